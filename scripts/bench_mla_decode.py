#!/usr/bin/env python
"""Benchmark the Triton MLA decode kernel against torch on a CUDA GPU; write a BENCHMARKS.md section.

What is measured, per (latent shape R+D, heads, batch, context):
  * kernel time (`triton.testing.do_bench`, median; it flushes L2 between runs, so small caches are
    not served from L2) and its effective bandwidth: bytes of cache read (each cached token once) plus
    bytes of queries read, divided by the time.  Decode is memory-bound, so this is the figure of merit;
    it is also given as a fraction of the device's measured copy bandwidth (a large device-to-device
    copy, bytes read + written over time), the practical ceiling.
  * TFLOP/s: 2 * batch * heads * context * (2R + D) flops (scores over R + D, values over R).
  * two torch baselines in the same run: "torch dense", a contiguous (unpaged) cache with matmuls in
    the cache dtype - the best plain torch can do, and optimistic since it skips paging - and the
    reference (`mla_decode_reference`: page gather + fp32 masked softmax), with the speed-up over each.
  * max |kernel - reference| of the output, so a fast but wrong kernel cannot go unnoticed.

All sequences of a case have the full context (uniform lengths) so the dense baseline needs no masks.

Usage (GPU; about 2-3 minutes on an H200):
    TRITON_INTERPRET=0 python scripts/bench_mla_decode.py --write-benchmarks BENCHMARKS.md
    python scripts/bench_mla_decode.py --sweep      # also time alternative launch configs (tuning aid)
Without CUDA the script exits with a message, except with --dry-run, which builds every case at a tiny
scale on CPU and runs the torch paths and the kernel under the Triton interpreter (plumbing check).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SECTION_TITLE = "## MLA decode kernel (GPU)"
# (R, D, heads): DeepSeek-V2/V3's 512+64 with 16 and 128 heads, and the SmolLM2-135M conversion shapes.
LATENT_SHAPES = [(512, 64, 16), (512, 64, 128), (128, 64, 9), (64, 32, 9), (32, 16, 9)]
BATCHES = [1, 16, 64, 128]
CONTEXTS = [1024, 4096, 16384]
DRY_BATCHES = [1, 2]
DRY_CONTEXTS = [16, 40]
COPY_BYTES = 2 * 1024**3
# Largest |kernel - reference| accepted before a row is flagged: the kernel rounds softmax probabilities
# to the cache dtype (see tests/test_mla_decode_kernel.py), so a few ulps of bf16/fp16 around O(1).
ERROR_LIMIT = {"bf16": 5e-2, "fp16": 1e-2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write-benchmarks", type=Path, metavar="PATH",
                        help=f"replace or append the '{SECTION_TITLE}' section of this markdown file")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes on CPU (kernel under the Triton interpreter): checks the plumbing only")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="cache and query dtype")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", help=f"default {BATCHES}")
    parser.add_argument("--contexts", type=int, nargs="+", help=f"default {CONTEXTS}")
    parser.add_argument("--no-reference", action="store_true", help="skip timing the (slow) reference")
    parser.add_argument("--sweep", action="store_true",
                        help="also time alternative block sizes / warps / splits on a few cases")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench measuring time per timing")
    args = parser.parse_args(argv)
    if args.page_size < 1:
        parser.error("--page-size must be at least 1")
    return args


@dataclass
class Case:
    rank: int
    rope_dim: int
    heads: int
    batch: int
    context: int


@dataclass
class Result:
    case: Case
    config: object
    kernel_ms: float
    dense_ms: float
    reference_ms: float | None
    max_error: float
    bytes_read: int
    flops: int


def build_paged_inputs(torch, case: Case, page_size: int, dtype, device, seed: int = 0):
    """Random queries and a paged cache with every sequence at full context, physical pages shuffled.

    Built directly on the device (no per-page Python loop), so the 2.4 GB caches of the largest cases
    take milliseconds.  Returns (q_latent, q_rope, kv_cache, page_table, seq_lens, softmax_scale).
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    pages_per_seq = -(-case.context // page_size)
    num_pages = case.batch * pages_per_seq
    width = case.rank + case.rope_dim
    kv_cache = torch.randn((num_pages, page_size, width), generator=generator, device=device, dtype=dtype)
    order = torch.randperm(num_pages, generator=generator, device=device)
    page_table = order.to(torch.int32).reshape(case.batch, pages_per_seq)  # (batch, pages_per_seq)
    seq_lens = torch.full((case.batch,), case.context, dtype=torch.int32, device=device)
    q_latent = torch.randn((case.batch, case.heads, case.rank), generator=generator, device=device, dtype=dtype)
    q_rope = torch.randn((case.batch, case.heads, case.rope_dim), generator=generator, device=device, dtype=dtype)
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


def time_ms(torch, fn, on_cuda: bool, rep_ms: int) -> float:
    if on_cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def measure_copy_bandwidth(torch, device, on_cuda: bool, rep_ms: int) -> float:
    """Bytes read + written per second by a large device-to-device copy (the practical ceiling)."""
    size = COPY_BYTES if on_cuda else 8 * 1024**2
    source = torch.empty(size, dtype=torch.uint8, device=device)
    source.random_(0, 255)
    target = torch.empty_like(source)
    ms = time_ms(torch, lambda: target.copy_(source), on_cuda, rep_ms)
    del source, target
    return 2 * size / (ms * 1e-3)


def run_case(torch, mla, case: Case, args, dtype, device, on_cuda: bool) -> Result:
    inputs = build_paged_inputs(torch, case, args.page_size, dtype, device)
    q_latent, q_rope, kv_cache, page_table, seq_lens, scale = inputs
    shape = mla.inputs.check_decode_inputs(q_latent, q_rope, kv_cache, page_table, seq_lens, None)
    config = mla.choose_config(shape, dtype, kv_cache.device)
    out, _ = mla.mla_decode(*inputs, config=config)
    ref_out, _ = mla.mla_decode_reference(*inputs)
    max_error = (out.float() - ref_out.float()).abs().max().item()
    del ref_out
    dense_decode = make_dense_torch_decode(torch, kv_cache, page_table, case.context, case.rank)
    kernel_ms = time_ms(torch, lambda: mla.mla_decode(*inputs, config=config), on_cuda, args.rep_ms)
    dense_ms = time_ms(torch, lambda: dense_decode(q_latent, q_rope, scale), on_cuda, args.rep_ms)
    reference_ms = None
    if not args.no_reference:
        reference_ms = time_ms(torch, lambda: mla.mla_decode_reference(*inputs), on_cuda, args.rep_ms)
    element = kv_cache.element_size()
    width = case.rank + case.rope_dim
    bytes_read = case.batch * case.context * width * element + case.batch * case.heads * width * element
    flops = 2 * case.batch * case.heads * case.context * (2 * case.rank + case.rope_dim)
    return Result(case, config, kernel_ms, dense_ms, reference_ms, max_error, bytes_read, flops)


def sweep_case(torch, mla, case: Case, args, dtype, device, on_cuda: bool) -> list[str]:
    """Time every launch config in a small grid around the heuristic; one markdown row per config."""
    inputs = build_paged_inputs(torch, case, args.page_size, dtype, device)
    shape = mla.inputs.check_decode_inputs(*inputs[:5], None)
    chosen = mla.choose_config(shape, dtype, inputs[2].device)
    block_r = max(16, 1 << (case.rank - 1).bit_length())
    cache_bytes = case.batch * case.context * (case.rank + case.rope_dim) * inputs[2].element_size()
    rows = []
    for block_h in (16, 32, 64):
        # Beyond 16K accumulator elements the compile for sm_90 spills (see mla_decode_triton.compile_check).
        if block_h * block_r > 16384 or block_h > max(16, 1 << (case.heads - 1).bit_length()):
            continue
        for block_n in (16, 32, 64):
            for num_warps in (4, 8, 16):
                for num_splits in sorted({chosen.num_splits, chosen.num_splits * 2}):
                    config = mla.DecodeConfig(block_h, block_n, num_splits, num_warps, 2)
                    label = format_config(config) + (" (heuristic)" if config == chosen else "")
                    try:
                        ms = time_ms(torch, lambda: mla.mla_decode(*inputs, config=config), on_cuda, args.rep_ms)
                    except Exception as error:  # e.g. out of shared memory for this tile: report and go on
                        rows.append(f"| {describe(case)} | {label} | failed: {type(error).__name__} | |")
                        continue
                    bandwidth = cache_bytes / (ms * 1e-3)
                    rows.append(f"| {describe(case)} | {label} | {ms * 1e3:.1f} | {bandwidth / 1e9:.0f} |")
    return rows


def describe(case: Case) -> str:
    return f"{case.rank}+{case.rope_dim}, {case.heads} heads, batch {case.batch}, ctx {case.context}"


def format_config(config) -> str:
    return f"H{config.block_h} N{config.block_n} w{config.num_warps} s{config.num_splits}"


def format_table(results: list[Result], copy_bandwidth: float, error_limit: float) -> str:
    header = (
        "| R+D | heads | batch | context | config | kernel µs | GB/s | % of copy | TFLOP/s "
        "| torch dense µs | speed-up | reference µs | speed-up | max abs err |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in results:
        bandwidth = r.bytes_read / (r.kernel_ms * 1e-3)
        reference = "-" if r.reference_ms is None else f"{r.reference_ms * 1e3:.1f}"
        reference_speedup = "-" if r.reference_ms is None else f"{r.reference_ms / r.kernel_ms:.1f}x"
        lines.append(
            f"| {r.case.rank}+{r.case.rope_dim} | {r.case.heads} | {r.case.batch} | {r.case.context} "
            f"| {format_config(r.config)} | {r.kernel_ms * 1e3:.1f} | {bandwidth / 1e9:.0f} "
            f"| {100 * bandwidth / copy_bandwidth:.0f}% | {r.flops / (r.kernel_ms * 1e-3) / 1e12:.2f} "
            f"| {r.dense_ms * 1e3:.1f} | {r.dense_ms / r.kernel_ms:.1f}x | {reference} | {reference_speedup} "
            f"| {r.max_error:.1e}{' **too large**' if not r.max_error <= error_limit else ''} |"
        )
    return header + "\n".join(lines) + "\n"


def write_section(path: Path, body: str) -> None:
    """Replace the section (up to the next '## ' heading) or append it; the rest of the file is kept."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = f"{SECTION_TITLE}\n\n{body.rstrip()}\n"
    pattern = re.compile(rf"^{re.escape(SECTION_TITLE)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        # Before triton is imported: without a GPU the kernel can only run in the interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    on_cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    if not on_cuda and not args.dry_run:
        reason = "no CUDA device" if not torch.cuda.is_available() else "TRITON_INTERPRET is set"
        print(f"bench_mla_decode: needs a CUDA GPU with compiled Triton kernels ({reason}); "
              "use --dry-run for a CPU plumbing check", file=sys.stderr)
        return 2
    import mla_decode_triton as mla  # also loads mla.inputs (check_decode_inputs)
    import triton

    device = torch.device("cuda" if on_cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    batches = args.batches or (DRY_BATCHES if args.dry_run else BATCHES)
    contexts = args.contexts or (DRY_CONTEXTS if args.dry_run else CONTEXTS)
    page_size = args.page_size if not args.dry_run else min(args.page_size, 16)
    args.page_size = page_size
    started = time.perf_counter()

    copy_bandwidth = measure_copy_bandwidth(torch, device, on_cuda, args.rep_ms)
    device_name = torch.cuda.get_device_name(device) if on_cuda else "CPU (dry run, Triton interpreter)"
    print(f"# {device_name}: copy bandwidth {copy_bandwidth / 1e9:.0f} GB/s (read + write)", file=sys.stderr)

    results = []
    for rank, rope_dim, heads in LATENT_SHAPES:
        for batch in batches:
            for context in contexts:
                case = Case(rank, rope_dim, heads if not args.dry_run else min(heads, 3), batch, context)
                result = run_case(torch, mla, case, args, dtype, device, on_cuda)
                results.append(result)
                print(f"# {describe(case)}: {result.kernel_ms * 1e3:.1f} us", file=sys.stderr)
                if not result.max_error <= ERROR_LIMIT[args.dtype]:
                    print(f"# WARNING: max |kernel - reference| = {result.max_error:.3g}", file=sys.stderr)
                if on_cuda:
                    torch.cuda.empty_cache()

    sweep_rows = []
    if args.sweep:
        sweep_cases = [Case(512, 64, 128, 16, 4096), Case(512, 64, 16, 1, 16384), Case(128, 64, 9, 64, 4096)]
        if args.dry_run:
            sweep_cases = [Case(32, 16, 3, 1, 40)]
        for case in sweep_cases:
            sweep_rows += sweep_case(torch, mla, case, args, dtype, device, on_cuda)

    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    body = (
        f"Produced by `{command}` on {device_name} ({datetime.date.today().isoformat()}; torch "
        f"{torch.__version__}, triton {triton.__version__}); {args.dtype} cache, page size {page_size}, "
        f"every sequence at full context, times are do_bench medians with L2 flushed.\n\n"
        f"Device copy bandwidth (large device-to-device copy, bytes read + written / time): "
        f"{copy_bandwidth / 1e9:.0f} GB/s.  Kernel GB/s counts the cache bytes (each token once) plus "
        f"the query bytes; config = rows per program (H), tokens per tile (N), warps (w), splits (s).\n\n"
        + format_table(results, copy_bandwidth, ERROR_LIMIT[args.dtype])
    )
    if sweep_rows:
        body += (
            "\nLaunch-config sweep (tuning aid):\n\n| case | config | kernel µs | cache GB/s |\n"
            "|---|---|---|---|\n" + "\n".join(sweep_rows) + "\n"
        )
    body += f"\nTotal benchmark wall time: {time.perf_counter() - started:.0f} s.\n"
    print(body)
    if args.write_benchmarks:
        write_section(args.write_benchmarks, body)
        print(f"# wrote '{SECTION_TITLE}' to {args.write_benchmarks}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
