"""integrity.py: a checkpoint's files are what was written, and nothing in a file from elsewhere
runs.

Not in the BOOST paper (arXiv 2512.12131); what makes resuming, exporting or importing a folder
safe.

Checksums. meta.json records the size and CRC-32 of every file of a checkpoint (the ranks checksum
the files between them) and a CRC-32 of its own other fields; `verify` checks them before a
checkpoint is resumed or exported, so a flipped byte, a truncated shard or an edited meta.json is
named in one line and never trained on.

Data, never code. Python's pickle runs whatever a crafted file asks for, and two readers in this
project's path use it:

- torch.distributed.checkpoint reads a checkpoint's `.metadata` with plain pickle. `Reader` is
  DCP's FileSystemReader with that one read done by `MetadataUnpickler`: pickle's pure-Python
  reader, whose names give only checking functions or empty DCP dataclasses (never the class or
  function named: pickle's BUILD sets attributes on whatever object it is handed), whose BUILD sets
  only such an instance's own fields; every other name and opcode is refused with one line. Then
  `check_metadata` requires every item to read a stretch of a file of its own folder that
  meta.json lists and checksums, so a crafted folder cannot point a read at another run's files.
- DCP's default planner turns an item stored as bytes back into whatever object its pickle names.
  This project's training state is tensors only, so `Planner` refuses any bytes item outright.

The tensors themselves DCP reads with torch.load(weights_only=True); model folders are read from
safetensors files, their header checked first, or, for a pytorch_model.bin, with weights_only=True
(weights.py). So a
checkpoint folder may hold `.metadata`, `*.distcp` shards and `meta.json`; an import folder
`config.json` and `model.safetensors` (or `pytorch_model.bin`); nothing in them is ever executed.
"""
import collections
import dataclasses
import io
import json
import logging
import math
import os
import pickle
import warnings
import zlib

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
    TensorProperties, TensorStorageMetadata)

from plumbing import pickle_scan
# noqa: F401  (the checksum of every file: checkpoints here, token files in prepare.py)
from plumbing.data import crc32

# ------------------------------------------------------------------------ .metadata, read as data

def _path(*parts):
    """pathlib.PosixPath(*parts) as a plain string (DCP records the folder it saved to)."""
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("a path in .metadata is not made of strings")
    return os.path.join(*parts) if parts else ""


def _size(dims=()):
    """torch.Size(dims), of integers only."""
    if not isinstance(dims, (tuple, list)) or not all(type(d) is int and d >= 0 for d in dims):
        raise pickle.UnpicklingError("a size in .metadata is not a tuple of integers")
    return torch.Size(dims)


def _layout(name):
    """torch.serialization._get_layout without its cache: a layout by its name."""
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if type(name) is not str or name not in layouts:
        raise pickle.UnpicklingError(f"a {type(name).__name__} is not a torch layout name")
    return layouts[name]


def _ordered(*items):
    """collections.OrderedDict(*items), of (str key, value) pairs only (checked before hashing)."""
    pairs = list(items[0]) if len(items) == 1 else []
    if len(items) > 1 or not all(type(p) in (tuple, list) and len(p) == 2 for p in pairs):
        raise pickle.UnpicklingError("an OrderedDict in .metadata is not made of pairs")
    pickle_scan.check_keys(k for k, _ in pairs)
    return collections.OrderedDict(pairs)


# (module, name) -> what a reference to it in .metadata gives: plain functions that check their
# arguments, never the named class or function itself (pickle's BUILD sets attributes on whatever
# object it is handed, a class or function included: nothing of the process is handed out)
DCP = "torch.distributed.checkpoint."
FUNCTIONS = {("pathlib", "PosixPath"): _path, ("torch", "Size"): _size,
             ("torch.serialization", "_get_layout"): _layout,
             ("collections", "OrderedDict"): _ordered,
             (DCP + "metadata", "_MEM_FORMAT_ENCODING"): _MEM_FORMAT_ENCODING}
# the dataclasses DCP's metadata is made of: made empty (NEWOBJ), then given their fields (BUILD)
DATACLASSES = {(DCP + "metadata", c.__name__): c for c in (
    Metadata, StorageMeta, MetadataIndex, ChunkStorageMetadata, TensorProperties,
    TensorStorageMetadata)} | {(DCP + "filesystem", "_StorageInfo"): _StorageInfo}
ALLOWED = set(FUNCTIONS) | set(DATACLASSES)


class MetadataUnpickler(pickle._Unpickler):
    """Reads a DCP .metadata as data: the pure-Python Unpickler with four opcodes restricted.
    A name is looked up only in FUNCTIONS, DATACLASSES and torch's dtypes; REDUCE calls only
    FUNCTIONS; NEWOBJ makes only an empty DATACLASSES instance; BUILD sets only such an
    instance's own dataclass fields (TensorProperties: its 5-tuple of checked types)."""
    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module, name):
        found = FUNCTIONS.get((module, name)) or DATACLASSES.get((module, name))
        dtype = getattr(torch, name, None) if module == "torch" else None
        if found is None and isinstance(dtype, torch.dtype):
            found = dtype
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")
        return found

    def load_reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        if func not in FUNCTIONS.values() or not isinstance(args, tuple):
            raise pickle.UnpicklingError(f".metadata calls a {type(func).__name__}, which a "
                                         "checkpoint never does")
        try:
            self.stack[-1] = func(*args)
        except (TypeError, ValueError) as e:
            raise pickle.UnpicklingError(f".metadata holds a bad value ({e})") from None

    def load_newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        if cls not in DATACLASSES.values() or args != ():
            raise pickle.UnpicklingError(f".metadata makes a {type(cls).__name__}: a checkpoint "
                                         "never does")
        self.append(object.__new__(cls))

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        if type(inst) not in DATACLASSES.values():
            raise pickle.UnpicklingError(f".metadata sets attributes of a {type(inst).__name__}, "
                                         "which a checkpoint never does")
        if type(inst) is TensorProperties:
            return _properties(inst, state)
        names = {f.name for f in dataclasses.fields(inst)}
        if not isinstance(state, dict) or not set(state) <= names:
            raise pickle.UnpicklingError(f".metadata gives a {type(inst).__name__} fields it has "
                                         "not")
        for f in dataclasses.fields(inst):   # the defaults first: a field left out still exists
            if f.default is not dataclasses.MISSING:
                inst.__dict__[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                inst.__dict__[f.name] = f.default_factory()
        inst.__dict__.update(state)   # (MetadataIndex is frozen: its __dict__, as pickle does)

    def load_setitem(self):   # (the keys checked before the dict hashes them)
        pickle_scan.check_keys(self.stack[-2:-1])
        super().load_setitem()

    def load_setitems(self):
        items = self.pop_mark()
        pickle_scan.check_keys(items[::2])
        target = self.stack[-1]
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def refuse(self):
        raise pickle.UnpicklingError(".metadata uses a pickle opcode a checkpoint never does")

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    for _op in (pickle.NEWOBJ_EX, pickle.INST, pickle.OBJ, pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = refuse


def _properties(inst, state):
    """TensorProperties.__setstate__ on a state whose types are checked first."""
    kinds = (torch.dtype, torch.layout, bool, _MEM_FORMAT_ENCODING, bool)
    if not (isinstance(state, tuple) and len(state) == 5 and all(map(isinstance, state, kinds))):
        raise pickle.UnpicklingError(".metadata gives a TensorProperties a state it never has")
    inst.__setstate__(state)


def check_metadata(metadata, files):
    """UnpicklingError unless `metadata` is DCP's Metadata of tensors whose every item reads a
    stretch of one of `files` (the folder's plain files, as meta.json lists them), untransformed."""
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}, not DCP's "
                                     "Metadata")
    items = metadata.state_dict_metadata
    if not isinstance(items, dict) or not all(
            isinstance(k, str) and type(v) is TensorStorageMetadata for k, v in items.items()):
        raise pickle.UnpicklingError(".metadata describes something other than tensors")
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not storage:
        raise pickle.UnpicklingError(".metadata names no storage")
    for index, info in storage.items():
        ok = type(index) is MetadataIndex and type(info) is _StorageInfo
        name = info.relative_path if ok else None
        if not ok or not isinstance(name, str) or name not in files or "/" in name:
            # (named by its type unless a short string: formatting a crafted value, a tuple
            # doubled forty times through the memo, would take hours)
            shown = repr(name[:80]) if isinstance(name, str) else f"a {type(name).__name__}"
            raise pickle.UnpicklingError(f".metadata reads {shown}, not a file meta.json lists in "
                                         "its own folder")
        start, length = info.offset, info.length   # (checked below)
        if type(start) is not int or type(length) is not int or min(start, length) < 0 \
                or start + length > files[name] or info.transform_descriptors:
            raise pickle.UnpicklingError(f".metadata reads past the end of {name}, or through a "
                                         "transform")
    for fqn, item in items.items():
        if not tiles(item):
            raise pickle.UnpicklingError(f".metadata's chunks of {fqn[:200]} do not cover it "
                                         "exactly (each inside it, none overlapping)")


def tiles(item):
    """True if the chunks of a TensorStorageMetadata cover its tensor exactly: each inside it,
    none overlapping another, their volumes summing to the tensor's (a crafted .metadata that
    covers part of a tensor would leave the rest at its initial values)."""
    size, chunks = item.size, item.chunks
    if type(size) is not torch.Size or type(chunks) is not list:
        return False
    for c in chunks:
        if type(c) is not ChunkStorageMetadata or type(c.offsets) is not torch.Size or \
                type(c.sizes) is not torch.Size or not len(c.offsets) == len(c.sizes) == len(size):
            return False
        if any(o < 0 or o + n > d for o, n, d in zip(c.offsets, c.sizes, size)):
            return False
    if sum(math.prod(c.sizes) for c in chunks) != math.prod(size):
        return False
    return not any(all(max(ao, bo) < min(ao + an, bo + bn) for ao, an, bo, bn in
                       zip(a.offsets, a.sizes, b.offsets, b.sizes))
                   for i, a in enumerate(chunks) for b in chunks[i + 1:])


class Reader(FileSystemReader):
    """DCP's FileSystemReader, whose .metadata goes through MetadataUnpickler and check_metadata:
    `files` is {name: bytes} of the files meta.json lists (and checksums)."""

    def __init__(self, path, files):
        super().__init__(path)
        self.files, self.refused = files, None   # refused: what read_metadata refused, in words

    def read_metadata(self, *args, **kwargs):
        try:
            with open(os.path.join(self.path, ".metadata"), "rb") as f:
                data = f.read(pickle_scan.MAX_BYTES + 1)
            pickle_scan.scan(data)   # (no opcode, size or nesting a checkpoint never has)
            metadata = MetadataUnpickler(io.BytesIO(data)).load()
            check_metadata(metadata, self.files)
        except pickle.UnpicklingError as e:
            self.refused = str(e)
            raise
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class Planner(DefaultLoadPlanner):
    """DCP's default load planner, except that an item stored as pickled bytes is refused."""

    def load_bytes(self, read_item, value):
        raise pickle.UnpicklingError(f"{read_item.dest_index.fqn} is stored as pickled bytes, "
                                     "which this project never writes and never unpickles")


def dcp_load(state, path, files, no_dist):
    """torch.distributed.checkpoint.load of `state` from the folder `path`, whose meta.json lists
    `files` ({name: {"bytes", "crc32"}}), safely: None, or the one line that says it failed (DCP's
    own tracebacks and warnings are silenced: the line says it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException   # a BaseException
    root = logging.getLogger()   # DCP's loader logs its failures with tracebacks on the root logger
    level = root.level
    root.setLevel(logging.CRITICAL)
    reader = Reader(path, {name: f["bytes"] for name, f in files.items()})
    try:
        with warnings.catch_warnings():
            # one process means no process group: we know
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader, planner=Planner(), no_dist=no_dist)
    # corrupt files: any error of DCP or of unpickling
    except (Exception, CheckpointException) as e:
        why = reader.refused or type(e).__name__
        return f".metadata or a shard is unreadable or corrupt ({why})"
    finally:
        root.setLevel(level)
    return None


# ------------------------------------------------------------------------ checksums

class Damaged(ValueError):
    """A checkpoint's meta.json that is not as it was written: resume skips the checkpoint."""


def meta_crc32(record):
    """The checksum meta.json carries of its own other fields (an edited or damaged meta.json fails
    it)."""
    return f"{zlib.crc32(json.dumps(record, sort_keys=True).encode()):08x}"


def map_over_ranks(names, fn):
    """{name: fn(name)}, the names split between the ranks (each computes its share), for all."""
    if not dist.is_initialized():
        return {n: fn(n) for n in names}
    mine = {n: fn(n) for n in names[dist.get_rank()::dist.get_world_size()]}
    box = [None] * dist.get_world_size()
    dist.all_gather_object(box, mine)
    return {k: v for part in box for k, v in part.items()}


def check_meta(path, meta):
    """Damaged unless meta.json (read into `meta`; its checksum field is taken out) is as written
    and names its own folder's iteration."""
    if meta.pop("meta_crc32", None) != meta_crc32(meta):
        raise Damaged("meta.json fails its checksum (edited or damaged)")
    if meta.get("iter_num") != int(os.path.basename(path)[len("iter_"):]):
        raise Damaged(f"meta.json says iteration {meta.get('iter_num')!r}, the folder is "
                      f"{os.path.basename(path)}")


def _size_problem(path, name, want):
    file = os.path.join(path, name)
    if os.path.islink(file) or (os.path.exists(file) and not os.path.isfile(file)):
        return f"{name} is not a plain file (a checkpoint holds no links)"
    if not os.path.exists(file):
        return f"{name} is missing"
    if os.path.getsize(file) != want["bytes"]:
        return f"{name} has {os.path.getsize(file)} bytes, {want['bytes']} were written (truncated)"
    return None


def sizes(path, meta):
    """None if meta.json lists the checkpoint's .metadata and files of its own folder only, each a
    plain file of its recorded size, else what failed (the checks that read no file's bytes)."""
    files = meta["files"]
    if not isinstance(files, dict) or ".metadata" not in files:
        return "meta.json lists no .metadata"
    if not all(isinstance(n, str) and os.path.basename(n) == n and n not in ("", ".", "..")
               for n in files):
        return "meta.json lists a file outside its own folder"
    return next((p for p in (_size_problem(path, n, files[n]) for n in sorted(files)) if p), None)


def verify(path, meta):
    """None if every file of the checkpoint is as sizes() wants and has its recorded checksum,
    else what failed. Collective under torchrun: the ranks checksum the files between them."""
    problem = sizes(path, meta)
    if problem:
        return problem

    def check(name):
        got, want = crc32(os.path.join(path, name)), meta["files"][name]["crc32"]
        return None if got == want else \
            f"{name} fails its checksum (crc32 {got}, {want} was written)"
    results = map_over_ranks(sorted(meta["files"]), check)
    return next((results[n] for n in sorted(results) if results[n]), None)
