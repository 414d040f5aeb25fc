"""compat.pin_triton_cache: OSCAR's Triton kernels in one cache folder from start to start."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from oscar_vllm import compat


def test_an_unset_folder_is_pinned_to_tritons_default(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))  # Triton's default folder lies under it
    env: dict[str, str] = {}
    folder = compat.pin_triton_cache(env)
    assert folder == env["TRITON_CACHE_DIR"]
    assert Path(folder) == tmp_path / ".triton" / "cache"


def test_a_folder_the_user_chose_is_kept(tmp_path):
    env = {"TRITON_CACHE_DIR": str(tmp_path / "mine")}
    assert compat.pin_triton_cache(env) is None
    assert env == {"TRITON_CACHE_DIR": str(tmp_path / "mine")}


def test_inductor_keeps_the_pinned_folder(monkeypatch, tmp_path):
    """Inductor (under vLLM's torch.compile) points an unset TRITON_CACHE_DIR at a folder of its own
    cache (``<TORCHINDUCTOR_CACHE_DIR>/triton/<device>``, what the H100 logs showed OSCAR's kernels
    landing in), and keeps a set one: why pinning it before the model compiles is enough."""
    cdu = pytest.importorskip("torch._inductor.runtime.cache_dir_utils", reason="needs torch's Inductor")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert cdu.triton_cache_dir(0).startswith(str(tmp_path / "inductor"))  # unpinned: compile's folder
    pinned = compat.pin_triton_cache()
    assert cdu.triton_cache_dir(0) == pinned == str(tmp_path / "home" / ".triton" / "cache")
    assert os.environ["TRITON_CACHE_DIR"] == pinned
