"""Everything that touches SGLang internals (SGLang 0.5.17 and 0.5.23).

This is the only module that imports SGLang, together with the per-release adapters in
:mod:`oscar_sglang.compat` (chosen by ``sglang.__version__``; this module uses only their
small interface). It provides:

* :func:`register`, the ``sglang.srt.plugins`` entry point, run by SGLang's
  ``load_plugins()`` in the launcher and in every scheduler subprocess: registers the
  ``oscar`` attention backend, adds it to the ``--attention-backend`` choices, adds
  ``--oscar-rotations`` to the server's argument parser, and installs hooks (SGLang's
  ``HookRegistry``) on the KV-pool construction and the per-token cell size;
* :class:`OscarTokenToKVPool`, the KV pool (INT2 pages + BF16 windows);
* :class:`OscarAttnBackend`, the attention backend.

Hook targets (dotted paths, the same in both releases unless noted):

* ``ServerArgs.add_cli_args`` (after): adds ``--oscar-rotations FILE``;
* ``ServerArgs.from_cli_args`` (around): copies it to ``$OSCAR_ROTATIONS`` (inherited by
  the scheduler subprocesses) and checks the file before anything starts;
* ``DefaultPoolConfigurator._compute_cell_size`` (around): INT2 bytes per token;
* ``DefaultPoolConfigurator.finalize_with_max_running_requests`` (around): takes the BF16
  windows of every request slot (and the window snapshots) out of the token budget;
* ``KVCacheConfigurator._build_token_to_kv_pool`` (around): builds the OSCAR pool;
* ``UnifiedRadixCache`` / ``RadixCache`` ``.__init__``, ``.match_prefix`` and the release's
  publish points (0.5.23: ``.checkpoint``; 0.5.17: ``.cache_unfinished_req`` and
  ``.cache_finished_req``) (around), and ``ReqToTokenPool.alloc`` (after): the radix-cache
  policy (``--oscar-radix-cache``): hits cut back to prefixes with a BF16 window snapshot,
  snapshots published where the tree takes a request's tokens and planted at branch points
  (``exact``, the default), or the tree built disabled (``off``). See docs/sglang.md,
  "Radix (prefix) cache";
* ``TpModelWorker.update_weights_from_{disk,tensor,distributed,ipc}`` (after): ``R_V`` folded again
  into the output projections a weight update rewrote (the backend folds them when it is built:
  :func:`oscar_sglang.core.fold_outputs`); a release without one of them logs that hook's failure.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import OrderedDict
from typing import Any

import torch

from oscar_kernels import PagedKVCache, cache_from_page_buffer, page_bytes, paged_write, torch_flash_attention
from oscar_kernels.serving import (
    WINDOW_MEMORY_SHARE,
    CaptureChunk,
    CopyWindows,
    RebuildWindows,
    StepBuffers,
    StepPlan,
    copy_windows,
    default_max_seqs,
    exit_report,
    plan_step,
    prefill_kernel,
    run_layer,
)
from oscar_math.artifact import load_rotations
from oscar_math.errors import OscarError

from .core import (
    BACKEND_NAME,
    ENV_RADIX,
    ENV_ROTATIONS,
    ENV_SNAPSHOTS,
    RADIX_MODES,
    RankQuant,
    SnapshotStore,
    WindowTracker,
    block_table,
    fold_outputs,
    int2_bytes_per_token,
    load_rank_quant,
    overlap_write,
    prefill_options,
    prefix_digests,
    radix_mode,
    rotations_path,
    snapshot_count,
    tokens_after_windows,
    window_bytes_per_slot,
)

logger = logging.getLogger(__name__)

# SGLang imports (this module is imported only where SGLang is installed). The release's adapter
# first: an unsupported SGLang fails here, in one line, before any of its internals are touched.
from .compat import adapter  # noqa: E402

_compat = adapter()

from sglang.srt.layers.attention.attention_registry import (  # noqa: E402
    ATTENTION_BACKENDS,
    register_attention_backend,
)
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend  # noqa: E402
from sglang.srt.mem_cache.memory_pool import KVCache, MHATokenToKVPool, unwrap_write_loc  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: E402

# both releases export these from server_args (0.5.23 re-exports them from arg_groups.choices,
# which 0.5.17 does not have)
from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices  # noqa: E402

#: the SGLang release whose adapter is in use
SGLANG_VERSION: str = _compat.VERSION

__all__ = ["register", "OscarTokenToKVPool", "OscarAttnBackend", "oscar_selected", "SGLANG_VERSION"]

_T_ARGS = "sglang.srt.server_args.ServerArgs"
_T_CELL = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator"
_T_KVC = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_T_WORKER = "sglang.srt.managers.tp_worker.TpModelWorker"
#: TpModelWorker.update_weights_from_<how>: where a running server's weights change
_WEIGHT_UPDATES = ("disk", "tensor", "distributed", "ipc")
_T_TREES = (
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache",
    "sglang.srt.mem_cache.radix_cache.RadixCache",
)


# --------------------------------------------------------------------------- selection


def oscar_selected(server_args: Any) -> bool:
    """Whether the server runs the ``oscar`` backend; mixing it with another backend is refused."""
    names = [
        getattr(server_args, a, None)
        for a in ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
    ]
    chosen = {n for n in names if n is not None}
    if BACKEND_NAME not in chosen:
        return False
    if chosen != {BACKEND_NAME}:
        raise OscarError(
            f"--attention-backend {BACKEND_NAME} serves both prefill and decode (one KV layout): "
            f"do not combine it with {sorted(chosen - {BACKEND_NAME})}"
        )
    return True


def _parallel() -> tuple[int, int, int]:
    """(attn_tp_size, attn_tp_rank, attn_dcp_size) of this process."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    return (
        int(getattr(p, "attn_tp_size", 1) or 1),
        int(getattr(p, "attn_tp_rank", 0) or 0),
        int(getattr(p, "attn_dcp_size", 1) or 1),
    )


def _rank_quant(kvc: Any, layer_ids: list[int], device: str | torch.device) -> RankQuant:
    """The artifact for this rank, checked against the model SGLang loaded."""
    mc = kvc.model_config
    if getattr(kvc, "use_mla_backend", False) or getattr(kvc, "is_hybrid_swa", False):
        raise OscarError(
            f"--attention-backend {BACKEND_NAME}: only plain multi-head / GQA attention models are supported"
        )
    tp, rank, dcp = _parallel()
    if dcp != 1:
        raise OscarError(f"--attention-backend {BACKEND_NAME}: decode context parallelism is not supported")
    return load_rank_quant(
        rotations_path(),
        num_layers=int(mc.num_hidden_layers),
        total_kv_heads=int(mc.get_total_num_kv_heads()),
        head_dim=int(mc.head_dim),
        v_head_dim=int(getattr(mc, "v_head_dim", mc.head_dim) or mc.head_dim),
        page_size=int(kvc.page_size),
        tp_size=tp,
        tp_rank=rank,
        layer_ids=layer_ids,
        device=device,
    )


# --------------------------------------------------------------------------- pool


class OscarTokenToKVPool(MHATokenToKVPool):
    """SGLang KV pool holding INT2 pages (one ``[num_pages, page_bytes]`` uint8 buffer per layer)
    plus BF16 sink/recent windows with one row per ``req_to_token_pool`` row.

    Token slot ``loc`` (SGLang's ``out_cache_loc``) is ``page * page_size + offset``,
    exactly the cache's ``slot_mapping``. ``get_kv_size_bytes`` reports pages + windows.
    The pool has no BF16 key/value buffers: only the ``oscar`` backend reads it.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str,
        enable_memory_saver: bool,
        *,
        quant: RankQuant,
        max_seqs: int,
        radix: str = "off",
        snapshots: int = 0,
        start_layer: int | None = None,
        end_layer: int | None = None,
        **_unused: Any,
    ) -> None:
        # MHATokenToKVPool.__init__ allocates BF16 buffers; only the base bookkeeping is wanted.
        KVCache.__init__(
            self, size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer
        )
        lo = quant.layout
        if lo.page_size != page_size or lo.num_kv_heads != head_num or lo.head_dim != head_dim:
            raise OscarError(
                f"Invalid OSCAR pool: layout {lo} does not match SGLang's page_size={page_size}, "
                f"heads={head_num}, head_dim={head_dim}"
            )
        self.head_num, self.head_dim, self.v_head_dim = head_num, head_dim, head_dim
        self.quant = quant
        self.layout = lo
        self.k_buffer = self.v_buffer = None
        self.kv_cache_layout = "oscar"
        self.use_hnd = False
        # the page of slots [0, page_size) is SGLang's padding page (dummy writes land there)
        self.num_pages = -(-(size + page_size) // page_size)
        self.page_buffers = [
            torch.zeros(self.num_pages, page_bytes(lo), dtype=torch.uint8, device=device)
            for _ in range(layer_num)
        ]
        if radix not in RADIX_MODES:
            raise OscarError(f"Invalid radix mode: expected one of {RADIX_MODES}, got {radix!r}")
        if radix == "exact" and snapshots < 1:
            raise OscarError("Invalid OSCAR pool: radix mode 'exact' needs at least one window snapshot row")
        # window rows [0, max_seqs) belong to request slots, [max_seqs, max_seqs + snapshots) are
        # window snapshots for exact radix hits (same tensors: a snapshot is copied row to row)
        self.caches: list[PagedKVCache] = [
            cache_from_page_buffer(lo, b, max_seqs + snapshots) for b in self.page_buffers
        ]
        self.max_seqs = max_seqs
        self.radix = radix
        self.store = SnapshotStore(max_seqs, snapshots) if snapshots else None
        #: token slot of a hit's last prefix position -> (digest, length), set by the match hook;
        #: bounded (oldest dropped: SGLang matches every waiting request for its scheduling policy)
        self.pending_hits: OrderedDict[int, tuple[bytes, int]] = OrderedDict()
        self.pending_cap = 16 * max_seqs + 1024
        #: slot -> generation of a request whose windows hold INT2-rebuilt rows: never snapshotted
        self.tainted: dict[int, int] = {}
        #: slot -> (generation, N): the request's match was cut back from N (a branch point of the
        #: tree without a snapshot); its prefill also snapshots N, so the next request hits it
        self.want: dict[int, tuple[int, int]] = {}
        #: radix hits served without a snapshot (rebuilt from INT2): only in mode "int2", or if a
        #: snapshot was recycled between SGLang's match and the forward (logged)
        self.inexact_hits = 0
        self.exact_hits = 0
        self.tracker = WindowTracker(max_seqs)
        #: decode steps' snapshot captures ``(snapshot rows, slots)``, copied (every layer) before the
        #: next step runs: the windows a hit of ``L`` reads exist once the step that wrote position
        #: ``L - 1`` ran, and a CUDA graph's replay cannot run the copies itself
        self.pending_copies: list[tuple[list[int], list[int]]] = []
        #: the step's plan (set by the backend's init_forward_metadata; read by set_kv_buffer)
        self.step: StepPlan | None = None
        self._finalize_allocation_log(size)

    def flush_copies(self) -> None:
        """Run the pending snapshot captures (before any later step's forward is launched)."""
        if not self.pending_copies:
            return
        dev = self.caches[0].k_sink.device
        dst = torch.tensor([d for ds, _ in self.pending_copies for d in ds], dtype=torch.int64, device=dev)
        src = torch.tensor([x for _, xs in self.pending_copies for x in xs], dtype=torch.int64, device=dev)
        self.pending_copies = []
        for cache in self.caches:
            copy_windows(cache, dst, src)

    def note_hit(self, token_slot: int, digest: bytes, length: int) -> None:
        self.pending_hits[token_slot] = (digest, length)
        self.pending_hits.move_to_end(token_slot)
        while len(self.pending_hits) > self.pending_cap:
            self.pending_hits.popitem(last=False)

    def may_snapshot(self, slot: int, generation: int) -> bool:
        """Whether ``slot``'s windows are exact BF16 (not rebuilt from INT2 after a radix hit)."""
        return self.store is not None and self.tainted.get(slot) != generation

    # -- what the backend uses
    def cache(self, layer_id: int) -> PagedKVCache:
        return self.caches[layer_id - self.start_layer]

    def params(self, layer_id: int):  # noqa: ANN201 - ExpandedParams
        return self.quant.params[layer_id]

    # -- SGLang's pool API
    def get_kv_size_bytes(self) -> int:
        pages = sum(b.numel() for b in self.page_buffers)
        windows = sum(
            t.numel() * t.element_size()
            for c in self.caches
            for t in (c.k_sink, c.v_sink, c.k_recent, c.v_recent)
        )
        return pages + windows

    def _no_bf16(self, *_: Any, **__: Any):  # noqa: ANN202
        raise OscarError(
            "the OSCAR KV pool stores INT2 pages, not BF16 key/value buffers: "
            "only --attention-backend oscar reads it"
        )

    get_key_buffer = get_value_buffer = get_kv_buffer = _no_bf16
    get_cpu_copy = load_cpu_copy = move_kv_cache = get_contiguous_buf_infos = _no_bf16

    def set_kv_buffer(
        self, layer: Any, loc: Any, cache_k: torch.Tensor, cache_v: torch.Tensor, *args: Any, **kwargs: Any
    ) -> None:
        """Quantise and store ``cache_k/cache_v`` at ``loc`` (``paged_write``; windows included).

        In an extend step only the INT2 rows and sink rows (the step's ``parts``): the
        backend writes the ring rows after attention (:meth:`write_ring`).
        """
        self._store(layer, loc, cache_k, cache_v, None)

    def write_ring(self, layer: Any, loc: Any, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """The ring rows of an extend step's tokens, after its attention read the old ones."""
        self._store(layer, loc, cache_k, cache_v, "ring")

    def _store(
        self, layer: Any, loc: Any, cache_k: torch.Tensor, cache_v: torch.Tensor, parts: str | None
    ) -> None:
        if self.step is None:
            raise OscarError("OSCAR pool: set_kv_buffer called before OscarAttnBackend.init_forward_metadata")
        loc, _, _ = unwrap_write_loc(loc)
        lo = self.layout
        k = cache_k.reshape(-1, lo.num_kv_heads, lo.head_dim)
        v = cache_v.reshape(-1, lo.num_kv_heads, lo.head_dim)
        n = k.shape[0]
        st = self.step
        paged_write(
            self.cache(layer.layer_id),
            self.params(layer.layer_id),
            k.contiguous(),
            v.contiguous(),
            loc[:n].to(torch.int64),
            st.positions[:n],
            st.seq_index[:n],
            st.seq_lens,
            st.window_slots,
            # windows apply per query token: an extend step's ring rows follow its attention
            parts=parts or ("all" if st.all_decode else "pages"),
        )


# --------------------------------------------------------------------------- backend


def sgl_flash_attention() -> Any:
    """``sgl_kernel``'s FlashAttention-3 varlen forward (what SGLang's ``fa3`` backend runs on
    Hopper) as an ``oscar_kernels.DenseAttention``; ImportError where sgl_kernel has no FA3 build."""
    from sgl_kernel.flash_attn import flash_attn_varlen_func

    def attn(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left):  # noqa: ANN001, ANN202
        window = (int(window_left), 0) if int(window_left) >= 0 else (-1, -1)
        out, lse, *_ = flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_seqlen_q=max(int(max_q), 1), max_seqlen_k=max(int(max_k), 1),
            softmax_scale=float(scale), causal=True, window_size=window, return_softmax_lse=True,
        )  # fmt: skip
        return out, lse

    return attn


class OscarAttnBackend(AttentionBackend):
    """``--attention-backend oscar``: extend/decode through oscar-kernels on the OSCAR pool.

    Triton kernels on CUDA tensors, the torch references on CPU (``oscar_kernels`` dispatch).
    """

    def __init__(self, model_runner: Any) -> None:
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, OscarTokenToKVPool):
            raise OscarError(
                f"--attention-backend {BACKEND_NAME} needs the OSCAR KV pool, got {type(pool).__name__} "
                "(is oscar-sglang's sglang.srt.plugins entry point loaded? check SGLANG_PLUGINS)"
            )
        self.pool = pool
        self.req_to_token_pool = model_runner.req_to_token_pool
        # the ReqToTokenPool.alloc hook finds the OSCAR pool here (branch-point snapshots)
        self.req_to_token_pool._oscar_pool = pool
        self.device = model_runner.device
        # R_V into o_proj where exact (the model is loaded, no graph captured yet): those layers'
        # attention returns o_rot and skips the un-rotation (docs/sglang.md)
        fold_outputs(getattr(model_runner, "model", None), pool.quant.params, logger)
        #: this step's plan (the serving core's StepPlan), shared by every layer's forward
        self.plan: StepPlan | None = None
        #: oscar_kernels' backend: Triton on CUDA, the torch references elsewhere ("triton" runs the
        #: kernels under TRITON_INTERPRET=1 on a CPU, as a test does)
        self.kernel_backend = "auto"
        dense_on, split_on = prefill_options()
        # short chunks over long prefixes (radix hits' tails) split over more programs
        self.extend_splits: int | str = "auto" if split_on else 1
        self.overlap_write = overlap_write()
        #: long prefill chunks through a dense FlashAttention kernel that passed its start-up check
        #: (sgl_kernel's FA3, else torch's FA2); None: OSCAR's Triton extend kernel
        self.dense = None
        if dense_on and torch.device(self.device).type == "cuda":
            lo = pool.layout
            # the query-head group only shapes the kernel's probe: any model config serves
            mc = getattr(model_runner, "model_config", None)
            heads = getattr(mc, "num_attention_heads", None)
            kv_heads = getattr(mc, "num_key_value_heads", None) or heads
            group = max(1, int(heads) // int(kv_heads)) if heads and kv_heads else 2
            dtype = getattr(model_runner, "dtype", torch.bfloat16)
            self.dense = prefill_kernel(
                [("sgl_kernel's FlashAttention-3", sgl_flash_attention),
                 ("torch's FlashAttention-2", torch_flash_attention)],
                self.device, lo.head_dim, lo.num_kv_heads, group, dtype, logger,
            )  # fmt: skip

    def init_forward_metadata(self, forward_batch: Any) -> None:
        fb = forward_batch
        mode = fb.forward_mode
        self.pool.flush_copies()
        if mode.is_idle():  # a data-parallel worker with nothing to run this step
            self.plan = None
            return
        pool = self.pool
        if mode.is_decode():
            pool.step = self.plan = self._decode_plan(fb, fb.seq_lens.shape[0])
            return
        slots = fb.req_pool_indices.to(torch.int32)
        bt = block_table(self.req_to_token_pool.req_to_token, fb.req_pool_indices, pool.page_size)
        gens = self.req_to_token_pool.req_generation
        P = pool.page_size
        if mode.name not in ("EXTEND", "MIXED"):  # speculative / dLLM / split-prefill modes
            raise OscarError(f"--attention-backend {BACKEND_NAME}: forward mode {mode.name} is not supported")
        ext_cpu = fb.extend_seq_lens_cpu
        ext_cpu = list(ext_cpu) if ext_cpu is not None else fb.extend_seq_lens.tolist()
        pre_cpu = fb.extend_prefix_lens_cpu
        pre_cpu = list(pre_cpu) if pre_cpu is not None else fb.extend_prefix_lens.tolist()
        # the plan derives positions, sequence index and offsets once (plan_step); the window
        # bookkeeping below reads them
        plan = self._plan(fb, bt, slots, torch.as_tensor(ext_cpu, dtype=torch.int64), None, pre_cpu)
        rebuild, res_src, res_dst = [], [], []
        slot_list = fb.req_pool_indices.tolist()
        for b, slot in enumerate(slot_list):
            gen = int(gens[slot])
            written = pool.tracker.written(slot, gen)
            p, c = int(pre_cpu[b]), int(ext_cpu[b])
            if p > written:
                # prefix positions this request did not write (a radix-cache hit): their BF16
                # window rows are not in this slot
                buf = self._hit_snapshot(slot, p)
                if buf is not None:
                    res_src.append(buf)
                    res_dst.append(slot)
                else:
                    rebuild.append((b, slot, written, p))
                    pool.tainted[slot] = gen  # its windows now hold INT2 rows: never publish them
            pool.tracker.mark(slot, gen, p + c)
        cap_src, cap_dst, cap_tok = [], [], []
        if pool.store is not None:
            busy = set(res_src)
            cum = 0
            for b, slot in enumerate(slot_list):
                p, c = int(pre_cpu[b]), int(ext_cpu[b])
                gen = int(gens[slot])
                k_len = (p + c) // P * P
                lengths = [k_len] if k_len > p else []
                want = pool.want.get(slot)
                if want is not None and want[0] == gen:
                    if p < want[1] < k_len:
                        lengths.insert(0, want[1])
                    if want[1] <= p + c:
                        del pool.want[slot]
                for length in lengths if pool.may_snapshot(slot, gen) else ():
                    buf = pool.store.capture(slot, gen, length, self._current_gens(), busy)
                    if buf is not None:
                        busy.add(buf)
                        cap_src.append(slot)
                        cap_dst.append(buf)
                        cap_tok.append((cum, cum + length - p, len(cap_dst) - 1, length))
                cum += c
        cap_meta = None
        if cap_tok:
            dev = plan.positions.device
            idx = torch.cat([torch.arange(lo, hi, device=dev) for lo, hi, _, _ in cap_tok])
            sidx = torch.cat(
                [torch.full((hi - lo,), j, dtype=torch.int64, device=dev) for lo, hi, j, _ in cap_tok]
            )
            lens = torch.tensor([k for _, _, _, k in cap_tok], dtype=torch.int32, device=dev)
            cap_meta = (idx, plan.positions[idx].long(), sidx, lens)
        before: list = []
        restore = self._pair(res_dst, res_src)
        if restore is not None:  # exact radix hits: the prefix's BF16 windows, as a miss wrote them
            before.append(CopyWindows(*restore))
        if rebuild:
            before.append(RebuildWindows(tuple((bt[b], slot, start, p) for b, slot, start, p in rebuild)))
        plan.before = tuple(before)
        if cap_meta is not None:
            # snapshots at page boundaries K inside the chunk (its last one, and a branch point the
            # match asked for): the windows before this chunk's ring write (sink already written),
            # plus the chunk's tokens [p, K) written into the snapshot's ring
            src, dst = self._pair(cap_src, cap_dst)
            idx, pos, sidx, lens = cap_meta
            plan.after_attend = (CaptureChunk(src, dst, idx, pos, sidx, lens, plan.slot_mapping[idx]),)
        pool.step = self.plan = plan

    def _plan(
        self,
        fb: Any,
        bt: torch.Tensor,
        slots: torch.Tensor,
        qlens_cpu: torch.Tensor,
        seq_lens_cpu: list[int] | None,
        prefix_cpu: list[int] | None = None,
    ) -> StepPlan:
        """The serving core's plan of this batch: SGLang's ``out_cache_loc`` is the INT2 slot
        mapping (``page * page_size + offset``), its request rows the window slots."""
        dev = fb.seq_lens.device
        cu_cpu = torch.zeros(qlens_cpu.shape[0] + 1, dtype=torch.int64)
        cu_cpu[1:] = torch.cumsum(qlens_cpu, 0)
        if seq_lens_cpu is None:
            seq_lens_cpu = (torch.as_tensor(prefix_cpu, dtype=torch.int64) + qlens_cpu).tolist()
        seq_cpu = torch.as_tensor(seq_lens_cpu, dtype=torch.int64)
        return plan_step(
            cu_cpu.to(dev, torch.int32),
            cu_cpu,
            fb.seq_lens,
            seq_cpu,
            bt,
            unwrap_write_loc(fb.out_cache_loc)[0].to(torch.int64),
            qlens_cpu.shape[0],
            slots,
            None,
            num_tokens=int(cu_cpu[-1]),
        )

    def _pair(self, a: list[int], b: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not a:
            return None
        dev = self.pool.caches[0].k_sink.device
        return torch.tensor(a, dtype=torch.int64, device=dev), torch.tensor(b, dtype=torch.int64, device=dev)

    def _current_gens(self) -> list[int]:
        return self.pool.tracker.generation

    def _hit_snapshot(self, slot: int, prefix_len: int) -> int | None:
        """The snapshot row holding the BF16 windows of this request's cached prefix, or None.

        ``None`` in mode ``off`` raises (a hit must not happen there), in mode ``int2`` means
        "rebuild from INT2" (documented approximation), in mode ``exact`` it is logged: the match
        hook only lets through hits that have a snapshot, so this happens only if that snapshot
        was recycled between SGLang's match and this forward.
        """
        pool = self.pool
        if pool.radix == "off":
            raise OscarError(
                f"--attention-backend {BACKEND_NAME}: a radix-cache hit of {prefix_len} tokens reached the "
                f"backend with {ENV_RADIX}=off (its sink/recent tokens would be read at INT2, not BF16): "
                "pass --disable-radix-cache, or --oscar-radix-cache exact"
            )
        if pool.radix == "exact":
            token_slot = int(self.req_to_token_pool.req_to_token[slot, prefix_len - 1])
            pend = pool.pending_hits.get(token_slot)
            hit = pool.store.lookup(pend[0]) if pend is not None and pend[1] == prefix_len else None
            if hit is not None and hit[1] == prefix_len:
                pool.exact_hits += 1
                return hit[0]
            logger.warning(
                "OSCAR: radix hit of %d tokens without its window snapshot (recycled since the match): its "
                "sink/recent tokens are read at INT2 (raise --oscar-window-snapshots)",
                prefix_len,
            )
        pool.inexact_hits += 1
        return None

    @staticmethod
    def _check_layer(layer: Any) -> None:
        if (
            getattr(layer, "is_cross_attention", False)
            or (getattr(layer, "sliding_window_size", -1) or -1) > -1
            or (getattr(layer, "logit_cap", 0.0) or 0.0) > 0
            or getattr(getattr(layer, "attn_type", None), "name", "DECODER") != "DECODER"
        ):
            raise OscarError(
                f"--attention-backend {BACKEND_NAME}: layer {layer.layer_id} uses cross attention, a sliding "
                "window, logit capping or non-causal attention, which the INT2 kernels do not implement"
            )

    def _run(self, q: Any, k: Any, v: Any, layer: Any, save_kv_cache: bool) -> torch.Tensor:
        """One layer through the serving core (:func:`oscar_kernels.serving.run_layer`)."""
        self._check_layer(layer)
        if k is None or v is None:
            raise OscarError(f"--attention-backend {BACKEND_NAME}: layer {layer.layer_id} gave no key/value")
        lo, pool = self.pool.layout, self.pool
        hq = layer.tp_q_head_num
        out = run_layer(
            self.plan,
            pool.cache(layer.layer_id),
            pool.params(layer.layer_id),
            q.reshape(-1, hq, lo.head_dim),
            k.reshape(-1, lo.num_kv_heads, lo.head_dim),
            v.reshape(-1, lo.num_kv_heads, lo.head_dim),
            layer.scaling,
            backend=self.kernel_backend,
            dense=self.dense,
            extend_splits=self.extend_splits,
            overlap_write=self.overlap_write,
            # the model stored its K/V itself (pool.set_kv_buffer): the ring rows of an extend
            # step still follow its attention
            stored=not save_kv_cache,
        )
        return out.reshape(-1, hq * lo.head_dim)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):  # noqa: ANN001, ANN201
        return self._run(q, k, v, layer, save_kv_cache)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):  # noqa: ANN001, ANN201
        return self._run(q, k, v, layer, save_kv_cache)

    def _decode_plan(self, fb: Any, raw: int) -> StepPlan:
        """A decode step's plan; rows past ``raw`` are a CUDA graph's padding (no write: slot -1).

        Rows whose length reaches a page boundary have their windows captured for exact radix
        hits after this step's write (:meth:`OscarTokenToKVPool.flush_copies`)."""
        pool, P = self.pool, self.pool.page_size
        bsz = fb.seq_lens.shape[0]
        slots = fb.req_pool_indices.to(torch.int32)
        bt = block_table(self.req_to_token_pool.req_to_token, fb.req_pool_indices, P)
        gens = self.req_to_token_pool.req_generation
        lens_cpu = (fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens).tolist()
        cap_src, cap_dst = [], []
        for slot, length in zip(fb.req_pool_indices[:raw].tolist(), lens_cpu[:raw], strict=True):
            gen = int(gens[slot])
            pool.tracker.mark(slot, gen, length)
            if length % P == 0 and pool.may_snapshot(slot, gen):
                # this step writes position length-1: the windows are those of a hit of `length`
                buf = pool.store.capture(slot, gen, length, self._current_gens(), set())
                if buf is not None:
                    cap_src.append(slot)
                    cap_dst.append(buf)
        if cap_dst:
            pool.pending_copies.append((cap_dst, cap_src))
        loc = unwrap_write_loc(fb.out_cache_loc)[0].to(torch.int64)
        if raw < bsz:  # padding rows write nothing (their slot's windows are a live request's)
            loc = torch.cat([loc[:raw], loc.new_full((bsz - raw,), -1)])
        cu_cpu = torch.arange(bsz + 1, dtype=torch.int64)
        return plan_step(
            cu_cpu.to(fb.seq_lens.device, torch.int32),
            cu_cpu,
            fb.seq_lens,
            torch.as_tensor(lens_cpu, dtype=torch.int64),
            bt,
            loc,
            bsz,
            slots,
            None,
            num_tokens=bsz,
        )

    # -- CUDA graphs (decode): SGLang's runner captures forward_decode with the plan's tensors in
    # fixed buffers, and before every replay calls init_forward_metadata_out_graph with its
    # persistent batch buffers, which copies the new step's plan into the same buffers

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.graph_buffers = StepBuffers(max_bs, max(max_num_tokens, max_bs), torch.device(self.device))

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # a padding row attends one key (its output is dropped); it writes nothing

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        fb = forward_batch
        self.pool.flush_copies()
        if not fb.forward_mode.is_decode():
            raise OscarError(
                f"--attention-backend {BACKEND_NAME}: CUDA graphs of forward mode {fb.forward_mode.name} "
                "are not supported (decode only); pass --disable-cuda-graph"
            )
        bsz = fb.seq_lens.shape[0]
        raw = bsz - int(getattr(fb, "num_padding", 0) or 0)
        if in_capture:  # a capture batch is a dummy: no request slots to track
            raw = 0
        plan = self.graph_buffers.hold(self._decode_plan(fb, raw))
        self.pool.step = self.plan = plan

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> None:
        pass  # everything is copied into the fixed buffers outside the graph

    def support_triton(self) -> bool:
        return False


def create_backend(runner: Any) -> OscarAttnBackend:
    return OscarAttnBackend(runner)


# --------------------------------------------------------------------------- hooks


def _add_cli_args(result: Any, parser: Any) -> None:
    parser.add_argument(
        "--oscar-rotations",
        type=str,
        default=None,
        help=f"OSCAR rotations artifact (.safetensors from 'oscar calibrate') for --attention-backend "
        f"{BACKEND_NAME}; sets ${ENV_ROTATIONS} for the scheduler processes",
    )
    parser.add_argument(
        "--oscar-radix-cache",
        choices=list(RADIX_MODES),
        default=None,
        help=f"radix (prefix) cache under --attention-backend {BACKEND_NAME}: exact (default; hits only "
        "where the prefix's BF16 window rows were kept: a hit equals a miss), off (SGLang's tree is built "
        "disabled), int2 (any hit; the prefix's window tokens are read at INT2). Sets $" + ENV_RADIX,
    )
    parser.add_argument(
        "--oscar-window-snapshots",
        type=int,
        default=None,
        help="window snapshots kept for --oscar-radix-cache exact (default: two per request slot; each costs "
        "one request's BF16 window bytes, taken out of the KV budget). Sets $" + ENV_SNAPSHOTS,
    )


def _from_cli_args(original: Any, cls: Any, args: Any) -> Any:
    path = getattr(args, "oscar_rotations", None)
    if path:
        os.environ[ENV_ROTATIONS] = os.path.abspath(path)
    if getattr(args, "oscar_radix_cache", None):
        os.environ[ENV_RADIX] = args.oscar_radix_cache
    if getattr(args, "oscar_window_snapshots", None) is not None:
        os.environ[ENV_SNAPSHOTS] = str(args.oscar_window_snapshots)
    server_args = original(cls, args)
    if oscar_selected(server_args):
        # fail in the launcher, in one line, before any process or GPU memory is touched
        load_rotations(rotations_path())
        snapshot_count(radix_mode(), 1)
    return server_args


def _compute_cell_size(original: Any, self: Any, kvc: Any, num_layers: int) -> int:
    if not oscar_selected(kvc.server_args):
        return original(self, kvc, num_layers)
    rq = _rank_quant(kvc, [], "cpu")
    self._oscar_layout = rq.layout
    self._oscar_layers = num_layers
    # no --max-running-requests: OSCAR's slot default (each slot's BF16 windows are allocated up front)
    self._oscar_default_slots = getattr(kvc.server_args, "max_running_requests", None) is None
    cell = int2_bytes_per_token(rq.layout, num_layers)
    logger.info(
        "OSCAR: %d bytes/token for %d layers (INT2 pages), windows %d bytes per request slot",
        cell,
        num_layers,
        window_bytes_per_slot(rq.layout, num_layers),
    )
    return cell


def _finalize(original: Any, self: Any, config: Any) -> Any:
    config = original(self, config)
    layout = getattr(self, "_oscar_layout", None)
    if layout is not None and config.max_running_requests is not None:
        if getattr(self, "_oscar_default_slots", False) and torch.cuda.is_available():
            per_slot = window_bytes_per_slot(layout, self._oscar_layers)
            device = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            slots = default_max_seqs(config.max_running_requests, device, per_slot)
            if slots < config.max_running_requests:
                logger.info(
                    "OSCAR: max_running_requests %d (the request slots whose BF16 windows fit %d%% of the "
                    "device; SGLang's default was %d): pass --max-running-requests to choose",
                    slots,
                    round(100 * WINDOW_MEMORY_SHARE),
                    config.max_running_requests,
                )
                config.max_running_requests = slots
        mode = radix_mode()
        slots = config.max_running_requests + 1
        snaps = snapshot_count(mode, slots)
        left = tokens_after_windows(
            config.max_total_num_tokens, config.max_running_requests, layout, self._oscar_layers, snaps
        )
        if left <= 0:
            raise OscarError(
                f"--attention-backend {BACKEND_NAME}: the BF16 windows of {config.max_running_requests} "
                "request "
                "slots do not fit the KV budget; lower --max-running-requests or raise --mem-fraction-static"
            )
        _log_windows(mode, slots, snaps, layout, self._oscar_layers, config.max_total_num_tokens - left)
        config.max_total_num_tokens = left
    return config


def _log_windows(mode: str, slots: int, snaps: int, layout: Any, layers: int, tokens_taken: int) -> None:
    """The start-up line that states what the windows and the radix mode cost and promise."""
    per = window_bytes_per_slot(layout, layers)
    promise = {
        "exact": "hits read the BF16 window rows their prefix wrote (a hit equals a miss); a prefix without "
        "a snapshot is recomputed",
        "off": "SGLang's radix tree is built disabled (no prefix reuse)",
        "int2": "any hit; a hit's sink/recent tokens are read at INT2, not BF16 (approximate)",
    }[mode]
    logger.info(
        "OSCAR: BF16 windows %.1f MiB for %d request slots; radix cache %s: %d window snapshots "
        "(--oscar-window-snapshots) %.1f MiB; together %d tokens taken from the INT2 budget; %s",
        slots * per / 2**20,
        slots,
        mode,
        snaps,
        snaps * per / 2**20,
        tokens_taken,
        promise,
    )


def _build_pool(
    original: Any, self: Any, *, sizes: Any, is_dsa_model: bool, is_dsv4_model: bool, req_to_token_pool: Any
):
    if not oscar_selected(self.server_args):
        return original(
            self,
            sizes=sizes,
            is_dsa_model=is_dsa_model,
            is_dsv4_model=is_dsv4_model,
            req_to_token_pool=req_to_token_pool,
        )
    if is_dsa_model or is_dsv4_model or self.mambaish_config is not None:
        raise OscarError(
            f"--attention-backend {BACKEND_NAME}: only plain multi-head / GQA attention models are supported"
        )
    li = self.layer_info
    rq = _rank_quant(self, list(range(li.start_layer, li.end_layer)), self.device)
    mode = radix_mode()
    max_seqs = req_to_token_pool.req_to_token.shape[0]
    return OscarTokenToKVPool(
        sizes.max_total_num_tokens,
        page_size=self.page_size,
        dtype=self.kv_cache_dtype,
        head_num=rq.layout.num_kv_heads,
        head_dim=rq.layout.head_dim,
        layer_num=li.num_effective_layers,
        device=self.device,
        enable_memory_saver=False,
        quant=rq,
        max_seqs=max_seqs,
        radix=mode,
        snapshots=snapshot_count(mode, max_seqs),
        start_layer=li.start_layer,
        end_layer=li.end_layer,
    )


def _oscar_pool_of(tree: Any) -> OscarTokenToKVPool | None:
    alloc = getattr(tree, "token_to_kv_pool_allocator", None)
    if alloc is None:
        return None
    try:
        pool = alloc.get_kvcache()
    except Exception:  # noqa: BLE001 - allocators without a pool (simulated trees)
        return None
    return pool if isinstance(pool, OscarTokenToKVPool) else None


def _tree_init(original: Any, self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
    """Radix mode ``off``: build SGLang's tree disabled (as SGLang itself does for some models)."""
    alloc = getattr(params, "token_to_kv_pool_allocator", None)
    pool = alloc.get_kvcache() if alloc is not None and hasattr(alloc, "get_kvcache") else None
    if isinstance(pool, OscarTokenToKVPool) and pool.radix == "off" and not params.disable:
        logger.warning(
            "OSCAR: radix (prefix) cache off under --attention-backend %s (--oscar-radix-cache off): "
            "SGLang's tree is built disabled. The default, --oscar-radix-cache exact, keeps it on with hits "
            "equal to misses (window snapshots, more memory); --oscar-radix-cache int2 allows approximate "
            "hits",
            BACKEND_NAME,
        )
        params.disable = True
    return original(self, params, *args, **kwargs)


def _match_prefix(original: Any, self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
    """Radix mode ``exact``: cut a hit back to the longest prefix with a published window snapshot.

    A hit of ``M`` tokens then holds everything a miss reads for query ``M`` (shared INT2
    pages + that snapshot's BF16 sink/ring rows); the cut-off tokens are recomputed. The
    truncated match is SGLang's own match of the shorter key (the tree splits its node there).
    """
    result = original(self, params, *args, **kwargs)
    pool = _oscar_pool_of(self)
    n = _compat.prefix_len(result)
    req = getattr(params, "req", None)
    # only a request's match (the scheduler passes req) adopts a prefix; the tree's own lookups
    # (re-finding the path it just inserted, in checkpoint / cache_unfinished_req) see it whole
    if pool is None or pool.radix != "exact" or n == 0 or req is None:
        if req is not None:
            req._oscar_want_snapshot = None
        return result
    from sglang.srt.mem_cache.base_prefix_cache import zero_match_result

    key = params.key
    if getattr(key, "is_bigram", False):
        return zero_match_result(self, result, extra_key=key.extra_key)
    page = pool.page_size
    digests = prefix_digests(key.token_ids, key.extra_key, _compat.key_salt(key), page, n)
    m, found = 0, None
    for i in range(len(digests) - 1, -1, -1):
        found = pool.store.lookup(digests[i])
        if found is not None:
            m = (i + 1) * page
            break
    # no snapshot at SGLang's branch point n: this request's prefill plants one there (the
    # ReqToTokenPool.alloc hook hands n to the backend), so the next request sharing it hits
    req._oscar_want_snapshot = n if m < n else None
    if m == 0:
        return zero_match_result(self, result, extra_key=key.extra_key)
    if m < n:
        short = _compat.short_key(key, m)
        result = original(self, dataclasses.replace(params, key=short), *args, **kwargs)
        if _compat.prefix_len(result) != m:
            return zero_match_result(self, result, extra_key=key.extra_key)
    pool.note_hit(_compat.prefix_slot(self, result, key.extra_key, m), digests[m // page - 1], m)
    return result


def _publish(tree: Any, req: Any, slot: Any, k_len: int, token_ids: Any) -> None:
    """Radix mode ``exact``: the tree now owns the request's first ``k_len`` tokens: publish every
    window snapshot the request captured up to there under its prefix's content digest.

    Called by the release adapter's hooks on the tree's publish points (``compat``).
    """
    pool = _oscar_pool_of(tree)
    if pool is None or pool.store is None or getattr(tree, "disable", False):
        return
    if k_len <= 0 or slot is None or len(token_ids) != k_len:
        return
    gen = int(tree.req_to_token_pool.req_generation[slot])
    lengths = [n for n in pool.store.candidates(int(slot), gen) if n <= k_len]
    if lengths:
        page = pool.page_size
        digests = prefix_digests(token_ids, req.extra_key, _compat.req_salt(req), page, k_len)
        for n in lengths:  # the tree holds [0, k_len): every candidate up to there is a cached prefix
            pool.store.publish(int(slot), gen, n, digests[n // page - 1])


def _refold(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """After a TP worker updated its model's weights: fold ``R_V`` into the projections the update
    rewrote (a fingerprint tells them from those it left folded; :mod:`oscar_kernels.serving.fold`)."""
    runner = getattr(self, "model_runner", None)
    pool = getattr(runner, "token_to_kv_pool", None)
    if isinstance(pool, OscarTokenToKVPool):
        fold_outputs(getattr(runner, "model", None), pool.quant.params, logger)


def _req_alloc(result: Any, self: Any, reqs: Any, *args: Any, **kwargs: Any) -> Any:
    """Hand a branch point the match asked to snapshot (``_match_prefix``) to the request's slot."""
    pool = getattr(self, "_oscar_pool", None)
    if pool is None or result is None:
        return result
    for r in reqs:
        n = getattr(r, "_oscar_want_snapshot", None)
        slot = _compat.req_slot(r)
        if n and slot is not None:
            pool.want[int(slot)] = (int(self.req_generation[slot]), int(n))
            r._oscar_want_snapshot = None
    return result


_REGISTERED = False


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: idempotent (SGLang calls it in every process)."""
    global _REGISTERED
    exit_report.install()  # an OscarError that stops SGLang ends its output with one "OSCAR: ..." line
    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(create_backend)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if _REGISTERED:
        return
    _REGISTERED = True
    HookRegistry.register(f"{_T_ARGS}.add_cli_args", _add_cli_args, HookType.AFTER)
    HookRegistry.register(f"{_T_ARGS}.from_cli_args", _from_cli_args, HookType.AROUND)
    HookRegistry.register(f"{_T_CELL}._compute_cell_size", _compute_cell_size, HookType.AROUND)
    HookRegistry.register(f"{_T_CELL}.finalize_with_max_running_requests", _finalize, HookType.AROUND)
    HookRegistry.register(f"{_T_KVC}._build_token_to_kv_pool", _build_pool, HookType.AROUND)
    for tree in _T_TREES:
        HookRegistry.register(f"{tree}.__init__", _tree_init, HookType.AROUND)
        HookRegistry.register(f"{tree}.match_prefix", _match_prefix, HookType.AROUND)
        for method, hook in _compat.publish_hooks(_publish):
            HookRegistry.register(f"{tree}.{method}", hook, HookType.AROUND)
    HookRegistry.register("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.alloc", _req_alloc, HookType.AFTER)
    for how in _WEIGHT_UPDATES:  # R_V folded again into what a weight update rewrote
        HookRegistry.register(f"{_T_WORKER}.update_weights_from_{how}", _refold, HookType.AFTER)
    for target, hook, kind in _compat.extra_hooks():
        HookRegistry.register(target, hook, kind)
