"""Conversion options, declared once: type, default, help, flag and valid range of every field.

The command line is generated from these declarations (`cli_options`), so a field cannot exist in the
API without a flag or the other way round, and `convert` and `sweep` share the calibration flags by
construction.  `option_problems` checks every value against its declared range in one place, so a bad
value is one `error:` line before any work, from the CLI and from the Python API alike.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

DEFAULT_MAX_SHARD_SIZE = "5GB"
METHODS = ("activation-aware", "input", "svd")
# the serving targets (data: mla_convert.convert.target.TARGETS, which a test keeps in step with this tuple)
TARGETS = ("transformers", "vllm", "llama.cpp", "all")


def option(default: Any = None, help: str = "", *, flag: str | None = None, short: str | None = None,
           choices: tuple[str, ...] | None = None, minimum: float | None = None, maximum: float | None = None,
           positive: bool = False, why: str | None = None, default_factory: Callable | None = None,
           also: tuple[type, ...] = ()) -> Any:
    """A dataclass field that is also a command-line flag (`why`: the reason for its range, shown with a range error;
    `also`: types the Python API may give besides the annotated one, e.g. a shard size in bytes as an int)."""
    metadata = {"help": help, "flag": flag, "short": short, "choices": choices, "minimum": minimum,
                "maximum": maximum, "positive": positive, "why": why, "also": also}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class CalibrationOptions:
    """Where the calibration activations come from and how many are collected."""

    data: Optional[str] = option(None, "Calibration text: a file, a folder, or a datasets spec name:config:split. "
                                 "Default: text sampled from the source model itself.", flag="--calib-data")
    num_samples: int = option(16, "Calibration windows.", flag="--calib-samples", minimum=1, maximum=1 << 20)
    seq_len: int = option(256, "Tokens per calibration window (at least 2: attention needs two positions).",
                          flag="--calib-seq-len", minimum=2, maximum=1 << 20, why="attention needs two positions")
    seed: int = option(0, "Seed for sampling calibration text from the model.", flag="--seed", minimum=0, maximum=2**63 - 1)
    text_column: str = option("text", "Text field of .jsonl rows or column of a datasets dataset.", flag="--calib-text-column")
    temperature: float = option(1.0, "Sampling temperature for self-sampled calibration text (0: greedy).",
                                flag="--calib-temperature", minimum=0.0, maximum=100.0)
    top_p: float = option(0.95, "Nucleus threshold for self-sampled calibration text, in (0, 1].",
                          flag="--calib-top-p", positive=True, maximum=1.0)
    error_samples: int = option(4, "Windows kept per layer to measure the conversion error (and to refine on).",
                                flag="--calib-error-samples", minimum=1, maximum=1 << 20)
    chunk: int = option(4, "Windows pushed through a layer at once (memory vs speed).", flag="--calib-chunk",
                        minimum=1, maximum=1 << 20)

    def __post_init__(self):
        # a pathlib.Path from the Python API, as run_sweep and run_eval take their texts (it was refused as "must be
        # str"); stored as the str the command line gives, which the report records
        if isinstance(self.data, os.PathLike):
            self.data = os.fspath(self.data)


@dataclass
class ConvertOptions:
    """Everything that decides what `convert` writes."""

    kv_lora_rank: Optional[int] = option(None, "Latent rank R of the MLA cache.", flag="--kv-lora-rank", short="-r")
    rope_dim: Optional[int] = option(None, "Dimension D of the shared RoPE key (even).", flag="--rope-dim", short="-d")
    compression: Optional[float] = option(None, "Target KV-cache ratio (source / MLA); picks R and D.  With a serving "
                                          "--target: the allowed shape nearest at or above it; a target with no shape "
                                          "that shrinks this source's cache is refused, saying so.", flag="--compression",
                                          short="-c")
    target: str = option("transformers", "Where the export will run: transformers (any shape, as the source: tied "
                         "embeddings and biases kept), vllm (kv_lora_rank + rope_dim in 320/512/576: vLLM 0.32.0's allow-list; "
                         "untied lm_head, no biases), llama.cpp (q_lora_rank set, weights that survive f16/q8_0 GGUF, no biases) or all (every "
                         "constraint at once).  With a serving target a requested KV-cache ratio picks, of the shapes the "
                         "target allows, the one with the smallest ratio at or above it (else the largest); see "
                         "`mla-convert inspect --target`.", flag="--target", choices=TARGETS)
    q_lora_rank: Optional[int] = option(None, "Also factor the queries through a latent of this rank (at most hidden_size; "
                                        "+1 for a query bias when the heads are wider than the input).",
                                        flag="--q-lora-rank")
    method: str = option("activation-aware", "Factorization: activation-aware (inputs whitened, outputs weighted by what "
                         "their error costs), input (whitened only) or svd (weight-only baseline).", flag="--method",
                         choices=METHODS)
    calibration: CalibrationOptions = option(help="", default_factory=CalibrationOptions)
    dtype: str = option("auto", "Export dtype: auto (the source's; fp16 becomes bf16), bf16 or fp32; fp16 only with a "
                        "serving --target (a --target transformers export's tiny-scale latent does not fit it).",
                        flag="--dtype",
                        choices=("auto", "bf16", "bfloat16", "fp32", "float32", "fp16", "float16"))
    device: str = option("cpu", "Where calibration, statistics, factorization and refinement run (and, in sweep, evaluation): "
                         "cpu, cuda or cuda:N. "
                         "Weights stream from disk one layer at a time; on a GPU those read once stay on it while they "
                         "fit in half its free memory.", flag="--device")
    sequential: bool = option(True, "Calibrate each layer on the outputs of the already converted layers "
                              "(--no-sequential: on the source's).", flag="--sequential")
    effort: str = option("default", "How much measured search a conversion spends (costs and gains in BENCHMARKS.md): fast "
                         "(closed form, no K/V balance search, the RoPE grid of best estimate), default (40 one-window "
                         "refinement steps on layers where a step is cheap, up to SmolLM2's width; K/V balance search; up to "
                         "two RoPE grids), thorough (200 refinement "
                         "steps on every layer, up to four RoPE grids; a runner-up grid is measured only when its estimate is "
                         "within 1.5x of the best's).  --refine-steps, --kv-balance-search and "
                         "--rope-finalists override it.", flag="--effort", choices=("fast", "default", "thorough"))
    refine_steps: Optional[int] = option(None, "Adam steps per layer on the attention-output error, kept only where a "
                                         "held-out window improves (0: closed form only; default: from --effort).",
                                         flag="--refine-steps", minimum=0, maximum=1 << 20)
    refine_lr: float = option(1e-3, "Refinement learning rate, relative to each tensor's scale.", flag="--refine-lr",
                              positive=True, maximum=1.0)
    rope_finalists: Optional[int] = option(None, "RoPE grids measured on calibration data after ranking all by estimate "
                                           "(the runners-up only when their estimate is within 1.5x of the best; "
                                           "default: from --effort).", flag="--rope-finalists", minimum=1, maximum=64)
    kv_balance_search: Optional[bool] = option(None, "Search the K/V balance of the activation-aware factorization per "
                                               "layer by measured attention error (5 factorizations per layer; "
                                               "default: from --effort).", flag="--kv-balance-search")
    max_shard_size: str = option(DEFAULT_MAX_SHARD_SIZE, "Largest output shard, e.g. 5GB or 500MB.", flag="--max-shard-size",
                                 also=(int,))  # bytes, as save_pretrained takes them
    overwrite: bool = option(False, "Replace an existing output folder written by mla-convert.", flag="--overwrite")
    force: bool = option(False, "With --overwrite: also replace a folder that is not an mla-convert output, or a symlink "
                         "(the link itself, never its target).", flag="--force")
    allow_pickle: bool = option(False, "Read pickled *.bin weights (torch.load with weights_only=True).", flag="--allow-pickle")
    revision: Optional[str] = option(None, "Hub revision of the source.", flag="--revision")
    base_model: Optional[str] = option(None, "Hub id of the source for the model card's `base_model` (default: the "
                                       "source itself when it was given as a hub id).", flag="--base-model")
    license: Optional[str] = option(None, "License id for the model card, e.g. apache-2.0 (default: the source's, "
                                    "from its config.json or its model card).", flag="--license")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def options_from_record(recorded: dict) -> ConvertOptions:
    """The ConvertOptions of a recorded run (a report's `options`), without the keys of options removed since
    (older records hold `profile_samples`)."""
    def known(cls, values: dict) -> dict:
        names = {spec.name for spec in dataclasses.fields(cls)}
        return {key: value for key, value in values.items() if key in names}

    values = dict(recorded)
    calibration = CalibrationOptions(**known(CalibrationOptions, values.pop("calibration", {}) or {}))
    return ConvertOptions(**known(ConvertOptions, values), calibration=calibration)


# --------------------------------------------------------------------------- validation
def option_problems(options: Any, types_only: bool = False, _prefix: str = "") -> list[str]:
    """Every value outside its declared range, one line each, named by its flag.

    `types_only`: just the values of the wrong type (a str where a number belongs, from the Python API), which
    the other checks cannot even compare and so must stop before them.  Only the API can pass one, so these are named
    by their Python names (`calibration.seq_len`), not by flags.
    """
    problems = []
    hints = typing.get_type_hints(type(options))
    for spec in dataclasses.fields(options):
        value = getattr(options, spec.name)
        if dataclasses.is_dataclass(value):
            problems += option_problems(value, types_only, f"{_prefix}{spec.name}.")
            continue
        if isinstance(hints[spec.name], type) and dataclasses.is_dataclass(hints[spec.name]):
            problems.append(f"{_prefix}{spec.name} {value!r}: must be {hints[spec.name].__name__}")
            continue
        meta, flag = spec.metadata, spec.metadata.get("flag") or spec.name
        if value is None:
            continue
        expected = _base_type(hints[spec.name])
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (expected, *meta.get("also", ()))) or (expected is not bool and isinstance(value, bool)):
            problems.append(f"{_prefix}{spec.name} {value!r}: must be "
                            f"{' or '.join(t.__name__ for t in (expected, *meta.get('also', ())))}")
            continue
        if types_only:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{flag} {value}: must be a finite number")
            continue
        if meta.get("choices") and value not in meta["choices"]:
            problems.append(f"{flag} {value!r}: choose one of {', '.join(meta['choices'])}")
        if meta.get("positive") and not value > 0:
            problems.append(f"{flag} {value}: must be positive")
        if meta.get("minimum") is not None and value < meta["minimum"]:
            why = f" ({meta['why']})" if meta.get("why") else ""
            problems.append(f"{flag} {value}: must be at least {meta['minimum']:g}{why}")
        if meta.get("maximum") is not None and value > meta["maximum"]:
            problems.append(f"{flag} {value}: must be at most {meta['maximum']:g}")
        # an empty value would fall back to a surprising default (an empty choice is already reported above)
        if isinstance(value, str) and not value.strip() and not meta.get("choices"):
            problems.append(f"{flag}: must not be empty")
    return problems


# Flags that only act together with other settings: (field path) -> (does it act?, what it needs).  A flag given
# on the command line where it cannot act is refused rather than silently ignored (the predicates read the
# whole ConvertOptions; the API cannot tell a default from a value given, so only the command line checks).
def _self_sampled(options: ConvertOptions) -> bool:
    return options.calibration.data is None


def _refines(options: ConvertOptions) -> bool:
    if options.refine_steps is not None:
        return options.refine_steps > 0
    return options.effort != "fast" and options.method != "svd"  # both: no refinement unless --refine-steps N


def error_windows_kept(calibration: CalibrationOptions, windows: int | None = None) -> int:
    """Windows each layer keeps to measure (and refine on) its conversion error (`windows`: those actually read)."""
    return min(calibration.error_samples, max(calibration.num_samples if windows is None else windows, 0))


def _sampled_at_temperature(options: ConvertOptions) -> bool:
    return _self_sampled(options) and options.calibration.temperature > 0  # (0: greedy, no seed or nucleus)


def _reads_a_column(options: ConvertOptions) -> bool:
    """Calibration text with named fields: a .jsonl file, a folder holding one, or a datasets spec (not a path)."""
    from pathlib import Path

    data = options.calibration.data
    if data is None:
        return False
    path = Path(data).expanduser()
    if path.is_file():
        return path.suffix.lower() == ".jsonl"
    if path.is_dir():
        return any(p.suffix.lower() == ".jsonl" for p in path.rglob("*") if p.is_file())
    return True


ACTS_ONLY_WITH: dict[tuple[str, ...], tuple[Callable[[ConvertOptions], bool], str]] = {
    ("force",): (lambda o: o.overwrite, "--overwrite"),
    ("calibration", "seed"): (_sampled_at_temperature, "calibration text sampled from the model (no --calib-data) "
                                                       "at a --calib-temperature above 0"),
    ("calibration", "temperature"): (_self_sampled, "calibration text sampled from the model (no --calib-data)"),
    ("calibration", "top_p"): (_sampled_at_temperature, "calibration text sampled from the model (no --calib-data) "
                                                        "at a --calib-temperature above 0"),
    ("calibration", "text_column"): (lambda o: _reads_a_column(o) or o.calibration.text_column == "text",
                                     "--calib-data of .jsonl files, folders holding them, or a datasets spec"),
    ("kv_balance_search",): (lambda o: o.method == "activation-aware",
                             "the activation-aware method (convert: --method activation-aware; sweep: in --methods)"),
    ("refine_lr",): (_refines, "layer refinement (--refine-steps N, or --effort default/thorough with a "
                               "calibrated --method)"),
    # each layer keeps at most the windows calibration reads: more was clamped silently, and recorded as asked
    ("calibration", "error_samples"): (lambda o: o.calibration.error_samples <= o.calibration.num_samples,
                                       "--calib-samples of at least as many windows (each layer keeps at most the "
                                       "windows calibration reads)"),
    ("refine_steps",): (lambda o: not o.refine_steps or error_windows_kept(o.calibration) >= 2,
                        "at least 2 error windows per layer (--calib-error-samples and --calib-samples of 2 or more)"),
}


def ineffective_flag_problems(options: ConvertOptions, given: dict[tuple[str, ...], str]) -> list[str]:
    """One line for each flag in `given` (field path -> flag as typed) that cannot act with the other settings."""
    return [f"{flag}: acts only with {needs}" for path, flag in given.items()
            if path in ACTS_ONLY_WITH for acts, needs in [ACTS_ONLY_WITH[path]] if not acts(options)]


def argument_problems(**arguments: tuple[Any, tuple[type, ...], str]) -> list[str]:
    """Python-API arguments of the wrong type (`name=(value, types, what it must be)`), one line each naming the
    parameter: refused before the work they would fail deep inside (Path(None), a dict's AttributeError where
    ConvertOptions belongs, a str compared with an int).  A bool is no int here."""
    return [f"{name} {value!r}: must be {what}" for name, (value, types, what) in arguments.items()
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types)]


PATH_TYPES = (str, os.PathLike)


def path_argument(value: Any, optional: bool = False) -> tuple[Any, tuple[type, ...], str]:
    """`argument_problems`' entry for a path (or hub id) parameter."""
    if optional:
        return value, (*PATH_TYPES, type(None)), "a path (str or os.PathLike) or None"
    return value, PATH_TYPES, "a path (str or os.PathLike)"


def int_argument(value: Any, optional: bool = True) -> tuple[Any, tuple[type, ...], str]:
    """`argument_problems`' entry for a whole-number parameter: any `numbers.Integral` (numpy's integers too)."""
    return (value, (numbers.Integral, type(None)), "int or None") if optional else (value, (numbers.Integral,), "int")


def optional_argument(value: Any, kind: type) -> tuple[Any, tuple[type, ...], str]:
    """`argument_problems`' entry for a parameter that takes an instance of `kind` (options, calibration) or None."""
    return value, (kind, type(None)), f"{kind.__name__} or None"


def evaluation_number_arguments(**numbers: Any) -> dict[str, tuple[Any, tuple[type, ...], str]]:
    """`argument_problems`' entries for the evaluation's whole numbers (run_eval, run_sweep): every one may be None
    (the default) except batch_size."""
    return {name: int_argument(value, optional=name != "batch_size") for name, value in numbers.items()}


def _base_type(annotation: Any) -> type:
    """Optional[int] -> int; int -> int."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


# --------------------------------------------------------------------------- command line
@dataclass(frozen=True)
class _Flag:
    parameter: inspect.Parameter
    path: tuple[str, ...]  # field names from the top-level dataclass down to this field


def _flags(cls: type, exclude: frozenset[str], path: tuple[str, ...] = ()) -> list[_Flag]:
    import typer

    flags = []
    hints = typing.get_type_hints(cls)
    for spec in dataclasses.fields(cls):
        if spec.name in exclude:
            continue
        annotation = hints[spec.name]
        if dataclasses.is_dataclass(annotation):
            flags += _flags(annotation, exclude, path + (spec.name,))
            continue
        meta = spec.metadata
        flag = meta.get("flag") or "--" + spec.name.replace("_", "-")
        names = [flag] + ([meta["short"]] if meta.get("short") else [])
        if annotation in (bool, Optional[bool]):  # a switch both ways: --sequential / --no-sequential (None: unset)
            names[0] = f"{flag}/--no-{flag[2:]}"
        default = spec.default if spec.default is not dataclasses.MISSING else spec.default_factory()
        help_text = meta.get("help", "")
        if meta.get("choices"):  # escaped: rich reads an unescaped [choices: ...] as markup and drops it
            from rich.markup import escape

            help_text += escape(f" [choices: {', '.join(meta['choices'])}]")
        param_name = flag.lstrip("-").replace("-", "_")
        parameter = inspect.Parameter(param_name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                                      default=typer.Option(default, *names, help=help_text, show_default=True))
        flags.append(_Flag(parameter, path + (spec.name,)))
    return flags


def _build(cls: type, values: dict[tuple[str, ...], Any], path: tuple[str, ...] = ()) -> Any:
    kwargs = {}
    hints = typing.get_type_hints(cls)
    for spec in dataclasses.fields(cls):
        key = path + (spec.name,)
        if dataclasses.is_dataclass(hints[spec.name]):
            kwargs[spec.name] = _build(hints[spec.name], values, key)
        elif key in values:
            kwargs[spec.name] = values[key]
    return cls(**kwargs)


def cli_options(variants: Callable[[dict, ConvertOptions], list[ConvertOptions]] | None = None,
                **groups: type | tuple[type, frozenset[str] | set[str]]):
    """Decorate a typer command: each keyword names a parameter of the command that receives a dataclass
    (optionally with field names to leave out); its fields become the command's flags.

    Example: `@cli_options(options=(ConvertOptions, {"method"}))` gives the command every ConvertOptions
    flag but `--method` and calls it with `options=ConvertOptions(...)`.  `variants(kwargs, options)`: the
    ConvertOptions the command will really run with (sweep: one per --methods entry); a typed flag is refused
    only when it can act in none of them.  Flags that cannot act are refused before the command runs, unless the
    command declares a `flag_problems` parameter: it then receives them (a list of lines) to report together with
    the problems it finds itself, so that one run names every problem.  A command that declares a `cli_context`
    parameter receives the command line's context in it (None when called without one), to tell its own typed flags
    from defaults.
    """
    specs = {name: (value, frozenset()) if isinstance(value, type) else (value[0], frozenset(value[1]))
             for name, value in groups.items()}

    import typer

    def decorate(func):
        hints = typing.get_type_hints(func)
        declared = inspect.signature(func).parameters
        own = [p.replace(annotation=hints.get(p.name, p.annotation))
               for p in declared.values() if p.name not in specs and p.name not in (FLAG_PROBLEMS, _CONTEXT)]
        generated = {name: _flags(cls, exclude) for name, (cls, exclude) in specs.items()}
        taken = [p.name for p in own] + [f.parameter.name for flags in generated.values() for f in flags]
        clashes = {name for name in taken if taken.count(name) > 1}
        if clashes:
            raise TypeError(f"{func.__name__}: flags declared twice: {sorted(clashes)}")

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            from .errors import PreflightError

            context = kwargs.pop(_CONTEXT, None)
            problems = list(kwargs.pop(FLAG_PROBLEMS, ()))  # found before this wrapper: number flags that are not numbers
            for name, flags in generated.items():
                values = {flag.path: kwargs.pop(flag.parameter.name) for flag in flags if flag.parameter.name in kwargs}
                kwargs[name] = _build(specs[name][0], values)
                if isinstance(kwargs[name], ConvertOptions):
                    given = _given_on_command_line(context, flags)
                    cases = variants(kwargs, kwargs[name]) if variants else [kwargs[name]]
                    idle = [ineffective_flag_problems(case, given) for case in cases or [kwargs[name]]]
                    unparsed = {line.split(":")[0] for line in problems}  # a flag refused as no number is not also idle
                    problems += [problem for problem in idle[0] if all(problem in other for other in idle[1:])
                                 and problem.split(":")[0] not in unparsed]
            if FLAG_PROBLEMS in declared:
                kwargs[FLAG_PROBLEMS] = problems
            elif problems:
                raise PreflightError(problems)
            if _CONTEXT in declared:  # the command reads which of its own flags were typed (inspect on an export)
                kwargs[_CONTEXT] = context
            return func(*args, **kwargs)

        parameters = own + [f.parameter for flags in generated.values() for f in flags]
        # typer hands the command's context to a parameter annotated typer.Context: it tells typed flags from defaults
        parameters.append(inspect.Parameter(_CONTEXT, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context))
        wrapper.__signature__ = inspect.Signature(parameters)
        wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
        wrapper.option_flags = {name: [(f.parameter.name, f.path) for f in flags] for name, flags in generated.items()}
        return wrapper

    return decorate


_CONTEXT = "cli_context"
FLAG_PROBLEMS = "flag_problems"


def _given_on_command_line(context: Any, flags: list[_Flag]) -> dict[tuple[str, ...], str]:
    """The flags the user typed (field path -> the flag's name), read from the command's context ({} without one)."""
    typed = typed_flags(context, switch_as_typed=False)
    return {flag.path: typed[flag.parameter.name] for flag in flags if flag.parameter.name in typed}


def typed_flags(context: Any, skip: tuple[str, ...] = (), switch_as_typed: bool = True) -> dict[str, str]:
    """The flags typed on this command line (or set from the environment): parameter name -> its long flag, except
    the parameters in `skip`; {} without a command line's context.  `switch_as_typed`: a switch turned off is named
    as typed (--no-sequential), else by its flag (--sequential)."""
    if context is None:
        return {}
    flags = {}
    for param in context.command.params:
        source = context.get_parameter_source(param.name)
        if param.name in skip or source is None or source.name not in ("COMMANDLINE", "ENVIRONMENT"):
            continue
        names = param.opts
        if switch_as_typed and getattr(param, "secondary_opts", None) and context.params.get(param.name) is False:
            names = param.secondary_opts
        flags[param.name] = next((name for name in names if name.startswith("--")), names[0])
    return flags
