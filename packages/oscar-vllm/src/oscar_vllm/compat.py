"""Every vLLM-version-specific piece of glue, in one module.

Run against vLLM 0.32.0 (the CPU build the tests use); checked against vLLM 0.33.0's sources
(``benchmarks/api_check.py`` and a file-by-file diff; lab/NOTES_vllm.md has the audit table: nothing
used here changed). Names that may differ are looked up defensively here, so a difference shows
up as one :class:`~oscar_math.errors.OscarError` naming the vLLM version, not as an
``AttributeError`` deep in a worker.

Importing this module does not import vLLM; the functions do. It is the only module of the
package that names vLLM's modules (``tests/test_compat_isolation.py`` checks it): the others
take vLLM's classes and hooks from the accessors at the end of this file.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
from typing import Any

import torch

from oscar_math.errors import OscarError

__all__ = [
    "BACKEND_NAME",
    "SUPPORTED",
    "vllm_version",
    "version_supported",
    "check_version",
    "register_backend",
    "register_cpu_override",
    "guard_prefix_caching",
    "default_max_num_seqs",
    "wrap_max_num_seqs_default",
    "default_block_size",
    "wrap_block_size_default",
    "guard_possible",
    "check_prefix_caching",
    "exact_prefix_caching",
    "window_spec",
    "window_records_mode",
    "uses_v2_runner",
    "in_flight_tokens",
    "cudagraph_support",
    "add_window_layer",
    "window_metadata",
    "attention_layer_base",
    "current_config",
    "oscar_selected",
    "layer_index",
    "layer_of_impl",
    "serve_with_default_backend",
    "page_buffer",
    "request_slots",
    "track_v1_requests",
    "track_v2_rows",
    "after_model_warm_up",
    "jit_warmup_enabled",
    "block_table_widths",
    "kv_cache_layouts",
    "attention_api",
    "tp_rank",
    "cpu_attention_backend",
    "sliding_window_api",
    "register_kv_spec",
    "engine_core_class",
]

log = logging.getLogger("oscar_vllm")

#: the name users select: ``--attention-backend OSCAR``
BACKEND_NAME = "OSCAR"
#: supported vLLM releases, ``[low, high)`` on (major, minor); keep in step with pyproject's
#: ``vllm`` extra (``vllm>=0.32,<0.34``).
SUPPORTED = ((0, 32), (0, 34))

_BACKEND_PATH = "oscar_vllm.backend.OscarAttentionBackend"
_CPU_SELECT_PATH = "oscar_vllm.cpu_select.SelectedBackend"


def vllm_version() -> str:
    """The installed vLLM version (``vllm.__version__``), or ``""`` when vLLM is absent."""
    try:
        import vllm
    except Exception:  # absent or broken: callers report it
        return ""
    return str(getattr(vllm, "__version__", ""))


def _major_minor(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def version_supported(version: str) -> bool:
    """Whether ``version`` lies in :data:`SUPPORTED`."""
    mm = _major_minor(version)
    return mm is not None and SUPPORTED[0] <= mm < SUPPORTED[1]


def check_version() -> str:
    """Raise a one-line :class:`OscarError` unless the installed vLLM is supported."""
    version = vllm_version()
    if not version_supported(version):
        lo, hi = SUPPORTED
        raise OscarError(
            f"the OSCAR attention backend supports vLLM >={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}; "
            f"this environment has vLLM {version or '(not importable)'}"
        )
    return version


def register_backend() -> None:
    """Register ``OSCAR`` with vLLM's backend registry (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.registry import register_backend as reg

    if BACKEND_NAME in AttentionBackendEnum.__members__:
        reg(AttentionBackendEnum[BACKEND_NAME], _BACKEND_PATH)
    else:
        reg(BACKEND_NAME, _BACKEND_PATH)
    member = AttentionBackendEnum[BACKEND_NAME]
    # vLLM pickles its config into spawned engine/worker processes, which unpickle it
    # before they load plugins; an enum member pickles by value and would not be found
    # there. Pickle this member as "register, then look up OSCAR" instead.
    member.__reduce_ex__ = _reduce_member  # type: ignore[method-assign]


def _reduce_member(_protocol: int) -> tuple:
    return (backend_member, ())


def backend_member() -> Any:
    """``AttentionBackendEnum.OSCAR``, registering it first in this process if needed."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend()
    return AttentionBackendEnum[BACKEND_NAME]


def register_cpu_override() -> None:
    """On the CPU platform, let ``CPU_ATTN`` resolve to OSCAR while OSCAR is selected.

    ``CpuPlatform.get_attn_backend_cls`` ignores the selected backend and always returns
    ``CPU_ATTN``'s path; the registry's override points that path at
    :mod:`oscar_vllm.cpu_select`, which returns vLLM's own CPU backend unless the
    current config selects OSCAR.
    """
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.registry import register_backend as reg

    if current_platform.is_cpu():
        reg(AttentionBackendEnum.CPU_ATTN, _CPU_SELECT_PATH)


def current_config() -> Any:
    """vLLM's current ``VllmConfig`` (set while the model and its layers are built), else ``None``."""
    from vllm.config import get_current_vllm_config

    try:
        return get_current_vllm_config()
    except AssertionError:  # 0.32 asserts when no config is set (e.g. CPU_ATTN resolved elsewhere)
        return None


def oscar_selected(vllm_config: Any) -> bool:
    """Whether ``vllm_config`` selects the OSCAR attention backend."""
    attn = getattr(vllm_config, "attention_config", None)
    backend = getattr(attn, "backend", None)
    return getattr(backend, "name", backend) == BACKEND_NAME


def guard_prefix_caching(register_records: Any = None, check_records: Any = None) -> None:
    """Make the engine core turn prefix caching off when OSCAR is selected (idempotent).

    ``register_records(vllm_config)`` (:func:`oscar_vllm.records.register`, passed in so this
    module never imports the records module, which imports it) runs before the scheduler is
    built when the window records are transient, and ``check_records(vllm_config,
    kv_cache_config)`` (:func:`oscar_vllm.records.check_admission`) once vLLM has sized the pool.

    A cache hit hands a new request blocks computed by another one; their INT2 pages are
    there but the BF16 sink/recent rows of the hit tokens are not (the windows live per
    sequence slot), so attention over a hit would differ from a run without caching.
    The engine core builds its scheduler (and the prefix cache) right after
    ``_initialize_kv_caches``; wrapping that method is the one place in the process that
    owns the scheduler where the config can still be changed. The backend's metadata
    builder also refuses (one clear error) a request that arrives with cached tokens it
    has no windows for, so a missed guard can never be silently wrong.
    """
    if not guard_possible():
        log.warning("OSCAR: cannot turn prefix caching off in this vLLM; OSCAR will require it off")
        return
    from vllm.v1.engine import core

    cls = core.EngineCore
    original = cls._initialize_kv_caches
    if getattr(original, "_oscar_guard", False):
        return

    def _initialize_kv_caches(self: Any, vllm_config: Any) -> Any:
        if (
            oscar_selected(vllm_config)
            and vllm_config.cache_config.enable_prefix_caching
            and not exact_prefix_caching(vllm_config)
        ):
            log.warning(
                "OSCAR: prefix caching turned off (exact hits need vLLM's hybrid KV-cache manager and "
                "no exclude_layers; see docs/vllm.md, 'Prefix caching')"
            )
            vllm_config.cache_config.enable_prefix_caching = False
        elif exact_prefix_caching(vllm_config):
            _dense_window_checkpoints(vllm_config.cache_config)
            if window_records_mode(vllm_config) == "transient" and register_records is not None:
                register_records(vllm_config)  # the scheduler in this process builds the manager
                out = original(self, vllm_config)
                if check_records is not None:
                    check_records(vllm_config, out)
                return out
        return original(self, vllm_config)

    _initialize_kv_caches._oscar_guard = True  # type: ignore[attr-defined]
    cls._initialize_kv_caches = _initialize_kv_caches


def default_max_num_seqs() -> None:
    """Give OSCAR engines a ``max_num_seqs`` default sized to the windows (idempotent).

    vLLM fills in ``max_num_seqs`` in ``EngineArgs`` when the user gave none (1024 on an
    H100/H200). OSCAR allocates BF16 windows per sequence slot, so that default would take
    ~45 GiB at Qwen3-8B's shape; :func:`oscar_vllm.settings.default_max_num_seqs` picks the
    slots whose windows fit in a few percent of the device instead. A user's value is kept.
    """
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return
    wrap_max_num_seqs_default(EngineArgs)


def wrap_max_num_seqs_default(cls: type) -> None:
    """Wrap ``cls._set_default_max_num_seqs_and_batched_tokens_args`` (vLLM's ``EngineArgs``, or a
    stand-in in tests) so that OSCAR engines get :func:`oscar_vllm.settings.default_max_num_seqs`."""
    original = getattr(cls, "_set_default_max_num_seqs_and_batched_tokens_args", None)
    if original is None or getattr(original, "_oscar_default", False):
        if original is None:
            log.warning("OSCAR: this vLLM sets max_num_seqs elsewhere; OSCAR keeps vLLM's default")
        return

    def _set_defaults(self: Any, usage_context: Any, model_config: Any, parallel_config: Any) -> Any:
        user_set = self.max_num_seqs is not None
        out = original(self, usage_context, model_config, parallel_config)
        if not user_set and _args_select_oscar(self):
            engine_default = int(self.max_num_seqs)
            n = _oscar_max_num_seqs(self, engine_default, model_config, parallel_config)
            if n < engine_default:
                log.info(
                    "OSCAR: max_num_seqs defaults to %d (vLLM's default %d): each sequence slot holds "
                    "BF16 windows; pass --max-num-seqs to choose",
                    n,
                    engine_default,
                )
                self.max_num_seqs = n
        return out

    _set_defaults._oscar_default = True  # type: ignore[attr-defined]
    cls._set_default_max_num_seqs_and_batched_tokens_args = _set_defaults


def default_block_size() -> None:
    """Give OSCAR engines on a GPU 64-token KV blocks where the user chose none (idempotent).

    vLLM's default is 16 tokens. The INT2 decode kernel reads a 64-token page in one tile (the
    16-byte ``cp.async`` ring and 64-token tiles need page and sink multiples of 64): on the H200 a
    decode layer at 1 x 130k took 66 µs with 64-token pages against 120 µs with 16-token ones, and
    109 vs 192 µs at 8 x 32k (``lab/kernel_studies/page_size_decode.py``, docs/vllm.md). The
    value is set before vLLM builds its cache config, so vLLM treats it as chosen and the
    backends, window records and prefix-cache hashes all see one block size from the start.
    """
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return
    wrap_block_size_default(EngineArgs, _on_cuda)


def wrap_block_size_default(cls: type, on_gpu: Any) -> None:
    """Wrap ``cls.create_engine_config`` (vLLM's ``EngineArgs``, or a stand-in in tests) so that an
    OSCAR engine with no ``block_size`` gets :data:`oscar_vllm.settings.GPU_BLOCK_SIZE` when
    ``on_gpu()`` is true."""
    from .settings import GPU_BLOCK_SIZE

    original = getattr(cls, "create_engine_config", None)
    if original is None or getattr(original, "_oscar_default", False):
        return

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "block_size", 0) is None and _args_select_oscar(self) and on_gpu():
            log.info(
                "OSCAR: block_size defaults to %d (vLLM's default 16): the INT2 decode kernel reads "
                "64-token pages ~1.8x faster; pass --block-size to choose",
                GPU_BLOCK_SIZE,
            )
            self.block_size = GPU_BLOCK_SIZE
        return original(self, *args, **kwargs)

    create_engine_config._oscar_default = True  # type: ignore[attr-defined]
    cls.create_engine_config = create_engine_config


def _on_cuda() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cuda())
    except Exception:  # no platform resolved: keep vLLM's default
        return False


def _args_select_oscar(args: Any) -> bool:
    for value in (
        getattr(args, "attention_backend", None),
        getattr(getattr(args, "attention_config", None), "backend", None),
    ):
        if getattr(value, "name", value) == BACKEND_NAME:
            return True
    return False


def _oscar_max_num_seqs(args: Any, engine_default: int, model_config: Any, parallel_config: Any) -> int:
    from oscar_kernels.serving import window_bytes_per_slot

    from .settings import default_max_num_seqs, load_checked, settings_from

    try:
        settings = settings_from(getattr(args, "additional_config", None))
        num_layers = int(model_config.hf_text_config.num_hidden_layers)
        total_kv, head_dim = int(model_config.get_total_num_kv_heads()), int(model_config.get_head_size())
        rot = load_checked(settings, num_layers, total_kv, head_dim)  # cached: the layers reuse it
        kv = int(model_config.get_num_kv_heads(parallel_config))
        slot = window_bytes_per_slot(
            num_layers - len(settings.exclude_layers), kv, rot.head_dim, rot.sink_tokens, rot.recent_tokens
        )
        device = _device_total_memory()
    except Exception:  # a bad artifact is reported by the layers at start-up; keep vLLM's default
        return engine_default
    return default_max_num_seqs(engine_default, device, slot)


def _device_total_memory() -> int:
    from vllm.platforms import current_platform

    return int(current_platform.get_device_total_memory())


def _dense_window_checkpoints(cache_config: Any) -> None:
    """Let the window groups cache every full block (vLLM's ``prefix_cache_retention_interval=None``).

    vLLM's default (0) keeps a sliding-window group's blocks cached only at a prompt's replay
    boundary, so a hit could never reach into generated tokens (the continuation of a finished
    request) although the INT2 group has them. Dense retention costs no capacity: freed blocks
    stay in the free queue, evictable, with their hashes. A positive interval a user chose is
    kept.
    """
    if getattr(cache_config, "prefix_cache_retention_interval", None) == 0:
        log.info("OSCAR: prefix_cache_retention_interval set to None (window blocks cached densely)")
        cache_config.prefix_cache_retention_interval = None


#: Triton's own variable for its kernel cache folder
TRITON_CACHE_ENV = "TRITON_CACHE_DIR"


def pin_triton_cache(environ: Any = None) -> str | None:
    """Keep OSCAR's Triton kernels in one cache folder from start to start.

    When vLLM's torch.compile compiles (an empty compile cache) it points ``TRITON_CACHE_DIR`` at a
    folder of that compilation (``…/torch_compile_cache/<hash>/…/triton``); when it loads a
    cached compilation it does not, and Triton uses its default folder. OSCAR's kernels, compiled
    in the same process, followed: on the H100 each of three starts of one configuration compiled
    34-41 of them again (the warm-up's 51-61 s and most of the graph captures' 31-54 s), because
    every start looked in another folder. Unless the user set the variable, it is set here, in the
    engine process before the model compiles, to Triton's default (``~/.triton/cache``): vLLM and
    Inductor keep a folder the caller chose. Returns the folder set, or ``None`` (the user's kept).
    """
    import os

    from .warmup_plans import triton_cache_dir

    env = os.environ if environ is None else environ
    if env.get(TRITON_CACHE_ENV):
        return None
    folder = str(triton_cache_dir())  # unset here: Triton's default (``TRITON_HOME`` honoured)
    env[TRITON_CACHE_ENV] = folder
    log.info("OSCAR: Triton's kernel cache pinned to %s (set %s to choose)", folder, TRITON_CACHE_ENV)
    return folder


def guard_possible() -> bool:
    """Whether :func:`guard_prefix_caching` can hook this vLLM (checked again by every worker)."""
    try:
        from vllm.v1.engine import core
    except ImportError:
        return False
    return callable(getattr(getattr(core, "EngineCore", None), "_initialize_kv_caches", None))


def exact_prefix_caching(vllm_config: Any) -> bool:
    """Whether OSCAR serves prefix caching in this configuration, with exact hits.

    The BF16 window rows then live in vLLM-managed pages of sliding-window KV-cache groups
    (one block table per group, shared by the prefix cache like any KV block; docs/vllm.md,
    "Prefix caching"). That needs vLLM's hybrid KV-cache manager (on by default) and every
    layer in INT2: an ``exclude_layers`` BF16 page beside the INT2 page would make vLLM pad
    every page to the larger size. The engine core (the guard) and every worker decide with
    this same function on the same config.
    """
    from .settings import settings_from

    if not (oscar_selected(vllm_config) and vllm_config.cache_config.enable_prefix_caching):
        return False
    if getattr(vllm_config.scheduler_config, "disable_hybrid_kv_cache_manager", True):
        return False
    try:
        return not settings_from(getattr(vllm_config, "additional_config", None)).exclude_layers
    except OscarError:  # reported by the layers at start-up
        return False


def uses_v2_runner(vllm_config: Any) -> bool:
    """Whether vLLM runs the V2 model runner (persistent ``req_idx`` rows) in this configuration."""
    try:
        return bool(vllm_config.use_v2_model_runner)
    except Exception:  # property missing or refusing this config: the V1 runner
        return False


def window_records_mode(vllm_config: Any) -> str | None:
    """``"transient"`` or ``"held"`` window records with exact prefix caching, else ``None``.

    ``additional_config["oscar"]["window_records"]``; ``auto`` (the default) is ``transient``
    wherever a running request's window slot can never be lost: its persistent row with vLLM's
    V2 model runner, its request id with the V1 runner (:func:`track_v1_requests`); ``held``
    only where neither is available (docs/vllm.md, "Prefix caching").
    """
    from .settings import settings_from

    if not exact_prefix_caching(vllm_config):
        return None
    mode = settings_from(getattr(vllm_config, "additional_config", None)).window_records
    if mode == "auto":
        return "transient" if uses_v2_runner(vllm_config) or track_v1_requests() else "held"
    return mode


def window_spec(
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: Any,
    window: int,
    cell: int,
    spec_class: type | None = None,
) -> Any:
    """Spec of one window page: vLLM's ``SlidingWindowSpec`` (its manager shares blocks through the
    prefix cache, accepts a hit only if the last ``window`` tokens' blocks are cached, and frees
    blocks that leave the window), sized exactly as one INT2 page (``cell`` bytes per head and
    token) so that vLLM needs no page-size unification. ``spec_class``: a subclass to build instead,
    e.g. :class:`oscar_vllm.records.OscarWindowSpec`, whose manager frees a running request's
    records once written."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    cls = spec_class or SlidingWindowSpec
    return cls(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        sliding_window=window,
        state_content_bytes=cell,
    )


def in_flight_tokens(vllm_config: Any) -> int:
    """Tokens scheduled but not yet settled, which vLLM's sliding-window manager holds blocks for
    besides the window (``VllmConfig.max_in_flight_tokens``; ``max_num_batched_tokens`` where
    that property does not exist)."""
    n = getattr(vllm_config, "max_in_flight_tokens", None)
    if isinstance(n, int):
        return n
    return int(vllm_config.scheduler_config.max_num_batched_tokens)


def cudagraph_support(vllm_config: Any) -> Any:
    """The OSCAR metadata builder's ``AttentionCGSupport`` in this configuration.

    ``UNIFORM_SINGLE_TOKEN_DECODE`` (vLLM captures FULL graphs of pure decode batches, padded
    with zero-token rows, and runs other batches with attention outside the graphs) when prefix
    caching is off: the decode step (``paged_write`` + ``decode_attention``) makes no host
    synchronisation, its launch sizes depend on host-known sizes only, and the builder keeps the
    metadata in persistent buffers. With exact prefix caching the same on vLLM's V2 model runner:
    the slot bookkeeping runs in the INT2 group's metadata builder and the window restores in the
    window groups' builders, before the model runs (``backend._StepExchange``), and the window
    pages' write of a decode step makes no host synchronisation either. ``NEVER`` with prefix
    caching on the V1 runner, whose content-keyed slots are checked against record stamps in the
    forward pass (piecewise graphs still capture everything else).
    """
    from vllm.v1.attention.backend import AttentionCGSupport

    if exact_prefix_caching(vllm_config) and not uses_v2_runner(vllm_config):
        return AttentionCGSupport.NEVER
    return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def dense_attention(head_size: int) -> Any:
    """vLLM's FlashAttention varlen kernel as an ``oscar_kernels.DenseAttention`` (the version vLLM's
    own ``FLASH_ATTN`` backend picks: FA3 on Hopper), or ``None`` where vLLM has none (CPU build,
    unsupported GPU): prefill then runs through OSCAR's Triton extend kernel."""
    try:
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

        version = get_flash_attn_version(head_size=head_size)
    except Exception as e:  # no FlashAttention in this build: the Triton path serves
        log.info("OSCAR: prefill through the Triton extend kernel (vLLM's FlashAttention: %s)", e)
        return None
    if version is None:
        return None

    def attn(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left):  # noqa: ANN001, ANN202
        out, lse = flash_attn_varlen_func(
            q, k, v, max_q, cu_q, max(int(max_k), 1), cu_seqlens_k=cu_k, softmax_scale=scale, causal=True,
            window_size=[int(window_left), 0] if window_left >= 0 else None,
            return_softmax_lse=True, fa_version=version,
        )  # fmt: skip
        return out, lse

    return attn


def add_window_layer(vllm_config: Any, name: str, layer: Any) -> None:
    """Register a window layer where vLLM collects attention layers (``static_forward_context``)
    before it asks them for KV-cache specs; the model never calls it."""
    ctx = vllm_config.compilation_config.static_forward_context
    if name in ctx and ctx[name] is not layer:
        raise OscarError(f"OSCAR: attention layer name {name!r} is taken")
    ctx[name] = layer


def window_metadata(names: list[str]) -> list[Any]:
    """This step's metadata of the window layers ``names`` (built by their metadata builder)."""
    from vllm.forward_context import get_forward_context

    md = get_forward_context().attn_metadata
    if isinstance(md, list):  # micro-batches: not used with OSCAR
        raise OscarError("OSCAR: micro-batching (ubatch) is not supported with prefix caching")
    try:
        return [md[n] for n in names]
    except (KeyError, TypeError) as e:
        raise OscarError(f"OSCAR: vLLM {vllm_version()} built no metadata for window layer {e}") from e


def check_prefix_caching(vllm_config: Any) -> None:
    """Start-up error when prefix caching is on, OSCAR cannot serve it exactly here
    (:func:`exact_prefix_caching`) and the guard cannot turn it off."""
    on = vllm_config.cache_config.enable_prefix_caching
    if on and not exact_prefix_caching(vllm_config) and not guard_possible():
        raise OscarError(
            "OSCAR cannot serve prefix-cache hits exactly in this configuration and cannot turn "
            f"prefix caching off in vLLM {vllm_version()}: start vLLM with --no-enable-prefix-caching "
            "(enable_prefix_caching=False)"
        )


def layer_index(layer_name: str) -> int:
    """Decoder layer index from a vLLM layer name (``model.layers.7.self_attn.attn`` → 7)."""
    m = re.search(r"\.(\d+)\.", f".{layer_name}.")
    if not m:
        raise OscarError(f"cannot tell the decoder layer of attention layer {layer_name!r}")
    return int(m.group(1))


def layer_of_impl(vllm_config: Any, impl: Any) -> tuple[str, Any]:
    """``(name, layer)`` of the attention layer whose ``impl`` is ``impl``.

    vLLM registers every attention layer in ``compilation_config.static_forward_context``
    (name -> layer) once it is built; an implementation is not told its layer's name.
    """
    ctx = vllm_config.compilation_config.static_forward_context
    for name, layer in ctx.items():
        if getattr(layer, "impl", None) is impl:
            return name, layer
    raise OscarError(
        f"OSCAR: cannot find the attention layer of an OSCAR implementation in vLLM {vllm_version()}'s "
        "forward context (needed for exclude_layers)"
    )


def serve_with_default_backend(
    vllm_config: Any, layer: Any, impl_args: tuple, impl_kwargs: dict[str, Any], act_dtype: Any
) -> Any:
    """Hand ``layer`` over to the backend vLLM picks when no backend is selected; return that class.

    Used for the layers ``exclude_layers`` keeps in BF16: the layer gets that backend's
    implementation (built with the arguments vLLM gave OSCAR's) and reports that backend
    from ``get_attn_backend()``, so vLLM derives the layer's KV-cache spec (a plain BF16
    page), its metadata builder and its KV write from that backend, exactly as without
    OSCAR. Must run before vLLM collects the KV-cache specs, i.e. while the model is
    loaded (``AttentionImpl.process_weights_after_loading``).
    """
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import get_attn_backend

    attn = vllm_config.attention_config
    selected = attn.backend
    with set_current_vllm_config(vllm_config):
        # vLLM's own selection with OSCAR deselected (on CPU, cpu_select then answers
        # vLLM's CPU backend); the registry/platform caches key on the backend, so the
        # OSCAR layers' selection is untouched.
        attn.backend = None
        try:
            backend = get_attn_backend(
                layer.head_size,
                act_dtype,
                layer.kv_cache_dtype,
                has_sink=getattr(layer, "has_sink", False),
                use_mm_prefix=getattr(layer, "use_mm_prefix", False),
                attn_type=layer.attn_type,
            )
        finally:
            attn.backend = selected
        if backend.get_name() == BACKEND_NAME:
            raise OscarError(
                "OSCAR: vLLM selected OSCAR again for a layer in exclude_layers (backend_per_kind set?)"
            )
        kwargs = dict(impl_kwargs)
        if backend.supports_alibi_sqrt():  # what Attention.__init__ adds for such backends
            kwargs["use_alibi_sqrt"] = False
        impl = backend.get_impl_cls()(*impl_args, **kwargs)
        layer.attn_backend = backend
        layer.impl = impl
        layer.backend = AttentionBackendEnum[backend.get_name()]
        impl.process_weights_after_loading(act_dtype)
    return backend


def kv_cache_layouts() -> tuple | None:
    """Layouts the backend accepts: head-major block interiors (``LBHNC``), so one block
    of one layer is one contiguous page; ``None`` where the enum does not exist."""
    try:
        from vllm.v1.kv_cache_interface import KVCacheLayout
    except ImportError:
        return None
    layout = getattr(KVCacheLayout, "LBHNC", None)
    return None if layout is None else (layout,)


def page_buffer(kv_cache: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """vLLM's per-layer KV tensor (``[blocks, H, N, C]`` bytes, any dtype) as ``[blocks, page_bytes]`` uint8.

    Checks that every block is one dense page (it is with the ``LBHNC`` layout);
    a strided view, no copy.
    """
    t = kv_cache
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)  # last dim contiguous: reinterpret bytes
    if t.dim() == 2 and t.shape[1] == page_bytes and t.stride(1) == 1:
        return t
    dense = t.dim() >= 2 and t[0].is_contiguous() and t[0].numel() == page_bytes
    if not dense:
        raise OscarError(
            f"vLLM handed OSCAR a KV cache block that is not one dense page of {page_bytes} bytes "
            f"(shape {tuple(kv_cache.shape)}, strides {tuple(kv_cache.stride())}, dtype {kv_cache.dtype}); "
            "use the LBHNC KV cache layout"
        )
    return torch.as_strided(t, (t.shape[0], page_bytes), (t.stride(0), 1))


def request_slots(common: Any) -> Any:
    """Persistent per-request row indices when the model runner provides them, else ``None``.

    vLLM's V2 model runner passes ``req_idx`` (the request's row in its request-state
    table, stable for the request's lifetime, in ``[0, max_num_seqs)``); the V1 runner
    (used on CPU) does not.
    """
    return getattr(common, "req_idx", None)


#: the request slots the V1 runner hook feeds and the config of the engine they belong to (one
#: OSCAR engine per process at a time: the latest wins; other engines' runners are left alone)
_V1_SLOTS: list[Any] = [None, None]


def _v1_runner_class() -> type | None:
    """vLLM's V1 model runner class if it has the two methods the request hook wraps."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception:  # noqa: BLE001 - any import failure means: no hook, held records
        return None
    ok = callable(getattr(GPUModelRunner, "_update_states", None)) and callable(
        getattr(GPUModelRunner, "execute_model", None)
    )
    return GPUModelRunner if ok else None


def track_v1_requests(slots: Any = None, vllm_config: Any = None) -> bool:
    """Feed ``slots`` (:class:`oscar_kernels.serving.RequestSlots`) the V1 model runner's requests.

    After the runner applies a scheduler output to its persistent batch (``_update_states``,
    which also orders the rows as the attention metadata will), ``slots.step`` gets the requests
    that finished, were preempted or resumed, and the batch's request ids in row order; after
    the step (``execute_model``) ``slots.end_step``. CPU runners subclass this class, so one
    wrapper covers them. Returns whether the hook is in place (with ``slots=None`` only checks);
    without it, OSCAR falls back to held window records (:func:`window_records_mode`).
    """
    cls = _v1_runner_class()
    if cls is None:
        return False
    if slots is None:
        return True
    _V1_SLOTS[:] = [slots, vllm_config]
    if getattr(cls._update_states, "_oscar_rows", False):
        return True
    update, execute = cls._update_states, cls.execute_model

    @functools.wraps(update)  # __wrapped__: inspect (api_check) still reads vLLM's source
    def _update_states(self: Any, scheduler_output: Any) -> Any:
        out = update(self, scheduler_output)
        target, cfg = _V1_SLOTS
        if target is not None and getattr(self, "vllm_config", None) is cfg:
            cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
            ended = {
                *scheduler_output.finished_req_ids,
                *(getattr(scheduler_output, "preempted_req_ids", None) or ()),
                *(getattr(cached, "resumed_req_ids", None) or ()),
            }
            target.step(ended, list(self.input_batch.req_ids))
        return out

    @functools.wraps(execute)
    def execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return execute(self, *args, **kwargs)
        finally:
            if _V1_SLOTS[0] is not None and getattr(self, "vllm_config", None) is _V1_SLOTS[1]:
                _V1_SLOTS[0].end_step()

    _update_states._oscar_rows = True  # type: ignore[attr-defined]
    cls._update_states = _update_states
    cls.execute_model = execute_model
    return True


#: V2 model runner rows: how many requests each row has been given, the request id it holds, and the
#: config of the engine they belong to (one OSCAR engine per process at a time, as _V1_SLOTS)
_V2_ROWS: list[Any] = [None, None, None]


def _v2_runner_class() -> type | None:
    """vLLM's V2 model runner class if it has the two methods the row hook wraps."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    except Exception:  # noqa: BLE001 - any import failure means: no hook, block-id tracking
        return None
    ok = callable(getattr(GPUModelRunner, "add_requests", None)) and callable(
        getattr(GPUModelRunner, "finish_requests", None)
    )
    return GPUModelRunner if ok else None


def track_v2_rows(vllm_config: Any, runner_class: type | None = None) -> dict[int, int] | None:
    """Count, per row of vLLM's V2 model runner, the requests the row has been given.

    The runner frees a row when its request finishes or is preempted (``finish_requests``) and
    gives rows to new and resumed requests (``add_requests``; with the V2 runner vLLM's scheduler
    sends resumed requests as new ones). The returned dict (row -> count) is bumped when a row
    gets a request other than the one it held; a request re-added to its own row (a streaming
    input update) keeps the count. :class:`oscar_kernels.serving.FreshRows` turns it into restores
    without reading block ids. ``None`` where the hook cannot be installed (then OSCAR tracks
    slot contents by block ids, :func:`oscar_kernels.serving.plan_slots`).
    """
    cls = runner_class or _v2_runner_class()
    if cls is None:
        return None
    if _V2_ROWS[2] is not vllm_config:
        _V2_ROWS[:] = [{}, {}, vllm_config]
    gen = _V2_ROWS[0]
    if getattr(cls.add_requests, "_oscar_rows", False):
        return gen
    add, finish = cls.add_requests, cls.finish_requests

    def _mine(runner: Any) -> bool:
        return getattr(runner, "vllm_config", None) is _V2_ROWS[2]

    @functools.wraps(finish)
    def finish_requests(self: Any, scheduler_output: Any) -> Any:
        if _mine(self):
            index = self.req_states.req_id_to_index
            owner = _V2_ROWS[1]
            for rid in (*scheduler_output.finished_req_ids, *(scheduler_output.preempted_req_ids or ())):
                row = index.get(rid)
                if row is not None and owner.get(row) == rid:
                    owner[row] = None
        return finish(self, scheduler_output)

    @functools.wraps(add)
    def add_requests(self: Any, scheduler_output: Any) -> Any:
        out = add(self, scheduler_output)
        if _mine(self):
            gen, owner = _V2_ROWS[0], _V2_ROWS[1]
            index = self.req_states.req_id_to_index
            for new in scheduler_output.scheduled_new_reqs:
                row = index.get(new.req_id)
                if row is not None and owner.get(row) != new.req_id:
                    gen[row] = gen.get(row, 0) + 1
                    owner[row] = new.req_id
        return out

    add_requests._oscar_rows = True  # type: ignore[attr-defined]
    cls.finish_requests = finish_requests
    cls.add_requests = add_requests
    return gen


def _gpu_worker_class() -> type | None:
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except Exception:  # noqa: BLE001 - no GPU worker in this build: nothing to hook
        return None
    return Worker if callable(getattr(Worker, "compile_or_warm_up_model", None)) else None


#: the worker method that starts vLLM's JIT monitor (0.33: the last step of its warm-up); the
#: OSCAR warm-up runs just before it, so the monitor reports only compiles during requests
_JIT_MONITOR_START = "_maybe_activate_jit_monitor"


def _hook_method(cls: type, attr: str, hook: Any, before: bool) -> None:
    """Run ``hook(self)`` before or after ``cls.attr`` at every call: one wrapper per method holding
    its hooks (installing a hook twice adds it once)."""
    _add_hook(cls, attr, hook, before)


def _add_hook(owner: Any, attr: str, hook: Any, before: bool) -> None:
    """Wrap ``owner.attr`` (a class's method or a module's function) once so that every call runs its
    hooks on the first argument (``self``, or the function's first), before or after it; add
    ``hook`` to them unless it is there already."""
    orig = getattr(owner, attr)
    hooks = getattr(orig, "_oscar_hooks", None)
    if hooks is None:
        hooks = []

        @functools.wraps(orig)
        def wrapped(first: Any, *args: Any, **kwargs: Any) -> Any:
            if before:
                for h in hooks:
                    h(first)
            out = orig(first, *args, **kwargs)
            if not before:
                for h in hooks:
                    h(first)
            return out

        wrapped._oscar_hooks = hooks  # type: ignore[attr-defined]
        setattr(owner, attr, wrapped)
    if hook not in hooks:
        hooks.append(hook)


def after_model_warm_up(hook: Any, worker_class: type | None = None) -> bool:
    """Run ``hook(worker)`` each time vLLM's GPU worker has finished its own warm-up and CUDA-graph
    capture (``Worker.compile_or_warm_up_model``), before the engine serves: just before the worker
    starts its JIT monitor where it has one (vLLM 0.33), else after the method. Idempotent per hook.
    False where the worker class or the method is missing (then nothing runs)."""
    cls = worker_class or _gpu_worker_class()
    if cls is None:
        return False
    before = callable(getattr(cls, _JIT_MONITOR_START, None))
    _hook_method(cls, _JIT_MONITOR_START if before else "compile_or_warm_up_model", hook, before)
    return True


#: modules that call vLLM's ``process_weights_after_loading`` on a freshly loaded model (0.33:
#: every model loader's ``load_model``, the weight-cache loaders)
_WEIGHT_PROCESSING_CALLERS = (
    "vllm.model_executor.model_loader.base_loader",
    "vllm.model_executor.model_loader.weight_cache.daemon",
    "vllm.model_executor.model_loader.weight_cache.ipc_loader",
)
_PROCESSING = "process_weights_after_loading"


def before_weight_processing(hook: Any) -> bool:
    """Run ``hook(model)`` each time a model loader has loaded a model's weights, before vLLM turns
    them into their kernels' formats (quantisation, the CPU build's packed GEMM weights) and before
    the attention layers' own ``process_weights_after_loading``. Install before the model loads (the
    plugin's ``register``). Idempotent. False where no loader module calls that function."""
    hooked = False
    for name in _WEIGHT_PROCESSING_CALLERS:
        try:
            mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a loader this build lacks
            continue
        hooked = _hook_function(mod, _PROCESSING, hook, before=True) or hooked
    return hooked


def _hook_function(mod: Any, attr: str, hook: Any, before: bool) -> bool:
    """Run ``hook(first argument)`` before or after the module function ``mod.attr`` at every call
    (its callers look it up by name at call time). False where ``mod`` has no such function."""
    if not callable(getattr(mod, attr, None)):
        return False
    _add_hook(mod, attr, hook, before)
    return True


def weights_pre_processed() -> bool:
    """Whether the weights being loaded come already processed (vLLM's weight-cache loaders: the
    process that cached them ran every post-load step, an OSCAR fold included); False where this
    vLLM has no such loaders."""
    try:
        from vllm.model_executor.utils import is_weights_pre_processed
    except ImportError:
        return False
    return bool(is_weights_pre_processed())


#: the worker's methods after which the model holds reloaded weights (0.33; those present)
_WEIGHT_RELOADS = ("reload_weights", "update_weights")


def after_weights_reloaded(hook: Any, worker_class: type | None = None) -> bool:
    """Run ``hook(worker)`` each time vLLM's GPU worker (the CPU worker inherits it) has reloaded or
    updated its model's weights (``reload_weights`` / ``update_weights``). Idempotent per hook. False
    where the worker class has neither method (then nothing runs)."""
    cls = worker_class or _gpu_worker_class()
    found = [a for a in _WEIGHT_RELOADS if cls is not None and callable(getattr(cls, a, None))]
    for attr in found:
        _hook_method(cls, attr, hook, before=False)
    return bool(found)


def model_of_worker(worker: Any) -> Any:
    """The worker's model itself (CUDA-graph and micro-batch wrappers taken off)."""
    return worker.model_runner.get_model()


#: the model runner's method that allocates the small KV cache its CUDA-graph memory profile
#: captures with (0.33: in ``determine_available_memory``, before the engine's KV cache exists)
_PROFILING_KV_CACHE = "_init_minimal_kv_cache_for_profiling"


def _gpu_model_runner_class() -> type | None:
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception:  # noqa: BLE001 - no GPU model runner in this build: nothing to hook
        return None
    return GPUModelRunner


#: where vLLM's V2 GPU model runner (``vllm/v1/worker/gpu/``, 0.33's default) profiles its CUDA-graph
#: memory: ``profile_cudagraph_memory(runner)`` calls the module's ``_PROFILING_KV_CACHE(runner)``
_V2_PROFILING_MODULE = "vllm.v1.worker.gpu.cudagraph_utils"


def after_profiling_kv_cache(
    hook: Any, runner_class: type | None = None, v2_module: Any | None = None
) -> bool:
    """Run ``hook(model_runner)`` each time vLLM's GPU model runner has allocated the small KV
    cache of its CUDA-graph memory profile, before that profile captures its graphs (whose first
    launches would compile OSCAR's decode kernels one after another): after the V1 runner's
    method, and after the V2 runner's module function of that name (the H100's 2026-12-07 server
    start had only the V1 hook, so its profile captures compiled for 84 s). Idempotent per hook.
    False where neither is found (then nothing runs: the kernels compile in the captures)."""
    cls = runner_class or _gpu_model_runner_class()
    hooked = False
    if cls is not None and callable(getattr(cls, _PROFILING_KV_CACHE, None)):
        _hook_method(cls, _PROFILING_KV_CACHE, hook, before=False)
        hooked = True
    if v2_module is None:
        try:
            v2_module = importlib.import_module(_V2_PROFILING_MODULE)
        except Exception:  # noqa: BLE001 - a build without the V2 runner
            v2_module = None
    if v2_module is not None:
        hooked = _hook_function(v2_module, _PROFILING_KV_CACHE, hook, before=False) or hooked
    return hooked


def jit_warmup_enabled(vllm_config: Any) -> bool:
    """Whether vLLM warms its own JIT kernels at start (``kernel_config.enable_jit_warmup``: on by
    default, off with ``enforce_eager``); without that field, whether the engine is not eager."""
    kc = getattr(vllm_config, "kernel_config", None)
    if kc is not None and hasattr(kc, "enable_jit_warmup"):
        return bool(kc.enable_jit_warmup)
    return not bool(getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False))


def block_table_widths(model_runner: Any) -> dict[str, int]:
    """Per KV-cache layer name, the columns of the block table vLLM's runner gives its group's
    backends (V2: ``block_tables.input_block_tables``; V1: the input batch's tables). Empty where
    neither is found (callers then derive the width from ``max_model_len``)."""
    try:
        groups = model_runner.kv_cache_config.kv_cache_groups
        tables = getattr(getattr(model_runner, "block_tables", None), "input_block_tables", None)
        if tables is None:
            multi = model_runner.input_batch.block_table
            tables = [bt.block_table.gpu for bt in multi.block_tables]
        return {name: int(t.shape[1]) for g, t in zip(groups, tables, strict=True) for name in g.layer_names}
    except Exception:  # noqa: BLE001 - another runner: the caller's fallback
        return {}


def attention_layer_base() -> type:
    """vLLM's ``AttentionLayerBase`` (what the model runner collects KV-cache specs from)."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    return AttentionLayerBase


# ---- vLLM classes and hooks the other modules build on (an upgrade that moves them: here) -----


def attention_api() -> Any:
    """vLLM's attention interface module (``vllm.v1.attention.backend``: the base classes,
    ``AttentionType``, ``CommonAttentionMetadata``, ``MultipleOf`` that ``backend.py`` builds on)."""
    from vllm.v1.attention import backend

    return backend


def tp_rank() -> int:
    """This worker's tensor-parallel rank (0 where vLLM's distributed state is not initialised)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (unit use): rank 0
        return 0


def cpu_attention_backend() -> type:
    """vLLM's own CPU attention backend (what ``CPU_ATTN`` means without OSCAR selected)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return CPUAttentionBackend


def sliding_window_api() -> tuple[type, type]:
    """``(SlidingWindowManager, SlidingWindowSpec)``: what the transient window records extend."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowManager, SlidingWindowSpec


def register_kv_spec(spec: type, manager: type, base: type, vllm_config: Any = None) -> None:
    """Register a KV-cache spec and its manager with vLLM's ``KVCacheSpecRegistry``, after vLLM's
    built-ins (registered lazily on the registry's first use, only while it is empty)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    if vllm_config is not None:
        with set_current_vllm_config(vllm_config):
            KVCacheSpecRegistry.check_kv_cache_spec_registry({})
    else:
        KVCacheSpecRegistry.check_kv_cache_spec_registry({})
    KVCacheSpecRegistry.register(spec, manager, uniform_type_base_spec=base)


def engine_core_class() -> type:
    """vLLM's ``EngineCore`` (whose ``_initialize_kv_caches`` sizes the KV cache)."""
    from vllm.v1.engine import core

    return core.EngineCore
