"""Errors raised on bad inputs to the MLA decode kernels.

They derive from `mla_convert.errors.MLAConvertError` (the project's rule for user-facing errors: one
clear line, no traceback in the CLI) and from `ValueError`, so callers that treat the kernel as a plain
tensor function can catch the usual exception type.
"""

from __future__ import annotations

from mla_convert.errors import MLAConvertError


class MLADecodeInputError(MLAConvertError, ValueError):
    """The tensors handed to an MLA decode function do not fit together (shape, dtype or device)."""
