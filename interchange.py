"""interchange.py: this project's models in the formats other tools read, and back: export,
import, sample, and a checkpoint's held-out evaluation.

Not in the BOOST paper (arXiv 2512.12131); what lets a model trained with BTP be evaluated (and a
CoLA model trained elsewhere be trained on with BTP). The formats, hf (Hugging Face: transformers'
Llama, or the folder's own code for cola, LaX and svd) and cola (the official CoLA code's), are
plumbing/formats.py; eval is plumbing/heldout.py.

The commands (a checkpoint is a folder <out_dir>/checkpoints/iter_NNNNNNN,
plumbing/train_state.py's):

    python interchange.py export out/checkpoints/iter_0002000 model.pt   # one unsharded file
    python interchange.py export out/checkpoints/iter_0002000 hf_model --format=hf   # or cola
    python interchange.py import hf_model out2   # a checkpoint to continue (--init_from=resume)
    python interchange.py sample model.pt 200    # generate from an exported file
    python interchange.py sample out 200         # or from an out_dir's newest checkpoint
    python interchange.py eval out/checkpoints/iter_0002000 --dataset=path/to/corpus --tokens=100000
                                                 # held-out loss, perplexity, bits per byte

What a format cannot represent, or a folder whose weights do not fit its config.json, is refused
with one line (ValueError).
"""
import argparse
import os
import shutil
import sys
import time
import zlib

import torch

import layouts

from tp_model import TPLlama
import model as llama
import parallel
from plumbing import formats, integrity, rundir, train_state
from plumbing.tokenizer import (identity as tokenizer_identity, in_folder as tokenizer_in,
                                keep as keep_tokenizer, load as load_tokenizer, sample_text)

# ------------------------------------------------------------------------ the commands

def checkpoint_state(path):
    """(model.Config, single-device state dict, tokenizer) of a checkpoint folder, in one process:
    its checksums verified as resume verifies them, its tensors loaded into a model of its
    config."""
    cfg, meta = train_state.verified(path)
    # the template DCP loads into (a tied head is the embedding: stored once)
    model = llama.Llama(cfg)
    state = {"model." + name: p.detach() for name, p in model.named_parameters()}
    error = integrity.dcp_load(state, path, meta["files"], no_dist=True)
    if error:
        raise ValueError(f"checkpoint {path}: {error}")
    state = {k[len("model."):]: v for k, v in state.items()}
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["tok_emb.weight"]
    return cfg, state, meta.get("tokenizer", "bytes")


def export(path, out, fmt="pt"):
    """A checkpoint as one file (pt: torch.save of {'model', 'config', 'tokenizer', 'crc32'}) or as
    a folder another tool reads (hf, cola)."""
    cfg, state, tokenizer = checkpoint_state(path)
    if fmt != "pt":
        return formats.write(out, state, cfg, fmt, tokenizer)
    tmp = f"{out}.{os.getpid()}.tmp"   # (renamed into place when whole)
    try:
        with open(tmp, "wb") as f:   # (a file object: a write's OSError names its cause)
            torch.save({"model": state, "config": cfg.shape(), "tokenizer": tokenizer,
                        "crc32": tensors_crc32(state)}, f)
        os.replace(tmp, out)
    except (OSError, RuntimeError) as e:   # (torch.save's own file errors are RuntimeErrors)
        if os.path.exists(tmp):
            os.remove(tmp)
        raise rundir.cannot_write(out, e) from None


def import_folder(folder, out_dir, tokenizer=None):
    """An hf or cola folder as the iteration-0 training checkpoint of a new run in out_dir, which
    --init_from=resume continues under any layout (fresh AdamW moments). Returns its folder."""
    from plumbing import options
    rundir.check_place(out_dir)
    kw, state, named = formats.read(folder)
    # --tokenizer, else the folder's file, else its name
    tokenizer = tokenizer or tokenizer_in(folder) or named
    if tokenizer is None:
        raise ValueError(f"{folder} does not name its tokenizer: pass --tokenizer")
    if options.vocab_size(tokenizer) != kw["vocab_size"]:
        raise ValueError(f"the model's vocabulary of {kw['vocab_size']} is not the "
                         f"{options.vocab_size(tokenizer)} of --tokenizer={tokenizer} (padded to "
                         "a multiple of 64)")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"{out_dir} is a file: import needs a new or empty out_dir")
    found = rundir.earlier_run(out_dir)
    if found:
        raise ValueError(f"out_dir {out_dir} holds an earlier run ({' and '.join(found)}): import "
                         "into a new or empty out_dir")
    ref = llama.Llama(llama.Config(**kw))
    ref.load_state_dict(state)
    # saved as a tp=1 run holds it: the layout with a TP group of one (the file is layout-free)
    m = TPLlama(ref, parallel.TPGroup(None, 0, 1), layouts.default_layout(ref.cfg))
    before = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else None
    try:
        # a copy in out_dir/tokenizer/ for the runs that continue it
        tokenizer = keep_tokenizer(tokenizer, out_dir)
        meta = {"config": m.cfg.shape(), "tokenizer": tokenizer,
                "tokenizer_id": tokenizer_identity(tokenizer),
                "train_config": {"tokenizer": tokenizer},   # (a resume's; the rest: defaults)
                "run_id": rundir.new_run_id(), "imported_from": folder}
        return train_state.save(out_dir, 0, m, torch.optim.AdamW(m.parameters()), None, meta)[0]
    except (OSError, ValueError) as e:   # a full disk: what this import wrote goes, nothing else
        if before is None:
            shutil.rmtree(out_dir, ignore_errors=True)
        for name in set(os.listdir(out_dir)) - before if before is not None else ():
            path = os.path.join(out_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        raise (e if isinstance(e, ValueError) else rundir.cannot_write(out_dir, e)) from None


def tensors_crc32(state):
    """A CRC-32 over the tensors of a state dict, in name order: an exported file carries its
    own."""
    value = 0
    for name in sorted(state):
        value = zlib.crc32(state[name].detach().contiguous().view(-1).view(torch.uint8).numpy(),
                           value)
    return f"{value:08x}"


def load_exported(out_file):
    """A model.Llama from an exported file, its tensors checked against the checksum it carries."""
    blob = torch.load(out_file, weights_only=True)
    if tensors_crc32(blob["model"]) != blob["crc32"]:
        raise ValueError(f"{out_file} fails its checksum (damaged since it was exported)")
    m = llama.Llama(llama.Config(**blob["config"]))
    m.load_state_dict(blob["model"])
    return m, blob["tokenizer"]


def _checkpoint_folder(text):
    if os.path.isdir(os.path.join(text, "checkpoints")):
        found = train_state.checkpoint_dirs(text)
        hint = f": pass one of its checkpoints, e.g. {found[-1]}" if found else \
            " and holds no complete checkpoint"
        raise argparse.ArgumentTypeError(f"{text} is an out_dir, not a checkpoint{hint}")
    if not os.path.isfile(os.path.join(text, "meta.json")):
        raise argparse.ArgumentTypeError(f"{text} is not a checkpoint folder (no "
                                         f"{os.path.join(text, 'meta.json')})")
    return text


def _model_source(text):
    """What sample reads: an exported file, a checkpoint folder, or an out_dir (its newest
    complete checkpoint, as nanoGPT's sample.py reads its out_dir)."""
    if os.path.isdir(os.path.join(text, "checkpoints")):
        found = train_state.checkpoint_dirs(text)
        if not found:
            raise argparse.ArgumentTypeError(f"{text} holds no complete checkpoint")
        return found[-1]
    if os.path.isdir(text):
        return _checkpoint_folder(text)
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text} is not an exported file, a checkpoint folder "
                                         "or an out_dir")
    return text


def load_for_sampling(source):
    """(model.Llama, tokenizer) of what _model_source chose."""
    if not os.path.isdir(source):
        return load_exported(source)
    cfg, state, tokenizer = checkpoint_state(source)
    m = llama.Llama(cfg)
    m.load_state_dict(state)
    return m, tokenizer


def parser_of():
    """The commands' argument parser (one-line errors, exit status 2: plumbing/data.py's)."""
    from plumbing import data
    parser = data.CommandParser(prog="interchange.py",
                                description="Export a training checkpoint (one file, or a folder "
                                "other tools read), import such a folder as a checkpoint, or "
                                "sample.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("export", help="write a checkpoint as one file (pt) or a Hugging Face / "
                       "CoLA folder")
    p.add_argument("checkpoint", type=_checkpoint_folder,
                   help="a folder <out_dir>/checkpoints/iter_NNNNNNN")
    p.add_argument("out", type=data.new_path,
                   help="the file (pt) or folder (hf, cola) to write; must not exist")
    p.add_argument("--format", default="pt", choices=("pt",) + formats.FORMATS,
                   help="pt: one torch.save file; hf: Hugging Face (transformers' Llama for full "
                   "and SwiGLU svd, merged W = B·A; cola, LaX and other svd with the folder's own "
                   "code: trust_remote_code=True); cola: the official CoLA format (cola models)")
    p = sub.add_parser("import",
                       help="an hf or cola folder as the training checkpoint of a new run")
    p.add_argument("folder", help="a folder with config.json and model.safetensors (or "
                   "pytorch_model.bin)")
    p.add_argument("out_dir", help="the new run's out_dir; continue with train.py "
                   "--init_from=resume")
    p.add_argument("--tokenizer", help="default: the folder's tokenizer file, else the one "
                   "config.json names")
    add_eval(sub, data)
    p = sub.add_parser("sample", help="generate text from an exported file, a checkpoint folder "
                       "or an out_dir (its newest checkpoint)")
    p.add_argument("model_file", type=_model_source)
    p.add_argument("tokens", type=data.positive_int, nargs="?", default=200,
                   help="tokens to generate (default 200)")
    p.add_argument("--prompt", default="", help="the text to continue (default: a new document)")
    p.add_argument("--temperature", type=data.positive_float, default=0.8,
                   help="above 0 (default 0.8)")
    p.add_argument("--top_k", type=int, default=50,
                   help="sample from the k likeliest tokens; 0: from all (default 50)")
    p.add_argument("--seed", type=int, default=1337, help="of the sampling (default 1337)")
    return parser


def add_eval(sub, data):
    """The eval command's arguments (plumbing/heldout.py: the CoLA and GaLore papers' protocol)."""
    p = sub.add_parser("eval", help="a checkpoint's held-out loss, perplexity and bits per byte "
                       "over a fixed token budget (under torchrun: at any --tp)")
    p.add_argument("checkpoint", type=_checkpoint_folder,
                   help="a folder <out_dir>/checkpoints/iter_NNNNNNN")
    p.add_argument("--dataset", required=True, help="a corpus as train.py takes it (prepared "
                   "with the checkpoint's tokenizer into --data_dir)")
    p.add_argument("--tokens", type=data.positive_int, default=1_000_000,
                   help="the token budget, from the start of the split (default 1,000,000)")
    p.add_argument("--split", choices=("val", "train"), default="val",
                   help="of the prepared corpus (default val: what training held out)")
    p.add_argument("--data_dir", default="data", help="where prepared token files are kept")
    p.add_argument("--text_field", default="text", help="a JSON line's text field")
    p.add_argument("--val_fraction", type=float, default=None,
                   help="the corpus's held-out share (default: the run's, as its checkpoint "
                   "records it; another is said: its val split then holds trained-on documents)")
    p.add_argument("--batch_size", type=data.positive_int, default=8, help="sequences a step")
    p.add_argument("--tp", type=data.positive_int, default=1, help="tensor-parallel degree")
    p.add_argument("--layout", default="auto", choices=("auto", *layouts.LAYOUTS),
                   help="the TP layout (auto: btp for low-rank, megatron for dense)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"))


def cli(argv):
    parser = parser_of()
    args = parser.parse_args(argv)
    t0 = time.time()
    if args.command == "eval":
        from plumbing import heldout
        master = int(os.environ.get("RANK", "0")) == 0
        try:
            return heldout.run(args, print if master else (lambda *a: None))
        except ValueError as e:   # (the same on every rank: rank 0 says it)
            parser.error(str(e)) if master else sys.exit(2)
    if args.command in ("export", "import"):
        try:
            if args.command == "export":
                export(args.checkpoint, args.out, args.format)
                print(f"exported {args.checkpoint} to {args.out} ({args.format}) in "
                      f"{time.time() - t0:.1f} s")
            else:
                path = import_folder(args.folder, args.out_dir, args.tokenizer)
                print(f"imported {args.folder} as {path}; continue with train.py "
                      f"--out_dir={args.out_dir} --init_from=resume")
        except ValueError as e:
            parser.error(str(e))
        except OSError as e:   # a target that cannot be written: a read-only disk, a file there
            target = e.filename or getattr(args, "out", None) or args.out_dir
            parser.error(f"cannot write {target} ({e.strerror or e})")
        return
    try:
        m, tokenizer = load_for_sampling(args.model_file)
        enc = load_tokenizer(tokenizer)
    except ValueError as e:
        parser.error(str(e))
    except Exception as e:  # not a torch.save file, or not one of ours: unpickling fails many ways
        parser.error(f"{args.model_file} is not an exported model ({type(e).__name__})")
    if args.top_k < 0 or not 0 <= args.seed < 2 ** 63:
        parser.error(f"--top_k={args.top_k} must not be negative" if args.top_k < 0 else
                     f"--seed={args.seed} must be at least 0 and below 2**63")
    n_prompt = 1 + len(enc.encode_ordinary(args.prompt))   # (with the <|endoftext|> before it)
    if n_prompt > m.cfg.block_size:
        print(f"note: the prompt is {n_prompt} tokens, more than block_size {m.cfg.block_size}: "
              f"the model sees its last {m.cfg.block_size}", file=sys.stderr)
    torch.manual_seed(args.seed)
    # (a large model takes a while on a CPU: what runs is said first, on stderr; stdout: the text)
    print(f"sample: {args.tokens} tokens from {args.model_file}, one forward of up to "
          f"{m.cfg.block_size} tokens each...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    text = sample_text(m, enc, args.tokens, prompt=args.prompt, temperature=args.temperature,
                       top_k=args.top_k or None)
    print(f"sample: done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(text)


if __name__ == "__main__":
    cli(sys.argv[1:])
