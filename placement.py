"""placement.py: where a run's processes sit and the model each of them holds.

BOOST (arXiv 2512.12131) section 3 places a model on a (dp, pp, tp) mesh of processes; this is the
step of train.py that does it: the process group and the mesh under torchrun (NCCL on GPUs, gloo
elsewhere), this rank's coordinates in it, and this rank's part of the single-device model
(layouts.TPLlama cuts it). explain.py and tools/bench_gpu.py build their models here too.
"""
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import checkpointing
import dp_shard
import kernels
import layouts
import parallel
from model import Llama


@dataclass
class Placement:
    """Where this process sits in the (dp, pp, tp) mesh (parallel.init_mesh), and on which device."""
    world: int
    dp: int
    device: str
    mesh: object = None
    tp: parallel.TP = field(default_factory=lambda: parallel.TP(None, 0, 1))   # a group of one
    dp_rank: int = 0
    pp_rank: int = 0
    host_group: object = None   # gloo, over every rank, whatever the device

    def group(self, name):
        return self.mesh.get_group(name) if self.mesh is not None else None

    @property
    def ckpt_mesh(self):  # a stage's tensors are sharded over its own (dp, tp) ranks in a checkpoint
        return self.mesh["dp", "tp"] if self.mesh is not None else None


def place_processes(tc, world, dp, device):
    """The process group and the (dp, pp, tp) mesh under torchrun (NCCL on GPUs, gloo elsewhere)."""
    if world == 1:
        return Placement(world, dp, device)
    if device == "cuda":
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    mesh = parallel.init_mesh(dp, tc.tp, device.split(":")[0], tc.timeout_s, tc.pp)
    tp = parallel.TP(mesh.get_group("tp"), mesh.get_local_rank("tp"), tc.tp, tc.overlap)
    kernels.agree_over(mesh.get_group("tp"), mesh.get_group("dp"))   # a stage's ranks choose kernels alike
    host = dist.new_group(backend="gloo")   # CPU-side agreements (interrupts) that must not wait for the GPU
    return Placement(world, dp, device, mesh, tp, mesh.get_local_rank("dp"), mesh.get_local_rank("pp"), host)


def compute_dtype(tc, device):
    """--dtype as the run computes in: auto is bfloat16 on a GPU that has it, else float32."""
    if tc.dtype != "auto":
        return tc.dtype
    return "bfloat16" if device.startswith("cuda") and torch.cuda.is_bf16_supported() else "float32"


def build_model(cfg, tc, place, layout):
    """The model this rank trains, and the full model's parameter and FLOP counts. Every layout is
    cut from the single-device model built from one seed, so every layout starts from the same
    weights: under TP or PP this rank's part of it (layouts.TPLlama); on one device with the Triton
    kernels on, the BTP layer with a TP group of one (so one GPU runs the fused kernels too);
    otherwise model.Llama itself, the reference the tests compare every layout with."""
    torch.manual_seed(tc.seed)
    model = Llama(cfg, recompute=tc.recompute, layer_runner=checkpointing.run_layers)
    counts = model.num_params(), model.flops_per_token(cfg.block_size)
    if tc.tp > 1 or tc.pp > 1:
        model = layouts.TPLlama(model, place.tp, layout, stage=place.pp_rank, stages=tc.pp)
    elif cfg.lowrank and kernels.backend() != "torch":
        model = layouts.TPLlama(model, place.tp, "btp")
    model = model.to(place.device)
    if tc.dp_shard != "none":   # FSDP2 over the dp ranks, before the optimizer sees the parameters
        dp_shard.apply(model, place.mesh["dp"], tc.dp_shard, compute_dtype(tc, place.device), parallel.LEDGER)
    return model, *counts


ACTIVATION_BYTES = 34 * 4   # saved and transient bytes a token, a layer, a unit of width (measured)


def footprint(cfg, tc, n_params, place):
    """(estimated peak bytes of one rank: {"state", "activations", "logits"}, bytes one rank of this
    machine may use). State: fp32 weights, gradients and AdamW's two moments, 16 bytes a parameter,
    cut by tp and pp (and dp under --dp_shard); activations ≈ 34·d·4 bytes a token a layer, and the
    logits with their softmax and gradient, 3·V·4 bytes a token, of a micro-batch: both measured
    on this project's models (within 15% of the peak RSS of d=256..512, V=320..50304)."""
    tokens = tc.batch_size * cfg.block_size
    shard = tc.tp * tc.pp * (place.dp if tc.dp_shard != "none" else 1)
    parts = {"state": 16 * n_params / shard,
             "activations": ACTIVATION_BYTES * cfg.n_embd * tokens * cfg.n_layer / (tc.tp * tc.pp),
             "logits": 3 * 4 * cfg.vocab_size * tokens / tc.tp}
    if place.device.startswith("cuda"):
        machine = torch.cuda.get_device_properties(place.device).total_memory
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", place.world))
        machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / local
    return parts, machine


def sizing_line(cfg, tc, n_params, place):
    """One line a run starts with: the share of the parameters in the embedding and head, and the
    estimated peak memory of a rank against what this machine has for it (a warning above 90%)."""
    emb = cfg.vocab_size * cfg.n_embd * (1 if cfg.tie_embeddings else 2)
    parts, machine = footprint(cfg, tc, n_params, place)
    need = sum(parts.values())
    line = (f"sizing: the embedding{'' if cfg.tie_embeddings else ' and head'} hold "
            f"{100 * emb / n_params:.0f}% of the parameters (vocabulary {cfg.vocab_size:,} × "
            f"n_embd {cfg.n_embd}); about {need / 1e9:.1f} GB a rank at the peak (state "
            f"{parts['state'] / 1e9:.1f}, activations {parts['activations'] / 1e9:.1f}, logits "
            f"{parts['logits'] / 1e9:.1f}) of the {machine / 1e9:.1f} GB this machine has for it")
    if need > 0.9 * machine:
        line += ("; MORE THAN IT HAS: lower --batch_size (--gradient_accumulation_steps keeps the "
                 "batch), use --recompute, or more ranks")
    return line
