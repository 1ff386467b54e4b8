"""The one place that decides how a kernel family runs.

``backend(tensor)`` returns:

* ``"triton"`` for CUDA tensors when Triton imports;
* ``"interpret"`` when ``TRITON_INTERPRET=1`` is set and Triton imports (the Triton
  kernels run on the CPU through Triton's interpreter: slow, used by CI to test them);
* ``"cpu"`` for CPU tensors when numba imports: the fast CPU kernels (``_X_cpu.py``:
  numba loops with all cores, see :mod:`pointalign._threads`) where a family has one, the
  PyTorch reference otherwise;
* ``"torch"`` otherwise (the plain PyTorch references, which the tests compare against).

``POINTALIGN_BACKEND=torch|cpu|triton|interpret`` overrides the choice (``triton`` on a CPU
tensor is an error; ``cpu`` applies to CPU tensors only, CUDA tensors keep Triton).
Triton is imported lazily, only when a Triton path is taken.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from pointalign.kernels import _numba

BACKENDS = ("torch", "cpu", "triton", "interpret")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Tell whether ``import triton`` works."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


@functools.lru_cache(maxsize=1)
def cpu_available() -> bool:
    """Return True when the CPU kernels' compiler (numba) imports."""
    return _numba.available()


def backend(x: torch.Tensor | None = None) -> str:
    """Name of the backend a kernel family should use for tensors like ``x``."""
    forced = os.environ.get("POINTALIGN_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"POINTALIGN_BACKEND must be one of {BACKENDS}, got {forced!r}")
        if forced == "triton" and (x is None or not x.is_cuda):
            raise ValueError("POINTALIGN_BACKEND=triton needs CUDA tensors")
        if forced in ("triton", "interpret") and not triton_available():
            raise ValueError(f"POINTALIGN_BACKEND={forced} but Triton is not installed")
        if forced == "cpu":
            if not cpu_available():
                raise ValueError("POINTALIGN_BACKEND=cpu but numba is not installed")
            if x is not None and x.is_cuda:
                return "triton" if triton_available() else "torch"
        return forced
    if x is not None and x.is_cuda and triton_available():
        return "triton"
    if os.environ.get("TRITON_INTERPRET") == "1" and triton_available():
        return "interpret"
    if (x is None or x.device.type == "cpu") and cpu_available():
        return "cpu"  # numba is imported (and heard) when a CPU kernel's module is
    return "torch"


class SearchPlan(NamedTuple):
    """What the kernel layer offers nearest-neighbour search for points on one device.

    Exported as ``pointalign.kernels.SearchPlan``; :mod:`pointalign.search.policy` turns it
    into the choice of index and of the fine grid tiers, and never looks at devices or
    backends itself.

    Attributes:
        host_tree: the points live in host memory, where SciPy's cKDTree (built and queried
            on all cores) is the fastest exact search; the fused kernels do not run there
            (except through the slow Triton interpreter).
        fused: the Triton search kernels run for these points (CUDA, or the interpreter
            under ``TRITON_INTERPRET=1``): brute force, the voxel grid and the k-d tree are
            single fused kernels whose cost follows the work per query, so fine grids in
            front of an index ("tiers") can pay; with the PyTorch references they do not.

    """

    host_tree: bool
    fused: bool


def search_plan(points: torch.Tensor) -> SearchPlan:
    """Return the :class:`SearchPlan` for ``points (M, 3)`` (reads their device only; no sync)."""
    return SearchPlan(host_tree=points.device.type == "cpu",
                      fused=backend(points) in ("triton", "interpret"))


def upload(values: Sequence[float] | np.ndarray, *, dtype: torch.dtype,
           device: torch.device | str) -> torch.Tensor:
    """Copy a host list (or NumPy array) to ``device`` as a ``dtype`` tensor of its shape.

    On a GPU the values go through page-locked memory, so the copy is enqueued without
    waiting for the device (from pageable memory CUDA first synchronises the stream); stream
    order keeps every later kernel behind it, and PyTorch's pinned-memory cache keeps the
    buffer until the copy is done. On the CPU it is a plain tensor.
    """
    host = (torch.from_numpy(values).to(dtype) if isinstance(values, np.ndarray)
            else torch.tensor(list(values), dtype=dtype))
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def describe() -> dict[str, str]:
    """Backend chosen for CPU and (if present) CUDA tensors; used by ``pointalign info``."""
    out = {"cpu": backend(torch.empty(0))}
    if torch.cuda.is_available():
        out["cuda"] = backend(torch.empty(0, device="cuda"))
    return out
