"""Pre-flight of `eval` (and the model half of `generate`): every problem listed before any model is loaded.

What the evaluation of a model needs to be meaningful, checked from configs and headers alone: weights
that are safe to load (no pickles without `--allow-pickle`, no damaged shards, no special files), a config
transformers can read without running code, a context within the model's positions (a longer context
silently measures extrapolation: stories260K, 512 positions, scores 111 at 1024 against 46 at 256), and no
fp16 on a converted model (its tiny-scale latent underflows: 109.9 against 46.6 in fp32 on the same windows).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..convert import target as T
from ..errors import MLAConvertError
from ..io.hf_loading import load_config, weights_problems
from ..io.paths import model_folder_problems, read_model_text
from ..io.resolve import resolve_model_path
from ..units import parse_dtype

DEFAULT_CONTEXT = 1024


@dataclass(frozen=True)
class ModelFacts:
    """What the checks learnt about one model folder."""

    path: Path
    max_positions: int | None
    converted: bool  # a DeepseekV3 export (fp16 refused)
    architecture: str | None = None  # config.architectures[0]
    hidden_size: int | None = None
    num_layers: int | None = None
    vocab_size: int | None = None  # rows of the input embedding
    serving: bool = False  # an export rewritten for the serving engines (weights in fp16's range)


def model_facts(name: str | os.PathLike, revision: str | None, allow_pickle: bool, problems: list[str],
                flag: str = "model", pickle_flag: bool = True) -> ModelFacts | None:
    """Resolve `name` (folder or hub id) and check it; problems are appended, None when it cannot be used.
    `pickle_flag`: the command has --allow-pickle (False for generate: its messages must not offer it)."""
    try:
        path = resolve_model_path(name, revision, allow_pickle)
    except MLAConvertError as error:
        problems.append(str(error))
        return None
    found = model_folder_problems(path, flag)
    if found:
        problems += found
        return None
    found = weights_problems(path, allow_pickle, pickle_flag)
    try:
        config = load_config(path)
    except MLAConvertError as error:
        problems += found + [str(error)]
        return None
    problems += found
    positions = getattr(config, "max_position_embeddings", None)
    architectures = getattr(config, "architectures", None) or [None]
    vocab_size = getattr(config, "vocab_size", None)
    converted = getattr(config, "model_type", None) == T.MODEL_TYPE
    return ModelFacts(path, positions if isinstance(positions, int) else None, converted,
                      architectures[0], getattr(config, "hidden_size", None), getattr(config, "num_hidden_layers", None),
                      vocab_size if isinstance(vocab_size, int) else None, converted and _serving_export(path))


def _serving_export(folder: Path) -> bool:
    """Whether the folder's report says a serving --target rewrote it (unreadable or absent: not known, so no)."""
    import json

    from ..convert.report import REPORT_FILE

    try:
        report = json.loads(read_model_text(folder / REPORT_FILE))
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and isinstance(report.get("serving"), dict)


def load_tokenizers(facts: list[ModelFacts | None]) -> dict[Path, object]:
    """Each model's own tokenizer, by folder, for those that have one that loads (in `facts`' order)."""
    from ..io.hf_loading import ModelLoadError, load_tokenizer

    tokenizers = {}
    for fact in facts:
        if fact is not None and fact.path not in tokenizers:
            try:
                tokenizers[fact.path] = load_tokenizer(fact.path)
            except ModelLoadError:
                continue
    return tokenizers


def tokenizer_problems(facts: list[ModelFacts | None], tokenizers: dict[Path, object],
                       flags: tuple[str, str] = ("model", "--baseline"),
                       consequence: str = "both models are scored on the ids of one tokenizer, so the perplexities "
                                          "would not be comparable") -> list[str]:
    """The one rule for two models that are compared (`eval --baseline`) or distilled (`finetune --teacher`): both
    read the ids of one tokenizer (the first model's, else the second's), so each must embed all of its ids, and a
    second model with its own tokenizer must have the same one.

    A baseline with a smaller vocabulary crashed in the embedding after both models had loaded; one with another
    tokenizer of the same size was scored on ids that meant other words to it, and compared as if comparable; a
    teacher with another tokenizer was distilled from anyway.  `tokenizers`: what `load_tokenizers(facts)` returned;
    `flags`: how the command names the two models.
    """
    known = [fact for fact in facts if fact is not None]
    if not known or not tokenizers:
        return [f"no tokenizer loads from {' or '.join(str(fact.path) for fact in known)}"] if known else []
    used_from = next(fact.path for fact in known if fact.path in tokenizers)
    vocabulary = tokenizers[used_from].get_vocab()
    largest_id = max(vocabulary.values())
    problems = []
    for flag, fact in zip(flags, facts):
        if fact is None:
            continue
        if fact.vocab_size is not None and largest_id >= fact.vocab_size:
            problems.append(f"{flag} {fact.path}: embeds {fact.vocab_size} token ids, but the tokenizer of {used_from} "
                            f"has ids up to {largest_id}; both models read that tokenizer's ids")
        elif fact.path != used_from and fact.path in tokenizers and tokenizers[fact.path].get_vocab() != vocabulary:
            problems.append(f"{flag} {fact.path}: its tokenizer differs from that of {used_from}; {consequence}")
    return problems


def context_for(facts: list[ModelFacts], context: int | None, allow_long_context: bool, problems: list[str],
                flag: str = "--context", consequence: str = " and scores would measure extrapolation") -> int:
    """The evaluation context: given, or min(1024, every model's max_position_embeddings)."""
    limits = [(f.path, f.max_positions) for f in facts if f.max_positions]
    if context is None:
        return min([DEFAULT_CONTEXT] + [limit for _, limit in limits])
    for path, limit in limits:
        if context > limit and not allow_long_context:
            problems.append(f"{flag} {context}: longer than {path}'s max_position_embeddings ({limit}); the model never saw "
                            f"such positions{consequence}. Use a shorter {flag} or --allow-long-context")
    return context


def dtype_problems(dtype: str, facts: list[ModelFacts], flag: str = "--dtype", converted: bool | None = None) -> list[str]:
    """`converted`: whether a model fp16 cannot hold is evaluated (default: any of `facts` is a converted model that
    no serving --target rewrote)."""
    if dtype in (None, "auto"):
        return []
    try:
        parsed = parse_dtype(dtype)
    except MLAConvertError as error:
        return [f"{flag}: {error}"]
    import torch

    if converted is None:  # (a serving export's weights fit fp16's range)
        converted = any(f.converted and not f.serving for f in facts)
    if parsed == torch.float16 and converted:
        return [f"{flag} fp16: {T.FP16_REFUSED}"]
    return []


def positive_problems(values: dict[str, float | None], minimum: dict[str, int] | None = None) -> list[str]:
    """`--flag value` pairs that must be at least 1 (or the given minimum); None is 'not given'."""
    problems = []
    for flag, value in values.items():
        low = (minimum or {}).get(flag, 1)
        if value is not None and value < low:
            problems.append(f"{flag} {value}: must be at least {low}")
    return problems


def results_file_problems(json_path: str | os.PathLike | None, data: str | os.PathLike | None,
                          facts: list[ModelFacts]) -> list[str]:
    """`--json` may replace an earlier result, never an input: the text, a model's file (config.json included), or
    any other file."""
    from ..io.paths import absolute_path, real_path

    if json_path is None or not os.fspath(json_path).strip():  # empty: refused by output_file_problems
        return []
    path = absolute_path(json_path)
    for fact in facts:
        if real_path(path).is_relative_to(real_path(fact.path)):
            return [f"--json {json_path}: inside the model folder {fact.path}; write the results elsewhere"]
    if data is not None and Path(os.fspath(data)).expanduser().exists() and \
            real_path(path).is_relative_to(real_path(os.fspath(data))):
        return [f"--json {json_path}: is the evaluation text (--data); write the results elsewhere"]
    if path.is_file() and not _is_eval_result(path):
        return [f"--json {json_path}: exists and is not an earlier `mla-convert eval` result; give a new file name "
                "(or remove it)"]
    return []


def _is_eval_result(path: Path) -> bool:
    import json

    try:
        written = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(written, dict) and isinstance(written.get("results"), dict) and isinstance(written.get("settings"), dict)


def text_option_problems(data: str | os.PathLike | None, text_column: str = "text", split: str | None = None,
                         max_chars: int | None = None, flag: str = "--data") -> list[str]:
    """Options of the text that cannot act on it: a text column names a field of .jsonl or dataset rows (a plain
    text file has none), a split picks from a dataset (a local file or folder has none).  An empty spec is refused:
    as a path it is the current folder, whose text files would be read."""
    problems = positive_problems({"--max-chars": max_chars})
    if data is None:
        return problems
    if not os.fspath(data).strip():
        return problems + [f"{flag}: must not be empty (a text file, a folder or a datasets spec)"]
    path = Path(os.fspath(data)).expanduser()
    from ..data.textdata import looks_like_path

    if not path.exists() and ":" not in os.fspath(data) and looks_like_path(os.fspath(data)):
        # (read at load time, after every other check: a typo came one run after the other problems)
        return problems + [f"{flag}: {data}: no such file or folder"]
    plain_folder = path.is_dir() and not any(p.suffix.lower() == ".jsonl" for p in path.rglob("*") if p.is_file())
    if text_column != "text" and ((path.is_file() and path.suffix.lower() != ".jsonl") or plain_folder):
        problems.append(f"--text-column {text_column}: acts only with .jsonl files, folders holding them, or datasets; "
                        f"{data} is plain text")
    if split is not None and path.exists():
        problems.append(f"--split {split}: acts only with a datasets spec; {data} is a local "
                        f"{'folder' if path.is_dir() else 'file'}")
    return problems


@dataclass(frozen=True)
class EvalPlan:
    """What `eval_preflight` found: the models' facts (model first, baseline second when given), the context and,
    for an evaluation, the tokenizer every model is scored with (loaded once, for the checks and the scoring)."""

    facts: list[ModelFacts | None]
    context: int
    tokenizer: object | None = None


def eval_preflight(model: str | os.PathLike, baseline: str | os.PathLike | None, context: int | None, *,
                   allow_long_context: bool = False, dtype: str = "auto", device: str | None = None,
                   stride: int | None = None, max_windows: int | None = None, max_tokens: int | None = None,
                   batch_size: int = 1, json_path: str | os.PathLike | None = None, revision: str | None = None,
                   allow_pickle: bool = False, problems: list[str] | None = None, data: str | os.PathLike | None = None,
                   text_column: str = "text", split: str | None = None, max_chars: int | None = None) -> EvalPlan:
    """Every check an evaluation needs before loading a model, for `eval` and for `run_eval` alike (the API
    must not silently score fp16 underflow or extrapolated positions either).  Problems are appended to
    `problems` when given (the caller adds its own and raises), else raised here as one `PreflightError`."""
    from ..devices import device_problems
    from ..errors import PreflightError
    from ..io.paths import output_file_problems

    found: list[str] = []
    facts = [model_facts(model, revision, allow_pickle, found, "model")]
    if baseline is not None:
        facts.append(model_facts(baseline, revision, allow_pickle, found, "baseline"))
    known = [f for f in facts if f is not None]
    context = context_for(known, context, allow_long_context, found)
    found += dtype_problems(dtype, known)
    found += positive_problems({"--context": context, "--stride": stride, "--max-windows": max_windows,
                                "--max-tokens": max_tokens, "--batch-size": batch_size},
                               minimum={"--context": 2, "--max-tokens": 2})
    if stride is not None and stride > context >= 2:
        found.append(f"--stride {stride}: longer than the context ({context}); the tokens between windows would never "
                     "be scored")
    found += device_problems(device) + output_file_problems(json_path, "--json")
    found += results_file_problems(json_path, data, known) + text_option_problems(data, text_column, split, max_chars)
    tokenizer = None
    if data is not None:  # an evaluation (not the model half of another command)
        tokenizers = load_tokenizers(facts)
        found += tokenizer_problems(facts, tokenizers)
        tokenizer = next(iter(tokenizers.values()), None)  # the model's own, else the baseline's
    if problems is not None:
        problems += found
    elif found:
        raise PreflightError(list(dict.fromkeys(found)))
    return EvalPlan(facts, context, tokenizer)
