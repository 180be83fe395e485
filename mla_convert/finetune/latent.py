"""Bring the linearised latents of a converted model to a trainable scale, and back at save time.

Why: the export stores each latent at a tiny scale alpha (see `convert.target`).  `kv_a_proj_with_mqa`'s
latent rows are alpha * W (alpha ~ 1e-7) and `kv_a_layernorm.weight` = g = sqrt(eps) / alpha (~1e4), so
the stock RMSNorm g * x / sqrt(mean(x^2) + eps) sees mean(x^2) <= 1e-5 eps and returns the unscaled
latent W x.  The same holds for `q_a_proj` / `q_a_layernorm` with a query bias or q_lora.  Adam moves
every weight by ~lr per step: it would wipe weights of size 1e-8 and barely touch gains of size 1e4,
so these tensors cannot be trained as stored.

The reparametrisation.  With x = alpha * c~ (c~ = W~ h, W~ = W / alpha the rows at their natural scale)
and m = mean(c~^2):

    g * x / sqrt(mean(x^2) + eps)  =  g~ * c~ / sqrt(1 + s * m),   g~ = g * alpha / sqrt(eps),  s = alpha^2 / eps.

The converter chose alpha so that s * m <= 1e-5 for EVERY possible input (a bound over all
RMS-normalised inputs, not a calibration maximum), i.e. the stock norm computes g~ * c~ to within
5e-6 relative: the norm-free MLA function the conversion was designed to compute.  Training therefore
divides the latent rows (and their bias) of the down-projection by alpha and replaces the stock norm
with `LinearLatentNorm`, which computes g~ * c~ with a trainable gain g~ (1 after conversion).  Every
trained tensor now has its natural size; the model's function changes by at most that 5e-6
(a test checks the logits), and nothing in training depends on alpha.

Saving folds the scale back: W = alpha' * W~, b = alpha' * b~, g = g~ * sqrt(eps) / alpha', with alpha'
the training alpha unless the trained weights have grown past the same worst-case bound
(`mla_layer.latent_scale_for`, applied to the trained W~, bias and input norm); then alpha' shrinks to
the bound.  Either way s' * m <= 1e-5 for every input again, so the stored stock norm is linear and
the saved model computes the trained function to within 5e-6 relative, in transformers and in any
engine.

Norms that are not linearised (a real DeepSeek checkpoint, gain ~1) are left alone: the test is the
gain's size (`LINEARISED_MIN_GAIN`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..convert import target as T
from ..convert.target import LATENT_NORM_EPS, latent_scale_for

# A stock norm gain this large means the latent was stored at a tiny scale by the converter
# (g = sqrt(1e-6) / alpha >= 10 <=> alpha <= 1e-4; the converter's alphas are ~1e-7 .. 1e-5).
LINEARISED_MIN_GAIN = 10.0
# The saving bound is recomputed from the stored (rounded) weights; a bound this close to the training
# alpha is the same bound, not a need to shrink it.
SCALE_TOLERANCE = 1e-3


class LinearLatentNorm(nn.Module):
    """Training form of a linearised latent RMSNorm: g~ * c~ (what the stock norm computes to 5e-6).

    `weight` is g~ (the name is kept so state-dict keys match the stock model); `latent_scale` (alpha)
    and `eps` are plain attributes, not tensors, so they never enter a checkpoint or an optimizer.
    """

    def __init__(self, gain: torch.Tensor, latent_scale: float, eps: float = LATENT_NORM_EPS):
        super().__init__()
        self.weight = nn.Parameter(gain.detach().clone())
        self.latent_scale = float(latent_scale)
        self.eps = float(eps)

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return self.weight * latent

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


def unfold_latent_scales(model: nn.Module) -> list[LatentSite]:
    """Stock stored form -> training form, in place; the model's function is unchanged.

    Returns the unfolded sites (needed by `fold_latent_scales`).  Idempotent: already unfolded norms
    are reported, not unfolded twice.
    """
    sites: list[LatentSite] = []
    for index, attention in _attention_modules(model):
        for kind, (proj_name, norm_name) in T.LATENT_MODULES.items():
            norm = getattr(attention, norm_name, None)
            if norm is None:
                continue
            proj = getattr(attention, proj_name)
            rank = norm.weight.shape[0]
            if isinstance(norm, LinearLatentNorm):
                sites.append(LatentSite(index, kind, norm.latent_scale, rank, norm.eps))
                continue
            eps = getattr(norm, "variance_epsilon", LATENT_NORM_EPS)
            gain = norm.weight.detach()
            if gain.double().abs().mean().item() < LINEARISED_MIN_GAIN:
                continue  # a real learned norm, not a linearised latent
            alpha = T.latent_scale_of(gain, eps)
            with torch.no_grad():
                proj.weight[:rank].div_(alpha)
                if proj.bias is not None:
                    proj.bias[:rank].div_(alpha)
                gain_tilde = (gain.double() / T.latent_norm_gain(alpha, eps)).to(gain.dtype)
            replacement = LinearLatentNorm(gain_tilde, alpha, eps).to(device=gain.device)
            replacement.weight.requires_grad_(norm.weight.requires_grad)
            setattr(attention, norm_name, replacement)
            sites.append(LatentSite(index, kind, alpha, rank, eps))
    return sites


def saving_scale(site: LatentSite, down: torch.Tensor, bias: torch.Tensor | None, input_norm: torch.Tensor) -> float:
    """alpha' for saving: the training alpha, or smaller if the trained weights need it to stay linear."""
    bound = latent_scale_for(down.double(), input_norm.double(), 0.0 if bias is None else bias.double().norm().item())
    # within rounding of the bound: keep the training alpha, so the saved function is the trained one exactly
    return site.latent_scale if bound >= site.latent_scale * (1 - SCALE_TOLERANCE) else bound


def fold_latent_scales(state_dict: dict[str, torch.Tensor], sites: list[LatentSite]) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Training-form state dict -> stock stored form (new dict; inputs untouched) and the alphas used.

    Works on a full (gathered) state dict, so it is the same code for one process and FSDP.
    """
    out = dict(state_dict)
    scales: list[float] = []
    for site in sites:
        weight_key = site.prefix + site.proj + ".weight"
        bias_key = site.prefix + site.proj + ".bias"
        gain_key = site.prefix + site.norm + ".weight"
        input_norm_key = f"model.layers.{site.layer}.input_layernorm.weight"
        weight = state_dict[weight_key]
        bias = state_dict.get(bias_key)
        down = weight[: site.rank].double()
        latent_bias = None if bias is None else bias[: site.rank].double()
        alpha = saving_scale(site, down, latent_bias, state_dict[input_norm_key])
        folded = weight.double().clone()
        folded[: site.rank] *= alpha
        out[weight_key] = folded.to(weight.dtype)
        if bias is not None:
            folded_bias = bias.double().clone()
            folded_bias[: site.rank] *= alpha
            out[bias_key] = folded_bias.to(bias.dtype)
        gain = state_dict[gain_key]
        out[gain_key] = (gain.double() * T.latent_norm_gain(alpha, site.eps)).to(gain.dtype)
        scales.append(alpha)
    return out, scales
