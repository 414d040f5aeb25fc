"""Transient window records: a KV-cache spec + manager that vLLM's scheduler runs for OSCAR.

With prefix caching, each INT2 layer also stores its BF16 window rows in *window records*,
pages of a sliding-window KV-cache group (docs/vllm.md, "Prefix caching"). A running request
reads its own window slot, never its records; only a request that starts from a prefix-cache
hit (or, with vLLM's V1 runner, one that lost its slot) restores from records. vLLM's own
``SlidingWindowManager`` nevertheless holds the last ``window`` tokens' records for every
running request (21 blocks of 16 tokens at SmolLM2's geometry: as many bytes as the request's
2k tokens of INT2 pages).

:class:`OscarWindowSpec` / :class:`OscarWindowManager` make records *transient*:

* a window block is freed as soon as every token of it has been processed (written), on the
  same processed-token basis vLLM frees sliding-window blocks on
  (``KVCacheManager.allocate_slots`` → ``remove_skipped_blocks``); it stays in the prefix
  cache under its block hash, evictable, so later hits can use it;
* a hit is accepted exactly as vLLM's sliding-window manager accepts one: only if the blocks
  of the ``window - 1`` tokens before it are all still cached (``find_longest_cache_hit``,
  inherited), and those blocks are held from admission until the step after the hit's first
  step, i.e. through the restore;
* per running request vLLM then counts one window block (the open one); the runtime admission
  cap is the in-flight chunk's blocks (``max_admission_blocks_per_request``).

Registered through vLLM's ``KVCacheSpecRegistry`` (public; :func:`register`), no vLLM file
patched. Safe only where a running request never needs its own records: with the V2 model
runner (slot = persistent ``req_idx``), and on the V1 runner behind the worker's record
stamps (:class:`oscar_kernels.serving.RecordStamps`), which refuse a restore from records that are
gone instead of reading them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oscar_math.errors import OscarError

from . import compat

SlidingWindowManager, SlidingWindowSpec = compat.sliding_window_api()

__all__ = ["OscarWindowSpec", "OscarWindowManager", "register", "check_admission"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, kw_only=True)
class OscarWindowSpec(SlidingWindowSpec):
    """A window-record page (same bytes as an INT2 page) whose records live only until written."""

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """Blocks one request may hold at once: its in-flight chunk's blocks plus the open block
        the chunk starts in (runtime admission cap; a hit's first step also holds the hit's
        ``window - 1`` tokens of records, checked against free blocks by vLLM at admission)."""
        return _cdiv(min(max_in_flight_tokens, max_model_len), self.block_size) + 1

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """Per running request: the one open (partially written) block. The blocks of the
        step's chunks are a per-step cost (at most ``max_num_batched_tokens / block + rows``
        blocks for the whole batch), not a per-request one; vLLM's per-request sizer cannot
        express that, so it is left to its allocation check and preemption (docs/vllm.md)."""
        return self.page_size_bytes


class OscarWindowManager(SlidingWindowManager):
    """vLLM's sliding-window manager, except that a running request's records are freed as soon
    as they are written (they stay cached and evictable under their block hashes)."""

    def __init__(self, kv_cache_spec: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self._requests: dict[str, Any] = {}  # running requests (their block hashes), by id

    def cache_blocks(self, request: Any, num_tokens: int, *args: Any, **kwargs: Any) -> None:
        self._requests[request.request_id] = request
        super().cache_blocks(request, num_tokens, *args, **kwargs)

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Free every block whose tokens are all processed (written): ``[0, processed // block)``.

        Called by vLLM before each chunk is allocated, with the processed (not the optimistic,
        in-flight) token count, so a block is never freed before the step that writes it ran.
        The blocks are cached under their hashes first: vLLM caches blocks only up to the
        scheduler's block alignment (128 tokens here), and a block freed before that would go
        back uncached. A hit's blocks (touched at admission, nulls before ``window - 1`` tokens)
        are freed here at the request's second step, after its first step restored from them.
        """
        del num_prompt_tokens
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        end = min(processed_computed_tokens // self.block_size, len(blocks))
        request = self._requests.get(request_id)
        if request is not None and end > self.num_cached_block.get(request_id, 0):
            super().cache_blocks(request, end * self.block_size, None, replay_boundaries=())
        self._remove_blocks_in_range(request_id, 0, end)

    def pop_blocks_for_free(self, request_id: str) -> list[Any]:
        self._requests.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)


_registered = False


def register(vllm_config: Any = None) -> None:
    """Register :class:`OscarWindowSpec` with :class:`OscarWindowManager` (idempotent).

    vLLM registers its built-in specs lazily, on the registry's first use and only while the
    registry is empty; registering ours first would leave vLLM's own specs out. So the built-ins
    are registered first, through the public ``check_kv_cache_spec_registry`` (an empty check).
    """
    global _registered
    if _registered:
        return
    compat.register_kv_spec(OscarWindowSpec, OscarWindowManager, SlidingWindowSpec, vllm_config)
    _registered = True


def check_admission(vllm_config: Any, kv_cache_config: Any) -> None:
    """Refuse at start-up a KV pool that could never admit one request.

    vLLM sizes the pool with each spec's per-request bytes, which for transient records count one
    window block; but admitting a request's chunk also takes the window blocks of the chunk's tokens
    (:meth:`OscarWindowSpec.max_admission_blocks_per_request`). A pool smaller than one request of
    ``max_model_len`` plus those blocks passes vLLM's own check and then never schedules anything
    (seen on the CPU build: 19 blocks, a 600-token prompt needing 22, the engine waiting forever).

    Raises:
        OscarError: one line with the numbers and what to change.
    """
    if kv_cache_config is None or not getattr(kv_cache_config, "kv_cache_groups", None):
        return
    max_len = int(vllm_config.model_config.max_model_len)
    in_flight = compat.in_flight_tokens(vllm_config)
    need = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, OscarWindowSpec):
            need += spec.max_admission_blocks_per_request(
                max_in_flight_tokens=in_flight, max_model_len=max_len
            )
        else:
            need += _cdiv(max_len, int(spec.block_size))
    have = int(kv_cache_config.num_blocks)
    if have < need:
        chunk = min(in_flight, max_len)  # a request's chunk never exceeds max_model_len
        raise OscarError(
            f"the KV cache has {have} blocks, but one request of max_model_len {max_len} needs {need} "
            f"(its pages and the window records of a {chunk}-token chunk); give the KV cache more memory "
            "(--kv-cache-memory-bytes / --gpu-memory-utilization) or lower --max-model-len, "
            "--max-num-batched-tokens or --max-num-seqs"
        )
