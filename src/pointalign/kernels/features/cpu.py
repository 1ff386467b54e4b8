"""CPU (numba) kernel of ``pca_normals``: covariance and closed-form eigenvector in one pass.

Same formulas as the reference (:func:`pointalign.kernels.features.pca_normals_reference`:
``features.normals._neighbour_covariances`` and ``smallest_eigenvector``), per point, with
no ``(N, K, 3)`` gather: the neighbourhood mean and covariance are accumulated in the
points' dtype in neighbour order (as the reference's sums), the eigen-solve in float64
(Smith's closed form, null vector as the largest cross product of two rows of A − λI,
the orthogonal fallback for a repeated smallest eigenvalue). Differences to the reference
come from the order of the covariance additions only (float32: ~1e-6 relative on the
covariance; the normals agree to ~1e-5 except where the smallest eigenvalue is nearly
repeated, where any unit vector of the plane is an answer).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pointalign import _threads
from pointalign.kernels._numba import njit, prange


@njit(cache=True, inline="always")
def _null(a00, a01, a02, a11, a12, a22, lam):
    m00, m11, m22 = a00 - lam, a11 - lam, a22 - lam
    # rows r0 = (m00, a01, a02), r1 = (a01, m11, a12), r2 = (a02, a12, m22)
    c = np.empty((3, 3))
    c[0, 0] = a01 * a12 - a02 * m11
    c[0, 1] = a02 * a01 - m00 * a12
    c[0, 2] = m00 * m11 - a01 * a01
    c[1, 0] = a01 * m22 - a02 * a12
    c[1, 1] = a02 * a02 - m00 * m22
    c[1, 2] = m00 * a12 - a01 * a02
    c[2, 0] = m11 * m22 - a12 * a12
    c[2, 1] = a12 * a02 - a01 * m22
    c[2, 2] = a01 * a12 - m11 * a02
    best, nb = 0, -1.0
    for r in range(3):
        n2 = c[r, 0] * c[r, 0] + c[r, 1] * c[r, 1] + c[r, 2] * c[r, 2]
        if n2 > nb:
            nb, best = n2, r
    s = math.sqrt(max(nb, 1e-300))
    return c[best, 0] / s, c[best, 1] / s, c[best, 2] / s, nb


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
        sc = max(abs(a00), abs(a01), abs(a02), abs(a11), abs(a12), abs(a22))
        if not sc > 0:
            sc = 1.0
        a00, a01, a02, a11, a12, a22 = a00 / sc, a01 / sc, a02 / sc, a11 / sc, a12 / sc, a22 / sc
        q = (a00 + a11 + a22) / 3
        b00, b11, b22 = a00 - q, a11 - q, a22 - q
        p2 = b00 * b00 + b11 * b11 + b22 * b22 + 2 * (a01 * a01 + a02 * a02 + a12 * a12)
        pp = math.sqrt(p2 / 6)
        ps = pp if pp > 0 else 1.0
        c00, c11, c22 = b00 / ps, b11 / ps, b22 / ps
        c01, c02, c12 = a01 / ps, a02 / ps, a12 / ps
        det = (c00 * (c11 * c22 - c12 * c12) - c01 * (c01 * c22 - c12 * c02)
               + c02 * (c01 * c12 - c11 * c02))
        phi = math.acos(min(1.0, max(-1.0, det / 2))) / 3
        l_max = q + 2 * pp * math.cos(phi)
        l_min = q + 2 * pp * math.cos(phi + 2 * math.pi / 3)
        l_mid = 3 * q - l_max - l_min
        v0, v1, v2, nv = _null(a00, a01, a02, a11, a12, a22, l_min)
        gap = l_mid - l_min
        spread = l_max - l_min
        simple = nv > (1e-8 * max(spread, 1e-300)) ** 2 and gap > 1e-9 * max(spread, 1e-300)
        if not simple:
            u0, u1, u2, nu = _null(a00, a01, a02, a11, a12, a22, l_max)
            if nu > 0 and spread > 0:
                # cross(u, e_k) with k the axis of u's smallest magnitude (first on ties)
                au0, au1, au2 = abs(u0), abs(u1), abs(u2)
                if au0 <= au1 and au0 <= au2:
                    v0, v1, v2 = 0.0, u2, -u1
                elif au1 <= au2:
                    v0, v1, v2 = -u2, 0.0, u0
                else:
                    v0, v1, v2 = u1, -u0, 0.0
                nn = math.sqrt(max(v0 * v0 + v1 * v1 + v2 * v2, 1e-300))
                v0, v1, v2 = v0 / nn, v1 / nn, v2 / nn
            else:
                v0, v1, v2 = 0.0, 0.0, 1.0
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
