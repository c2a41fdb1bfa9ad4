"""bench_schedules.py: `python tools/bench.py schedules`: the pipeline schedules (pipeline.py, the
pp dimension of BOOST's 3D layouts, arXiv 2512.12131 §6) side by side on this machine: at pp=2, 4
with 4 and 8 micro-batches, each schedule's step time and the share of it each rank sat idle,
measured (1 − the seconds its actions computed, Pipeline.time_actions, / the step), beside the
share its own action order leaves idle as schedule_sim models it (a forward 1, a backward 2,
its halves 1 each, sends free) and the textbook 1F1B bubble (p−1)/(m+p−1). CoLA under BTP at a TP
group of one, d=256, 8 layers (a stage of one layer at pp=4 with two stages a rank), 2 sequences of
128 byte tokens a micro-batch, one thread a rank. Each round is a fresh group of pp processes
running every schedule in turn (the order rotated each round), 1 step to warm up and `--iters`
timed (default 3); the figures are medians over `--rounds` rounds (default 3); `--pp=2` or
`--pp=4` runs one degree (anything else: one error line). At pp=4 this
2-core machine runs 4 processes: a waiting rank lends its core, so the measured shares there are
the machine's as much as the schedule's.
"""
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the core files: the root

# (schedule, stages a rank)
SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2),
             ("dualpipev", 2)]
SHAPE = dict(arch="cola", n_layer=8, n_head=8, n_kv_head=4, n_embd=256, block_size=128,
             vocab_size=256, attn_rank=64, mlp_rank=64)
MICRO = 2   # sequences a micro-batch


def cases(pp):
    """(schedule, stages a rank, micro-batches) run at pp: a V needs m >= 2pp (plan.py's checks)."""
    return [(k, v, m) for m in (4, 8) for k, v in SCHEDULES
            if not (k in ("zbv", "dualpipev") and m < 2 * pp)]


def _worker(rank, world, store, todo, iters, result):
    import torch
    import torch.distributed as dist
    from tp_model import TPLlama
    import parallel
    from extensions import pipeline
    from model import Config, Llama
    from plumbing import placement
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(store, world))
    mesh = placement.init_mesh(1, 1, "cpu", 600, world)
    tp = parallel.TPGroup(mesh.get_group("tp"), 0, 1)
    out = {}
    for schedule, virtual, m in todo:
        torch.manual_seed(0)
        ref = Llama(Config(**SHAPE))
        held = pipeline.stages_of(rank, world, virtual, schedule)
        model = TPLlama(ref, tp, "btp", stage=held, stages=world * len(held))
        pipe = pipeline.Pipeline(model, mesh, m, schedule, "cpu")
        x = torch.randint(0, 256, (m * MICRO, 128), generator=torch.Generator().manual_seed(1))
        pipe.run(x, x)                                    # (warm-up: shapes inferred)
        pipe.time_actions()
        steps = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            pipe.run(x, x)
            steps.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        busy = sum(pipe.busy.values()) / iters
        out[f"{schedule}|{virtual}|{m}"] = {"step": statistics.median(steps), "busy": busy}
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        Path(result).write_text(json.dumps(gathered))
    placement.exit_worker(world)


def measure(pp, iters, rounds):
    """{(schedule, v, m): {ms, idle (per rank)}}: medians over rounds of fresh pp-process groups."""
    from bench_common import spawned
    todo, per = cases(pp), {}
    for r in range(rounds):
        turn = todo[r % len(todo):] + todo[:r % len(todo)]   # (rotated: drift hits all alike)
        ranks = spawned(_worker, pp, turn, iters)
        for key in ranks[0]:
            step = max(rk[key]["step"] for rk in ranks)   # (the step ends with the last rank)
            per.setdefault(key, []).append((step, [1 - rk[key]["busy"] / step for rk in ranks]))
    return {key: {"ms": 1000 * statistics.median(s for s, _ in got),
                  "idle": [statistics.median(i[r] for _, i in got) for r in range(pp)]}
            for key, got in per.items()}


def bench(iters, extra, rounds):
    """(markdown, results) of every schedule at pp=2 and 4 with 4 and 8 micro-batches."""
    from extensions import schedule_sim
    from bench_common import table
    pps = [a.split("=", 1)[1] for a in extra if a.startswith("--pp=")] or ["2", "4"]
    if any(p not in ("2", "4") for p in pps) or any(not a.startswith("--pp=") for a in extra):
        print(f"error: {' '.join(extra)}: this bench takes --pp=2 or --pp=4 (its 8 layers, two "
              "stages a rank), --iters and --rounds", file=sys.stderr)
        sys.exit(2)
    pps = [int(p) for p in pps]
    rows, out = [], {}
    for pp in pps:
        for key, r in measure(pp, iters, rounds).items():
            schedule, v, m = key.split("|")
            v, m = int(v), int(m)
            model = schedule_sim.idle(schedule_sim.timeline(schedule_sim.order(schedule, pp, m, v)))
            out[f"pp={pp} {key}"] = {**r, "modelled": list(model.values())}
            rows.append([pp, m, schedule, v, f"{r['ms']:.0f}",
                         f"{statistics.fmean(r['idle']):.2f} (" +
                         " ".join(f"{i:.2f}" for i in r["idle"]) + ")",
                         f"{statistics.fmean(model.values()):.2f}",
                         f"{(pp - 1) / (m + pp - 1):.2f}"])
    return table(["pp", "micro-batches", "schedule", "stages a rank", "ms/step",
                  "idle share, measured: mean (each rank)", "idle share, modelled",
                  "textbook 1F1B bubble"], rows), out
