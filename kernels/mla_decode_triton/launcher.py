"""Launch the Triton MLA decode kernels: pick the tile, the split count, allocate, launch.

Choices and why (none of this changes results beyond fp rounding; tests pin that down):

* The tile (rows per program BLOCK_H, R split, tokens per tile BLOCK_N, warps, pipeline stages) comes
  from `configs.py`: the measured table when it has the shape, else the first of the shape's candidate
  tiles, every one of which `compile_check` proves spill-free on sm_90.  BLOCK_H covers every query row
  of a sequence up to 64 (at R = 512 up to 32 by default, measured faster), so the heads of a row block
  share each cache tile.
* num_splits (flash-decoding): decode with a small batch has far fewer (sequence, row block) programs
  than multiprocessors, so each context is cut into chunks handled in parallel and merged afterwards.
  The count is chosen in whole waves: the GPU runs `multiprocessors x resident` programs at once
  (resident = programs one multiprocessor holds, from the compiled kernel's registers and shared
  memory, `programs_per_multiprocessor`; until a tile has been launched once, 2), and a launch whose
  programs spill into a partly filled extra wave pays for the whole wave.  Every split count up to the
  useful maximum is costed as waves x (tiles per program + SPLIT_FIXED_TILES) (+ MERGE_TILES for the
  merge, and the partial outputs that splitting writes) and the fewest splits within 5 % of the
  cheapest win - e.g. 64 sequences x 16 heads at 4K on 132 multiprocessors holding one program each:
  2 splits (128 programs, one wave) rather than the 5 that "about 2 programs per multiprocessor" gave
  (320 programs, three waves, the last 42 % full); 4 splits where two programs fit a multiprocessor.
  The H200 run of 2026-11-30 is consistent with this (512+64, 16 heads, context 16K, one program per
  multiprocessor): at batch 64 (320 programs, 81 % of three waves busy) the kernel reached 48 % of copy
  bandwidth, at batch 128 (384 programs, 97 %) 56 %.
  The count is sized from the real lengths the caller passes (`max_seq_len`, `mean_seq_len`: plain
  Python numbers it already knows, so the launcher never reads seq_lens back from the device and
  stays CUDA-graph friendly); without them the page table's capacity stands in for both, which
  over-splits a preallocated table.
* min_split_tokens: a split costs a query load, and with several splits a partial output (fp32, rows x
  R) written and read back by the merge.  Each chunk is made long enough that this partial traffic
  stays below PARTIAL_TRAFFIC_FRACTION of the cache bytes the chunk reads (and at least
  MIN_TOKENS_PER_SPLIT); the kernel applies it per sequence, so a short sequence in a long batch uses
  one split and its other split programs return at once.
* On CPU (the Triton interpreter, used by the tests) every program is slow Python, so at most 2 splits
  are used by default: enough to exercise the merge stage.
* With one split the first kernel writes the final output directly and the merge is skipped.  With
  several, on sm_90 and later, the merge is a programmatic dependent launch (`dependent_launch`;
  MLA_DECODE_PDL=0 turns it off): 0.3-1.1 µs faster per step on the H200 (2026-12-04), bit-identical.
* Rows whose latent is not a power of two are read in two blocks, cut where that pads least
  (`configs.row_blocks`); the launcher passes them as BLOCK_R / BLOCK_T.
* ROW_ALIGN: the largest power of two (<= 16 elements) dividing the cache's page and token strides and
  its base address, passed as a vectorisation hint.  Triton only infers alignment itself for integer
  arguments divisible by 16, so a 4+4 bf16 cache row (8 elements, 16 bytes) would otherwise be read
  with 2-byte loads.  `mla_convert.runtime.PagedLatentCache` pads its rows to a 16-byte multiple so
  that every shape gets at least 16-byte aligned rows.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from dataclasses import dataclass

import torch
import triton.language as tl

from mla_decode_triton.configs import TileConfig, choose_tile, pow2_at_least, row_blocks
from mla_decode_triton.errors import MLADecodeInputError
from mla_decode_triton.inputs import DecodeShape, check_decode_inputs
from mla_decode_triton.kernel import (
    LOG2E,
    mla_decode_merge_kernel,
    mla_decode_split_kernel,
    mla_decode_split_tokens_major_kernel,
)

MIN_TOKENS_PER_SPLIT = 128
PARTIAL_TRAFFIC_FRACTION = 0.5
MAX_SPLITS = 64
PROGRAMS_PER_MULTIPROCESSOR = 2  # resident programs assumed until the compiled kernel says otherwise
SPLIT_FIXED_TILES = 2  # a program's cost beyond its tiles, in tile times: pipeline fill, query load, epilogue
MERGE_TILES = 1  # the merge launch, in tile times
SPLIT_COST_TOLERANCE = 1.05  # the cost model is coarse: more splits only when they are predicted 5 % cheaper
REGISTER_ALLOCATION_UNIT = 256  # registers are given to a warp in blocks of this many (sm_70 onwards)
CPU_MAX_SPLITS = 2
MERGE_BLOCK_C = 128
MERGE_BLOCK_ROWS = 16
MERGE_MIN_BLOCK_S = 8
MERGE_TILE_ELEMENTS = 8192  # fp32 partials one merge program loads at once (32 KB: 64 registers a thread at 4 warps)
MAX_ROW_ALIGN = 16

INTERPRETED = type(mla_decode_split_kernel).__name__ == "InterpretedFunction"


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of one decode call (see the module docstring for how they are chosen).

    `r_split` = 2 splits the output accumulator's R columns over two programs (see kernel.py);
    `min_split_tokens` is the shortest chunk a split may get (1: any whole tile); `tokens_major` runs
    the split kernel with its products transposed (`mla_decode_split_tokens_major_kernel`).
    """

    block_h: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    r_split: int = 1
    min_split_tokens: int = 1
    tokens_major: bool = False

    @property
    def tile(self) -> TileConfig:
        return TileConfig(self.block_h, self.r_split, self.block_n, self.num_warps, self.num_stages,
                          self.tokens_major)

    @classmethod
    def from_tile(cls, tile: TileConfig, num_splits: int, min_split_tokens: int = 1) -> DecodeConfig:
        """The launch of `tile` (configs.candidate_tiles) with this split count and chunk floor."""
        return cls(tile.block_h, tile.block_n, num_splits, tile.num_warps, tile.num_stages, tile.r_split,
                   min_split_tokens, tile.tokens_major)


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def min_split_tokens_for(shape: DecodeShape, cache_element_size: int) -> int:
    """Shortest chunk worth a split: partial-output traffic <= PARTIAL_TRAFFIC_FRACTION of its cache bytes."""
    partial_bytes = shape.rows * shape.kv_lora_rank * 4 * 2  # fp32, written by the split, read by the merge
    bytes_per_token = (shape.kv_lora_rank + shape.rope_dim) * cache_element_size
    tokens = max(MIN_TOKENS_PER_SPLIT, math.ceil(partial_bytes / (PARTIAL_TRAFFIC_FRACTION * bytes_per_token)))
    return -(-tokens // 16) * 16  # a multiple of 16, so the JIT compiles one specialisation for all shapes


def programs_per_multiprocessor(registers: int, shared_bytes: int, num_warps: int, max_registers: int = 65536,
                                max_shared_bytes: int = 232448, max_warps: int = 64) -> int:
    """Programs of one compiled kernel that a multiprocessor holds at once (at least 1).

    The tightest of three limits: the register file (each warp gets its registers in blocks of
    REGISTER_ALLOCATION_UNIT), shared memory, and warps per multiprocessor.  Defaults are Hopper's
    (64K registers, 227 KB shared memory per program, 64 warps).
    """
    unit = REGISTER_ALLOCATION_UNIT
    registers_per_warp = -(-max(1, registers) * 32 // unit) * unit
    by_registers = max_registers // (registers_per_warp * num_warps)
    by_shared = max_shared_bytes // shared_bytes if shared_bytes > 0 else max_warps
    return max(1, min(by_registers, by_shared, max_warps // num_warps))


_RESIDENT: dict[tuple, int] = {}  # residency key -> programs per multiprocessor, read from compiled kernels


def _residency_key(device: torch.device, shape: DecodeShape, cache_dtype: torch.dtype, tile: TileConfig) -> tuple:
    return (device.index or 0, shape.kv_lora_rank, shape.rope_dim, shape.page_size, cache_dtype, tile)


def resident_programs(device: torch.device, shape: DecodeShape, cache_dtype: torch.dtype, tile: TileConfig) -> int:
    """Programs per multiprocessor of this tile: measured from its compiled kernel once it has run, else 2."""
    return _RESIDENT.get(_residency_key(device, shape, cache_dtype, tile), PROGRAMS_PER_MULTIPROCESSOR)


def _record_residency(compiled, key: tuple) -> None:
    """Read registers and shared memory of a launched kernel (Triton's CompiledKernel) into _RESIDENT."""
    if key in _RESIDENT or compiled is None:
        return
    from triton.runtime import driver

    try:
        limits = driver.active.utils.get_device_properties(key[0])
        max_threads = getattr(torch.cuda.get_device_properties(key[0]), "max_threads_per_multi_processor", 2048)
        _RESIDENT[key] = programs_per_multiprocessor(
            int(compiled.n_regs), int(compiled.metadata.shared), int(compiled.metadata.num_warps),
            int(limits["max_num_regs"]), int(limits["max_shared_mem"]), max_threads // 32,
        )
    except (AttributeError, KeyError, TypeError) as error:  # another Triton's CompiledKernel: keep the default
        _RESIDENT[key] = PROGRAMS_PER_MULTIPROCESSOR
        warnings.warn(f"mla_decode: could not read the compiled kernel's registers / shared memory ({error!r}); "
                      f"split counts assume {PROGRAMS_PER_MULTIPROCESSOR} programs per multiprocessor", stacklevel=3)


@functools.lru_cache(maxsize=1024)  # ~80 µs of Python per new set of sizes on a slow host; a hit is ~1 µs
def splits_for_gpu(shape: DecodeShape, tile: TileConfig, cache_element_size: int, multiprocessors: int,
                   max_seq_len: int | None = None, mean_seq_len: float | None = None,
                   resident: int = PROGRAMS_PER_MULTIPROCESSOR) -> int:
    """Splits per sequence that finish the batch in the fewest tile times, counted in whole waves.

    For each split count s up to the useful maximum (chunks no shorter than `min_split_tokens_for`,
    at most MAX_SPLITS): a split holds ceil(longest / s) tokens (the kernel's `split_extent`), the batch
    about batch x mean / that many non-empty programs per row program (at least one per sequence),
    which run in ceil(programs / (multiprocessors x resident)) waves.  A program costs its tiles plus
    SPLIT_FIXED_TILES, and with s > 1 also the fp32 partial output it writes and the merge reads back
    (in tile-sized units of bytes); the merge launch adds MERGE_TILES.  The fewest splits whose cost is
    within SPLIT_COST_TOLERANCE of the cheapest win.  A pure function of sizes (no tensor is read), so
    it is testable without a GPU.
    """
    longest = max(1, shape.max_context if max_seq_len is None else int(max_seq_len))
    mean = float(longest if mean_seq_len is None else min(max(mean_seq_len, 1.0), longest))
    row_programs = math.ceil(shape.rows / tile.block_h) * tile.r_split
    slots = max(1, multiprocessors * resident)
    floor = min_split_tokens_for(shape, cache_element_size)
    useful = max(1, min(math.ceil(longest / floor), MAX_SPLITS))

    tile_bytes = tile.block_n * (shape.kv_lora_rank + shape.rope_dim) * cache_element_size
    columns = -(-shape.kv_lora_rank // tile.r_split)
    partial_tiles = tile.block_h * columns * 4 * 2 / tile_bytes  # fp32 partial: written, then read by the merge

    block_n, batch, tokens = tile.block_n, shape.batch, shape.batch * mean
    costs = []  # costs[s - 1]: the cost of s splits
    for splits in range(1, useful + 1):
        tiles = -(-max(-(-longest // splits), floor) // block_n)  # tiles per split, as split_extent
        programs = row_programs * max(batch, math.ceil(tokens / (tiles * block_n)))
        waves = -(-programs // slots)
        if splits == 1:
            costs.append(waves * (tiles + SPLIT_FIXED_TILES))
        else:
            costs.append(waves * (tiles + SPLIT_FIXED_TILES + partial_tiles) + MERGE_TILES)
    limit = min(costs) * SPLIT_COST_TOLERANCE
    return next(index + 1 for index, value in enumerate(costs) if value <= limit)


def _check_length_hints(shape: DecodeShape, max_seq_len: int | None, mean_seq_len: float | None) -> None:
    if max_seq_len is not None and not 0 <= int(max_seq_len) <= shape.max_context:
        raise MLADecodeInputError(
            f"max_seq_len={max_seq_len} is outside the page table's range 0..{shape.max_context} "
            f"({shape.max_pages} pages of {shape.page_size} tokens)"
        )
    if mean_seq_len is not None and not 0 <= float(mean_seq_len) <= (
        shape.max_context if max_seq_len is None else int(max_seq_len)
    ):
        raise MLADecodeInputError(f"mean_seq_len={mean_seq_len} must lie between 0 and max_seq_len")


def choose_config(
    shape: DecodeShape,
    cache_dtype: torch.dtype,
    device: torch.device,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    mean_seq_len: float | None = None,
) -> DecodeConfig:
    """Tile, split count and chunk floor for one call; `num_splits` overrides the split heuristic.

    `max_seq_len` / `mean_seq_len` are the batch's real longest and mean lengths, if the caller knows
    them (they only size the split count; every length is still read from seq_lens on the device).
    """
    _check_length_hints(shape, max_seq_len, mean_seq_len)
    element_size = torch.empty((), dtype=cache_dtype).element_size()
    tile = choose_tile(shape.kv_lora_rank, shape.rope_dim, shape.rows, shape.page_size, cache_dtype)
    if device.type == "cuda":
        min_tokens = min_split_tokens_for(shape, element_size)
        if num_splits is None:
            num_splits = splits_for_gpu(shape, tile, element_size, _multiprocessor_count(device.index or 0),
                                        max_seq_len, mean_seq_len, resident_programs(device, shape, cache_dtype, tile))
    else:
        min_tokens = 1
        if num_splits is None:
            longest = shape.max_context if max_seq_len is None else max(1, int(max_seq_len))
            num_splits = min(CPU_MAX_SPLITS, max(1, math.ceil(longest / 16)))
    if int(num_splits) < 1:
        raise MLADecodeInputError(f"num_splits must be at least 1, got {num_splits}")
    return DecodeConfig.from_tile(tile, int(num_splits), min_tokens)


def _dot_dtype(cache_dtype: torch.dtype):
    """Operand dtype of the kernel's products: the cache dtype, except bf16 under the interpreter.

    The Triton interpreter does not support bf16 `tl.dot` (triton-lang/triton#11584: it multiplies the
    uint16 bit patterns), so there the bf16-rounded operands are widened to fp32 before each product.
    """
    if cache_dtype == torch.float32 or (INTERPRETED and cache_dtype == torch.bfloat16):
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[cache_dtype]


def row_alignment(kv_cache: torch.Tensor) -> int:
    """Largest power of two (<= MAX_ROW_ALIGN elements) dividing the row and page strides and the base.

    Every cache row then starts at a multiple of that many elements, which the kernel passes on to the
    compiler (`tl.multiple_of`) so it can use vector loads.
    """
    if kv_cache.stride(2) != 1:
        return 1
    element = kv_cache.element_size()
    address_elements = kv_cache.data_ptr() // element if kv_cache.data_ptr() % element == 0 else 1
    align = MAX_ROW_ALIGN
    while align > 1 and (kv_cache.stride(0) % align or kv_cache.stride(1) % align or address_elements % align):
        align //= 2
    return align


def _check_runnable(device: torch.device) -> None:
    if device.type == "cuda" and INTERPRETED:
        raise MLADecodeInputError(
            "TRITON_INTERPRET=1 is set, so the MLA decode kernel runs in the interpreter; unset it to use the GPU"
        )
    if device.type != "cuda" and not INTERPRETED:
        raise MLADecodeInputError(
            f"the Triton MLA decode kernel needs CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 "
            "before importing triton, or use mla_decode_reference"
        )


def _check_config(config: DecodeConfig, shape: DecodeShape) -> None:
    """Reject configs the kernel cannot run correctly (they come from callers, benchmarks and tuners)."""
    blocks = row_blocks(shape.kv_lora_rank, shape.rope_dim)
    problems = []
    if config.block_h < 16 or config.block_h & (config.block_h - 1):
        problems.append(f"block_h={config.block_h} is not a power of two >= 16")
    if config.block_n < 16 or config.block_n & (config.block_n - 1):
        problems.append(f"block_n={config.block_n} is not a power of two >= 16")
    if config.r_split not in (1, 2) or blocks.main // config.r_split < 16:
        problems.append(f"r_split={config.r_split} must be 1 or 2 with at least 16 columns per part")
    elif config.r_split == 2 and blocks.tail_has_latent(shape.kv_lora_rank):
        problems.append(f"r_split=2 needs a power-of-two latent width (R={shape.kv_lora_rank} is cut into "
                        f"{blocks.main} + a tail of {blocks.tail} columns)")
    if config.tokens_major and (config.r_split != 1 or blocks.tail_has_latent(shape.kv_lora_rank)):
        problems.append(f"tokens_major needs r_split=1 and the whole latent in one block (R={shape.kv_lora_rank}, "
                        f"r_split={config.r_split}, main block {blocks.main} columns)")
    if config.num_splits < 1 or config.min_split_tokens < 1:
        problems.append("num_splits and min_split_tokens must be at least 1")
    if problems:
        raise MLADecodeInputError("bad decode config: " + "; ".join(problems))


@dataclass
class KernelLaunch:
    """One kernel launch, fully described: what `_launch` runs and what `compile_check` compiles."""

    kernel: object
    grid: tuple[int, int, int]
    args: list  # positional run-time arguments, in the kernel's order
    constexprs: dict  # compile-time arguments (block sizes, dims, dtypes)
    num_warps: int
    num_stages: int
    launch_pdl: bool = False  # a programmatic dependent of the launch before it (see dependent_launch)

    def run(self):
        """Launch; returns what Triton returns (the CompiledKernel on a GPU)."""
        options = {"launch_pdl": True} if self.launch_pdl else {}
        return self.kernel[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps,
                                      num_stages=self.num_stages, **options)


@functools.lru_cache(maxsize=16)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def dependent_launch(device: torch.device) -> bool:
    """Whether the merge is launched as a programmatic dependent of the split kernel (PDL).

    On sm_90 and later a kernel launched with programmatic stream serialisation may be scheduled
    before the kernel ahead of it has finished: the merge's programs then do their setup while the
    last split programs run and wait (griddepcontrol.wait) only before reading the partials, instead
    of the GPU draining the split kernel, then launching the merge (on the H200 of 2026-12-04 the merge
    added about 3 µs to a 13-100 µs step beyond its own work).  Older GPUs lack the instructions, and
    the interpreter runs the launches one after the other anyway.  MLA_DECODE_PDL=0 turns it off.
    """
    if INTERPRETED or device.type != "cuda" or os.environ.get("MLA_DECODE_PDL", "1") == "0":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


def plan_launches(
    rows_latent: torch.Tensor,
    rows_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    shape: DecodeShape,
    config: DecodeConfig,
    out_dtype: torch.dtype,
    pdl: bool | None = None,
) -> tuple[list[KernelLaunch], torch.Tensor, torch.Tensor]:
    """Allocate the outputs and describe the split (and, with several splits, merge) launches.

    Queries are (batch, rows, ·).  Returns the launches and out (batch, rows, R), lse (batch, rows),
    which hold the result once every launch has run.  `pdl`: launch the merge as a programmatic
    dependent (None: where `dependent_launch` allows it).
    """
    _check_config(config, shape)
    device = kv_cache.device
    batch, rows, rank, rope_dim = shape.batch, shape.rows, shape.kv_lora_rank, shape.rope_dim
    out = torch.empty((batch, rows, rank), dtype=out_dtype, device=device)
    lse = torch.empty((batch, rows), dtype=torch.float32, device=device)
    splits = config.num_splits
    pdl = (dependent_launch(kv_cache.device) if pdl is None else pdl) and splits > 1
    if splits == 1:
        part_out = out.unsqueeze(2)  # (batch, rows, 1, R): the split kernel writes the final output
        part_lse = lse.unsqueeze(2)  # (batch, rows, 1)
    else:
        part_out = torch.empty((batch, rows, splits, rank), dtype=torch.float32, device=device)
        part_lse = torch.empty((batch, rows, splits), dtype=torch.float32, device=device)

    dot_dtype = _dot_dtype(kv_cache.dtype)
    blocks = row_blocks(rank, rope_dim)
    launches = [
        KernelLaunch(
            kernel=mla_decode_split_tokens_major_kernel if config.tokens_major else mla_decode_split_kernel,
            # ceil divisions as -(-a // b): triton.cdiv is a jit function, slow to call on the host
            grid=(-(-rows // config.block_h) * config.r_split, splits, batch),
            args=[
                rows_latent, rows_rope, kv_cache, page_table, seq_lens, part_out, part_lse,
                float(softmax_scale) * LOG2E,
                rows, shape.heads, shape.q_len, config.min_split_tokens,
                *rows_latent.stride(), *rows_rope.stride(), *kv_cache.stride(), *page_table.stride(),
                *part_out.stride(), *part_lse.stride(),
            ],
            constexprs=dict(
                KV_LORA_RANK=rank,
                ROPE_DIM=rope_dim,
                PAGE_SIZE=shape.page_size,
                BLOCK_H=config.block_h,
                BLOCK_N=config.block_n,
                BLOCK_R=blocks.main,
                BLOCK_T=blocks.tail,
                R_SPLIT=config.r_split,
                ROW_ALIGN=row_alignment(kv_cache),
                DOT_DTYPE=dot_dtype,
                DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
                LAUNCH_DEPENDENTS=pdl,
            ),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    ]
    if splits > 1:
        block_rows = min(MERGE_BLOCK_ROWS, pow2_at_least(rows, minimum=1))
        block_s = pow2_at_least(splits, minimum=MERGE_MIN_BLOCK_S)  # 8, 16, 32 or 64: few compiled variants
        # (rows, splits, columns) partials are read in one load: the column block shrinks as splits grow
        block_c = min(MERGE_BLOCK_C, pow2_at_least(rank), max(1, MERGE_TILE_ELEMENTS // (block_rows * block_s)))
        launches.append(
            KernelLaunch(
                kernel=mla_decode_merge_kernel,
                grid=(-(-rank // block_c), -(-rows // block_rows), batch),
                args=[
                    part_out, part_lse, seq_lens, out, lse, rows, splits, config.min_split_tokens,
                    *part_out.stride(), *part_lse.stride(), *out.stride(), *lse.stride(),
                ],
                constexprs=dict(
                    KV_LORA_RANK=rank,
                    SPLIT_BLOCK_N=config.block_n,
                    BLOCK_ROWS=block_rows,
                    BLOCK_C=block_c,
                    BLOCK_S=block_s,
                    WAIT_FOR_SPLITS=pdl,
                ),
                num_warps=4,
                num_stages=2,
                launch_pdl=pdl,
            )
        )
    return launches, out, lse


def _maybe_autotune(shape: DecodeShape, args: tuple, q_len_dim: bool, max_seq_len, mean_seq_len) -> None:
    """With MLA_DECODE_AUTOTUNE=1 on CUDA, time the candidate tiles of a shape the first time it is seen."""
    from mla_decode_triton import autotune, configs

    kv_cache = args[2]
    if not autotune.autotune_enabled(kv_cache.device):
        return
    key = configs.table_key(shape.kv_lora_rank, shape.rope_dim, shape.rows, shape.page_size, kv_cache.dtype)
    if key not in configs.measured_tiles():
        autotune.autotune(*args, max_seq_len=max_seq_len, mean_seq_len=mean_seq_len, q_len_dim=q_len_dim)


def _launch(*plan_args) -> tuple[torch.Tensor, torch.Tensor]:
    """Run split + merge (arguments as `plan_launches`); returns out (batch, rows, R), lse (batch, rows).

    On CUDA the split kernel's first launch per tile also records how many of its programs a
    multiprocessor holds (`resident_programs`), which sizes the split count of later calls.
    """
    launches, out, lse = plan_launches(*plan_args)
    kv_cache, shape, config = plan_args[2], plan_args[6], plan_args[7]
    for index, launch in enumerate(launches):
        compiled = launch.run()
        if index == 0 and kv_cache.device.type == "cuda":
            _record_residency(compiled, _residency_key(kv_cache.device, shape, kv_cache.dtype, config.tile))
    return out, lse


def mla_decode(
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
    config: DecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode (one query token per sequence) with the Triton split-KV kernel.

    Same inputs and outputs as `mla_decode_reference`: q_latent (batch, heads, R), q_rope (batch,
    heads, D), kv_cache (num_pages, page_size, R + D) (a column slice of wider, padded rows is fine),
    page_table (batch, max_pages) int, seq_lens (batch,) int (0 gives out = 0, lse = -inf).  Returns out
    (batch, heads, R) in q_latent's dtype and lse (batch, heads) fp32.  `max_seq_len` / `mean_seq_len`
    (keyword only): the batch's real longest / mean length, which size the split count without a device
    read.  `num_splits` forces the split count; `config` forces every launch parameter.
    """
    check_decode_inputs(q_latent, q_rope, kv_cache, page_table, seq_lens, kv_lora_rank)
    # one query token is the q_len = 1 case of the multi-token decode: the same launch, rows = heads
    out, lse = mla_decode_multi(q_latent[:, None], q_rope[:, None], kv_cache, page_table, seq_lens, softmax_scale,
                                kv_lora_rank, num_splits, max_seq_len=max_seq_len, mean_seq_len=mean_seq_len,
                                config=config)  # (batch, 1, heads, R), (batch, 1, heads)
    return out[:, 0], lse[:, 0]


def mla_decode_multi(
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
    config: DecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode with q_len causal query tokens per sequence (speculative decoding).

    q_latent (batch, q_len, heads, R), q_rope (batch, q_len, heads, D); seq_lens counts the q_len new
    tokens (already in the cache) and must be >= q_len; query i sees tokens t <= seq_len - q_len + i.
    All q_len * heads rows of a sequence share each cache tile.  Returns out (batch, q_len, heads, R)
    and lse (batch, q_len, heads), like `mla_decode_multi_reference`.
    """
    shape = check_decode_inputs(q_latent, q_rope, kv_cache, page_table, seq_lens, kv_lora_rank, q_len_dim=True)
    _check_runnable(kv_cache.device)
    if config is None and num_splits is None:
        _maybe_autotune(shape, (q_latent, q_rope, kv_cache, page_table, seq_lens, softmax_scale), True,
                        max_seq_len, mean_seq_len)
    if config is None:
        config = choose_config(shape, kv_cache.dtype, kv_cache.device, num_splits, max_seq_len, mean_seq_len)
    batch, q_len, heads = shape.batch, shape.q_len, shape.heads
    rows_latent = q_latent.reshape(batch, q_len * heads, shape.kv_lora_rank)  # (batch, q_len * heads, R)
    rows_rope = q_rope.reshape(batch, q_len * heads, shape.rope_dim)  # (batch, q_len * heads, D)
    out, lse = _launch(
        rows_latent, rows_rope, kv_cache, page_table, seq_lens, softmax_scale, shape, config, q_latent.dtype
    )
    out = out.reshape(batch, q_len, heads, shape.kv_lora_rank)  # (batch, q_len, heads, R)
    lse = lse.reshape(batch, q_len, heads)  # (batch, q_len, heads)
    return out, lse
