"""Attention shapes of the source and the MLA target, and what their KV caches cost.

Everything here is arithmetic on configs; it never touches weights, so `inspect` and the pre-flight
checks answer instantly even for a model that is still on the hub.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .architectures import ArchitectureSpec, architecture_for_config, tied_embeddings
from ..errors import CheckpointError, InvalidShapeError

DEEPSEEK_KV_LORA_RANK = 512
DEEPSEEK_ROPE_DIM = 64

_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    if name is None:
        return default
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPE_NAMES[str(name).lower().replace("torch.", "")]
    except KeyError as error:
        raise InvalidShapeError(f"unknown dtype {name!r}; use one of bf16, fp16, fp32") from error


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class SourceShape:
    """The attention facts of a source model that the conversion and the cache math need."""

    architecture: ArchitectureSpec
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tied_embeddings: bool
    rope_parameters: dict
    rms_norm_eps: float
    max_position_embeddings: int
    torch_dtype: torch.dtype

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "SourceShape":
        """Read the shape from a parsed `config.json`; `preflight` reports inconsistent values first."""
        arch = architecture_for_config(config)
        hidden = _config_int(config, "hidden_size")
        heads = _config_int(config, "num_attention_heads")
        kv_heads = _config_int(config, "num_key_value_heads", default=heads)
        head_dim = _config_int(config, "head_dim", default=hidden // heads if heads > 0 else 0)
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_layers=_config_int(config, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=_config_int(config, "vocab_size"),
            intermediate_size=_config_int(config, "intermediate_size"),
            qkv_bias=arch.has_qkv_bias(config),
            o_bias=arch.has_o_bias(config),
            mlp_bias=arch.has_mlp_bias(config),
            tied_embeddings=tied_embeddings(config),
            rope_parameters=source_rope_parameters(config),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            torch_dtype=parse_dtype(config.get("dtype") or config.get("torch_dtype"), torch.float32),
        )

    @property
    def attention_kind(self) -> str:
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        if self.num_kv_heads == 1:
            return "MQA"
        return "GQA"

    @property
    def kv_values_per_token_layer(self) -> int:
        """Cached numbers per token per layer: one key and one value per kv head."""
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def max_kv_lora_rank(self) -> int:
        """Largest useful latent rank: the rank of the stacked NoPE-key/value projection.

        Biases need no latent column: NoPE-key biases shift every score of a query equally (softmax drops
        them) and value biases move into o_proj's bias (attention weights sum to one).
        """
        return min(2 * self.num_kv_heads * self.head_dim, self.hidden_size)

    @property
    def max_rope_dim(self) -> int:
        return self.head_dim


def _config_int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """An integer from config.json, as a user error (not a KeyError traceback) when absent or malformed.

    `default` stands in for a key that is absent or null, as transformers itself reads those configs.
    """
    value = config.get(key)
    if value is None:
        if default is None:
            raise CheckpointError(f"config.json has no {key!r}; cannot tell the model's shape")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise CheckpointError(f"config.json: {key!r} is {value!r}, not an integer")
    return int(value)


def source_rope_parameters(config: Mapping[str, Any]) -> dict:
    """RoPE parameters in transformers-5 form, whether the config uses `rope_parameters` or the older keys."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    if "rope_theta" not in params:
        params["rope_theta"] = float(config.get("rope_theta", 10000.0))
    return params


@dataclass(frozen=True)
class MLAShape:
    kv_lora_rank: int
    rope_dim: int
    q_lora_rank: int | None = None

    @property
    def kv_values_per_token_layer(self) -> int:
        """The MLA cache holds the latent and the one shared RoPE key per token and layer."""
        return self.kv_lora_rank + self.rope_dim


def shape_problems(source: SourceShape, kv_lora_rank: int | None, rope_dim: int | None) -> list[str]:
    """Every reason the requested MLA shape cannot be built from `source` (empty when it can)."""
    problems = []
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


def check_mla_shape(source: SourceShape, kv_lora_rank: int, rope_dim: int, q_lora_rank: int | None = None) -> MLAShape:
    problems = shape_problems(source, kv_lora_rank, rope_dim)
    if q_lora_rank is not None and q_lora_rank <= 0:
        problems.append(f"--q-lora-rank {q_lora_rank}: must be positive")
    if problems:
        raise InvalidShapeError("; ".join(problems))
    return MLAShape(kv_lora_rank, rope_dim, q_lora_rank)


def _power_of_two_floor(value: float) -> int:
    power = 1
    while power * 2 <= value:
        power *= 2
    return power


def rope_share(budget: int, head_dim: int) -> float:
    """Fraction of the cache budget to give the shared RoPE key, from measurements (one-shot perplexity).

    The tighter the budget relative to head_dim, the larger the share that pays: SmolLM2 (head_dim 64)
    was best at 144+48 for a 192 budget (0.25; 128+64 and 160+32 worse), 64+32 for 96 (0.33; 72+24
    worse); stories260K (head_dim 8) at 24+8 for 32, 10+6 for 16 (0.375; 12+4 and 8+8 worse), 4+4 for 8
    (0.5).  0.5 * (budget / head_dim)^-0.5 fits all of them; never more than half the budget.
    """
    return min(0.5, 0.5 * (budget / head_dim) ** -0.5)


def shape_for_compression(source: SourceShape, compression: float) -> MLAShape:
    """Pick (kv_lora_rank, rope_dim) so the cache is `compression` times smaller than the source's.

    rope_dim is `rope_share(...)` of the budget, rounded to a multiple of head_dim / 4 (at least 2),
    capped at the source head_dim, DeepSeek's 64 and half the budget; the rest is the latent.
    """
    if not compression >= 1:  # also catches NaN
        # Below 1 the MLA cache would be larger than the source's; the rank cap makes it unreachable anyway.
        raise InvalidShapeError(
            f"--compression {compression}: must be at least 1 (how many times smaller the MLA cache is than the source's)"
        )
    budget = int(round(source.kv_values_per_token_layer / compression))
    if budget < 3:
        raise InvalidShapeError(
            f"--compression {compression}: leaves {budget} cached values per token and layer; "
            f"the source caches {source.kv_values_per_token_layer}, so the ratio can be at most "
            f"{source.kv_values_per_token_layer / 3:.1f}"
        )
    unit = max(2, source.head_dim // 4 - (source.head_dim // 4) % 2)
    ceiling = min(source.head_dim, DEEPSEEK_ROPE_DIM, budget // 2)
    rope_dim = unit * max(1, round(rope_share(budget, source.head_dim) * budget / unit))
    while rope_dim > ceiling and rope_dim > 2:
        rope_dim -= unit if rope_dim - unit >= 2 else 2
    rope_dim = max(2, rope_dim - rope_dim % 2)
    rank = min(budget - rope_dim, source.max_kv_lora_rank)
    return check_mla_shape(source, rank, rope_dim)


def default_shape(source: SourceShape) -> MLAShape:
    """DeepSeek's 512+64 when the source caches enough to make it a real saving, else a 2x compression."""
    deepseek = DEEPSEEK_KV_LORA_RANK + DEEPSEEK_ROPE_DIM
    if (
        source.kv_values_per_token_layer >= 2 * deepseek
        and source.max_kv_lora_rank >= DEEPSEEK_KV_LORA_RANK
        and source.head_dim >= DEEPSEEK_ROPE_DIM
    ):
        return MLAShape(DEEPSEEK_KV_LORA_RANK, DEEPSEEK_ROPE_DIM)
    return shape_for_compression(source, 2.0)


@dataclass(frozen=True)
class CacheCost:
    """KV-cache size of one model for a given context, batch and dtype."""

    values_per_token_layer: int
    num_layers: int
    dtype: torch.dtype

    @property
    def bytes_per_token_layer(self) -> int:
        return self.values_per_token_layer * dtype_bytes(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_token_layer * self.num_layers

    def bytes_for(self, context: int, batch: int = 1) -> int:
        return self.bytes_per_token * context * batch

    def max_context(self, memory_bytes: int, batch: int = 1) -> int:
        """Largest context whose cache fits `memory_bytes` at this batch size."""
        return memory_bytes // (self.bytes_per_token * batch)


def cache_costs(source: SourceShape, mla: MLAShape, dtype: torch.dtype) -> tuple[CacheCost, CacheCost]:
    return (
        CacheCost(source.kv_values_per_token_layer, source.num_layers, dtype),
        CacheCost(mla.kv_values_per_token_layer, source.num_layers, dtype),
    )


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")
