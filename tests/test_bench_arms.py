"""test_bench_arms.py: tools/bench_arms.py's arithmetic at a toy size, on records made here: the
sweep's equal budgets, its winners, the seed-by-seed pairing, the wall ratio's interval and its
upper end, a miss and where it ended, which half decides, the headline; and its refusals.
"""
import shutil
import statistics
import sys

import pytest

import bench_arms as arms
import bench_quality as bq
from plumbing import options


def records(evals, ms):
    """A run's metrics records: val losses {step: loss} every 25 steps, `ms` a step."""
    last = max(evals)
    return [{"iter": i, "ms": ms, "loss": 1.0} for i in range(last)] + \
        [{"iter": s, "val_loss": v} for s, v in sorted(evals.items())]


def test_every_arm_is_offered_the_same_budget_over_the_same_grid():
    grids = {arm: arms.grid(arm) for arm in arms.ARMS if arm not in arms.RANKED}
    assert len(grids) == 4
    assert {len(g) for g in grids.values()} == {len(arms.WARMUPS) * len(arms.LRS)}
    for arm, g in grids.items():
        rates = {a for args in g.values() for a in args
                 if a.startswith("--muon_lr=" if arm.endswith("muon") else "--learning_rate=")}
        assert len(rates) == len(arms.LRS), (arm, rates)
        warmups = {a for args in g.values() for a in args if a.startswith("--warmup_iters=")}
        assert warmups == {f"--warmup_iters={w}" for w in arms.WARMUPS}
        for args in g.values():   # (each recipe a valid run of the bench's shape)
            options.parse_args([*arms.SHAPE, *args])
    assert "--max_iters=450" in grids["cola adamw"]["cola adamw: lr 1e-3, warmup 30"]
    assert "--lr_decay_iters=375" in grids["cola muon"]["cola muon: muon_lr 0.04, warmup 90"]
    assert "--max_iters=300" in grids["dense muon"]["dense muon: muon_lr 0.01, warmup 30"]


def test_winners_are_the_dense_arms_lowest_and_colas_soonest():
    trained = {"dense adamw: lr 1e-3, warmup 60": [records({25: 3.0, 500: 1.50}, 10)],
               "dense adamw: lr 2e-3, warmup 60": [records({25: 3.0, 500: 1.40}, 10)],
               "dense muon: muon_lr 0.01, warmup 60": [records({25: 3.0, 500: 1.45}, 10)],
               # both reach 1.40; the second sooner (step 400 against 600)
               "cola adamw: lr 1e-3, warmup 60": [records({25: 3.0, 600: 1.40, 750: 1.30}, 5)],
               "cola adamw: lr 2e-3, warmup 60": [records({25: 3.0, 400: 1.40, 750: 1.35}, 5)]}
    won = arms.winners(trained)
    assert won == {"dense adamw": "dense adamw: lr 2e-3, warmup 60",
                   "dense muon": "dense muon: muon_lr 0.01, warmup 60",
                   "cola adamw": "cola adamw: lr 2e-3, warmup 60"}


def test_a_pair_meets_seed_by_seed_with_the_ratios_upper_end():
    """Three seeds: CoLA crosses its seed's target at 300 and 400, misses on the third (where it
    ended is listed); the dense arm reaches each target at step 500; steps at 5 ms against 10 ms."""
    targets = [1.5, 1.5, 1.5]
    dense = [records({250: 2.0, 500: 1.5}, 10) for _ in targets]
    cola = [records({200: 2.0, 400: 1.0, 750: 0.9}, 5), records({300: 2.0, 500: 1.0, 750: 0.9}, 5),
            records({375: 2.0, 750: 1.6}, 5)]
    row = arms.pair(cola, dense, targets, tokens_per_iter=100, flops=2.0)
    assert row["reached"] == "2/3" and row["ended"] == [(750, 1.6)]
    assert row["steps"] == bq.interval([300.0, 400.0])
    assert row["tokens"][0] == 35000 and row["flops"][0] == 70000
    ratios = [300 * 5 / (500 * 10), 400 * 5 / (500 * 10)]
    mean, half = bq.interval(ratios)
    assert row["ratio"] == pytest.approx((mean, half, mean + half))
    assert row["steps_ratio"] == pytest.approx(0.7) and row["step_time_ratio"] == 0.5
    d = arms.decide(row)
    assert d["product"] == pytest.approx(0.35) and d["steps_ratio_for_goal"] == pytest.approx(1.2)
    assert d["step_time_ratio_for_goal"] == pytest.approx(0.6 / 0.7)


def test_compare_takes_the_better_dense_arm_and_the_best_cola_arm():
    """The target is the better dense arm's (lower mean last val) on each seed; the headline is the
    CoLA arm reaching it on more seeds, then the lower wall ratio."""
    trained = {"dense adamw": [records({250: 2.0, 500: 1.6}, 10), records({250: 2.0, 500: 1.4}, 10)],
               "dense muon": [records({250: 2.0, 500: 1.5}, 10), records({250: 2.0, 500: 1.3}, 10)],
               "cola adamw": [records({250: 2.0, 750: 1.0}, 5), records({250: 2.0, 750: 1.35}, 5)],
               "cola muon": [records({250: 2.0, 750: 1.0}, 5), records({250: 2.0, 750: 1.0}, 5)]}
    targets, better, pairs, head = arms.compare(trained, 100, {"cola adamw": 1.0, "cola muon": 1.0})
    assert better == "dense muon" and targets == [1.5, 1.3]
    assert set(pairs) == {(c, d) for c in ("cola adamw", "cola muon") for d in ("dense adamw", "dense muon")}
    assert pairs[("cola adamw", "dense muon")]["reached"] == "1/2"
    assert head == ("cola muon", "dense muon")
    # the other dense arm reaches neither of the better one's targets: no seed gives a ratio
    assert pairs[("cola muon", "dense adamw")]["reached"] == "2/2"
    assert "ratio" not in pairs[("cola muon", "dense adamw")]
    rows = {row[0]: row for row in arms.rows_of(pairs)}
    assert rows["cola muon vs dense muon"][6].endswith(")") and "upper" in rows["cola muon vs dense muon"][6]
    assert rows["cola muon vs dense adamw"][6] == "-"
    # against dense AdamW's own losses (1.6, 1.4) both CoLA arms reach on both seeds, with ratios
    own = arms.own_targets(trained, better, 100, {"cola adamw": 1.0, "cola muon": 1.0})
    assert set(own) == {("cola adamw", "dense adamw"), ("cola muon", "dense adamw")}
    assert own[("cola adamw", "dense adamw")]["reached"] == "2/2"
    assert own[("cola muon", "dense adamw")]["ratio"][0] < 1


def test_the_winner_file_is_a_config_train_py_reads(tmp_path):
    args = arms.grid("cola muon")["cola muon: muon_lr 0.02, warmup 90"]
    path = arms.write_config("cola muon", args, tmp_path)
    cfg, tc = options.parse_args([*arms.SHAPE, *arms.config_args(path)])   # (as the bench runs it)
    assert (cfg.arch, tc.layout, tc.optimizer, tc.muon_lr, tc.warmup_iters, tc.max_iters) == \
        ("cola", "btp", "muon", 0.02, 90, 450)
    assert cfg.attn_rank == cfg.mlp_rank == 64   # (r = d/4 at the CPU tier's d=256)


def test_the_rank_arm_trains_cola_muons_winner_at_three_eighths_of_d(monkeypatch, tmp_path):
    """The fifth arm is not swept: it reads CoLA Muon's winner file, its rank 3d/8 of the tier's
    d (96 at the CPU tier's 256, 192 at the GPU tier's 512, after the GPU shape's own 128)."""
    monkeypatch.setattr(arms, "CONFIGS", tmp_path)
    arm = "cola muon r=3d/8"
    assert arms.chosen([f"--arms=dense muon,{arm}"]) == ["dense muon", arm]
    assert arms.config_file(arm) == tmp_path / "cola_muon.toml"
    arms.write_config("cola muon", arms.grid("cola muon")["cola muon: muon_lr 0.01, warmup 90"])
    for shape, r in ((arms.SHAPE, 96), (arms.SHAPE_GPU, 192)):
        cfg, tc = options.parse_args([*shape, *arms.config_args(arms.config_file(arm)),
                                      *arms.rank_args(arm, shape)])
        assert (cfg.attn_rank, cfg.mlp_rank, tc.muon_lr, cfg.arch) == (r, r, 0.01, "cola")
    assert arms.rank_args("cola muon", arms.SHAPE) == []


def test_bad_arms_and_missing_winners_are_one_line(capsys, monkeypatch, tmp_path):
    with pytest.raises(SystemExit) as e:
        arms.chosen(["--arms=cola sgd"])
    assert e.value.code == 2 and capsys.readouterr().err.startswith("error: --arms=cola sgd")
    monkeypatch.setattr(arms, "CONFIGS", tmp_path)
    with pytest.raises(SystemExit) as e:
        arms.bench(["--arms=dense adamw,cola muon"])
    assert e.value.code == 2 and "run `bench.py arms --sweep` first" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        arms.bench(["--arms=cola muon"])
    assert "needs a dense arm and a CoLA arm" in capsys.readouterr().err
    monkeypatch.setattr(bq, "train", lambda *a, **k: pytest.fail("trained"))
    # without matplotlib (its figure) the bench stops before any training, in one line
    arms.write_config("cola muon", arms.grid("cola muon")["cola muon: muon_lr 0.01, warmup 30"])
    arms.write_config("dense muon", arms.grid("dense muon")["dense muon: muon_lr 0.01, warmup 30"])
    with pytest.raises(SystemExit) as e:   # (this machine has no CUDA device)
        arms.bench(["--arms=dense muon,cola muon", "--tier=gpu"])
    assert e.value.code == 2 and capsys.readouterr().err.startswith(
        "error: --tier=gpu trains on a CUDA device and this machine has none")
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # (import matplotlib raises)
    with pytest.raises(SystemExit) as e:
        arms.bench(["--arms=dense muon,cola muon"])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("error: bench.py arms's figure needs the matplotlib")
    with pytest.raises(SystemExit) as e:
        bq.bench([])
    assert e.value.code == 2 and "bench.py quality's figure needs" in capsys.readouterr().err
    assert statistics.fmean([1, 2]) == 1.5


@pytest.mark.slow
def test_sweep_then_bench_end_to_end_at_a_toy_size(monkeypatch, tmp_path, data_dir):
    """The two commands as a user runs them, on a tiny model for 20 dense steps: the sweep trains
    each arm's grid and writes the winners; the bench trains them at tp=2 on two seeds and pairs
    them."""
    from conftest import TINY
    shape = [a for a in TINY if not a.startswith(("--warmup", "--log_interval"))]
    monkeypatch.setattr(arms, "SHAPE", [*shape, f"--data_dir={data_dir}", "--tp=2"])
    monkeypatch.setattr(arms, "DENSE_STEPS", 20)
    monkeypatch.setattr(arms, "WARMUPS", (2, 4))   # (two recipes an arm: one rate, two warmups)
    monkeypatch.setattr(arms, "LRS", ("2e-3",))
    monkeypatch.setattr(arms, "CONFIGS", tmp_path / "arms")
    monkeypatch.setattr(bq, "EVAL_EVERY", 5)
    monkeypatch.setattr(bq, "RESULTS", tmp_path / "results")
    pick = "--arms=dense adamw,cola adamw"
    text, out = arms.sweep([pick], log=lambda *a: None)
    assert set(out["winners"]) == {"dense adamw", "cola adamw"} and text.count("| winner |") == 2
    assert sorted(p.name for p in (tmp_path / "arms").iterdir()) == ["cola_adamw.toml", "dense_adamw.toml"]
    shutil.rmtree(tmp_path / "results")   # (the bench alone, as in a fresh clone: its folder made)
    text, out = arms.bench([pick, "--seeds=2"], log=lambda *a: None)
    assert out["better"] == "dense adamw" and len(out["targets"]) == 2
    assert list(out["pairs"]) == ["cola adamw vs dense adamw"]
    assert [len(c) for c in out["curves"]["cola adamw"]] == [7, 7]   # (steps 0, 5, ..., 30)
    assert [len(t) for t in out["seconds"].values()] == [2, 2] and "min" in text
    assert (tmp_path / "results" / "arms.png").stat().st_size > 0   # (the figure, from `out`)
    assert [len(v) for v in out["step_ms"].values()] == [2, 2]


def test_quality_md_says_the_grid_and_the_steps_the_bench_uses():
    """docs/quality.md's counts are the bench's: recipes an arm, runs in the sweep, the steps, the
    ranks at the CPU tier's d."""
    from conftest import ROOT
    text = " ".join((ROOT / "docs" / "quality.md").read_text().split())
    swept = [a for a in arms.ARMS if a not in arms.RANKED]
    per_arm = len(arms.grid(swept[0]))
    assert f"offers every arm {per_arm} recipes over the same grid" in text
    assert f"{len(swept) * per_arm} runs, {per_arm} an arm" in text
    assert (f"Dense arms train {arms.DENSE_STEPS} steps; CoLA arms a cosine of {arms.COLA_DECAY}, "
            f"trained on to {int(arms.DENSE_STEPS * arms.EXTEND)}") in text
    d = int(next(a for a in arms.SHAPE if a.startswith("--n_embd=")).split("=")[1])
    r = arms.rank_args("cola muon r=3d/8", arms.SHAPE)[0].split("=")[1]
    assert f"r = 3d/8 = {r} instead of d/4 = {d // 4}" in text
    assert f"rate in {{{', '.join(arms.LRS)}}} for AdamW" in text
    assert f"rate in {{{', '.join(arms.MUON_LRS)}}} for the Muon arms" in text
    assert f"warmup of {arms.WARMUPS[0]} or {arms.WARMUPS[1]} steps" in text
