"""``R_V`` folded into each OSCAR layer's output projection as vLLM loads the weights.

The decision and the fold are the serving core's (:mod:`oscar_kernels.serving.fold`: which
projections can hold ``R_V`` exactly, the fingerprint against double folds); this module finds
vLLM's attention modules whose ``attn`` runs an OSCAR INT2 layer and runs the fold at vLLM's
moments: once the loader has the checkpoint's weights, before vLLM turns them into kernel formats
(the CPU build packs them for its GEMM) and before the layers prepare themselves
(:func:`oscar_vllm.compat.before_weight_processing`), and after ``reload_weights`` /
``update_weights`` (:func:`oscar_vllm.compat.after_weights_reloaded`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from oscar_kernels.serving.fold import FoldTarget, fold_output_projections
from oscar_math.errors import OscarError

__all__ = ["fold_model", "fold_on_load", "fold_after_reload"]

log = logging.getLogger("oscar_vllm")


def _targets(model: torch.nn.Module) -> Iterator[FoldTarget]:
    """The attention modules whose ``attn`` runs an OSCAR INT2 layer (not one ``exclude_layers``
    hands to vLLM's backend)."""
    for name, module in model.named_modules():
        impl = getattr(getattr(module, "attn", None), "impl", None)
        if not getattr(impl, "oscar_layer", False) or not hasattr(impl, "serve_rotated_output"):
            continue
        if impl.serves_int2():
            yield FoldTarget(
                name, module, impl.num_heads, impl.head_size, impl.value_rotation, impl.rotated_output,
                impl.serve_rotated_output,
            )  # fmt: skip


def fold_model(model: torch.nn.Module, enabled: bool = True) -> int:
    """:func:`oscar_kernels.serving.fold.fold_output_projections` over ``model``'s OSCAR layers;
    returns the number that serve rotated outputs."""
    return fold_output_projections(_targets(model), enabled, log)


def _enabled(cfg: Any) -> bool | None:
    """``fold_output`` where ``cfg`` selects OSCAR, else ``None`` (nothing to fold)."""
    from . import compat
    from .settings import settings_from

    if cfg is None or not compat.oscar_selected(cfg):
        return None
    return settings_from(getattr(cfg, "additional_config", None), require_rotations=False).fold_output


def fold_on_load(model: torch.nn.Module) -> None:
    """:func:`fold_model` on a model whose loader has just read the checkpoint, where OSCAR serves it
    (installed in every vLLM process by the plugin; vLLM's configuration is current while a worker
    loads its model)."""
    from . import compat

    enabled = _enabled(compat.current_config())
    if enabled and compat.weights_pre_processed():
        # a cached model may hold R_V already (its fingerprint does not travel with the weights)
        raise OscarError(
            "OSCAR: fold_output cannot tell whether weights from vLLM's weight cache hold R_V already; "
            'serve them with additional_config {"oscar": {"fold_output": false}} (or OSCAR_FOLD_OUTPUT=0) '
            "in the caching process too"
        )
    if enabled is not None:
        fold_model(model, enabled)


def fold_after_reload(worker: Any) -> None:
    """:func:`fold_model` after a worker reloaded or updated weights."""
    from . import compat

    enabled = _enabled(getattr(worker, "vllm_config", None))
    if enabled is not None:
        fold_model(compat.model_of_worker(worker), enabled)
