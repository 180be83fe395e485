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

import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ..devices import device_problems
from ..errors import MLAConvertError, NonFiniteError, PreflightError
from ..io.paths import not_utf8_problem, read_model_text, special_file_problems, within
from ..io.reader import CheckpointReader, split_row_view
from ..io.writer import SIDECAR_FILES, clean_stale_partial, parse_shard_size, prepare_output_path
from ..options import ConvertOptions, option_problems
from ..source.config import SourceConfig, sliding_phrase
from ..source.folds import family_notes
from ..source.shapes import MLAShape, pick_target_shape, shape_choice_note, shape_problems
from ..units import dtype_bytes, human_bytes, parse_dtype
from . import target as T
from .engines import rope_problems

# Tokenizer files `AutoTokenizer` can build a tokenizer from (needed only to tokenise --calib-data).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# Bytes beyond the weights: config, generation config, model card, mla_convert.json.
OUTPUT_OVERHEAD_BYTES = 256 * 1024
# At most this many per-tensor lines; a config that does not match the checkpoint would otherwise
# print one line per tensor of every layer.
MAX_TENSOR_LINES = 8
FREE_SPACE_MARGIN = 1.05
# safetensors header of one layer's statistics file (five named tensors), rounded up
STATS_HEADER_BYTES = 1024
# Source files copied (or parsed) late, checked for being readable JSON up front.
SIDECAR_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                "added_tokens.json", "chat_template.json", "vocab.json")


# --------------------------------------------------------------------------- tensors
def expected_tensor_shapes(shape: SourceConfig) -> dict[str, tuple[int, ...]]:
    """Every stored tensor the converter will read, with the shape it must have."""
    arch = shape.architecture
    d, H, G, h, V, inter = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.vocab_size, shape.intermediate_size
    out = {arch.embed: (V, d), arch.final_norm: (d,)}
    if not shape.tied_embeddings:
        out[arch.lm_head] = (V, d)
    for layer in range(shape.num_layers):
        names = shape.layer_weight_names(layer)
        expected = {
            "q_weight": (H * h, d), "k_weight": (G * h, d), "v_weight": (G * h, d), "o_weight": (d, H * h),
            "q_bias": (H * h,), "k_bias": (G * h,), "v_bias": (G * h,), "o_bias": (d,),
            "gate_weight": (inter, d), "up_weight": (inter, d), "down_weight": (d, inter),
            "gate_bias": (inter,), "up_bias": (inter,), "down_bias": (d,),
            "input_norm": (d,), "post_attn_norm": (d,),
        }
        for role, name in names.items():
            view = split_row_view(name)
            if view is None:
                out[name] = expected[role]
            else:  # a role stored fused with others (Phi-3's qkv_proj): the stored matrix holds their rows in turn
                stored, _, stop = view
                out[stored] = (max(stop, out.get(stored, (0,))[0]), *expected[role][1:])
    return out


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def _copies_identical(reader: CheckpointReader, name: str, stray_files: list[str]) -> bool:
    """Whether every stray copy of `name` holds what the indexed one holds (dtype, shape and bytes): then either
    copy is the same model (a re-sharded checkpoint may repeat a tensor), and nothing is ambiguous."""
    try:
        indexed = reader.get(name)
        return all(_same_bytes(indexed, reader.get_from(file, name)) for file in stray_files)
    except MLAConvertError:  # an unreadable copy is not known to be the same
        return False


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                       b.reshape(-1).view(torch.uint8))


BASE_PREFIX = "model."  # where a *ForCausalLM checkpoint keeps the base model's tensors


def tensor_problems(reader: CheckpointReader, shape: SourceConfig) -> list[str]:
    """Every expected tensor is stored, with the expected shape and a floating-point dtype (headers only, except
    that a tensor stored twice is read to compare its copies)."""
    damaged = reader.header_problems()
    if damaged:
        return damaged
    try:
        infos = reader.tensor_infos()
    except MLAConvertError as error:
        return [str(error)]
    problems = [f"{reader.folder}: tensor {name!r} is stored in {', '.join(files)} as well as in {infos[name].file}, the "
                "shard the index names, and the copies differ; transformers may load either, so the conversion could describe another "
                "model: remove the stray copy" for name, files in sorted(reader.stray_copies.items())
                if name in infos and not _copies_identical(reader, name, files)]
    expected = expected_tensor_shapes(shape)
    unprefixed = [name for name in expected if name.startswith(BASE_PREFIX) and name not in infos
                  and name.removeprefix(BASE_PREFIX) in infos]
    if unprefixed:  # one cause, not a "missing" line per tensor
        return problems + [f"{reader.folder}: the tensors are stored without the '{BASE_PREFIX}' prefix (e.g. "
                           f"{unprefixed[0].removeprefix(BASE_PREFIX)!r} for {unprefixed[0]!r}), as a base model saves "
                           "them; mla-convert reads the names a *ForCausalLM checkpoint has: load the folder with "
                           "AutoModelForCausalLM.from_pretrained and save_pretrained it again"]
    for name, wanted in expected.items():
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
    beyond = sorted(name for name in infos if (m := _LAYER_INDEX.match(name)) and int(m.group(1)) >= shape.num_layers)
    if beyond:  # (transformers drops them when it loads the source: this is a checkpoint of another model)
        problems.append(f"{reader.folder}: {len(beyond)} tensor(s) of layers config.json does not have (num_hidden_layers "
                        f"{shape.num_layers}; e.g. {beyond[0]!r}): the weights and config.json come from different models")
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

    Each block is a copy read from the shard and freed before the next: the scan holds one block, never the tensor.
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
    return bad, numel


def check_source_finite(reader: CheckpointReader, shape: SourceConfig, progress: Callable | None = None) -> None:
    """Raise `NonFiniteError` naming every source tensor that holds NaN or Inf."""
    problems = source_finite_problems(reader, list(expected_tensor_shapes(shape)), progress)
    if problems:
        raise NonFiniteError("\n".join(problems))


# --------------------------------------------------------------------------- options
def calibration_problems(folder: Path, calibration) -> list[str]:
    """A local calibration text exists, is readable and not empty, and the tokenizer it needs is there.

    (The option values themselves are checked against their declared ranges by `option_problems`.)
    """
    problems = []
    if calibration.data is None:
        return problems
    if not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        problems.append(
            f"{folder}: --calib-data needs the source model's tokenizer, but the folder has none "
            f"({', '.join(TOKENIZER_FILES)}); leave out --calib-data to sample calibration text from the model"
        )
    problems += tokenizer_code_problems(Path(folder))
    problems += local_text_problems(calibration.data, calibration.text_column)
    return problems


def calibration_length_problems(source: SourceConfig, calibration) -> list[str]:
    """Calibration windows no longer than the positions the source was trained on.

    Past `max_position_embeddings` the factorization would be fitted to attention the model never computed in
    training (and sampling that much text from the model is slow: 100K tokens take hours on a CPU).
    """
    if calibration.seq_len > source.max_position_embeddings:
        return [f"--calib-seq-len {calibration.seq_len}: longer than the source's max_position_embeddings "
                f"{source.max_position_embeddings}"]
    if calibration.seq_len > source.export_max_positions:  # the streamed source attends to every position, unlike both
        return [f"--calib-seq-len {calibration.seq_len}: longer than the {source.export_max_positions} tokens the source's "
                "sliding window attends to (and the export's max_position_embeddings); calibration would fit attention "
                "that neither model computes"]
    return []


def tokenizer_code_problems(folder: Path) -> list[str]:
    """A tokenizer that exists only as custom code in the model folder is refused, never run.

    transformers would ask "Do you wish to run the custom code? [y/N]" (and run it on "y"), or fail with a
    ValueError when nobody can answer; mla-convert never runs code from a model folder.
    """
    import json

    path = folder / "tokenizer_config.json"
    try:
        settings = json.loads(read_model_text(path))
    except (OSError, ValueError):
        return []
    auto_map = settings.get("auto_map") if isinstance(settings, dict) else None
    wants_code = (isinstance(auto_map, dict) and "AutoTokenizer" in auto_map) or isinstance(auto_map, list)
    if not wants_code:
        return []
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    class_name = settings.get("tokenizer_class")
    if isinstance(class_name, str) and tokenizer_class_from_name(class_name) is not None:
        return []  # transformers has the class itself and uses it; the custom code is not needed
    return [
        f"{path}: the tokenizer {class_name!r} exists only as custom code in the model folder (auto_map); "
        "mla-convert never runs code from a model folder. Leave out --calib-data to sample calibration text from the model"
    ]


def local_text_problems(spec: str, text_column: str) -> list[str]:
    """Read the start of a local calibration file or folder (a dataset spec is checked when it is loaded)."""
    from ..data.textdata import load_text, looks_like_path

    path = Path(str(spec)).expanduser()
    if not (path.exists() or (":" not in str(spec) and looks_like_path(str(spec)))):
        return []
    try:
        load_text(spec, text_column=text_column, max_chars=1 << 16)
    except MLAConvertError as error:
        return [f"--calib-data: {error}"]
    return []


def sidecar_problems(folder: Path) -> list[str]:
    """Tokenizer and generation files the output copies: readable JSON now, not a failure after the NaN scan."""
    problems = []
    for name in SIDECAR_JSON:
        path = Path(folder) / name
        if not path.is_file():
            continue
        try:
            json.loads(path.read_bytes())
        except (OSError, UnicodeDecodeError, ValueError) as error:
            problems.append(f"{path}: not valid JSON ({' '.join(str(error).split())[:120]}); the output would copy a broken file")
    return problems


def shard_size_problems(max_shard_size) -> list[str]:
    try:
        size = parse_shard_size(max_shard_size)
    except ValueError as error:
        return [f"--max-shard-size: {error}"]
    return [] if size > 0 else [f"--max-shard-size {max_shard_size!r}: must be positive"]


# --------------------------------------------------------------------------- output and disk
def output_problems(output: Path, source: Path, overwrite: bool) -> list[str]:
    """With --overwrite, the output must not be (or contain) the source model: replacing it deletes the source."""
    if not overwrite or not output.exists():
        return []
    out, src = output.resolve(), Path(source).resolve()
    if within(src, out):
        return [f"{output}: is the source model folder or contains it; --overwrite would delete the source. Choose another output path"]
    return []


def target_rope_problems(source: SourceConfig, target: str | None) -> list[str]:
    """A target whose engines cannot run this source's RoPE as declared (`engines.ROPE_FAILURES`), one line per
    engine: the export would keep the source's RoPE type (the serving targets' grids start at the first frequency),
    so the refusal comes before converting."""
    if target not in T.TARGETS:
        return []
    return [f"--target {target}: this source's {rope}; convert with --target transformers"
            for rope in rope_problems(T.target_of(target), source.rope_parameters)]


def estimated_output_bytes(shape: SourceConfig, mla: MLAShape, dtype: torch.dtype, target: str | None = None) -> int:
    d, H, h, D, R, inter = shape.hidden_size, shape.num_heads, shape.head_dim, mla.rope_dim, mla.kv_lora_rank, shape.intermediate_size
    layout = T.export_layout(shape, mla, T.target_of(target))
    q_rows = H * (h + D)
    query = q_rows * d if layout.q_lora_rank is None else layout.q_lora_rank * (d + q_rows + 2)
    per_layer = query + (R + D) * (d + 1) + R + H * 2 * h * R + d * H * h + d + 3 * d * inter + 2 * d
    total = shape.vocab_size * d * (1 if layout.tie_word_embeddings else 2) + d + shape.num_layers * per_layer
    return total * dtype_bytes(dtype)


def estimated_statistics_bytes(shape: SourceConfig, calibration) -> int:
    """Size of the per-layer calibration statistics spilled to the temp folder (calibration.StatsStore)."""
    d, T = shape.hidden_size, calibration.seq_len
    kept = min(calibration.error_samples, max(calibration.num_samples, 0))
    moments = 2 * d * d * 8  # E[x x^T] and the attention-weighted moment, float64 (d x d each)
    per_layer = moments + d * 8 + kept * T * d * 4 + shape.num_heads * T * 8 + STATS_HEADER_BYTES
    return shape.num_layers * per_layer


def sidecar_bytes(source: Path) -> int:
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


def storage_needs(shape: SourceConfig, mla: MLAShape, dtype: torch.dtype, source: Path, calibration,
                  target: str | None = None) -> tuple[int, int]:
    """Bytes the output folder and the calibration statistics (in the temp folder) will take."""
    needed = estimated_output_bytes(shape, mla, dtype, target) + sidecar_bytes(source) + OUTPUT_OVERHEAD_BYTES
    return needed, estimated_statistics_bytes(shape, calibration)


def shared_disk_problems(output: Path, needed: int, statistics: int) -> list[str]:
    """The output and the temp folder on one file system must hold both at once (each may fit alone)."""
    try:
        scratch = Path(tempfile.gettempdir())
        if os.stat(output.parent).st_dev != os.stat(scratch).st_dev:
            return []
    except OSError:  # reported by the separate checks
        return []
    free = shutil.disk_usage(output.parent).free
    if free < (needed + statistics) * FREE_SPACE_MARGIN:
        return [f"{output.parent}: {human_bytes(free)} free, and the output (about {human_bytes(needed)}) and the calibration "
                f"statistics in {scratch} (about {human_bytes(statistics)}) share this disk: together they need about "
                f"{human_bytes(needed + statistics)}; free some space, or set TMPDIR to a folder on another disk"]
    return []


def storage_problems(output: Path, shape: SourceConfig, mla: MLAShape, dtype: torch.dtype, source: Path,
                     calibration, target: str | None = None, calibrated: bool = False) -> tuple[list[str], str]:
    """Free-space problems for the output and the temp folder, and a one-line estimate to show the user.

    `calibrated`: the statistics are already written (a sweep's later exports): they need no more room, and the
    estimate does not repeat them for every point."""
    needed, statistics = storage_needs(shape, mla, dtype, source, calibration, target)
    if calibrated:
        statistics = 0
    problems = disk_problems(output, needed) + (scratch_problems(statistics) if statistics else [])
    if not problems:  # each fits alone; on one disk they must fit together
        problems = shared_disk_problems(output, needed, statistics)
    summary = f"disk: the output needs about {human_bytes(needed)}"
    if output.parent.exists():
        summary += f" ({human_bytes(shutil.disk_usage(output.parent).free)} free in {output.parent})"
    if statistics:
        summary += f"; calibration statistics about {human_bytes(statistics)} in {tempfile.gettempdir()}"
    return problems, summary


def output_path_problems(output: Path, overwrite: bool, source: Path | None = None, force: bool = False) -> list[str]:
    """Output-path problems found without touching anything (reported even when the source is broken)."""
    undecodable = [problem for what, path in (("output", output), ("source", source))
                   if (problem := not_utf8_problem(what, path)) is not None]
    if undecodable:  # (the model card's writer failed on it after the whole conversion)
        return undecodable
    if source is not None and Path(source).exists():
        clash = output_problems(output, Path(source), overwrite)
        if clash:  # the one thing to say: --force would not make this safe
            return clash
    try:
        prepare_output_path(output, overwrite, force)
    except MLAConvertError as error:
        return [str(error)]
    return []


# --------------------------------------------------------------------------- the shape and dtype to export


def export_dtype(name: str, source: SourceConfig, serving: bool = False) -> torch.dtype:
    """`--dtype` -> the export dtype; `auto` is the source's, with fp16 exported as bf16.  An explicit fp16 is taken
    for a serving target only (`serving`): its transforms bring every weight into fp16's range."""
    if name == "auto":
        # fp16 cannot hold the tiny-scale latent: bf16 keeps fp32's exponent range
        return torch.bfloat16 if source.torch_dtype == torch.float16 else source.torch_dtype
    dtype = parse_dtype(name)
    if dtype == torch.float16 and not serving:
        raise PreflightError([f"--dtype fp16: {T.FP16_REFUSED}"])
    return dtype


def run_preflight(source: SourceConfig, reader: CheckpointReader, output: Path, options: ConvertOptions,
                  message: Callable[[str], None], calibrated: bool = False) -> tuple[MLAShape, torch.dtype]:
    """Every problem at once (`PreflightError`), or the MLA shape and export dtype.

    Reads only headers and the file system; `message` receives what was cleaned up and the disk estimate.
    `calibrated`: the calibration statistics are already written (`storage_problems`).
    """
    from ..hub.card import card_option_problems  # the Hub's metadata rules live with the card (import cycle)

    wrong_types = option_problems(options, types_only=True)
    if wrong_types:  # e.g. compression="4" from the API: the checks below could not even compare it
        raise PreflightError(wrong_types)
    problems: list[str] = option_problems(options)
    target = options.target if options.target in T.TARGETS else None  # a bad name is already one of the problems
    output_ok = True
    if output.parent.exists():
        try:  # a partial folder a live run is writing is one problem among the others
            stale = clean_stale_partial(output)
        except MLAConvertError as error:
            problems.append(str(error))
            stale, output_ok = None, False
        if stale:
            message(stale)
    path_problems = output_path_problems(output, options.overwrite, reader.folder, options.force)
    problems += path_problems
    output_ok = output_ok and not path_problems
    mla = None
    dtype = source.torch_dtype
    try:
        # (a misspelled --target is one of the problems already: it is not also blamed for an fp16 it may allow)
        misspelled = target is None and options.target is not None
        dtype = export_dtype(options.dtype, source, serving=misspelled or T.target_of(target).serving)
    except PreflightError as error:
        problems += error.problems
    except MLAConvertError as error:
        problems.append(str(error))
    shape_flags = ("--compression", "--kv-lora-rank", "--rope-dim", "--q-lora-rank")
    try:  # (a shape value already refused above, e.g. -c nan, would only be refused again in other words)
        if not any(problem.startswith(shape_flags) for problem in problems):
            mla = pick_target_shape(source, target, options.kv_lora_rank, options.rope_dim, options.compression,
                                    options.q_lora_rank)
            problems += shape_problems(source, mla.kv_lora_rank, mla.rope_dim, mla.q_lora_rank)
    except PreflightError as error:
        problems += error.problems
    except MLAConvertError as error:
        problems.append(str(error))
    problems += target_rope_problems(source, target)
    problems += special_file_problems(reader.folder) + sidecar_problems(reader.folder)
    problems += tensor_problems(reader, source)
    problems += calibration_problems(reader.folder, options.calibration)
    problems += calibration_length_problems(source, options.calibration)
    problems += card_option_problems(options.base_model, options.license)
    problems += shard_size_problems(options.max_shard_size) + device_problems(options.device)
    storage_summary = None
    if output_ok and mla is not None:
        storage, storage_summary = storage_problems(output, source, mla, dtype, reader.folder, options.calibration,
                                                    target, calibrated)
        problems += storage
    if problems:
        raise PreflightError(list(dict.fromkeys(problems)))
    if storage_summary:
        message(storage_summary)
    if reader.ignored_index is not None:
        message(f"note: {reader.folder} holds both {reader.ignored_index[1]} and {reader.ignored_index[0]}; transformers loads "
                f"{reader.ignored_index[1]}, so the conversion reads it and ignores the index and its shards")
    if not math.isclose(source.rms_norm_eps, T.EXPORT_RMS_NORM_EPS):  # said in the card only, the console was silent
        message(f"note: every RMSNorm of the export uses eps {T.EXPORT_RMS_NORM_EPS:g} (the source: {source.rms_norm_eps:g}): "
                "transformers fixes the latent norms at that value and the serving engines use one eps for all norms; "
                "the layer norms compute slightly differently from the source's, which the attention error does not measure")
    if source.sliding_window is not None:
        slides = sliding_phrase(source.sliding_window, source.sliding_layers, source.num_layers)
        message(f"note: the source slides its attention {slides}; DeepseekV3 attends to every "
                f"position, so the export declares max_position_embeddings {source.sliding_window} (the source: "
                f"{source.max_position_embeddings}), the context where the two agree")
    for note in family_notes(source):
        message(f"note: {note}")
    if not T.target_of(options.target).serving and options.kv_lora_rank is None and options.rope_dim is None:
        # (a serving target's note is in its report and summary); the transformers target said nothing when a ratio
        # rounded to another (25x of 64 values is 3 values, 21.33x)
        note = shape_choice_note(source, options.target, mla, options.compression)
        if note:
            message(f"note: {note}")
    grown = mla.kv_values_per_token_layer / source.kv_values_per_token_layer
    if grown > 1:  # allowed (e.g. an exact full-rank conversion), but not what anyone converts for by accident
        message(f"note: {mla.kv_lora_rank}+{mla.rope_dim} caches {mla.kv_values_per_token_layer} values per token and "
                f"layer, more than the source's {source.kv_values_per_token_layer}: the KV cache grows {grown:.2f}x "
                f"(compression {1 / grown:.2f}x)")
    return mla, dtype
