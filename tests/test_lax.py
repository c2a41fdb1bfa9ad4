"""test_lax.py: LaX's latent crossing (lax.py): the official code's formula, then every layout against
the single-device model (loss and every gradient) at TP 2 and 4 and dp x tp, each recompute mode and
gate; its collectives (none more under btp, vanilla's all-gathers) against the formulas; the
pipeline's boundary; resumed across layouts; its exports; its options.
"""
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from recompute import RECOMPUTE
import layouts
from ablations import ablated
from tp_model import TPLlama
import parallel
from plumbing.recorder import SavedBytes
from lax import factor_pair
from model import Bottleneck, Llama
from plumbing import placement, train_state
from conftest import (TINY, check_tp_step, command, expect_error, group_of_one, losses, metrics,
                      run_train, small_cfg,
                      spawn, torchrun)

GATES = ("kron", "linear", "identity")
CASES = [("cola", "btp", "kron"), ("svd", "btp", "linear"), ("cola", "vanilla", "kron"),
         ("svd", "vanilla", "identity"), ("cola", "vanilla", "linear"), ("cola", "btp", "identity")]


def official_pair(n):
    """The official code's most_balanced_factor_pair, read: the first divisor d (ascending) whose
    |d - n/d| is smallest, returned as (d, n/d)."""
    best, diff = (1, n), abs(n - 1)
    for d in (d for d in range(1, n + 1) if n % d == 0):
        if abs(d - n // d) < diff:
            best, diff = (d, n // d), abs(d - n // d)
    return best


def test_kron_gate_shape_is_the_official_pair():
    assert factor_pair(256) == (16, 16) and factor_pair(96) == (8, 12) and factor_pair(7) == (1, 7)
    for r in range(1, 400):
        assert factor_pair(r) == official_pair(r), r


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("arch", ["cola", "svd"])
def test_a_crossing_bottleneck_is_the_official_formula(arch, gate):
    """TensorizedLinear with two cores, InterRes and its gate, written out as the official code does
    it: x·A, + the gate of res_former (einsum 'abcd,de,cf->abfe' with res viewed (a, b), enc (b, b),
    dec (a, a)), LayerNorm(eps 1e-6), σ (LatentAct; none for svd), the latent passed on, then ·B."""
    torch.manual_seed(0)
    p = Bottleneck(48, 40, 24, arch, cross=gate)
    with torch.no_grad():   # weights away from their initial values, so that each one shows
        for t in p.cross.parameters():
            t.add_(torch.randn_like(t) * 0.3)
    x, res = torch.randn(3, 5, 48), torch.randn(3, 5, 24)
    z = x @ p.A.weight.T
    c = p.cross
    if gate == "kron":
        a, b = official_pair(24)
        g = torch.einsum("abcd,de,cf->abfe", res.reshape(-1, 1, a, b), c.E, c.D).reshape(z.shape)
    elif gate == "linear":
        g = res @ c.W.weight.T + c.W.bias
    else:
        g = res
    z = F.layer_norm(z + g, (24,), c.norm.weight, c.norm.bias, eps=1e-6)
    h = F.silu(z) if arch == "cola" else z
    y, h_out = p(x, res)
    torch.testing.assert_close(h_out, h)
    torch.testing.assert_close(y, h @ p.B.weight.T)


def test_layer_0_emits_and_later_layers_cross_each_projection_alone():
    cfg = small_cfg("cola", n_layer=3, lax=True)
    m = Llama(cfg)
    crossing = {n.split(".cross.")[0] for n, _ in m.named_parameters() if ".cross." in n}
    projections = ["attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down"]
    assert crossing == {f"layers.{i}.{p}" for i in (1, 2) for p in projections}
    # q's latent in layer 1 reads q's of layer 0 only: changing layer 0's k-latent changes k's, not q's or v's
    x = torch.randn(2, 16, cfg.n_embd)
    cos, sin = m.rope_cos, m.rope_sin
    _, lat = m.layers[0](x, cos, sin)
    changed = list(lat)
    changed[1] = changed[1] + 1.0
    (_, out), (_, out_changed) = m.layers[1](x, cos, sin, lat), m.layers[1](x, cos, sin, changed)
    torch.testing.assert_close(out[0], out_changed[0])
    torch.testing.assert_close(out[2], out_changed[2])
    assert not torch.allclose(out[1], out_changed[1])


def test_lax_options_and_counts(capsys, tmp_path):
    expect_error(capsys, [f"--out_dir={tmp_path}", "--lax=true", "--arch=full"], "lax=true", "arch=cola or arch=svd")
    expect_error(capsys, [f"--out_dir={tmp_path}", "--lax=true", "--lax_gate=tucker"], "lax_gate=tucker is not one of")
    base = Llama(small_cfg("cola", n_layer=3))
    for gate in GATES:
        m = Llama(small_cfg("cola", n_layer=3, lax=True, lax_gate=gate))
        ra, rm = 16, 24   # small_cfg's ranks: kron gates of 4 x 4 and 4 x 6
        per_layer = {"kron": 4 * (2 * ra + 4 ** 2 + 4 ** 2) + 3 * (2 * rm + 4 ** 2 + 6 ** 2),
                     "linear": 4 * (2 * ra + ra * ra + ra) + 3 * (2 * rm + rm * rm + rm),
                     "identity": 4 * 2 * ra + 3 * 2 * rm}[gate]
        assert m.num_params() - base.num_params() == 2 * per_layer, gate   # layers 1 and 2 cross
        gate_flops = {"kron": 4 * ra * (4 + 4) + 3 * rm * (4 + 6), "linear": 4 * ra * ra + 3 * rm * rm, "identity": 0}
        assert m.flops_per_token(16) - base.flops_per_token(16) == 6 * 2 * gate_flops[gate], gate


@pytest.mark.parametrize("gate", GATES)
def test_lax_recompute_one_device(gate):
    """At tp=1 (a TP group of one, as train.py trains) every recompute mode gives the reference's
    loss and gradients; the latents carried between layers are kept: (4·ra + 3·rm) more per token
    per layer under lowrank and layer."""
    cfg_of = lambda n: small_cfg("cola", n_layer=n, lax=True, lax_gate=gate)
    idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    runs, saved = {}, {}
    for mode in RECOMPUTE:
        for n in (2, 4):
            torch.manual_seed(0)
            m = group_of_one(Llama(cfg_of(n)), mode)
            with SavedBytes(m) as meter:
                loss = m(idx, idx)[1]
            loss.backward()
            saved[(mode, n)] = meter.bytes
            if n == 4:
                runs[mode] = (loss.detach(), m.full_tensors(grads=True))
    torch.manual_seed(0)
    ref = Llama(cfg_of(4))
    ref_loss = ref(idx, idx)[1]
    ref_loss.backward()
    runs["reference"] = (ref_loss.detach(), {k: p.grad for k, p in ref.named_parameters()})
    for mode in ("none", "layer", "lowrank"):
        torch.testing.assert_close(runs[mode][0], runs["reference"][0])
        for k, g in runs[mode][1].items():
            torch.testing.assert_close(g, runs["reference"][1][k], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{mode} {k}: {m}")
    per_layer = {mode: (saved[(mode, 4)] - saved[(mode, 2)]) / 2 / idx.numel() for mode in RECOMPUTE}
    lat = 4 * 16 + 3 * 24
    assert per_layer["lowrank"] == (4 * 16 + 3 * 24 + 2 + 2 * 64 + lat) * 4, per_layer   # btp, t=1
    assert per_layer["layer"] == (64 + lat) * 4, per_layer


def _equivalence_worker(rank, world, meshes, every_mode=True):
    for dp, tp in meshes:
        mesh = placement.init_mesh(dp, tp, "cpu", 120)
        handle = parallel.TPGroup(mesh.get_group("tp"), mesh.get_local_rank("tp"), tp, overlap=True)
        dp_rank = mesh.get_local_rank("dp")
        modes = RECOMPUTE   # (every mode with every case, or each case with one mode in turn)
        pairs = [(c, m) for c in CASES for m in modes] if every_mode else \
            [(c, modes[i % len(modes)]) for i, c in enumerate(CASES)]
        # an ablated BTP layer (tools/ablations.py) extended alike: the mixin sits before any class
        pairs += [(("cola", "btp", "kron", options), modes[-1 - i]) for i, options in
                  enumerate(({"online_norm": False}, {"grouped": False}))] if tp == 2 else []
        for (arch, layout, gate, *options), recompute in pairs:
            where = f"{arch}/{layout} gate={gate} {options} recompute={recompute} dp={dp} tp={tp}"
            torch.manual_seed(0)
            ref = Llama(small_cfg(arch, n_layer=3, lax=True, lax_gate=gate))
            idx = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
            logits, loss = ref(idx, idx)
            loss.backward()
            block = ablated(**options[0]) if options else None
            tp_model = TPLlama(ref, handle, layout, recompute=recompute, block=block)
            model = DDP(tp_model, process_group=mesh.get_group("dp")) if dp > 1 else tp_model
            share = slice(dp_rank * 4 // dp, (dp_rank + 1) * 4 // dp)
            tp_logits, tp_loss = model(idx[share], idx[share])
            tp_loss.backward()
            check_tp_step(ref, logits, loss, tp_model, tp_logits, tp_loss, handle, mesh.get_group("dp"), share, where)
        dist.barrier()


def test_lax_tp2_equals_single_device():
    spawn(2, _equivalence_worker, [(1, 2)], False)   # (each case with one recompute mode in turn)


@pytest.mark.slow
def test_lax_tp2_every_case_with_every_recompute_mode():
    spawn(2, _equivalence_worker, [(1, 2)])


@pytest.mark.slow
def test_lax_tp4_and_dp2_tp2_equal_single_device():
    spawn(4, _equivalence_worker, [(1, 4), (2, 2)], False, timeout=600)   # (every mode with every case: tp=2)


def _ledger_worker(rank, world, out):
    tp = parallel.TPGroup(dist.group.WORLD, rank, world)
    parallel.LEDGER.name(dist.group.WORLD, "tp")
    b, s = 2, 16
    for arch, layout, gate in CASES:
        totals = {}
        for lax_on in (False, True):
            for n_layer in (2, 4):
                torch.manual_seed(0)
                cfg = small_cfg(arch, n_layer, lax=lax_on, lax_gate=gate)
                model = TPLlama(Llama(cfg), tp, layout)
                idx = torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(1))
                parallel.LEDGER.reset()
                model(idx, idx)[1].backward()
                totals[(lax_on, n_layer)] = [parallel.LEDGER.total("tp", "fwd"), parallel.LEDGER.total("tp", "bwd"),
                                             parallel.LEDGER.total("tp", unit="calls")]
        per_layer = [(totals[(True, 4)][i] - totals[(True, 2)][i]) // 2 for i in range(3)]
        fwd, bwd, calls = layouts.per_layer_traffic(layout, cfg)
        assert per_layer == [fwd * b * s, bwd * b * s, calls], (arch, layout, gate, per_layer)
        lat = (4 * cfg.attn_rank + 3 * cfg.mlp_rank) * b * s
        extra = [t - u for t, u in zip(totals[(True, 2)], totals[(False, 2)])]   # two layers, LaX minus CoLA
        # btp: not one element more. vanilla: both layers gather their latents, layer 1 all-reduces their gradient
        assert extra == ([0, 0, 0] if layout == "btp" else [2 * lat, lat, 4 * 2 + 4]), (arch, layout, extra)
        out[f"{arch}/{layout}"] = per_layer


@pytest.mark.slow
def test_lax_collectives_equal_the_formulas():
    spawn(2, _ledger_worker, {})


def lax_run(arch="cola", layout="btp", gate="kron"):
    return [*TINY, f"--arch={arch}", "--lax=true", f"--lax_gate={gate}", "--n_layer=4", "--batch_size=2",
            "--gradient_accumulation_steps=2", "--eval_interval=100", "--max_iters=4"]


@pytest.mark.slow
@pytest.mark.parametrize("arch, layout, gate, extra", [   # (every recompute mode at TP 2 and 4: in-process above)
    ("cola", "btp", "kron", ["--pp=2", "--tp=2", "--recompute=lowrank"]), ("svd", "vanilla", "linear", ["--pp=2", "--tp=2"])])
def test_lax_train_py_equals_one_process(tmp_path, data_dir, arch, layout, gate, extra):
    """pp x tp and tp runs of train.py reproduce one process's losses; a stage boundary carries the
    residual slice and each projection's latent whole: (d/t or d) + 4·ra + 3·rm per token."""
    args = [f"--data_dir={data_dir}", *lax_run(arch, layout, gate)]
    single = losses(run_train(tmp_path / "one", data_dir, *args[1:]))
    torchrun(4 if "--pp=2" in extra else 2, f"--out_dir={tmp_path / 'par'}", *args, f"--layout={layout}", *extra)
    records = metrics(tmp_path / "par")
    torch.testing.assert_close(torch.tensor(losses(records)), torch.tensor(single), rtol=1e-5, atol=1e-6)
    if "--pp=2" in extra:
        d_local = 32 // 2 if layout == "btp" else 32
        per_token = d_local + 4 * 8 + 3 * 8   # TINY: n_embd 32, ranks n_embd/4
        # rank 0 is stage 0: per micro-batch one send forward; 2 micro-batches of 2 x 32 tokens, fp32
        assert records[0]["pp_bytes"] == 2 * 2 * 32 * per_token * 4, records[0]


@pytest.mark.slow
def test_lax_resumes_across_layouts_and_exports(tmp_path, data_dir):
    common = [f"--data_dir={data_dir}", *lax_run(), "--max_iters=8", "--eval_interval=4", "--lr_decay_iters=8"]
    straight = losses(run_train(tmp_path / "one", data_dir, *common[1:]))
    torchrun(2, f"--out_dir={tmp_path / 'btp'}", *common, "--max_iters=4", "--tp=2")
    for name, nproc, layout in (("vanilla", 2, ["--tp=2", "--layout=vanilla"]), ("tp1", 1, [])):
        shutil.copytree(tmp_path / "btp" / "checkpoints", tmp_path / name / "checkpoints")
        res = torchrun(nproc, f"--out_dir={tmp_path / name}", *common, "--init_from=resume", *layout)
        assert "resuming from" in res.stdout and "iter_0000004" in res.stdout
        torch.testing.assert_close(torch.tensor(losses(metrics(tmp_path / name))), torch.tensor(straight[4:]),
                                   rtol=1e-5, atol=1e-5, msg=lambda m: f"resumed at {name}: {m}")
    ckpt = train_state.checkpoint_dirs(tmp_path / "btp")[-1]
    import interchange
    assert command(interchange.cli, "export", ckpt, tmp_path / "model.pt") == (0, "")
    exported, _ = interchange.load_exported(str(tmp_path / "model.pt"))
    assert exported.cfg.lax and any(".cross." in n for n, _ in exported.named_parameters())
    code, err = command(interchange.cli, "export", ckpt, tmp_path / "cola", "--format=cola")   # (hf: test_hf_export)
    assert code == 2 and "latents cross between layers" in err and "--format=hf" in err, err
    assert not (tmp_path / "cola").exists()
