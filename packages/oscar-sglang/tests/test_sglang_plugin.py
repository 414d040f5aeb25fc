import importlib.metadata as md
import importlib.util

import pytest

from oscar_math.plugins import available_engines, get_plugin_manager

INSTALLED = any(ep.name == "sglang" for ep in md.entry_points(group="oscar"))
ENGINE_PRESENT = importlib.util.find_spec("sglang") is not None


@pytest.fixture(autouse=True)
def fresh_manager(monkeypatch):
    monkeypatch.delenv("OSCAR_PLUGINS", raising=False)
    get_plugin_manager.cache_clear()
    yield
    get_plugin_manager.cache_clear()


def test_plugin_module_does_not_import_the_engine():
    import sys

    import oscar_sglang.plugin as plugin

    assert plugin.oscar_engines()[0].module == "sglang"
    if not ENGINE_PRESENT:
        assert "sglang" not in sys.modules


@pytest.mark.skipif(not INSTALLED, reason="oscar-sglang not installed (no oscar entry point sglang)")
def test_available_engines_lists_sglang():
    engines = {spec.name: (spec, ok, err) for spec, ok, err in available_engines()}
    spec, ok, err = engines["sglang"]
    assert spec.package == "oscar-sglang" and spec.module == "sglang"
    if ENGINE_PRESENT:
        assert ok and err is None
    else:
        assert not ok and "sglang" in err and "ModuleNotFoundError" in err
