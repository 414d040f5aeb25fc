"""What OSCAR tells vLLM's log at start-up.

* :func:`announce_active`, called by every OSCAR layer as vLLM builds it, logs once per
  process (each worker builds every layer) the line made by :func:`active_line`::

      OSCAR active: artifact /abs/rot.safetensors (format version 3), 30 INT2 layers, 2.50 bits/element,
      window records held

* :func:`install_kv_report` makes the engine core log, once vLLM has sized the KV cache, the
  line made by :func:`kv_line`: vLLM's token count beside what BF16 pages would hold in the
  same memory (KV pages + OSCAR's BF16 windows) and the bytes per token of each.
* :func:`install_cpu_note`: vLLM's CPU platform logs ``Cannot use AttentionBackendEnum.OSCAR
  backend on CPU.`` although OSCAR serves there (oscar-vllm points ``CPU_ATTN`` at it,
  :mod:`oscar_vllm.cpu_select`); a filter rewrites that one record into what happens.

The line builders take plain values (unit-tested without vLLM); the rest reads vLLM's config.
Logging goes to ``vllm.oscar``, a child of vLLM's logger, so it has vLLM's handler, format and
level (``VLLM_LOGGING_LEVEL``); the ``oscar_vllm`` logger has no handler in a vLLM process.
"""

from __future__ import annotations

import logging
from typing import Any

from oscar_kernels.serving import cell_bytes, window_bytes_per_slot

__all__ = [
    "bits_per_element",
    "active_line",
    "kv_line",
    "announce_active",
    "report_kv",
    "install_kv_report",
    "install_cpu_note",
    "CPU_NOTE",
]

log = logging.getLogger("vllm.oscar")

#: what replaces vLLM's "Cannot use AttentionBackendEnum.OSCAR backend on CPU."
CPU_NOTE = (
    "OSCAR selected: vLLM's CPU platform names CPU_ATTN for every backend, and oscar-vllm "
    "points CPU_ATTN at the OSCAR backend while OSCAR is selected"
)
# vLLM 0.32/0.33 vllm/platforms/cpu.py: logger.info("Cannot use %s backend on CPU.", selected_backend)
_CPU_MESSAGE = "Cannot use %s backend on CPU."
_CPU_LOGGER = "vllm.platforms.cpu"

_announced = False


def bits_per_element(group: int) -> float:
    """Stored bits per K or V element: the 2-bit code + a bf16 scale and zero per ``group`` elements."""
    return 2 + 32 / group


def active_line(
    path: str,
    format_version: str,
    num_layers: int,
    excluded: tuple[int, ...] | list[int],
    group: int,
    window_records: str | None,
) -> str:
    """The "OSCAR active" line.

    Args:
        path: the artifact as configured.
        num_layers: the model's decoder layers; ``excluded`` of them keep a BF16 KV cache.
        group: the artifact's quantisation group.
        window_records: ``"held"`` / ``"transient"`` with exact prefix caching, else ``None``.
    """
    layers = f"{num_layers - len(excluded)} INT2 layers"
    if excluded:
        layers += f", excluded {sorted(excluded)} (BF16)"
    records = window_records or "none (prefix caching off)"
    return (
        f"OSCAR active: artifact {path} (format version {format_version}), {layers}, "
        f"{bits_per_element(group):.2f} bits/element, window records {records}"
    )


def kv_line(
    tokens: int,
    num_blocks: int,
    block_size: int,
    num_layers: int,
    num_excluded: int,
    kv_heads: int,
    head_dim: int,
    group: int,
    window_tokens: int,
    max_seqs: int,
) -> str:
    """The KV-capacity line: vLLM's count against BF16 pages in the same memory.

    Args:
        tokens: vLLM's KV capacity in tokens (its own, group-aware count).
        num_blocks: KV blocks vLLM allocated; each holds one page per layer of ``block_size``
            tokens of the INT2 layers' (and excluded layers' BF16) page format.
        kv_heads: KV heads of one tensor-parallel rank (pages and windows are per rank).
        window_tokens: sink + recent tokens of the BF16 windows, ``max_seqs`` rows per INT2 layer.
    """
    int2 = num_layers - num_excluded
    bf16_token = num_layers * kv_heads * head_dim * 4  # K and V, 2 bytes each
    oscar_token = int2 * kv_heads * cell_bytes(head_dim, group) + num_excluded * kv_heads * head_dim * 4
    pages = num_blocks * block_size * oscar_token
    windows = max_seqs * window_bytes_per_slot(int2, kv_heads, head_dim, window_tokens, 0)
    # BF16 would have both: no windows, so their memory would hold pages too (whole blocks). vLLM's
    # unused remainder (under one OSCAR block) is not known here: "about", low by at most ~1 block
    bf16_tokens = (pages + windows) // bf16_token // block_size * block_size
    ratio = f"{tokens / bf16_tokens:.2f}x" if bf16_tokens else "n/a"
    return (
        f"OSCAR KV cache: {tokens:,} tokens; BF16 would hold about {bf16_tokens:,} tokens in the same memory "
        f"({ratio}; KV pages {pages / 2**20:.1f} MiB + OSCAR's BF16 windows {windows / 2**20:.1f} MiB); "
        f"{oscar_token:,} bytes per token against BF16's {bf16_token:,} ({bf16_token / oscar_token:.2f}x)"
    )


def announce_active(vllm_config: Any, rotations: Any) -> None:
    """Log :func:`active_line` once per process (every OSCAR layer calls this as it is built)."""
    global _announced
    if _announced:
        return
    _announced = True
    from . import compat
    from .settings import settings_from

    try:
        settings = settings_from(getattr(vllm_config, "additional_config", None))
        line = active_line(
            settings.rotations,
            rotations.format_version,
            int(vllm_config.model_config.hf_text_config.num_hidden_layers),
            settings.exclude_layers,
            int(rotations.group_size),
            compat.window_records_mode(vllm_config),
        )
    except Exception as e:  # a report must never stop the engine; say why it is missing
        log.warning("OSCAR active (could not describe the configuration: %s)", e)
        return
    log.info("%s", line)


def report_kv(vllm_config: Any, kv_cache_config: Any) -> None:
    """Log :func:`kv_line` for an engine whose KV cache vLLM has just sized (engine-core process)."""
    from oscar_kernels.serving import kv_heads_of_rank

    from .settings import load_checked, settings_from

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    settings = settings_from(getattr(vllm_config, "additional_config", None))
    num_layers, total_kv, head_dim = (
        int(mc.hf_text_config.num_hidden_layers),
        int(mc.get_total_num_kv_heads()),
        int(mc.get_head_size()),
    )
    rot = load_checked(settings, num_layers, total_kv, head_dim)  # cached per process
    # the INT2 group's block; window groups (prefix caching) have smaller blocks in the same pages
    block = max(int(g.kv_cache_spec.block_size) for g in kv_cache_config.kv_cache_groups)
    num_blocks = int(cc.num_gpu_blocks)
    tokens = getattr(cc, "kv_cache_size_tokens", None)
    line = kv_line(
        int(tokens) if tokens else num_blocks * block,
        num_blocks,
        block,
        num_layers,
        len(settings.exclude_layers),
        len(kv_heads_of_rank(total_kv, int(vllm_config.parallel_config.tensor_parallel_size), 0)),
        head_dim,
        int(rot.group_size),
        int(rot.sink_tokens) + int(rot.recent_tokens),
        int(vllm_config.scheduler_config.max_num_seqs),
    )
    log.info("%s", line)


def install_kv_report() -> None:
    """Wrap the engine core's ``_initialize_kv_caches`` to call :func:`report_kv` (idempotent).

    That method sizes the KV cache (``cache_config.num_gpu_blocks``, vLLM's token count) and
    returns the scheduler's ``KVCacheConfig`` in vLLM 0.32 and 0.33; it is the method
    :func:`oscar_vllm.compat.guard_prefix_caching` wraps too.
    """
    from . import compat

    cls = compat.engine_core_class()
    original = cls._initialize_kv_caches
    if getattr(original, "_oscar_kv_report", False):
        return

    def _initialize_kv_caches(self: Any, vllm_config: Any) -> Any:
        result = original(self, vllm_config)
        if compat.oscar_selected(vllm_config):
            try:
                report_kv(vllm_config, result)
            except Exception as e:  # a report must never stop the engine
                log.warning("OSCAR: could not report the KV capacity: %s", e)
        return result

    _initialize_kv_caches._oscar_kv_report = True  # type: ignore[attr-defined]
    # keep compat's idempotence marker visible through this wrapper
    _initialize_kv_caches._oscar_guard = getattr(original, "_oscar_guard", False)  # type: ignore[attr-defined]
    cls._initialize_kv_caches = _initialize_kv_caches


class _CpuNote(logging.Filter):
    """Rewrites vLLM's CPU "Cannot use ... OSCAR backend" record; every other record passes unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if record.msg == _CPU_MESSAGE and len(args) == 1 and getattr(args[0], "name", None) == "OSCAR":
            record.msg, record.args = CPU_NOTE, ()
        return True


def install_cpu_note() -> None:
    """Install :class:`_CpuNote` on vLLM's CPU-platform logger (idempotent).

    A logger filter (not a handler) survives vLLM re-applying its logging config; it only
    touches records that name the OSCAR backend, i.e. only while OSCAR is selected.
    """
    logger = logging.getLogger(_CPU_LOGGER)
    if not any(isinstance(f, _CpuNote) for f in logger.filters):
        logger.addFilter(_CpuNote())
