"""pipeline.py: pipeline parallelism, the pp dimension of BOOST's 3D layouts (arXiv 2512.12131 §6).

The model's layers are cut into pp × v stages (`--pp_virtual_stages` v; the embedding with the
first stage, the final norm and LM head with the last), each rank holding v of them as one
tp_model.TPLlama; torch.distributed.pipelining's schedules run the micro-batches through them:
1F1B and GPipe (one stage a rank), interleaved 1F1B and interleaved zero-bubble (stages looped over
the ranks: rank i holds i, i + pp, ...), ZBV and DualPipeV (two stages a rank in a V: rank i holds
i and 2pp − 1 − i, so the first and the last stage share rank 0). Zero-bubble schedules split each
backward into the input's gradient (sent at once) and the weights' (deferred into what would be
the bubble): under BTP a low-rank layer's weight gradients need no collective, so the deferred
pass moves nothing. Between stages the residual stream travels as the layout holds it, (b, s, d/t)
under BTP, and under LaX the previous layer's latents ride beside it.
Notation: b batch, s sequence, d n_embd, t tp degree, V vocabulary, m micro-batches.
"""
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from parallel import LEDGER, VocabParallelCrossEntropy


# torch.distributed.pipelining's schedule of each --pp_schedule
SINGLE = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}   # one stage a rank
MULTI = {"interleaved_1f1b": "ScheduleInterleaved1F1B",       # v stages a rank, looped
         "zero_bubble": "ScheduleInterleavedZeroBubble",
         "zbv": "ScheduleZBVZeroBubble",                       # two stages a rank, in a V
         "dualpipev": "ScheduleDualPipeV"}
V_SHAPED = ("zbv", "dualpipev")
BACKWARD_ACTIONS = ("B", "I", "W", "SEND_B", "RECV_B", "REDUCE_GRAD")   # (in torch's action lists)
SPLIT_BACKWARD = ("zero_bubble", "zbv", "dualpipev")   # the input's gradient, then the weights'


def stages_of(pp_rank, pp, virtual, schedule):
    """The pipeline stages rank `pp_rank` holds, of pp × virtual (V-shaped schedules: of 2pp)."""
    if schedule in V_SHAPED:
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return tuple(k * pp + pp_rank for k in range(virtual))


class StageView(nn.Module):
    """One held stage of a TPLlama as torch's PipelineStage takes it: its parameters are the
    stage's alone (the zero-bubble weight pass walks them) and its forward is the model's, for that
    stage (so hooks on the model, FSDP2's, still run)."""

    def __init__(self, model, stage):
        super().__init__()
        self.stage, self._model = stage, [model]   # (in a list: not a submodule)
        self.layers = model.layers[model.at[stage]]
        ends = (["tok_emb"] if stage == 0 else []) + \
            (["norm", "lm_head", "tok_emb"] if stage == model.stages - 1 else [])
        for name in dict.fromkeys(ends):
            if isinstance(getattr(model, name, None), nn.Parameter):
                self.register_parameter(name, getattr(model, name))

    def forward(self, x):
        return self._model[0](x, stage=self.stage)


class Pipeline:
    """Pipeline parallelism over tp_model.TPLlama stages with torch.distributed.pipelining.

    Each (dp, tp) rank of stage i sends its slice of the residual stream, (b, s, d/t) under btp, to
    the same (dp, tp) rank of stage i+1, once per micro-batch forward and once per backward, where
    the two stages sit on different ranks (a V's turn at its bottom rank stays there); the ledger
    counts those. The schedule runs this rank's gradient-accumulation micro-batches; the loss is
    the vocab-parallel cross-entropy over m, so the gradients add up to the mean loss's (torch's
    own scaling is off: it would divide a tied embedding held by two stages of one rank twice)."""

    def __init__(self, model, mesh, n_micro, schedule, device):
        from torch.distributed import pipelining
        self.pp_group, tp_group = mesh.get_group("pp"), mesh.get_group("tp")
        held, n_stages = tuple(model.at), model.stages   # (stages_of: the stages the model holds)
        # one module a held stage (the model itself where it holds one)
        views = [model] if len(held) == 1 else [StageView(model, k) for k in held]
        stages = [pipelining.PipelineStage(v, k, n_stages, torch.device(device),
                                           group=self.pp_group) for v, k in zip(views, held)]
        self.first, self.last = model.first, model.last

        def loss_fn(logits, targets):  # (b, s, V/t), (b, s)
            return VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(),
                                                   tp_group).mean() / n_micro
        self.stages, self.device, self.busy = stages, torch.device(device), None
        if schedule in SINGLE:   # (the multi-stage schedules label their actions PP:2F1 in traces)
            self._label(stages[0])
        kind = getattr(pipelining, {**SINGLE, **MULTI}[schedule])
        self.schedule = kind(stages if schedule in MULTI else stages[0], n_micro,
                             loss_fn=loss_fn, scale_grads=False)
        self.evaluator = self.schedule
        if schedule in V_SHAPED:   # (torch evaluates in the training order, whose backward hands
            # a gradient across the V's turn even then: evaluation runs the forwards alone)
            self.evaluator = kind(stages, n_micro, loss_fn=loss_fn, scale_grads=False)
            self.evaluator.pipeline_order_with_comms = {
                r: [sub for a in acts for sub in (a.sub_actions or (a,))
                    if sub.computation_type.value not in BACKWARD_ACTIONS]
                for r, acts in self.evaluator.pipeline_order_with_comms.items()}
        self.n_micro, self.shapes = n_micro, {}
        # the boundaries this rank sends across, (stage, forward to the next, backward to the
        # last): those whose neighbour another rank holds
        self.sends = [(k, k + 1 < n_stages and k + 1 not in held, k > 0 and k - 1 not in held)
                      for k in held]
        for v, k in zip(views, held):
            v.register_forward_hook(self._keep_shapes(k))
        # FSDP2 (--dp_shard) under several stages a rank: torch's stages see StageViews, not the
        # FSDP module, and would reduce-scatter after every micro-batch; held to the last, below
        from torch.distributed.fsdp import FSDPModule
        self.fsdp = model if len(held) > 1 and isinstance(model, FSDPModule) else None

    def _keep_shapes(self, k):
        """A hook keeping stage k's input and output of one micro-batch (what crosses its
        boundaries: the ledger's sends)."""
        def hook(module, inputs, output):
            self.shapes[k] = (inputs[0].detach(), output.detach())
        return hook

    @staticmethod
    def _label(stage):
        """1F1B's and GPipe's forwards and backwards as PP:<stage>F<micro-batch> (B) in --profile
        traces, as torch's multi-stage schedules label theirs."""
        def labelled(fn, kind):
            def run(chunk, *args, **kwargs):
                with record_function(f"PP:{stage.stage_index}{kind}{chunk}"):
                    return fn(chunk, *args, **kwargs)
            return run
        stage.forward_one_chunk = labelled(stage.forward_one_chunk, "F")
        stage.backward_one_chunk = labelled(stage.backward_one_chunk, "B")

    def time_actions(self):
        """From now on add the seconds each action computes into self.busy (F forward, B whole
        backward, I and W its input and weight halves): the rest of a step is the bubble and the
        waits on sends (tools/bench_schedules.py). On a GPU each action is synchronised."""
        self.busy = dict.fromkeys("FBIW", 0.0)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)

        def timed(fn, name):
            def run(*args, **kwargs):
                sync()
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                sync()
                kind = "F" if name.startswith("forward") else "W" if "weight" in name else \
                    "B" if kwargs.get("full_backward", True) else "I"
                self.busy[kind] += time.perf_counter() - t0
                return out
            return run
        for stage in self.stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, timed(getattr(stage, name), name))

    def run(self, x, y, train=True):
        """All micro-batches of x, y (m·b, s) through the pipeline (forward and backward when
        training); returns the mean loss, on every stage, as a device tensor."""
        losses = []
        args = (x,) if self.first else ()
        kwargs = {"target": y, "losses": losses} if self.last else {}
        if train and self.fsdp is not None:
            hold_gradient_sync(self.fsdp, True)
        (self.schedule.step if train else self.evaluator.eval)(*args, **kwargs)
        if train and self.fsdp is not None:
            hold_gradient_sync(self.fsdp, False)
        # (the schedule may run an extra forward to infer shapes: not counted)
        for k, fwd, bwd in self.sends:
            x_in, out = self.shapes[k]
            for _ in range(self.n_micro):
                if fwd:              # the activation to the next stage
                    LEDGER.record("send", self.pp_group, out, "fwd")
                if bwd and train:    # the gradient of the input back to the previous stage
                    LEDGER.record("send", self.pp_group, x_in, "bwd")
        # (each micro-batch's loss is divided by m: their sum is the mean)
        loss = torch.stack([l.detach().float() for l in losses]).sum() if self.last else \
            torch.zeros((), device=x.device)
        dist.all_reduce(loss, group=self.pp_group)  # only the last stage holds it
        return loss   # on the device: train.py reads it at log steps


def hold_gradient_sync(model, hold):
    """FSDP2's flags as torch's PipelineStage sets them for a stage that is an FSDP module: while
    held, backward accumulates unsharded gradients and keeps the parameters gathered; released,
    every FSDP group of the model reduce-scatters its gradients once (the step's only one) and
    reshards, as torch's stage does at its REDUCE_GRAD action."""
    from torch.distributed.fsdp import fully_shard
    model.set_is_last_backward(not hold)
    model.set_reshard_after_backward(not hold)
    model.set_requires_gradient_sync(not hold)
    if not hold:
        state = fully_shard.state(model)
        for each in state._state_ctx.all_states:   # (torch 2.11: one `_fsdp_param_group` or None)
            groups = getattr(each, "_fsdp_param_groups", None)
            for group in groups if groups is not None else filter(None, [each._fsdp_param_group]):
                group.post_backward()
        state._root_post_backward_final_callback()
