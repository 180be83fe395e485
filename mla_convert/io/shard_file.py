"""Positioned reads of one safetensors shard: each tensor is copied out with `pread`, never memory-mapped.

Why not a memory map (what `safetensors.safe_open` reads through): a shard that shrinks while it is mapped turns
the next touch of a vanished page into SIGBUS, which kills the process with no Python traceback and no message (a
download tool resuming over the file, a sync client, a second export written into the source folder).  A
positioned read of a shortened file returns fewer bytes, which is an error that can name the file.  The price: each
tensor is a copy in the process's own memory where the map handed out views of the page cache (the streaming copy's
peak in BENCHMARKS, "Streaming checkpoint IO", is measured with this reader).

A shard is also pinned to the state (size, modification time, inode) it had when this run first read its header:
every read compares the open file with that state afterwards, and a later open compares the path with it.  A file
rewritten in place or replaced after pre-flight scanned it for NaN/Inf is then named, instead of converting bytes
that nobody checked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError
from .paths import NotARegularFile, open_regular_file
from .safetensors_stream import TORCH_DTYPES


@dataclass(frozen=True)
class FileState:
    """What changes when a file is truncated, rewritten or replaced."""

    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, stat: os.stat_result) -> FileState:
        return cls(stat.st_size, stat.st_mtime_ns, stat.st_ino)

    def change_from(self, earlier: FileState) -> str | None:
        """How the file differs from `earlier`, in words (None: it does not)."""
        if self.inode != earlier.inode:
            return "was replaced by another file"
        if self.size != earlier.size:
            return f"changed size from {earlier.size:,} to {self.size:,} bytes"
        if self.mtime_ns != earlier.mtime_ns:
            return "was rewritten (its modification time changed)"
        return None


def changed_error(path: Path, change: str) -> CheckpointError:
    return CheckpointError(f"{path}: {change} while this run was reading it; what was read before may not match what is "
                           "there now, so nothing was written. Run again once nothing else writes to the model folder")


def open_shard(path: Path):
    """`path` opened for reading (a regular file only) and its state; a CheckpointError names what is wrong."""
    try:
        handle = open_regular_file(path)
    except NotARegularFile as error:
        raise CheckpointError(str(error)) from None
    except OSError as error:  # removed or made unreadable after the run started (pre-flight saw it)
        raise CheckpointError(f"{path}: cannot read the shard any more ({error.strerror or error}); was it moved or "
                              "deleted while converting?") from error
    return handle, FileState.of(os.fstat(handle.fileno()))


class ShardFile:
    """One open shard: tensors (or leading-dimension row ranges of them) by name, as the header describes them."""

    def __init__(self, path: Path, handle, state: FileState, header: dict, data_start: int):
        self.path, self._handle, self.state = path, handle, state
        self.header, self.data_start = header, data_start

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Tensor `name`, or its rows start:stop (slice semantics on the first dimension: rows are contiguous)."""
        entry = self.header[name]
        begin, end = entry["data_offsets"]
        shape = list(entry["shape"])
        if start is not None or stop is not None:
            rows = shape[0]
            first, last, _ = slice(start, stop).indices(rows)
            last = max(first, last)
            row_bytes = (end - begin) // rows if rows else 0
            begin, end = begin + first * row_bytes, begin + last * row_bytes
            shape[0] = last - first
        data = torch.empty(end - begin, dtype=torch.uint8)  # (bytes,) -> viewed as (shape) of the stored dtype below
        self._read_into(memoryview(data.numpy()), self.data_start + begin)
        return data.view(TORCH_DTYPES[entry["dtype"]]).reshape(shape)

    def _read_into(self, buffer: memoryview, offset: int) -> None:
        done = 0
        while done < len(buffer):
            try:
                got = os.preadv(self._handle.fileno(), [buffer[done:]], offset + done)
            except OSError as error:
                raise CheckpointError(f"{self.path}: cannot read ({error.strerror or error})") from error
            if got == 0:
                now = FileState.of(os.fstat(self._handle.fileno()))
                raise changed_error(self.path, now.change_from(self.state) or f"ended at byte {offset + done:,}")
            done += got
        now = FileState.of(os.fstat(self._handle.fileno()))
        change = now.change_from(self.state)
        if change:
            raise changed_error(self.path, change)

    def close(self) -> None:
        self._handle.close()
