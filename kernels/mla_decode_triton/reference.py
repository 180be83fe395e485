"""Pure-torch absorbed-MLA decode over a paged latent cache: the oracle for the Triton kernel.

Written for clarity and trustworthiness first, speed second, and with no data-dependent Python control
flow (no `.item()`), so the same function runs on CPU and CUDA and doubles as the torch baseline in
`scripts/bench_mla_decode.py`.

How it works: every sequence's pages are gathered into a dense, logically ordered (batch, max_context,
R + D) tensor, the slots past each sequence's length are replaced by zeros *before* any arithmetic
(masking after a multiply would let `0 * NaN` poison the result), and then the attention is two
batched matrix products in float32 with an ordinary masked softmax.

Semantics, for one query row of sequence b:
    score_t = softmax_scale * (q_latent · c_t + q_rope · krope_t)      for visible tokens t
    out     = sum_t softmax(score)_t * c_t          (c is both the key-nope side and the value)
    lse     = logsumexp_t(score_t)                  (natural log, float32)
"""

from __future__ import annotations

import torch

from mla_decode_triton.inputs import check_decode_inputs


def gather_paged_cache(
    kv_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand the paged cache into a dense float32 (batch, max_pages * page_size, R + D) tensor.

    Returns the dense rows and the (batch, max_context) mask of valid tokens.  Page-table entries past a
    sequence's last page may be garbage (unallocated, -1, out of range), so they are redirected to page
    0 before indexing; the rows they bring in are zeroed by the token mask like any other slot past
    the sequence's end.
    """
    batch, max_pages = page_table.shape
    page_size, width = kv_cache.shape[1], kv_cache.shape[2]
    device = kv_cache.device
    lens = seq_lens.to(device=device, dtype=torch.int64)
    pages_used = (lens + page_size - 1) // page_size  # (batch,)
    logical_page = torch.arange(max_pages, device=device)  # (max_pages,)
    page_in_use = logical_page[None, :] < pages_used[:, None]  # (batch, max_pages)
    physical_page = torch.where(page_in_use, page_table.to(torch.int64), 0)  # (batch, max_pages)
    paged_rows = kv_cache[physical_page]  # (batch, max_pages, page_size, R + D)
    dense = paged_rows.reshape(batch, max_pages * page_size, width)  # (batch, max_context, R + D): logical order
    token = torch.arange(max_pages * page_size, device=device)  # (max_context,)
    token_valid = token[None, :] < lens[:, None]  # (batch, max_context)
    dense = torch.where(token_valid[..., None], dense.float(), 0.0)  # garbage/NaN slots become exact zeros
    return dense, token_valid


def _attend(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    dense: torch.Tensor,
    visible: torch.Tensor,
    softmax_scale: float,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention of (batch, rows, ·) queries over the dense cache, all in float32.

    `visible` is (batch, rows, max_context).  A row that sees no token at all (only possible when a
    caller breaks the seq_len >= q_len rule of the multi-token variant) gets out = 0 and lse = -inf,
    the same convention the Triton kernel uses, instead of NaN.
    """
    latent = dense[..., :rank]  # (batch, max_context, R)
    rope = dense[..., rank:]  # (batch, max_context, D)
    scores = q_latent.float() @ latent.transpose(1, 2)  # (batch, rows, max_context)
    scores = scores + q_rope.float() @ rope.transpose(1, 2)
    scores = scores * softmax_scale
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (batch, rows)
    finite_lse = torch.where(torch.isfinite(lse), lse, 0.0)
    probs = torch.exp(scores - finite_lse[..., None])  # (batch, rows, max_context); 0 where not visible
    out = probs @ latent  # (batch, rows, R)
    return out, lse


def mla_decode_reference(
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
    """Absorbed MLA decode, one query token per sequence.

    q_latent (batch, heads, R), q_rope (batch, heads, D), kv_cache (num_pages, page_size, R + D),
    page_table (batch, max_pages) int, seq_lens (batch,) int (a length of 0 gives out = 0, lse = -inf).
    Returns out (batch, heads, R) in q_latent's dtype and lse (batch, heads) float32.  `num_splits`,
    `max_seq_len` and `mean_seq_len` only tune the Triton kernel's launch; they are accepted (and
    ignored) so that the two functions are interchangeable.
    """
    check_decode_inputs(q_latent, q_rope, kv_cache, page_table, seq_lens, kv_lora_rank)
    # the q_len = 1 case of the multi-token decode: the one query sees every cached token
    out, lse = mla_decode_multi_reference(q_latent[:, None], q_rope[:, None], kv_cache, page_table, seq_lens,
                                          softmax_scale, kv_lora_rank)  # (batch, 1, heads, R), (batch, 1, heads)
    return out[:, 0], lse[:, 0]


def mla_decode_multi_reference(
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
    """Absorbed MLA decode with q_len query tokens per sequence (speculative decoding), causal.

    q_latent (batch, q_len, heads, R), q_rope (batch, q_len, heads, D).  The q_len new tokens are
    already written to the cache, so seq_lens counts them: query i (0-based) sits at position
    seq_len - q_len + i and sees tokens t <= that position.  Requires seq_len >= q_len.  The launch
    arguments (`num_splits`, `max_seq_len`, `mean_seq_len`) are ignored, as in `mla_decode_reference`.
    Returns out (batch, q_len, heads, R) in q_latent's dtype and lse (batch, q_len, heads) float32.
    """
    shape = check_decode_inputs(q_latent, q_rope, kv_cache, page_table, seq_lens, kv_lora_rank, q_len_dim=True)
    batch, q_len, heads = shape.batch, shape.q_len, shape.heads
    dense, _ = gather_paged_cache(kv_cache, page_table, seq_lens)
    lens = seq_lens.to(device=kv_cache.device, dtype=torch.int64)
    query_index = torch.arange(q_len, device=kv_cache.device)  # (q_len,)
    key_limit = lens[:, None] - q_len + query_index[None, :] + 1  # (batch, q_len): tokens t < limit are visible
    token = torch.arange(dense.shape[1], device=kv_cache.device)  # (max_context,)
    visible = token[None, None, :] < key_limit[..., None]  # (batch, q_len, max_context)
    visible = visible.repeat_interleave(heads, dim=1)  # (batch, q_len * heads, max_context): row = i * heads + h
    rows_latent = q_latent.reshape(batch, q_len * heads, shape.kv_lora_rank)  # (batch, q_len * heads, R)
    rows_rope = q_rope.reshape(batch, q_len * heads, shape.rope_dim)  # (batch, q_len * heads, D)
    out, lse = _attend(rows_latent, rows_rope, dense, visible, float(softmax_scale), shape.kv_lora_rank)
    out = out.reshape(batch, q_len, heads, shape.kv_lora_rank)  # (batch, q_len, heads, R)
    lse = lse.reshape(batch, q_len, heads)  # (batch, q_len, heads)
    return out.to(q_latent.dtype), lse
