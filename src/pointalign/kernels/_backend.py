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

import torch

BACKENDS = ("torch", "cpu", "triton", "interpret")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when ``import triton`` works."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


@functools.lru_cache(maxsize=1)
def cpu_available() -> bool:
    """Return True when the CPU kernels' compiler (numba) imports."""
    from pointalign.kernels import _knn_cpu

    return _knn_cpu.available()


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
        return "cpu"
    return "torch"


def describe() -> dict[str, str]:
    """Backend chosen for CPU and (if present) CUDA tensors; used by ``pointalign info``."""
    out = {"cpu": backend(torch.empty(0))}
    if torch.cuda.is_available():
        out["cuda"] = backend(torch.empty(0, device="cuda"))
    return out
