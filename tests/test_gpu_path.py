"""test_gpu_path.py: the mechanisms of the CUDA path that reproduce on a CPU: --kernels=auto choosing
alike on every rank, shapes timed before torch.compile traces, autotune keys bucketed, int64 element
offsets in the Triton kernels, and the non-finite check that never waits for the device (kernels.py,
triton_kernels.py, train.py; BOOST arXiv 2512.12131 sections 3-4).
"""
import pytest
import torch
import torch.distributed as dist

import kernels   # first: it imports triton_kernels, which sets TRITON_INTERPRET=1 without CUDA
import train
import triton
import triton.language as tl
import triton_kernels as tk
from conftest import TINY, expect_error, spawn


def _choose(tp_rank, world, out):
    """Each rank times one shape with forced times that favour triton on rank 0, torch on rank 1."""
    forced = {0: {"triton": 1.0, "torch": 2.0}, 1: {"triton": 4.0, "torch": 1.0}}[tp_rank]
    kernels._time = lambda fn, args, name: forced[name]
    kernels.select("torch", "cpu")
    kernels.agree_over(dist.group.WORLD if out == "agreed" else None)
    with kernels.using("auto"):
        mine = kernels._which("rms_norm", lambda: "≤16x32", None, (torch.zeros(16, 32),))
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if out == "agreed":   # the mean times: triton 2.5 ms, torch 1.5 ms on both ranks
        assert everyone == ["torch", "torch"], everyone
    else:                 # alone, each rank keeps its own faster one: the drift the agreement prevents
        assert everyone == ["triton", "torch"], everyone


@pytest.mark.parametrize("mode", ["agreed", "alone"])
def test_auto_chooses_alike_on_every_rank(mode):
    spawn(2, _choose, mode)


def test_autotune_and_auto_keys_bucket_the_token_count():
    """Sampling's M = 1..200: the autotuners' keys and auto's shape keys round M up to a power of two."""
    assert [tk.bucket(m) for m in (1, 2, 3, 5, 100, 128, 129, 200)] == [1, 2, 4, 8, 128, 128, 256, 256]
    keys = {kernels._rows(torch.zeros(m, 8)) for m in range(65, 129)}
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
    monkeypatch.setattr(kernels, "select", lambda mode, device: setattr(kernels, "_backend", "auto"))
    monkeypatch.setattr(kernels, "_time", lambda fn, args, name: {"triton": 2.0, "torch": 1.0}[name])
    monkeypatch.setattr(torch, "compile", lambda model: (at_compile.setdefault("chosen", kernels.chosen()), model)[1])
    kernels._choices.clear()
    try:
        train.main([f"--out_dir={tmp_path}", f"--data_dir={data_dir}", *TINY, "--max_iters=2", "--compile=true",
                    "--kernels=auto"])
        timed = kernels.chosen()
    finally:
        kernels._backend = "torch"
        kernels._choices.clear()
    assert at_compile["chosen"] == timed   # training met no shape the warm-up had not timed
    ops = {op for op, key in at_compile["chosen"]}
    assert ops == {"norm_down", "grouped_up", "rms_norm"}, at_compile
