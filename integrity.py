"""integrity.py: a checkpoint's files are what was written, and nothing in a file from elsewhere runs.

Not in the BOOST paper (arXiv 2512.12131); what makes resuming, exporting or importing a folder safe.

Checksums. meta.json records the size and CRC-32 of every file of a checkpoint (the ranks checksum
the files between them) and a CRC-32 of its own other fields; `verify` checks them before a
checkpoint is resumed or exported, so a flipped byte, a truncated shard or an edited meta.json is
named in one line and never trained on.

Data, never code. Python's pickle runs whatever a crafted file asks for, and two readers in this
project's path use it:

- torch.distributed.checkpoint reads a checkpoint's `.metadata` with plain pickle. `Reader` is
  DCP's FileSystemReader with that one read done by `MetadataUnpickler`, which builds nothing but
  the classes DCP's metadata is made of (ALLOWED) and refuses every other name with one line.
- DCP's default planner turns an item stored as bytes back into whatever object its pickle names.
  This project's training state is tensors only, so `Planner` refuses any bytes item outright.

The tensors themselves DCP reads with torch.load(weights_only=True); model folders are read from
safetensors files or, for a pytorch_model.bin, with weights_only=True (interchange.py). So a
checkpoint folder may hold `.metadata`, `*.distcp` shards and `meta.json`; an import folder
`config.json` and `model.safetensors` (or `pytorch_model.bin`); nothing in them is ever executed.
"""
import json
import logging
import os
import pickle
import warnings
import zlib

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from data import crc32   # noqa: F401  (the checksum of every file: checkpoints here, token files in prepare.py)

# (module, name) of everything a DCP .metadata pickle of this project refers to
ALLOWED = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties",
    "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("collections", "OrderedDict")}


class MetadataUnpickler(pickle.Unpickler):
    """An Unpickler that finds only the ALLOWED names and torch's dtypes."""

    def find_class(self, module, name):
        if (module, name) in ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class Reader(FileSystemReader):
    """DCP's FileSystemReader, whose .metadata goes through MetadataUnpickler."""

    def read_metadata(self, *args, **kwargs):
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class Planner(DefaultLoadPlanner):
    """DCP's default load planner, except that an item stored as pickled bytes is refused."""

    def load_bytes(self, read_item, value):
        raise pickle.UnpicklingError(f"{read_item.dest_index.fqn} is stored as pickled bytes, which this project "
                                     "never writes and never unpickles")


def dcp_load(state, path, no_dist):
    """torch.distributed.checkpoint.load of `state` from the folder `path`, safely: None, or the one
    line that says it failed (DCP's own tracebacks and warnings are silenced: the line says it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException   # a BaseException
    root = logging.getLogger()   # DCP's loader logs its failures with tracebacks on the root logger
    level = root.level
    root.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)   # one process means no process group: we know
            dcp.load(state, storage_reader=Reader(path), planner=Planner(), no_dist=no_dist)
    except (Exception, CheckpointException) as e:   # corrupt files: any error of DCP or of unpickling
        return f"checkpoint {path} is unreadable or corrupt ({type(e).__name__})"
    finally:
        root.setLevel(level)
    return None


# ------------------------------------------------------------------------ checksums

class Damaged(ValueError):
    """A checkpoint's meta.json that is not as it was written: resume skips the checkpoint."""


def meta_crc32(record):
    """The checksum meta.json carries of its own other fields (an edited or damaged meta.json fails it)."""
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
    """Damaged unless meta.json (read into `meta`; its checksum field is taken out) is as written and
    names its own folder's iteration."""
    if meta.pop("meta_crc32", None) != meta_crc32(meta):
        raise Damaged("meta.json fails its checksum (edited or damaged)")
    if meta.get("iter_num") != int(os.path.basename(path)[len("iter_"):]):
        raise Damaged(f"meta.json says iteration {meta.get('iter_num')!r}, the folder is {os.path.basename(path)}")


def verify(path, meta):
    """None if every file of the checkpoint has its recorded size and checksum, else what failed.
    Collective under torchrun: the ranks checksum the files between them."""
    def check(name):
        file = os.path.join(path, name)
        want = meta["files"][name]
        if not os.path.exists(file):
            return f"{name} is missing"
        if os.path.getsize(file) != want["bytes"]:
            return f"{name} has {os.path.getsize(file)} bytes, {want['bytes']} were written (truncated)"
        got = crc32(file)
        if got != want["crc32"]:
            return f"{name} fails its checksum (crc32 {got}, {want['crc32']} was written)"
        return None
    results = map_over_ranks(sorted(meta["files"]), check)
    return next((results[n] for n in sorted(results) if results[n]), None)
