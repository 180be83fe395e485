"""Write `.safetensors` files tensor by tensor, byte-identical to `safetensors.torch.save_file`.

`save_file` needs every tensor of a file in memory at once.  A converter produces its output one layer at
a time, so holding a whole shard (5 GB by default) would make its memory grow with the shard limit.  Here
a shard's tensors are appended to a scratch "spool" file the moment they arrive (`ShardSpool.append`) and
dropped; when the shard is complete its `.safetensors` file is laid out from the spool
(`ShardSpool.assemble`), copying in the kernel or through a bounded buffer.  Memory is then bounded by the
largest single tensor, whatever the shard limit.

The layout reproduced (checked against `save_file` for every dtype in `tests/test_streaming_writer.py`):
  * 8 bytes: little-endian u64 length of the header;
  * header: compact JSON (`,` and `:` without spaces, non-ASCII characters written as UTF-8) with
    `__metadata__` first, then one entry `{"dtype","shape","data_offsets"}` per tensor, in data order;
    padded with spaces to a multiple of 8 bytes;
  * data: the tensors back to back, ordered by dtype (the order of `SAFETENSORS_DTYPES`: widest first,
    so every tensor stays aligned to its element size) and, within a dtype, by name.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# safetensors' dtype names in the order `save_file` lays data out (its Rust `Dtype` enum, descending);
# torch attribute names, since some dtypes only exist in recent torch releases.
SAFETENSORS_DTYPES: tuple[tuple[str, str], ...] = (
    ("uint64", "U64"),
    ("int64", "I64"),
    ("float64", "F64"),
    ("complex64", "C64"),
    ("float32", "F32"),
    ("uint32", "U32"),
    ("int32", "I32"),
    ("bfloat16", "BF16"),
    ("float16", "F16"),
    ("uint16", "U16"),
    ("int16", "I16"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e8m0fnu", "F8_E8M0"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("int8", "I8"),
    ("uint8", "U8"),
    ("bool", "BOOL"),
)
_DTYPE_NAMES: dict[torch.dtype, str] = {
    getattr(torch, attr): name for attr, name in SAFETENSORS_DTYPES if isinstance(getattr(torch, attr, None), torch.dtype)
}
_DTYPE_RANK: dict[str, int] = {name: rank for rank, (_, name) in enumerate(SAFETENSORS_DTYPES)}
# header name -> torch dtype, for every dtype this torch build has (the reader's table)
TORCH_DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in _DTYPE_NAMES.items()}

METADATA = {"format": "pt"}  # what save_pretrained / save_file(metadata={"format": "pt"}) record
COPY_CHUNK = 64 * 2**20  # bytes per write/copy call: bounds the buffer of the user-space copy fallback
# copy_file_range errors that only mean "not between these files / on this kernel": copy in user space
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.EPERM}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (`torch.bfloat16` -> `"BF16"`)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be written to a safetensors checkpoint by mla-convert") from None


def tensor_bytes(tensor: torch.Tensor):
    """The bytes safetensors stores for `tensor` (row-major, little-endian) as a uint8 array.

    A contiguous CPU tensor is not copied: the array is a view of its memory (for a memory-mapped tensor, of
    the mapping), so the caller should drop it as soon as it is written.  Goes through a uint8 view of the
    tensor: numpy has no bfloat16 or float8, so `tensor.numpy()` in the tensor's own dtype would fail.
    """
    if sys.byteorder != "little":  # pragma: no cover - no big-endian torch builds in use
        raise NotImplementedError("writing safetensors on a big-endian machine is not supported")
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    tensor = tensor.resolve_conj().resolve_neg().contiguous()
    flat = tensor.reshape(-1)  # (numel,): a 0-dim tensor becomes one element
    return flat.view(torch.uint8).numpy()  # (numel * element_size,)


@dataclass(frozen=True)
class SpooledTensor:
    """Where one tensor's bytes sit in the spool file, and what the header will say about it."""

    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # in the spool file
    nbytes: int


def data_order(entries: list[SpooledTensor]) -> list[SpooledTensor]:
    """The order `save_file` writes tensors in: by dtype (`SAFETENSORS_DTYPES` order), then by name."""
    return sorted(entries, key=lambda entry: (_DTYPE_RANK[entry.dtype], entry.name))


def header_bytes(entries_in_data_order: list[SpooledTensor]) -> bytes:
    """Length prefix + JSON header, space-padded so the data starts at a multiple of 8, as `save_file` does."""
    header: dict = {"__metadata__": METADATA}
    begin = 0
    for entry in entries_in_data_order:
        header[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape), "data_offsets": [begin, begin + entry.nbytes]}
        begin += entry.nbytes
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def describe(name: str, tensor: torch.Tensor, offset: int) -> SpooledTensor:
    """The header facts of one tensor, checked before anything is written for it."""
    if not isinstance(name, str):
        raise TypeError(f"tensor names must be strings, got {type(name).__name__}")
    if name == "__metadata__":
        raise ValueError("'__metadata__' is reserved by the safetensors format and cannot name a tensor")
    if tensor.layout != torch.strided:
        raise ValueError(f"tensor {name!r} is {tensor.layout}; only dense tensors can be written (call .to_dense())")
    return SpooledTensor(name, dtype_name(tensor.dtype), tuple(tensor.shape), offset, tensor.numel() * tensor.element_size())


def write_all(fd: int, data) -> int:
    """Write all of `data` (bytes-like) to `fd`, in chunks of at most COPY_CHUNK; returns the byte count."""
    view = memoryview(data).cast("B")
    total = len(view)
    while view:
        written = os.write(fd, view[:COPY_CHUNK])
        view = view[written:]
    return total


def copy_range(source: int, offset: int, length: int, destination: int) -> None:
    """Append bytes [offset, offset + length) of `source` at the position of `destination`.

    `copy_file_range` copies inside the kernel (no user memory; on XFS/btrfs it can share the blocks);
    where the file system or kernel cannot, a bounded user-space buffer does it.
    """
    end = offset + length
    if hasattr(os, "copy_file_range"):
        while offset < end:
            try:
                copied = os.copy_file_range(source, destination, min(end - offset, COPY_CHUNK), offset)
            except OSError as error:
                if error.errno not in _NO_KERNEL_COPY:
                    raise
                break
            if copied == 0:  # some file systems report "nothing copied" instead of an error
                break
            offset += copied
    while offset < end:
        chunk = os.pread(source, min(end - offset, COPY_CHUNK), offset)
        if not chunk:
            raise OSError(errno.EIO, f"spool file ends at byte {offset}, expected {end}")
        offset += write_all(destination, chunk)


_fallocate = None


def release_range(fd: int, offset: int, length: int) -> None:
    """Free the disk blocks of bytes already copied out of the spool (best effort, Linux).

    Without this a shard would briefly need twice its size on disk: the spool plus the shard file.
    """
    global _fallocate
    if length <= 0 or not sys.platform.startswith("linux"):
        return
    if _fallocate is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            function = getattr(libc, "fallocate64", None) or libc.fallocate
        except (OSError, AttributeError):
            _fallocate = False
            return
        function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        function.restype = ctypes.c_int
        _fallocate = function
    if _fallocate:
        punch_hole_keep_size = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        _fallocate(fd, punch_hole_keep_size, offset, length)  # failure (e.g. EOPNOTSUPP) only costs disk space


@contextlib.contextmanager
def naming_the_file(path: Path):
    """Give OSErrors raised by fd-level calls the file name they lack (the user sees which file failed)."""
    try:
        yield
    except OSError as error:
        if error.filename is None and error.errno is not None:
            raise OSError(error.errno, error.strerror or os.strerror(error.errno), str(path)) from error
        raise


def _create(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)


def write_single_tensor_file(path: Path, name: str, tensor: torch.Tensor) -> None:
    """A `.safetensors` file holding one tensor, written straight from the tensor's memory."""
    entry = describe(name, tensor, 0)
    with naming_the_file(path):
        fd = _create(path)
        try:
            write_all(fd, header_bytes([entry]))
            write_all(fd, tensor_bytes(tensor))
        finally:
            os.close(fd)


class ShardSpool:
    """The shard being filled: tensor bytes go to a scratch file as they arrive, in arrival order.

    Nothing of a tensor is kept after `append` returns but its name, dtype, shape and byte range.
    `assemble` writes the finished `.safetensors` file and empties the spool for the next shard.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.entries: list[SpooledTensor] = []
        self.nbytes = 0
        self._names: set[str] = set()
        self._fd: int | None = None
        self._failed: BaseException | None = None  # a write that stopped part-way leaves the spool unusable

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self.entries)

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"{self.path}: an earlier write failed part-way; this shard cannot be finished") from self._failed

    def append(self, name: str, tensor: torch.Tensor) -> None:
        self._check_usable()
        entry = describe(name, tensor, self.nbytes)
        data = tensor_bytes(tensor)  # before the spool is touched: a tensor that cannot be read leaves it intact
        try:
            with naming_the_file(self.path):
                if self._fd is None:
                    self._fd = _create(self.path)
                written = write_all(self._fd, data)
        except BaseException as error:  # disk full, Ctrl-C: the spool now ends in a torn tensor
            self._failed = error
            raise
        finally:
            del data  # the last reference to the tensor's memory (or its file mapping) held here
        if written != entry.nbytes:  # pragma: no cover - would mean tensor_bytes disagrees with numel * element_size
            raise RuntimeError(f"tensor {name!r}: wrote {written} bytes, expected {entry.nbytes}")
        self.entries.append(entry)
        self._names.add(name)
        self.nbytes += entry.nbytes

    def append_rows(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                    read_rows: Callable[[int, int], torch.Tensor], rows_per_chunk: int) -> None:
        """Append one tensor given as row blocks `read_rows(start, stop)` (row-major bytes are contiguous).

        For tensors read from a memory-mapped checkpoint: each block's mapping can be dropped before the
        next one is read, so an embedding table never becomes resident as a whole.
        """
        self._check_usable()
        probe = torch.empty((0, *shape[1:]), dtype=dtype)
        entry = describe(name, probe, self.nbytes)
        entry = SpooledTensor(entry.name, entry.dtype, tuple(shape), entry.offset,
                              int(torch.Size(shape).numel()) * probe.element_size())
        written = 0
        try:
            with naming_the_file(self.path):
                if self._fd is None:
                    self._fd = _create(self.path)
                for start in range(0, shape[0], rows_per_chunk):
                    block = read_rows(start, min(start + rows_per_chunk, shape[0]))
                    if block.dtype != dtype or tuple(block.shape[1:]) != tuple(shape[1:]):
                        raise ValueError(f"tensor {name!r}: row block {tuple(block.shape)} {block.dtype} does not match {shape} {dtype}")
                    data = tensor_bytes(block)
                    del block
                    written += write_all(self._fd, data)
                    del data
        except BaseException as error:
            self._failed = error
            raise
        if written != entry.nbytes:
            self._failed = RuntimeError(f"tensor {name!r}: wrote {written} bytes, expected {entry.nbytes}")
            raise self._failed
        self.entries.append(entry)
        self._names.add(name)
        self.nbytes += entry.nbytes

    def assemble(self, path: Path) -> None:
        """Write the spooled tensors as the `.safetensors` file `path`, then empty the spool."""
        self._check_usable()
        ordered = data_order(self.entries)
        try:
            with naming_the_file(path):
                fd = _create(path)
                try:
                    write_all(fd, header_bytes(ordered))
                    for entry in ordered:
                        copy_range(self._fd, entry.offset, entry.nbytes, fd)
                        release_range(self._fd, entry.offset, entry.nbytes)
                finally:
                    os.close(fd)
        except BaseException as error:  # ranges already copied were released: the spool cannot be laid out again
            self._failed = error
            raise
        self.entries, self._names, self.nbytes = [], set(), 0
        with naming_the_file(self.path):
            os.ftruncate(self._fd, 0)
            os.lseek(self._fd, 0, os.SEEK_SET)

    def close(self, remove: bool = True) -> None:
        """Close the spool file (and delete it unless the whole folder is about to be removed anyway)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        self.entries, self._names, self.nbytes = [], set(), 0
        if remove:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
