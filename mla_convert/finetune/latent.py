"""Bring the latents of a converted model to a trainable scale, and back at save time, exactly.

Why: the export stores each latent at a small scale alpha (see `convert.target`).  `kv_a_proj_with_mqa`'s
latent rows are alpha * W and `kv_a_layernorm.weight` = g = sqrt(eps) / alpha x (per-dim factors ~1): alpha ~3e-7
for a --target transformers export (gain ~3e3), ~5e-5 .. 8e-5 for a serving export (stories260K --target llama.cpp
-c 2: gains 13 .. 18, above `LINEARISED_MIN_GAIN`).  The same
holds for `q_a_proj` / `q_a_layernorm` with a query bias or q_lora.  Adam moves every weight by ~lr per step: it
would wipe weights of size 1e-7 and barely touch gains of size 1e4, so these tensors cannot be trained as stored.

The reparametrisation.  With x = alpha * c~ (c~ = W~ h, W~ = W / alpha the rows at their natural scale)
and m = mean(c~^2), the stock RMSNorm is, for ANY alpha:

    g * x / sqrt(mean(x^2) + eps)  =  g~ * c~ / sqrt(1 + s * m),   g~ = g * alpha / sqrt(eps),  s = alpha^2 / eps.

Training divides the latent rows (and their bias) of the down-projection by alpha and replaces the stock
norm with `UnfoldedLatentNorm`, which computes the right-hand side with a trainable gain g~ (~1 after
conversion).  Every trained tensor has its natural size, and the model computes the stock function: for a
transformers export s * m <= 1e-5 on every input as converted (the converter's bound), so the norm starts nearly
linear; for a serving export s * m reaches 1e-2 on calibration tokens.  Training sees the stock norm either way, and
trained weights that grow may leave that linear range: the saved folder still computes exactly what was trained.

Saving folds the same alpha back: W = alpha * W~, b = alpha * b~, g = g~ * sqrt(eps) / alpha.  Both sides of
the identity above are the same function, so the saved folder computes the trained model (to rounding) in
transformers and in any engine, and keeps its export's weight scale: a serving export stays in float16's
normal range.  (An earlier design trained the linear g~ * c~ and, when the trained weights grew, shrank
alpha at save back to the worst-case bound, which undid a serving export's scale.)

Which norms are stored latents: those the conversion report (mla_convert.json) gives a latent scale for
(`stored_latent_sites`), whatever their gain.  Without a report (a real DeepSeek checkpoint, or a folder that lost
it), the gain's size decides (`LINEARISED_MIN_GAIN`): a learned norm (gain ~1) is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..convert import target as T
from ..convert.target import LATENT_NORM_EPS

# Without a conversion report: a stock norm gain this large means the latent was stored at a small scale by the
# converter (g = sqrt(1e-6) / alpha >= 10 <=> alpha <= 1e-4; measured: ~3e-7 for the transformers target, 5e-5 .. 8e-5
# for a serving target, only 1.3-1.8x inside this bound, which is why the report decides when there is one; a site
# left out trains as stored, still exactly).
LINEARISED_MIN_GAIN = 10.0

# which side of a layer a report row's latent scale belongs to
REPORT_SCALE_KEYS = {"kv": "latent_scale", "q": "query_latent_scale"}


class UnfoldedLatentNorm(nn.Module):
    """Training form of a stored latent RMSNorm: g~ * c~ / sqrt(1 + s * mean(c~^2)), s = alpha^2 / eps.

    Exactly the stock norm of alpha * c~ with gain g~ * sqrt(eps) / alpha (module doc), computed as
    transformers' DeepseekV3RMSNorm computes it (the mean square in float32, the gain applied in the input's
    dtype).  `weight` is g~ (the name is kept so state-dict keys match the stock model); `latent_scale`
    (alpha) and `eps` are plain attributes, not tensors, so they never enter a checkpoint or an optimizer.
    """

    def __init__(self, gain: torch.Tensor, latent_scale: float, eps: float = LATENT_NORM_EPS):
        super().__init__()
        self.weight = nn.Parameter(gain.detach().clone())
        self.latent_scale = float(latent_scale)
        self.eps = float(eps)

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        s = self.latent_scale**2 / self.eps
        wide = latent.float() if latent.dtype in (torch.float16, torch.bfloat16) else latent
        normalised = wide * torch.rsqrt(1.0 + s * wide.pow(2).mean(-1, keepdim=True))  # (..., rank)
        return self.weight * normalised.to(latent.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, latent_scale={self.latent_scale:.4g}, eps={self.eps}"


@dataclass
class LatentSite:
    """One unfolded latent: layer index, which side (kv or q), and the alpha it was unfolded with."""

    layer: int
    kind: str  # "kv" (kv_a_proj_with_mqa -> kv_a_layernorm) or "q" (q_a_proj -> q_a_layernorm)
    latent_scale: float
    rank: int  # latent rows of the down-projection (kv: kv_lora_rank; q: q_lora_rank)
    eps: float = LATENT_NORM_EPS

    @property
    def prefix(self) -> str:
        return T.attention_prefix(self.layer)

    @property
    def proj(self) -> str:
        return T.LATENT_MODULES[self.kind][0]

    @property
    def norm(self) -> str:
        return T.LATENT_MODULES[self.kind][1]


def _attention_modules(model: nn.Module):
    for index, layer in enumerate(model.model.layers):
        yield index, layer.self_attn


def stored_latent_sites(report: dict) -> set[tuple[int, str]] | None:
    """(layer, "kv" | "q") of every latent the conversion stored at a small scale, from its report's layer rows;
    None when the report has no layer rows (then `unfold_latent_scales` judges by the gain)."""
    rows = report.get("layers") if isinstance(report, dict) else None
    if not rows:
        return None
    return {(row["layer"], kind) for row in rows for kind, key in REPORT_SCALE_KEYS.items() if row.get(key) is not None}


def unfold_latent_scales(model: nn.Module, stored: set[tuple[int, str]] | None = None) -> list[LatentSite]:
    """Stock stored form -> training form, in place; the model's function is unchanged.

    `stored`: the (layer, kind) sites the conversion stored at a small scale (`stored_latent_sites` of its report);
    None: every norm whose gain is at least `LINEARISED_MIN_GAIN`.  Returns the unfolded sites (needed by
    `fold_latent_scales`).  Idempotent: already unfolded norms are reported, not unfolded twice.
    """
    sites: list[LatentSite] = []
    for index, attention in _attention_modules(model):
        for kind, (proj_name, norm_name) in T.LATENT_MODULES.items():
            norm = getattr(attention, norm_name, None)
            if norm is None or (stored is not None and (index, kind) not in stored):
                continue
            proj = getattr(attention, proj_name)
            rank = norm.weight.shape[0]
            if isinstance(norm, UnfoldedLatentNorm):
                sites.append(LatentSite(index, kind, norm.latent_scale, rank, norm.eps))
                continue
            eps = getattr(norm, "variance_epsilon", LATENT_NORM_EPS)
            gain = norm.weight.detach()
            if stored is None and gain.double().abs().mean().item() < LINEARISED_MIN_GAIN:
                continue  # a real learned norm, not a linearised latent
            alpha = T.latent_scale_of(gain, eps)
            with torch.no_grad():
                proj.weight[:rank].div_(alpha)
                if proj.bias is not None:
                    proj.bias[:rank].div_(alpha)
                gain_tilde = (gain.double() / T.latent_norm_gain(alpha, eps)).to(gain.dtype)
            replacement = UnfoldedLatentNorm(gain_tilde, alpha, eps).to(device=gain.device)
            replacement.weight.requires_grad_(norm.weight.requires_grad)
            setattr(attention, norm_name, replacement)
            sites.append(LatentSite(index, kind, alpha, rank, eps))
    return sites


def fold_latent_scales(state_dict: dict[str, torch.Tensor], sites: list[LatentSite]) -> dict[str, torch.Tensor]:
    """Training-form state dict -> stock stored form (new dict; inputs untouched), with each site's own alpha.

    Exact: the stored norm of the folded tensors computes what `UnfoldedLatentNorm` computed in training.
    Works on a full (gathered) state dict, so it is the same code for one process and FSDP.
    """
    out = dict(state_dict)
    for site in sites:
        alpha = site.latent_scale
        for key in (site.prefix + site.proj + ".weight", site.prefix + site.proj + ".bias"):
            tensor = state_dict.get(key)
            if tensor is None:
                continue
            folded = tensor.double().clone()
            folded[: site.rank] *= alpha  # the latent rows only (kv: the RoPE rows after them are not a latent)
            out[key] = folded.to(tensor.dtype)
        gain_key = site.prefix + site.norm + ".weight"
        gain = state_dict[gain_key]
        out[gain_key] = (gain.double() * T.latent_norm_gain(alpha, site.eps)).to(gain.dtype)
    return out
