"""CPU (numba) kernel of ``pca_normals``: covariance and closed-form eigenvector in one pass.

Same formulas as the reference (:func:`pointalign.kernels.features.pca_normals_reference`:
``kernels/features/reference.neighbour_covariances`` and ``smallest_eigenvector``), per point, with
no ``(N, K, 3)`` gather: the neighbourhood mean and covariance are accumulated in the
points' dtype in neighbour order (as the reference's sums), the eigen-solve in float64
by :func:`pointalign.kernels._nb_math.smallest_eigenvector3`, the numba twin of the spec's
(Smith's closed form, null vector as the largest cross product of two rows of A − λI,
the orthogonal fallback for a repeated smallest eigenvalue). Differences to the reference
come from the order of the covariance additions only (float32: ~1e-6 relative on the
covariance; the normals agree to ~1e-5 except where the smallest eigenvalue is nearly
repeated, where any unit vector of the plane is an answer).
"""

from __future__ import annotations

import numpy as np
import torch

from pointalign import _threads
from pointalign.kernels._nb_math import smallest_eigenvector3
from pointalign.kernels._numba import njit, prange


@njit(cache=True, parallel=True)
def _normals(pts, idx, centers, vp, use_vp, out):
    n, k = idx.shape
    for i in prange(n):
        z = pts[0, 0] - pts[0, 0]
        cnt = z
        m0, m1, m2 = z, z, z
        for j in range(k):
            p = idx[i, j]
            if p >= 0:
                cnt += 1
                m0 += pts[p, 0]
                m1 += pts[p, 1]
                m2 += pts[p, 2]
        c = max(cnt, z + 1)
        m0, m1, m2 = m0 / c, m1 / c, m2 / c
        s00, s01, s02, s11, s12, s22 = z, z, z, z, z, z
        for j in range(k):
            p = idx[i, j]
            if p >= 0:
                d0, d1, d2 = pts[p, 0] - m0, pts[p, 1] - m1, pts[p, 2] - m2
                s00 += d0 * d0
                s01 += d0 * d1
                s02 += d0 * d2
                s11 += d1 * d1
                s12 += d1 * d2
                s22 += d2 * d2
        a00, a01, a02 = np.float64(s00 / c), np.float64(s01 / c), np.float64(s02 / c)
        a11, a12, a22 = np.float64(s11 / c), np.float64(s12 / c), np.float64(s22 / c)
        (v0, v1, v2), _ = smallest_eigenvector3(a00, a01, a02, a11, a12, a22)
        o0, o1, o2 = out.dtype.type(v0), out.dtype.type(v1), out.dtype.type(v2)
        if use_vp:
            f = ((vp[0] - centers[i, 0]) * o0 + (vp[1] - centers[i, 1]) * o1
                 + (vp[2] - centers[i, 2]) * o2)
            if f < 0:
                o0, o1, o2 = -o0, -o1, -o2
        out[i, 0] = o0
        out[i, 1] = o1
        out[i, 2] = o2


def pca_normals_cpu(points: torch.Tensor, nbr_idx: torch.Tensor,
                    viewpoint: torch.Tensor | None, centers: torch.Tensor) -> torch.Tensor:
    """Return ``(Q, 3)`` unit normals (arguments as :func:`.features.pca_normals`)."""
    _threads.numba_threads()
    p = points.detach().contiguous().numpy()
    c = centers.detach().to(points.dtype).contiguous().numpy()
    vp = (np.zeros(3, p.dtype) if viewpoint is None
          else viewpoint.detach().to(points.dtype).contiguous().numpy())
    out = np.empty((nbr_idx.shape[0], 3), p.dtype)
    if out.shape[0]:
        _normals(p, nbr_idx.detach().to(torch.int64).contiguous().numpy(), c, vp,
                 viewpoint is not None, out)
    return torch.from_numpy(out)
