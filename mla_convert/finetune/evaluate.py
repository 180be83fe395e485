"""Perplexity during fine-tuning, on the project protocol, for one process or many.

Same windows and the same scoring function as `eval.perplexity.evaluate_perplexity` (`plan_windows`,
`window_nll`), but the windows are spread over the processes and the sums reduced, because under FSDP
every process has to run every forward together.  A test checks it against `evaluate_perplexity`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..eval.perplexity import plan_windows, window_batches, window_nll
from ..io.paths import portable_path


@dataclass(frozen=True)
class EvalWindows:
    """Token ids of the evaluation text and the windows to score."""

    ids: torch.Tensor  # (num_tokens,)
    windows: list  # list[perplexity.Window]
    description: str

    @classmethod
    def from_text(cls, tokenizer, spec: str, context: int, max_windows: int, text_column: str = "text",
                  label: str | None = None) -> EvalWindows:
        """`label`: how the description names the text (default: `spec` as given, machine paths shortened)."""
        from ..data.textdata import load_text, tokenize_text

        ids = tokenize_text(tokenizer, load_text(spec, text_column=text_column))
        windows = plan_windows(int(ids.numel()), context, context, max_windows)
        context = min(context, int(ids.numel()))  # a text shorter than a window is one window of itself, as `eval` says
        scored = sum(w.num_scored for w in windows)
        return cls(ids, windows, f"{label or portable_path(str(spec))}: context {context}, {len(windows)} non-overlapping windows, "
                                 f"{scored} scored tokens, token-weighted NLL")

    @property
    def num_scored(self) -> int:
        return sum(w.num_scored for w in self.windows)

    def shortfall_note(self, requested: int) -> str | None:
        """What to tell the user when the text holds fewer windows than eval_windows asks for (they were all used,
        silently: the report said 60 where 1000 were asked)."""
        if len(self.windows) >= requested:
            return None
        return (f"eval_windows {requested}: the evaluation text holds {len(self.windows)} window(s) of this context; "
                "all of them are scored")


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
            for group in window_batches(data.windows, batch_size):
                total += window_nll(model, data.ids, group, device)
        else:
            mine = data.windows[process_index::num_processes]
            for step in range(math.ceil(len(data.windows) / num_processes)):
                if step < len(mine):
                    total += window_nll(model, data.ids, [mine[step]], device)
                else:
                    total += 0.0 * window_nll(model, data.ids, data.windows[:1], device)
    finally:
        model.train(was_training)
    if reduce is not None:
        total = reduce(total)
    return math.exp(total.item() / data.num_scored)
