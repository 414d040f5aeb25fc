import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oscar_math import OscarError
from oscar_math.eigen import eigenbasis


def _random_cov(batch, d, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, 2 * d + 3, d, generator=g, dtype=torch.float64)
    x = x * torch.logspace(0, -2, d, dtype=torch.float64)  # decaying spectrum
    return (x.transpose(-1, -2) @ x / x.shape[-2]).to(dtype)


@settings(max_examples=30, deadline=None)
@given(
    batch=st.sampled_from([(), (1,), (3,), (2, 2)]),
    d=st.sampled_from([1, 2, 5, 16, 33, 64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_reconstructs_sorted_orthonormal(batch, d, seed):
    C = _random_cov(batch, d, seed)
    vals, U = eigenbasis(C)
    assert vals.shape == (*batch, d) and U.shape == (*batch, d, d)
    assert vals.dtype == U.dtype == torch.float64
    assert bool((vals[..., :-1] >= vals[..., 1:]).all())
    eye = torch.eye(d, dtype=torch.float64)
    assert torch.allclose(U.transpose(-1, -2) @ U, eye.expand_as(U), atol=1e-10)
    rec = U @ torch.diag_embed(vals) @ U.transpose(-1, -2)
    assert torch.allclose(rec, C, atol=1e-10 * C.abs().max().item() + 1e-14)
    # deterministic sign: largest-|entry| of each column positive
    idx = U.abs().argmax(-2, keepdim=True)
    assert bool((torch.gather(U, -2, idx) > 0).all())


def test_sign_is_deterministic_under_input_sign_flip_and_float32():
    C = _random_cov((), 24, 7)
    _, U1 = eigenbasis(C)
    # a column-flipped reconstruction gives the same basis
    vals, U = eigenbasis(C)
    flip = torch.where(torch.arange(24) % 2 == 0, 1.0, -1.0).double()
    C2 = (U * flip) @ torch.diag(vals) @ (U * flip).T
    _, U2 = eigenbasis(C2)
    assert torch.allclose(U1, U2, atol=1e-8)
    vals32, U32 = eigenbasis(C.float())
    assert U32.dtype == torch.float64 and vals32.dtype == torch.float64


def test_symmetrises_input():
    C = _random_cov((), 8, 3)
    A = torch.randn(8, 8, dtype=torch.float64) * 1e-3
    vals, U = eigenbasis(C + (A - A.T))  # antisymmetric part is dropped
    assert torch.allclose(U @ torch.diag(vals) @ U.T, C, atol=1e-12)


def test_rejects_bad_input():
    with pytest.raises(OscarError, match=r"Invalid cov: expected shape .*, got \[4, 5\]"):
        eigenbasis(torch.zeros(4, 5))
    with pytest.raises(OscarError, match="Invalid cov"):
        eigenbasis(torch.zeros(4))
    bad = torch.eye(4)
    bad[1, 2] = float("nan")
    with pytest.raises(OscarError, match="finite"):
        eigenbasis(bad)
    with pytest.raises(OscarError, match="finite"):
        eigenbasis(torch.eye(3) * float("inf"))
