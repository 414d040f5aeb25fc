"""Built-in KV schemes: registration, fake quantisation in the original basis, bits."""

from __future__ import annotations

import pytest
import torch

from oscar_calib.schemes import (
    DEFAULT_SCHEMES,
    RowCodec,
    SchemeContext,
    build_scheme,
    remove_bit_reversal,
    scheme_names,
)
from oscar_math import OscarError, fake_quantize_int2
from oscar_math.artifact import Rotations
from oscar_math.bits import bits_per_element, kivi_bits_per_element
from oscar_math.hadamard import random_sign_hadamard
from oscar_math.rotation import compose_rotation

L, H, D = 3, 2, 16


def _orth(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(n, D, D, generator=g, dtype=torch.float64))[0]


def rotations(group_size: int = D, seed: int = 0) -> Rotations:
    g = torch.Generator().manual_seed(seed)
    us = [_orth(g, H) for _ in range(L)]
    rot = [compose_rotation(u, group_size) for u in us]
    return Rotations(
        model="tiny",
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        group_size=group_size,
        sink_tokens=4,
        recent_tokens=8,
        granularity="kv_head",
        k_rotation=rot,
        v_rotation=[compose_rotation(_orth(g, H), group_size) for _ in range(L)],
        k_eigenvalues=[torch.ones(H, D)] * L,
        v_eigenvalues=[torch.ones(H, D)] * L,
        k_clip=[torch.tensor([0.9, 0.8])] * L,
        v_clip=[torch.tensor([0.95, 1.0])] * L,
        k_mean=[torch.randn(H, D, generator=g) for _ in range(L)],
        calibration={"us": [u.tolist() for u in us], "clip_power": 0.5},
    )


def ctx(rot=None, **kw) -> SchemeContext:
    return SchemeContext(D, L, H, rotations=rot, **kw)


def x(seed=0, t=13) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, H, D, generator=g) * torch.linspace(0.2, 3, D) + 0.5


def test_builtins_are_registered_through_the_hook():
    names = scheme_names()
    for n in DEFAULT_SCHEMES + ("oscar2-nobitrev", "hadamard2-center"):
        assert n in names
    from oscar_math.plugins import available_schemes

    assert "oscar2" in available_schemes()


def test_unknown_and_uncalibrated_are_errors():
    with pytest.raises(OscarError, match="scheme"):
        build_scheme("int3", ctx())
    with pytest.raises(OscarError, match="rotations"):
        build_scheme("oscar2", ctx())


def test_bf16_is_identity_and_16_bits():
    s = build_scheme("bf16", ctx())
    k = x()
    assert s.fake_quantize_keys(0, k) is k and not s.quantized
    assert s.bits_per_element(2048, D, 64, 256) == 16


def test_int2_and_hadamard_match_the_reference_quantiser():
    k = x(1)
    int2 = build_scheme("int2", ctx())
    torch.testing.assert_close(int2.fake_quantize_keys(2, k), fake_quantize_int2(k, D))
    had = build_scheme("hadamard2", ctx(seed=5))
    r = random_sign_hadamard(D, 5).float()
    torch.testing.assert_close(
        had.fake_quantize_values(0, k), fake_quantize_int2(k @ r, D) @ r.T, atol=1e-5, rtol=1e-5
    )
    assert int2.bits_per_element(2048, D, 64, 256) == bits_per_element(2048, D, group_size=D)


def test_oscar2_centres_rotates_and_clips_per_head():
    rot = rotations()
    s = build_scheme("oscar2", ctx(rot))
    k = x(2)
    lay = rot.for_layer(1)
    # oscar2 serves the stored (tempered) ratios; calclip undoes the artifact's clip_power 0.5
    for name, power in (("oscar2", 1.0), ("oscar2-calclip", 2.0)):
        sch = build_scheme(name, ctx(rot))
        for h in range(H):
            y = (k[:, h] - lay.k_mean[h]) @ lay.k_rotation[h]
            alpha = float(lay.k_clip[h]) ** power
            ref = fake_quantize_int2(y, D, alpha) @ lay.k_rotation[h].T + lay.k_mean[h]
            torch.testing.assert_close(sch.fake_quantize_keys(1, k)[:, h], ref, atol=1e-5, rtol=1e-5)
    # ablations differ from the full scheme and from each other
    outs = {
        n: build_scheme(n, ctx(rot)).fake_quantize_keys(1, k)
        for n in ("oscar2", "oscar2-calclip", "oscar2-noclip", "oscar2-nocenter", "oscar2-norot")
    }
    for a in outs:
        for b in outs:
            if a < b:
                assert not torch.allclose(outs[a], outs[b])
    # the key mean is added back: a row equal to the mean is reproduced (up to the bf16 zero point)
    torch.testing.assert_close(
        s.fake_quantize_keys(1, lay.k_mean[None].expand(2, H, D)),
        lay.k_mean[None].expand(2, H, D),
        atol=1e-6,
        rtol=0,
    )


def test_values_are_not_centred_and_shapes_kept():
    rot = rotations()
    s = build_scheme("oscar2", ctx(rot))
    v = x(3, t=5)
    out = s.fake_quantize_values(0, v.double())
    assert out.dtype == torch.float64 and out.shape == v.shape
    assert s.value_codec(0).mean is None and s.key_codec(0).mean is not None


def test_remove_bit_reversal_recovers_plain_composition():
    rot = rotations(group_size=4)
    us = [torch.tensor(u, dtype=torch.float64) for u in rot.calibration["us"]]
    got = remove_bit_reversal(rot.k_rotation[0], 4)
    want = compose_rotation(us[0], 4, bit_reversal=False).float()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    s = build_scheme("oscar2-nobitrev", ctx(rot))
    assert not torch.allclose(
        s.fake_quantize_keys(0, x()), build_scheme("oscar2", ctx(rot)).fake_quantize_keys(0, x())
    )


def test_kivi_bits_and_shapes():
    s = build_scheme("kivi2", ctx())
    k = x(4, t=70)
    assert s.fake_quantize_keys(0, k).shape == k.shape
    assert s.bits_per_element(4096, D, 64, 256) == kivi_bits_per_element(
        4096, D, sink_tokens=64, recent_tokens=256
    )


def test_codec_broadcasts_layer_granularity():
    r = random_sign_hadamard(D, 1).float()[None]
    c = RowCodec(8, rotation=r, clip=torch.tensor([0.9]))
    k = x(6)
    per_head = torch.stack([fake_quantize_int2(k[:, h] @ r[0], 8, 0.9) @ r[0].T for h in range(H)], 1)
    torch.testing.assert_close(c.fake_quantize(k), per_head, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c.decode(c.encode(k), torch.float32), c.fake_quantize(k))


def test_calclip_undoes_key_and_value_powers_separately():
    """An artifact with value_clip_power != clip_power: calclip raises each kind to its own inverse."""
    import dataclasses

    base = rotations()
    rot = dataclasses.replace(
        base, calibration={**base.calibration, "clip_power": 0.7, "value_clip_power": 0.5}
    )
    k, v = x(3), x(4)
    lay = rot.for_layer(0)
    sch = build_scheme("oscar2-calclip", ctx(rot))
    for h in range(H):
        yk = (k[:, h] - lay.k_mean[h]) @ lay.k_rotation[h]
        ak = float(lay.k_clip[h]) ** (1 / 0.7)
        ref_k = fake_quantize_int2(yk, D, ak) @ lay.k_rotation[h].T + lay.k_mean[h]
        torch.testing.assert_close(sch.fake_quantize_keys(0, k)[:, h], ref_k, atol=1e-5, rtol=1e-5)
        yv = v[:, h] @ lay.v_rotation[h]
        av = float(lay.v_clip[h]) ** (1 / 0.5)
        ref_v = fake_quantize_int2(yv, D, av) @ lay.v_rotation[h].T
        torch.testing.assert_close(sch.fake_quantize_values(0, v)[:, h], ref_v, atol=1e-5, rtol=1e-5)
