"""rundir.py: a run's out_dir and lifetime: who owns the folder, its metrics log, and interrupts.

Not in the BOOST paper (arXiv 2512.12131); what makes a long run of train.py safe to leave alone:

- An out_dir belongs to one run. While a run lives it holds an fcntl lock on <out_dir>/run.lock
  (the kernel frees it when the process dies, so a crashed run never blocks the next); a second
  run into the same out_dir is refused. A run from scratch into an out_dir that holds an earlier
  run's checkpoints or metrics is refused too, unless it is told to discard them (--overwrite),
  or it is the same torchrun job restarting (--max-restarts) before its first checkpoint.
  <out_dir>/run.json names the run (its id, carried over by every resume, marks its checkpoints).
- metrics.jsonl: one JSON line per logged iteration, and event lines {"event": "start" | "resume" |
  "interrupted" | "end", ...}. A resumed run appends to the log; the iterations after a "resume"
  event replace any of the same number before it (rows of an interrupted attempt are kept).
- Interrupts. SIGINT (Ctrl-C) and SIGTERM (what schedulers send before they kill a job; torchrun
  forwards both to its workers and waits 30 s before SIGKILL) set a flag; the loop finishes the
  current step or evaluation batch, the ranks agree, it saves and exits 128 + the signal number. A
  second signal, or one before the loop starts (nothing to save), stops at once. Under torchrun
  the ranks agree through an all-reduce of their flags a step, overlapped with the next step.
- Traces. --profile=W:A records A steps after the first W of this run with torch.profiler into one
  Chrome trace per rank, <out_dir>/trace/rank<N>.json (the collectives, BTP's chunks and the
  optimizer step labelled), replacing the files of an earlier profile there.
"""
import contextlib
import fcntl
import json
import os
import re
import resource
import shutil
import signal
import sys
import time
import uuid

import torch
import torch.distributed as dist


def check_place(out_dir):
    """ValueError if out_dir lies inside another run's checkpoints/ folder, whose pruning, overwrite
    and saves would remove or replace it."""
    path = os.path.realpath(out_dir)
    while path != os.path.dirname(path):
        name, parent = os.path.basename(path), os.path.dirname(path)
        inside = re.fullmatch(r"iter_\d+(\.tmp)?", name) and \
            os.path.basename(parent) == "checkpoints"
        a_run = any(os.path.exists(os.path.join(parent, f))
                    for f in ("run.json", "run.lock", "metrics.jsonl"))
        if inside or (name == "checkpoints" and a_run):
            raise ValueError(f"out_dir {out_dir} is inside the checkpoints of the run in "
                             f"{parent if not inside else os.path.dirname(parent)}, which removes "
                             "what it holds when it prunes: choose an out_dir outside it")
        path = parent


def check_tensorboard(out_dir):
    """ValueError if <out_dir>/tensorboard, where --tensorboard=true writes, is a file."""
    board = os.path.join(out_dir, "tensorboard")
    if os.path.exists(board) and not os.path.isdir(board):
        raise ValueError(f"{board} is a file, where --tensorboard=true writes its events: move it "
                         "away")


def lock(out_dir):
    """Take <out_dir>/run.lock and return its open file (held while the caller keeps it open);
    ValueError if another run holds it."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        f = open(os.path.join(out_dir, "run.lock"), "a+")
    except OSError as e:
        raise ValueError(f"out_dir {out_dir} cannot be written ({e.strerror})") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        owner = f.read().strip() or "another process"
        f.close()
        raise ValueError(f"out_dir {out_dir} is in use by a live run ({owner}): wait for it to end "
                         "or choose another --out_dir") from None
    f.truncate(0)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    f.write(f"pid {os.getpid()} on {os.uname().nodename}, started {started}\n")
    f.flush()
    return f


def unlock(f):
    """Free a lock taken by lock() (None: nothing to free)."""
    if f is not None:
        f.close()


def checkpoint_folders(out_dir):
    """Every checkpoint folder a run wrote in out_dir, complete (iter_N) or not (iter_N.tmp)."""
    folder = os.path.join(out_dir, "checkpoints")
    return sorted(os.path.join(folder, d) for d in os.listdir(folder) if d.startswith("iter_")) \
        if os.path.isdir(folder) else []


def earlier_run(out_dir):
    """What an earlier run left in out_dir: a list of 'N checkpoints', 'metrics.jsonl'."""
    found = []
    ckpts = checkpoint_folders(out_dir)
    if ckpts:
        found.append(f"{len(ckpts)} checkpoint folder{'s' if len(ckpts) > 1 else ''}")
    if os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
        found.append("metrics.jsonl")
    return found


def _restarted_job(out_dir):
    """True when torchrun restarted this job (--max-restarts) and out_dir is its own first
    attempt's."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return False
    try:
        with open(os.path.join(out_dir, "run.json")) as f:
            return json.load(f).get("torchrun_job") == os.environ.get("TORCHELASTIC_RUN_ID")
    except (OSError, json.JSONDecodeError):
        return False


def check_scratch(out_dir, overwrite):
    """Before a run from scratch: ValueError if out_dir holds an earlier run (unless overwrite)."""
    found = earlier_run(out_dir)
    if found and not overwrite and not _restarted_job(out_dir):
        raise ValueError(f"out_dir {out_dir} holds an earlier run ({' and '.join(found)}): "
                         "continue it with --init_from=resume, choose another --out_dir, or "
                         "discard it with --overwrite=true")


def discard(out_dir):
    """--overwrite: remove what an earlier run wrote (checkpoints/iter_*, metrics.jsonl,
    run.json)."""
    for d in checkpoint_folders(out_dir):
        shutil.rmtree(d)
    for name in ("metrics.jsonl", "run.json"):
        if os.path.exists(os.path.join(out_dir, name)):
            os.remove(os.path.join(out_dir, name))


def machine(device, world):
    """A run's machine and load in a few words, for its log and figures that show time."""
    where = f"{os.cpu_count()} CPUs"
    if device.startswith("cuda"):
        where = f"{torch.cuda.get_device_name(torch.device(device))}, {where}"
    return {"machine": f"{where}, {world} process{'es' if world > 1 else ''}",
            "load": round(os.getloadavg()[0], 2)}


def tell_torchrun(line):
    """Under torchrun, `line` (a user error) into this rank's TORCHELASTIC_ERROR_FILE, as @record
    writes it: torchrun's failure summary, printed last, then shows it in place of a traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError):
            with open(path, "w") as f:
                json.dump({"message": line, "timestamp": str(int(time.time()))}, f)


def cannot_write(target, e):
    """The ValueError for an output that could not be written, naming it, what the system said
    (an OSError's words, or the "os error N" inside a safetensors or DCP error) and the space free
    where it was going: a full disk says "No space left on device"."""
    found = re.search(r"os error (\d+)", str(e))
    why = getattr(e, "strerror", None) or (os.strerror(int(found[1])) if found else
                                           type(e).__name__)
    where = os.path.dirname(os.path.abspath(target))
    while not os.path.isdir(where):
        where = os.path.dirname(where)
    free = shutil.disk_usage(where).free / 1e6
    return ValueError(f"cannot write {target} ({why}; {free:,.0f} MB free there); nothing of it "
                      "was kept")


def new_run_id():
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


def write_run(out_dir, run_id, argv):
    """<out_dir>/run.json: which run the folder belongs to."""
    info = {"run_id": run_id, "argv": argv, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "torchrun_job": os.environ.get("TORCHELASTIC_RUN_ID")}
    tmp = os.path.join(out_dir, f"run.json.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(info, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "run.json"))


class Metrics:
    """metrics.jsonl, appended and flushed line by line (rank 0 only; a no-op elsewhere); with
    tensorboard=True every number of an iteration's record also goes to <out_dir>/tensorboard as a
    scalar at that iteration (torch.utils.tensorboard, as torchtitan and Megatron write them)."""

    def __init__(self, out_dir, active, tensorboard=False):
        self.f = open(os.path.join(out_dir, "metrics.jsonl"), "a") if active else None
        self.board = None
        if active and tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.board = SummaryWriter(os.path.join(out_dir, "tensorboard"))

    @classmethod
    def start(cls, out_dir, active, run_id, argv, resumed_from=None, iter_num=0, tensorboard=False,
              tokens_per_iter=None, about=None):
        """The log of a run that starts or resumes: run.json written, the first event appended (with
        the tokens an iteration trains and `about`: the arch, the machine and its load, which
        tools/plot.py reads)."""
        metrics = cls(out_dir, active, tensorboard)
        if active:
            write_run(out_dir, run_id, argv)
            if resumed_from:
                metrics.event("resume", iter=iter_num, checkpoint=resumed_from, run_id=run_id,
                              tokens_per_iter=tokens_per_iter, **(about or {}))
            else:
                metrics.event("start", run_id=run_id, argv=argv, tokens_per_iter=tokens_per_iter,
                              **(about or {}))
        return metrics

    def write(self, record):
        if self.f:
            try:
                self.f.write(json.dumps(record) + "\n")
                self.f.flush()
            except OSError as e:   # (a full disk: one line and exit 2, the checkpoints whole)
                print(line := f"error: cannot write {self.f.name} ({e.strerror}); the run stops "
                      "here, its checkpoints untouched: free space, then --init_from=resume",
                      file=sys.stderr)
                tell_torchrun(line)
                sys.exit(2)
        if self.board and "event" not in record:
            for key, value in record.items():
                if key != "iter" and isinstance(value, (int, float)):
                    self.board.add_scalar(key, value, record["iter"])
            self.board.flush()

    def event(self, name, **fields):
        self.write({"event": name, "time": time.strftime("%Y-%m-%d %H:%M:%S"), **fields})

    def close(self):
        if self.f:
            self.f.close()
        if self.board:
            self.board.close()


class Interrupt:
    """SIGINT and SIGTERM handlers: the first asks the loop to save and stop, the second stops
    now."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, say):
        self.say, self.signum, self.armed, self.defer = say, 0, False, False
        self.pending = (None, None)   # (work, flag) of the agreement all-reduce in flight
        self.previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.defer and not self.signum:
            self.signum = signum
            self.say(f"{name}: stopping once the checkpoint is read ({name} again stops at once)")
            return
        if self.defer:
            os._exit(128 + signum)   # (nothing was written: the run is as it was)
        if not self.armed:
            self.say(f"{name} before training started: stopped (nothing to save)")
            sys.exit(128 + signum)
        if self.signum:
            self.say(f"{name} again: stopped at once, without saving")
            sys.stdout.flush()
            os._exit(128 + signum)
        self.signum = signum
        self.say(f"{name}: finishing this iteration (or evaluation batch), then saving a "
                 f"checkpoint ({name} again stops at once)")

    @contextlib.contextmanager
    def deferred(self):
        """Within: a signal is noted, not acted on; after: a noted signal stops the process with
        128+N before anything is written or pruned. A resume verifies and reads its checkpoint
        within: an exit raised inside DCP's load comes out as a CheckpointException, which would
        condemn a good checkpoint and send the run back to an older one."""
        self.defer = True
        try:
            yield
        finally:
            self.defer = False
        if self.signum:
            self.say(f"{signal.Signals(self.signum).name}: stopped before training (nothing "
                     "written; the checkpoints are as they were)")
            sys.exit(128 + self.signum)

    def agreed(self, group):
        """The signal number if a rank was interrupted, else 0; called once a step by every rank.
        Under torchrun the ranks' flags of one step are all-reduced (MAX) over `group`, a gloo group
        of CPU tensors, while the next step computes (async_op): agreeing never waits for the GPU,
        and the run stops one step after the signal."""
        if group is None:
            return self.signum
        result = self.settle()
        flag = torch.tensor([self.signum])
        self.pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True),
                        flag)
        return result

    def now(self, group):
        """The signal number if a rank was interrupted, agreed now (evaluation asks between its
        batches, so a stop takes effect within one batch): the step's agreement in flight, then one
        blocking all-reduce (MAX) of the flags over `group`; called by every rank alike. A rank
        that got no signal itself takes the agreed one as its own."""
        if group is not None:
            earlier, flag = self.settle(), torch.tensor([self.signum])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            self.signum = self.signum or max(earlier, int(flag.item()))
        return self.signum

    def settle(self):
        """Wait for the all-reduce in flight (before other collectives, at the end); its result."""
        work, flag = self.pending
        self.pending = (None, None)
        if work is None:
            return 0
        work.wait()
        return int(flag.item())

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def synchronize(device):
    """Wait for the device's queued work (a GPU's; a no-op elsewhere)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def clock(device):
    """time.time() after the device's queued work: a log step's time, tokens/s and MFU are the
    device's (the host is otherwise ahead of it by queued steps). Read at log steps only."""
    synchronize(device)
    return time.time()


def peak_memory_gb(device):
    """This rank's peak memory since reset_peak_memory: CUDA max allocated on a GPU, the resident
    set's high-water mark elsewhere (Linux's VmHWM; the process's whole life where there is no
    /proc)."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 1e9
    try:
        with open("/proc/self/status") as fh:
            hwm = next(line for line in fh if line.startswith("VmHWM:"))
        return int(hwm.split()[1]) * 1024 / 1e9   # kB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB


def reset_peak_memory(device):
    """The next peak_memory_gb starts from now: a log line reports its own steps' peak, not
    evaluation's or the kernels' timing's (Linux resets VmHWM through /proc/self/clear_refs)."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def duration(seconds):
    """1h02m, 3m07s, 12.3s."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


def profiler(spec, out_dir, rank, log, steps=None):
    """--profile=W:A: a started torch.profiler.profile that records A steps after the first W of
    this run (train.py calls .step() after each) and writes <out_dir>/trace/rank<N>.json; None
    without it. `steps`: how many this run will train (a resumed run may train fewer than W + A)."""
    if not spec:
        return None
    wait, active = (int(n) for n in spec.split(":"))
    held = active if steps is None else max(0, min(active, steps - wait))
    path = os.path.join(out_dir, "trace", f"rank{rank}.json")

    def write(prof):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        prof.export_chrome_trace(path)
        log(f"profile: wrote {os.path.join(out_dir, 'trace')}/rank<N>.json ({held} steps after the "
            f"first {wait} of "
            "this run); open one in https://ui.perfetto.dev or chrome://tracing")
    prof = torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=max(wait - 1, 0), warmup=min(wait, 1), active=active,
                                         repeat=1),
        on_trace_ready=write, record_shapes=True)
    prof.start()
    return prof
