"""``R_V`` folded into each OSCAR layer's output projection as the weights are loaded.

With ``W_o``'s head blocks multiplied by ``R_V`` (:func:`oscar_kernels.fold_output_rotation`),
the layer's attention returns ``o_rot`` (:attr:`oscar_kernels.ExpandedParams.rotated_output`)
and no decode or prefill step un-rotates: a ``[d, d]`` product per query row and layer saved.

Folded only where that is exact: the attention module's class feeds ``self.attn``'s output
straight into ``self.o_proj`` (:data:`DIRECT_O_PROJ`: no gate or norm between them), and
``o_proj`` is a plain floating-point matrix (vLLM's unquantised linear, no LoRA wrapper). Any
other layer keeps its un-rotation, with one start-up line saying why. The fold runs once the
loader has the checkpoint's weights, before vLLM turns them into kernel formats (the CPU build
packs them for its GEMM) and before the layers prepare themselves
(:func:`oscar_vllm.compat.before_weight_processing`); after ``reload_weights`` /
``update_weights`` (:func:`oscar_vllm.compat.after_weights_reloaded`) it refolds only a weight
that no longer carries its fold's fingerprint, so a weight reloaded in full is folded again and one
left untouched is not folded twice. A folded layer whose weight cannot be read back after a reload
stops the engine with one line (never a silently wrong projection).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from oscar_kernels import fold_output_rotation
from oscar_math.errors import OscarError

__all__ = ["DIRECT_O_PROJ", "fold_model", "fold_refusal", "fold_on_load", "fold_after_reload"]

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
def fold_model(model: torch.nn.Module, enabled: bool = True, reload: bool = False) -> int:
    """Fold ``R_V`` into the output projection of every attention module whose ``attn`` runs an
    OSCAR INT2 layer (its implementation has ``oscar_layer`` and serves the layer: not one that
    ``exclude_layers`` hands to vLLM's backend), and tell that layer its outputs stay rotated;
    ``enabled=False`` (``fold_output: false``) leaves every layer un-rotating. ``reload``: after a
    weight reload (a folded layer that cannot be checked any more is an error). Returns the number
    of layers that serve rotated outputs. One log line per reason a layer was refused."""
    served, refused = 0, {}
    for name, module in model.named_modules():
        impl = getattr(getattr(module, "attn", None), "impl", None)
        if not getattr(impl, "oscar_layer", False) or not hasattr(impl, "serve_rotated_output"):
            continue
        if not impl.serves_int2():
            continue
        o_proj = getattr(module, "o_proj", None)
        why = "fold_output is off"
        if enabled:
            why = fold_refusal(module, o_proj, impl.num_heads, impl.head_size)
        if why is not None:
            if reload and impl.rotated_output:
                raise OscarError(
                    f"OSCAR: {name}.o_proj holds R_V (fold_output) but after the weight reload it cannot "
                    f"be checked ({why}); serve with fold_output: false to reload weights this way"
                )
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


def _enabled(cfg: Any) -> bool | None:
    """``fold_output`` where ``cfg`` selects OSCAR, else ``None`` (nothing to fold)."""
    from . import compat
    from .settings import settings_from

    if cfg is None or not compat.oscar_selected(cfg):
        return None
    return settings_from(getattr(cfg, "additional_config", None), require_rotations=False).fold_output


def fold_on_load(model: torch.nn.Module) -> None:
    """:func:`fold_model` on a model whose loader has just read the checkpoint, where OSCAR serves it
    (installed in every vLLM process by the plugin: :func:`oscar_vllm.compat.before_weight_processing`;
    vLLM's configuration is current while a worker loads its model)."""
    from . import compat

    enabled = _enabled(compat.current_config())
    if enabled is not None:
        fold_model(model, enabled)


def fold_after_reload(worker: Any) -> None:
    """:func:`fold_model` after a worker reloaded or updated weights (``reload=True``)."""
    from . import compat

    enabled = _enabled(getattr(worker, "vllm_config", None))
    if enabled is not None:
        fold_model(compat.model_of_worker(worker), enabled, reload=True)
