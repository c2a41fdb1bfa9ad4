"""kernels.py: the local compute ops of bottleneck-aware TP: PyTorch references and Triton kernels.

BOOST (arXiv 2512.12131) sections 3-4. parallel.py calls only `norm_down`, `grouped_up` and
`rms_norm`; `select()` (train.py's --kernels=auto|triton|torch) decides whether they run the
PyTorch reference (the specification, and the CPU path) or the Triton kernels, forward and backward.

- norm_down: the local half of online RMSNorm fused with a grouped down-projection. For a rank's
  slice x (M, K) of the residual stream, its slice γ (K) of the gain and its columns A (N, K) of the
  grouped down-projection, one pass over x gives H = (x ⊙ γ)·Aᵀ (M, N) and S = Σ_k x² (M, 1) (fp32,
  accumulated inside the GEMM's K loop). After the all-reduce of [H | S]:
  RMSNorm(x_full)·A_fullᵀ = H / sqrt(S/d + ε). Backward: d(xγ) = dH·A, dx = d(xγ)⊙γ + 2·x·dS,
  dγ = Σ_m d(xγ)⊙x, dA = dHᵀ·(x⊙γ).
- grouped_up: the up-projections y_g = z_g·B_gᵀ of G latents of equal rank r in one launch; each
  group has its own output width n_g (with GQA q is wider than k and v). Backward as grouped GEMMs:
  dz_g = dy_g·B_g, dB_g = dy_gᵀ·z_g.
- rms_norm: plain RMSNorm over the last dim (replicated-stream layouts, the final norm).

On a machine without CUDA the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set
here before the kernels are defined); it computes bf16 dots wrongly, so tiles are upcast there.
"""
import functools
import os

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:
    import triton
    import triton.language as tl
except ImportError:  # a laptop without Triton: the reference path still works
    triton = None

BACKENDS = ("auto", "triton", "torch")
_backend = "torch"


def select(mode, device):
    """Choose the implementation: auto = Triton on CUDA, the reference elsewhere."""
    global _backend
    if mode not in BACKENDS:
        raise ValueError(f"kernels={mode} is not one of {', '.join(BACKENDS)}")
    if mode == "triton" and triton is None:
        raise ValueError("kernels=triton but Triton is not installed")
    if mode == "triton" and not str(device).startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("kernels=triton on a CPU needs TRITON_INTERPRET=1 set before start")
    _backend = mode if mode != "auto" else ("triton" if triton and str(device).startswith("cuda") else "torch")
    return _backend


# ------------------------------------------------------------------------- PyTorch references

def norm_down_ref(x, gamma, A):
    """x (..., K), gamma (K,), A (N, K) -> H (..., N), S (..., 1) float32."""
    return (x * gamma) @ A.t(), x.float().pow(2).sum(-1, keepdim=True)


def grouped_up_ref(z, Bs):
    """z (..., G·r) the concatenated latents, Bs [(n_g, r)] -> [z_g·B_gᵀ (..., n_g)]: one GEMM per
    group on a strided view of z, so nothing is copied (a stacked bmm copies z and every B_g twice)."""
    return [zg @ B.t() for zg, B in zip(z.split(Bs[0].shape[1], -1), Bs)]


def rms_norm_ref(x, gamma, eps):
    return F.rms_norm(x, (x.shape[-1],), gamma, eps)


# ------------------------------------------------------------------------- dispatch

def _autocast(*tensors):
    """Custom Functions are not autocast: give them the autocast dtype ourselves."""
    if tensors[0].is_cuda and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        return [t.to(dtype) for t in tensors]
    return [t.to(tensors[0].dtype) for t in tensors]


def norm_down(x, gamma, A):
    if _backend == "torch":
        return norm_down_ref(x, gamma, A)
    x2, gamma, A = _autocast(x.reshape(-1, x.shape[-1]), gamma, A)
    H, S = NormDown.apply(x2, gamma, A)
    return H.view(*x.shape[:-1], -1), S.view(*x.shape[:-1], 1)


def grouped_up(z, Bs):
    if _backend == "torch":
        return grouped_up_ref(z, Bs)
    z2, W = _autocast(z.reshape(-1, z.shape[-1]), torch.cat(Bs))  # autograd of cat splits dW
    Y = GroupedUp.apply(z2, W, tuple(B.shape[0] for B in Bs))
    return [y.view(*z.shape[:-1], -1) for y in Y.split([B.shape[0] for B in Bs], -1)]


# grouped_up's backward in two halves, for parallel.CopyUp, which all-reduces dz while dB computes
def grouped_up_dz(dys, Bs):
    """[dy_g (..., n_g)], [B_g (n_g, r)] -> dz (..., G·r), dz_g = dy_g·B_g."""
    if _backend == "torch":
        return torch.cat([dy @ B.to(dy.dtype) for dy, B in zip(dys, Bs)], -1)
    dY = torch.cat([dy.reshape(-1, dy.shape[-1]) for dy in dys], -1)
    W = torch.cat(Bs).to(dY.dtype)
    return _up_dz(dY, W, [B.shape[0] for B in Bs]).view(*dys[0].shape[:-1], -1)


def grouped_up_dB(dys, z, Bs):
    """-> [dB_g (n_g, r)], dB_g = dy_gᵀ·z_g over all tokens, in each B's dtype."""
    zs = z.split(Bs[0].shape[1], -1)
    if _backend == "torch":
        return [(dy.reshape(-1, dy.shape[-1]).t() @ zg.reshape(-1, zg.shape[-1]).to(dy.dtype)).to(B.dtype)
                for dy, zg, B in zip(dys, zs, Bs)]
    dY = torch.cat([dy.reshape(-1, dy.shape[-1]) for dy in dys], -1)
    dW = _up_dW(dY, z.reshape(-1, z.shape[-1]).to(dY.dtype), Bs[0].shape[1], [B.shape[0] for B in Bs])
    return [d.to(B.dtype) for d, B in zip(dW.split([B.shape[0] for B in Bs]), Bs)]


def rms_norm(x, gamma, eps):
    if _backend == "torch":
        return rms_norm_ref(x, gamma, eps)
    x2, gamma = _autocast(x.reshape(-1, x.shape[-1]), gamma)
    return RMSNormFn.apply(x2, gamma, eps).view(x.shape)


# ------------------------------------------------------------------------- Triton kernels

def _blocks():
    """Tile sizes: small programs cost little in the interpreter; 64x64x32 tiles on a GPU."""
    return (32, 32, 32) if os.environ.get("TRITON_INTERPRET") == "1" else (64, 64, 32)


def _flags(t):
    """(UPCAST, IEEE): upcast tiles under the interpreter; exact fp32 dots for fp32 inputs."""
    return os.environ.get("TRITON_INTERPRET") == "1", t.dtype == torch.float32


if triton is not None:
    @triton.jit
    def _dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _norm_down_fwd(x_ptr, g_ptr, a_ptr, h_ptr, s_ptr, M, N, K, s_xm, s_an, s_hm,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """H tile (BM, BN) = (x⊙γ)·Aᵀ; the programs of the first N tile also store S = Σ x²."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        ss = tl.zeros((BM,), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + rm[:, None] * s_xm + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            g = tl.load(g_ptr + rk, mask=rk < K, other=0.0)
            a = tl.load(a_ptr + rn[:, None] * s_an + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
            xg = (xf * g.to(tl.float32)[None, :]).to(a.dtype)
            acc += _dot(xg, tl.trans(a), UPCAST, IEEE)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(h_ptr + rm[:, None] * s_hm + rn[None, :], acc.to(h_ptr.dtype.element_ty), mask=mask)
        if pid_n == 0:
            tl.store(s_ptr + rm, ss, mask=rm < M)

    @triton.jit
    def _norm_down_dx(dh_ptr, a_ptr, x_ptr, g_ptr, ds_ptr, dx_ptr, dg_ptr, M, N, K, s_dhm, s_an, s_xm,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """dx tile (BM, BK) = (dH·A)⊙γ + 2·x·dS, and this row block's partial dγ = Σ_m (dH·A)⊙x."""
        pid_m, pid_k = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rk = pid_k * BK + tl.arange(0, BK)
        acc = tl.zeros((BM, BK), dtype=tl.float32)
        for n0 in range(0, N, BN):
            rn = n0 + tl.arange(0, BN)
            dh = tl.load(dh_ptr + rm[:, None] * s_dhm + rn[None, :], mask=(rm[:, None] < M) & (rn[None, :] < N), other=0.0)
            a = tl.load(a_ptr + rn[:, None] * s_an + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
            acc += _dot(dh, a, UPCAST, IEEE)
        mask = (rm[:, None] < M) & (rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * s_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        ds = tl.load(ds_ptr + rm, mask=rm < M, other=0.0)
        dx = acc * g[None, :] + 2.0 * x * ds[:, None]
        tl.store(dx_ptr + rm[:, None] * s_xm + rk[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dg_ptr + pid_m * K + rk, tl.sum(acc * x, axis=0), mask=rk < K)

    @triton.jit
    def _grouped_mm(a_ptr, b_ptr, c_ptr, tiles_ptr, meta_ptr, s_ap, s_ak, s_bk, s_bq, s_cp, s_cq,
                    BP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                    UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """One tile of C_g (P_g, Q_g) = A_g (P_g, K_g) · B_g (K_g, Q_g), for the group this tile is in.
        tiles: (group, p0, q0) per program; meta per group: P, Q, K and the row and column offsets
        of A_g, B_g, C_g inside A, B, C."""
        t = tl.program_id(0)
        g = tl.load(tiles_ptr + 3 * t)
        rp = tl.load(tiles_ptr + 3 * t + 1) + tl.arange(0, BP)
        rq = tl.load(tiles_ptr + 3 * t + 2) + tl.arange(0, BQ)
        m = meta_ptr + 9 * g
        P, Q, K = tl.load(m), tl.load(m + 1), tl.load(m + 2)
        a_row, a_col, b_row = tl.load(m + 3), tl.load(m + 4), tl.load(m + 5)
        b_col, c_row, c_col = tl.load(m + 6), tl.load(m + 7), tl.load(m + 8)
        acc = tl.zeros((BP, BQ), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            a = tl.load(a_ptr + (a_row + rp)[:, None] * s_ap + (a_col + rk)[None, :] * s_ak,
                        mask=(rp[:, None] < P) & (rk[None, :] < K), other=0.0)
            b = tl.load(b_ptr + (b_row + rk)[:, None] * s_bk + (b_col + rq)[None, :] * s_bq,
                        mask=(rk[:, None] < K) & (rq[None, :] < Q), other=0.0)
            acc += _dot(a, b, UPCAST, IEEE)
        tl.store(c_ptr + (c_row + rp)[:, None] * s_cp + (c_col + rq)[None, :] * s_cq,
                 acc.to(c_ptr.dtype.element_ty), mask=(rp[:, None] < P) & (rq[None, :] < Q))

    @triton.jit
    def _rms_fwd(x_ptr, g_ptr, y_ptr, rstd_ptr, M, N, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        g = tl.load(g_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        for row in range(pid * ROWS, pid * ROWS + ROWS):
            if row < M:
                x = tl.load(x_ptr + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
                rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
                tl.store(y_ptr + row * N + cols, (x * rstd * g).to(y_ptr.dtype.element_ty), mask=cols < N)
                tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _rms_bwd(dy_ptr, x_ptr, g_ptr, rstd_ptr, dx_ptr, dg_ptr, M, N, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """dx = rstd·(dy⊙γ − x̂·mean(dy⊙γ⊙x̂)); this program's partial dγ = Σ_rows dy⊙x̂."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        g = tl.load(g_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        dg = tl.zeros((BLOCK,), dtype=tl.float32)
        for row in range(pid * ROWS, pid * ROWS + ROWS):
            if row < M:
                x = tl.load(x_ptr + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
                rstd = tl.load(rstd_ptr + row)
                xhat = x * rstd
                wdy = dy * g
                c = tl.sum(xhat * wdy, axis=0) / N
                tl.store(dx_ptr + row * N + cols, ((wdy - xhat * c) * rstd).to(dx_ptr.dtype.element_ty), mask=cols < N)
                dg += dy * xhat
        tl.store(dg_ptr + pid * N + cols, dg, mask=cols < N)


@functools.lru_cache(maxsize=64)
def _tile_schedule(groups, BP, BQ, device):
    """The (group, p0, q0) of every program and the groups' metadata, as device tensors; cached,
    since the same shapes come back every step."""
    tiles = [(g, p0, q0) for g, (P, Q, *_) in enumerate(groups)
             for p0 in range(0, P, BP) for q0 in range(0, Q, BQ)]
    return (torch.tensor(tiles, dtype=torch.int64, device=device),
            torch.tensor(groups, dtype=torch.int64, device=device))


def grouped_mm(A, B, C, groups):
    """Launch _grouped_mm: groups is a list of (P, Q, K, a_row, a_col, b_row, b_col, c_row, c_col);
    A, B, C are given as (tensor, stride along P/K, stride along K/Q) views via their strides."""
    (a, s_ap, s_ak), (b, s_bk, s_bq), (c, s_cp, s_cq) = A, B, C
    BP, BQ, BK = _blocks()
    tiles_t, meta_t = _tile_schedule(tuple(map(tuple, groups)), BP, BQ, c.device)
    up, ieee = _flags(a)
    _grouped_mm[(tiles_t.shape[0],)](a, b, c, tiles_t, meta_t, s_ap, s_ak, s_bk, s_bq, s_cp, s_cq,
                                     BP=BP, BQ=BQ, BK=BK, UPCAST=up, IEEE=ieee)
    return c


class NormDown(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, A):
        x, gamma, A = x.contiguous(), gamma.contiguous(), A.contiguous()
        (M, K), N = x.shape, A.shape[0]
        H = torch.empty(M, N, dtype=x.dtype, device=x.device)
        S = torch.empty(M, dtype=torch.float32, device=x.device)
        BM, BN, BK = _blocks()
        up, ieee = _flags(x)
        _norm_down_fwd[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
            x, gamma, A, H, S, M, N, K, x.stride(0), A.stride(0), H.stride(0),
            BM=BM, BN=BN, BK=BK, UPCAST=up, IEEE=ieee)
        ctx.save_for_backward(x, gamma, A)
        return H, S

    @staticmethod
    def backward(ctx, dH, dS):
        x, gamma, A = ctx.saved_tensors
        (M, K), N = x.shape, A.shape[0]
        dH = dH.contiguous()
        dS = torch.zeros(M, dtype=torch.float32, device=x.device) if dS is None else dS.float().contiguous()
        BM, BN, BK = _blocks()
        up, ieee = _flags(x)
        dx = torch.empty_like(x)
        dg = torch.empty(triton.cdiv(M, BM), K, dtype=torch.float32, device=x.device)
        _norm_down_dx[(triton.cdiv(M, BM), triton.cdiv(K, BK))](
            dH, A, x, gamma, dS, dx, dg, M, N, K, dH.stride(0), A.stride(0), x.stride(0),
            BM=BM, BN=BN, BK=BK, UPCAST=up, IEEE=ieee)
        xg = x * gamma                                                     # (M, K)
        dA = torch.empty_like(A)
        grouped_mm((dH, 1, N), (xg, K, 1), (dA, K, 1), [(N, K, M, 0, 0, 0, 0, 0, 0)])  # dHᵀ·(x⊙γ)
        return dx, dg.sum(0).to(gamma.dtype), dA


class GroupedUp(torch.autograd.Function):
    """Z (M, G·r), W (Σn_g, r) the stacked B_g, widths (n_g) -> Y (M, Σn_g)."""

    @staticmethod
    def forward(ctx, Z, W, widths):
        Z, W = Z.contiguous(), W.contiguous()
        (M, R), r = Z.shape, W.shape[1]
        offsets = [sum(widths[:g]) for g in range(len(widths))]
        Y = torch.empty(M, sum(widths), dtype=Z.dtype, device=Z.device)
        grouped_mm((Z, R, 1), (W, 1, r), (Y, Y.stride(0), 1),
                   [(M, n, r, 0, g * r, 0, o, 0, o) for g, (n, o) in enumerate(zip(widths, offsets))])
        ctx.save_for_backward(Z, W)
        ctx.widths = widths
        return Y

    @staticmethod
    def backward(ctx, dY):
        Z, W = ctx.saved_tensors
        dY = dY.contiguous()
        return _up_dz(dY, W, ctx.widths), _up_dW(dY, Z, W.shape[1], ctx.widths), None


def _up_dz(dY, W, widths):
    """dY (M, Σn_g), W (Σn_g, r) -> dZ (M, G·r): dz_g = dy_g·B_g."""
    dY, W = dY.contiguous(), W.contiguous()
    (M, n_all), r = dY.shape, W.shape[1]
    offsets = [sum(widths[:g]) for g in range(len(widths))]
    dZ = torch.empty(M, r * len(widths), dtype=dY.dtype, device=dY.device)
    grouped_mm((dY, n_all, 1), (W, r, 1), (dZ, dZ.shape[1], 1),
               [(M, r, n, 0, o, o, 0, 0, g * r) for g, (n, o) in enumerate(zip(widths, offsets))])
    return dZ


def _up_dW(dY, Z, r, widths):
    """dY (M, Σn_g), Z (M, G·r) -> dW (Σn_g, r): dB_g = dy_gᵀ·z_g."""
    dY, Z = dY.contiguous(), Z.contiguous()
    (M, n_all), R = dY.shape, Z.shape[1]
    offsets = [sum(widths[:g]) for g in range(len(widths))]
    dW = torch.empty(n_all, r, dtype=Z.dtype, device=Z.device)
    grouped_mm((dY, 1, n_all), (Z, R, 1), (dW, r, 1),
               [(n, r, M, o, 0, 0, g * r, o, 0) for g, (n, o) in enumerate(zip(widths, offsets))])
    return dW


def _rows():
    return 4 if os.environ.get("TRITON_INTERPRET") == "1" else 16


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, eps):
        x = x.contiguous()
        M, N = x.shape
        y = torch.empty_like(x)
        rstd = torch.empty(M, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(M, _rows()),)
        _rms_fwd[grid](x, gamma, y, rstd, M, N, eps, ROWS=_rows(), BLOCK=triton.next_power_of_2(N))
        ctx.save_for_backward(x, gamma, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gamma, rstd = ctx.saved_tensors
        M, N = x.shape
        dx = torch.empty_like(x)
        grid = (triton.cdiv(M, _rows()),)
        dg = torch.empty(grid[0], N, dtype=torch.float32, device=x.device)
        _rms_bwd[grid](dy.contiguous(), x, gamma, rstd, dx, dg, M, N, ROWS=_rows(), BLOCK=triton.next_power_of_2(N))
        return dx, dg.sum(0).to(gamma.dtype), None
