"""Fixtures the engine tests share: the SmolLM2 folder and one artifact calibrated per session."""

from __future__ import annotations

import pytest


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
