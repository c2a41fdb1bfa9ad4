"""kernel_choice.py: `--kernels=auto`: which implementation each of local_ops.py's ops runs, timed
per op and shape the first time it comes, the times agreed across the ranks that run it.

BOOST (arXiv 2512.12131) section 4 fuses the bottleneck's local ops into Triton kernels; whether a
fused kernel beats the PyTorch reference depends on the GPU and the shape (a short sequence, a
narrow slice), so under auto each op is timed both ways, forward and backward apart, and the faster
kept in each direction. local_ops.py dispatches; this file measures: `select` installs `measure` as
local_ops.py's way of deciding a shape it has not met, and train.py's placement names the process
groups to agree over (`agree_over`).
"""
import os
import time

import torch
import torch.distributed as dist

import local_ops
from extensions import kernel_ops  # noqa: F401  (the Triton side registers itself)

_agree = []   # the process groups over which the times are averaged before choosing (agree_over)


def select(mode, device):
    """local_ops.select(mode, device), with `measure` deciding the shapes auto meets."""
    local_ops.measure = measure
    return local_ops.select(mode, device)


def agree_over(*groups):
    """Under torchrun, the groups whose ranks run the same shapes at the same moments (a pipeline
    stage's TP and DP groups): auto averages each shape's times over them, so every rank chooses
    alike. Ranks choosing alone could run replicated work (the final norm, vanilla's and megatron's
    norms) through different implementations: the copies of a replicated weight would round
    differently and drift apart, and the gradient norm, hence clipping, would differ between
    ranks."""
    _agree[:] = [g for g in groups if g is not None and dist.get_world_size(g) > 1]


def measure(op, key, fn, args):
    """(forward, backward): the faster of local_ops.IMPLS in each direction for fn(*args), timed
    (3 runs each after a warm-up) and averaged over the agree_over groups; logged once by rank 0.
    A fused forward that wins is kept when its backward loses."""
    t = _averaged({name: _time(fn, args, name) for name in local_ops.IMPLS}, args[0].device)
    ways = tuple(min(local_ops.IMPLS, key=lambda n: t[n][i]) for i in (0, 1))
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"kernels: {op} ({key}) " + "; ".join(
            f"{way} triton {t['triton'][i]:.3f} ms vs torch {t['torch'][i]:.3f} ms: {ways[i]}"
            for i, way in enumerate(("forward", "backward"))))
    return ways


def _averaged(times, device):
    """{name: (forward ms, backward ms)} averaged over the ranks of the agree_over groups (every
    rank the same result)."""
    if not _agree:
        return times
    t = torch.tensor([times[n] for n in local_ops.IMPLS], dtype=torch.float64,
                     device=device)                                 # (2 impls, 2 directions)
    for group in _agree:   # TP, then DP: the mean over the stage's whole (dp, tp) slab
        dist.all_reduce(t, group=group)
        t /= dist.get_world_size(group)
    return dict(zip(local_ops.IMPLS, map(tuple, t.tolist())))


def _time(fn, args, name, runs=3):
    """(forward ms, backward ms) of fn under implementation `name`, on copies of args: with grad on
    (CopyUp's forward runs without it) and past any saved-tensor hooks of the caller (inside an
    activation-checkpoint segment the timing's tensors would be counted as the segment's)."""
    plain = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with local_ops.using(name), torch.enable_grad(), plain:
        leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) if torch.is_tensor(a)
                  else a for a in args]
        sync = torch.cuda.synchronize if leaves[0].is_cuda else (lambda: None)
        total = [0.0, 0.0]
        for i in range(runs + 1):
            sync()
            t0 = time.perf_counter()
            outs = [o for o in fn(*leaves) if o.requires_grad]
            sync()
            t1 = time.perf_counter()
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            sync()
            if i:   # (the first run warms up)
                total[0] += (t1 - t0) * 1000 / runs
                total[1] += (time.perf_counter() - t1) * 1000 / runs
        return tuple(total)


def time_shapes(run):
    """--kernels=auto under compile: one eager forward and backward of train.py's `run` first, so
    that every shape is timed and chosen before tracing (which only reads the choices), then
    forgotten (its gradients, and the random numbers it drew)."""
    x, y = next(run.shares("train", "train", 0))   # (drawn by (seed, stream, step))
    cuda = run.place.device.startswith("cuda")
    with torch.random.fork_rng(devices=[run.place.device] if cuda else []):
        with run.autocast:
            loss = run.raw_model(x, y)[1]
        loss.backward()
    run.raw_model.zero_grad(set_to_none=True)
