"""test_formats.py: the papers' own setting (plumbing/tokenizer.py, plumbing/corpus.py): a Hugging Face tokenizer.json
and a SentencePiece .model, both trained here on the embedded corpus (nothing is downloaded), and
Parquet and zstd corpora made here: prepared the same for any --num_proc, decoded back to the text,
trained at tp=1 and tp=2, resumed, exported to Hugging Face with the tokenizer and imported again.
"""
import json
import os

import pytest

import interchange
from plumbing import preparation
from plumbing import tokenizer, train_state
from conftest import TINY, command, command_out, expect_error, metrics, torchrun


def documents():
    from pydoc_data.topics import topics
    return [topics[k] for k in sorted(topics)]


@pytest.fixture(scope="session")
def tokenizers_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json (400 tokens, <|endoftext|>) and a SentencePiece BPE .model
    (400 pieces, identity normalisation and byte fallback, as LLaMA's), trained in well under a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import sentencepiece as spm
    d = tmp_path_factory.mktemp("tokenizers")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(documents(), trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    meta = Tokenizer(models.BPE(unk_token="<unk>"))   # LLaMA's and T5's way: a "▁" before every text
    meta.pre_tokenizer, meta.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    meta.train_from_iterator(documents(), trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"]))
    (d / "metaspace").mkdir()
    meta.save(str(d / "metaspace" / "tokenizer.json"))
    (d / "corpus.txt").write_text("\n".join(documents()))
    spm.SentencePieceTrainer.train(input=str(d / "corpus.txt"), model_prefix=str(d / "sp"), vocab_size=400,
                                   model_type="bpe", byte_fallback=True, character_coverage=0.995, minloglevel=2,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False)
    return d


def corpus(folder):
    """The embedded corpus's documents as a Parquet file (two row groups, one row without text) and a
    .jsonl.zst file, in one folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    docs = documents()
    folder.mkdir(parents=True, exist_ok=True)
    rows = docs[:40] + [None]
    pq.write_table(pa.table({"text": rows, "id": list(range(len(rows)))}), folder / "a.parquet", row_group_size=25)
    lines = "".join(json.dumps({"text": t}) + "\n" for t in docs[40:])
    (folder / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    return folder, docs


def token_files(folder):
    return {s: (folder / f"{s}.bin").read_bytes() for s in ("train", "val")}


@pytest.mark.parametrize("name", ["tokenizer.json", "sp.model"])
def test_tokenizer_files_encode_decode_and_name_themselves(tokenizers_dir, name):
    enc = tokenizer.load(str(tokenizers_dir / name))
    assert enc.n_vocab == 400 and enc.eos in ("<|endoftext|>", "</s>")
    text = documents()[5]
    assert enc.decode(enc.encode_ordinary(text)) == text
    ident = tokenizer.identity(str(tokenizers_dir / name))
    assert ident.startswith("hf-" if name.endswith(".json") else "spm-") and len(ident.split("-")[1]) == 12
    assert tokenizer.identity(str(tokenizers_dir)) == tokenizer.identity(str(tokenizers_dir / "tokenizer.json"))


@pytest.mark.parametrize("name", ["tokenizer.json", "sp.model", "metaspace/tokenizer.json"])
def test_parquet_and_zst_prepare_alike_for_any_num_proc_and_decode_back(tmp_path, tokenizers_dir, name):
    """... and a long document cut into pieces decodes back whole: a tokenizer that puts "▁" before
    every text it encodes (SentencePiece, Metaspace) puts it before the document only."""
    src, docs = corpus(tmp_path / "c")
    tok = str(tokenizers_dir / name)
    logs = []
    one = preparation.prepare(str(src), tok, tmp_path / "one", num_proc=1, log=logs.append)
    two = preparation.prepare(str(src), tok, tmp_path / "two", num_proc=2, log=lambda *a: None)
    assert token_files(one) == token_files(two)
    meta = json.loads((one / "meta.json").read_text())
    assert meta["tokenizer"] == tokenizer.identity(tok) and one.name.endswith(meta["tokenizer"])
    summary = "\n".join(logs)
    assert "1 malformed" in summary and f"{src / 'a.parquet'}:row 41" in summary   # the row without text
    enc = tokenizer.load(tok)
    import numpy as np
    ids = np.concatenate([np.fromfile(one / f"{s}.bin", dtype=np.uint16) for s in ("train", "val")])
    ends = np.flatnonzero(ids == enc.eot_token)   # (SentencePiece does not render its </s>: cut at the ids)
    decoded = [enc.decode(ids[a + 1:b].tolist()) for a, b in zip([-1, *ends[:-1]], ends)]
    assert sorted(decoded) == sorted(d for d in docs)   # every document, whole, in one split or the other


def test_damaged_or_columnless_files_are_skipped_and_named(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    src, _ = corpus(tmp_path / "c")
    (src / "c.txt.zst").write_bytes(b"\x28\xb5\x2f\xfd not a frame")
    pq.write_table(pa.table({"body": ["x"]}), src / "d.parquet")
    logs = []
    out = preparation.prepare(str(src), "bytes", tmp_path / "d", num_proc=1, log=logs.append)
    assert "2 file(s) skipped (first: " + str(src / "c.txt.zst") + " (ZstdError" in "\n".join(logs)
    skipped = json.loads((out / "meta.json").read_text())["skipped_files"]
    assert len(skipped) == 2 and "d.parquet (no column 'text'; its columns: body)" in skipped[1]


@pytest.mark.parametrize("suffix", [".jsonl.zst", ".jsonl.gz"])
def test_a_truncated_compressed_file_keeps_what_was_read_and_is_named(tmp_path, suffix):
    """A .zst (whose reader ended silently) or .gz cut in half beside a good file: its documents
    before the cut are prepared, and the summary names it as damaged, not skipped."""
    import gzip
    import zstandard
    docs = [f"document {i} " + " ".join(str(i * j) for j in range(40)) for i in range(7200)]
    lines = "".join(json.dumps({"text": t}) + "\n" for t in docs).encode()
    packed = zstandard.ZstdCompressor().compress(lines) if suffix.endswith("zst") else gzip.compress(lines)
    src = tmp_path / "c"
    src.mkdir()
    (src / f"a{suffix}").write_bytes(packed[:len(packed) // 2])
    (src / "b.txt").write_text("a good file beside it\n" * 50)
    logs = []
    out = preparation.prepare(str(src), "bytes", tmp_path / "d", num_proc=1, log=logs.append)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["skipped_files"] == [] and len(meta["damaged_files"]) == 1, meta
    assert 3000 < meta["documents"] - 1 < 7200, meta["documents"]   # (the good file is one document)
    assert f"1 damaged file(s) read up to the damage, their documents until then kept (first: {src}/a{suffix} " \
        "(EOFError" in logs[-1] and "skipped" not in logs[-1], logs[-1]


def test_a_missing_package_is_one_line(tmp_path, monkeypatch, tokenizers_dir):
    import sys
    src, _ = corpus(tmp_path / "c")
    monkeypatch.setitem(sys.modules, "pyarrow", None)   # import pyarrow now raises ImportError
    with pytest.raises(ValueError, match=r"^reading the corpus's .parquet files needs the pyarrow package: pip install pyarrow$"):
        preparation.check_preparation(str(src), tmp_path / "d", 1, 0.1)
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    monkeypatch.setattr(tokenizer, "_LOADED", {})   # (as in a new process: nothing loaded yet)
    with pytest.raises(ValueError, match=r"needs the sentencepiece package: pip install sentencepiece$"):
        tokenizer.load(str(tokenizers_dir / "sp.model"))


def test_bad_tokenizer_paths_are_one_line(tmp_path, capsys):
    expect_error(capsys, ["--tokenizer=nope", f"--out_dir={tmp_path}"], "tokenizer=nope is not one of bytes, gpt2")
    (tmp_path / "empty").mkdir()
    expect_error(capsys, [f"--tokenizer={tmp_path / 'empty'}", f"--out_dir={tmp_path}"],
                 "is a folder without a tokenizer.json or a SentencePiece .model")
    (tmp_path / "tokenizer.json").write_text("{not json")
    expect_error(capsys, [f"--tokenizer={tmp_path / 'tokenizer.json'}", f"--out_dir={tmp_path}"], "cannot read the tokenizer")


def test_a_broken_tokenizer_config_is_named(tmp_path, capsys, tokenizers_dir):
    """A tokenizer_config.json that is not JSON, not an object, or whose eos_token the vocabulary lacks."""
    import shutil
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copyfile(tokenizers_dir / "tokenizer.json", folder / "tokenizer.json")
    for text, fragment in (("{broken", "tokenizer_config.json is unreadable or not JSON (JSONDecodeError)"),
                           ("[1]", "tokenizer_config.json is not a JSON object with an eos_token string"),
                           ('{"eos_token": "<|nope|>"}', "the eos_token '<|nope|>' of "),
                           ('{"eos_token": {"content": 5}}', "is not a JSON object with an eos_token string")):
        (folder / "tokenizer_config.json").write_text(text)
        expect_error(capsys, [f"--tokenizer={folder}", f"--out_dir={tmp_path / 'o'}"], fragment)


def test_a_tokenizer_changed_or_gone_since_the_run_is_said_so(tmp_path, capsys, tokenizers_dir,
                                                              monkeypatch):
    """A run, and a resume, each hash and load their tokenizer file once (the vocabulary, the
    prepared files' name, the checkpoint checks and the sample share them). A resume whose recorded
    tokenizer file changed in place, or was deleted: one line that says so, before any corpus is
    prepared."""
    import shutil
    tok = tmp_path / "tok.json"
    shutil.copyfile(tokenizers_dir / "tokenizer.json", tok)
    out = tmp_path / "run"
    train_args = [f"--out_dir={out}", f"--data_dir={tmp_path / 'd'}", *TINY, f"--tokenizer={tok}",
                  "--num_proc=1", "--sample_tokens=4"]
    import train
    calls = []
    digest, load = tokenizer._digest, tokenizer._load
    monkeypatch.setattr(tokenizer, "_digest", lambda path: calls.append("hash") or digest(path))
    monkeypatch.setattr(tokenizer, "_load", lambda name: calls.append("load") or load(name))
    resume = [f"--out_dir={out}", "--init_from=resume", "--max_iters=4"]
    for argv in ([*train_args, "--max_iters=2", "--eval_interval=2"], resume):
        tokenizer._IDENTITY.clear(), tokenizer._LOADED.clear(), calls.clear()   # (a new process)
        train.main(argv)
        assert sorted(calls) == ["hash", "load"], (argv, calls)
    capsys.readouterr()
    shutil.copyfile(tokenizers_dir / "metaspace" / "tokenizer.json", tok)   # changed in place
    shutil.rmtree(tmp_path / "d")
    resume = [f"--out_dir={out}", "--init_from=resume", "--max_iters=6"]
    expect_error(capsys, resume, f"the tokenizer file {tok} changed since checkpoint", "put back the file")
    tok.unlink()
    expect_error(capsys, resume, f"the tokenizer {tok} that checkpoint", "is gone (deleted or moved)")
    # (and its held-out evaluation says the same)
    code, err = command(interchange.cli, "eval", train_state.checkpoint_dirs(out)[-1],
                        "--dataset=pydoc", f"--data_dir={tmp_path / 'd'}")
    assert code == 2 and f"the tokenizer {tok} that checkpoint" in err and "\n" not in err, err
    assert "put it back at that path" in err and "--tokenizer" not in err   # (eval has none)
    assert not (tmp_path / "d").exists()   # nothing prepared


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tokenizer.json", "sp.model"])
def test_train_resume_export_import_with_a_tokenizer_file(tmp_path, tokenizers_dir, name):
    """Parquet + jsonl.zst with the tokenizer file: tp=1 and tp=2 train alike, a resume continues,
    another tokenizer file is refused in one line, and export --format=hf carries the tokenizer, which
    import takes back (into the new out_dir), so that the imported run trains on."""
    src, _ = corpus(tmp_path / "c")
    tok = str(tokenizers_dir / name)
    arch, fmt = ("full" if name.endswith(".json") else "svd"), "hf"   # (svd exports as a Llama, W = B·A)
    common = [f"--dataset={src}", f"--tokenizer={tok}", f"--data_dir={tmp_path / 'd'}", *TINY, "--max_iters=4",
              "--eval_interval=2", "--num_proc=1", f"--arch={arch}"]
    train = lambda *argv: command_out(__import__("train").main, *argv)   # (in this process: faster)
    assert train(f"--out_dir={tmp_path / 'one'}", *common)[0] == 0
    torchrun(2, f"--out_dir={tmp_path / 'two'}", *common, "--tp=2")
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [round(r["loss"], 4) for r in one if "loss" in r] == [round(r["loss"], 4) for r in two if "loss" in r]
    assert train(f"--out_dir={tmp_path / 'one'}", "--init_from=resume", "--max_iters=6")[0] == 0
    assert [r["iter"] for r in metrics(tmp_path / "one") if "loss" in r] == [0, 1, 2, 3, 4, 5]
    other = tokenizers_dir / ("sp.model" if name.endswith(".json") else "tokenizer.json")
    code, out, err = train(f"--out_dir={tmp_path / 'one'}", "--init_from=resume", "--max_iters=8",
                           f"--tokenizer={other}")
    assert code == 2 and "pass the same tokenizer" in err, err[-500:]
    assert "data:" not in out   # (refused before a corpus is prepared for it)
    ckpt = train_state.checkpoint_dirs(tmp_path / "one")[-1]
    res = command(interchange.cli, "export", ckpt, tmp_path / "hf", f"--format={fmt}")
    assert res == (0, ""), res[1]
    held = sorted(os.listdir(tmp_path / "hf"))
    assert ("tokenizer.json" if name.endswith(".json") else "tokenizer.model") in held and "tokenizer_config.json" in held
    assert tokenizer.identity(str(tmp_path / "hf")) == tokenizer.identity(tok)
    assert command(interchange.cli, "import", tmp_path / "hf", tmp_path / "imported") == (0, "")
    kept = tmp_path / "imported" / "tokenizer"
    assert tokenizer.identity(str(kept)) == tokenizer.identity(tok)
    assert train(f"--out_dir={tmp_path / 'imported'}", "--init_from=resume", f"--dataset={src}",   # (the
                 f"--data_dir={tmp_path / 'd'}", *TINY, "--max_iters=2", "--num_proc=1")[0] == 0   # record's)
    assert tokenizer.load(str(kept)).n_vocab == 400


def test_tensorboard_events_hold_the_metrics(tmp_path, data_dir, monkeypatch, capsys):
    """--tensorboard=true: every number of metrics.jsonl's iteration records, read back from the
    event files with TensorBoard's own reader; without the package, one line before any work."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from conftest import run_train
    records = run_train(tmp_path / "o", data_dir, "--max_iters=3", "--eval_interval=2", "--tensorboard=true")
    board = EventAccumulator(str(tmp_path / "o" / "tensorboard"))
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {"loss", "val_loss", "lr", "tokens_per_s", "ms", "mem_gb", "tp_bytes", "dp_bytes", "pp_bytes"} <= tags
    assert [(e.step, round(e.value, 5)) for e in board.Scalars("loss")] == \
        [(r["iter"], round(r["loss"], 5)) for r in records if "loss" in r]
    assert [e.step for e in board.Scalars("val_loss")] == [r["iter"] for r in records if "val_loss" in r]
    import sys
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    expect_error(capsys, [f"--out_dir={tmp_path / 'p'}", f"--data_dir={data_dir}", *TINY, "--tensorboard=true"],
                 "--tensorboard=true needs the tensorboard package: pip install tensorboard")
    assert not (tmp_path / "p").exists()
