"""Write the fine-tuned model as the same stock DeepseekV3 folder `convert` writes.

Same tensors (names, shards via `CheckpointWriter`, atomic appearance), `config.json` rebuilt by the
installed `DeepseekV3Config`, the converted folder's tokenizer / generation config / chat template,
`mla_convert.json` (the conversion report with the new latent scales and a `finetuning` section) and
the model card regenerated from that report.  The latent scales are folded back first
(`latent.fold_latent_scales`), so the stored `kv_a_layernorm` / `q_a_layernorm` stay linear.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from ..convert.report import REPORT_FILE
from ..convert.target import FP16_REFUSED
from ..errors import MLAConvertError
from ..hub.card import CARD_FILE
from ..io.reader import CheckpointReader
from ..io.writer import CheckpointWriter
from ..units import parse_dtype
from .latent import LatentSite, fold_latent_scales


class FinetuneSaveError(MLAConvertError):
    pass


def stored_tensor_names(folder: Path) -> list[str]:
    """Tensor names of a safetensors model folder, in the order its index (or single file) lists them."""
    try:
        with CheckpointReader(folder) as reader:
            return reader.keys()
    except MLAConvertError as error:
        raise FinetuneSaveError(str(error)) from error


def resolve_save_dtype(name: str, converted_config) -> torch.dtype:
    if name == "auto":
        dtype = getattr(converted_config, "dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    else:
        dtype = parse_dtype(name)
    if dtype == torch.float16:
        raise FinetuneSaveError(f"save_dtype fp16: {FP16_REFUSED}")
    return dtype


def updated_report(report: dict, sites: list[LatentSite], scales: list[float], finetuning: dict, dtype: torch.dtype) -> dict:
    """The conversion report with the folded latent scales, the save dtype and the finetuning section."""
    out = copy.deepcopy(report) if report else {}
    layers = out.get("layers") or []
    by_index = {layer.get("layer", i): layer for i, layer in enumerate(layers) if isinstance(layer, dict)}
    for site, scale in zip(sites, scales):
        entry = by_index.get(site.layer)
        if entry is not None:
            entry["latent_scale" if site.kind == "kv" else "query_latent_scale"] = scale
    dtype_name = str(dtype).replace("torch.", "")
    cache = out.get("cache")
    if isinstance(cache, dict) and cache.get("dtype") and cache["dtype"] != dtype_name:
        old = torch.empty((), dtype=getattr(torch, cache["dtype"])).element_size()
        new = torch.empty((), dtype=dtype).element_size()
        for key in ("source_bytes_per_token", "mla_bytes_per_token"):
            if isinstance(cache.get(key), (int, float)):
                cache[key] = cache[key] * new // old
        cache["dtype"] = dtype_name
    if isinstance(out.get("options"), dict):
        out["options"]["dtype"] = dtype_name
    out["finetuning"] = finetuning
    return out


def save_finetuned(
    state_dict: dict[str, torch.Tensor],
    sites: list[LatentSite],
    converted: Path,
    output: Path,
    report: dict,
    finetuning: dict,
    save_dtype: str = "auto",
    max_shard_size: str = "5GB",
    overwrite: bool = False,
) -> tuple[Path, list[float]]:
    """Fold the latent scales, write the folder atomically; returns (path, alphas used per site)."""
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

    converted, output = Path(converted), Path(output)
    config = DeepseekV3Config.from_pretrained(str(converted))
    dtype = resolve_save_dtype(save_dtype, config)
    folded, scales = fold_latent_scales(state_dict, sites)
    names = stored_tensor_names(converted)
    missing = [name for name in names if name not in folded]
    if missing:
        raise FinetuneSaveError(f"trained state dict lacks {len(missing)} tensors of {converted} (first: {missing[0]})")
    final_report = updated_report(report, sites, scales, finetuning, dtype)
    writer = CheckpointWriter(output, max_shard_size, overwrite)
    with writer:
        for name in names:
            writer.add(name, folded[name].detach().to(device="cpu", dtype=dtype))
        config.dtype = dtype
        config.save_pretrained(writer.partial)
        writer.copy_sidecars(converted)
        write_report(writer.partial, final_report)
        path = writer.commit()
    return path, scales


def write_report(folder: Path, report: dict) -> None:
    """`mla_convert.json` (as `CheckpointWriter.write_json` writes it) and the model card built from it."""
    from ..hub.card import build_model_card

    (Path(folder) / REPORT_FILE).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    build_model_card(report).save(str(Path(folder) / CARD_FILE))
