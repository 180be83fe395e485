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
