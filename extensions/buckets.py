"""buckets.py: Muon's collectives (extensions/muon.py), several matrices in one call each.

Beyond the BOOST paper (arXiv 2512.12131 §6 trains with AdamW). An optimizer that needs whole
matrices from TP-cut pieces either gathers every piece on every rank (`gathered_all`: one
all-gather of all of them, flattened into one buffer), or makes each matrix whole on one owner
rank (`owners`), which computes and sends each rank its slice back (`owner_computes`: two
all-to-alls). Both record in parallel.py's ledger, with the phase "optim".
"""
import torch
import torch.distributed as dist
from torch.profiler import record_function

import parallel
from parallel import LEDGER, all_gather_last, group_rank, group_size

def gathered_all(blocks, dims, group):
    """The whole matrices of several pieces, each cut along its dim in `dims` over `group`, from
    this rank's `blocks`, in one all-gather: the blocks (oriented so the cut runs along the last
    dim) flattened into one buffer, gathered, and cut back per piece and rank."""
    oriented = [x.t() if dim == 0 else x for x, dim in zip(blocks, dims)]   # (a, b/t) each
    flat = torch.cat([y.reshape(-1) for y in oriented])                       # (L,)
    t = group_size(group)
    every = all_gather_last(flat, group, "optim").view(t, -1)                 # (t, L)
    out, start = [], 0
    for y, dim in zip(oriented, dims):
        part = every[:, start:start + y.numel()].reshape(t, *y.shape)         # (t, a, b/t)
        whole = torch.cat(list(part), dim=-1)                                 # (a, b)
        out.append(whole.t() if dim == 0 else whole)
        start += y.numel()
    return out


def all_to_all(x, sizes_out, sizes_in, group, phase):
    """x cut in order into sizes_out[k] elements for rank k of the group; returns, in rank order,
    what each rank cut for this one (sizes_in), concatenated (no autograd). The ledger counts
    what this rank sends."""
    LEDGER.record("all_to_all", group, x, phase)
    out = x.new_empty(sum(sizes_in))
    if parallel.NO_COMM:
        return out.zero_()
    name = LEDGER.names.get(id(group), "?")
    with record_function(f"all_to_all {name} {phase} {x.numel()}"):
        dist.all_to_all_single(out, x.contiguous(), sizes_in, sizes_out, group=group)
    return out


def owners(sizes, t):
    """Each matrix's owner of t ranks: the largest first, each to the least loaded (ties: the
    lowest rank), so every rank computes about 1/t of the work, the same on every rank."""
    load, out = [0] * t, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        out[i] = min(range(t), key=lambda k: (load[k], k))
        load[out[i]] += sizes[i]
    return out


def owner_computes(blocks, dims, group, fn, phase="optim"):
    """This rank's slices of fn(whole matrices) for several pieces, each cut along its dim in
    `dims` over `group`, each whole only on its owner (`owners`): one all-to-all sends every
    rank's block of a matrix to its owner, the owner applies fn to its matrices (a list: same
    shapes may be batched), a second all-to-all returns each rank its slice. Against gathering
    every matrix on every rank: 2/t of the bytes, and 1/t of the work on each."""
    t, me = group_size(group), group_rank(group)
    ys = [x.t() if dim == 0 else x for x, dim in zip(blocks, dims)]      # (a, b/t): cut last
    owner = owners([y.numel() for y in ys], t)
    held = [[i for i in range(len(ys)) if owner[i] == k] for k in range(t)]
    sizes = [sum(ys[i].numel() for i in idx) for idx in held]          # what each owner gets
    got = all_to_all(torch.cat([ys[i].reshape(-1) for idx in held for i in idx]), sizes,
                     [sizes[me]] * t, group, phase)                    # (t · sizes[me],)
    done = []
    if held[me]:   # (a rank may own none)
        parts = [p.split([ys[i].numel() for i in held[me]]) for p in got.split(sizes[me])]
        done = fn([torch.cat([parts[k][j].view_as(ys[i]) for k in range(t)], -1)
                   for j, i in enumerate(held[me])])                   # [(a, b)] whole
    back = torch.cat([y.chunk(t, -1)[k].reshape(-1) for k in range(t) for y in done]).to(
        ys[0].dtype) if done else ys[0].new_empty(0)                  # (every rank's slices)
    mine = all_to_all(back, [sizes[me]] * t, sizes, group, phase).split(
        [ys[i].numel() for idx in held for i in idx])
    out = [None] * len(ys)
    for i, y in zip([i for idx in held for i in idx], mine):
        out[i] = y.view(ys[i].shape).t() if dims[i] == 0 else y.view(ys[i].shape)
    return out
