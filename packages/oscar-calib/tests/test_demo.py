"""``oscar demo`` end to end on SmolLM2, shrunk to about a minute."""

from __future__ import annotations

import importlib.util
import json

import pytest


def _smollm2_available() -> bool:
    return all(importlib.util.find_spec(m) for m in ("gguf", "accelerate"))


@pytest.mark.skipif(not _smollm2_available(), reason="needs oscar-calib[smollm2] (gguf, accelerate)")
def test_demo_smollm2_small(tmp_path, monkeypatch, capsys):
    from oscar_calib.cli import main
    from oscar_calib.commands import demo

    monkeypatch.setattr(demo, "DEMO_CALIBRATION", {"tokens": 512, "seq_len": 512, "granularity": "kv_head"})
    monkeypatch.setattr(
        demo,
        "DEMO_EVAL",
        {
            "schemes": ("bf16", "int2", "kivi2", "hadamard2", "oscar2"),
            "contexts": (400,),
            "num_sequences": 1,
            "sink": 16,
            "recent": 64,
            "needle_contexts": (300,),
            "needle_depths": (0.5,),
            "needle_schemes": ("bf16", "oscar2"),
        },
    )
    assert main(["demo", "--out", str(tmp_path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "[demo] total" in out and "oscar2" in out and "passkey" in out
    result = json.loads((tmp_path / "results.json").read_text())
    block = result["contexts"]["400"]
    assert block["bf16"]["kl"]["mean"] == 0
    for name in ("int2", "kivi2", "hadamard2", "oscar2"):
        assert 0 < block[name]["kl"]["mean"] < 5
    assert (tmp_path / "results.png").stat().st_size > 10_000
    assert (tmp_path / "rotations.safetensors").exists()
