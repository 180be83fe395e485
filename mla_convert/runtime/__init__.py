"""A small inference runtime for exported MLA models, decoding in absorbed form from a paged latent cache.

It reads the folder `mla-convert convert` writes (a stock dense DeepseekV3 checkpoint), keeps kv_b_proj
split into per-head W_UK / W_UV so that attention runs on the (R + D)-wide latent cache, and decodes with
the `mla_decode_triton` kernel on CUDA (its torch reference on CPU).  Greedy output equals
transformers' `generate` on the same folder token for token (tests/test_runtime.py).

Modules: `loading` (read and check the folder), `paged_cache` (the page pool and the kernel's cache
layout), `model` (absorbed weights, packed prefill, one-token decode), `decode_backends` (kernel or
reference), `generate` (the generation loop, `generate_ids`, `generate_text`).
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
