"""The H200 study script of the pre-RoPE key mean (lab/calib_studies/rope_study.py), dry-run on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1]


@pytest.fixture
def rope_study(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import rope_study

    return rope_study


def test_rope_study_tiny_dry_run(rope_study, tmp_path):
    out = tmp_path / "o"
    argv = [
        "--out",
        str(out),
        "--tiny",
        "--tokens",
        "1024",
        "--seq-len",
        "512",
        "--variants",
        "0",
        "4",
        "all",
    ]
    argv += ["--select-contexts", "512", "--select-seqs", "1", "--contexts", "512", "--num-seqs", "2"]
    argv += [
        "--other-contexts",
        "512",
        "--other-seqs",
        "1",
        "--served",
        "512",
        "--ablations",
        "oscar2-noclip",
    ]
    assert rope_study.main(argv) == 0
    rep = json.loads((out / "rope_study.json").read_text())
    arts = rep["artifacts"]
    assert arts[rope_study.PREVIOUS]["format_version"] == "2"
    assert arts["oscar2 rope_pairs 4"]["format_version"] == "3"
    assert arts["oscar2 rope_pairs 4"]["rope_mean"]["pairs_per_layer"] == [
        sorted(p) for p in arts["oscar2 rope_pairs 4"]["rope_mean"]["pairs_per_layer"]
    ]
    assert all(len(p) == 4 for p in arts["oscar2 rope_pairs 4"]["rope_mean"]["pairs_per_layer"])
    assert rep["pick"] in arts and "emulation" not in rep["pick"]
    held = rep["heldout"]["512"]
    for name in (
        "bf16",
        "int2",
        "kivi2",
        "hadamard2",
        rope_study.PREVIOUS,
        "oscar2 rope_pairs all",
        rep["pick"],
    ):
        assert len(held["schemes"][name]["kl"]) == 2, name  # per-sequence values
        assert name in held["bits"]
    assert held["bits"]["bf16"] == 16.0
    assert len(held["schemes"][rope_study.ablation_label("oscar2-noclip", rep["pick"])]["kl"]) == 2
    assert rope_study.nofeedback_label(rep["pick"]) in held["schemes"]
    assert "512" in rep["other"]
    assert "served" in rep or rep["served_skipped"]
    for v in ("0", "4", "all"):
        assert (out / f"rope_pairs_{v}.safetensors").is_file()


def test_rope_study_budget_skips_other_text(rope_study, tmp_path):
    out = tmp_path / "o"
    argv = ["--out", str(out), "--tiny", "--tokens", "512", "--seq-len", "512", "--variants", "0", "all"]
    argv += ["--select-contexts", "--select-seqs", "--contexts", "512", "--num-seqs", "1", "--budget-s", "0"]
    argv += ["--no-emulation"]
    assert rope_study.main(argv) == 0
    rep = json.loads((out / "rope_study.json").read_text())
    assert rep["skipped"] == ["other"] and "other" not in rep
    assert rep["pick"] == "oscar2 rope_pairs all"  # no selection: the provisional default


def test_rope_study_rejects_negative_pairs(rope_study):
    with pytest.raises(SystemExit):
        rope_study.main(["--variants", "-1", "--tiny"])
