"""OSCAR registry entry for vLLM (entry point ``oscar: vllm``).

Only declares the integration; importing this module never imports vLLM. The
attention backend itself is not implemented yet.
"""

from __future__ import annotations

from oscar_math.hookspecs import EngineSpec, hookimpl

__all__ = ["ENGINE", "oscar_engines"]

ENGINE = EngineSpec(
    name="vllm",
    module="vllm",
    package="oscar-vllm",
    description="vLLM INT2 KV-cache backend (not implemented yet)",
)


@hookimpl
def oscar_engines() -> list[EngineSpec]:
    """The vLLM engine entry."""
    return [ENGINE]
