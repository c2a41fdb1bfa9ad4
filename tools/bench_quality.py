"""bench_quality.py: `python tools/bench.py quality`: time to quality, the number BOOST is about.

BOOST (arXiv 2512.12131) promises the dense model's quality sooner. This bench trains each run of
RUNS (an arch under a layout at tp=2, its own learning rate and schedule) in fresh train.py
processes under torchrun, on `--seeds` seeds (default 3), the runs interleaved seed by seed, and
asks when each reaches a target validation loss: the baseline's (the first run, the dense model
under Megatron TP) val loss at its last step (`--target_step`, default its max_iters), seed by
seed, since a seed also draws its evaluation batches (the mean target is reported), or a number for
every seed (`--target=1.70`). Validation is evaluated every `eval_every` steps on a fixed held-out
budget; the crossing is placed by linear interpolation between the two evaluations around it. Per
run: steps, tokens, model FLOPs and wall time to the target, each a mean and a 95% interval over
seeds (Student's t), and the wall time's ratio to the baseline's. Wall time twice: measured (the
sum of train.py's synchronised step times up to the crossing, evaluation left out) and as steps ×
the run's median step time, so that the machine's noise shows. And the effective throughput:
tokens/s × the first run's FLOPs per token (the dense work the run stands for). A figure: val loss
against wall time and against FLOPs, each run's seeds as a band around their mean, the target as a
line, the crossings marked and zoomed (`--figure=PATH`, default bench-results/quality.png).
`--tier=gpu`: CoLA-60M's shape on one GPU (a config file among the options names another: the
130M's, configs/cola_130m.toml); `--sweep`: the recipes.
"""
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the core files: the root

# the CPU tier (the default): d=256, 4 layers, block 128, batch 8, at tp=2; the dense model trains
# STEPS steps (its val loss there is the target): three seeds of both runs in under 15 minutes here
SHAPE = ["--n_layer=4", "--n_embd=256", "--n_head=8", "--block_size=128", "--batch_size=8",
         "--warmup_iters=30", "--eval_iters=4", "--tp=2"]
STEPS = 500
RESULTS = Path(__file__).resolve().parents[1] / "bench-results"   # (figures, kept sweep runs)
EVAL_EVERY = 25
# the GPU tier (--tier=gpu; one GPU: tp=1): CoLA-60M's shape (configs/cola_60m.toml), sequence 256,
# 64 sequences a step (16K tokens), the dense model at lr 1e-3 for 2000 steps (33M tokens) against
# CoLA at BOOST's 60M lr 4e-3; it needs a corpus of that size (--dataset=..., docs/corpora.md)
SHAPE_GPU = [str(Path(__file__).resolve().parents[1] / "configs" / "cola_60m.toml"),
             "--block_size=256", "--batch_size=64", "--warmup_iters=100", "--eval_iters=20",
             "--tp=1"]
RUNS_GPU = {"dense": ["--arch=full", "--learning_rate=1e-3", "--min_lr=1e-4", "--max_iters=2000"],
            "cola": ["--arch=cola", "--learning_rate=4e-3", "--min_lr=4e-4",
                     "--lr_decay_iters=2000", "--max_iters=2500"]}
OWN = ("seeds", "target", "target_step", "figure", "tier")   # the bench's; the rest go to train.py
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def recipe(arch, lr, decay, max_iters=None, rank=None, warmup=None):
    """One point of a recipe sweep: the arch at peak lr `lr` (min_lr a tenth of it), a cosine over
    `decay` steps, trained `max_iters` steps (default: the schedule), r = `rank` (default d/4),
    `warmup` steps of warmup (default: the shape's)."""
    return [f"--arch={arch}", f"--learning_rate={lr}", f"--min_lr={float(lr) / 10:g}",
            f"--lr_decay_iters={decay}", f"--max_iters={max_iters or decay}",
            *([f"--attn_rank={rank}", f"--mlp_rank={rank}"] if rank else []),
            *([f"--warmup_iters={warmup}"] if warmup else [])]


# the CPU tier's runs: each side's best recipe of the sweep below (docs/quality.md), CoLA's also
# configs/cola_quality_cpu.toml
RUNS = {"dense (megatron)": ["--layout=megatron", *recipe("full", "1e-3", STEPS, warmup=150)],
        "cola (btp)": ["--layout=btp", *recipe("cola", "2e-3", 625, warmup=150)]}

# the recipe sweeps (`bench.py quality --sweep`), both sides alike: the dense model's first (its
# best val loss at step STEPS is the CoLA recipes' target), trained at tp=1: every layout is tested
# equal to one device, so the steps to a val loss do not depend on tp (the time per step does)
SWEEP = {**{f"dense lr {lr}": recipe("full", lr, STEPS) for lr in ("5e-4", "1e-3", "2e-3")},
         **{f"dense lr 1e-3, warmup {w}": recipe("full", "1e-3", STEPS, warmup=w)
            for w in (60, 100, 150)},
         **{f"cola lr {lr}": recipe("cola", lr, 625) for lr in ("1.5e-3", "2e-3", "3e-3")},
         "cola lr 2e-3, schedule 550": recipe("cola", "2e-3", 550, 625),
         **{f"cola lr 2e-3, warmup {w}": recipe("cola", "2e-3", 625, warmup=w)
            for w in (60, 100, 150)},
         "cola lr 2e-3, warmup 150, r 96": recipe("cola", "2e-3", 625, rank=96, warmup=150)}


def crossing(points, target):
    """The (fractional) step at which a val-loss curve [(step, loss)] first reaches `target`,
    linearly between the evaluations around it; None if it never does (or starts below)."""
    for (s0, l0), (s1, l1) in zip(points, points[1:]):
        if l0 > target >= l1:
            return s0 + (s1 - s0) * (l0 - target) / (l0 - l1)
    return None


def interval(values):
    """(mean, half-width of the 95% interval by Student's t; 0 for one value) of `values`."""
    mean = statistics.fmean(values)
    n = len(values)
    if n < 2:
        return mean, 0.0
    return mean, T95.get(n - 1, 1.96) * statistics.stdev(values) / math.sqrt(n)


def wall_ms(records, step):
    """Training ms up to the fractional `step`: the logged step times (log_interval=1) summed,
    the last step in part."""
    ms = {r["iter"]: r["ms"] for r in records if "ms" in r}
    whole = math.floor(step)
    return sum(ms[i] for i in range(whole) if i in ms) + (step - whole) * ms.get(whole, 0.0)


def curve(records):
    """[(step, val loss)] of a run's evaluations, in order."""
    return sorted((r["iter"], r["val_loss"]) for r in records if "val_loss" in r)


def train(runs, shape, seeds, eval_every, tmp, log, keep=None, seed0=1337):
    """{run: [records of each seed]}, the runs interleaved seed by seed, each a fresh process. With
    `keep` (a folder), each run's records are kept there and reused when the same arguments come
    again on the same code and corpus (a sweep that was stopped goes on where it was); a kept file
    that is not a record is a ValueError naming it."""
    import json
    from bench_common import train_run
    nproc = next((int(a.split("=")[1]) for a in shape if a.startswith("--tp=")), 1)
    out, reused = {name: [] for name in runs}, 0
    for seed in range(seeds):
        for i, (name, args) in enumerate(runs.items()):   # (a folder each: seed, run)
            argv = [*shape, *args, f"--seed={seed0 + seed}", f"--eval_interval={eval_every}"]
            kept = Path(keep) / f"{name.replace(' ', '_').replace(',', '')}-{seed}.json" \
                if keep else None
            key = run_key(argv) if kept else None
            records = read_kept(kept, key) if kept and kept.is_file() else None
            reused += records is not None
            if records is None:
                records = train_run(nproc, argv, f"{tmp}/{seed}-{i}")
                if kept:
                    kept.parent.mkdir(parents=True, exist_ok=True)
                    kept.write_text(json.dumps({"key": key, "records": records}))
            out[name].append(records)
            points = curve(records)
            log(f"  seed {seed}: {name}: val {points[-1][1]:.4f} at step {points[-1][0]}")
    if reused:
        log(f"reused {reused} record(s) from {keep} (the same arguments, commit and corpus)")
    return out


def run_key(argv):
    """What a kept run's records stand for: its arguments, the code's commit (with '+changes' where
    the work tree differs from it) and its corpus's fingerprint (names, sizes, times)."""
    import subprocess
    from plumbing import options, preparation
    root = Path(__file__).resolve().parents[1]
    git = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout
    commit = git("rev-parse", "HEAD").strip() or "not a git checkout"
    commit += "+changes" if git("status", "--porcelain", "--untracked-files=no").strip() else ""
    _, tc = options.parse_args(argv)
    corpus = preparation.fingerprint(tc.dataset, tc.val_fraction, tc.text_field)
    return {"argv": argv, "commit": commit, "corpus": corpus}


def read_kept(path, key):
    """The records kept in `path` where they were made under `key`, None where under another; a
    file that is not such a record (bad JSON, missing keys, wrong types) is a ValueError."""
    import json
    try:
        kept = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a kept run's record ({e}): remove it") from None
    records = kept.get("records") if isinstance(kept, dict) else None
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    good = isinstance(records, list) and records and all(
        isinstance(r, dict) and isinstance(r.get("iter"), int) and
        all(number(r[k]) for k in ("val_loss", "ms") if k in r) for r in records) and \
        any("val_loss" in r for r in records) and isinstance(kept.get("key", {}), dict)
    if not good:
        raise ValueError(f"{path} is not a kept run's record (it needs a key and a list of "
                         "records, each an iter with numbers): remove it")
    return records if kept.get("key") == key else None   # (an older record had no key)


def summarise(runs, trained, targets, tokens_per_iter, flops):
    """{run: {steps, tokens, flops, wall_s, wall_s_steps: (mean, ±), ratio, reached}}; seed i's
    crossing is against targets[i]."""
    out = {}
    for name, seeds in trained.items():
        steps = [crossing(curve(rec), t) for rec, t in zip(seeds, targets)]
        hit = [(s, rec) for s, rec in zip(steps, seeds) if s is not None]
        row = {"reached": f"{len(hit)}/{len(seeds)}"}
        if hit:
            row["steps"] = interval([s for s, _ in hit])
            row["tokens"] = interval([s * tokens_per_iter for s, _ in hit])
            row["flops"] = interval([s * tokens_per_iter * flops[name] for s, _ in hit])
            row["wall_s"] = interval([wall_ms(rec, s) / 1e3 for s, rec in hit])
            row["wall_s_steps"] = interval([s * statistics.median(r["ms"] for r in rec
                                                                  if "ms" in r) / 1e3
                                            for s, rec in hit])
        # effective throughput: the run's tokens/s at the first run's (the dense model's) FLOPs
        # per token: the work a dense model would do to go as fast, the scale on which a
        # cheaper token compares with a dense one (its MFU counts its own, fewer, FLOPs)
        row["dense_eq_tflops"] = interval([statistics.median(r["tokens_per_s"] for r in rec
                                                             if "tokens_per_s" in r)
                                           * flops[next(iter(runs))] / 1e12 for rec in seeds])
        out[name] = row
    base = out[next(iter(runs))]
    for row in out.values():
        if "wall_s" in row and "wall_s" in base:
            row["ratio"] = row["wall_s"][0] / base["wall_s"][0]
    return out


def figure(trained, target, tokens_per_iter, flops, summary, path):
    """Val loss against wall time and against FLOPs: each run's seeds as a band (min to max) around
    their mean, the target as a line, the mean crossing marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    walls, crossings = [], []   # (the wall-time panel's curves and crossings, zoomed below)
    for name, seeds in trained.items():
        steps = [s for s, _ in curve(seeds[0])]
        losses = [[dict(curve(rec)).get(s, float("nan")) for rec in seeds] for s in steps]
        mean = [statistics.fmean(v) for v in losses]
        for ax, x in ((axes[0], [statistics.fmean(wall_ms(rec, s) for rec in seeds) / 1e3
                                 for s in steps]),
                      (axes[1], [s * tokens_per_iter * flops[name] for s in steps])):
            line, = ax.plot(x, mean, marker="o", ms=3, label=name)
            if ax is axes[0]:
                walls.append((x, mean, line.get_color()))
            ax.fill_between(x, [min(v) for v in losses], [max(v) for v in losses],
                            color=line.get_color(), alpha=0.2)
        row = summary[name]
        if "wall_s" in row:
            axes[0].plot([row["wall_s"][0]], [target], "x", color=line.get_color(), ms=10)
            crossings.append((row["wall_s"][0], line.get_color()))
            axes[1].plot([row["flops"][0]], [target], "x", color=line.get_color(), ms=10)
    for ax, label in zip(axes, ("wall time, s (training steps, this machine)", "model FLOPs")):
        ax.axhline(target, color="gray", ls="--", lw=1)
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss")
        ax.legend()
    zoom(axes[0], walls, crossings, target)
    load = os.getloadavg()[0]   # (the machine and its load, on the figure that shows time)
    fig.suptitle(f"time to the target val loss, mean {target:.4f} (dashed); seeds as bands; "
                 f"{os.cpu_count()} CPUs, load {load:.1f} at the end", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def zoom(ax, curves, crossings, target):
    """An inset of the wall-time panel around the crossings ((t, colour)), where the curves
    overlap near the target and hide which crosses first: (its x limits, y limits), or None."""
    if not crossings:
        return None
    lo, hi = min(t for t, _ in crossings), max(t for t, _ in crossings)
    pad = max(hi - lo, 0.05 * hi, 1e-9)
    xlim = (lo - pad, hi + pad)
    near = [y for x, ys, _ in curves for xi, y in zip(x, ys) if xlim[0] <= xi <= xlim[1]]
    spread = max([abs(y - target) for y in near] + [1e-3])
    inset = ax.inset_axes([0.5, 0.45, 0.47, 0.4])
    for x, ys, color in curves:
        inset.plot(x, ys, marker="o", ms=3, color=color)
    for t, color in crossings:
        inset.plot([t], [target], "x", color=color, ms=10)
    inset.axhline(target, color="gray", ls="--", lw=1)
    inset.set(xlim=xlim, ylim=(target - spread, target + spread))
    inset.tick_params(labelsize=6)
    inset.set_title("the crossings, zoomed", fontsize=7)
    ax.indicate_inset_zoom(inset, edgecolor="gray")
    return xlim, inset.get_ylim()


def plan(extra, runs, shape):
    """(the bench's options, runs with train.py's own options added, shape, seeds, each run's
    parsed (Config, TrainConfig)), or exit 2 with one line before any training."""
    from bench_common import need_matplotlib, shape_args
    from plumbing import options
    need_matplotlib("bench.py quality's figure")
    opts = dict(a[2:].split("=", 1) for a in extra if a.startswith("--") and "=" in a)
    seeds, tier = opts.get("seeds", "3"), opts.get("tier", "cpu")
    # train.py's own options (--dataset=..., --tokenizer=...) go to every run
    given = [a for a in extra if a.startswith("--") and a[2:].split("=")[0] not in OWN]
    if not seeds.isdigit() or int(seeds) < 1 or tier not in ("cpu", "gpu"):
        print(f"error: --seeds={seeds} must be a whole number of at least 1 and --tier={tier} "
              "cpu or gpu", file=sys.stderr)
        sys.exit(2)
    if tier == "gpu" and not any(a.startswith("--dataset=") for a in given):
        print("error: --tier=gpu trains on 33M tokens a run: name a corpus of that size with "
              "--dataset=... (docs/corpora.md)", file=sys.stderr)
        sys.exit(2)
    gpu = tier == "gpu"
    runs = {name: [*args, *given] for name, args in (runs or (RUNS_GPU if gpu else RUNS)).items()}
    shape = shape if shape is not None else SHAPE_GPU if gpu else SHAPE
    files = [a for a in extra if a.endswith(".toml")]
    if files:   # a config file names the shape (on the GPU tier: in place of CoLA-60M's)
        shape = [*files, *(a for a in shape if not a.endswith(".toml"))]
    try:
        parsed = {name: options.parse_args(shape_args([*shape, *args], []))
                  for name, args in runs.items()}
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    return opts, runs, shape, int(seeds), parsed


def rows_of(summary):
    """The table's rows: each measure as mean ± half-width of its 95% interval."""
    def fmt(r, key, f):
        return f"{f(r[key][0])} ± {f(r[key][1])}" if key in r else "not reached"
    return [[name, r["reached"], fmt(r, "steps", lambda v: f"{v:.0f}"),
             fmt(r, "tokens", lambda v: f"{v / 1e6:.2f}M"),
             fmt(r, "flops", lambda v: f"{v / 1e12:.2f}T"), fmt(r, "wall_s", lambda v: f"{v:.1f}"),
             fmt(r, "wall_s_steps", lambda v: f"{v:.1f}"),
             fmt(r, "dense_eq_tflops", lambda v: f"{v:.3f}"),
             f"{r['ratio']:.2f}" if "ratio" in r else "-"] for name, r in summary.items()]


def bench(extra, runs=None, shape=None, eval_every=EVAL_EVERY, log=print):
    """(markdown text, results) of time to quality; `extra` may hold --seeds=N (default 3),
    --target=X (a val loss), --target_step=N (the first run's mean val loss at step N),
    --figure=PATH, --tier=cpu|gpu and train.py's options."""
    import torch
    from bench_common import table
    from model import Llama
    from plumbing import options
    opts, runs, shape, seeds, parsed = plan(extra, runs, shape)
    flops = {}
    for name, (cfg, tc) in parsed.items():
        cfg.vocab_size = options.vocab_size(tc.tokenizer)
        with torch.device("meta"):
            flops[name] = Llama(cfg).flops_per_token(cfg.block_size)
    first = next(iter(runs))
    cfg, tc = parsed[first]
    with tempfile.TemporaryDirectory() as tmp:
        trained = train(runs, shape, seeds, eval_every, tmp, log)
    tokens_per_iter = tc.batch_size * tc.gradient_accumulation_steps * cfg.block_size
    # a seed's evaluation batches are drawn from its seed: each seed's runs are compared on theirs,
    # against the baseline's val loss of the same seed (paired), unless --target names a number
    step = int(opts.get("target_step", curve(trained[first][0])[-1][0]))
    targets = [float(opts["target"]) if "target" in opts else dict(curve(rec))[step]
               for rec in trained[first]]
    target = statistics.fmean(targets)
    summary = summarise(runs, trained, targets, tokens_per_iter, flops)
    path = Path(opts.get("figure") or RESULTS / "quality.png")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure(trained, target, tokens_per_iter, flops, summary, path)
    text = (f"Time to the first run's val loss at step {step}, each seed against its own "
            f"(mean {target:.4f}; or --target), {seeds} seed(s), mean ± 95%; figure {path}\n\n" +
            table(["run", "seeds reaching it", "steps", "tokens", "model FLOPs",
                   "wall s (measured)", "wall s (steps × median step)",
                   "dense-equivalent TFLOP/s", "wall time / first's"], rows_of(summary)))
    return text, {"target": target, "targets": targets, "summary": summary, "flops": flops,
                  "curves": {n: [curve(r) for r in s] for n, s in trained.items()}}


def sweep(extra, log=print):
    """(markdown text, results) of the recipe sweep: each recipe of SWEEP whose name holds
    `--sweep=TEXT` (all for a bare --sweep) on `--seeds` seeds (default 1), at tp=1; per recipe its
    val loss at step `--target_step` (default STEPS) and at its end, and its steps to the target:
    on each seed the val loss there of the best dense recipe (by its mean), or `--target=X`;
    runs are kept in `--keep_runs=DIR` (default bench-results/sweep/), for a stopped sweep."""
    opts = dict(a[2:].partition("=")[::2] for a in extra if a.startswith("--"))
    only, seeds = opts.get("sweep", ""), opts.get("seeds", "1")
    runs = {name: args for name, args in SWEEP.items() if only in name}
    if not runs or not seeds.isdigit() or int(seeds) < 1:
        print(f"error: --sweep={only} names no recipe of {list(SWEEP)}, or --seeds={seeds} is "
              "not a whole number of at least 1", file=sys.stderr)
        sys.exit(2)
    if not opts.get("target") and not any(name.startswith("dense") for name in runs):
        print(f"error: --sweep={only} names no dense recipe to take the target from: name one "
              "too, or pass --target=X", file=sys.stderr)
        sys.exit(2)
    step = int(opts.get("target_step") or STEPS)
    shape = [a for a in SHAPE if not a.startswith("--tp=")]
    keep = opts.get("keep_runs") or RESULTS / "sweep"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            trained = train(runs, shape, int(seeds), EVAL_EVERY, tmp, log, keep)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
    at = {name: [dict(curve(rec)).get(step) for rec in recs] for name, recs in trained.items()}
    dense = {name: statistics.fmean(v) for name, v in at.items() if name.startswith("dense")
             and None not in v}
    # each seed against its own target (as the bench pairs them): the best dense recipe's val loss
    # at `step` on that seed (best by the mean over seeds), or --target for every seed
    best = min(dense, key=dense.get, default=None)
    if not opts.get("target") and best is None:
        print("error: no dense recipe ran to the target step: pass --target=X", file=sys.stderr)
        sys.exit(2)
    targets = [float(opts["target"])] * int(seeds) if opts.get("target") else at[best]
    rows, out = [], {}
    for name, recs in trained.items():
        steps = [crossing(curve(rec), t) for rec, t in zip(recs, targets)]
        hit = [s for s in steps if s is not None]
        out[name] = {"at_step": at[name], "last": [curve(rec)[-1] for rec in recs],
                     "steps": steps}
        v = [x for x in at[name] if x is not None]
        rows.append([name, f"{statistics.fmean(v):.4f}" if v else "-",
                     " ".join(f"{curve(rec)[-1][1]:.4f} ({curve(rec)[-1][0]})" for rec in recs),
                     f"{len(hit)}/{len(recs)}", "%.0f ± %.0f" % interval(hit) if hit else "-"])
    target = statistics.fmean(targets)
    from bench_common import table
    text = (f"Recipe sweep at tp=1, {seeds} seed(s); target: each seed's val loss of the best "
            f"dense recipe at step {step} (mean {target:.4f}), or --target\n\n" +
            table(["recipe", f"val at step {step}", "val at the end (step)", "seeds reaching it",
                   "steps to the target"], rows))
    return text, {"target": target, "targets": targets, "target_step": step, "recipes": out}
