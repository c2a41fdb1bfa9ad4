"""costmodel_fsdp.py: memory per GPU and seconds per iteration of sharded data parallelism on the
paper's cluster: FSDP alone, BTP with plain data parallelism, and BTP with FSDP (`--dp_shard`).

Not in the BOOST paper (arXiv 2512.12131), which leaves ZeRO and FSDP out of scope. Built on
costmodel.py's iteration time (its GEMMs, attention, TP and PP terms, calibrated on the paper's
table) with what sharding adds, at bf16 compute with fp32 master weights and AdamW:

  state      bytes per parameter held by a GPU: DDP 16 (fp32 weight, gradient, two moments);
             `grad` (ZeRO-2) 4 + 12/dp; `full` (ZeRO-3) 16/dp, plus each unit's bf16 weights
             gathered while it computes (the largest layer, 2 bytes a parameter).
  activations recompute=layer: each layer keeps its input, b·s·d/t bf16 (d for FSDP alone), and
             one layer's working set is rebuilt at a time (WORKING · b·s·d/t bytes).
  DP comm    DDP: a ring all-reduce of the bf16 gradients; FSDP: an all-gather of the bf16 weights
             before the forward (and again before the backward under `full`) and a reduce-scatter
             of the gradients, each (dp - 1)/dp of the bytes, over the network; none overlapped,
             as costmodel.py takes the DP all-reduce.

A CoLA model throughout (r = d/4), one global batch of 16 sequences of 4096 tokens an iteration:
FSDP alone runs it at t = 1 with dp = all 16 GPUs (one sequence each); BTP at t = 4 (one node)
with dp = 4 (four sequences a TP group, the paper's micro-batch).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from costmodel import HARDWARE, SHAPES, _table, flops_per_token, iteration_time  # noqa: E402

# one layer's activations while it recomputes, in units of b·s·d/t bf16 values (an estimate)
WORKING = 24
GPU_MEMORY = 80e9     # A100-80GB


def plan(sh, gpus, t, shard, hw=HARDWARE["A100"], batch=16, s=4096):
    """(GB per GPU, seconds per iteration, the DP seconds in it) of one plan on `gpus` GPUs, the
    global batch of `batch` sequences shared by the dp replicas (b = batch / dp each)."""
    dp = gpus // t
    b = batch // dp
    params = flops_per_token(sh, "btp", 0) / 6 / t  # this GPU's parameters before dp sharding
    largest = params / sh.n_layer                              # one decoder layer's (roughly)
    state = {"none": 16 * params, "grad": (4 + 12 / dp) * params,
             "full": 16 * params / dp + 2 * largest}[shard]
    tokens, width = b * s, sh.n_embd / t
    activations = (sh.n_layer + WORKING) * tokens * width * 2
    base = iteration_time(sh, "btp", hw, t=t, dp=1, b=b, s=s)["total"]   # compute, TP; no DP yet
    ring = (dp - 1) / dp if dp > 1 else 0.0
    weights = params * 2 / hw.network                          # bf16 bytes of this GPU's parameters
    dp_time = {"none": 2 * ring * weights, "grad": 2 * ring * weights,
               "full": 3 * ring * weights}[shard]
    return (state + activations) / 1e9, base + dp_time, dp_time


PLANS = [("FSDP alone (t=1, full)", 1, "full"), ("BTP + DP (t=4, none)", 4, "none"),
         ("BTP + FSDP (t=4, grad)", 4, "grad"), ("BTP + FSDP (t=4, full)", 4, "full")]


def report(gpus=16):
    """A table per model size: each plan's memory per GPU (fits in 80 GB or not) and its time."""
    rows, out = [], {}
    for name, sh in SHAPES.items():
        for label, t, shard in PLANS:
            gb, sec, dp_s = plan(sh, gpus, t, shard)
            out[f"{name} {label}"] = {"gb": gb, "s": sec, "dp_s": dp_s}
            rows.append([name, label, f"{gb:.1f}"
                         + ("" if gb * 1e9 <= GPU_MEMORY else " (does not fit)"),
                         f"{sec:.2f}", f"{dp_s:.2f}"])
    text = (f"CoLA models (r = d/4) on {gpus} A100-80GB (4 a node, NVLink within, Slingshot "
            "between), 16 sequences of 4096 tokens an iteration, recompute=layer\n\n"
            + _table(["model", "plan", "GB per GPU", "s/iteration", "of which DP comm"], rows))
    return text, out


if __name__ == "__main__":
    print(report()[0])
