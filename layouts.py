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

LaX (lax.py) extends the btp and vanilla layers: its crossing adds no collective under btp and
one all-gather of the latents per chunk under vanilla (lax.py's docstring counts them).

Every layout starts from the single-device Llama's weights (built from one seed, then cut by the
`Spec` of each parameter, sharding.py) and is tested against it: same loss, same gradients.
"""
import functools
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function

import kernels
import lax
from checkpointing import run_layers
from model import Llama, causal_attention, gated_product, latent_act, rope_table
from parallel import Gather, Reduce, VocabParallelCrossEntropy, all_gather_last, column_parallel
from sharding import Sharded, check_divisible


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
    """The volumes of this module's docstring, written down once (tested equal to the ledger's
    count; tools/bench.py and tools/costmodel.py use them). cfg: n_embd, mlp_width, kv_dim and the
    ranks."""
    d, f, kv, ra, rm = cfg.n_embd, cfg.mlp_width, cfg.kv_dim, cfg.attn_rank, cfg.mlp_rank
    if layout == "btp":      # q/k/v latents + Σx², o, gate/up + Σx², down; backward their gradients
        return Traffic((3 * ra + 1) + ra + (2 * rm + 1) + rm, 3 * ra + ra + 2 * rm + rm, 4 + 4)
    if layout == "vanilla":  # every B's whole output; backward every A's input gradient
        lx = (4 * ra + 3 * rm) if getattr(cfg, "lax", False) else 0   # LaX's latents
        return Traffic(d + 2 * kv + d + 2 * f + d + lx, 3 * d + d + 2 * d + f + lx,
                       7 + 7 + (8 if lx else 0))
    return Traffic(2 * d, 2 * d, 2 + 2)   # megatron: after attention and after the MLP


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
        --recompute=lowrank a checkpointed segment (checkpointing.py), so the all-reduces stay
        outside what backward replays. Returns (x, None): prev and the None are the latents that
        LaX carries from layer to layer (lax.py extends this layer and its emit)."""
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
        H, S = kernels.norm_down(x, gamma, A)            # (b, s, n), (b, s, 1)
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

    # One layer: BTP's chunks, but the latents are local r/t slices (reduce: nothing to sum) and
    # each of the seven B's ends in an all-reduce of its whole output (d, kv or f) in its chunk.
    forward = BTPBlock.forward

    # The chunks, with BTP's boundaries (checkpointing.run_layers recomputes them one by one).
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
        h = kernels.rms_norm(x, self.attn_norm, self.cfg.norm_eps)  # (b, s, d)
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
        n = kernels.rms_norm(x, self.mlp_norm, self.cfg.norm_eps)
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
        h = kernels.rms_norm(x, self.attn_norm, cfg.norm_eps)                         # (b, s, d)
        q, k, v = column_parallel(h, [self.W_q, self.W_k, self.W_v], self.tp)         # Copy, GEMMs
        y = causal_attention(q, k, v, cfg.n_head // t, cfg.n_kv_head // t, cos, sin)  # (b, s, d/t)
        x = x + Reduce.apply(y @ self.W_o.t(), g)                                     # (b, s, d)
        h = kernels.rms_norm(x, self.mlp_norm, cfg.norm_eps)
        gate, up = column_parallel(h, [self.W_gate, self.W_up], self.tp)
        a = gated_product(cfg.mlp_gate, gate, up)                                      # (b, s, f/t)
        return x + Reduce.apply(a @ self.W_down.t(), g), None                         # (b, s, d)


BLOCKS = {"btp": BTPBlock, "vanilla": VanillaBlock, "megatron": MegatronBlock}


class TPLlama(Sharded):
    """model.Llama under a TP layout; same forward contract: (idx, targets) -> (logits, loss), the
    logits vocab-sharded (b, s, V/t) with targets and all-gathered (b, 1, V) without.
    As pipeline stage `stage` of `stages` (or the stages of a tuple: several a rank, pipeline.py)
    it holds n_layer/stages layers a stage, the embedding with stage 0 and the final norm and LM
    head with the last; between stages the residual stream travels as held here ((b, s, d/t) under
    btp), and the last stage returns the logits for the schedule's loss (pipeline.Pipeline). Tied
    embeddings: every TP rank of the first and last stage holds the matrix whole and uses its
    slices (`embedding`, `head`); sharding.reduce_tied_grad sums their gradients.
    `recompute` (none | layer | lowrank) is its activation checkpointing (checkpointing.py);
    `block` replaces the layout's layer class (tools/ablations.py); under lax=true lax.py extends
    the class with its crossing."""

    def __init__(self, model, tp, layout, stage=0, stages=1, recompute="none", block=None):
        check_divisible(model.cfg, tp.size, layout)
        full = {k: v.detach() for k, v in model.state_dict().items()}
        super().__init__(tp, full)
        self.cfg, self.layout, self.recompute = model.cfg, layout, recompute
        held = (stage,) if isinstance(stage, int) else tuple(stage)
        self.first, self.last, self.pipelined = 0 in held, stages - 1 in held, stages > 1
        per_stage, self.stages = model.cfg.n_layer // stages, stages
        ids = [i for k in sorted(held) for i in range(k * per_stage, (k + 1) * per_stage)]
        # stage k's layers: self.layers[self.at[k]] (held in the model's order)
        self.at = {k: slice(j * per_stage, (j + 1) * per_stage) for j, k in enumerate(sorted(held))}
        self.tied = model.cfg.tie_embeddings
        if self.tied and (self.first or self.last):   # whole on every TP rank (and on the first
            self.shard("tok_emb", ["tok_emb.weight"], None)  # and last stage), (V, d): the two
            # uses take other slices of it
        elif self.first:
            self.shard("tok_emb", ["tok_emb.weight"],
                       1 if layout == "btp" else None)  # (V, d/t) or (V, d)
        block = block or BLOCKS[layout]
        if model.cfg.lax:   # LaX's crossing, an extension of the layer (lax.py)
            block = lax.extended(block, layout)
        self.layers = nn.ModuleList(block(model.cfg, tp, full, f"layers.{i}.") for i in ids)
        for i, layer in zip(ids, self.layers):
            layer.label = f"{layout} layer {i}"  # in profiler traces
        if self.last:
            self.shard("norm", ["norm.weight"], None)
            if not self.tied:
                self.shard("lm_head", ["lm_head.weight"], 0)                       # (V/t, d)
        self.register_buffer("rope_cos", model.rope_cos.clone(), persistent=False)
        self.register_buffer("rope_sin", model.rope_sin.clone(), persistent=False)
        for m in self.modules():
            m._full = None  # the full weights are not kept

    @torch.no_grad()
    def init_buffers(self):
        """RoPE's tables, computed here (a model cut on the meta device holds none)."""
        cos, sin = rope_table(self.cfg)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def embedding(self):
        """The embedding as this rank uses it: (V, d/t) under btp, else (V, d)."""
        if not self.tied:
            return self.tok_emb
        if self.layout == "btp":
            return self.tok_emb.chunk(self.tp.size, 1)[self.tp.tp_rank]
        # replicated use: every TP rank gets the same gradient, so one rank's counts (in
        # sharding.reduce_tied_grad)
        return self.tok_emb if self.tp.tp_rank == 0 else self.tok_emb.detach()

    def head(self):
        """The LM head as this rank uses it, vocab-parallel: (V/t, d)."""
        return self.tok_emb.chunk(self.tp.size, 0)[self.tp.tp_rank] if self.tied else self.lm_head

    def forward(self, x, targets=None, stage=None):
        """`stage`: which held pipeline stage to run (None: the one held, or the whole model)."""
        g = self.tp.group
        stage = next(iter(self.at)) if stage is None else stage
        if stage == 0:
            x, lat = F.embedding(x, self.embedding()), None  # (b, s, d/t) btp, else (b, s, d)
        else:
            x, lat = self.unpack(x)  # from the previous pipeline stage
        x, lat = run_layers(self.layers[self.at[stage]], x, self.rope_cos, self.rope_sin,
                            self.recompute, lat)
        if stage != self.stages - 1:
            return torch.cat([x, *lat], -1) if lat else x          # to the next pipeline stage
        if self.layout == "btp":   # the head is cut along V ≫ d: move d numbers a token, not V
            x = Gather.apply(x, g)                                  # (b, s, d)
        x = kernels.rms_norm(x, self.norm, self.cfg.norm_eps)      # (b, s, d)
        head = self.head()                                          # (V/t, d)
        if targets is None and not self.pipelined:
            return all_gather_last(x[:, [-1], :] @ head.t(), g, "fwd"), None  # (b, 1, V)
        logits = column_parallel(x, [head], self.tp)[0]             # (b, s, V/t), Copy first
        if self.pipelined:
            return logits                                           # to the schedule's loss
        loss = VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), g).mean()
        return logits, loss

    def unpack(self, x):
        """A stage's input: the residual stream and, under LaX, the previous layer's latents of
        q|k|v, o, gate|up, down, whole, riding beside it in one tensor (b, s, d_local + 4ra +
        3rm)."""
        if not self.cfg.lax:
            return x, None
        c = self.cfg
        x, *lat = x.split([x.shape[-1] - 4 * c.attn_rank - 3 * c.mlp_rank, 3 * c.attn_rank,
                           c.attn_rank,
                           2 * c.mlp_rank, c.mlp_rank], -1)
        return x, lat

    generate = Llama.generate
