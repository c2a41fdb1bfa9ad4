"""tp_model.py: the model a run trains: model.Llama cut under a layout of layouts.py.

BOOST (arXiv 2512.12131) sections 2-4 and 6. Every run trains a TPLlama, at tp=1 a TP group of one:
the token embedding (cut along d under btp), the layout's layers, the final RMSNorm and the LM head
cut along the vocabulary, whose cross-entropy runs on the vocabulary shards
(parallel.VocabParallelCrossEntropy): no rank holds the (b, s, V) logits. As one stage of a
pipeline (extensions/pipeline.py) it holds that stage's layers alone.
Notation: b batch, s sequence, d n_embd, V vocabulary, t tp degree, r bottleneck rank.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import local_ops
from layouts import LAYOUTS, check_divisible
from model import Llama, rope_table
from parallel import Gather, VocabParallelCrossEntropy, all_gather_last, column_parallel
from recompute import run_layers
from sharding import Sharded

extend_for_lax = None   # block -> block with LaX's crossing: set by extensions/lax_layers.py


class TPLlama(Sharded):
    """model.Llama under a TP layout; same forward contract: (idx, targets) -> (logits, loss), the
    logits vocab-sharded (b, s, V/t) with targets and all-gathered (b, 1, V) without.
    As pipeline stage `stage` of `stages` (or the stages of a tuple: several a rank) it holds
    n_layer/stages layers a stage, the embedding with stage 0 and the final norm and LM head with
    the last; between stages the residual stream travels as held here ((b, s, d/t) under btp), and
    the last stage returns the logits for the schedule's loss (extensions/pipeline.py). Tied
    embeddings: every TP rank of the first and last stage holds the matrix whole and uses its
    slices (`embedding`, `head`); sharding.reduce_tied_grad sums their gradients.
    `recompute` (none | layer | lowrank) is its activation checkpointing (recompute.py);
    `block` replaces the layout's layer class (tools/ablations.py); under lax=true
    extensions/lax_layers.py extends the class with its crossing (`extend_for_lax`)."""

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
                       1 if LAYOUTS[layout].stream_sharded else None)  # (V, d/t) or (V, d)
        block = block or LAYOUTS[layout].block
        if model.cfg.lax:   # LaX's crossing, an extension of the layer
            if extend_for_lax is None:
                raise ValueError("lax=true needs extensions/lax_layers.py imported (placement "
                                 "imports it): it extends the layer with the crossing")
            block = extend_for_lax(block)
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
        if LAYOUTS[self.layout].stream_sharded:
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
        if LAYOUTS[self.layout].stream_sharded:   # the head is cut along V ≫ d: send d, not V
            x = Gather.apply(x, g)                                  # (b, s, d)
        x = local_ops.rms_norm(x, self.norm, self.cfg.norm_eps)      # (b, s, d)
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
