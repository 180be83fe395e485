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

    def stand_in(source, output, options, progress=None, command=None):
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
    # and replaces only the models it kept itself: no flag to replace anything else
    assert {"--overwrite", "--force"}.isdisjoint(sweep_flags)


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
    ({"calibration": CalibrationOptions(num_samples=True)}, "--calib-samples True: must be int"),
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
    (["--method", "svd", "--no-kv-balance-search"], "--kv-balance-search: acts only with --method activation-aware"),
    (["--refine-steps", "0", "--refine-lr", "0.01"], "--refine-lr: acts only with layer refinement"),
    (["--effort", "fast", "--refine-lr", "0.01"], "--refine-lr: acts only with layer refinement"),
    (["--method", "svd", "--refine-lr", "0.01"], "--refine-lr: acts only with layer refinement"),
])
def test_a_flag_that_cannot_act_with_the_others_is_refused_not_ignored(monkeypatch, args, message):
    """These were accepted and changed nothing (e.g. --seed with --calib-data: the text is read, not sampled)."""
    from typer.testing import CliRunner

    import mla_convert.convert.pipeline as pipeline

    monkeypatch.setattr(pipeline, "convert", lambda *a, **k: pytest.fail("converted despite an ineffective flag"))
    result = CliRunner().invoke(cli.app, ["convert", "src", "out", *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


@pytest.mark.parametrize("args", [
    ["--overwrite", "--force"],
    ["--seed", "3", "--calib-temperature", "0.5", "--calib-top-p", "0.5"],
    ["--method", "input", "--refine-lr", "0.01"],
    ["--effort", "fast", "--refine-steps", "5", "--refine-lr", "0.01"],
    ["--method", "svd", "--refine-steps", "5", "--refine-lr", "0.01"],
])
def test_the_same_flags_are_accepted_where_they_act(monkeypatch, args):
    assert isinstance(parsed_options(monkeypatch, ["src", "out", *args]), ConvertOptions)
