import importlib.metadata as md
import importlib.util

import pytest

from oscar_math.plugins import available_engines, get_plugin_manager

INSTALLED = any(ep.name == "vllm" for ep in md.entry_points(group="oscar"))
ENGINE_PRESENT = importlib.util.find_spec("vllm") is not None


@pytest.fixture(autouse=True)
def fresh_manager(monkeypatch):
    monkeypatch.delenv("OSCAR_PLUGINS", raising=False)
    get_plugin_manager.cache_clear()
    yield
    get_plugin_manager.cache_clear()


def test_plugin_module_does_not_import_the_engine():
    import sys

    import oscar_vllm.plugin as plugin

    assert plugin.oscar_engines()[0].module == "vllm"
    if not ENGINE_PRESENT:
        assert "vllm" not in sys.modules


@pytest.mark.skipif(not INSTALLED, reason="oscar-vllm not installed (no oscar entry point vllm)")
def test_available_engines_lists_vllm():
    engines = {spec.name: (spec, ok, err) for spec, ok, err in available_engines()}
    spec, ok, err = engines["vllm"]
    assert spec.package == "oscar-vllm" and spec.module == "vllm"
    if ENGINE_PRESENT:
        assert ok and err is None
    else:
        assert not ok and "vllm" in err and "ModuleNotFoundError" in err
