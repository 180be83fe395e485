"""Sliding-window perplexity: agrees with independent computations, scores every token once, and
reproduces the project's protocol numbers on real weights."""

from __future__ import annotations

import bisect
import json
import math
import re

import pytest
import torch
from tiny_models import tiny_mla_config, tiny_model

from mla_convert.convert import ConvertOptions, convert
from mla_convert.data.textdata import tokenize_with_offsets
from mla_convert.errors import MLAConvertError
from mla_convert.eval.perplexity import (
    PerplexityResult,
    compare_models,
    evaluate_perplexity,
    format_markdown_table,
    plan_windows,
    run_eval,
)
from mla_convert.options import CalibrationOptions


def hf_guide_nll(model, ids: torch.Tensor, context: int, stride: int, max_windows: int | None = None):
    """The Hugging Face perplexity guide's loop, written independently with `labels=` and -100 masking.

    Returns (summed NLL, scored tokens); the model's own mean loss is multiplied back by the number of
    labels it averaged over, so the sum is exact.
    """
    ids = ids.reshape(1, -1)  # (1, num_tokens)
    num_tokens = ids.shape[1]
    nll, count, previous_end, windows = 0.0, 0, 0, 0
    with torch.no_grad():
        for begin in range(0, num_tokens, stride):
            end = min(begin + context, num_tokens)
            target_length = end - previous_end
            input_ids = ids[:, begin:end]
            labels = input_ids.clone()
            labels[:, :-target_length] = -100
            valid = int((labels[:, 1:] != -100).sum())
            if valid:
                loss = model(input_ids=input_ids, labels=labels).loss
                nll += loss.item() * valid
                count += valid
                windows += 1
            previous_end = end
            if end == num_tokens or (max_windows is not None and windows == max_windows):
                break
    return nll, count


# ---------------------------------------------------------------------------------------- (c) accounting


@pytest.mark.parametrize(
    "context, stride",
    [(16, 16), (16, 8), (16, 1), (16, 5), (7, 3), (7, 6), (32, 32), (64, 10), (200, 50), (200, 200)],
)
def test_every_token_scored_once(context, stride):
    """No token scored twice or skipped: with stride < context every position 1..N-1 is scored exactly
    once; with stride = context the first token of each window has no context and is the only gap."""
    num_tokens = 101
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (num_tokens,))
    windows = plan_windows(num_tokens, context, stride)
    scored = [p for w in windows for p in range(w.score_from, w.end)]
    assert len(scored) == len(set(scored))  # nothing twice
    assert all(w.end - w.begin <= context and w.begin < w.score_from for w in windows)
    if stride < context or context >= num_tokens:
        assert sorted(scored) == list(range(1, num_tokens))
    else:
        assert sorted(scored) == [p for p in range(1, num_tokens) if p % context != 0]
    assert all(w.num_scored <= stride for w in windows[1:])

    model = tiny_model(seed=3, weight_scale=4.0)
    result = evaluate_perplexity(model, ids, context_length=context, stride=stride, batch_size=3, progress=False)
    expected_nll, expected_count = hf_guide_nll(model, ids, context, stride)
    assert result.num_scored_tokens == expected_count == len(scored)
    assert result.num_tokens == num_tokens
    assert result.nll_sum == pytest.approx(expected_nll, rel=1e-5)


@pytest.mark.parametrize("context, stride, max_windows", [(16, 4, 5), (16, 16, 3), (10, 7, 1)])
def test_max_windows_bounds_the_span(context, stride, max_windows):
    ids = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(0))
    model = tiny_model(seed=2, weight_scale=4.0)
    result = evaluate_perplexity(model, ids, context_length=context, stride=stride, max_windows=max_windows, progress=False)
    expected_nll, expected_count = hf_guide_nll(model, ids, context, stride, max_windows)
    assert result.num_windows == max_windows
    assert result.num_scored_tokens == expected_count
    assert result.nll_sum == pytest.approx(expected_nll, rel=1e-5)
    span = context + (max_windows - 1) * stride
    assert result.num_tokens == span
    if stride < context:
        assert result.num_scored_tokens == span - 1


def test_max_tokens_truncates_before_planning():
    ids = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(0))
    model = tiny_model(seed=2, weight_scale=4.0)
    truncated = evaluate_perplexity(model, ids, context_length=32, stride=8, max_tokens=77, progress=False)
    direct = evaluate_perplexity(model, ids[:77], context_length=32, stride=8, progress=False)
    assert truncated.num_tokens == 77 and truncated.num_scored_tokens == 76
    assert truncated.nll_sum == direct.nll_sum


def test_batching_does_not_change_the_result():
    ids = torch.randint(0, 128, (250,), generator=torch.Generator().manual_seed(5))
    model = tiny_model(seed=4, weight_scale=4.0)
    one = evaluate_perplexity(model, ids, context_length=24, stride=10, batch_size=1, progress=False)
    many = evaluate_perplexity(model, ids, context_length=24, stride=10, batch_size=7, progress=False)
    assert many.num_scored_tokens == one.num_scored_tokens
    assert many.nll_sum == pytest.approx(one.nll_sum, rel=1e-5)


def test_bad_settings_are_user_errors():
    model = tiny_model()
    ids = torch.arange(50) % 128
    with pytest.raises(MLAConvertError, match="stride"):
        evaluate_perplexity(model, ids, context_length=8, stride=9, progress=False)
    with pytest.raises(MLAConvertError, match="context length"):
        evaluate_perplexity(model, ids, context_length=1, progress=False)
    with pytest.raises(MLAConvertError, match="needs the text"):
        evaluate_perplexity(model, object(), None, context_length=8, progress=False)


# ---------------------------------------------------------------------------------------- (d) formulas


def test_bits_per_byte_and_word_perplexity_by_hand():
    result = PerplexityResult(
        nll_sum=20.0, num_scored_tokens=8, num_windows=1, num_tokens=9, num_bytes=16, num_words=5, context_length=9, stride=9
    )
    assert result.perplexity == pytest.approx(math.exp(20.0 / 8))
    assert result.bits_per_byte == pytest.approx(20.0 / math.log(2) / 16)  # 1.8034 bits per byte
    assert result.bits_per_byte == pytest.approx(1.80337, abs=1e-5)
    assert result.word_perplexity == pytest.approx(math.exp(4.0))
    unknown = PerplexityResult(20.0, 8, 1, 9, None, None, 9, 9)
    assert unknown.bits_per_byte is None and unknown.word_perplexity is None


def scored_text_by_hand(tokenized, scored_positions: set[int]) -> tuple[int, int]:
    """(bytes, words) of the text owned by the scored tokens: a character belongs to the first token ending after it."""
    ends = list(tokenized.char_ends)
    ends[-1] = len(tokenized.text)
    owner = [bisect.bisect_right(ends, c) for c in range(len(tokenized.text))]  # token index per character
    num_bytes = sum(len(ch.encode("utf-8")) for c, ch in enumerate(tokenized.text) if owner[c] in scored_positions)
    num_words = sum(1 for word in re.finditer(r"\S+", tokenized.text) if owner[word.start()] in scored_positions)
    return num_bytes, num_words


@pytest.mark.real_model
def test_bytes_and_words_are_those_of_the_scored_tokens(stories260k):
    """Multi-byte characters make bytes != characters; the unscored first token of a window adds no bytes."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stories260k)
    text = "Lily saw a café near the park — it was big. " * 30 + "The end."
    tokenized = tokenize_with_offsets(tokenizer, text)
    model = tiny_model(vocab_size=512, seed=0)

    # Overlapping windows score every token but the BOS, which covers no text: all bytes and words count.
    overlapping = evaluate_perplexity(model, tokenizer, text, context_length=64, stride=32, progress=False)
    assert overlapping.num_scored_tokens == len(tokenized) - 1
    assert overlapping.num_bytes == len(text.encode("utf-8")) > len(text)
    assert overlapping.num_words == len(text.split())
    assert overlapping.bits_per_byte == pytest.approx(overlapping.nll_sum / math.log(2) / len(text.encode("utf-8")))
    assert overlapping.word_perplexity == pytest.approx(math.exp(overlapping.nll_sum / len(text.split())))

    # Non-overlapping windows leave each window's first token unscored: its text is not counted.
    full = evaluate_perplexity(model, tokenizer, text, context_length=64, progress=False)
    unscored = {0} | set(range(64, len(tokenized), 64))
    assert full.num_scored_tokens == len(tokenized) - len(unscored)
    expected_bytes, expected_words = scored_text_by_hand(tokenized, set(range(len(tokenized))) - unscored)
    assert (full.num_bytes, full.num_words) == (expected_bytes, expected_words)
    assert full.num_bytes < overlapping.num_bytes and full.num_words < overlapping.num_words
    assert full.bits_per_byte == pytest.approx(full.nll_sum / math.log(2) / expected_bytes)

    # A run cut short counts only what its own windows scored.
    part = evaluate_perplexity(model, tokenizer, text, context_length=64, max_windows=2, progress=False)
    assert part.num_tokens == 128
    assert (part.num_bytes, part.num_words) == scored_text_by_hand(tokenized, set(range(1, 64)) | set(range(65, 128)))

    # Token ids carry no offsets: no bytes or words, and a text given beside them is refused.
    ids_only = evaluate_perplexity(model, tokenized.ids, context_length=64, max_windows=2, progress=False)
    assert ids_only.nll_sum == part.nll_sum and ids_only.num_bytes is None and ids_only.bits_per_byte is None
    with pytest.raises(MLAConvertError, match="offsets"):
        evaluate_perplexity(model, tokenized.ids, text, context_length=64, progress=False)


# ---------------------------------------------------------------------------------------- any causal LM


def tiny_deepseek_v3(seed: int = 0):
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(tiny_mla_config()).eval()


def test_deepseek_v3_model_is_evaluated_like_any_other():
    model = tiny_deepseek_v3()
    ids = torch.randint(0, 128, (120,), generator=torch.Generator().manual_seed(9))
    result = evaluate_perplexity(model, ids, context_length=32, stride=12, batch_size=2, progress=False)
    expected_nll, expected_count = hf_guide_nll(model, ids, 32, 12)
    assert result.num_scored_tokens == expected_count == 119
    assert result.nll_sum == pytest.approx(expected_nll, rel=1e-5)


def test_compare_models_uses_identical_windows_and_reports_the_ratio():
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(2))
    a, b = tiny_model(seed=1, weight_scale=4.0), tiny_model(seed=2, weight_scale=4.0)
    comparison = compare_models(a, b, ids, context_length=32, stride=16, progress=False, model_label="A", baseline_label="B")
    alone_a = evaluate_perplexity(a, ids, context_length=32, stride=16, progress=False)
    alone_b = evaluate_perplexity(b, ids, context_length=32, stride=16, progress=False)
    assert comparison.model.nll_sum == alone_a.nll_sum and comparison.baseline.nll_sum == alone_b.nll_sum
    assert comparison.ratio == pytest.approx(alone_a.perplexity / alone_b.perplexity)
    assert comparison.ratio != pytest.approx(1.0)
    table = format_markdown_table(comparison)
    lines = table.splitlines()
    assert lines[0].startswith("| model | perplexity") and "ppl ratio" in lines[0]
    assert lines[2].startswith("| B | ") and lines[2].endswith("| 1.0000 |")
    assert lines[3].startswith("| A | ") and lines[3].endswith(f"| {comparison.ratio:.4f} |")


# ---------------------------------------------------------------------------------------- real weights


@pytest.mark.real_model
def test_stories260k_protocol_and_overlap(stories260k, tinystories_text):
    """(b) The project protocol (ctx 256, 60 non-overlapping windows: 5.735), stride = context equals
    the default exactly, and overlapping windows (more left context per token) give a lower ppl."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(stories260k).eval()
    tokenizer = AutoTokenizer.from_pretrained(stories260k)
    text = tinystories_text.read_text(encoding="utf-8")
    tokenized = tokenize_with_offsets(tokenizer, text)

    protocol = evaluate_perplexity(model, tokenized, context_length=256, max_windows=60, batch_size=8, progress=False)
    assert protocol.num_windows == 60 and protocol.num_scored_tokens == 60 * 255
    assert protocol.perplexity == pytest.approx(5.735, abs=0.005)

    span = dict(context_length=256, max_tokens=256 * 20, progress=False, batch_size=4)
    default = evaluate_perplexity(model, tokenized, **span)
    same_stride = evaluate_perplexity(model, tokenized, stride=256, **span)
    overlapping = evaluate_perplexity(model, tokenized, stride=64, **span)
    assert same_stride == default
    assert overlapping.num_tokens == default.num_tokens == 256 * 20
    assert overlapping.num_scored_tokens == 256 * 20 - 1 > default.num_scored_tokens
    assert overlapping.perplexity < default.perplexity


@pytest.mark.real_model
def test_run_eval_writes_json_and_table(stories260k, tinystories_text, tmp_path):
    out = tmp_path / "eval.json"
    report = run_eval(
        str(stories260k), str(tinystories_text), baseline=str(stories260k), context_length=128, max_windows=5,
        batch_size=5, json_path=out, progress=False,
    )
    assert report.ratio == pytest.approx(1.0)
    saved = json.loads(out.read_text())
    assert saved["settings"]["context_length"] == 128 and saved["settings"]["max_windows"] == 5
    results = list(saved["results"].values())
    assert results[0]["num_windows"] == 5 and results[0]["num_scored_tokens"] == 5 * 127
    assert results[0]["perplexity"] == pytest.approx(math.exp(results[0]["nll_sum"] / (5 * 127)))
    assert "(baseline)" in report.markdown()


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_wikitext_matches_direct_loss(smollm2, wikitext_text):
    """(a) 3 non-overlapping windows of 512 on WikiText-2 test vs plain `model(ids, labels=ids).loss`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    text = wikitext_text.read_text(encoding="utf-8")
    context, num_windows = 512, 3

    result = evaluate_perplexity(model, tokenizer, text, context_length=context, max_windows=num_windows, batch_size=3, progress=False)

    ids = tokenizer(text[:20000], add_special_tokens=False)["input_ids"]  # SmolLM2 adds no BOS
    windows = torch.tensor(ids[: context * num_windows]).reshape(num_windows, context)  # (3, 512)
    with torch.no_grad():
        losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in windows]
    direct = math.exp(sum(losses) / num_windows)  # every window averages over context - 1 labels
    assert result.num_scored_tokens == num_windows * (context - 1)
    assert result.perplexity == pytest.approx(direct, rel=0.01)
    assert result.perplexity == pytest.approx(direct, rel=1e-4)  # in fact the same computation
    assert 10 < result.perplexity < 60


@pytest.mark.real_model
def test_run_eval_checks_what_the_command_checks(stories260k, tinystories_text, tmp_path):
    """The Python API used to score fp16 underflow on a converted model, windows past the model's positions and a
    missing device without a word (or with a torch traceback), and to fail on a --json folder only at the end."""
    from mla_convert.errors import PreflightError

    converted = tmp_path / "mla"
    convert(stories260k, converted, ConvertOptions(compression=2, effort="fast",
                                                   calibration=CalibrationOptions(num_samples=2, seq_len=32)))
    for kwargs, message in [
        (dict(dtype="fp16"), "--dtype fp16: fp16 cannot hold a --target transformers export"),
        (dict(context_length=100_000), "--context 100000: longer than"),
        (dict(json_path=tmp_path / "no-such-folder" / "eval.json"), "--json"),
    ] + ([] if torch.cuda.is_available() else [(dict(device="cuda"), "--device cuda: no CUDA device")]):
        with pytest.raises(PreflightError, match=re.escape(message)):
            run_eval(converted, tinystories_text, max_windows=1, progress=False, **kwargs)
    # the default context is what the command uses: min(1024, max_position_embeddings = 512)
    report = run_eval(converted, tinystories_text, max_windows=1, progress=False)
    assert report.settings["context_length"] == 512
    assert not [note for note in report.notes if "allow-pickle" in note]
    # --allow-pickle where both models hold safetensors: the same scores, and a note that the flag did nothing
    both = run_eval(converted, tinystories_text, baseline=stories260k, max_windows=1, progress=False, allow_pickle=True)
    assert f"--allow-pickle has no effect: {converted} and {stories260k} hold safetensors weights, which are read " \
           "(as transformers reads them when a folder holds both)" in both.notes
    assert both.results[f"{converted}"].perplexity == report.results[f"{converted}"].perplexity


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny source with a character tokenizer, its conversion, and a text: eval's plumbing without ../shared."""
    from tiny_models import save_tiny_model, save_tiny_tokenizer

    root = tmp_path_factory.mktemp("eval-inputs")
    source = save_tiny_tokenizer(save_tiny_model(root / "src", num_layers=1, vocab_size=512), vocab_size=512)
    converted = convert(source, root / "mla", ConvertOptions(compression=2, effort="fast", calibration=CalibrationOptions(
        num_samples=2, seq_len=16))).output
    text = root / "text.txt"
    text.write_text("the cat sat on the mat and looked at the dog. " * 40)
    return source, converted, text


def test_json_never_replaces_an_input_or_a_foreign_file(tiny_pair, tmp_path):
    """`--json` used to overwrite whatever it named: the evaluation text, the model's config.json, any file."""
    from typer.testing import CliRunner

    from mla_convert import cli

    source, converted, text = tiny_pair
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}')
    before = {path: path.read_bytes() for path in (text, converted / "config.json", notes)}
    for target, message in [(text, "is the evaluation text"), (converted / "config.json", "inside the model folder"),
                            (source / "new.json", "inside the model folder"),
                            (notes, "exists and is not an earlier `mla-convert eval` result")]:
        result = CliRunner().invoke(cli.app, ["eval", str(converted), "--baseline", str(source), "--data", str(text),
                                              "--context", "32", "--max-windows", "1", "--json", str(target)])
        assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
        with pytest.raises(MLAConvertError, match=re.escape(message)):
            run_eval(converted, text, baseline=source, context_length=32, max_windows=1, progress=False, json_path=target)
    assert {path: path.read_bytes() for path in before} == before and not (source / "new.json").exists()
    loop = tmp_path / "loop.json"  # Path.resolve() raised RuntimeError("Symlink loop") out of the pre-flight
    loop.symlink_to(loop)
    result = CliRunner().invoke(cli.app, ["eval", str(converted), "--data", str(text), "--json", str(loop)])
    assert result.exit_code == 2, repr(result.exception)  # (a traceback exits 1)
    assert f"--json {loop}: a symlink to nothing" in " ".join(result.output.split()), result.output
    earlier = tmp_path / "eval.json"  # an earlier result is replaced: reruns are the normal case
    for _ in range(2):
        run_eval(converted, text, context_length=32, max_windows=1, progress=False, json_path=earlier)
    assert json.loads(earlier.read_text())["settings"]["context_length"] == 32


def test_run_eval_without_progress_draws_no_loading_bar(tiny_pair, capfd):
    """progress=False still wrote transformers' "Loading weights" bar to stderr (found by the API/sweep probe)."""
    source, converted, text = tiny_pair
    run_eval(converted, text, baseline=source, context_length=32, max_windows=1, progress=False)
    assert capfd.readouterr().err == ""


def test_run_eval_arguments_of_the_wrong_type_are_refused_naming_the_parameter(tiny_pair):
    """`context_length="512"` was a TypeError from comparing a str with an int (found by the API/sweep probe)."""
    from mla_convert.errors import PreflightError

    source, _, text = tiny_pair
    with pytest.raises(PreflightError) as refused:
        run_eval(source, text, context_length="512", batch_size=None, progress=False)
    assert refused.value.problems == ["context_length '512': must be int or None", "batch_size None: must be int"]
    with pytest.raises(PreflightError) as refused:
        run_eval(None, text, progress=False)
    assert refused.value.problems == ["model None: must be a path (str or os.PathLike)"]


def test_a_missing_text_file_is_listed_with_the_other_problems(tiny_pair, tmp_path):
    """eval and sweep read --data only after every other check had passed: `--data /typo.txt --context 0` named the
    context, and the missing file one run later (sweep: after a "failed: reading the evaluation text" line)."""
    from typer.testing import CliRunner

    from mla_convert import cli

    source, converted, _ = tiny_pair
    missing = tmp_path / "typo.txt"
    for args in (["eval", str(converted)], ["sweep", str(source), "--out-dir", str(tmp_path / "sweep")]):
        result = CliRunner().invoke(cli.app, [*args, "--data", str(missing), "--context", "0"])
        lines = [line for line in result.output.splitlines() if line.startswith("error: ")]
        assert result.exit_code == 2 and f"error: --data: {missing}: no such file or folder" in lines, result.output
        assert any(line.startswith("error: --context 0") for line in lines) and "failed:" not in result.output, result.output
    assert not (tmp_path / "sweep").exists()


def test_text_and_window_problems_come_before_any_model_loads(tiny_pair, tmp_path, monkeypatch):
    """A missing text, a stride longer than the context and a text column a .txt cannot have were found only after
    both models had loaded (the stride after the text was also tokenized), one at a time."""
    import mla_convert.eval.perplexity as perplexity
    from mla_convert.errors import PreflightError

    source, converted, text = tiny_pair
    monkeypatch.setattr(perplexity, "load_model_for_eval", lambda *a, **k: pytest.fail("a model loaded first"))
    with pytest.raises(PreflightError) as refused:
        run_eval(converted, text, baseline=source, context_length=32, stride=40, text_column="body", progress=False)
    assert [problem.split(":")[0] for problem in refused.value.problems] == ["--stride 40", "--text-column body"]
    with pytest.raises(MLAConvertError, match="nothere.txt: no such file or folder"):
        run_eval(converted, tmp_path / "nothere.txt", baseline=source, context_length=32, progress=False)
    folder = tmp_path / "plain"  # a folder of .txt files has no columns either
    folder.mkdir()
    (folder / "a.txt").write_text(text.read_text())
    with pytest.raises(PreflightError, match="--text-column body: acts only with .jsonl files"):
        run_eval(converted, folder, baseline=source, context_length=32, text_column="body", progress=False)
    blank = tmp_path / "blank.txt"
    blank.write_text("   \n")
    with pytest.raises(MLAConvertError, match="contains no text"):
        run_eval(converted, blank, baseline=source, context_length=32, progress=False)


def test_eval_runs_its_preflight_once_and_loads_each_tokenizer_once(tiny_pair, monkeypatch):
    """`eval` ran the pre-flight twice (the command's, then `run_eval`'s: two hub lookups per model id) and loaded the
    tokenizers three times (once in each pre-flight, again to score)."""
    from typer.testing import CliRunner

    import mla_convert.eval.checks as checks
    import mla_convert.io.hf_loading as hf_loading
    from mla_convert import cli

    source, converted, text = tiny_pair
    calls = {"preflight": 0, "tokenizer": []}
    real_preflight, real_load_tokenizer = checks.eval_preflight, hf_loading.load_tokenizer

    def counted_preflight(*args, **kwargs):
        calls["preflight"] += 1
        return real_preflight(*args, **kwargs)

    def counted_load_tokenizer(folder, *args, **kwargs):
        calls["tokenizer"].append(folder)
        return real_load_tokenizer(folder, *args, **kwargs)

    monkeypatch.setattr(checks, "eval_preflight", counted_preflight)
    monkeypatch.setattr(hf_loading, "load_tokenizer", counted_load_tokenizer)
    result = CliRunner().invoke(cli.app, ["eval", str(converted), "--baseline", str(source), "--data", str(text),
                                          "--context", "32", "--max-windows", "1"])
    assert result.exit_code == 0, result.output
    assert calls["preflight"] == 1
    assert sorted(map(str, calls["tokenizer"])) == sorted([str(converted), str(source)])


def test_a_text_shorter_than_the_context_is_described_by_its_real_length(tiny_pair, tmp_path):
    """`eval --max-tokens 10` under a context of 32 printed `32/32` (context/stride) and saved "context_length": 32
    in the JSON and the card, while the one window held 10 tokens (9 scored)."""
    import shutil
    from pathlib import Path

    from typer.testing import CliRunner

    from mla_convert import cli

    source, converted, text = tiny_pair
    converted = Path(shutil.copytree(converted, tmp_path / "mla"))  # --update-card rewrites its report and card
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(cli.app, ["eval", str(converted), "--baseline", str(source), "--data", str(text),
                                          "--context", "32", "--stride", "16", "--max-tokens", "10", "--json", str(out),
                                          "--update-card"])
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert ("note: the evaluation text has 10 tokens (--max-tokens 10), fewer than the context 32: one window of "
            "10 tokens") in output
    # the context/stride cell; not a bare "32/", which a temporary folder such as pytest-132/ also holds
    assert "| 1 | 10/10 |" in output and not re.search(r"\| 32/\d+ \|", output)
    saved = json.loads(out.read_text())
    assert (saved["settings"]["context_length"], saved["settings"]["stride"]) == (10, 10)
    for scored in saved["results"].values():
        assert (scored["context_length"], scored["stride"], scored["num_windows"], scored["num_scored_tokens"]) == \
            (10, 10, 1, 9)
    evaluation = json.loads((converted / "mla_convert.json").read_text())["evaluation"]
    assert (evaluation["context_length"], evaluation["stride"]) == (10, 10)
    assert "context 10 tokens, 1 window, 9 scored tokens, computed in float32):" in (converted / "README.md").read_text()
    # the API says the same; a text at least as long as the context keeps the context asked for
    report = run_eval(converted, text, context_length=32, max_tokens=10, progress=False)
    assert (report.settings["context_length"], report.settings["stride"]) == (10, 10) and len(report.notes) == 1
    report = run_eval(converted, text, context_length=32, max_tokens=32, progress=False)
    assert (report.settings["context_length"], report.notes) == (32, [])


def test_a_special_data_path_and_an_empty_json_are_named_for_what_they_are(tiny_pair, tmp_path, monkeypatch):
    """`eval --data /dev/null` said "/dev/null: no such file or folder" (it exists), and `--json ""` said
    "--json <the current folder>: exists and is not a regular file" (the empty name read as the current folder)."""
    from typer.testing import CliRunner

    from mla_convert import cli
    from mla_convert.errors import PreflightError

    source, converted, text = tiny_pair
    monkeypatch.chdir(tmp_path)
    for data, json_name, message in [("/dev/null", None, "error: /dev/null: is a character device, not a text file or folder"),
                                     (str(text), "", "error: --json: must not be empty"),
                                     (str(text), "  ", "error: --json: must not be empty")]:
        result = CliRunner().invoke(cli.app, ["eval", str(converted), "--data", data, "--context", "32"]
                                    + ([] if json_name is None else ["--json", json_name]))
        assert result.exit_code == 2 and result.output.strip().splitlines() == [message], result.output
    with pytest.raises(PreflightError, match="^--json: must not be empty$"):
        run_eval(converted, text, context_length=32, json_path="", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_models_computing_in_different_dtypes_are_named_beside_the_ratio(tiny_pair, tmp_path):
    """Under `--dtype auto` a float32 source and a bfloat16 export each compute in their own dtype, so the ratio
    mixes bfloat16's rounding into the conversion's error; eval printed it without saying so.  A note names both
    dtypes and the flag that evens them out; with --dtype fp32 (one dtype for both) there is no note."""
    from typer.testing import CliRunner

    from mla_convert import cli

    source, _, text = tiny_pair
    bf16 = convert(source, tmp_path / "bf16", ConvertOptions(compression=2, effort="fast", dtype="bf16",
                                                             calibration=CalibrationOptions(num_samples=2, seq_len=16))).output
    report = run_eval(bf16, text, baseline=source, context_length=32, max_windows=2, progress=False)
    assert (report.settings["dtype"], report.settings["baseline_dtype"]) == ("bfloat16", "float32")
    assert report.notes == [f"{source} (baseline) computed in float32, {bf16} in bfloat16 (each in its stored dtype): "
                            "the ratio includes the difference in precision too; --dtype fp32 computes both in float32"]
    assert run_eval(bf16, text, baseline=source, context_length=32, max_windows=2, dtype="fp32", progress=False).notes == []
    assert run_eval(bf16, text, context_length=32, max_windows=2, progress=False).notes == []  # no baseline: nothing to mix
    result = CliRunner().invoke(cli.app, ["eval", str(bf16), "--baseline", str(source), "--data", str(text),
                                          "--context", "32", "--max-windows", "2"])
    assert result.exit_code == 0, result.output
    assert "note: " + str(source) + " (baseline) computed in float32, " + str(bf16) + " in bfloat16" in \
        " ".join(result.output.split())
