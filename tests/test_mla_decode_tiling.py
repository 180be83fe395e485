"""The kernel's tiling and split paths against the torch reference: many heads, R split, per-sequence
splits from real lengths, empty splits, idle slots, padded rows, every candidate tile, the autotuner.

Runs in the Triton interpreter on CPU (the conftest default) and, with TRITON_INTERPRET=0 on a GPU,
compiled on CUDA.  Every cache is adversarial (`mla_decode_triton.testing`): shuffled pages, NaN in
every slot past a sequence's length, in spare pages and in row padding, and out-of-range page-table
entries past each sequence's last page.  Shapes are kept small where the interpreter is slow (R = 512
with 128 heads only at lengths of a few tiles); heavier variants are marked `slow`.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, NEEDS_KERNEL_DEVICE, assert_matches
from mla_decode_triton import DecodeConfig, candidate_tiles, choose_config, mla_decode, mla_decode_multi, mla_decode_multi_reference, mla_decode_reference
from mla_decode_triton.configs import WIDE_BLOCK_N, TileConfig, choose_tile, load_table, save_table, table_key
from mla_decode_triton.inputs import check_decode_inputs
from mla_decode_triton.launcher import INTERPRETED, plan_launches, row_alignment
from mla_decode_triton.testing import LSE_TOLERANCE, TOLERANCE, make_decode_inputs, paginate

pytestmark = NEEDS_KERNEL_DEVICE


# ------------------------------------------------------------------------------------- many heads
@pytest.mark.parametrize("heads, block_h, r_split", [(1, 16, 1), (16, 16, 1), (64, 32, 1), (128, 32, 1)])
def test_heads_share_one_tile_at_512_plus_64(heads, block_h, r_split):
    """1, 16, 64 and 128 heads at R = 512, D = 64.  The launcher's tile holds up to 32 rows with whole R
    (measured fastest on the H200, configs.py); 64 and 128 heads also run the tile that holds 64 rows, R
    split in two, which the autotuner may still pick elsewhere."""
    inputs = make_decode_inputs(2, heads, 512, 64, [5, 40], page_size=16, dtype=torch.bfloat16, device=DEVICE,
                                seed=heads)
    expected = mla_decode_reference(*inputs.args())
    shape = check_decode_inputs(*inputs.args()[:5], None)
    config = choose_config(shape, torch.bfloat16, torch.device(DEVICE), num_splits=2)
    assert (config.block_h, config.r_split) == (block_h, r_split)
    assert_matches(mla_decode(*inputs.args(), config=config), expected, torch.bfloat16)
    if heads >= 64:
        split_tile = next(tile for tile in candidate_tiles(512, 64, heads, torch.bfloat16) if tile.r_split == 2)
        assert split_tile.block_h == 64
        assert_matches(mla_decode(*inputs.args(), config=DecodeConfig.from_tile(split_tile, num_splits=2)), expected,
                       torch.bfloat16)


def test_r_split_with_a_ragged_half_rows_over_blocks_and_several_query_tokens():
    """R = 48 split as 32 + 16 real columns, 3 tokens x 9 heads = 27 rows over two 16-row blocks."""
    inputs = make_decode_inputs(2, 9, 48, 24, [4, 45], page_size=8, q_len=3, dtype=torch.float16, device=DEVICE,
                                seed=31)
    for config in (DecodeConfig(16, 16, 3, 4, 2, r_split=2), DecodeConfig(32, 16, 1, 4, 2, r_split=2)):
        assert_matches(mla_decode_multi(*inputs.args(), config=config), mla_decode_multi_reference(*inputs.args()),
                       torch.float16)


# ------------------------------------------------------------------------------------- tokens-major
def _tokens_major_tile(heads):
    tile = candidate_tiles(512, 64, heads, torch.bfloat16)[-1]
    assert tile.tokens_major and tile.r_split == 1 and tile.block_n == 64
    return tile


@pytest.mark.parametrize("heads, block_h", [(1, 16), (16, 16), (64, 32), (128, 32)])
def test_tokens_major_tiles_match_the_reference_at_512_plus_64(heads, block_h):
    """The transposed split kernel (cache tokens in the MMA's M) gives the reference's answer for one
    head up to 128 heads (four 32-row programs), with sequences that end inside a tile and inside a page
    (NaN past each length); the launcher runs it only when the tile says tokens_major."""
    inputs = make_decode_inputs(2, heads, 512, 64, [5, 130], page_size=16, dtype=torch.bfloat16, device=DEVICE,
                                seed=70 + heads)
    shape = check_decode_inputs(*inputs.args()[:5], None)
    tile = _tokens_major_tile(heads)
    assert tile.block_h == block_h
    config = DecodeConfig.from_tile(tile, num_splits=2)
    launches, _, _ = plan_launches(*inputs.args(), shape, config, torch.float32)
    assert launches[0].kernel.fn.__name__ == "mla_decode_split_tokens_major_kernel"
    assert launches[0].grid == (-(-heads // block_h), 2, 2)
    assert_matches(mla_decode(*inputs.args(), config=config), mla_decode_reference(*inputs.args()), torch.bfloat16)


def test_tokens_major_with_several_query_tokens_mixed_lengths_and_empty_splits():
    """3 query tokens x 16 heads (causal within the new tokens) over lengths {3, 7, 300} in a table
    preallocated for 1024 tokens, 8 splits of at least 64 tokens: the short sequences leave 7 splits
    empty, whose partials (NaN before the launch) are neither written nor read."""
    lens = [3, 7, 300]
    inputs = make_decode_inputs(3, 16, 512, 64, lens, page_size=16, q_len=3, dtype=torch.bfloat16, device=DEVICE,
                                seed=75, table_pages=1024 // 16)
    shape = check_decode_inputs(*inputs.args()[:5], None, q_len_dim=True)
    config = DecodeConfig.from_tile(_tokens_major_tile(48), num_splits=8, min_split_tokens=64)
    rows_latent = inputs.q_latent.reshape(3, 48, 512)  # (batch, q_len * heads, R)
    rows_rope = inputs.q_rope.reshape(3, 48, 64)  # (batch, q_len * heads, D)
    launches, out, lse = plan_launches(rows_latent, rows_rope, *inputs.args()[2:], shape, config, torch.bfloat16)
    part_lse = launches[0].args[6]  # (3, 48, 8)
    launches[0].args[5].fill_(float("nan"))
    part_lse.fill_(float("nan"))
    for launch in launches:
        launch.run()
    # (batch, rows, R) -> (batch, q_len, heads, R), as mla_decode_multi returns them
    assert_matches((out.reshape(3, 3, 16, 512), lse.reshape(3, 3, 16)), mla_decode_multi_reference(*inputs.args()),
                   torch.bfloat16)
    for seq, used in enumerate([1, 1, 5]):  # 300 tokens in chunks of 64
        assert torch.isfinite(part_lse[seq, :, :used]).all() and torch.isnan(part_lse[seq, :, used:]).all()


def test_tokens_major_is_offered_only_for_whole_wide_latents_and_refused_elsewhere():
    """Tokens-major tiles come after every row-major tile (no default changes) and only for 16-bit caches
    whose latent is a power of two of at least 256 columns: narrower latents are memory-bound, a cut
    latent (144 = 128 + 16 in the tail) or an R split would leave output columns to no program."""
    from mla_decode_triton.configs import TOKENS_MAJOR_MIN_R
    from mla_decode_triton.errors import MLADecodeInputError

    for heads in (16, 128):
        tiles = candidate_tiles(512, 64, heads, torch.bfloat16)
        flags = [tile.tokens_major for tile in tiles]
        assert flags[0] is False and flags == sorted(flags)  # row-major first, tokens-major last
    assert any(tile.tokens_major for tile in candidate_tiles(TOKENS_MAJOR_MIN_R, 64, 16, torch.float16))
    for rank, rope_dim, dtype in [(128, 64, torch.bfloat16), (144, 48, torch.bfloat16), (64, 32, torch.bfloat16),
                                  (512, 64, torch.float32)]:
        assert not any(tile.tokens_major for tile in candidate_tiles(rank, rope_dim, 16, dtype)), (rank, dtype)

    inputs = make_decode_inputs(1, 16, 144, 48, [40], page_size=16, dtype=torch.bfloat16, device=DEVICE, seed=76)
    cut = DecodeConfig(16, 64, 1, 4, 2, tokens_major=True)
    with pytest.raises(MLADecodeInputError, match="tokens_major needs r_split=1 and the whole latent"):
        mla_decode(*inputs.args(), config=cut)
    inputs = make_decode_inputs(1, 16, 512, 64, [40], page_size=16, dtype=torch.bfloat16, device=DEVICE, seed=77)
    with pytest.raises(MLADecodeInputError, match="tokens_major needs r_split=1"):
        mla_decode(*inputs.args(), config=DecodeConfig(16, 64, 1, 4, 2, r_split=2, tokens_major=True))


# ------------------------------------------------------------------------------------- splits
def _mixed_inputs(heads, rank, rope_dim, dtype, seed=40):
    """Lengths {1, 7, 4096} in one batch, table preallocated for 4x the longest (like a runtime's)."""
    lens = [1, 7, 4096]
    inputs = make_decode_inputs(3, heads, rank, rope_dim, lens, page_size=64, dtype=dtype, device=DEVICE, seed=seed,
                                table_pages=4 * 4096 // 64)
    assert inputs.page_table.shape == (3, 256)
    return inputs, lens


def test_mixed_lengths_with_a_preallocated_table():
    """Per-sequence splits: the 4096-token sequence is cut in 16 chunks, the short ones use one split."""
    inputs, lens = _mixed_inputs(8, 64, 32, torch.bfloat16)
    expected = mla_decode_reference(*inputs.args())
    tile = candidate_tiles(64, 32, 8, torch.bfloat16)[0]
    config = DecodeConfig.from_tile(tile, num_splits=16, min_split_tokens=128)
    assert_matches(mla_decode(*inputs.args(), config=config), expected, torch.bfloat16)
    # the default path, told the real lengths (no device read), gives the same answer
    hinted = mla_decode(*inputs.args(), max_seq_len=max(lens), mean_seq_len=sum(lens) / len(lens))
    assert_matches(hinted, expected, torch.bfloat16)


@pytest.mark.slow
def test_mixed_lengths_with_a_preallocated_table_at_512_plus_64_and_128_heads():
    inputs, _ = _mixed_inputs(128, 512, 64, torch.bfloat16, seed=41)
    tile = next(tile for tile in candidate_tiles(512, 64, 128, torch.bfloat16) if tile.r_split == 2)
    assert tile.block_h == 64  # two row blocks of 64 rows, each R split in two: the most programs per tile
    expected = mla_decode_reference(*inputs.args())
    config = DecodeConfig.from_tile(tile, num_splits=8, min_split_tokens=256)
    assert_matches(mla_decode(*inputs.args(), config=config), expected, torch.bfloat16)
    # the transposed kernel's 32-row tile (four row blocks) over the same batch
    config = DecodeConfig.from_tile(_tokens_major_tile(128), num_splits=8, min_split_tokens=256)
    assert_matches(mla_decode(*inputs.args(), config=config), expected, torch.bfloat16)


def test_empty_splits_are_neither_written_nor_read():
    """Splits past a sequence's last chunk return at once; the merge reads only the written partials.

    The partial buffers are filled with NaN before the launch: any read of an unwritten partial would
    poison the output, and the unused splits' lse must still be NaN afterwards.
    """
    lens = [1, 7, 300]
    inputs = make_decode_inputs(3, 4, 32, 16, lens, page_size=16, device=DEVICE, seed=42)
    shape = check_decode_inputs(*inputs.args()[:5], None)
    config = DecodeConfig(16, 16, num_splits=8, num_warps=4, num_stages=2, min_split_tokens=48)
    launches, out, lse = plan_launches(*inputs.args(), shape, config, torch.float32)
    part_out, part_lse = launches[0].args[5], launches[0].args[6]  # (3, 4, 8, 32), (3, 4, 8)
    part_out.fill_(float("nan"))
    part_lse.fill_(float("nan"))
    for launch in launches:
        launch.run()
    assert_matches((out, lse), mla_decode_reference(*inputs.args()), torch.float32)
    # per split: max(ceil(len / 8), 48) tokens rounded up to 16-token tiles -> 300 tokens use 7 splits of 48
    used = [1, 1, 7]
    for seq, count in enumerate(used):
        assert torch.isfinite(part_lse[seq, :, :count]).all()
        assert torch.isnan(part_lse[seq, :, count:]).all()


def test_merge_reads_up_to_the_most_splits_at_once():
    """The merge loads all of a sequence's splits in one read; at 64 splits (MAX_SPLITS) its split block is
    64 wide and its column block shrinks to keep the load at MERGE_TILE_ELEMENTS (4 rows: 32 columns,
    where R = 32 needs one column block).  A 1024-token sequence fills every split, a 3-token one only its first;
    the unwritten partials hold NaN, which must not reach the output."""
    from mla_decode_triton.launcher import MAX_SPLITS, MERGE_TILE_ELEMENTS

    inputs = make_decode_inputs(2, 4, 32, 16, [3, 1024], page_size=16, device=DEVICE, seed=64)
    shape = check_decode_inputs(*inputs.args()[:5], None)
    config = DecodeConfig(16, 16, num_splits=MAX_SPLITS, num_warps=4, num_stages=2, min_split_tokens=1)
    launches, out, lse = plan_launches(*inputs.args(), shape, config, torch.float32)
    merge = launches[1].constexprs
    assert (merge["BLOCK_ROWS"], merge["BLOCK_S"], merge["BLOCK_C"]) == (4, 64, 32)
    assert merge["BLOCK_ROWS"] * merge["BLOCK_S"] * merge["BLOCK_C"] == MERGE_TILE_ELEMENTS
    part_out, part_lse = launches[0].args[5], launches[0].args[6]  # (2, 4, 64, 32), (2, 4, 64)
    part_out.fill_(float("nan"))
    part_lse.fill_(float("nan"))
    for launch in launches:
        launch.run()
    assert torch.isfinite(part_lse[1]).all() and torch.isnan(part_lse[0, :, 1:]).all()
    assert_matches((out, lse), mla_decode_reference(*inputs.args()), torch.float32)


def test_a_split_that_some_query_rows_cannot_see_merges_to_zero_weight():
    """Speculative decoding with 4 query tokens over 33 tokens in 16-token splits: the last split holds
    token 32 alone, which only the last query sees, so the other rows' partials of that split are 0 with
    lse = -inf.  The merge reads every written partial without waiting for its lse (kernel.py), so
    these must come out as weight 0, while the NaN left in the unwritten splits must stay unread."""
    q_len, heads = 4, 3
    inputs = make_decode_inputs(2, heads, 32, 16, [33, 5], page_size=16, q_len=q_len, device=DEVICE, seed=65)
    shape = check_decode_inputs(*inputs.args()[:5], None, q_len_dim=True)
    config = DecodeConfig(16, 16, num_splits=4, num_warps=4, num_stages=2, min_split_tokens=16)
    rows_latent = inputs.q_latent.reshape(2, q_len * heads, 32)  # (batch, rows, R)
    rows_rope = inputs.q_rope.reshape(2, q_len * heads, 16)  # (batch, rows, D)
    launches, out, lse = plan_launches(rows_latent, rows_rope, *inputs.args()[2:], shape, config, torch.float32)
    part_out, part_lse = launches[0].args[5], launches[0].args[6]  # (2, 12, 4, 32), (2, 12, 4)
    part_out.fill_(float("nan"))
    part_lse.fill_(float("nan"))
    for launch in launches:
        launch.run()
    last_split = part_lse[0, :, 2].reshape(q_len, heads)  # (q_len, heads): token 32 is seen by query 3 only
    assert torch.isneginf(last_split[:3]).all() and torch.isfinite(last_split[3]).all()
    assert (part_out[0, : 3 * heads, 2] == 0).all()
    assert torch.isnan(part_lse[0, :, 3]).all() and torch.isnan(part_lse[1, :, 1:]).all()
    expected = mla_decode_multi_reference(*inputs.args())
    assert_matches((out.reshape(2, q_len, heads, 32), lse.reshape(2, q_len, heads)), expected, torch.float32)


def test_idle_slots_with_length_zero_give_zero_output():
    """A length-0 slot (a finished sequence left in a captured batch) yields out = 0, lse = -inf."""
    inputs = make_decode_inputs(3, 4, 32, 16, [0, 20, 0], page_size=8, device=DEVICE, seed=43)
    expected = mla_decode_reference(*inputs.args())
    for num_splits in (1, 3):
        out, lse = mla_decode(*inputs.args(), num_splits=num_splits)
        assert torch.equal(out[[0, 2]].cpu(), torch.zeros(2, 4, 32))
        assert torch.isinf(lse[[0, 2]]).all() and (lse[[0, 2]] < 0).all()
        torch.testing.assert_close(out[1].cpu(), expected[0][1].cpu(), **TOLERANCE[torch.float32])
        torch.testing.assert_close(lse[1].cpu(), expected[1][1].cpu(), **LSE_TOLERANCE)
    assert torch.equal(expected[0][[0, 2]].cpu(), torch.zeros(2, 4, 32))


# ------------------------------------------------------------------------------------- padded rows
@pytest.mark.parametrize("rank, rope_dim, row_width, alignment", [(4, 4, 8, 8), (20, 6, 32, 16), (10, 6, 16, 16)])
def test_padded_rows_give_identical_results_and_are_never_read(rank, rope_dim, row_width, alignment):
    """Rows padded to 16 bytes (NaN in the padding) decode bit-identically to unpadded ones."""
    kwargs = dict(page_size=16, dtype=torch.bfloat16, device=DEVICE, seed=rank)
    plain = make_decode_inputs(2, 8, rank, rope_dim, [3, 50], **kwargs)
    padded = make_decode_inputs(2, 8, rank, rope_dim, [3, 50], row_width=row_width, **kwargs)
    assert padded.kv_cache.stride(1) == row_width and torch.isnan(padded.kv_cache.as_strided(
        (1,), (1,), padded.kv_cache.storage_offset() + rank + rope_dim)).all() == (row_width > rank + rope_dim)
    assert row_alignment(padded.kv_cache) == alignment
    result = mla_decode(*padded.args(), num_splits=2)
    assert all(torch.equal(a, b) for a, b in zip(result, mla_decode(*plain.args(), num_splits=2)))
    assert_matches(result, mla_decode_reference(*plain.args()), torch.bfloat16)


def test_row_alignment_is_the_largest_power_of_two_dividing_the_strides():
    storage = torch.zeros(4, 16, 32, dtype=torch.bfloat16)
    assert row_alignment(storage) == 16
    assert row_alignment(storage[..., :26]) == 16  # a column slice keeps the 32-element stride
    assert row_alignment(torch.zeros(4, 16, 26, dtype=torch.bfloat16)) == 2
    assert row_alignment(torch.zeros(4, 16, 8, dtype=torch.bfloat16)) == 8
    assert row_alignment(storage[:, :, 1:27]) == 1  # base address off by one element


# ------------------------------------------------------------------------------------- every tile
TILE_SHAPES = [
    (512, 64, 16, torch.bfloat16),
    (512, 64, 64, torch.bfloat16),
    (144, 48, 9, torch.bfloat16),
    (64, 32, 9, torch.bfloat16),
    (24, 8, 8, torch.bfloat16),
    (4, 4, 8, torch.bfloat16),
    (100, 12, 3, torch.float32),
]


@pytest.mark.parametrize("rank, rope_dim, heads, dtype", TILE_SHAPES)
def test_every_candidate_tile_matches_the_reference(rank, rope_dim, heads, dtype):
    """Whatever tile the autotuner picks, the answer is the reference's (within the dtype's rounding)."""
    inputs = make_decode_inputs(2, heads, rank, rope_dim, [9, 70], page_size=16, dtype=dtype, device=DEVICE,
                                seed=rank + heads)
    expected = mla_decode_reference(*inputs.args())
    tiles = candidate_tiles(rank, rope_dim, heads, dtype)
    assert tiles
    if INTERPRETED:
        # num_stages only shapes the compiled software pipeline, which the interpreter does not model
        # (test_mla_decode_compile checks it for sm_90): one tile per computed shape is enough here.
        tiles = list({(tile.block_h, tile.r_split, tile.block_n, tile.num_warps, tile.tokens_major): tile
                      for tile in tiles}.values())
    for tile in tiles:
        assert_matches(mla_decode(*inputs.args(), config=DecodeConfig.from_tile(tile, num_splits=2)), expected, dtype)


def test_autotune_times_every_candidate_and_the_launcher_then_uses_the_winner():
    from mla_decode_triton import autotune, configs

    # pages of 8: a key the shipped table does not have, so without this process's measurement the
    # launcher falls back to the default tile
    inputs = make_decode_inputs(2, 9, 64, 32, [9, 70], page_size=8, dtype=torch.bfloat16, device=DEVICE, seed=50)
    result = autotune.autotune(*inputs.args(), rep_ms=5)
    tiles = candidate_tiles(64, 32, 9, torch.bfloat16)
    assert set(result.times_ms) == {tile.label() for tile in tiles}
    assert result.best in tiles and result.times_ms[result.best.label()] == min(result.times_ms.values())
    try:
        assert choose_tile(64, 32, 9, 8, torch.bfloat16) == result.best
        assert choose_config(check_decode_inputs(*inputs.args()[:5], None), torch.bfloat16,
                             torch.device(DEVICE)).tile == result.best
    finally:
        configs._MEASURED.pop(result.key)
    assert result.key not in configs.load_table()
    assert choose_tile(64, 32, 9, 8, torch.bfloat16) == tiles[0]


def test_shipped_table_entries_are_current_candidates_and_the_launcher_uses_them():
    """The tiles measured on the H200 (tuned_configs.json): each is still a candidate of its shape (a rule
    change that drops one would silently send that shape back to the default), and the launcher picks it."""
    from mla_decode_triton import configs

    table = configs.load_table()
    assert {"512+64/rows16/page16/bf16", "512+64/rows128/page16/bf16", "144+48/rows9/page16/bf16",
            "64+32/rows9/page16/bf16"} <= set(table)  # the benchmark's shapes at the runtime's page size
    for key, tile in table.items():
        shape, rows, page, dtype_name = key.split("/")
        rank, rope_dim = (int(value) for value in shape.split("+"))
        dtype = {name: dtype for dtype, name in configs.DTYPE_NAMES.items()}[dtype_name]
        rows, page = int(rows.removeprefix("rows")), int(page.removeprefix("page"))
        assert tile in candidate_tiles(rank, rope_dim, rows, dtype), key
        assert choose_tile(rank, rope_dim, rows, page, dtype) == tile, key


def test_tuned_table_round_trip_and_stale_entries_are_ignored(tmp_path):
    from mla_decode_triton import configs

    tiles = candidate_tiles(144, 48, 9, torch.bfloat16)
    key = table_key(144, 48, 9, 16, torch.bfloat16)
    stale = table_key(64, 32, 9, 16, torch.bfloat16)
    path = tmp_path / "tuned.json"
    save_table({key: tiles[-1], stale: TileConfig(64, 1, 128, 4, 2)}, "test", path)
    table = load_table(path)
    assert table[key] == tiles[-1]
    saved, configs._TABLE = configs._TABLE, table
    try:
        assert choose_tile(144, 48, 9, 16, torch.bfloat16) == tiles[-1]
        assert choose_tile(144, 48, 9, 64, torch.bfloat16) == tiles[0]  # another page size: not in the table
        # this table replaces the shipped one: no entry for 64+32, whatever the shipped table says
        assert choose_tile(64, 32, 9, 16, torch.bfloat16) == candidate_tiles(64, 32, 9, torch.bfloat16)[0]
    finally:
        configs._TABLE = saved


# ------------------------------------------------------------------------------------- page gathers
@pytest.mark.parametrize("block_n", [64, WIDE_BLOCK_N])
def test_every_page_gather_gives_identical_results(block_n):
    """A tile gathers its rows three ways (kernel.py): one page id per tile (pages of at least BLOCK_N),
    one per page (pages of 8 tokens up to BLOCK_N / 2: the tile holds whole pages), one per token (pages
    of 1 to 4, and sizes that do not divide the tile).  The same logical cache in each layout decodes
    bit-identically, and past-the-end page-table entries and slots are poison in every layout.  Run for
    the 64-token tile and for the 128-token one that narrow rows such as this 64+32 also get."""
    assert TileConfig(16, 1, block_n, 4, 3) in candidate_tiles(64, 32, 9, torch.bfloat16)
    base = make_decode_inputs(3, 9, 64, 32, [1, 77, 300], page_size=16, dtype=torch.bfloat16, device=DEVICE, seed=60)
    tile = TileConfig(16, 1, block_n, 4, 3)
    results = []
    for page_size in (128, 64, 32, 16, 8, 4, 1, 24):
        kv_cache, page_table = paginate(base.logical.cpu(), base.seq_lens.cpu(), page_size,
                                        torch.Generator().manual_seed(page_size))
        results.append(mla_decode(base.q_latent, base.q_rope, kv_cache.to(DEVICE), page_table.to(DEVICE),
                                  base.seq_lens, base.softmax_scale, config=DecodeConfig.from_tile(tile, num_splits=2)))
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])
    assert_matches(results[0], mla_decode_reference(*base.args()), torch.bfloat16)



def test_the_merge_is_a_programmatic_dependent_launch_only_where_asked_and_possible(monkeypatch):
    """plan_launches(pdl=True) makes the split kernel signal its dependents and the merge wait for it,
    launched with Triton's launch_pdl; one split has no merge and nothing to signal; by default
    (`dependent_launch`) it is off on the CPU and in the interpreter, and MLA_DECODE_PDL=0 turns it off
    on a GPU.  Compiled for sm_90 in test_mla_decode_compile; run on the H200 by the `gpu` tests."""
    from mla_decode_triton.launcher import dependent_launch, plan_launches

    inputs = make_decode_inputs(2, 9, 64, 32, [40, 100], page_size=16, dtype=torch.bfloat16, device=DEVICE, seed=8)
    shape = check_decode_inputs(*inputs.args()[:5], None)
    tile = candidate_tiles(64, 32, 9, torch.bfloat16)[0]
    for splits, pdl in [(3, True), (3, False), (1, True)]:
        config = DecodeConfig.from_tile(tile, splits)
        launches, _, _ = plan_launches(*inputs.args(), shape, config, torch.float32, pdl=pdl)
        dependent = pdl and splits > 1
        assert len(launches) == (2 if splits > 1 else 1)
        assert launches[0].constexprs["LAUNCH_DEPENDENTS"] is dependent and not launches[0].launch_pdl
        if splits > 1:
            assert launches[1].constexprs["WAIT_FOR_SPLITS"] is dependent and launches[1].launch_pdl is dependent
    assert not dependent_launch(torch.device("cpu"))
    monkeypatch.setenv("MLA_DECODE_PDL", "0")
    assert not dependent_launch(torch.device("cuda", 0))
