"""explain.py: `train.py --explain=true`: what every rank computes, sends and keeps in one real
step.

For teaching BOOST (arXiv 2512.12131) §2-6: run exactly as training is launched (under torchrun for
TP, PP or DP), with any model and layout options; one forward and backward of a tiny batch is run
and recorded (recorder.py: every op, collective, saved tensor and FLOP as the run does it; with
--optimizer=muon the optimizer step's collectives too), printed, and the program exits: no
training, no checkpoint, no out_dir. Shapes are printed in the notation of layouts.py (b·s tokens,
d, d/t, r, 3r+1, f/t, V/t, ...; notation.py names them). The comparison at the end runs the other
layouts of the same width on the same TP group, a one-layer and a two-layer model each, so their
difference is one layer's.
"""
import torch
import torch.distributed as dist

import local_ops
from extensions import muon
from extensions import pipeline
from extensions import schedule_sim

from plumbing import placement
from plumbing.notation import Names
from plumbing.recorder import record


def layer_view(events):
    """The report lines: the first layer in full, each other layer 'the same' or in full."""
    sections = []
    for phase, section, kind, text in events:
        if not sections or sections[-1][:2] != (phase, section):
            sections.append((phase, section, []))
        sections[-1][2].append(f"{kind:<11} {text}")
    lines, first_layer = [], {}
    for phase, section, body in sections:
        if section.startswith("layer "):
            key = (phase, "layer")
            if key in first_layer and first_layer[key][1] == body:
                first_layer[key][0].append(section.split()[1])
                continue
            first_layer.setdefault(key, ([section.split()[1]], body))
        lines.append(f"  {phase} · {section}")
        lines += [f"    {line}" for line in repeats(body)]
    for (phase, _), (same, _) in first_layer.items():
        if len(same) > 1:
            lines.append(f"  {phase} · layers {same[0]}..{same[-1]}: the same ops, shapes and "
                         f"collectives each")
    return lines


def repeats(body):
    """Runs of equal lines as one, `(× n)` after it (Muon's gathers, one a matrix)."""
    out = []
    for line in body:
        if out and out[-1][0] == line:
            out[-1][1] += 1
        else:
            out.append([line, 1])
    return [line + (f"  (× {n})" if n > 1 else "") for line, n in out]


def totals(counts, saved, flops, tokens, names):
    """The per-step totals of one rank, and the numbers the tests compare."""
    lines = []
    for (op, group, phase), (elements, nbytes, calls) in sorted(counts.items()):
        lines.append(f"  {group:<3} {op} {phase}: {calls} calls, {elements:,} elements ({nbytes:,} "
                     f"bytes)")
    if not counts:
        lines.append("  no collectives")
    lines.append(f"  FLOPs on this rank: {flops:,}; saved for backward: {saved.bytes:,} bytes "
                 f"({saved.bytes / tokens:,.0f} per token)")
    for section, items in saved.by_section.items():
        if section.startswith("layer "):
            shapes = ", ".join(sorted({names.attention(s) if kind else names.shape(s)
                                       for s, _, kind in items}))
            lines.append(f"    what {section} keeps (one layer's bytes: the table below): {shapes}")
            break
    return lines


def unnamed_length(cfg, b):
    """A sequence length s <= block_size whose b·s and s name no model size, so shapes read
    clearly."""
    sizes = set(Names(cfg, 1, 1, 1).names) | {cfg.n_embd // 2, cfg.n_embd // 4, cfg.attn_rank // 2}
    for s in (7, 5, 9, 11, 13, 6, 3, 10, 12, 14, 15, 4, 2):
        if s <= cfg.block_size and s not in sizes and b * s not in sizes:
            return s
    return min(cfg.block_size, 8)


def per_layer(cfg, layout, arch, tp, recompute, b, s, device):
    """One layer of `arch` under `layout` on this TP group, measured as the difference of a two- and
    a one-layer model: (TP elements fwd, bwd, collectives, saved bytes, FLOPs) per token."""
    from tp_model import TPLlama
    from model import Config, Llama
    rows = []
    for n_layer in (1, 2):
        c = Config(**{**cfg.shape(), "arch": arch, "n_layer": n_layer,
                      "lax": cfg.lax and arch != "full",
                      "mlp_gate": cfg.mlp_gate if arch == cfg.arch else "auto"})
        torch.manual_seed(0)
        model = TPLlama(Llama(c), tp, layout, recompute=recompute)
        model.to(device)   # on the run's device: NCCL takes no CPU tensors
        x = torch.randint(0, c.vocab_size, (b, s),
                          generator=torch.Generator().manual_seed(0)).to(device)
        _, counts, saved, flops = record(model, x, x, Names(c, tp.size, b, s), layout)
        tp_counts = {k: v for k, v in counts.items() if k[1] == "tp"}
        rows.append([sum(v[0] for k, v in tp_counts.items() if k[2] == "fwd"),
                     sum(v[0] for k, v in tp_counts.items() if k[2] == "bwd"),
                     sum(v[2] for v in tp_counts.values()), saved.bytes, flops])
    return [(two - one) / (b * s) if i != 2 else two - one
            for i, (one, two) in enumerate(zip(*rows))]


def comparison(cfg, tc, tp, layout, b, s, device):
    """The layouts (the paper's three) at this width, one layer each, side by side."""
    import layouts
    low = cfg.arch if cfg.lowrank else "cola"
    cases = [(name, low if lay.lowrank else "full")
             for name, lay in reversed(layouts.LAYOUTS.items())]
    lax = " (LaX: layer 1, which crosses, minus layer 0)" if cfg.lax else ""
    lines = [f"  one layer at this width (d={cfg.n_embd}, r={cfg.attn_rank}, tp={tp.size}), per "
             f"token, measured{lax}:",
             "  layout    arch  TP elements fwd  bwd   collectives  saved bytes  "
             "FLOPs on this rank"]
    for name, arch in cases:
        recompute = tc.recompute if not (tc.recompute == "lowrank" and arch == "full") else "none"
        fwd, bwd, calls, saved, flops = per_layer(cfg, name, arch, tp, recompute, b, s, device)
        lines.append(f"  {name:<9} {arch:<5} {fwd:>15,.0f} {bwd:>4,.0f} {calls:>12} "
                     f"{saved:>12,.0f} {flops:>19,.0f}"
                     + ("   <- this run's layout" if name == layout else ""))
    return lines


def main(plan, place):
    """--explain=true: one recorded step of the model train.py builds for this rank
    (placement.Placement says where it sits), printed by rank 0; nothing else runs and no file is
    written."""
    from dataclasses import replace
    cfg, tc, layout = plan.cfg, plan.tc, plan.layout
    # the ops are traced with one stage a rank (GPipe, below): several a rank run the same ops
    one = replace(tc, pp_schedule="gpipe", pp_virtual_stages=1)
    model = placement.build_model(replace(plan, tc=one), place)[0]
    world, mesh, tp, device = place.world, place.mesh, place.tp, place.device
    coords = {name: mesh.get_local_rank(name)
              for name in ("dp", "pp", "tp")} if mesh is not None else {}
    rank = dist.get_rank() if world > 1 else 0
    b = 2
    s = unnamed_length(cfg, b)
    names = Names(cfg, tc.tp, b, s)
    x = torch.randint(0, cfg.vocab_size, (b, s),
                      generator=torch.Generator().manual_seed(tc.seed + rank)).to(device)
    # wrapped as a run wraps it (DDP, or the pipeline: one micro-batch, GPipe, so the printout is
    # one pass through the stages), not compiled: the ops are recorded eagerly
    wrapped, pipe = placement.wrap(model, replace(one, compile=False), place, 1)
    ddp = wrapped if wrapped is not model else None
    if pipe:   # its first run infers the shapes between stages with an extra forward: not recorded
        pipe.run(x, x)
        model.zero_grad(set_to_none=True)
    optimizer = muon.configure(model, tc) if tc.optimizer == "muon" else None  # (AdamW: no comm)
    events, counts, saved, flops = record(model, x, x, names, layout if tc.tp > 1 else "one device",
                                          pipe, ddp, optimizer)
    view, sums = layer_view(events), totals(counts, saved, flops, b * s, names)
    views = [None] * world
    if world > 1:
        dist.all_gather_object(views, (coords, view, sums))
    else:
        views = [(coords, view, sums)]
    compare = comparison(cfg, tc, tp, layout, b, s, device) if tc.tp > 1 else []
    if rank == 0:
        report(cfg, tc, place, layout, (b, s), views, sums, compare)
    placement.finish(plan.world)


def report(cfg, tc, place, layout, shape, views, sums, compare):
    """Rank 0's printout: the header, its ops in order, where the other ranks differ, the totals and
    the layouts side by side."""
    (b, s), (coords, view, _) = shape, views[0]
    where = lambda c: ", ".join(f"{k} {v}" for k, v in c.items()) or "one process"
    print(f"explain: {cfg.arch}, {'layout ' + layout if tc.tp > 1 else 'no TP'}, dp={place.dp} "
          f"pp={tc.pp} tp={tc.tp}, "
          f"recompute={tc.recompute}, overlap={tc.overlap if tc.tp > 1 else '-'}"
          + (f", dp_shard={tc.dp_shard}" if tc.dp_shard != "none" else "")
          + f"; one forward and backward of b={b} sequences of s={s} tokens per rank"
          + (" (one micro-batch through the stages)" if tc.pp > 1 else "")
          + ", recorded (t = tp degree)"
          + ("; the Triton kernels are shown as the PyTorch reference ops they fuse"
                                            if local_ops.backend() != "torch" else ""))
    print(f"\nrank 0 ({where(coords)}), in execution order:")
    print("\n".join(view))
    for r, (c, v, _) in enumerate(views[1:], 1):
        if v == view:
            print(f"rank {r} ({where(c)}): the same ops, shapes and collectives as rank 0")
        else:
            print(f"rank {r} ({where(c)}), where it differs from rank 0:")
            print("\n".join(line for line in v if line not in view))
    print("\nthis step's totals, rank 0:")
    print("\n".join(sums))
    if compare:
        print("\nthe layouts side by side:")
        print("\n".join(compare))
    if tc.pp > 1:
        print("\n".join(schedule_lines(tc, tc.gradient_accumulation_steps // place.dp)))


def schedule_lines(tc, n_micro):
    """The pipeline schedule's actions on each pp rank, in order, and each rank's idle share as
    schedule_sim.timeline models it (forward 1, backward 2 or its halves 1 and 1; sends free)."""
    v = tc.pp_virtual_stages
    acts = schedule_sim.order(tc.pp_schedule, tc.pp, n_micro, v)
    share = schedule_sim.idle(schedule_sim.timeline(acts))
    lines = [f"\nthe schedule: {tc.pp_schedule} over pp={tc.pp} ranks, {n_micro} micro-batches, "
             f"{len(pipeline.stages_of(0, tc.pp, v, tc.pp_schedule))} stage(s) a rank",
             "  (2F1: stage 2's forward of micro-batch 1; B a whole backward, I and W its input "
             "and weight halves)",
             "  idle share as modelled (schedule_sim.timeline: F 1, B 2, I and W 1 each, sends "
             f"free); the textbook 1F1B bubble (p-1)/(m+p-1) = "
             f"{(tc.pp - 1) / (n_micro + tc.pp - 1):.2f}"]
    for r, a in acts.items():
        lines.append(f"  pp rank {r} (idle {share[r]:.2f}): "
                     + " ".join(str(x) for x in a if x is not None))
    return lines
