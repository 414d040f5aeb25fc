import pytest
import torch

from oscar_math import OscarError, fake_quantize_int2
from oscar_math.clipping import (
    DEFAULT_CLIP_GRID,
    center_keys,
    clip_error,
    key_metric,
    quantile_clip_fake_quantize,
    quantization_error,
    rotate_samples,
    search_clip_ratio,
)


def _heavy(n, g, d, df, gen, outlier_channels=4):
    """Student-t rows with a few large channels, then a random orthogonal rotation per head."""
    t = torch.distributions.StudentT(torch.tensor(df)).sample((n, g, d))
    scale = torch.ones(d)
    scale[:outlier_channels] = 8.0
    q = torch.linalg.qr(torch.randn(g, d, d, generator=gen))[0]
    return torch.einsum("ngd,gde->nge", t * scale, q)


def _psd(g, d, gen):
    a = torch.randn(g, d, d, generator=gen) * torch.logspace(0, -2, d)
    return a @ a.transpose(1, 2) / d


@pytest.mark.parametrize("group_size", [64, 16])
def test_calibrated_key_ratios_beat_no_clip_and_quantile_on_held_out(group_size):
    gen = torch.Generator().manual_seed(11)
    n, g, d = 2048, 2, 64
    torch.manual_seed(1)
    cal = _heavy(n, g, d, 3.0, torch.Generator().manual_seed(5))
    torch.manual_seed(2)  # fresh samples, same rotation and channel scales
    held = _heavy(n, g, d, 3.0, torch.Generator().manual_seed(5))
    assert not torch.equal(cal, held)
    metric = _psd(g, d, gen)
    res = search_clip_ratio(cal, group_size, metric=metric)
    assert res.ratios.shape == (g,) and res.ratios.dtype == torch.float32
    assert ((res.ratios > 0) & (res.ratios <= 1)).all()
    calibrated = clip_error(held, group_size, res.ratios, metric=metric)
    unclipped = clip_error(held, group_size, 1.0, metric=metric)
    baseline = quantization_error(held, quantile_clip_fake_quantize(held, group_size, 0.96), metric=metric)
    assert (calibrated < 0.9 * unclipped).all(), (calibrated, unclipped)
    assert (calibrated < baseline).all(), (calibrated, baseline)


def test_calibrated_value_ratios_beat_no_clip_and_quantile_on_held_out():
    torch.manual_seed(3)
    n, g, d, gs = 2048, 2, 64, 32
    cal = _heavy(n, g, d, 2.5, torch.Generator().manual_seed(7))
    w_cal = torch.distributions.Exponential(1.0).sample((n, g)) ** 2
    torch.manual_seed(4)
    held = _heavy(n, g, d, 2.5, torch.Generator().manual_seed(7))
    w_held = torch.distributions.Exponential(1.0).sample((n, g)) ** 2
    res = search_clip_ratio(cal, gs, weights=w_cal)
    calibrated = clip_error(held, gs, res.ratios, weights=w_held)
    unclipped = clip_error(held, gs, 1.0, weights=w_held)
    baseline = quantization_error(held, quantile_clip_fake_quantize(held, gs, 0.92), weights=w_held)
    assert (calibrated < 0.9 * unclipped).all()
    assert (calibrated < baseline).all()


def test_never_worse_than_unclipped_on_calibration_data():
    torch.manual_seed(5)
    x = torch.randn(300, 3, 32)
    x[:, 1] *= torch.linspace(0.1, 3, 32)
    res = search_clip_ratio(x, 32)
    assert (res.error <= res.error_unclipped).all()
    assert res.errors.shape == (len(res.grid), 3)
    assert res.grid[-1] == 1.0 and torch.equal(res.error_unclipped, res.errors[-1])
    # the grid contains DEFAULT_CLIP_GRID and the refined error is the true error at the ratio
    assert len(res.grid) == len(DEFAULT_CLIP_GRID)
    torch.testing.assert_close(res.error, clip_error(x, 32, res.ratios))
    assert (res.error <= res.errors.min(0).values + 1e-12).all()


def test_per_head_search_returns_different_ratios_for_different_heads():
    torch.manual_seed(6)
    n, d = 2048, 64
    flat = torch.rand(n, 1, d) * 2 - 1  # uniform rows, no tails
    heavy = torch.distributions.StudentT(torch.tensor(3.0)).sample((n, 1, d))
    x = torch.cat([flat, heavy], dim=1)
    res = search_clip_ratio(x, d)
    per_head = [search_clip_ratio(x[:, i : i + 1], d).ratios[0] for i in range(2)]
    torch.testing.assert_close(res.ratios, torch.stack(per_head))
    # uniform rows: optimum near 0.75 (levels at ±0.25, ±0.75 of the range); heavy tails clip more
    assert float(res.ratios[0] - res.ratios[1]) > 0.1, res.ratios


def test_clip_error_matches_reference_quantiser():
    torch.manual_seed(7)
    x = torch.randn(50, 2, 64) * 3
    alpha = torch.tensor([0.7, 0.93])
    metric = _psd(2, 64, torch.Generator().manual_seed(0))
    w = torch.rand(50, 2)
    ref = quantization_error(x, fake_quantize_int2(x, 32, alpha.view(2, 1)), metric=metric, weights=w)
    torch.testing.assert_close(clip_error(x, 32, alpha, metric=metric, weights=w), ref)
    # brute force of the definition for one head
    e = x[:, 1] - fake_quantize_int2(x[:, 1], 32, 0.93)
    brute = torch.stack([w[i, 1] * e[i] @ metric[1] @ e[i] for i in range(50)]).mean()
    torch.testing.assert_close(ref[1].float(), brute.float(), rtol=1e-4, atol=1e-5)


def test_quantile_clip_clamps_top_magnitudes():
    x = torch.arange(1.0, 101.0).reshape(1, 100)  # |x| = 1..100
    y = quantile_clip_fake_quantize(x, 100, 0.96)
    # clamped to the 96th smallest magnitude before min/max, so the range shrinks to [1, 96]
    assert float(y.max()) <= 96.5 and float(y.min()) >= 0.5


def test_center_keys_subtracts_mean_per_head():
    k = torch.randn(10, 3, 8)
    mu = torch.randn(3, 8)
    torch.testing.assert_close(center_keys(k, mu), k - mu)
    assert center_keys(k, None) is k
    with pytest.raises(OscarError, match="k_mean.shape"):
        center_keys(k, torch.randn(2, 8))


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda x: search_clip_ratio(x[:, 0], 32), "x.shape"),
        (lambda x: search_clip_ratio(x, 24), "group_size"),
        (lambda x: search_clip_ratio(x, 32, metric=torch.eye(16)), "metric.shape"),
        (lambda x: search_clip_ratio(x, 32, weights=-torch.ones(5)), "weights"),
        (lambda x: search_clip_ratio(x, 32, grid=[0.0, 0.5]), "grid"),
        (lambda x: clip_error(x, 32, 1.5), "alpha"),
    ],
)
def test_bad_inputs_name_the_argument(call, name):
    with pytest.raises(OscarError, match=name):
        call(torch.randn(5, 2, 32))


def test_rotate_samples_and_key_metric_give_the_logit_error():
    torch.manual_seed(8)
    n, h, d = 64, 3, 16
    k = torch.randn(n, h, d) + 2.0
    mu = k.mean(0)  # [H, d]
    rot = torch.linalg.qr(torch.randn(h, d, d, dtype=torch.float64))[0]
    x = rotate_samples(k, rot, mu)
    torch.testing.assert_close(x[:, 1], ((k[:, 1] - mu[1]) @ rot[1].float()))
    # a shared per-layer rotation broadcasts over heads
    shared = rotate_samples(k, rot[:1])
    torch.testing.assert_close(shared[:, 2], k[:, 2] @ rot[0].float())
    # e_rot M e_rot equals the mean squared logit error over the queries
    q = torch.randn(500, h, d, dtype=torch.float64)
    c_q = torch.einsum("nhi,nhj->hij", q, q) / 500
    m = key_metric(c_q, rot)
    e_rot = x - fake_quantize_int2(x, 8)
    e = torch.einsum("nhj,hij->nhi", e_rot.double(), rot)  # back to the original basis
    logit_err = torch.einsum("qhd,nhd->qnh", q, e).pow(2).mean(0).mean(0)
    torch.testing.assert_close(
        quantization_error(x, x - e_rot, metric=m).float(), logit_err.float(), rtol=1e-4, atol=1e-6
    )


def test_value_weights_approximate_the_full_output_error():
    """Σ_n (Σ_t S_tn²) ‖e_n‖² (diagonal of SᵀS) vs the exact ‖S E‖² with a causal softmax."""
    torch.manual_seed(9)
    t, d = 384, 32
    q, k = torch.randn(t, d), torch.randn(t, d) * 1.5
    v = torch.distributions.StudentT(torch.tensor(3.0)).sample((t, d))
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    s = torch.softmax((q @ k.T / d**0.5).masked_fill(mask, float("-inf")), -1)
    w = (s**2).sum(0)  # [T]
    for alpha in (1.0, 0.7):
        e = v - fake_quantize_int2(v, 16, alpha)
        exact = float((s @ e).pow(2).sum()) / t
        approx = float(clip_error(v.unsqueeze(1), 16, alpha, weights=w))
        assert abs(approx / exact - 1) < 0.1, (alpha, approx, exact)
