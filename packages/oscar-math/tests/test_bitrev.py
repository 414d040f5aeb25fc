import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oscar_math import OscarError
from oscar_math.bitrev import (
    bit_reversal_permutation,
    bit_reverse,
    inverse_permutation,
    permutation_matrix,
)


@settings(max_examples=60, deadline=None)
@given(n_groups=st.integers(1, 12), group_size=st.integers(1, 40))
def test_permutation_and_balanced(n_groups, group_size):
    d = n_groups * group_size
    perm = bit_reversal_permutation(d, group_size)
    assert perm.dtype == torch.int64 and perm.shape == (d,)
    assert torch.equal(torch.sort(perm).values, torch.arange(d))
    groups = perm.view(n_groups, group_size)
    # each group gets exactly one direction of each consecutive block of n_groups
    blocks = groups // n_groups
    for g in range(n_groups):
        assert torch.equal(torch.sort(blocks[g]).values, torch.arange(group_size))
    # slots are ordered by importance inside each group
    assert torch.equal(blocks, torch.arange(group_size).expand(n_groups, -1))


@pytest.mark.parametrize("d", [64, 80, 96, 128])
def test_group_equals_d_is_identity(d):
    assert torch.equal(bit_reversal_permutation(d, d), torch.arange(d))


def test_bit_reversal_layout_d128_g32():
    perm = bit_reversal_permutation(128, 32)
    groups = perm.view(4, 32)
    # leading directions 0,1,2,3 go to groups bitrev2 = 0,2,1,3
    assert groups[:, 0].tolist() == [0, 2, 1, 3]
    assert groups[0, :3].tolist() == [0, 4, 8]
    # matches the full 7-bit reversal up to the slot order inside each group
    full = torch.tensor([bit_reverse(i, 7) for i in range(128)])
    full_group = full // 32
    for i in range(128):
        assert (perm == i).nonzero().item() // 32 == full_group[i].item()


def test_round_robin_when_not_power_of_two():
    perm = bit_reversal_permutation(96, 32)  # 3 groups
    assert perm.view(3, 32)[:, 0].tolist() == [0, 1, 2]
    assert perm.view(3, 32)[1, :3].tolist() == [1, 4, 7]


@settings(max_examples=30, deadline=None)
@given(n_groups=st.sampled_from([1, 2, 3, 4, 8]), group_size=st.integers(1, 16), seed=st.integers(0, 999))
def test_permutation_matrix_convention(n_groups, group_size, seed):
    d = n_groups * group_size
    perm = bit_reversal_permutation(d, group_size)
    P = permutation_matrix(perm)
    x = torch.randn(3, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(x @ P, x[..., perm])
    assert torch.equal(P @ P.T, torch.eye(d, dtype=torch.float64))
    assert torch.equal(x[..., perm][..., inverse_permutation(perm)], x)


def test_rejects_bad_input():
    with pytest.raises(OscarError, match="Invalid group_size: expected a positive divisor of d=128, got 48"):
        bit_reversal_permutation(128, 48)
    with pytest.raises(OscarError, match="Invalid d"):
        bit_reversal_permutation(0, 1)
    with pytest.raises(OscarError, match="Invalid perm"):
        permutation_matrix(torch.tensor([0, 0, 1]))
