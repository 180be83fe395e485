"""Measure the candidate tiles of a decode shape on the device at hand and keep the fastest.

Why not `triton.autotune`: it times configs inside the first launch, which is the wrong moment twice
over - during CUDA-graph capture nothing may be timed, and under the Triton interpreter every config
would be timed in slow Python on every new key.  Here tuning is an explicit step: `autotune` times each
candidate of `configs.candidate_tiles` (all proven spill-free on sm_90 by `compile_check`) on the
caller's real inputs, checks that each gives the same output as the default tile, and records the
winner for the rest of the process (`configs.remember`); `scripts/bench_mla_decode.py` saves the
winners as the shipped table `tuned_configs.json`.  Setting MLA_DECODE_AUTOTUNE=1 makes `mla_decode`
tune each new shape key on its first CUDA call (never while a CUDA graph is being captured).

The timer is `triton.testing.do_bench` (median, L2 flushed between runs) on the candidate's launch
captured in a CUDA graph and replayed; under the interpreter it is the median of a few wall-clock runs,
which only exercises the machinery.  Why replayed: on the H200 of 2026-12-04 one eager launch cost the
host 100-370 µs (argument checks, config lookup, two launches, in Python) against 20-100 µs of GPU time
at the tuning workload, so eager timings ranked the host's noise, not the tiles (the same tile timed
146-374 µs in one split sweep); a decode step is replayed from a graph in the runtime too.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from mla_decode_triton.configs import TileConfig, candidate_tiles, remember, table_key
from mla_decode_triton.errors import MLADecodeInputError
from mla_decode_triton.inputs import DecodeShape, check_decode_inputs
from mla_decode_triton.launcher import (
    DecodeConfig,
    _check_runnable,
    _launch,
    choose_config,
)

ENV_FLAG = "MLA_DECODE_AUTOTUNE"
AGREEMENT = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}  # max |candidate - default|


@dataclass
class TuneResult:
    key: str
    best: TileConfig
    times_ms: dict[str, float] = field(default_factory=dict)  # tile label -> median ms
    splits: dict[str, int] = field(default_factory=dict)  # tile label -> split count used


def autotune_enabled(device: torch.device) -> bool:
    if os.environ.get(ENV_FLAG, "") in ("", "0", "false") or device.type != "cuda":
        return False
    return not torch.cuda.is_current_stream_capturing()


def time_ms(fn, on_cuda: bool, rep_ms: int) -> float:
    """Median milliseconds of `fn` called eagerly: do_bench (L2 flushed) on CUDA, three wall-clock runs elsewhere.

    On CUDA this includes the host's launch work whenever that is longer than the GPU's (graph_time_ms
    leaves it out).
    """
    if on_cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median"))
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def graph_time_ms(fn, rep_ms: int) -> float:
    """Median milliseconds of `fn` captured once in a CUDA graph and replayed (do_bench, L2 flushed).

    Only the GPU's time for the work remains, as when a runtime replays its decode step.  `fn` must not
    synchronise or allocate differently between calls; it is warmed up on a side stream first, as
    capture requires (the first call may compile).
    """
    import triton.testing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return float(triton.testing.do_bench(graph.replay, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median"))


def gpu_time_ms(fn, on_cuda: bool, rep_ms: int) -> float:
    """The GPU's own time for `fn`: replayed from a graph on CUDA, wall-clock runs elsewhere."""
    return graph_time_ms(fn, rep_ms) if on_cuda else time_ms(fn, on_cuda, rep_ms)


def config_for_tile(shape: DecodeShape, tile: TileConfig, cache_dtype: torch.dtype, device: torch.device,
                    max_seq_len: int | None = None, mean_seq_len: float | None = None) -> DecodeConfig:
    """The launcher's choice with this tile in place of its own (split count recomputed for the tile)."""
    from mla_decode_triton import launcher

    chosen = choose_config(shape, cache_dtype, device, None, max_seq_len, mean_seq_len)
    splits = chosen.num_splits
    if device.type == "cuda":
        element_size = torch.empty((), dtype=cache_dtype).element_size()
        splits = launcher.splits_for_gpu(shape, tile, element_size, launcher._multiprocessor_count(device.index or 0),
                                         max_seq_len, mean_seq_len,
                                         launcher.resident_programs(device, shape, cache_dtype, tile))
    return DecodeConfig.from_tile(tile, splits, chosen.min_split_tokens)


def autotune(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    *,
    max_seq_len: int | None = None,
    mean_seq_len: float | None = None,
    rep_ms: int = 30,
    q_len_dim: bool = False,
) -> TuneResult:
    """Time every candidate tile on these inputs (arguments as `mla_decode`); remember and return the best.

    Every candidate's output must agree with the default tile's (AGREEMENT), so a tile that computes
    something else can never win.
    """
    shape = check_decode_inputs(q_latent, q_rope, kv_cache, page_table, seq_lens, None, q_len_dim=q_len_dim)
    device = kv_cache.device
    _check_runnable(device)
    on_cuda = device.type == "cuda"
    rows_latent = q_latent.reshape(shape.batch, shape.rows, shape.kv_lora_rank)  # (batch, rows, R)
    rows_rope = q_rope.reshape(shape.batch, shape.rows, shape.rope_dim)  # (batch, rows, D)
    key = table_key(shape.kv_lora_rank, shape.rope_dim, shape.rows, shape.page_size, kv_cache.dtype)
    result = TuneResult(key=key, best=None)
    reference_out = None
    for tile in candidate_tiles(shape.kv_lora_rank, shape.rope_dim, shape.rows, kv_cache.dtype):

        def run(config):
            return _launch(rows_latent, rows_rope, kv_cache, page_table, seq_lens, softmax_scale, shape, config,
                           q_latent.dtype)

        # The first launch compiles the tile and, on CUDA, records its programs per multiprocessor,
        # which the split count of the timed configuration then uses.
        run(config_for_tile(shape, tile, kv_cache.dtype, device, max_seq_len, mean_seq_len))
        config = config_for_tile(shape, tile, kv_cache.dtype, device, max_seq_len, mean_seq_len)
        out, _ = run(config)
        if reference_out is None:
            reference_out = out
        else:
            error = (out.float() - reference_out.float()).abs().max().item()
            if not error <= AGREEMENT[kv_cache.dtype]:
                raise MLADecodeInputError(f"tile {tile.label()} disagrees with the default tile by {error:.3g}")
        result.times_ms[tile.label()] = gpu_time_ms(lambda config=config: run(config), on_cuda, rep_ms)
        result.splits[tile.label()] = config.num_splits
        if result.best is None or result.times_ms[tile.label()] < result.times_ms[result.best.label()]:
            result.best = tile
    remember(key, result.best)
    return result
