"""prepare.py: a corpus of any size to token files: streaming, in parallel, never half-used.

Not part of the BOOST paper (arXiv 2512.12131); what a pretraining run needs before its first step.

    python prepare.py --dataset=path/to/corpus --tokenizer=gpt2 [--data_dir=data --num_proc=N
                      --val_fraction=0.1 --text_field=text]

The corpus is a file or a folder (recursive, sorted, hidden files skipped) of text files (one
document each; any name but the ones below), JSON Lines (`.jsonl`, `.json`: one document per line,
its text in `text_field`), and the gzip-compressed form of either (`.gz`). Documents are read one at
a time, cut into pieces of about 16 KiB at line ends, tokenised by `num_proc` worker processes in
chunks and appended to the split files as they come, so memory does not grow with the corpus, and
the tokens do not depend on the number of workers. A document goes to the validation split when a
hash of its index falls below `val_fraction` (so a folder sorted by kind does not put one kind into
val), the first document always; a corpus that is one text file has no documents to split by, so
there the pieces are split the same way. <|endoftext|> follows every document.

Nothing is lost in silence: invalid UTF-8 bytes are replaced and counted, malformed JSON lines and
binary files (a NUL byte in the first 8 KiB) are skipped and counted; the summary line names the
first of each. The files are written under unique temporary names and published by renaming,
meta.json last (token counts, file sizes, the source's fingerprint); an interrupted preparation is
redone, never read; a lock makes a second process wait for the first one's files.
"""
import codecs
import fcntl
import gzip
import hashlib
import json
import os
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

import data

PIECE = 16 << 10             # bytes: documents are cut at the first line end past this many bytes
CHUNK = 1 << 20              # bytes of text per task sent to a worker
FORMAT = 2                   # bumped when the same source would give other token files
PROGRESS_S = 5.0             # seconds between progress lines
JSON_SUFFIXES = (".jsonl", ".json")


def token_dtype(n_vocab):
    """The integer type of the token files: 16 bits while the vocabulary fits."""
    return np.uint16 if n_vocab <= 2 ** 16 else np.uint32


def kind_of(path):
    """'jsonl' or 'text', and whether gzip-compressed, from the file name."""
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return ("jsonl" if name.endswith(JSON_SUFFIXES) else "text"), path.name.endswith(".gz")


def pieces(buf, final):
    """Cut bytes into pieces that end at the first b'\\n' at or past PIECE bytes from their start:
    (complete pieces, the rest). Feeding the rest back with more bytes gives the same cuts."""
    out, start = [], 0
    while (nl := buf.find(b"\n", start + PIECE - 1)) >= 0:
        out.append(buf[start:nl + 1])
        start = nl + 1
    rest = buf[start:]
    if final and rest:
        out, rest = out + [rest], b""
    return out, rest


def to_val(doc, piece, fraction):
    """The split of a unit, a document (piece 0) or a piece of the one document of a single text file:
    a hash of its index, uniform in [0, 1), below fraction. The first unit always goes to val, so
    a small corpus always has one."""
    h = hashlib.blake2b(f"{doc}:{piece}".encode(), digest_size=8).digest()
    return (doc, piece) == (0, 0) or int.from_bytes(h, "little") / 2 ** 64 < fraction


# ------------------------------------------------------------------------ the workers' side

_bad = [0]     # invalid UTF-8 bytes replaced in the current task


def _count_bad(err):
    _bad[0] += err.end - err.start
    return "\ufffd", err.end


codecs.register_error("boost_count", _count_bad)
_enc = None


def _init_worker(tokenizer):
    global _enc
    _enc = data.get_tokenizer(tokenizer)


def tokenize(task):
    """One task -> (train ids, val ids, stats). A task is (options, items), each item one of
    ("text", file, document, piece index, bytes, last piece of the document) and
    ("jsonl", file, document, line number, line bytes, None)."""
    (fraction, field, by_piece), items = task
    train, val = [], []
    stats = {"docs": 0, "bad_bytes": 0, "bad_files": [], "bad_lines": 0, "first_bad_line": None,
             "train_units": 0, "val_units": 0}
    _bad[0] = 0

    def emit(doc, k, blob, last):
        ids = _enc.encode_ordinary(blob.decode("utf-8", "boost_count"))
        if last:
            ids.append(_enc.eot_token)
            stats["docs"] += 1
        split = "val" if to_val(doc, k if by_piece else 0, fraction) else "train"
        (val if split == "val" else train).extend(ids)
        if last or by_piece:
            stats[f"{split}_units"] += 1

    for kind, file, doc, k, blob, last in items:
        bad_before = _bad[0]
        if kind == "text":
            emit(doc, k, blob, last)
        else:
            try:
                text = json.loads(blob.decode("utf-8", "boost_count"))[field]
                if not isinstance(text, str):
                    raise TypeError
            except (ValueError, TypeError, KeyError, IndexError):
                stats["bad_lines"] += 1
                stats["first_bad_line"] = stats["first_bad_line"] or f"{file}:{k}"
                continue
            cut, _ = pieces(text.encode("utf-8"), final=True)
            for piece_k, piece in enumerate(cut or [b""]):
                emit(doc, piece_k, piece, piece_k == max(0, len(cut) - 1))
        if _bad[0] > bad_before and file not in stats["bad_files"]:
            stats["bad_files"].append(file)
    stats["bad_bytes"] = _bad[0]
    dtype = token_dtype(_enc.n_vocab)
    return np.array(train, dtype=dtype), np.array(val, dtype=dtype), stats


# ------------------------------------------------------------------------ the reader's side

class Reader:
    """Streams the corpus as tasks of about CHUNK bytes, counting bytes read for progress."""

    def __init__(self, dataset, fraction, field):
        self.files = [] if dataset == data.EMBEDDED else data.source_files(dataset)
        by_piece = len(self.files) == 1 and kind_of(self.files[0])[0] == "text"   # no documents to split by
        self.dataset, self.opts, self.done_bytes, self.doc = dataset, (fraction, field, by_piece), 0, 0
        self.total_bytes = sum(f.stat().st_size for f in self.files)
        self.item_bytes = 0   # bytes handed to the workers (the embedded corpus has no files to count)
        self.skipped = []   # binary files, named in the summary

    @property
    def read_bytes(self):
        """Bytes of the source files read so far (compressed bytes for .gz)."""
        try:
            return self.done_bytes + (self.raw.tell() if self.raw and not self.raw.closed else 0)
        except (OSError, ValueError):
            return self.done_bytes

    def tasks(self):
        """Tasks of about CHUNK bytes of items, across document and file boundaries."""
        self.raw, self.items, self.size = None, [], 0
        if self.dataset == data.EMBEDDED:
            for blob in (d.encode("utf-8") for d in data.embedded_documents()):
                cut, _ = pieces(blob, final=True)
                for k, piece in enumerate(cut):
                    yield from self._add(("text", "pydoc", self.doc, k, piece, k == len(cut) - 1))
                self.doc += 1
        for f in self.files:
            kind, zipped = kind_of(f)
            with open(f, "rb") as self.raw:
                stream = gzip.GzipFile(fileobj=self.raw) if zipped else self.raw
                base = self.done_bytes
                try:
                    yield from (self._jsonl if kind == "jsonl" else self._text_file)(str(f), stream)
                except (OSError, EOFError) as e:   # a corrupt .gz: say so, keep what was read
                    self.skipped.append(f"{f} ({type(e).__name__}: {e})")
            self.done_bytes = base + f.stat().st_size
        if self.items:
            yield self.opts, self.items

    def _add(self, item):
        """Add an item; yields a full task when there is one."""
        self.items.append(item)
        self.size += len(item[4])
        self.item_bytes += len(item[4])
        if self.size >= CHUNK:
            yield self.opts, self.items
            self.items, self.size = [], 0

    def _text_file(self, f, stream):
        head = stream.read(8192)
        if b"\0" in head:
            self.skipped.append(f"{f} (binary)")
            return
        k, buf, held = 0, head, None
        while True:
            block = stream.read(CHUNK)
            cut, buf = pieces(buf + block, final=not block)
            for piece in cut:   # hold one piece back: only the end of the file says which is last
                if held is not None:
                    yield from self._add(("text", f, self.doc, k, held, False))
                    k += 1
                held = piece
            if not block:
                break
        if held is not None:
            yield from self._add(("text", f, self.doc, k, held, True))
        self.doc += 1

    def _jsonl(self, f, stream):
        for line_no, line in enumerate(stream, 1):
            if line.strip():
                yield from self._add(("jsonl", f, self.doc, line_no, line, None))
                self.doc += 1


def _results(tasks, tokenizer, num_proc):
    """tokenize() of every task, in order; at most 2·num_proc tasks in flight (bounded memory)."""
    if num_proc <= 1:
        _init_worker(tokenizer)
        yield from map(tokenize, tasks)
        return
    import multiprocessing as mp
    with mp.get_context("spawn").Pool(num_proc, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        flying = deque()
        for task in tasks:
            flying.append(pool.apply_async(tokenize, (task,)))
            if len(flying) >= 2 * num_proc:
                yield flying.popleft().get()
        while flying:
            yield flying.popleft().get()


# ------------------------------------------------------------------------ preparing, once

def fingerprint(dataset, fraction, field):
    """Changes when the source (names, sizes, modification times) or the preparation's options do."""
    h = hashlib.sha1(f"{FORMAT}\0{fraction}\0{field}\0".encode())
    if dataset == data.EMBEDDED:
        h.update(sys.version.encode())
    else:
        for f in data.source_files(dataset):
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
                log(f"data: {out / (split + '.bin')} has {size} bytes, meta.json says {want}: preparing again")
                (out / "meta.json").unlink()
            return None
    return meta


def prepare(dataset, tokenizer, data_dir, num_proc=0, val_fraction=0.1, text_field="text", log=print):
    """Tokenise `dataset` into <data_dir>/<name>-<tokenizer>/ unless already prepared; return the folder."""
    data.check_prepare_options(dataset, data_dir, num_proc, val_fraction)
    out = data.prepared_dir(dataset, tokenizer, data_dir)
    fp = fingerprint(dataset, val_fraction, text_field)
    if ready(out, fp):
        return out
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "prepare.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # a second process waits here, then finds the files ready
        if ready(out, fp, log):
            return out
        if (out / "meta.json").exists():
            log(f"data: {dataset} or the preparation's options changed since it was prepared, preparing again")
        (out / "meta.json").unlink(missing_ok=True)   # meta.json goes first and comes back last
        for stale in out.glob("*.tmp"):   # left by a preparation that was killed: never read, removed
            stale.unlink()
        enc = data.get_tokenizer(tokenizer)
        tmp = {s: out / f"{s}.bin.{os.getpid()}.tmp" for s in ("train", "val")}
        try:
            workers = num_proc or len(os.sched_getaffinity(0))   # 0: every CPU this process may use
            meta = _write(dataset, tokenizer, out, tmp, workers, val_fraction, text_field, enc, log)
        finally:
            for t in tmp.values():
                t.unlink(missing_ok=True)
        meta.update(source=str(dataset), tokenizer=tokenizer, vocab_size=enc.n_vocab, fingerprint=fp,
                    val_fraction=val_fraction, text_field=text_field)
        (out / "meta.json.tmp").write_text(json.dumps(meta, indent=1))
        os.replace(out / "meta.json.tmp", out / "meta.json")
    return out


def prepare_once(dataset, tokenizer, data_dir, num_proc, val_fraction, text_field, log=print):
    """prepare() on global rank 0; the other ranks wait for its published meta.json (no collective, so
    no process-group timeout: call this before the process group starts)."""
    if int(os.environ.get("RANK", "0")) == 0:
        return prepare(dataset, tokenizer, data_dir, num_proc, val_fraction, text_field, log)
    out, fp = data.prepared_dir(dataset, tokenizer, data_dir), fingerprint(dataset, val_fraction, text_field)
    while not ready(out, fp):
        time.sleep(0.5)
    return out


def _write(dataset, tokenizer, out, tmp, num_proc, fraction, field, enc, log):
    """Stream the corpus through the workers into the temporary split files, then publish them."""
    reader, t0, last = Reader(dataset, fraction, field), time.time(), time.time()
    n = {"train": 0, "val": 0, "train_units": 0, "val_units": 0, "docs": 0, "bad_bytes": 0, "bad_lines": 0}
    first, bad_files = {}, set()
    with open(tmp["train"], "wb") as f_train, open(tmp["val"], "wb") as f_val:
        for train, val, stats in _results(reader.tasks(), tokenizer, num_proc):
            train.tofile(f_train)
            val.tofile(f_val)
            n["train"], n["val"] = n["train"] + len(train), n["val"] + len(val)
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
                log(f"data: {done / 1e9:.2f}/{reader.total_bytes / 1e9:.2f} GB read, {n['docs']:,} documents, "
                    f"{n['train'] + n['val']:,} tokens, {rate / 1e6:.1f} MB/s, "
                    f"eta {(reader.total_bytes - done) / max(rate, 1):.0f} s")
    if n["train"] == 0 or n["val"] == 0:
        unit = f"pieces of up to {PIECE // 1024} KiB" if reader.opts[2] else "documents"
        where = f"{dataset}" + (f" ({'; '.join(reader.skipped)} skipped)" if reader.skipped else "")
        raise ValueError(f"{where} is too small to split: {n['docs']} documents, {n['train'] + n['val']} tokens; "
                         f"{n['train_units']} {unit} drew train and {n['val_units']} val (val_fraction {fraction})")
    for split in ("train", "val"):
        os.replace(tmp[split], out / f"{split}.bin")
    seconds = time.time() - t0
    mb = (reader.total_bytes or reader.item_bytes) / 1e6
    notes = [f"{len(reader.skipped)} file(s) skipped (first: {reader.skipped[0]})"] if reader.skipped else []
    if n["bad_bytes"]:
        notes.append(f"{n['bad_bytes']:,} invalid UTF-8 bytes replaced in {len(bad_files)} file(s) (first: {first['bytes']})")
    if n["bad_lines"]:
        notes.append(f"{n['bad_lines']:,} malformed JSON lines skipped (first: {first['line']})")
    log(f"data: prepared {dataset} with {tokenizer} in {seconds:.1f} s ({mb / seconds:.1f} MB/s, {num_proc} "
        f"process{'es' if num_proc > 1 else ''}): {n['docs']:,} documents, {n['train']:,} train and {n['val']:,} "
        f"val tokens, in {out}" + "".join(f"; {x}" for x in notes))
    return {"dtype": np.dtype(token_dtype(enc.n_vocab)).name, "train_tokens": n["train"], "val_tokens": n["val"], "documents": n["docs"],
            "train_units": n["train_units"], "val_units": n["val_units"], "split_by": "piece" if reader.opts[2] else
            "document", "skipped_files": reader.skipped,
            "invalid_utf8_bytes": n["bad_bytes"], "malformed_json_lines": n["bad_lines"], "seconds": seconds}


def main(argv):
    parser = data.OneLineParser(prog="prepare.py", description="Tokenise a corpus into <data_dir>/<name>-<tokenizer>/ "
                                "(train.py does this on first use; the option names are train.py's).")
    parser.add_argument("--dataset", required=True, help="a text, .jsonl or .gz file, or a folder of them, or 'pydoc'")
    parser.add_argument("--tokenizer", default="bytes", choices=data.TOKENIZERS)
    parser.add_argument("--data_dir", default="data")
    parser.add_argument("--num_proc", type=int, default=0, help="worker processes (default: every CPU)")
    parser.add_argument("--val_fraction", type=float, default=0.1)
    parser.add_argument("--text_field", default="text", help="the field of a JSON line that holds its text")
    args = parser.parse_args(argv)
    try:
        folder = prepare(args.dataset, args.tokenizer, args.data_dir, args.num_proc, args.val_fraction,
                         args.text_field)
    except ValueError as e:
        parser.error(str(e))
    print(f"data: ready in {folder}")


if __name__ == "__main__":
    main(sys.argv[1:])
