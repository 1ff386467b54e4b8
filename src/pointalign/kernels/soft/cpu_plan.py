"""How the soft methods' CPU passes will run: the plan chosen up front, and its cost model.

:func:`plan` estimates, before the run, what the exact numba passes would take (pairs per
second per thread, measured) and, with the clouds and the schedule, what the approximated
forms would take (cells counted per level, kept pairs sampled), then picks the form: exact
while the exact run is estimated at most ``AUTO_BUDGET_S`` seconds, else the approximation
(the forms and their bounds: :mod:`pointalign.kernels.soft.cpu`). The :class:`Plan` goes
with the run (``cpu.CpuPasses``): it holds the run's trees and cells (:class:`_Cache`), and
its :meth:`Plan.info` is what ``result.info["approximation"]`` records. The tuned constants
of the CPU passes live here, each with the measurement it comes from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pointalign import _threads

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
#: EM-ICP "cells": cell pairs per second per thread of its E-steps, for the run-time
#: estimate only (the form is chosen on the exact estimate). The pruned rate above made the
#: estimate 4.1x (10k points) and 2.7x (40k) the wall time on the quiet 2-core machine, and
#: 2.8x / 2.1x at load 6 (``benchmarks/bench_estimates.py``): the cells' pairs run ~3x faster
EMICP_CELL_PAIRS_PER_S = 1.0e8
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
#: ~2.5 s with the per-point phase's glue). The whole call's wall time (the program's steps
#: between the updates included: 18 % of a 5k x 5k run) against the estimate over 2k-10k
#: points of the bunny pair (``benchmarks/bench_estimates.py``, shared 2-core machine at
#: load 2-12) needs more: 7e-4 gave ratios 0.35 (2k) to 0.85 (10k) at load 8-12, 1.5e-3
#: 0.55-0.67 at 2k (10.9 s at load 2 against 7.2 s predicted), 0.78 at 5k, 1.1-1.7 at
#: 10k-40k; the fixed cost matters most on small clouds
CELL_PASS_OVERHEAD_S = 2.5e-3
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
        total += ns * near / EMICP_CELL_PAIRS_PER_S + 2e-3 + 1e-7 * (ns + nt)
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

    The pairs each pass keeps are counted at two poses of the centred clouds, the larger
    count taken: the start (identity: for up to ``SAMPLE`` source cells, a fixed sample, the
    target cells within the pass's radius, times the source cells) and the aligned pose,
    where the source lies on the target's surface (for up to ``SAMPLE`` target cells, the
    target cells within the radius, times the source cells). The late temperatures run
    near the aligned pose: counted at the start alone, a pair whose clouds start 45° apart
    (bun045 → bun000, 5k points) kept 1.0-3.5× more pairs over the last half of the
    schedule than predicted, and the run took 3-4× its estimate; the aligned count is
    within 5-15 % of the pairs kept there. Cells: one kernel matrix per update
    (``BUILD_S_PER_PAIR``) and a product with it per pass (``CSR_S_PER_PAIR``); per point:
    ``PRUNED_PAIRS_PER_S``; both over the threads, plus ``CELL_PASS_OVERHEAD_S`` (fused
    cells updates) or ``PASS_OVERHEAD_S`` (per point) per pass on one.
    An estimate, not a promise.
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
            start = np.sort(np.square(cs[pick, None, :] - ct[None]).sum(-1).ravel())
            pick_t = rng.choice(ct.shape[0], min(SAMPLE, ct.shape[0]), replace=False)
            aligned = np.sort(np.square(ct[pick_t, None, :] - ct[None]).sum(-1).ravel())
            merged = inv_s is not None or inv_t is not None
            per_level[level] = (cs.shape[0], ct.shape[0], (start, pick.shape[0]),
                                (aligned, pick_t.shape[0]), merged, a)
        ns, nt, at_start, at_aligned, merged, a = per_level[level]
        kk = kc if merged else k
        r = math.sqrt((kk * kk / 2 + beta * alpha) / beta) + (2 * math.sqrt(3) * a if merged else 0)
        pairs = ns * max(float(np.searchsorted(d2, r * r, side="right")) / n_pick
                         for d2, n_pick in (at_start, at_aligned))
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
