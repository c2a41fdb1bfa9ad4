"""bench.py: side-by-side measurements on this machine, for the comparisons of BOOST (arXiv 2512.12131) §7.

    python bench.py archs    # full vs svd vs CoLA at one width: tokens/s and val loss after the same steps
    python bench.py traffic  # TP traffic per layer of the three layouts: formula vs the ledger's count
    python bench.py tp       # ms/iteration and TP MB/iteration of the three layouts at --tp (torchrun)
    python bench.py recompute  # Table 3: activation memory saved per ms of recompute, layer vs lowrank

Each prints a markdown table and writes bench-<name>.json. Each comparison is measured in one run,
one configuration after the other, since these machines are noisy. Extra `--key=value` arguments
go to train.py (model size and so on); `--iters=N` sets the iterations per configuration.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PY = sys.executable


def per_layer_volume(layout, cfg):
    """TP elements per token per layer (forward, backward), from the layouts' docstrings (parallel.py)."""
    d, f, kv, ra, rm = cfg.n_embd, cfg.mlp_width, cfg.kv_dim, cfg.attn_rank, cfg.mlp_rank
    return {"btp": ((3 * ra + 1) + ra + (2 * rm + 1) + rm, 3 * ra + ra + 2 * rm + rm),
            "vanilla": (d + 2 * kv + d + 2 * f + d, 3 * d + d + 2 * d + f),
            "megatron": (2 * d, 2 * d)}[layout]


def train_run(nproc, args, out_dir):
    """train.py (under torchrun when nproc > 1); returns its metrics records."""
    launcher = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else [PY]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if nproc > 1 else "2")}
    res = subprocess.run([*launcher, str(ROOT / "train.py"), f"--out_dir={out_dir}", "--sample_tokens=0",
                          "--log_interval=1", *args], capture_output=True, text=True, env=env, timeout=3600)
    if res.returncode:
        sys.exit(f"train.py {' '.join(args)} failed:\n{res.stderr[-2000:]}")
    return [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]


def steady(records, key):
    """Median of `key` over the training records, the first 3 (warm-up) left out."""
    values = [r[key] for r in records if "loss" in r][3:]
    return statistics.median(values)


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def bench_archs(iters, extra):
    rows, out = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("full", "svd", "cola"):
            rec = train_run(1, [f"--arch={arch}", f"--max_iters={iters}", f"--eval_interval={iters}", *extra],
                            f"{tmp}/{arch}")
            out[arch] = {"tokens_per_s": steady(rec, "tokens_per_s"), "ms": steady(rec, "ms"),
                         "val_loss": rec[-1]["val_loss"]}
            rows.append([arch, f"{out[arch]['ms']:.1f}", f"{out[arch]['tokens_per_s']:,.0f}", f"{out[arch]['val_loss']:.3f}"])
    return table(["arch", "ms/iter", "tokens/s", f"val loss after {iters} iters"], rows), out


def bench_tp(iters, extra, tp):
    rows, out = [], {}
    cases = [("full", "megatron"), ("cola", "vanilla"), ("cola", "btp"), ("svd", "btp")]
    with tempfile.TemporaryDirectory() as tmp:
        for arch, layout in cases:
            key = f"{arch}/{layout}"
            one = train_run(1, [f"--arch={arch}", f"--max_iters={iters}", "--eval_interval=100000", *extra], f"{tmp}/{key}-1")
            rec = train_run(tp, [f"--arch={arch}", f"--tp={tp}", f"--tp_mode={layout}", f"--max_iters={iters}",
                                 "--eval_interval=100000", *extra], f"{tmp}/{key}-tp")
            out[key] = {"ms_tp1": steady(one, "ms"), "ms": steady(rec, "ms"), "tp_mb": [r for r in rec if "loss" in r][-1]["tp_bytes"] / 1e6}
            rows.append([key, f"{out[key]['ms_tp1']:.1f}", f"{out[key]['ms']:.1f}", f"{out[key]['tp_mb']:.2f}"])
    return table(["arch/layout", "ms/iter, 1 process", f"ms/iter, tp={tp}", "TP MB/iter"], rows), out


def _traffic_worker(rank, world, store, cfg_kwargs, result):
    import torch
    import torch.distributed as dist
    import layouts
    import parallel
    from model import Config, Llama
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(store, world))
    env = parallel.TP(dist.group.WORLD, rank, world)
    parallel.LEDGER.name(dist.group.WORLD, "tp")
    out, b, s = {}, 2, 32
    for arch, layout in (("full", "megatron"), ("cola", "vanilla"), ("cola", "btp")):
        totals = []
        for n_layer in (1, 2):
            cfg = Config(**{**cfg_kwargs, "arch": arch, "n_layer": n_layer, "block_size": s})
            model = layouts.TPLlama(Llama(cfg), env, layout)
            idx = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
            parallel.LEDGER.reset()
            model(idx, idx)[1].backward()
            totals.append([parallel.LEDGER.total("tp", phase) for phase in ("fwd", "bwd")])
        out[layout] = {"measured": [(totals[1][i] - totals[0][i]) / (b * s) for i in range(2)],
                       "formula": per_layer_volume(layout, cfg)}
    if rank == 0:
        Path(result).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def _recompute_worker(rank, world, store, cfg_kwargs, batch, iters, result):
    import time
    import torch
    import torch.distributed as dist
    import layouts
    import parallel
    from checkpointing import RECOMPUTE, SavedBytes
    from model import Config, Llama
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(store, world))
    env = parallel.TP(dist.group.WORLD, rank, world)
    cfg = Config(**cfg_kwargs)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=torch.Generator().manual_seed(0))
    models = {}
    for mode in RECOMPUTE:
        torch.manual_seed(0)
        models[mode] = layouts.TPLlama(Llama(cfg, recompute=mode), env, "btp" if cfg.lowrank else "megatron")
    out = {mode: {"ms": []} for mode in RECOMPUTE}
    for mode, model in models.items():
        with SavedBytes(model) as meter:
            model(idx, idx)[1].backward()
        out[mode]["saved_mb"] = meter.bytes / 1e6
    for i in range(iters + 2):          # interleaved, so that drifts of the machine hit every mode alike
        for mode, model in models.items():
            dist.barrier()
            t0 = time.perf_counter()
            model(idx, idx)[1].backward()
            dist.barrier()
            if i >= 2:
                out[mode]["ms"].append(1000 * (time.perf_counter() - t0))
    if rank == 0:
        Path(result).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def bench_recompute(iters, extra, tp):
    import torch.multiprocessing as mp
    import train
    cfg, tc = train.parse_args(extra)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_recompute_worker, args=(tp, f"{tmp}/store", cfg.shape(), tc.batch_size, iters,
                                                   f"{tmp}/out.json"), nprocs=tp, start_method="spawn")
        out = json.loads(Path(f"{tmp}/out.json").read_text())
    base_ms = statistics.median(out["none"]["ms"])
    rows = []
    for mode, r in out.items():
        r["ms"] = statistics.median(r["ms"])
        saved, extra_ms = out["none"]["saved_mb"] - r["saved_mb"], r["ms"] - base_ms
        r.update(saved_vs_none_mb=saved, extra_ms=extra_ms)
        rows.append([mode, f"{r['saved_mb']:.1f}", f"{saved:.1f}", f"{r['ms']:.1f}", f"{extra_ms:+.1f}",
                     f"{saved / extra_ms:.2f}" if mode != "none" and extra_ms > 0 else "-"])
    title = (f"arch={cfg.arch}, btp, tp={tp}, n_layer={cfg.n_layer}, d={cfg.n_embd}, r={cfg.attn_rank}, "
             f"batch {tc.batch_size} x {cfg.block_size} tokens, per rank, fp32")
    return title + "\n\n" + table(["recompute", "saved MB", "MB less than none", "ms/iter (fwd+bwd)",
                                    "extra ms", "MB saved per ms"], rows), out


def bench_traffic(extra, tp):
    import torch.multiprocessing as mp
    from model import Config
    import train
    cfg, _ = train.parse_args(extra)
    kwargs = {k: v for k, v in cfg.shape().items()}
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_traffic_worker, args=(tp, f"{tmp}/store", kwargs, f"{tmp}/out.json"), nprocs=tp,
                           start_method="spawn")
        out = json.loads(Path(f"{tmp}/out.json").read_text())
    cfg = Config(**kwargs)
    rows = [[layout, *out[layout]["formula"], *[f"{m:g}" for m in out[layout]["measured"]],
             f"{out[layout]['formula'][0] / out['btp']['formula'][0]:.2f}"] for layout in out]
    title = f"d={cfg.n_embd}, d_ff={cfg.mlp_width}, kv={cfg.kv_dim}, r={cfg.attn_rank}/{cfg.mlp_rank}, tp={tp}"
    return title + "\n\n" + table(["layout", "fwd formula", "bwd formula", "fwd measured", "bwd measured",
                                   "fwd vs btp"], rows), out


def main(argv):
    if not argv or argv[0] not in ("archs", "traffic", "tp", "recompute"):
        sys.exit(__doc__)
    what, iters, tp, extra = argv[0], 300, 2, []
    for arg in argv[1:]:
        if arg.startswith("--iters="):
            iters = int(arg.split("=", 1)[1])
        elif arg.startswith("--tp="):
            tp = int(arg.split("=", 1)[1])
        else:
            extra.append(arg)
    if what == "archs":
        text, out = bench_archs(iters, extra)
    elif what == "tp":
        text, out = bench_tp(iters, extra, tp)
    elif what == "recompute":
        text, out = bench_recompute(iters, extra, tp)
    else:
        text, out = bench_traffic(extra, tp)
    print(text)
    Path(f"bench-{what}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
