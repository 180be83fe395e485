"""The developer scripts' argument handling: paths resolved from the caller's folder, bad values refused with
one `error:` line (exit 2) before anything is measured or written.  Nothing here converts or times a model."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
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


# --------------------------------------------------------------------------- the shell scripts
SHELL_SCRIPTS = ["device_check.sh", "device_kernel_check.sh", "prepare_device_assets.sh", "check_engines.sh"]


def fake_repo(tmp_path: Path, *scripts: str) -> Path:
    """A copy of the scripts in an otherwise empty git repository: what they do to 'the repo' happens there."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in scripts:
        shutil.copy(SCRIPTS / name, repo / "scripts" / name)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    return repo


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_scripts_parse_and_answer_help(script, tmp_path):
    path = SCRIPTS / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    shown = subprocess.run(["bash", str(path), "--help"], capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert shown.returncode == 0 and "usage" not in shown.stderr
    assert script in shown.stdout and not shown.stdout.startswith("!")  # the header comment, without its '#'
    bad = subprocess.run(["bash", str(path), "--bogus"], capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "error: unknown" in bad.stderr
    assert list(tmp_path.iterdir()) == []  # nothing made in the caller's folder


def test_prepare_device_assets_checks_its_argument_before_removing_anything(tmp_path):
    repo = fake_repo(tmp_path, "prepare_device_assets.sh")
    (repo / ".device_assets").mkdir()
    (repo / ".device_assets" / "keep").write_text("prepared earlier")
    done = subprocess.run(["bash", str(repo / "scripts" / "prepare_device_assets.sh"), str(tmp_path / "nowhere")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert done.returncode == 2 and "error:" in done.stderr and done.stderr.count("\n") == 1
    assert (repo / ".device_assets" / "keep").exists()  # was rm -rf'd before the first cp failed
    assert "device_assets" not in (repo / ".git" / "info" / "exclude").read_text()


def test_prepare_device_assets_reads_a_relative_shared_folder_from_the_callers_folder(tmp_path):
    repo = fake_repo(tmp_path, "prepare_device_assets.sh")
    caller = tmp_path / "caller"
    (caller / "mine" / "assets" / "stories260k").mkdir(parents=True)
    (caller / "mine" / "assets" / "stories260k" / "config.json").write_text("{}")
    (caller / "mine" / "data").mkdir()
    (caller / "mine" / "data" / "tinystories-valid-excerpt.txt").write_text("one\ntwo\nthree\nfour\n")
    done = subprocess.run(["bash", str(repo / "scripts" / "prepare_device_assets.sh"), "mine"],
                          capture_output=True, text=True, cwd=caller, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (repo / ".device_assets" / "stories260k" / "config.json").exists()
    assert (repo / ".device_assets" / "texts" / "held-out.txt").read_text()


def test_device_check_writes_a_relative_out_in_the_callers_folder(tmp_path):
    """SKIP_KERNEL=1 in a repo without device_convert_check.py: the conversion fails at once, the packing still runs."""
    repo = fake_repo(tmp_path, "device_check.sh")
    caller = tmp_path / "caller"
    caller.mkdir()
    env = {**os.environ, "OUT": "results", "SKIP_KERNEL": "1", "CONVERT_LIMIT": "20"}
    subprocess.run(["bash", str(repo / "scripts" / "device_check.sh")], capture_output=True, text=True, cwd=caller,
                   env=env, timeout=60)
    assert (caller / "results" / "summary.txt").exists() and not (repo / "results").exists()
