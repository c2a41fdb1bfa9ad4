"""heldout.py: a checkpoint's held-out loss, perplexity and bits per byte, at any layout.

Not in the BOOST paper (arXiv 2512.12131); the evaluation protocol of the CoLA and GaLore papers it
compares with: the validation loss over a fixed budget of tokens of a corpus, in order, cut into
non-overlapping sequences of the model's block_size (each predicts its next token at every
position), the mean over every predicted token. `python interchange.py eval` runs it; under
torchrun the model is built and loaded as train.py builds it (--tp, --layout; the data-parallel
ranks take every dp-th sequence), so every layout gives one process's numbers.

    loss = mean over tokens of -log p(token)         (nats)
    perplexity = exp(loss)
    bits per byte = Σ -log2 p(token) / the UTF-8 bytes those tokens decode to
"""
import math
import os
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from plumbing import preparation
from plumbing import options, placement, train_state
from plumbing.data import TokenFile
from plumbing.plan import make as make_plan
from plumbing.tokenizer import load as load_tokenizer


def sequences(folder, split, tokens, block_size, vocab_size):
    """The first `tokens` predicted tokens of a prepared split as n sequences of block_size + 1
    tokens (n, s + 1), consecutive and not overlapping: ValueError if the split holds fewer, or
    token ids past the model's vocabulary (its meta.json's max_id)."""
    data = TokenFile(folder, split, block_size, vocab_size).data
    n = tokens // block_size
    if n < 1:
        raise ValueError(f"--tokens={tokens} is less than one sequence of block_size {block_size}: "
                         f"pass --tokens={block_size} or more")
    if n * block_size + 1 > len(data):
        raise ValueError(f"--tokens={tokens}: the {split} split holds {len(data):,} tokens, and "
                         f"{n} sequences of block_size {block_size} (and the last one's "
                         f"next token) need {n * block_size + 1:,}")
    return np.stack([data[i * block_size:(i + 1) * block_size + 1] for i in range(n)])


def run(args, log):
    """interchange.py eval: {loss, perplexity, bits_per_byte, tokens, bytes}, printed by rank 0."""
    cfg, meta = train_state.verified(args.checkpoint)
    held = meta.get("train_config", {}).get("val_fraction", 0.1)   # (what the run held out)
    if args.val_fraction is None:
        args.val_fraction = held
    elif args.val_fraction != held and args.split == "val":
        log(f"note: --val_fraction={args.val_fraction}, where the run held out {held}: this val "
            f"split holds documents the run trained on (leave it out to evaluate on the run's)")
    preparation.check_preparation(args.dataset, args.data_dir, 0, args.val_fraction)
    tokenizer = meta.get("tokenizer", "bytes")
    # (gone or changed: one line; eval reads the recorded path, it has no --tokenizer)
    train_state.check_tokenizer(args.checkpoint, meta, tokenizer, passable=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tc = replace(options.TrainConfig(), tp=args.tp, layout=args.layout, device=args.device,
                 dtype=args.dtype, tokenizer=tokenizer, gradient_accumulation_steps=world)
    plan = make_plan(cfg, tc, world)
    folder = preparation.prepare_once(args.dataset, tokenizer, args.data_dir, tc.num_proc,
                                  args.val_fraction, args.text_field, log)
    seqs = sequences(folder, args.split, args.tokens, cfg.block_size, cfg.vocab_size)  # (n, s+1)
    place = placement.place_processes(plan)
    model = placement.build_model(plan, place, init=False)[0]   # (the checkpoint's values)
    error = train_state.load(args.checkpoint, meta, model, None, place.ckpt_mesh)
    if error:
        raise ValueError(f"checkpoint {args.checkpoint}: {error}")
    total = mean_loss_sum(model, plan, place, seqs, args.batch_size)
    enc = load_tokenizer(tokenizer)
    # the predicted tokens are one stretch of the corpus (each sequence's targets follow the last's)
    n_bytes = len(enc.decode([t for t in seqs[:, 1:].reshape(-1).tolist()
                              if t < enc.n_vocab]).encode())
    n_tokens = seqs.shape[0] * cfg.block_size
    out = {"loss": total / n_tokens, "tokens": n_tokens, "bytes": n_bytes,
           "bits_per_byte": total / math.log(2) / max(1, n_bytes)}
    out["perplexity"] = math.exp(out["loss"])
    log(f"eval {args.checkpoint}: {n_tokens:,} tokens of the {args.split} split of {args.dataset}"
        f" ({seqs.shape[0]} sequences of {cfg.block_size}), {n_bytes:,} bytes: loss "
        f"{out['loss']:.4f}, perplexity {out['perplexity']:.3f}, bits per byte "
        f"{out['bits_per_byte']:.4f}")
    placement.finish(plan.world)
    return out


@torch.no_grad()
def mean_loss_sum(model, plan, place, seqs, batch_size):
    """Σ over every predicted token of -log p, in fp64: this dp rank's share of the sequences
    (every dp-th), summed over the data-parallel ranks."""
    model.eval()
    autocast = torch.autocast(place.device.split(":")[0], dtype=getattr(torch, plan.dtype),
                              enabled=plan.dtype != "float32")
    mine = seqs[place.dp_rank::place.dp]
    total = torch.zeros((), dtype=torch.float64, device=place.device)
    for i in range(0, len(mine), batch_size):
        batch = torch.from_numpy(mine[i:i + batch_size].astype(np.int64)).to(place.device)
        x, y = batch[:, :-1], batch[:, 1:]                                 # (b, s), (b, s)
        with autocast:
            loss = model(x, y)[1]                                          # the batch's mean
        total += loss.double() * y.numel()
    if place.dp > 1:
        dist.all_reduce(total, group=place.group("dp"))
    return total.item()
