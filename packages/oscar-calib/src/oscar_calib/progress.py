"""Time left in a run of known steps, estimated from the steps already timed.

The evaluation knows its whole plan up front (every context, sequence, scheme and
passkey case), so after each step it can say how long the rest should take: a step
whose key has run before (the same scheme at the same context on an earlier
sequence) is expected to take as long as it did last time; a step never seen is
expected to take the mean of the finished steps of its kind, scaled by context
length when it was measured at another context (or, before any step of its kind has
finished, the rate of a kind it resembles); with nothing to go on yet the
estimate is unknown (``None``) rather than made up.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from oscar_math import check

__all__ = ["Step", "StepClock", "format_seconds"]


@dataclass(frozen=True)
class Step:
    """One step of a plan.

    Attributes:
        kind: what the step does (``"forward"``, ``"metrics"``, ``"passkey"``): the fallback
            estimate averages the finished steps of the same kind.
        key: identifies repeats of the same work (e.g. the scheme's name).
        size: relative size, e.g. the context length; a fallback estimate is scaled by it.
        like: a kind whose rate stands in while no step of ``kind`` has finished (a passkey
            case is mostly one forward pass over its prompt): None, no stand-in.
    """

    kind: str
    key: Hashable
    size: float = 1.0
    like: str | None = None


class StepClock:
    """Bookkeeping of finished steps and the estimate of the time the others need.

    Usage::

        clock = StepClock([Step("forward", "int2", 2048), ...])
        clock.finish(seconds)   # after each step, in plan order
        clock.left()            # estimated seconds for the remaining steps (None: no data yet)
    """

    def __init__(self, plan: Sequence[Step]):
        self.plan = list(plan)
        self.done = 0
        self._last: dict[tuple[str, Hashable, float], float] = {}
        self._per_size: dict[str, list[float]] = {}  # seconds per unit of size, per kind

    def finish(self, seconds: float) -> None:
        """Record that the next step of the plan took ``seconds``."""
        check(self.done < len(self.plan), "finished steps", f"at most {len(self.plan)}", self.done + 1)
        step = self.plan[self.done]
        self._last[(step.kind, step.key, step.size)] = seconds
        self._per_size.setdefault(step.kind, []).append(seconds / step.size)
        self.done += 1

    def expected(self, step: Step) -> float | None:
        """Seconds ``step`` should take (None: no finished step of its kind yet)."""
        last = self._last.get((step.kind, step.key, step.size))
        if last is not None:
            return last
        rates = self._per_size.get(step.kind) or (self._per_size.get(step.like) if step.like else None)
        return None if not rates else sum(rates) / len(rates) * step.size

    def left(self) -> float | None:
        """Estimated seconds for the steps not finished yet (0 when all are; None while
        some remaining step has no estimate)."""
        total = 0.0
        for step in self.plan[self.done :]:
            est = self.expected(step)
            if est is None:
                return None
            total += est
        return total

    def status(self) -> str:
        """``"step 7/18, ~1 min 10 s left"`` (``"…, time left not known yet"`` before data)."""
        left = self.left()
        tail = "time left not known yet" if left is None else f"~{format_seconds(left)} left"
        return f"step {self.done}/{len(self.plan)}, {tail}"


def format_seconds(seconds: float) -> str:
    """``"42 s"``, ``"3 min 05 s"``, ``"1 h 02 min"``."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"
