"""Plain-torch references of every kernel (same signatures); what engines use on CPU."""

from .attention import decode_attention_ref, extend_attention_ref, gather_rotated_kv
from .paged_write import paged_write_ref

__all__ = ["decode_attention_ref", "extend_attention_ref", "gather_rotated_kv", "paged_write_ref"]
