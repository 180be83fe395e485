"""Read an exported DeepseekV3 MLA folder: its config, every tensor, and the ids that end generation.

The runtime keeps the whole model in memory (it is for inference), so loading is simply every
safetensors shard read once.  What this module checks is what the runtime relies on and a stock
DeepseekV3 checkpoint might not provide: dense MLP layers only (the converter never writes MoE blocks),
a RoPE type whose frequencies do not depend on the sequence length (the runtime computes cos/sin per
absolute position), and no fp16 compute (the converter's latent is stored at ~1e-6 scale, which fp16
projections would flush to zero).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import RuntimeModelError

# what the runtime computes in (an fp16 export, which only a serving --target writes, is computed in fp32)
RUNTIME_DTYPES = "the runtime computes in bf16 or fp32 only (dtype auto computes an fp16 export in fp32)"

# RoPE types whose inverse frequencies are fixed at load (transformers' `dynamic_rope_update` changes
# the dynamic/longrope ones with the sequence length, which a per-position cache cannot follow).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class ExportedFolder:
    """Everything read from disk: the transformers config, the tensors and config.json's end-of-sequence ids."""

    path: Path
    config: object  # transformers DeepseekV3Config
    tensors: dict[str, torch.Tensor]
    eos_token_ids: tuple[int, ...]
    stored_dtype: torch.dtype


def config_eos_ids(config) -> tuple[int, ...]:
    """config.json's end-of-sequence ids: what `generate` stops at when the folder has no generation_config.json
    (one that exists decides alone: `GenerationSettings.eos_token_ids`)."""
    from .generation_settings import token_id_tuple

    return token_id_tuple(getattr(config, "eos_token_id", None), Path(config.name_or_path or ".") / "config.json")


def shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise RuntimeModelError(f"{path}: no *.safetensors files; export the model with `mla-convert convert` first")
    return files


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in shard_files(path):
        if not file.exists():
            raise RuntimeModelError(f"{file} is listed in the safetensors index but missing")
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


def check_supported(config, path: Path) -> None:
    """Refuse, in one line, anything the absorbed dense runtime would silently compute wrongly."""
    if getattr(config, "model_type", None) != "deepseek_v3":
        model_type = getattr(config, "model_type", None)
        raise RuntimeModelError(f"{path}: model_type {model_type!r}; the MLA runtime reads DeepseekV3 folders")
    if config.first_k_dense_replace < config.num_hidden_layers:
        raise RuntimeModelError(
            f"{path}: layers {config.first_k_dense_replace}..{config.num_hidden_layers - 1} are MoE; "
            "the MLA runtime only decodes dense models (first_k_dense_replace == num_hidden_layers)"
        )
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        supported = ", ".join(STATIC_ROPE_TYPES)
        raise RuntimeModelError(f"{path}: RoPE type {rope_type!r} is not supported (supported: {supported})")


def compute_dtype(requested: torch.dtype | None, stored: torch.dtype) -> torch.dtype:
    """The dtype every projection runs in: the stored one, except fp16, which becomes fp32.

    fp16's exponent cannot hold the converter's tiny-scale latent (see `convert.target`); bf16 can.
    """
    dtype = requested if requested is not None else (torch.float32 if stored == torch.float16 else stored)
    if dtype not in COMPUTE_DTYPES:
        raise RuntimeModelError(f"compute dtype {dtype} is not supported: {RUNTIME_DTYPES}")
    return dtype


def read_exported_folder(path: str | Path) -> ExportedFolder:
    from ..io.hf_loading import load_config

    path = Path(path)
    if not (path / "config.json").exists():
        raise RuntimeModelError(f"{path}: no config.json; give the folder written by `mla-convert convert`")
    config = load_config(path)
    check_supported(config, path)
    tensors = read_tensors(path)
    floating = [t.dtype for t in tensors.values() if t.is_floating_point()]
    stored = max(set(floating), key=floating.count) if floating else torch.float32
    return ExportedFolder(path, config, tensors, config_eos_ids(config), stored)
