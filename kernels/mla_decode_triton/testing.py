"""Build decode inputs for tests and benchmarks: a logical cache laid out in shuffled, poisoned pages.

Kept in the package (not in tests/) so that any test file, or a user checking the kernel on their own
GPU, builds the same adversarial inputs.

The logical cache is a dense (batch, max_len, R + D) tensor in token order.  `paginate` scatters each
sequence's tokens into physical pages of any size, in a random page order, and leaves everything no
sequence owns - the tail of each last page, spare pages, page-table entries past a sequence's last
page, and optional padding columns past R + D in every row - filled with poison (NaN in the cache, an
out-of-range page index in the table).  A kernel that reads anything past a sequence's length (or past
a row's payload) then produces NaN or crashes instead of passing by luck.  The page table may also be
made much wider than the lengths need, like a runtime's preallocated table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

UNUSED_PAGE = 2**30  # page-table filler past a sequence's last page: out of range on purpose
# How close the kernel's output must be to the fp32 reference, per cache dtype (the kernel rounds softmax
# probabilities to the cache dtype before the second product), and its log-sum-exp (always fp32).
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
LSE_TOLERANCE = dict(atol=1e-4, rtol=1e-5)


@dataclass
class DecodeInputs:
    """Arguments of one `mla_decode` call plus the logical cache they encode."""

    q_latent: torch.Tensor  # (batch, heads, R) or (batch, q_len, heads, R)
    q_rope: torch.Tensor  # (batch, heads, D) or (batch, q_len, heads, D)
    kv_cache: torch.Tensor  # (num_pages, page_size, R + D)
    page_table: torch.Tensor  # (batch, max_pages) int32
    seq_lens: torch.Tensor  # (batch,) int32
    softmax_scale: float
    logical: torch.Tensor  # (batch, max_len, R + D), token order, zeros past each length

    def args(self) -> tuple:
        return (self.q_latent, self.q_rope, self.kv_cache, self.page_table, self.seq_lens, self.softmax_scale)


def paginate(
    logical: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    generator: torch.Generator | None = None,
    spare_pages: int = 2,
    poison: float = float("nan"),
    row_width: int | None = None,
    table_pages: int | None = None,
    device: str | torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter a logical (batch, max_len, width) cache into shuffled physical pages.

    Returns kv_cache (num_pages, page_size, width) in logical's dtype and page_table (batch, max_pages)
    int32 with max_pages = max(ceil(max_len / page_size), table_pages).  Only ceil(seq_len / page_size)
    pages are allocated per sequence (like a real paged allocator); unused slots hold `poison`.  With
    `row_width` > width the storage rows are that wide (padding columns hold `poison`) and kv_cache is
    the (num_pages, page_size, width) column slice of it, as `PagedLatentCache` lays rows out.  The
    pages are built on the CPU and moved to `device` (default: logical's) whole, so a slice stays one.
    """
    batch, max_len, width = logical.shape
    lens = [int(n) for n in seq_lens.tolist()]
    max_pages = max(-(-max_len // page_size), table_pages or 0)
    pages_used = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_used) + spare_pages
    order = torch.randperm(num_pages, generator=generator).tolist()  # physical page of each allocation
    storage_width = width if row_width is None else row_width
    if storage_width < width:
        raise ValueError(f"row_width {row_width} is narrower than the rows ({width})")
    storage = torch.full((num_pages, page_size, storage_width), poison, dtype=logical.dtype)
    page_table = torch.full((batch, max_pages), UNUSED_PAGE, dtype=torch.int32)
    next_allocation = 0
    for seq, length in enumerate(lens):
        for page in range(pages_used[seq]):
            physical = order[next_allocation]
            next_allocation += 1
            page_table[seq, page] = physical
            first = page * page_size
            count = min(page_size, length - first)
            storage[physical, :count, :width] = logical[seq, first : first + count]
    device = logical.device if device is None else torch.device(device)
    storage = storage.to(device)
    return storage[..., :width], page_table.to(device)  # (num_pages, page_size, width) view


def make_decode_inputs(
    batch: int,
    heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    seq_lens: list[int],
    page_size: int,
    dtype: torch.dtype = torch.float32,
    q_len: int | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    poison: float = float("nan"),
    row_width: int | None = None,
    table_pages: int | None = None,
) -> DecodeInputs:
    """Random queries and cache for one decode call (queries get a q_len axis when q_len is given).

    Values are drawn in float32 and rounded to `dtype`; the softmax scale is 1/sqrt(R + D) as in
    DeepSeek's absorbed attention, giving softmaxes that are neither flat nor one-hot.  `row_width`
    and `table_pages`: see `paginate`.  A length of 0 is allowed (an idle slot of a batch).
    """
    if len(seq_lens) != batch:
        raise ValueError(f"need {batch} sequence lengths, got {len(seq_lens)}")
    generator = torch.Generator().manual_seed(seed)
    width = kv_lora_rank + rope_dim
    max_len = max(1, max(seq_lens))
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    logical = torch.randn(batch, max_len, width, generator=generator).to(dtype)  # (batch, max_len, R + D)
    valid = torch.arange(max_len)[None, :] < lens[:, None]  # (batch, max_len)
    logical = torch.where(valid[..., None], logical, torch.zeros((), dtype=dtype))
    query_shape = (batch, heads) if q_len is None else (batch, q_len, heads)
    q_latent = torch.randn(*query_shape, kv_lora_rank, generator=generator).to(dtype)
    q_rope = torch.randn(*query_shape, rope_dim, generator=generator).to(dtype)
    device = torch.device(device)
    kv_cache, page_table = paginate(logical, lens, page_size, generator=generator, poison=poison,
                                    row_width=row_width, table_pages=table_pages, device=device)
    return DecodeInputs(
        q_latent=q_latent.to(device),
        q_rope=q_rope.to(device),
        kv_cache=kv_cache,
        page_table=page_table,
        seq_lens=lens.to(device),
        softmax_scale=width**-0.5,
        logical=logical.to(device),
    )
