"""The numba shim of the CPU kernels: ``njit``, ``prange`` and ``available()``.

Every ``kernels/<family>/cpu.py`` imports its decorators from here, so a machine without
numba still imports the package (the decorators become no-ops and ``available()`` is
False: the dispatchers then take the PyTorch references).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

#: numba's parallel passes for ``parallel=True`` kernels: the explicit ``prange`` loops
#: only. With plain ``parallel=True`` numba also turns every array expression, ``np.full``/
#: ``np.zeros``/``np.arange`` call and slice assignment outside them into a parallel loop
#: of its own (each lowered and compiled as a separate function); ours are small buffers,
#: filled serially just as fast, and element by element the values are the same.
PARALLEL = {"prange": True, "fusion": False, "numpy": False, "setitem": False,
            "inplace_binop": False, "comprehension": False, "reduction": False,
            "stencil": False}


@functools.cache
def _load() -> Any:
    """Import numba on first need (None where it does not import) and listen to it.

    ``import pointalign`` does not import numba (a quarter of a second and more): the CPU
    kernels' modules import it when a CPU kernel is first dispatched (their decorators call
    :func:`njit`), so a GPU-only process never pays for it. The ``numba:compile`` listener
    (:func:`listen`) is installed with it: whatever compiles is announced.
    """
    try:
        import numba
    except Exception:  # pragma: no cover - numba missing: the "cpu" backend is unavailable
        return None
    _listen(numba)
    return numba


def njit(*args: Any, **kwargs: Any) -> Any:
    """``numba.njit``, with ``parallel=True`` meaning :data:`PARALLEL` (a no-op without numba)."""
    nb = _load()
    if nb is None:  # pragma: no cover
        return (lambda f: f) if not (args and callable(args[0])) else args[0]
    if kwargs.get("parallel") is True:
        kwargs["parallel"] = dict(PARALLEL)  # numba consumes the dict
    return nb.njit(*args, **kwargs)


def __getattr__(name: str) -> Any:
    """``prange``: numba's, imported with it (``range`` without numba)."""
    if name == "prange":
        nb = _load()
        return range if nb is None else nb.prange
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def available() -> bool:
    """Return True when numba is installed (the CPU kernels need it); nothing is imported."""
    return importlib.util.find_spec("numba") is not None


#: what each warm-up step (:func:`pointalign._warmup._steps`) compiles on an empty cache,
#: kernel by kernel: ``[kernel, argument types, compiler CPU seconds]`` measured on the
#: 2-core development machine (``benchmarks/bench_first_call_cpu.py --compile-table
#: --manifest`` writes it). The warm-up compiles these side by side; a first use estimates
#: its compile time from the ones not yet in numba's cache.
MANIFEST = Path(__file__).with_name("compile_manifest.json")

_announced = False  # this process said that numba compiles (once)
_silent = False  # pointalign warmup: its own bar says it


@functools.cache
def manifest() -> dict[str, list[tuple[str, str, float]]]:
    """Return :data:`MANIFEST`: per warm-up step, ``(kernel, argument types, seconds)``."""
    try:
        doc = json.loads(MANIFEST.read_text())
        return {step: [(str(k), str(a), float(sec)) for k, a, sec in rows]
                for step, rows in doc.items()}
    except (OSError, ValueError, TypeError):  # pragma: no cover - broken: no estimates
        return {}


def dispatcher(kernel: str) -> Any:
    """``"knn.cpu._nearest"`` -> its numba dispatcher (None: not one, or not found)."""
    nb = _load()
    if nb is None:  # pragma: no cover
        return None
    module, _, name = kernel.rpartition(".")
    try:
        mod = importlib.import_module(f"pointalign.kernels.{module}")
    except ImportError:
        return None
    d = getattr(mod, name, None)
    if not isinstance(d, nb.core.dispatcher.Dispatcher):  # one built with its signatures
        d = getattr(mod, "_TYPED", {}).get(name)  # its lazy twin (the same cache entries)
    return d if isinstance(d, nb.core.dispatcher.Dispatcher) else None


_LITERAL = re.compile(r"^Literal\[(bool|int)\]\((.+)\)$")
_ARRAY = re.compile(r"^(readonly )?array\((\w+), (\d+)d, ([CFA])\)$")


def _scalar(name: str) -> Any:
    from numba.core import types

    t = types.boolean if name == "bool" else getattr(types, name, None)
    return t if isinstance(t, (types.Number, types.Boolean)) else None


def signature(args: str) -> tuple[Any, ...] | None:
    """Numba types from their printed list (``"array(float32, 2d, C), int64"``); None: other."""
    if _load() is None:  # pragma: no cover
        return None
    from numba.core import types

    out: list[Any] = []
    for part in re.split(r", (?![^()]*\))", args) if args else []:
        lit = _LITERAL.match(part)  # a constant argument numba typed by its value
        if lit:
            value = {"True": True, "False": False}.get(lit[2]) if lit[1] == "bool" else \
                int(lit[2]) if lit[1] == "int" and lit[2].lstrip("-").isdigit() else None
            if value is None:
                return None
            out.append(types.literal(value))
            continue
        m = _ARRAY.match(part)
        t = _scalar(m[2] if m else part)
        if t is None:
            return None
        out.append(types.Array(t, int(m[3]), m[4], readonly=bool(m[1]))  # type: ignore[arg-type]
                   if m else t)
    return tuple(out)


def _same(sig: Any, args: str) -> bool:
    return ", ".join(str(t) for t in sig) == args


def is_cached(kernel: str, args: str) -> bool:
    """Whether ``kernel`` for ``args`` is loaded in this process or in numba's disk cache."""
    d = dispatcher(kernel)
    if d is None:
        return False
    if any(_same(sig, args) for sig in d.overloads):
        return True
    try:  # numba's index of the kernel's cached signatures (empty when its source changed)
        index = d._cache._cache_file._load_index()
    except Exception:  # pragma: no cover - another numba's layout: count it as missing
        return False
    return any(_same(key[0], args) for key in index)


def pending(steps: Sequence[str]) -> list[tuple[str, str, float]]:
    """Return the kernels of the warm-up ``steps`` numba would compile now, longest first."""
    seen: dict[tuple[str, str], float] = {}
    table = manifest()
    for step in steps:
        for kernel, args, sec in table.get(step, []):
            if (kernel, args) in seen or dispatcher(kernel) is None:
                continue  # a kernel given its signature when built (horn's): not tracked
            if not is_cached(kernel, args):
                seen[(kernel, args)] = sec
    return sorted(((k, a, s) for (k, a), s in seen.items()), key=lambda r: -r[2])


# ------------------------------------------------------------- first use: announce, bar


class _Scope:
    """A public call in progress: its warm-up steps, and the bar once it compiles."""

    def __init__(self, steps: tuple[str, ...]) -> None:
        self.steps = steps
        self.bar: Any = None
        self.cm: Any = None


_scope: list[_Scope] = []  # the outermost public call in progress (nested calls: not again)
_depth = [0]  # numba:compile events open (a kernel's helpers compile inside it)
_listening = False


_compiled = [0]  # kernels of this package compiled in this process (top-level events)


def compiles() -> int:
    """Return how many of this package's kernels numba compiled in this process so far.

    Counted once :func:`listen` is installed (the CPU backend's first use installs it);
    loads from the cache are not compiles.
    """
    listen()
    return _compiled[0]


def _on_start(ev: Any) -> None:
    _depth[0] += 1
    if _depth[0] != 1:
        return
    f = getattr(ev.data.get("dispatcher"), "py_func", None)
    if not getattr(f, "__module__", "").startswith("pointalign."):
        return
    _compiled[0] += 1
    if _silent:
        return
    scope = _scope[0] if _scope else None
    if scope is not None and scope.cm is None:
        _open(scope)
    elif scope is None:
        _announce(None)


def _on_end(ev: Any) -> None:
    _depth[0] = max(0, _depth[0] - 1)
    if _depth[0] == 0 and _scope and _scope[0].bar is not None:
        _scope[0].bar.advance()


def listen() -> None:
    """Import numba (:func:`_load`), which installs the ``numba:compile`` listener."""
    _load()


def _listen(numba: Any) -> None:
    """Install the ``numba:compile`` listener (once per process) that announces compiles."""
    global _listening
    if _listening:
        return
    _listening = True
    from numba.core import event

    listener = type("_Listener", (event.Listener,), {
        "on_start": lambda self, ev: _on_start(ev), "on_end": lambda self, ev: _on_end(ev)})
    event.register("numba:compile", listener())


def _user_stacklevel() -> int:
    """Return the ``stacklevel`` of the user's line for :func:`_announce`'s warning.

    The frame that called pointalign's outermost frame (not numba's, which runs the event).
    """
    frame, level, last = sys._getframe(1), 1, 1
    while frame is not None:
        if (frame.f_globals.get("__name__", "") + ".").startswith("pointalign."):
            last = level
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return last + 1


def _announce(todo: list[tuple[str, str, float]] | None) -> None:
    """Say that numba compiles now, with the estimate of ``todo`` where there is one.

    A public method's call says so when ``todo`` takes above
    :data:`~pointalign._progress.ANNOUNCE_SECONDS`; a call outside the methods the warm-up
    knows (``todo`` None) once per process, without an estimate.
    """
    global _announced
    from pointalign import _progress

    if todo is not None:
        seconds = sum(s for _, _, s in todo)
        if not seconds > _progress.ANNOUNCE_SECONDS:
            return
        what = (f"{len(todo)} CPU kernel{'s' if len(todo) > 1 else ''} for this call "
                f"({_progress.describe_seconds(seconds)} on the 2-core machine where it was "
                "measured)")
    elif _announced:
        return
    else:
        what = "the CPU kernels this call needs (typically 1-4 s each on 2 cores)"
    _announced = True
    _progress.warn(
        f"first use on this machine: numba compiles {what} now, once (later processes "
        "load them from its cache; `pointalign warmup --all` compiles every method's "
        "kernels ahead of time)", _progress.SlowOperationWarning,
        stacklevel=_user_stacklevel())


def _open(scope: _Scope) -> None:
    from pointalign import _progress

    todo = pending(scope.steps)
    _announce(todo)
    scope.cm = _progress.task("compiling CPU kernels (numba, once)", total=len(todo) or None,
                              delay=_progress.LIBRARY_DELAY)
    scope.bar = scope.cm.__enter__()


P = ParamSpec("P")
R = TypeVar("R")


def first_use(*steps: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a public method whose first call on a machine compiles the warm-up ``steps``.

    Where numba compiles during the call (its kernels are not cached yet), the call says so
    once, with the estimate of :func:`pending`, and shows a bar counting the kernels;
    nothing happens where they load from the cache. A nested public call is covered by the
    outer one's.
    """
    def deco(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if _scope or not available():
                return fn(*args, **kwargs)
            scope = _Scope(steps)
            _scope.append(scope)
            try:
                return fn(*args, **kwargs)
            finally:
                _scope.pop()
                if scope.cm is not None:
                    scope.cm.__exit__(None, None, None)
        return wrapper
    return deco


def cache_dirs() -> list[Path]:
    """Return the folders where numba keeps (or would keep) this package's kernels.

    numba picks, per source folder, the first of: ``NUMBA_CACHE_DIR`` (a subfolder named
    after the source folder and a hash of its path), ``__pycache__`` beside the source when
    that is writable (an editable or user installation), else its user-wide cache
    (``~/.cache/numba`` on Linux, with the same subfolder naming): a package installed into
    a read-only ``site-packages`` still caches, and every later process of the same user
    finds the kernels there. One folder per kernel folder of this package, in numba's order.
    """
    import os

    here = Path(__file__).resolve().parent
    folders = [here] + sorted(p for p in here.iterdir()
                              if p.is_dir() and not p.name.startswith("__"))
    if _load() is None:  # pragma: no cover
        return []
    from numba.core import config
    from numba.core.caching import _CacheLocator
    from numba.misc.appdirs import AppDirs

    user = os.environ.get("NUMBA_CACHE_DIR") or getattr(config, "CACHE_DIR", "")
    out: list[Path] = []
    for folder in folders:
        sub = _CacheLocator.get_suitable_cache_subpath(str(folder / "cpu.py"))
        if user:
            out.append(Path(user) / sub)
        elif os.access(folder, os.W_OK):
            out.append(folder / "__pycache__")
        else:
            out.append(Path(AppDirs(appname="numba", appauthor=False).user_cache_dir) / sub)
    return out


def cached_kernels() -> int:
    """Count the compiled kernels numba's cache holds for this package (index files)."""
    return sum(1 for d in cache_dirs() if d.is_dir() for _ in d.glob("*.nbi"))
