#!/usr/bin/env bash
# Bring SmolLM2-135M (the GGUF, in two parts) and the few wheels the GPU machine lacks
# to a GPU machine with no package index, then run `nox -s gpu` there (kernel unit tests,
# the paged serving loop's tests and the end-to-end checks of gpu_e2e.py).
#
# Why two parts: each call to the device machine carries at most 64 MiB with the rest of
# the tree; the GGUF is 98 MB. /tmp on that machine survives between back-to-back calls.
#
#   here (has the GGUF and pip, repo root):
#     bash packages/oscar-calib/benchmarks/gpu_e2e.sh pack [GGUF]   # -> .xfer/part1, .xfer/part2 (git-ignored)
#   device call 1, carrying .xfer/part1 (and not part2):
#     bash packages/oscar-calib/benchmarks/gpu_e2e.sh stash         # copies the part to /tmp/oscar-xfer
#   device call 2, carrying .xfer/part2, while the machine is still warm:
#     bash packages/oscar-calib/benchmarks/gpu_e2e.sh run           # joins, checks sha256, installs, nox -s gpu
#
# `run` writes gpu_e2e.json and the GPU-made artifacts under $OUT (default ./gpu-e2e).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
XFER="$ROOT/.xfer"
STASH=/tmp/oscar-xfer
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
# pure-Python wheels: gguf (transformers reads GGUF with it) and nox with the needs the
# H200 image lacks (virtualenv is not needed: the gpu session runs with venv_backend none)
WHEELS=(gguf==0.19.0 nox==2026.10.20 argcomplete==3.7.2 colorlog==6.12.0 dependency-groups==1.3.2
    humanize==4.17.0 python-discovery==1.9.6 attrs==26.1.0 filelock==4.3.1 platformdirs==4.14.9)

pack() {
    local gguf="${1:-${OSCAR_SMOLLM2_GGUF:-}}"
    [[ -f "$gguf" ]] || { echo "gpu_e2e.sh pack: no GGUF file (give its path or set OSCAR_SMOLLM2_GGUF)" >&2; exit 2; }
    rm -rf "$XFER" && mkdir -p "$XFER/part1/wheels" "$XFER/part2"
    # two halves (< 50 MB each): with the tree and the wheels each call stays < 64 MiB
    local size half
    size=$(stat -c %s "$gguf")
    half=$(( (size + 1) / 2 ))
    head -c "$half" "$gguf" >"$XFER/part1/$GGUF_NAME.part-aa"
    tail -c +"$((half + 1))" "$gguf" >"$XFER/part2/$GGUF_NAME.part-ab"
    sha256sum "$gguf" | awk -v n="$GGUF_NAME" '{print $1 "  " n}' >"$XFER/part2/SHA256"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$XFER/part1/wheels" "${WHEELS[@]}"
    du -sh "$XFER"/part1 "$XFER"/part2
}

stash() {
    mkdir -p "$STASH"
    for d in "$XFER"/part1 "$XFER"/part2; do
        [[ -d "$d" ]] && cp -r "$d"/. "$STASH"/
    done
    ls -la "$STASH"
}

run() {
    stash
    cd "$STASH"
    if [[ ! -f "$GGUF_NAME" ]]; then
        [[ -f "$GGUF_NAME.part-aa" && -f "$GGUF_NAME.part-ab" ]] || {
            echo "gpu_e2e.sh run: missing a GGUF part in $STASH (run 'stash' with part1 first)" >&2; exit 2; }
        cat "$GGUF_NAME.part-aa" "$GGUF_NAME.part-ab" >"$GGUF_NAME"
    fi
    sha256sum -c SHA256
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site wheels/*.whl
    cd "$ROOT"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    export OSCAR_SMOLLM2_GGUF="$STASH/$GGUF_NAME" OSCAR_CACHE_DIR=/tmp/oscar-cache
    export OSCAR_GPU_OUT="${OUT:-$ROOT/gpu-e2e}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
    if python3 -c "import nox" 2>/dev/null; then
        python3 -m nox -s gpu -- "$@"
    else  # the same steps as the gpu session
        echo "gpu_e2e.sh: nox not importable, running the gpu session's commands directly"
        python3 -m pip install -q --no-deps --no-build-isolation \
            -e packages/oscar-math -e packages/oscar-kernels -e packages/oscar-calib
        local rc=0
        python3 packages/oscar-calib/benchmarks/gpu_e2e.py --out "$OSCAR_GPU_OUT" || rc=$?
        python3 -m pytest -q packages/oscar-kernels/tests tests/test_paged_serving.py "$@" || rc=$?
        return $rc
    fi
}

cmd="${1:-}"
shift || true
case "$cmd" in
    pack) pack "$@" ;;
    stash) stash ;;
    run) run "$@" ;;
    *) echo "usage: gpu_e2e.sh pack [GGUF] | stash | run [pytest args]" >&2; exit 2 ;;
esac
