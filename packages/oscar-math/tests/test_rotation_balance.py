"""The group-balance figures quoted in docs/math.md ("Composition"), reproduced."""

import pytest
import torch

from oscar_math.eigen import eigenbasis
from oscar_math.rotation import compose_rotation


def _balance(d: int, group: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """(group-energy max/min, coordinate-energy max/mean) for ``U`` and for ``U·P·H``.

    Covariance with eigenvalues ``logspace(0, -3, d)`` in a random orthonormal basis.
    """
    lam = torch.logspace(0, -3, d, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    c = q @ torch.diag(lam) @ q.T
    _, u = eigenbasis(c)
    out = []
    for r in (u, compose_rotation(u, group).double()):
        energy = torch.diagonal(r.T @ c @ r)
        groups = energy.reshape(-1, group).sum(-1)
        out.append((float(groups.max() / groups.min()), float(energy.max() / energy.mean())))
    return out[0], out[1]


@pytest.mark.parametrize(
    "d, group, plain, balanced",
    [(128, 32, 185, 1.18), (128, 16, 442, 1.46), (96, 32, 105, 1.16)],
)
def test_group_energy_balance_quoted_in_math_md(d, group, plain, balanced):
    (u_groups, u_coord), (r_groups, r_coord) = _balance(d, group)
    assert u_groups == pytest.approx(plain, abs=0.5)
    assert r_groups == pytest.approx(balanced, abs=0.005)
    if (d, group) == (128, 32):  # the largest coordinate energy: 6.8x the mean -> 1.08x
        assert u_coord == pytest.approx(6.8, abs=0.05) and r_coord == pytest.approx(1.08, abs=0.005)
