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
def test_from_rotations_takes_a_layer_of_the_artifact(granularity):
    from oscar_math.artifact import identity_rotations

    rot = identity_rotations(
        "m", num_layers=3, num_kv_heads=2, head_dim=16, granularity=granularity, k_clip=0.7, v_clip=0.9
    )
    p = LayerQuantParams.from_rotations(rot, 2)
    assert p.granularity == granularity
    ep = p.expand(2, 16, torch.device("cpu"))
    assert torch.equal(ep.k_rotation[1], torch.eye(16))
    assert torch.allclose(ep.k_clip, torch.tensor([0.7, 0.7]))
    assert torch.allclose(ep.v_clip, torch.tensor([0.9, 0.9]))
    with pytest.raises(OscarError, match="layer"):
        LayerQuantParams.from_rotations(rot, 3)
