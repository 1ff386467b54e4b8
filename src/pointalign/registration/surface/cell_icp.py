"""``approximate_icp``: the paper's approximate ICP, the tree cell's mean as the partner."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from pointalign import _threads, _validate, estimate
from pointalign.kernels import _loop, _np_math, normal_eq, upload
from pointalign.kernels import surface as _ks
from pointalign.registration._edge import StopReason
from pointalign.registration.criteria import ConvergenceCriteria, as_criteria
from pointalign.registration.result import RegistrationResult
from pointalign.registration.surface.levels import LevelSchedule
from pointalign.registration.surface.problem import (
    _finish,
    _prepare,
    _Problem,
    _rms_displacement,
    default_criteria,
)
from pointalign.search.kdtree import KDTreeIndex


@dataclass(frozen=True)
class CellMeanStep:
    """One approximate-ICP step on the device: cell means as correspondences, then Horn.

    Move the source by T, descend the tree to ``level`` (no backtracking) and take each
    point's cell mean as its partner (dropped beyond ``tau2``); reduce the pairs and solve
    Horn's closed form in float64: one kernel call,
    :func:`pointalign.kernels.surface.cell_mean_step` (the ICP update with the cell means as
    the target).

    Inputs: ``source (1, N, 3)`` float32, ``means (1, K, 3)`` (the nodes' means),
    ``lengths (1,)``, ``center (1, 3)``, ``level (1,)`` int64 (an input, not a field: one
    CUDA graph serves every level, where a graph per level evicted the others from the
    executor's cache every call). State: ``T (1, 4, 4)`` float64 and its float32 ``Tf``.
    Record: ``sums (1, 30)`` at T, the update ``D``, ``T' = D T`` and ``flags``.
    """

    graph_safe: ClassVar[bool] = True
    tree: KDTreeIndex             # the target's tree (a signature keys it by its layout)
    tau2: float

    def __call__(self, inputs: _loop.Tensors, state: _loop.Tensors):
        """Run one step: ``(inputs, state) -> (state, record)`` (class docstring)."""
        T = state["T"]
        sums, D, T_new, Tf_new, flags = _ks.cell_mean_step(
            inputs["source"], inputs["means"], T, state["Tf"], self.tree.arrays,
            inputs["level"], tau2=self.tau2, lengths=inputs["lengths"], center=inputs["center"],
            eps=estimate.DEGENERACY_EPS)
        return {"T": T_new, "Tf": Tf_new}, {"sums": sums, "update": D, "T": T_new,
                                            "flags": flags}


@dataclass
class _CellMeanRules:
    """Stopping rules and the level schedule of :func:`approximate_icp`, per step's record.

    The cell-mean lookup is not a nearest-neighbour search, so ICP's monotonicity fails: a
    step that raised the RMS distance to the cell means is taken back, and the iteration
    goes one level finer or (finest level) stops ("no_decrease"). Too few distinct cell
    means for Horn's solve also send it one level finer (finest: "degenerate").
    """

    crit: ConvergenceCriteria
    schedule: LevelSchedule
    prob: _Problem
    T: np.ndarray
    it: int = 0
    fit: float = 0.0
    rmse: float = math.inf
    prev_rmse: float = math.inf
    reason: StopReason | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    #: relative change of the RMS distance made by the last step kept (inf: none yet)
    last_rel: float = math.inf
    #: the iteration ended on "no_decrease" while its steps still changed the RMS distance by
    #: LevelSchedule.LEVEL_RELATIVE_CHANGE or more: a stall of the cell-mean lookup (a step
    #: moved points into other cells), not a settled pose
    stalled: bool = False

    def __post_init__(self) -> None:
        self.T_prev, self.fit_prev = self.T, self.fit

    def _stop(self, reason: StopReason) -> bool:
        self.reason = reason
        return True

    def __call__(self, rec: dict[str, np.ndarray]) -> bool:
        """Apply the rules to one record; True when this level's run ends (stop or new level)."""
        s, sch = rec["sums"][0], self.schedule
        n_in = float(s[28])
        if n_in < 3:
            return self._stop(StopReason.NO_CORRESPONDENCES)
        fit, rmse = n_in / self.prob.source.shape[0], math.sqrt(float(s[29]) / n_in)
        if self.it >= self.crit.max_iterations:  # the last pose, evaluated
            self.fit, self.rmse = fit, rmse
            return self._stop(StopReason.MAX_ITERATIONS)
        if rmse > self.prev_rmse * (1 + 1e-9):
            # the previous step raised the RMS distance to the cell means (on coarse levels
            # the cloud then drifts along the cells): take it back, go finer or stop
            self.T, self.fit, self.rmse = self.T_prev, self.fit_prev, self.prev_rmse
            self.history.pop()
            if sch.finest:
                self.stalled = not self.last_rel < LevelSchedule.LEVEL_RELATIVE_CHANGE
                return self._stop(StopReason.NO_DECREASE)
            sch.descend()
            self.prev_rmse = math.inf
            return True
        self.fit, self.rmse = fit, rmse
        self.it += 1
        if not rec["flags"][0, normal_eq.FLAG_VALID]:
            if sch.finest:
                return self._stop(StopReason.DEGENERATE)
            sch.descend()  # too few distinct cell means: go finer
            return True
        D = rec["update"][0]
        disp = _rms_displacement(D, self.T, self.prob)
        # ICP's host form of transforms.rotation_angle: NumPy, ~5 µs a step (the tensor
        # form is ~60 small PyTorch ops, ~100 times that: new work in every step)
        rot = float(_np_math.rotation_angle(D[None, :3, :3])[0])
        trans = float(np.linalg.norm(D[:3, 3]))
        self.T_prev, self.fit_prev = self.T, fit
        self.T = rec["T"][0]
        self.history.append({"rmse": rmse, "fitness": fit, "rotation": rot,
                             "translation": trans, "displacement": disp,
                             "level": sch.level})
        prev, self.prev_rmse = self.prev_rmse, rmse
        rel = abs(prev - rmse) / prev if math.isfinite(prev) and prev > 0 else math.inf
        self.last_rel = rel
        if sch.finest:
            c = self.crit
            if rot < c.rotation_tolerance and trans < c.translation_tolerance:
                return self._stop(StopReason.SMALL_UPDATE)
            if rel < c.relative_rmse:
                return self._stop(StopReason.RELATIVE_CHANGE)
            return False
        if sch.after_step(disp, rel):
            self.prev_rmse = math.inf
            return True
        return False


@_threads.per_call
@_validate.out_of_memory_is_clear
def approximate_icp(
    source: Any,
    target: Any = None,
    *,
    tree_depth: int | None = None,
    init: Any = None,
    criteria: ConvergenceCriteria | None = None,
    max_iterations: int | None = None,
    device: str | torch.device | None = None,
    index: KDTreeIndex | None = None,
    max_correspondence_distance: float | None = None,
) -> RegistrationResult:
    """ICP whose correspondence is the mean point of the tree cell the source point falls in.

    The paper's approximate GPU ICP (GCAICP, :class:`CellMeanStep`): descend the target's
    k-d tree to a level without backtracking, take that node's mean as the corresponding
    point, drop pairs farther apart than ``max_correspondence_distance`` (if given; finest
    level only), and solve ``argmin Σ ||R x + t − y||²`` in closed form (Horn; reduced and
    solved on the device). Coarse to fine as :func:`surface_newton` with the cell-mean
    schedule (:class:`LevelSchedule`: first cells of at least 0.3 of the target's RMS
    radius, margin 8, one level deeper when the RMS distance to the cell means changes by
    less than 1e-3). On the finest level it stops on a small update,
    ``|Δrmse| / rmse < relative_rmse``, or a step that would raise the RMS distance
    ("no_decrease": the step is not taken; converged). A pose the data do not determine (a
    sphere turned, three points, a plane slid) is "ambiguous" (``info["stability"]``).
    Arguments and precision as :func:`surface_newton` (default criteria:
    :func:`default_criteria`); ``max_iterations=n`` is a shortcut for
    ``criteria=dataclasses.replace(default_criteria(source), max_iterations=n)``.

    ``num_threads``: CPU threads for this call (:func:`pointalign.threads`).

    ``info`` holds ``tree_depth`` (the last level), ``device_steps``, ``cuda_graph``,
    ``max_correspondence_distance``, ``last_relative_change`` (the relative change of the
    RMS distance to the cell means made by the last step kept; inf when it was the first on
    its level) and ``stalled``: the iteration ended on a step that raised the distance
    while that change was still at least 1e-3 (:attr:`LevelSchedule.LEVEL_RELATIVE_CHANGE`),
    i.e. a step moved points into other cells while the pose was still moving. The stop is
    then the lookup's, not a settled pose: ``stop_reason`` keeps the library's meaning of
    "no_decrease" (converged), and ``stalled`` says how much to trust it. (Neither it nor
    whether the finest level kept a step tells a wrong pose from a right one: runs 0.15°
    off on a 2e5-point bunny end as "stalled" as runs 20° off on clouds that are no
    surface, so ``converged`` does not read it.)

    Accuracy: the partner is the mean of the cell a point falls in, not the surface under
    it, so the fixed points of the iteration lie where the cell assignment is consistent,
    not at the least-squares pose: measured from the identity (docs, "Surface methods"):
    bun045 -> bun000 4.2° / 3.8 mm (50 steps, still creeping), the fast_gicp LiDAR pair
    2.4° / 0.89 m (stalled), KITTI 00 frames 1 -> 0 0.32° / 0.95 m (stalled: its 0.86 m
    forward motion barely recovered; the cells along a LiDAR scan line span metres, and on
    the coarse levels tens of metres, so each step moves the scan by centimetres). Use it as
    a cheap first stage and refine with :func:`surface_newton` or
    :func:`pointalign.icp` with a truncation.
    """
    t_start = time.perf_counter()
    as_criteria(criteria, max_iterations)  # checked before any work
    if tree_depth is not None:
        _validate.integer(tree_depth, "tree_depth", minimum=0)
    tau2 = math.inf if max_correspondence_distance is None else _validate.positive(
        max_correspondence_distance, "max_correspondence_distance") ** 2
    prob, clock = _prepare(source, target, init, device, index,
                           None if not math.isfinite(tau2) else math.sqrt(tau2), "approximate_icp")
    dev = prob.pair.device
    crit = criteria if criteria is not None else \
        as_criteria(None, max_iterations, default=default_criteria(prob.source))
    tree = prob.tree

    def cell_means() -> torch.Tensor:
        key = "surface:mean"
        if not tree.has_payload(key):
            tree.attach(key, (tree.node_sums(tree.points) / tree.node_sizes()[:, None]).float())
        return tree.payload(key)

    means = clock.stage("approximants", cell_means)
    schedule = LevelSchedule.for_tree(tree, tree_depth, cell_means=True)
    inputs = {"source": prob.source[None], "means": means[None],
              "lengths": prob.pair.source_lengths, "center": means[:1].contiguous()}
    rules = _CellMeanRules(crit, schedule, prob, prob.pair.init[0].copy())
    t_it, runs = time.perf_counter(), []
    while rules.reason is None:
        step = CellMeanStep(tree, tau2 if schedule.finest else math.inf)
        T = torch.from_numpy(rules.T.copy())[None].to(dev)
        inputs["level"] = upload([schedule.level], dtype=torch.int64, device=dev)
        run = _loop.iterate(step, inputs, {"T": T, "Tf": T.float()},
                            max_steps=int(crit.max_iterations) - rules.it + 1)
        runs.append(run)
        for record in run:
            if rules(record):
                break
        else:
            rules.reason = StopReason.MAX_ITERATIONS
    timings = dict(clock.timings, iterate=time.perf_counter() - t_it)
    timings["total"] = time.perf_counter() - t_start
    info = {"tree_depth": schedule.level, "device_steps": sum(r.launched for r in runs),
            "cuda_graph": runs[-1].graph if runs else "off", "stalled": rules.stalled,
            "last_relative_change": rules.last_rel,
            "max_correspondence_distance": max_correspondence_distance}
    assert rules.reason is not None
    return _finish(prob, rules.T, rules.fit, rules.rmse, rules.it, rules.reason,
                   rules.history, timings, info)
