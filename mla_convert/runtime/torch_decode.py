"""Absorbed-MLA decode attention for CPUs: plain torch, one sequence at a time, lengths read on the host.

Why not the reference (`mla_decode_triton.reference`)?  That one is the Triton kernel's oracle: it stays free of
host reads so that it runs inside a CUDA graph, and so it gathers every sequence's pages into a dense float32 copy
the size of the page table and zeroes the slots past each length with a second full-size copy before multiplying.
On a CPU there is no graph to stay inside and reading a length costs nothing, so this path cuts each sequence's
rows to its length first and multiplies them where they lie: a sequence whose pages are consecutive in the pool
(a lone sequence, or any sequence until another one takes a page in between) is read as a view of the cache,
with no copy at all; any other gathers only its own pages.

The loop pays a dozen torch calls per sequence and layer, the reference a dozen per layer, so with many short
sequences the reference's batched products win: below LOOP_FROM_VALUES cached values per sequence on average
(length x (R + D)) this path hands the call to the reference (`uses_loop`); the threshold comes from the loop /
reference timings in BENCHMARKS.md, "CPU decode" (`scripts/bench_cpu_decode_paths.py`).

The contract is the reference's and the kernel's (`check_decode_inputs`): slots past a sequence's length and
page-table entries past its last page are never read, a length of 0 gives out = 0 and lse = -inf.  It is not for
CUDA: reading the lengths on the host would synchronise every layer of every step and break graph capture.
"""

from __future__ import annotations

import torch
from mla_decode_triton.inputs import check_decode_inputs
from mla_decode_triton.reference import mla_decode_reference

LOOP_FROM_VALUES = 65536  # mean cached values per sequence (length x (R + D)) from which the loop beats the reference


def uses_loop(lengths: list[int], row_width: int) -> bool:
    """Whether the per-sequence loop runs (else the reference's batched products): long enough caches on average."""
    return sum(lengths) * row_width >= LOOP_FROM_VALUES * max(1, len(lengths))


def sequence_rows(kv_cache: torch.Tensor, pages: list[int], length: int) -> torch.Tensor:
    """The first `length` cached rows (length, R + D) of a sequence held in `pages` (its physical page ids, in order).

    Consecutive pages are one slice of the pool, so the rows are a view of the cache (padded rows too: a page's
    stride is page_size rows, so pages and tokens merge into one axis); otherwise the sequence's pages are gathered.
    """
    used = pages[: -(-length // kv_cache.shape[1])]
    first = used[0]
    if used == list(range(first, first + len(used))):
        block = kv_cache[first : first + len(used)]  # (pages, page_size, R + D), a view
    else:
        block = kv_cache[torch.tensor(used, device=kv_cache.device)]  # (pages, page_size, R + D), gathered
    return block.reshape(-1, kv_cache.shape[2])[:length]  # (pages * page_size, R + D) -> (length, R + D)


def mla_decode_torch(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int | None = None,
    num_splits: int | None = None,
    *,
    max_seq_len: int | None = None,
    mean_seq_len: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode, one query token per sequence, with `mla_decode_reference`'s signature and results.

    q_latent (batch, heads, R), q_rope (batch, heads, D), kv_cache (num_pages, page_size, R + D), page_table
    (batch, max_pages) int, seq_lens (batch,) int.  Returns out (batch, heads, R) in q_latent's dtype and lse
    (batch, heads) float32.  The launch arguments (`num_splits`, `max_seq_len`, `mean_seq_len`) are ignored.
    Products and softmax in float32, as in the reference (which runs the call for short caches, `uses_loop`).
    """
    shape = check_decode_inputs(q_latent, q_rope, kv_cache, page_table, seq_lens, kv_lora_rank)
    lengths = seq_lens.tolist()
    if not uses_loop(lengths, kv_cache.shape[2]):
        return mla_decode_reference(q_latent, q_rope, kv_cache, page_table, seq_lens, softmax_scale, kv_lora_rank)
    rank = shape.kv_lora_rank
    queries = torch.cat([q_latent, q_rope], dim=-1).float()  # (batch, heads, R + D)
    out = torch.zeros(shape.batch, shape.heads, rank, dtype=torch.float32, device=kv_cache.device)
    lse = torch.full((shape.batch, shape.heads), float("-inf"), dtype=torch.float32, device=kv_cache.device)
    for seq, (length, pages) in enumerate(zip(lengths, page_table.tolist())):
        if length == 0:
            continue
        rows = sequence_rows(kv_cache, pages, length).float()  # (length, R + D)
        scores = (queries[seq] @ rows.T) * softmax_scale  # (heads, length): latent and rope parts in one product
        lse[seq] = torch.logsumexp(scores, dim=-1)
        out[seq] = torch.exp(scores - lse[seq, :, None]) @ rows[:, :rank]  # (heads, R)
    return out.to(q_latent.dtype), lse
