"""Imports only go down: each package of `mla_convert` may import from its own layer and the layers below it.

Every import counts, the ones inside functions too (a lazy import is still a dependency, and was how the circles
were hidden).  The layers, lowest first:

    __init__, errors, units, devices  the version, plain facts and exceptions
    io, options                       files, the hub, signals; the option types
    source, data                      the source model and its config; text and sampled text
    convert                           the conversion
    eval                              perplexity, the KV cache as measured, sweeps
    hub                               model cards and pushing
    finetune, runtime                 healing; decoding exported models
    console, commands, pause, demo, number_flags
    cli, __main__

`STILL_UPWARD` lists the upward imports that remain to be removed; the test fails when a new one appears and when
one of the list is gone (so the list only shrinks, and always says what is left).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mla_convert"
LAYERS = [("__init__", "errors", "units", "devices"), ("io", "options"), ("source", "data"), ("convert",), ("eval",), ("hub",),
          ("finetune", "runtime"), ("console", "commands", "pause", "demo", "number_flags"), ("cli", "__main__")]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
# (importing module, imported module) pairs still pointing up: the output model's shape and target facts live in
# convert/ but are read by source/shapes.py (a target/ package below both removes them), and convert and eval write
# model cards through hub/card.py (the card's sections below convert remove them)
STILL_UPWARD = {
    ("mla_convert.convert.pipeline", "mla_convert.hub.card"),
    ("mla_convert.convert.preflight", "mla_convert.hub.card"),
    ("mla_convert.eval.sweep", "mla_convert.hub.card"),
    ("mla_convert.source.shapes", "mla_convert.convert.engines"),
    ("mla_convert.source.shapes", "mla_convert.convert.target"),
}


def module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imported_modules(path: Path) -> set[str]:
    """Every `mla_convert` module `path` imports, relative imports resolved, at any depth of the file."""
    name, is_package = module_name(path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from . import x`: x is a module when a file or package of that name exists, else a name in `target`
            found |= {target} if node.module else {f"{target}.{alias.name}" if is_module(f"{target}.{alias.name}") else target
                                                   for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {module for module in found if module == "mla_convert" or module.startswith("mla_convert.")}


def layer_part(module: str) -> str:
    """'mla_convert.convert.target' -> 'convert'; 'mla_convert' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        name, _ = module_name(path)
        for target in imported_modules(path):
            here, there = layer_part(name), layer_part(target)
            if here != there and RANK[there] > RANK[here]:
                found.add((name, ".".join(target.split(".")[:3])))
    return found


def test_every_part_of_the_package_has_a_layer():
    parts = {path.relative_to(PACKAGE).parts[0].removesuffix(".py") for path in PACKAGE.glob("*")
             if path.suffix == ".py" or (path / "__init__.py").exists()}
    assert parts <= set(RANK), f"give these a layer in LAYERS: {sorted(parts - set(RANK))}"


def test_imports_only_go_down_but_for_the_listed_ones():
    found = upward_imports()
    assert not found - STILL_UPWARD, f"new upward imports (import from a lower layer, or move the code): {sorted(found - STILL_UPWARD)}"
    assert not STILL_UPWARD - found, f"removed, so take them off STILL_UPWARD: {sorted(STILL_UPWARD - found)}"


def test_the_checker_sees_a_lazy_upward_import(tmp_path):
    """The oracle: an import inside a function, relative, two levels up, is found and resolved."""
    package = tmp_path / "mla_convert" / "io"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    module = package / "late.py"
    module.write_text("def f():\n    from ..convert.target import TARGETS\n    return TARGETS\n")
    import test_layering as layering

    original = layering.PACKAGE
    layering.PACKAGE = tmp_path / "mla_convert"
    try:
        assert layering.imported_modules(module) == {"mla_convert.convert.target"}
        assert layering.upward_imports() == {("mla_convert.io.late", "mla_convert.convert.target")}
    finally:
        layering.PACKAGE = original
