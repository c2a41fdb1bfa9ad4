"""test_plot.py: tools/plot.py draws what metrics.jsonl says (a resumed run's later records, the
time axis from the logged step times, the machine and load) and refuses bad input in one line; bench.py data's corpus forms
hold the same documents, so they prepare to the same token files.
"""
import json
import re
import sys

import pytest

from plumbing import preparation
from conftest import ROOT, command, run_train

sys.path.insert(0, str(ROOT / "tools"))
import bench_data  # noqa: E402
import plot  # noqa: E402


def write_log(folder, lines):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(x if isinstance(x, str) else json.dumps(x) + "\n" for x in lines))


def test_read_run_keeps_the_later_attempt_and_sums_the_step_times(tmp_path):
    write_log(tmp_path / "a", [
        {"event": "start", "tokens_per_iter": 100, "arch": "cola", "machine": "2 CPUs", "load": 0.1},
        {"iter": 0, "loss": 5.0, "tokens_per_s": 10.0, "val_loss": 5.5, "ms": 100.0},
        {"iter": 1, "loss": 4.0, "tokens_per_s": 11.0, "ms": 200.0},
        {"iter": 2, "loss": 3.9, "tokens_per_s": 12.0, "val_loss": 4.2, "ms": 900.0},
        {"event": "resume", "iter": 1, "tokens_per_iter": 100, "machine": "2 CPUs", "load": 1.5},
        {"iter": 2, "loss": 3.0, "tokens_per_s": 13.0, "val_loss": 3.5, "ms": 300.0},
        {"iter": 5, "loss": 2.5, "tokens_per_s": 13.0, "ms": 100.0},   # a line for 3 steps
        '{"iter": 6, "loss": 2.',                                  # cut short by a kill
    ])
    run = plot.read_run(tmp_path / "a")
    assert [(i, round(t, 6), loss) for i, t, loss in run["train"]] == \
        [(0, 0.1, 5.0), (1, 0.3, 4.0), (2, 0.6, 3.0), (5, 0.9, 2.5)]
    assert [(i, round(t, 6), loss) for i, t, loss in run["val"]] == [(0, 0.0, 5.5), (2, 0.3, 3.5)]
    assert run["speed"] == [(0, 10.0), (1, 11.0), (2, 13.0), (5, 13.0)]
    assert (run["arch"], run["machine"], run["load"]) == ("cola", "2 CPUs", 1.5)   # (the latest)


def test_plot_draws_real_runs(tmp_path, data_dir):
    pytest.importorskip("matplotlib")
    for name in ("cola", "full"):
        run_train(tmp_path / name, data_dir, f"--arch={name}", "--max_iters=4", "--eval_interval=2")
    run = plot.read_run(tmp_path / "cola")
    seconds = [p[1] for p in run["train"]]
    assert [p[0] for p in run["train"]] == [0, 1, 2, 3] and 0 < seconds[0] < seconds[-1]
    assert [p[0] for p in run["val"]] == [0, 2, 4] and run["arch"] == "cola"
    assert run["machine"].endswith("CPUs, 1 process") and run["load"] >= 0
    out = tmp_path / "runs.png"
    for extra in ([], ["--diff"]):   # (--diff: the dense run is another model, left out)
        code, err = command(plot.main, tmp_path / "cola", tmp_path / "full", "-o", out, "--labels=CoLA,dense",
                            *extra)
        assert code == 0, err
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_at_equal_wall_time(tmp_path):
    """--ms_per_iter: each run's losses against iterations × its figure (the val loss before step
    `it`, the train loss after it + 1 iterations), drawn; a wrong count or a non-number is one line."""
    pytest.importorskip("matplotlib")
    write_log(tmp_path / "a", [{"event": "start", "tokens_per_iter": 8},
                               {"iter": 0, "loss": 2.5, "val_loss": 3.0, "tokens_per_s": 1.0}, {"iter": 1, "loss": 2.0}])
    timed = plot.with_seconds(plot.read_run(tmp_path / "a"), 250.0)
    assert timed["train"] == [(0, 0.25, 2.5), (1, 0.5, 2.0)] and timed["val"] == [(0, 0.0, 3.0)]
    code, err = command(plot.main, tmp_path / "a", tmp_path / "a", "-o", tmp_path / "t.png", "--ms_per_iter=250,100")
    assert code == 0 and (tmp_path / "t.png").stat().st_size > 10_000, err
    for bad in ("250", "250,x", "250,-1"):
        code, err = command(plot.main, tmp_path / "a", tmp_path / "a", "-o", tmp_path / "u.png", f"--ms_per_iter={bad}")
        assert code == 2 and err.startswith("error: --ms_per_iter") and "\n" not in err, err
    assert not (tmp_path / "u.png").exists()


def test_plot_refuses_bad_input_in_one_line(tmp_path):
    write_log(tmp_path / "a", [{"event": "start"}, {"iter": 0, "loss": 1.0, "tokens_per_s": 1.0}])
    (tmp_path / "notes.txt").write_text("mine")
    cases = [((tmp_path / "empty", "-o", tmp_path / "x.png"), "has no metrics.jsonl"),
             ((tmp_path / "a", "-o", tmp_path / "notes.txt"), "name a .png"),
             ((tmp_path / "a", "-o", tmp_path / "nope" / "x.png"), "does not exist"),
             ((tmp_path / "a", "-o", tmp_path / "x.png", "--labels=a,b"), "names 2 runs")]
    (tmp_path / "empty").mkdir()
    for args, fragment in cases:
        code, err = command(plot.main, *args)
        assert code == 2 and err.startswith("error: ") and "\n" not in err and fragment in err, (args, err)
    assert (tmp_path / "notes.txt").read_text() == "mine" and not (tmp_path / "x.png").exists()
    write_log(tmp_path / "b", [{"event": "start"}])
    code, err = command(plot.main, tmp_path / "b", "-o", tmp_path / "x.png")
    assert code == 2 and "holds no iteration records" in err


def test_plot_takes_rows_without_speed_nan_and_refuses_strings_and_binary(tmp_path):
    """Rows without tokens_per_s (drawn without a speed point), a NaN loss (a gap), a string where a
    number belongs or a binary metrics.jsonl: drawn, or one line naming the file."""
    pytest.importorskip("matplotlib")
    write_log(tmp_path / "a", [{"event": "start", "tokens_per_iter": 8}, {"iter": 0, "loss": 5.0},
                               '{"iter": 1, "loss": NaN, "tokens_per_s": 3.0}\n'])
    run = plot.read_run(tmp_path / "a")
    assert run["speed"] == [(1, 3.0)] and run["train"][0] == (0, 0.0, 5.0) and run["train"][1][2] != 5.0
    assert command(plot.main, tmp_path / "a", "-o", tmp_path / "a.png")[0] == 0
    write_log(tmp_path / "s", [{"iter": 0, "loss": "5.0", "tokens_per_s": 1.0}])
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "metrics.jsonl").write_bytes(bytes(range(256)))
    for folder, fragment in (("s", "metrics.jsonl:1: loss is '5.0', not a number"), ("bin", "is not a text file")):
        code, err = command(plot.main, tmp_path / folder, "-o", tmp_path / "x.png")
        assert code == 2 and err.startswith("error: ") and "\n" not in err and fragment in err, err


def test_bench_data_forms_prepare_to_the_same_tokens(tmp_path):
    pytest.importorskip("pyarrow")
    pytest.importorskip("zstandard")
    forms = bench_data.make_corpus(tmp_path / "corpus", 0.3)
    assert set(forms) == set(bench_data.FORMS)
    crcs = {}
    for form in ("jsonl", "jsonl.gz", "jsonl.zst", "parquet"):
        out = preparation.prepare(str(forms[form]), "bytes", tmp_path / f"d-{form}", num_proc=1, log=lambda *a: None)
        meta = json.loads((out / "meta.json").read_text())
        crcs[form] = (meta["documents"], meta["train_crc32"], meta["val_crc32"])
    assert len(set(crcs.values())) == 1, crcs
    mixed = json.loads((preparation.prepare(str(forms["mixed"]), "bytes", tmp_path / "d-mixed", num_proc=1,
                                        log=lambda *a: None) / "meta.json").read_text())
    assert mixed["documents"] == 3 * crcs["jsonl"][0]   # the .txt folder, the .jsonl and the .jsonl.gz


def test_plot_without_matplotlib_is_one_line(tmp_path, monkeypatch):
    write_log(tmp_path / "a", [{"event": "start"}, {"iter": 0, "loss": 1.0, "tokens_per_s": 1.0}])
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # as if it were not installed
    code, err = command(plot.main, tmp_path / "a", "-o", tmp_path / "x.png")
    assert code == 2 and "needs the matplotlib package: pip install matplotlib" in err and "\n" not in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.slow
def test_draw_pictures_come_from_what_the_code_records(tmp_path, monkeypatch):
    """tools/draw.py: one BTP layer's steps are --explain's (four all-reduces each way, their widths
    in the formula's order), drawn; the traffic bars are bench.py traffic's ledger counts, drawn."""
    pytest.importorskip("matplotlib")
    import bench_traffic
    import draw
    text = draw.explain_layer()
    fwd, bwd = draw.layer_steps(text, "fwd · layer 0"), draw.layer_steps(text, "bwd · layer 1")
    widths = lambda steps: [re.search(r"tp: (\S+) per token", t).group(1) for k, t in steps if k == "all_reduce"]
    assert widths(fwd) == ["3r+1", "r", "2r+1", "r"] and widths(bwd) == ["r", "2r", "r", "3r"]
    assert ("GEMM", "B_q, B_k, B_v") in fwd
    draw.draw_layer(text, tmp_path / "layer.png")
    measured = {n: {"measured": [226.0, 224.0]} for n in draw.LAYOUTS}
    monkeypatch.setattr(bench_traffic, "bench_traffic", lambda extra, tp: ("", measured))
    code, err = command(draw.main, "traffic", "-o", tmp_path / "traffic.png")
    assert code == 0, err
    for name in ("layer.png", "traffic.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert command(draw.main, "traffic", "-o", tmp_path / "x.txt")[0] == 2
    # the schedules' picture keys its four colours (it had none)
    assert draw.draw_schedules(tmp_path / "schedules.png") == [
        "F: forward", "B: backward (whole)", "I: backward, input half", "W: backward, weight half"]
    assert (tmp_path / "schedules.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
