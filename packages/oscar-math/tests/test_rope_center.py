"""The pre-RoPE centering primitives (format version 3): the score term equals q·RoPE_p(m)."""

from __future__ import annotations

import pytest
import torch

from oscar_math import OscarError
from oscar_math.rope_center import (
    compact_rope_mean,
    rope_position_mean,
    rope_rotate,
    rope_score_coef,
    rope_score_correction,
)


def _inv_freq(d: int, base: float = 10000.0) -> torch.Tensor:
    # float32, as the artifact stores it and the kernels read it
    return (1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).float()


def _sparse_mean(h: int, d: int, pairs: list[int], gen: torch.Generator) -> torch.Tensor:
    m = torch.zeros(h, d)
    for i in pairs:
        m[:, i] = torch.randn(h, generator=gen)
        m[:, i + d // 2] = torch.randn(h, generator=gen)
    return m


def test_rope_rotate_is_a_rotation_per_pair_and_inverts():
    gen = torch.Generator().manual_seed(0)
    d = 16
    x = torch.randn(7, 3, d, generator=gen, dtype=torch.float64)
    pos = torch.tensor([0, 1, 5, 17, 300, 4096, 131071])
    f = _inv_freq(d)
    y = rope_rotate(x, pos, f)
    # pair norms are preserved, position 0 is the identity, -p undoes p
    h = d // 2
    torch.testing.assert_close(x[..., :h] ** 2 + x[..., h:] ** 2, y[..., :h] ** 2 + y[..., h:] ** 2)
    torch.testing.assert_close(y[0], x[0])
    torch.testing.assert_close(rope_rotate(y, -pos, f), x)
    # pair 0 at position 1 turns by exactly θ_0 = 1 rad: (a, b) -> (a cos1 - b sin1, b cos1 + a sin1)
    a, b = x[1, :, 0], x[1, :, h]
    one = torch.tensor(1.0, dtype=torch.float64)
    c, s = torch.cos(one), torch.sin(one)
    torch.testing.assert_close(y[1, :, 0], a * c - b * s)
    torch.testing.assert_close(y[1, :, h], b * c + a * s)


@pytest.mark.parametrize("pairs,expect_r", [([3], 1), ([1, 6], 2), ([0, 2, 5], 4), (list(range(8)), 8)])
def test_score_term_equals_q_dot_rope_of_the_mean(pairs, expect_r):
    gen = torch.Generator().manual_seed(len(pairs))
    hkv, g, d = 2, 3, 16
    m = _sparse_mean(hkv, d, pairs, gen)
    f = _inv_freq(d)
    ab, theta, idx = compact_rope_mean(m, f)
    assert ab.shape == (hkv, 2, expect_r) and theta.shape == (expect_r,) and idx.shape == (expect_r,)
    q = torch.randn(4, hkv * g, d, generator=gen)
    pos = torch.tensor([0, 3, 64, 511, 2047, 8191, 100000])
    coef = rope_score_coef(q, ab, idx)  # [4, H_q, 2, R]
    got = rope_score_correction(coef, theta, pos)  # [4, H_q, N]
    mu = rope_position_mean(m, pos, f)  # [N, H_kv, d]
    mu_q = mu.repeat_interleave(g, 1).double()  # [N, H_q, d]
    want = torch.einsum("bhd,nhd->bhn", q.double(), mu_q).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compact_form_of_a_zero_mean_adds_nothing():
    m = torch.zeros(2, 8)
    ab, theta, idx = compact_rope_mean(m, _inv_freq(8))
    assert ab.shape == (2, 2, 1) and float(ab.abs().sum()) == 0.0 and float(theta.abs().sum()) == 0.0
    coef = rope_score_coef(torch.randn(3, 4, 8), ab, idx)
    assert float(rope_score_correction(coef, theta, torch.arange(5)).abs().max()) == 0.0


def test_bad_shapes_are_refused():
    with pytest.raises(OscarError, match="inv_freq"):
        compact_rope_mean(torch.zeros(2, 8), torch.ones(3))
    with pytest.raises(OscarError, match="positions"):
        rope_rotate(torch.zeros(4, 1, 8), torch.arange(3), _inv_freq(8))
