"""explain.py: `train.py --explain=true`: what every rank computes, sends and keeps in one real
step.

For teaching BOOST (arXiv 2512.12131) §2-6: run exactly as training is launched (under torchrun for
TP, PP or DP), with any model and layout options; one forward and backward of a tiny batch is run
and recorded, printed, and the program exits: no training, no checkpoint, no out_dir.

Everything printed is recorded from the run, never written from the formulas:
  - a TorchDispatchMode sees every GEMM, attention, embedding and norm op with this rank's local
    shapes; whether it runs in forward, backward or a recompute comes from the autograd engine
    (`torch._C._current_autograd_node`, grad mode), its layer from the last parameter it touched;
  - parallel.LEDGER's listener sees every collective, in order, with its group and size (under
    --dp_shard FSDP2's all-gathers and reduce-scatters too: dp_shard.py records them);
  - checkpointing.SavedBytes's pack hook sees what autograd keeps for backward;
  - torch.utils.flop_counter's formulas count the FLOPs of those ops.
Shapes are printed in the notation of layouts.py (b·s tokens, d, d/t, r, 3r+1, f/t, V/t, ...;
notation.py names them). The comparison at the end runs the other layouts of the same width on the
same TP group, a one-layer and a two-layer model each, so their difference is one layer's.
"""
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

import checkpointing
import dp_shard
import kernels
from parallel import LEDGER
from plumbing import placement
from plumbing.notation import Names

ATTENTION = "scaled_dot_product"
GEMMS = ("aten.mm.", "aten.bmm.", "aten.addmm.")
PREFER = {"btp": ("3r+1", "2r+1", "2r_m+1", "3r", "2r", "2r_m", "r", "r_m", "d"),
          "megatron": ("d",),
          "vanilla": ("d", "kv", "f")}   # the symbols of each layout's collectives
# what each collective carries, by layout, phase and width per token (the numbers are recorded)
CARRIES = {("btp", "fwd", "3r+1"): "q, k, v latents + the norm statistic (online RMSNorm)",
           ("btp", "fwd", "2r+1"): "gate, up latents + the norm statistic",
           ("btp", "fwd", "r"): "a partial latent",
           ("btp", "bwd", "3r"): "gradient of the q, k, v latents",
           ("btp", "bwd", "2r"): "gradient of the gate, up latents",
           ("btp", "bwd", "r"): "gradient of a latent",
           ("btp", "fwd", "d"): "the residual stream, gathered for the head",
           ("megatron", "fwd", "d"): "partial sums of o or down (row-parallel)",
           ("megatron", "bwd", "d"): "gradient of the normed input (column-parallel)",
           ("vanilla", "fwd", "d"): "partial sums of a row-parallel B",
           ("vanilla", "bwd", "d"): "gradient of an A's input",
           ("vanilla", "fwd", "kv"): "partial sums of B_k or B_v",
           ("vanilla", "fwd", "f"): "partial sums of B_gate or B_up",
           ("vanilla", "bwd", "f"): "gradient of A_down's input",
           ("btp", "bwd", "d"): "gradient of the head's input",
           **{("vanilla", "bwd", w): "gradient of latents gathered for LaX's crossing"
              for w in ("r", "2r", "3r")},
           **{(lay, "fwd", "1"): "cross-entropy over the vocabulary shards: max, target logit, Σexp"
              for lay in ("btp", "megatron", "vanilla")}}
GATHERS = {"btp": "the residual stream, gathered for the head",   # (TP's all-gathers, by layout)
           "vanilla": "a projection's latent, gathered from its r/t slices for the next layer's "
                      "crossing (LaX)"}
FSDP = {"all_gather": "a unit's parameters for the next ops, gathered over dp (FSDP2)",
        "reduce_scatter": "its gradients, summed and cut over dp (FSDP2)"}


class Recorder(TorchDispatchMode):
    """The events of one step, in order: (phase, section, kind, text)."""

    def __init__(self, model, names, layout):
        super().__init__()
        self.names, self.layout, self.events, self.pending = names, layout, [], []
        self.section = "embedding"
        specs = dict(model.named_specs())   # (a layouts.TPLlama: every run trains one)
        self.model, self.labels, self.grads, self.flops = model, {}, {}, 0
        first = int(model.layers[0].label.split()[-1])   # (a pipeline stage's first layer)
        for full_name, p in model.named_parameters():
            parts = full_name.split(".")
            section = f"layer {int(parts[1]) + first}" if parts[0] == "layers" else \
                ("embedding" if parts[0] == "tok_emb" else "head")
            short = ".".join(parts[2:] if parts[0] == "layers" else parts).removesuffix(".weight")
            symbols = names.local(specs[full_name], model.cfg)
            self.labels[full_name] = (section, short, symbols, tuple(p.shape), p.stride())
            # a weight gradient's shape -> symbols
            self.grads.setdefault(tuple(p.shape), set()).add(symbols)
        self.sharded = getattr(model, "dp_shard", "none") != "none"
        self.index()

    def index(self):
        """{storage: label} of the parameters where they are now. Under --dp_shard FSDP2 puts a
        unit's gathered parameters in place of its shards while it is gathered, in new memory each
        time (often the memory the unit before it freed), so `param` reads them again at every
        op."""
        self.params = {p.untyped_storage().data_ptr(): self.labels[n]
                       for n, p in self.model.named_parameters()
                       if not dp_shard.is_sharded(p)}

    @staticmethod
    def phase():
        if torch._C._current_autograd_node() is None:
            return "fwd"
        return "recompute" if torch.is_grad_enabled() else "bwd"

    def param(self, t):
        if not isinstance(t, torch.Tensor) or dp_shard.is_sharded(t):
            return None
        if self.sharded:
            self.index()
        return self.params.get(t.untyped_storage().data_ptr())

    def symbols(self, t):
        """(label, symbolic shape) of a parameter operand as it is used (transposed: Wᵀ); else
        None."""
        p = self.param(t)
        if p and tuple(t.shape) == p[3] and t.stride() == p[4]:
            return p[1], p[2]
        if p and t.dim() == 2 and tuple(t.shape) == p[3][::-1] and t.stride() == p[4][::-1]:
            return p[1] + "ᵀ", p[2][::-1]
        return None

    def gemm(self, a, b, out):
        """`x (b·s, d/t) @ A_qkvᵀ (d/t, 3r) -> (b·s, 3r)`: a parameter operand names its dimensions,
        and the other operand's and the output's that it shares."""
        size = self.names.size
        if a.dim() != 2 or b.dim() != 2:
            shape = self.names.shape
            return f"{shape(a.shape)} @ {shape(b.shape)} -> {shape(out.shape)}"
        pa, pb = self.symbols(a), self.symbols(b)
        grad = self.grads.get(tuple(out.shape), ())
        if not (pa or pb) and len(grad) == 1:  # a weight gradient, dyᵀ·x: its weight's symbols
            (m, n), = grad
            return (f"({m}, {size(a.shape[1])}) @ ({size(b.shape[0])}, {n}) -> weight gradient "
                    f"({m}, {n})")
        sa = pa[1] if pa else (size(a.shape[0]), pb[1][0] if pb else size(a.shape[1]))
        sb = pb[1] if pb else (sa[1], size(b.shape[1]))
        label = lambda p: p[0] + " " if p else ""
        return f"{label(pa)}({', '.join(sa)}) @ {label(pb)}({', '.join(sb)}) -> ({sa[0]}, {sb[1]})"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if func._overloadpacket in flop_registry:
            self.flops += flop_registry[func._overloadpacket](*args, **(kwargs or {}), out_val=out)
        touched = self.touched = [self.param(a) for a in args if self.param(a)]
        if touched:  # ops between two parameters' belong to the layer of the next one (see add)
            self.section = touched[0][0]
            for event in self.pending:
                event[1] = self.section
            self.pending = []
        shape = self.names.shape
        if name.startswith(GEMMS):
            self.add("GEMM", self.gemm(args[-2], args[-1], out))
        elif ATTENTION in name:
            positions = lambda t: "(" + ", ".join(self.names.size(n, prefer) for n, prefer in
                                                  zip(t.shape,
                                                      [("b",), ("heads/t", "kv_heads/t", "heads"),
                                                       ("s",), ("hd",)])) + ")"
            self.add("attention", f"q {positions(args[0])}, k and v {positions(args[1])}"
                     + (" (backward)" if "backward" in name else ""))
        elif name.startswith("aten.embedding."):
            label, sym = self.symbols(args[0]) or ("", ())
            self.add("embedding", f"{label} ({', '.join(sym)}) rows of {shape(args[1].shape)} -> "
                     f"{shape(out.shape, ('b', 's') + sym[1:])}")
        elif name.startswith("aten.rsqrt.") and self.phase() != "bwd":
            self.add("norm", f"1/rms {shape(out.shape, ('b', 's'))}")
        elif name.startswith("aten.pow.Tensor_Scalar") and args[1] == 2 and self.phase() != "bwd":
            self.add("norm", f"x² {shape(args[0].shape, ('b', 's', 'd', 'd/t'))}")
        return out

    def add(self, kind, text):
        """An event; when its op touched no parameter, its section is that of the next op that
        does."""
        self.events.append([self.phase(), self.section, kind, text])
        if not self.touched:
            self.pending.append(self.events[-1])

    def collective(self, op, group, phase, tensor, tokens):
        fsdp = op in FSDP and group == "dp"   # (FSDP2's collectives run over dp, TP's over tp)
        per_token = tensor.numel() % tokens == 0 and phase != "grad" and not fsdp
        gather = op == "all_gather" and not fsdp
        prefer = ("d/t", "d") if op == "send" else PREFER["btp" if gather else self.layout] \
            if self.layout in PREFER else ()
        width = self.names.size(tensor.numel() // tokens, prefer) if per_token else "-"
        carries = "the residual stream to the next stage" if op == "send" and phase == "fwd" else \
            "its gradient back to the previous stage" if op == "send" else FSDP[op] if fsdp else \
            GATHERS.get(self.layout, "") if gather else \
            next((CARRIES[(self.layout, phase, w)] for w in width.split("=")
                  if (self.layout, phase, w) in CARRIES), "")
        text = (f"{group}: " + (f"{width} per token = " if per_token else "")
                + f"{tensor.numel():,} elements"
                + (f"  [{carries}]" if carries else ""))
        if self.phase() == "recompute" and phase == "fwd":
            phase = "recompute"
        # a collective belongs to the op before it (the partial sums it reduces), BTP's gather of
        # the residual stream to the head after it
        self.events.append([phase, "stage boundary" if op == "send" else self.section, op, text])
        if op == "all_gather":
            self.pending.append(self.events[-1])


def run_step(model, x, y, pipe=None, ddp=None):
    """One forward and backward as training runs it; the loss."""
    if pipe is not None:
        return pipe.run(x, y).item()
    loss = (ddp or model)(x, y)[1]
    loss.backward()
    return loss.item()


def record(model, x, y, names, layout, pipe=None, ddp=None):
    """Run one step under the recorder; (events, ledger counts, saved bytes by section, FLOPs)."""
    recorder = Recorder(model, names, layout)
    tokens = x.numel() // (pipe.n_micro if pipe else 1)
    LEDGER.reset()
    LEDGER.listener = lambda op, group, phase, t: recorder.collective(op, group, phase, t, tokens)
    saved = SectionBytes(model, recorder)
    try:
        # (the fused kernels compute what the references do)
        with saved, recorder, kernels.reference():
            run_step(model, x, y, pipe, ddp)
    finally:
        LEDGER.listener = None
    model.zero_grad(set_to_none=True)
    return recorder.events, dict(LEDGER.counts), saved, recorder.flops


class SectionBytes(checkpointing.SavedBytes):
    """The meter of the tests, also noting the layer each saved tensor belongs to."""

    def __init__(self, module, recorder):
        super().__init__(module)
        self.recorder, self.by_section = recorder, {}

    def pack(self, t):
        # a parameter (under --dp_shard, as FSDP2 gathered it)
        if self.recorder.param(t) is not None:
            return t
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params and storage.data_ptr() not in self.storages:
            section = self.recorder.section
            self.by_section.setdefault(section, []).append((tuple(t.shape), storage.nbytes()))
        return super().pack(t)


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
        lines += [f"    {line}" for line in body]
    for (phase, _), (same, _) in first_layer.items():
        if len(same) > 1:
            lines.append(f"  {phase} · layers {same[0]}..{same[-1]}: the same ops, shapes and "
                         f"collectives each")
    return lines


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
            shapes = ", ".join(sorted({names.shape(s) for s, _ in items}))
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
    import layouts
    from model import Config, Llama
    rows = []
    for n_layer in (1, 2):
        c = Config(**{**cfg.shape(), "arch": arch, "n_layer": n_layer,
                      "lax": cfg.lax and arch != "full",
                      "mlp_gate": cfg.mlp_gate if arch == cfg.arch else "auto"})
        torch.manual_seed(0)
        model = layouts.TPLlama(Llama(c), tp, layout, recompute=recompute)
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
    """The three layouts of the paper at this width, one layer each, side by side."""
    low = cfg.arch if cfg.lowrank else "cola"
    cases = [("megatron", "full"), ("vanilla", low), ("btp", low)]
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
    model = placement.build_model(plan, place)[0]
    cfg, tc, layout = plan.cfg, plan.tc, plan.layout
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
    wrapped, pipe = placement.wrap(model, replace(tc, pp_schedule="gpipe", compile=False), place, 1)
    ddp = wrapped if wrapped is not model else None
    if pipe:   # its first run infers the shapes between stages with an extra forward: not recorded
        pipe.run(x, x)
        model.zero_grad(set_to_none=True)
    events, counts, saved, flops = record(model, x, x, names, layout if tc.tp > 1 else "one device",
                                          pipe, ddp)
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
                                            if kernels.backend() != "torch" else ""))
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
