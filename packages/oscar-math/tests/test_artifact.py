import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from oscar_math import ArtifactError
from oscar_math.artifact import (
    FORMAT,
    Granularity,
    Rotations,
    identity_rotations,
    load_rotations,
    save_rotations,
)


def _random_orthogonal(g, d, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(g, d, d, generator=gen, dtype=torch.float64))[0]


def make_rotations(num_layers=3, heads=2, d=16, granularity="kv_head", k_mean=True, seed=0):
    g = heads if granularity == "kv_head" else 1
    gen = torch.Generator().manual_seed(seed)
    return Rotations(
        model="test/tiny",
        num_layers=num_layers,
        num_kv_heads=heads,
        head_dim=d,
        group_size=8,
        sink_tokens=4,
        recent_tokens=16,
        granularity=granularity,
        k_rotation=[_random_orthogonal(g, d, seed + i) for i in range(num_layers)],
        v_rotation=[_random_orthogonal(g, d, 100 + seed + i) for i in range(num_layers)],
        k_eigenvalues=[torch.rand(g, d, generator=gen).sort(-1)[0].flip(-1) for _ in range(num_layers)],
        v_eigenvalues=[torch.rand(g, d, generator=gen) for _ in range(num_layers)],
        k_clip=[0.5 + 0.5 * torch.rand(g, generator=gen) for _ in range(num_layers)],
        v_clip=[0.5 + 0.5 * torch.rand(g, generator=gen) for _ in range(num_layers)],
        k_mean=[torch.randn(g, d, generator=gen) for _ in range(num_layers)] if k_mean else None,
        calibration={"tokens": 4096, "text": "pydoc_data.topics", "seed": 0, "tool": "oscar-math 0.1.0"},
    )


@pytest.mark.parametrize("granularity,k_mean", [("kv_head", True), ("layer", False)])
def test_round_trip(tmp_path, granularity, k_mean):
    rot = make_rotations(granularity=granularity, k_mean=k_mean)
    path = save_rotations(tmp_path / "r.safetensors", rot)
    back = load_rotations(path, model="test/tiny", num_layers=3, num_kv_heads=2, head_dim=16)
    assert back.granularity == Granularity(granularity) and back.num_groups == rot.num_groups
    assert back.metadata() == rot.metadata()
    assert back.calibration == rot.calibration
    for kind in ("k_rotation", "v_rotation", "k_eigenvalues", "v_eigenvalues", "k_clip", "v_clip", "k_mean"):
        a, b = getattr(rot, kind), getattr(back, kind)
        if not k_mean and kind == "k_mean":
            assert a is None and b is None
            continue
        assert len(b) == 3 and all(x.dtype == torch.float32 for x in b)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    layer = back.for_layer(2)
    assert layer.k_rotation.shape == (rot.num_groups, 16, 16) and layer.k_clip.shape == (rot.num_groups,)
    assert torch.equal(layer.v_clip, rot.v_clip[2])


def test_file_layout_is_the_documented_contract(tmp_path):
    rot = make_rotations(num_layers=2)
    path = save_rotations(tmp_path / "r.safetensors", rot)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        names = set(f.keys())
    assert meta["format"] == FORMAT and meta["format_version"] == "1"
    assert {k: meta[k] for k in ("num_layers", "num_kv_heads", "head_dim", "group_size", "granularity")} == {
        "num_layers": "2",
        "num_kv_heads": "2",
        "head_dim": "16",
        "group_size": "8",
        "granularity": "kv_head",
    }
    assert json.loads(meta["calibration"])["tokens"] == 4096
    kinds = ["k_rotation", "v_rotation", "k_eigenvalues", "v_eigenvalues", "k_clip", "v_clip", "k_mean"]
    assert names == {f"layers.{i}.{k}" for i in range(2) for k in kinds}


def test_identity_rotations_are_valid_and_round_trip(tmp_path):
    rot = identity_rotations("m", 4, 3, 64, group_size=32, granularity="kv_head", k_clip=0.9)
    assert rot.k_rotation[0].shape == (3, 64, 64) and float(rot.k_clip[1][2]) == pytest.approx(0.9)
    back = load_rotations(save_rotations(tmp_path / "i.safetensors", rot))
    assert torch.equal(back.v_rotation[3], torch.eye(64).expand(3, 64, 64))


# ---- malformed files: each names its problem -------------------------------------------------


@pytest.fixture
def good(tmp_path):
    path = save_rotations(tmp_path / "good.safetensors", make_rotations())
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata())
    return path, load_file(str(path)), meta


def _rewrite(tmp_path, tensors, meta, name="bad.safetensors"):
    p = tmp_path / name
    save_file(tensors, str(p), metadata=meta)
    return p


def test_missing_file(tmp_path):
    with pytest.raises(ArtifactError, match="not found"):
        load_rotations(tmp_path / "nope.safetensors")


def test_not_safetensors(tmp_path):
    p = tmp_path / "junk.safetensors"
    p.write_bytes(b"this is not a safetensors file at all")
    with pytest.raises(ArtifactError, match="not a readable safetensors file") as e:
        load_rotations(p)
    assert "\n" not in str(e.value) and str(p) in str(e.value)


def test_truncated(tmp_path, good):
    path, _, _ = good
    data = path.read_bytes()
    p = tmp_path / "trunc.safetensors"
    p.write_bytes(data[: len(data) - 100])
    with pytest.raises(ArtifactError, match="truncated or corrupt"):
        load_rotations(p)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"format": "something-else"}, "Invalid format"),
        ({"format_version": "4"}, r"Unsupported format_version: expected one of \['1', '2', '3'\], got '4'"),
        ({"format_version": "3"}, r"missing tensor layers\.0\.k_rope_mean \(format_version '3' needs it"),
        ({"format_version": "2"}, "format_version '2' without k_feedback or v_feedback"),
        ({"granularity": "token"}, "Invalid granularity"),
        ({"head_dim": "sixteen"}, "Invalid metadata head_dim"),
        ({"calibration": "{not json"}, "Invalid metadata calibration"),
        ({"group_size": "5"}, "Invalid group_size"),
    ],
)
def test_bad_metadata(tmp_path, good, change, match):
    _, tensors, meta = good
    with pytest.raises(ArtifactError, match=match):
        load_rotations(_rewrite(tmp_path, tensors, {**meta, **change}))


def test_missing_metadata_key(tmp_path, good):
    _, tensors, meta = good
    del meta["recent_tokens"]
    with pytest.raises(ArtifactError, match="missing metadata key 'recent_tokens'"):
        load_rotations(_rewrite(tmp_path, tensors, meta))


def test_no_metadata(tmp_path, good):
    _, tensors, _ = good
    with pytest.raises(ArtifactError, match="missing __metadata__"):
        load_rotations(_rewrite(tmp_path, tensors, None))


def test_missing_tensor(tmp_path, good):
    _, tensors, meta = good
    del tensors["layers.1.k_rotation"]
    with pytest.raises(ArtifactError, match=r"missing tensor layers\.1\.k_rotation"):
        load_rotations(_rewrite(tmp_path, tensors, meta))


def test_partial_k_mean(tmp_path, good):
    _, tensors, meta = good
    del tensors["layers.2.k_mean"]
    with pytest.raises(ArtifactError, match=r"missing tensor layers\.2\.k_mean"):
        load_rotations(_rewrite(tmp_path, tensors, meta))


def test_unexpected_tensor(tmp_path, good):
    _, tensors, meta = good
    tensors["layers.3.k_rotation"] = tensors["layers.0.k_rotation"].clone()
    with pytest.raises(ArtifactError, match=r"unexpected tensors .*layers\.3\.k_rotation"):
        load_rotations(_rewrite(tmp_path, tensors, meta))


def test_wrong_shape(tmp_path, good):
    _, tensors, meta = good
    tensors["layers.0.v_eigenvalues"] = torch.zeros(2, 15)
    match = r"shape of layers\.0\.v_eigenvalues: expected \[2, 16\], got \[2, 15\]"
    with pytest.raises(ArtifactError, match=match):
        load_rotations(_rewrite(tmp_path, tensors, meta))


def test_wrong_dtype(tmp_path, good):
    _, tensors, meta = good
    tensors["layers.1.k_clip"] = tensors["layers.1.k_clip"].half()
    match = r"dtype of layers\.1\.k_clip: expected torch.float32, got torch.float16"
    with pytest.raises(ArtifactError, match=match):
        load_rotations(_rewrite(tmp_path, tensors, meta))


def test_nan(tmp_path, good):
    _, tensors, meta = good
    tensors["layers.2.k_mean"][1, 3] = float("nan")
    with pytest.raises(ArtifactError, match=r"layers\.2\.k_mean: contains NaN or Inf"):
        load_rotations(_rewrite(tmp_path, tensors, meta))


def test_non_orthogonal(tmp_path, good):
    _, tensors, meta = good
    tensors["layers.1.v_rotation"][1] *= 1.1
    with pytest.raises(ArtifactError, match=r"layers\.1\.v_rotation: not orthogonal.*\(group 1\)"):
        load_rotations(_rewrite(tmp_path, tensors, meta))


@pytest.mark.parametrize("value", [0.0, 1.5, -0.2])
def test_clip_out_of_range(tmp_path, good, value):
    _, tensors, meta = good
    tensors["layers.0.v_clip"][0] = value
    with pytest.raises(ArtifactError, match=r"layers\.0\.v_clip: expected clip ratios in \(0, 1\]"):
        load_rotations(_rewrite(tmp_path, tensors, meta))


def test_layer_count_of_file_inconsistent(tmp_path, good):
    _, tensors, meta = good
    with pytest.raises(ArtifactError, match="unexpected tensors for num_layers=2"):
        load_rotations(_rewrite(tmp_path, tensors, {**meta, "num_layers": "2"}))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_layers": 30}, "num_layers mismatch: the model being served has 30, the file has 3"),
        ({"model": "other/model"}, "model mismatch"),
        ({"num_kv_heads": 4}, "num_kv_heads mismatch"),
        ({"head_dim": 64}, "head_dim mismatch"),
    ],
)
def test_does_not_match_model(good, kwargs, match):
    path, _, _ = good
    with pytest.raises(ArtifactError, match=match):
        load_rotations(path, **kwargs)


def test_constructor_validates_and_replace_revalidates():
    rot = make_rotations()
    with pytest.raises(ArtifactError, match="Invalid k_clip: expected 3 layers"):
        dataclasses.replace(rot, k_clip=rot.k_clip[:2])
    with pytest.raises(ArtifactError, match="Invalid calibration"):
        dataclasses.replace(rot, calibration={"x": object()})
    with pytest.raises(ArtifactError, match="Invalid layer index"):
        rot.for_layer(3)


@settings(max_examples=15, deadline=None)
@given(
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    d=st.sampled_from([4, 8, 12, 20]),
    per_head=st.booleans(),
    with_mean=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_round_trip_property(tmp_path_factory, layers, heads, d, per_head, with_mean, seed):
    g = heads if per_head else 1
    gen = torch.Generator().manual_seed(seed)
    rot = Rotations(
        model=f"m{seed}",
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=d,
        group_size=4,
        sink_tokens=seed % 7,
        recent_tokens=seed % 300,
        granularity="kv_head" if per_head else "layer",
        k_rotation=[_random_orthogonal(g, d, seed + i) for i in range(layers)],
        v_rotation=[_random_orthogonal(g, d, seed + 50 + i) for i in range(layers)],
        k_eigenvalues=[torch.randn(g, d, generator=gen) for _ in range(layers)],
        v_eigenvalues=[torch.randn(g, d, generator=gen) for _ in range(layers)],
        k_clip=[torch.rand(g, generator=gen).clamp(min=0.01) for _ in range(layers)],
        v_clip=[torch.ones(g) for _ in range(layers)],
        k_mean=[torch.randn(g, d, generator=gen) for _ in range(layers)] if with_mean else None,
        calibration={"seed": seed, "nested": {"a": [1, 2.5, "x"]}},
    )
    path = save_rotations(tmp_path_factory.mktemp("rt") / "r.safetensors", rot)
    back = load_rotations(path, model=f"m{seed}", num_layers=layers, num_kv_heads=heads, head_dim=d)
    assert back.metadata() == rot.metadata() and back.calibration == rot.calibration
    assert set(back.tensors()) == set(rot.tensors())
    assert all(torch.equal(back.tensors()[n], t) for n, t in rot.tensors().items())


def test_save_to_a_folder_names_the_folder_not_a_temp_file(tmp_path):
    with pytest.raises(ArtifactError, match="expected a file name, got the folder") as info:
        save_rotations(tmp_path, identity_rotations("m", 1, 1, 64))
    assert ".tmp" not in str(info.value) and list(tmp_path.iterdir()) == []


def test_loads_under_another_default_device(tmp_path):
    """vLLM builds models (and so loads the artifact) under a CUDA default device; the artifact
    is host data. The meta device stands in for CUDA on a CPU machine: any factory call without
    an explicit device would land there and fail beside the CPU tensors read from the file."""
    path = save_rotations(tmp_path / "r.safetensors", make_rotations())
    with torch.device("meta"):
        rot = load_rotations(path)
        again = dataclasses.replace(rot, model=rot.model + "-copy")  # revalidates
    for r in (rot, again):
        assert r.k_rotation[0].device.type == "cpu" and r.v_clip[0].device.type == "cpu"
    assert torch.equal(rot.k_rotation[0], load_rotations(path).k_rotation[0])
