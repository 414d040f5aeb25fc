"""One test per hook (named ``test_hook_<name>``), plus the meta-test that enforces it."""

import argparse
import re
from pathlib import Path

import pytest

from oscar_math import hookspecs
from oscar_math.hookspecs import EngineSpec, SchemeSpec, hookimpl
from oscar_math.plugins import add_plugin_commands, available_engines, available_schemes, get_plugin_manager

HOOKS = sorted(name for name, fn in vars(hookspecs).items() if hasattr(fn, "oscar_spec"))
DOCS = Path(__file__).resolve().parents[3] / "docs" / "hooks.md"


class _Plugin:
    @hookimpl
    def oscar_schemes(self):
        return [SchemeSpec("test-scheme", "a test scheme", factory=lambda **kw: ("built", kw))]

    @hookimpl
    def oscar_engines(self):
        return [EngineSpec("test-engine", "json", "oscar-test", "stdlib json as a stand-in engine")]

    @hookimpl
    def oscar_cli_commands(self, subparsers):
        p = subparsers.add_parser("hello", help="say hello")
        p.add_argument("--name", default="world")
        p.set_defaults(func=lambda args: f"hello {args.name}")


@pytest.fixture
def pm():
    get_plugin_manager.cache_clear()
    pm = get_plugin_manager()
    pm.register(_Plugin(), name="test-plugin")
    yield pm
    get_plugin_manager.cache_clear()


def test_hook_oscar_schemes(pm):
    schemes = available_schemes()
    spec = schemes["test-scheme"]
    assert spec.factory(x=1) == ("built", {"x": 1})


def test_hook_oscar_engines(pm):
    engines = {spec.name: (ok, err) for spec, ok, err in available_engines()}
    assert engines["test-engine"] == (True, None)


def test_hook_oscar_cli_commands(pm):
    parser = argparse.ArgumentParser(prog="oscar")
    add_plugin_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["hello", "--name", "oscar"])
    assert args.func(args) == "hello oscar"


def test_every_hook_has_a_test():
    assert HOOKS == ["oscar_cli_commands", "oscar_engines", "oscar_schemes"]
    source = Path(__file__).read_text()
    missing = [h for h in HOOKS if f"def test_hook_{h}(" not in source]
    assert not missing, f"hooks without a test_hook_<name> test: {missing}"


@pytest.mark.skipif(not DOCS.exists(), reason="docs/hooks.md not beside this checkout (package tested alone)")
def test_every_hook_is_documented():
    text = DOCS.read_text()
    sections = set(re.findall(r"^## `?(\w+)", text, flags=re.M))
    missing = [h for h in HOOKS if h not in sections]
    assert not missing, f"hooks without a '## <name>' section in docs/hooks.md: {missing}"


def test_every_hook_has_a_docstring():
    assert all((getattr(hookspecs, h).__doc__ or "").strip() for h in HOOKS)
