"""Which third-party modules an SGLang server start imports at module level (static, no import).

Usage: python3 sglang_imports.py SITE_DIR [ROOT_MODULE ...]

Walks the module-level ``import``/``from`` statements (also inside module-level ``if`` blocks,
which run on CUDA) from the root modules through every ``sglang``/``sgl_kernel`` module they
reach, and prints each third-party top-level name with whether SITE_DIR (an unpacked target dir)
has it. Imports inside functions are lazy and not followed; those inside ``try`` are marked
guarded. A check made on a CPU machine for a GPU machine with no package index: a name that is
neither in SITE_DIR nor in the GPU image (gpu-image-packages.txt) fails there at start-up.
"""

from __future__ import annotations

import ast
import os
import sys

DEFAULT_ROOTS = [
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.qwen3",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.sampler",
    "sglang.bench_one_batch_server",
    "sglang.bench_serving",
]
OWN = ("sglang", "sgl_kernel", "flashinfer", "xgrammar", "tvm_ffi")


def module_file(site: str, mod: str) -> str | None:
    base = os.path.join(site, *mod.split("."))
    for p in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.exists(p):
            return p
    return None


def top_imports(tree: ast.Module, mod: str, is_pkg: bool) -> list[tuple[str, bool]]:
    """(absolute module name, guarded) for every module-level import; guarded = inside ``try`` or
    a module-level ``if`` (platform/env switches: aiter on ROCm, deep_gemm behind an env var)."""
    out: list[tuple[str, bool]] = []

    def visit(stmts: list[ast.stmt], guarded: bool) -> None:
        for s in stmts:
            if isinstance(s, ast.Import):
                out.extend((a.name, guarded) for a in s.names)
            elif isinstance(s, ast.ImportFrom):
                if s.level:
                    parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    parts = parts[: len(parts) - (s.level - 1)]
                    base = ".".join(parts + ([s.module] if s.module else []))
                else:
                    base = s.module or ""
                out.append((base, guarded))
                out.extend((f"{base}.{a.name}", guarded) for a in s.names)  # submodules, if any
            elif isinstance(s, ast.Try):
                visit(s.body, True)
                for h in s.handlers:
                    visit(h.body, guarded)
                visit(s.orelse, guarded)
                visit(s.finalbody, guarded)
            elif isinstance(s, ast.If):
                if "TYPE_CHECKING" in ast.unparse(s.test):
                    continue
                visit(s.body, True)
                visit(s.orelse, True)
            elif isinstance(s, (ast.With,)):
                visit(s.body, guarded)

    visit(tree.body, False)
    return out


def main() -> None:
    site, *roots = sys.argv[1:]
    todo = list(roots or DEFAULT_ROOTS)
    seen: set[str] = set()
    third: dict[str, tuple[bool, str]] = {}  # name -> (always guarded, an unguarded importer)
    by: dict[str, str] = {}  # module -> the module that first imported it (for the chain)
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        f = module_file(site, mod)
        if f is None:
            continue
        # a package's __init__ runs before any of its submodules
        parent = mod.rsplit(".", 1)[0]
        if "." in mod and parent not in seen:
            by.setdefault(parent, mod)
            todo.append(parent)
        tree = ast.parse(open(f, encoding="utf-8").read())
        for name, guarded in top_imports(tree, mod, f.endswith("__init__.py")):
            top = name.split(".")[0]
            if not top:
                continue
            if top in OWN:
                if not guarded:  # follow only imports that always run
                    by.setdefault(name, mod)
                    todo.append(name)
            else:
                g0, who = third.get(top, (True, mod))
                third[top] = (g0 and guarded, who if (g0 is False or guarded) else mod)
    stdlib = set(sys.stdlib_module_names)
    for top in sorted(third):
        if top in stdlib or top == "__future__":
            continue
        guarded, who = third[top]
        have = any(os.path.exists(os.path.join(site, top + s)) for s in ("", ".py")) or any(
            n.startswith(top + ".") and n.endswith((".so",)) for n in os.listdir(site)
        )
        chain = [who]
        while chain[-1] in by and len(chain) < 30:
            chain.append(by[chain[-1]])
        where = " <- ".join(chain) if not (have or guarded) else who
        print(f"{top:22s} {'site ' if have else '---- '} {'guarded' if guarded else 'REQUIRED'}  {where}")
    print(f"# {len(seen)} modules walked")


if __name__ == "__main__":
    main()
