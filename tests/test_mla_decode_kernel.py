"""The Triton MLA decode kernel against the torch reference, and the reference against a naive oracle.

Where the kernel runs: with TRITON_INTERPRET=1 (the conftest default) the kernels run in the Triton
interpreter on CPU tensors, so the small-shape tests run on any machine.  On a GPU machine run
`TRITON_INTERPRET=0 pytest tests/test_mla_decode_kernel.py` to compile the kernels: the same
small-shape tests then run on CUDA tensors and the `gpu`-marked tests add realistic sizes.

Every cache built here is adversarial (`mla_decode_triton.testing.paginate`): pages are shuffled, the
slots past each sequence's length and the spare pages hold NaN, and page-table entries past a
sequence's last page are out of range, so a kernel that reads past a length fails loudly.

Tolerances: the kernel and the reference see the same rounded inputs; with an fp32 cache both
compute in fp32 and differ only in summation order (1e-5).  With fp16/bf16 caches the kernel also
rounds the softmax probabilities to the cache dtype before the value product (as tensor-core
flash-attention kernels do), about 2**-11 (fp16) or 2**-8 (bf16) relative per term; the outputs are
averages of O(1) values, hence 2e-3 and 1.6e-2.  The lse is unaffected by that rounding (1e-4).
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, NEEDS_KERNEL_DEVICE, assert_matches
from mla_decode_triton import (
    DecodeConfig,
    MLADecodeInputError,
    candidate_tiles,
    choose_config,
    mla_decode,
    mla_decode_multi,
    mla_decode_multi_reference,
    mla_decode_reference,
)
from mla_decode_triton.inputs import check_decode_inputs
from mla_decode_triton.launcher import INTERPRETED
from mla_decode_triton.testing import make_decode_inputs, paginate

needs_kernel_device = NEEDS_KERNEL_DEVICE
if not torch.cuda.is_available():
    needs_compiled_cuda = pytest.mark.skip(reason="needs a CUDA device")
elif INTERPRETED:
    needs_compiled_cuda = pytest.mark.skip(
        reason="the kernel runs in the Triton interpreter (TRITON_INTERPRET=1, the conftest default); "
        "run with TRITON_INTERPRET=0 to compile it for the GPU"
    )
else:
    needs_compiled_cuda = pytest.mark.skipif(False, reason="compiled kernels on a CUDA device")


def naive_decode(q_latent, q_rope, logical, seq_lens, softmax_scale, q_len=None):
    """Float64, one sequence (and one query token) at a time, plain softmax over a contiguous cache.

    q_latent (batch, heads, R) or (batch, q_len, heads, R); logical (batch, max_len, R + D).
    """
    rank = q_latent.shape[-1]
    outs, lses = [], []
    for seq, length in enumerate(seq_lens.tolist()):
        queries = range(q_len) if q_len is not None else [None]
        seq_out, seq_lse = [], []
        for index in queries:
            visible = length if index is None else length - q_len + index + 1
            cache = logical[seq, :visible].double().cpu()  # (visible, R + D)
            ql = (q_latent[seq] if index is None else q_latent[seq, index]).double().cpu()  # (heads, R)
            qr = (q_rope[seq] if index is None else q_rope[seq, index]).double().cpu()  # (heads, D)
            scores = (ql @ cache[:, :rank].T + qr @ cache[:, rank:].T) * softmax_scale  # (heads, visible)
            seq_out.append(torch.softmax(scores, dim=-1) @ cache[:, :rank])
            seq_lse.append(torch.logsumexp(scores, dim=-1))
        if index is None:
            outs.append(seq_out[0])
            lses.append(seq_lse[0])
        else:
            outs.append(torch.stack(seq_out))
            lses.append(torch.stack(seq_lse))
    return torch.stack(outs), torch.stack(lses)


# ---------------------------------------------------------------------------------------------------
# The oracle: reference vs naive dense computation (no kernel involved).


@pytest.mark.parametrize("page_size", [1, 16])
def test_reference_matches_naive_dense_softmax(page_size):
    inputs = make_decode_inputs(3, 3, 100, 12, [1, 23, 40], page_size, seed=1)
    expected = naive_decode(inputs.q_latent, inputs.q_rope, inputs.logical, inputs.seq_lens, inputs.softmax_scale)
    out, lse = mla_decode_reference(*inputs.args())
    torch.testing.assert_close(out.double(), expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), expected[1], atol=1e-5, rtol=1e-5)


def test_reference_multi_matches_naive_causal_softmax():
    inputs = make_decode_inputs(2, 3, 48, 24, [3, 30], page_size=8, q_len=3, seed=2)
    expected = naive_decode(
        inputs.q_latent, inputs.q_rope, inputs.logical, inputs.seq_lens, inputs.softmax_scale, q_len=3
    )
    out, lse = mla_decode_multi_reference(*inputs.args())
    assert out.shape == (2, 3, 3, 48) and lse.shape == (2, 3, 3)
    torch.testing.assert_close(out.double(), expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), expected[1], atol=1e-5, rtol=1e-5)


def test_reference_length_one_returns_the_only_latent():
    inputs = make_decode_inputs(2, 4, 32, 16, [1, 1], page_size=4, seed=3)
    out, lse = mla_decode_reference(*inputs.args())
    only_latent = inputs.logical[:, 0, :32]  # (batch, R)
    torch.testing.assert_close(out, only_latent[:, None, :].expand(2, 4, 32))
    scores = (inputs.q_latent @ only_latent[..., None]).squeeze(-1)  # (batch, heads)
    scores = scores + (inputs.q_rope @ inputs.logical[:, 0, 32:, None]).squeeze(-1)
    torch.testing.assert_close(lse, scores * inputs.softmax_scale)


def test_inputs_that_do_not_fit_are_rejected_in_one_line():
    inputs = make_decode_inputs(2, 3, 32, 16, [4, 9], page_size=4)
    with pytest.raises(MLADecodeInputError, match="kv_cache rows hold 47 values, expected R \\+ D = 32 \\+ 16"):
        check_decode_inputs(inputs.q_latent, inputs.q_rope, inputs.kv_cache[..., :47], inputs.page_table,
                            inputs.seq_lens, kv_lora_rank=None)
    with pytest.raises(MLADecodeInputError, match="q_latent's last dim is 32 but kv_lora_rank is 24"):
        check_decode_inputs(inputs.q_latent, inputs.q_rope, inputs.kv_cache, inputs.page_table,
                            inputs.seq_lens, kv_lora_rank=24)
    with pytest.raises(MLADecodeInputError, match="page_table must be"):
        mla_decode_reference(inputs.q_latent, inputs.q_rope, inputs.kv_cache, inputs.page_table[:1],
                             inputs.seq_lens, inputs.softmax_scale)
    with pytest.raises(MLADecodeInputError, match="int32 or int64"):
        mla_decode_reference(inputs.q_latent, inputs.q_rope, inputs.kv_cache, inputs.page_table.float(),
                             inputs.seq_lens, inputs.softmax_scale)


# ---------------------------------------------------------------------------------------------------
# The kernel against the reference (small shapes: interpreter on CPU, or compiled on CUDA).


@needs_kernel_device
@pytest.mark.parametrize(
    "heads, rank, rope_dim, page_size, lens",
    [
        (3, 48, 24, 16, [1, 37, 70]),  # odd heads, R and D not powers of two, tiles spanning pages
        (9, 100, 12, 1, [2, 33, 17]),  # SmolLM2-like head count, one token per page
        (9, 64, 32, 64, [64, 1, 65]),  # lengths on and just past a page boundary
        (5, 32, 16, 5, [11, 40]),  # page size that is not a power of two
        (17, 16, 8, 16, [20]),  # 17 heads padded to a 32-row block
    ],
)
def test_kernel_matches_reference(heads, rank, rope_dim, page_size, lens):
    inputs = make_decode_inputs(len(lens), heads, rank, rope_dim, lens, page_size, device=DEVICE, seed=heads)
    assert_matches(mla_decode(*inputs.args()), mla_decode_reference(*inputs.args()), torch.float32)


@needs_kernel_device
def test_kernel_page_sizes_give_identical_results():
    """One logical cache laid out in pages of 1, 16 and 64 tokens (shuffled): bit-identical outputs."""
    base = make_decode_inputs(3, 3, 48, 24, [1, 45, 100], page_size=16, device=DEVICE, seed=5)
    results = []
    for page_size in (1, 16, 64):
        generator = torch.Generator().manual_seed(page_size)
        kv_cache, page_table = paginate(base.logical.cpu(), base.seq_lens.cpu(), page_size, generator)
        results.append(
            mla_decode(base.q_latent, base.q_rope, kv_cache.to(DEVICE), page_table.to(DEVICE),
                       base.seq_lens, base.softmax_scale, num_splits=2)
        )
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0])
        assert torch.equal(lse, results[0][1])
    assert_matches(results[0], mla_decode_reference(*base.args()), torch.float32)


@needs_kernel_device
def test_kernel_ignores_what_lies_past_each_length():
    """NaN or huge values past the lengths, in spare pages and behind unused table entries never leak."""
    clean = make_decode_inputs(3, 3, 48, 24, [1, 19, 50], page_size=16, device=DEVICE, seed=6, poison=0.0)
    out_clean, lse_clean = mla_decode(*clean.args(), num_splits=3)
    for poison in (float("nan"), float("inf"), 1e30):
        poisoned = make_decode_inputs(3, 3, 48, 24, [1, 19, 50], page_size=16, device=DEVICE, seed=6, poison=poison)
        assert torch.isnan(poisoned.kv_cache).any() == (poison != poison)
        out, lse = mla_decode(*poisoned.args(), num_splits=3)
        assert torch.equal(out, out_clean) and torch.equal(lse, lse_clean)


@needs_kernel_device
def test_kernel_length_one_everywhere():
    inputs = make_decode_inputs(4, 3, 48, 24, [1, 1, 1, 1], page_size=1, device=DEVICE, seed=7)
    out, lse = mla_decode(*inputs.args())
    only_latent = inputs.logical[:, 0, :48]  # (batch, R)
    torch.testing.assert_close(out, only_latent[:, None, :].expand(4, 3, 48), atol=0, rtol=0)
    assert_matches((out, lse), mla_decode_reference(*inputs.args()), torch.float32)


@needs_kernel_device
@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_kernel_split_counts_agree(num_splits):
    """Splitting the context (with empty splits for the short sequences at 8) changes nothing."""
    inputs = make_decode_inputs(3, 3, 48, 24, [2, 40, 90], page_size=16, device=DEVICE, seed=8)
    single = mla_decode(*inputs.args(), num_splits=1)
    split = mla_decode(*inputs.args(), num_splits=num_splits)
    torch.testing.assert_close(split[0], single[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split[1], single[1], atol=1e-5, rtol=1e-6)
    assert_matches(split, mla_decode_reference(*inputs.args()), torch.float32)


@needs_kernel_device
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_half_precision_cache(dtype):
    inputs = make_decode_inputs(2, 3, 100, 12, [1, 70], page_size=16, dtype=dtype, device=DEVICE, seed=9)
    out, lse = mla_decode(*inputs.args(), num_splits=2)
    assert out.dtype == dtype
    assert_matches((out, lse), mla_decode_reference(*inputs.args()), dtype)


@needs_kernel_device
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_deepseek_shape_512_plus_64(dtype):
    inputs = make_decode_inputs(2, 4, 512, 64, [5, 40], page_size=16, dtype=dtype, device=DEVICE, seed=10)
    assert_matches(mla_decode(*inputs.args()), mla_decode_reference(*inputs.args()), dtype)


@needs_kernel_device
def test_kernel_accepts_strided_query_views():
    """q_latent and q_rope as column slices of one fused projection output (non-contiguous views)."""
    inputs = make_decode_inputs(2, 3, 48, 24, [9, 30], page_size=8, device=DEVICE, seed=11)
    fused = torch.cat([inputs.q_latent, inputs.q_rope], dim=-1)  # (batch, heads, R + D)
    q_latent, q_rope = fused[..., :48], fused[..., 48:]
    assert not q_latent.is_contiguous()
    out = mla_decode(q_latent, q_rope, *inputs.args()[2:])
    assert_matches(out, mla_decode_reference(*inputs.args()), torch.float32)


@needs_kernel_device
def test_kernel_multi_token_matches_reference_and_single_token_decode():
    """Speculative decoding: query i equals a single-token decode of the first len - q_len + i + 1 tokens."""
    q_len = 3
    inputs = make_decode_inputs(2, 3, 48, 24, [3, 41], page_size=16, q_len=q_len, device=DEVICE, seed=12)
    out, lse = mla_decode_multi(*inputs.args(), num_splits=2)
    assert out.shape == (2, q_len, 3, 48) and lse.shape == (2, q_len, 3)
    assert_matches((out, lse), mla_decode_multi_reference(*inputs.args()), torch.float32)
    for index in range(q_len):
        shorter = inputs.seq_lens - q_len + index + 1
        single = mla_decode(inputs.q_latent[:, index], inputs.q_rope[:, index], inputs.kv_cache,
                            inputs.page_table, shorter, inputs.softmax_scale, num_splits=1)
        torch.testing.assert_close(out[:, index], single[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[:, index], single[1], atol=1e-5, rtol=1e-6)


@needs_kernel_device
def test_kernel_rows_spread_over_several_row_blocks():
    """Forced 16-row programs: 17 heads, and 2 query tokens x 9 heads, each straddle two row blocks."""
    config = DecodeConfig(block_h=16, block_n=16, num_splits=2, num_warps=4, num_stages=2)
    single = make_decode_inputs(2, 17, 48, 24, [5, 50], page_size=16, device=DEVICE, seed=13)
    assert_matches(mla_decode(*single.args(), config=config), mla_decode_reference(*single.args()), torch.float32)
    multi = make_decode_inputs(2, 9, 48, 24, [2, 50], page_size=16, q_len=2, device=DEVICE, seed=14)
    assert_matches(
        mla_decode_multi(*multi.args(), config=config), mla_decode_multi_reference(*multi.args()), torch.float32
    )


def _shape(batch, heads, rank, rope_dim, context, page_size=64, q_len=1):
    from mla_decode_triton.inputs import DecodeShape

    return DecodeShape(batch=batch, q_len=q_len, heads=heads, kv_lora_rank=rank, rope_dim=rope_dim,
                       page_size=page_size, max_pages=context // page_size)


def test_choose_config_shares_tiles_across_heads():
    """Rows of a sequence share a row block: all of them up to 16 (SmolLM2), up to 32 at R = 512 (whole R)."""
    cpu = torch.device("cpu")
    smollm = choose_config(_shape(1, 9, 144, 48, 64, page_size=4), torch.bfloat16, cpu)
    assert (smollm.block_h, smollm.r_split) == (16, 1)  # all 9 heads in one program: one read per split
    assert smollm.block_n == 64
    # 512+64: up to 32 rows with whole R per program, 64-token tiles (the H200's fastest, configs.py)
    for heads, block_h in [(1, 16), (16, 16), (32, 32), (64, 32), (128, 32)]:
        config = choose_config(_shape(1, heads, 512, 64, 64, page_size=4), torch.bfloat16, cpu)
        assert (config.block_h, config.r_split) == (block_h, 1), heads
        assert config.block_n == 64 and config.num_warps == 8 and config.num_stages == 3
    # speculative decoding: 4 tokens x 16 heads = 64 rows, in two row blocks of 32
    multi = choose_config(_shape(1, 16, 512, 64, 64, page_size=4, q_len=4), torch.bfloat16, cpu)
    assert (multi.block_h, multi.r_split) == (32, 1)
    # an fp32 cache (CUDA-core products) stays at 16-row tiles, the only ones that compile spill-free
    assert choose_config(_shape(1, 128, 512, 64, 64), torch.float32, cpu).block_h == 16
    config = choose_config(_shape(1, 128, 512, 64, 16, page_size=4), torch.bfloat16, cpu)
    assert config.num_splits == 1  # a 16-token context is not worth splitting
    assert choose_config(_shape(1, 128, 512, 64, 64), torch.bfloat16, cpu, num_splits=5).num_splits == 5
    with pytest.raises(MLADecodeInputError, match="num_splits must be at least 1"):
        choose_config(_shape(1, 128, 512, 64, 64), torch.bfloat16, cpu, num_splits=0)


def test_narrow_rows_also_get_128_token_tiles_after_the_default():
    """Rows up to 192 padded columns get 128-token candidates (a tile within WIDE_TILE_BYTES), placed
    after every other tile, so the default stays the 64-token one (the H200's 6-12 % preference for 128
    tokens at 64+32 lives in the shipped table); wider rows (DeepSeek's 576) do not get them.  SmolLM2
    2x at 144+48 qualifies since its row is cut into 128 + 64 columns (it padded to 256 + 64 before)."""
    from mla_decode_triton.configs import WIDE_BLOCK_N, WIDE_TILE_BYTES

    for rank, rope_dim, heads in [(64, 32, 9), (24, 8, 8), (4, 4, 8), (128, 64, 64), (144, 48, 9)]:
        tiles = candidate_tiles(rank, rope_dim, heads, torch.bfloat16)
        wide = [index for index, tile in enumerate(tiles) if tile.block_n == WIDE_BLOCK_N]
        assert wide and wide == list(range(len(tiles) - len(wide), len(tiles))), (rank, rope_dim)
        assert tiles[0].block_n == 64 and tiles[0].num_stages == 3
    for rank, rope_dim, heads in [(256, 64, 9), (512, 64, 16), (512, 64, 128)]:
        assert all(tile.block_n < WIDE_BLOCK_N for tile in candidate_tiles(rank, rope_dim, heads, torch.bfloat16))
    assert WIDE_BLOCK_N * (128 + 64) * 2 == WIDE_TILE_BYTES  # the widest row that qualifies



def test_rows_are_cut_into_the_two_blocks_with_the_fewest_padded_columns():
    """configs.row_blocks: a power-of-two latent stays whole (the tail is the rope key); otherwise the cut
    main + tail is taken when it pads less, as at SmolLM2 2x (144+48 -> 128 + 64, no padding at all,
    against 256 + 64); where cutting pads more (255+64 -> 128 + 256) or as much (48+24 -> 32 + 64 =
    64 + 32), or the main block would be under CUT_MIN_MAIN = 64 columns (20+6), the latent stays whole;
    latents under 16 columns are padded to tl.dot's 16."""
    from mla_decode_triton.configs import RowBlocks, candidate_tiles, row_blocks

    expected = {
        (512, 64): RowBlocks(512, 64), (64, 32): RowBlocks(64, 32), (144, 48): RowBlocks(128, 64),
        (300, 64): RowBlocks(256, 128), (255, 64): RowBlocks(256, 64), (48, 24): RowBlocks(64, 32),
        (4, 4): RowBlocks(16, 16), (20, 6): RowBlocks(32, 16), (100, 12): RowBlocks(64, 64),
    }
    for (rank, rope_dim), blocks in expected.items():
        assert row_blocks(rank, rope_dim) == blocks, (rank, rope_dim)
        assert blocks.width >= rank + rope_dim
        assert blocks.tail_has_latent(rank) == (blocks.main < rank)
    # A cut latent is never R-split (the kernel asserts it): 64 rows of 300+64 accumulate 384 columns,
    # over ACCUMULATOR_BUDGET, so they get 32-row programs instead.
    assert all(tile.r_split == 1 and tile.block_h == 32 for tile in candidate_tiles(300, 64, 64, torch.bfloat16))
    assert any(tile.r_split == 2 for tile in candidate_tiles(512, 64, 64, torch.bfloat16))


@needs_kernel_device
def test_an_r_split_of_a_cut_latent_is_refused():
    """R_SPLIT halves the main block between two programs; with latent columns in the tail neither half
    would own them, so a config that asks for it is refused before any launch (kernel.py asserts the same)."""
    from mla_decode_triton import DecodeConfig

    inputs = make_decode_inputs(1, 16, 144, 48, [40], page_size=16, dtype=torch.bfloat16, device=DEVICE, seed=3)
    config = DecodeConfig(block_h=16, r_split=2, block_n=32, num_warps=4, num_stages=3, num_splits=1,
                          min_split_tokens=32)
    with pytest.raises(MLADecodeInputError, match="r_split=2 needs a power-of-two latent width \\(R=144 is cut"):
        mla_decode(*inputs.args(), config=config)

def _gpu_splits(shape, max_seq_len=None, mean_seq_len=None, dtype=torch.bfloat16, resident=2):
    from mla_decode_triton.configs import choose_tile
    from mla_decode_triton.launcher import splits_for_gpu

    tile = choose_tile(shape.kv_lora_rank, shape.rope_dim, shape.rows, shape.page_size, dtype)
    return splits_for_gpu(shape, tile, 2, 132, max_seq_len, mean_seq_len, resident), tile


@pytest.mark.parametrize("batch, heads, context", [(1, 16, 16384), (1, 16, 1024), (16, 16, 4096), (4, 9, 4096),
                                                   (1, 128, 16384), (2, 64, 4096)])
def test_split_count_fills_one_wave(batch, heads, context):
    """Small batches are split until their programs fill one wave (132 SMs x 2 resident programs, like an
    H100/H200 with a tile two of which fit a multiprocessor), never beyond it, or until the chunks
    reach their floor length (within the cost model's 5 % tolerance) or MAX_SPLITS."""
    from mla_decode_triton.launcher import MAX_SPLITS, min_split_tokens_for

    shape = _shape(batch, heads, 512, 64, context)
    splits, tile = _gpu_splits(shape)
    programs = batch * splits * -(-heads // tile.block_h) * tile.r_split
    slots = 2 * 132
    chunks_at_floor = -(-context // min_split_tokens_for(shape, 2))
    assert splits <= chunks_at_floor  # no more splits than chunks of the minimum length
    assert programs <= slots  # one wave: a second, nearly empty one would cost a whole wave more
    assert programs >= 0.85 * slots or splits >= 0.85 * chunks_at_floor or splits == MAX_SPLITS, splits
    assert splits > 1


def test_split_count_is_chosen_in_whole_waves():
    """64 sequences x 16 heads at 4K: the flash-decoding count (~2 programs per SM -> 5 splits, 320
    programs) would run 3 waves of 132 with one resident program per SM, the last 42 % full.  The
    launcher takes 2 splits there (128 programs, one wave), and 4 (256 programs, one wave of 264) once
    the compiled kernel shows that two programs fit a multiprocessor."""
    shape = _shape(64, 16, 512, 64, 4096)
    assert _gpu_splits(shape, resident=1)[0] == 2
    assert _gpu_splits(shape, resident=2)[0] == 4
    # 128 heads x 128 sequences already fill 3.9 waves of 132: splitting would only add partial traffic
    assert _gpu_splits(_shape(128, 128, 512, 64, 16384), resident=1)[0] == 1


def test_programs_per_multiprocessor_from_registers_and_shared_memory():
    """Residency from the compiled kernel's resources (values from the sm_90 compile check)."""
    from mla_decode_triton.launcher import programs_per_multiprocessor

    assert programs_per_multiprocessor(128, 91 * 1024, 8) == 2  # 512+64 x16, N32, 3 stages: 32K registers
    assert programs_per_multiprocessor(171, 164 * 1024, 8) == 1  # N64: registers (and shared memory) allow one
    assert programs_per_multiprocessor(72, 29 * 1024, 4) == 7  # 64+32 x9: shared memory allows 7
    assert programs_per_multiprocessor(32, 2 * 1024, 4) == 16  # tiny tiles: 64 warps per SM at most
    assert programs_per_multiprocessor(255, 220 * 1024, 8) == 1  # never below one


def test_split_count_is_one_when_the_batch_already_fills_the_gpu():
    assert _gpu_splits(_shape(128, 128, 512, 64, 4096))[0] == 1
    assert _gpu_splits(_shape(512, 16, 512, 64, 16384))[0] == 1
    # 128 heads x 512 fp32 partials per split: longer chunks, so fewer splits than with 16 heads
    assert _gpu_splits(_shape(1, 128, 512, 64, 16384))[0] < _gpu_splits(_shape(1, 16, 512, 64, 16384))[0]


def test_split_count_follows_the_real_lengths_not_the_table_capacity():
    """A table preallocated for 64K tokens holding 1K-token sequences is split for 1K, not 64K."""
    from mla_decode_triton.launcher import min_split_tokens_for

    preallocated = _shape(1, 16, 512, 64, 65536)
    capacity_splits, _ = _gpu_splits(preallocated)
    real_splits, _ = _gpu_splits(preallocated, max_seq_len=1024, mean_seq_len=1024)
    assert real_splits == -(-1024 // min_split_tokens_for(preallocated, 2)) < capacity_splits
    # mixed batch: one 4096-token sequence among 31 of 7 tokens.  Sized from the batch's real total
    # (4313 tokens) the long one is cut as finely as the chunk floor allows; sized as if every sequence
    # were 4096 long (32 x 4096 tokens would nearly fill the GPU) it would get 8 splits.
    mixed = _shape(32, 16, 512, 64, 65536)
    uniform, _ = _gpu_splits(mixed, max_seq_len=4096, mean_seq_len=4096)
    skewed, _ = _gpu_splits(mixed, max_seq_len=4096, mean_seq_len=(4096 + 31 * 7) / 32)
    assert uniform == 8  # 256 programs: one wave of 264
    assert skewed == -(-4096 // min_split_tokens_for(mixed, 2)) == 32


def test_length_hints_are_checked_against_the_table():
    cpu = torch.device("cpu")
    shape = _shape(2, 16, 512, 64, 1024)
    with pytest.raises(MLADecodeInputError, match="max_seq_len=2000 is outside the page table's range 0..1024"):
        choose_config(shape, torch.bfloat16, cpu, max_seq_len=2000)
    with pytest.raises(MLADecodeInputError, match="mean_seq_len=600 must lie between 0 and max_seq_len"):
        choose_config(shape, torch.bfloat16, cpu, max_seq_len=500, mean_seq_len=600)
    # on the interpreter the hint caps the default split count too: a 10-token batch gets one split
    assert choose_config(shape, torch.bfloat16, cpu, max_seq_len=10).num_splits == 1
    assert choose_config(shape, torch.bfloat16, cpu).num_splits == 2


# ---------------------------------------------------------------------------------------------------
# Realistic sizes on a GPU (compiled kernels).


@pytest.mark.gpu
@needs_compiled_cuda
@pytest.mark.parametrize(
    "heads, rank, rope_dim, dtype",
    [  # DeepSeek at 16 / 128 heads, SmolLM2 2x / 4x, stories260K 2x; fp16 once (same code path as bf16)
        (16, 512, 64, torch.bfloat16), (128, 512, 64, torch.bfloat16), (128, 512, 64, torch.float16),
        (9, 144, 48, torch.bfloat16), (9, 64, 32, torch.bfloat16), (8, 24, 8, torch.bfloat16),
    ],
)
def test_gpu_kernel_matches_reference_at_realistic_sizes(heads, rank, rope_dim, dtype):
    """Mixed lengths up to 4096 (pages of 64, NaN past each length), default, single and 16 splits."""
    lens = [1, 77, 1000, 4096, 2049, 64, 3000, 513]
    inputs = make_decode_inputs(len(lens), heads, rank, rope_dim, lens, page_size=64, dtype=dtype,
                                device="cuda", seed=heads + rank)
    expected = mla_decode_reference(*inputs.args())
    assert_matches(mla_decode(*inputs.args()), expected, dtype)
    assert_matches(mla_decode(*inputs.args(), num_splits=1), expected, dtype)
    assert_matches(mla_decode(*inputs.args(), num_splits=16), expected, dtype)


@pytest.mark.gpu
@needs_compiled_cuda
def test_gpu_page_sizes_and_fp32_cache():
    base = make_decode_inputs(4, 16, 512, 64, [1, 300, 2000, 1024], page_size=64, device="cuda", seed=20)
    expected = mla_decode_reference(*base.args())
    results = []
    for page_size in (1, 16, 64, 128):
        kv_cache, page_table = paginate(base.logical.cpu(), base.seq_lens.cpu(), page_size,
                                        torch.Generator().manual_seed(page_size))
        result = mla_decode(base.q_latent, base.q_rope, kv_cache.cuda(), page_table.cuda(), base.seq_lens,
                            base.softmax_scale, num_splits=4)
        assert_matches(result, expected, torch.float32)
        results.append(result)
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse, results[0][1], atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@needs_compiled_cuda
def test_gpu_multi_token_decode():
    inputs = make_decode_inputs(8, 128, 512, 64, [4, 100, 2000, 4096, 7, 513, 64, 1500], page_size=64,
                                dtype=torch.bfloat16, q_len=4, device="cuda", seed=21)
    assert_matches(mla_decode_multi(*inputs.args()), mla_decode_multi_reference(*inputs.args()), torch.bfloat16)


@pytest.mark.gpu
@needs_compiled_cuda
def test_gpu_first_launch_records_programs_per_multiprocessor():
    """The split kernel's first launch reads its registers and shared memory; later calls size splits by it.

    The recorded residency must be the one the compiled kernel's own resources give (Hopper: 64K
    registers, 227 KB shared memory per program), and the next call's split count must use it.
    """
    from mla_decode_triton import launcher
    from mla_decode_triton.configs import choose_tile

    inputs = make_decode_inputs(64, 16, 512, 64, [1024] * 64, page_size=64, dtype=torch.bfloat16, device="cuda",
                                seed=22)
    shape = check_decode_inputs(*inputs.args()[:5], None)
    tile = choose_tile(512, 64, 16, 64, torch.bfloat16)
    key = launcher._residency_key(inputs.kv_cache.device, shape, torch.bfloat16, tile)
    launcher._RESIDENT.pop(key, None)
    expected = mla_decode_reference(*inputs.args())
    assert_matches(mla_decode(*inputs.args(), max_seq_len=1024, mean_seq_len=1024), expected, torch.bfloat16)
    resident = launcher._RESIDENT[key]
    assert 1 <= resident <= 8
    config = choose_config(shape, torch.bfloat16, inputs.kv_cache.device, max_seq_len=1024, mean_seq_len=1024)
    element = inputs.kv_cache.element_size()
    assert config.num_splits == launcher.splits_for_gpu(
        shape, tile, element, launcher._multiprocessor_count(0), 1024, 1024, resident)
    assert_matches(mla_decode(*inputs.args(), config=config), expected, torch.bfloat16)


@needs_kernel_device
@pytest.mark.parametrize(
    "heads, rank, rope_dim, lens, num_splits, dtype",
    [
        (9, 144, 48, [1, 70, 129], 3, torch.bfloat16),  # SmolLM2 2x: 128 + a tail of 16 latent, 48 rope columns
        (9, 144, 48, [1, 70, 129], 3, torch.float32),  # the same on the exact fp32 path
        (4, 300, 64, [5, 90], 2, torch.float32),  # a tail of 128 columns: 44 latent, 64 rope, 20 padding
        (36, 160, 32, [33, 64], 1, torch.bfloat16),  # 36 heads in one 64-row program; one split writes the output
    ],
)
def test_a_latent_cut_into_main_and_tail_blocks_matches_the_reference(heads, rank, rope_dim, lens, num_splits,
                                                                      dtype):
    """Where R is not a power of two the row is cut into a main block and a tail that holds the latent's
    last columns before the rope key (configs.row_blocks): the tail then takes part in both products and
    its latent columns are stored.  NaN past each length must still stay out."""
    from mla_decode_triton.configs import row_blocks

    assert row_blocks(rank, rope_dim).tail_has_latent(rank)  # the path under test
    inputs = make_decode_inputs(len(lens), heads, rank, rope_dim, lens, page_size=16, dtype=dtype, device=DEVICE,
                                seed=rank, poison=float("nan"))
    out, lse = mla_decode(*inputs.args(), num_splits=num_splits)
    assert torch.isfinite(out).all()
    assert_matches((out, lse), mla_decode_reference(*inputs.args()), dtype)


@pytest.mark.gpu
@needs_compiled_cuda
def test_gpu_dependent_merge_launch_equals_the_plain_one():
    """The merge launched early (programmatic dependent launch) must read only finished partials: over
    many splits, repeated eagerly and from a CUDA graph, it gives bit-identical outputs to the plain
    launch.  A merge that ran ahead of the split kernel would read stale or NaN partials."""
    from mla_decode_triton.launcher import dependent_launch, plan_launches

    device = torch.device("cuda")
    assert dependent_launch(device) == (torch.cuda.get_device_capability(device) >= (9, 0))
    inputs = make_decode_inputs(64, 16, 512, 64, [4096] * 63 + [33], page_size=64, dtype=torch.bfloat16,
                                device="cuda", seed=21)
    shape = check_decode_inputs(*inputs.args()[:5], None)
    config = choose_config(shape, torch.bfloat16, device, num_splits=16)

    def step(pdl):
        launches, out, lse = plan_launches(*inputs.args(), shape, config, torch.bfloat16, pdl=pdl)
        for launch in launches:
            launch.run()
        return out, lse

    plain_out, plain_lse = step(False)
    assert_matches((plain_out, plain_lse), mla_decode_reference(*inputs.args()), torch.bfloat16)
    for _ in range(20):
        out, lse = step(True)
        assert torch.equal(out, plain_out) and torch.equal(lse, plain_lse)
    graph = torch.cuda.CUDAGraph()
    step(True)  # compiled and warmed outside the capture
    with torch.cuda.graph(graph):
        graph_out, graph_lse = step(True)
    for _ in range(20):
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_out, plain_out) and torch.equal(graph_lse, plain_lse)
