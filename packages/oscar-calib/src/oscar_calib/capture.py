"""Stream a model's queries, keys and values into OSCAR's calibration statistics.

One forward pass per calibration chunk, with the attention hook of
:mod:`oscar_calib.attention` feeding, for every layer:

* ``C_Q`` (:class:`oscar_math.QueryCovariance`) from queries at positions ``>= sink``
  (queries inside the sink window only ever read BF16 sink keys);
* the key mean (:class:`oscar_math.KeyMean`) from keys at positions ``>= sink`` (the sink
  keys stay BF16; the first token's outsized key would otherwise dominate the mean);
* ``C_S`` (:class:`oscar_math.ScoreWeightedValueCovariance`) from the causal softmax of
  the whole chunk with the sink tokens' values zeroed, so it measures the attention
  output carried by values that will actually be quantised; the same pass returns each
  key's attention weight ``Σ_t S_ts²`` for value clipping;
* a bounded, seeded sample of key/value rows (and those weights) at positions
  ``>= sink`` for the clip-ratio search.

The forward itself is untouched (the hook returns plain SDPA), so the samples are the
rows a second pass with known rotations would see: rotations, centring and clipping
are applied to the stored raw rows afterwards (:mod:`oscar_calib.calibrate`), and one
pass suffices. Memory: ``O(layers · H_q · d²)`` float64 sums plus the sample
(``layers × max_samples × H_kv × d`` floats for K and for V); never all activations.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from oscar_math.covariance import KeyMean, QueryCovariance, ScoreWeightedValueCovariance
from oscar_math.errors import check

from .attention import attention_override, sdpa_attention
from .models import ModelInfo, model_info

__all__ = ["LayerSample", "CalibrationStatistics", "collect_statistics"]


@dataclass
class LayerSample:
    """Raw calibration rows of one layer (un-rotated, un-centred, float32, CPU).

    Attributes:
        keys: ``[N, H_kv, d]`` keys after RoPE / QK-norm.
        values: ``[N, H_kv, d]``.
        key_weights: ``[N, H_kv]`` attention weight ``Σ_t Σ_{h in group} S_h[t, s]²`` of
            each sampled token's value in its chunk.
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_weights: torch.Tensor


@dataclass
class CalibrationStatistics:
    """Everything calibration derives rotations and clip ratios from.

    Attributes:
        info: the model's attention geometry.
        query_cov: per layer, ``C_Q`` accumulators.
        value_cov: per layer, ``C_S`` accumulators.
        key_mean: per layer, key-mean accumulators.
        samples: per layer, the sampled raw rows.
        tokens: tokens run through the model.
        seconds: wall time of the capture.
    """

    info: ModelInfo
    query_cov: list[QueryCovariance]
    value_cov: list[ScoreWeightedValueCovariance]
    key_mean: list[KeyMean]
    samples: list[LayerSample]
    tokens: int = 0
    seconds: float = 0.0
    scaling: list[float] = field(default_factory=list)


def _sample_positions(
    num_chunks: int, seq_len: int, sink: int, max_samples: int, seed: int
) -> list[torch.Tensor]:
    """Seeded choice of ``<= max_samples`` (chunk, position >= sink) pairs, sorted per chunk."""
    per_chunk = seq_len - sink
    total = num_chunks * per_chunk
    generator = torch.Generator().manual_seed(int(seed) + 7919)  # independent of chunk choice
    flat = torch.randperm(total, generator=generator)[: min(max_samples, total)].sort().values
    return [flat[(flat // per_chunk) == c] % per_chunk + sink for c in range(num_chunks)]


class _Capture:
    """The attention hook: updates one layer's statistics per call (batch of one chunk)."""

    def __init__(self, info: ModelInfo, sink: int, block_size: int, device: torch.device) -> None:
        h_q, h_kv, d = info.num_q_heads, info.num_kv_heads, info.head_dim
        layers = range(info.num_layers)
        self.sink = sink
        self.query_cov = [QueryCovariance(h_q, h_kv, d, device=device) for _ in layers]
        self.value_cov = [
            ScoreWeightedValueCovariance(h_q, h_kv, d, block_size, device=device, compute_dtype=torch.float32)
            for _ in layers
        ]
        self.key_mean = [KeyMean(h_kv, d, device=device) for _ in layers]
        self.keys: list[list[torch.Tensor]] = [[] for _ in layers]
        self.values: list[list[torch.Tensor]] = [[] for _ in layers]
        self.weights: list[list[torch.Tensor]] = [[] for _ in layers]
        self.scaling = [0.0 for _ in layers]
        self.positions: torch.Tensor | None = None

    def __call__(self, ctx, query, key, value, attention_mask, scaling, **kwargs):
        i = ctx.layer_idx
        check(query.shape[0] == 1, "calibration batch", "1 sequence per forward", query.shape[0])
        q = query[0].transpose(0, 1)  # [T, H_q, d]
        k = key[0].transpose(0, 1)  # [T, H_kv, d]
        v = value[0].transpose(0, 1)
        s = self.sink
        self.query_cov[i].update(q[s:])
        self.key_mean[i].update(k[s:])
        v_quantised = v.clone()
        v_quantised[:s] = 0  # sink values stay BF16: their share of the output is not at risk
        weights = self.value_cov[i].update(q, k, v_quantised, scaling, return_key_weights=True)
        self.scaling[i] = float(scaling)
        if self.positions is not None and self.positions.numel():
            pos = self.positions.to(k.device)
            self.keys[i].append(k[pos].float().cpu())
            self.values[i].append(v[pos].float().cpu())
            self.weights[i].append(weights[pos].float().cpu())
        return sdpa_attention(query, key, value, attention_mask, scaling)


def collect_statistics(
    model: Any,
    chunks: Sequence[torch.Tensor],
    *,
    sink: int = 64,
    max_samples: int = 2048,
    seed: int = 0,
    block_size: int = 256,
    progress: bool = True,
) -> CalibrationStatistics:
    """Run ``chunks`` through ``model`` and accumulate the calibration statistics.

    Args:
        model: a loaded causal LM of a supported family (:func:`oscar_calib.load_model`).
        chunks: LongTensor ``[seq_len]`` each, all the same length ``> sink``.
        sink: leading tokens of every chunk that stay BF16 (excluded as described above).
        max_samples: token rows kept per layer for the clip search (seeded choice).
        seed: seed of the sample choice.
        block_size: query rows per block of the ``C_S`` softmax.
        progress: show a tqdm bar with tokens/s on stderr.

    Returns:
        :class:`CalibrationStatistics`.
    """
    info = model_info(model)
    check(len(chunks) >= 1, "chunks", "at least one chunk", len(chunks))
    seq_len = int(chunks[0].numel())
    check(
        all(c.dim() == 1 and c.numel() == seq_len for c in chunks),
        "chunks",
        f"1-D token tensors of one length ({seq_len})",
        [tuple(c.shape) for c in chunks[:4]],
    )
    check(seq_len > sink, "seq_len", f"more tokens than sink={sink}", seq_len)
    check(isinstance(max_samples, int) and max_samples >= 1, "max_samples", "an integer >= 1", max_samples)
    device = next(model.parameters()).device
    capture = _Capture(info, sink, block_size, device)
    positions = _sample_positions(len(chunks), seq_len, sink, max_samples, seed)

    from tqdm.auto import tqdm

    bar = tqdm(
        total=len(chunks) * seq_len,
        unit="tok",
        unit_scale=True,
        desc="calibrating",
        disable=not progress,
        leave=False,
        dynamic_ncols=True,
    )
    start = time.perf_counter()
    try:
        with torch.no_grad(), attention_override(model, capture):
            for chunk, pos in zip(chunks, positions, strict=True):
                capture.positions = pos
                model(input_ids=chunk[None].to(device), use_cache=False)
                bar.update(seq_len)
    finally:
        bar.close()
    seconds = time.perf_counter() - start

    def _cat(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        return torch.cat(parts) if parts else torch.zeros(shape)

    h, d = info.num_kv_heads, info.head_dim
    samples = [
        LayerSample(
            keys=_cat(capture.keys[i], (0, h, d)),
            values=_cat(capture.values[i], (0, h, d)),
            key_weights=_cat(capture.weights[i], (0, h)),
        )
        for i in range(info.num_layers)
    ]
    return CalibrationStatistics(
        info=info,
        query_cov=capture.query_cov,
        value_cov=capture.value_cov,
        key_mean=capture.key_mean,
        samples=samples,
        tokens=len(chunks) * seq_len,
        seconds=seconds,
        scaling=capture.scaling,
    )
