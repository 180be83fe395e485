"""Every transformers `from_pretrained` of the package goes through here: no code from a model folder, no
pickles without the user's opt-in.

transformers runs a model folder's own Python when its config or tokenizer config names one (`auto_map`)
and `trust_remote_code` is true, and it *asks* on a terminal when the argument is left out; mla-convert
never runs such code, so it always passes `trust_remote_code=False` (transformers then refuses with its
own message).  Pickled `*.bin` weights are loaded only with `allow_pickle` (and then with
`weights_only=True`, which transformers uses by default); without it a folder that holds nothing else is
refused before transformers sees it.

Weights that do not match the config are refused too: transformers initialises a tensor the checkpoint lacks at
random and drops one the model has no place for, with a printed table and nothing else, so `eval` scored (and wrote
into a card) a model that was partly random noise, and `finetune` trained one.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from ..errors import CheckpointError, MLAConvertError
from .config_file import read_config_json


class ModelLoadError(MLAConvertError):
    """transformers could not build the model, tokenizer or config from a folder."""


def _first_line(error: BaseException) -> str:
    """The error's first line, with the next when the first only announces it (huggingface_hub's validation errors:
    "Validation error for field 'eos_token_id':" then what is wrong with it)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()] or [type(error).__name__]
    return " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def _refusals() -> tuple[type[BaseException], ...]:
    """What transformers raises for a folder it will not load (a config field of the wrong type is rejected by
    huggingface_hub's strict dataclasses, an Exception of their own)."""
    from huggingface_hub.errors import StrictDataclassError

    return OSError, ValueError, TypeError, KeyError, StrictDataclassError


def weights_problems(folder: str | os.PathLike, allow_pickle: bool = False, pickle_flag: bool = True) -> list[str]:
    """Why the weights of `folder` must not or cannot be loaded (headers only; empty: they can).  `pickle_flag`:
    the command has --allow-pickle, so its messages may offer it."""
    from .reader import CheckpointReader

    try:
        reader = CheckpointReader(folder, allow_pickle=allow_pickle, pickle_flag=pickle_flag)
    except CheckpointError as error:
        return [str(error)]
    problems = reader.header_problems()
    if problems or reader.format != "safetensors":
        return problems
    return non_floating_problems(reader)


def non_floating_problems(reader) -> list[str]:
    """A stored tensor that is not floating point (one line; [] when all are).  transformers casts an integer tensor
    to the model's dtype without a word: a weight saved as int32 loaded as its rounded values, and was scored, trained
    and pushed so."""
    try:
        infos = reader.tensor_infos()
    except CheckpointError as error:
        return [str(error)]
    integral = sorted(name for name, info in infos.items() if not info.dtype.is_floating_point)
    if not integral:
        return []
    name = integral[0]
    return [f"{Path(reader.folder) / infos[name].file}: {len(integral)} tensor(s) of a non-floating-point dtype (e.g. "
            f"{name!r}: {str(infos[name].dtype).removeprefix('torch.')}); a model's weights are floating point, so the "
            "file is damaged or not a model checkpoint"]


def config_json_problem(folder: str | os.PathLike) -> str | None:
    """What is missing for transformers' Auto classes to pick a model class from `folder/config.json`: the file, a JSON
    object in it, or its `model_type` (None: it has one).  Asked once transformers has refused the folder: its own
    message for all three ("Unrecognized model in X. Should have a `model_type` key in its config.json") names none of
    our flags or files, and says model_type for a folder that has no config.json at all."""

    try:
        raw = read_config_json(folder)
    except CheckpointError as error:
        return str(error)
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type.strip():
        return None
    path = Path(folder) / "config.json"
    found = "no \"model_type\"" if model_type is None else f"\"model_type\" {model_type!r} is not a model type"
    named = _model_type_of(raw.get("architectures"))
    hint = (f"; its architectures name {named[1]}: add \"model_type\": \"{named[0]}\"" if named else
            "; is this a model's config?")
    return f"{path}: {found}, which transformers needs to pick the model class{hint}"


def _model_type_of(architectures) -> tuple[str, str] | None:
    """(model_type, class name) for the first causal-LM class `architectures` names that transformers knows.  Several
    model types share some classes (deepseek_v3 and sarvam_mla build DeepseekV3ForCausalLM): the one the class is named
    after is meant (None when no single one is)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not isinstance(architectures, list):
        return None
    for name in architectures:
        if not isinstance(name, str):
            continue
        squeezed = name.lower().replace("_", "")
        types = [model_type for model_type, known in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if known == name]
        named = [model_type for model_type in types if squeezed.startswith(model_type.replace("_", "").replace("-", ""))]
        if len(types) == 1 or len(named) == 1:
            return (types[0] if len(types) == 1 else named[0]), name
    return None


def load_config(folder: str | os.PathLike):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    except _refusals() as error:
        raise ModelLoadError(config_json_problem(folder)
                             or f"{folder}: transformers cannot read its config ({_first_line(error)})") from error


def load_tokenizer(folder: str | os.PathLike):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except _refusals() as error:
        raise ModelLoadError(f"{folder}: transformers cannot load its tokenizer ({_first_line(error)})") from error


@contextlib.contextmanager
def without_load_progress_bars():
    """Silence transformers' per-load "Loading weights" bar: our own phases already say what is loading,
    and two bars drawn at once (rich's and tqdm's) garble a terminal and litter a log."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_causal_lm(folder: str | os.PathLike, dtype: torch.dtype | str = "auto", allow_pickle: bool = False,
                   pickle_flag: bool = True, **kwargs):
    """A causal LM from a local folder, weights checked first (refused pickles, damaged shards).  `pickle_flag`: the
    command that loads it has --allow-pickle (finetune has none: its refusal of pickles must not offer one)."""
    from transformers import AutoModelForCausalLM

    problems = weights_problems(folder, allow_pickle, pickle_flag)
    if problems:
        raise CheckpointError("\n".join(problems))
    try:
        with _load_report_silenced():
            model, loading = AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=dtype, trust_remote_code=False, use_safetensors=None if allow_pickle else True,
                output_loading_info=True, **kwargs)
    except (*_refusals(), RuntimeError) as error:
        raise ModelLoadError(config_json_problem(folder)
                             or f"{Path(folder)}: cannot load as a causal LM ({_first_line(error)})") from error
    problem = loading_problem(folder, loading)
    if problem:
        raise CheckpointError(problem)
    return model


def loading_problem(folder: str | os.PathLike, loading: dict) -> str | None:
    """Why a model transformers built from `folder` is not the checkpoint's model (None: every tensor it needs came
    from the checkpoint and every stored tensor found its place), from transformers' own loading report (which
    already leaves out what a model class declares ignorable, e.g. old Llama checkpoints' rotary `inv_freq`)."""
    missing = sorted(loading.get("missing_keys") or ())
    unexpected = sorted(loading.get("unexpected_keys") or ())
    mismatched = sorted(str(entry[0] if isinstance(entry, tuple) else entry) for entry in loading.get("mismatched_keys") or ())
    parts = []
    for names, what in ((missing, "the model config.json describes needs, not in the weights (transformers would "
                                  "initialise them at random)"),
                        (unexpected, "in the weights that the model config.json describes has no place for"),
                        (mismatched, "whose stored shape differs from the model's")):
        if names:
            parts.append(f"{len(names)} tensor(s) {what}: {', '.join(names[:3])}" + (" ..." if len(names) > 3 else ""))
    if not parts:
        return None
    return (f"{Path(folder)}: the weights do not match config.json: {'; '.join(parts)}. The weights and config.json "
            "come from different models or conversions, or a file was edited: nothing was run on this model")


@contextlib.contextmanager
def _load_report_silenced():
    """transformers prints a MISSING/UNEXPECTED table as a warning; `loading_problem` says the same as one error."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
