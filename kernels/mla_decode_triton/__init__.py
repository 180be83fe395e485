"""Triton kernels for DeepSeek-style absorbed Multi-head Latent Attention decode on a paged latent cache.

`mla_decode` runs the split-KV Triton kernel (CUDA, or the Triton interpreter on CPU when
TRITON_INTERPRET=1 is set before triton is imported); `mla_decode_reference` is the pure-torch oracle
with the same signature.  `mla_decode_multi` / `mla_decode_multi_reference` take several causal query
tokens per sequence (speculative decoding).

Modules: `kernel` (the two @triton.jit kernels: split-KV attention and the LSE merge), `launcher`
(block sizes, split count, launches), `reference` (pure-torch oracle), `inputs` (shared argument
checks), `testing` (adversarial paged inputs), `compile_check` (compile for sm_90 without a GPU and
report registers, spills, shared memory; `TRITON_INTERPRET=0 python -m mla_decode_triton.compile_check`).

On a GPU machine: `TRITON_INTERPRET=0 pytest tests/test_mla_decode_kernel.py` (the conftest otherwise
turns the interpreter on) and `python scripts/bench_mla_decode.py --write-benchmarks BENCHMARKS.md`.
"""

from mla_decode_triton.errors import MLADecodeInputError
from mla_decode_triton.launcher import DecodeConfig, choose_config, mla_decode, mla_decode_multi
from mla_decode_triton.reference import mla_decode_multi_reference, mla_decode_reference

__all__ = [
    "DecodeConfig",
    "MLADecodeInputError",
    "choose_config",
    "mla_decode",
    "mla_decode_multi",
    "mla_decode_multi_reference",
    "mla_decode_reference",
]
