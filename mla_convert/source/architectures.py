"""Source-architecture facts, kept as data.

Every supported source family is one `ArchitectureSpec` record: where its weights live in the
checkpoint, which config keys describe the attention shape, which projections carry a bias and how
RoPE is laid out.  Adding a family means adding a record, not an `if` somewhere in the converter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class ArchitectureSpec:
    """How one decoder-only family stores its weights and describes its attention."""

    family: str
    hf_architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    # Weight-name templates; `{i}` is the layer index.
    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"
    q_proj: str = "model.layers.{i}.self_attn.q_proj"
    k_proj: str = "model.layers.{i}.self_attn.k_proj"
    v_proj: str = "model.layers.{i}.self_attn.v_proj"
    o_proj: str = "model.layers.{i}.self_attn.o_proj"
    gate_proj: str = "model.layers.{i}.mlp.gate_proj"
    up_proj: str = "model.layers.{i}.mlp.up_proj"
    down_proj: str = "model.layers.{i}.mlp.down_proj"
    input_norm: str = "model.layers.{i}.input_layernorm.weight"
    post_attn_norm: str = "model.layers.{i}.post_attention_layernorm.weight"
    # Bias rules.  A bool is a fixed fact of the family; a string names the config key that decides.
    qkv_bias: bool | str = False
    o_bias: bool | str = False
    mlp_bias: bool | str = False
    # RoPE layout of q/k rows inside each head: "rotate_half" pairs row j with row j + head_dim/2.
    rope_layout: str = "rotate_half"
    # Config keys whose non-default values the converter cannot reproduce in DeepseekV3.
    unsupported_config: Mapping[str, Any] = field(default_factory=dict)

    def layer_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}."

    def has_qkv_bias(self, config: Mapping[str, Any]) -> bool:
        return _resolve_flag(self.qkv_bias, config)

    def has_o_bias(self, config: Mapping[str, Any]) -> bool:
        return _resolve_flag(self.o_bias, config)

    def has_mlp_bias(self, config: Mapping[str, Any]) -> bool:
        return _resolve_flag(self.mlp_bias, config)

    def attention_weight_names(self, layer: int, config: Mapping[str, Any]) -> dict[str, str]:
        """Names of one layer's attention tensors, keyed by role (`q_weight`, `k_bias`, ...)."""
        names = {}
        for role, template in (("q", self.q_proj), ("k", self.k_proj), ("v", self.v_proj), ("o", self.o_proj)):
            prefix = template.format(i=layer)
            names[f"{role}_weight"] = f"{prefix}.weight"
            if (role != "o" and self.has_qkv_bias(config)) or (role == "o" and self.has_o_bias(config)):
                names[f"{role}_bias"] = f"{prefix}.bias"
        return names

    def mlp_weight_names(self, layer: int, config: Mapping[str, Any]) -> dict[str, str]:
        names = {}
        for role, template in (("gate", self.gate_proj), ("up", self.up_proj), ("down", self.down_proj)):
            prefix = template.format(i=layer)
            names[f"{role}_weight"] = f"{prefix}.weight"
            if self.has_mlp_bias(config):
                names[f"{role}_bias"] = f"{prefix}.bias"
        return names

    def norm_weight_names(self, layer: int) -> dict[str, str]:
        return {"input_norm": self.input_norm.format(i=layer), "post_attn_norm": self.post_attn_norm.format(i=layer)}

    def layer_weight_names(self, layer: int, config: Mapping[str, Any]) -> dict[str, str]:
        """Every tensor of one decoder layer, keyed by role."""
        return {
            **self.attention_weight_names(layer, config),
            **self.mlp_weight_names(layer, config),
            **self.norm_weight_names(layer),
        }

    def global_weight_names(self, config: Mapping[str, Any]) -> dict[str, str]:
        names = {"embed": self.embed, "final_norm": self.final_norm}
        if not tied_embeddings(config):
            names["lm_head"] = self.lm_head
        return names


def _resolve_flag(flag: bool | str, config: Mapping[str, Any]) -> bool:
    if isinstance(flag, bool):
        return flag
    return bool(config.get(flag, False))


def tied_embeddings(config: Mapping[str, Any]) -> bool:
    return bool(config.get("tie_word_embeddings", False))


LLAMA = ArchitectureSpec(
    family="llama",
    hf_architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    mlp_bias="mlp_bias",
)

MISTRAL = ArchitectureSpec(
    family="mistral",
    hf_architectures=("MistralForCausalLM",),
    model_types=("mistral",),
)

QWEN2 = ArchitectureSpec(
    family="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    qkv_bias=True,
    # Sliding-window attention has no counterpart in DeepseekV3.
    unsupported_config={"use_sliding_window": True},
)

SUPPORTED_ARCHITECTURES: tuple[ArchitectureSpec, ...] = (LLAMA, MISTRAL, QWEN2)


def supported_architecture_names() -> list[str]:
    return [name for spec in SUPPORTED_ARCHITECTURES for name in spec.hf_architectures]


def architecture_for_config(config: Mapping[str, Any]) -> ArchitectureSpec:
    """Pick the record for `config` (a parsed `config.json`), or explain what is supported."""
    architectures = config.get("architectures") or []
    name = architectures[0] if architectures else None
    for spec in SUPPORTED_ARCHITECTURES:
        if name in spec.hf_architectures:
            return spec
    if name is None:
        # Configs written without `architectures` still carry `model_type`.
        for spec in SUPPORTED_ARCHITECTURES:
            if config.get("model_type") in spec.model_types:
                return spec
    raise UnsupportedArchitectureError(
        f"unsupported architecture {name or config.get('model_type')!r}; "
        f"mla-convert supports: {', '.join(supported_architecture_names())} "
        "(SmolLM/SmolLM2 and TinyLlama are LlamaForCausalLM)"
    )
