"""Attention shapes of the source and the MLA target, and what their KV caches cost.

Everything here is arithmetic on configs; it never touches weights, so `inspect` and the pre-flight
checks answer instantly even for a model that is still on the hub.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..convert.target import DEEPSEEK_KV_LORA_RANK, DEEPSEEK_ROPE_DIM, Target, target_of
from ..errors import InvalidShapeError, PreflightError
from ..units import dtype_bytes
from .config import SourceConfig


@dataclass(frozen=True)
class MLAShape:
    kv_lora_rank: int
    rope_dim: int
    q_lora_rank: int | None = None

    @property
    def kv_values_per_token_layer(self) -> int:
        """The MLA cache holds the latent and the one shared RoPE key per token and layer."""
        return self.kv_lora_rank + self.rope_dim


def shape_problems(source: SourceConfig, kv_lora_rank: int | None, rope_dim: int | None,
                   q_lora_rank: int | None = None) -> list[str]:
    """Every reason the requested MLA shape cannot be built from `source` (empty when it can)."""
    problems = []
    if q_lora_rank is not None:
        if q_lora_rank <= 0:
            problems.append(f"--q-lora-rank {q_lora_rank}: must be positive")
        elif q_lora_rank > source.max_q_lora_rank:
            bias = " + 1 channel for the query bias" if source.query_bias_channel else ""
            problems.append(f"--q-lora-rank {q_lora_rank}: larger than the source allows (at most {source.max_q_lora_rank} "
                            f"= hidden_size {source.hidden_size}{bias}: the query latent is computed from the "
                            f"{source.hidden_size}-wide input)")
    if rope_dim is not None:
        if rope_dim <= 0:
            problems.append(f"--rope-dim {rope_dim}: must be a positive even number")
        elif rope_dim % 2:
            problems.append(f"--rope-dim {rope_dim}: must be even (RoPE rotates pairs of dimensions)")
        elif rope_dim > source.max_rope_dim:
            problems.append(
                f"--rope-dim {rope_dim}: larger than the source head_dim {source.head_dim}; "
                f"at most {source.max_rope_dim} dimensions can carry RoPE"
            )
    if kv_lora_rank is not None:
        if kv_lora_rank <= 0:
            problems.append(f"--kv-lora-rank {kv_lora_rank}: must be positive")
        elif kv_lora_rank > source.max_kv_lora_rank:
            problems.append(
                f"--kv-lora-rank {kv_lora_rank}: larger than the source allows (at most {source.max_kv_lora_rank} = "
                f"min(2 x {source.num_kv_heads} kv heads x head_dim {source.head_dim}, hidden size {source.hidden_size}))"
            )
    return problems


def check_mla_shape(source: SourceConfig, kv_lora_rank: int, rope_dim: int, q_lora_rank: int | None = None) -> MLAShape:
    problems = shape_problems(source, kv_lora_rank, rope_dim, q_lora_rank)
    if problems:
        raise InvalidShapeError("; ".join(problems))
    return MLAShape(kv_lora_rank, rope_dim, q_lora_rank)


def rope_share(budget: int, head_dim: int) -> float:
    """Fraction of the cache budget to give the shared RoPE key, from measurements (one-shot perplexity).

    The tighter the budget relative to head_dim, the larger the share that pays: SmolLM2 (head_dim 64)
    was best at 144+48 for a 192 budget (0.25; 128+64 and 160+32 worse), 64+32 for 96 (0.33; 72+24
    worse); stories260K (head_dim 8) at 24+8 for 32, 10+6 for 16 (0.375; 12+4 and 8+8 worse), 4+4 for 8
    (0.5).  0.5 * (budget / head_dim)^-0.5 fits all of them; never more than half the budget.
    """
    return min(0.5, 0.5 * (budget / head_dim) ** -0.5)


def check_compression(compression: float) -> None:
    """A ratio of at least 1 and finite, worded as `convert`'s option check words it (NaN and inf are named as such,
    not as "must be at least 1" or "leaves 0 cached values")."""
    if not math.isfinite(compression):
        raise InvalidShapeError(f"--compression {compression}: must be a finite number")
    if not compression >= 1:
        # Below 1 the MLA cache would be larger than the source's; the rank cap makes it unreachable anyway.
        raise InvalidShapeError(
            f"--compression {compression}: must be at least 1 (how many times smaller the MLA cache is than the source's)")


def shape_for_compression(source: SourceConfig, compression: float) -> MLAShape:
    """Pick (kv_lora_rank, rope_dim) so the cache is `compression` times smaller than the source's.

    rope_dim is `rope_share(...)` of the budget, rounded to a multiple of head_dim / 4 (at least 2),
    capped at the source head_dim, DeepSeek's 64 and half the budget; the rest is the latent.
    """
    check_compression(compression)
    values = source.kv_values_per_token_layer
    budget = int(round(values / compression))
    if budget < 3:
        # the limit is where the budget rounds to 3 (it said "at most values / 3", 21.3 for stories260K, while
        # 22 and 25 were accepted, rounded to the 3-value shape): below values / 2.5 (round(2.5) is 2)
        raise InvalidShapeError(
            f"--compression {compression:g}: leaves {budget} cached values per token and layer (at least 3: a latent and "
            f"a 2-dimensional RoPE key); the source caches {values}, so the ratio must be below {values / 2.5:g} "
            f"(the smallest cache, 3 values, is {values / 3:.2f}x)"
        )
    unit = max(2, source.head_dim // 4 - (source.head_dim // 4) % 2)
    ceiling = min(source.head_dim, DEEPSEEK_ROPE_DIM, budget // 2)
    rope_dim = unit * max(1, round(rope_share(budget, source.head_dim) * budget / unit))
    while rope_dim > ceiling and rope_dim > 2:
        rope_dim -= unit if rope_dim - unit >= 2 else 2
    rope_dim = max(2, rope_dim - rope_dim % 2)
    rank = min(budget - rope_dim, source.max_kv_lora_rank)
    return check_mla_shape(source, rank, rope_dim)


def default_shape(source: SourceConfig) -> MLAShape:
    """DeepSeek's 512+64 when the source caches enough to make it a real saving, else a 2x compression."""
    deepseek = DEEPSEEK_KV_LORA_RANK + DEEPSEEK_ROPE_DIM
    if (
        source.kv_values_per_token_layer >= 2 * deepseek
        and source.max_kv_lora_rank >= DEEPSEEK_KV_LORA_RANK
        and source.head_dim >= DEEPSEEK_ROPE_DIM
    ):
        return MLAShape(DEEPSEEK_KV_LORA_RANK, DEEPSEEK_ROPE_DIM)
    return shape_for_compression(source, 2.0)


def pick_shape(source: SourceConfig, kv_lora_rank: int | None = None, rope_dim: int | None = None,
               compression: float | None = None, q_lora_rank: int | None = None) -> MLAShape:
    """The MLA shape asked for: from `compression`, from the ranks given (the default fills in what is
    missing), or the default.  Raises `PreflightError` / `InvalidShapeError` naming the flag at fault."""
    if compression is not None:
        if kv_lora_rank is not None or rope_dim is not None:
            raise PreflightError(["--compression picks --kv-lora-rank and --rope-dim; give either the ratio or the ranks"])
        mla = shape_for_compression(source, compression)
    elif kv_lora_rank is None or rope_dim is None:
        try:
            fallback = default_shape(source)
        except InvalidShapeError as error:  # say where the "--compression 2.0" comes from: the user never typed it
            raise PreflightError([f"the default MLA shape (--compression 2.0) does not fit this source: {error}; "
                                  "give --kv-lora-rank and --rope-dim"]) from error
        mla = MLAShape(kv_lora_rank if kv_lora_rank is not None else fallback.kv_lora_rank,
                       rope_dim if rope_dim is not None else fallback.rope_dim)
    else:
        mla = MLAShape(kv_lora_rank, rope_dim)
    return MLAShape(mla.kv_lora_rank, mla.rope_dim, q_lora_rank)


# --------------------------------------------------------------------------- shapes a serving target allows
def target_width_shape(source: SourceConfig, width: int, target: Target) -> MLAShape | None:
    """The shape of one allowed width: DeepSeek's rope 64 (or the source head_dim, if smaller), the rest latent.

    Where the target has a quantised-KV rule, a rope_dim that keeps both sizes multiples of its block wins;
    a width the source cannot fill (latent rank above its maximum) or that would not shrink the cache gives None.
    """
    preferred = min(DEEPSEEK_ROPE_DIM, source.max_rope_dim)
    preferred -= preferred % 2
    candidates = sorted(range(2, preferred + 1, 2), key=lambda d: (
        target.quantized_kv_problem(width - d, d) is not None, abs(d - preferred)))
    for rope_dim in candidates:
        rank = width - rope_dim
        if rank <= 0 or shape_problems(source, rank, rope_dim):
            continue
        if source.kv_values_per_token_layer < width:  # a bigger cache than the source's is no conversion
            return None
        return MLAShape(rank, rope_dim)
    return None


def target_shapes(source: SourceConfig, target: Target) -> list[MLAShape] | None:
    """Every shape `target` allows for this source, smallest compression first (None: any shape)."""
    if target.widths is None:
        return None
    shapes = [shape for shape in (target_width_shape(source, width, target) for width in sorted(target.widths, reverse=True))
              if shape is not None]
    return shapes


def ratio_of(source: SourceConfig, mla: MLAShape) -> float:
    return source.kv_values_per_token_layer / mla.kv_values_per_token_layer


def describe_shapes(source: SourceConfig, shapes: list[MLAShape]) -> str:
    return ", ".join(f"{m.kv_lora_rank}+{m.rope_dim} ({ratio_of(source, m):.2f}x)" for m in shapes) or "none"


def _any_shape_targets(source: SourceConfig) -> list[str]:
    """The targets that serve any shape and do not refuse this source's RoPE (the advice named llama.cpp for a linear
    source that --target llama.cpp refuses).  A serving target removes attention biases and refuses a layer where
    that costs too much, which only the conversion measures: for a biased source it is named with that condition
    (the advice sent a real Qwen2.5-0.5B to llama.cpp, which then refused it)."""
    from ..convert.engines import rope_problems
    from ..convert.target import TARGETS

    names = []
    for target in TARGETS.values():
        if target.widths is None and not rope_problems(target, source.rope_parameters):
            biased = target.serving and (source.qkv_bias or source.o_bias)
            names.append(f"{target.name} (which removes this source's attention biases, and refuses where that costs "
                         "too much)" if biased else target.name)
    return names


# what a source caches per token and layer at 7B scale (Qwen2.5-7B: 4 kv heads x 128 x 2; Llama-3-8B and Mistral-7B: 2,048)
SEVEN_B_CLASS_VALUES = 1024


def no_shape_fits_problem(source: SourceConfig, target: Target) -> str:
    """Why none of a width-limited target's shapes serves this source, in its real terms.

    Usually every width the target serves is wider than what the source caches: the export would cache more than the
    source, which is no conversion.  (Listing the source's maximum kv_lora_rank and rope_dim instead read as a
    contradiction: 256 + 64 = 320 is on vLLM's list, yet 320 values exceed the 256 a small Qwen2 caches.)"""
    values, widths = source.kv_values_per_token_layer, sorted(target.widths)
    advice = f"use --target {' or '.join(_any_shape_targets(source))}"
    if widths[0] > values:
        return (f"--target {target.name}: every KV-cache width it serves ({', '.join(map(str, widths))} values per token and "
                f"layer{target.widths_note}) is more than the {values} this source caches, so the export's cache would be "
                f"larger than the source's, not smaller; it pays off for sources caching more than {widths[0]} (7B-class "
                f"models cache {SEVEN_B_CLASS_VALUES:,} or more); {advice}")
    return (f"--target {target.name}: no shape this target serves fits this source (kv_lora_rank + rope_dim must be one of "
            f"{', '.join(map(str, widths))}{target.widths_note}, at most the {values} values per token and layer the source "
            f"caches, with kv_lora_rank <= {source.max_kv_lora_rank} and an even rope_dim <= {source.max_rope_dim}); {advice}")


def pick_target_shape(source: SourceConfig, target: Target | str | None, kv_lora_rank: int | None = None,
                      rope_dim: int | None = None, compression: float | None = None,
                      q_lora_rank: int | None = None) -> MLAShape:
    """`pick_shape` under a target's width rule.

    --compression X picks the allowed shape with the smallest ratio at or above X (the best quality that
    reaches X), or the one closest to X when none reaches it; no shape options pick the default when the
    target allows it, else as --compression 2.  Explicit ranks outside the target are an error naming the
    shapes it allows for this source.
    """
    target = target_of(target) if not isinstance(target, Target) else target
    allowed = target_shapes(source, target)
    if allowed is None:
        return pick_shape(source, kv_lora_rank, rope_dim, compression, q_lora_rank)
    explicit = kv_lora_rank is not None or rope_dim is not None
    if explicit or not allowed:
        if compression is not None and explicit:
            raise PreflightError(["--compression picks --kv-lora-rank and --rope-dim; give either the ratio or the ranks"])
        if not allowed:
            raise PreflightError([no_shape_fits_problem(source, target)])
        mla = pick_shape(source, kv_lora_rank, rope_dim, None, q_lora_rank)
        problem = target.width_problem(mla.kv_lora_rank, mla.rope_dim)
        if problem:
            flags = " ".join(f"{flag} {value}" for flag, value in (("--kv-lora-rank", kv_lora_rank), ("--rope-dim", rope_dim))
                             if value is not None)
            raise PreflightError([f"--target {target.name} {flags}: {problem}; this model allows {describe_shapes(source, allowed)}"])
        return mla
    if compression is None:
        try:
            fallback = default_shape(source)
        except InvalidShapeError:
            fallback = None
        if fallback is not None and target.width_problem(fallback.kv_lora_rank, fallback.rope_dim) is None:
            return MLAShape(fallback.kv_lora_rank, fallback.rope_dim, q_lora_rank)
        compression = 2.0
    check_compression(compression)
    reaching = [m for m in allowed if ratio_of(source, m) >= compression * (1 - 1e-9)]
    if reaching:
        mla = min(reaching, key=lambda m: ratio_of(source, m))
    else:
        mla = max(allowed, key=lambda m: ratio_of(source, m))
    return MLAShape(mla.kv_lora_rank, mla.rope_dim, q_lora_rank)


def shape_choice_note(source: SourceConfig, target: Target | str | None, mla: MLAShape, compression: float | None) -> str | None:
    """Why the shape differs from the ratio asked for (None when it does not, or no ratio was asked).

    Any target: a ratio is met in whole cached values per token and layer, so e.g. 25x of stories260K's 64 values
    is 3 values, 21.33x; the note says so whenever the ratio got differs from the one asked as both print
    (two decimals), or a sweep row labelled 25x beside a 21.33x cache reads as a mistake.
    """
    target = target_of(target) if not isinstance(target, Target) else target
    allowed = target_shapes(source, target)
    got = ratio_of(source, mla)
    if allowed is None:
        if compression is None or f"{got:.2f}" == f"{compression:.2f}":
            return None
        return (f"asked {compression:g}x, got {mla.kv_lora_rank}+{mla.rope_dim} = {got:.2f}x (the cache holds whole "
                f"values: {mla.kv_values_per_token_layer} per token and layer of the source's {source.kv_values_per_token_layer})")
    if compression is None:
        try:
            fallback = default_shape(source)
        except InvalidShapeError:
            fallback = None
        if fallback is not None and (fallback.kv_lora_rank, fallback.rope_dim) == (mla.kv_lora_rank, mla.rope_dim):
            return None
    asked = 2.0 if compression is None else compression
    if abs(got - asked) <= 1e-9 * asked:
        return None
    how = "the closest" if got < asked * (1 - 1e-9) else "the smallest at or above it"
    return (f"--target {target.name} allows {describe_shapes(source, allowed)} for this model; asked "
            f"{asked:g}x{' (the default)' if compression is None else ''}, got {mla.kv_lora_rank}+{mla.rope_dim} = "
            f"{got:.2f}x ({how})")


@dataclass(frozen=True)
class CacheCost:
    """KV-cache size of one model for a given context, batch and dtype.  `window`: the tokens a sliding layer keeps at
    most, in `sliding_layers` of the `num_layers` (None: every layer, where there is a window); the other layers keep
    every token."""

    values_per_token_layer: int
    num_layers: int
    dtype: torch.dtype
    window: int | None = None
    sliding_layers: int | None = None

    @property
    def bytes_per_token_layer(self) -> int:
        return self.values_per_token_layer * dtype_bytes(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token takes in every layer (a sliding layer's too, up to its window)."""
        return self.bytes_per_token_layer * self.num_layers

    @property
    def windowed_layers(self) -> int:
        """Layers whose cache the window caps (0: no window)."""
        if not self.window:
            return 0
        return self.num_layers if self.sliding_layers is None else min(self.sliding_layers, self.num_layers)

    def bytes_for(self, context: int, batch: int = 1) -> int:
        """The cache after `context` tokens: a sliding layer holds at most its window of them, the others all."""
        sliding = self.windowed_layers
        capped = min(context, self.window) if sliding else context
        return self.bytes_per_token_layer * batch * ((self.num_layers - sliding) * context + sliding * capped)

    def window_label(self, context: int) -> str:
        """What the cache row says after the source's bytes at `context` when a window caps them: " (16-token
        window)", or " (16-token window in 1 of 2 layers)" when only some layers slide; "" otherwise."""
        sliding = self.windowed_layers
        if not sliding or context <= self.window:
            return ""
        layers = f" in {sliding} of {self.num_layers} layers" if sliding < self.num_layers else ""
        return f" ({self.window}-token window{layers})"

    def max_context(self, memory_bytes: int, batch: int = 1) -> int:
        """Largest context whose cache fits `memory_bytes` at this batch size (every token in every layer: a window
        is not counted)."""
        return memory_bytes // (self.bytes_per_token * batch)


def cache_costs(source: SourceConfig, mla: MLAShape, dtype: torch.dtype) -> tuple[CacheCost, CacheCost]:
    return (
        CacheCost(source.kv_values_per_token_layer, source.num_layers, dtype, source.sliding_window, source.sliding_layers),
        CacheCost(mla.kv_values_per_token_layer, source.num_layers, dtype),
    )
