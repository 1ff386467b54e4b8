"""The soft methods' row passes on the CPU (numba), exact or with a stated, bounded approximation.

EM-ICP and Softassign sum over all N·M pairs every pass (``soft.soft_rows``); at 40k × 40k
that is 1.6e9 exponentials per EM-ICP iteration, minutes for a run. Here one numba kernel
(:func:`_rows`, all cores, float64 sums with a running maximum per row) computes the row
reductions of ``soft.soft_rows`` (lse, lse2, mean) over a k-d tree of the points side, and
:func:`plan` chooses up front, from a cost estimate, one of three forms:

* ``"exact"``: every pair (the tree prunes nothing); equal to the PyTorch reference up to
  the order of float64 sums. Chosen automatically while its estimate is at most
  ``AUTO_BUDGET_S`` seconds.
* ``"cells"`` (EM-ICP): at each annealing step (scale s = 1/(2σ²)) both clouds are merged
  into cubic cells of side ``a = c·σ`` rounded down to a power of √2 (in the input's
  unit; ``c = CELL_RATIO``, so ``a ∈ (cσ/√2, cσ]``, half-diagonal ``h = a√3/2 ≤ 0.87cσ``),
  and pairs of cells whose centroids are more than ``kσ`` apart are dropped
  (``k = TRUNCATE_K``). A target cell acts as its centroid ȳ with weight n (its count); each
  source point takes the E-step values (λ, x') of its cell's centroid. Bounds, at a source
  centroid q and a kept target cell at centroid distance d (Jensen and Hoeffding's lemma on
  the centred offsets δ of the cell's points: mean |δ|² ≤ 3a²/4 = h², each coordinate's
  variance being at most a²/4, and any projection of δ within an interval of width 2h):
  ``n e^(−s d²) / Σ_cell e^(−s d_j²) ∈ [e^(−(4 s d h + s h²)²/8), e^(s h²)]``: second order
  in h/σ (at d = σ, c = 0.4: within [0.93, 1.06]); a point lies within the full diagonal
  a√3 = 2h of its cell's centroid, so each dropped point's term is below
  ``e^(−s (kσ − 2h)²)`` (c = 0.4, k = 4: e^(−(4 − 0.69)²/2) = 4.2e-3). Once the cells are
  smaller than the point spacing they hold one point each and only the truncation is left
  (the late, small-σ iterations).
* ``"truncated"`` (Softassign, per point): pairs with ``s d² > k²/2 + offset`` are dropped,
  where ``offset`` = βα is the logits' known shift (so every dropped term of a Sinkhorn
  pass, ``exp(−β(d² − α)) c_j``, is below ``e^(−k²/2)/w``: its scalings are at most ``1/w``,
  w the slack entry); k is chosen so that every normaliser ``w + Σ`` is low by a relative
  ``M e^(−k²/2)/w² ≤ SOFTASSIGN_TOLERANCE``. Kept pairs are exact. At the hot temperatures
  the radius exceeds the cloud and every pair is kept (2k × 2k bunny, seed schedule: all
  pairs for the first ~30 of 100 temperatures, 72 % of the 4.4e9 pair terms there).
* ``"cells"`` (Softassign, chosen by "approximate"/"auto" when the schedule is known): at
  each β (σ = 1/√(2β)) both clouds are merged into cubic cells of side ``a = c·σ`` rounded
  down to a power of √2 (``c = SOFT_CELL_RATIO``); a source cell meets a target cell through
  one kernel value at their centroids (the target's weighted by its scalings) times the
  source count and the target's summed scalings, every point takes its cell's row values,
  and cell pairs beyond the truncation radius for ``CELLS_TOLERANCE`` plus ``2√3 a`` are
  dropped (every dropped point pair lies beyond that radius). Each kept cell pair's term is
  within ``[e^(−(4√3 βda + 12βa²)²/8), e^(1.5βa²)]`` of its block's exact sum
  (:func:`block_factor`; at d = σ, c = 0.5: [0.27, 1.21]; second order in a/σ), so the hot
  phase is a coarse Softassign on cell centroids. Once both clouds hold one point per cell
  (the cold temperatures, where the pose is settled) the passes are the per-point
  "truncated" ones with the 1e-4 normaliser bound. Within one pose update every pass sees
  the same cell pairs (one pose, one β): their kernel values are computed once into a
  sparse matrix (at most ``KERNEL_CACHE_PAIRS``, else the tree passes) and each Sinkhorn
  pass is a product with it or its transpose (:func:`_kernel_matrix_rows`; the same sums
  in another order). The program runs a whole update in one call
  (:func:`softassign_update`: the matrix, then its 2·rounds passes over the cells, with the
  same sums in the same order and the same PyTorch normalisations, so the pose is the
  per-pass path's bit for bit), which leaves out each pass's fixed cost (~2 ms of keys,
  checks and conversions, 3,000 passes in the seed schedule); its matrix comes from
  candidate pairs (:func:`_candidates`: one tree walk at 1.15× the radius, reused by the
  later updates and temperatures of a cell level while the moved cells stay within the
  margin), a distance test and an exp per pair instead of two tree walks. The plan predicts
  the phases (``Plan.phases``); ``info()["passes"]`` counts what ran. The final pose is
  measured against the exact form in the tests (bunny subsample, short schedule: within
  0.1°).

A row with no kept pair gets lse = −inf (λ = 0: an outlier; Softassign: only the slack).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pointalign import _threads
from pointalign.kernels._numba import njit, prange
from pointalign.kernels.knn.cpu import CpuTree, _boxd2

#: EM-ICP truncation radius in σ (each dropped term below e^(−(k − √3 c)²/2))
TRUNCATE_K = 4.0
#: EM-ICP cell side / σ (diagonal ≤ √3 c σ)
CELL_RATIO = 0.4
#: Softassign: relative bound on every Sinkhorn normaliser (sets k)
SOFTASSIGN_TOLERANCE = 1e-4
#: exact pairs per second of :func:`_rows` per thread (measured on the 2-core machine, bunny
#: 40k; an estimate for :func:`plan`, not a promise)
EXACT_PAIRS_PER_S = 1.0e8
#: pairs per second per thread when pruning (tree overhead included; same measurement)
PRUNED_PAIRS_PER_S = 3.0e7
#: Softassign "cells": most cell pairs one update's kernel matrix keeps (12 bytes each)
KERNEL_CACHE_PAIRS = 8_000_000
#: Softassign "cells": cell side / σ, σ = 1/√(2β) (see :func:`block_factor`)
SOFT_CELL_RATIO = 0.5
#: Softassign "cells": the normalisers' relative truncation bound while cells merge (their
#: own error, :func:`block_factor`, is far larger than ``SOFTASSIGN_TOLERANCE``)
CELLS_TOLERANCE = 1e-2
#: source cells sampled by the Softassign estimate
SAMPLE = 64
#: seconds per per-point pass besides the pairs, on one thread whatever the thread count
#: (Python, PyTorch's small ops; measured ~2.2 ms per pass at 2k x 2k, loaded 2 cores)
PASS_OVERHEAD_S = 2e-3
#: seconds per pass of a fused "cells" update (:func:`softassign_update`) besides the pairs
#: and points, on one thread (its share of the update's Python, PyTorch normalisations and
#: Horn step; measured 2k x 2k seed schedule, 1 thread, load 3.5: ~2.1 s over 2,790 passes,
#: ~2.5 s with the per-point phase's glue; rounded up)
CELL_PASS_OVERHEAD_S = 7e-4
#: seconds per point per pass (moving, gathering)
POINT_COST_S = 5e-8
#: seconds per cell pair per thread to build an update's kernel matrix (from the candidate
#: pairs of :func:`_candidates`: a distance test per candidate, 1 exp per kept pair;
#: measured ~20 ns per kept pair, same run)
BUILD_S_PER_PAIR = 2e-8
#: seconds per cell pair per thread of one pass through the kernel matrix (same run: 1.7 ns)
CSR_S_PER_PAIR = 2e-9
#: points per leaf of the trees the passes search
LEAF_SIZE = 16
#: the "auto" mode approximates when the exact run would take longer than this (seconds)
AUTO_BUDGET_S = 3.0


class _Cache:
    """Trees and cell sets of one run, keyed by (tensor storage, shape, cell level).

    ``passes`` counts the passes run in each form ("cells", "per_point"): what the run did,
    for ``result.info["approximation"]``.
    """

    def __init__(self) -> None:
        self.items: dict = {}
        self.passes: dict[str, int] = {}

    def count(self, form: str) -> None:
        self.passes[form] = self.passes.get(form, 0) + 1

    def get(self, key, make):
        if key not in self.items:
            self.items[key] = make()
        return self.items[key]


@dataclass(frozen=True)
class Plan:
    """How a soft method's row passes run on the CPU (from :func:`plan`); goes into ``info``.

    Attributes:
        mode: "exact", "cells" (EM-ICP) or "truncated" (Softassign), see the module doc.
        k: truncation radius in σ (inf when exact).
        cell_ratio: cell side / σ (0: no cells).
        exact_estimate_s: predicted seconds of the exact passes for the whole run.
        estimate_s: predicted seconds of the chosen form's passes for the whole run.

    """

    mode: str
    k: float
    cell_ratio: float
    exact_estimate_s: float
    estimate_s: float
    cache: _Cache = field(default_factory=_Cache, compare=False, repr=False)
    #: "emicp" or "softassign"
    method: str = "emicp"
    #: Softassign "cells": the truncation radius in σ while cells merge (from
    #: ``CELLS_TOLERANCE``; the per-point passes use ``k``)
    cells_k: float = math.inf
    #: Softassign "cells": the predicted phases, ``({"temperatures": [first, last], "form":
    #: "cells" | "per_point", "cells": [source, target]}, ...)`` (0-based, inclusive)
    phases: tuple = ()

    def info(self) -> dict:
        """Return the record for ``result.info["approximation"]`` (JSON-safe)."""
        out: dict = {"mode": self.mode, "exact_estimate_s": round(self.exact_estimate_s, 3),
                     "estimate_s": round(self.estimate_s, 3)}
        if self.mode == "cells" and self.method == "softassign":
            out.update(
                k=self.k, cell_ratio=self.cell_ratio,
                cell_rule="sigma = 1/sqrt(2 beta); cells of side c*sigma rounded down to a "
                          "power of sqrt(2) while they merge points, then per point",
                rule="pairs with beta*d^2 > k^2/2 + beta*alpha dropped (cells: centroid "
                     "distance beyond that radius + 2*sqrt(3)*side)",
                dropped_term_bound=math.exp(-self.k ** 2 / 2),
                normaliser_relative_bound=SOFTASSIGN_TOLERANCE,
                cell_block_ratio_at_1_sigma=list(block_factor(1.0, self.cell_ratio)),
                phases=[dict(p) for p in self.phases],
                passes=dict(self.cache.passes))
        elif self.mode == "cells":
            out.update(k=self.k, cell_ratio=self.cell_ratio,
                       cell_rule="side c*sigma rounded down to a power of sqrt(2); "
                                 "cell pairs with centroids beyond k*sigma dropped",
                       dropped_term_bound=math.exp(
                           -(self.k - math.sqrt(3) * self.cell_ratio) ** 2 / 2),
                       kept_cell_ratio_at_1_sigma=list(cell_factor(1.0, self.cell_ratio)))
        elif self.mode == "truncated":
            out.update(k=self.k, rule="pairs with s*d^2 > k^2/2 + beta*alpha dropped",
                       dropped_term_bound=math.exp(-self.k ** 2 / 2),
                       normaliser_relative_bound=SOFTASSIGN_TOLERANCE)
        return out


def cell_factor(d_over_sigma: float, cell_ratio: float) -> tuple[float, float]:
    """Bounds ``(lo, hi)`` of a kept cell's term / its points' exact terms (module doc).

    At centroid distance ``d = d_over_sigma·σ`` and cells of side ``cell_ratio·σ``, scale
    s = 1/(2σ²).
    """
    h = math.sqrt(3) / 2 * cell_ratio  # h/σ
    rng = 2 * d_over_sigma * h + h * h / 2  # (4 s d h + s h²) in units of σ
    return math.exp(-rng * rng / 8), math.exp(h * h / 2)


def block_factor(d_over_sigma: float, cell_ratio: float) -> tuple[float, float]:
    """Bounds ``(lo, hi)`` of a Softassign cell pair's term / its block's exact sum.

    A source cell I (n points, centroid x̄) and a target cell J (weights c_j, weighted
    centroid ȳ), both cubes of side a = ``cell_ratio``·σ, at centroid distance
    d = ``d_over_sigma``·σ, β = 1/(2σ²): the cells form uses ``n C e^(−β d²)`` (C = Σ c_j)
    for ``Σ_(i∈I, j∈J) c_j e^(−β |x_i − y_j|²)``. With δ = (x_i − x̄) − (y_j − ȳ) (mean 0
    under the weights; each side's variance ≤ 3a²/4, its projection on any direction
    within a width a√3, |δ| ≤ 2a√3), Jensen gives exact ≥ approx · e^(−1.5 β a²) and
    Hoeffding's lemma exact ≤ approx · e^((2βd·2√3a + 12βa²)²/8): the term / block ratio
    lies in ``[e^(−(4√3 βda + 12βa²)²/8), e^(1.5 β a²)]``, second order in a/σ.
    """
    a = cell_ratio  # a/σ; β = 1/(2σ²)
    rng = 2 * math.sqrt(3) * d_over_sigma * a + 6 * a * a  # (4√3 βda + 12βa²) in σ units
    return math.exp(-rng * rng / 8), math.exp(0.75 * a * a)


def cell_side(sigma: float, cell_ratio: float) -> tuple[int, float]:
    """Return ``(level, side)``: the cell side c·σ rounded down to a power of √2."""
    level = math.floor(2 * math.log2(cell_ratio * sigma))
    return level, 2.0 ** (level / 2)


def _threads_now(threads: int | None) -> int:
    return max(1, _threads.get_num_threads() if threads is None else threads)


def estimate_exact_seconds(n: int, m: int, passes: int, threads: int | None = None) -> float:
    """Return the predicted seconds of ``passes`` exact row passes over n × m pairs."""
    return float(n) * float(m) * float(passes) / (EXACT_PAIRS_PER_S * _threads_now(threads))


def _cells_estimate(source: np.ndarray, target: np.ndarray, sigmas: list[float], k: float,
                    c: float, threads: int) -> float:
    """Predicted seconds of the "cells" E-steps: cells counted, neighbours from a surface."""
    total, counts = 0.0, {}
    for sig in sigmas:
        level, a = cell_side(sig, c)
        if level not in counts:
            counts[level] = (_count_cells(source, a), _count_cells(target, a))
        ns, nt = counts[level]
        # cells within kσ of a cell on a surface of nt·a² (a 3-D cloud has more: an estimate)
        near = min(nt, math.pi * (k * sig) ** 2 / (a * a) * 1.3)
        total += ns * near / PRUNED_PAIRS_PER_S + 2e-3 + 1e-7 * (ns + nt)
    return total / threads


def _count_cells(points: np.ndarray, a: float) -> int:
    key = np.floor((points - points.min(0)) / a).astype(np.int64)
    dims = key.max(0) + 1
    if float(dims[0]) * float(dims[1]) * float(dims[2]) >= 2.0 ** 62:
        return points.shape[0]
    return int(np.unique((key[:, 0] * dims[1] + key[:, 1]) * dims[2] + key[:, 2]).shape[0])


def _softassign_k(m: int, n: int, w: float, tolerance: float) -> float:
    """Return the truncation radius k (in σ) leaving every normaliser low by ≤ ``tolerance``.

    Each dropped term is below ``e^(−k²/2)/w`` (scalings ≤ 1/w), at most max(N, M) of them,
    and each normaliser (slack w included) is at least w.
    """
    return math.sqrt(max(2 * math.log(max(m, n) / (w * w * tolerance)), 1.0))


def _softassign_estimate(source: np.ndarray, target: np.ndarray, betas: list[float],
                         alpha: float, k: float, kc: float, c: float, passes_per_beta: int,
                         passes_per_update: int, threads: int) -> tuple[float, tuple]:
    """Predicted seconds of the Softassign "cells" passes and their phases (:class:`Plan`).

    The pairs each pass keeps are counted at the identity pose on the centred clouds: for
    up to ``SAMPLE`` source cells (a fixed sample), the target cells within the pass's
    radius, times the source cells. Cells: one kernel matrix per update
    (``BUILD_S_PER_PAIR``) and a product with it per pass (``CSR_S_PER_PAIR``); per point:
    ``PRUNED_PAIRS_PER_S``; both over the threads, plus ``CELL_PASS_OVERHEAD_S`` (fused
    cells updates) or ``PASS_OVERHEAD_S`` (per point) per pass on one.
    An estimate at the start pose, not a promise.
    """
    src = source - source.mean(0)
    tgt = target - target.mean(0)
    rng = np.random.default_rng(0)
    total, per_level = 0.0, {}
    phases: list[dict[str, Any]] = []
    for j, beta in enumerate(betas):
        sigma = math.sqrt(0.5 / beta)
        level, a = cell_side(sigma, c)
        if level not in per_level:
            cs, _, inv_s = _merge(src, a)
            ct, _, inv_t = _merge(tgt, a)
            pick = rng.choice(cs.shape[0], min(SAMPLE, cs.shape[0]), replace=False)
            d2 = np.sort(np.square(cs[pick, None, :] - ct[None]).sum(-1).ravel())
            merged = inv_s is not None or inv_t is not None
            per_level[level] = (cs.shape[0], ct.shape[0], d2, pick.shape[0], merged, a)
        ns, nt, d2, n_pick, merged, a = per_level[level]
        kk = kc if merged else k
        r = math.sqrt((kk * kk / 2 + beta * alpha) / beta) + (2 * math.sqrt(3) * a if merged else 0)
        pairs = ns * float(np.searchsorted(d2, r * r, side="right")) / n_pick
        if merged:  # one kernel matrix per update, every pass a product with it
            updates = passes_per_beta / passes_per_update
            par = updates * pairs * (BUILD_S_PER_PAIR + passes_per_update * CSR_S_PER_PAIR)
        else:
            par = passes_per_beta * pairs / PRUNED_PAIRS_PER_S
        overhead = CELL_PASS_OVERHEAD_S if merged else PASS_OVERHEAD_S
        total += par / threads + passes_per_beta * (
            overhead + POINT_COST_S * (source.shape[0] + target.shape[0]))
        form = "cells" if merged else "per_point"
        if phases and phases[-1]["form"] == form and (form == "per_point"
                                                      or phases[-1]["cells"] == [ns, nt]):
            phases[-1]["temperatures"][1] = j
        else:
            phases.append({"temperatures": [j, j], "form": form, "cells": [ns, nt]})
    return total, tuple(phases)


def plan(n: int, m: int, passes: int, *, approximation: str = "auto",
         budget_s: float = AUTO_BUDGET_S, method: str = "emicp",
         source: np.ndarray | None = None, target: np.ndarray | None = None,
         sigmas: list[float] | None = None, outlier_weight: float = 1.0,
         betas: list[float] | None = None, alpha: float = 0.0,
         passes_per_beta: int = 0, passes_per_update: int = 1) -> Plan:
    """Choose the CPU form of a soft method's row passes up front (once per run).

    Args:
        n: source points (the largest of a batch).
        m: target points (the largest of a batch).
        passes: row passes of n × m pairs in the whole run.
        approximation: "auto" (approximate when the exact estimate exceeds ``budget_s``),
            "exact" or "approximate" (EM-ICP: "cells", Softassign: "truncated").
        budget_s: seconds the exact run may take in "auto" mode.
        method: "emicp" or "softassign".
        source: ``(N, 3)`` float64 source (EM-ICP: to estimate the cells' cost; optional).
        target: ``(M, 3)`` float64 target (as ``source``).
        sigmas: EM-ICP's σ per iteration (as ``source``).
        outlier_weight: Softassign's slack w (sets k).
        betas: Softassign's β per temperature (with ``source``, ``target``: "cells" form;
            without: the per-point "truncated" form throughout).
        alpha: Softassign's α (the truncation radius grows by α).
        passes_per_beta: Softassign's passes per temperature (updates × 2 × rounds).
        passes_per_update: Softassign's passes per pose update (2 × rounds).

    Returns:
        a :class:`Plan`; ``plan.info()`` is what the algorithm records in
        ``result.info["approximation"]``.

    """
    if approximation not in ("auto", "exact", "approximate"):
        raise ValueError("approximation: expected 'auto', 'exact' or 'approximate', got "
                         f"{approximation!r}")
    if method not in ("emicp", "softassign"):
        raise ValueError(f"method: expected 'emicp' or 'softassign', got {method!r}")
    threads = _threads_now(None)
    exact = estimate_exact_seconds(n, m, passes, threads)
    use = approximation == "approximate" or (approximation == "auto" and exact > budget_s)
    if not use:
        return Plan("exact", math.inf, 0.0, exact, exact)
    if method == "softassign":
        w = float(outlier_weight)
        k = _softassign_k(m, n, w, SOFTASSIGN_TOLERANCE)
        if source is not None and target is not None and betas:
            c = SOFT_CELL_RATIO
            kc = _softassign_k(m, n, w, CELLS_TOLERANCE)
            est, phases = _softassign_estimate(source, target, betas, alpha, k, kc, c,
                                               max(1, passes_per_beta),
                                               max(1, passes_per_update), threads)
            return Plan("cells", k, c, exact, est, method="softassign", phases=phases,
                        cells_k=kc)
        # the early temperatures see every pair and the kernel costs more per pair than the
        # exact estimate's rate (measured: 2k x 2k, seed schedule, 123 CPU-s on 2 loaded
        # cores against 60 s predicted exact): predict the exact time, not less
        return Plan("truncated", k, 0.0, exact, exact, method="softassign")
    k, c = TRUNCATE_K, CELL_RATIO
    est = exact / 10
    if source is not None and target is not None and sigmas:
        est = _cells_estimate(source, target, sigmas, k, c, threads)
    return Plan("cells", k, c, exact, est)


def _merge(points: np.ndarray, a: float):
    """Cells of side ``a``: ``(centroids (V, 3), counts (V,), inverse (N,) or None)``.

    None: every cell holds one point (the centroids are the points, in their order).
    """
    key = np.floor((points - points.min(0)) / a).astype(np.int64)
    dims = key.max(0) + 1
    if float(dims[0]) * float(dims[1]) * float(dims[2]) >= 2.0 ** 62:  # cells finer than
        return points, np.ones(points.shape[0]), None  # the extent
    lin = (key[:, 0] * dims[1] + key[:, 1]) * dims[2] + key[:, 2]
    uniq, inv, cnt = np.unique(lin, return_inverse=True, return_counts=True)
    if uniq.shape[0] == points.shape[0]:
        return points, np.ones(points.shape[0]), None
    cen = np.empty((uniq.shape[0], 3))
    for d in range(3):
        cen[:, d] = np.bincount(inv, weights=points[:, d], minlength=uniq.shape[0])
    return cen / cnt[:, None], cnt.astype(np.float64), inv.reshape(-1)


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


@njit(cache=True, parallel=True)
def _rows(q, g, perm, spts, lo, hi, bmin, bmax, depth, s, r2, want2, sq_w, lse, lse2, mean):
    """Row reductions over the stored points within ``r2`` of each (moved) query.

    ``lse_i = log Σ_j exp(−s d² + g_j)``, ``lse2_i = log Σ_j exp(2(−s d²) + c g_j)`` (when
    ``want2``; c = 2 with ``sq_w``, the square of each term, else 1: g_j = log n_j, a cell's
    count enters once), ``mean_i`` the first sum's weighted mean of the points; running
    maxima keep every sum finite.
    """
    nq = q.shape[0]
    for i in prange(nq):
        stack = np.empty(2 * depth + 4, np.int64)
        leaves = np.empty(1 << depth, np.int64)
        q0, q1, q2 = q[i, 0], q[i, 1], q[i, 2]
        m1 = -np.inf
        m2 = -np.inf
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
                u0 += e * p0
                u1 += e * p1
                u2 += e * p2
                if want2:
                    z2 = (2.0 * gj if sq_w else gj) - 2.0 * s * dd
                    if z2 > m2:
                        l2 *= math.exp(m2 - z2)
                        m2 = z2
                    l2 += math.exp(z2 - m2)
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


@njit(cache=True, parallel=True)
def _rows_linear(q, w, perm, spts, lo, hi, bmin, bmax, depth, s, r2, want2, sq_w, lse, lse2,
                 mean):
    """:func:`_rows` with linear weights ``w_j = exp(g_j − shift)`` and no running maximum.

    Only for a finite ``r2`` with every kept term representable (the caller checks
    ``s·r2 + 2·spread of g < LINEAR_RANGE``): one exponential per pair.
    ``lse2 = log Σ_j w_j^c exp(−2 s d²)`` (c = 2 with ``sq_w``, else 1); the caller adds
    the shift back.
    """
    nq = q.shape[0]
    for i in prange(nq):
        stack = np.empty(2 * depth + 4, np.int64)
        leaves = np.empty(1 << depth, np.int64)
        q0, q1, q2 = q[i, 0], q[i, 1], q[i, 2]
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
                k = math.exp(-s * dd)
                e = w[perm[j]] * k
                l1 += e
                l2 += e * e if sq_w else e * k
                u0 += e * p0
                u1 += e * p1
                u2 += e * p2
        if l1 > 0:
            lse[i] = math.log(l1)
            lse2[i] = math.log(l2) if l2 > 0 else -np.inf
            mean[i, 0] = u0 / l1
            mean[i, 1] = u1 / l1
            mean[i, 2] = u2 / l1
        else:
            lse[i] = -np.inf
            lse2[i] = -np.inf
            mean[i, 0] = 0.0
            mean[i, 1] = 0.0
            mean[i, 2] = 0.0


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
        _rows(q, np.ascontiguousarray(g), tree.perm, tree.spts, tree.lo, tree.hi, tree.bmin,
              tree.bmax, tree.depth, s, r2, squares, square_weights, lse, lse2, mean)
    return lse, lse2, mean


def _tree(plan_: Plan, points: Any, key) -> CpuTree:
    """Return the run's tree of ``points()`` (a function giving ``(M, 3)`` float64)."""
    return plan_.cache.get(("tree",) + key, lambda: CpuTree(points(), leaf_size=LEAF_SIZE))


def rows(query: torch.Tensor, points: torch.Tensor, transform: torch.Tensor, scale: float, *,
         log_weights: torch.Tensor | None = None, radius2: float = math.inf,
         squares: bool = False, plan_: Plan | None = None, numpy: bool = False):
    """Row reductions ``(lse (N,), lse2 (N,) or None, mean (N, 3))`` of one problem.

    ``lse_i = log Σ_j exp(−s ||R q_i + t − p_j||² + g_j)`` over the pairs within
    ``radius2`` (squared; inf: all), as :func:`pointalign.kernels.soft.soft_rows_reference`.

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


def _source64(plan_: Plan, source: torch.Tensor) -> np.ndarray:
    key = ("source64", source.data_ptr(), tuple(source.shape), source.stride())
    return plan_.cache.get(key, lambda: source.detach().cpu().to(torch.float64).numpy())


def emicp_moments(source, target, transform, scale, log_outlier, source_lengths,
                  target_lengths, plan_: Plan):
    """Batched EM-ICP E-step in the plan's form, reduced to Horn's moments.

    Returns:
        ``(lam (B, N) in the source's dtype, W (B,), Σλx (B, 3), Σλx' (B, 3),
        Σλ x x'ᵀ (B, 3, 3))`` (float64 torch; the moments of
        :func:`pointalign.kernels.horn.horn_moments` of ``(x_i, x'_i, λ_i)``, summed per
        source cell in "cells" form: its points share λ and x').

    """
    B, N = source.shape[:2]
    lam = np.zeros((B, N))
    W, sx, sm, cross = np.zeros(B), np.zeros((B, 3)), np.zeros((B, 3)), np.zeros((B, 3, 3))
    sl, tl = source_lengths.tolist(), target_lengths.tolist()
    scale_h, lo_h = scale.tolist(), log_outlier.tolist()
    for b in range(B):
        if sl[b] == 0 or tl[b] == 0:
            continue
        if plan_.mode == "cells":
            lam_c, xp, x, n, inv = emicp_cells(source[b, :sl[b]], target[b, :tl[b]],
                                               transform[b], scale_h[b], lo_h[b], plan_)
            lam[b, :sl[b]] = lam_c if inv is None else lam_c[inv]
            wc = lam_c * n
        else:
            lse, lse2, xp = rows(source[b, :sl[b]], target[b, :tl[b]], transform[b],
                                 scale_h[b], squares=True, plan_=plan_, numpy=True)
            wc = lam[b, :sl[b]] = _weights(lse, lse2, lo_h[b])
            x = _source64(plan_, source[b, :sl[b]])
        W[b] = wc.sum()
        wx = wc[:, None] * x
        sx[b], sm[b], cross[b] = wx.sum(0), wc @ xp, wx.T @ xp
    t = torch.from_numpy
    return t(lam).to(source.dtype), t(W), t(sx), t(sm), t(cross)


def emicp_rows(source, target, transform, scale, log_outlier, source_lengths,
               target_lengths, plan_: Plan):
    """Batched EM-ICP rows ``(lam (B, N), x_prime (B, N, 3))`` in the plan's form."""
    B, N = source.shape[:2]
    lam = np.zeros((B, N))
    xp = np.zeros((B, N, 3))
    sl, tl = source_lengths.tolist(), target_lengths.tolist()
    scale_h, lo_h = scale.tolist(), log_outlier.tolist()
    for b in range(B):
        if sl[b] == 0 or tl[b] == 0:
            continue
        if plan_.mode == "cells":
            lam_c, mean, _, _, inv = emicp_cells(source[b, :sl[b]], target[b, :tl[b]],
                                                 transform[b], scale_h[b], lo_h[b], plan_)
            lam_b, mean = (lam_c, mean) if inv is None else (lam_c[inv], mean[inv])
        else:
            lse, lse2, mean = rows(source[b, :sl[b]], target[b, :tl[b]], transform[b],
                                   scale_h[b], squares=True, plan_=plan_, numpy=True)
            lam_b = _weights(lse, lse2, lo_h[b])
        lam[b, :sl[b]] = lam_b
        xp[b, :sl[b]] = mean
    dt = source.dtype
    return torch.from_numpy(lam).to(dt), torch.from_numpy(xp).to(dt)


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


def _softassign_cells(query: torch.Tensor, points: torch.Tensor, transform: torch.Tensor,
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


def soft_rows(query, points, transform, scale, query_lengths, point_lengths,
              point_log_weights, squares: bool, offset, plan_: Plan):
    """Batched ``soft.soft_rows`` (lse, lse2, mean) in the plan's form.

    ``offset (B,)`` or None: the logits' known shift (Softassign's βα); Softassign's
    "truncated" and "cells" forms drop the pairs with ``s d² > k²/2 + offset`` ("cells":
    merged cells while they hold several points, :func:`_softassign_cells`).
    """
    B, N = query.shape[:2]
    dt = query.dtype
    lse = torch.full((B, N), -math.inf, dtype=dt)
    lse2 = torch.full((B, N), -math.inf, dtype=dt) if squares else None
    mean = torch.zeros(B, N, 3, dtype=dt)
    ql, pl = query_lengths.tolist(), point_lengths.tolist()
    for b in range(B):
        if ql[b] == 0 or pl[b] == 0:
            continue
        s_b = float(scale[b])
        r2 = math.inf
        if plan_.method == "softassign" and plan_.mode != "exact":
            off = 0.0 if offset is None else max(0.0, float(offset[b]))
            r2 = (plan_.k ** 2 / 2 + off) / s_b
        g = None if point_log_weights is None else point_log_weights[b, :pl[b]]
        if plan_.mode == "cells" and plan_.method == "softassign" and not squares:
            off = 0.0 if offset is None else max(0.0, float(offset[b]))
            got = _softassign_cells(query[b, :ql[b]], points[b, :pl[b]], transform[b], s_b,
                                    g, (plan_.cells_k ** 2 / 2 + off) / s_b, plan_)
            if got is not None:
                lse[b, :ql[b]] = torch.from_numpy(got[0]).to(dt)
                mean[b, :ql[b]] = torch.from_numpy(got[1]).to(dt)
                continue
            plan_.cache.count("per_point")
        lb, l2b, mb = rows(query[b, :ql[b]], points[b, :pl[b]], transform[b], s_b,
                           log_weights=g, radius2=r2, squares=squares, plan_=plan_)
        lse[b, :ql[b]] = lb
        if lse2 is not None and l2b is not None:
            lse2[b, :ql[b]] = l2b
        mean[b, :ql[b]] = mb
    return lse, lse2, mean


def _sinkhorn_step(lse: torch.Tensor, offset: torch.Tensor, log_slack: torch.Tensor,
                   lengths: torch.Tensor) -> torch.Tensor:
    """``soft.sinkhorn_scaling``'s normalisation of a pass's ``lse (B, N)``, the same ops."""
    out = offset.to(lse.dtype)[:, None] - torch.logaddexp(
        lse, log_slack.to(lse.dtype)[:, None].expand_as(lse))
    rows_ = torch.arange(lse.shape[1])[None, :] < lengths[:, None]
    return torch.where(rows_, out, torch.full_like(out, -math.inf))


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
    :func:`soft_rows` and :func:`_softassign_cells`): the results are those of the passes.

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
        """Cell log weights (as :func:`_softassign_cells`) → ``(w, shift)`` or None."""
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
        g = _sinkhorn_step(lse, offset, log_slack, qlen)
    return None


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
        ``kernels._knn_cpu``: float64 distances, no soft-min).

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
