"""test_kernels.py: the Triton kernels against their PyTorch references, in Triton's interpreter on
CPU (local_ops.py turns it on where there is no CUDA): fp32, fp16 and bf16, ragged shapes.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import local_ops
from extensions import kernel_choice
from conftest import ROOT, TINY, losses, torchrun
from gpu_check_kernels import outputs_and_grads   # (tools/: the GPU check compares through it too)


# bf16 keeps 8 bits of mantissa: compared in fp32 against the fp32 reference of the same inputs
KERNEL_TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=1e-2, atol=1e-2),
              torch.bfloat16: dict(rtol=4e-2, atol=4e-2)}


def triton_and_ref(fn, inputs, upstream):
    """Outputs and input gradients of fn under the Triton and the reference backend."""
    return [outputs_and_grads(fn, inputs, upstream, backend) for backend in ("triton", "torch")]


def ref_in_fp32(fn, inputs, upstream):
    """The reference computed in fp32 from the same (rounded) inputs."""
    return outputs_and_grads(fn, [t.float() for t in inputs], upstream, "torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M, K, N", [(37, 50, 29), (64, 24, 97)])
def test_norm_down_kernel(dtype, M, K, N):
    g = torch.Generator().manual_seed(M + K + N)
    inputs = [torch.randn(M, K, generator=g).to(dtype), (1 + torch.rand(K, generator=g)).to(dtype),
              (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)]
    upstream = [torch.randn(M, N, generator=g).to(dtype), torch.randn(M, 1, generator=g)]
    (out, grads), _ = triton_and_ref(local_ops.norm_down, inputs, upstream)
    ref_out, ref_grads = ref_in_fp32(local_ops.norm_down_ref, inputs, upstream)
    for a, b in zip(out + grads, ref_out + ref_grads):
        torch.testing.assert_close(a, b, **KERNEL_TOL[dtype])
    again = triton_and_ref(local_ops.norm_down, inputs, upstream)[0]
    assert all(torch.equal(a, b) for a, b in zip(out + grads, again[0] + again[1]))  # deterministic


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("widths, r", [((40, 20, 20), 12), ((33, 33), 18), ((70,), 5)])
def test_grouped_expand_kernel(dtype, widths, r):
    g = torch.Generator().manual_seed(sum(widths) + r)
    M = 45
    inputs = [torch.randn(M, len(widths) * r, generator=g).to(dtype)] + \
             [(torch.randn(n, r, generator=g) / r ** 0.5).to(dtype) for n in widths]
    upstream = [torch.randn(M, n, generator=g).to(dtype) for n in widths]
    fn = lambda z, *Bs: local_ops.grouped_expand(z, list(Bs))
    (out, grads), _ = triton_and_ref(fn, inputs, upstream)
    ref_out, ref_grads = ref_in_fp32(lambda z, *Bs: local_ops.grouped_expand_ref(z, list(Bs)), inputs, upstream)
    for a, b in zip(out + grads, ref_out + ref_grads):
        torch.testing.assert_close(a, b, **KERNEL_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel(dtype):
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(2, 9, 48, generator=g).to(dtype), (1 + torch.rand(48, generator=g)).to(dtype)]
    upstream = [torch.randn(2, 9, 48, generator=g).to(dtype)]
    fn = lambda x, w: [local_ops.rms_norm(x, w, 1e-5)]
    (out, grads), _ = triton_and_ref(fn, inputs, upstream)
    ref_out, ref_grads = ref_in_fp32(lambda x, w: [local_ops.rms_norm_ref(x, w, 1e-5)], inputs, upstream)
    for a, b in zip(out + grads, ref_out + ref_grads):
        torch.testing.assert_close(a, b, **KERNEL_TOL[dtype])


def test_backward_references_are_autograds_gradients():
    """local_ops' written-out backward references (what a backward without its forward's graph
    runs: a PyTorch backward after a Triton forward under auto, CopyUp's halves) equal autograd's
    gradients of the forward references."""
    g = torch.Generator().manual_seed(5)
    rand = lambda *shape: torch.randn(*shape, generator=g)
    x, gamma, A = rand(13, 24).requires_grad_(), rand(24).requires_grad_(), rand(10, 24)
    A.requires_grad_()
    dH, dS = rand(13, 10), rand(13)
    H, S = local_ops.norm_down_ref(x, gamma, A)
    want = torch.autograd.grad([H, S.squeeze(-1)], [x, gamma, A], [dH, dS])
    got = local_ops.norm_down_ref_backward(dH, dS, x.detach(), gamma.detach(), A.detach())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    z, Bs = rand(13, 3 * 4).requires_grad_(), [rand(n, 4).requires_grad_() for n in (8, 5, 5)]
    dys = [rand(13, n) for n in (8, 5, 5)]
    want = torch.autograd.grad(local_ops.grouped_expand_ref(z, Bs), [z, *Bs], dys)
    got = [local_ops.grouped_expand_dz_ref(dys, Bs), *local_ops.grouped_expand_dB(dys, z, Bs)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    y = local_ops.rms_norm_ref(x, gamma, 1e-5)
    dy = rand(13, 24)
    want = torch.autograd.grad(y, [x, gamma], dy)
    got = local_ops.rms_norm_ref_backward(dy, x.detach(), gamma.detach(),
                                          local_ops.rms_stat(x.detach(), 1e-5))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_every_custom_op_passes_opcheck_in_training_dtype_mixes():
    """torch.library.opcheck (schema, fake tensors, autograd registration, dynamo) for each op,
    every forward/backward pairing auto may choose, and training's dtype mixes: fp32 throughout,
    an fp32 stream with bf16 weights (autocast), bf16 throughout."""
    from extensions import kernel_ops as ops
    g = torch.Generator().manual_seed(0)
    rand = lambda dtype, *shape: torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()
    checked = 0
    for xd, wd in [(torch.float32,) * 2, (torch.float32, torch.bfloat16), (torch.bfloat16,) * 2]:
        for ways in [(f, b) for f in local_ops.IMPLS for b in local_ops.IMPLS]:
            x, gamma = rand(xd, 20, 16), (1 + rand(xd, 16)).detach().requires_grad_()
            torch.library.opcheck(ops.norm_down_op, (x, gamma, rand(wd, 12, 16), *ways))
            torch.library.opcheck(ops.grouped_expand_op, (rand(wd, 20, 8), [rand(wd, 6, 4),
                                                                        rand(wd, 3, 4)], *ways))
            torch.library.opcheck(ops.rms_norm_op, (x, gamma, 1e-5, *ways))
            checked += 3
    assert checked == 36


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2])   # (tp=1: tools/gpu_check.py --cpu's run, test_tools.py)
def test_btp_training_with_triton_kernels_matches_torch(tmp_path, data_dir, tp):
    """At tp=2 the BTP layout, at tp=1 the single-device model run as BTP with a TP group of one
    (so one GPU gets the fused kernels too), against the PyTorch reference of each."""
    common = [f"--data_dir={data_dir}", *TINY, "--max_iters=3", "--eval_interval=100", f"--tp={tp}", "--batch_size=2",
              "--eval_iters=1", "--n_layer=1"]
    runs = {}
    for backend in ("torch", "triton"):
        res = torchrun(tp, f"--out_dir={tmp_path / backend}", *common, f"--kernels={backend}")
        assert ("kernels triton (Triton's interpreter on a CPU: hundreds of times slower" in res.stdout) == \
            (backend == "triton")
        runs[backend] = losses([json.loads(x) for x in open(tmp_path / backend / "metrics.jsonl")])
    assert len(runs["torch"]) == 3
    torch.testing.assert_close(torch.tensor(runs["triton"]), torch.tensor(runs["torch"]), rtol=1e-5, atol=1e-5)


def test_auto_times_each_op_once_and_keeps_the_faster(capsys):
    """--kernels=auto (on CUDA; forced here on the CPU, where Triton is interpreted): each op and shape
    is timed once, the faster kept and logged, and the results are those of the implementation chosen."""
    g = torch.Generator().manual_seed(5)
    x, gamma, A = torch.randn(2, 8, 32, generator=g), 1 + torch.rand(32, generator=g), torch.randn(24, 32, generator=g)
    z, Bs = torch.randn(2, 8, 16, generator=g), [torch.randn(n, 8, generator=g) for n in (12, 6)]
    kernel_choice.select("torch", "cpu")   # (forgets earlier choices)
    with local_ops.using("auto"):
        for _ in range(2):
            H, S = local_ops.norm_down(x, gamma, A)
            ys = local_ops.grouped_expand(z, Bs)
            y = local_ops.rms_norm(x, gamma, 1e-5)
    lines = capsys.readouterr().out.splitlines()
    way = r"(forward|backward) triton [\d.]+ ms vs torch [\d.]+ ms: (triton|torch)"
    assert len(lines) == 3 and all(re.fullmatch(rf"kernels: \w+ \(.+\) {way}; {way}", l) for l in lines), lines
    assert "norm_down (≤16x32 -> 24+1)" in lines[0] and "grouped_expand (≤16x2x8 -> 12+6)" in lines[1]
    assert set(local_ops.chosen()) == {("norm_down", "≤16x32 -> 24+1"), ("grouped_expand", "≤16x2x8 -> 12+6"),
                                     ("rms_norm", "≤16x32")}
    torch.testing.assert_close(H, local_ops.norm_down_ref(x, gamma, A)[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ys, local_ops.grouped_expand_ref(z, Bs), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y, local_ops.rms_norm_ref(x, gamma, 1e-5), rtol=1e-4, atol=1e-4)
    kernel_choice.select("torch", "cpu")


@pytest.mark.parametrize("ways", [("triton", "torch"), ("torch", "triton")])
def test_auto_chooses_each_direction_apart(monkeypatch, ways):
    """auto keeps a fused forward that wins even when its backward loses (and the other way round):
    each op then runs one direction through Triton and the other through the reference, with the
    reference's outputs and input gradients (fp32, and bf16 inputs against fp32)."""
    fast = {ways[0]: (1.0, 9.0), ways[1]: (9.0, 1.0)}   # (forward ms, backward ms)
    monkeypatch.setattr(kernel_choice, "_time", lambda fn, args, name: fast[name])
    cases = [("norm_down", [(37, 50), (50,), (29, 50)]), ("grouped_expand", [(37, 24), (12, 8), (20, 8), (7, 8)]),
             ("rms_norm", [(37, 50), (50,)])]
    for dtype in (torch.float32, torch.bfloat16):
        for op, shapes in cases:
            g = torch.Generator().manual_seed(1)
            inputs = [torch.randn(s, generator=g).to(dtype) for s in shapes]
            up = [torch.randn(s, generator=g) for s in
                  {"norm_down": [(37, 29), (37, 1)], "grouped_expand": [(37, 12), (37, 20), (37, 7)],
                   "rms_norm": [(37, 50)]}[op]]
            fn = {"norm_down": lambda x, gm, A: list(local_ops.norm_down(x, gm, A)),
                  "grouped_expand": lambda z, *Bs: local_ops.grouped_expand(z, list(Bs)),
                  "rms_norm": lambda x, gm: [local_ops.rms_norm(x, gm, 1e-5)]}[op]
            kernel_choice.select("torch", "cpu")
            mixed = outputs_and_grads(fn, inputs, up, "auto")
            assert list(local_ops.chosen().values()) == [ways], local_ops.chosen()
            ref = ref_in_fp32(fn, inputs, up)
            for got, want in zip(mixed[0] + mixed[1], ref[0] + ref[1]):
                torch.testing.assert_close(got, want, **KERNEL_TOL[dtype])
    kernel_choice.select("torch", "cpu")


def test_bench_gpu_shapes_and_plumbing_on_cpu(tmp_path):
    """bench.py gpu needs CUDA (a clear error here); its cases are the TP=4 slices of BOOST's 1B and
    7B shapes, and its measuring code runs, on tiny shapes, on the CPU."""
    import bench_gpu
    from model import Config
    cases = {label: (op, shapes, flops) for label, op, shapes, flops in bench_gpu.kernel_cases(bench_gpu.shapes()["1b"])}
    assert cases["norm_down q,k,v"] == ("norm_down", [(16384, 512), (512,), (1536, 512)], 2 * 16384 * 1536 * 512)
    assert cases["grouped_expand gate,up"][1] == [(16384, 1024), (1368, 512), (1368, 512)]
    assert bench_gpu.kernel_cases(bench_gpu.shapes()["7b"])[0][2] == [(16384, 1024), (1024,), (3072, 1024)]
    r = bench_gpu.measure_op("norm_down", [(64, 16), (16,), (24, 16)], 2 * 64 * 24 * 16, "torch", "cpu", torch.float32, 2)
    assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["tflops_fwd"] > 0 and r["vs_matmul"] > 0
    from test_cuda_graph import StandIn
    cfg = Config(arch="cola", n_layer=1, n_embd=32, n_head=4, block_size=16, vocab_size=64)
    for mode in ("eager", "captured"):   # (captured: a CPU stand-in for the graph)
        step = bench_gpu.train_step(cfg, "cpu", mode, runs=1, graph=StandIn())
        assert step["tokens_per_s"] > 0 and step["estimate_gb"] > 0
    assert bench_gpu.head_ms(cfg, "cpu", 16, runs=1) > 0
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "gpu", f"--json_dir={tmp_path}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 2 and res.stderr.strip() == "error: bench.py gpu needs a CUDA GPU (this machine has none)"


def _nvidia_backend():
    import triton
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


@pytest.mark.slow
@pytest.mark.skipif(not _nvidia_backend(), reason="this Triton install has no NVIDIA backend (no ptxas to compile with)")
def test_kernels_compile_for_a100_and_h100_without_spills():
    """Every kernel with every tile configuration of triton_kernels.GEMM_CONFIGS, for sm_80 (A100) and
    sm_90 (H100/H200), bf16 and fp32, and norm_down as bf16 autocast launches it (fp32 residual),
    compiled to PTX and cubin here (gpu_compile.py): bf16 GEMMs use
    the tensor cores (mma.sync on sm_80, wgmma on sm_90) and no kernel spills registers."""
    import triton_kernels as tk
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_compile.py"), "--json"], cwd=ROOT, capture_output=True,
                         text=True, timeout=900, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout)
    for sm in (80, 90):
        for dtype, bits in (("bf16", 16), ("fp32", 32)):
            mine = [r for r in rows if r["sm"] == sm and r["dtype"] == dtype]
            configs = len(tk.GEMM_CONFIGS[(sm, bits)])   # norm_down fwd and dx, grouped in its 3 calls,
            assert len(mine) == configs * 4 + 4, (sm, dtype, len(mine))   # grouped: up, dz; RMSNorm fwd, bwd at 4096, 8192
            for r in mine:
                assert r["spill_bytes"] == 0, r
                if r["gemm"] and dtype == "bf16":
                    assert (r["wgmma"] if sm == 90 else r["mma"]), r
        # bf16 autocast's calls: norm_down's fp32 x, γ, dx beside bf16 A, H, dH (its dx on the x32
        # list), the grouped GEMM's fp32 Bs read where they lie beside bf16 latents (up and dz)
        mixed = [r for r in rows if r["sm"] == sm and r["dtype"] == "mixed"]
        assert len(mixed) == 3 * len(tk.GEMM_CONFIGS[(sm, 16)]) + len(tk.GEMM_CONFIGS[(sm, "x32")]), mixed
        assert all(r["spill_bytes"] == 0 and (r["wgmma"] if sm == 90 else r["mma"]) for r in mixed), mixed


@pytest.mark.parametrize("recompute", ["lowrank", "layer"])
def test_auto_timing_inside_a_recompute_segment(capsys, recompute):
    """--kernels=auto times a new shape the first time it comes, which may be inside an activation-
    checkpoint segment (the first step after a resume): the timing runs with grad on and past the
    segment's saved-tensor hooks, so the recomputation matches and the gradients are the reference's."""
    from conftest import group_of_one
    from model import Config, Llama
    cfg = Config(arch="cola", n_layer=1, n_embd=32, n_head=4, block_size=8, vocab_size=64)
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    grads = {}
    for mode in ("torch", "auto"):
        torch.manual_seed(0)
        model = group_of_one(Llama(cfg), recompute)
        kernel_choice.select("torch", "cpu")   # (forgets earlier choices: every shape is new to auto)
        with local_ops.using(mode):
            model(idx, idx)[1].backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
    kernel_choice.select("torch", "cpu")
    assert "kernels: norm_down" in capsys.readouterr().out   # auto did time inside the segments
    for name, g in grads["torch"].items():
        torch.testing.assert_close(grads["auto"][name], g, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_grouped_expand_reads_each_B_where_it_lies(monkeypatch):
    """The grouped GEMM's Triton launches (forward, its backward's dz, CopyUp's dz half) get the
    parameters B_g themselves, fp32 under bf16 autocast, cast in the kernel's registers: no stacked
    or cast copy of the weights a call (the launches spied on, run as they are); the result equals
    the reference's."""
    import parallel
    import triton_kernels as tk
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 7, 48, generator=g, requires_grad=True)
    Bs = [torch.randn(n, 16, generator=g, requires_grad=True) for n in (40, 24, 24)]
    seen, launch = [], tk.grouped_mm
    monkeypatch.setattr(tk, "grouped_mm", lambda A, ops, C, groups, call: (
        seen.append((call, [o.t.data_ptr() for o in ops])), launch(A, ops, C, groups, call))[1])
    for fn in (lambda: local_ops.grouped_expand(z, Bs), lambda: parallel.CopyUp.apply(z, None, True, *Bs)):
        outs = {}
        for impl in ("triton", "torch"):
            with local_ops.using(impl):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    ys = fn()
                sum(y.float().pow(2).sum() for y in ys).backward()
            outs[impl] = [y.float() for y in ys] + [z.grad.clone()] + [B.grad.clone() for B in Bs]
            z.grad, *_ = None, [setattr(B, "grad", None) for B in Bs]
        for got, want in zip(outs["triton"], outs["torch"]):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert [call for call, _ in seen] == ["expand", "dz", "expand", "dz"], seen
    assert all(ptrs == [B.data_ptr() for B in Bs] for _, ptrs in seen), seen


def test_auto_without_a_measure_is_an_error_not_a_silent_reference(monkeypatch):
    """local_ops.py asks extensions/kernel_choice.py's measure for a shape auto has not met; without one
    installed (kernel_choice.select installs it) auto refuses rather than running the reference."""
    monkeypatch.setattr(local_ops, "measure", None)
    local_ops.select("torch", "cpu")   # (forgets earlier choices)
    with local_ops.using("auto"), pytest.raises(RuntimeError, match="kernel_choice.select"):
        local_ops.rms_norm(torch.randn(4, 8), torch.ones(8), 1e-5)
    kernel_choice.select("torch", "cpu")
    assert local_ops.measure is kernel_choice.measure
