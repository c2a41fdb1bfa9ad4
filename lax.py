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

This file is LaX's math alone: it imports nothing of the project, so model.py (the reference)
loads only torch and this. Under tensor parallelism LaX extends a layout's layer class:
extensions/lax_layers.py (btp's latents are whole after their all-reduce, so its crossing is
local; vanilla gathers its r/t slices first).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

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


def crossing_sources(prefix, full, gate):
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
    """`cross` with the parameters crossing_sources named on `module`, unstacked (G, ...)."""
    G = len(GROUPS[group])

    def get(param):
        t = getattr(module, f"X_{group}_{param.replace('.', '_')}")
        return t.view(G, -1) if t.dim() == 1 else t.view(G, -1, t.shape[-1])   # (G, r) or (G, n, m)
    return cross(z, h_prev, gate, [get(n) for n in GATE_PARAMS[gate]], get("norm.weight"),
                 get("norm.bias"))
