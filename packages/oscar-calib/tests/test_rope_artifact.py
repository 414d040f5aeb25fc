"""Format version 3 served in emulation: the ``oscar2`` scheme of an artifact with a pre-RoPE
key mean applies the contract of :mod:`oscar_math.rope_center` to INT2 rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_cache import HEAD_DIM, KV_HEADS, LAYERS, ROPE_PAIRS, fake_rotations

from oscar_calib.schemes import RowCodec, SchemeContext, build_scheme
from oscar_math import dequantize_int2, quantize_int2
from oscar_math.feedback import quantize_int2_feedback
from oscar_math.rope_center import rope_rotate


def _ctx(rot):
    return SchemeContext(HEAD_DIM, LAYERS, KV_HEADS, rotations=rot)


def _with_feedback(rot, seed=3):
    g = torch.Generator().manual_seed(seed)
    fb = [torch.tril(0.3 * torch.randn(KV_HEADS, HEAD_DIM, HEAD_DIM, generator=g), -1) for _ in range(LAYERS)]
    return dataclasses.replace(rot, k_feedback=fb)


def by_hand(rot, layer, k, positions):
    """``Q((k − k_mean − RoPE_p(m)) @ R_K)``, dequantised ``+ RoPE_p(m) @ R_K``, back in the
    original basis (``@ R_Kᵀ + k_mean``) — the contract written out, float64 except Q."""
    r = rot.k_rotation[layer].double()  # [H, d, d]
    mean = rot.k_mean[layer].double()
    m = rot.k_rope_mean[layer].double()
    rm = rope_rotate(m[None].expand(k.shape[0], -1, -1), positions, rot.rope_inv_freq.double())  # [T, H, d]
    y = torch.einsum("thd,hde->the", k.double() - mean - rm, r).float()
    clip = rot.k_clip[layer].reshape(KV_HEADS, 1)
    if rot.k_feedback is not None:
        q = quantize_int2_feedback(y, rot.group_size, rot.k_feedback[layer], clip)
    else:
        q = quantize_int2(y, rot.group_size, clip)
    deq = dequantize_int2(q).double() + torch.einsum("thd,hde->the", rm, r)
    return q, torch.einsum("the,hde->thd", deq, r) + mean


@pytest.mark.parametrize("feedback", [False, True])
@pytest.mark.parametrize("offset", [0, 37, 5000])
def test_emulation_applies_the_contract(feedback, offset):
    rot = fake_rotations(rope=True)
    rot = _with_feedback(rot) if feedback else rot
    assert rot.format_version == "3"
    sch = build_scheme("oscar2", _ctx(rot))
    k = 0.5 * torch.randn(64, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(offset, offset + 64)
    for layer in range(LAYERS):
        q_ref, k_ref = by_hand(rot, layer, k, pos)
        codec = sch.key_codec(layer)
        q = codec.encode(k, pos)
        # identical codes and scales (the centering in float32 lands on the same grid here)
        assert torch.equal(q.codes, q_ref.codes)
        assert torch.equal(q.scale, q_ref.scale) and torch.equal(q.zero, q_ref.zero)
        got = sch.fake_quantize_keys_at(layer, k, pos)
        torch.testing.assert_close(got.double(), k_ref, atol=1e-5, rtol=0)
        if offset == 0:  # positions default to the row's index in the sequence
            torch.testing.assert_close(sch.fake_quantize_keys(layer, k), got, rtol=0, atol=0)


def test_only_keys_and_only_int2_rows_change():
    """Values and BF16 rows do not see the mean: the value codec has none, and a codec's
    rotated space of a v3 artifact differs from v2's by ``RoPE_p(m) @ R_K`` exactly."""
    rot3 = fake_rotations(rope=True)
    rot2 = dataclasses.replace(rot3, k_rope_mean=None, rope_inv_freq=None)
    s3, s2 = build_scheme("oscar2", _ctx(rot3)), build_scheme("oscar2", _ctx(rot2))
    v = torch.randn(20, KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(s3.fake_quantize_values(0, v), s2.fake_quantize_values(0, v), rtol=0, atol=0)
    assert s3.value_codec(0).rope_mean is None
    pos = torch.arange(20)
    diff = s3.key_codec(0).to_rotated(v, pos) - s2.key_codec(0).to_rotated(v, pos)
    rm = rope_rotate(rot3.k_rope_mean[0].double()[None].expand(20, -1, -1), pos, rot3.rope_inv_freq.double())
    torch.testing.assert_close(
        diff.double(), -torch.einsum("thd,hde->the", rm, rot3.k_rotation[0].double()), atol=1e-5, rtol=0
    )
    # pairs outside the selected ones are exactly zero in the mean
    m = rot3.k_rope_mean[0]
    off = [i for i in range(HEAD_DIM // 2) if i not in ROPE_PAIRS]
    assert not m[:, off].any() and not m[:, [i + HEAD_DIM // 2 for i in off]].any()


@pytest.mark.parametrize(
    "name", ["oscar2", "oscar2-nofeedback", "oscar2-noclip", "oscar2-nocenter", "oscar2-norot"]
)
def test_v2_artifacts_unchanged_bit_for_bit(name):
    """Without a pre-RoPE mean every codec is the pre-format-3 one: the same tensors in, the
    same rows out, to the bit (the hand-built codec has no rope fields at all)."""
    rot = _with_feedback(fake_rotations())
    assert rot.format_version == "2"
    sch = build_scheme(name, _ctx(rot))
    k = torch.randn(30, KV_HEADS, HEAD_DIM).to(torch.bfloat16)
    for layer in range(LAYERS):
        c = sch.key_codec(layer)
        assert c.rope_mean is None and c.rope_inv_freq is None
        plain = RowCodec(c.group_size, rotation=c.rotation, mean=c.mean, clip=c.clip, feedback=c.feedback)
        assert torch.equal(sch.fake_quantize_keys(layer, k), plain.fake_quantize(k))
        assert torch.equal(sch.fake_quantize_keys_at(layer, k, torch.arange(5, 35)), plain.fake_quantize(k))


def test_nocenter_drops_the_rope_mean_and_hadamard_center_keeps_it():
    rot = fake_rotations(rope=True)
    assert build_scheme("oscar2-nocenter", _ctx(rot)).key_codec(0).rope_mean is None
    assert build_scheme("oscar2-norot", _ctx(rot)).key_codec(0).rope_mean is not None
    assert build_scheme("hadamard2-center", _ctx(rot)).key_codec(0).rope_mean is not None


def test_codec_needs_both_rope_fields():
    from oscar_math import OscarError

    with pytest.raises(OscarError, match="rope_mean / rope_inv_freq"):
        RowCodec(16, rope_mean=torch.zeros(1, 16))


def test_kernel_params_read_the_artifact_names():
    """``LayerQuantParams.from_rotations`` (oscar-kernels) finds the v3 fields by name."""
    params = pytest.importorskip("oscar_kernels.params")
    rot = fake_rotations(rope=True)
    lp = params.LayerQuantParams.from_rotations(rot, 1)
    assert torch.equal(lp.k_rope_mean, rot.k_rope_mean[1]) and torch.equal(
        lp.k_rope_inv_freq, rot.rope_inv_freq
    )
    ex = lp.expand(KV_HEADS, HEAD_DIM, torch.device("cpu"))
    assert ex.rope_pairs == 4 and sorted(ex.k_rope_pairs.tolist()[:3]) == list(ROPE_PAIRS)


def test_run_eval_serves_a_version_3_file(tmp_path):
    """``oscar eval``'s harness on a saved v3 file: same bits as v2, other (finite) scores."""
    import json

    from oscar_calib.evaluate import EvalConfig, run_eval
    from oscar_calib.models import tiny_random_model
    from oscar_math.artifact import identity_rotations, load_rotations, save_rotations

    model, tok = tiny_random_model("llama", seed=1)
    v2 = identity_rotations("tiny", 2, 2, 32, k_clip=0.9, granularity="kv_head")
    m = torch.zeros(2, 32)
    m[:, [3, 9, 19, 25]] = 1.5  # pairs 3 and 9
    v3 = dataclasses.replace(v2, k_rope_mean=[m, -m], rope_inv_freq=10000.0 ** (-torch.arange(0, 32, 2) / 32))
    v3 = load_rotations(save_rotations(tmp_path / "v3.safetensors", v3))
    assert v3.format_version == "3"
    text = " ".join(f"Paragraph {i}: the quick brown fox {i * 7 % 13} jumps." for i in range(400))
    cfg = EvalConfig(contexts=(160,), schemes=("bf16", "oscar2"), num_sequences=2, sink=4, recent=16)
    out = {}
    for name, rot in (("v2", v2), ("v3", v3)):
        res = run_eval(model, tok, rot, cfg, progress=False, model_name="tiny", heldout_text=text)
        out[name] = json.loads(res.to_json())["contexts"]["160"]["oscar2"]
    assert out["v2"]["bits_per_element"] == out["v3"]["bits_per_element"]
    assert out["v3"]["kl"]["mean"] > 0 and out["v2"]["kl"]["mean"] != out["v3"]["kl"]["mean"]
