import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oscar_math import OscarError
from oscar_math.hadamard import (
    HADAMARD_BASE_ORDERS,
    block_hadamard,
    hadamard_matrix,
    hadamard_matrix_int,
    is_hadamard_order,
    random_sign_hadamard,
)


@pytest.mark.parametrize("K", HADAMARD_BASE_ORDERS)
@pytest.mark.parametrize("m", [0, 1, 2, 3])
def test_integer_hadamard_is_exact(K, m):
    n = 2**m * K
    H = hadamard_matrix_int(n)
    assert H.shape == (n, n) and H.dtype == torch.int64
    assert set(H.unique().tolist()) == ({1} if n == 1 else {-1, 1})
    assert torch.equal(H @ H.T, n * torch.eye(n, dtype=torch.int64))


@pytest.mark.parametrize("n", [64, 80, 96, 112, 128, 192, 256, 40, 52, 60])
def test_normalised_hadamard_orthogonal(n):
    H = hadamard_matrix(n)
    assert H.dtype == torch.float64
    assert torch.allclose(H @ H.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.allclose(H.abs(), torch.full((n, n), n**-0.5, dtype=torch.float64))


def test_hadamard_dtype_and_known_small():
    assert torch.equal(hadamard_matrix_int(2), torch.tensor([[1, 1], [1, -1]]))
    assert hadamard_matrix(16, torch.float32).dtype == torch.float32


@pytest.mark.parametrize("n", [0, -4, 3, 6, 10, 44, 100, 136, 336])
def test_unsupported_order_names_supported(n):
    assert not is_hadamard_order(n)
    with pytest.raises(OscarError, match=r"Invalid n: expected a Hadamard order 2\^m \* K"):
        hadamard_matrix(n)


def test_order_classification():
    assert all(is_hadamard_order(n) for n in [1, 2, 12, 20, 24, 40, 80, 96, 112, 160, 208, 240])
    assert not any(is_hadamard_order(n) for n in [3, 6, 10, 44, 68, 100, 0])
    with pytest.raises(OscarError, match="Invalid n"):
        hadamard_matrix_int(12.0)


@settings(max_examples=25, deadline=None)
@given(
    n=st.sampled_from([4, 12, 20, 28, 36, 40, 52, 60, 64, 80, 96, 112, 128]),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_sign_hadamard_orthogonal_and_seeded(n, seed):
    R = random_sign_hadamard(n, seed)
    assert torch.allclose(R @ R.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.equal(R, random_sign_hadamard(n, seed))
    s = (R / hadamard_matrix(n))[:, 0]
    assert torch.allclose(s.abs(), torch.ones(n, dtype=torch.float64))


def test_random_sign_hadamard_seeds_differ():
    assert not torch.equal(random_sign_hadamard(64, 0), random_sign_hadamard(64, 1))


@pytest.mark.parametrize(("n", "block"), [(128, 32), (128, 64), (96, 32), (80, 80), (112, 16)])
def test_block_hadamard(n, block):
    B = block_hadamard(n, block)
    assert torch.allclose(B @ B.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    H = hadamard_matrix(block)
    for g in range(n // block):
        sl = slice(g * block, (g + 1) * block)
        assert torch.equal(B[sl, sl], H)
    off = B.clone()
    for g in range(n // block):
        off[g * block : (g + 1) * block, g * block : (g + 1) * block] = 0
    assert torch.count_nonzero(off) == 0


def test_block_hadamard_rejects_bad_block():
    with pytest.raises(OscarError, match="Invalid n"):
        block_hadamard(100, 32)
    with pytest.raises(OscarError, match="Invalid n: expected a Hadamard order"):
        block_hadamard(88, 44)
    with pytest.raises(OscarError, match="Invalid block"):
        block_hadamard(64, 0)
