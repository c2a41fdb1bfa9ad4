"""bench_common.py: what the benches of tools/bench.py share: train.py runs under torchrun, spawned
worker groups, the steady-state median of a metric, a config file's place among the arguments,
markdown tables.

Not in the BOOST paper (arXiv 2512.12131); the measuring harness of its §7 comparisons here.
"""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def train_run(nproc, args, out_dir):
    """train.py (under torchrun when nproc > 1); returns its metrics records."""
    launcher = [PY, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc}"] if nproc > 1 else [PY]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS",
                                                           "1" if nproc > 1 else "2")}
    args = shape_args(args, [])   # a config file first
    res = subprocess.run([*launcher, str(ROOT / "train.py"), *args[:1], f"--out_dir={out_dir}",
                          "--sample_tokens=0",
                          "--log_interval=1", *args[1:]], capture_output=True, text=True, env=env,
                         timeout=3600)
    if res.returncode:
        sys.exit(f"train.py {' '.join(args)} failed:\n{res.stderr[-2000:]}")
    records = [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]
    return [r for r in records if "event" not in r]


def need_matplotlib(what):
    """Exit 2 in one line before any work where matplotlib, which `what` draws with, is missing."""
    from plumbing.tokenizer import need
    try:
        need("matplotlib", what)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def spawned(worker, world, *args):
    """worker(rank, world, store, *args, result) in `world` spawned processes (gloo over a file
    store in a temporary folder); what the worker wrote to `result`, read as JSON."""
    import tempfile
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(world, f"{tmp}/store", *args, f"{tmp}/out.json"),
                           nprocs=world, start_method="spawn")
        return json.loads(Path(f"{tmp}/out.json").read_text())


def steady(records, key):
    """Median of `key` over the training records, the first 3 (warm-up) left out where there are
    more."""
    values = [r[key] for r in records if "loss" in r]
    return statistics.median(values[3:] or values)   # (a short run: all of them)


def shape_args(extra, default):
    """train.py's arguments for a bench: a config file among `extra` (configs/*.toml) replaces the
    bench's default shape and goes first; the other options follow."""
    files = [a for a in extra if a.endswith(".toml")]
    return files + [a for a in extra if not a.endswith(".toml")] if files else [*default, *extra]


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
