"""bench_traffic.py: `python tools/bench.py traffic`: the TP elements per token of one layer under
each layout (BOOST, arXiv 2512.12131, §4's volumes), counted by the ledger in a real forward and
backward (a three- minus a two-layer model on `tp` spawned gloo ranks) beside
layouts.per_layer_traffic's formula; with LaX rows (a layer that crosses).
"""
import json
import sys
from pathlib import Path

# the core files live at the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# layouts.per_layer_traffic's volumes in words (fwd, bwd), r = attn_rank = mlp_rank; the numbers
# beside them are the function's own
FORMULAS = {"megatron": ("2d", "2d"), "vanilla": ("3d + 2kv + 2d_ff", "6d + d_ff"),
            "btp": ("7r + 2", "7r"), "vanilla lax": ("3d + 2kv + 2d_ff + 7r", "6d + d_ff + 7r"),
            "btp lax": ("7r + 2", "7r")}


def _traffic_worker(rank, world, store, cfg_kwargs, result):
    import torch
    import torch.distributed as dist
    import layouts
    from tp_model import TPLlama
    import parallel
    from plumbing import placement
    from model import Config, Llama
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(store, world))
    tp = parallel.TPGroup(dist.group.WORLD, rank, world)
    parallel.LEDGER.name(dist.group.WORLD, "tp")
    out, b, s = {}, 2, 32
    for arch, layout, lax in (("full", "megatron", False), ("cola", "vanilla", False),
                              ("cola", "btp", False),
                              # LaX: a crossing layer
                              ("cola", "vanilla", True), ("cola", "btp", True)):
        totals = []
        for n_layer in (2, 3):   # the difference: layer 2, which crosses under LaX
            cfg = Config(**{**cfg_kwargs, "arch": arch, "mlp_gate": "auto", "n_layer": n_layer,
                            "block_size": s,
                            "lax": lax})
            model = TPLlama(Llama(cfg), tp, layout)
            idx = torch.randint(0, cfg.vocab_size, (b, s),
                                generator=torch.Generator().manual_seed(0))
            parallel.LEDGER.reset()
            model(idx, idx)[1].backward()
            totals.append([parallel.LEDGER.total("tp", phase) for phase in ("fwd", "bwd")])
            totals[-1] += optimizer_traffic(model, layout, cfg, world)
        measured = [(totals[1][i] - totals[0][i]) / (b * s) for i in range(2)]
        formula = list(layouts.per_layer_traffic(layout, cfg)[:2])
        out[layout + (" lax" if lax else "")] = {"measured": measured, "formula": formula,
                                                 "muon": [totals[1][i] - totals[0][i]
                                                          for i in (2, 3, 4, 5)]}
    if rank == 0:
        Path(result).write_text(json.dumps(out))
    placement.exit_worker(world)



def optimizer_traffic(model, layout, cfg, t):
    """Muon's step (muon.py) on the gradients the model holds: the ledger's "optim" elements and
    the model's count by muon.per_layer_traffic's formula, with the Gram path (btp only; else 0)
    and with the gather path."""
    from extensions import muon
    import parallel
    from plumbing import options
    tc = options.TrainConfig(optimizer="muon")
    out = []
    for prefer in ("gram", "gather"):
        if prefer == "gram" and layout != "btp":
            out += [0, 0]
            continue
        opt = muon.configure(model, tc, prefer)
        parallel.LEDGER.reset()
        opt.step()
        out += [parallel.LEDGER.total("tp", "optim"),
                cfg.n_layer * muon.per_layer_traffic(layout, cfg, t, prefer)]
    return out


def bench_traffic(extra, tp):
    from model import Config
    from plumbing import options
    from bench_common import shape_args, spawned, table
    cfg, _ = options.parse_args(shape_args(extra, []))
    kwargs = {k: v for k, v in cfg.shape().items()}
    out = spawned(_traffic_worker, tp, kwargs)
    cfg = Config(**kwargs)
    rows = [[layout, *[f"{text} = {v:g}" for text, v in zip(FORMULAS[layout],
                                                            out[layout]["formula"])],
             *[f"{m:g}" for m in out[layout]["measured"]],
             f"{out[layout]['formula'][0] / out['btp']['formula'][0]:.2f}"] for layout in out]
    title = (f"d={cfg.n_embd}, d_ff={cfg.mlp_width}, kv={cfg.kv_dim}, "
             f"r={cfg.attn_rank}/{cfg.mlp_rank}, tp={tp}")
    muon_rows = [[layout, *out[layout]["muon"]] for layout in out]
    return title + "\n\n" + table(["layout", "fwd formula", "bwd formula", "fwd measured",
                                   "bwd measured",
                                   "fwd vs btp"], rows) + \
        "\n\nMuon's optimizer step (--optimizer=muon), elements all-reduced or gathered per " \
        "layer and step, whatever the tokens:\n\n" + \
        table(["layout", "Gram (measured)", "Gram (formula)", "gather (measured)",
               "gather (formula)"], muon_rows), out


