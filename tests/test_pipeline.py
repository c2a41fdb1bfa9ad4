"""test_pipeline.py: pipeline stages (pp=2, pp x tp, dp x pp; every schedule, one stage a rank and
several) against the single-device model, and train.py's pipelined runs and checkpoints equal to one
process.
"""
import shutil

import pytest
import torch
import torch.distributed as dist


from tp_model import TPLlama
import parallel
from extensions import pipeline
import sharding
from model import Llama
from plumbing import placement
from conftest import TINY, losses, metrics, run_train, small_cfg, spawn, torchrun


# (arch, layout, schedule, tied, stages a rank, micro-batches); zero-bubble schedules split each
# backward in two: they run with low-rank recompute, which replays no collective
CASES = [("cola", "btp", "1f1b", False, 1, 2), ("full", "megatron", "gpipe", False, 1, 2),
         ("cola", "btp", "1f1b", True, 1, 2), ("cola", "btp", "zero_bubble", False, 1, 2),
         ("cola", "vanilla", "interleaved_1f1b", False, 1, 2),
         ("cola", "btp", "interleaved_1f1b", True, 2, 2), ("full", "megatron", "zero_bubble", False, 2, 4),
         ("cola", "btp", "zbv", True, 2, 4), ("cola", "vanilla", "dualpipev", False, 2, 4)]
# the stage boundaries a pp=2 rank sends across, (forward, backward), rank 0 then rank 1: one stage a
# rank; two looped (rank 0 holds stages 0 and 2, rank 1 stages 1 and 3); two in a V (0 and 3, 1 and 2:
# the turn from stage 1 to 2 stays on rank 1)
CROSSINGS = {1: [(1, 0), (0, 1)], "looped": [(2, 1), (1, 2)], "v": [(1, 1), (1, 1)]}


def _pipeline_worker(rank, world, meshes, cases=CASES):
    for dp, pp, tp in meshes:
        mesh = placement.init_mesh(dp, tp, "cpu", 120, pp)
        tp_handle = parallel.TPGroup(mesh.get_group("tp"), mesh.get_local_rank("tp"), tp, overlap=True)
        dp_rank, pp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
        for arch, layout, schedule, tied, virtual, n_micro in cases:
            where = f"{arch}/{layout} {schedule} v={virtual} tied={tied} dp={dp} pp={pp} tp={tp}"
            torch.manual_seed(0)
            ref = Llama(small_cfg(arch, n_layer=4, tie_embeddings=tied))
            idx = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
            tgt = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(2))
            loss = ref(idx, tgt)[1]
            loss.backward()
            recompute = "lowrank" if arch == "cola" and schedule in pipeline.SPLIT_BACKWARD else "none"
            held = pipeline.stages_of(pp_rank, pp, virtual, schedule)
            stage = TPLlama(ref, tp_handle, layout, stage=held, stages=pp * len(held),
                                    recompute=recompute)
            pipe = pipeline.Pipeline(stage, mesh, n_micro, schedule, "cpu")
            share = slice(dp_rank * 8 // dp, (dp_rank + 1) * 8 // dp)
            parallel.LEDGER.reset()
            pipe_loss = pipe.run(idx[share], tgt[share]).clone()
            sharding.all_reduce_grads(stage, mesh.get_group("dp"))
            # (in buckets: one all-reduce for these few gradients, not one a parameter)
            assert parallel.LEDGER.total("dp", "grad", unit="calls") == (dp > 1), where
            sharding.reduce_tied_grad(stage, mesh.get_group("pp"))
            dist.all_reduce(pipe_loss, group=mesh.get_group("dp"))
            torch.testing.assert_close(pipe_loss / dp, loss.detach(), msg=lambda m: f"{where} loss: {m}")
            grads = stage.full_tensors(grads=True)
            for name, g in grads.items():
                torch.testing.assert_close(g, dict(ref.named_parameters())[name].grad, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{where} grad of {name}: {m}")
            names = [None] * pp
            dist.all_gather_object(names, sorted(grads), group=mesh.get_group("pp"))
            # a tied embedding sits with the first and the last stage: two ranks, but one in a V
            shared = ["tok_emb.weight"] if tied and schedule not in pipeline.V_SHAPED else []
            assert sorted(sum(names, [])) == sorted([n for n, _ in ref.named_parameters()] + shared), where
            d_local = 64 // tp if layout == "btp" else 64   # what crosses the stage boundary per token
            sent = {phase: parallel.LEDGER.total("pp", phase) for phase in ("fwd", "bwd")}
            kind = "v" if schedule in pipeline.V_SHAPED else "looped" if virtual > 1 else 1
            fwd, bwd = CROSSINGS[kind][pp_rank] if pp == 2 else (int(pp_rank < pp - 1), int(pp_rank > 0))
            assert sent == {"fwd": fwd * 8 // dp * 16 * d_local, "bwd": bwd * 8 // dp * 16 * d_local}, \
                (where, sent)


def test_pipeline_pp2_equals_single_device():
    spawn(2, _pipeline_worker, [(1, 2, 1)])


@pytest.mark.slow
def test_pipeline_pp2_tp2_and_dp2_pp2_equal_single_device():
    spawn(4, _pipeline_worker, [(1, 2, 2), (2, 2, 1)])


PP_RUN = ["--n_layer=4", "--max_iters=4", "--eval_interval=2", "--lr_decay_iters=4", "--batch_size=1",
          "--gradient_accumulation_steps=4"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc, layout", [(4, ["--pp=2", "--tp=2", "--recompute=lowrank"]),   # pp=2 alone:
                                           (4, ["--pp=2", "--dp=2", "--pp_schedule=gpipe"])])    # the next test
def test_pipeline_training_reproduces_single_device(tmp_path, data_dir, nproc, layout):
    single = run_train(tmp_path / "one", data_dir, *PP_RUN)
    torchrun(nproc, f"--out_dir={tmp_path / 'pp'}", f"--data_dir={data_dir}", *TINY, *PP_RUN, *layout)
    records = metrics(tmp_path / "pp")
    assert all(r["pp_bytes"] > 0 for r in records if "loss" in r)
    torch.testing.assert_close(torch.tensor(losses(records)), torch.tensor(losses(single)), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(records[-1]["val_loss"]), torch.tensor(single[-1]["val_loss"]),
                               rtol=1e-5, atol=1e-6)


V2 = ["--pp_virtual_stages=2"]


@pytest.mark.parametrize("nproc, layout", [   # one fast representative; the rest under slow
    (2, ["--pp=2", "--pp_schedule=zbv", *V2, "--recompute=lowrank", "--tie_embeddings=true"]),
    pytest.param(2, ["--pp=2", "--pp_schedule=interleaved_1f1b", *V2, "--optimizer=muon", "--lax=true"],
                 marks=pytest.mark.slow),
    pytest.param(2, ["--pp=2", "--pp_schedule=zero_bubble", *V2, "--recompute=layer", "--arch=svd",
                     "--layout=vanilla"], marks=pytest.mark.slow),
    pytest.param(4, ["--pp=2", "--tp=2", "--pp_schedule=dualpipev", *V2, "--lax=true",
                     "--recompute=lowrank", "--optimizer=muon", "--muon_mode=owner"], marks=pytest.mark.slow),
    pytest.param(4, ["--pp=2", "--dp=2", "--pp_schedule=interleaved_1f1b", *V2, "--dp_shard=grad",
                     "--gradient_accumulation_steps=8"], marks=pytest.mark.slow)])
def test_pipeline_schedules_train_like_one_process(tmp_path, data_dir, nproc, layout):
    """Each schedule's training run (several stages a rank) reproduces one process's losses."""
    options = [a for a in layout if a.split("=")[0] in ("--tie_embeddings", "--optimizer", "--lax", "--arch",
                                                        "--gradient_accumulation_steps")]   # (muon_mode: TP only)
    single = run_train(tmp_path / "one", data_dir, *PP_RUN, *options)
    torchrun(nproc, f"--out_dir={tmp_path / 'pp'}", f"--data_dir={data_dir}", *TINY, *PP_RUN, *layout)
    records = metrics(tmp_path / "pp")
    torch.testing.assert_close(torch.tensor(losses(records)), torch.tensor(losses(single)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(records[-1]["val_loss"]), torch.tensor(single[-1]["val_loss"]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_checkpoint_moves_between_pipeline_degrees(tmp_path, data_dir):
    common = [f"--data_dir={data_dir}", *TINY, *PP_RUN, "--max_iters=8", "--eval_interval=4", "--lr_decay_iters=8"]
    straight = losses(run_train(tmp_path / "straight", data_dir, *common[1:]))
    torchrun(2, f"--out_dir={tmp_path / 'pp2'}", *common, "--max_iters=4", "--pp=2")
    run_train(tmp_path / "pp1", data_dir, *common[1:], "--max_iters=4")
    torchrun(2, f"--out_dir={tmp_path / 'zbv'}", *common, "--max_iters=4", "--pp=2", "--pp_schedule=zbv", *V2)
    for src, dst, nproc, layout in (("pp2", "to_pp1", 1, []), ("pp1", "to_pp2", 2, ["--pp=2"]),
                                    ("zbv", "to_interleaved", 2, ["--pp=2", "--pp_schedule=interleaved_1f1b", *V2])):
        shutil.copytree(tmp_path / src / "checkpoints", tmp_path / dst / "checkpoints")
        torchrun(nproc, f"--out_dir={tmp_path / dst}", *common, "--init_from=resume", *layout)
        torch.testing.assert_close(torch.tensor(losses(metrics(tmp_path / dst))), torch.tensor(straight[4:]),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"{src} -> {dst}: {m}")
