"""checkpointing.py: low-rank activation checkpointing, and sharded training-state checkpoints.

Part 1, activation checkpointing, BOOST (arXiv 2512.12131) section 5. `--recompute=` chooses what
autograd keeps between forward and backward:

  none     everything the ops save (many d- and d_ff-sized tensors per layer).
  layer    whole-block recompute (torch.utils.checkpoint, non-reentrant): each layer keeps only its
           input; backward replays the whole layer, including its forward all-reduces under TP.
  lowrank  segments aligned with the BTP chunks (CoLA-M's segmentation). A segment starts from a
           replicated latent after its all-reduce (and the residual slice where it needs it) and
           ends with the local partial product of the next down-projection A, before its
           all-reduce. So the collectives stay outside the segments and recomputing them in
           backward issues none; the last GEMM of a segment (that A) is not recomputed at all
           (non-reentrant checkpoint stops once the tensors backward needs are rebuilt).

One layer under BTP, segments [ ... ], all-reduces between them (b s elided; t = tp degree):

   [x (d/t) -> RMSNorm·A_qkv partial] -> AR(3r+1) ->
   [σ(H/rms) -> B_q,B_k,B_v -> attention on local heads -> A_o partial] -> AR(r) ->
   [σ -> B_o -> x' = x + .  -> RMSNorm·A_gu partial] -> AR(2r+1) ->
   [σ(H/rms) -> B_gate,B_up -> gate·up (f/t) -> A_down partial] -> AR(r) ->
   [σ -> B_down -> x'' = x' + . -> next layer's RMSNorm·A_qkv partial] -> AR(3r+1) -> ...

Saved per token per layer with `lowrank` (e = bytes per activation element; with rank ra for
attention and rm for the MLP):
  btp          (4·ra + 3·rm + 2 + 2·d/t)·e       the all-reduced latents (q/k/v and gate/up with
                                                  their norm statistic) and the residuals x and x'
  one device   (4·ra + 3·rm + 2·d)·e             the latents A·x and the residuals x and x'
  vanilla      (4·ra/t + 3·rm/t + 2·d)·e         local latent slices, replicated residuals; here
                                                  each B ends in an all-reduce inside its segment,
                                                  so recompute replays them (the paper's point)
With `layer`: d/t·e (btp) or d·e (one device, vanilla, megatron) per token per layer.

Part 2, training-state checkpoints (what a run of days needs; not in the paper). Saved through
torch.distributed.checkpoint (DCP): every rank writes its own shards, nothing is gathered. Each
tensor is stored under its single-device name (`model.layers.0.attn.q.A.weight`,
`optim.exp_avg.<same>`) as a DTensor sharded like the layout holds it, so DCP can load it into any
other layout (tp=2 -> 1, 4, dp×tp 2×2) or into one process. A checkpoint is a folder
<out_dir>/checkpoints/iter_NNNNNNN/ with the DCP files and meta.json (iteration, config, file
sizes), written under a temporary name and renamed when complete; the data position is the
iteration (batches are drawn from (seed, step)).
"""
import glob
import json
import logging
import os
import shutil
import warnings

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import model as llama

RECOMPUTE = ("none", "layer", "lowrank")


def forward_chunks(block, x, cos, sin):
    """One layer through its chunks, no recompute (the forward of BTPBlock and VanillaBlock)."""
    u = block.reduce(block.attn_chunk(block.reduce(block.qkv_down(x)), cos, sin))
    x, partial = block.o_chunk(u, x)
    u = block.reduce(block.mlp_chunk(block.reduce(partial)))
    return block.down_chunk(u, x)


class OneDeviceChunks:
    """model.Block (arch svd or cola) seen as the same chunks; its latents are A·x, no collectives."""

    def __init__(self, block):
        self.b, self.cfg = block, block.attn.cfg
        self.act = llama.latent_act(self.cfg.arch)

    def reduce(self, partial):
        return partial

    def qkv_down(self, x):
        a, h = self.b.attn, self.b.attn_norm(x)                            # (b, s, d)
        return torch.cat([a.q.A(h), a.k.A(h), a.v.A(h)], -1)               # (b, s, 3r)

    def attn_chunk(self, z, cos, sin):
        a, cfg = self.b.attn, self.cfg
        zq, zk, zv = self.act(z).split(cfg.attn_rank, -1)
        y = llama.causal_attention(a.q.B(zq), a.k.B(zk), a.v.B(zv), cfg.n_head, cfg.n_kv_head, cos, sin)
        return a.o.A(y)                                                    # (b, s, r)

    def o_chunk(self, u, x):
        x = x + self.b.attn.o.B(self.act(u))                              # (b, s, d)
        m, h = self.b.mlp, self.b.mlp_norm(x)
        return x, torch.cat([m.gate.A(h), m.up.A(h)], -1)                  # (b, s, 2r)

    def mlp_chunk(self, z):
        m = self.b.mlp
        zg, zu = self.act(z).split(self.cfg.mlp_rank, -1)
        return m.down.A(llama.gated_product(self.cfg.arch, m.gate.B(zg), m.up.B(zu)))  # (b, s, r)

    def down_chunk(self, u, x):
        return x + self.b.mlp.down.B(self.act(u))                         # (b, s, d)


def _segment(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False)


def _down_then_next(block, nxt):
    """The segment that crosses a layer boundary: B_down, the residual add, the next A_qkv partial."""
    def fn(u, x):
        x = block.down_chunk(u, x)
        return x, nxt.qkv_down(x)
    return fn


def run_layers(layers, x, cos, sin, recompute):
    """Run the decoder layers on x with the chosen activation checkpointing."""
    if recompute == "none":
        for layer in layers:
            x = layer(x, cos, sin)
        return x
    if recompute == "layer":
        for layer in layers:
            x = _segment(layer, x, cos, sin)
        return x
    blocks = [OneDeviceChunks(b) if isinstance(b, llama.Block) else b for b in layers]
    partial = _segment(blocks[0].qkv_down, x)
    for i, b in enumerate(blocks):
        u = b.reduce(_segment(b.attn_chunk, b.reduce(partial), cos, sin))
        x, partial = _segment(b.o_chunk, u, x)
        u = b.reduce(_segment(b.mlp_chunk, b.reduce(partial)))
        if i + 1 < len(blocks):
            x, partial = _segment(_down_then_next(b, blocks[i + 1]), u, x)
        else:
            x = _segment(b.down_chunk, u, x)
    return x


def check_recompute(cfg, recompute):
    """A clear ValueError where the mode does not apply to this model."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute} is not one of {', '.join(RECOMPUTE)}")
    if recompute == "lowrank" and not cfg.lowrank:
        raise ValueError("recompute=lowrank needs low-rank bottlenecks; arch=full uses none or layer")


class SavedBytes:
    """Bytes an autograd graph saves for backward, parameters excluded, each storage counted once.

        with SavedBytes(model) as meter:
            loss = model(x, y)[1]
        meter.bytes"""

    def __init__(self, module):
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.storages = {}

    def pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def bytes(self):
        return sum(self.storages.values())


# ------------------------------------------------------------------------ training-state checkpoints

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


def checkpoint_dirs(out_dir):
    """Complete checkpoints (published folders with meta.json), oldest first."""
    return sorted(d for d in glob.glob(os.path.join(out_dir, "checkpoints", "iter_*"))
                  if not d.endswith(".tmp") and os.path.exists(os.path.join(d, "meta.json")))


def save(out_dir, iter_num, raw_model, optimizer, mesh, meta, keep=2, before_publish=None):
    """Every rank writes its shards into iter_N.tmp; rank 0 records meta.json, renames, prunes."""
    import torch.distributed.checkpoint as dcp
    final = os.path.join(out_dir, "checkpoints", f"iter_{iter_num:07d}")
    tmp = final + ".tmp"
    master = not dist.is_initialized() or dist.get_rank() == 0
    if master:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    if dist.is_initialized():
        dist.barrier()
    with warnings.catch_warnings():  # DCP warns that one process means no process group: we know
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state_views(raw_model, optimizer, mesh), checkpoint_id=tmp, no_dist=mesh is None)
    if dist.is_initialized():
        dist.barrier()
    if before_publish:
        before_publish()  # the fault-injection hook of the tests: die before the rename
    if master:
        sizes = {f: os.path.getsize(os.path.join(tmp, f)) for f in sorted(os.listdir(tmp))}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({**meta, "iter_num": iter_num, "files": sizes}, f, indent=1)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)  # atomic: a reader sees the old set of checkpoints or the new one
        for old in checkpoint_dirs(out_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return final


def find(out_dir, init_from, config):
    """(folder, meta) of the checkpoint to resume from, checked against config, or (None, None)
    to start from scratch."""
    if init_from == "scratch":
        return None, None
    found = checkpoint_dirs(out_dir)
    if not found:
        if init_from == "resume":
            raise ValueError(f"--init_from=resume but there is no complete checkpoint in {out_dir}/checkpoints")
        return None, None
    return found[-1], read_meta(found[-1], config)


def check_writable(out_dir):
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write-test-{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"out_dir {out_dir} cannot be written ({e.strerror})") from None


def read_meta(path, config):
    """meta.json of a checkpoint, checked: files whole, model shape equal (naming the field)."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        for name, size in meta["files"].items():
            actual = os.path.getsize(os.path.join(path, name))
            if actual != size:
                raise ValueError(f"checkpoint {path} is truncated or corrupt: {name} has {actual} bytes, "
                                 f"{size} were written")
    except (OSError, KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint {path} is unreadable or corrupt ({type(e).__name__}: {e})") from None
    for key, value in config.items():
        if meta["config"].get(key) != value:
            raise ValueError(f"checkpoint {path} was written with {key}={meta['config'].get(key)}, "
                             f"this run has {key}={value}: pass the same model options")
    return meta


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


def export(path, out_file):
    """One unsharded file (torch.save) of a checkpoint: {'model': state dict, 'config': ...}."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    tmp = out_file + ".dcp.tmp"
    dcp_to_torch_save(path, tmp)
    flat = torch.load(tmp, weights_only=False)
    os.remove(tmp)
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    model = {k[len("model."):]: v for k, v in flat.items() if k.startswith("model.")}
    torch.save({"model": model, "config": meta["config"], "tokenizer": meta.get("tokenizer", "bytes")}, out_file)


def load_exported(out_file):
    """A model.Llama from an exported file."""
    blob = torch.load(out_file, weights_only=True)
    m = llama.Llama(llama.Config(**blob["config"]))
    m.load_state_dict(blob["model"])
    return m, blob["tokenizer"]


if __name__ == "__main__":
    import sys
    usage = ("usage: python checkpointing.py export <checkpoint folder> <file.pt>\n"
             "       python checkpointing.py sample <file.pt> [tokens]")
    if len(sys.argv) >= 4 and sys.argv[1] == "export":
        export(sys.argv[2], sys.argv[3])
        print(f"exported {sys.argv[2]} to {sys.argv[3]}")
    elif len(sys.argv) >= 3 and sys.argv[1] == "sample":
        import data
        m, tokenizer = load_exported(sys.argv[2])
        enc = data.get_tokenizer(tokenizer)
        out = m.generate(torch.tensor([[enc.eot_token]]), int(sys.argv[3]) if len(sys.argv) > 3 else 200, top_k=50)
        print(enc.decode([t for t in out[0, 1:].tolist() if t < enc.n_vocab]))
    else:
        sys.exit(usage)
