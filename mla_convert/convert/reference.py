"""Functional DeepseekV3 MLA attention on converted weights, for measuring conversion error.

Mirrors `DeepseekV3Attention` (tests check it against transformers) without importing the transformers
modeling stack, so per-layer errors can be measured inside the low-memory conversion process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..source.model import rms_norm
from . import target as T


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3)...: x (..., T, D); cos/sin (T, D/2). Layout kept."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # (..., T, D/2, 2)
    return out.flatten(-2)  # (..., T, D)


def project_queries(x: torch.Tensor, weights: dict[str, torch.Tensor], latent_norm: bool = True) -> torch.Tensor:
    """The MLA queries of the normalised input x (b, T, d) -> (b, T, H * (nope + rope)), through the query latent if any."""
    w = {name: weights[name].to(device=x.device, dtype=x.dtype) for name in T.QUERY_NAMES if name in weights}
    if T.Q_PROJ in w:
        return F.linear(x, w[T.Q_PROJ])
    q_latent = F.linear(x, w[T.Q_A_PROJ], w.get(T.Q_A_BIAS))
    if latent_norm:
        q_latent = rms_norm(q_latent, w[T.Q_A_NORM], T.LATENT_NORM_EPS)
    return F.linear(q_latent, w[T.Q_B_PROJ])


def mla_attention(
    x: torch.Tensor,
    weights: dict[str, torch.Tensor],
    num_heads: int,
    nope_dim: int,
    rope_dim: int,
    v_dim: int,
    inv_freq: torch.Tensor,
    latent_norm: bool = True,
    queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal MLA attention of the normalised input x (b, T, d) -> (b, T, d), weights named as in `self_attn.*`.

    latent_norm=False skips kv_a_layernorm / q_a_layernorm: the norm-free form used while refining.
    queries: `project_queries(x, ...)` when the caller has them (then `weights` needs no query tensors): calls that
    differ only in the K/V latent share them.
    """
    batch, length, _ = x.shape
    dtype = x.dtype
    w = {name: tensor.to(device=x.device, dtype=dtype) for name, tensor in weights.items() if name not in T.QUERY_NAMES}
    q = project_queries(x, weights, latent_norm) if queries is None else queries
    q = q.view(batch, length, num_heads, nope_dim + rope_dim).transpose(1, 2)  # (b, H, T, nope + rope)
    q_nope, q_rope = q.split([nope_dim, rope_dim], dim=-1)
    rank = w[T.KV_B_PROJ].shape[1]
    compressed = F.linear(x, w[T.KV_A_PROJ], w.get(T.KV_A_BIAS))
    latent, k_rope = compressed.split([rank, rope_dim], dim=-1)  # (b, T, R), (b, T, D)
    if latent_norm:
        latent = rms_norm(latent, w[T.KV_A_NORM], T.LATENT_NORM_EPS)
    kv = F.linear(latent, w[T.KV_B_PROJ]).view(batch, length, num_heads, nope_dim + v_dim).transpose(1, 2)
    k_nope, value = kv.split([nope_dim, v_dim], dim=-1)  # (b, H, T, nope), (b, H, T, v)
    freqs = torch.arange(length, dtype=torch.float32, device=x.device)[:, None] * inv_freq.to(x.device).float()[None, :]  # (T, D/2)
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    q_rope = rotate_interleaved(q_rope, cos, sin)
    k_rope = rotate_interleaved(k_rope[:, None], cos, sin).expand(-1, num_heads, -1, -1)  # (b, H, T, D)
    query = torch.cat([q_nope, q_rope], dim=-1)
    key = torch.cat([k_nope, k_rope], dim=-1)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=length > 1, scale=(nope_dim + rope_dim) ** -0.5)
    out = out.transpose(1, 2).reshape(batch, length, num_heads * v_dim)  # (b, T, H*v)
    return F.linear(out, w[T.O_PROJ], w.get(T.O_BIAS))
