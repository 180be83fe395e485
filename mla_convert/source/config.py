"""The source model's `config.json`, parsed once into a frozen, typed `SourceConfig`.

This is the only module that reads the raw config dict.  Parsing is strict: a value of the wrong JSON
type is a problem even when Python's truthiness would accept it (`"attention_bias": "false"` is a
string, not False), sizes must be positive integers within sane bounds (a config claiming 10^9 layers
must not make pre-flight itself loop for hours), and token ids must lie in the vocabulary.  Every
problem is collected, so the user sees all of them at once.

RoPE is resolved by the architecture's own transformers config class, exactly as transformers resolves
it when it loads the model (a legacy `rope_scaling` next to `rope_parameters` wins there, so it wins
here too); the standardized parameters are then checked against what DeepseekV3 can reproduce.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import MLAConvertError, PreflightError
from ..io.config_file import read_config_json
from .architectures import ArchitectureSpec, architecture_for_config, supported_family_names

REQUIRED_SIZES = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")
# Ceilings far above any released model; beyond them a config is garbage, and checks that walk every
# layer or tensor would run for hours.
MAX_SIZE = {"num_hidden_layers": 4096, "num_attention_heads": 4096, "num_key_value_heads": 4096,
            "hidden_size": 1 << 20, "intermediate_size": 1 << 22, "vocab_size": 1 << 24, "head_dim": 4096,
            "max_position_embeddings": 1 << 28,
            # an MLA export's (DeepseekV3) attention sizes
            "kv_lora_rank": 1 << 20, "qk_rope_head_dim": 4096, "q_lora_rank": 1 << 20, "qk_nope_head_dim": 4096,
            "v_head_dim": 4096}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# What the RoPE types mla-convert reproduces need beyond rope_theta (transformers' own requirements).
ROPE_REQUIRED_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SUPPORTED_ACTIVATIONS = ("silu", "swish")
DEFAULT_MAX_POSITIONS = 4096


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class SourceAttentionShape:
    """What a supported source family's attention is and caches, from its head counts: shared by the source's own config
    and the shape an export's conversion report records (`num_heads`, `num_kv_heads`, `head_dim` are the user's)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def attention_kind(self) -> str:
        """MHA (a kv head per query head), MQA (one kv head) or GQA (query heads share kv heads)."""
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def kv_values_per_token_layer(self) -> int:
        """Cached numbers per token per layer: one key and one value per kv head."""
        return 2 * self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class SourceConfig(SourceAttentionShape):
    """Every fact of the source config the conversion, the cache math and the export need, typed."""

    architecture: ArchitectureSpec
    model_type: str
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
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    initializer_range: float = 0.02
    license: str | None = None
    # the source's attention window when some layer slides and the window is shorter than its positions: the export
    # (full attention) agrees with the source only up to it, so it declares that many positions
    sliding_window: int | None = None
    # how many of the layers slide over `sliding_window` (the rest attend to every position): Qwen2's layer_types can
    # mix the two; Mistral slides every layer.  None when no layer slides
    sliding_layers: int | None = None
    # False: config.json states no dtype, and `torch_dtype` is a float32 placeholder until the weights' headers are
    # read (`convert.pipeline.with_the_weights_dtype`): transformers 5 then loads the weights' own dtype
    dtype_stated: bool = True
    # per layer, whether it rotates queries and keys; None: every layer does (SmolLM3 leaves every fourth unrotated)
    rotary_layers: tuple[bool, ...] | None = None
    # the scalars the family multiplies activations by (`ArchitectureSpec.multipliers`), by field name ("embedding",
    # "residual", "attention", "logits_divisor"), as its config class resolves them; None: the family has none
    multipliers: dict[str, float] | None = None

    def rotates(self, layer: int) -> bool:
        """Whether layer `layer` applies RoPE to its queries and keys (a NoPE layer attends without positions)."""
        return self.rotary_layers is None or self.rotary_layers[layer]

    @property
    def multipliers_by_config_key(self) -> dict[str, float]:
        """The activation multipliers named as config.json names them (`embedding_multiplier`: 12.0, ...)."""
        keys = self.architecture.multipliers
        return {getattr(keys, field): value for field, value in (self.multipliers or {}).items()}

    @property
    def nope_layers(self) -> list[int]:
        """The layers that attend without RoPE."""
        return [layer for layer in range(self.num_layers) if not self.rotates(layer)]

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SourceConfig:
        """Parse a `config.json` mapping; raise `PreflightError` listing every problem."""
        config, problems = _parse(raw)
        if problems:
            raise PreflightError(problems)
        return config

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> SourceConfig:
        return cls.from_dict(read_config_json(folder))

    @staticmethod
    def problems(raw: Mapping[str, Any]) -> list[str]:
        """Every reason `raw` cannot be converted (empty: it can)."""
        return _parse(raw)[1]

    # ------------------------------------------------------------------ attention shape
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

    @property
    def export_max_positions(self) -> int:
        """Positions the export declares: the source's, or its attention window where layers slide (beyond it a
        full-attention export and the source read different tokens)."""
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    @property
    def query_bias_channel(self) -> bool:
        """Whether the query bias needs a latent channel of its own: with more query rows than inputs, W_q's
        column space is a proper subspace and a bias generally lies outside it (q_a_proj's bias feeds q_b_proj
        through one constant channel instead)."""
        return self.qkv_bias and self.num_heads * self.head_dim > self.hidden_size

    @property
    def max_q_lora_rank(self) -> int:
        """The query latent cannot usefully be wider than the input it is computed from (plus the bias channel)."""
        return self.hidden_size + int(self.query_bias_channel)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    @property
    def first_token_id(self) -> int:
        """The id sampling starts from: BOS, else 0."""
        return 0 if self.bos_token_id is None else self.bos_token_id

    # ------------------------------------------------------------------ weight names
    @property
    def role_rows(self) -> dict[str, int]:
        """Rows of each projection a family may store fused: (H*h, G*h, G*h) for q/k/v, the MLP width for gate/up."""
        return {"q_weight": self.num_heads * self.head_dim, "k_weight": self.num_kv_heads * self.head_dim,
                "v_weight": self.num_kv_heads * self.head_dim, "gate_weight": self.intermediate_size,
                "up_weight": self.intermediate_size}

    def attention_weight_names(self, layer: int) -> dict[str, str]:
        return self.architecture.attention_weight_names(layer, self.qkv_bias, self.o_bias, self.role_rows)

    def mlp_weight_names(self, layer: int) -> dict[str, str]:
        return self.architecture.mlp_weight_names(layer, self.mlp_bias, self.role_rows)

    def norm_weight_names(self, layer: int) -> dict[str, str]:
        return self.architecture.norm_weight_names(layer)

    def layer_weight_names(self, layer: int) -> dict[str, str]:
        """Every tensor of one decoder layer, keyed by role (`q_weight`, `k_bias`, `gate_weight`, ...)."""
        return {**self.attention_weight_names(layer), **self.mlp_weight_names(layer), **self.norm_weight_names(layer)}

    @property
    def head_weight_name(self) -> str:
        """The output projection's rows: the embedding table when the two are tied."""
        return self.architecture.embed if self.tied_embeddings else self.architecture.lm_head


# --------------------------------------------------------------------------- an MLA export's config
EXPORT_MODEL_TYPE = "deepseek_v3"


def is_export_config(raw: Mapping[str, Any]) -> bool:
    """Whether a config.json describes an MLA model (DeepseekV3: mla-convert's exports, DeepSeek's own models)."""
    return raw.get("model_type") == EXPORT_MODEL_TYPE


@dataclass(frozen=True)
class ExportConfig:
    """What an MLA export's `config.json` says its KV cache holds, typed (an mla-convert export's, or any DeepseekV3's).

    Per token and layer a DeepseekV3 model caches the latent (`kv_lora_rank` values) and the one RoPE key shared by
    all heads (`qk_rope_head_dim`): transformers' DeepseekV3Attention caches exactly these (tests/test_kv_cache_measure.py),
    as absorbed-MLA engines do.  The query latent and the MoE layers of a DeepSeek model change nothing in the cache;
    they are kept to be named.  A key the file leaves out is transformers' DeepseekV3Config default, as loading the
    model would take it (q_lora_rank 1536 when absent; null is no query latent).
    """

    kv_lora_rank: int
    rope_dim: int
    num_layers: int
    num_heads: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None
    moe_layers: int  # layers built with a mixture of experts (index >= first_k_dense_replace); 0: a dense model
    max_position_embeddings: int
    rope_parameters: dict
    torch_dtype: torch.dtype | None  # None: config.json states no dtype (transformers 5 then loads the weights' dtype)
    attention_bias: bool = False  # q/k/v projections with biases (a Qwen2 source's): engines without a bias slot refuse
    tied_embeddings: bool = False  # tie_word_embeddings: lm_head shares the embedding (engines that never tie refuse)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ExportConfig:
        """Parse a DeepseekV3 `config.json` mapping; raise `PreflightError` listing every problem."""
        config, problems = _parse_export(raw)
        if problems:
            raise PreflightError(problems)
        return config

    @property
    def kv_values_per_token_layer(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def rope_type(self) -> str:
        """As the engine records name it (a legacy `rope_scaling` says `type`)."""
        return self.rope_parameters.get("rope_type") or self.rope_parameters.get("type") or "default"


def _parse_export(raw: Mapping[str, Any]) -> tuple[ExportConfig | None, list[str]]:
    from transformers import DeepseekV3Config

    if not is_export_config(raw):
        return None, [f"config.json: model_type {raw.get('model_type')!r} is not an MLA export's ({EXPORT_MODEL_TYPE!r}); "
                      f"a {' / '.join(supported_family_names())} source is inspected as one (SourceConfig, inspect_shapes)"]
    defaults = DeepseekV3Config()
    read = _Reader(raw)

    def size(key: str) -> int | None:
        return read.size(key, default=getattr(defaults, key))

    rank, rope, layers, heads = (size(key) for key in ("kv_lora_rank", "qk_rope_head_dim", "num_hidden_layers",
                                                       "num_attention_heads"))
    nope, value_dim, positions = (size(key) for key in ("qk_nope_head_dim", "v_head_dim", "max_position_embeddings"))
    q_rank = None if "q_lora_rank" in raw and raw["q_lora_rank"] is None else size("q_lora_rank")
    if rope is not None and rope % 2:
        read.problems.append(f"config.json: qk_rope_head_dim {rope} is odd; RoPE rotates pairs of dimensions")
    dense = raw.get("first_k_dense_replace", defaults.first_k_dense_replace)
    if not (_is_int(dense) and dense >= 0):
        read.problems.append(f"config.json: first_k_dense_replace must be a whole number >= 0 (found {dense!r})")
        dense = None
    rope_parameters = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope_parameters, dict):
        read.problems.append(f"config.json: rope_parameters must be a JSON object (found {rope_parameters!r})")
    # none stated: transformers 5 takes the weights' dtype, which the config does not tell
    dtype = _dtype(raw, read.problems, absent=None)
    bias, tied = read.flag("attention_bias"), read.flag("tie_word_embeddings")
    if read.problems:
        return None, read.problems
    return ExportConfig(
        kv_lora_rank=rank, rope_dim=rope, num_layers=layers, num_heads=heads, qk_nope_head_dim=nope,
        v_head_dim=value_dim, q_lora_rank=q_rank, moe_layers=max(0, layers - dense), max_position_embeddings=positions,
        rope_parameters=dict(rope_parameters), torch_dtype=dtype, attention_bias=bias, tied_embeddings=tied,
    ), []


# --------------------------------------------------------------------------- reading


# --------------------------------------------------------------------------- strict parse
class _Reader:
    """Typed access to the raw mapping that records a problem (and returns None) for each bad value."""

    def __init__(self, raw: Mapping[str, Any]):
        self.raw = raw
        self.problems: list[str] = []

    def size(self, key: str, default: int | None = None, required: bool = False) -> int | None:
        value = self.raw.get(key)
        if value is None:
            if required:
                self.problems.append(f"config.json: {key} must be a positive integer (found {value!r})")
            return default
        if not _is_int(value) or value <= 0:
            self.problems.append(f"config.json: {key} must be a positive integer (found {value!r})")
            return None
        if value > MAX_SIZE.get(key, 1 << 40):
            self.problems.append(f"config.json: {key} {value} is beyond any real model (at most {MAX_SIZE[key]})")
            return None
        return value

    def flag(self, key: str) -> bool:
        value = self.raw.get(key, False)
        if value is None:
            return False
        if not isinstance(value, bool):
            self.problems.append(f"config.json: {key} must be true or false (found {value!r})")
            return False
        return value

    def number(self, key: str, default: float) -> float:
        value = self.raw.get(key)
        if value is None:
            return default
        if not _is_number(value) or value <= 0:
            self.problems.append(f"config.json: {key} must be a positive number (found {value!r})")
            return default
        return float(value)

    def text(self, key: str, default: str | None) -> str | None:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            self.problems.append(f"config.json: {key} must be a string (found {value!r})")
            return default
        return value


def _architecture(raw: Mapping[str, Any]) -> tuple[ArchitectureSpec | None, list[str]]:
    architectures = raw.get("architectures")
    if architectures is not None and not (isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)):
        return None, [f"config.json: architectures must be a list of class names (found {architectures!r})"]
    model_type = raw.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        return None, [f"config.json: model_type must be a string (found {model_type!r})"]
    if model_type == EXPORT_MODEL_TYPE:  # an export given as a source: say so, its architecture is not "unsupported"
        rank, rope = raw.get("kv_lora_rank"), raw.get("qk_rope_head_dim")
        return None, [f"config.json: already an MLA model (DeepseekV3, kv_lora_rank {rank} + rope {rope}); convert and "
                      f"sweep take the {' / '.join(supported_family_names())} model it was converted from (`mla-convert inspect` reports "
                      "what an export caches)"]
    if not architectures and not model_type:
        return None, ["config.json: names no architecture (no 'architectures' or 'model_type'); is this a model's config?"]
    try:
        return architecture_for_config(architectures, model_type), []
    except MLAConvertError as error:
        return None, [str(error)]


def _parse(raw: Mapping[str, Any]) -> tuple[SourceConfig | None, list[str]]:
    arch, problems = _architecture(raw)
    if arch is None:
        return None, problems
    read = _Reader(raw)
    sizes = {key: read.size(key, required=True) for key in REQUIRED_SIZES}
    hidden, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    kv_heads = read.size("num_key_value_heads", default=heads)
    head_dim = read.size("head_dim")
    if heads and kv_heads and heads % kv_heads:
        read.problems.append(f"config.json: num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
    if raw.get("head_dim") is None:  # absent or null: transformers derives it
        if hidden and heads:
            if hidden % heads:
                read.problems.append(f"config.json: num_attention_heads {heads} does not divide hidden_size {hidden} "
                                     "(and no head_dim is given)")
            else:
                head_dim = hidden // heads
    if head_dim is not None and head_dim % 2:
        read.problems.append(f"config.json: head_dim {head_dim} is odd; RoPE rotates pairs of dimensions")
    hidden_act = read.text("hidden_act", "silu")
    if hidden_act not in SUPPORTED_ACTIVATIONS:
        # (transformers' DeepseekV3MLP would take another ACT2FN name; the export, its oracle tests and every engine
        # run are silu, the activation of the Llama, Mistral, Qwen2 and Phi-3 checkpoints this converts)
        read.problems.append(f"config.json: hidden_act {hidden_act!r} is not supported (mla-convert converts silu MLPs, "
                             "the activation of DeepSeek-V3 and of every export tested in the serving engines)")
    for key, bad in arch.unsupported_config.items():
        if raw.get(key) == bad:
            read.problems.append(f"config.json: {key}={bad!r} is not supported (DeepseekV3 has no such attention)")
    qkv_bias = arch.qkv_bias if isinstance(arch.qkv_bias, bool) else read.flag(arch.qkv_bias)
    o_bias = arch.o_bias if isinstance(arch.o_bias, bool) else read.flag(arch.o_bias)
    mlp_bias = arch.mlp_bias if isinstance(arch.mlp_bias, bool) else read.flag(arch.mlp_bias)
    if mlp_bias:  # (the key that decides it: mlp_bias, ERNIE 4.5's use_bias)
        key = arch.mlp_bias if isinstance(arch.mlp_bias, str) else "mlp_bias"
        read.problems.append(f"config.json: {key}=true is not supported (DeepseekV3's MLP has no biases)")
    tied = read.flag("tie_word_embeddings")
    eps = read.number("rms_norm_eps", 1e-6)
    initializer_range = read.number("initializer_range", 0.02)
    max_positions = read.size("max_position_embeddings") or _family_default(arch, "max_position_embeddings",
                                                                            DEFAULT_MAX_POSITIONS)
    window, sliding_layers = _sliding_window(raw, arch, hidden, heads, head_dim, max_positions, sizes["num_hidden_layers"])
    dtype = _dtype(raw, read.problems)
    vocab = sizes["vocab_size"]
    token_ids = _token_ids(raw, vocab, read.problems)
    license_ = raw.get("license") if isinstance(raw.get("license"), str) else None
    rope_parameters = rotary_layers = multipliers = None
    read.problems += _multiplier_problems(raw, arch)
    if arch.rotary_layers_key is not None and raw.get(arch.rotary_layers_key) is not None:
        _check_layer_flags(raw[arch.rotary_layers_key], arch.rotary_layers_key, sizes["num_hidden_layers"], read.problems)
    if head_dim is not None and head_dim % 2 == 0 and not read.problems:
        rope_parameters = _rope_parameters(raw, arch, heads, head_dim, read.problems)
    if rope_parameters is not None:
        if arch.rotary_layers_key is not None or arch.multipliers is not None:
            family = _family_config(raw, arch, heads, head_dim)  # (built once; the RoPE check built it without error)
            rotary_layers = _rotary_layers(family, arch, sizes["num_hidden_layers"], read.problems)
            multipliers = _multipliers(family, arch)
    if read.problems or rope_parameters is None:
        return None, problems + read.problems
    return SourceConfig(
        architecture=arch,
        model_type=raw.get("model_type") or arch.model_types[0],
        hidden_size=hidden,
        num_layers=sizes["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        intermediate_size=sizes["intermediate_size"],
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        tied_embeddings=tied,
        rope_parameters=rope_parameters,
        rms_norm_eps=eps,
        max_position_embeddings=max_positions,
        torch_dtype=dtype,
        dtype_stated=any(raw.get(key) is not None for key in ("dtype", "torch_dtype")),
        hidden_act=hidden_act,
        bos_token_id=token_ids["bos_token_id"],
        eos_token_id=token_ids["eos_token_id"],
        pad_token_id=token_ids["pad_token_id"],
        initializer_range=initializer_range,
        license=license_,
        sliding_window=window,
        sliding_layers=sliding_layers,
        rotary_layers=rotary_layers,
        multipliers=multipliers,
    ), []


def _rotary_layers(family, arch: ArchitectureSpec, num_layers: int, problems: list[str]) -> tuple[bool, ...] | None:
    """Per layer, whether it rotates (None: all do), as the family's config class (`family`, built) states it, its
    defaults included (SmolLM3: `no_rope_layers`, else a NoPE layer every `no_rope_layer_interval` layers)."""
    if arch.rotary_layers_key is None:
        return None
    flags = getattr(family, arch.rotary_layers_key, None)
    if not _check_layer_flags(flags, arch.rotary_layers_key, num_layers, problems):
        return None
    rotary = tuple(bool(flag) for flag in flags)
    return None if all(rotary) else rotary


def _multiplier_problems(raw: Mapping[str, Any], arch: ArchitectureSpec) -> list[str]:
    """Each activation multiplier the config states must be a finite number > 0: the folds divide by the embedding
    multiplier and the logits divisor (checked before the config class sees them, which would blame its RoPE)."""
    keys = vars(arch.multipliers).values() if arch.multipliers is not None else ()
    return [f"config.json: {key} must be a number > 0 (found {raw[key]!r})" for key in keys
            if key in raw and not (_is_number(raw[key]) and raw[key] > 0)]


def _multipliers(family, arch: ArchitectureSpec) -> dict[str, float] | None:
    """The family's activation multipliers as its config class (`family`, built) resolves them (a key left out is
    its default)."""
    if arch.multipliers is None:
        return None
    return {field_name: float(getattr(family, key)) for field_name, key in vars(arch.multipliers).items()}


def _check_layer_flags(flags: Any, key: str, num_layers: int | None, problems: list[str]) -> bool:
    """Whether `flags` is one 0/1 flag per layer (else a problem says what it is)."""
    if (isinstance(flags, (list, tuple)) and (num_layers is None or len(flags) == num_layers)
            and all(isinstance(flag, int) and flag in (0, 1) for flag in flags)):  # (JSON true/false too)
        return True
    problems.append(f"config.json: {key} must list 0 or 1 for each of the {num_layers} layers (found {flags!r})")
    return False


def _family_config(raw: Mapping[str, Any], arch: ArchitectureSpec, heads: int, head_dim: int):
    """The family's transformers config class built from `raw`, as loading the source would build it.

    The class also validates the architecture (transformers 5 refuses a hidden size that is not a multiple of the
    heads even with an explicit head_dim); mla-convert converts such models, so the class sees a hidden size
    consistent with the heads and everything else as written.  Raises what the class raises.
    """
    module_name, _, class_name = arch.config_class.rpartition(".")
    values = {k: v for k, v in raw.items() if k not in IGNORED_BY_CONFIG_CLASS}
    values.update(hidden_size=heads * head_dim, head_dim=head_dim)
    return getattr(importlib.import_module(module_name), class_name)(**values)


def _family_default(arch: ArchitectureSpec, key: str, fallback: int) -> int:
    """What transformers' config class of the family assumes for a key the config leaves out (loading the source
    in transformers gives the same), e.g. 2048 positions for Llama, 32768 for Qwen2, 131072 for Mistral."""
    module_name, _, class_name = arch.config_class.rpartition(".")
    value = getattr(getattr(importlib.import_module(module_name), class_name)(), key, None)
    return value if _is_int(value) and value > 0 else fallback


def _sliding_window(raw: Mapping[str, Any], arch: ArchitectureSpec, hidden: int | None, heads: int | None,
                    head_dim: int | None, max_positions: int, num_layers: int | None) -> tuple[int | None, int | None]:
    """(the window of the source's sliding layers, how many layers slide), when there are any and the window is
    shorter than the positions; (None, None) otherwise.

    As transformers' config class decides it: a missing `sliding_window` is the family's default (Mistral: 4096),
    Qwen2's `layer_types` win over `use_sliding_window` / `max_window_layers`, whose own defaults apply when absent.
    A family whose config has no `layer_types` (Mistral) slides every layer.
    """
    if not arch.may_slide or not (heads and head_dim):
        return None, None
    try:
        config = _family_config(raw, arch, heads, head_dim)
    except Exception:  # the RoPE check builds the same class and reports why it refuses
        return None, None
    window, layer_types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    if not _is_int(window) or window <= 0 or window >= max_positions:
        return None, None
    if layer_types is None:
        return window, num_layers
    sliding = sum(kind == "sliding_attention" for kind in layer_types)
    return (window, sliding) if sliding else (None, None)


def sliding_phrase(window: int, sliding_layers: int | None, num_layers: int | None) -> str:
    """How the source slides, as the notes and the card say it: "over 16 tokens", or "over 16 tokens in 1 of its 2
    layers" when only some layers slide (`sliding_layers` None: every layer, as an older report records it)."""
    if sliding_layers is None or num_layers is None or sliding_layers >= num_layers:
        return f"over {window} tokens"
    return f"over {window} tokens in {sliding_layers} of its {num_layers} layers"


def _dtype(raw: Mapping[str, Any], problems: list[str], absent: torch.dtype | None = torch.float32) -> torch.dtype | None:
    """The dtype config.json states (`absent` when it states none)."""
    for key in ("dtype", "torch_dtype"):  # `dtype` wins over the older `torch_dtype`, as in transformers
        value = raw.get(key)
        if value is None:
            continue
        name = value.replace("torch.", "") if isinstance(value, str) else None
        if name not in DTYPES:
            problems.append(f"config.json: {key} {value!r} is not a dtype mla-convert reads (float32, float16, bfloat16)")
            return torch.float32
        return DTYPES[name]
    return absent


def _token_ids(raw: Mapping[str, Any], vocab: int | None, problems: list[str]) -> dict:
    """Special token ids as DeepseekV3Config accepts them: integers (eos: or a list of them) inside the vocabulary; a
    negative pad id (transformers loads it, and pads with nothing) is no pad id."""
    out: dict = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = raw.get(key)
        out[key] = None
        if value is None:
            continue
        many = key == "eos_token_id" and isinstance(value, list)
        ids = value if many else [value]
        if (many and not value) or not all(_is_int(i) for i in ids):
            problems.append(f"config.json: {key} must be a token id (an integer{' or a list of them' if key == 'eos_token_id' else ''}); "
                            f"found {value!r}")
            continue
        if key == "pad_token_id" and value < 0:  # -1: "no pad token" in transformers-4.2x-era Llama configs
            continue
        outside = [i for i in ids if vocab is not None and not 0 <= i < vocab]
        if outside:
            problems.append(f"config.json: {key} {value!r} is outside the vocabulary (vocab_size {vocab})")
            continue
        out[key] = tuple(ids) if many else value
    return out


def _rope_parameters(raw: Mapping[str, Any], arch: ArchitectureSpec, heads: int, head_dim: int,
                     problems: list[str]) -> dict | None:
    """RoPE parameters as transformers' own config class standardizes them, checked for what DeepseekV3 can express.

    The class also validates the architecture (transformers 5 refuses a hidden size that is not a multiple of
    the heads even with an explicit head_dim); that is not a RoPE fact and mla-convert converts such models,
    so the class sees a hidden size consistent with the heads and everything else as written.
    """
    for key in ("rope_parameters", "rope_scaling"):
        if raw.get(key) is not None and not isinstance(raw.get(key), dict):
            problems.append(f"config.json: {key} must be a JSON object (found {raw.get(key)!r})")
            return None
    if "rope_theta" in raw and not (_is_number(raw["rope_theta"]) and raw["rope_theta"] > 0):
        problems.append(f"config.json: rope_theta must be a positive number (found {raw['rope_theta']!r})")
        return None
    class_name = arch.config_class.rpartition(".")[2]
    try:
        params = dict(getattr(_family_config(raw, arch, heads, head_dim), "rope_parameters", None) or {})
    except Exception as error:  # transformers validates in its own ways; report the reason it gives
        reason = error.__cause__ or error
        first_line = (str(reason).strip().splitlines() or [type(reason).__name__])[0]
        problems.append(f"config.json: transformers' {class_name} rejects its RoPE settings ({first_line})")
        return None
    params.pop("type", None)  # the legacy key; transformers keeps it beside rope_type
    params.setdefault("rope_type", "default")
    rope_problems = _unsupported_rope(params, head_dim)
    problems += [f"config.json: {p}" for p in rope_problems]
    return None if rope_problems else params


# Keys a transformers config class must not receive from a hostile file: they select remote code or
# change how the class itself behaves, not the model.
IGNORED_BY_CONFIG_CLASS = ("auto_map", "transformers_version", "_name_or_path", "architectures")


def _unsupported_rope(params: dict, head_dim: int) -> list[str]:
    from .model import rope_inv_freq

    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        return [f"RoPE type {rope_type!r} (as transformers resolves this config) is not supported; "
                f"mla-convert reproduces {', '.join(SUPPORTED_ROPE_TYPES)}"]
    theta = params.get("rope_theta")
    if not (_is_number(theta) and theta > 0):
        return [f"rope_theta must be a positive number (found {theta!r})"]
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        return [f"partial_rotary_factor {params.get('partial_rotary_factor')!r} is not supported: only part of each head "
                "rotates, and mla-convert's split of the keys into a rotated and a latent part assumes the whole head "
                "does (factor 1, what Llama, Mistral, Qwen2, Phi-3 and Phi-4 checkpoints use; Phi-4-mini rotates 0.75)"]
    missing = [key for key in ROPE_REQUIRED_KEYS.get(rope_type, ()) if key not in params]
    if missing:
        return [f"rope_parameters of type {rope_type!r} lack {', '.join(repr(k) for k in missing)}"]
    if rope_type in ROPE_REQUIRED_KEYS:  # the ranges transformers' RoPE code assumes (it only warns)
        factor = params["factor"]
        if not (_is_number(factor) and factor >= 1):
            return [f"rope_parameters: factor must be a number >= 1 (found {factor!r})"]
    if rope_type == "llama3":
        low, high, original = params["low_freq_factor"], params["high_freq_factor"], params["original_max_position_embeddings"]
        if not (_is_number(low) and _is_number(high) and 0 < low < high):
            return [f"rope_parameters: llama3 needs 0 < low_freq_factor < high_freq_factor (found {low!r}, {high!r})"]
        if not (_is_int(original) and original > 0):
            return [f"rope_parameters: original_max_position_embeddings must be a positive integer (found {original!r})"]
    try:
        inv_freq = rope_inv_freq(params, head_dim)
    except Exception as error:  # transformers' RoPE initialisers validate in their own ways
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return [f"rope_parameters {params} cannot be used ({first_line})"]
    if not bool(torch.isfinite(inv_freq).all()) or not bool((inv_freq > 0).all()):
        return [f"rope_parameters {params} give non-finite or non-positive frequencies"]
    return []
