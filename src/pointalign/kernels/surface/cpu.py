"""CPU (numba) kernels of the distance-map registration: the contracts of :mod:`.surface`.

* :func:`newton_terms_cpu`: the fused Newton reduction of
  :func:`pointalign.kernels.surface.newton_terms` in one pass over the points, no
  ``(N, ·)`` intermediates: each of ``BLOCKS`` fixed point blocks moves its points, descends
  the tree to the level, reads the node's 10 coefficients and accumulates the 29 sums in
  float64 registers; the block partials are added in block order. The block split does not
  depend on the thread count, so the result is the same bit for bit with any
  ``set_num_threads``.
* :func:`node_frames_cpu`: mean, covariance (centred two-pass sums) and the closed-form
  eigenpairs (:func:`pointalign.kernels._nb_math.eigh3`) of every tree node, the contract of
  :func:`pointalign.kernels.surface.node_frames` (small nodes take their parent's
  frame); :func:`quadric_sums_cpu`: the sums of the second-order approximant's quadric
  fits. Both serial (once a call, ~10-30 ms on 70k points).

Rounding follows the reference (:func:`~pointalign.kernels.surface.newton_terms_reference`):
``T`` is rounded to the points' dtype, the moved point ``q`` is rounded to the points' dtype
(the descent compares it in the tree's dtype), and every term is then formed in float64 from
``q`` and the coefficients. The reference's float32 matrix product may round ``q`` one ulp
differently, which can send a point lying on a split plane to the neighbouring cell; apart
from that the sums differ only by the order of float64 additions.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pointalign import _threads
from pointalign.kernels._nb_math import add_horn, eigh3
from pointalign.kernels._numba import njit, prange
from pointalign.kernels.surface.reference import N_TERMS

#: point blocks of the reduction (fixed: the summation order does not depend on threads)
BLOCKS = 64
#: fewer points than this run on one thread (a parallel region costs more than it saves;
#: on a loaded machine OpenMP's wake-up of the other threads alone took 50-100 ms)
PARALLEL_MIN_POINTS = 32768
#: points descended together (their node reads overlap)
GROUP = 16


@njit(cache=True, inline="always")
def _move_descend(x, g0, g1, rt, q32, axis, split, depth, s32, qs, nodes):
    """Move the points ``x[g0:g1]`` by ``rt`` and descend them together to ``depth``.

    The moved points go to ``qs`` (rounded to float32 when ``q32``), their nodes at
    ``depth`` to ``nodes``. A group's chains of dependent node reads overlap (3x faster
    than one point after another). The descent compares ``q[axis] >= split`` (goes right)
    in the tree's dtype (float32 when ``s32``).
    """
    for k in range(g1 - g0):
        x0 = np.float64(x[g0 + k, 0])
        x1 = np.float64(x[g0 + k, 1])
        x2 = np.float64(x[g0 + k, 2])
        for r in range(3):
            q = rt[r, 0] * x0 + rt[r, 1] * x1 + rt[r, 2] * x2 + rt[r, 3]
            qs[k, r] = np.float64(np.float32(q)) if q32 else q
        nodes[k] = 0
    for _ in range(depth):
        for k in range(g1 - g0):
            node = nodes[k]
            qa = qs[k, axis[node]]
            if s32:
                qa = np.float64(np.float32(qa))
            nodes[k] = 2 * node + 1 + (1 if qa >= np.float64(split[node]) else 0)


@njit(cache=True, parallel=True)
def _terms(x, w, has_w, rt, center, axis, split, co, depth, tau2, q32, s32, obj_only):
    n = x.shape[0]
    part = np.zeros((BLOCKS, N_TERMS), np.float64)
    step = (n + BLOCKS - 1) // BLOCKS
    o0, o1, o2 = center[0], center[1], center[2]
    for blk in prange(BLOCKS):
        acc = np.zeros(N_TERMS, np.float64)
        qs = np.empty((GROUP, 3), np.float64)
        nodes = np.zeros(GROUP, np.int64)
        stop = min(n, (blk + 1) * step)
        for g0 in range(blk * step, stop, GROUP):
            g1 = min(stop, g0 + GROUP)
            # move a group of points, then descend them together: their chains of
            # dependent node reads overlap (3x faster than one point after another)
            _move_descend(x, g0, g1, rt, q32, axis, split, depth, s32, qs, nodes)
            for k in range(g1 - g0):
                i = g0 + k
                node = nodes[k]
                qx = qs[k, 0]
                qy = qs[k, 1]
                qz = qs[k, 2]
                a00 = np.float64(co[node, 0])
                a01 = np.float64(co[node, 1])
                a02 = np.float64(co[node, 2])
                a11 = np.float64(co[node, 3])
                a12 = np.float64(co[node, 4])
                a22 = np.float64(co[node, 5])
                b0 = np.float64(co[node, 6])
                b1 = np.float64(co[node, 7])
                b2 = np.float64(co[node, 8])
                c = np.float64(co[node, 9])
                ax_ = a00 * qx + a01 * qy + a02 * qz
                ay_ = a01 * qx + a11 * qy + a12 * qz
                az_ = a02 * qx + a12 * qy + a22 * qz
                h = (qx * ax_ + qy * ay_ + qz * az_) - 2.0 * (b0 * qx + b1 * qy + b2 * qz) + c
                h = max(h, 0.0)
                wt = np.float64(w[i]) if has_w else 1.0
                acc[27] += wt * min(h, tau2)
                if not h <= tau2:
                    continue  # truncated: the constant tau2 above, nothing in F, g
                if wt > 0.0:
                    acc[28] += 1.0
                if obj_only or wt == 0.0:
                    continue
                gx, gy, gz = ax_ - b0, ay_ - b1, az_ - b2
                px, py, pz = qx - o0, qy - o1, qz - o2
                # u_i = A m_i with m_i = e_i × p (the rotation columns of Q = [−[p]ₓ | I])
                u0x = a02 * py - a01 * pz
                u0y = a12 * py - a11 * pz
                u0z = a22 * py - a12 * pz
                u1x = a00 * pz - a02 * px
                u1y = a01 * pz - a12 * px
                u1z = a02 * pz - a22 * px
                u2x = a01 * px - a00 * py
                u2y = a11 * px - a01 * py
                u2z = a12 * px - a02 * py
                acc[0] += wt * (py * u0z - pz * u0y)
                acc[1] += wt * (py * u1z - pz * u1y)
                acc[2] += wt * (py * u2z - pz * u2y)
                acc[3] += wt * u0x
                acc[4] += wt * u0y
                acc[5] += wt * u0z
                acc[6] += wt * (pz * u1x - px * u1z)
                acc[7] += wt * (pz * u2x - px * u2z)
                acc[8] += wt * u1x
                acc[9] += wt * u1y
                acc[10] += wt * u1z
                acc[11] += wt * (px * u2y - py * u2x)
                acc[12] += wt * u2x
                acc[13] += wt * u2y
                acc[14] += wt * u2z
                acc[15] += wt * a00
                acc[16] += wt * a01
                acc[17] += wt * a02
                acc[18] += wt * a11
                acc[19] += wt * a12
                acc[20] += wt * a22
                acc[21] += wt * (pz * gy - py * gz)
                acc[22] += wt * (px * gz - pz * gx)
                acc[23] += wt * (py * gx - px * gy)
                acc[24] -= wt * gx
                acc[25] -= wt * gy
                acc[26] -= wt * gz
        for k in range(N_TERMS):
            part[blk, k] = acc[k]
    out = np.zeros(N_TERMS, np.float64)
    for blk in range(BLOCKS):
        for k in range(N_TERMS):
            out[k] += part[blk, k]
    return out


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def newton_terms_cpu(points: torch.Tensor, T: torch.Tensor, center: torch.Tensor, tree,
                     coeffs: torch.Tensor, depth: int, *, weights: torch.Tensor | None = None,
                     tau2: float = math.inf, objective_only: bool = False) -> torch.Tensor:
    """Return the ``(29,)`` float64 terms (arguments as in :func:`.surface.newton_terms`).

    The points, weights and split values reach the kernel as float64 (exact for float32) with
    flags saying where the reference rounds to float32, so one compiled signature serves
    both dtypes; coefficients other than float32 are passed as float64.
    """
    _threads_for(points.shape[0])
    x = _f64(points)
    # T rounded to the points' dtype, as the reference applies it
    rt = T.detach().to(points.dtype).to(torch.float64).cpu().numpy()
    o = center.detach().to(torch.float64).cpu().numpy().reshape(3)
    co = _np(coeffs)
    if co.dtype != np.float32:
        co = co.astype(np.float64)
    has_w = weights is not None
    w = _f64(weights) if weights is not None else np.zeros(1)
    d = max(0, min(int(depth), tree.depth))
    out = _terms(x, w, has_w, rt, o, _np(tree.split_axis), _f64(tree.split_value), co, d,
                 float(tau2), points.dtype == torch.float32,
                 tree.split_value.dtype == torch.float32, bool(objective_only))
    return torch.from_numpy(out)


def _threads_for(n: int) -> None:
    """All the configured threads for ``n`` items of work from PARALLEL_MIN_POINTS on, else 1."""
    if n >= PARALLEL_MIN_POINTS:
        _threads.numba_threads()
        return
    import numba

    if numba.get_num_threads() != 1:
        numba.set_num_threads(1)


def _f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).contiguous().numpy()


# ----------------------------------------------------------------------------- node frames


@njit(cache=True)
def _moments(pts, depth):
    """Mean ``(K, 3)`` and centred covariance ``(K, 6)`` (c00 c01 c02 c11 c12 c22) per node.

    Two passes over each node's range of the tree-ordered points (mean, then the centred
    second moment) in float64; serial: ~10 ms for 70k points, once a call (a parallel
    kernel compiles for seconds longer and gains a few milliseconds).
    """
    m = pts.shape[0]
    K = 2 ** (depth + 1) - 1
    mean = np.zeros((K, 3), np.float64)
    cov = np.zeros((K, 6), np.float64)
    for v in range(K):
        level = 0
        while (2 ** (level + 1)) - 1 <= v:
            level += 1
        j = v - (2**level - 1)
        s = (j * m) >> level
        e = ((j + 1) * m) >> level
        n = e - s
        m0 = 0.0
        m1 = 0.0
        m2 = 0.0
        for i in range(s, e):
            m0 += np.float64(pts[i, 0])
            m1 += np.float64(pts[i, 1])
            m2 += np.float64(pts[i, 2])
        m0 /= n
        m1 /= n
        m2 /= n
        c00 = 0.0
        c01 = 0.0
        c02 = 0.0
        c11 = 0.0
        c12 = 0.0
        c22 = 0.0
        for i in range(s, e):
            d0 = np.float64(pts[i, 0]) - m0
            d1 = np.float64(pts[i, 1]) - m1
            d2 = np.float64(pts[i, 2]) - m2
            c00 += d0 * d0
            c01 += d0 * d1
            c02 += d0 * d2
            c11 += d1 * d1
            c12 += d1 * d2
            c22 += d2 * d2
        mean[v, 0] = m0
        mean[v, 1] = m1
        mean[v, 2] = m2
        cov[v, 0] = c00 / n
        cov[v, 1] = c01 / n
        cov[v, 2] = c02 / n
        cov[v, 3] = c11 / n
        cov[v, 4] = c12 / n
        cov[v, 5] = c22 / n
    return mean, cov


@njit(cache=True)
def _frames(cov, sizes, min_points, depth):
    """Return frames ``(K, 3, 3)`` (columns e1, e2, n) and RMS radii ``(K,)`` of ``cov (K, 6)``.

    Nodes with fewer than ``min_points`` points take their parent's frame.
    """
    K = cov.shape[0]
    frame = np.empty((K, 3, 3), np.float64)
    radius = np.empty(K, np.float64)
    for v in range(K):
        ev, v0, v1, v2 = eigh3(cov[v, 0], cov[v, 1], cov[v, 2], cov[v, 3], cov[v, 4],
                               cov[v, 5])
        for r in range(3):
            frame[v, r, 0] = v2[r]
            frame[v, r, 1] = v1[r]
            frame[v, r, 2] = v0[r]
        radius[v] = math.sqrt(max(ev[0], 0.0) + max(ev[1], 0.0) + max(ev[2], 0.0))
    # level by level, top-down: a parent's frame is final before its children read it
    for level in range(1, depth + 1):
        for v in range(2**level - 1, 2 ** (level + 1) - 1):
            if sizes[v] < min_points:
                p = (v - 1) // 2
                for r in range(3):
                    for col in range(3):
                        frame[v, r, col] = frame[p, r, col]
    return frame, radius


def node_moments_cpu(tree) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``(K, 3)`` and covariance ``(K, 3, 3)`` float64 of every node of ``tree``.

    Centred two-pass sums per node (the reference takes differences of float64 prefix sums
    of the raw coordinates and their products; the two agree to the rounding of those).
    """
    mean, c = _moments(_f64(tree.points), int(tree.depth))
    cov = c[:, [0, 1, 2, 1, 3, 4, 2, 4, 5]].reshape(-1, 3, 3)
    return torch.from_numpy(mean), torch.from_numpy(cov)


def node_frames_cpu(tree, min_frame_points: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(mean (K, 3), frame (K, 3, 3), radius (K,))`` float64 of every node.

    The contract of :func:`pointalign.kernels.surface.node_frames`, for a tree in host
    memory.
    """
    mean, c = _moments(_f64(tree.points), int(tree.depth))
    sizes = _np(tree.end - tree.start)
    frame, radius = _frames(c, sizes, int(min_frame_points), int(tree.depth))
    return torch.from_numpy(mean), torch.from_numpy(frame), torch.from_numpy(radius)


@njit(cache=True)
def _quadric_sums(pts, mean, frame, depth):
    """Return the quadric fits' normal equations ``(K, 4, 4)`` and right-hand sides ``(K, 4)``.

    For every node, its points in its PCA frame ``(u, v, w) = (p − mean) · frame`` give
    ``φ = (u², uv, v², 1)``; the sums are ``Σ φφᵀ`` and ``Σ φ w`` in float64.
    """
    m = pts.shape[0]
    K = 2 ** (depth + 1) - 1
    ne = np.zeros((K, 4, 4), np.float64)
    rhs = np.zeros((K, 4), np.float64)
    for v in range(K):
        level = 0
        while (2 ** (level + 1)) - 1 <= v:
            level += 1
        j = v - (2**level - 1)
        s = (j * m) >> level
        e = ((j + 1) * m) >> level
        phi = np.empty(4)
        for i in range(s, e):
            d0 = pts[i, 0] - mean[v, 0]
            d1 = pts[i, 1] - mean[v, 1]
            d2 = pts[i, 2] - mean[v, 2]
            u = d0 * frame[v, 0, 0] + d1 * frame[v, 1, 0] + d2 * frame[v, 2, 0]
            vv = d0 * frame[v, 0, 1] + d1 * frame[v, 1, 1] + d2 * frame[v, 2, 1]
            w = d0 * frame[v, 0, 2] + d1 * frame[v, 1, 2] + d2 * frame[v, 2, 2]
            phi[0] = u * u
            phi[1] = u * vv
            phi[2] = vv * vv
            phi[3] = 1.0
            for a in range(4):
                for b in range(4):
                    ne[v, a, b] += phi[a] * phi[b]
                rhs[v, a] += phi[a] * w
    return ne, rhs


def quadric_sums_cpu(tree, mean: torch.Tensor, frame: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the quadric fits' ``(K, 4, 4)`` and ``(K, 4)`` float64 sums (``_quadric_sums``)."""
    ne, rhs = _quadric_sums(_f64(tree.points), _f64(mean), _f64(frame), int(tree.depth))
    return torch.from_numpy(ne), torch.from_numpy(rhs)


# ----------------------------------------------------------------------------- cell means


@njit(cache=True, parallel=True)
def _cell_mean_sums(x, rt, axis, split, means, depth, tau2, center, q32, s32):
    """Horn's 30 sums of the approximate-ICP step (the layout of ``normal_eq``), one pass.

    Each point is moved by ``rt`` (rounded to float32 when ``q32``), descended to ``depth``
    (groups of ``GROUP`` points together, as :func:`_terms`), paired with its node's mean and
    kept when ``||q − mean||² <= tau2``; coordinates are centred on ``center``.
    """
    n = x.shape[0]
    part = np.zeros((BLOCKS, 30), np.float64)
    step = (n + BLOCKS - 1) // BLOCKS
    c0, c1, c2 = center[0], center[1], center[2]
    for blk in prange(BLOCKS):
        acc = np.zeros(30, np.float64)
        qs = np.empty((GROUP, 3), np.float64)
        nodes = np.zeros(GROUP, np.int64)
        stop = min(n, (blk + 1) * step)
        for g0 in range(blk * step, stop, GROUP):
            g1 = min(stop, g0 + GROUP)
            _move_descend(x, g0, g1, rt, q32, axis, split, depth, s32, qs, nodes)
            for k in range(g1 - g0):
                node = nodes[k]
                y0 = np.float64(means[node, 0])
                y1 = np.float64(means[node, 1])
                y2 = np.float64(means[node, 2])
                d0, d1, d2 = qs[k, 0] - y0, qs[k, 1] - y1, qs[k, 2] - y2
                dd = d0 * d0 + d1 * d1 + d2 * d2
                if not dd <= tau2:
                    continue
                x0, x1, x2 = qs[k, 0] - c0, qs[k, 1] - c1, qs[k, 2] - c2
                y0 -= c0
                y1 -= c1
                y2 -= c2
                add_horn(acc, 1.0, x0, x1, x2, y0, y1, y2)
                acc[28] += 1.0
                acc[29] += dd
        for k in range(30):
            part[blk, k] = acc[k]
    out = np.zeros(30, np.float64)
    for blk in range(BLOCKS):
        for k in range(30):
            out[k] += part[blk, k]
    return out


def cell_mean_sums_cpu(points: torch.Tensor, T: torch.Tensor, tree, means: torch.Tensor,
                       depth: int, *, tau2: float = math.inf,
                       center: torch.Tensor | None = None) -> torch.Tensor:
    """Return the ``(30,)`` float64 sums (arguments as in :func:`.surface.cell_mean_sums`).

    One compiled signature for float32 and float64 points (passed as float64 with flags
    saying where the reference rounds to float32, as :func:`newton_terms_cpu`).
    """
    _threads_for(points.shape[0])
    x = _f64(points)
    rt = T.detach().to(points.dtype).to(torch.float64).cpu().numpy()
    c = np.zeros(3) if center is None else \
        center.detach().to(points.dtype).to(torch.float64).cpu().numpy().reshape(3)
    d = max(0, min(int(depth), tree.depth))
    out = _cell_mean_sums(x, rt, _np(tree.split_axis), _f64(tree.split_value), _f64(means), d,
                          float(tau2), c, points.dtype == torch.float32,
                          tree.split_value.dtype == torch.float32)
    return torch.from_numpy(out)
