"""Number flags that are not numbers, reported with the command's other problems.

typer (click underneath) stops at the first flag it cannot convert: `convert -r abc --calib-data x --seed 3`
printed only the `-r` error, and the user learnt of the next problem on the next run.  Here every int/float
flag of a command is parsed by `number_parser`'s function, which keeps a text that is not a number as `Unparsed`;
`take_unparsed` then puts the flag's default in its place and returns one line per such flag, for the command
to list beside the problems it finds itself (or to raise alone, when it collects none).

A float flag given `nan`, `inf` or a number beyond float's range (`1e309`) is refused the same way, with the text as
typed: Python reads all of them as floats, and the checks after parsing echoed `1e309` as `inf`.
"""

from __future__ import annotations

import inspect
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

NUMBER_KINDS = {int: "an integer", float: "a number"}


@dataclass(frozen=True)
class Unparsed:
    """The text typed for a number flag that does not read as that kind of number."""

    text: str
    kind: type
    non_finite: bool = False  # a float that reads as nan or infinity

    def problem(self, flag: str) -> str:
        if self.non_finite:
            return f"{flag}: {self.text!r} is not a finite number"
        return f"{flag}: {self.text!r} is not {NUMBER_KINDS[self.kind]}"


def number_parser(kind: type):
    """typer's `parser=` for a flag of type `kind`: the number, or `Unparsed` (never an exception) for a text that is
    not one, or that reads as nan or infinity."""

    def parse(text: Any) -> Any:
        if not isinstance(text, str):  # a default, already of its type
            return text
        try:
            value = kind(text)
        except ValueError:
            return Unparsed(text, kind)
        if isinstance(value, float) and not math.isfinite(value):
            return Unparsed(text, kind, non_finite=True)
        return value

    parse.__name__ = f"parse_{kind.__name__}"
    return parse


def number_kind(annotation: Any) -> type | None:
    """int or float for `int` or `Optional[float]`; None for any other flag (bool is not a number here, and a list of
    numbers is not one number)."""
    if annotation in NUMBER_KINDS:
        return annotation
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        base = next(a for a in args if a is not type(None))
        return base if base in NUMBER_KINDS else None
    return None


def make_number_flags_lenient(signature: inspect.Signature) -> None:
    """Give every int/float option of a command's signature `number_parser` (unless it has a parser already)."""
    import typer.models

    for parameter in signature.parameters.values():
        info = parameter.default
        kind = number_kind(parameter.annotation)
        if kind is not None and isinstance(info, typer.models.ParameterInfo) and info.parser is None:
            info.parser = number_parser(kind)


def take_unparsed(kwargs: dict, signature: inspect.Signature) -> list[str]:
    """Put each `Unparsed` value's default in its place in kwargs; one problem line for each."""
    problems = []
    for name, value in kwargs.items():
        if isinstance(value, Unparsed):
            info = signature.parameters[name].default
            kwargs[name] = info.default
            problems.append(value.problem(long_flag(name, info)))
    return problems


def long_flag(name: str, info: Any) -> str:
    """The long flag a user types for a parameter (`--kv-lora-rank` for kv_lora_rank, or its declared name)."""
    declared = [flag for decl in info.param_decls or () for flag in decl.split("/") if flag.startswith("--")]
    return declared[0] if declared else "--" + name.replace("_", "-")
