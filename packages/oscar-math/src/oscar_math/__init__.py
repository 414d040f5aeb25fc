"""oscar-math: the pure math of OSCAR 2-bit KV-cache quantisation."""

from .errors import ArtifactError, OscarError, check
from .pack import pack_int2, unpack_int2
from .quantize import (
    SCALE_DTYPE,
    Int2Quantized,
    clip_range,
    dequantize_int2,
    fake_quantize_int2,
    quantize_int2,
)

__version__ = "0.1.0"

__all__ = [
    "ArtifactError",
    "OscarError",
    "check",
    "pack_int2",
    "unpack_int2",
    "SCALE_DTYPE",
    "Int2Quantized",
    "clip_range",
    "dequantize_int2",
    "fake_quantize_int2",
    "quantize_int2",
]
