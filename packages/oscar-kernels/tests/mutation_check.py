"""Regression tests of the suite's power: plant known bugs in a copy and expect a failure.

Each mutation below is a bug that once passed every test of this package (or, for the
per-token windows of extend, a bug that rule is most easily broken by). The check
copies ``src/`` and ``tests/`` to a temporary directory, applies one mutation by exact
text replacement (a mutation whose text is no longer in the source fails the check
loudly: update it with the code), runs only the few tests that must catch it with the
copy first on ``PYTHONPATH``, and requires that run to fail. A control run of the same
tests on the unmutated copy must pass, so a broken environment is not mistaken for a
caught bug.

    python packages/oscar-kernels/tests/mutation_check.py            # all mutations
    python packages/oscar-kernels/tests/mutation_check.py ring       # names containing "ring"

Run by the ``kernels`` nox session after the test suite (CPU, Triton interpreter).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # packages/oscar-kernels
TIMEOUT_S = 300  # per pytest run; each targets a handful of tests
JOBS = int(os.environ.get("OSCAR_MUTATION_JOBS", os.cpu_count() or 1))


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the package root
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments that must fail on the mutant


LAUNCH = "src/oscar_kernels/launch.py"

MUTATIONS = (
    Mutation(
        "write-kv-values-rotated-by-the-key-rotation",
        "src/oscar_kernels/kernels/paged_write.py",
        "v_ptr, stride_vxt, stride_vxh, vrot_ptr,",
        "v_ptr, stride_vxt, stride_vxh, krot_ptr,",
        ("tests/test_write_rope.py", "-k", "one_launch"),
    ),
    Mutation(
        "write-kv-values-centred-by-the-key-mean",
        "src/oscar_kernels/kernels/paged_write.py",
        "n_tokens, page_size, scr_ptr, HEAD_DIM, GROUP, SINK, RECENT, False, V_FEEDBACK, False,",
        "n_tokens, page_size, scr_ptr, HEAD_DIM, GROUP, SINK, RECENT, HAS_MEAN, V_FEEDBACK, False,",
        ("tests/test_write_rope.py", "-k", "one_launch"),
    ),
    Mutation(
        "write-kv-one-launch-with-unequal-rotation-strides",
        "src/oscar_kernels/paged_write.py",
        "        kt.rot.stride() == vt.rot.stride()\n        and cache.k_scale",
        "        cache.k_scale",
        ("tests/test_write_rope.py", "-k", "per_layer_key"),
    ),
    Mutation(
        "write-kv-values-clipped-by-the-key-ratios",
        "src/oscar_kernels/paged_write.py",
        "kt.alpha, vt.alpha,",
        "kt.alpha, kt.alpha,",
        ("tests/test_write_rope.py", "-k", "one_launch"),
    ),
    Mutation(
        "write-wide-feedback-chunk-on-four-warps",
        "src/oscar_kernels/paged_write.py",
        "kcfg = (kcfg[0], fb_rows) if params.k_feedback",
        "kcfg = (kcfg[0], 4) if params.k_feedback",
        ("tests/test_paged_write.py", "-k", "only_small_feedback"),
    ),
    Mutation(
        "write-wide-feedback-chunk-rows-as-the-narrow",
        "src/oscar_kernels/paged_write.py",
        "return FEEDBACK_WIDE_CHUNK_ROWS if n <= FEEDBACK_CHUNK_MAX_TOKENS else 0",
        "return FEEDBACK_CHUNK_ROWS if n <= FEEDBACK_CHUNK_MAX_TOKENS else 0",
        ("tests/test_paged_write.py", "-k", "only_small_feedback or six_sequences"),
    ),
    Mutation(
        "window-record-ring-row-off-by-one",
        "src/oscar_kernels/kernels/window_records.py",
        "r = (kv * H + h) * WB + pos % WB",
        "r = (kv * H + h) * WB + (pos + 1) % WB",
        ("tests/test_window_records.py", "-k", "triton"),
    ),
    Mutation(
        "window-record-k-and-v-swapped",
        "src/oscar_kernels/kernels/window_records.py",
        "    if kv == 0:\n        x = tl.load(k_ptr",
        "    if kv == 1:\n        x = tl.load(k_ptr",
        ("tests/test_window_records.py", "-k", "triton"),
    ),
    Mutation(
        "window-record-sink-part-skipped-across-blocks",
        "src/oscar_kernels/kernels/window_records.py",
        "                & (tl.load(pos_ptr + tn).to(tl.int64) // WB == pi // WB)\n",
        "",
        ("tests/test_window_records.py", "-k", "triton"),
    ),
    Mutation(
        "window-record-sink-part-skipped-by-the-steps-last-token",
        "src/oscar_kernels/kernels/window_records.py",
        "                (ti + 1 < NT)\n                & (tl.load",
        "                (ti < NT)\n                & (tl.load",
        ("tests/test_window_records.py", "-k", "triton"),
    ),
    Mutation(
        "window-restore-batched-sink-part-from-the-wrong-held-block",
        "src/oscar_kernels/serving/window_pages.py",
        "old_blk = last - ((last - q) % max(plan.sink_parts, 1))",
        "old_blk = last - ((last - q + 1) % max(plan.sink_parts, 1))",
        ("tests/test_window_restore.py",),
    ),
    Mutation(
        "window-restore-batched-rows-of-one-prefix-share-a-slot",
        "src/oscar_kernels/serving/window_pages.py",
        "torch.tensor([s for _, s, _ in rows], dtype=torch.int64)",
        "torch.tensor([rows[0][1] for _ in rows], dtype=torch.int64)",
        ("tests/test_window_restore.py",),
    ),
    Mutation(
        "window-restore-batched-ring-row-off-by-one",
        "src/oscar_kernels/serving/window_pages.py",
        "pos = torch.where(in_sink, p, p % max(lo.recent_tokens, 1))",
        "pos = torch.where(in_sink, p, (p + 1) % max(lo.recent_tokens, 1))",
        ("tests/test_window_restore.py",),
    ),
    Mutation(
        "window-record-grid-drops-the-last-partial-tile",
        "src/oscar_kernels/window_records.py",
        "launch(window_records_kernel, (triton.cdiv(n, _TOK), 2 * h),",
        "launch(window_records_kernel, (n // _TOK, 2 * h),",
        ("tests/test_window_records.py", "-k", "triton"),
    ),
    Mutation(
        "window-record-sink-chunks-skip-the-tiles-last-tokens",
        "src/oscar_kernels/kernels/window_records.py",
        "for c in tl.static_range(0, TOK, TC):",
        "for c in tl.static_range(0, TOK - TC, TC):",
        ("tests/test_window_records.py", "-k", "triton"),
    ),
    Mutation(
        "window-record-sink-chunks-all-read-the-first",
        "src/oscar_kernels/kernels/window_records.py",
        "ti = tl.program_id(0) * TOK + c + e // PART_P2",
        "ti = tl.program_id(0) * TOK + e // PART_P2",
        ("tests/test_window_records.py", "-k", "triton"),
    ),
    Mutation(
        "window-record-sink-part-shifted",
        "src/oscar_kernels/kernels/window_records.py",
        "s = (bk % PARTS) * PART + j",
        "s = (bk % PARTS) * PART + j + 1",
        ("tests/test_window_records.py", "-k", "triton"),
    ),
    Mutation(
        "dense-check-probe-on-the-default-device",
        "src/oscar_kernels/dense_kernels.py",
        "torch.randn(*shape, generator=gen, dtype=torch.float32, device=cpu)",
        "torch.randn(*shape, generator=gen)",
        ("tests/test_dense_kernels.py",),
    ),
    Mutation(
        "dense-check-ignores-output",
        "src/oscar_kernels/dense_kernels.py",
        "if not err <= OUT_TOL:",
        "if False:",
        ("tests/test_dense_kernels.py",),
    ),
    Mutation(
        "dense-check-accepts-a-finite-lse-for-rows-without-keys",
        "src/oscar_kernels/dense_kernels.py",
        "if not torch.equal(torch.isfinite(lse), finite):",
        "if False:",
        ("tests/test_dense_kernels.py",),
    ),
    Mutation(
        "dense-check-probes-no-window",
        "src/oscar_kernels/dense_kernels.py",
        "for window in (-1, 3):",
        "for window in (-1,):",
        ("tests/test_dense_kernels.py",),
    ),
    Mutation(
        "dense-runs-short-chunks-dense",
        "src/oscar_kernels/extend_attention.py",
        "dense = m >= min_query if m else",
        "dense = m >= 1 if m else",
        ("tests/test_extend_dense.py", "-k", "dense_runs"),
    ),
    Mutation(
        "dense-extend-far-set-one-key-too-many",
        "src/oscar_kernels/extend_dense.py",
        "_segments((pre + qlen - r).clamp(min=0), sum(bound_far))",
        "_segments((pre + qlen - r + 1).clamp(min=0), sum(bound_far))",
        ("tests/test_extend_dense.py", "-k", "matches_reference and prefills"),
    ),
    Mutation(
        "dense-extend-near-window-one-too-wide",
        "src/oscar_kernels/extend_dense.py",
        "max(bound_near, default=0), scale, r - 1)",
        "max(bound_near, default=0), scale, r)",
        ("tests/test_extend_dense.py", "-k", "matches_reference and prefills"),
    ),
    Mutation(
        "write-round-bf16-truncates",
        "src/oscar_kernels/kernels/paged_write.py",
        "bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536",
        "bits = bits & -65536",
        ("tests/test_paged_write.py::test_triton_write_is_exact_when_the_rotation_is",),
    ),
    Mutation(
        "write-ring-window-off-by-one",
        "src/oscar_kernels/kernels/paged_write.py",
        "m = valid & (pos >= SINK) & (pos >= length - RECENT)",
        "m = valid & (pos >= SINK) & (pos > length - RECENT)",
        ("tests/test_write_windows.py", "-k", "triton and (prefill-only or cut-at)"),
    ),
    Mutation(
        "rotate-queries-transposed",
        "src/oscar_kernels/rotate.py",
        "return _rotate(x, ep.k_rotation, dtype, backend=backend).reshape(q.shape)",
        "return _rotate(x, ep.k_rotation.transpose(-1, -2), dtype, backend=backend).reshape(q.shape)",
        ("tests/test_oracle.py", "-k", "torch"),
    ),
    Mutation(
        "rotate-tile-transposed",
        "src/oscar_kernels/kernels/rotate.py",
        "k[:, None] * sr_i + n[None, :] * sr_j",
        "k[:, None] * sr_j + n[None, :] * sr_i",
        ("tests/test_rotate.py", "-k", "not compiles"),
    ),
    Mutation(
        "near-rows-first-chunk-row-read-from-the-ring",
        "src/oscar_kernels/kernels/near_rows.py",
        "mine = live & (p >= pre)",
        "mine = live & (p > pre)",
        ("tests/test_extend_dense.py", "-k", "near_rows and not compiles"),
    ),
    Mutation(
        "near-rows-sink-rows-from-the-ring",
        "src/oscar_kernels/kernels/near_rows.py",
        "y = tl.where(in_sink[:, None], y, z)",
        "y = z",
        ("tests/test_extend_dense.py", "-k", "near_rows and not compiles"),
    ),
    Mutation(
        "merge-unrotate-second-weight-from-the-first-set",
        "src/oscar_kernels/kernels/rotate.py",
        "w2 = tl.exp(m2 - mx)",
        "w2 = tl.exp(m1 - mx)",
        ("tests/test_rotate.py", "-k", "merge and not compiles"),
    ),
    Mutation(
        "merge-unrotate-rotation-not-transposed",
        "src/oscar_kernels/rotate.py",
        "rot = ep.v_rotation.transpose(-1, -2)\n        grid",
        "rot = ep.v_rotation\n        grid",
        ("tests/test_rotate.py", "-k", "merge and not compiles"),
    ),
    Mutation(
        "merge-unrotate-query-head-order",
        "src/oscar_kernels/kernels/rotate.py",
        "hq = h * G + r % G",
        "hq = h + (r % G) * H",
        ("tests/test_rotate.py", "-k", "merge and not compiles"),
    ),
    Mutation(
        "merge-unrotate-empty-set-kept",
        "src/oscar_kernels/kernels/rotate.py",
        'ok1 = tl.abs(a1) < float("inf")',
        "ok1 = a1 == a1",
        ("tests/test_rotate.py", "-k", "merge and not compiles"),
    ),
    Mutation(
        "rotate-tile-key-mean-dropped",
        "src/oscar_kernels/kernels/rotate.py",
        "x = x - tl.load(mean_ptr",
        "x = x + 0 * tl.load(mean_ptr",
        ("tests/test_rotate.py", "-k", "not compiles"),
    ),
    Mutation(
        "rotate-tile-truncates-bf16",
        "src/oscar_kernels/kernels/attention.py",
        "u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16",
        "u = u >> 16",
        ("tests/test_rotate.py", "-k", "not compiles"),
    ),
    Mutation(
        "triton-query-rotation-transposed",
        "src/oscar_kernels/decode_attention.py",
        "rot, rot.stride(0), rot.stride(2), rot.stride(1), out, hq,",
        "rot, rot.stride(0), rot.stride(1), rot.stride(2), out, hq,",
        ("tests/test_oracle.py", "-k", "decode and triton"),
    ),
    Mutation(
        "merge-unrotation-transposed",
        "src/oscar_kernels/decode_attention.py",
        "rs = (rot.stride(0), rot.stride(1), rot.stride(2))",
        "rs = (rot.stride(0), rot.stride(2), rot.stride(1))",
        ("tests/test_decode_attention.py", "-k", "merge_matches_torch and v1 and head"),
    ),
    Mutation(
        "merge-skips-last-chunk-of-splits",
        "src/oscar_kernels/kernels/attention.py",
        "        sm = s0 + s < NT\n",
        "        sm = (s0 + s < NT) & (s0 + CH < NT)\n",
        ("tests/test_decode_attention.py", "-k", "merge_matches_torch and v1 and head"),
    ),
    Mutation(
        # the merge's preloaded [d, d] rotation (PRELOAD): indexed as Rᵀ instead of R
        "merge-preload-rotation-transposed",
        "src/oscar_kernels/kernels/attention.py",
        "ri[:, None] * stride_ri + ri[None, :] * stride_rj",
        "ri[:, None] * stride_rj + ri[None, :] * stride_ri",
        ("tests/test_decode_attention.py", "-k", "merge_matches_torch and v1 and head"),
    ),
    Mutation(
        "merge-forgets-to-rescale-chunks",
        "src/oscar_kernels/kernels/attention.py",
        "alpha = tl.exp2(m - m_safe)",
        "alpha = tl.exp2(m - m) + 0.0 * m_safe",
        ("tests/test_decode_attention.py", "-k", "many_partials"),
    ),
    # empty splits (a short sequence under a wide block table): not written, not read
    Mutation(
        "merge-v1-reads-empty-partials",
        "src/oscar_kernels/kernels/attention.py",
        "(any bits): zeroed\n        o = tl.where(live[:, None], o, 0.0)",
        "(any bits): zeroed\n        o = tl.where(sm[:, None], o, 0.0)",
        ("tests/test_decode_attention.py", "-k", "many_partials or merge_matches_torch and v1 and head"),
    ),
    Mutation(
        "merge-v2-reads-empty-partials",
        "src/oscar_kernels/kernels/attention.py",
        '        live = lse > float("-inf")\n        o = tl.where(live[:, None], o, 0.0)\n',
        '        live = lse > float("-inf")\n        o = tl.where(inr[:, None], o, 0.0)\n',
        ("tests/test_decode_attention.py", "-k", "merge_matches_torch and v2 and none"),
    ),
    Mutation(
        "split-kernel-writes-empty-partials",
        "src/oscar_kernels/kernels/attention.py",
        "rmask & has, acc0",
        "rmask, acc0",
        ("tests/test_decode_attention.py", "-k", "empty_splits and tl"),
    ),
    # the v2 merge (issue #38): merge_cols_kernel + unrotate_rows_kernel
    Mutation(
        "merge-v2-skips-max-subtraction",
        "src/oscar_kernels/kernels/attention.py",
        'sub = tl.where(mx_new == float("-inf"), 0.0, mx_new)',
        'sub = tl.where(mx_new == float("-inf"), 0.0, 0.0 * mx_new)',
        ("tests/test_decode_attention.py", "-k", "merge_matches_torch and v2 and none"),
    ),
    Mutation(
        "merge-v2-forgets-to-rescale-steps",
        "src/oscar_kernels/kernels/attention.py",
        "a = tl.exp2(mx - sub)",
        "a = tl.exp2(mx - mx) + 0.0 * sub",
        ("tests/test_decode_attention.py", "-k", "merge_v2_in_steps"),
    ),
    Mutation(
        "merge-v2-drops-last-step-of-partials",
        "src/oscar_kernels/kernels/attention.py",
        "        inr = s0 + s < NT\n",
        "        inr = (s0 + s < NT) & (s0 + CH < NT)\n",
        ("tests/test_decode_attention.py", "-k", "merge_v2_in_steps"),
    ),
    Mutation(
        "merge-v2-every-program-merges-the-first-columns",
        "src/oscar_kernels/kernels/attention.py",
        "cols = tl.program_id(1) * DC + tl.arange(0, DC)",
        "cols = tl.arange(0, DC)",
        ("tests/test_decode_attention.py", "-k", "merge_matches_torch and v2 and none"),
    ),
    Mutation(
        "merge-v2-query-rows-of-a-kv-head-interleaved",
        "src/oscar_kernels/kernels/attention.py",
        "row = (m // GQA).to(tl.int64) * HQ + h * GQA + m % GQA",
        "row = (m // GQA).to(tl.int64) * HQ + h + (m % GQA) * (HQ // GQA)",
        ("tests/test_decode_attention.py", "-k", "merge_matches_torch and v2 and head"),
    ),
    Mutation(
        "merge-v2-unrotation-transposed",
        "src/oscar_kernels/kernels/attention.py",
        "cols[None, :] * stride_ri + (k0 + k)[:, None] * stride_rj",
        "cols[None, :] * stride_rj + (k0 + k)[:, None] * stride_ri",
        ("tests/test_decode_attention.py", "-k", "merge_matches_torch and v2 and layer"),
    ),
    Mutation(
        "merge-v2-first-kv-head-rotation-for-all",
        "src/oscar_kernels/decode_attention.py",
        "merged, rot, rot.stride(0), rot.stride(1), rot.stride(2), out,",
        "merged, rot, 0, rot.stride(1), rot.stride(2), out,",
        ("tests/test_decode_attention.py", "-k", "merge_matches_torch and v2 and head"),
    ),
    Mutation(
        "merge-v2-unrotation-transposed-in-launcher",
        "src/oscar_kernels/decode_attention.py",
        "merged, rot, rot.stride(0), rot.stride(1), rot.stride(2), out,",
        "merged, rot, rot.stride(0), rot.stride(2), rot.stride(1), out,",
        ("tests/test_decode_attention.py", "-k", "merge_matches_torch and v2 and head"),
    ),
    Mutation(
        "write-ring-pass-skips-blocks-with-one-ring-row",
        "src/oscar_kernels/kernels/paged_write.py",
        "if tl.max(bf16_m.to(tl.int32), 0) == 0:",
        "if tl.sum(bf16_m.to(tl.int32), 0) <= 1:",
        ("tests/test_write_windows.py", "-k", "ring_pass"),
    ),
    Mutation(
        "reference-ring-window-off-by-one",
        "src/oscar_kernels/reference/paged_write.py",
        "m = (pos >= lo.sink_tokens) & (pos >= length - lo.recent_tokens)",
        "m = (pos >= lo.sink_tokens) & (pos > length - lo.recent_tokens)",
        ("tests/test_write_windows.py", "-k", "reference and prefill-only"),
    ),
    Mutation(
        "extend-rows-take-another-kv-heads-queries",
        "src/oscar_kernels/kernels/attention.py",
        "hq = h * GQA + r % GQA",
        "hq = r % GQA",
        ("tests/test_extend_attention.py", "-k", "triton_matches_reference"),
    ),
    Mutation(
        "extend-token-blocks-overlap",
        "src/oscar_kernels/kernels/attention.py",
        "t_hi = tl.minimum(total, t_lo + BLOCK_T)",
        "t_hi = tl.minimum(total, t_lo + BLOCK_T - 1)",
        ("tests/test_extend_attention.py", "-k", "triton_matches_reference"),
    ),
    Mutation(
        "far-rows-specialised-on-the-row-offset",
        "src/oscar_kernels/kernels/far_rows.py",
        'do_not_specialize_on_alignment=["seq_ptr", "pos_ptr", "table_ptr", "ws_ptr"],',
        'do_not_specialize_on_alignment=["seq_ptr", "pos_ptr"],',
        ("tests/test_extend_dense.py", "-k", "row_offset"),
    ),
    Mutation(
        "extend-specialised-on-the-row-offset",
        "src/oscar_kernels/kernels/attention.py",
        'do_not_specialize_on_alignment=["bt_ptr", "cu_ptr", "prefix_ptr", "wslot_ptr"],',
        'do_not_specialize_on_alignment=["cu_ptr"],',
        ("tests/test_extend_dense.py", "-k", "row_offset"),
    ),
    Mutation(
        # the prefix view alone: [a:b] of an int32 tensor is 16-byte aligned only for a % 4 == 0
        "extend-prefix-specialised-on-the-row-offset",
        "src/oscar_kernels/kernels/attention.py",
        'do_not_specialize_on_alignment=["bt_ptr", "cu_ptr", "prefix_ptr", "wslot_ptr"],',
        'do_not_specialize_on_alignment=["bt_ptr", "cu_ptr", "wslot_ptr"],',
        ("tests/test_extend_dense.py", "-k", "row_offset"),
    ),
    Mutation(
        # quarter 0's errors no longer reach quarter 1's targets (the per-quarter feedback loop)
        "write-feedback-skips-a-later-quarter",
        "src/oscar_kernels/kernels/paged_write.py",
        "    if Q <= 1:\n        t1 = t1",
        "    if Q == 1:\n        t1 = t1",
        ("tests/test_paged_write.py", "-k", "feedback_write_is_exact"),
    ),
    Mutation(
        # the look-ahead: the second coordinate's error never reaches the third's picked target
        "write-feedback-step-drops-an-error-inside-the-step",
        "src/oscar_kernels/kernels/paged_write.py",
        "    tc = tc + eb * f21\n",
        "",
        ("tests/test_paged_write.py", "-k", "feedback_write_is_exact"),
    ),
    Mutation(
        "write-feedback-step-reads-the-wrong-F-entry",
        "src/oscar_kernels/kernels/paged_write.py",
        "f31 = tl.load(f + 3 * stride_fr + stride_fc)",
        "f31 = tl.load(f + 3 * stride_fr + 2 * stride_fc)",
        ("tests/test_paged_write.py", "-k", "feedback_write_is_exact"),
    ),
    Mutation(
        # eight coordinates a step: the second run's targets miss the first run's errors
        "write-feedback-step8-skips-the-cross-update",
        "src/oscar_kernels/kernels/paged_write.py",
        "                tf = _cross(tf, ea, eb, ec, ed, f + 5 * fr, fc)\n",
        "",
        ("tests/test_paged_write.py", "-k", "feedback_write_is_exact"),
    ),
    Mutation(
        # the cross update reads the second error's F entry from the third column
        "write-feedback-step8-cross-reads-the-wrong-column",
        "src/oscar_kernels/kernels/paged_write.py",
        "    t = t + eb * tl.load(f + stride_fc).to(tl.float32)",
        "    t = t + eb * tl.load(f + 2 * stride_fc).to(tl.float32)",
        ("tests/test_paged_write.py", "-k", "feedback_write_is_exact"),
    ),
    Mutation(
        # the second run's own F block taken from the first run's columns
        "write-feedback-step8-second-run-reads-the-first-block",
        "src/oscar_kernels/kernels/paged_write.py",
        "te, tf, tg, th, xe, xf, xg, xh, zg, ig, sg, f + 4 * fr + 4 * fc, fr, fc",
        "te, tf, tg, th, xe, xf, xg, xh, zg, ig, sg, f + 4 * fr, fr, fc",
        ("tests/test_paged_write.py", "-k", "feedback_write_is_exact"),
    ),
    Mutation(
        # a step over two groups of four rounds its second run with the first group's scale/zero
        "write-feedback-step8-one-group-a-step",
        "src/oscar_kernels/kernels/paged_write.py",
        "SPLIT_GROUP: tl.constexpr = GROUP % 8 != 0",
        "SPLIT_GROUP: tl.constexpr = False",
        ("tests/test_paged_write.py", "-k", "feedback_write_is_exact"),
    ),
    Mutation(
        # the feedback loop's row chunks: only the first chunk of a tile is quantised
        "write-feedback-chunks-stop-after-the-first",
        "src/oscar_kernels/kernels/paged_write.py",
        "            for r0 in range(0, rows, FBR):",
        "            for r0 in range(0, FBR, FBR):",
        ("tests/test_paged_write.py", "-k", "chunks_are_exact"),
    ),
    Mutation(
        # the chunks' one-shuffle pick takes the next lane
        "write-feedback-gather-picks-the-next-lane",
        "src/oscar_kernels/kernels/paged_write.py",
        "tl.gather(x, tl.zeros([x.shape[0], 1], tl.int32) + lane, 1)",
        "tl.gather(x, tl.zeros([x.shape[0], 1], tl.int32) + (lane + 1) % x.shape[1], 1)",
        ("tests/test_paged_write.py", "-k", "chunks_are_exact"),
    ),
    Mutation(
        # plain tensors and ring passes planned with chunks: a second build of their kernels
        "write-plan-chunks-without-feedback",
        "src/oscar_kernels/paged_write.py",
        "scratch, fb_rows = None, 0",
        "scratch, fb_rows = None, FEEDBACK_CHUNK_ROWS",
        ("tests/test_paged_write.py", "-k", "small_feedback"),
    ),
    Mutation(
        # every chunk reads the tile's first rows back from the scratch
        "write-feedback-chunks-read-the-first-rows",
        "src/oscar_kernels/kernels/paged_write.py",
        "_unstage(scr + r0 * Q4, BLOCK_T, FBR, Q4)",
        "_unstage(scr, BLOCK_T, FBR, Q4)",
        ("tests/test_paged_write.py", "-k", "chunks_are_exact"),
    ),
    Mutation(
        # R_V folded transposed into the output projection (o_rot R_V, not o_rot R_Vᵀ, reaches W)
        "fold-uses-the-transposed-rotation",
        "src/oscar_kernels/fold.py",
        "@ rot[h // g]).to(weight.dtype)",
        "@ rot[h // g].t()).to(weight.dtype)",
        ("tests/test_fold.py", "-k", "folded_weight"),
    ),
    Mutation(
        # any attention class folded: one that gates its output before o_proj would be wrong
        "serving-fold-ignores-the-class",
        "src/oscar_kernels/serving/fold.py",
        "    if cls not in DIRECT_O_PROJ:",
        "    if False:",
        ("tests/test_serving_fold.py",),
    ),
    Mutation(
        # no fingerprint: a second pass (a reload that left the weight alone) folds it twice
        "serving-fold-folds-twice",
        "src/oscar_kernels/serving/fold.py",
        "if getattr(o_proj, _FOLD_MARK, None) != _mark(w):",
        "if True:",
        ("tests/test_serving_fold.py",),
    ),
    Mutation(
        # the decode op un-rotates although the engine folded R_V into its output projection
        "decode-ignores-rotated-output",
        "src/oscar_kernels/decode_attention.py",
        "unrotate=None if params.rotated_output else params.v_rotation,",
        "unrotate=params.v_rotation,",
        ("tests/test_fold.py", "-k", "decode_leaves"),
    ),
    Mutation(
        # the prefill merge un-rotates although the engine folded R_V
        "prefill-merge-ignores-rotated-output",
        "src/oscar_kernels/kernels/rotate.py",
        "    if ROTATE:\n        for n0",
        "    if True:\n        for n0",
        ("tests/test_rotate.py", "-k", "merge_unrotate_matches"),
    ),
    Mutation(
        # the prefetch's row blocks as d // 32: none at d = 16, which compiles only on a GPU
        "write-prefetch-no-row-block-at-small-d",
        "src/oscar_kernels/kernels/paged_write.py",
        "NR: tl.constexpr = (HEAD_DIM + 31) // 32",
        "NR: tl.constexpr = HEAD_DIM // 32",
        ("tests/test_paged_write.py", "-k", "prefetch_compiles"),
    ),
    Mutation(
        # rows and columns of F swapped: F's transpose is read (strictly upper triangular, so
        # no error reaches a later coordinate): the column-major layout's strides must be used
        "write-feedback-reads-F-transposed",
        "src/oscar_kernels/paged_write.py",
        "(t.fb, *t.fb.stride())",
        "(t.fb, t.fb.stride(0), t.fb.stride(2), t.fb.stride(1))",
        ("tests/test_paged_write.py", "-k", "feedback_write_is_exact"),
    ),
    Mutation(
        # the quarters stay in the dot's layout: the loop's picks wait on block barriers again
        "write-feedback-loop-in-the-dot-layout",
        "src/oscar_kernels/kernels/paged_write.py",
        "                y0, y1, y2, y3 = _unstage(scr + r0 * Q4, BLOCK_T, FBR, Q4)\n",
        "                y0, y1, y2, y3 = x0, x1, x2, x3\n",
        ("tests/test_paged_write.py", "-k", "no_block_barrier"),
    ),
    Mutation(
        "far-rows-page-off-by-one",
        "src/oscar_kernels/kernels/far_rows.py",
        "col = tl.minimum(p // page_size, last_page)",
        "col = tl.minimum((p + 1) // page_size, last_page)",
        ("tests/test_extend_dense.py", "-k", "far_rows"),
    ),
    Mutation(
        "far-rows-sink-off-by-one",
        "src/oscar_kernels/kernels/far_rows.py",
        "in_sink = live & (p < SINK)",
        "in_sink = live & (p <= SINK)",
        ("tests/test_extend_dense.py", "-k", "far_rows"),
    ),
    Mutation(
        "far-rows-truncates-to-bf16",
        "src/oscar_kernels/kernels/far_rows.py",
        "y = round_bf16(x).to(tl.bfloat16)",
        "y = x.to(tl.bfloat16)",
        ("tests/test_extend_dense.py", "-k", "far_rows"),
    ),
    Mutation(
        "far-rows-transposed-rotation",
        "src/oscar_kernels/kernels/far_rows.py",
        "i[:, None] * stride_rr + j[None, :]",
        "i[:, None] + j[None, :] * stride_rr",
        ("tests/test_extend_dense.py", "-k", "far_rows"),
    ),
    Mutation(
        "split-extend-skips-a-tile",
        "src/oscar_kernels/kernels/attention.py",
        "i1 = tl.minimum(hi, i0 + per)",
        "i1 = tl.minimum(hi, i0 + per - BLOCK_N)",
        ("tests/test_extend_attention.py", "-k", "split_extend_matches"),
    ),
    Mutation(
        "split-extend-bf16-rows-in-every-split",
        "src/oscar_kernels/kernels/attention.py",
        "bf16 = sp == 0  # the BF16 rows: one split's share",
        "bf16 = sp >= 0",
        ("tests/test_extend_attention.py", "-k", "split_extend_matches"),
    ),
    Mutation(
        "extend-block-m-too-small-for-a-hit",
        "src/oscar_kernels/extend_attention.py",
        "min(64, _pow2_at_least(max(1, max_query_len) * gqa))",
        "min(64, _pow2_at_least(max(1, max_query_len)))",
        ("tests/test_extend_attention.py", "-k", "block_m_fills"),
    ),
    Mutation(
        "extend-window-off-by-one",
        "src/oscar_kernels/kernels/attention.py",
        "ok = ok & (tok[None, :] > qpos[:, None] - RECENT)",
        "ok = ok & (tok[None, :] >= qpos[:, None] - RECENT)",
        ("tests/test_chunk_invariance.py", "-k", "triton_schedules and group-d and chunks-of-recent"),
    ),
    Mutation(
        "reference-decode-oldest-ring-row-from-int2",
        "src/oscar_kernels/reference/attention.py",
        "r0 = bf16_ring_start(window_end - 1, s, lo.recent_tokens)",
        "r0 = bf16_ring_start(window_end, s, lo.recent_tokens)",
        ("tests/test_chunk_invariance.py", "-k", "reference_decode"),
    ),
    Mutation(
        "reference-extend-chunk-keys-bf16",
        "src/oscar_kernels/reference/attention.py",
        "quant = int2_mask(qpos[:, 0], j[0], s, r)",
        "quant = int2_mask(qpos[:, 0], j[0], s, r) & (j < p)",
        ("tests/test_chunk_invariance.py", "-k", "reference_decode"),
    ),
    Mutation(
        "decode-16-byte-ring-from-one-wave",
        "src/oscar_kernels/decode_attention.py",
        "programs >= wide_waves * wave",
        "programs >= wave",
        ("tests/test_decode_attention.py", "-k", "async_ring_rule"),
    ),
    Mutation(
        "decode-ring-tiles-rounded-down",
        "src/oscar_kernels/decode_attention.py",
        "if -(-per // block_n) < tuning.async_min_tiles:",
        "if per // block_n < tuning.async_min_tiles:",
        ("tests/test_decode_attention.py", "-k", "async_ring_rule"),
    ),
    # the pre-RoPE key mean's score term (format version 3, tests/test_rope_mean_attention.py)
    Mutation(
        "rope-sin-sign-flipped",
        "src/oscar_kernels/kernels/attention.py",
        "        return tl.cos(a), tl.sin(a)",
        "        return tl.cos(a), -tl.sin(a)",
        ("tests/test_rope_mean_attention.py", "-k", "decode_rope_matches and tl and 128-2-4"),
    ),
    Mutation(
        "rope-position-off-by-one",
        "src/oscar_kernels/kernels/attention.py",
        "_rope_cos_sin(_rope_angle(th_hi * 0.0 + t0, th_hi, th_lo), DOT)",
        "_rope_cos_sin(_rope_angle(th_hi * 0.0 + t0 + 1, th_hi, th_lo), DOT)",
        ("tests/test_rope_mean_attention.py", "-k", "decode_rope_matches and tl and 128-2-4"),
    ),
    Mutation(
        "rope-split-product-drops-a-cross-term",
        "src/oscar_kernels/kernels/attention.py",
        "    t = tl.dot(x_hi, y_lo, t)\n",
        "",
        ("tests/test_rope_mean_attention.py", "-k", "float32_exact"),
    ),
    Mutation(
        "rope-packed-slots-one-sine-read-as-cosine",
        "src/oscar_kernels/kernels/attention.py",
        "    return i % ROPE_P, i < ROPE_P\n",
        "    return i % ROPE_P, i <= ROPE_P\n",
        ("tests/test_rope_mean_attention.py", "-k", "float32_exact"),
    ),
    Mutation(
        "extend-page-ahead-reads-the-current-tile",
        "src/oscar_kernels/kernels/attention.py",
        "nxt = tl.load(bt_row + ahead // page_size, mask=ahead < i1, other=0)",
        "nxt = tl.load(bt_row + (ahead - BLOCK_N) // page_size, mask=ahead < i1, other=0)",
        ("tests/test_extend_attention.py", "-k", "tiles_of_one_page"),
    ),
    Mutation(
        "extend-scales-ahead-of-the-wrong-tile",
        "src/oscar_kernels/kernels/attention.py",
        "ks_ptr, kz_ptr, vs_ptr, vz_ptr, page, t0 + BLOCK_N, hi, page_size, h, stride_sp,",
        "ks_ptr, kz_ptr, vs_ptr, vz_ptr, page, t0, hi, page_size, h, stride_sp,",
        ("tests/test_extend_attention.py", "-k", "tiles_of_one_page"),
    ),
    Mutation(
        "extend-page-tiles-promised-off-the-tile-grid",
        "src/oscar_kernels/extend_attention.py",
        "PAGE_TILES=lo.page_size % block_n == 0 and lo.sink_tokens % block_n == 0,",
        "PAGE_TILES=lo.page_size % block_n == 0,",
        ("tests/test_extend_attention.py", "-k", "triton_matches_reference or tiles_of_one_page"),
    ),
    Mutation(
        "rope-bf16-split-keeps-no-remainder",
        "src/oscar_kernels/kernels/attention.py",
        "    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)",
        "    return hi, (x * 0.0).to(tl.bfloat16)",
        ("tests/test_rope_mean_attention.py", "-k", "float32_exact"),
    ),
    Mutation(
        "rope-angle-sum-left-unreduced",
        "src/oscar_kernels/kernels/attention.py",
        "    n = ((a + b) * INV_TWO_PI + 0.5)",
        "    n = (a * INV_TWO_PI + 0.5)",
        ("tests/test_rope_mean_attention.py", "-k", "angle_reduction"),
    ),
    Mutation(
        "rope-tile-angles-through-libdevice",
        "src/oscar_kernels/kernels/attention.py",
        "    if DOT == tl.float32:\n        return tl.cos(a), tl.sin(a)",
        "    if True:\n        return tl.cos(a), tl.sin(a)",
        ("tests/test_extend_attention.py", "-k", "spills_next_to_nothing"),
    ),
    Mutation(
        "rope-basis-transposed-sine",
        "src/oscar_kernels/kernels/attention.py",
        "cb = rc1 * c0 - rc0 * s0",
        "cb = rc0 * s0 - rc1 * c0",
        ("tests/test_rope_mean_attention.py", "-k", "extend_rope and 128"),
    ),
    Mutation(
        "rope-coefficient-c1-sign",
        "src/oscar_kernels/kernels/attention.py",
        "tl.store(rc_ptr + r * (2 * ROPE_P) + ROPE_P + i, xb * ca - xa * cb)",
        "tl.store(rc_ptr + r * (2 * ROPE_P) + ROPE_P + i, xa * cb - xb * ca)",
        ("tests/test_rope_mean_attention.py", "-k", "decode_rope_matches and tl and 128-2-4"),
    ),
    Mutation(
        "rope-angle-drops-theta-lo",
        "src/oscar_kernels/kernels/attention.py",
        "    return r + b\n",
        "    return r\n",
        ("tests/test_rope_mean_attention.py", "-k", "angle_reduction"),
    ),
    Mutation(
        "extend-rope-position-off-by-one",
        "src/oscar_kernels/kernels/attention.py",
        "basis, t0, s, ROPE_P, DOT)\n            ok = tmask[None, :]",
        "basis, t0 + 1, s, ROPE_P, DOT)\n            ok = tmask[None, :]",
        ("tests/test_rope_mean_attention.py", "-k", "extend_rope and 128"),
    ),
    Mutation(
        "reference-rope-term-on-sink-keys",
        "src/oscar_kernels/reference/attention.py",
        "k[:ns] = cache.k_sink[window_slot, :, :ns].transpose(0, 1).to(dtype)",
        "k[:ns] = cache.k_sink[window_slot, :, :ns].transpose(0, 1).to(dtype) + (\n"
        "            0.0 if ep is None or ep.k_rope_mean is None\n"
        "            else rope_mean_rows(ep, ns, cache.device).to(dtype)\n"
        "        )",
        ("tests/test_rope_mean_attention.py", "-k", "reference_term or rope_matches and tl and 64-2-4"),
    ),
    Mutation(
        "reference-write-ring-before-attention",
        "src/oscar_kernels/reference/paged_write.py",
        '"pages": (True, True, False),',
        '"pages": (True, True, True),',
        ("tests/test_chunk_invariance.py", "-k", "reference_schedules and group-d and chunks-of-7"),
    ),
    # a decode write in two passes (serving.run_layer: BF16 rows before attention, INT2 rows beside it)
    Mutation(
        "write-window-pass-skips-sink-rows",
        "src/oscar_kernels/kernels/paged_write.py",
        "        if WRITE_SINK and SINK > 0:",
        "        if WRITE_PAGES and SINK > 0:",
        ("tests/test_write_rope.py", "-k", "two_passes and triton and order0"),
    ),
    # the window pass (on a decode step's critical path) asks for its rotation into L1 first
    Mutation(
        "write-window-pass-without-rotation-prefetch",
        "src/oscar_kernels/kernels/paged_write.py",
        "    if PREFETCH and (WRITE_PAGES or WINDOW_PASS):",
        "    if PREFETCH and WRITE_PAGES:",
        ("tests/test_paged_write.py", "-k", "window_pass_asks"),
    ),
    # the one-pass write re-rotates a tile's BF16 rows (uncentred by the pre-RoPE mean) only where
    # the tile holds one (the window pass itself has no early return)
    Mutation(
        "write-bf16-rows-mask-drops-sink-only-tokens",
        "src/oscar_kernels/kernels/paged_write.py",
        "                bf16_m = bf16_m | (valid & (pos < SINK))",
        "                bf16_m = bf16_m",
        ("tests/test_write_rope.py", "-k", "two_passes and sink-only and triton and order0"),
    ),
    Mutation(
        "reference-codes-pass-writes-ring-rows",
        "src/oscar_kernels/reference/paged_write.py",
        '"codes": (True, False, False),',
        '"codes": (True, False, True),',
        ("tests/test_write_rope.py", "-k", "two_passes and torch and order0"),
    ),
    Mutation(
        "serving-overlap-window-pass-without-sink-rows",
        "src/oscar_kernels/serving/run.py",
        '_write(plan, key, cache, ep, k, v, "window", backend, first, trigger=trigger)',
        '_write(plan, key, cache, ep, k, v, "ring", backend, first, trigger=trigger)',
        ("tests/test_serving_overlap.py", "-k", "changes_no_bit and torch"),
    ),
    Mutation(
        "write-trigger-on-any-pass",
        "src/oscar_kernels/paged_write.py",
        '        trigger = parts == "window" and pdl_available(cache.device)',
        "        trigger = pdl_available(cache.device)",
        ("tests/test_serving_overlap.py", "-k", "only_a_window"),
    ),
    # the BF16-pages baseline kernel (benchmarks compare INT2 against it)
    Mutation(
        "bf16-baseline-page-offset-off-by-one",
        "src/oscar_kernels/kernels/bf16_decode.py",
        "(tok % page_size) * stride_ct",
        "((tok + 1) % page_size) * stride_ct",
        ("tests/test_baseline.py", "-k", "matches"),
    ),
    Mutation(
        "bf16-baseline-split-past-the-end",
        "src/oscar_kernels/kernels/bf16_decode.py",
        "hi = tl.minimum(length, lo + per)",
        "hi = lo + per",
        ("tests/test_baseline.py", "-k", "matches"),
    ),
    # the launcher's re-use of compiled kernels (launch.py): a key coarser than Triton's
    # specialisation re-uses a kernel compiled for other facts; a wrong launcher call mixes values
    Mutation(
        "launch-key-ignores-alignment",
        LAUNCH,
        "put(not v.data_ptr() & 15)",
        "put(True)",
        ("tests/test_launch.py",),
    ),
    Mutation(
        "launch-key-ignores-value-one",
        LAUNCH,
        "put(1 if v == 1 else 10",
        "put(10",
        ("tests/test_launch.py",),
    ),
    Mutation(
        "launch-key-ignores-options",
        LAUNCH,
        "keys = tuple([k for k in names if k not in site.index])",
        "keys = ()",
        ("tests/test_launch.py",),
    ),
    Mutation(
        "launch-sequence-replays-other-constexprs",
        LAUNCH,
        "replay = _fixed(site, vals, kwargs) == fixed",
        "replay = True",
        ("tests/test_launch.py",),
    ),
    Mutation(
        "launch-sequence-ignores-optional-arguments",
        LAUNCH,
        "if not c and (d is None or type(d) is bool)",
        "if False",
        ("tests/test_launch.py",),
    ),
    Mutation(
        "launch-grid-axes-swapped",
        LAUNCH,
        "grid[0], g1, g2,",
        "grid[0], g2, g1,",
        ("tests/test_launch.py",),
    ),
)


def _copy(dst: Path) -> Path:
    root = dst / "oscar-kernels"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache")
    # benchmarks/: the offline sm_90 compile checks that some test files hold import compile_check.py
    for part in ("src", "tests", "benchmarks"):
        shutil.copytree(PACKAGE / part, root / part, ignore=ignore)
    return root


def _apply(root: Path, m: Mutation) -> None:
    f = root / m.path
    text = f.read_text()
    n = text.count(m.old)
    if n != 1:
        raise SystemExit(
            f"mutation {m.name}: expected the text once in {m.path}, found it {n} times: {m.old!r} "
            "(the code changed: update the mutation in tests/mutation_check.py)"
        )
    f.write_text(text.replace(m.old, m.new))


def _pytest(root: Path, args: tuple[str, ...]) -> tuple[int, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TRITON_INTERPRET", "1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args]
    try:
        r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {TIMEOUT_S} s"
    lines = (r.stdout + r.stderr).strip().splitlines()
    return r.returncode, lines[-1] if lines else ""


def _imports_copy(root: Path) -> bool:
    # the same PYTHONPATH as _pytest (the copy first, then the caller's: e.g. oscar-math)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run(
        [sys.executable, "-c", "import oscar_kernels; print(oscar_kernels.__file__)"],
        env=env,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return out.startswith(str(root))


def main(argv: list[str], mutations: tuple[Mutation, ...] = MUTATIONS) -> int:
    """Run the ``mutations`` whose names contain one of ``argv`` (all without ``argv``); 0 iff all caught."""
    chosen = [m for m in mutations if not argv or any(a in m.name for a in argv)]
    if not chosen:
        print(f"no mutation matches {argv}; names: {[m.name for m in mutations]}")
        return 2
    failed = []
    with tempfile.TemporaryDirectory(prefix="oscar-mutants-") as tmp:
        control = _copy(Path(tmp) / "control")
        if not _imports_copy(control):
            print("the copy is not what `import oscar_kernels` loads (PYTHONPATH is shadowed)")
            return 2
        for m in chosen:
            _apply(_copy(Path(tmp) / m.name), m)  # every mutation's text must still exist

        controls: dict[tuple[str, ...], tuple[int, str]] = {}

        def check(m: Mutation) -> tuple[bool, str]:
            t0 = time.time()
            rc, last = controls[m.tests]
            if rc != 0:
                return False, f"CONTROL FAILED  {m.name}: the unmutated tests fail ({last}); fix them first"
            rc, last = _pytest(Path(tmp) / m.name / "oscar-kernels", m.tests)
            caught = rc == 1  # 1 = tests failed; anything else (crash, timeout, no tests) is not a catch
            verdict = "caught   " if caught else "SURVIVED "
            return caught, f"{verdict} {m.name:<34} {time.time() - t0:6.1f} s  {last}"

        # independent subprocesses: one per core (OSCAR_MUTATION_JOBS overrides), reported in order
        with ThreadPoolExecutor(max_workers=JOBS) as pool:
            # each distinct test selection runs once unmutated (mutations share selections)
            keys = list(dict.fromkeys(m.tests for m in chosen))
            controls.update(zip(keys, pool.map(lambda t: _pytest(control, t), keys), strict=True))
            for m, (ok, line) in zip(chosen, pool.map(check, chosen), strict=True):
                print(line, flush=True)
                if not ok:
                    failed.append(m.name)
    if failed:
        print(f"{len(failed)} of {len(chosen)} mutations not caught: {failed}")
        return 1
    print(f"all {len(chosen)} mutations caught")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
