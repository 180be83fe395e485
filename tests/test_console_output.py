"""What a command prints when its output is piped or redirected (not a terminal): for logs and CI.

Rich would wrap tables at the terminal width (80 columns when there is none) and draw progress bars that
leave blank lines in a file.  Piped, every command prints plain Markdown tables, one row per line however
long, and one `done: <phase> (<seconds>)` line per finished phase.  Checked through real subprocesses, so
stdout and stderr really are pipes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import save_tiny_model, save_tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
QUICK = ["--calib-samples", "2", "--calib-seq-len", "16", "--effort", "fast"]


def run_piped(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'kernels'}", "COLUMNS": "80", "HF_HUB_OFFLINE": "1"}
    env.pop("FORCE_COLOR", None)
    return subprocess.run([sys.executable, "-m", "mla_convert", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600)


def markdown_tables(text: str) -> list[list[str]]:
    """The Markdown tables in `text` (runs of lines starting with '|'), each a list of lines."""
    tables, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables + ([current] if current else [])


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    folder = save_tiny_model(tmp_path_factory.mktemp("piped") / "src", vocab_size=128, num_layers=2)
    save_tiny_tokenizer(folder, vocab_size=128)
    return folder


def test_piped_convert_prints_one_line_per_phase_and_unwrapped_markdown_tables(source, tmp_path):
    done = run_piped("convert", source, tmp_path / "out", "-c", "2", *QUICK)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr and "\x1b[" not in done.stderr + done.stdout  # no bars, no colour codes
    phases = json.loads((tmp_path / "out" / "mla_convert.json").read_text())["summary"]["phase_seconds"]
    finished = re.findall(r"^done: (.+) \([\d.]+ s\)$", done.stderr, re.M)
    assert sorted(finished) == sorted(phases)  # each phase once
    assert all(line.startswith(("done: ", "disk: ")) for line in done.stderr.splitlines())
    tables = markdown_tables(done.stdout)
    assert len(tables) >= 2
    for table in tables:
        assert re.fullmatch(r"\|(-{3,}:?\|)+", table[1]), table[1]  # a Markdown header separator
        assert all(line.endswith("|") and line.count("|") == table[0].count("|") for line in table)
    assert max(len(line) for table in tables for line in table) > 80  # rows longer than COLUMNS stay whole
    assert re.search(r"\|\n\*\*", done.stdout) is None  # a blank line ends each table before the next title


def test_piped_eval_prints_its_table_unwrapped(source, tmp_path):
    converted = tmp_path / "out"
    assert run_piped("convert", source, converted, "-c", "2", *QUICK, "-q").returncode == 0
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a tiny model that read a tiny text. " * 30)
    done = run_piped("eval", converted, "--baseline", source, "--data", text, "--context", "32", "--max-windows", "4",
                     "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stdout + done.stderr
    tables = markdown_tables(done.stdout)
    assert tables and len(tables[0]) >= 4  # header, separator, the model, the baseline
    assert all(line.endswith("|") for line in tables[0])


def test_piped_convert_prints_a_long_bracketed_output_path_as_one_exact_line(source, tmp_path):
    """The last line of `convert` is the output folder, for scripts (`out=$(mla-convert convert ...)`): rich
    would wrap it at 80 columns when piped and read `[v2]` as markup."""
    output = tmp_path / "runs [v2]" / ("a-folder-name-longer-than-the-console-" * 2) / "out"
    output.parent.mkdir(parents=True)
    assert len(str(output)) > 80
    done = run_piped("convert", source, output, "-c", "2", *QUICK, "-q")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(output)]
    assert (output / "config.json").is_file()
    inspected = run_piped("inspect", output.parent / "missing-on-purpose", "-c", "2")  # the error names the path whole
    assert inspected.returncode == 2 and str(output.parent / "missing-on-purpose") in inspected.stderr


def test_emoji_codes_in_paths_and_prompts_are_printed_as_typed(source, tmp_path):
    """rich turned `:cat:` into a cat: the output line a script reads named another folder, and a prompt
    `generate` echoed was not the prompt given."""
    output = tmp_path / "run :cat: 2" / "out"
    output.parent.mkdir()
    done = run_piped("convert", source, output, "-c", "2", *QUICK, "-q")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(output)]
    generated = run_piped("generate", output, "say :smile:", "--max-new-tokens", "2")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("say :smile:") and "\N{SMILING FACE WITH OPEN MOUTH AND SMILING EYES}" not in generated.stdout
    missing = run_piped("inspect", tmp_path / "gone :smile:", "-c", "2")
    assert missing.returncode == 2 and str(tmp_path / "gone :smile:") in missing.stderr


def test_terminal_tables_show_cells_as_text_not_markup():
    """On a terminal the tables are rich tables; a cell such as a path with brackets stays as it is."""
    import io

    from rich.console import Console

    from mla_convert.console import print_table

    buffer = io.StringIO()
    terminal = Console(file=buffer, force_terminal=True, color_system=None, width=120)
    print_table(terminal, "title", ("what", "where"), [("calibration", "runs/[v2]/text.txt [bold]x[/]")])
    assert "runs/[v2]/text.txt [bold]x[/]" in buffer.getvalue()


def test_progress_messages_are_plain_text():
    """Messages (a sweep point's label, a failure quoting a path) keep their brackets."""
    import io

    from rich.console import Console

    from mla_convert.console import RichProgress

    buffer = io.StringIO()
    RichProgress(Console(file=buffer, width=40)).message("[2/4] 2x: failed: no folder runs/[v2]/" + "x" * 60)
    assert buffer.getvalue() == "[2/4] 2x: failed: no folder runs/[v2]/" + "x" * 60 + "\n"


def test_piped_sweep_reports_each_evaluation_before_its_result(source, tmp_path):
    """Each scored model's `done: perplexity: <label>` line comes before the line with its result, not after
    the next point's header (the phase used to stay open until the next one started)."""
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a tiny model that read a tiny text. " * 30)
    done = run_piped("sweep", source, "--ratios", "2", "--data", text, "--out-dir", tmp_path / "sweep", "--context", "32",
                     "--max-windows", "2", "--methods", "svd", *QUICK)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    for label in ("source", "weight-only SVD 2x"):
        finished = next(i for i, line in enumerate(lines) if re.fullmatch(rf"done: perplexity: {label} \([\d.]+ s\)", line))
        result = next(i for i, line in enumerate(lines) if line.startswith(f"{label}") and "perplexity" in line
                      and not line.startswith("done:"))
        assert finished < result, lines


def test_convert_says_when_the_norm_epsilon_changes(tmp_path):
    """A source with rms_norm_eps 1e-5 (most real Llamas) is exported with 1e-6; only the card said so."""
    source = save_tiny_model(tmp_path / "src", vocab_size=128, num_layers=1, rms_norm_eps=1e-5)
    done = run_piped("convert", source, tmp_path / "out", "-c", "2", *QUICK)
    assert done.returncode == 0, done.stderr
    assert "note: every RMSNorm of the export uses eps 1e-06 (the source: 1e-05)" in done.stderr
