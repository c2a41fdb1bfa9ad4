"""train.py: the one training loop for the dense, svd and CoLA models, in nanoGPT's order.

BOOST (arXiv 2512.12131) trains low-rank bottleneck models at scale; this loop is the same on a
laptop CPU and on a GPU cluster:

    python train.py --arch=full --max_iters=200       # any option as --key=value; -h lists them all
    torchrun --standalone --nproc_per_node=2 train.py --tp=2     # BOOST's bottleneck-aware TP

Read it top to bottom: main() checks everything and claims the out_dir; train() is the run: data,
processes, model, optimizer, the loop, the end. Every rank draws its share of the same global batch
from (seed, step) (plumbing/data.py), so the logged loss, the mean over the global batch, is
comparable line by line across layouts. The run's plan, resolved once: plumbing/plan.py; the
model built: plumbing/placement.py; the out_dir: plumbing/rundir.py; checkpoints: the same
folder's train_state.py.
"""
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict

import torch
import torch.distributed as dist

import sharding
from model import estimate_mfu
from parallel import LEDGER
from extensions import cuda_graph, dp_shard, kernel_choice, muon
from plumbing import data, faults, options, placement, preparation, rundir, train_state
from plumbing.plan import resolve, say_schedule_change
from plumbing.tokenizer import identity as tokenizer_identity, sample_at_end


def fail(msg):
    """A user error: one line on stderr (once per job), exit status 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {msg}", file=sys.stderr)
    rundir.tell_torchrun(f"error: {msg}")   # (torchrun's summary ends with it)
    sys.exit(2)


def main(argv):
    """Check everything, claim the out_dir, train; exit status 2 on bad input, 128+N on signal N."""
    if "-h" in argv or "--help" in argv:
        print(options.usage())
        return
    master, held = int(os.environ.get("RANK", "0")) == 0, None
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        plan, resume = resolve(argv, world, print if master else (lambda *a: None))
        tc = plan.tc
        placement.check_fits(plan)   # (a model no rank could hold: one line, before anything)
        kernel_choice.select(tc.kernels, plan.device)   # (auto: timed per op and shape)
        if tc.explain:  # one recorded step, printed; no data, no out_dir, no checkpoint
            from plumbing import explain
            return explain.main(plan, placement.place_processes(plan))
        rundir.check_place(tc.out_dir)
        if master:
            held = rundir.lock(tc.out_dir)   # a second run into this out_dir stops here
        if not resume:
            rundir.check_scratch(tc.out_dir, tc.overwrite)
        if master and tc.overwrite:
            rundir.discard(tc.out_dir)
    except ValueError as e:
        rundir.unlock(held)
        fail(e)
    interrupt = rundir.Interrupt(print if master else (lambda *a: None))
    try:
        signum = train(plan, argv, resume, interrupt)
    except RuntimeError as e:   # (torch.distributed's errors are RuntimeErrors)
        faults.exit_if_peer_lost(e, plan.world, plan.tc.out_dir)   # (one line, not 40-77)
        raise
    finally:
        interrupt.restore()
        rundir.unlock(held)
    if signum:
        sys.exit(128 + signum)


# ------------------------------------------------------------------------------ setting up a run

def get_lr(it, tc):
    """Linear warmup, then cosine decay to min_lr at lr_decay_iters (nanoGPT)."""
    decay_iters = tc.lr_decay_iters or tc.max_iters
    if it < tc.warmup_iters:
        return tc.learning_rate * (it + 1) / (tc.warmup_iters + 1)
    if it >= decay_iters:
        return tc.min_lr
    ratio = (it - tc.warmup_iters) / max(1, decay_iters - tc.warmup_iters)
    return tc.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (tc.learning_rate - tc.min_lr)


# ------------------------------------------------------------------------------ the run

def train(plan, argv, resume, interrupt):
    """The run of `plan` (plumbing.plan.Plan); returns the signal number that interrupted it, or 0.
    Rank 0 speaks for the job."""
    cfg, tc = plan.cfg, plan.tc
    master = int(os.environ.get("RANK", "0")) == 0
    log = print if master else (lambda *a, **k: None)
    # rank 0 prepares the corpus before the process group starts, so an hour of it meets no timeout
    try:
        folder = preparation.prepare_once(tc.dataset, tc.tokenizer, tc.data_dir, tc.num_proc,
                                      tc.val_fraction, tc.text_field, log)
        splits = {s: data.TokenFile(folder, s, cfg.block_size, cfg.vocab_size)
                  for s in ("train", "val")}
        place = placement.place_processes(plan)
        raw_model, n_params, flops_per_token = placement.build_model(plan, place, init=not resume)
        optimizer = muon.configure(raw_model, tc)
        iter_num, run_id, resume_from, skipped = 0, rundir.new_run_id(), None, []
        if resume:   # the newest checkpoint that verifies and loads (each other one: a line)
            mesh = place.ckpt_mesh
            load = lambda path, meta: train_state.load(path, meta, raw_model, optimizer, mesh)
            same = lambda meta: options.other_options(argv, resume, meta)
            with interrupt.deferred():   # (a stop signal never condemns a checkpoint)
                resume_from, meta, skipped = train_state.choose(resume, cfg.shape(), tc.tokenizer,
                                                                load, same, log)
            iter_num, run_id = meta["iter_num"], meta.get("run_id", run_id)
            if iter_num >= tc.max_iters:   # (here: a damaged newest checkpoint may leave steps)
                raise ValueError(f"max_iters={tc.max_iters} is not past iteration {iter_num} of "
                                 f"{resume_from}: nothing to train; pass a larger --max_iters")
            named = any(a.startswith("--dataset=") for a in argv)
            data.check_resumed_corpus(resume_from, meta, splits["train"], named, log)
            log(f"resuming from {resume_from} (iteration {iter_num})")
            say_schedule_change(meta.get("train_config", {}), tc, iter_num, get_lr, log)
    except ValueError as e:
        fail(e)
    run = Run(plan, place, splits, raw_model, optimizer, log, run_id, resume_from)
    run.damaged = skipped   # removed at the first save: they hold nothing to resume from
    for line in placement.start_lines(plan, place, n_params, flops_per_token, optimizer,
                                      run.tokens_per_iter):
        log(line)
    run.metrics = rundir.Metrics.start(tc.out_dir, master, run_id, argv, resume_from, iter_num,
                                       tc.tensorboard, run.tokens_per_iter,
                                       {"arch": cfg.arch, **rundir.machine(place.device,
                                                                           place.world)})
    signum = loop(run, iter_num, flops_per_token, interrupt)
    if not signum:
        sample_at_end(run)
    placement.finish(plan.world)
    return signum


class Run:
    """What a run's steps share: options, place, data, the model as trained and as held."""

    def __init__(self, plan, place, splits, raw_model, optimizer, log, run_id, resume_from):
        cfg, tc = plan.cfg, plan.tc
        self.cfg, self.tc, self.place, self.splits, self.log = cfg, tc, place, splits, log
        self.raw_model, self.optimizer = raw_model, optimizer
        self.run_id, self.resume_from, self.last_ckpt = run_id, resume_from, resume_from
        self.micro_steps = tc.gradient_accumulation_steps // place.dp
        self.global_batch = tc.batch_size * tc.gradient_accumulation_steps
        self.tokens_per_iter = self.global_batch * cfg.block_size
        self.dtype = plan.dtype
        self.hardware_flops = None if tc.peak_tflops <= 0 or tc.recompute == "none" else \
            placement.hardware_flops_per_token(cfg, plan.layout, tc.recompute)
        self.autocast = nullcontext() if self.dtype == "float32" else \
            torch.autocast(place.device.split(":")[0], dtype=getattr(torch, self.dtype))
        self.nonfinite = torch.tensor(-1, device=place.device)  # the first non-finite iteration
        self.tokenizer_id = tokenizer_identity(tc.tokenizer)   # (what the data was prepared with)
        if tc.compile:   # (plan.py refuses it with a pipeline)
            log("torch.compile: the first steps compile the model, which takes minutes on a CPU")
        self.model, self.pipe = placement.wrap(raw_model, tc, place, self.micro_steps,
                                               warm=lambda: kernel_choice.time_shapes(self))
        self.pp_group = place.group("pp") if self.pipe else None
        last_rank = int(os.environ.get("RANK", "0")) == place.world - 1
        self.faults = faults.Faults(tc, last_rank)
        self.captured = tc.cuda_graph and cuda_graph.Captured(lambda b, at: step(self, b, at),
                                                              optimizer, place.device)

    @torch.no_grad()
    def shares(self, split, stream, step):
        """This rank's micro-batches of the global batch of (stream, step), whatever the layout."""
        tc, place = self.tc, self.place
        for micro in range(self.micro_steps):
            start = (micro * place.dp + place.dp_rank) * tc.batch_size
            x, y = self.splits[split].batch(tc.seed, stream, step, self.global_batch, start,
                                            tc.batch_size)
            if place.device.startswith("cuda"):   # from pinned memory, copied while the GPU works
                x, y = x.pin_memory(), y.pin_memory()
            x, y = x.to(place.device, non_blocking=True), y.to(place.device, non_blocking=True)
            yield x, y   # (b, s), (b, s)

    def whole(self, split, stream, step):
        """This rank's micro-batches in one tensor each, for the pipeline schedule to split."""
        xs, ys = zip(*self.shares(split, stream, step))
        return torch.cat(xs), torch.cat(ys)   # (micro_steps·b, s) each

    def mean_over_dp(self, value):
        """The mean over the data-parallel ranks (each holds the mean of its equal share) of a loss
        kept on the device, as a float: the host waits for the device here, at log steps only."""
        t = torch.as_tensor(value, device=self.place.device).detach().double().reshape(1)
        if self.place.dp > 1:
            dist.all_reduce(t, group=self.place.group("dp"))
        return t.item() / self.place.dp


@torch.no_grad()
def evaluate(run, stopped=lambda: 0):
    """Mean loss over eval_iters fixed global batches per split (the same at every evaluation),
    through the model itself, not its compiled or DDP wrapper: no_grad and eval() would make
    torch.compile trace a second graph. Before each batch, `stopped()` (every rank's agreement):
    a signal ends the evaluation there, returning None, so a stop waits one batch, not all."""
    model, out = run.raw_model, {}
    model.eval()
    try:
        for split in ("train", "val"):
            total = torch.zeros((), device=run.place.device)
            for k in range(run.tc.eval_iters):
                if stopped():
                    return None
                with run.autocast:
                    if run.pipe:
                        total += run.pipe.run(*run.whole(split, f"eval-{split}", k), train=False)
                    else:
                        parts = run.shares(split, f"eval-{split}", k)
                        total += sum(model(x, y)[1].float() for x, y in parts) / run.micro_steps
            out[split] = run.mean_over_dp(total / run.tc.eval_iters)
    finally:
        dp_shard.reshard(run.raw_model)   # (--dp_shard=grad keeps what forward gathered)
        model.train()
    return out


def check_finite(run, iter_num):
    """Stop, exit 2, if a step since the last check had a non-finite gradient (read at log steps and
    before a save, so no step waits for it; the fused AdamW skipped that step's update on the
    device)."""
    bad = int(run.nonfinite.item())
    if bad >= 0:
        fail(f"the loss or its gradient is not finite at iteration {bad} (its update skipped; "
             f"stopped at iteration {iter_num}). The last good checkpoint "
             f"({run.last_ckpt or 'none'}) is untouched")


def save_checkpoint(run, iter_num, crash=None):
    check_finite(run, iter_num)
    tc = run.tc
    meta = {"config": run.cfg.shape(), "train_config": asdict(tc), "tokenizer": tc.tokenizer,
            "tokenizer_id": run.tokenizer_id, "run_id": run.run_id,
            "corpus_id": run.splits["train"].corpus_id}
    t = time.time()
    try:
        path, size = train_state.save(tc.out_dir, iter_num, run.raw_model, run.optimizer,
                                      run.place.ckpt_mesh, meta, keep=tc.keep_checkpoints,
                                      before_publish=crash, discard=run.damaged)
    except ValueError as e:   # the disk is full: one line, exit 2
        fail(e)
    run.damaged, run.last_ckpt = [], path
    run.log(f"saved checkpoint {path} ({size / 1e6:.1f} MB in {time.time() - t:.1f} s)")
    return path


def train_step(run, iter_num):
    """Forward and backward of the global batch (the pipeline schedule, or gradient accumulation
    over this rank's micro-batches, DDP averaging at the last), clipping, the optimizer step; the
    loss. Under --cuda_graph one replayed graph does it all (extensions/cuda_graph.py)."""
    batches = None if run.pipe else run.shares("train", "train", iter_num)
    if run.captured:
        return run.captured.step(batches, iter_num)
    return step(run, batches, iter_num)


def step(run, batches, at):
    """train_step's work at iteration `at` (an int, or a device tensor a graph reads); what
    outlives it is written in place."""
    loss_sum = torch.zeros((), device=run.place.device)   # on the device: log_step reads it
    if run.pipe:   # the schedule runs this rank's micro-batches through the stages, both ways
        with run.autocast:
            loss_sum = run.pipe.run(*run.whole("train", "train", at))
        if run.tc.dp_shard == "none":   # (dp_shard: FSDP2 reduce-scatters at the last micro-batch)
            sharding.all_reduce_grads(run.raw_model, run.place.group("dp"))
    else:
        sharded = run.tc.dp_shard != "none"
        for micro, (x, y) in enumerate(batches):
            sync = micro == run.micro_steps - 1 or run.place.dp == 1   # DDP: at the last only
            if sharded:   # FSDP2 reduce-scatters at the last only
                run.model.set_requires_gradient_sync(sync)
            with (nullcontext() if sync or sharded else run.model.no_sync()), run.autocast:
                loss = run.faults.poison(run.model(x, y)[1] / run.micro_steps, at)
            loss.backward()
            loss_sum += loss.detach().float()
    sharding.reduce_tied_grad(run.raw_model, run.pp_group)
    clip = run.tc.grad_clip if run.tc.grad_clip > 0 else float("inf")
    grad_norm = sharding.clip_grad_norm(run.raw_model, clip, run.pp_group)
    bad = ~torch.isfinite(grad_norm)   # the same on every rank; no host sync:
    run.optimizer.found_inf = bad.float()   # the fused AdamW skips this update where it is 1
    run.nonfinite.copy_(torch.where(bad & (run.nonfinite < 0), at, run.nonfinite))
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.grad_norm = grad_norm   # (on the device, before clipping: log_step reads it)
    return loss_sum


def log_step(run, iter_num, lr, loss_sum, dt, elapsed, start_iter, flops_per_token, record):
    """One line of the log and one row of metrics.jsonl."""
    tc = run.tc
    check_finite(run, iter_num)
    loss, tokens_per_s = run.mean_over_dp(loss_sum), run.tokens_per_iter / dt
    # MFU counts the model's FLOPs; HFU also what --recompute replays (the same without it)
    mfu, hfu = (estimate_mfu(f, tokens_per_s / run.place.world, tc.peak_tflops)
                for f in (flops_per_token, run.hardware_flops or flops_per_token))
    comm = {"comm_bytes": LEDGER.total(unit="bytes"), "tp_bytes": LEDGER.total("tp", unit="bytes"),
            "dp_bytes": LEDGER.total("dp", unit="bytes"),
            "pp_bytes": LEDGER.total("pp", unit="bytes")}
    # eta from the last interval's mean step; none at a launch's first (it allocates, compiles)
    eta = rundir.duration(dt * (tc.max_iters - iter_num - 1)) if iter_num > start_iter else "-"
    mem_gb, grad_norm = rundir.peak_memory_gb(run.place.device), float(run.grad_norm)
    run.metrics.write({"iter": iter_num, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                       "ms": dt * 1000, "tokens_per_s": tokens_per_s, **comm,
                       **({"mfu": mfu, "hfu": hfu} if mfu is not None else {}), "mem_gb": mem_gb,
                       **record})
    run.log(f"iter {iter_num}/{tc.max_iters}: loss {loss:.4f}, lr {lr:.2e}, "
            f"grad norm {grad_norm:.3f}, {dt * 1000:.1f} ms, "
            f"{tokens_per_s:,.0f} tok/s, {flops_per_token * tokens_per_s / 1e12:.3f} TFLOP/s, "
            f"comm {comm['comm_bytes'] / 1e6:.2f} MB"
            + (f", mfu {100 * mfu:.1f}%" if mfu is not None else "")
            + (f", hfu {100 * hfu:.1f}%" if mfu is not None and run.hardware_flops else "")
            + f", mem {mem_gb:.2f} GB, elapsed {rundir.duration(elapsed)}, "
            f"eta {eta}")


def loop(run, iter_num, flops_per_token, interrupt):
    """Evaluate and checkpoint every eval_interval, train to max_iters, stop cleanly on a signal;
    returns the signal number, or 0 at the end."""
    tc, log = run.tc, run.log
    start_iter, best_val, signum, since_log = iter_num, None, 0, 0
    world_rank = dist.get_rank() if dist.is_initialized() else 0
    profiler = rundir.profiler(tc.profile, tc.out_dir, world_rank, log, tc.max_iters - iter_num)
    interrupt.armed = True
    # a log line's ms: from the last synchronised log step (or evaluation's end), over the steps
    t_start = t_log = time.time()
    while True:
        lr = get_lr(iter_num, tc)
        for group in run.optimizer.param_groups:   # (Muon's: its own peak, scaled alike)
            cuda_graph.set_lr(group, lr * group.get("lr_ratio", 1.0))
        record = {}
        # evaluate (not again at the iteration a resumed run starts from: it was saved there)
        due = iter_num % tc.eval_interval == 0 or iter_num == tc.max_iters
        if due and not (run.resume_from and iter_num == start_iter):
            losses = evaluate(run, lambda: interrupt.now(run.place.host_group))
            if losses is None:   # a stop signal during the evaluation: save this step, stop
                signum = interrupt.signum
                break
            record = {"eval_train_loss": losses["train"], "val_loss": losses["val"]}
            best_val = losses["val"] if best_val is None else min(best_val, losses["val"])
            log(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if iter_num > 0:
                save_checkpoint(run, iter_num, run.faults.in_save(iter_num))
            t_log, since_log = rundir.clock(run.place.device), 0   # (not training time)
            rundir.reset_peak_memory(run.place.device)
        run.faults.after_eval(iter_num)   # (--inject_fault: the tests' failures, on purpose)
        if iter_num >= tc.max_iters:
            if record:
                run.metrics.write({"iter": iter_num, **record})
            break
        LEDGER.reset()
        loss_sum = train_step(run, iter_num)
        if profiler:
            profiler.step()
        since_log += 1
        if iter_num % tc.log_interval == 0 or record:
            t1 = rundir.clock(run.place.device)   # (after the device's queued work)
            log_step(run, iter_num, lr, loss_sum, (t1 - t_log) / since_log, t1 - t_start,
                     start_iter, flops_per_token, record)
            t_log, since_log = t1, 0
            rundir.reset_peak_memory(run.place.device)   # (each line: its own steps' peak)
        iter_num += 1
        signum = interrupt.agreed(run.place.host_group)
        if signum:  # every rank finished this step: save it, say how to go on, stop
            break
    interrupt.settle()
    if profiler:
        profiler.stop()
    end(run, iter_num, signum, start_iter, best_val, time.time() - t_start)
    return signum


def end(run, iter_num, signum, start_iter, best_val, seconds):
    """An interrupted run saves its step and says how to go on; a finished one sums itself up."""
    if signum:
        path = save_checkpoint(run, iter_num)
        run.log(f"interrupted at iteration {iter_num}; saved {path}; continue with "
                "--init_from=resume")
        run.metrics.event("interrupted", iter=iter_num, signal=signum, checkpoint=path)
    else:
        check_finite(run, iter_num)
        n = run.tc.max_iters - start_iter
        summary = (f"{n} iterations ({start_iter}..{run.tc.max_iters}), "
                   f"{n * run.tokens_per_iter:,} tokens in {rundir.duration(seconds)}")
        best = f"; best val loss {best_val:.4f}" if best_val is not None else ""
        run.log(f"done: {summary}{best}; last checkpoint {run.last_ckpt or 'none'}")
        run.metrics.event("end", iter=iter_num, best_val_loss=best_val, checkpoint=run.last_ckpt)
    run.metrics.close()


if __name__ == "__main__":
    main(sys.argv[1:])
