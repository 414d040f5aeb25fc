"""``R_V`` folded into each OSCAR layer's output projection once the weights are loaded.

With ``W_o``'s head blocks multiplied by ``R_V`` (:func:`oscar_kernels.fold_output_rotation`),
the layer's attention returns ``o_rot`` (:attr:`oscar_kernels.ExpandedParams.rotated_output`)
and no decode or prefill step un-rotates: a ``[d, d]`` product per query row and layer saved.

Folded only where that is exact: the attention module's class feeds ``self.attn``'s output
straight into ``self.o_proj`` (:data:`DIRECT_O_PROJ`: no gate or norm between them), and
``o_proj`` is a plain floating-point matrix (vLLM's unquantised linear, no LoRA wrapper). Any
other layer keeps its un-rotation, with one start-up line saying why. The pass runs after every
weight load (:func:`oscar_vllm.compat.after_weights_loaded`: first load, ``reload_weights``,
``update_weights``) and refolds only a weight that no longer carries its fold's fingerprint, so a
weight reloaded in full is folded again and one left untouched is not folded twice.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from oscar_kernels import fold_output_rotation

__all__ = ["DIRECT_O_PROJ", "fold_model", "fold_refusal", "fold_after_load"]

log = logging.getLogger("oscar_vllm")

#: vLLM attention-module classes whose forward is ``o_proj(attn(q, k, v))`` (checked in vLLM 0.33's
#: llama.py, qwen2.py, qwen3.py); others may gate or normalise the output first (Qwen3-Next does)
DIRECT_O_PROJ = frozenset({"LlamaAttention", "Qwen2Attention", "Qwen3Attention"})

_FOLD_MARK = "_oscar_fold_mark"
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


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
def fold_model(model: torch.nn.Module, enabled: bool = True) -> int:
    """Fold ``R_V`` into the output projection of every attention module whose ``attn`` runs an
    OSCAR layer (its implementation has ``oscar_layer``), and tell that layer its outputs stay
    rotated; ``enabled=False`` (``fold_output: false``) leaves every layer un-rotating. Returns
    the number of layers that serve rotated outputs. One log line per reason a layer was refused."""
    served, refused = 0, {}
    for _, module in model.named_modules():
        impl = getattr(getattr(module, "attn", None), "impl", None)
        if not getattr(impl, "oscar_layer", False) or not hasattr(impl, "serve_rotated_output"):
            continue
        o_proj = getattr(module, "o_proj", None)
        why = "fold_output is off"
        if enabled:
            why = fold_refusal(module, o_proj, impl.num_heads, impl.head_size)
        if why is not None:
            refused[why] = refused.get(why, 0) + 1
            impl.serve_rotated_output(False)
            continue
        w = o_proj.weight
        if getattr(o_proj, _FOLD_MARK, None) != _mark(w):  # loaded (again) since the last fold
            fold_output_rotation(w.data, impl.value_rotation(), impl.num_heads)
            setattr(o_proj, _FOLD_MARK, _mark(w))
        impl.serve_rotated_output(True)
        served += 1
    for why, n in refused.items():
        log.info("OSCAR: %d layer(s) keep the output un-rotation: %s", n, why)
    if served:
        log.info("OSCAR: R_V folded into o_proj of %d layer(s): no output un-rotation", served)
    return served


def fold_after_load(worker: Any) -> None:
    """:func:`fold_model` on a worker that has just loaded weights, where OSCAR serves it (the
    plugin installs this in every vLLM process: :func:`oscar_vllm.compat.after_weights_loaded`)."""
    from . import compat
    from .settings import settings_from

    cfg = getattr(worker, "vllm_config", None)
    if cfg is None or not compat.oscar_selected(cfg):
        return
    enabled = settings_from(getattr(cfg, "additional_config", None), require_rotations=False).fold_output
    fold_model(compat.model_of_worker(worker), enabled)
