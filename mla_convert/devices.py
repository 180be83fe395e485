"""Compute devices: what `--device` may name, and the default when it names none."""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    """cuda when a CUDA device is there, else cpu (the default of eval and generate)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(name: str | torch.device | None) -> torch.device:
    return default_device() if name is None else torch.device(name)


def device_problems(device: str | None, flag: str = "--device") -> list[str]:
    """The device exists here and is one mla-convert computes on (cpu, cuda, cuda:N); None is the default."""
    if device is None:
        return []
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        return [f"{flag} {device!r}: not a device (use cpu, cuda or cuda:N)"]
    if parsed.type not in ("cpu", "cuda"):
        return [f"{flag} {device}: mla-convert computes on cpu or cuda"]
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            return [f"{flag} {device}: no CUDA device is available"]
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            return [f"{flag} {device}: there are {count} CUDA devices (cuda:0 .. cuda:{count - 1})"]
    return []


# Share of a GPU's free memory that may hold source weights across the conversion's passes (the rest is for
# activations, the calibration KV cache, statistics and factorizations).
RESIDENT_WEIGHT_SHARE = 0.5


def resident_weight_budget(device: torch.device) -> int:
    """Bytes of source weights a conversion keeps on `device` instead of streaming them again each pass.

    0 on the CPU: there the operating system's page cache already keeps re-read shards, and the promise is
    a peak RSS of about one layer.  On a GPU, a share of the free memory.
    """
    if device.type != "cuda":
        return 0
    free, _total = torch.cuda.mem_get_info(device)
    return int(free * RESIDENT_WEIGHT_SHARE)
