"""muon.py: Muon for the low-rank factors, sharded as BTP shards them: orthogonalised updates for an
r×r price.

Not in the BOOST paper (arXiv 2512.12131); BOOST's layouts make it cheap. Muon (Jordan et al.,
github.com/KellerJordan/Muon; torch.optim.Muon is the same update) replaces a matrix's update by
its nearest semi-orthogonal matrix: Nesterov momentum, then five steps of a quintic Newton-Schulz
iteration on the update X (m, n), rows ≤ columns (else on Xᵀ):

    X ← X / ‖X‖_F;   five times:  G = X·Xᵀ,  X ← a·X + (b·G + c·G²)·X     (a, b, c) = (3.4445,
    -4.7750, 2.0315);   W ← W·(1 − lr·wd) − lr·√max(1, m/n)·X

It is for the 2-D weights of the decoder layers (every A and B factor, and the dense projections of
arch=full); embeddings, the head, norm gains and LaX's gates stay with AdamW, as Muon's authors do.

Under tensor parallelism each weight is a piece of a layout's local parameter (sharding.Spec), cut
along one dimension over the t ranks. When the cut runs along X's long side (BTP: A (r, d) along d,
B (d, r) along d) the Newton-Schulz steps need only the r×r Gram matrix G = Σ_ranks X_i·X_iᵀ: one
all-reduce of r² elements a step, for every such piece at once, and each rank updates its own
columns (the work split t ways). Otherwise (vanilla cuts the latent r, Megatron its rows or
columns) the piece's update is gathered whole once, orthogonalised on every rank, and its slice
kept. `gram` is chosen where its bytes, 5 all-reduces of r² (2(t−1)/t·r² each), are below the
gather's (t−1)/t·r·d, or with `prefer="gram"`; both equal one device's Muon (tests/test_muon.py),
and their collectives go to the ledger with the phase "optim" (per_layer_traffic: their elements
in layouts.py's terms). Under --dp_shard (FSDP2 holds each TP-local matrix cut along its rows over
dp) the momentum runs on each rank's rows, the update is all-gathered over dp first (dp_gathered)
and each rank applies its own rows. The Newton-Schulz arithmetic runs in bf16 on a GPU and fp32 on
a CPU.
"""
import math
import re

import torch

import dp_shard
from parallel import all_gather_last, all_reduce

NS = (3.4445, -4.7750, 2.0315)
STEPS = 5
EPS = 1e-7
# the decoder weights Muon takes (full-model names): a bottleneck's factors, or a dense projection
MATRIX = re.compile(r"layers\.\d+\.(attn|mlp)\.(q|k|v|o|gate|up|down)\.(A\.|B\.)?weight$")


def newton_schulz(X, dtype=torch.float32, steps=STEPS):
    """The orthogonalised X (m, n) of one device: torch.optim.Muon's iteration in `dtype`."""
    a, b, c = NS
    Y = X.to(dtype)
    Y = Y.t() if X.shape[0] > X.shape[1] else Y                     # (small, large)
    Y = Y / Y.norm().clamp(min=EPS)
    for _ in range(steps):
        G = Y @ Y.t()                                               # (small, small)
        Y = a * Y + (b * G + c * G @ G) @ Y
    return (Y.t() if X.shape[0] > X.shape[1] else Y).to(X.dtype)


def newton_schulz_gram(blocks, group, dtype=torch.float32, steps=STEPS):
    """newton_schulz of several matrices each cut along its long side over `group`: blocks are this
    rank's X_i (small, large/t), already oriented; the Frobenius norms and the Gram matrices summed
    over the ranks, one all-reduce for all the blocks at each step. Returns the orthogonalised
    blocks."""
    a, b, c = NS
    Ys = [x.to(dtype) for x in blocks]
    sq = all_reduce(torch.stack([(y.float() ** 2).sum() for y in Ys]), group, "optim")  # (n,)
    Ys = [y / sq[i].sqrt().clamp(min=EPS).to(dtype) for i, y in enumerate(Ys)]
    for _ in range(steps):
        grams = [y @ y.t() for y in Ys]                             # [(small, small)]
        flat = all_reduce(torch.cat([g.reshape(-1) for g in grams]), group, "optim")
        Gs = flat.split([g.numel() for g in grams])
        Ys = [a * y + (b * G.view_as(g) + c * G.view_as(g) @ G.view_as(g)) @ y
              for y, G, g in zip(Ys, Gs, grams)]
    return Ys


class Piece:
    """One full weight inside a local parameter: its rows [start, start + rows) of the local tensor,
    the dimension `dim` its full tensor is cut along over t ranks (None: whole here), and how its
    update is orthogonalised: "whole", "gram" or "gather"."""

    def __init__(self, start, rows, local_shape, dim, t, prefer=None):
        self.start, self.rows, self.dim, self.t = start, rows, dim, t
        full = [rows, local_shape[1]]
        if dim is not None:
            full[dim] *= t
        self.full = tuple(full)                                     # (m, n) of the whole weight
        m, n = self.full
        if dim is None or t == 1:
            self.mode = "whole"
        else:
            long_side = 1 if m <= n else 0
            gram_bytes = STEPS * 2 * min(m, n) ** 2                 # all-reduces, ring: 2(t-1)/t
            gather_bytes = m * n                                    # one gather: (t-1)/t · m·n
            fits = dim == long_side
            self.mode = "gram" if fits and (prefer == "gram" or
                                            (prefer != "gather" and gram_bytes < gather_bytes)) \
                else "gather"

    def block(self, t):
        return t[self.start:self.start + self.rows]                 # this rank's part, a view

    @property
    def lr_scale(self):
        """torch.optim.Muon's "original" scale, of the whole weight: √max(1, m/n)."""
        return math.sqrt(max(1.0, self.full[0] / self.full[1]))


def pieces_of(spec, local_shape, t, prefer=None):
    """The Pieces of a local parameter laid out by sharding.Spec `spec`."""
    out, start = [], 0
    for rows in spec.rows:
        out.append(Piece(start, rows, local_shape, spec.dim, t, prefer))
        start += rows
    return out


class MuonAdamW(torch.optim.AdamW):
    """AdamW (torch's, fused where the device has it: it skips its update where `found_inf` is 1)
    for the groups without "muon", and Muon for the groups with it: each such group also holds
    "pieces" ({param: [Piece]}), "tp" (the TP group, None for one device), "momentum" and
    "ns_dtype". A Muon parameter's state is its "momentum_buffer" (and "step", as AdamW's)."""

    def step(self, closure=None):
        everything = self.param_groups
        self.param_groups = [g for g in everything if not g.get("muon")]
        try:
            super().step(closure)
        finally:
            self.param_groups = everything
        for group in everything:
            if group.get("muon"):
                self.muon_step(group)

    @torch.no_grad()
    def muon_step(self, group):
        """Nesterov momentum, the orthogonalised update of every piece, then decay and the step;
        nothing moves where found_inf is 1 (a non-finite gradient, train.py's flag)."""
        found = getattr(self, "found_inf", None)
        keep = 1.0 if found is None else (found == 0).to(torch.float32)   # (0: skip this step)
        work, grams, gathers = [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            update = self.nesterov(p, group["momentum"], found, keep)   # (TP-local, dp gathered)
            for piece in group["pieces"][p]:
                x = piece.block(update)
                if piece.mode == "gram":   # oriented (small, large): the cut runs along columns
                    grams.append((p, piece, x.t() if piece.dim == 0 else x))
                else:
                    gathers.append((p, piece, x))
            work.append(p)
        out = {}
        for p, piece, x in gathers:
            full = x if piece.mode == "whole" else self.gathered(x, piece.dim, group["tp"])
            ortho = newton_schulz(full.float(), group["ns_dtype"])
            if piece.mode == "gather":
                ortho = ortho.chunk(piece.t, piece.dim)[group["tp"].tp_rank]
            out[(p, piece.start)] = ortho
        if grams:
            ys = newton_schulz_gram([x for *_, x in grams], group["tp"].group, group["ns_dtype"])
            for (p, piece, _), y in zip(grams, ys):
                out[(p, piece.start)] = y.t() if piece.dim == 0 else y
        self.apply(group, work, out, keep)

    def nesterov(self, p, momentum, found, keep):
        """The momentum step of p's buffer and p's Nesterov update, whole on this TP rank: under
        --dp_shard on this dp rank's rows, then the update gathered over dp (see dp_gathered)."""
        st = self.state[p]
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = torch.zeros_like(p)             # (a dp shard, as p is)
            st["step"] = torch.zeros((), device=p.device)
        grad, buf = dp_shard.local(p.grad), dp_shard.local(st["momentum_buffer"])
        g = grad if found is None else torch.where(found > 0, 0.0, grad)   # (no NaN in)
        buf.lerp_(g, (1 - momentum) * keep)                         # (unchanged when skipped)
        st["step"] += 1
        update = g.lerp(buf, momentum)                              # (Nesterov)
        return dp_gathered(p, update) if dp_shard.is_sharded(p) else update

    @staticmethod
    def gathered(x, dim, tp):
        """The whole piece from every rank's block, cut along `dim`."""
        if dim == 0:
            return all_gather_last(x.t(), tp.group, "optim").t()
        return all_gather_last(x, tp.group, "optim")

    @staticmethod
    def apply(group, params, out, keep):
        lr, wd = group["lr"], group["weight_decay"]
        for p in params:
            dp_shard.local(p).mul_(1 - lr * wd * keep)              # (under --dp_shard: its rows)
            for piece in group["pieces"][p]:
                got = dp_shard.held(p, slice(piece.start, piece.start + piece.rows))
                if got is not None:                                 # (this dp rank's rows of it)
                    view, part = got
                    step = out[(p, piece.start)][part].to(p.dtype)
                    view.sub_(step * (lr * piece.lr_scale * keep))


def dp_gathered(p, rows):
    """Under --dp_shard: the whole TP-local update of p from each dp rank's `rows` (FSDP2 cuts dim 0
    as torch.chunk does, ceil(m/dp) rows a rank: padded to that, gathered, cut back). Gathered
    rather than orthogonalised shard-wise: a dp shard holds rows of the TP-local tensor, which for
    an A (r, d/t) cut the short side r (X·Xᵀ needs whole rows) and for a stacked qkv cut across
    pieces; its bytes are one all-gather of the matrices, as FSDP2's own before a forward."""
    m, mesh = p.shape[0], p.device_mesh
    size = dp_shard.chunk_rows(m, mesh.size())
    padded = rows.new_zeros((size, *rows.shape[1:]))                # (ceil(m/dp), n)
    padded[:len(rows)] = rows
    return all_gather_last(padded.t(), mesh.get_group(), "optim").t()[:m]   # (m, n)


def configure(model, tc, prefer=None):
    """train.py's optimizer for `model` (a layouts.TPLlama, or model.Llama on one device): AdamW
    (tc.optimizer="adamw"): weight decay on 2-D weights only, not on norm gains; fused, so a step
    with found_inf = 1 changes nothing. "muon": the decoder's matrices (MATRIX) go to Muon at
    tc.muon_lr with tc.muon_momentum, the rest to that AdamW."""
    params = [p for p in model.parameters() if p.requires_grad]
    matrices = set(map(id, muon_params(model))) if tc.optimizer == "muon" else set()
    adam = [p for p in params if id(p) not in matrices]
    groups = [{"params": [p for p in adam if p.dim() >= 2], "weight_decay": tc.weight_decay},
              {"params": [p for p in adam if p.dim() < 2], "weight_decay": 0.0}]
    if matrices:
        tp = getattr(model, "tp", None)
        specs = dict(model.named_specs()) if hasattr(model, "named_specs") else {}
        names = {id(p): n for n, p in model.named_parameters()}
        mats = [p for p in params if id(p) in matrices]
        pieces = {p: (pieces_of(specs[names[id(p)]], p.shape, tp.size, prefer) if specs
                      else [Piece(0, p.shape[0], p.shape, None, 1)]) for p in mats}
        cuda = mats[0].is_cuda
        groups.append({"params": mats, "muon": True, "pieces": pieces, "tp": tp,
                       "momentum": tc.muon_momentum, "weight_decay": tc.weight_decay,
                       "lr_ratio": tc.muon_lr / tc.learning_rate,
                       "ns_dtype": torch.bfloat16 if cuda else torch.float32})
    # fused: one kernel a step, which skips its update on the device where found_inf is 1
    cls = MuonAdamW if matrices else torch.optim.AdamW
    return cls(groups, lr=tc.learning_rate, betas=(tc.beta1, tc.beta2), fused=True)


def muon_params(model):
    """The parameters Muon takes: those whose full-model pieces are decoder matrices (a layout's
    local parameter holds pieces of one kind; model.Llama's names are the full names)."""
    if hasattr(model, "named_specs"):
        local = dict(model.named_parameters())
        return [local[n] for n, spec in model.named_specs() if MATRIX.search(spec.pieces[0])]
    return [p for n, p in model.named_parameters() if MATRIX.search(n)]


def per_layer_traffic(layout, cfg, t, prefer=None):
    """The elements Muon's TP collectives carry for one decoder layer in one step, written in the
    terms of layouts.per_layer_traffic (d, kv, f, r_a, r_m; t) and tested equal to the ledger:
    each projection (out, in) of rank ρ is A (ρ, in) and B (out, ρ) (arch=full: W (out, in)),
    cut by BTP along in and out (X's long side), by vanilla along ρ, by Megatron along out (q, k,
    v, gate, up: column-parallel) or in (o, down); a piece costs 5·min(m, n)² + 1 by the Gram path
    or m·n gathered (Piece chooses)."""
    if t == 1:
        return 0
    d, f, kv, ra, rm = cfg.n_embd, cfg.mlp_width, cfg.kv_dim, cfg.attn_rank, cfg.mlp_rank
    total = 0
    for out, inp, rho, col in [(d, d, ra, True), (kv, d, ra, True), (kv, d, ra, True),
                               (d, d, ra, False), (f, d, rm, True), (f, d, rm, True),
                               (d, f, rm, False)]:                  # q, k, v, o, gate, up, down
        mats = {"megatron": [(out, inp, 0 if col else 1)],
                "btp": [(rho, inp, 1), (out, rho, 0)],
                "vanilla": [(rho, inp, 0), (out, rho, 1)]}[layout]
        for m, n, dim in mats:
            piece = Piece(0, m // t if dim == 0 else m, (0, n // t if dim == 1 else n), dim, t,
                          prefer)
            total += 5 * min(m, n) ** 2 + 1 if piece.mode == "gram" else m * n
    return total


def traffic(optimizer, group="tp"):
    """The elements Muon's collectives over `group` carry in one step (the ledger's phase "optim"
    counts the results). "tp": per Gram piece its r×r matrix at each of the 5 steps, and one norm;
    per gathered piece the whole matrix (m·n). "dp" (--dp_shard): every matrix's TP-local update,
    its m rows padded to a multiple of dp."""
    total = 0
    for g in optimizer.param_groups:
        if not g.get("muon"):
            continue
        if group == "dp":
            total += sum(dp_shard.chunk_rows(p.shape[0], dp) * dp * math.prod(p.shape[1:])
                         for p in g["params"] if dp_shard.is_sharded(p)
                         for dp in [p.device_mesh.size()])
            continue
        pieces = [pc for p in g["params"] for pc in g["pieces"][p]]
        grams = [pc for pc in pieces if pc.mode == "gram"]
        total += (len(grams) + STEPS * sum(min(pc.full) ** 2 for pc in grams)) if grams else 0
        total += sum(pc.full[0] * pc.full[1] for pc in pieces if pc.mode == "gather")
    return total
