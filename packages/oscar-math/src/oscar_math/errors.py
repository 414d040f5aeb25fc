"""Error types and the one input-check helper every public function uses."""

from __future__ import annotations

from typing import Any

__all__ = ["OscarError", "ArtifactError", "check"]


class OscarError(ValueError):
    """Invalid input to an OSCAR function; the message names the argument."""


class ArtifactError(OscarError):
    """A rotations artifact is missing, malformed or does not match the model."""


def check(condition: Any, name: str, expected: str, actual: Any) -> None:
    """Raise :class:`OscarError` ``Invalid <name>: expected <expected>, got <actual>``."""
    if not condition:
        raise OscarError(f"Invalid {name}: expected {expected}, got {actual}")
