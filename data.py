"""data.py: tokenisers, corpus preparation to token files, and deterministic per-rank batches.

Not part of the BOOST paper (arXiv 2512.12131) itself; it is what makes every layout comparable:
the global batch of a step is a function of (seed, step) alone, so a data-parallel or
tensor-parallel run sees exactly the sequences a single process sees, and a resumed run sees
exactly what an uninterrupted one would.

Prepared corpora live in <data_dir>/<name>-<tokenizer>/ as train.bin and val.bin (memmapped
integers, nanoGPT style) and meta.json (tokeniser, vocabulary size, token counts, source
fingerprint). They are reused while the source and tokeniser are unchanged.
"""
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import tiktoken
import torch

TOKENIZERS = ("bytes", "gpt2")
EOT = "<|endoftext|>"
# GPT-2's pre-tokenisation pattern; it only splits text into pieces, the ranks do the rest.
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EMBEDDED = "pydoc"  # Python's own help text, shipped with every CPython: the default corpus
VAL_FRACTION = 0.1


def get_tokenizer(name):
    """A tiktoken Encoding: 'bytes' (256 byte values + <|endoftext|>, offline) or 'gpt2'."""
    if name == "bytes":
        ranks = {bytes([i]): i for i in range(256)}
        return tiktoken.Encoding(name="bytes", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                                 special_tokens={EOT: 256})
    if name == "gpt2":
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:  # network or cache failure inside tiktoken
            raise ValueError(f"cannot load the GPT-2 vocabulary ({type(e).__name__}); set "
                             "TIKTOKEN_CACHE_DIR to a tiktoken cache or use --tokenizer=bytes") from None
    raise ValueError(f"tokenizer={name!r} is not one of {', '.join(TOKENIZERS)}")


def _source_files(path):
    """The files of a dataset path, sorted; hidden files and folders are skipped."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"dataset path {path} does not exist")
    if p.is_file():
        return [p]
    return sorted(f for f in p.rglob("*") if f.is_file()
                  and not any(part.startswith(".") for part in f.relative_to(p).parts))


def _fingerprint(dataset):
    """Changes when the source text changes (file names, sizes and modification times)."""
    h = hashlib.sha1()
    if dataset == EMBEDDED:
        import sys
        h.update(sys.version.encode())
    else:
        for f in _source_files(dataset):
            st = f.stat()
            h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


def _documents(dataset):
    """The corpus as a list of text documents."""
    if dataset == EMBEDDED:
        from pydoc_data.topics import topics
        return [topics[k] for k in sorted(topics)]
    docs = []
    for f in _source_files(dataset):
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # not a text file
        if text.strip():
            docs.append(text)
    if not docs:
        raise ValueError(f"dataset path {dataset} holds no UTF-8 text")
    return docs


def prepared_dir(dataset, tokenizer, data_dir):
    name = EMBEDDED if dataset == EMBEDDED else \
        f"{Path(dataset).name}-{hashlib.sha1(str(Path(dataset).resolve()).encode()).hexdigest()[:8]}"
    return Path(data_dir) / f"{name}-{tokenizer}"


def prepare(dataset, tokenizer, data_dir, log=print):
    """Tokenise `dataset` (EMBEDDED, a text file or a folder) unless already prepared; return its dir."""
    out = prepared_dir(dataset, tokenizer, data_dir)
    fingerprint = _fingerprint(dataset)
    meta_path = out / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("fingerprint") == fingerprint and meta.get("tokenizer") == tokenizer:
            return out
        log(f"data: {dataset} changed since it was prepared, preparing again")
    enc = get_tokenizer(tokenizer)
    ids = []
    for doc in _documents(dataset):
        ids.extend(enc.encode_ordinary(doc))
        ids.append(enc.eot_token)
    dtype = np.uint16 if enc.n_vocab <= 2 ** 16 else np.uint32
    ids = np.array(ids, dtype=dtype)
    n_val = int(len(ids) * VAL_FRACTION)
    out.mkdir(parents=True, exist_ok=True)
    meta_path.unlink(missing_ok=True)  # meta.json last: a half-written preparation is never reused
    for split, part in (("train", ids[:len(ids) - n_val]), ("val", ids[len(ids) - n_val:])):
        part.tofile(out / f"{split}.bin.tmp")
        os.replace(out / f"{split}.bin.tmp", out / f"{split}.bin")
    meta = {"source": str(dataset), "tokenizer": tokenizer, "vocab_size": enc.n_vocab,
            "dtype": np.dtype(dtype).name, "train_tokens": len(ids) - n_val, "val_tokens": n_val,
            "fingerprint": fingerprint}
    meta_path.write_text(json.dumps(meta, indent=1))
    log(f"data: prepared {dataset} with {tokenizer}: {len(ids) - n_val:,} train and {n_val:,} val tokens in {out}")
    return out


def prepare_once(dataset, tokenizer, data_dir, log=print):
    """prepare() on global rank 0 only, the others waiting; its ValueError is raised on every rank."""
    import torch.distributed as dist
    error = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            prepare(dataset, tokenizer, data_dir, log=log)
        except ValueError as e:
            error = str(e)
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise ValueError(error)
    return prepared_dir(dataset, tokenizer, data_dir)


class TokenFile:
    """One split of a prepared corpus, memmapped, with deterministic batch drawing."""

    STREAMS = {"train": 0, "eval-train": 1, "eval-val": 2}

    def __init__(self, folder, split, block_size):
        meta = json.loads((Path(folder) / "meta.json").read_text())
        self.data = np.memmap(Path(folder) / f"{split}.bin", dtype=meta["dtype"], mode="r")
        self.block_size = block_size
        if len(self.data) <= block_size:
            raise ValueError(f"the {split} split of {meta['source']} has {len(self.data)} tokens, fewer "
                             f"than block_size+1={block_size + 1}: use a longer corpus or a smaller --block_size")

    def batch(self, seed, stream, step, global_batch, start, count):
        """Sequences [start, start+count) of the global batch drawn for (seed, stream, step).

        Returns x, y (count, block_size) int64, y shifted by one token."""
        rng = np.random.default_rng([seed, self.STREAMS[stream], step])
        ix = rng.integers(0, len(self.data) - self.block_size, size=global_batch)[start:start + count]
        x = np.stack([self.data[i:i + self.block_size] for i in ix]).astype(np.int64)
        y = np.stack([self.data[i + 1:i + 1 + self.block_size] for i in ix]).astype(np.int64)
        return torch.from_numpy(x), torch.from_numpy(y)  # (count, s), (count, s)


def unigram_entropy(folder, split="train"):
    """Entropy (nats/token) of the token frequencies: the loss of the best context-free model."""
    meta = json.loads((Path(folder) / "meta.json").read_text())
    data = np.memmap(Path(folder) / f"{split}.bin", dtype=meta["dtype"], mode="r")
    p = np.bincount(data).astype(np.float64)
    p = p[p > 0] / len(data)
    return float(-(p * np.log(p)).sum())
