"""The developer scripts' argument handling: paths resolved from the caller's folder, bad values refused with
one `error:` line (exit 2) before anything is measured or written.  Nothing here converts or times a model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(capsys, call) -> str:
    """`call()` exits 2 with a one-line `error:` message; returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        call()
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1, lines
    return lines[0]


# --------------------------------------------------------------------------- bench_targets.py
def test_bench_targets_resolves_paths_from_the_callers_folder(tmp_path, monkeypatch):
    """The conversions run with cwd=REPO: a relative --work must name the caller's folder, not the repo's."""
    bench = load("bench_targets")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.eval.json").write_text("{}")
    args = bench.parse_args(["--work", "w", "--write-benchmarks", "B.md"])
    assert args.work == tmp_path / "w" and args.write_benchmarks == tmp_path / "B.md"
    assert bench.parse_args(["--from-json", "a.eval.json"]).from_json == [tmp_path / "a.eval.json"]


@pytest.mark.parametrize("argv, says", [
    ([], "--work"),                                  # was a TypeError from Path / None
    (["--work", "w", "--models", "bogus"], "bogus"),  # was a KeyError after parsing
    (["--from-json"], "no files"),                   # zero files fell through to running the conversions
    (["--from-json", "missing.json"], "no such file"),  # was a FileNotFoundError
])
def test_bench_targets_refuses_bad_arguments(tmp_path, monkeypatch, capsys, argv, says):
    bench = load("bench_targets")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "run", lambda *a: pytest.fail("ran the conversions"))
    assert says in refused(capsys, lambda: bench.main(argv))
