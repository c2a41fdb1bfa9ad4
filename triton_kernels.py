"""triton_kernels.py: the Triton kernels behind local_ops.py, their tile configurations per GPU, and
their launches.

BOOST (arXiv 2512.12131) sections 3-4; what each kernel computes is local_ops.py's docstring. The
GEMM-shaped kernels (the fused online-RMSNorm + down-projection, its input gradient, the grouped
GEMM) are `triton.autotune`d on CUDA over a short list of tile configurations for the GPU's
architecture (A100, sm_80: BK 32, cp.async pipelines of 3-4 stages; H100/H200, sm_90: BK 64 for
wgmma), keyed on the shapes, as in Triton's matmul tutorials and Liger-Kernel. Under Triton's CPU
interpreter (TRITON_INTERPRET=1, set here when there is no CUDA) there is one small configuration,
and bf16 tiles are upcast since the interpreter's bf16 dots are wrong. test_kernels.py compiles
every configuration for sm_80 and sm_90 without a GPU (tools/gpu_compile.py) and checks tensor-core
instructions and that nothing spills.
"""
import functools
import os
from typing import NamedTuple

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402  (after TRITON_INTERPRET: it decides what triton.jit builds)
import triton.language as tl  # noqa: E402

from local_ops import bucket  # noqa: E402  (the autotuners' key for a token count)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# (block rows, block columns, block K, num_warps, num_stages) of the GEMM-shaped kernels, per GPU
# architecture and input width: bf16/fp16 tiles feed the tensor cores (mma on sm_80, wgmma on
# sm_90); fp32 inputs take exact IEEE dots on the FMA units and get smaller tiles. Every entry
# compiles without register spills for every kernel (tools/gpu_compile.py; BK 64 spilled on sm_90
# in the grouped GEMM)
GEMM_CONFIGS = {
    (80, 16): [(128, 128, 32, 8, 3), (128, 64, 32, 8, 3), (64, 128, 32, 8, 3), (64, 64, 32, 4, 4)],
    (90, 16): [(128, 128, 32, 8, 3), (128, 64, 32, 8, 3), (64, 128, 32, 8, 3), (64, 64, 32, 4, 3)],
    (80, 32): [(128, 64, 32, 8, 3), (64, 128, 32, 8, 3), (64, 64, 32, 4, 2), (32, 64, 32, 4, 2)],
    (90, 32): [(64, 64, 32, 4, 2), (64, 32, 32, 4, 2), (32, 64, 32, 4, 2), (64, 64, 16, 4, 2)],
    # norm_down's input gradient under bf16 autocast: bf16 A and dH beside the fp32 residual x and
    # its gradient dx, whose tiles 128x128 cannot hold in registers (120 B spilled on sm_90, 8 B on
    # sm_80, tools/gpu_compile.py's "mixed" rows)
    (80, "x32"): [(128, 64, 32, 8, 3), (64, 128, 32, 8, 3), (64, 64, 32, 4, 4)],
    (90, "x32"): [(128, 64, 32, 8, 3), (64, 128, 32, 8, 3), (64, 64, 32, 4, 3)],
}
INTERPRETER_CONFIG = (32, 32, 32, 1, 1)
ROWS_CONFIG = {"ROWS": 16}   # RMSNorm: rows per program (4 under the interpreter); warps: rms_warps


def arch(device=None):
    """The architecture whose list GEMM_CONFIGS gives for `device` (a CUDA device; default the
    current one): 90 from Hopper on, else 80; None under the interpreter. Asked at a kernel's first
    launch on a device, not at import: one process may drive GPUs of two kinds."""
    if INTERPRET or not torch.cuda.is_available():
        return None
    major, _ = torch.cuda.get_device_capability(device)
    return 90 if major >= 9 else 80


def gemm_configs(names, bits, arch_):
    """triton.Configs over the block names, e.g. ("BM", "BN", "BK"), for inputs of `bits` (16, 32,
    "x32")
    on GPUs of architecture arch_ (80 or 90; None: the interpreter's one configuration)."""
    rows = [INTERPRETER_CONFIG] if arch_ is None else GEMM_CONFIGS[(arch_, bits)]
    return [triton.Config(dict(zip(names, r[:3])), num_warps=r[3], num_stages=r[4]) for r in rows]


def dot_flags(t):
    """(UPCAST, IEEE): upcast tiles under the interpreter; exact fp32 dots for fp32 inputs."""
    return INTERPRET, t.dtype == torch.float32


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)

@triton.jit
def _at(rows, cols, s_row, s_col):
    """Element offsets (rows[:, None]·s_row + cols[None, :]·s_col) in int64: tokens × width passes
    2^31 at a 30B model's gate/up from about 60k tokens a rank, where int32 products would wrap."""
    return rows.to(tl.int64)[:, None] * s_row + cols.to(tl.int64)[None, :] * s_col

@triton.jit
def _norm_down_fwd(x_ptr, g_ptr, a_ptr, h_ptr, s_ptr, M, N, K, s_xm, s_an, s_hm, M_KEY,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """H tile (BM, BN) = (x⊙γ)·Aᵀ; the programs of the first N tile also store S = Σ x². M_KEY (M
    rounded up to a power of two) is only the autotuner's key: a new M need not be tuned again."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    ss = tl.zeros((BM,), dtype=tl.float32)
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + _at(rn, rk, s_an, 1)   # (made once, advanced by BK: A's offsets)
    for k0 in range(0, K, BK):
        # x's offsets rebuilt each step: a second tile of 64-bit pointers kept across the loop
        # spilled 24 B on sm_90 in fp32 (64x64x32; tools/gpu_compile.py)
        x = tl.load(x_ptr + _at(rm, k0 + rk, s_xm, 1),
                    mask=(rm[:, None] < M) & (k0 + rk[None, :] < K), other=0.0)
        g = tl.load(g_ptr + k0 + rk, mask=k0 + rk < K, other=0.0)
        a = tl.load(a_ptrs, mask=(rn[:, None] < N) & (k0 + rk[None, :] < K), other=0.0)
        a_ptrs += BK
        xf = x.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
        xg = (xf * g.to(tl.float32)[None, :]).to(a.dtype)
        acc += _dot(xg, tl.trans(a), UPCAST, IEEE)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(h_ptr + _at(rm, rn, s_hm, 1), acc.to(h_ptr.dtype.element_ty), mask=mask)
    if pid_n == 0:
        tl.store(s_ptr + rm, ss, mask=rm < M)

@triton.jit
def _norm_down_dx(dh_ptr, a_ptr, x_ptr, g_ptr, ds_ptr, dx_ptr, dg_ptr, M, N, K, s_dhm, s_an, s_xm,
                  M_KEY,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """dx tile (BM, BK) = (dH·A)⊙γ + 2·x·dS, and this row block's partial dγ = Σ_m (dH·A)⊙x. The
    K blocks are the grid's fast axis (programs running together read the same dH rows), and BK,
    the output's width, takes the wide entry of a configuration (KERNELS' block names)."""
    pid_k, pid_m = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rk = pid_k * BK + tl.arange(0, BK)
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    rn = tl.arange(0, BN)
    dh_ptrs = dh_ptr + _at(rm, rn, s_dhm, 1)   # (the offsets made once; the pointers advance)
    a_ptrs = a_ptr + _at(rn, rk, s_an, 1)
    for n0 in range(0, N, BN):
        dh = tl.load(dh_ptrs, mask=(rm[:, None] < M) & (n0 + rn[None, :] < N), other=0.0)
        a = tl.load(a_ptrs, mask=(n0 + rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        dh_ptrs += BN
        a_ptrs += BN * s_an
        acc += _dot(dh, a, UPCAST, IEEE)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + _at(rm, rk, s_xm, 1), mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
    ds = tl.load(ds_ptr + rm, mask=rm < M, other=0.0)
    dx = acc * g[None, :] + 2.0 * x * ds[:, None]
    tl.store(dx_ptr + _at(rm, rk, s_xm, 1), dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dg_ptr + pid_m.to(tl.int64) * K + rk, tl.sum(acc * x, axis=0), mask=rk < K)

@triton.jit
def _grouped_mm(a_ptr, b0_ptr, b1_ptr, b2_ptr, c_ptr, meta_ptr, s_ap, s_ak, s_bk, s_bq, s_cp,
                s_cq, P_KEY, Q_KEY, K_KEY, CALL_KEY, G: tl.constexpr, BP: tl.constexpr,
                BQ: tl.constexpr, BK: tl.constexpr,
                UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """One tile of C_g (P_g, Q_g) = A_g (P_g, K_g) · B_g (K_g, Q_g). meta holds per group P, Q, K
    and the row and column offsets of A_g, B_g, C_g inside A, B_g's own tensor (b0, b1, b2: the
    Bs where they lie, G ≤ 3, read in their own dtype and cast to A's in registers, so nothing
    stacks or casts them first), C; the programs take the groups' tiles in order, each finding its
    group from the tile counts. P_KEY, Q_KEY, K_KEY (the largest group's sizes, rounded up to
    powers of two) and CALL_KEY (which of CALLS launched it: their strides differ) are only the
    autotuner's key."""
    t = tl.program_id(0)
    g = 0
    first = 0
    start = 0
    for i in tl.static_range(G):
        tiles = tl.cdiv(tl.load(meta_ptr + 9 * i), BP) * tl.cdiv(tl.load(meta_ptr + 9 * i + 1), BQ)
        inside = (t >= start) & (t < start + tiles)
        g = tl.where(inside, i, g)
        first = tl.where(inside, start, first)
        start += tiles
    m = meta_ptr + 9 * g
    P, Q, K = tl.load(m), tl.load(m + 1), tl.load(m + 2)
    q_tiles = tl.cdiv(Q, BQ)
    rp = ((t - first) // q_tiles) * BP + tl.arange(0, BP)
    rq = ((t - first) % q_tiles) * BQ + tl.arange(0, BQ)
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + _at(tl.load(m + 3) + rp, tl.load(m + 4) + rk, s_ap, s_ak)
    b_ptr = b0_ptr
    if G > 1:
        b_ptr = tl.where(g == 1, b1_ptr, b_ptr)
    if G > 2:
        b_ptr = tl.where(g == 2, b2_ptr, b_ptr)
    b_ptrs = b_ptr + _at(tl.load(m + 5) + rk, tl.load(m + 6) + rq, s_bk, s_bq)
    acc = tl.zeros((BP, BQ), dtype=tl.float32)
    for k0 in range(0, K, BK):  # the pointers advance by BK along K, as in Triton's matmul tutorial
        a = tl.load(a_ptrs, mask=(rp[:, None] < P) & (k0 + rk[None, :] < K), other=0.0)
        b = tl.load(b_ptrs, mask=(k0 + rk[:, None] < K) & (rq[None, :] < Q), other=0.0)
        b = b.to(a.dtype)
        acc += _dot(a, b, UPCAST, IEEE)
        a_ptrs += BK * s_ak
        b_ptrs += BK * s_bk
    tl.store(c_ptr + _at(tl.load(m + 7) + rp, tl.load(m + 8) + rq, s_cp, s_cq),
             acc.to(c_ptr.dtype.element_ty), mask=(rp[:, None] < P) & (rq[None, :] < Q))


@triton.jit
def rms_fwd(x_ptr, g_ptr, y_ptr, rstd_ptr, M, N, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    g = tl.load(g_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    for i in range(ROWS):
        row = pid.to(tl.int64) * ROWS + i   # int64: rows × N passes 2^31 on long batches
        if row < M:
            at = row * N + cols
            x = tl.load(x_ptr + at, mask=cols < N, other=0.0).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
            tl.store(y_ptr + at, (x * rstd * g).to(y_ptr.dtype.element_ty), mask=cols < N)
            tl.store(rstd_ptr + row, rstd)

@triton.jit
def rms_bwd(dy_ptr, x_ptr, g_ptr, rstd_ptr, dx_ptr, dg_ptr, M, N, ROWS: tl.constexpr,
            BLOCK: tl.constexpr):
    """dx = rstd·(dy⊙γ − x̂·mean(dy⊙γ⊙x̂)); this program's partial dγ = Σ_rows dy⊙x̂."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    g = tl.load(g_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    dg = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(ROWS):
        row = pid.to(tl.int64) * ROWS + i   # int64: rows × N passes 2^31 on long batches
        if row < M:
            at = row * N + cols
            x = tl.load(x_ptr + at, mask=cols < N, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + at, mask=cols < N, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            xhat = x * rstd
            wdy = dy * g
            c = tl.sum(xhat * wdy, axis=0) / N
            tl.store(dx_ptr + at, ((wdy - xhat * c) * rstd).to(dx_ptr.dtype.element_ty),
                     mask=cols < N)
            dg += dy * xhat
    tl.store(dg_ptr + pid.to(tl.int64) * N + cols, dg, mask=cols < N)


# ------------------------------------------------------------------------- autotuned launches

# the autotuned kernels: name -> (JIT function, block names, autotune key, autotune options)
KERNELS = {
    "norm_down_fwd": (_norm_down_fwd, ("BM", "BN", "BK"), ["M_KEY", "N", "K"], {}),
    "norm_down_dx": (_norm_down_dx, ("BM", "BK", "BN"), ["M_KEY", "N", "K"],
                     {"reset_to_zero": ["dg_ptr"]}),   # unused rows stay 0
    "grouped_mm": (_grouped_mm, ("BP", "BQ", "BK"), ["P_KEY", "Q_KEY", "K_KEY", "CALL_KEY", "G"],
                   {}),
}
# the grouped products extensions/kernel_ops.py launches for local_ops.py: the up-projections and
# their input gradient (the weight gradients, which reduce over every token, are cuBLAS's)
CALLS = ("expand", "dz")
# the JIT functions by name, for tools/gpu_compile.py to compile for GPUs that are not here
JIT = {"norm_down_fwd": _norm_down_fwd, "norm_down_dx": _norm_down_dx, "grouped_mm": _grouped_mm,
       "rms_fwd": rms_fwd, "rms_bwd": rms_bwd}
# the smallest row block of any list: the rows of norm_down_dx's partial dγ
MIN_BM = min(r[0] for r in [INTERPRETER_CONFIG, *sum(GEMM_CONFIGS.values(), [])])


@functools.cache
def tuner(name, bits_, arch_):
    """KERNELS[name] autotuned over the list for its input width and GPU architecture. The choices
    are kept in Triton's on-disk cache (cache_results): every rank, resume and later run on the
    machine reads a shape's choice instead of timing its configurations again at its first step
    (where a slower rank would stall its peers at the next collective)."""
    fn, names, key, options = KERNELS[name]
    return triton.autotune(gemm_configs(names, bits_, arch_), key=key, cache_results=True,
                           **options)(fn)


def launcher(name, t, residual=None):
    """The autotuned kernel `name` for t's width (and an fp32 residual's beside 16-bit t) on t's
    device, made at its first launch there."""
    return tuner(name, bits(t, residual), arch(t.device) if t.is_cuda else None)


def bits(t, residual=None):
    """GEMM_CONFIGS' width key: 32 or 16, or "x32" for 16-bit t beside an fp32 residual."""
    if t.dtype == torch.float32:
        return 32
    return "x32" if residual is not None and residual.dtype == torch.float32 else 16


@functools.lru_cache(maxsize=64)
def _meta(groups, device):
    """The groups' metadata as a device tensor; cached, since the same shapes come back every
    step."""
    return torch.tensor(groups, dtype=torch.int32, device=device)  # int32: 32-bit index arithmetic


class Operand(NamedTuple):
    """A matrix of a grouped product as its tensor and two strides: along P and K for A, K and Q
    for B, P and Q for C. Swapping the strides reads the matrix transposed, without a copy."""
    t: torch.Tensor
    s_outer: int
    s_inner: int


class Group(NamedTuple):
    """One product C_g (P, Q) = A_g (P, K) · B_g (K, Q) of a grouped launch, and where its blocks
    start inside A, B and C (row and column offsets, in the operands' own P/K/Q coordinates)."""
    P: int
    Q: int
    K: int
    a_row: int = 0
    a_col: int = 0
    b_row: int = 0
    b_col: int = 0
    c_row: int = 0
    c_col: int = 0


MAX_GROUPS = 3   # the Bs one grouped launch reads where they lie (q, k, v)


def grouped_mm(A, Bs, C, groups, call):
    """Launch _grouped_mm over the Groups of the Operands A, C and Bs (one Operand per group, each
    its own tensor, all with the same strides). `call` names the caller's stride pattern ("expand",
    "dz"): the autotuner keeps tiles per call."""
    assert 1 <= len(Bs) == len(groups) <= MAX_GROUPS, (len(Bs), len(groups))
    groups = tuple(tuple(g) for g in groups)
    up, ieee = dot_flags(A.t)
    B = Bs[0]
    b_ptrs = [b.t for b in Bs] + [B.t] * (MAX_GROUPS - len(Bs))   # (unused ones: any tensor)
    grid = lambda META: (sum(triton.cdiv(g[0], META["BP"]) * triton.cdiv(g[1], META["BQ"])
                             for g in groups),)
    launcher("grouped_mm", A.t)[grid](A.t, *b_ptrs, C.t, _meta(groups, C.t.device),
                                      A.s_outer, A.s_inner, B.s_outer, B.s_inner,
                                      C.s_outer, C.s_inner,
                                      *(bucket(max(g[i] for g in groups)) for i in range(3)),
                                      CALLS.index(call), G=len(groups), UPCAST=up, IEEE=ieee)
    return C.t


def rows():
    return 4 if INTERPRET else ROWS_CONFIG["ROWS"]


def rms_warps(block, backward=False):
    """Warps for an RMSNorm row of BLOCK columns (tools/gpu_compile.py, ptxas -v, sm_80 and sm_90):
    4 up to 4096 both ways; at 8192 (d > 4096: the 13B and 30B models) the backward spills with 4
    (about 600 B bf16, 6,400 B fp32) and not with 8, while the forward spills 8 B with 8 on sm_90
    and none with 4. Twice the row, twice the warps from there."""
    return min(16, max(4, block // (1024 if backward else 2048)))
