"""One readable last line when an OSCAR error stops an engine: ``OSCAR: <the OscarError message>``.

vLLM: a bad artifact fails in a worker process while the model is built; vLLM logs it there with
its traceback, the engine core logs its own, and the server process ends with a third
(``Engine core initialization failed. See root cause above``): some 240 lines in which the
cause is easy to miss. SGLang: the launcher checks the artifact while it parses its arguments and
dies of the traceback. Both plugins (loaded by their engine in every process) therefore call
:func:`install`, which:

* in every process, wraps the logging record factory: a record at ERROR or above whose
  exception (or any exception in its ``__cause__`` / ``__context__`` chain) is an
  :class:`~oscar_math.errors.OscarError` appends that error's first line to a per-launch file.
  vLLM logs every start-up failure of its engine and worker processes this way
  (``logger.exception``), under any logging configuration (the factory sees records before
  handlers do, and vLLM's own factory wraps whatever is installed);
* in the launching process (the one that is not a ``multiprocessing`` child: ``vllm serve``,
  the api_server, a script building ``LLM``), names that file in ``$OSCAR_VLLM_ERROR_FILE``
  (inherited by the engine processes it starts) and wraps ``sys.excepthook``: when the process
  dies of an uncaught exception (vLLM's server raises ``Engine core initialization failed`` out of
  ``main``; so does a script whose ``LLM(...)`` fails), it notes an OscarError in that exception's
  own chain, and at exit prints each recorded message once as ``OSCAR: <message>`` on stderr. The
  file is removed at exit either way. A process that handled the failure (a test expecting it,
  a script retrying) prints nothing. The atexit hook is registered when vLLM loads plugins,
  before vLLM's own, so it runs after them: the line comes last.

Nothing is hidden or changed: tracebacks and exit statuses stay vLLM's, and an error that is
not an OscarError produces no line.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from oscar_math.errors import OscarError

__all__ = ["ENV", "install", "note", "oscar_error_in", "report"]

#: the per-launch file the engine processes append OscarError messages to
ENV = "OSCAR_ERROR_FILE"
PREFIX = "OSCAR: "

_installed = False
_dying = False  # the launching process is exiting on an uncaught exception


def oscar_error_in(exc: BaseException | None) -> OscarError | None:
    """The first OscarError in ``exc``'s chain (itself, then causes and contexts), else ``None``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OscarError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def note(exc: BaseException | None, path: str | None = None) -> None:
    """Append the message of the OscarError in ``exc``'s chain (if any) to the launch's file."""
    err = oscar_error_in(exc)
    path = path or os.environ.get(ENV)
    if err is None or not path:
        return
    try:
        # O_NOFOLLOW: the file lies in a shared temporary directory
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(_first_line(err) + "\n")
    except OSError:  # reporting must never add a failure of its own
        pass


def report(path: str, stream: Any = None, show: bool = True) -> list[str]:
    """Print (if ``show``) each distinct recorded message once as ``OSCAR: <message>``; remove the file.

    Returns the recorded lines.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # nothing recorded
        return []
    try:
        with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
            if os.fstat(f.fileno()).st_uid != os.getuid():  # not ours: ignore it
                return []
            messages = list(dict.fromkeys(line.strip() for line in f if line.strip()))
        os.unlink(path)
    except OSError:
        return []
    out = [PREFIX + m for m in messages]
    if out and show:
        stream = stream or sys.stderr
        print("\n".join(out), file=stream, flush=True)
    return out


class _RecordFactory:
    """Wraps the logging record factory; notes OscarErrors of ERROR records, returns the record unchanged."""

    def __init__(self, factory: Callable[..., logging.LogRecord]) -> None:
        self._factory = factory

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record = self._factory(*args, **kwargs)
        exc_info = record.exc_info
        if exc_info and record.levelno >= logging.ERROR and isinstance(exc_info, tuple):
            note(exc_info[1])
        return record


def _excepthook(previous: Callable[..., Any]) -> Callable[..., Any]:
    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        global _dying
        previous(exc_type, exc, tb)  # the usual traceback first
        _dying = True
        note(exc)

    return hook


def _at_exit(path: str) -> None:
    report(path, show=_dying)


def _path_for(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"oscar-errors-{os.getuid()}-{pid}")


def install() -> None:
    """Set up the recording (every process) and the report (the launching process); idempotent."""
    global _installed
    if _installed:
        return
    _installed = True
    if multiprocessing.parent_process() is None:
        # the launching process: a file of its own, even if an outer process set one
        path = _path_for(os.getpid())
        if os.path.lexists(path):  # left by an earlier process with this pid
            try:
                os.unlink(path)
            except OSError:
                pass
        os.environ[ENV] = path
        sys.excepthook = _excepthook(sys.excepthook)
        atexit.register(_at_exit, path)
    factory = logging.getLogRecordFactory()
    if not isinstance(factory, _RecordFactory):
        logging.setLogRecordFactory(_RecordFactory(factory))
