"""Planted bugs of the write with a pre-RoPE key mean (format version 3): each must fail
``tests/test_write_rope.py``.

The machinery of ``tests/mutation_check.py`` (copy ``src/`` + ``tests/``, exact text
replacement, the named tests must fail on the mutant and pass on an unmutated control)::

    python packages/oscar-kernels/tests/rope_write_mutation_check.py          # all
    python packages/oscar-kernels/tests/rope_write_mutation_check.py kernel   # names containing "kernel"
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mutation_check  # noqa: E402
from mutation_check import Mutation  # noqa: E402

KERNEL = "src/oscar_kernels/kernels/paged_write.py"
REF = "src/oscar_kernels/reference/paged_write.py"
T = "tests/test_write_rope.py"

MUTATIONS = (
    Mutation(
        "kernel-rope-position-off-by-one",
        KERNEL,
        "rpos = tl.load(pos_ptr + t, mask=valid, other=0)",
        "rpos = tl.load(pos_ptr + t, mask=valid, other=0) + 1",
        (T, "-k", "matches_reference and 64-2-5"),
    ),
    Mutation(
        "kernel-rope-mean-added",
        KERNEL,
        "xlo = xlo - (a * cos - b * sin)\n        xhi = xhi - (b * cos + a * sin)",
        "xlo = xlo + (a * cos - b * sin)\n        xhi = xhi + (b * cos + a * sin)",
        (T, "-k", "constant_offsets and 64-2-5"),
    ),
    Mutation(
        "kernel-bf16-rows-centred-too",
        KERNEL,
        "if tl.max(bf16_m.to(tl.int32), 0) > 0:",
        "if tl.max(bf16_m.to(tl.int32), 0) > 1:",
        (T, "-k", "bf16_rows and triton"),
    ),
    Mutation(
        "kernel-rope-sin-sign-flipped",
        KERNEL,
        "xhi = xhi - (b * cos + a * sin)",
        "xhi = xhi - (b * cos - a * sin)",
        (T, "-k", "offset and 64-4"),
    ),
    Mutation(
        "kernel-rope-quadrant-sign",
        KERNEL,
        "sin = tl.where(q == 0, s, tl.where(q == 1, c,",
        "sin = tl.where(q == 0, s, tl.where(q == 1, -c,",
        (T, "-k", "offset and 64-4"),
    ),
    Mutation(
        "kernel-rope-pair-partner-wrong",
        KERNEL,
        "b = tl.load(rmean_ptr + h * stride_rmh + HALF + i)",
        "b = tl.load(rmean_ptr + h * stride_rmh + i)",
        (T, "-k", "matches_reference and 64-2-5"),
    ),
    Mutation(
        "kernel-rope-narrow-rows-sin-sign",  # the d < 32 path (whole rows)
        KERNEL,
        "x = x - tl.where(low[None, :], m * cos - mp * sin, m * cos + mp * sin)",
        "x = x - tl.where(low[None, :], m * cos + mp * sin, m * cos - mp * sin)",
        (T, "-k", "matches_reference and 16-2-4"),
    ),
    Mutation(
        "kernel-rope-range-reduction-2pi-off",
        KERNEL,
        "r = a - k * 6.28125",
        "r = a - k * 6.2812",
        (T, "-k", "offset and 64-4"),
    ),
    Mutation(
        "reference-rope-position-off-by-one",
        REF,
        "rope = rope_position_mean(ep.k_rope_mean, pos, ep.k_rope_inv_freq)",
        "rope = rope_position_mean(ep.k_rope_mean, pos + 1, ep.k_rope_inv_freq)",
        (T, "-k", "reconstruct and torch and nearest"),
    ),
    Mutation(
        "reference-rope-mean-added",
        REF,
        'kq = torch.einsum("nhd,hde->nhe", km - rope, ep.k_rotation)',
        'kq = torch.einsum("nhd,hde->nhe", km + rope, ep.k_rotation)',
        (T, "-k", "reconstruct and torch and nearest"),
    ),
    Mutation(
        "reference-bf16-rows-centred-too",
        REF,
        'kq = torch.einsum("nhd,hde->nhe", km - rope, ep.k_rotation)',
        'kq = kr = torch.einsum("nhd,hde->nhe", km - rope, ep.k_rotation)',
        (T, "-k", "bf16_rows and torch"),
    ),
)


def main(argv: list[str]) -> int:
    return mutation_check.main(argv, MUTATIONS)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
