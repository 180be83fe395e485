"""`convert`: a Llama-family checkpoint in, a stock DeepseekV3 MLA checkpoint out, streamed layer by layer.

Phases (DESIGN.md section 2):
1. Pre-flight: config, shapes, every tensor's shape/dtype, disk space, output path; all problems at once.
2. Calibration windows: a text, or text sampled from the source model itself.
3. Statistics pass: the layer-streamed source forward collects, per layer, the attention input's second
   moment, a few input samples and each head's attention-distance profile (spilled to a temp folder).
4. RoPE grid: one frequency grid for the whole model (DeepseekV3 has one rope_theta), chosen by the
   estimated logit error over all layers, the best few then compared by measured attention error.
5. Conversion pass: per layer, slot plan + activation/output-aware factorization (+ K/V balance picked by
   measured attention error), written straight into the output shards.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import __version__
from .calibration import (
    CalibrationOptions,
    LayerInputStats,
    StatsStore,
    calibration_ids,
    layer_input_stats,
    rope_stats_for_layer,
)
from ..io.reader import CheckpointReader, load_config
from ..io.writer import (
    DEFAULT_MAX_SHARD_SIZE,
    CheckpointWriter,
    claim_scratch_folder,
    clean_stale_partial,
    clean_stale_scratch_folders,
    prepare_output_path,
)
from ..errors import CheckpointError, ConversionError, MLAConvertError, NonFiniteError, PreflightError
from .target import build_deepseek_config, carried_over_names, global_names
from .factorize import METHODS, Whitening
from .reference import mla_attention
from .layer import LayerReport, convert_attention
from ..io.resolve import looks_like_hub_id, resolve_model_path
from .rope import RopeGrid, SlotPlan, candidate_grids, deepseek_rope_parameters, grid_inv_freq, plan_layer
from .memory import peak_rss_bytes, pin_mmap_threshold
from ..source.shapes import MLAShape, SourceShape, check_mla_shape, default_shape, parse_dtype, shape_for_compression
from ..source.model import StreamedSourceModel, apply_rotary, attention_from_qkv, project_qkv, rotary_cos_sin

METHOD_ALIASES = {"activation-aware": "output", "output": "output", "input": "input", "svd": "weight", "weight": "weight"}
# K/V balance: multiplies the equal-energy weighting of NoPE-key errors against value errors; measured
# per layer.  SmolLM2 layers mostly chose the top of (0.25 .. 4), so the search now spans 1/8 .. 32.
KV_BALANCE_COARSE = (0.25, 1.0, 4.0, 16.0)
# Layer refinement by default ("auto", refine_steps=None) where it is cheap: when AUTO_REFINE_STEPS steps
# of one layer cost at most AUTO_REFINE_FLOPS.  Measured gains: stories260K (28 GFLOP per layer) 2x
# 6.80 -> 6.45, 4x 15.3 -> 12.3, 8x 58.7 -> 44.4 perplexity; SmolLM2-135M (725 GFLOP per layer) 2x
# 41.5 -> 38.1 on 10 windows, but at twice the conversion time (258 s instead of ~125-170 s on 2 cores),
# so there it is opt-in (--refine-steps 200).  Each layer stops after AUTO_REFINE_PATIENCE held-out checks without
# a new best, and keeps the closed form when refinement never beat it.
AUTO_REFINE_STEPS = 200
AUTO_REFINE_PATIENCE = 2  # held-out checks (25 steps each) without a new best before a layer stops
AUTO_REFINE_FLOPS = 50e9
REFINE_BATCH_WINDOWS = 2  # calibration windows per refinement step (refine_layer's default)
# RoPE grid: finalists whose estimated error is within this factor of the best are measured (the estimate
# ranks well when the gap is wide: SmolLM2 2x, 69.8 vs 121, the measurement agreed)
ROPE_MEASURE_WITHIN = 1.5


@dataclass
class ConvertOptions:
    kv_lora_rank: int | None = None
    rope_dim: int | None = None
    compression: float | None = None
    q_lora_rank: int | None = None
    method: str = "activation-aware"
    calibration: CalibrationOptions = field(default_factory=CalibrationOptions)
    dtype: str = "auto"
    device: str = "cpu"
    sequential: bool = True
    rope_candidates_measured: int = 2
    kv_balance_search: bool = True
    refine_steps: int | None = None  # None: auto (see AUTO_REFINE_*); 0: closed form only
    nope_scaling: bool = True
    weighting: str = "attention"  # "attention" or "uniform": how calibration tokens weigh in the factorization
    refine_lr: float = 1e-3
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE
    overwrite: bool = False
    allow_pickle: bool = False
    revision: str | None = None
    command: str | None = None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["calibration"] = asdict(self.calibration)
        return out


@dataclass
class ConversionResult:
    output: Path
    report: dict
    layer_reports: list[LayerReport]


class Progress:
    """Callbacks the CLI turns into progress bars; the library itself prints nothing."""

    def phase(self, name: str, total: int | None = None) -> None: ...
    def advance(self, done: int, total: int | None = None) -> None: ...
    def message(self, text: str) -> None: ...


def _source_dtype_for_export(name: str, shape: SourceShape) -> torch.dtype:
    if name == "auto":
        # fp16 cannot hold the tiny-scale latent (DESIGN.md 2.3): bf16 keeps fp32's exponent range
        return torch.bfloat16 if shape.torch_dtype == torch.float16 else shape.torch_dtype
    dtype = parse_dtype(name)
    if dtype == torch.float16:
        raise PreflightError(["--dtype fp16: the linearised latent norm stores weights of ~1e-6 scale, which fp16 flushes to zero; use bf16 or fp32"])
    return dtype


def pick_shape(shape: SourceShape, options: ConvertOptions) -> MLAShape:
    if options.compression is not None:
        if options.kv_lora_rank is not None or options.rope_dim is not None:
            raise PreflightError(["--compression picks --kv-lora-rank and --rope-dim; give either the ratio or the ranks"])
        mla = shape_for_compression(shape, options.compression)
    elif options.kv_lora_rank is None and options.rope_dim is None:
        mla = _default_shape(shape)
    else:
        # robustness: the default fills in only what was not given (with both given, it must not be able to fail)
        fallback = _default_shape(shape) if options.kv_lora_rank is None or options.rope_dim is None else None
        mla = MLAShape(
            options.kv_lora_rank if options.kv_lora_rank is not None else fallback.kv_lora_rank,
            options.rope_dim if options.rope_dim is not None else fallback.rope_dim,
        )
    return MLAShape(mla.kv_lora_rank, mla.rope_dim, options.q_lora_rank)


def _default_shape(shape: SourceShape) -> MLAShape:
    """robustness: say where the "--compression 2.0" in default_shape's errors comes from (the user never typed it)."""
    from ..errors import InvalidShapeError

    try:
        return default_shape(shape)
    except InvalidShapeError as error:
        raise PreflightError([f"the default MLA shape (--compression 2.0) does not fit this source: {error}; "
                              "give --kv-lora-rank and --rope-dim"]) from error


def _check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """`where` names the layer and the step ("layer 3, step 'factorization'"); the message names the tensor."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            bad = (~torch.isfinite(tensor)).sum().item()
            raise NonFiniteError(f"{where}: {name} holds {bad} NaN/Inf values (of {tensor.numel()}); refusing to write the output")


# ----- robustness (docs/robustness.md): statistics the factorization can use, not a LinAlgError deep in torch
def _check_statistics(stats: LayerInputStats, index: int, step: str) -> None:
    _check_finite(stats.to_tensors(), f"layer {index}, step '{step}'")
    if not bool(stats.second_moment.abs().sum() > 0):
        raise ConversionError(
            f"layer {index}, step '{step}': the attention input is identically zero (an all-zero input_layernorm "
            "weight, or hidden states that overflow float32); this layer cannot be calibrated"
        )
# ----- end robustness


# --------------------------------------------------------------------------- attention error
def source_attention_output(layer, x: torch.Tensor, model: StreamedSourceModel) -> torch.Tensor:
    cos, sin = model.cos_sin(x.shape[1])
    q, k, v = project_qkv(x, layer, model.shape)
    return attention_from_qkv(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, layer, model.shape)


def relative_error(approx: torch.Tensor, reference: torch.Tensor) -> float:
    return ((approx.double() - reference.double()).norm() / reference.double().norm().clamp_min(1e-30)).item()


def converted_attention_output(weights: dict[str, torch.Tensor], x: torch.Tensor, shape: SourceShape, mla: MLAShape,
                               slot_inv_freq: torch.Tensor) -> torch.Tensor:
    return mla_attention(x, weights, shape.num_heads, shape.head_dim, mla.rope_dim, shape.head_dim, slot_inv_freq)


# --------------------------------------------------------------------------- RoPE grid
def choose_rope_grid(
    rope_stats: list,
    layers: Callable[[int], object],
    samples: Callable[[int], torch.Tensor],
    model: StreamedSourceModel,
    mla: MLAShape,
    measured: int,
    progress: Progress,
) -> tuple[RopeGrid, list[SlotPlan], list[dict]]:
    """Pick the model-wide RoPE grid: rank all candidates by estimated error, measure the best few."""
    shape = model.shape
    llama3 = shape.rope_parameters.get("rope_type") == "llama3"
    grids = candidate_grids(shape.head_dim // 2, mla.rope_dim // 2, llama3=llama3)
    scored = []  # (estimated error, grid, plans); plans kept only while a grid is among the best `keep`
    keep = max(1, measured)
    progress.phase("ranking RoPE grids", len(grids))
    for number, grid in enumerate(grids):
        plans = [plan_layer(stats, grid, model.inv_freq, shape.num_kv_heads, max_fold=grid.step) for stats in rope_stats]
        scored.append((sum(p.estimated_error for p in plans), grid, plans))
        scored.sort(key=lambda item: item[0])
        # every grid's plans for every layer add up (8x on SmolLM2: +360 MiB); only finalists need theirs
        scored[keep:] = [(est, other, None) for est, other, _ in scored[keep:]]
        progress.advance(number + 1, len(grids))
    # the best always; the runners-up only when close (a NaN/inf estimate compares false: best alone)
    finalists = scored[:1] + [item for item in scored[1:keep] if item[0] <= ROPE_MEASURE_WITHIN * scored[0][0]]
    table = [{"grid": grid.describe(), "estimated_error": est} for est, grid, _ in scored[:10]]
    if len(finalists) == 1:
        return finalists[0][1], finalists[0][2], table
    # measured: attention output error with full-rank K/V (only the RoPE choice differs)
    full = MLAShape(shape.max_kv_lora_rank, mla.rope_dim, mla.q_lora_rank)
    progress.phase("measuring RoPE grids", len(finalists) * shape.num_layers)
    errors = [0.0] * len(finalists)
    for index in range(shape.num_layers):
        layer = layers(index)
        stats = samples(index)
        x = stats.samples.to(model.dtype)
        reference = source_attention_output(layer, x, model)
        for rank, (_, grid, plans) in enumerate(finalists):
            weights, _ = convert_attention(layer.weights, shape, full, plans[index], stats.second_moment, stats.mean,
                                           method="input", whitening=Whitening.of(stats.second_moment))
            out = converted_attention_output({k: v.float() for k, v in weights.items()}, x, shape, full, plans[index].slot_inv_freq)
            errors[rank] += relative_error(out, reference) ** 2 / shape.num_layers
            progress.advance(index * len(finalists) + rank + 1)
        model.release()
    for rank, (est, grid, _) in enumerate(finalists):
        for row in table:
            if row["grid"] == grid.describe():
                row["measured_attention_error"] = math.sqrt(errors[rank])
    best = min(range(len(finalists)), key=lambda r: (not math.isfinite(errors[r]), errors[r]))
    return finalists[best][1], finalists[best][2], table


# --------------------------------------------------------------------------- main entry
class Converter:
    """One source model, calibrated once, exported to one or more MLA shapes (sweeps reuse the calibration)."""

    def __init__(self, source: str | os.PathLike, options: ConvertOptions | None = None, progress: Progress | None = None):
        from .preflight import config_problems

        self.options = options or ConvertOptions()
        self.progress = progress or Progress()
        self.source = source
        pin_mmap_threshold()  # freed per-layer temporaries leave the process (see memory.py)
        self.source_path = resolve_model_path(source, self.options.revision, self.options.allow_pickle)
        self.config = load_config(self.source_path)
        problems = config_problems(self.config)
        try:  # robustness: a broken config and unreadable weights are reported together
            self.reader = CheckpointReader(self.source_path, allow_pickle=self.options.allow_pickle)
        except CheckpointError as error:
            if not problems:
                raise
            problems.append(str(error))
        if problems:
            raise PreflightError(problems)
        self.shape = SourceShape.from_config(self.config)
        self.model = StreamedSourceModel(self.reader, self.config, self.shape, dtype=torch.float32)
        self.store: StatsStore | None = None
        self.ids: torch.Tensor | None = None
        self.calibration_description = ""
        self.rope_stats: list = []
        self.calibration_seconds = 0.0
        self._stats_lock = None  # robustness: flock marking the statistics folder as in use

    def preflight(self, output: Path, options: ConvertOptions | None = None) -> tuple[MLAShape, torch.dtype]:
        shape, mla, dtype = _preflight(self.config, self.reader, Path(output), options or self.options, self.progress)
        return mla, dtype

    def calibrate(self) -> None:
        """Calibration windows and the per-layer statistics pass (once per Converter)."""
        if self.store is not None:
            return
        started = time.time()
        model, shape, calib, progress = self.model, self.shape, self.options.calibration, self.progress
        # ----- robustness: NaN/Inf in the source named before any forward pass; killed runs' statistics removed
        from .preflight import check_source_finite, expected_tensor_shapes

        progress.phase("checking source weights for NaN/Inf", len(expected_tensor_shapes(shape, self.config)))
        check_source_finite(self.reader, shape, self.config, progress.advance)
        for name in clean_stale_scratch_folders():
            progress.message(f"removed {name}, left behind in the temp folder by an interrupted run")
        # ----- end robustness
        progress.phase("reading calibration text" if calib.data else "sampling calibration text from the source model",
                       None if calib.data else calib.seq_len - 1)
        self.ids, self.calibration_description = calibration_ids(model, self.source_path, calib, progress=progress.advance)
        model.release()
        self.store = StatsStore()
        self._stats_lock = claim_scratch_folder(self.store.path)  # robustness: a later run cleans it after a kill
        progress.phase("calibration statistics", shape.num_layers)
        hidden = model.embed(self.ids)
        model.release()
        cos, sin = model.cos_sin(self.ids.shape[1])
        for index in range(shape.num_layers):
            layer = model.load_layer(index)
            stats = layer_input_stats(model, layer, hidden, cos, sin, calib)
            _check_statistics(stats, index, "calibration statistics")  # robustness
            self.rope_stats.append(rope_stats_for_layer(layer, stats, shape))
            self.store.save(index, stats.to_tensors())
            del layer
            model.release()
            progress.advance(index + 1, shape.num_layers)
        self.calibration_seconds = time.time() - started

    def export(self, output: str | os.PathLike, options: ConvertOptions | None = None,
               mla: MLAShape | None = None, export_dtype: torch.dtype | None = None) -> ConversionResult:
        """Choose the RoPE grid, convert every layer and write the DeepseekV3 folder at `output`."""
        options = options or self.options
        started = time.time()
        output = Path(output)
        if mla is None or export_dtype is None:
            mla, export_dtype = self.preflight(output, options)
        self.calibrate()
        method = METHOD_ALIASES[options.method]
        model, shape, config, reader, progress, calib = self.model, self.shape, self.config, self.reader, self.progress, self.options.calibration
        store = self.store
        use_q_lora = mla.q_lora_rank is not None or shape.qkv_bias
        q_lora_rank = mla.q_lora_rank if mla.q_lora_rank is not None else (shape.hidden_size if shape.qkv_bias else None)
        attention_bias = shape.qkv_bias or shape.o_bias
        grid, plans, grid_table = choose_rope_grid(
            self.rope_stats, model.load_layer, lambda i: LayerInputStats.from_tensors(store.load(i)), model, mla,
            options.rope_candidates_measured, progress,
        )
        rope_parameters = deepseek_rope_parameters(shape.rope_parameters, grid, shape.head_dim)
        rope_error = verify_exported_rope(rope_parameters, mla.rope_dim, grid_inv_freq(grid, model.inv_freq))
        target_config = build_deepseek_config(config, shape, mla, rope_parameters, export_dtype, q_lora_rank, attention_bias)
        writer = CheckpointWriter(output, options.max_shard_size, options.overwrite)
        with writer:
            before, after = global_names(shape, config)
            for src, dst in before.items():
                self._copy_table(writer, src, dst, export_dtype)
            layer_reports: list[LayerReport] = []
            progress.phase("converting layers", shape.num_layers)
            hidden = None
            cos, sin = model.cos_sin(self.ids.shape[1])
            if options.sequential:
                hidden = model.embed(self.ids)
                model.release()
            refine = RefinePolicy.of(options, shape)
            for index in range(shape.num_layers):
                layer = model.load_layer(index)
                plan = plans[index]
                if options.sequential:
                    # statistics of what this layer really receives: the output of the converted layers below
                    stats = layer_input_stats(model, layer, hidden, cos, sin, calib, move_hidden=False)
                    _check_statistics(stats, index, "sequential re-calibration")  # robustness
                    plan = plan_layer(rope_stats_for_layer(layer, stats, shape), grid, model.inv_freq,
                                      shape.num_kv_heads, max_fold=grid.step)
                else:
                    stats = LayerInputStats.from_tensors(store.load(index))
                step = "refinement" if refine.steps > 0 else "factorization"  # robustness: name the step
                try:
                    weights, report = _convert_layer(layer, stats, shape, mla, plan, method, options, model, use_q_lora, refine)
                except torch.linalg.LinAlgError as error:
                    raise ConversionError(f"layer {index}, step '{step}': {str(error).splitlines()[0]}; nothing was written") from error
                _check_finite(weights, f"layer {index}, step '{step}'")
                if options.sequential:
                    advance_through_converted(model, layer, weights, hidden, shape, mla, plan.slot_inv_freq, calib.chunk)
                for name, tensor in weights.items():
                    writer.add(f"model.layers.{index}.self_attn.{name}", tensor.to(export_dtype))
                for src, dst in carried_over_names(shape, config, index).items():
                    writer.add(dst, layer.weights[_role_of(shape, config, index, src)].to(export_dtype))
                layer_reports.append(report)
                del layer
                model.release()
                progress.advance(index + 1, shape.num_layers)
            for src, dst in after.items():
                self._copy_table(writer, src, dst, export_dtype)
            target_config.save_pretrained(writer.partial)
            writer.copy_sidecars(self.source_path)
            report = _report(self.source, config, shape, mla, options, method, self.calibration_description, self.ids,
                             grid, rope_parameters, grid_table, layer_reports, export_dtype,
                             time.time() - started + self.calibration_seconds, q_lora_rank, attention_bias)
            report["rope"]["max_relative_frequency_error"] = rope_error
            report["refinement"] = refine.decision
            writer.write_json("mla_convert.json", report)
            _write_card(writer, report)
            result_path = writer.commit()
        return ConversionResult(result_path, report, layer_reports)

    def _copy_table(self, writer: CheckpointWriter, source_name: str, target_name: str, dtype: torch.dtype) -> None:
        """Copy a carried-over tensor (embeddings, head, final norm) in row blocks, releasing each block's mapping."""
        info = self.reader.tensor_infos()[source_name]

        def rows(start: int, stop: int) -> torch.Tensor:
            block = self.reader.get_rows(source_name, start, stop).to(dtype)
            self.reader.close()
            return block

        writer.add_rows(target_name, info.shape, dtype, rows)

    def close(self) -> None:
        if self._stats_lock is not None:  # robustness
            self._stats_lock.close()
            self._stats_lock = None
        if self.store is not None:
            self.store.cleanup()
            self.store = None
        self.reader.close()

    def __enter__(self) -> "Converter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def convert(source: str | os.PathLike, output: str | os.PathLike, options: ConvertOptions | None = None,
            progress: Progress | None = None) -> ConversionResult:
    """Convert `source` (folder or hub id) into a DeepseekV3 MLA folder at `output`.

    Pre-flight runs first and reports every problem at once; nothing is written unless the whole
    conversion succeeds (the output appears by an atomic rename).
    """
    options = options or ConvertOptions()
    if options.method not in METHOD_ALIASES:
        raise PreflightError([f"--method {options.method!r}: choose one of activation-aware, input, svd"])
    try:  # robustness: problems with the output path are reported together with those of the source
        converter = Converter(source, options, progress)
    except MLAConvertError as error:
        from .preflight import output_path_problems

        lines = error.problems if isinstance(error, PreflightError) else [str(error)]
        raise PreflightError(lines + output_path_problems(Path(output), options.overwrite)) from error
    with converter:
        mla, export_dtype = converter.preflight(Path(output), options)
        converter.calibrate()
        return converter.export(output, options, mla, export_dtype)


def _preflight(config: dict, reader: CheckpointReader, output: Path, options: ConvertOptions, progress: Progress):
    """Every problem at once (PreflightError), or the source shape, MLA shape and export dtype."""
    from ..errors import MLAConvertError
    from .preflight import config_problems, tensor_problems
    from ..source.shapes import shape_problems

    problems: list[str] = []
    output_ok = True
    if output.parent.exists():
        try:  # robustness: a partial folder a live run is writing is one problem among the others
            stale = clean_stale_partial(output)
        except MLAConvertError as error:
            problems.append(str(error))
            stale, output_ok = None, False
        if stale:
            progress.message(stale)
    try:
        prepare_output_path(output, options.overwrite)
    except MLAConvertError as error:
        problems.append(str(error))
        output_ok = False
    broken_config = config_problems(config)
    if broken_config:  # nothing below can be checked without a sound config
        raise PreflightError(problems + broken_config)
    shape = SourceShape.from_config(config)
    mla = None
    export_dtype = shape.torch_dtype
    try:
        export_dtype = _source_dtype_for_export(options.dtype, shape)
    except PreflightError as error:
        problems += error.problems
    try:
        mla = pick_shape(shape, options)
        problems += shape_problems(shape, mla.kv_lora_rank, mla.rope_dim)
    except PreflightError as error:
        problems += error.problems
    except MLAConvertError as error:
        problems.append(str(error))
    if options.q_lora_rank is not None and options.q_lora_rank <= 0:
        problems.append(f"--q-lora-rank {options.q_lora_rank}: must be positive")
    problems += tensor_problems(reader, shape, config)
    # ----- robustness (docs/robustness.md): options, calibration text, output vs source, free disk (estimate shown)
    from .preflight import calibration_problems, device_problems, output_problems, shard_size_problems, storage_problems

    problems += calibration_problems(reader.folder, options.calibration, config)
    problems += shard_size_problems(options.max_shard_size) + device_problems(options.device)
    problems += output_problems(output, reader.folder, options.overwrite)
    storage_summary = None
    if output_ok and mla is not None:
        storage, storage_summary = storage_problems(output, shape, mla, export_dtype, reader.folder, options.calibration)
        problems += storage
    # ----- end robustness
    if problems:
        raise PreflightError(list(dict.fromkeys(problems)))
    if storage_summary:
        progress.message(storage_summary)
    return shape, mla, export_dtype


def _role_of(shape: SourceShape, config: dict, index: int, name: str) -> str:
    for role, candidate in shape.architecture.layer_weight_names(index, config).items():
        if candidate == name:
            return role
    raise KeyError(name)


def verify_exported_rope(rope_parameters: dict, rope_dim: int, expected: torch.Tensor, rtol: float = 2e-6) -> float:
    """The exported config's inverse frequencies (computed as transformers computes them) must equal the chosen ones."""
    from ..source.model import rope_inv_freq

    actual = rope_inv_freq(rope_parameters, rope_dim).double()
    error = ((actual - expected.double()).abs() / expected.double()).max().item()
    if error > rtol:
        raise AssertionError(f"exported RoPE frequencies differ from the chosen ones (max relative error {error:.2e})")
    return error


def advance_through_converted(model: StreamedSourceModel, layer, weights, hidden: torch.Tensor, shape: SourceShape,
                              mla: MLAShape, slot_inv_freq: torch.Tensor, chunk: int) -> None:
    """Push the calibration hidden states through the converted layer (MLA attention + source MLP), in place."""
    from ..source.model import mlp, rms_norm

    attention_weights = {k: v.to(model.dtype) for k, v in weights.items()}
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start : start + chunk]
        x = rms_norm(h, layer.weights["input_norm"], shape.rms_norm_eps)
        h = h + converted_attention_output(attention_weights, x, shape, mla, slot_inv_freq)
        hidden[start : start + chunk] = h + mlp(rms_norm(h, layer.weights["post_attn_norm"], shape.rms_norm_eps), layer)


@dataclass
class RefinePolicy:
    """How many refinement steps each layer gets, and why (recorded in the report)."""

    steps: int
    patience: int | None
    decision: str

    @classmethod
    def of(cls, options: "ConvertOptions", shape: SourceShape) -> "RefinePolicy":
        if options.refine_steps is not None:
            return cls(options.refine_steps, None, f"{options.refine_steps} steps per layer (given)")
        if METHOD_ALIASES.get(options.method) == "weight":  # the baseline stays free of calibration data
            return cls(0, None, "auto: off (weight-only SVD uses no calibration data)")
        cost = refine_flops(shape, options.calibration.seq_len, AUTO_REFINE_STEPS)
        if cost <= AUTO_REFINE_FLOPS:
            return cls(AUTO_REFINE_STEPS, AUTO_REFINE_PATIENCE,
                       f"auto: on ({cost / 1e9:.1f} GFLOP per layer <= {AUTO_REFINE_FLOPS / 1e9:.0f})")
        return cls(0, None, f"auto: off ({cost / 1e9:.0f} GFLOP per layer > {AUTO_REFINE_FLOPS / 1e9:.0f}; "
                            f"--refine-steps {AUTO_REFINE_STEPS} turns it on)")


def refine_flops(shape: SourceShape, seq_len: int, steps: int) -> float:
    """Rough cost of refining one layer: forward + backward (3x forward) of its attention on the step's tokens."""
    projections = 2 * shape.hidden_size * shape.head_dim * (shape.num_heads + shape.num_kv_heads)  # q, o + k, v
    tokens = REFINE_BATCH_WINDOWS * seq_len
    per_token = 2 * projections + 4 * shape.num_heads * shape.head_dim * seq_len  # matmuls + scores/values
    return 3.0 * per_token * tokens * steps


def _convert_layer(layer, stats: LayerInputStats, shape: SourceShape, mla: MLAShape, plan: SlotPlan, method: str,
                   options: ConvertOptions, model: StreamedSourceModel, use_q_lora: bool, refine: RefinePolicy):
    """Convert one layer; with the output-aware method, pick the K/V balance by measured attention error."""
    moment = stats.attention_moment if (options.weighting == "attention" and stats.attention_moment is not None) else stats.second_moment
    whitening = None if method == "weight" else Whitening.of(moment)
    x = stats.samples.to(model.dtype)
    reference = source_attention_output(layer, x, model)
    best = None

    def attempt(balance: float):
        nonlocal best
        weights, report = convert_attention(layer.weights, shape, mla, plan, stats.second_moment, stats.mean, method,
                                            balance, layer.index, use_q_lora, whitening, options.nope_scaling)
        out = converted_attention_output({k: v.float() for k, v in weights.items()}, x, shape, mla, plan.slot_inv_freq)
        report.attention_error = relative_error(out, reference)
        if best is None or report.attention_error < best[1].attention_error:
            best = (weights, report)
        return report.attention_error

    if method == "output" and options.kv_balance_search:
        # coarse (x4 apart), then the x2 step from the best towards its better coarse neighbour (beyond the
        # end of the grid when the best is at an end): 1/8 .. 32 in 5 conversions
        errors = [attempt(balance) for balance in KV_BALANCE_COARSE]
        position = min(range(len(errors)), key=errors.__getitem__)
        centre = KV_BALANCE_COARSE[position]
        if position in (0, len(errors) - 1):
            towards_below = position == 0
        else:
            towards_below = errors[position - 1] < errors[position + 1]
        attempt(centre / 2 if towards_below else centre * 2)
    else:
        attempt(1.0)
    _check_finite(best[0], f"layer {layer.index}, step 'factorization'")  # robustness: before refinement hides it
    if refine.steps > 0 and x.shape[0] >= 2:
        from .layer import latent_scale_for
        from .refine import refine_layer

        weights, report = best
        result = refine_layer(weights, x, reference, shape.num_heads, shape.head_dim, mla.rope_dim, shape.head_dim,
                              plan.slot_inv_freq, steps=refine.steps, lr=options.refine_lr, patience=refine.patience,
                              latent_scale_fn=lambda down: latent_scale_for(down, layer.weights["input_norm"]))
        out = converted_attention_output({k: v.float() for k, v in result.weights.items()}, x, shape, mla, plan.slot_inv_freq)
        report.extra["closed_form_attention_error"] = report.attention_error
        report.attention_error = relative_error(out, reference)
        report.latent_scale = math.sqrt(1e-6) / result.weights["kv_a_layernorm.weight"][0].item()
        report.extra["refine_best_step"] = result.steps
        report.extra["refine_held_out_error"] = [result.error_before, result.error_after]  # closed form, refined
        best = (result.weights, report)
    return best


def _report(source, config, shape, mla, options, method, calib_description, ids, grid, rope_parameters,
            grid_table, layer_reports, export_dtype, seconds, q_lora_rank, attention_bias) -> dict:
    import safetensors
    import transformers

    from .engines import engine_compatibility

    src_values = shape.kv_values_per_token_layer
    mla_values = mla.kv_values_per_token_layer
    size = torch.empty((), dtype=export_dtype).element_size()
    energies = [r.kept_energy for r in layer_reports]
    errors = [r.attention_error for r in layer_reports if r.attention_error is not None]
    return {
        "mla_convert_version": __version__,
        "command": options.command,
        "source": {
            "name_or_path": str(source),
            "hub_id": str(source) if (not Path(str(source)).exists() and looks_like_hub_id(str(source))) else None,
            "architecture": (config.get("architectures") or [None])[0],
            "license": config.get("license"),
            "num_layers": shape.num_layers,
            "num_heads": shape.num_heads,
            "num_kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim,
            "hidden_size": shape.hidden_size,
            "qkv_bias": shape.qkv_bias,
            "rope_parameters": shape.rope_parameters,
        },
        "options": {**options.to_dict(), "kv_lora_rank": mla.kv_lora_rank, "rope_dim": mla.rope_dim,
                    "q_lora_rank": q_lora_rank, "method": method, "dtype": str(export_dtype).replace("torch.", "")},
        "calibration": {"description": calib_description, "tokens": int(ids.numel())},
        "rope": {"grid": grid.describe(), "offset": grid.offset, "step": grid.step, "rope_parameters": rope_parameters,
                 "candidates": grid_table},
        "cache": {
            "source_values_per_token_layer": src_values,
            "mla_values_per_token_layer": mla_values,
            "ratio": src_values / mla_values,
            "num_layers": shape.num_layers,
            "dtype": str(export_dtype).replace("torch.", ""),
            "source_bytes_per_token": src_values * shape.num_layers * size,
            "mla_bytes_per_token": mla_values * shape.num_layers * size,
        },
        "layers": [r.to_dict() for r in layer_reports],
        "summary": {
            "mean_kept_energy": sum(energies) / len(energies),
            "min_kept_energy": min(energies),
            "mean_attention_error": (sum(errors) / len(errors)) if errors else None,
            "seconds": round(seconds, 2),
            "peak_rss_bytes": peak_rss_bytes(),
        },
        "evaluation": None,
        "finetuning": None,
        "engines": engine_compatibility(mla, attention_bias, q_lora_rank),
        "versions": {
            "mla_convert": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "safetensors": safetensors.__version__,
            "python": platform.python_version(),
        },
    }


def _write_card(writer: CheckpointWriter, report: dict) -> None:
    try:
        from ..hub.card import build_model_card
    except ImportError:  # pragma: no cover - the card module ships with the package
        return
    build_model_card(report).save(str(writer.partial / "README.md"))


def command_line() -> str:
    return " ".join(shlex.quote(arg) for arg in [Path(sys.argv[0]).name, *sys.argv[1:]])


def install_sigterm_handler() -> None:
    """Turn SIGTERM (and SIGHUP: the terminal closed) into KeyboardInterrupt so they clean up like Ctrl-C does."""
    from ..errors import TerminatedBySignal

    def handler(signum, frame):
        raise TerminatedBySignal(signum)

    for signum in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if signum is not None:
            signal.signal(signum, handler)


__all__ = ["convert", "ConvertOptions", "ConversionResult", "CalibrationOptions", "METHODS", "json"]
