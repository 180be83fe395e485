"""Which absorbed-MLA decode attention runs: the Triton kernel, a plain-torch path for CPUs, or the kernel's reference.

All three share one signature, (q_latent, q_rope, kv_cache, page_table, seq_lens, softmax_scale, kv_lora_rank, *,
max_seq_len, mean_seq_len) -> (out (B, H, R), lse (B, H)), so the model calls whichever is chosen here without
knowing which (the length hints only size the kernel's split count; the others ignore them).  "auto" picks the
kernel on CUDA and "torch" (`torch_decode.py`: each sequence's rows cut to its length on the host, read in place
where its pages are consecutive) elsewhere; "torch" is refused on CUDA, where its host reads would synchronise
every layer and break the runtime's CUDA graphs.  "reference" is the kernel's oracle from `mla_decode_triton`
(graph-capturable, slower: it copies the whole page table's rows every call).  "triton" on CPU runs the kernel in
the Triton interpreter (only when TRITON_INTERPRET=1 was set before triton was imported) - slow, but it checks the
runtime/kernel contract on any machine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .errors import GenerationSettingsError

BACKENDS = ("auto", "triton", "torch", "reference")

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
        return "triton" if device.type == "cuda" else "torch"
    if backend == "torch" and device.type == "cuda":
        raise GenerationSettingsError("decode backend 'torch' reads every sequence's length on the host, which on CUDA "
                                      "would synchronise each layer and break CUDA graphs; use 'triton' (the default "
                                      "there) or 'reference'")
    return backend


def decode_attention(backend: str, device: torch.device) -> DecodeAttention:
    """The decode attention function for `backend` on `device`, checked to be runnable there."""
    name = resolve_backend(backend, device)
    if name == "torch":
        from .torch_decode import mla_decode_torch

        return mla_decode_torch
    if name == "reference":  # pure torch: no triton needed (a CPU-only install decodes with this)
        from mla_decode_triton.reference import mla_decode_reference

        return mla_decode_reference
    kernels = _import_kernels()
    from mla_decode_triton.launcher import INTERPRETED

    if device.type == "cuda" and INTERPRETED:
        raise GenerationSettingsError("TRITON_INTERPRET=1 is set, so the Triton kernel cannot run on the GPU; unset it")
    if device.type != "cuda" and not INTERPRETED:
        raise GenerationSettingsError(
            f"the Triton decode kernel needs CUDA (device is {device}); use the torch backend (the default there), "
            "or set TRITON_INTERPRET=1 before triton is imported to run the kernel in the interpreter"
        )
    return kernels.mla_decode
