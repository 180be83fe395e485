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
from .rope import SlotPlan, augmented_moment, complex_components, moment_products, real_rows


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
    """E[q_i q_i^T] per query head: (H, h, h), from the input second moment and mean.

    One head at a time: the float64 rows of all heads and their product with the moment (2 x 134 MB at
    Llama-3-8B width) were the largest buffers at the conversion's peak.
    """
    c = second_moment.double()
    rows = [slice(i * head_dim, (i + 1) * head_dim) for i in range(num_heads)]
    return torch.stack([moment_products(q_weight[r], None if q_bias is None else q_bias[r], c, mean) for r in rows])


@dataclass
class QueryRows:
    """The exported query rows, from what they are made of: per head [NoPE rows (the source's, scaled) | RoPE rows].

    Kept as these parts (the source rows are the loaded layer's own tensor) and built on demand: the float64 rows
    are 1.5x W_q, the largest tensor of a layer's conversion.
    """

    source: torch.Tensor  # (H*h, d) the source query rows, rotate_half layout
    bias: torch.Tensor | None  # (H*h,) float64
    rope: torch.Tensor  # (H, D, d+1) float64 slot rows, bias column last
    nope_scale: torch.Tensor | None  # (H, h): E[cos(omega_j * distance)] per head, on rows j and j + h/2
    gamma: float  # sqrt((h + D) / h): DeepSeek's softmax scale made equal to the source's

    def rows(self) -> torch.Tensor:
        """(H*(h+D), d+1) float64: [q_proj | bias column], filled in place (no concatenated copies)."""
        heads, rope_dim, width = self.rope.shape
        head_dim = self.source.shape[0] // heads
        d = width - 1
        full = torch.empty(heads, head_dim + rope_dim, width, dtype=torch.float64, device=self.rope.device)
        full[:, :head_dim, :d] = self.source.view(heads, head_dim, d)
        full[:, :head_dim, d] = self.bias.view(heads, head_dim) if self.bias is not None else 0.0
        if self.nope_scale is not None:
            full[:, :head_dim].mul_(self.nope_scale[:, :, None])
        full[:, head_dim:] = self.rope
        return full.mul_(self.gamma).reshape(heads * (head_dim + rope_dim), width)


@dataclass
class AttentionParts:
    """One layer's conversion except the K/V factorization: everything the K/V balance attempts share.

    Why split: the balance only reweights the factorization of [NoPE keys; values]; the queries (a W_q-sized float64
    product and copy), o_proj and the shared RoPE key are the same for every attempt, so they are built once per
    layer and no attempt holds a second copy of them (Llama-3-8B width: 201 MB for q_proj alone).
    """

    fixed: dict[str, torch.Tensor]  # balance-independent output tensors, by target name
    stacked: torch.Tensor  # (2*G*h, d) float64 [NoPE keys; values]: what the latent must rebuild
    k_rope: torch.Tensor  # (D, d + 1) float64 shared RoPE key rows, bias column last
    key_weight: torch.Tensor | None  # (G, h, h) E[q q^T] summed over each kv group's query heads ("output" only)
    value_weight: torch.Tensor | None  # (G, h, h) W_o^T W_o per kv group, per head block ("output" only)
    energy_ratio: float  # V energy / NoPE-key energy (clamped): equal K and V energy at kv_balance 1
    method: str
    num_kv_heads: int
    head_dim: int
    group: int  # query heads per kv head
    plan_errors: tuple[float, float]  # the slot plan's estimated RoPE error and its error without RoPE
    query_bias_residual: float | None = None
    query_latent_scale: float | None = None
    queries: QueryRows | None = None  # q_proj, when it is not in `fixed` (no query latent)

    def tensors(self) -> dict[str, torch.Tensor]:
        """`fixed` with q_proj built (a new float64 tensor on each call)."""
        if self.queries is None:
            return dict(self.fixed)
        return {**self.fixed, T.Q_PROJ: self.queries.rows()[:, :-1]}


@dataclass
class LatentFactors:
    """The K/V factorization for one balance: the latent (kv_a, kv_a_layernorm) and its up-projection (kv_b)."""

    kv_a: torch.Tensor  # (R + D, d): [alpha * W_down | shared RoPE key]
    kv_a_norm: torch.Tensor  # (R,)
    kv_b: torch.Tensor  # (H * 2h, R)
    kept_energy: float
    alpha: float
    balance: float  # the effective NoPE-key weight: energy ratio x kv_balance

    def tensors(self) -> dict[str, torch.Tensor]:
        return {T.KV_A_PROJ: self.kv_a, T.KV_A_NORM: self.kv_a_norm, T.KV_B_PROJ: self.kv_b}


def prepare_attention(
    weights: dict[str, torch.Tensor],
    shape: SourceConfig,
    mla: MLAShape,
    plan: SlotPlan,
    second_moment: torch.Tensor,
    mean: torch.Tensor,
    method: str = "output",
    use_q_lora: bool = False,
    nope_scaling: bool = False,
) -> AttentionParts:
    """Source attention weights (by role) -> the balance-independent parts of the DeepseekV3 layer (float64).

    The float64 intermediates are each the size of W_q and are dropped as soon as they are used, so that
    one layer holds a few of them at a time, not all.
    """
    H, G, h, D = shape.num_heads, shape.num_kv_heads, shape.head_dim, mla.rope_dim
    group = H // G
    d = shape.hidden_size
    w_q = weights["q_weight"]  # as loaded (float32): W_q-sized float64 copies are made only where needed, one at a time
    w_k, w_v = (weights[f"{r}_weight"].double() for r in "kv")
    b_q, b_k, b_v, b_o = (weights.get(f"{r}_bias") for r in "qkvo")
    b_q, b_k, b_v, b_o = (b.double() if b is not None else None for b in (b_q, b_k, b_v, b_o))
    device = w_q.device

    # --- RoPE slots: complex rows with a bias column appended (zero when there is no bias)
    def with_bias(w, b):  # (rows, d) -> (rows, d+1) float64, written into one new tensor (no float64 copy of w first)
        out = torch.empty(w.shape[0], w.shape[1] + 1, dtype=torch.float64, device=w.device)
        out[:, :-1] = w
        out[:, -1] = b if b is not None else 0.0
        return out

    q_c = complex_components(with_bias(w_q, b_q), H, h)  # (H, h/2, d+1)
    k_c = complex_components(with_bias(w_k, b_k), G, h)  # (G, h/2, d+1)
    q_slots, k_slot, k_residual = slot_projections(plan, q_c, k_c, G)
    del q_c, k_c
    q_rope = interleave_slots(q_slots)  # (H, D, d+1)
    k_rope = interleave_slots(k_slot)  # (D, d+1)
    k_nope = real_rows(k_residual)[:, :d]  # (G*h, d); NoPE key bias dropped (softmax-invariant)
    del q_slots, k_slot, k_residual
    stacked = torch.cat([k_nope, w_v], dim=0)  # (2*G*h, d)

    # --- what the K/V factorization weighs its errors by (the same for every balance)
    key_weight = value_weight = None
    energy_ratio = 1.0
    if method == "output":
        q_moments = query_second_moments(w_q, b_q, second_moment, mean, H, h)  # (H, h, h)
        if nope_scaling and plan.nope_scale is not None:
            # the exported NoPE queries are scaled: weight the key errors by what the queries will really be
            scale = plan.nope_scale.double().to(device).repeat(1, 2)  # (H, h)
            q_moments = q_moments * scale[:, :, None] * scale[:, None, :]
        key_weight = q_moments.view(G, group, h, h).sum(1)  # (G, h, h)
        del q_moments
        # W_o_i^T W_o_i for head i's o_proj columns W_o_i (d, h), widened a head at a time: a float64 copy of the
        # whole o_proj is 134 MB at hidden 4096, the converting phase's peak
        w_o = weights["o_weight"]  # (d, H*h)
        head_grams = torch.stack([columns.T @ columns for columns in (w_o[:, i * h:(i + 1) * h].double() for i in range(H))])
        value_weight = head_grams.view(G, group, h, h).sum(1)  # (H, h, h) -> (G, h, h)
        del head_grams
        c = second_moment.double()
        k_energy = sum(torch.trace(k @ c @ k.T @ m).item() for k, m in zip(k_nope.view(G, h, d), key_weight))
        v_energy = sum(torch.trace(v @ c @ v.T @ m).item() for v, m in zip(w_v.view(G, h, d), value_weight))
        del c
        # equal K and V energy (then shifted by kv_balance); clamped for layers with (almost) no NoPE key
        energy_ratio = min(max(v_energy / max(k_energy, 1e-300), 1e-6), 1e6)
    del k_nope

    # --- queries: [nope | rope] per head, with the softmax-scale ratio folded in
    scale = plan.nope_scale.double().to(device).repeat(1, 2) if nope_scaling and plan.nope_scale is not None else None
    queries = QueryRows(w_q, b_q, q_rope, scale, math.sqrt((h + D) / h))
    del q_rope

    # o_proj is the source's (exact in its own dtype: casting it to the export dtype gives the same values)
    fixed: dict[str, torch.Tensor] = {T.O_PROJ: weights["o_weight"]}
    if shape.qkv_bias or shape.o_bias:
        fixed[T.KV_A_BIAS] = torch.cat([torch.zeros(mla.kv_lora_rank, dtype=torch.float64, device=device), k_rope[:, d]])
        o_bias = b_o.clone() if b_o is not None else torch.zeros(d, dtype=torch.float64, device=device)
        if b_v is not None:
            o_bias = o_bias + weights["o_weight"].double() @ b_v.view(G, h).repeat_interleave(group, dim=0).reshape(H * h)
        fixed[T.O_BIAS] = o_bias
    parts = AttentionParts(fixed, stacked, k_rope, key_weight, value_weight, energy_ratio, method, G, h, group,
                           (plan.estimated_error, plan.nope_error))
    needs_q_lora = use_q_lora or mla.q_lora_rank is not None or (b_q is not None and bool(b_q.abs().max() > 0))
    if not needs_q_lora:
        parts.queries = queries  # q_proj is built when asked for (`AttentionParts.tensors`), never held through an attempt
    else:
        q_full = queries.rows()
        q_weight, q_bias = q_full[:, :d], q_full[:, d]
        q_a_weight, q_a_bias, q_b_weight, residual, q_alpha = _query_lora(
            q_weight, q_bias, w_q.double(), b_q, mla, second_moment, mean, weights["input_norm"])
        fixed[T.Q_A_PROJ] = q_a_weight
        if T.KV_A_BIAS in fixed:
            fixed[T.Q_A_BIAS] = q_a_bias
        fixed[T.Q_A_NORM] = T.latent_norm_weight(q_a_weight.shape[0], q_alpha).to(device)
        fixed[T.Q_B_PROJ] = q_b_weight
        parts.query_bias_residual, parts.query_latent_scale = residual, q_alpha
    return parts


def factorize_latent(parts: AttentionParts, rank: int, whitening: Whitening | None, input_norm: torch.Tensor,
                     kv_balance: float = 1.0) -> LatentFactors:
    """The rank-`rank` latent of [NoPE keys; values] for one K/V balance (`whitening` None: the "weight" method)."""
    G, h = parts.num_kv_heads, parts.head_dim
    row_roots = None  # the block-diagonal output weighting: one h x h block per kv head, NoPE keys then values
    balance = 1.0
    if parts.method == "output":
        balance = parts.energy_ratio * kv_balance
        row_roots = [psd_root(m * balance)[0] for m in parts.key_weight] + [psd_root(m)[0] for m in parts.value_weight]
    fact = factorize(parts.stacked, rank, None if parts.method == "weight" else whitening, row_roots)
    up_k = fact.up[: G * h].view(G, h, rank)
    up_v = fact.up[G * h :].view(G, h, rank)
    d = parts.stacked.shape[1]
    alpha = T.latent_scale_for(fact.down, input_norm)
    kv_a = torch.cat([alpha * fact.down, parts.k_rope[:, :d]], dim=0)  # (R + D, d)
    kv_b = torch.cat([up_k, up_v], dim=1).repeat_interleave(parts.group, dim=0).reshape(-1, rank)  # (H*(h+h), R)
    norm = T.latent_norm_weight(rank, alpha).to(parts.stacked.device)
    return LatentFactors(kv_a, norm, kv_b, fact.kept_energy, alpha, balance)


def assemble_attention(parts: AttentionParts, factors: LatentFactors, layer_index: int = 0,
                       kv_balance: float = 1.0) -> tuple[dict[str, torch.Tensor], LayerReport]:
    """The layer's `self_attn.*` tensors (in the export's order) and its report."""
    fixed = parts.tensors()
    out = {**factors.tensors(), T.O_PROJ: fixed[T.O_PROJ]}
    for name in (T.KV_A_BIAS, T.O_BIAS, T.Q_PROJ, T.Q_A_PROJ, T.Q_A_BIAS, T.Q_A_NORM, T.Q_B_PROJ):
        if name in fixed:
            out[name] = fixed[name]
    estimated, nope = parts.plan_errors
    report = LayerReport(layer_index, factors.kept_energy, factors.alpha, estimated, nope, kv_balance=kv_balance)
    report.extra["kv_energy_ratio"] = factors.balance
    if parts.query_latent_scale is not None:
        report.query_bias_residual = parts.query_bias_residual
        report.extra["query_latent_scale"] = parts.query_latent_scale
    return out, report


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
    """Source attention weights (by role) -> DeepseekV3 `self_attn.*` tensors (float64, o_proj as given) and a report.

    `whitening` may be passed in to share its eigendecomposition across several calls on one layer.
    """
    parts = prepare_attention(weights, shape, mla, plan, second_moment, mean, method, use_q_lora, nope_scaling)
    if method != "weight" and whitening is None:
        whitening = Whitening.of(second_moment)
    factors = factorize_latent(parts, mla.kv_lora_rank, whitening, weights["input_norm"], kv_balance)
    return assemble_attention(parts, factors, layer_index, kv_balance)


def _query_lora(q_weight, q_bias, w_q_source, b_q_source, mla: MLAShape, second_moment, mean, input_norm_weight):
    """Queries through q_a_proj -> (linearised) q_a_layernorm -> q_b_proj.

    Full rank (the Qwen2 bias case): q_a = alpha * (x + v) with W_q v = b_q, so q_b_proj = the query rows
    reproduces W' x + T b_q exactly when b_q lies in W_q's column space; the residual is reported.  With more
    query rows than inputs it generally does not: rank d + 1 takes the augmented path, whose constant input
    channel carries the bias exactly.
    Low rank (`--q-lora-rank`): activation-aware SVD of [W' | b'] with the bias as a constant input
    (the augmented moment E[[x;1][x;1]^T], cross terms with the mean included); the residual reported is
    the relative error of the rebuilt queries on the calibration statistics.
    Returns (q_a weight, q_a bias, q_b weight, residual or None without a bias, alpha).
    """
    d = q_weight.shape[1]
    # no q_lora_rank asked: full rank, plus one constant channel for a bias W_q's columns cannot reach (more query
    # rows than inputs); that rank goes through the augmented path below, exact at d + 1
    outside = b_q_source is not None and w_q_source.shape[0] > d  # the bias can leave W_q's column space
    rank = mla.q_lora_rank or (d + 1 if outside else d)
    if rank == d and not outside:  # (a rank-d latent with such a bias: the augmented path's best rank-d fit below)
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
