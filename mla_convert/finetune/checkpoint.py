"""Training checkpoints that are data, written like exports and verified before a resume loads them.

A checkpoint folder `step-NNNNNNN/` holds:

  model.safetensors (or FSDP's sharded pieces)  student weights            accelerate `save_state`
  optimizer.bin (or FSDP's pieces)              AdamW state                accelerate `save_state`
  random_states_<rank>.pkl                      RNG states of each process accelerate `save_state`
  trainer_state.json                            LR schedule, data cursor, history (plain JSON)
  checkpoint_complete.json                      step, settings, and the size and sha256 of every file above

Why not accelerate's registered objects: it pickles them to `custom_checkpoint_*.pkl` and loads them with
`weights_only=False`, so a crafted checkpoint folder would run code on `--resume`.  Here nothing in a checkpoint is
unpickled beyond plain tensor data: torch-saved files must load with `weights_only=True` (tensors, numbers, the
numpy arrays of RNG states), FSDP's checkpoint metadata goes through an unpickler that builds only the checkpoint
library's own record classes, and a file the manifest does not list is refused.

Written into `step-NNNNNNN.partial` and renamed when complete, so a crash or a full disk never leaves a folder that
looks like a checkpoint; a damaged one (a file truncated or changed since it was written) is found by its sha256
before anything loads.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import torch

from ..errors import MLAConvertError
from ..units import human_bytes

CHECKPOINT_PREFIX = "step-"
COMPLETE_MARKER = "checkpoint_complete.json"
TRAINER_STATE = "trainer_state.json"
PARTIAL_SUFFIX = ".partial"
# written into a checkpoint folder the run creates: a folder without it that holds other files is the user's
OWNER_MARKER = ".mla-convert-checkpoints"
MANIFEST_VERSION = 2
HASH_CHUNK = 1 << 22


class CheckpointError(MLAConvertError):
    pass


def _write_errors() -> tuple[type[BaseException], ...]:
    from safetensors import SafetensorError

    return (OSError, RuntimeError, SafetensorError)


WRITE_ERRORS = _write_errors()


def step_folder(root: Path, step: int) -> Path:
    return root / f"{CHECKPOINT_PREFIX}{step:07d}"


def step_of(folder: Path) -> int | None:
    """The step a folder named `step-NNNNNNN` holds; None for any other name (`.partial` included)."""
    digits = folder.name[len(CHECKPOINT_PREFIX):]
    return int(digits) if folder.name.startswith(CHECKPOINT_PREFIX) and digits.isdigit() else None


def complete_checkpoints(root: Path) -> list[Path]:
    """Folders under `root` that claim to be complete checkpoints (a marker is present), oldest first."""
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir()
             if step_of(path) is not None and path.is_dir() and not path.is_symlink() and (path / COMPLETE_MARKER).is_file()]
    return sorted(found, key=step_of)


# --------------------------------------------------------------------------- the root folder
def claim_root(root: Path) -> list[str]:
    """Make `root` this tool's checkpoint folder, or say why it is not one.  A folder that exists, is not empty, and
    was not made by mla-convert is the user's: the run would write its log over their files and remove `step-*`
    folders it did not make, so it is refused (problems, one line each; [] means claimed)."""
    if root.is_dir() and not (root / OWNER_MARKER).is_file():
        foreign = sorted(path.name for path in root.iterdir())
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            return [f"checkpoint_dir {root}: holds files mla-convert did not write ({shown}); the run writes its log "
                    "and checkpoints there and removes old ones, so give a new or empty folder"]
    root.mkdir(parents=True, exist_ok=True)
    (root / OWNER_MARKER).touch()
    return []


def remove_partial_checkpoints(root: Path) -> list[str]:
    """Remove `step-*.partial` folders a crash or a full disk left behind; returns what was removed."""
    removed = []
    for path in sorted(root.glob(f"{CHECKPOINT_PREFIX}*{PARTIAL_SUFFIX}")) if root.is_dir() else []:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


# --------------------------------------------------------------------------- writing
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> list[Path]:
    """Every entry under `folder` except the marker, as paths relative to it (folders are walked, not listed)."""
    found = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if path.is_dir() and not path.is_symlink():
            continue
        if relative.as_posix() != COMPLETE_MARKER:
            found.append(relative)
    return found


def _fsync(path: Path) -> None:
    """Best effort: some file systems refuse fsync on folders."""
    with contextlib.suppress(OSError):
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def write_checkpoint(accelerator, root: Path, step: int, states: dict, marker: dict) -> Path:
    """Write the training state of `step` as `root/step-NNNNNNN` (see the module docstring); returns the folder.

    Every process takes part (accelerate writes each rank's RNG state and, under FSDP, its shard); the main process
    adds the JSON states and the manifest and renames the folder into place.  A write that fails (a full disk)
    removes what it wrote and raises `CheckpointError`; the checkpoints written before stay as they were.
    """
    folder = step_folder(root, step)
    partial = folder.with_name(folder.name + PARTIAL_SUFFIX)
    main = accelerator.is_main_process
    failure = None
    if main:
        shutil.rmtree(partial, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(partial))
    except WRITE_ERRORS as error:  # (safetensors and torch.save report a failed write in their own types)
        failure = error
    # every process learns whether any failed (one that raised alone would leave the others waiting at a barrier)
    failed_anywhere = _any_process(accelerator, failure is not None)
    if failed_anywhere and failure is None:
        failure = OSError(f"another process could not write its part of {partial.name}")
    if main and failure is None:
        try:
            (partial / TRAINER_STATE).write_text(json.dumps(states) + "\n")
            manifest = {relative.as_posix(): {"bytes": (partial / relative).stat().st_size,
                                              "sha256": _sha256(partial / relative)} for relative in _files(partial)}
            (partial / COMPLETE_MARKER).write_text(json.dumps(
                marker | {"manifest_version": MANIFEST_VERSION, "files": manifest}) + "\n")
            for relative in list(manifest) + [COMPLETE_MARKER]:
                _fsync(partial / relative)
            if folder.exists():  # the same step written again (a resume that stopped where it started)
                shutil.rmtree(folder)
            os.replace(partial, folder)
            _fsync(root)
        except OSError as error:
            failure = error
    if _any_process(accelerator, failure is not None) and failure is None:
        failure = OSError(f"the main process could not finish {partial.name}")
    if failure is not None:
        if main:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(_write_failure(failure, folder, root))
    return folder


def _any_process(accelerator, flag: bool) -> bool:
    """Whether `flag` is true in any process (a sum over processes; no communication in a single process)."""
    if accelerator.num_processes == 1:
        return flag
    total = accelerator.reduce(torch.tensor([int(flag)], device=accelerator.device), reduction="sum")
    return bool(total.item())


def _write_failure(error: BaseException, folder: Path, root: Path) -> str:
    kept = [path.name for path in complete_checkpoints(root)]
    last = f"the last complete checkpoint is {root / kept[-1]}" if kept else "no earlier checkpoint exists"
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or f"os error {errno.ENOSPC})" in text:
        free = human_bytes(shutil.disk_usage(root).free) if root.exists() else "?"
        reason = f"the disk is full ({free} free in {root})"
    else:
        reason = getattr(error, "strerror", None) or text
    return (f"checkpoint {folder.name}: could not be written: {reason}; the partial checkpoint was removed and {last} "
            "(free space and continue with --resume auto)")


# --------------------------------------------------------------------------- reading
# Classes FSDP's checkpoint metadata (`.metadata`, a plain pickle) is built from; nothing else is constructed.
DCP_MODULES = ("torch.distributed.checkpoint.",)
SAFE_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                ("pathlib", "PureWindowsPath"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice")}


class _RecordsOnlyUnpickler(pickle.Unpickler):
    """Builds the checkpoint library's record classes and torch dtypes/sizes; refuses every other global (the
    callables a crafted pickle would run)."""

    def find_class(self, module: str, name: str):
        found = super().find_class(module, name) if _allowed_global(module, name) else None
        if found is None:
            raise pickle.UnpicklingError(f"refers to {module}.{name}, which a checkpoint never holds")
        return found


def _allowed_global(module: str, name: str) -> bool:
    if (module, name) in SAFE_GLOBALS:
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
    if module.startswith(DCP_MODULES) and not name.startswith("__"):
        import importlib

        try:
            value = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return False
        return isinstance(value, type)  # record classes and enums, never functions
    return False


def _check_data_file(path: Path) -> str | None:
    """Why `path` is not plain data (None: it is).  Loads it the way the resume will, minus the code."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as handle:
                handle.keys()
        except Exception as error:  # noqa: BLE001 (safetensors raises its own error types)
            return f"not a readable safetensors file ({error})"
        return None
    if path.suffix == ".json":
        try:
            json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as error:
            return f"not valid JSON ({error})"
        return None
    if path.suffix == ".distcp":  # raw tensor bytes; their non-tensor entries load with weights_only=True
        return None
    if path.name == ".metadata":
        try:
            with open(path, "rb") as handle:
                _RecordsOnlyUnpickler(handle).load()
        except Exception as error:  # noqa: BLE001 (any unpickling failure is a refusal)
            return f"checkpoint metadata that is not plain records ({error})"
        return None
    if zipfile.is_zipfile(path):
        from accelerate.utils import load as accelerate_load  # weights_only=True with the RNG states' numpy types

        try:
            accelerate_load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 (torch raises UnpicklingError, RuntimeError, ...)
            return f"not plain tensor data (torch.load with weights_only=True refused it: {str(error).splitlines()[0]})"
        return None
    return "a kind of file a checkpoint never holds"


def verify_checkpoint(folder: Path) -> dict:
    """The marker of a complete, undamaged checkpoint made of data only; raises `CheckpointError` naming the first
    problem otherwise.  Reads every file once (sha256) and loads each pickled one without running code."""
    marker_path = folder / COMPLETE_MARKER
    try:
        marker = json.loads(marker_path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{folder}: its {COMPLETE_MARKER} cannot be read ({error})") from None
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"{folder}: not a checkpoint this version can verify (no file list in {COMPLETE_MARKER}; "
                              "checkpoints of mla-convert before 2026-12 pickled part of their state): start a new run "
                              "in another checkpoint_dir")
    present = {relative.as_posix() for relative in _files(folder)}
    unexpected = sorted(present - set(files))
    if unexpected:
        raise CheckpointError(f"{folder}: holds {', '.join(unexpected[:5])}, which its manifest does not list: refused "
                              "(a checkpoint is only what the run wrote)")
    for name, facts in files.items():
        path = folder / name
        if not isinstance(facts, dict) or name.startswith("/") or ".." in Path(name).parts:
            raise CheckpointError(f"{folder}: its manifest entry {name!r} is not a file of the checkpoint")
        if not path.exists():
            raise CheckpointError(f"{folder}: {name} is missing")
        if path.is_symlink() or not path.is_file():
            raise CheckpointError(f"{folder}: {name} is not a regular file")
        size = path.stat().st_size
        if size != facts.get("bytes"):
            raise CheckpointError(f"{folder}: {name} holds {size:,} bytes, {facts.get('bytes'):,} were written "
                                  "(truncated or changed since)")
        if _sha256(path) != facts.get("sha256"):
            raise CheckpointError(f"{folder}: {name} changed since it was written (its sha256 differs)")
        problem = _check_data_file(path)
        if problem:
            raise CheckpointError(f"{folder}: {name} is {problem}")
    if TRAINER_STATE not in files:
        raise CheckpointError(f"{folder}: {TRAINER_STATE} is missing")
    return marker


def read_trainer_states(folder: Path) -> dict:
    """The JSON states `write_checkpoint` stored (call after `verify_checkpoint`)."""
    states = json.loads((folder / TRAINER_STATE).read_text())
    if not isinstance(states, dict):
        raise CheckpointError(f"{folder}: {TRAINER_STATE} does not hold the training state")
    return states


# --------------------------------------------------------------------------- room on disk
# headroom over the estimates (safetensors headers, JSON, the RNG states, file-system blocks)
DISK_MARGIN = 1.05
DISK_SLACK_BYTES = 1 << 20


def checkpoints_held(max_steps: int, checkpoint_every: int, keep: int) -> int:
    """How many checkpoints can be on disk at once: the `keep` newest of the periodic ones plus the one being
    written (a signal or `stop_after` writes one even when none are scheduled)."""
    periodic = (max_steps - 1) // checkpoint_every if checkpoint_every else 0
    return min(keep, periodic) + 1


def disk_problems(needs: list[tuple[Path, int, str]]) -> list[str]:
    """Refusals for `needs` = [(folder, bytes, what)] that do not fit the free space of their file system (folders
    on one file system are added up: each may fit alone while together they do not)."""
    by_device: dict[int, list[tuple[Path, int, str]]] = {}
    for folder, size, what in needs:
        by_device.setdefault(os.stat(folder).st_dev, []).append((folder, size, what))
    problems = []
    for group in by_device.values():
        folder = group[0][0]
        need = int(sum(size for _, size, _ in group) * DISK_MARGIN) + DISK_SLACK_BYTES
        free = shutil.disk_usage(folder).free
        if need > free:
            parts = " + ".join(f"{what} {human_bytes(size)}" for _, size, what in group)
            problems.append(f"not enough disk space in {folder}: the run needs about {human_bytes(need)} ({parts}) and "
                            f"{human_bytes(free)} is free; free space, lower --keep-checkpoints, or put "
                            "--checkpoint-dir on another disk (checked before training, so no trained step is lost)")
    return problems
