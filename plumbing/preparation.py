"""preparation.py: a corpus of any size to token files: streaming, in parallel, never half-used
(prepare.py is the command over it; train.py calls it on first use).

Not part of the BOOST paper (arXiv 2512.12131); what a pretraining run needs before its first step.

plumbing/corpus.py reads the corpus (text, JSON Lines, their .gz; a file or a folder) as a stream
of pieces of about 16 KiB, which `num_proc` worker processes tokenise in chunks; the tokens are
appended to the split files as they come, so memory does not grow with the corpus, and the tokens
do not depend on the number of workers. A document goes to the validation split when a hash of its
index falls below `val_fraction` (so a folder sorted by kind does not put one kind into val; a
document longer than UNIT pieces goes in units of UNIT pieces), the first document always; a corpus
that is one text file has no documents to split by, so there the pieces are split the same way.
<|endoftext|> follows every document.

Nothing is lost in silence: invalid UTF-8 bytes are replaced and counted, malformed JSON lines and
binary files (a NUL byte in the first 8 KiB) are skipped and counted; the summary line names the
first of each. The files are written under unique temporary names and published by renaming,
meta.json last (token counts, file sizes, the source's fingerprint); an interrupted preparation is
redone, never read; a lock makes a second process wait for the first one's files.
"""
import array
import codecs
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

from plumbing import corpus, data
from plumbing.tokenizer import continued, identity as tokenizer_identity, load as load_tokenizer

UNIT = 16  # pieces (256 KiB to 1 MiB): a longer document is split in units of this many
FORMAT = 5  # bumped when the same source would give other token files (5: "▁" once a document)
PROGRESS_S = 5.0             # seconds between progress lines


def token_dtype(n_vocab):
    """The integer type of the token files: 16 bits while the vocabulary fits."""
    return np.uint16 if n_vocab <= 2 ** 16 else np.uint32


def to_val(doc, piece, fraction):
    """The split of a unit: a document, UNIT pieces of a longer one, or a piece of the one document
    of a single text file: a hash of its index, uniform in [0, 1), below fraction. The first unit
    always goes to val, so a small corpus always has one."""
    h = hashlib.blake2b(f"{doc}:{piece}".encode(), digest_size=8).digest()
    return (doc, piece) == (0, 0) or int.from_bytes(h, "little") / 2 ** 64 < fraction


def check_preparation(dataset, data_dir, num_proc, val_fraction):
    """ValueError naming the option where a preparation option is out of range."""
    if dataset != data.EMBEDDED and not os.path.exists(dataset):
        raise ValueError(f"dataset path {dataset} does not exist")
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise ValueError(f"data_dir={data_dir} is a file, not a folder")
    if num_proc < 0:
        raise ValueError(f"num_proc={num_proc} must not be negative (0: every CPU)")
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be above 0 and below 1")
    if dataset != data.EMBEDDED:
        # pyarrow for .parquet, zstandard for .zst
        corpus.check_packages(corpus.source_files(dataset))


def prepared_dir(dataset, tokenizer, data_dir):
    """<data_dir>/<name>-<hash of its path>-<tokenizer's identity>: one folder per source and
    tokenizer."""
    where = hashlib.sha1(str(Path(dataset).resolve()).encode()).hexdigest()[:8]
    name = data.EMBEDDED if dataset == data.EMBEDDED else f"{Path(dataset).name}-{where}"
    return Path(data_dir) / f"{name}-{tokenizer_identity(tokenizer)}"


# ------------------------------------------------------------------------ the workers' side

_bad = [0]     # invalid UTF-8 bytes replaced in the current task


def _count_bad(err):
    _bad[0] += err.end - err.start
    return "\ufffd", err.end


codecs.register_error("boost_count", _count_bad)
_enc = None


def _init_worker(tokenizer):
    global _enc
    _enc = load_tokenizer(tokenizer)


def tokenize(task):
    """One task -> (train ids, val ids, stats). A task is (options, items), each item one of
    ("text", file, document, piece index, bytes, last piece of the document) and
    ("jsonl", file, document, line number, line bytes, None) and ("row", file, document, row number,
    its text's bytes or None where it had no text, the type of a value that was not text or
    None)."""
    (fraction, field, by_piece), items = task
    typecode = "H" if token_dtype(_enc.n_vocab) == np.uint16 else "I"
    # 2 or 4 bytes a token, not a Python int
    train, val = array.array(typecode), array.array(typecode)
    stats = {"docs": 0, "bad_bytes": 0, "bad_files": [], "bad_lines": 0, "first_bad_line": None,
             "train_units": 0, "val_units": 0}
    _bad[0] = 0

    def emit(doc, k, blob, last):
        # a later piece of a document: no "▁" again
        encode = continued(_enc) if k else _enc.encode_ordinary
        ids = encode(blob.decode("utf-8", "boost_count"))
        if last:
            ids.append(_enc.eot_token)
            stats["docs"] += 1
        split = "val" if to_val(doc, k if by_piece else k // UNIT, fraction) else "train"
        (val if split == "val" else train).extend(ids)
        if last or by_piece or (k + 1) % UNIT == 0:
            stats[f"{split}_units"] += 1

    for kind, file, doc, k, blob, last in items:
        bad_before = _bad[0]
        if kind == "text":
            emit(doc, k, blob, last)
        else:
            text, why = text_of(kind, blob, last, field)
            if why:
                stats["bad_lines"] += 1
                where = f"{file}:{'row ' if kind == 'row' else ''}{k}"
                stats["first_bad_line"] = stats["first_bad_line"] or f"{where}, {why}"
                continue
            cut, _ = corpus.pieces(text.encode("utf-8"), final=True)
            for piece_k, piece in enumerate(cut or [b""]):
                emit(doc, piece_k, piece, piece_k == max(0, len(cut) - 1))
        if _bad[0] > bad_before and file not in stats["bad_files"]:
            stats["bad_files"].append(file)
    stats["bad_bytes"] = _bad[0]
    dtype = token_dtype(_enc.n_vocab)
    return np.frombuffer(train, dtype=dtype), np.frombuffer(val, dtype=dtype), stats


def text_of(kind, blob, held, field):
    """(the text of a JSON line or a Parquet row, None), or (None, why it has none); a row's `held`
    names the type of a value that was not text."""
    if kind == "row":
        return (blob.decode("utf-8", "boost_count"), None) if blob is not None else \
            (None, f"its {field!r} is {'a ' + held if held else 'empty'}, not text")
    try:
        obj = json.loads(blob.decode("utf-8", "boost_count"))
    except ValueError:
        return None, "not JSON"
    if not isinstance(obj, dict):
        return None, f"a JSON {type(obj).__name__}, not an object (one document per line)"
    if field not in obj:
        return None, f"no {field!r} field (--text_field names it)"
    if not isinstance(obj[field], str):
        return None, f"its {field!r} is a {type(obj[field]).__name__}, not text"
    return obj[field], None


def _results(tasks, tokenizer, num_proc):
    """tokenize() of every task, in order; at most 2·num_proc tasks in flight (bounded memory)."""
    if num_proc <= 1:
        _init_worker(tokenizer)
        yield from map(tokenize, tasks)
        return
    import multiprocessing as mp
    with mp.get_context("spawn").Pool(num_proc, initializer=_init_worker,
                                      initargs=(tokenizer,)) as pool:
        flying = deque()
        for task in tasks:
            flying.append(pool.apply_async(tokenize, (task,)))
            if len(flying) >= 2 * num_proc:
                yield flying.popleft().get()
        while flying:
            yield flying.popleft().get()


# ------------------------------------------------------------------------ preparing, once

def fingerprint(dataset, fraction, field):
    """Changes when the source (names, sizes, modification times) or the preparation's options
    do."""
    h = hashlib.sha1(f"{FORMAT}\0{fraction}\0{field}\0".encode())
    if dataset == data.EMBEDDED:
        h.update(sys.version.encode())
    else:
        for f in corpus.source_files(dataset):
            st = f.stat()
            h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


def ready(out, fp, log=None):
    """meta.json of a finished preparation matching fingerprint fp, with its files whole; else None
    (and, given `log`, a line saying which file does not match)."""
    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if meta.get("fingerprint") != fp:
        return None
    for split in ("train", "val"):
        want = meta[f"{split}_tokens"] * np.dtype(meta["dtype"]).itemsize
        size = (out / f"{split}.bin").stat().st_size if (out / f"{split}.bin").exists() else None
        if size != want:
            if log:
                log(f"data: {out / (split + '.bin')} has {size} bytes, meta.json says {want}: "
                    f"preparing again")
                (out / "meta.json").unlink()
            return None
    for split in ("train", "val"):   # the same size is not the same tokens: their checksum
        if data.crc32(out / f"{split}.bin") != meta.get(f"{split}_crc32"):
            if log:
                log(f"data: {out / (split + '.bin')} fails its checksum (changed since it was "
                    f"prepared): preparing again")
                (out / "meta.json").unlink()
            return None
    return meta


def prepare(dataset, tokenizer, data_dir, num_proc=0, val_fraction=0.1, text_field="text",
            log=print):
    """Tokenise `dataset` into <data_dir>/<name>-<tokenizer>/ unless already prepared; return the
    folder."""
    check_preparation(dataset, data_dir, num_proc, val_fraction)
    out = prepared_dir(dataset, tokenizer, data_dir)
    fp = fingerprint(dataset, val_fraction, text_field)
    if ready(out, fp):
        return out
    made = not out.exists()   # (a folder this call makes goes again if nothing could be kept)
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = open(out / "prepare.lock", "a")
    except OSError as e:
        raise ValueError(f"cannot write in data_dir {data_dir} ({e.strerror or e})") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # a second process waits here, then finds the files ready
        if ready(out, fp, log):
            return out
        if (out / "meta.json").exists():
            log(f"data: {dataset} or the preparation's options changed since it was prepared, "
                f"preparing again")
        (out / "meta.json").unlink(missing_ok=True)   # meta.json goes first and comes back last
        # left by a preparation that was killed: never read, removed
        for stale in out.glob("*.tmp"):
            stale.unlink()
        enc = load_tokenizer(tokenizer)
        tmp = {s: out / f"{s}.bin.{os.getpid()}.tmp" for s in ("train", "val")}
        try:
            cpus = len(os.sched_getaffinity(0))   # 0: every CPU this process may use; never more
            if num_proc > cpus:
                log(f"data: num_proc={num_proc} is more than the {cpus} CPUs this process may use: "
                    f"using {cpus}")
            workers = min(num_proc, cpus) or cpus
            meta = _write(dataset, tokenizer, out, tmp, workers, val_fraction, text_field, enc, log)
        except OSError as e:   # a full disk, most often: nothing half-written is left behind
            free = shutil.disk_usage(out).free / 1e6
            if made:
                shutil.rmtree(out, ignore_errors=True)
            raise ValueError(f"cannot write the token files in {out} ({e.strerror or e}; "
                             f"{free:,.0f} MB free there); nothing was kept") from None
        finally:
            for t in tmp.values():
                t.unlink(missing_ok=True)
        meta.update(source=str(dataset), tokenizer=tokenizer_identity(tokenizer),
                    tokenizer_path=tokenizer, vocab_size=enc.n_vocab, fingerprint=fp,
                    val_fraction=val_fraction,
                    text_field=text_field)
        (out / "meta.json.tmp").write_text(json.dumps(meta, indent=1))
        os.replace(out / "meta.json.tmp", out / "meta.json")
    return out


def prepare_once(dataset, tokenizer, data_dir, num_proc, val_fraction, text_field, log=print):
    """prepare() on global rank 0; the other ranks wait for its published meta.json (no collective,
    so no process-group timeout: call this before the process group starts)."""
    if int(os.environ.get("RANK", "0")) == 0:
        return prepare(dataset, tokenizer, data_dir, num_proc, val_fraction, text_field, log)
    out = prepared_dir(dataset, tokenizer, data_dir)
    fp = fingerprint(dataset, val_fraction, text_field)
    while not ready(out, fp):
        time.sleep(0.5)
    return out


def too_small(dataset, reader, n, first, fraction):
    """The ValueError of a corpus that gave one of the splits no token: what it held, and why."""
    unit = f"pieces of up to {corpus.PIECE // 1024} KiB" if reader.opts[2] else "documents"
    said = [f"{'; '.join(files)} {how}" for files, how in ((reader.skipped, "skipped"),
                                                          (reader.damaged, "damaged")) if files]
    where = f"{dataset}" + (f" ({'; '.join(said)})" if said else "")
    lines = f"; {n['bad_lines']:,} JSON lines or rows had no text (first: {first['line']})" \
        if n["bad_lines"] else ""
    raise ValueError(f"{where} is too small to split: {n['docs']} documents, "
                     f"{n['train'] + n['val']} tokens; {n['train_units']} {unit} drew train "
                     f"and {n['val_units']} val (val_fraction {fraction})" + lines)


def _write(dataset, tokenizer, out, tmp, num_proc, fraction, field, enc, log):
    """Stream the corpus through the workers into the temporary split files, then publish them."""
    reader, t0, last = corpus.Reader(dataset, (fraction, field)), time.time(), time.time()
    n = {"train": 0, "val": 0, "train_units": 0, "val_units": 0, "docs": 0, "bad_bytes": 0,
         "bad_lines": 0}
    first, bad_files, max_id = {}, set(), 0
    with open(tmp["train"], "wb") as f_train, open(tmp["val"], "wb") as f_val:
        for train, val, stats in _results(reader.tasks(), tokenizer, num_proc):
            train.tofile(f_train)
            val.tofile(f_val)
            n["train"], n["val"] = n["train"] + len(train), n["val"] + len(val)
            max_id = max([max_id] + [int(ids.max()) for ids in (train, val) if len(ids)])
            for key in ("train_units", "val_units", "docs", "bad_bytes", "bad_lines"):
                n[key] += stats[key]
            if stats["bad_files"]:
                bad_files.update(stats["bad_files"])
                first.setdefault("bytes", stats["bad_files"][0])
            if stats["first_bad_line"]:
                first.setdefault("line", stats["first_bad_line"])
            if time.time() - last > PROGRESS_S and reader.total_bytes:
                last, done = time.time(), reader.read_bytes
                rate = done / (last - t0)
                log(f"data: {done / 1e9:.2f}/{reader.total_bytes / 1e9:.2f} GB read, "
                    f"{n['docs']:,} documents, {n['train'] + n['val']:,} tokens, {rate / 1e6:.1f} "
                    f"MB/s, eta {(reader.total_bytes - done) / max(rate, 1):.0f} s")
    if n["train"] == 0 or n["val"] == 0:
        too_small(dataset, reader, n, first, fraction)
    crcs = {f"{split}_crc32": data.crc32(tmp[split]) for split in ("train", "val")}
    for split in ("train", "val"):
        os.replace(tmp[split], out / f"{split}.bin")
    seconds = time.time() - t0
    mb = (reader.total_bytes or reader.item_bytes) / 1e6
    notes = [f"{len(reader.skipped)} file(s) skipped (first: {reader.skipped[0]})"] \
        if reader.skipped else []
    if reader.damaged:
        notes.append(f"{len(reader.damaged)} damaged file(s) read up to the damage, their "
                     f"documents until then kept (first: {reader.damaged[0]})")
    if n["bad_bytes"]:
        notes.append(f"{n['bad_bytes']:,} invalid UTF-8 bytes replaced in {len(bad_files)} file(s) "
                     f"(first: {first['bytes']})")
    if n["bad_lines"]:
        notes.append(f"{n['bad_lines']:,} malformed JSON lines or rows without text skipped "
                     f"(first: {first['line']})")
    # (a rate of a small corpus in the unit it reads in: 0.0 MB/s said nothing)
    rate = f"{mb / seconds:.1f} MB/s" if mb >= 1 else f"{mb * 1e3 / seconds:.1f} kB/s"
    log(f"data: prepared {dataset} with {tokenizer} in {seconds:.1f} s ({rate}, "
        f"{num_proc} process{'es' if num_proc > 1 else ''}): {n['docs']:,} documents, "
        f"{n['train']:,} train and {n['val']:,} val tokens, in {out}"
        + "".join(f"; {x}" for x in notes))
    return {"dtype": np.dtype(token_dtype(enc.n_vocab)).name, "train_tokens": n["train"],
            "val_tokens": n["val"], **crcs, "max_id": max_id, "documents": n["docs"],
            "train_units": n["train_units"], "val_units": n["val_units"],
            "split_by": "piece" if reader.opts[2] else "document",
            "skipped_files": reader.skipped, "damaged_files": reader.damaged,
            "invalid_utf8_bytes": n["bad_bytes"], "malformed_json_lines": n["bad_lines"],
            "seconds": seconds}
