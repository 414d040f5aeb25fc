"""oscar-vllm: the OSCAR INT2 KV cache as a vLLM attention backend (``--attention-backend OSCAR``).

Importing this package does not import vLLM.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["llm_kwargs", "register"]


def register() -> None:
    """Register the ``OSCAR`` backend with vLLM in this process (what vLLM's plugin loader calls).

    ``vllm serve`` loads plugins before it parses ``--attention-backend``; the offline
    ``LLM(...)`` validates ``attention_config`` before it loads plugins, so call this (or
    :func:`llm_kwargs`) first when you build an ``LLM`` in Python.
    """
    from .vllm_plugin import register as _register

    _register()


def llm_kwargs(rotations: str, **oscar_options: Any) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for OSCAR: ``LLM(model, **llm_kwargs("rot.safetensors"))``.

    Registers the backend first (see :func:`register`).
    """
    register()
    return {
        "attention_config": {"backend": "OSCAR"},
        "additional_config": {"oscar": {"rotations": str(rotations), **oscar_options}},
    }
