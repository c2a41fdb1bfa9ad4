"""bench_gpu.py: `python tools/bench.py gpu`: the first measurements on one GPU, in one command (<
5 minutes).

BOOST (arXiv 2512.12131) §3-4 and §7. Two tables, each row printed and appended to a JSON Lines
file as it is measured (a run cut short keeps its rows), then written to <json_dir>/bench-gpu.json:

1. The kernels of local_ops at the TP=4 slices of BOOST's 1B and 7B shapes (configs/boost_1b.toml,
   boost_7b.toml; M = 4·4096 tokens), Triton against the PyTorch reference (cuBLAS), forward and
   backward apart: ms of each and their ratio (torch/Triton: 1.0 = as fast as cuBLAS; the goal is
   at least 0.9).
2. One training step (forward, backward, AdamW; bf16 autocast) of the 1B-shaped cola, full and svd
   models (and cola with CoLA-1B's d_ff of 5461, as it is and with --mlp_multiple_of=8) on one
   GPU (`--n_layer`, default 8 of its 24 layers, keeps torch.compile short), compile off and on:
   ms, the layers' ms (less the head, measured alone: at few layers the 32000-way tied head is
   most of CoLA's matmul weights), tokens/s, MFU against the measured bf16 matmul peak,
   peak memory (reset before each row).

Nothing here runs without CUDA; tests check the shapes and the plumbing on the CPU with tiny shapes.
"""
import json
import sys
import time
from pathlib import Path

import torch

# the core files live at the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOKENS = 4 * 4096
TP = 4


def shapes():
    """{name: Config} of the two BOOST shapes this bench slices."""
    from plumbing import options
    return {name: options.parse_args([f"configs/boost_{name}.toml"])[0] for name in ("1b", "7b")}


def kernel_cases(cfg, tp=TP, tokens=TOKENS):
    """(op, inputs as shapes, FLOPs of the forward) of one TP rank's local ops for this shape."""
    d, r, rm, f = cfg.n_embd // tp, cfg.attn_rank, cfg.mlp_rank, cfg.mlp_width // tp
    kv = cfg.kv_dim // tp
    return [("norm_down q,k,v", "norm_down", [(tokens, d), (d,), (3 * r, d)],
             2 * tokens * 3 * r * d),
            ("norm_down gate,up", "norm_down", [(tokens, d), (d,), (2 * rm, d)],
             2 * tokens * 2 * rm * d),
            ("grouped_expand q,k,v", "grouped_expand", [(tokens, 3 * r), (d, r), (kv, r), (kv, r)],
             2 * tokens * r * (d + 2 * kv)),
            ("grouped_expand gate,up", "grouped_expand", [(tokens, 2 * rm), (f, rm), (f, rm)],
             2 * tokens * rm * 2 * f),
            ("rms_norm (final)", "rms_norm", [(tokens, cfg.n_embd), (cfg.n_embd,)], 0)]


def timed(fn, device, runs=10):
    """Median ms of fn() over `runs` after a warm-up (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(runs):
        if str(device).startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2]


def measure_op(op, input_shapes, flops, impl, device, dtype, runs=10):
    """{fwd_ms, fwd_bwd_ms, tflops or gbs, vs_matmul} of one op under one implementation."""
    import local_ops
    g = torch.Generator(device="cpu").manual_seed(0)
    inputs = [torch.randn(s, generator=g).to(device, dtype).requires_grad_() for s in input_shapes]
    fn = {"norm_down": lambda x, gm, A: local_ops.norm_down(x, gm, A),
          "grouped_expand": lambda z, *Bs: local_ops.grouped_expand(z, list(Bs)),
          "rms_norm": lambda x, gm: [local_ops.rms_norm(x, gm, 1e-6)]}[op]

    def both():
        outs = [o for o in fn(*inputs) if o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    with local_ops.using(impl):
        fwd = timed(lambda: fn(*inputs), device, runs)
        fwd_bwd = timed(both, device, runs)
    out = {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd}
    if flops:
        out["tflops_fwd"] = flops / fwd / 1e9
        m = int(round((flops / 2) ** (1 / 3)))   # a square matmul of the same FLOPs
        a, b = (torch.randn(m, m, device=device, dtype=dtype) for _ in range(2))
        out["vs_matmul"] = timed(lambda: a @ b, device, runs) / fwd
    else:
        moved = 2 * inputs[0].numel() * inputs[0].element_size()   # read x, write y
        out["gbs_fwd"] = moved / fwd / 1e6
    return out


def matmul_peak(device, dtype=torch.bfloat16, n=8192):
    """Measured TFLOP/s of a large square matmul: the MFU denominator."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n ** 3 / timed(lambda: a @ b, device) / 1e9


MODES = ("eager", "compiled", "captured")   # captured: --cuda_graph's one graph a step


def train_step(cfg, device, mode, batch=1, runs=5, graph=None):
    """{tokens_per_s, ms, peak_gb, estimate_gb} of one training step of Llama(cfg) on one GPU,
    eager, compiled (torch.compile) or captured (extensions/cuda_graph.py, as --cuda_graph runs
    it; `graph`: its stand-in on a CPU); estimate_gb: placement.footprint's for this step."""
    from extensions import cuda_graph
    from plumbing import options, placement
    from plumbing.plan import Plan
    # built as train.py builds it: the BTP layer with a TP group of one
    tc = options.TrainConfig(seed=0, batch_size=batch)
    layout = "btp" if cfg.lowrank else "megatron"
    plan = Plan(cfg, tc, 1, 1, layout, str(device), "bfloat16")
    place = placement.Placement(1, 1, str(device))
    model, n_params, _ = placement.build_model(plan, place)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    net = torch.compile(model) if mode == "compiled" else model
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), device=device)

    def body(batches, at=0):
        (x, y), = batches
        with torch.autocast(str(device).split(":")[0], dtype=torch.bfloat16):
            loss = net(x, y)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    if mode == "captured":
        captured = cuda_graph.Captured(body, opt, str(device), graph)
        step = lambda: captured.step([(idx, idx)], 0)   # noqa: E731
    else:
        step = lambda: body([(idx, idx)])   # noqa: E731
    for _ in range(cuda_graph.WARMUP + 1 if mode == "captured" else 2):   # (warm, compile, capture)
        step()
    if str(device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    ms = timed(step, device, runs)
    peak = torch.cuda.max_memory_allocated() / 1e9 if str(device).startswith("cuda") else 0.0
    estimate = sum(placement.footprint(cfg, tc, n_params, plan, "bfloat16")[0].values()) / 1e9
    return {"ms": ms, "tokens_per_s": batch * cfg.block_size / ms * 1000, "peak_gb": peak,
            "estimate_gb": estimate}


def head_ms(cfg, device, tokens, runs=5):
    """ms of the head alone as the model computes it (tp_model.TPLlama at a TP group of one): the
    final RMSNorm (local_ops), the (V, d) matmul, the chunked vocabulary-parallel cross-entropy;
    forward and backward, bf16 autocast, at this many tokens: what the step rows take out to give
    the layers' time."""
    import local_ops
    from parallel import VocabParallelCrossEntropy
    x = torch.randn(tokens, cfg.n_embd, device=device, requires_grad=True)
    w = torch.randn(cfg.vocab_size, cfg.n_embd, device=device, requires_grad=True)
    gain = torch.ones(cfg.n_embd, device=device, requires_grad=True)
    y = torch.randint(0, cfg.vocab_size, (tokens,), device=device)

    def step():
        with torch.autocast(str(device).split(":")[0], dtype=torch.bfloat16):
            h = local_ops.rms_norm(x, gain, cfg.norm_eps)             # (N, d)
            loss = VocabParallelCrossEntropy.apply(h @ w.t(), y, None).mean()
        loss.backward()
    return timed(step, device, runs)


# the vendors' dense bf16 peaks, TFLOP/s (no sparsity): MFU's nominal denominator, beside the
# measured matmul's (H100 SXM: the measured one is about 1.25x lower)
NOMINAL = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def nominal_peak(name):
    return next((v for k, v in NOMINAL.items() if k in name), None)


def dynamo_counts():
    """torch.compile's graphs, graph breaks and recompiles so far (torch._dynamo's counters)."""
    from torch._dynamo.utils import counters
    return {"graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values()),
            "recompiles": counters["recompiles"].get("total", 0) if "recompiles" in counters
            else 0}


def fresh_peak(device):
    """Free what earlier rows left and start the peak from here."""
    import gc
    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# what a row may take on a cold cache, seconds (estimates for one H100/H200: CUDA and Triton warm
# from the earlier steps, a compiled row inductor's cold compile of a few layers): a row that would
# pass the deadline is skipped with a line instead of being cut off mid-way
ROW_S = {"kernel": 5, "eager": 15, "compiled": 90, "captured": 20}


def fits(kind, deadline, emit, what):
    """True when a row of `kind` fits before the deadline (None: no deadline); else a line."""
    left = float("inf") if deadline is None else deadline - time.time()
    if left >= ROW_S[kind]:
        return True
    emit(f"skipped {what}: {left:.0f} s left of the budget, the row takes up to {ROW_S[kind]} s")
    return False


def kernel_rows(device, dtype, emit, deadline=None):
    """The kernels at the 1B and 7B TP=4 slices, forward and backward apart (backward = forward +
    backward less forward, medians): Triton ms, the PyTorch reference's (cuBLAS) ms, their ratio."""
    emit("| shape | op | fwd Triton ms | fwd torch ms | torch/Triton | bwd Triton ms | "
         "bwd torch ms | torch/Triton |")
    emit("|---|---|---|---|---|---|---|---|")
    for name, cfg in shapes().items():
        for label, op, input_shapes, flops in kernel_cases(cfg):
            if not fits("kernel", deadline, emit, f"{name} {label}"):
                continue
            fresh_peak(device)
            r = {impl: measure_op(op, input_shapes, flops, impl, device, dtype)
                 for impl in ("triton", "torch")}
            for impl in r:
                r[impl]["bwd_ms"] = r[impl]["fwd_bwd_ms"] - r[impl]["fwd_ms"]
            row = {"shape": name, "op": label, **{f"{impl}_{k}": v for impl in r
                                                   for k, v in r[impl].items()}}
            emit(f"| {name} TP={TP} | {label} | {r['triton']['fwd_ms']:.3f} | "
                 f"{r['torch']['fwd_ms']:.3f} | {r['torch']['fwd_ms'] / r['triton']['fwd_ms']:.2f}"
                 f" | {r['triton']['bwd_ms']:.3f} | {r['torch']['bwd_ms']:.3f} | "
                 f"{r['torch']['bwd_ms'] / r['triton']['bwd_ms']:.2f} |", row)


def step_rows(device, n_layer, peak, emit, deadline=None, compiled=("cola", "full", "svd"),
              captured=("cola", "full"), only=None):
    """One training step of the 1B shape at n_layer layers, each arch (CoLA first: the rows that
    matter), eager; compiled for the archs in `compiled` (with dynamo's graph, break and recompile
    counts), captured as one CUDA graph for those in `captured`. The layers' time is the step's
    less the head's (measured alone, as the model computes it). MFU against the measured matmul
    peak and the vendor's nominal one; the peak memory beside placement.footprint's estimate.
    `only`: the variants (arch names) to run, None for all."""
    from model import Llama
    base = shapes()["1b"]
    cfg0 = type(base)(**{**base.shape(), "vocab_size": 32000})
    head = head_ms(cfg0, device, cfg0.block_size)
    name = torch.cuda.get_device_name() if str(device).startswith("cuda") else str(device)
    nominal = nominal_peak(name)
    emit(f"One training step of the 1B shape with {n_layer} layers, 1 × {cfg0.block_size} tokens, "
         f"bf16, one GPU; the head alone (norm, {cfg0.vocab_size}-way matmul, chunked vocab-"
         f"parallel cross-entropy, forward and backward): {head:.1f} ms. MFU denominators: "
         f"measured {peak:.0f} TFLOP/s, nominal {nominal or '?'} TFLOP/s ({name})",
         {"head_ms": head, "nominal_tflops": nominal})
    emit("| arch | mode | ms | layers ms (less the head) | tokens/s | MFU measured | MFU nominal |"
         " peak GB | estimate GB | graphs, breaks, recompiles |")
    emit("|---|---|---|---|---|---|---|---|---|---|")
    # and CoLA-1B's own d_ff, 5461 (configs/cola_1b.toml): misaligned bf16 strides in the MLP's
    # GEMMs, then rounded up to 5464 by --mlp_multiple_of=8 (eager only)
    variants = [(arch, {"arch": arch, "mlp_gate": "auto" if arch != "cola" else base.mlp_gate})
                for arch in ("cola", "full", "svd")]
    variants += [("cola d_ff 5461", {"mlp_width": 5461}),
                 ("cola d_ff 5461, mlp_multiple_of=8", {"mlp_width": 5461, "mlp_multiple_of": 8})]
    for arch, change in [v for v in variants if only is None or v[0] in only]:
        cfg = type(base)(**{**base.shape(), "n_layer": n_layer, "vocab_size": 32000, **change})
        with torch.device("meta"):
            # counted from the matrices
            flops_per_token = Llama(cfg).flops_per_token(cfg.block_size)
        modes = ["eager"] + ["compiled"] * (arch in compiled) + ["captured"] * (arch in captured)
        for mode in modes:
            if not fits(mode, deadline, emit, f"{arch} {mode} step"):
                continue
            fresh_peak(device)
            r = train_step(cfg, device, mode)
            r["mfu"] = flops_per_token * r["tokens_per_s"] / (peak * 1e12)
            r["mfu_nominal"] = flops_per_token * r["tokens_per_s"] / (nominal * 1e12) \
                if nominal else None
            r["layers_ms"] = r["ms"] - head
            dyn = dynamo_counts() if mode == "compiled" else None
            emit(f"| {arch} | {mode} | {r['ms']:.1f} | {r['layers_ms']:.1f} | "
                 f"{r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | "
                 + (f"{100 * r['mfu_nominal']:.1f}%" if nominal else "?")
                 + f" | {r['peak_gb']:.1f} | {r['estimate_gb']:.1f} | "
                 + (", ".join(str(v) for v in dyn.values()) if dyn else "-") + " |",
                 {"arch": arch, "mode": mode, **r, **({"dynamo": dyn} if dyn else {})})


def run(device="cuda", n_layer=8, json_path=None, log=print, rows_path=None, deadline=None,
        compiled=("cola", "full", "svd"), steps_first=False):
    """Both tables, each row printed (log) and appended to rows_path (JSON Lines) as it is
    measured, so that a run stopped by a timeout keeps its rows; returns (markdown, results).
    With a deadline (time.time()'s), each row starts only where it fits (ROW_S). gpu_check's order
    (steps_first): CoLA's and the dense model's steps (eager, compiled, captured), then the
    kernels, then the svd and d_ff 5461 rows (eager), the ones that teach least."""
    from extensions import kernel_choice
    kernel_choice.select("auto", device)
    out = {"device": torch.cuda.get_device_name() if str(device).startswith("cuda")
           else str(device),
           "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "rows": [],
           "lines": []}
    lines = out["lines"]

    def emit(line, row=None):
        lines.append(line)
        log(line)
        if row is not None:
            out["rows"].append(row)
            if rows_path:
                with open(rows_path, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
    out["matmul_peak_tflops"] = peak = matmul_peak(device)
    emit(f"{out['device']}, {out['date']}, torch {torch.__version__}; bf16 matmul peak "
         f"measured: {peak:.0f} TFLOP/s", {"matmul_peak_tflops": peak})
    kernels = lambda: kernel_rows(device, torch.bfloat16, emit, deadline)   # noqa: E731
    steps = lambda only=None: step_rows(device, n_layer, peak, emit, deadline,  # noqa: E731
                                        compiled, only=only)
    tables = [kernels, steps]
    if steps_first:
        first = ("cola", "full")
        tables = [lambda: steps(first), kernels,
                  lambda: steps(("svd", "cola d_ff 5461", "cola d_ff 5461, mlp_multiple_of=8"))]
    for table in tables:
        table()
        emit("")
    text = "\n".join(lines)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(out, fh, indent=1)
    return text, out


def from_cli(extra, json_dir):
    """`bench.py gpu [--n_layer=N]`'s results, its rows appended to json_dir as they come; one
    line and exit status 2 without CUDA."""
    if not torch.cuda.is_available():
        print("error: bench.py gpu needs a CUDA GPU (this machine has none)", file=sys.stderr)
        sys.exit(2)
    n_layer = next((int(a.split("=", 1)[1]) for a in extra if a.startswith("--n_layer=")), 8)
    json_dir.mkdir(parents=True, exist_ok=True)
    return run("cuda", n_layer, log=print, rows_path=json_dir / "bench-gpu-rows.jsonl")[1]
