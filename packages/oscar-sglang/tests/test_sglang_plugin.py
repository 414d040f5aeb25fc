import importlib.util

import pytest

from oscar_math.plugin_checks import (
    check_engine_listed,
    check_plugin_module,
    fresh_plugin_manager,
    plugin_installed,
)

ENGINE_PRESENT = importlib.util.find_spec("sglang") is not None
NOT_INSTALLED = "oscar-sglang not installed (no oscar entry point sglang)"


@pytest.fixture(autouse=True)
def fresh_manager(monkeypatch):
    monkeypatch.delenv("OSCAR_PLUGINS", raising=False)
    with fresh_plugin_manager():
        yield


def test_plugin_module_does_not_import_the_engine():
    check_plugin_module("oscar_sglang.plugin", "sglang")


@pytest.mark.skipif(not plugin_installed("sglang"), reason=NOT_INSTALLED)
def test_available_engines_lists_sglang():
    check_engine_listed("sglang", "oscar-sglang")
