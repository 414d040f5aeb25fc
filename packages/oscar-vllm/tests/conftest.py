"""Fixtures the engine tests share: the SmolLM2 folder and one artifact calibrated per session."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


@pytest.fixture(scope="session")
def model_dir() -> str:
    """SmolLM2-135M's converted folder (skipped with the reason when it cannot be had)."""
    try:
        from oscar_calib.models import resolve_model

        return str(resolve_model("smollm2"))
    except Exception as e:  # OscarError (no GGUF / cache), ImportError (no oscar-calib)
        pytest.skip(f"SmolLM2 is not available: {e}")


@pytest.fixture(scope="session")
def artifact(model_dir, tmp_path_factory) -> str:
    """Calibrated once per session by oscar-calib's `oscar calibrate` code path (256 tokens: ~50 s
    on 2 cores); the engine tests and the HTTP server tests serve the same file."""
    from oscar_calib.calibrate import CalibrationConfig, calibrate
    from oscar_calib.models import load_model
    from oscar_math.artifact import save_rotations

    model, tok = load_model(model_dir)
    rot = calibrate(
        model, tok, CalibrationConfig(tokens=256, seq_len=256), model_name="smollm2", progress=False
    )
    del model
    return str(save_rotations(tmp_path_factory.mktemp("oscar") / "rot.safetensors", rot))


def fresh_process_ran(request, interpret_on_gpu: bool = False) -> bool:  # noqa: ANN001
    """Where Triton was imported in this process without the interpreter (an earlier test in
    the same worker), its own @triton.jit helpers cannot run interpreted: run this test alone in
    a new process with ``TRITON_INTERPRET=1`` and fail if it fails there. False: run it here.
    ``interpret_on_gpu``: a test that interprets on a GPU machine too goes to a new process there
    always: interpreting here would leave the kernels bound to the interpreter for the GPU tests
    after it (seen on the H200). Other tests run on the GPU, here."""
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("OSCAR_FRESH_PROCESS") == "1":
        return False
    if torch.cuda.is_available() and not interpret_on_gpu:
        return False
    if "triton" not in sys.modules and not torch.cuda.is_available():
        return False
    env = dict(os.environ, TRITON_INTERPRET="1", OSCAR_FRESH_PROCESS="1")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        request.node.nodeid,
    ]
    p = subprocess.run(cmd, cwd=request.config.rootpath, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return True
