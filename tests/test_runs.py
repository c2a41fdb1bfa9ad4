"""test_runs.py: safe runs (plumbing/rundir.py, plumbing/train_state.py, plumbing/options.py): an out_dir belongs to one run,
checkpoints are verified by content, interrupts save and resume exactly, every bad value is a
one-line error, and the log says where the run stands. Each test names the README guarantee it
proves. Run: .venv/bin/python -m pytest -q
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import interchange
import train
from plumbing import integrity, options, plan, train_state
from conftest import ROOT, TINY, command, expect_error, losses, metrics, run_train, torchrun

RUN = ["--max_iters=8", "--eval_interval=4", "--lr_decay_iters=8", "--batch_size=2"]


def files_of(out_dir):
    """{relative path: bytes} of everything a run wrote (the lock file aside)."""
    root = Path(out_dir)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "run.lock"}


# ---------------------------------------------------------------------------- an out_dir belongs to one run

def test_second_run_is_refused_and_overwrite_discards(capsys, tmp_path, data_dir):
    run_train(tmp_path, data_dir, *RUN)
    before = files_of(tmp_path)
    assert {"checkpoints/iter_0000004/meta.json", "checkpoints/iter_0000008/meta.json", "metrics.jsonl",
            "run.json"} <= before.keys()
    expect_error(capsys, [f"--out_dir={tmp_path}", f"--data_dir={data_dir}", *TINY, *RUN],
                 "holds an earlier run (2 checkpoint folders and metrics.jsonl)", "--init_from=resume",
                 "another --out_dir", "--overwrite=true")
    assert files_of(tmp_path) == before  # nothing written, nothing deleted
    records = run_train(tmp_path, data_dir, *RUN[1:], "--max_iters=2", "--overwrite=true")
    assert [r["iter"] for r in records if "loss" in r] == [0, 1]
    assert [e["event"] for e in metrics(tmp_path, events=True) if "event" in e] == ["start", "end"]
    assert [Path(d).name for d in train_state.checkpoint_dirs(tmp_path)] == ["iter_0000002"]


def test_live_run_holds_the_out_dir(capsys, tmp_path, data_dir):
    cmd = [sys.executable, str(ROOT / "train.py"), f"--out_dir={tmp_path}", f"--data_dir={data_dir}", *TINY,
           "--max_iters=100000", "--eval_interval=100000"]
    live = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_for_rows(tmp_path, 1, live)
        for extra in ([], ["--init_from=auto"], ["--overwrite=true"]):
            expect_error(capsys, [f"--out_dir={tmp_path}", f"--data_dir={data_dir}", *TINY, *extra],
                         f"out_dir {tmp_path} is in use by a live run (pid {live.pid}")
    finally:
        live.kill()   # a crash: the kernel frees the lock
        live.wait(timeout=60)
    run_train(tmp_path, data_dir, "--max_iters=1", "--overwrite=true")


@pytest.mark.slow
def test_restarted_job_may_start_over_in_its_own_out_dir(tmp_path, data_dir):
    """torchrun --max-restarts after a rank died before the first checkpoint: the same job goes on."""
    res = torchrun(2, f"--out_dir={tmp_path}", f"--data_dir={data_dir}", *TINY, "--max_iters=4",
                   "--eval_interval=100", "--gradient_accumulation_steps=2", "--batch_size=2", "--init_from=auto",
                   "--inject_fault=kill:2", launcher=["--max-restarts=1"], timeout=400)
    assert "holds an earlier run" not in res.stderr
    assert [r["iter"] for r in metrics(tmp_path) if "loss" in r] == [0, 1, 0, 1, 2, 3]


def test_pruning_removes_only_this_runs_older_checkpoints(tmp_path):
    def fake(it, run_id):
        d = tmp_path / "checkpoints" / f"iter_{it:07d}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"iter_num": it, "run_id": run_id, "files": {}}))
    for it in (2, 4, 6, 10):
        fake(it, "mine")
    for it in (1, 8):
        fake(it, "theirs")
    train_state.prune(tmp_path, "mine", 6, keep=2)
    assert [Path(d).name for d in train_state.checkpoint_dirs(tmp_path)] == \
        ["iter_0000001", "iter_0000004", "iter_0000006", "iter_0000008", "iter_0000010"]


# ---------------------------------------------------------------------------- checkpoints verified by content

@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_dir):
    """Losses of an uninterrupted 8-iteration run, in a process of its own (as the resumed ones)."""
    out = tmp_path_factory.mktemp("straight")
    torchrun(1, f"--out_dir={out}", f"--data_dir={data_dir}", *TINY, *RUN)
    return losses(metrics(out))


@pytest.mark.slow
def test_flipped_byte_is_detected_and_the_previous_checkpoint_used(tmp_path, data_dir, straight):
    common = [f"--out_dir={tmp_path}", f"--data_dir={data_dir}", *TINY, *RUN]
    torchrun(1, *common)
    newest = Path(train_state.checkpoint_dirs(tmp_path)[-1])
    shard = next(newest.glob("*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01   # one bit, same size
    shard.write_bytes(bytes(raw))
    res = torchrun(1, *common, "--init_from=resume")
    assert f"skipping checkpoint {newest}: {shard.name} fails its checksum" in res.stdout
    assert "resuming from" in res.stdout and "iter_0000004" in res.stdout
    records = metrics(tmp_path, events=True)
    resume = next(i for i, r in enumerate(records) if r.get("event") == "resume")
    assert losses(records[resume:]) == straight[4:]   # bit for bit
    assert [Path(d).name for d in train_state.checkpoint_dirs(tmp_path)] == ["iter_0000004", "iter_0000008"]
    meta = json.loads((newest / "meta.json").read_text())
    assert integrity.verify(str(newest), meta) is None   # rewritten whole by the resumed run


# ---------------------------------------------------------------------------- interrupts

def wait_for_rows(out_dir, n, proc, timeout=120):
    """Wait until metrics.jsonl holds n iteration rows."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "the run ended before it was interrupted"
        if (Path(out_dir) / "metrics.jsonl").exists() and len(losses(metrics(out_dir))) >= n:
            return
        time.sleep(0.05)
    raise TimeoutError("no metrics rows")


@pytest.mark.slow
@pytest.mark.parametrize("nproc, sig", [(1, signal.SIGINT), (2, signal.SIGTERM)])
def test_interrupt_saves_and_resumes_exactly(tmp_path, data_dir, nproc, sig):
    common = [f"--data_dir={data_dir}", *TINY, "--eval_interval=100000", "--lr_decay_iters=100000",
              "--gradient_accumulation_steps=2", "--batch_size=2", *(["--tp=2"] if nproc > 1 else [])]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] \
        if nproc > 1 else [sys.executable]
    proc = subprocess.Popen([*launcher, str(ROOT / "train.py"), f"--out_dir={tmp_path / 'run'}", *common,
                             "--max_iters=100000"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_for_rows(tmp_path / "run", 3, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    line = next(x for x in out.splitlines() if x.startswith("interrupted at iteration"))
    k = int(line.split()[3].rstrip(";"))
    ckpt = tmp_path / "run" / "checkpoints" / f"iter_{k:07d}"
    assert line == f"interrupted at iteration {k}; saved {ckpt}; continue with --init_from=resume"
    if nproc == 1:
        assert proc.returncode == 128 + sig and "Traceback" not in err
    torchrun(nproc, f"--out_dir={tmp_path / 'run'}", *common, f"--max_iters={k + 3}", "--init_from=resume")
    torchrun(nproc, f"--out_dir={tmp_path / 'straight'}", *common, f"--max_iters={k + 3}")
    records = metrics(tmp_path / "run", events=True)
    assert [r.get("event", r.get("iter")) for r in records if "loss" in r or "event" in r] == \
        ["start", *range(k), "interrupted", "resume", k, k + 1, k + 2, "end"]   # no step repeated
    assert losses(records) == losses(metrics(tmp_path / "straight"))   # bit for bit


@pytest.mark.slow
def test_second_signal_stops_at_once():
    code = ("import os, signal, time\nfrom plumbing import rundir\n"
            "i = rundir.Interrupt(print); i.armed = True\n"
            "os.kill(os.getpid(), signal.SIGINT); time.sleep(0.2)\n"
            "assert i.signum == signal.SIGINT\n"
            "os.kill(os.getpid(), signal.SIGINT); time.sleep(5); print('not stopped')\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 130 and "SIGINT again: stopped at once" in res.stdout and "not stopped" not in res.stdout


# ---------------------------------------------------------------------------- every value checked before work

@pytest.mark.parametrize("argv, fragment", [
    (["--learning_rate=-1"], "learning_rate=-1.0 must be positive"),
    (["--learning_rate=nan"], "learning_rate=nan must be a finite number"),
    (["--min_lr=0.1"], "min_lr=0.1 is above learning_rate=0.003"),
    (["--beta2=1.5"], "beta2=1.5 must be at least 0 and below 1"),
    (["--beta1=-0.1"], "beta1=-0.1 must be at least 0 and below 1"),
    (["--weight_decay=inf"], "weight_decay=inf must be a finite number"),
    (["--grad_clip=-1"], "grad_clip=-1.0 must not be negative"),
    (["--seed=-1"], "seed=-1 must not be negative"),
    (["--seed=" + "9" * 30], "seed=" + "9" * 30 + " must be below 2**63"),
    (["--tp_mode=vanilla"], "--tp_mode is now --layout: pass --layout=... instead"),
    (["--max_iters=-3"], "max_iters=-3 must not be negative"),
    (["--warmup_iters=-1"], "warmup_iters=-1 must not be negative"),
    (["--lr_decay_iters=-1"], "lr_decay_iters=-1 must not be negative"),
    (["--lr_decay_iters=5", "--warmup_iters=10"], "lr_decay_iters=5 ends before warmup_iters=10"),
    (["--timeout_s=0"], "timeout_s=0 must be at least 1"),
    (["--sample_tokens=-1"], "sample_tokens=-1 must not be negative"),
    (["--device=foo"], "device=foo is not auto, cpu, cuda or cuda:N"),
    (["--norm_eps=0"], "norm_eps=0.0 must be a positive finite number"),
    (["--rope_base=nan"], "rope_base=nan must be a positive finite number"),
    (["--overwrite=true", "--init_from=resume"], "overwrite=true discards the earlier run"),
    (["--inject_fault=boom:3"], "inject_fault=boom:3 is not"),
    (["--inject_fault=kill:1:2"], "inject_fault=kill:1:2 is not kill:N"),
    (["--muon_mode=gram"], "muon_mode=gram chooses how Muon's updates cross tensor parallelism: "
                           "it needs --optimizer=muon"),
    (["--muon_mode=owner", "--optimizer=muon"], "at tp=1 every matrix is whole on its rank"),
    (["--data_dir= "], "data_dir is empty: name one (the default is data)"),
    (["--out_dir="], "out_dir is empty: name one (the default is out)"),
    (["--tokenizer=" + "t" * 5000], "t... (5,000 characters) cannot be read: File name too long"),
])
def test_bad_values(capsys, tmp_path, argv, fragment):
    expect_error(capsys, [f"--out_dir={tmp_path / 'o'}", *argv], fragment)
    assert not (tmp_path / "o").exists()


def test_bad_places_and_devices(capsys, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    expect_error(capsys, [f"--out_dir={tmp_path / 'o'}", f"--data_dir={a_file}"], f"data_dir={a_file} is a file")
    expect_error(capsys, [f"--out_dir={a_file}"], f"out_dir={a_file} is a file")
    if not torch.cuda.is_available():
        expect_error(capsys, [f"--out_dir={tmp_path / 'o'}", "--device=cuda"], "this machine has no CUDA device")
    cfg, tc = options.parse_args(["--n_embd=96", "--n_head=6", "--n_kv_head=3", "--mlp_width=264", "--tp=3"])
    cfg.vocab_size = options.vocab_size("bytes")
    with pytest.raises(ValueError, match="does not divide the vocabulary of 320 .the tokenizer's, padded"):
        plan.make(cfg, tc, 3)


@pytest.fixture(scope="module")
def one_checkpoint(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("ckpt")
    run_train(out, data_dir, "--max_iters=2", "--eval_interval=2")
    return out


@pytest.mark.parametrize("args, fragment", [
    ([], "the following arguments are required: command"),
    (["export", "/no/such/ckpt", "x.pt"], "/no/such/ckpt is not a checkpoint folder"),
    (["export", "{out}", "x.pt"], "{out} is an out_dir, not a checkpoint: pass one of its checkpoints, e.g. "
                                  "{out}/checkpoints/iter_0000002"),
    (["export", "{ckpt}", "/no/such/dir/x.pt"], "the folder /no/such/dir of /no/such/dir/x.pt does not exist"),
    (["export", "{ckpt}", "{ckpt}/meta.json"], "meta.json exists: remove it or choose another name"),
    (["sample", "/no/such.pt"], "/no/such.pt is not an exported file, a checkpoint folder or an out_dir"),
    (["sample", "{ckpt}/meta.json"], "is not an exported model"),
    (["sample", "{ckpt}/meta.json", "abc"], "expects a whole number, got 'abc'"),
    (["sample", "{ckpt}/meta.json", "-5"], "must be at least 1, got -5"),
    (["sample", "{ckpt}/meta.json", "--temperature=0"], "expects a number above 0, got '0'"),
    (["sample", "{ckpt}/meta.json", "--temperature=nan"], "expects a number above 0, got 'nan'"),
])
def test_export_and_sample_arguments(one_checkpoint, args, fragment):
    fill = dict(out=one_checkpoint, ckpt=one_checkpoint / "checkpoints" / "iter_0000002")
    code, err = command(interchange.cli, *(a.format(**fill) for a in args))   # (its process: test_integrity.py)
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert fragment.format(**fill) in err, err


def test_sample_takes_a_prompt_a_temperature_and_top_k(one_checkpoint, tmp_path, capsys):
    """The sample continues the prompt; top_k=1 is greedy (the same text whatever the seed), a seed
    repeats a sample, and a negative top_k is one line."""
    ckpt = one_checkpoint / "checkpoints" / "iter_0000002"
    assert command(interchange.cli, "export", ckpt, tmp_path / "m.pt")[0] == 0

    errs = []

    def sample(*args):
        capsys.readouterr()
        assert interchange.cli(["sample", str(tmp_path / "m.pt"), "20", *args]) is None
        out, err = capsys.readouterr()
        errs.append(err)
        return out
    greedy = sample("--prompt=def main(", "--top_k=1", "--seed=1")
    err = errs[0]   # (what runs is said first, not 68 s of silence; stdout: the text alone)
    assert err.startswith("sample: 20 tokens from ") and re.search(r"sample: done in [\d.]+ s", err)
    assert greedy.startswith("def main(") and greedy == sample("--prompt=def main(", "--top_k=1", "--seed=2")
    hot = sample("--temperature=5", "--top_k=0", "--seed=3")
    assert hot == sample("--temperature=5", "--top_k=0", "--seed=3") != sample("--temperature=5", "--seed=4")
    code, err = command(interchange.cli, "sample", tmp_path / "m.pt", "--top_k=-1")
    assert code == 2 and "--top_k=-1 must not be negative" in err


# ---------------------------------------------------------------------------- the log says where the run stands

def test_log_and_metrics_say_where_the_run_stands(capsys, tmp_path, data_dir):
    run_train(tmp_path, data_dir, *RUN[1:], "--max_iters=4")
    out = capsys.readouterr().out
    assert "iter 0/4: loss" in out and ", mem " in out and "elapsed" in out and ", eta " in out
    assert ", grad norm " in out and "sizing: the embedding and head hold " in out
    ckpt = tmp_path / "checkpoints" / "iter_0000004"
    assert f"saved checkpoint {ckpt} (" in out
    assert "done: 4 iterations (0..4), 256 tokens in" in out and f"last checkpoint {ckpt}" in out
    assert "best val loss" in out
    records = metrics(tmp_path, events=True)
    assert records[0]["event"] == "start" and records[-1]["event"] == "end"
    assert all(r["mem_gb"] > 0.05 and r["grad_norm"] > 0 for r in records if "loss" in r)
    written = (ckpt / "meta.json").stat().st_mtime_ns
    run_train(tmp_path, data_dir, *RUN, "--init_from=resume")   # to 8
    out = capsys.readouterr().out
    assert f"saved checkpoint {ckpt}" not in out and (ckpt / "meta.json").stat().st_mtime_ns == written
    resume = [r for r in metrics(tmp_path, events=True) if r.get("event") == "resume"]
    assert resume == [{**resume[0], "iter": 4, "checkpoint": str(ckpt)}]


def test_the_start_says_where_the_parameters_and_memory_go(monkeypatch):
    """GPT-2's vocabulary on the default shape: the embedding and head are 98% of the model, said at
    the start; an estimate past 90% of what the machine has for a rank is a warning in that line."""
    import os
    from plumbing import placement
    from model import Llama
    cfg, tc = options.parse_args(["--tokenizer=gpt2"])
    cfg.vocab_size = 50304
    with torch.device("meta"):
        n_params = Llama(cfg).num_params()
    one = placement.Placement(1, 1, "cpu")   # (one process on a CPU)
    line = placement.sizing_line(cfg, tc, n_params, one)
    assert line.startswith("sizing: the embedding and head hold 98% of the parameters (vocabulary 50,304 ")
    parts, _ = placement.footprint(cfg, tc, n_params, one)
    tokens = tc.batch_size * cfg.block_size
    assert parts == {"state": 16 * n_params, "logits": 12 * 50304 * tokens,
                     "activations": 136 * cfg.n_embd * tokens * cfg.n_layer}
    bf16, _ = placement.footprint(cfg, tc, n_params, one, "bfloat16")   # values of 2 bytes
    assert bf16 == {**parts, "logits": parts["logits"] / 2, "activations": parts["activations"] / 2}
    assert "MORE THAN IT HAS" not in line
    monkeypatch.setattr(os, "sysconf", lambda name: 1024 if name == "SC_PHYS_PAGES" else 4096)   # 4 MB
    assert "of the 0.0 GB this machine has for it; MORE THAN IT HAS: lower --batch_size" in \
        placement.sizing_line(cfg, tc, n_params, one)


def test_the_start_says_how_long_a_step_and_an_evaluation_take_at_least():
    """The time line: a rank's share of a step's FLOPs (flops_per_token per token of the global
    batch, over the world) and of an evaluation's (a third of them, over eval_iters batches of two
    splits) at the measured matmul rate; the rate is a real, positive measurement."""
    from plumbing import placement
    _, tc = options.parse_args(["--eval_iters=10", "--eval_interval=50"])
    line = placement.timing_line(3e6, 4096, tc, 2, 1e9)   # 3 MFLOP/token, 4,096 tokens, 2 ranks
    # step: 3e6 * 4096 / 2 / 1e9 = 6.1 s; evaluation: 2 * 10 * 1e6 * 4096 / 2 / 1e9 = 41 s
    assert line == ("time: at this device's matmul rate (1 GFLOP/s, measured now) a step takes "
                    "at least 6.1s and an evaluation (every 50 steps) 41.0s")
    assert "at least 6 ms and an evaluation (every 50 steps) 41 ms" in \
        placement.timing_line(3e6, 4096, tc, 2, 1e12)
    assert placement.matmul_rate("cpu", "float32", n=64, reps=2) > 1e6


@pytest.mark.slow
def test_resume_continues_the_recorded_run(capsys, tmp_path, data_dir):
    """--init_from=resume alone continues the run with the options it recorded (the model, the seed,
    the schedule), says when a given data option differs, and refuses a max_iters with nothing left."""
    run_train(tmp_path, data_dir, "--max_iters=4", "--eval_interval=2", "--n_layer=1", "--seed=7")
    capsys.readouterr()
    bare = [f"--out_dir={tmp_path}", f"--data_dir={data_dir}", "--init_from=resume", "--sample_tokens=0"]
    train.main([*bare, "--max_iters=6"])   # none of the model options given: they are the run's
    out = capsys.readouterr().out
    assert "resuming from" in out and "(iteration 4)" in out and "resume:" not in out
    assert [r["iter"] for r in metrics(tmp_path) if "loss" in r][-2:] == [4, 5]
    train.main([*bare, "--max_iters=8", "--seed=8"])
    assert "resume: seed=7 -> 8 (as given; the run had the first)" in capsys.readouterr().out
    expect_error(capsys, [*bare, "--max_iters=8"], "max_iters=8 is not past iteration 8", "pass a larger --max_iters")
    expect_error(capsys, [*bare, "--max_iters=10", "--n_layer=2"], "written with n_layer=1, this run has n_layer=2")
    expect_error(capsys, [*bare, "--max_iters=10", "--optimizer=muon"], "was trained with --optimizer=adamw",
                 "whose moments it does not hold: resume with --optimizer=adamw")


@pytest.mark.slow
def test_a_user_error_under_torchrun_is_one_line_and_status_2_on_every_rank(tmp_path, data_dir):
    res = torchrun(2, f"--out_dir={tmp_path}", f"--data_dir={data_dir}", *TINY, "--tp=2", "--mlp_width=99", check=False)
    said = [x for x in res.stderr.splitlines() if x.startswith("error: tp=2 does not divide mlp_width=99")]
    assert len(said) == 1, res.stderr[-2000:]   # (once, by rank 0)
    # torchrun's report: each rank exits 2, unless torchrun ended it first (SIGTERM) once a peer had
    codes = re.findall(r"exitcode  : (-?\d+)", res.stderr)
    assert res.returncode != 0 and "2" in codes and set(codes) <= {"2", "-15"}, res.stderr[-2000:]
    # torchrun's summary, the last thing it prints, ends with the line (the rank's error file)
    root = res.stderr[res.stderr.index("Root Cause"):]
    assert "traceback : error: tp=2 does not divide mlp_width=99" in root, root


def test_a_config_file_that_is_not_utf8_is_named(capsys, tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes("n_layer = 2\n# caf\xe9 au lait\n".encode("latin-1"))
    expect_error(capsys, [str(path)], f"config file {path} is not UTF-8 text")


def test_profile_of_a_resumed_run_says_how_many_steps_its_trace_holds(capsys, tmp_path, data_dir):
    run_train(tmp_path, data_dir, "--max_iters=4", "--eval_interval=2")
    capsys.readouterr()
    run_train(tmp_path, data_dir, "--max_iters=6", "--eval_interval=2", "--init_from=resume", "--profile=1:3")
    out = capsys.readouterr().out
    assert "(1 steps after the first 1 of this run)" in out, out   # 2 steps left: 1 waits, 1 is traced
    assert json.loads((tmp_path / "trace" / "rank0.json").read_text())["traceEvents"]
