"""Checks of the kind of every path a command touches, before it touches it.

A FIFO named `tokenizer.json` makes a reader block forever; a result file whose parent is a file, or
that is a folder, fails only after the whole evaluation ran; a symlink as the output folder makes a
replace write through it.  Each function returns one line per problem (empty: go), so that commands
can report every problem at once, before any heavy work.
"""

from __future__ import annotations

import os
import shlex
import stat
import sys
from pathlib import Path


def special_kind(path: Path) -> str:
    """What a path that is neither a regular file nor a folder is: 'a FIFO', 'a character device', ..."""
    mode = path.stat().st_mode
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "a special file"


class NotARegularFile(OSError):
    """`open_regular_file` was given a FIFO, socket or device."""


def open_regular_file(path: str | os.PathLike):
    """`path` opened for binary reading, refused unless it is a regular file: the one opener for files read from a
    model folder.  The kind is checked on the opened descriptor (opened non-blocking, so opening a FIFO with no
    writer returns at once instead of hanging, and a path swapped between a check and the open is still caught)."""
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFile(f"{path}: is {special_kind(Path(path))}, not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_model_text(path: str | os.PathLike, encoding: str = "utf-8") -> str:
    """A text file of a model folder (config, report, card, tokenizer settings), read through `open_regular_file`: a
    FIFO or device raises `NotARegularFile` (an OSError) instead of blocking, like every other model file."""
    with open_regular_file(path) as handle:
        return handle.read().decode(encoding)


def special_file_problems(folder: str | os.PathLike, recursive: bool = False) -> list[str]:
    """Entries of a model folder that are neither regular files nor folders (reading them can hang); `recursive`: in
    its subfolders too (what an upload of the whole folder would read)."""
    folder = Path(folder)
    problems = []
    try:
        entries = sorted(folder.rglob("*") if recursive else folder.iterdir())
    except OSError as error:
        return [f"{folder}: cannot list the folder ({error.strerror or error})"]
    for entry in entries:
        try:
            if entry.is_file() or entry.is_dir():
                continue
            if entry.is_symlink() and not entry.exists():
                problems.append(f"{entry}: a symlink to nothing")
                continue
            problems.append(f"{entry}: is {special_kind(entry)}, not a regular file")
        except OSError as error:
            problems.append(f"{entry}: cannot be read ({error.strerror or error})")
    return problems


def model_folder_problems(path: str | os.PathLike, what: str = "model") -> list[str]:
    """A local model folder exists, is a folder, and holds no special files."""
    path = Path(path)
    if not path.exists():
        return [f"{path}: no such {what} folder"]
    if not path.is_dir():
        return [f"{path}: is a file; pass the {what} folder that holds config.json and the weights"]
    return special_file_problems(path)


def output_file_problems(path: str | os.PathLike | None, flag: str) -> list[str]:
    """A file a command will write at the end: its folder exists and is writable, and it is not a folder."""
    if path is None:
        return []
    if not os.fspath(path).strip():  # as a path, "" is the current folder
        return [f"{flag}: must not be empty"]
    path = absolute_path(path)  # a quoted `~/x.json` is written in the home folder, as every other path is read
    parent = path.parent
    if path.is_symlink() and not path.exists():
        return [f"{flag} {path}: a symlink to nothing"]
    if path.exists() and not path.is_file():
        return [f"{flag} {path}: exists and is not a regular file"]
    if not parent.exists():
        return [f"{flag} {path}: its folder {parent} does not exist"]
    if not parent.is_dir():
        return [f"{flag} {path}: {parent} is not a folder"]
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return [f"{flag} {path}: not writable"]
    return []


def folder_to_create_problems(path: str | os.PathLike, what: str) -> list[str]:
    """A folder a command creates (or reuses) as it starts: not a file or a broken link, below a folder it can write.

    `mkdir(parents=True, exist_ok=True)` raised FileExistsError or NotADirectoryError out of the run otherwise.
    """
    path = absolute_path(path)
    if path.is_symlink() and not path.exists():  # (a link to nothing, or a loop)
        return [f"{what} {path}: a symlink to nothing"]
    if path.exists():
        return [] if path.is_dir() else [f"{what} {path}: exists and is not a folder"]
    parent = next(folder for folder in path.parents if folder.exists() or folder.is_symlink())
    if not parent.is_dir():
        return [f"{what} {path}: {parent} is not a folder"]
    if not os.access(parent, os.W_OK):
        return [f"{what} {path}: cannot be created in {parent} (not writable)"]
    return []


def within(path: Path, folder: Path) -> bool:
    """Whether `path` is `folder` or lies under it (both as given: resolve them first to compare real locations)."""
    return path == folder or folder in path.parents


def absolute_path(path: str | os.PathLike) -> Path:
    """`path` made absolute and normal (`~` expanded, `.` and a trailing `/` gone) without following links.

    Output folders are named by their last part (`<name>.mla-convert-partial` beside them, checkpoints in
    `<name>.checkpoints`): `.` or `out/` must mean the folder itself, and a symlink must stay a symlink so
    that the overwrite rules can see it.
    """
    return Path(os.path.abspath(Path(path).expanduser()))


def real_path(path: str | os.PathLike) -> Path:
    """The path with every link followed, like `Path.resolve()`, but a symlink loop is left as it is instead of
    raising (RuntimeError on Python 3.11, OSError later): a looping `--json` is a bad name to report, not a crash."""
    return Path(os.path.realpath(Path(path).expanduser()))


# --------------------------------------------------------------------------- what reports record
def command_line(argv: list[str] | None = None) -> str:
    """The command as typed, for the report and the card, without this machine's absolute paths.

    An absolute path becomes relative to the working directory when it lies below it, else its last part.
    """
    argv = list(sys.argv if argv is None else argv)
    program = Path(argv[0]).name
    if program == "__main__.py" and Path(argv[0]).parent.name == "mla_convert":
        program = "mla-convert"  # `python -m mla_convert ...` is the same command as the entry point
    return " ".join(shlex.quote(portable_path(arg)) for arg in [program, *argv[1:]])


def portable_path(arg: str) -> str:
    flag, equals, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    if not equals:
        flag, value = "", arg
    if os.path.isabs(value):
        relative = os.path.relpath(value)
        value = relative if not relative.startswith("..") else Path(value).name
    return f"{flag}{equals}{value}"


def shown(text: str) -> str:
    """`text` printable whatever bytes it came from (an undecodable byte of a path shows as \\xff)."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def not_utf8_problem(what: str, value) -> str | None:
    """Why `value` (a path or text from the command line) cannot be used: it is not valid UTF-8 (Python keeps such
    bytes as lone surrogates, which fail only when written into a report, card or JSON, after the work was done).
    The rule for every command: refused up front, named as the user typed it."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str):
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return (f"{what} {shown(text)!r}: is not valid UTF-8; mla-convert writes paths and text into reports, model "
                "cards and JSON, which hold UTF-8 only: rename it, or pass the text as UTF-8")
    return None
