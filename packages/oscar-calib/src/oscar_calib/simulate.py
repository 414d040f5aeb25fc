"""Serving semantics of a quantised KV cache, simulated inside the attention call.

For a query at absolute position ``t`` and a key/value at position ``s <= t``, the
cache serves the quantised ``k_hat`` / ``v_hat`` when ``sink <= s <= t - recent``
(outside the first ``sink`` tokens and outside the last ``recent`` tokens up to and
including ``t``) and the exact ones otherwise. This is what a token-by-token decode
sees: tokens leave the recent window into INT2 as the sequence grows. Every query
row gets its own window, so one forward pass over a sequence measures the decode
quality at every position at once.

The mixed attention is one SDPA call over the exact keys followed by the quantised
copies of the quantisable ones, with a boolean mask that lets each query see exactly
one copy of every key. When errors are captured it is computed in blocks of query
rows instead (memory ``O(block · S · H_q)``), selecting per ``(t, s)`` between the
exact and the quantised logits, and ``out = P @ V + (P ⊙ M) @ (V_hat − V)``.

Optional statistics per layer (on the quantised region only):

* logit error ``‖L_hat − L‖ / ‖L‖`` with each query's mean over the region removed
  from both (softmax ignores a per-query constant, e.g. the one key centering adds);
* output error ``‖O_hat − O‖ / ‖O‖`` over query rows that read at least one
  quantised token, where ``O`` is the exact attention output of the same layer
  inputs (a local error, not the error accumulated through earlier layers).

Both are measured on every ``error_row_stride``-th query row (8 by default).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from oscar_math import DEFAULT_RECENT, DEFAULT_SINK, check, int2_mask

from .schemes import KVScheme

# SDPA reads grouped KV heads itself from torch 2.5 on (``enable_gqa``)
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)

__all__ = [
    "Windows",
    "LayerErrors",
    "quantized_region",
    "mixed_attention",
    "exact_attention",
    "SimulatedAttention",
    "simulate",
]


@dataclass(frozen=True)
class Windows:
    """BF16 windows of the serving layout.

    Attributes:
        sink: first tokens kept exact.
        recent: last tokens (up to and including the query's own) kept exact.
        prefill_chunk: 1 (default): the per-query rule, which the kernels and both engine
            plugins apply in prefill and decode alike. ``C > 1``: the chunk-granular rule
            of an engine that prefills in chunks of ``C`` tokens and lets every query of a
            chunk read the window as it stands *after* the chunk (the chunk's own keys
            exact) — what ``OscarCache`` does for one multi-token ``update`` and what
            ``extend_attention`` did before 2026-12-01.
    """

    sink: int = DEFAULT_SINK
    recent: int = DEFAULT_RECENT
    prefill_chunk: int = 1

    def __post_init__(self) -> None:
        check(isinstance(self.sink, int) and self.sink >= 0, "sink", "an integer >= 0", self.sink)
        check(isinstance(self.recent, int) and self.recent >= 1, "recent", "an integer >= 1", self.recent)
        check(
            isinstance(self.prefill_chunk, int) and self.prefill_chunk >= 1,
            "prefill_chunk",
            "an integer >= 1",
            self.prefill_chunk,
        )


@dataclass
class LayerErrors:
    """Running sums of squared errors for one layer (see module docstring)."""

    logit_err: float = 0.0
    logit_ref: float = 0.0
    out_err: float = 0.0
    out_ref: float = 0.0
    rows: int = 0

    @property
    def logit_rel(self) -> float:
        return (self.logit_err / self.logit_ref) ** 0.5 if self.logit_ref > 0 else float("nan")

    @property
    def output_rel(self) -> float:
        return (self.out_err / self.out_ref) ** 0.5 if self.out_ref > 0 else float("nan")


def quantized_region(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    sink: int,
    recent: int,
    chunk: int = 1,
    seq_len: int | None = None,
) -> torch.Tensor:
    """``[T, S]`` bool: True where query ``q_pos[t]`` reads key ``k_pos[s]`` quantised.

    ``(k_pos >= sink) & (k_pos <= q_pos - recent)``; causality is not part of it
    (``s <= t - recent < t`` anyway for ``recent >= 1``). With ``chunk > 1`` (chunked
    prefill) the query's position is replaced by the last position of its chunk
    ``[c·chunk, min((c+1)·chunk, seq_len))`` and keys of its own chunk stay exact.
    """
    if chunk == 1:
        return int2_mask(q_pos, k_pos, sink, recent)
    start = torch.div(q_pos, chunk, rounding_mode="floor") * chunk
    end = start + chunk - 1
    if seq_len is not None:
        end = end.clamp(max=seq_len - 1)
    return int2_mask(end, k_pos, sink, recent) & (k_pos[None, :] < start[:, None])


def _expand_kv(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """``[B, H_kv, S, d]`` → ``[B, H_q, S, d]`` (query head h reads KV head ``h // g``)."""
    g = num_q_heads // x.shape[1]
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _apply_user_mask(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return logits
    if mask.dtype == torch.bool:
        return logits.masked_fill(~mask, float("-inf"))
    return logits + mask.to(logits.dtype)


def exact_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention with queries at the END of the key sequence.

    Args:
        query: ``[B, H_q, T, d]``; key, value: ``[B, H_kv, S, d]`` with ``S >= T``.
        attention_mask: optional 4-D ``[B, 1|H_q, T, S]`` mask (bool or additive).
    Returns:
        ``[B, T, H_q, d]``.
    """
    hq, t, s = query.shape[1], query.shape[2], key.shape[2]
    k, v = _expand_kv(key, hq), _expand_kv(value, hq)
    if attention_mask is not None and attention_mask.dim() == 4:
        mask = attention_mask[..., :t, :s]
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)
    elif t == s:
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)
    else:
        q_pos = torch.arange(s - t, s, device=query.device)
        causal = torch.arange(s, device=query.device)[None, :] <= q_pos[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=causal, scale=scaling)
    return out.transpose(1, 2).contiguous()


def mixed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_hat: torch.Tensor,
    value_hat: torch.Tensor,
    scaling: float,
    windows: Windows,
    attention_mask: torch.Tensor | None = None,
    block: int = 256,
    errors: LayerErrors | None = None,
    error_row_stride: int = 1,
) -> torch.Tensor:
    """Causal attention reading quantised K/V inside the quantised region, exact elsewhere.

    Args:
        query: ``[B, H_q, T, d]`` (post-RoPE), at absolute positions ``S-T .. S-1``.
        key, value: ``[B, H_kv, S, d]`` exact.
        key_hat, value_hat: ``[B, H_kv, S, d]`` quantised (same basis as ``key``/``value``).
        scaling: softmax scale.
        windows: sink / recent sizes.
        attention_mask: optional 4-D mask ``[B, 1|H_q, T, S]`` (bool True = attend, or additive).
        block: query rows per block.
        errors: if given, accumulates the logit / output error sums of this call.
        error_row_stride: measure the errors on every n-th query row only (the output
            is still computed for every row); 1 measures all rows.
    Returns:
        ``[B, T, H_q, d]`` in ``query.dtype``.
    """
    b, hq, t, d = query.shape
    s = key.shape[2]
    check(s >= t, "key length", f">= query length {t}", s)
    check(error_row_stride >= 1, "error_row_stride", "an integer >= 1", error_row_stride)
    if errors is None or error_row_stride > 1:
        out = _mixed_sdpa(query, key, value, key_hat, value_hat, scaling, windows, attention_mask, block)
        if errors is None:
            return out
    else:
        out = torch.empty(b, t, hq, d, dtype=query.dtype, device=query.device)
    dev = query.device
    k, v = _expand_kv(key, hq).float(), _expand_kv(value, hq).float()
    kh, dv = _expand_kv(key_hat, hq).float(), (_expand_kv(value_hat, hq).float() - v)
    k_pos_all = torch.arange(s, device=dev)
    rows_all = torch.arange(0, t, error_row_stride, device=dev)
    for r0 in range(0, rows_all.numel(), block):
        rows = rows_all[r0 : r0 + block]
        q_pos = s - t + rows
        s_end = int(q_pos[-1]) + 1  # causal: later keys are never read by these rows
        k_pos = k_pos_all[:s_end]
        qb = query[:, :, rows].float()
        logits = torch.matmul(qb, k[:, :, :s_end].transpose(-1, -2)) * scaling
        quant = quantized_region(
            q_pos, k_pos, windows.sink, windows.recent, windows.prefill_chunk, s
        )  # [tb, s_end]
        causal = k_pos[None, :] <= q_pos[:, None]
        user = None
        if attention_mask is not None and attention_mask.dim() == 4:
            user = (
                attention_mask[:, :, rows, :s_end]
                if attention_mask.shape[2] > 1
                else attention_mask[..., :s_end]
            )
        if bool(quant.any()):
            logits_hat = torch.matmul(qb, kh[:, :, :s_end].transpose(-1, -2)) * scaling
            mixed = torch.where(quant, logits_hat, logits)
        else:
            logits_hat, mixed = logits, logits
        mixed = _apply_user_mask(mixed.masked_fill(~causal, float("-inf")), user)
        p = torch.softmax(mixed, dim=-1)
        ob = torch.matmul(p, v[:, :, :s_end])
        if bool(quant.any()):
            ob = ob + torch.matmul(p * quant, dv[:, :, :s_end])
        if error_row_stride == 1:
            out[:, rows] = ob.transpose(1, 2).to(query.dtype)
        if bool(quant.any()):
            _accumulate(errors, logits, logits_hat, quant, causal, user, ob, v[:, :, :s_end])
    return out


def _mixed_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_hat: torch.Tensor,
    value_hat: torch.Tensor,
    scaling: float,
    windows: Windows,
    attention_mask: torch.Tensor | None,
    block: int = 256,
) -> torch.Tensor:
    """Fused form of :func:`mixed_attention`: per block of query rows, one SDPA call over
    ``[K[:end] ; K_hat[lo:hi]]``.

    Each quantisable key appears twice, exact and quantised; a boolean mask lets
    query ``t`` see exactly one copy (the quantised one iff ``sink <= s <= t - recent``).
    About 5x faster on CPU than materialising both logit matrices. Blocks of query rows
    keep only the keys the block can read (``end``: causal; ``hi``: the last key any of
    its rows reads quantised): with an explicit mask CPU SDPA computes every masked
    logit, so one call over all rows did twice the work of the causal triangle.
    """
    b, hq, t, d = query.shape
    s = key.shape[2]
    dev = query.device
    lo = windows.sink
    user_all = None
    if attention_mask is not None and attention_mask.dim() == 4:
        user_all = attention_mask[..., :t, :s]
        user_all = user_all if user_all.dtype == torch.bool else user_all == 0
    # float32: CPU SDPA with an explicit mask is slow in bf16, and the quantised K/V are
    # float32 already (serving kernels also dequantise and accumulate in fp32)
    qf, kf, vf = query.float(), key.float(), value.float()
    khf, vhf = key_hat.float(), value_hat.float()
    out = torch.empty(b, hq, t, d, dtype=torch.float32, device=dev)
    k_pos_all = torch.arange(s, device=dev)
    for r0 in range(0, t, block):
        r1 = min(t, r0 + block)
        q_pos = torch.arange(s - t + r0, s - t + r1, device=dev)
        end = s - t + r1  # causal: no row of the block reads a later key
        k_pos = k_pos_all[:end]
        causal = k_pos[None, :] <= q_pos[:, None]
        quant = quantized_region(q_pos, k_pos[lo:], windows.sink, windows.recent, windows.prefill_chunk, s)
        cols = quant.any(0).nonzero()
        hi = lo + (int(cols[-1]) + 1 if cols.numel() else 0)
        quant = quant[:, : hi - lo]
        exact = causal.clone()
        exact[:, lo:hi] &= ~quant
        mask = torch.cat([exact, quant], 1)  # [tb, end + (hi - lo)]
        if user_all is not None:
            user = user_all[..., r0:r1, :end] if user_all.shape[-2] > 1 else user_all[..., :end]
            mask = mask & torch.cat([user, user[..., lo:hi]], -1)
        k2 = torch.cat([kf[:, :, :end], khf[:, :, lo:hi]], 2)
        v2 = torch.cat([vf[:, :, :end], vhf[:, :, lo:hi]], 2)
        if _SDPA_GQA:  # KV heads are read in place; copying them per query head cost ~20%
            gqa = {"enable_gqa": True}
        else:
            k2, v2, gqa = _expand_kv(k2, hq), _expand_kv(v2, hq), {}
        out[:, :, r0:r1] = torch.nn.functional.scaled_dot_product_attention(
            qf[:, :, r0:r1], k2, v2, attn_mask=mask, scale=scaling, **gqa
        )
    return out.transpose(1, 2).contiguous().to(query.dtype)


def _accumulate(
    errors: LayerErrors,
    logits: torch.Tensor,
    logits_hat: torch.Tensor,
    quant: torch.Tensor,
    causal: torch.Tensor,
    user: torch.Tensor | None,
    out_hat: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Add one block's squared errors to ``errors`` (shapes ``[B, H, tb, s]``)."""
    w = quant.to(logits.dtype)
    n = w.sum(-1, keepdim=True).clamp_min(1.0)
    diff = (logits_hat - logits) * w
    diff = (diff - diff.sum(-1, keepdim=True) / n) * w
    ref = logits * w
    ref = (ref - ref.sum(-1, keepdim=True) / n) * w
    errors.logit_err += float(diff.square().sum())
    errors.logit_ref += float(ref.square().sum())
    exact = _apply_user_mask(logits.masked_fill(~causal, float("-inf")), user)
    out = torch.matmul(torch.softmax(exact, dim=-1), v)
    rows = quant.any(-1)  # [tb]
    errors.out_err += float((out_hat - out)[:, :, rows].square().sum())
    errors.out_ref += float(out[:, :, rows].square().sum())
    errors.rows += int(rows.sum())


def _fake_quantize(scheme: KVScheme, layer_idx: int, x: torch.Tensor, kind: str) -> torch.Tensor:
    """Fake-quantise ``[B, H, S, d]`` per batch row through the scheme's ``[S, H, d]`` API."""
    fn = scheme.fake_quantize_keys if kind == "k" else scheme.fake_quantize_values
    rows = [fn(layer_idx, x[i].transpose(0, 1)).transpose(0, 1) for i in range(x.shape[0])]
    return torch.stack(rows, 0)


@dataclass
class SimulatedAttention:
    """Attention function for :func:`oscar_calib.attention.attention_override`.

    Attributes:
        scheme: the KV scheme; ``scheme.quantized == False`` runs exact attention.
        windows: sink / recent windows (the same for every scheme of a run).
        capture: accumulate per-layer errors in ``errors``.
        block: query rows per block.
        error_row_stride: errors are measured on every n-th query row (cost).
    """

    scheme: KVScheme
    windows: Windows = field(default_factory=Windows)
    capture: bool = False
    block: int = 256
    error_row_stride: int = 8
    errors: dict[int, LayerErrors] = field(default_factory=dict)

    def __call__(
        self,
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
        **kwargs: Any,
    ) -> torch.Tensor:
        layer = int(ctx.layer_idx)
        s = key.shape[2]
        # no (t, s) pair is quantised when even the last query's window covers [sink, s)
        if not self.scheme.quantized or (s - 1) - self.windows.recent < self.windows.sink:
            return exact_attention(query, key, value, scaling, attention_mask)
        key_hat = _fake_quantize(self.scheme, layer, key, "k")
        value_hat = _fake_quantize(self.scheme, layer, value, "v")
        errors = self.errors.setdefault(layer, LayerErrors()) if self.capture else None
        return mixed_attention(
            query,
            key,
            value,
            key_hat,
            value_hat,
            scaling,
            self.windows,
            attention_mask,
            self.block,
            errors,
            self.error_row_stride,
        )


@contextlib.contextmanager
def simulate(
    model: Any, scheme: KVScheme, windows: Windows | None = None, capture: bool = False, block: int = 256
) -> Iterator[SimulatedAttention]:
    """Run ``model`` with ``scheme``'s quantised KV cache under serving semantics.

    Usage::

        with simulate(model, scheme, Windows(DEFAULT_SINK, DEFAULT_RECENT), capture=True) as sim:
            logits = model(input_ids).logits
        sim.errors[layer].logit_rel
    """
    from .attention import attention_override

    fn = SimulatedAttention(scheme, windows or Windows(), capture, block)
    with attention_override(model, fn):
        yield fn
