"""test_scale.py: a rank never holds more than its part of the model: built on the meta device, each
rank's part equals the one cut from the seeded single-device model, bit for bit (tp=4, pp2 x tp2,
dp2 x tp2 with --dp_shard), and the build's peak memory is the part and one full parameter; a
--dp_shard checkpoint is saved and loaded as it is held, its peak the training state and one
parameter.
"""
import subprocess
import sys
import textwrap

import pytest
import torch

from extensions import dp_shard
from tp_model import TPLlama
from conftest import ROOT, spawn
from model import Llama
from plumbing import options, placement
from plumbing.plan import make


def plan_of(args, world):
    cfg, tc = options.parse_args(["--n_layer=4", "--n_head=4", "--n_embd=64",
                                  "--gradient_accumulation_steps=2",
                                  *args])
    cfg.vocab_size = 320
    return make(cfg, tc, world)


def _build_worker(rank, world):
    meshes = [["--tp=4"], ["--tp=2", "--pp=2", "--pp_schedule=gpipe"], ["--tp=2", "--dp_shard=full"],
              ["--dp_shard=grad", "--pp=2", "--pp_schedule=gpipe"]]
    models = [["--arch=cola", "--lax=true", "--tie_embeddings=true"], ["--arch=full"]]
    for mesh in meshes:
        for model_args in models:
            plan = plan_of([*model_args, *mesh], world)
            place = placement.place_processes(plan)
            built = placement.build_model(plan, place)[0]
            torch.manual_seed(plan.tc.seed)   # today's way: the whole reference, then cut
            cut = TPLlama(Llama(plan.cfg), place.tp, plan.layout, stage=place.pp_rank,
                                  stages=plan.tc.pp)
            theirs = dict(cut.named_parameters())
            where = f"{mesh} {model_args} rank {rank}"
            assert theirs.keys() == dict(built.named_parameters()).keys(), where
            for name, p in built.named_parameters():
                assert torch.equal(dp_shard.whole(p).detach(), theirs[name].detach()), \
                    f"{where}: {name}"
            assert torch.equal(built.rope_cos, cut.rope_cos), where




MEMORY = """
import sys, torch
sys.path.insert(0, {root!r})
import layouts, parallel
from model import Llama
from plumbing import options, placement
from plumbing.plan import Plan

def rss(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field)) * 1024

cfg, tc = options.parse_args(["--arch=full", "--n_layer=8", "--n_embd=768", "--n_head=12",
                              "--tp=4"])
cfg.vocab_size = 16000
place = placement.Placement(4, 1, "cpu", tp=parallel.TPGroup(None, 1, 4))   # rank 1 of tp=4
plan = Plan(cfg, tc, 4, 1, "megatron", "cpu", "float32")
small = Plan(options.parse_args(["--arch=full", "--n_layer=1", "--n_embd=64", "--tp=4"])[0],
             tc, 4, 1, "megatron", "cpu", "float32")
small.cfg.vocab_size = 64
placement.build_model(small, place)   # (every code path once)
open("/proc/self/clear_refs", "w").write("5")   # the peak from here
before = rss("VmRSS")
if {whole!r}:
    torch.manual_seed(tc.seed)
    model = TPLlama(Llama(cfg), place.tp, "megatron")
else:
    model = placement.build_model(plan, place)[0]
part = sum(p.numel() * 4 for p in model.parameters())
largest = cfg.vocab_size * cfg.n_embd * 4   # the embedding (and the head): the largest
print(rss("VmHWM") - before, part, largest)
"""


def build_peak(whole):
    """(peak bytes above the start, this rank's part, the largest parameter) of building rank 1 of
    tp=4 of a dense 8-layer d=768 model (16,000-token vocabulary), in a fresh process."""
    code = MEMORY.format(root=str(ROOT), whole=whole)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    return [int(x) for x in out.split()]


@pytest.mark.slow
def test_the_build_holds_the_part_and_one_parameter():
    """The build's peak above its start: at most this rank's part, the largest full parameter
    (the embedding, 49 MB) and 32 MB; the whole reference cut (the old way, build_peak(True))
    peaks with the full model (326 MB) on top of the part (tools/bench.py startup measures both)."""
    peak, part, largest = build_peak(False)
    assert peak <= part + largest + 32e6, (peak / 1e6, part / 1e6, largest / 1e6)


def _checkpoint_worker(rank, world, folder):
    """A dense model sharded over dp=2 (x tp=2) with its AdamW moments: a save's and a load's peak
    above the training state, and the round trip exact."""
    import train
    from plumbing import train_state
    plan = plan_of(["--arch=full", "--n_layer=8", "--n_embd=512", "--n_head=8", "--tp=2",
                    "--dp_shard=full"], world)
    plan.cfg.vocab_size = 8000
    place = placement.place_processes(plan)
    model = placement.build_model(plan, place)[0]
    optimizer = train.muon.configure(model, plan.tc)
    views = train_state.state_views(model, optimizer, place.ckpt_mesh)   # (the moments made)
    for t in views.values():
        t.uniform_()   # (every value its own)
    kept = {k: v.clone() for k, v in views.items()}
    largest = plan.cfg.vocab_size * plan.cfg.n_embd * 4
    state = 3 * sum(p.numel() for p in model.parameters()) * 4   # (all of it, TP-local)
    for step in ("save", "load"):
        torch.distributed.barrier()
        open("/proc/self/clear_refs", "w").write("5")
        before = rss("VmRSS")
        if step == "save":
            meta = {"run_id": "x", "config": plan.cfg.shape()}
            path = train_state.save(folder, 1, model, optimizer, place.ckpt_mesh, meta)[0]
        else:
            for t in views.values():
                t.zero_()
            meta = train_state.read_meta(path)
            assert train_state.load(path, meta, model, optimizer, place.ckpt_mesh) is None
        peak = rss("VmHWM") - before
        assert peak <= largest + 48e6, (step, peak / 1e6, largest / 1e6, state / 1e6)
    assert all(torch.equal(views[k], kept[k]) for k in views)


def rss(field):
    return next(int(x.split()[1]) for x in open("/proc/self/status")
                if x.startswith(field)) * 1024


def _scale_worker(rank, world, folder):
    _build_worker(rank, world)
    _checkpoint_worker(rank, world, folder)


@pytest.mark.slow
def test_each_rank_builds_its_part_and_checkpoints_its_shards(tmp_path):
    """The build, bit for bit, at each mesh; then, at dp2 x tp2, each rank saves and loads its dp
    shards as it holds them: the peak above the training state is at most the largest parameter
    (16 MB) and 48 MB, where gathering the state whole (the way before) took 3 × 4 bytes a TP-local
    parameter more (201 MB a rank here); the values come back exact."""
    spawn(4, _scale_worker, str(tmp_path), timeout=400)


# --------------------------------------------------- issue 42: a rank draws its part alone

def test_any_part_of_a_parameter_is_drawn_alone_with_the_values_of_the_whole(monkeypatch):
    """model.init_part: a region of a parameter, ragged against the tiles, equals that region of
    the parameter drawn whole, and draws only the tiles it meets (tiles of 8 here, to have many)."""
    import model
    monkeypatch.setattr(model, "INIT_TILE", 8)
    drawn = []
    keyed = model.tile_generator
    monkeypatch.setattr(model, "tile_generator", lambda *key: (drawn.append(key[2:]), keyed(*key))[1])
    rule = (torch.ops.aten.normal_.default, (0.0, 0.5), {})
    whole = model.init_part(rule, 7, "w", (40, 36), (0, 40), (0, 36))
    assert len(drawn) == 5 * 5 and 0.4 < whole.std() < 0.6
    drawn.clear()
    part = model.init_part(rule, 7, "w", (40, 36), (10, 20), (9, 27))
    assert torch.equal(part, whole[10:20, 9:27])
    assert sorted(drawn) == [(i, j) for i in (1, 2) for j in (1, 2, 3)]   # rows 8-23, cols 8-31
    other = model.init_part(rule, 8, "w", (40, 36), (0, 40), (0, 36))   # another seed, another model
    assert not torch.equal(other, whole)


def test_a_rank_draws_a_quarter_at_tp4_and_a_resume_draws_nothing(monkeypatch, tmp_path, data_dir):
    """Rank 1 of tp=4 (BTP, untied) draws about a quarter of the tiles the whole model takes (the
    replicated norms aside), its values test_scale's first test checks; a resumed run, whose
    checkpoint overwrites every parameter, draws none."""
    import model
    import parallel
    import train
    import sharding
    monkeypatch.setattr(model, "INIT_TILE", 8)
    drawn = []
    keyed = model.tile_generator
    monkeypatch.setattr(model, "tile_generator", lambda *key: (drawn.append(key[1:]), keyed(*key))[1])
    plan = plan_of(["--tp=4"], 4)
    with torch.device("meta"):
        ref = Llama(plan.cfg)
    model_4 = TPLlama(ref, parallel.TPGroup(None, 1, 4), "btp")
    model_4.to_empty(device="cpu")
    sharding.materialize(model_4, ref)
    part = len(drawn)
    drawn.clear()
    torch.manual_seed(plan.tc.seed)
    Llama(plan.cfg)   # the whole, on the CPU
    assert 0.2 < part / len(drawn) < 0.3, (part, len(drawn))
    common = [f"--out_dir={tmp_path}", f"--data_dir={data_dir}", "--n_layer=1", "--n_embd=32",
              "--n_head=4", "--block_size=16", "--batch_size=2", "--eval_interval=2",
              "--sample_tokens=0"]
    train.main([*common, "--max_iters=2"])
    called = []
    monkeypatch.setattr(sharding, "materialize", lambda *a: called.append(a))
    train.main([*common, "--max_iters=3", "--init_from=resume"])
    assert called == []
