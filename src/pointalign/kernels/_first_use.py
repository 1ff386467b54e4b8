"""The public methods' first call on a machine: compilers announced or run ahead.

:func:`first_use` decorates each public method with the warm-up steps it needs
(:func:`pointalign._warmup.warmup`'s names). On a CPU, numba's compiles during the call are
announced with their estimate and counted on a bar (:func:`pointalign.kernels._numba.first_use`);
on a GPU, the step's Triton kernels missing from the disk cache are compiled side by side
before the call (:func:`pointalign.kernels._precompile.ensure`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from pointalign.kernels import _numba, _precompile

P = ParamSpec("P")
R = TypeVar("R")

_depth = [0]  # public calls in progress (register() calls icp(): its kernels are register's)


def _device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Return the call's compute device as the method resolves it (None: it cannot)."""
    from pointalign import _validate

    try:
        return _validate.resolve_device(kwargs.get("device"), source=args[0] if args else None)
    except Exception:  # the method reports bad input itself
        try:
            return _validate.resolve_device(kwargs.get("device"))
        except Exception:
            return None


def first_use(*steps: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a public method whose first call on a machine compiles the warm-up ``steps``."""
    def deco(fn: Callable[P, R]) -> Callable[P, R]:
        inner = _numba.first_use(*steps)(fn)

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if not _depth[0] and steps not in _precompile._done:
                _precompile.ensure(steps, _device(args, kwargs))
            _depth[0] += 1  # a nested public call: the outer step's manifest covers it
            try:
                return inner(*args, **kwargs)
            finally:
                _depth[0] -= 1
        return wrapper
    return deco
