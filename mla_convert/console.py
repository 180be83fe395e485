"""Terminal output for the CLI: rich progress bars per phase and the conversion summary table."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichBar
from rich.table import Table

from .convert.decisions import Progress
from .units import human_bytes


class RichProgress(Progress):
    """One progress bar per conversion phase (sampling, statistics, RoPE grids, layers)."""

    def __init__(self, console: Console, quiet: bool = False, verbose: bool = False):
        self.console = console
        self.quiet = quiet
        self.verbose = verbose
        self._bar: RichBar | None = None
        self._task = None

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def phase(self, name: str, total: int | None = None) -> None:
        self._close()
        if self.quiet:
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

    def message(self, text: str) -> None:
        if not self.quiet:
            self.console.print(text, highlight=False)

    def finish(self) -> None:
        self._close()


def summary_table(report: dict) -> Table:
    """Cache before -> after, ratio, quality proxies, time and memory of one conversion."""
    cache, summary, options = report["cache"], report["summary"], report["options"]
    table = Table(title="mla-convert summary", show_header=False)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("MLA shape (kv_lora_rank + rope_dim)", f"{options['kv_lora_rank']} + {options['rope_dim']}")
    table.add_row("cached values / token / layer", f"{cache['source_values_per_token_layer']} -> {cache['mla_values_per_token_layer']}")
    table.add_row(f"KV cache / token ({cache['dtype']})",
                  f"{human_bytes(cache['source_bytes_per_token'])} -> {human_bytes(cache['mla_bytes_per_token'])}")
    table.add_row("compression ratio", f"{cache['ratio']:.2f}x")
    table.add_row("kept energy (mean / min over layers)", f"{summary['mean_kept_energy']:.3f} / {summary['min_kept_energy']:.3f}")
    if summary.get("mean_attention_error") is not None:
        table.add_row("attention output error (mean, relative)", f"{summary['mean_attention_error']:.3f}")
    table.add_row("RoPE grid", report["rope"]["grid"])
    table.add_row("calibration", report["calibration"]["description"])
    table.add_row("time", f"{summary['seconds']:.1f} s")
    table.add_row("peak memory (RSS)", human_bytes(summary["peak_rss_bytes"]))
    return table


def engines_table(report: dict) -> Table:
    table = Table(title="engine compatibility")
    table.add_column("engine")
    table.add_column("runs")
    table.add_column("notes")
    for engine, facts in report["engines"].items():
        runs = "yes" if facts["ok"] else "no"
        if facts["ok"] and not facts.get("fast_path", True):
            runs = "yes (no fast kernel)"
        table.add_row(engine, runs, "; ".join(facts["notes"]))
    return table
