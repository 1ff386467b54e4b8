"""The edge every registration algorithm shares: devices, inputs, frames, stop reasons, results.

* :func:`resolve_device`: the one rule for ``device=`` (explicit, else the inputs' common
  device, else CUDA when present); inputs on different devices are an error.
* :func:`prepare_pair`, :class:`Pair`, :class:`Frame` (from :mod:`._pair`): source and
  target as padded float32 batches **in a local frame**, the target's centroid the origin.
* :class:`StopReason`: why an algorithm stopped, one vocabulary for all of them.
* :func:`build_result`: a :class:`RegistrationResult` from per-problem host arrays, batched
  or squeezed to one problem.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pointalign import _math, _validate
from pointalign.kernels import upload
from pointalign.registration._pair import ONE_CLOUD_EACH as ONE_CLOUD_EACH
from pointalign.registration._pair import Frame as Frame
from pointalign.registration._pair import HostPart as HostPart
from pointalign.registration._pair import LocalPair as LocalPair
from pointalign.registration._pair import Pair as Pair
from pointalign.registration._pair import prepare_pair as prepare_pair
from pointalign.registration._pair import prepare_pairs as prepare_pairs
from pointalign.registration._pair import recentre as recentre
from pointalign.registration.result import RegistrationResult
from pointalign.search import policy


class StopReason(str, enum.Enum):
    """Why an algorithm stopped (or why its result is trusted); equal to its string value.

    Converged (``result.converged`` is True):

    * ``SMALL_UPDATE``: the last update rotated by less than ``rotation_tolerance`` and
      moved by less than ``translation_tolerance``;
    * ``RELATIVE_CHANGE``: fitness and RMSE stopped changing (Open3D's rule);
    * ``SCHEDULE``: an annealing schedule reached its end (EM-ICP's σ_min, Softassign's β)
      with the pose settled (its last check moved it by a small fraction of the final
      scale; else ``STALLED``);
    * ``POSE_AND_WEIGHTS``: an annealing method's pose and soft weights settled early;
    * ``NO_DECREASE``: no step along the last update lowers the objective any more (a
      descent method's line search found none while the refused step was small, or
      approximate ICP's step raised it and was taken back): a numerical minimum.

    Not converged:

    * ``MAX_ITERATIONS``: the iteration cap was reached first;
    * ``NO_CORRESPONDENCES``: no source point had a partner within the distance bound;
    * ``DEGENERATE``: the problem does not determine a pose (collinear points, too few
      correspondences, a rank-deficient system);
    * ``AMBIGUOUS``: the iteration settled, but the data do not determine the pose there:
      the final correspondences let the source slide along the target without changing
      any residual (a plane moved in-plane, a sphere or cylinder turned, fewer than 6
      correspondences); :func:`pointalign._math.stability` ≤ ``STABILITY_EPS``
      (``info["stability"]``), decided once at the end by :func:`build_result`;
    * ``STALLED``: the iteration stopped without settling: ``surface_newton``'s line search
      found no step while the refused Newton step still asked for a large motion (the
      distance map is poor at this pose: ``STALL`` in
      :mod:`pointalign.registration.surface.newton`), or an annealing schedule ended while
      its last check still moved the pose by more than ``SETTLED`` of the final scale
      (:mod:`pointalign.registration.soft`);
    * ``LOW_FITNESS``: the iteration settled, but fewer than :data:`MIN_FITNESS` (1 %) of
      the source points have a partner: a handful of chance matches (a distance given in
      other units than the clouds, no overlap) decide nothing, whatever the stop rule said;
      decided once at the end by :func:`build_result`;
    * ``COARSE_INPUT``: the iteration settled, but the coordinates came rounded by more than
      :data:`MAX_RESOLUTION` of the target's extent (float32 far from the origin: at 10⁵ m
      a float32 coordinate's spacing is ~8 mm), so the pose is only as good as that
      rounding (``info["input_resolution"]``); pass float64 coordinates;
    * ``NO_HYPOTHESIS`` / ``BELOW_THRESHOLD``: a global method found no (good enough)
      hypothesis; ``TOO_FEW_CORRESPONDENCES``: fewer than three feature correspondences to
      draw hypotheses from.

    A sampling method (RANSAC) has no convergence of its own, only a confidence:

    * ``CONFIDENCE``: enough hypotheses were drawn to find an all-inlier sample with the
      asked probability (converged);
    * ``INLIER_RATIO``: the best hypothesis reached the asked inlier ratio (converged);
    * ``MAX_HYPOTHESES``: the hypothesis budget ran out first; RANSAC still returns its best
      hypothesis as its answer (``converged`` True unless a threshold was asked and missed,
      which is ``BELOW_THRESHOLD``), so its caller passes ``converged`` to
      :func:`build_result` rather than reading it from this reason.

    Where a verdict on the result decides (``register``), the reason is the verdict's:

    * ``TRUSTED``: every test passed (converged);
    * ``SMALL_OVERLAP``, ``WEAK_MARGIN``, ``NOT_CONCENTRATED``
      (``"residuals_not_concentrated"``): the first test that failed (not converged; a
      pose the data do not determine is ``AMBIGUOUS``, as above).
    """

    SMALL_UPDATE = "small_update"
    RELATIVE_CHANGE = "relative_change"
    SCHEDULE = "schedule"
    POSE_AND_WEIGHTS = "pose_and_weights"
    NO_DECREASE = "no_decrease"
    MAX_ITERATIONS = "max_iterations"
    NO_CORRESPONDENCES = "no_correspondences"
    DEGENERATE = "degenerate"
    AMBIGUOUS = "ambiguous"
    LOW_FITNESS = "low_fitness"
    STALLED = "stalled"
    COARSE_INPUT = "coarse_input"
    NO_HYPOTHESIS = "no_hypothesis"
    BELOW_THRESHOLD = "below_threshold"
    TOO_FEW_CORRESPONDENCES = "too_few_correspondences"
    CONFIDENCE = "confidence"
    INLIER_RATIO = "inlier_ratio"
    MAX_HYPOTHESES = "max_hypotheses"
    TRUSTED = "trusted"
    SMALL_OVERLAP = "small_overlap"
    WEAK_MARGIN = "weak_margin"
    NOT_CONCENTRATED = "residuals_not_concentrated"

    def __str__(self) -> str:
        return self.value

    @property
    def converged(self) -> bool:
        """True for the reasons that mean the algorithm converged."""
        return self in _CONVERGED


_CONVERGED = frozenset({StopReason.SMALL_UPDATE, StopReason.RELATIVE_CHANGE,
                        StopReason.SCHEDULE, StopReason.POSE_AND_WEIGHTS,
                        StopReason.NO_DECREASE, StopReason.CONFIDENCE,
                        StopReason.INLIER_RATIO, StopReason.TRUSTED})


#: the one rule for ``device=`` (defined in :mod:`pointalign._validate`, where the features
#: and search modules reach it too): explicit, else the inputs' common device, else CUDA
#: when present; inputs on different devices are a ValueError naming each
resolve_device = _validate.resolve_device


#: the smallest fitness (fraction of source points with a partner) a converged result may
#: have: below it the pose rests on a few chance matches (1 %: 400 of the bunny's 40k
#: points; partial overlaps of real scans at their usual distances keep 10 % or more)
MIN_FITNESS = 0.01

#: the coarsest input spacing, as a fraction of the target's RMS radius, at which a settled
#: iteration still counts as converged (the bunny in float32 at 10⁴ m: 0.02, poses within
#: 3·10⁻⁴ of the extent; at 10⁵ m: 0.2, poses ~10 % off)
MAX_RESOLUTION = 0.05


#: the normals a cloud carries (a PointCloud's, an Open3D cloud's): defined in
#: :mod:`pointalign._validate`, where the features reach it too
cloud_normals = _validate.cloud_normals


def target_normals(target: Any, normals: Any, pair: Pair) -> torch.Tensor | None:
    """Return unit normals ``(B, M, 3)`` float32 from ``normals`` or the target cloud, else None.

    ``normals``: the caller's ``(M, 3)`` / ``(B, M, 3)`` array; None: the normals the target
    carries (:func:`cloud_normals`: a PointCloud's or an Open3D cloud's), else None.
    """
    if normals is None:
        normals = cloud_normals(target)
    if normals is None:
        return None
    t = _validate._to_tensor("target_normals", normals)
    shape = tuple(pair.target.shape)
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if tuple(t.shape) != shape and not (t.shape[0] == 1 and tuple(t.shape[1:]) == shape[1:]):
        raise ValueError(f"target_normals: expected shape {shape[1:]} or {shape} (like "
                         f"target), got {tuple(t.shape)}")
    t = _validate._float("target_normals", t, torch.float32).to(pair.device)
    _validate._check_finite("target_normals", t)
    return t.expand(*shape).contiguous()


def knn_index(idxs: Sequence[Any], b: int, points: torch.Tensor) -> Any:
    """Return problem ``b``'s correspondence index where a k-NN self-query can search it.

    ``points (m, 3)``: the points of that self-query (normals, covariances); None where the
    index cannot serve it. A tree over exactly these points answers the exact k-NN, the
    neighbours of a tree built for them (a host tree keeps the self-query as its shortcut
    lists, a device tree saves a second build); not a voxel grid (cells sized for the
    correspondence bound) nor brute force (N × M, where the caller's own search is faster).
    A caller's index (a :class:`~pointalign.search.shifted.ShiftedIndex`: over the target
    as given, trusted to hold it, as the registration trusts it for its correspondences)
    is searched through its shift.
    """
    from pointalign.search.brute import BruteForceIndex
    from pointalign.search.grid import VoxelGridIndex
    from pointalign.search.shifted import ShiftedIndex

    top = idxs[b] if b < len(idxs) else None
    ix = getattr(top, "index", top)  # behind tiers, or the caller's behind its shift
    p = getattr(ix, "points", None)
    if ix is None or isinstance(ix, (VoxelGridIndex, BruteForceIndex)) \
            or not isinstance(p, torch.Tensor) or p.shape != points.shape \
            or p.device != points.device:
        return None
    if isinstance(top, ShiftedIndex):
        return top
    return ix if p is points or torch.equal(p, points) else None


# ---- estimates of long work (announced before it starts: _progress.announce) -------------

def measured_stability(pair: Pair, T_local: np.ndarray, *, index: Any = None,
                       max_distance: float | None = None) -> np.ndarray:
    """:func:`pointalign._math.stability` of each final pose, measured on the data: ``(B,)``.

    For the methods whose own iteration holds no 6×6 information (EM-ICP, Softassign, the
    surface methods): the point-to-plane information of a sample of each problem's final
    nearest-neighbour correspondences (ICP's point-to-point test,
    :func:`pointalign.registration.stability.stability`), so that a pose the data do not
    determine (a sphere turned about its centre, three points, a plane slid in-plane) is
    "ambiguous" whichever method found it. A few thousand queries and one small PCA pass.

    Args:
        pair: the prepared problem(s).
        T_local: ``(B, 4, 4)`` float64 final poses in the local frames.
        index: an Index over the target the method already holds (e.g. the surface methods'
            k-d tree, in ``pair.target``'s coordinates), or one per problem; the search
            policy decides whether it is queried (:func:`pointalign.search.policy.probe_index`).
        max_distance: correspondences farther apart are not counted (None or inf: every
            nearest neighbour counts).

    """
    from pointalign.registration import stability as _stability  # (it imports this module)

    assert pair.extent is not None
    scale = float(np.max(pair.extent)) + float(np.max(pair.source_extent
                                                       if pair.source_extent is not None
                                                       else pair.extent))
    d = max_distance if max_distance is not None and np.isfinite(max_distance) \
        and max_distance > 0 else 1e6 * max(scale, 1e-30)
    n = 1 if pair.shared_target else pair.size
    own = list(index) if isinstance(index, (list, tuple)) else [index] * n
    with _validate.trusted():  # the prepared targets were checked
        built = [policy.probe_index(pair.target[b, : pair.target_counts[b]],
                                    _stability.STABILITY_SAMPLE, index=own[b]) for b in range(n)]
    idxs = tuple(built * pair.size if n == 1 else built)
    # (point-to-point: the sums of a final step are not read, the sample is measured)
    return _stability.stability(pair, idxs, np.asarray(T_local, dtype=np.float64),
                                np.zeros((pair.size, 30)), False, d)


def build_result(pair: Pair, T_local: np.ndarray, *, fitness: np.ndarray, rmse: np.ndarray,
                 iterations: np.ndarray, reasons: Sequence[StopReason | str],
                 history: list[dict[str, Any]], timings: dict[str, float],
                 info: dict[str, Any], converged: np.ndarray | None = None,
                 stability: np.ndarray | None = None) -> RegistrationResult:
    """Build the :class:`RegistrationResult` of B problems, squeezed for unbatched input.

    The one result builder: every public registration function (icp, the soft and surface
    methods, ransac, register) returns what this builds, so the rules below hold for all.

    Args:
        pair: the prepared inputs.
        T_local: ``(B, 4, 4)`` float64 estimates in the local frames.
        fitness: ``(B,)`` host array.
        rmse: ``(B,)`` host array.
        iterations: ``(B,)`` host array.
        reasons: B stop reasons: :class:`StopReason` members, or the caller's own words
            where something else decides (``register``'s verdict), then with ``converged``.
        history: one dict per iteration of ``(B,)`` arrays (or scalars).
        timings: seconds per stage.
        info: extras; ``(B, …)`` arrays are split per problem when squeezing.
        converged: ``(B,)`` bools, the caller's decision; defaults to ``reason.converged``
            of each reason.
        stability: ``(B,)`` :func:`pointalign._math.stability` of each final pose (None:
            not measured).

    **The rules**, applied to every problem still converged (by its reason or by
    ``converged``): a fitness below :data:`MIN_FITNESS` is too few partners to decide
    anything: reason ``LOW_FITNESS``, not converged; at a stability ≤
    :data:`pointalign._math.STABILITY_EPS` the data do not
    determine the pose: reason ``AMBIGUOUS``, not converged (``info["stability"]`` records
    the values); on input coarser than :data:`MAX_RESOLUTION` of the extent the pose is only
    as good as that rounding: reason ``COARSE_INPUT``, not converged
    (``info["input_resolution"]``).

    """
    reasons = list(reasons)
    conv = (np.array([bool(getattr(r, "converged", False)) for r in reasons])
            if converged is None else np.array(converged, dtype=bool).reshape(len(reasons)))
    fit = np.asarray(fitness, dtype=np.float64).reshape(len(reasons))
    for b in np.nonzero(conv & ~(fit >= MIN_FITNESS))[0]:
        reasons[b], conv[b] = StopReason.LOW_FITNESS, False
    if pair.resolution is not None and pair.extent is not None:
        # (a target of no extent is left to the degeneracy and stability rules)
        coarse = (pair.extent > 0) & (pair.resolution > MAX_RESOLUTION * pair.extent)
        if coarse.any():
            for b in np.nonzero(coarse & conv)[0]:
                reasons[b], conv[b] = StopReason.COARSE_INPUT, False
            info = {**info, "input_resolution": pair.resolution}
    if stability is not None:
        stab = np.asarray(stability, dtype=np.float64)
        for b in np.nonzero(conv & ~(stab > _math.STABILITY_EPS))[0]:
            reasons[b], conv[b] = StopReason.AMBIGUOUS, False
        info = {**info, "stability": stab}
    T = pair.frame.to_world(T_local)
    if pair.init_world is not None:  # left at init: exactly init (no float64 round trip)
        kept = (T_local == pair.init).all(axis=(1, 2))
        T = np.where(kept[:, None, None], pair.init_world, T)
    result = RegistrationResult(
        transformation=T, fitness=fitness, rmse=rmse, iterations=iterations, converged=conv,
        stop_reason=[str(r) for r in reasons], history=history, timings=timings, info=info,
        transformation_tensor=upload(T, dtype=torch.float64, device=pair.device))
    return result if pair.batched else result[0]


def in_world(result: RegistrationResult, frame: Frame) -> RegistrationResult:
    """Return an unbatched ``result`` solved in the local ``frame`` in the caller's coordinates.

    The transformation (and its tensor, and a nested ``info["global"]`` result) are composed
    back in float64: ``T_world = Tr(c) T_local Tr(−c)`` (:meth:`Frame.to_world`). For a
    result an algorithm returned to a composite one (``register``'s global stage) that
    builds its own result with :func:`build_result` on its own :class:`Pair`.
    """
    T = frame.to_world(np.asarray(result.transformation, dtype=np.float64)[None])[0]
    tt = result.transformation_tensor
    info = dict(result.info)
    if isinstance(info.get("global"), RegistrationResult):
        info["global"] = in_world(info["global"], frame)
    return dataclasses.replace(
        result, transformation=T, info=info,
        transformation_tensor=None if tt is None else
        upload(T, dtype=torch.float64, device=tt.device))
