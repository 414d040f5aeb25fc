"""SGLang 0.5.23: what oscar-sglang's shared glue needs that differs from other releases.

Radix tree (``mem_cache/radix_cache.py``, ``unified_radix_cache.py``): a match carries its
length (``MatchResult.device_prefix_len``), the token slots lie on the path to
``last_device_node``; ``RadixKey`` has a ``cache_salt`` namespace besides ``extra_key``; the
tree takes ownership of a request's tokens in ``checkpoint(req, *, up_to)`` (after every prefill
chunk and when the request finishes), which sets ``req.kv.cache_protected_len``. Requests keep
their row in ``req.kv.req_pool_idx``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

VERSION = "0.5.23"


def prefix_len(result: Any) -> int:
    return int(result.device_prefix_len)


def prefix_slot(tree: Any, result: Any, extra_key: Any, n: int) -> int:
    node = result.last_device_node
    core = getattr(tree, "tree_core", None)
    if core is not None and hasattr(core, "collect_full_device_indices"):  # UnifiedRadixCache
        path: torch.Tensor = core.collect_full_device_indices(node, tree.root_node_handle(extra_key))
    else:  # RadixCache
        path = tree.path_device_indices(node)
    return int(path[n - 1])


def short_key(key: Any, limit: int) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cap = limit if key.limit is None else min(limit, key.limit)
    return RadixKey(key.token_ids, key.extra_key, is_bigram=False, limit=cap, cache_salt=key.cache_salt)


def key_salt(key: Any) -> Any:
    return key.cache_salt


def req_salt(req: Any) -> Any:
    return req.cache_salt


def req_slot(req: Any) -> int | None:
    return req.kv.req_pool_idx


def publish_hooks(publish: Callable[..., None]) -> list[tuple[str, Callable[..., Any]]]:
    def checkpoint(original: Any, self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, req, *args, **kwargs)
        k_len = int(req.kv.cache_protected_len)
        publish(self, req, req.kv.req_pool_idx, k_len, req.full_untruncated_fill_ids[:k_len])
        return out

    return [("checkpoint", checkpoint)]


def extra_hooks() -> list[tuple[str, Callable[..., Any], Any]]:
    return []  # ReqToTokenPool.clear keeps req_generation monotonic here


#: method -> (positional args, keyword args) as decode_cuda_graph_runner.py / base_runner.py /
#: prefill_cuda_graph_runner.py call them on the attention backend ("fb": a ForwardBatch)
CUDA_GRAPH_CALLS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "init_cuda_graph_state": (("max_bs", "max_num_tokens"), ()),
    "get_cuda_graph_seq_len_fill_value": ((), ()),
    "init_forward_metadata_out_graph": (("fb",), ("in_capture",)),
    "init_forward_metadata_in_graph": (("fb",), ()),
    "on_after_cuda_graph_warmup": ((), ()),
    "shared_read_ends": (("forward_mode",), ()),
}
