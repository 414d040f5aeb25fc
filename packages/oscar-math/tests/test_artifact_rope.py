"""Artifact format version 3: the pre-RoPE key mean (``k_rope_mean`` + ``rope_inv_freq``)."""

import dataclasses

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_artifact import make_rotations

from oscar_math import ArtifactError
from oscar_math.artifact import FORMAT_VERSIONS, load_rotations, save_rotations


def _inv_freq(d):
    return 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)


def with_rope(rot, pairs=(0, 3), seed=1, feedback=False):
    """``rot`` with a pre-RoPE mean on ``pairs`` (zero elsewhere) and optional feedback."""
    gen = torch.Generator().manual_seed(seed)
    g, d, half = rot.num_groups, rot.head_dim, rot.head_dim // 2
    means = []
    for _ in range(rot.num_layers):
        m = torch.zeros(g, d)
        for i in pairs:
            m[:, i], m[:, i + half] = torch.randn(g, generator=gen), torch.randn(g, generator=gen)
        means.append(m)
    kw = {}
    if feedback:
        kw["k_feedback"] = [torch.tril(torch.randn(g, d, d, generator=gen), -1) * 0.1 for _ in means]
    return dataclasses.replace(rot, k_rope_mean=means, rope_inv_freq=_inv_freq(d), **kw)


@pytest.mark.parametrize("granularity", ["kv_head", "layer"])
@pytest.mark.parametrize("feedback", [False, True])
def test_round_trip_version_3(tmp_path, granularity, feedback):
    rot = with_rope(make_rotations(granularity=granularity), feedback=feedback)
    assert rot.format_version == "3" and rot.has_rope_mean and rot.has_feedback == feedback
    back = load_rotations(save_rotations(tmp_path / "r.safetensors", rot))
    assert back.format_version == "3" and back.metadata() == rot.metadata()
    assert back.rope_inv_freq.dtype == torch.float32 and back.rope_inv_freq.shape == (8,)
    assert torch.equal(back.rope_inv_freq, _inv_freq(16).float())
    for a, b in zip(rot.k_rope_mean, back.k_rope_mean, strict=True):
        assert torch.equal(a, b) and b.shape == (rot.num_groups, 16)
    lay = back.for_layer(1)
    assert torch.equal(lay.k_rope_mean, rot.k_rope_mean[1])


def test_file_layout_version_3(tmp_path):
    rot = with_rope(make_rotations(num_layers=2))
    path = save_rotations(tmp_path / "r.safetensors", rot)
    with safe_open(str(path), "pt") as f:
        meta, names = f.metadata(), set(f.keys())
    assert meta["format_version"] == "3"
    kinds = ["k_rotation", "v_rotation", "k_eigenvalues", "v_eigenvalues", "k_clip", "v_clip", "k_mean"]
    assert names == {f"layers.{i}.{k}" for i in range(2) for k in [*kinds, "k_rope_mean"]} | {"rope_inv_freq"}


def test_files_without_the_mean_keep_their_version(tmp_path):
    plain = make_rotations()
    assert plain.format_version == "1" and not plain.has_rope_mean
    assert (
        plain.k_rope_mean is None and plain.rope_inv_freq is None and plain.for_layer(0).k_rope_mean is None
    )
    fb = with_rope(plain, feedback=True)
    fb = dataclasses.replace(fb, k_rope_mean=None, rope_inv_freq=None)
    assert fb.format_version == "2"
    assert set(FORMAT_VERSIONS) == {"1", "2", "3"}


@pytest.fixture
def v3(tmp_path):
    path = save_rotations(tmp_path / "v3.safetensors", with_rope(make_rotations()))
    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata())
    return load_file(str(path)), meta


def _load(tmp_path, tensors, meta):
    p = tmp_path / "bad.safetensors"
    save_file(tensors, str(p), metadata=meta)
    return load_rotations(p)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda t, m: t.pop("rope_inv_freq"), "missing tensor rope_inv_freq"),
        (lambda t, m: t.pop("layers.1.k_rope_mean"), r"missing tensor layers\.1\.k_rope_mean"),
        (
            lambda t, m: [t.pop(f"layers.{i}.k_rope_mean") for i in range(3)],
            r"missing tensor layers\.0\.k_rope_mean \(format_version '3'",
        ),
        (
            lambda t, m: t.update(rope_inv_freq=torch.ones(7)),
            r"Invalid shape of rope_inv_freq: expected \[8\]",
        ),
        (lambda t, m: t.update(rope_inv_freq=-torch.ones(8)), "expected finite positive frequencies"),
        (lambda t, m: t.update(rope_inv_freq=torch.zeros(8)), "expected finite positive frequencies"),
        (
            lambda t, m: t.update(rope_inv_freq=torch.full((8,), float("inf"))),
            "expected finite positive frequencies",
        ),
        (
            lambda t, m: t["layers.2.k_rope_mean"].__setitem__((0, 0), float("nan")),
            r"Invalid layers\.2\.k_rope_mean: contains NaN",
        ),
        (
            lambda t, m: t.update({"layers.0.k_rope_mean": torch.zeros(2, 15)}),
            r"Invalid shape of layers\.0\.k_rope_mean: expected \[2, 16\]",
        ),
        (
            lambda t, m: t.update(rope_inv_freq=torch.ones(8, dtype=torch.float64)),
            "Invalid dtype of rope_inv_freq",
        ),
        # an older reader's view: a rope mean in a version-1/2 file is refused, not ignored
        (lambda t, m: m.update(format_version="1"), "unexpected tensors .*k_rope_mean"),
        (lambda t, m: m.update(format_version="2"), "unexpected tensors .*k_rope_mean"),
    ],
)
def test_refuses_bad_version_3_files(tmp_path, v3, edit, match):
    tensors, meta = v3
    edit(tensors, meta)
    with pytest.raises(ArtifactError, match=match) as e:
        _load(tmp_path, tensors, meta)
    assert "\n" not in str(e.value)


def test_constructor_needs_both_or_neither():
    rot = with_rope(make_rotations())
    with pytest.raises(ArtifactError, match="k_rope_mean: given without rope_inv_freq"):
        dataclasses.replace(rot, rope_inv_freq=None)
    with pytest.raises(ArtifactError, match="rope_inv_freq: given without k_rope_mean"):
        dataclasses.replace(rot, k_rope_mean=None)
    with pytest.raises(ArtifactError, match=r"expected 3 layers"):
        dataclasses.replace(rot, k_rope_mean=rot.k_rope_mean[:2])
