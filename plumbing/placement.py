"""placement.py: where a run's processes sit and the model each of them holds.

BOOST (arXiv 2512.12131) section 3 places a model on a (dp, pp, tp) mesh of processes; this is the
step of train.py that does it: the process group and the mesh under torchrun (NCCL on GPUs, gloo
elsewhere), this rank's coordinates in it, and this rank's part of the single-device model
(TPLlama cuts it). explain.py and tools/bench_gpu.py build their models here too. Importing
it wires in the extensions a run may use: LaX's layers and the Triton side of the local ops.
"""
import os
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


from tp_model import TPLlama
import local_ops
import parallel
from extensions import pipeline
import sharding
from extensions import dp_shard, kernel_choice
from extensions import lax_layers  # noqa: F401  (registers LaX's extension of the layers)
from model import Llama
from plumbing.rundir import duration


@dataclass
class Placement:
    """Where this process sits in the (dp, pp, tp) mesh (init_mesh), and on which device."""
    world: int
    dp: int
    device: str
    mesh: object = None
    # a group of one
    tp: parallel.TPGroup = field(default_factory=lambda: parallel.TPGroup(None, 0, 1))
    dp_rank: int = 0
    pp_rank: int = 0
    host_group: object = None   # gloo, over every rank, whatever the device
    threads: str = ""   # the CPU threads chosen, and why (choose_threads)

    def group(self, name):
        return self.mesh.get_group(name) if self.mesh is not None else None

    @property
    # a stage's tensors are sharded over its own (dp, tp) ranks in a checkpoint
    def ckpt_mesh(self):
        return self.mesh["dp", "tp"] if self.mesh is not None else None


def choose_threads(threads, device, local_world):
    """(intra-op threads for this process, why): `--threads`, else OMP_NUM_THREADS (torchrun sets
    1 a rank), else on a CPU the cores the 1-minute load average leaves idle, shared by this
    machine's ranks: a thread on a core another job holds makes every step wait for it (PyTorch's
    default, a thread a core, ran 10x slower on two busy cores)."""
    if threads:
        return threads, "--threads"
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]):
        return int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    if not device.startswith("cpu"):
        return torch.get_num_threads(), "PyTorch's default (the GPU computes)"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load, how = busy_now()
    busy = min(cores - 1, round(load))
    n = max(1, (cores - busy) // local_world)
    return n, (f"{cores} cores, {busy} busy by {how}, {local_world} rank(s) here; "
               "--threads=N to choose")


def busy_now(seconds=0.25, stat="/proc/stat", wait=time.sleep):
    """(cores busy with other work, how it was read): the CPU time /proc/stat counts over a quarter
    of a second (Linux), else the 1-minute load average, which still counts a job that ended a
    minute ago. (`stat` and `wait`: what the test reads between its own two snapshots.)"""
    def sample():
        with open(stat) as f:
            values = [int(v) for v in f.readline().split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)   # (idle, iowait)
        return sum(values) - idle, sum(values)
    try:
        (b0, t0), _, (b1, t1) = sample(), wait(seconds), sample()
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0], "the load average"
    return (b1 - b0) / max(1, t1 - t0) * (os.cpu_count() or 1), "the last 0.25 s of /proc/stat"


def place_processes(plan):
    """The process group and the (dp, pp, tp) mesh under torchrun (NCCL on GPUs, gloo elsewhere);
    this process's CPU threads (choose_threads)."""
    tc, world, dp, device = plan.tc, plan.world, plan.dp, plan.device
    n, why = choose_threads(tc.threads, device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(n)
    threads = f"{n} thread{'s' if n > 1 else ''} ({why})"
    if device.startswith("cuda"):   # Triton launches and NCCL use the current device
        torch.cuda.set_device(torch.device(device))   # (plan.resolve_device gave it its index)
    if world == 1:
        return Placement(world, dp, device, threads=threads)
    mesh = init_mesh(dp, tc.tp, device.split(":")[0], tc.timeout_s, tc.pp)
    tp = parallel.TPGroup(mesh.get_group("tp"), mesh.get_local_rank("tp"), tc.tp, tc.overlap)
    # a stage's ranks choose kernels alike
    kernel_choice.agree_over(mesh.get_group("tp"), mesh.get_group("dp"))
    # CPU-side agreements (interrupts) that must not wait for the GPU
    host = dist.new_group(backend="gloo")
    return Placement(world, dp, device, mesh, tp, mesh.get_local_rank("dp"),
                     mesh.get_local_rank("pp"), host, threads)


def build_model(plan, place, init=True):
    """The model this rank trains, and the full model's parameter and FLOP counts, in the order
    torchtitan's parallelize step takes: the single-device reference on the meta device (shapes
    and initialisation rules only, its init_seed drawn after torch.manual_seed(seed)) -> its
    counts -> this rank's layout of it (TPLlama: its TP shard and pipeline stage, at tp=1
    a TP group of one, btp for low-rank and megatron for dense) -> FSDP2 over dp (--dp_shard) ->
    memory on the device for this rank's part alone -> its values drawn (sharding.materialize:
    this rank's tiles alone, the values of the reference built whole from the seed, so every
    layout starts from the same weights), unless `init` is False: a checkpoint will overwrite
    them (a resume, an evaluation). DDP, the pipeline schedule and compile wrap it next
    (`wrap`)."""
    cfg, tc = plan.cfg, plan.tc
    torch.manual_seed(tc.seed)
    with torch.device("meta"):
        ref = Llama(cfg)
    counts = ref.num_params(), ref.flops_per_token(cfg.block_size)
    held = pipeline.stages_of(place.pp_rank, tc.pp, tc.pp_virtual_stages, tc.pp_schedule)
    model = TPLlama(ref, place.tp, plan.layout, stage=held, stages=tc.pp * len(held),
                            recompute=tc.recompute)
    if tc.dp_shard != "none":   # FSDP2 over the dp ranks, before the optimizer sees the parameters
        dp_shard.apply(model, place.mesh["dp"], tc.dp_shard, plan.dtype, parallel.LEDGER)
    model.to_empty(device=place.device)
    if init:
        sharding.materialize(model, ref)
    model.init_buffers()
    return model, *counts


def hardware_flops_per_token(cfg, layout, recompute):
    """The FLOPs a token costs the hardware in training, for HFU: the model's
    (Llama.flops_per_token, 6 a weight and attention as PaLM counts it; MFU's numerator) plus what
    --recompute replays in backward, counted by torch's FlopCounterMode over one forward and
    backward of this layout at a TP group of one, on the meta device (nothing computed;
    attention in SDPA's math form, counted as flops_per_token counts it: the tests check that
    without recompute the two are equal)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    with torch.random.fork_rng(devices=[]), torch.device("meta"):   # (Llama draws its seed)
        model = TPLlama(Llama(cfg), parallel.TPGroup(None, 0, 1), layout,
                                recompute=recompute)
        idx = torch.zeros(1, cfg.block_size, dtype=torch.long)                   # (1, s)
        with sdpa_kernel(SDPBackend.MATH), local_ops.reference(), \
                FlopCounterMode(display=False) as counter:
            model(idx, idx)[1].backward()
    return counter.get_total_flops() / cfg.block_size


def wrap(raw_model, tc, place, n_micro, warm=None):
    """(the model as trained, the pipeline or None): under pp > 1 the pipeline schedule over the
    stage (pipeline.Pipeline); else DDP over dp where --dp_shard does not shard (its gradient
    all-reduce recorded in the ledger), then torch.compile around it (so that DDPOptimizer splits
    the graph at its buckets). `warm()` runs first under compile: one eager step, so that
    --kernels=auto times every shape before tracing, which only reads the choices."""
    if tc.pp > 1:
        return raw_model, pipeline.Pipeline(raw_model, place.mesh, n_micro, tc.pp_schedule,
                                            place.device)
    model = raw_model
    if place.dp > 1 and tc.dp_shard == "none":
        cuda = place.device.startswith("cuda")
        model = DDP(model, process_group=place.group("dp"),
                    device_ids=[place.device] if cuda else None)
        model.register_comm_hook(place.group("dp"), ledger_ddp_hook)
    if tc.compile:
        if warm is not None and local_ops.backend() == "auto":
            warm()
        model = torch.compile(model)
    return model, None


# values saved and transient a token, a layer, a unit of width, and a token's logits per vocabulary
# entry, each in the run's compute dtype (measured on this project's models in fp32; bf16 autocast
# measured at 0.51 of fp32's activations, d=256 and 512)
ACTIVATION_VALUES, LOGIT_VALUES = 34, 3


def footprint(cfg, tc, n_params, place, dtype="float32"):
    """(`place`: a Place or the Plan, what it reads of both: device, dp, world)
    (estimated peak bytes of one rank: {"state", "activations", "logits"}, bytes one rank of this
    machine may use). State: fp32 weights, gradients and AdamW's two moments, 16 bytes a parameter,
    cut by tp and pp (and dp under --dp_shard); activations ≈ 34·d values a token a layer, and the
    logits with their softmax and gradient, 3·V values a token, of a micro-batch, each value in the
    compute dtype's bytes (4 in fp32, 2 under bf16 autocast): measured on this project's models
    (fp32 within 15% of the peak RSS of d=256..512, V=320..50304)."""
    tokens, size = tc.batch_size * cfg.block_size, getattr(torch, dtype).itemsize
    shard = tc.tp * tc.pp * (place.dp if tc.dp_shard != "none" else 1)
    parts = {"state": 16 * n_params / shard,
             "activations": ACTIVATION_VALUES * size * cfg.n_embd * tokens * cfg.n_layer /
             (tc.tp * tc.pp),
             "logits": LOGIT_VALUES * size * cfg.vocab_size * tokens / tc.tp}
    if place.device.startswith("cuda"):
        machine = torch.cuda.get_device_properties(place.device).total_memory
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", place.world))
        machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / local
    return parts, machine


def count_params(cfg):
    """The full model's parameter count by arithmetic, before anything is built: a reference of at
    most two layers on the meta device (under LaX the first layer has no crossing into it), its
    last layer times the layers left (so --n_layer=1000000 is counted in a moment, not built)."""
    with torch.device("meta"):
        few = Llama(replace(cfg, n_layer=min(cfg.n_layer, 2)))
    last = sum(p.numel() for p in few.layers[-1].parameters())
    return few.num_params() + (cfg.n_layer - len(few.layers)) * last


def check_fits(plan):
    """Refuse, before any work, a model whose weights, gradients and AdamW moments alone (16 bytes
    a parameter, cut by tp, pp and --dp_shard) exceed what this machine has for a rank: nothing
    could train it (ValueError). What is close is sizing_line's warning."""
    cfg, tc = plan.cfg, plan.tc
    n_params = count_params(cfg)
    parts, machine = footprint(cfg, tc, n_params, plan, plan.dtype)
    if parts["state"] > machine:
        raise ValueError(f"the model ({cfg.n_layer:,} layers, n_embd {cfg.n_embd}: "
                         f"{n_params / 1e6:,.0f}M parameters) needs {parts['state'] / 1e9:,.1f} GB "
                         f"a rank for its weights, gradients and AdamW moments, more than the "
                         f"{machine / 1e9:.1f} GB this machine has for one: a smaller model, or "
                         "more ranks (--tp, --pp, --dp_shard)")


def start_lines(plan, place, n_params, flops_per_token, optimizer, tokens_per_iter):
    """The lines a run starts with: the model and its placement, the options that differ from the
    defaults, Muon's collectives (as chosen), its memory, and its time."""
    from plumbing import options   # (options reads the kernels' names: imported when it speaks)
    cfg, tc = plan.cfg, plan.tc
    lines = [f"{cfg.arch}: {n_params / 1e6:.2f}M parameters, {flops_per_token / 1e6:.1f} "
             f"MFLOP/token, dp={plan.dp} pp={tc.pp} tp={tc.tp}" +
             (f" ({plan.layout})" if tc.tp > 1 else "") + local_ops.describe(place.device) +
             f", {tokens_per_iter:,} tokens/iter, {place.device} {plan.dtype}, {place.threads}",
             f"options: {options.chosen(cfg, tc)}"]
    lines += [optimizer.said] if optimizer.said else []
    rate = matmul_rate(place.device, plan.dtype)
    return lines + [sizing_line(cfg, tc, n_params, place, plan.dtype),
                    timing_line(flops_per_token, tokens_per_iter, tc, place.world, rate)]


def matmul_rate(device, dtype, n=512, reps=4):
    """FLOP/s of an n×n matmul on this device in the run's dtype, timed now (a few ms): no step
    runs its matmuls faster, so it bounds a step's time from below."""
    dtype = getattr(torch, dtype)
    a = torch.randn(n, n, device=device, dtype=dtype)   # (n, n)
    (a @ a).sum().item()   # (warm: the first call pays for its library's setup)
    t0 = time.perf_counter()
    for _ in range(reps):
        b = a @ a   # (n, n)
    b.sum().item()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def timing_line(flops_per_token, tokens_per_iter, tc, world, rate):
    """How long a step and an evaluation take at least: their FLOPs a rank computes (training:
    forward and backward, flops_per_token; evaluation: forward alone, a third, over eval_iters
    batches of each split) at `rate`. Small models fall short of it; a large one meets it."""
    step = flops_per_token * tokens_per_iter / world / rate
    evaluation = 2 * tc.eval_iters * flops_per_token / 3 * tokens_per_iter / world / rate
    said = lambda s: f"{s * 1e3:.0f} ms" if s < 1 else duration(s)
    return (f"time: at this device's matmul rate ({rate / 1e9:,.0f} GFLOP/s, measured now) a "
            f"step takes at least {said(step)} and an evaluation (every {tc.eval_interval} "
            f"steps) {said(evaluation)}")


def sizing_line(cfg, tc, n_params, place, dtype="float32"):
    """One line a run starts with: the share of the parameters in the embedding and head, and the
    estimated peak memory of a rank in the run's compute dtype against what this machine has for
    it (a warning above 90%)."""
    emb = cfg.vocab_size * cfg.n_embd * (1 if cfg.tie_embeddings else 2)
    parts, machine = footprint(cfg, tc, n_params, place, dtype)
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


# ------------------------------------------------------------------ the process group and mesh

def finish(world):
    """The end of a torchrun job's process: leave the group together (no rank closes its connections
    while a peer still uses them)."""
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def exit_worker(world):
    """The end of a spawned worker (tests, tools/bench.py): wait for the group, then exit at once,
    with no teardown (os._exit frees it all): at interpreter teardown gloo's threads can abort the
    process ('terminate called without an active exception'); a 4-rank worker once died of
    SIGSEGV in a suite run here (where, unknown): the group's destruction need not run at all."""
    if world > 1:
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def init_mesh(dp, tp, device_type, timeout_s, pp=1):
    """The (dp, pp, tp) DeviceMesh over the torchrun world, TP innermost (TP peers are adjacent
    ranks, on one node), then PP, then DP."""
    from torch.distributed.device_mesh import init_device_mesh
    if not dist.is_initialized():
        backend, timeout = ("nccl" if device_type == "cuda"
                            else "gloo"), timedelta(seconds=timeout_s)
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:
            # torchrun's store outlives a restarted worker group, and so do the old group's
            # addresses in it: each attempt keeps its keys under its own prefix, or peers dial dead
            # processes. The attempt is counted in the store itself (the restart count is per node).
            world = int(os.environ["WORLD_SIZE"])
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False, timeout=timeout)
            attempt = (store.add("boost/arrivals", 1) - 1) // world
            dist.init_process_group(backend,
                                    store=dist.PrefixStore(f"boost/attempt{attempt}", store),
                                    rank=int(os.environ["RANK"]), world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    mesh = init_device_mesh(device_type, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    for name in ("dp", "pp", "tp"):
        parallel.LEDGER.name(mesh.get_group(name), name)
    return mesh


def ledger_ddp_hook(group, bucket):
    """DDP communication hook: the default gradient all-reduce, recorded in the ledger."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    parallel.LEDGER.record("all_reduce", group, bucket.buffer(), "grad")
    return allreduce_hook(group, bucket)
