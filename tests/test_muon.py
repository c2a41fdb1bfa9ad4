"""test_muon.py: Muon (extensions/muon.py) equals torch.optim.Muon on one device, and under every layout equals one
device's Muon: the loss at every step and every parameter after a few steps, with the Gram path and
the gather path, at tp=2 and tp=4 and dp2 × tp2; its collectives in the ledger (phase "optim") equal
the formula; train.py with --optimizer=muon at tp=2 and pp=2 as one process, and resumed exactly.
"""
import copy
import shutil

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from extensions import buckets, dp_shard
from tp_model import TPLlama
from extensions import muon
import parallel
from conftest import TINY, losses, metrics, run_train, spawn, torchrun
from model import Config, Llama
from plumbing import options, placement


def tc_of(**kw):
    return options.TrainConfig(optimizer="muon", learning_rate=1e-2, muon_lr=0.05, **kw)


def test_one_device_muon_is_torch_optim_muon():
    """The whole-matrix path with its Newton-Schulz in bf16 is torch.optim.Muon's update (Nesterov,
    decay lr·wd, lr·√max(1, m/n)), for a wide and a tall matrix over three steps."""
    for shape in ((8, 24), (24, 8)):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(shape))
        ref = torch.nn.Parameter(w.detach().clone())
        mine = muon.MuonAdamW([{"params": [w], "muon": True, "pieces": {w: [muon.Piece(0, shape[0], shape, None, 1)]},
                                "tp": None, "momentum": 0.9, "weight_decay": 0.1, "ns_dtype": torch.bfloat16}], lr=0.02)
        theirs = torch.optim.Muon([ref], lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True,
                                  adjust_lr_fn="original")
        for step in range(3):
            g = torch.randn(shape, generator=torch.Generator().manual_seed(step))
            w.grad, ref.grad = g.clone(), g.clone()
            mine.step()
            theirs.step()
            torch.testing.assert_close(w.detach(), ref.detach(), rtol=0, atol=2e-3)


def test_a_step_with_found_inf_changes_nothing():
    """train.py's non-finite flag: a NaN gradient with found_inf = 1 leaves the weights and the
    momentum as they were (AdamW's fused step skips alike)."""
    w = torch.nn.Parameter(torch.randn(8, 24))
    opt = muon.MuonAdamW([{"params": [w], "muon": True, "pieces": {w: [muon.Piece(0, 8, (8, 24), None, 1)]},
                           "tp": None, "momentum": 0.9, "weight_decay": 0.1, "ns_dtype": torch.float32}], lr=0.02)
    w.grad = torch.randn(8, 24)
    opt.step()
    before, buf = w.detach().clone(), opt.state[w]["momentum_buffer"].clone()
    w.grad = torch.full((8, 24), float("nan"))
    opt.found_inf = torch.ones(())
    opt.step()
    assert torch.equal(w.detach(), before) and torch.equal(opt.state[w]["momentum_buffer"], buf)


def test_newton_schulz_orthogonalises():
    X = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(muon.newton_schulz(X))
    assert 0.6 < s.min() and s.max() < 1.3, s   # (the quintic's band around 1, as Muon's authors say)


def small(arch, lax=False, kv=2):
    return Config(arch=arch, n_layer=2, n_embd=32, n_head=4, n_kv_head=kv, block_size=16, vocab_size=128,
                  lax=lax, lax_gate="linear", attn_rank=8, mlp_rank=8)


def _worker(tp_rank, world, meshes):
    for dp, tp, shard in meshes:
        mesh = placement.init_mesh(dp, tp, "cpu", 120)
        handle = parallel.TPGroup(mesh.get_group("tp"), mesh.get_local_rank("tp"), tp)
        for name in ("dp", "tp"):
            parallel.LEDGER.name(mesh.get_group(name), name)
        dp_rank = mesh.get_local_rank("dp")
        for arch, layout, prefer in [("cola", "btp", "gram"), ("cola", "btp", "gather"), ("svd", "vanilla", None),
                                     ("full", "megatron", None), ("cola", "btp", "owner"),
                                     ("svd", "vanilla", "owner"), ("full", "megatron", "owner")]:
            where = f"{arch}/{layout}/{prefer} dp={dp} tp={tp} dp_shard={shard}"
            torch.manual_seed(0)
            ref = Llama(small(arch, lax=arch != "full", kv=max(2, tp)))
            tp_model = TPLlama(copy.deepcopy(ref), handle, layout)
            if shard != "none":
                dp_shard.apply(tp_model, mesh["dp"], shard, "float32", parallel.LEDGER)
            model = DDP(tp_model, process_group=mesh.get_group("dp")) if dp > 1 and shard == "none" else tp_model
            opt_ref, opt = muon.configure(ref, tc_of()), muon.configure(tp_model, tc_of(), prefer)
            modes = {pc.mode for g in opt.param_groups if g.get("muon") for pcs in g["pieces"].values() for pc in pcs}
            mode = prefer or (opt.said.split()[1] if opt.said else "gather")   # (auto: its choice)
            assert modes == {"whole" if tp == 1 else mode if mode in ("gram", "owner") else "gather"}, \
                (where, modes)
            for step in range(3):
                idx = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(step))
                share = slice(dp_rank * 4 // dp, (dp_rank + 1) * 4 // dp)
                loss = ref(idx, idx)[1]
                loss.backward()
                parallel.LEDGER.reset()
                tp_loss = model(idx[share], idx[share])[1]
                tp_loss.backward()
                for o in (opt_ref, opt):
                    o.step()
                    o.zero_grad()
                mean = tp_loss.detach().clone()
                dist.all_reduce(mean, group=mesh.get_group("dp"))
                torch.testing.assert_close(mean / dp, loss.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")
                assert parallel.LEDGER.total("tp", "optim") == muon.traffic(opt), where
                # buckets: a handful of collectives a step, however many matrices (closed form)
                calls = parallel.LEDGER.total(phase="optim", unit="calls")
                assert calls == muon.collectives(opt) <= 1 + 1 + 1 + muon.STEPS, (where, calls)
                layer = muon.per_layer_traffic(layout, ref.cfg, tp, mode)   # (the closed form)
                mine = torch.tensor(muon.traffic(opt))   # (owner: what a rank sends depends on what it owns)
                dist.all_reduce(mine, group=mesh.get_group("tp"))
                assert mine == tp * ref.cfg.n_layer * layer and (layer > 0) == (tp > 1), where
                assert parallel.LEDGER.total("dp", "optim") == muon.traffic(opt, "dp"), where
                assert (muon.traffic(opt, "dp") > 0) == (shard != "none"), where   # (gathered over dp)
            full = tp_model.gather_full({n: dp_shard.whole(p.detach()) for n, p in tp_model.named_parameters()})
            # atol 5e-5: AdamW (LaX's gates, norms) moves an element by about lr·sign(g) whatever |g|,
            # so one whose gradient is at rounding level (layer 1's gates at the first steps) differs
            # by a fraction of lr=1e-2: measured at most 2.8e-5 (layers.1.mlp.up.cross.W.weight)
            for name, p in ref.named_parameters():
                torch.testing.assert_close(full[name], p.detach(), rtol=1e-4, atol=5e-5,
                                           msg=lambda m: f"{where} {name}: {m}")
        dist.barrier()


def test_muon_tp2_and_dp_shard_every_layout_equals_one_device():
    """tp=2 (DDP off), and dp=2 under --dp_shard=grad (the update gathered over dp), each in its own
    pair of processes: run in one pair, one run of about ten (a fresh clone's CI run) lost a rank to
    glibc's "double free or corruption" in the dp_shard half, after the tp half's groups; not
    reproduced since, not understood."""
    for meshes in ([(1, 2, "none")], [(2, 1, "grad")]):
        spawn(2, _worker, meshes)


@pytest.mark.slow
def test_muon_tp4_dp2_tp2_and_dp_shard_tp2_equal_one_device():
    spawn(4, _worker, [(1, 4, "none"), (2, 2, "none"), (2, 2, "full")], timeout=600)


def test_owners_balance_the_work():
    assert buckets.owners([5, 3, 3, 1], 2) == [0, 1, 1, 0]   # largest first, each to the least loaded
    assert buckets.owners([2, 1], 4) == [0, 1]                 # ranks 2 and 3 own none


def _owner_worker(rank, world):
    """owner_computes against gathering every matrix (gathered_all) and applying fn on every rank:
    three matrices cut along rows or columns, then one matrix alone (rank 1 owns none)."""
    group = placement.init_mesh(1, world, "cpu", 120).get_group("tp")
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(6, 8, generator=g), torch.randn(4, 10, generator=g), torch.randn(8, 8, generator=g)]
    for picked in ([0, 1, 2], [1]):
        dims = [(0, 1, 1)[i] for i in picked]
        blocks = [fulls[i].chunk(world, d)[rank] for i, d in zip(picked, dims)]
        fn = lambda xs: [2 * x + x.sum() for x in xs]   # (elementwise and whole-matrix: needs it whole)
        got = buckets.owner_computes(blocks, dims, group, fn)
        want = [y.chunk(world, d)[rank] for y, d in zip(fn(buckets.gathered_all(blocks, dims, group)), dims)]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    dist.barrier()


def test_owner_computes_equals_computing_everywhere():
    spawn(2, _owner_worker)


def test_traffic_formula_counts_gram_and_gather():
    """muon.traffic: the Gram path's r×r matrices (5 a step, and the norms), the gather path's whole
    matrices, by hand for one BTP layer's A_qkv (3 pieces of (8, 32/t)) at t=2."""
    group = {"muon": True, "params": ["A"], "tp": parallel.TPGroup(None, 0, 2)}
    gram = [muon.Piece(i * 8, 8, (24, 16), 1, 2, prefer="gram") for i in range(3)]
    gather = [muon.Piece(i * 8, 8, (24, 16), 1, 2, prefer="gather") for i in range(3)]
    assert [p.mode for p in gram + gather] == ["gram"] * 3 + ["gather"] * 3 and gram[0].full == (8, 32)
    opt = type("O", (), {"param_groups": [{**group, "pieces": {"A": gram}}]})()
    assert muon.traffic(opt) == 3 + 5 * 3 * 8 * 8
    opt.param_groups[0]["pieces"] = {"A": gather}
    assert muon.traffic(opt) == 3 * 8 * 32


def test_step_cost_is_its_closed_form():
    """step_cost of three (8, 32) matrices cut along their long side at tp=2 (fp32, α 1 s, 1 byte/s,
    1 FLOP/s): a collective, the bytes a rank receives, the Newton-Schulz FLOPs of the busiest rank
    (5 × (4·8²·32 + 2·8³) = 46,080 a whole matrix; the owner path's ranks own two and one)."""
    def cost(mode):
        pieces = [muon.Piece(i * 8, 8, (24, 16), 1, 2, prefer=mode) for i in range(3)]
        return muon.step_cost(pieces, 1.0, 1.0, 1.0, 4)
    assert muon.ns_flops(8, 32) == muon.ns_flops(32, 8) == 46_080
    assert cost("gather") == 1 + 3 * 256 / 2 * 4 + 3 * 46_080
    assert cost("gram") == 6 + 3 * (5 * 64 + 1) * 4 + 3 * 5 * (4 * 64 * 16 + 2 * 512)
    assert cost("owner") == 2 + 3 * 256 * 2 / 4 * 4 + 2 * 46_080


def test_auto_mode_takes_the_path_of_least_modelled_cost():
    """choose_mode: small pieces on gloo's link gather (one collective against two or six); wide
    pieces (r = 8 of a 4096-wide matrix) on a link with no latency take the r×r Gram path; pieces
    cut along their short side (the Gram path gathers them) go to their owners where the
    products are slow; the line gives every path's cost; nothing cut over TP gathers, silently."""
    def cut(r, n, k, dim=1):
        return lambda mode: {"A": [muon.Piece(i * r, r, (k * r, n // 2), dim, 2, prefer=mode)
                                   for i in range(k)]}
    mode, said = muon.choose_mode(cut(8, 32, 3), cuda=False)
    assert mode == "gather" and "gram 0.3" in said and "α 50 µs, 1 GB/s, 0.05 TFLOP/s" in said, said
    mode, said = muon.choose_mode(cut(8, 4096, 3), cuda=False, alpha_us=1e-3)
    assert mode == "gram" and said.startswith("muon: gram over TP"), said
    assert muon.choose_mode(cut(8, 32, 4, dim=0), cuda=True)[0] == "gather"
    mode, said = muon.choose_mode(cut(8, 32, 4, dim=0), cuda=True, tflops=1e-9)
    assert mode == "owner" and "gather" in said and "owner" in said, said
    whole = lambda mode: {"A": [muon.Piece(0, 8, (8, 32), None, 2, prefer=mode)]}
    assert muon.choose_mode(whole, cuda=False) == ("gather", "")


def saved(path):
    """A checkpoint's tensors under their single-device names (DCP's own converter)."""
    import tempfile
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, f"{tmp}/whole.pt")
        return torch.load(f"{tmp}/whole.pt", weights_only=True)


@pytest.mark.slow
def test_train_py_muon_dp_shard_and_pp2_tp2_equal_one_process_and_resume(tmp_path, data_dir):
    """--optimizer=muon through train.py equals one process: 3 steps at dp=2 under --dp_shard=full,
    resumed from its dp shards at pp2 × tp2 (btp) for 3 more; one process's checkpoint resumed into
    dp shards; every parameter after 6 steps as one process's; and one process resumed exactly (the
    momentum buffers saved and loaded, resharded each time)."""
    common = [f"--data_dir={data_dir}", *TINY, "--optimizer=muon", "--max_iters=6", "--eval_interval=3",
              "--lr_decay_iters=6", "--gradient_accumulation_steps=2", "--batch_size=2"]
    one = losses(run_train(tmp_path / "one", data_dir, *common[1:]))
    run_train(tmp_path / "half", data_dir, *common[1:], "--max_iters=3")

    def check(name, want, params=True):
        torch.testing.assert_close(torch.tensor(losses(metrics(tmp_path / name))), torch.tensor(want), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"{name}: {m}")
        if not params:
            return
        mine, ref = (saved(tmp_path / n / "checkpoints" / "iter_0000006") for n in (name, "one"))
        assert mine.keys() == ref.keys() and any(k.startswith("optim.momentum_buffer.") for k in mine)
        for key in (k for k in ref if k.startswith("model.")):
            torch.testing.assert_close(mine[key], ref[key], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {key}: {m}")

    torchrun(2, f"--out_dir={tmp_path / 'shard'}", *common, "--dp_shard=full", "--max_iters=3")
    check("shard", one[:3], params=False)
    for name, nproc, source, extra in (("pp2tp2", 4, "shard", ["--pp=2", "--tp=2"]),
                                       ("into-shards", 2, "half", ["--dp_shard=full"])):
        shutil.copytree(tmp_path / source / "checkpoints", tmp_path / name / "checkpoints")
        torchrun(nproc, f"--out_dir={tmp_path / name}", *common, *extra, "--init_from=resume")
        check(name, one[3:])
    resumed = losses(run_train(tmp_path / "half", data_dir, *common[1:], "--init_from=resume"))
    assert resumed == one, (resumed, one)


def test_collectives_a_step_do_not_grow_with_the_layers():
    """bench.py optim's count at the papers' 1B and 7B CoLA shapes under BTP at tp=4 (meta device):
    14 matrices a layer (7 projections, A and B), one all-gather a step for all of them, or the Gram
    path's 6 all-reduces; before buckets the gather path issued one a matrix."""
    import sys
    from conftest import ROOT
    sys.path.insert(0, str(ROOT / "tools"))
    import bench_optim
    assert bench_optim.counts() == [["paper_1b", "gram", 14 * 24, 6, 6], ["paper_1b", "gather", 14 * 24, 14 * 24, 1],
                                    ["paper_7b", "gram", 14 * 32, 6, 6], ["paper_7b", "gather", 14 * 32, 14 * 32, 1]]


def _bf16_worker(tp_rank, world):
    """One step at tp=2 with Newton-Schulz in bf16 (a GPU's): the gathered and owned updates
    travel in bf16 (2 bytes an element in the ledger), and the parameters match one device's
    Muon in bf16."""
    mesh = placement.init_mesh(1, world, "cpu", 120)
    handle = parallel.TPGroup(mesh.get_group("tp"), mesh.get_local_rank("tp"), world)
    parallel.LEDGER.name(mesh.get_group("tp"), "tp")
    for arch, layout, prefer in [("cola", "btp", "gather"), ("full", "megatron", "owner")]:
        torch.manual_seed(0)
        ref = Llama(small(arch, lax=False))
        tp_model = TPLlama(copy.deepcopy(ref), handle, layout)
        opts = muon.configure(ref, tc_of()), muon.configure(tp_model, tc_of(), prefer)
        for o in opts:
            for g in o.param_groups:
                g["ns_dtype"] = torch.bfloat16
        idx = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
        for m, o in zip((ref, tp_model), opts):
            m(idx, idx)[1].backward()
            parallel.LEDGER.reset()
            o.step()
        sent = parallel.LEDGER.total("tp", "optim")
        assert sent > 0 and parallel.LEDGER.total("tp", "optim", unit="bytes") == 2 * sent
        full = tp_model.gather_full({n: p.detach() for n, p in tp_model.named_parameters()})
        for name, p in ref.named_parameters():   # (a few bf16 ulps of an update of 0.05)
            torch.testing.assert_close(full[name], p.detach(), rtol=0, atol=1e-3,
                                       msg=lambda m: f"{arch}/{prefer} {name}: {m}")
    dist.barrier()


def test_gathered_and_owned_updates_travel_in_newton_schulz_dtype():
    spawn(2, _bf16_worker)
