"""Triton kernels for absorbed MLA decode over a paged latent cache (split-KV, then merge).

Only the `@triton.jit` functions live here; `launcher.py` picks the block sizes and launches them.

Why this shape of kernel.  In absorbed MLA every head of a sequence attends over the *same* cache rows
(one latent c of width R plus one shared RoPE key of width D per token, and c doubles as the value).
Decode is therefore memory-bound on reading the cache once, and the kernel makes all heads (a block
of BLOCK_H query rows, up to 64) share each cache tile it loads: per tile it computes a
(BLOCK_H, BLOCK_N) score block with small matrix products and folds a (BLOCK_H, BLOCK_N) x (BLOCK_N, R)
product into the output accumulator.  A batch of a few long sequences would leave most
multiprocessors idle, so the context of each sequence is cut into up to `num_splits` chunks handled by
separate programs ("flash-decoding"); each writes a normalised partial output and its log-sum-exp, and
a second kernel combines them: out = sum_s exp(lse_s - lse) * out_s with lse = logsumexp_s lse_s.

Many heads, wide latent (R_SPLIT).  With 64 query rows and R = 512 the fp32 output accumulator alone
is 64 x 512 x 4 B = 128 KB, half of a multiprocessor's register file; compiled for sm_90 it fits only
with 16-token tiles (see `configs` and `compile_check`).  With R_SPLIT = 2 the accumulator's R columns are split over two programs that
share a (row block, split): each computes the full scores (the product over all R + D columns needs the
whole row) but accumulates only its own half of the output columns.  Both programs read the same tile
at the same time (adjacent program ids), so the second read comes from L2; a 64-head sequence then
costs one HBM read of its cache, where 16-row programs would read it four times.  The price is that
both programs compute the scores (1.5x the tensor-core work at 512+64), which is why `configs` also
offers whole-R tiles for these shapes (32 rows, or 64 rows with 16-token tiles) and lets the autotuner
choose.

Tokens-major (`mla_decode_split_tokens_major_kernel`, added 2026-12-06, not yet timed on a GPU).
Hopper's wgmma needs 64 rows in M per warpgroup; the row-major kernel puts query rows there, so its
16- and 32-row tiles multiply with mma.sync, and 128 heads at 512+64 ran at 16 % of the H200's
tensor-core peak.  The second split kernel computes the same thing transposed - scores as K Q^T with
64 cache tokens in M, the output as V^T P^T with the 512 latent columns in M - so both products run
on wgmma at 16 or 32 rows per program.  Shared helpers (`first_page_ids`, `tile_row_offsets`,
`online_softmax_step`) keep the page gather and the softmax the same in both.  The rest (split range,
final normalisation) is written out in each kernel on purpose: moved into a helper it changed how
ptxas allocated the row-major kernel's registers (an fp32 tile started to spill), see BENCHMARKS.md.

Row blocks.  tl.dot wants power-of-two block widths, so a cache row of R + D columns is read as two
blocks (`configs.row_blocks`): a main block of latent columns [0, BLOCK_R) and a tail of BLOCK_T columns
from min(R, BLOCK_R).  With a power-of-two R the tail is the rope key; otherwise the row may be cut
below R, and the tail holds the latent's last columns and then the rope key.  Both blocks take part
in the scores (the tail's query is the latent query on its latent columns and the rope query on the
rest); with latent in the tail it also takes part in the product with the probabilities, and its
latent columns are stored.  At SmolLM2 2x (144+48) the cut is 128 + 64 = the 192 columns of the row,
where padding the latent whole gave 256 + 64: 40 % fewer columns in shared memory and in the
products, 96-104 registers instead of 128-146 (compiled for sm_90), and on the H200 (2026-12-04) a
1.12x faster step at batch 64, context 4K (BENCHMARKS.md).  An R split needs the whole latent in the
main block, so cut latents never use it.

Query rows.  A row is one (query token, head) pair; rows are numbered token-major, row = i * heads + h,
so a single decode token is just q_len = 1.  With several query tokens per sequence (speculative
decoding) query i sits at position seq_len - q_len + i and may only see tokens below
seq_len - q_len + i + 1; rows of the same sequence still share every cache tile.

Splits are sized per sequence, from its own length.  `split_extent` gives every sequence chunks of at
least `min_split_tokens` tokens (whole tiles), so in a mixed batch a short sequence uses one split
and a long one many; programs whose split holds no token of their sequence return at once without
touching memory, and the merge only reads the splits that hold tokens.

Pipelining.  Triton software-pipelines the loop over cache tiles (cp.async copies into shared memory,
issued while earlier tiles are multiplied), but it spends one pipeline stage on every level of indirect
load: had the page ids of a tile been read in the same iteration as the tile, the cache load would
depend on a load of its own iteration, and with num_stages = 3 the third stage would go to the page
table, leaving the cache single-buffered.  So a tile's page ids are read one iteration earlier and
carried over; the cache load then depends only on a loop-carried value.  `compile_check` reads what
the compiler made of it (cache buffers in shared memory, and how many copy groups the loop leaves in
flight while it computes): num_stages = 2 gives one buffer and waits for every copy at the top of
each iteration - the read of a tile and its products do not overlap at all - while num_stages = 3
keeps the next tile in flight during the products (4: the next two).  See `configs.py`.

Masking rules that keep garbage out.  Every cache load is masked by `token < split_end <= seq_len`
with `other=0`, and the page-table loads (the first tile's and each look-ahead) are masked the same
way, so neither slots past a sequence's end nor unused page-table entries (nor any padding columns
past R + D in the cache rows) are ever read: NaN poison there cannot reach the arithmetic.  Padding lanes (rows >= number of rows, columns >= R or
D when those are not powers of two) are zero-filled, which leaves every dot product unchanged, and are
never stored.

Numerics.  Products run on the cache's dtype (tensor cores for fp16/bf16; exact fp32 FMAs for an fp32
cache, where TF32 would lose precision the caller asked for) and accumulate in fp32.  The queries and
the softmax probabilities are rounded to the cache dtype before their products.  Under the Triton
interpreter a bf16 `tl.dot` is not supported (it multiplies the raw bit patterns, triton-lang/triton
#11584), so the launcher then passes DOT_DTYPE = fp32: the operands are still rounded to bf16 first,
so the interpreter checks the same rounding the GPU applies.  The online softmax works in base 2
(scores are pre-multiplied by softmax_scale * log2(e)) because exp2 is the native instruction; the
stored lse is converted back to natural log.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# log2(e) is applied by the launcher (scale_log2); ln(2) converts the base-2 lse back inside the kernel.
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def split_extent(seq_len, num_splits, min_split_tokens, BLOCK_N: tl.constexpr):
    """Tokens per split of one sequence and how many of its splits hold tokens.

    A split covers ceil(seq_len / num_splits) tokens, raised to `min_split_tokens` (so that a short
    sequence in a long batch does not pay a query load and a partial-output write for a few tokens) and
    rounded up to whole tiles (so only the last tile of a split is ragged).  The split and the merge
    kernels both call this, so they agree on which partials exist.  seq_len = 0 gives 0 used splits.
    """
    per_split = tl.maximum(tl.cdiv(seq_len, num_splits), min_split_tokens)
    per_split = tl.cdiv(per_split, BLOCK_N) * BLOCK_N
    return per_split, tl.cdiv(seq_len, per_split)


@triton.jit
def first_page_ids(page_row, split_start, split_end, stride_pt_p, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The page ids of a split's first tile (see "Gather through the page table" in the split kernel).

    A scalar when a tile lies in one page, one id per page when it holds whole pages, else one per
    token; masked past the split like every load, so unused page-table entries are never read.
    """
    ONE_PAGE_PER_TILE: tl.constexpr = PAGE_SIZE % BLOCK_N == 0
    WHOLE_PAGES_PER_TILE: tl.constexpr = (BLOCK_N % PAGE_SIZE == 0) and (PAGE_SIZE >= 8)
    PAGES: tl.constexpr = BLOCK_N // PAGE_SIZE if WHOLE_PAGES_PER_TILE else 1
    if ONE_PAGE_PER_TILE:
        first = tl.load(page_row + (split_start // PAGE_SIZE) * stride_pt_p, mask=split_start < split_end,
                        other=0)  # scalar
    elif WHOLE_PAGES_PER_TILE:
        first_pages = split_start // PAGE_SIZE + tl.arange(0, PAGES)  # (PAGES,)
        first = tl.load(page_row + first_pages * stride_pt_p, mask=first_pages * PAGE_SIZE < split_end, other=0)
    else:
        first_tokens = split_start + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        first = tl.load(page_row + (first_tokens // PAGE_SIZE) * stride_pt_p, mask=first_tokens < split_end,
                        other=0)  # (BLOCK_N,)
    return first


@triton.jit
def tile_row_offsets(page_row, page_ids, tile_start, split_end, stride_pt_p, stride_kv_page, stride_kv_tok,
                     PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, ROW_ALIGN: tl.constexpr):
    """Offsets of a tile's BLOCK_N cache rows from this tile's page ids, and the next tile's page ids.

    The next tile's ids are read here, one iteration ahead (module docstring, "Pipelining"), so the
    cache load of a tile depends only on a value carried over from the previous iteration.
    """
    ONE_PAGE_PER_TILE: tl.constexpr = PAGE_SIZE % BLOCK_N == 0
    WHOLE_PAGES_PER_TILE: tl.constexpr = (BLOCK_N % PAGE_SIZE == 0) and (PAGE_SIZE >= 8)
    PAGES: tl.constexpr = BLOCK_N // PAGE_SIZE if WHOLE_PAGES_PER_TILE else 1
    tokens = tile_start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) logical token positions
    physical_page = page_ids.to(tl.int64)  # scalar, (PAGES,) or (BLOCK_N,)
    if ONE_PAGE_PER_TILE:
        ahead = tile_start + BLOCK_N  # the next tile's first token; masked past the split like every load
        next_ids = tl.load(page_row + (ahead // PAGE_SIZE) * stride_pt_p, mask=ahead < split_end, other=0)
        row_offset = physical_page * stride_kv_page + (tokens % PAGE_SIZE).to(tl.int64) * stride_kv_tok
    elif WHOLE_PAGES_PER_TILE:
        ahead_pages = (tile_start + BLOCK_N) // PAGE_SIZE + tl.arange(0, PAGES)  # (PAGES,)
        next_ids = tl.load(page_row + ahead_pages * stride_pt_p, mask=ahead_pages * PAGE_SIZE < split_end, other=0)
        in_page = tl.arange(0, PAGE_SIZE).to(tl.int64) * stride_kv_tok  # (PAGE_SIZE,)
        # (PAGES, PAGE_SIZE) -> (BLOCK_N,): page-major, i.e. token order within the tile
        row_offset = tl.reshape(physical_page[:, None] * stride_kv_page + in_page[None, :], (BLOCK_N,))
    else:
        ahead = tokens + BLOCK_N  # (BLOCK_N,) the next tile's tokens
        next_ids = tl.load(page_row + (ahead // PAGE_SIZE) * stride_pt_p, mask=ahead < split_end, other=0)
        row_offset = physical_page * stride_kv_page + (tokens % PAGE_SIZE).to(tl.int64) * stride_kv_tok
    # The launcher guarantees both strides are multiples of ROW_ALIGN; saying so lets the compiler
    # use vector loads for rows whose width is not a multiple of 16 elements.
    return tl.multiple_of(row_offset, ROW_ALIGN), next_ids


@triton.jit
def online_softmax_step(scores, running_max, running_sum, TOKEN_AXIS: tl.constexpr):
    """Fold one tile of base-2 scores into the running max and sum of each query row.

    `scores` holds -inf where a token is not visible; TOKEN_AXIS is its token dimension (1 when rows
    are the first dimension, 0 in the tokens-major kernel).  Returns the probabilities (exactly 0 where
    not visible), the factor the accumulator must be rescaled by, and the new max and sum.
    """
    new_max = tl.maximum(running_max, tl.max(scores, axis=TOKEN_AXIS))
    # A row with nothing visible yet keeps max = -inf; shifting by 0 instead avoids -inf - -inf.
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp2(running_max - shift)  # (rows,)
    probs = tl.exp2(scores - tl.expand_dims(shift, TOKEN_AXIS))
    running_sum = running_sum * rescale + tl.sum(probs, axis=TOKEN_AXIS)
    return probs, rescale, new_max, running_sum


@triton.jit
def mla_decode_split_kernel(
    q_latent_ptr,  # (batch, rows, R)
    q_rope_ptr,  # (batch, rows, D)
    kv_cache_ptr,  # (num_pages, PAGE_SIZE, >= R + D): latent in columns [0, R), rope key in [R, R + D)
    page_table_ptr,  # (batch, max_pages)
    seq_lens_ptr,  # (batch,)
    part_out_ptr,  # (batch, rows, num_splits, R): normalised partial outputs (fp32, or the final output)
    part_lse_ptr,  # (batch, rows, num_splits): natural-log lse of each partial (fp32)
    scale_log2,  # softmax_scale * log2(e)
    num_rows,  # q_len * heads
    heads,
    q_len,
    min_split_tokens,  # >= 1, see split_extent
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
    BLOCK_R: tl.constexpr,  # main block: latent columns [0, BLOCK_R), a power of two >= 16 (configs.row_blocks)
    BLOCK_T: tl.constexpr,  # tail block: row columns [min(R, BLOCK_R), + BLOCK_T): the rope key, after the
    #                         latent's last R - BLOCK_R columns when BLOCK_R < R; a power of two >= 16
    R_SPLIT: tl.constexpr,  # 1 or 2: programs that share one (row block, split), each owning BLOCK_R / R_SPLIT columns
    ROW_ALIGN: tl.constexpr,  # power of two dividing the page and token strides (vectorisation hint)
    DOT_DTYPE: tl.constexpr,  # operand dtype of the products: the cache dtype, or fp32 (see launcher)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands (no TF32 rounding), else irrelevant
    LAUNCH_DEPENDENTS: tl.constexpr = False,  # the merge is launched as a programmatic dependent (sm_90+)
):
    """One program: BLOCK_H query rows of one sequence, its own BLOCK_R / R_SPLIT output columns, one split.

    Grid = (row blocks x R_SPLIT, splits, batch).  The R parts of a row block vary fastest, then the row
    blocks, so the programs that read the same cache chunk run next to each other and share it in L2.
    """
    pid_cols = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)  # 64-bit so batch offsets into large buffers cannot overflow
    num_splits = tl.num_programs(1)
    pid_rows = pid_cols // R_SPLIT
    r_part = pid_cols % R_SPLIT

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    tokens_per_split, used_splits = split_extent(seq_len, num_splits, min_split_tokens, BLOCK_N)
    # A split past the sequence's last chunk has nothing to do; the merge never reads its partial.
    # Split 0 always runs: with one split it writes the final output (out = 0, lse = -inf if empty).
    if (split > 0) & (split >= used_splits):
        return
    split_start = split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)

    BLOCK_RC: tl.constexpr = BLOCK_R // R_SPLIT  # main-block output columns owned by this program
    TAIL_HAS_LATENT: tl.constexpr = BLOCK_R < KV_LORA_RANK  # the tail also holds output columns
    TAIL_START: tl.constexpr = BLOCK_R if BLOCK_R < KV_LORA_RANK else KV_LORA_RANK
    tl.static_assert(R_SPLIT == 1 or not TAIL_HAS_LATENT, "an R split needs the whole latent in the main block")
    rows = pid_rows * BLOCK_H + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
    row_ok = rows < num_rows
    query_index = rows // heads
    key_limit = seq_len - q_len + query_index + 1  # (BLOCK_H,): row sees tokens t < key_limit
    cols_own = r_part * BLOCK_RC + tl.arange(0, BLOCK_RC)  # (BLOCK_RC,) latent columns accumulated here
    cols_other = (1 - r_part) * BLOCK_RC + tl.arange(0, BLOCK_RC)  # the other half (used when R_SPLIT == 2)
    cols_t = TAIL_START + tl.arange(0, BLOCK_T)  # (BLOCK_T,) row columns of the tail block
    own_ok = cols_own < KV_LORA_RANK
    other_ok = cols_other < KV_LORA_RANK
    t_ok = cols_t < KV_LORA_RANK + ROPE_DIM
    t_latent = cols_t < KV_LORA_RANK  # tail columns that are latent columns (only when TAIL_HAS_LATENT)
    t_rope = (cols_t >= KV_LORA_RANK) & t_ok  # tail columns that are rope-key columns

    cache_dtype = kv_cache_ptr.dtype.element_ty
    q_base = q_latent_ptr + seq * stride_qlat_b + rows[:, None] * stride_qlat_r
    q_own = tl.load(
        q_base + cols_own[None, :] * stride_qlat_c, mask=row_ok[:, None] & own_ok[None, :], other=0.0
    ).to(cache_dtype).to(DOT_DTYPE)  # (BLOCK_H, BLOCK_RC): rounded like the cache
    if R_SPLIT == 2:
        q_other = tl.load(
            q_base + cols_other[None, :] * stride_qlat_c, mask=row_ok[:, None] & other_ok[None, :], other=0.0
        ).to(cache_dtype).to(DOT_DTYPE)  # (BLOCK_H, BLOCK_RC)
    # The tail's query: the rope query on rope columns, the latent query on the latent's last columns.
    q_tail = tl.load(
        q_rope_ptr + seq * stride_qrope_b + rows[:, None] * stride_qrope_r
        + (cols_t - KV_LORA_RANK)[None, :] * stride_qrope_c,
        mask=row_ok[:, None] & t_rope[None, :],
        other=0.0,
    )  # (BLOCK_H, BLOCK_T)
    if TAIL_HAS_LATENT:
        q_tail += tl.load(
            q_base + cols_t[None, :] * stride_qlat_c, mask=row_ok[:, None] & t_latent[None, :], other=0.0
        ).to(q_tail.dtype)  # the two masks are disjoint: each column comes from one of the two loads
    q_tail = q_tail.to(cache_dtype).to(DOT_DTYPE)

    running_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # base-2 max score per row
    running_sum = tl.zeros([BLOCK_H], dtype=tl.float32)  # sum of exp2(score - running_max)
    acc = tl.zeros([BLOCK_H, BLOCK_RC], dtype=tl.float32)  # unnormalised sum of p_t * c_t, own columns
    if TAIL_HAS_LATENT:
        acc_tail = tl.zeros([BLOCK_H, BLOCK_T], dtype=tl.float32)  # the same over the tail (rope part unused)

    # Gather through the page table.  Tiles start at multiples of BLOCK_N (splits are whole tiles), so
    # when BLOCK_N divides PAGE_SIZE a tile lies in one page and needs one page id (a scalar); when
    # PAGE_SIZE divides BLOCK_N it holds BLOCK_N / PAGE_SIZE whole pages and needs one id per page; only
    # pages under 8 tokens or of sizes that divide neither way read one id per token.  Fewer ids mean
    # fewer loads and a row offset the compiler sees as page base + contiguous rows: compiled for sm_90
    # this saves tens of registers per thread (BENCHMARKS.md, compile check).  The ids are read one tile
    # ahead (see "Pipelining" in the module docstring): this tile's come from the previous iteration.
    page_row = page_table_ptr + seq * stride_pt_b
    next_page = first_page_ids(page_row, split_start, split_end, stride_pt_p, PAGE_SIZE, BLOCK_N)
    for tile_start in range(split_start, split_end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) logical token positions
        token_ok = tokens < split_end
        row_offset, next_page = tile_row_offsets(page_row, next_page, tile_start, split_end, stride_pt_p,
                                                 stride_kv_page, stride_kv_tok, PAGE_SIZE, BLOCK_N, ROW_ALIGN)
        row_ptr = kv_cache_ptr + row_offset[:, None]  # (BLOCK_N, 1)
        latent = tl.load(
            row_ptr + cols_own[None, :] * stride_kv_c, mask=token_ok[:, None] & own_ok[None, :], other=0.0
        ).to(DOT_DTYPE)  # (BLOCK_N, BLOCK_RC): keys (nope side) and values at once
        tail = tl.load(
            row_ptr + cols_t[None, :] * stride_kv_c,
            mask=token_ok[:, None] & t_ok[None, :],
            other=0.0,
        ).to(DOT_DTYPE)  # (BLOCK_N, BLOCK_T): the rope key (and the latent's last columns)

        scores = tl.dot(q_own, tl.trans(latent), input_precision=DOT_PRECISION)  # (BLOCK_H, BLOCK_N) fp32
        if R_SPLIT == 2:
            latent_other = tl.load(
                row_ptr + cols_other[None, :] * stride_kv_c, mask=token_ok[:, None] & other_ok[None, :], other=0.0
            ).to(DOT_DTYPE)  # (BLOCK_N, BLOCK_RC): only for the scores
            scores += tl.dot(q_other, tl.trans(latent_other), input_precision=DOT_PRECISION)
        scores += tl.dot(q_tail, tl.trans(tail), input_precision=DOT_PRECISION)
        scores = scores * scale_log2
        visible = token_ok[None, :] & (tokens[None, :] < key_limit[:, None])
        scores = tl.where(visible, scores, float("-inf"))

        probs, rescale, running_max, running_sum = online_softmax_step(scores, running_max, running_sum, 1)
        acc = acc * rescale[:, None]  # probs: (BLOCK_H, BLOCK_N); rescale: (BLOCK_H,)
        # probs are rounded to the cache dtype first, exactly as the tensor-core path does.
        probs_rounded = probs.to(cache_dtype).to(DOT_DTYPE)
        acc = tl.dot(probs_rounded, latent, acc, input_precision=DOT_PRECISION)
        if TAIL_HAS_LATENT:
            acc_tail = tl.dot(probs_rounded, tail, acc_tail * rescale[:, None], input_precision=DOT_PRECISION)

    if LAUNCH_DEPENDENTS:
        # The merge's programs may now be scheduled and do their setup; they wait in gdc_wait until
        # this whole grid has finished and its stores are visible, so this is only a hint.
        gdc_launch_dependents()
    has_tokens = running_sum > 0.0
    safe_sum = tl.where(has_tokens, running_sum, 1.0)
    out = acc / safe_sum[:, None]
    lse = tl.where(has_tokens, (running_max + tl.log2(safe_sum)) * LN2, float("-inf"))

    part_row = part_out_ptr + seq * stride_po_b + rows[:, None] * stride_po_r + split * stride_po_s  # (BLOCK_H, 1)
    tl.store(part_row + cols_own[None, :] * stride_po_c, out.to(part_out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & own_ok[None, :])
    if TAIL_HAS_LATENT:
        tl.store(part_row + cols_t[None, :] * stride_po_c, (acc_tail / safe_sum[:, None]).to(part_out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & t_latent[None, :])
    if r_part == 0:  # every R part computed the same lse; one of them stores it
        tl.store(part_lse_ptr + seq * stride_pl_b + rows * stride_pl_r + split * stride_pl_s, lse, mask=row_ok)


@triton.jit
def mla_decode_split_tokens_major_kernel(
    q_latent_ptr, q_rope_ptr, kv_cache_ptr, page_table_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, num_rows, heads, q_len, min_split_tokens,
    stride_qlat_b, stride_qlat_r, stride_qlat_c,
    stride_qrope_b, stride_qrope_r, stride_qrope_c,
    stride_kv_page, stride_kv_tok, stride_kv_c,
    stride_pt_b, stride_pt_p,
    stride_po_b, stride_po_r, stride_po_s, stride_po_c,
    stride_pl_b, stride_pl_r, stride_pl_s,
    KV_LORA_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
    R_SPLIT: tl.constexpr, ROW_ALIGN: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr = False,
):
    """The split kernel with its products transposed: cache tokens in the MMA's M, query rows in its N.

    Same arguments, grid, outputs and masking as `mla_decode_split_kernel` (the launcher swaps one for
    the other by the tile's `tokens_major`), so the merge and every caller are shared.  Why it exists:
    Hopper's warpgroup MMA (wgmma) needs M = 64 per warpgroup, and with fewer than 64 query rows per
    program the row-major kernel's products run on mma.sync; 128 heads at 512+64 are bound by those
    products (the H200 of 2026-12-04: 142-164 TFLOP/s, 16 % of the tensor-core peak).  Transposed, the
    scores are S^T = K Q^T, (BLOCK_N, R + D) x (R + D, BLOCK_H), with 64 cache tokens filling M, and the
    output is O^T = V^T P^T, (R, BLOCK_N) x (BLOCK_N, BLOCK_H), with the R = 512 latent columns in M:
    both products go to wgmma for any BLOCK_H from 16, and the queries become wgmma's B operand, which
    lives in shared memory instead of the registers a row-major A operand takes.  Compiled for sm_90
    (`compile_check`), 32 rows at 512+64 with 64-token tiles use HGMMA only, without spills.  The
    online softmax then reduces over the first (token) axis.  Only for latents held whole in the main
    block (power-of-two R, no R split): `configs.candidate_tiles` offers it only there.
    """
    pid_rows = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)  # 64-bit so batch offsets into large buffers cannot overflow
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    tokens_per_split, used_splits = split_extent(seq_len, tl.num_programs(1), min_split_tokens, BLOCK_N)
    if (split > 0) & (split >= used_splits):
        return  # as in the row-major kernel: split 0 always runs
    split_start = split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)
    tl.static_assert((R_SPLIT == 1) and (BLOCK_R >= KV_LORA_RANK), "tokens-major tiles need the whole latent")

    rows = pid_rows * BLOCK_H + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
    row_ok = rows < num_rows
    key_limit = seq_len - q_len + rows // heads + 1  # (BLOCK_H,): row sees tokens t < key_limit
    cols_r = tl.arange(0, BLOCK_R)  # (BLOCK_R,) latent columns
    r_ok = cols_r < KV_LORA_RANK
    cols_t = KV_LORA_RANK + tl.arange(0, BLOCK_T)  # (BLOCK_T,) rope-key columns of the row
    t_ok = cols_t < KV_LORA_RANK + ROPE_DIM

    cache_dtype = kv_cache_ptr.dtype.element_ty
    q_latent_t = tl.load(
        q_latent_ptr + seq * stride_qlat_b + rows[None, :] * stride_qlat_r + cols_r[:, None] * stride_qlat_c,
        mask=r_ok[:, None] & row_ok[None, :], other=0.0,
    ).to(cache_dtype).to(DOT_DTYPE)  # (BLOCK_R, BLOCK_H): the latent queries, transposed
    q_rope_t = tl.load(
        q_rope_ptr + seq * stride_qrope_b + rows[None, :] * stride_qrope_r
        + (cols_t - KV_LORA_RANK)[:, None] * stride_qrope_c,
        mask=t_ok[:, None] & row_ok[None, :], other=0.0,
    ).to(cache_dtype).to(DOT_DTYPE)  # (BLOCK_T, BLOCK_H)

    running_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # base-2 max score per row
    running_sum = tl.zeros([BLOCK_H], dtype=tl.float32)  # sum of exp2(score - running_max)
    acc_t = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)  # unnormalised sum of c_t p_t, transposed

    page_row = page_table_ptr + seq * stride_pt_b
    next_page = first_page_ids(page_row, split_start, split_end, stride_pt_p, PAGE_SIZE, BLOCK_N)
    for tile_start in range(split_start, split_end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) logical token positions
        token_ok = tokens < split_end
        row_offset, next_page = tile_row_offsets(page_row, next_page, tile_start, split_end, stride_pt_p,
                                                 stride_kv_page, stride_kv_tok, PAGE_SIZE, BLOCK_N, ROW_ALIGN)
        row_ptr = kv_cache_ptr + row_offset[:, None]  # (BLOCK_N, 1)
        latent = tl.load(
            row_ptr + cols_r[None, :] * stride_kv_c, mask=token_ok[:, None] & r_ok[None, :], other=0.0
        ).to(DOT_DTYPE)  # (BLOCK_N, BLOCK_R): keys (nope side) and values at once
        rope_key = tl.load(
            row_ptr + cols_t[None, :] * stride_kv_c, mask=token_ok[:, None] & t_ok[None, :], other=0.0
        ).to(DOT_DTYPE)  # (BLOCK_N, BLOCK_T)

        scores_t = tl.dot(latent, q_latent_t, input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_H) fp32
        scores_t = tl.dot(rope_key, q_rope_t, scores_t, input_precision=DOT_PRECISION)
        scores_t = scores_t * scale_log2
        visible = token_ok[:, None] & (tokens[:, None] < key_limit[None, :])
        scores_t = tl.where(visible, scores_t, float("-inf"))

        probs_t, rescale, running_max, running_sum = online_softmax_step(scores_t, running_max, running_sum, 0)
        # probs rounded to the cache dtype first, as in the row-major kernel
        probs_t = probs_t.to(cache_dtype).to(DOT_DTYPE)  # (BLOCK_N, BLOCK_H)
        acc_t = tl.dot(tl.trans(latent), probs_t, acc_t * rescale[None, :], input_precision=DOT_PRECISION)

    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()  # as in the row-major kernel: only a scheduling hint for the merge
    has_tokens = running_sum > 0.0
    safe_sum = tl.where(has_tokens, running_sum, 1.0)
    out_t = acc_t / safe_sum[None, :]  # (BLOCK_R, BLOCK_H)
    lse = tl.where(has_tokens, (running_max + tl.log2(safe_sum)) * LN2, float("-inf"))
    part_row = part_out_ptr + seq * stride_po_b + rows[None, :] * stride_po_r + split * stride_po_s  # (1, BLOCK_H)
    tl.store(part_row + cols_r[:, None] * stride_po_c, out_t.to(part_out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & row_ok[None, :])
    tl.store(part_lse_ptr + seq * stride_pl_b + rows * stride_pl_r + split * stride_pl_s, lse, mask=row_ok)


@triton.jit
def mla_decode_merge_kernel(
    part_out_ptr,  # (batch, rows, num_splits, R) fp32
    part_lse_ptr,  # (batch, rows, num_splits) fp32
    seq_lens_ptr,  # (batch,)
    out_ptr,  # (batch, rows, R)
    lse_ptr,  # (batch, rows) fp32
    num_rows,
    num_splits,
    min_split_tokens,
    stride_po_b, stride_po_r, stride_po_s, stride_po_c,
    stride_pl_b, stride_pl_r, stride_pl_s,
    stride_out_b, stride_out_r, stride_out_c,
    stride_lse_b, stride_lse_r,
    KV_LORA_RANK: tl.constexpr,
    SPLIT_BLOCK_N: tl.constexpr,  # the split kernel's BLOCK_N (split_extent depends on it)
    BLOCK_ROWS: tl.constexpr,  # query rows per program
    BLOCK_C: tl.constexpr,  # output columns per program
    BLOCK_S: tl.constexpr,  # splits read at once: a power of two >= num_splits
    WAIT_FOR_SPLITS: tl.constexpr = False,  # launched as a programmatic dependent of the split kernel
):
    """One program: BLOCK_ROWS query rows of one sequence, BLOCK_C output columns, all its used splits.

    Grid = (column blocks, row blocks, batch).  Only the sequence's used splits (`split_extent`) were
    written, so only they are read: their lse, one (BLOCK_ROWS, BLOCK_S) load that gives every split's
    weight exp(lse_s - max_s lse_s), and their partial outputs, one (BLOCK_ROWS, BLOCK_S, BLOCK_C) load
    summed over the splits.  The two loads do not depend on each other (both are masked by which splits
    exist, not the partials by their weights), so the compiler may issue them together: one round trip
    to memory, not two in a row (`compile_check.merge_load_order` reads what it did).  The loop over
    splits this replaced (load a split's lse, then its partial, fold in with a running maximum) was a
    chain of two reads per split, and on the H200 (2026-12-04) the merge alone took 15-17 µs of a
    20-46 µs decode step at 16 splits (batch 16, context 4K).  A row's lse is finite unless it saw no
    token at all, which the decode contract (seq_len >= q_len) rules out except for seq_len = 0 (out =
    0, lse = -inf).
    """
    col_block = tl.program_id(0)
    row_block = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    _, used_splits = split_extent(seq_len, num_splits, min_split_tokens, SPLIT_BLOCK_N)
    rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # (BLOCK_ROWS,)
    row_ok = rows < num_rows
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < KV_LORA_RANK
    splits = tl.arange(0, BLOCK_S)
    if WAIT_FOR_SPLITS:
        # Launched before the split kernel finished (programmatic dependent launch): everything above
        # reads only inputs that kernel does not write; from here on its partials are read.
        gdc_wait()
    written = row_ok[:, None] & (splits < used_splits)[None, :]  # (BLOCK_ROWS, BLOCK_S): partials that exist
    lse_ptrs = part_lse_ptr + seq * stride_pl_b + rows[:, None] * stride_pl_r + splits[None, :] * stride_pl_s
    split_lse = tl.load(lse_ptrs, mask=written,
                        other=float("-inf"))  # (BLOCK_ROWS, BLOCK_S); unused splits and padding rows: -inf
    # The partials are masked by the same `written`, not by their weights, so both loads are issued at
    # once instead of the second waiting for the first.  A written partial of a row that saw no token
    # of its split is 0 (the split kernel divides a zero sum by 1) and gets weight 0.
    out_ptrs = (part_out_ptr + seq * stride_po_b + rows[:, None, None] * stride_po_r
                + splits[None, :, None] * stride_po_s + cols[None, None, :] * stride_po_c)
    partial = tl.load(out_ptrs, mask=written[:, :, None] & col_ok[None, None, :],
                      other=0.0)  # (BLOCK_ROWS, BLOCK_S, BLOCK_C); unwritten partials are never read
    row_max = tl.max(split_lse, axis=1)  # (BLOCK_ROWS,)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    weight = tl.exp(split_lse - shift[:, None])  # (BLOCK_ROWS, BLOCK_S), 0 where a split saw no token of the row
    total = tl.sum(weight, axis=1)  # (BLOCK_ROWS,)
    acc = tl.sum(partial * weight[:, :, None], axis=1)  # (BLOCK_ROWS, BLOCK_C)

    has_tokens = total > 0.0
    out = acc / tl.where(has_tokens, total, 1.0)[:, None]
    tl.store(
        out_ptr + seq * stride_out_b + rows[:, None] * stride_out_r + cols[None, :] * stride_out_c,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )
    if col_block == 0:  # one column block writes the rows' lse
        lse = tl.where(has_tokens, shift + tl.log(tl.where(has_tokens, total, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * stride_lse_b + rows * stride_lse_r, lse, mask=row_ok)
