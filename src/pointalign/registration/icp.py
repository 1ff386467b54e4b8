"""Iterative closest point: point-to-point (Horn) and point-to-plane (linearised 6×6), batched.

Each iteration (:class:`IcpStep`): move the source by the current estimate, find for every
source point the nearest target point within ``max_correspondence_distance`` (an
:class:`~pointalign.search.base.Index` built once over the target and reused), reduce the
correspondences in one fused pass and solve for the update in float64
(:func:`pointalign.kernels.normal_eq.icp_update`):

* point-to-point: ``argmin Σ w_i ||R x_i + t − y_i||²`` by Horn's quaternion method from the
  weighted moments (Besl & McKay, "A method for registration of 3-D shapes", PAMI 1992;
  Horn, JOSA A 1987);
* point-to-plane: ``argmin Σ w_i (n_iᵀ(R x_i + t − y_i))²`` linearised at the current
  estimate, a 6×6 system (Chen & Medioni, "Object modelling by registration of multiple
  range images", IVC 1992).

Weights w_i come from the robust kernel (IRLS: recomputed from the current residuals). The
search is warm-started where the index allows it (the last correspondences as hints).

The stopping rules (:class:`_Rules`) read each step's record on the host; how the steps run
(eagerly, or replayed from CUDA graphs with one step in flight) is the executor's business
(:mod:`pointalign.kernels._loop`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from pointalign import _progress, _threads, _validate, estimate
from pointalign.kernels import _first_use, _loop, _np_math, normal_eq, upload
from pointalign.kernels import ransac as _kr
from pointalign.registration import _edge, anderson, checks
from pointalign.registration._edge import StopReason
from pointalign.registration.criteria import (
    ConvergenceCriteria,
    RobustKernel,
    as_criteria,
    as_robust_kernel,
)
from pointalign.registration.result import RegistrationResult
from pointalign.registration.stability import stability
from pointalign.search import policy
from pointalign.search.shifted import Offset, ShiftedIndex

METHODS = ("point_to_point", "point_to_plane")

#: neighbours used for target normals when point-to-plane needs them and none are given
NORMALS_K = 20


@dataclass(frozen=True)
class IcpStep:
    """One ICP iteration on the device for B problems in lockstep.

    Inputs: ``source (B, N, 3)``, ``target (B, M, 3)``, ``lengths (B,)``, ``center (B, 3)``
    and, for point-to-plane, ``normals (B, M, 3)``. State: ``T (B, 4, 4)`` float64, the same
    as float32 ``Tf``, and ``hint (B, N)`` (the last correspondences) for indexes that read
    it. Record: ``sums (B, 30)`` at T, the update ``D``, ``T' = D T`` and ``flags (B, 2)``
    (valid, usable) of D.
    """

    graph_safe: ClassVar[bool] = True
    indexes: tuple            # one correspondence index per problem
    max_distance: float
    plane: bool
    kernel: str
    scale: float

    def _search(self, x: torch.Tensor, hint: torch.Tensor | None) -> torch.Tensor:
        """Nearest target point within the bound for each row of ``x (B, N, 3)``; -1: none."""
        if all(ix is self.indexes[0] for ix in self.indexes):  # one index: one query
            h = None if hint is None else hint.reshape(-1)
            r = self.indexes[0].nearest_within(x.reshape(-1, 3), self.max_distance, hint=h)
            return r.idx.view(x.shape[:2])
        out = []
        for b, ix in enumerate(self.indexes):
            h = None if hint is None else hint[b]
            out.append(ix.nearest_within(x[b], self.max_distance, hint=h).idx[:, 0])
        return torch.stack(out)

    def __call__(self, inputs: _loop.Tensors, state: _loop.Tensors):
        """Run one iteration: search, fused sums and solve; return the new state and record."""
        T, Tf = state["T"], state["Tf"]
        x = _kr.transform_points(Tf, inputs["source"])
        with _validate.trusted():
            idx = self._search(x, state.get("hint"))
        sums, D, T_new, Tf_new, flags = normal_eq.icp_update(
            x, inputs["target"], idx, transform=T, plane=self.plane,
            target_normals=inputs.get("normals"), lengths=inputs["lengths"],
            center=inputs["center"], kernel=self.kernel, scale=self.scale,
            eps=estimate.DEGENERACY_EPS)
        new = {"T": T_new, "Tf": Tf_new} | ({"hint": idx} if "hint" in state else {})
        return new, {"sums": sums, "update": D, "T": T_new, "flags": flags}


@dataclass
class _Rules:
    """The stopping rules, applied to each step's record for B problems at once.

    Iteration 0 evaluates the initial estimate. Iteration j ≥ 1 accepts the update of step
    j − 1 (unless it is unusable: "degenerate") and evaluates it with step j's sums; a
    problem stops with no correspondences left, on a small update (Besl–McKay) or when
    fitness and RMSE stop changing (Open3D's relative rule).
    """

    crit: ConvergenceCriteria
    n_src: np.ndarray
    T: np.ndarray
    translation_tolerance: np.ndarray  # (B,) metres (ConvergenceCriteria.translation_for)
    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    pending: tuple[np.ndarray, ...] = ()  # the last record's update (D, T', flags)

    def __post_init__(self) -> None:
        B = self.T.shape[0]
        self.active = np.ones(B, dtype=bool)
        self.reasons = [StopReason.MAX_ITERATIONS] * B
        self.iterations = np.zeros(B, dtype=np.int64)
        self.rank_deficient = np.zeros(B, dtype=bool)

    def _stop(self, mask: np.ndarray, reason: StopReason) -> None:
        hit = self.active & mask
        if hit.any():
            for b in np.flatnonzero(hit):
                self.reasons[b] = reason
            self.active &= ~hit

    def continues(self, prev: dict[str, np.ndarray], last: dict[str, np.ndarray]) -> bool:
        """Guess that the run goes on past a chunk ending in records ``prev``, ``last``.

        The executor's ``ahead`` (:func:`pointalign.kernels._loop.iterate`): every active
        problem still has correspondences and a usable update, moves ten times more than the
        small-update tolerances, and changes its fitness or RMSE ten times more than the
        relative ones. A wrong guess costs a chunk of device work, never a result.
        """
        c, n = self.crit, self.n_src
        s0, s1, D = prev["sums"], last["sums"], last["update"]
        t = D[:, :3, 3]
        moving = (np.sqrt((t * t).sum(-1)) > 10 * self.translation_tolerance) \
            | (_np_math.rotation_angle(D[:, :3, :3]) > 10 * c.rotation_tolerance)
        r0, r1 = (np.sqrt(x[:, 29] / np.maximum(x[:, 28], 1)) for x in (s0, s1))
        changing = (np.abs(s1[:, 28] - s0[:, 28]) / n > 10 * c.relative_fitness) \
            | (np.abs(r1 - r0) / np.maximum(r0, 1e-300) > 10 * c.relative_rmse)
        going = (s1[:, 28] > 0) & (last["flags"][:, 1] != 0) & moving & changing
        return bool(self.active.any() and (going | ~self.active).all())

    def __call__(self, rec: dict[str, np.ndarray]) -> bool:
        """Apply the rules to one record; True when every problem has stopped."""
        s = rec["sums"]
        cnt = s[:, 28].copy()
        fit = cnt / self.n_src
        rmse = np.sqrt(s[:, 29] / np.maximum(cnt, 1))
        if not (cnt > 0).all():
            rmse[~(cnt > 0)] = np.inf
        ok = rec["accepted"].astype(bool) if "accepted" in rec else None  # None: all
        if self.step == 0:
            self.fitness, self.rmse, self.sums, self.count = fit, rmse, s.copy(), cnt
            self._stop(cnt == 0, StopReason.NO_CORRESPONDENCES)
        else:
            D, T_next, flags = self.pending
            # an accelerated pose whose energy rose is discarded (registration/anderson.py)
            usable = flags[:, 1] != 0
            if ok is None:
                self.rank_deficient |= self.active & (flags[:, 0] == 0)
                act = self.active & usable
            else:
                self.rank_deficient |= self.active & ok & (flags[:, 0] == 0)
                act = self.active & ok & usable
            if not usable.all():
                self._stop(~usable if ok is None else ok & ~usable, StopReason.DEGENERATE)
            prev_fit, prev_rmse = self.fitness, self.rmse
            if act.all():  # the usual record: every problem takes its update
                self.T, self.sums = T_next.copy(), s.copy()
                self.fitness, self.rmse, self.count = fit, rmse, cnt
                self.iterations += 1
            else:
                self.T = np.where(act[:, None, None], T_next, self.T)
                self.iterations += act
                self.fitness, self.rmse = np.where(act, fit, prev_fit), np.where(act, rmse,
                                                                                 prev_rmse)
                self.sums[act], self.count = s[act], np.where(act, cnt, self.count)
            c = self.crit
            t = D[:, :3, 3]
            small = np.sqrt((t * t).sum(-1)) < self.translation_tolerance
            if ok is not None:
                small &= ok
            if small.any():  # the angle only then: most steps move more than the tolerance
                small &= _np_math.rotation_angle(D[:, :3, :3]) < c.rotation_tolerance
            none = cnt == 0
            relative = (np.abs(self.fitness - prev_fit) < c.relative_fitness) \
                & (np.abs(self.rmse - prev_rmse) / np.maximum(prev_rmse, 1e-300)
                   < c.relative_rmse)
            if ok is not None:
                none, relative = none & ok, relative & ok
            capped = self.iterations >= c.max_iterations
            # most records stop nothing: one test, then the rules in their order
            if (self.active & (none | small | relative | capped)).any():
                for mask, reason in ((none, StopReason.NO_CORRESPONDENCES),
                                     (small, StopReason.SMALL_UPDATE),
                                     (relative, StopReason.RELATIVE_CHANGE),
                                     (capped, StopReason.MAX_ITERATIONS)):
                    self._stop(mask, reason)
        if ok is None or self.step == 0 or ok.any():  # a rejected pose is not an iteration
            self.history.append({"iteration": len(self.history), "fitness": self.fitness,
                                 "rmse": self.rmse, "correspondences": self.count})
        self.pending = (rec["update"], rec["T"], rec["flags"])
        self.step += 1
        return not self.active.any()


def information_matrix(sums: np.ndarray, plane: bool, center: np.ndarray) -> np.ndarray:
    """6×6 information matrix ``(B, 6, 6)`` of the final correspondences.

    Twist (ω, v) about the origin of the target frame (small_gicp / Open3D ``H``), from the
    sums ``(B, 30)`` accumulated about ``center (B, 3)``. NumPy float64 (host work).
    """
    s, c = np.asarray(sums, dtype=np.float64), np.asarray(center, dtype=np.float64)
    if plane:  # J_origin = J_centred A(c)
        return _np_math.shift_information(normal_eq.unpack_hessian(s)[0], c)
    # point-to-point: Σ w Gᵀ G with G = [−[y]×, I], from the target moments shifted to 0
    W, sy_c, yy_c = s[:, 0], s[:, 4:7], normal_eq.unpack_sym3(s[:, 22:28])
    sy = sy_c + W[:, None] * c
    yy = yy_c + c[:, :, None] * sy_c[:, None, :] + sy_c[:, :, None] * c[:, None, :] \
        + W[:, None, None] * c[:, :, None] * c[:, None, :]
    H = np.zeros((s.shape[0], 6, 6))
    H[:, :3, :3] = np.trace(yy, axis1=1, axis2=2)[:, None, None] * np.eye(3) - yy
    H[:, :3, 3:] = _np_math.skew(sy)
    H[:, 3:, :3] = _np_math.skew(sy).transpose(0, 2, 1)
    H[:, 3:, 3:] = W[:, None, None] * np.eye(3)
    return H


def run_rules(step: Any, inputs: _loop.Tensors, state: _loop.Tensors,
              crit: ConvergenceCriteria, pair: _edge.Pair, T: np.ndarray | None = None,
              meanwhile: Any = None, progress: str | None = None) -> tuple[_Rules, _loop.Run]:
    """Iterate ``step`` from ``T`` (default the pair's init) until :class:`_Rules` stop it.

    The first steps are enqueued before the host reads the pair's host part (its init and
    extent) and makes the rules; ``meanwhile()``, when given, runs then too (checks that
    may raise). ``progress``: the label of a progress bar over the iterations (shown for
    long runs only). Returns the rules (the final estimate, sums, reasons) and the run.
    """
    rules: _Rules | None = None

    def ahead(prev: dict[str, np.ndarray], last: dict[str, np.ndarray]) -> bool:
        return rules is not None and rules.continues(prev, last)

    run = _loop.iterate(step, inputs, state,
                        max_steps=anderson.max_steps(step, int(crit.max_iterations)),
                        ahead=ahead).start()
    if meanwhile is not None:
        meanwhile()
    T0 = pair.init if T is None else T
    rules = _Rules(crit, pair.source_counts.astype(np.float64), T0.copy(),
                   crit.translation_for(pair.extent))
    records: Any = run if progress is None else _progress.track(
        run, progress, total=int(crit.max_iterations), delay=_progress.LIBRARY_DELAY)
    for record in records:
        if rules(record):
            break
    return rules, run


def _indexes(pair: _edge.Pair, index: Any, max_distance: float, knn: bool = False) -> tuple:
    """Return the correspondence search of each problem: built here, or the caller's index.

    Built here: one index for a shared target; for different targets on a device one
    packed index for the whole batch (:func:`pointalign.search.policy.choose_batch_index`),
    else one per problem (``knn``: the caller also asks the targets' k-NN of it, see
    :func:`~pointalign.search.policy.choose_index`). The caller's: searched from the
    centred frame (:class:`~pointalign.search.shifted.ShiftedIndex`; the queries move by
    the frame's centre), so that sums and updates keep their precision far from the origin.
    """
    if index is None:
        with _validate.trusted():  # over the checked targets: no second NaN/Inf scan
            return _built_indexes(pair, max_distance, knn)
    B, built = pair.size, list(index) if isinstance(index, (list, tuple)) else [index]
    if len(built) not in (1, B):
        raise ValueError(f"index: expected one index or a list of {B}, got {len(built)}")
    for b, ix in enumerate(built):
        p, n = getattr(ix, "points", None), int(pair.target_counts[b])
        if not isinstance(p, torch.Tensor) or not hasattr(ix, "nearest_within"):
            raise TypeError("index: expected an object implementing the Index protocol "
                            "(pointalign.search.build_index)")
        if tuple(p.shape) != (n, 3) or p.device != pair.device:
            raise ValueError(f"index: built over {tuple(p.shape)} points on {p.device}, but "
                             f"target{'' if B == 1 else f'[{b}]'} has ({n}, 3) on "
                             f"{pair.device}")
    searches = _searches(built * B if len(built) == 1 else built, max_distance)
    # the caller's indexes hold the targets as given; the problem is solved centred on them
    # (one wrapper per distinct index and centre: a shared target is searched once a step)
    if (pair.center_device is not None and (pair.shared_target or B == 1)
            and len({id(ix) for ix in searches}) == 1):  # one centre, on the device
        one = ShiftedIndex(searches[0], Offset(pair.center_device[0].to(
            searches[0].points.dtype)))
        return (one,) * B
    keys = [(id(ix), c.tobytes()) for ix, c in zip(searches, pair.frame.center, strict=True)]
    shifted: dict[tuple, ShiftedIndex] = {}
    for key, ix, c in zip(keys, searches, pair.frame.center, strict=True):
        if key not in shifted:
            shifted[key] = ShiftedIndex(ix, Offset(upload(c, dtype=ix.points.dtype,
                                                          device=pair.device)))
    return tuple(shifted[key] for key in keys)


def _built_indexes(pair: _edge.Pair, max_distance: float, knn: bool) -> tuple:
    """:func:`_indexes` without the caller's index: built over the checked targets."""
    B = pair.size
    if not pair.shared_target and B > 1:
        packed = policy.choose_batch_index(pair.target, pair.target_counts,
                                           max_distance=max_distance)
        if packed is not None:  # the whole batch in one index (search/packed.py)
            return (packed,) * B
    n = 1 if pair.shared_target else B
    built = [policy.choose_index(pair.target[b, : pair.target_counts[b]],
                                 max_distance=max_distance, knn=knn) for b in range(n)]
    return _searches(built * B if len(built) == 1 else built, max_distance)


def _searches(built: list, max_distance: float) -> tuple:
    """Return the correspondence search of each problem's index (one per distinct index)."""
    search = {id(ix): policy.correspondence_index(ix, max_distance) for ix in built}
    return tuple(search[id(ix)] for ix in built)


def _normals(target: Any, target_normals: Any, pair: _edge.Pair,
             idxs: tuple = ()) -> torch.Tensor:
    """Target normals ``(B, M, 3)``: given, from a PointCloud, or estimated (k = NORMALS_K).

    Estimated ones search the correspondence index of ``idxs`` where it serves a k-NN
    self-query over that target (:func:`~pointalign.registration._edge.knn_index`).
    """
    normals = _edge.target_normals(target, target_normals, pair)
    if normals is not None:
        return normals
    from pointalign.features.normals import estimate_normals

    normals = torch.zeros_like(pair.target)
    for b in range(1 if pair.shared_target else pair.size):
        m = int(pair.target_counts[b])
        if m >= 3:
            with _validate.trusted():  # the checked target: no second NaN/Inf scan
                normals[b, :m] = estimate_normals(
                    pair.target[b, :m], k=max(3, min(NORMALS_K, m)), orient=None,
                    device=pair.device, index=_edge.knn_index(idxs, b, pair.target[b, :m]))
    return normals[:1].expand_as(pair.target) if pair.shared_target else normals


@_first_use.first_use("icp (point-to-point)", "icp (point-to-plane)")
@_threads.per_call
@_validate.out_of_memory_is_clear
def icp(
    source: Any,
    target: Any,
    *,
    init: Any = None,
    max_correspondence_distance: float,
    method: str = "point_to_point",
    robust_kernel: RobustKernel | str | tuple[str, float] | None = None,
    criteria: ConvergenceCriteria | None = None,
    max_iterations: int | None = None,
    device: str | torch.device | None = None,
    index: Any = None,
    target_normals: Any = None,
    source_lengths: Any = None,
    target_lengths: Any = None,
    acceleration: bool | None = None,
) -> RegistrationResult:
    """Register ``source`` to ``target`` by ICP; returns ``T_target_source``.

    Correspondences: each source point's nearest target point within
    ``max_correspondence_distance``; points without one are left out (not an error). The
    update is Horn's closed form (point-to-point) or the 6×6 linearised point-to-plane
    solve, weighted by ``robust_kernel``. Stops (``stop_reason``) on the iteration cap
    ("max_iterations"); both ``|Δfitness| < relative_fitness`` and
    ``|Δrmse| / rmse < relative_rmse`` ("relative_change"); an update smaller than the
    translation and rotation tolerances ("small_update"); no correspondence left
    ("no_correspondences", not converged); or a degenerate point-to-point problem
    (collinear or too few correspondences: "degenerate", not converged). A rank-deficient
    point-to-plane system (e.g. a single plane) takes its least-norm step on the determined
    directions and carries on; ``info["rank_deficient"]`` records that it happened.

    Precision: the problem is solved in a frame centred on the target's centroid (shifted
    in float64 before anything becomes float32), so coordinates far from the origin keep
    their precision; with a caller's ``index`` the caller's coordinates are used.

    Batches: ``source (B, N, 3)`` with ``source_lengths (B,)`` and ``target (B, M, 3)`` with
    ``target_lengths (B,)`` (or one ``(M, 3)`` target shared by all B) run B independent
    problems in lockstep through the same kernels; one index is built per target (one in
    all for a shared target). Each problem stops on its own; the result is then batched
    (``transformation (B, 4, 4)``).

    Args:
        source: ``(N, 3)`` or ``(B, N, 3)`` points (NumPy, tensor or PointCloud), metres.
        target: ``(M, 3)`` or ``(B, M, 3)`` points; a PointCloud with normals supplies them.
        init: initial ``T_target_source`` ``(4, 4)`` or ``(B, 4, 4)`` (default identity).
        max_correspondence_distance: largest source-target distance of a correspondence
            (> 0, same units as the points).
        method: ``"point_to_point"`` or ``"point_to_plane"``.
        robust_kernel: :class:`RobustKernel`, a kind (``"huber"``, as
            ``RobustKernel("huber")``) or a pair ``("huber", k)``; default none.
        criteria: :class:`ConvergenceCriteria` (default ``ConvergenceCriteria()``).
        max_iterations: shortcut for ``criteria=ConvergenceCriteria(max_iterations=n)``
            (Open3D's and small_gicp's habit); not both.
        device: compute device; default: the tensors' device, else cuda when available.
        index: an Index over the target (or a list of B of them) from
            :func:`pointalign.search.build_index`, reused across calls; default: chosen by
            :func:`pointalign.search.policy.choose_index`. ``info["index"]`` names it.
        target_normals: ``(M, 3)`` / ``(B, M, 3)`` unit normals for point-to-plane; default:
            the PointCloud's, else estimated with :func:`estimate_normals` (k = 20).
        source_lengths: ``(B,)`` valid source points per padded batch entry.
        target_lengths: ``(B,)`` valid target points per padded batch entry.
        acceleration: Anderson acceleration of the iteration with an energy safeguard
            (:mod:`pointalign.registration.anderson`): fewer iterations from far away; a
            rejected accelerated step costs a step and is no iteration. Default: on for
            point-to-point (it crawls along flat valleys), off for point-to-plane (BENCHMARKS).
        num_threads: CPU threads for this call (:func:`pointalign.threads`); None: the
            process setting.

    Before any work the clouds' extents and the distance are compared
    (:func:`pointalign.registration.checks.check_units`): a 20× mismatch warns
    (:class:`~pointalign.UnitsWarning`), a 1000× one raises ValueError. A call estimated
    above 5 s on the CPU says so first, and shows a counted bar on a terminal.

    Returns:
        :class:`RegistrationResult` with ``fitness`` (fraction of source points with a
        correspondence), ``rmse`` (RMS correspondence distance), ``history`` (iteration,
        fitness, rmse, correspondences per iteration), ``timings`` (seconds: index,
        normals, iterate, launch, sync, total) and ``info``: ``H`` (the final 6×6
        information matrix, twist (ω, v) about the target origin), ``rank_deficient``,
        ``index``, ``device_steps`` and ``cuda_graph`` (how the executor ran the steps).

    """
    t_start = time.perf_counter()
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    max_dist = _validate.positive(max_correspondence_distance, "max_correspondence_distance")
    rk = as_robust_kernel(robust_kernel)
    crit = as_criteria(criteria, max_iterations)
    accelerate = _validate.flag(acceleration, "acceleration", none=True)
    dev = _edge.resolve_device(device, source=source, target=target,
                               target_normals=target_normals)
    pair, units = checks.prepared_pair(source, target, init, dev, source_lengths,
                                       target_lengths, max_correspondence_distance=max_dist)
    estimated_normals = target_normals is None and _edge.cloud_normals(target) is None
    checks.announce_icp(pair, method, int(crit.max_iterations), normals=estimated_normals)
    plane, B = method == "point_to_plane", pair.size
    if target_normals is not None and not plane:
        _edge.target_normals(target, target_normals, pair)  # checked even when not used
    clock = _loop.Clock(dev)
    # the target's k-NN (its normals, unless given) can search the same index
    idxs = clock.stage("index", _indexes, pair, index, max_dist, plane and estimated_normals)
    inputs = {"source": pair.source, "target": pair.target, "lengths": pair.source_lengths,
              "center": torch.zeros(B, 3, device=dev)}
    if plane:
        inputs["normals"] = clock.stage("normals", _normals, target, target_normals, pair,
                                       idxs)
    if B == 1 and pair.source_counts[0] == pair.source.shape[1]:
        order = policy.query_order(pair.source[0])  # a spatially coherent order, or None
        inputs["source"] = pair.source if order is None else pair.source[:, order]
    T0 = pair.init_on_device()  # no wait for the device
    state = {"T": T0, "Tf": T0.to(torch.float32)}
    if any(ix.uses_hint for ix in idxs):
        state["hint"] = torch.full(pair.source.shape[:2], -1, dtype=torch.int64, device=dev)
    step: Any = IcpStep(idxs, max_dist, plane, rk.kind, float(rk.k))
    if (not plane) if accelerate is None else accelerate:
        step, inputs, state = anderson.accelerated(step, inputs, state, pair, max_dist)
    t_it = time.perf_counter()
    rules, run = run_rules(step, inputs, state, crit, pair, progress="ICP", meanwhile=units)
    timings = dict(clock.timings, iterate=time.perf_counter() - t_it, **run.timings)
    timings["total"] = time.perf_counter() - t_start
    info = {"H": information_matrix(rules.sums, plane, pair.frame.center),
            "per_iteration_s": timings["iterate"] / max(1, len(rules.history)),
            "method": method, "index": type(getattr(idxs[0], "index", idxs[0])).__name__,
            "rank_deficient": rules.rank_deficient, "device_steps": run.launched,
            "cuda_graph": run.graph}
    stab = stability(pair, idxs, rules.T, rules.sums, plane, max_dist)
    return _edge.build_result(pair, rules.T, fitness=rules.fitness, rmse=rules.rmse,
                              iterations=rules.iterations, reasons=rules.reasons,
                              history=rules.history, timings=timings, info=info,
                              stability=stab)
