"""The soft methods' "cells" forms on the CPU: merged clouds, kernel matrices, fused updates.

EM-ICP (:func:`emicp_cells`): both clouds merged into cells of side c·σ per annealing step,
a source cell's centroid against the target cells (weighted by their counts) through the row
pass of ``cpu_rows``, each source point taking its cell's E-step values. Softassign
(:func:`softassign_cells`, :func:`softassign_update`): cells of side c·σ (σ = 1/√(2β)) while
they merge points; within one pose update every pass sees the same cell pairs, so their
kernel values are computed once into a sparse matrix (:func:`_kernel_matrix_rows`, at most
``KERNEL_CACHE_PAIRS``) and each Sinkhorn pass is a product with it or its transpose;
:func:`softassign_update` runs a whole update's passes in one call over such a matrix built
from candidate pairs (:func:`_candidates`). The forms' bounds: :mod:`pointalign.kernels.soft.cpu`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from pointalign import _threads
from pointalign.kernels._numba import njit, prange
from pointalign.kernels.knn.cpu import CpuTree
from pointalign.kernels.soft.cpu_plan import (
    KERNEL_CACHE_PAIRS,
    LEAF_SIZE,
    Plan,
    _merge,
    cell_side,
)
from pointalign.kernels.soft.cpu_rows import (
    LINEAR_RANGE,
    _leaves_within,
    _run_rows,
    _tree,
    _weights,
)
from pointalign.kernels.soft.reference import sinkhorn_normalise


@njit(cache=True, parallel=True)
def _pair_count(q, spts, lo, hi, bmin, bmax, depth, r2, counts):
    """Count the stored points within ``r2`` of each query (the CSR row lengths)."""
    for i in prange(q.shape[0]):
        stack = np.empty(2 * depth + 4, np.int64)
        leaves = np.empty(1 << depth, np.int64)
        q0, q1, q2 = q[i, 0], q[i, 1], q[i, 2]
        c = 0
        for li in range(_leaves_within(q0, q1, q2, bmin, bmax, depth, r2, stack, leaves)):
            v = leaves[li]
            for j in range(lo[v], hi[v]):
                e0, e1, e2 = q0 - spts[j, 0], q1 - spts[j, 1], q2 - spts[j, 2]
                if e0 * e0 + e1 * e1 + e2 * e2 <= r2:
                    c += 1
        counts[i] = c


@njit(cache=True, parallel=True)
def _pair_fill(q, perm, spts, lo, hi, bmin, bmax, depth, s, r2, indptr, cols, vals):
    """CSR of ``exp(−s d²)`` over the pairs within ``r2`` (columns: the points' indices)."""
    for i in prange(q.shape[0]):
        stack = np.empty(2 * depth + 4, np.int64)
        leaves = np.empty(1 << depth, np.int64)
        q0, q1, q2 = q[i, 0], q[i, 1], q[i, 2]
        k = indptr[i]
        for li in range(_leaves_within(q0, q1, q2, bmin, bmax, depth, r2, stack, leaves)):
            v = leaves[li]
            for j in range(lo[v], hi[v]):
                e0, e1, e2 = q0 - spts[j, 0], q1 - spts[j, 1], q2 - spts[j, 2]
                dd = e0 * e0 + e1 * e1 + e2 * e2
                if dd <= r2:
                    cols[k] = perm[j]
                    vals[k] = math.exp(-s * dd)
                    k += 1


@njit(cache=True, parallel=True)
def _csr_rows(indptr, cols, vals, w, pts, lse, mean):
    """Per row i: ``lse_i = log Σ vals·w[col]``, ``mean_i`` that sum's mean of ``pts[col]``."""
    for i in prange(indptr.shape[0] - 1):
        l1 = 0.0
        u0 = 0.0
        u1 = 0.0
        u2 = 0.0
        for k in range(indptr[i], indptr[i + 1]):
            j = cols[k]
            e = vals[k] * w[j]
            l1 += e
            u0 += e * pts[j, 0]
            u1 += e * pts[j, 1]
            u2 += e * pts[j, 2]
        if l1 > 0:
            lse[i] = math.log(l1)
            mean[i, 0] = u0 / l1
            mean[i, 1] = u1 / l1
            mean[i, 2] = u2 / l1
        else:
            lse[i] = -np.inf
            mean[i, 0] = 0.0
            mean[i, 1] = 0.0
            mean[i, 2] = 0.0


@njit(cache=True, parallel=True)
def _pair_index(q, spts, lo, hi, bmin, bmax, depth, r2, indptr, idx):
    """:func:`_pair_fill`'s pairs as indices into the tree's sorted points (no values)."""
    for i in prange(q.shape[0]):
        stack = np.empty(2 * depth + 4, np.int64)
        leaves = np.empty(1 << depth, np.int64)
        q0, q1, q2 = q[i, 0], q[i, 1], q[i, 2]
        k = indptr[i]
        for li in range(_leaves_within(q0, q1, q2, bmin, bmax, depth, r2, stack, leaves)):
            v = leaves[li]
            for j in range(lo[v], hi[v]):
                e0, e1, e2 = q0 - spts[j, 0], q1 - spts[j, 1], q2 - spts[j, 2]
                if e0 * e0 + e1 * e1 + e2 * e2 <= r2:
                    idx[k] = j
                    k += 1


@njit(cache=True, parallel=True)
def _cand_count(q, spts, cptr, cidx, r2, counts):
    """:func:`_pair_count` over candidate pairs (a superset in the tree walk's order)."""
    for i in prange(q.shape[0]):
        q0, q1, q2 = q[i, 0], q[i, 1], q[i, 2]
        c = 0
        for k in range(cptr[i], cptr[i + 1]):
            j = cidx[k]
            e0, e1, e2 = q0 - spts[j, 0], q1 - spts[j, 1], q2 - spts[j, 2]
            if e0 * e0 + e1 * e1 + e2 * e2 <= r2:
                c += 1
        counts[i] = c


@njit(cache=True, parallel=True)
def _cand_fill(q, perm, spts, cptr, cidx, s, r2, indptr, cols, vals):
    """:func:`_pair_fill` over candidate pairs: the same pairs, order and values."""
    for i in prange(q.shape[0]):
        q0, q1, q2 = q[i, 0], q[i, 1], q[i, 2]
        k = indptr[i]
        for m in range(cptr[i], cptr[i + 1]):
            j = cidx[m]
            e0, e1, e2 = q0 - spts[j, 0], q1 - spts[j, 1], q2 - spts[j, 2]
            dd = e0 * e0 + e1 * e1 + e2 * e2
            if dd <= r2:
                cols[k] = perm[j]
                vals[k] = math.exp(-s * dd)
                k += 1


@njit(cache=True, parallel=True)
def _span_rows(start, end, cols, vals, w, lse):
    """:func:`_csr_rows`' lse over row spans ``[start_i, end_i)`` (no means; same sums)."""
    for i in prange(start.shape[0]):
        l1 = 0.0
        for k in range(start[i], end[i]):
            l1 += vals[k] * w[cols[k]]
        lse[i] = math.log(l1) if l1 > 0 else -np.inf


@njit(cache=True)
def _span_cols(start, end, cols, vals, w, pts, n_cols, want_mean, lse, mean):
    """:func:`_csr_rows` of the transpose over row spans ``[start_i, end_i)``.

    Per column j, the rows weighted by ``w``; the means only when ``want_mean`` (else the
    ``mean`` rows of a column with a positive sum are left as zeros).
    """
    acc = np.zeros((n_cols, 4))
    for i in range(start.shape[0]):
        wi = w[i]
        p0, p1, p2 = pts[i, 0], pts[i, 1], pts[i, 2]
        for k in range(start[i], end[i]):
            j = cols[k]
            e = vals[k] * wi
            acc[j, 0] += e
            if want_mean:
                acc[j, 1] += e * p0
                acc[j, 2] += e * p1
                acc[j, 3] += e * p2
    for j in range(n_cols):
        l1 = acc[j, 0]
        if l1 > 0:
            lse[j] = math.log(l1)
            mean[j, 0] = acc[j, 1] / l1
            mean[j, 1] = acc[j, 2] / l1
            mean[j, 2] = acc[j, 3] / l1
        else:
            lse[j] = -np.inf
            mean[j, 0] = 0.0
            mean[j, 1] = 0.0
            mean[j, 2] = 0.0



def emicp_cells(source: torch.Tensor, target: torch.Tensor, transform: torch.Tensor,
                scale: float, log_outlier: float, plan_: Plan):
    """EM-ICP's E-step per source cell in "cells" form (module doc), NumPy float64.

    Args:
        source: ``(N, 3)`` float tensor (source frame; its cells do not move with the pose).
        target: ``(M, 3)`` float tensor.
        transform: ``(4, 4)`` applied to the source.
        scale: s = 1/(2σ²).
        log_outlier: −d₀²/σ² (−inf: no outlier term).
        plan_: the run's :class:`Plan` (caches cells and trees per level).

    Returns:
        ``(λ (V,), x' (V, 3), centroids (V, 3), counts (V,), inverse (N,) or None)`` of the
        V source cells (inverse: each source point's cell; None: one point per cell).

    """
    _threads.numba_threads()
    sigma = math.sqrt(0.5 / scale)
    level, a = cell_side(sigma, plan_.cell_ratio)

    def cells(t: torch.Tensor):
        key = ("cells", t.data_ptr(), tuple(t.shape), t.stride(), level)

        def make():
            c, n, inv = _merge(t.detach().cpu().to(torch.float64).numpy(), a)
            if inv is None:  # one point per cell: the points' own tree, built once per run
                tree = _tree(plan_, lambda: c, (t.data_ptr(), tuple(t.shape), t.stride()))
            else:
                tree = CpuTree(c, leaf_size=LEAF_SIZE)
            return c, n, np.log(n), inv, tree
        return plan_.cache.get(key, make)

    sc, sn, _, sinv, _ = cells(source)
    _, _, tg, _, tree = cells(target)
    T = transform.detach().to(torch.float64).cpu().numpy()
    q = sc @ T[:3, :3].T + T[:3, 3]
    r = plan_.k * sigma
    lse, lse2, mean = _run_rows(q, tg, tree, float(scale), r * r, True)
    return _weights(lse, lse2, log_outlier), mean, sc, sn, sinv



def _cell_weights(pts: np.ndarray, inv: np.ndarray, v: int, g: np.ndarray):
    """Per cell: ``(log Σ_j e^(g_j) (V,), weighted centroid (V, 3), constant (bool))``.

    ``constant``: every cell's g_j are equal (the weighted centroids are the plain ones).
    """
    cmax = np.full(v, -np.inf)
    np.maximum.at(cmax, inv, g)
    cmin = np.full(v, np.inf)
    np.minimum.at(cmin, inv, g)
    base = np.where(np.isfinite(cmax), cmax, 0.0)
    w = np.exp(g - base[inv])
    ws = np.bincount(inv, weights=w, minlength=v)
    cen = np.empty((v, 3))
    for d in range(3):
        cen[:, d] = np.bincount(inv, weights=w * pts[:, d], minlength=v)
    with np.errstate(divide="ignore", invalid="ignore"):
        cen /= ws[:, None]
        lg = base + np.log(ws)
    return lg, cen, bool(np.all(cmax == cmin))


def _kernel_matrix_rows(plan_: Plan, qkey: tuple, pkey: tuple, qcen: np.ndarray,
                        pcen: np.ndarray, tree: CpuTree, T: np.ndarray, s: float, r2: float,
                        lg: np.ndarray):
    """Run a "cells" pass through the update's kernel matrix: ``(lse, mean)`` or None.

    Within one Softassign update (one pose, one β) the row and the column passes see the
    same cell pairs, ``K_IJ = exp(−s |T x̄_I − ȳ_J|²)`` within ``r2``: it is computed once
    (sparse, CSR over the first pass's query cells) and each pass is a product with it (the
    column passes through its transpose, ``|T⁻¹ ȳ − x̄| = |T x̄ − ȳ|``). None: not cached
    (more than ``KERNEL_CACHE_PAIRS`` pairs, or weights too spread for linear sums); the
    caller runs the tree pass. The same sums as that pass (float64, another order).
    """
    gmax, gmin = float(lg.max()), float(lg.min())
    if not 2 * (s * r2 + gmax - gmin) < LINEAR_RANGE:
        return None
    slot = plan_.cache.items.get("kernel")
    forward = transpose = False
    if slot is not None and slot["s"] == s and slot["r2"] == r2:
        if slot["q"] == qkey and slot["p"] == pkey and np.array_equal(slot["T"], T):
            forward = True
        elif slot["q"] == pkey and slot["p"] == qkey:
            Ti = np.linalg.inv(T)
            tol = 1e-12 * (1.0 + float(np.abs(T[:3, 3]).max()))
            transpose = bool(np.allclose(Ti, slot["T"], rtol=0, atol=tol))
    if not forward and not transpose:
        plan_.cache.items.pop("kernel", None)
        q = np.ascontiguousarray(qcen @ T[:3, :3].T + T[:3, 3])
        counts = np.empty(q.shape[0], np.int64)
        _pair_count(q, tree.spts, tree.lo, tree.hi, tree.bmin, tree.bmax, tree.depth, r2,
                    counts)
        indptr = np.zeros(q.shape[0] + 1, np.int64)
        np.cumsum(counts, out=indptr[1:])
        nnz = int(indptr[-1])
        if nnz > KERNEL_CACHE_PAIRS:
            return None
        cols, vals = np.empty(nnz, np.int64), np.empty(nnz)
        _pair_fill(q, tree.perm, tree.spts, tree.lo, tree.hi, tree.bmin, tree.bmax, tree.depth,
                   s, r2, indptr, cols, vals)
        slot = dict(q=qkey, p=pkey, T=T.copy(), s=s, r2=r2, indptr=indptr, cols=cols,
                    vals=vals, qcen=qcen, n_p=pcen.shape[0])
        plan_.cache.items["kernel"] = slot
        forward = True
    assert slot is not None
    w = np.exp(lg - gmax)
    if forward:
        n = slot["indptr"].shape[0] - 1
        lse, mean = np.empty(n), np.empty((n, 3))
        _csr_rows(slot["indptr"], slot["cols"], slot["vals"], w, pcen, lse, mean)
    else:
        n = slot["n_p"]
        lse, mean = np.empty(n), np.empty((n, 3))
        ip = slot["indptr"]
        _span_cols(ip[:-1], ip[1:], slot["cols"], slot["vals"], w, pcen, n, True, lse, mean)
    return lse + gmax, mean


def _level_cells(plan_: Plan, t: torch.Tensor, level: int, a: float):
    """Return a cloud's cells at a level (cached): ``(p64, centroids, counts, inverse, first)``.

    ``inverse`` (N,) each point's cell and ``first`` (V,) each cell's first point, both
    None when every cell holds one point (the centroids are then the points).
    """
    key = ("cells", t.data_ptr(), tuple(t.shape), t.stride(), level)

    def make():
        p64 = t.detach().cpu().to(torch.float64).numpy()
        c, n, inv = _merge(p64, a)
        first = None if inv is None else np.unique(inv, return_index=True)[1]
        return p64, c, n, inv, first
    return plan_.cache.get(key, make)


def softassign_cells(query: torch.Tensor, points: torch.Tensor, transform: torch.Tensor,
                      s: float, g: torch.Tensor | None, r2: float, plan_: Plan):
    """One Softassign pass in "cells" form: ``(lse (N,), mean (N, 3))`` NumPy, or None.

    σ = 1/√(2s); both clouds merged into cells of side ``cell_ratio``·σ (rounded down to a
    power of √2, cached per level); a query cell's centroid (moved) against the point cells
    (weight Σ_j e^(g_j), weighted centroid), cell pairs beyond √r2 + 2√3·side dropped (so
    every dropped point pair lies beyond √r2); each query point takes its cell's values.
    None when both clouds have one point per cell at this σ (the caller runs per point).
    """
    sigma = math.sqrt(0.5 / s)
    level, a = cell_side(sigma, plan_.cell_ratio)
    qp, qc, _, qinv, _ = _level_cells(plan_, query, level, a)
    pp, pc, pn, pinv, pfirst = _level_cells(plan_, points, level, a)
    if qinv is None and pinv is None:
        return None
    plan_.cache.count("cells")
    gp = np.zeros(pp.shape[0]) if g is None else g.detach().cpu().to(torch.float64).numpy()
    pkey = ("cells", points.data_ptr(), tuple(points.shape), points.stride(), level)
    if pinv is None:
        lg, cen, const = gp, pp, True
    elif np.array_equal(gp, gp[pfirst][pinv]):  # one weight per cell (Sinkhorn at one level)
        lg, cen, const = np.log(pn) + gp[pfirst], pc, True
    else:
        lg, cen, const = _cell_weights(pp, pinv, pc.shape[0], gp)
    keep = np.isfinite(lg)
    if const and bool(keep.all()):  # weighted = plain centroids: the level's cached tree
        tree = plan_.cache.get(("ctree",) + pkey, lambda: CpuTree(cen, leaf_size=LEAF_SIZE))
    elif not keep.any():
        n = qp.shape[0]
        return np.full(n, -np.inf), np.zeros((n, 3))
    else:
        cen, lg = np.ascontiguousarray(cen[keep]), lg[keep]
        tree = CpuTree(cen, leaf_size=LEAF_SIZE)
    T = transform.detach().to(torch.float64).cpu().numpy()
    qcen = qp if qinv is None else qc
    r = math.sqrt(r2) + 2 * math.sqrt(3) * a
    qkey = ("cells", query.data_ptr(), tuple(query.shape), query.stride(), level)
    got = None
    if const and bool(keep.all()):
        got = _kernel_matrix_rows(plan_, qkey, pkey, qcen, cen, tree, T, s, r * r, lg)
    if got is not None:
        lse, mean = got
    else:
        q = qcen @ T[:3, :3].T + T[:3, 3]
        lse, _, mean = _run_rows(q, lg, tree, s, r * r, False)
    if qinv is not None:
        lse, mean = lse[qinv], mean[qinv]
    return lse, mean



#: Softassign "cells": the candidate pairs of :func:`_candidates` reach this much (relative)
#: beyond the radius, so that they serve while the moved cells stay within the margin
CANDIDATE_MARGIN = 0.15


def _cells_key(t: torch.Tensor, level: int) -> tuple:
    return ("cells", t.data_ptr(), tuple(t.shape), t.stride(), level)


def _candidates(plan_: Plan, b: int, keys: tuple, q: np.ndarray, r: float, tree: CpuTree):
    """Candidate pairs ``(indptr, sorted-point indices)`` covering radius ``r`` around ``q``.

    Built by one tree walk at ``R = (1 + CANDIDATE_MARGIN) r`` around the queries ``q₀`` of
    that moment, in the walk's order, and reused while ``max_i |q_i − q₀_i| + r ≤ R``
    (triangle inequality, with a 1e-9 relative margin for rounding): then every pair within
    ``r`` is a candidate, and filtering the candidates by the same distance test gives the
    tree walk's pairs in its order (the walk at ``r`` visits a subset of the leaves, in the
    same order). None: more than ``KERNEL_CACHE_PAIRS`` candidates (walk the tree).
    """
    slot = plan_.cache.items.get(("cand", b))
    if slot is not None and slot["keys"] == keys and slot["q0"].shape == q.shape:
        move = float(np.sqrt(np.square(q - slot["q0"]).sum(1).max())) if q.shape[0] else 0.0
        if (r + move) * (1 + 1e-9) <= slot["R"]:
            return slot["ptr"], slot["idx"]
    R = (1 + CANDIDATE_MARGIN) * r
    counts = np.empty(q.shape[0], np.int64)
    _pair_count(q, tree.spts, tree.lo, tree.hi, tree.bmin, tree.bmax, tree.depth, R * R,
                counts)
    ptr = np.zeros(q.shape[0] + 1, np.int64)
    np.cumsum(counts, out=ptr[1:])
    if int(ptr[-1]) > KERNEL_CACHE_PAIRS:
        plan_.cache.items.pop(("cand", b), None)
        return None
    idx = np.empty(int(ptr[-1]), np.int64)
    _pair_index(q, tree.spts, tree.lo, tree.hi, tree.bmin, tree.bmax, tree.depth, R * R, ptr,
                idx)
    plan_.cache.items[("cand", b)] = dict(keys=keys, q0=q.copy(), R=R, ptr=ptr, idx=idx)
    return ptr, idx


def softassign_update(source: torch.Tensor, target: torch.Tensor, transform: torch.Tensor,
                      beta: torch.Tensor, offset: torch.Tensor, log_slack: torch.Tensor,
                      source_lengths: torch.Tensor, target_lengths: torch.Tensor,
                      rounds: int, plan_: Plan):
    """One Softassign pose update's passes in "cells" form, fused; or None.

    The ``2·rounds`` passes of one update (``rounds`` row and ``rounds − 1`` column
    normalisations, then the last column pass with the means) as the program runs them
    through ``soft.sinkhorn_scaling`` and ``soft.soft_rows``, with the same sums in the same
    order: each problem's kernel matrix is built once (:func:`_kernel_matrix_rows`' CSR) and
    every pass is one product with it or its transpose over the cells (NumPy, numba), the
    normalisations by the slack the same PyTorch ops on the same ``(B, N)`` tensors. What
    it saves is the fixed cost of each pass (the per-pass keys, checks and conversions of
    :func:`soft_rows` and :func:`softassign_cells`): the results are those of the passes.

    Args:
        source: ``(B, N, 3)`` float tensor x (the row passes' queries).
        target: ``(B, M, 3)`` float tensor y.
        transform: ``(B, 4, 4)`` float64 pose applied to the source.
        beta: ``(B,)`` β (float32 as the program's).
        offset: ``(B,)`` βα.
        log_slack: ``(B,)`` log of the slack entry.
        source_lengths: ``(B,)`` valid source points.
        target_lengths: ``(B,)`` valid target points.
        rounds: Sinkhorn rounds (≥ 1).
        plan_: the run's :class:`Plan` ("cells", Softassign).

    Returns:
        ``(lse (B, M), mean (B, M, 3))`` of the last column pass in the source's dtype (as
        ``soft.soft_rows(target, source, T⁻¹, β, point_log_weights=log r)``), or None when
        the passes do not all run through the kernel matrix at this β (a problem with one
        point per cell on both sides, more than ``KERNEL_CACHE_PAIRS`` cell pairs, weights
        too spread for linear sums): the caller runs the passes one by one.

    """
    if plan_.mode != "cells" or plan_.method != "softassign":
        return None
    _threads.numba_threads()
    B, N = source.shape[:2]
    M = target.shape[1]
    dt = source.dtype
    sl, tl = source_lengths.tolist(), target_lengths.tolist()
    scales, offs = beta.to(dt).tolist(), offset.tolist()
    states: list[Any] = []
    used = 0  # pairs of the earlier problems in the kernel buffer
    for b in range(B):
        if sl[b] == 0 or tl[b] == 0:
            states.append(None)
            continue
        s = float(scales[b])
        level, a = cell_side(math.sqrt(0.5 / s), plan_.cell_ratio)
        xb, yb = source[b, :sl[b]], target[b, :tl[b]]
        xp, xc, xn, xinv, xfirst = _level_cells(plan_, xb, level, a)
        yp, yc, yn, yinv, yfirst = _level_cells(plan_, yb, level, a)
        if xinv is None and yinv is None:
            return None
        r = math.sqrt((plan_.cells_k ** 2 / 2 + max(0.0, float(offs[b]))) / s) \
            + 2 * math.sqrt(3) * a
        r2 = r * r
        xcen = xp if xinv is None else xc
        ycen = yp if yinv is None else yc
        ykey = ("cells", yb.data_ptr(), tuple(yb.shape), yb.stride(), level)
        tree = plan_.cache.get(("ctree",) + ykey,
                               lambda c=ycen: CpuTree(c, leaf_size=LEAF_SIZE))
        T = transform[b].detach().to(torch.float64).cpu().numpy()
        q = np.ascontiguousarray(xcen @ T[:3, :3].T + T[:3, 3])
        nq = q.shape[0]
        counts = np.empty(nq, np.int64)
        indptr = np.zeros(nq + 1, np.int64)
        cand = _candidates(plan_, b, (_cells_key(xb, level), ykey), q, r, tree)
        if cand is None:
            _pair_count(q, tree.spts, tree.lo, tree.hi, tree.bmin, tree.bmax, tree.depth, r2,
                        counts)
        else:
            _cand_count(q, tree.spts, cand[0], cand[1], r2, counts)
        np.cumsum(counts, out=indptr[1:])
        nnz = int(indptr[-1])
        if used + nnz > KERNEL_CACHE_PAIRS:
            return None
        buf = plan_.cache.items.get("kbuf")  # the run's, grown as needed: no fresh pages
        if buf is None or buf[0].shape[0] < used + nnz:
            size = min(KERNEL_CACHE_PAIRS, max(used + nnz, 3 * (used + nnz) // 2))
            buf = (np.empty(size, np.int64), np.empty(size))
            for st in states:  # the earlier problems' pairs move along
                if st is not None:
                    a0, a1 = st["span"]
                    buf[0][a0:a1], buf[1][a0:a1] = st["cols"], st["vals"]
                    st["cols"], st["vals"] = buf[0][a0:a1], buf[1][a0:a1]
            plan_.cache.items["kbuf"] = buf
        cols, vals = buf[0][used:used + nnz], buf[1][used:used + nnz]
        if cand is None:
            _pair_fill(q, tree.perm, tree.spts, tree.lo, tree.hi, tree.bmin, tree.bmax,
                       tree.depth, s, r2, indptr, cols, vals)
        else:
            _cand_fill(q, tree.perm, tree.spts, cand[0], cand[1], s, r2, indptr, cols, vals)
        used += nnz
        start, end = indptr[:-1], indptr[1:]
        states.append(dict(s=s, r2=r2, start=start, end=end, cols=cols, vals=vals,
                           span=(used - nnz, used),
                           x=(xcen, None if xinv is None else np.log(xn), xinv, xfirst),
                           y=(ycen, None if yinv is None else np.log(yn), yinv, yfirst)))

    def weights(g: torch.Tensor, b: int, side: tuple, length: int):
        """Cell log weights (as :func:`softassign_cells`) → ``(w, shift)`` or None."""
        g64 = g[b, :length].detach().cpu().to(torch.float64).numpy()
        _, logn, _, first = side
        lg = g64 if logn is None else logn + g64[first]
        if not bool(np.isfinite(lg).all()):
            return None
        gmax, gmin = float(lg.max()), float(lg.min())
        st = states[b]
        if not 2 * (st["s"] * st["r2"] + gmax - gmin) < LINEAR_RANGE:
            return None
        return np.exp(lg - gmax), gmax

    g = offset[:, None].expand(-1, M)  # log c + βα, c = 1 (the program's first g_col)
    for p in range(2 * rounds):
        forward = p % 2 == 0  # rows: source cells against target cells
        nq, qlen = (N, source_lengths) if forward else (M, target_lengths)
        lse = torch.full((B, nq), -math.inf, dtype=dt)
        last = p == 2 * rounds - 1
        mean = torch.zeros(B, M, 3, dtype=dt) if last else None
        for b, st in enumerate(states):
            if st is None:
                continue
            qside, pside = (st["x"], st["y"]) if forward else (st["y"], st["x"])
            got = weights(g, b, pside, tl[b] if forward else sl[b])
            if got is None:
                return None
            w, gmax = got
            n = qside[0].shape[0]
            lse_c, mean_c = np.empty(n), np.empty((n, 3))
            if forward:
                _span_rows(st["start"], st["end"], st["cols"], st["vals"], w, lse_c)
            else:
                _span_cols(st["start"], st["end"], st["cols"], st["vals"], w, pside[0], n,
                           last, lse_c, mean_c)
            lse_c += gmax
            inv = qside[2]
            if inv is not None:
                lse_c, mean_c = lse_c[inv], mean_c[inv]
            lse[b, :lse_c.shape[0]] = torch.from_numpy(lse_c).to(dt)
            if mean is not None:
                mean[b, :mean_c.shape[0]] = torch.from_numpy(mean_c).to(dt)
        if last:
            assert mean is not None
            for _ in range(2 * rounds * sum(st is not None for st in states)):
                plan_.cache.count("cells")
            return lse, mean
        g = sinkhorn_normalise(lse, offset, log_slack, qlen)
    return None
