"""test_doc_numbers.py: every deterministic number the docs print is the code's: the papers' models'
parameter and FLOP counts (docs/models.md, model.py on the meta device), the TP traffic per layer
(docs/results.md and the README's table, layouts.per_layer_traffic), and the layouts table's
collectives, elements and bytes per step (docs/results.md, counted by tools/bench.py's own worker).
Timings are measurements and are not checked; a docs number that drifts from the code fails here.
"""
import re
import sys

import pytest
import torch

from layouts import per_layer_traffic
from model import Llama
from plumbing import options
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))


def rows(page, header):
    """The rows (lists of cells) of the markdown table under the line starting with `header`."""
    lines = (ROOT / page).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    out = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        out.append([cell.strip() for cell in line.strip("|").split("|")])
    return out


def counts(path, arch, vocab=32000):
    cfg, _ = options.parse_args([str(ROOT / "configs" / path), f"--arch={arch}"])
    cfg.vocab_size = vocab
    with torch.device("meta"):
        model = Llama(cfg)
    return model.num_params(), model.flops_per_token(cfg.block_size)


@pytest.mark.slow
def test_models_md_counts_are_model_pys():
    for model, file, arch, params, gflops, _ in rows("docs/models.md", "| model | file |"):
        file = file.strip("`")
        archs = ["full", "cola"] if "/" in params else [arch.split(",")[0].split()[0]]
        for a, p, g in zip(archs, params.split(" / "), gflops.split(" / ")):
            n, f = counts(file, a)
            assert p.split()[0] == f"{round(n / 1e6):,}M", (model, a, p, n)
            assert g == f"{f / 1e9:.2f}", (model, a, g, f)
    n, _ = counts("default.toml", "cola", vocab=320)
    assert "(0.40M at the bytes vocabulary)" in (ROOT / "docs/models.md").read_text() and f"{n / 1e6:.2f}" == "0.40"


def default_cfg(*extra):
    cfg, _ = options.parse_args(list(extra))
    return cfg


def test_traffic_tables_are_the_formulas():
    """results.md's traffic table (formula and measured columns; the ledger equals the formula:
    test_parallel_collectives.py) and the README's formula column, at the default shape."""
    for layout, fwd_f, bwd_f, fwd, bwd, ratio in rows("docs/results.md", "| layout | fwd formula"):
        lax = layout.endswith(" lax")   # (the rows as bench.py traffic prints them)
        cfg = default_cfg(*(["--lax=true"] if lax else []))
        want = per_layer_traffic(layout.split()[0], cfg)
        assert (int(fwd), int(bwd)) == want[:2], layout
        assert fwd_f.endswith(f"= {want[0]}") and bwd_f.endswith(f"= {want[1]}"), layout
        btp = per_layer_traffic("btp", cfg)[0]
        assert ratio == f"{want[0] / btp:.2f}", layout
    readme = {row[0]: row[1] for row in rows("README.md", "| layout | TP elements per token")}
    for name, layout in (("Megatron TP, dense model", "megatron"), ("vanilla low-rank TP", "vanilla"),
                         ("**BTP** (BOOST)", "btp")):
        assert readme[name].endswith(f"= {per_layer_traffic(layout, default_cfg()).fwd:,}"), name


@pytest.mark.slow
def test_layouts_table_counts_are_the_benchs():
    """The collectives, elements and MB per step of results.md's layouts table, counted by the bench's
    worker at its shape (one sequence, scaled by the batch: every count is per token); the tp=4 rows
    count what the tp=2 rows do (a rank's collectives do not depend on t under these layouts)."""
    import bench
    cfg, tc = options.parse_args(["--n_embd=256", "--n_layer=4", "--block_size=256", "--batch_size=8"])
    cfg.vocab_size = 320
    table = rows("docs/results.md", "| tp | variant | ms/step")
    names = [name for tp, name, *_ in table if tp == "2"]
    got = bench.measure(2, names, cfg, 1, 0)
    for tp, name, _, _, calls, elements, mb, *_ in table:
        if tp == "1":
            assert (calls, elements, mb) == ("0", "0", "0.00"), name
            continue
        r = got[name]
        assert (int(calls), elements, mb) == (r["tp_calls"], f"{r['tp_elements'] * tc.batch_size:,}",
                                              f"{r['tp_mb'] * tc.batch_size:.2f}"), (tp, name)


def test_every_command_in_the_docs_names_what_exists():
    """Each train.py, prepare.py and tools/*.py command the README and docs show: its --key options
    are train.py's (or the tool's own), its config files and scripts exist (the commands themselves
    run in test_readme_commands.py and the tests of each tool)."""
    known = set(options.options()) | {"key"}   # (--key=value: how the docs name the form)
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for command in re.findall(r"(?:^|[`\s])((?:\S*/)?train\.py[^`\n|]*)", page.read_text(), re.M):
            for key in re.findall(r"--(\w+)=", command):
                assert key in known, f"{page.name}: {command.strip()} names --{key}, which train.py has not"
        for path in re.findall(r"\b((?:configs|tools)/[a-z][\w.]*\.(?:toml|py|sh))\b", page.read_text()):
            assert (ROOT / path).exists(), f"{page.name} names {path}, which does not exist"


def test_startup_predictions_are_the_meta_models():
    """scale.md's predicted table (tools/bench.py startup): parameters, per rank and bytes, from
    the meta model as the bench counts them."""
    import bench_startup
    for name, params, per_rank, build, train, ckpt in rows("docs/scale.md", "| shape | parameters"):
        config, arch = name.split(" (")
        p = bench_startup.predict(config, arch.rstrip(")"))
        assert params == f"{p['params'] / 1e9:.2f}B" and per_rank == f"{p['per_rank'] / 1e6:,.0f}M"
        assert build == f"{p['build_before_gb']:.1f} / {p['build_now_gb']:.1f}", name
        assert train == f"{p['train_gb']:.1f} / {p['train_sharded_gb']:.1f}", name
        assert ckpt == f"{p['ckpt_before_gb']:.1f} / {p['ckpt_now_gb']:.1f}", name


def test_draw_table_counts_are_the_meta_models():
    """scale.md's draws table (tools/bench.py startup): each shape's parameters and rank 0's part
    at tp=4 under BTP, counted on the meta device."""
    import bench_startup
    found = rows("docs/scale.md", "| model | parameters | rank 0's part")
    assert [r[0] for r in found] == ["boost_1b (cola)", "boost_7b (cola)"]
    for name, params, part, *_ in found:
        ref, mine = bench_startup.draw_models(name.split(" (")[0])
        assert params == f"{ref.num_params() / 1e9:.2f}B", name
        assert part == f"{sum(p.numel() for p in mine.parameters()) / 1e6:,.0f}M", name


def test_models_md_worked_example_counts_are_the_codes():
    """The worked example's model (the default shape, cola with LaX, a 1,024-token tokenizer): its
    parameters and FLOPs as train.py printed them; its token and sequence counts from block_size."""
    text = (ROOT / "docs" / "models.md").read_text()
    cfg, _ = options.parse_args(["--arch=cola", "--lax=true"])
    cfg.vocab_size = 1024
    with torch.device("meta"):
        model = Llama(cfg)
    line = f"cola: {model.num_params() / 1e6:.2f}M parameters, {model.flops_per_token(cfg.block_size) / 1e6:.1f} MFLOP/token"
    assert line in text, line
    assert f"32,768 tokens of the val split of pydoc ({32768 // cfg.block_size} sequences of {cfg.block_size})" in text


def test_muon_md_counts_are_the_codes():
    """docs/muon.md's default run: the matrices Muon takes and their parameters, of the model's."""
    from extensions import muon
    cfg, _ = options.parse_args([])
    cfg.vocab_size = options.vocab_size("bytes")
    with torch.device("meta"):
        model = Llama(cfg)
    mats = muon.muon_params(model)
    text = " ".join((ROOT / "docs" / "muon.md").read_text().split())
    assert f"{len(mats)} factors ({sum(p.numel() for p in mats):,} of the model's {model.num_params():,} parameters)" in text
    # the per-layer traffic table: muon.per_layer_traffic at tp=2, by the Gram path and the gather
    table = {r[0].split()[0]: r[1:] for r in rows("docs/muon.md", "| layout | Gram path")}
    for layout in ("megatron", "vanilla", "btp"):
        c, _ = options.parse_args(["--arch=full"] if layout == "megatron" else [])
        want = [f"{muon.per_layer_traffic(layout, c, 2, prefer):,}" if layout == "btp" or prefer == "gather"
                else "-" for prefer in ("gram", "gather")]
        assert table[layout] == want, (layout, table[layout], want)


def test_muon_md_corpus_size_is_the_prepared_corpus(data_dir):
    """docs/muon.md's count of the embedded corpus's training tokens (bytes), as prepare.py writes it."""
    import json
    train = json.loads((data_dir / "pydoc-bytes" / "meta.json").read_text())["train_tokens"]
    text = " ".join((ROOT / "docs" / "muon.md").read_text().split())
    assert f"the embedded corpus of {train:,} training tokens" in text
