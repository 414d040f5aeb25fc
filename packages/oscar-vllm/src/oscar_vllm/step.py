"""One engine step of the OSCAR backend, free of vLLM: metadata, window slots, the layer call.

:mod:`oscar_vllm.backend` adapts vLLM's objects to these functions; the GPU check script
(``benchmarks/gpu_check.py``) drives the same functions with vLLM-shaped tensors on a
machine without vLLM.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from oscar_kernels import PagedKVCache, decode_attention, extend_attention, paged_write
from oscar_math.errors import OscarError

__all__ = [
    "StepMetadata",
    "WindowSlots",
    "build_step",
    "step_record",
    "write_step",
    "attend_step",
    "run_layer",
]


@dataclass
class StepMetadata:
    """One step's batch, shared by every layer (int32 on the model's device)."""

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # [B+1]
    seq_lens: torch.Tensor  # [B] after this step
    prefix_lens: torch.Tensor  # [B] cached before this step
    block_table: torch.Tensor  # [B, max_blocks]
    slot_mapping: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    seq_index: torch.Tensor  # [T]
    window_slots: torch.Tensor  # [B]
    all_decode: bool


class WindowSlots:
    """Window-pool row of every live request, for model runners that give no request row.

    Keyed by the request's first KV block, which no other live request holds while
    prefix caching is off (OSCAR turns it off). A request that starts (no cached
    tokens) takes a slot — its predecessor's if it got the same first block (that one
    has finished), else a free one, else the least recently seen slot of a request not
    in this batch. A request that continues must already have one: otherwise its BF16
    windows were never written here, and the step fails with one clear error instead of
    attending garbage.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # first block -> slot, LRU order
        self._free = list(range(num_slots - 1, -1, -1))

    def assign(self, first_blocks: list[int], starts: list[bool], active: list[bool]) -> list[int]:
        """Slots of a batch's rows (``0`` for inactive/padding rows)."""
        slots = [0] * len(first_blocks)
        in_batch = {b for b, a in zip(first_blocks, active, strict=True) if a}
        for i, (block, start, act) in enumerate(zip(first_blocks, starts, active, strict=True)):
            if not act:
                continue
            if block in self._slot_of:
                self._slot_of.move_to_end(block)
                slots[i] = self._slot_of[block]
                continue
            if not start:
                raise OscarError(
                    "OSCAR: a request arrived with cached tokens whose BF16 windows this worker never "
                    "wrote (a prefix-cache hit?); prefix caching must be off with OSCAR (see docs/vllm.md)"
                )
            if not self._free:
                victim = next((b for b in self._slot_of if b not in in_batch), None)
                if victim is None:
                    raise OscarError(f"OSCAR: more than {self.num_slots} live requests (max_num_seqs)")
                self._free.append(self._slot_of.pop(victim))
            slot = self._free.pop()
            self._slot_of[block] = slot
            slots[i] = slot
        return slots


def build_step(
    query_start_loc: torch.Tensor,
    query_start_loc_cpu: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_reqs: int,
    window_slots: torch.Tensor | None,
    slots: WindowSlots | None,
) -> StepMetadata:
    """:class:`StepMetadata` from vLLM's per-step tensors (``CommonAttentionMetadata`` fields).

    ``window_slots`` are the runner's persistent request rows when it has them; else
    ``slots`` assigns them from the first KV block of each row (host lists).
    """
    b = num_reqs
    dev = seq_lens.device
    qsl = query_start_loc[: b + 1].to(torch.int32)
    qsl_cpu = query_start_loc_cpu[: b + 1].to(torch.int64)
    q_lens_cpu = qsl_cpu[1:] - qsl_cpu[:-1]
    prefix_cpu = seq_lens_cpu[:b].to(torch.int64) - q_lens_cpu
    seq = seq_lens[:b].to(torch.int32)
    prefix = seq - (qsl[1:] - qsl[:-1])
    table = block_table[:b].to(torch.int32)
    if window_slots is not None:
        ws = window_slots[:b].to(device=dev, dtype=torch.int32)
    else:
        if slots is None:
            raise OscarError("OSCAR: no window slots for this batch")
        first = table[:, 0].cpu().tolist() if table.shape[1] else [0] * b
        ws = torch.tensor(
            slots.assign(first, (prefix_cpu == 0).tolist(), (q_lens_cpu > 0).tolist()),
            dtype=torch.int32,
            device=dev,
        )
    n = int(qsl_cpu[-1]) if b else 0
    tok = torch.arange(n, device=dev, dtype=torch.int32)
    seq_index = torch.searchsorted(qsl[1:], tok, right=True).to(torch.int32)
    positions = prefix[seq_index] + tok - qsl[seq_index]
    return StepMetadata(
        num_actual_tokens=n,
        max_query_len=int(q_lens_cpu.max()) if b else 0,
        query_start_loc=qsl,
        seq_lens=seq,
        prefix_lens=prefix,
        block_table=table,
        slot_mapping=slot_mapping[:n],
        positions=positions,
        seq_index=seq_index,
        window_slots=ws,
        all_decode=bool(b) and bool((q_lens_cpu <= 1).all()) and bool((prefix_cpu > 0).all()),
    )


def step_record(md: StepMetadata) -> dict:
    """A step's batch as host lists: per row the chunk length, the cached prefix before it,
    the window slot and the first KV block (what decides each sequence's outputs)."""
    qsl = md.query_start_loc.cpu().tolist()
    return {
        "query_lens": [b - a for a, b in zip(qsl[:-1], qsl[1:], strict=True)],
        "prefix_lens": md.prefix_lens.cpu().tolist(),
        "window_slots": md.window_slots.cpu().tolist(),
        "first_blocks": md.block_table[:, 0].cpu().tolist() if md.block_table.shape[1] else [],
    }


def write_step(
    cache: PagedKVCache,
    params: object,
    k: torch.Tensor,
    v: torch.Tensor,
    md: StepMetadata,
    backend: str = "auto",
    parts: str = "all",
) -> None:
    """Quantise the step's ``k``/``v`` (``[T, H_kv, d]``) into ``cache`` (INT2 pages + BF16 windows).

    ``parts`` as :func:`oscar_kernels.paged_write`: :func:`run_layer` writes ``"all"`` before
    a decode-only step, ``"pages"`` before and ``"ring"`` after an extend step.
    """
    ws = md.window_slots
    paged_write(
        cache,
        params,
        k,
        v,
        md.slot_mapping,
        md.positions,
        md.seq_index,
        md.seq_lens,
        ws,
        backend=backend,
        parts=parts,
    )


def attend_step(
    cache: PagedKVCache,
    params: object,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    md: StepMetadata,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of the step's queries over the cache (after :func:`write_step`).

    Decode kernel when every row is a one-token decode (everything written before);
    otherwise one extend call over the whole mixed batch (a decode row is a one-token
    chunk; extend and decode agree there, see oscar-kernels' tests), after the INT2 +
    sink write and before the ring write. Returns ``[T, H_q, d]`` in ``q.dtype``.
    """
    if md.all_decode:
        return decode_attention(
            q,
            cache,
            params,
            md.block_table,
            md.seq_lens,
            md.window_slots,
            softmax_scale=scale,
            backend=backend,
        )
    return extend_attention(
        q,
        k,
        v,
        cache,
        params,
        md.query_start_loc,
        md.prefix_lens,
        md.block_table,
        md.window_slots,
        md.max_query_len,
        softmax_scale=scale,
        backend=backend,
    )


def run_layer(
    cache: PagedKVCache,
    params: object,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    md: StepMetadata,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """One layer's step (what the backend runs): write, attend, and for an extend step the
    ring rows last — the windows apply per query token (``oscar_kernels.extend_attention``),
    and a chunk's ring rows overwrite rows its first queries still read."""
    if md.all_decode:
        write_step(cache, params, k, v, md, backend)
        return attend_step(cache, params, q, k, v, md, scale, backend)
    write_step(cache, params, k, v, md, backend, parts="pages")
    out = attend_step(cache, params, q, k, v, md, scale, backend)
    write_step(cache, params, k, v, md, backend, parts="ring")
    return out
