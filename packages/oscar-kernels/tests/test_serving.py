"""oscar_kernels.serving: what every engine integration takes from an artifact (vLLM, SGLang)."""

from __future__ import annotations

import pytest
import torch

from oscar_kernels import CacheLayout, LayerQuantParams, page_bytes
from oscar_kernels.serving import (
    PER_HEAD_FIELDS,
    SHARED_FIELDS,
    cell_bytes,
    check_head_dim,
    kv_heads_of_rank,
    load_for_serving,
    rank_layout,
    shard_params,
)
from oscar_math.artifact import identity_rotations, save_rotations
from oscar_math.errors import OscarError


def test_check_head_dim():
    check_head_dim(32)  # the interpreter and the torch references serve it
    with pytest.raises(OscarError, match="head dim 32 on a GPU"):
        check_head_dim(32, on_gpu=True)
    check_head_dim(64, on_gpu=True)
    for d in (16, 64, 128, 256):
        check_head_dim(d)
    for d in (8, 72, 100):
        with pytest.raises(OscarError, match=f"head dim {d}"):
            check_head_dim(d)


def test_kv_heads_of_rank():
    assert kv_heads_of_rank(8, 1, 0) == list(range(8))
    assert kv_heads_of_rank(8, 2, 1) == [4, 5, 6, 7]
    assert kv_heads_of_rank(8, 4, 2) == [4, 5]
    # fewer KV heads than ranks: vLLM replicates, rank r holds head r // (tp / kv)
    assert [kv_heads_of_rank(2, 4, r) for r in range(4)] == [[0], [0], [1], [1]]
    with pytest.raises(OscarError):
        kv_heads_of_rank(6, 4, 0)
    with pytest.raises(OscarError):
        kv_heads_of_rank(8, 2, 2)


def test_shard_params_takes_each_ranks_heads():
    h, d = 4, 16
    g = torch.Generator().manual_seed(0)
    rots = torch.linalg.qr(torch.randn(h, d, d, generator=g))[0]
    params = LayerQuantParams(
        rots, rots.flip(0), k_mean=torch.randn(h, d, generator=g), k_clip=torch.tensor([0.9, 0.8, 0.7, 0.6])
    )
    part = shard_params(params, kv_heads_of_rank(h, 2, 1))
    assert torch.equal(part.k_rotation, rots[2:]) and torch.equal(part.v_rotation, rots.flip(0)[2:])
    assert torch.equal(part.k_mean, params.k_mean[2:])
    assert torch.allclose(part.k_clip, torch.tensor([0.7, 0.6]))
    assert part.v_clip == 1.0
    part.expand(2, d, torch.device("cpu"))  # a valid per-rank parameter set
    layer = LayerQuantParams(rots[0], rots[1])  # one rotation per layer: every rank the same
    assert shard_params(layer, [3]) is layer


def test_shard_params_takes_each_ranks_feedback_and_keeps_shared_values():
    # format version 2: the error-feedback matrices are per KV head like the rotations; a rank
    # that kept all heads' matrices (or none) would serve other codes than `oscar eval` measured
    h, d = 4, 16
    g = torch.Generator().manual_seed(1)
    rots = torch.linalg.qr(torch.randn(h, d, d, generator=g))[0]
    fb = torch.tril(torch.randn(h, d, d, generator=g), diagonal=-1)
    mean = torch.randn(d, generator=g)  # one mean shared by every head: not a per-head row
    params = LayerQuantParams(rots, rots, k_mean=mean, k_feedback=fb, v_feedback=fb.flip(0))
    part = shard_params(params, kv_heads_of_rank(h, 4, 2))
    assert torch.equal(part.k_feedback, fb[2:3]) and torch.equal(part.v_feedback, fb.flip(0)[2:3])
    assert torch.equal(part.k_mean, mean)
    part.expand(1, d, torch.device("cpu"))


def test_shard_params_takes_each_ranks_rope_mean_and_keeps_the_frequencies():
    # format version 3: the pre-RoPE key mean is per KV head like k_mean; the RoPE frequencies
    # are the model's, [d/2], shared — indexing them by head would corrupt them silently
    h, d = 4, 16
    g = torch.Generator().manual_seed(2)
    rots = torch.linalg.qr(torch.randn(h, d, d, generator=g))[0]
    rm = torch.randn(h, d, generator=g)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)  # [8], longer than the rank's 1 head
    params = LayerQuantParams(rots, rots, k_rope_mean=rm, k_rope_inv_freq=inv_freq)
    part = shard_params(params, kv_heads_of_rank(h, 4, 1))
    assert torch.equal(part.k_rope_mean, rm[1:2]) and torch.equal(part.k_rope_inv_freq, inv_freq)
    ep = part.expand(1, d, torch.device("cpu"))
    assert torch.equal(ep.k_rope_mean, rm[1:2]) and ep.rope_pairs == d // 2


def test_cell_bytes_equal_kernel_page_bytes():
    for h, d, group, page in ((3, 64, 64, 16), (8, 128, 128, 128), (2, 128, 32, 64)):
        lo = CacheLayout(num_kv_heads=h, head_dim=d, page_size=page, group_size=group)
        assert h * page * cell_bytes(d, group) == page_bytes(lo)
    assert cell_bytes(64, 64) * 1.0 / (2 * 64 * 2) < 1 / 6  # vs BF16 K+V: 6.4x smaller


def test_every_parameter_field_has_a_sharding_rule():
    """A field added to LayerQuantParams without a row in the table is refused at start-up (never
    dropped or served unsharded); today's fields all have one."""
    from dataclasses import dataclass, fields

    names = {f.name for f in fields(LayerQuantParams)}
    assert names == PER_HEAD_FIELDS.keys() | SHARED_FIELDS

    @dataclass(frozen=True)
    class Newer(LayerQuantParams):
        v_mean: torch.Tensor | None = None

    rots = torch.eye(16).expand(2, 16, 16).clone()
    with pytest.raises(OscarError, match=r"cannot shard the layer parameters \['v_mean'\]"):
        shard_params(Newer(rots, rots), [1])


def test_load_for_serving_checks_the_geometry_and_gives_the_artifacts_windows(tmp_path):
    rot = identity_rotations("tiny", 2, 4, 32, granularity="kv_head", sink_tokens=8, recent_tokens=24)
    path = str(save_rotations(tmp_path / "a.safetensors", rot))
    got = load_for_serving(path, 2, 4, 32)
    assert load_for_serving(path, 2, 4, 32) is got  # once per process
    lo = rank_layout(got, len(kv_heads_of_rank(4, 2, 1)), 32, page_size=16)
    assert (lo.num_kv_heads, lo.sink_tokens, lo.recent_tokens, lo.group) == (2, 8, 24, got.group_size)
    with pytest.raises(OscarError, match="num_kv_heads mismatch"):
        load_for_serving(path, 2, 8, 32)
    with pytest.raises(OscarError, match="unsupported head dim 40"):
        load_for_serving(path, 2, 4, 40)
    with pytest.raises(OscarError, match="MLA"):
        check_head_dim(64, 128)
