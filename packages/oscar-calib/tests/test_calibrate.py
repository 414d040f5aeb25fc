"""calibrate(): config validation, artifact structure, determinism, and a real SmolLM2 run."""

from __future__ import annotations

import dataclasses
import platform

import pytest
import torch
from conftest import needs_smollm2

from oscar_calib.calibrate import CalibrationConfig, calibrate, rotations_from_statistics
from oscar_calib.capture import collect_statistics
from oscar_calib.models import tiny_random_model
from oscar_math import dequantize_int2
from oscar_math.artifact import load_rotations, save_rotations
from oscar_math.errors import OscarError
from oscar_math.rotation import is_orthogonal

SMALL = dict(tokens=512, seq_len=128, sink=8, recent=16, max_samples=256)


@pytest.fixture(scope="module")
def qwen3():
    return tiny_random_model("qwen3", num_hidden_layers=2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tokens=100, seq_len=128), "tokens"),
        (dict(seq_len=64, sink=64), "seq_len"),
        (dict(granularity="head"), "granularity"),
        (dict(group_size=2), "group_size"),
        (dict(seed=-1), "seed"),
        (dict(heldout_fraction=1.0), "heldout_fraction"),
        (dict(hadamard="half"), "hadamard"),
        (dict(clip="yes"), "clip"),
        (dict(clip_power=0.0), "clip_power"),
        (dict(value_clip_power=1.5), "value_clip_power"),
        (dict(key_clip_objective="mse"), "key_clip_objective"),
        (dict(tokens=True), "tokens"),
        (dict(feedback="q"), "feedback"),
        (dict(feedback_damp=0.0), "feedback_damp"),
        (dict(rope_pairs=-1), "rope_pairs"),
        (dict(rope_pairs="some"), "rope_pairs"),
        (dict(rope_pairs=True), "rope_pairs"),
        (dict(rope_pairs=4, key_centering=False), "rope_pairs"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(OscarError, match=f"Invalid {match}"):
        CalibrationConfig(**kwargs)


def test_group_size_checked_against_model(qwen3):
    model, tok = qwen3
    with pytest.raises(OscarError, match="group_size"):
        calibrate(model, tok, CalibrationConfig(group_size=48, **SMALL), progress=False)  # 48 ∤ 128


@pytest.mark.parametrize("granularity,groups", [("kv_head", 2), ("layer", 1)])
def test_artifact_structure(qwen3, tmp_path, granularity, groups):
    model, tok = qwen3
    config = CalibrationConfig(granularity=granularity, group_size=32, **SMALL)
    rot = calibrate(model, tok, config, model_name="tiny-qwen3", progress=False)
    assert (rot.num_layers, rot.num_kv_heads, rot.head_dim, rot.group_size) == (2, 2, 128, 32)
    assert rot.num_groups == groups and rot.model == "tiny-qwen3"
    assert (rot.sink_tokens, rot.recent_tokens) == (8, 16)
    for i in range(2):
        layer = rot.for_layer(i)
        assert layer.k_rotation.shape == (groups, 128, 128)
        assert is_orthogonal(layer.k_rotation.double(), atol=1e-5)
        assert is_orthogonal(layer.v_rotation.double(), atol=1e-5)
        assert bool((layer.k_eigenvalues[:, :-1] >= layer.k_eigenvalues[:, 1:]).all())  # sorted
        assert bool(((layer.k_clip > 0) & (layer.k_clip <= 1)).all())
        assert layer.k_mean is not None and layer.k_mean.shape == (groups, 128)
    cal = rot.calibration
    assert cal["tokens"] == 512 and cal["seq_len"] == 128 and cal["seed"] == 0
    assert cal["text"] == f"pydoc_data.topics (Python {platform.python_version()})" and cal["tool_version"]
    path = save_rotations(tmp_path / "r.safetensors", rot)
    again = load_rotations(path, model="tiny-qwen3", num_layers=2, num_kv_heads=2, head_dim=128)
    assert torch.equal(again.k_rotation[1], rot.k_rotation[1])


def test_deterministic_for_a_seed(qwen3):
    model, tok = qwen3
    a = calibrate(model, tok, CalibrationConfig(seed=4, **SMALL), progress=False)
    b = calibrate(model, tok, CalibrationConfig(seed=4, **SMALL), progress=False)
    c = calibrate(model, tok, CalibrationConfig(seed=5, **SMALL), progress=False)
    for name, ta in a.tensors().items():
        assert torch.equal(ta, b.tensors()[name]), name
    assert a.calibration == b.calibration
    assert not torch.equal(a.k_rotation[0], c.k_rotation[0])


def test_options_centering_clipping_rotation(qwen3):
    model, tok = qwen3
    from oscar_calib.calibrate import calibration_chunks

    base = CalibrationConfig(**SMALL)
    chunks, _ = calibration_chunks(tok, base)
    stats = collect_statistics(model, chunks, sink=base.sink, max_samples=base.max_samples, progress=False)
    plain = rotations_from_statistics(
        stats, dataclasses.replace(base, key_centering=False, clip=False), model="m"
    )
    assert plain.k_mean is None
    assert all(bool((c == 1).all()) for c in (*plain.k_clip, *plain.v_clip))
    full = rotations_from_statistics(stats, dataclasses.replace(base, rope_pairs=0), model="m")
    # the key mean is the mean of the keys past the sink (format 2: no pre-RoPE mean)
    torch.testing.assert_close(full.k_mean[0], stats.key_mean[0].result("kv_head").float())
    # clipping: calibrated ratios never do worse than none on the calibration rows
    assert full.calibration["clip_error_ratio"]["k"] <= 1.0
    assert full.calibration["clip_error_ratio"]["v"] <= 1.0
    assert any(bool((c < 1).any()) for c in full.k_clip)
    # no Hadamard, no permutation: R_K is the eigenbasis of C_Q itself
    eig = rotations_from_statistics(
        stats, dataclasses.replace(base, hadamard="none", bit_reversal=False), model="m"
    )
    c_q = stats.query_cov[1].result("kv_head")
    R = eig.k_rotation[1].double()
    rotated = R.transpose(-1, -2) @ c_q @ R
    off = rotated - torch.diag_embed(torch.diagonal(rotated, dim1=-2, dim2=-1))
    assert float(off.abs().max()) < 1e-4 * float(c_q.abs().max())
    torch.testing.assert_close(torch.diagonal(rotated, dim1=-2, dim2=-1).float(), eig.k_eigenvalues[1])


@needs_smollm2
def test_smollm2_calibration(tmp_path):
    """Slow-ish (~15 s on 2 cores): a real llama model end to end."""
    from oscar_calib.models import load_model

    model, tok = load_model("smollm2")
    config = CalibrationConfig(tokens=1024, seq_len=512, max_samples=512, search_context=1024, search_seqs=1)
    rot = calibrate(model, tok, config, model_name="smollm2", progress=False)
    path = save_rotations(tmp_path / "smollm2.safetensors", rot)
    loaded = load_rotations(path, model="smollm2", num_layers=30, num_kv_heads=3, head_dim=64)
    assert loaded.granularity.value == "kv_head" and loaded.group_size == 64
    for i in (0, 15, 29):
        assert is_orthogonal(loaded.k_rotation[i].double(), atol=1e-5)
        assert is_orthogonal(loaded.v_rotation[i].double(), atol=1e-5)
    # real attention statistics are far from isotropic: a few directions dominate C_Q
    top_share = torch.stack([e[:, 0] / e.sum(-1) for e in loaded.k_eigenvalues])
    assert float(top_share.mean()) > 4 / 64
    assert loaded.calibration["tokens"] == 1024 and loaded.calibration["chunks"] == 2


def test_clip_tempering_stored_and_reported(qwen3):
    """The artifact stores searched ** clip_power, and clip_error_ratio is the error of what is stored."""
    from oscar_calib.calibrate import calibration_chunks
    from oscar_math.clipping import clip_error

    model, tok = qwen3
    base = CalibrationConfig(**SMALL, rope_pairs=0)  # format-2 keys (the rope path: test_rope_artifact_*)
    chunks, _ = calibration_chunks(tok, base)
    stats = collect_statistics(model, chunks, sink=base.sink, max_samples=base.max_samples, progress=False)
    raw = rotations_from_statistics(
        stats, dataclasses.replace(base, clip_power=1.0, value_clip_power=1.0), model="m"
    )
    tempered = rotations_from_statistics(
        stats, dataclasses.replace(base, clip_power=0.5, value_clip_power=0.25), model="m"
    )
    for a, b in zip(raw.k_clip, tempered.k_clip, strict=True):
        torch.testing.assert_close(b, a.sqrt())
    for a, b in zip(raw.v_clip, tempered.v_clip, strict=True):
        torch.testing.assert_close(b, a**0.25)
    assert tempered.calibration["value_clip_power"] == 0.25
    assert any(bool((c < 0.95).any()) for c in raw.k_clip)  # the test needs real clipping to bite
    assert tempered.calibration["clip_power"] == 0.5 and raw.calibration["clip_power"] == 1.0
    # the raw ratios minimise the searched error, so reporting them for a tempered artifact
    # would understate its error: the tempered report must be the larger one
    k_raw, k_tmp = raw.calibration["clip_error_ratio"]["k"], tempered.calibration["clip_error_ratio"]["k"]
    assert k_raw < k_tmp <= 1.0
    # and it is exactly the stored ratios' error over the unclipped error (keys, layer mean)
    ratios = []
    for i in range(raw.num_layers):
        keys = stats.samples[i].keys.double() - tempered.k_mean[i].double()
        x = torch.einsum("ngi,gij->ngj", keys, tempered.k_rotation[i].double()).float()
        R = tempered.k_rotation[i].double()
        metric = (R.transpose(-1, -2) @ stats.query_cov[i].result("kv_head").double() @ R).float()
        err = clip_error(x, raw.group_size, tempered.k_clip[i], metric=metric)
        ratios.append(float((err / clip_error(x, raw.group_size, 1.0, metric=metric)).mean()))
    assert k_tmp == pytest.approx(sum(ratios) / len(ratios), abs=2e-4)


def test_attention_key_objective_weighs_rows_by_received_attention(qwen3):
    from oscar_calib.calibrate import calibration_chunks
    from oscar_math.clipping import search_clip_ratio

    model, tok = qwen3
    base = CalibrationConfig(
        **SMALL, clip_power=1.0, rope_pairs=0
    )  # format-2 keys (the rope path: test_rope_artifact_*)
    chunks, _ = calibration_chunks(tok, base)
    stats = collect_statistics(model, chunks, sink=base.sink, max_samples=base.max_samples, progress=False)
    att = rotations_from_statistics(
        stats, dataclasses.replace(base, key_clip_objective="attention"), model="m"
    )
    logit = rotations_from_statistics(stats, base, model="m")
    i = 1
    keys = stats.samples[i].keys.double() - att.k_mean[i].double()
    R = att.k_rotation[i].double()
    x = torch.einsum("ngi,gij->ngj", keys, R).float()
    metric = (R.transpose(-1, -2) @ stats.query_cov[i].result("kv_head").double() @ R).float()
    w = stats.samples[i].key_weights.float()
    expected = search_clip_ratio(x, att.group_size, metric=metric, weights=w).ratios
    torch.testing.assert_close(att.k_clip[i], expected)
    unweighted = search_clip_ratio(x, att.group_size, metric=metric).ratios
    torch.testing.assert_close(logit.k_clip[i], unweighted)
    assert not torch.equal(expected, unweighted)  # the weights change the choice on these rows


def test_error_feedback_in_the_artifact(qwen3, tmp_path):
    """Key feedback by default: format version 2, ``F`` strictly lower triangular and derived
    from ``R_Kᵀ C_Q R_K``; the default key clip power follows the rounding; eval serves it."""
    from oscar_calib.calibrate import calibration_chunks
    from oscar_calib.schemes import SchemeContext, build_scheme
    from oscar_math.feedback import feedback_matrix

    model, tok = qwen3
    base = CalibrationConfig(**SMALL, rope_pairs=0)  # format-2 keys (the rope path: test_rope_artifact_*)
    assert base.feedback == "k" and base.clip_power == 0.5
    assert CalibrationConfig(feedback="none", **SMALL).clip_power == 0.7
    assert CalibrationConfig(feedback="none", clip_power=0.9, **SMALL).clip_power == 0.9
    chunks, _ = calibration_chunks(tok, base)
    stats = collect_statistics(model, chunks, sink=base.sink, max_samples=base.max_samples, progress=False)
    rot = rotations_from_statistics(stats, base, model="m")
    assert rot.format_version == "2" and rot.v_feedback is None
    assert rot.calibration["feedback"] == {"rows": "k", "damp": 0.01}
    c_q = stats.query_cov[1].result("kv_head").double()
    R = rot.k_rotation[1].double()
    want = feedback_matrix(R.transpose(-1, -2) @ c_q @ R)
    torch.testing.assert_close(rot.k_feedback[1], want, atol=1e-3, rtol=1e-3)
    kv = rotations_from_statistics(stats, dataclasses.replace(base, feedback="kv"), model="m")
    assert kv.v_feedback is not None and kv.v_feedback[0].shape == (2, 128, 128)
    none = rotations_from_statistics(stats, dataclasses.replace(base, feedback="none"), model="m")
    assert none.format_version == "1" and not none.has_feedback
    back = load_rotations(save_rotations(tmp_path / "fb.safetensors", rot))
    assert torch.equal(back.k_feedback[0], rot.k_feedback[0])
    # oscar2 writes feedback codes, oscar2-nofeedback plain ones (same clip, same scale/zero)
    ctx = SchemeContext(128, 2, 2, back)
    k = torch.randn(40, 2, 128, generator=torch.Generator().manual_seed(0))
    a = build_scheme("oscar2", ctx).key_codec(0).encode(k)
    b = build_scheme("oscar2-nofeedback", ctx).key_codec(0).encode(k)
    assert torch.equal(a.scale, b.scale) and not torch.equal(a.codes, b.codes)
    # and under the metric the feedback codes are better on these rows
    codec = build_scheme("oscar2", ctx).key_codec(0)
    y = codec.to_rotated(k)

    R0 = back.k_rotation[0].double()  # layer 0's metric
    m = R0.transpose(-1, -2) @ stats.query_cov[0].result("kv_head").double() @ R0

    def err(q):
        e = (y - dequantize_int2(q)).double()
        return float(torch.einsum("thi,hij,thj->", e, m, e))

    assert err(a) < err(b)


# ---- the pre-RoPE key mean (format version 3) -----------------------------------------------


def test_rope_pairs_default_and_resolution():
    from oscar_calib.calibrate import ROPE_PAIRS_DEFAULT

    assert CalibrationConfig().resolved_rope_pairs == ROPE_PAIRS_DEFAULT
    assert CalibrationConfig(key_centering=False).resolved_rope_pairs == 0
    assert CalibrationConfig(rope_pairs=8).resolved_rope_pairs == 8
    # replace() of a default config can turn centering off (the default follows it)
    assert dataclasses.replace(CalibrationConfig(), key_centering=False).resolved_rope_pairs == 0


@pytest.fixture(scope="module")
def llama_stats():
    model, tok = tiny_random_model("llama", num_hidden_layers=2)
    from oscar_calib.calibrate import calibration_chunks

    cfg = CalibrationConfig(**SMALL)
    chunks, _ = calibration_chunks(tok, cfg)
    stats = collect_statistics(model, chunks, sink=cfg.sink, max_samples=cfg.max_samples, progress=False)
    return model, tok, chunks, cfg, stats


def test_capture_prerope_mean_matches_the_independent_estimate(llama_stats):
    """collect_statistics' pre-RoPE mean (auto: the model's frequencies) equals
    ``rope_mean.prerope_key_means`` (rotates each key back in the attention hook of its own)."""
    from oscar_calib.rope_mean import prerope_key_means

    model, _, chunks, cfg, stats = llama_stats
    assert stats.prerope_mean is not None and stats.rope_inv_freq.shape == (16,)
    ref = prerope_key_means(model, chunks, sink=cfg.sink)
    for i in range(2):
        torch.testing.assert_close(
            stats.prerope_mean[i].result("kv_head").float(), ref[i], atol=1e-5, rtol=1e-4
        )
    # the sampled rows carry their positions (>= sink, < seq_len)
    pos = stats.samples[0].positions
    assert pos.shape[0] == stats.samples[0].keys.shape[0] and int(pos.min()) >= 8 and int(pos.max()) < 128


@pytest.mark.parametrize("granularity", ["kv_head", "layer"])
@pytest.mark.parametrize("pairs", [3, "all"])
def test_rope_artifact_statistics_are_of_the_served_residual(llama_stats, granularity, pairs):
    """With ``rope_pairs`` the artifact is format 3, ``m`` is the pre-RoPE mean on the chosen
    pairs (zero elsewhere), and the static ``k_mean`` is the mean of ``k − RoPE_p(m)`` over
    every calibration key past the sink (checked against a direct average of those keys)."""
    from oscar_calib.rope_mean import prerope_key_means
    from oscar_math.rope_center import rope_rotate

    model, _, chunks, cfg, stats = llama_stats
    cfg = dataclasses.replace(cfg, rope_pairs=pairs, granularity=granularity)
    rot = rotations_from_statistics(stats, cfg, model="m")
    assert rot.format_version == "3" and rot.rope_inv_freq.shape == (16,)
    meta = rot.calibration["rope_mean"]
    assert meta["rope_pairs"] == pairs and meta["positions"] == [8, 128]
    full = prerope_key_means(model, chunks, sink=cfg.sink)
    for i in range(2):
        m = rot.k_rope_mean[i]
        nz = ((m[:, :16] != 0) | (m[:, 16:] != 0)).any(0)
        assert int(nz.sum()) == (16 if pairs == "all" else 3)
        if pairs != "all":
            assert nz.nonzero().flatten().tolist() == meta["pairs_per_layer"][i]
        want = full[i] if granularity == "kv_head" else full[i].mean(0, keepdim=True)
        keep = torch.cat((nz, nz))
        torch.testing.assert_close(m[:, keep], want[:, keep], atol=1e-5, rtol=1e-4)
        # the residual mean by brute force: every key past the sink, minus RoPE_p(m)
        inv = rot.rope_inv_freq.double()
        total, n = 0, 0
        for chunk in chunks:
            with torch.no_grad():
                keys = _layer_keys(model, chunk, i)[cfg.sink :]  # [T, H, d]
            pos = torch.arange(cfg.sink, chunk.numel())
            mh = m.double().expand(keys.shape[1], -1)
            res = keys.double() - rope_rotate(mh[None].expand(len(pos), -1, -1), pos, inv)
            total, n = total + res.sum(0), n + res.shape[0]
        want_mean = total / n if granularity == "kv_head" else (total / n).mean(0, keepdim=True)
        torch.testing.assert_close(rot.k_mean[i].double(), want_mean, atol=1e-5, rtol=1e-4)


def _layer_keys(model, chunk, layer):
    """Keys after RoPE of one layer for one chunk (through the attention hook)."""
    from oscar_calib.attention import attention_override
    from oscar_calib.simulate import exact_attention

    got = {}

    def fn(ctx, query, key, value, attention_mask, scaling, **kw):
        if ctx.layer_idx == layer:
            got["k"] = key[0].transpose(0, 1).float()
        return exact_attention(query, key, value, scaling, attention_mask)

    with attention_override(model, fn):
        model.get_decoder()(input_ids=chunk[None], use_cache=False)
    return got["k"]


def test_select_rope_pairs_rule():
    """Scores ``Σ (E q_i² + E q_{i+h}²)|m_i|²(1 − |mean e^{ipθ}|²)``: a pair the static mean
    removes (θ ≈ 0) loses to a rotating one of the same energy; queries that never read a
    pair make it worthless; ties broken by energy."""
    from oscar_calib.calibrate import select_rope_pairs

    d, half = 8, 4
    inv = torch.tensor([1.0, 0.3, 1e-7, 0.05], dtype=torch.float64)
    m = torch.zeros(1, d)
    m[0, [0, 1, 2, 3]] = torch.tensor([1.0, 2.0, 5.0, 1.5])
    qe = torch.ones(1, d)
    assert select_rope_pairs(m, qe, inv, (0, 512), 2).tolist() == [1, 3]  # pair 2 static, pair 0 weak
    qe2 = qe.clone()
    qe2[0, [1, 1 + half]] = 0.0  # no query reads pair 1
    assert select_rope_pairs(m, qe2, inv, (0, 512), 2).tolist() == [0, 3]
    assert select_rope_pairs(m, qe, inv, (0, 512), "all").tolist() == [0, 1, 2, 3]
    assert select_rope_pairs(m, qe, inv, (0, 512), 99).tolist() == [0, 1, 2, 3]  # capped at d/2


def test_calibrate_writes_format_3_by_default_and_0_keeps_format_2(tmp_path):
    model, tok = tiny_random_model("llama", num_hidden_layers=2)
    rot = calibrate(model, tok, CalibrationConfig(**SMALL), progress=False)
    from oscar_calib.calibrate import ROPE_PAIRS_DEFAULT

    assert rot.format_version == "3" and rot.calibration["rope_mean"]["rope_pairs"] == ROPE_PAIRS_DEFAULT
    back = load_rotations(save_rotations(tmp_path / "r.safetensors", rot))
    assert torch.equal(back.k_rope_mean[1], rot.k_rope_mean[1])
    off = calibrate(model, tok, CalibrationConfig(rope_pairs=0, **SMALL), progress=False)
    assert off.format_version == "2" and off.k_rope_mean is None and "rope_mean" not in off.calibration


def test_scaled_rope_refused_when_asked_and_default_falls_back(capsys):
    model, tok = tiny_random_model("llama", num_hidden_layers=2)
    model.model.rotary_emb.rope_type = "dynamic"  # frequencies that change with the length at run time
    with pytest.raises(OscarError, match="Invalid rope_type"):
        calibrate(model, tok, CalibrationConfig(rope_pairs=4, **SMALL), progress=False)
    rot = calibrate(model, tok, CalibrationConfig(**SMALL), progress=False)
    assert rot.format_version == "2" and rot.k_rope_mean is None
    assert "no pre-RoPE key mean" in capsys.readouterr().err


def test_rope_key_clip_search_runs_on_the_served_rows(llama_stats):
    """The key clip ratios of a format-3 artifact are searched on ``(k − k_mean − RoPE_p(m)) @ R_K``
    of the sampled rows at their positions — what the INT2 writer quantises."""
    from oscar_math.clipping import search_clip_ratio
    from oscar_math.rope_center import rope_position_mean

    _, _, _, cfg, stats = llama_stats
    rot = rotations_from_statistics(stats, dataclasses.replace(cfg, clip_power=1.0, rope_pairs=5), model="m")
    flat = rotations_from_statistics(stats, dataclasses.replace(cfg, clip_power=1.0, rope_pairs=0), model="m")
    for i in range(2):
        smp = stats.samples[i]
        rm = rope_position_mean(rot.k_rope_mean[i], smp.positions, rot.rope_inv_freq)
        R = rot.k_rotation[i].double()
        x = torch.einsum("ngi,gij->ngj", smp.keys.double() - rot.k_mean[i].double() - rm.double(), R).float()
        metric = (R.transpose(-1, -2) @ stats.query_cov[i].result("kv_head").double() @ R).float()
        torch.testing.assert_close(rot.k_clip[i], search_clip_ratio(x, rot.group_size, metric=metric).ratios)
        assert torch.equal(rot.k_rotation[i], flat.k_rotation[i])  # rotations do not depend on the keys
        assert torch.equal(rot.k_feedback[i], flat.k_feedback[i])  # nor the feedback matrices
