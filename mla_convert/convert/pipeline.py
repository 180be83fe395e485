"""`convert`: a Llama-family checkpoint in, a stock DeepseekV3 MLA checkpoint out, streamed layer by layer.

Phases:
1. Pre-flight (`preflight.run_preflight`): config, shapes, every tensor's shape/dtype, option ranges,
   disk space, output path; all problems at once, before any heavy work.
2. Calibration windows: a text, or text sampled from the source model itself.
3. Statistics pass: the layer-streamed source forward collects, per layer, the attention input's second
   moment, a few input samples and each head's attention-distance profile (spilled to a temp folder).
4. RoPE grid (`decisions.choose_rope_grid`): one frequency grid for the whole model (DeepseekV3 has one
   rope_theta), chosen by the estimated logit error over all layers, the best few then measured.
5. Conversion pass: per layer, slot plan + activation/output-aware factorization (+ K/V balance and
   refinement chosen by measured attention error, `decisions.convert_layer`), written straight into the
   output shards by the streaming writer, which makes the folder appear only when complete.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..devices import resident_weight_budget
from ..errors import CheckpointError, ConversionError, MLAConvertError, PreflightError
from ..io.config_file import read_config_json
from ..io.paths import absolute_path
from ..io.reader import CheckpointReader, unneeded_pickle_note
from ..io.resolve import resolve_model_path, revision_problems
from ..io.writer import CheckpointWriter, clean_stale_scratch_folders
from ..options import CalibrationOptions, ConvertOptions, argument_problems, optional_argument, path_argument
from ..source.config import SourceConfig
from ..source.folds import source_folds
from ..source.model import StreamedRows, StreamedSourceModel
from ..source.shapes import MLAShape
from ..units import dtype_name
from . import serving as S
from . import target as T
from .calibration import LayerInputStats, StatsStore, calibration_ids, layer_input_stats, rope_stats_for_layer
from .decisions import (
    METHOD_ALIASES,
    PhaseTimer,
    Progress,
    RefinePolicy,
    advance_through_converted,
    check_finite,
    check_statistics,
    choose_rope_grid,
    convert_layer,
    effort_of,
    served_attention_error,
)
from .layer import LayerReport
from .memory import pin_mmap_threshold
from .preflight import check_source_finite, expected_tensor_shapes, output_path_problems, run_preflight
from .report import REPORT_FILE, ConversionFacts, build_report
from .rope import deepseek_rope_parameters, grid_frame, grid_inv_freq, plan_layer

__all__ = ["CalibrationOptions", "ConversionResult", "ConvertOptions", "Converter", "Progress", "convert"]


COPY_BLOCK_BYTES = 16 * 2**20  # rows of a carried-over tensor are mapped (resident) this many stored bytes at a time


@dataclass
class ConversionResult:
    output: Path
    report: dict
    layer_reports: list[LayerReport]


# embedding rows compared per read when a tied config meets a stored head (bounded memory on a 128K vocabulary)
_TIE_CHECK_ROWS = 4096


def untie_if_the_checkpoint_does(source: SourceConfig, reader: CheckpointReader, progress: Progress) -> SourceConfig:
    """`tie_word_embeddings: true` with a stored `lm_head.weight` that differs from the embeddings: transformers loads
    the two untied (it keeps both), so the source model *is* untied, and so must the conversion be."""
    arch = source.architecture
    if not source.tied_embeddings or arch.lm_head not in reader or arch.embed not in reader:
        return source
    for start in range(0, source.vocab_size, _TIE_CHECK_ROWS):
        stop = min(start + _TIE_CHECK_ROWS, source.vocab_size)
        if not torch.equal(reader.get_rows(arch.embed, start, stop), reader.get_rows(arch.lm_head, start, stop)):
            progress.message(f"note: config.json ties the output head to the embeddings, but the checkpoint's "
                             f"{arch.lm_head} differs from them; transformers loads the two untied, and so does "
                             "this conversion")
            return dataclasses.replace(source, tied_embeddings=False)
    return source


def with_the_weights_dtype(source: SourceConfig, reader: CheckpointReader, message: Callable[[str], None],
                           dtype_option: str = "auto") -> SourceConfig:
    """A config.json that states no dtype: transformers 5 loads the weights' own dtype, so that is the source's (and
    what `--dtype auto` exports); reading it as float32 exported a bf16 checkpoint at twice its size.  A shard too
    damaged to read returns `source` itself: pre-flight reports the damage beside every other problem, in one run."""
    if source.dtype_stated:
        return source
    try:
        stored = reader.floating_dtype() or source.torch_dtype
    except CheckpointError:  # a damaged shard: pre-flight reports it beside every other problem, so don't raise here
        return source
    if dtype_option == "auto":
        message(f"note: config.json states no dtype; the weights are stored as {dtype_name(stored)}, which "
                         "transformers loads and --dtype auto exports" + (" (as bfloat16: fp16 cannot hold the latent)"
                                                                          if stored == torch.float16 else ""))
    return dataclasses.replace(source, torch_dtype=stored)


class Converter:
    """One source model, calibrated once, exported to one or more MLA shapes (sweeps reuse the calibration)."""

    def __init__(self, source: str | os.PathLike, options: ConvertOptions | None = None, progress: Progress | None = None,
                 setting_problems: Sequence[str] = ()):
        self.options = options or ConvertOptions()
        self.progress = progress or Progress()
        self.source = source
        pin_mmap_threshold()  # freed per-layer temporaries leave the process (see memory.py)
        self.source_path = resolve_model_path(source, self.options.revision, self.options.allow_pickle)
        raw = read_config_json(self.source_path)
        revision = revision_problems(self.options.revision, source)
        problems = SourceConfig.problems(raw)
        try:  # a broken config and unreadable weights are reported together
            self.reader = CheckpointReader(self.source_path, allow_pickle=self.options.allow_pickle)
        except CheckpointError as error:
            if not problems and not revision:
                raise
            problems.append(str(error))
        if problems:
            raise PreflightError(revision + problems)
        unneeded = unneeded_pickle_note([self.source_path]) if self.options.allow_pickle else None
        if unneeded:
            self.progress.message(f"note: {unneeded}")
        # what is wrong with the settings themselves (`setting_problems`: the caller's, e.g. the CLI's flags that
        # cannot act; a --revision that cannot act on a local folder): raised with pre-flight's problems
        # (`preflight`), so that the ranks', options' and output's problems come in the same run
        self.setting_problems = [*setting_problems, *revision]
        self.config = with_the_weights_dtype(untie_if_the_checkpoint_does(SourceConfig.from_dict(raw), self.reader, self.progress),
                                             self.reader, self.progress.message, self.options.dtype)
        self.reader.fold(source_folds(self.config))  # read as the Llama it equals (source/folds.py)
        self.device = _device(self.options.device)
        self.model = StreamedSourceModel(self.reader, self.config, dtype=torch.float32, device=self.device,
                                         resident_bytes=resident_weight_budget(self.device))
        self.store: StatsStore | None = None
        self.ids: torch.Tensor | None = None
        self.calibration_description = ""
        self.rope_stats: list = []
        self.calibration_seconds = 0.0
        self.closed = False  # `close` removed the statistics: an export would silently calibrate all over again
        self.calibration_phases: dict[str, float] = {}  # wall time per calibration phase (shared by every export)
        self.calibration_cpu: dict[str, float] = {}  # and process CPU time
        self.calibration_windows: dict[str, list[float]] = {}  # and when (Unix time: first start, last end)

    def preflight(self, output: Path, options: ConvertOptions | None = None) -> tuple[MLAShape, torch.dtype]:
        """The shape and dtype to export (PreflightError: every problem, the settings' first).  A run refused for its
        settings prints its errors alone: no notes or disk estimate."""
        self._refuse_if_closed()  # (it would read the closed source's headers)
        quiet = bool(self.setting_problems)
        try:
            shape = run_preflight(self.config, self.reader, Path(output), options or self.options,
                                  (lambda line: None) if quiet else self.progress.message, calibrated=self.store is not None)
        except PreflightError as error:
            raise PreflightError(self.setting_problems + error.problems) from error
        if self.setting_problems:
            raise PreflightError(self.setting_problems)
        return shape

    def calibrate(self) -> None:
        """Calibration windows and the per-layer statistics pass (once per Converter)."""
        if self.setting_problems:  # (an API caller that skipped `preflight`)
            raise PreflightError(self.setting_problems)
        self._refuse_if_closed()
        if self.store is not None:
            return
        started = time.time()
        model, source, calib = self.model, self.config, self.options.calibration
        progress = PhaseTimer(self.progress, self.calibration_phases, self.calibration_cpu, self.calibration_windows)
        # NaN/Inf in the source named before any forward pass; killed runs' statistics removed
        progress.phase("checking source weights for NaN/Inf", len(expected_tensor_shapes(source)))
        check_source_finite(self.reader, source, progress.advance)
        for name in clean_stale_scratch_folders():
            progress.message(f"removed {name}, left behind in the temp folder by an interrupted run")
        progress.phase("reading calibration text" if calib.data else "sampling calibration text from the source model",
                       None if calib.data else calib.seq_len - 1)
        self.ids, self.calibration_description = calibration_ids(model, self.source_path, calib, progress=progress.advance)
        model.release()
        self.store = StatsStore()
        progress.phase("calibration statistics", source.num_layers)
        hidden = model.embed(self.ids)
        model.release()
        cos, sin = model.cos_sin(self.ids.shape[1])
        for index in range(source.num_layers):
            layer = model.load_layer(index)
            stats = layer_input_stats(model, layer, hidden, cos, sin, calib)
            check_statistics(stats, index, "calibration statistics")
            self.rope_stats.append(rope_stats_for_layer(layer, stats, source))
            self.store.save(index, stats.to_tensors())
            del layer, stats  # its two d x d moments are not held through the next layer's pass (2 x 134 MB at hidden 4096)
            model.release()
            progress.advance(index + 1, source.num_layers)
        progress.stop()
        self.calibration_seconds = time.time() - started

    def export(self, output: str | os.PathLike, options: ConvertOptions | None = None, mla: MLAShape | None = None,
               export_dtype: torch.dtype | None = None, command: str | None = None) -> ConversionResult:
        """Choose the RoPE grid, convert every layer and write the DeepseekV3 folder at `output`."""
        options = options or self.options
        self._refuse_if_closed()  # (before pre-flight, which would read the closed source's headers again)
        # calibration runs once per Converter, with its own settings: an export asking for others would get these
        # and record the ones it asked for
        differing = [name for name in ("calibration", "device") if getattr(options, name) != getattr(self.options, name)]
        if differing:
            raise PreflightError([f"export: {name} differs from the Converter's; it calibrates once, with its own "
                                  f"{name} settings (make another Converter for others)" for name in differing])
        started = time.time()
        output = Path(output)
        if mla is None or export_dtype is None:
            mla, export_dtype = self.preflight(output, options)
        self.calibrate()
        method = METHOD_ALIASES[options.method]
        model, source, calib, store = self.model, self.config, self.options.calibration, self.store
        phase_seconds = dict(self.calibration_phases)  # this export's phases are added to the shared calibration
        phase_cpu = dict(self.calibration_cpu)
        phase_windows = {name: list(window) for name, window in self.calibration_windows.items()}
        progress = PhaseTimer(self.progress, phase_seconds, phase_cpu, phase_windows)
        use_q_lora = mla.q_lora_rank is not None or source.qkv_bias
        target = T.target_of(options.target)
        layout = T.export_layout(source, mla, target)
        q_lora_rank, attention_bias = layout.q_lora_rank, layout.attention_bias
        served: list[dict] = []  # per-layer serving facts (serving targets only)
        # the grid the slots count in: the source's own, or (a llama3 source, an engine that ignores its scaling) the
        # unscaled one, exported as default RoPE
        frame, frame_rope = grid_frame(source.rope_parameters, source.head_dim, model.inv_freq, target.llama3_scaling)
        grid, plans, grid_table = choose_rope_grid(
            self.rope_stats, model.load_layer, lambda i: LayerInputStats.from_tensors(store.load(i, model.device)), model, mla,
            effort_of(options).rope_finalists, progress, offsets=target.rope_offsets, frame=frame,
        )
        rope_parameters = deepseek_rope_parameters(frame_rope, grid, source.head_dim)
        rope_error = T.verify_rope(rope_parameters, mla.rope_dim, grid_inv_freq(grid, frame))
        target_config = T.build_config(source, mla, rope_parameters, export_dtype, q_lora_rank, attention_bias,
                                       layout.tie_word_embeddings)
        writer = CheckpointWriter(output, options.max_shard_size, options.overwrite, options.force)
        with writer:
            before, after = T.global_names(source)
            for src, dst in before.items():
                self._copy_table(writer, src, dst, export_dtype)
            layer_reports: list[LayerReport] = []
            progress.phase("converting layers", source.num_layers)
            hidden = None
            cos, sin = model.cos_sin(self.ids.shape[1])
            if options.sequential:
                hidden = model.embed(self.ids)
                model.release()
            refine = RefinePolicy.of(options, source, windows=int(self.ids.shape[0]))

            def export_layer(index: int) -> LayerReport:
                """Convert and write one layer. A function so that its tensors are freed before the next layer
                starts: held across the loop, one layer's leftovers (its float64 query rows, the last K/V attempt's
                weights, its statistics) stayed live through the next layer's peak (0.3 GiB at Llama-3-8B width)."""
                layer = model.load_layer(index)
                plan = plans[index]
                if options.sequential:
                    # statistics of what this layer really receives: the output of the converted layers below
                    stats = layer_input_stats(model, layer, hidden, cos, sin, calib, move_hidden=False)
                    check_statistics(stats, index, "sequential re-calibration")
                    plan = plan_layer(rope_stats_for_layer(layer, stats, source), grid, model.inv_freq,
                                      source.num_kv_heads, max_fold=grid.step, frame=frame, rotates=source.rotates(index))
                else:
                    stats = LayerInputStats.from_tensors(store.load(index, model.device))
                step = "refinement" if refine.steps > 0 else "factorization"
                try:
                    # the serving transforms below read the layer's moments; otherwise they are freed during the conversion
                    weights, report = convert_layer(layer, stats, mla, plan, method, options, model, use_q_lora, refine,
                                                    keep_moments=target.serving)
                except torch.linalg.LinAlgError as error:
                    raise ConversionError(f"layer {index}, step '{step}': {str(error).splitlines()[0]}; nothing was written") from error
                check_finite(weights, f"layer {index}, step '{step}'")
                carried = {role: layer.weights[role] for role in T.carried_over_names(source, index)}
                if target.serving:  # biases out first: the layers above are calibrated on what they will get
                    weights, bias_info = S.remove_biases(weights, stats, source, mla, plan.slot_inv_freq, int(self.ids.numel()))
                    problem = S.bias_cost_problem(index, bias_info, report.attention_error)
                    if problem:
                        raise ConversionError(problem)
                if options.sequential:
                    advance_through_converted(model, layer, weights, hidden, mla, plan.slot_inv_freq, calib.chunk)
                if target.serving:
                    layer_serving = S.serve_layer(weights, carried["input_norm"], stats, source, mla, layout)
                    check_finite(layer_serving.weights, f"layer {index}, step 'serving transforms'")
                    if report.attention_error is not None:  # the error of what the export computes, not of the closed form
                        report.extra["attention_error_before_serving"] = report.attention_error
                        report.attention_error = served_attention_error(
                            layer_serving.weights, carried["input_norm"], layer_serving.input_norm, layer, stats, model,
                            mla, plan.slot_inv_freq)
                    weights, carried["input_norm"] = layer_serving.weights, layer_serving.input_norm
                    # the latent is stored at the serving scale now: the report gives the one the export's gain encodes
                    report.latent_scale = T.latent_scale_of(weights[T.KV_A_NORM])
                    if "query_latent_scale" in report.extra:  # the query latent is refit the same way
                        report.extra["query_latent_scale"] = T.latent_scale_of(weights[T.Q_A_NORM])
                    served.append({"layer": index, **({"bias": bias_info} if bias_info else {}), **layer_serving.info})
                prefix = T.attention_prefix(index)
                for name, tensor in weights.items():
                    writer.add(prefix + name, tensor.to(export_dtype))
                for role, dst in T.carried_over_names(source, index).items():
                    if isinstance(carried[role], StreamedRows):  # a large MLP matrix: copied a block of rows at a time
                        self._copy_table(writer, carried[role].name, dst, export_dtype)
                    else:
                        writer.add(dst, carried[role].to(export_dtype))
                return report

            for index in range(source.num_layers):
                layer_reports.append(export_layer(index))
                model.release()
                progress.advance(index + 1, source.num_layers)
            progress.phase("writing the output", None)
            for src, dst in after.items():
                self._copy_table(writer, src, dst, export_dtype)
            if source.tied_embeddings and not layout.tie_word_embeddings:  # the engine builds its own head: give it one
                self._copy_table(writer, source.architecture.embed, "lm_head.weight", export_dtype)
            target_config.save_pretrained(writer.partial)
            copied = writer.copy_sidecars(self.source_path)
            report = build_report(ConversionFacts(
                source_name=str(self.source), source_folder=self.source_path, output=output, source=source, mla=mla, options=options,
                calibration_description=self.calibration_description, calibration_tokens=int(self.ids.numel()),
                calibration_fingerprint=hashlib.sha256(self.ids.cpu().to(torch.int64).numpy().tobytes()).hexdigest(),
                grid=grid, rope_parameters=rope_parameters, grid_table=grid_table, layer_reports=layer_reports,
                export_dtype=export_dtype, seconds=time.time() - started + self.calibration_seconds,
                q_lora_rank=q_lora_rank, attention_bias=attention_bias, command=command,
                serving=S.serving_report(source, mla, target, layout, served, export_dtype, options.compression,
                                         ranks_given=options.kv_lora_rank is not None or options.rope_dim is not None),
            ))
            progress.stop()
            report["rope"]["max_relative_frequency_error"] = rope_error
            report["copied_from_source"] = copied  # tokenizer and generation files: the card says what came along
            report["summary"]["phase_seconds"] = {name: round(value, 3) for name, value in phase_seconds.items()}
            report["summary"]["phase_cpu_seconds"] = {name: round(value, 3) for name, value in phase_cpu.items()}
            report["summary"]["phase_windows_unix"] = {name: [round(t, 3) for t in window] for name, window in phase_windows.items()}
            report["summary"]["cpu_seconds"] = round(time.process_time(), 2)  # the whole process, all threads
            report["refinement"] = refine.decision
            report["summary"]["device"] = describe_device(model.device)
            if model.device.type == "cuda":
                report["summary"]["peak_device_bytes"] = torch.cuda.max_memory_allocated(model.device)
            report["summary"]["resident_source_bytes"] = model.resident_tensor_bytes  # source weights kept on the device
            writer.write_json(REPORT_FILE, report)
            _write_card(writer, report)
            result_path = writer.commit()
        return ConversionResult(result_path, report, layer_reports)

    def _copy_table(self, writer: CheckpointWriter, source_name: str, target_name: str, dtype: torch.dtype) -> None:
        """Copy a carried-over tensor (embeddings, head, final norm, large MLP matrices) in row blocks: one block is in
        memory at a time."""
        info = self.reader.info(source_name)

        def rows(start: int, stop: int) -> torch.Tensor:
            return self.reader.get_rows(source_name, start, stop).to(dtype)

        row_bytes = max(1, info.nbytes // max(1, info.shape[0]))
        writer.add_rows(target_name, info.shape, dtype, rows, rows_per_chunk=max(1, COPY_BLOCK_BYTES // row_bytes))

    def _refuse_if_closed(self) -> None:
        """After `close()` the statistics are deleted and the source's shards closed: working on would silently
        calibrate again into statistics nothing removes, or read closed files."""
        if self.closed:
            raise PreflightError(["the Converter is closed (its calibration statistics are removed and its source "
                                  "closed); make a new Converter to convert again"])

    def close(self) -> None:
        self.closed = True
        if self.store is not None:
            self.store.cleanup()
            self.store = None
        self.reader.close()

    def __enter__(self) -> Converter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def convert(source: str | os.PathLike, output: str | os.PathLike, options: ConvertOptions | None = None,
            progress: Progress | None = None, command: str | None = None,
            caller_problems: Sequence[str] = ()) -> ConversionResult:
    """Convert `source` (folder or hub id) into a DeepseekV3 MLA folder at `output`.

    Pre-flight runs first and reports every problem at once; nothing is written unless the whole
    conversion succeeds (the output appears by an atomic rename).  `command` is recorded in the report.
    `caller_problems`: what the caller found wrong with its own settings (the CLI's flags); pre-flight still
    runs, so that one PreflightError names those and the source's and output's problems together.
    """
    caller_problems = list(caller_problems)
    wrong_types = argument_problems(source=path_argument(source), output=path_argument(output),
                                    options=optional_argument(options, ConvertOptions))
    if wrong_types:
        raise PreflightError(caller_problems + wrong_types)
    options = options or ConvertOptions()
    output = absolute_path(output)  # `.`, `out/` and `~/out` name the folder itself
    if not output.name:
        raise PreflightError(caller_problems + [f"{output}: is the root folder; give the path of a folder to create"])
    try:  # problems with the output path are reported together with those of the source
        converter = Converter(source, options, progress, setting_problems=caller_problems)
    except MLAConvertError as error:
        lines = error.problems if isinstance(error, PreflightError) else [str(error)]
        raise PreflightError(caller_problems + lines + output_path_problems(Path(output), options.overwrite,
                                                                            force=options.force)) from error
    with converter:
        mla, export_dtype = converter.preflight(Path(output), options)
        converter.calibrate()
        return converter.export(output, options, mla, export_dtype, command=command)


def _device(name: str) -> torch.device:
    """The compute device; an unusable one is a pre-flight problem (`preflight.device_problems`), not a crash here."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        return torch.device("cpu")
    return device if device.type != "cuda" or torch.cuda.is_available() else torch.device("cpu")


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


def _write_card(writer: CheckpointWriter, report: dict) -> None:
    from ..hub.card import build_model_card, export_config, save_card

    save_card(build_model_card(report, config=export_config(writer.partial)), writer.partial / "README.md")


def install_sigterm_handler() -> None:
    """Turn SIGTERM (and SIGHUP: the terminal closed) into KeyboardInterrupt so they clean up like Ctrl-C does."""
    from ..errors import TerminatedBySignal

    def handler(signum, frame):
        raise TerminatedBySignal(signum)

    for signum in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if signum is not None:
            signal.signal(signum, handler)
