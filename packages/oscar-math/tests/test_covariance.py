import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oscar_math import OscarError
from oscar_math.covariance import KeyMean, QueryCovariance, ScoreWeightedValueCovariance


def _randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _pool(per_head, Hkv, granularity):
    """Mean over the heads of each group (per_head [H_q, ...] are per-head means)."""
    if granularity == "layer":
        return per_head.mean(0, keepdim=True)
    return per_head.view(Hkv, -1, *per_head.shape[1:]).mean(1)


def _dense_cs(q, k, v, scaling):
    """Dense float64 reference: per query head Σ_t o_t o_tᵀ, and S² summed per key."""
    T, Hq, d = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    q, k, v = q.double(), k.double(), v.double()
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    sums, w = [], torch.zeros(T, Hkv, dtype=torch.float64)
    for h in range(Hq):
        j = h // g
        logits = (q[:, h] @ k[:, j].T * scaling).masked_fill(mask, -math.inf)
        S = torch.softmax(logits, -1)
        O = S @ v[:, j]
        assert torch.allclose(O.T @ O, v[:, j].T @ S.T @ S @ v[:, j])
        sums.append(O.T @ O)
        w[:, j] += (S * S).sum(0)
    return torch.stack(sums), w


@settings(max_examples=25, deadline=None)
@given(
    Hkv=st.integers(1, 3),
    g=st.sampled_from([1, 3]),
    d=st.sampled_from([4, 8, 12]),
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    seed=st.integers(0, 2**31 - 1),
)
def test_query_covariance_vs_brute_force(Hkv, g, d, lengths, seed):
    Hq = Hkv * g
    acc = QueryCovariance(Hq, Hkv, d)
    chunks = [_randn(T, Hq, d, seed=seed + i) for i, T in enumerate(lengths)]
    for c in chunks:
        acc.update(c)
    allq = torch.cat(chunks).double()
    N = allq.shape[0]
    if N == 0:
        with pytest.raises(OscarError, match="at least one row"):
            acc.result()
        return
    assert acc.count == N
    for gran in ("kv_head", "layer"):
        res = acc.result(gran)
        G = Hkv if gran == "kv_head" else 1
        assert res.shape == (G, d, d) and res.dtype == torch.float64
        for j in range(G):
            heads = range(j * g, (j + 1) * g) if gran == "kv_head" else range(Hq)
            rows = torch.cat([allq[:, h] for h in heads])
            assert torch.allclose(res[j], rows.T @ rows / rows.shape[0], atol=1e-12)


def test_query_covariance_merge_and_state_dict():
    q = _randn(37, 6, 16, seed=1)
    one = QueryCovariance(6, 2, 16)
    one.update(q)
    a, b = QueryCovariance(6, 2, 16), QueryCovariance(6, 2, 16)
    a.update(q[:20])
    b.update(q[20:])
    m = a.merge(b)
    assert m is not a and a.count == 20 and b.count == 17 and m.count == 37
    for gran in ("kv_head", "layer"):
        assert torch.allclose(m.result(gran), one.result(gran), atol=1e-12)
    r = QueryCovariance.from_state_dict(m.state_dict())
    assert torch.equal(r.result("layer"), m.result("layer"))
    assert all(isinstance(t, torch.Tensor) for t in m.state_dict().values())
    with pytest.raises(OscarError, match="Invalid other"):
        a.merge(QueryCovariance(6, 3, 16))
    with pytest.raises(OscarError, match="Invalid other"):
        a.merge(KeyMean(2, 16))


@pytest.mark.parametrize(
    ("T", "block", "Hkv", "g"),
    [(1, 4, 1, 1), (7, 16, 2, 1), (16, 16, 1, 3), (37, 8, 2, 3), (45, 4, 3, 3), (33, 32, 1, 1)],
)
def test_score_weighted_value_covariance_matches_dense(T, block, Hkv, g):
    d = 8
    Hq = Hkv * g
    q, k, v = _randn(T, Hq, d, seed=T), _randn(T, Hkv, d, seed=T + 1), _randn(T, Hkv, d, seed=T + 2)
    q = q * 3  # sharper softmax than the default so the scores are far from uniform
    acc = ScoreWeightedValueCovariance(Hq, Hkv, d, block_size=block)
    w = acc.update(q, k, v, return_key_weights=True)
    sums, w_ref = _dense_cs(q, k, v, 1 / math.sqrt(d))
    assert w.shape == (T, Hkv) and w.dtype == torch.float64
    assert torch.allclose(w, w_ref, atol=1e-12)
    for gran in ("kv_head", "layer"):
        assert torch.allclose(acc.result(gran), _pool(sums / T, Hkv, gran), atol=1e-12)
    assert acc.update(q, k, v) is None


def test_score_weighted_value_covariance_sequences_merge_and_scaling():
    Hq, Hkv, d = 6, 2, 8
    seqs = [
        (_randn(T, Hq, d, seed=9 * T), _randn(T, Hkv, d, seed=9 * T + 1), _randn(T, Hkv, d, seed=9 * T + 2))
        for T in (5, 19, 12)
    ]
    one = ScoreWeightedValueCovariance(Hq, Hkv, d, block_size=4)
    a, b = ScoreWeightedValueCovariance(Hq, Hkv, d, block_size=4), ScoreWeightedValueCovariance(Hq, Hkv, d, 4)
    ref = torch.zeros(Hq, d, d, dtype=torch.float64)
    for i, (q, k, v) in enumerate(seqs):
        one.update(q, k, v, scaling=0.7)
        (a if i < 2 else b).update(q, k, v, scaling=0.7)
        ref += _dense_cs(q, k, v, 0.7)[0]
    N = sum(s[0].shape[0] for s in seqs)
    m = a.merge(b)
    for gran in ("kv_head", "layer"):
        assert torch.allclose(one.result(gran), _pool(ref / N, Hkv, gran), atol=1e-12)
        assert torch.allclose(m.result(gran), one.result(gran), atol=1e-12)
    r = ScoreWeightedValueCovariance.from_state_dict(one.state_dict())
    assert r.block_size == 4 and torch.equal(r.result(), one.result())


def test_score_weighted_value_blocks_bound_memory(monkeypatch):
    """With T > block_size no T×T score tensor is ever formed."""
    T, block = 64, 8
    seen = []
    real_softmax = torch.softmax

    def spy(x, dim):
        seen.append(tuple(x.shape))
        return real_softmax(x, dim=dim)

    monkeypatch.setattr(torch, "softmax", spy)
    acc = ScoreWeightedValueCovariance(2, 1, 4, block_size=block)
    acc.update(_randn(T, 2, 4, seed=0), _randn(T, 1, 4, seed=1), _randn(T, 1, 4, seed=2))
    assert len(seen) == T // block
    assert all(s[-2] <= block for s in seen)


def test_key_mean():
    k1, k2 = _randn(11, 3, 8, seed=0) + 2.0, _randn(5, 3, 8, seed=1)
    km = KeyMean(3, 8)
    km.update(k1)
    km.update(k2.to(torch.bfloat16))
    allk = torch.cat([k1.double(), k2.to(torch.bfloat16).double()])
    assert km.result("kv_head").shape == (3, 8)
    assert torch.allclose(km.result("kv_head"), allk.mean(0), atol=1e-12)
    assert torch.allclose(km.result("layer"), allk.reshape(-1, 8).mean(0, keepdim=True), atol=1e-12)
    a, b = KeyMean(3, 8), KeyMean(3, 8)
    a.update(k1)
    b.update(k2.to(torch.bfloat16))
    assert torch.allclose(a.merge(b).result(), km.result(), atol=1e-12)
    assert torch.equal(KeyMean.from_state_dict(km.state_dict()).result(), km.result())


def test_validation_messages():
    qc = QueryCovariance(6, 2, 16)
    with pytest.raises(OscarError, match=r"Invalid shape of q: expected \[T, 6, 16\], got \[4, 4, 16\]"):
        qc.update(torch.zeros(4, 4, 16))
    with pytest.raises(OscarError, match=r"Invalid shape of q: expected \[T, 6, 16\], got \[6, 16\]"):
        qc.update(torch.zeros(6, 16))
    with pytest.raises(OscarError, match="Invalid q: expected finite"):
        qc.update(torch.full((2, 6, 16), float("nan")))
    with pytest.raises(OscarError, match="Invalid granularity"):
        qc.update(torch.ones(2, 6, 16)) or qc.result("head")
    with pytest.raises(OscarError, match="Invalid num_q_heads: expected a multiple of num_kv_heads=4"):
        QueryCovariance(6, 4, 16)
    sv = ScoreWeightedValueCovariance(6, 2, 16)
    q, kv = torch.zeros(5, 6, 16), torch.zeros(5, 2, 16)
    with pytest.raises(OscarError, match=r"Invalid shape of k: expected \[5, 2, 16\], got \[4, 2, 16\]"):
        sv.update(q, kv[:4], kv)
    with pytest.raises(OscarError, match=r"Invalid shape of v: expected \[5, 2, 16\], got \[5, 6, 16\]"):
        sv.update(q, kv, q)
    with pytest.raises(OscarError, match="Invalid scaling"):
        sv.update(q, kv, kv, scaling=-1.0)
    with pytest.raises(OscarError, match="Invalid block_size"):
        ScoreWeightedValueCovariance(6, 2, 16, block_size=0)
    with pytest.raises(OscarError, match=r"Invalid shape of k: expected \[T, 2, 16\], got \[3, 2, 8\]"):
        KeyMean(2, 16).update(torch.zeros(3, 2, 8))
    with pytest.raises(OscarError, match="Invalid KeyMean: expected at least one row"):
        KeyMean(2, 16).result()
    bad = qc.state_dict()
    bad["sum"] = bad["sum"][:1]
    with pytest.raises(OscarError, match=r"Invalid shape of state\['sum'\]"):
        QueryCovariance.from_state_dict(bad)
    with pytest.raises(OscarError, match="Invalid state: expected keys"):
        QueryCovariance.from_state_dict({"sum": bad["sum"]})


def test_score_weighted_float32_compute_matches_float64():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(300, h, 32, generator=g) for h in (6, 2, 2))
    ref = ScoreWeightedValueCovariance(6, 2, 32, block_size=64)
    fast = ScoreWeightedValueCovariance(6, 2, 32, block_size=64, compute_dtype=torch.float32)
    w_ref = ref.update(q, k, v, return_key_weights=True)
    w_fast = fast.update(q, k, v, return_key_weights=True)
    r, f = ref.result("kv_head"), fast.result("kv_head")
    assert f.dtype == torch.float64
    assert ((f - r).norm() / r.norm()).item() < 1e-5
    assert ((w_fast - w_ref).norm() / w_ref.norm()).item() < 1e-5


def test_score_weighted_rejects_bad_compute_dtype():
    with pytest.raises(OscarError, match="compute_dtype"):
        ScoreWeightedValueCovariance(2, 1, 8, compute_dtype=torch.float16)


@pytest.mark.parametrize("kernel", ["cpu-flash", "fallback"])
@pytest.mark.parametrize(
    ("T", "block", "Hkv", "g"), [(1, 4, 1, 1), (37, 8, 2, 3), (45, 16, 3, 3), (64, 64, 1, 1)]
)
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.float64])
def test_fused_update_matches_dense_at_sampled_keys(monkeypatch, kernel, T, block, Hkv, g, compute_dtype):
    from oscar_math import covariance

    if kernel == "fallback":  # the GPU path: sdpa outputs + blockwise log-sum-exp
        monkeypatch.setattr(covariance, "_cpu_flash_kernel", lambda: None)
    elif covariance._cpu_flash_kernel() is None:
        pytest.skip("this torch has no CPU flash-attention op")
    d, Hq = 8, Hkv * g
    q, k, v = _randn(T, Hq, d, seed=T), _randn(T, Hkv, d, seed=T + 1), _randn(T, Hkv, d, seed=T + 2)
    q = q * 3
    positions = torch.randperm(T, generator=torch.Generator().manual_seed(T))[: max(1, T // 3)].sort().values
    acc = ScoreWeightedValueCovariance(Hq, Hkv, d, block_size=block, compute_dtype=compute_dtype)
    w = acc.update_fused(q, k, v, 0.6, key_positions=positions)
    sums, w_ref = _dense_cs(q, k, v, 0.6)
    tol = 1e-12 if compute_dtype == torch.float64 else 2e-5
    assert w.shape == (positions.numel(), Hkv) and w.dtype == torch.float64
    torch.testing.assert_close(w, w_ref[positions], atol=tol, rtol=tol)
    for gran in ("kv_head", "layer"):
        torch.testing.assert_close(acc.result(gran), _pool(sums / T, Hkv, gran), atol=tol, rtol=tol)
    assert acc.update_fused(q, k, v, 0.6) is None and acc.count == 2 * T


def test_fused_update_equals_update_and_validates():
    Hq, Hkv, d, T = 6, 2, 16, 40
    q, k, v = _randn(T, Hq, d, seed=1), _randn(T, Hkv, d, seed=2), _randn(T, Hkv, d, seed=3)
    ref, fused = ScoreWeightedValueCovariance(Hq, Hkv, d, 8), ScoreWeightedValueCovariance(Hq, Hkv, d, 8)
    w_all = ref.update(q, k, v, return_key_weights=True)
    pos = torch.tensor([0, 5, 39])
    torch.testing.assert_close(fused.update_fused(q, k, v, key_positions=pos), w_all[pos], atol=1e-12, rtol=0)
    torch.testing.assert_close(fused.result(), ref.result(), atol=1e-12, rtol=0)
    with pytest.raises(OscarError, match="key_positions"):
        fused.update_fused(q, k, v, key_positions=torch.tensor([T]))
    with pytest.raises(OscarError, match="shape of v"):
        fused.update_fused(q, k, v[:-1])
