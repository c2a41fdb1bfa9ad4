"""lax.py: LaX's latent crossing (arXiv 2505.21732, "Latent Crossing"), the third bottleneck
architecture BOOST (arXiv 2512.12131) evaluates beside SVD and CoLA.

From layer 1 on, a bottleneck's latent z = A·x also reads the same projection's latent of the
previous layer, h_prev (taken after that layer's σ, so it carries the earlier crossings), through a
gate G, and is normalised over r before σ:

    h = σ(LayerNorm_r(z + G(h_prev)))

As the official code defines it (K1seki221/Latent_Crossing at c892d2c, vits_pretraining/timm/models/
lax_vit.py, `TensorizedLinear` with two cores): the LayerNorm (eps 1e-6, with weight and bias) only
where the layer crosses; the tensorised gate factors r as its most balanced pair r1·r2 and reads
h as an r1 × r2 matrix, G(h) = vec(Dᵀ·mat(h)·E), D (r1, r1) and E (r2, r2) kaiming-uniform; the
code's other gates are a dense r × r linear (with bias) and the identity. `cross` below computes
G projections side by side (the layouts group q, k, v and gate, up as BTP does); model.py holds one
Crossing module per projection, the names a checkpoint carries.

Under tensor parallelism LaX is the worked example of extending a layout: `extended(block, layout)`
puts a mixin before layouts.py's layer class that adds the crossing parameters (replicated) and
runs each chunk with the previous layer's latent of its projections, handing the chunk's own latent
on; inside the chunk only `emit` changes (the one step between a latent's all-reduce and the
up-projections): it crosses, as the layout's `cross_emit` says. The chunk sequence and the chunks
stay the layout's. btp's latents are whole after their all-reduce,
so the crossing is local: no collective more. vanilla holds r/t slices, so each crossing layer
all-gathers its latents (forward 4·ra + 3·rm elements a token; backward an all-reduce of the same,
entering the row-parallel Bs); layer 0 gathers its latents for layer 1 and all-reduces nothing more.
"""
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel import Copy, Gather

LAX_GATES = ("kron", "linear", "identity")
LAX_EPS = 1e-6   # the official code's LayerNorm eps


def factor_pair(r):
    """The most balanced r1 <= r2 with r1·r2 = r (256: 16, 16; 96: 8, 12): the kron gate's shape."""
    r1 = max(a for a in range(1, math.isqrt(r) + 1) if r % a == 0)
    return r1, r // r1


def cross(z, h_prev, gate, weights, ln_w, ln_b):
    """LaX's crossing of G projections side by side: each r-slice of z becomes
    LayerNorm_r(z + G(h_prev)), G and the LayerNorm that slice's own. z, h_prev (..., G·r); ln_w,
    ln_b (G, r); weights: kron (D (G, r1, r1), E (G, r2, r2)), linear (W (G, r, r), bias (G, r)),
    identity (). One function for the model and every layout, as causal_attention is."""
    G, r = ln_w.shape
    z, h = z.unflatten(-1, (G, r)), h_prev.unflatten(-1, (G, r))              # (b, s, G, r)
    if gate == "kron":
        D, E = weights
        m = h.unflatten(-1, (D.shape[-1], E.shape[-1]))  # (b, s, G, r1, r2) mat(h)
        g = torch.einsum("...gij,gik,gjl->...gkl", m, D, E).flatten(-2)  # Dᵀ·mat(h)·E, (b, s, G, r)
    elif gate == "linear":
        W, bias = weights
        g = torch.einsum("...gi,goi->...go", h, W) + bias                     # (b, s, G, r)
    else:
        g = h
    y = F.layer_norm(z + g, (r,), eps=LAX_EPS) * ln_w + ln_b                  # (b, s, G, r)
    return y.flatten(-2)                                                      # (b, s, G·r)


class Crossing(nn.Module):
    """One projection's gate G and LayerNorm over r (their initialisation as in the official code:
    kaiming-uniform D and E, torch's default nn.Linear, LayerNorm weight 1 and bias 0)."""

    def __init__(self, r, gate):
        super().__init__()
        self.gate, self.norm = gate, nn.LayerNorm(r, eps=LAX_EPS)
        if gate == "kron":
            r1, r2 = factor_pair(r)
            self.D = nn.Parameter(nn.init.kaiming_uniform_(torch.empty(r1, r1)))
            self.E = nn.Parameter(nn.init.kaiming_uniform_(torch.empty(r2, r2)))
        elif gate == "linear":
            self.W = nn.Linear(r, r)

    def weights(self):
        """The gate's parameters in the order `cross` takes them."""
        return {"kron": lambda: [self.D, self.E], "linear": lambda: [self.W.weight, self.W.bias],
                "identity": lambda: []}[self.gate]()

    def forward(self, z, h_prev):
        return cross_group([self], z, h_prev)


def cross_group(crossings, z, h_prev):
    """`cross` with the parameters of several projections' Crossing modules stacked (G of them)."""
    weights = [torch.stack(ws) for ws in zip(*(c.weights() for c in crossings))]
    return cross(z, h_prev, crossings[0].gate, weights,
                 torch.stack([c.norm.weight for c in crossings]),
                 torch.stack([c.norm.bias for c in crossings]))


# ------------------------------------------------------------- the layouts' view: grouped, stacked

GROUPS = {"qkv": ("attn.q", "attn.k", "attn.v"), "o": ("attn.o",), "gu": ("mlp.gate", "mlp.up"),
          "down": ("mlp.down",)}   # the projections whose latents a BTP chunk holds side by side
GATE_PARAMS = {"kron": ("D", "E"), "linear": ("W.weight", "W.bias"), "identity": ()}


def group_pieces(prefix, full, gate):
    """(local name, [full-model names]) of a layer's crossing parameters, one local parameter per
    group and kind, its projections' pieces concatenated on dim 0; nothing for a layer that does not
    cross (layer 0, or no LaX: `full`, the model's state, holds no such names)."""
    if prefix + "attn.q.cross.norm.weight" not in full:
        return []
    return [(f"X_{group}_{param.replace('.', '_')}",
             [f"{prefix}{p}.cross.{param}" for p in projections])
            for group, projections in GROUPS.items()
            for param in ("norm.weight", "norm.bias", *GATE_PARAMS[gate])]


def cross_stacked(module, group, gate, z, h_prev):
    """`cross` with the local parameters group_pieces named on `module`, unstacked to (G, ...)."""
    G = len(GROUPS[group])

    def get(param):
        t = getattr(module, f"X_{group}_{param.replace('.', '_')}")
        return t.view(G, -1) if t.dim() == 1 else t.view(G, -1, t.shape[-1])   # (G, r) or (G, n, m)
    return cross(z, h_prev, gate, [get(n) for n in GATE_PARAMS[gate]], get("norm.weight"),
                 get("norm.bias"))


# --------------------------------------------------------- LaX as an extension of a layout's layer

CHUNK_GROUPS = {"attn_chunk": "qkv", "o_chunk": "o", "mlp_chunk": "gu", "down_chunk": "down"}


class Crossed:
    """What LaX adds to a layer of layouts.py, before the layout's class in the MRO: its crossing
    parameters, and latents carried between layers. The layer's forward runs its chunks through a
    `segment`; this one runs each chunk that emits a latent (CHUNK_GROUPS) as `crossed`, with the
    previous layer's latent of its projections as an argument and its own as a result, so that
    recompute (a checkpointed segment) replays the crossing from the same tensors. A layout's
    subclass says how its latents cross: `cross_emit`."""

    def __init__(self, cfg, tp, full, prefix):
        super().__init__(cfg, tp, full, prefix)
        pieces = group_pieces(prefix, full, cfg.lax_gate)
        for name, names in pieces:   # replicated: every rank crosses whole latents alike
            self.shard(name, names, None)
        self.crosses = bool(pieces)   # (layer 0 emits its latents, it does not cross)

    def forward(self, x, cos, sin, prev=None, segment=None):
        """(x, the latents of q|k|v, o, gate|up, down); prev: the previous layer's (None: layer 0
        or a pipeline's first stage)."""
        run = segment or (lambda chunk, *args: chunk(*args))
        prev, made = prev or (None,) * len(CHUNK_GROUPS), []

        def carried(chunk, *args):
            if chunk.__name__ not in CHUNK_GROUPS:   # (qkv_down: no latent yet)
                return run(chunk, *args)
            *out, h = run(self.crossed, chunk, prev[len(made)], *args)
            made.append(h)
            return out[0] if len(out) == 1 else tuple(out)
        x, _ = super().forward(x, cos, sin, segment=carried)
        return x, tuple(made)

    def crossed(self, chunk, h_prev, *args):
        """The layout's chunk(*args), its emit crossing with h_prev: (the chunk's results, the
        latent for the next layer). The chunk runs on a Carrier rather than on a flag set on the
        layer: under recompute this runs inside a checkpoint, which torch.compile traces as one
        graph only if nothing from outside it is mutated."""
        view = Carrier(self, CHUNK_GROUPS[chunk.__name__], h_prev)
        out = chunk.__func__(view, *args)
        return (*out, view._made) if isinstance(out, tuple) else (out, view._made)


class Carrier:
    """The layer as one chunk sees it under LaX: the layer itself in every attribute but `emit`,
    which crosses the chunk's latent with the previous layer's and keeps its own, `_made`. (Its
    own attributes start with _, so that none hides one of the layer's.)"""

    def __init__(self, layer, group, h_prev):
        self._layer, self._group, self._h_prev, self._made = layer, group, h_prev, None

    def __getattr__(self, name):   # (only for what __init__ did not set)
        return getattr(self._layer, name)

    def emit(self, z):
        h, self._made = self._layer.cross_emit(z, self._group, self._h_prev)
        return h


class CrossedBTP(Crossed):
    """LaX under btp: the latent z is whole after its all-reduce, so the crossing runs locally."""

    def cross_emit(self, z, group, h_prev):
        """(h for the Bs, h for the next layer): σ(LayerNorm(z + G(h_prev))) from layer 1 on, σ(z)
        in layer 0; the same tensor twice."""
        if self.crosses:
            z = cross_stacked(self, group, self.cfg.lax_gate, z, h_prev)         # (b, s, G·r)
        h = self.act(z)
        return h, h


class CrossedVanilla(Crossed):
    """LaX under vanilla: each rank holds r/t of every latent, and the crossing reads it whole."""

    def cross_emit(self, z, group, h_prev):
        """(the row-parallel Bs' slices of h, h whole for the next layer). A crossing layer
        all-gathers z (backward: its slice of the whole gradient), crosses it on every rank alike,
        and hands its slices to the Bs through Copy (backward: the all-reduce that makes the Bs'
        slice gradients whole); layer 0 gathers σ(z) for layer 1."""
        G, t, i = len(GROUPS[group]), self.tp.size, self.tp.tp_rank

        def whole(slices):   # (b, s, G·r/t) on each rank -> (b, s, G·r), projection by projection
            gathered = Gather.apply(slices, self.tp.group)                # (b, s, t·G·r/t)
            return gathered.unflatten(-1, (t, G, -1)).transpose(-3, -2).flatten(-3)
        if not self.crosses:
            h = self.act(z)                                                       # (b, s, G·r/t)
            return h, whole(h)
        h = self.act(cross_stacked(self, group, self.cfg.lax_gate, whole(z), h_prev))  # (b, s, G·r)
        mine = Copy.apply(h, self.tp.group).unflatten(-1, (G, t, -1))[..., i, :].flatten(-2)
        return mine, h   # (b, s, G·r/t), (b, s, G·r)


EXTENSIONS = {"btp": CrossedBTP, "vanilla": CrossedVanilla}


@functools.cache
def extended(block, layout):
    """block (a layout's layer class, or a subclass of it) with LaX: CrossedBTP or CrossedVanilla
    first in its MRO. layouts.TPLlama builds its layers from this under lax=true (Config and
    sharding.check_divisible have already refused LaX on a dense model, megatron's)."""
    return type(f"LaX{block.__name__}", (EXTENSIONS[layout], block), {})
