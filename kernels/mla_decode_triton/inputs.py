"""Shape, dtype and device checks shared by the reference and the Triton launcher.

Both entry points accept exactly the same tensors, so they validate them in one place: a mistake in
the caller (wrong latent width, a page table for another batch, tensors on two devices) is reported as
one readable line instead of an indexing error deep inside torch or a silent out-of-bounds read inside
a kernel.  The checks only look at shapes and dtypes, never at tensor values, so they cost no device
synchronisation and leave the decode step capturable in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_decode_triton.errors import MLADecodeInputError

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class DecodeShape:
    """Sizes of one decode call, read off the tensors.

    `rows` is the number of query rows per sequence that share the sequence's cache: the head count for
    one query token, `q_len * heads` for speculative decoding.
    """

    batch: int
    q_len: int
    heads: int
    kv_lora_rank: int
    rope_dim: int
    page_size: int
    max_pages: int

    @property
    def rows(self) -> int:
        return self.q_len * self.heads

    @property
    def max_context(self) -> int:
        """Longest context the page table can address; a sync-free upper bound on every seq_len."""
        return self.max_pages * self.page_size


def check_decode_inputs(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int | None,
    q_len_dim: bool = False,
) -> DecodeShape:
    """Validate one decode call and return its sizes.

    With `q_len_dim=False` the queries are (batch, heads, R) / (batch, heads, D); with `q_len_dim=True`
    they are (batch, q_len, heads, R) / (batch, q_len, heads, D) (several query tokens per sequence).
    """
    query_rank = 4 if q_len_dim else 3
    layout = "(batch, q_len, heads, {})" if q_len_dim else "(batch, heads, {})"
    if q_latent.dim() != query_rank:
        raise MLADecodeInputError(f"q_latent must be {layout.format('R')}, got shape {tuple(q_latent.shape)}")
    if q_rope.dim() != query_rank:
        raise MLADecodeInputError(f"q_rope must be {layout.format('D')}, got shape {tuple(q_rope.shape)}")
    if q_rope.shape[:-1] != q_latent.shape[:-1]:
        raise MLADecodeInputError(
            f"q_rope {tuple(q_rope.shape)} and q_latent {tuple(q_latent.shape)} disagree on batch/heads"
        )
    if kv_cache.dim() != 3:
        raise MLADecodeInputError(
            f"kv_cache must be (num_pages, page_size, R + D), got shape {tuple(kv_cache.shape)}"
        )
    rank = q_latent.shape[-1] if kv_lora_rank is None else int(kv_lora_rank)
    rope_dim = q_rope.shape[-1]
    if q_latent.shape[-1] != rank:
        raise MLADecodeInputError(f"q_latent's last dim is {q_latent.shape[-1]} but kv_lora_rank is {rank}")
    if kv_cache.shape[-1] != rank + rope_dim:
        raise MLADecodeInputError(
            f"kv_cache rows hold {kv_cache.shape[-1]} values, expected R + D = {rank} + {rope_dim}"
        )
    batch = q_latent.shape[0]
    if page_table.dim() != 2 or page_table.shape[0] != batch:
        raise MLADecodeInputError(
            f"page_table must be (batch={batch}, max_pages), got shape {tuple(page_table.shape)}"
        )
    if seq_lens.shape != (batch,):
        raise MLADecodeInputError(f"seq_lens must be (batch={batch},), got shape {tuple(seq_lens.shape)}")
    if page_table.dtype not in INDEX_DTYPES or seq_lens.dtype not in INDEX_DTYPES:
        raise MLADecodeInputError(
            f"page_table and seq_lens must be int32 or int64, got {page_table.dtype} and {seq_lens.dtype}"
        )
    if kv_cache.dtype not in CACHE_DTYPES:
        raise MLADecodeInputError(f"kv_cache dtype {kv_cache.dtype} is not one of fp16, bf16, fp32")
    if not (q_latent.is_floating_point() and q_rope.is_floating_point()):
        raise MLADecodeInputError("q_latent and q_rope must be floating point tensors")
    devices = {t.device for t in (q_latent, q_rope, kv_cache, page_table, seq_lens)}
    if len(devices) != 1:
        raise MLADecodeInputError(f"all decode tensors must be on one device, got {sorted(map(str, devices))}")
    if batch == 0 or q_latent.shape[-2] == 0 or page_table.shape[1] == 0 or kv_cache.shape[1] == 0:
        raise MLADecodeInputError("batch, heads, max_pages and page_size must all be at least 1")
    return DecodeShape(
        batch=batch,
        q_len=q_latent.shape[1] if q_len_dim else 1,
        heads=q_latent.shape[-2],
        kv_lora_rank=rank,
        rope_dim=rope_dim,
        page_size=kv_cache.shape[1],
        max_pages=page_table.shape[1],
    )
