"""Launch the Triton MLA decode kernels: pick block sizes and the split count, allocate, launch.

Choices and why (none of this changes results beyond fp rounding; tests pin that down):

* BLOCK_R / BLOCK_D: next power of two >= R / D (at least 16, the smallest `tl.dot` operand).  R and D
  need not be powers of two; the padding columns are masked to zero.
* BLOCK_H (query rows per program): as many rows as the sequence has, rounded up to a power of two and
  at least 16 (tl.dot's minimum M), so that all heads share each cache tile - the whole point of the
  absorbed layout.  It is capped so the fp32 output accumulator (BLOCK_H x BLOCK_R) stays within
  ~8K elements (32 KB of registers across the program): 16 rows at R = 512, 64 rows at R <= 128.
  With more rows than the cap (128 heads at R = 512) several row-block programs read the same chunk;
  the grid orders them next to each other so the re-reads come from L2, not HBM.  Compiled for sm_90
  (`python -m mla_decode_triton.compile_check`), 16 rows x 512 with 8 warps takes ~100 registers per
  thread and no spills (two programs per multiprocessor); 32 rows need 16 warps to stay unspilled and
  64 rows spill, which is why the cap shrinks as R grows.
* num_warps: 8 once the accumulator reaches that budget, else 4 (registers per thread stay ~100-130).
* BLOCK_N (cache tokens per tile): the largest power of two in [16, 64] whose tile (BLOCK_N x (R + D)
  cache values) fits ~48 KB, so two pipeline stages fit in shared memory with room for a second
  program on the multiprocessor: 32 at 512+64 bf16, 64 for the small SmolLM2 shapes.
* num_splits (flash-decoding): decode with a small batch has far fewer (sequence, row block) programs
  than multiprocessors, so each context is cut into chunks handled in parallel and merged afterwards.
  On CUDA the target is ~2 programs per multiprocessor (one to run, one to hide the next one's
  start-up), limited so that each split covers at least MIN_TOKENS_PER_SPLIT tokens (a split that
  only loads the queries and writes a partial is pure overhead) and so that the fp32 partial outputs
  written and re-read by the merge stay below ~25 % of the cache bytes read.  The context length used
  is the page table's capacity (max_pages * page_size), a bound known without reading seq_lens back
  from the device, so the launcher never synchronises and stays CUDA-graph friendly.  On CPU (the
  Triton interpreter, used by the tests) every program is slow Python, so at most 2 splits are used:
  enough to exercise the merge stage by default.
* With one split the first kernel writes the final output directly and the merge is skipped.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mla_decode_triton.errors import MLADecodeInputError
from mla_decode_triton.inputs import DecodeShape, check_decode_inputs
from mla_decode_triton.kernel import LOG2E, mla_decode_merge_kernel, mla_decode_split_kernel

ACCUMULATOR_BUDGET = 8192  # fp32 elements of BLOCK_H x BLOCK_R per program
TILE_BYTES_BUDGET = 48 * 1024  # bytes of one BLOCK_N x (R + D) cache tile
MAX_BLOCK_H = 64
MIN_TOKENS_PER_SPLIT = 128
MAX_SPLITS = 64
PARTIAL_TRAFFIC_FRACTION = 0.25
CPU_MAX_SPLITS = 2
MERGE_BLOCK_C = 128
MERGE_SPLITS_PER_STEP = 8

INTERPRETED = type(mla_decode_split_kernel).__name__ == "InterpretedFunction"


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of one decode call (see the module docstring for how they are chosen)."""

    block_h: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int


def _pow2_at_least(value: int, minimum: int = 16) -> int:
    return max(minimum, triton.next_power_of_2(value))


def _pow2_at_most(value: int) -> int:
    return 1 << max(0, int(value).bit_length() - 1)


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def splits_for_gpu(shape: DecodeShape, block_h: int, cache_element_size: int, multiprocessors: int) -> int:
    """Splits per sequence so that batch x row blocks x splits is ~2 programs per multiprocessor.

    Capped by MIN_TOKENS_PER_SPLIT, by the partial-output traffic budget and by MAX_SPLITS (see the
    module docstring).  A pure function of the sizes, so it is testable without a GPU.
    """
    row_blocks = math.ceil(shape.rows / block_h)
    wanted = math.ceil(2 * multiprocessors / (shape.batch * row_blocks))
    useful = max(1, math.ceil(shape.max_context / MIN_TOKENS_PER_SPLIT))
    cache_bytes = shape.max_context * (shape.kv_lora_rank + shape.rope_dim) * cache_element_size
    partial_bytes_per_split = shape.rows * shape.kv_lora_rank * 4 * 2  # fp32, written then read
    traffic_cap = max(1, int(PARTIAL_TRAFFIC_FRACTION * cache_bytes / partial_bytes_per_split))
    return max(1, min(wanted, useful, traffic_cap, MAX_SPLITS))


def choose_num_splits(
    shape: DecodeShape, block_h: int, cache_element_size: int, device: torch.device
) -> int:
    """The split count for this device: `splits_for_gpu` on CUDA, at most CPU_MAX_SPLITS on CPU."""
    if device.type != "cuda":
        return min(CPU_MAX_SPLITS, max(1, math.ceil(shape.max_context / 16)))
    return splits_for_gpu(shape, block_h, cache_element_size, _multiprocessor_count(device.index or 0))


def choose_config(
    shape: DecodeShape, cache_dtype: torch.dtype, device: torch.device, num_splits: int | None = None
) -> DecodeConfig:
    """Block sizes, warps and split count for one call; `num_splits` overrides the heuristic."""
    block_r = _pow2_at_least(shape.kv_lora_rank)
    block_d = _pow2_at_least(shape.rope_dim)
    element_size = torch.empty((), dtype=cache_dtype).element_size()
    row_cap = min(MAX_BLOCK_H, max(16, ACCUMULATOR_BUDGET // block_r))
    block_h = min(_pow2_at_least(shape.rows), row_cap)
    tokens_in_budget = TILE_BYTES_BUDGET // ((block_r + block_d) * element_size)
    block_n = min(64, max(16, _pow2_at_most(tokens_in_budget)))
    if num_splits is None:
        num_splits = choose_num_splits(shape, block_h, element_size, device)
    elif int(num_splits) < 1:
        raise MLADecodeInputError(f"num_splits must be at least 1, got {num_splits}")
    num_warps = 8 if block_h * block_r >= ACCUMULATOR_BUDGET else 4
    return DecodeConfig(block_h=block_h, block_n=block_n, num_splits=int(num_splits), num_warps=num_warps, num_stages=2)


def _dot_dtype(cache_dtype: torch.dtype):
    """Operand dtype of the kernel's products: the cache dtype, except bf16 under the interpreter.

    The Triton interpreter does not support bf16 `tl.dot` (triton-lang/triton#11584: it multiplies the
    uint16 bit patterns), so there the bf16-rounded operands are widened to fp32 before each product.
    """
    if cache_dtype == torch.float32 or (INTERPRETED and cache_dtype == torch.bfloat16):
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[cache_dtype]


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


@dataclass
class KernelLaunch:
    """One kernel launch, fully described: what `_launch` runs and what `compile_check` compiles."""

    kernel: object
    grid: tuple[int, int, int]
    args: list  # positional run-time arguments, in the kernel's order
    constexprs: dict  # compile-time arguments (block sizes, dims, dtypes)
    num_warps: int
    num_stages: int

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages)


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
) -> tuple[list[KernelLaunch], torch.Tensor, torch.Tensor]:
    """Allocate the outputs and describe the split (and, with several splits, merge) launches.

    Queries are (batch, rows, ·).  Returns the launches and out (batch, rows, R), lse (batch, rows),
    which hold the result once every launch has run.
    """
    device = kv_cache.device
    batch, rows, rank, rope_dim = shape.batch, shape.rows, shape.kv_lora_rank, shape.rope_dim
    out = torch.empty((batch, rows, rank), dtype=out_dtype, device=device)
    lse = torch.empty((batch, rows), dtype=torch.float32, device=device)
    splits = config.num_splits
    if splits == 1:
        part_out = out.unsqueeze(2)  # (batch, rows, 1, R): the split kernel writes the final output
        part_lse = lse.unsqueeze(2)  # (batch, rows, 1)
    else:
        part_out = torch.empty((batch, rows, splits, rank), dtype=torch.float32, device=device)
        part_lse = torch.empty((batch, rows, splits), dtype=torch.float32, device=device)

    dot_dtype = _dot_dtype(kv_cache.dtype)
    launches = [
        KernelLaunch(
            kernel=mla_decode_split_kernel,
            grid=(triton.cdiv(rows, config.block_h), splits, batch),
            args=[
                rows_latent, rows_rope, kv_cache, page_table, seq_lens, part_out, part_lse,
                float(softmax_scale) * LOG2E,
                rows, shape.heads, shape.q_len,
                *rows_latent.stride(), *rows_rope.stride(), *kv_cache.stride(), *page_table.stride(),
                *part_out.stride(), *part_lse.stride(),
            ],
            constexprs=dict(
                KV_LORA_RANK=rank,
                ROPE_DIM=rope_dim,
                PAGE_SIZE=shape.page_size,
                BLOCK_H=config.block_h,
                BLOCK_N=config.block_n,
                BLOCK_R=_pow2_at_least(rank),
                BLOCK_D=_pow2_at_least(rope_dim),
                DOT_DTYPE=dot_dtype,
                DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
            ),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    ]
    if splits > 1:
        block_c = min(MERGE_BLOCK_C, _pow2_at_least(rank))
        block_splits = triton.next_power_of_2(splits)
        launches.append(
            KernelLaunch(
                kernel=mla_decode_merge_kernel,
                grid=(triton.cdiv(rank, block_c), rows, batch),
                args=[
                    part_out, part_lse, out, lse, splits,
                    *part_out.stride(), *part_lse.stride(), *out.stride(), *lse.stride(),
                ],
                constexprs=dict(
                    KV_LORA_RANK=rank,
                    BLOCK_SPLITS=block_splits,
                    SPLITS_PER_STEP=min(MERGE_SPLITS_PER_STEP, block_splits),
                    BLOCK_C=block_c,
                ),
                num_warps=4,
                num_stages=2,
            )
        )
    return launches, out, lse


def _launch(*plan_args) -> tuple[torch.Tensor, torch.Tensor]:
    """Run split + merge (arguments as `plan_launches`); returns out (batch, rows, R), lse (batch, rows)."""
    launches, out, lse = plan_launches(*plan_args)
    for launch in launches:
        launch.run()
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
    config: DecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode (one query token per sequence) with the Triton split-KV kernel.

    Same inputs and outputs as `mla_decode_reference`: q_latent (batch, heads, R), q_rope (batch,
    heads, D), kv_cache (num_pages, page_size, R + D), page_table (batch, max_pages) int, seq_lens
    (batch,) int >= 1.  Returns out (batch, heads, R) in q_latent's dtype and lse (batch, heads) fp32.
    `num_splits` forces the split count; `config` (keyword only, for benchmarks and tuning) forces every
    launch parameter.
    """
    shape = check_decode_inputs(q_latent, q_rope, kv_cache, page_table, seq_lens, kv_lora_rank)
    _check_runnable(kv_cache.device)
    if config is None:
        config = choose_config(shape, kv_cache.dtype, kv_cache.device, num_splits)
    return _launch(q_latent, q_rope, kv_cache, page_table, seq_lens, softmax_scale, shape, config, q_latent.dtype)


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
    if config is None:
        config = choose_config(shape, kv_cache.dtype, kv_cache.device, num_splits)
    batch, q_len, heads = shape.batch, shape.q_len, shape.heads
    rows_latent = q_latent.reshape(batch, q_len * heads, shape.kv_lora_rank)  # (batch, q_len * heads, R)
    rows_rope = q_rope.reshape(batch, q_len * heads, shape.rope_dim)  # (batch, q_len * heads, D)
    out, lse = _launch(
        rows_latent, rows_rope, kv_cache, page_table, seq_lens, softmax_scale, shape, config, q_latent.dtype
    )
    out = out.reshape(batch, q_len, heads, shape.kv_lora_rank)  # (batch, q_len, heads, R)
    lse = lse.reshape(batch, q_len, heads)  # (batch, q_len, heads)
    return out, lse
