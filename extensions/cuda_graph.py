"""cuda_graph.py: a whole training step captured as one CUDA graph and replayed (--cuda_graph=true).

Not in the BOOST paper (arXiv 2512.12131), but its authors' own measurements of CoLA inside
Megatron show why a low-rank model wants it: eager, CoLA-1B's step launches 26% more kernels than
the dense model's, each 42% shorter, and the GPU idles 27% of the step; captured as one graph it ran
1.45x faster than dense. A graph records the kernels of one step once (forward and backward of
every micro-batch, clipping, the optimizer) and replays them with one launch a step.

What a graph may hold: no question to the host (`.item()`, a tensor's truth value, a shape that
depends on data) and no host value that changes between steps. So the step reads its batch from
static buffers (copied in before each replay), the learning rate and the iteration number from
device tensors (filled before each replay), and writes its results (the loss, the gradient norm,
the first non-finite iteration) into tensors that outlive it; AdamW's fused kernel and Muon's step
skip a non-finite update on the device. `check_step` is what a CPU can prove: over a real step, a
dispatch mode records every op and finds no host synchronisation, and two steps make the same ops
on the same shapes (tests/test_cuda_graph.py, tp=1 and tp=2, AdamW and Muon).

How (torch.cuda.graphs' recipe): WARMUP eager steps on a side stream (they allocate the optimizer's
state, let --kernels=auto and Triton's autotuners time their shapes), then one step captured and
replayed; every later step copies its batch in and replays. The collectives' ledger is the
last eager step's, restored at each replay (a replay runs no Python). Not captured, refused in one
line by `refusal`: a CPU (a graph is CUDA's), a pipeline (its schedule sends from Python), DDP and
--dp_shard (their reducers' hooks, not built here), compile, --profile, --inject_fault.
"""
import copy

import torch

from parallel import LEDGER

WARMUP = 3   # eager steps before the capture
# ops that make the host wait for the device, or whose output's shape depends on data
HOST_SYNC = ("_local_scalar_dense", "is_nonzero", "equal", "allclose", "item")
DATA_SHAPE = ("nonzero", "masked_select", "unique", "_unique2", "unique_consecutive",
              "unique_dim", "repeat_interleave")
DEVICES = ("cuda",)   # (the tests' CPU stand-in for the graph adds "cpu")


def refusal(tc, device, dp):
    """Why this run's step cannot be captured (a line), or None."""
    why = [(not device.startswith(DEVICES), f"a graph is CUDA's, this run is on {device}"),
           (tc.pp > 1, "a pipeline's schedule sends between stages from Python"),
           (dp > 1, "DDP's and FSDP2's gradient hooks are not captured here (use dp=1)"),
           (tc.compile, "compile=true is the other way to cut launches: choose one"),
           (bool(tc.profile), "--profile would trace one replay, not the kernels"),
           (bool(tc.inject_fault), "--inject_fault acts from Python between steps")]
    found = [text for bad, text in why if bad]
    return f"cuda_graph=true cannot capture this run's step: {found[0]}" if found else None


class Graph:
    """torch.cuda.CUDAGraph behind the two calls Captured makes (the tests' CPU stand-in has the
    same two)."""

    def capture(self, fn):
        """Record fn's kernels (none run); returns fn's outputs, the tensors each replay fills."""
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            return fn()

    def replay(self):
        self.graph.replay()


class Captured:
    """A run's training step as one graph: `step(batches, iter_num)` copies the batch into the
    static buffers, fills the iteration number, and runs the step: eager for the first WARMUP calls
    (on a side stream on CUDA), captured at the next, replayed after. `body(batches, at)` is
    train.py's step over micro-batches `batches` at iteration `at` (a device tensor); it must
    write what outlives it in place."""

    def __init__(self, body, optimizer, device, graph=None):
        self.body, self.device, self.graph = body, device, graph or Graph()
        self.calls, self.outs, self.ledger, self.xs = 0, None, None, None
        self.at = torch.zeros((), dtype=torch.long, device=device)
        self.optimizer = optimizer
        for group in optimizer.param_groups:   # (a float would be baked into the graph)
            group["lr"] = torch.tensor(float(group["lr"]), device=device)

    def step(self, batches, iter_num):
        xs, ys = (torch.stack(t) for t in zip(*batches))   # (micro, b, s) each
        if self.xs is None:
            self.xs, self.ys = torch.empty_like(xs), torch.empty_like(ys)
        self.xs.copy_(xs, non_blocking=True)
        self.ys.copy_(ys, non_blocking=True)
        self.at.fill_(iter_num)
        self.calls += 1
        if self.calls <= WARMUP:   # (the last one's collectives: what each replay sends)
            out = self._warm()
            self.ledger = copy.deepcopy(dict(LEDGER.counts))
            return out
        if self.outs is None:   # (torch.optim refuses a capture without capturable, and warns
            for group in self.optimizer.param_groups:   # when it steps eager with it)
                group["capturable"] = self.device.startswith("cuda")
            self.outs = self.graph.capture(self._run)
        self.graph.replay()
        LEDGER.reset()   # (a replay runs no Python: the captured step's collectives)
        LEDGER.counts.update(copy.deepcopy(self.ledger))
        return self.outs

    def _run(self):
        return self.body(list(zip(self.xs, self.ys)), self.at)

    def _warm(self):
        if not self.device.startswith("cuda"):
            return self._run()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self._run()
        torch.cuda.current_stream().wait_stream(side)
        return out


def set_lr(group, value):
    """A group's learning rate for this step: in place where it is a tensor a graph reads."""
    if torch.is_tensor(group["lr"]):
        group["lr"].fill_(value)
    else:
        group["lr"] = value


class StepRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Every aten op a step calls, as (name, its tensors' shapes), and the ones a graph cannot
    hold: a host synchronisation or a shape that depends on data."""

    def __init__(self):
        super().__init__()
        self.ops, self.bad = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        shapes = tuple(tuple(a.shape) for a in torch.utils._pytree.tree_leaves((args, kwargs))
                       if isinstance(a, torch.Tensor))
        self.ops.append((name, shapes))
        if name in HOST_SYNC or name in DATA_SHAPE:
            self.bad.append(name)
        return func(*args, **(kwargs or {}))


def check_step(fn):
    """Run fn (one training step) under a StepRecorder; returns the recorder."""
    with StepRecorder() as recorder:
        fn()
    return recorder
