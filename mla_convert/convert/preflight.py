"""Pre-flight validation: every problem a conversion could hit late, found before any heavy work.

A conversion can run for hours; failing at layer 70 because layer 71's k_proj has the wrong shape, or
because the disk fills while writing, wastes all of it.  The checks here read only the config, the
safetensors headers and the file system, and return every problem at once, one line each (the CLI
prints each as an `error:` line).  `source_finite_problems` is the one check that reads tensor data:
it runs after these, before the first forward pass, so a NaN in a weight is named instead of turning
into a sampling failure deep inside torch.

docs/robustness.md lists every bad input the tests try and the exact message the user sees.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

from ..source.architectures import architecture_for_config
from ..io.reader import CheckpointReader
from ..errors import MLAConvertError, NonFiniteError
from .rope import rope_problems
from ..source.shapes import MLAShape, SourceShape, dtype_bytes, human_bytes, parse_dtype, shape_problems

REQUIRED_CONFIG_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")
# What the RoPE types mla-convert reproduces need beyond rope_theta (transformers' own requirements).
ROPE_REQUIRED_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# Tokenizer files `AutoTokenizer` can build a tokenizer from (needed only to tokenise --calib-data).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# Bytes beyond the weights: config, generation config, model card, mla_convert.json.
OUTPUT_OVERHEAD_BYTES = 256 * 1024
# At most this many per-tensor lines; a config that does not match the checkpoint would otherwise
# print one line per tensor of every layer.
MAX_TENSOR_LINES = 8
FREE_SPACE_MARGIN = 1.05


# --------------------------------------------------------------------------- config.json
def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def config_problems(config: dict) -> list[str]:
    """Missing or inconsistent attention facts in `config.json`."""
    architectures = config.get("architectures")
    if architectures is not None and not (isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)):
        return [f"config.json: architectures must be a list of class names (found {architectures!r})"]
    if not architectures and not config.get("model_type"):
        return ["config.json: names no architecture (no 'architectures' or 'model_type'); is this a model's config?"]
    try:
        arch = architecture_for_config(config)
    except MLAConvertError as error:
        return [str(error)]
    problems = []
    for key in REQUIRED_CONFIG_KEYS:
        value = config.get(key)
        if not _positive_int(value):
            problems.append(f"config.json: {key} must be a positive integer (found {value!r})")
    if problems:
        return problems
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else kv_heads
    if not _positive_int(kv_heads):
        problems.append(f"config.json: num_key_value_heads must be a positive integer (found {kv_heads!r})")
    elif heads % kv_heads:
        problems.append(f"config.json: num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
    head_dim = config.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            problems.append(f"config.json: num_attention_heads {heads} does not divide hidden_size {hidden} (and no head_dim is given)")
        head_dim = hidden // heads
    if not _positive_int(head_dim):
        problems.append(f"config.json: head_dim must be a positive integer (found {head_dim!r})")
        head_dim = None
    elif head_dim % 2:
        problems.append(f"config.json: head_dim {head_dim} is odd; RoPE rotates pairs of dimensions")
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        problems.append(f"config.json: hidden_act {config.get('hidden_act')!r} is not supported (DeepseekV3's MLP uses silu)")
    for key, bad in arch.unsupported_config.items():
        if config.get(key) == bad:
            problems.append(f"config.json: {key}={bad!r} is not supported (DeepseekV3 has no such attention)")
    if arch.has_mlp_bias(config):
        problems.append("config.json: mlp_bias=true is not supported (DeepseekV3's MLP has no biases)")
    for key in ("rms_norm_eps",):
        if key in config and not _positive_number(config[key]):
            problems.append(f"config.json: {key} must be a positive number (found {config[key]!r})")
    if "max_position_embeddings" in config and not _positive_int(config["max_position_embeddings"]):
        problems.append(f"config.json: max_position_embeddings must be a positive integer (found {config['max_position_embeddings']!r})")
    problems += _token_id_problems(config)
    if "initializer_range" in config and not _positive_number(config["initializer_range"]):
        problems.append(f"config.json: initializer_range must be a positive number (found {config['initializer_range']!r})")
    for key in ("dtype", "torch_dtype"):
        if config.get(key) is not None:
            try:
                parse_dtype(config[key])
            except (MLAConvertError, TypeError):
                problems.append(f"config.json: {key} {config[key]!r} is not a dtype mla-convert reads (float32, float16, bfloat16)")
            break  # `dtype` wins over the older `torch_dtype`, as in transformers
    if head_dim is not None and head_dim % 2 == 0:
        problems += [f"config.json: {p}" for p in _rope_config_problems(config, head_dim)]
    return problems


def _token_id_problems(config: dict) -> list[str]:
    """Special token ids as DeepseekV3Config accepts them (it validates strictly, at export time)."""
    vocab = config["vocab_size"]
    problems = []
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        ids = value if (key == "eos_token_id" and isinstance(value, list) and value) else [value]
        if value is None:
            continue
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            problems.append(f"config.json: {key} must be a token id (an integer{' or a list of them' if key == 'eos_token_id' else ''}); found {value!r}")
        elif key == "bos_token_id" and not 0 <= value < vocab:
            problems.append(f"config.json: bos_token_id {value} is outside the vocabulary (vocab_size {vocab})")
    return problems


def _rope_config_problems(config: dict, head_dim: int) -> list[str]:
    """The RoPE parameters are of a supported type, complete, and give finite positive frequencies."""
    from ..source.shapes import source_rope_parameters
    from ..source.model import rope_inv_freq

    raw = config.get("rope_parameters") or config.get("rope_scaling")
    if raw is not None and not isinstance(raw, dict):
        return [f"rope_parameters must be a JSON object (found {raw!r})"]
    try:
        params = source_rope_parameters(config)
    except (TypeError, ValueError):
        return [f"rope_theta must be a positive number (found {config.get('rope_theta')!r})"]
    theta = params.get("rope_theta")
    if not _positive_number(theta):
        return [f"rope_theta must be a positive number (found {theta!r})"]
    try:
        problems = rope_problems(params, head_dim)
    except (TypeError, ValueError) as error:
        return [f"rope_parameters {params} cannot be read ({error})"]
    if problems:
        return problems
    rope_type = params.get("rope_type", "default")
    missing = [key for key in ROPE_REQUIRED_KEYS.get(rope_type, ()) if key not in params]
    if missing:
        return [f"rope_parameters of type {rope_type!r} lack {', '.join(repr(k) for k in missing)}"]
    if rope_type in ROPE_REQUIRED_KEYS:  # the ranges transformers' RoPE code assumes (it only warns)
        factor = params["factor"]
        if not (_positive_number(factor) and factor >= 1):
            return [f"rope_parameters: factor must be a number >= 1 (found {factor!r})"]
    if rope_type == "llama3":
        low, high, original = params["low_freq_factor"], params["high_freq_factor"], params["original_max_position_embeddings"]
        if not (_positive_number(low) and _positive_number(high) and low < high):
            return [f"rope_parameters: llama3 needs 0 < low_freq_factor < high_freq_factor (found {low!r}, {high!r})"]
        if not _positive_int(original):
            return [f"rope_parameters: original_max_position_embeddings must be a positive integer (found {original!r})"]
    try:
        inv_freq = rope_inv_freq(params, head_dim)
    except Exception as error:  # transformers' RoPE initialisers validate in their own ways
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return [f"rope_parameters {params} cannot be used ({first_line})"]
    if not bool(torch.isfinite(inv_freq).all()) or not bool((inv_freq > 0).all()):
        return [f"rope_parameters {params} give non-finite or non-positive frequencies"]
    return []


# --------------------------------------------------------------------------- tensors
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
            "gate_bias": (inter,), "up_bias": (inter,), "down_bias": (d,),
            "input_norm": (d,), "post_attn_norm": (d,),
        }
        for role, name in names.items():
            out[name] = expected[role]
    return out


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def tensor_problems(reader: CheckpointReader, shape: SourceShape, config: dict) -> list[str]:
    """Every expected tensor is stored, with the expected shape and a floating-point dtype (headers only)."""
    damaged = reader.header_problems()
    if damaged:
        return damaged
    try:
        infos = reader.tensor_infos()
    except MLAConvertError as error:
        return [str(error)]
    problems = []
    for name, wanted in expected_tensor_shapes(shape, config).items():
        info = infos.get(name)
        if info is None:
            problems.append(f"{reader.folder}: tensor {name!r} is missing (expected shape {list(wanted)})")
        elif info.shape != wanted:
            problems.append(f"{reader.folder / info.file}: tensor {name!r} has shape {list(info.shape)}, expected {list(wanted)}")
        elif not info.dtype.is_floating_point:
            problems.append(f"{reader.folder / info.file}: tensor {name!r} has dtype {info.dtype}, expected a floating-point dtype")
    if len(problems) > MAX_TENSOR_LINES:
        problems = problems[:MAX_TENSOR_LINES] + [f"{reader.folder}: ... and {len(problems) - MAX_TENSOR_LINES} more tensor problems"]
    stored_layers = {int(m.group(1)) for m in map(_LAYER_INDEX.match, infos) if m}
    if problems and stored_layers and len(stored_layers) != shape.num_layers:
        problems.insert(0, f"config.json: num_hidden_layers is {shape.num_layers}, but the checkpoint holds {len(stored_layers)} layers")
    return problems


def source_finite_problems(reader: CheckpointReader, names: list[str], progress: Callable | None = None) -> list[str]:
    """One line per tensor holding NaN or Inf (reads the data, a tensor at a time, in chunks)."""
    problems = []
    chunk = 1 << 20  # elements per block: the block, its mask and isfinite's temporaries stay a few MB
    infos = reader.tensor_infos()
    for done, name in enumerate(sorted(names, key=lambda n: (reader.weight_map.get(n, ""), n)), start=1):
        info = infos.get(name)
        if info is None:
            reader.get(name)  # raises the reader's "missing from the checkpoint" error
        elif info.dtype.is_floating_point:
            bad, numel = _non_finite_count(reader, name, info.shape, chunk)
            if bad:
                problems.append(
                    f"{reader.folder / reader.weight_map[name]}: tensor {name!r} holds {bad} NaN/Inf values "
                    f"(of {numel}); the checkpoint is damaged, nothing was written"
                )
        if progress:
            progress(done, len(names))
    return problems


def _non_finite_count(reader: CheckpointReader, name: str, shape: tuple[int, ...], chunk: int) -> tuple[int, int]:
    """(NaN/Inf count, element count) of one tensor, read in row blocks of about `chunk` elements.

    Each block is read and the shard closed again: tensors are views of a memory mapping, and the pages
    scanned would otherwise stay in this process's resident memory (the whole checkpoint, in the end).
    """
    numel = math.prod(shape)
    rows = shape[0] if shape else 1
    block = max(1, chunk // max(1, numel // max(rows, 1)))  # rows per block
    if reader.format != "safetensors":
        block = rows  # a pickle is loaded whole per open: one block
    bad = 0
    for start in range(0, rows, block):
        part = reader.get_rows(name, start, min(rows, start + block)) if shape else reader.get(name)
        finite = torch.isfinite(part)
        if not bool(finite.all()):
            bad += int((~finite).sum())
        del part, finite
        reader.close()
    return bad, numel


def check_source_finite(reader: CheckpointReader, shape: SourceShape, config: dict, progress: Callable | None = None) -> None:
    """Raise `NonFiniteError` naming every source tensor that holds NaN or Inf."""
    problems = source_finite_problems(reader, list(expected_tensor_shapes(shape, config)), progress)
    if problems:
        raise NonFiniteError("\n".join(problems))


# --------------------------------------------------------------------------- options
def calibration_problems(folder: Path, calibration, config: dict | None = None) -> list[str]:
    """The calibration options make sense and a local calibration text exists, is readable and not empty."""
    problems = []
    if calibration.num_samples < 1:
        problems.append(f"--calib-samples {calibration.num_samples}: must be at least 1")
    if calibration.seq_len < 2:
        problems.append(f"--calib-seq-len {calibration.seq_len}: must be at least 2 (attention needs two positions)")
    for key in ("chunk", "error_samples", "profile_samples"):
        if getattr(calibration, key) < 1:
            problems.append(f"calibration {key} {getattr(calibration, key)}: must be at least 1")
    if not 0 < calibration.top_p <= 1:
        problems.append(f"calibration top_p {calibration.top_p}: must be in (0, 1]")
    if not calibration.temperature >= 0:
        problems.append(f"calibration temperature {calibration.temperature}: must not be negative")
    if calibration.data is None:
        return problems
    if not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        problems.append(
            f"{folder}: --calib-data needs the source model's tokenizer, but the folder has none "
            f"({', '.join(TOKENIZER_FILES)}); leave out --calib-data to sample calibration text from the model"
        )
    problems += tokenizer_code_problems(Path(folder))
    problems += _local_text_problems(calibration.data, calibration.text_column)
    return problems


def tokenizer_code_problems(folder: Path) -> list[str]:
    """A tokenizer that exists only as custom code in the model folder is refused, never run.

    transformers would ask "Do you wish to run the custom code? [y/N]" (and run it on "y"), or fail with a
    ValueError when nobody can answer; mla-convert never runs code from a model folder.
    """
    import json

    path = folder / "tokenizer_config.json"
    try:
        tokenizer_config = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    auto_map = tokenizer_config.get("auto_map") if isinstance(tokenizer_config, dict) else None
    wants_code = (isinstance(auto_map, dict) and "AutoTokenizer" in auto_map) or isinstance(auto_map, list)
    if not wants_code:
        return []
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    class_name = tokenizer_config.get("tokenizer_class")
    if isinstance(class_name, str) and tokenizer_class_from_name(class_name) is not None:
        return []  # transformers has the class itself and uses it; the custom code is not needed
    return [
        f"{path}: the tokenizer {class_name!r} exists only as custom code in the model folder (auto_map); "
        "mla-convert never runs code from a model folder. Leave out --calib-data to sample calibration text from the model"
    ]


def _local_text_problems(spec: str, text_column: str) -> list[str]:
    """Read the start of a local calibration file or folder (a dataset spec is checked when it is loaded)."""
    from ..eval.textdata import _looks_like_path, load_text

    path = Path(str(spec)).expanduser()
    if not (path.exists() or (":" not in str(spec) and _looks_like_path(str(spec)))):
        return []
    try:
        load_text(spec, text_column=text_column, max_chars=1 << 16)
    except MLAConvertError as error:
        return [f"--calib-data: {error}"]
    return []


def shard_size_problems(max_shard_size) -> list[str]:
    from ..io.writer import parse_shard_size

    try:
        size = parse_shard_size(max_shard_size)
    except ValueError as error:
        return [f"--max-shard-size: {error}"]
    return [] if size > 0 else [f"--max-shard-size {max_shard_size!r}: must be positive"]


def device_problems(device: str) -> list[str]:
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        return [f"--device {device!r}: not a device (use cpu or cuda)"]
    if parsed.type == "cuda" and not torch.cuda.is_available():
        return [f"--device {device}: no CUDA device is available"]
    return []


# --------------------------------------------------------------------------- output and disk
def output_problems(output: Path, source: Path, overwrite: bool) -> list[str]:
    """With --overwrite, the output must not be (or contain) the source model: replacing it deletes the source."""
    if not overwrite or not output.exists():
        return []
    out, src = output.resolve(), Path(source).resolve()
    if out == src or out in src.parents:
        return [f"{output}: is the source model folder or contains it; --overwrite would delete the source. Choose another output path"]
    return []


def estimated_output_bytes(shape: SourceShape, mla: MLAShape, dtype: torch.dtype) -> int:
    d, H, h, D, R, inter = shape.hidden_size, shape.num_heads, shape.head_dim, mla.rope_dim, mla.kv_lora_rank, shape.intermediate_size
    q_rows = H * (h + D)
    query = q_rows * d if mla.q_lora_rank is None and not shape.qkv_bias else (mla.q_lora_rank or d) * (d + q_rows + 2)
    per_layer = query + (R + D) * (d + 1) + R + H * 2 * h * R + d * H * h + d + 3 * d * inter + 2 * d
    total = shape.vocab_size * d * (1 if shape.tied_embeddings else 2) + d + shape.num_layers * per_layer
    return total * dtype_bytes(dtype)


def estimated_statistics_bytes(shape: SourceShape, calibration) -> int:
    """Size of the per-layer calibration statistics spilled to the temp folder (calibration.StatsStore)."""
    d, T = shape.hidden_size, calibration.seq_len
    kept = min(calibration.error_samples, max(calibration.num_samples, 0))
    per_layer = d * d * 8 + d * 8 + kept * T * d * 4 + shape.num_heads * T * 8
    return shape.num_layers * per_layer


def sidecar_bytes(source: Path) -> int:
    from ..io.writer import SIDECAR_FILES

    return sum((Path(source) / name).stat().st_size for name in SIDECAR_FILES if (Path(source) / name).is_file())


def disk_problems(output: Path, needed: int) -> list[str]:
    parent = output.parent if output.parent.exists() else None
    if parent is None:
        return [f"{output.parent}: parent folder does not exist"]
    problems = []
    if not os.access(parent, os.W_OK):
        problems.append(f"{parent}: not writable")
        return problems
    free = shutil.disk_usage(parent).free
    if free < needed * FREE_SPACE_MARGIN:
        problems.append(f"{parent}: {human_bytes(free)} free, the output needs about {human_bytes(needed)}")
    return problems


def scratch_problems(needed: int) -> list[str]:
    """The temp folder (TMPDIR) must hold the calibration statistics."""
    try:
        scratch = Path(tempfile.gettempdir())
    except FileNotFoundError as error:  # no usable temp folder at all
        return [f"no writable temp folder for the calibration statistics ({error}); set TMPDIR"]
    if not os.access(scratch, os.W_OK):
        return [f"{scratch}: temp folder not writable (the calibration statistics go there); set TMPDIR"]
    free = shutil.disk_usage(scratch).free
    if free < needed * FREE_SPACE_MARGIN:
        return [
            f"{scratch}: {human_bytes(free)} free, the calibration statistics need about {human_bytes(needed)}; "
            "set TMPDIR to a folder on a larger disk"
        ]
    return []


def storage_problems(output: Path, shape: SourceShape, mla: MLAShape, dtype: torch.dtype, source: Path,
                     calibration) -> tuple[list[str], str]:
    """Free-space problems for the output and the temp folder, and a one-line estimate to show the user."""
    needed = estimated_output_bytes(shape, mla, dtype) + sidecar_bytes(source) + OUTPUT_OVERHEAD_BYTES
    statistics = estimated_statistics_bytes(shape, calibration)
    problems = disk_problems(output, needed) + scratch_problems(statistics)
    summary = f"disk: the output needs about {human_bytes(needed)}"
    if output.parent.exists():
        summary += f" ({human_bytes(shutil.disk_usage(output.parent).free)} free in {output.parent})"
    summary += f"; calibration statistics about {human_bytes(statistics)} in {tempfile.gettempdir()}"
    return problems, summary


# --------------------------------------------------------------------------- all of it
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


def output_path_problems(output: Path, overwrite: bool, source: Path | None = None) -> list[str]:
    """Output-path problems found without touching anything (reported even when the source is broken)."""
    from ..io.writer import prepare_output_path

    problems = []
    try:
        prepare_output_path(output, overwrite)
    except MLAConvertError as error:
        problems.append(str(error))
    if source is not None and Path(source).exists():
        problems += output_problems(output, Path(source), overwrite)
    return problems
