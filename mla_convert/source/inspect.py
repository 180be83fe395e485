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


ESTIMATE_DEVICES = ("cpu", "cuda")


def estimate_problems(estimate: bool, device: str | None, cpu_cores: int | None, options) -> list[str]:
    """Every problem with the `inspect --estimate` flags, one line each (a flag that would change nothing is one too)."""
    from ..options import ConvertOptions, option_problems

    problems = option_problems(options) if options is not None else []
    if device is not None and device not in ESTIMATE_DEVICES:
        problems.append(f"--device {device!r}: the estimate knows cpu and cuda (cuda: one NVIDIA H200, the GPU it was fitted on)")
    if cpu_cores is not None and cpu_cores < 1:
        problems.append(f"--cpu-cores {cpu_cores}: must be at least 1")
    if cpu_cores is not None and device == "cuda":
        problems.append("--cpu-cores: only with --device cpu (the cuda estimate is for the fitted GPU machine)")
    if not estimate:
        given = [flag for flag, value in (("--device", device), ("--cpu-cores", cpu_cores)) if value is not None]
        given += changed_flags(options, ConvertOptions()) if options is not None else []
        if given:
            problems.append(f"{', '.join(given)}: only change the cost estimate; add --estimate")
    return problems


def changed_flags(options, defaults) -> list[str]:
    """Flags of the option fields whose values differ from `defaults` (nested dataclasses included)."""
    import dataclasses

    flags = []
    for spec in dataclasses.fields(options):
        value, default = getattr(options, spec.name), getattr(defaults, spec.name)
        if dataclasses.is_dataclass(value):
            flags += changed_flags(value, default)
        elif value != default:
            flags.append(spec.metadata.get("flag") or "--" + spec.name.replace("_", "-"))
    return flags
