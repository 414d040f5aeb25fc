# Shared by the lab/gpu_vllm scripts (source it, with $OUT set): run_tests NAME LIMIT PYTEST_ARGS...
# runs pytest under its own time limit (a slow file cannot hide the others' results), its log in
# $OUT/NAME_tests.log, and prints its last line. A caller may set the array PYT first.
if [[ -z "${PYT+x}" ]]; then PYT=(python3 -m pytest -q -p no:cacheprovider -p no:warnings); fi
run_tests() {
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "${PYT[@]}" "$@" >"$OUT/${name}_tests.log" 2>&1
    echo "[$name rc=$?] $(tail -1 "$OUT/${name}_tests.log")"
}
