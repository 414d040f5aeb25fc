"""The ``oscar`` command through ``main([...])``: calibrate, inspect, engines, plugins, errors."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_smollm2

from oscar_calib.calibrate import CalibrationConfig, calibrate
from oscar_calib.cli import main
from oscar_calib.commands import format_table
from oscar_calib.models import tiny_random_model
from oscar_math.artifact import identity_rotations, load_rotations, save_rotations
from oscar_math.errors import OscarError
from oscar_math.hookspecs import EngineSpec, hookimpl
from oscar_math.plugins import get_plugin_manager


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    model, tok = tiny_random_model("llama", num_hidden_layers=3)
    config = CalibrationConfig(tokens=256, seq_len=128, sink=8, recent=16, max_samples=128)
    rot = calibrate(model, tok, config, model_name="tiny-llama", progress=False)
    return save_rotations(tmp_path_factory.mktemp("art") / "tiny.safetensors", rot)


def _one_line_error(capsys, needle: str) -> None:
    err = capsys.readouterr().err
    assert needle in err, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "calibrate" in capsys.readouterr().out


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("oscar ")


def test_inspect_table(artifact, capsys):
    assert main(["inspect", str(artifact)]) == 0
    out = capsys.readouterr().out
    for needle in (
        "model         tiny-llama",
        "layers        3",
        "KV heads      2",
        "head dim      32",
        "granularity   kv_head",
        "8 sink + 16 recent",
        "key mean      yes",
        # the default's pairs per layer (ROPE_PAIRS_DEFAULT, 8) of this model's d/2 = 16
        "pre-RoPE mean yes, 8-8 of 16 frequency pairs per layer",
        "(format version 3)",
        "tokens 256",
        "bits/element  1k:",
        "K clip min/mean/max",
    ):
        assert needle in out, needle
    table = out[out.index("layer  ") :].splitlines()
    assert len([line for line in table if line.strip()[:1].isdigit()]) == 3


def test_inspect_identity_file_has_no_spectrum(tmp_path, capsys):
    path = save_rotations(tmp_path / "id.safetensors", identity_rotations("m", 2, 4, 64, granularity="layer"))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "key mean      no" in out and "granularity   layer" in out
    assert "pre-RoPE mean no" in out
    assert " - " in out  # unknown (zero) eigenvalues shown as '-'


def test_inspect_corrupt_files_one_line(tmp_path, artifact, capsys):
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(artifact.read_bytes()[:700])
    assert main(["inspect", str(truncated)]) == 2
    _one_line_error(capsys, "truncated or corrupt")
    text = tmp_path / "notes.safetensors"
    text.write_text("this is not a safetensors file at all\n" * 4)
    assert main(["inspect", str(text)]) == 2
    _one_line_error(capsys, "oscar inspect: error:")
    assert main(["inspect", str(tmp_path / "missing.safetensors")]) == 2
    _one_line_error(capsys, "not found")


def test_calibrate_user_errors_one_line(tmp_path, capsys):
    assert main(["calibrate", str(tmp_path / "nope"), "--out", str(tmp_path / "x.safetensors")]) == 2
    _one_line_error(capsys, "model '")
    assert main(["calibrate", "smollm2", "--out", "x.safetensors", "--tokens", "10"]) == 2
    _one_line_error(capsys, "Invalid tokens")
    assert main(["calibrate", "smollm2", "--out", "x", "--granularity", "head"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main(["calibrate", "smollm2"]) == 2  # --out is required
    assert "--out" in capsys.readouterr().err
    assert main(["calibrate", "smollm2", "--out", "x", "--clip-power", "0"]) == 2
    _one_line_error(capsys, "Invalid clip_power")
    assert main(["calibrate", "smollm2", "--out", "x", "--value-clip-power", "2"]) == 2
    _one_line_error(capsys, "Invalid value_clip_power")
    assert main(["calibrate", "smollm2", "--out", "x", "--key-clip-objective", "mse"]) == 2
    assert "invalid choice" in capsys.readouterr().err


class _FakePlugin:
    @hookimpl
    def oscar_engines(self):
        return [
            EngineSpec(name="fakejson", module="json", package="oscar-fake", description="imports"),
            EngineSpec(
                name="ghost", module="no_such_engine_xyz", package="oscar-ghost", description="missing"
            ),
        ]

    @hookimpl
    def oscar_cli_commands(self, subparsers):
        p = subparsers.add_parser("hello", help="plugin command")
        p.add_argument("--name", default="world")
        p.set_defaults(func=lambda args: print(f"hello {args.name}") or 0)


@pytest.fixture
def fake_plugin():
    pm = get_plugin_manager()
    plugin = _FakePlugin()
    pm.register(plugin, name="fake-test-plugin")
    yield plugin
    pm.unregister(plugin)


def test_engines_lists_plugins(fake_plugin, capsys):
    assert main(["engines"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "fakejson" in lines and " yes" in lines["fakejson"]
    import json

    assert f" {json.__version__} " in lines["fakejson"]  # the engine module's own version
    assert "ghost" in lines and " no " in lines["ghost"] and "No module named" in lines["ghost"]


def test_plugin_command(fake_plugin, capsys):
    assert main(["hello", "--name", "oscar"]) == 0
    assert capsys.readouterr().out.strip() == "hello oscar"


def test_format_table_aligns():
    text = format_table(["a", "value"], [["x", 1.5], ["long", 10.25]])
    lines = text.splitlines()
    assert lines[0].startswith("a     value")
    assert lines[2].endswith("  1.5") and lines[3].endswith("10.25")


@needs_smollm2
def test_calibrate_smollm2_then_inspect(tmp_path, capsys):
    out = tmp_path / "smollm2.safetensors"
    args = ["calibrate", "smollm2", "--out", str(out), "--tokens", "512", "--seq-len", "256"]
    args += ["--clip-power", "1", "--value-clip-power", "0.25", "--key-clip-objective", "attention"]
    args += ["--clip-search", "row"]
    assert main([*args, "--granularity", "layer", "--group-size", "32", "--seed", "3", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "512 tokens" in printed
    rot = load_rotations(out, model="smollm2", num_layers=30)
    assert (rot.granularity.value, rot.group_size, rot.num_groups) == ("layer", 32, 1)
    assert rot.calibration["seed"] == 3
    assert (rot.calibration["clip_power"], rot.calibration["value_clip_power"]) == (1.0, 0.25)
    assert rot.calibration["config"]["key_clip_objective"] == "attention"
    assert torch.isfinite(rot.k_clip[0]).all()
    assert main(["inspect", str(out)]) == 0
    assert "model         smollm2" in capsys.readouterr().out


def test_serve_unknown_engine_is_one_line_error(capsys):
    from oscar_calib.cli import main

    assert main(["serve", "--engine", "nosuch", "m", "--rotations", "r.safetensors", "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("oscar serve: error: --engine 'nosuch': no such engine plugin"), err
    assert len(err.splitlines()) == 1


def test_serve_passes_unknown_arguments_to_the_launcher(monkeypatch):
    import types

    from oscar_calib.cli import main
    from oscar_math import plugins
    from oscar_math.hookspecs import EngineSpec

    seen = {}
    fake = types.ModuleType("oscar_fake_launcher")
    fake.launch = lambda model, rotations, engine_args: seen.update(m=model, r=rotations, a=engine_args) or 7
    monkeypatch.setitem(__import__("sys").modules, "oscar_fake_launcher", fake)
    spec = EngineSpec(
        name="fake",
        module="json",
        package="oscar-fake",
        description="d",
        launcher="oscar_fake_launcher:launch",
    )
    monkeypatch.setattr(plugins, "available_engines", lambda: [(spec, True, None)])
    assert main(["serve", "--engine", "fake", "MODEL", "--rotations", "R", "--port", "8000", "-tp", "2"]) == 7
    assert seen == {"m": "MODEL", "r": "R", "a": ["--port", "8000", "-tp", "2"]}


def test_serve_resolves_the_builtin_model_and_serves_it_under_its_name(monkeypatch):
    import types
    from pathlib import Path

    from oscar_calib import models
    from oscar_calib.cli import main
    from oscar_math import plugins
    from oscar_math.hookspecs import EngineSpec

    seen = []
    fake = types.ModuleType("oscar_fake_launcher")
    fake.launch = lambda model, rotations, engine_args: seen.append((model, engine_args)) or 0
    monkeypatch.setitem(__import__("sys").modules, "oscar_fake_launcher", fake)
    spec = EngineSpec(
        name="fake", module="json", package="p", description="d", launcher="oscar_fake_launcher:launch"
    )
    monkeypatch.setattr(plugins, "available_engines", lambda: [(spec, True, None)])
    monkeypatch.setattr(models, "resolve_model", lambda name: Path("/cache/models") / name)
    serve = ["serve", "--engine", "fake"]
    assert main([*serve, "smollm2", "--rotations", "R", "--port", "8000"]) == 0
    assert main([*serve, "smollm2", "--rotations", "R", "--served-model-name=mine"]) == 0
    assert main([*serve, "/my/model", "--rotations", "R", "--port", "8000"]) == 0  # a folder: unchanged
    assert seen == [
        (str(Path("/cache/models/smollm2")), ["--port", "8000", "--served-model-name", "smollm2"]),
        (str(Path("/cache/models/smollm2")), ["--served-model-name=mine"]),
        ("/my/model", ["--port", "8000"]),
    ]


def test_other_commands_still_reject_unknown_arguments(capsys):
    from oscar_calib.cli import main

    assert main(["engines", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_engine_spec_launcher_is_validated():
    import pytest

    from oscar_math.errors import OscarError
    from oscar_math.hookspecs import EngineSpec

    with pytest.raises(OscarError):
        EngineSpec(name="x", module="x", package="p", description="d", launcher="no-colon")


# --- output arguments, context limits: one line naming the user's argument, exit 2 ------------


def test_demo_out_existing_file_is_one_line(tmp_path, capsys):
    taken = tmp_path / "results.txt"
    taken.write_text("mine")
    assert main(["demo", "--out", str(taken)]) == 2
    _one_line_error(capsys, f"oscar demo: error: --out {taken}: is a file, expected a folder")
    assert taken.read_text() == "mine"


def test_calibrate_out_under_a_file_is_one_line(tmp_path, capsys):
    taken = tmp_path / "FILE"
    taken.write_text("mine")
    out = taken / "x.safetensors"
    # checked before the model is loaded: no model files exist here, and none are needed
    assert main(["calibrate", str(tmp_path / "no-model"), "--out", str(out)]) == 2
    _one_line_error(capsys, f"--out {out}: cannot create a folder at {taken}, a file is there")


def test_calibrate_out_folder_names_the_argument_not_a_temp_file(tmp_path, capsys):
    folder = tmp_path / "adir"
    folder.mkdir()
    assert main(["calibrate", "smollm2", "--out", str(folder)]) == 2
    err = capsys.readouterr().err
    assert f"--out {folder}: is a folder; give a file name" in err and ".tmp" not in err
    assert len(err.strip().splitlines()) == 1 and list(folder.iterdir()) == []


def test_eval_plot_without_image_suffix_is_refused(tmp_path, capsys):
    assert main(["eval", "smollm2", "--plot", str(tmp_path / "adir")]) == 2
    _one_line_error(capsys, "--plot " + str(tmp_path / "adir") + ": expected a file name ending in .png")
    assert main(["eval", "smollm2", "--json", str(tmp_path)]) == 2
    _one_line_error(capsys, f"--json {tmp_path}: is a folder")


def test_eval_context_past_the_model_limit_is_refused(monkeypatch, capsys):
    from oscar_calib import models

    loaded = []

    def tiny(name, **kw):
        loaded.append(name)
        return tiny_random_model("llama", max_position_embeddings=512)

    monkeypatch.setattr(models, "load_model", tiny)
    assert main(["eval", "tiny", "--context", "256", "1024", "--needle-context"]) == 2
    _one_line_error(
        capsys, "--context 1024: longer than the model's context limit (max_position_embeddings 512)"
    )
    assert main(["eval", "tiny", "--context", "256", "--needle-context", "600"]) == 2
    _one_line_error(capsys, "--needle-context 600: longer than")
    assert main(["calibrate", "tiny", "--out", "unused.safetensors", "--seq-len", "1024"]) == 2
    _one_line_error(capsys, "--seq-len 1024: longer than")
    assert loaded == ["tiny"] * 3


class _EnginesPlugin:
    @hookimpl
    def oscar_engines(self):
        return [
            EngineSpec(name="stubengine", module="json", package="oscar-stub", description="registry only"),
            EngineSpec(
                name="realengine",
                module="json",
                package="oscar-real",
                description="serves",
                launcher="json:dumps",
            ),
        ]


def test_engines_marks_plugins_without_a_launcher_not_implemented(capsys):
    pm = get_plugin_manager()
    plugin = _EnginesPlugin()
    pm.register(plugin, name="engines-status-test")
    try:
        assert main(["engines"]) == 0
    finally:
        pm.unregister(plugin)
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "not implemented" in lines["stubengine"]
    assert " ready " in lines["realengine"] and "not implemented" not in lines["realengine"]
    assert "cannot serve it yet" in out


def test_engines_none_installed_names_the_repo_path(monkeypatch, capsys):
    import oscar_math.plugins

    monkeypatch.setattr(oscar_math.plugins, "available_engines", lambda: [])
    assert main(["engines"]) == 0
    out = capsys.readouterr().out
    assert "pip install ./packages/oscar-vllm" in out and "pip install oscar-vllm " not in out


def test_calibrate_default_chunk_length_fits_tokens_and_context(monkeypatch, tmp_path, capsys):
    """Default --seq-len: 4096, but never more than --tokens nor the model's context."""
    from oscar_calib import models

    monkeypatch.setattr(
        models, "load_model", lambda name, **kw: tiny_random_model("llama", max_position_embeddings=512)
    )
    out = tmp_path / "t.safetensors"
    args = ["calibrate", "tiny", "--out", str(out), "--sink", "8", "--recent", "16", "--quiet"]
    assert main([*args, "--tokens", "1024"]) == 0  # tiny: 512 positions
    assert load_rotations(out).calibration["seq_len"] == 512 and "(2 x 512)" in capsys.readouterr().out
    assert main([*args, "--tokens", "300"]) == 0
    assert load_rotations(out).calibration["seq_len"] == 300
    assert CalibrationConfig().seq_len == 4096 and CalibrationConfig().tokens == 16384


def test_calibrate_api_refuses_chunks_past_the_model_context():
    model, tok = tiny_random_model("llama", max_position_embeddings=512)
    with pytest.raises(OscarError, match="seq_len"):
        calibrate(model, tok, CalibrationConfig(tokens=2048, seq_len=1024), progress=False)


def test_calibrate_rope_pairs_option(monkeypatch, tmp_path, capsys):
    """--rope-pairs R|all|0: format 3 with R pairs per layer (the summary says so), 0 = format 2."""
    from oscar_calib import models
    from oscar_calib.calibrate import ROPE_PAIRS_DEFAULT

    monkeypatch.setattr(models, "load_model", lambda name, **kw: tiny_random_model("llama"))
    out = tmp_path / "t.safetensors"
    args = [
        "calibrate",
        "tiny",
        "--out",
        str(out),
        "--sink",
        "8",
        "--recent",
        "16",
        "--quiet",
        "--tokens",
        "256",
    ]
    assert main([*args, "--rope-pairs", "3"]) == 0
    rot = load_rotations(out)
    assert rot.format_version == "3" and rot.calibration["rope_mean"]["rope_pairs"] == 3
    assert "pre-RoPE key mean on 3-3 of 16 frequency pairs" in capsys.readouterr().out
    assert main(args) == 0  # the default, 8 pairs of this model's 16
    assert load_rotations(out).calibration["rope_mean"]["rope_pairs"] == ROPE_PAIRS_DEFAULT == 8
    assert "on 8-8 of 16" in capsys.readouterr().out
    assert main([*args, "--rope-pairs", "0"]) == 0
    assert load_rotations(out).format_version == "2" and "pre-RoPE" not in capsys.readouterr().out
    assert main([*args, "--no-key-centering"]) == 0  # the default follows the centering
    assert load_rotations(out).k_rope_mean is None
    capsys.readouterr()
    assert main([*args, "--rope-pairs", "some"]) == 2
    assert "expected an integer >= 0 or 'all'" in capsys.readouterr().err
    assert main([*args, "--rope-pairs", "4", "--no-key-centering"]) == 2
    _one_line_error(capsys, "Invalid rope_pairs")


def test_eval_and_generate_serve_the_artifacts_windows(capsys):
    """`oscar eval` / `oscar generate` measure the layout the engines serve: the artifact's BF16
    windows unless --sink / --recent override them, and an override is said on stderr."""
    from oscar_calib.commands import serving_windows
    from oscar_math.artifact import identity_rotations

    rot = identity_rotations("m", 2, 1, 8, sink_tokens=8, recent_tokens=16)
    assert serving_windows(None, None, rot) == (8, 16)
    assert capsys.readouterr().err == ""
    assert serving_windows(8, 16, rot) == (8, 16)
    assert capsys.readouterr().err == ""
    assert serving_windows(4, None, rot) == (4, 16)
    assert "the artifact's (what the engines serve) are 8 + 16" in capsys.readouterr().err
    assert serving_windows(None, None, None) == (64, 256)  # no artifact (bf16 / baselines only)
