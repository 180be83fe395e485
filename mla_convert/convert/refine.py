"""Layer-local refinement: a few optimizer steps that pull each converted attention layer towards the source.

The closed-form conversion optimises proxies (weighted reconstruction of keys and values, an estimate of
the RoPE logit error).  What matters is the layer's attention output, so after the closed form we run
a short, deterministic Adam descent on exactly that: || MLA(x) - source_attention(x) ||^2 over the
calibration inputs of the layer, holding out one window to stop before over-fitting.  This is local
(one layer's weights, that layer's calibration inputs), cheap next to fine-tuning, and keeps every
shape, so the export format does not change.

It works on the norm-free form of the weights: the latent is the plain c = W_down x (the tiny export
scale alpha and the linearised kv_a_layernorm are removed before and re-applied after).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import target as T
from .reference import mla_attention

TRAINABLE = (T.Q_PROJ, T.Q_B_PROJ, T.KV_A_PROJ, T.KV_B_PROJ)


@dataclass
class RefineResult:
    weights: dict[str, torch.Tensor]
    error_before: float
    error_after: float
    steps: int


def _strip_latent_scale(weights: dict[str, torch.Tensor], rank: int) -> tuple[dict[str, torch.Tensor], float]:
    """Export form -> norm-free form: divide the latent rows by alpha and drop kv_a_layernorm."""
    alpha = T.latent_scale_of(weights[T.KV_A_NORM][0].item())
    plain = dict(weights)
    kv_a = weights[T.KV_A_PROJ].clone()
    kv_a[:rank] /= alpha
    plain[T.KV_A_PROJ] = kv_a
    del plain[T.KV_A_NORM]
    if T.Q_A_NORM in weights:  # the query latent is linearised the same way
        q_alpha = T.latent_scale_of(weights[T.Q_A_NORM][0].item())
        plain[T.Q_A_PROJ] = weights[T.Q_A_PROJ] / q_alpha
        if T.Q_A_BIAS in weights:
            plain[T.Q_A_BIAS] = weights[T.Q_A_BIAS] / q_alpha
        del plain[T.Q_A_NORM]
    return plain, alpha


def refine_layer(
    weights: dict[str, torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    num_heads: int,
    nope_dim: int,
    rope_dim: int,
    v_dim: int,
    slot_inv_freq: torch.Tensor,
    steps: int = 100,
    lr: float = 1e-3,
    latent_scale_fn=None,
    seed: int = 0,
    batch_windows: int = 2,
    check_every: int = 25,
    patience: int | None = None,
) -> RefineResult:
    """Refine one layer; `inputs` (n, T, d) normalised attention inputs, `targets` (n, T, d) source outputs.

    The last window is held out: the weights with the lowest held-out error are returned (never worse
    than the closed form on that window).  `latent_scale_fn(down)` recomputes alpha for the refined
    down-projection (the linearisation bound depends on it).  `patience`: stop after that many held-out
    checks in a row without a new best (None: run all `steps`).
    """
    rank = weights[T.KV_B_PROJ].shape[1]
    plain, _ = _strip_latent_scale(weights, rank)
    generator = torch.Generator().manual_seed(seed)
    train_x, train_y = inputs[:-1].float(), targets[:-1].float()
    hold_x, hold_y = inputs[-1:].float(), targets[-1:].float()
    params = {k: v.float().clone().requires_grad_(k in TRAINABLE) for k, v in plain.items()}
    trainable = [p for k, p in params.items() if p.requires_grad]
    # per-tensor learning rate relative to the tensor's scale: Adam steps are ~lr in absolute size
    groups = [{"params": [p], "lr": lr * p.detach().pow(2).mean().sqrt().item()} for p in trainable]
    optimizer = torch.optim.Adam(groups, betas=(0.9, 0.99))
    norm_y = train_y.pow(2).mean()
    norm_hold = hold_y.pow(2).mean()

    def held_out_error() -> float:
        with torch.no_grad():
            out = mla_attention(hold_x, params, num_heads, nope_dim, rope_dim, v_dim, slot_inv_freq, latent_norm=False)
            return ((out - hold_y).pow(2).mean() / norm_hold).sqrt().item()

    best_error = before = held_out_error()
    best = {k: v.detach().clone() for k, v in params.items()}
    best_step = 0
    for step in range(1, steps + 1):
        # a few windows per step (seeded): cost per step stays small however many windows are kept
        pick = torch.randperm(train_x.shape[0], generator=generator)[:batch_windows].to(train_x.device)
        optimizer.zero_grad(set_to_none=True)
        out = mla_attention(train_x[pick], params, num_heads, nope_dim, rope_dim, v_dim, slot_inv_freq, latent_norm=False)
        loss = (out - train_y[pick]).pow(2).mean() / norm_y
        loss.backward()
        optimizer.step()
        if step % check_every == 0 or step == steps:
            error = held_out_error()
            if error < best_error:
                best_error, best_step = error, step
                best = {k: v.detach().clone() for k, v in params.items()}
            elif patience is not None and step - best_step >= patience * check_every:
                break
    refined = {k: v.double() for k, v in best.items()}
    for name in (T.Q_A_PROJ, T.Q_A_BIAS, T.Q_A_NORM):
        if name in weights:  # untouched by the optimizer: keep the exported form bit for bit
            refined[name] = weights[name]
    down = refined[T.KV_A_PROJ][:rank]
    alpha = latent_scale_fn(down)
    kv_a = refined[T.KV_A_PROJ].clone()
    kv_a[:rank] *= alpha
    refined[T.KV_A_PROJ] = kv_a
    refined[T.KV_A_NORM] = T.latent_norm_weight(rank, alpha).to(kv_a.device)
    return RefineResult(refined, before, best_error, best_step)
