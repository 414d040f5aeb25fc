import pytest
import torch
from conftest import rand_orth

from oscar_kernels import LayerQuantParams
from oscar_math import OscarError


def test_expand_layer_and_kv_head():
    g = torch.Generator().manual_seed(0)
    r = rand_orth(16, 16, gen=g).t()  # non-contiguous on purpose
    ep = LayerQuantParams(r, r, k_mean=torch.ones(16), k_clip=0.9).expand(3, 16, torch.device("cpu"))
    assert ep.k_rotation.shape == (3, 16, 16) and ep.k_rotation.stride(0) == 0
    assert ep.k_rotation.stride(-1) == 1 and torch.equal(ep.k_rotation[2], r)
    assert ep.k_mean.shape == (3, 16) and ep.has_mean
    assert ep.k_clip.tolist() == pytest.approx([0.9] * 3) and ep.v_clip.tolist() == [1.0] * 3
    rh = rand_orth(3, 16, 16, gen=g)
    ep = LayerQuantParams(rh, rh, v_clip=torch.tensor([0.5, 0.6, 0.7])).expand(3, 16, torch.device("cpu"))
    assert ep.k_rotation.stride(0) == 256 and not ep.has_mean


def test_invalid_params():
    r = torch.eye(16)
    with pytest.raises(OscarError, match="shape of k_rotation"):
        LayerQuantParams(torch.eye(8), r).expand(2, 16, torch.device("cpu"))
    with pytest.raises(OscarError, match="k_clip"):
        LayerQuantParams(r, r, k_clip=1.5).expand(2, 16, torch.device("cpu"))
    with pytest.raises(OscarError, match="size of v_clip"):
        LayerQuantParams(r, r, v_clip=torch.ones(3)).expand(2, 16, torch.device("cpu"))


@pytest.mark.parametrize("granularity", ["layer", "kv_head"])
def test_from_rotations_takes_a_layer_of_the_artifact(granularity, tmp_path):
    """Distinct random (non-symmetric) rotations, key means and clips per layer, through a
    saved and re-loaded artifact: a transposed rotation, a wrong layer or a dropped mean fails."""
    from oscar_math.artifact import Rotations, load_rotations, save_rotations

    gen = torch.Generator().manual_seed(4)
    layers, h, d = 3, 2, 16
    g = 1 if granularity == "layer" else h

    def per_layer(make):
        return [make() for _ in range(layers)]

    rot = Rotations(
        model="m",
        num_layers=layers,
        num_kv_heads=h,
        head_dim=d,
        group_size=d,
        sink_tokens=4,
        recent_tokens=8,
        granularity=granularity,
        k_rotation=per_layer(lambda: rand_orth(g, d, d, gen=gen)),
        v_rotation=per_layer(lambda: rand_orth(g, d, d, gen=gen)),
        k_eigenvalues=per_layer(lambda: torch.rand(g, d, generator=gen)),
        v_eigenvalues=per_layer(lambda: torch.rand(g, d, generator=gen)),
        k_clip=per_layer(lambda: 0.5 + 0.5 * torch.rand(g, generator=gen)),
        v_clip=per_layer(lambda: 0.5 + 0.5 * torch.rand(g, generator=gen)),
        k_mean=per_layer(lambda: torch.randn(g, d, generator=gen)),
        calibration={"source": "random"},
    )
    save_rotations(tmp_path / "r.safetensors", rot)
    rot = load_rotations(tmp_path / "r.safetensors")
    p = LayerQuantParams.from_rotations(rot, 2)
    assert p.granularity == granularity
    ep = p.expand(h, d, torch.device("cpu"))
    want = rot.for_layer(2)
    for head in range(h):
        src = 0 if granularity == "layer" else head
        assert torch.equal(ep.k_rotation[head], want.k_rotation[src])
        assert torch.equal(ep.v_rotation[head], want.v_rotation[src])
        assert torch.equal(ep.k_mean[head], want.k_mean[src])
        assert float(ep.k_clip[head]) == float(want.k_clip[src])
        assert float(ep.v_clip[head]) == float(want.v_clip[src])
    assert ep.has_mean
    # and it is the layer's own data: not another layer's, not transposed
    assert not torch.equal(ep.k_rotation[0], rot.for_layer(1).k_rotation[0])
    assert not torch.allclose(ep.k_rotation[0], ep.k_rotation[0].T, atol=1e-3)
    with pytest.raises(OscarError, match="layer"):
        LayerQuantParams.from_rotations(rot, 3)
