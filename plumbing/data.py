"""data.py: token files and deterministic per-rank batches: what training reads.

Not part of the BOOST paper (arXiv 2512.12131) itself; it is what makes every layout comparable:
the global batch of a step is a function of (seed, step) alone, so a data-parallel or
tensor-parallel run sees exactly the sequences a single process sees, and a resumed run sees
exactly what an uninterrupted one would.

This file holds what training reads: the token files of a prepared corpus,
<data_dir>/<name>-<tokenizer>/train.bin and val.bin (memmapped integers, nanoGPT style) beside
meta.json (tokeniser, vocabulary size, token counts, checksums, source fingerprint). Everything
that turns a corpus's files into token files is preparation.py (and corpus.py). This file imports
no torch at import time, so preparation.py's workers stay small; hence the one helper the commands
beside train.py share lives here too: CommandParser, argparse with train.py's one-line errors.
"""
import argparse
import json
import os
import sys
import zlib
from pathlib import Path

import numpy as np

# the default corpus: Python's own help text, shipped with every CPython (preparation.py)
EMBEDDED = "pydoc"


def crc32(path, chunk=16 << 20):
    """CRC-32 of a file, streamed (about 2 GB/s on one core)."""
    value = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            value = zlib.crc32(block, value)
    return f"{value:08x}"


class TokenFile:
    """One split of a prepared corpus, memmapped, with deterministic batch drawing."""

    STREAMS = {"train": 0, "eval-train": 1, "eval-val": 2}

    def __init__(self, folder, split, block_size, vocab_size=None):
        meta = json.loads((Path(folder) / "meta.json").read_text())
        # an IndexError at step 0 otherwise
        if vocab_size is not None and meta["max_id"] >= vocab_size:
            raise ValueError(f"{folder} holds token ids up to {meta['max_id']}, the model's "
                             f"vocabulary has {vocab_size}: prepare the corpus with this run's "
                             "--tokenizer")
        self.data = np.memmap(Path(folder) / f"{split}.bin", dtype=meta["dtype"], mode="r")
        self.block_size, self.source = block_size, meta["source"]
        # what was prepared, by content: a checkpoint records it, a resume compares it
        self.corpus_id = f"{meta['train_crc32']}-{meta['val_crc32']}"
        if len(self.data) <= block_size:
            raise ValueError(f"the {split} split of {meta['source']} has {len(self.data)} tokens "
                             f"(train {meta['train_tokens']}, val {meta['val_tokens']}), fewer "
                             f"than block_size+1={block_size + 1}: use a longer corpus, a smaller "
                             "--block_size or another --val_fraction")

    def batch(self, seed, stream, step, global_batch, start, count):
        """Sequences [start, start+count) of the global batch drawn for (seed, stream, step).

        Returns x, y (count, block_size) int64, y shifted by one token."""
        rng = np.random.default_rng([seed, self.STREAMS[stream], step])
        ix = rng.integers(0, len(self.data) - self.block_size,
                          size=global_batch)[start:start + count]
        # here, not on top: preparation.py's worker processes import this file and need no torch
        import torch
        x = np.stack([self.data[i:i + self.block_size] for i in ix]).astype(np.int64)
        y = np.stack([self.data[i + 1:i + 1 + self.block_size] for i in ix]).astype(np.int64)
        return torch.from_numpy(x), torch.from_numpy(y)  # (count, s), (count, s)


def check_resumed_corpus(path, meta, split, named, log):
    """A resume trains on the corpus its checkpoint (`path`, `meta`) recorded: a launch that
    prepared another (`split`: its TokenFile) is refused, unless it names --dataset again (`named`),
    then it is said. Checkpoints from before corpus_id compare nothing."""
    theirs = meta.get("corpus_id")
    if theirs is None or theirs == split.corpus_id:
        return
    what = (f"checkpoint {path} was trained on {meta['train_config'].get('dataset')} (token "
            f"files {theirs}); this launch prepared {split.source} ({split.corpus_id})")
    if not named:
        raise ValueError(f"{what}: pass --dataset= the recorded corpus (a path recorded relative "
                         "is read from this working directory), or name this one to train on it")
    log(f"resume: {what}, as named by --dataset")


def unigram_entropy(folder, split="train"):
    """Entropy (nats/token) of the token frequencies: the loss of the best context-free model."""
    meta = json.loads((Path(folder) / "meta.json").read_text())
    data = np.memmap(Path(folder) / f"{split}.bin", dtype=meta["dtype"], mode="r")
    p = np.bincount(data).astype(np.float64)
    p = p[p > 0] / len(data)
    return float(-(p * np.log(p)).sum())


class CommandParser(argparse.ArgumentParser):
    """argparse for the commands beside train.py (prepare.py, interchange.py): an error is one
    `error:` line and exit status 2, as train.py's."""

    def error(self, message):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {message} (-h for help)", file=sys.stderr)
        if "TORCHELASTIC_ERROR_FILE" in os.environ:   # (torchrun's summary ends with it)
            from plumbing import rundir
            rundir.tell_torchrun(f"error: {message}")
        sys.exit(2)


def new_path(text):
    """An argument type: a path to create, in a folder that exists."""
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"the folder {parent} of {text} does not exist")
    if os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text} exists: remove it or choose another name")
    return text


def positive_float(text):
    """An argument type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expects a number above 0, got {text!r}")
    return value


def positive_int(text):
    """An argument type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
