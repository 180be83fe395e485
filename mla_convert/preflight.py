"""Pre-flight validation: every problem a conversion could hit late, found before any heavy work.

A conversion can run for hours; failing at layer 70 because layer 71's k_proj has the wrong shape, or
because the disk fills while writing, wastes all of it.  `preflight` reads only the config and the
safetensors headers and returns every problem at once, one line each.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from .architectures import architecture_for_config
from .checkpoint_reader import CheckpointReader
from .errors import MLAConvertError
from .rope import rope_problems
from .shapes import MLAShape, SourceShape, dtype_bytes, shape_problems

REQUIRED_CONFIG_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")


def config_problems(config: dict) -> list[str]:
    """Missing or inconsistent attention facts in `config.json`."""
    problems = []
    try:
        arch = architecture_for_config(config)
    except MLAConvertError as error:
        return [str(error)]
    for key in REQUIRED_CONFIG_KEYS:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            problems.append(f"config.json: {key} must be a positive integer (found {value!r})")
    if problems:
        return problems
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if not isinstance(kv_heads, int) or kv_heads <= 0:
        problems.append(f"config.json: num_key_value_heads must be a positive integer (found {kv_heads!r})")
    elif heads % kv_heads:
        problems.append(f"config.json: num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
    head_dim = config.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            problems.append(f"config.json: num_attention_heads {heads} does not divide hidden_size {hidden} (and no head_dim is given)")
        head_dim = hidden // heads
    if not isinstance(head_dim, int) or head_dim <= 0:
        problems.append(f"config.json: head_dim must be a positive integer (found {head_dim!r})")
    elif head_dim % 2:
        problems.append(f"config.json: head_dim {head_dim} is odd; RoPE rotates pairs of dimensions")
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        problems.append(f"config.json: hidden_act {config.get('hidden_act')!r} is not supported (DeepseekV3's MLP uses silu)")
    for key, bad in arch.unsupported_config.items():
        if config.get(key) == bad:
            problems.append(f"config.json: {key}={bad!r} is not supported (DeepseekV3 has no such attention)")
    if arch.has_mlp_bias(config):
        problems.append("config.json: mlp_bias=true is not supported (DeepseekV3's MLP has no biases)")
    if isinstance(head_dim, int) and head_dim > 0:
        from .shapes import source_rope_parameters

        problems.extend(f"config.json: {p}" for p in rope_problems(source_rope_parameters(config), head_dim))
    return problems


def expected_tensor_shapes(shape: SourceShape, config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor the converter will read, with the shape it must have."""
    arch = shape.architecture
    d, H, G, h, V, inter = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.vocab_size, shape.intermediate_size
    out = {arch.embed: (V, d), arch.final_norm: (d,)}
    if not shape.tied_embeddings:
        out[arch.lm_head] = (V, d)
    for layer in range(shape.num_layers):
        names = arch.layer_weight_names(layer, config)
        expected = {
            "q_weight": (H * h, d), "k_weight": (G * h, d), "v_weight": (G * h, d), "o_weight": (d, H * h),
            "q_bias": (H * h,), "k_bias": (G * h,), "v_bias": (G * h,), "o_bias": (d,),
            "gate_weight": (inter, d), "up_weight": (inter, d), "down_weight": (d, inter),
            "input_norm": (d,), "post_attn_norm": (d,),
        }
        for role, name in names.items():
            out[name] = expected[role]
    return out


def tensor_problems(reader: CheckpointReader, shape: SourceShape, config: dict) -> list[str]:
    problems = []
    infos = reader.tensor_infos()
    for name, wanted in expected_tensor_shapes(shape, config).items():
        info = infos.get(name)
        if info is None:
            problems.append(f"{reader.folder}: tensor {name!r} is missing (expected shape {list(wanted)})")
        elif info.shape != wanted:
            problems.append(f"{reader.folder / info.file}: tensor {name!r} has shape {list(info.shape)}, expected {list(wanted)}")
        elif not info.dtype.is_floating_point:
            problems.append(f"{reader.folder / info.file}: tensor {name!r} has dtype {info.dtype}, expected a floating-point dtype")
    return problems


def estimated_output_bytes(shape: SourceShape, mla: MLAShape, dtype: torch.dtype) -> int:
    d, H, h, D, R, inter = shape.hidden_size, shape.num_heads, shape.head_dim, mla.rope_dim, mla.kv_lora_rank, shape.intermediate_size
    q_rows = H * (h + D)
    query = q_rows * d if mla.q_lora_rank is None and not shape.qkv_bias else (mla.q_lora_rank or d) * (d + q_rows + 2)
    per_layer = query + (R + D) * (d + 1) + R + H * 2 * h * R + d * H * h + d + 3 * d * inter + 2 * d
    total = shape.vocab_size * d * (1 if shape.tied_embeddings else 2) + d + shape.num_layers * per_layer
    return total * dtype_bytes(dtype)


def disk_problems(output: Path, needed: int) -> list[str]:
    from .shapes import human_bytes

    parent = output.parent if output.parent.exists() else None
    if parent is None:
        return [f"{output.parent}: parent folder does not exist"]
    problems = []
    if not os.access(parent, os.W_OK):
        problems.append(f"{parent}: not writable")
        return problems
    free = shutil.disk_usage(parent).free
    if free < needed * 1.05:
        problems.append(f"{parent}: {human_bytes(free)} free, the output needs about {human_bytes(needed)}")
    return problems


def preflight(
    config: dict,
    reader: CheckpointReader | None,
    shape: SourceShape | None,
    mla: MLAShape | None,
    output: Path | None,
    dtype: torch.dtype,
) -> list[str]:
    """All problems, one line each (empty: go)."""
    problems = config_problems(config)
    if problems or shape is None:
        return problems
    if mla is not None:
        problems += shape_problems(shape, mla.kv_lora_rank, mla.rope_dim)
    if reader is not None:
        problems += tensor_problems(reader, shape, config)
    if output is not None and mla is not None:
        problems += disk_problems(output, estimated_output_bytes(shape, mla, dtype))
    return problems
