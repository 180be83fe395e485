"""Streaming, lazy reader for Hugging Face checkpoints.

A 70B checkpoint does not fit in the memory of the machines people convert on, so nothing here ever
loads a whole checkpoint: tensors are read by name from `safetensors` shards that are opened on
demand, and at most one shard is held open at a time.  A layer's reads are planned up front and grouped
by shard, so a layer whose q/k/v straddle two shards costs two opens, not six.

Families that store several projections in one matrix (Phi-3's `qkv_proj`, its `gate_up_proj`) are read through
row views: the name `"<stored name>[start:stop]"` means rows start:stop of the stored matrix, read without the rest.
The converter then handles a fused checkpoint by the same roles as a split one.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import struct
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError, PickleRefusedError
from .paths import NotARegularFile, open_regular_file, within
from .safetensors_stream import TORCH_DTYPES
from .shard_file import FileState, ShardFile, changed_error, open_shard

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
PICKLE_SINGLE = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"
_ROW_VIEW = re.compile(r"^(?P<stored>.+)\[(?P<start>\d+):(?P<stop>\d+)\]$")


def row_view_name(stored: str, start: int, stop: int) -> str:
    """The name under which the reader serves rows start:stop of the stored matrix `stored`."""
    return f"{stored}[{start}:{stop}]"


def split_row_view(name: str) -> tuple[str, int, int] | None:
    """(stored name, start, stop) for a row-view name; None for a plain tensor name."""
    match = _ROW_VIEW.match(name)
    if match is None or int(match["start"]) >= int(match["stop"]):
        return None
    return match["stored"], int(match["start"]), int(match["stop"])


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of a stored tensor, known from headers alone."""

    name: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype).element_size()


def _hub_blobs_folder(root: Path) -> Path | None:
    """The `blobs/` folder of a Hugging Face cache repo when `root` is one of its `snapshots/<revision>` folders.

    `snapshot_download` fills a snapshot folder with symlinks into `../../blobs/`, so those links, and
    only those, are part of the model even though they point outside the folder.
    """
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith(("models--", "datasets--", "spaces--")):
        return root.parent.parent / "blobs"
    return None


def _inside(folder: Path, relative: str) -> Path:
    """Resolve `relative` under `folder`, refusing anything that escapes it (`../`, absolute paths, symlinks out).

    The one exception is the Hugging Face cache layout (see `_hub_blobs_folder`).
    """
    if os.path.isabs(relative) or Path(relative).drive:
        raise CheckpointError(f"{folder}: index names an absolute path {relative!r}; refusing to read outside the model folder")
    candidate = folder / relative
    root = folder.resolve()
    if not within(Path(os.path.normpath(root / relative)), root):
        raise CheckpointError(f"{folder}: {relative!r} is a path outside the model folder; refusing to read it")
    resolved = candidate.resolve()
    if within(resolved, root):
        return candidate
    blobs = _hub_blobs_folder(root)
    if blobs is not None and within(resolved, blobs.resolve()):
        return candidate
    raise CheckpointError(f"{folder}: {relative!r} is a symlink pointing outside the model folder ({resolved}); refusing to read it")


def read_safetensors_header(path: Path) -> dict:
    """Parse and sanity-check a safetensors header without mapping the file.

    The checks here catch truncated downloads and garbage files with a message naming the file, where
    the library itself would fail later with an offset error.
    """
    try:
        with open_regular_file(path) as handle:
            return safetensors_header_of(handle, path)[0]
    except NotARegularFile as error:
        raise CheckpointError(str(error)) from None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read ({error.strerror or error})") from error


def safetensors_header_of(handle, path: Path) -> tuple[dict, int]:
    """(checked header, byte offset of the data section) of the safetensors file open as `handle` (read from its start)."""
    size = os.fstat(handle.fileno()).st_size
    raw_len = os.pread(handle.fileno(), 8, 0)
    if len(raw_len) < 8:
        raise CheckpointError(f"{path}: corrupt safetensors file (shorter than its 8-byte header length)")
    (header_len,) = struct.unpack("<Q", raw_len)
    if header_len > size - 8 or header_len > 100_000_000:
        raise CheckpointError(f"{path}: corrupt safetensors file (header length {header_len} exceeds the file size {size})")
    header_bytes = os.pread(handle.fileno(), header_len, 8)
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: corrupt safetensors file (header is not valid JSON: {error})") from error
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors file (header is not a JSON object)")
    data_size = size - 8 - header_len
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            dtype, shape = entry["dtype"], entry["shape"]
            if not all(isinstance(offset, int) and not isinstance(offset, bool) and offset >= 0 for offset in (begin, end)):
                raise TypeError("data_offsets must be non-negative integers")
            if not isinstance(dtype, str):
                raise TypeError("dtype must be a string")
        except (TypeError, KeyError, ValueError) as error:
            raise CheckpointError(f"{path}: corrupt safetensors file (bad header entry for {name!r})") from error
        if end > data_size or begin > end:
            raise CheckpointError(
                f"{path}: truncated or corrupt safetensors file (tensor {name!r} ends at byte {end}, "
                f"the data section holds {data_size}); re-download or re-export it"
            )
        if dtype not in TORCH_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        if not isinstance(shape, list) or any((not isinstance(s, int)) or s < 0 for s in shape):
            raise CheckpointError(f"{path}: corrupt safetensors file (bad shape for {name!r})")
        # A byte range that disagrees with shape x dtype would only fail when the tensor is finally read
        # (possibly hours into a conversion); catching it here makes it a pre-flight problem.
        expected = _element_size(TORCH_DTYPES[dtype])
        for extent in shape:
            expected *= extent
        if end - begin != expected:
            raise CheckpointError(
                f"{path}: corrupt safetensors file (tensor {name!r} of shape {shape} and dtype {dtype} needs "
                f"{expected} bytes, its header gives it {end - begin})"
            )
    data_end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"), default=0)
    if data_end != data_size:  # bytes beyond the last tensor: a file of another (longer) copy, or garbage
        raise CheckpointError(f"{path}: corrupt safetensors file ({size:,} bytes on disk, its header describes "
                              f"{8 + header_len + data_end:,})")
    return header, 8 + header_len


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Fold:
    """How every read of one stored tensor is changed: rows reordered (row i is stored row `row_order[i]`), then
    multiplied by `scale` (in fp32, rounded once to the stored dtype)."""

    scale: float = 1.0
    row_order: torch.Tensor | None = None


def holds_safetensors(folder: str | os.PathLike) -> bool:
    """Whether `folder` has safetensors weights, which transformers' `from_pretrained` (and `CheckpointReader`) load
    before any pickled copy beside them: --allow-pickle then changes nothing."""
    folder = Path(folder)
    return (folder / SAFE_SINGLE).exists() or (folder / SAFE_INDEX).exists()


def unneeded_pickle_note(folders: Sequence[str | os.PathLike]) -> str | None:
    """What to say when --allow-pickle was given and every folder read holds safetensors (None: it is needed or
    may be): the flag was harmless, but whoever passed it expected *.bin weights to be read."""
    if not folders or not all(holds_safetensors(folder) for folder in folders):
        return None
    names = " and ".join(str(folder) for folder in folders)
    return (f"--allow-pickle has no effect: {names} {'holds' if len(folders) == 1 else 'hold'} safetensors weights, "
            "which are read (as transformers reads them when a folder holds both)")


class CheckpointReader:
    """Read tensors by name from a local Hugging Face model folder, one shard open at a time.

    `allow_pickle` must be set explicitly to read `pytorch_model*.bin` files: unpickling runs code, so
    they are loaded with `torch.load(weights_only=True)` and only when the user asked for it.
    """

    def __init__(self, folder: str | os.PathLike, allow_pickle: bool = False, pickle_flag: bool = True):
        self.folder = Path(folder)
        self.pickle_flag = pickle_flag  # the command has --allow-pickle (generate, finetune: safetensors only)
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: no such model folder")
        self.allow_pickle = allow_pickle
        self.ignored_index: tuple[str, str] | None = None  # (index, single file) when a folder holds both
        self.format, self.weight_map = self._discover()
        self._open_file: str | None = None
        self._open_handle = None
        self._infos: dict[str, TensorInfo] | None = None
        # tensor name -> the other files holding a copy of it (filled by `tensor_infos`): an ambiguous checkpoint
        self.stray_copies: dict[str, list[str]] = {}
        self.files_opened = 0
        # stored tensor name -> how every read of it is changed (`fold`)
        self.folds: dict[str, Fold] = {}
        # shard -> the state it was in when this reader first checked its header, and (header, data offset): a shard
        # that changes after that is an error, not a header to check again (`shard_file`)
        self._shard_states: dict[str, FileState] = {}
        self._headers: dict[str, tuple[dict, int]] = {}

    # ----------------------------------------------------------------- discovery
    def _discover(self) -> tuple[str, dict[str, str]]:
        """The weights transformers' `from_pretrained` loads, in its order: model.safetensors before the shard index
        (reading the index first converted another model than the one transformers runs, when a folder held both)."""
        folder = self.folder
        if (folder / SAFE_SINGLE).exists():
            if (folder / SAFE_INDEX).exists():
                self.ignored_index = (SAFE_INDEX, SAFE_SINGLE)
            path = _inside(folder, SAFE_SINGLE)
            header = read_safetensors_header(path)
            return "safetensors", {name: SAFE_SINGLE for name in header if name != "__metadata__"}
        if (folder / SAFE_INDEX).exists():
            return "safetensors", self._read_index(folder / SAFE_INDEX)
        pickled = (folder / PICKLE_INDEX).exists() or (folder / PICKLE_SINGLE).exists()
        if pickled:
            if not self.allow_pickle:
                remedy = ("Convert them to safetensors first, or pass --allow-pickle to load them with torch.load(weights_only=True)"
                          if self.pickle_flag else
                          "This command reads safetensors only: convert them to safetensors first")
                raise PickleRefusedError(
                    f"{folder}: holds only pickled PyTorch weights (*.bin); unpickling can run arbitrary code. {remedy}"
                )
            if (folder / PICKLE_SINGLE).exists():  # (transformers' order again)
                if (folder / PICKLE_INDEX).exists():
                    self.ignored_index = (PICKLE_INDEX, PICKLE_SINGLE)
                state = self._load_pickle(PICKLE_SINGLE)
                return "pickle", {name: PICKLE_SINGLE for name in state}
            return "pickle", self._read_index(folder / PICKLE_INDEX)
        expected = (f"{SAFE_SINGLE}, {SAFE_INDEX} or, with --allow-pickle, {PICKLE_SINGLE}" if self.pickle_flag else
                    f"{SAFE_SINGLE} or {SAFE_INDEX}")
        raise CheckpointError(f"{folder}: no weights found (expected {expected})")

    def _read_index(self, index_path: Path) -> dict[str, str]:
        try:
            with open_regular_file(index_path) as handle:
                index = json.loads(handle.read())
            weight_map = index["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index_path}: unreadable shard index ({error})") from error
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: shard index has an empty or invalid weight_map")
        for name, file in weight_map.items():
            if not isinstance(file, str):
                raise CheckpointError(f"{index_path}: weight_map entry for {name!r} is not a file name")
            path = _inside(self.folder, file)
            if not path.exists():
                raise CheckpointError(f"{index_path}: names shard {file!r} (for {name!r}), which is missing from the folder")
        return dict(weight_map)

    # ----------------------------------------------------------------- metadata
    @property
    def files(self) -> list[str]:
        """Shard files, each once, sorted by name: shard order for `model-0000k-of-0000n` names.

        (Not the order of first appearance in the index: `weight_map` is sorted by tensor name, which
        would put `lm_head`'s shard, usually the last, first.)
        """
        return sorted(set(self.weight_map.values()))

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return self._stored_name(name) in self.weight_map

    def _stored_name(self, name: str) -> str:
        """The stored tensor that holds `name` (itself, unless it is a row view of a stored matrix)."""
        if name in self.weight_map:
            return name
        view = split_row_view(name)
        return view[0] if view is not None else name

    def info(self, name: str) -> TensorInfo:
        """Shape and dtype of a stored tensor or of a row view (headers only); a view's rows must lie inside the
        stored matrix."""
        infos = self.tensor_infos()
        if name in infos:
            return infos[name]
        view = split_row_view(name)
        if view is None or view[0] not in infos:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        stored, start, stop = view
        whole = infos[stored]
        if not whole.shape or stop > whole.shape[0]:
            raise CheckpointError(f"{self.folder / whole.file}: tensor {stored!r} has shape {list(whole.shape)}, too few "
                                  f"rows for rows {start}:{stop}")
        return TensorInfo(name, whole.file, (stop - start, *whole.shape[1:]), whole.dtype)

    def tensor_infos(self) -> dict[str, TensorInfo]:
        """Shape and dtype of every tensor, from headers only (no tensor data is read)."""
        if self._infos is None:
            infos: dict[str, TensorInfo] = {}
            self.stray_copies = {}
            for file in self.files:
                if self.format == "safetensors":
                    shard = self._open_shard(file)
                    shard.close()
                    for name, entry in shard.header.items():
                        if name != "__metadata__" and self.weight_map.get(name, file) != file:
                            self.stray_copies.setdefault(name, []).append(file)
                        if name == "__metadata__" or self.weight_map.get(name) != file:
                            continue
                        infos[name] = TensorInfo(name, file, tuple(entry["shape"]), TORCH_DTYPES[entry["dtype"]])
                else:
                    state = self._load_pickle(file)
                    for name, tensor in state.items():
                        if self.weight_map.get(name, file) != file:
                            self.stray_copies.setdefault(name, []).append(file)
                        if self.weight_map.get(name) == file:
                            infos[name] = TensorInfo(name, file, tuple(tensor.shape), tensor.dtype)
            missing = [name for name in self.weight_map if name not in infos]
            if missing:
                raise CheckpointError(
                    f"{self.folder / self.weight_map[missing[0]]}: the index lists {missing[0]!r} here but the shard does not hold it"
                    + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else "")
                )
            self._infos = infos
        return self._infos

    def floating_dtype(self) -> torch.dtype | None:
        """The dtype transformers' `dtype="auto"` loads when config.json states none: the first floating-point tensor's,
        by name, in the first file (None: no floating-point tensor)."""
        infos = self.tensor_infos()
        first = self.files[0] if self.files else None
        for name in sorted(name for name, info in infos.items() if info.file == first):
            if infos[name].dtype.is_floating_point and infos[name].dtype.itemsize > 1:  # (not fp8, as in transformers)
                return infos[name].dtype
        return None

    def header_problems(self) -> list[str]:
        """One line per shard whose header is unreadable or inconsistent (all shards, not just the first).

        Pre-flight uses this to report every damaged shard at once; `tensor_infos` stops at the first.
        """
        if self.format != "safetensors":
            return []
        problems = []
        for file in self.files:
            try:
                read_safetensors_header(_inside(self.folder, file))
            except CheckpointError as error:
                problems.append(str(error))
        return problems

    def total_bytes(self) -> int:
        return sum(info.nbytes for info in self.tensor_infos().values())

    # ----------------------------------------------------------------- reading
    def plan(self, names: Iterable[str]) -> list[tuple[str, list[str]]]:
        """Group the requested names by shard, shards in `files` order: the order `get_many` reads them."""
        by_file: dict[str, list[str]] = {}
        for name in names:
            if name not in self:
                raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
            by_file.setdefault(self.weight_map[self._stored_name(name)], []).append(name)
        order = {file: rank for rank, file in enumerate(self.files)}
        # Read the shard that is already open first: it costs nothing to switch to.
        return sorted(by_file.items(), key=lambda item: (item[0] != self._open_file, order[item[0]]))

    def get(self, name: str) -> torch.Tensor:
        return self.get_many([name])[name]

    def get_many(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Read several tensors, opening each needed shard once."""
        names = list(names)
        out: dict[str, torch.Tensor] = {}
        for file, file_names in self.plan(names):
            handle = self._handle(file)
            for name in file_names:
                out[name] = self._read(handle, file, name)
        return {name: out[name] for name in names}

    def get_from(self, file: str, name: str) -> torch.Tensor:
        """The copy of `name` stored in `file`, whatever the index says (to compare a stray copy with the indexed one)."""
        return self._read(self._handle(file), file, name)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of a tensor, reading only those rows (embedding tables of large vocabularies)."""
        if name not in self.weight_map:
            view = split_row_view(name)
            if view is None or view[0] not in self.weight_map:
                raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
            stored, first, last = view
            return self.get_rows(stored, first + start, min(first + stop, last))
        file = self.weight_map[name]
        handle = self._handle(file)
        try:
            return self._rows(handle, name, start, stop)
        except Exception as error:
            raise CheckpointError(f"{self.folder / file}: cannot read rows of {name!r} ({error})") from error

    def fold(self, folds: Mapping[str, Fold]) -> None:
        """Change every later read of these stored tensors (whole, rows, row views) as their `Fold` says.

        How a family that differs from Llama only by linear changes (Granite's multipliers, adjacent-pair RoPE) is
        read as the Llama it equals (`source.folds`).  A name the checkpoint lacks changes nothing here: pre-flight
        reports the missing tensor."""
        self.folds = dict(folds)

    def _rows(self, handle, stored: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows start:stop of a stored tensor (None: all of it), folded.  A reordered tensor is read whole: its rows
        start:stop come from anywhere in it (only query and key projections are reordered)."""
        fold = self.folds.get(stored)
        if fold is not None and fold.row_order is not None:
            rows = self._raw(handle, stored)[fold.row_order][start:stop]
        else:
            rows = self._raw(handle, stored, start, stop)
        return rows if fold is None or fold.scale == 1.0 else (rows.float() * fold.scale).to(rows.dtype)

    def _raw(self, handle, stored: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        if self.format == "safetensors":
            return handle.read(stored, start, stop)
        tensor = handle[stored]
        return (tensor if start is None else tensor[start:stop]).clone()

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, shard by shard in `files` order."""
        for file in self.files:
            for name in [n for n, f in self.weight_map.items() if f == file]:
                yield name, self._read(self._handle(file), file, name)

    def _read(self, handle, file: str, name: str) -> torch.Tensor:
        view = None if name in self.weight_map else split_row_view(name)
        try:
            if view is not None:  # rows of a fused matrix
                self.info(name)  # (raises unless the rows lie inside the stored matrix: headers only)
                stored, start, stop = view
                return self._rows(handle, stored, start, stop)
            return self._rows(handle, name)
        except CheckpointError:
            raise
        except Exception as error:  # safetensors raises its own error types; name the file for the user
            raise CheckpointError(f"{self.folder / file}: cannot read tensor {name!r} ({error})") from error

    def _handle(self, file: str):
        if self._open_file == file:
            return self._open_handle
        self.close()
        if self.format == "safetensors":
            handle = self._open_shard(file)
        else:
            handle = self._load_pickle(file)
        self._open_file, self._open_handle = file, handle
        self.files_opened += 1
        return handle

    def _open_shard(self, file: str) -> ShardFile:
        """The shard opened for positioned reads, pinned to the state it had when this reader first checked its header."""
        path = _inside(self.folder, file)
        handle, state = open_shard(path)
        try:
            change = state.change_from(self._shard_states.setdefault(file, state))
            if change:
                raise changed_error(path, change)
            if file not in self._headers:
                try:
                    self._headers[file] = safetensors_header_of(handle, path)
                except OSError as error:
                    raise CheckpointError(f"{path}: cannot read ({error.strerror or error})") from error
            header, data_start = self._headers[file]
            return ShardFile(path, handle, state, header, data_start)
        except BaseException:
            handle.close()
            raise

    def _load_pickle(self, file: str) -> dict[str, torch.Tensor]:
        """Load a pickled state dict with `weights_only=True`: tensors and plain containers, no code.

        Only the zip format (torch >= 1.6) can be memory-mapped; older "legacy" files are read whole.
        Anything but a flat name -> tensor mapping (a training checkpoint with an `epoch` entry, a
        nested `state_dict`) is refused rather than guessed at.
        """
        path = _inside(self.folder, file)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
        except pickle.UnpicklingError as error:
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            # torch's message is a paragraph; the line naming the offending global is the useful one.
            detail = next((line for line in lines if "global" in line.lower()), lines[0] if lines else type(error).__name__)
            raise CheckpointError(
                f"{path}: refused: the pickle holds something other than tensors, which weights-only loading "
                f"will not unpickle ({detail})"
            ) from error
        except Exception as error:
            first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise CheckpointError(f"{path}: cannot load pickled weights ({first_line})") from error
        if not isinstance(state, dict):
            raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a state dict of tensors")
        for name, value in state.items():
            if not isinstance(name, str) or not isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"{path}: entry {name!r} is a {type(value).__name__}, not a tensor; expected a flat state dict "
                    "(name -> tensor), as save_pretrained writes"
                )
        return state

    def close(self) -> None:
        if isinstance(self._open_handle, ShardFile):
            self._open_handle.close()
        self._open_file, self._open_handle = None, None

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
