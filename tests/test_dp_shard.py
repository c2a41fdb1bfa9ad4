"""test_dp_shard.py: --dp_shard (extensions/dp_shard.py, FSDP2 on the dp dimension) against one device: loss and
every gradient gathered to full shape for btp, vanilla and megatron at dp2 and dp2 x tp2, each
recompute mode it takes, and at dp2 x pp2; the ledger's count of FSDP's collectives; train.py's
runs equal to one process; checkpoints resumed across dp_shard settings and layouts; what it refuses.
"""
import shutil

import pytest
import torch
import torch.distributed as dist

from extensions import dp_shard
from tp_model import TPLlama
import parallel
from extensions import pipeline
import sharding
from recompute import RECOMPUTE
from model import Llama
from plumbing import placement
from conftest import TINY, expect_error, losses, metrics, run_train, small_cfg, spawn, torchrun

CASES = [("cola", "btp"), ("cola", "vanilla"), ("full", "megatron")]   # (at tp=1: a TP group of one)


def expected_fsdp_traffic(model, mode):
    """What FSDP2 sends in one step of one micro-batch, from its units' sizes (the ledger's elements:
    all-gathers their result, reduce-scatters their input): each unit's parameters gathered for
    forward, again for backward under full, and its gradients reduce-scattered once."""
    units = [*model.layers, model]
    own = [sum(p.numel() for n, p in u.named_parameters() if u is not model or not n.startswith("layers."))
           for u in units]
    n = [k for k in own if k]   # (a pipeline stage's root may hold none)
    expect = {("all_gather", "fwd"): [sum(n), len(n)], ("reduce_scatter", "grad"): [sum(n), len(n)]}
    if mode == "full":
        expect[("all_gather", "bwd")] = [sum(n), len(n)]
    return expect


def fsdp_traffic(group_name="dp"):
    return {(op, phase): [c[0], c[2]] for (op, g, phase), c in parallel.LEDGER.counts.items()
            if g == group_name and op in ("all_gather", "reduce_scatter")}


def _equivalence_worker(rank, world, tp_size):
    dp = world // tp_size
    mesh = placement.init_mesh(dp, tp_size, "cpu", 120)
    tp = parallel.TPGroup(mesh.get_group("tp"), mesh.get_local_rank("tp"), tp_size)
    dp_rank = mesh.get_local_rank("dp")
    for (arch, layout), recompute, mode in [(c, r, m) for c in CASES for r in RECOMPUTE for m in ("grad", "full")]:
        if recompute == "lowrank" and arch == "full":
            continue
        where = f"{arch}/{layout} recompute={recompute} dp_shard={mode} dp={dp} tp={tp_size}"
        torch.manual_seed(0)
        ref = Llama(small_cfg(arch, n_layer=2))
        idx = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
        loss = ref(idx, idx)[1]
        loss.backward()
        model = TPLlama(ref, tp, layout, recompute=recompute)
        dp_shard.apply(model, mesh["dp"], mode, "float32", parallel.LEDGER)
        share = slice(dp_rank * 4 // dp, (dp_rank + 1) * 4 // dp)
        parallel.LEDGER.reset()
        part = model(idx[share], idx[share])[1]
        part.backward()
        assert fsdp_traffic() == expected_fsdp_traffic(model, mode), (where, fsdp_traffic())
        mean = part.detach().clone()
        dist.all_reduce(mean, group=mesh.get_group("dp"))
        torch.testing.assert_close(mean / dp, loss.detach(), msg=lambda m: f"{where} loss: {m}")
        assert all(dp_shard.is_sharded(p) for p in model.parameters()), where
        local = {n: dp_shard.whole(p.grad) for n, p in model.named_parameters()}
        grads = model.gather_full(local)
        assert grads.keys() == dict(ref.named_parameters()).keys()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{where} {name}: {m}")
        norm = sharding.clip_grad_norm(model, float("inf"))   # the global norm, from the shards
        full_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in ref.parameters()))
        torch.testing.assert_close(norm.double(), full_norm, rtol=1e-5, atol=1e-7, msg=lambda m: f"{where} norm: {m}")
        params = dict(model.named_parameters())
        for name, spec in (model.named_specs() if tp_size > 1 else ()):
            if spec.dim is None:   # replicated over TP: this dp shard of its gradient the same on each TP rank
                g = dp_shard.local(params[name].grad)
                peers = [torch.empty_like(g) for _ in range(tp_size)]
                dist.all_gather(peers, g, group=mesh.get_group("tp"))
                assert all(torch.equal(peer, g) for peer in peers), f"{where}: {name}'s gradient differs over TP"
    if tp_size == 1:
        _check_mixed_precision(mesh, tp, dp_rank, dp)
    dist.barrier()


def _check_mixed_precision(mesh, tp, dp_rank, dp):
    """bf16: FSDP's MixedPrecisionPolicy keeps fp32 shards, gathers them in bf16 (2 bytes an element
    in the ledger) and reduce-scatters the gradients in fp32 (4 bytes); the step is bf16 autocast's."""
    torch.manual_seed(0)
    ref = Llama(small_cfg("cola"))
    idx = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ref(idx, idx)[1]
    loss.backward()
    model = dp_shard.apply(TPLlama(ref, tp, "btp"), mesh["dp"], "grad", "bfloat16",
                           parallel.LEDGER)
    share = slice(dp_rank * 4 // dp, (dp_rank + 1) * 4 // dp)
    parallel.LEDGER.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        part = model(idx[share], idx[share])[1]
    part.backward()
    (elements, nbytes, _), (r_elements, r_bytes, _) = (parallel.LEDGER.counts[k] for k in
                                                       [("all_gather", "dp", "fwd"), ("reduce_scatter", "dp", "grad")])
    assert nbytes == 2 * elements and r_bytes == 4 * r_elements, (nbytes, elements, r_bytes, r_elements)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    mean = part.detach().float().clone()
    dist.all_reduce(mean, group=mesh.get_group("dp"))
    torch.testing.assert_close(mean / dp, loss.detach().float(), rtol=1e-2, atol=1e-2)
    grads = model.gather_full({n: dp_shard.whole(p.grad) for n, p in model.named_parameters()})
    for name, p in ref.named_parameters():
        g = p.grad
        torch.testing.assert_close(grads[name], g, rtol=5e-2, atol=5e-2 * g.abs().max().item(),
                                   msg=lambda m: f"bf16 {name}: {m}")


def test_dp2_sharded_equals_single_device():
    spawn(2, _equivalence_worker, 1)


@pytest.mark.slow
def test_dp2_tp2_sharded_equals_single_device():
    spawn(4, _equivalence_worker, 2, timeout=600)


def _pipeline_worker(rank, world):
    """dp2 x pp2: each stage's TP-local parameters (tp=1) sharded over its dp pair; 2 micro-batches."""
    mesh = placement.init_mesh(2, 1, "cpu", 120, 2)
    tp = parallel.TPGroup(mesh.get_group("tp"), 0, 1)
    dp_rank, pp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    cases = [("cola", "btp", r) for r in RECOMPUTE] + [("cola", "vanilla", r) for r in RECOMPUTE] + \
        [("full", "megatron", r) for r in ("none", "layer")]
    runs = [(c, m, ("1f1b", "gpipe")[i % 2]) for i, (c, m) in enumerate((c, m) for c in cases for m in ("grad", "full"))]
    # two stages a rank: torch sees StageViews, not the FSDP module; still one reduce-scatter a step
    runs += [(("cola", "btp", "lowrank"), m, "interleaved_1f1b") for m in ("grad", "full")]
    for i, ((arch, layout, recompute), mode, schedule) in enumerate(runs):
        tied = i % 3 == 0
        where = f"{arch}/{layout} recompute={recompute} dp_shard={mode} tied={tied} {schedule} dp2 x pp2"
        torch.manual_seed(0)
        ref = Llama(small_cfg(arch, n_layer=4, tie_embeddings=tied))
        idx = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
        loss = ref(idx, idx)[1]
        loss.backward()
        held = pipeline.stages_of(pp_rank, 2, 2 if schedule == "interleaved_1f1b" else 1, schedule)
        stage = TPLlama(ref, tp, layout, stage=held, stages=2 * len(held), recompute=recompute)
        dp_shard.apply(stage, mesh["dp"], mode, "float32", parallel.LEDGER)
        pipe = pipeline.Pipeline(stage, mesh, 2, schedule, "cpu")
        parallel.LEDGER.reset()
        pipe_loss = pipe.run(idx[dp_rank * 4:(dp_rank + 1) * 4], idx[dp_rank * 4:(dp_rank + 1) * 4]).clone()
        sharding.reduce_tied_grad(stage, mesh.get_group("pp"))
        sent, expect = fsdp_traffic(), expected_fsdp_traffic(stage, mode)
        assert sent[("reduce_scatter", "grad")] == expect[("reduce_scatter", "grad")], (where, sent)  # once a step
        assert sent[("all_gather", "fwd")][0] >= expect[("all_gather", "fwd")][0], (where, sent)
        dist.all_reduce(pipe_loss, group=mesh.get_group("dp"))
        torch.testing.assert_close(pipe_loss / 2, loss.detach(), msg=lambda m: f"{where} loss: {m}")
        grads = stage.gather_full({n: dp_shard.whole(p.grad) for n, p in stage.named_parameters()})
        for name, g in grads.items():
            torch.testing.assert_close(g, dict(ref.named_parameters())[name].grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{where} grad of {name}: {m}")
        held = [None] * 2
        dist.all_gather_object(held, sorted(grads), group=mesh.get_group("pp"))
        assert sorted(set(sum(held, []))) == sorted(n for n, _ in ref.named_parameters()), where
        norm = sharding.clip_grad_norm(stage, float("inf"), mesh.get_group("pp"))
        full_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in ref.parameters()))
        torch.testing.assert_close(norm.double(), full_norm, rtol=1e-5, atol=1e-7, msg=lambda m: f"{where} norm: {m}")
    dist.barrier()


@pytest.mark.slow
def test_dp2_pp2_sharded_equals_single_device():
    spawn(4, _pipeline_worker, timeout=600)


def run_args(data_dir, *extra):
    return [f"--data_dir={data_dir}", *TINY, "--max_iters=8", "--eval_interval=4", "--lr_decay_iters=8",
            "--batch_size=2", "--gradient_accumulation_steps=4", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("nproc, extra", [(2, ["--dp_shard=full", "--recompute=layer"]),
                                          (4, ["--dp_shard=grad", "--pp=2", "--arch=cola", "--recompute=lowrank"])])
def test_train_py_sharded_equals_one_process(tmp_path, data_dir, nproc, extra):
    model_args = [a for a in extra if a.startswith(("--arch", "--recompute"))]
    single = losses(run_train(tmp_path / "one", data_dir, *run_args(data_dir, *model_args)[1:]))
    torchrun(nproc, f"--out_dir={tmp_path / 'dp'}", *run_args(data_dir, *extra))
    records = metrics(tmp_path / "dp")
    torch.testing.assert_close(torch.tensor(losses(records)), torch.tensor(single), rtol=1e-5, atol=1e-5)
    assert all(r["dp_bytes"] > 0 for r in records if "loss" in r)


@pytest.mark.slow
def test_sharded_checkpoints_resume_across_dp_shard_settings(tmp_path, data_dir):
    """Saved from shards (grad, whose evaluation before the save leaves the parameters gathered),
    loaded into shards (full: under BTP at tp=2, whose stacked parameters hold several pieces each,
    and on a pipeline) and into one process's whole model."""
    straight = losses(run_train(tmp_path / "one", data_dir, *run_args(data_dir)[1:]))
    torchrun(2, f"--out_dir={tmp_path / 'grad'}", *run_args(data_dir, "--max_iters=4", "--dp_shard=grad"))
    for name, nproc, extra in (("btp", 4, ["--dp_shard=full", "--tp=2"]), ("pp", 4, ["--dp_shard=full", "--pp=2"]),
                               ("one", 1, [])):
        shutil.copytree(tmp_path / "grad" / "checkpoints", tmp_path / f"r-{name}" / "checkpoints")
        res = torchrun(nproc, f"--out_dir={tmp_path / f'r-{name}'}", *run_args(data_dir, "--init_from=resume", *extra))
        assert "resuming from" in res.stdout and "iter_0000004" in res.stdout
        torch.testing.assert_close(torch.tensor(losses(metrics(tmp_path / f"r-{name}"))), torch.tensor(straight[4:]),
                                   rtol=1e-5, atol=1e-5, msg=lambda m: f"resumed with {name}: {m}")


@pytest.mark.parametrize("world, argv, fragment", [
    (1, ["--dp_shard=full"], "dp_shard=full shards over the data-parallel ranks, and this run has dp=1"),
    (2, ["--dp_shard=grad", "--compile=true", "--gradient_accumulation_steps=2"], "does not compose with compile=true"),
    (2, ["--dp_shard=zero3"], "dp_shard=zero3 is not one of none, grad, full"),
])
def test_bad_dp_shard(capsys, monkeypatch, tmp_path, world, argv, fragment):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    expect_error(capsys, [f"--out_dir={tmp_path}", *argv], fragment)


def test_held_gradient_sync_releases_on_torch_2_11s_state_too(monkeypatch):
    """pipeline.hold_gradient_sync's release walks FSDP's states as torch does: 2.13 keeps a list
    `_fsdp_param_groups`, 2.11 (the GPU image's) one `_fsdp_param_group` or None; each group's
    post_backward runs once, then the root's final callback (FSDP's objects stood in for)."""
    from types import SimpleNamespace
    from torch.distributed.fsdp import fully_shard
    calls, flags = [], {}
    group = lambda name: SimpleNamespace(post_backward=lambda: calls.append(name))   # noqa: E731
    states = [SimpleNamespace(_fsdp_param_group=group("a")), SimpleNamespace(_fsdp_param_group=None),
              SimpleNamespace(_fsdp_param_groups=[group("b"), group("c")])]
    root = SimpleNamespace(_state_ctx=SimpleNamespace(all_states=states),
                           _root_post_backward_final_callback=lambda: calls.append("final"))
    monkeypatch.setattr(fully_shard, "state", lambda model: root)
    model = SimpleNamespace(**{f"set_{k}": (lambda k: lambda v: flags.__setitem__(k, v))(k)
                               for k in ("is_last_backward", "reshard_after_backward", "requires_gradient_sync")})
    pipeline.hold_gradient_sync(model, True)
    assert flags == dict.fromkeys(flags, False) and len(flags) == 3 and calls == []
    pipeline.hold_gradient_sync(model, False)
    assert flags == dict.fromkeys(flags, True) and calls == ["a", "b", "c", "final"]
