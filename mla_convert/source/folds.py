"""Read a family that differs from Llama only by linear changes as the Llama it equals.

Two such differences are folded into the weights, so calibration, the streamed source forward and the export all see
a Llama (the reader applies them to every read: `CheckpointReader.fold`), and the export - stock DeepseekV3, which has
neither - computes the source's logits.

Activation multipliers (Granite): embeddings x e, each attention and MLP output x r before the residual add, softmax
scale a instead of head_dim ** -0.5, logits / L.  Each multiplies a linear function:

* embed_tokens x e: the residual stream starts scaled, as in the source.
* q_proj (weight and bias) x a * sqrt(head_dim): Llama's scale head_dim ** -0.5 then gives a.
* o_proj and down_proj (weights and biases) x r: the block outputs are scaled before the add.
* the final norm's weight x 1 / L, and also x 1 / e when the head is tied to the (now scaled) embeddings: the
  logits are linear in it.

Adjacent-pair RoPE (ERNIE 4.5, Helium): dimensions (2i, 2i + 1) of a head rotate together by frequency i, where
Llama rotates (i, i + d/2).  Reordering the rows of q_proj and k_proj (weights and biases) within each head - the
even rows first, then the odd ones - turns one into the other, and q . k is unchanged (both move alike).
"""

from __future__ import annotations

import math

import torch

from ..io.reader import Fold, split_row_view
from .config import SourceConfig

MULTIPLIED_ROLES = ("q_weight", "q_bias", "o_weight", "o_bias", "down_weight", "down_bias")
REORDERED_ROLES = ("q_weight", "q_bias", "k_weight", "k_bias")


def source_folds(source: SourceConfig) -> dict[str, Fold]:
    """Stored tensor name -> how its reads are changed (empty for a family that is Llama as stored)."""
    scales = folded_weight_scales(source)
    orders = rotate_half_row_orders(source)
    return {name: Fold(scale=scales.get(name, 1.0), row_order=orders.get(name)) for name in {*scales, *orders}}


def folded_weight_scales(source: SourceConfig) -> dict[str, float]:
    """Stored tensor name -> the factor its reads are multiplied by (Granite's multipliers; else empty)."""
    m = source.multipliers
    if not m:
        return {}
    arch = source.architecture
    query = m["attention"] * math.sqrt(source.head_dim)
    head = 1.0 / (m["logits_divisor"] * (m["embedding"] if source.tied_embeddings else 1.0))
    scales = {arch.embed: m["embedding"], arch.final_norm: head}
    factors = dict(zip(MULTIPLIED_ROLES, (query, query, *[m["residual"]] * 4)))
    for layer in range(source.num_layers):
        scales.update({name: factors[role] for role, name in _stored_roles(source, layer, MULTIPLIED_ROLES).items()})
    return {name: factor for name, factor in scales.items() if factor != 1.0}


def rotate_half_row_order(num_heads: int, head_dim: int) -> torch.Tensor:
    """Row order that turns adjacent-pair RoPE rows into rotate-half rows: per head, its even rows, then its odd."""
    within = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])  # (head_dim,)
    return (torch.arange(num_heads)[:, None] * head_dim + within).reshape(-1)  # (num_heads * head_dim,)


def rotate_half_row_orders(source: SourceConfig) -> dict[str, torch.Tensor]:
    """Stored q/k projection name -> its row order, for a family that rotates adjacent pairs (else empty)."""
    if not source.architecture.interleaved_rope:
        return {}
    heads = {"q": source.num_heads, "k": source.num_kv_heads}
    return {name: rotate_half_row_order(heads[role[0]], source.head_dim)
            for layer in range(source.num_layers)
            for role, name in _stored_roles(source, layer, REORDERED_ROLES).items()}


def _stored_roles(source: SourceConfig, layer: int, roles: tuple[str, ...]) -> dict[str, str]:
    """The stored names of `roles` in one layer (those it has); a fold applies to a whole stored tensor."""
    names = {**source.attention_weight_names(layer), **source.mlp_weight_names(layer)}
    found = {role: names[role] for role in roles if role in names}
    for name in found.values():
        if split_row_view(name) is not None:  # a fused matrix would need its rows folded apart
            raise ValueError(f"{source.architecture.family}: cannot fold {name}, rows of a fused matrix")
    return found


def family_notes(source: SourceConfig) -> list[str]:
    """What the export does about what DeepseekV3 lacks (said by convert's pre-flight and by inspect on a source):
    the folds above, and layers that attend without RoPE."""
    notes = []
    if source.multipliers:
        values = ", ".join(f"{key} {value:g}" for key, value in source.multipliers_by_config_key.items())
        notes.append(f"the source scales its activations by {values}; DeepseekV3 has no such settings, so the export "
                     "folds each into the weights it multiplies (the same function)")
    if source.architecture.interleaved_rope:
        notes.append("the source rotates adjacent dimension pairs of each head; the conversion reads its query and key "
                     "rows reordered into DeepseekV3's halves (no attention score changes)")
    if source.nope_layers:
        notes.append(f"{len(source.nope_layers)} of the {source.num_layers} layers attend without RoPE; the export gives "
                     "them zero RoPE rows, so the latent holds their whole key")
    return notes
