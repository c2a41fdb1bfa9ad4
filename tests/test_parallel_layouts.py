"""test_parallel_layouts.py: the three TP layouts against the single-device model: logits, loss and every
gradient at TP 2 (both --overlap settings, the bench's ablations), TP 4 and dp x tp 2 x 2; train.py's TP
runs equal to one process; torch.compile and bf16 autocast under TP; a layout added in one file (the
walkthrough's question 12) read by everything that reads layouts.
"""
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import layouts
import local_ops
from tp_model import TPLlama
import parallel
import sharding
from model import Llama
from extensions import muon
from plumbing import placement
from plumbing.options import parse_args
from ablations import ablated
from conftest import TINY, TP_CASES, check_tp_step, losses, metrics, run_train, small_cfg, spawn, torchrun


def _equivalence_worker(rank, world, meshes):
    for dp, tp in meshes:
        mesh = placement.init_mesh(dp, tp, "cpu", 120)
        plain, overlap = (parallel.TPGroup(mesh.get_group("tp"), mesh.get_local_rank("tp"), tp, o) for o in (False, True))
        dp_rank = mesh.get_local_rank("dp")
        ablations = [("cola", "btp", {"online_norm": False}, {}), ("svd", "btp", {"grouped": False}, {})]  # tools/ablations.py
        variants = [(a, lay, {}, {"tie_embeddings": True, "mlp_gate": "silu" if a == "cola" else "none"})
                    for a, lay in TP_CASES]   # the reference configs' options: tied head, the other gate
        # both settings of --overlap at TP 2 (where the ablations run plain too); the default at TP 4 and dp x tp
        handles = (plain, overlap) if (dp, tp) == (1, 2) else (overlap,)
        cases = [(a, lay, {}, {}, tp_handle) for a, lay in TP_CASES for tp_handle in handles] + \
            [(*case, plain) for case in ablations if plain in handles] + [(*case, overlap) for case in ablations + variants]
        for arch, layout, options, extra, tp_handle in cases:
            where = f"{arch}/{layout} {options} {extra} overlap={tp_handle.overlap} dp={dp} tp={tp}"
            cfg = small_cfg(arch, **extra)
            torch.manual_seed(0)
            ref = Llama(cfg)
            idx = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
            tgt = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(2))
            logits, loss = ref(idx, tgt)
            loss.backward()
            tp_model = TPLlama(ref, tp_handle, layout, block=ablated(**options) if options else None)
            model = DDP(tp_model, process_group=mesh.get_group("dp")) if dp > 1 else tp_model
            share = slice(dp_rank * 4 // dp, (dp_rank + 1) * 4 // dp)
            tp_logits, tp_loss = model(idx[share], tgt[share])
            tp_loss.backward()
            sharding.reduce_tied_grad(tp_model)
            check_tp_step(ref, logits, loss, tp_model, tp_logits, tp_loss, tp_handle, mesh.get_group("dp"), share, where)
            full = tp_model.full_tensors()
            for name, p in ref.named_parameters():
                assert torch.equal(full[name], p.detach()), f"{where}: {name} does not unshard exactly"
        dist.barrier()


def test_tp2_equals_single_device():
    spawn(2, _equivalence_worker, [(1, 2)])


@pytest.mark.slow
def test_tp4_and_dp2_tp2_equal_single_device():
    spawn(4, _equivalence_worker, [(1, 4), (2, 2)])


@pytest.mark.slow
@pytest.mark.parametrize("arch, layout, nproc, dp, recompute, dtype, overlap", [
    ("cola", "btp", 2, 1, "none", "float32", "true"),   # overlap=false: the vanilla run, and in-process above
    ("svd", "vanilla", 2, 1, "none", "float32", "false"), ("full", "megatron", 2, 1, "layer", "float32", "true"),
    ("cola", "btp", 4, 2, "lowrank", "float32", "true"), ("cola", "btp", 2, 1, "none", "bfloat16", "true")])
def test_tp_training_reproduces_single_device(tmp_path, data_dir, arch, layout, nproc, dp, recompute, dtype, overlap):
    common = [f"--data_dir={data_dir}", *TINY, "--max_iters=5", "--eval_interval=100", f"--arch={arch}",
              "--gradient_accumulation_steps=2", "--batch_size=2", f"--recompute={recompute}", f"--dtype={dtype}",
              f"--overlap={overlap}"]
    single = losses(run_train(tmp_path / "one", data_dir, *common[1:]))
    torchrun(nproc, f"--out_dir={tmp_path / 'tp'}", *common, "--tp=2", f"--layout={layout}", f"--dp={dp}")
    records = metrics(tmp_path / "tp")
    assert len(single) == 5 and all(r["tp_bytes"] > 0 for r in records if "loss" in r)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=1e-3, atol=1e-3)  # bf16 autocast
    torch.testing.assert_close(torch.tensor(losses(records)), torch.tensor(single), **tol)


# ---------------------------------------------------------------------------- torch.compile under TP

def _compile_worker(rank, world):
    from torch._dynamo.utils import counters
    tp = parallel.TPGroup(dist.group.WORLD, rank, world, overlap=True)
    parallel.LEDGER.name(dist.group.WORLD, "tp")
    # every layout through dynamo and AOT autograd, which is where TP breaks graphs, and BTP with the
    # Triton kernels (interpreted): custom ops inside the graph, their backward too. Not inductor: on
    # a CPU it builds C++ (a minute of a cold machine), not the Triton a GPU compiles; gpu_check's
    # compiled runs hold inductor on a GPU to eager (tools/gpu_check_train.py)
    for arch, layout, impl in (("cola", "btp", "torch"), ("svd", "vanilla", "torch"),
                               ("full", "megatron", "torch"), ("cola", "btp", "triton")):
        local_ops.select(impl, "cpu")
        torch.manual_seed(0)
        ref = Llama(small_cfg(arch, n_layer=1))
        idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        results = []
        for compiled in (False, True):
            model = TPLlama(ref, tp, layout)
            run = torch.compile(model, backend="aot_eager") if compiled else model
            counters.clear()
            parallel.LEDGER.reset()
            for _ in range(2):   # the second step runs the compiled graphs as they are
                loss = run(idx, idx)[1]
                loss.backward()
            results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()},
                            dict(parallel.LEDGER.counts)))
            if compiled:
                assert counters["stats"]["unique_graphs"] >= 1, f"{layout}: nothing was compiled"
        (eager_loss, eager_grads, eager_counts), (loss, grads, counts) = results
        torch.testing.assert_close(loss, eager_loss, msg=lambda m: f"{layout} loss: {m}")
        for name, g in grads.items():
            torch.testing.assert_close(g, eager_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{layout} {name}: {m}")
        assert counts == eager_counts, layout   # the same collectives, each recorded once


@pytest.mark.slow
def test_torch_compile_under_tp2_equals_eager():
    spawn(2, _compile_worker, timeout=600)


# ---------------------------------------------------------------------------- bf16 autocast under TP

# bf16 keeps 8 bits of mantissa, and under TP every all-reduce sums bf16 partials: the loss within 1e-4
# (measured: at most 4e-5), every gradient within 6% in norm (measured: at most 3.9%), against one
# device in bf16 and against fp32 alike
BF16_LOSS, BF16_GRAD = dict(rtol=1e-4, atol=0.0), 6e-2


def _bf16_worker(rank, world):
    tp = parallel.TPGroup(dist.group.WORLD, rank, world, overlap=True)
    for arch, layout in TP_CASES:
        torch.manual_seed(0)
        ref = Llama(small_cfg(arch))
        idx = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
        runs = {}
        for name, model in (("fp32", ref), ("bf16", ref), ("tp bf16", TPLlama(ref, tp, layout))):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name != "fp32"):
                loss = model(idx, idx)[1]
            loss.backward()
            grads = model.full_tensors(grads=True) if name.startswith("tp") else \
                {n: p.grad.clone() for n, p in model.named_parameters()}
            runs[name] = (loss.detach().float(), grads)
        for other in ("bf16", "fp32"):
            where = f"{arch}/{layout} tp bf16 vs {other}"
            torch.testing.assert_close(runs["tp bf16"][0], runs[other][0], **BF16_LOSS, msg=lambda m: f"{where} loss: {m}")
            for n, g in runs["tp bf16"][1].items():
                ref_g = runs[other][1][n]
                # gradients as a whole: their relative error in norm (single elements of a bf16 sum vary more)
                err = (g.float() - ref_g.float()).norm() / ref_g.float().norm()
                assert err < BF16_GRAD, f"{where} grad of {n}: relative error {err:.3g}"


def test_bf16_every_layout_tp2_equals_one_device():
    spawn(2, _bf16_worker)


# ------------------------------------------- a layout added in one file (walkthrough, question 12)

def unnormed_traffic(cfg):
    """BTP's volumes with the norm statistic all-reduced on its own, before each down-projection
    (tools/ablations.py): the same elements forward, one more a norm backward (the all-reduce of the
    statistic's gradient: every rank uses the sum), and two more collectives a norm."""
    fwd, bwd, calls = layouts.btp_traffic(cfg)
    return layouts.Traffic(fwd, bwd + 2, calls + 4)


# the whole of the new layout: a layer class and a record; a fork writes the record in layouts.py
UNNORMED = dataclasses.replace(layouts.LAYOUTS["btp"], name="btp_unnormed",
                               block=ablated(online_norm=False), traffic=unnormed_traffic)


def _added_layout_worker(rank, world):
    layouts.LAYOUTS[UNNORMED.name] = UNNORMED
    tp = parallel.TPGroup(dist.group.WORLD, rank, world, overlap=True)
    parallel.LEDGER.name(dist.group.WORLD, "tp")
    torch.manual_seed(0)
    ref = Llama(small_cfg("cola"))
    idx = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    logits, loss = ref(idx, idx)
    loss.backward()
    model = TPLlama(ref, tp, UNNORMED.name)
    tp_logits, tp_loss = model(idx, idx)
    tp_loss.backward()
    check_tp_step(ref, logits, loss, model, tp_logits, tp_loss, tp, dist.new_group([rank]), slice(None),
                  UNNORMED.name)
    counts = {}
    for n_layer in (1, 2):   # the record's formula is the ledger's count, per layer
        torch.manual_seed(0)
        cfg = small_cfg("cola", n_layer=n_layer)
        parallel.LEDGER.reset()
        TPLlama(Llama(cfg), tp, UNNORMED.name)(idx, idx)[1].backward()
        counts[n_layer] = [parallel.LEDGER.total("tp", "fwd"), parallel.LEDGER.total("tp", "bwd"),
                           parallel.LEDGER.total("tp", unit="calls")]
    per_layer = [two - one for one, two in zip(counts[1], counts[2])]
    fwd, bwd, calls = layouts.per_layer_traffic(UNNORMED.name, cfg)
    assert per_layer == [fwd * idx.numel(), bwd * idx.numel(), calls], per_layer


def test_a_layout_added_in_one_file_equals_single_device_and_its_formula():
    spawn(2, _added_layout_worker)


def test_a_layout_added_in_one_file_is_an_option_and_cut_as_its_record_says(monkeypatch):
    """Registered, the new layout is an option value, refuses the dense model by its record, and
    Muon prices its factors by the record's cut (BTP's here)."""
    monkeypatch.setitem(layouts.LAYOUTS, UNNORMED.name, UNNORMED)
    cfg, tc = parse_args([*TINY, f"--layout={UNNORMED.name}"])[:2]
    assert tc.layout == UNNORMED.name
    layouts.check_divisible(cfg, 2, UNNORMED.name)
    dense = parse_args([*TINY, "--arch=full"])[0]
    with pytest.raises(ValueError, match="layout=btp_unnormed cuts bottleneck models; arch=full uses megatron"):
        layouts.check_divisible(dense, 2, UNNORMED.name)
    for mode in ("gram", "gather", "owner"):
        assert muon.per_layer_traffic(UNNORMED.name, cfg, 2, mode) == muon.per_layer_traffic("btp", cfg, 2, mode)
