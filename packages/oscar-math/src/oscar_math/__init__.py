"""oscar-math: the pure math of OSCAR 2-bit KV-cache quantisation."""

from .bits import bits_per_element, int2_bits_per_element, kivi_bits_per_element
from .errors import ArtifactError, OscarError, check
from .kivi import kivi_fake_quantize_keys, kivi_fake_quantize_values
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
    "bits_per_element",
    "int2_bits_per_element",
    "kivi_bits_per_element",
    "kivi_fake_quantize_keys",
    "kivi_fake_quantize_values",
]
