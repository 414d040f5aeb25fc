"""transformers ``Cache`` classes that store the K/V cache the OSCAR way.

:class:`OscarCache` is the real thing: per layer it keeps the first ``sink`` tokens
and the last ``recent`` tokens in the model dtype and everything between as packed
INT2 (:func:`oscar_math.quantize_int2` of centred, rotated rows with the
artifact's per-head clip ratios, 2 bits per element plus a bf16 scale and zero per
group). Tokens move from the recent window into INT2 as generation proceeds::

    cache = OscarCache.from_rotations(model, rotations)          # or from a scheme
    out = model.generate(ids, cache=cache, max_new_tokens=16)      # transformers < 5: past_key_values=
    cache.bits_per_element()                                       # what is stored

:class:`SchemeCache` keeps exact K/V and serves any :class:`~oscar_calib.schemes.KVScheme`
fake-quantised under the same windows (used for ``kivi2``, whose per-channel blocks
do not fit a per-token packed store).

Semantics of one ``update`` (``n0`` tokens cached, ``T`` new ones): the new tokens
are written (the oldest ones beyond the recent window go to INT2), and attention
reads every *earlier* token as it is stored after the write and the ``T`` new tokens
exactly. For a decode step (``T = 1``) that is exactly the per-query rule of
:mod:`oscar_calib.simulate` and of the kernels: token ``s`` is read quantised iff
``sink <= s <= t - recent``. For ``T > 1`` (``model.generate``'s prompt) it is the
chunk-granular rule (``Windows(prefill_chunk=T)``): transformers' ``Cache.update``
returns one key tensor for all ``T`` queries, so per-query windows cannot be expressed
here; the kernels (``oscar_kernels.extend_attention``) and the engine plugins apply
the per-query rule in prefill too. ``oscar eval``'s perplexity does not use this
class (it emulates per query, :mod:`oscar_calib.simulate`); its passkey test does: the
haystack is one ``update`` (its tokens read each other in BF16), and the question and
answer read the haystack as stored (INT2 outside the windows).

This is the torch reference: it dequantises the stored INT2 rows on every step
(like transformers' ``QuantizedCache``); :meth:`OscarLayer.memory_bytes` counts
only what is stored.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from oscar_math import Int2Quantized, check

from .schemes import KVScheme, RowCodec
from .simulate import Windows

__all__ = ["OscarLayer", "OscarCache", "SchemeLayer", "SchemeCache"]


def _cat_q(a: Int2Quantized | None, b: Int2Quantized) -> Int2Quantized:
    if a is None:
        return b
    return Int2Quantized(
        torch.cat([a.codes, b.codes], 1),
        torch.cat([a.scale, b.scale], 1),
        torch.cat([a.zero, b.zero], 1),
        b.group_size,
    )


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class OscarLayer(DynamicLayer):
    """One layer of :class:`OscarCache`.

    Storage (``B`` batch, ``H`` KV heads):
        ``sink_keys/values`` ``[B, H, <=sink, d]`` and ``recent_keys/values``
        ``[B, H, <=recent, d]`` in the model dtype; ``int2_keys/values``:
        :class:`~oscar_math.Int2Quantized` with codes ``[B, N, H, d/4]`` and
        scale/zero ``[B, N, H, d/group_size]`` (token-major, one row per token).
    """

    is_croppable = False

    def __init__(self, key_codec: RowCodec, value_codec: RowCodec, windows: Windows):
        super().__init__()
        self.key_codec, self.value_codec, self.windows = key_codec, value_codec, windows
        self.cumulative_length = 0
        self.sink_keys = self.sink_values = None
        self.recent_keys = self.recent_values = None
        self.int2_keys: Int2Quantized | None = None
        self.int2_values: Int2Quantized | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.dtype = key_states.dtype
        empty = key_states[:, :, :0]
        self.sink_keys = self.recent_keys = empty
        self.sink_values = self.recent_values = value_states[:, :, :0]

    def _int2_rows(self) -> int:
        return 0 if self.int2_keys is None else int(self.int2_keys.codes.shape[1])

    def _encode(self, codec: RowCodec, x: torch.Tensor) -> Int2Quantized:
        """``[B, H, n, d]`` → packed rows ``[B, n, H, ...]``; the rows follow the sink and the
        INT2 rows already stored (their positions, which a pre-RoPE key mean reads)."""
        start = self.sink_keys.shape[-2] + self._int2_rows()
        return codec.encode(x.transpose(1, 2), torch.arange(start, start + x.shape[-2]))

    def _decode(self, codec: RowCodec, q: Int2Quantized | None, like: torch.Tensor) -> torch.Tensor:
        if q is None:
            return like[:, :, :0]
        start = self.sink_keys.shape[-2]
        positions = torch.arange(start, start + q.codes.shape[1])
        return codec.decode(q, self.dtype, positions).transpose(1, 2)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, H, T, d]`` new K/V; return ``[B, H, n0 + T, d]`` for attention."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n0 = self.cumulative_length
        self.cumulative_length += key_states.shape[-2]
        take = max(0, min(key_states.shape[-2], self.windows.sink - self.sink_keys.shape[-2]))
        self.sink_keys = torch.cat([self.sink_keys, key_states[:, :, :take]], -2)
        self.sink_values = torch.cat([self.sink_values, value_states[:, :, :take]], -2)
        self.recent_keys = torch.cat([self.recent_keys, key_states[:, :, take:]], -2)
        self.recent_values = torch.cat([self.recent_values, value_states[:, :, take:]], -2)
        over = self.recent_keys.shape[-2] - self.windows.recent
        if over > 0:
            # values first: _encode reads the INT2 row count from int2_keys
            self.int2_values = _cat_q(
                self.int2_values, self._encode(self.value_codec, self.recent_values[:, :, :over])
            )
            self.int2_keys = _cat_q(
                self.int2_keys, self._encode(self.key_codec, self.recent_keys[:, :, :over])
            )
            self.recent_keys = self.recent_keys[:, :, over:]
            self.recent_values = self.recent_values[:, :, over:]
        keys = torch.cat(
            [self.sink_keys, self._decode(self.key_codec, self.int2_keys, key_states), self.recent_keys], -2
        )
        values = torch.cat(
            [
                self.sink_values,
                self._decode(self.value_codec, self.int2_values, value_states),
                self.recent_values,
            ],
            -2,
        )
        # earlier tokens as stored; this update's own tokens exact (a prefill chunk's fresh K/V)
        keys = torch.cat([keys[:, :, :n0], key_states], -2)
        values = torch.cat([values[:, :, :n0], value_states], -2)
        return keys, values

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0
        self.sink_keys = self.sink_values = self.recent_keys = self.recent_values = None
        self.int2_keys = self.int2_values = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("OscarCache does not support beam search / num_return_sequences > 1")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("OscarCache does not support batch selection")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("OscarCache does not support beam search")

    def memory_bytes(self) -> int:
        """Bytes stored for K and V: windows in the model dtype, INT2 codes, bf16 scale/zero."""
        total = sum(
            _nbytes(t) for t in (self.sink_keys, self.sink_values, self.recent_keys, self.recent_values)
        )
        for q in (self.int2_keys, self.int2_values):
            if q is not None:
                total += _nbytes(q.codes) + _nbytes(q.scale) + _nbytes(q.zero)
        return total

    def num_elements(self) -> int:
        """K and V elements represented (``2 · B · H · n · d``)."""
        if self.sink_keys is None:
            return 0
        b, h, _, d = self.sink_keys.shape
        return 2 * b * h * self.cumulative_length * d


class OscarCache(Cache):
    """Mixed BF16 / packed-INT2 KV cache for ``model.generate(..., cache=...)`` (transformers 5).

    Before transformers 5 the argument is called ``past_key_values``.

    Args:
        scheme: a per-token INT2 scheme (``oscar2``, ``int2``, ``hadamard2`` ...) whose
            ``key_codec(i)`` / ``value_codec(i)`` give layer ``i``'s codec.
        num_layers: decoder layers.
        windows: sink / recent windows (default 64 / 256).
    """

    def __init__(self, scheme: KVScheme, num_layers: int, windows: Windows | None = None):
        check(scheme.key_codec(0) is not None, "scheme", "a per-token INT2 scheme with codecs", scheme.name)
        self.scheme, self.windows = scheme, windows or Windows()
        layers = [
            OscarLayer(scheme.key_codec(i), scheme.value_codec(i), self.windows) for i in range(num_layers)
        ]
        super().__init__(layers=layers)

    @classmethod
    def from_rotations(
        cls, model: Any, rotations: Any, windows: Windows | None = None, scheme: str = "oscar2"
    ) -> OscarCache:
        """Build the cache for ``model`` from a calibrated :class:`oscar_math.artifact.Rotations`."""
        from .schemes import SchemeContext, build_scheme

        cfg = model.config.get_text_config(decoder=True)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        ctx = SchemeContext(
            head_dim=head_dim,
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            rotations=rotations,
        )
        return cls(build_scheme(scheme, ctx), cfg.num_hidden_layers, windows)

    def memory_bytes(self) -> int:
        """Bytes stored by all layers."""
        return sum(layer.memory_bytes() for layer in self.layers)

    def bits_per_element(self) -> float:
        """Average stored bits per K/V element (windows counted at the model dtype's width)."""
        n = sum(layer.num_elements() for layer in self.layers)
        return 8.0 * self.memory_bytes() / n if n else float("nan")


class SchemeLayer(DynamicLayer):
    """Exact storage; serves the middle region fake-quantised by ``scheme`` on every update."""

    is_croppable = False

    def __init__(self, scheme: KVScheme, layer_idx: int, windows: Windows):
        super().__init__()
        self.scheme, self.layer_idx, self.windows = scheme, layer_idx, windows

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n0 = self.get_seq_length()
        keys, values = super().update(key_states, value_states)
        n = keys.shape[-2]
        lo, hi = self.windows.sink, n - self.windows.recent
        if not self.scheme.quantized or hi <= lo:
            return keys, values
        fk, fv = self.scheme.fake_quantize_keys_at, self.scheme.fake_quantize_values
        pos = torch.arange(lo, hi)  # the slice's positions in the sequence (a pre-RoPE key mean reads them)
        mid_k = torch.stack(
            [fk(self.layer_idx, keys[b, :, lo:hi].transpose(0, 1), pos) for b in range(keys.shape[0])]
        )
        mid_v = torch.stack(
            [fv(self.layer_idx, values[b, :, lo:hi].transpose(0, 1)) for b in range(keys.shape[0])]
        )
        out_k = torch.cat([keys[:, :, :lo], mid_k.transpose(1, 2).to(keys.dtype), keys[:, :, hi:]], -2)
        out_v = torch.cat([values[:, :, :lo], mid_v.transpose(1, 2).to(values.dtype), values[:, :, hi:]], -2)
        out_k = torch.cat([out_k[:, :, :n0], key_states], -2)
        out_v = torch.cat([out_v[:, :, :n0], value_states], -2)
        return out_k, out_v


class SchemeCache(Cache):
    """Fake-quantised cache for any scheme (same windows and semantics as :class:`OscarCache`)."""

    def __init__(self, scheme: KVScheme, num_layers: int, windows: Windows | None = None):
        self.scheme, self.windows = scheme, windows or Windows()
        super().__init__(layers=[SchemeLayer(scheme, i, self.windows) for i in range(num_layers)])
