"""parallel.py: process groups, the tensor-parallel collectives and the communication ledger.

BOOST (arXiv 2512.12131) sections 2 and 6. The collectives are Megatron's pair f/g (Copy, Reduce)
plus what the layouts of layouts.py need (Gather, the vocab-parallel cross-entropy), each an autograd
Function with an explicit group; CopyUp is f fused with the GEMMs after it, so that backward overlaps
its all-reduce with the weight gradients (--overlap). Every collective records its op, group, phase
and size in LEDGER; train.py logs it per iteration, tools/bench.py compares it with the formulas and
explain.py prints it in order.
Notation: b batch, s sequence, d n_embd, r bottleneck rank, t tp degree.
"""
import os
import sys
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.profiler import record_function

import dp_shard
import kernels


# ------------------------------------------------------------------------------------ the ledger

class Ledger:
    """Every collective records (op, group, phase) -> [elements, bytes, calls]; train.py and tools/bench.py
    read it.

    Elements are those of the collective's result (b·s·n for an all-reduce of n features per token,
    b·s·d for the all-gather of d). Phases: fwd, bwd, and grad (the data-parallel gradient all-reduce)."""

    def __init__(self):
        self.names, self.counts = {}, defaultdict(lambda: [0, 0, 0])
        self.listener = None  # explain.py's: called with (op, group name, phase, tensor) in order

    def name(self, group, name):
        self.names[id(group)] = name

    def record(self, op, group, tensor, phase):
        name = self.names.get(id(group), "?")
        if self.listener:
            self.listener(op, name, phase, tensor)
        entry = self.counts[(op, name, phase)]
        entry[0] += tensor.numel()
        entry[1] += tensor.numel() * tensor.element_size()
        entry[2] += 1

    def reset(self):
        self.counts.clear()

    def total(self, group=None, phase=None, unit="elements"):
        i = ("elements", "bytes", "calls").index(unit)
        return sum(n[i] for (op, g, p), n in self.counts.items()
                   if (group is None or g == group) and (phase is None or p == phase))


LEDGER = Ledger()


# tools/bench.py's lower bound: True skips every collective (the ledger still counts them), so a step
# costs only its computation. Its results are wrong on purpose; no training option sets it.
NO_COMM = False


def group_size(group):
    """A group's size; None stands for a group of one without any process group (layouts.TPLlama as
    the single-device model that runs the Triton kernels: train.py at tp=1)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group):
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x, group, phase, op=dist.ReduceOp.SUM, async_op=False):
    """Sum (or `op`) x over the group, in place when x is contiguous. With async_op the result is
    (x, work): the sum lands in x after work.wait(), and the caller computes in the meantime.
    Profiler traces (--profile) show it as `all_reduce <group> <phase> <elements>`."""
    if group_size(group) == 1:
        return (x, _Pending(None, "")) if async_op else x  # a TP "group" of one (pipelining without TP)
    x = x.contiguous()
    LEDGER.record("all_reduce", group, x, phase)
    label = f"all_reduce {LEDGER.names.get(id(group), '?')} {phase} {x.numel()}"
    with record_function(label):
        work = None if NO_COMM else dist.all_reduce(x, op=op, group=group, async_op=async_op)
    return (x, _Pending(work, label)) if async_op else x


class _Pending:
    """An asynchronous collective's handle; its wait shows in traces as `wait <label>`."""

    def __init__(self, work, label):
        self.work, self.label = work, label

    def wait(self):
        if self.work is not None:
            with record_function("wait " + self.label):
                self.work.wait()


def all_gather_last(x, group, phase):
    """The tensors of the group's ranks concatenated along the last dim (no autograd)."""
    if group_size(group) == 1:
        # not even a local gloo all_gather: its copies start a second OpenMP team on gloo's thread,
        # and with more OpenMP threads than cores every later op of this process runs up to 3x slower
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    if NO_COMM:
        parts = [x] * len(parts)
    else:
        with record_function(f"all_gather {LEDGER.names.get(id(group), '?')} {phase} {x.numel() * len(parts)}"):
            dist.all_gather(parts, x, group=group)
    out = torch.cat(parts, dim=-1)
    LEDGER.record("all_gather", group, out, phase)
    return out


# ------------------------------------------------------------------------------ the collectives

class Copy(torch.autograd.Function):
    """Megatron's f. Forward: identity. Backward: all-reduce of the gradient over the group.

    Enters a region whose ranks use the same input with different weight shards (a column-parallel
    linear): vanilla/megatron before A or W (d, f per token), btp before B (the latent, r)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        if group_size(ctx.group) == 1:
            return grad, None
        return all_reduce(grad.clone(), ctx.group, "bwd"), None  # (the incoming grad may be shared)


class CopyUp(torch.autograd.Function):
    """Copy (f) fused with the column-parallel GEMMs that read its output, so that backward can
    overlap its all-reduce with computation (Megatron's input-gradient all-reduce beside the
    weight-gradient GEMM). Layouts use it with --overlap=true instead of `Copy` + matmuls.

    x (..., k) and Ws [(n_g, r)]: sliced=True, y_g = x_g·W_gᵀ with x_g the g-th r-slice of x
    (BTP's concatenated latents, kernels.grouped_up); sliced=False, y_g = x·W_gᵀ (every W reads
    all of x). Backward: dx first, its all-reduce started asynchronously, then dW_g = dy_gᵀ·x_g
    while it flies, then wait. Same values and the same one collective as Copy."""

    @staticmethod
    def forward(ctx, x, group, sliced, *Ws):
        ctx.group, ctx.sliced = group, sliced
        ctx.save_for_backward(x, *Ws)
        if sliced:
            return tuple(kernels.grouped_up(x, list(Ws)))
        return tuple(x @ W.t() for W in Ws)                                    # [(..., n_g)]

    @staticmethod
    def backward(ctx, *dys):
        x, *Ws = ctx.saved_tensors
        if ctx.sliced:
            dx = kernels.grouped_up_dz(list(dys), Ws)                          # (..., G·r)
        else:
            dx = sum(dy @ W.to(dy.dtype) for dy, W in zip(dys, Ws))           # (..., k)
        dx, work = all_reduce(dx, ctx.group, "bwd", async_op=True)
        if ctx.sliced:
            dWs = kernels.grouped_up_dB(list(dys), x, Ws)
        else:
            x2 = x.reshape(-1, x.shape[-1])                                    # (b·s, k)
            dWs = [dy.reshape(-1, dy.shape[-1]).t() @ x2.to(dy.dtype) for dy in dys]  # [(n_g, k)]
        work.wait()
        return (dx, None, None, *dWs)


class Reduce(torch.autograd.Function):
    """Megatron's g. Forward: all-reduce (sum) over the group. Backward: identity.

    Leaves a row-parallel product, whose ranks each hold a partial sum: megatron after o and down
    (d), vanilla after every B (d_out), btp after every A (the latent r, plus 1 norm statistic)."""

    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous():
            return all_reduce(x.contiguous(), group, "fwd")
        # in place: x is a partial product that no one else reads (mark_dirty: autograd checks it)
        ctx.mark_dirty(x)
        return all_reduce(x, group, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Gather(torch.autograd.Function):
    """Forward: all-gather of the last dim (b, s, d/t) -> (b, s, d), b·s·d elements.
    Backward: this rank's slice of the gradient (the gradient after it is replicated)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.width = group, x.shape[-1]
        return all_gather_last(x, group, "fwd")

    @staticmethod
    def backward(ctx, grad):
        i = group_rank(ctx.group)
        return grad[..., i * ctx.width:(i + 1) * ctx.width].contiguous(), None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary (N, V/t), targets (N,) -> loss (N,).

    Forward: three all-reduces of N elements (max, target logit, sum of exponentials).
    Backward: local, softmax minus one-hot on this rank's slice."""

    @staticmethod
    def forward(ctx, logits, target, group):
        logits = logits.float()
        v_local = logits.shape[-1]
        start = group_rank(group) * v_local
        m = all_reduce(logits.max(dim=-1).values, group, "fwd", op=dist.ReduceOp.MAX)  # (N,)
        shifted = logits - m.unsqueeze(-1)                                             # (N, V/t)
        outside = (target < start) | (target >= start + v_local)
        local_t = (target - start).masked_fill(outside, 0)
        rows = torch.arange(len(target), device=logits.device)
        picked = all_reduce(shifted[rows, local_t].masked_fill(outside, 0.0), group, "fwd")
        exp = shifted.exp()
        sum_exp = all_reduce(exp.sum(dim=-1), group, "fwd")                            # (N,)
        softmax = exp / sum_exp.unsqueeze(-1)   # not in place: torch.compile refuses a saved alias
        ctx.save_for_backward(softmax, outside, local_t)
        return sum_exp.log() - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, outside, local_t = ctx.saved_tensors
        rows = torch.arange(len(local_t), device=grad.device)
        g = softmax.clone()
        g[rows, local_t] -= (~outside).float()
        return g * grad.unsqueeze(-1), None, None


# --------------------------------------------------------------------------- process groups

@dataclass
class TP:
    """This process's tensor-parallel group: `tp_rank` of `size`; `overlap` (--overlap) makes the
    layouts use CopyUp for their column-parallel GEMMs."""
    group: object
    tp_rank: int
    size: int
    overlap: bool = False


def column_parallel(x, Ws, tp, sliced=False):
    """Copy (f), then the column-parallel GEMMs that read x: [x·W_gᵀ], or with sliced=True
    [x_g·W_gᵀ] on the g-th slice of x (BTP's grouped latents, kernels.grouped_up). With tp.overlap
    the same values through CopyUp, whose backward overlaps the all-reduce with the dW GEMMs."""
    if tp.overlap:
        return list(CopyUp.apply(x, tp.group, sliced, *Ws))
    x = Copy.apply(x, tp.group)
    return kernels.grouped_up(x, Ws) if sliced else [x @ W.t() for W in Ws]


def finish(world):
    """The end of a torchrun job's process: leave the group together (no rank closes its connections
    while a peer still uses them)."""
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def exit_worker(world):
    """The end of a spawned worker (tests, tools/bench.py): wait for the group, then exit at once,
    with no teardown (os._exit frees it all): at interpreter teardown gloo's threads can abort the
    process ('terminate called without an active exception'); a 4-rank worker once died of
    SIGSEGV in a suite run here (where, unknown): the group's destruction need not run at all."""
    if world > 1:
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def init_mesh(dp, tp, device_type, timeout_s, pp=1):
    """The (dp, pp, tp) DeviceMesh over the torchrun world, TP innermost (TP peers are adjacent
    ranks, on one node), then PP, then DP."""
    from torch.distributed.device_mesh import init_device_mesh
    if not dist.is_initialized():
        backend, timeout = ("nccl" if device_type == "cuda" else "gloo"), timedelta(seconds=timeout_s)
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:
            # torchrun's store outlives a restarted worker group, and so do the old group's addresses
            # in it: each attempt keeps its keys under its own prefix, or peers dial dead processes.
            # The attempt is counted in the store itself (the restart count is per node).
            world = int(os.environ["WORLD_SIZE"])
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False, timeout=timeout)
            attempt = (store.add("boost/arrivals", 1) - 1) // world
            dist.init_process_group(backend, store=dist.PrefixStore(f"boost/attempt{attempt}", store),
                                    rank=int(os.environ["RANK"]), world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    mesh = init_device_mesh(device_type, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    for name in ("dp", "pp", "tp"):
        LEDGER.name(mesh.get_group(name), name)
    return mesh


def ledger_ddp_hook(group, bucket):
    """DDP communication hook: the default gradient all-reduce, recorded in the ledger."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    LEDGER.record("all_reduce", group, bucket.buffer(), "grad")
    return allreduce_hook(group, bucket)


def clip_grad_norm(model, max_norm, pp_group=None):
    """torch.nn.utils.clip_grad_norm_ with the global norm over TP shards and pipeline stages."""
    tp_model = getattr(model, "module", model)   # (a layouts.TPLlama, under DDP or not)
    norm_sq = tp_model.grad_norm_sq()
    if pp_group is not None:
        dist.all_reduce(norm_sq, group=pp_group)  # the stages hold disjoint parameters
    norm = norm_sq.sqrt().float()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in tp_model.parameters():
        if p.grad is not None:   # (under --dp_shard a DTensor: scale this rank's shard)
            g = dp_shard.local(p.grad)
            g.mul_(coef.to(g.dtype))
    return norm


def all_reduce_grads(model, dp_group):
    """The data-parallel mean of the gradients, where DDP is not used (under pipelining)."""
    size = dist.get_world_size(dp_group)
    for p in model.parameters():
        if p.grad is not None:
            p.grad = all_reduce(p.grad, dp_group, "grad").div_(size)


def reduce_tied_grad(model, pp_group=None):
    """Tied embeddings: the gradient of the one matrix is the sum of its uses' parts, over the TP
    ranks (layouts.TPLlama.reduce_tied_grad), then over the first and the last pipeline stage, which
    both hold it (middle stages add zeros). Afterwards every holder has the single-device gradient,
    so the copies stay equal step after step. A no-op for untied models and on one device."""
    model = getattr(model, "module", model)
    if not getattr(model, "tied", False):
        return
    model.reduce_tied_grad()
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return
    held, cfg = getattr(model, "tok_emb", None), model.cfg
    rows = dp_shard.rows_held(model, cfg.vocab_size)   # (under --dp_shard the same dp shard's rows on both)
    buf = dp_shard.local(held.grad) if held is not None else torch.zeros(rows, cfg.n_embd, device=model.rope_cos.device)
    buf = all_reduce(buf, pp_group, "grad")   # (V, d), or this dp shard of its rows; in place
    if held is not None and not dp_shard.is_sharded(held.grad):
        held.grad = buf


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
            return VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), tp_group).mean()
        self.schedule = (Schedule1F1B if schedule == "1f1b" else ScheduleGPipe)(stage, n_micro, loss_fn=loss_fn)
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
        x_in, out = self.shapes  # (the schedule may run an extra forward to infer shapes: not counted)
        for _ in range(self.n_micro):
            if not self.last:            # the activation to the next stage
                LEDGER.record("send", self.pp_group, out, "fwd")
            if not self.first and train:  # the gradient of the input back to the previous stage
                LEDGER.record("send", self.pp_group, x_in, "bwd")
        loss = torch.stack([l.detach().float() for l in losses]).mean() if self.last else torch.zeros((), device=x.device)
        dist.all_reduce(loss, group=self.pp_group)  # only the last stage holds it
        return loss   # on the device: train.py reads it at log steps
