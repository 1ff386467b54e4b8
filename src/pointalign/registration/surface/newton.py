"""``surface_newton``: damped Newton steps on the distance-map approximants (Algorithms 1-2)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from pointalign import _threads, _validate
from pointalign.kernels import _first_use, _loop
from pointalign.kernels import surface as _ks
from pointalign.registration._edge import StopReason
from pointalign.registration.criteria import ConvergenceCriteria, as_criteria
from pointalign.registration.result import RegistrationResult
from pointalign.registration.surface.approximants import Approximant, approximant_coefficients
from pointalign.registration.surface.levels import LevelSchedule
from pointalign.registration.surface.problem import (
    _finish,
    _move,
    _prepare,
    _Problem,
    _rms_displacement,
    default_criteria,
)
from pointalign.search.kdtree import KDTreeIndex

#: a line search that finds no step on the finest level is a numerical minimum
#: ("no_decrease", converged) when the refused Newton direction would move the source by at
#: most this fraction of its RMS radius (RMS over its points); a larger one is a stall on a
#: poor model ("stalled", not converged). Measured on bunny subsamples (300-40k points,
#: 5-45°): runs ending within 0.6° refused 5e-4-5e-3; runs stuck 3-70° off (300 points,
#: random clouds that are no surface) refused 1.8e-2-0.4
STALL = 1e-2


def newton_direction(F: np.ndarray, g: np.ndarray, radius: float
                     ) -> tuple[np.ndarray, bool]:
    """Solve for the Newton direction ``ξ = F⁺ g`` ``(6,)``; tell whether F is determined.

    ``F (6, 6)``, ``g (6,)`` float64 about the rotation centre; ``radius`` is the length
    that makes the rotation columns unitless (the source's RMS radius). The degeneracy rule
    has the library's form (as :data:`pointalign.estimate.DEGENERACY_EPS`): on the scaled
    system ``S F S`` (``S = diag(1/radius ×3, 1 ×3)``) eigenvalues at or below ``eps ×`` the
    largest are dropped and the step is the least-norm one on the determined directions;
    F is *determined* when none is dropped (a plane leaves three motions free, a line two,
    identical points three). Here ``eps = 1e-5``: F comes from float32 coefficients and
    float32 block sums, so a free motion shows as an eigenvalue of ~1e-8-1e-6 of the
    largest, of either sign (1e-10 would sit inside that rounding); the bunny's smallest is
    ~0.1 of its largest.
    """
    rank_eps = 1e-5
    s = np.array([1.0 / radius] * 3 + [1.0] * 3) if radius > 0 else np.ones(6)
    ev, V = np.linalg.eigh(F * s[:, None] * s[None, :])
    keep = ev > rank_eps * max(ev[-1], 1e-300)
    inv = np.where(keep, 1.0 / np.where(keep, ev, 1.0), 0.0)
    return s * (V @ (inv * (V.T @ (s * g)))), bool(keep.all())


@dataclass(frozen=True)
class NewtonStep:
    """One damped Newton iteration (Algorithm 2) with the Armijo rule (Algorithm 1).

    From the terms ``F, g, f0`` at the current pose T: the direction ``ξ = F⁺ g``
    (:func:`newton_direction`), then the step ``α ∈ {1, β, β², …}`` (at most 12 trials), the
    first with ``f(α) − f0 <= σ α ∇fᵀξ`` on the exact objective; with ``stretch`` (the
    point approximant) an accepted full step is stretched to ``α ∈ {2, 4, 8}`` while the
    exact objective keeps falling and the condition holds. Each trial is one fused pass at
    the moved pose whose terms, when accepted, are the next iteration's: one pass per
    iteration when the full step is taken.

    Inputs: ``source (N, 3)`` float32, ``coeffs (K, 10)``. State (host, float64): ``T (4, 4)``
    and ``terms (29,)`` at T on this step's level. Record: ``line (6,)`` = (usable: F is not
    empty, accepted, α, f0, determined: of F, passes), the direction ``xi (6,)`` and the new
    state (``T``, ``terms``).
    """

    #: the line search reads each trial's objective on the host: the executor runs it eagerly
    graph_safe: ClassVar[bool] = False
    #: Armijo trials before the step counts as failed (then: next level, or stop)
    MAX_BACKTRACKS: ClassVar[int] = 12
    #: the point approximant's accepted full step may be stretched up to this factor
    MAX_STRETCH: ClassVar[float] = 8.0

    tree: KDTreeIndex             # the target's tree (a signature names it by identity)
    level: int
    tau2: float                   # squared truncation distance (inf: none)
    beta: float
    sigma: float
    stretch: bool
    centroid: tuple[float, float, float]   # the source's centroid (the rotation centre)
    radius: float

    def terms(self, inputs: _loop.Tensors, T: torch.Tensor) -> torch.Tensor:
        """``(29,)`` float64 host terms at pose ``T`` about the moved centroid."""
        center = T[:3, :3] @ torch.tensor(self.centroid, dtype=torch.float64) + T[:3, 3]
        return _ks.newton_terms(inputs["source"], T, center, self.tree.arrays, inputs["coeffs"],
                                self.level, tau2=self.tau2).cpu()

    def __call__(self, inputs: _loop.Tensors, state: _loop.Tensors):
        """Run one iteration: ``(inputs, state) -> (state, record)`` (class docstring)."""
        T, tt = state["T"], state["terms"]
        F, g, f0, _ = _ks.unpack(tt)
        usable = math.isfinite(float(F.diagonal().abs().max())) and bool(F.diagonal().any())
        xi, determined = newton_direction(F.numpy(), g.numpy(), self.radius) if usable else \
            (np.zeros(6), False)
        center = T[:3, :3].numpy() @ np.array(self.centroid) + T[:3, 3].numpy()
        slope = -2.0 * float(g.numpy() @ xi)   # directional derivative of the model, < 0
        alpha, passes, best = 1.0, 0, None
        for _ in range(self.MAX_BACKTRACKS if usable else 0):
            Tc = torch.from_numpy(_move(alpha * xi, center)) @ T
            tc = self.terms(inputs, Tc)
            passes += 1
            if float(tc[27]) - f0 <= self.sigma * alpha * slope:
                best = (alpha, Tc, tc)
                break
            alpha *= self.beta
        while self.stretch and best is not None and best[0] >= 1.0 and \
                best[0] < self.MAX_STRETCH:
            # the cell-mean model is stiff (ICP-like linear convergence: the full step
            # undershoots by a steady factor), so try 2ξ, 4ξ, … while the exact objective
            # keeps falling (Armijo's condition still holds at every accepted length)
            a2 = 2 * best[0]
            Te = torch.from_numpy(_move(a2 * xi, center)) @ T
            te = self.terms(inputs, Te)
            passes += 1
            fe = float(te[27])
            if not (fe < float(best[2][27]) and fe - f0 <= self.sigma * a2 * slope):
                break
            best = (a2, Te, te)
        new = state if best is None else {"T": best[1], "terms": best[2]}
        # one host row: the executor packs records into one float64 row per step
        line = [usable, best is not None, alpha if best is None else best[0], f0, determined,
                passes]
        record = {"line": torch.tensor(line, dtype=torch.float64),
                  "xi": torch.from_numpy(np.asarray(xi, dtype=np.float64)),
                  "T": new["T"], "terms": new["terms"]}
        return new, record


@dataclass
class _NewtonRules:
    """Stopping rules and the level schedule of :func:`surface_newton`, per step's record.

    A step that finds no descent leaves a coarse level for the next finer one and on the
    finest level ends the iteration ("no_decrease": a numerical minimum). An accepted step
    on a coarse level moves the schedule (:meth:`LevelSchedule.after_step`); on the finest
    level it stops on a small update ``||T(ξ) − I||`` or a small relative change of the RMS
    approximate distance (Algorithm 2's two criteria).
    """

    crit: ConvergenceCriteria
    schedule: LevelSchedule
    prob: _Problem
    T: np.ndarray
    terms: np.ndarray
    tau2: float = math.inf
    it: int = 0
    passes: int = 0
    reason: StopReason | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    #: the RMS motion of the source (over its radius) the refused direction asked for, when
    #: the line search found no step on the finest level (nan: it did not happen)
    refused: float = math.nan

    def _stop(self, reason: StopReason) -> bool:
        self.reason = reason
        return True

    def __call__(self, rec: dict[str, np.ndarray]) -> bool:
        """Apply the rules to one record; True when this level's run ends (stop or new level)."""
        usable, accepted, alpha, f0, _, passes = rec["line"].tolist()
        self.passes += int(passes)
        if not usable:
            no_terms = self.terms[28] == 0
            return self._stop(StopReason.NO_CORRESPONDENCES if no_terms else
                              StopReason.DEGENERATE)
        self.it += 1
        sch = self.schedule
        xi = rec["xi"]
        center = self.T[:3, :3] @ self.prob.centroid + self.T[:3, 3]
        if not accepted:
            if sch.finest:
                # the direction no step along lowers the objective: a numerical minimum when
                # it asks for next to no motion, a stall (a poor model: the wrong piece of
                # surface) when it still asks for a large one
                self.refused = _rms_displacement(_move(xi, center), self.T, self.prob) \
                    / max(self.prob.radius, 1e-300)
                return self._stop(StopReason.STALLED if self.refused > STALL
                                  else StopReason.NO_DECREASE)
            sch.descend()
            return True
        # the full Newton step ξ (not the damped one) measures the motion still expected: a
        # step cut short by the line search is small because the model is poor, not because
        # the iteration converged
        full = max(alpha, 1.0) * xi
        disp = _rms_displacement(_move(full, center), self.T, self.prob)
        rot, trans = float(np.linalg.norm(full[:3])), float(np.linalg.norm(full[3:]))
        self.T, self.terms = rec["T"], rec["terms"]
        f1 = float(self.terms[27])
        fit, rmse = self.stats()
        self.history.append({"objective": f1, "step": alpha, "rotation": rot,
                             "translation": trans, "displacement": disp, "fitness": fit,
                             "rmse": rmse, "level": sch.level})
        if sch.finest:
            c = self.crit
            if rot < c.rotation_tolerance and trans < c.translation_tolerance:
                return self._stop(StopReason.SMALL_UPDATE)
            rel_rmse = 1.0 - math.sqrt(max(f1, 0.0) / f0) if f0 > 0 else 0.0
            if f1 == 0 or abs(rel_rmse) < c.relative_rmse:
                return self._stop(StopReason.RELATIVE_CHANGE)
            return False
        return sch.after_step(disp, abs(f0 - f1) / f0 if f0 > 0 else 0.0)

    def stats(self) -> tuple[float, float]:
        """Fitness (terms within the truncation) and RMS approximate distance over them."""
        n, obj, inl = self.prob.source.shape[0], float(self.terms[27]), float(self.terms[28])
        tau2 = self.tau2
        inl_obj = obj - (n - inl) * tau2 if math.isfinite(tau2) else obj
        return inl / n, math.sqrt(max(inl_obj, 0.0) / inl) if inl > 0 else math.inf


@_first_use.first_use("surface_newton")
@_threads.per_call
@_validate.out_of_memory_is_clear
def surface_newton(
    source: Any,
    target: Any = None,
    *,
    approximant: Approximant = "plane",
    tree_depth: int | None = None,
    init: Any = None,
    criteria: ConvergenceCriteria | None = None,
    max_iterations: int | None = None,
    device: str | torch.device | None = None,
    index: KDTreeIndex | None = None,
    max_correspondence_distance: float | None = None,
    armijo: tuple[float, float] = (0.5, 1e-4),
) -> RegistrationResult:
    """Register ``source`` to ``target`` by damped Newton steps on ``Σ_q d̂²(R q + t)``.

    Each iteration (:class:`NewtonStep`) solves the 6×6 system ``F ξ = g`` reduced in one
    fused pass and takes the Armijo step along ξ on the exact objective. Coarse to fine
    (``tree_depth=None``, :class:`LevelSchedule`): the iteration starts 6 levels above the
    finest, where cells are large enough for a lookup without backtracking to stay on the
    right piece of surface while the motion is large (the point approximant, ICP to the
    cell means, starts as :func:`approximate_icp` does); after each accepted step it moves
    to the deepest level whose typical cell radius is at least 2 (point: 8) times the motion
    still expected (the step's RMS displacement of the source, stretched by the observed
    rate of convergence); the stop rules apply on the finest level only. With
    ``tree_depth`` given, that one level is used throughout.

    Precision: without ``index`` the problem is solved in a frame centred on the target's
    centroid (shifted in float64 before anything becomes float32) and the pose composed
    back in float64, so coordinates far from the origin (UTM) keep their precision; an
    ``index`` keeps the caller's coordinates (it was built in them).

    Args:
        source: ``(N, 3)`` points (array, tensor or PointCloud), the query surface.
        target: ``(M, 3)`` points, the template; ignored (may be None) when ``index`` is
            given.
        approximant: ``"point"``, ``"plane"``, ``"second_order"`` or a callable (module
            docstring).
        tree_depth: tree level whose approximants are used (default: coarse to fine, down to
            the deepest level whose cells hold at least 8 points).
        init: ``(4, 4)`` initial ``T_target_source`` (default identity).
        criteria: iteration cap; stops when the Newton step ``ξ = (ω, τ)`` rotates by less
            than ``rotation_tolerance`` and moves the centroid by less than
            ``translation_tolerance`` ("small_update", i.e. ``||T(ξ) − I||`` small), or the
            RMS approximate distance changes by less than ``relative_rmse`` relatively
            ("relative_change"), or no step decreases it: "no_decrease" when the refused
            Newton step would move the source by at most :data:`STALL` of its radius (a
            numerical minimum), else "stalled" (not converged: the distance map is poor at
            that pose; ``info["refused_step"]``). Default:
            :func:`default_criteria` (float32-aware, scaled to the source).
        max_iterations: shortcut for ``criteria`` = :func:`default_criteria` with this cap;
            not both.
        device: compute device; default: the inputs' device, else cuda when available.
        index: a :class:`~pointalign.search.kdtree.KDTreeIndex` over the target, reused across
            calls with its cached approximants (build it once: ``KDTreeIndex(target)``).
        max_correspondence_distance: truncate each term at this distance (``min(d̂², τ²)``),
            so points outside the overlap stop pulling; None: no truncation.
        armijo: ``(β, σ)`` of the Armijo rule: step ``α ∈ {1, β, β², …}`` (12 trials at
            most), accepted when ``f(α) − f(0) <= σ α ∇fᵀξ``. With the point approximant a
            full step that is accepted is then stretched to ``α ∈ {2, 4, 8}`` while the
            exact objective keeps falling and the condition holds (ICP-like linear
            convergence: the Newton step on the cell means undershoots by a steady factor;
            3e5-point bunny at 10°/10 mm: 17 steps instead of 38-50).
        num_threads: CPU threads for this call (:func:`pointalign.threads`).

    Returns:
        :class:`RegistrationResult`; ``iterations`` counts Newton steps (one 6×6 solve
        each); ``fitness`` is the fraction of terms within the truncation distance (1
        without one), ``rmse`` the RMS approximate distance over them. ``converged`` is
        False when the final system leaves a motion undetermined (a plane, a line,
        identical points: ``stop_reason`` "degenerate", ``info["rank_deficient"]``; the
        pose is then the least-norm solution on the determined motions), when the line
        search stalled ("stalled"), and when the data do not determine the pose at the
        end (a sphere turned, a plane slid: "ambiguous", ``info["stability"]``). ``info``
        holds the final ``F`` (6×6), ``objective``, ``tree_depth``, the number of objective
        passes (``passes``, Armijo trials included), ``rank_deficient``, ``approximant``,
        ``refused_step`` and ``max_correspondence_distance`` (None: not truncated).

    Accuracy (docs, "Surface methods"): ``converged`` means the Newton iteration reached
    the minimum of *this* objective; without ``max_correspondence_distance`` that is the
    least-squares fit of the whole source, so on partial overlaps the parts without a
    counterpart pull the pose off the truth, as untruncated ICP's would. Started from the
    reference pose it drifts to the same place: bun045 -> bun000 0.66-0.68° off (truncated at
    5 mm: 0.17-0.18°, at 2 mm: 0.05°; point-to-plane ICP at 5 mm: 0.08°); the fast_gicp LiDAR
    pair 0.78° / 50 mm (1 m: 0.33° / 49 mm; with its ~5k invalid returns at (0, 0, 0) removed
    from each scan, 1 m: 0.12° / 14 mm, point-to-plane ICP 0.07° / 18 mm, Open3D 0.04° /
    16 mm). Pass a truncation of a few point spacings (plus the expected residual noise) on
    scans that overlap partly, and drop invalid returns: points stored at the sensor origin
    in both scans are pinned there, which pulls the pose toward the identity.

    """
    t_start = time.perf_counter()
    as_criteria(criteria, max_iterations)  # checked before any work
    if tree_depth is not None:
        _validate.integer(tree_depth, "tree_depth", minimum=0)
    if not isinstance(armijo, (tuple, list)) or len(armijo) != 2:
        raise TypeError(f"armijo: expected a pair (beta, sigma), each in (0, 1), got {armijo!r}")
    beta = _validate.in_range(armijo[0], "armijo beta", 0.0, 1.0)
    sigma = _validate.in_range(armijo[1], "armijo sigma", 0.0, 1.0)
    tau2 = math.inf if max_correspondence_distance is None else _validate.positive(
        max_correspondence_distance, "max_correspondence_distance") ** 2
    prob, clock = _prepare(source, target, init, device, index,
                           None if not math.isfinite(tau2) else math.sqrt(tau2), "surface_newton")
    crit = criteria if criteria is not None else \
        as_criteria(None, max_iterations, default=default_criteria(prob.source))
    co = clock.stage("approximants", approximant_coefficients, prob.tree, approximant)
    stretch = isinstance(approximant, str) and approximant == "point"
    schedule = LevelSchedule.for_tree(prob.tree, tree_depth, cell_means=stretch)
    inputs = {"source": prob.source, "coeffs": co}
    T0 = torch.from_numpy(prob.pair.init[0].copy())
    rules = _NewtonRules(crit, schedule, prob, T0.numpy(), np.zeros(_ks.N_TERMS), tau2=tau2)
    t_it, runs = time.perf_counter(), []
    while rules.reason is None:
        # the truncation applies on the finest level only: on coarse levels the cells'
        # approximants lie farther from the surface than a correspondence distance meant
        # for it
        step = NewtonStep(prob.tree, schedule.level, tau2 if schedule.finest
                          else math.inf, beta, sigma, stretch, tuple(prob.centroid.tolist()),
                          prob.radius)
        left = int(crit.max_iterations) - rules.it
        if left <= 0:
            rules.reason = StopReason.MAX_ITERATIONS
            break
        T = torch.from_numpy(rules.T.copy())
        rules.terms = step.terms(inputs, T).numpy()
        rules.passes += 1
        run = _loop.iterate(step, inputs, {"T": T, "terms": torch.from_numpy(rules.terms)},
                            max_steps=left)
        runs.append(run)
        ended = False
        for record in run:
            if rules(record):
                ended = True
                break
        if not ended:
            rules.reason = StopReason.MAX_ITERATIONS
    F, g, _, _ = _ks.unpack(torch.from_numpy(rules.terms))
    determined = newton_direction(F.numpy(), g.numpy(), prob.radius)[1] and \
        rules.terms[28] > 0
    reason = rules.reason
    if not determined and reason is not StopReason.NO_CORRESPONDENCES:
        reason = StopReason.DEGENERATE
    fit, rmse = rules.stats()
    timings = dict(clock.timings, iterate=time.perf_counter() - t_it)
    timings["total"] = time.perf_counter() - t_start
    info = {"F": F, "objective": float(rules.terms[27]), "tree_depth": schedule.level,
            "passes": rules.passes, "rank_deficient": not determined,
            "refused_step": rules.refused,
            "approximant": approximant if isinstance(approximant, str) else "custom",
            "device_steps": sum(r.launched for r in runs),
            "max_correspondence_distance": max_correspondence_distance}
    return _finish(prob, rules.T, fit, rmse, rules.it, reason, rules.history, timings, info)
