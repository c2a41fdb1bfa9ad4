"""bench_startup.py: `python tools/bench.py startup`: what building a rank's model costs, measured
here for boost_1b and predicted from the meta model for the papers' 7B, 13B and 30B shapes.

BOOST (arXiv 2512.12131) trains these shapes on nodes of 8 GPUs; a rank that built the whole
single-device model in fp32 before cutting its part needed the whole model's bytes on its host at
start, and under --dp_shard gathered every parameter and both AdamW moments at each checkpoint.
Measured: each rank of boost_1b (configs/boost_1b.toml, a 32,000-token vocabulary) at tp=1, tp=2
and dp2 x tp2 with --dp_shard=full builds its model both ways in its own process, the ways
interleaved (`--rounds`, default 2; medians): the whole reference cut (the way before) and the
meta-device build (placement.build_model): seconds and the peak memory above the process's start
(VmHWM), on rank 0. Predicted: parameters and bytes a rank of a node of 8 holds at tp=4 (the
paper's TP degree; with --dp_shard=full over the node's 2 dp ranks), at the build, in training and
at a checkpoint, before and now. Drawn: the seconds one core takes to draw the initial values of
boost_1b and boost_7b whole (what every rank did before) and rank 0's part at tp=4 (now).
"""
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the core files: the root

CASES = {"tp=1": (1, ["--tp=1"]), "tp=2": (2, ["--tp=2"]),
         "dp2 x tp2, dp_shard=full": (4, ["--tp=2", "--dp_shard=full",
                                          "--gradient_accumulation_steps=2"])}
VOCAB = 32000


def _rss(field):
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith(field)) * 1024


def _worker(rank, world, store, args, way, result):
    """Build this rank's model `way` (whole: the reference built and cut; meta: build_model) and
    write rank 0's seconds and peak bytes above the start."""
    import time
    import torch
    import torch.distributed as dist
    from extensions import dp_shard
    from tp_model import TPLlama
    import parallel
    from model import Llama
    from plumbing import options, placement
    from plumbing.plan import make
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                store=dist.FileStore(store, world))
    cfg, tc = options.parse_args([str(Path(__file__).resolve().parents[1] / "configs" /
                                      "boost_1b.toml"), *args])
    cfg.vocab_size = VOCAB
    plan = make(cfg, tc, world)
    place = placement.place_processes(plan)
    open("/proc/self/clear_refs", "w").write("5")   # the peak from here
    before, t0 = _rss("VmRSS"), time.time()
    if way == "meta":
        placement.build_model(plan, place)
    else:   # the way before: the whole reference in fp32, then this rank's part cut from it
        torch.manual_seed(tc.seed)
        model = TPLlama(Llama(cfg), place.tp, plan.layout)
        if tc.dp_shard != "none":
            dp_shard.apply(model, place.mesh["dp"], tc.dp_shard, plan.dtype, parallel.LEDGER)
    seconds, peak = time.time() - t0, _rss("VmHWM") - before
    if rank == 0:
        Path(result).write_text(json.dumps({"s": seconds, "peak_gb": peak / 1e9}))
    placement.exit_worker(world)


def measure(rounds):
    """{case: {way: {"s", "peak_gb"}}}: medians of `rounds`, the ways interleaved."""
    from bench_common import spawned
    runs = {}
    for round_ in range(rounds):
        for case, (world, args) in CASES.items():
            for way in ("whole", "meta"):
                r = spawned(_worker, world, args, way)
                runs.setdefault(case, {}).setdefault(way, []).append(r)
                print(f"  round {round_ + 1}: {case} {way}: {r['s']:.1f} s, "
                      f"{r['peak_gb']:.2f} GB", flush=True)
    return {case: {way: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                   for way, rs in ways.items()} for case, ways in runs.items()}


def predict(name, arch, tp=4, dp=2):
    """A rank's share of a paper shape at tp (and dp_shard=full over dp): counts from the meta
    model, bytes fp32."""
    import torch
    from tp_model import TPLlama
    import parallel
    from model import Llama
    from plumbing import options
    root = Path(__file__).resolve().parents[1]
    cfg, _ = options.parse_args([str(root / "configs" / f"{name}.toml"), f"--arch={arch}"])
    cfg.vocab_size = VOCAB
    with torch.device("meta"):
        ref = Llama(cfg)
        part = TPLlama(ref, parallel.TPGroup(None, 0, tp), "btp" if cfg.lowrank
                               else "megatron")
    n, mine = ref.num_params(), sum(p.numel() for p in part.parameters())
    largest = max(p.numel() for p in ref.parameters())
    return {"params": n, "per_rank": mine, "build_before_gb": 4 * (n + mine) / 1e9,
            "build_now_gb": 4 * (mine + largest) / 1e9, "train_gb": 16 * mine / 1e9,
            "train_sharded_gb": 16 * mine / dp / 1e9,
            "ckpt_before_gb": (16 * mine / dp + 12 * mine) / 1e9,
            "ckpt_now_gb": (16 * mine / dp + 4 * largest) / 1e9}


def draw_models(name, tp=4):
    """(the reference, rank 0's part at tp under BTP) of a cola shape, on the meta device."""
    import torch
    from tp_model import TPLlama
    import parallel
    from model import Llama
    from plumbing import options
    root = Path(__file__).resolve().parents[1]
    cfg, tc = options.parse_args([str(root / "configs" / f"{name}.toml"), "--arch=cola"])
    cfg.vocab_size = VOCAB
    torch.manual_seed(tc.seed)
    with torch.device("meta"):
        ref = Llama(cfg)
        return ref, TPLlama(ref, parallel.TPGroup(None, 0, tp), "btp")


def draw_times(name, tp=4):
    """Seconds one CPU core takes to draw a shape's initial values: the whole model, one full
    parameter at a time (what every rank drew before: the replay of the seeded reference), and
    rank 0's part at tp=4 under BTP (sharding.materialize now: only the tiles that meet it)."""
    import time
    import torch
    import sharding
    from model import init_part
    torch.set_num_threads(1)
    ref, part = draw_models(name, tp)
    t0 = time.time()
    for pname, p in ref.named_parameters():
        init_part(ref.init_rules[pname], ref.init_seed, pname, p.shape, (0, p.shape[0]),
                  (0, p[0].numel()))
    whole = time.time() - t0
    part.to_empty(device="cpu")
    t0 = time.time()
    sharding.materialize(part, ref)
    return {"params": ref.num_params(), "part": sum(p.numel() for p in part.parameters()),
            "whole_s": whole, "part_s": time.time() - t0}


CE_CODE = """
import sys, torch
sys.path.insert(0, {root!r})
import parallel

def rss(field):
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith(field)) * 1024

class Before(torch.autograd.Function):   # the cross-entropy as it was: four (N, V) fp32 at once
    @staticmethod
    def forward(ctx, logits, target):
        logits = logits.float()
        m = logits.max(dim=-1).values
        shifted = logits - m.unsqueeze(-1)
        rows = torch.arange(len(target))
        picked = shifted[rows, target]
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, target)
        return sum_exp.log() - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, target = ctx.saved_tensors
        g = softmax.clone()
        g[torch.arange(len(target)), target] -= 1
        return g * grad.unsqueeze(-1), None

logits = torch.randn(4096, 32000, requires_grad=True)
target = torch.randint(0, 32000, (4096,))
open("/proc/self/clear_refs", "w").write("5")
before = rss("VmRSS")
if {old!r}:
    loss = Before.apply(logits, target).mean()
else:
    loss = parallel.VocabParallelCrossEntropy.apply(logits, target, None).mean()
loss.backward()
print(rss("VmHWM") - before)
"""


def cross_entropy_peak(old):
    """Peak bytes above the logits of one forward and backward of the cross-entropy over 4096
    tokens x 32000 (fp32 logits: 524 MB), the old way or the chunked one, in a fresh process."""
    import subprocess
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", CE_CODE.format(root=root, old=old)],
                         capture_output=True, text=True, check=True, timeout=600).stdout
    return int(out.split()[-1])


def bench(rounds=2):
    """(markdown text, results) of both tables."""
    from bench_common import table
    measured = measure(rounds)
    rows = [[case, f"{r['whole']['s']:.1f}", f"{r['meta']['s']:.1f}",
             f"{r['whole']['peak_gb']:.2f}", f"{r['meta']['peak_gb']:.2f}"]
            for case, r in measured.items()]
    predicted = {f"{name} ({arch})": predict(name, arch) for name, arch in
                 (("boost_7b", "cola"), ("paper_13b", "cola"), ("paper_30b", "cola"),
                  ("paper_30b", "full"))}
    prows = [[name, f"{p['params'] / 1e9:.2f}B", f"{p['per_rank'] / 1e6:,.0f}M",
              f"{p['build_before_gb']:.1f} / {p['build_now_gb']:.1f}",
              f"{p['train_gb']:.1f} / {p['train_sharded_gb']:.1f}",
              f"{p['ckpt_before_gb']:.1f} / {p['ckpt_now_gb']:.1f}"]
             for name, p in predicted.items()]
    draws = {name: draw_times(name) for name in ("boost_1b", "boost_7b")}
    drows = [[f"{name} (cola)", f"{d['params'] / 1e9:.2f}B", f"{d['part'] / 1e6:,.0f}M",
              f"{d['whole_s']:.1f}", f"{d['part_s']:.1f}"] for name, d in draws.items()]
    ce = {way: statistics.median(cross_entropy_peak(way == "before") for _ in range(rounds)) / 1e9
          for way in ("before", "now")}
    text = ("boost_1b (32,000-token vocabulary), rank 0's build, medians of "
            f"{rounds} interleaved rounds\n\n" +
            table(["layout", "s, whole then cut", "s, meta build", "peak GB, whole then cut",
                   "peak GB, meta build"], rows) +
            "\n\nPredicted from the meta model: one rank at tp=4 (fp32; training: weights, "
            "gradients, AdamW's moments; dp_shard: full over 2 dp ranks)\n\n" +
            table(["shape", "parameters", "per rank", "build GB before / now",
                   "training GB / with dp_shard", "dp_shard checkpoint GB before / now"], prows) +
            "\n\nDrawing the initial values on one CPU core: the whole model (every rank "
            "before) against rank 0's part at tp=4 (BTP; keyed tiles, model.init_part)\n\n" +
            table(["shape", "parameters", "rank 0's part", "s, whole", "s, the part alone"],
                  drows) +
            "\n\nThe vocabulary-parallel cross-entropy, one process, 4096 tokens x 32000 (fp32 "
            f"logits 0.52 GB): peak above the logits in forward and backward, {ce['before']:.2f} "
            f"GB before, {ce['now']:.2f} GB now (the gradient itself is 0.52 GB)")
    return text, {"measured": measured, "predicted": predicted, "cross_entropy_gb": ce,
                  "draws": draws}
