"""The ``OSCAR`` attention backend for vLLM's v1 engine.

* KV-cache spec: each (KV head, token) cell of a page is ``d/2 + 8·d/group`` bytes (K and V
  INT2 codes + bf16 scale/zero), so vLLM's allocator sizes pages with
  :func:`oscar_kernels.page_bytes` and really gives ~6–7× the BF16 token count.
* BF16 sink/recent windows: one row per sequence slot (``max_num_seqs`` rows per layer),
  allocated when the layer is built, so they are part of the non-KV memory vLLM measures
  (GPU profiling, CPU RSS); with an explicit ``kv_cache_memory_bytes`` the backend takes
  their size out of that budget.
* Per step: write every new token (:func:`oscar_kernels.paged_write`), then attend —
  :func:`oscar_kernels.decode_attention` when every row is a one-token decode, else
  :func:`oscar_kernels.extend_attention` over the whole mixed batch (a decode row is a
  one-token chunk). CUDA tensors run the Triton kernels, CPU tensors the torch references.

Version-specific glue lives in :mod:`oscar_vllm.compat`; options in :mod:`oscar_vllm.settings`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from oscar_kernels import (
    CacheLayout,
    LayerQuantParams,
    PagedKVCache,
    cache_from_page_buffer,
    decode_attention,
    extend_attention,
    page_bytes,
    paged_write,
)
from oscar_math.errors import OscarError

from . import compat
from .settings import cell_bytes, check_head_dim, load_checked, settings_from, shard_kv_heads, shard_params

log = logging.getLogger("oscar_vllm")

#: group size of the artifact loaded by this process's layers (read by customize_spec)
_LOADED_GROUP: dict[str, int] = {}

__all__ = [
    "OscarAttentionBackend",
    "OscarMetadata",
    "OscarMetadataBuilder",
    "OscarAttentionImpl",
    "cell_bytes",
]


def _artifact_for(vllm_config: Any):  # noqa: ANN202 - Rotations
    """Load (once per process) and check the artifact against the model in ``vllm_config``."""
    mc = vllm_config.model_config
    settings = settings_from(getattr(vllm_config, "additional_config", None))
    hf = mc.hf_text_config
    num_layers = int(hf.num_hidden_layers)
    total_kv = int(mc.get_total_num_kv_heads())
    return load_checked(settings, num_layers, total_kv, int(mc.get_head_size()))


class OscarAttentionBackend(AttentionBackend):
    """vLLM attention backend over the OSCAR paged INT2 + BF16-window cache."""

    accept_output_buffer: bool = True
    # The write needs the per-step metadata (positions, window slots), so it runs in forward.
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "bfloat16", "float16"]

    @staticmethod
    def get_name() -> str:
        return compat.BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[OscarAttentionImpl]:
        return OscarAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[OscarMetadataBuilder]:
        return OscarMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [d for d in range(16, 513, 16)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple | None:
        return compat.kv_cache_layouts()

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
        group = _LOADED_GROUP.get("group", spec.head_size)
        return replace(spec, state_content_bytes=cell_bytes(spec.head_size, group))


@dataclass
class OscarMetadata(AttentionMetadata):
    """One step's batch, shared by every layer (all int32 on the model's device)."""

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


class OscarMetadataBuilder(AttentionMetadataBuilder[OscarMetadata]):
    """Builds :class:`OscarMetadata` and gives every live request a window slot.

    The slot is vLLM's persistent request row when the model runner provides it
    (V2 runner); otherwise (V1 runner, e.g. on CPU) it is kept in a table keyed by the
    request's first KV block — unique among live requests because prefix caching is
    off under OSCAR — and assigned when a request starts (no cached tokens).
    """

    reorder_batch_threshold: int | None = 1

    def __init__(
        self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.max_slots = int(vllm_config.scheduler_config.max_num_seqs)
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # first block id -> slot, LRU order
        self._free = list(range(self.max_slots))

    def _assign(self, first_blocks: list[int], starts: list[bool], active: list[bool]) -> list[int]:
        slots = [0] * len(first_blocks)
        in_batch = {b for b, a in zip(first_blocks, active, strict=True) if a}
        for i, (block, start, act) in enumerate(zip(first_blocks, starts, active, strict=True)):
            if not act:
                continue
            if block in self._slot_of:
                self._slot_of.move_to_end(block)  # a restart reuses its (dead) predecessor's slot
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
                    raise OscarError(f"OSCAR: more than max_num_seqs={self.max_slots} live requests")
                self._free.append(self._slot_of.pop(victim))
            slot = self._free.pop()
            self._slot_of[block] = slot
            slots[i] = slot
        return slots

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> OscarMetadata:
        cm = common_attn_metadata
        dev = cm.seq_lens.device
        b = cm.num_reqs
        qsl = cm.query_start_loc[: b + 1].to(torch.int32)
        qsl_cpu = cm.query_start_loc_cpu[: b + 1].to(torch.int64)
        q_lens_cpu = qsl_cpu[1:] - qsl_cpu[:-1]
        seq_lens = cm.seq_lens[:b].to(torch.int32)
        seq_cpu = getattr(cm, "seq_lens_cpu_upper_bound", None)
        seq_cpu = (seq_cpu if seq_cpu is not None else cm.seq_lens.cpu())[:b].to(torch.int64)
        prefix_cpu = seq_cpu - q_lens_cpu
        prefix_lens = seq_lens - (qsl[1:] - qsl[:-1])
        block_table = cm.block_table_tensor[:b].to(torch.int32)
        rows = compat.request_slots(cm)
        if rows is not None:
            window_slots = torch.as_tensor(rows[:b], dtype=torch.int32).to(dev)
        else:
            first = block_table[:, 0].cpu().tolist() if block_table.shape[1] else [0] * b
            slots = self._assign(first, (prefix_cpu == 0).tolist(), (q_lens_cpu > 0).tolist())
            window_slots = torch.tensor(slots, dtype=torch.int32, device=dev)
        n = int(qsl_cpu[-1])
        tok = torch.arange(n, device=dev, dtype=torch.int32)
        seq_index = torch.searchsorted(qsl[1:], tok, right=True).to(torch.int32)
        positions = prefix_lens[seq_index] + tok - qsl[seq_index]
        return OscarMetadata(
            num_actual_tokens=n,
            max_query_len=int(q_lens_cpu.max()) if b else 0,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            prefix_lens=prefix_lens,
            block_table=block_table,
            slot_mapping=cm.slot_mapping[:n],
            positions=positions,
            seq_index=seq_index,
            window_slots=window_slots,
            all_decode=bool(b) and bool((q_lens_cpu <= 1).all()) and bool((prefix_cpu > 0).all()),
        )


class OscarAttentionImpl(AttentionImpl):
    """One decoder layer: quantising writes and attention through oscar-kernels."""

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
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.kv_sharing_target_layer_name = None
        cfg = compat.current_config()
        self.rotations = _artifact_for(cfg)
        rot = self.rotations
        _LOADED_GROUP["group"] = rot.group_size
        pc = cfg.parallel_config
        self.heads = shard_kv_heads(
            int(cfg.model_config.get_total_num_kv_heads()), pc.tensor_parallel_size, _tp_rank()
        )
        if len(self.heads) != num_kv_heads:
            raise OscarError(f"OSCAR: this rank holds {num_kv_heads} KV heads, expected {len(self.heads)}")
        self.layout = CacheLayout(
            num_kv_heads=num_kv_heads,
            head_dim=head_size,
            page_size=int(cfg.cache_config.block_size),
            group_size=rot.group_size,
            sink_tokens=rot.sink_tokens,
            recent_tokens=rot.recent_tokens,
        )
        self.max_seqs = int(cfg.scheduler_config.max_num_seqs)
        self.device = torch.device(cfg.device_config.device)
        # Allocate (and touch) the windows now so that they count as non-KV memory.
        self.windows = _windows(self.layout, self.max_seqs, self.device)
        _take_from_explicit_budget(cfg, sum(w.numel() * w.element_size() for w in self.windows))
        self._cache: PagedKVCache | None = None
        self._cache_src: int | None = None
        self._params = None

    def _layer_state(self, layer: Any, kv_cache: torch.Tensor) -> tuple[PagedKVCache, Any]:
        if self._params is None:
            idx = compat.layer_index(getattr(layer, "layer_name", ""))
            params = shard_params(LayerQuantParams.from_rotations(self.rotations, idx), self.heads)
            self._params = params.expand(self.num_kv_heads, self.head_size, kv_cache.device)
        if self._cache is None or self._cache_src != kv_cache.data_ptr():
            lo = self.layout
            if kv_cache.shape[2] != lo.page_size:  # kernel blocks may be smaller than vLLM's
                lo = replace(lo, page_size=int(kv_cache.shape[2]))
                self.layout = lo
            buf = compat.page_buffer(kv_cache, page_bytes(lo))
            c = cache_from_page_buffer(lo, buf, 1)
            ks, vs, kr, vr = self.windows
            self._cache = replace(c, k_sink=ks, v_sink=vs, k_recent=kr, v_recent=vr)
            self._cache.validate()
            self._cache_src = kv_cache.data_ptr()
        return self._cache, self._params

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: OscarMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise OscarError("the OSCAR attention backend does not support fused output quantization")
        assert output is not None
        if attn_metadata is None:  # profiling / warm-up run without a cache
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
        paged_write(
            cache, params, k, v, md.slot_mapping, md.positions, md.seq_index, md.seq_lens, md.window_slots
        )
        if md.all_decode:
            out = decode_attention(
                q, cache, params, md.block_table, md.seq_lens, md.window_slots, softmax_scale=self.scale
            )
        else:
            out = extend_attention(
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
                softmax_scale=self.scale,
            )
        output[:n].view(n, h, d).copy_(out)
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
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (unit use): rank 0
        return 0
