"""`sweep`: one source model converted at several KV-cache ratios, each scored on one text, as a table and a plot.

Why a sweep is its own function rather than a loop over `convert` + `eval`:

* Calibration (sampling or reading text, then the layer-streamed statistics pass) does not depend on the
  target shape, and it is the slow part of a conversion.  One `Converter` calibrates once and every
  (ratio, method) export reuses those statistics; each point records which statistics it used, so the
  result itself shows that there was one calibration pass.
* Every model, the source included, is scored on the same token windows (one tokenization, the project
  protocol of `perplexity.evaluate_perplexity`: non-overlapping windows, token-weighted NLL), so the
  perplexities are directly comparable.
* Converted folders are only a means to a number: they live in a temporary folder and each is deleted
  as soon as it has been scored, unless the caller keeps them.

The result is written as markdown (for READMEs and BENCHMARKS.md), CSV (for spreadsheets), JSON (every
number, for scripts) and a PNG of perplexity against KV-cache bytes per token, the trade-off a user picks
a ratio from.  The files are rewritten after every point, so an interrupted sweep keeps what it measured.
"""

from __future__ import annotations

import csv
import dataclasses
import gc
import io
import json
import math
import numbers
import os
import re
import shlex
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..convert.decisions import METHOD_ALIASES, METHOD_NAMES, ForwardingProgress, Progress
from ..convert.pipeline import Converter
from ..convert.preflight import estimated_statistics_bytes
from ..convert.target import TARGETS, target_of
from ..data.textdata import TokenizedText, load_text, looks_like_path, tokenize_with_offsets
from ..devices import device_problems, resolve_device
from ..errors import MLAConvertError, PreflightError
from ..io.paths import absolute_path, portable_path, real_path
from ..io.resolve import needs_download
from ..io.writer import STATS_SCRATCH_PREFIX, SWEEP_SCRATCH_PREFIX, ScratchFolder, clean_stale_scratch_folders
from ..options import CalibrationOptions, ConvertOptions, argument_problems, evaluation_number_arguments, optional_argument, path_argument
from ..source.shapes import pick_target_shape
from ..units import dtype_bytes, human_bytes, parse_dtype
from .checks import DEFAULT_CONTEXT, dtype_problems, text_option_problems
from .perplexity import PerplexityResult, evaluate_perplexity, load_model_for_eval, load_tokenizer_for_eval, plan_windows

DEFAULT_METHODS = ("activation-aware", "svd")
SOURCE = "source"
# What a reader sees for each factorization method (keys: the converter's internal method names).
METHOD_LABELS = {"output": "activation-aware", "input": "input-whitened", "weight": "weight-only SVD"}
# Plot styling per method: colour and marker stay the same across every sweep plot of the project.
METHOD_STYLES = {
    "output": {"color": "tab:blue", "marker": "o"},
    "weight": {"color": "tab:orange", "marker": "s"},
    "input": {"color": "tab:green", "marker": "^"},
}
PLOT_SIZE_INCHES = (9.0, 5.6)
PLOT_DPI = 110


class SweepError(MLAConvertError):
    """Bad sweep settings (ratios, methods, output folder)."""


# --------------------------------------------------------------------------- settings
def parse_ratios(text: str | Iterable[float]) -> list[float]:
    """`"2,4,8"` (or numbers) -> sorted distinct ratios, each at least 1 (a user error otherwise)."""
    if isinstance(text, str):
        parts = [part.strip() for part in text.replace(" ", ",").split(",") if part.strip()]
        ratios = []
        for part in parts:
            try:
                ratio = float(part.rstrip("xX"))
            except ValueError:
                raise SweepError(f"--ratios {text!r}: {part!r} is not a number; write e.g. 2,4,8") from None
            if not math.isfinite(ratio):  # nan, inf, or 1e309 (which the range check echoed as "inf")
                raise SweepError(f"--ratios {text!r}: {part!r} is not a finite number; write e.g. 2,4,8")
            ratios.append(ratio)
    else:
        ratios = _numbers(text)
    if not ratios:
        raise SweepError("--ratios: give at least one KV-cache ratio, e.g. 2,4,8")
    bad = [r for r in ratios if not (math.isfinite(r) and r >= 1)]
    if bad:
        raise SweepError(f"--ratios: {', '.join(f'{r:g}' for r in bad)}: each ratio must be at least 1 (how many times smaller the cache gets)")
    return sorted(set(ratios))


def _numbers(ratios: Iterable[float] | float) -> list[float]:
    """Ratios given as numbers (the Python API): a list of them, or one (`run_sweep(source, 2, ...)`); anything else is
    refused naming the parameter (it was a TypeError "'int' object is not iterable", or float's ValueError)."""
    if isinstance(ratios, numbers.Real) and not isinstance(ratios, bool):  # (numpy's numbers too)
        return [float(ratios)]
    try:
        items = list(ratios)
    except TypeError:
        raise SweepError(f"--ratios {ratios!r}: give numbers, e.g. [2, 4, 8] or '2,4,8'") from None
    bad = [item for item in items if isinstance(item, bool) or not isinstance(item, (numbers.Real, str))
           or isinstance(item, str) and not _is_number(item)]
    if bad:
        raise SweepError(f"--ratios {ratios!r}: {bad[0]!r} is not a number; give numbers, e.g. [2, 4, 8] or '2,4,8'")
    return [float(item) for item in items]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def canonical_methods(methods: str | Iterable[str]) -> list[str]:
    """Method names (aliases allowed, e.g. `svd` = `weight`) -> the converter's names, order kept, duplicates dropped."""
    if isinstance(methods, str):
        methods = [m.strip() for m in methods.split(",") if m.strip()]
    elif not isinstance(methods, Iterable):
        raise SweepError(f"--methods {methods!r}: give method names, e.g. ['activation-aware', 'svd']")
    out: list[str] = []
    for name in methods:
        if not isinstance(name, str) or name not in METHOD_ALIASES:
            raise SweepError(f"--methods: {name!r} is not a method; choose from activation-aware, input, svd")
        if METHOD_ALIASES[name] not in out:
            out.append(METHOD_ALIASES[name])
    if not out:
        raise SweepError("--methods: give at least one method (activation-aware, input, svd)")
    return out


def format_ratio(ratio: float) -> str:
    return f"{ratio:g}x"


# --------------------------------------------------------------------------- results
@dataclass(frozen=True)
class SweepPoint:
    """One evaluated model: the source, or one (ratio, method) conversion of it."""

    method: str  # "source", or the converter's method name: output / input / weight
    requested_ratio: float | None  # None for the source
    kv_lora_rank: int | None  # None for the source
    rope_dim: int | None
    values_per_token_layer: int  # cached numbers per token per layer
    result: PerplexityResult | None  # None when the conversion or evaluation failed (see `error`)
    error: str | None = None
    convert_seconds: float | None = None
    eval_seconds: float | None = None
    mean_attention_error: float | None = None  # conversion's own proxy (relative attention output error)
    calibration_id: str | None = None  # the statistics the conversion used; one id per calibration pass
    model_path: str | None = None  # kept converted folder (None: deleted after evaluation)
    export_dtype: str | None = None  # dtype the conversion was written (and so evaluated) in
    # the ratio whose conversion had this very shape (a serving target rounds ratios to its shapes): that
    # conversion's numbers, not converted and evaluated again
    same_shape_as: float | None = None
    # dtype the model was scored in, which its cache is counted in (None: the sweep's cache_dtype); the source is
    # scored in its own dtype, so under `--dtype bf16` its row counted a bf16 cache it was never measured with
    measured_dtype: str | None = None

    @property
    def is_source(self) -> bool:
        return self.method == SOURCE

    @property
    def label(self) -> str:
        if self.is_source:
            return SOURCE
        return f"{METHOD_LABELS.get(self.method, self.method)} {format_ratio(self.requested_ratio)}"

    @property
    def method_label(self) -> str:
        return SOURCE if self.is_source else METHOD_LABELS.get(self.method, self.method)

    @property
    def perplexity(self) -> float:
        return math.nan if self.result is None else self.result.perplexity

    @property
    def ok(self) -> bool:
        return self.result is not None and math.isfinite(self.result.perplexity)


@dataclass
class SweepResult:
    """Every point of a sweep plus what is needed to read it (model, data, protocol, cache dtype)."""

    model_name: str
    source: str
    data: str
    num_layers: int
    attention_kind: str  # MHA / GQA / MQA of the source
    cache_dtype: str  # dtype the models were exported and evaluated in; bytes are counted in it
    context_length: int
    max_windows: int | None
    source_point: SweepPoint
    points: list[SweepPoint] = field(default_factory=list)
    calibration: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    files: SweepFiles | None = None  # where `save` last wrote the table, CSV, JSON and plot

    # ---- cache arithmetic
    def cache_dtype_of(self, point: SweepPoint) -> str:
        """The dtype a point's cache is counted in: the one it was scored in."""
        return point.measured_dtype or self.cache_dtype

    def bytes_per_value(self, point: SweepPoint) -> int:
        return dtype_bytes(parse_dtype(self.cache_dtype_of(point)))

    def values_per_token(self, point: SweepPoint) -> int:
        """Cached numbers per token over all layers."""
        return point.values_per_token_layer * self.num_layers

    def bytes_per_token(self, point: SweepPoint) -> int:
        return self.values_per_token(point) * self.bytes_per_value(point)

    def actual_ratio(self, point: SweepPoint) -> float:
        """How many times smaller this point's cache is than the source's (exact, from the shapes)."""
        return self.source_point.values_per_token_layer / point.values_per_token_layer

    def perplexity_ratio(self, point: SweepPoint) -> float:
        return point.perplexity / self.source_point.perplexity

    @property
    def calibration_passes(self) -> int:
        """Distinct calibration statistics the conversions used (1 when the calibration was reused); 1 when calibration
        ran but no conversion finished (an interrupted sweep's files said "0 passes")."""
        used = len({p.calibration_id for p in self.points if p.calibration_id is not None})
        return max(used, 1 if self.calibration else 0)

    @property
    def conversions(self) -> int:
        """Models converted (a ratio that got an earlier ratio's shape reuses that model)."""
        return sum(p.same_shape_as is None for p in self.points)

    @property
    def methods(self) -> list[str]:
        return list(dict.fromkeys(p.method for p in self.points))

    @property
    def num_windows(self) -> int | None:
        return None if self.source_point.result is None else self.source_point.result.num_windows

    def all_points(self) -> list[SweepPoint]:
        """Source first, then the conversions by ratio (small compression first) and method."""
        order = {m: i for i, m in enumerate(self.methods)}
        return [self.source_point] + sorted(self.points, key=lambda p: (p.requested_ratio, order[p.method]))

    # ---- table rows
    def rows(self) -> list[dict]:
        """One dict per model (source first): the numbers of the CSV, unformatted."""
        rows = []
        for point in self.all_points():
            result = point.result
            rows.append({
                "model": point.label,
                "method": point.method_label,
                "requested_ratio": point.requested_ratio,
                "kv_lora_rank": point.kv_lora_rank,
                "rope_dim": point.rope_dim,
                "values_per_token_layer": point.values_per_token_layer,
                "values_per_token": self.values_per_token(point),
                "bytes_per_token": self.bytes_per_token(point),
                "cache_dtype": self.cache_dtype_of(point),
                "actual_ratio": self.actual_ratio(point),
                "perplexity": point.perplexity,
                "perplexity_ratio": self.perplexity_ratio(point),
                "bits_per_byte": None if result is None else result.bits_per_byte,
                "mean_nll": None if result is None else result.mean_nll,
                "scored_tokens": None if result is None else result.num_scored_tokens,
                "windows": None if result is None else result.num_windows,
                "context_length": self.context_length,
                "mean_attention_error": point.mean_attention_error,
                "convert_seconds": point.convert_seconds,
                "eval_seconds": point.eval_seconds,
                "error": point.error,
                "model_path": point.model_path,
                "same_shape_as": point.same_shape_as,
            })
        return rows

    def markdown(self) -> str:
        """A markdown table: one row per model, source first."""
        header = ["model", "shape (rank + rope)", "KV cache / token", "ratio", "perplexity", "vs source",
                  "bits/byte", "attn. error", "convert s", "eval s"]
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|"]
        for point in self.all_points():
            shape = f"{self.attention_kind} K+V" if point.is_source else f"{point.kv_lora_rank} + {point.rope_dim}"
            result = point.result
            lines.append("| " + " | ".join([
                f"**{point.label}**" if point.is_source else point.label
                + ("" if point.same_shape_as is None else f" (the {format_ratio(point.same_shape_as)} model)"),
                shape,
                f"{human_bytes(self.bytes_per_token(point))} ({self.values_per_token(point)} values)",
                f"{self.actual_ratio(point):.2f}x",
                f"{point.perplexity:.3f}" if point.ok else f"failed: {point.error}",
                f"{self.perplexity_ratio(point):.3f}" if point.ok else "-",
                "-" if result is None or result.bits_per_byte is None else f"{result.bits_per_byte:.4f}",
                "-" if point.mean_attention_error is None else f"{point.mean_attention_error:.3f}",
                _seconds(point.convert_seconds),
                _seconds(point.eval_seconds),
            ]) + " |")
        return "\n".join(lines)

    def _dtypes_by_role(self) -> str | None:
        """"source X, conversions Y" when the source was scored in another dtype than the conversions, else None."""
        source = self.cache_dtype_of(self.source_point)
        others = list(dict.fromkeys(self.cache_dtype_of(p) for p in self.points)) or [source]
        return None if others == [source] else f"source {source}, conversions {', '.join(others)}"

    def dtypes_text(self) -> str:
        """The dtype the caches are counted in, or each model's when the source was scored in another."""
        by_role = self._dtypes_by_role()
        return self.cache_dtype_of(self.source_point) if by_role is None else \
            f"the dtype each model was scored in ({by_role})"

    def window_counts(self) -> tuple[int, int]:
        """(windows of the full context, tokens of a last shorter window or 0): the text's end cuts the last one."""
        return divmod(self.source_point.result.num_tokens, self.context_length)

    def describe_protocol(self) -> str:
        """Two or three sentences saying how the numbers were measured (for the markdown files)."""
        source = self.source_point.result
        # a local text is named by its file name (its path is this machine's, or written portably as $TMPDIR/...)
        local = Path(self.data).exists() or self.data.startswith("$TMPDIR/") or looks_like_path(self.data)
        data = Path(self.data).name if local else self.data
        full, rest = self.window_counts()
        if full + bool(rest) == 1:
            windows = f"1 window of {full * self.context_length + rest} tokens"
        else:
            windows = (f"{full} non-overlapping window{'s' if full != 1 else ''} of {self.context_length} tokens"
                       + (f" and 1 of {rest}" if rest else ""))
        text = (f"Perplexity on `{data}`: {windows} "
                f"({source.num_scored_tokens} scored tokens), token-weighted NLL. KV cache counted in {self.dtypes_text()} "
                f"over all {self.num_layers} layers.")
        if self.calibration:
            passes = self.calibration_passes
            description = self.calibration.get("description", "n/a")
            calib_data = self.settings.get("convert_options", {}).get("calibration", {}).get("data")
            if calib_data and os.sep in str(calib_data):  # a local file: its name says enough, the path is this machine's
                description = description.replace(str(calib_data), f"`{Path(calib_data).name}`")
            shared = (f" shared by {self.conversions} conversion{'s' if self.conversions != 1 else ''}" if self.conversions
                      else ", no conversion finished")
            text += (f" Calibration: {description}, {self.calibration.get('seconds', '?')} s, "
                     f"{passes} pass{'es' if passes != 1 else ''}{shared}.")
        # why a ratio got another cache ratio: a serving target's few shapes, else whole cached values per token and
        # layer (it said "the serving target's shapes" under --target transformers too)
        target = self.settings.get("convert_options", {}).get("target", "transformers")
        serving = target_of(target).serving if target in TARGETS else False
        why = f"--target {target} serves only a few shapes" if serving else "the cache holds whole values per token and layer"
        repeated = [p for p in self.points if p.same_shape_as is not None]
        if repeated:
            text += (f" {len(repeated)} requested ratio{'s' if len(repeated) != 1 else ''} got the shape of a smaller one "
                     f"({why}): shown with that model's numbers, not converted again.")
        rounded = {format_ratio(p.requested_ratio): f"{self.actual_ratio(p):.2f}x" for p in self.all_points()[1:]
                   if f"{self.actual_ratio(p):.2f}" != f"{p.requested_ratio:.2f}"}
        if rounded:
            how = f"as closely as --target {target}'s shapes allow" if serving else "in whole cached values per token and layer"
            text += f" Ratios met {how}: " + ", ".join(f"{asked} got {got}" for asked, got in rounded.items()) + "."
        return text

    def csv_text(self, out_dir: str | os.PathLike | None = None) -> str:
        """The rows as CSV; paths written portably as in the JSON (the CSV kept this machine's absolute model_path),
        a kept model's relative to `out_dir` (the folder the CSV is written in) when it lies below it."""
        rows = [{**row, "model_path": _written_model_path(row["model_path"], out_dir)} for row in self.rows()]
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else _portable_paths(v) if isinstance(v, str) else v for k, v in row.items()})
        return buffer.getvalue()

    def to_dict(self, out_dir: str | os.PathLike | None = None) -> dict:
        """Everything, to rebuild the result; a kept model's path relative to `out_dir` when it lies below it."""
        return {
            "model": self.model_name,
            "source": self.source,
            "data": self.data,
            "num_layers": self.num_layers,
            "attention_kind": self.attention_kind,
            "cache_dtype": self.cache_dtype,
            "context_length": self.context_length,
            "max_windows": self.max_windows,
            "calibration": {**self.calibration, "passes": self.calibration_passes},
            "settings": self.settings,
            "rows": [{**row, "model_path": _written_model_path(row["model_path"], out_dir)} for row in self.rows()],
            "points": [{**_point_to_dict(p), "model_path": _written_model_path(p.model_path, out_dir)}
                       for p in self.all_points()],
        }

    @classmethod
    def from_dict(cls, data: dict) -> SweepResult:
        """Rebuild a result from `to_dict` output (e.g. to redraw the plot without rerunning the sweep)."""
        points = [_point_from_dict(p) for p in data["points"]]
        source = next(p for p in points if p.is_source)
        calibration = {k: v for k, v in data.get("calibration", {}).items() if k != "passes"}
        return cls(data["model"], data["source"], data["data"], data["num_layers"], data["attention_kind"],
                   data["cache_dtype"], data["context_length"], data.get("max_windows"), source,
                   [p for p in points if not p.is_source], calibration, data.get("settings", {}))

    def plot(self, path: str | os.PathLike, title: str | None = None) -> Path:
        return plot_sweep(self, path, title)

    def save(self, out_dir: str | os.PathLike, stem: str = "sweep", title: str | None = None) -> SweepFiles:
        """Write `<stem>.md`, `.csv`, `.json` and `.png` into `out_dir` (created if needed)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        files = SweepFiles.at(out, stem)
        _write_atomic(files.markdown, f"# KV-cache sweep: {self.model_name}\n\n{self.describe_protocol()}\n\n{self.markdown()}\n")
        _write_atomic(files.csv, self.csv_text(out))
        _write_atomic(files.json, json.dumps(_json_safe(self.to_dict(out)), indent=2, default=str, allow_nan=False) + "\n")
        if self.source_point.ok:
            self.plot(files.png, title)
        self.files = files
        return files


_RESULT_FIELDS = [f.name for f in dataclasses.fields(PerplexityResult)]


def _point_to_dict(point: SweepPoint) -> dict:
    data = {f.name: getattr(point, f.name) for f in dataclasses.fields(SweepPoint)}
    data["result"] = None if point.result is None else point.result.to_dict()  # with perplexity, bits/byte, ...
    return data


def _point_from_dict(data: dict) -> SweepPoint:
    result = data.get("result")
    if result is not None:
        result = PerplexityResult(**{k: result[k] for k in _RESULT_FIELDS})
    return SweepPoint(**{**data, "result": result})


def _json_safe(value):
    """NaN/inf (a failed point's perplexity) as null: strict JSON readers refuse NaN; this machine's paths
    as `~/...` or `../...` (relative to the working directory's parent), so committed files hold no
    absolute paths of the machine that ran the sweep."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, str):
        return _portable_paths(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _portable_paths(text: str) -> str:
    """This machine's paths written portably: `$TMPDIR/...` only for mla-convert's own scratch folders in the temp
    folder (anything else under it, e.g. an --out-dir in /tmp, was written as `$TMPDIR/probe/...`, a path no reader
    could find again), then `../...` (relative to the working directory's parent) and `~/...`."""
    temp = tempfile.gettempdir()
    if len(temp) > 1:
        scratch = "|".join(re.escape(prefix) for prefix in (SWEEP_SCRATCH_PREFIX, STATS_SCRATCH_PREFIX))
        text = re.sub(re.escape(temp) + rf"(?=/(?:{scratch}))", "$TMPDIR", text)
    for prefix, alias in ((str(Path.cwd().parent), ".."), (str(Path.home()), "~")):
        if len(prefix) > 1:
            text = re.sub(re.escape(prefix) + r"(?=/)", alias, text)
    return text


def _written_model_path(path: str | None, out_dir: str | os.PathLike | None) -> str | None:
    """A kept model's path as the files write it: relative to the folder they are in (`models/svd-2x`) when it lies
    below it, else as it is."""
    if path is None or out_dir is None or not os.path.isabs(path):
        return path
    out = os.path.abspath(out_dir)
    if os.path.commonpath([out, os.path.abspath(path)]) != out:
        return path
    return os.path.relpath(path, out)


def load_sweep(path: str | os.PathLike) -> SweepResult:
    """A sweep from the JSON file `SweepResult.save` wrote (a kept model's relative path is relative to its folder)."""
    result = SweepResult.from_dict(json.loads(Path(path).read_text()))
    folder = absolute_path(path).parent
    result.points = [dataclasses.replace(point, model_path=str(folder / point.model_path))
                     if point.model_path is not None and not point.model_path.startswith(("$", "~", ".."))
                     and not os.path.isabs(point.model_path) else point for point in result.points]
    return result


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


@dataclass(frozen=True)
class SweepFiles:
    markdown: Path
    csv: Path
    json: Path
    png: Path

    @classmethod
    def at(cls, out: Path, stem: str = "sweep") -> SweepFiles:
        """The files a sweep writes into its output folder (`SweepResult.save`)."""
        return cls(*(Path(out) / f"{stem}.{ext}" for ext in ("md", "csv", "json", "png")))

    def paths(self) -> tuple[Path, ...]:
        return (self.markdown, self.csv, self.json, self.png)


def _write_atomic(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


# --------------------------------------------------------------------------- plot
def _use_log_y(values: Sequence[float]) -> bool:
    """Log y once the perplexities span more than a factor 2: then a linear axis squashes the good points."""
    finite = [v for v in values if math.isfinite(v) and v > 0]
    return len(finite) >= 2 and max(finite) / min(finite) > 2.0


def _plain_number(value: float, _position=None) -> str:
    if value <= 0:
        return ""
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


def _label_offset(result: SweepResult, point: SweepPoint) -> tuple[float, float]:
    """Where a point's perplexity label goes: above for the worst method at that size, below for the best.

    Points of different methods share an x (the same ratio), so labels placed the same way collide.
    """
    same_size = sorted(p.perplexity for p in result.points if p.ok and p.requested_ratio == point.requested_ratio)
    if len(same_size) < 2:
        return (8, 0)
    if point.perplexity == same_size[-1]:
        return (6, 9)
    if point.perplexity == same_size[0]:
        return (6, -10)
    return (9, 0)


def plot_title(result: SweepResult) -> str:
    """The plot's default title: model, text and its windows (the context, or the text's length when it is shorter)."""
    full, rest = result.window_counts()  # as sweep.md counts them
    if not full:
        windows = f"1 x {rest}-token window"
    else:
        windows = (f"{full} x {result.context_length}-token window{'s' if full != 1 else ''}"
                   + (f" and 1 of {rest} tokens" if rest else ""))  # it said "31 x 512" of 30 and one of 177
    return f"{result.model_name}: perplexity vs KV-cache size\n{Path(result.data).name}, {windows}"


def top_axis_label(result: SweepResult) -> str:
    """The plot's top axis: byte ratios to the source.  Scored in different dtypes, a byte ratio is not the value
    ratio the table gives (a bf16 2x point beside an fp32 source sits at 4x), and the label says so."""
    measured = [result.source_point] + [p for p in result.points if p.ok]
    if len({result.cache_dtype_of(p) for p in measured}) > 1:
        return "KV-cache bytes vs the source's (dtypes differ; the table's ratios count values)"
    return "KV-cache compression vs the source"


def plot_sweep(result: SweepResult, path: str | os.PathLike, title: str | None = None,
               size_inches: tuple[float, float] = PLOT_SIZE_INCHES, dpi: int = PLOT_DPI) -> Path:
    """Perplexity against KV-cache bytes per token: one curve per method, the source as a dashed line.

    The x axis is logarithmic (ratios double from point to point), ticks sit at the measured cache sizes
    and the top axis names their compression ratios; y is logarithmic when perplexities span more than a
    factor 2 (weight-only SVD at high ratios otherwise flattens every other point).  Drawn on a bare
    `Figure` (no pyplot state), so it is safe inside a library and in tests; the image is exactly
    `size_inches * dpi` pixels.
    """
    from matplotlib import ticker
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size_inches, dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    source = result.source_point
    source_bytes = result.bytes_per_token(source)
    source_ppl = source.perplexity

    ax.axhline(source_ppl, color="black", linestyle="--", linewidth=1.3, zorder=1,
               label=f"source {result.attention_kind} ({human_bytes(source_bytes)}/token): {source_ppl:.3f}")
    ax.plot([source_bytes], [source_ppl], marker="*", markersize=13, color="black", linestyle="none", zorder=3)
    ax.annotate(f"source {source_ppl:.2f}", (source_bytes, source_ppl), textcoords="offset points", xytext=(-10, 9),
                ha="right", fontsize=8.5, bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.85})

    plotted: list[float] = [source_ppl]
    for method in result.methods:
        points = sorted((p for p in result.points if p.method == method and p.ok), key=result.bytes_per_token)
        failed = [p for p in result.points if p.method == method and not p.ok]
        style = METHOD_STYLES.get(method, {"color": None, "marker": "D"})
        label = METHOD_LABELS.get(method, method)
        if failed:
            label += f" (failed at {', '.join(format_ratio(p.requested_ratio) for p in failed)})"
        if not points:
            ax.plot([], [], label=label, **style)
            continue
        xs = [result.bytes_per_token(p) for p in points]
        ys = [p.perplexity for p in points]
        plotted += ys
        ax.plot(xs, ys, linewidth=2, markersize=7, label=label, zorder=2, **style)
        for p, x, y in zip(points, xs, ys):
            ax.annotate(f"{y:.2f}" if y < 100 else f"{y:.0f}", (x, y), textcoords="offset points",
                        xytext=_label_offset(result, p), fontsize=8.5, color=style["color"], ha="left", va="center",
                        bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.85})

    # x: bytes per token, log2 (the ratios double), ticks at the measured sizes, smaller cache on the left
    sizes = sorted({result.bytes_per_token(p) for p in [source] + [p for p in result.points if p.ok]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([human_bytes(s) for s in sizes])
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax.set_xlim(sizes[0] / 1.35, sizes[-1] * 1.35)
    ax.margins(y=0.08)
    dtypes = result._dtypes_by_role() or result.cache_dtype_of(source)
    ax.set_xlabel(f"KV cache per token, all {result.num_layers} layers ({dtypes}; log scale)")
    top = ax.secondary_xaxis("top", functions=(lambda x: x, lambda x: x))
    top.set_xticks(sizes)
    top.set_xticklabels([format_ratio(round(source_bytes / s, 2)) for s in sizes])
    top.xaxis.set_minor_locator(ticker.NullLocator())
    top.set_xlabel(top_axis_label(result))

    if _use_log_y(plotted):
        ax.set_yscale("log")
        span = max(plotted) / min(plotted)
        # a log axis labels only powers of ten; with a few decades, 1-2-5 steps are what a reader wants
        if span < 1000:
            ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_minor_locator(ticker.LogLocator(base=10, subs=(1.5, 3.0, 4.0, 6.0, 7.0, 8.0, 9.0)))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(_plain_number))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_ylabel("perplexity (log scale, lower is better)")
    else:
        ax.set_ylabel("perplexity (lower is better)")
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", axis="y", alpha=0.15)

    ax.set_title(plot_title(result) if title is None else title, fontsize=12)
    # below the axes: inside, it would sooner or later sit on a point (bad SVD points reach any corner)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize=9.5, frameon=False)
    out = Path(path)
    partial = out.with_name(out.name + ".partial.png")
    fig.savefig(partial, dpi=dpi, format="png")
    partial.replace(out)
    return out


# --------------------------------------------------------------------------- running a sweep
def _evaluate(model_path: Path, tokenized: TokenizedText, context_length: int, max_windows: int | None,
              device: str | None, dtype: str, batch_size: int, progress: Progress,
              label: str, allow_pickle: bool = False) -> tuple[PerplexityResult, float, str]:
    """Load one model, score it on the shared windows (progress per forward pass), free it; also the dtype it was
    scored in (its cache's).  `allow_pickle`: --allow-pickle, for the source (the conversions are safetensors)."""
    started = time.time()
    model = _load_quietly(model_path, device, dtype, allow_pickle)
    scored_in = str(next(model.parameters()).dtype).replace("torch.", "")
    total = len(plan_windows(len(tokenized), context_length, None, max_windows))
    progress.phase(f"perplexity: {label}", total)
    done = [0]

    def count_windows(module, args, kwargs, output):
        done[0] += int(kwargs["input_ids"].shape[0])
        progress.advance(done[0], total)

    hook = model.register_forward_hook(count_windows, with_kwargs=True)
    try:
        result = evaluate_perplexity(model, tokenized, context_length=context_length, max_windows=max_windows,
                                     batch_size=batch_size, progress=False, desc=label)
    finally:
        hook.remove()
        del model
        gc.collect()
    progress.end()  # only when scored: a phase cut off by Ctrl-C is not "done" (the CLI logs it as interrupted)
    return result, time.time() - started, scored_in


def _load_quietly(model_path: Path, device: str | None, dtype: str, allow_pickle: bool = False):
    """`load_model_for_eval` without transformers' per-load progress bar (a sweep loads many models)."""
    from ..io.hf_loading import without_load_progress_bars

    with without_load_progress_bars():
        return load_model_for_eval(model_path, device, dtype, allow_pickle=allow_pickle)[0]


def _model_name(source: str | os.PathLike) -> str:
    path = Path(str(source))
    return path.name if path.name else str(source)


def run_sweep(
    source: str | os.PathLike,
    ratios: str | Iterable[float],
    data: str | os.PathLike,
    out_dir: str | os.PathLike | None = None,
    *,
    context_length: int | None = None,
    max_windows: int | None = None,
    methods: str | Iterable[str] = DEFAULT_METHODS,
    calibration: CalibrationOptions | None = None,
    options: ConvertOptions | None = None,
    keep_models: bool = False,
    models_dir: str | os.PathLike | None = None,
    eval_device: str | None = None,
    eval_dtype: str = "auto",
    batch_size: int = 1,
    text_column: str = "text",
    model_name: str | None = None,
    stem: str = "sweep",
    progress: Progress | None = None,
    overwrite: bool = False,
    caller_problems: Sequence[str] = (),
) -> SweepResult:
    """Convert `source` at every ratio with every method (one calibration), score all on `data`, write files.

    `context_length` None: 1024 tokens, or the source's max_position_embeddings when shorter (as `eval`).
    `eval_device`: where every model is scored (None: cuda when there is one); sweep.json records the device used.
    `options` carries everything else a conversion takes (dtype, device, sequential, refine steps, ...);
    its compression, ranks, method and output settings are set per point.  `calibration` replaces
    `options.calibration`.  Converted folders are written under `models_dir` (default: the system temp
    folder) and deleted after scoring; with `keep_models` they are kept as `<out_dir>/models/<method>-<ratio>x`
    (or under `models_dir` when there is no `out_dir`).  With `out_dir`, the table, CSV, JSON and plot
    (`<stem>.md/.csv/.json/.png`) are rewritten after every point.  A point whose conversion or
    evaluation fails (e.g. non-finite weights) is recorded with its error and the sweep goes on.
    An `out_dir` that holds an earlier sweep's `<stem>.*` files is refused unless `overwrite` (as `convert` refuses an
    existing output): they were silently replaced, and a sweep of fewer ratios lost the earlier rows.  With
    `overwrite` the models the replaced sweep kept in `<out_dir>/models` go too (those mla-convert wrote, when the
    calibration is done): the folder holds only the models this sweep lists.
    Every problem with the settings, the source (a local one: a hub id is not downloaded to check it) and each
    planned export is raised together in one PreflightError, with `caller_problems` (the CLI's refused flags).
    """
    progress = progress or Progress()
    problems = list(caller_problems)
    wrong_types = _wrong_argument_types(source, data, out_dir, models_dir, options, calibration, stem,
                                        context_length=context_length, max_windows=max_windows, batch_size=batch_size)
    if wrong_types:  # the checks below could not even compare them
        raise PreflightError(problems + wrong_types)
    problems += _stem_problems(stem)
    try:
        ratios = parse_ratios(ratios)
    except SweepError as error:
        ratios, problems = [], problems + [str(error)]
    try:
        methods = canonical_methods(methods)
    except SweepError as error:
        methods, problems = [], problems + [str(error)]
    base = dataclasses.replace(options or ConvertOptions(), kv_lora_rank=None, rope_dim=None, overwrite=False)
    if calibration is not None:
        base = dataclasses.replace(base, calibration=calibration)
    problems += [f"{flag} {value}: must be at least {low}" for flag, value, low in
                 (("--batch-size", batch_size, 1), ("--context", context_length, 2), ("--max-windows", max_windows, 1))
                 if value is not None and value < low]
    # every point is a converted model (fp16 underflows its latent unless a serving --target rewrote it); the device
    # must exist before the slow calibration
    # (a misspelled --target is refused by each export's pre-flight, below; here it only must not raise a KeyError)
    serving = base.target in TARGETS and target_of(base.target).serving
    problems += dtype_problems(eval_dtype, [], flag="eval_dtype", converted=not serving)
    problems += device_problems(eval_device)
    problems += text_option_problems(data, text_column)
    out = None if out_dir is None else absolute_path(out_dir)  # a quoted `~/sweep` means the home folder
    if out is not None:
        if out.is_symlink():
            problems.append(f"--out-dir {out}: is a symlink; give a real folder (or a new path)")
        elif out.exists() and not out.is_dir():
            problems.append(f"--out-dir {out}: exists and is not a folder")
        elif not out.exists() and not out.parent.is_dir():
            problems.append(f"--out-dir {out}: its parent {out.parent} is not a folder")
        source_folder = absolute_path(source) if isinstance(source, (str, os.PathLike)) else None
        if source_folder is not None and source_folder.is_dir() and real_path(out).is_relative_to(real_path(source_folder)):
            problems.append(f"--out-dir {out}: is the source folder {source} or inside it; the sweep would write its "
                            "table, plot and kept models among the model's files; choose a folder outside it")
        earlier_files = [path.name for path in SweepFiles.at(out, stem).paths() if path.exists() or path.is_symlink()]
        if earlier_files and not overwrite:
            problems.append(f"--out-dir {out}: holds an earlier sweep's results ({', '.join(earlier_files)}); give --overwrite "
                            "to replace them, or choose another --out-dir")
    if models_dir is not None and not Path(models_dir).is_dir():
        problems.append(f"--models-dir {models_dir}: no such folder")
    if keep_models and out is None and models_dir is None:
        problems.append("--keep-models: say where to keep them (an output folder or a models folder)")
    if problems and needs_download(source):
        raise PreflightError(problems)  # checking a hub source means downloading it first

    keep_root = None  # (kept with no place to keep them: among the problems, raised with the source's below)
    if keep_models and (out is not None or models_dir is not None):
        keep_root = (out / "models") if out is not None else Path(models_dir)
    # (a --models-dir that is not a folder is among the problems: the source is still checked, in the temp folder)
    # converted models stay here until scored; a SIGKILLed sweep's folder (whole models, maybe) is removed by the next run
    scratch = ScratchFolder(SWEEP_SCRATCH_PREFIX, models_dir if models_dir is not None and Path(models_dir).is_dir() else None)
    try:
        try:
            converter = Converter(source, base, _NotesOnce(progress))
        except MLAConvertError as error:  # reported with the settings' problems
            raise PreflightError(problems + (error.problems if isinstance(error, PreflightError) else [str(error)])) from error
        with converter:
            max_positions = converter.config.max_position_embeddings
            if context_length is None:
                context_length = min(DEFAULT_CONTEXT, max_positions)
            elif context_length > max_positions:
                problems.append(f"--context {context_length}: longer than the model's max_position_embeddings ({max_positions})")
            # everything that can fail cheaply fails before the slow calibration and evaluations
            # (kept models' folder does not exist yet: its exports are checked in the scratch folder)
            problems += _preflight_all(converter, base, ratios, methods,
                                       keep_root if keep_root and keep_root.exists() else scratch.path)
            if problems:
                raise PreflightError(list(dict.fromkeys(problems)))
            _clean_stale_scratch(scratch.path.parent, progress)
            if base.calibration.data is not None:
                load_text(base.calibration.data, text_column=base.calibration.text_column, max_chars=1000)
            progress.phase("reading and tokenizing the evaluation text")
            tokenizer = load_tokenizer_for_eval(converter.source_path)
            tokenized = tokenize_with_offsets(tokenizer, load_text(data, text_column=text_column))
            if len(tokenized) < context_length:  # every number would say "windows of 256 tokens" about a 12-token one
                progress.message(f"note: the evaluation text has {len(tokenized)} tokens, fewer than the context "
                                 f"{context_length}: one window of {len(tokenized)} tokens")
                context_length = len(tokenized)
            windows = plan_windows(len(tokenized), context_length, None, max_windows)
            replaced = out is not None and overwrite and bool(earlier_files)  # an earlier sweep's files, replaced below
            if out is not None and not replaced:
                _note_unlisted_models(out / "models", methods, ratios, progress)
            # out_dir is made by the first save, the models folder by the first kept model: neither is left behind,
            # empty, by a sweep refused above or interrupted before it measured anything ("nothing written in" it)
            progress.message(f"evaluation: {len(windows)} windows of {context_length} tokens "
                             f"({sum(w.num_scored for w in windows)} scored tokens of {len(tokenized)})")

            # the source is read as the conversions read it: `sweep --allow-pickle` was refused here, "pass --allow-pickle"
            source_result, source_seconds, source_dtype = _evaluate(converter.source_path, tokenized, context_length, max_windows,
                                                      eval_device, eval_dtype, batch_size, progress, SOURCE,
                                                      allow_pickle=base.allow_pickle)
            progress.message(f"source: perplexity {source_result.perplexity:.4f}")
            shape = converter.config
            result = SweepResult(
                model_name=model_name or _model_name(source),
                source=str(source),
                data=str(data),
                num_layers=shape.num_layers,
                attention_kind=shape.attention_kind,
                cache_dtype=str(shape.torch_dtype).replace("torch.", ""),
                context_length=context_length,
                max_windows=max_windows,
                source_point=SweepPoint(SOURCE, None, None, None, shape.kv_values_per_token_layer, source_result,
                                        eval_seconds=source_seconds, measured_dtype=source_dtype),
                settings={
                    "ratios": ratios,
                    "methods": [METHOD_LABELS[m] for m in methods],
                    "convert_options": {k: v for k, v in base.to_dict().items() if k not in ("compression", "method", "command")},
                    "eval_dtype": eval_dtype,
                    "eval_device": str(resolve_device(eval_device)),  # where the models were scored (None: cuda if any)
                    "batch_size": batch_size,
                    "text_column": text_column,
                    "total_tokens": len(tokenized),
                    "torch_threads": torch.get_num_threads(),
                },
            )

            started = time.time()
            # said once, before the one pass that writes them (each export's disk line says only its output's size)
            progress.message(f"disk: calibration statistics about "
                             f"{human_bytes(estimated_statistics_bytes(converter.config, base.calibration))} in "
                             f"{tempfile.gettempdir()}")
            converter.calibrate()
            result.calibration = {"description": converter.calibration_description,
                                  "tokens": int(converter.ids.numel()),
                                  "seconds": round(getattr(converter, "calibration_seconds", time.time() - started), 2)}
            if replaced:  # the models the replaced sweep kept are its results too: only this sweep's stay listed
                _remove_earlier_models(out / "models", methods if keep_root is not None else [], ratios, progress)
            if out is not None:
                result.save(out, stem)

            total = len(ratios) * len(methods)
            for ratio in ratios:
                for method in methods:
                    label = f"{METHOD_LABELS[method]} {format_ratio(ratio)}"
                    progress.message(f"[{len(result.points) + 1}/{total}] {label}")
                    mla = pick_target_shape(converter.config, base.target, compression=ratio)
                    earlier = next((p for p in result.points if p.method == method and p.same_shape_as is None
                                    and (p.kv_lora_rank, p.rope_dim) == (mla.kv_lora_rank, mla.rope_dim)), None)
                    if earlier is not None:  # the same shape from the same statistics: the same model
                        progress.message(f"{label}: the same shape ({mla.kv_lora_rank}+{mla.rope_dim}) as "
                                         f"{earlier.label}; its numbers, not converted again")
                        result.points.append(dataclasses.replace(earlier, requested_ratio=ratio,  # no time spent on it
                                                                 same_shape_as=earlier.requested_ratio,
                                                                 convert_seconds=None, eval_seconds=None))
                        if replaced and keep_root is not None and _kept_model(keep_root / _folder_name(method, ratio)):
                            shutil.rmtree(keep_root / _folder_name(method, ratio))  # the earlier sweep's, unlisted now
                        if out is not None:
                            result.save(out, stem)
                        continue
                    if keep_root is not None:
                        keep_root.mkdir(parents=True, exist_ok=True)
                    folder = (keep_root or scratch.path) / _folder_name(method, ratio)
                    point = _convert_and_score(converter, base, ratio, method, folder, tokenized, context_length,
                                               max_windows, eval_device, eval_dtype, batch_size, progress, label,
                                               keep=keep_root is not None, source=str(source), data=str(data),
                                               source_result=source_result, source_dtype=source_dtype)
                    result.points.append(point)
                    if point.export_dtype and not any(p.export_dtype for p in result.points[:-1]):
                        result.cache_dtype = point.export_dtype  # the conversions' (the source row keeps its own)
                    if point.ok:
                        progress.message(f"{label} ({point.kv_lora_rank}+{point.rope_dim}): perplexity "
                                         f"{point.perplexity:.4f} = {result.perplexity_ratio(point):.3f} x source")
                    else:
                        progress.message(f"{label}: failed: {point.error}")
                    if out is not None:
                        result.save(out, stem)
    finally:
        scratch.cleanup()
    return result


def _clean_stale_scratch(parent: Path, progress: Progress) -> None:
    """Scratch folders killed runs left where this sweep keeps its own (the temp folder, or --models-dir)."""
    for name in clean_stale_scratch_folders(parent):
        progress.message(f"removed {name}, left behind in {parent} by an interrupted run")


def _wrong_argument_types(source, data, out_dir, models_dir, options, calibration, stem, **numbers) -> list[str]:
    """run_sweep's arguments of the wrong type, each named (a dict for options was an AttributeError deep inside)."""
    return argument_problems(
        source=path_argument(source), data=path_argument(data), out_dir=path_argument(out_dir, optional=True),
        models_dir=path_argument(models_dir, optional=True),
        options=optional_argument(options, ConvertOptions), calibration=optional_argument(calibration, CalibrationOptions),
        stem=(stem, (str,), "str"),
        **evaluation_number_arguments(**numbers))


def _stem_problems(stem: str) -> list[str]:
    """The files are `<out_dir>/<stem>.md` etc.: a stem with a folder in it (`../escape`) wrote outside out_dir, and
    one with a NUL byte crashed the save after the whole sweep."""
    if (stem and stem not in (".", "..") and Path(stem).name == stem and "/" not in stem and os.sep not in stem
            and "\0" not in stem):
        return []
    return [f"stem {stem!r}: must be a plain file name (the results are <stem>.md, .csv, .json and .png in out_dir)"]


def _note_unlisted_models(models: Path, methods: Sequence[str], ratios: Sequence[float], progress: Progress) -> None:
    """Kept models of an earlier sweep that this one will not list: said, and left as they are (never deleted)."""
    if not models.is_dir():
        return
    planned = {_folder_name(method, ratio) for method in methods for ratio in ratios}
    stale = sorted(folder.name for folder in models.iterdir() if folder.name not in planned and _kept_model(folder))
    if stale:
        progress.message(f"note: {models} holds models an earlier sweep kept that this one does not list "
                         f"({', '.join(stale)}); left as they are")


def _remove_earlier_models(models: Path, methods: Sequence[str], ratios: Sequence[float], progress: Progress) -> None:
    """With --overwrite, the models an earlier sweep kept in `<out_dir>/models` that this one will not replace (its
    sweep.md would not list them): removed.  Only folders mla-convert wrote (holding mla_convert.json, not a link);
    anything else is left as it is."""
    if not models.is_dir():
        return
    planned = {_folder_name(method, ratio) for method in methods for ratio in ratios}
    stale = sorted(folder for folder in models.iterdir() if folder.name not in planned and _kept_model(folder))
    for folder in stale:
        shutil.rmtree(folder)
    if stale:
        progress.message(f"removed the models the replaced sweep kept in {models} that this one does not list "
                         f"({', '.join(folder.name for folder in stale)})")
    if not any(models.iterdir()):
        models.rmdir()


def _folder_name(method: str, ratio: float) -> str:
    """A kept model's folder, named as `--methods` names its method (`svd-2x`; it was the internal `weight-2x`)."""
    return f"{METHOD_NAMES[method]}-{ratio:g}x"


def _preflight_all(converter: Converter, base: ConvertOptions, ratios: Sequence[float], methods: Sequence[str],
                   models_root: Path) -> list[str]:
    """The converter's pre-flight problems for every planned export (shapes, tensors, disk), all of them.

    Quietly: its per-export notes (e.g. the disk estimate) are shown again when each export runs.
    """
    problems: list[str] = []
    shown, converter.progress = converter.progress, Progress()
    try:
        _collect_preflight_problems(converter, base, ratios, methods, models_root, problems)
    finally:
        converter.progress = shown
    return problems


class _NotesOnce(ForwardingProgress):
    """The sweep's progress for its conversions: a `note:` every export repeats (the source's norm epsilon, its sliding
    window) is shown the first time only; everything else passes through."""

    def __init__(self, inner: Progress):
        super().__init__(inner)
        self.seen = set()

    def message(self, text: str) -> None:
        if text.startswith("note:") and text in self.seen:
            return
        self.seen.add(text)
        self.inner.message(text)


def _kept_model(folder: Path) -> bool:
    """A real folder holding a conversion (an earlier sweep's kept model), which a sweep may replace; never a link."""
    return folder.is_dir() and not folder.is_symlink() and (folder / "mla_convert.json").is_file()


def _collect_preflight_problems(converter: Converter, base: ConvertOptions, ratios: Sequence[float],
                                methods: Sequence[str], models_root: Path, problems: list[str]) -> None:
    for ratio in ratios:
        for method in methods:
            folder = models_root / _folder_name(method, ratio)
            if _kept_model(folder):
                continue  # an earlier sweep's kept model: replaced when its turn comes
            if folder.exists() or folder.is_symlink():
                problems.append(f"{folder}: exists and is not a model an earlier sweep kept; a sweep replaces only "
                                "those: move it away or choose another --out-dir")
                continue
            try:
                converter.preflight(folder, dataclasses.replace(base, compression=ratio, method=METHOD_NAMES[method]))
            except PreflightError as error:
                problems += [_as_sweep_flags(problem, ratio) for problem in error.problems]
            except MLAConvertError as error:
                problems.append(_as_sweep_flags(str(error), ratio))


def convert_command(source: str | os.PathLike, output: str | os.PathLike, options: ConvertOptions) -> str:
    """The `mla-convert convert` command that makes the model `options` describe, paths written as convert records
    its own command line (relative to the working directory below it, else the last part): every option that
    differs from convert's default, the compression and method always."""
    words = ["mla-convert", "convert", portable_path(str(source)), portable_path(os.path.abspath(output))]
    if options.compression is not None:
        words += ["--compression", _flag_value(options.compression)]
    words += ["--method", options.method]
    return shlex.join(words + _changed_flags(options, ConvertOptions(), skip={"compression", "method", "overwrite", "force"}))


def _changed_flags(values, defaults, skip: set[str] = frozenset()) -> list[str]:
    flags: list[str] = []
    for spec in dataclasses.fields(values):
        value, default = getattr(values, spec.name), getattr(defaults, spec.name)
        if dataclasses.is_dataclass(value):
            flags += _changed_flags(value, default)
            continue
        if spec.name in skip or value is None or value == default:
            continue
        flag = spec.metadata.get("flag") or "--" + spec.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        else:
            flags += [flag, _flag_value(value)]
    return flags


def _flag_value(value) -> str:
    if isinstance(value, float):
        short = f"{value:g}"
        return short if float(short) == value else repr(value)
    return portable_path(value) if isinstance(value, str) else str(value)  # e.g. --calib-data, as convert records it


def _as_sweep_flags(problem: str, ratio: float) -> str:
    """convert's message about its --compression, in the sweep's words (a ratio comes from --ratios)."""
    return problem.replace(f"--compression {ratio}", f"--ratios {ratio:g}").replace("--compression", "--ratios")


def _convert_and_score(converter: Converter, base: ConvertOptions, ratio: float, method: str, folder: Path,
                       tokenized: TokenizedText, context_length: int, max_windows: int | None, eval_device: str | None,
                       eval_dtype: str, batch_size: int, progress: Progress, label: str, keep: bool,
                       source: str, data: str, source_result: PerplexityResult,
                       source_dtype: str | None = None) -> SweepPoint:
    mla = pick_target_shape(converter.config, base.target, compression=ratio)
    common = dict(method=method, requested_ratio=ratio, kv_lora_rank=mla.kv_lora_rank, rope_dim=mla.rope_dim,
                  values_per_token_layer=mla.kv_values_per_token_layer)
    options = dataclasses.replace(base, compression=ratio, method=METHOD_NAMES[method])
    command = convert_command(source, folder, options)  # the kept model's card: a command that makes this model
    if folder.exists() or folder.is_symlink():
        if not _kept_model(folder):
            return SweepPoint(result=None, error=f"{folder}: exists and is not a converted model; not replacing it", **common)
        shutil.rmtree(folder)  # an earlier sweep's kept model
    started = time.time()
    try:
        conversion = converter.export(folder, options, command=command)
    except MLAConvertError as error:
        return SweepPoint(result=None, error=str(error).splitlines()[0], **common)
    convert_seconds = time.time() - started
    report = conversion.report
    options_used = report.get("options", {})
    common.update(kv_lora_rank=options_used.get("kv_lora_rank", mla.kv_lora_rank),
                  rope_dim=options_used.get("rope_dim", mla.rope_dim),
                  values_per_token_layer=report.get("cache", {}).get("mla_values_per_token_layer", mla.kv_values_per_token_layer))
    store = getattr(converter, "store", None)
    calibration_id = None if store is None else str(getattr(store, "path", id(store)))
    try:
        evaluation, eval_seconds, measured = _evaluate(conversion.output, tokenized, context_length, max_windows,
                                                       eval_device, eval_dtype, batch_size, progress, label)
        error = None
        if keep:  # its card reports what the sweep measured (it said "no perplexity was measured")
            from ..hub.card import record_perplexities

            record_perplexities(conversion.output, evaluation, source_result, data, measured,
                                str(resolve_device(eval_device)), measured_with="mla-convert sweep",
                                source_dtype=source_dtype)
    except MLAConvertError as failure:
        evaluation, eval_seconds, error = None, None, str(failure).splitlines()[0]
        measured = report.get("cache", {}).get("dtype")
    finally:
        if not keep:
            shutil.rmtree(conversion.output, ignore_errors=True)
    return SweepPoint(result=evaluation, error=error, convert_seconds=convert_seconds, eval_seconds=eval_seconds,
                      mean_attention_error=report.get("summary", {}).get("mean_attention_error"),
                      calibration_id=calibration_id, model_path=str(conversion.output) if keep else None,
                      export_dtype=report.get("cache", {}).get("dtype"), measured_dtype=measured, **common)


__all__ = [
    "DEFAULT_METHODS",
    "SweepError",
    "SweepFiles",
    "SweepPoint",
    "SweepResult",
    "canonical_methods",
    "parse_ratios",
    "load_sweep",
    "plot_sweep",
    "plot_title",
    "run_sweep",
]
