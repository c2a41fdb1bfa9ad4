"""layouts.py: the three tensor-parallel layouts of a decoder, cut from the single-device model.

BOOST (arXiv 2512.12131) sections 2-4. Notation: b batch, s sequence, d n_embd, f d_ff, kv the k/v
width, r bottleneck rank, t tp degree. Volumes are elements per token per layer.

  megatron  dense model. Column-parallel q/k/v and gate/up (heads and d_ff split), row-parallel o
            and down, replicated residual. Forward: all-reduce d (attn) + d (MLP); backward the
            same.
  vanilla   low-rank model, each A/B pair as its own Megatron MLP: A column-parallel over r, σ
            local, B row-parallel + all-reduce of the full output; replicated residual, all heads
            on every rank. Forward: d + 2kv (q, k, v) + d (o) + 2f (gate, up) + d (down); backward,
            one all-reduce of each A's input gradient: 3d + d + 2d + f.
  btp       bottleneck-aware TP: the residual stream sharded along d. Every bottleneck is a
            row-parallel A (partial r-vector), one all-reduce of the latent, σ, column-parallel B.
            RMSNorm is online (the sum of squares rides in the q/k/v and gate/up all-reduces), the
            down-projections sharing an input are one GEMM, the up-projections one grouped GEMM.
            Forward: (3r + 1) + r + (2r + 1) + r; backward 3r + r + 2r + r.

Each layout is one `Layout` record at the end of this file (its layer class, the traffic formula,
what the TP degree must divide, how Muon's and explain's views cut and name it): everything else
reads LAYOUTS, so adding a layout is a layer class and a record (docs/walkthrough.md, question 11).
LaX extends the btp and vanilla layers from outside (extensions/lax_layers.py): its crossing adds
no collective under btp and one all-gather of the latents per chunk under vanilla.

Every layout starts from the single-device Llama's weights (built from one seed, then cut by the
`Spec` of each parameter, sharding.py) and is tested against it: same loss, same gradients.
"""
import dataclasses
import functools
from typing import Callable, NamedTuple

import torch
from torch.profiler import record_function

import local_ops
import sharding
from model import causal_attention, gated_product, latent_act
from parallel import Reduce, column_parallel
from sharding import Sharded


def traced(chunk):
    """A chunk as one labelled range in profiler traces (--profile), `btp layer 0: attn_chunk`;
    when no profiler runs it costs one check (layouts.py's chunks)."""
    @functools.wraps(chunk)
    def run(block, *args):
        # (under torch.compile no range: record_function would break the graph in two)
        if torch.compiler.is_compiling() or not torch.autograd._profiler_enabled():
            return chunk(block, *args)
        with record_function(f"{block.label}: {chunk.__name__}"):
            return chunk(block, *args)
    return run


class Traffic(NamedTuple):
    """One layer's TP elements per token, forward and backward, and its collectives (both ways)."""
    fwd: int
    bwd: int
    collectives: int


def per_layer_traffic(layout, cfg):
    """The volumes of this module's docstring, written down once in each layout's record (tested
    equal to the ledger's count; tools/bench.py and tools/costmodel.py use them). cfg: n_embd,
    mlp_width, kv_dim and the ranks."""
    return LAYOUTS[layout].traffic(cfg)


def btp_traffic(cfg):
    """q/k/v latents + Σx², o, gate/up + Σx², down; backward their gradients."""
    ra, rm = cfg.attn_rank, cfg.mlp_rank
    return Traffic((3 * ra + 1) + ra + (2 * rm + 1) + rm, 3 * ra + ra + 2 * rm + rm, 4 + 4)


def vanilla_traffic(cfg):
    """Every B's whole output; backward every A's input gradient (LaX: its gathered latents)."""
    d, f, kv, ra, rm = cfg.n_embd, cfg.mlp_width, cfg.kv_dim, cfg.attn_rank, cfg.mlp_rank
    lx = (4 * ra + 3 * rm) if getattr(cfg, "lax", False) else 0
    return Traffic(d + 2 * kv + d + 2 * f + d + lx, 3 * d + d + 2 * d + f + lx,
                   7 + 7 + (8 if lx else 0))


def megatron_traffic(cfg):
    """After attention and after the MLP, both ways."""
    return Traffic(2 * cfg.n_embd, 2 * cfg.n_embd, 2 + 2)


class BTPBlock(Sharded):
    """One decoder layer under bottleneck-aware TP; the residual stream x is (b, s, d/t)."""

    def __init__(self, cfg, tp, full, prefix):
        super().__init__(tp, full)
        self.cfg, self.act = cfg, latent_act(cfg.arch)
        self.shard("attn_norm", [prefix + "attn_norm.weight"], 0)
        self.shard("A_qkv", [prefix + f"attn.{n}.A.weight"
                             for n in "qkv"], 1)  # (3r, d/t): one GEMM
        for n in "qkv":
            self.shard(f"B_{n}", [prefix + f"attn.{n}.B.weight"], 0)            # (heads/t·hd, r)
        self.shard("A_o", [prefix + "attn.o.A.weight"], 1)                      # (r, d/t)
        self.shard("B_o", [prefix + "attn.o.B.weight"], 0)                      # (d/t, r)
        self.shard("mlp_norm", [prefix + "mlp_norm.weight"], 0)
        self.shard("A_gu", [prefix + "mlp.gate.A.weight",
                            prefix + "mlp.up.A.weight"], 1)  # (2r, d/t)
        self.shard("B_gate", [prefix + "mlp.gate.B.weight"], 0)                 # (f/t, r)
        self.shard("B_up", [prefix + "mlp.up.B.weight"], 0)
        self.shard("A_down", [prefix + "mlp.down.A.weight"], 1)                 # (r, f/t)
        self.shard("B_down", [prefix + "mlp.down.B.weight"], 0)                 # (d/t, r)

    def forward(self, x, cos, sin, prev=None, segment=None):
        """One layer: five chunks, and between them the layer's only four collectives, each an
        all-reduce of an r-wide latent. segment(chunk, *args) runs each chunk: under
        --recompute=lowrank a checkpointed segment (recompute.py), so the all-reduces stay
        outside what backward replays. Returns (x, None): prev and the None are the latents that
        LaX carries from layer to layer (extensions/lax_layers.py extends this layer: it relies on
        the chunks running in this order, each a bound method through `segment`, and on each
        chunk after qkv_down calling self.emit on its latent)."""
        run = segment or (lambda chunk, *args: chunk(*args))
        partial = run(self.qkv_down, x)                                        # (b, s, 3r+1)
        partial = run(self.attn_chunk, self.reduce(partial), cos, sin)         # (b, s, r)
        x, partial = run(self.o_chunk, self.reduce(partial), x)      # (b, s, d/t), (b, s, 2r+1)
        partial = run(self.mlp_chunk, self.reduce(partial))                    # (b, s, r)
        x = run(self.down_chunk, self.reduce(partial), x)                      # (b, s, d/t)
        return x, None

    # The chunks. Each starts from a replicated latent after its all-reduce and ends with the local
    # partial product of the next A, before its all-reduce; so recomputing one issues no collective.
    def norm_down(self, x, gamma, A):
        """The local half of σ(RMSNorm(x)·Aᵀ): the partial [H | S] to all-reduce (online RMSNorm,
        §3)."""
        H, S = local_ops.norm_down(x, gamma, A)            # (b, s, n), (b, s, 1)
        # the statistic travels in the latents' dtype (bf16 under autocast, like every TP
        # all-reduce): its rounding is below that of the bf16 output it normalises
        return torch.cat([H, S.to(H.dtype)], -1)         # (b, s, n+1)

    def reduce(self, partial):
        """The latent's all-reduce: the sum of the ranks' partials (backward: the identity)."""
        return Reduce.apply(partial, self.tp.group)

    def latent(self, HS):
        """RMSNorm(x)·Aᵀ from the all-reduced [H | S], replicated (σ comes in `emit`)."""
        return HS[..., :-1] * torch.rsqrt(HS[..., -1:].float() / self.cfg.n_embd
                                          + self.cfg.norm_eps)   # (b, s, n)

    def emit(self, z):
        """σ(z), the latent the up-projections read (LaX's layers cross z first: lax.py)."""
        return self.act(z)

    def expand(self, z, Bs):
        """The column-parallel up-projections of the replicated latent z's groups, one grouped GEMM
        (Copy first: backward all-reduces dz; overlapped with the dB GEMMs under --overlap)."""
        return column_parallel(z, Bs, self.tp, sliced=True)

    @traced
    def qkv_down(self, x):
        return self.norm_down(x, self.attn_norm, self.A_qkv)  # (b, s, 3r+1) partial

    @traced
    def attn_chunk(self, HS, cos, sin):
        cfg, t = self.cfg, self.tp.size
        h = self.emit(self.latent(HS))                                          # (b, s, 3r)
        # B_q, B_k, B_v are cut by rows, i.e. by heads: each rank attends over its own heads, and
        # their outputs side by side are its d/t slice of o's input, which A_o's columns match
        q, k, v = self.expand(h, [self.B_q, self.B_k, self.B_v])
        y = causal_attention(q, k, v, cfg.n_head // t, cfg.n_kv_head // t, cos, sin)  # (b, s, d/t)
        return y @ self.A_o.t()                                                  # (b, s, r) partial

    @traced
    def o_chunk(self, u, x):
        h = self.emit(u)                                                         # (b, s, r)
        # B_o's rows are this rank's d/t of the stream: the update lands on its own slice, locally
        x = x + self.expand(h, [self.B_o])[0]                                    # (b, s, d/t)
        return x, self.norm_down(x, self.mlp_norm, self.A_gu)      # (b, s, 2r+1) partial

    @traced
    def mlp_chunk(self, HS):
        h = self.emit(self.latent(HS))                                          # (b, s, 2r)
        gate, up = self.expand(h, [self.B_gate, self.B_up])
        # gate and up are cut alike along f, so their product is local; A_down reads those f/t
        a = gated_product(self.cfg.mlp_gate, gate, up)                           # (b, s, f/t)
        return a @ self.A_down.t()                                               # (b, s, r) partial

    @traced
    def down_chunk(self, u, x):
        h = self.emit(u)                                                         # (b, s, r)
        return x + self.expand(h, [self.B_down])[0]                              # (b, s, d/t)


class VanillaBlock(Sharded):
    """One layer under vanilla low-rank TP: replicated x (b, s, d), each A/B pair a Megatron MLP."""

    def __init__(self, cfg, tp, full, prefix):
        super().__init__(tp, full)
        self.cfg, self.act = cfg, latent_act(cfg.arch)
        self.shard("attn_norm", [prefix + "attn_norm.weight"], None)
        self.shard("mlp_norm", [prefix + "mlp_norm.weight"], None)
        for name in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down"):
            key = name.replace(".", "_")
            self.shard(f"{key}_A", [prefix + name + ".A.weight"], 0)    # (r/t, d_in)
            self.shard(f"{key}_B", [prefix + name + ".B.weight"], 1)    # (d_out, r/t)

    def forward(self, x, cos, sin, prev=None, segment=None):
        """One layer: BTP's five chunks, but the latents are local r/t slices (reduce: nothing to
        sum) and each of the seven B's ends in an all-reduce of its whole output (d, kv or f)
        inside its chunk, so recompute replays those (the paper's point). Returns (x, None)."""
        run = segment or (lambda chunk, *args: chunk(*args))
        z = run(self.qkv_down, x)                                              # (b, s, 3r/t)
        u = run(self.attn_chunk, z, cos, sin)                                  # (b, s, r/t)
        x, z = run(self.o_chunk, u, x)                             # (b, s, d), (b, s, 2r/t)
        u = run(self.mlp_chunk, z)                                             # (b, s, r/t)
        return run(self.down_chunk, u, x), None                                # (b, s, d)

    # The chunks, with BTP's boundaries (recompute.run_layers recomputes them one by one).
    def reduce(self, partial):
        return partial  # a column-parallel A gives this rank's latent slice whole: nothing to sum

    emit = BTPBlock.emit   # σ of this rank's r/t slices

    def compress(self, h, *keys):
        """Each column-parallel A after its own Copy (one backward all-reduce per A, as in the
        paper's vanilla TP): this rank's r/t latent slices, concatenated."""
        return torch.cat([column_parallel(h, [getattr(self, k + "_A")], self.tp)[0]
                          for k in keys], -1)

    def expand(self, h, key):
        """The row-parallel B of a latent slice h, all-reduce of the full d_out."""
        return Reduce.apply(h @ getattr(self, key + "_B").t(), self.tp.group)  # (b, s, d_out)

    @traced
    def qkv_down(self, x):
        h = local_ops.rms_norm(x, self.attn_norm, self.cfg.norm_eps)  # (b, s, d)
        return self.compress(h, "attn_q", "attn_k", "attn_v")                     # (b, s, 3r/t)

    @traced
    def attn_chunk(self, z, cos, sin):
        cfg = self.cfg
        h = self.emit(z)                                                          # (b, s, 3r/t)
        hq, hk, hv = h.split(cfg.attn_rank // self.tp.size, -1)
        # q (b, s, d), k and v (b, s, kv): each B's whole output, all-reduced (expand)
        q, k, v = (self.expand(hz, "attn_" + n) for hz, n in zip((hq, hk, hv), "qkv"))
        y = causal_attention(q, k, v, cfg.n_head, cfg.n_kv_head, cos, sin)  # all heads, (b, s, d)
        return self.compress(y, "attn_o")                                         # (b, s, r/t)

    @traced
    def o_chunk(self, u, x):
        h = self.emit(u)                                                          # (b, s, r/t)
        x = x + self.expand(h, "attn_o")                                          # (b, s, d)
        n = local_ops.rms_norm(x, self.mlp_norm, self.cfg.norm_eps)
        return x, self.compress(n, "mlp_gate", "mlp_up")                          # (b, s, 2r/t)

    @traced
    def mlp_chunk(self, z):
        h = self.emit(z)                                                          # (b, s, 2r/t)
        hg, hu = h.split(self.cfg.mlp_rank // self.tp.size, -1)
        a = gated_product(self.cfg.mlp_gate, self.expand(hg, "mlp_gate"),
                          self.expand(hu, "mlp_up"))  # (b, s, f)
        return self.compress(a, "mlp_down")                                       # (b, s, r/t)

    @traced
    def down_chunk(self, u, x):
        h = self.emit(u)                                                          # (b, s, r/t)
        return x + self.expand(h, "mlp_down")                                     # (b, s, d)


class MegatronBlock(Sharded):
    """One dense layer under Megatron TP: replicated x (b, s, d), heads and d_ff split."""

    def __init__(self, cfg, tp, full, prefix):
        super().__init__(tp, full)
        self.cfg = cfg
        self.shard("attn_norm", [prefix + "attn_norm.weight"], None)
        self.shard("mlp_norm", [prefix + "mlp_norm.weight"], None)
        for n in ("q", "k", "v"):
            self.shard(f"W_{n}", [prefix + f"attn.{n}.weight"], 0)      # (heads/t·hd, d)
        self.shard("W_o", [prefix + "attn.o.weight"], 1)                 # (d, d/t)
        self.shard("W_gate", [prefix + "mlp.gate.weight"], 0)            # (f/t, d)
        self.shard("W_up", [prefix + "mlp.up.weight"], 0)
        self.shard("W_down", [prefix + "mlp.down.weight"], 1)            # (d, f/t)

    @traced
    def forward(self, x, cos, sin, prev=None):
        """(x, None): a dense layer has no latents (prev is always None)."""
        cfg, t, g = self.cfg, self.tp.size, self.tp.group
        h = local_ops.rms_norm(x, self.attn_norm, cfg.norm_eps)                         # (b, s, d)
        q, k, v = column_parallel(h, [self.W_q, self.W_k, self.W_v], self.tp)         # Copy, GEMMs
        y = causal_attention(q, k, v, cfg.n_head // t, cfg.n_kv_head // t, cos, sin)  # (b, s, d/t)
        x = x + Reduce.apply(y @ self.W_o.t(), g)                                     # (b, s, d)
        h = local_ops.rms_norm(x, self.mlp_norm, cfg.norm_eps)
        gate, up = column_parallel(h, [self.W_gate, self.W_up], self.tp)
        a = gated_product(cfg.mlp_gate, gate, up)                                      # (b, s, f/t)
        return x + Reduce.apply(a @ self.W_down.t(), g), None                         # (b, s, d)


# ------------------------------------------------------------------ the layouts, a record each

@dataclasses.dataclass(frozen=True)
class Layout:
    """All the project knows of a layout: the rest of it (options, the plan, Muon, explain, the
    benches) reads these fields, never the layout's name."""
    name: str
    block: type                 # its layer class: (cfg, tp, full, prefix), forward -> (x, latents)
    lowrank: bool               # it cuts a bottleneck model (else the dense one)
    splits: tuple               # the Config fields the TP degree must divide
    stream_sharded: bool        # the residual stream (and the embedding) cut along d
    traffic: Callable           # cfg -> Traffic: one layer's TP elements per token
    cut: tuple                  # the dims a matrix is cut along over TP, as Muon sees it:
    # low-rank (A's, B's) of A (r, d_in), B (d_out, r); dense (column-, row-parallel W's)
    symbols: tuple = ()         # explain: the widths of its collectives, preferred first
    carries: dict = dataclasses.field(default_factory=dict)   # explain: (phase, width) -> words
    gathers: str = ""           # explain: what its TP all-gather carries


SHAPES = ("n_embd", "n_head", "n_kv_head", "mlp_width")   # heads and d (or d_ff) split
_GATHERED_LATENTS = "gradient of latents gathered for LaX's crossing"
LAYOUTS = {lay.name: lay for lay in (
    Layout("btp", BTPBlock, True, SHAPES, True, btp_traffic, (1, 0),
           ("3r+1", "2r+1", "2r_m+1", "3r", "2r", "2r_m", "r", "r_m", "d"), {
               ("fwd", "3r+1"): "q, k, v latents + the norm statistic (online RMSNorm)",
               ("fwd", "2r+1"): "gate, up latents + the norm statistic",
               ("fwd", "r"): "a partial latent", ("bwd", "r"): "gradient of a latent",
               ("bwd", "3r"): "gradient of the q, k, v latents",
               ("bwd", "2r"): "gradient of the gate, up latents",
               ("fwd", "d"): "the residual stream, gathered for the head",
               ("bwd", "d"): "gradient of the head's input"},
           "the residual stream, gathered for the head"),
    Layout("vanilla", VanillaBlock, True, ("attn_rank", "mlp_rank"), False, vanilla_traffic,
           (0, 1), ("d", "kv", "f"), {
               ("fwd", "d"): "partial sums of a row-parallel B",
               ("bwd", "d"): "gradient of an A's input", ("bwd", "f"): "gradient of A_down's input",
               ("fwd", "kv"): "partial sums of B_k or B_v",
               ("fwd", "f"): "partial sums of B_gate or B_up",
               **dict.fromkeys((("bwd", "r"), ("bwd", "2r"), ("bwd", "3r")), _GATHERED_LATENTS)},
           "a projection's latent, gathered from its r/t slices for the next layer's crossing"),
    Layout("megatron", MegatronBlock, False, SHAPES, False, megatron_traffic, (0, 1), ("d",), {
        ("fwd", "d"): "partial sums of o or down (row-parallel)",
        ("bwd", "d"): "gradient of the normed input (column-parallel)"}),
)}


def check_divisible(cfg, tp, layout, pp=1):
    """A clear ValueError when `layout` is none of LAYOUTS or cannot split this model at this tp
    (its record's rule: sharding.check_divisible), or pp its layers."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout} is not one of {', '.join(LAYOUTS)}")
    others = [name for name, lay in LAYOUTS.items() if lay.lowrank == cfg.lowrank]
    sharding.check_divisible(cfg, tp, LAYOUTS[layout], others, pp)


def default_layout(cfg):
    """--layout=auto: the first layout that cuts this kind of model (btp, or megatron for full)."""
    return next(name for name, lay in LAYOUTS.items() if lay.lowrank == cfg.lowrank)
