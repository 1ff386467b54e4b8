"""The soft methods' passes on the CPU (numba): exact, or a stated, bounded approximation.

EM-ICP and Softassign sum over all N·M pairs every pass; at 40k × 40k that is 1.6e9
exponentials per EM-ICP iteration, minutes for a run. Here the numba row pass
(``cpu_rows``: all cores, float64 sums with a running maximum per row) runs over a k-d tree
of the points side, and :func:`prepare` chooses up front, from a cost estimate
(``cpu_plan``), one of three forms. This docstring is where their bounds are stated:

* ``"exact"``: every pair (the tree prunes nothing); equal to the PyTorch reference up to
  the order of float64 sums. Chosen automatically while its estimate is at most
  ``AUTO_BUDGET_S`` seconds.
* ``"cells"`` (EM-ICP): at each annealing step (scale s = 1/(2σ²)) both clouds are merged
  into cubic cells of side ``a = c·σ`` rounded down to a power of √2 (in the input's
  unit; ``c = CELL_RATIO`` = 0.4, so ``a ∈ (cσ/√2, cσ]``, half-diagonal
  ``h = a√3/2 ≤ 0.87cσ``), and pairs of cells whose centroids are more than ``kσ`` apart
  are dropped (``k = TRUNCATE_K`` = 4). A target cell acts as its centroid ȳ with weight n
  (its count); each source point takes the E-step values (λ, x') of its cell's centroid.
  Bounds, at a source centroid q and a kept target cell at centroid distance d (Jensen and
  Hoeffding's lemma on the centred offsets δ of the cell's points: mean |δ|² ≤ 3a²/4 = h²,
  each coordinate's variance being at most a²/4, and any projection of δ within an
  interval of width 2h): ``n e^(−s d²) / Σ_cell e^(−s d_j²) ∈ [e^(−(4 s d h + s h²)²/8),
  e^(s h²)]``: second order in h/σ (at d = σ, c = 0.4: within [0.93, 1.06],
  ``cpu_plan.cell_factor``); a point lies within the full diagonal a√3 = 2h of its cell's
  centroid, so each dropped point's term is below ``e^(−s (kσ − 2h)²)`` (c = 0.4, k = 4:
  e^(−(4 − 0.69)²/2) = 4.2e-3). Once the cells are smaller than the point spacing they
  hold one point each and only the truncation is left (the late, small-σ iterations).
* ``"truncated"`` (Softassign, per point): pairs with ``s d² > k²/2 + offset`` are dropped,
  where ``offset`` = βα is the logits' known shift (so every dropped term of a Sinkhorn
  pass, ``exp(−β(d² − α)) c_j``, is below ``e^(−k²/2)/w``: its scalings are at most ``1/w``,
  w the slack entry); k is chosen so that every normaliser ``w + Σ`` is low by a relative
  ``max(N, M) e^(−k²/2)/w² ≤ SOFTASSIGN_TOLERANCE`` (1e-4). Kept pairs are exact. At the
  hot temperatures the radius exceeds the cloud and every pair is kept (2k × 2k bunny,
  seed schedule: all pairs for the first ~30 of 100 temperatures, 72 % of the 4.4e9 pair
  terms there).
* ``"cells"`` (Softassign, chosen by "approximate"/"auto" when the schedule is known): at
  each β (σ = 1/√(2β)) both clouds are merged into cubic cells of side ``a = c·σ`` rounded
  down to a power of √2 (``c = SOFT_CELL_RATIO`` = 0.5); a source cell meets a target cell
  through one kernel value at their centroids (the target's weighted by its scalings)
  times the source count and the target's summed scalings, every point takes its cell's
  row values, and cell pairs beyond the truncation radius for ``CELLS_TOLERANCE`` (1e-2)
  plus ``2√3 a`` are dropped (every dropped point pair lies beyond that radius). Each kept
  cell pair's term is within ``[e^(−(4√3 βda + 12βa²)²/8), e^(1.5βa²)]`` of its block's
  exact sum (``cpu_plan.block_factor``, d the centroid distance; at d = σ, c = 0.5:
  [0.27, 1.21]; second order in a/σ), so the hot phase is a coarse Softassign on cell
  centroids. Once both clouds hold one point per cell (the cold temperatures, where the
  pose is settled) the passes are the per-point "truncated" ones with the 1e-4 normaliser
  bound. A whole update's passes run in one call over a kernel matrix of the cell pairs
  (``cpu_cells.softassign_update``: the same sums in the same order as the passes one by
  one, so the same pose up to the rounding of PyTorch's vector kernels between passes).
  The plan predicts the phases (``Plan.phases``); ``info()["passes"]`` counts what ran.
  The final pose is measured against the exact form in the tests (bunny subsample, short
  schedule: within 0.05°).

A row with no kept pair gets lse = −inf (λ = 0: an outlier; Softassign: only the slack).
:class:`CpuPasses` (from :func:`prepare`) runs a run's passes in its plan's form.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pointalign import _threads
from pointalign.kernels.horn import horn_from_sums
from pointalign.kernels.soft import cpu_cells
from pointalign.kernels.soft.cpu_plan import (  # noqa: F401 (re-exported: the forms' constants)
    AUTO_BUDGET_S,
    CELL_RATIO,
    CELLS_TOLERANCE,
    SOFT_CELL_RATIO,
    SOFTASSIGN_TOLERANCE,
    TRUNCATE_K,
    Plan,
    plan,
)
from pointalign.kernels.soft.cpu_rows import _weights, nearest_d2, rows
from pointalign.kernels.soft.reference import (
    Passes,
    SoftRows,
    keep_frozen,
    lengths_or_all,
    softassign_passes,
)


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
            lam_c, xp, x, n, inv = cpu_cells.emicp_cells(
                source[b, :sl[b]], target[b, :tl[b]], transform[b], scale_h[b], lo_h[b], plan_)
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
            lam_c, mean, _, _, inv = cpu_cells.emicp_cells(
                source[b, :sl[b]], target[b, :tl[b]], transform[b], scale_h[b], lo_h[b], plan_)
            lam_b, mean = (lam_c, mean) if inv is None else (lam_c[inv], mean[inv])
        else:
            lse, lse2, mean = rows(source[b, :sl[b]], target[b, :tl[b]], transform[b],
                                   scale_h[b], squares=True, plan_=plan_, numpy=True)
            lam_b = _weights(lse, lse2, lo_h[b])
        lam[b, :sl[b]] = lam_b
        xp[b, :sl[b]] = mean
    dt = source.dtype
    return torch.from_numpy(lam).to(dt), torch.from_numpy(xp).to(dt)


def soft_rows(query, points, transform, scale, query_lengths, point_lengths,
              point_log_weights, squares: bool, offset, plan_: Plan):
    """Batched ``soft.soft_rows`` (lse, lse2, mean) in the plan's form.

    ``offset (B,)`` or None: the logits' known shift (Softassign's βα); Softassign's
    "truncated" and "cells" forms drop the pairs with ``s d² > k²/2 + offset`` ("cells":
    merged cells while they hold several points, :func:`.cpu_cells.softassign_cells`).
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
            got = cpu_cells.softassign_cells(query[b, :ql[b]], points[b, :pl[b]], transform[b],
                                             s_b, g, (plan_.cells_k ** 2 / 2 + off) / s_b, plan_)
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


@dataclass(frozen=True)
class CpuPasses(Passes):
    """A run's passes on the CPU in its :class:`~.cpu_plan.Plan`'s form (module doc).

    The plan holds the run's trees and cells and counts the passes run in each form; the
    passes run on the host with numba's threads while PyTorch's small operations between
    them run on one (:meth:`running`). Arguments and results as
    :class:`~pointalign.kernels.soft.reference.Passes`.
    """

    plan: Plan = field(kw_only=True)

    @property
    def estimate_s(self) -> float:
        """Predicted seconds of the chosen form's passes for the whole run."""
        return self.plan.estimate_s

    @property
    def exact_estimate_s(self) -> float:
        """Predicted seconds of the exact passes for the whole run."""
        return self.plan.exact_estimate_s

    @property
    def form(self) -> str:
        """"exact", "cells" or "truncated" (module doc)."""
        return self.plan.mode

    def info(self) -> dict:
        """Return the plan's record: form, parameters, bounds, passes run (JSON-safe)."""
        return self.plan.info()

    def running(self):
        """One PyTorch thread during the run (``_threads.torch_single``).

        Between the passes PyTorch only handles (B, N) vectors and the 4x4 poses; on 2
        threads each of those small ops paid an OpenMP fork/join (weighted Horn on 2k points:
        13.5 ms of CPU on 2 threads against 1.4 ms on one, loaded machine). The numba passes
        keep their own thread count (``_threads.numba_threads``).
        """
        return _threads.torch_single()

    def soft_rows(self, query, points, transform, scale, query_lengths=None,
                  point_lengths=None, *, point_log_weights=None, squares=False,
                  offset=None) -> SoftRows:
        """Row reductions in the plan's form (``offset``: Softassign's βα, see module doc)."""
        return SoftRows(*soft_rows(query, points, transform, scale,
                                   lengths_or_all(query_lengths, query),
                                   lengths_or_all(point_lengths, points), point_log_weights,
                                   squares, offset, self.plan))

    def emicp_rows(self, source, target, transform, scale, log_outlier, source_lengths=None,
                   target_lengths=None):
        """EM-ICP's ``(λ, x')`` in the plan's form."""
        return emicp_rows(source, target, transform, scale, log_outlier,
                          lengths_or_all(source_lengths, source),
                          lengths_or_all(target_lengths, target), self.plan)

    def emicp_step(self, source, target, transform, scale, log_outlier, frozen,
                   source_lengths=None, target_lengths=None):
        """Sum the E-step into Horn's moments on the host (no (B, N, 3) x'), then solve Horn."""
        lam, *moments = emicp_moments(source, target, transform, scale, log_outlier,
                                      lengths_or_all(source_lengths, source),
                                      lengths_or_all(target_lengths, target), self.plan)
        T_new, valid = horn_from_sums(*moments)
        return keep_frozen(T_new, valid, frozen, transform), valid, lam

    def softassign_update(self, source, target, transform, beta, offset, log_slack,
                          source_lengths, target_lengths, rounds: int):
        """Run the update fused over its kernel matrix where the cells allow, else pass by pass.

        ``cpu_cells.softassign_update`` gives the passes' sums in their order; it declines
        (None) where a pass would not run through the matrix, and the passes then run one
        by one (:func:`~pointalign.kernels.soft.reference.softassign_passes`).
        """
        got = cpu_cells.softassign_update(source, target, transform, beta, offset, log_slack,
                                          source_lengths, target_lengths, rounds, self.plan)
        if got is not None:
            return got
        return softassign_passes(self, source, target, transform, beta, offset, log_slack,
                                 source_lengths, target_lengths, rounds)

    def nearest_d2(self, query, points, transform, max_d2, query_lengths=None,
                   point_lengths=None) -> torch.Tensor:
        """Exact, through the run's k-d trees (``inf`` beyond ``max_d2`` and on padding)."""
        return nearest_d2(query, points, transform, lengths_or_all(query_lengths, query),
                          lengths_or_all(point_lengths, points), max_d2, self.plan)


def exact_passes(device: str, n: int, m: int) -> CpuPasses:
    """Return the exact numba passes for one call over ``n`` × ``m`` points (a fresh plan)."""
    return CpuPasses(device, plan=plan(n, m, 1, approximation="exact"))


def prepare(method: str, source: torch.Tensor, target: torch.Tensor,
            source_lengths: torch.Tensor, target_lengths: torch.Tensor, *, iterations: int,
            approximation: str, schedule: Callable[[], dict] | None, outlier_weight: float,
            sinkhorn_rounds: int, per_temperature: int) -> CpuPasses:
    """Choose the form of a run's passes up front (``soft.prepare``, whose arguments these are).

    EM-ICP: ``iterations`` × B row passes; the first problem's clouds and σ schedule let
    the plan count cells. Softassign: ``iterations`` × 2 × rounds × B passes; the first
    problem's clouds, β schedule and α let the plan predict its "cells" phases (without a
    schedule: the per-point "truncated" form throughout).
    """
    n, m, B = source.shape[1], target.shape[1], source.shape[0]
    plan_ = schedule() if schedule is not None else {}
    if method == "emicp":
        made = plan(n, m, iterations * B, approximation=approximation, method="emicp",
                    source=source[0].double().numpy(), target=target[0].double().numpy(),
                    sigmas=plan_.get("sigmas"))
        return CpuPasses(str(source.device), plan=made)
    extra: dict[str, Any] = {}
    if plan_.get("betas"):
        ns, nt = int(source_lengths[0]), int(target_lengths[0])
        extra = dict(source=source[0, :ns].double().numpy(),
                     target=target[0, :nt].double().numpy(), betas=plan_["betas"],
                     alpha=plan_.get("alpha", 0.0),
                     passes_per_beta=per_temperature * 2 * sinkhorn_rounds,
                     passes_per_update=2 * sinkhorn_rounds)
    made = plan(n, m, iterations * 2 * sinkhorn_rounds * B, approximation=approximation,
                method="softassign", outlier_weight=outlier_weight, **extra)
    return CpuPasses(str(source.device), plan=made)
