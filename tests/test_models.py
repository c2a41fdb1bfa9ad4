"""test_models.py: the papers' models by name (configs/*.toml), the options their configs need (the
MLP gate, tied embeddings), and checkpoints other tools read (interchange.py, plumbing/train_state.py
export/import). The tied and gate options under every TP layout are in test_parallel.py's
equivalence tests. Run: .venv/bin/python -m pytest -q
"""
import json
import shutil

import pytest
import torch
import torch.nn.functional as F

import interchange
import layouts
from model import Config, Llama
from plumbing import formats, options, train_state
from conftest import ROOT, TINY, expect_error, losses, metrics, run_train, torchrun

CONFIGS = ROOT / "configs"

# the authors' configurations (docs/design.md): (d, d_ff, heads, layers, r, gate, tied, block_size)
REFERENCE = {
    "cola_60m": (512, 1376, 8, 8, 128, "silu", False, 1024), "cola_130m": (768, 2048, 12, 12, 256, "silu", False, 1024),
    "cola_350m": (1024, 2736, 16, 24, 256, "none", False, 1024), "cola_1b": (2048, 5461, 32, 24, 512, "none", False, 1024),
    "cola_7b": (4096, 11008, 32, 32, 1024, "none", False, 1024),
    "boost_60m": (512, 1344, 8, 8, 128, "none", False, 4096), "boost_1b": (2048, 5472, 32, 24, 512, "none", True, 4096),
    "boost_7b": (4096, 11008, 32, 32, 1024, "none", True, 4096), "boost_test": (256, 768, 4, 2, 64, "none", False, 4096),
    "paper_1b": (2048, 5461, 32, 24, 512, "silu", False, 4096), "paper_3b": (3200, 8640, 32, 26, 800, "silu", False, 4096),
    "paper_7b": (4096, 11008, 32, 32, 1024, "silu", False, 4096),
    "paper_13b": (5120, 13824, 40, 40, 1280, "silu", False, 4096),
    "paper_30b": (6656, 17920, 52, 60, 1664, "silu", False, 4096),
    "lax_60m": (512, 1344, 8, 8, 128, "none", False, 4096), "lax_1b": (2048, 5472, 32, 24, 512, "none", True, 4096),
}


# ---------------------------------------------------------------------------- the presets

def test_every_preset_has_the_papers_shape():
    assert {p.stem for p in CONFIGS.glob("*.toml")} == set(REFERENCE) | {"default", "cola_quality_cpu"}
    for name, (d, f, h, layers, r, gate, tied, seq) in REFERENCE.items():
        cfg, tc = options.parse_args([str(CONFIGS / f"{name}.toml")])
        got = (cfg.n_embd, cfg.mlp_width, cfg.n_head, cfg.n_layer, cfg.attn_rank, cfg.mlp_gate, cfg.tie_embeddings,
               cfg.block_size)
        assert got == (d, f, h, layers, r, gate, tied, seq) and cfg.mlp_rank == r and cfg.norm_eps == 1e-6, name
        assert cfg.lax == name.startswith("lax_") and cfg.lax_gate == "kron", name
        cfg.vocab_size = 32000
        with torch.device("meta"):   # never allocates: the 7B-30B models are built as shapes only
            Llama(cfg)
    assert options.parse_args([str(CONFIGS / "default.toml")])[0] == options.parse_args([])[0]


def test_llama2_7b_preset_counts_like_llama2():
    cfg, _ = options.parse_args([str(CONFIGS / "paper_7b.toml")])
    cfg.vocab_size = 32000
    with torch.device("meta"):
        n = Llama(cfg).num_params()
    assert n == 6_738_415_616   # LLaMA-2 7B, as Hugging Face counts it
    cfg, _ = options.parse_args([str(CONFIGS / "paper_7b.toml"), "--arch=cola"])
    cfg.vocab_size = 32000
    with torch.device("meta"):
        assert 2.3 < n / Llama(cfg).num_params() < 2.7   # r = d/4: about 2.5 times fewer


def test_config_file_then_command_line(tmp_path):
    cfg, tc = options.parse_args([str(CONFIGS / "boost_60m.toml"), "--n_layer=2", "--learning_rate=1e-3"])
    assert (cfg.n_embd, cfg.n_layer, tc.learning_rate, tc.max_iters) == (512, 2, 1e-3, 2000)
    assert "train.py [config.toml]" in options.usage()


def test_config_file_errors(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    for text, fragment in [("n_layers = 2\n", f"{bad}: unknown option n_layers; did you mean --n_layer?"),
                           ('n_layer = "two"\n', f"{bad}: n_layer expects an integer, got 'two'"),
                           ("arch = \"dense\"\n", f"{bad}: arch=dense is not one of full, svd, cola"),
                           ("[model]\nn_layer = 2\n", f"{bad}: [model] is a section"), ("n_layer = [2]\n", "not a list"),
                           ("n_layer = \n", f"config file {bad} is not valid TOML"),
                           ("learning_rate = -1.0\n", "learning_rate=-1.0 must be positive")]:
        bad.write_text(text)
        expect_error(capsys, [str(bad), f"--out_dir={tmp_path / 'o'}"], fragment)
    expect_error(capsys, [str(tmp_path / "none.toml")], "cannot be read")
    expect_error(capsys, ["model.json"], "expected a config file (.toml) or --key=value")
    expect_error(capsys, ["--mlp_gate=relu"], "--mlp_gate=relu is not one of auto, silu, none")


def test_mlp_multiple_of_rounds_colas_1b_width_to_aligned_strides(capsys):
    """CoLA-1B's d_ff of 5461 (43·127) as the paper has it: misaligned bf16 strides, and no TP degree
    divides it; --mlp_multiple_of=32 makes it 5472 (tp up to 4 with slices a multiple of 8); a
    resumed or exported model keeps the rounded width (the rounding is idempotent)."""
    cola_1b = [str(CONFIGS / "cola_1b.toml")]
    assert options.parse_args(cola_1b)[0].mlp_width == 5461
    cfg = options.parse_args([*cola_1b, "--mlp_multiple_of=32"])[0]
    assert cfg.mlp_width == 5472 and Config(**cfg.shape()).shape() == cfg.shape()
    assert Config(mlp_width=5461, mlp_multiple_of=8).mlp_width == 5464
    with pytest.raises(ValueError, match="5461"):
        layouts.check_divisible(options.parse_args(cola_1b)[0], 4, "btp")
    layouts.check_divisible(cfg, 4, "btp")
    expect_error(capsys, ["--mlp_multiple_of=0"], "mlp_multiple_of=0 must be at least 1")


# ---------------------------------------------------------------------------- the gate and tied embeddings

def test_gate_option_on_every_arch():
    x = torch.randn(2, 5, 32)
    for arch in ("full", "svd", "cola"):
        torch.manual_seed(0)
        silu, none = (Llama(Config(arch=arch, n_layer=1, n_embd=32, n_head=4, vocab_size=64, mlp_gate=g)) for g in
                      ("silu", "none"))
        none.load_state_dict(silu.state_dict())
        mlp_s, mlp_n = silu.layers[0].mlp, none.layers[0].mlp
        out = lambda p, x: p(x)[0] if arch != "full" else p(x)   # a bottleneck returns (y, its latent)
        torch.testing.assert_close(mlp_s(x)[0], out(mlp_s.down, F.silu(out(mlp_s.gate, x)) * out(mlp_s.up, x)))
        torch.testing.assert_close(mlp_n(x)[0], out(mlp_n.down, out(mlp_n.gate, x) * out(mlp_n.up, x)))
    assert Config(arch="cola").mlp_gate == "none" and Config(arch="svd").mlp_gate == "silu"


def test_tied_gradient_is_the_sum_of_both_uses():
    torch.manual_seed(0)
    tied = Llama(Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, tie_embeddings=True))
    assert tied.lm_head.weight is tied.tok_emb.weight
    untied = Llama(Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64))
    untied.load_state_dict(tied.state_dict())
    idx = torch.randint(0, 64, (2, 8))
    tied(idx, idx)[1].backward()
    untied(idx, idx)[1].backward()
    torch.testing.assert_close(tied.tok_emb.weight.grad, untied.tok_emb.weight.grad + untied.lm_head.weight.grad)
    assert tied.num_params() == untied.num_params() - 64 * 32


@pytest.mark.slow
def test_tied_and_gate_train_alike_under_pp_and_resume_under_tp(tmp_path, data_dir):
    run = [f"--data_dir={data_dir}", *TINY, "--n_layer=4", "--max_iters=4", "--eval_interval=2", "--lr_decay_iters=4",
           "--batch_size=1", "--gradient_accumulation_steps=2", "--tie_embeddings=true", "--mlp_gate=silu"]
    single = losses(run_train(tmp_path / "one", data_dir, *run[1:]))
    torchrun(2, f"--out_dir={tmp_path / 'pp'}", *run, "--pp=2")
    torch.testing.assert_close(torch.tensor(losses(metrics(tmp_path / "pp"))), torch.tensor(single), rtol=1e-5, atol=1e-6)
    shutil.copytree(tmp_path / "pp" / "checkpoints" / "iter_0000002", tmp_path / "tp" / "checkpoints" / "iter_0000002")
    torchrun(2, f"--out_dir={tmp_path / 'tp'}", *run, "--tp=2", "--init_from=resume")
    torch.testing.assert_close(torch.tensor(losses(metrics(tmp_path / "tp"))), torch.tensor(single[2:]),
                               rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- export and import

def trained_checkpoint(tmp_path, data_dir, *extra):
    run_train(tmp_path, data_dir, "--max_iters=2", "--eval_interval=2", *extra)
    return train_state.checkpoint_dirs(tmp_path)[-1]


def logits_of(model, idx):
    model.eval()
    with torch.no_grad():
        return model(idx, idx)[0]


@pytest.mark.slow
@pytest.mark.parametrize("extra, fmt", [
    (["--arch=full"], "hf"), (["--arch=full", "--tie_embeddings=true"], "hf"), (["--arch=svd"], "hf"),
    (["--arch=cola", "--n_kv_head=4"], "cola"), (["--arch=cola", "--n_kv_head=4", "--mlp_gate=silu"], "cola"),
    (["--arch=cola", "--n_kv_head=4", "--tie_embeddings=true"], "cola"), (["--arch=svd", "--n_kv_head=4"], "pt")])
def test_export_import_round_trip(tmp_path, data_dir, extra, fmt):
    ckpt = trained_checkpoint(tmp_path / "run", data_dir, *extra)
    cfg, state, _ = interchange.checkpoint_state(ckpt)
    original = Llama(cfg)
    original.load_state_dict(state)
    out = tmp_path / f"exported.{fmt}"
    interchange.cli(["export", ckpt, str(out), f"--format={fmt}"])
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    if fmt == "pt":
        back = interchange.load_exported(str(out))[0]
    else:
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == {"hf": "llama", "cola": "cola"}[fmt] and config["boost_tokenizer"] == "bytes"
        path = interchange.import_folder(str(out), str(tmp_path / "imported"))
        back_cfg, back_state, _ = interchange.checkpoint_state(path)
        back = Llama(back_cfg)
        back.load_state_dict(back_state)
        assert back_cfg.arch == ("full" if fmt == "hf" else "cola")
    exact = cfg.arch != "svd" or fmt == "pt"   # svd leaves through hf merged: W = B·A, rounded differently
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits_of(back, idx), logits_of(original, idx), **tol)


def test_export_refuses_what_a_format_cannot_hold(tmp_path):
    for kw, fmt, fragment in [(dict(arch="cola", lax=True), "cola", "latents cross between layers"),
                              (dict(arch="svd"), "cola", "use --format=hf (its projections merged"),
                              (dict(arch="full"), "cola", "has no bottlenecks"),
                              (dict(arch="cola", n_kv_head=2), "cola", "no grouped-query attention"),
                              (dict(arch="cola", attn_rank=8, mlp_rank=16), "cola", "attn_rank=8, mlp_rank=16"),
                              (dict(arch="full", mlp_gate="none"), "hf", "has mlp_gate=none")]:
        cfg = Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, **kw)
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
            formats.write(tmp_path / "x", Llama(cfg).state_dict(), cfg, fmt, "bytes")
        assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_export_and_import_command_errors(capsys, tmp_path, data_dir):
    ckpt = trained_checkpoint(tmp_path / "run", data_dir, "--arch=cola")
    cases = [(["export", ckpt, str(tmp_path / "o"), "--format=cola"], "no grouped-query attention"),
             (["export", ckpt, str(tmp_path / "o"), "--format=onnx"], "invalid choice: 'onnx'"),
             (["import", str(tmp_path / "nothing"), str(tmp_path / "x")], "is not a model folder"),
             (["import", str(ROOT / "configs"), str(tmp_path / "x")], "is not a model folder")]
    interchange.cli(["export", ckpt, str(tmp_path / "pt")])
    for args, fragment in cases:   # the command in this process (its subprocess form: test_integrity.py)
        with pytest.raises(SystemExit) as exc:
            interchange.cli(args)
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and err.startswith("error: ") and "\n" not in err and fragment in err, err
    with pytest.raises(SystemExit):
        interchange.cli(["export", "-h"])
    out = capsys.readouterr().out
    out = " ".join(out.split())   # (argparse wraps the help)
    assert "hf: Hugging Face" in out and "trust_remote_code" in out and "cola: the official CoLA format" in out


@pytest.mark.slow
def test_imported_cola_model_trains_under_btp(tmp_path, data_dir):
    """A CoLA-format model (as trained elsewhere) imported, then continued at tp=2 like one process."""
    ckpt = trained_checkpoint(tmp_path / "run", data_dir, "--arch=cola", "--n_kv_head=4")
    cfg, state, _ = interchange.checkpoint_state(ckpt)
    formats.write(tmp_path / "cola", state, cfg, "cola", "bytes")
    for name in ("one", "tp2"):
        interchange.import_folder(str(tmp_path / "cola"), str(tmp_path / name))
    run = [f"--data_dir={data_dir}", *TINY, "--n_kv_head=4", "--max_iters=3", "--eval_interval=100", "--batch_size=2",
           "--gradient_accumulation_steps=2", "--init_from=resume"]
    torchrun(1, f"--out_dir={tmp_path / 'one'}", *run)
    torchrun(2, f"--out_dir={tmp_path / 'tp2'}", *run, "--tp=2")
    torchrun(1, f"--out_dir={tmp_path / 'scratch'}", *run[:-1])
    one, tp2 = losses(metrics(tmp_path / "one")), losses(metrics(tmp_path / "tp2"))
    assert len(one) == 3 and one[0] != losses(metrics(tmp_path / "scratch"))[0]   # the imported weights, not new ones
    torch.testing.assert_close(torch.tensor(tp2), torch.tensor(one), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- FLOPs, MFU and HFU

@pytest.mark.parametrize("arch,lax,gate,kv", [("full", False, "kron", 4), ("svd", False, "kron", 2),
                                              ("cola", False, "kron", 4), ("cola", True, "kron", 4),
                                              ("cola", True, "linear", 2), ("svd", True, "identity", 4)])
def test_flops_per_token_is_what_torch_counts(arch, lax, gate, kv):
    """Llama.flops_per_token (MFU's numerator) against torch's FlopCounterMode over a real forward
    and backward, at two shapes: within 1% (equal: every matmul 6 FLOPs a weight a token, LaX's
    gates, and attention with SDPA's math form, which counts the whole s×s as PaLM's formula does)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    for d, n_layer, s in ((64, 1, 32), (128, 2, 64)):
        cfg = Config(arch=arch, n_layer=n_layer, n_embd=d, n_head=4, n_kv_head=kv, block_size=s,
                     vocab_size=96, lax=lax, lax_gate=gate)
        torch.manual_seed(0)
        model = Llama(cfg)
        idx = torch.randint(0, 96, (2, s), generator=torch.Generator().manual_seed(0))
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(idx, idx)[1].backward()
        counted = counter.get_total_flops() / idx.numel()
        assert abs(model.flops_per_token(s) / counted - 1) < 0.01, (d, s, model.flops_per_token(s), counted)


def test_hfu_counts_what_recompute_replays(tmp_path, data_dir):
    """placement.hardware_flops_per_token: the model's FLOPs without recompute; with it, more, by
    less than a forward (a third of the total); the layer-wise replay more than the low-rank one. A
    run with --peak_tflops and --recompute logs both, hfu above mfu by that ratio."""
    from plumbing import placement
    cfg = Config(arch="cola", n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=96)
    with torch.device("meta"):
        model_flops = Llama(cfg).flops_per_token(cfg.block_size)
    hw = {rc: placement.hardware_flops_per_token(cfg, "btp", rc) for rc in ("none", "lowrank", "layer")}
    assert hw["none"] == model_flops
    assert model_flops < hw["lowrank"] < hw["layer"] < model_flops * 4 / 3, (hw, model_flops)
    records = run_train(tmp_path, data_dir, "--max_iters=2", "--recompute=layer", "--peak_tflops=1")
    r = [r for r in records if "loss" in r][-1]
    cfg_run = options.parse_args(list(TINY))[0]   # (the run's model)
    cfg_run.vocab_size = options.vocab_size("bytes")
    with torch.device("meta"):
        ratio = placement.hardware_flops_per_token(cfg_run, "btp", "layer") / \
            Llama(cfg_run).flops_per_token(cfg_run.block_size)
    assert r["hfu"] == pytest.approx(r["mfu"] * ratio) and r["hfu"] > r["mfu"]
