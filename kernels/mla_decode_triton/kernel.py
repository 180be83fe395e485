"""Triton kernels for absorbed MLA decode over a paged latent cache (split-KV, then merge).

Only the `@triton.jit` functions live here; `launcher.py` picks the block sizes and launches them.

Why this shape of kernel.  In absorbed MLA every head of a sequence attends over the *same* cache rows
(one latent c of width R plus one shared RoPE key of width D per token, and c doubles as the value).
Decode is therefore memory-bound on reading the cache once, and the kernel makes all heads (a block
of BLOCK_H query rows) share each cache tile it loads: per tile it computes a (BLOCK_H, BLOCK_N) score
block with two small matrix products and folds a (BLOCK_H, BLOCK_N) x (BLOCK_N, R) product into the
output accumulator.  A batch of a few long sequences would leave most multiprocessors idle, so the
context of each sequence is cut into `num_splits` chunks handled by separate programs
("flash-decoding"); each writes a normalised partial output and its log-sum-exp, and a second kernel
combines them: out = sum_s exp(lse_s - lse) * out_s with lse = logsumexp_s lse_s.

Query rows.  A row is one (query token, head) pair; rows are numbered token-major, row = i * heads + h,
so a single decode token is just q_len = 1.  With several query tokens per sequence (speculative
decoding) query i sits at position seq_len - q_len + i and may only see tokens below
seq_len - q_len + i + 1; rows of the same sequence still share every cache tile.

Masking rules that keep garbage out.  Every cache load is masked by `token < split_end <= seq_len`
with `other=0`, and the page-table load is masked the same way, so neither slots past a sequence's end
nor unused page-table entries are ever read: NaN poison there cannot reach the arithmetic.  Padding
lanes (rows >= number of rows, columns >= R or D when those are not powers of two) are zero-filled,
which leaves every dot product unchanged, and are never stored.

Numerics.  Products run on the cache's dtype (tensor cores for fp16/bf16; exact fp32 FMAs for an fp32
cache, where TF32 would lose precision the caller asked for) and accumulate in fp32.  The queries and
the softmax probabilities are rounded to the cache dtype before their products.  Under the Triton
interpreter a bf16 `tl.dot` is not supported (it multiplies the raw bit patterns, triton-lang/triton
#11584), so the launcher then passes DOT_DTYPE = fp32: the operands are still rounded to bf16 first,
so the interpreter checks the same rounding the GPU applies.  The online
softmax works in base 2 (scores are pre-multiplied by softmax_scale * log2(e)) because exp2 is the
native instruction; the stored lse is converted back to natural log.
"""

from __future__ import annotations

import triton
import triton.language as tl

# log2(e) is applied by the launcher (scale_log2); ln(2) converts the base-2 lse back inside the kernel.
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def mla_decode_split_kernel(
    q_latent_ptr,  # (batch, rows, R)
    q_rope_ptr,  # (batch, rows, D)
    kv_cache_ptr,  # (num_pages, PAGE_SIZE, R + D)
    page_table_ptr,  # (batch, max_pages)
    seq_lens_ptr,  # (batch,)
    part_out_ptr,  # (batch, rows, num_splits, R): normalised partial outputs (fp32, or the final output)
    part_lse_ptr,  # (batch, rows, num_splits): natural-log lse of each partial (fp32)
    scale_log2,  # softmax_scale * log2(e)
    num_rows,  # q_len * heads
    heads,
    q_len,
    stride_qlat_b, stride_qlat_r, stride_qlat_c,
    stride_qrope_b, stride_qrope_r, stride_qrope_c,
    stride_kv_page, stride_kv_tok, stride_kv_c,
    stride_pt_b, stride_pt_p,
    stride_po_b, stride_po_r, stride_po_s, stride_po_c,
    stride_pl_b, stride_pl_r, stride_pl_s,
    KV_LORA_RANK: tl.constexpr,  # R
    ROPE_DIM: tl.constexpr,  # D
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # query rows per program (>= 16 for tl.dot)
    BLOCK_N: tl.constexpr,  # cache tokens per tile
    BLOCK_R: tl.constexpr,  # next power of two >= R (>= 16)
    BLOCK_D: tl.constexpr,  # next power of two >= D (>= 16)
    DOT_DTYPE: tl.constexpr,  # operand dtype of the products: the cache dtype, or fp32 (see launcher)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands (no TF32 rounding), else irrelevant
):
    """One program: BLOCK_H query rows of one sequence over one split of its context.

    Grid = (row blocks, splits, batch).  Row blocks vary fastest so the programs that read the same
    cache chunk for different heads are scheduled together and share it through L2.
    """
    pid_rows = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)  # 64-bit so batch offsets into large buffers cannot overflow
    num_splits = tl.num_programs(1)

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    # Chunks are whole tiles long so only the last tile of a split is ragged; a short sequence may
    # leave the trailing splits empty (they then store out = 0, lse = -inf, which the merge ignores).
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    split_start = split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)

    rows = pid_rows * BLOCK_H + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
    row_ok = rows < num_rows
    query_index = rows // heads
    key_limit = seq_len - q_len + query_index + 1  # (BLOCK_H,): row sees tokens t < key_limit
    cols_r = tl.arange(0, BLOCK_R)
    cols_d = tl.arange(0, BLOCK_D)
    r_ok = cols_r < KV_LORA_RANK
    d_ok = cols_d < ROPE_DIM

    cache_dtype = kv_cache_ptr.dtype.element_ty
    q_lat = tl.load(
        q_latent_ptr + seq * stride_qlat_b + rows[:, None] * stride_qlat_r + cols_r[None, :] * stride_qlat_c,
        mask=row_ok[:, None] & r_ok[None, :],
        other=0.0,
    ).to(cache_dtype).to(DOT_DTYPE)  # (BLOCK_H, BLOCK_R): rounded like the cache
    q_rope = tl.load(
        q_rope_ptr + seq * stride_qrope_b + rows[:, None] * stride_qrope_r + cols_d[None, :] * stride_qrope_c,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(cache_dtype).to(DOT_DTYPE)  # (BLOCK_H, BLOCK_D)

    running_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # base-2 max score per row
    running_sum = tl.zeros([BLOCK_H], dtype=tl.float32)  # sum of exp2(score - running_max)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)  # unnormalised sum of p_t * c_t

    for tile_start in range(split_start, split_end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) logical token positions
        token_ok = tokens < split_end
        # Gather through the page table: a tile may span several pages (or, with PAGE_SIZE=1, be one
        # page per token), so each token finds its own physical row.
        physical_page = tl.load(
            page_table_ptr + seq * stride_pt_b + (tokens // PAGE_SIZE) * stride_pt_p, mask=token_ok, other=0
        ).to(tl.int64)
        row_offset = physical_page * stride_kv_page + (tokens % PAGE_SIZE).to(tl.int64) * stride_kv_tok
        latent = tl.load(
            kv_cache_ptr + row_offset[:, None] + cols_r[None, :] * stride_kv_c,
            mask=token_ok[:, None] & r_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)  # (BLOCK_N, BLOCK_R): keys (nope side) and values at once
        rope_key = tl.load(
            kv_cache_ptr + row_offset[:, None] + (KV_LORA_RANK + cols_d[None, :]) * stride_kv_c,
            mask=token_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)  # (BLOCK_N, BLOCK_D)

        scores = tl.dot(q_lat, tl.trans(latent), input_precision=DOT_PRECISION)  # (BLOCK_H, BLOCK_N) fp32
        scores += tl.dot(q_rope, tl.trans(rope_key), input_precision=DOT_PRECISION)
        scores = scores * scale_log2
        visible = token_ok[None, :] & (tokens[None, :] < key_limit[:, None])
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # A row with nothing visible yet keeps max = -inf; shifting by 0 instead avoids -inf - -inf.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2(running_max - shift)  # (BLOCK_H,)
        probs = tl.exp2(scores - shift[:, None])  # (BLOCK_H, BLOCK_N), exactly 0 where not visible
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None]
        # probs are rounded to the cache dtype first, exactly as the tensor-core path does.
        acc = tl.dot(probs.to(cache_dtype).to(DOT_DTYPE), latent, acc, input_precision=DOT_PRECISION)
        running_max = new_max

    has_tokens = running_sum > 0.0
    safe_sum = tl.where(has_tokens, running_sum, 1.0)
    out = acc / safe_sum[:, None]
    lse = tl.where(has_tokens, (running_max + tl.log2(safe_sum)) * LN2, float("-inf"))

    tl.store(
        part_out_ptr
        + seq * stride_po_b
        + rows[:, None] * stride_po_r
        + split * stride_po_s
        + cols_r[None, :] * stride_po_c,
        out.to(part_out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & r_ok[None, :],
    )
    tl.store(part_lse_ptr + seq * stride_pl_b + rows * stride_pl_r + split * stride_pl_s, lse, mask=row_ok)


@triton.jit
def mla_decode_merge_kernel(
    part_out_ptr,  # (batch, rows, num_splits, R) fp32
    part_lse_ptr,  # (batch, rows, num_splits) fp32
    out_ptr,  # (batch, rows, R)
    lse_ptr,  # (batch, rows) fp32
    num_splits,
    stride_po_b, stride_po_r, stride_po_s, stride_po_c,
    stride_pl_b, stride_pl_r, stride_pl_s,
    stride_out_b, stride_out_r, stride_out_c,
    stride_lse_b, stride_lse_r,
    KV_LORA_RANK: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,  # next power of two >= num_splits
    SPLITS_PER_STEP: tl.constexpr,  # partials folded per loop step
    BLOCK_C: tl.constexpr,  # output columns per program
):
    """One program: one query row of one sequence, BLOCK_C output columns, all splits.

    Grid = (column blocks, rows, batch).  Empty splits carry lse = -inf, hence weight 0; the row's lse
    is finite whenever any split saw a token, which the decode contract (seq_len >= q_len) guarantees.
    """
    col_block = tl.program_id(0)
    row = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)

    lse_base = part_lse_ptr + seq * stride_pl_b + row * stride_pl_r
    all_splits = tl.arange(0, BLOCK_SPLITS)
    split_lse = tl.load(lse_base + all_splits * stride_pl_s, mask=all_splits < num_splits, other=float("-inf"))
    max_lse = tl.max(split_lse, axis=0)
    shift = tl.where(max_lse == float("-inf"), 0.0, max_lse)
    total = tl.sum(tl.exp(split_lse - shift), axis=0)  # >= 1 unless every split was empty

    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < KV_LORA_RANK
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    out_base = part_out_ptr + seq * stride_po_b + row * stride_po_r
    for first in range(0, num_splits, SPLITS_PER_STEP):
        splits = first + tl.arange(0, SPLITS_PER_STEP)  # (SPLITS_PER_STEP,)
        split_ok = splits < num_splits
        weight = tl.exp(tl.load(lse_base + splits * stride_pl_s, mask=split_ok, other=float("-inf")) - shift)
        partial = tl.load(
            out_base + splits[:, None] * stride_po_s + cols[None, :] * stride_po_c,
            mask=split_ok[:, None] & col_ok[None, :] & (weight > 0.0)[:, None],
            other=0.0,
        )  # (SPLITS_PER_STEP, BLOCK_C)
        acc += tl.sum(partial * weight[:, None], axis=0)

    has_tokens = total > 0.0
    out = acc / tl.where(has_tokens, total, 1.0)
    tl.store(
        out_ptr + seq * stride_out_b + row * stride_out_r + cols * stride_out_c,
        out.to(out_ptr.dtype.element_ty),
        mask=col_ok,
    )
    # Only one column block writes the row's lse.
    lse = tl.where(has_tokens, shift + tl.log(tl.where(has_tokens, total, 1.0)), float("-inf"))
    tl.store(lse_ptr + seq * stride_lse_b + row * stride_lse_r, lse, mask=col_block == 0)
