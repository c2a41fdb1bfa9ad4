"""data.py: tokenisers, the corpus's files, and deterministic per-rank batches from token files.

Not part of the BOOST paper (arXiv 2512.12131) itself; it is what makes every layout comparable:
the global batch of a step is a function of (seed, step) alone, so a data-parallel or
tensor-parallel run sees exactly the sequences a single process sees, and a resumed run sees
exactly what an uninterrupted one would.

Prepared corpora (prepare.py makes them) live in <data_dir>/<name>-<tokenizer>/ as train.bin and
val.bin (memmapped integers, nanoGPT style) and meta.json (tokeniser, vocabulary size, token
counts, source fingerprint).
"""
import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import tiktoken

TOKENIZERS = ("bytes", "gpt2")
EOT = "<|endoftext|>"
# GPT-2's pre-tokenisation pattern; it only splits text into pieces, the ranks do the rest.
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EMBEDDED = "pydoc"  # Python's own help text, shipped with every CPython: the default corpus


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


def source_files(path):
    """The files of a dataset path, sorted; hidden files and folders are skipped."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"dataset path {path} does not exist")
    if p.is_file():
        return [p]
    return sorted(f for f in p.rglob("*") if f.is_file()
                  and not any(part.startswith(".") for part in f.relative_to(p).parts))


def embedded_documents():
    """The default corpus: Python's help topics, one document each."""
    from pydoc_data.topics import topics
    return [topics[k] for k in sorted(topics)]


def prepared_dir(dataset, tokenizer, data_dir):
    name = EMBEDDED if dataset == EMBEDDED else \
        f"{Path(dataset).name}-{hashlib.sha1(str(Path(dataset).resolve()).encode()).hexdigest()[:8]}"
    return Path(data_dir) / f"{name}-{tokenizer}"


def check_prepare_options(dataset, data_dir, num_proc, val_fraction):
    """ValueError naming the option where a preparation option is out of range."""
    if dataset != EMBEDDED and not os.path.exists(dataset):
        raise ValueError(f"dataset path {dataset} does not exist")
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise ValueError(f"data_dir={data_dir} is a file, not a folder")
    if num_proc < 0:
        raise ValueError(f"num_proc={num_proc} must not be negative (0: every CPU)")
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be above 0 and below 1")


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one `error:` line and exit status 2 (for prepare.py, train_state.py)."""

    def error(self, message):
        print(f"error: {message} (-h for help)", file=sys.stderr)
        sys.exit(2)


class TokenFile:
    """One split of a prepared corpus, memmapped, with deterministic batch drawing."""

    STREAMS = {"train": 0, "eval-train": 1, "eval-val": 2}

    def __init__(self, folder, split, block_size):
        meta = json.loads((Path(folder) / "meta.json").read_text())
        self.data = np.memmap(Path(folder) / f"{split}.bin", dtype=meta["dtype"], mode="r")
        self.block_size = block_size
        if len(self.data) <= block_size:
            raise ValueError(f"the {split} split of {meta['source']} has {len(self.data)} tokens "
                             f"(train {meta['train_tokens']}, val {meta['val_tokens']}), fewer than block_size+1="
                             f"{block_size + 1}: use a longer corpus, a smaller --block_size or another --val_fraction")

    def batch(self, seed, stream, step, global_batch, start, count):
        """Sequences [start, start+count) of the global batch drawn for (seed, stream, step).

        Returns x, y (count, block_size) int64, y shifted by one token."""
        rng = np.random.default_rng([seed, self.STREAMS[stream], step])
        ix = rng.integers(0, len(self.data) - self.block_size, size=global_batch)[start:start + count]
        import torch  # here, not on top: prepare.py's worker processes import this file and need no torch
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
