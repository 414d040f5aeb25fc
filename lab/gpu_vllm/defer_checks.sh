#!/usr/bin/env bash
# Issue #38, 2026-12-07 (eleventh session): the decode write's INT2 pass and the window records left
# open past their layer in a FULL graph (serving.run_layer's defer_join, serving.beside,
# oscar_vllm.backend.join_later) and the query rotation beside the window pass (PDL), on the GPU.
# Two parts, each small enough to ride along a `gpu_engine.sh stash N` call:
#   tests:    the overlap tests (both CUDA-graph cases, two-layer steps; a fresh machine compiles for
#             ~2 min: 90 s cut them on the H100, 2026-12-07) and a planted bug only a
#             GPU shows (run_layer no longer joins an earlier layer's pass)              (~2 min)
#   ablation: step_ablation.py's variants of the write + records beside the attention (joined in
#             their layer, a layer later, and with the rotation beside the window pass)  (~2 min)
#   extend:   a prefix hit's 48-token tails over 100k INT2 tokens (extend_split.py): 64- vs 128-row
#             programs, stages, the pre-RoPE term's share, before (lab/gpu_vllm/before, carried:
#             `git archive REV packages/oscar-kernels/src | tar -x -C lab/gpu_vllm/before`) and after
#   The tests part also runs the pre-RoPE term's tests (its cosines and sines share one operand)
#   and a planted bug only a GPU shows (the tile angles' cos.approx / sin.approx swapped).
#   rope:     the RoPE tests and the cos/sin plant alone (the tests part without the overlap)
#   device: OUT=$OUT bash lab/gpu_vllm/defer_checks.sh tests|rope|ablation|extend|all
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/defer-checks}"
WHAT="${1:-all}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ROOT=$PWD
T=packages/oscar-kernels/tests
source lab/gpu_vllm/lib.sh
export PYTHONPATH=$ROOT/packages/oscar-math/src:$ROOT/packages/oscar-kernels/src
if [[ $WHAT == tests || $WHAT == rope || $WHAT == all ]]; then
    run_tests rope 200 "$T/test_rope_mean_attention.py" "$T/test_extend_attention.py" -rs
fi
if [[ $WHAT == tests || $WHAT == all ]]; then
    run_tests overlap 240 "$T/test_serving_overlap.py" "$T/test_serving_settings.py" "$T/test_launch.py" -rs
    echo "== plant: no join of an earlier layer's pass"
    rm -rf /tmp/plant && mkdir -p /tmp/plant && cp -r packages/oscar-kernels /tmp/plant/
    sed -i 's/^    if plan.side:  # an earlier layer/    if False:  # an earlier layer/' \
        /tmp/plant/oscar-kernels/src/oscar_kernels/serving/run.py
    grep -c "if False:  # an earlier layer" /tmp/plant/oscar-kernels/src/oscar_kernels/serving/run.py
    (cd /tmp/plant/oscar-kernels && PYTHONPATH=$ROOT/packages/oscar-math/src:/tmp/plant/oscar-kernels/src \
        timeout 60 "${PYT[@]}" tests/test_serving_overlap.py -k "stay_open" >"$OUT/plant_tests.log" 2>&1
        echo "[plant rc=$? (must be 1)] $(tail -1 "$OUT/plant_tests.log")")
fi
if [[ $WHAT == tests || $WHAT == rope || $WHAT == all ]]; then
    echo "== plant: the tile angles' approximate cosine and sine swapped (only a GPU runs them)"
    rm -rf /tmp/plant2 && mkdir -p /tmp/plant2 && cp -r packages/oscar-kernels /tmp/plant2/
    sed -i 's/"cos.approx.f32 \$0, \$1;"/"SIN_TMP"/; s/"sin.approx.f32 \$0, \$1;"/"cos.approx.f32 $0, $1;"/; s/"SIN_TMP"/"sin.approx.f32 $0, $1;"/' \
        /tmp/plant2/oscar-kernels/src/oscar_kernels/kernels/attention.py
    grep -A1 'c = tl.inline_asm_elementwise(' /tmp/plant2/oscar-kernels/src/oscar_kernels/kernels/attention.py | grep -c sin.approx
    (cd /tmp/plant2/oscar-kernels && PYTHONPATH=$ROOT/packages/oscar-math/src:/tmp/plant2/oscar-kernels/src \
        timeout 90 "${PYT[@]}" tests/test_rope_mean_attention.py tests/test_extend_attention.py -k "rope" >"$OUT/plant_trig.log" 2>&1
        echo "[plant rc=$? (must be 1)] $(tail -1 "$OUT/plant_trig.log")")
fi
if [[ $WHAT == ablation || $WHAT == all ]]; then
    echo "== step_ablation"
    timeout 120 python3 lab/gpu_vllm/step_ablation.py --out "$OUT" --variants attention_only \
        overlap deferred deferred_early >"$OUT/step_ablation.log" 2>&1
    echo "[rc=$?]"; tail -3 "$OUT/step_ablation.log" | cut -c1-1000
fi
if [[ $WHAT == extend || $WHAT == all ]]; then
    echo "== extend_split (48-token tails over 100k): before / after"
    B=lab/gpu_vllm/before/packages/oscar-kernels/src
    for which in after before; do
        src=packages/oscar-kernels/src
        [[ $which == before ]] && src=$B
        [[ -d $src/oscar_kernels ]] || { echo "no $src"; continue; }
        PYTHONPATH=$ROOT/packages/oscar-math/src:$ROOT/$src timeout 150 python3 lab/kernel_studies/extend_split.py \
            --out "$OUT/extend_$which" --quick --rep-ms 50 --shapes 100000,48,48,0,4,1 100000,48,48,128,8,1 \
            100000,48,48,0,4,0 100000,48,48,64,8,1 100000,48,48,0,4,1,64,3 100000,48,48,0,4,1,32 \
            >"$OUT/extend_$which.log" 2>&1
        echo "[$which rc=$?]"; grep "prefix" "$OUT/extend_$which.log" | cut -c1-300
    done
fi
