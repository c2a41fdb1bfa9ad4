"""test_boost.py: the tests of boost (pytest), on CPU, in float32.

Model shapes and counts, the data pipeline, the training loop (single process and torchrun data
parallel), resume, and every bad input's one-line error. Run: .venv/bin/python -m pytest -q
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpointing
import data
import kernels
import layouts
import parallel
import train
from model import Bottleneck, Config, Llama

ROOT = Path(__file__).resolve().parent
SHARED_CACHE = ROOT.parent / "shared" / "tiktoken_cache"
if "TIKTOKEN_CACHE_DIR" not in os.environ and SHARED_CACHE.is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED_CACHE)

TINY = ["--n_layer=2", "--n_head=4", "--n_kv_head=2", "--n_embd=32", "--block_size=32",
        "--batch_size=4", "--eval_iters=2", "--sample_tokens=0", "--warmup_iters=2", "--log_interval=1"]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """One prepared copy of the embedded corpus for the whole session."""
    d = tmp_path_factory.mktemp("data")
    data.prepare(data.EMBEDDED, "bytes", d, log=lambda *a: None)
    return d


def run_train(out_dir, data_dir, *args):
    """train.main in this process; returns the metrics.jsonl records."""
    train.main([f"--out_dir={out_dir}", f"--data_dir={data_dir}", *TINY, *args])
    return [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]


def losses(records):
    return [r["loss"] for r in records if "loss" in r]


def torchrun(nproc, *args, timeout=300, launcher=(), check=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *launcher, str(ROOT / "train.py"), *args]
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / "train.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res


def metrics(out_dir):
    return [json.loads(x) for x in open(Path(out_dir) / "metrics.jsonl")]


# ---------------------------------------------------------------------------- model

def expected_params(cfg):
    """Hand formula: parameters of the model, per arch."""
    d, kv, f, V, L = cfg.n_embd, cfg.kv_dim, cfg.mlp_width, cfg.vocab_size, cfg.n_layer
    ra, rm = cfg.attn_rank, cfg.mlp_rank
    if cfg.arch == "full":
        layer = 2 * d * d + 2 * d * kv + 3 * d * f
    else:
        layer = (ra * d + d * ra) * 2 + (ra * d + kv * ra) * 2 + (rm * d + f * rm) * 2 + (rm * f + d * rm)
    return L * (layer + 2 * d) + 2 * V * d + d


@pytest.mark.parametrize("arch", ["full", "svd", "cola"])
@pytest.mark.parametrize("shape", [dict(n_embd=64, n_head=4, n_kv_head=2), dict(n_embd=96, n_head=6, attn_rank=16, mlp_rank=40)])
def test_param_and_flop_counts(arch, shape):
    cfg = Config(arch=arch, n_layer=3, vocab_size=128, block_size=48, **shape)
    m = Llama(cfg)
    n = expected_params(cfg)
    assert m.num_params() == n
    matmul = n - cfg.vocab_size * cfg.n_embd - (2 * cfg.n_layer + 1) * cfg.n_embd  # no embedding, no norms
    assert m.flops_per_token(48) == 6 * matmul + 12 * 3 * cfg.n_embd * 48


def test_cola_parameters_about_two_and_a_half_times_fewer():
    full, cola = (Llama(Config(arch=a, n_layer=1, n_embd=512, n_head=8, vocab_size=64)) for a in ("full", "cola"))
    per_layer = lambda m: sum(p.numel() for p in m.layers.parameters())
    assert 2.3 < per_layer(full) / per_layer(cola) < 2.7   # boost-notes §1: 12·d² vs ≈4.8·d²


def test_cola_init_std():
    b = Bottleneck(1024, 2048, 256, "cola")
    expected = 256 ** -0.25 * 3072 ** -0.25
    for w in (b.A.weight, b.B.weight):
        assert abs(w.std().item() - expected) / expected < 0.02
    product_var = (b.B.weight @ b.A.weight).var().item()
    assert abs(product_var * 3072 - 1) < 0.05


def test_svd_layer_equals_dense_product():
    b = Bottleneck(24, 40, 8, "svd")
    dense = nn.Linear(24, 40, bias=False)
    dense.weight.data = b.B.weight @ b.A.weight
    x = torch.randn(3, 5, 24)
    torch.testing.assert_close(b(x), dense(x))
    cola = Bottleneck(24, 40, 8, "cola")
    torch.testing.assert_close(cola(x), torch.nn.functional.silu(x @ cola.A.weight.T) @ cola.B.weight.T)


@pytest.mark.parametrize("arch", ["full", "svd", "cola"])
def test_causality(arch):
    torch.manual_seed(0)
    m = Llama(Config(arch=arch, n_layer=2, n_embd=32, n_head=4, n_kv_head=2, vocab_size=64, block_size=16))
    idx = torch.randint(0, 64, (2, 16))
    logits, _ = m(idx, idx)
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 64
    logits2, _ = m(changed, changed)
    torch.testing.assert_close(logits[:, :10], logits2[:, :10])
    assert not torch.allclose(logits[:, 10:], logits2[:, 10:])


def test_generate_extends():
    m = Llama(Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=8))
    out = m.generate(torch.zeros(1, 3, dtype=torch.long), 12, top_k=5)
    assert out.shape == (1, 15) and out.max() < 64


# ---------------------------------------------------------------------------- data

def test_bytes_tokenizer_round_trip():
    enc = data.get_tokenizer("bytes")
    text = "héllo wörld\n\tdef f(x): return x ** 2  # ünïcode ✓"
    ids = enc.encode_ordinary(text)
    assert ids == list(text.encode("utf-8")) and enc.decode(ids) == text
    assert enc.n_vocab == 257 and enc.eot_token == 256


def test_gpt2_tokenizer_round_trip():
    if "TIKTOKEN_CACHE_DIR" not in os.environ:
        pytest.skip("no offline tiktoken cache (../shared/tiktoken_cache)")
    enc = data.get_tokenizer("gpt2")
    assert enc.encode("hello world") == [31373, 995] and enc.n_vocab == 50257
    text = "BOOST trains low-rank LLMs.\n  Indented ünïcode."
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_prepare_reuses_and_reprepares(tmp_path):
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text("alpha beta gamma " * 200)
    (src / "b.bin").write_bytes(bytes(range(256)) * 4)  # not UTF-8: skipped
    messages = []
    out = data.prepare(str(src), "bytes", tmp_path / "d", log=messages.append)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train_tokens"] + meta["val_tokens"] == 17 * 200 + 1 and meta["vocab_size"] == 257
    assert len(messages) == 1
    data.prepare(str(src), "bytes", tmp_path / "d", log=messages.append)
    assert len(messages) == 1  # reused
    (src / "a.txt").write_text("delta " * 300)
    os.utime(src / "a.txt", ns=(1, 1))
    data.prepare(str(src), "bytes", tmp_path / "d", log=messages.append)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train_tokens"] + meta["val_tokens"] == 6 * 300 + 1 and "changed" in messages[1]


def test_batches_deterministic_and_shared(data_dir):
    folder = data.prepared_dir(data.EMBEDDED, "bytes", data_dir)
    tokens = data.TokenFile(folder, "train", 16)
    x, y = tokens.batch(7, "train", 3, 8, 0, 8)
    assert x.shape == (8, 16) and torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = tokens.batch(7, "train", 3, 8, 0, 8)
    assert torch.equal(x, x2)
    parts = [tokens.batch(7, "train", 3, 8, start, 2)[0] for start in (0, 2, 4, 6)]
    assert torch.equal(torch.cat(parts), x)   # shares of the global batch tile it exactly
    assert not torch.equal(tokens.batch(7, "train", 4, 8, 0, 8)[0], x)


# ---------------------------------------------------------------------------- training

def test_short_run_lowers_loss_below_unigram_entropy(tmp_path, data_dir):
    records = run_train(tmp_path, data_dir, "--max_iters=60", "--eval_interval=60", "--learning_rate=1e-2")
    entropy = data.unigram_entropy(data.prepared_dir(data.EMBEDDED, "bytes", data_dir))
    assert records[-1]["val_loss"] < entropy < records[0]["val_loss"]
    assert all({"iter", "loss", "lr", "ms", "tokens_per_s"} <= r.keys() for r in records[:-1])


def test_resume_reproduces_uninterrupted_run(tmp_path, data_dir):
    common = ["--max_iters=8", "--eval_interval=4", "--lr_decay_iters=8", "--arch=svd"]
    straight = losses(run_train(tmp_path / "a", data_dir, *common))
    run_train(tmp_path / "b", data_dir, *common[1:], "--max_iters=4")
    resumed = run_train(tmp_path / "b", data_dir, *common, "--init_from=resume")
    assert len(straight) == 8
    assert losses(resumed) == straight  # iterations 0-3 from the first run, 4-7 resumed: bit for bit


def test_data_parallel_equals_single_process(tmp_path, data_dir):
    common = [f"--data_dir={data_dir}", *TINY, "--max_iters=4", "--eval_interval=100",
              "--gradient_accumulation_steps=4", "--batch_size=2"]
    single = losses(run_train(tmp_path / "one", data_dir, *common[1:]))
    torchrun(2, f"--out_dir={tmp_path / 'two'}", *common)
    double = losses([json.loads(x) for x in open(tmp_path / "two" / "metrics.jsonl")])
    assert len(single) == 4
    torch.testing.assert_close(torch.tensor(double), torch.tensor(single), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- bad input

def expect_error(capsys, argv, *fragments):
    with pytest.raises(SystemExit) as exc:
        train.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for fragment in fragments:
        assert fragment in err, err


@pytest.mark.parametrize("argv, fragments", [
    (["--max_iter=5"], ["unknown option --max_iter", "--max_iters"]),
    (["--lerning_rate=1"], ["did you mean --learning_rate"]),
    (["--n_layer=two"], ["--n_layer expects an integer", "'two'"]),
    (["--compile=maybe"], ["--compile expects true or false"]),
    (["max_iters=3"], ["expected --key=value"]),
    (["--arch=dense"], ["--arch=dense is not one of full, svd, cola"]),
    (["--attn_rank=200", "--n_embd=128"], ["attn_rank=200 is larger than the width n_embd=128"]),
    (["--n_embd=100", "--n_head=3"], ["n_embd=100 is not divisible by n_head=3"]),
    (["--n_head=4", "--n_kv_head=3"], ["n_head=4 is not divisible by n_kv_head=3"]),
    (["--batch_size=0"], ["batch_size=0 must be at least 1"]),
    (["--block_size=0"], ["block_size=0 must be at least 1"]),
    (["--dataset=/no/such/corpus"], ["dataset path /no/such/corpus does not exist"]),
    (["--arch=full", "--recompute=lowrank"], ["recompute=lowrank needs low-rank bottlenecks"]),
    (["--recompute=all"], ["--recompute=all is not one of none, layer, lowrank"]),
])
def test_bad_options(capsys, tmp_path, argv, fragments):
    expect_error(capsys, [f"--out_dir={tmp_path}", *argv], *fragments)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_bad_corpora(capsys, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "x.bin").write_bytes(b"\xff\xfe\x00" * 10)
    expect_error(capsys, [f"--out_dir={tmp_path / 'o'}", f"--data_dir={tmp_path / 'd'}", f"--dataset={empty}"],
                 "holds no UTF-8 text")
    short = tmp_path / "short.txt"
    short.write_text("too short " * 20)
    expect_error(capsys, [f"--out_dir={tmp_path / 'o'}", f"--data_dir={tmp_path / 'd'}", f"--dataset={short}"],
                 "fewer than block_size+1=129")


def test_bad_checkpoints(capsys, tmp_path, data_dir):
    out = [f"--out_dir={tmp_path}", f"--data_dir={data_dir}", *TINY]
    expect_error(capsys, [*out, "--init_from=resume"], "no complete checkpoint in")
    run_train(tmp_path, data_dir, "--max_iters=2", "--eval_interval=2", "--arch=cola")
    expect_error(capsys, [*out, "--init_from=resume", "--arch=full"], "written with arch=cola, this run has arch=full")
    expect_error(capsys, [*out, "--init_from=resume", "--mlp_rank=4"], "written with mlp_rank=8, this run has mlp_rank=4")
    expect_error(capsys, [*out, "--init_from=resume", "--n_embd=64"], "written with n_embd=32, this run has n_embd=64")
    expect_error(capsys, [*out[:1], f"--data_dir={tmp_path / 'gpt2data'}", *TINY, "--init_from=resume",
                          "--tokenizer=gpt2"], "written with vocab_size=320, this run has vocab_size=50304")
    ckpt = Path(checkpointing.checkpoint_dirs(tmp_path)[-1])
    metadata = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(b"\0" * len(metadata))  # same size, garbage
    expect_error(capsys, [*out, "--init_from=resume"], "unreadable or corrupt")
    (ckpt / ".metadata").write_bytes(metadata)
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    expect_error(capsys, [*out, "--init_from=resume"], "is truncated or corrupt", shard.name)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    expect_error(capsys, [f"--out_dir={blocker / 'out'}"], "cannot be written")


def test_help_lists_every_option(capsys):
    train.main(["-h"])
    out = capsys.readouterr().out
    for name in train.options():
        assert f"--{name}=" in out


# ---------------------------------------------------------------------------- tensor parallelism

def spawn(world, fn, *args, timeout=240):
    """Run fn(rank, world, *args) in `world` processes over gloo; re-raises a worker's failure."""
    import tempfile
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), fn, *args), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = __import__("time").time() + timeout
        while not ctx.join(timeout=5):
            if __import__("time").time() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__} did not finish in {timeout} s")


def _worker(rank, world, store, fn, *args):
    """One spawned process: a gloo group over a FileStore (no port), fn, then an orderly shutdown."""
    import datetime
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120),
                            store=dist.FileStore(store, world))
    fn(rank, world, *args)
    dist.barrier()
    dist.destroy_process_group()


TP_CASES = [("full", "megatron"), ("svd", "btp"), ("cola", "btp"), ("svd", "vanilla"), ("cola", "vanilla")]


def small_cfg(arch, n_layer=2):
    return Config(arch=arch, n_layer=n_layer, n_head=8, n_kv_head=4, n_embd=64, block_size=16,
                  vocab_size=128, attn_rank=16, mlp_rank=24)


def _equivalence_worker(rank, world, meshes):
    for dp, tp in meshes:
        mesh = parallel.init_mesh(dp, tp, "cpu", 120)
        env = parallel.TP(mesh.get_group("tp"), mesh.get_local_rank("tp"), tp)
        dp_rank = mesh.get_local_rank("dp")
        ablations = [("cola", "btp", {"online_norm": False}), ("svd", "btp", {"grouped": False})]
        for arch, layout, options in [(a, lay, {}) for a, lay in TP_CASES] + ablations:
            where = f"{arch}/{layout} {options} dp={dp} tp={tp}"
            cfg = small_cfg(arch)
            torch.manual_seed(0)
            ref = Llama(cfg)
            idx = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
            tgt = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(2))
            logits, loss = ref(idx, tgt)
            loss.backward()
            tp_model = layouts.TPLlama(ref, env, layout, **options)
            model = DDP(tp_model, process_group=mesh.get_group("dp")) if dp > 1 else tp_model
            share = slice(dp_rank * 4 // dp, (dp_rank + 1) * 4 // dp)
            tp_logits, tp_loss = model(idx[share], tgt[share])
            tp_loss.backward()
            v = cfg.vocab_size // tp
            torch.testing.assert_close(tp_logits, logits[share][..., env.tp_rank * v:(env.tp_rank + 1) * v],
                                       msg=lambda m: f"{where} logits: {m}")
            mean_loss = tp_loss.detach().clone()
            dist.all_reduce(mean_loss, group=mesh.get_group("dp"))
            torch.testing.assert_close(mean_loss / dp, loss.detach(), msg=lambda m: f"{where} loss: {m}")
            grads = tp_model.full_tensors(grads=True)
            assert grads.keys() == dict(ref.named_parameters()).keys()
            for name, p in ref.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{where} grad of {name}: {m}")
            full = tp_model.full_tensors()
            for name, p in ref.named_parameters():
                assert torch.equal(full[name], p.detach()), f"{where}: {name} does not unshard exactly"
            for name, spec in tp_model.named_specs():  # replicated parameters get identical gradients
                if spec.dim is None:
                    g = dict(tp_model.named_parameters())[name].grad
                    peers = [torch.empty_like(g) for _ in range(tp)]
                    dist.all_gather(peers, g, group=env.group)
                    assert all(torch.equal(peer, g) for peer in peers), f"{where}: {name} grads differ"
        dist.barrier()


def test_tp2_equals_single_device():
    spawn(2, _equivalence_worker, [(1, 2)])


def test_tp4_and_dp2_tp2_equal_single_device():
    spawn(4, _equivalence_worker, [(1, 4), (2, 2)])


def _collectives_worker(rank, world):
    g = dist.group.WORLD
    # Copy (f): identity forward, all-reduce backward, also of a non-contiguous gradient
    x = torch.full((4, 3), float(rank + 1), requires_grad=True)
    y = parallel.Copy.apply(x, g)
    assert torch.equal(y, x)
    grad = (torch.arange(12.0).view(3, 4) * (rank + 1)).t()
    assert not grad.is_contiguous()
    y.backward(grad)
    assert torch.equal(x.grad, torch.arange(12.0).view(3, 4).t() * 3)
    # Reduce (g): all-reduce forward, identity backward
    x = torch.arange(6.0, requires_grad=True)
    y = parallel.Reduce.apply(x * (rank + 1), g)
    assert torch.equal(y, torch.arange(6.0) * 3)
    y.backward(torch.ones(6) * (rank + 5))
    assert torch.equal(x.grad, torch.ones(6) * (rank + 5) * (rank + 1))
    # Gather: all-gather forward, own slice backward
    x = torch.full((2, 3), float(rank + 1), requires_grad=True)
    y = parallel.Gather.apply(x, g)
    assert torch.equal(y, torch.tensor([[1.0] * 3 + [2.0] * 3] * 2))
    y.backward(torch.arange(12.0).view(2, 6).t().contiguous().t())
    assert torch.equal(x.grad, torch.arange(12.0).view(2, 6)[:, 3 * rank:3 * rank + 3])
    # vocab-parallel cross-entropy equals F.cross_entropy on the full logits
    torch.manual_seed(0)
    logits = torch.randn(5, 8, requires_grad=True)
    target = torch.tensor([0, 3, 4, 7, 5])
    torch.nn.functional.cross_entropy(logits, target, reduction="none").mul(torch.arange(1.0, 6)).sum().backward()
    local = logits.detach()[:, 4 * rank:4 * rank + 4].clone().requires_grad_()
    loss = parallel.VocabParallelCrossEntropy.apply(local, target, g)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits.detach(), target, reduction="none"))
    loss.mul(torch.arange(1.0, 6)).sum().backward()
    torch.testing.assert_close(local.grad, logits.grad[:, 4 * rank:4 * rank + 4])


def test_collectives_forward_and_backward():
    spawn(2, _collectives_worker)


def ledger_per_layer(layout, cfg, tokens):
    """Elements per layer per the docstrings of parallel.py: (forward, backward)."""
    d, f, kv, ra, rm = cfg.n_embd, cfg.mlp_width, cfg.kv_dim, cfg.attn_rank, cfg.mlp_rank
    per_token = {"btp": ((3 * ra + 1) + ra + (2 * rm + 1) + rm, 3 * ra + ra + 2 * rm + rm),
                 "vanilla": (d + 2 * kv + d + 2 * f + d, 3 * d + d + 2 * d + f),
                 "megatron": (d + d, d + d)}[layout]
    return tuple(tokens * n for n in per_token)


def _ledger_worker(rank, world, result_file):
    env = parallel.TP(dist.group.WORLD, rank, world)
    parallel.LEDGER.name(dist.group.WORLD, "tp")
    b, s, out = 2, 16, {}
    for arch, layout in TP_CASES:
        totals = {}
        for n_layer in (2, 4):
            torch.manual_seed(0)
            cfg = small_cfg(arch, n_layer)
            model = layouts.TPLlama(Llama(cfg), env, layout)
            idx = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(1))
            parallel.LEDGER.reset()
            model(idx, idx)[1].backward()
            totals[n_layer] = (parallel.LEDGER.total("tp", "fwd"), parallel.LEDGER.total("tp", "bwd"))
        per_layer = tuple((totals[4][i] - totals[2][i]) // 2 for i in range(2))
        head = tuple(totals[2][i] - 2 * per_layer[i] for i in range(2))
        out[f"{arch}/{layout}"] = {"per_layer": per_layer, "head": head,
                                   "expected": ledger_per_layer(layout, cfg, b * s)}
        bsd = b * s * cfg.n_embd
        # outside the layers: btp all-gathers d before the final norm; all layouts all-reduce the
        # gradient of the normalised d before the vocab-parallel head, whose loss takes 3 all-reduces of b·s
        assert head == ((bsd if layout == "btp" else 0) + 3 * b * s, bsd), (layout, head)
    if rank == 0:
        Path(result_file).write_text(json.dumps(out))


def test_ledger_volumes_equal_formulas(tmp_path):
    spawn(2, _ledger_worker, str(tmp_path / "ledger.json"))
    for case, r in json.loads((tmp_path / "ledger.json").read_text()).items():
        assert tuple(r["per_layer"]) == tuple(r["expected"]), case


@pytest.mark.parametrize("arch, layout, nproc, dp, recompute", [
    ("cola", "btp", 2, 1, "none"), ("svd", "vanilla", 2, 1, "none"), ("full", "megatron", 2, 1, "layer"),
    ("cola", "btp", 4, 2, "lowrank")])
def test_tp_training_reproduces_single_device(tmp_path, data_dir, arch, layout, nproc, dp, recompute):
    common = [f"--data_dir={data_dir}", *TINY, "--max_iters=5", "--eval_interval=100", f"--arch={arch}",
              "--gradient_accumulation_steps=2", "--batch_size=2", f"--recompute={recompute}"]
    single = losses(run_train(tmp_path / "one", data_dir, *common[1:]))
    torchrun(nproc, f"--out_dir={tmp_path / 'tp'}", *common, "--tp=2", f"--tp_mode={layout}", f"--dp={dp}")
    records = [json.loads(x) for x in open(tmp_path / "tp" / "metrics.jsonl")]
    assert len(single) == 5 and all(r["tp_bytes"] > 0 for r in records if "loss" in r)
    torch.testing.assert_close(torch.tensor(losses(records)), torch.tensor(single), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world, argv, fragment", [
    (4, ["--tp=3"], "world size 4 is not dp × tp = 1 × 3"),
    (4, ["--tp=2", "--dp=3"], "world size 4 is not dp × tp = 3 × 2"),
    (2, [], "gradient_accumulation_steps=1 is not divisible by the 2 data-parallel ranks"),
    (2, ["--tp=2", "--n_head=3", "--n_embd=48", "--n_kv_head=1"], "tp=2 does not divide n_head=3"),
    (2, ["--tp=2", "--n_kv_head=1"], "tp=2 does not divide n_kv_head=1"),
    (4, ["--tp=4", "--n_embd=18", "--n_head=1"], "tp=4 does not divide n_embd=18"),
    (2, ["--tp=2", "--mlp_width=99"], "tp=2 does not divide mlp_width=99"),
    (2, ["--tp=2", "--tp_mode=vanilla", "--attn_rank=9"], "tp=2 does not divide attn_rank=9"),
    (2, ["--tp=2", "--tp_mode=megatron"], "tp_mode=megatron is the dense baseline"),
    (2, ["--tp=2", "--arch=full", "--tp_mode=btp"], "arch=full uses tp_mode=megatron"),
])
def test_bad_parallel_layouts(capsys, monkeypatch, tmp_path, world, argv, fragment):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    expect_error(capsys, [f"--out_dir={tmp_path}", *argv], fragment)



# ---------------------------------------------------------------------------- activation checkpointing

def lowrank_saved_per_token(layout, cfg, t, e=4):
    """checkpointing.py's docstring formula: bytes saved per token per layer with recompute=lowrank."""
    ra, rm, d = cfg.attn_rank, cfg.mlp_rank, cfg.n_embd
    return {"btp": 4 * (4 * ra + 3 * rm + 2) + 2 * d // t * e,
            "one": (4 * ra + 3 * rm + 2 * d) * e,
            "vanilla": (4 * ra // t + 3 * rm // t + 2 * d) * e}[layout]


def run_recompute(make_model, recompute, idx, n_layer):
    """(loss, {name: grad}, saved bytes, ledger counts of the backward) for one forward/backward."""
    model = make_model(n_layer)
    model.recompute = recompute
    with checkpointing.SavedBytes(model) as meter:
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
    saved = {mode: [run_recompute(make_model, mode, idx, n)[2] for n in (2, 4)] for mode in checkpointing.RECOMPUTE}
    per_layer = {mode: (v[1] - v[0]) / 2 / tokens for mode, v in saved.items()}
    assert per_layer["lowrank"] == lowrank_saved_per_token(layout, cfg, t), (layout, per_layer)
    assert per_layer["layer"] == (cfg.n_embd // t if layout == "btp" else cfg.n_embd) * 4, (layout, per_layer)
    assert per_layer["layer"] < per_layer["lowrank"] < per_layer["none"] / 2
    return ref


@pytest.mark.parametrize("arch", ["svd", "cola"])
@pytest.mark.parametrize("size", [dict(n_embd=64, attn_rank=16, mlp_rank=24), dict(n_embd=96, n_head=6, n_kv_head=3, attn_rank=12, mlp_rank=20)])
def test_recompute_one_device(arch, size):
    cfg_of = lambda n: Config(**{**dict(n_head=8, n_kv_head=4, block_size=16, vocab_size=128), **size,
                                 "arch": arch, "n_layer": n})
    def make_model(n_layer):
        torch.manual_seed(0)
        return Llama(cfg_of(n_layer))
    idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    check_recompute(make_model, "one", cfg_of(2), 1, idx)


def test_recompute_flops_lowrank_below_layer():
    from torch.utils.flop_counter import FlopCounterMode
    idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    flops = {}
    for mode in checkpointing.RECOMPUTE:
        torch.manual_seed(0)
        model = Llama(small_cfg("cola", 4), recompute=mode)
        with FlopCounterMode(display=False) as counter:
            model(idx, idx)[1].backward()
        flops[mode] = counter.get_total_flops()
    recompute = {mode: flops[mode] - flops["none"] for mode in ("layer", "lowrank")}
    assert 0 < recompute["lowrank"] < recompute["layer"], flops


def _recompute_worker(rank, world):
    env = parallel.TP(dist.group.WORLD, rank, world)
    parallel.LEDGER.name(dist.group.WORLD, "tp")
    for layout, size in (("btp", dict(n_embd=64, attn_rank=16, mlp_rank=24)),
                         ("btp", dict(n_embd=128, attn_rank=32, mlp_rank=32)),
                         ("vanilla", dict(n_embd=64, attn_rank=16, mlp_rank=24))):
        cfg_of = lambda n: Config(**{**dict(n_head=8, n_kv_head=4, block_size=16, vocab_size=128), **size,
                                     "arch": "cola", "n_layer": n})
        def make_model(n_layer):
            torch.manual_seed(0)
            return layouts.TPLlama(Llama(cfg_of(n_layer)), env, layout)
        idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        ref = check_recompute(make_model, layout, cfg_of(2), world, idx)
        backward = {mode: run_recompute(make_model, mode, idx, 2)[3] for mode in ("lowrank", "layer")}
        if layout == "btp":   # communication-free: the backward issues exactly the collectives of none
            assert backward["lowrank"] == ref[3], (backward["lowrank"], ref[3])
        replayed = {k: v for k, v in backward["layer"].items() if k[2] == "fwd"}
        assert replayed and {k: v for k, v in backward["layer"].items() if k[2] == "bwd"} == ref[3]
        if layout == "vanilla":  # its segments hold the all-reduces of the B outputs: recompute replays them
            assert any(k[2] == "fwd" for k in backward["lowrank"])


def test_recompute_tp2_btp_and_vanilla():
    spawn(2, _recompute_worker)



# ---------------------------------------------------------------------------- Triton kernels (interpreter on CPU)

# bf16 keeps 8 bits of mantissa: compared in fp32 against the fp32 reference of the same inputs
KERNEL_TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=1e-2, atol=1e-2),
              torch.bfloat16: dict(rtol=4e-2, atol=4e-2)}


def triton_and_ref(fn, inputs, upstream):
    """Outputs and input gradients of fn under the Triton and the reference backend."""
    results = []
    for backend in ("triton", "torch"):
        kernels._backend = backend
        try:
            leaves = [t.detach().clone().requires_grad_() for t in inputs]
            outs = fn(*leaves)
            torch.autograd.backward(outs, upstream)
            results.append(([o.detach().float() for o in outs], [t.grad.float() for t in leaves]))
        finally:
            kernels._backend = "torch"
    return results


def ref_in_fp32(fn, inputs, upstream):
    """The reference computed in fp32 from the same (rounded) inputs."""
    leaves = [t.detach().float().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    torch.autograd.backward(outs, [u.float() for u in upstream])
    return [o.detach() for o in outs], [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M, K, N", [(37, 50, 29), (64, 24, 97)])
def test_norm_down_kernel(dtype, M, K, N):
    g = torch.Generator().manual_seed(M + K + N)
    inputs = [torch.randn(M, K, generator=g).to(dtype), (1 + torch.rand(K, generator=g)).to(dtype),
              (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)]
    upstream = [torch.randn(M, N, generator=g).to(dtype), torch.randn(M, 1, generator=g)]
    (out, grads), _ = triton_and_ref(kernels.norm_down, inputs, upstream)
    ref_out, ref_grads = ref_in_fp32(kernels.norm_down_ref, inputs, upstream)
    for a, b in zip(out + grads, ref_out + ref_grads):
        torch.testing.assert_close(a, b, **KERNEL_TOL[dtype])
    again = triton_and_ref(kernels.norm_down, inputs, upstream)[0]
    assert all(torch.equal(a, b) for a, b in zip(out + grads, again[0] + again[1]))  # deterministic


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("widths, r", [((40, 20, 20), 12), ((33, 33), 18), ((70,), 5)])
def test_grouped_up_kernel(dtype, widths, r):
    g = torch.Generator().manual_seed(sum(widths) + r)
    M = 45
    inputs = [torch.randn(M, len(widths) * r, generator=g).to(dtype)] + \
             [(torch.randn(n, r, generator=g) / r ** 0.5).to(dtype) for n in widths]
    upstream = [torch.randn(M, n, generator=g).to(dtype) for n in widths]
    fn = lambda z, *Bs: kernels.grouped_up(z, list(Bs))
    (out, grads), _ = triton_and_ref(fn, inputs, upstream)
    ref_out, ref_grads = ref_in_fp32(lambda z, *Bs: kernels.grouped_up_ref(z, list(Bs)), inputs, upstream)
    for a, b in zip(out + grads, ref_out + ref_grads):
        torch.testing.assert_close(a, b, **KERNEL_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel(dtype):
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(2, 9, 48, generator=g).to(dtype), (1 + torch.rand(48, generator=g)).to(dtype)]
    upstream = [torch.randn(2, 9, 48, generator=g).to(dtype)]
    fn = lambda x, w: [kernels.rms_norm(x, w, 1e-5)]
    (out, grads), _ = triton_and_ref(fn, inputs, upstream)
    ref_out, ref_grads = ref_in_fp32(lambda x, w: [kernels.rms_norm_ref(x, w, 1e-5)], inputs, upstream)
    for a, b in zip(out + grads, ref_out + ref_grads):
        torch.testing.assert_close(a, b, **KERNEL_TOL[dtype])


def test_btp_training_with_triton_kernels_matches_torch(tmp_path, data_dir):
    common = [f"--data_dir={data_dir}", *TINY, "--max_iters=3", "--eval_interval=100", "--tp=2", "--batch_size=2"]
    runs = {}
    for backend in ("torch", "triton"):
        torchrun(2, f"--out_dir={tmp_path / backend}", *common, f"--kernels={backend}")
        runs[backend] = losses([json.loads(x) for x in open(tmp_path / backend / "metrics.jsonl")])
    assert len(runs["torch"]) == 3
    torch.testing.assert_close(torch.tensor(runs["triton"]), torch.tensor(runs["torch"]), rtol=1e-5, atol=1e-5)



# ---------------------------------------------------------------------------- training checkpoints

CKPT_RUN = ["--max_iters=8", "--eval_interval=4", "--lr_decay_iters=8", "--n_kv_head=4", "--batch_size=2",
            "--gradient_accumulation_steps=2"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_dir):
    """Losses of an uninterrupted 8-iteration single-process run."""
    return losses(run_train(tmp_path_factory.mktemp("straight"), data_dir, *CKPT_RUN))


def test_checkpoint_reshards_across_layouts(tmp_path, data_dir, straight):
    common = [f"--data_dir={data_dir}", *TINY, *CKPT_RUN]
    torchrun(2, f"--out_dir={tmp_path / 'tp2'}", *common, "--max_iters=4", "--tp=2")
    written = checkpointing.checkpoint_dirs(tmp_path / "tp2")
    assert [Path(d).name for d in written] == ["iter_0000004"]
    for name, nproc, layout in (("tp1", 1, []), ("tp4", 4, ["--tp=4"]), ("dp2tp2", 4, ["--tp=2", "--dp=2"])):
        shutil.copytree(tmp_path / "tp2" / "checkpoints", tmp_path / name / "checkpoints")
        res = torchrun(nproc, f"--out_dir={tmp_path / name}", *common, "--init_from=resume", *layout)
        assert "resuming from" in res.stdout and "iter_0000004" in res.stdout
        resumed = losses(metrics(tmp_path / name))
        assert len(resumed) == 4, name
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(straight[4:]), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"resumed at {name}: {m}")


def test_interrupted_save_keeps_previous_checkpoint(tmp_path, data_dir, straight):
    common = [f"--out_dir={tmp_path}", f"--data_dir={data_dir}", *TINY, *CKPT_RUN, "--max_iters=12"]
    res = torchrun(1, *common, "--inject_fault=kill_in_save:8", check=False)
    assert res.returncode != 0
    assert [Path(d).name for d in checkpointing.checkpoint_dirs(tmp_path)] == ["iter_0000004"]
    assert (tmp_path / "checkpoints" / "iter_0000008.tmp").is_dir()  # the half-written one, ignored
    (tmp_path / "metrics.jsonl").unlink()
    res = torchrun(1, *common[:-1], "--max_iters=8", "--init_from=resume")
    assert "resuming from" in res.stdout and "iter_0000004" in res.stdout
    assert losses(metrics(tmp_path)) == straight[4:]  # exact: same layout, same state


def test_killed_rank_restarts_and_finishes_like_uninterrupted(tmp_path, data_dir, straight):
    common = [f"--out_dir={tmp_path}", f"--data_dir={data_dir}", *TINY, *CKPT_RUN, "--init_from=auto"]
    res = torchrun(2, *common, "--inject_fault=kill:6", launcher=["--max-restarts=1"], timeout=400)
    assert "resuming from" in res.stdout and "iteration 4" in res.stdout
    records = metrics(tmp_path)
    assert [r["iter"] for r in records if "loss" in r] == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7]
    torch.testing.assert_close(torch.tensor(losses(records)[-4:]), torch.tensor(straight[4:]), rtol=1e-5, atol=1e-5)
    single = run_train(tmp_path / "one", data_dir, *CKPT_RUN)
    torch.testing.assert_close(torch.tensor(records[-1]["val_loss"]), torch.tensor(single[-1]["val_loss"]),
                               rtol=1e-5, atol=1e-5)


def test_non_finite_loss_stops_and_keeps_last_checkpoint(tmp_path, data_dir, straight):
    common = [f"--out_dir={tmp_path}", f"--data_dir={data_dir}", *TINY, *CKPT_RUN]
    res = torchrun(1, *common, "--inject_fault=nan:6", check=False)
    assert res.returncode == 2
    assert "not finite at iteration 6" in res.stderr and "iter_0000004) is untouched" in res.stderr
    assert [Path(d).name for d in checkpointing.checkpoint_dirs(tmp_path)] == ["iter_0000004"]
    (tmp_path / "metrics.jsonl").unlink()
    torchrun(1, *common, "--init_from=resume")
    assert losses(metrics(tmp_path)) == straight[4:]


def test_export_unsharded_and_generate(tmp_path, data_dir):
    torchrun(2, f"--out_dir={tmp_path}", f"--data_dir={data_dir}", *TINY, *CKPT_RUN, "--max_iters=4", "--tp=2")
    ckpt = checkpointing.checkpoint_dirs(tmp_path)[-1]
    subprocess.run([sys.executable, str(ROOT / "checkpointing.py"), "export", ckpt, str(tmp_path / "model.pt")],
                   check=True, timeout=120, cwd=ROOT)
    exported, tokenizer = checkpointing.load_exported(str(tmp_path / "model.pt"))
    cfg, tc = train.parse_args([*TINY, *CKPT_RUN])
    cfg.vocab_size = 320
    direct = Llama(cfg)
    opt = train.configure_optimizer(direct, tc)
    checkpointing.load(ckpt, direct, opt, None)  # the sharded checkpoint read by one process
    assert tokenizer == "bytes"
    for (name, a), b in zip(exported.state_dict().items(), direct.state_dict().values()):
        assert torch.equal(a, b), name
    assert exported.generate(torch.zeros(1, 1, dtype=torch.long), 10).shape == (1, 11)


# ---------------------------------------------------------------------------- bench.py and the cost model

def test_cost_model_matches_model_and_ledger():
    import costmodel
    for name, sh in costmodel.SHAPES.items():
        cfg = Config(arch="cola", n_layer=sh.n_layer, n_embd=sh.n_embd, mlp_width=sh.mlp_width, n_head=sh.n_head,
                     n_kv_head=sh.n_kv_head, vocab_size=sh.vocab_size, block_size=4096)
        with torch.device("meta"):
            for arch, layout in (("cola", "btp"), ("full", "megatron")):
                cfg.arch = arch
                assert costmodel.flops_per_token(sh, layout, 4096) == Llama(cfg).flops_per_token(4096), (name, arch)
    cfg = small_cfg("cola")
    for layout in ("btp", "vanilla", "megatron"):  # the formulas the ledger test measured exactly
        assert costmodel.per_layer_volume(layout, cfg.n_embd, cfg.mlp_width, cfg.kv_dim, cfg.attn_rank,
                                          cfg.mlp_rank) == ledger_per_layer(layout, cfg, 1)
    text, out = costmodel.report()
    assert out["mean_abs_rel_error"] < 0.5 and "| 7B | 4 | 1 |" in text


def test_bench_runs_end_to_end(tmp_path):
    tiny = ["--n_embd=32", "--n_layer=2", "--n_head=4", "--block_size=16", "--batch_size=2", "--iters=1"]
    for what in (["layouts", "--tp=1,2", *tiny], ["traffic", "--n_embd=32", "--n_head=4"], ["model"]):
        res = subprocess.run([sys.executable, str(ROOT / "bench.py"), *what], cwd=tmp_path, capture_output=True,
                             text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert res.returncode == 0, res.stderr[-2000:]
        assert json.loads((tmp_path / f"bench-{what[0]}.json").read_text())
    assert "cola/btp recompute=lowrank" in (tmp_path / "bench-layouts.json").read_text()
