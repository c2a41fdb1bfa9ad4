"""kernels.py: the local compute ops of bottleneck-aware TP, one function per op.

BOOST (arXiv 2512.12131) sections 3-4. parallel.py calls only the functions below; each is the
PyTorch reference here, which is the specification and the CPU path. (Triton kernels with the same
signatures are the subject of a later issue and plug in behind these functions.)

- norm_down: the local half of online RMSNorm fused with a grouped down-projection. For a rank's
  slice x (M, K) of the residual stream, its slice γ (K) of the norm gain and its columns A (N, K)
  of the grouped down-projection: H = (x ⊙ γ)·Aᵀ (M, N) and S = Σ_k x² (M, 1), in one pass over x.
  After the all-reduce of [H | S]: RMSNorm(x_full)·A_fullᵀ = H / sqrt(S/d + ε).
- grouped_up: the up-projections y_g = z_g·B_gᵀ of several latents in one grouped GEMM; each group
  may have its own output width (with GQA, q is wider than k and v).
"""
import torch


def norm_down(x, gamma, A):
    """x (..., K), gamma (K,), A (N, K) -> H (..., N), S (..., 1) with S in float32."""
    S = x.float().pow(2).sum(-1, keepdim=True)   # (..., 1)
    H = (x * gamma) @ A.t()                      # (..., N)
    return H, S


def grouped_up(zs, Bs):
    """zs: latents (..., r_g), Bs: weights (n_g, r_g) -> [z_g·B_gᵀ (..., n_g)] as one batched GEMM.

    Groups of equal shape go through a single torch.bmm; with unequal widths the narrower weights
    are zero-padded to the widest (the Triton kernel avoids the padding)."""
    if len(zs) == 1:
        return [zs[0] @ Bs[0].t()]
    lead = zs[0].shape[:-1]
    r = zs[0].shape[-1]
    if any(z.shape[-1] != r for z in zs):
        return [z @ B.t() for z, B in zip(zs, Bs)]
    n_max = max(B.shape[0] for B in Bs)
    W = torch.stack([torch.nn.functional.pad(B, (0, 0, 0, n_max - B.shape[0])) for B in Bs])  # (G, n_max, r)
    Z = torch.stack([z.reshape(-1, r) for z in zs])                                        # (G, M, r)
    Y = torch.bmm(Z, W.transpose(1, 2))                                                    # (G, M, n_max)
    return [Y[g, :, :B.shape[0]].reshape(*lead, B.shape[0]) for g, B in enumerate(Bs)]
