"""What every engine integration needs from an artifact, written once (vLLM, SGLang, oscar-calib).

* :func:`load_for_serving`: the artifact, loaded once per process and checked against the model
  (layers, KV heads, head dim; one-line :class:`~oscar_math.errors.OscarError` otherwise).
* :func:`check_head_dim`: the kernels' geometry rule.
* :func:`kv_heads_of_rank` / :func:`shard_params`: a tensor-parallel rank's KV heads and their
  parameters (one field table: a field added to :class:`~oscar_kernels.LayerQuantParams` that
  the table does not name is refused, never dropped or passed on unsharded).
* :func:`rank_layout`: the rank's :class:`~oscar_kernels.CacheLayout`, with the artifact's
  windows (``sink_tokens`` / ``recent_tokens``).
* :func:`cell_bytes` / :func:`window_bytes_per_slot`: the page and window bytes engines size
  their pools with.

The window rule itself (which positions a query reads as BF16) lives in
:meth:`oscar_kernels.CacheLayout.reads_bf16`.
"""

from __future__ import annotations

import functools
from dataclasses import fields, replace

import torch

from oscar_math.artifact import Rotations, load_rotations
from oscar_math.errors import OscarError

from ..layout import CacheLayout
from ..params import LayerQuantParams

__all__ = [
    "load_for_serving",
    "check_head_dim",
    "kv_heads_of_rank",
    "shard_params",
    "rank_layout",
    "cell_bytes",
    "window_bytes_per_slot",
    "default_max_seqs",
    "WINDOW_MEMORY_SHARE",
    "PER_HEAD_FIELDS",
    "SHARED_FIELDS",
]

#: per-head fields of :class:`LayerQuantParams` and the rank of their ``[H_kv, ...]`` form:
#: ``[H, d, d]`` rotations and error-feedback matrices, ``[H, d]`` means, ``[H]`` clip ratios
PER_HEAD_FIELDS = {
    "k_rotation": 3,
    "v_rotation": 3,
    "k_feedback": 3,
    "v_feedback": 3,
    "k_mean": 2,
    "k_rope_mean": 2,  # pre-RoPE key mean of the INT2 rows (format version 3)
    "k_clip": 1,
    "v_clip": 1,
}
#: fields every head shares (the model's RoPE frequencies)
SHARED_FIELDS = frozenset({"k_rope_inv_freq"})


@functools.lru_cache(maxsize=4)
def load_for_serving(path: str, num_layers: int, num_kv_heads: int, head_dim: int) -> Rotations:
    """The artifact at ``path``, checked against the model (total, unsharded geometry), loaded once
    per process (every layer of every engine asks).

    Raises:
        OscarError: one line naming the file and the problem (missing, corrupt, other model,
            a head dim the kernels do not serve).
    """
    check_head_dim(head_dim)
    return load_rotations(str(path), num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)


#: the smallest head dim the GPU kernels compile for: the extend kernel multiplies quarter rows, and
#: Triton 3.6's ``tl.dot`` needs ``K >= 16`` (head dim 32 fails to compile on the H200 machine)
GPU_MIN_HEAD_DIM = 64


def check_head_dim(head_dim: int, v_head_dim: int | None = None, on_gpu: bool = False) -> None:
    """The kernels serve equal key and value head dims that are a multiple of 16, on a GPU at least
    :data:`GPU_MIN_HEAD_DIM`."""
    if v_head_dim is not None and v_head_dim != head_dim:
        raise OscarError(
            f"OSCAR: key head dim {head_dim} != value head dim {v_head_dim} "
            "(MLA-style attention is not supported)"
        )
    if head_dim < 16 or head_dim % 16:
        raise OscarError(
            f"unsupported head dim {head_dim}: the OSCAR kernels need a head dim that is a multiple of 16"
        )
    if on_gpu and head_dim < GPU_MIN_HEAD_DIM:
        raise OscarError(
            f"unsupported head dim {head_dim} on a GPU: the OSCAR kernels compile for head dims of at least "
            f"{GPU_MIN_HEAD_DIM} there (Triton's tl.dot needs 16-wide quarter rows)"
        )


def kv_heads_of_rank(total_kv_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    """The model's KV heads that tensor-parallel rank ``tp_rank`` holds, in order.

    vLLM and SGLang split the same way: with at least as many KV heads as ranks, rank ``r`` holds
    ``[r·n, (r+1)·n)`` (``n = total / tp``); with fewer, each head is replicated on ``tp / total``
    consecutive ranks (rank ``r`` holds head ``r // (tp / total)``).
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise OscarError(f"Invalid tensor-parallel rank {tp_rank} of {tp_size}")
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise OscarError(f"{total_kv_heads} KV heads do not split over tensor-parallel size {tp_size}")
        n = total_kv_heads // tp_size
        return list(range(tp_rank * n, (tp_rank + 1) * n))
    if tp_size % total_kv_heads:
        raise OscarError(f"tensor-parallel size {tp_size} is not a multiple of {total_kv_heads} KV heads")
    return [tp_rank // (tp_size // total_kv_heads)]


def shard_params(params: LayerQuantParams, heads: list[int]) -> LayerQuantParams:
    """The parameters of a rank's KV heads (``heads``: :func:`kv_heads_of_rank`).

    ``layer`` granularity (one rotation per layer) applies to every head unchanged. ``kv_head``
    granularity takes the rank's rows of every per-head field (:data:`PER_HEAD_FIELDS`); a value
    shared by every head (a float or ``[1]`` clip, a ``[d]`` mean, a ``[d, d]`` matrix) stays as
    is. An unknown field is refused: it must never reach a rank unsharded or be dropped, or the
    rank would serve something other than what ``oscar eval`` measured.
    """
    if params.granularity == "layer":
        return params
    known = PER_HEAD_FIELDS.keys() | SHARED_FIELDS
    unknown = [f.name for f in fields(params) if f.name not in known]
    if unknown:
        raise OscarError(f"OSCAR cannot shard the layer parameters {unknown}; upgrade oscar-kernels")
    idx = torch.tensor(heads, dtype=torch.long)

    def take(t: object, dims: int) -> object:
        if isinstance(t, torch.Tensor) and t.dim() == dims and t.shape[0] > 1:
            return t.index_select(0, idx.to(t.device))
        return t

    return replace(params, **{n: take(getattr(params, n), dims) for n, dims in PER_HEAD_FIELDS.items()})


def rank_layout(rotations: Rotations, num_kv_heads: int, head_dim: int, page_size: int) -> CacheLayout:
    """One layer's cache sizes on a rank holding ``num_kv_heads`` heads, with the artifact's group
    size and windows (a server serves the windows the artifact was calibrated and evaluated with)."""
    return CacheLayout(
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        group_size=rotations.group_size,
        sink_tokens=rotations.sink_tokens,
        recent_tokens=rotations.recent_tokens,
    )


def cell_bytes(head_dim: int, group: int) -> int:
    """Bytes of one (KV head, token) cell of a page: K+V codes ``2·d/4``, K/V scale+zero ``4·2·d/group``."""
    return head_dim // 2 + 8 * (head_dim // group)


def window_bytes_per_slot(int2_layers: int, kv_heads: int, head_dim: int, sink: int, recent: int) -> int:
    """Bytes of one sequence slot's BF16 windows (K and V, sink + recent rows, every INT2 layer)."""
    return int2_layers * kv_heads * (sink + recent) * 2 * head_dim * 2


#: share of the device's memory that OSCAR's default request-slot count lets the BF16 windows take.
#: 8 %: 144 slots at Qwen3-8B's shape on an H100, whose INT2 cache is full at ~17k tokens a slot. At
#: 4 % (72 slots) 1k-token prompts generating 16k held every slot busy with the cache 70 % empty;
#: at 144 slots vLLM's serving benchmark gave 4,581 output tok/s (3.37x FA3's) against ~3,360, for
#: 8 % fewer INT2 tokens (H100, 2026-12-07; docs/performance.md). Long contexts may pass fewer.
WINDOW_MEMORY_SHARE = 0.08
#: OSCAR's default never goes below this many slots (or the engine's own default)
MIN_DEFAULT_SEQS = 16


def default_max_seqs(engine_default: int, device_bytes: int, slot_bytes: int) -> int:
    """OSCAR's default number of request slots (vLLM's ``max_num_seqs``, SGLang's
    ``max_running_requests``) when the user set none.

    Every slot owns BF16 windows allocated up front (45 MiB at Qwen3-8B's shape), so an engine's
    own GPU default (vLLM 1024 slots, SGLang up to 4096) would hand most of the memory to windows
    that long requests never fill. The default is the number of slots whose windows take at most
    :data:`WINDOW_MEMORY_SHARE` of the device, within
    ``[min(MIN_DEFAULT_SEQS, engine_default), engine_default]``; ``device_bytes <= 0`` (no GPU):
    the engine's default.
    """
    if device_bytes <= 0 or slot_bytes <= 0:
        return engine_default
    fit = int(WINDOW_MEMORY_SHARE * device_bytes) // slot_bytes
    return max(min(engine_default, fit), min(engine_default, MIN_DEFAULT_SEQS))
