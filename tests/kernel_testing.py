"""Where the MLA decode kernel tests run: the Triton interpreter on the CPU, or a CUDA device when compiled."""

from __future__ import annotations

import pytest
import torch
from mla_decode_triton.launcher import INTERPRETED
from mla_decode_triton.testing import LSE_TOLERANCE, TOLERANCE

DEVICE = "cpu" if INTERPRETED else "cuda"
NEEDS_KERNEL_DEVICE = pytest.mark.skipif(
    not INTERPRETED and not torch.cuda.is_available(),
    reason="TRITON_INTERPRET=0 and no CUDA device: the kernel cannot run here",
)


def assert_matches(actual, expected, dtype):
    """Kernel (out, lse) against the reference's, within the cache dtype's tolerance; no NaN anywhere."""
    out, lse = actual
    ref_out, ref_lse = expected
    assert out.dtype == ref_out.dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.float().cpu(), ref_out.float().cpu(), **TOLERANCE[dtype])
    torch.testing.assert_close(lse.cpu(), ref_lse.float().cpu(), **LSE_TOLERANCE)
