"""Stream a model's queries, keys and values into OSCAR's calibration statistics.

One forward pass of the decoder stack (no LM head) per chunk, or per batch of chunks
on an accelerator, with the attention hook of :mod:`oscar_calib.attention` feeding,
for every layer and sequence:

* ``C_Q`` (:class:`oscar_math.QueryCovariance`) from queries at positions ``>= sink``
  (queries inside the sink window only ever read BF16 sink keys);
* the key mean (:class:`oscar_math.KeyMean`) from keys at positions ``>= sink`` (the sink
  keys stay BF16; the first token's outsized key would otherwise dominate the mean);
* ``C_S`` (:class:`oscar_math.ScoreWeightedValueCovariance`) from the causal softmax of
  the whole chunk with the sink tokens' values zeroed, so it measures the attention
  output carried by values that will actually be quantised. The outputs come from a
  fused (flash) attention kernel, and each *sampled* key's attention weight
  ``Σ_t S_ts²`` for value clipping from the rows' log-sum-exp
  (:meth:`~oscar_math.ScoreWeightedValueCovariance.update_fused`): no ``T × T`` score
  matrix is formed;
* a bounded, seeded sample of key/value rows (and those weights) at positions
  ``>= sink`` for the clip-ratio search, with their positions;
* with ``rope_inv_freq``: the *pre-RoPE* key mean (each key at position ``p >= sink``
  rotated back by ``RoPE_{-p}`` before averaging; artifact format version 3).

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
from oscar_math.errors import OscarError, check

from .attention import attention_override, sdpa_attention
from .models import ModelInfo, model_info

__all__ = ["LayerSample", "CalibrationStatistics", "collect_statistics", "head_output_metrics"]

# C_S through the fused kernel (ScoreWeightedValueCovariance.update_fused); tests set it
# False to run the reference blockwise softmax over all keys and compare the two.
_FUSED = True


@dataclass
class LayerSample:
    """Raw calibration rows of one layer (un-rotated, un-centred, float32, CPU).

    Attributes:
        keys: ``[N, H_kv, d]`` keys after RoPE / QK-norm.
        values: ``[N, H_kv, d]``.
        key_weights: ``[N, H_kv]`` attention weight ``Σ_t Σ_{h in group} S_h[t, s]²`` of
            each sampled token's value in its chunk.
        positions: ``[N]`` int64 position of each sampled row in its chunk, or None.
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_weights: torch.Tensor
    positions: torch.Tensor | None = None


@dataclass
class CalibrationStatistics:
    """Everything calibration derives rotations and clip ratios from.

    Attributes:
        info: the model's attention geometry.
        query_cov: per layer, ``C_Q`` accumulators.
        value_cov: per layer, ``C_S`` accumulators.
        key_mean: per layer, key-mean accumulators.
        samples: per layer, the sampled raw rows.
        output_metrics: per layer ``[H_q, d, d]`` float64 ``W_hᵀ W_h`` of each query head's
            ``o_proj`` slice (the value error's weight in the residual stream; the value
            feedback matrices are derived from it), or None.
        tokens: tokens run through the model.
        seconds: wall time of the capture.
        prerope_mean: per layer, the pre-RoPE key-mean accumulators (positions ``>= sink``),
            or None when ``rope_inv_freq`` was not given.
        rope_inv_freq: ``[d/2]`` float64 RoPE inverse frequencies used for it, or None.
        positions_per_chunk: positions each chunk contributed to the key means
            (``sink .. seq_len-1``), as ``(sink, seq_len)``.
    """

    info: ModelInfo
    query_cov: list[QueryCovariance]
    value_cov: list[ScoreWeightedValueCovariance]
    key_mean: list[KeyMean]
    samples: list[LayerSample]
    tokens: int = 0
    seconds: float = 0.0
    scaling: list[float] = field(default_factory=list)
    output_metrics: list[torch.Tensor] | None = None
    prerope_mean: list[KeyMean] | None = None
    rope_inv_freq: torch.Tensor | None = None
    positions_per_chunk: tuple[int, int] = (0, 0)


def head_output_metrics(model: Any, num_q_heads: int, head_dim: int) -> list[torch.Tensor] | None:
    """Per layer ``[H_q, d, d]`` float64 ``W_hᵀ W_h`` (``W_h`` the head's ``o_proj`` columns).

    None when a layer has no ``o_proj`` of the expected shape (then value feedback cannot be
    derived and calibration says so).
    """
    from .attention import attention_modules

    out = []
    for module in attention_modules(model):
        proj = getattr(module, "o_proj", None)
        w = getattr(proj, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[1] != num_q_heads * head_dim:
            return None
        w = w.detach().double().cpu().reshape(w.shape[0], num_q_heads, head_dim).permute(1, 0, 2)
        out.append(w.transpose(1, 2) @ w)
    return out


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

    def __init__(
        self,
        info: ModelInfo,
        sink: int,
        block_size: int,
        device: torch.device,
        rope_inv_freq: torch.Tensor | None = None,
    ) -> None:
        h_q, h_kv, d = info.num_q_heads, info.num_kv_heads, info.head_dim
        layers = range(info.num_layers)
        self.sink = sink
        self.query_cov = [QueryCovariance(h_q, h_kv, d, device=device) for _ in layers]
        self.value_cov = [
            ScoreWeightedValueCovariance(h_q, h_kv, d, block_size, device=device, compute_dtype=torch.float32)
            for _ in layers
        ]
        self.key_mean = [KeyMean(h_kv, d, device=device) for _ in layers]
        self.rope_inv_freq = rope_inv_freq
        self.prerope_mean = (
            None if rope_inv_freq is None else [KeyMean(h_kv, d, device=device) for _ in layers]
        )
        self.keys: list[list[torch.Tensor]] = [[] for _ in layers]
        self.values: list[list[torch.Tensor]] = [[] for _ in layers]
        self.weights: list[list[torch.Tensor]] = [[] for _ in layers]
        self.scaling = [0.0 for _ in layers]
        self.positions: list[torch.Tensor | None] = []

    def __call__(self, ctx, query, key, value, attention_mask, scaling, **kwargs):
        # The statistics are many small ops (MBs each): one intra-op thread does them with
        # no fork/join per op, which on 2 shared cores took 4x less CPU time and half the
        # wall time (docs/calibration.md). The model's own matmuls keep torch's threads.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for b in range(query.shape[0]):  # per sequence, in chunk order: sums do not depend on batching
                self._add(ctx.layer_idx, query[b], key[b], value[b], scaling, self.positions[b])
        finally:
            torch.set_num_threads(threads)
        return sdpa_attention(query, key, value, attention_mask, scaling)

    def _add(self, i: int, query, key, value, scaling, positions: torch.Tensor | None) -> None:
        q = query.transpose(0, 1)  # [T, H_q, d]
        k = key.transpose(0, 1)  # [T, H_kv, d]
        v = value.transpose(0, 1)
        s = self.sink
        self.query_cov[i].update(q[s:])
        self.key_mean[i].update(k[s:])
        if self.prerope_mean is not None and k.shape[0] > s:
            from oscar_math.rope_center import rope_rotate

            back = -torch.arange(s, k.shape[0], device=k.device)
            self.prerope_mean[i].update(rope_rotate(k[s:].double(), back, self.rope_inv_freq))
        v_quantised = v.clone()
        v_quantised[:s] = 0  # sink values stay BF16: their share of the output is not at risk
        pos = None if positions is None or not positions.numel() else positions.to(k.device)
        if _FUSED:
            # flash attention for C_S; key weights only where rows are sampled
            weights = self.value_cov[i].update_fused(q, k, v_quantised, scaling, key_positions=pos)
        else:  # the reference path (blockwise softmax over all keys), kept for tests
            weights = self.value_cov[i].update(q, k, v_quantised, scaling, return_key_weights=pos is not None)
            weights = None if weights is None else weights[pos]
        self.scaling[i] = float(scaling)
        if pos is not None:
            self.keys[i].append(k[pos].float().cpu())
            self.values[i].append(v[pos].float().cpu())
            self.weights[i].append(weights.float().cpu())


def _forward_without_head(model: Any) -> Any:
    """The decoder stack alone: calibration needs attention inputs, not the vocabulary logits.

    The LM head is a ``[hidden, vocab]`` matmul per token (a fifth of SmolLM2's forward).
    """
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return decoder if isinstance(decoder, torch.nn.Module) else model


def collect_statistics(
    model: Any,
    chunks: Sequence[torch.Tensor],
    *,
    sink: int = 64,
    max_samples: int = 2048,
    seed: int = 0,
    block_size: int = 256,
    progress: bool = True,
    batch_size: int | None = None,
    rope_inv_freq: torch.Tensor | str | None = "auto",
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
        batch_size: chunks per forward pass. ``None``: 1 on CPU (large enough matmuls
            already; a batch only adds memory), up to 8 chunks (and at most 16384 tokens)
            on accelerators, where one short sequence leaves the device idle. The
            statistics are summed per sequence in chunk order either way, so the result
            does not depend on it beyond floating-point noise. Memory stays bounded by
            the batch: activations are never kept, only the sums and the sample.
        rope_inv_freq: ``[d/2]`` RoPE inverse frequencies (:func:`oscar_calib.rope_mean.rope_inv_freq`):
            also accumulate the pre-RoPE key mean (artifact format version 3); ``"auto"``
            (default): the model's if its RoPE is static, else none; ``None``: none.

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
    if batch_size is None:
        batch_size = 1 if device.type == "cpu" else max(1, min(8, 16384 // seq_len))
    check(isinstance(batch_size, int) and batch_size >= 1, "batch_size", "an integer >= 1", batch_size)
    if isinstance(rope_inv_freq, str):
        check(rope_inv_freq == "auto", "rope_inv_freq", "a tensor, 'auto' or None", repr(rope_inv_freq))
        from .rope_mean import rope_inv_freq as model_inv_freq

        try:
            rope_inv_freq = model_inv_freq(model)
        except OscarError:  # no rotary embedding, or one whose frequencies change at run time
            rope_inv_freq = None
    if rope_inv_freq is not None:
        rope_inv_freq = rope_inv_freq.detach().double().cpu()
        half = info.head_dim // 2
        check(
            tuple(rope_inv_freq.shape) == (half,),
            "shape of rope_inv_freq",
            (half,),
            tuple(rope_inv_freq.shape),
        )
    capture = _Capture(info, sink, block_size, device, rope_inv_freq)
    positions = _sample_positions(len(chunks), seq_len, sink, max_samples, seed)
    forward = _forward_without_head(model)

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
            for b0 in range(0, len(chunks), batch_size):
                batch = torch.stack(list(chunks[b0 : b0 + batch_size])).to(device)
                capture.positions = list(positions[b0 : b0 + batch_size])
                forward(input_ids=batch, use_cache=False)
                bar.update(batch.numel())
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
            positions=torch.cat(positions).long(),
        )
        for i in range(info.num_layers)
    ]
    return CalibrationStatistics(
        output_metrics=head_output_metrics(model, info.num_q_heads, info.head_dim),
        info=info,
        query_cov=capture.query_cov,
        value_cov=capture.value_cov,
        key_mean=capture.key_mean,
        samples=samples,
        tokens=len(chunks) * seq_len,
        seconds=seconds,
        scaling=capture.scaling,
        prerope_mean=capture.prerope_mean,
        rope_inv_freq=rope_inv_freq,
        positions_per_chunk=(sink, seq_len),
    )
