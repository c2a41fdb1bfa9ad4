"""bench_optim.py: `python tools/bench.py optim`: AdamW against Muon (muon.py) on CoLA and on the
dense model, on this machine: the milliseconds of a train.py iteration and of the optimizer step
alone. Not in the BOOST paper (arXiv 2512.12131); docs/muon.md's equal-wall-time comparison reads
these figures. Each of the four runs (cola and full, --optimizer=adamw and muon) is a fresh
train.py process of `--iters` iterations (default 30), `--rounds` times (default 3), the runs
interleaved; an iteration's figure is the median of its rounds' medians (train.py's ms, the first 3
left out). The optimizer step alone: one process, each model's parameters given fixed gradients,
the four optimizers' steps interleaved, `--iters` each, the median, with train.py's non-finite flag
set (found_inf = 0: Muon then masks each gradient and scales by a tensor, as in training); then
CoLA's Muon step alone at tp=2 under BTP by each path over TP (gram, gather, owner), two
processes, the paths interleaved, the median of `--iters` steps, beside the path `--muon_mode=auto`
takes and the costs it modelled (muon.step_cost). Extra
`--key=value` arguments set the model and batch as in train.py (the default run's shape without
them; `--n_embd=512 --n_head=8` for docs/muon.md's larger one).
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

# the core files live at the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = [(arch, opt) for arch in ("cola", "full") for opt in ("adamw", "muon")]


def step_alone(extra, iters):
    """{(arch, optimizer): median ms of optimizer.step()} on one process, interleaved."""
    import torch
    from extensions import muon
    from model import Llama
    from plumbing import options
    opts, models = {}, {}
    for arch, opt in CASES:
        cfg, tc = options.parse_args([*extra, f"--arch={arch}", f"--optimizer={opt}"])
        cfg.vocab_size = options.vocab_size(tc.tokenizer)
        torch.manual_seed(0)
        model = models.setdefault(arch, Llama(cfg))
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opts[(arch, opt)] = muon.configure(model, tc)
        opts[(arch, opt)].found_inf = torch.zeros(())   # (as train.py sets it every step)
    times = {case: [] for case in CASES}
    for i in range(iters + 2):   # (the first two: warm-up)
        for case in CASES:
            start = time.perf_counter()
            opts[case].step()
            if i >= 2:
                times[case].append((time.perf_counter() - start) * 1e3)
    return {case: statistics.median(t) for case, t in times.items()}


def _tp_worker(rank, world, store, extra, iters, result):
    """The Muon step alone at tp=2 under BTP by each path over TP, interleaved step by step."""
    import json
    import torch
    import torch.distributed as dist
    from tp_model import TPLlama
    from extensions import muon
    import parallel
    from model import Llama
    from plumbing import options, placement
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(store, world))
    tp = parallel.TPGroup(dist.group.WORLD, rank, world)
    cfg, tc = options.parse_args([*extra, "--arch=cola", "--optimizer=muon"])
    cfg.vocab_size = options.vocab_size(tc.tokenizer)
    torch.manual_seed(0)
    model = TPLlama(Llama(cfg), tp, "btp")
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opts = {mode: muon.configure(model, tc, mode) for mode in TP_MODES}
    for opt in opts.values():
        opt.found_inf = torch.zeros(())   # (as train.py sets it every step)
    times = {mode: [] for mode in TP_MODES}
    for i in range(iters + 2):   # (the first two: warm-up)
        for mode in TP_MODES:
            dist.barrier()
            start = time.perf_counter()
            opts[mode].step()
            dist.barrier()
            if i >= 2:
                times[mode].append((time.perf_counter() - start) * 1e3)
    if rank == 0:   # (and what auto would take, by muon.step_cost)
        said = muon.configure(model, tc).said
        Path(result).write_text(json.dumps({**{m: statistics.median(t) for m, t in times.items()},
                                            "auto": said}))
    placement.exit_worker(world)


TP_MODES = ("gram", "gather", "owner")


def tp_step(extra, iters):
    """{path: median ms of CoLA's Muon step alone at tp=2 under BTP} (two processes, one thread
    each, the paths interleaved)."""
    from bench_common import spawned
    return spawned(_tp_worker, 2, extra, iters)


def bench(iters, extra, rounds):
    from bench_common import steady, table, train_run
    runs = {case: [] for case in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for arch, opt in CASES:
                rec = train_run(1, [*extra, f"--arch={arch}", f"--optimizer={opt}",
                                    f"--max_iters={iters}", f"--eval_interval={10 * iters}",
                                    "--eval_iters=1"],
                                f"{tmp}/{arch}-{opt}-{r}")
                runs[(arch, opt)].append(steady(rec, "ms"))
                print(f"  round {r + 1}: {arch} {opt}: {runs[(arch, opt)][-1]:.1f} ms/iter",
                      flush=True)
    alone = step_alone(extra, iters)
    rows = [[arch, opt, f"{statistics.median(runs[(arch, opt)]):.1f}",
             " / ".join(f"{m:.1f}" for m in runs[(arch, opt)]), f"{alone[(arch, opt)]:.1f}"]
            for arch, opt in CASES]
    title = (f"AdamW vs Muon, {iters} iterations a run, {rounds} rounds interleaved"
             + (f" ({' '.join(extra)})" if extra else " (the default run's shape)"))
    out = {f"{arch} {opt}": {"ms_per_iter": runs[(arch, opt)], "optimizer_ms": alone[(arch, opt)]}
           for arch, opt in CASES}
    counted, at_tp2 = counts(), tp_step(extra, iters)
    out["collectives"], out["tp2_step_ms"] = counted, at_tp2
    return (title + "\n\n" + table(["arch", "optimizer", "ms / iteration (median)", "each round",
                                    "optimizer step alone, ms"], rows) +
            "\n\nMuon's collectives a step, BTP at tp=4, the papers' CoLA shapes (counted on the "
            "meta device):\n\n" + table(["shape", "mode", "matrices (pieces) a rank holds",
                                         "collectives before buckets", "after"], counted) +
            "\n\nCoLA's Muon step alone at tp=2 under BTP, by the path over TP (two processes, "
            "one thread each, interleaved, median ms):\n\n" +
            table(["path", "ms"], [[m, f"{at_tp2[m]:.1f}"] for m in TP_MODES]) +
            f"\n\nauto's choice (modelled): {at_tp2['auto']}"), out


def unbucketed(optimizer):
    """The collectives one Muon step issued before buckets: an all-gather per gathered piece, the
    Gram path's 1 + 5 all-reduces, an all-gather over dp per sharded matrix."""
    from extensions import muon
    total = 0
    for g in optimizer.param_groups:
        if g.get("muon"):
            pieces = [pc for pcs in g["pieces"].values() for pc in pcs]
            total += sum(pc.mode == "gather" for pc in pieces)
            total += (1 + muon.STEPS) * any(pc.mode == "gram" for pc in pieces)
    return total


def counts(shapes=("paper_1b", "paper_7b"), tp=4):
    """[[shape, mode, Muon's matrices (pieces) a rank holds, collectives a step before buckets,
    after]] of the papers' CoLA models under BTP at tp=4, built on the meta device (counts only)."""
    import torch
    from tp_model import TPLlama
    from extensions import muon
    import parallel
    from model import Llama
    from plumbing import options
    root = Path(__file__).resolve().parents[1]
    rows = []
    for shape in shapes:
        cfg, tc = options.parse_args([str(root / "configs" / f"{shape}.toml"), "--arch=cola",
                                      "--optimizer=muon", f"--tp={tp}", "--mlp_multiple_of=32"])
        cfg.vocab_size = 32000
        with torch.device("meta"):
            model = TPLlama(Llama(cfg), parallel.TPGroup(None, 0, tp), "btp")
        for mode in ("gram", "gather"):
            opt = muon.configure(model, tc, mode)
            pieces = sum(len(pcs) for g in opt.param_groups if g.get("muon")
                         for pcs in g["pieces"].values())
            rows.append([shape, mode, pieces, unbucketed(opt), muon.collectives(opt)])
    return rows
