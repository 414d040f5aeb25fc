"""Only ``compat.py`` names vLLM's modules: an engine upgrade that moves a class touches one file.
Parses every module of the package (imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import oscar_vllm

SRC = Path(oscar_vllm.__file__).parent


def _vllm_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found += [f"{path.name}:{node.lineno} {n}" for n in names if n == "vllm" or n.startswith("vllm.")]
    return found


def test_only_compat_imports_vllm():
    modules = sorted(SRC.glob("*.py"))
    assert len(modules) > 5 and any(p.name == "compat.py" for p in modules)
    assert _vllm_imports(SRC / "compat.py"), "the check finds nothing: it would pass vacuously"
    stray = [hit for p in modules if p.name != "compat.py" for hit in _vllm_imports(p)]
    assert stray == [], stray
