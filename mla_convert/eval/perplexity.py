"""Sliding-window perplexity of any Hugging Face causal LM, and the `eval` entry point.

Every quality number of this project (source vs converted vs fine-tuned) comes from here, so the
method is fixed and checked: the sliding-window procedure of the Hugging Face perplexity guide.

* Windows of `context_length` tokens start every `stride` tokens (default: `stride = context_length`,
  non-overlapping windows - the project's standard protocol).
* The first window scores every token it can predict (all but its first token).  Each later window
  scores only the tokens after the previous window's end, i.e. its last `stride` tokens, so with
  `stride < context_length` every scored token sees at least `context_length - stride` tokens of left
  context, and no token is scored twice or skipped.  With `stride = context_length` the first token
  of each window has nothing to be predicted from and is not scored (that is what the guide and the
  project protocol do).
* NLL is summed over scored tokens and divided by their number (token-weighted), never averaged per
  window.

Besides perplexity we report bits per byte and word perplexity, with the formulas lm-evaluation-harness
uses for its wikitext task (total NLL over bytes, over words), so numbers are comparable across
tokenizers.  The bytes and words are those of the text the *scored* tokens cover (token i covers the text
from the end of token i - 1 to its own end): lm-evaluation-harness scores every token, while the first
token of each non-overlapping window here is not scored, and counting its bytes too would put bits per
byte about 1/context too low.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..data.textdata import TokenizedText, load_text, tokenize_with_offsets
from ..errors import MLAConvertError
from ..io.paths import absolute_path
from ..io.reader import unneeded_pickle_note

if TYPE_CHECKING:
    from .checks import EvalPlan

LN2 = math.log(2.0)


class EvaluationError(MLAConvertError):
    """Bad evaluation settings or inputs."""


# --------------------------------------------------------------------------------------------------
# Windows
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """Tokens [begin, end) are fed to the model; targets at positions [score_from, end) are scored."""

    begin: int
    end: int
    score_from: int

    @property
    def length(self) -> int:
        return self.end - self.begin

    @property
    def num_scored(self) -> int:
        return self.end - self.score_from


def plan_windows(num_tokens: int, context_length: int, stride: int | None = None, max_windows: int | None = None) -> list[Window]:
    """The windows of the Hugging Face sliding-window method over `num_tokens` tokens.

    A position p is scored by the first window that ends after it and holds at least one token
    before it: `score_from = max(previous end, begin + 1)`.
    """
    stride = context_length if stride is None else stride
    if context_length < 2:
        raise EvaluationError(f"context length must be at least 2 tokens, got {context_length}")
    if not 1 <= stride <= context_length:
        raise EvaluationError(f"stride must be between 1 and the context length ({context_length}), got {stride}")
    if max_windows is not None and max_windows < 1:
        raise EvaluationError(f"max_windows must be at least 1, got {max_windows}")
    if num_tokens < 2:
        raise EvaluationError(f"need at least 2 tokens to score one, got {num_tokens}")
    windows: list[Window] = []
    previous_end = 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + context_length, num_tokens)
        score_from = max(previous_end, begin + 1)
        if score_from < end:
            windows.append(Window(begin, end, score_from))
        previous_end = end
        if end == num_tokens or (max_windows is not None and len(windows) == max_windows):
            break
    return windows


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PerplexityResult:
    """Summed NLL over scored tokens, with what is needed to express it per token, byte and word."""

    nll_sum: float  # nats, summed over scored tokens
    num_scored_tokens: int
    num_windows: int
    num_tokens: int  # tokens in the evaluated span (ids[0:last window end])
    num_bytes: int | None  # UTF-8 bytes of the text the scored tokens cover (None: unknown without offsets)
    num_words: int | None  # whitespace-separated words starting in that text
    context_length: int
    stride: int

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.num_scored_tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    @property
    def bits_per_byte(self) -> float | None:
        """Total NLL in bits over the scored text's UTF-8 bytes (lm-evaluation-harness `bits_per_byte`)."""
        return None if not self.num_bytes else self.nll_sum / LN2 / self.num_bytes

    @property
    def word_perplexity(self) -> float | None:
        """exp(total NLL / the scored text's words) (lm-evaluation-harness `word_perplexity`)."""
        return None if not self.num_words else math.exp(self.nll_sum / self.num_words)

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(
            mean_nll=self.mean_nll,
            perplexity=self.perplexity,
            bits_per_byte=self.bits_per_byte,
            word_perplexity=self.word_perplexity,
        )
        return data


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------


def _as_tokenized(tokenizer_or_ids, text: str | None) -> TokenizedText:
    """Accept a tokenizer (+ text), ready token ids or a `TokenizedText`."""
    if isinstance(tokenizer_or_ids, TokenizedText):
        return tokenizer_or_ids
    if isinstance(tokenizer_or_ids, torch.Tensor) or isinstance(tokenizer_or_ids, (list, tuple)):
        if text is not None:
            raise EvaluationError(
                "evaluate_perplexity takes token ids without their text: bytes and words need each token's "
                "offsets; pass the text with its tokenizer, or a TokenizedText (tokenize_with_offsets)"
            )
        ids = torch.as_tensor(tokenizer_or_ids, dtype=torch.long).reshape(-1)  # (num_tokens,)
        return TokenizedText(ids, None, "")  # no offsets: no bytes or words are reported
    if text is None:
        raise EvaluationError("evaluate_perplexity needs the text when given a tokenizer")
    return tokenize_with_offsets(tokenizer_or_ids, text)


def _model_device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def _accepts_logits_to_keep(model) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def window_batches(windows: list[Window], batch_size: int):
    """Consecutive windows of identical shape (length and number scored) in groups of `batch_size`."""
    group: list[Window] = []
    for window in windows:
        if group and (len(group) == batch_size or (window.length, window.num_scored) != (group[0].length, group[0].num_scored)):
            yield group
            group = []
        group.append(window)
    if group:
        yield group


@torch.no_grad()
def window_nll(model, ids: torch.Tensor, group: list[Window], device: torch.device, keep_logits: bool = False) -> torch.Tensor:
    """Summed NLL (nats, a float64 scalar on `device`) of the scored targets of a group of same-shaped windows.

    The one scoring loop of the project: `evaluate_perplexity` sums it over the windows of one process,
    fine-tuning's evaluation over the windows of every process (then reduces the sums).
    """
    length, num_scored = group[0].length, group[0].num_scored
    batch = torch.stack([ids[w.begin : w.end] for w in group]).to(device)  # (B, length)
    kwargs = {"use_cache": False}
    if keep_logits:
        # Only the positions that predict scored targets need the LM head (saves the vocab matmul).
        kwargs["logits_to_keep"] = num_scored + 1
    logits = model(input_ids=batch, **kwargs).logits  # (B, kept or length, vocab)
    predicting = logits[:, -(num_scored + 1) : -1]  # (B, num_scored, vocab): row j predicts target j
    targets = batch[:, length - num_scored :]  # (B, num_scored)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for row in range(batch.shape[0]):  # one row at a time bounds the fp32 upcast to (num_scored, vocab)
        total += F.cross_entropy(predicting[row].float(), targets[row], reduction="sum").double()
    return total


def evaluate_perplexity(
    model,
    tokenizer_or_ids,
    text: str | None = None,
    context_length: int = 1024,
    stride: int | None = None,
    batch_size: int = 1,
    max_tokens: int | None = None,
    max_windows: int | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
    desc: str = "perplexity",
) -> PerplexityResult:
    """Sliding-window perplexity of `model` on `text` (see the module docstring for the method).

    `tokenizer_or_ids`: a tokenizer (then `text` is required), a 1-D tensor of token ids (then bytes and
    words are not reported: without offsets the text of the scored tokens is unknown), or a
    `TokenizedText`.  `max_tokens` evaluates only the first that many tokens; `max_windows` stops
    after that many windows.  Inputs go to `device` (default: where the model's embeddings are).
    Tokens fewer than `context_length` make one window of them all: the result's `context_length` and `stride`
    are then its length.
    """
    if batch_size < 1:
        raise EvaluationError(f"batch size must be at least 1, got {batch_size}")
    tokenized = _as_tokenized(tokenizer_or_ids, text)
    ids = tokenized.ids
    if max_tokens is not None:
        if max_tokens < 2:
            raise EvaluationError(f"max_tokens must be at least 2, got {max_tokens}")
        ids = ids[:max_tokens]
    stride = context_length if stride is None else stride
    windows = plan_windows(int(ids.numel()), context_length, stride, max_windows)
    if ids.numel() < context_length:  # one window of every token: say its real length, not the one asked for
        context_length = stride = int(ids.numel())
    span_tokens = windows[-1].end
    scored_ranges = [(w.score_from, w.end) for w in windows]
    num_bytes, num_words = tokenized.covered_statistics(scored_ranges)

    device = torch.device(device) if device is not None else _model_device(model)
    keep_logits = _accepts_logits_to_keep(model)
    was_training = model.training
    model.eval()
    nll_sum = 0.0
    done = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(windows), desc=desc, unit="win", leave=False, disable=None)  # None: no bar when not a terminal
    try:
        for group in window_batches(windows, batch_size):
            nll_sum += window_nll(model, ids, group, device, keep_logits).item()
            done += len(group)
            if bar is not None and not bar.disable:
                bar.update(len(group))
                scored = sum(w.num_scored for w in windows[:done])
                bar.set_postfix(ppl=f"{math.exp(nll_sum / scored):.3f}")
    finally:
        if bar is not None:
            bar.close()
        model.train(was_training)
    if not math.isfinite(nll_sum):
        raise EvaluationError(f"the model produced a non-finite loss ({nll_sum}); check the weights and dtype")
    return PerplexityResult(
        nll_sum=nll_sum,
        num_scored_tokens=sum(w.num_scored for w in windows),
        num_windows=len(windows),
        num_tokens=span_tokens,
        num_bytes=num_bytes,
        num_words=num_words,
        context_length=context_length,
        stride=stride,
    )


@dataclass(frozen=True)
class Comparison:
    """A model and its baseline scored on the same token windows; `ratio` = model ppl / baseline ppl."""

    model: PerplexityResult
    baseline: PerplexityResult
    model_label: str = "model"
    baseline_label: str = "baseline"

    @property
    def ratio(self) -> float:
        return self.model.perplexity / self.baseline.perplexity

    def results(self) -> dict[str, PerplexityResult]:
        return {self.baseline_label: self.baseline, self.model_label: self.model}

    def to_dict(self) -> dict:
        return {
            self.baseline_label: self.baseline.to_dict(),
            self.model_label: self.model.to_dict(),
            "ratio": self.ratio,
        }


def compare_models(
    model,
    baseline,
    tokenizer_or_ids,
    text: str | None = None,
    context_length: int = 1024,
    model_label: str = "model",
    baseline_label: str = "baseline",
    **kwargs,
) -> Comparison:
    """Evaluate `model` and `baseline` on exactly the same token windows (one tokenization).

    A converted model keeps its source's tokenizer, so one tokenization serves both; keyword arguments
    are those of `evaluate_perplexity`.
    """
    tokenized = _as_tokenized(tokenizer_or_ids, text)
    base = evaluate_perplexity(baseline, tokenized, context_length=context_length, desc=baseline_label, **kwargs)
    mine = evaluate_perplexity(model, tokenized, context_length=context_length, desc=model_label, **kwargs)
    return Comparison(mine, base, model_label, baseline_label)


def format_markdown_table(results: Mapping[str, PerplexityResult] | Comparison, baseline_label: str | None = None) -> str:
    """A markdown table: one row per result; with a baseline, a column of perplexity ratios to it."""
    if isinstance(results, Comparison):
        baseline_label = results.baseline_label
        results = results.results()
    baseline = results.get(baseline_label) if baseline_label else None
    header = ["model", "perplexity", "bits/byte", "word ppl", "scored tokens", "windows", "context/stride"]
    if baseline is not None:
        header.append("ppl ratio")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for label, result in results.items():
        row = [
            label,
            f"{result.perplexity:.4f}",
            "n/a" if result.bits_per_byte is None else f"{result.bits_per_byte:.4f}",
            "n/a" if result.word_perplexity is None else f"{result.word_perplexity:.3f}",
            str(result.num_scored_tokens),
            str(result.num_windows),
            f"{result.context_length}/{result.stride}",
        ]
        if baseline is not None:
            row.append(f"{result.perplexity / baseline.perplexity:.4f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# The `eval` entry point (`mla-convert eval` and the Python API)
# --------------------------------------------------------------------------------------------------


@dataclass
class EvalReport:
    """What `run_eval` measured, ready to print (`markdown`) or save (`to_dict` / JSON)."""

    results: dict[str, PerplexityResult]
    settings: dict = field(default_factory=dict)
    baseline_label: str | None = None
    notes: list[str] = field(default_factory=list)  # what the numbers mean differently from what was asked

    @property
    def ratio(self) -> float | None:
        if self.baseline_label is None:
            return None
        model_label = next(label for label in self.results if label != self.baseline_label)
        return self.results[model_label].perplexity / self.results[self.baseline_label].perplexity

    def markdown(self) -> str:
        return format_markdown_table(self.results, self.baseline_label)

    def to_dict(self) -> dict:
        return {
            "settings": self.settings,
            "results": {label: result.to_dict() for label, result in self.results.items()},
            "baseline": self.baseline_label,
            "ratio": self.ratio,
        }


def load_model_for_eval(model: str | os.PathLike, device: str | torch.device | None = None, dtype: str = "auto",
                        revision: str | None = None, allow_pickle: bool = False):
    """Load any causal LM folder or hub id with stock transformers (no remote code), in eval mode, on `device`
    (default: cuda when there is one)."""
    from ..devices import resolve_device
    from ..io.hf_loading import load_causal_lm
    from ..io.resolve import resolve_model_path
    from ..units import parse_dtype

    path = resolve_model_path(model, revision, allow_pickle)
    torch_dtype = "auto" if dtype in (None, "auto") else parse_dtype(dtype)
    loaded = load_causal_lm(path, dtype=torch_dtype, allow_pickle=allow_pickle)
    return loaded.to(resolve_device(device)).eval(), path


def load_tokenizer_for_eval(*folders: Path):
    """The first folder's tokenizer that loads (a converted model falls back to its source's)."""
    from ..io.hf_loading import ModelLoadError, load_tokenizer

    for folder in folders:
        if folder is None:
            continue
        try:
            return load_tokenizer(folder)
        except ModelLoadError:
            continue
    raise EvaluationError(f"no tokenizer found in {', '.join(str(f) for f in folders if f is not None)}")


def _load_bars(progress: bool):
    """transformers' "Loading weights" bars only where run_eval shows progress: `progress=False` wrote them to stderr."""
    import contextlib

    from ..io.hf_loading import without_load_progress_bars

    return contextlib.nullcontext() if progress else without_load_progress_bars()


def _refuse_wrong_types(model, data, baseline, json_path, **numbers) -> None:
    """run_eval's arguments of the wrong type, named (`context_length="512"` was a TypeError from a comparison)."""
    from ..errors import PreflightError
    from ..options import argument_problems, evaluation_number_arguments, path_argument

    problems = argument_problems(model=path_argument(model), data=path_argument(data),
                                 baseline=path_argument(baseline, optional=True),
                                 json_path=path_argument(json_path, optional=True),
                                 **evaluation_number_arguments(**numbers))
    if problems:
        raise PreflightError(problems)


def _dtypes_differ_note(baseline_label: str, baseline_dtype: str, model_label: str, model_dtype: str) -> str:
    """Each model computes in its own stored dtype under `--dtype auto`: a float32 source beside a bfloat16 export
    puts bfloat16's rounding into the ratio, which a reader would otherwise take for the conversion's alone."""
    return (f"{baseline_label} computed in {baseline_dtype}, {model_label} in {model_dtype} (each in its stored dtype): "
            "the ratio includes the difference in precision too; --dtype fp32 computes both in float32")


def run_eval(
    model: str | os.PathLike,
    data: str | os.PathLike,
    baseline: str | os.PathLike | None = None,
    context_length: int | None = None,
    stride: int | None = None,
    max_windows: int | None = None,
    max_tokens: int | None = None,
    batch_size: int = 1,
    device: str | None = None,
    dtype: str = "auto",
    text_column: str = "text",
    split: str | None = None,
    max_chars: int | None = None,
    json_path: str | os.PathLike | None = None,
    progress: bool = True,
    revision: str | None = None,
    allow_pickle: bool = False,
    labels: tuple[str | None, str | None] | None = None,
    allow_long_context: bool = False,
    _plan: EvalPlan | None = None,
) -> EvalReport:
    """Load `model` (and `baseline`), read `data`, evaluate on identical windows, optionally save JSON.

    `context_length` None: 1024 tokens, or the models' max_position_embeddings when shorter; a longer one
    needs `allow_long_context`; a text (after `max_tokens`) shorter than it is one window of its own length, which
    the results and `settings` record and `notes` says.  Everything `mla-convert eval` refuses (fp16 on a converted model, a device
    that is not there, an unwritable `json_path`) is refused here too, before any model loads.
    The tokenizer comes from the model folder, else from the baseline's (a converted model carries its
    source's tokenizer, but an older export might not).
    `_plan` is internal to `mla-convert eval`: the pre-flight it already ran with these arguments (and its own
    checks), so that the hub lookups and tokenizer loads are not repeated.  It skips every check: the API's
    callers leave it out.
    """
    from .checks import eval_preflight

    if _plan is None:
        _refuse_wrong_types(model, data, baseline, json_path, context_length=context_length, stride=stride,
                            max_windows=max_windows, max_tokens=max_tokens, batch_size=batch_size, max_chars=max_chars)
    plan = _plan or eval_preflight(model, baseline, context_length, allow_long_context=allow_long_context, dtype=dtype,
                                   device=device, stride=stride, max_windows=max_windows, max_tokens=max_tokens,
                                   batch_size=batch_size, json_path=json_path, revision=revision,
                                   allow_pickle=allow_pickle, data=data, text_column=text_column, split=split,
                                   max_chars=max_chars)
    context_length = plan.context
    # the text, its tokens and the windows before any model loads: a missing or empty text, or one too short for
    # a window, fails in seconds rather than after the models
    text = load_text(data, text_column=text_column, split=split, max_chars=max_chars)
    tokenizer = plan.tokenizer or load_tokenizer_for_eval(*(fact.path for fact in plan.facts))
    tokenized = tokenize_with_offsets(tokenizer, text)
    plan_windows(len(tokenized), context_length, stride, max_windows)
    notes = []
    unneeded = unneeded_pickle_note([fact.path for fact in plan.facts if fact is not None]) if allow_pickle else None
    if unneeded:
        notes.append(unneeded)
    tokens = len(tokenized) if max_tokens is None else min(len(tokenized), max_tokens)
    if tokens < context_length:  # the results say so too (context_length, stride): the table and JSON quote them
        notes.append(f"the evaluation text has {tokens} tokens"
                     + (f" (--max-tokens {max_tokens})" if max_tokens is not None and max_tokens < len(tokenized) else "")
                     + f", fewer than the context {context_length}: one window of {tokens} tokens")
    with _load_bars(progress):
        model_obj, _ = load_model_for_eval(model, device, dtype, revision, allow_pickle)
        baseline_obj = None
        if baseline is not None:
            baseline_obj, _ = load_model_for_eval(baseline, device, dtype, revision, allow_pickle)
    if labels is not None:  # what the user typed (a hub id, a relative path), not where it was resolved to
        model, baseline = labels[0] or model, labels[1] or baseline
    options = dict(
        context_length=context_length,
        stride=stride,
        batch_size=batch_size,
        max_tokens=max_tokens,
        max_windows=max_windows,
        progress=progress,
    )
    model_label = str(model)
    if baseline_obj is not None:
        baseline_label = f"{baseline} (baseline)"
        if baseline_label == model_label:
            model_label = f"{model} (model)"
        comparison = compare_models(model_obj, baseline_obj, tokenized, model_label=model_label, baseline_label=baseline_label, **options)
        results = comparison.results()
    else:
        baseline_label = None
        results = {model_label: evaluate_perplexity(model_obj, tokenized, desc=model_label, **options)}
    settings = dict(
        model=str(model),
        baseline=None if baseline is None else str(baseline),
        data=str(data),
        text_column=text_column,
        split=split,
        max_chars=max_chars,
        context_length=next(iter(results.values())).context_length,  # the real window length (a short text: its own)
        stride=next(iter(results.values())).stride,
        max_windows=max_windows,
        max_tokens=max_tokens,
        batch_size=batch_size,
        dtype=str(next(model_obj.parameters()).dtype).replace("torch.", ""),
        baseline_dtype=None if baseline_obj is None else str(next(baseline_obj.parameters()).dtype).replace("torch.", ""),
        device=str(_model_device(model_obj)),
        total_tokens=len(tokenized),
    )
    if settings["baseline_dtype"] not in (None, settings["dtype"]):
        notes.append(_dtypes_differ_note(baseline_label, settings["baseline_dtype"], model_label, settings["dtype"]))
    report = EvalReport(results, settings, baseline_label, notes)
    if json_path is not None:
        absolute_path(json_path).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return report
