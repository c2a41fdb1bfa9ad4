"""local_ops.py: the local compute ops of bottleneck-aware TP: PyTorch references, one dispatch.

BOOST (arXiv 2512.12131) sections 3-4. layouts.py and parallel.py call `norm_down`, `grouped_expand`
(and its backward halves for parallel.CopyUp) and `rms_norm`; `select()` (train.py's
--kernels=auto|triton|torch) decides whether they run the PyTorch reference (the specification, and
the CPU path) or the Triton kernels (triton_kernels.py); under auto, forward and backward are
chosen apart. The weight gradients (dA, dB), which reduce over every token, are cuBLAS's on both
paths.

- norm_down: the local half of online RMSNorm fused with a grouped down-projection. For a rank's
  slice x (M, K) of the residual stream, its slice γ (K) of the gain and its columns A (N, K) of the
  grouped down-projection, one pass over x gives H = (x ⊙ γ)·Aᵀ (M, N) and S = Σ_k x² (M, 1) (fp32,
  accumulated inside the GEMM's K loop). After the all-reduce of [H | S]:
  RMSNorm(x_full)·A_fullᵀ = H / sqrt(S/d + ε). Backward: d(xγ) = dH·A, dx = d(xγ)⊙γ + 2·x·dS,
  dγ = Σ_m d(xγ)⊙x, dA = dHᵀ·(x⊙γ).
- grouped_expand: the B side, the G latents of equal rank r expanded back (the paper's
  up-projections, y_g = z_g·B_gᵀ) in one launch; each group has its own output width n_g (with GQA
  q is wider than k and v). Backward as grouped GEMMs: dz_g = dy_g·B_g, dB_g = dy_gᵀ·z_g.
- rms_norm: plain RMSNorm over the last dim (replicated-stream layouts, the final norm).

The file reads in that order: the PyTorch references (the math, and the specification the kernels
are tested against), the dispatch, then which implementation runs (--kernels; under auto the choice
is extensions/kernel_choice.py's, which times each op and shape and agrees across ranks). The
Triton side is registered here from outside: extensions/kernel_ops.py wraps triton_kernels.py's
launches as custom ops, each direction one, with their autograd (so a compiled layer is one graph),
and sets `triton_ops` when imported (plumbing/placement.py imports it). Without it, or without
Triton installed, only the references run. On a machine without CUDA the kernels run in Triton's
interpreter.
"""
import contextlib
import os

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "triton", "torch")
IMPLS = ("triton", "torch")
_backend = "torch"
_choices = {}   # (op, shape key) -> (forward, backward) of IMPLS, decided once per run under auto
# the Triton side (norm_down_op, grouped_expand_op, grouped_expand_dz_op, rms_norm_op): the module
# extensions/kernel_ops.py, which sets this when it is imported and Triton is installed
triton_ops = None
# under auto, what decides an (op, shape) met the first time: measure(op, shape key, fn, args) ->
# (forward, backward); extensions/kernel_choice.py's timing, installed by its select()
measure = None

# ------------------------------------------------------------------------- PyTorch references

def norm_down_ref(x, gamma, A):
    """x (..., K), gamma (K,), A (N, K) -> H (..., N) in A's dtype, S (..., 1) float32."""
    return (x * gamma).to(A.dtype) @ A.t(), x.float().pow(2).sum(-1, keepdim=True)


def grouped_expand_ref(z, Bs):
    """z (..., G·r) the concatenated latents, Bs [(n_g, r)] -> [z_g·B_gᵀ (..., n_g)] in z's dtype:
    one GEMM per group on a strided view of z, so nothing is copied (a stacked bmm copies z and
    every B_g twice)."""
    return [zg @ B.to(z.dtype).t() for zg, B in zip(z.split(Bs[0].shape[1], -1), Bs)]


def rms_norm_ref(x, gamma, eps):
    return F.rms_norm(x, (x.shape[-1],), gamma, eps)


# The backward references: autograd's gradients of the three above, written out because the
# kernels' side (extensions/kernel_ops.py) runs a backward without its forward's graph (under
# --kernels=auto a Triton forward may meet a PyTorch backward), and parallel.CopyUp splits
# grouped_expand's backward in two. tests/test_kernels.py checks each against autograd.

def norm_down_ref_backward(dH, dS, x, gamma, A):
    """dH (M, N), dS (M) -> dx (M, K) in x's dtype, dγ (K), dA (N, K): d(x⊙γ) = dH·A,
    dx = d(x⊙γ)⊙γ + 2·x·dS, dγ = Σ_m d(x⊙γ)⊙x, dA = dHᵀ·(x⊙γ)."""
    dxg = (dH @ A.to(dH.dtype)).float()                                # d(x⊙γ) (M, K)
    dx = dxg * gamma + 2 * x.float() * dS.float()[:, None]             # (M, K)
    return dx.to(x.dtype), (dxg * x).sum(0).to(gamma.dtype), norm_down_dA(dH, x, gamma, A)


def norm_down_dA(dH, x, gamma, A):
    """dA = dHᵀ·(x⊙γ) (N, K) in A's dtype: a reduction over every token, cuBLAS on both paths (its
    split-K fills a GPU where a kernel's 32-88 output tiles do not)."""
    return (dH.t() @ (x * gamma).to(dH.dtype)).to(A.dtype)


def grouped_expand_dz_ref(dys, Bs):
    """[dy_g (..., n_g)], [B_g (n_g, r)] -> dz (..., G·r) in dy's dtype, dz_g = dy_g·B_g."""
    return torch.cat([dy @ B.to(dy.dtype) for dy, B in zip(dys, Bs)], -1)


def grouped_expand_dB(dys, z, Bs):
    """-> [dB_g (n_g, r)], dB_g = dy_gᵀ·z_g over all tokens, in each B's dtype: cuBLAS on both
    paths (a reduction over every token, as norm_down_dA)."""
    return [(dy.reshape(-1, dy.shape[-1]).t() @ zg.reshape(-1, zg.shape[-1]).to(dy.dtype))
            .to(B.dtype) for dy, zg, B in zip(dys, z.split(Bs[0].shape[1], -1), Bs)]


def rms_stat(x, eps):
    """1/rms of each row of x (M, N) -> (M,) fp32: what the forward keeps for the backward."""
    return torch.rsqrt(x.float().pow(2).mean(-1) + eps)


def rms_norm_ref_backward(dy, x, gamma, rstd):
    """dy, x (M, N), rstd (M) -> dx in x's dtype, dγ: with x̂ = x·rstd,
    dx = rstd·(dy⊙γ − x̂·mean(dy⊙γ⊙x̂)), dγ = Σ_rows dy⊙x̂."""
    xhat, wdy = x.float() * rstd[:, None], dy.float() * gamma.float()  # (M, N)
    dx = (wdy - xhat * (xhat * wdy).mean(-1, keepdim=True)) * rstd[:, None]
    return dx.to(x.dtype), (dy.float() * xhat).sum(0).to(gamma.dtype)


# ------------------------------------------------------------------------- dispatch

def _autocast(t, like):
    """Custom Functions are not autocast: a matmul operand t in the autocast dtype ourselves, or
    without autocast in like's dtype."""
    device = t.device.type
    return t.to(torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else
                like.dtype)


def norm_down(x, gamma, A):
    """x and γ in their own dtypes (an fp32 residual stays fp32: Σx² and x⊙γ are taken in fp32 as
    the reference takes them, and x⊙γ is rounded to A's dtype for the product, as autocast rounds
    the reference's); A in the autocast dtype."""
    ways = _which("norm_down", lambda: f"{_rows(x)}x{x.shape[-1]} -> {A.shape[0]}+1", norm_down,
                  (x, gamma, A))
    if ways == ("torch", "torch"):
        return norm_down_ref(x, gamma, A)
    A = _autocast(A, x)
    H, S = triton_ops.norm_down_op(x.reshape(-1, x.shape[-1]), gamma, A, *ways)
    return H.view(*x.shape[:-1], -1), S.view(*x.shape[:-1], 1)


def _expand_key(z, Bs):
    return f"{_rows(z)}x{len(Bs)}x{Bs[0].shape[1]} -> {'+'.join(str(B.shape[0]) for B in Bs)}"


def grouped_expand(z, Bs):
    ways = _which("grouped_expand", lambda: _expand_key(z, Bs),
                  lambda z, *Bs: grouped_expand(z, list(Bs)), (z, *Bs))
    if ways == ("torch", "torch"):
        return grouped_expand_ref(z, Bs)
    Y = triton_ops.grouped_expand_op(_autocast(z, z).reshape(-1, z.shape[-1]), list(Bs), *ways)
    return [y.view(*z.shape[:-1], -1) for y in Y.split([B.shape[0] for B in Bs], -1)]


# grouped_expand's backward in two halves, for parallel.CopyUp, which all-reduces dz while dB
# computes: dz dispatched here, dB the reference's grouped_expand_dB (cuBLAS on both paths)
def grouped_expand_dz(dys, Bs):
    """[dy_g (..., n_g)], [B_g (n_g, r)] -> dz (..., G·r), dz_g = dy_g·B_g: under auto, the
    implementation grouped_expand's backward took for these shapes (the reference for a shape auto
    never measured: nothing unmeasured runs a kernel)."""
    way = _backend if _backend != "auto" else \
        _choices.get(("grouped_expand", _expand_key(dys[0], Bs)), ("torch", "torch"))[1]
    if way == "torch":
        return grouped_expand_dz_ref(dys, Bs)
    dY = torch.cat([dy.reshape(-1, dy.shape[-1]) for dy in dys], -1)   # (M, Σn_g), built once
    return triton_ops.grouped_expand_dz_op(dY, list(Bs)).view(*dys[0].shape[:-1], -1)


def rms_norm(x, gamma, eps):
    ways = _which("rms_norm", lambda: f"{_rows(x)}x{x.shape[-1]}",
                  lambda x, g: [rms_norm(x, g, eps)], (x, gamma))
    if ways == ("torch", "torch"):
        return rms_norm_ref(x, gamma, eps)
    # (x in its own dtype, as the reference's F.rms_norm takes it under autocast: y in x's dtype)
    return triton_ops.rms_norm_op(x.reshape(-1, x.shape[-1]), gamma, eps, *ways)[0].view(x.shape)


# ---------------------------------------------------------------------- which one runs: --kernels
# (under auto, decided per op and shape by `measure`: extensions/kernel_choice.py)

def select(mode, device):
    """Choose the implementation: triton or torch everywhere; auto = on CUDA, per op and shape, the
    faster of the two as `measure` finds the first time the shape comes (`_which`); elsewhere the
    reference."""
    global _backend
    if mode not in BACKENDS:
        raise ValueError(f"kernels={mode} is not one of {', '.join(BACKENDS)}")
    if mode == "triton" and triton_ops is None:
        raise ValueError("kernels=triton but Triton is not installed (or extensions/kernel_ops.py, "
                         "the Triton side, is not imported)")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if mode == "triton" and not str(device).startswith("cuda") and not interpreted:
        raise ValueError("kernels=triton on a CPU needs TRITON_INTERPRET=1 set before start")
    _backend = mode if mode != "auto" else ("auto" if triton_ops and str(device).startswith("cuda")
                                            else "torch")
    _choices.clear()
    return _backend


def describe(device):
    """The start line's words for the backend: none for the reference; Triton's interpreter (a
    CPU under TRITON_INTERPRET=1) named as what it is, hundreds of times slower than PyTorch."""
    if _backend == "torch":
        return ""
    slow = _backend == "triton" and not str(device).startswith("cuda")
    return f", kernels {_backend}" + (" (Triton's interpreter on a CPU: hundreds of times slower, "
                                      "for checking the kernels, not for training)" if slow else "")


def backend():
    """The implementation select() chose: "torch", "triton" or "auto" (measured per op and
    shape)."""
    return _backend


@contextlib.contextmanager
def using(name):
    """`name` ("torch", "triton" or "auto") inside, whatever select() chose: the auto timing runs
    each side this way, and the benches and tests force one."""
    global _backend
    saved, _backend = _backend, name
    try:
        yield
    finally:
        _backend = saved


def reference():
    """The PyTorch references inside (plumbing/explain.py records ops with a dispatch mode, to
    which a Triton launch is invisible)."""
    return using("torch")


def chosen():
    """What --kernels=auto chose so far: {(op, shape key): (forward, backward) of IMPLS}."""
    return dict(_choices)


def bucket(n):
    """n rounded up to a power of two: how a token count keys auto's timings and the kernels'
    tunings (triton_kernels.py), so that sampling's M = 1, 2, 3, ... (and a ragged last batch) are
    timed and tuned a few times, not 200."""
    return 1 << (max(1, n) - 1).bit_length()


def _rows(t):
    """The token count of t (..., width) as auto's shape keys name it (bucket)."""
    return f"≤{bucket(t.numel() // t.shape[-1])}"


def _which(op, shape_key, fn, args):
    """(forward, backward): the implementations of `op` for this shape: the forced one both ways,
    or under auto what `measure` decided the first time the shape came (it is called once per op
    and shape, never while torch.compile traces). shape_key() names the shape; it is called only
    under auto, off the reference's hot path."""
    if _backend != "auto":
        return _backend, _backend
    key = shape_key()
    if (op, key) not in _choices:
        if torch.compiler.is_compiling():
            return "torch", "torch"   # (timed in the eager warm-up steps, not while tracing)
        if measure is None:
            raise RuntimeError("kernels: auto without a measure: select it with "
                               "extensions.kernel_choice.select")
        _choices[(op, key)] = measure(op, key, fn, args)
    return _choices[(op, key)]
