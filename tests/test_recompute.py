"""test_recompute.py: activation checkpointing (section 5): equal gradients for every mode, saved bytes
equal to recompute.py's formulas, no collective replayed by low-rank recompute under BTP, the
recompute FLOPs.
"""

import pytest
import torch
import torch.distributed as dist

from recompute import RECOMPUTE
from tp_model import TPLlama
import parallel
from model import Config, Llama
from conftest import group_of_one, small_cfg, spawn
from plumbing.recorder import SavedBytes


def lowrank_saved_per_token(layout, cfg, t, e=4):
    """recompute.py's docstring formula: bytes saved per token per layer with recompute=lowrank."""
    ra, rm, d = cfg.attn_rank, cfg.mlp_rank, cfg.n_embd
    lat = (4 * ra + 3 * rm) * e if cfg.lax else 0   # LaX: the previous layer's latents, whole
    return lat + {"btp": (4 * ra + 3 * rm + 2 + 2 * d // t) * e,
                  "vanilla": (4 * ra // t + 3 * rm // t + 2 * d) * e}[layout]


def run_recompute(make_model, recompute, idx, n_layer):
    """(loss, {name: grad}, saved bytes, ledger counts of the backward) for one forward/backward."""
    model = make_model(n_layer)
    model.recompute = recompute
    with SavedBytes(model) as meter:
        loss = model(idx, idx)[1]
    parallel.LEDGER.reset()
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}, meter.bytes, dict(parallel.LEDGER.counts)


def check_recompute(make_model, layout, cfg, t, idx):
    ref = run_recompute(make_model, "none", idx, 2)
    for mode in ("layer", "lowrank"):
        loss, grads, _, _ = run_recompute(make_model, mode, idx, 2)
        torch.testing.assert_close(loss, ref[0])
        for name, g in grads.items():
            torch.testing.assert_close(g, ref[1][name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{mode} {name}: {m}")
    tokens = idx.numel()
    saved = {mode: [run_recompute(make_model, mode, idx, n)[2] for n in (2, 4)] for mode in RECOMPUTE}
    per_layer = {mode: (v[1] - v[0]) / 2 / tokens for mode, v in saved.items()}
    assert per_layer["lowrank"] == lowrank_saved_per_token(layout, cfg, t), (layout, per_layer)
    lat = (4 * cfg.attn_rank + 3 * cfg.mlp_rank) if cfg.lax else 0
    assert per_layer["layer"] == (lat + (cfg.n_embd // t if layout == "btp" else cfg.n_embd)) * 4, (layout, per_layer)
    assert per_layer["layer"] < per_layer["lowrank"] < per_layer["none"] / 2
    return ref


@pytest.mark.parametrize("arch", ["svd", "cola"])
@pytest.mark.parametrize("size", [dict(n_embd=64, attn_rank=16, mlp_rank=24), dict(n_embd=96, n_head=6, n_kv_head=3, attn_rank=12, mlp_rank=20)])
def test_recompute_one_device(arch, size):
    cfg_of = lambda n: Config(**{**dict(n_head=8, n_kv_head=4, block_size=16, vocab_size=128), **size,
                                 "arch": arch, "n_layer": n})
    def make_model(n_layer):   # as train.py trains at tp=1: btp with a TP group of one
        torch.manual_seed(0)
        return group_of_one(Llama(cfg_of(n_layer)))
    idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    check_recompute(make_model, "btp", cfg_of(2), 1, idx)
    torch.manual_seed(0)
    ref = Llama(cfg_of(2))   # and the reference's loss and gradients, whatever the mode
    ref(idx, idx)[1].backward()
    for mode in RECOMPUTE:
        model = make_model(2)
        model.recompute = mode
        model(idx, idx)[1].backward()
        grads = model.full_tensors(grads=True)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{mode} {name}: {m}")


def test_recompute_flops_lowrank_below_layer():
    from torch.utils.flop_counter import FlopCounterMode
    idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    flops = {}
    for mode in RECOMPUTE:
        torch.manual_seed(0)
        model = group_of_one(Llama(small_cfg("cola", 4)), mode)
        with FlopCounterMode(display=False) as counter:
            model(idx, idx)[1].backward()
        flops[mode] = counter.get_total_flops()
    recompute = {mode: flops[mode] - flops["none"] for mode in ("layer", "lowrank")}
    assert 0 < recompute["lowrank"] < recompute["layer"], flops


def _recompute_worker(rank, world):
    parallel.LEDGER.name(dist.group.WORLD, "tp")
    small = dict(n_embd=64, attn_rank=16, mlp_rank=24)
    for layout, size, overlap in (("btp", small, False), ("btp", small, True),
                                  ("btp", dict(n_embd=128, attn_rank=32, mlp_rank=32), True),
                                  ("vanilla", small, True), ("btp", {**small, "lax": True}, True),   # LaX (lax.py)
                                  ("vanilla", {**small, "lax": True, "lax_gate": "linear"}, True)):
        tp = parallel.TPGroup(dist.group.WORLD, rank, world, overlap)
        cfg_of = lambda n: Config(**{**dict(n_head=8, n_kv_head=4, block_size=16, vocab_size=128), **size,
                                     "arch": "cola", "n_layer": n})
        def make_model(n_layer):
            torch.manual_seed(0)
            return TPLlama(Llama(cfg_of(n_layer)), tp, layout)
        idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        ref = check_recompute(make_model, layout, cfg_of(2), world, idx)
        backward = {mode: run_recompute(make_model, mode, idx, 2)[3] for mode in ("lowrank", "layer")}
        if layout == "btp":   # communication-free: the backward issues exactly the collectives of none
            assert backward["lowrank"] == ref[3], (backward["lowrank"], ref[3])
        replayed = {k: v for k, v in backward["layer"].items() if k[2] == "fwd"}
        assert replayed and {k: v for k, v in backward["layer"].items() if k[2] == "bwd"} == ref[3]
        if layout == "vanilla":  # its segments hold the all-reduces of the B outputs: recompute replays them
            assert any(k[2] == "fwd" for k in backward["lowrank"])


@pytest.mark.slow
def test_recompute_tp2_btp_and_vanilla():
    spawn(2, _recompute_worker)
