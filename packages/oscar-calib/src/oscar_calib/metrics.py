"""Next-token metrics of a quantised KV cache against the unquantised model.

Per sequence (positions ``0 .. T-2`` predict tokens ``1 .. T-1``):

* perplexity ``exp(mean NLL)``;
* mean ``KL(P_ref ‖ P_scheme)`` of the next-token distributions (nats);
* top-1 agreement: fraction of positions where both argmaxes agree.

Across sequences every number comes with its spread: :class:`Summary` holds the
mean, the sample standard deviation and a seeded bootstrap 95% confidence interval
of the per-sequence values. Rankings between 2-bit schemes can flip on one short
sequence; paired statistics (the same sequences for every scheme, e.g. the
relative perplexity increase over BF16 per sequence) are tighter than unpaired ones.

Logits are never materialised for a whole sequence at once: the decoder's final
hidden states are kept and the LM head is applied in row chunks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from oscar_math import check

__all__ = [
    "Summary",
    "summarize",
    "SequenceMetrics",
    "compare_logits",
    "final_hidden",
    "sequence_metrics",
    "sequences_metrics",
]


@dataclass(frozen=True)
class Summary:
    """Mean and spread of per-sequence values.

    Attributes:
        mean: arithmetic mean.
        std: sample standard deviation (0 for one value).
        ci_low, ci_high: bootstrap 95% CI of the mean (percentile, seeded).
        n: number of sequences.
    """

    mean: float
    std: float
    ci_low: float
    ci_high: float
    n: int

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def fmt(self, digits: int = 3, pct: bool = False) -> str:
        """``mean ± std`` (percent if ``pct``)."""
        k = 100.0 if pct else 1.0
        unit = "%" if pct else ""
        return f"{self.mean * k:.{digits}f} ± {self.std * k:.{digits}f}{unit}"


def summarize(values: Sequence[float], seed: int = 0, resamples: int = 2000) -> Summary:
    """Mean, std and bootstrap 95% CI of ``values`` (one value per sequence)."""
    x = torch.tensor([float(v) for v in values], dtype=torch.float64)
    check(x.numel() >= 1, "values", "at least one value", x.numel())
    n = x.numel()
    mean = float(x.mean())
    std = float(x.std(unbiased=True)) if n > 1 else 0.0
    if n == 1:
        return Summary(mean, 0.0, mean, mean, 1)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (resamples, n), generator=g)
    means = x[idx].mean(1)
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return Summary(mean, std, float(lo), float(hi), n)


@dataclass(frozen=True)
class SequenceMetrics:
    """Metrics of one sequence.

    Attributes:
        nll: mean negative log-likelihood (nats/token).
        kl: mean KL(reference ‖ scheme) in nats (0 for the reference itself).
        top1: fraction of positions whose argmax equals the reference's.
        tokens: positions scored.
    """

    nll: float
    kl: float
    top1: float
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


def compare_logits(
    ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position NLL, KL(ref ‖ scheme) and top-1 agreement.

    Args:
        ref_logits, logits: ``[N, V]``.
        targets: ``[N]`` next tokens.
    Returns:
        ``(nll [N], kl [N], agree [N] bool)`` float64 / bool.
    """
    check(ref_logits.shape == logits.shape, "logits.shape", tuple(ref_logits.shape), tuple(logits.shape))
    return _compare(_Reference.of(ref_logits), logits, targets)


@dataclass(frozen=True)
class _Reference:
    """What every comparison with one chunk of reference logits ``[N, V]`` needs, computed
    once per chunk instead of once per scheme: probabilities ``p`` and ``Σ p·log p`` (float64),
    and the argmax."""

    p: torch.Tensor
    p_log_p: torch.Tensor
    argmax: torch.Tensor

    @staticmethod
    def of(ref_logits: torch.Tensor) -> _Reference:
        lp = torch.log_softmax(ref_logits.double(), -1)
        p = lp.exp()
        return _Reference(p, _rowdot(p, lp), ref_logits.argmax(-1))


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` for ``[N, V]`` rows as a batched matmul: no ``[N, V]`` temporary."""
    return torch.bmm(a[:, None, :], b[:, :, None]).reshape(-1)


def _compare(
    ref: _Reference, logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`compare_logits` against a precomputed reference. With ``lse = logsumexp(x)``,
    ``log q = x − lse`` and ``Σ p = 1``: ``NLL = lse − x[target]`` and
    ``KL = Σ p log p − Σ p·x + lse``; one float64 pass over the logits instead of a full
    log-softmax and three more ``[N, V]`` passes."""
    x = logits.double()
    lse = torch.logsumexp(x, -1)
    nll = lse - x.gather(-1, targets.long()[:, None]).squeeze(-1)
    kl = (ref.p_log_p - _rowdot(ref.p, x) + lse).clamp_min(0.0)
    agree = ref.argmax == logits.argmax(-1)
    return nll, kl, agree


def final_hidden(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """Final (normed) hidden states ``[B, T, hidden]`` of a causal LM, without the LM head."""
    with torch.no_grad():
        out = model.get_decoder()(input_ids=input_ids, use_cache=False)
    return out.last_hidden_state


def _fp32_head(model: Any) -> Any:
    """The LM head applied in float32 (bf16 logits would be too coarse for KL and NLL)."""
    head = model.get_output_embeddings()
    weight = head.weight.float()
    bias = None if getattr(head, "bias", None) is None else head.bias.float()

    def apply(h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h.float(), weight, bias)

    return apply


def sequence_metrics(
    model: Any, ref_hidden: torch.Tensor, hidden: torch.Tensor, input_ids: torch.Tensor, chunk: int = 512
) -> SequenceMetrics:
    """Metrics of one sequence from final hidden states (LM head applied in chunks).

    Args:
        model: the causal LM (``get_output_embeddings()`` is its LM head).
        ref_hidden, hidden: ``[T, hidden]`` reference and scheme hidden states.
        input_ids: ``[T]`` the tokens.
    """
    return sequences_metrics(model, ref_hidden, {"x": hidden}, input_ids, chunk)["x"]


def sequences_metrics(
    model: Any,
    ref_hidden: torch.Tensor,
    hiddens: dict[str, torch.Tensor],
    input_ids: torch.Tensor,
    chunk: int = 512,
) -> dict[str, SequenceMetrics]:
    """:func:`sequence_metrics` for several schemes at once (reference logits computed once per chunk).

    Args:
        ref_hidden: ``[T, hidden]``; hiddens: ``{name: [T, hidden]}``; input_ids: ``[T]``.
    """
    head = _fp32_head(model)
    t = input_ids.shape[0]
    sums = {name: [0.0, 0.0, 0] for name in hiddens}
    with torch.no_grad():
        for a in range(0, t - 1, chunk):
            b = min(t - 1, a + chunk)
            ref = head(ref_hidden[a:b])
            stats = _Reference.of(ref)
            for name, hidden in hiddens.items():
                if hidden is ref_hidden:  # the reference itself: KL 0 and agreement 1 exactly
                    nll, _, agree = _compare(stats, ref, input_ids[a + 1 : b + 1])
                    kl = torch.zeros_like(nll)
                else:
                    nll, kl, agree = _compare(stats, head(hidden[a:b]), input_ids[a + 1 : b + 1])
                acc = sums[name]
                acc[0] += float(nll.sum())
                acc[1] += float(kl.sum())
                acc[2] += int(agree.sum())
    n = t - 1
    return {name: SequenceMetrics(v[0] / n, v[1] / n, v[2] / n, n) for name, v in sums.items()}
