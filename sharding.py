"""sharding.py: how a tensor-parallel model's local parameters derive from the single-device
model's.

BOOST (arXiv 2512.12131) sections 2-4 cut one model three ways (layouts.py). Every local parameter
carries a `Spec`: which full-model parameters it is cut from, along which dim, and how many rows of
each it holds. From the Specs alone a layout's model is cut (`Sharded.shard`), gathered back to the
full model's names and shapes (`gather_full`: the tests and tools compare with it; checkpoints keep
each rank's local tensors, interchange.py's export builds the full names on one process), and its
gradient norm counted once per parameter (`grad_norm_sq`). The gradients of a sharded model as one
model's: the global norm and its clipping (`clip_grad_norm`), the tied embedding's gradient summed
over its uses (`reduce_tied_grad`), the data-parallel mean where DDP is not used.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from model import init_part
from parallel import all_reduce


@dataclass
class Spec:
    """How a local parameter derives from the full model's: the full parameters `sources`, each
    split into t chunks along `dim` (None: replicated), this rank's chunks concatenated on dim 0
    (`rows` of each in the local parameter)."""
    sources: list
    dim: object
    rows: list


def check_divisible(cfg, tp, lay, others, pp=1):
    """A clear ValueError when the TP degree cannot split this model under the layout `lay` (a
    layouts.Layout: which models it cuts, which sizes tp must divide), or the pipeline degree its
    layers; `others`: the layouts that do cut this model, for the message."""
    if cfg.n_layer % pp:
        raise ValueError(f"n_layer={cfg.n_layer} cannot be split into pp={pp} equal stages")
    if lay.lowrank != cfg.lowrank:
        raise ValueError(f"layout={lay.name} cuts {'bottleneck' if lay.lowrank else 'dense'} "
                         f"models; arch={cfg.arch} uses {', '.join(others)}")
    for name in lay.splits:
        if getattr(cfg, name) % tp:
            raise ValueError(f"tp={tp} does not divide {name}={getattr(cfg, name)} "
                             f"(layout={lay.name})")
    if cfg.vocab_size % tp:  # not an option: the tokenizer's vocabulary, padded
        raise ValueError(f"tp={tp} does not divide the vocabulary of {cfg.vocab_size} (the "
                         "tokenizer's, padded to a multiple of 64): use a tp that divides 64")


def cut_local(full, spec, tp):
    """This rank's local tensor of `spec`, cut from a full-model dict {name: tensor}."""
    parts = [full[name] if spec.dim is None else full[name].chunk(tp.size, spec.dim)[tp.tp_rank]
             for name in spec.sources]
    return torch.cat(parts, 0)


class Sharded(nn.Module):
    """A module whose parameters are cut from the full model's state `full` by their Specs."""

    def __init__(self, tp, full):
        super().__init__()
        self.tp, self._full, self.specs = tp, full, {}

    def shard(self, name, sources, dim):
        full_rows = [self._full[source].shape[0] for source in sources]
        spec = Spec(sources, dim, [n // self.tp.size if dim == 0 else n for n in full_rows])
        self.register_parameter(name, nn.Parameter(cut_local(self._full, spec, self.tp).clone()))
        self.specs[name] = spec

    def parts(self):
        """(local parameter, full name, its rows in the local tensor, shard dim or None) for every
        full-model parameter each local one is cut from."""
        params, out = dict(self.named_parameters()), []
        for name, spec in self.named_specs():
            start = 0
            for source, rows in zip(spec.sources, spec.rows):
                out.append((params[name], source, slice(start, start + rows), spec.dim))
                start += rows
        return out

    def named_specs(self):
        """(local parameter name, Spec) for every parameter."""
        for prefix, m in self.named_modules():
            for name, spec in getattr(m, "specs", {}).items():
                yield (f"{prefix}.{name}" if prefix else name), spec

    def full_tensors(self, grads=False):
        """The single-device model's parameters (or gradients), gathered over TP: {name: tensor}."""
        return self.gather_full({n: p.grad if grads else p.detach()
                                 for n, p in self.named_parameters()})

    def gather_full(self, local):
        """{local name: tensor shaped like that parameter} -> {full-model name: full tensor}.
        A collective over the TP group: every TP rank must call it."""
        out = {}
        for name, spec in self.named_specs():
            local_t = local[name]
            if spec.dim is None or self.tp.size == 1:
                shards = [local_t] * self.tp.size
            else:
                shards = [torch.empty_like(local_t) for _ in range(self.tp.size)]
                dist.all_gather(shards, local_t.contiguous(), group=self.tp.group)
            for piece, chunks in zip(spec.sources, zip(*[s.split(spec.rows, 0) for s in shards])):
                out[piece] = chunks[0] if spec.dim is None else torch.cat(chunks, spec.dim)
        return out

    def grad_norm_sq(self):
        """Squared global gradient norm: sharded parameters summed over TP, replicated counted once;
        under --dp_shard every gradient is also a dp shard (FSDP2's): summed over dp too. One
        torch._foreach_norm per kind (one kernel for many tensors, no copy of any gradient), the
        squares of the per-tensor norms summed in fp64."""
        params = dict(self.named_parameters())
        kinds, dp_group = {"sharded": [], "replicated": []}, None
        for name, spec in self.named_specs():
            g = params[name].grad
            if g is None or (name == "tok_emb" and getattr(self, "tied", False)
                             and not getattr(self, "first", True)):
                # (a model's tied embedding on its last stage is its first stage's: counted there)
                continue
            if is_sharded(g):
                dp_group, g = g.device_mesh.get_group(), g.to_local()
            kinds["sharded" if spec.dim is not None else "replicated"].append(g)
        device = local(next(self.parameters())).device
        sharded, replicated = (torch.stack(torch._foreach_norm(gs)).double().pow(2).sum() if gs
                               else torch.zeros((), dtype=torch.float64, device=device)
                               for gs in kinds.values())
        if self.tp.size > 1:
            dist.all_reduce(sharded, group=self.tp.group)
        total = sharded + replicated
        if dp_group is not None:
            dist.all_reduce(total, group=dp_group)
        return total


# ------------------------------------------------------------------ the gradients as one model's

def clip_grad_norm(model, max_norm, pp_group=None):
    """torch.nn.utils.clip_grad_norm_ with the global norm over TP shards and pipeline stages."""
    tp_model = getattr(model, "module", model)   # (a tp_model.TPLlama, under DDP or not)
    norm_sq = tp_model.grad_norm_sq()
    if pp_group is not None:
        dist.all_reduce(norm_sq, group=pp_group)  # the stages hold disjoint parameters
    norm = norm_sq.sqrt().float()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    # (under --dp_shard a DTensor: scale this rank's shard); one _foreach_mul_ per gradient dtype
    by_dtype = {}
    for p in tp_model.parameters():
        if p.grad is not None:
            g = local(p.grad)
            by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, gs in by_dtype.items():
        torch._foreach_mul_(gs, coef.to(dtype))
    return norm


def all_reduce_grads(model, dp_group, bucket_bytes=64 << 20):
    """The data-parallel mean of the gradients, where DDP is not used (under pipelining): flattened
    into buckets of at most bucket_bytes (a gradient larger than that alone), one all-reduce each,
    as DDP's reducer buckets them, not one a parameter."""
    size = dist.get_world_size(dp_group)
    buckets, nbytes = [[]], 0
    for g in (p.grad for p in model.parameters() if p.grad is not None):
        if buckets[-1] and (g.dtype != buckets[-1][0].dtype or
                            nbytes + g.numel() * g.element_size() > bucket_bytes):
            buckets, nbytes = buckets + [[]], 0
        buckets[-1].append(g)
        nbytes += g.numel() * g.element_size()
    for grads in filter(None, buckets):
        flat = all_reduce(torch.cat([g.reshape(-1) for g in grads]), dp_group, "grad")   # (n,)
        for g, part in zip(grads, flat.div_(size).split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def reduce_tied_grad(model, pp_group=None):
    """Tied embeddings: the gradient of the one matrix is the sum of its uses' parts, over the TP
    ranks (each holds the gradient of the slices it used, tp_model.TPLlama.embedding and head: the
    embedding's d/t columns under btp, the head's V/t rows), then over the first and the last
    pipeline stage, which both hold it (middle stages add zeros). Afterwards every holder has the
    single-device gradient, so the copies stay equal step after step. A no-op for untied models."""
    model = getattr(model, "module", model)
    if not getattr(model, "tied", False):
        return
    held = getattr(model, "tok_emb", None)
    if held is not None and held.grad is not None:
        # (under --dp_shard this rank's dp shard of it: the same rows on each TP rank)
        summed = all_reduce(local(held.grad), model.tp.group, "grad")
        if not is_sharded(held.grad):   # (a shard is summed in place)
            held.grad = summed
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return
    cfg = model.cfg
    # (under --dp_shard the same dp shard's rows on both)
    rows = rows_held(model, cfg.vocab_size)
    device = model.rope_cos.device
    buf = local(held.grad) if held is not None else \
        torch.zeros(rows, cfg.n_embd, device=device)
    buf = all_reduce(buf, pp_group, "grad")   # (V, d), or this dp shard of its rows; in place
    if held is not None and not is_sharded(held.grad):
        held.grad = buf


# ---------------------------------------------------- a rank's part built alone (the meta device)

def materialize(model, ref):
    """Fill the layout `model` (cut from `ref` on the meta device, then `to_empty`) with exactly
    what the reference holds when built whole on the CPU: each piece of this rank's parameters
    drawn alone by its full parameter's rule (model.init_part: keyed tiles), only the tiles that
    meet this rank's TP slice, then copied in (under --dp_shard into its dp shard of it). Nothing
    else is drawn: the time and memory are this rank's part's, whatever the model's size."""
    params = dict(ref.named_parameters())   # (a tied head is the embedding: one name)
    t, k = model.tp.size, model.tp.tp_rank
    with torch.no_grad():
        for local, name, rows, dim in model.parts():
            shape = params[name].shape
            region = [(0, shape[0]), (0, math.prod(shape[1:]))]   # (rows, columns) of the full
            if dim is not None:   # this TP rank's slice of that dim
                assert dim < 2 and (dim == 0 or len(shape) == 2), (name, dim)
                n = region[dim][1]
                region[dim] = (k * n // t, (k + 1) * n // t)
            part = init_part(ref.init_rules[name], ref.init_seed, name, shape, *region)
            write_rows(local, rows, part.view(-1, *shape[1:]) if dim != 1 else part)


# ------------------------------------ a rank's dp shard of its part (FSDP2's DTensors, --dp_shard)
# FSDP2 (extensions/dp_shard.py) cuts each TP-local parameter's dim 0 over dp as torch.chunk does;
# what a rank's code reads of such a tensor is its own rows. Without --dp_shard every row.

def is_sharded(t):
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def local(t):
    """This rank's shard of a dp-sharded tensor (a plain tensor as it is)."""
    return t.to_local() if is_sharded(t) else t


def chunk_rows(n, dp):
    """The rows a dp shard of n rows holds at most: ceil(n/dp), so the last ranks may hold fewer,
    or none."""
    return -(-n // dp)


def shard_bounds(n, dp_rank, dp):
    """(lo, hi): the rows of n that dp shard dp_rank of dp holds (chunk_rows a shard)."""
    size = chunk_rows(n, dp)
    lo = min(n, dp_rank * size)
    return lo, min(n, lo + size)


def rows_held(model, rows):
    """How many of a tensor's `rows` rows this rank's dp shard holds."""
    if getattr(model, "dp_shard", "none") == "none":
        return rows
    lo, hi = shard_bounds(rows, *model.dp_place)
    return hi - lo


def held(t, rows):
    """(view, part): the rows `rows` (a slice) of the TP-local tensor t that this rank holds, as a
    view of what it holds, and which of `rows` they are (a slice from 0); None where this rank's
    dp shard holds none of them."""
    if not is_sharded(t):
        return t.data[rows], slice(0, rows.stop - rows.start)
    mesh = t.device_mesh
    lo, hi = shard_bounds(t.shape[0], mesh.get_local_rank(), mesh.size())
    a, b = max(rows.start, lo), min(rows.stop, hi)
    if a >= b:
        return None
    return t.to_local()[a - lo:b - lo], slice(a - rows.start, b - rows.start)


def write_rows(param, rows, values):
    """values into rows `rows` (a slice) of the TP-local parameter; under --dp_shard only the
    rows this rank's shard holds."""
    got = held(param, rows)
    if got is not None:
        got[0].copy_(values[got[1]])
