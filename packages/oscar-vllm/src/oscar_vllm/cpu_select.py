"""What ``CPU_ATTN`` resolves to once oscar-vllm is installed (CPU platform only).

vLLM's CPU platform always returns ``CPU_ATTN``'s class path, whatever backend was
selected. The plugin points that path here; :func:`__getattr__` (PEP 562) answers with
the OSCAR backend while the current vLLM config selects ``OSCAR`` and with vLLM's own
CPU backend otherwise, so installing the plugin changes nothing for other users.
"""

from __future__ import annotations

from typing import Any

from . import compat


def __getattr__(name: str) -> Any:
    if name != "SelectedBackend":
        raise AttributeError(name)
    if compat.oscar_selected(compat.current_config()):
        from .backend import OscarAttentionBackend

        return OscarAttentionBackend
    return compat.cpu_attention_backend()
