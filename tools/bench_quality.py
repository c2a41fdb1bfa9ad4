"""bench_quality.py: `python tools/bench.py quality`: time to quality, the number BOOST is about.

BOOST (arXiv 2512.12131) promises the dense model's quality sooner. This bench trains each run of
RUNS (an arch under a layout at tp=2, its own learning rate and schedule) in fresh train.py
processes under torchrun, on `--seeds` seeds (default 3), the runs interleaved seed by seed, and
asks when each reaches a target validation loss: the baseline's (the first run, the dense model
under Megatron TP) val loss at its last step (`--target_step`, default its max_iters), seed by
seed, since a seed also draws its evaluation batches (the mean target is reported), or a number
for every seed (`--target=1.70`). Validation is evaluated every `eval_every` steps on a fixed
held-out budget; the crossing is placed by linear interpolation between the two evaluations
around it.
Per run: steps, tokens, model FLOPs and wall time to the target, each a mean and a 95% interval
over seeds (Student's t), and the wall time's ratio to the baseline's. Wall time twice: measured
(the sum of train.py's synchronised step times up to the crossing, evaluation left out) and as
steps × the run's median step time, so that the machine's noise shows. A figure: val loss
against wall time and against FLOPs, each run's seeds as a band around their mean, the target as
a line, the crossings marked (`--figure=PATH`, default bench-results/quality.png).
"""
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the core files: the root

# the CPU tier (the default): d=256, 4 layers, block 128, batch 16, at tp=2
SHAPE = ["--n_layer=4", "--n_embd=256", "--n_head=8", "--block_size=128", "--batch_size=16",
         "--warmup_iters=30", "--eval_iters=4", "--tp=2"]
RUNS = {"dense (megatron)": ["--arch=full", "--layout=megatron", "--learning_rate=1e-3",
                             "--max_iters=600"],
        "cola (btp)": ["--arch=cola", "--layout=btp", "--learning_rate=3e-3", "--max_iters=900"]}
EVAL_EVERY = 50
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


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


def train(runs, shape, seeds, eval_every, tmp, log):
    """{run: [records of each seed]}, the runs interleaved seed by seed, each a fresh process."""
    from bench_common import train_run
    nproc = next((int(a.split("=")[1]) for a in shape if a.startswith("--tp=")), 1)
    out = {name: [] for name in runs}
    for seed in range(seeds):
        for name, args in runs.items():
            records = train_run(nproc, [*shape, *args, f"--seed={1337 + seed}",
                                        f"--eval_interval={eval_every}"],
                                f"{tmp}/{len(out[name])}-{name.split()[0]}")
            out[name].append(records)
            points = curve(records)
            log(f"  seed {seed}: {name}: val {points[-1][1]:.4f} at step {points[-1][0]}")
    return out


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
    for name, seeds in trained.items():
        steps = [s for s, _ in curve(seeds[0])]
        losses = [[dict(curve(rec)).get(s, float("nan")) for rec in seeds] for s in steps]
        mean = [statistics.fmean(v) for v in losses]
        for ax, x in ((axes[0], [statistics.fmean(wall_ms(rec, s) for rec in seeds) / 1e3
                                 for s in steps]),
                      (axes[1], [s * tokens_per_iter * flops[name] for s in steps])):
            line, = ax.plot(x, mean, marker="o", ms=3, label=name)
            ax.fill_between(x, [min(v) for v in losses], [max(v) for v in losses],
                            color=line.get_color(), alpha=0.2)
        row = summary[name]
        if "wall_s" in row:
            axes[0].plot([row["wall_s"][0]], [target], "x", color=line.get_color(), ms=10)
            axes[1].plot([row["flops"][0]], [target], "x", color=line.get_color(), ms=10)
    for ax, label in ((axes[0], "wall time, s (training steps, this machine)"),
                      (axes[1], "model FLOPs")):
        ax.axhline(target, color="gray", ls="--", lw=1)
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss")
        ax.legend()
    load = os.getloadavg()[0]   # (the machine and its load, on the figure that shows time)
    fig.suptitle(f"time to the target val loss, mean {target:.4f} (dashed); seeds as bands; "
                 f"{os.cpu_count()} CPUs, load {load:.1f} at the end", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench(extra, runs=None, shape=None, eval_every=EVAL_EVERY, log=print):
    """(markdown text, results) of time to quality; `extra` may hold --seeds=N (default 3),
    --target=X (a val loss), --target_step=N (the first run's mean val loss at step N) and
    --figure=PATH."""
    import torch
    from bench_common import table
    from model import Llama
    from plumbing import options
    runs, shape = runs or RUNS, shape if shape is not None else SHAPE
    opts = dict(a[2:].split("=", 1) for a in extra if a.startswith("--") and "=" in a)
    seeds = opts.get("seeds", "3")
    if not seeds.isdigit() or int(seeds) < 1:
        print(f"error: --seeds={seeds} must be a whole number of at least 1", file=sys.stderr)
        sys.exit(2)
    seeds = int(seeds)
    with tempfile.TemporaryDirectory() as tmp:
        trained = train(runs, shape, seeds, eval_every, tmp, log)
    cfgs = {name: options.parse_args([*shape, *args])[0] for name, args in runs.items()}
    flops = {}
    for name, cfg in cfgs.items():
        cfg.vocab_size = options.vocab_size("bytes")
        with torch.device("meta"):
            flops[name] = Llama(cfg).flops_per_token(cfg.block_size)
    first = next(iter(runs))
    tc = options.parse_args([*shape, *runs[first]])[1]
    tokens_per_iter = tc.batch_size * tc.gradient_accumulation_steps * cfgs[first].block_size
    base = trained[first]
    # a seed's evaluation batches are drawn from its seed: each seed's runs are compared on theirs,
    # against the baseline's val loss of the same seed (paired), unless --target names a number
    step = int(opts.get("target_step", curve(base[0])[-1][0]))
    targets = [float(opts["target"]) if "target" in opts else dict(curve(rec))[step]
               for rec in base]
    target = statistics.fmean(targets)
    summary = summarise(runs, trained, targets, tokens_per_iter, flops)

    def fmt(r, key, f):
        return f"{f(r[key][0])} ± {f(r[key][1])}" if key in r else "not reached"
    rows = [[name, r["reached"], fmt(r, "steps", lambda v: f"{v:.0f}"),
             fmt(r, "tokens", lambda v: f"{v / 1e6:.2f}M"),
             fmt(r, "flops", lambda v: f"{v / 1e12:.2f}T"), fmt(r, "wall_s", lambda v: f"{v:.1f}"),
             fmt(r, "wall_s_steps", lambda v: f"{v:.1f}"),
             f"{r['ratio']:.2f}" if "ratio" in r else "-"] for name, r in summary.items()]
    path = Path(opts.get("figure", Path(__file__).resolve().parents[1] / "bench-results" /
                         "quality.png"))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure(trained, target, tokens_per_iter, flops, summary, path)
    text = (f"Time to the first run's val loss at step {step}, each seed against its own "
            f"(mean {target:.4f}; or --target), {seeds} seed(s), mean ± 95% interval; figure "
            f"{path}\n\n" +
            table(["run", "seeds reaching it", "steps", "tokens", "model FLOPs",
                   "wall s (measured)", "wall s (steps × median step)", "wall time / first's"],
                  rows))
    return text, {"target": target, "targets": targets, "summary": summary,
                  "curves": {n: [curve(r) for r in s] for n, s in trained.items()}}
