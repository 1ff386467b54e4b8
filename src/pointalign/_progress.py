"""Progress bars, logging and warnings: the conventions every part of pointalign follows.

Logging
    The library logs through ``logging.getLogger("pointalign")`` (children such as
    ``"pointalign.icp"`` via :func:`get_logger`) and never configures handlers itself: a
    :class:`logging.NullHandler` keeps it silent until the application configures logging.
    Levels: ``DEBUG`` per-iteration or per-stage detail, ``INFO`` one line per call (sizes,
    chosen parameters, the result's summary), ``WARNING`` only through :func:`warn`.
    The CLI's ``-v``/``-q`` call :func:`configure_logging`.

Warning categories
    :func:`warn` issues :class:`PointalignWarning` subclasses through :mod:`warnings` (so
    users can filter or turn them into errors) and logs them at ``DEBUG``:

    * :class:`SlowOperationWarning`: the call will take long (e.g. EM-ICP on 40k points on a
      CPU): say roughly how long and what to do instead (downsample, another method).
    * :class:`IgnoredParameterWarning`: a parameter the method does not use was given
      (:func:`warn_ignored`).
    * :class:`DoubtfulResultWarning`: the result's verdict is uncertain.

Progress
    Long loops (batches, annealing schedules, RANSAC chunks, many files, benchmarks) wrap
    their work in :func:`task` or :func:`track`::

        from pointalign import _progress

        with _progress.task("EM-ICP", total=n_iterations) as bar:
            for k in range(n_iterations):
                ...
                bar.advance()

        for path in _progress.track(files, "reading"):
            ...

    A rich progress bar is drawn on standard error only when it is a terminal, rich is
    installed, and progress is not switched off by :func:`set_quiet` / :func:`quiet`, the
    ``quiet=True`` argument or ``POINTALIGN_PROGRESS=0`` (``=1`` forces it on). Otherwise
    both are no-ops costing a few attribute look-ups per step, so algorithms may call them
    unconditionally. Nested tasks share one display (rich allows one live display). Keep
    ``advance`` calls off the GPU hot path: advance per host-side step, not per kernel, and
    never synchronise a device just to report progress.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

logger = logging.getLogger("pointalign")
logger.addHandler(logging.NullHandler())


class PointalignWarning(UserWarning):
    """Base class of every warning pointalign issues."""


class SlowOperationWarning(PointalignWarning):
    """The operation will take long on this device and input size."""


class IgnoredParameterWarning(PointalignWarning):
    """A parameter was given that the chosen method does not use."""


class DoubtfulResultWarning(PointalignWarning):
    """The result's verdict (e.g. ``converged``) is uncertain."""


def get_logger(name: str | None = None) -> logging.Logger:
    """Return ``logging.getLogger("pointalign")`` or its child ``"pointalign.<name>"``."""
    return logger if not name else logger.getChild(name)


def warn(message: str, category: type[Warning] = PointalignWarning,
         stacklevel: int = 2) -> None:
    """Issue ``warnings.warn(message, category)`` pointing at the caller's caller.

    Args:
        message: one sentence saying what happens and what to do about it.
        category: a :class:`PointalignWarning` subclass.
        stacklevel: as in :func:`warnings.warn`, counted from the function calling this one
            (2: the user's line that called the public function).

    """
    logger.debug("warning (%s): %s", category.__name__, message)
    warnings.warn(message, category, stacklevel=stacklevel + 1)


def warn_ignored(parameter: str, method: str, reason: str = "", stacklevel: int = 2) -> None:
    """Warn that ``parameter`` was given but ``method`` does not use it."""
    tail = f" ({reason})" if reason else ""
    warn(f"{parameter} is ignored by {method}{tail}", IgnoredParameterWarning,
         stacklevel=stacklevel + 1)


# ------------------------------------------------------------------------------ quiet state

_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("pointalign_quiet",
                                                              default=False)


def set_quiet(flag: bool = True) -> None:
    """Switch progress bars off (``True``) or back on for this context/thread."""
    _QUIET.set(bool(flag))


@contextlib.contextmanager
def quiet(flag: bool = True) -> Iterator[None]:
    """Within this block progress bars are off (``flag=True``)."""
    token = _QUIET.set(bool(flag))
    try:
        yield
    finally:
        _QUIET.reset(token)


def enabled(quiet: bool | None = None, stream: Any = None) -> bool:
    """Tell whether a progress bar would be drawn now (see the module docstring)."""
    env = os.environ.get("POINTALIGN_PROGRESS", "").strip()
    if quiet or (quiet is None and _QUIET.get()) or env == "0":
        return False
    try:
        import rich.progress  # noqa: F401
    except ImportError:
        return False
    if env == "1":
        return True
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


# ------------------------------------------------------------------------------ progress

class _NoBar:
    """What :func:`task` yields when nothing is drawn."""

    def advance(self, n: float = 1) -> None:
        """Count ``n`` more steps done (nothing drawn)."""

    def update(self, **fields: Any) -> None:
        """Change ``description``/``total``/``completed`` (nothing drawn)."""


class _Bar:
    def __init__(self, progress: Any, task_id: Any) -> None:
        self._p, self._id = progress, task_id

    def advance(self, n: float = 1) -> None:
        """Count ``n`` more steps done."""
        self._p.advance(self._id, n)

    def update(self, **fields: Any) -> None:
        """Change ``description``/``total``/``completed`` of the bar."""
        self._p.update(self._id, **fields)


_LIVE: list[Any] = []  # the one rich Progress on screen, while a task is open


@contextlib.contextmanager
def task(description: str, total: float | None = None, *,
         quiet: bool | None = None) -> Iterator[_Bar | _NoBar]:
    """Show a progress bar for a block of work; yields an object with ``advance(n)``.

    Args:
        description: short text in front of the bar ("EM-ICP", "reading files").
        total: number of steps (None: an indeterminate spinner).
        quiet: True: draw nothing; None: follow :func:`set_quiet` / the terminal test.

    """
    if not enabled(quiet):
        yield _NoBar()
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    if _LIVE:  # nested: one more line in the display that is already live
        prog = _LIVE[-1]
        tid = prog.add_task(description, total=total)
        try:
            yield _Bar(prog, tid)
        finally:
            prog.remove_task(tid)
        return
    prog = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                    transient=True)
    with prog:
        _LIVE.append(prog)
        try:
            yield _Bar(prog, prog.add_task(description, total=total))
        finally:
            _LIVE.pop()


def track(iterable: Iterable[T], description: str, total: float | None = None, *,
          quiet: bool | None = None) -> Iterator[T]:
    """Yield the items of ``iterable`` while advancing a progress bar (see :func:`task`)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    with task(description, total, quiet=quiet) as bar:
        for item in iterable:
            yield item
            bar.advance()


# ------------------------------------------------------------------------------ logging setup

def configure_logging(verbosity: int = 0) -> None:
    """Send pointalign's log to standard error at a level set by ``verbosity`` (for apps).

    Args:
        verbosity: ``-1`` (quiet: errors only, no progress), ``0`` warnings, ``1`` info,
            ``2`` or more debug. Uses rich's handler when rich is installed.

    """
    level = {-1: logging.ERROR, 0: logging.WARNING, 1: logging.INFO}.get(
        max(-1, min(verbosity, 2)), logging.DEBUG)
    for h in list(logger.handlers):
        if getattr(h, "_pointalign_cli", False):
            logger.removeHandler(h)
    try:
        from rich.console import Console
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=Console(stderr=True), show_time=False,
                                               show_path=verbosity >= 2)
    except ImportError:  # pragma: no cover - rich is in the cli extra
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler._pointalign_cli = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)
    set_quiet(verbosity < 0)
    logging.captureWarnings(False)
