"""train_state.py: sharded training-state checkpoints, verified by content; what a resume continues.

Not in the BOOST paper (arXiv 2512.12131): what a run of days needs around its §6 3D layouts.
Saved through torch.distributed.checkpoint (DCP): every rank writes its own shards, nothing is
gathered. Each tensor is stored under its single-device name (`model.layers.0.attn.q.A.weight`,
`optim.exp_avg.<same>`) as a DTensor sharded like the layout holds it, so DCP can load it into any
other layout (tp=2 -> 1, 4, dp×tp 2×2, pp=2 -> 1) or into one process.

A checkpoint is a folder <out_dir>/checkpoints/iter_NNNNNNN/ holding the DCP files and meta.json:
the iteration, the model config, the tokenizer, the run's id, and every file's size and CRC-32
(the ranks checksum the files between them). It is written as iter_N.tmp and renamed when complete,
so a reader sees the old set of checkpoints or the new one. On resume the newest checkpoint whose
files all match their sizes and checksums, whose meta.json is as written (integrity.py) and which
loads is used; each one that fails is skipped with a line naming the file, and removed at the next
save. Pruning removes only older checkpoints of the same run (its id is kept across resumes), never
another run's and never a newer one. The data position is the iteration: batches are drawn from
(seed, step).
A resume continues the run with the model, data and schedule options the checkpoint it resumes
recorded, unless the launch gives them again (an older checkpoint taken in place of a damaged one
must give the same options). Exporting a checkpoint and importing one are interchange.py's commands.
"""
import glob
import json
import os
import shutil
import warnings

import torch
import torch.distributed as dist

from extensions import dp_shard
import model as llama
from plumbing import integrity
from plumbing.tokenizer import identity as tokenizer_identity

MOMENTS = ("exp_avg", "exp_avg_sq")


def state_kinds(optimizer):
    """p -> the names of its optimizer state: AdamW's moments, or Muon's momentum buffer (muon.py's
    groups marked "muon")."""
    muon = {id(p) for g in getattr(optimizer, "param_groups", ()) if g.get("muon")
            for p in g["params"]}
    return lambda p: ("momentum_buffer",) if id(p) in muon else MOMENTS


def state_views(raw_model, optimizer, mesh):
    """{key: tensor} of views into this rank's parameters and optimizer state (AdamW's moments,
    Muon's momentum buffers), under single-device names; DTensors on the (dp, tp) mesh when
    distributed. DCP saves from them and loads into them.
    Under --dp_shard (dp_shard.py) each is this rank's dp shard of its piece as it is held, a
    `Block` of the full tensor: nothing is gathered."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    kinds = state_kinds(optimizer)
    # the optimizers make their state lazily: make it now, to load into (none: the model alone)
    for p in raw_model.parameters() if optimizer is not None else ():
        if not optimizer.state[p]:
            # (on the parameter's device, where the fused AdamW keeps it)
            optimizer.state[p].update(step=torch.zeros((), device=p.device),
                                      **{k: torch.zeros_like(p) for k in kinds(p)})
    views = {}
    for p, name, rows, dim in raw_model.parts():
        moments = [(k, optimizer.state[p][k]) for k in kinds(p)] if optimizer is not None else []
        for kind, tensor in [("model", p.data)] + moments:
            key = "model." + name if kind == "model" else f"optim.{kind}.{name}"
            if dp_shard.is_sharded(tensor):
                block = dp_block(tensor, rows, dim, raw_model.tp)
                if block is not None:   # (a shard may hold no row of this piece)
                    views[key] = block
                continue
            view = tensor[rows]
            if mesh is not None:
                view = DTensor.from_local(view, mesh,
                                          [Replicate(), Replicate() if dim is None else Shard(dim)])
            views[key] = view
    if optimizer is not None:
        views["optim.step"] = optimizer.state[next(raw_model.parameters())]["step"]
    return views


class Block(torch.Tensor):
    """A rectangular block of a full (single-device) tensor that this rank holds, as DCP saves
    and loads it: the local values (shared, so a load writes into them), the full tensor's size and
    the block's offsets in it. Any block, so a dp shard of a TP shard is saved as it is held."""

    __torch_function__ = torch._C._disabled_torch_function_impl   # (ops give plain tensors)

    @staticmethod
    def __new__(cls, local, size, offsets):
        block = torch.Tensor._make_subclass(cls, local)
        block.full_size, block.offsets = torch.Size(size), torch.Size(offsets)
        return block

    def size(self, dim=None):   # DCP compares the saved size with this one: the full tensor's
        return self.full_size if dim is None else self.full_size[dim]

    def _chunk(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return ChunkStorageMetadata(offsets=self.offsets, sizes=torch.Tensor.size(self))

    def __create_chunk_list__(self):
        return [self._chunk()]

    def __create_write_items__(self, fqn, obj):
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import (TensorWriteData, WriteItem,
                                                          WriteItemType)
        local = self.as_subclass(torch.Tensor)
        return [WriteItem(index=MetadataIndex(fqn, self.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=self._chunk(), size=self.full_size,
                              properties=TensorProperties.create_from_tensor(local)))]

    def __get_tensor_shard__(self, index):
        return self.as_subclass(torch.Tensor)


def dp_block(tensor, rows, dim, tp):
    """This rank's dp shard of a piece (rows `rows` of a TP-local tensor FSDP2 shards over dp) as
    a Block of the full tensor, or None where the shard holds none of its rows."""
    got = dp_shard.held(tensor, rows)
    if got is None:
        return None
    local, part = got
    shape = [rows.stop - rows.start, *tensor.shape[1:]]           # the piece, TP-local
    offsets = [part.start] + [0] * (len(shape) - 1)
    if dim is not None:   # the piece is this TP rank's chunk of the full tensor along dim
        offsets[dim] += tp.tp_rank * shape[dim]
        shape[dim] *= tp.size
    return Block(local, shape, offsets)


# ------------------------------------------------------------------------ files and their checksums

def checkpoint_dirs(out_dir):
    """Complete checkpoints (published folders with meta.json), oldest first."""
    return sorted(d for d in glob.glob(os.path.join(out_dir, "checkpoints", "iter_*"))
                  if not d.endswith(".tmp") and os.path.exists(os.path.join(d, "meta.json")))


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def save(out_dir, iter_num, raw_model, optimizer, mesh, meta, keep=2, before_publish=None,
         discard=()):
    """Every rank writes its shards into iter_N.tmp and checksums its share of the files; rank 0
    records meta.json, renames, and prunes this run's older checkpoints and the corrupt ones resume
    skipped (`discard`). Returns (folder, bytes)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException   # a BaseException
    final = os.path.join(out_dir, "checkpoints", f"iter_{iter_num:07d}")
    tmp = final + ".tmp"
    master = not dist.is_initialized() or dist.get_rank() == 0
    if master:
        shutil.rmtree(tmp, ignore_errors=True)  # our own interrupted save of this iteration
        os.makedirs(tmp)
    _barrier()
    try:
        # DCP warns that one process means no process group: we know
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state_views(raw_model, optimizer, mesh), checkpoint_id=tmp,
                     no_dist=mesh is None)
    # a full disk, most often (every rank fails together)
    except (Exception, CheckpointException) as e:
        if master:
            shutil.rmtree(tmp, ignore_errors=True)   # the half-written one would only fill the disk
        raise ValueError(f"cannot write checkpoint {final} ({_reason(e)}); the previous "
                         "checkpoints are untouched") from None
    _barrier()
    files = integrity.map_over_ranks(sorted(os.listdir(tmp)),
                                     lambda f: {"bytes": os.path.getsize(os.path.join(tmp, f)),
                                                "crc32": integrity.crc32(os.path.join(tmp, f))})
    if before_publish:
        before_publish()  # the fault-injection hook of the tests: die before the rename
    failed = publish(tmp, final, {**meta, "iter_num": iter_num, "files": files}) if master else None
    if dist.is_initialized():   # (every rank learns rank 0's outcome: one line on each, no hang)
        said = [failed]
        dist.broadcast_object_list(said, src=0)
        failed = said[0]
    if failed:
        raise ValueError(f"cannot write checkpoint {final} ({failed}); the previous checkpoints "
                         "are untouched")
    if master:
        prune(out_dir, meta.get("run_id"), iter_num, keep, discard)
    return final, sum(f["bytes"] for f in files.values())


def publish(tmp, final, record):
    """meta.json into tmp, then tmp renamed to final; what the system said where it failed (a full
    disk: the shards fit, meta.json did not), with tmp removed, else None."""
    try:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({**record, "meta_crc32": integrity.meta_crc32(record)}, f, indent=1)
        # this run's own checkpoint of this iteration, if it rolled back
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)  # atomic: a reader sees the old set of checkpoints or the new one
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)   # (it would only fill the disk)
        return e.strerror or str(e)
    return None


def _reason(e):
    """What made a save fail, in a few words: the OSError inside DCP's CheckpointException."""
    for _ in range(8):   # CheckpointException.failures: {rank: (exception, traceback)}
        if e is None or isinstance(e, OSError):
            break
        failures = getattr(e, "failures", None)
        e = next(iter(failures.values()))[0] if failures else (e.__cause__ or e.__context__)
    if isinstance(e, OSError):
        return e.strerror or str(e)
    return "an error of torch.distributed.checkpoint"


def prune(out_dir, run_id, iter_num, keep, discard=()):
    """Remove the checkpoints of run `run_id` older than iteration `iter_num`, but the newest keep-1
    good ones; and the corrupt checkpoints resume skipped (`discard`), which hold nothing to
    resume."""
    own = []
    for d in discard:
        if os.path.basename(d) != f"iter_{iter_num:07d}":  # (not the one just written in its place)
            shutil.rmtree(d, ignore_errors=True)
    for d in checkpoint_dirs(out_dir):
        try:
            with open(os.path.join(d, "meta.json")) as f:
                meta = json.load(f)
        except (OSError, json.JSONDecodeError):
            continue  # not ours to judge: leave it
        ours = run_id is not None and meta.get("run_id") == run_id
        if ours and meta.get("iter_num", iter_num) < iter_num:
            own.append(d)
    for old in own[:max(0, len(own) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------ resuming

def candidates(out_dir, init_from):
    """The complete checkpoints to try, newest first ([] to start from scratch)."""
    if init_from == "scratch":
        return []
    found = checkpoint_dirs(out_dir)[::-1]
    if not found and init_from == "resume":
        raise ValueError(f"--init_from=resume but there is no complete checkpoint in "
                         f"{out_dir}/checkpoints")
    return found


class Resume:
    """What a launch resumes from: the checkpoints to try, newest first (`found`), the meta.json of
    the first (the launch's options come from its record and nothing else: .cfg and .tc, set by
    options.resume_plan), and those already skipped as damaged (removed at the next save)."""

    def __init__(self, found, meta, skipped):
        self.found, self.meta, self.skipped = found, meta, skipped
        self.cfg = self.tc = None


def recorded(meta):
    """The options a checkpoint's meta.json records: its model config and training options."""
    return {**meta["config"], **meta.get("train_config", {})}


def intact(found, log):
    """Resume from the newest checkpoint of `found` whose meta.json is as written and whose files
    are all there at their recorded sizes (the checks that need no process group; each other one
    is skipped with one line); ValueError if there is none. The checksums are verified in choose."""
    problems, skipped = [], []
    for i, path in enumerate(found):
        try:
            meta = read_meta(path)
            problem = integrity.sizes(path, meta)
        except integrity.Damaged as e:
            problem = str(e)
        except (OSError, KeyError, TypeError, ValueError) as e:
            problem = f"meta.json is unreadable ({type(e).__name__})"
        if problem is None:
            return Resume(found[i:], meta, skipped)
        log(f"skipping checkpoint {path}: {problem}")
        problems.append(f"{os.path.basename(path)}: {problem}")
        skipped.append(path)
    raise ValueError(f"no usable checkpoint in {os.path.dirname(found[0])} ({'; '.join(problems)})")


def verified(path):
    """(model.Config, meta.json) of a checkpoint read on its own (export, eval), its checksums
    verified as resume verifies them; ValueError with one line naming what is wrong."""
    try:
        meta = read_meta(path)   # as resume reads it, with no run to compare it with
        cfg = llama.Config(**meta["config"])
        problem = integrity.verify(path, meta)
    except integrity.Damaged as e:
        raise ValueError(f"checkpoint {path}: {e}") from None
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"checkpoint {path}: meta.json is unreadable "
                         f"({type(e).__name__})") from None
    if problem:
        raise ValueError(f"checkpoint {path}: {problem}")
    return cfg, meta


def read_meta(path, config=(), tokenizer=None):
    """meta.json of a checkpoint, as written (integrity.Damaged otherwise); ValueError naming the
    field where the model's shape differs from `config` (a run's Config.shape(); none to compare:
    export)."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    integrity.check_meta(path, meta)
    # derived sizes filled in, as this run's are
    meta["config"] = llama.Config(**meta["config"]).shape()
    same_file = tokenizer == meta.get("tokenizer")
    if same_file:   # (gone or changed is said before the vocabulary's size)
        check_tokenizer(path, meta, tokenizer)
    for key, value in dict(config).items():
        if meta["config"].get(key) != value:
            if key == "vocab_size":
                raise ValueError(f"checkpoint {path} was written with "
                                 f"--tokenizer={meta.get('tokenizer')} "
                                 f"(vocabulary {meta['config'].get(key)}), this run has "
                                 f"--tokenizer={tokenizer} "
                                 f"(vocabulary {value}): pass the same tokenizer")
            raise ValueError(f"checkpoint {path} was written with {key}={meta['config'].get(key)}, "
                             f"this run has {key}={value}: pass the same model options")
    if not same_file:
        check_tokenizer(path, meta, tokenizer)
    return meta


def check_tokenizer(path, meta, tokenizer, passable=True):
    """ValueError unless `tokenizer` (None: nothing to compare) is the checkpoint's, the same file
    unchanged; `passable`: the command has a --tokenizer to name a copy with (eval has none)."""
    if tokenizer is None:
        return
    # (checkpoints of bytes and gpt2 named them only)
    theirs = meta.get("tokenizer_id", meta.get("tokenizer"))
    same_file = tokenizer == meta.get("tokenizer") and tokenizer not in ("bytes", "gpt2")
    if same_file and not os.path.exists(tokenizer):
        raise ValueError(f"the tokenizer {tokenizer} that checkpoint {path} was written with is "
                         "gone (deleted or moved): put it back" + (", or pass --tokenizer= a "
                         "copy of it" if passable else " at that path (or a copy of it there)"))
    mine = tokenizer_identity(tokenizer)
    if theirs != mine and tokenizer == meta.get("tokenizer"):
        raise ValueError(f"the tokenizer file {tokenizer} changed since checkpoint {path} was "
                         f"written with it (it was {theirs}, it is {mine} now): put back the file "
                         "the run was trained with")
    if theirs != mine:
        raise ValueError(f"checkpoint {path} was written with the tokenizer {theirs} "
                         f"({meta.get('tokenizer')}), this "
                         f"run's --tokenizer={tokenizer} is {mine}: pass the same tokenizer")


def choose(resume, config, tokenizer, load, same, log=print):
    """(folder, meta, the bad ones skipped) of the newest checkpoint of resume.found that is whole,
    matches the model, records the options the launch took (same(meta): None or what differs) and
    loads (load(folder, meta): None or what failed), each bad one skipped with one line, so a
    checkpoint that cannot be read costs the steps since the previous one; ValueError if none is
    good or the model's shape differs. Collective under torchrun (the checksums, the load)."""
    problems, skipped = [], list(resume.skipped)
    for i, path in enumerate(resume.found):
        try:
            meta = read_meta(path, config, tokenizer)
            problem = integrity.verify(path, meta) or (same(meta) if i else None) or \
                load(path, meta)
        except integrity.Damaged as e:
            problem = str(e)
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            problem = f"meta.json is unreadable ({type(e).__name__})"
        if problem is None:
            return path, meta, skipped
        log(f"skipping checkpoint {path}: {problem}")
        problems.append(f"{os.path.basename(path)}: {problem}")
        skipped.append(path)
    raise ValueError(f"no usable checkpoint in {os.path.dirname(resume.found[0])} "
                     f"({'; '.join(problems)})")


def load(path, meta, raw_model, optimizer, mesh):
    """Load a checkpoint into this rank's parameters and moments (optimizer None: the parameters
    alone), whatever layout wrote it: None, or the one line that says why it could not be read
    (the same on every rank)."""
    views = state_views(raw_model, optimizer, mesh)
    error = integrity.dcp_load(views, path, meta["files"], no_dist=mesh is None)   # (no code runs)
    if dist.is_initialized():  # all ranks fail together, none is left waiting in a collective
        box = [None] * dist.get_world_size()
        dist.all_gather_object(box, error)
        error = next((e for e in box if e), None)
    if error or optimizer is None:
        return error
    step = views["optim.step"]
    for p in raw_model.parameters():
        optimizer.state[p]["step"] = step.detach().clone().to(p.device)
    return None

