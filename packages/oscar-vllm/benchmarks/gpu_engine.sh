#!/usr/bin/env bash
# Bring vLLM 0.33 (CUDA), the real SmolLM2 GGUF and the gguf wheel to the GPU test machine, which
# has torch 2.11 and no package index, then run gpu_engine.py there. Each device call carries at
# most 64 MiB, and /tmp there lives only while the machine stays warm (~30 s between calls), so the
# calls run back to back: stash 1..4 (the fourth unpacks), then run (any number of times while warm).
#
#   here, repo root (pip access):  bash packages/oscar-vllm/benchmarks/gpu_engine.sh pack
#        (needs ../shared/gpu-vllm/build_parts.sh and the SmolLM2 GGUF: OSCAR_SMOLLM2_GGUF=...)
#   device call N=1..4, carry .gpu/cN:  bash packages/oscar-vllm/benchmarks/gpu_engine.sh stash N
#   (SmolLM2 wanted: also stash 6, carrying .gpu/c6, the GGUF's first half; any order before run;
#    serve-bench needs only SmolLM2's tokenizer: carry .gpu/c5/tok instead)
#   device call 5.., carry .gpu/c5:     bash packages/oscar-vllm/benchmarks/gpu_engine.sh run [suite args]
#                                        bash packages/oscar-vllm/benchmarks/gpu_engine.sh test [pytest args]
# Each call also carries the working tree (~10 MB): a part stays under ~54 MB so the call fits 64 MiB.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
G="$ROOT/.gpu"
ST=/tmp/st
SITE=/tmp/site
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf

pack() {
    local gguf="${OSCAR_SMOLLM2_GGUF:?set OSCAR_SMOLLM2_GGUF to the SmolLM2 GGUF}"
    [[ -f "$G/parts/p3/deps.txz" ]] || bash "$ROOT/../shared/gpu-vllm/build_parts.sh" "$G/parts"
    rm -rf "$G"/c[1-6] && mkdir -p "$G"/c{1,2,3,4,5,6}
    ln -f "$G/parts/p1/vllm.00" "$G/c1/"; ln -f "$G/parts/p2/vllm.01" "$G/c2/"; ln -f "$G/parts/p3/deps.txz" "$G/c3/"
    cp "$G"/parts/p4/* "$G/c4/"
    # the GGUF's first half in a part of its own: beside FA3 and the wheels it made c4 62 MB, which
    # with the tree passed the 64 MiB a call carries
    # SmolLM2's tokenizer alone (3.5 MB), for serve-bench: carrying .gpu/c5/tok needs no stash 6
    local d
    if d=$(python3 -c "from oscar_calib.models import resolve_model; print(resolve_model('smollm2'))"); then
        mkdir -p "$G/c5/tok" && cp "$d"/tokenizer.json "$d"/tokenizer_config.json "$G/c5/tok/"
    else
        echo "no SmolLM2 folder here (oscar_calib not importable?): serve-bench will need stash 6" >&2
    fi
    head -c 48000000 "$gguf" >"$G/c6/$GGUF_NAME.aa"
    tail -c +48000001 "$gguf" >"$G/c5/$GGUF_NAME.ab"
    sha256sum "$gguf" | awk -v n="$GGUF_NAME" '{print $1 "  " n}' >"$G/c5/SHA256"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$G/c5" gguf==0.19.0
    du -sh "$G"/c*
}

stash() {  # device: keep this call's part for the next calls
    mkdir -p "$ST" && cp "$G/c$1"/* "$ST/"
    if [[ "$1" == 4 ]]; then unpack; fi
    ls -la "$ST" | tail -n +2
}

unpack() {  # device: vLLM + its missing dependencies into $SITE (the recipe of ../shared/gpu-vllm)
    mkdir -p "$SITE" /tmp/wh
    xz -dc "$ST/deps.txz" | tar xf - -C /tmp/wh && cp "$ST"/*.whl /tmp/wh/
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" /tmp/wh/*.whl
    cat "$ST/vllm.00" "$ST/vllm.01" | xz -T8 -dc | tar xf - -C "$SITE"
    xz -dc "$ST/fa3.txz" | tar xf - -C "$SITE"
    rm -f "$ST/vllm.00" "$ST/vllm.01" "$ST/deps.txz"
    echo "unpacked vLLM into $SITE"
}

setup() {  # device: the GGUF, this tree's packages, the environment every action runs in
    [[ -f "$SITE/vllm/__init__.py" ]] || { echo "no vLLM in $SITE: run stash 1..4 first (machine went cold?)" >&2; exit 3; }
    if [[ ! -f "$ST/$GGUF_NAME" && -f "$G/c5/$GGUF_NAME.ab" ]]; then
        cp "$G/c5/$GGUF_NAME.ab" "$G/c5/SHA256" "$ST/" 2>/dev/null || true
        cat "$ST/$GGUF_NAME.aa" "$ST/$GGUF_NAME.ab" >"$ST/$GGUF_NAME"
        (cd "$ST" && sha256sum -c SHA256)
        python3 -m pip install -q --no-index --no-deps --target "$SITE" "$G"/c5/gguf-*.whl
    fi
    # this tree's packages, every call (a fix between calls takes effect)
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$SITE" \
        "$ROOT"/packages/oscar-math "$ROOT"/packages/oscar-kernels "$ROOT"/packages/oscar-calib "$ROOT"/packages/oscar-vllm
    export PYTHONPATH="$SITE" PATH="$SITE/bin:$PATH" VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
    export OSCAR_SMOLLM2_GGUF="$ST/$GGUF_NAME" OSCAR_CACHE_DIR=/tmp/oscar-cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
}

run() {  # device: SmolLM2 converted, then the suite
    setup
    local smol qwen=/tmp/qwen3-8b-shape
    smol=""  # no GGUF carried (.gpu/c5): the Qwen3-8B-shape cases only
    [[ -f "$ST/$GGUF_NAME" ]] && smol=$(python3 -c "from oscar_calib.models import resolve_model; print(resolve_model('smollm2'))")
    mkdir -p "$qwen" && cp "$ROOT/packages/oscar-vllm/benchmarks/qwen3-8b-shape.config.json" "$qwen/config.json"
    python3 "$ROOT/packages/oscar-vllm/benchmarks/gpu_engine.py" suite --smol "$smol" --qwen "$qwen" --out "${OUT:-/tmp/gpu-out}" "$@"
}

tests() {  # device: pytest on this tree with the same environment (e.g. the HTTP server tests)
    setup
    unset VLLM_ENABLE_V1_MULTIPROCESSING  # servers run as users run them: engine core in its own process
    cd "$ROOT" && python3 -m pytest -p no:cacheprovider "$@"
}

serve_bench() {  # device: vLLM's own serving benchmark (serving_bench.py) on the Qwen3-8B shape with
    # SmolLM2's tokenizer (its ids fit Qwen3's vocabulary); workloads, rates and `-- server args` pass through
    setup
    unset VLLM_ENABLE_V1_MULTIPROCESSING  # servers run as users run them
    local qwen=/tmp/qwen3-8b-shape rot=/tmp/qwen3-8b-shape.oscar.safetensors tok="$G/c5/tok"
    if [[ ! -f "$tok/tokenizer.json" ]]; then  # no tokenizer folder carried: SmolLM2's, from its GGUF
        [[ -f "$ST/$GGUF_NAME" ]] || { echo "serve-bench needs SmolLM2's tokenizer: carry .gpu/c5/tok (or stash 6 + .gpu/c5)" >&2; exit 3; }
        tok=$(python3 -c "from oscar_calib.models import resolve_model; print(resolve_model('smollm2'))")
    fi
    mkdir -p "$qwen" && cp "$ROOT/packages/oscar-vllm/benchmarks/qwen3-8b-shape.config.json" "$qwen/config.json"
    python3 "$ROOT/packages/oscar-vllm/benchmarks/gpu_engine.py" qwen-artifact "$qwen/config.json" "$rot"
    python3 "$ROOT/packages/oscar-vllm/benchmarks/serving_bench.py" --engine vllm --model "$qwen" \
        --tokenizer "$tok" --rotations "$rot" --out "${OUT:-/tmp/gpu-out}" "$@"
}

case "${1:-}" in
    pack) pack ;;
    stash) stash "$2" ;;
    run) shift; run "$@" ;;
    test) shift; tests "$@" ;;
    serve-bench) shift; serve_bench "$@" ;;
    setup) setup; echo "ready: PYTHONPATH=$PYTHONPATH" ;;  # then several pytest runs side by side
    *) echo "usage: gpu_engine.sh pack | stash N | setup | run [suite args] | test [pytest args] | serve-bench [serving_bench.py args]" >&2; exit 2 ;;
esac
