"""BENCHMARKS.md is written by several scripts, each owning one section fenced by its own HTML comment markers.

One function replaces a fenced section (or appends it), so every script keeps the rest of the file as it is;
another records the command line that measured a table so that it can be run again from the repo root.
Imported by the bench scripts (scripts/bench_*.py); it does nothing on its own.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_marked_section(path: Path, begin: str, end: str, section: str) -> None:
    """Replace the text from `begin` to `end` (markers included) with `section`, which carries both markers;
    append it when the file has no such section yet.  A missing file starts as '# Benchmarks'."""
    path = Path(path)
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if not text.strip():
        text = "# Benchmarks\n"
    section = section.strip("\n") + "\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        after = rest.split(end, 1)[1].lstrip("\n")
        text = head + section + ("\n" + after if after else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text, encoding="utf-8")


def write_heading_section(path: Path, heading: str, section: str) -> None:
    """Replace the section that starts at the line `heading` and runs to the next `## ` heading or `<!-- `
    marker line (other scripts' fenced sections start with one, and must survive); append it when absent.
    `section` starts with the heading itself."""
    import re

    path = Path(path)
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if not text.strip():
        text = "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |^<!-- |\Z)", re.S | re.M)
    match = pattern.search(text)
    if match:
        followed = match.end() < len(text)
        text = text[: match.start()] + section.rstrip("\n") + ("\n\n" if followed else "\n") + text[match.end():]
    else:
        text = text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    path.write_text(text, encoding="utf-8")


def repo_path(path: str | os.PathLike, cwd: str | os.PathLike | None = None) -> str:
    """`path` (relative to `cwd`, default the current folder) as the repo root sees it: relative to the repo
    when it lies inside, absolute otherwise."""
    absolute = Path(os.path.abspath(Path(cwd or os.getcwd(), Path(path).expanduser())))
    for candidate, repo in ((absolute, REPO), (Path(os.path.realpath(absolute)), REPO.resolve())):
        if candidate == repo or repo in candidate.parents:
            return candidate.relative_to(repo).as_posix() or "."
    return str(absolute)


def recorded_command(script: str | os.PathLike, argv: list[str] | None, parser=None,
                     cwd: str | os.PathLike | None = None, local_or_not: tuple[str, ...] = ()) -> str:
    """`python scripts/NAME.py ARGS` as it can be re-run from the repo root, however the script was called:
    the values of `parser`'s path options (type `Path` or `absolute_path`) are made relative to the repo (or
    absolute outside it), and those of the options in `local_or_not` (a folder or a hub id) when they exist
    here; everything else is kept as typed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    takes: dict[str, int | None] = dict.fromkeys(local_or_not, 1)  # path option -> values it takes (None: any)
    for action in getattr(parser, "_actions", []):
        if getattr(action.type, "__name__", "") in ("Path", "absolute_path"):
            count = 1 if action.nargs is None else action.nargs if isinstance(action.nargs, int) else None
            takes.update(dict.fromkeys(action.option_strings, count))

    def rewritten(flag: str, value: str) -> str:
        if flag in local_or_not and not Path(cwd or os.getcwd(), value).expanduser().exists():
            return value
        return repo_path(value, cwd)

    out, left, flag = [], 0, ""
    for index, arg in enumerate(argv):
        if arg == "--":
            out += argv[index:]
            break
        if arg.startswith("-") and arg != "-":
            flag, equals, value = arg.partition("=")
            left = 0
            if flag in takes:
                if equals:
                    arg = f"{flag}={rewritten(flag, value)}"
                else:
                    left = takes[flag] if takes[flag] is not None else -1
            out.append(arg)
        elif left:
            out.append(rewritten(flag, arg))
            left -= 1 if left > 0 else 0
        else:
            out.append(arg)
    name = Path(script).name
    return shlex.join(["python", f"scripts/{name}", *out])


if __name__ == "__main__":
    ASKED = sys.argv[1:] in (["-h"], ["--help"])
    print(("" if ASKED else "benchmarks_md.py: error: ") + "benchmarks_md.py is imported by the bench scripts "
          "(scripts/bench_*.py) to write BENCHMARKS.md; it does nothing on its own", file=sys.stdout if ASKED else sys.stderr)
    sys.exit(0 if ASKED else 2)
