#!/usr/bin/env bash
# Issue #38: the GPU checks of what the 2026-12-06 (late) session built on the CPU, one device call
# (no vLLM needed; ~5 min, give it timeout 420): bash lab/gpu_vllm/open_checks.sh
#   * decode: empty splits under a wide table (Gluon: skips its queries, stores only lse = -inf;
#     the merges read no o of an empty partial), and the whole decode file;
#   * launch: compile_launches' thread pool (compiled-ahead kernels launch without compiling);
#   * the write and window records (the feedback loop's relayout, the records' sink tiles).
# Each file runs in its own process with its own limit, so a slow one cannot hide the others'
# results (the late session's single run was cut by its limit with no summary line).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/open-checks}"
mkdir -p "$OUT"
export PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src
T=packages/oscar-kernels/tests
source lab/gpu_vllm/lib.sh  # run_tests (the cwd is the repository root)
run_tests empty_splits 40 "$T/test_decode_attention.py" -k "empty_splits or merge"
run_tests launch 30 "$T/test_launch.py"
run_tests decode 70 "$T/test_decode_attention.py"
run_tests write 70 "$T/test_paged_write.py"
run_tests records 40 "$T/test_window_records.py" "$T/test_write_windows.py"
run_tests write_rope 60 "$T/test_write_rope.py"
# where the one-token write's ~40 µs go (PROBE build: the GPU timer at each phase boundary)
timeout 90 python3 lab/gpu_vllm/write_phases.py --out "$OUT" 2>&1 | tail -4
