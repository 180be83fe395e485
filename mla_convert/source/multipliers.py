"""Fold a family's activation multipliers (Granite's four config scalars) into the weights they scale.

Granite computes Llama's layers with four extra scalars: embeddings x e, each attention and MLP output x r before
the residual add, softmax scale a instead of head_dim ** -0.5, logits / L.  Each multiplies a linear function, so
weights scaled once compute the same numbers:

* embed_tokens x e: the residual stream starts scaled, as in the source.
* q_proj (weight and bias) x a * sqrt(head_dim): Llama's scale head_dim ** -0.5 then gives a.
* o_proj and down_proj (weights and biases) x r: the block outputs are scaled before the add.
* the final norm's weight x 1 / L, and also x 1 / e when the head is tied to the (now scaled) embeddings: the
  logits are linear in it.

The reader applies the factors to every read (`CheckpointReader.fold_scales`), so calibration, the streamed source
forward and the export all see the Llama that equals the source, and the export (stock DeepseekV3, no such scalars)
computes the source's logits.
"""

from __future__ import annotations

import math

from ..io.reader import split_row_view
from .config import SourceConfig


def folded_weight_scales(source: SourceConfig) -> dict[str, float]:
    """Stored tensor name -> the factor its reads are multiplied by (empty for a family without multipliers)."""
    m = source.multipliers
    if not m:
        return {}
    arch = source.architecture
    query = m["attention"] * math.sqrt(source.head_dim)
    head = 1.0 / (m["logits_divisor"] * (m["embedding"] if source.tied_embeddings else 1.0))
    scales = {arch.embed: m["embedding"], arch.final_norm: head}
    for layer in range(source.num_layers):
        names = {**source.attention_weight_names(layer), **source.mlp_weight_names(layer)}
        for role, factor in (("q_weight", query), ("q_bias", query), ("o_weight", m["residual"]),
                             ("o_bias", m["residual"]), ("down_weight", m["residual"]), ("down_bias", m["residual"])):
            if role in names:
                if split_row_view(names[role]) is not None:  # a fused matrix would need its rows scaled apart
                    raise ValueError(f"{arch.family}: cannot fold a multiplier into {names[role]}, rows of a fused matrix")
                scales[names[role]] = factor
    return {name: factor for name, factor in scales.items() if factor != 1.0}
