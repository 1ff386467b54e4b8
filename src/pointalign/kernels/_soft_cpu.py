"""EM-ICP's E-step on the CPU, exact or with a stated, bounded approximation (numba).

The exact E-step sums over all N·M pairs (``soft.emicp_rows``); at 40k × 40k that is 1.6e9
exponentials per iteration, seconds on a laptop, minutes for a run. Above a cost the caller
accepts (:func:`plan`), the sums are approximated in two stated ways, both controlled by
the current σ (scale s = 1/(2σ²)):

* **truncation** at ``R = k·σ``: pairs with d_ij > kσ are left out. Each dropped term
  exp(−d²/(2σ²)) is below ``e^(−k²/2)`` (k = 5: 3.7e-6), so the row sum
  ``Σ_j exp(−s d_ij²)`` is low by at most ``M·e^(−k²/2)`` in absolute terms;
* **merging** of the target points into cubic cells of half-diagonal ``h = εσ``
  (side ``a = 2εσ/√3``; only while that merges anything): the points of a cell act as their
  centroid c with weight n (the count). For a point p of the cell, ``|d_ip² − d_ic²| ≤
  2 d_ic h + h²``, so a kept term at distance d is off by a factor within
  ``exp(±(ε·d/σ + ε²/2))``: within ``e^(±1.005ε)`` for the terms within one σ, which carry
  most of a row's mass (ε = 0.1: ±10.6%), and the soft correspondence (a weighted mean of
  the target points) moves by at most h plus that relative change of its weights times
  the spread of the points within kσ. Both shrink with σ, so late iterations (small σ,
  cells smaller than the point spacing: nothing merged) are exact up to the truncation.

A row with no target point within kσ gets lse = −inf (λ = 0: an outlier). Its exact
weight is ``λ_i ≤ M·e^(−k²/2)/√C_i``: negligible when the outlier term (d₀ < kσ) is on;
without an outlier term the exact E-step still pulls such a row toward its distant
neighbours, the truncated one drops it.

Every row reduction of ``soft_rows`` (lse, lse2, mean) is returned for the same contract as
the reference, so :func:`pointalign.kernels.soft.emicp_weights` applies unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pointalign import _threads
from pointalign.kernels._knn_cpu import CpuTree, _boxd2, njit, prange

#: default truncation radius in σ (dropped terms < e^(−k²/2) = 3.7e-6 for k = 5)
TRUNCATE_K = 5.0
#: default merge tolerance ε (each kept term within a factor e^(±ε), see the module doc)
MERGE_EPS = 0.1
#: exact pairs per second of the CPU E-step per thread (measured on the 2-core machine,
#: bunny 40k; an estimate for :func:`plan`, not a promise)
EXACT_PAIRS_PER_S = 1.5e8
#: the "auto" mode approximates when the exact run would take longer than this (seconds)
AUTO_BUDGET_S = 3.0


@dataclass(frozen=True)
class Plan:
    """How a soft method's E-step runs on the CPU (from :func:`plan`); goes into ``info``.

    Attributes:
        mode: "exact" (all pairs) or "truncated" (radius kσ and merged cells, see module).
        k: truncation radius in σ.
        eps: merge tolerance ε.
        exact_estimate_s: predicted seconds of the exact E-steps for the whole run.
        bound: per-term relative bound of the approximation (0 when exact) and the
            absolute bound ``e^(−k²/2)`` of each dropped term, as a dict.

    """

    mode: str
    k: float
    eps: float
    exact_estimate_s: float

    def info(self) -> dict:
        """Return the record for ``result.info["approximation"]``."""
        if self.mode == "exact":
            return {"mode": "exact", "exact_estimate_s": self.exact_estimate_s}
        return {"mode": "truncated", "k": self.k, "eps": self.eps,
                "dropped_term_bound": math.exp(-self.k ** 2 / 2),
                "kept_term_factor_within_1_sigma": math.exp(self.eps + self.eps ** 2 / 2),
                "exact_estimate_s": self.exact_estimate_s}


def estimate_exact_seconds(n: int, m: int, iterations: int, threads: int | None = None) -> float:
    """Return the predicted seconds of ``iterations`` exact E-steps of n × m pairs."""
    t = _threads.get_num_threads() if threads is None else threads
    return float(n) * float(m) * float(iterations) / (EXACT_PAIRS_PER_S * max(1, t))


def plan(n: int, m: int, iterations: int, *, approximation: str = "auto",
         budget_s: float = AUTO_BUDGET_S, k: float = TRUNCATE_K,
         eps: float = MERGE_EPS) -> Plan:
    """Choose the CPU E-step up front (call once per run, before the iterations).

    Args:
        n: source points.
        m: target points.
        iterations: scheduled iterations.
        approximation: "auto" (truncate when the exact estimate exceeds ``budget_s``),
            "exact" or "truncated".
        budget_s: seconds the exact run may take in "auto" mode.
        k: truncation radius in σ (> 0).
        eps: merge tolerance (>= 0, 0: no merging).

    Returns:
        a :class:`Plan`; ``plan.info()`` is what the algorithm records in
        ``result.info["approximation"]``.

    """
    if approximation not in ("auto", "exact", "truncated"):
        raise ValueError(f"approximation: expected 'auto', 'exact' or 'truncated', got "
                         f"{approximation!r}")
    if not k > 0:
        raise ValueError(f"k: must be > 0, got {k}")
    if not eps >= 0:
        raise ValueError(f"eps: must be >= 0, got {eps}")
    est = estimate_exact_seconds(n, m, iterations)
    mode = approximation
    if mode == "auto":
        mode = "truncated" if est > budget_s else "exact"
    return Plan(mode, float(k), float(eps), est)


def _merge(points: np.ndarray, cell: float):
    """Return (centroids (V, 3) float64, counts (V,) float64) of points in cubic cells."""
    if cell <= 0:
        return points.astype(np.float64), np.ones(points.shape[0])
    key = np.floor((points - points.min(0)) / cell).astype(np.int64)
    dims = key.max(0) + 1
    lin = (key[:, 0] * dims[1] + key[:, 1]) * dims[2] + key[:, 2]
    uniq, inv, cnt = np.unique(lin, return_inverse=True, return_counts=True)
    cen = np.zeros((uniq.shape[0], 3))
    for d in range(3):
        cen[:, d] = np.bincount(inv, weights=points[:, d].astype(np.float64),
                                minlength=uniq.shape[0])
    return cen / cnt[:, None], cnt.astype(np.float64)


@njit(cache=True, parallel=True)
def _rows(q, w, perm, spts, lo, hi, bmin, bmax, depth, s, r2, lse, lse2, mean):
    """Row sums over the cells within ``r2`` of each (moved) query, weights ``w``."""
    nq = q.shape[0]
    first_leaf = (1 << depth) - 1
    for i in prange(nq):
        stack = np.empty(2 * depth + 4, np.int64)
        q0, q1, q2 = q[i, 0], q[i, 1], q[i, 2]
        l1 = 0.0
        l2 = 0.0
        u0 = 0.0
        u1 = 0.0
        u2 = 0.0
        top = 1
        stack[0] = 0
        while top > 0:
            top -= 1
            v = stack[top]
            if _boxd2(q0, q1, q2, bmin, bmax, v) > r2:
                continue
            if v >= first_leaf:
                for j in range(lo[v], hi[v]):
                    e0, e1, e2 = q0 - spts[j, 0], q1 - spts[j, 1], q2 - spts[j, 2]
                    dd = e0 * e0 + e1 * e1 + e2 * e2
                    if dd > r2:
                        continue
                    e = math.exp(-s * dd)
                    wj = w[perm[j]]
                    l1 += wj * e
                    l2 += wj * e * e
                    u0 += wj * e * spts[j, 0]
                    u1 += wj * e * spts[j, 1]
                    u2 += wj * e * spts[j, 2]
                continue
            stack[top] = 2 * v + 1
            stack[top + 1] = 2 * v + 2
            top += 2
        if l1 > 0:
            lse[i] = math.log(l1)
            lse2[i] = math.log(l2)
            mean[i, 0] = u0 / l1
            mean[i, 1] = u1 / l1
            mean[i, 2] = u2 / l1
        else:
            lse[i] = -np.inf
            lse2[i] = -np.inf
            mean[i, 0] = 0.0
            mean[i, 1] = 0.0
            mean[i, 2] = 0.0


def soft_rows_truncated(query: torch.Tensor, points: torch.Tensor, transform: torch.Tensor,
                        scale: float, *, k: float = TRUNCATE_K, eps: float = MERGE_EPS):
    """Approximate ``(lse (N,), lse2 (N,), mean (N, 3))`` of one problem (see module doc).

    Args:
        query: ``(N, 3)`` float tensor, moved by ``transform``.
        points: ``(M, 3)`` float tensor (the target).
        transform: ``(4, 4)`` float tensor applied to the query.
        scale: s = 1/(2σ²) > 0.
        k: truncation radius in σ.
        eps: merge tolerance.

    Returns:
        the three row reductions in the query's dtype (CPU tensors).

    """
    _threads.numba_threads()
    dt = query.dtype
    T = transform.detach().to(torch.float64).cpu().numpy()
    q = query.detach().cpu().to(torch.float64).numpy() @ T[:3, :3].T + T[:3, 3]
    p = points.detach().cpu().to(torch.float64).numpy()
    sigma = math.sqrt(0.5 / float(scale))
    R = k * sigma
    cen, cnt = _merge(p, 2 * eps * sigma / math.sqrt(3))
    tree = CpuTree(cen, leaf_size=8)
    n = q.shape[0]
    lse, lse2 = np.empty(n), np.empty(n)
    mean = np.empty((n, 3))
    _rows(np.ascontiguousarray(q), cnt, tree.perm, tree.spts, tree.lo, tree.hi, tree.bmin,
          tree.bmax, tree.depth, float(scale), R * R, lse, lse2, mean)
    return (torch.from_numpy(lse).to(dt), torch.from_numpy(lse2).to(dt),
            torch.from_numpy(mean).to(dt))


def emicp_rows_truncated(source, target, transform, scale, log_outlier, source_lengths,
                         target_lengths, plan_: Plan):
    """Batched EM-ICP rows ``(lam (B, N), x_prime (B, N, 3))`` by :func:`soft_rows_truncated`."""
    from pointalign.kernels.soft import emicp_weights

    B, N = source.shape[:2]
    lam = torch.zeros(B, N, dtype=source.dtype)
    xp = torch.zeros(B, N, 3, dtype=source.dtype)
    sl, tl = source_lengths.tolist(), target_lengths.tolist()
    for b in range(B):
        if sl[b] == 0 or tl[b] == 0:
            continue
        lse, lse2, mean = soft_rows_truncated(source[b, :sl[b]], target[b, :tl[b]],
                                              transform[b], float(scale[b]), k=plan_.k,
                                              eps=plan_.eps)
        lam[b, :sl[b]] = emicp_weights(lse[None], lse2[None], log_outlier[b:b + 1].to(
            lse.dtype))[0]
        xp[b, :sl[b]] = mean
    return lam, xp
