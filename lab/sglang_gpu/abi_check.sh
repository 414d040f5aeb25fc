#!/usr/bin/env bash
# Can SGLang 0.5.23's compiled kernels load beside the H200 machine's torch 2.11.0+cu130 (Python 3.12)?
# Runs on a CPU machine with pip access; needs unzip, nm, readelf, c++filt. Nothing is installed.
#   lab/sglang_gpu/abi_check.sh OUT_DIR            # ~1 GB of downloads, ~3 GB unpacked
#   CONTROL=1 lab/sglang_gpu/abi_check.sh OUT_DIR  # also check against torch 2.14.1 (SGLang's pin)
# For every .so of sglang-kernel 0.4.10 it prints the NEEDED libraries and the number of torch
# symbols it imports (C++ = unstable ABI: c10::/at::/torch::; C shim = stable ABI: aoti_torch_*,
# torch_*) that torch 2.11's libraries do not export; a missing symbol means dlopen fails.
set -euo pipefail
OUT=${1:?usage: abi_check.sh OUT_DIR}
mkdir -p "$OUT"/whl "$OUT"/kern "$OUT"/t211 "$OUT"/t214
cd "$OUT"
PIP=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
t0=$(date +%s)
"${PIP[@]}" -d whl sglang==0.5.23 sglang-kernel==0.4.10 flashinfer-python==0.7.2 apache-tvm-ffi==0.1.11
"${PIP[@]}" -d t211 torch==2.11.0
[ "${CONTROL:-0}" = 1 ] && "${PIP[@]}" -d t214 torch==2.14.1
echo "downloads: $(( $(date +%s) - t0 )) s"

echo "== sglang 0.5.23 kernel pins:"
unzip -p whl/sglang-0.5.23-*.whl '*/METADATA' | grep -E '^Requires-Dist: (torch|sglang-kernel|flashinfer)'
unzip -q -o whl/sglang_kernel-0.4.10-*.whl 'sgl_kernel/*.so' -d kern  # '*' also matches sm90/, sm100/

defined() {  # all dynamic symbols a torch wheel's torch/lib exports
  unzip -q -o "$1"/torch-*.whl 'torch/lib/*.so*' 'torch/version.py' -d "$1"
  grep __version__ "$1"/torch/version.py | sed 's/^/   /'
  for l in "$1"/torch/lib/lib*.so*; do nm -D --defined-only "$l" | awk '{print $3}'; done | sort -u > "$1"/defined.txt
}
echo "== torch 2.11.0 wheel:"; defined t211
[ "${CONTROL:-0}" = 1 ] && { echo "== torch 2.14.1 wheel (control):"; defined t214; }

TORCHISH='3c10|2at[0-9A-Z_]|5torch|6caffe2|^aoti_torch|^torch_'
: > missing_all.txt
for so in $(find kern -name '*.so' | sort); do
  nm -D --undefined-only "$so" | awk '{print $2}' | grep -v '@' | grep -E "$TORCHISH" | sort -u > und.txt
  cxx=$(grep -vcE '^aoti_torch|^torch_' und.txt || true); cshim=$(grep -cE '^aoti_torch|^torch_' und.txt || true)
  miss=$(comm -23 und.txt t211/defined.txt | tee -a missing_all.txt | wc -l)
  ctl=""; [ "${CONTROL:-0}" = 1 ] && ctl=" missing_in_2.14.1=$(comm -23 und.txt t214/defined.txt | wc -l)"
  echo "-- ${so#kern/}: torch C++ symbols=$cxx, stable C-shim symbols=$cshim, missing_in_2.11=$miss$ctl"
  echo "   NEEDED: $(readelf -d "$so" | grep NEEDED | grep -oE '\[[^]]*\]' | tr -d '[]' | tr '\n' ' ')"
done
echo "== distinct symbols missing from torch 2.11 ($(sort -u missing_all.txt | wc -l)):"
sort -u missing_all.txt | c++filt | cut -c1-160 | sed 's/^/   /'

echo "== flashinfer-python 0.7.2 compiled files:"
unzip -l whl/flashinfer_python-0.7.2-*.whl | grep -cE '\.(so|cubin)$' || true
echo "== apache-tvm-ffi 0.1.11 .so files importing torch symbols:"
mkdir -p tvm && unzip -q -o whl/apache_tvm_ffi-0.1.11-*.whl '*.so' -d tvm
for so in $(find tvm -name '*.so'); do echo "   ${so#tvm/}: $(nm -D --undefined-only "$so" | grep -cE "$TORCHISH" || true)"; done
echo "total: $(( $(date +%s) - t0 )) s"
