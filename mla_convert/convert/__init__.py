"""Conversion: calibration, RoPE choice, factorization, per-layer algebra, refinement and the DeepseekV3 target.

The pipeline (`pipeline.convert`) streams the source layer by layer; `target` owns every fact about the
DeepseekV3 format the export must match.
"""

from .calibration import CalibrationOptions
from .pipeline import ConversionResult, Converter, ConvertOptions, convert

__all__ = ["CalibrationOptions", "ConversionResult", "ConvertOptions", "Converter", "convert"]
