"""test_schedules.py: the pipeline schedules' action lists and schedule_sim.timeline's idle shares against
the formulas they must meet (1F1B's (p-1)/(m+p-1), interleaving's (p-1)/(v·m+p-1)), the stages a
rank holds, `--explain`'s schedule lines, and the schedules bench and picture at a toy size.
"""
import re

import pytest

from extensions import pipeline
from extensions import schedule_sim
from conftest import ROOT, TINY, torchrun


def names(actions):
    return [str(a) for a in actions if a is not None]


def test_1f1b_and_gpipe_orders_are_the_loops_torch_runs():
    # rank 0 of 2: 2 warm-up forwards (p - rank), then a backward and a forward in turn
    order = schedule_sim.order("1f1b", 2, 4)
    assert names(order[0]) == ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"]
    assert names(order[1]) == ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]
    assert names(schedule_sim.order("gpipe", 2, 3)[1]) == ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]


@pytest.mark.parametrize("pp, m", [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16), (8, 8)])
def test_modelled_idle_shares_equal_the_textbook_formulas(pp, m):
    for schedule in ("1f1b", "gpipe"):
        share = schedule_sim.idle(schedule_sim.timeline(schedule_sim.order(schedule, pp, m)))
        assert share == pytest.approx(dict.fromkeys(range(pp), (pp - 1) / (m + pp - 1))), schedule
    if m % pp == 0:   # interleaving v stages a rank: the warm-up and cool-down shrink v times
        for v in (2, 4):
            share = schedule_sim.idle(schedule_sim.timeline(schedule_sim.order("interleaved_1f1b", pp, m, v)))
            assert share == pytest.approx(dict.fromkeys(range(pp), (pp - 1) / (v * m + pp - 1)))
    if m >= 2 * pp:   # the zero-bubble schedules leave less idle than interleaving's
        inter = schedule_sim.idle(schedule_sim.timeline(schedule_sim.order("interleaved_1f1b", pp, m, 2)))[0]
        for schedule in ("zero_bubble", "zbv", "dualpipev"):
            share = schedule_sim.idle(schedule_sim.timeline(schedule_sim.order(schedule, pp, m, 2)))
            assert max(share.values()) < inter, (schedule, share, inter)


def test_stages_a_rank_holds():
    assert [pipeline.stages_of(r, 4, 2, "interleaved_1f1b") for r in range(4)] == \
        [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert [pipeline.stages_of(r, 4, 2, "zbv") for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    for schedule in ("zero_bubble", "dualpipev", "1f1b"):   # every stage on exactly one rank
        held = [k for r in range(4) for k in pipeline.stages_of(r, 4, 1 if schedule == "1f1b" else 2,
                                                                  schedule)]
        assert sorted(held) == list(range(8 if schedule != "1f1b" else 4)), (schedule, held)


def test_explain_prints_the_schedule_rank_by_rank(tmp_path):
    out = torchrun(2, f"--out_dir={tmp_path / 'out'}", *TINY, "--explain=true", "--n_layer=4", "--pp=2",
                   "--pp_schedule=zbv", "--pp_virtual_stages=2", "--gradient_accumulation_steps=4").stdout
    assert "the schedule: zbv over pp=2 ranks, 4 micro-batches, 2 stage(s) a rank" in out
    ranks = dict(re.findall(r"^  pp rank (\d) \(idle ([\d.]+)\): ", out, re.M))
    assert ranks == {"0": "0.04", "1": "0.04"}, out[-1500:]
    line0 = re.search(r"^  pp rank 0 \(idle [\d.]+\): (.*)$", out, re.M).group(1).split()
    assert line0[:5] == ["0F0", "0F1", "0F2", "3F0", "3I0"] and len(line0) == 24   # F, I, W of 8


def test_schedules_bench_refuses_what_it_cannot_run():
    import subprocess
    import sys
    for arg in ("--pp=3", "--n_embd=64"):
        res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "schedules", arg],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert res.returncode == 2 and res.stderr.startswith(f"error: {arg}: this bench takes"), res.stderr
        assert res.stderr.count("\n") == 1 and not res.stdout, (res.stdout, res.stderr)


@pytest.mark.slow
def test_schedules_bench_runs_every_schedule(tmp_path):
    import subprocess
    import sys
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "schedules", "--pp=2",
                          "--iters=1", "--rounds=1", f"--json_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 12, res.stdout   # 6 schedules x 4 and 8 micro-batches
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        measured = float(cells[5].split()[0])
        assert 0 <= measured < 1 and float(cells[4]) > 0, row
        assert float(cells[7]) == round((2 - 1) / (int(cells[1]) + 1), 2), row
    drawn = subprocess.run([sys.executable, str(ROOT / "tools" / "draw.py"), "schedules", "-o",
                            str(tmp_path / "schedules.png")], capture_output=True, text=True, timeout=300)
    assert drawn.returncode == 0 and (tmp_path / "schedules.png").stat().st_size > 10_000, drawn.stderr


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_profile_labels_every_action_of_the_schedule(tmp_path, schedule):
    """--profile traces carry each compute action of the rank's schedule as PP:<action> (torch labels
    the multi-stage schedules' own; pipeline.Pipeline labels 1F1B's and GPipe's)."""
    import json
    virtual = ["--pp_virtual_stages=2"] if schedule == "zbv" else []
    torchrun(2, f"--out_dir={tmp_path}", *TINY, "--n_layer=4", "--pp=2", f"--pp_schedule={schedule}", *virtual,
             "--batch_size=1", "--gradient_accumulation_steps=4", "--max_iters=3", "--eval_interval=100",
             "--profile=1:1")
    for rank in (0, 1):
        trace = json.loads((tmp_path / "trace" / f"rank{rank}.json").read_text())
        labels = {e["name"][3:] for e in trace["traceEvents"] if str(e.get("name", "")).startswith("PP:")}
        want = set(names(schedule_sim.order(schedule, 2, 4, 2 if virtual else 1)[rank]))
        assert want <= labels and len(want) == (8 if schedule == "1f1b" else 24), (rank, want - labels)
