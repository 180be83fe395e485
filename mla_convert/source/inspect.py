"""`mla-convert inspect`: what the source attention is and what an MLA shape would cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..units import human_bytes
from .config import SourceConfig
from .shapes import CacheCost, MLAShape, cache_costs, check_mla_shape, pick_shape


@dataclass(frozen=True)
class InspectReport:
    source: SourceConfig
    mla: MLAShape
    dtype: torch.dtype
    context: int
    batch: int
    source_cost: CacheCost
    mla_cost: CacheCost

    @property
    def ratio(self) -> float:
        return self.source_cost.values_per_token_layer / self.mla_cost.values_per_token_layer

    def rows(self) -> list[tuple[str, str, str]]:
        """(quantity, source, MLA) rows for the before/after table."""
        s, m = self.source_cost, self.mla_cost
        tokens = self.context * self.batch
        return [
            ("cached values / token / layer", f"{s.values_per_token_layer}", f"{m.values_per_token_layer}"),
            ("bytes / token / layer", f"{s.bytes_per_token_layer}", f"{m.bytes_per_token_layer}"),
            ("bytes / token (all layers)", human_bytes(s.bytes_per_token), human_bytes(m.bytes_per_token)),
            (f"cache for {self.context} tokens x batch {self.batch}", human_bytes(s.bytes_for(self.context, self.batch)),
             human_bytes(m.bytes_for(self.context, self.batch))),
            ("tokens cached per GiB", f"{(1 << 30) // s.bytes_per_token:,}", f"{(1 << 30) // m.bytes_per_token:,}"),
        ] if tokens else []


def inspect_shapes(
    source: SourceConfig,
    kv_lora_rank: int | None = None,
    rope_dim: int | None = None,
    compression: float | None = None,
    dtype: torch.dtype = torch.bfloat16,
    context: int = 4096,
    batch: int = 1,
) -> InspectReport:
    mla = pick_shape(source, kv_lora_rank, rope_dim, compression)
    mla = check_mla_shape(source, mla.kv_lora_rank, mla.rope_dim)
    source_cost, mla_cost = cache_costs(source, mla, dtype)
    return InspectReport(source, mla, dtype, context, batch, source_cost, mla_cost)
