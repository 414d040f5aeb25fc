"""Resolve what SGLang 0.5.17 needs on the GPU machine that its image lacks; download each as a
cp312 manylinux wheel with ``pip download --no-deps`` (pip's resolver would pull torch and CUDA
libraries the image already has, several GB).

Usage: python3 sglang_deps.py SGLANG_WHEEL OUT_DIR IMAGE_PACKAGES_TXT [EXTRA_REQ ...]

The image's package names come from IMAGE_PACKAGES_TXT (comma-separated, as in
shared/gpu-vllm/gpu-image-packages.txt); a requirement on one of those is taken as met, except the
pins in ``FORCE`` (versions the image has wrong, carried anyway). ``SKIP`` lists requirements a
dense Qwen3/Llama model on Hopper with the triton attention backend does not import at start-up
(kernel DSLs, FP8/MoE/MLA kernels, multimodal, profilers): carrying them would cost ~1 GB.
Writes OUT_DIR/resolve.json (what was taken, skipped, met by the image, version conflicts).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import zipfile

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as cn
from packaging.version import Version

ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
# Not imported on the dense-model triton path at start-up (checked with lazy_imports.py against
# the module-level imports of launch_server / scheduler / model runner / qwen3). Heavy ones:
# nvidia-cutlass-dsl (~300 MB with libs), tilelang, flash-attn-4, sgl-deep-gemm, torchao, helion.
# sglang-kernel is carried too, but trimmed by gpu_sglang.sh pack (its wheel is 383 MB).
SKIP = {
    cn(n)
    for n in (
        "torch torchaudio torchvision torchcodec triton numba cuda-python nvidia-cutlass-dsl "
        "nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-cu13 nvidia-mathdx flash-attn-4 "
        "helion humming-kernels quack-kernels sgl-deep-gemm tilelang tokenspeed-mla torchao "
        "torch-memory-saver py-spy modelscope kernels av decord2 smg-grpc-servicer "
        "nccl4py cuda-tile nvidia-cudnn-frontend apache-tvm-ffi-cu13 mistral-common anthropic "
        "timm llguidance sglang-kernel"
    ).split()
}
# The image's versions where known (KINDS.md "pip list" row): used only to report conflicts.
IMAGE_VERSIONS = {
    "transformers": "5.17.0",
    "tokenizers": "0.23.2",
    "huggingface-hub": "1.33.0",
    "numpy": "2.5.2",
    "safetensors": "0.8.0",
    "sentencepiece": "0.2.2",
    "tiktoken": "0.14.0",
    "torch": "2.11.0",
    "torchvision": "0.26.0",
    "torchaudio": "2.11.0",
    "triton": "3.6.0",
}
# Carried although the image has the package: SGLang 0.5.17 pins this version.
FORCE = {"transformers"}
PLATFORMS = [
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_35_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
    "any",
]


def requires(whl: str) -> list[Requirement]:
    z = zipfile.ZipFile(whl)
    md = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(md).decode().splitlines()
    return [Requirement(x.split(":", 1)[1].strip()) for x in lines if x.startswith("Requires-Dist:")]


def wanted(r: Requirement, extras: set[str]) -> bool:
    if r.marker is None:
        return True
    return any(r.marker.evaluate(dict(ENV, extra=e)) for e in extras | {""})


def wheel_of(out: str, name: str) -> str | None:
    for w in glob.glob(os.path.join(out, "*.whl")):
        if cn(os.path.basename(w).split("-")[0]) == name:
            return w
    return None


def download(out: str, spec: str) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3"]
    cmd += ["--abi", "none"] + [a for p in PLATFORMS for a in ("--platform", p)] + ["-d", out, spec]
    p = subprocess.run(cmd, capture_output=True, text=True)
    return "" if p.returncode == 0 else (p.stderr.strip().splitlines() or ["?"])[-1]


def main() -> None:
    sglang_whl, out, image_txt, *extra = sys.argv[1:]
    os.makedirs(out, exist_ok=True)
    image = {cn(x.strip()) for x in open(image_txt).read().split(",") if x.strip()}
    todo = [(r, "sglang") for r in requires(sglang_whl) if wanted(r, set())]
    todo += [(Requirement(e), "extra-root") for e in extra]
    report: dict = {"got": {}, "skipped": {}, "image": {}, "conflicts": [], "failed": {}}
    seen: dict[str, set[str]] = {"sglang": set()}
    while todo:
        r, parent = todo.pop(0)
        n = cn(r.name)
        if n in SKIP:
            report["skipped"].setdefault(n, []).append(f"{parent}: {r}")
            continue
        if n in image and n not in FORCE:
            report["image"].setdefault(n, []).append(f"{parent}: {r}")
            v = IMAGE_VERSIONS.get(n)
            if v and r.specifier and Version(v) not in r.specifier:
                report["conflicts"].append(f"{n} {v} (image) vs {r} from {parent}")
            continue
        new_extras = set(r.extras) - seen.get(n, set())
        if n in seen and not new_extras:
            continue
        first = n not in seen
        seen.setdefault(n, set()).update(r.extras)
        if first:
            err = download(out, f"{r.name}{r.specifier}")
            if err:
                report["failed"][n] = f"{r} from {parent}: {err}"
                print("FAIL", r, err)
                continue
        w = wheel_of(out, n)
        if w is None:
            report["failed"][n] = f"{r}: no wheel"
            continue
        report["got"][n] = os.path.basename(w)
        if first:
            print("got", os.path.basename(w), "<-", parent)
        # a later requirement with a narrower specifier: check the wheel we have still fits
        have = Version(os.path.basename(w).split("-")[1])
        if r.specifier and have not in r.specifier:
            report["conflicts"].append(f"{n} {have} (carried) vs {r} from {parent}")
        extras = set(r.extras) if first else new_extras
        for rr in requires(w):
            if rr.marker is None or rr.marker.evaluate(dict(ENV)):
                if first:
                    todo.append((rr, n))
            elif wanted(rr, extras):
                todo.append((Requirement(str(rr).split(";")[0]), f"{n}[{','.join(sorted(extras))}]"))
    with open(os.path.join(out, "resolve.json"), "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
    size = sum(os.path.getsize(w) for w in glob.glob(os.path.join(out, "*.whl")))
    print(f"{len(report['got'])} wheels, {size / 1e6:.1f} MB; conflicts: {report['conflicts']}")
    print("failed:", report["failed"])


if __name__ == "__main__":
    main()
