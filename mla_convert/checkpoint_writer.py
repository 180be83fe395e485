"""Streaming writer that produces the same files `save_pretrained` does.

Tensors arrive one at a time (layer by layer) and are flushed to a shard as soon as the shard is full,
so memory holds at most one shard's worth of output.  Everything goes into a temporary sibling folder
that is renamed onto the output path only when complete: an interrupted run never leaves a folder at
the output path that looks like a finished model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch
from huggingface_hub import constants as hub_constants
from safetensors.torch import save_file

from .errors import OutputExistsError

PARTIAL_SUFFIX = ".mla-convert-partial"
# Marker inside a partial folder naming the process that writes it, so a later run can tell a
# leftover of a dead run (safe to remove) from a folder another live run is still writing.
OWNER_FILE = ".mla-convert-owner"

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
    except ValueError as error:
        raise ValueError(f"max_shard_size {size!r}: expected bytes or a size like '5GB' (units KB, MB, GB, TB)") from error


def partial_path_for(output: Path) -> Path:
    return output.with_name(output.name + PARTIAL_SUFFIX)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_partial(output: Path) -> str | None:
    """Remove the partial folder an interrupted earlier run left beside `output`.

    Returns a message describing what was done (for the user), or None if there was nothing.  A partial
    folder still owned by a live process is left alone and reported as an error instead.
    """
    partial = partial_path_for(output)
    if not partial.exists():
        return None
    owner = partial / OWNER_FILE
    try:
        pid = int(owner.read_text().strip())
    except (OSError, ValueError):
        pid = None
    if pid is not None and pid != os.getpid() and _process_alive(pid):
        raise OutputExistsError(
            f"{partial}: another mla-convert process (pid {pid}) is writing this output; wait for it or remove the folder"
        )
    shutil.rmtree(partial)
    return f"removed {partial.name}, left behind by an interrupted run"


def prepare_output_path(output: str | os.PathLike, overwrite: bool = False) -> Path:
    """Check the output path before any heavy work; raise if it exists and `overwrite` is off."""
    output = Path(output)
    if output.exists() and not overwrite:
        raise OutputExistsError(f"{output}: already exists; choose another path or pass --overwrite")
    if not output.parent.exists():
        raise OutputExistsError(f"{output.parent}: parent folder does not exist")
    if not os.access(output.parent, os.W_OK):
        raise OutputExistsError(f"{output.parent}: not writable")
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
    ):
        self.output = prepare_output_path(output, overwrite)
        self.overwrite = overwrite
        self.max_shard_size = parse_shard_size(max_shard_size)
        if self.max_shard_size <= 0:
            raise ValueError("max_shard_size must be positive")
        self.cleanup_message = clean_stale_partial(self.output)
        self.partial = partial_path_for(self.output)
        self.partial.mkdir()
        (self.partial / OWNER_FILE).write_text(str(os.getpid()))
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self._shard_files: list[list[str]] = []  # tensor names per written shard, in order
        self._written: set[str] = set()  # names already on disk, for the duplicate check
        self.total_size = 0
        self.total_parameters = 0
        self._committed = False

    # ----------------------------------------------------------------- tensors
    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; the current shard is flushed first if this one would overflow it.

        Same packing rule as `huggingface_hub.split_torch_state_dict_into_shards`, so a model written
        in state-dict order lands in the same shards as `save_pretrained` puts it.  In particular a
        tensor larger than the limit gets a shard of its own *immediately*, numbered before the shard
        still being filled, which stays open for the tensors that follow.
        """
        if name in self._written or name in self._shard:
            raise ValueError(f"tensor {name!r} written twice")
        tensor = tensor.detach().to("cpu").contiguous()
        size = tensor.numel() * tensor.element_size()
        if size > self.max_shard_size:
            self._write_shard({name: tensor})
        else:
            if self._shard_bytes + size > self.max_shard_size:
                self._flush()
            self._shard[name] = tensor
            self._shard_bytes += size
        self.total_size += size
        self.total_parameters += tensor.numel()

    def add_many(self, tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        items = tensors.items() if isinstance(tensors, dict) else tensors
        for name, tensor in items:
            self.add(name, tensor)

    def _flush(self) -> None:
        if not self._shard:
            return
        shard, self._shard, self._shard_bytes = self._shard, {}, 0
        self._write_shard(shard)

    def _write_shard(self, tensors: dict[str, torch.Tensor]) -> None:
        index = len(self._shard_files)
        save_file(tensors, str(self.partial / f"shard-{index:05d}.tmp"), metadata={"format": "pt"})
        self._shard_files.append(list(tensors))
        self._written.update(tensors)

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
        _fsync_tree(self.partial)
        if self.output.exists():
            if not self.overwrite:
                raise OutputExistsError(f"{self.output}: appeared while converting; the result is kept in {self.partial}")
            # Move the old folder aside first, so that a crash here never leaves neither.
            backup = self.output.with_name(self.output.name + ".mla-convert-old")
            if backup.exists():
                shutil.rmtree(backup)
            os.replace(self.output, backup)
            os.replace(self.partial, self.output)
            shutil.rmtree(backup)
        else:
            os.replace(self.partial, self.output)
        self._committed = True
        return self.output

    def abort(self) -> None:
        self._shard = {}
        if self.partial.exists():
            shutil.rmtree(self.partial, ignore_errors=True)

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not self._committed:
            self.abort()


def _fsync_tree(folder: Path) -> None:
    """Flush the files to disk before the rename publishes them."""
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
