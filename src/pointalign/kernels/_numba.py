"""The numba shim of the CPU kernels: ``njit``, ``prange`` and ``available()``.

Every ``kernels/<family>/cpu.py`` imports its decorators from here, so a machine without
numba still imports the package (the decorators become no-ops and ``available()`` is
False: the dispatchers then take the PyTorch references).
"""

from __future__ import annotations

from pathlib import Path

try:
    import numba as _nb
except Exception:  # pragma: no cover - numba missing: the "cpu" backend is unavailable
    _nb = None  # type: ignore[assignment]

if _nb is not None:
    njit = _nb.njit
    prange = _nb.prange
else:  # pragma: no cover
    def njit(*a, **k):
        def deco(f):
            return f
        return deco if not (a and callable(a[0])) else a[0]

    prange = range  # type: ignore[misc]


def available() -> bool:
    """Return True when numba imports (the CPU kernels need it)."""
    return _nb is not None


#: seconds numba takes to compile the kernels a first register() needs in one process, on
#: the 2-core development machine (~124 signatures; 56 -> 52 s of compiler CPU under load
#: 10 in issue 23's paired runs, less when the machine is idle;
#: ``benchmarks/bench_first_call.py --compile-table`` lists them per kernel)
FIRST_COMPILE_S = 45

_announced = False


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
    if _nb is None:  # pragma: no cover
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


def announce_compile() -> None:
    """Say once per process, before the first CPU kernel runs, that numba compiles now.

    Only where numba's cache holds no kernel of this package (a fresh installation): the
    first call then spends about :data:`FIRST_COMPILE_S` seconds compiling, paid once per
    machine, and ``pointalign warmup`` does it ahead of time with a progress bar.
    """
    global _announced
    if _announced:
        return
    _announced = True
    if _nb is None or cached_kernels() > 0:
        return
    from pointalign import _progress

    _progress.warn(
        f"first use of pointalign's CPU kernels on this machine: numba compiles them now "
        f"(about {FIRST_COMPILE_S} s on 2 cores, once; later processes load them from its "
        "cache). `pointalign warmup --device cpu` does this ahead of time.",
        _progress.SlowOperationWarning, stacklevel=3)
