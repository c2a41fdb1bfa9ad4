"""gpu_check.py: the first run on a GPU machine, in one command of at most 8 minutes.

BOOST (arXiv 2512.12131) sections 3-4 and 7 run on GPUs; this says whether this project does, on a
machine with PyTorch already installed (its own python3, no pip):

    python3 tools/gpu_check.py [--budget_s=475] [--json=gpu-check/summary.json]
    python3 tools/gpu_check.py --cpu        # the same steps, small, on a CPU (the tests run this)

Without PyTorch, or without a CUDA device (and no --cpu), it says so in one line and exits 2. Its
summary goes to gpu-check/ in the repository (ignored by git) unless --json names another file.

Each step runs in its own process under its own timeout (cut to what is left of the budget), prints
its results as they come, so a step that hangs or times out keeps what it did, and the others still
run; one summary at the end, and a JSON file of it. The steps:
1. env: nvidia-smi, the versions of Python, torch, triton and numpy, the GPU and its capability,
   and whether Triton can build its launchers (a C compiler and Python's headers).
2. kernels: every Triton kernel against the PyTorch reference, forward and backward, bf16 and fp32,
   every tile configuration on ragged shapes, the calls training makes (bf16 autocast's
   mixed-dtype norm_down, CopyUp's backward halves), and the 1B and 7B TP=4 shapes through the
   autotuners (gpu_check_kernels.py).
3. train: 30 iterations on the embedded corpus with --kernels=torch, triton and auto, fp32 and
   bf16 (the losses agree: fp32 within 1e-3 relative, bf16 within 2%), resumed from the checkpoint
   at 15, with --recompute=lowrank, and compiled; then the time of a 200-token sample.
4. tp: two BTP ranks at tp=2 on the one GPU over gloo, equal to one device (gpu_check_tp.py).
5. bench: `bench.py gpu`'s step rows first (CoLA's, eager and compiled, then the dense and svd
   models eager), then its kernels-against-cuBLAS table, at 4 layers; a row starts only where it
   fits what is left of the slot.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]   # the core files live at the repository root
# each one's timeout, seconds: 475 in all, the default budget (8 minutes less 5 s), so that a second
# run fits 15 minutes of device time; docs/gpu.md says what each holds on a cold cache. tp's slot
# outlasts its ranks' 40 s gloo timeout, so a hang there reads as the ranks' own error. --cpu (the
# tests' mode, Triton's interpreter on a possibly busy machine) gets three times as long
STEPS = {"env": 15, "kernels": 150, "train": 150, "tp": 60, "bench": 100}
CPU_SLOWER = 3


def run_step(cmd, timeout, log, env=None):
    """Run one step's command, passing each line to log as it comes (printed and appended to the
    rows file); (status, its RESULT record or None). status is "ok", "failed" (it reported failures
    or exited non-zero) or "timed out". A thread reads the output, so no line is kept in a buffer
    past the deadline: what the step printed before it was killed is all logged."""
    import queue
    import threading
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env={**os.environ, **(env or {})}, start_new_session=True)
    lines, deadline, state = queue.Queue(), time.time() + timeout, {"result": None}
    reader = threading.Thread(target=lambda: [*map(lines.put, proc.stdout), lines.put(None)],
                              daemon=True)
    reader.start()

    def take(line):
        if line.startswith("RESULT "):
            state["result"] = json.loads(line[7:])
        else:
            log("  " + line.rstrip())
    while True:
        try:
            line = lines.get(timeout=max(0.0, min(1.0, deadline - time.time())))
        except queue.Empty:
            if time.time() < deadline:
                continue
            os.killpg(proc.pid, 9)
            proc.wait()
            reader.join(5)   # (the pipe's last lines, then its end)
            while not lines.empty():
                line = lines.get()
                if line is not None:
                    take(line)
            return "timed out", state["result"]
        if line is None:
            break
        take(line)
    code, result = proc.wait(), state["result"]
    if code == 0 and result and result.get("skipped"):
        return "skipped", result
    return ("ok" if code == 0 and result and not result.get("failed") else "failed"), result


def report(**record):
    print("RESULT " + json.dumps(record), flush=True)


def step_env(args):
    import numpy
    import torch
    import triton
    if not args.cpu:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20)
        print(smi.stdout.strip() or smi.stderr.strip(), flush=True)
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    record = {"python": sys.version.split()[0], "torch": torch.__version__,
              "triton": triton.__version__,
              "numpy": numpy.__version__, "cuda": torch.version.cuda,
              "gpu": torch.cuda.get_device_name() if cap else None, "capability": cap}
    print(", ".join(f"{k} {v}" for k, v in record.items()), flush=True)
    record["launcher_build"] = line = launcher_build()
    print(line, flush=True)
    report(**record, failed=0 if (cap or args.cpu) else 1)


def launcher_build():
    """One line: whether Triton can build its kernel launchers here (Triton 3.6 compiles a small C
    module per kernel signature with the machine's C compiler and Python's headers)."""
    import shutil
    import sysconfig
    cc = os.environ.get("CC") or next(filter(None, map(shutil.which, ("cc", "gcc", "clang"))),
                                      None)
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    missing = [what for what, ok in (("a C compiler (cc, gcc, clang or $CC)", cc),
                                     (f"Python's headers ({headers})", headers.exists())) if not ok]
    if missing:
        return ("launcher build: MISSING " + " and ".join(missing) + ": Triton cannot build "
                "its launchers, so every Triton kernel fails at its first launch")
    return f"launcher build: C compiler {cc}, Python headers {headers.parent}"


def step_kernels(args):
    import gpu_check_kernels
    passed, failed = gpu_check_kernels.run(device(args), lambda s: print(s, flush=True),
                                           real_shapes=not args.cpu)
    report(passed=passed, failed=failed)


def step_bench(args):
    if args.cpu:
        report(skipped="bench.py gpu needs CUDA", failed=0)
        return
    import bench_gpu
    # (4 layers: at 2 the tied head is most of CoLA's step.) The steps first, CoLA's first of all
    # and alone compiled; every row starts only where it fits the slot, less 10 s to report
    _, out = bench_gpu.run("cuda", n_layer=4, log=lambda line: print(line, flush=True),
                           deadline=time.time() + STEPS["bench"] - 10, compiled=("cola", "full"),
                           steps_first=True)
    report(failed=0, matmul_peak_tflops=out["matmul_peak_tflops"], rows=len(out["rows"]))


def missing(cpu):
    """What this machine lacks for the check, in one line, or None."""
    try:
        import torch
    except ImportError:
        return (f"gpu_check needs PyTorch, which {sys.executable} cannot import: run it with the "
                "python that has it")
    if not cpu and not torch.cuda.is_available():
        return ("no CUDA device here: run it on a GPU machine, or use --cpu for the same steps, "
                "small, on a CPU")
    if cpu:
        import numpy
        import triton
        if version(triton.__version__) < (3, 7) and version(numpy.__version__) >= (2, 4):
            return (f"--cpu runs Triton's interpreter, which fails in triton "
                    f"{triton.__version__} with numpy {numpy.__version__} (2.4 or newer): use "
                    "triton 3.7 or newer, or numpy below 2.4 (on a GPU, run it without --cpu)")
    return None


def version(text):
    """"3.6.0+git..." -> (3, 6)."""
    return tuple(int(p) for p in text.split("+")[0].split(".")[:2])


def device(args):
    return "cpu" if args.cpu else "cuda"


def main(argv):
    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n")[0])
    ap.add_argument("--budget_s", type=float, default=None,
                    help="the whole check's limit (default 475; with --cpu three times that)")
    ap.add_argument("--json", default=str(ROOT / "gpu-check" / "summary.json"),
                    help="the summary's file (default gpu-check/summary.json in the repository)")
    ap.add_argument("--cpu", action="store_true",
                    help="the same steps, small, on a CPU (the tests' mode)")
    # one step, in its own process
    ap.add_argument("--step", choices=sorted(STEPS), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)  # the train step's scratch folder
    args = ap.parse_args(argv)
    if args.step:
        import gpu_check_tp
        import gpu_check_train
        {"env": step_env, "kernels": step_kernels, "train": gpu_check_train.step,
         "tp": gpu_check_tp.step, "bench": step_bench}[args.step](args)
        return
    args.budget_s = args.budget_s or sum(STEPS.values()) * (CPU_SLOWER if args.cpu else 1)
    problem = missing(args.cpu)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    start, summary = time.time(), {}
    rows = Path(args.json).with_name("rows.jsonl")   # every line as it comes, kept on a timeout
    rows.parent.mkdir(parents=True, exist_ok=True)
    rows.write_text("")

    def log(line, step=None):
        print(line, flush=True)
        with open(rows, "a") as fh:
            fh.write(json.dumps({"s": round(time.time() - start, 1), "step": step,
                                 "line": line}) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        for name, limit in STEPS.items():
            left = args.budget_s - (time.time() - start)
            if left < 5:
                summary[name] = {"status": "not run (budget spent)"}
                continue
            limit *= CPU_SLOWER if args.cpu else 1
            log(f"== {name} (at most {min(limit, left):.0f} s)", name)
            t0 = time.time()
            cmd = [sys.executable, str(Path(__file__)), f"--step={name}",
                   f"--out={tmp}"] + (["--cpu"] if args.cpu else [])
            status, result = run_step(cmd, min(limit, left), lambda x: log(x, name),
                                      {"TRITON_INTERPRET": "1"} if args.cpu else None)
            summary[name] = {"status": status, "seconds": round(time.time() - t0, 1),
                             **(result or {})}
            log(f"== {name}: {status} in {summary[name]['seconds']} s", name)
    print("\nsummary: " + "; ".join(f"{n} {s['status']}" for n, s in summary.items()) +
          f" ({time.time() - start:.0f} s of {args.budget_s:.0f})")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"written to {args.json}")
    return 0 if all(s["status"] in ("ok", "skipped") for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
