"""Entry point of the ``vllm.general_plugins`` group: vLLM calls :func:`register` in every process.

Idempotent (vLLM may load plugins more than once). On an unsupported vLLM version the
``OSCAR`` name is still registered, so that selecting it gives one clear error from the
backend instead of vLLM's "unknown backend".
"""

from __future__ import annotations

from . import compat

_done = False


def register() -> None:
    """Register the OSCAR backend, its CPU stand-in and the prefix-caching guard."""
    global _done
    if _done:
        return
    compat.register_backend()
    if compat.version_supported(compat.vllm_version()):
        compat.register_cpu_override()
        compat.guard_prefix_caching()
    _done = True
