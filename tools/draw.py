"""draw.py: BOOST's two pictures, drawn from what the code records (never by hand).

BOOST (arXiv 2512.12131) §4 moves the tensor-parallel boundary to the bottleneck; these show it:

    python tools/draw.py traffic -o docs/figures/traffic.png   # TP elements per token per layer
    python tools/draw.py layer -o docs/figures/btp_layer.png   # one BTP layer: ops, all-reduces
    python tools/draw.py schedules -o docs/figures/schedules.png   # the pipeline schedules

traffic: forward and backward, per layout (Megatron on the dense model, vanilla low-rank TP, BTP,
and both low-rank layouts with LaX), as the ledger counts them in a real step at tp=2 (bench.py
traffic's worker), at the default shape (d=128, r=32). layer: the forward and backward of one layer
under BTP at tp=2, in execution order, as `train.py --tp=2 --explain=true` records it: each op, and
each all-reduce with what it carries and its width per token. schedules: each pipeline schedule's
actions on each of pp=4 ranks, 8 micro-batches, placed in time by schedule_sim (modelled, not
timed). -o names a .png, .svg or .pdf,
replaced if it exists. Needs matplotlib, which only the tools import.
"""
import re
import subprocess
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from plumbing import data  # noqa: E402  (after the path line)
from plot import check_output, pyplot  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {"megatron": "Megatron TP\n(dense)", "vanilla": "vanilla\nlow-rank TP", "btp": "BTP",
           "vanilla lax": "vanilla\n+ LaX", "btp lax": "BTP\n+ LaX"}


def draw_traffic(out):
    """Bars of the ledger's elements per token per layer, forward and backward, by layout."""
    import bench_traffic
    _, measured = bench_traffic.bench_traffic([], 2)
    plt = pyplot("tools/draw.py")
    fig, ax = plt.subplots(figsize=(8, 4.2))
    names = [n for n in LAYOUTS if n in measured]
    for k, phase in enumerate(("forward", "backward")):
        values = [measured[n]["measured"][k] for n in names]
        bars = ax.bar([i + (k - 0.5) * 0.38 for i in range(len(names))], values, 0.38, label=phase,
                      color=("#c0392b", "#e8a39b")[k])
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=8)
    ax.set_xticks(range(len(names)), [LAYOUTS[n] for n in names])
    ax.set_ylabel("TP elements per token per layer")
    ax.set_title("What each layout all-reduces (counted by the ledger at tp=2; d=128, r=32)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def explain_layer(extra=()):
    """--explain's text of a tp=2 BTP step (a torchrun of train.py, as a user would run it)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), "--tp=2", "--explain=true", "--n_layer=2", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    if res.returncode:
        raise ValueError(f"train.py --explain=true failed: {res.stderr.strip().splitlines()[-1:]}")
    return res.stdout


def layer_steps(text, section):
    """[(kind, text)] of rank 0's `section` of an --explain listing ("fwd · layer 0"), consecutive
    GEMMs merged into one step naming their weights."""
    lines = text.split("rank 0 (")[1].split("\n  ")
    start = next(i for i, line in enumerate(lines) if line.strip() == section)
    steps = []
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        kind, rest = line.split(None, 1)
        if kind == "GEMM":
            weight = re.search(r"@ (\w+?)ᵀ? \(", rest)
            name = weight.group(1) if weight else "weight gradient"
            if steps and steps[-1][0] == "GEMM":
                steps[-1][1].append(name)
                continue
            steps.append(("GEMM", [name]))
        else:
            steps.append((kind, rest.strip()))
    return [(kind, _gemms(text) if kind == "GEMM" else text) for kind, text in steps]


def _gemms(names):
    """'B_q, B_k, B_v', the weight gradients among them counted ('3 weight gradients, A_qkv')."""
    grads = names.count("weight gradient")
    return ", ".join(([f"{grads} weight gradient{'s' if grads > 1 else ''}"] if grads else []) +
                     [n for n in names if n != "weight gradient"])


def draw_layer(text, out):
    """Forward and backward of one BTP layer, top to bottom: ops grey, all-reduces red, labelled."""
    plt = pyplot("tools/draw.py")
    columns = [("forward, layer 0", layer_steps(text, "fwd · layer 0")),
               ("backward, layer 1", layer_steps(text, "bwd · layer 1"))]
    rows = max(len(steps) for _, steps in columns)
    fig, ax = plt.subplots(figsize=(13, 0.42 * rows + 1.2))
    for c, (title, steps) in enumerate(columns):
        x = c * 0.5
        ax.text(x + 0.01, rows + 0.3, title, fontsize=11, weight="bold")
        for i, (kind, label) in enumerate(steps):
            y = rows - 1 - i
            comm = kind in ("all_reduce", "all_gather")
            if comm:
                width, carries = re.match(r"tp: (.*?) per token.*?(?:\[(.*)\])?$", label).groups()
                label = f"{kind} {width}/token: {carries or ''}"
            ax.text(x + 0.01, y, f"{kind}: {label}" if not comm else label, fontsize=8, va="center",
                    color="white" if comm else "black",
                    bbox=dict(boxstyle="round,pad=0.3", fc="#c0392b" if comm else "#eeeeee",
                              ec="none"))
    ax.set_xlim(0, 1)
    ax.set_ylim(-1, rows + 1)
    ax.axis("off")
    fig.suptitle("One BTP layer at tp=2 (d=128, r=32), as --explain records it: four r-wide "
                 "all-reduces each way, the norm statistic riding in two", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


SCHEDULES = [("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2),
             ("dualpipev", 2)]
KIND_COLORS = {"F": "#2e86c1", "B": "#e67e22", "I": "#16a085", "W": "#27ae60"}
KIND_NAMES = {"F": "F: forward", "B": "B: backward (whole)", "I": "I: backward, input half",
              "W": "W: backward, weight half"}


def draw_schedules(out, pp=4, n_micro=8):
    """Each schedule's actions on each pp rank, placed in time by schedule_sim (a forward 1, a
    backward 2, its input and weight halves 1 each, in one stage's forward: drawn in a rank's,
    v stages' worth, so that the schedules share one axis), idle time left white."""
    from extensions import schedule_sim
    plt = pyplot("tools/draw.py")
    fig, axes = plt.subplots(len(SCHEDULES), 1, figsize=(11, 1.1 + 0.95 * len(SCHEDULES)),
                             sharex=True)
    for ax, (schedule, v) in zip(axes, SCHEDULES):
        placed = schedule_sim.timeline(schedule_sim.order(schedule, pp, n_micro, v))
        share = schedule_sim.idle(placed)
        for r, acts in placed.items():
            for start, end, a in acts:   # (in a rank's forward: a stage's is 1/v of it)
                start, end, kind = start / v, end / v, a.computation_type.value
                ax.barh(r, end - start, left=start, color=KIND_COLORS[kind], edgecolor="white",
                        linewidth=0.5)
                ax.text((start + end) / 2, r, f"{a.stage_index}{kind}{a.microbatch_index}",
                        ha="center", va="center", fontsize=5, color="white")
        ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)], fontsize=7)
        ax.invert_yaxis()
        mean = sum(share.values()) / pp
        ax.set_title(f"{schedule}, {v} stage(s) a rank: idle {mean:.0%} of the step (modelled)",
                     fontsize=8, loc="left")
    axes[-1].set_xlabel("time, in a rank's forward of one micro-batch through all its layers (a "
                        "stage's F 1/v of it, B twice F, I and W half of B; sends free); "
                        f"pp={pp}, {n_micro} micro-batches; sFm: stage s, micro-batch m",
                        fontsize=8)
    from matplotlib.patches import Patch   # (the colours' key, above the first schedule)
    axes[0].legend(handles=[Patch(color=c, label=KIND_NAMES[k]) for k, c in KIND_COLORS.items()],
                   ncol=4, fontsize=7, loc="lower right", bbox_to_anchor=(1, 1.15))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [t.get_text() for t in axes[0].get_legend().get_texts()]


def main(argv):
    parser = data.CommandParser(prog="tools/draw.py",
                                description="Draw BOOST's traffic, one BTP layer, the pipeline "
                                            "schedules.")
    parser.add_argument("what", choices=("traffic", "layer", "schedules"))
    parser.add_argument("-o", "--output", required=True, metavar="FILE.png",
                        help="a .png, .svg or .pdf (replaced)")
    args = parser.parse_args(argv)
    check_output(parser, args.output)
    try:
        if args.what == "traffic":
            draw_traffic(args.output)
        elif args.what == "schedules":
            draw_schedules(args.output)
        else:
            draw_layer(explain_layer(), args.output)
    except ValueError as e:
        parser.error(str(e))
    print(f"draw: {args.what} drawn into {args.output}")


if __name__ == "__main__":
    main(sys.argv[1:])
