#!/usr/bin/env python
"""Benchmark the Triton MLA decode kernel against torch on a CUDA GPU; render the results as markdown.

What is measured, per (latent shape R+D, heads, batch, context), all in one run:
  * kernel time (`triton.testing.do_bench`, median; it flushes L2 between runs, so small caches are not
    served from L2) and its effective bandwidth: bytes of cache read (each cached token once) plus bytes
    of queries read, divided by the time.  Decode is memory-bound, so this is the figure of merit.
  * the copy bandwidth of this very size: a device-to-device copy of as many bytes as the case's cache
    (bytes read + written over time), timed the same way; the kernel's bandwidth is given as % of it.
    A 2 GiB copy at the start gives the device's large-copy bandwidth for the header.
  * the roofline: with many heads the products, not the bytes, bound the time (128 heads at 512+64 do
    ~240 flops per cache byte), so each row also gives the time bound max(bytes / copy bandwidth,
    flops / tensor-core peak) and the kernel's % of it (the peak is the datasheet dense bf16/fp16
    figure, known for H100/H200 only; otherwise the column is empty).
  * two torch baselines in the same run: "torch dense", a contiguous (unpaged) cache with matmuls in the
    cache dtype (optimistic: it skips paging), and the reference (`mla_decode_reference`: page gather +
    fp32 masked softmax), with the speed-up over each.
  * max |kernel - reference| of the output, so a fast but wrong kernel cannot go unnoticed.
  * inside a model step: a model decodes all its layers in one step, so the runtime's CUDA graph holds
    one decode call per layer back to back, each over its own layer's cache.  One call replayed alone
    also pays the graph launch and the GPU's ramp up and drain, a few µs that decide the small cases
    (a 12 MB cache is read in 3 µs).  So the memory-bound cases with caches up to STACK_MAX_LAYER_BYTES
    are also timed as STACK_LAYERS calls over as many distinct caches (together larger than L2) in one
    graph, per call, beside STACK_LAYERS copies of the same bytes in one graph.
  * autotuning: per shape, every candidate tile (`mla_decode_triton.configs`) is timed once at batch 64,
    context 4096 (`mla_decode_triton.autotune`, replayed from a CUDA graph); the winner is used for every case of the shape, and the
    timings are kept in the JSON (`--write-tuned-table` turns them into the shipped table).  The table is
    keyed by page size, and `mla-convert generate` decodes with pages of RUNTIME_PAGE_SIZE (16), not
    the 64 timed here, so after the cases every shape is tuned once more at the runtime's page size
    (`--also-tune-page-size`; last, because a run cut short by the time budget should lose it first).
  * a split-count sweep: per shape at batch 16 and 64, context 4096, the tuned tile timed at several
    split counts (replayed from a CUDA graph) beside the launcher's own choice (`launcher.splits_for_gpu`, sized in whole waves from
    the compiled kernel's programs per multiprocessor), which shows whether its cost model picks well.

All sequences of a case have the full context (uniform lengths) so the dense baseline needs no masks.

On the GPU (part of scripts/device_kernel_check.sh; ~2 minutes on an H200):
    TRITON_INTERPRET=0 python scripts/bench_mla_decode.py --json OUT/bench.json --markdown OUT/bench.md
Back here, render the device's JSON into BENCHMARKS.md (and, if wanted, ship the tuned tiles):
    python scripts/bench_mla_decode.py --from-json OUT/bench.json --write-benchmarks BENCHMARKS.md \
        [--write-tuned-table]
Without CUDA the script exits with a message, except with --dry-run, which runs every step at a tiny
scale on CPU with the kernel under the Triton interpreter (plumbing check).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks_md import recorded_command, write_heading_section  # noqa: E402

SECTION_TITLE = "## MLA decode kernel (GPU)"
# (R, D, heads): DeepSeek-V2/V3's 512+64 with 16 and 128 heads, and SmolLM2-135M's 2x / 4x conversions.
LATENT_SHAPES = [(512, 64, 16), (512, 64, 128), (144, 48, 9), (64, 32, 9)]
BATCHES = [1, 16, 64, 128]
CONTEXTS = [1024, 4096, 16384]
TUNE_BATCH, TUNE_CONTEXT = 64, 4096
RUNTIME_PAGE_SIZE = 16  # mla_convert.runtime's DEFAULT_PAGE_SIZE (tests/test_mla_decode_bench.py keeps them equal)
SWEEP_BATCHES, SWEEP_CONTEXT, SWEEP_SPLITS = (16, 64), 4096, (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)
DRY_SWEEP_SPLITS = (1, 2, 3)
DRY_BATCHES = [1, 2]
DRY_CONTEXTS = [16, 40]
LARGE_COPY_BYTES = 2 * 1024**3
# Dense bf16/fp16 tensor-core peaks (TFLOP/s, no sparsity) from the datasheets, for the roofline column.
TENSOR_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "H20": 148.0}
# Largest |kernel - reference| accepted before a row is flagged: the kernel rounds softmax probabilities
# to the cache dtype (see tests/test_mla_decode_kernel.py), so a few ulps of bf16/fp16 around O(1).
ERROR_LIMIT = {"bf16": 5e-2, "fp16": 1e-2}
MEMORY_BOUND = dict(min_batch=16, min_context=4096)  # the regime of the >= 70 % of copy target
STACK_LAYERS = 30  # decode calls in one graph for "inside a model step" (SmolLM2-135M has 30 layers)
STACK_MAX_LAYER_BYTES = 128 * 1024**2  # ... measured for caches up to this size (30 of them: <= 3.75 GiB)
DRY_STACK_LAYERS = 2


def parse_shape(text: str) -> tuple[int, int, int]:
    """'512+64x128' -> (512, 64, 128): latent rank, RoPE width, query heads."""
    match = re.fullmatch(r"(\d+)\+(\d+)x(\d+)", text.strip())
    if not match or min(int(value) for value in match.groups()) < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a shape R+DxH of positive numbers (e.g. 512+64x128)")
    return tuple(int(value) for value in match.groups())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON (after every case)")
    parser.add_argument("--markdown", type=Path, metavar="PATH", help="write the rendered markdown body")
    parser.add_argument("--from-json", type=Path, metavar="PATH", help="render an earlier run's JSON (no GPU needed)")
    parser.add_argument("--write-benchmarks", type=Path, metavar="PATH",
                        help=f"replace or append the '{SECTION_TITLE}' section of this markdown file")
    parser.add_argument("--write-tuned-table", action="store_true",
                        help="with --from-json: store the tuned tiles as mla_decode_triton/tuned_configs.json")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes on CPU (kernel under the Triton interpreter): checks the plumbing only")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="cache and query dtype")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--also-tune-page-size", type=int, default=RUNTIME_PAGE_SIZE, metavar="N",
                        help="after the cases, tune every shape again with pages of N, so that the tuned table "
                             f"also covers that page size (default {RUNTIME_PAGE_SIZE}: the runtime's); "
                             "0, or N equal to --page-size: no second pass")
    parser.add_argument("--shapes", type=parse_shape, nargs="+", metavar="R+DxH",
                        help="latent shapes as rank+rope x heads, e.g. 512+64x64 (default: "
                             + " ".join(f"{r}+{d}x{h}" for r, d, h in LATENT_SHAPES) + ")")
    parser.add_argument("--batches", type=int, nargs="+", help=f"default {BATCHES}")
    parser.add_argument("--contexts", type=int, nargs="+", help=f"default {CONTEXTS}")
    parser.add_argument("--no-reference", action="store_true", help="skip timing the (slow) reference")
    parser.add_argument("--no-autotune", action="store_true", help="use the launcher's default tiles")
    parser.add_argument("--rep-ms", type=int, default=20, help="do_bench measuring time per timing")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds after which no new case is started (the rest is listed as skipped)")
    args = parser.parse_args(argv)
    if args.page_size < 1:
        parser.error("--page-size must be at least 1")
    if args.also_tune_page_size < 0:
        parser.error("--also-tune-page-size must be 0 (off) or a page size")
    if args.write_tuned_table and not args.from_json:
        parser.error("--write-tuned-table needs --from-json")
    if args.from_json and not args.from_json.is_file():
        parser.error(f"--from-json {args.from_json}: no such file")
    args.command = recorded_command(__file__, argv, parser)
    return args


# ----------------------------------------------------------------------------------------- measuring
def build_paged_inputs(torch, rank, rope_dim, heads, batch, context, page_size, dtype, device, seed=0):
    """Random queries and a paged cache with every sequence at full context, physical pages shuffled.

    Built directly on the device (no per-page Python loop), so the 2.4 GB caches of the largest cases
    take milliseconds.  Returns (q_latent, q_rope, kv_cache, page_table, seq_lens, softmax_scale).
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq
    width = rank + rope_dim
    kv_cache = torch.randn((num_pages, page_size, width), generator=generator, device=device, dtype=dtype)
    order = torch.randperm(num_pages, generator=generator, device=device)
    page_table = order.to(torch.int32).reshape(batch, pages_per_seq)  # (batch, pages_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q_latent = torch.randn((batch, heads, rank), generator=generator, device=device, dtype=dtype)
    q_rope = torch.randn((batch, heads, rope_dim), generator=generator, device=device, dtype=dtype)
    return q_latent, q_rope, kv_cache, page_table, seq_lens, width**-0.5


def make_dense_torch_decode(torch, kv_cache, page_table, context: int, rank: int):
    """The torch baseline: gather the pages once (untimed) into a contiguous cache, then per call
    two batched matmuls in the cache dtype with an fp32 softmax.  All sequences are full length."""
    batch = page_table.shape[0]
    width = kv_cache.shape[-1]
    dense = kv_cache[page_table.long()].reshape(batch, -1, width)[:, :context]  # (batch, context, R + D)
    dense = dense.contiguous()
    latent = dense[..., :rank]  # (batch, context, R)

    def decode(q_latent, q_rope, softmax_scale):
        query = torch.cat([q_latent, q_rope], dim=-1)  # (batch, heads, R + D)
        scores = torch.bmm(query, dense.transpose(1, 2)).float() * softmax_scale  # (batch, heads, context)
        lse = torch.logsumexp(scores, dim=-1)  # (batch, heads)
        probs = torch.exp(scores - lse[..., None]).to(dense.dtype)
        return torch.bmm(probs, latent), lse  # (batch, heads, R)

    return decode


def time_ms(fn, on_cuda: bool, rep_ms: int) -> float:
    from mla_decode_triton.autotune import time_ms as measured

    return measured(fn, on_cuda, rep_ms)


def gpu_time_ms(fn, on_cuda: bool, rep_ms: int) -> float:
    from mla_decode_triton.autotune import gpu_time_ms as measured

    return measured(fn, on_cuda, rep_ms)


def graph_time_ms(fn, rep_ms: int) -> float:
    """Time of `fn` replayed from a CUDA graph (L2 still flushed between runs): the GPU's own time.

    Eager timings of small cases measure Python launch work (argument checks, config lookup, two launches)
    while the GPU idles; a serving runtime replays decode steps as graphs (ours does).
    """
    from mla_decode_triton.autotune import graph_time_ms as replayed

    return replayed(fn, rep_ms)


def copy_ms(torch, size: int, device, on_cuda: bool, rep_ms: int, graph: bool = False) -> float:
    """Time of a device-to-device copy of `size` bytes (read once, written once)."""
    source = torch.empty(size, dtype=torch.uint8, device=device)
    source.random_(0, 255)
    target = torch.empty_like(source)
    if graph:
        return graph_time_ms(lambda: target.copy_(source), rep_ms)
    return time_ms(lambda: target.copy_(source), on_cuda, rep_ms)  # both freed on return


def stacked_times_ms(torch, mla, rank, rope_dim, heads, batch, context, args, dtype, device, config, on_cuda,
                     layers: int, cache_bytes: int) -> tuple[float, float]:
    """Per call: `layers` decode calls over as many distinct caches in one graph, and as many copies.

    Each layer gets its own cache, queries and page table (seeds 1..layers), as in a model, so no call
    finds its cache in L2 after the one before; the copies each move one cache's `cache_bytes`.  Returns
    (kernel ms, copy ms), each the graph's time divided by `layers`.
    """
    def decode_every_layer(stack):
        for inputs in stack:
            mla.mla_decode(*inputs, config=config)

    stack = [build_paged_inputs(torch, rank, rope_dim, heads, batch, context, args.page_size, dtype, device,
                                seed=layer + 1) for layer in range(layers)]
    kernel = gpu_time_ms(functools.partial(decode_every_layer, stack), on_cuda, args.rep_ms) / layers
    del stack  # freed before the copies' buffers are allocated
    pairs = [(torch.empty(cache_bytes, dtype=torch.uint8, device=device).random_(0, 255),
              torch.empty(cache_bytes, dtype=torch.uint8, device=device)) for _ in range(layers)]

    def copy_every_layer():
        for source, target in pairs:
            target.copy_(source)

    return kernel, gpu_time_ms(copy_every_layer, on_cuda, args.rep_ms) / layers


def measures_stack(batch: int, context: int, cache_bytes: int, dry_run: bool) -> bool:
    """Whether a case is also timed inside a model step: memory-bound, small enough (every case in a dry run)."""
    return dry_run or (batch >= MEMORY_BOUND["min_batch"] and context >= MEMORY_BOUND["min_context"]
                       and cache_bytes <= STACK_MAX_LAYER_BYTES)


def tune_shape(torch, mla, rank, rope_dim, heads, args, dtype, device, page_size: int) -> dict:
    """Time every candidate tile of this shape at the tuning workload; the autotuner remembers the best."""
    from mla_decode_triton import autotune

    batch, context = (TUNE_BATCH, TUNE_CONTEXT) if not args.dry_run else (2, 40)
    inputs = build_paged_inputs(torch, rank, rope_dim, heads, batch, context, page_size, dtype, device)
    result = autotune.autotune(*inputs, rep_ms=args.rep_ms)
    default = mla.candidate_tiles(rank, rope_dim, heads, dtype)[0]
    workload = f"batch {batch}, context {context}" + (f", pages of {page_size}" if page_size != args.page_size else "")
    return dict(shape=f"{rank}+{rope_dim} x{heads}", key=result.key, workload=workload, page_size=page_size,
                best=result.best.label(), best_tile=vars(result.best), default=default.label(),
                times_ms=result.times_ms, splits=result.splits)


def sweep_splits(torch, mla, rank, rope_dim, heads, batch, context, args, dtype, device, on_cuda, splits) -> dict:
    """Time the launcher's tile at each split count in `splits` and at the launcher's own choice."""
    inputs = build_paged_inputs(torch, rank, rope_dim, heads, batch, context, args.page_size, dtype, device)
    q_latent, q_rope, kv_cache, page_table, seq_lens, _ = inputs
    shape = mla.inputs.check_decode_inputs(q_latent, q_rope, kv_cache, page_table, seq_lens, None)
    mla.mla_decode(*inputs, max_seq_len=context, mean_seq_len=context)  # compiles; records the residency
    chosen = mla.choose_config(shape, dtype, kv_cache.device, max_seq_len=context, mean_seq_len=context)
    times = {}
    for count in sorted({*splits, chosen.num_splits}):
        config = dataclasses.replace(chosen, num_splits=count)
        # replayed from a graph: eagerly, the host's launch work (100-370 µs on the H200 of 2026-12-04)
        # hid the differences between counts
        times[str(count)] = gpu_time_ms(lambda config=config: mla.mla_decode(*inputs, config=config), on_cuda,
                                        args.rep_ms)
    # the launcher's step in its parts: the split kernel alone and the merge alone (a merge took 15-17 µs of
    # a 20-46 µs step at 16 splits on the H200, 2026-12-04, before it read all splits at once)
    launches, _, _ = mla.launcher.plan_launches(q_latent, q_rope, kv_cache, page_table, seq_lens, inputs[-1], shape,
                                                chosen, q_latent.dtype)
    parts = {"split": gpu_time_ms(launches[0].run, on_cuda, args.rep_ms)}
    if len(launches) > 1:
        parts["merge"] = gpu_time_ms(launches[1].run, on_cuda, args.rep_ms)
    if len(launches) > 1 and launches[1].launch_pdl:  # the same step with the merge launched the plain way
        plain, _, _ = mla.launcher.plan_launches(q_latent, q_rope, kv_cache, page_table, seq_lens, inputs[-1], shape,
                                                 chosen, q_latent.dtype, pdl=False)
        parts["step_without_pdl"] = gpu_time_ms(lambda: [launch.run() for launch in plain], on_cuda, args.rep_ms)
    return dict(shape=f"{rank}+{rope_dim} x{heads}", batch=batch, context=context, tile=chosen.tile.label(),
                programs_per_sm=mla.launcher.resident_programs(kv_cache.device, shape, dtype, chosen.tile)
                if on_cuda else None, chosen=chosen.num_splits, times_ms=times, parts_ms=parts)


def run_case(torch, mla, rank, rope_dim, heads, batch, context, args, dtype, device, on_cuda) -> dict:
    inputs = build_paged_inputs(torch, rank, rope_dim, heads, batch, context, args.page_size, dtype, device)
    q_latent, q_rope, kv_cache, page_table, seq_lens, scale = inputs
    shape = mla.inputs.check_decode_inputs(q_latent, q_rope, kv_cache, page_table, seq_lens, None)
    # a first call compiles the tile and (on CUDA) records its programs per multiprocessor, which the
    # split count of the measured configuration uses
    mla.mla_decode(*inputs, max_seq_len=context, mean_seq_len=context)
    config = mla.choose_config(shape, dtype, kv_cache.device, max_seq_len=context, mean_seq_len=context)
    resident = mla.launcher.resident_programs(kv_cache.device, shape, dtype, config.tile)
    out, _ = mla.mla_decode(*inputs, config=config)
    ref_out, _ = mla.mla_decode_reference(*inputs)
    max_error = (out.float() - ref_out.float()).abs().max().item()
    del ref_out, out
    element = kv_cache.element_size()
    cache_bytes = batch * context * (rank + rope_dim) * element
    row = dict(rank=rank, rope_dim=rope_dim, heads=heads, batch=batch, context=context,
               config=dict(tile=config.tile.label(), splits=config.num_splits, min_split_tokens=config.min_split_tokens,
                           programs_per_sm=resident if on_cuda else None),
               bytes=cache_bytes + batch * heads * (rank + rope_dim) * element,
               flops=2 * batch * heads * context * (2 * rank + rope_dim), max_error=max_error)
    row["kernel_ms"] = time_ms(lambda: mla.mla_decode(*inputs, config=config), on_cuda, args.rep_ms)
    row["copy_ms"] = copy_ms(torch, cache_bytes, device, on_cuda, args.rep_ms)
    dense_decode = make_dense_torch_decode(torch, kv_cache, page_table, context, rank)
    row["dense_ms"] = time_ms(lambda: dense_decode(q_latent, q_rope, scale), on_cuda, args.rep_ms)
    if on_cuda:  # the same three, replayed from CUDA graphs (launch overhead out)
        try:
            row["kernel_graph_ms"] = graph_time_ms(lambda: mla.mla_decode(*inputs, config=config), args.rep_ms)
            row["copy_graph_ms"] = copy_ms(torch, cache_bytes, device, on_cuda, args.rep_ms, graph=True)
            row["dense_graph_ms"] = graph_time_ms(lambda: dense_decode(q_latent, q_rope, scale), args.rep_ms)
        except Exception as error:  # a capture that fails is reported, the eager numbers stay
            row["graph_error"] = f"{type(error).__name__}: {error}"[:200]
    if measures_stack(batch, context, cache_bytes, args.dry_run):
        layers = DRY_STACK_LAYERS if args.dry_run else STACK_LAYERS
        try:
            row["kernel_stack_ms"], row["copy_stack_ms"] = stacked_times_ms(
                torch, mla, rank, rope_dim, heads, batch, context, args, dtype, device, config, on_cuda, layers,
                cache_bytes)
            row["stack_layers"] = layers
        except Exception as error:  # reported; the single-call numbers stay
            row["stack_error"] = f"{type(error).__name__}: {error}"[:200]
    row["reference_ms"] = None
    if not args.no_reference:
        row["reference_ms"] = time_ms(lambda: mla.mla_decode_reference(*inputs), on_cuda, args.rep_ms)
    return row


# ----------------------------------------------------------------------------------------- rendering
def _peak_tflops(device_name: str) -> float | None:
    for name, peak in TENSOR_PEAK_TFLOPS.items():
        if re.search(rf"\b{name}\b", device_name):
            return peak
    return None


def format_table(results: dict) -> str:
    meta = results["meta"]
    peak = meta.get("tensor_peak_tflops")
    header = (
        "| R+D | heads | batch | context | tile, splits | kernel µs | GB/s | % of copy | % of roofline | TFLOP/s "
        "| torch dense µs | speed-up | reference µs | speed-up | graph: kernel µs | graph: % of copy "
        "| graph: torch dense µs | max abs err |\n"
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for r in sorted(results["cases"], key=lambda r: (-r["rank"], r["heads"], r["batch"], r["context"])):
        if "error" in r:
            lines.append(f"| {r['rank']}+{r['rope_dim']} | {r['heads']} | {r['batch']} | {r['context']} "
                         f"| failed: {r['error']} |" + " |" * 10)
            continue
        seconds = r["kernel_ms"] * 1e-3
        bandwidth = r["bytes"] / seconds
        copy_bandwidth = 2 * (r["bytes"]) / (r["copy_ms"] * 1e-3)  # copy moves its bytes twice
        roofline = "-"
        if peak:
            bound = max(r["bytes"] / copy_bandwidth, r["flops"] / (peak * 1e12))
            roofline = f"{100 * bound / seconds:.0f}%"
        reference = "-" if r["reference_ms"] is None else f"{r['reference_ms'] * 1e3:.1f}"
        reference_speedup = "-" if r["reference_ms"] is None else f"{r['reference_ms'] / r['kernel_ms']:.1f}x"
        flag = "" if r["max_error"] <= ERROR_LIMIT[meta["dtype"]] else " **too large**"
        lines.append(
            f"| {r['rank']}+{r['rope_dim']} | {r['heads']} | {r['batch']} | {r['context']} "
            f"| {r['config']['tile']}, s{r['config']['splits']} | {r['kernel_ms'] * 1e3:.1f} | {bandwidth / 1e9:.0f} "
            f"| {100 * bandwidth / copy_bandwidth:.0f}% | {roofline} | {r['flops'] / seconds / 1e12:.1f} "
            f"| {r['dense_ms'] * 1e3:.1f} | {r['dense_ms'] / r['kernel_ms']:.1f}x | {reference} | {reference_speedup} "
            f"| {_graph_cells(r)} | {r['max_error']:.1e}{flag} |"
        )
    return header + "\n".join(lines) + "\n"


def _graph_cells(r: dict) -> str:
    if "kernel_graph_ms" not in r:
        return "- | - | -"
    percent = _percent_of_copy(r, "kernel_graph_ms", "copy_graph_ms")
    return f"{r['kernel_graph_ms'] * 1e3:.1f} | {percent:.0f}% | {r['dense_graph_ms'] * 1e3:.1f}"


def _percent_of_copy(r: dict, kernel_key: str = "kernel_ms", copy_key: str = "copy_ms") -> float | None:
    """The kernel's bandwidth (r["bytes"] read) as % of a copy of as many bytes (read + written), timed alike."""
    kernel, copy = r.get(kernel_key), r.get(copy_key)
    return None if kernel is None else 100 * (r["bytes"] / kernel) / (2 * r["bytes"] / copy)


def _percent_of_large_copy(r: dict, kernel_ms: float, large_gbps: float) -> float:
    """The kernel's bandwidth at `kernel_ms` as % of the large copy's (the run's meta large_copy_gbps)."""
    return 100 * r["bytes"] / (kernel_ms * 1e-3) / 1e9 / large_gbps


def memory_bound_summary(results: dict) -> str:
    """Worst and median % of copy per shape over the memory-bound cases (batch >= 16, context >= 4K)."""
    lines = ["| R+D | heads | cases | min % of copy | median % of copy | median speed-up vs torch dense "
             "| graph: min % of copy | graph: median % of copy | graph: min % of large copy "
             "| graph: median % of large copy | graph: median speed-up |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    large_gbps = results["meta"]["large_copy_gbps"]
    shapes = sorted({(r["rank"], r["rope_dim"], r["heads"]) for r in results["cases"] if "error" not in r},
                    key=lambda s: (-s[0], s[2]))
    for rank, rope_dim, heads in shapes:
        rows = [r for r in results["cases"] if "error" not in r and (r["rank"], r["rope_dim"], r["heads"]) ==
                (rank, rope_dim, heads) and r["batch"] >= MEMORY_BOUND["min_batch"]
                and r["context"] >= MEMORY_BOUND["min_context"]]
        if not rows:
            continue
        percent = [_percent_of_copy(r) for r in rows]
        speedup = [r["dense_ms"] / r["kernel_ms"] for r in rows]
        graphed = [r for r in rows if "kernel_graph_ms" in r]
        graph_cells = "- | - | - | - | -"
        if graphed:
            graph_percent = [_percent_of_copy(r, "kernel_graph_ms", "copy_graph_ms") for r in graphed]
            # against the 2 GiB copy's bandwidth: captured copies of 1-2 GB ran up to 1.5x slower than
            # eager ones on the H200 (2026-12-04), which lifts "% of copy" past 100 % there
            large_percent = [_percent_of_large_copy(r, r["kernel_graph_ms"], large_gbps) for r in graphed]
            graph_speedup = [r["dense_graph_ms"] / r["kernel_graph_ms"] for r in graphed]
            graph_cells = (f"{min(graph_percent):.0f}% | {statistics.median(graph_percent):.0f}% "
                           f"| {min(large_percent):.0f}% | {statistics.median(large_percent):.0f}% "
                           f"| {statistics.median(graph_speedup):.1f}x")
        lines.append(f"| {rank}+{rope_dim} | {heads} | {len(rows)} | {min(percent):.0f}% "
                     f"| {statistics.median(percent):.0f}% | {statistics.median(speedup):.1f}x | {graph_cells} |")
    return "\n".join(lines) + "\n"


def stack_table(results: dict) -> str:
    """The cases timed inside a model step (`stacked_times_ms`): per call, against one call alone."""
    rows = [r for r in results["cases"] if "kernel_stack_ms" in r]
    if not rows:
        return ""
    large_gbps = results["meta"]["large_copy_gbps"]
    lines = ["| R+D | heads | batch | context | calls in the graph | one call alone µs | in a step: µs per call "
             "| one call alone: % of large copy | in a step: % of large copy | in a step: % of copy |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (-r["rank"], r["heads"], r["batch"], r["context"])):
        alone = r.get("kernel_graph_ms")
        alone_us, alone_percent = ("-", "-") if alone is None else (
            f"{alone * 1e3:.1f}", f"{_percent_of_large_copy(r, alone, large_gbps):.0f}%")
        same_bytes = _percent_of_copy(r, "kernel_stack_ms", "copy_stack_ms")
        lines.append(f"| {r['rank']}+{r['rope_dim']} | {r['heads']} | {r['batch']} | {r['context']} "
                     f"| {r['stack_layers']} | {alone_us} | {r['kernel_stack_ms'] * 1e3:.1f} | {alone_percent} "
                     f"| {_percent_of_large_copy(r, r['kernel_stack_ms'], large_gbps):.0f}% | {same_bytes:.0f}% |")
    lines += ["", "| R+D | heads | cases | in a step: min % of large copy | in a step: median % of large copy |",
              "|---|---:|---:|---:|---:|"]
    for rank, rope_dim, heads in sorted({(r["rank"], r["rope_dim"], r["heads"]) for r in rows},
                                        key=lambda s: (-s[0], s[2])):
        percent = [_percent_of_large_copy(r, r["kernel_stack_ms"], large_gbps) for r in rows
                   if (r["rank"], r["rope_dim"], r["heads"]) == (rank, rope_dim, heads)]
        lines.append(f"| {rank}+{rope_dim} | {heads} | {len(percent)} | {min(percent):.0f}% "
                     f"| {statistics.median(percent):.0f}% |")
    return "\n".join(lines) + "\n"


def tuning_table(results: dict) -> str:
    if not results.get("tuning"):
        return ""
    lines = ["| shape | workload | candidate tile | splits | µs | |", "|---|---|---|---:|---:|---|"]
    for entry in results["tuning"]:
        if "error" in entry:
            lines.append(f"| {entry['shape']} | | failed: {entry['error']} | | | |")
            continue
        for label, ms in sorted(entry["times_ms"].items(), key=lambda item: item[1]):
            marks = ", ".join(m for m, on in (("chosen", label == entry["best"]), ("default", label == entry["default"]))
                              if on)
            lines.append(f"| {entry['shape']} | {entry['workload']} | {label} | {entry['splits'][label]} "
                         f"| {ms * 1e3:.1f} | {marks} |")
    return "\n".join(lines) + "\n"


def split_sweep_table(results: dict) -> str:
    """Per swept workload: the launcher's split count and time against the fastest count measured."""
    lines = ["| shape | batch | context | tile | programs / SM | launcher's splits | µs | split kernel µs | merge µs "
             "| without PDL µs | fastest splits | µs | launcher / fastest | every count: µs |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for entry in results.get("split_sweep", []):
        if "error" in entry:
            lines.append(f"| {entry['shape']} | {entry['batch']} | {entry['context']} | failed: {entry['error']} "
                         "|" + " |" * 10)
            continue
        times = {int(count): ms for count, ms in entry["times_ms"].items()}
        fastest = min(times, key=times.get)
        chosen = entry["chosen"]
        every = ", ".join(f"{count}: {ms * 1e3:.0f}" for count, ms in sorted(times.items()))
        resident = "-" if entry.get("programs_per_sm") is None else entry["programs_per_sm"]
        # runs before 2026-12-04 did not time the parts, nor (before the merge was a programmatic
        # dependent launch) the step without it
        parts = entry.get("parts_ms", {})
        split_us, merge_us, plain_us = (f"{parts[name] * 1e3:.1f}" if name in parts else "-"
                                        for name in ("split", "merge", "step_without_pdl"))
        lines.append(f"| {entry['shape']} | {entry['batch']} | {entry['context']} | {entry['tile']} | {resident} "
                     f"| {chosen} | {times[chosen] * 1e3:.1f} | {split_us} | {merge_us} | {plain_us} | {fastest} "
                     f"| {times[fastest] * 1e3:.1f} "
                     f"| {times[chosen] / times[fastest]:.2f} | {every} |")
    return "\n".join(lines) + "\n"


def render(results: dict) -> str:
    meta = results["meta"]
    peak = f" = {meta['tensor_peak_tflops']:.0f} TFLOP/s" if meta.get("tensor_peak_tflops") else ""
    body = (
        f"Produced by `{meta['command']}` on {meta['device']} ({meta['date']}; torch {meta['torch']}, "
        f"triton {meta['triton']}); {meta['dtype']} cache, page size {meta['page_size']}, every sequence at full "
        f"context, times are do_bench medians with L2 flushed.  Large-copy bandwidth "
        f"({meta.get('large_copy_bytes', 2 * 1024**3) / 1024**3:.3g} GiB device-to-device, "
        f"bytes read + written / time): {meta['large_copy_gbps']:.0f} GB/s.\n\n"
        "Kernel GB/s counts the cache bytes (each token once; payload R + D values, these caches have no row "
        "padding) plus the query bytes; **% of copy** compares it "
        "with a device-to-device copy of the same number of bytes timed the same way; **% of roofline** "
        "compares the time with max(bytes / copy bandwidth, flops / dense tensor-core peak"
        f"{peak}): with 128 "
        "heads at 512+64 the products, not the bytes, bound the time.  Tile: rows per program (H), R split "
        "(r), tokens per tile (N), warps (w), stages (st); s = splits.  **graph** columns: the same kernel, "
        "copy and torch dense replayed from a CUDA graph (as the runtime decodes), so host launch work is out "
        "of the time; the eager columns include it; **% of large copy** compares the graph time's bandwidth with "
        "the large copy's above (captured copies of 1-2 GB can run slower than that, which lifts % of copy).\n\n"
        "Memory-bound regime (batch >= 16, context >= 4K), target >= 70 % of copy:\n\n"
        + memory_bound_summary(results) + "\nAll cases:\n\n" + format_table(results)
    )
    stacked = stack_table(results)
    if stacked:
        body += ("\nInside a model step: a model's decode step calls the kernel once per layer, each over its own "
                 "layer's cache, all in one CUDA graph.  So the memory-bound cases with caches up to "
                 f"{STACK_MAX_LAYER_BYTES // 1024**2} MB (in a --dry-run: every case) are also timed as several "
                 "calls (column \"calls in the graph\") over as many distinct caches, together larger than L2, "
                 "in one graph, per call.  One call replayed alone (the graph columns above) also pays the graph's "
                 "launch and the GPU's ramp up and drain.  **% of copy** here compares with as many copies of "
                 "the same bytes in one graph:\n\n" + stacked)
    failed = [f"{r['rank']}+{r['rope_dim']} x{r['heads']} b{r['batch']} ctx{r['context']} ({r['stack_error']})"
              for r in results["cases"] if "stack_error" in r]
    if failed:
        body += "\nNot timed inside a model step (failed): " + "; ".join(failed) + ".\n"
    # runs before 2026-12-04 timed tuning and sweeps eagerly (host launch work included); the JSON says which
    timer = ("replayed from a CUDA graph" if meta.get("tuning_timer") == "graph"
             else "eager launches, host launch work included")
    if results.get("tuning"):
        body += ("\nAutotuning (`mla_decode_triton.autotune`, every candidate tile timed once per shape, "
                 f"{timer}):\n\n")
        body += tuning_table(results)
    if results.get("split_sweep"):
        body += ("\nSplit counts (`launcher.splits_for_gpu`: whole waves from the compiled kernel's programs per "
                 f"multiprocessor) against the fastest count measured, same tile, {timer}; the launcher's step also "
                 "timed in its parts, the split kernel alone and the merge alone (each with its own launch), and, "
                 "where the merge is a programmatic dependent launch (sm_90+), the step with a plain launch:\n\n")
        body += split_sweep_table(results)
    if results.get("skipped"):
        body += f"\nSkipped (time budget): {', '.join(results['skipped'])}.\n"
    body += f"\nTotal benchmark wall time: {meta.get('wall_s', 0):.0f} s.\n"
    return body


def write_section(path: Path, body: str) -> None:
    """Replace this script's section of BENCHMARKS.md (heading to the next heading or marker), or append it."""
    write_heading_section(path, SECTION_TITLE, f"{SECTION_TITLE}\n\n{body.rstrip()}\n")


def write_tuned_table(results: dict, path: Path | None = None) -> Path:
    """Store the measured winners in the package's table (mla_decode_triton/tuned_configs.json by default)."""
    from mla_decode_triton.configs import TABLE_PATH, TileConfig, load_table, save_table

    path = TABLE_PATH if path is None else path
    table = load_table(path)
    for entry in results.get("tuning", []):
        if "best_tile" in entry:
            table[entry["key"]] = TileConfig(**entry["best_tile"])
    meta = results["meta"]
    save_table(table, f"{meta['device']}, {meta['date']}, torch {meta['torch']}, triton {meta['triton']}, "
               f"scripts/bench_mla_decode.py at batch {TUNE_BATCH}, context {TUNE_CONTEXT}", path)
    return path


# ----------------------------------------------------------------------------------------- main
def _save(results: dict, args) -> None:
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


def measure(args, argv) -> dict:
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    on_cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    if not on_cuda and not args.dry_run:
        reason = "no CUDA device" if not torch.cuda.is_available() else "TRITON_INTERPRET is set"
        raise SystemExit(f"bench_mla_decode: needs a CUDA GPU with compiled Triton kernels ({reason}); "
                         "use --dry-run for a CPU plumbing check, or --from-json to render a GPU run")
    import mla_decode_triton as mla
    import mla_decode_triton.inputs  # noqa: F401  (mla.inputs.check_decode_inputs)
    import mla_decode_triton.launcher  # noqa: F401  (mla.launcher.resident_programs)
    import triton

    device = torch.device("cuda" if on_cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    batches = args.batches or (DRY_BATCHES if args.dry_run else BATCHES)
    contexts = args.contexts or (DRY_CONTEXTS if args.dry_run else CONTEXTS)
    if args.dry_run:
        args.page_size = min(args.page_size, 16)
    started = time.perf_counter()
    device_name = torch.cuda.get_device_name(device) if on_cuda else "CPU (dry run, Triton interpreter)"
    large = LARGE_COPY_BYTES if on_cuda else 8 * 1024**2
    command = args.command
    results = dict(
        meta=dict(device=device_name, date=datetime.date.today().isoformat(), torch=torch.__version__,
                  triton=triton.__version__, dtype=args.dtype, page_size=args.page_size, command=command,
                  large_copy_bytes=large,
                  large_copy_gbps=2 * large / (copy_ms(torch, large, device, on_cuda, args.rep_ms) * 1e-3) / 1e9,
                  tensor_peak_tflops=_peak_tflops(device_name) if on_cuda else None,
                  tuning_timer="graph" if on_cuda else "wall clock"),
        tuning=[], split_sweep=[], cases=[], skipped=[],
    )
    print(f"# {device_name}: large-copy bandwidth {results['meta']['large_copy_gbps']:.0f} GB/s", file=sys.stderr)
    shapes = [(r, d, h if not args.dry_run else min(h, 3)) for r, d, h in (args.shapes or LATENT_SHAPES)]

    def out_of_time() -> bool:
        return args.time_budget is not None and time.perf_counter() - started > args.time_budget

    def tune_all(page_size: int) -> None:
        for rank, rope_dim, heads in shapes:
            pages = f" (pages of {page_size})" if page_size != args.page_size else ""
            if out_of_time():
                results["skipped"].append(f"tuning {rank}+{rope_dim} x{heads}{pages}")
                continue
            try:
                entry = tune_shape(torch, mla, rank, rope_dim, heads, args, dtype, device, page_size)
            except Exception as error:  # report and go on: the launcher's default tile is then used
                entry = dict(shape=f"{rank}+{rope_dim} x{heads}", page_size=page_size,
                             error=f"{type(error).__name__}: {error}"[:200])
            results["tuning"].append(entry)
            print(f"# tuned {entry['shape']}{pages}: {entry.get('best', entry.get('error'))}", file=sys.stderr)
            _save(results, args)

    if not args.no_autotune:
        tune_all(args.page_size)
    sweep_batches = DRY_BATCHES[-1:] if args.dry_run else SWEEP_BATCHES
    sweep_context = contexts[-1] if args.dry_run else SWEEP_CONTEXT
    split_counts = DRY_SWEEP_SPLITS if args.dry_run else SWEEP_SPLITS
    for (rank, rope_dim, heads), batch in [(shape, batch) for shape in shapes for batch in sweep_batches]:
        if out_of_time():
            results["skipped"].append(f"split sweep {rank}+{rope_dim} x{heads} b{batch}")
            continue
        try:
            entry = sweep_splits(torch, mla, rank, rope_dim, heads, batch, sweep_context, args, dtype, device, on_cuda,
                                 split_counts)
        except Exception as error:  # report and go on
            entry = dict(shape=f"{rank}+{rope_dim} x{heads}", batch=batch, context=sweep_context,
                         error=f"{type(error).__name__}: {error}"[:200])
        results["split_sweep"].append(entry)
        print(f"# split sweep {entry['shape']} b{batch}: chosen {entry.get('chosen', entry.get('error'))}",
              file=sys.stderr)
        _save(results, args)
    # The memory-bound cases (the 70 %-of-copy target) first, so that a run cut short by the time budget
    # loses the least informative cases; the table is sorted back afterwards.
    grid = [(shape, batch, context) for shape in shapes for batch in batches for context in contexts]
    grid.sort(key=lambda item: not (item[1] >= MEMORY_BOUND["min_batch"] and item[2] >= MEMORY_BOUND["min_context"]))
    for (rank, rope_dim, heads), batch, context in grid:
        label = f"{rank}+{rope_dim} x{heads} b{batch} ctx{context}"
        if out_of_time():
            results["skipped"].append(label)
            continue
        try:
            row = run_case(torch, mla, rank, rope_dim, heads, batch, context, args, dtype, device, on_cuda)
            print(f"# {label}: {row['kernel_ms'] * 1e3:.1f} us ({row['config']['tile']}, "
                  f"s{row['config']['splits']}), err {row['max_error']:.2g}", file=sys.stderr)
        except Exception as error:  # e.g. out of memory: report the case and go on
            row = dict(rank=rank, rope_dim=rope_dim, heads=heads, batch=batch, context=context,
                       error=f"{type(error).__name__}: {error}"[:200])
            print(f"# {label}: FAILED {row['error']}", file=sys.stderr)
        results["cases"].append(row)
        if on_cuda:
            torch.cuda.empty_cache()
        results["meta"]["wall_s"] = time.perf_counter() - started
        _save(results, args)
    order = {(shape, batch, context): index for index, (shape, batch, context) in
             enumerate((shape, b, c) for shape in shapes for b in batches for c in contexts)}
    results["cases"].sort(key=lambda r: order[((r["rank"], r["rope_dim"], r["heads"]), r["batch"], r["context"])])
    if not args.no_autotune and args.also_tune_page_size not in (0, args.page_size):
        tune_all(args.also_tune_page_size)  # for the shipped table's entries at the runtime's page size
    results["meta"]["wall_s"] = time.perf_counter() - started
    _save(results, args)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        results = json.loads(args.from_json.read_text())
    else:
        results = measure(args, argv)
    body = render(results)
    print(body)
    if args.markdown:
        args.markdown.write_text(body)
    if args.write_benchmarks:
        write_section(args.write_benchmarks, body)
        print(f"# wrote '{SECTION_TITLE}' to {args.write_benchmarks}", file=sys.stderr)
    if args.write_tuned_table:
        print(f"# wrote the tuned tiles to {write_tuned_table(results)}", file=sys.stderr)
    bad = [r for r in results["cases"] if "error" in r or r["max_error"] > ERROR_LIMIT[results["meta"]["dtype"]]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
