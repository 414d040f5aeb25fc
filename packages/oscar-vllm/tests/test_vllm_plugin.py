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


def _api_check():
    import sys
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "api_check.py"
    spec = importlib.util.spec_from_file_location("oscar_vllm_api_check", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not ENGINE_PRESENT, reason="vLLM is not installed (run the nox session 'vllm')")
def test_api_check_passes_on_the_installed_vllm(monkeypatch, capsys):
    # the same script checks another release's sources statically (docs/vllm.md: the 0.33.0 audit)
    mod = _api_check()
    assert mod.main() == 0, capsys.readouterr().out
    # it can fail: an engine core whose KV-cache init changed signature is reported
    from vllm.v1.engine import core

    monkeypatch.setattr(core.EngineCore, "_initialize_kv_caches", lambda self, vllm_config, extra: None)
    assert mod.main() == 1
    assert "FAIL  check_config_and_engine" in capsys.readouterr().out
