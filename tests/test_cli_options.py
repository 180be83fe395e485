"""One options model drives the CLI: every field is a flag that reaches the library, and nothing else is.

The commands are generated from `ConvertOptions` / `CalibrationOptions` (`options.cli_options`); these tests
parse real command lines with the real typer app and look at the dataclass the command received.
"""

from __future__ import annotations

import dataclasses

import pytest
import typer

from mla_convert import cli
from mla_convert.options import CalibrationOptions, ConvertOptions, option_problems


def command(name: str):
    group = typer.main.get_command(cli.app)
    return group.commands[name]


def flags_of(name: str) -> set[str]:
    return {opt for param in command(name).params for opt in getattr(param, "opts", [])}


class Received(Exception):
    """Raised by the stand-in conversion to stop the command once it has the options."""


def parsed_options(monkeypatch, args: list[str]) -> ConvertOptions:
    """The ConvertOptions `mla-convert convert ARGS` hands the library (the conversion itself is not run)."""
    from typer.testing import CliRunner

    import mla_convert.convert.pipeline as pipeline

    seen = []

    def stand_in(source, output, options, progress=None, command=None, caller_problems=()):
        assert not caller_problems, caller_problems
        seen.append(options)
        raise Received()

    monkeypatch.setattr(pipeline, "convert", stand_in)
    result = CliRunner().invoke(cli.app, ["convert", *args])
    assert isinstance(result.exception, Received), result.output
    return seen[0]


def every_flag(cls) -> list[str]:
    out = []
    for spec in dataclasses.fields(cls):
        if dataclasses.is_dataclass(spec.type) or spec.name == "calibration":
            out += every_flag(CalibrationOptions)
        else:
            out.append(spec.metadata["flag"])
    return out


def test_every_option_field_is_a_convert_flag_and_calibration_flags_are_shared_with_sweep():
    convert_flags, sweep_flags = flags_of("convert"), flags_of("sweep")
    for flag in every_flag(ConvertOptions):
        assert flag in convert_flags, f"{flag} has no convert flag"
    for flag in every_flag(CalibrationOptions):
        assert flag in sweep_flags, f"sweep lacks the calibration flag {flag}"
    # sweep sets the shape and the method per point itself
    assert {"--kv-lora-rank", "--rope-dim", "--compression", "--method"}.isdisjoint(sweep_flags)
    # and replaces only what a sweep wrote itself (--overwrite: an earlier sweep's tables and plot; the models it kept
    # are replaced without a flag): no flag to replace anything else
    assert "--force" not in sweep_flags and "--overwrite" in sweep_flags


def test_flags_reach_the_options_dataclass(monkeypatch):
    options = parsed_options(monkeypatch, ["src", "out", "-r", "32", "--rope-dim", "16", "--calib-samples", "5",
                                           "--calib-top-p", "0.5", "--no-sequential", "--device", "cpu", "--refine-steps", "0",
                                           "--no-kv-balance-search", "--rope-finalists", "3", "--license", "mit"])
    assert isinstance(options, ConvertOptions)
    assert (options.kv_lora_rank, options.rope_dim, options.sequential, options.refine_steps) == (32, 16, False, 0)
    assert (options.kv_balance_search, options.rope_finalists, options.license) == (False, 3, "mit")
    assert (options.calibration.num_samples, options.calibration.top_p) == (5, 0.5)
    assert parsed_options(monkeypatch, ["src", "out"]) == ConvertOptions()


@pytest.mark.parametrize("changes, message", [
    ({"refine_lr": 0.0}, "--refine-lr 0.0: must be positive"),
    ({"method": "pca"}, "--method 'pca': choose one of"),
    ({"rope_finalists": 0}, "--rope-finalists 0: must be at least 1"),
    ({"calibration": CalibrationOptions(seq_len=1)}, "--calib-seq-len 1: must be at least 2 (attention needs two positions)"),
    ({"calibration": CalibrationOptions(top_p=1.5)}, "--calib-top-p 1.5: must be at most 1"),
    ({"calibration": CalibrationOptions(temperature=float("nan"))}, "--calib-temperature nan: must be a finite number"),
    ({"calibration": CalibrationOptions(num_samples=True)}, "calibration.num_samples True: must be int"),
])
def test_option_ranges_are_checked_in_one_place(changes, message):
    problems = option_problems(dataclasses.replace(ConvertOptions(), **changes))
    assert any(message in line for line in problems), problems
    assert option_problems(ConvertOptions()) == []


@pytest.mark.parametrize("args, message", [
    (["--force"], "--force: acts only with --overwrite"),
    (["--calib-data", "corpus.txt", "--seed", "3"], "--seed: acts only with calibration text sampled from the model"),
    (["--calib-data", "corpus.txt", "--calib-temperature", "0.5", "--calib-top-p", "0.5"],
     "--calib-temperature: acts only with calibration text sampled"),
    (["--calib-data", "corpus.txt", "--calib-top-p", "0.5"], "--calib-top-p: acts only with calibration text sampled"),
    (["--method", "svd", "--no-kv-balance-search"], "--kv-balance-search: acts only with the activation-aware method"),
    (["--refine-steps", "0", "--refine-lr", "0.01"], "--refine-lr: acts only with layer refinement"),
    (["--effort", "fast", "--refine-lr", "0.01"], "--refine-lr: acts only with layer refinement"),
    (["--method", "svd", "--refine-lr", "0.01"], "--refine-lr: acts only with layer refinement"),
    # greedy sampling has no seed or nucleus (the report said "(seed 1)")
    (["--calib-temperature", "0", "--seed", "1"], "--seed: acts only with calibration text sampled from the model (no "
                                                  "--calib-data) at a --calib-temperature above 0"),
    (["--calib-temperature", "0", "--calib-top-p", "0.1"], "--calib-top-p: acts only with"),
    # one error window: refinement never ran, and the report said "5 steps per layer (given)"
    (["--refine-steps", "5", "--calib-error-samples", "1"], "--refine-steps: acts only with at least 2 error windows"),
    (["--refine-steps", "5", "--calib-samples", "1"], "--refine-steps: acts only with at least 2 error windows"),
    # each layer keeps at most the windows read: 100 was clamped to 16 and recorded as 100 (README-journey probe)
    (["--calib-error-samples", "100"], "--calib-error-samples: acts only with --calib-samples of at least as many windows"),
])
def test_a_flag_that_cannot_act_with_the_others_is_refused_not_ignored(monkeypatch, args, message):
    """These were accepted and changed nothing (e.g. --seed with --calib-data: the text is read, not sampled)."""
    from typer.testing import CliRunner

    import mla_convert.convert.pipeline as pipeline

    monkeypatch.setattr(pipeline, "convert", lambda *a, **k: pytest.fail("converted despite an ineffective flag"))
    result = CliRunner().invoke(cli.app, ["convert", "src", "out", *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_flags_that_cannot_act_are_reported_with_every_other_problem(tmp_path):
    """convert stopped at the first flag that could not act (--force without --overwrite): the bad rank, the existing
    output and the source's damage came one run later each, although pre-flight promises every problem at once."""
    from tiny_models import save_tiny_model
    from typer.testing import CliRunner

    source = save_tiny_model(tmp_path / "src", num_layers=1)
    (source / "config.json").write_text((source / "config.json").read_text().replace('"hidden_act": "silu"',
                                                                                        '"hidden_act": "gelu"'))
    output = tmp_path / "out"
    output.mkdir()
    (output / "keep.txt").write_text("earlier work")
    result = CliRunner().invoke(cli.app, ["convert", str(source), str(output), "--force", "--private",
                                          "--kv-lora-rank", "0"])
    lines = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert [line.split(":")[1] for line in lines[:2]] == [" --force", " --private"], result.output
    text = " ".join(result.output.split())
    assert "hidden_act" in text and f"{output}: already exists" in text, text
    assert (output / "keep.txt").read_text() == "earlier work"

    # a source that pre-flight accepts: the refused flags and the rank together, and still nothing converted
    good = save_tiny_model(tmp_path / "good", num_layers=1)
    result = CliRunner().invoke(cli.app, ["convert", str(good), str(tmp_path / "new"), "--force", "--kv-lora-rank", "0"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "--force: acts only with --overwrite" in text
    assert "--kv-lora-rank 0: must be positive" in text and not (tmp_path / "new").exists(), text
    result = CliRunner().invoke(cli.app, ["convert", str(good), str(tmp_path / "new"), "--force"])
    assert result.exit_code == 2 and not (tmp_path / "new").exists()
    assert [line for line in result.output.splitlines() if line.strip()] == ["error: --force: acts only with --overwrite"]

    # a --revision that cannot act on a local folder stopped pre-flight too: the rank came one run later
    result = CliRunner().invoke(cli.app, ["convert", str(good), str(tmp_path / "new"), "--revision", "v2",
                                          "--kv-lora-rank", "0"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and f"--revision v2: {good} is a local folder" in text
    assert "--kv-lora-rank 0: must be positive" in text and not (tmp_path / "new").exists(), text

    # a hub id is not downloaded to check it: the flags are refused at once, beside the local output's problems
    result = CliRunner().invoke(cli.app, ["convert", "no-such-owner/no-such-model", str(output), "--force"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "--force: acts only with --overwrite" in text and f"{output}: already exists" in text
    assert "no such model" not in text and "download" not in text, text


@pytest.mark.parametrize("args", [
    ["--overwrite", "--force"],
    ["--seed", "3", "--calib-temperature", "0.5", "--calib-top-p", "0.5"],
    ["--method", "input", "--refine-lr", "0.01"],
    ["--effort", "fast", "--refine-steps", "5", "--refine-lr", "0.01"],
    ["--method", "svd", "--refine-steps", "5", "--refine-lr", "0.01"],
    ["--calib-data", "corpus.jsonl", "--calib-text-column", "body"],
    ["--calib-data", "wikitext:wikitext-2-raw-v1:train", "--calib-text-column", "body"],
    ["--refine-steps", "5", "--calib-error-samples", "2"],
])
def test_the_same_flags_are_accepted_where_they_act(monkeypatch, args):
    assert isinstance(parsed_options(monkeypatch, ["src", "out", *args]), ConvertOptions)


def test_a_text_column_of_a_plain_text_is_refused(monkeypatch, tmp_path):
    """A plain text has no columns: the weights were identical with and without --calib-text-column."""
    from typer.testing import CliRunner

    import mla_convert.convert.pipeline as pipeline

    (tmp_path / "corpus.txt").write_text("words " * 100)
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "a.jsonl").write_text('{"body": "words"}\n')
    monkeypatch.setattr(pipeline, "convert", lambda *a, **k: pytest.fail("converted despite an ineffective flag"))
    result = CliRunner().invoke(cli.app, ["convert", "src", "out", "--calib-data", str(tmp_path / "corpus.txt"),
                                          "--calib-text-column", "body"])
    assert result.exit_code == 2 and ("--calib-text-column: acts only with --calib-data of .jsonl files, folders "
                                      "holding them, or a datasets spec") in " ".join(result.output.split())
    # the default column given explicitly asks for nothing different (eval and finetune accept it too)
    assert isinstance(parsed_options(monkeypatch, ["src", "out", "--calib-data", str(tmp_path / "corpus.txt"),
                                                   "--calib-text-column", "text"]), ConvertOptions)
    assert isinstance(parsed_options(monkeypatch, ["src", "out", "--calib-data", str(tmp_path / "rows"),
                                                   "--calib-text-column", "body"]), ConvertOptions)


def test_refinement_with_one_error_window_is_reported_off():
    """From the API (or --effort default with --calib-samples 1) the report said "16 steps per layer" and no layer
    refined: refinement needs one window to fit and another to judge on."""
    from mla_convert.convert.decisions import RefinePolicy
    from mla_convert.options import CalibrationOptions
    from mla_convert.source.config import SourceConfig

    source = SourceConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64,
                                     "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                                     "intermediate_size": 96, "max_position_embeddings": 128})
    for calibration in (CalibrationOptions(error_samples=1), CalibrationOptions(num_samples=1)):
        policy = RefinePolicy.of(ConvertOptions(refine_steps=5, calibration=calibration), source)
        assert policy.steps == 0 and policy.decision.startswith("off (refinement needs 2 error windows per layer; "
                                                                "this run keeps 1")
    assert RefinePolicy.of(ConvertOptions(refine_steps=5), source).steps == 5
    # a short --calib-data gave one window although --calib-samples asked for 16: the report said "5 steps (given)"
    assert RefinePolicy.of(ConvertOptions(refine_steps=5), source, windows=1).decision.startswith("off (refinement needs")


def test_sweep_refuses_a_flag_no_swept_method_uses(tmp_path):
    """sweep judged the flags against convert's default method, not against --methods."""
    from typer.testing import CliRunner

    def sweep(*args):
        result = CliRunner().invoke(cli.app, ["sweep", "src", "--data", str(tmp_path / "none.txt"), "--out-dir",
                                              str(tmp_path / "out"), *args])
        return result.exit_code, " ".join(result.output.split())

    code, output = sweep("--methods", "svd", "--kv-balance-search")
    assert code == 2 and "--kv-balance-search: acts only with the activation-aware method (convert: --method " \
        "activation-aware; sweep: in --methods)" in output
    code, output = sweep("--methods", "svd,activation-aware", "--kv-balance-search")  # acts for one of them
    assert "--kv-balance-search" not in output
    code, output = sweep("--license", "mit")
    assert code == 2 and "--license: acts only with --keep-models" in output
    assert not (tmp_path / "out").exists()
    assert "--calib-profile-samples" not in flags_of("convert") | flags_of("sweep")  # it did nothing; it is gone


def test_the_help_shows_each_choice_list():
    """`[choices: ...]` was read as rich markup and dropped from every --help."""
    from typer.testing import CliRunner

    result = CliRunner().invoke(cli.app, ["convert", "--help"], env={"COLUMNS": "250"}, terminal_width=250)
    text = " ".join(result.output.replace("│", " ").split())  # (the help is wrapped inside a box)
    assert "[choices: activation-aware, input, svd]" in text and "[choices: fast, default, thorough]" in text


@pytest.mark.parametrize("name", sorted(typer.main.get_command(cli.app).commands))
def test_each_help_names_only_flags_its_command_has(name):
    """sweep's --target help told users '--compression picks...', a flag sweep does not have."""
    import re

    flags = {opt for param in command(name).params for opt in getattr(param, "opts", []) + getattr(param, "secondary_opts", [])}
    named = {(param.name, flag) for param in command(name).params for flag in re.findall(r"--[a-z][a-z0-9-]*", getattr(param, "help", None) or "")}
    if name in {"convert", "sweep"}:
        assert named, "no help names a flag: the check reads nothing"
    assert {(param, flag) for param, flag in named if flag not in flags} == set()


def test_sweep_evaluates_where_device_says(monkeypatch, tmp_path):
    """`sweep --device cpu` passed no evaluation device, so on a GPU machine the models were scored on cuda while
    sweep.json recorded cpu."""
    from typer.testing import CliRunner

    import mla_convert.eval.sweep as sweep

    seen = {}

    def stand_in(*args, **kwargs):
        seen.update(kwargs)
        raise Received()

    monkeypatch.setattr(sweep, "run_sweep", stand_in)
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time. " * 50)
    result = CliRunner().invoke(cli.app, ["sweep", str(tmp_path / "source"), "--data", str(text), "--out-dir",
                                          str(tmp_path / "out"), "--device", "cpu"])
    assert isinstance(result.exception, Received), result.output
    assert seen["eval_device"] == "cpu"


def _number_flags(name: str) -> list[str]:
    """The long flags of command NAME that take an int or a float."""
    from mla_convert.number_flags import number_kind

    return [param.opts[0] for param in command(name).params
            if isinstance(param, typer.core.TyperOption) and number_kind(param.type_descriptor.annotation) is not None]


def _arguments_besides_flags(name: str, tmp_path) -> tuple[list[str], list[str]]:
    """Command NAME's positional arguments and required options, pointing into tmp_path (nothing there exists)."""
    positional = {"convert": [str(tmp_path / "src"), str(tmp_path / "out")], "sweep": [str(tmp_path / "src")],
                  "eval": [str(tmp_path / "src")], "generate": [str(tmp_path / "src"), "hi"],
                  "inspect": [str(tmp_path / "src")], "push": [str(tmp_path / "src"), "me/model"]}.get(name, [])
    required = {"sweep": ["--data", "t.txt", "--out-dir", str(tmp_path / "sw")], "eval": ["--data", "t.txt"]}.get(name, [])
    return positional, required


@pytest.mark.parametrize("name", sorted(typer.main.get_command(cli.app).commands))
def test_every_number_flag_refuses_text_as_one_error_line(name, tmp_path):
    """typer printed a usage box for the first flag it could not convert and said nothing of the rest."""
    from typer.testing import CliRunner

    flags = _number_flags(name)
    if name in {"convert", "sweep", "eval", "generate", "inspect", "demo"}:
        assert flags, "no number flag found: the check reads nothing"
    positional, required = _arguments_besides_flags(name, tmp_path)
    for flag in flags:
        result = CliRunner().invoke(cli.app, [name, *positional, *required, flag, "1.5x"])
        assert result.exit_code == 2 and "Traceback" not in result.output, (flag, result.output)
        assert result.output.count(f"error: {flag}: '1.5x' is not ") == 1, (flag, result.output)
    assert not any(tmp_path.iterdir()), "a refused run wrote something"


def _float_flags(name: str) -> list[str]:
    """The long flags of command NAME that take a float."""
    from mla_convert.number_flags import number_kind

    return [param.opts[0] for param in command(name).params
            if isinstance(param, typer.core.TyperOption) and number_kind(param.type_descriptor.annotation) is float]


@pytest.mark.parametrize("name", sorted(typer.main.get_command(cli.app).commands))
def test_every_float_flag_refuses_nan_and_infinity_as_typed(name, tmp_path):
    """`inspect -c 1e309` said "--compression inf: must be a finite number": float() reads nan, inf and numbers beyond
    its range as floats, and the checks after parsing echoed the parsed value, not what was typed."""
    from typer.testing import CliRunner

    flags = _float_flags(name)
    if name in {"convert", "sweep", "generate", "inspect", "demo"}:
        assert flags, "no float flag found: the check reads nothing"
    positional, required = _arguments_besides_flags(name, tmp_path)
    for flag in flags:
        for typed in ("1e309", "nan", "-inf"):
            result = CliRunner().invoke(cli.app, [name, *positional, *required, f"{flag}={typed}"])
            assert result.exit_code == 2 and "Traceback" not in result.output, (flag, typed, result.output)
            assert result.output.count(f"error: {flag}: '{typed}' is not a finite number") == 1, (flag, typed, result.output)
            assert " inf" not in result.output and " nan:" not in result.output, (flag, typed, result.output)
    assert not any(tmp_path.iterdir()), "a refused run wrote something"


def test_only_a_single_int_or_float_is_a_number_flag():
    """A list of numbers is not one number: a scalar parser would have read `--x 1 --x 2` wrongly."""
    from typing import Optional

    from mla_convert.number_flags import number_kind

    assert [number_kind(kind) for kind in (int, float, Optional[int], float | None)] == [int, float, int, float]
    assert [number_kind(kind) for kind in (bool, str, list[int], Optional[str], tuple[float, float])] == [None] * 5


def test_number_flags_that_are_not_numbers_are_listed_with_every_other_problem(tmp_path):
    """`convert -r abc` stopped there: the ineffective --seed, the missing --calib-data file and the existing output
    came one run later each."""
    from tiny_models import save_tiny_model
    from typer.testing import CliRunner

    source = save_tiny_model(tmp_path / "src", num_layers=1)
    output = tmp_path / "out"
    output.mkdir()
    result = CliRunner().invoke(cli.app, ["convert", str(source), str(output), "-r", "abc", "--calib-top-p", "high",
                                          "--seed", "3", "--calib-data", str(tmp_path / "missing.txt"), "--calib-chunk", "2.0"])
    lines = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.exit_code == 2 and lines[:3] == ["error: --kv-lora-rank: 'abc' is not an integer",
                                                   "error: --calib-top-p: 'high' is not a number",
                                                   "error: --calib-chunk: '2.0' is not an integer"], result.output
    text = " ".join(result.output.split())
    assert "--seed: acts only with" in text and "missing.txt" in text and f"{output}: already exists" in text, text
    assert "--calib-top-p: acts only" not in text  # refused as no number: not also "cannot act"
    assert not any(output.iterdir())

    # with the command's own problems: eval's and generate's pre-flight, sweep's
    result = CliRunner().invoke(cli.app, ["eval", str(source), "--data", "t.txt", "--context", "k", "--stride", "0"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "--context: 'k' is not an integer" in text and "--stride" in text.split("integer", 1)[1], text
    result = CliRunner().invoke(cli.app, ["generate", str(source), "hi", "--max-new-tokens", "many"])
    text = " ".join(result.output.split())
    assert "--max-new-tokens: 'many' is not an integer" in text and "not a model written by `mla-convert convert`" in text, text
    result = CliRunner().invoke(cli.app, ["sweep", str(source), "--data", "t.txt", "--out-dir", str(tmp_path / "sw"),
                                          "--context", "k", "--ratios", "0.5"])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "--context: 'k' is not an integer" in text and "--ratios" in text, text

    # the help still shows the flags' types
    help_text = CliRunner().invoke(cli.app, ["convert", "--help"], terminal_width=250).output
    assert "<int>" in help_text and "<float>" in help_text
