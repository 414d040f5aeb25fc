"""OSCAR registry entry for SGLang (entry point ``oscar: sglang``).

Importing this module never imports SGLang. ``oscar serve --engine sglang`` calls
:func:`oscar_sglang.launch.launch`.
"""

from __future__ import annotations

from oscar_math.hookspecs import EngineSpec, hookimpl

__all__ = ["ENGINE", "oscar_engines"]

ENGINE = EngineSpec(
    name="sglang",
    module="sglang",
    package="oscar-sglang",
    description="SGLang attention backend 'oscar' (INT2 pages + BF16 windows)",
    launcher="oscar_sglang.launch:launch",
)


@hookimpl
def oscar_engines() -> list[EngineSpec]:
    """The SGLang engine entry."""
    return [ENGINE]
