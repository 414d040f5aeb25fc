import pytest
import torch

from oscar_math import ArtifactError, load_rotations, save_rotations
from oscar_math.rotationzoo import REFERENCE_K_FILE, REFERENCE_V_FILE, import_rotationzoo


class NotATensor:
    """A custom class: weights_only unpickling must refuse it."""

    def __init__(self):
        self.payload = [1, 2, 3]


def _orth(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(*shape, generator=g, dtype=torch.float64))[0].float()


def _reference_state(ids, d, heads=None, eig=True, seed=0, str_keys=False):
    layers = {}
    for i in ids:
        rot = _orth(d, d, seed=seed + i) if heads is None else _orth(heads, d, d, seed=seed + i)
        entry = {"layer_id": i, "rotation": rot}
        if eig:
            entry["eigenvalues"] = torch.linspace(0.1, 2.0, d) * (i + 1)
        layers[str(i) if str_keys else i] = entry
    return {"format_version": 1, "objective": "qqt", "source_grouping": "layer", "layers": layers}


def test_reference_directory_per_layer(tmp_path):
    k = _reference_state(range(3), 16)
    v = _reference_state(range(3), 16, seed=50)
    torch.save(k, tmp_path / REFERENCE_K_FILE)
    torch.save(v, tmp_path / REFERENCE_V_FILE)
    rot = import_rotationzoo(tmp_path, model="Qwen/Qwen3-8B", num_kv_heads=4)
    assert rot.granularity == "layer" and rot.num_layers == 3 and rot.head_dim == 16 and rot.num_kv_heads == 4
    assert rot.group_size == 16 and rot.sink_tokens == 64 and rot.recent_tokens == 256
    assert torch.equal(rot.k_rotation[1][0], k["layers"][1]["rotation"])
    assert torch.equal(rot.v_rotation[2][0], v["layers"][2]["rotation"])
    assert torch.equal(rot.k_eigenvalues[2][0], k["layers"][2]["eigenvalues"])
    assert all(torch.equal(c, torch.ones(1)) for c in rot.k_clip + rot.v_clip)
    assert rot.calibration["source"] == "rotationzoo" and "0.96" in rot.calibration["clip"]
    assert rot.calibration["k_info"]["objective"] == "qqt"
    # converts to our artifact and back
    back = load_rotations(save_rotations(tmp_path / "out.safetensors", rot), model="Qwen/Qwen3-8B")
    assert torch.equal(back.k_rotation[0], rot.k_rotation[0])


def test_per_head_string_keys_no_eigenvalues_explicit_v_path(tmp_path):
    torch.save(_reference_state([3, 7], 8, heads=2, eig=False, str_keys=True), tmp_path / "k.pt")
    torch.save(_reference_state([3, 7], 8, heads=2, eig=False, seed=9), tmp_path / "v.pt")
    rot = import_rotationzoo(tmp_path / "k.pt", v_path=tmp_path / "v.pt", model="m", group_size=4)
    assert rot.granularity == "kv_head" and rot.num_kv_heads == 2 and rot.num_layers == 2
    assert rot.k_rotation[0].shape == (2, 8, 8) and rot.k_clip[0].shape == (2,)
    assert torch.equal(rot.k_eigenvalues[1], torch.zeros(2, 8))
    assert rot.calibration["layer_ids"] == [3, 7] and "zeros" in rot.calibration["eigenvalues"]


def test_stacked_tensor_files(tmp_path):
    torch.save(_orth(4, 8, 8, seed=1), tmp_path / "k_rotation_custom.pt")
    torch.save([_orth(8, 8, seed=i) for i in range(4)], tmp_path / "v_rotation_custom.pt")
    rot = import_rotationzoo(tmp_path, model="m", num_kv_heads=1)
    assert rot.num_layers == 4 and rot.granularity == "layer"


@pytest.mark.parametrize("suffix", ["k_rotation", "k_rot"])
def test_combined_flat_file(tmp_path, suffix):
    obj = {}
    for i in range(2):
        obj[f"layers.{i}.{suffix}"] = _orth(8, 8, seed=i)
        obj[f"layers.{i}.{suffix.replace('k_', 'v_')}"] = _orth(8, 8, seed=10 + i)
        obj[f"layers.{i}.k_eigenvalues"] = torch.arange(8.0)
    torch.save(obj, tmp_path / "both.pt")
    rot = import_rotationzoo(tmp_path / "both.pt", model="m", num_kv_heads=3)
    assert torch.equal(rot.v_rotation[1][0], obj[f"layers.1.{suffix.replace('k_', 'v_')}"])
    assert torch.equal(rot.k_eigenvalues[1][0], torch.arange(8.0))
    assert torch.equal(rot.v_eigenvalues[1][0], torch.zeros(8))


def test_combined_kv_dict(tmp_path):
    obj = {"k": _reference_state(range(2), 8), "v": _reference_state(range(2), 8, seed=3)}
    torch.save(obj, tmp_path / "kv.pt")
    assert import_rotationzoo(tmp_path / "kv.pt", model="m", num_kv_heads=1).num_layers == 2


def test_custom_object_is_refused(tmp_path):
    state = _reference_state(range(2), 8)
    state["extra"] = NotATensor()
    torch.save(state, tmp_path / REFERENCE_K_FILE)
    torch.save(_reference_state(range(2), 8), tmp_path / REFERENCE_V_FILE)
    with pytest.raises(ArtifactError, match="refused or unreadable .pt file.*weights_only=True") as e:
        import_rotationzoo(tmp_path, model="m", num_kv_heads=1)
    assert "\n" not in str(e.value)


def test_corrupt_file(tmp_path):
    (tmp_path / "k.pt").write_bytes(b"\x80\x02garbage")
    (tmp_path / "v.pt").write_bytes(b"")
    with pytest.raises(ArtifactError, match="refused or unreadable"):
        import_rotationzoo(tmp_path / "k.pt", v_path=tmp_path / "v.pt", model="m", num_kv_heads=1)


def test_per_layer_needs_num_kv_heads(tmp_path):
    torch.save(_reference_state(range(2), 8), tmp_path / REFERENCE_K_FILE)
    torch.save(_reference_state(range(2), 8), tmp_path / REFERENCE_V_FILE)
    with pytest.raises(ArtifactError, match="pass num_kv_heads"):
        import_rotationzoo(tmp_path, model="m")


def test_k_and_v_must_cover_same_layers(tmp_path):
    torch.save(_reference_state(range(3), 8), tmp_path / REFERENCE_K_FILE)
    torch.save(_reference_state(range(2), 8), tmp_path / REFERENCE_V_FILE)
    with pytest.raises(ArtifactError, match="different layers"):
        import_rotationzoo(tmp_path, model="m", num_kv_heads=1)


def test_non_orthogonal_rotation_is_named(tmp_path):
    k = _reference_state(range(2), 8)
    k["layers"][1]["rotation"] = k["layers"][1]["rotation"] * 2
    torch.save(k, tmp_path / REFERENCE_K_FILE)
    torch.save(_reference_state(range(2), 8), tmp_path / REFERENCE_V_FILE)
    with pytest.raises(ArtifactError, match=r"layers\.1\.k_rotation: not orthogonal"):
        import_rotationzoo(tmp_path, model="m", num_kv_heads=1)


def test_unknown_layout_and_missing_file(tmp_path):
    torch.save({"foo": torch.zeros(2)}, tmp_path / "x.pt")
    with pytest.raises(ArtifactError, match="unrecognised layout"):
        import_rotationzoo(tmp_path / "x.pt", model="m", num_kv_heads=1)
    with pytest.raises(ArtifactError, match="not found"):
        import_rotationzoo(tmp_path / "nope.pt", model="m", v_path=tmp_path / "x.pt")
