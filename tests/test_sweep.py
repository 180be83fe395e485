"""`run_sweep`: one calibration, several (ratio, method) conversions, each scored on the same windows.

Plumbing on a tiny random Llama with a character-level tokenizer built here; the quality claims and the
agreement with `eval` on stories260K.  Every number a sweep reports is checked against something
computed independently: cache sizes against the shapes' arithmetic, perplexities against `run_eval`
on the same windows, the one calibration pass against the converter's statistics store.
"""

from __future__ import annotations

import csv
import json
import math
import re
import string
from pathlib import Path

import pytest
import torch
from PIL import Image
from tiny_models import pickled_copy, save_tiny_model

from mla_convert.convert.decisions import Progress
from mla_convert.errors import MLAConvertError, PreflightError
from mla_convert.eval.perplexity import PerplexityResult, run_eval
from mla_convert.eval.sweep import (
    PLOT_DPI,
    PLOT_SIZE_INCHES,
    SweepError,
    SweepPoint,
    SweepResult,
    canonical_methods,
    load_sweep,
    parse_ratios,
    plot_title,
    run_sweep,
)
from mla_convert.options import CalibrationOptions

EXPECTED_PNG_SIZE = (round(PLOT_SIZE_INCHES[0] * PLOT_DPI), round(PLOT_SIZE_INCHES[1] * PLOT_DPI))
TINY_CALIBRATION = CalibrationOptions(num_samples=2, seq_len=32, error_samples=2)


# --------------------------------------------------------------------------- fixtures
def save_char_tokenizer(folder: Path) -> None:
    """A character-level fast tokenizer (ids 4.. = printable ASCII) so a random model can read text."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for char in string.printable:
        vocab.setdefault(char, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        pad_token="<pad>")
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory) -> Path:
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny") / "src", seed=3, weight_scale=4.0)
    save_char_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory) -> Path:
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "away", "home", "quickly"]
    text = " ".join(words[(i * 7 + i // 3) % len(words)] for i in range(400)) + ".\n"
    path = tmp_path_factory.mktemp("text") / "tiny.txt"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def tiny_sweep(tiny_source, tiny_text, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep-out")
    scratch = tmp_path_factory.mktemp("sweep-scratch")
    phases = PhaseRecorder()
    result = run_sweep(tiny_source, "4,2", tiny_text, out, context_length=64, max_windows=3,
                       calibration=TINY_CALIBRATION, models_dir=scratch, model_name="tiny-llama", progress=phases)
    result.recorded_phases = phases.names
    return result, out, scratch


class PhaseRecorder(Progress):
    """The phases the library announced, in order (what the CLI turns into progress bars)."""

    def __init__(self):
        self.names: list[str] = []

    def phase(self, name: str, total: int | None = None) -> None:
        self.names.append(name)


# --------------------------------------------------------------------------- settings
def test_ratios_and_methods_are_parsed_or_refused_in_one_line():
    assert parse_ratios("8, 2,4,2") == [2.0, 4.0, 8.0]
    assert parse_ratios("1.5x 3") == [1.5, 3.0]
    assert parse_ratios([4, 2]) == [2.0, 4.0]
    for bad in ("2,abc", "0.5", "", "nan"):
        with pytest.raises(SweepError) as error:
            parse_ratios(bad)
        assert "\n" not in str(error.value)
    # nan, inf and a number beyond float's range are refused as typed (`2,1e309` said "--ratios: inf: ... at least 1")
    for typed in ("nan", "inf", "1e309", "-inf"):
        with pytest.raises(SweepError) as error:
            parse_ratios(f"2,{typed}")
        assert str(error.value) == f"--ratios '2,{typed}': '{typed}' is not a finite number; write e.g. 2,4,8"
    assert canonical_methods("svd,activation-aware,weight") == ["weight", "output"]
    with pytest.raises(SweepError, match="not a method"):
        canonical_methods(["activation-aware", "pca"])
    # from the Python API (found by the API/sweep probe): one number is one ratio (it was "'int' object is not
    # iterable"); a word in a list is named (it was float's ValueError)
    assert parse_ratios(2) == [2.0] and parse_ratios(["2", 4.5]) == [2.0, 4.5]
    for bad, message in [(["2", "x"], "--ratios ['2', 'x']: 'x' is not a number; give numbers, e.g. [2, 4, 8] or '2,4,8'"),
                         (None, "--ratios None: give numbers, e.g. [2, 4, 8] or '2,4,8'")]:
        with pytest.raises(SweepError) as error:
            parse_ratios(bad)
        assert str(error.value) == message
    with pytest.raises(SweepError, match=r"^--methods 3: give method names"):
        canonical_methods(3)


def test_impossible_ratio_is_refused_before_any_work(tiny_source, tiny_text, tmp_path):
    # the tiny source caches 2 x 2 kv heads x 16 = 64 values per token and layer: 64 / 100 leaves < 3
    with pytest.raises(PreflightError, match="^--ratios 100: ") as refused:  # (it named convert's --compression)
        run_sweep(tiny_source, [2, 100], tiny_text, tmp_path / "out", context_length=64, max_windows=2,
                  calibration=TINY_CALIBRATION)
    assert "--compression" not in str(refused.value)
    assert not (tmp_path / "out").exists()  # nothing measured, nothing written


def test_every_problem_is_reported_in_one_run(tiny_source, tiny_text, tmp_path):
    """A sweep reported one problem per run, and a context beyond the positions as a SweepError after the others
    (README: PreflightError): a user with four mistakes ran it four times."""
    with open(tiny_source / "config.json") as file:
        positions = json.load(file)["max_position_embeddings"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "sweep.md").write_text("an earlier sweep")
    with pytest.raises(PreflightError) as refused:
        run_sweep(tiny_source, "2,abc", tiny_text, out, methods="svd,pca", context_length=positions + 1,
                  batch_size=0, calibration=TINY_CALIBRATION, caller_problems=["--license: acts only with --keep-models"])
    problems = refused.value.problems
    assert problems[0] == "--license: acts only with --keep-models" and len(problems) == 6, problems
    for start in ("--ratios '2,abc'", "--methods: 'pca'", "--batch-size 0", f"--out-dir {out}: holds an earlier",
                  f"--context {positions + 1}: longer than the model's max_position_embeddings ({positions})"):
        assert sum(problem.startswith(start) for problem in problems) == 1, (start, problems)
    # the planned exports' pre-flight joins them: an impossible ratio beside the context
    with pytest.raises(PreflightError) as refused:
        run_sweep(tiny_source, [2, 100], tiny_text, tmp_path / "new", context_length=positions + 1,
                  calibration=TINY_CALIBRATION)
    assert [problem.split(":")[0] for problem in refused.value.problems] == [f"--context {positions + 1}", "--ratios 100"]
    assert (out / "sweep.md").read_text() == "an earlier sweep" and not (tmp_path / "new").exists()
    # a --models-dir that is not there is one of the problems (the scratch folder was made in it: a traceback)
    with pytest.raises(PreflightError) as refused:
        run_sweep(tiny_source, "2", tiny_text, None, models_dir=tmp_path / "nope", context_length=positions + 1,
                  calibration=TINY_CALIBRATION)
    assert [problem.split(":")[0] for problem in refused.value.problems] == [f"--models-dir {tmp_path / 'nope'}",
                                                                             f"--context {positions + 1}"]


@pytest.mark.parametrize("settings, message", [
    (dict(eval_dtype="fp16"), "eval_dtype fp16: fp16 cannot hold"),  # scored the underflow: 124.8 vs 108.6 in fp32
] + ([] if torch.cuda.is_available() else [(dict(eval_device="cuda"), "--device cuda: no CUDA device")]))
def test_evaluation_settings_are_refused_before_any_work(tiny_source, tiny_text, tmp_path, settings, message):
    with pytest.raises(PreflightError, match=message):
        run_sweep(tiny_source, [2], tiny_text, tmp_path / "out", context_length=64, max_windows=2,
                  calibration=TINY_CALIBRATION, **settings)
    assert not (tmp_path / "out").exists()


def test_a_misspelled_target_is_refused_before_any_work(tiny_source, tiny_text, tmp_path):
    """`--target foo` (or `vLLM`) was a KeyError traceback from `target_of`, raised by the eval-dtype check before the
    settings were validated (found by the API/sweep probe)."""
    from mla_convert.options import ConvertOptions

    message = "--target 'foo': choose one of transformers, vllm, llama.cpp, all"
    with pytest.raises(PreflightError) as refused:
        run_sweep(tiny_source, [2], tiny_text, tmp_path / "out", context_length=64, calibration=TINY_CALIBRATION,
                  options=ConvertOptions(target="foo"))
    assert refused.value.problems == [message]
    run = _cli_sweep(tiny_source, "--data", tiny_text, "--out-dir", tmp_path / "out", "--target", "foo", "--ratios", "2")
    assert run.exit_code == 2 and run.stderr.splitlines() == [f"error: {message}"], run.output
    assert not (tmp_path / "out").exists()


def test_kept_models_without_a_place_are_refused_before_any_work(tiny_source, tiny_text):
    """run_sweep(keep_models=True) with neither out_dir nor models_dir was a TypeError (Path(None)) for a local source;
    the problem was collected but raised early only for a hub source (found by the API/sweep probe)."""
    with pytest.raises(PreflightError) as refused:
        run_sweep(tiny_source, "2", tiny_text, keep_models=True, context_length=64, calibration=TINY_CALIBRATION)
    assert refused.value.problems == ["--keep-models: say where to keep them (an output folder or a models folder)"]


def test_api_arguments_of_the_wrong_type_are_refused_naming_the_parameter(tiny_source, tiny_text, tmp_path):
    """options={...}, context_length="64" and the like failed deep inside (found by the API/sweep probe)."""
    with pytest.raises(PreflightError) as refused:
        run_sweep(tiny_source, [2], tiny_text, tmp_path / "out", options={"compression": 2}, context_length="64")
    assert refused.value.problems == ["options {'compression': 2}: must be ConvertOptions or None",
                                      "context_length '64': must be int or None"]
    assert not (tmp_path / "out").exists()


def test_numpy_numbers_are_numbers_to_the_api():
    """The type checks added for the API refused numpy's numbers (np.arange(2, 9) as ratios, np.int64(512) as a
    context length), which the API took before (found by the review of the API fixes)."""
    import numpy as np

    from mla_convert.options import argument_problems, int_argument

    assert parse_ratios(np.array([2, 4])) == [2.0, 4.0] == parse_ratios([np.int64(4), np.float32(2)])
    assert parse_ratios(np.int64(2)) == [2.0]
    assert argument_problems(context_length=int_argument(np.int64(512)), batch_size=int_argument(np.int32(2), False)) == []
    assert argument_problems(context_length=int_argument(512.0)) == ["context_length 512.0: must be int or None"]


def test_a_stem_with_a_folder_in_it_is_refused(tiny_source, tiny_text, tmp_path):
    """stem="../escape" wrote escape.md etc. beside out_dir, outside it (found by the API/sweep probe)."""
    with pytest.raises(PreflightError) as refused:
        run_sweep(tiny_source, [2], tiny_text, tmp_path / "out", stem="../escape", context_length=64,
                  calibration=TINY_CALIBRATION, methods=["svd"])
    assert refused.value.problems == ["stem '../escape': must be a plain file name (the results are <stem>.md, .csv, "
                                      ".json and .png in out_dir)"]
    assert sorted(path.name for path in tmp_path.iterdir()) == []
    with pytest.raises(PreflightError, match=re.escape(f"stem {'a' + chr(0) + 'b'!r}: must be a plain file name")):
        run_sweep(tiny_source, [2], tiny_text, tmp_path / "out", stem="a\0b", context_length=64,
                  calibration=TINY_CALIBRATION, methods=["svd"])


def test_an_empty_data_spec_is_refused_before_any_work(tiny_source, tmp_path, monkeypatch):
    """`--data ""` was the current folder: sweep scored every .txt/.md in it."""
    (tmp_path / "notes.md").write_text("not evaluation text " * 200, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PreflightError, match="^--data: must not be empty"):
        run_sweep(tiny_source, [2], "", tmp_path / "out", context_length=64, max_windows=2, calibration=TINY_CALIBRATION)
    assert not (tmp_path / "out").exists()


def test_a_note_every_conversion_repeats_is_shown_once(tmp_path, tiny_text):
    """The source's norm-epsilon note was printed once per conversion (6 times in a 3-ratio, 2-method sweep)."""
    from mla_convert.convert.decisions import Progress

    class Recorder(Progress):
        def __init__(self):
            self.messages = []

        def message(self, text):
            self.messages.append(text)

    source = save_tiny_model(tmp_path / "src", seed=3, weight_scale=4.0, rms_norm_eps=1e-5)
    save_char_tokenizer(source)
    recorder = Recorder()
    run_sweep(source, [2, 4], tiny_text, tmp_path / "out", context_length=64, max_windows=2, methods=["svd"],
              calibration=TINY_CALIBRATION, progress=recorder)
    notes = [text for text in recorder.messages if text.startswith("note: every RMSNorm")]
    assert len(notes) == 1, recorder.messages


def test_missing_calibration_text_is_refused_before_any_work(tiny_source, tiny_text, tmp_path):
    with pytest.raises(MLAConvertError, match="no-such-calibration.txt"):
        run_sweep(tiny_source, [2], tiny_text, tmp_path / "out", context_length=64, max_windows=2,
                  calibration=CalibrationOptions(data=str(tmp_path / "no-such-calibration.txt"), num_samples=2, seq_len=32))
    assert not (tmp_path / "out").exists()


def test_context_longer_than_the_model_is_a_user_error(tiny_source, tiny_text, tmp_path):
    with pytest.raises(MLAConvertError, match="max_position_embeddings"):
        run_sweep(tiny_source, [2], tiny_text, tmp_path / "out", context_length=4096, calibration=TINY_CALIBRATION)


def test_default_context_is_capped_by_the_source_like_eval(tmp_path, tiny_text):
    """Without --context a sweep scores windows of min(1024, max_position_embeddings): a 96-position model sweeps
    (it used to be refused unless the user found --context), and the table says which context it used."""
    source = save_tiny_model(tmp_path / "short", seed=3, weight_scale=4.0, max_position_embeddings=96)
    save_char_tokenizer(source)
    result = run_sweep(source, [2], tiny_text, tmp_path / "out", max_windows=2, methods="svd",
                       calibration=TINY_CALIBRATION)
    assert result.context_length == 96
    assert [point.result.num_scored_tokens for point in result.points] == [2 * 95]  # the 2x point: 2 windows of 96
    assert "windows of 96 tokens" in (tmp_path / "out" / "sweep.md").read_text()


# --------------------------------------------------------------------------- a tiny sweep end to end
def test_one_row_per_ratio_and_method_plus_the_source(tiny_sweep):
    result, out, _ = tiny_sweep
    rows = result.rows()
    assert [r["model"] for r in rows] == ["source", "activation-aware 2x", "weight-only SVD 2x",
                                          "activation-aware 4x", "weight-only SVD 4x"]
    assert all(math.isfinite(r["perplexity"]) and r["perplexity"] > 1 for r in rows)
    with open(out / "sweep.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert [r["model"] for r in table] == [r["model"] for r in rows]
    assert [float(r["perplexity"]) for r in table] == pytest.approx([r["perplexity"] for r in rows], rel=1e-12)
    markdown = (out / "sweep.md").read_text()
    assert markdown.count("\n| ") == 1 + len(rows)  # header + one line per model
    assert "| **source** |" in markdown and "weight-only SVD 4x" in markdown


def test_cache_sizes_are_the_requested_ratio_smaller(tiny_sweep):
    result, _, _ = tiny_sweep
    source = result.rows()[0]
    assert source["values_per_token_layer"] == 2 * 2 * 16 and source["actual_ratio"] == 1.0
    assert source["bytes_per_token"] == 64 * 2 * 4  # 2 layers, float32
    for row in result.rows()[1:]:
        assert row["values_per_token_layer"] == row["kv_lora_rank"] + row["rope_dim"]
        # rounding to whole cached values only: within half a value per layer of source / ratio
        assert abs(row["values_per_token_layer"] - 64 / row["requested_ratio"]) <= 0.5
        assert row["bytes_per_token"] * row["requested_ratio"] == pytest.approx(source["bytes_per_token"], abs=2 * 4 * row["requested_ratio"])
        assert row["values_per_token"] == row["values_per_token_layer"] * 2


def test_calibration_runs_once_for_every_export(tiny_sweep):
    result, _, _ = tiny_sweep
    ids = {p.calibration_id for p in result.points}
    assert None not in ids and len(ids) == 1  # every export read the same statistics store
    # the layer-streamed statistics pass ran once, while every (ratio, method) point converted its layers
    conversions = len([p for p in result.points if not p.is_source])
    assert conversions == 4
    assert result.recorded_phases.count("calibration statistics") == 1
    assert result.recorded_phases.count("converting layers") == conversions
    assert result.calibration["tokens"] == TINY_CALIBRATION.num_samples * TINY_CALIBRATION.seq_len


def test_source_row_is_what_eval_reports_on_the_same_windows(tiny_sweep, tiny_source, tiny_text):
    result, _, _ = tiny_sweep
    report = run_eval(tiny_source, tiny_text, context_length=64, max_windows=3, progress=False)
    (direct,) = report.results.values()
    assert result.source_point.result.nll_sum == pytest.approx(direct.nll_sum, rel=1e-9)
    assert result.source_point.result.num_scored_tokens == direct.num_scored_tokens == 3 * 63


def test_png_is_a_plot_of_the_expected_size(tiny_sweep):
    _, out, _ = tiny_sweep
    with Image.open(out / "sweep.png") as image:
        image.verify()
    with Image.open(out / "sweep.png") as image:
        assert image.format == "PNG" and image.size == EXPECTED_PNG_SIZE
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert len(colours) > 50  # drawn curves, text and antialiasing, not a blank canvas


def test_converted_folders_are_deleted_after_scoring(tiny_sweep):
    result, out, scratch = tiny_sweep
    assert not any(scratch.iterdir())
    assert all(p.model_path is None for p in result.points)
    assert not (out / "models").exists()


def test_kept_model_scores_what_the_sweep_reported(tiny_source, tiny_text, tmp_path):
    result = run_sweep(tiny_source, [2], tiny_text, tmp_path / "out", context_length=64, max_windows=2,
                       methods=["svd"], calibration=TINY_CALIBRATION, keep_models=True)
    (point,) = result.points
    from mla_convert.eval.sweep import top_axis_label

    assert top_axis_label(result) == "KV-cache compression vs the source"  # one dtype: bytes and values agree
    kept = Path(point.model_path)
    assert kept == tmp_path / "out" / "models" / "svd-2x" and (kept / "config.json").exists()
    report = run_eval(kept, tiny_text, context_length=64, max_windows=2, progress=False)
    assert next(iter(report.results.values())).perplexity == pytest.approx(point.perplexity, rel=1e-9)

    # a second sweep into the same folder replaces the model the first one kept, nothing else
    marker = kept / "left-by-the-first-sweep"
    marker.write_text("")
    (again,) = run_sweep(tiny_source, [2], tiny_text, tmp_path / "out", context_length=64, max_windows=2,
                         methods=["svd"], calibration=TINY_CALIBRATION, keep_models=True, overwrite=True).points
    assert again.ok and not marker.exists() and (kept / "config.json").exists()


def test_a_ratio_that_gets_an_earlier_ratios_shape_is_not_converted_again(tiny_source, tiny_text, tmp_path):
    """8x and 8.4x both give 4+4 on this source (a serving target rounds more ratios together): the sweep used to
    convert and evaluate the same model twice and show two rows without a word."""
    result = run_sweep(tiny_source, [8, 8.4], tiny_text, tmp_path / "out", context_length=64, max_windows=2,
                       methods=["svd"], calibration=TINY_CALIBRATION, keep_models=True)
    first, second = result.points
    assert (first.kv_lora_rank, first.rope_dim) == (second.kv_lora_rank, second.rope_dim) == (4, 4)
    assert first.same_shape_as is None and second.same_shape_as == 8 and second.requested_ratio == 8.4
    assert second.perplexity == first.perplexity and second.model_path == first.model_path
    assert (second.convert_seconds, second.eval_seconds) == (None, None)  # no time was spent on it
    assert result.conversions == 1 and not (tmp_path / "out" / "models" / "svd-8.4x").exists()
    markdown = result.files.markdown.read_text()
    assert "weight-only SVD 8.4x (the 8x model)" in markdown and "shared by 1 conversion." in markdown
    assert "1 requested ratio got the shape of a smaller one" in markdown
    assert load_sweep(result.files.json).points[1].same_shape_as == 8


@pytest.mark.parametrize("occupant", ["folder", "link to a kept model"])
def test_a_kept_models_place_held_by_something_else_is_refused_before_any_work(tiny_source, tiny_text, tmp_path,
                                                                               occupant):
    place = tmp_path / "out" / "models" / "svd-2x"
    place.parent.mkdir(parents=True)
    if occupant == "folder":
        place.mkdir()
        (place / "notes.txt").write_text("mine")
    else:
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "mla_convert.json").write_text("{}")
        place.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(PreflightError) as refused:
        run_sweep(tiny_source, [2], tiny_text, tmp_path / "out", context_length=64, max_windows=2,
                  methods=["svd"], calibration=TINY_CALIBRATION, keep_models=True)
    message = str(refused.value)
    assert str(place) in message and "earlier sweep" in message
    assert "--overwrite" not in message  # sweep has no such flag
    assert not (tmp_path / "out" / "sweep.json").exists()
    if occupant == "folder":
        assert (place / "notes.txt").read_text() == "mine"
    else:
        assert place.is_symlink() and (tmp_path / "elsewhere" / "mla_convert.json").exists()


# --------------------------------------------------------------------------- tables and plot without models
def _fake_result(perplexities: dict[tuple[str, float], float | None]) -> SweepResult:
    def ppl(value: float) -> PerplexityResult:
        return PerplexityResult(math.log(value) * 100, 100, 2, 102, 400, 80, 51, 51)

    source = SweepPoint("source", None, None, None, 384, ppl(10.0))
    points = []
    for (method, ratio), value in perplexities.items():
        values = round(384 / ratio)
        points.append(SweepPoint(method, ratio, values - 16, 16, values, None if value is None else ppl(value),
                                 error=None if value is not None else "converted layer 3: NaN", calibration_id="s"))
    return SweepResult("fake-model", "fake", "wiki.txt", 30, "GQA", "bfloat16", 51, 2, source, points,
                       {"description": "8 x 64 tokens"})


def test_the_plot_title_counts_the_windows_as_sweep_md_does():
    """The title said "31 x 512-token windows" where sweep.md said "30 ... of 512 tokens and 1 of 177" (found by the
    API/sweep probe)."""
    import dataclasses

    result = _fake_result({("output", 2): 11.0})
    scored = dataclasses.replace(result.source_point.result, num_windows=31, num_tokens=30 * 512 + 177, context_length=512)
    result = dataclasses.replace(result, context_length=512,
                                 source_point=dataclasses.replace(result.source_point, result=scored))
    assert plot_title(result) == "fake-model: perplexity vs KV-cache size\nwiki.txt, 30 x 512-token windows and 1 of 177 tokens"
    assert "30 non-overlapping windows of 512 tokens and 1 of 177" in result.describe_protocol()


def test_failed_point_is_reported_not_plotted(tmp_path):
    result = _fake_result({("output", 2): 11.0, ("weight", 2): 15.0, ("output", 8): 40.0, ("weight", 8): None})
    files = result.save(tmp_path, stem="fake")
    markdown = files.markdown.read_text()
    assert "failed: converted layer 3: NaN" in markdown
    rows = {r["model"]: r for r in result.rows()}
    assert rows["weight-only SVD 8x"]["error"] == "converted layer 3: NaN"
    assert rows["source"]["bytes_per_token"] == 384 * 30 * 2  # bf16
    assert rows["activation-aware 8x"]["actual_ratio"] == pytest.approx(8.0)
    assert rows["activation-aware 2x"]["perplexity_ratio"] == pytest.approx(1.1)
    with Image.open(files.png) as image:
        assert image.size == EXPECTED_PNG_SIZE
    reloaded = load_sweep(files.json)  # JSON keeps everything: a plot can be redrawn without rerunning
    assert reloaded.csv_text() == result.csv_text() and reloaded.markdown() == result.markdown()


def test_a_reloaded_sweep_names_its_local_text_by_file_name(tmp_path):
    """The JSON writes paths portably ($TMPDIR/...); reloaded, the protocol sentence showed that path, not the name."""
    import dataclasses

    result = dataclasses.replace(_fake_result({("output", 2): 11.0}), data=str(tmp_path / "texts" / "wiki.txt"))
    files = result.save(tmp_path, stem="fake")
    sentence = load_sweep(files.json).describe_protocol()
    assert sentence.startswith("Perplexity on `wiki.txt`:"), sentence
    assert dataclasses.replace(result, data="wikitext:wikitext-2-raw-v1:test").describe_protocol().startswith(
        "Perplexity on `wikitext:wikitext-2-raw-v1:test`:")


# --------------------------------------------------------------------------- stories260K
@pytest.mark.real_model
def test_stories260k_sweep(stories260k, tinystories_text, tmp_path):
    result = run_sweep(stories260k, "2,8", tinystories_text, tmp_path / "out", context_length=128, max_windows=4,
                       calibration=CalibrationOptions(num_samples=4, seq_len=64),
                       keep_models=True)
    rows = {r["model"]: r for r in result.rows()}
    assert list(rows) == ["source", "activation-aware 2x", "weight-only SVD 2x", "activation-aware 8x", "weight-only SVD 8x"]
    # stories260K: 4 kv heads x head_dim 8 -> 64 values per token and layer, 5 layers, float32
    assert rows["source"]["bytes_per_token"] == 64 * 5 * 4
    assert rows["activation-aware 2x"]["bytes_per_token"] == 32 * 5 * 4
    assert rows["weight-only SVD 8x"]["bytes_per_token"] == 8 * 5 * 4
    source_ppl = rows["source"]["perplexity"]
    assert 1 < source_ppl < 20
    for label, row in rows.items():
        assert math.isfinite(row["perplexity"])
        if label != "source":
            assert row["perplexity"] > source_ppl  # halving the cache without training never helps
    # the project's claim: calibrated factorization beats weight-only SVD at the same cache size
    assert rows["activation-aware 2x"]["perplexity"] < rows["weight-only SVD 2x"]["perplexity"]
    assert result.calibration_passes == 1
    kept = tmp_path / "out" / "models" / "activation-aware-2x"
    report = run_eval(kept, tinystories_text, context_length=128, max_windows=4, progress=False)
    assert next(iter(report.results.values())).perplexity == pytest.approx(rows["activation-aware 2x"]["perplexity"], rel=1e-9)
    with Image.open(tmp_path / "out" / "sweep.png") as image:
        assert image.size == EXPECTED_PNG_SIZE


@pytest.mark.slow
def test_a_killed_sweep_removes_its_scratch_models(tiny_source, tiny_text, tmp_path):
    """SIGTERM (kill, `timeout`) used to end a sweep without cleanup: a full converted model stayed in the temp folder."""
    import os
    import signal
    import subprocess
    import sys
    import time

    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch_root)}
    command = [sys.executable, "-m", "mla_convert", "sweep", str(tiny_source), "--data", str(tiny_text), "--out-dir",
               str(tmp_path / "out"), "--ratios", ",".join(f"{2 + r / 10:g}" for r in range(150)), "--methods", "svd",
               "--context", "64", "--max-windows", "2", "--calib-samples", "2", "--calib-seq-len", "32", "-q"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and not list(scratch_root.glob("mla-convert-sweep-*/svd-*")):
        assert process.poll() is None, process.stderr.read()[-2000:]
        time.sleep(0.05)
    assert list(scratch_root.glob("mla-convert-sweep-*/svd-*")), "the sweep never started a conversion"
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode != 0 and "Traceback" not in err
    assert not list(scratch_root.glob("mla-convert-sweep-*")), sorted(p.name for p in scratch_root.iterdir())


@pytest.mark.slow
def test_a_sigkilled_sweeps_models_folder_is_removed_by_the_next_sweep(tiny_source, tiny_text, tmp_path, monkeypatch):
    """SIGKILL left `mla-convert-sweep-*` (converted models) in the temp folder forever: the leftover cleaner knew only
    the statistics folders, and the sweep's folder had no owner lock (found by the API/sweep probe)."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    command = [sys.executable, "-m", "mla_convert", "sweep", str(tiny_source), "--data", str(tiny_text), "--out-dir",
               str(tmp_path / "killed"), "--ratios", ",".join(f"{2 + r / 10:g}" for r in range(150)), "--methods", "svd",
               "--context", "64", "--max-windows", "2", "--calib-samples", "2", "--calib-seq-len", "32", "-q"]
    process = subprocess.Popen(command, env={**os.environ, "TMPDIR": str(scratch_root)}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and not list(scratch_root.glob("mla-convert-sweep-*/svd-*")):
        assert process.poll() is None, process.stderr.read()[-2000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    [left] = scratch_root.glob("mla-convert-sweep-*")
    monkeypatch.setattr(tempfile, "tempdir", str(scratch_root))
    messages = _Messages()
    run_sweep(tiny_source, [2], tiny_text, None, context_length=64, max_windows=1, methods=["svd"],
              calibration=TINY_CALIBRATION, progress=messages)
    assert list(scratch_root.iterdir()) == []
    assert f"removed {left.name}, left behind in {scratch_root} by an interrupted run" in messages.seen


def test_the_statistics_estimate_is_said_once_for_one_calibration(tiny_source, tiny_text, tmp_path):
    """Each point's disk line repeated "calibration statistics about ... in /tmp", which are computed (and need room)
    once (found by the API/sweep probe)."""
    messages = _Messages()
    run_sweep(tiny_source, [2, 4], tiny_text, None, context_length=64, max_windows=1, methods=["svd"],
              calibration=TINY_CALIBRATION, progress=messages)
    disk = [text for text in messages.seen if text.startswith("disk: ")]
    assert len(disk) == 3 and [("calibration statistics about" in text) for text in disk] == [True, False, False], disk


class _Messages(Progress):
    def __init__(self):
        self.seen = []

    def message(self, text):
        self.seen.append(text)


# --------------------------------------------------------------------------- the command line
def _cli_sweep(*args: str):
    from typer.testing import CliRunner

    from mla_convert import cli

    return CliRunner().invoke(cli.app, ["sweep", *map(str, args)])


def test_cli_sweep_reads_the_evaluation_texts_column(tiny_source, tiny_text, tmp_path):
    """`sweep` had no --text-column (eval has it): a .jsonl whose text field is not `text` could not be swept."""
    import json

    rows = tmp_path / "stories.jsonl"
    rows.write_text("".join(json.dumps({"story": line}) + "\n" for line in tiny_text.read_text().split(" mat ")))
    out = tmp_path / "out"
    run = _cli_sweep(tiny_source, "--data", rows, "--text-column", "story", "--out-dir", out, "--ratios", "2",
                     "--methods", "svd", "--context", "64", "--max-windows", "2", "--calib-samples", "2",
                     "--calib-seq-len", "32", "-q")
    assert run.exit_code == 0, run.output
    saved = json.loads((out / "sweep.json").read_text())
    assert saved["settings"]["text_column"] == "story" and saved["rows"][0]["scored_tokens"] == 2 * 63


def test_a_rounded_ratio_is_said_so_with_the_reason_of_the_default_target(tiny_source, tiny_text, tmp_path):
    """2 and 2.01 both give 32 of the tiny source's 64 values, 25 gives 3 (21.33x): sweep.md blamed "the serving
    target's shapes" under --target transformers, said nothing of 25x being 21.33x, and no note was printed."""

    class Messages(Progress):
        def __init__(self):
            self.seen = []

        def message(self, text):
            self.seen.append(text)

    messages = Messages()
    result = run_sweep(tiny_source, "2,2.01,25", tiny_text, tmp_path / "out", context_length=64, max_windows=1,
                       methods=["svd"], calibration=TINY_CALIBRATION, progress=messages)
    assert [p.values_per_token_layer for p in result.points] == [32, 32, 3]
    protocol = result.files.markdown.read_text()
    assert "serving target" not in protocol
    assert ("1 requested ratio got the shape of a smaller one (the cache holds whole values per token and layer)"
            in protocol)
    assert "Ratios met in whole cached values per token and layer: 2.01x got 2.00x, 25x got 21.33x." in protocol
    assert any(text.startswith("note: asked 25x, got 1+2 = 21.33x") for text in messages.seen), messages.seen


class _CtrlCAt(Progress):
    """Records the progress calls and raises KeyboardInterrupt (as Ctrl-C does) once `when(call, name)` holds."""

    def __init__(self, when):
        self.when, self.calls, self.phase_name = when, [], None

    def phase(self, name, total=None):
        self.calls.append(("phase", name))
        self.phase_name = name
        if self.when("phase", name):
            raise KeyboardInterrupt

    def advance(self, done, total=None):
        if self.when("advance", self.phase_name):
            raise KeyboardInterrupt

    def end(self):
        self.calls.append(("end", self.phase_name))


def test_an_evaluation_cut_off_is_not_ended_as_if_it_finished(tiny_source, tiny_text, tmp_path):
    """_evaluate ended its phase in a `finally`, so Ctrl-C during the source's evaluation was logged `done: perplexity: source`."""
    progress = _CtrlCAt(lambda call, name: call == "advance" and name == "perplexity: source")
    with pytest.raises(KeyboardInterrupt):
        run_sweep(tiny_source, [2], tiny_text, tmp_path / "out", context_length=64, max_windows=2, methods=["svd"],
                  calibration=TINY_CALIBRATION, progress=progress)
    assert progress.calls[-1] == ("phase", "perplexity: source")  # cut off: begun, never ended


def test_a_sweep_interrupted_after_calibration_says_calibration_ran(tiny_source, tiny_text, tmp_path):
    """sweep.md written after calibration, before any conversion finished, said "0 passes shared by 0 conversions"."""
    progress = _CtrlCAt(lambda call, name: call == "phase" and name == "converting layers")
    with pytest.raises(KeyboardInterrupt):
        run_sweep(tiny_source, [2], tiny_text, tmp_path / "out", context_length=64, max_windows=2, methods=["svd"],
                  calibration=TINY_CALIBRATION, progress=progress)
    markdown = (tmp_path / "out" / "sweep.md").read_text()
    assert "1 pass, no conversion finished." in markdown and "0 passes" not in markdown
    assert load_sweep(tmp_path / "out" / "sweep.json").calibration_passes == 1


def test_a_sweep_interrupted_before_it_measured_anything_leaves_no_folder(tiny_source, tiny_text, tmp_path):
    """Interrupted while scoring the source, a --keep-models sweep had made out/ and out/models/ and the CLI said
    "nothing written in out" (found by the API/sweep probe): the folders are made when something goes into them."""
    progress = _CtrlCAt(lambda call, name: call == "advance" and name == "perplexity: source")
    with pytest.raises(KeyboardInterrupt):
        run_sweep(tiny_source, [2], tiny_text, tmp_path / "out", context_length=64, max_windows=2, methods=["svd"],
                  calibration=TINY_CALIBRATION, progress=progress, keep_models=True)
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_sweep_lists_the_plot_it_wrote(tiny_source, tiny_text, tmp_path, monkeypatch):
    """Interrupted after the source was scored, the CLI listed sweep.md, .csv and .json but not the sweep.png it had
    written (found by the API/sweep probe)."""
    from typer.testing import CliRunner

    import mla_convert.eval.sweep as sweep_module
    from mla_convert import cli

    out = tmp_path / "out"

    def cut_off(*args, **kwargs):
        out.mkdir()
        for name in ("sweep.md", "sweep.csv", "sweep.json", "sweep.png"):
            (out / name).write_text("this sweep's first point")
        raise KeyboardInterrupt()

    monkeypatch.setattr(sweep_module, "run_sweep", cut_off)
    result = CliRunner().invoke(cli.app, ["sweep", str(tiny_source), "--data", str(tiny_text), "--out-dir", str(out)])
    listed = ", ".join(str(out / name) for name in ("sweep.md", "sweep.csv", "sweep.json", "sweep.png"))
    assert result.exit_code == 130 and f"the points measured before it are in {listed}" in " ".join(result.output.split())


def test_the_log_says_interrupted_not_done_for_a_phase_cut_off():
    """RichProgress printed `done: <phase>` for whatever phase was running when Ctrl-C came (convert's log too)."""
    import io as text_io

    from rich.console import Console

    from mla_convert.console import RichProgress

    log = text_io.StringIO()
    progress = RichProgress(Console(file=log, force_terminal=False, width=200))
    progress.phase("calibration statistics")
    progress.phase("converting layers")
    progress.finish("interrupted")
    progress.finish()  # closing again prints nothing more
    lines = log.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["done: calibration statistics", "interrupted: converting layers"]



def test_the_interrupted_line_gets_out_when_the_signal_cut_a_print_in_half(capsys):
    """A signal handled between rich's Console.__enter__ opening its buffer and the with-block starting leaves the
    buffer open, and the console then withholds every later line: a CI run lost "interrupted (SIGTERM)" so.  The
    state is made here the way that race leaves it; the interrupt handler must still get its lines out, in order."""
    import typer

    from mla_convert import cli
    from mla_convert.console import RichProgress
    from mla_convert.errors import TerminatedBySignal

    progress = RichProgress(cli.err_console)
    progress.phase("calibration statistics")
    cli.err_console._enter_buffer()  # what the cut leaves behind (rich's own method, as Console.__enter__ calls it)
    try:
        cli.err_console.print("a line printed after the cut", highlight=False)
        with pytest.raises(typer.Exit) as exit_info:
            cli._interrupted(progress, TerminatedBySignal(15), "the conversion left nothing at out")
        assert getattr(cli.err_console, "_buffer_index", 0) == 0
    finally:  # a failure must not leave the shared console withholding the next tests' output
        cli.release_console_buffer(cli.err_console)
    assert exit_info.value.exit_code == 143
    err = capsys.readouterr().err
    lines = [line.split(" (")[0] for line in err.splitlines()]
    assert lines == ["a line printed after the cut", "interrupted: calibration statistics", "interrupted"], err

@pytest.mark.slow
def test_an_interrupted_sweep_says_so_and_where_its_results_are(tiny_source, tiny_text, tmp_path):
    """Ctrl-C ended `sweep` with status 130 and no word (convert says "interrupted ...")."""
    import os
    import signal
    import subprocess
    import sys
    import time

    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch_root), "COLUMNS": "300"}
    out = tmp_path / "out"
    command = [sys.executable, "-m", "mla_convert", "sweep", str(tiny_source), "--data", str(tiny_text), "--out-dir",
               str(out), "--ratios", ",".join(f"{2 + r / 10:g}" for r in range(150)), "--methods", "svd",
               "--context", "64", "--max-windows", "2", "--calib-samples", "2", "--calib-seq-len", "32"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and not list(scratch_root.glob("mla-convert-sweep-*/svd-*")):
        assert process.poll() is None, process.stderr.read()[-2000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert f"interrupted (SIGINT): the points measured before it are in {out / 'sweep.md'}" in err, err[-2000:]


def test_an_overwriting_sweep_cut_off_before_its_first_point_does_not_claim_the_earlier_files(tiny_source, tiny_text,
                                                                                               tmp_path, monkeypatch):
    """`sweep --overwrite` interrupted before it saved anything said "the points measured before it are in
    sweep.md", which still held the earlier sweep."""
    from typer.testing import CliRunner

    import mla_convert.eval.sweep as sweep_module
    from mla_convert import cli

    out = tmp_path / "out"
    out.mkdir()
    for name in ("sweep.md", "sweep.csv", "sweep.json"):
        (out / name).write_text("an earlier sweep")
    arguments = ["sweep", str(tiny_source), "--data", str(tiny_text), "--out-dir", str(out), "--overwrite"]

    def cut_off(*args, save_first=False, **kwargs):
        if save_first:  # the run saved a point, then was interrupted
            (out / "sweep.json").write_text("this sweep's first point")
        raise KeyboardInterrupt()

    monkeypatch.setattr(sweep_module, "run_sweep", cut_off)
    result = CliRunner().invoke(cli.app, arguments)
    text = " ".join(result.output.split())
    assert result.exit_code == 130 and f"nothing was measured; the earlier sweep's files in {out} are unchanged" in text
    assert "measured before it" not in text
    monkeypatch.setattr(sweep_module, "run_sweep", lambda *a, **k: cut_off(*a, save_first=True, **k))
    result = CliRunner().invoke(cli.app, arguments)
    assert result.exit_code == 130 and f"the points measured before it are in {out / 'sweep.md'}" in " ".join(result.output.split())
    # a quoted `~/out` (no shell expanded it) is where run_sweep writes; the message looked at a folder named `~`
    monkeypatch.setenv("HOME", str(tmp_path))
    result = CliRunner().invoke(cli.app, [*arguments[:5], "~/out", "--overwrite"])
    assert result.exit_code == 130 and f"the points measured before it are in {out / 'sweep.md'}" in " ".join(result.output.split())


def test_a_text_shorter_than_the_context_is_described_by_its_real_length(tiny_source, tmp_path):
    """A 12-token text with --context 64 was "1 non-overlapping windows of 64 tokens" in sweep.md, the plot's title
    and sweep.json's context_length, while the only window held 12 tokens."""
    import json

    short = tmp_path / "short.txt"
    short.write_text("the cat sat.")
    result = run_sweep(tiny_source, [2], short, tmp_path / "out", context_length=64, methods=["svd"],
                       calibration=TINY_CALIBRATION)
    tokens = result.source_point.result.num_tokens
    assert tokens < 64 and result.source_point.result.num_scored_tokens == tokens - 1
    assert f"Perplexity on `short.txt`: 1 window of {tokens} tokens ({tokens - 1} scored tokens)" in \
        result.files.markdown.read_text()
    assert json.loads(result.files.json.read_text())["context_length"] == tokens
    assert plot_title(result).endswith(f"short.txt, 1 x {tokens}-token window")
    # a text that ends inside the last window: that window's real length is said too
    import dataclasses

    fake = _fake_result({("output", 2): 11.0})  # 102 tokens in windows of 51: exactly two
    assert "2 non-overlapping windows of 51 tokens (" in fake.describe_protocol()
    shorter = dataclasses.replace(fake.source_point.result, num_tokens=90)
    assert "1 non-overlapping window of 51 tokens and 1 of 39 (" in dataclasses.replace(
        fake, source_point=dataclasses.replace(fake.source_point, result=shorter)).describe_protocol()


def test_the_source_row_counts_its_cache_in_the_dtype_it_was_scored_in(tiny_source, tiny_text, tmp_path):
    """Under --dtype bf16 every row, the source's too, was counted in bfloat16, but the float32 source was scored in
    float32: its cache is twice what its row said."""
    from mla_convert.options import ConvertOptions

    result = run_sweep(tiny_source, [2], tiny_text, tmp_path / "out", context_length=64, max_windows=1, methods=["svd"],
                       calibration=TINY_CALIBRATION, options=ConvertOptions(dtype="bf16"))
    source, converted = result.rows()
    assert (source["cache_dtype"], source["bytes_per_token"]) == ("float32", 64 * 2 * 4)
    assert (converted["cache_dtype"], converted["bytes_per_token"]) == ("bfloat16", 32 * 2 * 2)
    assert "KV cache counted in the dtype each model was scored in (source float32, conversions bfloat16)" in \
        result.files.markdown.read_text()
    assert load_sweep(result.files.json).rows() == result.rows()
    # the plot's top axis divides bytes: the 2x point sits at 4x there, and the axis says it is a byte ratio
    from mla_convert.eval.sweep import top_axis_label

    assert top_axis_label(result).startswith("KV-cache bytes vs the source's (dtypes differ")
    assert top_axis_label(load_sweep(result.files.json)) == top_axis_label(result)


def test_allow_pickle_reads_a_pickled_source_for_its_evaluation_too(tiny_source, tiny_text, tmp_path):
    """`sweep --allow-pickle` converted a pickled-only source, then refused to score it: "... or pass --allow-pickle",
    the flag the user had passed (the source's evaluation loaded it without the flag's setting)."""
    import json

    pickled = pickled_copy(tiny_source, tmp_path / "pickled")
    common = ["--data", tiny_text, "--ratios", "2", "--methods", "svd", "--context", "64", "--max-windows", "1",
              "--calib-samples", "2", "--calib-seq-len", "32", "-q"]
    run = _cli_sweep(pickled, "--out-dir", tmp_path / "refused", *common)
    assert run.exit_code == 2 and "pass --allow-pickle" in " ".join(run.output.split()), run.output
    run = _cli_sweep(pickled, "--out-dir", tmp_path / "out", "--allow-pickle", *common)
    assert run.exit_code == 0, run.output
    rows = json.loads((tmp_path / "out" / "sweep.json").read_text())["rows"]
    source = run_sweep(tiny_source, [2], tiny_text, None, context_length=64, max_windows=1, methods=["svd"],
                       calibration=CalibrationOptions(num_samples=2, seq_len=32)).rows()[0]
    assert rows[0]["perplexity"] == pytest.approx(source["perplexity"], rel=1e-6)  # the same weights, read from the pickle


def test_an_earlier_sweeps_results_are_replaced_only_when_asked(tiny_source, tiny_text, tmp_path):
    """A second sweep into the same --out-dir rewrote sweep.md/csv/json/png without a word: with fewer ratios the
    earlier rows were gone, while the models it had kept stayed under models/ unlisted."""
    class Messages(Progress):
        def __init__(self):
            self.seen = []

        def message(self, text):
            self.seen.append(text)

    out = tmp_path / "out"
    settings = dict(context_length=64, max_windows=1, methods=["svd"], calibration=TINY_CALIBRATION, keep_models=True)
    run_sweep(tiny_source, [2, 4], tiny_text, out, **settings)
    first = (out / "sweep.json").read_text()
    with pytest.raises(PreflightError, match=r"holds an earlier sweep's results \(sweep.md, sweep.csv, sweep.json, "
                                             r"sweep.png\); give --overwrite"):
        run_sweep(tiny_source, [2], tiny_text, out, **settings)
    assert (out / "sweep.json").read_text() == first  # refused before any work
    messages = Messages()
    result = run_sweep(tiny_source, [2], tiny_text, out, **settings, overwrite=True, progress=messages)
    assert [p.requested_ratio for p in load_sweep(result.files.json).points] == [2]
    # the replaced sweep's kept models are its results too: they went with its files (they stayed, unlisted)
    assert f"removed the models the replaced sweep kept in {out / 'models'} that this one does not list (svd-4x)" \
           in messages.seen
    assert sorted(p.name for p in (out / "models").iterdir()) == ["svd-2x"]


def test_cli_sweep_refuses_an_earlier_sweeps_results_without_overwrite(tiny_source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "sweep.md").write_text("an earlier sweep")
    run = _cli_sweep(tiny_source, "--data", tmp_path / "none.txt", "--out-dir", out)
    assert run.exit_code == 2 and "holds an earlier sweep's results (sweep.md); give --overwrite" in run.output
    assert (out / "sweep.md").read_text() == "an earlier sweep"


def test_the_csv_writes_paths_as_the_json_does(tiny_source, tiny_text, tmp_path):
    """sweep.json wrote a kept model's path as $TMPDIR/... (or ~/..., ../...) while sweep.csv kept the absolute path."""
    import json

    result = run_sweep(tiny_source, [2], tiny_text, tmp_path / "out", context_length=64, max_windows=1,
                       methods=["svd"], calibration=TINY_CALIBRATION, keep_models=True)
    with open(result.files.csv, newline="") as handle:
        from_csv = [row["model_path"] for row in csv.DictReader(handle)]
    from_json = [row["model_path"] or "" for row in json.loads(result.files.json.read_text())["rows"]]
    # relative to the folder the files are in: an out-dir under the temp folder was written `$TMPDIR/.../svd-2x`
    # (not a temp folder of mla-convert's) while source and data stayed absolute
    assert from_csv == from_json == ["", "models/svd-2x"]
    assert json.loads(result.files.json.read_text())["points"][1]["model_path"] == "models/svd-2x"
    assert load_sweep(result.files.json).points[0].model_path == str(tmp_path / "out" / "models" / "svd-2x")


def test_only_mla_converts_scratch_folders_are_written_as_tmpdir():
    import tempfile

    from mla_convert.eval.sweep import _portable_paths

    temp = tempfile.gettempdir()
    assert _portable_paths(f"{temp}/mla-convert-sweep-x1/svd-2x") == "$TMPDIR/mla-convert-sweep-x1/svd-2x"
    assert _portable_paths(f"{temp}/mla-convert-stats-x1") == "$TMPDIR/mla-convert-stats-x1"
    assert "$TMPDIR" not in _portable_paths(f"{temp}/probe/sw1/models/activation-aware-2x")


def test_overwrite_leaves_only_this_sweeps_models(tiny_source, tiny_text, tmp_path):
    """`sweep --overwrite --keep-models` left the earlier sweep's kept models (svd-4x beside the new svd-2x) in
    out/models, which the new sweep.md does not list; a folder mla-convert did not write stays."""
    out = tmp_path / "out"
    run_sweep(tiny_source, [4], tiny_text, out, context_length=64, max_windows=1, methods=["svd"],
              calibration=TINY_CALIBRATION, keep_models=True)
    assert (out / "models" / "svd-4x" / "mla_convert.json").is_file()
    (out / "models" / "mine").mkdir()
    (out / "models" / "mine" / "notes.txt").write_text("the user's")
    result = run_sweep(tiny_source, [2], tiny_text, out, context_length=64, max_windows=1, methods=["svd"],
                       calibration=TINY_CALIBRATION, keep_models=True, overwrite=True)
    assert sorted(p.name for p in (out / "models").iterdir()) == ["mine", "svd-2x"]
    assert (out / "models" / "mine" / "notes.txt").read_text() == "the user's"
    assert [p.label for p in result.points] == ["weight-only SVD 2x"]


def test_a_kept_models_card_has_a_convert_command_and_the_sweeps_perplexity(tiny_source, tiny_text, tmp_path):
    """A kept model's card showed `mla-convert sweep (ratio 2, method weight-only SVD)` (not a command) and said
    "no perplexity was measured" although the sweep had measured it."""
    import shlex

    from typer.testing import CliRunner

    from mla_convert import cli

    result = run_sweep(tiny_source, [2], tiny_text, tmp_path / "out", context_length=64, max_windows=2,
                       methods=["svd"], calibration=TINY_CALIBRATION, keep_models=True)
    (point,) = result.points
    kept = Path(point.model_path)
    report = json.loads((kept / "mla_convert.json").read_text())
    assert report["evaluation"]["converted_perplexity"] == point.perplexity
    assert report["evaluation"]["source_perplexity"] == result.source_point.perplexity
    card = (kept / "README.md").read_text()
    assert "no perplexity was measured" not in card
    assert f"| MLA (this model) | {point.perplexity:,.4f} |" in card
    assert (report["evaluation"]["dtype"], report["evaluation"]["source_dtype"]) == ("float32", "float32")
    assert "scored tokens, computed in float32):" in card  # the sweep's compute dtype, which the card omitted
    (command,) = re.findall(r"```bash\n(mla-convert convert [^\n]*)\n```", card)
    words = shlex.split(command)
    assert words[:2] == ["mla-convert", "convert"] and words[3] == "svd-2x"
    # the same command, its paths given here: convert accepts it and makes the same shape
    again = tmp_path / "again"
    run = CliRunner().invoke(cli.app, ["convert", str(tiny_source), str(again), *words[4:], "-q"])
    assert run.exit_code == 0, run.output
    options = json.loads((again / "mla_convert.json").read_text())["options"]
    assert (options["kv_lora_rank"], options["rope_dim"]) == (point.kv_lora_rank, point.rope_dim)
