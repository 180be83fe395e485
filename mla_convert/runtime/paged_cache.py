"""A paged latent cache: per token and layer, only the normalised latent (R) and the rotated RoPE key (D).

This is the whole point of MLA at inference: a source GQA model caches 2 x kv_heads x head_dim values
per token and layer, the absorbed MLA form caches R + D, shared by every head.  The layout is exactly
the decode kernel's contract (`mla_decode_triton`): one (num_pages, page_size, R + D) tensor per layer
with the latent in the first R columns and the rotated key in the last D, a page table that maps each
sequence's logical pages to physical ones, and the sequence lengths.

Why pages: sequences of different lengths grow by one token per step and finish at different times.
Pages let each sequence take memory a page at a time from one shared pool and give it back when it
finishes, without copying, and without reserving max_length slots for every sequence.

Rows padded to 16 bytes.  Each stored row is R + D values rounded up to a multiple of 16 bytes (e.g.
26 bf16 values -> 32), and `layer(l)` hands the kernel the (num_pages, page_size, R + D) column slice.
Aligned rows let the kernel read them with vector loads (and cp.async) instead of 2- or 4-byte loads
(see `mla_decode_triton.compile_check`).  The padding is never read or written and is not cache
payload: `bytes_per_token`, `bytes_allocated` and `bytes_in_use` count R + D values only, and
`padding_bytes_per_token` says what the alignment costs on top (nothing for the usual shapes: 512+64,
144+48, 64+32, 24+8 and 4+4 are already 16-byte rows in bf16).

Bookkeeping (page lists, lengths) lives in Python: it changes once per token per sequence and costs
nothing next to the model.  The page table the kernel reads is a device tensor kept up to date in
place: every sequence owns one row of it for its lifetime, and only the entries of newly taken pages are
written (in one batched copy, at most once per page_size steps per sequence), so a decode step no longer
rebuilds and uploads the whole table.  The table's address stays fixed (it only grows, rarely, when a
sequence outgrows its width or more sequences are open than it has rows; `table_version` counts those
reallocations) so a captured CUDA graph can read it.  All layers share one page assignment (a token
sits in the same slot in every layer), so the storage is a single (num_layers, num_pages, page_size,
padded width) allocation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .errors import GenerationSettingsError

ROW_ALIGN_BYTES = 16
DEFAULT_TABLE_ROWS = 8
DEFAULT_TABLE_PAGES = 64


@dataclass
class _Sequence:
    row: int  # its row of the device page table
    pages: list[int] = field(default_factory=list)
    length: int = 0


class PagedLatentCache:
    """Fixed pool of pages shared by all sequences; every layer stores (R + D) values per token."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype, device: torch.device | str, max_sequences: int | None = None,
                 max_pages_per_sequence: int | None = None):
        if page_size < 1 or num_pages < 1:
            raise GenerationSettingsError(
                f"the latent cache needs page_size >= 1 and num_pages >= 1, got {page_size} and {num_pages}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.width = kv_lora_rank + rope_dim
        element_size = torch.empty((), dtype=dtype).element_size()
        align = max(1, ROW_ALIGN_BYTES // element_size)
        self.row_width = math.ceil(self.width / align) * align  # stored values per row (>= width)
        # (layers, pages, page_size, row_width): storage[l, ..., :width] is the kernel's kv_cache for layer l
        self.storage = torch.zeros(num_layers, num_pages, page_size, self.row_width, dtype=dtype, device=device)
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low page numbers first
        self._sequences: dict[int, _Sequence] = {}
        self._next_id = 0
        self._free_rows: list[int] = []
        self._next_row = 0
        rows = max_sequences or DEFAULT_TABLE_ROWS
        width = min(num_pages, max_pages_per_sequence or DEFAULT_TABLE_PAGES)
        # (rows, pages per sequence) int32: row r holds the physical pages of the sequence that owns it
        self.table = torch.zeros(rows, max(1, width), dtype=torch.int32, device=device)
        self.table_version = 0  # bumped whenever `table` is reallocated (captured graphs must be rebuilt)
        self._pending: list[tuple[int, int, int]] = []  # (row, logical page, physical page) not yet on device
        self.tokens_written = 0  # every token ever appended (what the cache has had to hold in total)
        self.peak_pages_in_use = 0

    @staticmethod
    def pages_needed(lengths: list[int], page_size: int) -> int:
        """Pages that hold sequences of these final lengths, each in its own pages."""
        return sum(math.ceil(length / page_size) for length in lengths)

    # ------------------------------------------------------------------ sequences
    def add_sequence(self) -> int:
        seq_id = self._next_id
        self._next_id += 1
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row = self._next_row
            self._next_row += 1
            if row >= self.table.shape[0]:
                self._grow_table(rows=2 * self.table.shape[0])
        self._sequences[seq_id] = _Sequence(row=row)
        return seq_id

    def release(self, seq_id: int) -> None:
        """Give a finished sequence's pages (and its page-table row) back to the pool."""
        sequence = self._sequences.pop(seq_id)
        self._free.extend(reversed(sequence.pages))
        self._free_rows.append(sequence.row)
        self._pending = [entry for entry in self._pending if entry[0] != sequence.row]

    def row(self, seq_id: int) -> int:
        """The sequence's row in the device page table `table`."""
        return self._sequences[seq_id].row

    def length(self, seq_id: int) -> int:
        return self._sequences[seq_id].length

    def append(self, seq_id: int, count: int) -> tuple[list[int], list[int]]:
        """Make room for `count` more tokens of a sequence: their positions and flat slot indices.

        A slot index addresses a row of `storage[l].view(num_pages * page_size, R + D)`, the same in
        every layer.  Pages are taken from the pool as the sequence crosses page boundaries.
        """
        sequence = self._sequences[seq_id]
        start = sequence.length
        positions = list(range(start, start + count))
        pages_after = math.ceil((start + count) / self.page_size)
        while len(sequence.pages) < pages_after:
            if not self._free:
                raise GenerationSettingsError(
                    f"the latent cache is full ({self.num_pages} pages of {self.page_size} tokens); allocate more pages"
                )
            page = self._free.pop()
            self._pending.append((sequence.row, len(sequence.pages), page))
            sequence.pages.append(page)
        if pages_after > self.table.shape[1]:
            self._grow_table(pages=max(pages_after, min(self.num_pages, 2 * self.table.shape[1])))
        self.peak_pages_in_use = max(self.peak_pages_in_use, self.pages_in_use)
        slots = [sequence.pages[p // self.page_size] * self.page_size + p % self.page_size for p in positions]
        sequence.length = start + count
        self.tokens_written += count
        return positions, slots

    # ------------------------------------------------------------------ tensors for the model / kernel
    def layer(self, index: int) -> torch.Tensor:
        """The kernel's kv_cache for one layer: (num_pages, page_size, R + D), a view of the padded storage."""
        return self.storage[index, ..., : self.width]

    def write(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store rows (N, R + D) (latent, rotated key) at flat slots (N,) of one layer."""
        flat = self.storage[layer].view(self.num_pages * self.page_size, self.row_width)  # (slots, row_width)
        flat[:, : self.width].index_copy_(0, slots, rows.to(flat.dtype))

    def _grow_table(self, rows: int | None = None, pages: int | None = None) -> None:
        """Reallocate the device page table larger (rare); its content is kept."""
        old = self.table
        grown = torch.zeros(rows or old.shape[0], pages or old.shape[1], dtype=old.dtype, device=old.device)
        grown[: old.shape[0], : old.shape[1]] = old
        self.table = grown
        self.table_version += 1

    def device_table(self) -> torch.Tensor:
        """The device page table (table rows, pages per sequence) int32, with every page taken so far.

        Entries of pages taken since the last call are written now, in one indexed copy.  Entries past a
        sequence's last page are stale or 0; lengths keep the kernel (and the reference) from reading them.
        """
        if self._pending:
            updates = torch.tensor(self._pending, dtype=torch.int64).to(self.table.device)  # (n, 3)
            self.table.index_put_((updates[:, 0], updates[:, 1]), updates[:, 2].to(self.table.dtype))
            self._pending.clear()
        return self.table

    def page_table(self, seq_ids: list[int]) -> torch.Tensor:
        """(batch, max_pages) int32 built from the bookkeeping; entries past a sequence's last page are 0."""
        width = max(len(self._sequences[s].pages) for s in seq_ids)
        table = [self._sequences[s].pages + [0] * (width - len(self._sequences[s].pages)) for s in seq_ids]
        return torch.tensor(table, dtype=torch.int32, device=self.storage.device)

    def seq_lens(self, seq_ids: list[int]) -> torch.Tensor:
        """(batch,) int32 number of cached tokens per sequence."""
        return torch.tensor([self._sequences[s].length for s in seq_ids], dtype=torch.int32, device=self.storage.device)

    # ------------------------------------------------------------------ accounting
    # Payload only: the row padding (row_width - width values) is not cache content and is reported apart.
    @property
    def values_per_token_per_layer(self) -> int:
        return self.width

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token costs across all layers: layers x (R + D) x element size (padding excluded)."""
        return self.num_layers * self.width * self.storage.element_size()

    @property
    def padding_bytes_per_token(self) -> int:
        """Bytes per token the 16-byte row alignment adds on top of the payload (0 for aligned shapes)."""
        return self.num_layers * (self.row_width - self.width) * self.storage.element_size()

    @property
    def bytes_allocated(self) -> int:
        """Payload bytes of the whole pool (every slot of every page); the storage adds the padding."""
        return self.num_pages * self.page_size * self.bytes_per_token

    @property
    def storage_bytes(self) -> int:
        """Bytes actually allocated, padding included."""
        return self.storage.numel() * self.storage.element_size()

    @property
    def tokens_stored(self) -> int:
        return sum(s.length for s in self._sequences.values())

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def bytes_in_use(self) -> int:
        """Payload bytes of the pages currently held by sequences (a partly filled last page counts whole)."""
        return self.pages_in_use * self.page_size * self.bytes_per_token
