"""dp_shard.py: sharded data parallelism, PyTorch's FSDP2 on the data-parallel dimension of the mesh.

Not in the BOOST paper (arXiv 2512.12131), which leaves ZeRO and FSDP out of scope as orthogonal
(§6 composes BTP with plain data parallelism). `--dp_shard=` chooses what the dp ranks keep:

  none  DDP: every dp rank holds the whole (TP-local) model, gradients all-reduced (train.py).
  grad  ZeRO-2 style: `fully_shard(..., reshard_after_forward=False)`: parameters, gradients and
        AdamW moments sharded over dp between steps; a layer's parameters all-gathered before its
        forward and kept until its backward; gradients reduce-scattered.
  full  ZeRO-3 style (`reshard_after_forward=True`): the same, but a layer's parameters are freed
        after its forward and all-gathered again for its backward.

Each decoder layer is one FSDP unit and the root (embedding, final norm, head) another; the units
hold each layout's TP-local parameters (layouts.TPLlama: under BTP the (r, d/t) and (d/t, r)
slices), so FSDP shards over dp what TP already cut. FSDP2 issues its collectives itself; `record`
counts them in the ledger from the units' sizes.
"""
import torch
import torch.distributed as dist

MODES = ("none", "grad", "full")


def apply(model, dp_mesh, mode, device, dtype):
    """fully_shard each decoder layer, then the root, over the dp mesh; mixed precision through
    FSDP's MixedPrecisionPolicy on CUDA in bf16 (bf16 parameters for compute, fp32 reductions)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.startswith("cuda") and dtype == "bfloat16" else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=mode == "full", mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=mode == "full", mp_policy=policy)
    model.dp_shard = mode
    return model


def is_sharded(t):
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def local(t):
    """This rank's shard of a dp-sharded tensor (a plain tensor as it is)."""
    return t.to_local() if is_sharded(t) else t


def whole(t):
    """A dp-sharded parameter or moment gathered to this rank's TP-local tensor (a collective)."""
    return t.full_tensor() if is_sharded(t) else t


def put_back(t, gathered, dp_rank, dp):
    """Copy this rank's dp shard of `gathered` (the TP-local tensor) into the sharded `t` (FSDP2
    shards dim 0 as torch.chunk does)."""
    mine, parts = local(t), torch.chunk(gathered, dp, dim=0)
    part = parts[dp_rank] if dp_rank < len(parts) else gathered[:0]   # (fewer rows than ranks: some hold none)
    mine.copy_(part.reshape(mine.shape))


def units(model):
    """The FSDP units, the root last: [(module, its own parameters' elements, their dtype)]."""
    out = []
    for m in [*model.layers, model]:
        own = [p for n, p in m.named_parameters() if m is not model or not n.startswith("layers.")]
        out.append((m, sum(p.numel() for p in own), own[0].dtype if own else torch.float32))
    return out


def record(model, ledger, dp_group, micro_steps):
    """The ledger's count of what FSDP2 sent in one step of `micro_steps` micro-batches: per micro-
    batch each unit's parameters all-gathered before its forward (and again before its backward
    under `full`), and at the last one its gradients reduce-scattered (the input's elements)."""
    mode = getattr(model, "dp_shard", "none")
    if mode == "none" or dist.get_world_size(dp_group) == 1:
        return
    for _, n, dtype in units(model):
        shape = torch.empty(n, dtype=dtype, device="meta")
        for _ in range(micro_steps):
            ledger.record("all_gather", dp_group, shape, "fwd")
            if mode == "full":
                ledger.record("all_gather", dp_group, shape, "bwd")
        ledger.record("reduce_scatter", dp_group, shape, "grad")
