"""``R_V`` folded into the output projections of the layers an engine serves with OSCAR.

With ``W_o``'s head blocks multiplied by ``R_V`` (:func:`oscar_kernels.fold_output_rotation`), a
layer's attention returns ``o_rot`` (:attr:`oscar_kernels.ExpandedParams.rotated_output`) and no
decode or prefill step un-rotates. Engine-neutral: each engine adapter finds its attention modules
and says, per layer, how to read ``R_V`` and switch the layer's outputs (:class:`FoldTarget`);
:func:`fold_output_projections` decides and folds.

Folded only where that is exact: the module's class feeds its attention output straight into
``self.o_proj`` (:data:`DIRECT_O_PROJ`: no gate or norm between them; the same class names and
forwards in vLLM 0.33 and SGLang 0.5.17 / 0.5.23), and ``o_proj`` is a plain floating-point matrix
(the engine's unquantised linear method, no LoRA wrapper). Any other layer keeps its un-rotation,
with one log line per reason. A fold leaves a fingerprint on the weight: folding again after a
reload folds a weight the reload rewrote and leaves one it did not; a folded layer whose weight
cannot be read back after a reload is an error (never a silently wrong projection).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from oscar_math.errors import OscarError

from ..fold import fold_output_rotation

__all__ = ["DIRECT_O_PROJ", "FoldTarget", "fold_output_projections", "fold_refusal"]

log = logging.getLogger("oscar_kernels")

#: attention-module classes whose forward is ``o_proj(attn(q, k, v, ...))`` (checked in vLLM 0.33's
#: and SGLang 0.5.17 / 0.5.23's llama, qwen2 and qwen3 models); others may gate or normalise first
DIRECT_O_PROJ = frozenset({"LlamaAttention", "Qwen2Attention", "Qwen3Attention"})

_FOLD_MARK = "_oscar_fold_mark"
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class FoldTarget:
    """One attention module an engine serves with OSCAR, as the fold needs it.

    Attributes:
        name: the module's name in the model (error messages).
        module: the attention module (its class and its ``o_proj``).
        num_heads, head_dim: this rank's query heads and head size.
        v_rotation: returns this rank's ``R_V`` (``[H_kv, d, d]``, on the weight's device).
        rotated: whether the layer returns ``o_rot`` now.
        serve: ``serve(True)``: return ``o_rot`` from now on; ``serve(False)``: un-rotate.
    """

    name: str
    module: Any
    num_heads: int
    head_dim: int
    v_rotation: Callable[[], torch.Tensor]
    rotated: bool
    serve: Callable[[bool], None]


def fold_refusal(module: Any, o_proj: Any, num_heads: int, head_dim: int) -> str | None:
    """Why ``module``'s output projection cannot hold ``R_V`` exactly (``None``: it can)."""
    cls = type(module).__name__
    if cls not in DIRECT_O_PROJ:
        return f"{cls} is not known to feed its attention output straight into o_proj"
    if o_proj is None:
        return f"{cls} has no o_proj"
    if hasattr(o_proj, "base_layer"):
        return "o_proj is wrapped by LoRA"
    method = getattr(o_proj, "quant_method", None)
    if method is not None and type(method).__name__ != "UnquantizedLinearMethod":
        return f"o_proj is quantised ({type(method).__name__})"
    w = getattr(o_proj, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype not in _FLOATS:
        return "o_proj's weight is not a 2-D bf16/fp16/fp32 matrix"
    if w.shape[1] != num_heads * head_dim:
        return f"o_proj reads {w.shape[1]} inputs, not {num_heads} heads x {head_dim}"
    return None


def _mark(w: torch.Tensor) -> tuple[float, float]:
    """A fingerprint of ``w`` (two float64 sums of a strided sample): a fold's result, recorded,
    tells a weight folded already from one a reload wrote since."""
    flat = w.detach().reshape(-1)
    sample = flat[:: max(1, flat.numel() // 4096)].double()
    ramp = torch.arange(1, sample.numel() + 1, device=sample.device)
    return float(sample.sum()), float((sample * ramp).sum())


@torch.no_grad()
def fold_output_projections(
    targets: Iterable[FoldTarget],
    enabled: bool = True,
    logger: logging.Logger | None = None,
) -> int:
    """Fold ``R_V`` into each target's ``o_proj`` where exact and switch it to rotated outputs;
    ``enabled=False`` (the ``fold_output`` setting off) switches every target to un-rotating. A
    target that serves rotated outputs (its weight folded earlier) and can no longer be folded or
    checked raises :class:`OscarError`. Run it again after every weight reload. Returns the number
    of targets that serve rotated outputs."""
    served, refused = 0, {}
    for t in targets:
        o_proj = getattr(t.module, "o_proj", None)
        why = fold_refusal(t.module, o_proj, t.num_heads, t.head_dim) if enabled else "fold_output is off"
        if why is not None:
            if t.rotated:  # its weight was folded: un-rotating now would be right only if unfolded
                raise OscarError(
                    f"OSCAR: {t.name}.o_proj holds R_V (fold_output) but it cannot be checked any more "
                    f"({why}); serve with fold_output: false to reload weights this way"
                )
            refused[why] = refused.get(why, 0) + 1
            t.serve(False)
            continue
        w = o_proj.weight
        if getattr(o_proj, _FOLD_MARK, None) != _mark(w):  # loaded (again) since the last fold
            fold_output_rotation(w.data, t.v_rotation(), t.num_heads)
            setattr(o_proj, _FOLD_MARK, _mark(w))
        t.serve(True)
        served += 1
    out = logger or log
    for why, n in refused.items():
        out.info("OSCAR: %d layer(s) keep the output un-rotation: %s", n, why)
    if served:
        out.info("OSCAR: R_V folded into o_proj of %d layer(s): no output un-rotation", served)
    return served
