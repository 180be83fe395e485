"""Triton kernels for DeepSeek-style absorbed Multi-head Latent Attention decode on a paged latent cache.

`mla_decode` runs the split-KV Triton kernel (CUDA, or the Triton interpreter on CPU when
TRITON_INTERPRET=1 is set before triton is imported); `mla_decode_reference` is the pure-torch oracle
with the same signature.  `mla_decode_multi` / `mla_decode_multi_reference` take several causal query
tokens per sequence (speculative decoding).

Modules: `kernel` (the @triton.jit kernels: split-KV attention, row-major or tokens-major - the
latter puts many-head products on Hopper's wgmma -, and the LSE merge), `configs` (the
candidate tiles per shape and the measured table `tuned_configs.json`), `launcher` (tile, split count
from the real lengths, launches), `autotune` (time the candidate tiles on a GPU, keep the fastest),
`reference` (pure-torch oracle), `inputs` (shared argument checks), `testing` (adversarial paged
inputs), `compile_check` (compile every candidate for sm_90 without a GPU and report registers, spills,
instruction mix; `TRITON_INTERPRET=0 python -m mla_decode_triton.compile_check`).

On a GPU machine: `scripts/device_kernel_check.sh` runs the GPU tests, the autotuner and the benchmark
in one go (`TRITON_INTERPRET=0 pytest -m gpu tests/test_mla_decode_kernel.py`, then
`python scripts/bench_mla_decode.py`).
"""

from __future__ import annotations

import importlib

# Imported on first use: the torch reference must import where triton is not installed (a CPU-only install).
_WHERE = {
    "TileConfig": "configs", "candidate_tiles": "configs", "MLADecodeInputError": "errors",
    "DecodeConfig": "launcher", "choose_config": "launcher", "mla_decode": "launcher", "mla_decode_multi": "launcher",
    "mla_decode_multi_reference": "reference", "mla_decode_reference": "reference",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(name)


__all__ = [
    "DecodeConfig",
    "MLADecodeInputError",
    "TileConfig",
    "candidate_tiles",
    "choose_config",
    "mla_decode",
    "mla_decode_multi",
    "mla_decode_multi_reference",
    "mla_decode_reference",
]
