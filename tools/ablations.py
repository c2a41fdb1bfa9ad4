"""ablations.py: the BTP layer without one of its two local optimisations, for `bench.py layouts`.

BOOST (arXiv 2512.12131) sections 3-4 claim that folding the RMSNorm statistic into the latent's
all-reduce (online RMSNorm) and grouping the projections that share an input each save
collectives. To measure what each is worth, this subclass of layouts.BTPBlock turns one off:

  online_norm=False  Σx² is all-reduced on its own before the down-projection, which then runs on
                     the normalised slice (one more, latency-bound collective per norm).
  grouped=False      A_q, A_k, A_v (and A_gate, A_up) run as separate GEMMs, each partial with its
                     own all-reduce (two, then one more collective per norm).

Both compute the same model: tests/test_parallel_layouts.py checks them against one device.

    TPLlama(model, tp, "btp", block=ablated(online_norm=False))
"""
import sys
from pathlib import Path

# the core files live at the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import layouts  # noqa: E402
from parallel import Copy, Reduce  # noqa: E402


class AblatedBTPBlock(layouts.BTPBlock):
    """layouts.BTPBlock with `online_norm` or `grouped` switched off (class attributes:
    ablated())."""
    online_norm, grouped = True, True

    def norm_down(self, x, gamma, A):
        """The partial(s) to all-reduce: one [H | S] (BTP), a list of them (ungrouped), or H alone
        after a separate all-reduce of Σx² (no online norm)."""
        r = A.shape[0] // (3 if A is self.A_qkv else 2)
        As = [A] if self.grouped else list(A.split(r))                           # (n, d/t) each
        if self.online_norm:
            parts = [super(AblatedBTPBlock, self).norm_down(x, gamma, a) for a in As]  # (b, s, n+1)
        else:
            g = self.tp.group
            S = x.float().pow(2).sum(-1, keepdim=True)                           # (b, s, 1) partial
            S = Copy.apply(Reduce.apply(S, g), g)  # every rank uses the sum: backward sums too
            h = (x * torch.rsqrt(S / self.cfg.n_embd + self.cfg.norm_eps)).to(x.dtype) * gamma
            parts = [h @ a.t() for a in As]                                      # (b, s, n)
        return parts[0] if self.grouped else parts

    def reduce(self, partial):
        if not isinstance(partial, list):
            return super().reduce(partial)
        parts = [super(AblatedBTPBlock, self).reduce(p) for p in partial]  # an all-reduce each
        if self.online_norm:   # every part carries the same Σx²: keep one copy, last
            return torch.cat([p[..., :-1] for p in parts] + [parts[0][..., -1:]], -1)
        return torch.cat(parts, -1)

    def latent(self, HS):
        return super().latent(HS) if self.online_norm else HS  # (b, s, n), before σ


def ablated(online_norm=True, grouped=True):
    """A BTP layer class for TPLlama(block=...) with the chosen optimisations."""
    return type("AblatedBTPBlock", (AblatedBTPBlock,),
                {"online_norm": online_norm, "grouped": grouped})
