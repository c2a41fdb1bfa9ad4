"""test_cuda_graph.py: --cuda_graph (extensions/cuda_graph.py) as far as a CPU can prove it: train.py's
step, run through the capture path with a CPU stand-in for the CUDA graph (the driver), makes no host
synchronisation and no data-dependent shape, the same ops on the same shapes at every replay, at tp=1
and tp=2 with AdamW and Muon, and trains exactly as the eager step; what cannot be captured is
refused in one line.
"""
import re
import sys

import pytest
import torch

from conftest import ROOT, TINY, launch, losses, metrics, run_train
from extensions import cuda_graph
from plumbing import options, plan as plans


class StandIn:
    """cuda_graph.Graph's two calls on a CPU. capture records the step without running it (as a
    real capture runs no kernel) and hands out the tensor each replay fills; replay runs the step
    under cuda_graph.StepRecorder and fails on an op a graph cannot hold, or on ops or shapes that
    differ from the first replay's (a graph replays one fixed sequence)."""
    replays = 0

    def capture(self, fn):
        self.fn, self.ops, self.out = fn, None, torch.zeros(())
        return self.out

    def replay(self):
        result = []
        recorder = cuda_graph.check_step(lambda: result.append(self.fn()))
        assert not recorder.bad, f"the step asks the host: {sorted(set(recorder.bad))}"
        assert self.ops is None or recorder.ops == self.ops, "the replayed step's ops differ"
        self.ops = recorder.ops
        self.out.copy_(result[0])
        StandIn.replays += 1


SCRIPT = """import sys
sys.path[:0] = [{root!r}, {tests!r}]
import test_cuda_graph
from extensions import cuda_graph
cuda_graph.DEVICES, cuda_graph.Graph = ("cuda", "cpu"), test_cuda_graph.StandIn
import train
train.main(sys.argv[1:])
"""
RUN = [*TINY, "--max_iters=8", "--lr_decay_iters=8"]


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(cuda_graph, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(cuda_graph, "Graph", StandIn)
    StandIn.replays = 0


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_captured_step_trains_as_eager_at_tp1(tmp_path, data_dir, on_cpu, optimizer):
    args = [*RUN, f"--optimizer={optimizer}"]
    eager = metrics(run_train(tmp_path / "eager", data_dir, *args) and tmp_path / "eager")
    graph = metrics(run_train(tmp_path / "graph", data_dir, *args, "--cuda_graph=true") and
                    tmp_path / "graph")
    assert StandIn.replays == 8 - cuda_graph.WARMUP
    torch.testing.assert_close(torch.tensor(losses(graph)), torch.tensor(losses(eager)),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_captured_step_trains_as_eager_at_tp2(tmp_path, data_dir, optimizer):
    """Two ranks of BTP; the collectives the ledger counts a step are the eager step's."""
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(root=str(ROOT), tests=str(ROOT / "tests")))
    args = [f"--data_dir={data_dir}", *RUN, "--tp=2", f"--optimizer={optimizer}"]
    launch(2, [str(script), f"--out_dir={tmp_path / 'eager'}", *args], 300)
    res = launch(2, [str(script), f"--out_dir={tmp_path / 'graph'}", *args, "--cuda_graph=true"],
                 300)
    eager, graph = metrics(tmp_path / "eager"), metrics(tmp_path / "graph")
    torch.testing.assert_close(torch.tensor(losses(graph)), torch.tensor(losses(eager)),
                               rtol=1e-5, atol=1e-6)
    sent = [[r["tp_bytes"] for r in run if "loss" in r] for run in (graph, eager)]
    assert sent[0] == sent[1] and min(sent[0]) > 0, res.stdout[-1000:]


def test_the_recorder_finds_host_syncs_and_data_shapes():
    """What check_step flags (so the tests above can fail): .item(), a tensor's truth value, a
    mask's selection; plain arithmetic passes."""
    x = torch.randn(4)
    assert cuda_graph.check_step(lambda: (x * 2).sum()).bad == []
    assert "_local_scalar_dense" in cuda_graph.check_step(lambda: x.sum().item()).bad
    assert "_local_scalar_dense" in cuda_graph.check_step(lambda: bool(x[0] > 0)).bad
    assert "nonzero" in cuda_graph.check_step(lambda: x.nonzero()).bad
    assert "masked_select" in cuda_graph.check_step(lambda: x[x > 0]).bad + \
        cuda_graph.check_step(lambda: x.masked_select(x > 0)).bad


@pytest.mark.parametrize("argv, fragment", [
    (["--device=cpu"], "a graph is CUDA's, this run is on cpu"),
    (["--pp=2", "--gradient_accumulation_steps=2"], "a pipeline's schedule"),
    (["--dp=2", "--gradient_accumulation_steps=2"], "use dp=1"),
    (["--profile=2:1"], "--profile"),
    (["--inject_fault=kill:3"], "--inject_fault")])
def test_what_cannot_be_captured_is_refused_in_one_line(monkeypatch, argv, fragment):
    if argv != ["--device=cpu"]:   # (the others as a CUDA run would meet them)
        monkeypatch.setattr(cuda_graph, "DEVICES", ("cuda", "cpu"))
    cfg, tc = options.parse_args([*TINY, "--cuda_graph=true", *argv])
    with pytest.raises(ValueError, match=re.escape(fragment)) as e:
        plans.make(cfg, tc, tc.tp * tc.pp * max(1, tc.dp))
    assert str(e.value).startswith("cuda_graph=true cannot capture") and "\n" not in str(e.value)
