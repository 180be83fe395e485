"""The decode kernels compile for a Hopper GPU (sm_90) without spilling, on a machine with no GPU.

The interpreter-based tests check the arithmetic; this one checks what only the compiler knows, for
every candidate tile of every project shape (`mla_decode_triton.compile_check.CASES`; the tiles the
launcher and the autotuner may pick): that it compiles for sm_90, keeps its registers (no stack frame,
no local loads/stores), uses tensor cores for fp16/bf16 caches - wgmma (HGMMA) where a program holds
64 query rows, mma.sync (HMMA) below that -, software-pipelines the cache loads (cp.async), fits its
shared memory, and reads aligned cache rows with vector loads.  The tokens-major split kernel (cache
tokens in the MMA's M) uses wgmma for every row count it is offered with.  The compile runs in a subprocess
because the kernels must be JIT functions there, while this test session has TRITON_INTERPRET=1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

HOPPER_MAX_SHARED_BYTES = 227 * 1024  # per block, opt-in maximum on sm_90
SCRATCH = 8 * 1024  # shared memory beyond the cache tiles and queries: page ids, staged probabilities


@pytest.fixture(scope="module")
def reports():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run(
        [sys.executable, "-m", "mla_decode_triton.compile_check", "--json"],
        capture_output=True, text=True, env=env, timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


SPLIT_KERNELS = {"mla_decode_split_kernel", "mla_decode_split_tokens_major_kernel"}


def _split(reports, shipped_only=True):
    """Split-kernel reports (both layouts); without the demonstration cases (ROW_ALIGN forced off) unless asked."""
    return [r for r in reports if r["kernel"] in SPLIT_KERNELS
            and not (shipped_only and r["case"].endswith("no-hint"))]


@pytest.mark.slow
def test_every_candidate_tile_compiles_for_sm90_without_spills(reports):
    from mla_decode_triton.compile_check import CASES
    from mla_decode_triton.configs import candidate_tiles

    assert {r["kernel"] for r in reports} == SPLIT_KERNELS | {"mla_decode_merge_kernel"}
    expected = sum(len(candidate_tiles(c.rank, c.rope_dim, c.heads, c.dtype)) for c in CASES)
    assert len(_split(reports, shipped_only=False)) == expected  # every tile of every case was compiled
    for report in reports:
        if report["case"].endswith("no-hint"):
            continue  # the demonstration without the alignment hint is never launched (it spills under 3.6)
        assert report["stack_bytes"] == 0 and report["local_memory_ops"] == 0, report
        assert report["shared_bytes"] <= HOPPER_MAX_SHARED_BYTES, report


@pytest.mark.slow
def test_split_kernel_uses_tensor_cores_and_pipelined_loads(reports):
    for report in _split(reports):
        assert report["async_copies"] > 0, report  # cache tiles are prefetched with cp.async
        if "float32" in report["case"]:
            assert report["wgmma_ops"] == report["mma_sync_ops"] == 0, report  # exact fp32 FMAs
        elif "BLOCK_H=64" in report["config"] or _tile(report).tokens_major:
            assert report["wgmma_ops"] > 0 and report["mma_sync_ops"] == 0, report  # Hopper's warpgroup MMA
        else:
            assert report["mma_sync_ops"] > 0, report


def _tile(report):
    """The TileConfig a split-kernel report was compiled for (parsed from its config string)."""
    from mla_decode_triton.configs import TileConfig

    values = dict(re.findall(r"(\w+)=(\d+)", report["config"]))
    return TileConfig(int(values["BLOCK_H"]), int(values["R_SPLIT"]), int(values["BLOCK_N"]), int(values["warps"]),
                      int(values["stages"]), tokens_major=report["kernel"] == "mla_decode_split_tokens_major_kernel")


@pytest.mark.slow
def test_cache_reads_overlap_the_products_from_three_stages(reports):
    """What the compiler made of the tile loop: with 3 stages the next tile is copied while one is
    multiplied (4 stages: the next two), and every case's default tile does this.  The buffers held in
    shared memory follow `configs.cache_buffers`, the rule the shared-memory budget is computed with,
    and the compiled shared memory stays within that estimate plus a few KB of scratch."""
    from mla_decode_triton.compile_check import CASES
    from mla_decode_triton.configs import cache_buffers, candidate_tiles, shared_bytes_estimate

    by_case = {case.label(): case for case in CASES}
    for report in _split(reports):
        case, tile = by_case[report["case"]], _tile(report)
        element_size = torch.empty((), dtype=case.dtype).element_size()
        assert report["cache_buffers"] == cache_buffers(tile, element_size), report
        if tile.num_stages >= 3:
            assert report["tiles_in_flight"] == tile.num_stages - 2, report
        assert report["shared_bytes"] <= shared_bytes_estimate(case.rank, case.rope_dim, tile, element_size) + SCRATCH
        if case.dtype != torch.float32 and tile == candidate_tiles(case.rank, case.rope_dim, case.heads, case.dtype)[0]:
            assert report["tiles_in_flight"] >= 1, report


@pytest.mark.slow
def test_many_heads_share_one_row_block(reports):
    """64 and 128 heads run 32-row programs with whole R at R = 512 (the default, mma.sync: the H200's
    fastest, configs.py), or one of the 64-row alternatives the autotuner may pick - R split in two, or
    whole R with 16-token tiles (both wgmma) - never 16-row ones."""
    for heads in (64, 128):
        cases = [r for r in _split(reports) if r["case"].startswith(f"512+64 x{heads} ")]
        assert "BLOCK_H=32" in cases[0]["config"] and "R_SPLIT=1" in cases[0]["config"]
        tiles = [_tile(r) for r in cases]
        assert {(tile.block_h, tile.r_split) for tile in tiles} == {(64, 2), (32, 1), (64, 1)}
        assert all(tile.block_n == 16 for tile in tiles if (tile.block_h, tile.r_split) == (64, 1))


@pytest.mark.slow
def test_tokens_major_tiles_put_the_many_head_products_on_wgmma(reports):
    """The transposed split kernel is compiled for the 16-bit 512+64 shapes only (whole power-of-two
    latents of at least 256 columns; configs.py): 16 rows at 16 heads, 32 rows from 32 heads, 64-token
    tiles, 2 stages (3 do not fit at 512+64).  Every product is wgmma - where the row-major kernel's
    16- and 32-row tiles use mma.sync - without spills, one program per multiprocessor."""
    from mla_decode_triton.compile_check import programs_per_sm

    transposed = [r for r in _split(reports) if _tile(r).tokens_major]
    assert sorted(r["case"] for r in transposed) == sorted(f"512+64 x{heads} page 64 {dtype}" for heads, dtype in
                                                          [(16, "bfloat16"), (32, "bfloat16"), (64, "bfloat16"),
                                                           (128, "float16")])
    for report in transposed:
        tile = _tile(report)
        heads = int(report["case"].split(" ")[1].removeprefix("x"))
        assert (tile.block_h, tile.block_n, tile.num_stages) == (min(heads, 32), 64, 2), report
        assert report["wgmma_ops"] > 0 and report["mma_sync_ops"] == 0 and report["stack_bytes"] == 0, report
        assert programs_per_sm(report) == 1, report


@pytest.mark.slow
def test_cache_rows_are_read_with_vector_loads(reports):
    """16-byte rows (4+4 bf16) load 8 bytes at a time (2 without the hint); padding a 52-byte row to 64
    bytes lifts its loads from 4 to 8 bytes."""
    def widest(case):
        rows = [r for r in _split(reports, shipped_only=False) if r["case"] == case]
        assert rows, case
        return min(max(int(width) for width in r["load_bytes"]) for r in rows)

    assert widest("4+4 x8 page 16 bfloat16") >= 8
    assert widest("4+4 x8 page 16 bfloat16 no-hint") == 4  # only the page-table and length loads
    assert widest("20+6 x8 page 16 bfloat16") == 4
    assert widest("20+6 x8 page 16 bfloat16 row 32") >= 8
    assert widest("512+64 x16 page 64 bfloat16") == 16


def test_rendered_report_gives_programs_per_multiprocessor_of_each_version():
    """The committed reports (kernels/mla_decode_triton/compile_reports/, the tables in BENCHMARKS.md) render
    with a programs-per-multiprocessor column per Triton version, every row as wide as the header; the
    16-row default tiles hold at least two programs per multiprocessor under both versions, and a tile
    with 164 KB of shared memory one (no GPU needed: the rendering reads JSON)."""
    from pathlib import Path

    from mla_decode_triton.compile_check import programs_per_sm, side_by_side

    folder = Path(__file__).resolve().parents[1] / "kernels" / "mla_decode_triton" / "compile_reports"
    runs = [json.loads(path.read_text().strip().splitlines()[-1]) for path in sorted(folder.glob("*.json"))]
    assert len(runs) == 2
    table = side_by_side(runs).splitlines()
    versions = [run[0]["triton_version"] for run in runs]
    assert all(f"programs / SM {version}" in table[0] for version in versions)
    assert {line.count("|") for line in table} == {table[0].count("|")}
    for run in runs:
        for report in _split(run):
            held = programs_per_sm(report)
            assert held >= 1
            if report["shared_bytes"] > 114 * 1024:  # more than half of Hopper's 227 KB per program
                assert held == 1, report
            if report["case"].startswith("512+64 x16 ") and "N=32" in report["config"] and "stages=3" in report["config"]:
                assert held == 2, report  # the 512+64 x16 default: 91 KB, 96-98 registers x 8 warps


@pytest.mark.slow
def test_the_merge_reads_partials_without_waiting_for_the_split_weights(reports):
    """The merge masks its partial-output loads by which splits exist, not by their weights, so the
    compiler issues most of its loads before the first exponential (which needs the lse loads back):
    e.g. 64+32 x9 at 4 splits (BLOCK_S = 8), 15 of 18 loads before it under 3.9.0 and all 18 under
    3.6.0, where masking by the weights left 2 of 18 (compile_check.merge_load_order).  Checked at 4
    splits: at 64, 3.6.0 still issues every load first, while 3.9.0 leaves about half after it."""
    merges = [r for r in reports if r["kernel"] == "mla_decode_merge_kernel" and "BLOCK_S=8 " in r["config"]]
    assert len(merges) >= 10
    for report in merges:
        assert report["loads_before_exp"] > 2 * report["loads_after_exp"], report


def test_merge_load_order_counts_loads_around_the_first_exponential():
    from mla_decode_triton.compile_check import merge_load_order

    sass = """
        /*0040*/  LDG.E R2, desc[UR4][R2.64] ;
        /*0050*/  LDGSTS.E.128 [R7], desc[UR4][R4.64] ;
        /*0060*/  LDG.E.128 R8, desc[UR4][R6.64] ;
        /*0070*/  MUFU.EX2 R9, R9 ;
        /*0080*/  LDG.E.64 R10, desc[UR4][R12.64] ;
        /*0090*/  MUFU.EX2 R11, R11 ;
    """
    assert merge_load_order(sass) == (2, 1)  # cp.async (LDGSTS) is not a register load
    assert merge_load_order("LDG.E R2, desc[UR4][R2.64] ;") == (1, 0)  # no exponential at all


@pytest.mark.slow
def test_the_merge_waits_for_the_split_kernel_where_it_is_launched_early(reports):
    """On sm_90 the merge is a programmatic dependent launch (launcher.dependent_launch): every split
    kernel of these multi-split launches signals its dependents once and every merge waits once
    (griddepcontrol) before it reads a partial."""
    for report in reports:
        assert report["grid_dependency_ops"] == 1, report
