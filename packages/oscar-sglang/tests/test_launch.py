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
    # the command line is what these tests check: a supported SGLang is assumed here
    # (test_launch_checks_the_sglang_release covers the check itself)
    monkeypatch.setattr(launch_mod, "installed_sglang", lambda: "0.5.23")
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
    # CUDA graphs are SGLang's choice: --disable-cuda-graph is passed through, never added
    assert cmd[-4:] == ["--port", "8001", "--page-size", "64"] and "--disable-cuda-graph" not in cmd
    assert env[ENV_ROTATIONS] == str(rot.resolve())
    launch_mod.launch(str(model), str(rot), ["--disable-cuda-graph"])
    assert calls[-1][0].count("--disable-cuda-graph") == 1


def test_launch_checks_the_sglang_release(tmp_path, model, calls, monkeypatch):
    from oscar_sglang.compat import SUPPORTED, release_of

    rot = save_rotations(tmp_path / "rot.safetensors", identity_rotations("m", 30, 3, 64))
    for version, found in (("0.5.30", "found SGLang 0.5.30"), (None, "found no SGLang installed")):
        monkeypatch.setattr(launch_mod, "installed_sglang", lambda v=version: v)
        with pytest.raises(OscarError, match=f"supports SGLang 0.5.17 and 0.5.23, {found}") as e:
            launch_mod.launch(str(model), str(rot), [])
        assert "\n" not in str(e.value) and not calls
    monkeypatch.setattr(launch_mod, "installed_sglang", lambda: "0.5.17.post1")
    assert launch_mod.launch(str(model), str(rot), []) == 0
    assert set(SUPPORTED) == {"0.5.17", "0.5.23"}
    assert [release_of(v) for v in ("0.5.23", "0.5.17+cu130", "0.5.18", "0.5.1", "0.5.170")] == [
        "0.5.23",
        "0.5.17",
        None,
        None,
        None,
    ]
    monkeypatch.undo()  # the real metadata: the session's SGLang is a supported one
    installed = launch_mod.installed_sglang()
    if installed is not None:
        assert release_of(installed) in SUPPORTED


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
