"""Replay the decode step of an `AbsorbedMLAModel` as a CUDA graph.

Why: a decode step of a small model is hundreds of tiny kernel launches (norms, projections, RoPE, the
cache write, the attention kernel and its merge, per layer); at batch sizes where the GPU finishes each
in a few microseconds the step is bound by Python and launch latency, not by the GPU.  A captured graph
replays the whole step with one launch.

What makes the step capturable: its only inputs are four int64 vectors (token ids, positions, cache
slots, page-table rows), copied into a static device buffer before each replay; everything else it reads
lives at fixed addresses (the weights, the cache storage, the cache's device page table, which is
updated in place).  seq_lens is computed inside the step as positions + 1, and nothing in it reads a
value back to the host (no .item(), no data-dependent shapes).  The decode kernel's split count is fixed
at capture, so graphs are keyed by the batch size and by the power-of-two buckets of the batch's
longest and mean length (which size the split count, see `mla_decode_triton.launcher`); lengths grow
slowly, so a generation captures a handful of graphs.  A reallocated page table (`table_version`)
invalidates every graph of that cache.

Capture follows the PyTorch recipe: one eager warm-up run on a side stream (it compiles the Triton
kernels, and it is a real decode step: it writes this step's latents to the cache), then the capture,
then the replay, which recomputes the same step and writes the same values to the same slots.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

MAX_GRAPHS = 16  # per cache; the least recently used graph is dropped beyond that


def length_bucket(value: float) -> int:
    """Smallest power of two >= value (>= 1): the split count only changes between buckets."""
    return 1 << (math.ceil(value) - 1).bit_length() if value > 1 else 1


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    step: torch.Tensor  # (4, B) int64 on the device: ids, positions, slots, table rows
    logits: torch.Tensor  # (B, vocab), written by each replay


class DecodeGraphs:
    """The captured decode steps of one model over one cache.

    It holds neither the model nor the cache (both are passed to `run`), so that the model can keep
    it in a weak-keyed dict by cache and drop it with the cache.
    """

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.captures = 0  # how many graphs were captured (tests and benchmarks read it)
        self.replays = 0

    def run(self, model, cache, step_host: torch.Tensor, max_len: int, mean_len: float) -> torch.Tensor:
        """Decode one step; step_host (4, B) int64 on the CPU.  Returns (B, vocab) logits (a fresh tensor)."""
        table = cache.device_table()  # writes pending page-table entries before the replay reads them
        key = (step_host.shape[1], length_bucket(max_len), length_bucket(mean_len), cache.table_version,
               tuple(table.shape))
        if self.graphs and next(iter(self.graphs))[3] != key[3]:  # the table was reallocated
            self.graphs.clear()
        captured = self.graphs.get(key)
        if captured is None:
            captured = self._capture(model, cache, key, step_host, table)
        else:
            self.graphs.move_to_end(key)
            captured.step.copy_(step_host)
            captured.graph.replay()
        self.replays += 1
        return captured.logits.clone()

    def _capture(self, model, cache, key: tuple, step_host: torch.Tensor, table: torch.Tensor) -> _Captured:
        capacity = table.shape[1] * cache.page_size
        max_hint = min(key[1], capacity)  # length hints for the kernel's split count: the buckets
        mean_hint = float(min(key[2], max_hint))
        step = step_host.to(model.device)  # the static input buffer, refilled before each replay

        def body() -> torch.Tensor:
            ids, positions, slots, rows = step.unbind(0)
            page_table = table.index_select(0, rows)  # (B, table width): full width, a static shape
            seq_lens = (positions + 1).to(torch.int32)  # (B,): the new token is already appended
            return model.decode_step(cache, ids, positions, slots, page_table, seq_lens, max_hint, mean_hint)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()  # warm-up: compiles what is not yet compiled
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = body()
        graph.replay()
        captured = _Captured(graph, step, logits)
        self.graphs[key] = captured
        self.captures += 1
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return captured
