"""Paths as users type them: `.`, a trailing slash, a quoted `~`, `python -m`; each names what it says.

Found by walking the whole journey from other working folders: `.` and `out/` crashed on "empty name",
`ft/` put the fine-tuning checkpoints inside the output (and the run failed at the save), a quoted `~`
was recorded literally (a later fine-tuning could not find its teacher), and `python -m mla_convert`
recorded `__main__.py` as the command.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import save_tiny_model, save_tiny_tokenizer
from typer.testing import CliRunner

from mla_convert import cli
from mla_convert.convert import CalibrationOptions, ConvertOptions, convert
from mla_convert.errors import PreflightError
from mla_convert.eval.perplexity import run_eval
from mla_convert.finetune.command import main as finetune_main
from mla_convert.finetune.config import FinetuneConfig
from mla_convert.hub.push import check_pushable
from mla_convert.io.paths import command_line

FAST = ConvertOptions(compression=2, effort="fast", calibration=CalibrationOptions(num_samples=2, seq_len=16))


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("paths")
    source = save_tiny_model(root / "src", num_layers=1)
    return convert(source, root / "mla", FAST).output


def test_a_trailing_slash_puts_checkpoints_beside_the_output_not_inside(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert FinetuneConfig(output="ft/").checkpoint_path == tmp_path / "ft.checkpoints"
    assert FinetuneConfig(output="runs/ft").checkpoint_path == tmp_path / "runs" / "ft.checkpoints"


def test_convert_into_the_current_folder_or_the_root_is_one_error(tmp_path, monkeypatch):
    source = save_tiny_model(tmp_path / "src", num_layers=1)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PreflightError, match="already exists"):
        convert(source, ".", FAST)
    with pytest.raises(PreflightError, match="is the root folder"):
        convert(source, "/", FAST)
    result = CliRunner().invoke(cli.app, ["convert", str(source), ".", "-c", "2"])
    assert result.exit_code == 2 and "Traceback" not in result.output and "already exists" in result.output


def test_push_checks_the_current_folder(converted, monkeypatch):
    monkeypatch.chdir(converted)
    assert {item.path for item in check_pushable(".")} == {item.path for item in check_pushable(converted)}


def test_a_quoted_home_path_is_recorded_relative_to_the_output(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    save_tiny_model(tmp_path / "home" / "models" / "src", num_layers=1)
    output = convert("~/models/src", tmp_path / "mla", FAST).output
    recorded = json.loads((output / "mla_convert.json").read_text())["source"]["name_or_path"]
    assert not recorded.startswith("~") and (output / recorded).resolve() == (tmp_path / "home" / "models" / "src").resolve()


def test_python_dash_m_records_the_command_people_type():
    assert command_line(["/somewhere/site-packages/mla_convert/__main__.py", "convert", "a", "b"]) == "mla-convert convert a b"
    assert command_line(["/usr/bin/mla-convert", "eval", "m"]) == "mla-convert eval m"


def test_the_recipe_script_takes_model_and_output_first_like_the_command(tmp_path, capsys):
    """Only `mla-convert finetune` used to accept them; `recipes/finetune_mla.py MODEL OUTPUT` was 'unrecognized'."""
    assert finetune_main([str(tmp_path / "m"), str(tmp_path / "o"), "--max-steps", "0"], prog="finetune_mla.py") == 2
    error = capsys.readouterr().err
    assert "max_steps: must be at least 1" in error and "unrecognized" not in error


def test_a_quoted_home_path_for_results_is_written_in_the_home_folder(tmp_path, monkeypatch):
    """`eval --json "~/eval.json"` was refused ("its folder ~ does not exist") or, with a `~` folder in the working
    folder, written there; the sweep's `--out-dir "~/sweep"` created a folder named `~`."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    source = save_tiny_tokenizer(save_tiny_model(tmp_path / "src", num_layers=1, vocab_size=512), vocab_size=512)
    converted = convert(source, tmp_path / "mla", FAST).output
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat and looked at the dog. " * 40)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    result = CliRunner().invoke(cli.app, ["eval", str(converted), "--data", str(text), "--context", "32",
                                          "--max-windows", "1", "--json", "~/eval.json"])
    assert result.exit_code == 0, result.output
    assert json.loads((home / "eval.json").read_text())["settings"]["context_length"] == 32
    run_eval(converted, text, context_length=32, max_windows=1, progress=False, json_path="~/api.json")
    assert (home / "api.json").is_file()
    from mla_convert.eval.sweep import run_sweep

    run_sweep(source, "2", text, "~/sweep", context_length=32, max_windows=1, methods="svd",
              options=FAST)
    assert (home / "sweep" / "sweep.json").is_file() and not (work / "~").exists()


def test_a_positional_model_and_a_model_flag_are_refused_together(tmp_path, capsys):
    """`finetune A B --model C` trained C without a word."""
    assert finetune_main([str(tmp_path / "a"), str(tmp_path / "b"), "--model", str(tmp_path / "c")]) == 2
    assert "--model: given both as a positional argument and as a flag" in capsys.readouterr().err
