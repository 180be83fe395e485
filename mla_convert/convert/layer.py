"""Convert one source attention layer into DeepseekV3 MLA weights.

Layout of the result (per DeepseekV3Attention, H heads, nope = v = source head_dim h, rope = D):
- `q_proj` rows per head: [q_nope (h, the source query rows) | q_rope (D, interleaved pairs)], scaled by
  sqrt((h + D) / h) so DeepSeek's softmax scale (h + D)^-0.5 equals the source's h^-0.5.
  With a query bias (Qwen2) or `q_lora_rank`, the same rows become `q_b_proj` behind `q_a_proj`.
- `kv_a_proj_with_mqa` rows: [alpha * W_down (R) | shared RoPE key (D, interleaved)].
- `kv_a_layernorm.weight` = sqrt(eps) / alpha: the latent is stored at a tiny scale alpha so that
  mean(c^2) << eps for every possible input, which makes the stock RMSNorm linear (it returns c).
- `kv_b_proj` rows per head: [NoPE key (h) | value (h)] of the head's source kv group: W_up rows.
- `o_proj` = source o_proj; the source value bias moves into its bias (attention weights sum to 1).
NoPE key biases are dropped exactly: they add the same number to every key of a query's softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..source.config import SourceConfig
from ..source.shapes import MLAShape
from . import target as T
from .factorize import Whitening, factorize, psd_root
from .rope import SlotPlan, augmented_moment, complex_components, real_rows


@dataclass
class LayerReport:
    layer: int
    kept_energy: float
    latent_scale: float
    rope_estimated_error: float = 0.0
    rope_nope_error: float = 0.0
    query_bias_residual: float | None = None
    kv_balance: float = 1.0
    attention_error: float | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = {
            "layer": self.layer,
            "kept_energy": round(self.kept_energy, 6),
            "latent_scale": self.latent_scale,
            "rope_error_estimate": self.rope_estimated_error,
            "rope_error_if_no_rope": self.rope_nope_error,
            "kv_balance": self.kv_balance,
        }
        if self.query_bias_residual is not None:
            out["query_bias_residual"] = self.query_bias_residual
        if self.attention_error is not None:
            out["attention_output_relative_error"] = self.attention_error
        out.update(self.extra)
        return out


def interleave_slots(slot_rows: torch.Tensor) -> torch.Tensor:
    """(..., slots, n) complex -> (..., 2 * slots, n) real rows: slot l -> rows 2l (real), 2l + 1 (imag)."""
    stacked = torch.stack([slot_rows.real, slot_rows.imag], dim=-2)  # (..., slots, 2, n)
    return stacked.flatten(-3, -2)  # (..., 2 * slots, n)


def slot_projections(plan: SlotPlan, q_c: torch.Tensor, k_c: torch.Tensor, num_kv_heads: int):
    """Apply a slot plan to complex query/key rows.

    q_c: (H, h/2, n) complex source query components; k_c: (G, h/2, n) key components (n = inputs, or
    inputs + 1 with a bias column).  Returns (q_slots (H, slots, n), k_slot (slots, n), k_residual
    (G, h/2, n)): the slot key c_l = sum conj(read) z, its per-head query, and the key left to NoPE.
    """
    num_heads, half, n = q_c.shape
    group = num_heads // num_kv_heads
    k_flat = k_c.reshape(num_kv_heads * half, n)  # (G*h/2, n)
    residual = k_flat.clone()
    slots = len(plan.members)
    device = k_flat.device
    k_slot = torch.zeros(slots, n, dtype=k_flat.dtype, device=device)
    q_slots = torch.zeros(num_heads, slots, n, dtype=q_c.dtype, device=device)
    for slot, members in enumerate(plan.members):
        if not members:
            continue
        index = torch.tensor(members, device=device)
        read = plan.read[slot].to(device=device, dtype=k_flat.dtype)
        write = plan.write[slot].to(device=device, dtype=k_flat.dtype)
        k_slot[slot] = (read.conj()[:, None] * k_flat[index]).sum(0)
        residual[index] -= write[:, None] * k_slot[slot][None, :]
        for position, member in enumerate(members):
            g, j = divmod(member, half)
            heads = torch.arange(g * group, (g + 1) * group, device=device)
            q_slots[heads, slot] += write[position].conj() * q_c[heads, j]
    return q_slots, k_slot, residual.reshape(num_kv_heads, half, n)


def query_second_moments(
    q_weight: torch.Tensor, q_bias: torch.Tensor | None, second_moment: torch.Tensor, mean: torch.Tensor,
    num_heads: int, head_dim: int,
) -> torch.Tensor:
    """E[q_i q_i^T] per query head: (H, h, h), from the input second moment and mean."""
    w = q_weight.double().view(num_heads, head_dim, -1)  # (H, h, d)
    moments = w @ second_moment.double() @ w.transpose(1, 2)  # (H, h, h)
    if q_bias is not None:
        b = q_bias.double().view(num_heads, head_dim, 1)  # (H, h, 1)
        wm = w @ mean.double().view(-1, 1)  # (H, h, 1)
        moments = moments + wm @ b.transpose(1, 2) + b @ wm.transpose(1, 2) + b @ b.transpose(1, 2)
    return moments


def convert_attention(
    weights: dict[str, torch.Tensor],
    shape: SourceConfig,
    mla: MLAShape,
    plan: SlotPlan,
    second_moment: torch.Tensor,
    mean: torch.Tensor,
    method: str = "output",
    kv_balance: float = 1.0,
    layer_index: int = 0,
    use_q_lora: bool = False,
    whitening: Whitening | None = None,
    nope_scaling: bool = False,
) -> tuple[dict[str, torch.Tensor], LayerReport]:
    """Source attention weights (by role) -> DeepseekV3 `self_attn.*` tensors (float64) and a report.

    `whitening` may be passed in to share its eigendecomposition across several calls on one layer.
    """
    H, G, h, D, R = shape.num_heads, shape.num_kv_heads, shape.head_dim, mla.rope_dim, mla.kv_lora_rank
    group = H // G
    d = shape.hidden_size
    w_q, w_k, w_v, w_o = (weights[f"{r}_weight"].double() for r in "qkvo")
    b_q, b_k, b_v, b_o = (weights.get(f"{r}_bias") for r in "qkvo")
    b_q, b_k, b_v, b_o = (b.double() if b is not None else None for b in (b_q, b_k, b_v, b_o))

    # --- RoPE slots: complex rows with a bias column appended (zero when there is no bias)
    def with_bias(w, b):
        return torch.cat([w, (b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)).view(-1, 1)], dim=1)

    q_c = complex_components(with_bias(w_q, b_q), H, h)  # (H, h/2, d+1)
    k_c = complex_components(with_bias(w_k, b_k), G, h)  # (G, h/2, d+1)
    q_slots, k_slot, k_residual = slot_projections(plan, q_c, k_c, G)
    q_rope = interleave_slots(q_slots)  # (H, D, d+1)
    k_rope = interleave_slots(k_slot)  # (D, d+1)
    k_nope = real_rows(k_residual)[:, :d]  # (G*h, d); NoPE key bias dropped (softmax-invariant)
    # the float64 intermediates of a layer are each the size of W_q: drop them as soon as they are used, so that
    # one layer's conversion holds a few of them at a time, not all (Llama-3-8B width: 134 MB each)
    del q_c, k_c, q_slots, k_slot, k_residual

    # --- joint low-rank factorization of [NoPE keys; values]
    stacked = torch.cat([k_nope, w_v], dim=0)  # (2*G*h, d)
    row_root = None
    balance = 1.0
    if method == "output":
        q_moments = query_second_moments(w_q, b_q, second_moment, mean, H, h)  # (H, h, h)
        if nope_scaling and plan.nope_scale is not None:
            # the exported NoPE queries are scaled: weight the key errors by what the queries will really be
            scale = plan.nope_scale.double().to(w_q.device).repeat(1, 2)  # (H, h)
            q_moments = q_moments * scale[:, :, None] * scale[:, None, :]
        key_weight = q_moments.view(G, group, h, h).sum(1)  # (G, h, h)
        w_o_heads = w_o.view(d, H, h).permute(1, 2, 0)  # (H, h, d): head i's o_proj columns, transposed
        value_weight = (w_o_heads @ w_o_heads.transpose(1, 2)).view(G, group, h, h).sum(1)  # (G, h, h)
        c = second_moment.double()
        k_energy = sum(torch.trace(k @ c @ k.T @ m).item() for k, m in zip(k_nope.view(G, h, d), key_weight))
        v_energy = sum(torch.trace(v @ c @ v.T @ m).item() for v, m in zip(w_v.view(G, h, d), value_weight))
        # equal K and V energy (then shifted by kv_balance); clamped for layers with (almost) no NoPE key
        balance = min(max(v_energy / max(k_energy, 1e-300), 1e-6), 1e6) * kv_balance
        row_root = torch.block_diag(
            *[psd_root(m * balance)[0] for m in key_weight], *[psd_root(m)[0] for m in value_weight]
        )
    if method != "weight" and whitening is None:
        whitening = Whitening.of(second_moment)
    fact = factorize(stacked, R, None if method == "weight" else whitening, row_root)
    del stacked, k_nope, row_root
    up_k = fact.up[: G * h].view(G, h, R)
    up_v = fact.up[G * h :].view(G, h, R)

    # --- latent scale that makes kv_a_layernorm linear
    alpha = T.latent_scale_for(fact.down, weights["input_norm"])
    kv_a = torch.cat([alpha * fact.down, k_rope[:, :d]], dim=0)  # (R + D, d)
    kv_b = torch.cat([up_k, up_v], dim=1).repeat_interleave(group, dim=0).reshape(H * 2 * h, R)  # (H*(h+h), R)

    # --- queries: [nope | rope] per head, with the softmax-scale ratio folded in
    gamma = math.sqrt((h + D) / h)
    q_nope = with_bias(w_q, b_q).view(H, h, d + 1)  # (H, h, d+1), rotate_half layout
    if nope_scaling and plan.nope_scale is not None:
        # pair j lives in rows j and j + h/2: scale both by E[cos(omega_j * distance)] of this head
        scale = plan.nope_scale.double().to(w_q.device).repeat(1, 2)  # (H, h)
        q_nope.mul_(scale[:, :, None])  # in place: a fresh tensor (with_bias concatenates), W_q-sized
    q_full = torch.cat([q_nope, q_rope], dim=1).mul_(gamma)  # (H, h + D, d+1)
    del q_nope, q_rope
    q_full = q_full.reshape(H * (h + D), d + 1)
    q_weight, q_bias = q_full[:, :d], q_full[:, d]

    out: dict[str, torch.Tensor] = {
        T.KV_A_PROJ: kv_a,
        T.KV_A_NORM: T.latent_norm_weight(R, alpha).to(w_q.device),
        T.KV_B_PROJ: kv_b,
        T.O_PROJ: w_o,
    }
    report = LayerReport(layer_index, fact.kept_energy, alpha, plan.estimated_error, plan.nope_error, kv_balance=kv_balance)
    report.extra["kv_energy_ratio"] = balance
    has_bias = shape.qkv_bias or shape.o_bias
    if has_bias:
        out[T.KV_A_BIAS] = torch.cat([torch.zeros(R, dtype=torch.float64, device=w_q.device), k_rope[:, d]])
        o_bias = b_o.clone() if b_o is not None else torch.zeros(d, dtype=torch.float64, device=w_q.device)
        if b_v is not None:
            o_bias = o_bias + w_o @ b_v.view(G, h).repeat_interleave(group, dim=0).reshape(H * h)
        out[T.O_BIAS] = o_bias

    needs_q_lora = use_q_lora or mla.q_lora_rank is not None or (b_q is not None and bool(b_q.abs().max() > 0))
    if not needs_q_lora:
        out[T.Q_PROJ] = q_weight
    else:
        q_a_weight, q_a_bias, q_b_weight, residual, q_alpha = _query_lora(
            q_weight, q_bias, w_q, b_q, mla, second_moment, mean, weights["input_norm"])
        out[T.Q_A_PROJ] = q_a_weight
        if has_bias:
            out[T.Q_A_BIAS] = q_a_bias
        out[T.Q_A_NORM] = T.latent_norm_weight(q_a_weight.shape[0], q_alpha).to(w_q.device)
        out[T.Q_B_PROJ] = q_b_weight
        report.query_bias_residual = residual
        report.extra["query_latent_scale"] = q_alpha
    return out, report


def _query_lora(q_weight, q_bias, w_q_source, b_q_source, mla: MLAShape, second_moment, mean, input_norm_weight):
    """Queries through q_a_proj -> (linearised) q_a_layernorm -> q_b_proj.

    Full rank (the Qwen2 bias case): q_a = alpha * (x + v) with W_q v = b_q, so q_b_proj = the query rows
    reproduces W' x + T b_q exactly when b_q lies in W_q's column space; the residual is reported.
    Low rank (`--q-lora-rank`): activation-aware SVD of [W' | b'] with the bias as a constant input
    (the augmented moment E[[x;1][x;1]^T], cross terms with the mean included); the residual reported is
    the relative error of the rebuilt queries on the calibration statistics.
    Returns (q_a weight, q_a bias, q_b weight, residual or None without a bias, alpha).
    """
    d = q_weight.shape[1]
    rank = mla.q_lora_rank or d
    if rank >= d:
        if b_q_source is not None:
            shift = torch.linalg.lstsq(w_q_source, b_q_source.view(-1, 1)).solution.view(-1)  # (d,)
            residual = (torch.linalg.norm(w_q_source @ shift - b_q_source) / torch.linalg.norm(b_q_source).clamp_min(1e-30)).item()
        else:
            shift = torch.zeros(d, dtype=torch.float64, device=q_weight.device)
            residual = None
        eye = torch.eye(d, dtype=torch.float64, device=q_weight.device)
        alpha = T.latent_scale_for(eye, input_norm_weight, torch.linalg.norm(shift).item())
        return alpha * eye, alpha * shift, q_weight, residual, alpha
    # low rank: inputs augmented with a constant 1 so that the bias becomes a column
    moment = augmented_moment(second_moment, mean)  # (d+1, d+1)
    augmented = torch.cat([q_weight, q_bias.view(-1, 1)], dim=1)  # (rows, d+1)
    fact = factorize(augmented, rank, Whitening.of(moment))
    down_w, down_b = fact.down[:, :d], fact.down[:, d]
    alpha = T.latent_scale_for(down_w, input_norm_weight, torch.linalg.norm(down_b).item())
    error = augmented - fact.up @ fact.down  # (rows, d+1)
    residual = math.sqrt(torch.trace(error @ moment @ error.T).clamp_min(0).item()
                         / max(torch.trace(augmented @ moment @ augmented.T).item(), 1e-300))
    return alpha * down_w, alpha * down_b, fact.up, residual, alpha
