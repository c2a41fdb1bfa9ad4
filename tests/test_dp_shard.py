"""test_dp_shard.py: --dp_shard (dp_shard.py, FSDP2 on the dp dimension) against one device: loss and
every gradient gathered to full shape for btp, vanilla and megatron at dp2 and dp2 x tp2, each
recompute mode it takes; train.py's runs equal to one process; checkpoints resumed across
dp_shard settings and layouts; the ledger's count of FSDP's collectives; what it refuses.
"""
import copy
import shutil

import pytest
import torch
import torch.distributed as dist

import checkpointing
import dp_shard
import layouts
import parallel
from conftest import TINY, expect_error, losses, metrics, run_train, small_cfg, spawn, torchrun
from model import Llama

CASES = [("cola", "btp"), ("cola", "vanilla"), ("full", "megatron"), ("cola", None)]   # None: model.Llama itself


def _equivalence_worker(rank, world, tp_size):
    dp = world // tp_size
    mesh = parallel.init_mesh(dp, tp_size, "cpu", 120)
    tp = parallel.TP(mesh.get_group("tp"), mesh.get_local_rank("tp"), tp_size)
    dp_rank = mesh.get_local_rank("dp")
    for (arch, layout), recompute, mode in [(c, r, m) for c in CASES for r in ("none", "layer") for m in ("grad", "full")]:
        if layout is None and tp_size > 1:
            continue
        where = f"{arch}/{layout} recompute={recompute} dp_shard={mode} dp={dp} tp={tp_size}"
        torch.manual_seed(0)
        ref = Llama(small_cfg(arch, n_layer=2), layer_runner=checkpointing.run_layers)
        idx = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
        loss = ref(idx, idx)[1]
        loss.backward()
        ref.recompute = recompute
        model = layouts.TPLlama(ref, tp, layout) if layout else copy.deepcopy(ref)
        dp_shard.apply(model, mesh["dp"], mode, "cpu", "float32")
        share = slice(dp_rank * 4 // dp, (dp_rank + 1) * 4 // dp)
        part = model(idx[share], idx[share])[1]
        part.backward()
        mean = part.detach().clone()
        dist.all_reduce(mean, group=mesh.get_group("dp"))
        torch.testing.assert_close(mean / dp, loss.detach(), msg=lambda m: f"{where} loss: {m}")
        assert all(dp_shard.is_sharded(p) for p in model.parameters()), where
        local = {n: dp_shard.whole(p.grad) for n, p in model.named_parameters()}
        grads = model.gather_full(local) if layout else local
        assert grads.keys() == dict(ref.named_parameters()).keys()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{where} {name}: {m}")
        norm = parallel.clip_grad_norm(model, float("inf"))   # the global norm, from the shards
        full_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in ref.parameters()))
        torch.testing.assert_close(norm.double(), full_norm, rtol=1e-5, atol=1e-7, msg=lambda m: f"{where} norm: {m}")
    dist.barrier()


def test_dp2_sharded_equals_single_device():
    spawn(2, _equivalence_worker, 1)


@pytest.mark.slow
def test_dp2_tp2_sharded_equals_single_device():
    spawn(4, _equivalence_worker, 2, timeout=600)


def run_args(data_dir, *extra):
    return [f"--data_dir={data_dir}", *TINY, "--max_iters=8", "--eval_interval=4", "--lr_decay_iters=8",
            "--batch_size=2", "--gradient_accumulation_steps=4", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("nproc, extra", [(2, ["--dp_shard=full", "--recompute=layer"]),
                                          (4, ["--dp_shard=grad", "--tp=2", "--arch=cola"])])
def test_train_py_sharded_equals_one_process(tmp_path, data_dir, nproc, extra):
    model_args = [a for a in extra if a.startswith(("--arch", "--recompute"))]
    single = losses(run_train(tmp_path / "one", data_dir, *run_args(data_dir, *model_args)[1:]))
    torchrun(nproc, f"--out_dir={tmp_path / 'dp'}", *run_args(data_dir, *extra))
    records = metrics(tmp_path / "dp")
    torch.testing.assert_close(torch.tensor(losses(records)), torch.tensor(single), rtol=1e-5, atol=1e-5)
    assert all(r["dp_bytes"] > 0 for r in records if "loss" in r)


@pytest.mark.slow
def test_sharded_checkpoints_resume_across_dp_shard_settings(tmp_path, data_dir):
    """Saved from shards (full), loaded into shards (grad; and under BTP at tp=2, whose stacked
    parameters hold several pieces each) and into one process's whole model."""
    straight = losses(run_train(tmp_path / "one", data_dir, *run_args(data_dir)[1:]))
    torchrun(2, f"--out_dir={tmp_path / 'full'}", *run_args(data_dir, "--max_iters=4", "--dp_shard=full"))
    for name, nproc, extra in (("grad", 2, ["--dp_shard=grad"]), ("btp", 4, ["--dp_shard=grad", "--tp=2"]),
                               ("one", 1, [])):
        shutil.copytree(tmp_path / "full" / "checkpoints", tmp_path / f"r-{name}" / "checkpoints")
        res = torchrun(nproc, f"--out_dir={tmp_path / f'r-{name}'}", *run_args(data_dir, "--init_from=resume", *extra))
        assert "resuming from" in res.stdout and "iter_0000004" in res.stdout
        torch.testing.assert_close(torch.tensor(losses(metrics(tmp_path / f"r-{name}"))), torch.tensor(straight[4:]),
                                   rtol=1e-5, atol=1e-5, msg=lambda m: f"resumed with {name}: {m}")


def test_ledger_counts_what_fsdp_sends():
    class Ledger:
        def __init__(self):
            self.rows = []

        def record(self, op, group, tensor, phase):
            self.rows.append((op, phase, tensor.numel()))
    model = Llama(small_cfg("cola", n_layer=2))
    model.dp_shard = "full"
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers."))

    class Group:   # a dp group of two, as far as record asks
        pass
    ledger = Ledger()
    orig = dist.get_world_size
    dist.get_world_size = lambda group=None: 2
    try:
        dp_shard.record(model, ledger, Group(), micro_steps=3)
    finally:
        dist.get_world_size = orig
    expect = []
    for n in [*sizes, root]:
        expect += [("all_gather", "fwd", n), ("all_gather", "bwd", n)] * 3 + [("reduce_scatter", "grad", n)]
    assert ledger.rows == expect


@pytest.mark.parametrize("world, argv, fragment", [
    (1, ["--dp_shard=full"], "dp_shard=full shards over the data-parallel ranks, and this run has dp=1"),
    (4, ["--dp_shard=grad", "--pp=2", "--gradient_accumulation_steps=4"], "does not compose with pp > 1"),
    (2, ["--dp_shard=full", "--recompute=lowrank", "--gradient_accumulation_steps=2"], "recompute=lowrank"),
    (2, ["--dp_shard=zero3"], "dp_shard=zero3 is not one of none, grad, full"),
])
def test_bad_dp_shard(capsys, monkeypatch, tmp_path, world, argv, fragment):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    expect_error(capsys, [f"--out_dir={tmp_path}", *argv], fragment)
