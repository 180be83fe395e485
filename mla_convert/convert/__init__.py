"""Conversion: calibration, RoPE choice, factorization, per-layer algebra, refinement and the DeepseekV3 target.

The pipeline (`pipeline.convert`) streams the source layer by layer; `target` owns every fact about the
DeepseekV3 format the export must match; `decisions` makes the measured choices; `preflight` checks
everything before any heavy work.  The public entry points are importable from here:

    from mla_convert.convert import convert, ConvertOptions, CalibrationOptions
"""

from __future__ import annotations

_PUBLIC = {
    "convert": "pipeline", "Converter": "pipeline", "ConversionResult": "pipeline",
    "ConvertOptions": "pipeline", "CalibrationOptions": "pipeline", "Progress": "pipeline",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    # lazy, so that importing `mla_convert.convert.target` (which the source shapes need) does not pull in
    # the whole pipeline
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    raise AttributeError(name)
