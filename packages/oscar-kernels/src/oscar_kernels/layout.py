"""The paged mixed-precision KV-cache layout of one attention layer.

Every token of a sequence is stored once in INT2 pages (codes + bf16 scale/zero),
written at the slot the engine gives it. Besides that, each *sequence* owns one row
of two BF16 window pools, in the rotated basis:

* ``sink``: the first ``sink_tokens`` positions, ``[max_seqs, H_kv, sink, d]``;
* ``recent``: a ring of the last ``recent_tokens`` positions, position ``p`` at
  row ``p % recent``, ``[max_seqs, H_kv, recent, d]``.

Attention over a sequence of length ``L`` reads key ``j`` from the sink when
``j < sink``, from the ring when ``j >= max(sink, L - recent)``, and from the INT2
pages otherwise. Because every token is *also* in INT2 from the moment it is
written, nothing moves when a token leaves the recent window: the window boundary
simply slides by one token per step (token-granular, no eviction pass, no host
synchronisation). The INT2 copies of the ``sink + recent`` window tokens are the
only redundancy (``(sink + recent) * 2.25`` bits per element per sequence).

INT2 pages are head-major inside a page (``[num_pages, H_kv, page_size, d/4]``) so
the program that serves one KV head reads ``page_size * d/4`` contiguous bytes per
page instead of ``d/4`` bytes every ``H_kv * d/4`` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from oscar_math import DEFAULT_RECENT, DEFAULT_SINK, SCALE_DTYPE, check, int2_bits_per_element
from oscar_math import bits_per_element as math_bits_per_element

__all__ = [
    "CacheLayout",
    "PagedKVCache",
    "allocate_cache",
    "page_bytes",
    "cache_from_page_buffer",
    "layout_bytes_per_token",
    "bits_per_element",
]


@dataclass(frozen=True)
class CacheLayout:
    """Sizes of one layer's paged INT2 + BF16-window cache.

    Attributes:
        num_kv_heads: ``H_kv``.
        head_dim: ``d`` (multiple of 16 so that a quarter-row feeds a 16-wide dot).
        page_size: tokens per INT2 page (the engine's block size).
        group_size: elements per quantisation group (``None`` = ``head_dim``).
        sink_tokens: first positions kept in BF16.
        recent_tokens: last positions kept in BF16 (ring).
    """

    num_kv_heads: int
    head_dim: int
    page_size: int = 64
    group_size: int | None = None
    sink_tokens: int = DEFAULT_SINK
    recent_tokens: int = DEFAULT_RECENT

    def __post_init__(self) -> None:
        check(self.num_kv_heads >= 1, "num_kv_heads", ">= 1", self.num_kv_heads)
        check(
            self.head_dim >= 16 and self.head_dim % 16 == 0,
            "head_dim",
            "a multiple of 16 (>= 16)",
            self.head_dim,
        )
        check(self.page_size >= 1, "page_size", ">= 1", self.page_size)
        g = self.group
        check(
            g >= 4 and self.head_dim % g == 0 and (g & (g - 1)) == 0,
            "group_size",
            f"a power-of-two divisor of head_dim {self.head_dim} (>= 4)",
            self.group_size,
        )
        check(self.sink_tokens >= 0, "sink_tokens", ">= 0", self.sink_tokens)
        check(self.recent_tokens >= 0, "recent_tokens", ">= 0", self.recent_tokens)

    @property
    def group(self) -> int:
        """Effective group size."""
        return self.head_dim if self.group_size is None else self.group_size

    @property
    def num_groups(self) -> int:
        return self.head_dim // self.group

    @property
    def window_tokens(self) -> int:
        return self.sink_tokens + self.recent_tokens


@dataclass
class PagedKVCache:
    """Tensors of one layer's cache (see module docstring).

    Attributes:
        layout: the sizes.
        k_codes, v_codes: ``[num_pages, H_kv, page_size, d/4]`` uint8, strided packing.
        k_scale, k_zero, v_scale, v_zero: ``[num_pages, H_kv, page_size, d/group]`` bf16.
        k_sink, v_sink: ``[max_seqs, H_kv, sink, d]`` bf16, rotated (keys centred).
        k_recent, v_recent: ``[max_seqs, H_kv, recent, d]`` bf16 ring, rotated.
    """

    layout: CacheLayout
    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    k_sink: torch.Tensor
    v_sink: torch.Tensor
    k_recent: torch.Tensor
    v_recent: torch.Tensor

    #: the tensor attributes, in declaration order (for copies, snapshots, comparisons).
    TENSOR_FIELDS: ClassVar[tuple[str, ...]] = (
        "k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero",
        "k_sink", "v_sink", "k_recent", "v_recent",
    )  # fmt: skip

    @property
    def num_pages(self) -> int:
        return self.k_codes.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.k_sink.shape[0]

    @property
    def device(self) -> torch.device:
        return self.k_codes.device

    def kernel_operands(self, codes: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple:
        """Pointers and strides every attention kernel takes, in their signature order.

        ``codes`` replaces ``(k_codes, v_codes)`` (the BF16-pages baseline kernel reads
        bf16 pages through the same skeleton).
        """
        kc, vc = (self.k_codes, self.v_codes) if codes is None else codes
        return (
            kc, vc, *kc.stride()[:3],
            self.k_scale, self.k_zero, self.v_scale, self.v_zero, *self.k_scale.stride()[:3],
            self.k_sink, self.v_sink, *self.k_sink.stride()[:3],
            self.k_recent, self.v_recent, *self.k_recent.stride()[:3],
        )  # fmt: skip

    def validate(self) -> None:
        """Check every tensor's shape and dtype against :attr:`layout`."""
        lo = self.layout
        p, h, d = self.num_pages, lo.num_kv_heads, lo.head_dim
        for name in ("k_codes", "v_codes"):
            t = getattr(self, name)
            check(
                t.shape == (p, h, lo.page_size, d // 4),
                f"shape of {name}",
                (p, h, lo.page_size, d // 4),
                tuple(t.shape),
            )
            check(t.dtype == torch.uint8, f"dtype of {name}", torch.uint8, t.dtype)
            check(t.stride(-1) == 1, f"stride(-1) of {name}", 1, t.stride(-1))
        for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
            t = getattr(self, name)
            exp = (p, h, lo.page_size, lo.num_groups)
            check(t.shape == exp, f"shape of {name}", exp, tuple(t.shape))
            check(t.dtype == SCALE_DTYPE, f"dtype of {name}", SCALE_DTYPE, t.dtype)
            check(t.stride(-1) == 1, f"stride(-1) of {name}", 1, t.stride(-1))
        m = self.max_seqs
        for name, n in (("k_sink", lo.sink_tokens), ("v_sink", lo.sink_tokens)):
            t = getattr(self, name)
            check(t.shape == (m, h, n, d), f"shape of {name}", (m, h, n, d), tuple(t.shape))
        for name, n in (("k_recent", lo.recent_tokens), ("v_recent", lo.recent_tokens)):
            t = getattr(self, name)
            check(t.shape == (m, h, n, d), f"shape of {name}", (m, h, n, d), tuple(t.shape))
        for name in ("k_sink", "v_sink", "k_recent", "v_recent"):
            t = getattr(self, name)
            check(t.dtype == torch.bfloat16, f"dtype of {name}", torch.bfloat16, t.dtype)
            check(t.stride(-1) == 1, f"stride(-1) of {name}", 1, t.stride(-1))
            check(t.device == self.device, f"device of {name}", self.device, t.device)


def allocate_cache(
    layout: CacheLayout, num_pages: int, max_seqs: int, device: torch.device | str = "cpu"
) -> PagedKVCache:
    """Allocate one layer's cache, filled with zeros.

    Args:
        layout: sizes.
        num_pages: INT2 pages in the pool (shared by all sequences).
        max_seqs: rows of the BF16 window pools (concurrent sequences).
    """
    check(num_pages >= 1, "num_pages", ">= 1", num_pages)
    check(max_seqs >= 1, "max_seqs", ">= 1", max_seqs)
    h, d, ps, ng = layout.num_kv_heads, layout.head_dim, layout.page_size, layout.num_groups

    def codes() -> torch.Tensor:
        return torch.zeros(num_pages, h, ps, d // 4, dtype=torch.uint8, device=device)

    def meta() -> torch.Tensor:
        return torch.zeros(num_pages, h, ps, ng, dtype=SCALE_DTYPE, device=device)

    def window(n: int) -> torch.Tensor:
        return torch.zeros(max_seqs, h, n, d, dtype=torch.bfloat16, device=device)

    return PagedKVCache(
        layout,
        codes(),
        codes(),
        meta(),
        meta(),
        meta(),
        meta(),
        window(layout.sink_tokens),
        window(layout.sink_tokens),
        window(layout.recent_tokens),
        window(layout.recent_tokens),
    )


def bits_per_element(layout: CacheLayout, context_len: int | None = None) -> float:
    """Bits stored per cached K or V element, metadata and windows included.

    ``oscar_math.bits_per_element`` with ``int2_copy_of_windows=True`` (the one
    definition): every token is stored in INT2 and each sequence owns full BF16 window
    rows, so the windows add ``16 * (sink + recent) / L`` to the INT2 cost
    (2.25 at ``group_size = head_dim = 128``). With ``context_len=None``, the INT2 part
    alone (the cost of a very long sequence).
    """
    d = layout.head_dim
    if context_len is None:
        return int2_bits_per_element(d, layout.group)
    check(isinstance(context_len, int) and context_len >= 1, "context_len", "an integer >= 1", context_len)
    return math_bits_per_element(
        context_len,
        d,
        group_size=layout.group,
        sink_tokens=layout.sink_tokens,
        recent_tokens=layout.recent_tokens,
        int2_copy_of_windows=True,
    )


def layout_bytes_per_token(layout: CacheLayout, context_len: int | None = None) -> float:
    """Bytes of K+V cache per token of one layer, all KV heads, metadata included.

    :func:`bits_per_element` times the ``2 * H_kv * d`` elements of a token. With
    ``context_len=None`` only the paged INT2 part (codes + scale + zero), i.e.
    ``page_bytes(layout) / page_size``; with a length ``L`` the per-sequence BF16
    window rows (allocated whatever the length) are spread over the ``L`` tokens.
    """
    return bits_per_element(layout, context_len) * 2 * layout.num_kv_heads * layout.head_dim / 8


def page_bytes(layout: CacheLayout) -> int:
    """Bytes of one INT2 page (K and V codes + bf16 scale/zero), what an engine allocates per block."""
    h, ps = layout.num_kv_heads, layout.page_size
    return 2 * h * ps * (layout.head_dim // 4) + 4 * h * ps * layout.num_groups * 2


def cache_from_page_buffer(layout: CacheLayout, page_buffer: torch.Tensor, max_seqs: int) -> PagedKVCache:
    """A :class:`PagedKVCache` whose INT2 tensors are views into an engine's page buffer.

    Args:
        layout: sizes.
        page_buffer: ``[num_pages, page_bytes(layout)]`` uint8 (e.g. vLLM's per-layer KV
            tensor viewed as bytes), last dim contiguous. Each page holds, in order,
            ``k_codes | v_codes | k_scale | k_zero | v_scale | v_zero``, each head-major
            ``[H_kv, page_size, ...]``.
        max_seqs: rows of the BF16 window pools (allocated here, on the buffer's device).
    Returns:
        The cache; the kernels take the strides of these views as they are.
    """
    nb = page_bytes(layout)
    check(page_buffer.dtype == torch.uint8, "dtype of page_buffer", torch.uint8, page_buffer.dtype)
    check(
        page_buffer.dim() == 2 and page_buffer.shape[1] == nb and page_buffer.stride(1) == 1,
        "shape of page_buffer",
        f"[num_pages, {nb}] with contiguous last dim",
        tuple(page_buffer.shape),
    )
    check(
        page_buffer.stride(0) % 2 == 0, "stride(0) of page_buffer", "even (bf16 views)", page_buffer.stride(0)
    )
    n = page_buffer.shape[0]
    h, ps, d, ng = layout.num_kv_heads, layout.page_size, layout.head_dim, layout.num_groups
    code_len = h * ps * (d // 4)
    meta_len = h * ps * ng * 2
    views = []
    off = 0
    for _ in range(2):
        views.append(page_buffer[:, off : off + code_len].view(n, h, ps, d // 4))
        off += code_len
    for _ in range(4):
        views.append(page_buffer[:, off : off + meta_len].view(torch.bfloat16).view(n, h, ps, ng))
        off += meta_len
    dev = page_buffer.device

    def window(k: int) -> torch.Tensor:
        return torch.zeros(max_seqs, h, k, d, dtype=torch.bfloat16, device=dev)

    cache = PagedKVCache(
        layout,
        *views,
        window(layout.sink_tokens),
        window(layout.sink_tokens),
        window(layout.recent_tokens),
        window(layout.recent_tokens),
    )
    cache.validate()
    return cache
