"""recorder.py: one training step recorded op by op, for `train.py --explain=true` (explain.py
prints it).

BOOST (arXiv 2512.12131) §2-6, as the run computes them; nothing here is written from formulas:
  - a TorchDispatchMode (Recorder) sees every GEMM, attention, embedding and norm op with this
    rank's local shapes; whether it runs in forward, backward or a recompute comes from the
    autograd engine (`torch._C._current_autograd_node`, grad mode), its layer from the last
    parameter it touched;
  - parallel.LEDGER's listener sees every collective, in order, with its group and size (under
    --dp_shard FSDP2's all-gathers and reduce-scatters too: dp_shard.py records them; with
    --optimizer=muon the optimizer step's, phase "optim": extensions/muon.py);
  - SavedBytes's pack hook (below; the recompute tests measure with it too) sees what autograd
    keeps for backward;
  - torch.utils.flop_counter's formulas count the FLOPs of those ops.
Shapes are named in the notation of layouts.py (notation.py).
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from extensions import dp_shard
import local_ops
from layouts import LAYOUTS
from parallel import LEDGER

ATTENTION = "scaled_dot_product"
GEMMS = ("aten.mm.", "aten.bmm.", "aten.addmm.")
# what each layout's collectives carry, by phase and width per token: its record in layouts.py
# (symbols, carries, gathers); the cross-entropy's are every layout's
CROSS_ENTROPY = "cross-entropy over the vocabulary shards: max, target logit, Σexp"
GATHERED = ("3r", "2r", "2r_m", "r", "r_m", "d")   # the widths a TP all-gather may carry
FSDP = {"all_gather": "a unit's parameters for the next ops, gathered over dp (FSDP2)",
        "reduce_scatter": "its gradients, summed and cut over dp (FSDP2)"}
# --optimizer=muon's collectives (extensions/muon.py), by op and group
OPTIM = {("all_reduce", "tp"): "Muon: the first the updates' squared norms, then one a Newton-"
                               "Schulz step: the r×r Gram matrices X·Xᵀ, summed over tp",
         ("all_gather", "tp"): "Muon: a matrix's update, gathered whole to orthogonalise",
         ("all_gather", "dp"): "Muon: a matrix's update, its rows gathered over dp (--dp_shard)",
         ("all_to_all", "tp"): "Muon (owner): the first each rank's block of a matrix to its "
                               "owner, the second each slice of the result back"}


class Recorder(TorchDispatchMode):
    """The events of one step, in order: (phase, section, kind, text)."""

    def __init__(self, model, names, layout):
        super().__init__()
        self.names, self.layout, self.events, self.pending = names, layout, [], []
        self.section, self.last = "embedding", ""   # (last: the latest op's name)
        specs = dict(model.named_specs())   # (a tp_model.TPLlama: every run trains one)
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
        name = self.last = str(func)
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
            q, k = args[1:3] if "backward" in name else args[:2]   # (backward: dy, q, k, v, ...)
            positions = self.names.attention
            self.add("attention", f"q {positions(q.shape)}, k and v {positions(k.shape)}"
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
        optim = phase == "optim"
        fsdp = op in FSDP and group == "dp" and not optim   # (FSDP2's run over dp, TP's over tp)
        per_token = tensor.numel() % tokens == 0 and phase not in ("grad", "optim") and not fsdp
        gather = op == "all_gather" and not fsdp
        lay = LAYOUTS.get(self.layout)   # (None on one device: no TP collective to name)
        prefer = ("d/t", "d") if op == "send" else GATHERED if gather else \
            lay.symbols if lay else ()
        width = self.names.size(tensor.numel() // tokens, prefer) if per_token else "-"
        carries = "the residual stream to the next stage" if op == "send" and phase == "fwd" else \
            "its gradient back to the previous stage" if op == "send" else FSDP[op] if fsdp else \
            OPTIM.get((op, group), "") if optim else \
            (lay.gathers if lay else "") if gather else \
            CROSS_ENTROPY if (phase, width) == ("fwd", "1") and lay else \
            next((lay.carries[(phase, w)] for w in width.split("=")
                  if lay and (phase, w) in lay.carries), "")
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


def record(model, x, y, names, layout, pipe=None, ddp=None, optimizer=None):
    """Run one step under the recorder; (events, ledger counts, saved bytes by section, FLOPs).
    With `optimizer` (Muon's, whose step sends collectives) its step too: its collectives only,
    in the section "optimizer step" (its Newton-Schulz GEMMs are not the model's ops)."""
    recorder = Recorder(model, names, layout)
    tokens = x.numel() // (pipe.n_micro if pipe else 1)
    LEDGER.reset()
    LEDGER.listener = lambda op, group, phase, t: recorder.collective(op, group, phase, t, tokens)
    saved = SectionBytes(model, recorder)
    try:
        # (the fused kernels compute what the references do)
        with saved, recorder, local_ops.reference():
            run_step(model, x, y, pipe, ddp)
        if optimizer is not None:
            recorder.section = "optimizer step"
            optimizer.step()
    finally:
        LEDGER.listener = None
    model.zero_grad(set_to_none=True)
    return recorder.events, dict(LEDGER.counts), saved, recorder.flops


class SavedBytes:
    """Bytes an autograd graph saves for backward, parameters excluded, each storage counted once.

        with SavedBytes(model) as meter:
            loss = model(x, y)[1]
        meter.bytes"""

    def __init__(self, module):
        self.params = {dp_shard.local(p).untyped_storage().data_ptr() for p in module.parameters()}
        self.storages = {}

    def pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def bytes(self):
        return sum(self.storages.values())


class SectionBytes(SavedBytes):
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
            section, kind = self.recorder.section, self.recorder.last
            self.by_section.setdefault(section, []).append(
                # (attention's own, and every 4-d activation: (b, heads, s, hd) is the only one)
                (tuple(t.shape), storage.nbytes(), ATTENTION in kind or t.dim() == 4))
        return super().pack(t)
