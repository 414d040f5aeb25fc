import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oscar_math import OscarError
from oscar_math.bitrev import bit_reversal_permutation, permutation_matrix
from oscar_math.eigen import eigenbasis
from oscar_math.hadamard import block_hadamard, hadamard_matrix
from oscar_math.rotation import (
    HadamardMode,
    compose_rotation,
    hadamard_rotation,
    identity_rotation,
    is_orthogonal,
)


def _decaying_cov(d, seed, batch=(), decay=3.0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(*batch, d, d, generator=g, dtype=torch.float64)
    Q, _ = torch.linalg.qr(A)
    lam = torch.logspace(0, -decay, d, dtype=torch.float64)
    return Q @ torch.diag_embed(lam.expand(*batch, d)) @ Q.transpose(-1, -2)


@settings(max_examples=30, deadline=None)
@given(
    d=st.sampled_from([64, 80, 96, 112, 128]),
    gs=st.sampled_from([16, 32, "d"]),
    mode=st.sampled_from(["group", "full", "none"]),
    bitrev=st.booleans(),
    batch=st.sampled_from([(), (3,)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_compose_orthogonal_and_inverse(d, gs, mode, bitrev, batch, seed):
    group = d if gs == "d" else gs
    if d % group:
        group = d
    _, U = eigenbasis(_decaying_cov(d, seed, batch))
    R = compose_rotation(U, group, bit_reversal=bitrev, hadamard=mode)
    assert R.shape == (*batch, d, d) and R.dtype == torch.float64
    assert is_orthogonal(R, atol=1e-10)
    x = torch.randn(5, *batch, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    x = x.transpose(0, -2) if batch else x  # rows x [..., d] matching R's batch
    y = x @ R
    assert torch.allclose(y @ R.transpose(-1, -2), x, atol=1e-10)


def test_composition_structure():
    d, group = 128, 32
    _, U = eigenbasis(_decaying_cov(d, 0))
    perm = bit_reversal_permutation(d, group)
    P = permutation_matrix(perm)
    Hb = block_hadamard(d, group)
    assert torch.allclose(compose_rotation(U, group), U @ P @ Hb, atol=1e-13)
    assert torch.allclose(compose_rotation(U, group, hadamard="full"), U @ P @ hadamard_matrix(d), atol=1e-13)
    assert torch.equal(compose_rotation(U, group, bit_reversal=False, hadamard="none"), U)
    assert torch.equal(compose_rotation(U, group, hadamard=HadamardMode.NONE), U[:, perm])
    # group_size == d: permutation is the identity and the group Hadamard is the full one
    assert torch.allclose(compose_rotation(U, d), U @ hadamard_matrix(d), atol=1e-13)
    assert torch.allclose(compose_rotation(U.float(), d), U @ hadamard_matrix(d), atol=1e-6)


def _group_energy(C, R, group):
    diag = torch.diagonal(R.transpose(-1, -2) @ C @ R, dim1=-2, dim2=-1)
    return diag, diag.view(-1, group).sum(-1)


@pytest.mark.parametrize(("d", "group"), [(128, 32), (128, 16), (96, 32), (64, 32)])
def test_bitrev_balances_group_energy(d, group):
    C = _decaying_cov(d, 1)
    _, U = eigenbasis(C)
    _, e_u = _group_energy(C, U, group)
    diag, e_r = _group_energy(C, compose_rotation(U, group), group)
    spread_u = (e_u.max() / e_u.min()).item()
    spread_r = (e_r.max() / e_r.min()).item()
    assert spread_r < spread_u / 10, (spread_u, spread_r)
    # inside each group the Hadamard makes every coordinate carry the group mean
    per = diag.view(-1, group)
    assert torch.allclose(per, per.mean(-1, keepdim=True).expand_as(per), rtol=1e-8)
    # and the largest coordinate energy is far below U's
    assert diag.max() < torch.diagonal(U.T @ C @ U).max() / 4


def test_baselines():
    assert torch.equal(identity_rotation(80), torch.eye(80, dtype=torch.float64))
    R = hadamard_rotation(96, seed=3)
    assert is_orthogonal(R, atol=1e-12) and torch.equal(R, hadamard_rotation(96, seed=3))


def test_is_orthogonal_rejects():
    assert not is_orthogonal(torch.ones(4, 4))
    assert not is_orthogonal(torch.eye(4)[:3])
    bad = torch.eye(4)
    bad[0, 0] = float("nan")
    assert not is_orthogonal(bad)
    assert not is_orthogonal(torch.eye(4) * (1 + 1e-3), atol=1e-5)
    assert is_orthogonal(torch.eye(4) * (1 + 1e-7), atol=1e-5)
    assert not is_orthogonal(torch.stack([torch.eye(3), 2 * torch.eye(3)]))


def test_compose_rejects_bad_input():
    U = torch.eye(128, dtype=torch.float64)
    with pytest.raises(OscarError, match="Invalid group_size: expected a positive divisor of d=128, got 48"):
        compose_rotation(U, 48)
    with pytest.raises(OscarError, match="Invalid hadamard"):
        compose_rotation(U, 32, hadamard="sylvester")
    with pytest.raises(OscarError, match=r"Invalid U: expected shape .*, got \[4, 5\]"):
        compose_rotation(torch.zeros(4, 5), 4)
    with pytest.raises(OscarError, match="Invalid n: expected a Hadamard order"):
        compose_rotation(torch.eye(88, dtype=torch.float64), 44)
