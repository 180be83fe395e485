"""Errors of the MLA inference runtime: user-facing, one clear line each (see `mla_convert.errors`)."""

from __future__ import annotations

from ..errors import MLAConvertError


class RuntimeModelError(MLAConvertError):
    """The folder is not a dense DeepseekV3 MLA checkpoint this runtime can decode."""


class GenerationSettingsError(MLAConvertError):
    """Bad generation settings (prompts, token counts, sampling parameters, cache geometry)."""
