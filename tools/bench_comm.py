"""bench_comm.py: `python tools/bench.py comm`: how much of a TP step is exposed communication, per
layout.

BOOST (arXiv 2512.12131) §2-4 and §7: BTP moves fewer bytes than Megatron TP but issues more
collectives. Each layout (megatron for the dense model, vanilla and btp for CoLA) is timed three
ways, interleaved step by step in the same processes:

  plain     the collectives run synchronously, as the paper describes them (--overlap=false)
  overlap   backward's all-reduces run asynchronously beside the weight-gradient GEMMs
            (parallel.CopyUp, --overlap=true)
  no comm   every collective skipped (parallel.NO_COMM): the same computation with no communication,
            a lower bound. ITS LOSSES AND GRADIENTS ARE WRONG ON PURPOSE; only bench.py sets it.

exposed = (step - no comm) / step. Run at TP 2 and 4 and as pp x tp = 2 x 2 (two pipeline stages
through torch.distributed.pipelining, 2 micro-batches).
"""
import json
import statistics
import sys
from pathlib import Path

# the core files live at the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = (("full", "megatron"), ("cola", "vanilla"), ("cola", "btp"))
MODES = ("plain", "overlap", "no comm")


def _worker(rank, world, store, pp, cfg_kwargs, batch, iters, result):
    import time
    import torch
    import torch.distributed as dist
    from tp_model import TPLlama
    import parallel
    from extensions import pipeline
    from plumbing import placement
    from model import Config, Llama
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(store, world))
    tp = world // pp
    mesh = placement.init_mesh(1, tp, "cpu", 600, pp)
    pp_rank = mesh.get_local_rank("pp")
    idx = torch.randint(0, 256, (batch, cfg_kwargs["block_size"]),
                        generator=torch.Generator().manual_seed(0))
    runs = {}
    for arch, layout in CASES:
        for mode in MODES:
            tp_handle = parallel.TPGroup(mesh.get_group("tp"), mesh.get_local_rank("tp"), tp,
                                         overlap=mode == "overlap")
            torch.manual_seed(0)
            model = TPLlama(Llama(Config(**{**cfg_kwargs, "arch": arch,
                                                    "mlp_gate": "auto"})), tp_handle, layout,
                                    stage=pp_rank, stages=pp)
            pipe = pipeline.Pipeline(model, mesh, 2, "1f1b", "cpu") if pp > 1 else None
            runs[(f"{arch}/{layout}", mode)] = (model, pipe,
                                                torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(key):
        model, pipe, opt = runs[key]
        parallel.NO_COMM = key[1] == "no comm"
        if pipe:
            pipe.run(idx, idx)
        else:
            model(idx, idx)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        parallel.NO_COMM = False

    out = {f"{name}|{mode}": [] for name, mode in runs}
    for key in runs:          # warm-up
        step(key)
    for _ in range(iters):
        for key in runs:
            dist.barrier()
            t0 = time.perf_counter()
            step(key)
            dist.barrier()
            out[f"{key[0]}|{key[1]}"].append(1000 * (time.perf_counter() - t0))
    for key in runs:          # one profiled step each: the time spent inside the collectives
        with torch.profiler.profile() as prof:
            step(key)
        out[f"{key[0]}|{key[1]}|in collectives"] = sum(
            e.cpu_time_total for e in prof.key_averages()
            if e.key.split(" ")[0] in ("all_reduce", "all_gather", "wait")) / 1000
    if rank == 0:
        Path(result).write_text(json.dumps(out))
    placement.exit_worker(world)


def _probe_worker(rank, world, store, tokens, width, result):
    """Can this machine overlap a gloo all-reduce with computation? One all-reduce of a BTP latent
    (tokens x width fp32), one GEMM of similar time, both in sequence, and both at once."""
    import time
    import torch
    import torch.distributed as dist
    from plumbing import placement
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(store, world))
    x, a, b = torch.randn(tokens, width), torch.randn(tokens, 512), torch.randn(512, width // 2)

    def overlapped():
        work = dist.all_reduce(x, async_op=True)
        a @ b
        work.wait()
    ways = {"all-reduce": lambda: dist.all_reduce(x), "GEMM": lambda: a @ b,
            "all-reduce then GEMM": lambda: (dist.all_reduce(x), a @ b),
            "both at once (async)": overlapped}
    out = {name: [] for name in ways}
    for i in range(40):
        for name, fn in ways.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if i >= 5:
                out[name].append(1000 * (time.perf_counter() - t0))
    if rank == 0:
        Path(result).write_text(json.dumps({k: statistics.median(v) for k, v in out.items()}))
    placement.exit_worker(world)


def probe(tokens, width):
    from bench_common import spawned
    return spawned(_probe_worker, 2, tokens, width)


def measure(pp, tp, cfg, batch, iters):
    """{(layout, mode): median ms/step} for one (pp, tp)."""
    from bench_common import spawned
    out = spawned(_worker, pp * tp, pp, cfg.shape(), batch, iters)
    return {tuple(k.split("|")): v if "in collectives" in k else statistics.median(v)
            for k, v in out.items()}


def bench_comm(iters, cfg, batch, shapes=((1, 2), (1, 4), (2, 2))):
    """The table: per (pp, tp) and layout, ms/step plain, with overlap and without communication;
    then the probe of whether this machine can overlap at all."""
    rows, out = [], {}
    for pp, tp in shapes:
        res = measure(pp, tp, cfg, batch, iters)
        out[f"pp={pp} tp={tp}"] = {" ".join(k): v for k, v in res.items()}
        btp_best = min(res[("cola/btp", m)] for m in MODES[:2])
        for arch, layout in CASES:
            name = f"{arch}/{layout}"
            plain, overlap, bound = (res[(name, m)] for m in MODES)
            inside = [res[(name, m, "in collectives")] for m in MODES[:2]]
            rows.append([f"{pp} x {tp}", name, f"{plain:.0f}", f"{overlap:.0f}", f"{bound:.0f}",
                         f"{(plain - bound) / plain:.0%}", f"{(overlap - bound) / overlap:.0%}",
                         f"{inside[0]:.0f} / {inside[1]:.0f}",
                         f"{min(plain, overlap) / btp_best:.2f}"])
    header = ["pp x tp", "layout", "plain ms", "overlap ms", "no comm ms (wrong on purpose)",
              "exposed plain",
              "exposed overlap", "ms inside collectives, plain / overlap (rank 0, one step)",
              "best vs btp's best"]
    tokens, width = batch * cfg.block_size, 3 * cfg.attn_rank + 1
    out["probe"] = probe(tokens, width)
    probe_rows = [[name, f"{ms:.2f}"] for name, ms in out["probe"].items()]
    return header, rows, ("Can two processes on this machine overlap a gloo all-reduce with "
                          f"computation? (an all-reduce of {tokens} x {width} fp32, the BTP q/k/v "
                          "latent; median ms)"), \
        ["way", "ms"], probe_rows, out
