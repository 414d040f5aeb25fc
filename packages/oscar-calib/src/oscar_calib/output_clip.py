"""Per-head clip ratios chosen by each layer's attention-output error under serving windows.

The row search of :mod:`oscar_calib.calibrate` minimises the quantisation error of each
key/value row on its own. The ratio that serves best is elsewhere (docs/results.md,
"Long context"): clipping shrinks the INT2 keys' logits (a bias) while cutting their
rounding noise, and logit noise on thousands of INT2 tokens inflates their softmax share
against the exact BF16 windows (``E[e^{l+ε}] = e^{l+σ²/2}``), the more so the longer
the context. A per-row error cannot see that trade; the attention output can.

So this module captures, on a few long calibration sequences, every layer's queries
(a strided subset of rows), keys and values, and chooses each KV head's key ratio, then
its value ratio, on a grid, minimising the error of that head's attention output as
the residual stream receives it::

    E = Σ_t Σ_{h in group} (ô_th − o_th)ᵀ W_hᵀ W_h (ô_th − o_th)

with ``W_h`` the head's slice of ``o_proj``, ``o`` the exact attention output and ``ô``
the output of the mixed cache (sink and recent windows exact, the rest fake-quantised by
exactly the codec the engines serve: centre, rotate, INT2 with the ratio, back). Where the
artifact stores error-feedback matrices (format version 2, ``k_feedback``/``v_feedback``)
the candidates are rounded with them, as served: plain rounding would score a different
quantiser than the one the ratio is stored for. Each head's ratio changes only its own
output, so heads are chosen independently. Only the stored ratios change: rotations, key
mean, feedback matrices, format and bits are those of the row search.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from oscar_math import int2_mask
from oscar_math.errors import check

from .attention import attention_modules, attention_override, sdpa_attention
from .capture import _forward_without_head
from .schemes import RowCodec

__all__ = [
    "CLIP_GRID",
    "CLIP_STEP",
    "LayerCapture",
    "OutputClipResult",
    "capture_layers",
    "output_metrics",
    "search_output_clip",
]

#: coarse candidate ratios (1.0 = no clipping is always a candidate); the search then tries
#: the two points ``CLIP_STEP`` either side of the best coarse one.
CLIP_GRID: tuple[float, ...] = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
CLIP_STEP = 0.05


@dataclass
class LayerCapture:
    """One layer's attention inputs on one sequence (float32, CPU).

    Attributes:
        query: ``[R, H_q, d]`` queries (after RoPE) at positions ``q_pos``.
        q_pos: ``[R]`` absolute positions of those rows.
        key, value: ``[S, H_kv, d]`` every key and value of the sequence.
        scaling: the layer's softmax scale.
        grad: ``[R, H_q, d]`` gradient of the sequence's next-token loss with respect to the
            attention output at those rows (``capture_layers(..., gradients=True)``), or None.
    """

    query: torch.Tensor
    q_pos: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    scaling: float
    grad: torch.Tensor | None = None


def _row_positions(seq_len: int, first: int, stride: int) -> torch.Tensor:
    """Every ``stride``-th position from ``first`` (the first that reads an INT2 token)."""
    return torch.arange(first, seq_len, stride)


def capture_layers(
    model: Any,
    chunks: Sequence[torch.Tensor],
    *,
    first_row: int,
    row_stride: int,
    gradients: bool = False,
) -> list[list[LayerCapture]]:
    """Run each chunk once and keep every layer's attention inputs.

    With ``gradients`` the pass also runs backward from the summed next-token loss and keeps
    the gradient of each layer's attention output at the strided rows (the empirical Fisher
    weighting of :func:`search_output_clip`).

    Returns:
        ``captures[c][layer]``. Memory: ``2 · S · H_kv · d`` floats per layer and chunk
        plus the strided queries (SmolLM2 at 8192 tokens: ~380 MB per chunk).
    """
    check(row_stride >= 1, "row_stride", "an integer >= 1", row_stride)
    device = next(model.parameters()).device
    out: list[list[LayerCapture]] = []

    def hook(ctx, query, key, value, attention_mask, scaling, **kwargs):
        s = key.shape[2]
        pos = _row_positions(s, min(first_row, s - 1), row_stride)
        cap = LayerCapture(
            query=query[0][:, pos.to(query.device)].detach().transpose(0, 1).float().cpu(),
            q_pos=pos,
            key=key[0].detach().transpose(0, 1).float().cpu(),
            value=value[0].detach().transpose(0, 1).float().cpu(),
            scaling=float(scaling),
        )
        layer[ctx.layer_idx] = cap
        o = sdpa_attention(query, key, value, attention_mask, scaling)  # [1, T, H_q, d]
        if gradients and o.requires_grad:

            def keep(g: torch.Tensor, cap: LayerCapture = cap, pos: torch.Tensor = pos) -> None:
                cap.grad = g[0, pos.to(g.device)].detach().float().cpu()

            o.register_hook(keep)
        return o

    with torch.set_grad_enabled(gradients), attention_override(model, hook):
        for chunk in chunks:
            layer: dict[int, LayerCapture] = {}
            ids = chunk[None].to(device)
            if gradients:
                logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
                torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").backward()
                model.zero_grad(set_to_none=True)
            else:
                _forward_without_head(model)(input_ids=ids, use_cache=False)
            out.append([layer[i] for i in sorted(layer)])
    return out


def output_metrics(model: Any, num_q_heads: int, head_dim: int) -> list[torch.Tensor]:
    """Per layer ``[H_q, d, d]`` float32: ``W_hᵀ W_h`` of each query head's ``o_proj`` slice."""
    metrics = []
    for module in attention_modules(model):
        w = module.o_proj.weight.detach().float().cpu()  # [hidden, H_q * d]
        w = w.reshape(w.shape[0], num_q_heads, head_dim).permute(1, 0, 2)  # [H_q, hidden, d]
        metrics.append(w.transpose(1, 2) @ w)
    return metrics


class _HeadProblem:
    """One KV head of one layer on one sequence: the exact output and what the mixed one needs.

    Query rows are taken in blocks of ``block`` rows, each against the keys up to its last
    row's position only (causality), which halves the work of a long sequence.
    """

    def __init__(
        self, cap: LayerCapture, head: int, groups: int, sink: int, recent: int, block: int = 64
    ) -> None:
        q = cap.query[:, head * groups : (head + 1) * groups].transpose(0, 1) * cap.scaling  # [g, R, d]
        self.k = cap.key[:, head]  # [S, d]
        self.v = cap.value[:, head]
        order = torch.argsort(cap.q_pos)
        self.inverse = torch.argsort(order)
        q, pos = q[:, order], cap.q_pos[order]
        self.blocks: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        outs = []
        for r0 in range(0, pos.numel(), block):
            qb, pb = q[:, r0 : r0 + block], pos[r0 : r0 + block]
            s_end = int(pb.max()) + 1
            k_pos = torch.arange(s_end)
            causal = k_pos[None, :] <= pb[:, None]
            quant = int2_mask(pb, k_pos, sink, recent)
            logits = (qb @ self.k[:s_end].T).masked_fill(~causal, float("-inf"))
            outs.append(torch.softmax(logits, -1) @ self.v[:s_end])
            self.blocks.append((qb, s_end, quant, quant.float(), logits))
        self.out = torch.cat(outs, 1)[:, self.inverse]  # [g, R, d], rows in capture order
        grad = cap.grad
        self.grad = None if grad is None else grad[:, head * groups : (head + 1) * groups].transpose(0, 1)

    def error(self, out: torch.Tensor, metric: torch.Tensor) -> float:
        """The objective for a mixed output ``[g, R, d]``: with gradients, the empirical Fisher
        ``Σ (gᵀ (ô − o))²`` (the loss change to second order); else the ``o_proj`` metric."""
        err = out - self.out
        if self.grad is not None:
            return float((err * self.grad).sum(-1).square().sum())
        return _quadratic(err, metric)

    def probs(self, k_hat: torch.Tensor) -> list[torch.Tensor]:
        """Per block, the softmax of the mixed logits: quantised keys inside the region, exact elsewhere."""
        return [
            torch.softmax(torch.where(quant, qb @ k_hat[:s_end].T, logits), -1)
            for qb, s_end, quant, _, logits in self.blocks
        ]

    def output(self, probs: list[torch.Tensor], v_hat: torch.Tensor) -> torch.Tensor:
        """``[g, R, d]`` mixed output: exact values outside the region, ``v_hat`` inside it."""
        dv = v_hat - self.v
        outs = [
            p @ self.v[:s_end] + (p * quant_f) @ dv[:s_end]
            for p, (_, s_end, _, quant_f, _) in zip(probs, self.blocks, strict=True)
        ]
        return torch.cat(outs, 1)[:, self.inverse]


def _quadratic(err: torch.Tensor, metric: torch.Tensor) -> float:
    """``Σ_h Σ_t e_th M_h e_thᵀ`` for ``err [g, R, d]``, ``metric [g, d, d]``."""
    return float(((err @ metric) * err).sum())


@dataclass
class OutputClipResult:
    """Chosen ratios ``[layers][H_kv]`` and the objective before (start) and after, per layer."""

    k_clip: list[torch.Tensor]
    v_clip: list[torch.Tensor]
    error_start: list[float]
    error_chosen: list[float]
    error_unclipped: list[float]


def _codec(
    group_size: int,
    rotation: torch.Tensor,
    mean: torch.Tensor | None,
    ratio: float,
    feedback: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> RowCodec:
    rope_mean, rope_inv_freq = (None, None) if rope is None else rope
    return RowCodec(
        group_size,
        rotation=rotation,
        mean=mean,
        clip=torch.tensor([float(ratio)]),
        feedback=feedback,
        rope_mean=rope_mean,
        rope_inv_freq=rope_inv_freq,
    )


def _group_slice(t: Any, r: int) -> torch.Tensor | None:
    """Rotation group ``r`` of a per-layer ``[G, ...]`` tensor, as float32 ``[1, ...]`` (None stays None)."""
    return None if t is None else torch.as_tensor(t).float()[r : r + 1]


def _fake(codec: RowCodec, x: torch.Tensor) -> torch.Tensor:
    """``[S, d]`` rows of one head through the serving codec."""
    return codec.fake_quantize(x[:, None])[:, 0].float()


def _search_group(
    problems: Sequence[_HeadProblem],
    metrics: Sequence[torch.Tensor],
    k_codec: Any,
    v_codec: Any,
    k0: float,
    v0: float,
    grid: Sequence[float],
    search_keys: bool,
    search_values: bool,
) -> tuple[float, float, float, float, float]:
    """Key ratio on the grid (values at ``v0``), then the value ratio with that key ratio.

    ``k_codec(ratio)`` / ``v_codec(ratio)`` build the serving codecs.
    Returns ``(k ratio, v ratio, error at start, error chosen, error unclipped)``.
    """
    pm = list(zip(problems, metrics, strict=True))
    v_start = [_fake(v_codec(v0), pr.v) for pr in problems]

    def k_err(c: float) -> float:
        codec = k_codec(c)
        return sum(
            pr.error(pr.output(pr.probs(_fake(codec, pr.k)), vh), m)
            for (pr, m), vh in zip(pm, v_start, strict=True)
        )

    e0 = k_err(k0)
    k1, v1 = k_codec(1.0), v_codec(1.0)
    e_none = sum(pr.error(pr.output(pr.probs(_fake(k1, pr.k)), _fake(v1, pr.v)), m) for pr, m in pm)
    kc, best = k0, e0
    if search_keys:
        kc, best = _grid_min(k_err, grid, kc, best)
    vc = v0
    if search_values:
        p_k = [pr.probs(_fake(k_codec(kc), pr.k)) for pr in problems]

        def v_err(c: float) -> float:
            codec = v_codec(c)
            return sum(
                pr.error(pr.output(p, _fake(codec, pr.v)), m) for (pr, m), p in zip(pm, p_k, strict=True)
            )

        vc, best = _grid_min(v_err, grid, vc, best)
    return kc, vc, e0, best, e_none


def _grid_min(fn: Any, grid: Sequence[float], x0: float, f0: float) -> tuple[float, float]:
    """Lowest of ``fn`` over ``grid``, then ``CLIP_STEP`` either side of the best grid point;
    ``(x0, f0)`` (the start) is kept unless a candidate scores strictly lower."""
    best_x, best_f = x0, f0
    grid_best, grid_f = None, float("inf")
    for c in grid:
        f = fn(c)
        if f < grid_f:
            grid_best, grid_f = c, f
        if f < best_f:
            best_x, best_f = c, f
    if grid_best is not None:
        for c in (grid_best - CLIP_STEP, grid_best + CLIP_STEP):
            c = round(c, 4)
            if 0.0 < c <= 1.0 and c not in grid:
                f = fn(c)
                if f < best_f:
                    best_x, best_f = c, f
    return best_x, best_f


def search_output_clip(
    captures: Sequence[Sequence[LayerCapture]],
    metrics: Sequence[torch.Tensor],
    rotations: Any,
    *,
    sink: int,
    recent: int,
    grid: Sequence[float] = CLIP_GRID,
    search_keys: bool = True,
    search_values: bool = True,
) -> OutputClipResult:
    """Choose each KV head's key ratio (values at the start ratio), then its value ratio.

    Args:
        captures: ``[chunk][layer]`` from :func:`capture_layers`.
        metrics: per layer ``[H_q, d, d]`` from :func:`output_metrics`.
        rotations: the artifact the row search produced (start ratios, rotations, key mean,
            and any error-feedback matrices, which the candidates are rounded with); with
            per-layer granularity all heads share one ratio, chosen on their summed error.
        sink, recent: the serving windows.
        grid: candidate ratios; the start ratio is kept unless a candidate scores lower, so
            the chosen ratios never score worse than the start on these sequences.
        search_keys, search_values: which ratios to choose (the other keeps its start).
    """
    grid = sorted({float(g) for g in grid} | {1.0})
    gs = int(rotations.group_size)
    result = OutputClipResult([], [], [], [], [])
    for i in range(rotations.num_layers):
        lay = rotations.for_layer(i)
        r_k, r_v = torch.as_tensor(lay.k_rotation).float(), torch.as_tensor(lay.v_rotation).float()
        mean = None if lay.k_mean is None else torch.as_tensor(lay.k_mean).float()
        k_new = torch.as_tensor(lay.k_clip).float().reshape(-1).clone()
        v_new = torch.as_tensor(lay.v_clip).float().reshape(-1).clone()
        h_kv, h_q = captures[0][i].key.shape[1], captures[0][i].query.shape[1]
        groups = h_q // h_kv
        # rotation groups: one per KV head, or one shared by all heads (granularity "layer")
        heads_of = [[h] for h in range(h_kv)] if r_k.shape[0] == h_kv else [list(range(h_kv))]
        totals = [0.0, 0.0, 0.0]
        for r, heads in enumerate(heads_of):
            problems = [_HeadProblem(cap[i], h, groups, sink, recent) for cap in captures for h in heads]
            mets = [metrics[i][h * groups : (h + 1) * groups] for _ in captures for h in heads]
            k_rot, v_rot = r_k[r : r + 1], r_v[r : r + 1]
            m_r = None if mean is None else mean[r : r + 1]
            k_fb, v_fb = _group_slice(lay.k_feedback, r), _group_slice(lay.v_feedback, r)
            # format version 3: the key rows (positions 0..S-1 of the captured sequences) are
            # centred by RoPE_p(m) as served
            rope = None
            if lay.k_rope_mean is not None:
                rope = (_group_slice(lay.k_rope_mean, r), torch.as_tensor(rotations.rope_inv_freq).float())
            kc, vc, e0, e1, en = _search_group(
                problems,
                mets,
                lambda c, rot=k_rot, m_r=m_r, fb=k_fb, rope=rope: _codec(gs, rot, m_r, c, fb, rope),
                lambda c, rot=v_rot, fb=v_fb: _codec(gs, rot, None, c, fb),
                float(k_new[r]),
                float(v_new[r]),
                grid,
                search_keys,
                search_values,
            )
            k_new[r], v_new[r] = kc, vc
            totals = [totals[0] + e0, totals[1] + e1, totals[2] + en]
        result.k_clip.append(k_new)
        result.v_clip.append(v_new)
        result.error_start.append(totals[0])
        result.error_chosen.append(totals[1])
        result.error_unclipped.append(totals[2])
    return result
