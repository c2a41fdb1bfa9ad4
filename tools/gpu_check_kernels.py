"""gpu_check_kernels.py: gpu_check.py's kernel step: every Triton kernel of local_ops.py against its
PyTorch reference, forward and backward, on the device it runs on.

BOOST (arXiv 2512.12131) sections 3-4 (online RMSNorm fused with the down-projection, the grouped
up-projections, RMSNorm). Each tile configuration of triton_kernels.GEMM_CONFIGS is forced in turn
(the autotuners get a list of one) on ragged shapes in bf16 (in fp32 the first); then the calls
training makes besides (TRAINING: bf16 autocast's norm_down on the fp32 residual, CopyUp's
backward halves); then the TP=4 slices of BOOST's 1B and 7B shapes go through the real autotuners
in bf16 (before the fp32 pass, so a short slot keeps them). Both sides get
the same inputs rounded to the dtype; the reference computes in fp32, and the error is the largest
difference relative to the largest reference value, for the outputs and for every input's
gradient. On a CPU it runs in Triton's interpreter (one configuration, small shapes), which is
how the tests run it.
"""
import contextlib

import torch

import local_ops
from extensions import kernel_ops  # noqa: F401, E402  (the Triton side registers itself)
import parallel
import triton_kernels as tk

# ragged on purpose: no size a multiple of a tile (M, K, N) or of a group's width
RAGGED = [("norm_down", [(77, 96), (96,), (40, 96)]), ("norm_down", [(130, 33), (33,), (72, 33)]),
          ("grouped_expand", [(77, 48), (40, 16), (24, 16), (24, 16)]),
          ("grouped_expand", [(130, 40), (33, 20), (33, 20)]),
          ("rms_norm", [(77, 96), (96,)]), ("rms_norm", [(5, 5120), (5120,)])]
# and the calls training makes besides, as it makes them: fp32 parameters and residual, under bf16
# autocast for the bf16 pass: norm_down on the fp32 residual and gain beside A cast to bf16 (its
# mixed signature), and parallel.CopyUp (--overlap) at a TP group of one, whose backward halves are
# grouped_expand_dz through Triton and the dB GEMMs
TRAINING = [("norm_down", [(77, 96), (96,), (40, 96)]),
            ("copy_up", [(77, 48), (40, 16), (24, 16), (24, 16)])]
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
FN = {"norm_down": lambda x, g, A: list(local_ops.norm_down(x, g, A)),
      "grouped_expand": lambda z, *Bs: local_ops.grouped_expand(z, list(Bs)),
      "copy_up": lambda z, *Bs: list(parallel.CopyUp.apply(z, None, True, *Bs)),
      "rms_norm": lambda x, g: [local_ops.rms_norm(x, g, 1e-6)]}


def outputs_and_grads(fn, inputs, upstream, impl):
    """fn's outputs and its inputs' gradients, in fp32, under implementation `impl` ("triton" or
    "torch", forward and backward), on fresh leaves of `inputs`, backward from `upstream`: a list of
    tensors, or a function of the outputs giving them; each is cast to its output's dtype. (The
    kernel tests in tests/test_kernels.py compare through it too.)"""
    with local_ops.using(impl):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        outs = fn(*leaves)
        grads = upstream(outs) if callable(upstream) else upstream
        torch.autograd.backward(outs, [u.to(o.dtype) for u, o in zip(grads, outs)])
    return [o.detach().float() for o in outs], [t.grad.float() for t in leaves]


def compare(op, shapes, dtype, device, seed=0, autocast=False):
    """(output error, gradient error) of the Triton path against the fp32 reference on the same
    inputs (rounded to dtype); with autocast, fp32 inputs, the Triton side under `dtype`
    autocast."""
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=g) for s in shapes]
    if op in ("norm_down", "rms_norm"):
        base[1] = 1 + base[1].abs()   # a gain
    got = {}
    for impl, dt in (("triton", torch.float32 if autocast else dtype), ("torch", torch.float32)):
        up = torch.Generator().manual_seed(seed + 1)
        on = autocast and impl == "triton"
        with torch.autocast(torch.device(device).type, dtype=dtype, enabled=on):
            got[impl] = outputs_and_grads(FN[op],
                                          [b.to(dtype).to(device=device, dtype=dt) for b in base],
                                          lambda outs: [torch.randn(o.shape,
                                                                    generator=up).to(device)
                                                        for o in outs], impl)

    def err(pairs):
        return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item() for a, b in pairs)
    return err(zip(got["triton"][0], got["torch"][0])), err(zip(got["triton"][1], got["torch"][1]))


def tuners(bits, device):
    """The autotuned kernels for `bits`-wide inputs on this device (triton_kernels.tuner)."""
    arch = tk.arch(torch.device(device)) if str(device).startswith("cuda") else None
    return [tk.tuner(name, bits, arch) for name in tk.KERNELS]


@contextlib.contextmanager
def forced(bits, device, i):
    """The autotuners for `bits`-wide inputs with their i-th configuration only (then restored)."""
    saved = [(t, t.configs) for t in tuners(bits, device)]
    for t, configs in saved:
        t.configs = [configs[i]]
        t.cache.clear()
    try:
        yield saved[0][1][i]
    finally:
        for t, configs in saved:
            t.configs = configs
            t.cache.clear()


def check(op, shapes, dtype, device, label, log, autocast=False):
    """One comparison, logged as it comes; True when within TOL."""
    out_err, grad_err = compare(op, shapes, dtype, device, autocast=autocast)
    ok = max(out_err, grad_err) <= TOL[dtype]
    log(f"{'ok  ' if ok else 'FAIL'} {label} {op} {'x'.join(map(str, shapes[0]))}: output "
        f"{out_err:.1e}, gradients {grad_err:.1e} (tolerance {TOL[dtype]:.0e})")
    return ok


def run(device, log, real_shapes=True):
    """bf16: every configuration on the ragged shapes, training's calls, then the real shapes
    autotuned; fp32: the first configuration and training's calls; (passed, failed)."""
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        bits = tk.bits(torch.empty(0, dtype=dtype))
        # every tile configuration in bf16 (what a GPU trains in); in fp32 the first alone: the
        # other configurations' fp32 compiles (about a third of the step's) teach nothing more
        n_configs = len(tuners(bits, device)[0].configs) if dtype == torch.bfloat16 else 1
        for i in range(n_configs):
            with forced(bits, device, i) as config:
                tiles = "x".join(str(v) for v in config.kwargs.values())
                label = f"{str(dtype)[6:]} {tiles} w{config.num_warps} s{config.num_stages}"
                results += [check(op, shapes, dtype, device, label, log) for op, shapes in RAGGED]
        on = dtype != torch.float32
        label = f"{str(dtype)[6:]} training's call{' (fp32 weights, autocast)' if on else ''}"
        results += [check(op, shapes, dtype, device, label, log, on) for op, shapes in TRAINING]
        if real_shapes and dtype == torch.bfloat16:   # (what a GPU trains in; fp32 above)
            import bench_gpu
            for name, cfg in bench_gpu.shapes().items():
                for case, op, shapes, _ in bench_gpu.kernel_cases(cfg):
                    results.append(check(op, shapes, dtype, device,
                                         f"{str(dtype)[6:]} {name} TP=4 {case} (autotuned)", log))
    return results.count(True), results.count(False)
