"""Where a long call's wall time goes, from a sampling thread: cheap enough to leave on while the
call itself is timed (a profiler that traces every call slows a Python-heavy start-up by 1.5-2x).

Every ``interval`` seconds the thread reads the sampled thread's stack (``sys._current_frames``) and
counts each distinct function on it once: a function's count x interval is its inclusive time,
as cProfile's cumtime. ``gpu_engine.py`` samples an engine's start with it (vLLM's engine core
runs in the caller's thread when ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

    with StackSampler() as s:
        llm = LLM(...)
    s.top(40)  # [(seconds, "file.py:function"), ...], most first
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from pathlib import Path


class StackSampler:
    def __init__(self, interval: float = 0.02, thread_id: int | None = None) -> None:
        self.interval = interval
        self.thread_id = thread_id if thread_id is not None else threading.get_ident()
        self.inclusive: Counter[str] = Counter()
        self.leaf: Counter[str] = Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.thread_id)
            if frame is None:
                continue
            self.samples += 1
            seen: set[str] = set()
            leaf = True
            while frame is not None:
                code = frame.f_code
                name = f"{Path(code.co_filename).name}:{code.co_name}"
                if leaf:
                    self.leaf[name] += 1
                    leaf = False
                if name not in seen:  # recursion counts once
                    seen.add(name)
                    self.inclusive[name] += 1
                frame = frame.f_back

    def __enter__(self) -> StackSampler:
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.wall = time.perf_counter() - self._t0

    def top(self, n: int = 40, leaf: bool = False) -> list[tuple[float, str]]:
        """The ``n`` functions with the most time: inclusive (on the stack), or ``leaf`` (running)."""
        c = self.leaf if leaf else self.inclusive
        scale = self.wall / max(self.samples, 1)  # seconds a sample stands for (the loop's real pace)
        return [(round(k * scale, 2), name) for name, k in c.most_common(n)]

    def report(self, n: int = 40) -> dict:
        return {"wall_s": round(self.wall, 1), "samples": self.samples, "inclusive": self.top(n),
                "leaf": self.top(n // 2, leaf=True)}  # fmt: skip
