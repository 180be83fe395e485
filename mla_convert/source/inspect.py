"""`mla-convert inspect`: what the source attention is and what an MLA shape would cache."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import PreflightError
from ..units import human_bytes
from .config import SourceConfig
from .shapes import CacheCost, MLAShape, cache_costs, pick_target_shape, ratio_of, shape_problems, target_shapes


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

    @property
    def source_cached_tokens(self) -> int:
        """Tokens the source caches per sequence at `context`: a sliding window keeps at most its window."""
        window = self.source.sliding_window
        return min(self.context, window) if window else self.context

    def notes(self) -> list[str]:
        """What the table's "cache for N tokens" row needs said: a window that caps the source's cache, and positions
        the export does not declare (it attends to every position, so a windowed source's export declares the window)."""
        notes = []
        if self.source.sliding_window and self.context > self.source.sliding_window:
            notes.append(f"the source slides its attention over {self.source.sliding_window} tokens, so it caches at most "
                         f"that many per sequence (counted so above); the export attends to every position and declares "
                         f"max_position_embeddings {self.source.export_max_positions}, the context where the two agree")
        if self.context > self.source.export_max_positions and not self.source.sliding_window:
            notes.append(f"--context {self.context} is longer than the model's max_position_embeddings "
                         f"{self.source.export_max_positions}, which the export keeps")
        return notes

    def rows(self) -> list[tuple[str, str, str]]:
        """(quantity, source, MLA) rows for the before/after table."""
        s, m = self.source_cost, self.mla_cost
        tokens = self.context * self.batch
        windowed = self.source_cached_tokens != self.context
        source_cache = human_bytes(s.bytes_for(self.source_cached_tokens, self.batch))
        return [
            ("cached values / token / layer", f"{s.values_per_token_layer}", f"{m.values_per_token_layer}"),
            ("bytes / token / layer", f"{s.bytes_per_token_layer}", f"{m.bytes_per_token_layer}"),
            ("bytes / token (all layers)", human_bytes(s.bytes_per_token), human_bytes(m.bytes_per_token)),
            (f"cache for {self.context} tokens x batch {self.batch}",
             source_cache + (f" ({self.source_cached_tokens}-token window)" if windowed else ""),
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
    target: str | None = None,
) -> InspectReport:
    mla = pick_target_shape(source, target, kv_lora_rank, rope_dim, compression)
    problems = shape_problems(source, mla.kv_lora_rank, mla.rope_dim)
    if problems:  # one line each, as convert's pre-flight prints them
        raise PreflightError(problems)
    source_cost, mla_cost = cache_costs(source, mla, dtype)
    return InspectReport(source, mla, dtype, context, batch, source_cost, mla_cost)


def target_rows(source: SourceConfig) -> list[tuple[str, str, str]]:
    """(target, the shapes it allows for this source, their KV ratios and the llama.cpp q8_0 KV-cache rule) per target."""
    from ..convert.engines import rope_problems
    from ..convert.target import TARGETS

    rows = []
    for target in TARGETS.values():
        allowed = target_shapes(source, target)
        refused = rope_problems(target, source.rope_parameters)
        if refused:  # convert refuses this source for the target whatever the shape
            rows.append((target.name, f"none: convert refuses this source's {refused[0].split(':')[0]} (the target's engine "
                                      "cannot run it as declared, measured)", "-"))
            continue
        if allowed is None:
            shapes = f"any: kv_lora_rank <= {source.max_kv_lora_rank}, even rope_dim <= {source.max_rope_dim}"
            # from the widest shape allowed (full rank + the widest RoPE key: below 1x for MQA) to the narrowest (2+... = 3)
            widest = source.max_kv_lora_rank + source.max_rope_dim
            ratios = f"{source.kv_values_per_token_layer / widest:.2f}x to {source.kv_values_per_token_layer / 3:.1f}x"
        else:
            shapes = ", ".join(f"{m.kv_lora_rank}+{m.rope_dim}" for m in allowed) or \
                f"none (kv_lora_rank + rope_dim must be one of {', '.join(map(str, target.widths))})"
            ratios = ", ".join(f"{ratio_of(source, m):.2f}x" for m in allowed) or "-"
        if target.quantized_kv_block:
            block = target.quantized_kv_block
            ropes = [d for d in range(block, source.max_rope_dim + 1, block)]
            ranks = source.max_kv_lora_rank // block * block
            if allowed is not None:
                ok = [m for m in allowed if target.quantized_kv_problem(m.kv_lora_rank, m.rope_dim) is None]
                rule = f"q8_0 KV cache: {', '.join(f'{m.kv_lora_rank}+{m.rope_dim}' for m in ok) or 'none'}"
            elif ropes and ranks:
                rule = (f"q8_0 KV cache only with kv_lora_rank and rope_dim multiples of {block}: rope_dim "
                        f"{' or '.join(map(str, ropes))}, kv_lora_rank {block}..{ranks}")
            else:
                rule = f"q8_0 KV cache impossible (needs rope_dim and kv_lora_rank multiples of {block}; rope_dim <= {source.max_rope_dim})"
            ratios += f"; {rule}"
        rows.append((target.name, shapes, ratios))
    return rows


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
        # --target also picks the shapes inspect shows, so it stands alone
        given += changed_flags(options, ConvertOptions(target=options.target)) if options is not None else []
        if given:
            problems.append(f"{', '.join(given)}: only change the cost estimate; add --estimate")
    return problems


def estimate_source_problems(source: SourceConfig, options, kv_lora_rank: int | None = None, rope_dim: int | None = None,
                             compression: float | None = None, local_folder: Path | None = None) -> list[str]:
    """What `convert` would refuse in these options for this source (from its config, and its files when it is a
    local folder): a query rank it cannot take, a RoPE the target's engine computes wrongly, calibration windows past
    its positions, a local calibration text that is missing or unreadable, or one the folder has no tokenizer for.  (A hub id is resolved to its config
    alone, so its tokenizer files are not there to check.)"""
    from ..convert.preflight import (
        calibration_length_problems,
        calibration_problems,
        local_text_problems,
        target_rope_problems,
    )
    from ..errors import MLAConvertError, PreflightError
    from .shapes import shape_problems

    problems = calibration_length_problems(source, options.calibration) + target_rope_problems(source, options.target)
    if options.calibration.data is not None and local_folder is not None:
        problems += calibration_problems(local_folder, options.calibration)
    elif options.calibration.data is not None:
        problems += local_text_problems(options.calibration.data, options.calibration.text_column)
    if options.q_lora_rank is not None:
        try:
            mla = pick_target_shape(source, options.target, kv_lora_rank, rope_dim, compression, options.q_lora_rank)
            problems += shape_problems(source, mla.kv_lora_rank, mla.rope_dim, mla.q_lora_rank)
        except PreflightError as error:
            problems += error.problems
        except MLAConvertError as error:
            problems.append(str(error))
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
