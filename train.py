"""train.py: the one training loop for the dense, svd and CoLA models, in nanoGPT's order.

BOOST (arXiv 2512.12131) trains low-rank bottleneck models at scale; this loop is the same on a
laptop CPU and on a GPU cluster:

    python train.py                                   # CoLA on the embedded corpus, CPU or GPU
    python train.py --arch=full --max_iters=200       # any option as --key=value; -h lists them all
    torchrun --standalone --nproc_per_node=2 train.py --gradient_accumulation_steps=2   # data parallel
    torchrun --standalone --nproc_per_node=2 train.py --tp=2     # BOOST's bottleneck-aware TP

Every rank draws its share of the same global batch from (seed, step) (data.py), so the logged
loss, the mean over the global batch, is comparable line by line across layouts. The options and
their checks are options.py; the out_dir's lock, metrics log and interrupts rundir.py; the
checkpoints train_state.py.
"""
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpointing
import data
import kernels
import layouts
import options
import parallel
import prepare
import rundir
import train_state
from model import Llama, estimate_mfu
from parallel import LEDGER


def fail(msg):
    """A user error: one line on stderr (once per job), exit status 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


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
    """Check everything, claim the out_dir, train; exit status 2 on bad input, 128+N on signal N."""
    if "-h" in argv or "--help" in argv:
        print(options.usage())
        return
    master = int(os.environ.get("RANK", "0")) == 0
    held = None
    try:
        cfg, tc = options.parse_args(argv)
        cfg.vocab_size = options.vocab_size(tc.tokenizer)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        dp, layout = options.plan_parallel(cfg, tc, world)
        checkpointing.check_recompute(cfg, tc.recompute)
        device = tc.device if tc.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        kernels.select(tc.kernels, device)
        if tc.explain:  # one recorded step, printed; no data, no out_dir, no checkpoint
            import explain
            explain.main(cfg, tc, world, dp, layout, device)
            finish(world)
            return
        if master:
            held = rundir.lock(tc.out_dir)   # a second run into this out_dir stops here
        found = train_state.candidates(tc.out_dir, tc.init_from)
        if not found:
            rundir.check_scratch(tc.out_dir, tc.overwrite)
        if master and tc.overwrite:
            rundir.discard(tc.out_dir)
    except ValueError as e:
        rundir.unlock(held)
        fail(e)
    interrupt = rundir.Interrupt(print if master else (lambda *a: None))
    try:
        signum = train(cfg, tc, argv, world, dp, layout, device, found, interrupt)
    finally:
        interrupt.restore()
        rundir.unlock(held)
    if signum:
        sys.exit(128 + signum)


def train(cfg, tc, argv, world, dp, layout, device, found, interrupt):
    """The run; returns the signal number that interrupted it, or 0."""
    # -------------------------------------------------------------- data (rank 0 prepares, before the process group)
    master = int(os.environ.get("RANK", "0")) == 0
    log = print if master else (lambda *a, **k: None)
    try:
        folder = prepare.prepare_once(tc.dataset, tc.tokenizer, tc.data_dir, tc.num_proc, tc.val_fraction,
                                      tc.text_field, log)
        splits = {s: data.TokenFile(folder, s, cfg.block_size) for s in ("train", "val")}
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
        tp = parallel.TP(mesh.get_group("tp"), mesh.get_local_rank("tp"), tc.tp, tc.overlap)
        ckpt_mesh = mesh["dp", "tp"]  # a stage's tensors are sharded over its own (dp, tp) ranks
    micro_steps = tc.gradient_accumulation_steps // dp
    dtype = tc.dtype if tc.dtype != "auto" else \
        ("bfloat16" if device.startswith("cuda") and torch.cuda.is_bf16_supported() else "float32")
    autocast = nullcontext() if dtype == "float32" else \
        torch.autocast(device.split(":")[0], dtype=getattr(torch, dtype))

    try:
        resume_from, resume_meta = train_state.choose(found, cfg.shape(), tc.tokenizer, log)
    except ValueError as e:
        fail(e)

    # -------------------------------------------------------------- model and optimizer
    torch.manual_seed(tc.seed)
    raw_model = Llama(cfg, recompute=tc.recompute, layer_runner=checkpointing.run_layers)
    n_params, flops_per_token = raw_model.num_params(), raw_model.flops_per_token(cfg.block_size)
    if tc.tp > 1 or tc.pp > 1:  # cut from the full model built above
        raw_model = layouts.TPLlama(raw_model, tp, layout, stage=pp_rank, stages=tc.pp)
    elif cfg.lowrank and kernels.backend() != "torch":  # one device: the BTP layer with a TP group of one
        raw_model = layouts.TPLlama(raw_model, parallel.TP(None, 0, 1), "btp")  # runs the fused kernels
    raw_model.to(device)
    optimizer = configure_optimizer(raw_model, tc)
    iter_num, run_id = 0, rundir.new_run_id()
    if resume_from:
        try:
            train_state.load(resume_from, raw_model, optimizer, ckpt_mesh)
        except ValueError as e:
            fail(e)
        iter_num, run_id = resume_meta["iter_num"], resume_meta.get("run_id", run_id)
        log(f"resuming from {resume_from} (iteration {iter_num})")
    if tc.compile:
        log("torch.compile: the first steps compile the model, which takes minutes on a CPU")
    model = torch.compile(raw_model) if tc.compile else raw_model
    pipe = parallel.Pipeline(raw_model, mesh, micro_steps, tc.pp_schedule, device) if tc.pp > 1 else None
    if dp > 1 and not pipe:
        model = DDP(model, process_group=dp_group, device_ids=[device] if device.startswith("cuda") else None)
        model.register_comm_hook(dp_group, parallel.ledger_ddp_hook)
    global_batch = tc.batch_size * tc.gradient_accumulation_steps
    tokens_per_iter = global_batch * cfg.block_size
    log(f"{cfg.arch}: {n_params / 1e6:.2f}M parameters, {flops_per_token / 1e6:.1f} MFLOP/token, "
        f"dp={dp} pp={tc.pp} tp={tc.tp}" + (f" ({layout})" if tc.tp > 1 else "") +
        (f", kernels {kernels.backend()}" if kernels.backend() != "torch" else "") +
        f", {tokens_per_iter:,} tokens/iter, {device} {dtype}")
    metrics = rundir.Metrics(tc.out_dir, master)
    if master:
        rundir.write_run(tc.out_dir, run_id, argv)
        if resume_from:
            metrics.event("resume", iter=iter_num, checkpoint=resume_from, run_id=run_id)
        else:
            metrics.event("start", run_id=run_id, argv=argv)

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

    def save_checkpoint(crash=None):
        meta = {"config": cfg.shape(), "train_config": asdict(tc), "tokenizer": tc.tokenizer, "run_id": run_id}
        t = time.time()
        path, size = train_state.save(tc.out_dir, iter_num, raw_model, optimizer, ckpt_mesh, meta,
                                      keep=tc.keep_checkpoints, before_publish=crash)
        log(f"saved checkpoint {path} ({size / 1e6:.1f} MB in {time.time() - t:.1f} s)")
        return path

    # -------------------------------------------------------------- the loop
    start_iter, last_ckpt, best_val = iter_num, resume_from, None
    profiler = rundir.profiler(tc.profile, tc.out_dir, dist.get_rank() if world > 1 else 0, log)
    interrupt.armed = True
    t_start = t0 = time.time()
    while True:
        lr = get_lr(iter_num, tc)
        for group in optimizer.param_groups:
            group["lr"] = lr
        record = {}
        if (iter_num % tc.eval_interval == 0 or iter_num == tc.max_iters) and not (resume_from and iter_num == start_iter):
            losses = estimate_loss()  # (not again at the iteration a resumed run starts from: it was saved there)
            record = {"eval_train_loss": losses["train"], "val_loss": losses["val"]}
            best_val = losses["val"] if best_val is None else min(best_val, losses["val"])
            log(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if iter_num > 0:
                last_ckpt = save_checkpoint((lambda: os._exit(1)) if fault_at(tc, "kill_in_save", iter_num) else None)
            t0 = time.time()  # evaluation is not training time
        if fault_at(tc, "kill", iter_num) and int(os.environ.get("RANK", "0")) == world - 1:
            os._exit(1)  # a rank dies mid-run; torchrun --max-restarts restarts the group
        if iter_num >= tc.max_iters:
            if record:
                metrics.write({"iter": iter_num, **record})
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
        parallel.reduce_tied_grad(raw_model, mesh.get_group("pp") if pipe else None)
        grad_norm = parallel.clip_grad_norm(raw_model, tc.grad_clip if tc.grad_clip > 0 else float("inf"),
                                            mesh.get_group("pp") if pipe else None)
        if not torch.isfinite(grad_norm):  # the same on every rank: gradients are all-reduced
            fail(f"the loss or its gradient is not finite at iteration {iter_num}; stopped before the "
                 f"optimizer step. The last good checkpoint ({last_ckpt or 'none'}) is untouched")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if profiler:
            profiler.step()

        t1 = time.time()
        dt, t0 = t1 - t0, t1
        if iter_num % tc.log_interval == 0 or record:
            loss_mean = mean_over_dp(loss_sum)
            tokens_per_s = tokens_per_iter / dt
            mfu = estimate_mfu(flops_per_token, tokens_per_s / world, tc.peak_tflops)
            comm = {"comm_bytes": LEDGER.total(unit="bytes"), "tp_bytes": LEDGER.total("tp", unit="bytes"),
                    "dp_bytes": LEDGER.total("dp", unit="bytes"), "pp_bytes": LEDGER.total("pp", unit="bytes")}
            elapsed = t1 - t_start
            eta = elapsed / (iter_num + 1 - start_iter) * (tc.max_iters - iter_num - 1)
            mem_gb = rundir.peak_memory_gb(device)
            record = {"iter": iter_num, "loss": loss_mean, "lr": lr, "ms": dt * 1000, "tokens_per_s": tokens_per_s,
                      **comm, **({"mfu": mfu} if mfu is not None else {}), "mem_gb": mem_gb, **record}
            log(f"iter {iter_num}/{tc.max_iters}: loss {loss_mean:.4f}, lr {lr:.2e}, {dt * 1000:.1f} ms, "
                f"{tokens_per_s:,.0f} tok/s, {flops_per_token * tokens_per_s / 1e12:.3f} TFLOP/s, "
                f"comm {comm['comm_bytes'] / 1e6:.2f} MB" + (f", mfu {100 * mfu:.1f}%" if mfu is not None else "")
                + f", mem {mem_gb:.2f} GB, elapsed {rundir.duration(elapsed)}, eta {rundir.duration(eta)}")
            metrics.write(record)
        iter_num += 1
        signum = interrupt.agreed(device)
        if signum:  # every rank finished this step: save it, say how to go on, stop
            interrupt.settle()
            if profiler:
                profiler.stop()
            path = save_checkpoint()
            log(f"interrupted at iteration {iter_num}; saved {path}; continue with --init_from=resume")
            metrics.event("interrupted", iter=iter_num, signal=signum, checkpoint=path)
            metrics.close()
            finish(world)
            return signum

    interrupt.settle()
    if profiler:
        profiler.stop()
    summary = (f"{tc.max_iters - start_iter} iterations ({start_iter}..{tc.max_iters}), "
               f"{(tc.max_iters - start_iter) * tokens_per_iter:,} tokens in {rundir.duration(time.time() - t_start)}")
    log(f"done: {summary}; best val loss {best_val:.4f}; last checkpoint {last_ckpt or 'none'}"
        if best_val is not None else f"done: {summary}; last checkpoint {last_ckpt or 'none'}")
    metrics.event("end", iter=iter_num, best_val_loss=best_val, checkpoint=last_ckpt)
    metrics.close()
    if tc.sample_tokens > 0 and pipe:
        log("no sample under pp > 1: export the checkpoint and run python train_state.py sample")
    elif tc.sample_tokens > 0:  # every rank samples alike (TP peers must run the forward together)
        enc = data.get_tokenizer(tc.tokenizer)
        torch.manual_seed(tc.seed)
        start = torch.tensor([[enc.eot_token]], device=device)
        with autocast:
            out = raw_model.generate(start, tc.sample_tokens, temperature=0.8, top_k=50)
        tokens = [t for t in out[0, 1:].tolist() if t < enc.n_vocab]
        log("sample:\n" + enc.decode(tokens))
    finish(world)
    return 0


def finish(world):
    if world > 1:
        dist.barrier()  # no rank closes its connections while a peer still uses them
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
