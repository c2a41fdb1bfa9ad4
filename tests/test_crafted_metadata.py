"""test_crafted_metadata.py: a few crafted bytes in a checkpoint's .metadata neither hang nor crash resume or export
(plumbing/pickle_scan.py), and a .metadata whose chunks leave part of a tensor unread is refused
(integrity.tiles).

Not in the BOOST paper (arXiv 2512.12131): reading checkpoints from elsewhere as data. Each crafted
file goes through the real user path (interchange.py export in a process of its own, with a
timeout: without the guard a doubling chain hashes for hours and a deep nest segfaults).
"""
import io
import pickle
from pathlib import Path

import pytest

from plumbing import integrity, pickle_scan
from conftest import run_train
from plumbing import train_state
from test_integrity import one_line_error, rewrite_meta, tool, tool_process


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, data_dir):
    """One small run's out_dir for the module (each test gets a copy to craft)."""
    out = tmp_path_factory.mktemp("crafted") / "run"
    run_train(out, data_dir, "--max_iters=2", "--eval_interval=2", "--n_kv_head=4")
    return out


@pytest.fixture
def checkpoint(pristine, tmp_path):
    import shutil
    shutil.copytree(pristine, tmp_path / "run")
    return Path(train_state.checkpoint_dirs(tmp_path / "run")[-1])

PROTO = b"\x80\x04"
DUP_CHAIN = PROTO + b"}N" + b"2\x86" * 60 + b"Ns."          # {((None, None), ...)²⁶⁰: None}
MEMO_CHAIN = PROTO + b"}N\x94" + b"".join(            # the same, the second by a GET of the memo
    b"h" + bytes([i]) + b"\x86\x94" for i in range(60)) + b"Ns."
DEEP = PROTO + b"N" + b"\x85" * 1_000_000 + b"."           # (((None,),),...) a million deep


@pytest.mark.parametrize("crafted, said", [
    (DUP_CHAIN, "the pickle opcode DUP"),
    (MEMO_CHAIN, "keys a dict by a tuple"),
    (DEEP, "nests objects deeper than 64"),
    (PROTO + b"N" * 10 + b"0.", "the pickle opcode POP"),
    (PROTO + b"]\x94h\x00\x85a.", "changes an object after it was shared"),   # L.append((L,))
    (PROTO + b"h\x05.", "not a whole pickle (KeyError)"),
    (PROTO + b"\x85.", "not a whole pickle (IndexError)")])
def test_crafted_metadata_is_refused_in_one_line(tmp_path, checkpoint, crafted, said):
    """The two that would hang or crash the process go through a process of their own."""
    (checkpoint / ".metadata").write_bytes(crafted)
    rewrite_meta(checkpoint)
    run = tool_process if crafted in (DUP_CHAIN, DEEP) else tool
    one_line_error(run("export", checkpoint, tmp_path / "m.pt"), "unreadable or corrupt", said)


def test_the_scan_admits_what_dcp_writes_and_caps_the_size(checkpoint):
    data = (checkpoint / ".metadata").read_bytes()
    pickle_scan.scan(data)   # (every opcode of DCP's own writer, its nesting)
    with pytest.raises(pickle.UnpicklingError, match="past the"):
        pickle_scan.scan(b"N" * (pickle_scan.MAX_BYTES + 1))


def test_a_metadata_that_covers_part_of_a_tensor_is_refused(tmp_path, checkpoint):
    """Chunks must tile each tensor exactly: one shrunk (the rest would keep its initial values),
    one moved onto another (overlap), one past the edge."""
    real = (checkpoint / ".metadata").read_bytes()
    metadata = integrity.MetadataUnpickler(io.BytesIO(real)).load()
    name, item = next((k, v) for k, v in metadata.state_dict_metadata.items() if len(v.size) == 2)
    assert integrity.tiles(item)
    chunk = item.chunks[0]
    import torch
    for offsets, sizes in (((0, 0), (chunk.sizes[0] - 1, chunk.sizes[1])),
                           ((1, 0), tuple(chunk.sizes))):
        chunk.offsets, chunk.sizes = torch.Size(offsets), torch.Size(sizes)
        assert not integrity.tiles(item)
        (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
        rewrite_meta(checkpoint)
        one_line_error(tool("export", checkpoint, tmp_path / "m.pt"),
                       f"chunks of {name} do not cover it exactly")


def test_a_crafted_value_is_named_by_its_type_not_formatted(tmp_path, checkpoint):
    """A storage entry whose relative_path is a tuple doubled forty times through the memo (24 KB;
    every check of the scan passes: 40 deep, no DUP) is refused naming its type: formatting its
    repr would take hours, its memory growing."""
    import torch.distributed.checkpoint as dcp
    meta = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    doubled = (None,)
    for _ in range(40):
        doubled = (doubled, doubled)
    index = next(iter(meta.storage_data))
    meta.storage_data[index].relative_path = doubled
    (checkpoint / ".metadata").write_bytes(pickle.dumps(meta))
    rewrite_meta(checkpoint)
    one_line_error(tool_process("export", checkpoint, tmp_path / "m.pt"), "reads a tuple, not a file")
