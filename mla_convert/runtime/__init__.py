"""A small inference runtime for exported MLA models, decoding in absorbed form from a paged latent cache.

It reads the folder `mla-convert convert` writes (a stock dense DeepseekV3 checkpoint), absorbs kv_b_proj
(per-head W_UK / W_UV, or folded into the query / output projections where that reads fewer weights)
so that attention runs on the (R + D)-wide latent cache, and decodes with the `mla_decode_triton`
kernel on CUDA, replaying each decode step as a CUDA graph there, and with plain torch on CPU (`torch_decode`).
Greedy output in fp32 equals transformers' `generate` on the same folder token for token (tests/test_runtime.py)
for the same number of new tokens: that number is the caller's `max_new_tokens` (`mla-convert generate`: the folder's
max_new_tokens, else 64), never generate()'s max_length (the folder's, or its default of 20); in bf16 both round
differently (the absorbed products are other products), so a near-tie can pick another token.

Modules: `loading` (read and check the folder), `paged_cache` (the page pool, the kernel's cache layout
and the device page table), `absorption` (where W_UK / W_UV go), `model` (absorbed weights, packed
prefill, one-token decode step), `cuda_graphs` (capture and replay of the decode step),
`decode_backends` (kernel, CPU path or the kernel's reference), `torch_decode` (the CPU path), `generate` (the
generation loop, `generate_ids`, `generate_text`).
"""

from .errors import GenerationSettingsError, RuntimeModelError
from .generate import GenerationOutput, generate_ids, generate_text, run_generation
from .model import AbsorbedMLAModel
from .paged_cache import PagedLatentCache

__all__ = [
    "AbsorbedMLAModel",
    "GenerationOutput",
    "GenerationSettingsError",
    "PagedLatentCache",
    "RuntimeModelError",
    "generate_ids",
    "generate_text",
    "run_generation",
]
