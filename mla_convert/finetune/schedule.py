"""Learning-rate schedule: linear warmup, then cosine decay to a floor.

A small callable class rather than a closure so that `LambdaLR.state_dict()` can hold it and a
checkpoint records the schedule it was made with.
"""

from __future__ import annotations

import math


class CosineWithWarmup:
    """Multiplier of the base lr at optimizer step `step` (0-based: the lr used BY step `step`).

    Steps 0 .. warmup-1 ramp linearly to 1 ((step + 1) / warmup, so the very first step already moves);
    then a half cosine from 1 down to `min_ratio` at the last step (total_steps - 1).
    """

    def __init__(self, warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        self.min_ratio = float(min_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - 1 - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
