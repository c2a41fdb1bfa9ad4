"""pipeline.py: pipeline parallelism, the pp dimension of BOOST's 3D layouts (arXiv 2512.12131 §6).

Each pipeline stage is a layouts.TPLlama holding n_layer/pp layers (the embedding on the first
stage, the final norm and LM head on the last); torch.distributed.pipelining's schedules (1F1B,
GPipe, and the multi-stage interleaved 1F1B and zero-bubble with one stage a rank) run the
micro-batches through them. Between stages the residual stream travels as the layout
holds it, (b, s, d/t) under BTP, and under LaX the previous layer's latents ride beside it.
Notation: b batch, s sequence, d n_embd, t tp degree, V vocabulary.
"""
import torch
import torch.distributed as dist

from parallel import LEDGER, VocabParallelCrossEntropy


# the schedules built for several stages a rank, run here with one: interleaved 1F1B's order, and
# zero-bubble's, which splits each backward into the input's gradient (sent at once) and the
# weights' (deferred into what would be the bubble)
MULTI = {"interleaved_1f1b": "ScheduleInterleaved1F1B",
         "zero_bubble": "ScheduleInterleavedZeroBubble"}


class Pipeline:
    """Pipeline parallelism over layouts.TPLlama stages with torch.distributed.pipelining.

    Each (dp, tp) rank of stage i sends its slice of the residual stream, (b, s, d/t) under btp, to
    the same (dp, tp) rank of stage i+1, once per micro-batch forward and once per backward; the
    ledger counts both. The schedule (1F1B or GPipe) runs this rank's gradient-accumulation
    micro-batches; the loss is the vocab-parallel cross-entropy, and the schedule scales each
    micro-batch's gradients by 1/n, so the result is the gradient of the mean loss."""

    def __init__(self, stage_model, mesh, n_micro, schedule, device):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        self.pp_group, tp_group = mesh.get_group("pp"), mesh.get_group("tp")
        pp_rank, pp = mesh.get_local_rank("pp"), mesh.size(mesh.mesh_dim_names.index("pp"))
        self.first, self.last = pp_rank == 0, pp_rank == pp - 1
        stage = PipelineStage(stage_model, pp_rank, pp, torch.device(device), group=self.pp_group)

        def loss_fn(logits, targets):  # (b, s, V/t), (b, s)
            return VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(),
                                                   tp_group).mean()
        if schedule in MULTI:   # (these take a list of stages: here one a rank)
            from torch.distributed import pipelining
            self.schedule = getattr(pipelining, MULTI[schedule])([stage], n_micro,
                                                                 loss_fn=loss_fn)
        else:
            kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
            self.schedule = kind(stage, n_micro, loss_fn=loss_fn)
        self.n_micro, self.shapes = n_micro, None
        stage_model.register_forward_hook(self._shapes)

    def _shapes(self, module, inputs, output):
        """The stage's input and output of one micro-batch (what crosses the stage boundaries)."""
        self.shapes = (inputs[0].detach(), output.detach())

    def run(self, x, y, train=True):
        """All micro-batches of x, y (n_micro·b, s) through the pipeline (forward and backward when
        training); returns the mean loss, on every stage, as a device tensor."""
        losses = []
        args = (x,) if self.first else ()
        kwargs = {"target": y, "losses": losses} if self.last else {}
        (self.schedule.step if train else self.schedule.eval)(*args, **kwargs)
        # (the schedule may run an extra forward to infer shapes: not counted)
        x_in, out = self.shapes
        for _ in range(self.n_micro):
            if not self.last:            # the activation to the next stage
                LEDGER.record("send", self.pp_group, out, "fwd")
            if not self.first and train:  # the gradient of the input back to the previous stage
                LEDGER.record("send", self.pp_group, x_in, "bwd")
        loss = torch.stack([l.detach().float() for l in losses]).mean() if self.last else \
            torch.zeros((), device=x.device)
        dist.all_reduce(loss, group=self.pp_group)  # only the last stage holds it
        return loss   # on the device: train.py reads it at log steps
