"""Fine-tuning settings: one dataclass, read from YAML, overridden by command-line flags.

Every key of a recipe YAML is a field of `FinetuneConfig`, and every field is also a flag
(`max_steps` <-> `--max-steps`), so a launch line can change any setting without editing the file.
Values from YAML and from flags go through the same type coercion (`1e-3` is a float whether YAML
reads it as a number or a string), unknown keys are an error (a typo must not silently do nothing),
and `validate` reports every problem at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml
from transformers import HfArgumentParser

from ..errors import MLAConvertError
from ..io.paths import absolute_path, folder_to_create_problems, real_path
from ..io.writer import parse_shard_size

TRAIN_CHOICES = ("auto", "all", "attention")
MIXED_PRECISION_CHOICES = ("auto", "no", "bf16", "fp16")
DTYPE_CHOICES = ("auto", "fp32", "float32", "bf16", "bfloat16", "fp16", "float16")
SAVE_DTYPE_CHOICES = ("auto", "fp32", "float32", "bf16", "bfloat16")
# fp16: a --target transformers export's latent (~1e-7) is below fp16's range; a serving export keeps its scale through
# fine-tuning, but nothing checks that the trained weights still fit fp16, so the save does not offer it
FINETUNE_FP16 = ("fine-tuning saves bf16 or fp32: a --target transformers export stores its latent at ~1e-7, which "
                 "fp16 flushes to zero, and a fine-tuned serving export's weights are not checked against fp16's range")


class FinetuneConfigError(MLAConvertError):
    """A recipe config or flag is missing, unknown or out of range."""


def setting(default, help: str):
    """A config field and its documentation: the flag's help comes from here (HfArgumentParser reads it)."""
    return field(default=default, metadata={"help": help})


@dataclass
class FinetuneConfig:
    # --- models and folders
    model: Optional[str] = setting(None, "converted folder (stock DeepseekV3 + mla_convert.json)")
    output: Optional[str] = setting(None, "where the fine-tuned folder is written (same layout as `convert`)")
    teacher: Optional[str] = setting(None, "source model; None: `source.name_or_path` of mla_convert.json")
    checkpoint_dir: Optional[str] = setting(None, "checkpoints, teacher samples, train_log.jsonl; None: <output>.checkpoints")
    overwrite: bool = setting(False, "replace an existing `output` written by mla-convert")
    force: bool = setting(False, "with overwrite: also replace a folder that is not an mla-convert output, or a "
                                 "symlink (the link itself, never its target)")
    # --- training text
    data: Optional[str] = setting(None, "file, folder or datasets spec; None: sample text from the teacher")
    text_column: str = setting("text", "text field of a jsonl file or datasets dataset")
    split: Optional[str] = setting(None, "datasets split when `data` names none")
    max_chars: Optional[int] = setting(None, "read only this much of `data`")
    teacher_samples: int = setting(1024, "sequences sampled from the teacher when `data` is None")
    sample_temperature: float = setting(1.0, "sampling temperature of the teacher text")
    sample_top_p: float = setting(0.95, "nucleus of the teacher text")
    sample_batch_size: int = setting(64, "sequences sampled at once (the samples depend on it)")
    seq_len: int = setting(256, "tokens per packed training window")
    # --- optimisation
    train: str = setting("auto", "all: every parameter (heals more per step: BENCHMARKS.md, 'Quality levers'); attention: "
                                 "only self_attn.* parameters; auto: all up to 2B parameters, the attention above (every "
                                 "parameter's AdamW state, 16 bytes each, stays under 32 GB)")
    max_steps: int = setting(300, "optimizer steps; the cosine schedule spans exactly these")
    micro_batch_size: int = setting(8, "windows per process per forward")
    grad_accum: int = setting(1, "forwards per optimizer step")
    lr: float = setting(1e-3, "peak learning rate (AdamW)")
    min_lr_ratio: float = setting(0.1, "the cosine ends at lr * min_lr_ratio")
    warmup_steps: int = setting(10, "optimizer steps of linear warmup before the cosine decay")
    weight_decay: float = setting(0.0, "AdamW weight decay (matrices only; norms and biases never decay)")
    adam_beta1: float = setting(0.9, "AdamW beta1")
    adam_beta2: float = setting(0.95, "AdamW beta2")
    max_grad_norm: float = setting(1.0, "gradient-norm clipping threshold (0 disables clipping)")
    # --- loss: kd_weight * T^2 * KL(teacher_T || student_T) + ce_weight * next-token CE
    kd_weight: float = setting(1.0, "weight of the distillation term T^2 * KL(teacher_T || student_T)")
    temperature: float = setting(1.0, "distillation temperature T")
    ce_weight: float = setting(0.0, "weight of the next-token cross-entropy term")
    # --- precision, memory, speed
    mixed_precision: str = setting("auto", "auto (bf16 autocast on a bf16-capable GPU, none on CPU), no, bf16 or fp16")
    gradient_checkpointing: bool = setting(False, "recompute activations in the backward pass (less memory, about a third more time)")
    teacher_dtype: str = setting("auto", "auto (bf16 on GPU, fp32 on CPU), fp32 or bf16")
    save_dtype: str = setting("auto", "auto (the converted folder's dtype, except an fp16 "
                                           "folder, which is saved in bf16), fp32 or bf16")
    num_threads: Optional[int] = setting(None, "CPU threads for torch (None: torch's default)")
    # --- evaluation: perplexity on non-overlapping windows, token-weighted NLL
    eval_data: Optional[str] = setting(None, "text to report perplexity on (file, folder or datasets spec); None: no evaluation")
    eval_context: int = setting(256, "tokens per evaluation window")
    eval_windows: int = setting(60, "evaluation windows (non-overlapping, from the start of the text)")
    eval_every: int = setting(0, "steps between evaluations (0: only before and after training)")
    eval_batch_size: int = setting(1, "evaluation windows per forward")
    eval_teacher: bool = setting(True, "also report the teacher's perplexity once")
    # --- checkpoints (accelerate save_state + data cursor + history)
    checkpoint_every: int = setting(0, "steps between checkpoints (0: none)")
    keep_checkpoints: int = setting(2, "checkpoints kept in checkpoint_dir (older ones are removed)")
    resume: Optional[str] = setting(None, "\"auto\" (latest in checkpoint_dir) or a checkpoint folder")
    stop_after: Optional[int] = setting(None, "stop with a checkpoint, as if interrupted, once the run has made this many "
                                              "steps in all (counted from its start, resumes included)")
    # --- misc
    seed: int = setting(0, "seed of the data order, the teacher samples and the initialisation of anything random")
    log_every: int = setting(10, "steps between log lines")
    verify_save: bool = setting(True, "reload the saved folder and compare logits with the trained model")
    max_shard_size: str = setting("5GB", "largest output shard, e.g. 5GB")

    # ----------------------------------------------------------------- derived
    @property
    def checkpoint_path(self) -> Path:
        if self.checkpoint_dir:
            return Path(self.checkpoint_dir)
        output = absolute_path(str(self.output))  # "ft/" -> ".../ft": beside it, not inside
        return output.with_name(output.name + ".checkpoints")

    @property
    def distills(self) -> bool:
        return self.kd_weight > 0

    @property
    def needs_teacher(self) -> bool:
        return self.distills or self.data is None or (self.eval_teacher and self.eval_data is not None)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Raise one `FinetuneConfigError` naming every problem, one line each."""
        problems = self.problems()
        if problems:
            raise FinetuneConfigError("\n".join(problems))

    def problems(self) -> list[str]:
        """Every problem of these settings taken together (ranges, choices, combinations), one line each."""
        problems = []
        if not self.model:
            problems.append("model: the converted folder is required (--model)")
        if not self.output:
            problems.append("output: the folder to write the fine-tuned model to is required (--output)")
        if self.train not in TRAIN_CHOICES:
            problems.append(f"train: {self.train!r}; choose one of {', '.join(TRAIN_CHOICES)}")
        if self.mixed_precision not in MIXED_PRECISION_CHOICES:
            problems.append(f"mixed_precision: {self.mixed_precision!r}; choose one of {', '.join(MIXED_PRECISION_CHOICES)}")
        if self.teacher_dtype not in DTYPE_CHOICES:
            problems.append(f"teacher_dtype: {self.teacher_dtype!r}; choose one of auto, fp32, bf16, fp16")
        if self.save_dtype not in SAVE_DTYPE_CHOICES:
            problems.append(f"save_dtype: {self.save_dtype!r}; choose one of auto, fp32, bf16"
                            + (f" ({FINETUNE_FP16})" if self.save_dtype in ("fp16", "float16") else ""))
        try:
            if parse_shard_size(self.max_shard_size) <= 0:
                problems.append(f"max_shard_size {self.max_shard_size!r}: must be positive")
        except ValueError as error:
            problems.append(str(error))
        if self.teacher and not self.needs_teacher:
            problems.append("teacher: not used by this run (kd_weight 0, training text given, no teacher evaluation); "
                            "leave it out")
        if self.force and not self.overwrite:
            problems.append("force: acts only with overwrite (--overwrite --force)")
        for name in ("max_steps", "micro_batch_size", "grad_accum", "eval_windows", "eval_batch_size", "teacher_samples",
                     "sample_batch_size", "keep_checkpoints", "log_every"):
            if getattr(self, name) < 1:
                problems.append(f"{name}: must be at least 1 (got {getattr(self, name)})")
        for name in ("seq_len", "eval_context"):
            if getattr(self, name) < 2:
                problems.append(f"{name}: must be at least 2 tokens (got {getattr(self, name)})")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "weight_decay", "max_grad_norm", "kd_weight", "ce_weight"):
            if getattr(self, name) < 0:
                problems.append(f"{name}: must not be negative (got {getattr(self, name)})")
        for name, kind in _field_types().items():
            value = getattr(self, name)
            if _unwrap_optional(kind)[0] is float and isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{name}: must be a finite number (got {value})")
        if self.lr <= 0:
            problems.append(f"lr: must be positive (got {self.lr})")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"min_lr_ratio: must be between 0 and 1 (got {self.min_lr_ratio})")
        if self.checkpoint_dir and self.output and self.model:
            checkpoints = real_path(absolute_path(str(self.checkpoint_dir)))  # (a symlink loop stays a name)
            for name, folder in (("output", self.output), ("model", self.model)):
                if checkpoints.is_relative_to(real_path(absolute_path(str(folder)))):  # the save replaces OUTPUT whole
                    problems.append(f"checkpoint_dir {self.checkpoint_dir}: inside the {name} folder {folder}; "
                                    "checkpoints go beside it (the default: OUTPUT.checkpoints)")
        problems += self._output_inside_model_problems()
        if self.checkpoint_dir or self.output:
            problems += folder_to_create_problems(self.checkpoint_path, "checkpoint_dir")
        if self.warmup_steps >= self.max_steps:  # (a 1-step run with warmup trained at lr 0 and said it trained)
            problems.append(f"warmup_steps ({self.warmup_steps}) must be below max_steps ({self.max_steps}); "
                            "for a short run lower --warmup-steps too")
        if self.temperature <= 0 or self.sample_temperature <= 0:
            problems.append("temperature and sample_temperature must be positive")
        if not 0 < self.sample_top_p <= 1:
            problems.append(f"sample_top_p: must be in (0, 1] (got {self.sample_top_p})")
        if self.kd_weight == 0 and self.ce_weight == 0:
            problems.append("kd_weight and ce_weight are both 0: nothing to train on")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            problems.append("adam_beta1 and adam_beta2 must be in [0, 1)")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.max_steps:
            problems.append(f"stop_after: must be between 1 and max_steps ({self.max_steps})")
        if self.num_threads is not None and self.num_threads < 1:
            problems.append("num_threads: must be at least 1")
        if self.max_chars is not None and self.max_chars < 1:  # 0 read the whole text in training, 64K in the check
            problems.append(f"max_chars: must be at least 1 (got {self.max_chars})")
        return problems

    def _output_inside_model_problems(self) -> list[str]:
        """An output inside the converted model folder (and its default checkpoints beside it, also inside) would be
        read and uploaded as part of that model (`mla-convert push MODEL` sent them along).  The output being the
        model itself is refused at setup, with --overwrite, as an output that would delete an input."""
        if not (self.output and self.model):
            return []
        output, model = (real_path(absolute_path(str(name))) for name in (self.output, self.model))
        if output == model or not output.is_relative_to(model):
            return []
        return [f"output {self.output}: inside the model folder {self.model}; the fine-tuned folder (and its default "
                f"checkpoints, OUTPUT.checkpoints) goes beside it (e.g. {model.name}-ft)"]


# --------------------------------------------------------------------------- settings that cannot act
# (settings, when they cannot act, why): given on the command line such a setting is refused, from a recipe YAML it is a
# note (a recipe may set them for the runs that use them, and a flag such as `--data` may switch them off).
INERT_WHEN = (
    (("teacher_samples", "sample_temperature", "sample_top_p", "sample_batch_size"), lambda c: c.data is not None,
     "no text is sampled from the teacher: data gives the training text"),
    (("text_column", "split", "max_chars"), lambda c: c.data is None,
     "no data is read: the training text is sampled from the teacher"),
    (("eval_context", "eval_windows", "eval_every", "eval_batch_size", "eval_teacher"), lambda c: c.eval_data is None,
     "there is no eval_data to evaluate on"),
    (("temperature",), lambda c: c.kd_weight == 0, "kd_weight is 0: there is no distillation term"),
    (("teacher_dtype",), lambda c: not c.needs_teacher,
     "no teacher is loaded: kd_weight 0, training text given, no teacher evaluation"),
)
DEFAULTS = {spec.name: spec.default for spec in dataclasses.fields(FinetuneConfig)}


def inert_settings(config: FinetuneConfig, names, as_flags: bool = True) -> list[str]:
    """Of the settings `names` (those given explicitly), the ones this run cannot use, each with the reason; named as
    flags (`--sample-top-p`) or as YAML keys (`sample_top_p`)."""
    from ..eval.checks import text_option_problems

    def spelled(name: str) -> str:
        return "--" + name.replace("_", "-") if as_flags else name

    given = set(names)
    found = []
    for settings, cannot_act, why in INERT_WHEN:
        # a value that asks for nothing different (the default, or off) is harmless wherever it is given
        idle = [name for name in settings if name in given and getattr(config, name) not in (False, DEFAULTS[name])]
        if idle and cannot_act(config):
            found.append(f"{', '.join(map(spelled, idle))}: not used by this run ({why})")
    if config.data is not None:  # a column or a split of a plain local text
        column = config.text_column if "text_column" in given else "text"
        split = config.split if "split" in given else None
        found.extend(problem.replace("--text-column", spelled("text_column")).replace("--split", spelled("split"))
                     for problem in text_option_problems(config.data, column, split, flag=spelled("data")))
    if config.eval_data is not None:  # (a missing local file: with the other problems, not once the model has loaded)
        found.extend(problem for problem in text_option_problems(config.eval_data, flag=spelled("eval_data"))
                     if problem.endswith("no such file or folder"))
    return found


# --------------------------------------------------------------------------- coercion
def _field_types() -> dict[str, object]:
    hints = typing.get_type_hints(FinetuneConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(FinetuneConfig)}


def _unwrap_optional(kind) -> tuple[object, bool]:
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return kind, False


def coerce(name: str, value, kind=None):
    """`value` (from YAML or a flag) as the field's type; 'null'/'none' give None for optional fields."""
    kind = kind if kind is not None else _field_types()[name]
    base, optional = _unwrap_optional(kind)
    if value is None or (optional and isinstance(value, str) and value.strip().lower() in ("null", "none", "~", "")):
        if optional:
            return None
        raise FinetuneConfigError(f"{name}: a value is required")
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("true", "yes", "1", "on"):
                return True
            if text in ("false", "no", "0", "off"):
                return False
            raise ValueError(value)
        if base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(float(value)) if isinstance(value, str) and any(c in value for c in ".eE") else int(value)
        if base is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if base is str:
            if isinstance(value, bool):  # YAML 1.1 reads a bare no/yes/off/on as a boolean
                raise FinetuneConfigError(f"{name}: YAML read {value!r} as a boolean; quote the value (e.g. \"no\")")
            if isinstance(value, (dict, list)):
                raise ValueError(value)
            return str(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: `max_steps: 1e309` in YAML (an infinite int)
        raise FinetuneConfigError(f"{name}: {value!r} is not a valid {getattr(base, '__name__', base)}") from None
    return value


# --------------------------------------------------------------------------- reading
def config_from_mapping(values: dict, base: FinetuneConfig | None = None,
                        problems: list[str] | None = None, refused: set[str] | None = None) -> FinetuneConfig:
    """A config from a mapping of field -> value.  Unknown keys and values of the wrong type are an error, all of them
    in one FinetuneConfigError; or, with `problems` given, appended to it (the config then keeps those fields' earlier
    values, and their names go into `refused`) so that the caller reports them with the rest."""
    types_by_name = _field_types()
    found = []
    unknown = sorted(set(values) - set(types_by_name))
    if unknown:
        found.append(f"unknown config keys: {', '.join(unknown)} (known: {', '.join(sorted(types_by_name))})")
    config = dataclasses.replace(base) if base is not None else FinetuneConfig()
    for name, value in values.items():
        if name in types_by_name:
            try:
                setattr(config, name, coerce(name, value, types_by_name[name]))
            except FinetuneConfigError as error:
                found.append(str(error))
                if refused is not None:
                    refused.add(name)
    if problems is not None:
        problems += found
    elif found:
        raise FinetuneConfigError("\n".join(found))
    return config


def load_yaml_config(path: str | Path) -> dict:
    path = Path(path)
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as error:
        raise FinetuneConfigError(f"{path}: cannot read the config ({error.strerror or error})") from error
    except yaml.YAMLError as error:
        raise FinetuneConfigError(f"{path}: not valid YAML ({str(error).splitlines()[0]})") from error
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise FinetuneConfigError(f"{path}: the config must be a mapping of keys to values")
    return loaded


class SettingsParser(HfArgumentParser):
    """A bad flag is one `error:` line and exit status 2, like every other mla-convert error (not a usage dump)."""

    def error(self, message: str):
        raise FinetuneConfigError(f"{message} (see --help)")


def build_parser(prog: str | None = None) -> HfArgumentParser:
    """`--config FILE` plus one flag per field (`--max-steps` and `--max_steps`), help from each field's metadata.

    Flag defaults are SUPPRESS, so only the flags actually given reach the namespace and YAML
    values survive the ones not given.
    """
    parser = SettingsParser(
        FinetuneConfig,
        prog=prog,
        usage=f"{prog or '%(prog)s'} MODEL OUTPUT [--config FILE] [--SETTING VALUE ...]  (MODEL and OUTPUT first, or "
              "as --model / --output anywhere)",
        description="Fine-tune a converted MLA model (distillation from its source model) and save a stock DeepseekV3 folder.",
    )
    parser.add_argument("--config", help="YAML file of settings; flags override its keys")
    defaults = {spec.name: spec.default for spec in dataclasses.fields(FinetuneConfig)}
    for action in parser._actions:  # a flag not given must not reach the namespace (argparse's own mechanism)
        if action.dest in defaults:
            action.default = argparse.SUPPRESS
            if any(flag.startswith("--no_") for flag in action.option_strings):  # the switch's off side
                action.help = f"turn {action.dest} off (on by default: {action.help})"
            elif defaults[action.dest] is not None:
                action.help = f"{action.help} (default: {defaults[action.dest]})"
    return parser


NONE_WORDS = ("null", "none", "~", "")


# Settings that name files or folders.  In a YAML file they are relative to that file (a config works from
# any current directory); on the command line, relative to the current directory as usual.
OUTPUT_PATHS = ("output", "checkpoint_dir")
INPUT_PATHS = ("model", "teacher", "data", "eval_data", "resume")


# Inputs that can only be local (a converted folder, a checkpoint): relative to the YAML file always, like outputs.
LOCAL_INPUT_PATHS = ("model", "resume")


def paths_relative_to(values: dict, folder: Path) -> dict:
    """YAML values with their paths made relative to `folder` (the config's own): outputs and local-only inputs
    (`model`, `resume`) always, other inputs when they are written as relative paths (`./`, `../`) or exist there (a
    hub id or a `datasets` spec stays as written).  A relative path never resolves from the current directory."""
    out = dict(values)
    for key in OUTPUT_PATHS + INPUT_PATHS:
        value = out.get(key)
        if not isinstance(value, str) or not value or value == "auto" or Path(value).expanduser().is_absolute():
            continue
        candidate = folder / Path(value).expanduser()
        if key in OUTPUT_PATHS + LOCAL_INPUT_PATHS or value.startswith(("./", "../")) or candidate.exists():
            out[key] = str(candidate)
    return out


def yaml_path_problems(values: dict, resolved: dict, config_file: str) -> list[str]:
    """One line per input path of a YAML config that is not where the config says (`paths_relative_to` made it
    relative to the file), and per value kept as a hub id or dataset spec that is a path of the current directory
    only: relative paths in a YAML config are relative to the file, never to where the command runs."""
    problems = []
    for key in INPUT_PATHS:
        value, found = values.get(key), resolved.get(key)
        if not isinstance(value, str) or not value or value == "auto" or not isinstance(found, str):
            continue
        if found != value and not Path(found).exists():
            problems.append(f"{key}: {value!r} (in {config_file}) not found: looked for {found} (paths in a YAML config "
                            "are relative to the file's folder)")
        elif found == value and not Path(value).expanduser().is_absolute() and Path(value).exists():
            problems.append(f"{key}: {value!r} (in {config_file}) is not next to the config file (looked for "
                            f"{Path(config_file).resolve().parent / value}) but in the current directory; paths in a "
                            "YAML config are relative to the file's folder: write it as seen from there, or absolute")
    return problems


class _Refused:
    """A flag value its type refused, kept in the parsed namespace so that parsing goes on to the other flags."""

    def __init__(self, message: str):
        self.message = message


def _collect_type_errors(parser: argparse.ArgumentParser) -> None:
    """argparse stops at the first value of the wrong type (`--max-steps abc`): each setting's type now returns a
    `_Refused` instead, and `parse_config` lists it with every other problem.  (Flags with choices keep argparse's
    check, which a `_Refused` could not pass.)"""
    for action in parser._actions:
        if action.type is None or action.choices is not None or not action.option_strings:
            continue

        def checked(text, convert=action.type, flag=action.option_strings[-1]):
            try:
                value = convert(text)
            except (ValueError, TypeError, OverflowError, argparse.ArgumentTypeError):
                kind = {"string_to_bool": "boolean"}.get(getattr(convert, "__name__", ""), getattr(convert, "__name__", ""))
                return _Refused(f"{flag}: invalid {kind + ' ' if kind.isidentifier() else ''}value: {text!r}")
            if isinstance(value, float) and not math.isfinite(value):  # `--lr 1e309` was echoed as "lr: ... (got inf)"
                return _Refused(f"{flag}: {text!r} is not a finite number")
            return value

        action.type = checked


def parse_config(argv: list[str] | None = None, prog: str | None = None, notes: list[str] | None = None) -> FinetuneConfig:
    """YAML (if `--config`, its paths relative to itself) then flags, then validation.

    A flag the run cannot use is refused; a YAML key it cannot use is appended to `notes` (when given).
    """
    parser = build_parser(prog)
    _collect_type_errors(parser)
    namespace, unknown = parser.parse_known_args(argv)  # unknown flags are reported with every other problem
    given = vars(namespace)
    config_file = given.pop("config", None)
    # an empty value would quietly mean "none" (e.g. `--data ""`: sample the teacher instead of reading a text)
    empty = [name for name, value in [("config", config_file), *given.items()] if isinstance(value, str) and not value.strip()]
    problems = [f"unrecognized arguments: {' '.join(unknown)} (see --help)"] if unknown else []
    problems += [value.message for value in given.values() if isinstance(value, _Refused)]
    problems += [f"--{name.replace('_', '-')}: must not be empty" + ("" if name == "config" else
                 " (write none to clear a setting the config file gives)") for name in empty]
    # fields whose value was refused keep their default: what problems() says about that default is not news
    refused = set(empty) | {name for name, value in given.items() if isinstance(value, _Refused)}
    given = {name: value for name, value in given.items() if name not in refused}
    values = {}
    if config_file and "config" not in empty:
        try:
            written = load_yaml_config(config_file)
            values = paths_relative_to(written, Path(config_file).resolve().parent)
            problems += [problem for problem in yaml_path_problems(written, values, config_file)
                         if problem.split(":")[0] not in given]  # a flag given instead: the YAML's value is unused
        except FinetuneConfigError as error:  # unreadable: its keys are unknown, the flags are still checked
            problems.append(str(error))
    config = config_from_mapping(values, problems=problems, refused=refused)  # all problems are reported below
    types_by_name = _field_types()
    for name, value in given.items():
        optional = _unwrap_optional(types_by_name[name])[1]
        if optional and isinstance(value, str) and value.strip().lower() in NONE_WORDS:
            given[name] = None  # `--data none` clears what the YAML set
    config = dataclasses.replace(config, **given)
    for key in OUTPUT_PATHS + INPUT_PATHS:  # `~/x` in YAML, or in `--model=~/x` where no shell expanded it
        value = getattr(config, key)
        if isinstance(value, str) and value.startswith("~"):
            setattr(config, key, str(Path(value).expanduser()))
    problems += [problem for problem in config.problems()
                 if not any(problem.startswith((f"{name}:", f"{name} ")) for name in refused)]
    problems += inert_settings(config, given)  # a flag that does nothing must not look as if it did something
    if problems:
        raise FinetuneConfigError("\n".join(dict.fromkeys(problems)))
    if notes is not None:
        notes.extend(f"{config_file}: {problem}" for problem in inert_settings(config, set(values) - set(given), as_flags=False))
    return config
