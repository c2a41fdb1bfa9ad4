"""notation.py: explain.py's notation, sizes named by the symbols of layouts.py's docstring.

BOOST (arXiv 2512.12131, §2-6, as explain.py teaches them) writes every tensor of a layer in a few
symbols: d the width, r the bottleneck rank, f the MLP width, t the tensor-parallel degree, V the
vocabulary, and their combinations (3r+1 for the q, k, v latents with the online RMSNorm's
statistic, d/t a BTP slice).
`--explain` prints the shapes it records in these symbols, so a reader sees (b·s, 3r+1), not (14,
49).
"""

HEADS = ("hd", "heads", "heads/t", "kv_heads/t")   # symbols named only where an op says it is one


class Names:
    """Sizes -> the symbols of layouts.py's docstring ("d/t", "3r+1"). Where the op says which
    symbol it is (a parameter's dimension, attention's (b, heads/t, s, hd), a collective of this
    layout) that one is printed; otherwise every symbol of that size ("d/t=2r")."""

    def __init__(self, cfg, t, b, s):
        d, ra, rm, f = cfg.n_embd, cfg.attn_rank, cfg.mlp_rank, cfg.mlp_width
        kv, V = cfg.kv_dim, cfg.vocab_size
        self.rm, self.t = ("r" if rm == ra else "r_m"), t
        self.kv = "kv" if kv != d else "d"
        self.heads, self.kv_heads = cfg.n_head, cfg.n_kv_head
        table = [("b·s", b * s), ("b", b), ("s", s), ("d", d), ("d/t", d // t), ("f", f),
                 ("f/t", f // t),
                 *([("kv", kv), ("kv/t", kv // t)] if kv != d else []), ("V", V), ("V/t", V // t),
                 ("hd", cfg.head_dim),
                 ("heads", cfg.n_head), ("heads/t", cfg.n_head // t),
                 ("kv_heads/t", cfg.n_kv_head // t)]
        if cfg.lowrank:
            table += [("r", ra), ("2r", 2 * ra), ("3r", 3 * ra), ("3r+1", 3 * ra + 1),
                      ("r/t", ra // t),
                      ("3r/t", 3 * ra // t), (self.rm, rm), (f"2{self.rm}", 2 * rm),
                      (f"2{self.rm}+1", 2 * rm + 1),
                      (f"{self.rm}/t", rm // t), (f"2{self.rm}/t", 2 * rm // t)]
        self.names = {}
        for name, value in table if t > 1 else [(n, v) for n, v in table if "/t" not in n]:
            if value > 1 and name not in self.names.get(value, []):
                self.names.setdefault(value, []).append(name)

    def size(self, n, prefer=()):
        names = self.names.get(n, [str(n)])
        chosen = [m for m in names if m in prefer]
        return chosen[0] if chosen else "=".join([m for m in names if m not in HEADS] or names)

    def shape(self, shape, prefer=()):
        return "(" + ", ".join(self.size(n, prefer) for n in shape) + ")"

    def attention(self, shape):
        """Attention's (b, heads/t, s, hd) tensors (and its (b, heads/t, s) statistic) named by
        position, not by value: b and heads/t, or hd and r, may be equal sizes."""
        t, cut = self.t, "/t" if self.t > 1 else ""
        heads = {}
        for n, name in [(self.heads // t, "heads" + cut), (self.kv_heads // t, "kv_heads" + cut),
                        (self.heads, "heads"), (self.kv_heads, "kv_heads")]:
            heads.setdefault(n, name)
        named = [self.size(shape[0], ("b",)), heads.get(shape[1], str(shape[1])),
                 *[self.size(n, (want,)) for n, want in zip(shape[2:], ("s", "hd"))]]
        return "(" + ", ".join(named) + ")"

    def param(self, name, cfg):
        """A single-device parameter's shape in symbols, from its name: layers.0.attn.q.A.weight ->
        (r, d)."""
        parts = name.split(".")
        if parts[0] in ("tok_emb", "lm_head"):
            return ("V", "d")
        if parts[0] == "norm" or parts[2].endswith("norm"):
            return ("d",)
        proj = parts[3]
        out = {"k": self.kv, "v": self.kv, "gate": "f", "up": "f"}.get(proj, "d")
        inp = "f" if proj == "down" else "d"
        if not cfg.lowrank:
            return (out, inp)
        rank = "r" if parts[2] == "attn" else self.rm
        # LaX: the LayerNorm and the gate (kron's D and E: r1 x r1, r2 x r2)
        if parts[4] == "cross":
            kind = parts[5]
            if kind in ("D", "E"):
                return (f"{rank}{'12'[kind == 'E']}",) * 2
            return (rank, rank) if kind == "W" and parts[-1] == "weight" else (rank,)
        return (rank, inp) if parts[4] == "A" else (out, rank)

    def local(self, spec, cfg):
        """A layout's parameter in symbols, from its Spec: [q.A, k.A, v.A] split on dim 1 -> (3r,
        d/t)."""
        full = [self.param(p, cfg) for p in spec.sources]
        rows = [f[0] for f in full]
        sym = [rows[0] if len(rows) == 1 else f"{len(rows)}{rows[0]}" if len(set(rows)) == 1
               else "+".join(rows),
               *full[0][1:]]
        if spec.dim is not None and self.t > 1:
            sym[spec.dim] += "/t"
        return tuple(sym)
