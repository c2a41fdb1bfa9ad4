"""test_data.py: corpus preparation at scale (prepare.py): the same token files whatever the number
of workers and the format, bad input counted and named, a split by documents, memory that does not
grow with the corpus, never a half-written or short file used, and torchrun ranks that wait for
rank 0's preparation past the process-group timeout. Run: .venv/bin/python -m pytest -q
"""
import fcntl
import gzip
import json
import re
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from plumbing import preparation
from plumbing import corpus, data
from conftest import ROOT, TINY, expect_error, losses, metrics

EOT = 256  # the bytes tokenizer's <|endoftext|>


def documents(n, seed=0, size=(200, 3000)):
    """n distinct documents of random words and lines, some longer than a piece."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "ünï", "code", "x = 1", "def f():", "\t", "42"]
    docs = []
    for i in range(n):
        length = rng.randint(*size) if i % 50 else 3 * corpus.PIECE  # every 50th spans several pieces
        text = f"doc {i}:"
        while len(text) < length:
            text += rng.choice(words) + rng.choice([" ", " ", "\n"])
        docs.append(text)
    return docs


def write_txt(folder, docs, gz=False):
    folder.mkdir(parents=True)
    for i, d in enumerate(docs):
        raw = d.encode("utf-8")
        (folder / f"d{i:05d}.txt{'.gz' if gz else ''}").write_bytes(gzip.compress(raw) if gz else raw)
    return folder


def write_jsonl(path, docs, gz=False, field="text"):
    lines = "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()
    path.write_bytes(gzip.compress(lines) if gz else lines)
    return path


def tokens(folder):
    return {s: (Path(folder) / f"{s}.bin").read_bytes() for s in ("train", "val")}


def run(dataset, data_dir, *args, **kwargs):
    """preparation.prepare in this process, its log lines collected."""
    lines = []
    out = preparation.prepare(str(dataset), "bytes", data_dir, *args, log=lines.append, **kwargs)
    return out, lines


# ---------------------------------------------------------------------------- the same tokens

@pytest.mark.parametrize("tokenizer", ["bytes", "gpt2"])
def test_same_files_for_one_and_two_workers(tmp_path, tokenizer):
    if tokenizer == "gpt2" and "TIKTOKEN_CACHE_DIR" not in os.environ:
        pytest.skip("TIKTOKEN_CACHE_DIR is not set: no GPT-2 vocabulary without a download")
    src = write_jsonl(tmp_path / "c.jsonl", documents(1500))   # about 2.5 MB: several tasks
    one = preparation.prepare(str(src), tokenizer, tmp_path / "one", num_proc=1, log=lambda *a: None)
    two = preparation.prepare(str(src), tokenizer, tmp_path / "two", num_proc=2, log=lambda *a: None)
    assert tokens(one) == tokens(two)
    assert json.loads((one / "meta.json").read_text())["documents"] == 1500


def test_formats_and_gzip_give_the_same_tokens(tmp_path):
    docs = documents(300)
    forms = {"txt": write_txt(tmp_path / "txt", docs), "txt.gz": write_txt(tmp_path / "txtgz", docs, gz=True),
             "jsonl": write_jsonl(tmp_path / "c.jsonl", docs), "jsonl.gz": write_jsonl(tmp_path / "c.jsonl.gz", docs, True),
             "json": write_jsonl(tmp_path / "c.json", docs)}
    got = {name: tokens(run(path, tmp_path / "d", num_proc=1)[0]) for name, path in forms.items()}
    for name in forms:
        assert got[name] == got["txt"], name
    all_ids = np.frombuffer(got["txt"]["train"] + got["txt"]["val"], dtype=np.uint16)
    assert (all_ids == EOT).sum() == 300   # one <|endoftext|> per document, none per piece
    field = write_jsonl(tmp_path / "other.jsonl", docs, field="content")
    assert tokens(run(field, tmp_path / "d", num_proc=1, text_field="content")[0]) == got["txt"]


@pytest.mark.parametrize("form, why", [
    ("a.jsonl", "a.jsonl:1, no 'text' field (--text_field names it)"),
    ("a.json", "a.json:1, a JSON list, not an object (one document per line)"),
    ("a.parquet", "a.parquet:row 1, its 'text' is a int, not text")])
def test_a_corpus_without_text_says_why_and_counts_the_rows(tmp_path, form, why):
    """A .jsonl without the text field, a .json array, a parquet text column of ints: one line that
    counts the lines or rows without text and says what the first one holds."""
    src = tmp_path / "c"
    src.mkdir()
    if form == "a.jsonl":
        (src / form).write_text("".join(json.dumps({"body": f"doc {i}"}) + "\n" for i in range(300)))
    elif form == "a.json":
        (src / form).write_text(json.dumps([{"text": f"doc {i}"} for i in range(300)]))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"text": list(range(300))}), src / form)
    count = 1 if form == "a.json" else 300
    with pytest.raises(ValueError, match=rf"; {count} JSON lines or rows had no text \(first: .*"
                                         + re.escape(why) + r"\)$"):
        run(src, tmp_path / "d", num_proc=1)


def test_bad_lines_bytes_and_files_are_counted_and_named(tmp_path):
    src = tmp_path / "c"
    src.mkdir()
    good = documents(40)
    write_jsonl(src / "a.jsonl", good[:20])
    with open(src / "a.jsonl", "ab") as f:
        f.write(b'{"text": "fine"}\n{not json\n{"text": 7}\n{"other": "x"}\n\n["text"]\n')
    (src / "b.txt").write_bytes("caf".encode() + b"\xe9 \xff\xfe ok\n" + good[20].encode())   # 3 invalid bytes
    (src / "c.bin").write_bytes(bytes(range(256)))                                          # binary: skipped
    write_txt(src / "more", good[21:])
    out, lines = run(src, tmp_path / "d", num_proc=2)
    summary = lines[-1]
    assert f"1 file(s) skipped (first: {src / 'c.bin'} (binary))" in summary
    assert f"3 invalid UTF-8 bytes replaced in 1 file(s) (first: {src / 'b.txt'})" in summary
    assert f"4 malformed JSON lines or rows without text skipped (first: {src / 'a.jsonl'}:22, not JSON)" \
        in summary
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["documents"], meta["invalid_utf8_bytes"], meta["malformed_json_lines"]) == (41, 3, 4)
    ids = np.frombuffer(b"".join(tokens(out).values()), dtype=np.uint16)
    assert bytes(ids[ids < 256].astype(np.uint8)).count("\ufffd".encode()) == 3   # replaced, not dropped


def test_split_is_by_documents_and_respects_the_fraction(tmp_path):
    docs = documents(2000, size=(50, 400))
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    for fraction in (0.1, 0.3):
        out, _ = run(src, tmp_path / f"d{fraction}", num_proc=1, val_fraction=fraction)
        split = {}
        for s, raw in tokens(out).items():
            ids = np.frombuffer(raw, dtype=np.uint16)
            text = bytes(ids.astype(np.uint8)) if ids.max() < 256 else None
            assert text is not None or (ids == EOT).any()
            parts = np.split(ids, np.flatnonzero(ids == EOT) + 1)
            split[s] = {bytes(p[:-1].astype(np.uint8)).decode() for p in parts if len(p)}
        assert not split["train"] & split["val"] and split["train"] | split["val"] == set(docs)
        share = len(split["val"]) / len(docs)
        assert abs(share - fraction) < 0.03, (fraction, share)   # 2000 draws: sd 0.007-0.010


# ---------------------------------------------------------------------------- bounded memory

def peak_rss_mb(dataset, data_dir):
    """Preparation in a process of its own: (main, largest worker) peak RSS in MB. The main's is its
    VmHWM (getrusage's maxrss would carry over this test process's peak across the exec)."""
    code = ("import resource, sys; from plumbing import preparation; preparation.prepare(sys.argv[1], 'bytes', sys.argv[2], num_proc=2, "
            "log=lambda *a: None); hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')]; "
            "print(int(hwm[0].split()[1]) / 1024, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)")
    res = subprocess.run([sys.executable, "-c", code, str(dataset), str(data_dir)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=True)
    return [float(x) for x in res.stdout.split()]


@pytest.mark.slow
def test_memory_does_not_grow_with_the_corpus(tmp_path):
    block = "".join(documents(400)).encode()            # about 0.6 MB, repeated
    sizes = {}
    for mb in (8, 64):
        path = tmp_path / f"c{mb}.txt"
        with open(path, "wb") as f:
            for _ in range(mb * 2 ** 20 // len(block) + 1):
                f.write(block)
        sizes[mb] = peak_rss_mb(path, tmp_path / f"d{mb}")
    (main8, worker8), (main64, worker64) = sizes[8], sizes[64]
    # The old preparation kept every id in a Python list: 13-29 bytes of RAM per token, +700 MB here.
    assert main64 - main8 < 30 and worker64 - worker8 < 30, sizes
    assert max(main64, worker64) < 1024, sizes


# ---------------------------------------------------------------------------- never half-used, never short

@pytest.mark.slow
def test_killed_preparation_is_redone_and_never_read(tmp_path):
    big = tmp_path / "big.jsonl"
    write_jsonl(big, documents(400) * 25)                # about 17 MB: a few seconds
    code = "import sys; from plumbing import preparation; preparation.prepare(sys.argv[1], 'bytes', sys.argv[2], num_proc=1)"
    proc = subprocess.Popen([sys.executable, "-c", code, str(big), str(tmp_path / "d")], cwd=ROOT)
    out = preparation.prepared_dir(str(big), "bytes", tmp_path / "d")
    deadline = time.time() + 60
    while not list(out.glob("*.tmp")) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    proc.kill()
    proc.wait()
    assert not (out / "meta.json").exists() and not (out / "train.bin").exists() and list(out.glob("*.tmp"))
    folder, _ = run(big, tmp_path / "d", num_proc=2)
    assert not list(out.glob("*.tmp"))
    assert tokens(folder) == tokens(run(big, tmp_path / "fresh", num_proc=2)[0])


def test_short_file_is_prepared_again_with_a_line(tmp_path):
    src = write_txt(tmp_path / "c", documents(50))
    out, _ = run(src, tmp_path / "d", num_proc=1)
    whole = tokens(out)
    with open(out / "train.bin", "r+b") as f:
        f.truncate(100)
    _, lines = run(src, tmp_path / "d", num_proc=1)
    assert lines[0] == f"data: {out / 'train.bin'} has 100 bytes, meta.json says {len(whole['train'])}: preparing again"
    assert tokens(out) == whole


def test_two_processes_preparing_at_once(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", documents(400) * 10)
    code = "import sys; from plumbing import preparation; preparation.prepare(sys.argv[1], 'bytes', sys.argv[2], num_proc=1)"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(src), str(tmp_path / "d")], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert sum("data: prepared" in o for o in outs) == 1   # the other one waited, then reused the files
    assert tokens(preparation.prepared_dir(str(src), "bytes", tmp_path / "d")) == tokens(run(src, tmp_path / "e", num_proc=1)[0])


# ---------------------------------------------------------------------------- progress, the command, torchrun

def test_progress_lines_and_the_quiet_default(tmp_path, monkeypatch):
    monkeypatch.setattr(preparation, "PROGRESS_S", 0.0)
    src = write_jsonl(tmp_path / "c.jsonl", documents(1500))
    _, lines = run(src, tmp_path / "d", num_proc=1)
    assert len(lines) > 2 and all(" GB read, " in x and "MB/s, eta" in x for x in lines[:-1])
    _, lines = run(data.EMBEDDED, tmp_path / "d", num_proc=1)
    assert len(lines) == 1 and lines[0].startswith("data: prepared pydoc with bytes")


@pytest.mark.parametrize("args, fragment", [
    (["--dataset=/no/such"], "dataset path /no/such does not exist"),
    (["--dataset=pydoc", "--val_fraction=1.5"], "val_fraction=1.5 must be above 0 and below 1"),
    (["--dataset=pydoc", "--num_proc=-1"], "num_proc=-1 must not be negative"),
    (["--dataset=pydoc", "--num_proc=two"], "argument --num_proc: invalid int value: 'two'"),
    (["--tokenizer=gpt2"], "the following arguments are required: --dataset"),
])
def test_command_errors(args, fragment):
    res = subprocess.run([sys.executable, str(ROOT / "prepare.py"), *args], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    err = res.stderr.strip()
    assert res.returncode == 2 and err.startswith("error: ") and "\n" not in err and fragment in err, err


def test_command_prints_the_summary(tmp_path):
    src = write_txt(tmp_path / "c", documents(30))
    res = subprocess.run([sys.executable, str(ROOT / "prepare.py"), f"--dataset={src}", f"--data_dir={tmp_path / 'd'}",
                          "--num_proc=2", "--val_fraction=0.2"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert "30 documents" in res.stdout and "data: ready in" in res.stdout
    # (a corpus of a few kB: its rate in kB/s, not "0.0 MB/s")
    rate = re.search(r"\(([\d.]+) kB/s, 2 processes\)", res.stdout)
    assert rate and float(rate.group(1)) > 0, res.stdout


@pytest.mark.slow
def test_torchrun_ranks_wait_for_rank_0_past_the_timeout(tmp_path):
    """Rank 0 is kept waiting 8 s on the preparation lock (as behind a long preparation); with a 3 s
    process-group timeout the other rank must wait outside any collective."""
    src = write_txt(tmp_path / "c", documents(60))
    out = preparation.prepared_dir(str(src), "bytes", tmp_path / "d")
    out.mkdir(parents=True)
    with open(out / "prepare.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "train.py"), f"--out_dir={tmp_path / 'o'}", f"--data_dir={tmp_path / 'd'}",
               f"--dataset={src}", *TINY, "--max_iters=2", "--eval_interval=100", "--timeout_s=3",
               "--gradient_accumulation_steps=2", "--batch_size=2"]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        time.sleep(8)
        assert proc.poll() is None, proc.communicate()
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "data: prepared" in stdout and len(losses(metrics(tmp_path / "o"))) == 2


def test_changed_token_file_is_prepared_again_and_foreign_ids_refused(capsys, tmp_path):
    """A token file overwritten at the same size (in-vocabulary ids, so no size or range check sees
    it) fails its checksum on reuse and is prepared again; ids past the model's vocabulary are a
    one-line error before training."""
    lines = []
    out = preparation.prepare(data.EMBEDDED, "bytes", tmp_path / "d", num_proc=1, log=lines.append)
    original = (out / "train.bin").read_bytes()
    (out / "train.bin").write_bytes(original[::-1])   # the same bytes in another order
    assert preparation.prepare(data.EMBEDDED, "bytes", tmp_path / "d", num_proc=1, log=lines.append) == out
    assert any("train.bin fails its checksum (changed since it was prepared): preparing again" in x for x in lines)
    assert (out / "train.bin").read_bytes() == original
    meta = json.loads((out / "meta.json").read_text())
    assert meta["max_id"] == 256 and meta["train_crc32"] == data.crc32(out / "train.bin")
    (out / "meta.json").write_text(json.dumps({**meta, "max_id": 400}))   # as from a larger vocabulary
    expect_error(capsys, [f"--out_dir={tmp_path / 'o'}", f"--data_dir={tmp_path / 'd'}", *TINY],
                 "holds token ids up to 400, the model's vocabulary has 320")


@pytest.mark.slow
def test_one_long_line_or_document_is_cut_and_split(tmp_path):
    """A corpus that is one 11 MB line (no line end at all) is cut into pieces at character
    boundaries, so memory stays as for any corpus; one 11 MB JSON document is split in units of
    about 1 MiB, so val holds about val_fraction of the tokens, not all of them."""
    line = ("ünïcödé wörds " * (16 * 2 ** 20 // 20))[: 16 * 2 ** 20 // 2]
    (tmp_path / "line.txt").write_text(line)
    (tmp_path / "doc.jsonl").write_text(json.dumps({"text": line}) + "\n")
    small = tmp_path / "small.txt"
    small.write_text(line[: 2 ** 20])
    base_main, base_worker = peak_rss_mb(small, tmp_path / "s")
    main, worker = peak_rss_mb(tmp_path / "line.txt", tmp_path / "d")
    assert main - base_main < 30 and worker - base_worker < 30, (main, worker, base_main, base_worker)
    for name in ("line.txt", "doc.jsonl"):
        out = preparation.prepare(str(tmp_path / name), "bytes", tmp_path / "d", num_proc=1, val_fraction=0.3,
                              log=lambda *a: None)
        meta = json.loads((out / "meta.json").read_text())
        share = meta["val_tokens"] / (meta["train_tokens"] + meta["val_tokens"])
        assert 0.1 < share < 0.6, (name, share)   # (about 11 units of 1 MiB for the document: a coarse split)
        text = np.fromfile(out / "train.bin", dtype=meta["dtype"]).astype(np.uint8)[:1000].tobytes()
        text.decode("utf-8")   # the cuts never split a character (bytes tokenizer: ids are the bytes)


def test_num_proc_above_the_cpus_is_capped_with_one_line(tmp_path):
    lines = []
    preparation.prepare(data.EMBEDDED, "bytes", tmp_path / "d", num_proc=1000, log=lines.append)
    cpus = len(os.sched_getaffinity(0))
    assert f"data: num_proc=1000 is more than the {cpus} CPUs this process may use: using {cpus}" in lines
    assert f"{cpus} process" in lines[-1]
