"""Terminal output for the CLI: progress per phase and the tables every command prints.

On a terminal: rich progress bars and boxed tables.  Piped or redirected (a log, `| tee`, CI): one plain
line per finished phase and Markdown tables one row per line, never wrapped at 80 columns and never the
blank lines a redrawn bar leaves in a file.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichBar
from rich.table import Table
from rich.text import Text

from .convert.decisions import Progress
from .units import human_bytes


class RichProgress(Progress):
    """One progress bar per conversion phase on a terminal; one line per finished phase elsewhere."""

    def __init__(self, console: Console, quiet: bool = False, verbose: bool = False):
        self.console = console
        self.quiet = quiet
        self.verbose = verbose
        self.interactive = console.is_terminal
        self._bar: RichBar | None = None
        self._task = None
        self._phase: tuple[str, float] | None = None  # (name, start time) of the running phase, off a terminal

    def _close(self, outcome: str = "done") -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self._phase is not None:
            name, started = self._phase
            self.console.print(f"{outcome}: {name} ({time.time() - started:.1f} s)", highlight=False, soft_wrap=True)
            self._phase = None

    def phase(self, name: str, total: int | None = None) -> None:
        self._close()
        if self.quiet:
            return
        if not self.interactive:
            self._phase = (name, time.time())
            return
        self._bar = RichBar(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=self.console, transient=not self.verbose,
        )
        self._bar.start()
        self._task = self._bar.add_task(name, total=total)

    def advance(self, done: int, total: int | None = None) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total if total is not None else self._bar.tasks[0].total)

    def end(self) -> None:
        self._close()

    def message(self, text: str) -> None:
        if not self.quiet:  # plain text: a message quoting a path or an error like `[v2]` keeps its brackets
            self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def finish(self, outcome: str = "done") -> None:
        """Close the running phase; `outcome` is what the log says of it: "interrupted" or "failed" for a phase that
        was cut off (never "done:" after a Ctrl-C)."""
        self._close(outcome)


def print_table(console: Console, title: str, header: Sequence[str], rows: Sequence[Sequence[str]],
                right: Sequence[int] = ()) -> None:
    """A boxed table on a terminal; a titled Markdown table, one row per line, anywhere else."""
    if console.is_terminal:
        table = Table(title=title, show_header=bool(header))
        for index, name in enumerate(header or [""] * len(rows[0])):
            table.add_column(name, justify="right" if index in right else "left")
        for row in rows:
            table.add_row(*(Text(str(cell)) for cell in row))  # Text: a cell like `runs/[v2]` is not markup
        console.print(table)
        return
    lines = ["", f"**{title}**", ""] if title else []  # blank first: Markdown would run the title into the text above
    names = list(header) if header else [""] * (len(rows[0]) if rows else 0)
    lines.append("| " + " | ".join(names) + " |")
    lines.append("|" + "|".join("---:" if index in right else "---" for index in range(len(names))) + "|")
    lines += ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    lines.append("")  # a blank line ends the table: Markdown would otherwise run the next text into it
    console.print("\n".join(lines), highlight=False, markup=False, soft_wrap=True)


def summary_rows(report: dict) -> list[tuple[str, str]]:
    """Cache before -> after, ratio, quality proxies, time and memory of one conversion."""
    cache, summary, options = report["cache"], report["summary"], report["options"]
    rows = [
        ("MLA shape (kv_lora_rank + rope_dim)", f"{options['kv_lora_rank']} + {options['rope_dim']}"),
        ("cached values / token / layer", f"{cache['source_values_per_token_layer']} -> {cache['mla_values_per_token_layer']}"),
        (f"KV cache / token ({cache['dtype']})",
         f"{human_bytes(cache['source_bytes_per_token'])} -> {human_bytes(cache['mla_bytes_per_token'])}"),
        ("compression ratio", f"{cache['ratio']:.2f}x"),
        ("kept energy (mean / min over layers)", f"{summary['mean_kept_energy']:.3f} / {summary['min_kept_energy']:.3f}"),
    ]
    if summary.get("mean_attention_error") is not None:
        # measured on the float32 fit: rounding the weights to the export's dtype adds its own error on top
        rounded = "" if options.get("dtype") in (None, "float32") else f"; of the float32 fit, before the {options['dtype']} export"
        rows.append((f"attention output error (mean, relative{rounded})", f"{summary['mean_attention_error']:.3f}"))
    rows += [
        ("RoPE grid", report["rope"]["grid"] + (f"; {report['rope']['note']}" if report["rope"].get("note") else "")),
        ("calibration", report["calibration"]["description"]),
        ("time", f"{summary['seconds']:.1f} s"),
        ("peak memory (RSS)", human_bytes(summary["peak_rss_bytes"])),
    ]
    if summary.get("device"):
        rows.append(("device", summary["device"]))
    rows += serving_rows(report)
    return rows


def serving_rows(report: dict) -> list[tuple[str, str]]:
    """What --target did: the shape it allowed, the extra bytes, the bias cost, the weight magnitudes."""
    serving = report.get("serving")
    if not serving:
        return []
    rows = [("target", serving["target"])]
    if serving.get("shape_note"):
        rows.append(("shape", serving["shape_note"]))
    extra = serving.get("extra_values", {})
    parts = [f"{name.replace('_', ' ')} {value:,} values" for name, value in extra.items() if value]
    if parts:
        rows.append(("extra weights", f"{human_bytes(serving['extra_bytes'])} ({'; '.join(parts)})"))
    if serving.get("bias"):
        bias = serving["bias"]
        rows.append(("attention biases removed", f"attention output changed by at most {bias['max_removal_error']:.4f} "
                     f"(relative, held-out calibration windows; {bias['rule']})"))
    latent = serving.get("magnitudes", {}).get("kv_a_latent_rows", {})
    if latent:
        rows.append(("latent weights", f"median {latent.get('median_nonzero', 0):.2g}, {latent.get('frac_below_f16_normal', 0):.1%} "
                     f"below f16's normal range, {latent.get('frac_zero_in_f16', 0):.2%} zero in f16 (worst layer)"))
    if serving.get("quantized_kv_cache"):
        rows.append(("llama.cpp q8_0 KV cache", serving["quantized_kv_cache"]))
    return rows


def print_summary(console: Console, report: dict) -> None:
    print_table(console, "mla-convert summary", (), summary_rows(report), right=(1,))


def engine_verdict(ok: bool | None, patches: list | None = None) -> str:
    if ok is True and patches:  # what a patched engine did, not the released one
        return "only patched (measured)"
    return "yes (measured)" if ok is True else ("no" if ok is False else "not measured")


def print_engines(console: Console, report: dict) -> None:
    """Which engines run this export: measured runs only (mla_convert/convert/engine_runs.json), else "not measured"."""
    rows = []
    for engine, facts in report["engines"].items():
        notes = list(facts.get("notes", [])) + list(facts.get("runs", []))
        rows.append((engine, engine_verdict(facts.get("ok"), facts.get("patches")), "; ".join(notes)))
    print_table(console, "engines (measured runs: docs/engines.md)", ("engine", "runs", "notes"), rows)
