"""OSCAR registry entry for SGLang (entry point ``oscar: sglang``).

Only declares the integration; importing this module never imports SGLang. The
attention backend itself is not implemented yet.
"""

from __future__ import annotations

from oscar_math.hookspecs import EngineSpec, hookimpl

__all__ = ["ENGINE", "oscar_engines"]

ENGINE = EngineSpec(
    name="sglang",
    module="sglang",
    package="oscar-sglang",
    description="SGLang INT2 KV-cache backend (not implemented yet)",
)


@hookimpl
def oscar_engines() -> list[EngineSpec]:
    """The SGLang engine entry."""
    return [ENGINE]
