"""plan.py: a run's plan, resolved once before any work: where it runs and how it is laid out.

BOOST (arXiv 2512.12131) §3-6 lay a model out on (dp, pp, tp) processes; a run's options say how,
some of them `auto`. Here they are resolved once, with every check that can fail, into a `Plan`
that placement.py and train.py read and never resolve again: the data-parallel degree, the
layout, the device and the dtype; and, for a resumed run, the options its checkpoint recorded.
"""
import math
import os
from dataclasses import asdict, dataclass

import torch

from recompute import check_recompute
import layouts
from extensions import cuda_graph, pipeline
from model import Config
from plumbing import options, rundir, train_state
from plumbing.options import TrainConfig
from plumbing.tokenizer import need


def resolve(argv, world, log):
    """(the run's Plan, the train_state.Resume it continues or None): the options of argv, or under
    --init_from=resume those its newest intact checkpoint recorded where argv does not give them;
    the tokenizer checked against that checkpoint's (its file gone or changed: one line) and its
    vocabulary; every check made before any work (ValueError)."""
    cfg, tc = options.parse_args(argv)
    resume = options.resume_plan(argv, tc, log)
    if resume:   # continue the run: the options its checkpoint recorded, unless argv gives them
        cfg, tc = resume.cfg, resume.tc
    if resume and tc.tokenizer == resume.meta.get("tokenizer"):   # its file gone or changed?
        train_state.check_tokenizer(resume.found[0], resume.meta, tc.tokenizer)
    cfg.vocab_size = options.vocab_size(tc.tokenizer)
    if resume:
        train_state.read_meta(resume.found[0], cfg.shape(), tc.tokenizer)
    if tc.tensorboard:   # (one line now, not a traceback after the model is built)
        need("tensorboard", "--tensorboard=true")
        rundir.check_tensorboard(tc.out_dir)
    return make(cfg, tc, world), resume


@dataclass
class Plan:
    """A run as resolved once, before any work, from its options and its world size: every later
    step (placement.py, train.py, explain.py) reads these and resolves nothing again."""
    cfg: Config
    tc: TrainConfig
    world: int      # processes (torchrun's WORLD_SIZE)
    dp: int         # data-parallel degree: world / (tp · pp) unless --dp gives it
    layout: str     # btp | vanilla | megatron (auto: btp for low-rank, megatron for dense)
    device: str     # cpu | cuda:N (auto and cuda resolved: under torchrun each rank its own GPU)
    dtype: str      # float32 | bfloat16 (auto: bfloat16 on a GPU that has it)


def make(cfg, tc, world):
    """The run's Plan; ValueError where the layout cannot split the model, the world does not
    factor into dp × pp × tp, or the recompute mode does not apply."""
    dp = tc.dp or max(1, world // (tc.tp * tc.pp))
    if dp * tc.pp * tc.tp != world:
        raise ValueError(f"world size {world} is not dp × pp × tp = {dp} × {tc.pp} × {tc.tp}: "
                         "set --dp, --pp and --tp, or torchrun --nproc_per_node")
    if tc.gradient_accumulation_steps % dp:
        raise ValueError(f"gradient_accumulation_steps={tc.gradient_accumulation_steps} is not "
                         f"divisible by the {dp} data-parallel ranks")
    layout = tc.layout if tc.layout != "auto" else layouts.default_layout(cfg)
    layouts.check_divisible(cfg, tc.tp, layout, tc.pp)
    n_micro = tc.gradient_accumulation_steps // dp
    if tc.pp > 1 or tc.pp_virtual_stages > 1:
        check_pipeline(cfg, tc, n_micro, dp)
    elif tc.pp_schedule != "1f1b":   # (the default: a run without a pipeline schedules nothing)
        raise ValueError(f"--pp_schedule={tc.pp_schedule} schedules a pipeline: it needs --pp > 1")
    if tc.inject_fault.startswith("nan") and tc.pp > 1:
        raise ValueError(f"--inject_fault={tc.inject_fault} poisons a loss outside a pipeline's "
                         "schedule: not with --pp > 1")
    if tc.dp_shard != "none":
        check_dp_shard(tc, dp)
    check_recompute(cfg, tc.recompute)
    device = resolve_device(tc.device)
    why = tc.cuda_graph and cuda_graph.refusal(tc, device, dp)
    if why:
        raise ValueError(why)
    return Plan(cfg, tc, world, dp, layout, device, compute_dtype(tc, device))


def resolve_device(device):
    """cpu or cuda:N, whatever way --device wrote it: auto is a GPU where there is one; a GPU
    without an index (auto, cuda) is this process's own, torchrun's LOCAL_RANK (0 alone).
    torch.cuda.set_device refuses a device without an index, and so does NCCL's device check."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    where = torch.device(device)
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return str(where)


def compute_dtype(tc, device):
    """--dtype as the run computes in: auto is bfloat16 on a GPU that has it, else float32."""
    if tc.dtype != "auto":
        return tc.dtype
    cuda = device.startswith("cuda") and torch.cuda.is_bf16_supported()
    return "bfloat16" if cuda else "float32"


def check_pipeline(cfg, tc, n_micro, dp):
    """The pipeline's stages and micro-batches fit its schedule (ValueError naming the
    constraint): extensions/pipeline.py's schedules and what each needs."""
    sched, pp, v = f"--pp_schedule={tc.pp_schedule}", tc.pp, tc.pp_virtual_stages
    more = f"raise gradient_accumulation_steps (the micro-batches times dp={dp})"
    if pp == 1:
        raise ValueError(f"--pp_virtual_stages={v} cuts the pipeline's stages: it needs pp > 1")
    if tc.compile:   # (torch.distributed.pipelining calls the stages itself, uncompiled)
        raise ValueError("compile=true does not reach a pipeline's stages (its schedule runs them "
                         "eager): leave --compile off with --pp > 1")
    if tc.pp_schedule in pipeline.SINGLE and v > 1:
        raise ValueError(f"{sched} runs one stage a rank: --pp_virtual_stages={v} needs "
                         "interleaved_1f1b, zero_bubble, zbv or dualpipev")
    if tc.pp_schedule in pipeline.V_SHAPED and v != 2:
        raise ValueError(f"{sched} holds two stages a rank, in a V: give --pp_virtual_stages=2")
    if cfg.n_layer % (pp * v):
        raise ValueError(f"n_layer={cfg.n_layer} cannot be split into pp × pp_virtual_stages = "
                         f"{pp} × {v} = {pp * v} equal stages")
    need = {"gpipe": 1, "dualpipev": 2 * pp, "zbv": 2 * pp}.get(tc.pp_schedule, pp)
    if n_micro < need:
        raise ValueError(f"{sched} needs at least {need} micro-batches per data-parallel rank "
                         f"(pp={pp}), this run has {n_micro}: {more} or use --pp_schedule=gpipe")
    if tc.dp_shard != "none" and tc.pp_schedule in pipeline.SPLIT_BACKWARD and \
            len(pipeline.stages_of(0, pp, v, tc.pp_schedule)) > 1:
        raise ValueError(f"{sched} with several stages a rank does not compose with --dp_shard: "
                         "its weight pass looks for the stage's parameters, and FSDP2 computes "
                         "with gathered copies; use one stage a rank or interleaved_1f1b")
    rounds = max(1, n_micro // pp)   # (torch's interleaved schedules run the micro-batches so)
    if tc.pp_schedule in ("interleaved_1f1b", "zero_bubble") and n_micro % rounds:
        raise ValueError(f"{sched} runs its {n_micro} micro-batches per data-parallel rank in "
                         f"rounds of pp={pp}: give a multiple of {rounds} "
                         f"(gradient_accumulation_steps {rounds * pp * dp})")


def check_dp_shard(tc, dp):
    """What --dp_shard composes with in this version (ValueError naming the rest)."""
    if dp == 1:
        raise ValueError(f"dp_shard={tc.dp_shard} shards over the data-parallel ranks, and this "
                         f"run has dp=1")
    if tc.compile:  # (FSDP2 under torch.compile wants per-layer compilation: not built, not tested)
        raise ValueError(f"dp_shard={tc.dp_shard} does not compose with compile=true yet; "
                         f"dp_shard=none does")


def say_schedule_change(recorded, tc, it, get_lr, log):
    """One line, logged and returned, where resuming at iteration `it` moves the learning-rate
    schedule the checkpoint's run followed (its options `recorded`: a larger --max_iters stretches
    the cosine); else None. get_lr(it, tc): train.py's schedule."""
    kept = {k: recorded[k] for k in SCHEDULE if k in recorded}
    old = type(tc)(**{**asdict(tc), **kept})
    was, now = get_lr(it, old), get_lr(it, tc)
    if math.isclose(was, now):   # (the same schedule, or one that agrees here)
        return None
    ends = old.lr_decay_iters or old.max_iters
    line = (f"the learning-rate schedule changes on resuming: {was:.2e} at iteration {it} becomes "
            f"{now:.2e} (to keep the old one, pass --lr_decay_iters={ends})")
    log(line)
    return line


SCHEDULE = ("learning_rate", "min_lr", "warmup_iters", "lr_decay_iters", "max_iters")
