"""Perplexity during fine-tuning, on the project protocol, for one process or many.

Same windows and arithmetic as `mla_convert.perplexity.evaluate_perplexity` (non-overlapping windows
from `plan_windows`, the first token of each window unscored, NLL summed over scored tokens and divided
by their number), but the windows are spread over the processes and the sums reduced, because under
FSDP every process has to run every forward together.  A test checks it against `evaluate_perplexity`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..eval.perplexity import plan_windows


@dataclass(frozen=True)
class EvalWindows:
    """Token ids of the evaluation text and the windows to score."""

    ids: torch.Tensor  # (num_tokens,)
    windows: list  # list[perplexity.Window]
    description: str

    @classmethod
    def from_text(cls, tokenizer, spec: str, context: int, max_windows: int, text_column: str = "text") -> "EvalWindows":
        from ..eval.textdata import load_text, tokenize_text

        ids = tokenize_text(tokenizer, load_text(spec, text_column=text_column))
        windows = plan_windows(int(ids.numel()), context, context, max_windows)
        scored = sum(w.num_scored for w in windows)
        return cls(ids, windows, f"{spec}: context {context}, {len(windows)} non-overlapping windows, {scored} scored tokens, token-weighted NLL")

    @property
    def num_scored(self) -> int:
        return sum(w.num_scored for w in self.windows)


def _window_nll(model, ids: torch.Tensor, windows: list, device: torch.device) -> torch.Tensor:
    """Summed NLL (float64, on `device`) of the scored targets of equally long windows, one forward."""
    batch = torch.stack([ids[w.begin : w.end] for w in windows]).to(device)  # (b, length)
    logits = model(input_ids=batch, use_cache=False).logits  # (b, length, vocab)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for row, window in enumerate(windows):
        first = window.score_from - window.begin  # first scored target position in the window
        predicting = logits[row, first - 1 : window.length - 1].float()  # (num_scored, vocab)
        total += F.cross_entropy(predicting, batch[row, first:], reduction="sum").double()
    return total


@torch.no_grad()
def evaluate_perplexity_distributed(model, data: EvalWindows, device: torch.device, process_index: int = 0,
                                    num_processes: int = 1, reduce=None, batch_size: int = 1) -> float:
    """Perplexity of `model` on `data`; with several processes every one must call it.

    One process: windows in groups of `batch_size` (equal lengths only).  Several: process p scores
    windows p, p + P, ... one per forward, and a process with fewer windows runs a padding forward
    (weight 0) so that all processes issue the same number of forwards; `reduce` sums across them.
    """
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    try:
        if num_processes == 1:
            groups: list[list] = []
            for window in data.windows:
                if groups and len(groups[-1]) < batch_size and groups[-1][0].length == window.length:
                    groups[-1].append(window)
                else:
                    groups.append([window])
            for group in groups:
                total += _window_nll(model, data.ids, group, device)
        else:
            mine = data.windows[process_index::num_processes]
            for step in range(math.ceil(len(data.windows) / num_processes)):
                if step < len(mine):
                    total += _window_nll(model, data.ids, [mine[step]], device)
                else:
                    total += 0.0 * _window_nll(model, data.ids, data.windows[:1], device)
    finally:
        model.train(was_training)
    if reduce is not None:
        total = reduce(total)
    return math.exp(total.item() / data.num_scored)
