"""test_gpu_path.py: the mechanisms of the CUDA path that reproduce on a CPU: --kernels=auto choosing
alike on every rank, shapes timed before torch.compile traces, autotune keys bucketed, int64 element
offsets in the Triton kernels, the non-finite check that never waits for the device, and the fixes
of a reading of every CUDA path that a CPU can show (local_ops.py, triton_kernels.py, train.py,
sharding.py, tools/gpu_check.py; BOOST arXiv 2512.12131 sections 3-4).
"""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import local_ops   # first: it imports triton_kernels, which sets TRITON_INTERPRET=1 without CUDA
from extensions import kernel_choice
import train
import triton
import triton.language as tl
import triton_kernels as tk
from conftest import TINY, expect_error, spawn


def _choose(tp_rank, world, out):
    """Each rank times one shape with forced times that favour triton on rank 0, torch on rank 1."""
    forced = {0: {"triton": (1.0, 1.0), "torch": (2.0, 2.0)}, 1: {"triton": (4.0, 4.0), "torch": (1.0, 1.0)}}[tp_rank]
    kernel_choice._time = lambda fn, args, name: forced[name]   # (forward ms, backward ms)
    kernel_choice.select("torch", "cpu")
    kernel_choice.agree_over(dist.group.WORLD if out == "agreed" else None)
    with local_ops.using("auto"):
        mine = local_ops._which("rms_norm", lambda: "≤16x32", None, (torch.zeros(16, 32),))
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if out == "agreed":   # the mean times: triton 2.5 ms, torch 1.5 ms on both ranks
        assert everyone == [("torch", "torch")] * 2, everyone
    else:                 # alone, each rank keeps its own faster one: the drift the agreement prevents
        assert everyone == [("triton", "triton"), ("torch", "torch")], everyone


@pytest.mark.parametrize("mode", ["agreed", "alone"])
def test_auto_chooses_alike_on_every_rank(mode):
    spawn(2, _choose, mode)


def test_autotune_and_auto_keys_bucket_the_token_count():
    """Sampling's M = 1..200: the autotuners' keys and auto's shape keys round M up to a power of two."""
    assert [tk.bucket(m) for m in (1, 2, 3, 5, 100, 128, 129, 200)] == [1, 2, 4, 8, 128, 128, 256, 256]
    keys = {local_ops._rows(torch.zeros(m, 8)) for m in range(65, 129)}
    assert keys == {"≤128"}


@triton.jit
def _offsets(out_ptr, first_row, s_row, B: tl.constexpr):
    rows = first_row + tl.arange(0, B)   # int32
    cols = tl.arange(0, B)
    tl.store(out_ptr + tl.arange(0, B)[:, None] * B + cols[None, :], tk._at(rows, cols, s_row, 1))


def test_element_offsets_are_int64_past_two_to_the_31():
    """triton_kernels._at, which every kernel's loads and stores go through: rows past 2^20 times a
    stride of 2^12 is past 2^31, where int32 products wrap (interpreted here, compiled alike)."""
    first, stride, B = 1 << 20, 1 << 12, 4
    out = torch.zeros(B, B, dtype=torch.int64)
    _offsets[(1,)](out, first, stride, B=B)
    rows, cols = torch.arange(first, first + B, dtype=torch.int64), torch.arange(B, dtype=torch.int64)
    assert torch.equal(out, rows[:, None] * stride + cols[None, :])
    assert out.max() > 2 ** 31


def test_rms_warps_grow_with_the_row():
    assert [tk.rms_warps(b, backward=True) for b in (256, 4096, 8192, 16384, 65536)] == [4, 4, 8, 16, 16]
    assert [tk.rms_warps(b) for b in (256, 4096, 8192, 16384, 65536)] == [4, 4, 4, 8, 16]


def test_non_finite_gradient_is_read_at_the_next_log_step_and_its_update_skipped(tmp_path, data_dir, capsys):
    """The finite check is a device flag read at log steps and before saves (no host sync a step):
    a NaN at iteration 3 with log_interval=2 is reported at iteration 4, and the fused AdamW skipped
    iteration 3's update on the device (found_inf), so the weights never held a NaN."""
    seen = {}
    step = train.train_step

    def watched(run, iter_num):
        loss = step(run, iter_num)
        seen[iter_num] = all(torch.isfinite(p).all() for p in run.raw_model.parameters())
        return loss
    train.train_step = watched
    try:
        expect_error(capsys, [f"--out_dir={tmp_path}", f"--data_dir={data_dir}", *TINY, "--log_interval=2",
                              "--max_iters=8", "--eval_interval=100", "--inject_fault=nan:3"],
                     "not finite at iteration 3 (its update skipped; stopped at iteration 4)")
    finally:
        train.train_step = step
    assert sorted(seen) == [0, 1, 2, 3, 4] and all(seen.values()), seen


def test_compile_with_auto_times_every_shape_in_an_eager_step_first(tmp_path, data_dir, monkeypatch):
    """--kernels=auto --compile=true: before torch.compile traces (which reads choices, records none),
    one eager forward and backward has timed every op and shape the step runs (forced here with the
    reference chosen: a CPU has no CUDA for auto, and compiling takes minutes)."""
    at_compile = {}
    monkeypatch.setattr(local_ops, "select", lambda mode, device: setattr(local_ops, "_backend", "auto"))
    monkeypatch.setattr(kernel_choice, "_time", lambda fn, args, name: {"triton": (2.0, 2.0), "torch": (1.0, 1.0)}[name])
    monkeypatch.setattr(torch, "compile", lambda model: (at_compile.setdefault("chosen", local_ops.chosen()), model)[1])
    local_ops._choices.clear()
    try:
        train.main([f"--out_dir={tmp_path}", f"--data_dir={data_dir}", *TINY, "--max_iters=2", "--compile=true",
                    "--kernels=auto"])
        timed = local_ops.chosen()
    finally:
        local_ops._backend = "torch"
        local_ops._choices.clear()
    assert at_compile["chosen"] == timed   # training met no shape the warm-up had not timed
    ops = {op for op, key in at_compile["chosen"]}
    assert ops == {"norm_down", "grouped_expand", "rms_norm"}, at_compile


# ---------------------------------------------------------------- issue 34's CPU-visible fixes

def test_norm_down_and_rms_norm_keep_an_fp32_residual_under_autocast():
    """Under bf16 autocast the kernels take the fp32 residual as it is (not rounded to bf16 first):
    Σx² and RMSNorm come from fp32 x as the reference's do, and dx is fp32; only the matmul's
    operands are bf16 (CPU autocast, kernels interpreted: the dtype handling is the CUDA path's)."""
    g = torch.Generator().manual_seed(0)
    x = (1 + torch.randn(37, 40, generator=g) * 1e-2).requires_grad_()   # bf16 rounding shows in Σx²
    gamma, A = 1 + torch.rand(40, generator=g), torch.randn(24, 40, generator=g)
    got, want = {}, {}
    for impl, out in (("triton", got), ("torch", want)):
        x.grad = None
        with local_ops.using(impl), torch.autocast("cpu", dtype=torch.bfloat16):
            H, S = local_ops.norm_down(x, gamma, A)
            y = local_ops.rms_norm(x, gamma, 1e-5)
        (H.float().sum() + S.sum() + y.sum()).backward()
        out.update(H=H, S=S, y=y, dx=x.grad)
    assert got["S"].dtype == torch.float32 and got["y"].dtype == torch.float32 and got["dx"].dtype == torch.float32
    torch.testing.assert_close(got["S"], want["S"], rtol=1e-6, atol=0)   # bf16-rounded x: off by ~1e-3
    torch.testing.assert_close(got["y"], want["y"], rtol=1e-6, atol=1e-6)
    assert got["H"].dtype == want["H"].dtype == torch.bfloat16   # (the interpreter's bf16 casts truncate)
    for name in ("H", "dx"):
        scale = want[name].float().abs().max().item()
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=2e-2, atol=2e-2 * scale)


def test_triton_architecture_is_chosen_per_device_at_first_launch(monkeypatch):
    """Importing triton_kernels asks no GPU anything; each device's architecture (A100 80, H100 90)
    picks its own tile list when a kernel first launches there."""
    monkeypatch.setattr(tk, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: {0: (8, 0), 1: (9, 0)}[d.index])
    assert [tk.arch(torch.device("cuda", i)) for i in (0, 1)] == [80, 90]
    configs = {a: [(c.kwargs, c.num_stages) for c in tk.tuner("grouped_mm", 16, a).configs] for a in (80, 90)}
    assert configs[80] != configs[90] and len(configs[90]) == len(tk.GEMM_CONFIGS[(90, 16)])
    assert tk.tuner("grouped_mm", 16, 90) is tk.tuner("grouped_mm", 16, 90)   # made once


@pytest.mark.parametrize("local_rank", [None, "1"])
def test_every_way_of_writing_a_gpu_sets_an_indexed_current_device(monkeypatch, local_rank):
    """--device=auto, cuda, cuda:0, cuda:1 alone and under torchrun (LOCAL_RANK): the plan names an
    indexed device and placement makes it current through torch's own torch.cuda.set_device and its
    argument check (which refuses a bare "cuda"); only the driver call is stood in for. A CPU run
    sets nothing."""
    from plumbing import placement, plan
    seen = []
    monkeypatch.setattr(torch._C, "_cuda_setDevice", seen.append, raising=False)   # the driver
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    own = int(local_rank or 0)
    want = {"auto": own, "cuda": own, "cuda:0": 0, "cuda:1": 1}
    for written, index in want.items():
        device = plan.resolve_device(written)
        assert device == f"cuda:{index}" and torch.device(device).index == index
        place = placement.place_processes(SimpleNamespace(tc=train.options.TrainConfig(), world=1, dp=1, device=device))
        assert place.device == device
    assert seen == list(want.values())
    with pytest.raises(ValueError, match="specified index"):   # what the old code passed
        torch.cuda.set_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert plan.resolve_device("auto") == plan.resolve_device("cpu") == "cpu"
    placement.place_processes(SimpleNamespace(tc=train.options.TrainConfig(), world=1, dp=1, device="cpu"))
    assert seen == list(want.values())


def test_clip_grad_norm_uses_foreach_kernels_and_copies_no_gradient(monkeypatch):
    """The norm is one _foreach_norm per kind of parameter (fp64 only for the per-tensor norms) and
    the clipping one _foreach_mul_: no fp64 copy of a gradient, no per-parameter mul; the result is
    the single-device norm and clipping."""
    from torch.utils._python_dispatch import TorchDispatchMode
    import sharding
    from conftest import group_of_one
    from model import Config, Llama
    cfg = Config(arch="cola", n_layer=2, n_embd=32, n_head=4, block_size=8, vocab_size=64)
    torch.manual_seed(0)
    model = group_of_one(Llama(cfg), "none")
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(idx, idx)[1].backward()
    grads = [p.grad.clone() for p in model.parameters()]
    want = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads]))

    class Ops(TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            big = [o for o in (out if isinstance(out, (list, tuple)) else [out])
                   if torch.is_tensor(o) and o.dtype == torch.float64 and o.numel() > len(grads)]
            self.seen.append((func.overloadpacket.__name__, bool(big)))
            return out
    with Ops():
        norm = sharding.clip_grad_norm(model, 0.5 * want.item())
    names = [n for n, _ in Ops.seen]
    assert "_foreach_norm" in names and "_foreach_mul_" in names and "mul_" not in names, names
    assert not any(big for _, big in Ops.seen), Ops.seen   # no fp64 tensor bigger than the norms
    torch.testing.assert_close(norm.double(), want, rtol=1e-6, atol=0)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g * 0.5, rtol=1e-5, atol=1e-7)


def test_evaluation_runs_the_uncompiled_model(tmp_path, data_dir, monkeypatch):
    """--compile=true: the compiled module trains; evaluation (no_grad, eval()) runs the model itself,
    so torch.compile never traces a second graph for it (torch.compile is stood in for here)."""
    calls = []

    class Compiled(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, *args):
            calls.append(torch.is_grad_enabled())
            return self.model(*args)
    monkeypatch.setattr(torch, "compile", Compiled)
    train.main([f"--out_dir={tmp_path}", f"--data_dir={data_dir}", *TINY, "--max_iters=2", "--compile=true",
                "--eval_interval=1", "--sample_tokens=0"])
    assert calls == [True, True], calls   # the two training steps, no evaluation


def test_a_log_line_times_its_steps_between_synchronised_clocks(tmp_path, data_dir, monkeypatch):
    """A log line's ms is the time from the last synchronised log step (or evaluation's end) to
    this one, divided by the steps between: with log_interval=3 the steps queued before the clock
    are counted in the interval, not in one step. Clocks are read at log steps and after
    evaluation only, each after the device's work (time stood in for: 1 s a training step)."""
    from plumbing import rundir
    events, now = [], [0.0]
    monkeypatch.setattr(rundir, "synchronize", lambda device: events.append("sync"))
    monkeypatch.setattr(train.time, "time", lambda: now[0])
    step = train.train_step

    def one_second(run, iter_num):
        now[0] += 1.0
        events.append(f"step {iter_num}")
        return step(run, iter_num)
    monkeypatch.setattr(train, "train_step", one_second)
    train.main([f"--out_dir={tmp_path}", f"--data_dir={data_dir}", *TINY, "--max_iters=7",
                "--log_interval=3", "--eval_interval=100", "--sample_tokens=0"])
    assert events == ["sync", "step 0", "sync", "step 1", "step 2", "step 3", "sync", "step 4",
                      "step 5", "step 6", "sync", "sync"], events   # (the last: iteration 7's eval)
    from conftest import metrics
    ms = {r["iter"]: r["ms"] for r in metrics(tmp_path) if "ms" in r}
    assert ms == {0: 1000.0, 3: 1000.0, 6: 1000.0}, ms


def test_a_log_line_reports_its_own_steps_peak_memory(monkeypatch):
    """The peak is reset after each log line and evaluation: on a CPU through Linux's
    /proc/self/clear_refs (VmHWM), on a GPU CUDA's counter."""
    from plumbing import rundir
    big = torch.ones(64 << 20, dtype=torch.uint8)   # 64 MB touched
    big += 1
    before = rundir.peak_memory_gb("cpu")
    del big
    rundir.reset_peak_memory("cpu")
    after = rundir.peak_memory_gb("cpu")
    assert before - after > 0.05, (before, after)
    reset = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset.append)
    rundir.reset_peak_memory("cuda:0")
    assert reset == ["cuda:0"]


def test_gpu_check_cpu_says_in_one_line_when_the_interpreter_cannot_run(monkeypatch):
    """Triton 3.6's interpreter fails with numpy 2.4 and newer (the GPU image's pair): gpu_check --cpu
    says so in one line instead of failing later."""
    import numpy
    import gpu_check
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.5.0")
    assert "fails in triton 3.6.0 with numpy 2.5.0" in gpu_check.missing(cpu=True)
    assert gpu_check.missing(cpu=False) is None or "CUDA" in gpu_check.missing(cpu=False)
    monkeypatch.setattr(numpy, "__version__", "2.3.1")
    assert gpu_check.missing(cpu=True) is None


def test_optimizer_state_is_made_on_each_parameter_device():
    """The fused AdamW keeps `step` on the parameter's device (a GPU's): the state a resume loads into
    is made there, every moment and every step (parameters on the meta device stand for a GPU's)."""
    from plumbing import train_state
    from conftest import group_of_one
    from model import Config, Llama
    model = group_of_one(Llama(Config(arch="cola", n_layer=1, n_embd=32, n_head=4, block_size=8,
                                      vocab_size=64)), "none").to("meta")
    opt = train.muon.configure(model, train.options.TrainConfig())
    views = train_state.state_views(model, opt, None)
    assert views and all(t.device.type == "meta" for t in views.values())
    assert all(t.device.type == "meta" for p in model.parameters() for t in opt.state[p].values())


# ---------------------------------------------------------------- issue 42: compiled graphs

GRAPH_CASES = (("cola", "btp"), ("svd", "vanilla"), ("full", "megatron"))
# LaX under recompute=lowrank: its crossing runs inside each checkpointed chunk (lax_layers.ChunkView)
LAX_CASE = ("cola", "btp", dict(lax=True), "lowrank")


def _graphs(tp_rank, world, out=None):
    """{(layout, kernels): (graphs, breaks)} of torch._dynamo.explain over a training forward
    (the loss) at this TP degree; the Triton kernels interpreted."""
    from tp_model import TPLlama
    import parallel
    from conftest import small_cfg
    from model import Llama
    tp = parallel.TPGroup(dist.group.WORLD if world > 1 else None, tp_rank, world)
    found = {}
    for arch, layout, extra, recompute in [(*c, {}, "none") for c in GRAPH_CASES] + [LAX_CASE]:
        torch.manual_seed(0)
        cfg = small_cfg(arch, n_layer=2 if extra else 1, **extra)   # (LaX crosses from layer 1)
        model = TPLlama(Llama(cfg), tp, layout, recompute=recompute)
        idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        for impl in ("torch", "triton"):
            torch._dynamo.reset()
            with local_ops.using(impl):
                ex = torch._dynamo.explain(lambda i: model(i, i)[1])(idx)
            found[(layout, impl, recompute)] = (ex.graph_count, ex.graph_break_count)
    assert all(v == (1, 0) for v in found.values()), found
    return found


def test_every_layout_compiles_to_one_graph_with_the_kernels_at_tp1():
    """The Triton kernels are custom ops (extensions/kernel_ops.py), the collectives functional under
    compile: a layer is one graph, no break, with --kernels=torch and --kernels=triton; and LaX
    with recompute=lowrank, whose crossing in each checkpointed chunk mutates nothing outside it."""
    cases = [(layout, "none") for _, layout in GRAPH_CASES] + [LAX_CASE[1::2]]
    assert set(_graphs(0, 1)) == {(layout, impl, recompute) for layout, recompute in cases
                                  for impl in ("torch", "triton")}


@pytest.mark.slow
def test_every_layout_compiles_to_one_graph_with_the_kernels_at_tp2():
    spawn(2, _graphs)
