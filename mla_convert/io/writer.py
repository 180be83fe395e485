"""Streaming writer that produces the same files `save_pretrained` does.

Tensors arrive one at a time (layer by layer); each one's bytes go to disk as it arrives (see
`safetensors_stream`), so memory holds at most the tensor being added, whatever `max_shard_size` is,
and the shard files are byte-identical to what `save_file` writes.  Everything goes into a temporary
sibling folder that is renamed onto the output path only when complete: an interrupted run never
leaves a folder at the output path that looks like a finished model.

The leftovers an interrupted run can leave (only a hard kill leaves any) are clearly named and cleaned
by the next run: `<output>.mla-convert-partial` (owner pid inside), `<output>.mla-convert-old` (the
previous output while `--overwrite` swaps it; restored if the swap was cut short) and scratch folders
such as the calibration statistics in the temp dir (owner holds an flock; see `claim_scratch_folder`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from huggingface_hub import constants as hub_constants

from ..errors import OutputExistsError, OutputWriteError
from .safetensors_stream import ShardSpool, write_single_tensor_file
from .signals import signals_deferred

PARTIAL_SUFFIX = ".mla-convert-partial"
BACKUP_SUFFIX = ".mla-convert-old"
# A finished result whose output path was taken meanwhile (kept, never cleaned automatically).
KEPT_SUFFIX = ".mla-convert-result"
# Marker inside a partial folder naming the process that writes it, so a later run can tell a
# leftover of a dead run (safe to remove) from a folder another live run is still writing.
OWNER_FILE = ".mla-convert-owner"
# Scratch file inside the partial folder holding the bytes of the shard being filled (never in an output).
SPOOL_FILE = "open-shard.spool"

# Files copied from the source folder next to the weights (tokenizer, generation defaults, chat templates).
SIDECAR_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.json",
    "chat_template.jinja",
)

DEFAULT_MAX_SHARD_SIZE = "5GB"

# Decimal units, as `save_pretrained(max_shard_size="5GB")` reads them (huggingface_hub's rule).
_SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def parse_shard_size(size: int | str) -> int:
    """Bytes in a shard-size limit such as `"5GB"` or `500_000`, read the way `save_pretrained` reads it.

    Kept here rather than imported: huggingface_hub has moved its own parser between releases.
    """
    if isinstance(size, int):
        return size
    text = str(size).strip()
    unit = text[-2:].upper()
    try:
        if unit in _SIZE_UNITS:
            return int(float(text[:-2].strip()) * _SIZE_UNITS[unit])
        return int(text)
    except (ValueError, OverflowError) as error:  # OverflowError: an infinite size ('1e309GB', 'infGB')
        raise ValueError(f"max_shard_size {size!r}: expected bytes or a size like '5GB' (units KB, MB, GB, TB)") from error


def partial_path_for(output: Path) -> Path:
    return output.with_name(output.name + PARTIAL_SUFFIX)


def claim_owner_file(path: Path):
    """Create `path`, hold an exclusive `flock` on it for as long as the returned handle lives, write our PID.

    The kernel drops the lock when the process ends, even by SIGKILL, so a later run knows exactly
    whether the writer is alive: no PID reuse, no PIDs of other machines or namespaces to guess about.
    """
    handle = open(path, "w")
    try:
        import fcntl

        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:  # pragma: no cover - Windows: no lock, the PID alone
        pass
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def live_owner(path: Path) -> str | None:
    """The PID text of the live process holding `path`'s lock, or None when nobody holds it (a leftover)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover
        return None
    try:
        with open(path, "r+") as handle:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return handle.read().strip() or "?"
            return None
    except OSError:  # no owner file: nobody claims the folder
        return None


def clean_stale_partial(output: Path) -> str | None:
    """Remove the partial folder an interrupted earlier run left beside `output`.

    Returns a message describing what was done (for the user), or None if there was nothing.  A partial
    folder still owned by a live process is left alone and reported as an error instead.
    """
    partial = partial_path_for(output)
    messages = []
    if partial.is_symlink():
        raise OutputExistsError(f"{partial}: is a symlink where mla-convert keeps its unfinished output; remove it")
    if partial.exists():
        pid = live_owner(partial / OWNER_FILE)
        if pid is not None:
            raise OutputExistsError(
                f"{partial}: another mla-convert process (pid {pid}) is writing this output; wait for it or remove the folder"
            )
        _remove(partial)
        messages.append(f"removed {partial.name}, left behind by an interrupted run")
    backup = backup_path_for(output)
    if backup.exists():
        # `commit(overwrite)` moves the old output here, the new one into place, then deletes this.
        if output.exists():  # killed after the swap: the new output is complete, the old one is garbage
            _remove(backup)
            messages.append(f"removed {backup.name}, left behind by an interrupted --overwrite")
        else:  # killed mid-swap: put the previous output back where the user left it
            os.replace(backup, output)
            messages.append(f"restored {output.name} from {backup.name}: an interrupted --overwrite had moved it aside")
    return "; ".join(messages) or None


def backup_path_for(output: Path) -> Path:
    return output.with_name(output.name + BACKUP_SUFFIX)


def kept_path_for(output: Path) -> Path:
    """Where a finished result goes when something else took its output path meanwhile (never overwritten)."""
    candidate = output.with_name(output.name + KEPT_SUFFIX)
    number = 1
    while candidate.exists() or candidate.is_symlink():
        number += 1
        candidate = output.with_name(f"{output.name}{KEPT_SUFFIX}-{number}")
    return candidate


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


REPORT_MARKER = "mla_convert.json"  # what makes a folder an earlier mla-convert output (`convert.report.REPORT_FILE`)


def prepare_output_path(output: str | os.PathLike, overwrite: bool = False, force: bool = False) -> Path:
    """Check the output path before any heavy work; raise if it exists and `overwrite` is off.

    `--overwrite` replaces only an earlier mla-convert output (a folder holding its report); a symlink at the
    output path, or a folder of other files, is replaced (the link itself, never its target) only with `force`.
    """
    output = Path(output)
    if output.is_symlink():
        if not (overwrite and force):
            raise OutputExistsError(f"{output}: is a symlink; mla-convert writes a real folder there and would replace the "
                                    "link. Choose another path, or pass --overwrite --force to replace the link itself")
        return _checked_parent(output)
    if output.exists() and not overwrite:
        raise OutputExistsError(f"{output}: already exists; choose another path or pass --overwrite")
    if output.exists() and not output.is_dir():
        raise OutputExistsError(f"{output}: is a file, not a model folder; --overwrite only replaces folders")
    if output.exists() and not force and not (output / REPORT_MARKER).is_file():
        raise OutputExistsError(f"{output}: is not an earlier mla-convert output (no {REPORT_MARKER}); --overwrite would "
                                "delete its files. Choose another path, or add --force")
    return _checked_parent(output)


def _checked_parent(output: Path) -> Path:
    if not output.parent.exists():
        raise OutputExistsError(f"{output.parent}: parent folder does not exist")
    if not output.parent.is_dir():
        raise OutputExistsError(f"{output.parent}: the output's parent is not a folder")
    if not os.access(output.parent, os.W_OK):
        read_only = hasattr(os, "statvfs") and bool(os.statvfs(output.parent).f_flag & os.ST_RDONLY)
        raise OutputExistsError(f"{output.parent}: not writable" + (" (read-only file system)" if read_only else ""))
    return output


class CheckpointWriter:
    """Write a Hugging Face model folder tensor by tensor; `commit()` makes it appear atomically.

    Use as a context manager: leaving the block with an exception removes the partial folder, and a
    hard kill leaves only the clearly named `<output>.mla-convert-partial` folder, which the next run
    removes (see `clean_stale_partial`).
    """

    def __init__(
        self,
        output: str | os.PathLike,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        overwrite: bool = False,
        force: bool = False,
    ):
        self.output = prepare_output_path(output, overwrite, force)
        self.overwrite = overwrite
        self.max_shard_size = parse_shard_size(max_shard_size)
        if self.max_shard_size <= 0:
            raise ValueError("max_shard_size must be positive")
        self.cleanup_message = clean_stale_partial(self.output)
        self.partial = partial_path_for(self.output)
        self._spool = ShardSpool(self.partial / SPOOL_FILE)
        self._owner = None
        try:
            self.partial.mkdir()
            self._owner = claim_owner_file(self.partial / OWNER_FILE)
        except OSError as error:
            self.abort()
            raise OutputWriteError(
                f"{self.partial}: cannot create the output ({error.strerror or error}); nothing was written"
            ) from error
        self._shard_files: list[list[str]] = []  # tensor names per written shard, in order
        self._written: set[str] = set()  # names already on disk, for the duplicate check
        self.total_size = 0
        self.total_parameters = 0
        self._committed = False

    # ----------------------------------------------------------------- tensors
    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write one tensor's bytes to disk now; the current shard is finished first if this one would overflow it.

        Nothing of `tensor` is kept once this returns (a memory-mapped input's mapping can go).  Same
        packing rule as `huggingface_hub.split_torch_state_dict_into_shards`, so a model written in
        state-dict order lands in the same shards as `save_pretrained` puts it.  In particular a tensor
        larger than the limit gets a shard of its own *immediately*, numbered before the shard still
        being filled, which stays open for the tensors that follow.
        """
        if name in self._written or name in self._spool:
            raise ValueError(f"tensor {name!r} written twice")
        size = tensor.numel() * tensor.element_size()
        if size > self.max_shard_size:
            self._write_shard(lambda path: write_single_tensor_file(path, name, tensor), [name])
        else:
            if self._spool.nbytes + size > self.max_shard_size:
                self._flush()
            self._spool.append(name, tensor)
        self.total_size += size
        self.total_parameters += tensor.numel()

    def add_rows(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 read_rows: Callable[[int, int], torch.Tensor], rows_per_chunk: int = 8192) -> None:
        """Like `add`, for a tensor supplied in row blocks (see `ShardSpool.append_rows`)."""
        if name in self._written or name in self._spool:
            raise ValueError(f"tensor {name!r} written twice")
        numel = int(torch.Size(shape).numel())
        size = numel * torch.empty((), dtype=dtype).element_size()
        if size > self.max_shard_size:  # a shard of its own: materialise it (only tables above max_shard_size)
            self.add(name, torch.cat([read_rows(s, min(s + rows_per_chunk, shape[0])) for s in range(0, shape[0], rows_per_chunk)]))
            return
        if self._spool.nbytes + size > self.max_shard_size:
            self._flush()
        self._spool.append_rows(name, tuple(shape), dtype, read_rows, rows_per_chunk)
        self.total_size += size
        self.total_parameters += numel

    def add_many(self, tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        items = tensors.items() if isinstance(tensors, dict) else tensors
        for name, tensor in items:
            self.add(name, tensor)

    def _flush(self) -> None:
        """Finish the shard being filled: lay its spooled tensors out as a `.safetensors` file."""
        if len(self._spool):
            self._write_shard(self._spool.assemble, [entry.name for entry in self._spool.entries])

    def _write_shard(self, write: Callable[[Path], object], names: list[str]) -> None:
        """Have `write(path)` write the next shard file, which holds the tensors `names`."""
        write(self.partial / f"shard-{len(self._shard_files):05d}.tmp")
        self._shard_files.append(names)
        self._written.update(names)

    # ----------------------------------------------------------------- side files
    def write_json(self, relative: str, payload: dict) -> Path:
        path = self.partial / relative
        path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
        return path

    def write_text(self, relative: str, text: str) -> Path:
        path = self.partial / relative
        path.write_text(text)
        return path

    def copy_sidecars(self, source: str | os.PathLike, names: Iterable[str] = SIDECAR_FILES) -> list[str]:
        """Copy tokenizer, generation config and chat template files that exist in `source`."""
        copied = []
        for name in names:
            src = Path(source) / name
            if src.is_file():
                shutil.copyfile(src, self.partial / name)
                copied.append(name)
        return copied

    # ----------------------------------------------------------------- finishing
    def commit(self) -> Path:
        """Name the shards, write the index and rename the folder onto the output path."""
        self._flush()
        self._spool.close()
        count = len(self._shard_files)
        if count == 0:
            raise ValueError("no tensors were written")
        weight_map = {}
        for index, names in enumerate(self._shard_files):
            final = hub_constants.SAFETENSORS_SINGLE_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.partial / f"shard-{index:05d}.tmp", self.partial / final)
            weight_map.update({name: final for name in names})
        if count > 1:
            index = {
                "metadata": {"total_parameters": self.total_parameters, "total_size": self.total_size},
                "weight_map": weight_map,
            }
            (self.partial / hub_constants.SAFETENSORS_INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        (self.partial / OWNER_FILE).unlink()
        self._release_owner()
        _fsync_tree(self.partial)
        if self.output.exists() or self.output.is_symlink():
            if not self.overwrite:
                # someone else put something at the output path meanwhile: keep both, say where ours is
                kept = kept_path_for(self.output)
                os.replace(self.partial, kept)
                self._committed = True
                raise OutputExistsError(f"{self.output}: appeared while converting; the finished result is kept in {kept}")
            # Move the old folder aside first, so that a crash here never leaves neither.
            backup = backup_path_for(self.output)
            if backup.exists() or backup.is_symlink():
                _remove(backup)
            os.replace(self.output, backup)
            os.replace(self.partial, self.output)
            _remove(backup)
        else:
            os.replace(self.partial, self.output)
        self._committed = True
        return self.output

    def _release_owner(self) -> None:
        if self._owner is not None:
            self._owner.close()
            self._owner = None

    def abort(self) -> None:
        """Remove the partial folder; a second Ctrl-C or `kill` meanwhile waits until it is gone."""
        self._spool.close(remove=False)  # removed with the folder
        with signals_deferred():
            self._release_owner()
            if self.partial.exists() and not self.partial.is_symlink():
                shutil.rmtree(self.partial, ignore_errors=True)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not self._committed:
            self.abort()
            code = write_failure_errno(exc)
            if code is not None:  # anything written into the partial folder: shards, config, card
                where = getattr(exc, "filename", None)
                raise OutputWriteError(
                    f"{self.output}: writing the output failed ({os.strerror(code)}"
                    + (f": {Path(where).name}" if where else "")
                    + f"); removed {self.partial.name}, nothing was written. Free some space or choose another location"
                ) from exc


# errno values that can only mean "the output cannot be written"
_WRITE_FAILURES = {errno.ENOSPC, errno.EROFS, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}


def write_failure_errno(error: BaseException | None) -> int | None:
    """The errno of a failed write (disk full, quota, read-only), from an OSError or a safetensors error."""
    if isinstance(error, OSError):
        return error.errno if error.errno in _WRITE_FAILURES else None
    if error is not None and type(error).__name__ == "SafetensorError":
        match = re.search(r"os error (\d+)", str(error))
        if match and int(match.group(1)) in _WRITE_FAILURES:
            return int(match.group(1))
    return None


# --------------------------------------------------------------------------- scratch folders
SCRATCH_LOCK = ".mla-convert-lock"
# the calibration statistics, and a sweep's converted models until each is scored (both may be large)
STATS_SCRATCH_PREFIX = "mla-convert-stats-"
SWEEP_SCRATCH_PREFIX = "mla-convert-sweep-"
SCRATCH_PREFIXES = (STATS_SCRATCH_PREFIX, SWEEP_SCRATCH_PREFIX)


def claim_scratch_folder(folder: str | os.PathLike):
    """Mark `folder` (a temp folder of this run) as in use until the returned handle is closed.

    The handle holds an `flock`, which the kernel drops when the process dies, even by SIGKILL; so
    `clean_stale_scratch_folders` in a later run can tell a leftover from a folder a live run still uses,
    across users and PID namespaces, without trusting PIDs.  The PID is written after the lock is held: an
    empty lock file means "being created", and is cleaned only when nothing else is in the folder and it has been
    that way for `CREATION_GRACE_SECONDS` (a run killed mid-creation).
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no cleaning of leftovers
        return None
    handle = open(Path(folder) / SCRATCH_LOCK, "w")
    fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


class ScratchFolder:
    """A temp folder of this run (calibration statistics, a sweep's models) that a later run can clean after a kill.

    The folder and its owner lock (`claim_scratch_folder`) appear together, or not at all, as far as Ctrl-C and kill
    can tell; SIGKILL, which nothing can defer, may leave a half-made one, which `clean_stale_scratch_folders` removes
    once it is old.  `cleanup()` removes the folder, then releases the lock even if the removal failed (a folder
    whose lock stayed held would never count as left behind).
    """

    def __init__(self, prefix: str, parent: str | os.PathLike | None = None):
        with signals_deferred():
            self._folder = tempfile.TemporaryDirectory(prefix=prefix, dir=parent)
            self._lock = claim_scratch_folder(self._folder.name)
        self.path = Path(self._folder.name)

    def cleanup(self) -> None:
        try:
            self._folder.cleanup()
        finally:
            if self._lock is not None:
                self._lock.close()
                self._lock = None


def clean_stale_scratch_folders(parent: str | os.PathLike | None = None) -> list[str]:
    """Remove scratch folders (calibration statistics, a sweep's models) that killed runs left in `parent` (default: the
    temp folder)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover
        return []
    parent = Path(parent or tempfile.gettempdir())
    removed = []
    for prefix in SCRATCH_PREFIXES:
        for folder in sorted(parent.glob(prefix + "*")):
            lock = folder / SCRATCH_LOCK
            left_behind = False
            try:
                with open(lock, "r+") as handle:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    # an empty lock: its owner is still creating it, unless that was long ago
                    left_behind = bool(handle.read().strip()) or _abandoned_while_created(folder)
                    if left_behind:
                        shutil.rmtree(folder, ignore_errors=True)
            except FileNotFoundError:  # no lock file: not ours to judge, unless a run died creating it
                left_behind = _abandoned_while_created(folder)
                if left_behind:
                    shutil.rmtree(folder, ignore_errors=True)
            except OSError:  # held by a live run, or not ours to remove
                continue
            if left_behind and not folder.exists():  # (said only of what is gone: another user's folder may resist)
                removed.append(folder.name)
    return removed


# A run creates its scratch folder and locks it within microseconds; one still half-made this long after is a leftover.
CREATION_GRACE_SECONDS = 600


def _abandoned_while_created(folder: Path) -> bool:
    """Whether `folder` is what a run killed (SIGKILL cannot be deferred) between creating its scratch folder and
    writing its PID into the lock left behind: nothing but, at most, an empty lock file, untouched for longer than any
    creation takes. Such a folder holds no data of anyone's, so removing it loses nothing."""
    try:
        entries = [entry.name for entry in folder.iterdir()]
        age = time.time() - folder.stat().st_mtime
    except OSError:
        return False
    return set(entries) <= {SCRATCH_LOCK} and age > CREATION_GRACE_SECONDS


def _fsync_tree(folder: Path) -> None:
    """Flush the files to disk before the rename publishes them."""
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
