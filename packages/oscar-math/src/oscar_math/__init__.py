"""oscar-math: the pure math of OSCAR 2-bit KV-cache quantisation."""

from .artifact import (
    DEFAULT_RECENT,
    DEFAULT_SINK,
    FORMAT,
    FORMAT_VERSION,
    FORMAT_VERSION_FEEDBACK,
    FORMAT_VERSION_ROPE,
    FORMAT_VERSIONS,
    ORTHOGONALITY_TOL,
    Granularity,
    LayerRotations,
    Rotations,
    identity_rotations,
    load_rotations,
    save_rotations,
)
from .bitrev import bit_reversal_permutation, inverse_permutation, permutation_matrix
from .bits import bits_per_element, int2_bits_per_element, kivi_bits_per_element
from .clipping import (
    DEFAULT_CLIP_GRID,
    FINE_CLIP_GRID,
    ClipSearch,
    center_keys,
    clip_error,
    key_metric,
    quantile_clip_fake_quantize,
    quantization_error,
    rotate_samples,
    search_clip_ratio,
)
from .covariance import GRANULARITIES, KeyMean, QueryCovariance, ScoreWeightedValueCovariance
from .eigen import eigenbasis
from .errors import ArtifactError, OscarError, check
from .hadamard import (
    HADAMARD_BASE_ORDERS,
    block_hadamard,
    hadamard_matrix,
    hadamard_matrix_int,
    is_hadamard_order,
    random_sign_hadamard,
)
from .hookspecs import EngineSpec, SchemeSpec, hookimpl
from .kivi import kivi_fake_quantize_keys, kivi_fake_quantize_values
from .model_config import model_geometry
from .pack import pack_int2, unpack_int2
from .plugins import available_engines, available_schemes, get_plugin_manager
from .quantize import (
    SCALE_DTYPE,
    Int2Quantized,
    clip_range,
    dequantize_int2,
    fake_quantize_int2,
    quantize_int2,
)
from .rotation import HadamardMode, compose_rotation, hadamard_rotation, identity_rotation, is_orthogonal
from .rotationzoo import REFERENCE_K_FILE, REFERENCE_V_FILE, import_rotationzoo
from .windows import bf16_ring_start, int2_mask

__version__ = "0.1.0"

__all__ = [
    "int2_mask",
    "bf16_ring_start",
    "DEFAULT_SINK",
    "DEFAULT_RECENT",
    "model_geometry",
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
    "bit_reversal_permutation",
    "inverse_permutation",
    "permutation_matrix",
    "GRANULARITIES",
    "KeyMean",
    "QueryCovariance",
    "ScoreWeightedValueCovariance",
    "eigenbasis",
    "HADAMARD_BASE_ORDERS",
    "block_hadamard",
    "hadamard_matrix",
    "hadamard_matrix_int",
    "is_hadamard_order",
    "random_sign_hadamard",
    "HadamardMode",
    "compose_rotation",
    "hadamard_rotation",
    "identity_rotation",
    "is_orthogonal",
    "ClipSearch",
    "DEFAULT_CLIP_GRID",
    "FINE_CLIP_GRID",
    "center_keys",
    "clip_error",
    "quantile_clip_fake_quantize",
    "quantization_error",
    "search_clip_ratio",
    "key_metric",
    "rotate_samples",
    "FORMAT",
    "FORMAT_VERSION",
    "FORMAT_VERSION_FEEDBACK",
    "FORMAT_VERSION_ROPE",
    "FORMAT_VERSIONS",
    "ORTHOGONALITY_TOL",
    "Granularity",
    "LayerRotations",
    "Rotations",
    "identity_rotations",
    "load_rotations",
    "save_rotations",
    "REFERENCE_K_FILE",
    "REFERENCE_V_FILE",
    "import_rotationzoo",
    "EngineSpec",
    "SchemeSpec",
    "hookimpl",
    "available_engines",
    "available_schemes",
    "get_plugin_manager",
]
