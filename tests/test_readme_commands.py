"""test_readme_commands.py: every command the README shows runs as shown, in order, on a fresh folder:
the Quick start's `make train` (its train.py), then each main command, then the papers' CoLA-60M
block; so a documented command can never fail unnoticed again.

Shrunk where it must be, and only so: every train.py run gets a tiny shape (the options after the
command's own, which they override) and its iteration numbers divided by 500 (2000 -> 4, 3000 -> 6,
500 -> 1, and a checkpoint's iter_NNNNNNN alike); `path/to/...` placeholders become a corpus and a
SentencePiece model made here; the bench gets one iteration at tp=2. Skipped: `make test`
(this suite) and pip installs; the GPU check must say in one line that there is no CUDA device.
The first torchrun command runs torchrun's agent; the later ones start the same ranks with the same
arguments as the agent would (conftest.launch), without its process (3 s each).
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, command, launch

IN_PROCESS = {"train.py": lambda: __import__("train").main, "prepare.py": lambda: __import__("prepare").main,
              "interchange.py": lambda: __import__("interchange").cli}   # the rest run as processes

TINY_SHAPE = ["--n_layer=2", "--n_head=4", "--n_kv_head=2", "--n_embd=32", "--block_size=32", "--batch_size=2",
              "--attn_rank=8", "--mlp_rank=8", "--mlp_width=64", "--eval_iters=1", "--eval_interval=2",
              "--sample_tokens=0", "--num_proc=1"]
AGENT = ["-m", "torch.distributed.run", "--standalone"]   # torchrun's agent, then --nproc_per_node


def readme_commands():
    """The README's bash blocks as commands, in order (continuation lines joined, comments kept out)."""
    text = (ROOT / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                out.append(argv)
    return out


def scaled(arg):
    """--max_iters and iter_NNNNNNN divided by 500 (at least 1)."""
    arg = re.sub(r"iter_(\d{7})", lambda m: f"iter_{max(1, int(m.group(1)) // 500):07d}", arg)
    m = re.fullmatch(r"--max_iters=(\d+)", arg)
    return f"--max_iters={max(1, int(m.group(1)) // 500)}" if m else arg


def shrink(argv, made):
    """The command to run for a README command (None: skipped) and the exit status it must give."""
    if argv[:2] == ["make", "test"] or argv[0].endswith("pip"):
        return None, 0
    if argv == ["make", "train"]:
        argv = [".venv/bin/python", "train.py"]
    start = {".venv/bin/python": [sys.executable], "python3": [sys.executable], "python": [sys.executable],
             ".venv/bin/torchrun": [sys.executable, "-m", "torch.distributed.run"],
             ".venv/bin/lm_eval": [sys.executable, "-m", "lm_eval"]}[argv[0]]
    args = [made.get(a.split("=", 1)[-1], {}).get(a, a) if "path/to" in a else scaled(a) for a in argv[1:]]
    args = [str(ROOT / a) if (ROOT / a).is_file() and a.endswith((".py", ".toml")) else a for a in args]
    script = next((a for a in args if a.endswith(".py")), "")
    if script.endswith("train.py") and "-h" not in args:
        args += TINY_SHAPE + ([] if any(a.startswith("--max_iters") for a in argv) else ["--max_iters=4"])
    if script.endswith("bench.py"):
        args += ["--iters=1", "--tp=2", f"--json_dir={made['tmp']}/bench", "--n_embd=64", "--n_layer=2",
                 "--block_size=32", "--batch_size=2"]
    if script.endswith("gpu_check.py"):
        return start + args, 2   # (no CUDA device here: one line)
    return start + args, 0


@pytest.fixture
def placeholders(tmp_path):
    """What the README's path/to/... stand for: a corpus folder and a SentencePiece .model."""
    import sentencepiece as spm
    from pydoc_data.topics import topics
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, key in enumerate(sorted(topics)[:60]):
        (corpus / f"{i:03d}.txt").write_text(topics[key])
    spm.SentencePieceTrainer.train(input=str(next(corpus.iterdir())), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=400, model_type="bpe", minloglevel=2, byte_fallback=True,
                                   character_coverage=0.995)
    sp = str(tmp_path / "sp.model")
    return {"tmp": str(tmp_path), "path/to/corpus": {"--dataset=path/to/corpus": f"--dataset={corpus}"},
            "path/to/llama2/tokenizer.model": {"--tokenizer=path/to/llama2/tokenizer.model": f"--tokenizer={sp}"},
            "path/to/fineweb/sample/10BT": {"--dataset=path/to/fineweb/sample/10BT": f"--dataset={corpus}"}}


@pytest.mark.slow
def test_every_readme_command_runs_as_shown(tmp_path, placeholders, monkeypatch):
    if "TIKTOKEN_CACHE_DIR" not in os.environ:
        pytest.skip("the README's gpt2 commands need the GPT-2 vocabulary (TIKTOKEN_CACHE_DIR)")
    work = tmp_path / "work"   # (the repository's root, as the commands are shown: its docs/tasks)
    shutil.copytree(ROOT / "docs" / "tasks", work / "docs" / "tasks")
    ran = ran_agent = 0
    for argv in readme_commands():
        cmd, status = shrink(argv, placeholders)
        if cmd is None:
            continue
        shown = " ".join(argv)
        if cmd[0] == sys.executable and Path(cmd[1]).name in IN_PROCESS:   # (as its process would, faster)
            monkeypatch.chdir(work)
            code, err = command(IN_PROCESS[Path(cmd[1]).name](), *cmd[2:])
            assert code == status, f"{shown}\n{err}"
            ran += 1
            continue
        if cmd[1:4] == AGENT and (ran_agent := ran_agent + 1) > 1:   # (the first with the agent)
            launch(int(cmd[4].split("=")[1]), cmd[5:], 240, cwd=work)
            ran += 1
            continue
        res = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=240,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert res.returncode == status, f"{shown}\n{res.stdout[-1500:]}\n{res.stderr[-2500:]}"
        if "lm_eval" in cmd:   # its table, with the local task's accuracy
            assert re.search(r"\|\s*arith\s*\|", res.stdout), res.stdout[-1500:]
        if status:
            assert res.stderr.startswith("error: no CUDA device") and res.stderr.count("\n") == 1, res.stderr
        ran += 1
    assert ran >= 18 and (work / "hf_model" / "config.json").exists() and (work / "runs.png").exists()
    assert (work / "hf_out" / "tokenizer.json").exists()   # (make train's bytes, for lm-eval)
    bench = (tmp_path / "bench" / "bench-layouts.json").read_text()   # (test_tools.py runs the others)
    assert all(name in bench for name in ("cola/btp recompute=lowrank", "cola/vanilla", "full/megatron"))
