"""dp_shard.py: sharded data parallelism, PyTorch's FSDP2 on the data-parallel dimension of the
mesh.

Not in the BOOST paper (arXiv 2512.12131), which leaves ZeRO and FSDP out of scope as orthogonal
(§6 composes BTP with plain data parallelism). `--dp_shard=` chooses what the dp ranks keep:

  none  DDP: every dp rank holds the whole (TP-local) model, gradients all-reduced (train.py).
  grad  ZeRO-2 style: `fully_shard(..., reshard_after_forward=False)`: parameters, gradients and
        AdamW moments sharded over dp between steps; a layer's parameters all-gathered before its
        forward and kept until its backward; gradients reduce-scattered.
  full  ZeRO-3 style (`reshard_after_forward=True`): the same, but a layer's parameters are freed
        after its forward and all-gathered again for its backward.

Each decoder layer is one FSDP unit and the root (embedding, final norm, head; on a pipeline stage
what the stage holds) another; the units hold each layout's TP-local parameters (tp_model.TPLlama:
under BTP the (r, d/t) and (d/t, r) slices), so FSDP shards over dp what TP already cut. FSDP2
issues its collectives itself, through the Counted ones below, so the ledger (and --explain) sees
each all-gather and reduce-scatter it sends. Under recompute=lowrank a layer's segments run inside
its forward (recompute.py), so FSDP2 gathers its parameters around them as around any forward.
Muon's updates, which need whole rows, are gathered over dp in one call (gathered_rows).
"""
import torch
import torch.distributed as dist

from parallel import all_gather_last
# a dp shard's rows, read through here too (sharding.py holds them: the story's code meets them)
from sharding import (chunk_rows, held, is_sharded, local, rows_held,  # noqa: F401
                      shard_bounds, write_rows)

MODES = ("none", "grad", "full")
# (the names of torch 2.13; the older ones before it)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def apply(model, dp_mesh, mode, dtype, ledger=None):
    """fully_shard each decoder layer, then the root, over the dp mesh; in bf16 (`dtype`, the run's
    compute dtype) mixed precision through FSDP's MixedPrecisionPolicy: fp32 shards, gathered in
    bf16 for compute, gradients reduced in fp32 (gloo does this on a CPU too); every collective
    FSDP sends recorded in `ledger` (parallel.LEDGER)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if dtype == "bfloat16" else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=mode == "full", mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=mode == "full", mp_policy=policy)
    if ledger is not None:
        for unit in [*model.layers, model]:
            unit.set_custom_all_gather(CountedAllGather(ledger))
            unit.set_custom_reduce_scatter(CountedReduceScatter(ledger))
    model.dp_shard, model.dp_place = mode, (dp_mesh.get_local_rank(), dp_mesh.size())
    return model


def _phase():
    """fwd, or bwd where the autograd engine runs it (FSDP's pre-backward all-gather under full)."""
    return "fwd" if torch._C._current_autograd_node() is None else "bwd"


class CountedAllGather:
    """FSDP2's all-gather as its default sends it, recorded in the ledger first (the gathered
    elements). FSDP2 calls a custom collective's `allocate` for its buffers, then the collective."""

    def __init__(self, ledger):
        self.ledger = ledger

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.ledger.record("all_gather", group, output_tensor, _phase())
        return _ALL_GATHER(output_tensor, input_tensor, group=group, async_op=async_op)


class CountedReduceScatter(CountedAllGather):
    """FSDP2's reduce-scatter of the gradients (op: FSDP's, the dp mean), recorded first (the whole
    gradient's elements)."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.ledger.record("reduce_scatter", group, input_tensor, "grad")
        return _REDUCE_SCATTER(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def reshard(model):
    """Free the gathered parameters where a forward without backward (evaluation, sampling) left
    them gathered (`grad` keeps them until a backward): the model's parameters are the shards
    again, as the optimizer and checkpoints hold them."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def whole(t):
    """A dp-sharded parameter or moment gathered to this rank's TP-local tensor (a collective)."""
    return t.full_tensor() if is_sharded(t) else t


def gathered_rows(params, rows):
    """The whole TP-local tensors (Muon's updates) of sharded `params` from each dp rank's
    `rows` (FSDP2 cuts dim 0 as torch.chunk does, ceil(m/dp) rows a rank: padded to that), in
    one all-gather of them all, cut back. Gathered rather than orthogonalised shard-wise: a dp
    shard holds rows of the TP-local tensor, which for an A (r, d/t) cut the short side r (X·Xᵀ
    needs whole rows) and for a stacked qkv cut across pieces; its bytes are one all-gather of
    the matrices, as FSDP2's own before a forward."""
    mesh = params[0].device_mesh
    dp, padded = mesh.size(), []
    for p, r in zip(params, rows):
        pad = r.new_zeros((chunk_rows(p.shape[0], dp), *r.shape[1:]))   # (ceil(m/dp), n)
        pad[:len(r)] = r
        padded.append(pad)
    flat = torch.cat([x.reshape(-1) for x in padded])                         # (L,)
    every = all_gather_last(flat, mesh.get_group(), "optim").view(dp, -1)     # (dp, L)
    out, start = [], 0
    for p, x in zip(params, padded):
        part = every[:, start:start + x.numel()].reshape(dp, *x.shape)        # (dp, rows, n)
        out.append(part.reshape(-1, *x.shape[1:])[:p.shape[0]])               # (m, n)
        start += x.numel()
    return out
