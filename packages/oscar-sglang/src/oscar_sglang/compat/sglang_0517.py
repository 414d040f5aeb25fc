"""SGLang 0.5.17: what oscar-sglang's shared glue needs that differs from 0.5.23.

Radix tree (``mem_cache/radix_cache.py``, ``unified_radix_cache.py``): a match returns the
prefix's token slots themselves (``MatchResult.device_indices``, no ``device_prefix_len``);
``RadixKey`` has no ``cache_salt`` (the request folds it into ``extra_key``); there is no
``checkpoint``: the tree takes ownership of a request's tokens in ``cache_unfinished_req`` (after
every prefill chunk and after a prefill whose request goes on decoding; sets
``req.cache_protected_len``) and ``cache_finished_req(req, is_insert, *, kv_len_to_handle)``
(when it finishes: inserts its page-aligned ``kv_len_to_handle`` tokens, then the caller
frees the row). Requests keep their row in ``req.req_pool_idx`` (no ``req.kv.req_pool_idx``).
``ReqToTokenPool.clear()`` (``flush_cache``) zeroes ``req_generation``, which the window
bookkeeping reads as "this row changed hands": kept monotonic here, as 0.5.23 does itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

VERSION = "0.5.17"


def prefix_len(result: Any) -> int:
    return len(result.device_indices)


def prefix_slot(tree: Any, result: Any, extra_key: Any, n: int) -> int:
    return int(result.device_indices[n - 1])


def short_key(key: Any, limit: int) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cap = limit if key.limit is None else min(limit, key.limit)
    return RadixKey(key.token_ids, key.extra_key, is_bigram=False, limit=cap)


def key_salt(key: Any) -> None:
    return None  # Req.extra_key already carries the cache salt (schedule_batch.py)


def req_salt(req: Any) -> None:
    return None


def req_slot(req: Any) -> int | None:
    return req.req_pool_idx


def publish_hooks(publish: Callable[..., None]) -> list[tuple[str, Callable[..., Any]]]:
    def cache_unfinished_req(original: Any, self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, req, *args, **kwargs)
        k_len = int(req.cache_protected_len)  # what the tree now owns of this request
        publish(self, req, req.req_pool_idx, k_len, req.full_untruncated_fill_ids[:k_len])
        return out

    def cache_finished_req(
        original: Any, self: Any, req: Any, is_insert: bool = True, *args: Any, **kwargs: Any
    ) -> Any:
        slot = req.req_pool_idx  # read first: a streaming session takes the row inside
        out = original(self, req, is_insert, *args, **kwargs)
        kv_len = kwargs.get("kv_len_to_handle")
        if is_insert and kv_len is not None and not getattr(self, "disable_finished_insert", False):
            # the tree inserted the page-aligned part of the request's first kv_len tokens
            k_len = int(kv_len) // self.page_size * self.page_size
            publish(self, req, slot, k_len, (req.origin_input_ids + req.output_ids)[:k_len])
        return out

    return [("cache_unfinished_req", cache_unfinished_req), ("cache_finished_req", cache_finished_req)]


def _monotonic_clear(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
    gen = self.req_generation.clone()
    out = original(self, *args, **kwargs)
    self.req_generation.copy_(gen)
    return out


def extra_hooks() -> list[tuple[str, Callable[..., Any], Any]]:
    from sglang.srt.plugins.hook_registry import HookType

    return [("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.clear", _monotonic_clear, HookType.AROUND)]


#: method -> (positional args, keyword args) as decode_cuda_graph_runner.py / base_runner.py /
#: prefill_cuda_graph_runner.py call them on the attention backend ("fb": a ForwardBatch)
CUDA_GRAPH_CALLS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "init_cuda_graph_state": (("max_bs", "max_num_tokens"), ()),
    "get_cuda_graph_seq_len_fill_value": ((), ()),
    "init_forward_metadata_out_graph": (("fb",), ("in_capture",)),
    "init_forward_metadata_in_graph": (("fb",), ()),
    "on_after_cuda_graph_warmup": ((), ()),
}
