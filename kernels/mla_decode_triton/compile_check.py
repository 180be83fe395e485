"""Compile the decode kernels for a Hopper GPU (sm_90) on a machine without one, and inspect the result.

The Triton interpreter checks what the kernels compute but not whether they compile for a GPU: the
interpreter accepts dot shapes, layouts and shared-memory sizes that the compiler would reject, and it
says nothing about register spills, which tensor-core instructions are used, or how wide the cache
loads are.  Triton can compile ahead of time for a named target with the ptxas it ships, so this module
builds exactly the launches `mla_decode` would make (same arguments through `plan_launches`), for every
candidate tile of every project shape (`configs.candidate_tiles`), specialises them the way the JIT
does at launch (integer arguments equal to 1 become constants, pointers and integers divisible by 16
get that hint), compiles them for sm_90 and reports:

* registers per thread and stack frame (`cuobjdump --dump-resource-usage`), local loads/stores in the
  SASS (LDL/STL: register spills), shared memory;
* the instruction mix: HGMMA (wgmma, Hopper's warpgroup tensor-core MMA) and HMMA (mma.sync, the
  Ampere-style one), LDGSTS (cp.async: pipelined global -> shared copies), and the width of every
  global load (16, 8, 4 or 2 bytes per thread and instruction) - narrow loads are what an unaligned
  cache row costs;
* the software pipeline, from the TTGIR (Triton's GPU-level IR) of the tile loop: how many cache tiles
  the program buffers in shared memory, and how many tiles' copies are still in flight while a tile is
  multiplied (the loop's `async_wait` count divided by the copies it issues per tile).  0 in flight
  means each tile is read and then multiplied, one after the other: the cache read never overlaps
  the products, which no count of cp.async instructions reveals.

Run with the interpreter off (the kernels must be real JIT functions):
    TRITON_INTERPRET=0 python -m mla_decode_triton.compile_check [--json] [--markdown]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mla_decode_triton.configs import TileConfig, candidate_tiles
from mla_decode_triton.inputs import DecodeShape, check_decode_inputs
from mla_decode_triton.kernel import mla_decode_merge_kernel
from mla_decode_triton.launcher import (
    INTERPRETED,
    MAX_SPLITS,
    DecodeConfig,
    min_split_tokens_for,
    plan_launches,
    programs_per_multiprocessor,
)

HOPPER = GPUTarget("cuda", 90, 32)
POINTER_TAGS = {
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
}


@dataclass(frozen=True)
class Case:
    """One decode shape: R + D, heads, page size, cache dtype, and the cache row's width in elements."""

    rank: int
    rope_dim: int
    heads: int
    page_size: int
    dtype: torch.dtype
    row_width: int | None = None  # None: R + D (unpadded); more: rows padded like PagedLatentCache's
    note: str = ""
    align_hint: bool = True  # False: ROW_ALIGN forced to 1, to show what the hint buys (never launched so)

    def label(self) -> str:
        pad = "" if self.row_width in (None, self.rank + self.rope_dim) else f" row {self.row_width}"
        hint = "" if self.align_hint else " no-hint"
        return (f"{self.rank}+{self.rope_dim} x{self.heads} page {self.page_size} "
                f"{str(self.dtype).removeprefix('torch.')}{pad}{hint}")


# The shapes the project decodes (DeepSeek's 512+64 at 16 / 64 / 128 heads, SmolLM2-135M's 9 heads at
# 2x = 144+48 and 4x = 64+32, stories260K's 8 heads at 24+8 and 4+4), plus awkward ones.
CASES = [
    Case(512, 64, 16, 64, torch.bfloat16, note="DeepSeek, 16 heads"),
    Case(512, 64, 64, 64, torch.bfloat16, note="DeepSeek, 64 heads"),
    Case(512, 64, 128, 64, torch.float16, note="DeepSeek, 128 heads: two row blocks"),
    Case(512, 64, 32, 64, torch.bfloat16, note="32 rows (32 heads, or 2 tokens x 16 heads)"),
    Case(144, 48, 9, 16, torch.bfloat16, note="SmolLM2-135M 2x"),
    Case(144, 48, 36, 16, torch.bfloat16, note="SmolLM2 2x, 4 speculative tokens x 9 heads"),
    Case(64, 32, 9, 16, torch.bfloat16, note="SmolLM2-135M 4x"),
    Case(128, 64, 64, 16, torch.bfloat16, note="64 rows, R = 128"),
    Case(24, 8, 8, 16, torch.bfloat16, note="stories260K 2x"),
    Case(4, 4, 8, 16, torch.bfloat16, note="stories260K 8x: 16-byte rows"),
    Case(4, 4, 8, 16, torch.bfloat16, note="same without the ROW_ALIGN hint (demonstration only)", align_hint=False),
    Case(20, 6, 8, 16, torch.bfloat16, note="26-element rows, unpadded"),
    Case(20, 6, 8, 16, torch.bfloat16, row_width=32, note="same, padded to 64 B"),
    Case(100, 12, 3, 1, torch.float32, note="fp32 cache (no tensor cores)"),
    Case(512, 64, 16, 64, torch.float32, note="fp32 cache, DeepSeek shape"),
    Case(144, 48, 9, 16, torch.float32, note="fp32 cache, SmolLM2 2x (the runtime's fp32 compute)"),
]


@dataclass
class CompileReport:
    case: str
    kernel: str
    config: str
    shared_bytes: int
    registers: int | None
    stack_bytes: int | None
    local_memory_ops: int  # LDL + STL in the SASS: register spills
    wgmma_ops: int  # HGMMA: Hopper warpgroup MMA
    mma_sync_ops: int  # HMMA: warp-level mma.sync
    async_copies: int  # LDGSTS (cp.async): pipelined global -> shared loads
    load_bytes: dict = field(default_factory=dict)  # global-load width in bytes -> instruction count
    cache_buffers: int | None = None  # cache tiles held in shared memory by the tile loop (split kernel)
    tiles_in_flight: int | None = None  # tiles still being copied while the loop multiplies one
    grid_dependency_ops: int | None = None  # griddepcontrol in the PTX: programmatic dependent launch
    loads_before_exp: int | None = None  # merge: global loads the SASS issues before its first exp ...
    loads_after_exp: int | None = None  # ... and after it, i.e. waiting for the split weights (merge_load_order)
    triton_version: str = triton.__version__
    note: str = ""

    @property
    def tensor_core_ops(self) -> int:
        return self.wgmma_ops + self.mma_sync_ops


def _specialise(kernel, args: list, constexprs: dict) -> ASTSource:
    """Signature, constants and alignment hints as the JIT would derive them from these arguments."""
    names = kernel.arg_names
    signature, constants, attrs = {}, {}, {}
    positional = dict(zip(names, args))
    for index, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
            constants[(index,)] = constexprs[name]
            continue
        value = positional[name]
        if isinstance(value, torch.Tensor):
            signature[name] = POINTER_TAGS[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"unexpected kernel argument {name}={value!r}")
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name] = "constexpr"
            constants[(index,)] = 1
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)


def _inspect_cubin(cubin: bytes) -> tuple[int | None, int | None, str]:
    """Registers and stack frame (cuobjdump resource usage) and the SASS, via Triton's own cuobjdump."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None, None, ""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True).stdout
    registers = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return (int(registers.group(1)) if registers else None, int(stack.group(1)) if stack else None, sass)


def global_load_widths(sass: str) -> dict[int, int]:
    """Bytes per thread of every global load (LDG) and cp.async (LDGSTS) in the SASS -> count.

    The opcode's suffix carries the width: .128 / .64 (bytes 16 / 8), .U16 / .S16 (2), .U8 / .S8 (1),
    none (4).
    """
    widths: Counter = Counter()
    for opcode in re.findall(r"\b(LDGSTS(?:\.[\w]+)*|LDG(?:\.[\w]+)*)\b", sass):
        suffixes = opcode.split(".")[1:]
        if "128" in suffixes:
            width = 16
        elif "64" in suffixes:
            width = 8
        elif {"U16", "S16"} & set(suffixes):
            width = 2
        elif {"U8", "S8"} & set(suffixes):
            width = 1
        else:
            width = 4
        widths[width] += 1
    return dict(sorted(widths.items(), reverse=True))


def tile_pipeline(ttgir: str, block_n: int) -> tuple[int | None, int | None]:
    """(cache buffers, tiles in flight during the products) of the split kernel's tile loop, from its TTGIR.

    Buffers: the leading dimension of the shared-memory allocations that hold BLOCK_N cache rows.  In
    flight: the loop waits until at most `num` copy groups are outstanding before it multiplies; each
    tile issues one group per cache copy (latent, RoPE key, the other R half), so num / copies per tile
    is how many later tiles are still loading while this one is used.
    """
    buffers = [int(m.group(1)) for m in re.finditer(r"ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x(\d+)x", ttgir)
               if int(m.group(2)) == block_n]
    start = ttgir.find("scf.for")
    if start < 0 or not buffers:
        return (min(buffers) if buffers else None), None
    loop = ttgir[start:ttgir.find("scf.yield", start)]
    copies = len(re.findall(rf"async_copy_global_to_local .*: tensor<{block_n}x\d+x!tt\.ptr", loop))
    waits = [int(num) for num in re.findall(r"ttg\.async_wait [^{]*\{num = (\d+)", loop)]
    in_flight = min(waits) // copies if copies and waits else 0
    return min(buffers), in_flight


def build_launches(case: Case, config: DecodeConfig, num_splits: int = 4):
    """The launches `mla_decode` makes for a 2-sequence batch of this shape (CPU tensors, never run)."""
    batch, context = 2, 4 * 64
    pages = context // case.page_size
    width = case.rank + case.rope_dim
    q_latent = torch.zeros((batch, case.heads, case.rank), dtype=case.dtype)
    q_rope = torch.zeros((batch, case.heads, case.rope_dim), dtype=case.dtype)
    storage = torch.zeros((batch * pages, case.page_size, case.row_width or width), dtype=case.dtype)
    kv_cache = storage[..., :width]  # (pages, page_size, R + D), a view when the rows are padded
    page_table = torch.arange(batch * pages, dtype=torch.int32).reshape(batch, pages)  # (batch, pages)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    shape = check_decode_inputs(q_latent, q_rope, kv_cache, page_table, seq_lens, None)
    # pdl=True: compiled as an sm_90 GPU runs them, the merge a programmatic dependent of the split kernel
    launches, _, _ = plan_launches(q_latent, q_rope, kv_cache, page_table, seq_lens, 0.1, shape, config, case.dtype,
                                   pdl=True)
    if not case.align_hint:
        launches[0].constexprs["ROW_ALIGN"] = 1
    return launches


def compile_launch(launch, label: str, note: str = "") -> CompileReport:
    source = _specialise(launch.kernel, launch.args, launch.constexprs)
    compiled = triton.compile(
        source, target=HOPPER, options={"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    )
    registers, stack, sass = _inspect_cubin(compiled.asm["cubin"])
    keys = [key for key in launch.constexprs if key.startswith(("BLOCK", "R_SPLIT", "ROW_ALIGN"))]
    block_n = launch.constexprs.get("BLOCK_N")
    buffers, in_flight = tile_pipeline(compiled.asm["ttgir"], block_n) if block_n else (None, None)
    load_order = merge_load_order(sass) if launch.kernel is mla_decode_merge_kernel and sass else (None, None)
    return CompileReport(
        case=label,
        kernel=launch.kernel.fn.__name__,
        config=" ".join(f"{key}={launch.constexprs[key]}" for key in keys)
        + f" warps={launch.num_warps} stages={launch.num_stages}",
        shared_bytes=int(compiled.metadata.shared),
        registers=registers,
        stack_bytes=stack,
        local_memory_ops=len(re.findall(r"\b(?:LDL|STL)\b", sass)),
        wgmma_ops=len(re.findall(r"\bHGMMA\b", sass)),
        mma_sync_ops=len(re.findall(r"\bHMMA\b", sass)),
        async_copies=len(re.findall(r"\bLDGSTS\b", sass)),
        load_bytes=global_load_widths(sass),
        cache_buffers=buffers,
        grid_dependency_ops=len(re.findall(r"\bgriddepcontrol\.", compiled.asm["ptx"])),
        loads_before_exp=load_order[0],
        loads_after_exp=load_order[1],
        tiles_in_flight=in_flight,
        note=note,
    )


def check_case(case: Case, tiles: list[TileConfig] | None = None, merge: bool = True) -> list[CompileReport]:
    """Compile the split kernel for every candidate tile of one shape (and its merge kernel once)."""
    if tiles is None:
        tiles = candidate_tiles(case.rank, case.rope_dim, case.heads, case.dtype)
    element_size = torch.empty((), dtype=case.dtype).element_size()
    reports = []
    for index, tile in enumerate(tiles):
        # The chunk floor as on a GPU (the CPU default is 1, which the JIT would turn into a constant).
        probe = DecodeShape(batch=1, q_len=1, heads=case.heads, kv_lora_rank=case.rank, rope_dim=case.rope_dim,
                            page_size=case.page_size, max_pages=1)
        config = DecodeConfig.from_tile(tile, 4, min_split_tokens_for(probe, element_size))
        launches = build_launches(case, config)
        wanted = launches if (merge and index == 0) else launches[:1]
        reports += [compile_launch(launch, case.label(), case.note) for launch in wanted]
        if merge and index == 0:  # the merge also at the most splits: its widest split block (BLOCK_S)
            widest = build_launches(case, dataclasses.replace(config, num_splits=MAX_SPLITS))[1]
            reports.append(compile_launch(widest, case.label(), case.note))
    return reports


def merge_load_order(sass: str) -> tuple[int, int]:
    """Global loads (LDG) in the merge's SASS before and after its first exponential (MUFU.EX2).

    The merge's exponentials turn the splits' lse into weights, so a load placed after the first one
    is, in program order, issued only once lse values have arrived: with the partial outputs masked
    by their weights (before 2026-12-04, third session) most of them were; masked by which splits
    exist, the compiler issues most of them together with the lse loads.
    """
    opcodes = re.findall(r"\b(LDG|MUFU\.EX2)\b", sass)
    first_exp = opcodes.index("MUFU.EX2") if "MUFU.EX2" in opcodes else len(opcodes)
    return opcodes[:first_exp].count("LDG"), opcodes[first_exp:].count("LDG")


def _dash(value) -> str:
    return "-" if value is None else str(value)


def markdown_table(reports: list[CompileReport]) -> str:
    """One row per compiled launch, for BENCHMARKS.md."""
    lines = [
        "| case | kernel | config | regs | stack B | spill ops | smem KB | buffers | in flight | HGMMA | HMMA | cp.async "
        "| global loads (bytes: count) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in reports:
        loads = ", ".join(f"{width}: {count}" for width, count in r.load_bytes.items())
        kernel = r.kernel.removeprefix("mla_decode_").removesuffix("_kernel")
        lines.append(
            f"| {r.case} | {kernel} | {r.config} | {r.registers} | {r.stack_bytes} | {r.local_memory_ops} "
            f"| {r.shared_bytes / 1024:.0f} | {_dash(r.cache_buffers)} | {_dash(r.tiles_in_flight)} | {r.wgmma_ops} "
            f"| {r.mma_sync_ops} | {r.async_copies} | {loads} |"
        )
    return "\n".join(lines) + "\n"


def programs_per_sm(report: dict) -> int | None:
    """Programs of this compiled launch one Hopper multiprocessor holds at once (registers, shared memory,
    warps: `launcher.programs_per_multiprocessor`, the rule the split count is sized with on the GPU)."""
    warps = re.search(r"warps=(\d+)", report["config"])
    if report.get("registers") is None or warps is None:
        return None
    return programs_per_multiprocessor(report["registers"], report["shared_bytes"], int(warps.group(1)))


def side_by_side(runs: list[list[dict]]) -> str:
    """One markdown row per launch, with registers, spills and programs per multiprocessor of every run
    (e.g. two Triton versions).

    Instruction mix, shared memory and load widths are taken from the first run; the per-version
    columns are what differs between compiler versions.
    """
    versions = [run[0]["triton_version"] for run in runs]
    by_key = [{(r["case"], r["kernel"], r["config"]): r for r in run} for run in runs]
    lines = [
        "| case | kernel | config | " + " | ".join(f"regs {v}" for v in versions) + " | "
        + " | ".join(f"spill B / ops {v}" for v in versions) + " | "
        + " | ".join(f"programs / SM {v}" for v in versions)
        + " | smem KB | buffers | in flight | HGMMA | HMMA | cp.async | global loads (bytes: count) |",
        "|---|---|---|" + "---:|" * (3 * len(runs)) + "---:|---:|---:|---:|---:|---:|---|",
    ]
    for key, first in by_key[0].items():
        others = [table.get(key) for table in by_key]
        regs = " | ".join("-" if r is None else str(r["registers"]) for r in others)
        spills = " | ".join("-" if r is None else f"{r['stack_bytes']} / {r['local_memory_ops']}" for r in others)
        spills += " | " + " | ".join(_dash(None if r is None else programs_per_sm(r)) for r in others)
        loads = ", ".join(f"{width}: {count}" for width, count in first["load_bytes"].items())
        kernel = first["kernel"].removeprefix("mla_decode_").removesuffix("_kernel")
        config = first["config"].replace(" BLOCK_", " ").replace("BLOCK_", "")
        lines.append(f"| {first['case']} | {kernel} | {config} | {regs} | {spills} | {first['shared_bytes'] / 1024:.0f} "
                     f"| {_dash(first.get('cache_buffers'))} | {_dash(first.get('tiles_in_flight'))} "
                     f"| {first['wgmma_ops']} | {first['mma_sync_ops']} | {first['async_copies']} | {loads} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the reports as one JSON line")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--cases", type=int, nargs="+", help="indices into CASES (default: all)")
    parser.add_argument("--render", type=Path, nargs="+", metavar="JSON",
                        help="render earlier --json outputs side by side (e.g. one per Triton version); no compile")
    args = parser.parse_args(argv)
    if args.render:
        print(side_by_side([json.loads(path.read_text().strip().splitlines()[-1]) for path in args.render]))
        return 0
    if INTERPRETED:
        print("compile_check: TRITON_INTERPRET=1 is set; run with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence Triton 3.9's default-change warning
    cases = CASES if args.cases is None else [CASES[index] for index in args.cases]
    reports = [report for case in cases for report in check_case(case)]
    if args.json:
        print(json.dumps([asdict(report) for report in reports]))
    elif args.markdown:
        print(markdown_table(reports))
    else:
        for report in reports:
            print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
