"""pickle_scan.py: a checkpoint's `.metadata` pickle read as an opcode stream before it is
unpickled, so that a few crafted bytes can neither hang nor crash the process.

Not in the BOOST paper (arXiv 2512.12131): part of reading a checkpoint from elsewhere as data
(integrity.py). integrity.MetadataUnpickler already lets a pickle name and call nothing but
checking functions and empty DCP dataclasses; what is left is the shape of the data itself, whose
harm is in C, where no signal handler runs:

- a doubling chain of tuples (each holding the one before twice: DUP, or GET of one memo entry
  twice) is 85 bytes that hash or print as 2**N items: hours;
- a tuple nested a million deep is freed (or printed) by recursion in C: a segfault.

`scan` walks the stream with pickletools (nothing is built) and refuses, in one line, any opcode
DCP's writer never emits (DUP, POP, the buffer and extension opcodes among them), a stream past
MAX_BYTES, and any object nested deeper than MAX_DEPTH. Depth is known exactly because a container
may only be filled while nothing else holds it (as pickle's writer always does): an object taken
from the memo, or put into another, is never changed after. `check_keys` admits as dict keys only
what DCP writes (strings and MetadataIndex of checked fields), before anything hashes them.
"""
import pickle
import pickletools

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

MAX_BYTES = 256 << 20   # a checkpoint's .metadata: ~1 KB a tensor shard
MAX_DEPTH = 64          # DCP's metadata nests about 8 deep
LEAVES = {"BININT", "BININT1", "BININT2", "LONG1", "NONE", "NEWTRUE", "NEWFALSE", "BINFLOAT",
          "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "EMPTY_TUPLE", "EMPTY_LIST",
          "EMPTY_DICT", "GLOBAL"}
TUPLES = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
FILLS = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "BUILD"}
OTHERS = {"PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET",
          "LONG_BINGET", "TUPLE", "STACK_GLOBAL", "REDUCE", "NEWOBJ"}
OPCODES = LEAVES | set(TUPLES) | FILLS | OTHERS


class _Node:
    """An object of the stream: how deep it nests, and whether anything holds it yet."""
    __slots__ = ("depth", "held")

    def __init__(self, depth=1):
        self.depth, self.held = depth, False


def _holding(parts):
    """A new object holding `parts` (each now held): one deeper than the deepest."""
    for part in parts:
        part.held = True
    return _Node(1 + max((p.depth for p in parts), default=0))


def _fill(target, parts):
    """Put `parts` into `target` (APPEND, SETITEM, BUILD): refused once anything holds it."""
    if target.held:
        raise pickle.UnpicklingError(".metadata changes an object after it was shared, which a "
                                     "checkpoint never does")
    target.depth = max(target.depth, _holding(parts).depth)


def _step(name, arg, stack, marks, memo):
    """One opcode's effect on the stack of _Nodes."""
    if name in LEAVES:
        stack.append(_Node())
    elif name in TUPLES or name == "TUPLE":
        start = marks.pop() if name == "TUPLE" else len(stack) - TUPLES[name]
        if start < 0:
            raise IndexError("stack underflow")
        parts, stack[start:] = stack[start:], []
        stack.append(_holding(parts))
    elif name in ("APPENDS", "SETITEMS"):
        start = marks.pop()
        parts, stack[start:] = stack[start:], []
        _fill(stack[-1], parts)
    elif name in ("APPEND", "BUILD"):
        part = stack.pop()
        _fill(stack[-1], [part])
    elif name == "SETITEM":
        value, key = stack.pop(), stack.pop()
        _fill(stack[-1], [key, value])
    elif name == "MARK":
        marks.append(len(stack))
    elif name == "MEMOIZE":
        memo[len(memo)] = stack[-1]
    elif name in ("BINPUT", "LONG_BINPUT"):
        memo[arg] = stack[-1]
    elif name in ("BINGET", "LONG_BINGET"):
        memo[arg].held = True
        stack.append(memo[arg])
    elif name in ("STACK_GLOBAL", "REDUCE", "NEWOBJ"):
        args, first = stack.pop(), stack.pop()
        stack.append(_holding([args, first]) if name == "REDUCE" else _Node())


def scan(data):
    """UnpicklingError (one line, naming no value of the file) unless `data` is a pickle of the
    opcodes, size and nesting DCP's writer gives a checkpoint's .metadata."""
    if len(data) > MAX_BYTES:
        raise pickle.UnpicklingError(f".metadata is {len(data):,} bytes, past the {MAX_BYTES:,} a "
                                     "checkpoint's has")
    stack, marks, memo = [], [], {}
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name not in OPCODES:
                raise pickle.UnpicklingError(f".metadata uses the pickle opcode {op.name}, which "
                                             "a checkpoint never does")
            _step(op.name, arg, stack, marks, memo)
            if stack and stack[-1].depth > MAX_DEPTH:
                raise pickle.UnpicklingError(f".metadata nests objects deeper than {MAX_DEPTH}, "
                                             "which a checkpoint never does")
    except (ValueError, IndexError, KeyError) as e:   # (a stream cut short, a memo never set)
        raise pickle.UnpicklingError(f".metadata is not a whole pickle "
                                     f"({type(e).__name__})") from None


def check_keys(keys):
    """UnpicklingError unless every dict key is a str or a MetadataIndex of a str, a torch.Size
    and an int or None: what DCP writes, checked before anything hashes them."""
    for key in keys:
        if type(key) is str:
            continue
        if type(key) is not MetadataIndex or type(key.__dict__.get("fqn")) is not str or \
                type(key.__dict__.get("offset")) is not torch.Size or \
                not isinstance(key.__dict__.get("index"), (int, type(None))):
            raise pickle.UnpicklingError(f".metadata keys a dict by a {type(key).__name__}, "
                                         "which a checkpoint never does")
