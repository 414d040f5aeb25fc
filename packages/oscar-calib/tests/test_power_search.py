"""Per-block clip powers chosen by end-to-end KL: the blocks, the stored ratios, the descent, and
what calibrate(clip_search="kl") writes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from oscar_calib import power_search
from oscar_calib.calibrate import CalibrationConfig, calibrate, calibration_chunks, rotations_from_statistics
from oscar_calib.capture import collect_statistics
from oscar_calib.models import tiny_random_model
from oscar_calib.power_search import (
    apply_clip_powers,
    layer_blocks,
    mean_kl,
    search_clip_powers,
)
from oscar_calib.schemes import SchemeContext, build_scheme
from oscar_calib.simulate import Windows
from oscar_calib.text import builtin_text, split_text, token_chunks
from oscar_math.artifact import load_rotations, save_rotations
from oscar_math.errors import OscarError

SMALL = dict(tokens=512, seq_len=128, sink=8, recent=16, max_samples=256, search_context=96, search_seqs=1)


@pytest.fixture(scope="module")
def llama():
    return tiny_random_model("llama", num_hidden_layers=3)


@pytest.fixture(scope="module")
def searched(llama):
    """Rotations with the searched ratios (powers 1) of the tiny model."""
    model, tok = llama
    config = CalibrationConfig(**SMALL, clip_power=1.0, value_clip_power=1.0)
    chunks, _ = calibration_chunks(tok, config)
    stats = collect_statistics(
        model, chunks, sink=config.sink, max_samples=config.max_samples, progress=False
    )
    return rotations_from_statistics(stats, config, model="tiny")


def test_layer_blocks_partition_contiguously():
    assert layer_blocks(30, 6) == [range(i, i + 5) for i in range(0, 30, 5)]
    blocks = layer_blocks(7, 3)
    assert [len(b) for b in blocks] == [3, 2, 2]
    assert [i for b in blocks for i in b] == list(range(7))
    assert layer_blocks(4, 4) == [range(i, i + 1) for i in range(4)]
    for bad in (0, 5, 2.0, True):
        with pytest.raises(OscarError, match="blocks"):
            layer_blocks(4, bad)


def test_apply_clip_powers_stores_searched_to_the_layer_power(searched):
    kp, vp = (0.5, 0.7, 1.0), (0.3, 1.0, 0.5)
    rot = apply_clip_powers(searched, kp, vp)
    for i in range(3):
        torch.testing.assert_close(rot.k_clip[i], searched.k_clip[i] ** kp[i])
        torch.testing.assert_close(rot.v_clip[i], searched.v_clip[i] ** vp[i])
    assert rot.calibration["clip_power_per_layer"] == {"k": list(kp), "v": list(vp)}
    assert "clip_power" not in rot.calibration and "value_clip_power" not in rot.calibration
    # rotations, mean and eigenvalues are untouched: same format, same bits
    for name in ("k_rotation", "v_rotation", "k_mean", "k_eigenvalues"):
        for a, b in zip(getattr(rot, name), getattr(searched, name), strict=True):
            assert torch.equal(a, b)
    with pytest.raises(OscarError, match="k_power"):
        apply_clip_powers(searched, (0.5, 0.7), vp)
    with pytest.raises(OscarError, match="v_power"):
        apply_clip_powers(searched, kp, (0.3, 0.0, 0.5))


def test_calclip_undoes_per_layer_powers_after_a_round_trip(searched, tmp_path):
    """oscar2-calclip serves the searched ratios again; the per-layer powers survive save/load."""
    rot = apply_clip_powers(searched, (0.5, 0.7, 1.0), (0.3, 1.0, 0.5))
    loaded = load_rotations(save_rotations(tmp_path / "a.safetensors", rot))
    assert loaded.calibration["clip_power_per_layer"] == rot.calibration["clip_power_per_layer"]
    ctx = SchemeContext(loaded.head_dim, 3, loaded.num_kv_heads, loaded)
    calclip, served = build_scheme("oscar2-calclip", ctx), build_scheme("oscar2", ctx)
    for i in range(3):
        torch.testing.assert_close(calclip.key_codec(i).clip, searched.k_clip[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(calclip.value_codec(i).clip, searched.v_clip[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(served.key_codec(i).clip, rot.k_clip[i])


def test_descent_finds_a_planted_per_block_optimum(searched, monkeypatch):
    """With a separable objective the coordinate descent lands on each block's best grid point."""
    target_k, target_v = [0.9, 0.5, 0.6], [1.0, 0.3, 0.7]

    def fake(model, rotations, refs, windows):
        per = rotations.calibration["clip_power_per_layer"]
        return 1.0 + sum((p - t) ** 2 for p, t in zip(per["k"] + per["v"], target_k + target_v, strict=True))

    monkeypatch.setattr(power_search, "mean_kl", fake)
    monkeypatch.setattr(power_search, "_references", lambda model, seqs: [None])
    seqs = [torch.zeros(64, dtype=torch.long)]
    res = search_clip_powers(None, searched, seqs, windows=Windows(8, 16), blocks=3)
    assert res.k_power == tuple(target_k) and res.v_power == tuple(target_v)
    assert res.kl_chosen == pytest.approx(1.0) and res.kl_start > res.kl_chosen
    assert res.complete and res.evaluations == 1 + 3 * 5 + 3 * 3
    # two blocks: layers 0-1 share a power, the best shared one for the planted targets
    res2 = search_clip_powers(None, searched, seqs, windows=Windows(8, 16), blocks=2)
    assert res2.k_power[0] == res2.k_power[1] == 0.7 and res2.k_power[2] == 0.6
    # a deadline already passed: only the start is evaluated, nothing moves
    res3 = search_clip_powers(None, searched, seqs, windows=Windows(8, 16), blocks=3, deadline_s=0.0)
    assert not res3.complete and res3.evaluations == 1
    assert res3.k_power == (0.7,) * 3 and res3.v_power == (0.5,) * 3


def test_search_on_a_model_never_ends_worse_and_reports_its_objective(llama, searched):
    model, tok = llama
    _, held = split_text(builtin_text())
    seqs = token_chunks(tok, held, 96, 96, 3)
    windows = Windows(8, 16)
    res = search_clip_powers(
        model, searched, seqs, windows=windows, blocks=3, k_grid=(0.5, 1.0), v_grid=(0.5, 1.0)
    )
    assert res.kl_chosen <= res.kl_start
    assert set(res.k_power) <= {0.5, 0.7, 1.0} and set(res.v_power) <= {0.5, 1.0}
    refs = power_search._references(model, seqs)
    chosen = apply_clip_powers(searched, res.k_power, res.v_power)
    assert mean_kl(model, chosen, refs, windows) == pytest.approx(res.kl_chosen, rel=1e-6)
    start = apply_clip_powers(searched, (0.7,) * 3, (0.5,) * 3)
    assert mean_kl(model, start, refs, windows) == pytest.approx(res.kl_start, rel=1e-6)
    with pytest.raises(OscarError, match="seqs"):
        search_clip_powers(model, searched, [seqs[0][:20]], windows=windows)
    with pytest.raises(OscarError, match="k_grid"):
        search_clip_powers(model, searched, seqs, windows=windows, k_grid=(0.5, 1.5))


def test_kl_objective_serves_the_artifacts_error_feedback_codes(llama, searched):
    """The KL search scores the oscar2 cache as served: with the artifact's k_feedback codes
    (calibrate computes them before the search), which score differently from plain rounding."""
    model, tok = llama
    assert searched.k_feedback is not None  # the default: error-feedback key codes
    _, held = split_text(builtin_text())
    seqs = token_chunks(tok, held, 96, 96, 3)
    windows = Windows(8, 16)
    refs = power_search._references(model, seqs)
    start = apply_clip_powers(searched, (0.7,) * 3, (0.5,) * 3)
    fb = mean_kl(model, start, refs, windows)
    plain = mean_kl(model, dataclasses.replace(start, k_feedback=None), refs, windows)
    assert abs(fb - plain) > 1e-3 * fb
    res = search_clip_powers(model, searched, seqs, windows=windows, blocks=1, k_grid=(0.7,), v_grid=(0.5,))
    assert res.kl_start == pytest.approx(fb, rel=1e-6) and res.evaluations == 1


def test_calibrate_kl_stores_the_powers_it_chose(llama, searched):
    model, tok = llama
    config = CalibrationConfig(**SMALL, clip_search="kl", power_blocks=2)
    rot = calibrate(model, tok, config, model_name="tiny", progress=False)
    per = rot.calibration["clip_power_per_layer"]
    assert len(per["k"]) == len(per["v"]) == 3 and per["k"][0] == per["k"][1]
    search = rot.calibration["clip_search"]
    assert search["blocks"] == 2 and search["kl_chosen"] <= search["kl_start"]
    assert search["evaluations"] == 1 + 2 * 5 + 2 * 3
    for i in range(3):  # same statistics and seed as the fixture: stored = searched ** p_layer
        torch.testing.assert_close(rot.k_clip[i], searched.k_clip[i] ** per["k"][i])
        torch.testing.assert_close(rot.v_clip[i], searched.v_clip[i] ** per["v"][i])
    row = calibrate(model, tok, dataclasses.replace(config, clip_search="row"), progress=False)
    assert "clip_power_per_layer" not in row.calibration
    with pytest.raises(OscarError, match="power_blocks"):
        CalibrationConfig(power_blocks=0)
