"""kernel_ops.py: BOOST's local ops as torch.compile sees them: custom ops with their autograd.

Beyond the BOOST paper (arXiv 2512.12131, sections 3-4 fuse these ops; registering them for
torch.compile is this project's): what each op computes is local_ops.py's docstring, which
chooses the implementation and calls these, once this file has registered itself there
(`local_ops.triton_ops`, at the end of this file). Each direction of an op is one custom op
(torch.library.custom_op) whose body launches the Triton kernel (triton_kernels.py) or calls
local_ops.py's reference (its forward, or its written-out backward: under --kernels=auto a Triton
forward may meet a PyTorch backward), as its `fwd` / `bwd` argument says; no math is restated
here. Why ops and not autograd Functions: dynamo cannot
trace a Triton launch or its cached autotuner, so an autograd Function around one broke
torch.compile's graph at every call (each layer fell back to eager between its pieces); an op is
one node of the graph, its backward registered beside it (register_autograd), and its shapes
given without running it (register_fake). Inductor calls the op's body as it is: the Triton
kernels run autotuned as in eager mode.
"""
import sys

import torch
from torch import Tensor

import local_ops

try:
    import triton_kernels as tk   # (first: TRITON_INTERPRET=1 where there is no CUDA)
    import triton
except ImportError:  # a laptop without Triton: the ops' reference bodies still run
    tk = triton = None


@torch.library.custom_op("boost::norm_down", mutates_args=())
def norm_down_op(x: Tensor, gamma: Tensor, A: Tensor, fwd: str, bwd: str) -> tuple[Tensor, Tensor]:
    """x (M, K), γ (K), A (N, K) -> H (M, N) in A's dtype, S (M) fp32."""
    x, gamma, A = x.contiguous(), gamma.contiguous(), A.contiguous()
    if fwd == "torch":
        H, S = local_ops.norm_down_ref(x, gamma, A)
        return H, S.squeeze(-1)
    (M, K), N = x.shape, A.shape[0]
    H = torch.empty(M, N, dtype=A.dtype, device=x.device)   # (the product's dtype: A's)
    S = torch.empty(M, dtype=torch.float32, device=x.device)
    up, ieee = tk.dot_flags(A)
    grid = lambda META: (triton.cdiv(M, META["BM"]), triton.cdiv(N, META["BN"]))
    tk.launcher("norm_down_fwd", A)[grid](x, gamma, A, H, S, M, N, K, x.stride(0), A.stride(0),
                                          H.stride(0), tk.bucket(M), UPCAST=up, IEEE=ieee)
    return H, S


@norm_down_op.register_fake
def _(x, gamma, A, fwd, bwd):
    return A.new_empty(x.shape[0], A.shape[0]), x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("boost::norm_down_backward", mutates_args=())
def norm_down_backward(dH: Tensor, dS: Tensor, x: Tensor, gamma: Tensor, A: Tensor,
                       bwd: str) -> tuple[Tensor, Tensor, Tensor]:
    """-> dx (M, K) in x's dtype (an fp32 residual gets an fp32 gradient), dγ, dA (N, K)."""
    x, gamma, A = x.contiguous(), gamma.contiguous(), A.contiguous()
    (M, K), N = x.shape, A.shape[0]
    dH, dS = dH.contiguous(), dS.float().contiguous()
    if bwd == "torch":
        return local_ops.norm_down_ref_backward(dH, dS, x, gamma, A)
    dA = local_ops.norm_down_dA(dH, x, gamma, A)   # (N, K): cuBLAS on both paths
    up, ieee = tk.dot_flags(A)
    dx = torch.empty_like(x)
    dg = torch.zeros(triton.cdiv(M, tk.MIN_BM), K, dtype=torch.float32, device=x.device)  # a row
    # block each; K blocks the fast axis: the programs running together share their dH row block
    grid = lambda META: (triton.cdiv(K, META["BK"]), triton.cdiv(M, META["BM"]))
    tk.launcher("norm_down_dx", A, x)[grid](dH, A, x, gamma, dS, dx, dg, M, N, K, dH.stride(0),
                                         A.stride(0), x.stride(0), tk.bucket(M), UPCAST=up,
                                         IEEE=ieee)
    return dx, dg.sum(0).to(gamma.dtype), dA


@norm_down_backward.register_fake
def _(dH, dS, x, gamma, A, bwd):
    return torch.empty_like(x), torch.empty_like(gamma), torch.empty_like(A)


def _norm_down_save(ctx, inputs, output):
    x, gamma, A, _, ctx.bwd = inputs
    ctx.save_for_backward(x, gamma, A)


def _norm_down_grad(ctx, dH, dS):
    x, gamma, A = ctx.saved_tensors
    dS = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device) if dS is None else dS
    return *norm_down_backward(dH, dS, x, gamma, A, ctx.bwd), None, None


norm_down_op.register_autograd(_norm_down_grad, setup_context=_norm_down_save)


@torch.library.custom_op("boost::grouped_expand", mutates_args=())
def grouped_expand_op(Z: Tensor, Bs: list[Tensor], fwd: str, bwd: str) -> Tensor:
    """Z (M, G·r), Bs [(n_g, r)] -> Y (M, Σn_g) in Z's dtype, y_g = z_g·B_gᵀ."""
    Z, r = Z.contiguous(), Bs[0].shape[1]
    if fwd == "torch":
        return torch.cat(local_ops.grouped_expand_ref(Z, Bs), -1)
    widths = [B.shape[0] for B in Bs]
    offsets = [sum(widths[:g]) for g in range(len(widths))]
    Y = torch.empty(Z.shape[0], sum(widths), dtype=Z.dtype, device=Z.device)
    groups = [tk.Group(P=Z.shape[0], Q=n, K=r, a_col=g * r, c_col=o)
              for g, (n, o) in enumerate(zip(widths, offsets))]
    # each B_g (n_g, r) read where it lies, transposed by its strides, cast to Z's dtype in the
    # kernel's registers: no stacked or cast copy of the weights a call
    tk.grouped_mm(tk.Operand(Z, Z.shape[1], 1), [tk.Operand(B.contiguous(), 1, r) for B in Bs],
                  tk.Operand(Y, Y.stride(0), 1), groups, call="expand")
    return Y


@grouped_expand_op.register_fake
def _(Z, Bs, fwd, bwd):
    return Z.new_empty(Z.shape[0], sum(B.shape[0] for B in Bs))


@torch.library.custom_op("boost::grouped_expand_backward", mutates_args=())
def grouped_expand_backward(dY: Tensor, Z: Tensor, Bs: list[Tensor], bwd: str) -> list[Tensor]:
    """-> [dZ (M, G·r), dB_1, ..., dB_G]: dz_g = dy_g·B_g, and dB_g = dy_gᵀ·z_g on cuBLAS (see
    grouped_expand_dB)."""
    dY, Z = dY.contiguous(), Z.contiguous()
    dys = dY.split([B.shape[0] for B in Bs], -1)
    dZ = (local_ops.grouped_expand_dz_ref(dys, Bs) if bwd == "torch" else
          grouped_expand_dz_op(dY, Bs))
    return [dZ, *local_ops.grouped_expand_dB(dys, Z, Bs)]


@grouped_expand_backward.register_fake
def _(dY, Z, Bs, bwd):
    return [torch.empty_like(Z), *[torch.empty_like(B) for B in Bs]]


def _grouped_expand_save(ctx, inputs, output):
    Z, Bs, _, ctx.bwd = inputs
    ctx.save_for_backward(Z, *Bs)


def _grouped_expand_grad(ctx, dY):
    Z, *Bs = ctx.saved_tensors
    dZ, *dBs = grouped_expand_backward(dY, Z, Bs, ctx.bwd)
    return dZ, dBs, None, None


grouped_expand_op.register_autograd(_grouped_expand_grad, setup_context=_grouped_expand_save)


@torch.library.custom_op("boost::grouped_expand_dz", mutates_args=())
def grouped_expand_dz_op(dY: Tensor, Bs: list[Tensor]) -> Tensor:
    """Triton's dY (M, Σn_g), Bs [(n_g, r)] -> dZ (M, G·r) in dY's dtype: dz_g = dy_g·B_g."""
    dY, r = dY.contiguous(), Bs[0].shape[1]
    widths = [B.shape[0] for B in Bs]
    offsets = [sum(widths[:g]) for g in range(len(widths))]
    dZ = torch.empty(dY.shape[0], r * len(widths), dtype=dY.dtype, device=dY.device)
    groups = [tk.Group(P=dY.shape[0], Q=r, K=n, a_col=o, c_col=g * r)
              for g, (n, o) in enumerate(zip(widths, offsets))]
    tk.grouped_mm(tk.Operand(dY, dY.shape[1], 1), [tk.Operand(B.contiguous(), r, 1) for B in Bs],
                  tk.Operand(dZ, dZ.shape[1], 1), groups, call="dz")   # (each B where it lies)
    return dZ


@grouped_expand_dz_op.register_fake
def _(dY, Bs):
    return dY.new_empty(dY.shape[0], Bs[0].shape[1] * len(Bs))


@torch.library.custom_op("boost::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, gamma: Tensor, eps: float, fwd: str,
                bwd: str) -> tuple[Tensor, Tensor]:
    """x (M, N), γ (N) -> y (M, N) in x's dtype, and 1/rms (M) fp32 for backward."""
    x = x.contiguous()
    M, N = x.shape
    if fwd == "torch":
        return local_ops.rms_norm_ref(x, gamma, eps).to(x.dtype), local_ops.rms_stat(x, eps)
    y = torch.empty_like(x)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(N)
    tk.rms_fwd[(triton.cdiv(M, tk.rows()),)](x, gamma, y, rstd, M, N, eps, ROWS=tk.rows(),
                                             BLOCK=block, num_warps=tk.rms_warps(block))
    return y, rstd


@rms_norm_op.register_fake
def _(x, gamma, eps, fwd, bwd):
    return torch.empty_like(x), x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("boost::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: Tensor, x: Tensor, gamma: Tensor, rstd: Tensor,
                      bwd: str) -> tuple[Tensor, Tensor]:
    """dx = rstd·(dy⊙γ − x̂·mean(dy⊙γ⊙x̂)), dγ = Σ_rows dy⊙x̂."""
    dy, x = dy.contiguous(), x.contiguous()
    M, N = x.shape
    if bwd == "torch":
        return local_ops.rms_norm_ref_backward(dy, x, gamma, rstd)
    dx = torch.empty_like(x)
    grid = (triton.cdiv(M, tk.rows()),)
    dg = torch.empty(grid[0], N, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(N)
    tk.rms_bwd[grid](dy, x, gamma, rstd, dx, dg, M, N, ROWS=tk.rows(), BLOCK=block,
                     num_warps=tk.rms_warps(block, backward=True))
    return dx, dg.sum(0).to(gamma.dtype)


@rms_norm_backward.register_fake
def _(dy, x, gamma, rstd, bwd):
    return torch.empty_like(x), torch.empty_like(gamma)


def _rms_norm_save(ctx, inputs, output):
    x, gamma, _, _, ctx.bwd = inputs
    ctx.save_for_backward(x, gamma, output[1])


def _rms_norm_grad(ctx, dy, _):
    x, gamma, rstd = ctx.saved_tensors
    return *rms_norm_backward(dy, x, gamma, rstd, ctx.bwd), None, None, None


rms_norm_op.register_autograd(_rms_norm_grad, setup_context=_rms_norm_save)


if triton is not None:   # the Triton side of local_ops.py's dispatch
    local_ops.triton_ops = sys.modules[__name__]
