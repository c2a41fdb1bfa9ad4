"""test_tools.py: the tools run and agree with the core: the cost model's FLOPs equal model.py's, its
collectives are layouts.per_layer_traffic's, and every bench of tools/bench.py runs end to end.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import layouts
from model import Config, Llama
from conftest import ROOT, command, command_out


def test_cost_model_matches_model_and_ledger():
    import costmodel
    for name, sh in costmodel.SHAPES.items():
        cfg = Config(arch="cola", n_layer=sh.n_layer, n_embd=sh.n_embd, mlp_width=sh.mlp_width, n_head=sh.n_head,
                     n_kv_head=sh.n_kv_head, vocab_size=sh.vocab_size, block_size=4096)
        with torch.device("meta"):
            for arch, layout in (("cola", "btp"), ("full", "megatron")):
                cfg.arch = arch
                assert costmodel.flops_per_token(sh, layout, 4096) == Llama(cfg).flops_per_token(4096), (name, arch)
    # its collectives are the layouts' formulas (which the ledger test measures): a Shape reads as a Config
    sh = costmodel.Shape(2, 64, 176, 8, 4, 128, rank=16)
    cfg = Config(arch="cola", n_layer=2, n_embd=64, mlp_width=176, n_head=8, n_kv_head=4, vocab_size=128,
                 attn_rank=16, mlp_rank=16)
    for layout in layouts.LAYOUTS:
        assert costmodel.per_layer_traffic(layout, sh) == layouts.per_layer_traffic(layout, cfg), layout
    text, out = costmodel.report()
    assert out["mean_abs_rel_error"] < 0.5 and "| 7B | 4 | 1 |" in text


@pytest.mark.slow
def test_bench_runs_end_to_end(tmp_path):
    tiny = ["--n_embd=32", "--n_layer=2", "--n_head=4", "--block_size=16", "--batch_size=2", "--iters=1"]
    for what in (["traffic", "--n_embd=32", "--n_head=4"], ["model"]):   # (layouts: test_readme_commands)
        res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), *what, f"--json_dir={tmp_path / 'j'}"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert res.returncode == 0, res.stderr[-2000:]
        assert json.loads((tmp_path / "j" / f"bench-{what[0]}.json").read_text())
    import bench_comm
    from plumbing import options
    cfg, _ = options.parse_args(tiny[:-2])
    res = bench_comm.measure(1, 2, cfg, 2, 1)   # the comm bench's worker: every layout, three ways
    assert set(res) >= {(f"{a}/{lay}", mode) for a, lay in bench_comm.CASES for mode in bench_comm.MODES}
    assert all(v > 0 for v in res.values())
    import bench_optim   # (its train.py runs: bench_common.train_run, as dp_shard's)
    alone = bench_optim.step_alone(tiny[:-2], 1)
    assert set(alone) == set(bench_optim.CASES) and all(v > 0 for v in alone.values())
    at_tp2 = bench_optim.tp_step(tiny[:-2], 1)   # (each path at tp=2, and auto's modelled choice)
    assert all(at_tp2[m] > 0 for m in bench_optim.TP_MODES), at_tp2
    assert re.match(r"muon: (gram|gather|owner) over TP \(modelled ms a step: gram ", at_tp2["auto"])
    assert not list(tmp_path.glob("*.json"))  # nothing in the current directory
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "-h"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "bench.py layouts" in res.stdout


def test_every_bench_prints_its_help_and_runs_nothing(tmp_path, monkeypatch):
    import bench
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "ROOT", tmp_path)   # (where its results would go by default)
    for what in bench.BENCHES:   # (in this process: the usage is printed before anything is imported)
        code, out, err = command_out(bench.main, what, "-h")
        assert code == 0 and out.startswith(f"usage: python tools/bench.py {what} "), (what, err)
        assert f"python tools/bench.py {what} " in out.splitlines()[2]
    assert list(tmp_path.iterdir()) == []   # no corpus, no results: nothing ran
    code, err = command(bench.main, "nope")
    assert code == 2 and err.startswith("error: name one of archs")
    # --iters as given (10 included); unset, optim's runs 30 and every other bench's 10
    assert [bench.bench_args(w, a)[0] for w, a in (("optim", []), ("optim", ["--iters=10"]),
                                                    ("layouts", []), ("layouts", ["--iters=0"]))] \
        == [30, 10, 10, 0]


def test_gpu_check_step_runner_keeps_what_a_timed_out_step_printed():
    """gpu_check.py runs each step in its own process: lines echo as they come, a step past its
    timeout is killed (with what it started) and reported, and its earlier lines are kept."""
    import gpu_check
    seen = []
    hang = "import time; print('first result', flush=True); time.sleep(60)"
    t0 = __import__("time").time()
    status, result = gpu_check.run_step([sys.executable, "-c", hang], 3, seen.append)
    assert status == "timed out" and result is None and seen == ["  first result"]
    assert __import__("time").time() - t0 < 20
    seen.clear()   # a burst read in one chunk, then a hang: every line of it is logged, none held
    burst = "import sys, time; sys.stdout.write(''.join(f'line {i}\\n' for i in range(500))); " \
            "sys.stdout.flush(); time.sleep(60)"
    assert gpu_check.run_step([sys.executable, "-c", burst], 3, seen.append)[0] == "timed out"
    assert seen == [f"  line {i}" for i in range(500)], seen[-3:]
    done = "print('RESULT {\"failed\": 1}')"
    assert gpu_check.run_step([sys.executable, "-c", done], 30, seen.append) == ("failed", {"failed": 1})
    assert gpu_check.run_step([sys.executable, "-c", "raise SystemExit(3)"], 30, seen.append)[0] == "failed"


@pytest.mark.slow
def test_gpu_check_without_cuda_or_torch_is_one_line():
    """No CUDA device (this machine) and no --cpu, or no PyTorch at all: one line, exit 2, nothing run
    or written (it writes only under gpu-check/, which git ignores)."""
    script = str(ROOT / "tools" / "gpu_check.py")
    hide = f"import sys, runpy; sys.modules['torch'] = None; sys.argv = ['{script}']; " \
           f"sys.exit(runpy.run_path('{script}', run_name='__main__'))"
    for cmd, said in (([sys.executable, script], "error: no CUDA device here"),
                      ([sys.executable, "-c", hide], "error: gpu_check needs PyTorch")):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert res.returncode == 2 and res.stderr.startswith(said) and res.stderr.count("\n") == 1, res.stderr
        assert res.stdout == ""
    assert not (ROOT / "gpu-check.json").exists()
    assert "gpu-check/" in (ROOT / ".gitignore").read_text().split()


@pytest.mark.slow
def test_gpu_check_runs_its_steps_on_a_cpu(tmp_path):
    """The whole check, --cpu: its kernel step (interpreted), its training runs (reference and
    interpreted kernels, resumed, recompute=lowrank) and sample; the summary says each step's state."""
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--cpu", f"--json={tmp_path / 's.json'}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert {k: v["status"] for k, v in summary.items()} == {"env": "ok", "kernels": "ok", "train": "ok", "tp": "ok",
                                                            "bench": "skipped"}
    assert summary["kernels"]["passed"] == 16 and summary["kernels"]["failed"] == 0   # 12 ragged, 4 training's
    assert summary["env"]["launcher_build"].startswith("launcher build: C compiler ")
    assert summary["tp"]["failed"] == 0 and summary["tp"]["grad"] < 1e-4
    assert set(summary["train"]["compared"]) == {"triton-float32 vs torch-float32", "resumed-float32 vs triton-float32",
                                                 "lowrank-float32 vs triton-float32"}
    assert "summary: env ok; kernels ok; train ok; tp ok; bench skipped" in res.stdout
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]   # as they came
    assert {r["step"] for r in rows} == {"env", "kernels", "train", "tp", "bench"}
    assert sum("ok   float32" in r["line"] for r in rows) == 8 and [r["s"] for r in rows] == sorted(r["s"] for r in rows)
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "-h"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "--budget_s" in res.stdout


def test_fsdp_cost_model_orders_memory_and_time():
    import costmodel_fsdp
    sh = costmodel_fsdp.SHAPES["7B"]
    (m_none, t_none, c_none), (m_grad, t_grad, c_grad), (m_full, t_full, c_full) = \
        (costmodel_fsdp.plan(sh, 16, 4, s) for s in ("none", "grad", "full"))
    assert m_none > m_grad > m_full and t_grad == t_none and c_full == pytest.approx(1.5 * c_grad) and t_full > t_grad
    alone = costmodel_fsdp.plan(sh, 16, 1, "full")
    params = costmodel_fsdp.flops_per_token(sh, "btp", 0) / 6   # FSDP alone: the whole model over 16 ranks
    assert abs(alone[2] - 3 * 15 / 16 * params * 2 / costmodel_fsdp.HARDWARE["A100"].network) < 1e-9
    text, out = costmodel_fsdp.report()
    assert len(out) == 5 * 4 and "| 30B | BTP + DP (t=4, none) |" in text


def test_gpu_check_slots_fit_its_budget_and_say_what_builds_launchers(monkeypatch):
    """The steps' slots add up to the default budget or less (under 8 minutes); the env step's line
    names what Triton 3.6 builds its launchers with, or what is missing."""
    import shutil
    import gpu_check
    assert sum(gpu_check.STEPS.values()) <= 475 < 480 and list(gpu_check.STEPS)[-1] == "bench"
    assert gpu_check.launcher_build().startswith("launcher build: C compiler ")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert gpu_check.launcher_build().startswith("launcher build: MISSING a C compiler")


@pytest.mark.slow
def test_bench_layouts_says_a_few_steps_are_noise(monkeypatch):
    """At under 10 timed steps a variant the table says its times rank nothing (the workers'
    timings stand in: test_readme_commands runs the real ones)."""
    import bench

    def measured(world, names, cfg, batch, iters):
        return {n: {"ms": 1.0 + i, "tp_calls": 0, "tp_elements": 0, "tp_mb": 0.0, "saved_mb": 1.0}
                for i, n in enumerate(names)}
    monkeypatch.setattr(bench, "measure", measured)
    tiny = ["--n_embd=32", "--n_layer=2", "--n_head=4", "--block_size=16", "--batch_size=2"]
    assert "note: 2 timed step(s) a variant: the times below are noise" in \
        bench.bench_layouts(2, tiny, [1])[0]
    assert "noise" not in bench.bench_layouts(10, tiny, [1])[0]


def test_bench_gpu_puts_colas_steps_first_and_skips_what_would_pass_the_deadline(monkeypatch):
    """gpu_check's bench: CoLA's and the dense model's step rows (eager, compiled, captured) first,
    then the kernel rows, then svd's and d_ff 5461's eager rows; a row whose estimate (ROW_S) does
    not fit what is left is a line, not a row cut off (the measurements stood in for: they need
    CUDA)."""
    import time
    import bench_gpu
    rows, widths = [], []
    monkeypatch.setattr(bench_gpu, "matmul_peak", lambda device: 100.0)
    monkeypatch.setattr(bench_gpu, "head_ms", lambda cfg, device, tokens: 1.0)
    monkeypatch.setattr(bench_gpu, "train_step", lambda cfg, device, mode: (
        rows.append(f"{cfg.arch} {mode}"), widths.append(cfg.mlp_width),
        {"ms": 2.0, "tokens_per_s": 1.0, "peak_gb": 0.0, "estimate_gb": 0.0})[2])
    monkeypatch.setattr(bench_gpu, "measure_op", lambda op, shapes, flops, impl, device, dtype: (
        rows.append(f"kernel {op}"), {"fwd_ms": 1.0, "fwd_bwd_ms": 2.0})[1])
    text, _ = bench_gpu.run("cpu", n_layer=1, deadline=time.time() + 1000, compiled=("cola", "full"),
                            steps_first=True)
    steps = [r for r in rows if not r.startswith("kernel")]
    assert steps == ["cola eager", "cola compiled", "cola captured", "full eager", "full compiled",
                     "full captured", "svd eager", "cola eager", "cola eager"], rows
    assert rows.index("full captured") < rows.index("kernel norm_down") < rows.index("svd eager")
    assert widths[-2:] == [5461, 5464]   # CoLA-1B's d_ff, and rounded by --mlp_multiple_of=8
    assert "MFU denominators: measured 100 TFLOP/s, nominal ? TFLOP/s (cpu)" in text
    rows.clear()
    text, _ = bench_gpu.run("cpu", n_layer=1, deadline=time.time() + 50, compiled=("cola",), steps_first=True)
    assert "cola compiled" not in rows and "cola eager" in rows and "skipped cola compiled step: " in text
    assert bench_gpu.nominal_peak("NVIDIA H100 80GB HBM3") == 989.0


def test_quality_bench_places_the_crossing_and_its_interval():
    """bench_quality's arithmetic: the crossing interpolated between the evaluations around it (None
    when never reached, or when the curve starts below), the 95% interval by Student's t, the wall
    time up to a fractional step."""
    import statistics
    import bench_quality as q
    assert q.crossing([(0, 3.0), (50, 2.0), (100, 1.5)], 1.75) == 75.0
    assert q.crossing([(0, 3.0), (50, 2.0)], 2.0) == 50.0 and q.crossing([(0, 3.0), (50, 2.0)], 1.9) is None
    assert q.crossing([(0, 1.0), (50, 0.5)], 2.0) is None
    mean, half = q.interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.303 * statistics.stdev([1, 2, 3]) / 3 ** 0.5)
    assert q.interval([5.0]) == (5.0, 0.0)
    records = [{"iter": i, "ms": 10.0 * (i + 1)} for i in range(4)]
    assert q.wall_ms(records, 2.5) == 10 + 20 + 0.5 * 30
    # a run's row: half way to the target at step 1, its FLOPs by its own FLOPs per token, its
    # effective throughput by the first run's
    def run(tok_s, ms):
        return [{"iter": 0, "val_loss": 3.0}, {"iter": 0, "ms": ms, "tokens_per_s": tok_s},
                {"iter": 1, "ms": ms, "tokens_per_s": tok_s}, {"iter": 2, "val_loss": 1.0}]
    trained = {"dense": [run(100.0, 40.0)], "cola": [run(300.0, 20.0)]}
    rows = q.summarise(trained, trained, [2.0], 10, {"dense": 2e12, "cola": 1e12})
    assert rows["dense"]["steps"] == (1.0, 0.0) and rows["cola"]["flops"] == (10 * 1e12, 0.0)
    assert rows["dense"]["wall_s"] == (0.04, 0.0) and rows["cola"]["ratio"] == 0.5
    assert rows["dense"]["dense_eq_tflops"] == (200.0, 0.0)
    assert rows["cola"]["dense_eq_tflops"] == (600.0, 0.0)


@pytest.mark.slow
def test_quality_bench_end_to_end_at_a_toy_size(tmp_path):
    """Two tiny runs, one seed, two evaluations each (steps 0 and 2): the first run's target is its
    own val loss at its last step, which it reaches at step 2 exactly; the table and the figure."""
    import bench_quality as q
    shape = ["--n_layer=1", "--n_embd=32", "--n_head=4", "--block_size=16", "--batch_size=2",
             "--eval_iters=1", "--max_iters=2", "--warmup_iters=0"]
    runs = {"dense": ["--arch=full"], "cola": ["--arch=cola", "--learning_rate=3e-3"]}
    text, out = q.bench([f"--figure={tmp_path / 'q.png'}", "--seeds=1"], runs, shape, eval_every=2,
                        log=lambda *a: None)
    assert [len(c[0]) for c in out["curves"].values()] == [2, 2]
    assert out["target"] == out["curves"]["dense"][0][-1][1]
    assert out["summary"]["dense"]["steps"] == (2.0, 0.0) and out["summary"]["dense"]["ratio"] == 1.0
    assert "| dense | 1/1 | 2 ± 0 |" in text and (tmp_path / "q.png").stat().st_size > 10_000
    # effective throughput: every run's tokens/s at the dense model's FLOPs per token
    assert out["flops"]["cola"] < out["flops"]["dense"]
    for row in out["summary"].values():
        assert row["dense_eq_tflops"][0] > 0 and row["dense_eq_tflops"][1] == 0.0


def test_quality_figure_zooms_on_the_crossings():
    """Two curves that overlap near the target: the wall-time panel's inset spans both crossings
    and the curves' distance from the target there, so which crosses first shows; none: no inset."""
    import bench_quality as q
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    fig, ax = plt.subplots()
    curves = [([0, 10, 20, 30], [3.0, 2.0, 1.52, 1.40], "C0"),
              ([0, 10, 20, 30], [3.0, 2.1, 1.55, 1.45], "C1")]
    (x0, x1), (y0, y1) = q.zoom(ax, curves, [(19.0, "C0"), (21.0, "C1")], 1.5)
    assert x0 < 19.0 and x1 > 21.0 and x1 - x0 < 10   # (the full axis spans 30)
    assert y0 <= 1.45 and y1 >= 1.55 and y1 - y0 < 0.5   # (it spans 1.6)
    assert len(ax.child_axes) == 1 and q.zoom(ax, curves, [], 1.5) is None
    plt.close(fig)


def test_quality_bench_tiers_and_bad_input(capsys, tmp_path):
    """The GPU tier: CoLA-60M's shape, both runs, or the shape a config file names (the 130M's); it
    needs a corpus and says so, as does a bad option of train.py's, before any training (exit
    status 2, one line)."""
    import bench_quality as q
    from bench_common import shape_args
    from plumbing import options
    for name, args in q.RUNS_GPU.items():
        cfg, tc = options.parse_args(shape_args([*q.SHAPE_GPU, *args], []))
        assert (cfg.arch, cfg.n_embd, cfg.n_layer, cfg.mlp_width) == (name.replace("dense", "full"),
                                                                     512, 8, 1376)
        assert tc.batch_size * cfg.block_size == 16384 and tc.tp == 1
    (tmp_path / "corpus.txt").write_text("some text")
    parsed = q.plan(["--tier=gpu", str(ROOT / "configs" / "cola_130m.toml"),
                     f"--dataset={tmp_path / 'corpus.txt'}"], None, None)[-1]
    assert {name: (cfg.arch, cfg.n_embd, cfg.n_layer, tc.batch_size * cfg.block_size)
            for name, (cfg, tc) in parsed.items()} == {"dense": ("full", 768, 12, 16384),
                                                       "cola": ("cola", 768, 12, 16384)}
    for bad in (["--tier=gpu"], ["--tier=tpu"], ["--seeds=0"], ["--dataset=/nowhere"]):
        with pytest.raises(SystemExit) as e:
            q.bench(bad, log=lambda *a: None)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, bad


@pytest.mark.slow
def test_quality_sweep_at_a_toy_size(monkeypatch, capsys, tmp_path):
    """The recipe sweep: the recipes a --sweep=TEXT names, the best dense one's val loss at the
    target step the target, which it reaches there; a name no recipe holds is refused."""
    import bench_quality as q
    monkeypatch.setattr(q, "SHAPE", ["--n_layer=1", "--n_embd=32", "--n_head=4", "--block_size=16",
                                     "--batch_size=2", "--eval_iters=1", "--warmup_iters=0"])
    monkeypatch.setattr(q, "SWEEP", {"dense lr 1e-3": q.recipe("full", "1e-3", 2),
                                     "dense lr 2e-3": q.recipe("full", "2e-3", 2),
                                     "cola lr 3e-3": q.recipe("cola", "3e-3", 2, rank=4)})
    keep = [f"--keep_runs={tmp_path}"]
    text, out = q.sweep(["--sweep=dense", "--target_step=2", *keep], log=lambda *a: None)
    assert list(out["recipes"]) == ["dense lr 1e-3", "dense lr 2e-3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense_lr_1e-3-0.json", "dense_lr_2e-3-0.json"]
    said = []
    assert q.sweep(["--sweep=dense", "--target_step=2", *keep], log=said.append)[1] == out   # (kept)
    assert f"reused 2 record(s) from {tmp_path} (the same arguments, commit and corpus)" in said
    # a record made on another commit (or corpus) is trained again, and its file rewritten
    kept = tmp_path / "dense_lr_1e-3-0.json"
    record = json.loads(kept.read_text())
    assert set(record["key"]) == {"argv", "commit", "corpus"}
    kept.write_text(json.dumps({**record, "key": {**record["key"], "commit": "0" * 40}}))
    said.clear()
    q.sweep(["--sweep=dense", "--target_step=2", *keep], log=said.append)
    assert any("reused 1 record(s)" in line for line in said)
    assert json.loads(kept.read_text())["key"] == record["key"]
    # a kept file that is not a record: one line, before any training
    for bad in ("{not json", '{"key": {}, "records": "x"}', '{"key": {}, "records": [{"iter": "1"}]}',
                '[1, 2]', '{"key": {}, "records": [{"iter": 1, "val_loss": "low"}]}'):
        kept.write_text(bad)
        with pytest.raises(SystemExit) as e:
            q.sweep(["--sweep=dense", "--target_step=2", *keep], log=lambda *a: None)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"error: {kept} is not a kept run's record")
        assert err.count("\n") == 1
    best = min(r["at_step"][0] for r in out["recipes"].values())
    assert out["target"] == best and "| 1/1 | 2 ± 0 |" in text
    with pytest.raises(SystemExit) as e:
        q.sweep(["--sweep=nothing"], log=lambda *a: None)
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: --sweep=nothing")
    with pytest.raises(SystemExit) as e:   # (no dense recipe, no --target: refused before training)
        q.sweep(["--sweep=cola", f"--keep_runs={tmp_path / 'none'}"], log=lambda *a: None)
    assert e.value.code == 2 and "no dense recipe" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


@pytest.mark.slow
def test_threads_bench_run_says_what_train_py_chose(tmp_path):
    """bench_threads.run: a fresh train.py with OMP_NUM_THREADS unset; --threads=0 what train.py
    chose from the idle cores (1..cores, parsed from its start line); ms per iteration read back."""
    import os
    import bench_threads
    ms, chosen = bench_threads.run("0", 4, tmp_path / "auto")
    assert ms > 0 and 1 <= chosen <= len(os.sched_getaffinity(0))


def test_the_quality_winner_config_is_the_benchs_cola_run():
    """configs/cola_quality_cpu.toml trains what bench.py quality's CPU tier runs for CoLA (but the
    tier's --tp, --layout and --eval_iters): every model and training option equal."""
    import dataclasses
    import bench_quality as q
    from conftest import ROOT
    from plumbing import options
    mine = options.parse_args([str(ROOT / "configs" / "cola_quality_cpu.toml")])
    theirs = options.parse_args([a for a in [*q.SHAPE, *q.RUNS["cola (btp)"]]
                                 if not a.startswith(("--tp=", "--layout=", "--eval_iters="))])
    assert [(c.shape(), dataclasses.asdict(t)) for c, t in (mine, theirs)][0] == \
        [(c.shape(), dataclasses.asdict(t)) for c, t in (mine, theirs)][1]


def test_gpu_md_gives_gpu_checks_slots_and_its_count_of_comparisons():
    """docs/gpu.md's table: each step's slot as gpu_check.STEPS has it, and the kernel step's count
    of comparisons on a GPU (every bf16 configuration on the ragged shapes, training's calls, the
    real shapes; fp32's first configuration and training's calls)."""
    import bench_gpu
    import gpu_check
    import gpu_check_kernels as k
    import triton_kernels as tk
    text = (ROOT / "docs" / "gpu.md").read_text()
    for name, slot in gpu_check.STEPS.items():
        assert f"| {name} | {slot} |" in text, name
    real = sum(len(bench_gpu.kernel_cases(cfg)) for cfg in bench_gpu.shapes().values())
    count = (len(tk.GEMM_CONFIGS[(90, 16)]) * len(k.RAGGED) + len(k.TRAINING) + real
             + len(k.RAGGED) + len(k.TRAINING))
    assert f"| kernels | {gpu_check.STEPS['kernels']} | {count} comparisons" in text, count
    assert sum(gpu_check.STEPS.values()) == 475 and "475 s budget" in text
