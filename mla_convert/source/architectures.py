"""Source-architecture facts, kept as data.

Every supported source family is one `ArchitectureSpec` record: where its weights live in the
checkpoint, which config keys decide its biases, which transformers config class resolves its RoPE,
and which config values DeepseekV3 cannot reproduce.  Adding a family means adding a record, not an
`if` somewhere in the converter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import UnsupportedArchitectureError
from ..io.reader import row_view_name


@dataclass(frozen=True)
class FusedMatrix:
    """One stored matrix that holds several roles' rows one after another (Phi-3's `qkv_proj` is [q | k | v]).

    The roles are read as row views of it (`io.reader.row_view_name`), so the converter sees the same roles as for
    a family that stores each projection on its own."""

    template: str  # the stored weight's name; `{i}` is the layer index
    roles: tuple[str, ...]  # in stored order, e.g. ("q_weight", "k_weight", "v_weight")


@dataclass(frozen=True)
class FoldedMultipliers:
    """Config keys of the scalars a family multiplies its activations by (Granite), each folded into weights.

    DeepseekV3 has no such scalars, but each one scales a linear function, so the export holds weights that compute
    the same numbers (`source.folds.folded_weight_scales`): the source is read as the Llama it equals."""

    embedding: str  # the embeddings are multiplied by it
    residual: str  # each attention and MLP output is multiplied by it before the residual add
    attention: str  # the softmax scale, in place of head_dim ** -0.5
    logits_divisor: str  # the logits are divided by it


@dataclass(frozen=True)
class ArchitectureSpec:
    """How one decoder-only family stores its weights and describes its attention."""

    family: str
    display_name: str  # how messages name the family ("Phi-3")
    hf_architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    # transformers' config class: it standardizes RoPE the way loading the model would
    config_class: str
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
    # Config keys whose non-default values the converter cannot reproduce in DeepseekV3.
    unsupported_config: Mapping[str, Any] = field(default_factory=dict)
    # Whether the family can slide its attention over a window.  Which layers slide, and over how many tokens, is
    # read from transformers' config class (its `sliding_window` and `layer_types`, defaults and switches included),
    # so the converter agrees with the model transformers builds.  DeepseekV3 attends to every position, which is
    # the same attention for contexts up to the window.
    may_slide: bool = False
    # Matrices stored fused; their roles' names are row views, which need each role's row count (`rows`).
    fused: tuple[FusedMatrix, ...] = ()
    # The config-class attribute listing, per layer, whether it rotates its queries and keys (1) or attends without
    # positions (0, "NoPE"); None: every layer rotates.  Read from the config class, defaults included.
    rotary_layers_key: str | None = None
    # Scalars the family multiplies activations by, read from its config class (defaults included); None: none.
    multipliers: FoldedMultipliers | None = None
    # Whether RoPE rotates adjacent dimensions (2i, 2i + 1) of a head together, where Llama rotates (i, i + d/2);
    # such q/k rows are read reordered into Llama's layout (`source.folds`).
    interleaved_rope: bool = False

    def attention_weight_names(self, layer: int, qkv_bias: bool, o_bias: bool,
                               rows: Mapping[str, int] | None = None) -> dict[str, str]:
        """Names of one layer's attention tensors, keyed by role (`q_weight`, `k_bias`, ...).  `rows`: each role's
        row count, which a family with fused matrices needs to name its roles' rows."""
        names = {}
        for role, template in (("q", self.q_proj), ("k", self.k_proj), ("v", self.v_proj), ("o", self.o_proj)):
            prefix = template.format(i=layer)
            names[f"{role}_weight"] = f"{prefix}.weight"
            if (o_bias if role == "o" else qkv_bias):
                names[f"{role}_bias"] = f"{prefix}.bias"
        return self._fuse(names, layer, rows)

    def mlp_weight_names(self, layer: int, mlp_bias: bool, rows: Mapping[str, int] | None = None) -> dict[str, str]:
        names = {}
        for role, template in (("gate", self.gate_proj), ("up", self.up_proj), ("down", self.down_proj)):
            prefix = template.format(i=layer)
            names[f"{role}_weight"] = f"{prefix}.weight"
            if mlp_bias:
                names[f"{role}_bias"] = f"{prefix}.bias"
        return self._fuse(names, layer, rows)

    def _fuse(self, names: dict[str, str], layer: int, rows: Mapping[str, int] | None) -> dict[str, str]:
        """`names` with each fused role named as its rows of the stored matrix."""
        for matrix in self.fused:
            if not any(role in names for role in matrix.roles):
                continue
            if rows is None:
                raise ValueError(f"{self.family} stores {', '.join(matrix.roles)} in one matrix: naming them needs "
                                 "their row counts")
            start = 0
            for role in matrix.roles:
                names[role] = row_view_name(matrix.template.format(i=layer), start, start + rows[role])
                start += rows[role]
        return names

    def norm_weight_names(self, layer: int) -> dict[str, str]:
        return {"input_norm": self.input_norm.format(i=layer), "post_attn_norm": self.post_attn_norm.format(i=layer)}


LLAMA = ArchitectureSpec(
    family="llama",
    display_name="Llama",
    hf_architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    config_class="transformers.LlamaConfig",
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    mlp_bias="mlp_bias",
)

MISTRAL = ArchitectureSpec(
    family="mistral",
    display_name="Mistral",
    hf_architectures=("MistralForCausalLM",),
    model_types=("mistral",),
    config_class="transformers.MistralConfig",
    may_slide=True,
)

QWEN2 = ArchitectureSpec(
    family="qwen2",
    display_name="Qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    config_class="transformers.Qwen2Config",
    qkv_bias=True,
    may_slide=True,
)

# Phi-3 and Phi-4 (Phi3ForCausalLM): Llama's computation with q/k/v in one matrix and gate/up in another.  Its
# long-context variants (RoPE "longrope") and Phi-4-mini's partial rotary factor are refused by the RoPE check.
PHI3 = ArchitectureSpec(
    family="phi3",
    display_name="Phi-3",
    hf_architectures=("Phi3ForCausalLM",),
    model_types=("phi3",),
    config_class="transformers.Phi3Config",
    may_slide=True,
    fused=(FusedMatrix("model.layers.{i}.self_attn.qkv_proj.weight", ("q_weight", "k_weight", "v_weight")),
           FusedMatrix("model.layers.{i}.mlp.gate_up_proj.weight", ("gate_weight", "up_weight"))),
)

# SmolLM3: Llama's layers, every fourth without RoPE (`no_rope_layers`).  The export gives those layers zero RoPE
# rows, so their shared RoPE key adds nothing and the whole key is in the latent.  Its optional sliding window
# (only in NoPE layers, only with use_sliding_window) is refused: SmolLM3Config defaults it off.
SMOLLM3 = replace(
    LLAMA,  # names and bias rules
    family="smollm3",
    display_name="SmolLM3",
    hf_architectures=("SmolLM3ForCausalLM",),
    model_types=("smollm3",),
    config_class="transformers.SmolLM3Config",
    unsupported_config={"use_sliding_window": True},
    rotary_layers_key="no_rope_layers",
)

# Granite (3.x): Llama's layers with four config scalars: embeddings x embedding_multiplier, each block's output x
# residual_multiplier, softmax scale attention_multiplier, logits / logits_scaling.  All four are folded into weights.
GRANITE = replace(
    LLAMA,  # names and bias rules
    family="granite",
    display_name="Granite",
    hf_architectures=("GraniteForCausalLM",),
    model_types=("granite",),
    config_class="transformers.GraniteConfig",
    multipliers=FoldedMultipliers(embedding="embedding_multiplier", residual="residual_multiplier",
                                  attention="attention_multiplier", logits_divisor="logits_scaling"),
)

# ERNIE 4.5 (dense): Llama's layers with RoPE over adjacent pairs and one `use_bias` for every projection (an MLP
# bias, which DeepseekV3 has no slot for, is refused).
ERNIE4_5 = replace(
    LLAMA,
    family="ernie4_5",
    display_name="ERNIE 4.5",
    hf_architectures=("Ernie4_5ForCausalLM",),
    model_types=("ernie4_5",),
    config_class="transformers.Ernie4_5Config",
    qkv_bias="use_bias",
    o_bias="use_bias",
    mlp_bias="use_bias",
    interleaved_rope=True,
)

# Helium: Llama's layers with RoPE over adjacent pairs; attention_bias adds q/k/v biases only (o_proj has none).
HELIUM = replace(
    LLAMA,
    family="helium",
    display_name="Helium",
    hf_architectures=("HeliumForCausalLM",),
    model_types=("helium",),
    config_class="transformers.HeliumConfig",
    o_bias=False,
    interleaved_rope=True,
)

# Ministral: Mistral's layers, with `layer_types` choosing which of them slide (read from MinistralConfig).
MINISTRAL = replace(
    MISTRAL,
    family="ministral",
    display_name="Ministral",
    hf_architectures=("MinistralForCausalLM",),
    model_types=("ministral",),
    config_class="transformers.MinistralConfig",
)

# Seed-OSS: Llama's layers; attention_bias adds q/k/v biases, attention_out_bias o_proj's.
SEED_OSS = replace(
    LLAMA,
    family="seed_oss",
    display_name="Seed-OSS",
    hf_architectures=("SeedOssForCausalLM",),
    model_types=("seed_oss",),
    config_class="transformers.SeedOssConfig",
    o_bias="attention_out_bias",
)

SUPPORTED_ARCHITECTURES: tuple[ArchitectureSpec, ...] = (LLAMA, MISTRAL, QWEN2, PHI3, SMOLLM3, GRANITE, ERNIE4_5, HELIUM,
                                                         MINISTRAL, SEED_OSS)


def supported_family_names() -> list[str]:
    """The supported families as messages name them: Llama, Mistral, ..."""
    return [spec.display_name for spec in SUPPORTED_ARCHITECTURES]


def supported_architecture_names() -> list[str]:
    return [name for spec in SUPPORTED_ARCHITECTURES for name in spec.hf_architectures]


def architecture_for_config(architectures: str | list[str] | None, model_type: str | None = None) -> ArchitectureSpec:
    """The record for a config: its `model_type`'s family, as `AutoModelForCausalLM` builds it.

    transformers picks the class from `model_type` alone, whatever `architectures` says: a config whose
    `architectures` names `LlamaModel`, a misspelt class or another family's class (`model_type: mistral` under
    `LlamaForCausalLM` loads as a sliding Mistral) converts as `model_type`'s family.  `architectures` decides only
    when `model_type` is one transformers does not know.  A config naming another head
    (`LlamaForSequenceClassification`) is refused: its weights are not a language model's.
    """
    names = [architectures] if isinstance(architectures, str) else list(architectures or [])
    by_name = next((spec for name in names for spec in SUPPORTED_ARCHITECTURES if name in spec.hf_architectures), None)
    by_type = next((spec for spec in SUPPORTED_ARCHITECTURES if model_type in spec.model_types), None)
    language_model = by_name is not None or all(name.endswith(("ForCausalLM", "Model")) for name in names)
    if by_type is not None and language_model:
        return by_type
    if by_name is not None and not _known_model_type(model_type):
        return by_name
    if by_name is not None:  # e.g. model_type gemma under LlamaForCausalLM: transformers builds a Gemma
        raise UnsupportedArchitectureError(
            f"unsupported model_type {model_type!r}: transformers builds the model from model_type, not from "
            f"architectures ({', '.join(names)}); mla-convert supports model_type "
            f"{', '.join(t for spec in SUPPORTED_ARCHITECTURES for t in spec.model_types)}"
        )
    raise UnsupportedArchitectureError(
        f"unsupported architecture {(names[0] if names else None) or model_type!r}; "
        f"mla-convert supports: {', '.join(supported_architecture_names())} "
        "(SmolLM/SmolLM2 and TinyLlama are LlamaForCausalLM; Phi-3 and Phi-4 are Phi3ForCausalLM)"
    )


def _known_model_type(model_type: str | None) -> bool:
    """Whether transformers has a config class for `model_type` (then it, not `architectures`, decides the model)."""
    if not model_type:
        return False
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING
