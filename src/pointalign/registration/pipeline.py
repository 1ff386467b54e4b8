"""register(): global then local registration in one call; composes, adds nothing numerical.

The recipe of Open3D's global-registration tutorial (Rusu et al. 2009 features; Marchel
2017 parallel RANSAC; Chen & Medioni 1992 point-to-plane ICP) as named stages, every
length a multiple of the voxel edge v (:class:`Scales`; default v:
:func:`~pointalign.features.downsample.auto_voxel_size`):

1. :func:`_prepare_pair`: v and the stray points (:mod:`~pointalign.registration.voxel_rule`),
   then each cloud prepared (:mod:`~pointalign.registration.prepare`; after dropping stray
   points where a sample shows some, :func:`~pointalign.features.outliers.dense_mask`):
   downsample at v; one neighbour search (5v, 100 nearest) serves the normals (PCA within
   2v, 30 nearest, facing the cloud's centroid, a convention that moves with the cloud) and
   FPFH (5v);
2. :func:`_global`: the feature matches, found once, go to parallel RANSAC (inliers within
   1.5v) and to the compatibility graph's proposer (:mod:`pointalign.registration.robust`);
3. :func:`_refine_hypotheses`: the best few proposals by inliers, refined by one batched
   point-to-plane ICP on the downsampled clouds (1.5v), ranked by their overlap within v;
4. :func:`_final_icp`: point-to-plane ICP (or GICP, ``refine="gicp"``) of the full clouds
   (or their ``icp_voxel_size`` copies, :func:`_final_clouds`) with 0.5v from the best;
   each ICP stops on Open3D's relative-change rule or an update below 0.1 % of v and 0.01°;
5. :func:`~pointalign.registration.verdict.verdict`: whether the result can be trusted
   (overlap, margin over a different hypothesis, concentration of the residuals,
   determinacy).

:func:`~pointalign.registration.many.register_many` runs the same stages: 1-2 per pair
(in each pair's frame scaled by 1/v), 3-5 on batches of pairs (lists of problems).
Options are checked by :func:`pointalign.registration.options.check` for both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from pointalign import _progress, _threads, _validate
from pointalign.features.downsample import group_clouds, voxel_downsample
from pointalign.features.normals import estimate_normals
from pointalign.kernels import _first_use, _loop
from pointalign.kernels import ransac as _kr
from pointalign.registration import _edge, checks, voxel_rule
from pointalign.registration._edge import StopReason
from pointalign.registration.criteria import ConvergenceCriteria
from pointalign.registration.gicp import gicp
from pointalign.registration.icp import icp
from pointalign.registration.options import (  # noqa: F401 (register's names, documented)
    RANSAC_OPTIONS,
    REFINEMENTS,
    check,
)
from pointalign.registration.options import Options as _Options
from pointalign.registration.prepare import Prepared, Settle, prepare_both, prepare_cloud
from pointalign.registration.ransac import ransac
from pointalign.registration.ransac_programs import count_inliers
from pointalign.registration.result import RegistrationResult
from pointalign.registration.robust import compatibility_hypotheses, rank_correspondences
from pointalign.registration.verdict import decided_result, global_result, verdict
from pointalign.search import build_index, policy


@dataclasses.dataclass(frozen=True)
class Scales:
    """Every length :func:`register` uses, a multiple of the voxel edge v (metres).

    ``Scales(v)`` holds the defaults; an override given to :func:`register` replaces its
    quantity at every use:

    =========================  =======  ======================================================
    field                      default  used by
    =========================  =======  ======================================================
    ``voxel``                  v        the global stage's downsampling; stray points (fewer
                                        than ``SPARSE_NEIGHBOURS`` others within v)
    ``normal_radius``          2 v      the normals of the downsampled clouds and of the
                                        final ICP's target
    ``feature_radius``         5 v      FPFH (its one search serves the normals too)
    ``correspondence``         1.5 v    ``max_correspondence_distance``: RANSAC's inliers, the
                                        compatibility graph's tolerance, the proposals'
                                        inlier counts, the coarse ICP, the verdict's outer
                                        bound
    ``overlap``                v        the overlap that ranks the refined hypotheses and
                                        the verdict's ``overlap``
    ``fine``                   0.5 v    ``icp_max_correspondence_distance``: the final ICP,
                                        the verdict's inner bound (``concentration``)
    ``translation_tolerance``  0.001 v  both ICP stages' smallest update
    ``distinct``               3 v      the verdict: a hypothesis moving the source's
                                        centroid farther from the result's is another one
    =========================  =======  ======================================================
    """

    voxel: float
    max_correspondence_distance: dataclasses.InitVar[float | None] = None
    icp_max_correspondence_distance: dataclasses.InitVar[float | None] = None
    normal_radius: float = dataclasses.field(init=False)
    feature_radius: float = dataclasses.field(init=False)
    correspondence: float = dataclasses.field(init=False)
    overlap: float = dataclasses.field(init=False)
    fine: float = dataclasses.field(init=False)
    translation_tolerance: float = dataclasses.field(init=False)
    distinct: float = dataclasses.field(init=False)

    def __post_init__(self, max_correspondence_distance: float | None,
                      icp_max_correspondence_distance: float | None) -> None:
        v = _validate.positive(self.voxel, "voxel_size")
        mcd, fine = max_correspondence_distance, icp_max_correspondence_distance
        for name, value in (
                ("voxel", v), ("normal_radius", 2 * v), ("feature_radius", 5 * v),
                ("correspondence", 1.5 * v if mcd is None else
                 _validate.positive(mcd, "max_correspondence_distance")),
                ("overlap", v),
                ("fine", 0.5 * v if fine is None else
                 _validate.positive(fine, "icp_max_correspondence_distance")),
                ("translation_tolerance", 1e-3 * v), ("distinct", 3 * v)):
            object.__setattr__(self, name, value)


#: nearest neighbours of the final ICP's target normals: the full clouds are dense (16
#: nearest points are well within 2v wherever the surface is sampled finer than the voxel),
#: and a k-NN list of 16 halves the search's work against 30 (KITTI: 5 vs 10 ms)
FULL_NORMAL_NEIGHBOURS = 16
#: both ICP stages' smallest rotation update (degrees)
ROTATION_TOLERANCE_DEG = 0.01


@_first_use.first_use("register")
@_threads.per_call
@_validate.out_of_memory_is_clear
def register(
    source: Any,
    target: Any,
    *,
    voxel_size: float | None = None,
    device: str | torch.device | None = None,
    refine: str = "point_to_plane",
    method: str | None = None,
    target_points: int = 5000,
    hypotheses: int = 16384,
    icp_voxel_size: float | None = None,
    max_iterations: int = 30,
    seed: int = 0,
    remove_outliers: bool = True,
    robust: bool = True,
    max_correspondence_distance: float | None = None,
    icp_max_correspondence_distance: float | None = None,
    **ransac_options: Any,
) -> RegistrationResult:
    """Register ``source`` onto ``target`` with no initial guess: FPFH + RANSAC, then ICP.

    Args:
        source: ``(N, 3)`` float array/tensor or PointCloud (metres).
        target: ``(M, 3)`` float array/tensor or PointCloud.
        voxel_size: downsampling edge v for the global stage (default:
            :func:`~pointalign.features.downsample.auto_voxel_size`); every other length is
            a multiple of it (:class:`Scales`: normals 2v, FPFH 5v, correspondences 1.5v,
            final ICP 0.5v).
        device: compute device (default: the inputs' device, which must be one, else CUDA
            if present: :func:`pointalign.registration._edge.resolve_device`).
        refine: the local refinement of the global result: ``"point_to_plane"`` ICP (the
            default), ``"gicp"`` (generalized ICP,
            :func:`~pointalign.registration.gicp.gicp`, covariances from k = 20 neighbours)
            or ``"none"`` (the global stage alone).
        method: deprecated name of ``refine`` (``"icp"`` meant ``"point_to_plane"``).
        target_points: size the automatic voxel edge aims at.
        hypotheses: RANSAC hypotheses per batch.
        icp_voxel_size: downsample the clouds for the final ICP at this edge (default: the
            full clouds).
        max_iterations: ICP iteration cap of each ICP stage (coarse and final).
        seed: RANSAC's seed (see :func:`~pointalign.registration.ransac.ransac`): an integer
            in [0, 2**64 - 1]; the same seed and inputs give identical results on one
            device (CPU, or a GPU), not across devices (their generators differ).
        remove_outliers: drop stray points before downsampling and choose v without them
            (:mod:`pointalign.features.outliers`); False: all points count.
        robust: add the compatibility-graph hypotheses (:mod:`~pointalign.registration.robust`)
            to RANSAC's and refine the best ``REFINE_TOP``; False: RANSAC's best only.
        max_correspondence_distance: the global stage's correspondence distance (default
            1.5v, ``Scales.correspondence``): RANSAC's inlier bound, the compatibility
            graph's length tolerance, the bound the proposals' inliers are counted at, the
            coarse ICP's distance and the verdict's outer bound, one value for all five.
        icp_max_correspondence_distance: the final ICP's correspondence distance (default
            0.5v, ``Scales.fine``), also the verdict's inner bound.
        **ransac_options: passed to :func:`~pointalign.registration.ransac.ransac`: any of
            :data:`~pointalign.registration.options.RANSAC_OPTIONS`; another keyword is a
            TypeError naming ``register``.

    Returns:
        :class:`RegistrationResult`; ``timings`` per stage (RANSAC's as ``ransac.<stage>``);
        ``info``: ``voxel_size``, ``source_down``, ``target_down``, ``global`` (RANSAC's).
        After ICP the **verdict** decides: ``converged`` only when the result looks
        trustworthy (overlap, a clear margin over the best different hypothesis, residuals
        concentrated near zero, a determined pose); ``stop_reason`` says why: ``"trusted"``
        or the first failed test (``"small_overlap"``, ``"weak_margin"``,
        ``"residuals_not_concentrated"``, ``"ambiguous"``); ``info["verdict"]`` every
        reason in words, with ``info["overlap"]``, ``["margin"]``, ``["concentration"]``;
        the final ICP's own stop: ``info["icp_converged"]``, ``["icp_stop_reason"]``.
        ``fitness``, ``rmse``, ``iterations`` and ``history`` are the final ICP's
        (``iterations == history[-1]["iteration"]``; the coarse stage's, of the kept
        hypothesis: ``info["coarse_iterations"]``). With ``refine="none"``, or when RANSAC
        finds no hypothesis, the result is RANSAC's (``iterations``: hypotheses drawn); a
        failed one says why in ``stop_reason`` and ``info["verdict"]``.

    """
    opts = check("register", {
        "voxel_size": voxel_size, "refine": refine, "method": method,
        "target_points": target_points, "hypotheses": hypotheses,
        "icp_voxel_size": icp_voxel_size, "max_iterations": max_iterations, "seed": seed,
        "remove_outliers": remove_outliers, "robust": robust,
        "max_correspondence_distance": max_correspondence_distance,
        "icp_max_correspondence_distance": icp_max_correspondence_distance,
        **ransac_options})
    dev = _validate.resolve_device(device, source=source, target=target)
    # the local frame: both clouds shifted by the target's centroid in float64 before
    # anything becomes float32 (georeferenced coordinates keep their precision)
    pair = _edge.prepare_pair(source, target, init=None, device=dev, min_points=3)
    if pair.batched:
        raise ValueError("source, target: expected one (N, 3) cloud each, got a batch; "
                         "register pairs one at a time")
    checks.check_units(pair, voxel_size=opts.voxel_size, icp_voxel_size=opts.icp_voxel_size,
                      max_correspondence_distance=opts.max_correspondence_distance,
                      icp_max_correspondence_distance=opts.icp_max_correspondence_distance)
    src, tgt = pair.source[0], pair.target[0]
    _warn_register(src, tgt, dev, opts.refine, opts.target_points, opts.icp_voxel_size,
                   opts.max_iterations,
                   icp_max_correspondence_distance=opts.icp_max_correspondence_distance)
    # arrays derived from validated ones: no NaN/Inf scans (host syncs) on them; PyTorch's
    # small operations between the kernels on one thread where the host runs them
    # the inner registrations run on clouds derived here: checked and announced once, above
    with _validate.trusted(), _progress.task("register", delay=_progress.LIBRARY_DELAY), \
            _threads.host_stages(dev), checks.inner():
        result = _register(src, tgt, pair, opts)
    _progress.log_timings("register", result.timings)
    if not result.converged:
        _warn_doubtful(result)
    return result


def _warn_doubtful(result: RegistrationResult) -> None:
    """Warn that ``result`` is not to be trusted, naming why and only keys that exist."""
    verdict = result.info.get("verdict")
    why = verdict if verdict and verdict != "trusted" else result.stop_reason
    keys = [k for k in ("verdict", "overlap", "margin", "concentration") if k in result.info]
    see = "; see " + ", ".join(f"result.info[{k!r}]" for k in keys) if keys else ""
    _progress.warn(f"register: the result is doubtful ({why}); result.converged is False"
                   f"{see} before trusting the transformation",
                   _progress.DoubtfulResultWarning, stacklevel=None)


def _warn_register(src: torch.Tensor, tgt: torch.Tensor, dev: torch.device, refine: str,
                   target_points: int, icp_voxel_size: float | None,
                   max_iterations: int, *,
                   icp_max_correspondence_distance: float | None = None) -> None:
    """Before the work: warn of parameters ``refine="none"`` ignores; announce a long CPU call.

    The estimate is :func:`~pointalign.registration.checks.estimate_register_seconds` (the
    one cost model of ``register``), said by :func:`pointalign._progress.announce`: above
    5 s a line, above a minute a :class:`~pointalign.SlowOperationWarning`.
    """
    for name, given in (("icp_voxel_size", icp_voxel_size is not None),
                        ("max_iterations", max_iterations != 30),
                        ("icp_max_correspondence_distance",
                         icp_max_correspondence_distance is not None)):
        if refine == "none" and given:
            _progress.warn_ignored(name, 'register(refine="none")', "no ICP stage",
                                   stacklevel=None)
    threads = _threads.host_threads(dev)
    n, m = src.shape[0], tgt.shape[0]
    est = checks.estimate_register_seconds(
        n, m, target_points=target_points, threads=threads, refine=refine != "none",
        iterations=min(max_iterations, checks.ICP_TYPICAL_ITERATIONS["point_to_plane"]))
    _progress.announce(f"register() on {n:,} + {m:,} points on the CPU ({threads} threads)",
                       est, "pass icp_voxel_size (ICP on downsampled clouds) or downsample "
                       "the clouds first (pointalign.voxel_downsample), or use a GPU")


def _register(src: torch.Tensor, tgt: torch.Tensor, pair: _edge.Pair,
              opts: _Options) -> RegistrationResult:
    """:func:`register` on the validated local clouds ``src (N, 3)``, ``tgt (M, 3)`` of ``pair``."""
    clock = _loop.Clock(pair.device)
    full_index = _full_target_index(tgt, opts)
    pending: list[Settle] = []
    v, scales, source, target = _prepare_pair(src, tgt, opts, clock, full_index=full_index,
                                              pending=pending)
    glob, candidates, n_rank, source, target = _global(source, target, scales, opts, clock,
                                                       pending)
    info: dict[str, Any] = {"voxel_size": v, "source_down": int(source.down.shape[0]),
                            "target_down": int(target.down.shape[0]),
                            "global": _edge.in_world(glob, pair.frame)}
    if candidates is None:  # refine="none", or RANSAC found nothing: the global result
        return global_result(pair, glob, info, clock.total())
    criteria = icp_criteria(scales, opts.max_iterations)
    (R, fit_v, coarse_iterations), = _refine_hypotheses([(candidates, source, target)],
                                                        scales, criteria, opts.robust, clock)
    full = _final_clouds(src, tgt, scales, opts.icp_voxel_size, opts.refine, full_index)
    local = _final_icp([full], R[:1], scales, criteria, opts.refine, clock)[0]
    judged, reason = verdict(local, R, fit_v, source, target, scales)
    clock.lap("verdict")
    info.update(judged, ranked_correspondences=n_rank, hypotheses_refined=int(R.shape[0]),
                coarse_iterations=coarse_iterations)
    return decided_result(pair, local, glob, info, reason, clock.total())


def _full_target_index(tgt: torch.Tensor, opts: _Options) -> Any:
    """Build one index over the full target for the stray count and the final ICP, or None.

    Only where an index's kind does not depend on the bound
    (:func:`pointalign.search.policy.one_index_serves_every_bound`: host memory), the final
    ICP runs on the full target and strays are looked for: one build instead of two.
    """
    if (opts.refine != "none" and opts.icp_voxel_size is None and opts.remove_outliers
            and policy.one_index_serves_every_bound(tgt)):
        return build_index(tgt)
    return None


def _prepare_pair(src: torch.Tensor, tgt: torch.Tensor, opts: _Options, clock: _loop.Clock,
                  in_voxels: bool = False, describe: bool = True, full_index: Any = None,
                  pending: list[Settle] | None = None) -> tuple[float, Scales, Prepared, Prepared]:
    """Choose v, drop stray points where there are some, prepare both clouds.

    v and the strays by :mod:`~pointalign.registration.voxel_rule` (``full_index``: an
    index over ``tgt`` its per-cloud path may search, or None).

    ``in_voxels``: the clouds divided by v and the lengths ``Scales(1, …/v)``
    (``register_many``'s frame, where one bound serves a batch of pairs). ``describe``: as
    :func:`~pointalign.registration.prepare.prepare_cloud`. In host memory each cloud is
    prepared alone, on a device both as one group
    (:func:`~pointalign.registration.prepare.prepare_both`: the same values; ``pending``:
    its deferred check goes there). Returns v (metres), the scales and the two prepared
    clouds.
    """
    # on a device both clouds as one group (their corners read once): for the rule, the
    # strays and, where the clouds stay as they are, the downsampling
    host = policy.search_plan(src).host_tree
    group = None if host else group_clouds([src, tgt])
    v, strays = voxel_rule.voxel_size(src, tgt, opts, full_index, group)
    mcd, fine = opts.max_correspondence_distance, opts.icp_max_correspondence_distance
    scales = Scales(v, mcd, fine) if not in_voxels else Scales(
        1.0, None if mcd is None else mcd / v, None if fine is None else fine / v)
    clock.lap("voxel_size")
    src_c, tgt_c = (voxel_rule.without_strays([(src, tgt)], [v], group)[0] if strays
                    else (src, tgt))
    if in_voxels:
        src_c, tgt_c = src_c / v, tgt_c / v
    if host:  # host memory: each cloud with its own tree
        return v, scales, prepare_cloud(src_c, scales, clock, "source", describe, v), \
            prepare_cloud(tgt_c, scales, clock, "target", describe, v)
    return (v, scales, *prepare_both(src_c, tgt_c, scales, clock, describe, v,
                                     group if src_c is src and tgt_c is tgt else None,
                                     pending))


class Global(NamedTuple):
    """:func:`_global`'s result, with the prepared clouds it stands on."""

    result: RegistrationResult
    candidates: torch.Tensor | None
    ranked: int
    source: Prepared
    target: Prepared


def _global(source: Prepared, target: Prepared, scales: Scales, opts: _Options,
            clock: _loop.Clock, pending: Sequence[Settle] = ()) -> Global:
    """Run the global stage: parallel RANSAC, then (``robust``) the graph's proposals.

    The feature matches are found once (:func:`pointalign.kernels.ransac.feature_matches`:
    2 forward where a ratio is taken, the backward ones where mutual pairs are asked for)
    and passed to both. ``pending``: the description's deferred checks
    (:func:`~pointalign.registration.prepare.prepare_both`), read after RANSAC (the device
    describes while the host launches the matches and RANSAC, and is idle after it); where
    a neighbourhood was wider than its table, the clouds described anew and the stage run
    again on them. Returns RANSAC's result (local frame), the candidate motions ``(H, 4,
    4)`` float64 (RANSAC's first; None when there is nothing to refine: ``refine="none"``
    or no hypothesis), how many correspondences the graph ranked, and the clouds.
    """
    ropts = opts.ransac_options
    ratio = opts.robust or ropts.get("ratio_test") is not None
    matches = _kr.feature_matches(source.features, target.features, 2 if ratio else 1,
                                  backward=opts.robust or bool(ropts.get("mutual", False)))
    glob = ransac(source.down, target.down, source_features=source.features,
                  target_features=target.features,
                  max_correspondence_distance=scales.correspondence,
                  hypotheses=opts.hypotheses, target_index=target.index, seed=opts.seed,
                  matches=matches, **ropts)
    clock.lap("ransac")
    for settle in pending:
        if (again := settle()) is not None:
            return _global(*again, scales, opts, clock)
    if opts.refine == "none" or glob.stop_reason in (StopReason.NO_HYPOTHESIS,
                                                     StopReason.TOO_FEW_CORRESPONDENCES):
        return Global(glob, None, 0, source, target)
    assert glob.transformation_tensor is not None  # every RegistrationResult of ransac()
    candidates = glob.transformation_tensor[None]
    n_rank = 0
    if opts.robust:  # second proposer: length-consistent cliques of distinctive matches
        corr = rank_correspondences(source.features, target.features, CORRESPONDENCES,
                                    matches=matches)
        n_rank = int(corr.shape[0])
        if n_rank >= 3:
            H, _ = compatibility_hypotheses(source.down[corr[:, 0]], target.down[corr[:, 1]],
                                            scales.correspondence)
            candidates = torch.cat([candidates, H])
    clock.lap("robust")
    return Global(glob, candidates, n_rank, source, target)


def icp_criteria(scales: Scales, max_iterations: int) -> ConvergenceCriteria:
    """Return both ICP stages' rule: the cap, or an update below the tolerances.

    ``max_iterations``; ``Scales.translation_tolerance``, :data:`ROTATION_TOLERANCE_DEG`.
    """
    return ConvergenceCriteria(max_iterations=max_iterations,
                               translation_tolerance=scales.translation_tolerance,
                               rotation_tolerance=math.radians(ROTATION_TOLERANCE_DEG))


def _refine_hypotheses(problems: Sequence[tuple[torch.Tensor, Prepared, Prepared]],
                       scales: Scales, criteria: ConvergenceCriteria, robust: bool,
                       clock: _loop.Clock) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Refine the best proposals by the coarse ICP stage and rank them by overlap.

    For each pair of ``problems`` ``(candidates (H, 4, 4), source, target)`` (one for
    :func:`register`, a batch of pairs for ``register_many``, all at ``scales``): the best
    :data:`REFINE_TOP` (``robust``; else 1) candidates by inliers within
    ``Scales.correspondence``; all of them refined by one batched point-to-plane ICP on the
    downsampled clouds. Returns per pair the refined motions ``(k, 4, 4)`` float64 and
    their overlap counts ``(k,)`` (within ``Scales.overlap``), best first, and the coarse
    iterations of the best.
    """
    top = [_ranked(c, s.down, t.index, scales.correspondence, REFINE_TOP if robust else 1)[0]
           for c, s, t in problems]
    owner = [b for b, c in enumerate(top) for _ in range(c.shape[0])]
    src: Any
    tgt: Any
    if len(problems) == 1:  # one pair: its hypotheses share the target
        _, s, t = problems[0]
        src, tgt, index, normals = s.down[None].expand(len(owner), -1, -1), t.down, \
            t.index, t.normals
    else:  # lists of clouds: padded by icp()
        src, tgt = [problems[b][1].down for b in owner], [problems[b][2].down for b in owner]
        index = [problems[b][2].index for b in owner]
        normals = _batch([problems[b][2].normals for b in owner])
    loc = icp(src, tgt, init=torch.cat(top), max_correspondence_distance=scales.correspondence,
              method="point_to_plane", criteria=criteria, index=index, target_normals=normals,
              device=top[0].device)
    R_all = loc.transformation_tensor
    assert R_all is not None  # every RegistrationResult of icp() carries it
    its = np.asarray(loc.iterations).reshape(-1)
    out, lo = [], 0
    for (_, s, t), c in zip(problems, top, strict=True):
        R, fit_v, order = _ranked(R_all[lo:lo + c.shape[0]], s.down, t.index, scales.overlap)
        out.append((R, fit_v, int(its[lo + int(order[0])])))
        lo += c.shape[0]
    clock.lap("hypotheses")
    return out


def _ranked(T: torch.Tensor, points: torch.Tensor, index: Any, bound: float,
            keep: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Motions ``T (H, 4, 4)`` by their inliers on ``points`` within ``bound``, most first.

    Returns the first ``keep`` (default all) of the sorted motions, their counts and their
    rows of ``T`` (a stable sort: ties keep their order). A fixed program (:class:`_Ranked`):
    on a GPU one CUDA graph per size, the index keyed by its layout.
    """
    _, out = _loop.run_program(_Ranked(index, float(bound), keep),
                               {"T": T, "points": points}, host_outputs=False,
                               eager_first=True)
    return out["T"], out["counts"], out["order"]


@dataclasses.dataclass(frozen=True)
class _Ranked:
    """:func:`_ranked`'s device work, with no host read (a graph replays it)."""

    index: Any
    bound: float
    keep: int | None

    def __call__(self, inputs: dict[str, torch.Tensor], checkpoint: object
                 ) -> dict[str, torch.Tensor]:
        T = inputs["T"]
        counts = count_inliers(T, inputs["points"], self.index, self.bound)
        order = torch.argsort(counts, descending=True, stable=True)[:self.keep]
        return {"T": T[order], "counts": counts[order], "order": order}


class FinalClouds(NamedTuple):
    """One pair's clouds for the final stage (:func:`_final_clouds`), on the compute device.

    ``source (N, 3)``, ``target (M, 3)`` float32; ``index`` over the target; ``normals``:
    the target's ``(M, 3)`` unit normals (point-to-plane), or None (``refine="gicp"``).
    """

    source: torch.Tensor
    target: torch.Tensor
    index: Any
    normals: torch.Tensor | None


def _final_clouds(src: torch.Tensor, tgt: torch.Tensor, scales: Scales,
                  icp_voxel_size: float | None, refine: str = "point_to_plane",
                  full_index: Any = None) -> FinalClouds:
    """Return the full clouds (or ``icp_voxel_size`` copies), an index, target normals.

    ``full_index``: an index over ``tgt`` (used when the ICP runs on the full clouds), or
    None (one is built over the clouds the ICP runs on). The target's normals within
    ``Scales.normal_radius`` from :data:`FULL_NORMAL_NEIGHBOURS` nearest points (searched a
    chunk at a time: the whole (M, 16) table of a 50M-point target held 26 GiB on the GPU;
    on the CPU the index keeps this self-query as the ICP's shortcut lists); none for
    ``refine="gicp"`` (its covariances come from the k = 20 nearest points of each cloud).
    """
    s_full, t_full = src, tgt
    if icp_voxel_size is not None:
        s_full = voxel_downsample(src, icp_voxel_size)
        t_full = voxel_downsample(tgt, icp_voxel_size)
    index = full_index if full_index is not None and t_full is tgt else build_index(t_full)
    if refine == "gicp":
        return FinalClouds(s_full, t_full, index, None)
    t_normals = estimate_normals(t_full, k=min(FULL_NORMAL_NEIGHBOURS, t_full.shape[0]),
                                 radius=scales.normal_radius, index=index,
                                 orient="viewpoint", viewpoint=t_full.mean(0))
    return FinalClouds(s_full, t_full, index, t_normals)


def _final_icp(pairs: Sequence[FinalClouds], init: torch.Tensor, scales: Scales,
               criteria: ConvergenceCriteria, refine: str, clock: _loop.Clock,
               own_index: bool = True) -> RegistrationResult:
    """Refine B pairs from ``init (B, 4, 4)`` within ``Scales.fine``: one batched call.

    ``refine="point_to_plane"``: point-to-plane ICP; ``"gicp"``: generalized ICP. One pair
    goes as a view ``(1, N, 3)``; several as lists (padded by the call: ``register_many``'s
    size groups). ``own_index``: each pair's target index is searched (built once with its
    clouds); else the call builds its own, one packed index over a batch's targets on a
    device (``register_many``'s batched stages: one search per iteration for the batch,
    not one per pair). The result is batched (B).
    """
    clock.lap("icp_prepare")
    index = [p.index for p in pairs] if own_index else None
    src, tgt = (_batch([p.source for p in pairs], pad=False),
                _batch([p.target for p in pairs], pad=False))
    if refine == "gicp":
        local = gicp(src, tgt, init=init, max_correspondence_distance=scales.fine,
                     criteria=criteria, index=index, device=init.device)
    else:
        local = icp(src, tgt, init=init, max_correspondence_distance=scales.fine,
                    method="point_to_plane", criteria=criteria, index=index,
                    target_normals=_batch([p.normals for p in pairs]), device=init.device)
    clock.lap("icp")
    return local


def _batch(clouds: list[Any], pad: bool = True) -> Any:
    """Return B clouds ``(n_b, 3)`` for a batched call.

    A view ``(1, n, 3)`` of one (no copy); else the list (``pad=False``: the call pads it)
    or ``(B, max n_b, 3)`` zero-padded.
    """
    if len(clouds) == 1:
        return clouds[0][None]
    return _validate.as_batch(clouds, "clouds")[0] if pad else clouds


#: correspondences the compatibility graph is built on (the most distinctive first)
CORRESPONDENCES = 1000
#: global hypotheses refined by the coarse ICP stage
REFINE_TOP = 4
