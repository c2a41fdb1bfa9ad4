"""plot.py: several runs side by side, from their metrics.jsonl: the curves of BOOST's comparisons.

Not a figure of the BOOST paper (arXiv 2512.12131) itself; the way its §7 comparisons (CoLA against
dense at equal steps, the layouts' losses lying on one another, their step times) are looked at
here.

    python tools/plot.py OUT_DIR [OUT_DIR ...] -o FILE.png [--labels=a,b] [--title=TEXT] [--diff]
                         [--ms_per_iter=A,B]

Three panels: train loss (solid) and val loss (its evaluations marked, dashed) against iterations;
the same against the run's own training time (its logged step times summed, evaluation left out),
or with --diff each run's |train loss - the first run's| on a log axis for the runs of the first
run's model (runs that should be equal show how equal; another model is left out, and said); the
median tokens/s of each run (its first tenth left out) with its interquartile range. With
--ms_per_iter (one figure per run, timed apart on an idle machine: runs that shared a machine time
nothing) the middle panel is the loss against iterations × that figure, runs compared at equal
time, and the third panel those figures. Under the panels: each run's machine and load at its
start (recorded by train.py), since time means nothing without them. Each
run is drawn narrower than the one before, so runs whose losses are equal (the layouts of one
model) show as nested bands. -o names a .png, .svg or .pdf, replaced if it exists (no other file is
written). Each OUT_DIR is a train.py out_dir; its label is the folder's name unless --labels names
them. A resumed run's log holds every attempt: where an iteration was logged twice (a run resumed
from an earlier checkpoint), the later record is drawn. Needs matplotlib (`pip install
matplotlib`), which only this tool imports.
"""
import json
import sys
from pathlib import Path

# the core files live at the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plumbing import data  # noqa: E402  (after the path line)

IMAGES = (".png", ".svg", ".pdf")   # the only files -o writes, replacing one of that name
NUMBERS = {"iter", "loss", "val_loss", "tokens_per_s", "tokens_per_iter"}   # what is drawn


def read_run(out_dir):
    """{"train": [(iter, seconds, loss)], "val": [(iter, seconds, loss)], "speed": [(iter,
    tokens/s)], and the arch, machine and load its start recorded} of an out_dir's metrics.jsonl
    (seconds: the run's logged step times summed); ValueError naming what is missing. A line cut
    short by a kill is skipped."""
    path = Path(out_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{out_dir} has no metrics.jsonl (is it a train.py out_dir?)")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a text file (a metrics.jsonl is JSON Lines)") from None
    records, per_iter, about = {}, None, {}
    for line_no, line in enumerate(text.splitlines(), 1):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        for key in NUMBERS & rec.keys():   # (NaN is a number: drawn as a gap)
            if not isinstance(rec[key], (int, float)) or isinstance(rec[key], bool):
                raise ValueError(f"{path}:{line_no}: {key} is {rec[key]!r}, not a number")
        if rec.get("event") in ("start", "resume"):
            per_iter = rec.get("tokens_per_iter", per_iter)
            about = {**about, **{k: rec[k] for k in ("arch", "machine", "load") if k in rec}}
        elif "iter" in rec and "event" not in rec:
            # a later attempt's record replaces
            records[rec["iter"]] = {**rec, "per_iter": per_iter}
    if not records:
        raise ValueError(f"{path} holds no iteration records")
    run, seconds, last = {"train": [], "val": [], "speed": [], **about}, 0.0, -1
    for it in sorted(records):
        rec = records[it]
        if "val_loss" in rec:   # evaluated before step `it`
            run["val"].append((it, seconds, rec["val_loss"]))
        if "loss" in rec:   # the loss of step `it`, after its time
            # (a line's ms: the mean over the steps since the last line)
            seconds += rec.get("ms", 0.0) / 1000 * (it - last)
            last = it
            run["train"].append((it, seconds, rec["loss"]))
        if "tokens_per_s" in rec:
            run["speed"].append((it, rec["tokens_per_s"]))
    return run


def with_seconds(run, ms):
    """read_run's run with its tokens column replaced by the wall time in seconds at `ms` per
    iteration (the loss of step `it` after it + 1 iterations, the val loss before step `it`)."""
    return {**run, "train": [(it, (it + 1) * ms / 1000, loss) for it, _, loss in run["train"]],
            "val": [(it, it * ms / 1000, loss) for it, _, loss in run["val"]], "ms": ms}


def pyplot(tool="tools/plot.py"):
    """matplotlib's pyplot drawing into files only (no display), or a one-line ValueError."""
    from plumbing.tokenizer import need
    need("matplotlib", tool).use("Agg")
    import matplotlib.pyplot as plt
    return plt


def check_output(parser, output):
    """-o must name an image (only an image is ever replaced) in a folder that exists."""
    if Path(output).suffix.lower() not in IMAGES:
        parser.error(f"-o {output}: name a {', '.join(IMAGES)} file (only an image is ever "
                     "replaced)")
    if not Path(output).resolve().parent.is_dir():
        parser.error(f"the folder of {output} does not exist")


def draw(runs, labels, out, title=None, diff=False):
    """The three panels of `runs` (read_run's) into the image file `out` (the module's docstring),
    each run's machine and load beneath."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    first = {p[0]: p[2] for p in runs[0]["train"]}
    others = []   # (--diff: runs of another model, left out of the difference panel)
    for k, (run, label) in enumerate(zip(runs, labels)):
        color = f"C{k}"
        # earlier runs wider: equal curves show as bands
        lw = 1 + 2.5 * (len(runs) - 1 - k) / max(1, len(runs) - 1)
        for x, ax in ((0, axes[0]), (1, axes[1])) if not diff else ((0, axes[0]),):
            ax.plot([p[x] for p in run["train"]], [p[2] for p in run["train"]], color=color, lw=lw,
                    label=f"{label} train")
            if run["val"]:   # (each evaluation marked: a few points are not a line)
                ax.plot([p[x] for p in run["val"]], [p[2] for p in run["val"]], "o--", color=color,
                        ms=3 + lw, lw=lw / 2, label=f"{label} val")
        if diff and k and run.get("arch", "?") != runs[0].get("arch", "?"):
            others.append(label)
        elif diff and k:
            gaps = [(p[0], abs(p[2] - first[p[0]])) for p in run["train"] if p[0] in first]
            axes[1].plot([g[0] for g in gaps], [max(g[1], 1e-9) for g in gaps], color=color, lw=1,
                         label=f"{label} vs {labels[0]}")
        speed_bar(axes[2], k, run, color)
    label_axes(axes, runs, labels, diff, others)
    if title:
        fig.suptitle(title)
    fig.text(0.01, 0.01, "measured on: " + machines(runs, labels), fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def speed_bar(ax, k, run, color):
    """Run k's bar: its --ms_per_iter figure, or its median tokens/s (the first tenth left out)
    with the interquartile range as the error bar (one step's tokens/s is noise)."""
    import statistics
    speeds = [p[1] for p in run["speed"]][len(run["speed"]) // 10:]
    if "ms" in run:
        ax.bar(k, run["ms"], color=color)
    elif speeds:
        q = statistics.quantiles(speeds, n=4) if len(speeds) > 1 else [speeds[0]] * 3
        ax.bar(k, q[1], color=color, yerr=[[q[1] - q[0]], [q[2] - q[1]]], capsize=4)


def label_axes(axes, runs, labels, diff, others):
    timed = "ms" in runs[0]
    panel2 = ("iteration", f"|train loss - {labels[0]}'s| (1e-9: equal)") if diff else \
        ("seconds (iterations × ms per iteration)" if timed else
         "seconds of training (the run's own step times)", "loss")
    for ax, xlabel, ylabel in zip(axes, ("iteration", panel2[0], "run"),
                                  ("loss", panel2[1], "ms per iteration, timed apart" if timed
                                   else "tokens/s (median, interquartile range)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    if diff:
        axes[1].set_yscale("log")
        if others:
            axes[1].set_title(f"not {labels[0]}'s model, left out: {', '.join(others)}",
                              fontsize=8)
        if len(runs) > len(others) + 1:
            axes[1].legend(fontsize=7)
    axes[2].set_xticks(range(len(runs)), labels, fontsize=7, rotation=15)
    axes[0].legend(fontsize=7)


def machines(runs, labels):
    """Each run's machine and load at its start, once if they all share them."""
    said = [f"{r.get('machine', 'not recorded')}, load {r.get('load', '?')} at its start"
            for r in runs]
    if len(set(said)) == 1:
        return said[0]
    return "; ".join(f"{label}: {text}" for label, text in zip(labels, said))


def ms_list(parser, text, n):
    """--ms_per_iter's figures (None when not given): n positive numbers, or a one-line error."""
    if text is None:
        return None
    try:
        ms = [float(x) for x in text.split(",")]
    except ValueError:
        parser.error(f"--ms_per_iter={text}: give numbers, one per OUT_DIR")
    if len(ms) != n or not all(0 < m < float("inf") for m in ms):
        parser.error(f"--ms_per_iter={text}: give {n} positive numbers, one per OUT_DIR")
    return ms


def main(argv):
    parser = data.CommandParser(prog="tools/plot.py",
                                description="Draw train.py runs side by side.")
    parser.add_argument("out_dirs", nargs="+", metavar="OUT_DIR")
    parser.add_argument("-o", "--output", required=True, metavar="FILE.png",
                        help="a .png, .svg or .pdf (replaced)")
    parser.add_argument("--labels", help="comma-separated, one per OUT_DIR (default: the folders' "
                        "names)")
    parser.add_argument("--title")
    parser.add_argument("--diff", action="store_true",
                        help="the middle panel: each run's loss minus the first's")
    parser.add_argument("--ms_per_iter", help="comma-separated, one per OUT_DIR: each run's time "
                        "per iteration, measured apart; the middle panel against wall time")
    args = parser.parse_args(argv)
    ms = ms_list(parser, args.ms_per_iter, len(args.out_dirs))
    labels = args.labels.split(",") if args.labels else [Path(d).resolve().name
                                                         for d in args.out_dirs]
    if len(labels) != len(args.out_dirs):
        parser.error(f"--labels names {len(labels)} runs, {len(args.out_dirs)} OUT_DIRs given")
    check_output(parser, args.output)
    try:
        runs = [read_run(d) for d in args.out_dirs]
        runs = [with_seconds(run, m) for run, m in zip(runs, ms)] if ms else runs
        draw(runs, labels, args.output, args.title, args.diff)
    except ValueError as e:
        parser.error(str(e))
    print(f"plot: {len(runs)} run(s) drawn into {args.output}")


if __name__ == "__main__":
    main(sys.argv[1:])
