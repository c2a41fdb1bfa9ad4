"""checkpointing.py: low-rank activation checkpointing, BOOST (arXiv 2512.12131) section 5.

`--recompute=` chooses what autograd keeps between forward and backward:

  none     everything the ops save (many d- and d_ff-sized tensors per layer).
  layer    whole-block recompute (torch.utils.checkpoint, non-reentrant): each layer keeps only its
           input; backward replays the whole layer, including its forward all-reduces under TP.
  lowrank  segments aligned with the BTP chunks (CoLA-M's segmentation). A segment starts from a
           replicated latent after its all-reduce (and the residual slice where it needs it) and
           ends with the local partial product of the next down-projection A, before its
           all-reduce. So the collectives stay outside the segments and recomputing them in
           backward issues none; the last GEMM of a segment (that A) is not recomputed at all
           (non-reentrant checkpoint stops once the tensors backward needs are rebuilt).

One layer under BTP, segments [ ... ], all-reduces between them (b s elided; t = tp degree):

   [x (d/t) -> RMSNorm·A_qkv partial] -> AR(3r+1) ->
   [σ(H/rms) -> B_q,B_k,B_v -> attention on local heads -> A_o partial] -> AR(r) ->
   [σ -> B_o -> x' = x + .  -> RMSNorm·A_gu partial] -> AR(2r+1) ->
   [σ(H/rms) -> B_gate,B_up -> gate·up (f/t) -> A_down partial] -> AR(r) ->
   [σ -> B_down -> x'' = x' + . -> next layer's RMSNorm·A_qkv partial] -> AR(3r+1) -> ...

Saved per token per layer with `lowrank` (e = bytes per activation element; with rank ra for
attention and rm for the MLP):
  btp          (4·ra + 3·rm + 2 + 2·d/t)·e       the all-reduced latents (q/k/v and gate/up with
                                                  their norm statistic) and the residuals x and x'
  one device   (4·ra + 3·rm + 2·d)·e             the latents A·x and the residuals x and x'
  vanilla      (4·ra/t + 3·rm/t + 2·d)·e         local latent slices, replicated residuals; here
                                                  each B ends in an all-reduce inside its segment,
                                                  so recompute replays them (the paper's point)
With `layer`: d/t·e (btp) or d·e (one device, vanilla, megatron) per token per layer.

(Training-state checkpoints, the files a run saves and resumes from, are train_state.py.)
"""
import torch
from torch.utils.checkpoint import checkpoint

import model as llama

RECOMPUTE = ("none", "layer", "lowrank")


class OneDeviceChunks:
    """model.Block (arch svd or cola) seen as the same chunks; its latents are A·x, no collectives."""

    def __init__(self, block):
        self.b, self.cfg = block, block.attn.cfg
        self.act = llama.latent_act(self.cfg.arch)

    def reduce(self, partial):
        return partial

    def qkv_down(self, x):
        a, h = self.b.attn, self.b.attn_norm(x)                            # (b, s, d)
        return torch.cat([a.q.A(h), a.k.A(h), a.v.A(h)], -1)               # (b, s, 3r)

    def attn_chunk(self, z, cos, sin):
        a, cfg = self.b.attn, self.cfg
        zq, zk, zv = self.act(z).split(cfg.attn_rank, -1)
        y = llama.causal_attention(a.q.B(zq), a.k.B(zk), a.v.B(zv), cfg.n_head, cfg.n_kv_head, cos, sin)
        return a.o.A(y)                                                    # (b, s, r)

    def o_chunk(self, u, x):
        x = x + self.b.attn.o.B(self.act(u))                              # (b, s, d)
        m, h = self.b.mlp, self.b.mlp_norm(x)
        return x, torch.cat([m.gate.A(h), m.up.A(h)], -1)                  # (b, s, 2r)

    def mlp_chunk(self, z):
        m = self.b.mlp
        zg, zu = self.act(z).split(self.cfg.mlp_rank, -1)
        return m.down.A(llama.gated_product(self.cfg.mlp_gate, m.gate.B(zg), m.up.B(zu)))  # (b, s, r)

    def down_chunk(self, u, x):
        return x + self.b.mlp.down.B(self.act(u))                         # (b, s, d)


def _segment(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False)


def _down_then_next(block, nxt):
    """The segment that crosses a layer boundary: B_down, the residual add, the next A_qkv partial."""
    def fn(u, x):
        x = block.down_chunk(u, x)
        return x, nxt.qkv_down(x)
    return fn


def run_layers(layers, x, cos, sin, recompute):
    """Run the decoder layers on x with the chosen activation checkpointing."""
    if recompute == "none":
        for layer in layers:
            x = layer(x, cos, sin)
        return x
    if recompute == "layer":
        for layer in layers:
            x = _segment(layer, x, cos, sin)
        return x
    blocks = [OneDeviceChunks(b) if isinstance(b, llama.Block) else b for b in layers]
    partial = _segment(blocks[0].qkv_down, x)
    for i, b in enumerate(blocks):
        u = b.reduce(_segment(b.attn_chunk, b.reduce(partial), cos, sin))
        x, partial = _segment(b.o_chunk, u, x)
        u = b.reduce(_segment(b.mlp_chunk, b.reduce(partial)))
        if i + 1 < len(blocks):
            x, partial = _segment(_down_then_next(b, blocks[i + 1]), u, x)
        else:
            x = _segment(b.down_chunk, u, x)
    return x


def check_recompute(cfg, recompute):
    """A clear ValueError where the mode does not apply to this model."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute} is not one of {', '.join(RECOMPUTE)}")
    if recompute == "lowrank" and not cfg.lowrank:
        raise ValueError("recompute=lowrank needs low-rank bottlenecks; arch=full uses none or layer")


class SavedBytes:
    """Bytes an autograd graph saves for backward, parameters excluded, each storage counted once.

        with SavedBytes(model) as meter:
            loss = model(x, y)[1]
        meter.bytes"""

    def __init__(self, module):
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.storages = {}

    def pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def bytes(self):
        return sum(self.storages.values())
