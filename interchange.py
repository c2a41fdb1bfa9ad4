"""interchange.py: this project's models in the formats other tools read, and back: export and import.

Not in the BOOST paper (arXiv 2512.12131); what lets a model trained with BTP be evaluated (and a
CoLA model trained elsewhere be trained on with BTP). docs/design.md states both formats:

  hf    Hugging Face Llama (`model_type: llama`, `LlamaForCausalLM` loads it without custom code,
        and so does lm-evaluation-harness). It computes down(silu(gate)·up) with dense projections,
        so it holds the dense model, and the svd model after merging each W = B·A (exact: σ is the
        identity there).
  cola  the official CoLA format (`model_type: cola`, CoLA's `ColaForCausalLM`): every projection
        is x @ cola_a, σ = hidden_act, @ cola_b, with cola_a (in, r) = A.weight.T and cola_b
        (r, out) = B.weight.T; one `rank` for all projections; `only_lr_act` true for
        down(gate·up), false for down(silu(gate)·up). Its k and v are n_head·head_dim wide.

The commands (a checkpoint is a folder <out_dir>/checkpoints/iter_NNNNNNN, plumbing/train_state.py's):

    python interchange.py export out/checkpoints/iter_0002000 model.pt               # one unsharded file
    python interchange.py export out/checkpoints/iter_0002000 hf_model --format=hf   # or cola
    python interchange.py import hf_model out2   # a checkpoint that train.py --init_from=resume continues
    python interchange.py sample model.pt 200    # generate from an exported file

A folder is config.json and model.safetensors, as transformers writes them (import also reads a
pytorch_model.bin, as tensors only); `boost_tokenizer` in config.json names the tokenizer. What a
format cannot represent, or a folder whose weights do not fit its config.json, is refused with one
line (ValueError).
"""
import argparse
import json
import os
import sys
import time
import zlib

import torch

from plumbing import integrity
import model as llama
from plumbing import train_state
from plumbing import weights
from plumbing.tokenizer import identity as tokenizer_identity, in_folder as tokenizer_in, load as load_tokenizer, \
    keep as keep_tokenizer, write_for_hf

FORMATS = ("hf", "cola")
PROJECTIONS = [("attn", "self_attn", n) for n in "qkvo"] + [("mlp", "mlp", n) for n in ("gate", "up", "down")]


def check(cfg, fmt):
    """ValueError naming what `fmt` cannot represent of this model."""
    if getattr(cfg, "lax", False) and fmt in FORMATS:
        raise ValueError(f"a LaX model's latents cross between layers (a gate and a LayerNorm per projection), "
                         f"which the {'Hugging Face Llama' if fmt == 'hf' else 'CoLA'} format cannot hold: "
                         "use --format=pt")
    if fmt == "hf":
        if cfg.arch == "cola":
            raise ValueError("a cola model has σ = SiLU inside every projection, which Llama has not: "
                             "use --format=cola")
        if cfg.mlp_gate != "silu":
            raise ValueError(f"Hugging Face Llama computes down(silu(gate)·up); this {cfg.arch} model has "
                             f"mlp_gate={cfg.mlp_gate}")
    elif fmt == "cola":
        if cfg.arch != "cola":
            raise ValueError(f"the CoLA format applies σ = hidden_act to every latent; arch={cfg.arch} "
                             f"{'has none' if cfg.arch == 'svd' else 'has no bottlenecks'}: use --format=hf"
                             + (" (its projections merged, W = B·A)" if cfg.arch == "svd" else ""))
        if cfg.attn_rank != cfg.mlp_rank:
            raise ValueError(f"the CoLA format has one rank for every projection; this model has "
                             f"attn_rank={cfg.attn_rank}, mlp_rank={cfg.mlp_rank}")
        if cfg.n_kv_head != cfg.n_head:
            raise ValueError(f"the CoLA format has no grouped-query attention; this model has "
                             f"n_kv_head={cfg.n_kv_head} < n_head={cfg.n_head}")
    else:
        raise ValueError(f"format={fmt} is not one of {', '.join(FORMATS)}")


def hf_config(cfg, fmt, tokenizer):
    """config.json of a model (model.Config) in format `fmt`."""
    out = {"architectures": ["LlamaForCausalLM" if fmt == "hf" else "ColaForCausalLM"],
           "model_type": "llama" if fmt == "hf" else "cola",
           "hidden_size": cfg.n_embd, "intermediate_size": cfg.mlp_width, "num_attention_heads": cfg.n_head,
           "num_key_value_heads": cfg.n_kv_head, "num_hidden_layers": cfg.n_layer, "head_dim": cfg.head_dim,
           "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_base, "max_position_embeddings": cfg.block_size,
           "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
           "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32", "boost_tokenizer": tokenizer,
           "boost_arch": cfg.arch}
    if fmt == "cola":
        out.update(rank=cfg.attn_rank, only_lr_act=cfg.mlp_gate == "none", max_sequence_length=cfg.block_size)
    return out


def tensor_names(cfg):
    """The one name mapping both directions use: ([(our name, theirs)] of the tensors that are the same
    in every format: embedding, norms), ([(our prefix, theirs)] of every projection)."""
    same = [("tok_emb.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight")]
    projections = []
    for i in range(cfg.n_layer):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        same += [(ours + "attn_norm.weight", theirs + "input_layernorm.weight"),
                 (ours + "mlp_norm.weight", theirs + "post_attention_layernorm.weight")]
        projections += [(f"{ours}{block}.{n}.", f"{theirs}{hf_block}.{n}_proj.") for block, hf_block, n in PROJECTIONS]
    return same, projections


def to_format(state, cfg, fmt, check_format=True):
    """{name: tensor} of the model's state dict (single-device names) in format `fmt`."""
    if check_format:
        check(cfg, fmt)
    same, projections = tensor_names(cfg)
    out = {theirs: state[ours] for ours, theirs in same}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for src, dst in projections:
        if cfg.arch == "full":
            out[dst + "weight"] = state[src + "weight"]
        elif fmt == "hf":   # svd: W = B·A, (out, r) @ (r, in)
            out[dst + "weight"] = state[src + "B.weight"] @ state[src + "A.weight"]
        else:
            out[dst + "cola_a"] = state[src + "A.weight"].t().contiguous()   # (in, r)
            out[dst + "cola_b"] = state[src + "B.weight"].t().contiguous()   # (r, out)
    return {k: v.detach().clone().contiguous() if v.device.type != "meta" else v for k, v in out.items()}


def write(folder, state, cfg, fmt, tokenizer):
    """A folder in format `fmt` (config.json, model.safetensors); refuses to write into a non-empty one."""
    tensors, st = to_format(state, cfg, fmt), weights.safetensors()
    if os.path.exists(folder) and os.listdir(folder):
        raise ValueError(f"{folder} exists and is not empty: choose another folder")
    tokenizer_identity(tokenizer)   # (a tokenizer file that is gone: one line, before anything is written)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config(cfg, fmt, tokenizer), f, indent=1)
    st.save_file(tensors, os.path.join(folder, weights.WEIGHTS), metadata={"format": "pt"})
    write_for_hf(tokenizer, folder)   # tokenizer.json or .model + tokenizer_config.json: AutoTokenizer reads it


INT_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "num_hidden_layers", "vocab_size", "max_position_embeddings", "rank", "head_dim")


def config_kwargs(c, folder):
    """model.Config keyword arguments of an hf or cola config.json; ValueError with one line for a
    missing key, a value of the wrong type, or what this project cannot hold."""
    kind = c.get("model_type")
    if kind not in ("llama", "cola"):
        raise ValueError(f"{folder}: model_type={kind!r} is not llama or cola")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise ValueError(f"{folder}: {key}=true: this project's projections have no bias")
    if c.get("hidden_act", "silu") != "silu" or c.get("rope_scaling"):
        raise ValueError(f"{folder}: hidden_act={c.get('hidden_act')}, rope_scaling={c.get('rope_scaling')}: "
                         "only silu and plain RoPE are supported")
    needed = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
    for key in needed + (("rank",) if kind == "cola" else ()):
        if key not in c:
            raise ValueError(f"{folder}: config.json has no {key}")
    for key in INT_KEYS:   # the optional ones may be null
        if (key in needed or c.get(key) is not None) and key in c and \
                (not isinstance(c[key], int) or isinstance(c[key], bool) or c[key] < 1):
            raise ValueError(f"{folder}: config.json's {key}={c[key]!r} is not a positive integer")
    for key in ("rope_theta", "rms_norm_eps"):
        if not isinstance(c.get(key, 1.0), (int, float)) or isinstance(c.get(key), bool):
            raise ValueError(f"{folder}: config.json's {key}={c[key]!r} is not a number")
    d, h = c["hidden_size"], c["num_attention_heads"]
    if c.get("head_dim", d // h) != d // h:
        raise ValueError(f"{folder}: head_dim={c['head_dim']} is not hidden_size/num_attention_heads={d // h}")
    kw = dict(arch="full" if kind == "llama" else "cola", n_layer=c["num_hidden_layers"], n_head=h,
              n_kv_head=c.get("num_key_value_heads") or h, n_embd=d, mlp_width=c["intermediate_size"],
              block_size=c.get("max_position_embeddings") or 2048, vocab_size=c["vocab_size"],
              rope_base=float(c.get("rope_theta", 10000.0)), norm_eps=float(c.get("rms_norm_eps", 1e-6)),
              tie_embeddings=bool(c.get("tie_word_embeddings", False)))
    if kind == "cola":   # CoLA's k and v are n_head·head_dim wide whatever num_key_value_heads says
        kw.update(attn_rank=c["rank"], mlp_rank=c["rank"], mlp_gate="none" if c.get("only_lr_act", True) else "silu",
                  n_kv_head=h)
    else:
        kw.update(mlp_gate="silu")
    return kw


def read(folder):
    """(model.Config keyword arguments, single-device state dict, tokenizer or None) of an hf or cola
    folder, every tensor of the model present with its shape and none left over; ValueError with one
    line otherwise."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder} is not a model folder: config.json is unreadable ({type(e).__name__})") from None
    if not isinstance(c, dict):
        raise ValueError(f"{folder}: config.json is not a JSON object")
    kw = config_kwargs(c, folder)
    try:
        cfg = llama.Config(**kw)
    except ValueError as e:
        raise ValueError(f"{folder}: config.json describes no model this project can build ({e})") from None
    tensors = weights.load(folder, needed_shapes(cfg), optional={"lm_head.weight"})   # (tied: none)
    return kw, from_format(tensors, cfg), c.get("boost_tokenizer")


def needed_shapes(cfg):
    """{name: shape} of the tensors a folder of cfg's model holds, in its format: a model of two
    layers is built on the meta device, and its last layer's names repeated (no model of cfg's size
    is built: a config.json may describe one that would not fit)."""
    small = llama.Config(**{**cfg.shape(), "n_layer": min(cfg.n_layer, 2)})
    with torch.device("meta"):
        state = llama.Llama(small).state_dict()
    named = to_format(state, small, "cola" if cfg.arch == "cola" else "hf", check_format=False)
    out, last = {}, f".layers.{small.n_layer - 1}."
    for name, t in named.items():
        if last in name:
            out.update({name.replace(last, f".layers.{i}."): tuple(t.shape)
                        for i in range(small.n_layer - 1, cfg.n_layer)})
        else:
            out[name] = tuple(t.shape)
    return out


def from_format(tensors, cfg):
    """The single-device state dict of a folder's tensors (hf or cola names), checked by read()."""
    same, projections = tensor_names(cfg)
    state = {ours: tensors[theirs] for ours, theirs in same}
    state["lm_head.weight"] = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    for dst, src in projections:
        if cfg.arch == "full":
            state[dst + "weight"] = tensors[src + "weight"]
        else:
            state[dst + "A.weight"] = tensors[src + "cola_a"].t().contiguous()   # (r, in)
            state[dst + "B.weight"] = tensors[src + "cola_b"].t().contiguous()   # (out, r)
    return state


# ------------------------------------------------------------------------ the commands

def checkpoint_state(path):
    """(model.Config, single-device state dict, tokenizer) of a checkpoint folder, in one process:
    its checksums verified as resume verifies them, its tensors loaded into a model of its config."""
    try:
        meta = train_state.read_meta(path)   # as resume reads it, with no run to compare it with
        cfg = llama.Config(**meta["config"])
        problem = integrity.verify(path, meta)
    except integrity.Damaged as e:
        raise ValueError(f"checkpoint {path}: {e}") from None
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"checkpoint {path}: meta.json is unreadable ({type(e).__name__})") from None
    if problem:
        raise ValueError(f"checkpoint {path}: {problem}")
    model = llama.Llama(cfg)   # the template DCP loads into (a tied head is the embedding: stored once)
    state = {"model." + name: p.detach() for name, p in model.named_parameters()}
    error = integrity.dcp_load(state, path, meta["files"], no_dist=True)
    if error:
        raise ValueError(f"checkpoint {path}: {error}")
    state = {k[len("model."):]: v for k, v in state.items()}
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["tok_emb.weight"]
    return cfg, state, meta.get("tokenizer", "bytes")


def export(path, out, fmt="pt"):
    """A checkpoint as one file (pt: torch.save of {'model', 'config', 'tokenizer', 'crc32'}) or as a
    folder another tool reads (hf, cola)."""
    cfg, state, tokenizer = checkpoint_state(path)
    if fmt != "pt":
        return write(out, state, cfg, fmt, tokenizer)
    tmp = f"{out}.{os.getpid()}.tmp"
    try:
        torch.save({"model": state, "config": cfg.shape(), "tokenizer": tokenizer,
                    "crc32": tensors_crc32(state)}, tmp)
        os.replace(tmp, out)
    except (OSError, RuntimeError) as e:   # (torch.save's own file errors are RuntimeErrors)
        if os.path.exists(tmp):
            os.remove(tmp)
        why = getattr(e, "strerror", None) or str(e).split(": ")[-1]
        raise ValueError(f"cannot write {out} ({why})") from None


def import_folder(folder, out_dir, tokenizer=None):
    """An hf or cola folder as the iteration-0 training checkpoint of a new run in out_dir, which
    --init_from=resume continues under any layout (fresh AdamW moments). Returns its folder."""
    from plumbing import options
    from plumbing import rundir
    rundir.check_place(out_dir)
    kw, state, named = read(folder)
    tokenizer = tokenizer or tokenizer_in(folder) or named   # --tokenizer, else the folder's file, else its name
    if tokenizer is None:
        raise ValueError(f"{folder} does not name its tokenizer: pass --tokenizer")
    if options.vocab_size(tokenizer) != kw["vocab_size"]:
        raise ValueError(f"the model's vocabulary of {kw['vocab_size']} is not the {options.vocab_size(tokenizer)} "
                         f"of --tokenizer={tokenizer} (padded to a multiple of 64)")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"{out_dir} is a file: import needs a new or empty out_dir")
    found = rundir.earlier_run(out_dir)
    if found:
        raise ValueError(f"out_dir {out_dir} holds an earlier run ({' and '.join(found)}): import into a new "
                         "or empty out_dir")
    m = llama.Llama(llama.Config(**kw))
    m.load_state_dict(state)
    tokenizer = keep_tokenizer(tokenizer, out_dir)   # a copy in out_dir/tokenizer/ for the runs that continue it
    meta = {"config": m.cfg.shape(), "tokenizer": tokenizer, "tokenizer_id": tokenizer_identity(tokenizer),
            "train_config": {"tokenizer": tokenizer},   # (a resume's; the other options: defaults)
            "run_id": rundir.new_run_id(), "imported_from": folder}
    return train_state.save(out_dir, 0, m, torch.optim.AdamW(m.parameters()), None, meta)[0]


def tensors_crc32(state):
    """A CRC-32 over the tensors of a state dict, in name order: an exported file carries its own."""
    value = 0
    for name in sorted(state):
        value = zlib.crc32(state[name].detach().contiguous().view(-1).view(torch.uint8).numpy(), value)
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
        hint = f": pass one of its checkpoints, e.g. {found[-1]}" if found else " and holds no complete checkpoint"
        raise argparse.ArgumentTypeError(f"{text} is an out_dir, not a checkpoint{hint}")
    if not os.path.isfile(os.path.join(text, "meta.json")):
        raise argparse.ArgumentTypeError(f"{text} is not a checkpoint folder (no {os.path.join(text, 'meta.json')})")
    return text


def _exported_file(text):
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text} is not a file (export a checkpoint first)")
    return text


def cli(argv):
    from plumbing import data
    parser = data.CommandParser(prog="interchange.py", description="Export a training checkpoint (one file, or "
                                "a folder other tools read), import such a folder as a checkpoint, or sample.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("export", help="write a checkpoint as one file (pt) or a Hugging Face / CoLA folder")
    p.add_argument("checkpoint", type=_checkpoint_folder, help="a folder <out_dir>/checkpoints/iter_NNNNNNN")
    p.add_argument("out", type=data.new_path, help="the file (pt) or folder (hf, cola) to write; must not exist")
    p.add_argument("--format", default="pt", choices=("pt",) + FORMATS,
                   help="pt: one torch.save file; hf: Hugging Face Llama (full, or svd merged W = B·A); "
                        "cola: the official CoLA format (cola models)")
    p = sub.add_parser("import", help="an hf or cola folder as the training checkpoint of a new run")
    p.add_argument("folder", help="a folder with config.json and model.safetensors (or pytorch_model.bin)")
    p.add_argument("out_dir", help="the new run's out_dir; continue with train.py --init_from=resume")
    p.add_argument("--tokenizer", help="default: the folder's tokenizer file, else the one config.json names")
    p = sub.add_parser("sample", help="generate text from an exported file")
    p.add_argument("model_file", type=_exported_file)
    p.add_argument("tokens", type=data.positive_int, nargs="?", default=200, help="tokens to generate (default 200)")
    p.add_argument("--prompt", default="", help="the text to continue (default: a new document)")
    p.add_argument("--temperature", type=data.positive_float, default=0.8,
                   help="above 0 (default 0.8)")
    p.add_argument("--top_k", type=int, default=50,
                   help="sample from the k likeliest tokens; 0: from all (default 50)")
    p.add_argument("--seed", type=int, default=1337, help="of the sampling (default 1337)")
    args = parser.parse_args(argv)
    t0 = time.time()
    if args.command in ("export", "import"):
        try:
            if args.command == "export":
                export(args.checkpoint, args.out, args.format)
                print(f"exported {args.checkpoint} to {args.out} ({args.format}) in {time.time() - t0:.1f} s")
            else:
                path = import_folder(args.folder, args.out_dir, args.tokenizer)
                print(f"imported {args.folder} as {path}; continue with train.py --out_dir={args.out_dir} --init_from=resume")
        except ValueError as e:
            parser.error(str(e))
        except OSError as e:   # a target that cannot be written: a read-only disk, a file there
            target = e.filename or getattr(args, "out", None) or args.out_dir
            parser.error(f"cannot write {target} ({e.strerror or e})")
        return
    try:
        m, tokenizer = load_exported(args.model_file)
        enc = load_tokenizer(tokenizer)
    except ValueError as e:
        parser.error(str(e))
    except Exception as e:  # not a torch.save file, or not one of ours: unpickling fails many ways
        parser.error(f"{args.model_file} is not an exported model ({type(e).__name__})")
    if args.top_k < 0 or not 0 <= args.seed < 2 ** 63:
        parser.error(f"--top_k={args.top_k} must not be negative" if args.top_k < 0 else
                     f"--seed={args.seed} must be at least 0 and below 2**63")
    torch.manual_seed(args.seed)
    print(llama.sample_text(m, enc, args.tokens, prompt=args.prompt, temperature=args.temperature,
                            top_k=args.top_k or None))


if __name__ == "__main__":
    cli(sys.argv[1:])
