"""CPU (numba) kernel of the grid family: the Morton order (:func:`.morton_order`).

:func:`_morton_codes` computes :func:`.reference.morton_codes_reference`'s codes in one pass
(the same operations in the points' dtype: a difference, a division and a product, each
rounded once, then the truncation), and a stable NumPy sort orders them.
"""

from __future__ import annotations

import numpy as np
import torch

from pointalign.kernels._numba import njit


@njit(cache=True, inline="always")
def _spread(v):
    """Spread the low 10 bits of ``v`` (int64) two bits apart (bit b to bit 3b)."""
    v = (v | (v << 16)) & 0x030000FF
    v = (v | (v << 8)) & 0x0300F00F
    v = (v | (v << 4)) & 0x030C30C3
    return (v | (v << 2)) & 0x09249249


@njit(cache=True)
def _morton_codes(pts, out):
    """Write the 30-bit Morton codes of ``pts (N, 3)`` (float32/float64) to ``out (N,)``."""
    n = pts.shape[0]
    lo = np.empty(3, pts.dtype)
    hi = np.empty(3, pts.dtype)
    for d in range(3):
        lo[d] = pts[0, d]
        hi[d] = pts[0, d]
    for i in range(n):
        for d in range(3):
            x = pts[i, d]
            lo[d] = min(lo[d], x)
            hi[d] = max(hi[d], x)
    span = max(hi[0] - lo[0], hi[1] - lo[1], hi[2] - lo[2], pts.dtype.type(1e-30))
    scale = pts.dtype.type(1023)
    for i in range(n):
        code = np.int64(0)
        for d in range(3):
            x = min(max((pts[i, d] - lo[d]) / span * scale, pts.dtype.type(0)), scale)
            code |= _spread(np.int64(x)) << d
        out[i] = code


def morton_order_cpu(points: torch.Tensor) -> torch.Tensor:
    """Return the ``(N,)`` int64 permutation of float32/float64 ``points (N, 3)`` by code."""
    p = points.detach().contiguous().numpy()
    codes = np.empty(p.shape[0], np.int32)
    if p.shape[0]:
        _morton_codes(p, codes)
    return torch.from_numpy(np.argsort(codes, kind="stable"))
