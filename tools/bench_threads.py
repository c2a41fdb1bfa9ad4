"""bench_threads.py: `python tools/bench.py threads`: make train's model at 1 and 2 CPU threads and
at train.py's own choice (--threads=0), on an idle machine and under a background load of two busy
processes the bench starts itself.

Not in the BOOST paper (arXiv 2512.12131): what a training step costs on a shared CPU. Each run is
a fresh train.py process (the default model, `--iters` iterations, default 50) with no
OMP_NUM_THREADS set, so --threads=0 chooses as a user's run does; the three thread settings
interleaved `--rounds` times (default 3) in each phase; a run's figure is train.py's median ms per
iteration (the first 3 left out), the table's the median over rounds. The loaded phase starts its
two busy processes (`while True: pass`) a few seconds before its first run.
"""
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from bench_common import PY, ROOT, steady

SETTINGS = ("1", "2", "0")   # --threads: one, two, train.py's choice


def run(threads, iters, out_dir):
    """(median ms per iteration, the threads train.py says it chose) of one fresh run."""
    import json
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    res = subprocess.run([PY, str(ROOT / "train.py"), f"--out_dir={out_dir}", "--sample_tokens=0",
                          f"--max_iters={iters}", f"--eval_interval={10 * iters}",
                          "--eval_iters=1", "--log_interval=1", f"--threads={threads}"],
                         capture_output=True, text=True, env=env, timeout=1800)
    if res.returncode:
        sys.exit(f"train.py failed:\n{res.stderr[-2000:]}")
    chosen = re.search(r", (\d+) threads? \(", res.stdout)
    records = [json.loads(x) for x in open(f"{out_dir}/metrics.jsonl")]
    return steady([r for r in records if "event" not in r], "ms"), int(chosen[1])


def bench(iters, rounds, log=print):
    """(markdown text, results): ms per iteration at each thread setting, idle and loaded."""
    from bench_common import table
    out, busy = {}, []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for phase in ("idle", "2 busy processes"):
                if busy == [] and phase != "idle":
                    busy = [subprocess.Popen([PY, "-c", "while True: pass"]) for _ in range(2)]
                    time.sleep(5)
                for r in range(rounds):
                    for t in SETTINGS:
                        ms, chosen = run(t, iters, f"{tmp}/{len(out)}-{r}-{t}")
                        out.setdefault((phase, t), []).append((ms, chosen))
                        log(f"  {phase}, --threads={t}: {ms:.1f} ms/iter ({chosen} threads)")
    finally:
        for p in busy:
            p.kill()
    rows = [[phase, t if t != "0" else "0 (chosen)",
             ", ".join(sorted({str(c) for _, c in runs})),
             f"{statistics.median(ms for ms, _ in runs):.1f}",
             " / ".join(f"{ms:.0f}" for ms, _ in runs)]
            for (phase, t), runs in out.items()]
    text = (f"make train's model, {iters} iterations a run, {rounds} rounds, {os.cpu_count()} "
            "CPUs\n\n" + table(["machine", "--threads", "threads used", "ms / iteration (median)",
                                "each round"], rows))
    return text, {f"{phase} {t}": runs for (phase, t), runs in out.items()}
