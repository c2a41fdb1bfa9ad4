"""test_usability.py: what a user meets: the CPU threads a run chooses, its log's start line, a
stop signal during a resume or an evaluation, a model too large refused, a resume from elsewhere,
outputs that cannot be written, sampling, the named tokenizers as Hugging Face files.

Not in the BOOST paper (arXiv 2512.12131): the running of its training loop on a shared machine.
"""
import dataclasses
import os
import re

import pytest
import torch

from plumbing import options, placement, plan as plans
from conftest import TINY


def test_threads_are_chosen_from_the_idle_cores(monkeypatch):
    """--threads wins, then OMP_NUM_THREADS; else the cores other work leaves idle, shared by the
    machine's ranks, never fewer than one; a GPU run keeps PyTorch's choice."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(placement, "busy_now", lambda: (0.2, "a stand-in"))
    assert placement.choose_threads(0, "cpu", 1)[0] == cores
    assert placement.choose_threads(3, "cpu", 1) == (3, "--threads")
    monkeypatch.setattr(placement, "busy_now", lambda: (cores + 5.0, "a stand-in"))   # busy
    n, why = placement.choose_threads(0, "cpu", 1)
    assert n == 1 and f"{cores} cores, {cores - 1} busy by a stand-in" in why
    monkeypatch.setattr(placement, "busy_now", lambda: (0.0, "a stand-in"))
    assert placement.choose_threads(0, "cpu", 2 * cores)[0] == 1
    assert placement.choose_threads(0, "cuda:0", 1)[0] == torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert placement.choose_threads(0, "cpu", 1) == (1, "OMP_NUM_THREADS")


def test_busy_cores_are_read_now_not_a_minute_ago(tmp_path):
    """busy_now counts the CPU time between two readings of /proc/stat taken now (the load average
    would still count a job that ended a minute ago): given two snapshots in which one of the
    machine's cores worked the whole interval and the rest idled, one core is busy; given the
    machine's own /proc/stat, a number of cores between 0 and all of them, whatever else runs."""
    import os
    stat = tmp_path / "stat"
    cores = os.cpu_count() or 1
    stat.write_text("cpu  100 0 50 1000 10 0 0 0 0 0\n")
    # the interval: 100 jiffies of user time (one core), 100 a core of idle on the others
    later = f"cpu  200 0 50 {1000 + 100 * (cores - 1)} 10 0 0 0 0 0\n"
    busy, how = placement.busy_now(0.25, stat=stat, wait=lambda s: stat.write_text(later))
    assert busy == pytest.approx(1.0) and "/proc/stat" in how
    real, how = placement.busy_now(0.1)
    assert 0.0 <= real <= cores and "/proc/stat" in how


def test_a_run_sets_its_threads_and_says_so(monkeypatch):
    """place_processes sets torch's threads (the real call) and names them for the log."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    cfg, tc = options.parse_args(["--threads=1", "--n_layer=1", "--n_embd=32", "--n_head=4"])
    try:
        place = placement.place_processes(plans.make(cfg, tc, 1))
        assert torch.get_num_threads() == 1 and place.threads == "1 thread (--threads)"
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="threads=-1 must not be negative"):
        options.parse_args(["--threads=-1"])


def test_the_start_line_names_every_choice_not_at_its_default():
    """options.chosen: what differs from the defaults, derived model fields (r = d/4) left out."""
    cfg, tc = options.parse_args(["--recompute=lowrank", "--n_embd=64", "--lax=true"])
    assert options.chosen(cfg, tc).split() == ["n_embd=64", "lax=True", "recompute=lowrank"]
    assert options.chosen(*options.parse_args([])) == "all defaults"
    assert "attn_rank=8" in options.chosen(*options.parse_args(["--attn_rank=8"]))


def test_the_log_says_what_runs(tmp_path, data_dir, capsys):
    """A short run's log: the options line, no eta at the first step and one after it (from the
    recent steps), and a line before the sample at the end."""
    from conftest import run_train
    run_train(tmp_path / "out", data_dir, "--max_iters=3", "--log_interval=1", "--sample_tokens=4",
              "--recompute=layer")
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("options: ") and "recompute=layer" in line for line in out)
    iters = [line for line in out if line.startswith("iter ")]
    assert iters[0].endswith("eta -") and not iters[1].endswith("eta -")
    assert "sampling 4 tokens (--sample_tokens=0: none)" in out


@pytest.mark.parametrize("phase", ["checksums", "load", "first step"])
def test_a_stop_signal_during_a_resume_loses_nothing(tmp_path, data_dir, capsys, monkeypatch,
                                                     phase):
    """SIGTERM while a resume verifies or reads its newest checkpoint (the real DCP load, the
    signal raised inside it): the load completes, nothing is skipped, written or pruned, exit
    128+15; during the first step: that step is finished and saved, as in any run."""
    import signal
    import train
    from conftest import run_train
    from plumbing import integrity
    out = tmp_path / "out"
    run_train(out, data_dir, "--max_iters=4", "--eval_interval=2")
    def files():   # (the lock file is taken by every launch)
        return sorted((p.name, p.stat().st_mtime_ns) for p in out.rglob("*") if p.name != "run.lock")
    before = files()
    capsys.readouterr()

    def signalling(real):
        def call(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)   # (the handler runs inside the real call)
            return real(*args, **kwargs)
        return call
    where = {"checksums": (integrity, "verify"), "load": (integrity.Reader, "read_data"),
             "first step": (train, "train_step")}[phase]
    monkeypatch.setattr(*where, signalling(getattr(*where)))
    with pytest.raises(SystemExit) as e:
        run_train(out, data_dir, "--max_iters=8", "--eval_interval=2", "--init_from=resume")
    log = capsys.readouterr().out
    assert e.value.code == 128 + signal.SIGTERM and "skipping" not in log
    if phase == "first step":
        assert "interrupted at iteration 5" in log and (out / "checkpoints/iter_0000005").is_dir()
    else:
        assert "stopped before training (nothing written" in log and "iter 4" not in log
        assert files() == before


def test_a_resume_from_elsewhere_trains_on_the_recorded_corpus(tmp_path, monkeypatch, capsys):
    """--dataset given relative is recorded resolved: a resume launched from another working
    directory (holding its own corpus.txt) reads the run's; a corpus changed under the run is
    refused in one line, unless named again, then said."""
    import random
    from conftest import run_train
    rng = random.Random(0)
    for folder, words in (("a", ["alpha", "beta", "gamma"]), ("b", ["delta", "epsilon"])):
        (tmp_path / folder).mkdir()
        text = " ".join(rng.choice(words) for _ in range(40000))
        (tmp_path / folder / "corpus.txt").write_text(text)
    out, data_dir = tmp_path / "out", tmp_path / "data"
    monkeypatch.chdir(tmp_path / "a")
    run_train(out, data_dir, "--max_iters=2", "--eval_interval=2", "--dataset=corpus.txt")
    monkeypatch.chdir(tmp_path / "b")
    capsys.readouterr()
    run_train(out, data_dir, "--max_iters=4", "--eval_interval=2", "--init_from=resume")
    assert "resuming from" in capsys.readouterr().out
    (tmp_path / "a" / "corpus.txt").write_text((tmp_path / "b" / "corpus.txt").read_text())
    with pytest.raises(SystemExit) as e:
        run_train(out, data_dir, "--max_iters=6", "--eval_interval=2", "--init_from=resume")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "was trained on" in err
    run_train(out, data_dir, "--max_iters=6", "--eval_interval=2", "--init_from=resume",
              f"--dataset={tmp_path / 'a' / 'corpus.txt'}")
    assert "as named by --dataset" in capsys.readouterr().out


@pytest.mark.slow
def test_an_output_that_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path, data_dir):
    """interchange.py's exports (hf, pt) and import under a 64 KB file-size limit (the real writers
    fail as on a full disk, with EFBIG): one line naming the target and the cause, no half-written
    folder or file left, and the same command then succeeds."""
    import resource
    import subprocess
    import sys
    from conftest import ROOT, run_train
    from plumbing import train_state
    run_train(tmp_path / "run", data_dir, "--max_iters=2", "--eval_interval=2")
    ckpt = train_state.checkpoint_dirs(tmp_path / "run")[-1]

    def interchange(*args, limit=None):
        def cap():
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        return subprocess.run([sys.executable, str(ROOT / "interchange.py"), *map(str, args)],
                              capture_output=True, text=True, timeout=120,
                              preexec_fn=cap if limit else None)
    import interchange as commands
    for args, target in ((["export", ckpt, tmp_path / "hf", "--format=hf"], tmp_path / "hf"),
                         (["export", ckpt, tmp_path / "m.pt"], tmp_path / "m.pt"),
                         (["import", tmp_path / "hf", tmp_path / "imported"],
                          tmp_path / "imported")):
        before = sorted(p.name for p in tmp_path.iterdir())
        res = interchange(*args, limit=64 << 10)
        err = res.stderr.strip()
        assert res.returncode == 2 and err.startswith("error: cannot write ") and "\n" not in err
        assert str(target) in err and "File too large" in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == before   # (no .tmp, no half folder)
        commands.cli([str(a) for a in args])   # (the retry succeeds, in this process)
        assert target.exists()


def test_sample_reads_an_out_dir_and_says_when_the_prompt_is_cut(tmp_path, data_dir):
    """interchange.py sample from an out_dir (its newest checkpoint) equals the sample from that
    checkpoint's exported file; a prompt past block_size is said; an empty sequence is one
    ValueError, in the model and in the exported Hugging Face code."""
    import interchange
    import model
    from conftest import command_out, run_train
    run_train(tmp_path / "run", data_dir, "--max_iters=2", "--eval_interval=2")
    assert interchange.cli(["export", str(tmp_path / "run" / "checkpoints" / "iter_0000002"),
                            str(tmp_path / "m.pt")]) is None
    runs = [command_out(interchange.cli, "sample", str(src), "8", "--prompt=" + "x" * 40)
            for src in (tmp_path / "run", tmp_path / "m.pt")]
    assert runs[0][0] == 0 and runs[0][1] == runs[1][1] and runs[0][1].strip()
    assert "note: the prompt is 41 tokens, more than block_size 32: the model sees its last 32" \
        in runs[0][2]
    m = model.Llama(model.Config(n_layer=1, n_embd=32, n_head=4))
    with pytest.raises(ValueError, match="a sequence of 0 tokens: it needs 1 to block_size=128"):
        m(torch.zeros(1, 0, dtype=torch.long))


@pytest.mark.parametrize("name", ["bytes", "gpt2"])
def test_the_named_tokenizers_export_as_hugging_face_files(tmp_path, name):
    """write_for_hf's tokenizer.json for bytes and gpt2: AutoTokenizer gives the project's ids on
    random text (ASCII, Latin, CJK, emoji, whitespace runs) and decodes them back; eos is
    <|endoftext|> at the project's id; an import of the folder names the tokenizer again."""
    import random
    from plumbing import tokenizer
    if name == "gpt2" and "TIKTOKEN_CACHE_DIR" not in os.environ:
        pytest.skip("TIKTOKEN_CACHE_DIR is not set: no GPT-2 vocabulary without a download")
    from transformers import AutoTokenizer
    tokenizer.write_for_hf(name, tmp_path)
    hf, enc = AutoTokenizer.from_pretrained(str(tmp_path)), tokenizer.load(name)
    rng = random.Random(0)
    pools = [range(32, 127), range(0xA0, 0x250), range(0x4E00, 0x4F00), range(0x1F600, 0x1F650),
             [10, 32, 9]]
    for _ in range(200):
        text = "".join(chr(rng.choice(rng.choice(pools))) for _ in range(rng.randrange(1, 80)))
        ids = hf.encode(text, add_special_tokens=False)
        assert ids == enc.encode_ordinary(text) and hf.decode(ids) == text, repr(text)
    assert (hf.eos_token, hf.eos_token_id) == ("<|endoftext|>", enc.eot_token)
    assert tokenizer.in_folder(tmp_path) == name


@pytest.mark.parametrize("argv, fragment", [
    (["--pp_schedule=zbv"], "--pp_schedule=zbv schedules a pipeline: it needs --pp > 1"),
    (["--pp_schedule=dualpipev", "--tp=2"], "--pp_schedule=dualpipev schedules a pipeline"),
    (["--pp=2", "--gradient_accumulation_steps=2", "--inject_fault=nan:5"], "not with --pp > 1"),
    (["--pp=2", "--gradient_accumulation_steps=2", "--compile=true"], "leave --compile off with --pp > 1")])
def test_a_pipeline_option_without_its_pipeline_is_refused_before_work(argv, fragment):
    """A schedule with no pipeline (it built two stages on one rank and crashed at the first
    evaluation), a NaN fault a pipeline would never inject, and compile, which a pipeline's stages
    never ran (they trained eager, silently): one line, before any work."""
    cfg, tc = options.parse_args([*TINY, *argv])
    world = tc.tp * tc.pp
    with pytest.raises(ValueError, match=re.escape(fragment)):
        plans.make(cfg, tc, world)


def test_resuming_with_a_longer_schedule_says_the_rate_jumps():
    """A finished 2000-step run resumed with --max_iters=3000: the cosine is stretched, so the rate
    at iteration 2000 jumps from min_lr up; one line says so and how to keep the old schedule."""
    import train
    old = options.parse_args(["--max_iters=2000", "--learning_rate=1e-3", "--min_lr=1e-4"])[1]
    new = options.parse_args(["--max_iters=3000", "--learning_rate=1e-3", "--min_lr=1e-4"])[1]
    recorded, logged = dataclasses.asdict(old), []
    said = plans.say_schedule_change(recorded, new, 2000, train.get_lr, logged.append)
    assert said.startswith("the learning-rate schedule changes on resuming: 1.00e-04 at iteration 2000")
    assert "--lr_decay_iters=2000" in said and logged == [said]
    kept = options.parse_args(["--max_iters=3000", "--lr_decay_iters=2000", "--learning_rate=1e-3",
                               "--min_lr=1e-4"])[1]
    assert plans.say_schedule_change(recorded, kept, 2000, train.get_lr, logged.append) is None
    assert plans.say_schedule_change(recorded, old, 1500, train.get_lr, logged.append) is None


@pytest.mark.parametrize("extra", [[], ["--arch=full"], ["--arch=svd", "--lax=true", "--lax_gate=kron"]])
def test_the_parameter_count_is_arithmetic_and_exact(extra):
    """placement.count_params (one layer on the meta device, times n_layer) equals the built
    model's count, LaX's gates included."""
    from model import Llama
    cfg, _ = options.parse_args([*TINY, "--n_layer=3", *extra])
    cfg.vocab_size = 300
    with torch.device("meta"):
        assert placement.count_params(cfg) == Llama(cfg).num_params()


@pytest.mark.parametrize("argv", [["--n_layer=1000000"], ["--n_layer=99999999999999999999"],
                                  ["--n_embd=65536", "--n_head=64"]])
def test_a_model_no_rank_can_hold_is_one_line_before_anything(tmp_path, capsys, argv):
    """It built layer after layer for hours with no output: the state's 16 bytes a parameter are
    counted first, and one line refuses what exceeds the machine, before any corpus or folder."""
    from conftest import expect_error
    out = tmp_path / "out"
    expect_error(capsys, [*TINY, f"--out_dir={out}", f"--data_dir={tmp_path / 'data'}", *argv],
                 "for its weights, gradients and AdamW moments, more than the", "more ranks")
    assert not out.exists() and not (tmp_path / "data").exists()


def test_a_stop_signal_during_an_evaluation_takes_effect_within_one_batch(tmp_path, data_dir,
                                                                         capsys, monkeypatch):
    """SIGINT during the step-0 evaluation of 50 batches (it ran on for 9 minutes on a large run):
    the evaluation stops before its next batch, step 0 is saved, exit 128+2."""
    import signal
    import train
    from conftest import run_train
    batches = []

    def shares(self, split, stream, step):
        batches.append(stream)
        if stream == "eval-train" and step == 1:
            os.kill(os.getpid(), signal.SIGINT)   # (the handler runs here, mid-evaluation)
        return real(self, split, stream, step)
    real = train.Run.shares
    monkeypatch.setattr(train.Run, "shares", shares)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        run_train(out, data_dir, "--max_iters=4", "--eval_interval=2", "--eval_iters=50")
    log = capsys.readouterr().out
    assert e.value.code == 128 + signal.SIGINT
    assert batches.count("eval-train") == 2 and "eval-val" not in batches   # (no batch after)
    assert "train" not in batches and "interrupted at iteration 0" in log    # (no step either)
    assert (out / "checkpoints/iter_0000000").is_dir()
