"""BENCHMARKS.md is written by several scripts, each owning one section fenced by its own HTML comment markers.

One function replaces a fenced section (or appends it), so every script keeps the rest of the file as it is.
"""

from __future__ import annotations

from pathlib import Path


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
