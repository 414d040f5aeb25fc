"""The plugin-contract checks engine packages call from their tests fail on a broken plugin."""

import sys
import types

import pytest

from oscar_math.hookspecs import EngineSpec
from oscar_math.plugin_checks import check_engine_listed, check_plugin_module, plugin_installed


def _module(monkeypatch, name: str, engine_module: str) -> None:
    mod = types.ModuleType(name)
    mod.oscar_engines = lambda: [
        EngineSpec(name="x", package="oscar-x", module=engine_module, description="a test plugin")
    ]
    monkeypatch.setitem(sys.modules, name, mod)


def test_a_plugin_naming_another_engine_fails(monkeypatch):
    _module(monkeypatch, "fake_oscar_plugin", "json")
    check_plugin_module("fake_oscar_plugin", "json")  # names its engine: passes
    with pytest.raises(AssertionError, match="expected 'csv'"):
        check_plugin_module("fake_oscar_plugin", "csv")


def test_an_unlisted_engine_fails():
    assert not plugin_installed("no-such-engine")
    with pytest.raises(AssertionError, match="no-such-engine is not among the listed engines"):
        check_engine_listed("no-such-engine", "oscar-none")


def test_contract_tests_skip_the_listing_with_the_reason_when_the_package_is_absent(monkeypatch):
    from oscar_math.plugin_checks import contract_tests

    _module(monkeypatch, "fake_oscar_plugin", "json")
    module_test, listed_test = contract_tests("json", "oscar-json", "fake_oscar_plugin")
    module_test(monkeypatch)  # the plugin module names its engine
    with pytest.raises(pytest.skip.Exception, match="oscar-json not installed"):
        listed_test(monkeypatch)
    bad_module_test, _ = contract_tests("csv", "oscar-csv", "fake_oscar_plugin")
    with pytest.raises(AssertionError):
        bad_module_test(monkeypatch)
