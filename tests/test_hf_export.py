"""test_hf_export.py: every architecture this project trains leaves as a Hugging Face folder that the
field's tools read (plumbing/formats.py, plumbing/hf_remote/): transformers' AutoModelForCausalLM with
the project's logits and generate(), lm-evaluation-harness's CLI on a task made here, import back
exact; and the held-out perplexity command (plumbing/heldout.py) equal at tp=1 and tp=2.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, command_out, launch, run_train
from model import Config, Llama
from plumbing import formats, options

# (name, model.Config keywords): dense and merged svd are transformers' Llama; the rest carry their code
ARCHS = [("full", dict(arch="full")),
         ("svd-merged", dict(arch="svd", mlp_gate="silu")),
         ("cola-gqa-tied", dict(arch="cola", n_kv_head=2, tie_embeddings=True)),
         ("cola-lax-kron", dict(arch="cola", lax=True, lax_gate="kron")),
         ("cola-lax-identity-silu-tied", dict(arch="cola", lax=True, lax_gate="identity", mlp_gate="silu",
                                              tie_embeddings=True)),
         ("svd-lax-linear-gqa", dict(arch="svd", lax=True, lax_gate="linear", n_kv_head=2)),
         ("svd-nogate", dict(arch="svd", mlp_gate="none"))]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE tokenizer.json of 300 tokens with <|endoftext|> (AutoTokenizer reads it)."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([topics[k] for k in sorted(topics)[:40]],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, bpe):
    """{name: (the model, its exported folder)} for every architecture (random weights, seeded)."""
    out = {}
    for name, kw in ARCHS:
        torch.manual_seed(0)
        cfg = Config(n_layer=3, n_embd=32, n_head=4, block_size=16, vocab_size=options.vocab_size(bpe), **kw)
        model = Llama(cfg).eval()
        folder = tmp_path_factory.mktemp("hf") / name
        formats.write(str(folder), model.state_dict(), cfg, "hf", bpe)
        out[name] = model, folder
    return out


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No hub, no network; the remote code's module cache in this test's folder."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


def test_transformers_reads_every_architecture_with_the_projects_logits(folders):
    """From the project's folder (on sys.path, as pytest puts it), with Hugging Face's `kernels`
    package installed (transformers 5.25 imports it on load: a root kernels.py broke this)."""
    import kernels
    assert "site-packages" in Path(kernels.__file__).parts, kernels.__file__   # (not ours)
    assert str(ROOT) in map(os.path.abspath, sys.path)
    from transformers import AutoModelForCausalLM
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for name, (model, folder) in folders.items():
        config = json.loads((folder / "config.json").read_text())
        remote = config["model_type"] == "boost"
        assert remote == (name not in ("full", "svd-merged")), name
        assert ({"configuration_boost.py", "modeling_boost.py"} <= set(os.listdir(folder))) == remote
        hf = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True).eval()
        with torch.no_grad():
            want = model(idx, idx)[0]
            got = hf(idx).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
            if remote:   # left padding with its mask: the padded row's tokens as without padding
                pad = torch.cat([torch.zeros(1, 5, dtype=torch.long), idx[:1, :11]], 1)
                mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 11, dtype=torch.long)], 1)
                torch.testing.assert_close(hf(pad, attention_mask=mask).logits[:, 5:], model(idx[:1, :11], idx[:1, :11])[0],
                                           rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} padded: {m}")
            out = hf.generate(idx[:1, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
            greedy = idx[:1, :8]
            for _ in range(4):
                greedy = torch.cat([greedy, model(greedy)[0][:, -1].argmax(-1, keepdim=True)], 1)
            assert torch.equal(out, greedy), (name, out, greedy)
            if remote:   # an empty input: one clear error, not a reshape deep inside
                with pytest.raises(ValueError, match="input_ids holds no tokens"):
                    hf(idx[:, :0])


def test_every_exported_file_is_readable_as_the_others(folders):
    """model.safetensors (which safetensors writes 0600) has config.json's mode: a model folder
    shared with other users is readable whole."""
    for _, folder in folders.values():
        modes = {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}
        assert modes["model.safetensors"] == modes["config.json"], modes


def test_import_reads_every_folder_back_exactly(folders):
    for name, (model, folder) in folders.items():
        kw, state, tokenizer = formats.read(str(folder))
        assert Config(**kw).shape() == {**model.cfg.shape(), **({"arch": "full"} if name == "svd-merged" else {})}
        if name == "svd-merged":   # W = B·A: the dense model it computes
            continue
        mine = model.state_dict()
        assert set(state) == set(mine), name
        for key, t in mine.items():
            assert torch.equal(state[key], t), (name, key)


def test_a_damaged_boost_config_is_one_line(folders, tmp_path):
    _, folder = folders["cola-lax-kron"]
    config = json.loads((folder / "config.json").read_text())
    for key, value, said in [("lax", "yes", "config.json's lax='yes' is not a bool"),
                             ("attn_rank", 5, "layers.0.self_attn.q_proj.A.weight"),
                             ("mlp_rank", True, "config.json's mlp_rank=True is not a int"),
                             ("lax_gate", "cubic", "lax_gate=cubic is not one of")]:
        bad = tmp_path / key
        bad.mkdir()
        for f in os.listdir(folder):
            (bad / f).write_bytes((folder / f).read_bytes())
        (bad / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=re.escape(said)):
            formats.read(str(bad))


TASK = """task: boost_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


# lm_eval's CLI (its console script's function) once per argv given as JSON, in one process: its imports
# once, and its index of the ~14,000 task files it ships (7 s of YAML parsing a call) built once
CLI_EACH = """import json, sys
from lm_eval.tasks import _index
build, built = _index.TaskIndex.build, {}
def once(paths, **kw):
    key = tuple(map(str, paths))
    built[key] = built.get(key) or build(paths, **kw)
    return dict(built[key])
_index.TaskIndex.build = staticmethod(once)
from lm_eval.__main__ import cli_evaluate
for argv in json.loads(sys.argv[1]):
    sys.argv = ["lm_eval", *argv]
    cli_evaluate()
"""


@pytest.mark.slow
def test_lm_eval_cli_runs_on_every_architecture(folders, tmp_path):
    """`lm_eval --model hf --model_args pretrained=FOLDER,trust_remote_code=True` with a local JSON
    Lines multiple-choice task (--include_path; no hub, no network) on every architecture's folder,
    through the `lm_eval` command's own function (its console script) in one process, so that its
    imports and task index are made once; each accuracy parsed from its results file, a fraction of
    the task's 6 questions."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    rows = [{"question": f"{a} plus {b} is", "choices": [f" {a + b}", f" {a + b + 1}"], "answer": 0}
            for a, b in [(1, 2), (3, 4), (5, 1), (2, 2), (7, 1), (4, 5)]]
    (tasks / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "boost_local.yaml").write_text(TASK.format(data=tasks / "data.jsonl"))
    argv = {name: ["--model", "hf", "--model_args", f"pretrained={folder},trust_remote_code=True,dtype=float32",
                   "--tasks", "boost_local", "--include_path", str(tasks), "--device", "cpu", "--batch_size", "2",
                   "--output_path", str(tmp_path / "results" / name)] for name, (_, folder) in folders.items()}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run([sys.executable, "-c", CLI_EACH, json.dumps(list(argv.values()))], capture_output=True,
                         text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("|boost_local|") == len(argv), res.stdout[-2000:]   # (a results table for each)
    for name in argv:
        found = list((tmp_path / "results" / name).rglob("results*.json"))
        assert len(found) == 1, (name, found)
        acc = json.loads(found[0].read_text())["results"]["boost_local"]["acc,none"]
        assert acc in {k / 6 for k in range(7)}, (name, acc)


@pytest.mark.slow
def test_eval_command_gives_the_same_numbers_at_tp1_and_tp2(tmp_path, data_dir):
    """interchange.py eval: the held-out loss, perplexity and bits per byte of a checkpoint, the same
    at tp=2 (torchrun) as in one process; for the bytes tokenizer, bits per byte = loss / ln 2 per byte."""
    run_train(tmp_path / "run", data_dir, "--max_iters=3", "--eval_interval=3")
    ckpt = str(tmp_path / "run" / "checkpoints" / "iter_0000003")
    args = [ckpt, "--dataset=pydoc", f"--data_dir={data_dir}", "--tokens=1000", "--batch_size=4"]
    import interchange
    code, out, err = command_out(interchange.cli, "eval", *args)
    assert code == 0, err
    assert "note:" not in out   # (the run's val_fraction, by default)
    code, _, short = command_out(interchange.cli, "eval", *args[:3], "--tokens=1")
    assert code == 2 and "--tokens=1 is less than one sequence of block_size 32" in short, short
    # another held-out share than the run's: its val split holds trained-on documents, said so
    code, other, err = command_out(interchange.cli, "eval", ckpt, "--dataset=pydoc", "--tokens=64",
                                   f"--data_dir={tmp_path / 'd3'}", "--val_fraction=0.3")
    assert code == 0 and "note: --val_fraction=0.3, where the run held out 0.1" in other, err
    res = launch(2, [str(ROOT / "interchange.py"), "eval", *args, "--tp=2"], 300)
    line = lambda text: re.search(r"loss ([\d.]+), perplexity ([\d.]+), bits per byte ([\d.]+)", text)
    one, two = ([float(v) for v in line(text).groups()] for text in (out, res.stdout))
    assert one == two and res.stdout.count("eval ") == 1, (one, two, res.stdout)
    assert "992 tokens of the val split of pydoc (31 sequences of 32)" in out, out
    loss, _, bpb = one
    n_bytes = int(re.search(r"([\d,]+) bytes", out).group(1).replace(",", ""))
    assert abs(bpb - loss / 0.6931471805599453 * 992 / n_bytes) < 2e-4 and 992 <= n_bytes <= 992 * 1.02


def test_eval_refuses_token_ids_past_the_models_vocabulary(data_dir):
    """interchange.py eval compares the prepared files' max_id with the model's vocabulary (it
    ended in an embedding's IndexError): one line, as train.py says it."""
    from plumbing import heldout
    folder = next(p.parent for p in data_dir.rglob("meta.json"))
    assert heldout.sequences(folder, "val", 64, 32, 320).shape == (2, 33)
    with pytest.raises(ValueError, match="holds token ids up to .*, the model's vocabulary has 64"):
        heldout.sequences(folder, "val", 64, 32, 64)
