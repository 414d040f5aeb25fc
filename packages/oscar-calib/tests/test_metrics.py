"""Metrics on known distributions, summaries with spreads."""

from __future__ import annotations

import math

import pytest
import torch

from oscar_calib.metrics import compare_logits, sequence_metrics, summarize


def test_compare_logits_known_values():
    ref = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.7, 0.2]]))
    cur = torch.log(torch.tensor([[0.25, 0.5, 0.25], [0.1, 0.7, 0.2]]))
    nll, kl, agree = compare_logits(ref, cur, torch.tensor([1, 2]))
    assert nll.tolist() == pytest.approx([-math.log(0.5), -math.log(0.2)])
    assert kl[0].item() == pytest.approx(0.5 * math.log(2) + 0.25 * math.log(0.5))
    assert kl[1].item() == pytest.approx(0.0, abs=1e-12)
    assert agree.tolist() == [False, True]


def test_kl_is_nonnegative_and_zero_only_for_equal():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(37, 11, generator=g), torch.randn(37, 11, generator=g)
    _, kl, _ = compare_logits(a, b, torch.zeros(37, dtype=torch.long))
    assert (kl > 0).all()
    _, kl0, agree = compare_logits(a, a + 3.0, torch.zeros(37, dtype=torch.long))  # shift-invariant
    assert kl0.abs().max() < 1e-9 and agree.all()


def test_summarize_mean_std_ci():
    s = summarize([1.0, 2.0, 3.0, 4.0], seed=1)
    assert s.mean == pytest.approx(2.5) and s.std == pytest.approx(1.2909944, rel=1e-6) and s.n == 4
    assert 1.0 <= s.ci_low < s.mean < s.ci_high <= 4.0
    assert summarize([1.0, 2.0, 3.0, 4.0], seed=1) == s  # seeded
    one = summarize([7.0])
    assert (one.mean, one.std, one.ci_low, one.ci_high) == (7.0, 0.0, 7.0, 7.0)
    assert "±" in s.fmt() and s.fmt(pct=True).endswith("%")


class _Model:
    def __init__(self):
        torch.manual_seed(0)
        self.head = torch.nn.Linear(4, 9, bias=False).to(torch.bfloat16)

    def get_output_embeddings(self):
        return self.head


def test_sequence_metrics_chunking_and_reference():
    m = _Model()
    h = torch.randn(23, 4).to(torch.bfloat16)
    ids = torch.randint(0, 9, (23,))
    ref = sequence_metrics(m, h, h, ids, chunk=5)
    assert ref.kl == 0 and ref.top1 == 1 and ref.tokens == 22
    with torch.no_grad():
        lp = torch.log_softmax(h[:-1].double() @ m.head.weight.double().T, -1)  # fp32 head on bf16 weights
    assert ref.nll == pytest.approx(float(-lp.gather(-1, ids[1:, None]).mean()), rel=1e-5)
    other = sequence_metrics(m, h, h + 0.5 * torch.randn(23, 4).to(torch.bfloat16), ids, chunk=7)
    assert other.kl > 0 and 0 <= other.top1 < 1 and other.perplexity == pytest.approx(math.exp(other.nll))


def test_compare_logits_matches_the_explicit_formulas():
    # the KL/NLL are computed from logsumexp and Σ p·x; check them against log-softmax written out
    g = torch.Generator().manual_seed(4)
    ref, cur = 6 * torch.randn(19, 3001, generator=g), 6 * torch.randn(19, 3001, generator=g)
    cur[:4] = ref[:4] + 0.01 * torch.randn(4, 3001, generator=g)  # small KLs too, where cancellation bites
    targets = torch.randint(0, 3001, (19,), generator=g)
    lp_ref, lp = torch.log_softmax(ref.double(), -1), torch.log_softmax(cur.double(), -1)
    nll, kl, agree = compare_logits(ref, cur, targets)
    torch.testing.assert_close(nll, -lp.gather(-1, targets[:, None]).squeeze(-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kl, (lp_ref.exp() * (lp_ref - lp)).sum(-1), rtol=1e-9, atol=1e-12)
    assert (kl[:4] < 1e-3).all() and (kl[4:] > 1).all()
    assert agree.tolist() == (ref.argmax(-1) == cur.argmax(-1)).tolist()
