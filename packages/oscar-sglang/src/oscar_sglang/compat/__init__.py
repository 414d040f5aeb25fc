"""What differs between the SGLang releases oscar-sglang supports: one adapter module per release.

``sglang_glue`` (the shared code) imports :func:`adapter` and uses only the small interface
every adapter module defines (see ``sglang_0523.py`` for the reference of each name):

* ``VERSION``: the release it was written against;
* ``prefix_len(result)``: the device prefix length of a ``MatchResult``;
* ``prefix_slot(tree, result, extra_key, n)``: the token slot of position ``n - 1`` of a match;
* ``short_key(key, limit)``: the same ``RadixKey`` capped at ``limit`` tokens;
* ``key_salt(key)`` / ``req_salt(req)``: the cache salt that namespaces the tree besides
  ``extra_key`` (``None`` where the release folds it into ``extra_key``);
* ``req_slot(req)``: the request's ``req_to_token_pool`` row;
* ``publish_hooks(publish)``: ``(tree method, AROUND hook)`` pairs that call the shared
  ``publish(tree, req, slot, k_len, token_ids)`` where the tree has just taken ownership of a
  request's first ``k_len`` tokens;
* ``extra_hooks()``: ``(dotted target, hook, HookType)`` for release-only fixes;
* ``CUDA_GRAPH_CALLS``: the attention-backend methods SGLang's CUDA-graph runners call, with
  the arguments they pass (checked against the backend's signatures by the tests).

The adapter is chosen by ``sglang.__version__``; any other release is refused in one line.
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType

from oscar_math.errors import OscarError

#: release -> adapter module (``oscar_sglang.compat.<name>``): the one list of supported releases
SUPPORTED: dict[str, str] = {"0.5.17": "sglang_0517", "0.5.23": "sglang_0523"}

__all__ = ["SUPPORTED", "adapter", "check_release", "release_of"]


def release_of(version: str) -> str | None:
    """The supported release a version string belongs to (``0.5.17``, ``0.5.17.post1``,
    ``0.5.17+cu130`` -> ``0.5.17``), or ``None``."""
    m = re.match(r"(\d+\.\d+\.\d+)(?:\.post\d+)?(?:\+.*)?$", version.strip())
    return m.group(1) if m and m.group(1) in SUPPORTED else None


def check_release(version: str | None) -> str:
    """The supported release of ``version`` (``None``: SGLang not installed); one-line error otherwise."""
    release = release_of(version) if version is not None else None
    if release is None:
        found = f"SGLang {version}" if version is not None else "no SGLang installed"
        raise OscarError(
            f"oscar-sglang supports SGLang {' and '.join(SUPPORTED)}, found {found}: "
            f"install one of them (pip install sglang=={list(SUPPORTED)[-1]})"
        )
    return release


def adapter(version: str | None = None) -> ModuleType:
    """The adapter module of the installed SGLang (or of ``version``); one-line error otherwise."""
    if version is None:
        import sglang

        version = str(getattr(sglang, "__version__", "unknown"))
    return importlib.import_module(f"{__name__}.{SUPPORTED[check_release(version)]}")
