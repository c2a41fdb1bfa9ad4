"""formats.py: this project's models in the folders other tools read, and those folders read back.

Not in the BOOST paper (arXiv 2512.12131); what lets a model trained with BTP be evaluated (and a
CoLA model trained elsewhere be trained on with BTP). interchange.py's export and import commands
write and read these; docs/design.md states both formats:

  hf    Hugging Face, for every model this trains. The dense model, and the svd model with
        SwiGLU merged (W = B·A, exact: σ is the identity), as `model_type: llama`, which
        transformers' own LlamaForCausalLM reads; cola, LaX and svd without SwiGLU as
        `model_type: boost` with its code in the folder (configuration_boost.py and
        modeling_boost.py from plumbing/hf_remote/, named by config.json's auto_map), read by
        `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` and lm-eval's hf
        model with trust_remote_code=True. Its tensors are this project's under transformers'
        module names (model.layers.i.self_attn.q_proj.A.weight, ...cross.norm.weight, ...).
  cola  the official CoLA format (`model_type: cola`, CoLA's `ColaForCausalLM`): every projection
        is x @ cola_a, σ = hidden_act, @ cola_b, with cola_a (in, r) = A.weight.T and cola_b
        (r, out) = B.weight.T; one `rank` for all projections; `only_lr_act` true for
        down(gate·up), false for down(silu(gate)·up). Its k and v are n_head·head_dim wide.

A folder is config.json and model.safetensors, as transformers writes them (import also reads a
pytorch_model.bin, as tensors only); `boost_tokenizer` in config.json names the tokenizer. What a
format cannot represent, or a folder whose weights do not fit its config.json, is refused with one
line (ValueError).
"""
import json
import os
import shutil
import sys
from pathlib import Path

import torch

import model as llama
from plumbing import rundir, weights
from plumbing.tokenizer import identity as tokenizer_identity, write_for_hf

FORMATS = ("hf", "cola")
REMOTE = Path(__file__).parent / "hf_remote"   # the code a boost folder carries
AUTO_MAP = {"AutoConfig": "configuration_boost.BoostConfig",
            "AutoModelForCausalLM": "modeling_boost.BoostForCausalLM"}
BOOST_KEYS = {"boost_arch": str, "attn_rank": int, "mlp_rank": int, "mlp_gate": str, "lax": bool,
              "lax_gate": str}   # config.json's bottleneck fields (model.Config's, renamed arch)
PROJECTIONS = [("attn", "self_attn", n) for n in "qkvo"] + [("mlp", "mlp", n)
                                                            for n in ("gate", "up", "down")]


def kind_of(cfg, fmt):
    """The folder's model_type: llama (transformers' own class holds the model), boost (the
    folder's code) or cola."""
    if fmt == "cola":
        return "cola"
    plain = cfg.arch == "full" or (cfg.arch == "svd" and cfg.mlp_gate == "silu" and not cfg.lax)
    return "llama" if plain else "boost"


def check(cfg, fmt):
    """ValueError naming what `fmt` cannot represent of this model."""
    if fmt == "hf":
        if cfg.arch == "full" and cfg.mlp_gate != "silu":
            raise ValueError(f"Hugging Face Llama computes down(silu(gate)·up); this {cfg.arch} "
                             f"model has mlp_gate={cfg.mlp_gate}")
    elif fmt == "cola":
        if getattr(cfg, "lax", False):
            raise ValueError("a LaX model's latents cross between layers (a gate and a LayerNorm "
                             "per projection), which the CoLA format cannot hold: use --format=hf")
        if cfg.arch != "cola":
            raise ValueError(f"the CoLA format applies σ = hidden_act to every latent; "
                             f"arch={cfg.arch} "
                             f"{'has none' if cfg.arch == 'svd' else 'has no bottlenecks'}: use "
                             f"--format=hf"
                             + (" (its projections merged, W = B·A)" if cfg.arch == "svd" else ""))
        if cfg.attn_rank != cfg.mlp_rank:
            raise ValueError(f"the CoLA format has one rank for every projection; this model has "
                             f"attn_rank={cfg.attn_rank}, mlp_rank={cfg.mlp_rank}")
        if cfg.n_kv_head != cfg.n_head:
            raise ValueError(f"the CoLA format has no grouped-query attention; this model has "
                             f"n_kv_head={cfg.n_kv_head} < n_head={cfg.n_head}")
    else:
        raise ValueError(f"format={fmt} is not one of {', '.join(FORMATS)}")


def hf_config(cfg, kind, tokenizer):
    """config.json of a model (model.Config) in a folder of model_type `kind`."""
    cls = {"llama": "LlamaForCausalLM", "cola": "ColaForCausalLM", "boost": "BoostForCausalLM"}
    out = {"architectures": [cls[kind]], "model_type": kind,
           "hidden_size": cfg.n_embd, "intermediate_size": cfg.mlp_width,
           "num_attention_heads": cfg.n_head,
           "num_key_value_heads": cfg.n_kv_head, "num_hidden_layers": cfg.n_layer,
           "head_dim": cfg.head_dim,
           "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_base,
           "max_position_embeddings": cfg.block_size,
           "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
           "hidden_act": "silu",
           "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
           "boost_tokenizer": tokenizer,
           "boost_arch": cfg.arch}
    if kind == "cola":
        out.update(rank=cfg.attn_rank, only_lr_act=cfg.mlp_gate == "none",
                   max_sequence_length=cfg.block_size)
    if kind == "boost":
        out.update(auto_map=AUTO_MAP, attn_rank=cfg.attn_rank, mlp_rank=cfg.mlp_rank,
                   mlp_gate=cfg.mlp_gate, lax=cfg.lax, lax_gate=cfg.lax_gate)
    return out


def tensor_names(cfg):
    """The one name mapping both directions use: ([(our name, theirs)] of the tensors that are the
    same in every format: embedding, norms), ([(our prefix, theirs)] of every projection)."""
    same = [("tok_emb.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight")]
    projections = []
    for i in range(cfg.n_layer):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        same += [(ours + "attn_norm.weight", theirs + "input_layernorm.weight"),
                 (ours + "mlp_norm.weight", theirs + "post_attention_layernorm.weight")]
        projections += [(f"{ours}{block}.{n}.", f"{theirs}{hf_block}.{n}_proj.")
                        for block, hf_block, n in PROJECTIONS]
    return same, projections


def to_format(state, cfg, kind):
    """{name: tensor} of the model's state dict (single-device names) in a folder of model_type
    `kind` (kind_of: llama, boost or cola)."""
    same, projections = tensor_names(cfg)
    out = {theirs: state[ours] for ours, theirs in same}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for src, dst in projections:
        if cfg.arch == "full":
            out[dst + "weight"] = state[src + "weight"]
        elif kind == "llama":   # svd: W = B·A, (out, r) @ (r, in)
            out[dst + "weight"] = state[src + "B.weight"] @ state[src + "A.weight"]
        elif kind == "boost":   # A, B and LaX's crossing under the projection's name
            out.update({dst + k[len(src):]: v for k, v in state.items() if k.startswith(src)})
        else:
            out[dst + "cola_a"] = state[src + "A.weight"].t().contiguous()   # (in, r)
            out[dst + "cola_b"] = state[src + "B.weight"].t().contiguous()   # (r, out)
    return {k: v.detach().clone().contiguous() if v.device.type != "meta" else v
            for k, v in out.items()}


def write(folder, state, cfg, fmt, tokenizer):
    """A folder in format `fmt` (config.json, model.safetensors); refuses to write into a non-empty
    one."""
    check(cfg, fmt)
    kind = kind_of(cfg, fmt)
    tensors, st = to_format(state, cfg, kind), weights.safetensors()
    if os.path.exists(folder) and os.listdir(folder):
        raise ValueError(f"{folder} exists and is not empty: choose another folder")
    # (a tokenizer file that is gone: one line, before anything is written)
    tokenizer_identity(tokenizer)
    # written beside the target, renamed into place when whole: never a half-written folder
    tmp = f"{os.path.normpath(folder)}.{os.getpid()}.tmp"
    try:
        os.makedirs(tmp)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config(cfg, kind, tokenizer), f, indent=1)
        st.save_file(tensors, os.path.join(tmp, weights.WEIGHTS), metadata={"format": "pt"})
        # (safetensors writes 0600: readable as the folder's other files are, for a shared model)
        os.chmod(os.path.join(tmp, weights.WEIGHTS),
                 os.stat(os.path.join(tmp, "config.json")).st_mode & 0o777)
        if kind == "boost":   # the model's code, which auto_map names
            for name in ("configuration_boost.py", "modeling_boost.py"):
                shutil.copyfile(REMOTE / name, os.path.join(tmp, name))
        # tokenizer.json or .model + tokenizer_config.json: AutoTokenizer reads it
        write_for_hf(tokenizer, tmp)
        os.replace(tmp, folder)   # (onto an empty folder, or where there was none)
    except (OSError, sys.modules["safetensors"].SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise rundir.cannot_write(folder, e) from None


INT_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "num_hidden_layers", "vocab_size", "max_position_embeddings", "rank", "head_dim")


def config_kwargs(c, folder):
    """model.Config keyword arguments of an hf or cola config.json; ValueError with one line for a
    missing key, a value of the wrong type, or what this project cannot hold."""
    kind = c.get("model_type")
    if kind not in ("llama", "cola", "boost"):
        raise ValueError(f"{folder}: model_type={kind!r} is not llama, boost or cola")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise ValueError(f"{folder}: {key}=true: this project's projections have no bias")
    if c.get("hidden_act", "silu") != "silu" or c.get("rope_scaling"):
        raise ValueError(f"{folder}: hidden_act={c.get('hidden_act')}, "
                         f"rope_scaling={c.get('rope_scaling')}: "
                         "only silu and plain RoPE are supported")
    needed = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
              "vocab_size")
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
        raise ValueError(f"{folder}: head_dim={c['head_dim']} is not "
                         f"hidden_size/num_attention_heads={d // h}")
    kw = dict(arch="full" if kind == "llama" else "cola", n_layer=c["num_hidden_layers"], n_head=h,
              n_kv_head=c.get("num_key_value_heads") or h, n_embd=d,
              mlp_width=c["intermediate_size"],
              block_size=c.get("max_position_embeddings") or 2048, vocab_size=c["vocab_size"],
              rope_base=float(c.get("rope_theta", 10000.0)),
              norm_eps=float(c.get("rms_norm_eps", 1e-6)),
              tie_embeddings=bool(c.get("tie_word_embeddings", False)))
    if kind == "boost":
        for key, typ in BOOST_KEYS.items():
            if not isinstance(c.get(key), typ) or (typ is int and isinstance(c[key], bool)):
                raise ValueError(f"{folder}: config.json's {key}={c.get(key)!r} is not a "
                                 f"{typ.__name__}")
        kw.update(arch=c["boost_arch"], attn_rank=c["attn_rank"], mlp_rank=c["mlp_rank"],
                  mlp_gate=c["mlp_gate"], lax=c["lax"], lax_gate=c["lax_gate"])
    elif kind == "cola":   # CoLA's k, v are n_head·head_dim wide whatever num_key_value_heads says
        kw.update(attn_rank=c["rank"], mlp_rank=c["rank"],
                  mlp_gate="none" if c.get("only_lr_act", True) else "silu",
                  n_kv_head=h)
    else:
        kw.update(mlp_gate="silu")
    return kw


def read(folder):
    """(model.Config keyword arguments, single-device state dict, tokenizer or None) of an hf or
    cola folder, every tensor of the model present with its shape and none left over; ValueError
    with one line otherwise."""
    path = os.path.join(folder, "config.json")
    if os.path.lexists(path) and not os.path.isfile(path):   # (a FIFO would block the read)
        raise ValueError(f"{folder}: config.json is not a plain file")
    try:
        with open(path) as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder} is not a model folder: config.json is unreadable "
                         f"({type(e).__name__})") from None
    if not isinstance(c, dict):
        raise ValueError(f"{folder}: config.json is not a JSON object")
    kw = config_kwargs(c, folder)
    try:
        cfg = llama.Config(**kw)
    except ValueError as e:
        raise ValueError(f"{folder}: config.json describes no model this project can build "
                         f"({e})") from None
    kind = c["model_type"]
    tensors = weights.load(folder, needed_shapes(cfg, kind),
                           optional={"lm_head.weight"})   # (tied: none)
    return kw, from_format(tensors, cfg, kind), c.get("boost_tokenizer")


def needed_shapes(cfg, kind):
    """{name: shape} of the tensors a folder of cfg's model holds, in its format: a model of two
    layers is built on the meta device, and its last layer's names repeated (no model of cfg's size
    is built: a config.json may describe one that would not fit)."""
    small = llama.Config(**{**cfg.shape(), "n_layer": min(cfg.n_layer, 2)})
    with torch.device("meta"):
        state = llama.Llama(small).state_dict()
    named = to_format(state, small, kind)   # (the folder's own model_type, not re-derived)
    out, last = {}, f".layers.{small.n_layer - 1}."
    for name, t in named.items():
        if last in name:
            out.update({name.replace(last, f".layers.{i}."): tuple(t.shape)
                        for i in range(small.n_layer - 1, cfg.n_layer)})
        else:
            out[name] = tuple(t.shape)
    return out


def from_format(tensors, cfg, kind):
    """The single-device state dict of a folder's tensors (llama, boost or cola names), checked by
    read()."""
    same, projections = tensor_names(cfg)
    state = {ours: tensors[theirs] for ours, theirs in same}
    state["lm_head.weight"] = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    for dst, src in projections:
        if cfg.arch == "full":
            state[dst + "weight"] = tensors[src + "weight"]
        elif kind == "boost":
            state.update({dst + k[len(src):]: v for k, v in tensors.items() if k.startswith(src)})
        else:
            state[dst + "A.weight"] = tensors[src + "cola_a"].t().contiguous()   # (r, in)
            state[dst + "B.weight"] = tensors[src + "cola_b"].t().contiguous()   # (out, r)
    return state
