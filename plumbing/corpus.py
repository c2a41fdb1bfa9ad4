"""corpus.py: the files of a corpus, read as a stream of tasks for preparation.py's workers.

Not part of the BOOST paper (arXiv 2512.12131); what a pretraining corpus looks like on disk. A
dataset is a file or a folder (recursive, sorted, hidden files skipped) of text files (one document
each; any name but the ones below), JSON Lines (`.jsonl`, `.json`: one document per line, its text
in the `text_field` the workers read), the gzip- or zstd-compressed form of either (`.gz`, `.zst`:
C4's .json.gz, The Pile's and SlimPajama's .jsonl.zst, streamed), and Parquet (`.parquet`: FineWeb,
DCLM; one document per row, its text in the `text_field` column, decoded PARQUET_ROWS rows at a
time; pyarrow reads a row group's column whole, so memory is a few times the largest row group's;
pyarrow needs it; zstandard reads .zst). Documents
are read one at a time and cut into pieces of about PIECE bytes at line ends, and pieces are handed
out in tasks of about CHUNK bytes across document and file boundaries, so memory does not grow with
the corpus or with a document. Binary files (a NUL byte in the first 8 KiB) and unreadable files
are skipped and named; a compressed or Parquet file that breaks off (truncated, corrupt) keeps the
documents read before the damage and is named as damaged; rows whose text is missing or not a
string are counted.
"""
import gzip
import io
from pathlib import Path

from plumbing import data

PIECE = 16 << 10             # bytes: documents are cut at the first line end past this many bytes
LONGEST = 4 * PIECE          # bytes: a piece with no line end in it is cut here
CHUNK = 1 << 20              # bytes of text per task sent to a worker
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_ROWS = 256           # rows of a .parquet file decoded at a time (a row group can hold GBs)


def kind_of(path):
    """'parquet', 'jsonl' or 'text', and the compression ('gz', 'zst' or None), from the file
    name."""
    name, packed = path.name, None
    for suffix in (".gz", ".zst"):
        if name.endswith(suffix):
            name, packed = name[:-len(suffix)], suffix[1:]
    if name.endswith(".parquet"):
        return "parquet", packed
    return ("jsonl" if name.endswith(JSON_SUFFIXES) else "text"), packed


def check_packages(files):
    """A one-line ValueError naming the package a corpus's formats need and this Python lacks."""
    from plumbing.tokenizer import need
    kinds = {kind_of(f) for f in files}
    if any(kind == "parquet" for kind, _ in kinds):
        need("pyarrow", "reading the corpus's .parquet files")
    if any(packed == "zst" for _, packed in kinds):
        need("zstandard", "reading the corpus's .zst files")


def damaged_errors():
    """What reading a damaged file raises: OSError, EOFError (gzip), ValueError (pyarrow's
    ArrowInvalid) and zstandard's ZstdError where it is installed."""
    try:
        import zstandard
        return OSError, EOFError, ValueError, zstandard.ZstdError
    except ImportError:
        return OSError, EOFError, ValueError


def open_stream(raw, packed):
    """The decompressed bytes of an open file, streamed (a truncated .gz or .zst raises EOFError
    where it ends)."""
    if packed == "gz":
        return gzip.GzipFile(fileobj=raw)
    if packed == "zst":
        return io.BufferedReader(Zstd(raw))
    return raw


class Zstd(io.RawIOBase):
    """A .zst file's frames decompressed one after another, ZSTD_IN bytes of input at a time;
    EOFError where the file ends inside a frame (zstandard's stream_reader ends there silently)."""
    ZSTD_IN = 8 << 10

    def __init__(self, raw):
        import zstandard
        self.raw, self.make = raw, zstandard.ZstdDecompressor().decompressobj
        self.frame, self.out, self.pos, self.open = self.make(), b"", 0, False   # open: in a frame

    def readable(self):
        return True

    def readinto(self, buffer):
        while self.pos == len(self.out):
            self.out, self.pos = b"", 0
            chunk = self.raw.read(self.ZSTD_IN)
            if not chunk:
                if self.open:
                    raise EOFError("the file ends inside a zstd frame (truncated)")
                return 0
            while chunk:
                if self.frame.eof:   # the previous frame ended: the rest starts the next one
                    self.frame = self.make()
                self.out += self.frame.decompress(chunk)
                chunk = self.frame.unused_data if self.frame.eof else b""
                self.open = not self.frame.eof
        n = min(len(buffer), len(self.out) - self.pos)
        buffer[:n] = memoryview(self.out)[self.pos:self.pos + n]
        self.pos += n
        return n


def pieces(buf, final):
    """Cut bytes into pieces that end at the first b'\\n' at or past PIECE bytes from their start,
    or, where no line ends before LONGEST bytes, at the last UTF-8 character boundary there:
    (complete pieces, the rest). Feeding the rest back with more bytes gives the same cuts, and no
    piece, so no buffer, grows with the length of a line."""
    out, start = [], 0
    while True:
        nl = buf.find(b"\n", start + PIECE - 1, start + LONGEST)
        if nl >= 0:
            end = nl + 1
        elif len(buf) - start > LONGEST:
            end = start + LONGEST
            while buf[end] & 0xC0 == 0x80:   # a continuation byte: the cut would split a character
                end -= 1
        else:
            break
        out.append(buf[start:end])
        start = end
    rest = buf[start:]
    if final and rest:
        out, rest = out + [rest], b""
    return out, rest


def source_files(path):
    """The files of a dataset path, sorted; hidden files and folders are skipped."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"dataset path {path} does not exist")
    if p.is_file():
        return [p]
    return sorted(f for f in p.rglob("*") if f.is_file()
                  and not any(part.startswith(".") for part in f.relative_to(p).parts))


class Reader:
    """Streams the corpus as tasks of about CHUNK bytes, counting bytes read for progress."""

    def __init__(self, dataset, options):
        self.files = [] if dataset == data.EMBEDDED else source_files(dataset)
        # no documents to split by
        by_piece = len(self.files) == 1 and kind_of(self.files[0])[0] == "text"
        self.dataset, self.opts, self.done_bytes, self.doc = dataset, (*options, by_piece), 0, 0
        self.total_bytes = sum(f.stat().st_size for f in self.files)
        # bytes handed to the workers (the embedded corpus has no files to count)
        self.item_bytes = 0
        self.skipped = []   # binary and unreadable files, named in the summary
        self.damaged = []   # files that broke off after some documents (those are kept), likewise

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
        if self.dataset == data.EMBEDDED:   # Python's help topics, one document each
            from pydoc_data.topics import topics
            for blob in (topics[k].encode("utf-8") for k in sorted(topics)):
                cut, _ = pieces(blob, final=True)
                for k, piece in enumerate(cut):
                    yield from self._add(("text", "pydoc", self.doc, k, piece, k == len(cut) - 1))
                self.doc += 1
        for f in self.files:
            kind, packed = kind_of(f)
            with open(f, "rb") as self.raw:
                base, used = self.done_bytes, self.item_bytes
                try:
                    if kind == "parquet":
                        yield from self._parquet(f)
                    else:
                        yield from (self._jsonl if kind == "jsonl"
                                    else self._text_file)(str(f), open_stream(self.raw, packed))
                # a corrupt .gz, .zst or .parquet: say so, keep what was read
                except damaged_errors() as e:
                    why = f"{f} ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})"
                    used_some = self.item_bytes > used   # (what was used is kept)
                    (self.damaged if used_some else self.skipped).append(why)
            self.done_bytes = base + f.stat().st_size
        if self.items:
            yield self.opts, self.items

    def _add(self, item):
        """Add an item; yields a full task when there is one."""
        self.items.append(item)
        self.size += len(item[4] or b"")
        self.item_bytes += len(item[4] or b"")
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

    def _parquet(self, f):
        """PARQUET_ROWS rows at a time, whatever the row groups' size (bounded memory); each row's
        text is an item the workers cut."""
        import pyarrow.parquet as pq
        table = pq.ParquetFile(self.raw)   # (read through self.raw: progress counts its bytes)
        field = self.opts[1]
        if field not in table.schema_arrow.names:
            names = ", ".join(table.schema_arrow.names[:8])
            self.skipped.append(f"{f} (no column {field!r}; its columns: {names})")
            return
        row = 0
        # within a row group too
        for batch in table.iter_batches(batch_size=PARQUET_ROWS, columns=[field]):
            for text in batch.column(0).to_pylist():
                row += 1
                blob = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else None
                held = None if text is None or blob is not None else type(text).__name__
                yield from self._add(("row", str(f), self.doc, row, blob, held))
                self.doc += 1

    def _jsonl(self, f, stream):
        for line_no, line in enumerate(stream, 1):
            if line.strip():
                yield from self._add(("jsonl", f, self.doc, line_no, line, None))
                self.doc += 1
