"""How many CPU threads pointalign uses (PyTorch, the numba CPU kernels, SciPy's workers).

Default: ``POINTALIGN_NUM_THREADS`` if set, else ``OMP_NUM_THREADS`` if set, else all cores
(``os.cpu_count()``, or the CPUs this process may run on where the OS says). The setting is
applied lazily: to numba when a CPU kernel first runs, to PyTorch at once when
:func:`set_num_threads` is called (at import only when one of the variables is set, so that
importing pointalign does not change a user's own ``torch.set_num_threads``).

    import pointalign as pa
    pa.set_num_threads(1)   # share the machine
    pa.get_num_threads()    # -> 1

Per call (small_gicp's habit): the CPU-heavy public functions take ``num_threads=`` (None:
the setting above), which runs that call under :func:`threads`::

    pa.icp(source, target, max_correspondence_distance=0.05, num_threads=4)
    with pa.threads(1):   # a block of calls
        ...

Waiting threads sleep: unless ``OMP_WAIT_POLICY`` is set, importing pointalign before
PyTorch sets it to ``PASSIVE`` (the OpenMP runtime reads it when it loads, with PyTorch).
PyTorch's OpenMP workers and numba's pool otherwise spin between parallel regions, and
register()'s many short PyTorch operations between numba kernels left both pools spinning
against each other: on the shared 2-core machine, ``register`` on the bunny pair with 2
threads took 1.1-4.8 s of CPU per call (2-4 s typical) against 0.77-0.95 s with ``PASSIVE``
(load 2.7-2.9; see ``benchmarks/bench_cpu.py``). Set ``OMP_WAIT_POLICY=ACTIVE`` to keep
spinning; when PyTorch was imported first, the runtime has read its setting already and
pointalign leaves it alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

if "OMP_WAIT_POLICY" not in os.environ and "torch" not in sys.modules:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

_ENV = ("POINTALIGN_NUM_THREADS", "OMP_NUM_THREADS")
_n: int | None = None


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _from_env() -> int | None:
    for name in _ENV:
        v = os.environ.get(name, "").strip()
        if v:
            try:
                n = int(v.split(",")[0])
            except ValueError:
                raise ValueError(f"{name}: expected a positive integer, got {v!r}") from None
            if n < 1:
                raise ValueError(f"{name}: expected a positive integer, got {v!r}")
            return n
    return None


#: the thread count of the innermost :func:`threads` block in this context (None: none)
_CALL: contextvars.ContextVar[int | None] = contextvars.ContextVar("pointalign_threads",
                                                                  default=None)


def get_num_threads() -> int:
    """Threads the CPU kernels use (see the module docstring for the default)."""
    n = _CALL.get()
    if n is not None:
        return n
    if _n is not None:
        return _n
    env = _from_env()
    return env if env is not None else _cores()


def set_num_threads(n: int | None) -> None:
    """Use ``n`` threads (>= 1) in PyTorch, the numba kernels and SciPy; None: the default.

    Args:
        n: number of threads, or None to go back to the environment / all cores.

    """
    global _n
    if n is not None:
        from pointalign import _validate

        n = _validate.integer(n, "n", minimum=1)
    _n = n
    _apply_torch()


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` CPU threads (PyTorch, the numba kernels, SciPy), then restore.

    The per-call form of :func:`set_num_threads` (small_gicp's ``num_threads=``): inside the
    block :func:`get_num_threads` is ``n`` in this context (thread, task), PyTorch's count
    is set to ``n``, and the numba kernels take it when they run; on exit PyTorch's and
    numba's previous counts come back (PyTorch's count is one per process: blocks in
    concurrent threads share it). ``n=None``: nothing changes.

    Args:
        n: threads (>= 1), or None.

    """
    if n is None:
        yield
        return
    from pointalign import _validate

    n = _validate.integer(n, "num_threads", minimum=1)
    import torch

    token = _CALL.set(n)
    before = torch.get_num_threads()
    numba_before = None
    if _numba_launched:
        import numba

        numba_before = numba.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        _CALL.reset(token)
        torch.set_num_threads(before)
        if numba_before is not None:
            import numba

            numba.set_num_threads(numba_before)


def per_call(fn: F) -> F:
    """Add the keyword ``num_threads=None`` to a public function: the call runs in :func:`threads`.

    The signature shown by ``help()`` and :func:`inspect.signature` gains the parameter
    (keyword-only, before ``**kwargs`` where the function has them).
    """
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    extra = inspect.Parameter("num_threads", inspect.Parameter.KEYWORD_ONLY, default=None,
                              annotation="int | None")
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD),
              len(params))
    params.insert(at, extra)

    @functools.wraps(fn)
    def wrapper(*args: Any, num_threads: int | None = None, **kwargs: Any) -> Any:
        if num_threads is None:
            return fn(*args, **kwargs)
        with threads(num_threads):
            return fn(*args, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def _apply_torch() -> None:
    import torch

    torch.set_num_threads(get_num_threads())


_numba_launched = False


def _launch_numba() -> None:
    """Start numba's thread pool once, keeping PyTorch's thread count.

    numba's OpenMP threading layer shares the OpenMP runtime with PyTorch, and starting its
    pool sets that runtime's thread count to numba's pool size: without this, the first CPU
    kernel silently undid ``set_num_threads`` (or the user's ``torch.set_num_threads``).
    """
    global _numba_launched
    if _numba_launched:
        return
    import torch
    from numba.np.ufunc import parallel

    before = torch.get_num_threads()
    parallel._launch_threads()
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)
    _numba_launched = True


def numba_threads() -> int:
    """Set numba's thread count to :func:`get_num_threads` (capped by its pool); return it."""
    import numba

    _launch_numba()
    n = min(get_num_threads(), numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    return n


@contextlib.contextmanager
def torch_single() -> Iterator[None]:
    """Run PyTorch's CPU operations on one thread inside the block (numba keeps its count).

    For stretches of many small PyTorch operations between the numba kernels (the stages of
    ``register()``): an operation on a few thousand points gains nothing from a second
    thread, and on a loaded machine each parallel region waits for a descheduled worker at
    its barrier (a Morton sort of 40k points took 78 ms of wall time on 2 threads under
    load 2, 9 ms on one). The caller's thread count is restored on exit.
    """
    import torch

    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def host_threads(device: Any) -> int | None:
    """PyTorch's CPU threads when ``device`` is the host ("cpu"), else None.

    For estimates of CPU work (``register``'s announcement of a long call): None means the
    device runs the work itself (a GPU) and no CPU estimate applies.
    """
    import torch

    if torch.device(device).type != "cpu":
        return None
    return max(torch.get_num_threads(), 1)


def host_share() -> float:
    """Return the share of this machine's cores a CPU computation can expect now, in (0, 1].

    ``min(1, cores / load)`` with ``load`` the 1-minute load average (``os.getloadavg``;
    1 where the OS has none): on a machine shared with other work (a CI runner, a shared
    server) the kernels run slower by about that factor, and estimates of long work
    divide by it. Measured on the shared 2-core machine at load 4.3-4.8: CPU stages took
    2.2-2.4× their unloaded time, where this predicts 2.2×.
    """
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 1.0
    cores = _cores()
    return min(1.0, cores / max(load, cores, 1e-9))


def host_stages(device: Any) -> contextlib.AbstractContextManager[None]:
    """Return the context for a stretch of small PyTorch operations on ``device``.

    On the host ("cpu"): :func:`torch_single` (the numba kernels keep their threads); on a
    GPU, nothing (``contextlib.nullcontext``). ``register()`` runs its stages inside it, so
    the algorithm never asks which device it is on.
    """
    import torch

    if torch.device(device).type == "cpu":
        return torch_single()
    return contextlib.nullcontext()


def scipy_workers() -> int:
    """Return the ``workers=`` argument for SciPy calls (cKDTree queries)."""
    return get_num_threads()


if os.environ.get("POINTALIGN_NUM_THREADS", "").strip():
    _apply_torch()  # OMP_NUM_THREADS is read by PyTorch itself
