"""CPU (numba) kernels of ``spfh`` and ``fpfh_combine``: one pass per point, no (N, K, ·) gathers.

Same formulas as the PyTorch references (:func:`pointalign.kernels.features.fpfh.spfh_reference`,
:func:`pointalign.kernels.features.fpfh.fpfh_combine_reference`; the module docstring of
:mod:`pointalign.kernels.features.fpfh` is the contract), computed per point in the points' dtype:
pair features (Open3D's choice of source point, the tie tolerance of 16 ulps), bins
``floor(11 (x − lo) / (hi − lo))`` clamped to [0, 10] with the bounds rounded to the dtype
as the reference's tensor-scalar arithmetic does, integer bin counts scaled by
``100 / #neighbours``; the FPFH combine sums ``SPFH(p_k) / ‖p − p_k‖²`` in neighbour order.

Differences to the reference come from rounding only: libm's ``atan2``/``sqrt`` against
PyTorch's vectorised ones (an angle within an ulp of a bin edge can fall in the other bin:
not seen on the bunny test clouds) and the order of the combine's additions (~1e-6 relative).

The α bin without ``atan2`` (:func:`_alpha_bin`): a polynomial arctangent in float64
(error < 2e-6 rad, i.e. < 4e-6 in bin units) places α; when that position lies more than
``ALPHA_MARGIN`` (1e-3 bin) from every bin edge, the bin of the exact ``atan2`` (error a few
ulps, < 1e-5 bin in float32) is the same, so it is taken; otherwise (about 0.2 % of the pairs,
and every pair with a zero or non-finite argument) the exact ``atan2`` path decides. The bins
are those of the ``atan2`` path, bit for bit (``_spfh(..., exact=True)`` is that path; tests
compare them).

Why a loop: the reference materialises (chunk, K, 3) pair tensors and a dozen temporaries
per pair feature; at FPFH's K = 100 on 5,000 points that is ~40 ms per temporary pass on
two cores (measured 0.4 s for ``spfh`` and 0.25 s for the combine under load 3.5), while
the pair work itself is ~50 flops.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pointalign import _threads
from pointalign.kernels._numba import njit, prange
from pointalign.kernels.features.reference import BINS


@njit(cache=True, inline="always")
def _bin(x, lo, span, nb):
    b = math.floor(nb * (x - lo) / span)
    if b < 0:
        return 0
    if b > BINS - 1:
        return BINS - 1
    return int(b)


#: points per parallel work item (one histogram buffer each)
POINT_BLOCK = 64
#: odd polynomial ``atan(a) ~ a * sum(C[i] * a**(2 i))`` on [0, 1], max error 1.7e-6 rad
#: (fitted here by weighted least squares on Chebyshev nodes; tests check the bound)
ATAN_C = (0.99997722, -0.33262283, 0.19354036, -0.11642641, 0.05264727, -0.0117191)
#: the polynomial's bin is taken when it is farther than this (in bins) from every edge
ALPHA_MARGIN = 1e-3
_C0, _C1, _C2, _C3, _C4, _C5 = ATAN_C


@njit(cache=True, inline="always")
def _atan2_approx(y, x):
    """Return ``atan2(y, x)`` in float64 to within 2e-6 rad (NaN for x = y = 0, inf or NaN)."""
    ax, ay = abs(x), abs(y)
    tot = ax + ay
    if not (tot > 0.0 and tot < math.inf):  # x = y = 0 (either sign), inf or NaN
        return math.nan
    a = min(ax, ay) / max(ax, ay)
    s = a * a
    r = a * (_C0 + s * (_C1 + s * (_C2 + s * (_C3 + s * (_C4 + s * _C5)))))
    if ay > ax:
        r = 0.5 * math.pi - r
    if x < 0:
        r = math.pi - r
    if y < 0:
        r = -r
    return r


@njit(cache=True, inline="always")
def _alpha_bin(y, x, lo_a, span_a, nb, exact):
    """Return the bin of ``atan2(y, x)`` (``y, x`` in the points' dtype), as :func:`_bin`.

    Unless ``exact``, the polynomial's bin when it is clear of the edges (module docstring).
    """
    if not exact:
        t = (_atan2_approx(np.float64(y), np.float64(x)) + math.pi) * (BINS / (2 * math.pi))
        b = math.floor(t)
        fr = t - b
        if fr > ALPHA_MARGIN and fr < 1.0 - ALPHA_MARGIN and b >= 0.0 and b < BINS:
            return int(b)
    return _bin(math.atan2(y, x), lo_a, span_a, nb)


@njit(cache=True, parallel=True, error_model="numpy")
def _spfh(pts, nrm, idx, tol, out, exact):
    """SPFH rows of every point (see :func:`spfh_cpu`); ``exact``: α bins from ``atan2``."""
    n, k = idx.shape
    nblk = (n + POINT_BLOCK - 1) // POINT_BLOCK
    for blk in prange(nblk):
        cnt = np.empty(3 * BINS, np.int32)
        for i in range(blk * POINT_BLOCK, min(n, (blk + 1) * POINT_BLOCK)):
            # constants in the points' dtype (numba would widen float32 against a Python float)
            z = pts.dtype.type(0.0)
            one = pts.dtype.type(1.0)
            nb = pts.dtype.type(BINS)
            span_a = pts.dtype.type(2 * math.pi)  # the reference's (hi − lo) rounded to the dtype
            lo_a = pts.dtype.type(-math.pi)
            lo_pt = -one
            span_pt = pts.dtype.type(2.0)
            eps = pts.dtype.type(1e-30)
            cnt[:] = 0
            used = 0
            p0, p1, p2 = pts[i, 0], pts[i, 1], pts[i, 2]
            m0, m1, m2 = nrm[i, 0], nrm[i, 1], nrm[i, 2]
            for c in range(k):
                j = idx[i, c]
                if j < 0 or j == i:
                    continue
                used += 1
                d0, d1, d2 = pts[j, 0] - p0, pts[j, 1] - p1, pts[j, 2] - p2
                o0, o1, o2 = nrm[j, 0], nrm[j, 1], nrm[j, 2]
                dist = math.sqrt(d0 * d0 + d1 * d1 + d2 * d2)
                safe = max(dist, eps)
                a1 = (m0 * d0 + m1 * d1 + m2 * d2) / safe
                a2 = (o0 * d0 + o1 * d1 + o2 * d2) / safe
                if abs(a1) < abs(a2) - tol:  # the neighbour is the source: swap
                    u0, u1, u2 = o0, o1, o2
                    t0, t1, t2 = m0, m1, m2
                    d0, d1, d2 = -d0, -d1, -d2
                    theta = -a2
                else:
                    u0, u1, u2 = m0, m1, m2
                    t0, t1, t2 = o0, o1, o2
                    theta = a1
                # v = d × u, w = u × v
                v0 = d1 * u2 - d2 * u1
                v1 = d2 * u0 - d0 * u2
                v2 = d0 * u1 - d1 * u0
                vn = math.sqrt(v0 * v0 + v1 * v1 + v2 * v2)
                if dist > z and vn > z:
                    s = max(vn, eps)
                    v0, v1, v2 = v0 / s, v1 / s, v2 / s
                    w0 = u1 * v2 - u2 * v1
                    w1 = u2 * v0 - u0 * v2
                    w2 = u0 * v1 - u1 * v0
                    phi = v0 * t0 + v1 * t1 + v2 * t2
                    ab = _alpha_bin(w0 * t0 + w1 * t1 + w2 * t2, u0 * t0 + u1 * t1 + u2 * t2,
                                    lo_a, span_a, nb, exact)
                else:  # degenerate pair: the features (0, 0, 0), as the reference
                    phi, theta = z, z
                    ab = _bin(z, lo_a, span_a, nb)
                cnt[ab] += 1
                cnt[BINS + _bin(phi, lo_pt, span_pt, nb)] += 1
                cnt[2 * BINS + _bin(theta, lo_pt, span_pt, nb)] += 1
            if used > 0:
                sc = pts.dtype.type(100.0) / pts.dtype.type(used)
                for b in range(3 * BINS):
                    out[i, b] = pts.dtype.type(cnt[b]) * sc
            else:
                for b in range(3 * BINS):
                    out[i, b] = z


@njit(cache=True, inline="always")
def _normalise(h, out, i):
    """``out[i] = h`` with each 11-bin group scaled to sum to 100 (zero groups stay zero)."""
    z = h.dtype.type(0.0)
    for g in range(3):
        s = z
        for b in range(BINS):
            s += h[g * BINS + b]
        if s > z:
            f = h.dtype.type(100.0) / max(s, h.dtype.type(1e-30))
            for b in range(BINS):
                out[i, g * BINS + b] = h[g * BINS + b] * f
        else:
            for b in range(BINS):
                out[i, g * BINS + b] = z


@njit(cache=True, parallel=True, error_model="numpy")
def _combine(spfh, idx, d2, out):
    n, k = idx.shape
    nblk = (n + POINT_BLOCK - 1) // POINT_BLOCK
    for blk in prange(nblk):
        acc = np.empty(3 * BINS, spfh.dtype)
        nb = np.empty((1, 3 * BINS), spfh.dtype)
        for i in range(blk * POINT_BLOCK, min(n, (blk + 1) * POINT_BLOCK)):
            z = spfh.dtype.type(0.0)
            one = spfh.dtype.type(1.0)
            eps = spfh.dtype.type(1e-30)
            acc[:] = z
            for c in range(k):
                j = idx[i, c]
                dd = d2[i, c]
                if j < 0 or not dd > z or not math.isfinite(dd):
                    continue
                w = one / max(dd, eps)
                for b in range(3 * BINS):
                    acc[b] += w * spfh[j, b]
            _normalise(acc, nb, 0)
            for b in range(3 * BINS):
                acc[b] = spfh[i, b] + nb[0, b]
            _normalise(acc, out, i)


def spfh_cpu(points: torch.Tensor, normals: torch.Tensor, nbr_idx: torch.Tensor) -> torch.Tensor:
    """SPFH ``(N, 33)`` of ``points (N, 3)``, ``normals (N, 3)``, ``nbr_idx (N, K)`` (CPU)."""
    _threads.numba_threads()
    p = points.detach().contiguous().numpy()
    nr = normals.detach().to(points.dtype).contiguous().numpy()
    out = np.empty((p.shape[0], 3 * BINS), p.dtype)
    if out.shape[0]:
        tol = p.dtype.type(16 * np.finfo(p.dtype).eps)
        # ``exact`` passed, not defaulted: one compiled signature with the tests' calls
        _spfh(p, nr, nbr_idx.detach().to(torch.int64).contiguous().numpy(), tol, out, False)
    return torch.from_numpy(out)


def fpfh_combine_cpu(spfh_hist: torch.Tensor, nbr_idx: torch.Tensor,
                     nbr_dist_sq: torch.Tensor) -> torch.Tensor:
    """FPFH ``(N, 33)`` from SPFH ``(N, 33)`` and the neighbour table ``(N, K)`` (CPU)."""
    _threads.numba_threads()
    h = spfh_hist.detach().contiguous().numpy()
    out = np.empty_like(h)
    if out.shape[0]:
        _combine(h, nbr_idx.detach().to(torch.int64).contiguous().numpy(),
                 nbr_dist_sq.detach().to(spfh_hist.dtype).contiguous().numpy(), out)
    return torch.from_numpy(out)
