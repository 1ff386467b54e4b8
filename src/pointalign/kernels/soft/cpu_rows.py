"""The soft methods' numba row passes on the CPU: one row reduction over a k-d tree.

:func:`rows` computes ``soft_rows``' reductions (lse, lse2, mean) for one problem with all
cores: each (moved) query walks the tree of the points, keeps the pairs within a squared
radius (inf: every pair, the exact form) and sums in float64, with a running maximum per
row (:func:`_rows_log`) or, where every kept term is representable, linear weights and one
exponential per pair (:func:`_rows_linear`): both run the one body :func:`_row` with its
mode a constant (``_row_log``, ``_row_linear``: outside the parallel loop, whose invariants
become arguments, so that the compiler drops the other mode's code).
:func:`nearest_d2` is the fitness pass (the exact nearest point through the same trees).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from pointalign import _threads
from pointalign.kernels._numba import njit, prange
from pointalign.kernels.knn.cpu import CpuTree, _boxd2
from pointalign.kernels.soft.cpu_plan import LEAF_SIZE, Plan


@njit(cache=True, inline="always")
def _leaves_within(q0, q1, q2, bmin, bmax, depth, r2, stack, leaves):
    """Fill ``leaves`` with the leaves whose boxes lie within ``r2`` (squared) of the query.

    In the walk's order (the right child first), the order the pair kernels keep; returns
    how many.
    """
    first_leaf = (1 << depth) - 1
    n = 0
    top = 1
    stack[0] = 0
    while top > 0:
        top -= 1
        v = stack[top]
        if _boxd2(q0, q1, q2, bmin, bmax, v) > r2:
            continue
        if v >= first_leaf:
            leaves[n] = v
            n += 1
            continue
        stack[top] = 2 * v + 1
        stack[top + 1] = 2 * v + 2
        top += 2
    return n



@njit(cache=True, inline="always")
def _row(i, q, g, perm, spts, lo, hi, bmin, bmax, depth, s, r2, want2, sq_w, linear, lse,
         lse2, mean):
    """Query ``i``'s row reductions over the stored points within ``r2`` (see :func:`_rows_log`).

    ``linear`` (a constant in each caller, so the other mode compiles away): ``g`` holds
    linear weights ``w_j`` and each term is ``w_j e^(−s d²)`` (no running maximum; the
    caller adds the shift back); else ``g`` holds log weights and the sums run in the log
    domain with a running maximum.
    """
    stack = np.empty(2 * depth + 4, np.int64)
    leaves = np.empty(1 << depth, np.int64)
    q0, q1, q2 = q[i, 0], q[i, 1], q[i, 2]
    m1 = 0.0 if linear else -np.inf
    m2 = 0.0 if linear else -np.inf
    l1 = 0.0
    l2 = 0.0
    u0 = 0.0
    u1 = 0.0
    u2 = 0.0
    for li in range(_leaves_within(q0, q1, q2, bmin, bmax, depth, r2, stack, leaves)):
        v = leaves[li]
        for j in range(lo[v], hi[v]):
            p0, p1, p2 = spts[j, 0], spts[j, 1], spts[j, 2]
            e0, e1, e2 = q0 - p0, q1 - p1, q2 - p2
            dd = e0 * e0 + e1 * e1 + e2 * e2
            if dd > r2:
                continue
            if linear:
                k = math.exp(-s * dd)
                e = g[perm[j]] * k
                l1 += e
                if want2:
                    l2 += e * e if sq_w else e * k
            else:
                gj = g[perm[j]]
                z = gj - s * dd
                if z > m1:
                    a = math.exp(m1 - z)
                    l1 *= a
                    u0 *= a
                    u1 *= a
                    u2 *= a
                    m1 = z
                e = math.exp(z - m1)
                l1 += e
                if want2:
                    z2 = (2.0 * gj if sq_w else gj) - 2.0 * s * dd
                    if z2 > m2:
                        l2 *= math.exp(m2 - z2)
                        m2 = z2
                    l2 += math.exp(z2 - m2)
            u0 += e * p0
            u1 += e * p1
            u2 += e * p2
    if l1 > 0:
        lse[i] = m1 + math.log(l1)
        mean[i, 0] = u0 / l1
        mean[i, 1] = u1 / l1
        mean[i, 2] = u2 / l1
    else:
        lse[i] = -np.inf
        mean[i, 0] = 0.0
        mean[i, 1] = 0.0
        mean[i, 2] = 0.0
    lse2[i] = m2 + math.log(l2) if l2 > 0 else -np.inf


@njit(cache=True)
def _row_log(i, q, g, perm, spts, lo, hi, bmin, bmax, depth, s, r2, want2, sq_w, lse, lse2,
             mean):
    """:func:`_row` in the log domain (its constant ``linear`` folds away here)."""
    _row(i, q, g, perm, spts, lo, hi, bmin, bmax, depth, s, r2, want2, sq_w, False, lse, lse2,
         mean)


@njit(cache=True)
def _row_linear(i, q, w, perm, spts, lo, hi, bmin, bmax, depth, s, r2, want2, sq_w, lse, lse2,
                mean):
    """:func:`_row` with linear weights (its constant ``linear`` folds away here)."""
    _row(i, q, w, perm, spts, lo, hi, bmin, bmax, depth, s, r2, want2, sq_w, True, lse, lse2,
         mean)


@njit(cache=True, parallel=True)
def _rows_log(q, g, perm, spts, lo, hi, bmin, bmax, depth, s, r2, want2, sq_w, lse, lse2,
              mean):
    """Row reductions over the stored points within ``r2`` of each (moved) query.

    ``lse_i = log Σ_j exp(−s d² + g_j)``, ``lse2_i = log Σ_j exp(2(−s d²) + c g_j)`` (when
    ``want2``; c = 2 with ``sq_w``, the square of each term, else 1: g_j = log n_j, a cell's
    count enters once), ``mean_i`` the first sum's weighted mean of the points; running
    maxima keep every sum finite.
    """
    for i in prange(q.shape[0]):
        # the index as int64: typed as range's int64, then as the gufunc's uint64, it would
        # compile _row_log twice
        _row_log(np.int64(i), q, g, perm, spts, lo, hi, bmin, bmax, depth, s, r2, want2, sq_w,
                 lse, lse2, mean)


@njit(cache=True, parallel=True)
def _rows_linear(q, w, perm, spts, lo, hi, bmin, bmax, depth, s, r2, want2, sq_w, lse, lse2,
                 mean):
    """:func:`_rows_log` with linear weights ``w_j = exp(g_j − shift)`` and no running maximum.

    Only for a finite ``r2`` with every kept term representable (the caller checks
    ``s·r2 + 2·spread of g < LINEAR_RANGE``): one exponential per pair.
    ``lse2 = log Σ_j w_j^c exp(−2 s d²)`` (c = 2 with ``sq_w``, else 1; when ``want2``);
    the caller adds the shift back.
    """
    for i in prange(q.shape[0]):
        _row_linear(np.int64(i), q, w, perm, spts, lo, hi, bmin, bmax, depth, s, r2, want2,
                    sq_w, lse, lse2, mean)


#: largest ``s·r2 + (max g − min g)`` for which :func:`_rows_linear` is used (e^-600 > 0)
LINEAR_RANGE = 600.0


def _run_rows(q, g, tree: CpuTree, s: float, r2: float, squares: bool,
              square_weights: bool = False):
    """``(lse, lse2, mean)`` NumPy float64 of the queries ``q`` against ``tree``'s points.

    ``square_weights``: lse2 sums the squares of the terms (``soft_rows``' contract); else
    each weight enters lse2 once (cells: a count).
    """
    n = q.shape[0]
    lse, lse2, mean = np.empty(n), np.empty(n), np.empty((n, 3))
    q = np.ascontiguousarray(q)
    gmax = float(g.max()) if g.shape[0] else 0.0
    gmin = float(g.min()) if g.shape[0] else 0.0
    if math.isfinite(gmax) and math.isfinite(gmin) and \
            2 * (s * r2 + gmax - gmin) < LINEAR_RANGE:
        _rows_linear(q, np.exp(g - gmax), tree.perm, tree.spts, tree.lo, tree.hi, tree.bmin,
                     tree.bmax, tree.depth, s, r2, squares, square_weights, lse, lse2, mean)
        lse += gmax
        lse2 += 2 * gmax if square_weights else gmax
    else:
        _rows_log(q, np.ascontiguousarray(g), tree.perm, tree.spts, tree.lo, tree.hi,
                  tree.bmin, tree.bmax, tree.depth, s, r2, squares, square_weights, lse, lse2,
                  mean)
    return lse, lse2, mean


def _tree(plan_: Plan, points: Any, key) -> CpuTree:
    """Return the run's tree of ``points()`` (a function giving ``(M, 3)`` float64)."""
    return plan_.cache.get(("tree",) + key, lambda: CpuTree(points(), leaf_size=LEAF_SIZE))


def rows(query: torch.Tensor, points: torch.Tensor, transform: torch.Tensor, scale: float, *,
         log_weights: torch.Tensor | None = None, radius2: float = math.inf,
         squares: bool = False, plan_: Plan | None = None, numpy: bool = False):
    """Row reductions ``(lse (N,), lse2 (N,) or None, mean (N, 3))`` of one problem.

    ``lse_i = log Σ_j exp(−s ||R q_i + t − p_j||² + g_j)`` over the pairs within
    ``radius2`` (squared; inf: all), as :func:`.reference.soft_rows_reference`.

    Args:
        query: ``(N, 3)`` float tensor, moved by ``transform``.
        points: ``(M, 3)`` float tensor (M >= 1).
        transform: ``(4, 4)`` float tensor applied to the query.
        scale: s > 0.
        log_weights: optional ``(M,)`` g_j.
        radius2: squared truncation radius.
        squares: also ``lse2 = log Σ_j exp(2(−s d² + g_j))``.
        plan_: the run's :class:`Plan` (caches the tree of ``points``), or None.
        numpy: return NumPy float64 arrays instead.

    Returns:
        the reductions in the query's dtype (CPU tensors).

    """
    _threads.numba_threads()
    dt = query.dtype
    T = transform.detach().to(torch.float64).cpu().numpy()
    q = query.detach().cpu().to(torch.float64).numpy() @ T[:3, :3].T + T[:3, 3]
    key = (points.data_ptr(), tuple(points.shape), points.stride())

    def p64() -> np.ndarray:
        return points.detach().cpu().to(torch.float64).numpy()
    tree = CpuTree(p64(), leaf_size=LEAF_SIZE) if plan_ is None else _tree(plan_, p64, key)
    g = np.zeros(points.shape[0]) if log_weights is None else \
        log_weights.detach().cpu().to(torch.float64).numpy()
    lse, lse2, mean = _run_rows(q, g, tree, float(scale), float(radius2), squares,
                                square_weights=True)
    if numpy:
        return lse, lse2, mean
    return (torch.from_numpy(lse).to(dt), torch.from_numpy(lse2).to(dt) if squares else None,
            torch.from_numpy(mean).to(dt))


def _weights(lse: np.ndarray, lse2: np.ndarray, log_outlier: float) -> np.ndarray:
    """EM-ICP's λ from the row sums (as ``soft.emicp_weights``, in NumPy float64)."""
    log_c = np.logaddexp(lse2, log_outlier)
    log_c[np.isinf(log_c)] = 0.0
    with np.errstate(invalid="ignore"):
        lam = np.exp(lse - 0.5 * log_c)
    return np.nan_to_num(lam, nan=0.0)


def nearest_d2(query: torch.Tensor, points: torch.Tensor, transform: torch.Tensor,
               query_lengths: torch.Tensor, point_lengths: torch.Tensor,
               max_d2: torch.Tensor, plan_: Plan) -> torch.Tensor:
    """Exact squared distance of each moved query to its nearest point within ``max_d2``.

    Args:
        query: ``(B, N, 3)`` float tensor, moved by ``transform (B, 4, 4)``.
        points: ``(B, M, 3)`` float tensor.
        transform: ``(B, 4, 4)``.
        query_lengths: ``(B,)`` valid queries.
        point_lengths: ``(B,)`` valid points.
        max_d2: ``(B,)`` squared bound.
        plan_: the run's :class:`Plan` (caches the trees).

    Returns:
        ``(B, N)`` float64, ``inf`` beyond the bound and on padding rows (the k-d tree of
        ``kernels.knn.cpu``: float64 distances, no soft-min).

    """
    B, N = query.shape[:2]
    out = np.full((B, N), np.inf)
    ql, pl, md = query_lengths.tolist(), point_lengths.tolist(), max_d2.tolist()
    for b in range(B):
        if ql[b] == 0 or pl[b] == 0:
            continue
        p = points[b, :pl[b]]
        key = (p.data_ptr(), tuple(p.shape), p.stride())
        tree = _tree(plan_, lambda p=p: p.detach().cpu().to(torch.float64).numpy(), key)
        T = transform[b].detach().to(torch.float64).cpu().numpy()
        q = query[b, :ql[b]].detach().cpu().to(torch.float64).numpy() @ T[:3, :3].T + T[:3, 3]
        d2, _ = tree.nearest(q, float(md[b]))
        out[b, :ql[b]] = d2
    return torch.from_numpy(out)
