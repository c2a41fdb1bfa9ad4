"""model.py: the Llama-style decoder BOOST trains, as a dense model or with low-rank bottlenecks.

BOOST (arXiv 2512.12131) section 2 / CoLA (arXiv 2502.10940): every projection of a decoder block
(q, k, v, o, gate, up, down) becomes a bottleneck

    y = B · σ(A · x)        A: (r, d_in) "down",   B: (d_out, r) "up"

with σ = SiLU (`arch=cola`) or the identity (`arch=svd`, a plain factorised W = B·A). `arch=full` is
the dense Llama baseline. Embedding and LM head stay dense. This file is the single-device
reference: layouts.py shards exactly these weights and is tested against this forward pass.

`lax=true` adds LaX's latent crossing (arXiv 2505.21732; BOOST evaluates it beside SVD and CoLA):
from layer 1 on, each bottleneck's latent also reads the same projection's latent h of the layer
before (after its σ), through a gate G, and is normalised over r:

    h = σ(LayerNorm_r(A·x + G(h_prev)))        y = B · h

G (`lax_gate`) is `kron` (r = r1·r2, the most balanced pair: G(h) = vec(Dᵀ·mat(h)·E), D (r1, r1) and
E (r2, r2)), `linear` (a dense r×r layer with bias) or `identity`. Layer 0 only emits its latents.

Notation in shape comments: b batch, s sequence, d n_embd, r bottleneck rank, h heads, hd head dim.
"""
import hashlib
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lax import LAX_GATES, Crossing   # LaX's gate and LayerNorm (a file of its own)

ARCHS = ("full", "svd", "cola")
GATES = ("silu", "none")
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")   # a layer's latents, in this order


@dataclass
class Config:
    arch: str = "cola"       # full | svd | cola
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 0       # 0: same as n_head (no grouped-query attention)
    n_embd: int = 128
    mlp_width: int = 0       # d_ff; 0: 8/3 * n_embd rounded up to a multiple of 32
    mlp_multiple_of: int = 1  # d_ff rounded up to a multiple of this (8·tp: aligned bf16 strides)
    attn_rank: int = 0       # r of q, k, v, o; 0: n_embd // 4
    mlp_rank: int = 0        # r of gate, up, down; 0: n_embd // 4
    block_size: int = 128    # the longest sequence (RoPE table size)
    vocab_size: int = 320    # set from the tokeniser by train.py (padded to a multiple of 64)
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    # auto (silu for full and svd, none for cola) | silu: down(silu(gate)·up) | none: down(gate·up)
    mlp_gate: str = "auto"
    tie_embeddings: bool = False  # one matrix for the token embedding and the LM head
    lax: bool = False        # LaX's latent crossing between consecutive layers' bottlenecks
    lax_gate: str = "kron"   # kron | linear | identity: the gate G on the previous layer's latent

    def __post_init__(self):
        """Fill the 0 = automatic fields, then reject shapes that cannot be built (ValueError)."""
        self.n_kv_head = self.n_kv_head or self.n_head
        self.mlp_width = self.mlp_width or 32 * math.ceil(8 * self.n_embd / 3 / 32)
        if self.mlp_multiple_of < 1:
            raise ValueError(f"mlp_multiple_of={self.mlp_multiple_of} must be at least 1")
        self.mlp_width = self.mlp_multiple_of * math.ceil(self.mlp_width / self.mlp_multiple_of)
        self.attn_rank = self.attn_rank or max(1, self.n_embd // 4)
        self.mlp_rank = self.mlp_rank or max(1, self.n_embd // 4)
        if self.arch not in ARCHS:
            raise ValueError(f"arch={self.arch!r} is not one of {', '.join(ARCHS)}")
        if self.mlp_gate == "auto":
            self.mlp_gate = "none" if self.arch == "cola" else "silu"
        if self.mlp_gate not in GATES:
            raise ValueError(f"mlp_gate={self.mlp_gate} is not one of auto, {', '.join(GATES)}")
        if self.lax_gate not in LAX_GATES:
            raise ValueError(f"lax_gate={self.lax_gate} is not one of {', '.join(LAX_GATES)}")
        if self.lax and self.arch == "full":
            raise ValueError("lax=true crosses bottleneck latents: it needs arch=cola or arch=svd")
        for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "mlp_width", "block_size",
                     "vocab_size", "attn_rank", "mlp_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("rope_base", "norm_eps"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name}={getattr(self, name)} must be a positive finite number")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        if self.head_dim % 2:
            raise ValueError(f"head dim n_embd/n_head={self.head_dim} must be even for RoPE")
        if self.arch != "full":
            for name in ("attn_rank", "mlp_rank"):
                if getattr(self, name) > self.n_embd:
                    raise ValueError(f"{name}={getattr(self, name)} is larger than the width "
                                     f"n_embd={self.n_embd}: a bottleneck must be narrower")

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    @property
    def kv_dim(self):
        return self.n_kv_head * self.head_dim

    @property
    def lowrank(self):
        return self.arch != "full"

    def shape(self):
        """The fields that fix the weights' shapes (a checkpoint must match them)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def latent_act(arch):
    """σ on the r-dimensional latent: SiLU for CoLA, identity for svd."""
    return F.silu if arch == "cola" else (lambda z: z)


def cola_std(d_in, d_out, r):
    """CoLA init: A and B ~ N(0, std²) so B·A has the variance 1/(d_in + d_out) of a dense layer."""
    return r ** -0.25 * (d_in + d_out) ** -0.25


class Bottleneck(nn.Module):
    """y = B·σ(A·x), weights in nn.Linear layout: A.weight (r, d_in), B.weight (d_out, r); under LaX
    with `cross` (the gate) y = B·σ(LayerNorm(A·x + G(h_prev)))."""

    def __init__(self, d_in, d_out, r, arch, cross=None):
        super().__init__()
        self.A = nn.Linear(d_in, r, bias=False)
        self.B = nn.Linear(r, d_out, bias=False)
        self.act = latent_act(arch)
        std = cola_std(d_in, d_out, r)
        nn.init.normal_(self.A.weight, std=std)
        nn.init.normal_(self.B.weight, std=std)
        self.cross = Crossing(r, cross) if cross else None

    def forward(self, x, h_prev=None):
        """(y, h): the output and the latent h = σ(...) that the next layer's crossing reads."""
        z = self.A(x)                        # (b, s, r)
        if self.cross is not None:
            z = self.cross(z, h_prev)        # (b, s, r) LayerNorm(z + G(h_prev))
        h = self.act(z)
        return self.B(h), h                  # (b, s, d_out), (b, s, r)


def projection(cfg, d_in, d_out, r, crosses=False):
    """A dense nn.Linear for arch=full, otherwise a rank-r bottleneck (crossing under LaX)."""
    if cfg.lowrank:
        return Bottleneck(d_in, d_out, r, cfg.arch, cfg.lax_gate if crosses else None)
    layer = nn.Linear(d_in, d_out, bias=False)
    nn.init.normal_(layer.weight, std=(d_in + d_out) ** -0.5)
    return layer


def project(p, x, h_prev=None):
    """A projection's output and its latent h (a dense layer's: None)."""
    return p(x, h_prev) if isinstance(p, Bottleneck) else (p(x), None)


def rope_table(cfg):
    """cos and sin of RoPE, each (block_size, hd/2)."""
    inv_freq = cfg.rope_base ** (-torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.block_size).float(), inv_freq)  # (block_size, hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate pairs (i, i + hd/2) of x (b, h, s, hd) by the position's angles (rotate-half form)."""
    s, half = x.shape[2], x.shape[3] // 2
    cos, sin = cos[:s].to(x.dtype), sin[:s].to(x.dtype)  # (s, hd/2)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def causal_attention(q, k, v, n_head, n_kv_head, cos, sin):
    """Multi-head causal attention with RoPE and GQA on the projected q (b, s, h·hd) and k, v
    (b, s, kvh·hd).

    Head counts are arguments so tensor-parallel layouts call it with their local heads."""
    b, s, _ = q.shape
    hd = q.shape[-1] // n_head
    q = apply_rope(q.view(b, s, n_head, hd).transpose(1, 2), cos, sin)     # (b, h, s, hd)
    k = apply_rope(k.view(b, s, n_kv_head, hd).transpose(1, 2), cos, sin)  # (b, kvh, s, hd)
    v = v.view(b, s, n_kv_head, hd).transpose(1, 2)                        # (b, kvh, s, hd)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_head != n_kv_head)
    return y.transpose(1, 2).reshape(b, s, n_head * hd)                    # (b, s, h·hd)


def gated_product(mlp_gate, gate, up):
    """SwiGLU's silu(gate)·up (mlp_gate=silu), or gate·up (none: CoLA's large configs and BOOST's,
    whose bottlenecks already carry σ)."""
    return (F.silu(gate) if mlp_gate == "silu" else gate) * up


class Attention(nn.Module):
    def __init__(self, cfg, crosses=False):
        super().__init__()
        d, r = cfg.n_embd, cfg.attn_rank
        self.cfg = cfg
        self.q = projection(cfg, d, d, r, crosses)
        self.k = projection(cfg, d, cfg.kv_dim, r, crosses)
        self.v = projection(cfg, d, cfg.kv_dim, r, crosses)
        self.o = projection(cfg, d, d, r, crosses)

    def forward(self, x, cos, sin, prev=(None,) * 4):
        """(output, the latents of q, k, v, o); prev: the previous layer's (LaX)."""
        (q, hq), (k, hk), (v, hv) = (project(p, x, h)
                                     for p, h in zip((self.q, self.k, self.v), prev))
        y = causal_attention(q, k, v, self.cfg.n_head, self.cfg.n_kv_head, cos, sin)  # (b, s, d)
        out, ho = project(self.o, y, prev[3])                                         # (b, s, d)
        return out, (hq, hk, hv, ho)


class MLP(nn.Module):
    def __init__(self, cfg, crosses=False):
        super().__init__()
        d, f, r = cfg.n_embd, cfg.mlp_width, cfg.mlp_rank
        self.mlp_gate = cfg.mlp_gate
        self.gate = projection(cfg, d, f, r, crosses)
        self.up = projection(cfg, d, f, r, crosses)
        self.down = projection(cfg, f, d, r, crosses)

    def forward(self, x, prev=(None,) * 3):
        """(output, the latents of gate, up, down); prev: the previous layer's (LaX)."""
        (g, hg), (u, hu) = project(self.gate, x, prev[0]), project(self.up, x, prev[1])
        a = gated_product(self.mlp_gate, g, u)                     # (b, s, d_ff)
        out, hd = project(self.down, a, prev[2])                   # (b, s, d)
        return out, (hg, hu, hd)


class Block(nn.Module):
    """One decoder layer; `index` 0 does not cross under LaX (it has no previous layer)."""

    def __init__(self, cfg, index=0):
        super().__init__()
        crosses = cfg.lax and index > 0
        self.lax = cfg.lax
        self.attn_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = Attention(cfg, crosses)
        self.mlp_norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = MLP(cfg, crosses)

    def forward(self, x, cos, sin, prev=None):
        """(x, latents): the residual stream and, under LaX, the layer's seven latents (PROJECTIONS'
        order) for the next layer; prev: the previous layer's (None in layer 0 and without LaX)."""
        prev = prev or (None,) * 7
        a, lat_attn = self.attn(self.attn_norm(x), cos, sin, prev[:4])
        x = x + a                                              # (b, s, d)
        m, lat_mlp = self.mlp(self.mlp_norm(x), prev[4:])
        return x + m, (lat_attn + lat_mlp if self.lax else None)   # (b, s, d)


# ----------------------------------------- initialisation: every value from (seed, parameter, tile)

INIT_TILE = 256   # the rows and columns of a tile drawn from a generator of its own
RANDOM, CONSTANT = ("normal_", "uniform_"), ("fill_", "zero_")   # the ops an init may end with


class InitRecorder(TorchDispatchMode):
    """The constructors' initialisation as written: the last in-place op on each storage."""

    def __init__(self):
        super().__init__()
        self.last = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__.endswith("_") and args and torch.is_tensor(args[0]):
            self.last[args[0].untyped_storage()._cdata] = (func, args[1:], kwargs)
        return func(*args, **kwargs)

    def rules(self, model):
        """{parameter name: (op, args, kwargs)}: how each of model's parameters is initialised."""
        out = {}
        for name, p in model.named_parameters():
            func, args, kwargs = self.last.get(p.untyped_storage()._cdata, (None, (), {}))
            kind = func.overloadpacket.__name__ if func else None
            if kind not in RANDOM + CONSTANT or any(torch.is_tensor(a) for a in args):
                raise ValueError(f"{name}'s initialisation ends with {func}: not drawn in parts")
            out[name] = (func, args, {k: v for k, v in kwargs.items() if k != "generator"})
        return out


def tile_generator(seed, name, i, j):
    """Tile (i, j) of `name`'s generator: keyed (counter-based), any tile drawn without the rest."""
    key = hashlib.blake2b(f"{seed}/{name}/{i}/{j}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)


def init_part(rule, seed, name, shape, rows, cols):
    """Rows [rows) x columns [cols) of parameter `name` (`shape` viewed (shape[0], rest)) as `rule`
    draws them, each INIT_TILE² tile from its tile_generator: any part, alone, the same values."""
    func, args, kwargs = rule
    n, m = shape[0], math.prod(shape[1:])
    out = torch.empty(rows[1] - rows[0], cols[1] - cols[0])                    # (rows, cols)
    if func.overloadpacket.__name__ not in RANDOM:   # (a constant: nothing to draw)
        return func(out, *args, **kwargs)
    T = INIT_TILE
    for i in range(rows[0] // T, -(-rows[1] // T)):
        for j in range(cols[0] // T, -(-cols[1] // T)):
            tile = torch.empty(min(T, n - i * T), min(T, m - j * T))
            func(tile, *args, **kwargs, generator=tile_generator(seed, name, i, j))
            r0, r1 = max(rows[0], i * T), min(rows[1], (i + 1) * T)
            c0, c1 = max(cols[0], j * T), min(cols[1], (j + 1) * T)
            out[r0 - rows[0]:r1 - rows[0], c0 - cols[0]:c1 - cols[0]] = \
                tile[r0 - i * T:r1 - i * T, c0 - j * T:c1 - j * T]
    return out


class Llama(nn.Module):
    """Token embedding, n_layer blocks, final RMSNorm, LM head (tied to the embedding or not).
    The reference every layout is cut from and tested against; a run trains a layout of it
    (tp_model.TPLlama, at tp=1 a group of one), which also runs its activation checkpointing.
    Initial values: the constructors' rules (CoLA's N(0, std²), ...) drawn tile by tile, keyed by
    (init_seed, name, tile) (init_part); init_seed comes from the global generator, so
    torch.manual_seed(s) then Llama(cfg) is one model. On the meta device it holds shapes and
    rules alone: a rank draws its part without the rest (sharding.materialize)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg, device = cfg, torch.get_default_device()
        self.init_seed = int(torch.randint(2 ** 62, (), device="cpu"))
        with torch.device("meta"), InitRecorder() as recorder:   # shapes and rules, no values
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
            self.norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
            nn.init.normal_(self.tok_emb.weight, std=0.02)
            nn.init.normal_(self.lm_head.weight, std=0.02)
        if cfg.tie_embeddings:   # one parameter, two uses: their gradients add
            self.lm_head.weight = self.tok_emb.weight
        self.init_rules = recorder.rules(self)
        if device.type != "meta":
            self.to_empty(device=device)
            if cfg.tie_embeddings:   # (to_empty gave each use its own tensor)
                self.lm_head.weight = self.tok_emb.weight
            self.reset_parameters()
        cos, sin = rope_table(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, idx, targets=None):
        """idx (b, s) token ids -> (logits, loss); without targets only the last position's
        logits."""
        if not 0 < idx.shape[1] <= self.cfg.block_size:   # (an empty one: nothing to predict)
            raise ValueError(f"a sequence of {idx.shape[1]} tokens: it needs 1 to "
                             f"block_size={self.cfg.block_size}")
        x, lat = self.tok_emb(idx), None  # (b, s, d); LaX: the latents between layers
        for layer in self.layers:
            x, lat = layer(x, self.rope_cos, self.rope_sin, lat)   # (b, s, d)
        x = self.norm(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None     # (b, 1, V)
        logits = self.lm_head(x)                         # (b, s, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss

    @torch.no_grad()
    def reset_parameters(self):
        """Every parameter drawn whole by its rule (init_part)."""
        for name, p in self.named_parameters():
            whole = (0, p.shape[0]), (0, math.prod(p.shape[1:]))
            p.copy_(init_part(self.init_rules[name], self.init_seed, name, p.shape, *whole)
                    .view_as(p))

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len=None):
        """Training FLOPs per token, counted from the actual matrices (A and B separately).

        6 per weight of every matmul (2 forward, 4 backward; the embedding is a lookup, norms are
        not matmuls) plus attention scores and values, 12·n_layer·d·s (PaLM's count, causal mask
        not discounted). LaX's gates count as their matmuls: kron r·(r1 + r2) multiply-adds per
        token (Dᵀ·mat(h), then ·E), linear r²."""
        s = seq_len or self.cfg.block_size
        matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        kron = sum(c.norm.weight.numel() * (c.D.shape[0] + c.E.shape[0])
                   for c in self.modules() if isinstance(c, Crossing) and c.gate == "kron")
        return 6 * (matmul + kron) + 12 * self.cfg.n_layer * self.cfg.n_embd * s

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Sample max_new_tokens after idx (b, s), nanoGPT style."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.cfg.block_size:])
            logits = logits[:, -1, :].float() / max(temperature, 1e-6)   # (b, V)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits[logits < kth] = -float("inf")
            nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)  # (b, 1)
            idx = torch.cat((idx, nxt), dim=1)
        return idx


def estimate_mfu(flops_per_token, tokens_per_s, peak_tflops):
    """Model FLOPs utilisation against a peak you name (TFLOP/s); None when no peak is given."""
    return flops_per_token * tokens_per_s / (peak_tflops * 1e12) if peak_tflops > 0 else None
