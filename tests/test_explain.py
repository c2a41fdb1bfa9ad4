"""test_explain.py: `--explain` (plumbing/explain.py) and `--profile` (rundir.profiler): what they print and
write is what a real step does: the collectives of a training step's ledger and of the formulas in
layouts.py's docstring (layouts.per_layer_traffic), the saved bytes of the tests' meter.
"""
import json
import re

import pytest
import torch

from plumbing.recorder import SavedBytes
from extensions import muon
import layouts
from layouts import per_layer_traffic
from model import Llama
from plumbing import options
from conftest import TINY, expect_error, group_of_one, metrics, torchrun

CASES = [("cola", "btp"), ("svd", "vanilla"), ("full", "megatron")]


def parse(out):
    """(tokens per rank, {(group, op, phase): (calls, elements)}, saved bytes, per-section collectives,
    {layout: (fwd, bwd) elements per token per layer} of the side-by-side table)."""
    b, s = map(int, re.search(r"b=(\d+) sequences of s=(\d+) tokens", out).groups())
    rank0 = out.split("this step's totals, rank 0:")[1]
    totals = {(g, op, ph): (int(c), int(e.replace(",", ""))) for g, op, ph, c, e in
              re.findall(r"^  (\w+) +(\w+) (\w+): (\d+) calls, ([\d,]+) elements", rank0, re.M)}
    saved = int(re.search(r"saved for backward: ([\d,]+) bytes", rank0).group(1).replace(",", ""))
    sections, current = {}, None
    for line in out.split("rank 0 (")[1].split("\nrank ")[0].split("this step's totals")[0].splitlines():
        if re.match(r"^  \S", line):
            current = line.strip()
            sections.setdefault(current, [])
        elif current and re.match(r"^    all_reduce +tp:", line) and not current.startswith("optim"):
            sections[current].append(int(re.search(r"= ([\d,]+) elements", line).group(1).replace(",", "")))
    table = {m[0]: (float(m[2].replace(",", "")), float(m[3].replace(",", "")))
             for m in re.findall(r"^  (btp|vanilla|megatron) +(\w+) +([\d,.]+) +([\d,.]+)", out, re.M)}
    return b * s, totals, saved, sections, table


def explain(nproc, tmp_path, *args):
    res = torchrun(nproc, f"--out_dir={tmp_path / 'out'}", *TINY, "--explain=true", *args)
    assert not (tmp_path / "out").exists(), "explain writes nothing"
    return res.stdout


@pytest.mark.parametrize("recompute", ["none", "lowrank"])
def test_explain_one_device(tmp_path, recompute):
    out = explain(1, tmp_path, f"--recompute={recompute}")
    tokens, totals, saved, sections, _ = parse(out)
    assert totals == {} and "no collectives" in out
    assert "fwd · layer 0" in out and "bwd · layer 1" in out and "attention" in out and "GEMM" in out
    assert "fwd · layers 0..1: the same" in out
    assert ("recompute · layer" in out) == (recompute == "lowrank")
    # TINY's b = heads = 4: attention's tensors, live and kept, are named by position, not value
    keeps = re.search(r"what layer 0 keeps.*", out).group(0)
    assert ("(b, heads, s, hd)" in keeps) == ("(b, kv_heads, s, hd)" in keeps) == (recompute == "none")
    assert "(b, b" not in out
    assert re.search(r"attention +q \(b, heads, s, hd\), k and v \(b, kv_heads, s, hd\) \(back", out)
    cfg, _ = options.parse_args([*TINY, f"--recompute={recompute}"])
    cfg.vocab_size = options.vocab_size("bytes")
    torch.manual_seed(0)
    model = group_of_one(Llama(cfg), recompute)
    x = torch.randint(0, cfg.vocab_size, (2, tokens // 2))
    with SavedBytes(model) as meter:
        model(x, x)[1].backward()
    assert saved == meter.bytes


@pytest.mark.slow
@pytest.mark.parametrize("arch, layout", CASES)
def test_explain_tp2_equals_training_step_and_formulas(tmp_path, data_dir, arch, layout):
    """The step's collectives per layer equal layouts.py's formulas, and with --optimizer=muon the
    optimizer step's (phase optim) extensions/muon.py's; the TP bytes per token those of a training step."""
    out = explain(2, tmp_path, f"--arch={arch}", "--tp=2", f"--layout={layout}", "--optimizer=muon")
    tokens, totals, saved, sections, table = parse(out)
    cfg, _ = options.parse_args([*TINY, f"--arch={arch}"])
    fwd, bwd, _ = per_layer_traffic(layout, cfg)
    optim = sum(e for (g, _, phase), (_, e) in totals.items() if (g, phase) == ("tp", "optim"))
    assert optim == cfg.n_layer * muon.per_layer_traffic(layout, cfg, 2, "gather") > 0   # (auto here: gather) and "optim · optimizer step" in out
    # the first layer of each direction is printed in full (backward starts at the last layer)
    assert sum(sections["fwd · layer 0"]) == fwd * tokens and sum(sections["bwd · layer 1"]) == bwd * tokens
    assert table[layout] == (fwd, bwd)    # the side-by-side table: every layout against its formula
    for other in ("btp", "vanilla", "megatron"):
        other_cfg, _ = options.parse_args([*TINY, f"--arch={'full' if other == 'megatron' else arch if arch != 'full' else 'cola'}"])
        assert table[other] == per_layer_traffic(other, other_cfg)[:2], (other, table)
    assert "rank 1 (dp 0, pp 0, tp 1): the same ops" in out
    listed = re.findall(r"^    (?:all_gather|all_reduce|reduce_scatter) +tp: .*?(?:  \(× \d+\))?$", out, re.M)
    assert listed and all(re.sub(r"  \(× \d+\)$", "", line).endswith("]") and "FSDP" not in line
                          for line in listed), listed
    if layout == "vanilla":
        return   # (the training step's comparison for btp and megatron keeps the suite short)
    # a real training step: the same TP bytes per token on rank 0
    torchrun(2, f"--out_dir={tmp_path / 'train'}", f"--data_dir={data_dir}", *TINY, f"--arch={arch}", "--tp=2",
             f"--layout={layout}", "--max_iters=1", "--eval_interval=100")
    step = metrics(tmp_path / "train")[0]
    explained = sum(e for (g, _, ph), (_, e) in totals.items() if g == "tp" and ph != "optim") * 4   # fp32
    assert explained / tokens == step["tp_bytes"] / (4 * 32), (explained, step["tp_bytes"])


@pytest.mark.parametrize("layout", ["btp", "vanilla", "megatron"])
def test_every_collective_is_labelled_with_its_real_role(layout):
    """An all-gather over tp is TP's (BTP's residual for the head, vanilla's LaX latents), never
    FSDP2's; over dp under --dp_shard it is FSDP2's; vanilla's LaX gradients are named too."""
    import types
    from plumbing import recorder
    from plumbing.notation import Names
    cfg, _ = options.parse_args([*TINY, "--arch=" + ("full" if layout == "megatron" else "cola")])
    rec = types.SimpleNamespace(layout=layout, names=Names(cfg, 2, 4, 32), events=[], pending=[], section="x",
                                phase=lambda: "fwd")
    d, r = cfg.n_embd, cfg.attn_rank
    recorder.Recorder.collective(rec, "all_gather", "tp", "fwd", torch.zeros(128 * (d if layout != "vanilla"
                                                                                     else r)), 128)
    recorder.Recorder.collective(rec, "all_gather", "dp", "grad", torch.zeros(1000), 128)
    recorder.Recorder.collective(rec, "reduce_scatter", "dp", "grad", torch.zeros(1000), 128)
    tp, gather, scatter = (e[3] for e in rec.events)
    want = layouts.LAYOUTS[layout].gathers
    assert "FSDP" not in tp and tp.endswith(f"[{want}]" if want else "elements"), tp
    assert "gathered over dp (FSDP2)" in gather and "cut over dp (FSDP2)" in scatter
    if layout == "vanilla":
        recorder.Recorder.collective(rec, "all_reduce", "tp", "bwd", torch.zeros(128 * r), 128)
        assert rec.events[-1][3].endswith("[gradient of latents gathered for LaX's crossing]"), rec.events[-1]


@pytest.mark.slow
@pytest.mark.parametrize("arch, layout", [("cola", "btp")])   # the baselines: at TP 2 above
def test_explain_pp2_tp2(tmp_path, arch, layout):
    out = explain(4, tmp_path, f"--arch={arch}", "--tp=2", f"--layout={layout}", "--pp=2",
                  "--gradient_accumulation_steps=2")
    tokens, totals, saved, sections, table = parse(out)
    cfg, _ = options.parse_args([*TINY, f"--arch={arch}"])
    fwd, bwd, _ = per_layer_traffic(layout, cfg)
    # rank 0 is stage 0: the embedding and layer 0 of 2; its TP traffic is that one layer's
    assert totals[("tp", "all_reduce", "fwd")][1] == fwd * tokens
    assert totals[("tp", "all_reduce", "bwd")][1] == bwd * tokens
    d_local = cfg.n_embd // 2 if layout == "btp" else cfg.n_embd
    assert totals[("pp", "send", "fwd")] == (1, tokens * d_local)   # the residual stream to stage 1
    assert "rank 2 (dp 0, pp 1, tp 0), where it differs from rank 0:" in out and "bwd · head" in out


@pytest.mark.slow
def test_explain_with_dp_counts_the_gradient_all_reduce_or_fsdps_collectives(tmp_path):
    """dp=2 with DDP: one all-reduce of every gradient; with --dp_shard=full (FSDP2): each unit
    (a layer, the root) all-gathered for forward and for backward and reduce-scattered once, as the
    run sent them; the same ops and saved bytes either way (low-rank segments through FSDP too)."""
    cfg, _ = options.parse_args(TINY)
    cfg.vocab_size = options.vocab_size("bytes")
    n = Llama(cfg).num_params()
    args = ["--gradient_accumulation_steps=2", "--arch=cola", "--recompute=lowrank"]
    ddp, fsdp = explain(2, tmp_path / "ddp", *args), explain(2, tmp_path / "fsdp", *args, "--dp_shard=full")
    (_, ddp_totals, ddp_saved, _, _), (_, totals, saved, _, _) = parse(ddp), parse(fsdp)
    assert ddp_totals[("dp", "all_reduce", "grad")] == (1, n)
    units = cfg.n_layer + 1
    assert {k: v for k, v in totals.items() if k[0] == "dp"} == {
        ("dp", "all_gather", "fwd"): (units, n), ("dp", "all_gather", "bwd"): (units, n),
        ("dp", "reduce_scatter", "grad"): (units, n)}
    assert saved == ddp_saved
    flops = lambda out: re.search(r"FLOPs on this rank: ([\d,]+)", out).group(1)
    assert flops(fsdp) == flops(ddp)
    ops = lambda out: {line for line in out.split("this step's totals")[0].splitlines()[1:]   # (the layers
                       if line.startswith("    ") and " dp: " not in line}   # differ in where FSDP gathers)
    assert ops(fsdp) == ops(ddp) and any("A_qkv" in line for line in ops(fsdp))   # (btp at tp=1)


@pytest.mark.slow
def test_profile_writes_a_trace_per_rank(tmp_path, data_dir):
    res = torchrun(2, f"--out_dir={tmp_path}", f"--data_dir={data_dir}", *TINY, "--tp=2", "--max_iters=4",
                   "--eval_interval=100", "--profile=1:2")
    assert "profile: wrote" in res.stdout and "ui.perfetto.dev" in res.stdout
    for rank in (0, 1):
        trace = json.loads((tmp_path / "trace" / f"rank{rank}.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any(n.startswith("all_reduce tp fwd ") for n in names), sorted(names)[:50]
        assert any(n.startswith("wait all_reduce tp bwd ") for n in names)       # --overlap's async waits
        assert any(n.startswith("btp layer 0: attn_chunk") for n in names)
        assert any("Optimizer.step" in n for n in names)


@pytest.mark.parametrize("argv, fragment", [
    (["--profile=3"], "is not W:A"), (["--profile=a:b"], "is not W:A"), (["--profile=1:0"], "is not W:A"),
    (["--profile=5:5", "--max_iters=8"], "past max_iters=8"),
    (["--profile=1:1", "--explain=true"], "nothing for profile to trace"), (["--explain=maybe"], "true or false")])
def test_bad_explain_and_profile(capsys, tmp_path, argv, fragment):
    expect_error(capsys, [f"--out_dir={tmp_path}", *TINY, *argv], fragment)


@pytest.mark.slow
def test_explain_lax_btp_sends_what_cola_sends(tmp_path):
    """LaX under btp crosses the all-reduced latents locally: its traffic is CoLA's, element for
    element; vanilla's side-by-side row shows its all-gathered latents."""
    out = explain(2, tmp_path, "--lax=true", "--tp=2")
    tokens, totals, saved, sections, table = parse(out)
    lax_cfg, _ = options.parse_args([*TINY, "--lax=true"])
    cola_cfg, _ = options.parse_args(TINY)
    fwd, bwd, calls = per_layer_traffic("btp", lax_cfg)
    assert (fwd, bwd, calls) == per_layer_traffic("btp", cola_cfg)
    assert table["btp"] == (fwd, bwd) and sum(sections["bwd · layer 1"]) == bwd * tokens
    latents = 4 * lax_cfg.attn_rank + 3 * lax_cfg.mlp_rank
    vanilla = per_layer_traffic("vanilla", cola_cfg)
    assert table["vanilla"] == (vanilla[0] + latents, vanilla[1] + latents), table
    assert "LaX: layer 1, which crosses, minus layer 0" in out
