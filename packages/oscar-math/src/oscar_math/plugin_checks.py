"""Checks an engine plugin's own tests run against the plugin contract (:mod:`oscar_math.plugins`).

Each engine package (oscar-vllm, oscar-sglang, a third party's) calls these from its tests, so the
contract is written once: the plugin module names its engine without importing it, and an
installed package is listed by :func:`~oscar_math.plugins.available_engines` with the reason when
the engine itself is missing.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .plugins import available_engines, get_plugin_manager

__all__ = [
    "fresh_plugin_manager",
    "plugin_installed",
    "check_plugin_module",
    "check_engine_listed",
    "contract_tests",
]


@contextmanager
def fresh_plugin_manager() -> Iterator[None]:
    """A plugin manager built from the entry points alone (``OSCAR_PLUGINS`` must be unset)."""
    get_plugin_manager.cache_clear()
    try:
        yield
    finally:
        get_plugin_manager.cache_clear()


def plugin_installed(engine: str) -> bool:
    """Whether a distribution declares the ``oscar`` entry point ``engine``."""
    return any(ep.name == engine for ep in importlib.metadata.entry_points(group="oscar"))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def check_plugin_module(module: str, engine: str) -> None:
    """``module``'s ``oscar_engines()`` names ``engine`` first, and importing it did not import
    the engine where the engine is not installed (listing plugins must stay cheap)."""
    present = importlib.util.find_spec(engine) is not None
    spec = importlib.import_module(module).oscar_engines()[0]
    _require(spec.module == engine, f"{module} names engine module {spec.module!r}, expected {engine!r}")
    if not present:
        _require(engine not in sys.modules, f"importing {module} imported {engine}")


def check_engine_listed(engine: str, package: str) -> None:
    """:func:`available_engines` lists ``engine`` from ``package``: importable where the engine is
    installed, else not, with a ``ModuleNotFoundError`` naming it."""
    engines = {spec.name: (spec, ok, err) for spec, ok, err in available_engines()}
    _require(engine in engines, f"{engine} is not among the listed engines {sorted(engines)}")
    spec, ok, err = engines[engine]
    _require(spec.package == package and spec.module == engine, f"unexpected spec {spec}")
    if importlib.util.find_spec(engine) is not None:
        _require(ok and err is None, f"{engine} is installed but listed as not importable: {err}")
    else:
        _require(not ok and engine in (err or "") and "ModuleNotFoundError" in (err or ""), f"reason: {err}")


def contract_tests(engine: str, package: str, module: str) -> tuple[Callable[..., None], Callable[..., None]]:
    """The two contract tests of an engine plugin, for its test module to bind at top level::

        test_plugin_module, test_engine_listed = contract_tests("vllm", "oscar-vllm", "oscar_vllm.plugin")

    Each runs with a plugin manager built from the entry points alone; the listing test is skipped
    with the reason where ``package`` is not installed (no ``oscar`` entry point ``engine``)."""

    def test_plugin_module(monkeypatch: Any) -> None:
        monkeypatch.delenv("OSCAR_PLUGINS", raising=False)
        with fresh_plugin_manager():
            check_plugin_module(module, engine)

    def test_engine_listed(monkeypatch: Any) -> None:
        if not plugin_installed(engine):
            import pytest  # only ever called by pytest

            pytest.skip(f"{package} not installed (no oscar entry point {engine})")
        monkeypatch.delenv("OSCAR_PLUGINS", raising=False)
        with fresh_plugin_manager():
            check_engine_listed(engine, package)

    return test_plugin_module, test_engine_listed
