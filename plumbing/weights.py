"""weights.py: a model folder's weight files read as data, checked before a tensor is made.

Not in the BOOST paper (arXiv 2512.12131); what makes importing a folder from elsewhere safe
(interchange.py's import). A `model.safetensors` is an 8-byte little-endian header length, a JSON
header ({name: {dtype, shape, data_offsets}}) and the tensors' bytes: `header` reads and checks the
header alone (its length against the file's, every dtype known, every shape a list of integers,
every tensor's bytes exactly its shape times its dtype's size, inside the file, none overlapping),
so a folder's names and shapes are checked against its config.json's model (`fit`) before a
byte of tensor data is read. A `pytorch_model.bin` is read with torch.load(weights_only=True): a
pickle that asks for anything but tensors is refused. A weights file that is a link is refused (it
may point anywhere).
"""
import json
import os
import pickle
import struct

import torch

from plumbing.tokenizer import need

WEIGHTS = "model.safetensors"   # what transformers writes by default
HEADER_MAX = 100 << 20          # bytes: safetensors' own limit on a header
DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
          "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def safetensors():
    """The safetensors package's torch half, or a one-line ValueError naming it."""
    need("safetensors", f"reading or writing {WEIGHTS}")
    import safetensors.torch
    return safetensors.torch


def _plain(path):
    if os.path.islink(path) or not os.path.isfile(path):
        raise ValueError(f"{path} is not a plain file (a model folder's weights are no link)")


def header(path):
    """{name: shape} of a safetensors file, from its header alone; ValueError with one line where
    the header is damaged or does not describe the file's bytes."""
    _plain(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 2 <= n <= min(HEADER_MAX, size - 8):
            raise ValueError(f"{path}: its header length ({n}) does not fit the file's {size} "
                             "bytes")
        try:
            entries = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError(f"{path}: its header is not JSON") from None
    if not isinstance(entries, dict):
        raise ValueError(f"{path}: its header is not a JSON object")
    entries.pop("__metadata__", None)
    shapes, spans = {}, []
    for name, e in entries.items():
        shapes[name] = _entry(path, name, e)
        spans.append((e["data_offsets"][0], e["data_offsets"][1], name))
    end = 0
    for start, stop, name in sorted(spans):
        if start < end or stop > size - 8 - n:
            raise ValueError(f"{path}: {name}'s bytes overlap another's or lie past the end of the "
                             "file")
        end = stop
    return shapes


def _entry(path, name, e):
    """The shape of one header entry, checked against its dtype and byte range."""
    naturals = lambda xs: isinstance(xs, list) and all(type(x) is int and x >= 0 for x in xs)
    ok = isinstance(e, dict) and e.get("dtype") in DTYPES and naturals(e.get("shape")) and \
        naturals(e.get("data_offsets")) and len(e["data_offsets"]) == 2
    if not ok:
        raise ValueError(f"{path}: the header's entry for {name!r} is not a dtype, shape and "
                         "offsets")
    numel = 1
    for d in e["shape"]:
        numel *= d
    start, stop = e["data_offsets"]
    if stop - start != numel * DTYPES[e["dtype"]]:
        raise ValueError(f"{path}: {name} is {e['dtype']} {tuple(e['shape'])}, which is "
                         f"{numel * DTYPES[e['dtype']]} bytes, not the {stop - start} it holds")
    return tuple(e["shape"])


def fit(folder, held, needed, optional=()):
    """ValueError unless the weights' {name: shape} `held` are exactly the `needed` ones that
    config.json's model needs (and any of `optional`)."""
    for name, want in needed.items():
        if name not in held:
            raise ValueError(f"{folder}: the weights have no {name}, which config.json's model "
                             "needs")
        if held[name] != want:
            raise ValueError(f"{folder}: {name} is {held[name]}, config.json's model needs {want}")
    extra = sorted(set(held) - set(needed) - set(optional))
    if extra:
        raise ValueError(f"{folder}: {len(extra)} tensor(s) that config.json's model has no place "
                         f"for, the first {extra[0]}")


FLOATS = (torch.float32, torch.float16, torch.bfloat16)   # a model's weights are one of these


def floats_only(folder, tensors):
    """tensors, or a one-line ValueError where one is not F32, F16 or BF16 (a float tensor
    relabelled I32 has the same bytes, and would train on garbage)."""
    bad = next((n for n, t in tensors.items() if t.dtype not in FLOATS), None)
    if bad is not None:
        raise ValueError(f"{folder}: {bad} is {tensors[bad].dtype}; a model's weights are "
                         "float32, float16 or bfloat16")
    return tensors


def load(folder, needed, optional=()):
    """{name: tensor} of a folder's model.safetensors, or of its pytorch_model.bin read as tensors
    only (weights_only=True: anything else is refused), whose names and shapes fit `needed` (fit():
    for safetensors on its header alone, before a byte of tensor data is read), every one a float
    tensor (floats_only)."""
    path = os.path.join(folder, WEIGHTS)
    if os.path.lexists(path):
        fit(folder, header(path), needed, optional)
        try:
            tensors = safetensors().load_file(path)
        except (OSError, RuntimeError, ValueError) as e:   # safetensors' own errors are these
            raise ValueError(f"{folder}: {WEIGHTS} is unreadable ({type(e).__name__}: "
                             f"{str(e)[:80]})") from None
        return floats_only(folder, tensors)
    path = os.path.join(folder, "pytorch_model.bin")
    if not os.path.lexists(path):
        raise ValueError(f"{folder} is not a model folder: it has neither {WEIGHTS} nor "
                         "pytorch_model.bin")
    _plain(path)
    try:
        tensors = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError:
        raise ValueError(f"{folder}: pytorch_model.bin holds more than tensors, and it is not "
                         f"unpickled (convert it to {WEIGHTS})") from None
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise ValueError(f"{folder}: pytorch_model.bin is unreadable ({type(e).__name__})") \
            from None
    if not isinstance(tensors, dict) or \
            not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ValueError(f"{folder}: pytorch_model.bin is not a dict of tensors")
    fit(folder, {name: tuple(t.shape) for name, t in tensors.items()}, needed, optional)
    return floats_only(folder, tensors)
