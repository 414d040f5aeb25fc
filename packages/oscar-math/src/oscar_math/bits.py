"""Bits per K/V element actually stored, metadata and BF16 windows included.

The serving layout (docs/format.md, "Bits per element") keeps the first ``sink_tokens`` and the last
``recent_tokens`` tokens of a sequence in BF16 and stores everything between as
INT2 codes plus one ``scale`` and one ``zero`` per group. The memory a budget must
reserve is therefore *not* ``2 + 32 / group_size`` bits per element at short
context: the BF16 windows dominate until the sequence is many times longer than
them. These functions give the exact average so that reports and KV budgets
count what is really stored (the reference implementation reported 2.28 but
stored fp32 metadata and left the windows out of the budget).
"""

from __future__ import annotations

import math

from .errors import check

__all__ = ["int2_bits_per_element", "bits_per_element", "kivi_bits_per_element"]

#: bits of one BF16 element in the sink / recent windows.
BF16_BITS = 16


def _check_common(seq_len: int, head_dim: int, sink_tokens: int, recent_tokens: int) -> None:
    check(isinstance(seq_len, int) and seq_len >= 1, "seq_len", "an integer >= 1", seq_len)
    check(isinstance(head_dim, int) and head_dim >= 1, "head_dim", "an integer >= 1", head_dim)
    check(isinstance(sink_tokens, int) and sink_tokens >= 0, "sink_tokens", "an integer >= 0", sink_tokens)
    check(
        isinstance(recent_tokens, int) and recent_tokens >= 0,
        "recent_tokens",
        "an integer >= 0",
        recent_tokens,
    )


def int2_bits_per_element(
    head_dim: int,
    group_size: int | None = None,
    *,
    code_bits: int = 2,
    scale_bits: int = 16,
    zero_bits: int = 16,
) -> float:
    """Bits per element of one quantised row: ``code_bits + (scale_bits + zero_bits) / group_size``.

    2.25 at ``group_size = 128``, 2.5 at 64, 3.0 at 32 (16-bit scale and zero).

    Args:
        head_dim: ``d``; ``group_size`` defaults to it (one group per row).
        group_size: elements per group, a divisor of ``head_dim``.
    """
    gs = head_dim if group_size is None else group_size
    ok = isinstance(gs, int) and gs >= 1 and head_dim % gs == 0
    check(ok, "group_size", f"a divisor of {head_dim}", gs)
    return code_bits + (scale_bits + zero_bits) / gs


def bits_per_element(
    seq_len: int,
    head_dim: int,
    *,
    group_size: int | None = None,
    sink_tokens: int = 64,
    recent_tokens: int = 256,
    code_bits: int = 2,
    scale_bits: int = 16,
    zero_bits: int = 16,
    int2_copy_of_windows: bool = False,
) -> float:
    """Average bits stored per K (or V) element over a sequence of ``seq_len`` tokens.

    The one definition of the figure; the two caches of the project differ in one
    respect, named by ``int2_copy_of_windows``:

    * ``False`` (the evaluation caches of ``oscar-calib``): ``min(seq_len, sink_tokens +
      recent_tokens)`` tokens are BF16 (16 bits) and only the rest cost
      :func:`int2_bits_per_element`.
    * ``True`` (the paged serving cache of ``oscar-kernels``, see
      ``oscar_kernels.bits_per_element``): *every* token is also stored in INT2, and
      each sequence owns full BF16 window rows of ``sink_tokens + recent_tokens``
      tokens whatever its length, so nothing moves when a token leaves the window.

    Keys and values have the same layout, so this is also the average over K and V.

    Example: ``seq_len=2048, head_dim=128`` (group 128, windows 64 + 256) gives
    ``(320 * 16 + 1728 * 2.25) / 2048 = 4.3984375``; at 131072 tokens 2.2836. With
    ``int2_copy_of_windows=True``: ``2.25 + 320 * 16 / 2048 = 4.75`` and 2.2891.
    """
    _check_common(seq_len, head_dim, sink_tokens, recent_tokens)
    q_bits = int2_bits_per_element(
        head_dim, group_size, code_bits=code_bits, scale_bits=scale_bits, zero_bits=zero_bits
    )
    if int2_copy_of_windows:
        return (seq_len * q_bits + (sink_tokens + recent_tokens) * BF16_BITS) / seq_len
    n_bf16 = min(seq_len, sink_tokens + recent_tokens)
    n_int2 = seq_len - n_bf16
    return (n_bf16 * BF16_BITS + n_int2 * q_bits) / seq_len


def kivi_bits_per_element(
    seq_len: int,
    head_dim: int,
    *,
    token_group: int = 32,
    group_size: int | None = None,
    sink_tokens: int = 64,
    recent_tokens: int = 256,
    code_bits: int = 2,
    scale_bits: int = 16,
    zero_bits: int = 16,
) -> float:
    """Average bits per element, over K and V, of the KIVI-style baseline (:mod:`oscar_math.kivi`).

    Same BF16 windows as OSCAR. Keys store one scale/zero per channel per block of
    ``token_group`` tokens (a final partial block pays a full set of metadata);
    values store one scale/zero per ``group_size`` elements of each token, like OSCAR.
    """
    _check_common(seq_len, head_dim, sink_tokens, recent_tokens)
    check(isinstance(token_group, int) and token_group >= 1, "token_group", "an integer >= 1", token_group)
    v_bits = int2_bits_per_element(
        head_dim, group_size, code_bits=code_bits, scale_bits=scale_bits, zero_bits=zero_bits
    )
    n_bf16 = min(seq_len, sink_tokens + recent_tokens)
    n_int2 = seq_len - n_bf16
    n_blocks = math.ceil(n_int2 / token_group)
    # per channel: codes for every token + one (scale, zero) per block; averaged over d channels
    k_total = n_bf16 * BF16_BITS + n_int2 * code_bits + n_blocks * (scale_bits + zero_bits)
    v_total = n_bf16 * BF16_BITS + n_int2 * v_bits
    return (k_total + v_total) / (2 * seq_len)
