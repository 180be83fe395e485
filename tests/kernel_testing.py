"""Where the MLA decode kernel tests run: the Triton interpreter on the CPU, or a CUDA device when compiled."""

from __future__ import annotations

import pytest
import torch
from mla_decode_triton.launcher import INTERPRETED

DEVICE = "cpu" if INTERPRETED else "cuda"
NEEDS_KERNEL_DEVICE = pytest.mark.skipif(
    not INTERPRETED and not torch.cuda.is_available(),
    reason="TRITON_INTERPRET=0 and no CUDA device: the kernel cannot run here",
)
