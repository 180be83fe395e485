"""`mla_convert.json`: what a conversion did and measured, written beside the weights and read by the card.

A local source is recorded by its path relative to the output folder (a hub id as it is), so the report
(and the card built from it) never carries a machine's absolute paths, and a converted folder moved
together with its source still finds it (fine-tuning reads its teacher from there).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import __version__
from ..io.assets import read_provenance
from ..io.resolve import looks_like_hub_id
from ..options import ConvertOptions
from ..source.config import SourceConfig
from ..source.shapes import MLAShape
from ..units import dtype_bytes, dtype_name
from .layer import LayerReport
from .memory import peak_rss_bytes
from .rope import RopeGrid, declaration_note

REPORT_FILE = "mla_convert.json"


@dataclass
class ConversionFacts:
    """What the pipeline decided, gathered for the report."""

    source_name: str
    source_folder: Path
    output: Path
    source: SourceConfig
    mla: MLAShape
    options: ConvertOptions
    calibration_description: str
    calibration_tokens: int
    # of the calibration token ids: two runs calibrated on the same text (a sampled one included) share it
    calibration_fingerprint: str | None
    grid: RopeGrid
    rope_parameters: dict
    grid_table: list[dict]
    layer_reports: list[LayerReport]
    export_dtype: torch.dtype
    seconds: float
    q_lora_rank: int | None
    attention_bias: bool
    command: str | None = None
    serving: dict | None = None  # serving.serving_report: what the --target did (None for transformers)


def servable_targets(source) -> frozenset[str]:
    """The serving targets that have at least one MLA shape for this source (a target of any shape always has)."""
    from ..source.shapes import target_shapes
    from .target import TARGETS, target_of

    return frozenset(name for name in TARGETS if target_shapes(source, target_of(name)) != [])


def source_label(name: str, output: Path) -> tuple[str, str | None]:
    """(how the report names a source or text, its hub id or None): a local path, relative to the output folder;
    anything else (a hub id, a datasets spec) as given."""
    if Path(name).expanduser().exists():  # `~/models` given quoted is read from the home folder, so recorded from there
        return os.path.relpath(Path(name).expanduser().resolve(), Path(output).resolve()), None
    return name, (name if looks_like_hub_id(name) else None)


def source_card_license(folder: Path) -> str | None:
    """The `license` of the source folder's own model card (README.md metadata), if it names one."""
    from huggingface_hub import ModelCard

    readme = Path(folder) / "README.md"
    if not readme.is_file():
        return None
    try:
        license_id = ModelCard.load(readme, ignore_metadata_errors=True).data.license
    except Exception:  # a README that is not a card says nothing about the license
        return None
    return license_id if isinstance(license_id, str) and license_id else None


def hub_dataset(spec: str | None) -> str | None:
    """The hub dataset a `name[:subset[:split]]` text spec names (None for a local file or folder)."""
    if not spec or Path(str(spec)).expanduser().exists():
        return None
    name = str(spec).split(":")[0]
    return name if looks_like_hub_id(name) else None


def build_report(facts: ConversionFacts) -> dict:
    import safetensors
    import transformers

    from .engines import engine_compatibility, sentencepiece_vocabulary

    source, mla = facts.source, facts.mla
    src_values = source.kv_values_per_token_layer
    mla_values = mla.kv_values_per_token_layer
    size = dtype_bytes(facts.export_dtype)
    energies = [r.kept_energy for r in facts.layer_reports]
    errors = [r.attention_error for r in facts.layer_reports if r.attention_error is not None]
    name, hub_id = source_label(facts.source_name, facts.output)
    hub_id = facts.options.base_model or hub_id
    license_id = facts.options.license or source.license or source_card_license(facts.source_folder)
    options = facts.options.to_dict()
    dataset = hub_dataset(facts.options.calibration.data)
    if options["calibration"].get("data"):
        options["calibration"]["data"] = source_label(str(options["calibration"]["data"]), facts.output)[0]
    return {
        "mla_convert_version": __version__,
        "command": facts.command,
        "source": {
            "name_or_path": name,
            "hub_id": hub_id,
            "architecture": source.architecture.hf_architectures[0],
            "license": license_id,
            "num_layers": source.num_layers,
            "num_heads": source.num_heads,
            "num_kv_heads": source.num_kv_heads,
            "head_dim": source.head_dim,
            "hidden_size": source.hidden_size,
            "qkv_bias": source.qkv_bias,
            "rope_parameters": source.rope_parameters,
            "max_position_embeddings": source.max_position_embeddings,
            "rms_norm_eps": source.rms_norm_eps,
            "sliding_window": source.sliding_window,
            "sliding_layers": source.sliding_layers,  # of num_layers (None: no window)
            # Granite's activation scalars, by config key: folded into the export's weights (source/folds.py)
            "folded_multipliers": source.multipliers_by_config_key or None,
            # which dimensions RoPE rotates together: adjacent pairs (ERNIE 4.5, Helium) are read reordered into halves
            "rope_pairs": "adjacent" if source.architecture.interleaved_rope else "halves",
            # a source that is not the hub checkpoint itself (the demo's dequantized Q4_1 SmolLM2): the card says so
            "provenance": read_provenance(facts.source_folder),
        },
        "options": {**options, "kv_lora_rank": mla.kv_lora_rank, "rope_dim": mla.rope_dim,
                    "q_lora_rank": facts.q_lora_rank, "dtype": dtype_name(facts.export_dtype)},
        "calibration": {"description": facts.calibration_description, "tokens": facts.calibration_tokens,
                        "token_ids_sha256": facts.calibration_fingerprint, "datasets": [dataset] if dataset else []},
        "rope": {"grid": facts.grid.describe(), "offset": facts.grid.offset, "step": facts.grid.step,
                 "rope_parameters": facts.rope_parameters, "candidates": facts.grid_table,
                 "note": declaration_note(source.rope_parameters, facts.rope_parameters)},
        "cache": {
            "source_values_per_token_layer": src_values,
            "mla_values_per_token_layer": mla_values,
            "ratio": src_values / mla_values,
            "num_layers": source.num_layers,
            "dtype": dtype_name(facts.export_dtype),
            "source_bytes_per_token": src_values * source.num_layers * size,
            "mla_bytes_per_token": mla_values * source.num_layers * size,
        },
        "layers": [r.to_dict() for r in facts.layer_reports],
        "summary": {
            # rounded as each layer's is: the last bits of a LAPACK spectrum change with the thread count and the CPU
            "mean_kept_energy": round(sum(energies) / len(energies), 6),
            "min_kept_energy": round(min(energies), 6),
            "mean_attention_error": (sum(errors) / len(errors)) if errors else None,
            "seconds": round(facts.seconds, 2),
            "peak_rss_bytes": peak_rss_bytes(),
        },
        "evaluation": None,
        "finetuning": None,
        "serving": facts.serving,
        "engines": engine_compatibility(mla, facts.attention_bias, facts.q_lora_rank, facts.options.target,
                                        tied=(facts.serving or {}).get("tie_word_embeddings", source.tied_embeddings),
                                        servable=servable_targets(source), num_layers=source.num_layers,
                                        sentencepiece=sentencepiece_vocabulary(facts.source_folder),
                                        rope_parameters=facts.rope_parameters),
        "versions": {
            "mla_convert": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "safetensors": safetensors.__version__,
            "python": platform.python_version(),
        },
    }
