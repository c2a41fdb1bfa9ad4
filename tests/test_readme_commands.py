"""test_readme_commands.py: every command the README and docs/ show runs as shown, in the order a
reader meets them, in one fresh folder: the README's (the Quick start's `make train`, each main
command, the papers' CoLA-60M block), then each page of docs/ in the order the README links them;
so a documented command can never fail unnoticed again. A docs command the reader has already run
(the same words) is not run twice; skipped as this suite cannot run them: `make test*`, pytest,
pip installs, lm_eval's hub tasks (hellaswag, arc_easy: they download) and torchrun across nodes.

Shrunk where it must be, and only so: every train.py run gets a tiny shape (the options after the
command's own, which they override) and its iteration numbers divided by 500 from 500 up (2000 -> 4,
3000 -> 6, 500 -> 1, and a checkpoint's iter_NNNNNNN alike), at most 10 below; an evaluation's
`--tokens` divided by 1000; `path/to/...` placeholders become a corpus and a SentencePiece model
made here; the bench gets one iteration at tp=2. Skipped: `make test`
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


def md_commands(path):
    """A page's bash blocks as commands, in order (continuation lines joined, comments kept out)."""
    text = path.read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                out.append(argv)
    return out


def docs_in_reading_order():
    """docs/'s pages: those the README links, in the order it links them, then the rest."""
    linked = dict.fromkeys(re.findall(r"docs/([\w-]+\.md)", (ROOT / "README.md").read_text()))
    return [ROOT / "docs" / name for name in [*linked, *sorted(
        p.name for p in (ROOT / "docs").glob("*.md") if p.name not in linked)]]


def steps(n):
    """An iteration count shrunk: from 500 up divided by 500 (2000 -> 4), below it at most 10."""
    return n // 500 if n >= 500 else min(n, 10)


def scaled(arg):
    """--max_iters and iter_NNNNNNN shrunk by steps(), an evaluation's --tokens by 1000."""
    arg = re.sub(r"iter_(\d{7})", lambda m: f"iter_{steps(int(m.group(1))):07d}", arg)
    arg = re.sub(r"^--tokens=(\d+)$", lambda m: f"--tokens={int(m.group(1)) // 1000}", arg)
    m = re.fullmatch(r"--max_iters=(\d+)", arg)
    return f"--max_iters={steps(int(m.group(1)))}" if m else arg


def shrink(argv, made):
    """The command to run for a README command (None: skipped) and the exit status it must give."""
    hub = any(t in a for a in argv for t in ("hellaswag", "arc_easy"))
    if argv[0] == "make" and argv[1].startswith("test") or argv[0].endswith("pip") or hub \
            or argv[1:3] == ["-m", "pytest"] or any(a.startswith("--nnodes=") for a in argv):
        return None, 0
    if argv == ["make", "train"]:
        argv = [".venv/bin/python", "train.py"]
    start = {".venv/bin/python": [sys.executable], "python3": [sys.executable], "python": [sys.executable],
             ".venv/bin/torchrun": [sys.executable, "-m", "torch.distributed.run"],
             ".venv/bin/lm_eval": [sys.executable, "-m", "lm_eval"],
             "lm_eval": [sys.executable, "-m", "lm_eval"]}[argv[0]]
    args = [made.get(a.split("=", 1)[-1], {}).get(a, a) if "path/to" in a else scaled(a) for a in argv[1:]]
    args = [str(ROOT / a) if (ROOT / a).is_file() and a.endswith((".py", ".toml")) else a for a in args]
    script = next((a for a in args if a.endswith(".py")), "")
    if script.endswith("train.py") and "-h" not in args:
        args += TINY_SHAPE + ([] if any(a.startswith("--max_iters") for a in argv) else ["--max_iters=4"])
    if script.endswith("bench.py"):
        args += ["--iters=1", f"--json_dir={made['tmp']}/bench", "--n_embd=64", "--n_layer=2",
                 "--block_size=32", "--batch_size=2"] + (["--tp=2"] if "layouts" in args else [])
    if script.endswith("gpu_check.py") or (script.endswith("bench.py") and
                                          ("gpu" in args or "--tier=gpu" in args)):
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
            "path/to/tokenizer.model": {"--tokenizer=path/to/tokenizer.model": f"--tokenizer={sp}"},
            "path/to/texts": {"--dataset=path/to/texts": f"--dataset={corpus}"},
            "path/to/fineweb_jsonl_gz": {"--dataset=path/to/fineweb_jsonl_gz": f"--dataset={corpus}"},
            "path/to/fineweb/sample/10BT": {"--dataset=path/to/fineweb/sample/10BT": f"--dataset={corpus}"}}


def run_as_shown(argv, made, work, monkeypatch, agent_used):
    """One documented command, shrunk, in `work`: whether it ran (False: skipped); a failure
    asserts with the command as shown. The first torchrun command runs torchrun's agent, the later
    ones conftest.launch (the same ranks, 3 s sooner each)."""
    cmd, status = shrink(argv, made)
    if cmd is None:
        return False
    shown = " ".join(argv)
    if cmd[0] == sys.executable and Path(cmd[1]).name in IN_PROCESS:   # (as its process would, faster)
        monkeypatch.chdir(work)
        code, err = command(IN_PROCESS[Path(cmd[1]).name](), *cmd[2:])
        assert code == status, f"{shown}\n{err}"
        return True
    if cmd[1:4] == AGENT and agent_used:
        try:
            launch(int(cmd[4].split("=")[1]), cmd[5:], 240, cwd=work)
        except AssertionError as e:
            raise AssertionError(f"{shown}\n{e}") from None
        return True
    res = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == status, f"{shown}\n{res.stdout[-1500:]}\n{res.stderr[-2500:]}"
    if "lm_eval" in " ".join(cmd):   # its table, with the local task's accuracy
        assert re.search(r"\|\s*arith\s*\|", res.stdout), res.stdout[-1500:]
    if status:   # (no CUDA device here: one line)
        assert res.stderr.startswith("error:") and "CUDA" in res.stderr, res.stderr
        assert res.stderr.count("\n") == 1, res.stderr
    return True


def run_pages(pages, work, made, monkeypatch):
    """Every command of `pages` in order in `work`, a command already run (the same words) once:
    how many ran."""
    done, agent_used = set(), False
    for page in pages:
        for argv in md_commands(page):
            if tuple(argv) in done:   # (a reader does not run the same command twice)
                continue
            if run_as_shown(argv, made, work, monkeypatch, agent_used):
                agent_used = agent_used or argv[0].endswith("torchrun")
                done.add(tuple(argv))
    return len(done)


@pytest.fixture
def work(tmp_path):
    """A folder laid out as the repository's root is for the commands shown (its docs/tasks)."""
    if "TIKTOKEN_CACHE_DIR" not in os.environ:
        pytest.skip("the README's gpt2 commands need the GPT-2 vocabulary (TIKTOKEN_CACHE_DIR)")
    work = tmp_path / "work"
    shutil.copytree(ROOT / "docs" / "tasks", work / "docs" / "tasks")
    (work / "docs" / "figures").mkdir()
    return work


@pytest.mark.slow
def test_every_readme_command_runs_as_shown(tmp_path, work, placeholders, monkeypatch):
    assert run_pages([ROOT / "README.md"], work, placeholders, monkeypatch) >= 18
    assert (work / "hf_model" / "config.json").exists()
    assert (work / "runs.png").exists() and (work / "hf_out" / "tokenizer.json").exists()
    bench = (tmp_path / "bench" / "bench-layouts.json").read_text()   # (test_tools: the rest)
    assert all(name in bench for name in ("cola/btp recompute=lowrank", "cola/vanilla",
                                          "full/megatron"))


@pytest.mark.docs
def test_every_docs_command_runs_as_shown(work, placeholders, monkeypatch):
    """The README's commands, then every docs page's (make test-docs: 2 min 53 s on the 2-core machine, idle)."""
    pages = [ROOT / "README.md", *docs_in_reading_order()]
    assert run_pages(pages, work, placeholders, monkeypatch) >= 40
    assert (work / "docs" / "figures" / "muon-2000.png").exists() and (work / "out2").is_dir()
