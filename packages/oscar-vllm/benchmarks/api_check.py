"""Check every vLLM name and signature oscar-vllm relies on against the importable vLLM.

No model, no device: imports, signatures, dataclass fields, KV-cache spec arithmetic and a
few source facts (the call order the plugin depends on). Run it against the installed vLLM
(the nox session does, through ``test_vllm_plugin.py``) or against another release's Python
sources without installing it, e.g. vLLM 0.33.0, which has no CPU build::

    pip download vllm==0.33.0 --no-deps -d /tmp/v33 && cd /tmp/v33 && unzip -q vllm-0.33.0-*.whl 'vllm/*.py'
    PYTHONPATH=/tmp/v33 python packages/oscar-vllm/benchmarks/api_check.py

(the compiled extensions are not needed for these checks). Prints one line per check and
exits 1 if any fails.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from collections.abc import Callable


def _params(fn: Callable) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _has_params(fn: Callable, *names: str) -> None:
    missing = [n for n in names if n not in _params(fn)]
    assert not missing, f"{fn.__qualname__} lacks parameters {missing}"


def _source_has(obj: object, *snippets: str) -> None:
    src = inspect.getsource(obj)  # type: ignore[arg-type]
    missing = [s for s in snippets if s not in src]
    assert not missing, f"{getattr(obj, '__qualname__', obj)} no longer contains {missing}"


def check_version() -> str:
    from oscar_vllm import compat

    version = compat.check_version()
    return version


def check_registry() -> str:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from oscar_vllm import compat

    compat.register_backend()
    assert AttentionBackendEnum["OSCAR"].get_class().__name__ == "OscarAttentionBackend"
    assert "CPU_ATTN" in AttentionBackendEnum.__members__
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return f"OSCAR registered; CPU_ATTN layouts {CPUAttentionBackend.supported_kv_cache_layouts()}"


def check_backend_api() -> str:
    from vllm.v1.attention import backend as api

    from oscar_vllm.backend import OscarAttentionImpl, OscarMetadataBuilder

    for name in ("customize_spec", "supported_kv_cache_layouts", "get_supported_kernel_block_sizes",
                 "supports_alibi_sqrt", "supports_attn_type", "get_supported_head_sizes"):  # fmt: skip
        assert callable(getattr(api.AttentionBackend, name, None)), f"AttentionBackend.{name} is gone"
    assert _params(api.AttentionImpl.forward) == _params(OscarAttentionImpl.forward), (
        "AttentionImpl.forward changed"
    )
    _has_params(api.AttentionImplBase.process_weights_after_loading, "act_dtype")
    assert _params(api.AttentionMetadataBuilder.__init__)[:5] == _params(OscarMetadataBuilder.__init__)[:5]
    _has_params(api.AttentionMetadataBuilder.build, "common_prefix_len", "common_attn_metadata", "fast_build")
    fields = {f.name for f in dataclasses.fields(api.CommonAttentionMetadata)}
    needed = {"query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu_upper_bound",
              "block_table_tensor", "slot_mapping", "num_reqs", "req_idx"}  # fmt: skip
    assert needed <= fields, f"CommonAttentionMetadata lacks {sorted(needed - fields)}"
    return "AttentionBackend/Impl/MetadataBuilder/CommonAttentionMetadata as used"


def check_specs() -> str:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout, UniformTypeKVCacheSpecs
    from vllm.v1.worker.utils import customize_attention_spec

    from oscar_kernels.serving import cell_bytes
    from oscar_vllm import backend, compat

    bf16 = FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    backend._Process.group = 64
    int2 = customize_attention_spec(backend.OscarAttentionBackend, bf16)
    assert int2.page_size_bytes == 3 * 128 * cell_bytes(64, 64), int2
    both = UniformTypeKVCacheSpecs.from_specs({"int2": int2, "bf16": bf16})
    assert both is not None and both.page_size_bytes == int2.page_size_bytes + bf16.page_size_bytes
    assert compat.kv_cache_layouts() == (KVCacheLayout.LBHNC,) and KVCacheLayout.LBHNC.is_block_compact
    return f"INT2 page {int2.page_size_bytes} B + BF16 page {bf16.page_size_bytes} B in one uniform-type spec"


def check_grouping() -> str:
    # 0.32: vllm.v1.core.kv_cache_utils; 0.33 moved the planning to kv_cache_planning
    for mod_name in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        if hasattr(mod, "get_kv_cache_groups"):
            src = inspect.getsource(mod.get_kv_cache_groups)
            first, unify = (
                src.find("UniformTypeKVCacheSpecs.from_specs"),
                src.find("unify_kv_cache_spec_page_size("),
            )
            assert 0 <= first < unify, (
                "get_kv_cache_groups no longer tries one uniform-type group before unifying"
            )
            return f"{mod_name}.get_kv_cache_groups: one group for mixed page sizes before any unification"
    raise AssertionError("get_kv_cache_groups not found")


def check_config_and_engine() -> str:
    from vllm.config import AttentionConfig, CacheConfig, CompilationConfig, set_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_rank  # noqa: F401
    from vllm.v1.attention.selector import get_attn_backend
    from vllm.v1.engine import core

    from oscar_vllm import compat

    assert compat.current_config() is None  # no config set: get_current_vllm_config raises AssertionError
    assert callable(set_current_vllm_config)
    for cls, names in ((AttentionConfig, {"backend"}),
                       (CacheConfig, {"enable_prefix_caching", "kv_cache_memory_bytes", "block_size"}),
                       (CompilationConfig, {"static_forward_context"})):  # fmt: skip
        fields = {f.name for f in dataclasses.fields(cls)}
        assert names <= fields, f"{cls.__name__} lacks {sorted(names - fields)}"
    _has_params(
        get_attn_backend, "head_size", "dtype", "kv_cache_dtype", "has_sink", "use_mm_prefix", "attn_type"
    )
    assert _params(core.EngineCore._initialize_kv_caches) == ["self", "vllm_config"]
    _source_has(core.EngineCore.__init__, "self._initialize_kv_caches(vllm_config)", "Scheduler(")
    assert compat.guard_possible()
    return "configs, get_attn_backend, EngineCore._initialize_kv_caches (before the scheduler)"


def check_attention_layer() -> str:
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.model_loader import utils as loader_utils

    assigned = ("self.attn_backend =", "self.impl =", "self.backend =", "self.layer_name = prefix",
                "self.kv_cache_dtype =", "self.attn_type =", "[prefix] = self")  # fmt: skip
    _source_has(Attention.__init__, *assigned)
    _source_has(Attention.get_attn_backend, "return self.attn_backend")
    _source_has(Attention.process_weights_after_loading, "self.impl.process_weights_after_loading(act_dtype)")
    _source_has(
        loader_utils.process_weights_after_loading, "module.process_weights_after_loading(model_config.dtype)"
    )
    return "Attention layer attributes and the load-time hook exclude_layers uses"


def check_window_groups() -> str:
    """What exact prefix caching relies on (docs/vllm.md, "Prefix caching")."""
    import torch
    from vllm.config import CacheConfig, SchedulerConfig
    from vllm.forward_context import get_forward_context  # noqa: F401
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from oscar_kernels.serving import cell_bytes
    from oscar_vllm import backend, compat

    assert "disable_hybrid_kv_cache_manager" in {f.name for f in dataclasses.fields(SchedulerConfig)}
    # window blocks are cached densely when the retention interval is None (OSCAR sets it)
    assert "prefix_cache_retention_interval" in {f.name for f in dataclasses.fields(CacheConfig)}
    _source_has(KVCacheCoordinator.__init__, "kv_cache_config.prefix_cache_retention_interval")
    _source_has(SlidingWindowManager.reachable_block_mask, "retention_interval is None")
    assert issubclass(backend.OscarWindowLayer, AttentionLayerBase)
    # the runner collects specs from every AttentionLayerBase in static_forward_context
    _source_has(GPUModelRunner.get_kv_cache_spec, "get_layers_from_vllm_config(self.vllm_config, layer_type)")
    # a window page (16-token window blocks) is exactly an INT2 page (128-token blocks);
    # SlidingWindowSpec keeps its manager
    cell = cell_bytes(64, 64)
    int2 = FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16,
                             state_content_bytes=cell)  # fmt: skip
    win = compat.window_spec(16, 3, 64, torch.bfloat16, 256, cell * 128 // 16)
    assert isinstance(win, SlidingWindowSpec) and win.page_size_bytes == int2.page_size_bytes
    assert KVCacheSpecRegistry.get_manager_class(win) is SlidingWindowManager
    # a hit needs the blocks of the last `window - 1` tokens cached; blocks before
    # `computed - window + 1` are freed: the window covers (N - recent, N)
    assert SlidingWindowManager._contiguous_blocks_for_hit(256, 16, False) == 16
    _source_has(SlidingWindowManager.get_num_skipped_tokens, "num_computed_tokens - self.sliding_window + 1")
    # groups: 30 INT2 layers + 30 window layers -> 2 groups of 30 layers, one page size, two block
    # sizes (the scheduler's block is their lcm, hashes at their gcd)
    for mod_name in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        if hasattr(mod, "_get_kv_cache_groups_uniform_page_size"):
            break
    specs = {f"model.layers.{i}.self_attn.attn": int2 for i in range(30)}
    specs |= {f"model.layers.{i}.self_attn.attn.oscar_window_0": win for i in range(30)}
    groups = mod._get_kv_cache_groups_uniform_page_size(mod.unify_kv_cache_spec_page_size(specs))
    assert len(groups) == 2 and all(len(g.layer_names) == 30 for g in groups), [
        len(g.layer_names) for g in groups
    ]
    assert sorted(g.kv_cache_spec.block_size for g in groups) == [16, 128]
    sizes = next(
        (getattr(importlib.import_module(m), "resolve_kv_cache_block_sizes", None) for m in
         ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning")),
        None,
    )  # fmt: skip
    assert sizes is not None, "resolve_kv_cache_block_sizes (per-group block sizes) not found"
    _source_has(sizes, "math.lcm")
    # CUDA graphs: the builder answers get_cudagraph_support; capture builds through
    # build_for_cudagraph_capture
    from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder

    assert AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE.value == 1 and AttentionCGSupport.NEVER.value == 0
    assert callable(AttentionMetadataBuilder.get_cudagraph_support)
    assert callable(AttentionMetadataBuilder.build_for_cudagraph_capture)
    pages = f"window pages of {win.page_size_bytes} B"
    return f"{pages}: 1 sliding-window group of 16-token blocks + the INT2 group ({mod_name})"


def check_transient_records() -> str:
    """What transient window records rely on (records.py; docs/vllm.md, "Transient records")."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import (
        SingleTypeKVCacheManager,
        SlidingWindowManager,
        get_manager_for_kv_cache_spec,
    )
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from oscar_vllm import compat, records

    # public registration, built-ins first (registered lazily only while the registry is empty)
    _has_params(KVCacheSpecRegistry.register, "kvcache_spec_cls", "manager_class", "uniform_type_base_spec")
    _has_params(KVCacheSpecRegistry.check_kv_cache_spec_registry, "kv_cache_spec")
    _source_has(KVCacheSpecRegistry._ensure_registered, "if _REGISTRY_KVCACHESPEC_LIST:")
    records.register()
    win = compat.window_spec(16, 3, 64, torch.bfloat16, 256, 120, spec_class=records.OscarWindowSpec)
    assert KVCacheSpecRegistry.get_manager_class(win) is records.OscarWindowManager
    # the manager hooks: frees on the processed-token basis, caches up to the scheduler block only
    _has_params(SingleTypeKVCacheManager.remove_skipped_blocks, "request_id", "processed_computed_tokens")
    _source_has(KVCacheManager.allocate_slots, "total_computed_tokens - request.num_in_flight_tokens")
    _has_params(SingleTypeKVCacheManager.cache_blocks, "request", "num_tokens", "retention_interval")
    _has_params(SingleTypeKVCacheManager._remove_blocks_in_range, "request_id", "first_block", "last_block")
    for name in ("req_to_blocks", "num_cached_block"):
        _source_has(SingleTypeKVCacheManager.__init__, f"self.{name}")
    _source_has(SingleTypeKVCacheManager.pop_blocks_for_free, "self.req_to_blocks.pop(request_id")
    # admission cap and sizer come from the spec's own methods
    _source_has(get_manager_for_kv_cache_spec, "kv_cache_spec.max_admission_blocks_per_request(")
    assert issubclass(records.OscarWindowManager, SlidingWindowManager)
    return f"OscarWindowSpec -> OscarWindowManager; {win.max_memory_usage_bytes(None)} B counted per request"


def check_v1_request_rows() -> str:
    """What the V1 runner's request hook relies on (compat.track_v1_requests): the runner applies
    each scheduler output in ``_update_states`` (finished ids first, rows ordered at its end) inside
    ``execute_model``; scheduler outputs name finished, preempted and resumed requests."""
    from dataclasses import fields

    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from oscar_vllm import compat

    assert compat.track_v1_requests(), "the V1 runner lacks _update_states / execute_model"
    _has_params(GPUModelRunner._update_states, "scheduler_output")
    _source_has(GPUModelRunner.execute_model, "self._update_states(scheduler_output)")
    update = GPUModelRunner._update_states
    _source_has(update, "scheduler_output.finished_req_ids", "self._may_reorder_batch(")
    assert isinstance(inspect.getattr_static(InputBatch, "req_ids"), property)
    names = {f.name for f in fields(SchedulerOutput)}
    assert {"finished_req_ids", "preempted_req_ids"} <= names, names
    assert "resumed_req_ids" in {f.name for f in fields(CachedRequestData)}
    return "GPUModelRunner._update_states / execute_model wrapped; finished, preempted, resumed ids"


CHECKS = (check_version, check_registry, check_backend_api, check_specs, check_grouping,
          check_config_and_engine, check_attention_layer, check_window_groups,
          check_transient_records, check_v1_request_rows)  # fmt: skip


def main() -> int:
    import vllm

    print(f"vLLM {getattr(vllm, '__version__', '?')} from {vllm.__file__}")
    failed = 0
    for check in CHECKS:
        try:
            print(f"ok    {check.__name__}: {check()}")
        except Exception as e:  # report every check, then fail
            failed += 1
            print(f"FAIL  {check.__name__}: {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
