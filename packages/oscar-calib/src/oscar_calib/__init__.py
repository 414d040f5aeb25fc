"""oscar-calib: capture attention statistics from real models, calibrate OSCAR rotations, evaluate.

Public names are imported lazily so that ``oscar --help`` and plugin discovery do not
pay for torch/transformers imports.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # models
    "load_model": "models",
    "resolve_model": "models",
    "model_info": "models",
    "model_name": "models",
    "ModelInfo": "models",
    "tiny_random_model": "models",
    "SUPPORTED_FAMILIES": "models",
    # text
    "builtin_text": "text",
    "load_text": "text",
    "split_text": "text",
    "token_chunks": "text",
    # attention hook
    "AttentionContext": "attention",
    "attention_override": "attention",
    "sdpa_attention": "attention",
    # calibration
    "collect_statistics": "capture",
    "CalibrationConfig": "calibrate",
    "calibrate": "calibrate",
    "rotations_from_statistics": "calibrate",
    # evaluation (oscar eval / oscar demo)
    "EvalConfig": "evaluate",
    "EvalResult": "evaluate",
    "run_eval": "evaluate",
    "build_scheme": "schemes",
    "scheme_names": "schemes",
    "OscarCache": "cache",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'oscar_calib' has no attribute '{name}'")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
