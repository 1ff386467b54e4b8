"""The numba shim of the CPU kernels: ``njit``, ``prange`` and ``available()``.

Every ``kernels/<family>/cpu.py`` imports its decorators from here, so a machine without
numba still imports the package (the decorators become no-ops and ``available()`` is
False: the dispatchers then take the PyTorch references).
"""

from __future__ import annotations

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
