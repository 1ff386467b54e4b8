"""CPU (numba) kernels of the GICP family: the contracts of :mod:`pointalign.kernels.gicp`.

* :func:`covariances_cpu`: one pass per point over its neighbour row: mean and covariance
  in float64 (two passes over the row, as the reference), the degeneracy rule, the smallest
  eigenvector in closed form (Smith 1961; the null vector as the largest cross product of
  two rows of ``A − λI``; the orthogonal fallback for a repeated smallest eigenvalue: the
  steps of :func:`pointalign._math.smallest_eigenvector3`) and ``I − (1 − ε) n nᵀ``.
* :func:`gicp_sums_cpu`: the 30 sums in float64 registers, one row at a time, no
  ``(B, N, ·)`` intermediates; ``BLOCKS`` fixed row blocks per batch entry summed in block
  order, so the result does not depend on the thread count. It differs from the reference
  (which sums whole columns, and forms ``Jᵀ M J`` by matrix products) by the rounding of
  float64 sums in another order and grouping (relative ~1e-13).
* :func:`knn_covariances_cpu`: the k-NN self-query of the knn family's host tree
  (its keyed search helpers) and :func:`covariances_cpu`'s row reduction in one parallel
  pass: no ``(N, k)`` table, the same bits as the search then the reduction.
* :func:`voxel_lookup_cpu`: the nearest voxel through a hash table of each target's
  sorted keys (built per call, O(V)); integer answers equal to the reference's (the same
  positions, the same float64 distances).
* :func:`voxelize_cpu`: the voxel map by one hashed pass over each target (no sort of the
  points, only of the occupied keys): the reference's map, bit for bit.
* :func:`gicp_step_sums_cpu`: one GICP iteration's move (``transform_points``' rounding),
  the target host tree's hinted nearest search (``knn/cpu.py``'s ``_nearest_one``) and
  sums in one parallel pass, returning the partners as the next hints: the bits of the
  three passes in a row.
* :func:`vgicp_sums_cpu`: one VGICP iteration's move (``transform_points``' rounding),
  voxel look-up and sums in one parallel pass: the bits of the three kernels in a row.

The per-row covariance, the per-pair terms (adjugate inverse, robust weight, the 28 sums),
the turned source covariance and the voxel look-up are written once here as ``inline``
helpers (the same operations as the reference and ``triton.py``); each kernel is a loop
over them, so the fused kernels add no second copy of a formula.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pointalign import _math, _threads
from pointalign.kernels._nb_math import (
    ROBUST_CODE,
    robust_weight,
    smallest_eigenvector3,
    spans_plane,
)
from pointalign.kernels._numba import njit, prange
from pointalign.kernels.gicp.reference import (
    KEY_BITS,
    KEY_OFFSET,
    MIN_NEIGHBOURS,
    OFFSETS,
    ROBUST_SCALE2,
    WIDTH,
    VoxelMap,
    padded_map,
    too_small,
)
from pointalign.kernels.knn.cpu import _LOW32, CpuTree, _nearest_one, _self_key
from pointalign.kernels.ransac.score_cpu import _moved

#: row blocks per batch entry (fixed: the summation order does not depend on threads)
BLOCKS = 64
_OFFSETS = np.asarray(OFFSETS, dtype=np.int64)


@njit(cache=True, inline="always")
def _cov_row(pts, row, eps, degeneracy, out, i):
    """Write ``out[i]``: the plane covariance of the neighbours ``row (K,)`` (``-1`` = none)."""
    k = row.shape[0]
    cnt = 0.0
    m0, m1, m2 = 0.0, 0.0, 0.0
    for j in range(k):
        p = row[j]
        if p >= 0:
            cnt += 1.0
            m0 += np.float64(pts[p, 0])
            m1 += np.float64(pts[p, 1])
            m2 += np.float64(pts[p, 2])
    c = max(cnt, 1.0)
    m0, m1, m2 = m0 / c, m1 / c, m2 / c
    s00, s01, s02, s11, s12, s22 = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    for j in range(k):
        p = row[j]
        if p >= 0:
            d0 = np.float64(pts[p, 0]) - m0
            d1 = np.float64(pts[p, 1]) - m1
            d2 = np.float64(pts[p, 2]) - m2
            s00 += d0 * d0
            s01 += d0 * d1
            s02 += d0 * d2
            s11 += d1 * d1
            s12 += d1 * d2
            s22 += d2 * d2
    s00, s01, s02, s11, s12, s22 = s00 / c, s01 / c, s02 / c, s11 / c, s12 / c, s22 / c
    for a in range(3):
        for b in range(3):
            out[i, a, b] = 1.0 if a == b else 0.0
    if cnt >= MIN_NEIGHBOURS and spans_plane(s00, s01, s02, s11, s12, s22, degeneracy):
        (n0, n1, n2), _ = smallest_eigenvector3(s00, s01, s02, s11, s12, s22)
        f = 1.0 - eps
        out[i, 0, 0] = 1.0 - f * (n0 * n0)
        out[i, 1, 1] = 1.0 - f * (n1 * n1)
        out[i, 2, 2] = 1.0 - f * (n2 * n2)
        out[i, 0, 1] = out[i, 1, 0] = -(f * (n0 * n1))
        out[i, 0, 2] = out[i, 2, 0] = -(f * (n0 * n2))
        out[i, 1, 2] = out[i, 2, 1] = -(f * (n1 * n2))


@njit(cache=True, parallel=True)
def _covariances(pts, idx, eps, degeneracy, out):
    for i in prange(idx.shape[0]):
        _cov_row(pts, idx[i], eps, degeneracy, out, i)


@njit(cache=True, parallel=True)
def _knn_covariances(pts, perm, spts, lo, hi, bmin, bmax, nmin, depth, k, max_d2, eps,
                     degeneracy, out):
    """Fused k-NN and :func:`_cov_row` of every point of a keyed host tree (float32).

    The search is :func:`pointalign.kernels.knn.cpu._knn_self_keyed`'s (bottom-up from each
    point's leaf, with its helpers and its ordered keys), and each point's k nearest
    (ordered by distance, then index) go straight into :func:`_cov_row` in that order: no
    neighbour table, one parallel pass, the same result as ``knn_self`` then
    :func:`_covariances`, bit for bit.
    """
    first_leaf = (1 << depth) - 1
    nleaves = 1 << depth
    for t in prange(nleaves):
        stack = np.empty(2 * depth + 4, np.int64)
        sd = np.empty(2 * depth + 4, spts.dtype)
        kb = np.empty(k, np.uint64)
        f = np.empty(2, np.float32)
        u = f.view(np.uint32)
        row = np.empty(k, np.int64)
        leaf = first_leaf + t
        lk = np.empty(hi[leaf] - lo[leaf], np.uint64)
        for j0 in range(lo[leaf], hi[leaf]):
            cnt = _self_key(j0, leaf, perm, spts, lo, hi, bmin, bmax, nmin, first_leaf, stack,
                            sd, k, kb, lk, max_d2, f, u)
            for s in range(cnt):
                row[s] = np.int64(kb[s] & _LOW32)
            for s in range(cnt, k):
                row[s] = -1
            _cov_row(pts, row, eps, degeneracy, out, perm[j0])


def covariances_cpu(points: torch.Tensor, nbr_idx: torch.Tensor, eps: float) -> torch.Tensor:
    """Return ``(Q, 3, 3)`` plane-regularised covariances in the points' dtype."""
    _threads.numba_threads()
    p = points.detach().contiguous().numpy()
    out = np.empty((nbr_idx.shape[0], 3, 3), p.dtype)  # rounded once, as .to() would
    if out.shape[0]:
        _covariances(p, nbr_idx.detach().to(torch.int64).contiguous().numpy(), float(eps),
                     _math.DEGENERACY_EPS, out)
    return torch.from_numpy(out)


def knn_covariances_cpu(points: torch.Tensor, k: int, eps: float) -> torch.Tensor | None:
    """``(N, 3, 3)`` covariances of each point's k nearest (itself included), fused; or None.

    A host k-d tree is built over the points (the knn family's, leaf size
    ``HOST_LEAF_SIZE``) and searched and reduced in one pass (:func:`_knn_covariances`).
    None where the keyed search does not apply (not float32, not finite): the caller then
    searches an index and calls :func:`covariances_cpu`.
    """
    from pointalign.kernels.knn import HOST_LEAF_SIZE

    p = points.detach().contiguous().numpy()
    if p.dtype != np.float32 or not np.isfinite(p).all():
        return None
    tree = CpuTree(p, leaf_size=HOST_LEAF_SIZE)
    _threads.numba_threads()
    out = np.empty((p.shape[0], 3, 3), p.dtype)  # rounded once, as .to() would
    _knn_covariances(p, tree.perm, tree.spts, tree.lo, tree.hi, tree.bmin, tree.bmax,
                     tree.nmin, tree.depth, int(k), np.float32(np.inf), float(eps),
                     _math.DEGENERACY_EPS, out)
    return torch.from_numpy(out)


@njit(cache=True, inline="always")
def _rotate_sym(R, a00, a01, a02, a11, a12, a22):
    """Upper triangle of ``R A Rᵀ`` for symmetric A (R a 3×3 array)."""
    # Q = A Rᵀ: Q[a, j] = Σ_b A[a, b] R[j, b]
    q00 = a00 * R[0, 0] + a01 * R[0, 1] + a02 * R[0, 2]
    q01 = a00 * R[1, 0] + a01 * R[1, 1] + a02 * R[1, 2]
    q02 = a00 * R[2, 0] + a01 * R[2, 1] + a02 * R[2, 2]
    q10 = a01 * R[0, 0] + a11 * R[0, 1] + a12 * R[0, 2]
    q11 = a01 * R[1, 0] + a11 * R[1, 1] + a12 * R[1, 2]
    q12 = a01 * R[2, 0] + a11 * R[2, 1] + a12 * R[2, 2]
    q20 = a02 * R[0, 0] + a12 * R[0, 1] + a22 * R[0, 2]
    q21 = a02 * R[1, 0] + a12 * R[1, 1] + a22 * R[1, 2]
    q22 = a02 * R[2, 0] + a12 * R[2, 1] + a22 * R[2, 2]
    s00 = R[0, 0] * q00 + R[0, 1] * q10 + R[0, 2] * q20
    s01 = R[0, 0] * q01 + R[0, 1] * q11 + R[0, 2] * q21
    s02 = R[0, 0] * q02 + R[0, 1] * q12 + R[0, 2] * q22
    s11 = R[1, 0] * q01 + R[1, 1] * q11 + R[1, 2] * q21
    s12 = R[1, 0] * q02 + R[1, 1] * q12 + R[1, 2] * q22
    s22 = R[2, 0] * q02 + R[2, 1] * q12 + R[2, 2] * q22
    return s00, s01, s02, s11, s12, s22


@njit(cache=True, inline="always")
def add_pair(acc, w, x0, x1, x2, m00, m01, m02, m11, m12, m22, u0, u1, u2, e):
    """Add one pair's weighted terms to ``acc[0:28]`` (the layout of ``gicp_sums``).

    ``x̃`` the centred source point, M the inverse combined covariance (upper triangle),
    ``u = M r``, ``e = rᵀ u``. With ``P_l = M (e_l × x̃)``: ``(Jᵀ M J)_ωω[:, l] = x̃ × P_l``,
    ``(Jᵀ M J)_ωv[l, :] = P_lᵀ``, ``(Jᵀ M J)_vv = M``, ``Jᵀ M r = (x̃ × u, u)``.
    """
    p00 = -x2 * m01 + x1 * m02
    p01 = -x2 * m11 + x1 * m12
    p02 = -x2 * m12 + x1 * m22
    p10 = x2 * m00 - x0 * m02
    p11 = x2 * m01 - x0 * m12
    p12 = x2 * m02 - x0 * m22
    p20 = -x1 * m00 + x0 * m01
    p21 = -x1 * m01 + x0 * m11
    p22 = -x1 * m02 + x0 * m12
    acc[0] += w * (x1 * p02 - x2 * p01)
    acc[1] += w * (x1 * p12 - x2 * p11)
    acc[2] += w * (x1 * p22 - x2 * p21)
    acc[3] += w * p00
    acc[4] += w * p01
    acc[5] += w * p02
    acc[6] += w * (x2 * p10 - x0 * p12)
    acc[7] += w * (x2 * p20 - x0 * p22)
    acc[8] += w * p10
    acc[9] += w * p11
    acc[10] += w * p12
    acc[11] += w * (x0 * p21 - x1 * p20)
    acc[12] += w * p20
    acc[13] += w * p21
    acc[14] += w * p22
    acc[15] += w * m00
    acc[16] += w * m01
    acc[17] += w * m02
    acc[18] += w * m11
    acc[19] += w * m12
    acc[20] += w * m22
    acc[21] += w * (x1 * u2 - x2 * u1)
    acc[22] += w * (x2 * u0 - x0 * u2)
    acc[23] += w * (x0 * u1 - x1 * u0)
    acc[24] += w * u0
    acc[25] += w * u1
    acc[26] += w * u2
    acc[27] += w * e


@njit(cache=True, inline="always")
def _pair(acc, x0, x1, x2, s00, s01, s02, s11, s12, s22, tgt, tcov, b, j, c0, c1, c2, kind,
          scale, rscale2):
    """Add the pair (source row, target ``j``) to ``acc``; return its squared distance, or -1.

    ``x̃`` the centred moved source point, ``s··`` its turned covariance (upper triangle);
    -1 (nothing added) where the combined covariance is not positive definite.
    """
    c00 = np.float64(tcov[b, j, 0, 0]) + s00
    c01 = np.float64(tcov[b, j, 0, 1]) + s01
    c02 = np.float64(tcov[b, j, 0, 2]) + s02
    c11 = np.float64(tcov[b, j, 1, 1]) + s11
    c12 = np.float64(tcov[b, j, 1, 2]) + s12
    c22 = np.float64(tcov[b, j, 2, 2]) + s22
    a00 = c11 * c22 - c12 * c12
    a01 = c02 * c12 - c01 * c22
    a02 = c01 * c12 - c02 * c11
    a11 = c00 * c22 - c02 * c02
    a12 = c01 * c02 - c00 * c12
    a22 = c00 * c11 - c01 * c01
    det = c00 * a00 + c01 * a01 + c02 * a02
    if not det > 0:
        return -1.0
    m00, m01, m02 = a00 / det, a01 / det, a02 / det
    m11, m12, m22 = a11 / det, a12 / det, a22 / det
    r0 = x0 - (np.float64(tgt[b, j, 0]) - c0)
    r1 = x1 - (np.float64(tgt[b, j, 1]) - c1)
    r2 = x2 - (np.float64(tgt[b, j, 2]) - c2)
    u0 = m00 * r0 + m01 * r1 + m02 * r2
    u1 = m01 * r0 + m11 * r1 + m12 * r2
    u2 = m02 * r0 + m12 * r1 + m22 * r2
    e = max(r0 * u0 + r1 * u1 + r2 * u2, 0.0)
    w = robust_weight(math.sqrt(rscale2 * e), kind, scale)
    add_pair(acc, w, x0, x1, x2, m00, m01, m02, m11, m12, m22, u0, u1, u2, e)
    return r0 * r0 + r1 * r1 + r2 * r2


@njit(cache=True, inline="always")
def _turned(R, scov, b, i):
    """Upper triangle of ``R Cˢ_i Rᵀ`` in float64."""
    return _rotate_sym(R, np.float64(scov[b, i, 0, 0]), np.float64(scov[b, i, 0, 1]),
                       np.float64(scov[b, i, 0, 2]), np.float64(scov[b, i, 1, 1]),
                       np.float64(scov[b, i, 1, 2]), np.float64(scov[b, i, 2, 2]))


@njit(cache=True, inline="always")
def _add_partner(acc, p0, p1, p2, R, scov, b, i, tgt, tcov, j, c0, c1, c2, kind, scale,
                 rscale2):
    """Add moved row i (``p``, its points' dtype) with its one partner j, as :func:`_sums`.

    The fused steps' per-row tail (S = 1): the centred row in float64, its turned
    covariance, the pair's terms and the fitness counters (``acc[28:30]``).
    """
    x0 = np.float64(p0) - c0
    x1 = np.float64(p1) - c1
    x2 = np.float64(p2) - c2
    s00, s01, s02, s11, s12, s22 = _turned(R, scov, b, i)
    d2 = _pair(acc, x0, x1, x2, s00, s01, s02, s11, s12, s22, tgt, tcov, b, j, c0, c1, c2,
               kind, scale, rscale2)
    if d2 >= 0:
        acc[28] += 1.0
        acc[29] += d2 / 1.0


@njit(cache=True)
def _total(part):
    """``(B, WIDTH)`` sums of the ``(B, BLOCKS, WIDTH)`` partials, in block order."""
    B = part.shape[0]
    out = np.zeros((B, WIDTH), np.float64)
    for b in range(B):
        for blk in range(BLOCKS):
            for q in range(WIDTH):
                out[b, q] += part[b, blk, q]
    return out


@njit(cache=True, parallel=True)
def _sums(src, scov, tgt, tcov, idx, rot, lengths, center, kind, scale, rscale2):
    B, N, S = idx.shape
    part = np.zeros((B, BLOCKS, WIDTH), np.float64)
    step = (N + BLOCKS - 1) // BLOCKS
    for job in prange(B * BLOCKS):
        b = job // BLOCKS
        blk = job % BLOCKS
        acc = np.zeros(WIDTH, np.float64)
        R = rot[b]
        c0, c1, c2 = center[b, 0], center[b, 1], center[b, 2]
        stop = min(lengths[b], (blk + 1) * step)
        for i in range(blk * step, stop):
            x0 = np.float64(src[b, i, 0]) - c0
            x1 = np.float64(src[b, i, 1]) - c1
            x2 = np.float64(src[b, i, 2]) - c2
            s00, s01, s02, s11, s12, s22 = _turned(R, scov, b, i)
            n_ok = 0.0
            d2sum = 0.0
            for s in range(S):
                j = idx[b, i, s]
                if j < 0:
                    continue
                d2 = _pair(acc, x0, x1, x2, s00, s01, s02, s11, s12, s22, tgt, tcov, b, j,
                           c0, c1, c2, kind, scale, rscale2)
                if d2 >= 0:
                    n_ok += 1.0
                    d2sum += d2
            if n_ok > 0:
                acc[28] += 1.0
                acc[29] += d2sum / n_ok
        for q in range(WIDTH):
            part[b, blk, q] = acc[q]
    return _total(part)


@njit(cache=True, parallel=True)
def _gicp_step_sums(Rf, tf, src, scov, tgt, tcov, hint, pts, perm, spts, lo, hi, bmin, bmax,
                    nmin, depth, max_d2, cand, cand_r2, rot, lengths, center, kind, scale,
                    rscale2, out_idx):
    """:func:`_sums` of one GICP iteration with the move and the search fused (one pass).

    Row i of entry b: moved by ``Rf[b], tf[b]`` in the points' dtype (``transform_points``'
    rounding, :func:`pointalign.kernels.ransac.score_cpu._moved`), its nearest target
    point within ``max_d2`` found by the host tree's search from ``hint[b, i]`` (else the
    row before's answer) and written to ``out_idx[b, i]`` (the next step's hint),
    summed as :func:`_sums` with S = 1 in the same blocks: the bits of ``transform_points``
    → ``nearest_within`` → ``gicp_sums`` (the search is exact: its answer does not depend
    on the hint). Every entry searches the one tree (a shared target). Rows past
    ``lengths[b]`` are neither searched nor summed (``out_idx`` -1).
    """
    B, N = src.shape[:2]
    first_leaf = (1 << depth) - 1
    part = np.zeros((B, BLOCKS, WIDTH), np.float64)
    step = (N + BLOCKS - 1) // BLOCKS
    for job in prange(B * BLOCKS):
        b = job // BLOCKS
        blk = job % BLOCKS
        acc = np.zeros(WIDTH, np.float64)
        stack = np.empty(2 * depth + 4, np.int64)
        sd = np.empty(2 * depth + 4, pts.dtype)
        R = rot[b]
        c0, c1, c2 = center[b, 0], center[b, 1], center[b, 2]
        first = blk * step
        stop = min(lengths[b], (blk + 1) * step)
        for i in range(first, min(N, (blk + 1) * step)):
            out_idx[b, i] = -1
        for i in range(first, stop):
            p0, p1, p2 = _moved(Rf, tf, b, src[b, i, 0], src[b, i, 1], src[b, i, 2])
            h = hint[b, i]
            if h < 0 and i > first:
                h = out_idx[b, i - 1]
            _, j = _nearest_one(p0, p1, p2, h, pts, perm, spts, lo, hi, bmin, bmax, nmin,
                                first_leaf, max_d2, cand, cand_r2, stack, sd)
            out_idx[b, i] = j
            if j >= 0:
                _add_partner(acc, p0, p1, p2, R, scov, b, i, tgt, tcov, j, c0, c1, c2, kind,
                             scale, rscale2)
        for q in range(WIDTH):
            part[b, blk, q] = acc[q]
    return _total(part)


@njit(cache=True, parallel=True)
def _vgicp_sums(Rf, tf, src, scov, keys, means, vcov, table, mask, inv, offsets, rot,
                lengths, center, kind, scale, rscale2):
    """:func:`_sums` of VGICP with the move and the voxel look-up fused (one pass).

    Row i of entry b: moved by ``Rf[b], tf[b]`` in the points' dtype
    (:func:`pointalign.kernels.ransac.score_cpu._moved`, the rounding of
    ``transform_points``), paired with :func:`_nearest_voxel` (that of
    :func:`voxel_lookup_cpu`), summed as :func:`_sums` with S = 1 in the same blocks: the
    bits of ``transform_points`` → ``voxel_lookup`` → ``gicp_sums``, without the two
    intermediate ``(B, N)`` arrays and two parallel regions per iteration.
    """
    B, N = src.shape[:2]
    top = (1 << KEY_BITS) - 2
    part = np.zeros((B, BLOCKS, WIDTH), np.float64)
    step = (N + BLOCKS - 1) // BLOCKS
    for job in prange(B * BLOCKS):
        b = job // BLOCKS
        blk = job % BLOCKS
        acc = np.zeros(WIDTH, np.float64)
        R = rot[b]
        c0, c1, c2 = center[b, 0], center[b, 1], center[b, 2]
        stop = min(lengths[b], (blk + 1) * step)
        for i in range(blk * step, stop):
            p0, p1, p2 = _moved(Rf, tf, b, src[b, i, 0], src[b, i, 1], src[b, i, 2])
            j = _nearest_voxel(np.float64(p0), np.float64(p1), np.float64(p2), keys, means,
                               table, mask, b, inv, offsets, top)
            if j >= 0:
                _add_partner(acc, p0, p1, p2, R, scov, b, i, means, vcov, j, c0, c1, c2,
                             kind, scale, rscale2)
        for q in range(WIDTH):
            part[b, blk, q] = acc[q]
    return _total(part)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def gicp_sums_cpu(source, source_cov, target, target_cov, idx, rotation, lengths, center,
                  kernel, scale) -> torch.Tensor:
    """Return the ``(B, 30)`` float64 sums (arguments as :func:`.gicp.gicp_sums`)."""
    _threads.numba_threads()
    src = _np(source)
    tgt = _np(target) if target.dtype == source.dtype else _np(target.to(source.dtype))
    out = _sums(src, _np(source_cov), tgt, _np(target_cov.to(source_cov.dtype)),
                _np(idx.to(torch.int64)), _np(rotation.to(torch.float64)),
                _np(lengths.to(torch.int64)), _np(center.to(torch.float64)),
                ROBUST_CODE[kernel], float(scale), ROBUST_SCALE2)
    return torch.from_numpy(out)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing's multiplier (2**64 / φ)


@njit(cache=True, inline="always")
def _slot(key, mask):
    """Return a key's first slot in an open-addressing table of ``mask + 1`` slots."""
    return np.int64((np.uint64(key) * _GOLDEN) >> np.uint64(32)) & mask


@njit(cache=True)
def _voxel_table(keys, sizes):
    """Hash ``keys[b, :sizes[b]]``: ``table (B, S)`` of positions (-1: empty), and ``S - 1``.

    S is the power of two at least twice the largest count (linear probing stays short).
    """
    size = 2
    while size < 2 * max(1, sizes.max()):
        size *= 2
    mask = size - 1
    table = np.full((keys.shape[0], size), -1, np.int64)
    for b in range(keys.shape[0]):
        for v in range(sizes[b]):
            h = _slot(keys[b, v], mask)
            while table[b, h] != -1:
                h = (h + 1) & mask
            table[b, h] = v
    return table, mask


@njit(cache=True, inline="always")
def _nearest_voxel(p0, p1, p2, keys, means, table, mask, b, inv, offsets, top):
    """Find the occupied voxel around ``p`` (float64) whose mean is nearest, or -1.

    Candidates: the cells ``floor(p · inv) + offsets[s]``; the answer is an index into
    ``keys[b]``, found through the keys' hash table (:func:`_voxel_table`): the position
    a binary search of the sorted keys finds, in one or two probes.
    """
    c0 = np.int64(math.floor(p0 * inv)) + KEY_OFFSET
    c1 = np.int64(math.floor(p1 * inv)) + KEY_OFFSET
    c2 = np.int64(math.floor(p2 * inv)) + KEY_OFFSET
    best, best_d2 = -1, np.inf
    for s in range(offsets.shape[0]):
        e0, e1, e2 = c0 + offsets[s, 0], c1 + offsets[s, 1], c2 + offsets[s, 2]
        if e0 < 0 or e1 < 0 or e2 < 0 or e0 > top or e1 > top or e2 > top:
            continue
        key = (e0 << (2 * KEY_BITS)) | (e1 << KEY_BITS) | e2
        h = _slot(key, mask)
        j = table[b, h]
        while j >= 0 and keys[b, j] != key:
            h = (h + 1) & mask
            j = table[b, h]
        if j >= 0:
            d0 = p0 - np.float64(means[b, j, 0])
            d1 = p1 - np.float64(means[b, j, 1])
            d2 = p2 - np.float64(means[b, j, 2])
            dd = (d0 * d0 + d1 * d1) + d2 * d2
            if dd < best_d2:
                best, best_d2 = j, dd
    return best


@njit(cache=True, parallel=True)
def _lookup(pts, keys, means, table, mask, inv, offsets, out):
    B, N = out.shape
    top = (1 << KEY_BITS) - 2
    for job in prange(B * N):
        b = job // N
        i = job % N
        out[b, i] = _nearest_voxel(np.float64(pts[b, i, 0]), np.float64(pts[b, i, 1]),
                                   np.float64(pts[b, i, 2]), keys, means, table, mask, b,
                                   inv, offsets, top)


def _occupied(k: np.ndarray) -> np.ndarray:
    """Each row's occupied keys: those below the padding (the padding key sorts last)."""
    return (k < np.iinfo(np.int64).max).sum(1).astype(np.int64)


def voxel_lookup_cpu(points: torch.Tensor, keys: torch.Tensor, means: torch.Tensor,
                     inv_size: float, neighborhood: int) -> torch.Tensor:
    """Return ``(B, N)`` int64 nearest voxels (see :func:`.gicp.voxel_lookup`)."""
    _threads.numba_threads()
    B, N = points.shape[:2]
    k = _np(keys)
    out = np.empty((B, N), np.int64)
    if B * N:
        table, mask = _voxel_table(k, _occupied(k))
        _lookup(_np(points), k, _np(means), table, mask, float(inv_size),
                _OFFSETS[:neighborhood], out)
    return torch.from_numpy(out)


@njit(cache=True)
def _voxel_sums(pts, covs, inv, keys, sums, csums, counts):
    """Sum ``pts (M, 3)`` and ``covs (M, 3, 3)`` per voxel in one pass; return V or -1.

    Voxels are numbered as first met (an open-addressing hash of the keys, linear
    probing); ``keys[v]``, ``sums[v] (3,)``, ``csums[v] (9,)`` (float64, added in point
    order, as the reference's ``index_add_``) and ``counts[v]`` fill the first V rows.
    -1: a point whose cell has no key (too far from the origin).
    """
    m = pts.shape[0]
    size = 2
    while size < 2 * m:
        size *= 2
    mask = size - 1
    slot_key = np.full(size, -1, np.int64)  # keys are >= 0
    slot_id = np.empty(size, np.int64)
    top = (1 << KEY_BITS) - 2
    nv = 0
    for i in range(m):
        c0 = np.int64(math.floor(np.float64(pts[i, 0]) * inv)) + KEY_OFFSET
        c1 = np.int64(math.floor(np.float64(pts[i, 1]) * inv)) + KEY_OFFSET
        c2 = np.int64(math.floor(np.float64(pts[i, 2]) * inv)) + KEY_OFFSET
        if c0 < 0 or c1 < 0 or c2 < 0 or c0 > top or c1 > top or c2 > top:
            return -1
        key = (c0 << (2 * KEY_BITS)) | (c1 << KEY_BITS) | c2
        h = _slot(key, mask)
        while slot_key[h] != -1 and slot_key[h] != key:
            h = (h + 1) & mask
        if slot_key[h] == -1:
            slot_key[h] = key
            slot_id[h] = nv
            keys[nv] = key
            nv += 1
        v = slot_id[h]
        counts[v] += 1
        for d in range(3):
            sums[v, d] += np.float64(pts[i, d])
        for a in range(3):
            for b in range(3):
                csums[v, 3 * a + b] += np.float64(covs[i, a, b])
    return nv


def voxelize_cpu(points: torch.Tensor, lengths: list[int], covariances: torch.Tensor,
                 voxel_size: float) -> VoxelMap:
    """:func:`.reference.voxelize_reference` by one hashed pass per problem: the same map.

    The same cells (``floor(p · inv_size)`` in float64), sums in the same order and the
    same divisions, so keys, counts, means and covariances equal the reference's bits.
    """
    inv = 1.0 / float(voxel_size)
    per = []
    for b, m in enumerate(lengths):
        p = _np(points[b, :m])
        keys = np.empty(m, np.int64)
        sums = np.zeros((m, 3), np.float64)
        csums = np.zeros((m, 9), np.float64)
        counts = np.zeros(m, np.int64)
        nv = _voxel_sums(p, _np(covariances[b, :m]), inv, keys, sums, csums, counts)
        if nv < 0:
            raise too_small(voxel_size)
        order = np.argsort(keys[:nv])
        n = counts[order]
        nf = n.astype(np.float64)[:, None]
        per.append((torch.from_numpy(keys[order]),
                    torch.from_numpy(sums[order] / nf).to(points.dtype),
                    torch.from_numpy(csums[order] / nf).to(points.dtype).reshape(-1, 3, 3),
                    torch.from_numpy(n)))
    return padded_map(per, float(voxel_size), points.device, points.dtype)


def vgicp_sums_cpu(source, source_cov, Tf, keys, means, voxel_cov, inv_size, neighborhood,
                   rotation, lengths, center, kernel, scale) -> torch.Tensor:
    """``(B, 30)`` float64 sums of one VGICP iteration from the unmoved source (fused).

    ``Tf (B, 4, 4)``: the estimate in the points' dtype (moves the source); the rest as
    :func:`gicp_sums_cpu` and :func:`voxel_lookup_cpu`. Equal to ``gicp_sums_cpu`` of
    ``transform_points(Tf, source)`` and its ``voxel_lookup_cpu`` partners.
    """
    _threads.numba_threads()
    src = _np(source)
    Tp = Tf.detach().to(source.dtype)
    k = _np(keys)
    m = _np(means) if means.dtype == source.dtype else _np(means.to(source.dtype))
    table, mask = _voxel_table(k, _occupied(k))
    return torch.from_numpy(_vgicp_sums(
        _np(Tp[:, :3, :3]), _np(Tp[:, :3, 3]), src, _np(source_cov), k, m,
        _np(voxel_cov.to(source_cov.dtype)), table, mask, float(inv_size),
        _OFFSETS[:neighborhood], _np(rotation.to(torch.float64)),
        _np(lengths.to(torch.int64)), _np(center.to(torch.float64)), ROBUST_CODE[kernel],
        float(scale), ROBUST_SCALE2))


def gicp_step_sums_cpu(source, source_cov, Tf, target, target_cov, tree, hint, max_d2,
                       rotation, lengths, center, kernel, scale
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One GICP iteration's ``(B, 30)`` float64 sums and ``(B, N)`` partners, fused.

    ``tree``: the target's host k-d tree (:class:`pointalign.kernels.knn.cpu.CpuTree`, with
    its candidate lists if set), shared by every entry; ``hint (B, N)`` int64 original
    indices (-1: none); ``max_d2`` the squared bound. The rest as :func:`gicp_sums_cpu`.
    Equal to ``gicp_sums_cpu`` of ``transform_points(Tf, source)`` and the tree's
    ``nearest`` partners (:func:`_gicp_step_sums`).
    """
    _threads.numba_threads()
    src = _np(source)
    Tp = Tf.detach().to(source.dtype)
    B, N = src.shape[:2]
    idx = np.empty((B, N), np.int64)
    cand, cand_r2 = tree.candidates()
    sums = _gicp_step_sums(
        _np(Tp[:, :3, :3]), _np(Tp[:, :3, 3]), src, _np(source_cov),
        _np(target) if target.dtype == source.dtype else _np(target.to(source.dtype)),
        _np(target_cov.to(source_cov.dtype)), _np(hint.to(torch.int64)), tree.points,
        tree.perm, tree.spts, tree.lo, tree.hi, tree.bmin, tree.bmax, tree.nmin, tree.depth,
        tree.bound(max_d2), cand, cand_r2, _np(rotation.to(torch.float64)),
        _np(lengths.to(torch.int64)), _np(center.to(torch.float64)), ROBUST_CODE[kernel],
        float(scale), ROBUST_SCALE2, idx)
    return torch.from_numpy(sums), torch.from_numpy(idx)
