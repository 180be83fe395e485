"""`mla-convert inspect`: what the source attention is and what an MLA shape would cache."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import PreflightError
from ..source.config import ExportConfig, SourceAttentionShape, SourceConfig, sliding_phrase
from ..source.folds import family_notes
from ..source.shapes import CacheCost, MLAShape, cache_costs, pick_target_shape, ratio_of, shape_problems, target_shapes
from ..units import human_bytes


@dataclass(frozen=True)
class InspectReport:
    source: SourceConfig
    mla: MLAShape
    dtype: torch.dtype
    context: int
    batch: int
    source_cost: CacheCost
    mla_cost: CacheCost

    @property
    def ratio(self) -> float:
        return self.source_cost.values_per_token_layer / self.mla_cost.values_per_token_layer

    def notes(self) -> list[str]:
        """What the conversion changes about the source's attention (`folds.family_notes`), and what the table's "cache
        for N tokens" row needs said: a window that caps the source's cache, and positions the export does not declare
        (it attends to every position, so a windowed source's export declares the window)."""
        s = self.source
        notes = family_notes(s)
        if s.sliding_window and self.context > s.sliding_window:
            notes.append(f"{window_note(s.sliding_window, s.sliding_layers, s.num_layers)}; the export attends to every "
                         f"position and declares max_position_embeddings {s.export_max_positions}, the context where "
                         "the two agree")
        if self.context > self.source.export_max_positions and not self.source.sliding_window:
            notes.append(f"the cache row's context ({self.context}, --context) is longer than the model's max_position_embeddings "
                         f"{self.source.export_max_positions}, which the export keeps")
        return notes

    def rows(self) -> list[tuple[str, str, str]]:
        """(quantity, source, MLA) rows for the before/after table."""
        return cache_rows(self.source_cost, self.mla_cost, self.context, self.batch)


UNKNOWN = "unknown"


def window_note(window: int, sliding_layers: int | None, num_layers: int) -> str:
    """The note on a window that caps the source's cache row (`sliding_layers` None: every layer slides)."""
    if sliding_layers is None or sliding_layers >= num_layers:
        return (f"the source slides its attention {sliding_phrase(window, sliding_layers, num_layers)}, so it caches at "
                "most that many per sequence (counted so above)")
    return (f"the source slides its attention {sliding_phrase(window, sliding_layers, num_layers)}, so those layers "
            "cache at most that many per sequence and the others every token (counted so above)")


def windowed_ratio(source: CacheCost | None, mla: CacheCost, context: int, batch: int) -> str:
    """What the ratio line adds when a window caps the source's cache at `context` (the ratio itself is per cached
    token): the ratio of the two caches the table's row shows; "" when no window caps it."""
    if source is None or not source.window_label(context) or not context * batch:
        return ""
    at = source.bytes_for(context, batch) / mla.bytes_for(context, batch)
    change = f"{at:.2f}x smaller" if at >= 1 else f"{1 / at:.2f}x larger for the MLA"
    return (f" per cached token; at {context} tokens x batch {batch}, where the source's sliding layers keep at most "
            f"{source.window} tokens, the cache is {change} ({human_bytes(source.bytes_for(context, batch))} vs "
            f"{human_bytes(mla.bytes_for(context, batch))})")


def cache_rows(source: CacheCost | None, mla: CacheCost, context: int, batch: int) -> list[tuple[str, str, str]]:
    """(quantity, source, MLA) rows of the before/after table; every source cell "unknown" when `source` is None (an
    export whose source is not recorded: its numbers are never guessed).  The source's cache for `context` is what its
    CacheCost holds: its sliding layers keep at most their window."""
    if not context * batch:
        return []

    def of_source(cell) -> str:
        return UNKNOWN if source is None else cell(source)

    return [
        ("cached values / token / layer", of_source(lambda s: f"{s.values_per_token_layer}"), f"{mla.values_per_token_layer}"),
        ("bytes / token / layer", of_source(lambda s: f"{s.bytes_per_token_layer}"), f"{mla.bytes_per_token_layer}"),
        ("bytes / token (all layers)", of_source(lambda s: human_bytes(s.bytes_per_token)), human_bytes(mla.bytes_per_token)),
        (f"cache for {context} tokens x batch {batch}", of_source(lambda s: human_bytes(s.bytes_for(context, batch)) + s.window_label(context)),
         human_bytes(mla.bytes_for(context, batch))),
        ("tokens cached per GiB", of_source(lambda s: f"{(1 << 30) // s.bytes_per_token:,}"),
         f"{(1 << 30) // mla.bytes_per_token:,}"),
    ]


def inspect_shapes(
    source: SourceConfig,
    kv_lora_rank: int | None = None,
    rope_dim: int | None = None,
    compression: float | None = None,
    dtype: torch.dtype = torch.bfloat16,
    context: int = 4096,
    batch: int = 1,
    target: str | None = None,
) -> InspectReport:
    mla = pick_target_shape(source, target, kv_lora_rank, rope_dim, compression)
    problems = shape_problems(source, mla.kv_lora_rank, mla.rope_dim)
    if problems:  # one line each, as convert's pre-flight prints them
        raise PreflightError(problems)
    source_cost, mla_cost = cache_costs(source, mla, dtype)
    return InspectReport(source, mla, dtype, context, batch, source_cost, mla_cost)


def target_rows(source: SourceConfig) -> list[tuple[str, str, str]]:
    """(target, the shapes it allows for this source, their KV ratios and the llama.cpp q8_0 KV-cache rule) per target."""
    from ..convert.engines import rope_problems
    from ..convert.target import TARGETS

    rows = []
    for target in TARGETS.values():
        allowed = target_shapes(source, target)
        refused = rope_problems(target, source.rope_parameters)
        if refused:  # convert refuses this source for the target whatever the shape
            rows.append((target.name, f"none: convert refuses this source's {refused[0].split(':')[0]} (the target's engine "
                                      "cannot run it as declared, measured)", "-"))
            continue
        if allowed is None:
            shapes = f"any: kv_lora_rank <= {source.max_kv_lora_rank}, even rope_dim <= {source.max_rope_dim}"
            # from the widest shape allowed (full rank + the widest RoPE key: below 1x for MQA) to the narrowest (2+... = 3)
            widest = source.max_kv_lora_rank + source.max_rope_dim
            ratios = f"{source.kv_values_per_token_layer / widest:.2f}x to {source.kv_values_per_token_layer / 3:.1f}x"
        else:
            shapes = ", ".join(f"{m.kv_lora_rank}+{m.rope_dim}" for m in allowed) or \
                f"none (kv_lora_rank + rope_dim must be one of {', '.join(map(str, target.widths))})"
            ratios = ", ".join(f"{ratio_of(source, m):.2f}x" for m in allowed) or "-"
        if target.quantized_kv_block:
            block = target.quantized_kv_block
            ropes = [d for d in range(block, source.max_rope_dim + 1, block)]
            ranks = source.max_kv_lora_rank // block * block
            if allowed is not None:
                ok = [m for m in allowed if target.quantized_kv_problem(m.kv_lora_rank, m.rope_dim) is None]
                rule = f"q8_0 KV cache: {', '.join(f'{m.kv_lora_rank}+{m.rope_dim}' for m in ok) or 'none'}"
            elif ropes and ranks:
                rule = (f"q8_0 KV cache only with kv_lora_rank and rope_dim multiples of {block}: rope_dim "
                        f"{' or '.join(map(str, ropes))}, kv_lora_rank {block}..{ranks}")
            else:
                rule = f"q8_0 KV cache impossible (needs rope_dim and kv_lora_rank multiples of {block}; rope_dim <= {source.max_rope_dim})"
            ratios += f"; {rule}"
        rows.append((target.name, shapes, ratios))
    return rows


# --------------------------------------------------------------------------- an MLA export
def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class RecordedSource(SourceAttentionShape):
    """The model an export was converted from, as the export's conversion report (mla_convert.json) records it."""

    name: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    sliding_layers: int | None = None  # None with a window: every layer slides (a report before mla-convert recorded it)

    @classmethod
    def from_report(cls, report: dict) -> RecordedSource | None:
        """None when the report's `source` section lacks a whole shape (positive integers) to count the cache from."""
        section = report.get("source")
        if not isinstance(section, dict):
            return None
        sizes = {key: section.get(key) for key in ("num_layers", "num_heads", "num_kv_heads", "head_dim")}
        if not all(_positive_int(value) for value in sizes.values()):
            return None
        window = section.get("sliding_window")
        window = window if _positive_int(window) else None
        sliding = section.get("sliding_layers")  # (an older report has none: every layer slid then)
        sliding = sliding if window and _positive_int(sliding) and sliding <= sizes["num_layers"] else None
        return cls(name=str(section.get("name_or_path") or "?"), architecture=str(section.get("architecture") or "?"),
                   sliding_window=window, sliding_layers=sliding, **sizes)


def _shown_source_path(recorded: str, folder: Path) -> str:
    """The report names a local source relative to the export folder (so that the two can move together); printed
    as it was, `../../../models/llama` read as relative to the working folder, a place that is not the source.  A
    path that exists from the folder is shown from the working folder (absolute when that would climb out of it)."""
    if not recorded or Path(recorded).is_absolute() or not (folder / recorded).exists():
        return recorded
    target = (folder / recorded).resolve()
    relative = os.path.relpath(target)
    return relative if not relative.startswith("..") else str(target)


@dataclass(frozen=True)
class ExportInspection:
    """What an MLA export caches (from its config.json) and, where its conversion report records them, the source it was
    converted from, the serving target it was made for and the recorded engine runs of exports like it.  Nothing the
    report does not record is filled in: `source` and `target` are None then, with the reason in `unknown_because`."""

    name: str
    export: ExportConfig
    dtype: torch.dtype
    context: int
    batch: int
    source: RecordedSource | None
    target: str | None
    report_file: str | None  # the report the source and target were read from (None: none was used)
    unknown_because: str | None  # why the source or the target is unknown
    runs: tuple[dict, ...] = ()  # mla_convert/convert/engine_runs.json records of this target, shape and RoPE, of the
    # engines that can run the export as is
    # {engine: why it cannot run this export as is} (convert/engines.py's constraints: the verdict mla_convert.json and
    # the card give); the recorded runs of these engines were of exports without these traits and are left out of `runs`
    blocked: dict[str, list[str]] = field(default_factory=dict)
    withheld_runs: tuple[dict, ...] = ()  # recorded runs of this target, shape and RoPE left out for an engine in `blocked`
    dtype_from: str | None = None  # where `dtype` came from when not asked for: "stored dtype", or why it is bf16

    @property
    def dtype_label(self) -> str:
        """The cache dtype as the table's title names it: 'bf16', or 'float32, stored dtype' when not asked for."""
        from ..units import dtype_name

        names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
        name = names.get(self.dtype, dtype_name(self.dtype))
        return f"{name}, {self.dtype_from}" if self.dtype_from else name

    @property
    def mla(self) -> MLAShape:
        return MLAShape(self.export.kv_lora_rank, self.export.rope_dim, self.export.q_lora_rank)

    @property
    def mla_cost(self) -> CacheCost:
        return CacheCost(self.export.kv_values_per_token_layer, self.export.num_layers, self.dtype)

    @property
    def source_cost(self) -> CacheCost | None:
        if self.source is None:
            return None
        return CacheCost(self.source.kv_values_per_token_layer, self.source.num_layers, self.dtype,
                         self.source.sliding_window, self.source.sliding_layers)

    @property
    def ratio(self) -> float | None:
        """Source cache / export cache per token (all layers); None when the source is unknown."""
        source = self.source_cost
        return None if source is None else source.bytes_per_token / self.mla_cost.bytes_per_token

    def rows(self) -> list[tuple[str, str, str]]:
        return cache_rows(self.source_cost, self.mla_cost, self.context, self.batch)

    def notes(self) -> list[str]:
        from ..convert.engines import LLAMA_CPP_LITE_LAYERS, PATCHES

        notes = []
        s = self.source
        if s is not None and s.sliding_window and self.context > s.sliding_window:
            notes.append(f"{window_note(s.sliding_window, s.sliding_layers, s.num_layers)}; the export attends to every "
                         "position")
        if self.context > self.export.max_position_embeddings:
            notes.append(f"the cache row's context ({self.context}, --context) is longer than the export's max_position_embeddings "
                         f"{self.export.max_position_embeddings}")
        extras = ([f"q_lora_rank {self.export.q_lora_rank}"] if self.export.q_lora_rank is not None else []) + (
            [f"mixture-of-experts MLPs in {self.export.moe_layers} of {self.export.num_layers} layers"]
            if self.export.moe_layers else [])
        if extras:
            notes.append(f"{' and '.join(extras)}: no change to the KV cache, which holds the latent (kv_lora_rank) and "
                         "the shared RoPE key (qk_rope_head_dim) per token and layer")
        patches = sorted({name for run in self.runs for name in run.get("workarounds") or []})
        if patches:
            notes.append("the runs marked 'harness workarounds' needed the test harness's patches to the engine: "
                         + "; ".join(f"{name} ({PATCHES.get(name, 'see docs/engines.md')})" for name in patches))
        if self.export.num_layers in LLAMA_CPP_LITE_LAYERS and any(run["engine"] == "llama.cpp" for run in self.runs):
            notes.append(f"{self.export.num_layers} layers: llama.cpp b11434 takes a 26- or 27-layer DeepSeek model for "
                         "V2-Lite and ignores its q_lora_rank (read in src/models/deepseek2.cpp; no such model was run)")
        return notes


def read_export_report(model: str | os.PathLike, folder: Path, revision: str | None = None) -> tuple[dict | None, str | None]:
    """(the export's conversion report, None), or (None, why it is not used): absent, unreadable, not mla-convert's,
    or of another conversion than config.json's."""
    from ..convert.report import REPORT_FILE
    from ..convert.target import report_config_differences
    from ..errors import MLAConvertError
    from ..hub.card import load_report
    from ..io.resolve import optional_file

    path, why = optional_file(model, folder, REPORT_FILE, revision)
    if path is None:
        return None, why or (f"{model} has no {REPORT_FILE} (the report mla-convert writes beside an export): "
                             "a DeepseekV3 model mla-convert did not write, or its report was removed")
    try:
        report = load_report(path.parent)
    except MLAConvertError as error:
        return None, str(error)
    wrong = report_config_differences(folder, report)
    if wrong:
        return None, (f"config.json and {REPORT_FILE} describe different models ({', '.join(wrong)}): the report is of "
                      "another conversion")
    return report, None


def inspect_export(model: str | os.PathLike, dtype: torch.dtype | None = None, context: int = 4096, batch: int = 1,
                   revision: str | None = None) -> ExportInspection:
    """`inspect` on an MLA export (a folder or hub id whose config.json is DeepseekV3's): its KV cache from config.json;
    the source's cache, the ratio and the serving target from its mla_convert.json, when it has one that matches;
    the recorded engine runs of exports of that target, shape and RoPE (mla_convert/convert/engine_runs.json).
    `dtype` None: the cache's dtype is the one config.json stores (bf16 where it states none)."""
    from ..convert.engines import export_constraint_problems, recorded_runs
    from ..convert.report import REPORT_FILE
    from ..convert.target import TARGETS
    from ..eval.checks import positive_problems
    from ..io.config_file import read_config_json
    from ..io.resolve import resolve_config_path

    problems = positive_problems({"context": context, "batch": batch})
    if problems:
        raise PreflightError(problems)
    folder = resolve_config_path(model, revision)
    export = ExportConfig.from_dict(read_config_json(folder))
    dtype_from = None
    if dtype is None:
        dtype, dtype_from = (export.torch_dtype, "stored dtype") if export.torch_dtype is not None else \
            (torch.bfloat16, "config.json states no dtype")
    report, why = read_export_report(model, folder, revision)
    source = target = None
    if report is not None:
        source = RecordedSource.from_report(report)
        if source is not None:
            source = dataclasses.replace(source, name=_shown_source_path(source.name, folder))
        options = report.get("options")
        target = options.get("target") if isinstance(options, dict) else None
        target = target if isinstance(target, str) and target in TARGETS else None
        missing = [what for what, value in (("source shape (num_layers, num_heads, num_kv_heads, head_dim)", source),
                                            ("--target", target)) if value is None]
        if missing:
            why = f"{REPORT_FILE} records no {' and no '.join(missing)}"
    shape = MLAShape(export.kv_lora_rank, export.rope_dim)
    recorded = [] if target is None else recorded_runs(target, shape, export.q_lora_rank, export.rope_type)
    blocked = {} if target is None else export_constraint_problems(target, shape, export.attention_bias,
                                                                   export.q_lora_rank, export.tied_embeddings)
    runs = tuple(run for run in recorded if run["engine"] not in blocked)
    return ExportInspection(str(model), export, dtype, context, batch, source, target,
                            REPORT_FILE if report is not None else None, why, runs, blocked,
                            tuple(run for run in recorded if run["engine"] in blocked), dtype_from)


ESTIMATE_DEVICES = ("cpu", "cuda")
# beyond this a core count is no machine's (the largest two-socket servers have ~512 cores)
MAX_ESTIMATE_CORES = 1024


def estimate_problems(estimate: bool, device: str | None, cpu_cores: int | None, options) -> list[str]:
    """Every problem with the `inspect --estimate` flags, one line each (a flag that would change nothing is one too)."""
    from ..options import ConvertOptions, option_problems

    problems = option_problems(options) if options is not None else []
    if device is not None and device not in ESTIMATE_DEVICES:
        problems.append(f"--device {device!r}: the estimate knows cpu and cuda (cuda: one NVIDIA H200, the GPU it was fitted on)")
    if cpu_cores is not None and cpu_cores < 1:
        problems.append(f"--cpu-cores {cpu_cores}: must be at least 1")
    if cpu_cores is not None and cpu_cores > MAX_ESTIMATE_CORES:
        problems.append(f"--cpu-cores {cpu_cores}: more than any one machine's {MAX_ESTIMATE_CORES}; the CPU constants were "
                        "fitted on 2-core runs and a prediction that far out would mean nothing")
    if cpu_cores is not None and device == "cuda":
        problems.append("--cpu-cores: only with --device cpu (the cuda estimate is for the fitted GPU machine)")
    if not estimate:
        given = [flag for flag, value in (("--device", device), ("--cpu-cores", cpu_cores)) if value is not None]
        # --target also picks the shapes inspect shows, so it stands alone
        given += changed_flags(options, ConvertOptions(target=options.target)) if options is not None else []
        if given:
            problems.append(f"{', '.join(given)}: only change the cost estimate; add --estimate")
    return problems


def estimate_source_problems(source: SourceConfig, options, kv_lora_rank: int | None = None, rope_dim: int | None = None,
                             compression: float | None = None, local_folder: Path | None = None) -> list[str]:
    """What `convert` would refuse in these options for this source (from its config, and its files when it is a
    local folder): a query rank it cannot take, a RoPE the target's engine computes wrongly, calibration windows past
    its positions, a local calibration text that is missing or unreadable, or one the folder has no tokenizer for.  (A hub id is resolved to its config
    alone, so its tokenizer files are not there to check.)"""
    from ..convert.preflight import (
        calibration_length_problems,
        calibration_problems,
        local_text_problems,
        target_rope_problems,
    )
    from ..errors import MLAConvertError, PreflightError
    from ..source.shapes import shape_problems

    problems = calibration_length_problems(source, options.calibration) + target_rope_problems(source, options.target)
    if options.calibration.data is not None and local_folder is not None:
        problems += calibration_problems(local_folder, options.calibration)
    elif options.calibration.data is not None:
        problems += local_text_problems(options.calibration.data, options.calibration.text_column)
    if options.q_lora_rank is not None:
        try:
            mla = pick_target_shape(source, options.target, kv_lora_rank, rope_dim, compression, options.q_lora_rank)
            problems += shape_problems(source, mla.kv_lora_rank, mla.rope_dim, mla.q_lora_rank)
        except PreflightError as error:
            problems += error.problems
        except MLAConvertError as error:
            problems.append(str(error))
    return problems


def changed_flags(options, defaults) -> list[str]:
    """Flags of the option fields whose values differ from `defaults` (nested dataclasses included)."""
    import dataclasses

    flags = []
    for spec in dataclasses.fields(options):
        value, default = getattr(options, spec.name), getattr(defaults, spec.name)
        if dataclasses.is_dataclass(value):
            flags += changed_flags(value, default)
        elif value != default:
            flags.append(spec.metadata.get("flag") or "--" + spec.name.replace("_", "-"))
    return flags
