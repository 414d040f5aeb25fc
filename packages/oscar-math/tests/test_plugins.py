import importlib.metadata as md
import textwrap

import pytest

from oscar_math import OscarError
from oscar_math import plugins as plugins_mod
from oscar_math.hookspecs import EngineSpec, SchemeSpec, hookimpl
from oscar_math.plugins import available_engines, available_schemes, get_plugin_manager, plugin_load_errors

PLUGIN_SRC = """
from oscar_math.hookspecs import EngineSpec, SchemeSpec, hookimpl

@hookimpl
def oscar_schemes():
    return [SchemeSpec("{scheme}", "from {mod}", factory=dict)]

@hookimpl
def oscar_engines():
    return [EngineSpec("{engine}", "{module}", "pkg-{mod}", "engine from {mod}")]
"""


@pytest.fixture
def fake_entry_points(tmp_path, monkeypatch):
    """Write plugin modules into tmp_path and expose them as ``oscar`` entry points."""
    monkeypatch.syspath_prepend(str(tmp_path))
    eps: list[md.EntryPoint] = []

    def add(name, source):
        mod = f"oscar_test_plugin_{name.replace('-', '_')}"
        (tmp_path / f"{mod}.py").write_text(textwrap.dedent(source))
        eps.append(md.EntryPoint(name=name, value=mod, group="oscar"))

    monkeypatch.setattr(plugins_mod, "entry_points", lambda group: [e for e in eps if e.group == group])
    monkeypatch.delenv("OSCAR_PLUGINS", raising=False)
    get_plugin_manager.cache_clear()
    yield add
    get_plugin_manager.cache_clear()


def _plugin(name, scheme, engine, module="json"):
    return PLUGIN_SRC.format(scheme=scheme, engine=engine, module=module, mod=name)


def test_entry_points_load_and_engines_report_importability(fake_entry_points):
    fake_entry_points("a", _plugin("a", "s-a", "e-a", module="json"))
    fake_entry_points("b", _plugin("b", "s-b", "e-b", module="surely_not_an_installed_engine_xyz"))
    assert set(available_schemes()) == {"s-a", "s-b"}
    engines = {s.name: (s, ok, err) for s, ok, err in available_engines()}
    assert engines["e-a"][1:] == (True, None)
    spec, ok, err = engines["e-b"]
    assert not ok and "ModuleNotFoundError" in err and "surely_not_an_installed_engine_xyz" in err
    assert spec.package == "pkg-b"


def test_env_var_limits_entry_points(fake_entry_points, monkeypatch):
    fake_entry_points("a", _plugin("a", "s-a", "e-a"))
    fake_entry_points("b", _plugin("b", "s-b", "e-b"))
    monkeypatch.setenv("OSCAR_PLUGINS", "b, c")
    get_plugin_manager.cache_clear()
    assert set(available_schemes()) == {"s-b"}
    monkeypatch.setenv("OSCAR_PLUGINS", "")
    get_plugin_manager.cache_clear()
    assert available_schemes() == {}


def test_duplicate_scheme_names_name_both_plugins(fake_entry_points):
    fake_entry_points("first", _plugin("first", "same", "e1"))
    fake_entry_points("second", _plugin("second", "same", "e2"))
    match = r"Duplicate scheme name 'same': registered by plugins '(first|second)' and '(first|second)'"
    with pytest.raises(OscarError, match=match):
        available_schemes()


def test_broken_plugin_is_reported_not_fatal(fake_entry_points):
    fake_entry_points("good", _plugin("good", "s-good", "e-good"))
    fake_entry_points("broken", "raise RuntimeError('plugin exploded')\n")
    assert set(available_schemes()) == {"s-good"}
    errors = plugin_load_errors()
    assert set(errors) == {"broken"} and "RuntimeError: plugin exploded" in errors["broken"]


def test_default_plugins_register_through_the_same_hooks(fake_entry_points, tmp_path, monkeypatch):
    (tmp_path / "oscar_test_builtin.py").write_text(_plugin("builtin", "s-builtin", "e-builtin"))
    monkeypatch.setattr(plugins_mod, "DEFAULT_PLUGINS", ("oscar_test_builtin",))
    monkeypatch.setenv("OSCAR_PLUGINS", "")  # built-ins load even when no entry point may
    get_plugin_manager.cache_clear()
    assert set(available_schemes()) == {"s-builtin"}


def test_plugin_manager_is_cached(fake_entry_points):
    assert get_plugin_manager() is get_plugin_manager()


def test_wrong_result_type_names_plugin(fake_entry_points):
    class Bad:
        @hookimpl
        def oscar_schemes(self):
            return ["not a spec"]

    get_plugin_manager().register(Bad(), name="bad-plugin")
    with pytest.raises(OscarError, match="oscar_schemes result from plugin 'bad-plugin'"):
        available_schemes()


def test_spec_validation():
    with pytest.raises(OscarError, match="SchemeSpec.factory"):
        SchemeSpec("x", "y", factory="not callable")
    with pytest.raises(OscarError, match="EngineSpec.name"):
        EngineSpec("", "vllm", "oscar-vllm", "")
