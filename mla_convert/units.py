"""Units shared by every command: dtype names and byte counts for people."""

from __future__ import annotations

import torch

from .errors import InvalidShapeError

DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """`bf16`, `float32`, `torch.float16`... -> the torch dtype (a user error for anything else)."""
    if name is None:
        return default
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPE_NAMES[str(name).lower().replace("torch.", "")]
    except KeyError as error:
        raise InvalidShapeError(f"unknown dtype {name!r}; use one of bf16, fp32 (or fp16 where a command accepts it)") from error


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `bfloat16` (as configs and reports write it)."""
    return str(dtype).replace("torch.", "")


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def human_bytes(count: float, digits: int = 2) -> str:
    """1536 -> '1.50 KiB' (binary units; whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.{digits}f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")
