"""Progress bars, logging and warnings: the conventions every part of pointalign follows.

Logging
    The library logs through ``logging.getLogger("pointalign")`` (children such as
    ``"pointalign.icp"`` via :func:`get_logger`) and never configures handlers itself: a
    :class:`logging.NullHandler` keeps it silent until the application configures logging.
    Levels: ``DEBUG`` per-iteration or per-stage detail (:func:`log_timings`: one line of
    stage timings per call), ``INFO`` one line per call (sizes, chosen parameters, the
    result's summary), ``WARNING`` only through :func:`warn`.
    The CLI's ``-v``/``-q`` call :func:`configure_logging`.

Warning categories
    :func:`warn` issues :class:`PointalignWarning` subclasses through :mod:`warnings` (so
    users can filter or turn them into errors) and logs them at ``DEBUG``. Under
    :func:`quiet` / :func:`set_quiet` (the CLI's ``--quiet``) they are only logged. Unlike
    progress bars they are issued off a terminal too (a batch job's log should keep them):

    * :class:`SlowOperationWarning`: the call will take long (e.g. EM-ICP on 40k points on a
      CPU): say roughly how long and what to do instead (downsample, another method);
      :func:`warn_slow` issues it above :data:`SLOW_SECONDS`.
    * :class:`IgnoredParameterWarning`: a parameter the method does not use was given
      (:func:`warn_ignored`).
    * :class:`DoubtfulResultWarning`: the result's verdict is uncertain.
    * :class:`FileContentWarning`: a file was read under an assumption (the column count of
      a raw ``.bin`` scan) or part of it was left out (a mesh's faces, rows whose
      coordinates are NaN), with the numbers.
    * :class:`UnitsWarning`: the two clouds, or a length given with them, differ in scale by
      more than 20× (:func:`pointalign.registration.checks.check_units`): probably one of
      them is in other units (millimetres against metres); both scales are named.

Estimates
    Work that can run longer than :data:`ANNOUNCE_SECONDS` on this device says so before it
    starts (:func:`announce`: a line above the bars on a terminal, an ``INFO`` log line
    always); above :data:`SLOW_SECONDS` it also warns (:func:`warn_slow`). The cost models
    live with the work (``registration.checks.estimate_icp_seconds``,
    ``estimate_register_seconds``; the soft methods' in their passes).

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

    Algorithms with an iteration loop of possibly long steps (ICP on millions of points) wrap
    the loop's host records in ``track(records, "ICP", total=cap, delay=LIBRARY_DELAY)`` so
    that a long call shows a bar with a count; an application that opens its own spinner
    around such a call passes ``placeholder=True`` (the spinner hides while the counted bar
    shows). Messages printed while bars are on screen go through :func:`live_console` (above
    the bars, never inside a progress line); the CLI prints the library's warnings so.

    A rich progress bar is drawn on standard error only when it is a terminal, rich is
    installed, and progress is not switched off by :func:`set_quiet` / :func:`quiet`, the
    ``quiet=True`` argument or ``POINTALIGN_PROGRESS=0`` (``=1`` forces it on). Otherwise
    both are no-ops costing a few attribute look-ups per step, so algorithms may call them
    unconditionally. ``task(..., delay=LIBRARY_DELAY)`` shows the bar only once the work has
    run that long (library calls use it: a fast call draws nothing). Nested tasks share one
    display (rich allows one live display). Keep
    ``advance`` calls off the GPU hot path: advance per host-side step, not per kernel, and
    never synchronise a device just to report progress.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import threading
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


class FileContentWarning(PointalignWarning):
    """A file was read under an assumption, or part of it was left out.

    For example: a mesh PLY read as its vertices (its faces are not points), rows with
    non-finite coordinates dropped, a raw ``.bin`` scan whose column count was inferred.
    """


class UnitsWarning(PointalignWarning):
    """The clouds, or a length given with them, differ in scale by more than 20×.

    Raised before any work by :func:`pointalign.registration.checks.check_units`, naming both
    scales and the likely unit error (millimetres against metres, …).
    """


def get_logger(name: str | None = None) -> logging.Logger:
    """Return ``logging.getLogger("pointalign")`` or its child ``"pointalign.<name>"``."""
    return logger if not name else logger.getChild(name)


def user_stacklevel() -> int:
    """Return the ``stacklevel`` of the first frame outside pointalign, counted from the caller.

    For a warning issued deep inside a public function (through decorators and helpers):
    it points at the user's line that called pointalign, however deep the call.
    """
    frame = sys._getframe(1)
    level = 1
    while frame is not None and (frame.f_globals.get("__name__", "") + ".").startswith(
            "pointalign."):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def warn(message: str, category: type[Warning] = PointalignWarning,
         stacklevel: int | None = 2) -> None:
    """Issue ``warnings.warn(message, category)`` pointing at the caller's caller.

    Args:
        message: one sentence saying what happens and what to do about it.
        category: a :class:`PointalignWarning` subclass.
        stacklevel: as in :func:`warnings.warn`, counted from the function calling this one
            (2: the user's line that called the public function); None: the first frame
            outside pointalign (:func:`user_stacklevel`).

    """
    logger.debug("warning (%s): %s", category.__name__, message)
    if _QUIET.get():  # quiet: progress and pointalign's warnings are both off
        return
    if stacklevel is None:
        warnings.warn(message, category, stacklevel=user_stacklevel())
        return
    warnings.warn(message, category, stacklevel=stacklevel + 1)


def warn_ignored(parameter: str, method: str, reason: str = "",
                 stacklevel: int | None = 2) -> None:
    """Warn that ``parameter`` was given but ``method`` does not use it.

    ``stacklevel``: as in :func:`warn` (None: the user's line).
    """
    tail = f" ({reason})" if reason else ""
    warn(f"{parameter} is ignored by {method}{tail}", IgnoredParameterWarning,
         stacklevel=None if stacklevel is None else stacklevel + 1)


#: a call expected to take longer than this (seconds) gets a :class:`SlowOperationWarning`
SLOW_SECONDS = 60.0


def warn_slow(what: str, seconds: float, advice: str, stacklevel: int = 2) -> bool:
    """Warn that ``what`` will take about ``seconds`` when that exceeds :data:`SLOW_SECONDS`.

    Args:
        what: the operation ("register() on 3,000,000 + 2,900,000 points on the CPU").
        seconds: a rough estimate (order of magnitude is enough).
        advice: what to do instead ("pass icp_voxel_size=...").
        stacklevel: as in :func:`warn`.

    Returns:
        True when the warning was issued (or would have been, without quiet).

    """
    if not (seconds > SLOW_SECONDS):
        return False
    minutes = seconds / 60.0
    warn(f"{what} will take about {minutes:.0f} minute{'s' if minutes >= 1.5 else ''}; "
         f"{advice}", SlowOperationWarning, stacklevel=stacklevel + 1)
    return True


#: work expected to take longer than this (seconds) says so before it starts (:func:`announce`)
ANNOUNCE_SECONDS = 5.0


def describe_seconds(seconds: float) -> str:
    """``"about 40 s"``, ``"about 3 minutes"``: a rough duration in words."""
    if seconds < 90:
        return f"about {max(1, round(seconds)):.0f} s"
    return f"about {seconds / 60:.0f} minutes"


def announce(what: str, seconds: float | None, advice: str = "",
             stacklevel: int | None = None) -> bool:
    """Say before it starts that ``what`` will take about ``seconds``, when that is long.

    Above :data:`ANNOUNCE_SECONDS`: an ``INFO`` log line, and on a terminal where progress
    is drawn (:func:`enabled`) a line on standard error (above any bar on screen); above
    :data:`SLOW_SECONDS` also a :class:`SlowOperationWarning` (:func:`warn_slow`) with
    ``advice``. Nothing for a short call, or where ``seconds`` is None (no estimate, e.g.
    on a GPU).

    Args:
        what: the operation ("ICP on 5,000,000 points on the CPU (2 threads)").
        seconds: the estimate (a cost model's: within 2× on the machines it was measured
            on).
        advice: what to do instead, for the warning.
        stacklevel: as in :func:`warn` (None: the user's line).

    Returns:
        True when the call was announced.

    """
    if seconds is None or not seconds > ANNOUNCE_SECONDS:
        return False
    text = f"{what}: {describe_seconds(seconds)}"
    logger.info("%s", text)
    if seconds > SLOW_SECONDS:
        warn(f"{what} will take {describe_seconds(seconds)}; {advice}" if advice else
             f"{what} will take {describe_seconds(seconds)}", SlowOperationWarning,
             stacklevel=None if stacklevel is None else stacklevel + 1)
    elif enabled():
        console = live_console()
        if console is None:
            from rich.console import Console

            console = Console(stderr=True)
        console.print(f"pointalign: {text}", markup=False, highlight=False)
    return True


def log_timings(name: str, timings: dict[str, float]) -> None:
    """Log one ``DEBUG`` line with the stage timings (seconds) of ``name``'s last call."""
    log = get_logger(name)
    if not log.isEnabledFor(logging.DEBUG):
        return
    parts = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in timings.items() if k != "total")
    total = timings.get("total")
    head = f"total {1e3 * total:.1f} ms" if total is not None else "stages (ms)"
    log.debug("%s: %s: %s", name, head, parts)


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


# The one rich Progress on screen, shared by every open bar (rich allows one live display):
# started by the first bar that shows, stopped when the last one closes, whatever the order
# in which nested (or lazily shown) bars open and close. "placeholders": the task ids of
# placeholder bars, hidden while "counted" (other) bars are on screen.
_SHARED: dict[str, Any] = {"progress": None, "bars": 0, "placeholders": set(), "counted": 0}

#: seconds a library call runs before its bar appears (``task(..., delay=LIBRARY_DELAY)``)
LIBRARY_DELAY = 1.0


_LOCK = threading.RLock()  # a delayed bar is shown from a timer thread


def live_console() -> Any:
    """Return the console of the progress display on screen, or None when no bar is drawn.

    Text printed through it appears above the bars (rich redraws them below), so an
    application's messages never land inside a progress line.
    """
    with _LOCK:
        prog = _SHARED["progress"]
        return None if prog is None else prog.console


def _show_placeholders(prog: Any) -> None:
    """Show placeholder bars only while no other bar is on screen."""
    visible = _SHARED["counted"] == 0
    for tid in _SHARED["placeholders"]:
        prog.update(tid, visible=visible)


def _open_bar(description: str, total: float | None, completed: float,
              placeholder: bool = False) -> tuple[Any, Any]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    class _Count(MofNCompleteColumn):  # type: ignore[misc]
        """``done/total`` for a bar, nothing for a spinner (no ``0/?``)."""

        def render(self, task: Any) -> Any:
            from rich.text import Text

            return super().render(task) if task.total is not None else Text("")

    with _LOCK:
        if _SHARED["progress"] is None:
            from rich.console import Console

            prog = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                            _Count(), TimeElapsedColumn(), TimeRemainingColumn(),
                            transient=True, console=Console(stderr=True))
            prog.start()
            _SHARED["progress"] = prog
        _SHARED["bars"] += 1
        prog = _SHARED["progress"]
        tid = prog.add_task(description, total=total, completed=completed)
        if placeholder:
            _SHARED["placeholders"].add(tid)
        else:
            _SHARED["counted"] += 1
        _show_placeholders(prog)
        return prog, tid


def _close_bar(prog: Any, task_id: Any) -> None:
    with _LOCK:
        prog.remove_task(task_id)
        if task_id in _SHARED["placeholders"]:
            _SHARED["placeholders"].discard(task_id)
        else:
            _SHARED["counted"] -= 1
        _SHARED["bars"] -= 1
        if _SHARED["bars"] <= 0:
            _SHARED.update(progress=None, bars=0, placeholders=set(), counted=0)
            prog.stop()
        else:
            _show_placeholders(prog)


class _Bar:
    """A bar on the shared display; with ``delay`` it appears only once the work runs long.

    Until ``delay`` seconds have passed since it was opened, ``advance``/``update`` only
    count; a daemon timer then puts the bar on screen with the counts so far (so a spinner
    appears even when nothing advances it). A call that ends sooner draws nothing.
    """

    def __init__(self, description: str, total: float | None, delay: float,
                 placeholder: bool = False) -> None:
        self._desc, self._total, self._done = description, total, 0.0
        self._placeholder = placeholder
        self._p: Any = None
        self._id: Any = None
        self._closed = False
        self._timer: threading.Timer | None = None
        if delay <= 0:
            self._show()
        else:
            self._timer = threading.Timer(delay, self._show)
            self._timer.daemon = True
            self._timer.start()

    def _show(self) -> None:
        with _LOCK:
            if self._p is None and not self._closed:
                self._p, self._id = _open_bar(self._desc, self._total, self._done,
                                              self._placeholder)

    def advance(self, n: float = 1) -> None:
        """Count ``n`` more steps done."""
        with _LOCK:
            self._done += n
            if self._p is not None:
                self._p.advance(self._id, n)

    def update(self, **fields: Any) -> None:
        """Change ``description``/``total``/``completed`` of the bar."""
        with _LOCK:
            self._desc = fields.get("description", self._desc)
            self._total = fields.get("total", self._total)
            self._done = fields.get("completed", self._done)
            if self._p is not None:
                self._p.update(self._id, **fields)

    @property
    def shown(self) -> bool:
        """Whether the bar is on screen (False while it waits for its ``delay``)."""
        return self._p is not None

    def close(self) -> None:
        """Take the bar off the display (the display stops with its last bar)."""
        if self._timer is not None:
            self._timer.cancel()
        with _LOCK:
            self._closed = True
            if self._p is not None:
                _close_bar(self._p, self._id)
                self._p = None


@contextlib.contextmanager
def task(description: str, total: float | None = None, *, quiet: bool | None = None,
         delay: float = 0.0, placeholder: bool = False) -> Iterator[_Bar | _NoBar]:
    """Show a progress bar for a block of work; yields an object with ``advance(n)``.

    Args:
        description: short text in front of the bar ("EM-ICP", "reading files").
        total: number of steps (None: an indeterminate spinner).
        quiet: True: draw nothing; None: follow :func:`set_quiet` / the terminal test.
        delay: seconds of work before the bar appears; library calls pass
            :data:`LIBRARY_DELAY`, so that only long calls show a bar.
        placeholder: a spinner for work whose own bars (with counts) may appear inside it
            (the CLI's "registering (icp)" around ``icp()``): hidden while any other bar
            is on screen, shown again when they close, so the screen shows the counted
            bar rather than a bare spinner.

    """
    if not enabled(quiet):
        yield _NoBar()
        return
    bar = _Bar(description, total, delay, placeholder)
    try:
        yield bar
    finally:
        bar.close()


def track(iterable: Iterable[T], description: str, total: float | None = None, *,
          quiet: bool | None = None, delay: float = 0.0) -> Iterator[T]:
    """Yield the items of ``iterable`` while advancing a progress bar (see :func:`task`)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    with task(description, total, quiet=quiet, delay=delay) as bar:
        for item in iterable:
            yield item
            bar.advance()


def batches(total: int, size: int, description: str, *,
            delay: float = LIBRARY_DELAY) -> Iterator[int]:
    """Yield batch sizes ``min(size, left)`` until ``total`` steps are covered, with a bar.

    For library loops over batches (RANSAC hypotheses): ``for h in batches(n, b, "RANSAC")``
    replaces a ``while`` loop; the bar (shown after ``delay`` seconds) advances by each
    batch once the loop body asks for the next one. A ``break`` closes the bar when the
    generator is released (at once in CPython).
    """
    with task(description, total, delay=delay) as bar:
        done = 0
        while done < total:
            step = min(size, total - done)
            yield step
            done += step
            bar.advance(step)


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
