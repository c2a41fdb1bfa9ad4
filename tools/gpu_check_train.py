"""gpu_check_train.py: gpu_check.py's train step: short training runs whose losses must agree, and
the time of a 200-token sample.

BOOST (arXiv 2512.12131) sections 3-4: the Triton kernels (--kernels=triton), the PyTorch reference
(torch) and the per-shape choice between them (auto) train the same CoLA model to the same losses:
fp32 within 1e-3 relative at every iteration, bf16 within 2%. A run stopped at iteration 15 and
resumed (its second half starts as soon as the first ends), one with --recompute=lowrank, and two
compiled ones (--kernels=auto against auto eager; --kernels=triton, which puts the user Triton
kernels inside inductor's graph, against Triton eager) train to the same losses too. The runs are
train.py processes, side by side on the one GPU (small models), each reported as it ends; on a CPU
(--cpu) a smaller model, fp32, the reference and the interpreted kernels.
"""
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU = ["--n_layer=4", "--n_embd=256", "--n_head=8", "--n_kv_head=4", "--block_size=256",
       "--batch_size=8", "--max_iters=30", "--lr_decay_iters=30", "--eval_interval=15",
       "--eval_iters=2"]
# interpreted Triton takes seconds a step on a CPU: one layer, one evaluation batch
CPU = ["--n_layer=1", "--n_embd=32", "--n_head=4", "--n_kv_head=2", "--block_size=16",
       "--batch_size=2", "--max_iters=2", "--lr_decay_iters=2", "--eval_interval=1",
       "--eval_iters=1"]
TOL = {"float32": 1e-3, "bfloat16": 2e-2}


def plan(cpu):
    """{run name: extra options} of the runs side by side, and the comparisons (run, against,
    dtype)."""
    dtypes = ["float32"] if cpu else ["float32", "bfloat16"]
    # (auto on a CPU is the reference)
    impls = ["torch", "triton"] if cpu else ["torch", "triton", "auto"]
    runs = {f"{k}-{d}": [f"--kernels={k}", f"--dtype={d}"] for k in impls for d in dtypes}
    runs["resumed-float32"] = ["--kernels=triton", "--dtype=float32",
                               f"--max_iters={1 if cpu else 15}"]   # then resumed
    runs["lowrank-float32"] = ["--kernels=triton", "--dtype=float32", "--recompute=lowrank"]
    if not cpu:   # compiled: auto's choices, and Triton's kernels inside inductor's graph
        runs["compiled-bfloat16"] = ["--kernels=auto", "--dtype=bfloat16", "--compile=true"]
        runs["compiled-triton-bfloat16"] = ["--kernels=triton", "--dtype=bfloat16",
                                            "--compile=true"]
    pairs = [(f"{k}-{d}", f"torch-{d}", d) for k in impls[1:] for d in dtypes]
    pairs += [("resumed-float32", "triton-float32", "float32"),
              ("lowrank-float32", "triton-float32", "float32")]
    if not cpu:
        pairs += [("compiled-bfloat16", "auto-bfloat16", "bfloat16"),
                  ("compiled-triton-bfloat16", "triton-bfloat16", "bfloat16")]
    return runs, pairs


def launch(name, extra, args, data_dir):
    """Start one train.py run into <out>/<name>; (process, start time). Its output goes to
    <name>.log."""
    cmd = [sys.executable, str(ROOT / "train.py"), f"--out_dir={Path(args.out) / name}",
           f"--data_dir={data_dir}",
           "--log_interval=1", "--sample_tokens=0", "--warmup_iters=2",
           f"--device={'cpu' if args.cpu else 'cuda'}", *(CPU if args.cpu else GPU), *extra]
    # (the child keeps its own copy of the handle)
    with open(Path(args.out) / f"{name}.log", "a") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), time.time()


def finish(name, proc_t0, args):
    """Wait for a run; its per-iteration losses ({iter: loss}, over every launch into its out_dir)
    or None, logged."""
    proc, t0 = proc_t0
    code = proc.wait()
    path = Path(args.out) / name / "metrics.jsonl"
    records = [json.loads(x) for x in open(path)] if path.exists() else []
    losses = {r["iter"]: r["loss"] for r in records if "loss" in r}
    tail = (Path(args.out) / f"{name}.log").read_text().strip().splitlines()[-1:] or [""]
    print(f"{'ok  ' if code == 0 else 'FAIL'} run {name}: exit {code} in {time.time() - t0:.0f} s, "
          f"{len(losses)} iterations" + (f", last loss {losses[max(losses)]:.4f}" if losses
                                         else f": {tail[0]}"), flush=True)
    return losses if code == 0 else None


def agree(a, b):
    """The largest relative difference of two runs' losses over the iterations both have."""
    common = sorted(set(a) & set(b))
    return max(abs(a[i] - b[i]) / abs(b[i]) for i in common) if common else float("inf")


def sample_ms(args):
    """ms of the 200-token sample a run ends with (train.sample's path: autocast, the reference
    ops)."""
    import torch
    import local_ops
    from plumbing.tokenizer import sample_text
    from extensions import kernel_choice
    from plumbing import options, placement, plan
    from plumbing.tokenizer import load as load_tokenizer
    cfg, tc = options.parse_args([*(CPU if args.cpu else GPU), "--warmup_iters=2",
                                  "--kernels=auto"])
    cfg.vocab_size = options.vocab_size("bytes")
    dev = "cpu" if args.cpu else "cuda"
    kernel_choice.select("auto", dev)
    net = placement.build_model(plan.make(cfg, tc, 1), placement.Placement(1, 1, dev))[0]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev == "cuda" else \
        torch.autocast("cpu", enabled=False)
    t0 = time.time()
    with torch.no_grad(), autocast, local_ops.reference():
        sample_text(net, load_tokenizer("bytes"), 200 if dev == "cuda" else 20, dev)
    return (time.time() - t0) * 1000


def step(args):
    from plumbing import data
    from plumbing import preparation
    data_dir = Path(args.out) / "data"
    shutil.rmtree(data_dir, ignore_errors=True)
    preparation.prepare(data.EMBEDDED, "bytes", data_dir, log=lambda *a: None)
    runs, pairs = plan(args.cpu)
    started = {name: launch(name, extra, args, data_dir) for name, extra in runs.items()}
    losses, resumed = {}, False
    # each run reported as it ends; the resume starts as soon as its first half ends
    while started:
        name = next((n for n, (p, _) in started.items() if p.poll() is not None), None)
        if name is None:
            time.sleep(0.2)
            continue
        losses[name] = finish(name, started.pop(name), args)
        if name == "resumed-float32" and not resumed and losses[name] is not None:
            resumed = True   # the second half, from the checkpoint at the middle
            started[name] = launch(name, ["--kernels=triton", "--dtype=float32",
                                          "--init_from=resume"], args, data_dir)
    failed = sum(v is None for v in losses.values())
    compared = {}
    for run, against, dtype in pairs:
        if losses.get(run) is None or losses.get(against) is None:
            continue
        diff = agree(losses[run], losses[against])
        compared[f"{run} vs {against}"] = diff
        ok = diff <= TOL[dtype]
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {run} against {against}: largest relative loss "
              f"difference {diff:.1e} (tolerance {TOL[dtype]:.0e})", flush=True)
    ms = sample_ms(args)
    print(f"ok   sample of {200 if not args.cpu else 20} tokens in {ms:.0f} ms", flush=True)
    print("RESULT " + json.dumps({"failed": failed, "compared": compared, "sample_ms": ms}),
          flush=True)
