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

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self._phase is not None:
            name, started = self._phase
            self.console.print(f"done: {name} ({time.time() - started:.1f} s)", highlight=False, soft_wrap=True)
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

    def message(self, text: str) -> None:
        if not self.quiet:
            self.console.print(text, highlight=False, soft_wrap=True)

    def finish(self) -> None:
        self._close()


def print_table(console: Console, title: str, header: Sequence[str], rows: Sequence[Sequence[str]],
                right: Sequence[int] = ()) -> None:
    """A boxed table on a terminal; a titled Markdown table, one row per line, anywhere else."""
    if console.is_terminal:
        table = Table(title=title, show_header=bool(header))
        for index, name in enumerate(header or [""] * len(rows[0])):
            table.add_column(name, justify="right" if index in right else "left")
        for row in rows:
            table.add_row(*row)
        console.print(table)
        return
    lines = [f"**{title}**", ""] if title else []
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
        rows.append(("attention output error (mean, relative)", f"{summary['mean_attention_error']:.3f}"))
    rows += [
        ("RoPE grid", report["rope"]["grid"]),
        ("calibration", report["calibration"]["description"]),
        ("time", f"{summary['seconds']:.1f} s"),
        ("peak memory (RSS)", human_bytes(summary["peak_rss_bytes"])),
    ]
    if summary.get("device"):
        rows.append(("device", summary["device"]))
    return rows


def print_summary(console: Console, report: dict) -> None:
    print_table(console, "mla-convert summary", (), summary_rows(report), right=(1,))


def print_engines(console: Console, report: dict) -> None:
    rows = []
    for engine, facts in report["engines"].items():
        runs = "yes" if facts["ok"] else "no"
        if facts["ok"] and not facts.get("fast_path", True):
            runs = "yes (no fast kernel)"
        rows.append((engine, runs, "; ".join(facts["notes"])))
    print_table(console, "engine compatibility", ("engine", "runs", "notes"), rows)
