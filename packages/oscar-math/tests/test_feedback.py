"""Error-feedback (LDLQ) rounding: exactness against plain rounding, the factorisation, the
error it saves under an anisotropic metric, bad input, and the artifact's version 2."""

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_artifact import make_rotations

from oscar_math import ArtifactError, OscarError, dequantize_int2, quantize_int2
from oscar_math.artifact import load_rotations, save_rotations
from oscar_math.feedback import (
    fake_quantize_int2_feedback,
    feedback_gain,
    feedback_matrix,
    quantize_int2_feedback,
)
from oscar_math.hadamard import hadamard_matrix


def _metric(d, seed=0, low=-3.0):
    """A dense metric as the rotation leaves it: anisotropic spectrum mixed by a Hadamard."""
    lam = torch.logspace(0, low, d, dtype=torch.float64)
    h = (
        hadamard_matrix(d).double()
        if d in (16, 32, 64, 128)
        else torch.linalg.qr(
            torch.randn(d, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        )[0]
    )
    return h.T @ torch.diag(lam) @ h


def _err(x, xh, m):
    e = (x - xh).double()
    return float(torch.einsum("...i,ij,...j->...", e, m, e).mean())


@pytest.mark.parametrize("shape,group", [((37, 3, 64), 64), ((5, 2, 24), 8), ((11, 128), 32)])
def test_zero_feedback_is_plain_rounding(shape, group):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 3
    d = shape[-1]
    for clip in (None, 0.8):
        a = quantize_int2(x, group, clip)
        for fb in (None, torch.zeros(d, d)):
            b = quantize_int2_feedback(x, group, fb, clip)
            assert (
                torch.equal(a.codes, b.codes)
                and torch.equal(a.scale, b.scale)
                and torch.equal(a.zero, b.zero)
            )


def test_factorisation_and_strictly_lower():
    m = _metric(32)
    f = feedback_matrix(m, damp=1e-6).double()
    assert torch.equal(torch.triu(f), torch.zeros_like(f))
    lower = f + torch.eye(32, dtype=torch.float64)
    # Lᵀ D L = M with D = diag of the conditional variances: check via L M⁻¹ Lᵀ being diagonal
    inner = lower @ torch.linalg.inv(m) @ lower.T
    off = inner - torch.diag(torch.diagonal(inner))
    assert float(off.abs().max()) < 1e-4 * float(torch.diagonal(inner).abs().max())


@pytest.mark.parametrize("d,group", [(64, 64), (32, 16), (24, 24)])
def test_feedback_lowers_the_metric_error(d, group):
    m = _metric(d)
    x = torch.randn(4000, d, generator=torch.Generator().manual_seed(2))
    f = feedback_matrix(m)
    for clip in (None, 0.85):
        plain = dequantize_int2(quantize_int2(x, group, clip))
        fb = fake_quantize_int2_feedback(x, group, f, clip)
        ratio = _err(x, fb, m) / _err(x, plain, m)
        predicted = float(feedback_gain(m))
        assert ratio < 0.7, ratio
        # uniform-noise prediction within a factor 1.5 (clamping at 4 levels costs some)
        assert predicted / 1.5 < ratio < predicted * 1.5, (ratio, predicted)


def test_isotropic_metric_gives_no_feedback():
    f = feedback_matrix(torch.eye(16, dtype=torch.float64) * 3.0)
    assert float(f.abs().max()) < 1e-12


def test_per_head_feedback_broadcasts():
    x = torch.randn(9, 3, 32, generator=torch.Generator().manual_seed(3))
    fs = torch.stack([feedback_matrix(_metric(32, low=-k)) for k in (1.0, 2.0, 3.0)])
    both = quantize_int2_feedback(x, 32, fs, torch.tensor([[0.9], [0.8], [1.0]]))
    for h in range(3):
        one = quantize_int2_feedback(x[:, h], 32, fs[h], [0.9, 0.8, 1.0][h])
        assert torch.equal(both.codes[:, h], one.codes)


def test_bad_input():
    with pytest.raises(OscarError, match="metric"):
        feedback_matrix(torch.ones(4, 5))
    with pytest.raises(OscarError, match="metric"):
        feedback_matrix(torch.full((4, 4), float("nan")))
    with pytest.raises(OscarError, match="damp"):
        feedback_matrix(torch.eye(4), damp=0.0)
    with pytest.raises(OscarError, match="feedback"):
        quantize_int2_feedback(torch.randn(3, 16), 16, torch.zeros(8, 8))


def _with_feedback(rot, kinds=("k_feedback", "v_feedback")):
    g, d = rot.num_groups, rot.head_dim
    fb = [feedback_matrix(_metric(d, seed=i).expand(g, d, d)) for i in range(rot.num_layers)]
    return dataclasses.replace(rot, **{k: fb for k in kinds})


def test_artifact_round_trip_with_feedback(tmp_path):
    rot = _with_feedback(make_rotations(d=16))
    assert rot.format_version == "2" and rot.has_feedback
    p = save_rotations(tmp_path / "a.safetensors", rot)
    back = load_rotations(p)
    assert back.format_version == "2"
    for a, b in zip(rot.k_feedback + rot.v_feedback, back.k_feedback + back.v_feedback, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(back.for_layer(1).k_feedback, rot.k_feedback[1])
    only_k = _with_feedback(make_rotations(d=16), ("k_feedback",))
    back = load_rotations(save_rotations(tmp_path / "k.safetensors", only_k))
    assert back.v_feedback is None and back.k_feedback is not None
    plain = load_rotations(save_rotations(tmp_path / "p.safetensors", make_rotations(d=16)))
    assert plain.format_version == "1" and not plain.has_feedback


def _rewrite(tmp_path, tensors, meta):
    p = tmp_path / "x.safetensors"
    save_file(tensors, str(p), metadata=meta)
    return p


def test_artifact_refuses_bad_feedback(tmp_path):
    rot = _with_feedback(make_rotations(d=16))
    p = save_rotations(tmp_path / "a.safetensors", rot)
    from safetensors import safe_open

    with safe_open(str(p), "pt") as fh:
        meta = fh.metadata()
    tensors = load_file(str(p))
    # a version-1 reader's view: feedback tensors in a version-1 file are refused, not ignored
    with pytest.raises(ArtifactError, match="unexpected tensors .*feedback"):
        load_rotations(_rewrite(tmp_path, tensors, {**meta, "format_version": "1"}))
    partial = dict(tensors)
    del partial["layers.2.v_feedback"]
    with pytest.raises(ArtifactError, match=r"missing tensor layers\.2\.v_feedback"):
        load_rotations(_rewrite(tmp_path, partial, meta))
    upper = dict(tensors)
    upper["layers.0.k_feedback"] = upper["layers.0.k_feedback"].transpose(-1, -2).contiguous()
    with pytest.raises(ArtifactError, match="strictly lower-triangular"):
        load_rotations(_rewrite(tmp_path, upper, meta))
    with pytest.raises(ArtifactError, match="Invalid shape of layers.0.k_feedback"):
        dataclasses.replace(rot, k_feedback=[torch.zeros(2, 8, 8)] * rot.num_layers)
