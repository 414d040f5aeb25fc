"""The one place OSCAR plugs into transformers' attention-function interface.

transformers (>= 4.48) routes every supported model's attention through
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``; the call receives the query
after RoPE and any QK-norm and the key/value *before* GQA repetition. Registering one
function under the name ``"oscar"`` (and the ``sdpa`` mask builder under the same
name, so models build the usual boolean causal mask for it) lets OSCAR read and
replace attention without copying model code.

:func:`attention_override` switches one model to a Python callable for the duration
of a ``with`` block; the registered function dispatches on the attention module, so
several models (or nested overrides) can coexist.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = [
    "IMPLEMENTATION_NAME",
    "AttentionContext",
    "AttentionFn",
    "attention_modules",
    "attention_override",
    "sdpa_attention",
]

IMPLEMENTATION_NAME = "oscar"


@dataclass(frozen=True)
class AttentionContext:
    """What an override learns about the attention call besides the tensors.

    Attributes:
        layer_idx: decoder layer index (0-based).
        num_kv_groups: ``H_q // H_kv``.
        module: the model's attention module (read-only use).
    """

    layer_idx: int
    num_kv_groups: int
    module: torch.nn.Module


class AttentionFn(Protocol):
    """``fn(ctx, query, key, value, attention_mask, scaling, **kw) -> [B, T, H_q, d]``.

    ``query`` is ``[B, H_q, T, d]``; ``key``/``value`` are ``[B, H_kv, S, d]`` (not repeated
    for GQA). ``attention_mask`` is ``None`` (plain causal) or a 4D boolean/additive mask
    broadcastable to ``[B, H_q, T, S]``.
    """

    def __call__(
        self,
        ctx: AttentionContext,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
        **kwargs: Any,
    ) -> torch.Tensor: ...


_lock = threading.Lock()
_registered = False
# id(attention module) -> stack of active override functions (innermost last).
_active: dict[int, list[Callable[..., torch.Tensor]]] = {}


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
) -> torch.Tensor:
    """Plain scaled-dot-product attention with GQA, in the layout transformers expects back.

    Args:
        query: ``[B, H_q, T, d]``.
        key, value: ``[B, H_kv, S, d]`` with ``H_q % H_kv == 0``.
        attention_mask: ``None`` → causal aligned to the end (query ``t`` sits at key
            position ``S - T + t``); boolean (True = attend) or additive float, 4D,
            broadcastable to ``[B, H_q, T, S]``.
        scaling: logit scale, default ``d ** -0.5``.

    Returns:
        ``[B, T, H_q, d]``.
    """
    num_q, q_len = query.shape[1], query.shape[2]
    num_kv, kv_len = key.shape[1], key.shape[2]
    if num_q != num_kv:
        groups = num_q // num_kv
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if attention_mask is None and q_len > 1:
        if q_len == kv_len:
            out = sdpa(query, key, value, is_causal=True, scale=scale)
        else:
            positions = torch.arange(q_len, device=query.device) + (kv_len - q_len)
            mask = positions[:, None] >= torch.arange(kv_len, device=query.device)[None, :]
            out = sdpa(query, key, value, attn_mask=mask, scale=scale)
    else:
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.to(query.dtype)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scale
        )
    return out.transpose(1, 2).contiguous()


def _dispatch(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    stack = _active.get(id(module))
    if not stack:
        raise RuntimeError(
            "attention implementation 'oscar' called outside oscar_calib.attention_override(); "
            "switch the model back with model.set_attn_implementation('sdpa')"
        )
    ctx = AttentionContext(
        layer_idx=int(getattr(module, "layer_idx", -1)),
        num_kv_groups=query.shape[1] // key.shape[1],
        module=module,
    )
    if scaling is None:
        scaling = float(getattr(module, "scaling", query.shape[-1] ** -0.5))
    return stack[-1](ctx, query, key, value, attention_mask, scaling, **kwargs), None


def _register() -> None:
    global _registered
    with _lock:
        if _registered:
            return
        from transformers import AttentionInterface

        AttentionInterface.register(IMPLEMENTATION_NAME, _dispatch)
        try:
            from transformers import AttentionMaskInterface
            from transformers.masking_utils import sdpa_mask
        except ImportError:  # older releases build the sdpa-style mask for unknown names
            pass
        else:
            AttentionMaskInterface.register(IMPLEMENTATION_NAME, sdpa_mask)
        _registered = True


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's self-attention modules in layer order (modules with ``layer_idx`` and ``q_proj``)."""
    found = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
    return sorted(found, key=lambda m: int(m.layer_idx))


def _current_implementation(model: Any) -> str | None:
    return getattr(model.config, "_attn_implementation", None)


def _set_implementation(model: Any, name: str | None) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # transformers < 4.56
        model.config._attn_implementation = name


@contextlib.contextmanager
def attention_override(model: Any, fn: AttentionFn) -> Iterator[Any]:
    """Route every self-attention call of ``model`` through ``fn`` inside the block.

    ``fn(ctx, query, key, value, attention_mask, scaling, **kw)`` must return
    ``[B, T, H_q, d]``; :func:`sdpa_attention` computes the unmodified result. The
    model's previous attention implementation is restored on exit, even on error.

    Yields:
        the model.
    """
    _register()
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no attention modules with a layer_idx")
    previous = _current_implementation(model)
    for module in modules:
        _active.setdefault(id(module), []).append(fn)
    try:
        if previous != IMPLEMENTATION_NAME:
            _set_implementation(model, IMPLEMENTATION_NAME)
        yield model
    finally:
        for module in modules:
            stack = _active.get(id(module))
            if stack:
                stack.pop()
                if not stack:
                    del _active[id(module)]
        if previous != IMPLEMENTATION_NAME:
            _set_implementation(model, previous)
