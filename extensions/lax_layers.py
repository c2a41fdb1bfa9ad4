"""lax_layers.py: LaX's latent crossing (arXiv 2505.21732) under tensor parallelism, as an
extension of a layout's layer (BOOST, arXiv 2512.12131, evaluates LaX beside SVD and CoLA).

The crossing's math is lax.py's; here it enters layouts.py's layers without their code changing:
`extended(block)` puts a mixin before the layer's class that adds the crossing parameters
(replicated) and runs each chunk with the previous layer's latent of its projections, handing the
chunk's own latent on; inside the chunk only `emit` changes (the one step between a latent's
all-reduce and the up-projections): it crosses, as the layout's `cross_emit` says. btp's latents
are whole after their all-reduce, so the crossing is local: no collective more. vanilla holds r/t
slices, so each crossing layer all-gathers its latents (forward 4·ra + 3·rm elements a token;
backward an all-reduce of the same, entering the row-parallel Bs); layer 0 gathers its latents for
layer 1 and all-reduces nothing more. Importing this file registers `extended` with layouts.py
(plumbing/placement.py imports it): the story itself imports no extension.

The contract an extension of a layout relies on (layouts.py's BTPBlock.forward keeps it):
- a layer's forward runs its chunks in order through `segment(chunk, *args)`, the chunk a bound
  method, and each chunk that emits a latent calls `self.emit(z)` itself, once;
- the chunks that emit are named in CHUNK_GROUPS, in the order of the latents the layer hands on
  (q|k|v, o, gate|up, down), the order TPLlama.unpack splits them in between pipeline stages.
"""
import functools

import tp_model
from lax import GROUPS, cross_stacked, crossing_sources
from layouts import BTPBlock, VanillaBlock
from parallel import Copy, Gather

CHUNK_GROUPS = {"attn_chunk": "qkv", "o_chunk": "o", "mlp_chunk": "gu", "down_chunk": "down"}


class Crossed:
    """What LaX adds to a layer of layouts.py, before the layout's class in the MRO: its crossing
    parameters, and latents carried between layers. The layer's forward runs its chunks through a
    `segment`; this one runs each chunk that emits a latent (CHUNK_GROUPS) as `run_crossing`, the
    previous layer's latent of its projections as an argument and its own as a result, so that
    recompute (a checkpointed segment) replays the crossing from the same tensors. A layout's
    subclass says how its latents cross: `cross_emit`."""

    def __init__(self, cfg, tp, full, prefix):
        super().__init__(cfg, tp, full, prefix)
        sources = crossing_sources(prefix, full, cfg.lax_gate)
        for name, names in sources:   # replicated: every rank crosses whole latents alike
            self.shard(name, names, None)
        self.crosses = bool(sources)   # (layer 0 emits its latents, it does not cross)

    def forward(self, x, cos, sin, prev=None, segment=None):
        """(x, the latents of q|k|v, o, gate|up, down); prev: the previous layer's (None: layer 0
        or a pipeline's first stage)."""
        run = segment or (lambda chunk, *args: chunk(*args))
        prev, made = prev or (None,) * len(CHUNK_GROUPS), []

        def carried(chunk, *args):
            if chunk.__name__ not in CHUNK_GROUPS:   # (qkv_down: no latent yet)
                return run(chunk, *args)
            *out, h = run(self.run_crossing, chunk, prev[len(made)], *args)
            made.append(h)
            return out[0] if len(out) == 1 else tuple(out)
        x, _ = super().forward(x, cos, sin, segment=carried)
        return x, tuple(made)

    def run_crossing(self, chunk, h_prev, *args):
        """The layout's chunk(*args), its emit crossing with h_prev: (the chunk's results, the
        latent for the next layer). The chunk runs on a ChunkView rather than on a flag set on the
        layer: under recompute this runs inside a checkpoint, which torch.compile traces as one
        graph only if nothing from outside it is mutated."""
        view = ChunkView(self, CHUNK_GROUPS[chunk.__name__], h_prev)
        out = chunk.__func__(view, *args)
        return (*out, view._made) if isinstance(out, tuple) else (out, view._made)


class ChunkView:
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


# each layer class that carries latents, and how its latents cross (keyed by class, not name)
EXTENSIONS = {BTPBlock: CrossedBTP, VanillaBlock: CrossedVanilla}


@functools.cache
def extended(block):
    """block (a layout's layer class, or a subclass of it) with LaX: CrossedBTP or CrossedVanilla
    first in its MRO. tp_model.TPLlama builds its layers from this under lax=true (Config and
    layouts.check_divisible have already refused LaX on a dense model, megatron's)."""
    base = next((b for b in block.__mro__ if b in EXTENSIONS), None)
    if base is None:
        raise ValueError(f"lax=true: {block.__name__} carries no latents to cross")
    return type(f"LaX{block.__name__}", (EXTENSIONS[base], block), {})


tp_model.extend_for_lax = extended   # importing this file is what lets TPLlama build LaX layers
