"""parallel.py: the tensor-parallel collectives, paired forward and backward, and their ledger.

BOOST (arXiv 2512.12131) sections 2 and 6. The collectives are Megatron's pair f/g (Copy, Reduce)
plus what the layouts of layouts.py need (Gather, the vocab-parallel cross-entropy), each an
autograd Function with an explicit group; CopyUp is f fused with the GEMMs after it, so that
backward overlaps its all-reduce with the weight gradients (--overlap). Every collective of a
step's model and optimizer records its op, group, phase and size in LEDGER (not the bookkeeping
around a step: the gradient norm's all-reduces, the pipeline's and dp's loss means, gather_full);
train.py logs it per iteration, tools/bench.py compares it with the formulas and
plumbing/explain.py prints it in order.
Notation: b batch, s sequence, d n_embd, r bottleneck rank, t tp degree.

The pairs, each a forward and its backward (Megatron's f and g, and the rest):

    Copy (f)        forward: identity             backward: all-reduce of the input's gradient
    Reduce (g)      forward: all-reduce           backward: identity
    CopyUp          f fused with the GEMMs after it: backward's all-reduce overlaps dW
    Gather          forward: all-gather (last)    backward: this rank's slice of the gradient
    VocabParallelCrossEntropy  forward: 3 all-reduces of N (max, target logit, Σexp)
                               backward: local

Before the LM head BTP gathers the residual stream (b, s, d/t) -> (b, s, d) (Gather): the head is
cut along the vocabulary, and V ≫ d, so moving d numbers a token beats moving its V logits.
"""
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.profiler import record_function

import local_ops


# ------------------------------------------------------------------------------------ the ledger

class Ledger:
    """Every collective records (op, group, phase) -> [elements, bytes, calls]; train.py and
    tools/bench.py read it.

    Elements are those of the collective's result (b·s·n for an all-reduce of n features per token,
    b·s·d for the all-gather of d), except a reduce-scatter's (its input: the whole gradient) and
    an all-to-all's (what this rank sends). Phases: fwd, bwd, grad (the data-parallel gradient
    all-reduce or FSDP2's reduce-scatter) and optim (Muon's)."""

    def __init__(self):
        self.names, self.counts = {}, defaultdict(lambda: [0, 0, 0])
        # plumbing/explain.py's: called with (op, group name, phase, tensor) in order
        self.listener = None

    def name(self, group, name):
        self.names[id(group)] = name

    def record(self, op, group, tensor, phase):
        name = self.names.get(id(group), "?")
        if torch.compiler.is_compiling():   # traced: an op of the graph, counted at every run
            torch.ops.boost.ledger(_TICK, op, name, phase, tensor.numel(), tensor.element_size())
            return
        if self.listener:
            self.listener(op, name, phase, tensor)
        self.add(op, name, phase, tensor.numel(), tensor.element_size())

    def add(self, op, name, phase, numel, element_size):
        entry = self.counts[(op, name, phase)]
        entry[0] += numel
        entry[1] += numel * element_size
        entry[2] += 1

    def reset(self):
        self.counts.clear()

    def total(self, group=None, phase=None, unit="elements"):
        i = ("elements", "bytes", "calls").index(unit)
        return sum(n[i] for (op, g, p), n in self.counts.items()
                   if (group is None or g == group) and (phase is None or p == phase))


LEDGER = Ledger()
_TICK = torch.zeros(())   # what the ledger's op writes: a graph keeps an op that writes


@torch.library.custom_op("boost::ledger", mutates_args=("tick",))
def _ledger_op(tick: torch.Tensor, op: str, name: str, phase: str, numel: int,
               element_size: int) -> None:
    """LEDGER.add as an op of a torch.compile graph: a Python side effect in traced code would run
    once, at tracing; an op runs at every step."""
    LEDGER.add(op, name, phase, numel, element_size)


# tools/bench.py's lower bound: True skips every collective (the ledger still counts them), so a
# step costs only its computation. Its results are wrong on purpose; no training option sets it.
NO_COMM = False


def group_size(group):
    """A group's size; None stands for a group of one without any process group (tp_model.TPLlama as
    the single-device model that runs the Triton kernels: train.py at tp=1)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group):
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x, group, phase, op=dist.ReduceOp.SUM, async_op=False):
    """Sum (or `op`) x over the group, in place when x is contiguous. With async_op the result is
    (x, work): the sum lands in x after work.wait(), and the caller computes in the meantime.
    Profiler traces (--profile) show it as `all_reduce <group> <phase> <elements>`."""
    if group_size(group) == 1:
        # a TP "group" of one (pipelining without TP)
        return (x, _Pending(None, "")) if async_op else x
    x = x.contiguous()
    LEDGER.record("all_reduce", group, x, phase)
    if torch.compiler.is_compiling():   # traced: a functional collective, one node of the graph
        x = funcol.all_reduce(x, {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max"}[op], group)
        return (x, _Pending(None, "")) if async_op else x
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
        # and with more OpenMP threads than cores every later op of this process runs up to 3x
        # slower
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    if NO_COMM:
        parts = [x] * len(parts)
    else:
        name = LEDGER.names.get(id(group), "?")
        with record_function(f"all_gather {name} {phase} {x.numel() * len(parts)}"):
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
    (BTP's concatenated latents, local_ops.grouped_expand); sliced=False, y_g = x·W_gᵀ (every W
    reads all of x). Backward: dx first, its all-reduce started asynchronously, then
    dW_g = dy_gᵀ·x_g while it flies, then wait. Same values and the same one collective as Copy."""

    @staticmethod
    def forward(ctx, x, group, sliced, *Ws):
        ctx.group, ctx.sliced = group, sliced
        ctx.save_for_backward(x, *Ws)
        if sliced:
            return tuple(local_ops.grouped_expand(x, list(Ws)))
        return tuple(x @ W.t() for W in Ws)                                    # [(..., n_g)]

    @staticmethod
    def backward(ctx, *dys):
        x, *Ws = ctx.saved_tensors
        if ctx.sliced:
            dx = local_ops.grouped_expand_dz(list(dys), Ws)                    # (..., G·r)
        else:
            dx = sum(dy @ W.to(dy.dtype) for dy, W in zip(dys, Ws))           # (..., k)
        dx, work = all_reduce(dx, ctx.group, "bwd", async_op=True)
        if ctx.sliced:
            dWs = local_ops.grouped_expand_dB(list(dys), x, Ws)
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
        if not x.is_contiguous() or torch.compiler.is_compiling():   # (traced: out of place)
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


CE_CHUNK = 1 << 24   # elements of logits the cross-entropy turns to fp32 at once (64 MB)


def _row_chunks(n, width):
    """(start, end) row ranges of an (n, width) tensor, CE_CHUNK elements each at most."""
    step = max(1, CE_CHUNK // width)
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def _exp_shifted(logits, m, a, b):
    """exp(logits - m) of rows a:b in fp32 (c, V/t): the cross-entropy's temporaries are these."""
    return torch.exp(logits[a:b].float() - m[a:b, None])


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary (N, V/t), targets (N,) -> loss (N,).

    Forward: three all-reduces of N elements (max, target logit, sum of exponentials).
    Backward: local, softmax minus one-hot on this rank's slice. In bounded memory: beside the
    logits (which the caller holds) and the gradient, only a chunk of rows in fp32 at a time
    (CE_CHUNK); backward recomputes the softmax, exp(logits - log Σ exp), from the logits."""

    @staticmethod
    def forward(ctx, logits, target, group):
        n, v_local = logits.shape
        start = group_rank(group) * v_local
        outside = (target < start) | (target >= start + v_local)
        local_t = (target - start).masked_fill(outside, 0)
        rows = torch.arange(n, device=logits.device)
        m = all_reduce(logits.max(dim=-1).values.float(), group, "fwd", op=dist.ReduceOp.MAX)
        picked = (logits[rows, local_t].float() - m).masked_fill(outside, 0.0)        # (N,)
        picked = all_reduce(picked, group, "fwd")
        sum_exp = torch.cat([_exp_shifted(logits, m, a, b).sum(dim=-1)
                             for a, b in _row_chunks(n, v_local)])                    # (N,)
        sum_exp = all_reduce(sum_exp, group, "fwd")
        lse = m + sum_exp.log()   # log Σ exp(logits), the softmax's normaliser: saved, (N,)
        ctx.save_for_backward(logits, lse, outside, local_t)
        return sum_exp.log() - picked

    @staticmethod
    def backward(ctx, grad):
        logits, lse, outside, local_t = ctx.saved_tensors
        g = torch.empty_like(logits)                                                   # (N, V/t)
        for a, b in _row_chunks(*logits.shape):
            p = _exp_shifted(logits, lse, a, b)                             # softmax (c, V/t)
            p[torch.arange(b - a, device=p.device), local_t[a:b]] -= (~outside[a:b]).float()
            g[a:b] = p * grad[a:b, None]
        return g, None, None


# --------------------------------------------------------------------------- process groups

@dataclass
class TPGroup:
    """This process's tensor-parallel group: `tp_rank` of `size`; `overlap` (--overlap) makes the
    layouts use CopyUp for their column-parallel GEMMs."""
    group: object
    tp_rank: int
    size: int
    overlap: bool = False


def column_parallel(x, Ws, tp, sliced=False):
    """Copy (f), then the column-parallel GEMMs that read x: [x·W_gᵀ], or with sliced=True
    [x_g·W_gᵀ] on the g-th slice of x (BTP's grouped latents, local_ops.grouped_expand). With
    tp.overlap the same values through CopyUp, whose backward overlaps the all-reduce with the dW
    GEMMs."""
    if tp.overlap:
        return list(CopyUp.apply(x, tp.group, sliced, *Ws))
    x = Copy.apply(x, tp.group)
    return local_ops.grouped_expand(x, Ws) if sliced else [x @ W.t() for W in Ws]
