"""A paged latent cache: per token and layer, only the normalised latent (R) and the rotated RoPE key (D).

This is the whole point of MLA at inference: a source GQA model caches 2 x kv_heads x head_dim values
per token and layer, the absorbed MLA form caches R + D, shared by every head.  The layout is exactly
the decode kernel's contract (`mla_decode_triton`): one (num_pages, page_size, R + D) tensor per layer
with the latent in the first R columns and the rotated key in the last D, a page table that maps each
sequence's logical pages to physical ones, and the sequence lengths.

Why pages: sequences of different lengths grow by one token per step and finish at different times.
Pages let each sequence take memory a page at a time from one shared pool and give it back when it
finishes, without copying, and without reserving max_length slots for every sequence.

Bookkeeping (page lists, lengths) lives in Python: it changes once per token per sequence, costs
nothing next to the model, and is turned into the small int32 page-table / length tensors once per
step.  All layers share one page assignment (a token sits in the same slot in every layer), so the
storage is a single (num_layers, num_pages, page_size, R + D) allocation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .errors import GenerationSettingsError


@dataclass
class _Sequence:
    pages: list[int] = field(default_factory=list)
    length: int = 0


class PagedLatentCache:
    """Fixed pool of pages shared by all sequences; every layer stores (R + D) values per token."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        if page_size < 1 or num_pages < 1:
            raise GenerationSettingsError(
                f"the latent cache needs page_size >= 1 and num_pages >= 1, got {page_size} and {num_pages}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.width = kv_lora_rank + rope_dim
        # (layers, pages, page_size, R + D): storage[l] is the kernel's kv_cache for layer l
        self.storage = torch.zeros(num_layers, num_pages, page_size, self.width, dtype=dtype, device=device)
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low page numbers first
        self._sequences: dict[int, _Sequence] = {}
        self._next_id = 0
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
        self._sequences[seq_id] = _Sequence()
        return seq_id

    def release(self, seq_id: int) -> None:
        """Give a finished sequence's pages back to the pool."""
        sequence = self._sequences.pop(seq_id)
        self._free.extend(reversed(sequence.pages))

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
            sequence.pages.append(self._free.pop())
        self.peak_pages_in_use = max(self.peak_pages_in_use, self.pages_in_use)
        slots = [sequence.pages[p // self.page_size] * self.page_size + p % self.page_size for p in positions]
        sequence.length = start + count
        self.tokens_written += count
        return positions, slots

    # ------------------------------------------------------------------ tensors for the model / kernel
    def layer(self, index: int) -> torch.Tensor:
        """The kernel's kv_cache for one layer: (num_pages, page_size, R + D), a view of the storage."""
        return self.storage[index]

    def write(self, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store rows (N, R + D) (latent, rotated key) at flat slots (N,) of one layer."""
        flat = self.storage[layer].view(self.num_pages * self.page_size, self.width)  # (slots, R + D)
        flat.index_copy_(0, slots, rows.to(flat.dtype))

    def page_table(self, seq_ids: list[int]) -> torch.Tensor:
        """(batch, max_pages) int32; entries past a sequence's last page are 0 (never read: lengths mask them)."""
        width = max(len(self._sequences[s].pages) for s in seq_ids)
        table = [self._sequences[s].pages + [0] * (width - len(self._sequences[s].pages)) for s in seq_ids]
        return torch.tensor(table, dtype=torch.int32, device=self.storage.device)

    def seq_lens(self, seq_ids: list[int]) -> torch.Tensor:
        """(batch,) int32 number of cached tokens per sequence."""
        return torch.tensor([self._sequences[s].length for s in seq_ids], dtype=torch.int32, device=self.storage.device)

    # ------------------------------------------------------------------ accounting
    @property
    def values_per_token_per_layer(self) -> int:
        return self.width

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token costs across all layers: layers x (R + D) x element size."""
        return self.num_layers * self.width * self.storage.element_size()

    @property
    def bytes_allocated(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    @property
    def tokens_stored(self) -> int:
        return sum(s.length for s in self._sequences.values())

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def bytes_in_use(self) -> int:
        """Bytes of the pages currently held by sequences (a partly filled last page counts whole)."""
        return self.pages_in_use * self.page_size * self.num_layers * self.width * self.storage.element_size()
