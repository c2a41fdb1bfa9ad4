"""test_integrity.py: damaged or untrusted files never run code or reach the weights (plumbing/integrity.py,
plumbing/train_state.py, interchange.py): a crafted checkpoint .metadata or pytorch_model.bin runs nothing, a
damaged meta.json or shard is named in one line by resume and export alike, pruning never removes the
good checkpoint a run resumed from, and an import folder must fit its config.json exactly.
"""
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import interchange
import prepare
from plumbing import formats, integrity, preparation, train_state
from conftest import ROOT, TINY, command, expect_error, metrics, run_train


class Payload:
    """A pickle that runs a shell command when unpickled: what a malicious file would hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def tool(*args):
    """interchange.py's command, in this process: (exit status, stderr)."""
    return command(interchange.cli, *args)


def tool_process(*args):
    """interchange.py's command as a process of its own: (exit status, stderr)."""
    res = subprocess.run([sys.executable, str(ROOT / "interchange.py"), *map(str, args)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    return res.returncode, res.stderr.strip()


def one_line_error(code_err, *fragments):
    code, err = code_err
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def rewrite_meta(ckpt, **changes):
    """Edit a checkpoint's meta.json and give it the checksums of what it now records (as a careful
    attacker would), so that only the checks behind them can catch it."""
    meta = json.loads((ckpt / "meta.json").read_text())
    meta.pop("meta_crc32")
    for name in meta["files"]:
        meta["files"][name] = {"bytes": (ckpt / name).stat().st_size, "crc32": integrity.crc32(ckpt / name)}
    meta.update(changes)
    (ckpt / "meta.json").write_text(json.dumps({**meta, "meta_crc32": integrity.meta_crc32(meta)}))


@pytest.fixture
def checkpoint(tmp_path, data_dir):
    run_train(tmp_path / "run", data_dir, "--max_iters=2", "--eval_interval=2", "--n_kv_head=4")
    return Path(train_state.checkpoint_dirs(tmp_path / "run")[-1])


@pytest.mark.slow
def test_crafted_metadata_runs_nothing_on_resume_or_export(capsys, tmp_path, data_dir, checkpoint):
    marker = tmp_path / "it_ran"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    rewrite_meta(checkpoint)   # its size and checksum recorded: only the unpickler stands in the way
    out_dir = checkpoint.parent.parent
    expect_error(capsys, [f"--out_dir={out_dir}", f"--data_dir={data_dir}", *TINY, "--n_kv_head=4", "--init_from=resume", "--max_iters=4"],
                 "is unreadable or corrupt")
    one_line_error(tool_process("export", checkpoint, tmp_path / "m.pt"), "is unreadable or corrupt")
    assert not marker.exists() and not (tmp_path / "m.pt").exists()
    with pytest.raises(pickle.UnpicklingError, match="posix.system is not part of a checkpoint's metadata"):
        integrity.MetadataUnpickler(open(checkpoint / ".metadata", "rb")).load()


def test_crafted_weights_file_runs_nothing_on_import(tmp_path, checkpoint):
    folder = tmp_path / "hf"
    cfg, state, _ = interchange.checkpoint_state(str(checkpoint))
    formats.write(folder, state, cfg, "cola", "bytes")
    assert (folder / "model.safetensors").exists() and not (folder / "pytorch_model.bin").exists()
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "it_ran"
    torch.save({"x": Payload(marker)}, folder / "pytorch_model.bin")
    one_line_error(tool("import", folder, tmp_path / "new"), "holds more than tensors", "not unpickled")
    assert not marker.exists()
    torch.save(torch.zeros(3), folder / "pytorch_model.bin")   # a bare tensor, not a dict of them
    one_line_error(tool("import", folder, tmp_path / "new"), "is not a dict of tensors")


def test_damaged_meta_json_is_skipped_with_one_line(capsys, tmp_path, data_dir):
    out = tmp_path / "run"
    run_train(out, data_dir, "--max_iters=4", "--eval_interval=2")
    newest, older = (Path(d) for d in train_state.checkpoint_dirs(out)[::-1])
    meta = json.loads((newest / "meta.json").read_text())
    for bad in (100, "abc"):   # an edit without the checksum, then a consistent lie
        (newest / "meta.json").write_text(json.dumps({**meta, "iter_num": bad}))
        lines = []
        resume = train_state.intact([str(newest), str(older)], lines.append)
        assert resume.found == [str(older)] and resume.skipped == [str(newest)]
        assert lines == [f"skipping checkpoint {newest}: meta.json fails its checksum (edited or damaged)"]
    rewrite_meta(newest, iter_num=100)
    lines = []
    with pytest.raises(ValueError, match="meta.json says iteration 100, the folder is iter_0000004"):
        train_state.intact([str(newest)], lines.append)
    one_line_error(tool("export", newest, tmp_path / "m.pt"), "meta.json says iteration 100")


def test_export_verifies_the_checksums(tmp_path, checkpoint):
    shard = next(checkpoint.glob("*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    one_line_error(tool("export", checkpoint, tmp_path / "m.pt"), f"{shard.name} fails its checksum")
    assert not (tmp_path / "m.pt").exists()


@pytest.mark.slow
def test_pruning_after_a_skipped_checkpoint_keeps_the_good_one(tmp_path, data_dir):
    """Good iter_2, corrupt iter_4: the resumed run (saving every 3) removes iter_4 at its first save
    and never the iter_2 it resumed from until a newer good one exists (keep_checkpoints=2)."""
    out, common = tmp_path / "run", ["--max_iters=4", "--eval_interval=2"]
    run_train(out, data_dir, *common)
    corrupt = Path(train_state.checkpoint_dirs(out)[-1])
    shard = next(corrupt.glob("*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0x01
    shard.write_bytes(bytes(raw))
    run_train(out, data_dir, "--max_iters=6", "--eval_interval=3", "--init_from=resume")
    assert [Path(d).name for d in train_state.checkpoint_dirs(out)] == ["iter_0000003", "iter_0000006"]
    resume = next(r for r in metrics(out, events=True) if r.get("event") == "resume")
    assert resume["iter"] == 2
    for d in train_state.checkpoint_dirs(out):
        assert integrity.verify(d, json.loads(Path(d, "meta.json").read_text())) is None


def fake_folder(folder, cfg_changes=(), drop=None, reshape=None, extra=None):
    """An hf folder of a tiny dense model, altered."""
    from model import Config, Llama
    cfg = Config(arch="full", n_layer=2, n_embd=32, n_head=4, vocab_size=320, block_size=32, mlp_gate="silu")
    formats.write(folder, Llama(cfg).state_dict(), cfg, "hf", "bytes")
    config = json.loads((folder / "config.json").read_text())
    config.update(dict(cfg_changes))
    (folder / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = torch.zeros(3, 3)
    if extra:
        tensors[extra] = torch.zeros(2)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("changes, fragment", [
    (dict(cfg_changes={"num_hidden_layers": 1}), "tensor(s) that config.json's model has no place for, the first model.layers.1."),
    (dict(drop="model.layers.0.mlp.up_proj.weight"), "the weights have no model.layers.0.mlp.up_proj.weight"),
    (dict(reshape="model.norm.weight"), "model.norm.weight is (3, 3), config.json's model needs (32,)"),
    (dict(extra="model.layers.0.self_attn.q_proj.bias"), "the first model.layers.0.self_attn.q_proj.bias"),
    (dict(cfg_changes={"num_attention_heads": 0}), "num_attention_heads=0 is not a positive integer"),
    (dict(cfg_changes={"hidden_size": "32"}), "hidden_size='32' is not a positive integer"),
    (dict(cfg_changes={"rms_norm_eps": "tiny"}), "rms_norm_eps='tiny' is not a number"),
    (dict(cfg_changes={"num_hidden_layers": None}), "num_hidden_layers=None is not a positive integer"),
])
def test_import_checks_the_folder_against_its_config(tmp_path, changes, fragment):
    folder = fake_folder(tmp_path / "hf", **changes)
    one_line_error(tool("import", folder, tmp_path / "new"), fragment)
    assert not (tmp_path / "new" / "checkpoints").exists()


def test_a_huge_config_is_refused_from_the_weights_header_before_any_model_is_built(tmp_path, monkeypatch):
    """4000 layers x 1M width beside a small file: refused from the header's names and shapes, with
    no model of that size built and no tensor read."""
    from plumbing import weights
    folder = fake_folder(tmp_path / "hf", cfg_changes={"num_hidden_layers": 4000, "hidden_size": 1 << 20,
                                                        "intermediate_size": 1 << 22, "head_dim": 1 << 18})
    monkeypatch.setattr(weights, "safetensors", lambda: pytest.fail("tensors read before the shapes were checked"))
    one_line_error(tool("import", folder, tmp_path / "new"), "model.embed_tokens.weight is (320, 32), "
                   "config.json's model needs (320, 1048576)")


def damaged_weights(folder, how):
    """Damage model.safetensors the ways a folder from elsewhere may be damaged."""
    import struct
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    if how == "length":
        raw = struct.pack("<Q", 10 ** 15) + raw[8:]
    elif how == "not_json":
        raw = raw[:8] + b"{" * n + raw[8 + n:]
    elif how in ("past_end", "dtype", "int"):
        name = max((k for k in head if k != "__metadata__"), key=lambda k: head[k]["data_offsets"][1])
        if how == "past_end":   # the last tensor moved 4 KiB on, past the end of the file
            head[name]["data_offsets"] = [o + 4096 for o in head[name]["data_offsets"]]
        elif how == "int":   # relabelled, the same bytes: the header is consistent
            head[name]["dtype"] = "I32"
        else:
            head[name]["dtype"] = "F16"   # the F32 bytes stay: half the shape's worth would be read
        text = json.dumps(head).encode()
        raw = struct.pack("<Q", len(text)) + text + raw[8 + n:]
    if how == "link":
        path.unlink()
        path.symlink_to("/etc/passwd")
        return
    path.write_bytes(raw)


@pytest.mark.parametrize("how, fragment", [
    ("length", "its header length (1000000000000000) does not fit the file's"),
    ("not_json", "its header is not JSON"),
    ("past_end", "bytes overlap another's or lie past the end of the file"),
    ("dtype", "model.norm.weight is F16 (32,), which is 64 bytes, not the 128 it holds"),
    ("link", "is not a plain file (a model folder's weights are no link)"),
    ("int", "is torch.int32; a model's weights are float32, float16 or bfloat16")])
def test_a_damaged_safetensors_file_is_one_line(tmp_path, how, fragment):
    folder = fake_folder(tmp_path / "hf")
    damaged_weights(folder, how)
    one_line_error(tool("import", folder, tmp_path / "new"), fragment)
    assert not (tmp_path / "new" / "checkpoints").exists()


def test_an_unwritable_target_is_one_line(capsys, tmp_path, checkpoint, data_dir):
    """export (pt and a folder), import and prepare into a path that cannot be written (under a file;
    under /proc, which no one may write, root included), and a tensorboard folder that is a file."""
    (tmp_path / "a_file").write_text("")
    for target in (tmp_path / "a_file" / "x", "/proc/boost-test"):
        said = "cannot write" if str(target).startswith("/proc") else "a_file of"   # (export's check)
        one_line_error(tool("export", checkpoint, target), said)
        one_line_error(tool("export", checkpoint, target, "--format=cola"), said)
        one_line_error(tool("import", fake_folder(tmp_path / f"hf{len(str(target))}"), target), "cannot write")
        code, err = command(prepare.main, "--dataset=pydoc", f"--data_dir={target}")
        assert code == 2 and err.startswith("error: cannot write in data_dir") and "\n" not in err, err
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "tensorboard").write_text("")
    expect_error(capsys, [f"--out_dir={tmp_path / 'tb'}", f"--data_dir={data_dir}", *TINY, "--tensorboard=true"],
                 "tensorboard is a file, where --tensorboard=true writes its events")


def test_import_command_errors(tmp_path):
    folder = fake_folder(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    del config["intermediate_size"]
    (folder / "config.json").write_text(json.dumps(config))
    one_line_error(tool("import", folder, tmp_path / "new"), "config.json has no intermediate_size")
    (folder / "config.json").write_text("[1, 2]")
    one_line_error(tool("import", folder, tmp_path / "new"), "config.json is not a JSON object")
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")   # (opening it would block until a writer came)
    one_line_error(tool("import", folder, tmp_path / "new"), "config.json is not a plain file")
    folder = fake_folder(tmp_path / "good")
    (tmp_path / "a_file").write_text("")
    one_line_error(tool("import", folder, tmp_path / "a_file"), "is a file: import needs a new or empty out_dir")
    assert tool("import", folder, tmp_path / "new")[0] == 0
    one_line_error(tool("import", folder, tmp_path / "new"), "holds an earlier run", "import into a new or empty out_dir")


def test_a_full_disk_is_one_line_and_leaves_nothing_behind(capsys, monkeypatch, tmp_path, data_dir):
    """Token files and checkpoint shards written to /dev/full (ENOSPC, as on a full filesystem):
    one line each, no temporary file left to fill the disk, the earlier checkpoint untouched."""
    import builtins
    from plumbing import data
    real_open, real_path_open = builtins.open, Path.open

    def full(path, mode="r", *args, **kw):
        return real_open("/dev/full" if ".bin." in str(path) and "w" in mode else path, mode, *args, **kw)
    monkeypatch.setattr(preparation, "open", full, raising=False)
    with pytest.raises(ValueError, match="cannot write the token files in .* MB free there\\); nothing was kept"):
        preparation.prepare(data.EMBEDDED, "bytes", tmp_path / "d", num_proc=1, log=lambda *a: None)
    assert not list((tmp_path / "d").rglob("*.tmp")) and not list((tmp_path / "d").rglob("meta.json"))
    assert list((tmp_path / "d").iterdir()) == []   # (the corpus's folder it made, gone again)
    monkeypatch.undo()
    out = tmp_path / "run"
    run_train(out, data_dir, "--max_iters=2", "--eval_interval=2")

    def full_shard(self, mode="r", *args, **kw):
        return real_open("/dev/full", mode) if self.suffix == ".distcp" and "w" in mode else \
            real_path_open(self, mode, *args, **kw)
    monkeypatch.setattr(Path, "open", full_shard)
    expect_error(capsys, [f"--out_dir={out}", f"--data_dir={data_dir}", *TINY, "--init_from=resume", "--max_iters=4",
                          "--eval_interval=2"], "cannot write checkpoint", "No space left on device",
                 "the previous checkpoints are untouched")
    monkeypatch.undo()
    assert [Path(d).name for d in train_state.checkpoint_dirs(out)] == ["iter_0000002"]
    assert not (out / "checkpoints" / "iter_0000004.tmp").exists()

    def full_meta(path, mode="r", *args, **kw):   # (the shards fit, meta.json does not)
        return real_open("/dev/full" if str(path).endswith("meta.json") and "w" in mode else path,
                         mode, *args, **kw)
    monkeypatch.setattr(train_state, "open", full_meta, raising=False)
    expect_error(capsys, [f"--out_dir={out}", f"--data_dir={data_dir}", *TINY, "--init_from=resume", "--max_iters=4",
                          "--eval_interval=2"], "cannot write checkpoint", "No space left on device")
    monkeypatch.undo()
    assert [Path(d).name for d in train_state.checkpoint_dirs(out)] == ["iter_0000002"]
    assert not (out / "checkpoints" / "iter_0000004.tmp").exists()


def test_a_full_disk_under_the_metrics_log_is_one_line(tmp_path, capsys):
    """metrics.jsonl on a full disk (/dev/full): one error line, exit 2, not a traceback."""
    from plumbing import rundir
    metrics = rundir.Metrics(tmp_path, active=True)
    metrics.f = open("/dev/full", "a")
    with pytest.raises(SystemExit) as e:
        metrics.write({"iter": 1, "loss": 2.0})
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: cannot write /dev/full (No space left on device); the run stops")


def test_a_damaged_exported_file_is_refused_by_sample(tmp_path, checkpoint):
    assert tool("export", checkpoint, tmp_path / "m.pt")[0] == 0
    assert tool("sample", tmp_path / "m.pt", 3)[0] == 0
    raw = bytearray((tmp_path / "m.pt").read_bytes())
    raw[len(raw) // 2] ^= 0x01   # inside the tensors' bytes
    (tmp_path / "bad.pt").write_bytes(bytes(raw))
    one_line_error(tool("sample", tmp_path / "bad.pt", 3), "bad.pt fails its checksum (damaged since it was exported)")


# ------------------------------------------------------------------------ a folder crafted elsewhere

def build_onto(module, name, key="__truediv__"):
    """A pickle that BUILDs {key: None} onto the object `module.name`: what sets a class's or a
    function's attributes in plain pickle (protocol 2 opcodes, written by hand)."""
    setitem = b"\x8c" + bytes([len(key)]) + key.encode() + b"N" + b"s"
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"}" + setitem + b"b."


def test_metadata_builds_onto_nothing_the_unpickler_admits():
    """BUILD onto every class and function the unpickler admits (and a dtype) is refused, and none of
    them is changed; so are REDUCE of a dataclass, NEWOBJ with arguments and an unknown field."""
    import io
    admitted = sorted(integrity.ALLOWED) + [("torch", "float32")]
    before = {(m, n): dict(vars(obj)) if hasattr(obj, "__dict__") else None
              for (m, n) in admitted for obj in [getattr(__import__(m, fromlist=[n]), n)]}
    for module, name in admitted:
        for key in ("__truediv__", "__eq__", "cache"):
            with pytest.raises(pickle.UnpicklingError):
                integrity.MetadataUnpickler(io.BytesIO(build_onto(module, name, key))).load()
    for (module, name), attrs in before.items():
        obj = getattr(__import__(module, fromlist=[name]), name)
        assert attrs is None or dict(vars(obj)) == attrs, f"{module}.{name} was changed"
    assert Path("a") / "b" == Path("a/b")
    meta = "torch.distributed.checkpoint.metadata"
    for crafted in (b"\x80\x02c" + f"{meta}\nMetadata\n".encode() + b")R.",        # REDUCE a dataclass
                    b"\x80\x02c" + f"{meta}\nStorageMeta\n".encode() + b"N\x85\x81.",   # NEWOBJ (None,)
                    b"\x80\x02c" + f"{meta}\nStorageMeta\n".encode() + b")\x81}\x8c\x01xNsb.",  # field x
                    b"\x80\x02cposix\nsystem\n\x8c\x04true\x85R."):
        with pytest.raises(pickle.UnpicklingError):
            integrity.MetadataUnpickler(io.BytesIO(crafted)).load()


def test_a_metadata_that_patches_path_steers_nothing(capsys, tmp_path, data_dir, checkpoint, monkeypatch):
    """The issue's attack: a prefix that BUILDs {'__truediv__': PosixPath} onto pathlib.PosixPath,
    then the real metadata. Resume and export refuse it in one line and write nothing elsewhere."""
    real = (checkpoint / ".metadata").read_bytes()
    prefix = b"\x80\x04cpathlib\nPosixPath\n}\x8c\x0b__truediv__cpathlib\nPosixPath\nsb0"
    (checkpoint / ".metadata").write_bytes(prefix + real[2:])   # (POP the patched class, then the rest)
    rewrite_meta(checkpoint)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out_dir = checkpoint.parent.parent
    expect_error(capsys, [f"--out_dir={out_dir}", f"--data_dir={data_dir}", *TINY, "--n_kv_head=4",
                          "--init_from=resume", "--max_iters=4"], "the pickle opcode POP", "no usable checkpoint")
    one_line_error(tool("export", checkpoint, tmp_path / "m.pt"), "the pickle opcode POP")
    # the unpickler alone (past the opcode scan) refuses the BUILD itself
    with pytest.raises(pickle.UnpicklingError, match="sets attributes of a function"):
        integrity.MetadataUnpickler(io.BytesIO(prefix + real[2:])).load()
    assert Path("a") / "b" == Path("a/b") and list(elsewhere.iterdir()) == []


def storage_of(ckpt):
    import io
    return integrity.MetadataUnpickler(io.BytesIO((ckpt / ".metadata").read_bytes())).load()


@pytest.mark.parametrize("where", ["absolute", "parent", "unlisted", "past_end"])
def test_metadata_items_read_only_the_files_meta_json_lists(capsys, tmp_path, data_dir, where):
    """Every item must read a stretch of a plain file of its own folder that meta.json lists: one
    that names another run's shard (absolute, ../), a file not listed, or bytes past a file's end is
    refused, and resume falls back to the previous checkpoint; export refuses it."""
    other = tmp_path / "other"
    run_train(other, data_dir, "--max_iters=2", "--eval_interval=2", "--seed=7")
    theirs = next(Path(train_state.checkpoint_dirs(other)[-1]).glob("*.distcp"))
    out = tmp_path / "run"
    run_train(out, data_dir, "--max_iters=4", "--eval_interval=2")
    newest = Path(train_state.checkpoint_dirs(out)[-1])
    metadata = storage_of(newest)
    for info in metadata.storage_data.values():
        info.relative_path = {"absolute": str(theirs), "parent": f"../../../other/checkpoints/"
                              f"{theirs.parent.name}/{theirs.name}", "unlisted": "x.distcp",
                              "past_end": info.relative_path}[where]
        info.offset += 10 ** 9 if where == "past_end" else 0
    (newest / ".metadata").write_bytes(pickle.dumps(metadata))
    (newest / "x.distcp").write_bytes(theirs.read_bytes())
    rewrite_meta(newest)   # (the files it lists and checksums: not x.distcp)
    one_line_error(tool("export", newest, tmp_path / "m.pt"), "unreadable or corrupt", ".metadata reads")
    assert not (tmp_path / "m.pt").exists()
    run_train(out, data_dir, "--max_iters=5", "--init_from=resume")
    assert f"skipping checkpoint {newest}: .metadata or a shard is unreadable or corrupt (.metadata reads" \
        in capsys.readouterr().out
    resume = next(r for r in metrics(out, events=True) if r.get("event") == "resume")
    assert resume["iter"] == 2


def test_resume_takes_its_options_from_the_checkpoint_it_resumes(capsys, tmp_path, data_dir):
    """An edited meta.json (a learning rate of 0.9, another dataset) fails its checksum: resume skips
    it, and the options come from the checkpoint resumed from, not from the one skipped."""
    out = tmp_path / "run"
    straight = run_train(tmp_path / "straight", data_dir, "--max_iters=6", "--eval_interval=2")
    run_train(out, data_dir, "--max_iters=4", "--eval_interval=2")
    newest = Path(train_state.checkpoint_dirs(out)[-1])
    meta = json.loads((newest / "meta.json").read_text())
    meta["train_config"].update(learning_rate=0.9, dataset="elsewhere")
    (newest / "meta.json").write_text(json.dumps(meta))   # the checksum no longer holds
    (out / "metrics.jsonl").unlink()
    resumed = run_train(out, data_dir, "--max_iters=6", "--eval_interval=2", "--init_from=resume")
    assert capsys.readouterr().out.count(f"skipping checkpoint {newest}") == 1
    steps = lambda records: {r["iter"]: (r["lr"], r["loss"]) for r in records if "lr" in r}
    assert steps(resumed) == {i: v for i, v in steps(straight).items() if i >= 2}


@pytest.mark.parametrize("damage", ["no_files", "garbage_metadata"])
def test_a_checkpoint_that_verifies_but_cannot_be_loaded_falls_back(capsys, tmp_path, data_dir, damage):
    """A checkpoint whose meta.json lists no files (with a correct meta_crc32), or whose .metadata
    DCP cannot read (its checksum recorded), is skipped with one line: the previous one is used."""
    out = tmp_path / "run"
    straight = run_train(tmp_path / "straight", data_dir, "--max_iters=5", "--eval_interval=2")
    run_train(out, data_dir, "--max_iters=4", "--eval_interval=2")
    newest = Path(train_state.checkpoint_dirs(out)[-1])
    if damage == "no_files":
        rewrite_meta(newest, files={})
    else:
        (newest / ".metadata").write_bytes(b"\x80\x04K\x01.")   # a pickle of the number 1
        rewrite_meta(newest)
    (out / "metrics.jsonl").unlink()
    resumed = run_train(out, data_dir, "--max_iters=5", "--eval_interval=2", "--init_from=resume")
    said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("skipping")]
    assert len(said) == 1 and str(newest) in said[0], said
    assert said[0].endswith("meta.json lists no .metadata" if damage == "no_files"
                            else "unreadable or corrupt (.metadata holds a int, not DCP's Metadata)")
    steps = lambda records: {r["iter"]: r["loss"] for r in records if "loss" in r}
    assert steps(resumed) == {i: v for i, v in steps(straight).items() if i >= 2}


def test_an_out_dir_inside_a_runs_checkpoints_is_refused(capsys, tmp_path, data_dir):
    out = tmp_path / "run"
    run_train(out, data_dir, "--max_iters=2", "--eval_interval=2")
    for inner in (out / "checkpoints" / "iter_0000002" / "nested", out / "checkpoints" / "mine"):
        expect_error(capsys, [f"--out_dir={inner}", f"--data_dir={data_dir}", *TINY, "--max_iters=2"],
                     f"is inside the checkpoints of the run in {out}")
        assert not inner.exists()
    fake_folder(tmp_path / "hf")
    one_line_error(tool("import", tmp_path / "hf", out / "checkpoints" / "x"), "is inside the checkpoints")
    assert not (out / "checkpoints" / "x").exists()
