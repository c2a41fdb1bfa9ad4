"""train_state.py: sharded training-state checkpoints, verified by content; export to one file.

Not in the BOOST paper (arXiv 2512.12131): what a run of days needs around its §6 3D layouts.
Saved through torch.distributed.checkpoint (DCP): every rank writes its own shards, nothing is
gathered. Each tensor is stored under its single-device name (`model.layers.0.attn.q.A.weight`,
`optim.exp_avg.<same>`) as a DTensor sharded like the layout holds it, so DCP can load it into any
other layout (tp=2 -> 1, 4, dp×tp 2×2, pp=2 -> 1) or into one process.

A checkpoint is a folder <out_dir>/checkpoints/iter_NNNNNNN/ holding the DCP files and meta.json:
the iteration, the model config, the tokenizer, the run's id, and every file's size and CRC-32
(the ranks checksum the files between them). It is written as iter_N.tmp and renamed when complete,
so a reader sees the old set of checkpoints or the new one. On resume the newest checkpoint whose
files all match their sizes and checksums is used; each one that fails is skipped with a line
naming the file. Pruning removes only older checkpoints of the same run (its id is kept across
resumes), never another run's and never a newer one. The data position is the iteration: batches
are drawn from (seed, step).

    python train_state.py export out/checkpoints/iter_0002000 model.pt   # one unsharded file
    python train_state.py export out/checkpoints/iter_0002000 hf_model --format=hf   # or cola
    python train_state.py import hf_model out2      # a checkpoint train.py --init_from=resume continues
    python train_state.py sample model.pt 200                            # generate from it
"""
import argparse
import glob
import json
import logging
import os
import shutil
import sys
import time
import warnings
import zlib

import torch
import torch.distributed as dist

import model as llama

MOMENTS = ("exp_avg", "exp_avg_sq")


def _pieces(raw_model):
    """(local parameter, full name, rows in the local tensor, shard dim or None) for every piece."""
    params = dict(raw_model.named_parameters())
    if not hasattr(raw_model, "named_specs"):
        return [(p, n, slice(None), None) for n, p in params.items()]
    out = []
    for name, spec in raw_model.named_specs():
        start = 0
        for piece, rows in zip(spec.pieces, spec.rows):
            out.append((params[name], piece, slice(start, start + rows), spec.dim))
            start += rows
    return out


def state_views(raw_model, optimizer, mesh):
    """{key: tensor} of views into this rank's parameters and AdamW moments, under single-device
    names; DTensors on the (dp, tp) mesh when distributed. DCP saves from them and loads into them."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    for p in raw_model.parameters():  # AdamW makes its state lazily: make it now, to load into
        if not optimizer.state[p]:
            optimizer.state[p].update(step=torch.zeros(()), **{k: torch.zeros_like(p) for k in MOMENTS})
    views = {}
    for p, name, rows, dim in _pieces(raw_model):
        for key, tensor in [("model." + name, p.data)] + [(f"optim.{k}.{name}", optimizer.state[p][k]) for k in MOMENTS]:
            view = tensor[rows]
            if mesh is not None:
                view = DTensor.from_local(view, mesh, [Replicate(), Replicate() if dim is None else Shard(dim)])
            views[key] = view
    views["optim.step"] = optimizer.state[next(raw_model.parameters())]["step"]
    return views


# ------------------------------------------------------------------------ files and their checksums

def checkpoint_dirs(out_dir):
    """Complete checkpoints (published folders with meta.json), oldest first."""
    return sorted(d for d in glob.glob(os.path.join(out_dir, "checkpoints", "iter_*"))
                  if not d.endswith(".tmp") and os.path.exists(os.path.join(d, "meta.json")))


def crc32(path, chunk=16 << 20):
    """CRC-32 of a file, streamed (about 2 GB/s on one core)."""
    value = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            value = zlib.crc32(block, value)
    return f"{value:08x}"


def _shared(names, fn):
    """{name: fn(name)}, the names split between the ranks (each computes its share), for all."""
    if not dist.is_initialized():
        return {n: fn(n) for n in names}
    mine = {n: fn(n) for n in names[dist.get_rank()::dist.get_world_size()]}
    box = [None] * dist.get_world_size()
    dist.all_gather_object(box, mine)
    return {k: v for part in box for k, v in part.items()}


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def save(out_dir, iter_num, raw_model, optimizer, mesh, meta, keep=2, before_publish=None):
    """Every rank writes its shards into iter_N.tmp and checksums its share of the files; rank 0
    records meta.json, renames, and prunes this run's older checkpoints. Returns (folder, bytes)."""
    import torch.distributed.checkpoint as dcp
    final = os.path.join(out_dir, "checkpoints", f"iter_{iter_num:07d}")
    tmp = final + ".tmp"
    master = not dist.is_initialized() or dist.get_rank() == 0
    if master:
        shutil.rmtree(tmp, ignore_errors=True)  # our own interrupted save of this iteration
        os.makedirs(tmp)
    _barrier()
    with warnings.catch_warnings():  # DCP warns that one process means no process group: we know
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state_views(raw_model, optimizer, mesh), checkpoint_id=tmp, no_dist=mesh is None)
    _barrier()
    files = _shared(sorted(os.listdir(tmp)), lambda f: {"bytes": os.path.getsize(os.path.join(tmp, f)),
                                                        "crc32": crc32(os.path.join(tmp, f))})
    if before_publish:
        before_publish()  # the fault-injection hook of the tests: die before the rename
    if master:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({**meta, "iter_num": iter_num, "files": files}, f, indent=1)
        shutil.rmtree(final, ignore_errors=True)  # this run's own checkpoint of this iteration, if it rolled back
        os.rename(tmp, final)  # atomic: a reader sees the old set of checkpoints or the new one
        prune(out_dir, meta.get("run_id"), iter_num, keep)
    _barrier()
    return final, sum(f["bytes"] for f in files.values())


def prune(out_dir, run_id, iter_num, keep):
    """Remove the checkpoints of run `run_id` older than iteration `iter_num`, but the newest keep-1."""
    own = []
    for d in checkpoint_dirs(out_dir):
        try:
            with open(os.path.join(d, "meta.json")) as f:
                meta = json.load(f)
        except (OSError, json.JSONDecodeError):
            continue  # not ours to judge: leave it
        if run_id is not None and meta.get("run_id") == run_id and meta.get("iter_num", iter_num) < iter_num:
            own.append(d)
    for old in own[:max(0, len(own) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------ resuming

def candidates(out_dir, init_from):
    """The complete checkpoints to try, newest first ([] to start from scratch)."""
    if init_from == "scratch":
        return []
    found = checkpoint_dirs(out_dir)[::-1]
    if not found and init_from == "resume":
        raise ValueError(f"--init_from=resume but there is no complete checkpoint in {out_dir}/checkpoints")
    return found


def read_meta(path, config, tokenizer):
    """meta.json of a checkpoint; ValueError naming the field where the model's shape differs."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    meta["config"] = llama.Config(**meta["config"]).shape()  # options added since it was written: defaults
    for key, value in config.items():
        if meta["config"].get(key) != value:
            if key == "vocab_size":
                raise ValueError(f"checkpoint {path} was written with --tokenizer={meta.get('tokenizer')} "
                                 f"(vocabulary {meta['config'].get(key)}), this run has --tokenizer={tokenizer} "
                                 f"(vocabulary {value}): pass the same tokenizer")
            raise ValueError(f"checkpoint {path} was written with {key}={meta['config'].get(key)}, "
                             f"this run has {key}={value}: pass the same model options")
    return meta


def verify(path, meta):
    """None if every file of the checkpoint has its recorded size and checksum, else what failed.
    Collective under torchrun: the ranks checksum the files between them."""
    def check(name):
        file = os.path.join(path, name)
        want = meta["files"][name]
        want = want if isinstance(want, dict) else {"bytes": want}  # written before checksums were
        if not os.path.exists(file):
            return f"{name} is missing"
        if os.path.getsize(file) != want["bytes"]:
            return f"{name} has {os.path.getsize(file)} bytes, {want['bytes']} were written (truncated)"
        got = crc32(file) if "crc32" in want else None
        if got != want.get("crc32"):
            return f"{name} fails its checksum (crc32 {got}, {want['crc32']} was written)"
        return None
    results = _shared(sorted(meta["files"]), check)
    return next((results[n] for n in sorted(results) if results[n]), None)


def choose(found, config, tokenizer, log=print):
    """(folder, meta) of the newest checkpoint in `found` that is whole and matches the model, each
    bad one skipped with one line; ValueError if none is good or the model's shape differs."""
    problems = []
    for path in found:
        try:
            meta = read_meta(path, config, tokenizer)
            problem = verify(path, meta)
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            problem = f"meta.json is unreadable ({type(e).__name__})"
        if problem is None:
            return path, meta
        log(f"skipping checkpoint {path}: {problem}")
        problems.append(f"{os.path.basename(path)}: {problem}")
    if found:
        raise ValueError(f"no usable checkpoint in {os.path.dirname(found[0])} ({'; '.join(problems)})")
    return None, None


def load(path, raw_model, optimizer, mesh):
    """Load a checkpoint into this rank's parameters and moments, whatever layout wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    views = state_views(raw_model, optimizer, mesh)
    error = None
    dcp_log = logging.getLogger()  # DCP's loader logs its failures with tracebacks on the root logger
    level = dcp_log.level
    dcp_log.setLevel(logging.CRITICAL)  # our one-line error says it instead
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(views, checkpoint_id=path, no_dist=mesh is None)
    except (Exception, CheckpointException) as e:  # corrupt files: any error of DCP or of unpickling
        error = f"checkpoint {path} is unreadable or corrupt ({type(e).__name__})"
    finally:
        dcp_log.setLevel(level)
    if dist.is_initialized():  # all ranks fail together, none is left waiting in a collective
        box = [None] * dist.get_world_size()
        dist.all_gather_object(box, error)
        error = next((e for e in box if e), None)
    if error:
        raise ValueError(error)
    step = views["optim.step"]
    for p in raw_model.parameters():
        optimizer.state[p]["step"] = step.clone()


# ------------------------------------------------------------------------ one file, and sampling

def checkpoint_state(path, scratch):
    """(model.Config, single-device state dict, tokenizer) of a checkpoint folder, in one process
    (through a temporary file in the folder `scratch`)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    tmp = os.path.join(scratch, f".export-{os.getpid()}.tmp")
    try:
        dcp_to_torch_save(path, tmp)
        flat = torch.load(tmp, weights_only=False)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    cfg = llama.Config(**meta["config"])
    state = {k[len("model."):]: v for k, v in flat.items() if k.startswith("model.")}
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["tok_emb.weight"]
    return cfg, state, meta.get("tokenizer", "bytes")


def export(path, out, fmt="pt"):
    """A checkpoint as one file (pt: torch.save of {'model', 'config', 'tokenizer'}) or as a folder
    another tool reads (hf, cola: interchange.py)."""
    import interchange
    cfg, state, tokenizer = checkpoint_state(path, os.path.dirname(os.path.abspath(out)))
    if fmt != "pt":
        return interchange.write(out, state, cfg, fmt, tokenizer)
    tmp = f"{out}.{os.getpid()}.tmp"
    torch.save({"model": state, "config": cfg.shape(), "tokenizer": tokenizer}, tmp)
    os.replace(tmp, out)


def import_folder(folder, out_dir, tokenizer=None):
    """An hf or cola folder as the iteration-0 training checkpoint of a new run in out_dir, which
    --init_from=resume continues under any layout (fresh AdamW moments). Returns its folder."""
    import interchange
    import options
    import rundir
    kw, state, named = interchange.read(folder)
    tokenizer = tokenizer or named
    if tokenizer is None:
        raise ValueError(f"{folder} does not name its tokenizer: pass --tokenizer")
    if options.vocab_size(tokenizer) != kw["vocab_size"]:
        raise ValueError(f"the model's vocabulary of {kw['vocab_size']} is not the {options.vocab_size(tokenizer)} "
                         f"of --tokenizer={tokenizer} (padded to a multiple of 64)")
    rundir.check_scratch(out_dir, overwrite=False)
    m = llama.Llama(llama.Config(**kw))
    m.load_state_dict(state)
    meta = {"config": m.cfg.shape(), "tokenizer": tokenizer, "run_id": rundir.new_run_id(), "imported_from": folder}
    return save(out_dir, 0, m, torch.optim.AdamW(m.parameters()), None, meta)[0]


def load_exported(out_file):
    """A model.Llama from an exported file."""
    blob = torch.load(out_file, weights_only=True)
    m = llama.Llama(llama.Config(**blob["config"]))
    m.load_state_dict(blob["model"])
    return m, blob["tokenizer"]


def _checkpoint_folder(text):
    if os.path.isdir(os.path.join(text, "checkpoints")):
        found = checkpoint_dirs(text)
        hint = f": pass one of its checkpoints, e.g. {found[-1]}" if found else " and holds no complete checkpoint"
        raise argparse.ArgumentTypeError(f"{text} is an out_dir, not a checkpoint{hint}")
    if not os.path.isfile(os.path.join(text, "meta.json")):
        raise argparse.ArgumentTypeError(f"{text} is not a checkpoint folder (no {os.path.join(text, 'meta.json')})")
    return text


def _new_file(text):
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"the folder {parent} of {text} does not exist")
    if os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text} exists: remove it or choose another name")
    return text


def _exported_file(text):
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text} is not a file (export a checkpoint first)")
    return text


def _positive(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def cli(argv):
    import data
    import interchange
    parser = data.OneLineParser(prog="train_state.py", description="Export a training checkpoint (one file, or "
                                "a folder other tools read), import such a folder as a checkpoint, or sample.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("export", help="write a checkpoint as one file (pt) or a Hugging Face / CoLA folder")
    p.add_argument("checkpoint", type=_checkpoint_folder, help="a folder <out_dir>/checkpoints/iter_NNNNNNN")
    p.add_argument("out", type=_new_file, help="the file (pt) or folder (hf, cola) to write; must not exist")
    p.add_argument("--format", default="pt", choices=("pt",) + interchange.FORMATS,
                   help="pt: one torch.save file; hf: Hugging Face Llama (full, or svd merged W = B·A); "
                        "cola: the official CoLA format (cola models)")
    p = sub.add_parser("import", help="an hf or cola folder as the training checkpoint of a new run")
    p.add_argument("folder", help="a folder with config.json and pytorch_model.bin")
    p.add_argument("out_dir", help="the new run's out_dir; continue with train.py --init_from=resume")
    p.add_argument("--tokenizer", choices=data.TOKENIZERS, help="default: the one config.json names")
    p = sub.add_parser("sample", help="generate text from an exported file")
    p.add_argument("model_file", type=_exported_file)
    p.add_argument("tokens", type=_positive, nargs="?", default=200, help="tokens to generate (default 200)")
    args = parser.parse_args(argv)
    t0 = time.time()
    if args.command in ("export", "import"):
        try:
            if args.command == "export":
                export(args.checkpoint, args.out, args.format)
                print(f"exported {args.checkpoint} to {args.out} ({args.format}) in {time.time() - t0:.1f} s")
            else:
                path = import_folder(args.folder, args.out_dir, args.tokenizer)
                print(f"imported {args.folder} as {path}; continue with train.py --out_dir={args.out_dir} "
                      "--init_from=resume (and the same model options)")
        except ValueError as e:
            parser.error(str(e))
        return
    try:
        m, tokenizer = load_exported(args.model_file)
        enc = data.get_tokenizer(tokenizer)
    except Exception as e:  # not a torch.save file, or not one of ours: unpickling fails many ways
        parser.error(f"{args.model_file} is not an exported model ({type(e).__name__})")
    torch.manual_seed(1337)
    out = m.generate(torch.tensor([[enc.eot_token]]), args.tokens, temperature=0.8, top_k=50)
    print(enc.decode([t for t in out[0, 1:].tolist() if t < enc.n_vocab]))


if __name__ == "__main__":
    cli(sys.argv[1:])
