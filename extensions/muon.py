"""muon.py: Muon for the low-rank factors, sharded as BTP shards them, its collectives in buckets.

Not in the BOOST paper (arXiv 2512.12131); BOOST's layouts make it cheap. Muon (Jordan et al.,
github.com/KellerJordan/Muon; torch.optim.Muon is the same update) replaces a matrix's update by
its nearest semi-orthogonal matrix: Nesterov momentum, then five steps of a quintic Newton-Schulz
iteration on the update X (m, n), rows ≤ columns (else on Xᵀ):

    X ← X / ‖X‖_F;   five times:  G = X·Xᵀ,  X ← a·X + (b·G + c·G²)·X     (a, b, c) = (3.4445,
    -4.7750, 2.0315);   W ← W·(1 − lr·wd) − lr·√max(1, m/n)·X

It is for the 2-D weights of the decoder layers (every A and B factor, and the dense projections of
arch=full); embeddings, the head, norm gains and LaX's gates stay with AdamW, as Muon's authors do.

Under tensor parallelism each weight is a piece of a layout's local parameter (sharding.Spec), cut
along one dimension over the t ranks. Three paths give one device's update. Gram: where the cut runs
along X's long side (BTP: A (r, d) and B (d, r) along d) the Newton-Schulz steps need only the r×r
Gram matrix G = Σ_ranks X_i·X_iᵀ, and each rank updates its own columns (the work split t ways).
Gather: the piece's update is gathered whole, orthogonalised on every rank, and its slice kept (the
only way where vanilla cuts the latent r, Megatron its rows or columns). Owner
(`buckets.owner_computes`): each matrix is made whole on one owner rank of the TP group and
orthogonalised there, in two all-to-alls a step: 2/t of the gather's bytes and 1/t of its work a
rank. The collectives come in buckets, not one a matrix: one all-gather of every gathered piece a
step, one all-reduce of every Gram piece's r×r matrix at each of the 5 steps (and one of the
norms), two all-to-alls for the owned ones: at most 1 + 6 over TP a step however many layers
(`collectives`). By default (`--muon_mode=auto`) `choose_mode` takes the path of least modelled
cost: α a collective, bytes over bandwidth, Newton-Schulz FLOPs at the device's rate (`step_cost`).
Same-shaped matrices take their Newton-Schulz steps as one bmm chain. Every path equals one
device's Muon (tests/test_muon.py); their collectives go to the ledger with the phase "optim"
(per_layer_traffic: their elements in layouts.py's terms). Under --dp_shard (FSDP2 holds
each TP-local matrix cut along its rows over dp) the momentum runs on each rank's rows, every
update is all-gathered over dp in one call first (dp_shard.gathered_rows), and each rank applies
its own rows. Newton-Schulz runs in bf16 on a GPU, fp32 on a CPU; updates travel in that dtype.
"""
import math
import re

import torch

from extensions import dp_shard
import layouts
from extensions.buckets import gathered_all, owner_computes, owners
from parallel import all_reduce

NS = (3.4445, -4.7750, 2.0315)
STEPS = 5
EPS = 1e-7
# the decoder weights Muon takes (full-model names): a bottleneck's factors, or a dense projection
MATRIX = re.compile(r"layers\.\d+\.(attn|mlp)\.(q|k|v|o|gate|up|down)\.(A\.|B\.)?weight$")


def newton_schulz(X, dtype=torch.float32, steps=STEPS):
    """The orthogonalised X (m, n) of one device: torch.optim.Muon's iteration in `dtype`; X may be
    a stack (k, m, n) of same-shaped matrices, orthogonalised together (one bmm chain)."""
    a, b, c = NS
    tall = X.shape[-2] > X.shape[-1]
    Y = X.to(dtype)
    Y = Y.mT if tall else Y                                          # (.., small, large)
    Y = Y / Y.norm(dim=(-2, -1), keepdim=True).clamp(min=EPS)
    for _ in range(steps):
        G = Y @ Y.mT                                                # (.., small, small)
        Y = a * Y + (b * G + c * G @ G) @ Y
    return (Y.mT if tall else Y).to(X.dtype)


def by_shape(xs):
    """[[indices of xs with one shape]], in first-seen order: the stacks a batched step takes."""
    groups = {}
    for i, x in enumerate(xs):
        groups.setdefault(tuple(x.shape), []).append(i)
    return list(groups.values())


def newton_schulz_many(xs, dtype=torch.float32):
    """newton_schulz of each matrix of xs, the same-shaped ones stacked (one bmm chain each)."""
    out = [None] * len(xs)
    for idx in by_shape(xs):
        ys = newton_schulz(torch.stack([xs[i] for i in idx]), dtype)   # (k, m, n)
        for j, i in enumerate(idx):
            out[i] = ys[j]
    return out


def newton_schulz_gram(blocks, group, dtype=torch.float32, steps=STEPS):
    """newton_schulz of several matrices each cut along its long side over `group`: blocks are this
    rank's X_i (small, large/t), already oriented, stacked by shape; the Frobenius norms and the
    Gram matrices summed over the ranks, one all-reduce for all the blocks at each step. Returns
    the orthogonalised blocks."""
    a, b, c = NS
    stacks = [torch.stack([blocks[i] for i in idx]).to(dtype) for idx in by_shape(blocks)]
    sq = all_reduce(torch.cat([(y.float() ** 2).sum((-2, -1)) for y in stacks]), group,
                    "optim")                                        # (n,): every block's Σx²
    norms = sq.sqrt().clamp(min=EPS).to(dtype).split([len(y) for y in stacks])
    Ys = [y / n[:, None, None] for y, n in zip(stacks, norms)]      # [(k, small, large/t)]
    for _ in range(steps):
        grams = [y @ y.mT for y in Ys]                              # [(k, small, small)]
        flat = all_reduce(torch.cat([g.reshape(-1) for g in grams]), group, "optim")
        Gs = [G.view_as(g) for G, g in zip(flat.split([g.numel() for g in grams]), grams)]
        Ys = [a * y + (b * G + c * G @ G) @ y for y, G in zip(Ys, Gs)]
    out = [None] * len(blocks)
    for idx, ys in zip(by_shape(blocks), Ys):
        for j, i in enumerate(idx):
            out[i] = ys[j]
    return out


class Piece:
    """One full weight inside a local parameter: its rows [start, start + rows) of the local tensor,
    the dimension `dim` its full tensor is cut along over t ranks (None: whole here), and how its
    update is orthogonalised: "whole", "gram", "gather" or "owner" (`prefer`, the path configure
    took; a piece the Gram path does not fit, cut along its short side, gathers)."""

    def __init__(self, start, rows, local_shape, dim, t, prefer="gather"):
        self.start, self.rows, self.dim, self.t = start, rows, dim, t
        full = [rows, local_shape[1]]
        if dim is not None:
            full[dim] *= t
        self.full = tuple(full)                                     # (m, n) of the whole weight
        m, n = self.full
        if dim is None or t == 1:
            self.mode = "whole"
        elif prefer == "owner":
            self.mode = "owner"
        else:   # (the Gram path sums over a cut along X's long side)
            fits = dim == (1 if m <= n else 0)
            self.mode = "gram" if fits and prefer == "gram" else "gather"

    def block(self, t):
        return t[self.start:self.start + self.rows]                 # this rank's part, a view

    @property
    def lr_scale(self):
        """torch.optim.Muon's "original" scale, of the whole weight: √max(1, m/n)."""
        return math.sqrt(max(1.0, self.full[0] / self.full[1]))


def pieces_of(spec, local_shape, t, prefer):
    """The Pieces of a local parameter laid out by sharding.Spec `spec`."""
    out, start = [], 0
    for rows in spec.rows:
        out.append(Piece(start, rows, local_shape, spec.dim, t, prefer))
        start += rows
    return out


class MuonAdamW(torch.optim.AdamW):
    """AdamW (torch's, fused where the device has it: it skips its update where `found_inf` is 1)
    for the groups without "muon", and Muon for the groups with it: each such group also holds
    "pieces" ({param: [Piece]}, each on the path configure chose), "tp" (the TP group, None for
    one device), "momentum", "lr_ratio" (Muon's rate over AdamW's) and "ns_dtype". A Muon
    parameter's state is its "momentum_buffer" (and "step", as AdamW's)."""

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
        nothing moves where found_inf is 1 (a non-finite gradient, train.py's flag). Collectives
        come in buckets, whatever the number of matrices: under --dp_shard one all-gather of every
        update over dp; over TP one all-gather of every gathered piece, 1 + 5 all-reduces for the
        Gram pieces, two all-to-alls for the owner pieces (buckets.owner_computes); the
        Newton-Schulz steps of same-shaped matrices are one bmm chain."""
        found = getattr(self, "found_inf", None)
        keep = 1.0 if found is None else (found == 0).to(torch.float32)   # (0: skip this step)
        work = [p for p in group["params"] if p.grad is not None]
        updates = self.updates(work, group["momentum"], found, keep)   # (TP-local, dp gathered)
        whole, gather, gram, owned = [], [], [], []
        for p in work:
            for piece in group["pieces"][p]:
                x = piece.block(updates[p])
                if piece.mode == "gram":   # oriented (small, large): the cut runs along columns
                    gram.append(((p, piece.start), piece, x.t() if piece.dim == 0 else x))
                else:   # sent (gather, owner) in the dtype Newton-Schulz casts them to anyway
                    {"gather": gather, "owner": owned, "whole": whole}[piece.mode].append(
                        ((p, piece.start), piece, x.to(group["ns_dtype"])))
        tp = group["tp"]
        fulls = [x for *_, x in whole]
        if gather:
            fulls += gathered_all([x for *_, x in gather], [pc.dim for _, pc, _ in gather],
                                  tp.group)
        out = {}
        for (key, piece, _), y in zip(whole + gather, newton_schulz_many(
                [f.float() for f in fulls], group["ns_dtype"])):
            out[key] = y if piece.mode == "whole" else y.chunk(piece.t, piece.dim)[tp.tp_rank]
        if gram:
            ys = newton_schulz_gram([x for *_, x in gram], tp.group, group["ns_dtype"])
            for (key, piece, _), y in zip(gram, ys):
                out[key] = y.t() if piece.dim == 0 else y
        if owned:   # (each whole on its owner: two all-to-alls)
            ys = owner_computes([x for *_, x in owned], [pc.dim for _, pc, _ in owned], tp.group,
                                lambda xs: newton_schulz_many([x.float() for x in xs],
                                                              group["ns_dtype"]))
            out.update({key: y for (key, _, _), y in zip(owned, ys)})
        self.apply(group, work, out, keep)

    def updates(self, params, momentum, found, keep):
        """{p: its Nesterov update, whole on this TP rank}: under --dp_shard each on this dp rank's
        rows, then every sharded one gathered over dp in one all-gather (dp_shard.gathered_rows)."""
        rows = {p: self.nesterov(p, momentum, found, keep) for p in params}
        sharded = [p for p in params if dp_shard.is_sharded(p)]
        if sharded:
            rows.update(zip(sharded, dp_shard.gathered_rows(sharded, [rows[p] for p in sharded])))
        return rows

    def nesterov(self, p, momentum, found, keep):
        """The momentum step of p's buffer and p's Nesterov update (under --dp_shard: of this dp
        rank's rows)."""
        st = self.state[p]
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = torch.zeros_like(p)             # (a dp shard, as p is)
            st["step"] = torch.zeros((), device=p.device)
        grad, buf = dp_shard.local(p.grad), dp_shard.local(st["momentum_buffer"])
        g = grad if found is None else torch.where(found > 0, 0.0, grad)   # (no NaN in)
        buf.lerp_(g, (1 - momentum) * keep)                         # (unchanged when skipped)
        st["step"] += 1
        return g.lerp(buf, momentum)                                # (Nesterov)

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


def configure(model, tc, prefer=None):
    """train.py's optimizer for `model` (a tp_model.TPLlama, or model.Llama on one device): AdamW
    (tc.optimizer="adamw"): weight decay on 2-D weights only, not on norm gains; fused, so a step
    with found_inf = 1 changes nothing. "muon": the decoder's matrices (MATRIX) go to Muon at
    tc.muon_lr with tc.muon_momentum, the rest to that AdamW."""
    params = [p for p in model.parameters() if p.requires_grad]
    matrices = set(map(id, muon_params(model))) if tc.optimizer == "muon" else set()
    adam = [p for p in params if id(p) not in matrices]
    groups = [{"params": [p for p in adam if p.dim() >= 2], "weight_decay": tc.weight_decay},
              {"params": [p for p in adam if p.dim() < 2], "weight_decay": 0.0}]
    said = ""
    if matrices:
        tp = getattr(model, "tp", None)
        specs = dict(model.named_specs()) if hasattr(model, "named_specs") else {}
        names = {id(p): n for n, p in model.named_parameters()}
        mats = [p for p in params if id(p) in matrices]
        cuda = mats[0].is_cuda

        def cut(mode):
            return {p: (pieces_of(specs[names[id(p)]], p.shape, tp.size, mode) if specs
                        else [Piece(0, p.shape[0], p.shape, None, 1)]) for p in mats}
        if prefer is None and tc.muon_mode != "auto":
            prefer = tc.muon_mode
        if prefer is None:   # auto: the path of least modelled cost
            prefer, said = choose_mode(cut, cuda, tc.muon_alpha_us, tc.muon_gbps, tc.muon_tflops)
        groups.append({"params": mats, "muon": True, "pieces": cut(prefer), "tp": tp,
                       "momentum": tc.muon_momentum, "weight_decay": tc.weight_decay,
                       "lr_ratio": tc.muon_lr / tc.learning_rate,
                       "ns_dtype": torch.bfloat16 if cuda else torch.float32})
    # fused: one kernel a step, which skips its update on the device where found_inf is 1
    cls = MuonAdamW if matrices else torch.optim.AdamW
    opt = cls(groups, lr=tc.learning_rate, betas=(tc.beta1, tc.beta2), fused=True)
    opt.said = said   # (train.py logs it once)
    return opt


# a Muon step's cost by backend (override: --muon_alpha_us, --muon_gbps, --muon_tflops): gloo over
# a host's loopback, one CPU thread's fp32 products at Muon's small shapes (17 to 78 GFLOP/s
# measured here); NCCL within an NVLink node, a GPU's bf16 products
LINKS = {"gloo": (50.0, 1.0, 0.05), "nccl": (10.0, 100.0, 100.0)}   # (α µs, GB/s, TFLOP/s)


def ns_flops(m, n, t=1):
    """The FLOPs of newton_schulz on an (m, n) matrix, its long side cut t ways (a rank's share on
    the Gram path): five steps of X·Xᵀ, G·G and (b·G + c·G²)·X."""
    m, n = min(m, n), max(m, n)
    return STEPS * (4 * m * m * n / t + 2 * m ** 3)


def step_cost(pieces, alpha, bw, rate, size):
    """Seconds of one Muon step's TP work on the busiest rank, the pieces cut for one path: α a
    collective, the bytes a rank receives over the bandwidth (ring: an all-gather (t−1)/t of the
    whole, an all-reduce 2(t−1)/t; an all-to-all (t−1)/t² of the whole), the Newton-Schulz FLOPs
    at `rate` (the owner path: the busiest owner's, as buckets.owners assigns them)."""
    cut = [pc for pc in pieces if pc.mode != "whole"]
    t = cut[0].t
    by = {mode: [pc for pc in cut if pc.mode == mode] for mode in ("gather", "gram", "owner")}
    numel = [pc.full[0] * pc.full[1] for pc in by["owner"]]
    calls = bool(by["gather"]) + (1 + STEPS) * bool(by["gram"]) + 2 * bool(by["owner"])
    elems = (sum(pc.full[0] * pc.full[1] for pc in by["gather"]) * (t - 1) / t
             + sum(STEPS * min(pc.full) ** 2 + 1 for pc in by["gram"]) * 2 * (t - 1) / t
             + sum(numel) * 2 * (t - 1) / t ** 2)
    load = [0.0] * t
    for pc, k in zip(by["owner"], owners(numel, t)):
        load[k] += ns_flops(*pc.full)
    flops = (sum(ns_flops(*pc.full) for pc in by["gather"]) + max(load)
             + sum(ns_flops(*pc.full, t) for pc in by["gram"]))
    return calls * alpha + elems * size / bw + flops / rate


def choose_mode(cut, cuda, alpha_us=0.0, gbps=0.0, tflops=0.0):
    """("gram", "gather" or "owner", a line saying why): the path of least step_cost for the
    TP-cut matrices, `cut(mode)` giving every matrix's Pieces for a path (where the Gram path fits
    no piece it is the gather); a tie goes to the earlier of gram, gather, owner. With no piece
    cut over TP, ("gather", "")."""
    alpha, bw, rate = LINKS["nccl" if cuda else "gloo"]
    alpha, bw, rate = (alpha_us or alpha) * 1e-6, (gbps or bw) * 1e9, (tflops or rate) * 1e12
    costs = {}
    for mode in ("gram", "gather", "owner"):
        pieces = [pc for pcs in cut(mode).values() for pc in pcs]
        if all(pc.mode == "whole" for pc in pieces):
            return "gather", ""
        if mode != "gram" or any(pc.mode == "gram" for pc in pieces):
            costs[mode] = step_cost(pieces, alpha, bw, rate, 2 if cuda else 4)
    mode = min(costs, key=costs.get)
    return mode, (f"muon: {mode} over TP (modelled ms a step: " +
                  ", ".join(f"{m} {c * 1e3:.3f}" for m, c in costs.items()) +
                  f"; α {alpha * 1e6:g} µs, {bw / 1e9:g} GB/s, {rate / 1e12:g} TFLOP/s; "
                  "--muon_mode to choose)")


def collectives(optimizer):
    """The collectives of one Muon step (the ledger's calls in phase "optim"), whatever the number
    of matrices: one all-gather over dp under --dp_shard, one all-gather of the gathered pieces
    over TP, 1 + 5 all-reduces for the Gram pieces, two all-to-alls for the owner pieces."""
    total = 0
    for g in optimizer.param_groups:
        if g.get("muon"):
            modes = {pc.mode for pcs in g["pieces"].values() for pc in pcs}
            total += any(dp_shard.is_sharded(p) for p in g["params"])
            total += ("gather" in modes) + (1 + STEPS) * ("gram" in modes) + 2 * ("owner" in modes)
    return total


def muon_params(model):
    """The parameters Muon takes: those whose full-model pieces are decoder matrices (a layout's
    local parameter holds pieces of one kind; model.Llama's names are the full names)."""
    if hasattr(model, "named_specs"):
        local = dict(model.named_parameters())
        return [local[n] for n, spec in model.named_specs() if MATRIX.search(spec.sources[0])]
    return [p for n, p in model.named_parameters() if MATRIX.search(n)]


def per_layer_traffic(layout, cfg, t, prefer):
    """The elements Muon's TP collectives carry for one decoder layer in one step, written in the
    terms of layouts.per_layer_traffic (d, kv, f, r_a, r_m; t) and tested equal to the ledger:
    each projection (out, in) of rank ρ is A (ρ, in) and B (out, ρ) (arch=full: W (out, in)),
    cut by BTP along in and out (X's long side), by vanilla along ρ, by Megatron along out (q, k,
    v, gate, up: column-parallel) or in (o, down); a piece costs 5·min(m, n)² + 1 by the Gram path,
    m·n gathered, or 2·m·n/t a rank on average by the owner path (`prefer`: gram, gather, owner)."""
    if t == 1:
        return 0
    d, f, kv, ra, rm = cfg.n_embd, cfg.mlp_width, cfg.kv_dim, cfg.attn_rank, cfg.mlp_rank
    total = 0
    for out, inp, rho, col in [(d, d, ra, True), (kv, d, ra, True), (kv, d, ra, True),
                               (d, d, ra, False), (f, d, rm, True), (f, d, rm, True),
                               (d, f, rm, False)]:                  # q, k, v, o, gate, up, down
        cut = layouts.LAYOUTS[layout].cut   # the dims A and B (dense: W) are cut along
        mats = [(rho, inp, cut[0]), (out, rho, cut[1])] if layouts.LAYOUTS[layout].lowrank \
            else [(out, inp, cut[0] if col else cut[1])]
        for m, n, dim in mats:
            piece = Piece(0, m // t if dim == 0 else m, (0, n // t if dim == 1 else n), dim, t,
                          prefer)
            total += {"gram": 5 * min(m, n) ** 2 + 1, "owner": 2 * m * n // t}.get(piece.mode,
                                                                                 m * n)
    return total


def traffic(optimizer, group="tp"):
    """The elements Muon's collectives over `group` carry in one step (the ledger's phase "optim"
    counts the results). "tp": per Gram piece its r×r matrix at each of the 5 steps, and one norm;
    per gathered piece the whole matrix (m·n); owner pieces: this rank's block of every one
    (m·n/t) to the owners, and of those it owns, every rank's slice back (m·n: buckets.owners).
    "dp" (--dp_shard): every matrix's TP-local update, its m rows padded to a multiple of dp."""
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
        owned = [pc.full[0] * pc.full[1] for pc in pieces if pc.mode == "owner"]
        if owned:
            t, me = g["tp"].size, g["tp"].tp_rank
            total += sum(owned) // t + sum(n for n, k in zip(owned, owners(owned, t)) if k == me)
    return total
