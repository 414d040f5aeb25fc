"""Streaming, mergeable calibration statistics: ``C_Q``, ``C_S`` and the key mean.

Every accumulator keeps float64 sums and a row count, so shards, processes and
sequences combine exactly: ``a.merge(b)`` is the accumulator of both inputs, and
``state_dict()`` / ``from_state_dict()`` move state as plain tensors (safetensors-ready,
no pickle).

Statistics are kept per QUERY head (``C_Q``, ``C_S``) or per KV head (key mean) and
pooled only in ``result(granularity)``:

* ``"kv_head"``: one result per KV head ``G = num_kv_heads``; query head ``h`` reads KV
  head ``h // g`` with ``g = num_q_heads / num_kv_heads`` (as HF ``repeat_kv``), so a KV
  head's statistic is the mean over its ``g`` query heads' rows.
* ``"layer"``: ``G = 1``, the mean over all heads.
"""

from __future__ import annotations

import contextlib
import math

import torch

from .errors import OscarError, check

__all__ = [
    "GRANULARITIES",
    "QueryCovariance",
    "ScoreWeightedValueCovariance",
    "KeyMean",
]

#: Pooling choices for ``result(granularity)``.
GRANULARITIES = ("layer", "kv_head")


def _check_heads(num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
    for name, v in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, name, "a positive int", v)
    check(
        num_q_heads % num_kv_heads == 0,
        "num_q_heads",
        f"a multiple of num_kv_heads={num_kv_heads}",
        num_q_heads,
    )


def _check_rows(x: torch.Tensor, name: str, heads: int, head_dim: int, T: int | None = None) -> None:
    check(isinstance(x, torch.Tensor), name, "a torch.Tensor", type(x).__name__)
    t = "T" if T is None else str(T)
    ok = x.ndim == 3 and x.shape[1] == heads and x.shape[2] == head_dim and (T is None or x.shape[0] == T)
    check(ok, f"shape of {name}", f"[{t}, {heads}, {head_dim}]", list(x.shape))
    check(not x.is_complex(), name, "a real tensor", x.dtype)


def _as_f64(x: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    x = x.detach().to(device=device, dtype=torch.float64)
    check(bool(torch.isfinite(x).all()), name, "finite values", "NaN or Inf")
    return x


def _check_granularity(granularity: str) -> None:
    check(granularity in GRANULARITIES, "granularity", f"one of {GRANULARITIES}", granularity)


class _Accumulator:
    """Shared plumbing: a float64 ``sum`` tensor, a row ``count`` and integer config."""

    _config_keys: tuple[str, ...] = ()

    sum: torch.Tensor
    count: int

    def _config(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self._config_keys}

    @property
    def device(self) -> torch.device:
        return self.sum.device

    def _empty_like_self(self, device: torch.device | None = None):
        return type(self)(**self._config(), device=device if device is not None else self.device)

    def merge(self, other):
        """Return a NEW accumulator holding the statistics of ``self`` and ``other``."""
        check(type(other) is type(self), "other", type(self).__name__, type(other).__name__)
        check(other._config() == self._config(), "other", f"config {self._config()}", other._config())
        out = self._empty_like_self()
        out.sum = self.sum + other.sum.to(self.device)
        out.count = self.count + other.count
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Plain CPU tensors: ``sum`` (float64), ``count`` and the config (int64 scalars)."""
        state = {"sum": self.sum.detach().cpu().clone(), "count": torch.tensor(self.count, dtype=torch.int64)}
        state.update({k: torch.tensor(v, dtype=torch.int64) for k, v in self._config().items()})
        return state

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], device: torch.device | str | None = None):
        """Rebuild from :meth:`state_dict` output (validated: keys, shape, count, finiteness)."""
        missing = [k for k in ("sum", "count", *cls._config_keys) if k not in state]
        check(not missing, "state", f"keys sum, count, {', '.join(cls._config_keys)}", f"missing {missing}")
        config = {k: int(state[k]) for k in cls._config_keys}
        out = cls(**config, device=device)
        s = state["sum"]
        check(
            isinstance(s, torch.Tensor) and tuple(s.shape) == tuple(out.sum.shape),
            "shape of state['sum']",
            list(out.sum.shape),
            list(getattr(s, "shape", [])),
        )
        check(bool(torch.isfinite(s).all()), "state['sum']", "finite values", "NaN or Inf")
        count = int(state["count"])
        check(count >= 0, "state['count']", "a non-negative int", count)
        out.sum = s.to(device=out.device, dtype=torch.float64).clone()
        out.count = count
        return out

    def _require_data(self) -> None:
        if self.count == 0:
            raise OscarError(f"Invalid {type(self).__name__}: expected at least one row, got 0 (call update)")


class _HeadCovariance(_Accumulator):
    """Per-query-head second moments ``sum [H_q, d, d]``; pooled on ``result``."""

    _config_keys = ("num_q_heads", "num_kv_heads", "head_dim")

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, device=None) -> None:
        _check_heads(num_q_heads, num_kv_heads, head_dim)
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sum = torch.zeros(num_q_heads, head_dim, head_dim, dtype=torch.float64, device=device)
        self.count = 0  # rows per query head

    @property
    def group(self) -> int:
        """GQA group size ``g = num_q_heads / num_kv_heads``."""
        return self.num_q_heads // self.num_kv_heads

    def result(self, granularity: str = "kv_head") -> torch.Tensor:
        """Pooled covariance ``[G, d, d]`` float64 (``G = num_kv_heads`` or 1), symmetric."""
        _check_granularity(granularity)
        self._require_data()
        d = self.head_dim
        if granularity == "kv_head":
            c = self.sum.view(self.num_kv_heads, self.group, d, d).sum(1) / (self.group * self.count)
        else:
            c = self.sum.sum(0, keepdim=True) / (self.num_q_heads * self.count)
        return 0.5 * (c + c.transpose(-1, -2))


class QueryCovariance(_HeadCovariance):
    """Query second moment ``C_Q = (1/N) Σ q qᵀ`` (uncentred), the key-rotation target.

    Feed queries exactly as attention sees them: after RoPE and any QK-norm.

    Args:
        num_q_heads, num_kv_heads, head_dim: layer shape (``num_q_heads % num_kv_heads == 0``).
        device: where the float64 sums live (inputs are moved there).
    """

    def update(self, q: torch.Tensor) -> None:
        """Add rows ``q`` ``[T, H_q, d]`` (any float dtype; T may be 0)."""
        _check_rows(q, "q", self.num_q_heads, self.head_dim)
        q64 = _as_f64(q, "q", self.device)
        self.sum += torch.einsum("thi,thj->hij", q64, q64)
        self.count += q.shape[0]


class ScoreWeightedValueCovariance(_HeadCovariance):
    """Score-weighted value covariance ``C_S = (1/N) Vᵀ SᵀS V``, the value-rotation target.

    For one causal sequence and query head ``h`` reading KV head ``h // g``, ``S`` is the
    causal softmax ``softmax(scaling · q kᵀ)`` ``[T, T]`` and ``Vᵀ SᵀS V =
    Σ_t o_t o_tᵀ`` with ``o_t = Σ_s S_ts v_s`` the attention output: ``C_S`` is the
    second moment of the attention outputs, ``N`` the number of query rows. Output
    error ``S (V - V̂)`` is what value quantisation costs, so these directions matter.

    The softmax is evaluated in ``compute_dtype`` (float64 by default; float32 is
    several times faster on CPU and accurate enough for calibration — the sums are
    float64 either way), ``block_size`` query rows at a time against
    the causal prefix of keys, so memory is ``O(H_q × block_size × T)``, never ``T × T``
    when ``T > block_size``. Sliding windows, logit soft-capping and attention sinks
    are not modelled (plain causal softmax).

    Args:
        num_q_heads, num_kv_heads, head_dim: layer shape.
        block_size: query rows per softmax block.
        device: where the float64 sums (and the blockwise softmax) live.
        compute_dtype: dtype of the blockwise logits/softmax/outputs.
    """

    _config_keys = ("num_q_heads", "num_kv_heads", "head_dim", "block_size")

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int = 256,
        device=None,
        compute_dtype: torch.dtype = torch.float64,
    ) -> None:
        super().__init__(num_q_heads, num_kv_heads, head_dim, device=device)
        check(
            isinstance(block_size, int) and not isinstance(block_size, bool) and block_size >= 1,
            "block_size",
            "a positive int",
            block_size,
        )
        check(
            compute_dtype in (torch.float32, torch.float64),
            "compute_dtype",
            "torch.float32 or torch.float64",
            compute_dtype,
        )
        self.block_size = block_size
        self.compute_dtype = compute_dtype

    def _check_inputs(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None
    ) -> tuple[int, float]:
        """Validate one sequence's ``q``/``k``/``v``; returns ``(T, scaling)`` (default ``1/sqrt(d)``)."""
        _check_rows(q, "q", self.num_q_heads, self.head_dim)
        T = q.shape[0]
        _check_rows(k, "k", self.num_kv_heads, self.head_dim, T)
        _check_rows(v, "v", self.num_kv_heads, self.head_dim, T)
        if scaling is None:
            scaling = 1.0 / math.sqrt(self.head_dim)
        check(
            isinstance(scaling, (int, float)) and math.isfinite(scaling) and scaling > 0,
            "scaling",
            "a positive finite float",
            scaling,
        )
        return T, scaling

    def update(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scaling: float | None = None,
        *,
        return_key_weights: bool = False,
    ) -> torch.Tensor | None:
        """Add one causal sequence.

        Args:
            q: ``[T, H_q, d]`` queries (after RoPE / QK-norm).
            k: ``[T, H_kv, d]`` keys (after RoPE / QK-norm).
            v: ``[T, H_kv, d]`` values.
            scaling: softmax scale, default ``1 / sqrt(d)``.
            return_key_weights: also return the per-key weights below.

        Returns:
            ``None``, or with ``return_key_weights=True`` ``w`` ``[T, H_kv]`` float64 with
            ``w[s, j] = Σ_t Σ_{h in group j} S_h[t, s]²`` (the diagonal of ``SᵀS`` per key,
            pooled over the group): the weight of key ``s``'s value error in the output
            error, for value clipping calibration.
        """
        T, scaling = self._check_inputs(q, k, v, scaling)
        H, g, d = self.num_kv_heads, self.group, self.head_dim
        cd = self.compute_dtype
        q64 = _as_f64(q, "q", self.device).to(cd).view(T, H, g, d) * scaling
        k64 = _as_f64(k, "k", self.device).to(cd)
        v64 = _as_f64(v, "v", self.device).to(cd)
        w = torch.zeros(T, H, dtype=torch.float64, device=self.device) if return_key_weights else None
        acc = self.sum.view(H, g, d, d)
        for t0 in range(0, T, self.block_size):
            t1 = min(T, t0 + self.block_size)
            # logits of query rows t0..t1 against the causal key prefix 0..t1: [H, g, b, t1]
            logits = torch.einsum("bhgd,shd->hgbs", q64[t0:t1], k64[:t1])
            rows = torch.arange(t0, t1, device=self.device)[:, None]
            cols = torch.arange(t1, device=self.device)[None, :]
            logits = logits.masked_fill(cols > rows, float("-inf"))
            S = torch.softmax(logits, dim=-1)
            o = torch.einsum("hgbs,shd->hgbd", S, v64[:t1])
            o = o.double()
            acc += torch.einsum("hgbi,hgbj->hgij", o, o)
            if w is not None:
                w[:t1] += torch.einsum("hgbs->sh", S * S).double()
        self.count += T
        return w

    def update_fused(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scaling: float | None = None,
        *,
        key_positions: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Add one causal sequence like :meth:`update`, through a fused attention kernel.

        The same ``C_S`` sums: the outputs ``o = S V`` come from
        ``scaled_dot_product_attention`` (flash attention on CPU and GPU, so no score
        matrix is formed at all), and ``Σ_t o_t o_tᵀ`` is added in float64. The key
        weights of :meth:`update` are computed only for ``key_positions`` — callers use
        them for a sample of keys, and all ``T`` of them would cost a full ``T × T``
        softmax again — from each query row's softmax normaliser (log-sum-exp), in
        blocks of ``block_size`` query rows (memory ``O(H_q × block_size × P)``).

        Args:
            q, k, v, scaling: as in :meth:`update`.
            key_positions: ``None`` or LongTensor ``[P]`` of key positions in ``[0, T)``.

        Returns:
            ``None`` without ``key_positions``, else ``w`` ``[P, H_kv]`` float64 with
            ``w[i, j] = Σ_t Σ_{h in group j} S_h[t, key_positions[i]]²``.
        """
        T, scaling = self._check_inputs(q, k, v, scaling)
        if key_positions is not None:
            key_positions = torch.as_tensor(key_positions, dtype=torch.long, device=self.device).reshape(-1)
            ok = key_positions.numel() == 0 or (
                0 <= int(key_positions.min()) and int(key_positions.max()) < T
            )
            check(ok, "key_positions", f"positions in [0, {T})", key_positions.tolist()[:8])
        self.count += T
        if T == 0:
            return None if key_positions is None else torch.zeros(0, self.num_kv_heads, dtype=torch.float64)
        H, g = self.num_kv_heads, self.group
        cd = self.compute_dtype
        # [H_q, T, d]: heads first, keys/values repeated for their query group
        qh = _as_f64(q, "q", self.device).to(cd).transpose(0, 1)
        kh = _as_f64(k, "k", self.device).to(cd).transpose(0, 1).repeat_interleave(g, 0)
        vh = _as_f64(v, "v", self.device).to(cd).transpose(0, 1).repeat_interleave(g, 0)
        o, lse = _causal_attention(qh, kh, vh, float(scaling), need_lse=key_positions is not None)
        o64 = o.double()
        self.sum += o64.transpose(-1, -2) @ o64
        if key_positions is None:
            return None
        P = key_positions.numel()
        w = torch.zeros(H * g, P, dtype=torch.float64, device=self.device)
        if P:
            kp = kh[:, key_positions]  # [H_q, P, d]
            first = int(key_positions.min())  # earlier query rows cannot see any sampled key
            for t0 in range(first, T, self.block_size):
                t1 = min(T, t0 + self.block_size)
                logits = (qh[:, t0:t1] @ kp.transpose(-1, -2)) * scaling  # [H_q, b, P]
                rows = torch.arange(t0, t1, device=self.device)[:, None]
                logits = logits.masked_fill(key_positions[None, :] > rows, float("-inf"))
                S = torch.exp(logits - lse[:, t0:t1, None])
                w += (S * S).sum(1).double()
        return w.view(H, g, P).sum(1).transpose(0, 1).contiguous()


def _cpu_flash_kernel():  # noqa: ANN202 - a torch op
    """PyTorch's CPU flash-attention op, which also returns the log-sum-exp (None if absent)."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, *, need_lse: bool, block: int = 256
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal ``softmax(scaling · q kᵀ) v`` for ``[H, T, d]`` inputs, and each row's log-sum-exp ``[H, T]``.

    CPU: one call of the flash kernel, which returns both. Elsewhere (or where that
    kernel is missing): ``scaled_dot_product_attention`` for the outputs and a blockwise
    log-sum-exp over the causal prefix (``block`` query rows at a time).
    """
    kernel = _cpu_flash_kernel() if q.device.type == "cpu" else None
    if kernel is not None:
        with contextlib.suppress(RuntimeError):  # e.g. a dtype this build's kernel lacks
            o, lse = kernel(q[None], k[None], v[None], 0.0, True, scale=scaling)
            return o[0], (lse[0] if need_lse else None)
    o = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], is_causal=True, scale=scaling
    )[0]
    if not need_lse:
        return o, None
    T = q.shape[1]
    lse = torch.empty(q.shape[0], T, dtype=q.dtype, device=q.device)
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        logits = (q[:, t0:t1] @ k[:, :t1].transpose(-1, -2)) * scaling
        rows = torch.arange(t0, t1, device=q.device)[:, None]
        cols = torch.arange(t1, device=q.device)[None, :]
        lse[:, t0:t1] = torch.logsumexp(logits.masked_fill(cols > rows, float("-inf")), dim=-1)
    return o, lse


class KeyMean(_Accumulator):
    """Mean key ``μ = (1/N) Σ k`` per KV head, subtracted before rotation and quantisation.

    Centering is free at run time: ``q·(k - μ) = q·k - q·μ`` shifts all of one query's
    logits by the same constant, which softmax ignores.

    Args:
        num_kv_heads, head_dim: layer shape.
        device: where the float64 sums live.
    """

    _config_keys = ("num_kv_heads", "head_dim")

    def __init__(self, num_kv_heads: int, head_dim: int, device=None) -> None:
        _check_heads(num_kv_heads, num_kv_heads, head_dim)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sum = torch.zeros(num_kv_heads, head_dim, dtype=torch.float64, device=device)
        self.count = 0

    def update(self, k: torch.Tensor) -> None:
        """Add keys ``k`` ``[T, H_kv, d]`` (after RoPE / QK-norm; T may be 0)."""
        _check_rows(k, "k", self.num_kv_heads, self.head_dim)
        self.sum += _as_f64(k, "k", self.device).sum(0)
        self.count += k.shape[0]

    def result(self, granularity: str = "kv_head") -> torch.Tensor:
        """Mean key ``[G, d]`` float64: per KV head (``G = num_kv_heads``) or pooled (``G = 1``)."""
        _check_granularity(granularity)
        self._require_data()
        if granularity == "kv_head":
            return self.sum / self.count
        return self.sum.sum(0, keepdim=True) / (self.num_kv_heads * self.count)
