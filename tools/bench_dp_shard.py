"""bench_dp_shard.py: `python tools/bench.py dp_shard`: DDP against FSDP2's two sharding modes
(dp_shard.py) at the same global batch, on this machine: step time, peak memory per rank, and what
the dp ranks send.

Not in the BOOST paper (arXiv 2512.12131), which leaves sharded data parallelism out of scope. Two
processes (dp=2) train the same model three ways, --dp_shard=none, grad and full, `--rounds` times
each (default 2), the modes interleaved; the table gives medians. A dense model by default
(d=512, 8 layers: 25M parameters, 400 MB of weights, gradients and AdamW moments at fp32), large
enough that the model's state shows beside the process's own few hundred MB; extra `--key=value`
arguments set the model and batch as in train.py.
"""
import statistics
import sys
import tempfile
from pathlib import Path

# the core files live at the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = ["--arch=full", "--n_embd=512", "--n_layer=8", "--n_head=8", "--block_size=128",
         "--batch_size=4",
         "--gradient_accumulation_steps=2"]


TINY = ["--n_layer=1", "--n_embd=64", "--n_head=4"]   # the baseline: the process without a model


def one_round(args, tmp, round_, runs):
    """Each mode once, with the model and with the tiny one (the peak above it is the model's)."""
    from bench_common import steady, train_run
    for mode in ("none", "grad", "full"):
        rec = train_run(2, [*args, f"--dp_shard={mode}"], f"{tmp}/{mode}-{round_}")
        tiny = train_run(2, [*args, *TINY, f"--dp_shard={mode}"], f"{tmp}/tiny-{mode}-{round_}")
        last = [r for r in rec if "loss" in r][-1]
        base = [r for r in tiny if "loss" in r][-1]["mem_gb"]
        runs.setdefault(mode, []).append({"ms": steady(rec, "ms"), "mem_gb": last["mem_gb"],
                                          "above_gb": last["mem_gb"] - base,
                                          "dp_mb": last["dp_bytes"] / 1e6, "loss": last["loss"]})
        print(f"  round {round_ + 1}: dp_shard={mode}: {runs[mode][-1]['ms']:.0f} ms, "
              f"{runs[mode][-1]['mem_gb']:.2f} GB ({runs[mode][-1]['above_gb']:.2f} above a tiny "
              "model's run)", flush=True)


def bench(iters, extra, rounds=2):
    """(markdown table, results) of the three modes. `--eval_interval=N` among `extra` puts
    checkpoints in the runs (their saves in the peak)."""
    from bench_common import shape_args, table
    args = [f"--max_iters={iters}", "--eval_interval=100000", *shape_args(extra, SHAPE)]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(rounds):
            one_round(args, tmp, round_, runs)
    out = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for mode, rs in runs.items()}
    ddp = out["none"]["above_gb"]
    rows = [[mode, f"{r['ms']:.1f}", f"{r['mem_gb']:.3f}",
             f"{r['above_gb']:.3f} ({r['above_gb'] / ddp:.2f}x)", f"{r['dp_mb']:.1f}",
             f"{r['loss']:.4f}"] for mode, r in out.items()]
    return table(["dp_shard", "ms/step", "peak memory per rank (GB, RSS)",
                  "above a tiny model's run (vs DDP)", "dp MB/step", f"loss at iter {iters - 1}"],
                 rows), out
