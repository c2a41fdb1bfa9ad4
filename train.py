"""train.py: the one training loop for the dense, svd and CoLA models, in nanoGPT's order.

BOOST (arXiv 2512.12131) trains low-rank bottleneck models at scale; this loop is the same on a
laptop CPU and on a GPU cluster:

    python train.py                                   # CoLA on the embedded corpus, CPU or GPU
    python train.py --arch=full --max_iters=200       # any option as --key=value; -h lists them all
    torchrun --standalone --nproc_per_node=2 train.py # data parallel (gloo on CPU, NCCL on GPU)

Every rank draws its share of the same global batch from (seed, step) (data.py), so the logged
loss, the mean over the global batch, is comparable line by line across layouts.
"""
import difflib
import inspect
import json
import math
import os
import re
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpointing
import data
import kernels
import layouts
import parallel
from model import ARCHS, Config, Llama, estimate_mfu
from parallel import LEDGER


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = "out"
    eval_interval: int = 250       # evaluate and save a checkpoint every this many iterations
    log_interval: int = 10
    eval_iters: int = 20           # batches per split in each evaluation
    init_from: str = "scratch"     # scratch | resume (the newest complete checkpoint) | auto (resume if one exists)
    keep_checkpoints: int = 2      # complete checkpoints kept in <out_dir>/checkpoints
    inject_fault: str = ""         # for tests: kill:N, nan:N (not with pp) or kill_in_save:N (first attempt only)
    # data
    dataset: str = data.EMBEDDED   # 'pydoc' (Python's help text, embedded) or a text file or folder
    tokenizer: str = "bytes"       # bytes (offline) | gpt2 (tiktoken's GPT-2 BPE)
    data_dir: str = "data"         # where prepared token files are kept
    batch_size: int = 16           # sequences per micro-step per data-parallel rank
    gradient_accumulation_steps: int = 1  # micro-steps per iteration, in total over the dp ranks
    # AdamW and the cosine schedule
    learning_rate: float = 3e-3
    max_iters: int = 2000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0         # 0: no clipping
    warmup_iters: int = 100
    lr_decay_iters: int = 0        # 0: max_iters
    min_lr: float = 3e-4
    # parallelism (under torchrun: world size = dp × pp × tp, TP peers are adjacent ranks)
    tp: int = 1                    # tensor-parallel degree
    dp: int = 0                    # data-parallel degree; 0: world size / (tp · pp)
    tp_mode: str = "auto"          # auto (btp for svd and cola, megatron for full) | btp | vanilla | megatron
    pp: int = 1                    # pipeline stages (n_layer / pp layers each)
    pp_schedule: str = "1f1b"      # 1f1b | gpipe (torch.distributed.pipelining)
    recompute: str = "none"        # activation checkpointing: none | layer | lowrank (checkpointing.py)
    kernels: str = "auto"          # auto (Triton on CUDA, PyTorch elsewhere) | triton | torch (kernels.py)
    # system
    device: str = "auto"           # auto | cpu | cuda | cuda:N
    dtype: str = "auto"            # auto (bfloat16 on a GPU that has it, else float32) | float32 | bfloat16
    compile: bool = False
    seed: int = 1337
    peak_tflops: float = 0.0       # your device's peak, for MFU; 0: report TFLOP/s only
    sample_tokens: int = 200       # generated at the end; 0: none
    timeout_s: int = 600           # process-group timeout


CHOICES = {"arch": ARCHS, "tokenizer": data.TOKENIZERS, "init_from": ("scratch", "resume", "auto"),
           "dtype": ("auto", "float32", "bfloat16"), "tp_mode": ("auto",) + layouts.LAYOUTS,
           "recompute": checkpointing.RECOMPUTE, "pp_schedule": ("1f1b", "gpipe"), "kernels": kernels.BACKENDS}
FAULTS = ("kill", "nan", "kill_in_save")


def fail(msg):
    """A user error: one line on stderr (once per job), exit status 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def _convert(key, typ, text):
    if typ is bool:
        if text.lower() in ("1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"--{key} expects true or false, got {text!r}")
    try:
        return typ(text)
    except ValueError:
        raise ValueError(f"--{key} expects {'an integer' if typ is int else 'a number'}, got {text!r}") from None


def options():
    """Every command-line option: name -> (dataclass, field). vocab_size comes from the tokeniser."""
    return {f.name: (cls, f) for cls in (Config, TrainConfig) for f in fields(cls) if f.name != "vocab_size"}


def usage():
    """Every option with its default and the comment it has in its dataclass."""
    lines = ["usage: [torchrun ...] train.py [--key=value ...]", ""]
    for cls, title in ((Config, "model"), (TrainConfig, "training")):
        notes = dict(re.findall(r"^\s+(\w+): \w+ = [^#\n]*#\s*(.*)$", inspect.getsource(cls), re.M))
        lines.append(f"{title} options (default):")
        lines += [(f"  --{f.name}={f.default}".ljust(34) + notes.get(f.name, "")).rstrip()
                  for f in fields(cls) if f.name != "vocab_size"]
    return "\n".join(lines)


def parse_args(argv):
    """--key=value arguments -> (model Config, TrainConfig); raises ValueError with one clear line."""
    known, given = options(), {Config: {}, TrainConfig: {}}
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ValueError(f"expected --key=value, got {arg!r} (-h lists the options)")
        key, text = arg[2:].split("=", 1)
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join('--' + c for c in close)}?" if close else " (-h lists them)"
            raise ValueError(f"unknown option --{key}{hint}")
        cls, f = known[key]
        value = _convert(key, type(f.default), text)
        if key in CHOICES and value not in CHOICES[key]:
            raise ValueError(f"--{key}={value} is not one of {', '.join(CHOICES[key])}")
        given[cls][key] = value
    tc = TrainConfig(**given[TrainConfig])
    for name in ("batch_size", "gradient_accumulation_steps", "eval_interval", "log_interval", "eval_iters", "tp", "pp",
                 "keep_checkpoints"):
        if getattr(tc, name) < 1:
            raise ValueError(f"{name}={getattr(tc, name)} must be at least 1")
    for name in ("max_iters", "dp"):
        if getattr(tc, name) < 0:
            raise ValueError(f"{name}={getattr(tc, name)} must not be negative")
    if tc.inject_fault and (tc.inject_fault.split(":")[0] not in FAULTS or not tc.inject_fault.split(":")[-1].isdigit()):
        raise ValueError(f"inject_fault={tc.inject_fault} is not kill:N, nan:N or kill_in_save:N")
    if tc.dataset != data.EMBEDDED and not os.path.exists(tc.dataset):
        raise ValueError(f"dataset path {tc.dataset} does not exist")
    return Config(**given[Config]), tc


def plan_parallel(cfg, tc, world):
    """(dp, layout) for this world size; ValueError when the layout cannot split the model."""
    dp = tc.dp or max(1, world // (tc.tp * tc.pp))
    if dp * tc.pp * tc.tp != world:
        raise ValueError(f"world size {world} is not dp × pp × tp = {dp} × {tc.pp} × {tc.tp}: "
                         "set --dp, --pp and --tp, or torchrun --nproc_per_node")
    if tc.gradient_accumulation_steps % dp:
        raise ValueError(f"gradient_accumulation_steps={tc.gradient_accumulation_steps} is not divisible by "
                         f"the {dp} data-parallel ranks")
    layout = tc.tp_mode if tc.tp_mode != "auto" else ("btp" if cfg.lowrank else "megatron")
    if tc.tp > 1 or tc.pp > 1:
        layouts.check_divisible(cfg, tc.tp, layout, tc.pp)
    if tc.pp > 1 and tc.pp_schedule == "1f1b" and tc.gradient_accumulation_steps // dp < tc.pp:
        raise ValueError(f"1F1B needs at least pp={tc.pp} micro-batches per data-parallel rank: raise "
                         f"gradient_accumulation_steps to {tc.pp * dp} or use --pp_schedule=gpipe")
    return dp, layout


def get_lr(it, tc):
    """Linear warmup, then cosine decay to min_lr at lr_decay_iters (nanoGPT)."""
    decay_iters = tc.lr_decay_iters or tc.max_iters
    if it < tc.warmup_iters:
        return tc.learning_rate * (it + 1) / (tc.warmup_iters + 1)
    if it >= decay_iters:
        return tc.min_lr
    ratio = (it - tc.warmup_iters) / max(1, decay_iters - tc.warmup_iters)
    return tc.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (tc.learning_rate - tc.min_lr)


def configure_optimizer(model, tc):
    """AdamW, weight decay on 2-D weights only (matrices and embeddings, not norm gains)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.learning_rate, betas=(tc.beta1, tc.beta2))


def fault_at(tc, kind, iter_num):
    """True where --inject_fault asks for this fault now (never in a group torchrun restarted)."""
    if not tc.inject_fault or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return False
    what, it = tc.inject_fault.split(":")
    return what == kind and int(it) == iter_num


def main(argv):
    if "-h" in argv or "--help" in argv:
        print(usage())
        return
    try:
        cfg, tc = parse_args(argv)
        cfg.vocab_size = 64 * math.ceil(data.get_tokenizer(tc.tokenizer).n_vocab / 64)  # padded: fast, divisible
        world = int(os.environ.get("WORLD_SIZE", "1"))
        dp, layout = plan_parallel(cfg, tc, world)
        checkpointing.check_recompute(cfg, tc.recompute)
        device = tc.device if tc.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        kernels.select(tc.kernels, device)
        resume_from, resume_meta = checkpointing.find(tc.out_dir, tc.init_from, cfg.shape())
        checkpointing.check_writable(tc.out_dir)
    except ValueError as e:
        fail(e)

    # -------------------------------------------------------------- processes, device, precision
    dp_rank, dp_group, tp, mesh, ckpt_mesh, pp_rank = 0, None, None, None, None, 0
    if world > 1:
        if device == "cuda":
            device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(device)
        mesh = parallel.init_mesh(dp, tc.tp, device.split(":")[0], tc.timeout_s, tc.pp)
        dp_rank, dp_group, pp_rank = mesh.get_local_rank("dp"), mesh.get_group("dp"), mesh.get_local_rank("pp")
        tp = parallel.TP(mesh.get_group("tp"), mesh.get_local_rank("tp"), tc.tp)
        ckpt_mesh = mesh["dp", "tp"]  # a stage's tensors are sharded over its own (dp, tp) ranks
    master = int(os.environ.get("RANK", "0")) == 0
    log = print if master else (lambda *a, **k: None)
    micro_steps = tc.gradient_accumulation_steps // dp
    dtype = tc.dtype if tc.dtype != "auto" else \
        ("bfloat16" if device.startswith("cuda") and torch.cuda.is_bf16_supported() else "float32")
    autocast = nullcontext() if dtype == "float32" else \
        torch.autocast(device.split(":")[0], dtype=getattr(torch, dtype))

    # -------------------------------------------------------------- data (prepared once, on rank 0)
    try:
        folder = data.prepare_once(tc.dataset, tc.tokenizer, tc.data_dir, log)
        splits = {s: data.TokenFile(folder, s, cfg.block_size) for s in ("train", "val")}
    except ValueError as e:
        fail(e)

    # -------------------------------------------------------------- model and optimizer
    torch.manual_seed(tc.seed)
    raw_model = Llama(cfg, recompute=tc.recompute)
    n_params, flops_per_token = raw_model.num_params(), raw_model.flops_per_token(cfg.block_size)
    if tc.tp > 1 or tc.pp > 1:  # cut from the full model built above
        raw_model = layouts.TPLlama(raw_model, tp, layout, stage=pp_rank, stages=tc.pp)
    raw_model.to(device)
    optimizer = configure_optimizer(raw_model, tc)
    iter_num = 0
    if resume_from:
        try:
            checkpointing.load(resume_from, raw_model, optimizer, ckpt_mesh)
        except ValueError as e:
            fail(e)
        iter_num = resume_meta["iter_num"]
        log(f"resuming from {resume_from} (iteration {iter_num})")
    model = torch.compile(raw_model) if tc.compile else raw_model
    pipe = parallel.Pipeline(raw_model, mesh, micro_steps, tc.pp_schedule, device) if tc.pp > 1 else None
    if dp > 1 and not pipe:
        model = DDP(model, process_group=dp_group, device_ids=[device] if device.startswith("cuda") else None)
        model.register_comm_hook(dp_group, parallel.ledger_ddp_hook)
    global_batch = tc.batch_size * tc.gradient_accumulation_steps
    tokens_per_iter = global_batch * cfg.block_size
    log(f"{cfg.arch}: {n_params / 1e6:.2f}M parameters, {flops_per_token / 1e6:.1f} MFLOP/token, "
        f"dp={dp} pp={tc.pp} tp={tc.tp}" + (f" ({layout})" if tc.tp > 1 else "") +
        f", {tokens_per_iter:,} tokens/iter, {device} {dtype}")

    def mean_over_dp(value):
        """The mean of a float over the data-parallel ranks (each holds the mean of its equal share)."""
        if dp == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, group=dp_group)
        return t.item() / dp

    @torch.no_grad()
    def shares(tokens, stream, step):
        """This rank's micro-batches of the global batch of (stream, step): the same sequences,
        split the same way, whatever the layout."""
        for micro in range(micro_steps):
            start = (micro * dp + dp_rank) * tc.batch_size
            x, y = tokens.batch(tc.seed, stream, step, global_batch, start, tc.batch_size)
            yield x.to(device), y.to(device)   # (b, s), (b, s)

    def whole(tokens, stream, step):
        """This rank's micro-batches in one tensor each, for the pipeline schedule to split."""
        xs, ys = zip(*shares(tokens, stream, step))
        return torch.cat(xs), torch.cat(ys)   # (micro_steps·b, s) each

    def estimate_loss():
        """Mean loss over eval_iters fixed global batches per split (the same at every evaluation)."""
        model.eval()
        out = {}
        for split, tokens in splits.items():
            total = 0.0
            for k in range(tc.eval_iters):
                if pipe:
                    with autocast:
                        total += pipe.run(*whole(tokens, f"eval-{split}", k), train=False)
                    continue
                for x, y in shares(tokens, f"eval-{split}", k):
                    with autocast:
                        total += model(x, y)[1].item() / micro_steps
            out[split] = mean_over_dp(total / tc.eval_iters)
        model.train()
        return out

    # -------------------------------------------------------------- the loop
    metrics = open(os.path.join(tc.out_dir, "metrics.jsonl"), "a") if master else None
    t0 = time.time()
    while True:
        lr = get_lr(iter_num, tc)
        for group in optimizer.param_groups:
            group["lr"] = lr
        record = {}
        if iter_num % tc.eval_interval == 0 or iter_num == tc.max_iters:
            losses = estimate_loss()
            record = {"eval_train_loss": losses["train"], "val_loss": losses["val"]}
            log(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if iter_num > 0:
                meta = {"config": cfg.shape(), "train_config": asdict(tc), "tokenizer": tc.tokenizer}
                crash = (lambda: os._exit(1)) if fault_at(tc, "kill_in_save", iter_num) else None
                checkpointing.save(tc.out_dir, iter_num, raw_model, optimizer, ckpt_mesh, meta,
                                   keep=tc.keep_checkpoints, before_publish=crash)
            t0 = time.time()  # evaluation is not training time
        if fault_at(tc, "kill", iter_num) and int(os.environ.get("RANK", "0")) == world - 1:
            os._exit(1)  # a rank dies mid-run; torchrun --max-restarts restarts the group
        if iter_num >= tc.max_iters:
            if master and record:
                metrics.write(json.dumps({"iter": iter_num, **record}) + "\n")
            break

        loss_sum = 0.0
        LEDGER.reset()
        if pipe:  # the schedule runs this rank's micro-batches through the stages, forward and backward
            with autocast:
                loss_sum = pipe.run(*whole(splits["train"], "train", iter_num))
            parallel.all_reduce_grads(raw_model, dp_group)
        else:
            for micro, (x, y) in enumerate(shares(splits["train"], "train", iter_num)):
                sync = micro == micro_steps - 1 or dp == 1
                with (nullcontext() if sync else model.no_sync()), autocast:
                    _, loss = model(x, y)
                    loss = loss / micro_steps
                    if fault_at(tc, "nan", iter_num):
                        loss = loss * float("nan")
                loss.backward()
                loss_sum += loss.item()
        grad_norm = parallel.clip_grad_norm(raw_model, tc.grad_clip if tc.grad_clip > 0 else float("inf"),
                                            mesh.get_group("pp") if pipe else None)
        if not torch.isfinite(grad_norm):  # the same on every rank: gradients are all-reduced
            last = checkpointing.checkpoint_dirs(tc.out_dir)
            fail(f"the loss or its gradient is not finite at iteration {iter_num}; stopped before the "
                 f"optimizer step. The last good checkpoint ({last[-1] if last else 'none'}) is untouched")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        t1 = time.time()
        dt, t0 = t1 - t0, t1
        if iter_num % tc.log_interval == 0 or record:
            loss_mean = mean_over_dp(loss_sum)
            tokens_per_s = tokens_per_iter / dt
            mfu = estimate_mfu(flops_per_token, tokens_per_s / world, tc.peak_tflops)
            comm = {"comm_bytes": LEDGER.total(unit="bytes"), "tp_bytes": LEDGER.total("tp", unit="bytes"),
                    "dp_bytes": LEDGER.total("dp", unit="bytes"), "pp_bytes": LEDGER.total("pp", unit="bytes")}
            record = {"iter": iter_num, "loss": loss_mean, "lr": lr, "ms": dt * 1000, "tokens_per_s": tokens_per_s,
                      **comm, **({"mfu": mfu} if mfu is not None else {}), **record}
            log(f"iter {iter_num}: loss {loss_mean:.4f}, lr {lr:.2e}, {dt * 1000:.1f} ms, "
                f"{tokens_per_s:,.0f} tok/s, {flops_per_token * tokens_per_s / 1e12:.3f} TFLOP/s, "
                f"comm {comm['comm_bytes'] / 1e6:.2f} MB"
                + (f", mfu {100 * mfu:.1f}%" if mfu is not None else ""))
            if master:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
        iter_num += 1

    if master:
        metrics.close()
    if tc.sample_tokens > 0 and pipe:
        log("no sample under pp > 1: export the checkpoint and run python checkpointing.py sample")
    elif tc.sample_tokens > 0:  # every rank samples alike (TP peers must run the forward together)
        enc = data.get_tokenizer(tc.tokenizer)
        torch.manual_seed(tc.seed)
        start = torch.tensor([[enc.eot_token]], device=device)
        with autocast:
            out = raw_model.generate(start, tc.sample_tokens, temperature=0.8, top_k=50)
        tokens = [t for t in out[0, 1:].tolist() if t < enc.n_vocab]
        log("sample:\n" + enc.decode(tokens))
    if world > 1:
        dist.barrier()  # no rank closes its connections while a peer still uses them
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
