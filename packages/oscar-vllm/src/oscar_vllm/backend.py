"""The ``OSCAR`` attention backend for vLLM's v1 engine.

* KV-cache spec: each (KV head, token) cell of a page is ``d/2 + 8·d/group`` bytes (K and V
  INT2 codes + bf16 scale/zero), so vLLM's allocator sizes pages with
  :func:`oscar_kernels.page_bytes` and really gives ~6–7× the BF16 token count.
* BF16 sink/recent windows: one row per sequence slot (``max_num_seqs`` rows per layer),
  allocated when the layer is built, so they are part of the non-KV memory vLLM measures
  (GPU profiling, CPU RSS); with an explicit ``kv_cache_memory_bytes`` the backend takes
  their size out of that budget.
* Prefix caching (when :func:`oscar_vllm.compat.exact_prefix_caching`): each layer also keeps
  its BF16 window rows in pages of a vLLM sliding-window KV-cache group (window blocks smaller
  than the INT2 block, same page bytes), declared by *window layers* registered beside it
  (:class:`OscarWindowLayer`); a row whose window slot does not hold its windows (a hit, a
  request that lost its slot: :class:`oscar_kernels.serving.SlotTracker`) restores it from them, so
  a cache hit computes what a miss computes (docs/vllm.md, "Prefix caching").
* CUDA graphs: FULL graphs of pure decode batches, with prefix caching too on vLLM's V2 model
  runner; none with prefix caching on the V1 runner (:func:`oscar_vllm.compat.cudagraph_support`);
  the builder keeps each step's metadata in persistent buffers
  (:class:`oscar_kernels.serving.StepBuffers`) that a replay reads.
* ``exclude_layers``: those layers leave OSCAR once the model is loaded
  (:meth:`OscarAttentionImpl.process_weights_after_loading`): vLLM's own backend takes
  them over, with a plain BF16 page; vLLM then keeps both page sizes in one KV-cache
  group (docs/vllm.md, "Layers kept in BF16").
* Per step: write every new token (:func:`oscar_kernels.paged_write`), then attend —
  :func:`oscar_kernels.decode_attention` when every row is a one-token decode, else
  :func:`oscar_kernels.extend_attention` over the whole mixed batch (a decode row is a
  one-token chunk), which applies the windows per query token: its step writes the INT2
  rows + sink before attention and the ring rows after (:func:`oscar_kernels.serving.run_layer`).
  CUDA tensors run the Triton kernels, CPU tensors the torch references.

Version-specific glue lives in :mod:`oscar_vllm.compat`; options in :mod:`oscar_vllm.settings`.
"""

from __future__ import annotations

import json
import logging
from contextlib import nullcontext
from dataclasses import replace
from typing import Any, ClassVar

import torch

from oscar_kernels import (
    CacheLayout,
    LayerQuantParams,
    PagedKVCache,
    cache_from_page_buffer,
    page_bytes,
    torch_flash_attention,
)
from oscar_kernels.serving import (
    FreshRows,
    RecordStamps,
    RequestSlots,
    SlotTracker,
    StepBuffers,
    StepPlan,
    WindowPages,
    WindowPlan,
    WindowSlots,
    beside,
    cell_bytes,
    check_head_dim,
    gather_columns,
    join_layer,
    kv_heads_of_rank,
    plan_slots,
    plan_step,
    plan_window_records,
    prefill_kernel,
    rank_layout,
    restore_window_rows,
    run_layer,
    shard_params,
    step_record,
    write_window_pages,
)
from oscar_math.errors import OscarError

from . import compat, startup
from .settings import load_checked, settings_from
from .warmup import compile_ahead_engine, warm_up_engine

_attn = compat.attention_api()  # vLLM's attention interface
AttentionBackend, AttentionImpl, AttentionMetadataBuilder = (
    _attn.AttentionBackend, _attn.AttentionImpl, _attn.AttentionMetadataBuilder,
)  # fmt: skip
AttentionType, CommonAttentionMetadata, MultipleOf = (
    _attn.AttentionType,
    _attn.CommonAttentionMetadata,
    _attn.MultipleOf,
)

log = logging.getLogger("oscar_vllm")

# Options (settings.py, oscar_kernels.serving.settings): ``step_log`` appends every step's batch
# as a JSON line (docs/vllm.md, "Reproducibility"); ``identity_restores`` (default on) restores
# windows by request identity on vLLM's V2 runner (serving.FreshRows fed by compat.track_v2_rows),
# off by the content tracker's per-step read of block ids (serving.plan_slots); ``split_extend``
# (default on) splits a short chunk's INT2 keys over more programs where the grid leaves SMs idle.


class _Process:
    """What this process's OSCAR layers share with vLLM calls that get no config (``customize_spec``)."""

    group: int | None = None  # the group size of the artifact the layers loaded


class EngineState:
    """One engine's OSCAR state in this process: its settings, the V1 runner's request slots and
    the metadata builders' hand-over (:class:`_StepExchange`). One per engine config
    (:func:`engine_state`); a new engine (a new config object) gets a new one."""

    def __init__(self, vllm_config: Any) -> None:
        self.cfg = vllm_config
        self.settings = settings_from(
            getattr(vllm_config, "additional_config", None), require_rotations=False
        )
        self.request_slots: RequestSlots | None = None
        self.request_slots_tried = False
        self.exchange = _StepExchange(vllm_config)


_ENGINE: list[EngineState] = []  # the current engine's state (one engine per process at a time)


def engine_state(vllm_config: Any) -> EngineState:
    """The :class:`EngineState` of ``vllm_config``'s engine (made at its first use)."""
    if not _ENGINE or _ENGINE[0].cfg is not vllm_config:
        _ENGINE[:] = [EngineState(vllm_config)]
    return _ENGINE[0]


__all__ = [
    "OscarAttentionBackend",
    "OscarMetadata",
    "OscarMetadataBuilder",
    "OscarAttentionImpl",
    "OscarWindowBackend",
    "OscarWindowLayer",
]

#: suffix of the window layers of an INT2 layer (``<layer name>.oscar_window_<g>``)
WINDOW_SUFFIX = ".oscar_window_"


def _artifact_for(vllm_config: Any):  # noqa: ANN202 - Rotations
    """Load (once per process) and check the artifact against the model in ``vllm_config``."""
    mc = vllm_config.model_config
    settings = settings_from(getattr(vllm_config, "additional_config", None))
    hf = mc.hf_text_config
    num_layers = int(hf.num_hidden_layers)
    total_kv = int(mc.get_total_num_kv_heads())
    return load_checked(settings, num_layers, total_kv, int(mc.get_head_size()))


class _OscarBackendBase(AttentionBackend):
    """What the INT2 layers' backend and the window layers' backend declare alike."""

    accept_output_buffer: bool = True
    # The write needs the per-step metadata (positions, window slots), so it runs in forward.
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "bfloat16", "float16"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple | None:
        return compat.kv_cache_layouts()


class OscarAttentionBackend(_OscarBackendBase):
    """vLLM attention backend over the OSCAR paged INT2 + BF16-window cache."""

    @staticmethod
    def get_name() -> str:
        return compat.BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[OscarAttentionImpl]:
        return OscarAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[OscarMetadataBuilder]:
        return OscarMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [d for d in range(16, 513, 16)]

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        """Declare the real INT2 page: ``state_content_bytes`` = one (KV head, token) cell."""
        if spec.state_content_bytes is not None:
            return spec
        # called after the layers were built (outside vLLM's config context): the group size
        # comes from the artifact their implementations loaded in this process
        group = _Process.group
        if group is None:  # a process that built no layer (e.g. a planner): read the artifact
            cfg = compat.current_config()
            try:
                group = _artifact_for(cfg).group_size if cfg is not None else spec.head_size
            except OscarError:
                group = spec.head_size  # the layers report the artifact problem at start-up
        return replace(spec, state_content_bytes=cell_bytes(spec.head_size, group))


def _request_slots(vllm_config: Any, num_slots: int) -> RequestSlots | None:
    """The engine's :class:`~oscar_kernels.serving.RequestSlots`, fed by the V1 runner hook; ``None``
    where the hook cannot be installed (then slots follow content or first blocks)."""
    st = engine_state(vllm_config)
    if not st.request_slots_tried:
        st.request_slots_tried = True
        slots = RequestSlots(num_slots)
        st.request_slots = slots if compat.track_v1_requests(slots, vllm_config) else None
    return st.request_slots


#: one step's batch, shared by every layer (see :class:`oscar_kernels.serving.StepPlan`)
OscarMetadata = StepPlan


class OscarMetadataBuilder(AttentionMetadataBuilder[StepPlan]):
    """Builds :class:`~oscar_kernels.serving.StepPlan`; gives every live request a window slot.

    The slot is vLLM's persistent request row when the model runner provides it
    (``req_idx``, V2 runner), else the request id's slot (:class:`~oscar_kernels.serving.RequestSlots`,
    V1 runner, e.g. on CPU); only where neither exists does :class:`~oscar_kernels.serving.WindowSlots`
    key it by the request's first KV block.
    """

    reorder_batch_threshold: int | None = 1

    def __init__(
        self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        sc = vllm_config.scheduler_config
        self.settings = engine_state(vllm_config).settings
        self.max_seqs = int(sc.max_num_seqs)
        self.slots = WindowSlots(self.max_seqs)
        # the V1 runner gives no persistent request row: slots by request id
        # (oscar_kernels.serving.RequestSlots), one instance per engine, shared by the engine's builders
        v2 = compat.uses_v2_runner(vllm_config)
        self.requests = None if v2 else _request_slots(vllm_config, self.max_seqs)
        # with prefix caching SlotTracker knows what each slot holds: a request whose slot holds
        # its windows uses them, anything else (a hit) restores from the window pages
        self.cached = compat.exact_prefix_caching(vllm_config)
        self.tracker = SlotTracker(self.max_seqs)
        # where slots follow request identity a restore is due exactly at a request's first step
        # in its slot (oscar_kernels.serving.FreshRows): no block ids read back from the device, so a step's
        # metadata build never waits for the previous step's kernels
        if v2:
            gen = compat.track_v2_rows(vllm_config) if self.settings.identity_restores else None
        else:
            gen = getattr(self.requests, "generation", None)
        self.fresh = FreshRows(gen) if self.cached and gen is not None else None
        # transient window records (records.py) are safe by construction where slots are request
        # rows (a running request never restores; vLLM accepts a hit only while its records are
        # cached); on the V1 runner every restore is also checked against record stamps, which
        # also covers a vLLM whose runner the request hook could not wrap
        transient = compat.window_records_mode(vllm_config) == "transient"
        self.stamps = RecordStamps() if transient and not compat.uses_v2_runner(vllm_config) else None
        # with prefix caching the window groups' builders run the step's restores (_StepExchange)
        self.exchange = _exchange(vllm_config) if self.cached else None
        self._step_no = 0
        self.block_size = int(getattr(kv_cache_spec, "block_size", vllm_config.cache_config.block_size))
        # CUDA graphs replay the addresses seen at capture: every step's metadata is copied into
        # these persistent tensors (CUDA only; the CPU platform has no graphs)
        self.buffers = (
            StepBuffers(self.max_seqs, max(int(sc.max_num_batched_tokens), self.max_seqs), device)
            if torch.device(device).type == "cuda"
            else None
        )
        self._capturing = False
        self.last_layer = last_layer_of(layer_names)

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> Any:
        """FULL graphs of pure decode batches (with prefix caching only on vLLM's V2 model runner):
        :func:`oscar_vllm.compat.cudagraph_support`."""
        return compat.cudagraph_support(vllm_config)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> StepPlan:
        # capture batches are dummies (no requests): window slots 0..B-1, no slot bookkeeping
        self._capturing = True
        try:
            return self.build(0, common_attn_metadata)
        finally:
            self._capturing = False

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> StepPlan:
        cm = common_attn_metadata
        seq_cpu = getattr(cm, "seq_lens_cpu_upper_bound", None)
        seq_cpu = seq_cpu if seq_cpu is not None else cm.seq_lens.cpu()
        rows = compat.request_slots(cm)
        if rows is None and self.requests is not None and not self._capturing:
            rows = self.requests.rows_for(cm.num_reqs)
        restore: list[tuple[int, int, int]] = []
        if self._capturing:
            rows = [i % self.max_seqs for i in range(cm.num_reqs)]
        elif self.cached and rows is not None and self.fresh is not None:
            rows, restore = self.fresh.plan(cm.query_start_loc_cpu, seq_cpu, rows, cm.num_reqs)
            self.tracker.restores += len(restore)
        elif self.cached:
            rows, restore = self._plan_cached(cm, seq_cpu, rows)
        md = plan_step(
            cm.query_start_loc,
            cm.query_start_loc_cpu,
            cm.seq_lens,
            seq_cpu,
            cm.block_table_tensor,
            cm.slot_mapping,
            cm.num_reqs,
            None if rows is None else torch.as_tensor(rows, dtype=torch.int32),
            self.slots,
            num_tokens=int(cm.num_actual_tokens),
            async_copy=self.fresh is not None,
        )
        self._step_no += 1
        md = replace(
            md, restore=tuple(restore), stamps=self.stamps, step_no=self._step_no, last_layer=self.last_layer
        )
        if self.buffers is not None:
            md = self.buffers.hold(md)
        if self.exchange is not None and not self._capturing:
            self.exchange.plan(md)
        path = self.settings.step_log
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(step_record(md)) + "\n")
        return md

    def _plan_cached(
        self, cm: CommonAttentionMetadata, seq_cpu: torch.Tensor, fixed: Any
    ) -> tuple[list[int], list[tuple[int, int, int]]]:
        """Window slots and rows to restore with prefix caching by slot content
        (:func:`oscar_kernels.serving.plan_slots`), where :class:`~oscar_kernels.serving.FreshRows` does not
        serve: the runner gives no request identity, or V2's identity restores are off.

        Copies the few block-table entries it needs to the host: a device-to-host copy on the GPU
        that waits for the previous step's kernels (docs/vllm.md, "H200, 2026-12-03 evening")."""
        b = cm.num_reqs
        return plan_slots(
            self.tracker,
            cm.query_start_loc_cpu,
            seq_cpu,
            cm.block_table_tensor,
            b,
            self.block_size,
            None if fixed is None else [int(x) for x in list(fixed)[:b]],
        )


def last_layer_of(layer_names: list[str]) -> str:
    """The last decoder layer a step runs among a KV-cache group's attention layers (by index, not
    by name: ``layers.10`` runs after ``layers.9``): where its deferred joins end (:func:`join_later`)."""
    return max(layer_names, key=compat.layer_index) if layer_names else ""


def join_later(md: StepPlan, layer_name: str) -> bool:
    """Whether layer ``layer_name`` leaves its decode write's INT2 pass (and window records) open
    on the second stream for the next layer's :func:`~oscar_kernels.serving.run_layer` to join:
    only inside a FULL CUDA graph's capture of a decode step and not in the step's last layer
    (a capture must end joined). Then nothing of the step waits for the pass. Eagerly and between
    piecewise graphs, whose replays reuse the step's key and value memory, a layer joins its own."""
    return (
        md.all_decode
        and bool(md.last_layer)
        and layer_name != md.last_layer
        and torch.cuda.is_available()
        and torch.cuda.is_current_stream_capturing()
    )


class OscarAttentionImpl(AttentionImpl):
    """One decoder layer: quantising writes and attention through oscar-kernels."""

    #: what the engine warm-up (:mod:`oscar_vllm.warmup`) looks for among the model's layers
    oscar_layer = True

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **_: Any,
    ) -> None:
        compat.check_version()
        for what, bad in (
            ("ALiBi", alibi_slopes is not None),
            ("sliding-window attention", sliding_window is not None),
            ("logit soft-capping", bool(logits_soft_cap)),
            (f"attention type {attn_type}", attn_type != AttentionType.DECODER),
            ("KV sharing between layers", kv_sharing_target_layer_name is not None),
        ):
            if bad:
                raise OscarError(f"the OSCAR attention backend does not support {what}")
        check_head_dim(head_size)
        # what vLLM's own backend is built with if this layer is excluded (BF16)
        self._impl_args = (
            *(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window),
            *(kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name),
        )
        self._impl_kwargs = dict(_)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.kv_sharing_target_layer_name = None
        cfg = compat.current_config()
        compat.check_prefix_caching(cfg)
        self.rotations = _artifact_for(cfg)
        self.excluded = frozenset(settings_from(getattr(cfg, "additional_config", None)).exclude_layers)
        self.cached = compat.exact_prefix_caching(cfg)  # window rows also kept in window pages
        self.transient = compat.window_records_mode(cfg) == "transient"  # records.py
        startup.announce_active(cfg, self.rotations)  # the "OSCAR active" log line, once per process
        compat.pin_triton_cache()  # before the model compiles (layers are built first)
        self.window_names: list[str] = []
        self._pages: WindowPages | None = None
        self._plan: WindowPlan | None = None
        self._cfg = cfg
        rot = self.rotations
        _Process.group = rot.group_size
        pc = cfg.parallel_config
        self.heads = kv_heads_of_rank(
            int(cfg.model_config.get_total_num_kv_heads()), pc.tensor_parallel_size, _tp_rank()
        )
        if len(self.heads) != num_kv_heads:
            raise OscarError(f"OSCAR: this rank holds {num_kv_heads} KV heads, expected {len(self.heads)}")
        self.layout = rank_layout(rot, num_kv_heads, head_size, int(cfg.cache_config.block_size))
        self.max_seqs = int(cfg.scheduler_config.max_num_seqs)
        self.device = torch.device(cfg.device_config.device)
        check_head_dim(head_size, on_gpu=self.device.type == "cuda")
        self.windows: tuple[torch.Tensor, ...] | None = None
        if not self.excluded:  # else the layer index is known after loading (process_weights_after_loading)
            self._allocate_windows()
        self._cache: PagedKVCache | None = None
        self._cache_src: int | None = None
        self._params = None
        self._rotated = False  # R_V folded into o_proj (fold.py): outputs stay rotated
        # prefill chunks through vLLM's own FlashAttention (oscar_kernels.extend_dense), else torch's,
        # whichever passes the start-up check first (dense_prefill: false keeps the Triton kernel)
        self._dense = None
        if self.device.type == "cuda" and engine_state(cfg).settings.dense_prefill:
            self._dense = prefill_kernel(
                [("vLLM's FlashAttention", lambda: compat.dense_attention(head_size)),
                 ("torch's FlashAttention-2", torch_flash_attention)],
                self.device, head_size, num_kv_heads, max(1, num_heads // num_kv_heads),
                cfg.model_config.dtype, log,
            )  # fmt: skip
        # a short chunk over a long prefix (a prefix hit's tail) split over more programs where the
        # grid leaves SMs idle (H200: a 16-token tail over 100k tokens 21x faster, docs/vllm.md);
        # OSCAR_VLLM_SPLIT_EXTEND=0 turns it off
        self._splits: int | str = "auto" if engine_state(cfg).settings.split_extend else 1
        self._overlap = engine_state(cfg).settings.overlap_write
        self._overlap_layers = self._overlap and engine_state(cfg).settings.overlap_layers
        # the query rotation beside the window pass (run_layer's overlap_rotation) stays off: on the
        # H100 it saved 2 µs a layer at 1 x 130k but cost 6 at 8 x 32k (docs/performance.md)
        self._overlap_rotation = False
        if self.device.type == "cuda":  # Triton compiles at engine start (warmup.py), not in requests
            compat.after_model_warm_up(warm_up_engine)
            compat.after_profiling_kv_cache(compile_ahead_engine)

    def _allocate_windows(self) -> None:
        # Allocated (and touched) while the model is loaded, so they count as non-KV memory.
        self.windows = _windows(self.layout, self.max_seqs, self.device)
        _take_from_explicit_budget(self._cfg, sum(w.numel() * w.element_size() for w in self.windows))

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Hand an excluded layer to vLLM's own backend; give an INT2 layer its BF16 windows.

        vLLM calls this once the model is loaded and before it asks the layers for their
        KV-cache specs, so an excluded layer's spec, builder and KV write are the default
        backend's (a plain BF16 page) and OSCAR allocates nothing for it.
        """
        if self.cached:
            self._add_window_layers()
        if not self.excluded:
            self._prepare_params(compat.layer_of_impl(self._cfg, self)[0])
            return
        name, layer = compat.layer_of_impl(self._cfg, self)
        if compat.layer_index(name) in self.excluded:
            backend = compat.serve_with_default_backend(
                self._cfg, layer, self._impl_args, self._impl_kwargs, act_dtype
            )
            log.info("OSCAR: %s is excluded: BF16 KV cache through vLLM's %s", name, backend.get_name())
        else:
            if self.windows is None:
                self._allocate_windows()
            self._prepare_params(name)

    def _prepare_params(self, layer_name: str) -> None:
        """This layer's rotations etc. on the device, once, at load time: their preparation
        makes host copies and checks, which a CUDA-graph capture must not meet."""
        if self._params is not None:
            return
        idx = compat.layer_index(layer_name)
        with torch.device("cpu"):
            params = shard_params(LayerQuantParams.from_rotations(self.rotations, idx), self.heads)
        ep = params.expand(self.num_kv_heads, self.head_size, self.device)
        self._params = replace(ep, rotated_output=self._rotated)

    def value_rotation(self) -> torch.Tensor:
        """This rank's ``R_V`` (``[H_kv, d, d]`` float32 on the device), which :mod:`oscar_vllm.fold`
        folds into the layer's output projection."""
        if self._params is None:
            self._prepare_params(compat.layer_of_impl(self._cfg, self)[0])
        return self._params.v_rotation

    def serves_int2(self) -> bool:
        """Whether this layer stays with OSCAR (not one ``exclude_layers`` hands to vLLM's backend)."""
        if not self.excluded:
            return True
        return compat.layer_index(compat.layer_of_impl(self._cfg, self)[0]) not in self.excluded

    @property
    def rotated_output(self) -> bool:
        """Whether this layer returns ``o_rot`` (its output projection holds ``R_V``)."""
        return self._rotated

    def serve_rotated_output(self, on: bool) -> None:
        """Return ``o_rot`` (``on``: the output projection holds ``R_V``) or ``o_rot @ R_Vᵀ``."""
        self._rotated = on
        if self._params is not None and self._params.rotated_output != on:
            self._params = replace(self._params, rotated_output=on)

    def _add_window_layers(self) -> None:
        """Register this layer's window layers (docs/vllm.md, "Prefix caching").

        Each declares one page of exactly this layer's INT2 page size in a sliding-window
        KV-cache group (window = ``recent``); vLLM then forms one group per window-layer index
        (``groups`` groups of all INT2 layers' window layers beside the INT2 group) and lets
        every group's layer ``i`` share layer ``i``'s KV tensor, so a block's window record of
        this layer sits in this layer's own buffer, spread over the groups' pages.
        """
        name, _ = compat.layer_of_impl(self._cfg, self)
        lo, bs = self.layout, int(self._cfg.cache_config.block_size)
        cell = cell_bytes(lo.head_dim, lo.group)
        page = lo.num_kv_heads * bs * cell
        if page % (2 * lo.head_dim):
            raise OscarError(
                f"OSCAR: with prefix caching a page of {page} bytes (block size {bs}) must hold whole "
                f"BF16 rows of {2 * lo.head_dim} bytes; use a block size that is a multiple of 64, "
                "or --no-enable-prefix-caching"
            )
        plan = plan_window_records(
            lo.num_kv_heads,
            bs,
            lo.sink_tokens,
            lo.recent_tokens,
            page // (2 * lo.head_dim),
            compat.in_flight_tokens(self._cfg),
        )
        self._plan = plan
        spec_class = None
        if self.transient:
            from . import records

            records.register(self._cfg)
            spec_class = records.OscarWindowSpec
        # a window block of plan.block_size tokens in a page of exactly the INT2 page's bytes
        spec = compat.window_spec(
            plan.block_size,
            lo.num_kv_heads,
            lo.head_dim,
            self._kv_dtype(),
            max(lo.recent_tokens, 2),
            cell * bs // plan.block_size,
            spec_class=spec_class,
        )
        self.window_names = [f"{name}{WINDOW_SUFFIX}{g}" for g in range(plan.groups)]
        for n in self.window_names:
            compat.add_window_layer(self._cfg, n, OscarWindowLayer(spec))

    def restore_before_forward(self, md: StepPlan, tables: torch.Tensor) -> None:
        """Run this layer's restores of the step from the metadata builders (:class:`_StepExchange`),
        before the model runs: nothing of it is then left to a forward pass that a CUDA graph
        replays. A layer not prepared yet (no forward has run) restores in its forward instead."""
        if self._cache is None or self._pages is None or id(self) in md.restored_by:
            return
        if md.stamps is not None:
            self._check_records(md, tables)
        restore_window_rows(self._cache, self._pages, tables, md.restore, md.restore_index)
        md.restored_by.add(id(self))

    def _check_records(self, md: StepPlan, tables: torch.Tensor) -> None:
        """Run the step's record-stamp check once (first layer; host lists, one copy per step)."""
        stamps = md.stamps
        assert stamps is not None and self._plan is not None
        if md.step_no == stamps.last_step:  # another layer of this step ran it
            return
        lo, plan = self.layout, self._plan
        stamps.configure(plan.block_size, lo.page_size, lo.sink_tokens, lo.recent_tokens, plan.sink_parts)
        b = md.seq_lens.shape[0]
        prefix, seq = md.prefix_lens.cpu().tolist(), md.seq_lens.cpu().tolist()
        rows = [row for row, _, _ in md.restore]
        # only the table entries the check reads: whole tables were ~10^5-10^6 host ints per step
        int2_cols, win_cols = stamps.columns(prefix, seq, rows)
        int2 = gather_columns(md.block_table[:b], int2_cols)[0]
        stamps.step(md.step_no, int2, gather_columns(tables[:, :b], win_cols), prefix, seq, rows)

    def _kv_dtype(self) -> torch.dtype:
        dt = self._cfg.model_config.dtype
        return dt if isinstance(dt, torch.dtype) else torch.bfloat16

    def _layer_state(self, layer: Any, kv_cache: torch.Tensor) -> tuple[PagedKVCache, Any]:
        if self._params is None:
            idx = compat.layer_index(getattr(layer, "layer_name", ""))
            if idx in self.excluded or self.windows is None:  # the hand-over above never ran
                raise OscarError(
                    f"OSCAR: layer {idx} was not prepared at load time (vLLM did not call the attention "
                    "implementation's process_weights_after_loading), so exclude_layers cannot be honoured; "
                    "serve without exclude_layers"
                )
            self._prepare_params(getattr(layer, "layer_name", ""))
        if self._cache is None or self._cache_src != kv_cache.data_ptr():
            lo = self.layout
            if kv_cache.shape[2] != lo.page_size:  # kernel blocks may be smaller than vLLM's
                lo = replace(lo, page_size=int(kv_cache.shape[2]))
                self.layout = lo
            buf = compat.page_buffer(kv_cache, page_bytes(lo))
            c = cache_from_page_buffer(lo, buf, 1)
            assert self.windows is not None  # checked with the parameters above
            ks, vs, kr, vr = self.windows
            self._cache = replace(c, k_sink=ks, v_sink=vs, k_recent=kr, v_recent=vr)
            self._cache.validate()
            self._cache_src = kv_cache.data_ptr()
            if self.cached:  # the same buffer holds this layer's pages of every window group
                d = lo.head_dim
                rows = buf.view(torch.bfloat16).view(buf.shape[0], buf.shape[1] // (2 * d), d)
                assert self._plan is not None  # set with the window layers
                self._pages = WindowPages(rows, lo.num_kv_heads, self._plan, lo.sink_tokens)
        return self._cache, self._params

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: StepPlan | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise OscarError("the OSCAR attention backend does not support fused output quantization")
        assert output is not None
        if attn_metadata is None or kv_cache.numel() == 0:  # profiling / warm-up run without a cache
            return output.fill_(0)
        md = attn_metadata
        n = md.num_actual_tokens
        if n == 0:
            return output
        cache, params = self._layer_state(layer, kv_cache)
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_size
        q = query[:n].view(n, h, d)
        k = key[:n].view(n, hk, d)
        v = value[:n].view(n, hk, d)
        o = output[:n].view(n, h, d)  # a decode step's attention writes here directly
        tables = None
        if self.cached:
            assert self._pages is not None
            b = md.seq_lens.shape[0]
            metas = compat.window_metadata(self.window_names)
            # [groups, B, max_blocks]: a view of the buffer the window builders filled for this step
            # (a captured graph replays its address); a stack here cost a copy a layer in the graph
            tables = metas[-1].stacked[:, :b]
            if md.stamps is not None:  # transient records: refuse a restore from records that are gone
                self._check_records(md, tables)
            # only rows whose slot does not already hold their windows (the builder's SlotTracker),
            # and only if the window groups' builders did not restore this layer already
            if id(self) not in md.restored_by:
                restore_window_rows(cache, self._pages, tables, md.restore, md.restore_index)
        keep_open = self._overlap_layers and join_later(md, getattr(layer, "layer_name", md.last_layer))
        try:
            out = run_layer(
                md, cache, params, q, k, v, self.scale, dense=self._dense, out=o,
                extend_splits=self._splits, overlap_write=self._overlap, defer_join=True,
                overlap_rotation=self._overlap_rotation,
            )  # fmt: skip
            if tables is not None:
                assert self._pages is not None
                with beside(md) if self._overlap_layers else nullcontext():
                    write_window_pages(cache, params, k, v, md, self._pages, tables)
        except BaseException:
            join_layer(md)
            raise
        if not keep_open:
            join_layer(md)
        if out is not o:
            o.copy_(out)
        return output


def _windows(layout: CacheLayout, max_seqs: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    h, d = layout.num_kv_heads, layout.head_dim

    def one(rows: int) -> torch.Tensor:
        # empty + fill (not zeros): calloc'd pages would not show in the RSS vLLM's CPU worker measures
        return torch.empty(max_seqs, h, rows, d, dtype=torch.bfloat16, device=device).fill_(0)

    return (
        one(layout.sink_tokens),
        one(layout.sink_tokens),
        one(layout.recent_tokens),
        one(layout.recent_tokens),
    )


def _take_from_explicit_budget(cfg: Any, nbytes: int) -> None:
    """With ``kv_cache_memory_bytes`` set, vLLM does not measure: take the windows out of it."""
    cc = cfg.cache_config
    budget = getattr(cc, "kv_cache_memory_bytes", None)
    if budget is None:
        return
    if budget <= nbytes:
        raise OscarError(
            f"kv_cache_memory_bytes={budget} does not even hold OSCAR's BF16 windows ({nbytes} bytes for one "
            "layer): raise it or lower max_num_seqs"
        )
    cc.kv_cache_memory_bytes = budget - nbytes


def _tp_rank() -> int:
    return compat.tp_rank()


# ---- window layers: the BF16 window pages vLLM manages with prefix caching -------------------


class OscarWindowMetadata:
    """One step's block table of a window KV-cache group (``[B, max_blocks]``)."""

    def __init__(self, block_table: torch.Tensor, stacked: torch.Tensor) -> None:
        self.block_table = block_table
        #: every window group's table of the step, ``[G, rows, max_blocks]`` (the rows past the
        #: step's are stale): the engine's one buffer, filled by the groups' builders
        self.stacked = stacked


class OscarWindowBuilder(AttentionMetadataBuilder[OscarWindowMetadata]):
    """Passes a window group's block table to the INT2 layers (through the forward context)."""

    reorder_batch_threshold: int | None = 1

    def __init__(
        self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # which window page of a record this group holds: the index in its layers' names (vLLM
        # splits the window layers into groups by stride, one index per group; a group that mixed
        # indices would hand the restores the wrong tables, so it is refused)
        indices = {n.rpartition(WINDOW_SUFFIX)[2] for n in layer_names}
        if len(indices) > 1:
            raise OscarError(
                f"OSCAR: vLLM {compat.vllm_version()} put window pages {sorted(indices)} in one "
                "KV-cache group; serve with --no-enable-prefix-caching"
            )
        self.window_index = int(indices.pop()) if indices else 0
        self.exchange = _exchange(vllm_config)

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> Any:
        """As the INT2 group's builder (vLLM takes the lowest support over all groups)."""
        return compat.cudagraph_support(vllm_config)

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> OscarWindowMetadata:
        cm = common_attn_metadata  # dummy rows: no step to serve
        table = self.exchange.stage(self.window_index, cm.block_table_tensor[: cm.num_reqs])
        return OscarWindowMetadata(table, self.exchange.stacked)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> OscarWindowMetadata:
        cm = common_attn_metadata
        table = self.exchange.table(self.window_index, cm.block_table_tensor[: cm.num_reqs])
        return OscarWindowMetadata(table, self.exchange.stacked)


class _StepExchange:
    """One engine's hand-over between its metadata builders, with prefix caching.

    vLLM builds each step's metadata group by group, the INT2 group first, then the window groups
    (the order of the KV-cache config: layers in the order they were registered). The step's
    restores need every window group's block table, which only those groups' builders see: the
    INT2 builder leaves its plan here (:meth:`plan`), each window builder its table
    (:meth:`table`), and the last one runs every prepared layer's restores before the model runs.
    No host synchronisation is then left to the forward pass, so pure decode steps replay FULL
    CUDA graphs with prefix caching on. A window table that arrives for a step the INT2 builder did
    not plan first is an error (a vLLM that builds the groups in another order), never a skipped
    restore.
    """

    def __init__(self, vllm_config: Any) -> None:
        self.cfg = vllm_config
        self._layers: list[OscarAttentionImpl] | None = None
        self.pending: StepPlan | None = None
        self.arrived: set[int] = set()
        self.int2_steps = 0
        #: ``[G, rows, max_blocks]`` int32: each window group's block table of the step in one
        #: buffer, so the layers read one view (no stack a layer); a FULL CUDA graph replays the
        #: address it saw at capture, so the buffer is allocated once (grown only before capture)
        self.stacked: torch.Tensor | None = None
        self.window_steps: dict[int, int] = {}

    @property
    def layers(self) -> list[OscarAttentionImpl]:
        """The INT2 layers with window records, from the forward context the model runs with."""
        if self._layers is None:
            ctx = self.cfg.compilation_config.static_forward_context
            impls = [getattr(x, "impl", None) for x in ctx.values()]
            self._layers = [i for i in impls if isinstance(i, OscarAttentionImpl) and i.window_names]
        return self._layers

    @property
    def groups(self) -> int:
        return len(self.layers[0].window_names) if self.layers else 0

    def plan(self, md: StepPlan) -> None:
        self.int2_steps += 1
        self.pending, self.arrived = md, set()

    def stage(self, g: int, table: torch.Tensor) -> torch.Tensor:
        """Copy window group ``g``'s ``[n, max_blocks]`` block table into :attr:`stacked`;
        returns its view ``stacked[g, :n]``."""
        n, w = table.shape
        buf = self.stacked
        if buf is None or g >= buf.shape[0] or n > buf.shape[1] or w > buf.shape[2]:
            rows = max(n, int(getattr(getattr(self.cfg, "scheduler_config", None), "max_num_seqs", 0)))
            shape = (max(self.groups, g + 1), rows, w)
            if buf is not None:  # grow: keep the tables of the groups already staged this step
                shape = tuple(max(a, b) for a, b in zip(shape, buf.shape, strict=True))
            new = torch.zeros(shape, dtype=torch.int32, device=table.device)
            if buf is not None:
                new[: buf.shape[0], : buf.shape[1], : buf.shape[2]].copy_(buf)
            self.stacked = buf = new
        view = buf[g, :n, :w]
        view.copy_(table, non_blocking=True)
        return view

    def table(self, g: int, table: torch.Tensor) -> torch.Tensor:
        """:meth:`stage` for a served step; the last group's table runs the step's restores."""
        view = self.stage(g, table)
        n = self.window_steps.get(g, 0) + 1
        self.window_steps[g] = n
        if n != self.int2_steps:
            raise OscarError(
                f"OSCAR: vLLM {compat.vllm_version()} built window group {g}'s metadata for step {n} "
                f"while the INT2 group's is at step {self.int2_steps}; serve with --no-enable-prefix-caching"
            )
        if self.pending is None:
            return view
        self.arrived.add(g)
        if len(self.arrived) < self.groups:
            return view
        md, self.pending = self.pending, None
        self.arrived = set()
        if md.restore or md.stamps is not None:
            assert self.stacked is not None
            tables = self.stacked[:, : md.seq_lens.shape[0]]
            for impl in self.layers:
                impl.restore_before_forward(md, tables)
        return view


def _exchange(vllm_config: Any) -> _StepExchange:
    return engine_state(vllm_config).exchange


class OscarWindowBackend(_OscarBackendBase):
    """Backend of the window layers: pages only, no attention of their own."""

    @staticmethod
    def get_name() -> str:
        return compat.BACKEND_NAME + "_WINDOW"

    @staticmethod
    def get_impl_cls() -> type[OscarAttentionImpl]:
        return OscarAttentionImpl  # never built: window layers have no implementation

    @staticmethod
    def get_builder_cls() -> type[OscarWindowBuilder]:
        return OscarWindowBuilder

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        return spec  # already the INT2 page size (compat.window_spec)


class OscarWindowLayer(compat.attention_layer_base()):  # type: ignore[misc]
    """A window layer: registered beside an INT2 layer, never called by the model."""

    def __init__(self, spec: Any) -> None:
        self._spec = spec
        self.kv_cache = torch.empty(0)
        self.impl = None

    def get_attn_backend(self) -> type[OscarWindowBackend]:
        return OscarWindowBackend

    def get_kv_cache_spec(self, vllm_config: Any) -> Any:
        return self._spec
