"""bench.py: side-by-side measurements on this machine, for the comparisons of BOOST (arXiv
2512.12131) §7.

    python tools/bench.py archs    # full vs svd vs CoLA at one width: tokens/s, val loss
    python tools/bench.py traffic  # TP traffic per layer of the layouts: formula vs the ledger
    python tools/bench.py layouts  # tp 1, 2, 4: the layouts side by side, then the ablations
                                   # (norm, grouping, recompute)
    python tools/bench.py comm     # exposed communication: each layout plain, with --overlap
                                   # and with no communication
    python tools/bench.py pp       # pipeline stages: step time, boundary volume, pp=1 vs pp=2
    python tools/bench.py schedules  # each pipeline schedule: ms/step, idle share (bench_schedules)
    python tools/bench.py model    # the cluster-scale cost model against the paper's table
                                   # (costmodel.py)
    python tools/bench.py data     # preparing a generated corpus of --mb=1024 MB in six forms
                                   # (txt, jsonl, .gz, .zst, parquet, mixed), --rounds=3: MB/s,
                                   # tokens/s, memory (bench_data.py)
    python tools/bench.py checkpoint  # what the checksums of a 3.7 GB training checkpoint cost
    python tools/bench.py dp_shard  # DDP vs FSDP2 (--dp_shard=grad, full) at dp=2: ms, peak
                                    # memory (bench_dp_shard.py)
    python tools/bench.py startup  # a rank's build: boost_1b measured (whole then cut vs the
                                   # meta device), the papers' 7B-30B predicted (bench_startup.py)
    python tools/bench.py optim    # AdamW vs Muon, cola and full: ms per train.py iteration
                                   # and of the optimizer step alone (bench_optim.py)
    python tools/bench.py quality  # time to the dense model's val loss, CoLA under BTP against
                                   # dense under Megatron at tp=2, --seeds=3 (bench_quality.py)
    python tools/bench.py arms     # {dense, CoLA} x {AdamW, Muon}, swept alike (bench_arms.py)
    python tools/bench.py threads  # make train's model at 1, 2 and train.py's chosen threads,
                                   # idle and beside two busy processes (bench_threads.py)
    python tools/bench.py gpu      # one GPU, < 5 min: the kernels at BOOST's 1B/7B TP=4 slices,
                                   # Triton vs PyTorch, a 1B step per arch, eager, compiled,
                                   # captured (bench_gpu.py)

Each prints a markdown table and writes <json_dir>/bench-<name>.json (`--json_dir=DIR`, default
bench-results/, which git ignores). Each comparison is measured in one run, the configurations
interleaved step by step, since these machines are noisy. Extra `--key=value` arguments set the
model as in train.py (a config file such as configs/boost_test.toml replaces a bench's default
shape); `--iters=N` the timed steps per configuration; `--tp=2,4` the TP degrees of
`layouts`; `--mb=N` the size of `data`'s corpus and `--keep=DIR` where to keep it (default: a
temporary folder). `python tools/bench.py -h` prints this.
"""
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

# the core files live at the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import ROOT, shape_args, steady, table, train_run  # noqa: E402


def bench_archs(iters, extra):
    rows, out = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("full", "svd", "cola"):
            rec = train_run(1, [f"--arch={arch}", f"--max_iters={iters}",
                                f"--eval_interval={iters}", *extra],
                            f"{tmp}/{arch}")
            out[arch] = {"tokens_per_s": steady(rec, "tokens_per_s"), "ms": steady(rec, "ms"),
                         "val_loss": rec[-1]["val_loss"]}
            rows.append([arch, f"{out[arch]['ms']:.1f}", f"{out[arch]['tokens_per_s']:,.0f}",
                         f"{out[arch]['val_loss']:.3f}"])
    return table(["arch", "ms/iter", "tokens/s", f"val loss after {iters} iters"], rows), out


def bench_pp(iters, extra):
    """Pipeline stages on this machine: step time and stage-boundary volume, pp=1 vs pp=2 under
    each schedule (4 micro-batches of 2)."""
    rows, out = [], {}
    args = ["--n_layer=4", "--batch_size=2", "--gradient_accumulation_steps=4",
            f"--max_iters={iters}",
            "--eval_interval=100000", *extra]
    with tempfile.TemporaryDirectory() as tmp:
        for name, nproc, layout in (("pp=1", 1, []), ("pp=2", 2, ["--pp=2"]),
                                    *((f"pp=2 {k}", 2, ["--pp=2", f"--pp_schedule={k}"])
                                      for k in ("gpipe", "interleaved_1f1b", "zero_bubble")),
                                    ("pp=2 x tp=2", 4, ["--pp=2", "--tp=2"])):
            rec = train_run(nproc, [*args, *layout], f"{tmp}/{len(out)}")   # (a folder each)
            last = [r for r in rec if "loss" in r][-1]
            out[name] = {"ms": steady(rec, "ms"), "pp_mb": last["pp_bytes"] / 1e6,
                         "tp_mb": last["tp_bytes"] / 1e6,
                         "loss": last["loss"]}
            rows.append([name, nproc, f"{out[name]['ms']:.1f}", f"{out[name]['pp_mb']:.2f}",
                         f"{out[name]['tp_mb']:.2f}",
                         f"{out[name]['loss']:.4f}"])
    return table(["layout", "processes", "ms/iter", "p2p MB/iter (rank 0)", "TP MB/iter (rank 0)",
                  f"loss at iter {iters - 1}"], rows), out


VARIANTS = {  # name: (arch, layout or None for model.Llama, recompute, ablations.ablated's options)
    "full": ("full", None, "none", {}), "svd": ("svd", None, "none", {}),
            "cola": ("cola", None, "none", {}),
    "full/megatron, a TP group of one": ("full", "megatron", "none", {}),
    "svd/btp, a TP group of one": ("svd", "btp", "none", {}),
    "full/megatron": ("full", "megatron", "none", {}),
            "cola/vanilla": ("cola", "vanilla", "none", {}),
    "svd/btp": ("svd", "btp", "none", {}), "cola/btp": ("cola", "btp", "none", {}),
    "cola/btp, a TP group of one": ("cola", "btp", "none", {}),
    "cola/btp separate norm all-reduce": ("cola", "btp", "none", {"online_norm": False}),
    "cola/btp ungrouped projections": ("cola", "btp", "none", {"grouped": False}),
    "cola/btp recompute=layer": ("cola", "btp", "layer", {}),
    "cola/btp recompute=lowrank": ("cola", "btp", "lowrank", {}),
    "cola/vanilla recompute=lowrank": ("cola", "vanilla", "lowrank", {}),
}


def _measure_worker(rank, world, store, names, cfg_kwargs, batch, iters, result):
    """Time fwd + bwd + AdamW of each variant, interleaved (a drift of the machine hits all alike);
    count its TP traffic with the ledger and its saved activations with SavedBytes."""
    import time
    import torch
    import torch.distributed as dist
    import ablations
    from tp_model import TPLlama
    import parallel
    from plumbing import placement
    from plumbing.recorder import SavedBytes
    from model import Config, Llama
    torch.set_num_threads(1 if world > 1 else 2)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(store, world))
    tp = parallel.TPGroup(dist.group.WORLD, rank, world)
    parallel.LEDGER.name(dist.group.WORLD, "tp")
    runs, out = {}, {}
    for name in names:
        arch, layout, recompute, options = VARIANTS[name]
        torch.manual_seed(0)
        model = Llama(Config(**{**cfg_kwargs, "arch": arch, "mlp_gate": "auto"}))
        if layout:   # (None: the single-device reference, model.Llama itself)
            block = ablations.ablated(**options) if options else None
            model = TPLlama(model, tp, layout, recompute=recompute, block=block)
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    idx = torch.randint(0, 256, (batch, cfg_kwargs["block_size"]),
                        generator=torch.Generator().manual_seed(0))

    def step(name):
        model, opt = runs[name]
        model(idx, idx)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for name, (model, _) in runs.items():
        with SavedBytes(model) as meter:
            loss = model(idx, idx)[1]
        loss.backward()
        parallel.LEDGER.reset()
        step(name)
        out[name] = {"saved_mb": meter.bytes / 1e6, "tp_elements": parallel.LEDGER.total("tp"),
                     "tp_mb": parallel.LEDGER.total("tp", unit="bytes") / 1e6,
                     "tp_calls": parallel.LEDGER.total("tp", unit="calls"), "ms": []}
    for _ in range(iters):
        for name in runs:
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            step(name)
            if world > 1:
                dist.barrier()
            out[name]["ms"].append(1000 * (time.perf_counter() - t0))
    if rank == 0:
        Path(result).write_text(json.dumps(out))
    placement.exit_worker(world)


def measure(world, names, cfg, batch, iters):
    """Run _measure_worker in `world` processes; {variant: results} with the median ms."""
    from bench_common import spawned
    out = spawned(_measure_worker, world, names, cfg.shape(), batch, iters)
    for r in out.values():
        r["ms"] = statistics.median(r["ms"]) if r["ms"] else None   # (iters=0: the counts alone)
    return out


def bench_layouts(iters, extra, tps):
    """The paper's comparison on this machine: the layouts at each TP degree, then the ablations."""
    from plumbing import options
    cfg, tc = options.parse_args(shape_args(extra,
                                            ["--n_embd=256", "--n_layer=4", "--block_size=256",
                                             "--batch_size=8"]))
    tokens = tc.batch_size * cfg.block_size
    rows, out = [], {}
    for tp in tps:
        names = ["full", "svd", "cola", *[n for n in VARIANTS
                                          if "group of one" in n]] if tp == 1 else \
            ["full/megatron", "cola/vanilla", "svd/btp", "cola/btp"] + \
            ([n for n in VARIANTS if " " in n and "group of one" not in n] if tp == tps[-1]
             or tp == 2 else [])
        out[tp] = measure(tp, names, cfg, tc.batch_size, iters)
        base = out[tp].get("cola/btp", out[tp].get("cola"))
        for name, r in out[tp].items():
            rows.append([tp, name, f"{r['ms']:.1f}", f"{tokens / r['ms'] * 1000:,.0f}",
                         r["tp_calls"],
                         f"{r['tp_elements']:,}", f"{r['tp_mb']:.2f}", f"{r['saved_mb']:.1f}",
                         f"{r['ms'] / base['ms']:.2f}"])
    table3 = []  # the paper's Table 3: activation memory saved per ms of recompute
    for tp, res in out.items():
        for name, r in res.items():
            base = res.get(name.split(" recompute=")[0])
            if " recompute=" in name and base:
                saved, extra = base["saved_mb"] - r["saved_mb"], r["ms"] - base["ms"]
                table3.append([tp, name, f"{saved:.1f}", f"{extra:+.1f}",
                               f"{saved / extra:.2f}" if extra > 0 else "-"])
    title = (f"n_layer={cfg.n_layer}, d={cfg.n_embd}, d_ff={cfg.mlp_width}, r={cfg.attn_rank}, "
             f"heads={cfg.n_head}, "
             f"{tc.batch_size} x {cfg.block_size} tokens per step, fp32, one process per TP rank"
             + (" (tp=4 oversubscribes the 2 cores of this machine)" if 4 in tps
                and os.cpu_count() < 4 else "")
             + (f"\nnote: {iters} timed step(s) a variant: the times below are noise at this "
                "count, rank no ablation on them (--iters=10 or more)" if iters < 10 else ""))
    return title + "\n\n" + table(["tp", "variant", "ms/step", "tokens/s", "TP collectives/step",
                                    "TP elements/step", "TP MB/step",
                                    "saved activations MB", "time vs cola/btp (or cola)"], rows) + \
        "\n\nRecompute (Table 3 of the paper)\n\n" + \
        table(["tp", "variant", "MB saved vs none", "extra ms/step", "MB saved per ms"],
              table3), out


def bench_comm(iters, extra):
    import bench_comm
    from plumbing import options
    cfg, tc = options.parse_args(shape_args(extra,
                                            ["--n_layer=4", "--n_embd=512", "--n_head=8",
                                             "--block_size=256",
                                                    "--batch_size=4"]))
    header, rows, probe_title, probe_header, probe_rows, out = \
        bench_comm.bench_comm(iters, cfg, tc.batch_size)
    title = (f"n_layer={cfg.n_layer}, d={cfg.n_embd}, r={cfg.attn_rank}, {tc.batch_size} x "
             f"{cfg.block_size} tokens per step, fp32, gloo, one process per rank with one "
             "thread; median ms of fwd + bwd + AdamW")
    probe = table(probe_header, probe_rows)
    return f"{title}\n\n{table(header, rows)}\n\n{probe_title}\n\n{probe}", out


def bench_checkpoint(extra):
    """The cost of a checkpoint's CRC-32s: save (which checksums), verify, and the checksums
    alone."""
    import torch
    from plumbing import options
    from plumbing import integrity
    from tp_model import TPLlama
    import parallel
    from plumbing import train_state
    from model import Llama
    cfg, _ = options.parse_args(shape_args(extra,
                                           ["--arch=full", "--n_layer=16", "--n_embd=1024",
                                            "--n_head=16"]))
    cfg.vocab_size = 50304
    # as a tp=1 run trains it
    model = TPLlama(Llama(cfg), parallel.TPGroup(None, 0, 1), "megatron")
    optimizer = torch.optim.AdamW(model.parameters())
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        t0 = time.time()
        path, size = train_state.save(tmp, 1, model, optimizer, None,
                                      {"config": cfg.shape(), "run_id": "bench"})
        t_save = time.time() - t0
        meta = json.loads(Path(path, "meta.json").read_text())
        t0 = time.time()
        assert integrity.verify(path, meta) is None
        t_verify = time.time() - t0
        t0 = time.time()
        for name in meta["files"]:
            integrity.crc32(Path(path, name))
        t_crc = time.time() - t0
    out = {"params": model.num_params(), "bytes": size, "save_s": t_save, "verify_s": t_verify,
           "crc32_s": t_crc}
    rows = [[f"{model.num_params() / 1e6:.0f}M", f"{size / 1e9:.2f}", f"{t_save:.1f}",
             f"{t_crc:.1f}", f"{size / 1e9 / t_crc:.2f}", f"{t_verify:.1f}"]]
    return ("A training checkpoint (dense model with its AdamW moments, one process)\n\n" +
            table(["parameters", "GB", "save s (with CRC-32s)", "CRC-32s alone s", "CRC-32 GB/s",
                   "verify s"], rows)), out


BENCHES = ("archs", "traffic", "layouts", "comm", "pp", "model", "data", "checkpoint", "gpu",
           "dp_shard", "startup", "optim", "quality", "arms", "threads", "schedules")


def rounds_of(extra, default):
    """--rounds=N of `data`, `dp_shard`, `startup` and `optim` (a usage error unless N >= 1)."""
    rounds = next((a.split("=", 1)[1] for a in extra if a.startswith("--rounds=")), str(default))
    if not rounds.isdigit() or int(rounds) < 1:
        usage_error(f"--rounds={rounds} must be a whole number of at least 1")
    return int(rounds)


def usage_error(msg):
    print(f"error: {msg} (python tools/bench.py -h)", file=sys.stderr)
    sys.exit(2)


def bench_help(what):
    """`bench.py SUB -h`: the docstring's lines of that bench and how to give options, nothing
    run."""
    lines = __doc__.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.startswith(f"    python tools/bench.py {what} "))
    end = start + 1
    while lines[end].lstrip().startswith("#"):   # the comment's continuation lines
        end += 1
    mine = lines[start:end]
    return "\n".join(["usage: python tools/bench.py " + what
                      + " [--iters=N] [--json_dir=DIR] [--key=value ...]", "",
                      *mine, "", *lines[lines.index(next(x for x in lines
                                                         if x.startswith("Each prints"))):]])


def bench_args(what, args):
    """(iters, tps, json_dir, mb, keep, the model's --key=value) of a bench's arguments: 30
    iterations for optim (10 are few after the warm-up), 3 for schedules, 10 for the others."""
    iters = {"optim": 30, "schedules": 3}.get(what, 10)
    tps, json_dir, mb, keep, extra = (1, 2, 4), ROOT / "bench-results", 1024, None, []
    try:
        for arg in args:
            key, _, value = arg.partition("=")
            if key == "--iters":
                iters = int(value)
            elif key == "--tp":
                tps = tuple(int(t) for t in value.split(","))
            elif key == "--json_dir":
                json_dir = Path(value)
            elif key == "--mb":
                mb = int(value)
            elif key == "--keep":
                keep = value
            else:
                extra.append(arg)
    except ValueError as e:
        usage_error(e)
    return iters, tps, json_dir, mb, keep, extra


def main(argv):
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    if not argv or argv[0] not in BENCHES:
        usage_error(f"name one of {', '.join(BENCHES)}")
    if "-h" in argv[1:] or "--help" in argv[1:]:
        print(bench_help(argv[0]))
        return
    # unwind, so temporary folders go on a kill too
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    what, (iters, tps, json_dir, mb, keep, extra) = argv[0], bench_args(argv[0], argv[1:])
    if what == "archs":
        text, out = bench_archs(iters, extra)
    elif what == "layouts":
        text, out = bench_layouts(iters, extra, tps)
    elif what == "comm":
        text, out = bench_comm(iters, extra)
    elif what == "pp":
        text, out = bench_pp(iters, extra)
    elif what == "traffic":
        import bench_traffic
        text, out = bench_traffic.bench_traffic(extra, 2 if tps == (1, 2, 4) else tps[0])
    elif what == "checkpoint":
        text, out = bench_checkpoint(extra)
    elif what == "gpu":
        import bench_gpu
        text, out = "", bench_gpu.from_cli(extra, json_dir)   # (printed row by row)
    elif what == "data":
        import bench_data
        try:
            title, header, rows, note, out = bench_data.bench_data(mb, keep, rounds_of(extra, 3))
        except ValueError as e:   # a missing package
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        text = f"{title}\n\n{table(header, rows)}\n\n{note}"
    elif what in ("quality", "arms"):
        bench = __import__(f"bench_{what}")
        sweep = any(a.startswith("--sweep") for a in extra)
        text, out = (bench.sweep if sweep else bench.bench)(extra)
    elif what == "threads":
        import bench_threads
        text, out = bench_threads.bench(iters if iters != 10 else 50, rounds_of(extra, 3))
    elif what == "startup":
        import bench_startup
        text, out = bench_startup.bench(rounds_of(extra, 2))
    elif what in ("dp_shard", "optim", "schedules"):
        bench = __import__(f"bench_{what}")
        text, out = bench.bench(iters, [a for a in extra if not a.startswith("--rounds=")],
                                rounds_of(extra, 2 if what == "dp_shard" else 3))
    else:
        import costmodel
        text, out = costmodel.report()
    print(text)
    json_dir.mkdir(parents=True, exist_ok=True)
    (json_dir / f"bench-{what}.json").write_text(json.dumps(out, indent=1))
    if what == "gpu":
        (json_dir / "bench-gpu.md").write_text("\n".join(out["lines"]) + "\n")
    print(f"\n(written to {json_dir / f'bench-{what}.json'})")


if __name__ == "__main__":
    main(sys.argv[1:])
