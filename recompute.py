"""recompute.py: low-rank activation checkpointing, BOOST (arXiv 2512.12131) section 5.

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

The chunk sequence is written once, in layouts.BTPBlock.forward (vanilla runs the same one); this
module hands it `_segment`, which runs each chunk as a checkpointed segment.

One layer under BTP, segments [ ... ], all-reduces between them (b s elided; t = tp degree):

   [x (d/t) -> RMSNorm·A_qkv partial] -> AR(3r+1) ->
   [σ(H/rms) -> B_q,B_k,B_v -> attention on local heads -> A_o partial] -> AR(r) ->
   [σ -> B_o -> x' = x + .  -> RMSNorm·A_gu partial] -> AR(2r+1) ->
   [σ(H/rms) -> B_gate,B_up -> gate·up (f/t) -> A_down partial] -> AR(r) ->
   [σ -> B_down -> x'' = x' + .]   [next layer: x'' -> RMSNorm·A_qkv partial] -> AR(3r+1) -> ...

(The residual x'' ends one layer's last segment and starts the next layer's first: it is kept once,
as the input of both. A segment never spans two layers: the layer's own forward runs its chunks,
each through the `segment` it is handed, so FSDP2 gathers the layer's parameters around all of
them as around any forward: extensions/dp_shard.py.)

Saved per token per layer with `lowrank` (e = bytes per activation element; with rank ra for
attention and rm for the MLP):
  btp          (4·ra + 3·rm + 2 + 2·d/t)·e       the all-reduced latents (q/k/v and gate/up with
                                                  their norm statistic) and the residuals x and x';
                                                  one device is btp at t=1 (every run trains a
                                                  layout: at tp=1 a TP group of one)
  vanilla      (4·ra/t + 3·rm/t + 2·d)·e         local latent slices, replicated residuals; here
                                                  each B ends in an all-reduce inside its segment,
                                                  so recompute replays them (the paper's point)
With `layer`: d/t·e (btp) or d·e (vanilla, megatron) per token per layer.

Under LaX (lax.py) every segment also takes the previous layer's latents h_prev of its
projections and returns this layer's, whole (replicated under btp, gathered under vanilla): in
every row above, with `lowrank` and with `layer` alike, each layer keeps (4·ra + 3·rm)·e more.

(Training-state checkpoints, the files a run saves and resumes from, are plumbing/train_state.py.)
"""
from torch.utils.checkpoint import checkpoint

RECOMPUTE = ("none", "layer", "lowrank")


def _segment(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False)


def _whole_layer(layer):
    """A layer as a segment whose tensors are all its arguments: x, cos, sin, then the latents."""
    return lambda x, cos, sin, *lat: layer(x, cos, sin, tuple(lat) or None)


def run_layers(layers, x, cos, sin, recompute, lat=None):
    """Run the decoder layers on x with the chosen activation checkpointing: (x, the last layer's
    latents under LaX, else None); `lat` holds the latents of the layer before the first (a pipeline
    stage's input). Each layer is called as layer(x, cos, sin, lat) -> (x, lat)."""
    if recompute == "none":
        for layer in layers:
            x, lat = layer(x, cos, sin, lat)
        return x, lat
    if recompute == "layer":
        # (the latents as arguments of their own: checkpoint keeps those it is given)
        for layer in layers:
            x, lat = _segment(_whole_layer(layer), x, cos, sin, *(lat or ()))
        return x, lat
    for layer in layers:  # (each chunk of the layer's forward a segment: layouts.BTPBlock)
        x, lat = layer(x, cos, sin, lat, segment=_segment)
    return x, lat


def check_recompute(cfg, recompute):
    """A clear ValueError where the mode does not apply to this model."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute} is not one of {', '.join(RECOMPUTE)}")
    if recompute == "lowrank" and not cfg.lowrank:
        raise ValueError("recompute=lowrank needs low-rank bottlenecks; arch=full uses none or "
                         "layer")
