"""oscar-kernels: the paged INT2 + BF16-window KV cache, its Triton kernels and torch references.

Importing this package does not import Triton; kernels load on first use.
"""

from ._backend import Backend, KernelUnavailableError, triton_available
from ._validate import set_bounds_checks
from .baseline import paged_bf16_decode
from .decode_attention import (
    DECODE_IMPLS,
    DecodePlan,
    choose_num_splits,
    decode_attention,
    plan_decode,
    run_decode,
)
from .dense_kernels import check_dense_attention, pick_dense_attention, torch_flash_attention
from .extend_attention import extend_attention, extend_block_m, run_extend
from .extend_dense import DenseAttention, dense_attention_ref, extend_attention_dense
from .fold import fold_output_rotation
from .layout import (
    CacheLayout,
    PagedKVCache,
    allocate_cache,
    bits_per_element,
    cache_from_page_buffer,
    layout_bytes_per_token,
    page_bytes,
)
from .ops import decode_attention_op, extend_attention_op, paged_write_op, register_ops
from .paged_write import WritePlan, paged_write, plan_write, run_write
from .params import ExpandedParams, LayerQuantParams, as_expanded
from .reference import decode_attention_ref, extend_attention_ref, gather_rotated_kv, paged_write_ref
from .rotate import rotate_chunk, rotate_queries, unrotate_output
from .window_records import write_window_records

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "KernelUnavailableError",
    "triton_available",
    "set_bounds_checks",
    "CacheLayout",
    "PagedKVCache",
    "allocate_cache",
    "cache_from_page_buffer",
    "page_bytes",
    "bits_per_element",
    "layout_bytes_per_token",
    "paged_write",
    "WritePlan",
    "plan_write",
    "run_write",
    "write_window_records",
    "decode_attention",
    "DecodePlan",
    "plan_decode",
    "run_decode",
    "DECODE_IMPLS",
    "choose_num_splits",
    "paged_bf16_decode",
    "extend_attention",
    "run_extend",
    "extend_block_m",
    "extend_attention_dense",
    "dense_attention_ref",
    "DenseAttention",
    "check_dense_attention",
    "pick_dense_attention",
    "torch_flash_attention",
    "decode_attention_op",
    "extend_attention_op",
    "paged_write_op",
    "register_ops",
    "ExpandedParams",
    "LayerQuantParams",
    "as_expanded",
    "decode_attention_ref",
    "extend_attention_ref",
    "gather_rotated_kv",
    "paged_write_ref",
    "rotate_chunk",
    "rotate_queries",
    "unrotate_output",
    "fold_output_rotation",
]
