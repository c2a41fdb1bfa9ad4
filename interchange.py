"""interchange.py: this project's models in the formats other tools read, and back.

Not in the BOOST paper (arXiv 2512.12131); what lets a model trained with BTP be evaluated (and a
CoLA model trained elsewhere be trained on with BTP). boost-notes §9 states both formats:

  hf    Hugging Face Llama (`model_type: llama`, `LlamaForCausalLM` loads it without custom code,
        and so does lm-evaluation-harness). It computes down(silu(gate)·up) with dense projections,
        so it holds the dense model, and the svd model after merging each W = B·A (exact: σ is the
        identity there).
  cola  the official CoLA format (`model_type: cola`, CoLA's `ColaForCausalLM`): every projection
        is x @ cola_a, σ = hidden_act, @ cola_b, with cola_a (in, r) = A.weight.T and cola_b
        (r, out) = B.weight.T; one `rank` for all projections; `only_lr_act` true for
        down(gate·up), false for down(silu(gate)·up). Its k and v are n_head·head_dim wide.

A folder is config.json (written with json) and pytorch_model.bin (torch.save of the weights),
which both readers accept; `boost_tokenizer` in config.json names the tokenizer. What a format
cannot represent is refused with one line (ValueError).
"""
import json
import os

import torch

FORMATS = ("hf", "cola")
PROJECTIONS = [("attn", "self_attn", n) for n in "qkvo"] + [("mlp", "mlp", n) for n in ("gate", "up", "down")]


def check(cfg, fmt):
    """ValueError naming what `fmt` cannot represent of this model."""
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


def to_format(state, cfg, fmt):
    """{name: tensor} of the model's state dict (single-device names) in format `fmt`."""
    check(cfg, fmt)
    out = {"model.embed_tokens.weight": state["tok_emb.weight"], "model.norm.weight": state["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.n_layer):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        out[theirs + "input_layernorm.weight"] = state[ours + "attn_norm.weight"]
        out[theirs + "post_attention_layernorm.weight"] = state[ours + "mlp_norm.weight"]
        for block, hf_block, n in PROJECTIONS:
            src, dst = f"{ours}{block}.{n}.", f"{theirs}{hf_block}.{n}_proj."
            if cfg.arch == "full":
                out[dst + "weight"] = state[src + "weight"]
            elif fmt == "hf":   # svd: W = B·A, (out, r) @ (r, in)
                out[dst + "weight"] = state[src + "B.weight"] @ state[src + "A.weight"]
            else:
                out[dst + "cola_a"] = state[src + "A.weight"].t().contiguous()   # (in, r)
                out[dst + "cola_b"] = state[src + "B.weight"].t().contiguous()   # (r, out)
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def write(folder, state, cfg, fmt, tokenizer):
    """A folder in format `fmt` (config.json, pytorch_model.bin); refuses to write into a non-empty one."""
    tensors = to_format(state, cfg, fmt)
    if os.path.exists(folder) and os.listdir(folder):
        raise ValueError(f"{folder} exists and is not empty: choose another folder")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config(cfg, fmt, tokenizer), f, indent=1)
    torch.save(tensors, os.path.join(folder, "pytorch_model.bin"))


def read(folder):
    """(model.Config keyword arguments, single-device state dict, tokenizer or None) of an hf or cola
    folder; ValueError with one line for what this project cannot hold."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            c = json.load(f)
        tensors = torch.load(os.path.join(folder, "pytorch_model.bin"), weights_only=True, map_location="cpu")
    except (OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{folder} is not a model folder with config.json and pytorch_model.bin ({type(e).__name__})") from None
    kind = c.get("model_type")
    if kind not in ("llama", "cola"):
        raise ValueError(f"{folder}: model_type={kind!r} is not llama or cola")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise ValueError(f"{folder}: {key}=true: this project's projections have no bias")
    if c.get("hidden_act", "silu") != "silu" or c.get("rope_scaling"):
        raise ValueError(f"{folder}: hidden_act={c.get('hidden_act')}, rope_scaling={c.get('rope_scaling')}: "
                         "only silu and plain RoPE are supported")
    d, h = c["hidden_size"], c["num_attention_heads"]
    if c.get("head_dim", d // h) != d // h:
        raise ValueError(f"{folder}: head_dim={c['head_dim']} is not hidden_size/num_attention_heads={d // h}")
    kw = dict(arch="full" if kind == "llama" else "cola", n_layer=c["num_hidden_layers"], n_head=h,
              n_kv_head=c.get("num_key_value_heads") or h, n_embd=d, mlp_width=c["intermediate_size"],
              block_size=c.get("max_position_embeddings", 2048), vocab_size=c["vocab_size"],
              rope_base=float(c.get("rope_theta", 10000.0)), norm_eps=float(c.get("rms_norm_eps", 1e-6)),
              tie_embeddings=bool(c.get("tie_word_embeddings", False)))
    if kind == "cola":
        kw.update(attn_rank=c["rank"], mlp_rank=c["rank"], mlp_gate="none" if c.get("only_lr_act", True) else "silu",
                  n_kv_head=h)   # CoLA's k and v are n_head·head_dim wide whatever num_key_value_heads says
    else:
        kw.update(mlp_gate="silu")
    state = {"tok_emb.weight": tensors["model.embed_tokens.weight"], "norm.weight": tensors["model.norm.weight"],
             "lm_head.weight": tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])}
    try:
        for i in range(kw["n_layer"]):
            ours, theirs = f"layers.{i}.", f"model.layers.{i}."
            state[ours + "attn_norm.weight"] = tensors[theirs + "input_layernorm.weight"]
            state[ours + "mlp_norm.weight"] = tensors[theirs + "post_attention_layernorm.weight"]
            for block, hf_block, n in PROJECTIONS:
                src, dst = f"{theirs}{hf_block}.{n}_proj.", f"{ours}{block}.{n}."
                if kind == "llama":
                    state[dst + "weight"] = tensors[src + "weight"]
                else:
                    state[dst + "A.weight"] = tensors[src + "cola_a"].t().contiguous()   # (r, in)
                    state[dst + "B.weight"] = tensors[src + "cola_b"].t().contiguous()   # (out, r)
    except KeyError as e:
        raise ValueError(f"{folder}: pytorch_model.bin has no {e.args[0]}") from None
    return kw, state, c.get("boost_tokenizer")
