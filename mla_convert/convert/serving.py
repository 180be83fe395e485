"""Serving-target transforms of one converted layer (`--target vllm / llama.cpp / all`).

The default export (`--target transformers`) keeps DeepSeek's latent RMSNorm linear by storing the latent
at a tiny scale (weights ~1e-7, see target.py): exact in transformers, but f16 flushes those weights to
zero and Q8_0's f16 block scales underflow (llama.cpp: SmolLM2 2x perplexity x4500 in f16).  For the
serving targets each layer is rewritten here, from its own calibration statistics (`LayerInputStats`:
the input second moment over every calibration token and the kept calibration windows), streaming, one
layer at a time.  Notation: x = the layer's normalised attention input (input_layernorm output, gain g),
L = latent rows of kv_a_proj_with_mqa, P = its RoPE rows, w = kv_a_layernorm gain, B = kv_b_proj,
eps = 1e-6 (every norm of the export).

1. Biases (`remove_biases`; serving targets have no bias slot: llama.cpp refuses the tensors, vLLM drops
   them silently).  Exactly softmax-invariant parts are already gone (the NoPE key bias adds the same
   number to every score of a query: layer.py drops it).  The rest is carried through the most constant
   direction of the input: u = argmin E[(u.x - 1)^2] = (E[x x^T])^-1 E[x] (ridge-regularised, fitted on the
   calibration tokens outside the kept windows, so that the cost below is measured out of sample), so
   b ~ b (u.x): the query bias and the RoPE-key bias move into their weights (W += b u^T); the value bias
   (and an o_proj bias, mapped onto per-head value biases through o_proj's pseudo-inverse) moves into
   kv_b_proj's value columns through the latent's own most constant direction v (v.n(c) ~ 1, n = the
   normalised latent).  Its cost is measured as the attention-output change with vs without biases on
   the kept calibration windows (reference MLA forward), and the export is refused when that is larger
   than max(BIAS_ERROR_FLOOR, the layer's own compression error): a bias-free export may lose at most as
   much again as the compression did.
2. Latent scale from calibration (`refit_latent`): L := b L with b = sqrt(margin eps / max_t mean(c_t^2))
   (margin 1e-2 of eps for the largest calibration token, vs today's worst-case bound ~1e-5), and the gain
   refit by least squares over the tokens: w := k w, k = sum_t e_t h_t / sum_t e_t h_t^2 with
   h_t = b sqrt(ms_t + eps) / sqrt(b^2 ms_t + eps), e_t = ms_t / (ms_t + eps).  Cost: the norm is linear to
   ~margin/2 instead of ~5e-6 (measured +2.8e-4 / +6.4e-4 relative perplexity on stories260K / SmolLM2 2x).
3. Cache balance (exact): every latent dim i stores w_i c_i / sqrt(eps): w_i := w_i t_i, B[:, i] := B[:, i] / t_i
   with t equalising their RMS; every RoPE pair j: P_j := u_j P_j and every head's query RoPE rows / u_j.
   A q8_0 KV cache (32 values per scale) otherwise wipes the small dims (SmolLM2 256+64: ppl 37.9 -> 51.7).
4. Identity query path (llama.cpp needs q_lora_rank; exact up to eps / mean(h^2)): q_lora_rank = hidden,
   q_a_proj = I, q_a_layernorm = g sqrt(1 + eps), q_b_proj = the query rows, kv_a absorbs diag(g),
   input_layernorm = 1.  Cost: hidden^2 + hidden values per layer.
5. Split (exact): input_layernorm *= s, every consumer (q_proj or q_a_proj, kv_a) /= s, with
   s = sqrt(rms(L) / rms(x)) so that the tiny factor is shared by the activation and the weights.
The magnitudes that decide f16 / Q8_0 / Q4_K survival are recorded per layer (`magnitude`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..source.config import SourceConfig
from ..source.shapes import MLAShape
from . import target as T
from .calibration import LayerInputStats
from .reference import mla_attention

F16_MIN_NORMAL = 6.103515625e-05
F16_MIN_SUBNORMAL = 5.960464477539063e-08
# Largest calibration token's mean(c^2) as a fraction of eps after the refit (docs/engines.md: 1e-2 costs
# +2.8e-4 / +6.4e-4 relative perplexity and lifts the weights ~100-1000x, into f16's normal range).
SERVING_MARGIN = 1e-2
# A bias-free export is refused when removing the biases changes a layer's attention output by more than
# this and by more than the layer's own compression error (relative, on the kept calibration windows).
BIAS_ERROR_FLOOR = 0.05
# Per-dimension balancing factors are kept within this range (a dead latent dim must not blow up its gain).
BALANCE_LIMIT = 1e4


@dataclass
class ServedLayer:
    weights: dict[str, torch.Tensor]
    input_norm: torch.Tensor
    info: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- magnitudes
def magnitude(t: torch.Tensor) -> dict:
    """What f16 / Q8_0 / Q4_K would do to a 2-D weight (rows = outputs, blocks along the input dim).

    Fractions are over the non-zero entries (the exact zeros of an identity survive every format).  A Q8_0
    block scale is amax/127 stored in f16: below 6.1e-5 it is subnormal (precision lost), below 3e-8 zero.
    """
    a = t.detach().abs().double()
    nz = a[a > 0]
    if nz.numel() == 0:
        return {"max": 0.0}
    out = {"max": a.max().item(), "median_nonzero": nz.median().item(), "min_nonzero": nz.min().item(),
           "frac_below_f16_normal": (nz < F16_MIN_NORMAL).double().mean().item(),
           "frac_zero_in_f16": (nz.to(torch.float16) == 0).double().mean().item()}
    if t.dim() == 2 and t.shape[1] % 32 == 0:
        blocks = a.reshape(t.shape[0], -1, 32).amax(-1)
        q8 = blocks[blocks > 0] / 127
        if q8.numel():
            out["q8_0_scale_median"] = q8.median().item()
            out["frac_q8_0_scale_subnormal"] = (q8 < F16_MIN_NORMAL).double().mean().item()
            out["frac_q8_0_scale_zero"] = (q8 < F16_MIN_SUBNORMAL / 2).double().mean().item()
    return out


def layer_magnitudes(weights, rank: int) -> dict:
    """`magnitude` of each weight of one served layer that a GGUF / fp16 conversion can hurt; `weights` by attention
    names (`target.KV_A_PROJ`, ...), `rank` the latent rows of kv_a_proj_with_mqa (the rest are its RoPE rows)."""
    kv_a = weights[T.KV_A_PROJ]
    mags = {"kv_a_latent_rows": magnitude(kv_a[:rank]), "kv_a_rope_rows": magnitude(kv_a[rank:]),
            "kv_b_proj": magnitude(weights[T.KV_B_PROJ])}
    for name in (T.Q_PROJ, T.Q_A_PROJ, T.Q_B_PROJ):
        if name in weights:
            mags[name.split(".")[0]] = magnitude(weights[name])
    return mags


def summarize_magnitudes(layers: list[dict]) -> dict:
    """Worst case over layers, per tensor kind: the largest fractions, the smallest medians, the largest max."""
    summary: dict = {}
    for info in layers:
        for name, mags in info.get("magnitudes", {}).items():
            row = summary.setdefault(name, {})
            for key, value in mags.items():
                if key.startswith("frac"):
                    row[key] = max(row.get(key, 0.0), value)
                elif key in ("median_nonzero", "min_nonzero", "q8_0_scale_median"):
                    row[key] = min(row.get(key, math.inf), value)
                elif key == "max":
                    row[key] = max(row.get(key, 0.0), value)
    return summary


# --------------------------------------------------------------------------- helpers
def _tokens(stats: LayerInputStats, like: torch.Tensor) -> torch.Tensor:
    """The kept calibration windows' tokens, (N, d) float64."""
    return stats.samples.reshape(-1, stats.samples.shape[-1]).to(device=like.device, dtype=torch.float64)


def _geometric_balance(rms: torch.Tensor) -> torch.Tensor:
    """Factors t with rms * t all equal to their geometric mean (limited to BALANCE_LIMIT either way)."""
    alive = rms[rms > 0]
    if alive.numel() == 0:
        return torch.ones_like(rms)
    floor = alive.max() / BALANCE_LIMIT
    clamped = rms.clamp_min(floor)
    t = clamped.log().mean().exp() / clamped
    return t.clamp(1 / BALANCE_LIMIT, BALANCE_LIMIT)


# Ridge of the constant-direction fit, relative to the input's mean eigenvalue.
CONSTANT_DIRECTION_RIDGE = 1e-3


def constant_direction(moment: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """u minimising E[(u.x - 1)^2] + ridge |u|^2 for inputs with second moment `moment` and mean `mean`."""
    n = moment.shape[0]
    ridge = CONSTANT_DIRECTION_RIDGE * torch.trace(moment).item() / n + 1e-300
    return torch.linalg.solve(moment + ridge * torch.eye(n, dtype=moment.dtype, device=moment.device), mean)


def held_out_moments(stats: LayerInputStats, total_tokens: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(second moment, mean) of the calibration tokens that are NOT in the kept windows, and whether that was possible.

    The bias fold is fitted on these and measured on the kept windows, so its measured cost is out of sample
    (fitted and measured on the same tokens, u can reproduce a constant on as many tokens as the input has
    dimensions, whatever the text).
    """
    moment = stats.second_moment.double().to(like.device)
    mean = stats.mean.double().to(like.device)
    kept = _tokens(stats, like)
    rest = total_tokens - kept.shape[0]
    if rest < 1:
        return moment, mean, False
    moment = (total_tokens * moment - kept.T @ kept) / rest
    mean = (total_tokens * mean - kept.sum(0)) / rest
    return moment, mean, True


def refit_latent(rows: torch.Tensor, gain: torch.Tensor, ms_old: torch.Tensor, eps: float, margin: float):
    """New latent scale so that max_t mean(c_t^2) / eps = margin; the gain refit by least squares.

    Old: out_t = gain c_t / sqrt(ms_t + eps).  New rows b L, gain k w: out'_t = out_t g_t with
    g_t = k b sqrt(ms_t + eps) / sqrt(b^2 ms_t + eps); k minimises sum_t e_t (g_t - 1)^2, e_t = ms_t/(ms_t + eps)
    (the energy of out_t).  Returns (rows, gain, info).
    """
    top = ms_old.max().item()
    if not top > 0:
        return rows, gain, {"scale_factor": 1.0, "gain_factor": 1.0}
    b = math.sqrt(margin * eps / top)
    h = b * torch.sqrt(ms_old + eps) / torch.sqrt(b * b * ms_old + eps)
    e = ms_old / (ms_old + eps)
    k = ((e * h).sum() / (e * h * h).sum()).item()
    g = k * h
    info = {"scale_factor": b, "gain_factor": k, "max_ms_over_eps_before": top / eps, "max_ms_over_eps": b * b * top / eps,
            "token_factor_rel_std": (g.std() / g.mean()).item() if g.numel() > 1 else 0.0,
            "token_factor_min": g.min().item(), "token_factor_max": g.max().item()}
    return rows * b, gain * k, info


def _rope_rows(weights: dict[str, torch.Tensor]) -> str:
    return T.Q_B_PROJ if T.Q_B_PROJ in weights else T.Q_PROJ


# --------------------------------------------------------------------------- 1. biases
def _without_biases(w: dict[str, torch.Tensor], u: torch.Tensor | None, v: torch.Tensor | None, beta: torch.Tensor | None,
                    mla: MLAShape, source: SourceConfig) -> dict[str, torch.Tensor]:
    """Biases carried by x-direction u (query, RoPE key) and latent direction v (per-head value bias beta); None: dropped."""
    w = dict(w)
    R, H, h = mla.kv_lora_rank, source.num_heads, source.head_dim
    for bias_name, weight_name in ((T.Q_A_BIAS, T.Q_A_PROJ), (T.KV_A_BIAS, T.KV_A_PROJ)):
        bias = w.pop(bias_name, None)
        if bias is not None and u is not None:
            w[weight_name] = w[weight_name] + torch.outer(bias, u)
    if w.pop(T.O_BIAS, None) is not None and v is not None:
        kv_b = w[T.KV_B_PROJ].view(H, 2 * h, R).clone()
        kv_b[:, h:, :] += beta.view(H, h, 1) * v.view(1, 1, R)
        w[T.KV_B_PROJ] = kv_b.view(H * 2 * h, R)
    if T.Q_A_PROJ in w and mla.q_lora_rank is None:
        # linear q_a_layernorm: q = q_b diag(gain / sqrt(eps)) q_a x
        scale = w.pop(T.Q_A_NORM) / math.sqrt(T.LATENT_NORM_EPS)
        w[T.Q_PROJ] = w.pop(T.Q_B_PROJ) @ (scale[:, None] * w.pop(T.Q_A_PROJ))
    return w


def remove_biases(weights: dict[str, torch.Tensor], stats: LayerInputStats, source: SourceConfig, mla: MLAShape,
                  inv_freq: torch.Tensor, total_tokens: int) -> tuple[dict[str, torch.Tensor], dict]:
    """The bias-free layer (see the module doc) and what it cost: {"removal_error", residuals, ...}.

    Two candidates are measured on the kept windows, the biases carried by the most constant directions
    (fitted on the other calibration tokens) and the biases simply dropped; the better one is exported.
    The query path collapses to q_proj when the user did not ask for a query latent (the full-rank q_a
    path existed only to carry the query bias); `serve_layer` rebuilds it where a target needs one.
    """
    biases = [name for name in (T.Q_A_BIAS, T.KV_A_BIAS, T.O_BIAS) if name in weights]
    if not biases and not (T.Q_A_PROJ in weights and mla.q_lora_rank is None):
        return weights, {}
    w = {name: tensor.double() for name, tensor in weights.items()}
    if not biases:
        return _without_biases(w, None, None, None, mla, source), {}
    R, H, h = mla.kv_lora_rank, source.num_heads, source.head_dim
    moment, mean, held_out = held_out_moments(stats, total_tokens, w[T.KV_A_PROJ])
    u = constant_direction(moment, mean)
    x = stats.samples.to(device=u.device, dtype=torch.float64)  # the kept windows: where the cost is measured
    flat = x.reshape(-1, x.shape[-1])
    info: dict = {"biases": sorted(biases), "measured_on": "held-out kept windows" if held_out else "the fitting tokens (all kept)",
                  "bias_norms": {name: torch.linalg.norm(w[name]).item() for name in biases},
                  "constant_direction_residual": ((flat @ u - 1).pow(2).mean()).item()}
    v = beta = None
    if T.O_BIAS in w:
        o, bias = w[T.O_PROJ], w[T.O_BIAS]  # o: (d, H*h); a per-head value bias beta with o beta = bias carries it exactly
        beta = torch.linalg.lstsq(o, bias.view(-1, 1)).solution.view(-1)
        info["o_bias_residual"] = (torch.linalg.norm(o @ beta - bias) / max(torch.linalg.norm(bias).item(), 1e-300)).item()
        # what kv_b_proj reads: n = diag(gain / sqrt(eps)) L x (the latent norm is linear in this export)
        latent = w[T.KV_A_NORM][:, None] / math.sqrt(T.LATENT_NORM_EPS) * w[T.KV_A_PROJ][:R]
        v = constant_direction(latent @ moment @ latent.T, latent @ mean)
        info["latent_constant_direction_residual"] = ((flat @ latent.T @ v - 1).pow(2).mean()).item()
    with_bias = mla_attention(x, w, H, h, mla.rope_dim, h, inv_freq)
    candidates = {"carried": _without_biases(w, u, v, beta, mla, source), "dropped": _without_biases(w, None, None, None, mla, source)}
    errors = {}
    for name, candidate in candidates.items():
        without = mla_attention(x, candidate, H, h, mla.rope_dim, h, inv_freq)
        errors[name] = ((without - with_bias).norm() / with_bias.norm().clamp_min(1e-300)).item()
    best = min(errors, key=errors.get)
    info.update(removal_errors=errors, chosen=best, removal_error=errors[best])
    return candidates[best], info


def bias_cost_problem(layer: int, info: dict, compression_error: float | None) -> str | None:
    """Why the bias-free export is refused (None: its cost is acceptable)."""
    cost = info.get("removal_error")
    if cost is None:
        return None
    limit = max(BIAS_ERROR_FLOOR, compression_error or 0.0)
    if cost <= limit:
        return None
    return (f"layer {layer}: removing the attention biases (the serving engines have no bias slot) changes the attention "
            f"output by {cost:.3f} (relative, on the calibration windows), more than the limit {limit:.3f} = max({BIAS_ERROR_FLOOR}, "
            f"this layer's compression error {compression_error or 0.0:.3f}): no direction of the input is constant enough "
            f"to carry biases this large (the best leaves mean (u.x - 1)^2 = "
            f"{info.get('constant_direction_residual', 1.0):.2g} on held-out tokens). "
            "Use --target transformers, which keeps the biases; nothing was written")


# --------------------------------------------------------------------------- 2-5. magnitudes, balance, q path, split
def serve_layer(weights: dict[str, torch.Tensor], input_norm: torch.Tensor, stats: LayerInputStats, source: SourceConfig,
                mla: MLAShape, layout: T.ExportLayout, margin: float | None = None) -> ServedLayer:
    """A bias-free converted layer (float64 weights) rewritten for the serving engines (module doc, steps 2-5)."""
    eps = T.LATENT_NORM_EPS
    margin = SERVING_MARGIN if margin is None else margin
    w = {name: tensor.double().clone() for name, tensor in weights.items()}
    device = w[T.KV_A_PROJ].device
    g = input_norm.double().to(device)
    R, D, H, h, d = mla.kv_lora_rank, mla.rope_dim, source.num_heads, source.head_dim, source.hidden_size
    moment = stats.second_moment.double().to(device)
    tokens = _tokens(stats, w[T.KV_A_PROJ])
    info: dict = {}

    # 2. latent scale from calibration (and the query latent's, when the user asked for one)
    kv_a, kv_norm = w[T.KV_A_PROJ], w[T.KV_A_NORM]
    ms = (tokens @ kv_a[:R].T).pow(2).mean(-1)
    rows, kv_norm, info["kv_latent"] = refit_latent(kv_a[:R], kv_norm, ms, eps, margin)
    kv_a = torch.cat([rows, kv_a[R:]])
    if T.Q_A_PROJ in w:
        ms_q = (tokens @ w[T.Q_A_PROJ].T).pow(2).mean(-1)
        w[T.Q_A_PROJ], w[T.Q_A_NORM], info["q_latent"] = refit_latent(w[T.Q_A_PROJ], w[T.Q_A_NORM], ms_q, eps, margin)

    # 3. balance what the cache stores: latent dims (gain / kv_b columns), RoPE pairs (key rows / query rows)
    dim_rms = torch.einsum("rd,de,re->r", kv_a, moment, kv_a).clamp_min(0).sqrt()
    stored = dim_rms[:R] * kv_norm.abs()
    t = _geometric_balance(stored)
    kv_norm = kv_norm * t
    w[T.KV_B_PROJ] = w[T.KV_B_PROJ] / t[None, :]
    pairs = dim_rms[R:].view(-1, 2).pow(2).mean(-1).sqrt()
    tr = _geometric_balance(pairs).repeat_interleave(2)
    kv_a = torch.cat([kv_a[:R], kv_a[R:] * tr[:, None]])
    q_name = _rope_rows(w)
    q = w[q_name].view(H, h + D, -1).clone()
    q[:, h:, :] /= tr[None, :, None]
    w[q_name] = q.view(H * (h + D), -1)
    alive = lambda x: x[x > 0]  # noqa: E731
    info["cache_balance"] = {
        "latent_rms_spread_before": (alive(stored).max() / alive(stored).min()).item() if alive(stored).numel() else 1.0,
        "rope_pair_rms_spread_before": (alive(pairs).max() / alive(pairs).min()).item() if alive(pairs).numel() else 1.0,
    }

    # 4. identity query path: q_a sees x_hat (RMS 1), the input gain moves into q_a_layernorm and kv_a
    act_rms = math.sqrt(max(torch.trace(moment).item(), 1e-300) / d)
    if layout.identity_q_path:
        w[T.Q_B_PROJ] = w.pop(T.Q_PROJ)
        w[T.Q_A_PROJ] = torch.eye(d, dtype=torch.float64, device=device)
        w[T.Q_A_NORM] = g * math.sqrt(1 + eps)
        kv_a = kv_a * g[None, :]
        g = torch.ones_like(g)
        act_rms = 1.0
        info["identity_q_path_values"] = d * d + d

    # 5. split: the remaining small factor shared by the input norm and its consumers
    latent_rms = kv_a[:R].pow(2).mean().sqrt().item()
    s = math.sqrt(latent_rms / act_rms) if latent_rms > 0 else 1.0
    g = g * s
    kv_a = kv_a / s
    q_in = T.Q_A_PROJ if T.Q_A_PROJ in w else T.Q_PROJ
    w[q_in] = w[q_in] / s
    info["split_s"] = s
    info["input_activation_rms"] = act_rms * s
    w[T.KV_A_PROJ], w[T.KV_A_NORM] = kv_a, kv_norm

    info["magnitudes"] = layer_magnitudes(w, R)
    info["kv_a_layernorm_gain_max"] = kv_norm.abs().max().item()
    return ServedLayer(w, g, info)


# --------------------------------------------------------------------------- the report's `serving` section
def serving_report(source: SourceConfig, mla: MLAShape, target: T.Target, layout: T.ExportLayout, layers: list[dict],
                   dtype: torch.dtype, compression: float | None, ranks_given: bool = False) -> dict | None:
    """What `--target` did to the export, for mla_convert.json (None for the transformers target)."""
    from ..source.shapes import shape_choice_note
    from ..units import dtype_bytes

    if not target.serving:
        return None
    size = dtype_bytes(dtype)
    d = source.hidden_size
    untied = source.tied_embeddings and not layout.tie_word_embeddings
    extra = {"untied_lm_head": source.vocab_size * d if untied else 0,
             "identity_q_path": source.num_layers * (d * d + d) if layout.identity_q_path else 0}
    transforms = ["n_group / topk_group null (every target)"]
    if untied:
        transforms.append(f"untied lm_head.weight (a copy of the embeddings: +{extra['untied_lm_head']:,} values)")
    if layout.identity_q_path:
        transforms.append(f"identity query path, q_lora_rank = hidden {d} (+{extra['identity_q_path']:,} values)")
    transforms += [f"latent scale from calibration (max mean(c^2) = {SERVING_MARGIN:g} eps), gain refit by least squares",
                   "KV cache balanced per latent dim and RoPE pair (exact)", "input-norm split s (exact)"]
    bias_layers = [layer["bias"] for layer in layers if layer.get("bias", {}).get("removal_error") is not None]
    bias = None
    if bias_layers:
        transforms.append("attention biases removed (softmax-invariant parts dropped, the rest carried by the most constant "
                          "input direction)")
        bias = {"removal_error_per_layer": [b["removal_error"] for b in bias_layers],
                "chosen_per_layer": [b["chosen"] for b in bias_layers],
                "dropped_error_per_layer": [b["removal_errors"]["dropped"] for b in bias_layers],
                "max_removal_error": max(b["removal_error"] for b in bias_layers),
                "constant_direction_residual_per_layer": [b["constant_direction_residual"] for b in bias_layers],
                "floor": BIAS_ERROR_FLOOR,
                "rule": f"refused when a layer's removal error exceeds max({BIAS_ERROR_FLOOR}, its compression error)"}
    return {
        "target": target.name,
        # only a shape the tool picked needs explaining; ranks given with -r/-d are the user's own choice
        "shape_note": None if ranks_given else shape_choice_note(source, target, mla, compression),
        "quantized_kv_cache": target.quantized_kv_problem(mla.kv_lora_rank, mla.rope_dim) or (
            "possible" if target.quantized_kv_block else None),
        "tie_word_embeddings": layout.tie_word_embeddings,
        "q_lora_rank": layout.q_lora_rank,
        "transforms": transforms,
        "extra_values": extra,
        "extra_bytes": sum(extra.values()) * size,
        "margin": SERVING_MARGIN,
        "bias": bias,
        "weight_formats": list(target.weight_formats),
        "kv_cache_formats": list(target.kv_cache_formats),
        "magnitudes": summarize_magnitudes(layers),
        "layers": layers,
    }
