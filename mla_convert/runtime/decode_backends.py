"""Which absorbed-MLA decode attention runs: the Triton kernel or its pure-torch reference.

Both come from `mla_decode_triton` and share one signature, (q_latent, q_rope, kv_cache, page_table,
seq_lens, softmax_scale, kv_lora_rank, *, max_seq_len, mean_seq_len) -> (out (B, H, R), lse (B, H)), so
the model calls whichever is chosen here without knowing which (the length hints only size the
kernel's split count; the reference ignores them).  "auto" picks the kernel on CUDA and the reference elsewhere;
"triton" on CPU runs the kernel in the Triton interpreter (only when TRITON_INTERPRET=1 was set before
triton was imported) - slow, but it checks the runtime/kernel contract on any machine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .errors import GenerationSettingsError

BACKENDS = ("auto", "triton", "reference")

DecodeAttention = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _import_kernels():
    try:
        import mla_decode_triton
    except ImportError as error:  # triton is an optional dependency
        raise GenerationSettingsError(
            f"MLA decoding needs the mla_decode_triton package and triton ({error}); pip install 'mla-convert[triton]'"
        ) from None
    return mla_decode_triton


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise GenerationSettingsError(f"decode backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "reference"
    return backend


def decode_attention(backend: str, device: torch.device) -> DecodeAttention:
    """The decode attention function for `backend` on `device`, checked to be runnable there."""
    name = resolve_backend(backend, device)
    if name == "reference":  # pure torch: no triton needed (a CPU-only install decodes with this)
        from mla_decode_triton.reference import mla_decode_reference

        return mla_decode_reference
    kernels = _import_kernels()
    from mla_decode_triton.launcher import INTERPRETED

    if device.type == "cuda" and INTERPRETED:
        raise GenerationSettingsError("TRITON_INTERPRET=1 is set, so the Triton kernel cannot run on the GPU; unset it")
    if device.type != "cuda" and not INTERPRETED:
        raise GenerationSettingsError(
            f"the Triton decode kernel needs CUDA (device is {device}); use the reference backend, "
            "or set TRITON_INTERPRET=1 before triton is imported to run the kernel in the interpreter"
        )
    return kernels.mla_decode
