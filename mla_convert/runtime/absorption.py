"""Where W_UK and W_UV go for decoding: per-head products each step, or folded into q/o_proj at load.

Absorbed decoding needs, per head h, q_latent[h] = W_UK[h]^T q_nope[h] (R values from nope) before the
attention and W_UV[h] out[h] (v values from R) after it.  Both are linear maps next to another linear map
(q_proj or q_b_proj before, o_proj after), so they can be multiplied in once at load:

* query side: q_proj's nope rows of head h, (nope, q_in), become W_UK[h]^T @ those rows, (R, q_in); one
  (H * (R + D), q_in) projection then yields q_latent and q_rope directly;
* output side: o_proj's columns of head h, (hidden, v), become those columns @ W_UV[h]^T, (hidden, R);
  one (hidden, H * R) projection maps the kernel's (B, H, R) output straight to the hidden size.

Fusing removes two batched matmuls (and their transposes) per layer and step, but it changes how many
weights are read per token, which is what a memory-bound decode step pays for:

    query:  separate H (nope + D) q_in + H nope R      fused H (R + D) q_in
    output: separate H v R + hidden H v                fused hidden H R

Fusing is cheaper only when R is at most about nope (resp. v): SmolLM2-135M at 4x (R = 64 = nope = v)
fuses both sides (query 497K vs 534K multiply-adds per token, output 332K vs 369K); at 2x (R = 144) it
would read 1.5x more weights (query 995K vs 663K), so "auto" keeps the per-head products there.  The
decision is made per side from these counts; "fused" and "separate" force it.

The fused weights are computed in float32 from the checkpoint's tensors and then cast to the compute
dtype, so they are as exact as the separate ones up to one rounding.  Prefill still uses the
original projections (it runs the expanded attention, which needs q_nope and the per-head values), so
a fused side keeps both copies of its weights in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import GenerationSettingsError

ABSORB_MODES = ("auto", "fused", "separate")


@dataclass(frozen=True)
class AbsorptionPlan:
    """Which side is fused, and the multiply-adds per token and layer of each choice (separate, fused)."""

    fuse_query: bool
    fuse_output: bool
    query_costs: tuple[int, int]
    output_costs: tuple[int, int]


def plan_absorption(mode: str, heads: int, nope: int, rope_dim: int, v_dim: int, rank: int, q_in: int,
                    hidden: int) -> AbsorptionPlan:
    """Decide per side from the weight counts above (`mode` "auto"), or force it ("fused" / "separate")."""
    if mode not in ABSORB_MODES:
        raise GenerationSettingsError(f"absorb={mode!r}: choose one of {', '.join(ABSORB_MODES)}")
    query = (heads * (nope + rope_dim) * q_in + heads * nope * rank, heads * (rank + rope_dim) * q_in)
    output = (heads * v_dim * rank + hidden * heads * v_dim, hidden * heads * rank)
    if mode == "auto":
        return AbsorptionPlan(query[1] <= query[0], output[1] <= output[0], query, output)
    fused = mode == "fused"
    return AbsorptionPlan(fused, fused, query, output)


def fuse_query_weight(q_weight: torch.Tensor, w_uk: torch.Tensor, nope: int, rope_dim: int) -> torch.Tensor:
    """(H * (nope + D), q_in) query projection and W_UK (H, nope, R) -> (H * (R + D), q_in), float32.

    Row block h of the result is [W_UK[h]^T @ nope rows of head h ; rope rows of head h], so that
    F.linear(x, result).view(N, H, R + D) splits into q_latent (N, H, R) and q_rope (N, H, D).
    """
    heads, _, rank = w_uk.shape
    per_head = q_weight.float().view(heads, nope + rope_dim, -1)  # (H, nope + D, q_in)
    latent_rows = torch.bmm(w_uk.float().transpose(1, 2), per_head[:, :nope, :])  # (H, R, nope) @ (H, nope, q_in)
    fused = torch.cat([latent_rows, per_head[:, nope:, :]], dim=1)  # (H, R + D, q_in)
    return fused.reshape(heads * (rank + rope_dim), -1)  # (H * (R + D), q_in)


def fuse_output_weight(o_proj: torch.Tensor, w_uv_t: torch.Tensor) -> torch.Tensor:
    """o_proj (hidden, H * v) and W_UV^T (H, R, v) -> (hidden, H * R), float32.

    Column block h is o_proj[:, h*v:(h+1)*v] @ W_UV[h], so F.linear(out.reshape(B, H * R), result)
    equals o_proj applied to the per-head values W_UV[h] out[h].
    """
    heads, rank, v_dim = w_uv_t.shape
    per_head = o_proj.float().view(-1, heads, v_dim).transpose(0, 1)  # (H, hidden, v)
    fused = torch.bmm(per_head, w_uv_t.float().transpose(1, 2))  # (H, hidden, v) @ (H, v, R) -> (H, hidden, R)
    return fused.transpose(0, 1).reshape(-1, heads * rank)  # (hidden, H * R)
