"""``oscar serve --engine sglang``: checks the artifact, then runs SGLang's server (mocked)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from oscar_math.artifact import identity_rotations, save_rotations
from oscar_math.errors import OscarError
from oscar_sglang import launch as launch_mod
from oscar_sglang.core import ENV_ROTATIONS
from oscar_sglang.plugin import ENGINE


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    cfg = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "num_hidden_layers": 30}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture
def calls(monkeypatch):
    seen = []

    def fake_call(cmd, env=None):
        seen.append((cmd, env))
        return 0

    monkeypatch.setattr(subprocess, "call", fake_call)
    return seen


def test_engine_spec_names_the_launcher():
    module, func = ENGINE.launcher.split(":")
    assert module == "oscar_sglang.launch" and func == "launch" and callable(launch_mod.launch)


def test_launch_runs_sglang_with_the_backend_and_rotations(tmp_path, model, calls):
    rot = save_rotations(tmp_path / "rot.safetensors", identity_rotations("m", 30, 3, 64))
    assert launch_mod.launch(str(model), str(rot), ["--port", "8001", "--page-size", "64"]) == 0
    ((cmd, env),) = calls
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert cmd[cmd.index("--attention-backend") + 1] == "oscar"
    assert cmd[cmd.index("--oscar-rotations") + 1] == str(rot.resolve())
    assert cmd[-4:] == ["--port", "8001", "--page-size", "64"] and "--disable-cuda-graph" in cmd
    assert env[ENV_ROTATIONS] == str(rot.resolve())


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: None, "rotations file not found"),
        (lambda p: p.write_bytes(b"not a safetensors file"), "rot.safetensors"),
        (lambda p: save_rotations(p, identity_rotations("m", 30, 2, 64)), "num_kv_heads mismatch"),
        (lambda p: save_rotations(p, identity_rotations("m", 28, 3, 64)), "num_layers mismatch"),
    ],
)
def test_launch_rejects_bad_artifacts_before_starting(tmp_path, model, calls, make, match):
    path = tmp_path / "rot.safetensors"
    make(path)
    with pytest.raises(OscarError, match=match) as e:
        launch_mod.launch(str(model), str(path), [])
    assert "\n" not in str(e.value) and not calls


def test_launch_rejects_other_backends_and_bad_models(tmp_path, model, calls):
    rot = save_rotations(tmp_path / "rot.safetensors", identity_rotations("m", 30, 3, 64))
    with pytest.raises(OscarError, match="--attention-backend fa3"):
        launch_mod.launch(str(model), str(rot), ["--attention-backend", "fa3"])
    with pytest.raises(OscarError, match="no config.json"):
        launch_mod.launch(str(tmp_path), str(rot), [])
    (model / "config.json").write_text(
        json.dumps({"num_attention_heads": 4, "hidden_size": 288, "num_hidden_layers": 30})
    )
    with pytest.raises(OscarError, match="unsupported head dim 72"):
        launch_mod.launch(str(model), str(rot), [])
    assert not calls
