"""bench_arms.py: `python tools/bench.py arms`: time to quality as a sceptic asks for it: four arms,
each tuned with the same sweep budget, five seeds, the wall-time ratio's interval.

BOOST (arXiv 2512.12131) promises the dense model's quality sooner. The arms: {the dense model
under Megatron TP, CoLA under BTP} x {AdamW, Muon}. `--sweep` tunes each arm with the same budget:
the same number of recipes over the same grid (learning rate x warmup for the AdamW arms, Muon's
rate x warmup for the Muon arms, whose AdamW part keeps 1e-3), trained at tp=1 on the sweep seed
SWEEP_SEED, which no bench seed uses; each arm's winner (the dense arms': the lowest val loss at
their last step; CoLA's: the fewest steps to the better dense winner's val loss, else the lowest
last val) is written as configs/arms/<arm>.toml, and the sweep's table lists what each arm was
offered. A fifth arm, CoLA with Muon at r = 3d/8 (RANKED), is not swept: it trains CoLA Muon's
winner at the other rank, the rank the only difference. The bench trains the winners on `--seeds`
seeds (default 5), interleaved, at tp=2; on each seed the target is the better dense arm's val
loss at its last step (the better: lower on the mean over seeds), and each CoLA arm meets each
dense arm seed by seed (`pairs`): seeds reaching, steps, tokens, FLOPs and wall time to the target
(mean, 95% interval), and the wall ratio: per seed CoLA's wall time over the dense arm's, its mean
and the upper end of its interval. Dense arms train DENSE_STEPS; CoLA's cosine is 1.25x that and
it trains on to EXTEND x (one that misses says where it ended). The headline is the best CoLA arm
against the better dense arm; `decide` splits its ratio into the steps ratio and the step-time
ratio, and says what each would need for 0.6. `--arms=a,b` trains some arms only (the CPU tier's
headline pair in under 25 minutes). `--tier=gpu`: CoLA-60M's shape on one GPU at tp=1, three
seeds, its corpus prepared by the command from this machine's Python library (no download).
"""
import contextlib
import itertools
import statistics
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import bench_quality as bq   # noqa: E402  (crossing, interval, curve, wall_ms, kept records)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs" / "arms"
SHAPE = bq.SHAPE                    # d=256, 4 layers, block 128, batch 8, tp=2 (the CPU tier)
# 300 dense steps: the headline pair's five seeds fit 25 minutes on the 2-core machine (500 did not)
DENSE_STEPS, COLA_DECAY, EXTEND = 300, 375, 1.5
ARMS = {"dense adamw": ["--arch=full", "--layout=megatron", "--optimizer=adamw"],
        "dense muon": ["--arch=full", "--layout=megatron", "--optimizer=muon"],
        "cola adamw": ["--arch=cola", "--layout=btp", "--optimizer=adamw"],
        "cola muon": ["--arch=cola", "--layout=btp", "--optimizer=muon"]}
RANKED = {"cola muon r=3d/8": ("cola muon", 3 / 8)}   # arm: (the swept arm whose winner, r/d)
CHOICES = [*ARMS, *RANKED]          # the arms --arms may name: the swept ones and the RANKED
LRS, MUON_LRS, WARMUPS = ("1e-3", "2e-3", "4e-3"), ("0.01", "0.02", "0.04"), (30, 90)
SWEEP_SEED, SEED0 = 7, 1337         # the sweep's seed; the bench's are SEED0, SEED0 + 1, ...
# the GPU tier: CoLA-60M's shape, tp=1, three seeds; the corpus: this machine's Python library
SHAPE_GPU = ["--n_embd=512", "--mlp_width=1376", "--n_head=8", "--n_layer=8", "--attn_rank=128",
             "--mlp_rank=128", "--mlp_gate=silu", "--norm_eps=1e-6", "--block_size=256",
             "--batch_size=32", "--eval_iters=10", "--tp=1"]   # (configs/cola_60m.toml's model)
STEPS_GPU = 1000


def schedule(arm, dense_steps=None):
    """The steps an arm trains and its cosine's length: a dense arm `dense_steps` (DENSE_STEPS; its
    last val loss is the target), CoLA a cosine of 1.25x that, trained on to EXTEND x (a miss says
    where)."""
    dense_steps = dense_steps or DENSE_STEPS
    if arm.startswith("dense"):
        return [f"--lr_decay_iters={dense_steps}", f"--max_iters={dense_steps}"]
    return [f"--lr_decay_iters={dense_steps * COLA_DECAY // DENSE_STEPS}",
            f"--max_iters={int(dense_steps * EXTEND)}"]


def config_file(arm):
    """The winner file an arm trains: its own, or (a RANKED arm) the swept arm's."""
    arm = RANKED.get(arm, (arm,))[0]
    return CONFIGS / f"{arm.replace(' ', '_')}.toml"


def rank_args(arm, shape):
    """A RANKED arm's bottleneck rank, r = its fraction of the shape's n_embd; [] for the others."""
    if arm not in RANKED:
        return []
    d = int(next(a for a in shape if a.startswith("--n_embd=")).split("=")[1])
    r = int(d * RANKED[arm][1])
    return [f"--attn_rank={r}", f"--mlp_rank={r}"]


def grid(arm):
    """{recipe name: train.py options} the sweep offers `arm`: as many recipes for every arm, over
    the same grid (rate x warmup); a Muon arm's rate is Muon's, its AdamW part at 1e-3."""
    muon = arm.endswith("muon")
    out = {}
    for lr in (MUON_LRS if muon else LRS):
        for warmup in WARMUPS:
            rates = ["--learning_rate=1e-3", "--min_lr=1e-4", f"--muon_lr={lr}"] if muon else \
                [f"--learning_rate={lr}", f"--min_lr={float(lr) / 10:g}"]
            out[f"{arm}: {'muon_lr' if muon else 'lr'} {lr}, warmup {warmup}"] = \
                [*ARMS[arm], *rates, f"--warmup_iters={warmup}", *schedule(arm)]
    return out


def winners(trained):
    """{arm: its winning recipe's name} from {recipe: [records]} (one seed): the dense arms' lowest
    val at their last step; CoLA's fewest steps to the better dense winner's (else lowest last)."""
    last = {name: bq.curve(recs[0])[-1][1] for name, recs in trained.items()}
    by_arm = {}
    for name in trained:
        by_arm.setdefault(name.split(":")[0], []).append(name)
    out = {arm: min(names, key=last.get) for arm, names in by_arm.items()
           if arm.startswith("dense")}
    target = min((last[n] for n in out.values()), default=None)
    for arm, names in by_arm.items():
        if arm.startswith("cola"):
            steps = {n: bq.crossing(bq.curve(trained[n][0]), target) if target else None
                     for n in names}
            out[arm] = min(names, key=lambda n: (steps[n] is None, steps[n] or 0, last[n]))
    return out


def write_config(arm, args, folder=None):
    """The winner of `arm` as a config file (`option = value` lines) in `folder` (CONFIGS): the
    bench's arm."""
    folder = folder or CONFIGS
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"# {arm}: the winner of `bench.py arms --sweep` (tools/bench_arms.py)"]
    for a in args:
        key, value = a[2:].split("=", 1)
        lines.append(f"{key} = {value}" if value.replace(".", "").replace("e-", "").isdigit()
                     else f'{key} = "{value}"')
    path = folder / f"{arm.replace(' ', '_')}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def config_args(path):
    """A winner's config file as --key=value options, to follow the bench's shape (whose own
    warmup, a config file placed first would lose to)."""
    from plumbing import options
    return [f"--{k}={v}" for k, v in options.read_config_file(path, options.options()).items()]


def pair(cola, dense, targets, tokens_per_iter, flops):
    """One CoLA arm against one dense arm, seed by seed ([records] each, targets[i] seed i's):
    {reached, steps, tokens, flops, wall_s: (mean, ±), ratio: (mean, ±, upper end), ended}."""
    steps = [bq.crossing(bq.curve(c), t) for c, t in zip(cola, targets)]
    base = [bq.crossing(bq.curve(d), t) for d, t in zip(dense, targets)]
    hit = [i for i, s in enumerate(steps) if s is not None]
    row = {"reached": f"{len(hit)}/{len(cola)}",
           "ended": [bq.curve(c)[-1] for i, c in enumerate(cola) if steps[i] is None]}
    if hit:
        row["steps"] = bq.interval([steps[i] for i in hit])
        row["tokens"] = bq.interval([steps[i] * tokens_per_iter for i in hit])
        row["flops"] = bq.interval([steps[i] * tokens_per_iter * flops for i in hit])
        row["wall_s"] = bq.interval([bq.wall_ms(cola[i], steps[i]) / 1e3 for i in hit])
    both = [i for i in hit if base[i] is not None]
    if both:
        ratios = [bq.wall_ms(cola[i], steps[i]) / bq.wall_ms(dense[i], base[i]) for i in both]
        mean, half = bq.interval(ratios)
        row["ratio"] = (mean, half, mean + half)
        row["steps_ratio"] = statistics.fmean(steps[i] / base[i] for i in both)
        row["step_time_ratio"] = statistics.fmean(
            statistics.median(r["ms"] for r in cola[i] if "ms" in r) /
            statistics.median(r["ms"] for r in dense[i] if "ms" in r) for i in both)
    return row


def decide(row, goal=0.6):
    """Which half decides a pair's wall ratio: its steps ratio and step-time ratio, and what each
    would need (the other held) for the ratio `goal`."""
    s, t = row["steps_ratio"], row["step_time_ratio"]
    return {"steps_ratio": s, "step_time_ratio": t, "product": s * t,
            "steps_ratio_for_goal": goal / t, "step_time_ratio_for_goal": goal / s}


def compare(trained, tokens_per_iter, flops):
    """(targets, the better dense arm, {(cola arm, dense arm): pair}, the headline's key): every
    CoLA arm against every dense arm on the better dense arm's last val loss, seed by seed."""
    dense = [a for a in trained if a.startswith("dense")]
    better = min(dense, key=lambda a: statistics.fmean(bq.curve(r)[-1][1] for r in trained[a]))
    targets = [bq.curve(r)[-1][1] for r in trained[better]]
    pairs = {(c, d): pair(trained[c], trained[d], targets, tokens_per_iter, flops[c])
             for c in trained if c.startswith("cola") for d in dense}
    heads = [k for k in pairs if k[1] == better]
    head = min(heads, key=lambda k: (-int(pairs[k]["reached"].split("/")[0]),
                                     pairs[k].get("ratio", (float("inf"),))[0]), default=None)
    return targets, better, pairs, head


def own_targets(trained, better, tokens_per_iter, flops):
    """{(cola arm, dense arm): pair} against each dense arm but the better one on that arm's own val
    loss at its last step, seed by seed: like against like (e.g. both with AdamW, as the papers
    compare), beside the headline's harder target."""
    return {(c, d): pair(trained[c], trained[d], [bq.curve(r)[-1][1] for r in trained[d]],
                         tokens_per_iter, flops[c])
            for d in trained if d.startswith("dense") and d != better
            for c in trained if c.startswith("cola")}


def rows_of(pairs):
    def fmt(r, key, f):
        return f"{f(r[key][0])} ± {f(r[key][1])}" if key in r else "not reached"
    return [[f"{c} vs {d}", r["reached"], fmt(r, "steps", lambda v: f"{v:.0f}"),
             fmt(r, "tokens", lambda v: f"{v / 1e6:.2f}M"),
             fmt(r, "flops", lambda v: f"{v / 1e12:.2f}T"), fmt(r, "wall_s", lambda v: f"{v:.1f}"),
             f"{r['ratio'][0]:.2f} ± {r['ratio'][1]:.2f} (upper {r['ratio'][2]:.2f})"
             if "ratio" in r else "-",
             "; ".join(f"{v:.4f} at {s}" for s, v in r["ended"]) or "-"]
            for (c, d), r in pairs.items()]


def sweep(extra, log=print):
    """(markdown, results) of the sweep: every arm's grid (or the arms of --arms=a,b) on the sweep
    seed at tp=1, kept in bench-results/sweep-arms/ for a stopped sweep; the winners written."""
    arms = [a for a in chosen(extra) if a in ARMS]   # (a RANKED arm takes another's winner)
    runs = {name: args for arm in arms for name, args in grid(arm).items()}
    shape = [a for a in SHAPE if not a.startswith("--tp=")]
    with tempfile.TemporaryDirectory() as tmp:
        trained = bq.train(runs, shape, 1, bq.EVAL_EVERY, tmp, log, bq.RESULTS / "sweep-arms",
                           seed0=SWEEP_SEED)
    won = winners(trained)
    for arm, name in won.items():
        write_config(arm, runs[name])
    rows = [[name, f"{len(grid(name.split(':')[0]))}", " ".join(
        f"{v:.4f}@{s}" for s, v in bq.curve(recs[0])[-4:]), "winner" if name in won.values()
        else ""] for name, recs in trained.items()]
    from bench_common import table
    text = (f"Sweep at tp=1 on seed {SWEEP_SEED}: each arm offered the same number of recipes "
            f"over the same grid (rate in {LRS} for AdamW, Muon's in {MUON_LRS}; warmup in "
            f"{WARMUPS}); winners written to {CONFIGS}\n\n" +
            table(["recipe", "recipes its arm was offered", "val loss at the last evaluations",
                   ""], rows))
    return text, {"winners": won, "curves": {n: bq.curve(r[0]) for n, r in trained.items()}}


def chosen(extra):
    """The arms named by --arms=a,b (default all of CHOICES), or exit 2 with one line."""
    opts = dict(a[2:].partition("=")[::2] for a in extra if a.startswith("--"))
    arms = [a.strip() for a in opts.get("arms", ",".join(CHOICES)).split(",")]
    if not arms or any(a not in CHOICES for a in arms):
        print(f"error: --arms={opts.get('arms')} names an arm not among {CHOICES}",
              file=sys.stderr)
        sys.exit(2)
    return arms


@contextlib.contextmanager
def timed_runs(runs):
    """Yields {run: [seconds of each of its train.py processes]}, filled while bench_quality.train
    calls bench_common.train_run (each process start to end, its evaluations and start-up in)."""
    import time
    import bench_common
    seconds, first = {name: [] for name in runs}, bench_common.train_run
    order = itertools.cycle(runs)   # (bench_quality.train: the runs in order, seed by seed)

    def timed(nproc, args, out_dir):
        t0 = time.time()
        records = first(nproc, args, out_dir)
        seconds[next(order)].append(time.time() - t0)
        return records
    bench_common.train_run = timed
    try:
        yield seconds
    finally:
        bench_common.train_run = first


def figure(out, path):
    """Val loss against steps, model FLOPs and (where the run kept its step times) wall time, each
    arm's seeds as a band (min to max) around their mean, the mean target dashed: from the bench's
    results (its JSON), so a kept run can be drawn again."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = ["step", "model FLOPs"] + (["wall time, s (steps x the median step)"]
                                        if "step_ms" in out else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for name, seeds in out["curves"].items():
        by_seed = [dict(map(tuple, c)) for c in seeds]   # ({step: val} of each seed)
        steps = list(by_seed[0])
        losses = [[c.get(s, float("nan")) for c in by_seed] for s in steps]
        mean = [statistics.fmean(v) for v in losses]
        scales = [1.0, out["tokens_per_iter"] * out["flops"][name]] + (   # (x per step, a panel)
            [statistics.fmean(out["step_ms"][name]) / 1e3] if "step_ms" in out else [])
        for ax, scale in zip(axes[0], scales):
            x = [s * scale for s in steps]
            line, = ax.plot(x, mean, marker="o", ms=2, label=name)
            ax.fill_between(x, [min(v) for v in losses], [max(v) for v in losses],
                            color=line.get_color(), alpha=0.15)
    target = statistics.fmean(out["targets"])
    for ax, label in zip(axes[0], panels):
        ax.axhline(target, color="gray", ls="--", lw=1)
        ax.set(xlabel=label, ylabel="validation loss", ylim=(target - 0.25, target + 0.6))
        ax.legend(fontsize=7)
    fig.suptitle(f"{len(out['targets'])} seeds as bands; dashed: {out['better']}'s val loss at "
                 f"its last step, mean {target:.4f}", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)   # (a fresh clone has no bench-results/)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def gpu_corpus():
    """The GPU tier's corpus, from what the machine has: its Python standard library's sources (a
    folder of text files train.py prepares itself), so no download is needed."""
    import sysconfig
    return sysconfig.get_paths()["stdlib"]


def bench(extra, log=print):
    """(markdown, results) of the arms' bench: the written winners of --arms (default all five)
    on --seeds seeds (default 5; the GPU tier's 3), interleaved; every pair, the headline."""
    import torch
    import bench_common
    from model import Llama
    from plumbing import options
    opts = dict(a[2:].partition("=")[::2] for a in extra if a.startswith("--"))
    gpu = opts.get("tier") == "gpu"
    arms, seeds = chosen(extra), int(opts.get("seeds") or (3 if gpu else 5))
    if not any(a.startswith("dense") for a in arms) or not any(a.startswith("cola") for a in arms):
        print("error: --arms needs a dense arm and a CoLA arm", file=sys.stderr)
        sys.exit(2)
    missing = [a for a in arms if not config_file(a).is_file()]
    if missing:
        print(f"error: no sweep winner for {missing}: run `bench.py arms --sweep` first",
              file=sys.stderr)
        sys.exit(2)
    if gpu and not torch.cuda.is_available():
        print("error: --tier=gpu trains on a CUDA device and this machine has none (the CPU tier: "
              "leave --tier out)", file=sys.stderr)
        sys.exit(2)
    bench_common.need_matplotlib("bench.py arms's figure")
    shape = SHAPE_GPU + [f"--dataset={gpu_corpus()}"] if gpu else SHAPE
    runs = {a: [*config_args(config_file(a)), *rank_args(a, shape),
                *(schedule(a, STEPS_GPU) if gpu else [])] for a in arms}
    flops = {}
    for name, args in runs.items():
        cfg, tc = options.parse_args([*shape, *args])
        cfg.vocab_size = options.vocab_size(tc.tokenizer)
        with torch.device("meta"):
            flops[name] = Llama(cfg).flops_per_token(cfg.block_size)
    tokens_per_iter = tc.batch_size * tc.gradient_accumulation_steps * cfg.block_size
    with tempfile.TemporaryDirectory() as tmp, timed_runs(runs) as seconds:
        trained = bq.train(runs, shape, seeds, bq.EVAL_EVERY, tmp, log, seed0=SEED0)
    return report(trained, seconds, flops, tokens_per_iter)


def report(trained, seconds, flops, tokens_per_iter):
    """(markdown, results) of the bench's trained runs: every pair on the better dense arm's target
    and on each other dense arm's own, the figure, each arm's process time, the headline."""
    from bench_common import table
    seeds = len(next(iter(trained.values())))
    targets, better, pairs, head = compare(trained, tokens_per_iter, flops)
    own = own_targets(trained, better, tokens_per_iter, flops)
    header = ["CoLA arm vs dense arm", "seeds reaching", "steps", "tokens", "model FLOPs", "wall s",
              "wall ratio (upper end)", "missed: val at step"]
    text = (f"Time to the better dense arm's ({better}) val loss at its last step, seed by seed "
            f"(mean {statistics.fmean(targets):.4f}), {seeds} seeds, mean ± 95%\n\n" +
            table(header, rows_of(pairs)))
    if own:
        text += ("\n\nTime to each other dense arm's own val loss at its last step, seed by "
                 "seed\n\n" + table(header, rows_of(own)))
    out = {"targets": targets, "better": better, "flops": flops, "seconds": seconds,
           "pairs": {f"{c} vs {d}": r for (c, d), r in pairs.items()},
           "own_targets": {f"{c} vs {d}": r for (c, d), r in own.items()},
           "curves": {n: [bq.curve(r) for r in s] for n, s in trained.items()},
           "tokens_per_iter": tokens_per_iter,
           "step_ms": {n: [statistics.median(x["ms"] for x in r if "ms" in x) for r in s]
                       for n, s in trained.items()}}
    figure(out, bq.RESULTS / "arms.png")
    text += f"\n\nFigure: {bq.RESULTS / 'arms.png'}. Each arm's runs, all seeds, start to end: "
    text += ", ".join(f"{a} {sum(t) / 60:.1f} min" for a, t in seconds.items())
    if head and "ratio" in pairs[head]:
        out["headline"], out["decide"] = f"{head[0]} vs {head[1]}", decide(pairs[head])
        d = out["decide"]
        text += (f"\n\nHeadline: {head[0]} against {head[1]}: wall ratio "
                 f"{pairs[head]['ratio'][0]:.2f}, upper end of its 95% interval "
                 f"{pairs[head]['ratio'][2]:.2f}; steps ratio {d['steps_ratio']:.2f} x step-time "
                 f"ratio {d['step_time_ratio']:.2f}; for 0.6 the steps ratio would need "
                 f"{d['steps_ratio_for_goal']:.2f} or the step-time ratio "
                 f"{d['step_time_ratio_for_goal']:.2f}")
    return text, out
