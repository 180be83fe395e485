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
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..errors import MLAConvertError

TRAIN_CHOICES = ("attention", "all")
MIXED_PRECISION_CHOICES = ("auto", "no", "bf16", "fp16")
DTYPE_CHOICES = ("auto", "fp32", "float32", "bf16", "bfloat16", "fp16", "float16")


class FinetuneConfigError(MLAConvertError):
    """A recipe config or flag is missing, unknown or out of range."""


@dataclass
class FinetuneConfig:
    # --- models and folders
    model: str | None = None  # converted folder (stock DeepseekV3 + mla_convert.json)
    output: str | None = None  # where the fine-tuned folder is written (same layout as `convert`)
    teacher: str | None = None  # source model; None: `source.name_or_path` of mla_convert.json
    checkpoint_dir: str | None = None  # checkpoints, teacher samples, train_log.jsonl; None: <output>.checkpoints
    overwrite: bool = False  # replace an existing `output`
    # --- training text
    data: str | None = None  # file, folder or datasets spec; None: sample text from the teacher
    text_column: str = "text"  # text field of a jsonl file or datasets dataset
    split: str | None = None  # datasets split when `data` names none
    max_chars: int | None = None  # read only this much of `data`
    teacher_samples: int = 512  # sequences sampled from the teacher when `data` is None
    sample_temperature: float = 1.0  # sampling temperature of the teacher text
    sample_top_p: float = 0.95  # nucleus of the teacher text
    sample_batch_size: int = 64  # sequences sampled at once (the samples depend on it)
    seq_len: int = 256  # tokens per packed training window
    # --- optimisation
    train: str = "attention"  # attention: only self_attn.* parameters; all: every parameter
    max_steps: int = 100  # optimizer steps; the cosine schedule spans exactly these
    micro_batch_size: int = 8  # windows per process per forward
    grad_accum: int = 1  # forwards per optimizer step
    lr: float = 1e-3  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 10
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    max_grad_norm: float = 1.0  # 0 disables clipping
    # --- loss: kd_weight * T^2 * KL(teacher_T || student_T) + ce_weight * next-token CE
    kd_weight: float = 1.0
    temperature: float = 1.0
    ce_weight: float = 0.0
    # --- precision, memory, speed
    mixed_precision: str = "auto"  # auto: bf16 autocast on a bf16-capable GPU, none on CPU
    gradient_checkpointing: bool = False
    teacher_dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    save_dtype: str = "auto"  # auto: the converted folder's dtype
    num_threads: int | None = None  # CPU threads for torch (None: torch's default)
    # --- evaluation: perplexity on non-overlapping windows, token-weighted NLL
    eval_data: str | None = None
    eval_context: int = 256
    eval_windows: int = 60
    eval_every: int = 0  # steps between evaluations (0: only before and after training)
    eval_batch_size: int = 1
    eval_teacher: bool = True  # also report the teacher's perplexity once
    # --- checkpoints (accelerate save_state + data cursor + history)
    checkpoint_every: int = 0  # steps between checkpoints (0: none)
    keep_checkpoints: int = 2
    resume: str | None = None  # "auto" (latest in checkpoint_dir) or a checkpoint folder
    stop_after: int | None = None  # stop after this many steps with a checkpoint, as if interrupted
    # --- misc
    seed: int = 0
    log_every: int = 10
    verify_save: bool = True  # reload the saved folder and compare logits with the trained model
    max_shard_size: str = "5GB"

    # ----------------------------------------------------------------- derived
    @property
    def checkpoint_path(self) -> Path:
        if self.checkpoint_dir:
            return Path(self.checkpoint_dir)
        return Path(str(self.output) + ".checkpoints")

    @property
    def distills(self) -> bool:
        return self.kd_weight > 0

    @property
    def needs_teacher(self) -> bool:
        return self.distills or self.data is None or (self.eval_teacher and self.eval_data is not None)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Raise one `FinetuneConfigError` naming every problem."""
        problems = []
        if not self.model:
            problems.append("model: the converted folder is required (--model)")
        if not self.output:
            problems.append("output: the folder to write the fine-tuned model to is required (--output)")
        if self.train not in TRAIN_CHOICES:
            problems.append(f"train: {self.train!r}; choose one of {', '.join(TRAIN_CHOICES)}")
        if self.mixed_precision not in MIXED_PRECISION_CHOICES:
            problems.append(f"mixed_precision: {self.mixed_precision!r}; choose one of {', '.join(MIXED_PRECISION_CHOICES)}")
        for name in ("teacher_dtype", "save_dtype"):
            if getattr(self, name) not in DTYPE_CHOICES:
                problems.append(f"{name}: {getattr(self, name)!r}; choose one of auto, fp32, bf16, fp16")
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
        if self.lr <= 0:
            problems.append(f"lr: must be positive (got {self.lr})")
        if not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"min_lr_ratio: must be between 0 and 1 (got {self.min_lr_ratio})")
        if self.warmup_steps >= self.max_steps and self.max_steps > 1:
            problems.append(f"warmup_steps ({self.warmup_steps}) must be below max_steps ({self.max_steps})")
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
        if problems:
            raise FinetuneConfigError("; ".join(problems))


# --------------------------------------------------------------------------- coercion
def _field_types() -> dict[str, object]:
    hints = typing.get_type_hints(FinetuneConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(FinetuneConfig)}


def _field_comments() -> dict[str, str]:
    """Each field's trailing `# comment` in the class source: the flags' help (one place documents a key)."""
    import inspect
    import re

    pattern = re.compile(r"^\s+(\w+): [^=]+=.*?#\s*(.+)$")
    found = {}
    for line in inspect.getsource(FinetuneConfig).splitlines():
        match = pattern.match(line)
        if match:
            found[match.group(1)] = match.group(2).strip()
    return found


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
    except (TypeError, ValueError):
        raise FinetuneConfigError(f"{name}: {value!r} is not a valid {getattr(base, '__name__', base)}") from None
    return value


# --------------------------------------------------------------------------- reading
def config_from_mapping(values: dict, base: FinetuneConfig | None = None) -> FinetuneConfig:
    """A config from a mapping of field -> value (unknown keys are an error, listed all at once)."""
    types_by_name = _field_types()
    unknown = sorted(set(values) - set(types_by_name))
    if unknown:
        raise FinetuneConfigError(f"unknown config keys: {', '.join(unknown)} (known: {', '.join(sorted(types_by_name))})")
    config = dataclasses.replace(base) if base is not None else FinetuneConfig()
    for name, value in values.items():
        setattr(config, name, coerce(name, value, types_by_name[name]))
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


def build_parser() -> argparse.ArgumentParser:
    """`--config FILE` plus one flag per field; flags default to 'not given' so YAML values survive."""
    parser = argparse.ArgumentParser(
        description="Fine-tune a converted MLA model (distillation from its source model) and save a stock DeepseekV3 folder.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help="YAML file of settings; flags override its keys")
    comments = _field_comments()
    defaults = FinetuneConfig()
    for name, kind in _field_types().items():
        flag = "--" + name.replace("_", "-")
        base, _ = _unwrap_optional(kind)
        text = f"{comments.get(name, '')} (default: {getattr(defaults, name)})".strip()
        if base is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=text)
        else:
            parser.add_argument(flag, dest=name, metavar=getattr(base, "__name__", "VALUE").upper(), help=text)
    return parser


def parse_config(argv: list[str] | None = None) -> FinetuneConfig:
    """YAML (if `--config`) then flags, then validation."""
    args = vars(build_parser().parse_args(argv))
    config_file = args.pop("config", None)
    values = load_yaml_config(config_file) if config_file else {}
    config = config_from_mapping(values)
    config = config_from_mapping(args, base=config)
    config.validate()
    return config
