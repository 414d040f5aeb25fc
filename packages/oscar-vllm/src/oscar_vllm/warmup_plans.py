"""Which warm-up steps an engine start ran for real, kept as JSON for the next start with the same
sources, versions, GPU, environment and configuration (:class:`WarmupPlans`), so that start runs
them without the dry runs that chose them (:func:`oscar_vllm.warmup.run_warmup`'s ``only``)."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

log = logging.getLogger("oscar_vllm")

__all__ = ["WarmupPlans", "triton_cache_dir", "cache_entries"]


class WarmupPlans:
    """Which warm-up steps an engine start ran for real, per layer configuration, as JSON files in
    ``folder`` (by default beside Triton's kernel cache, whose compiled kernels make the next start's
    real steps cheap): a start whose key matches runs those steps and no dry runs.

    The key covers what picks the launches: every ``oscar_kernels`` source file and
    ``oscar_vllm.warmup``, the torch and Triton versions, the GPU, the ``OSCAR_*`` / ``TRITON_*``
    environment and the caller's configurations and steps. A stale or unreadable file only costs the
    dry runs again (a wrong plan could only leave a compile to the first request that needs it,
    never a wrong number).
    """

    def __init__(self, folder: str | os.PathLike | None = None) -> None:
        self.folder = Path(folder) if folder is not None else triton_cache_dir() / "oscar_warmup"

    def key(self, device: torch.device, configs: Sequence[object]) -> str:
        """A digest of everything the plan depends on (``configs``: each configuration's key and
        steps, in warm-up order)."""
        h = hashlib.sha256(_sources_digest().encode())
        env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("OSCAR_", "TRITON_")))
        h.update(repr((torch.__version__, _triton_version(), _device_name(device), env)).encode())
        h.update(repr(list(configs)).encode())
        return h.hexdigest()[:32]

    def load(self, key: str, steps: Sequence[int]) -> list[list[int]] | None:
        """The step indices per configuration saved under ``key`` (``steps``: each configuration's
        step count, to check them against), or None."""
        try:
            data = json.loads((self.folder / f"{key}.json").read_text())
            plan = data["ran"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        ok = (
            isinstance(plan, list)
            and len(plan) == len(steps)
            and all(
                isinstance(ix, list) and all(type(i) is int and 0 <= i < n for i in ix)
                for ix, n in zip(plan, steps, strict=False)
            )
        )
        return plan if ok else None

    def save(self, key: str, plan: Sequence[Sequence[int]]) -> None:
        """Keep ``plan`` under ``key`` (written whole, then renamed; a failure is logged only)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = self.folder / f".{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps({"ran": [list(map(int, ix)) for ix in plan]}))
            tmp.replace(self.folder / f"{key}.json")
        except OSError as e:
            log.debug("OSCAR: warm-up plan not kept in %s (%s)", self.folder, e)


def triton_cache_dir() -> Path:
    """Triton's kernel cache folder (its ``knobs.cache.dir``; ``~/.triton/cache`` before knobs)."""
    try:
        from triton import knobs

        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):
        return Path.home() / ".triton" / "cache"


def cache_entries(folder: Path) -> int:
    """Entries in Triton's cache folder (one per compiled kernel; 0 where it does not exist)."""
    try:
        with os.scandir(folder) as it:
            return sum(1 for _ in it)
    except OSError:
        return 0


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "none"


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"


@functools.cache
def _sources_digest() -> str:
    """sha256 over ``oscar_kernels``' Python sources and ``oscar_vllm.warmup``'s (what launches what)."""
    import oscar_kernels

    h = hashlib.sha256()
    root = Path(oscar_kernels.__file__).parent
    for f in [*sorted(root.rglob("*.py")), Path(__file__).with_name("warmup.py")]:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()
