"""test_parallel_collectives.py: the TP collectives as autograd Functions with exact, rank-valued
expectations (Megatron's mappings tests), the ledger's per-layer volumes and collective counts equal
to layouts.per_layer_traffic, and the one-line errors of layouts that cannot split a model.
"""
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import layouts

from tp_model import TPLlama
import parallel
from model import Llama
from conftest import TP_CASES, expect_error, small_cfg, spawn


def _collectives_worker(rank, world):
    g = dist.group.WORLD
    # Copy (f): identity forward, all-reduce backward, also of a non-contiguous gradient
    x = torch.full((4, 3), float(rank + 1), requires_grad=True)
    y = parallel.Copy.apply(x, g)
    assert torch.equal(y, x)
    grad = (torch.arange(12.0).view(3, 4) * (rank + 1)).t()
    assert not grad.is_contiguous()
    y.backward(grad)
    assert torch.equal(x.grad, torch.arange(12.0).view(3, 4).t() * 3)
    # Reduce (g): all-reduce forward, identity backward
    x = torch.arange(6.0, requires_grad=True)
    y = parallel.Reduce.apply(x * (rank + 1), g)
    assert torch.equal(y, torch.arange(6.0) * 3)
    y.backward(torch.ones(6) * (rank + 5))
    assert torch.equal(x.grad, torch.ones(6) * (rank + 5) * (rank + 1))
    # CopyUp (--overlap): Copy fused with the GEMMs reading its output; the same values, gradients and
    # one backward all-reduce, with every W reading all of x or (sliced) its own slice of x
    parallel.LEDGER.name(g, "tp")
    for sliced in (False, True):
        torch.manual_seed(1)
        x, Ws = torch.randn(2, 3, 8), [torch.randn(n, 4 if sliced else 8) for n in (5, 6)]
        dys = [torch.randn(2, 3, n) * (rank + 1) for n in (5, 6)]
        results = []
        for overlap in (False, True):
            xo, Wo = x.clone().requires_grad_(), [W.clone().requires_grad_() for W in Ws]
            parallel.LEDGER.reset()
            ys = parallel.column_parallel(xo, Wo, parallel.TPGroup(g, rank, world, overlap), sliced)
            torch.autograd.backward(ys, dys)
            results.append((ys, xo.grad, [W.grad for W in Wo], dict(parallel.LEDGER.counts)))
        (ys, dx, dWs, counts), (ys_o, dx_o, dWs_o, counts_o) = results
        torch.testing.assert_close(ys_o, ys)
        torch.testing.assert_close(dx_o, dx)
        torch.testing.assert_close(dWs_o, dWs)
        assert counts_o == counts == {("all_reduce", "tp", "bwd"): [x.numel(), 4 * x.numel(), 1]}
        xs = x.split(4, -1) if sliced else [x, x]
        torch.testing.assert_close(ys[1], xs[1] @ Ws[1].t())
        mine = [dy @ W for dy, W in zip(dys, Ws)]
        mine = torch.cat(mine, -1) if sliced else sum(mine)
        torch.testing.assert_close(dx, mine / (rank + 1) * 3)  # summed over the ranks: factors 1 + 2
    # bench.py's lower bound: NO_COMM skips the communication (the values stay this rank's) but not the ledger
    parallel.NO_COMM = True
    try:
        parallel.LEDGER.reset()
        assert torch.equal(parallel.Reduce.apply(torch.arange(6.0) * (rank + 1), g), torch.arange(6.0) * (rank + 1))
        assert parallel.LEDGER.total("tp", unit="calls") == 1
    finally:
        parallel.NO_COMM = False
    # Gather: all-gather forward, own slice backward
    x = torch.full((2, 3), float(rank + 1), requires_grad=True)
    y = parallel.Gather.apply(x, g)
    assert torch.equal(y, torch.tensor([[1.0] * 3 + [2.0] * 3] * 2))
    y.backward(torch.arange(12.0).view(2, 6).t().contiguous().t())
    assert torch.equal(x.grad, torch.arange(12.0).view(2, 6)[:, 3 * rank:3 * rank + 3])
    # vocab-parallel cross-entropy equals F.cross_entropy on the full logits, in one chunk of rows
    # or in chunks of 2 and of 3 rows (the last one short), with its three all-reduces
    torch.manual_seed(0)
    logits = torch.randn(5, 8, requires_grad=True)
    target = torch.tensor([0, 3, 4, 7, 5])
    torch.nn.functional.cross_entropy(logits, target, reduction="none").mul(torch.arange(1.0, 6)).sum().backward()
    default = parallel.CE_CHUNK
    for chunk in (default, 8, 12):   # elements: (5, 4) local logits, so 2 and 3 rows a chunk
        parallel.CE_CHUNK = chunk
        local = logits.detach()[:, 4 * rank:4 * rank + 4].clone().requires_grad_()
        parallel.LEDGER.reset()
        loss = parallel.VocabParallelCrossEntropy.apply(local, target, g)
        assert parallel.LEDGER.total(unit="calls") == 3, chunk
        torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits.detach(), target, reduction="none"))
        loss.mul(torch.arange(1.0, 6)).sum().backward()
        torch.testing.assert_close(local.grad, logits.grad[:, 4 * rank:4 * rank + 4])
    parallel.CE_CHUNK = default


def test_collectives_forward_and_backward():
    spawn(2, _collectives_worker)


def _ledger_worker(rank, world, result_file):
    tp = parallel.TPGroup(dist.group.WORLD, rank, world)
    parallel.LEDGER.name(dist.group.WORLD, "tp")
    b, s, out = 2, 16, {}
    for arch, layout in TP_CASES:
        totals = {}
        for n_layer in (2, 4):
            torch.manual_seed(0)
            cfg = small_cfg(arch, n_layer)
            model = TPLlama(Llama(cfg), tp, layout)
            idx = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(1))
            parallel.LEDGER.reset()
            model(idx, idx)[1].backward()
            totals[n_layer] = (parallel.LEDGER.total("tp", "fwd"), parallel.LEDGER.total("tp", "bwd"),
                               parallel.LEDGER.total("tp", unit="calls"))
        per_layer = tuple((totals[4][i] - totals[2][i]) // 2 for i in range(3))
        head = tuple(totals[2][i] - 2 * per_layer[i] for i in range(2))
        fwd, bwd, calls = layouts.per_layer_traffic(layout, cfg)   # per token; the collectives per layer
        out[f"{arch}/{layout}"] = {"per_layer": per_layer, "head": head, "expected": (fwd * b * s, bwd * b * s, calls)}
        bsd = b * s * cfg.n_embd
        # outside the layers: btp all-gathers d before the final norm; all layouts all-reduce the
        # gradient of the normalised d before the vocab-parallel head, whose loss takes 3 all-reduces of b·s
        assert head == ((bsd if layout == "btp" else 0) + 3 * b * s, bsd), (layout, head)
    if rank == 0:
        Path(result_file).write_text(json.dumps(out))


def test_ledger_volumes_and_collectives_equal_the_formulas(tmp_path):
    spawn(2, _ledger_worker, str(tmp_path / "ledger.json"))
    for case, r in json.loads((tmp_path / "ledger.json").read_text()).items():
        assert tuple(r["per_layer"]) == tuple(r["expected"]), case


@pytest.mark.parametrize("world, argv, fragment", [
    (4, ["--tp=3"], "world size 4 is not dp × pp × tp = 1 × 1 × 3"),
    (4, ["--tp=2", "--dp=3"], "world size 4 is not dp × pp × tp = 3 × 1 × 2"),
    (2, [], "gradient_accumulation_steps=1 is not divisible by the 2 data-parallel ranks"),
    (4, ["--pp=2", "--tp=3"], "world size 4 is not dp × pp × tp = 1 × 2 × 3"),
    (2, ["--pp=2", "--n_layer=3", "--gradient_accumulation_steps=2"], "n_layer=3 cannot be split into pp=2 equal stages"),
    (2, ["--pp=2"], "--pp_schedule=1f1b needs at least 2 micro-batches per data-parallel rank (pp=2), this "
                    "run has 1"),
    (2, ["--pp=2", "--pp_schedule=dualpipev", "--pp_virtual_stages=2", "--gradient_accumulation_steps=2"],
     "--pp_schedule=dualpipev needs at least 4 micro-batches per data-parallel rank (pp=2), this run has 2"),
    (2, ["--pp=2", "--pp_virtual_stages=2", "--gradient_accumulation_steps=2"],
     "--pp_schedule=1f1b runs one stage a rank: --pp_virtual_stages=2 needs interleaved_1f1b"),
    (2, ["--pp=2", "--pp_schedule=zbv", "--gradient_accumulation_steps=4"],
     "--pp_schedule=zbv holds two stages a rank, in a V: give --pp_virtual_stages=2"),
    (2, ["--pp=2", "--pp_schedule=interleaved_1f1b", "--pp_virtual_stages=3", "--n_layer=4",
         "--gradient_accumulation_steps=2"],
     "n_layer=4 cannot be split into pp × pp_virtual_stages = 2 × 3 = 6 equal stages"),
    (1, ["--pp_virtual_stages=2"], "--pp_virtual_stages=2 cuts the pipeline's stages: it needs pp > 1"),
    (4, ["--pp=2", "--pp_schedule=zbv", *["--pp_virtual_stages=2", "--n_layer=4", "--dp_shard=grad"],
         "--gradient_accumulation_steps=8"], "--pp_schedule=zbv with several stages a rank does not compose"),
    (2, ["--pp=2", "--pp_schedule=zero_bubble", "--gradient_accumulation_steps=5"],
     "runs its 5 micro-batches per data-parallel rank in rounds of pp=2: give a multiple of 2"),
    (2, ["--tp=2", "--n_head=3", "--n_embd=48", "--n_kv_head=1"], "tp=2 does not divide n_head=3"),
    (2, ["--tp=2", "--n_kv_head=1"], "tp=2 does not divide n_kv_head=1"),
    (4, ["--tp=4", "--n_embd=18", "--n_head=1"], "tp=4 does not divide n_embd=18"),
    (2, ["--tp=2", "--mlp_width=99"], "tp=2 does not divide mlp_width=99"),
    (2, ["--tp=2", "--layout=vanilla", "--attn_rank=9"], "tp=2 does not divide attn_rank=9"),
    (2, ["--tp=2", "--layout=megatron"], "layout=megatron cuts dense models"),
    (2, ["--tp=2", "--arch=full", "--layout=btp"], "arch=full uses megatron"),
])
def test_bad_parallel_layouts(capsys, monkeypatch, tmp_path, world, argv, fragment):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    expect_error(capsys, [f"--out_dir={tmp_path}", *argv], fragment)
