"""register(): global then local registration in one call; composes, adds nothing numerical.

The recipe of Open3D's global-registration tutorial (Rusu et al. 2009 features; Marchel
2017 parallel RANSAC; Chen & Medioni 1992 point-to-plane ICP):

1. ``voxel_downsample`` both clouds (edge v);
2. normals by PCA within 2v (30 neighbours at most), oriented towards each cloud's centroid
   (a convention that moves with the cloud, so features do not depend on the pose);
3. FPFH within 5v (100 neighbours at most); one neighbour search per cloud (5v, 100) serves
   both steps, the normals taking its first 30 neighbours within 2v;
4. parallel RANSAC on feature nearest neighbours, inlier bound 1.5v;
5. point-to-plane ICP from the RANSAC pose: a coarse stage on the clouds of steps 1-2
   (their index and normals) with a correspondence bound of 1.5v, then the full clouds
   (or their ``icp_voxel_size`` copies; target normals within 2v from 16 neighbours)
   with 0.5v; each stops on Open3D's relative-change rule or an update below 0.1 % of v
   and 0.01°.

Default v: the edge at which the larger of the two clouds keeps about
``target_points`` = 5,000 points (found by a few secant steps on the occupied-voxel count,
which scales like v⁻² on surfaces). 5,000 is the size the parallel RANSAC paper works at
(5 mm voxels on ~10⁵-point object scans); it gives ~3.5 mm on the Stanford bunny, ~5 cm on
3DMatch fragments and ~1 m on a KITTI scan, the sizes those datasets are usually
registered at.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import numpy as np
import torch

from pointalign import _progress, _threads, _validate
from pointalign.cloud import PointCloud
from pointalign.features.downsample import bounds, count_voxels, voxel_downsample
from pointalign.features.fpfh import fpfh, neighbourhoods, restrict
from pointalign.features.outliers import neighbour_counts
from pointalign.kernels import _loop
from pointalign.registration import _edge
from pointalign.registration.ransac import ransac
from pointalign.registration.result import RegistrationResult

METHODS = ("icp", "none")


def auto_voxel_size(points: Any, target_points: int = 5000, *, iterations: int = 6) -> float:
    """Voxel edge at which ``points (N, 3)`` keeps about ``target_points`` voxels.

    Starts from ``diag / sqrt(target_points)`` (diag: the bounding-box diagonal) and
    corrects ``v ← v · sqrt(count / target_points)`` (surfaces: count ∝ v⁻²) a few times;
    returns the first edge whose count is within 10 % or the best seen. A cloud with fewer
    than ``2 · target_points`` points is reduced to about half its size instead.
    """
    pts = _validate.as_points(points, "points")
    target_points = int(target_points)
    if target_points < 3:
        raise ValueError(f"target_points: expected an integer >= 3, got {target_points}")
    extent = bounds(pts)  # one synchronisation for the loop
    diag = math.dist(extent[1], extent[2])
    if diag == 0.0:
        raise ValueError("points: all points coincide; cannot choose a voxel size")
    # a cloud not much larger than the target is still halved: every voxel must keep a
    # few neighbours within the 2v normal radius
    want = max(3, min(target_points, pts.shape[0] // 2))
    v = diag / math.sqrt(want)
    best_v, best_err = v, math.inf
    for _ in range(iterations):
        c = count_voxels(pts, v, extent)
        err = abs(math.log(c / want))
        if err < best_err:
            best_v, best_err = v, err
        if err < 0.1:
            break
        v *= math.sqrt(c / want)
        v = max(v, diag * 1e-6)
    return best_v


#: raw neighbours within one voxel edge: a point with fewer is a stray point ...
SPARSE_NEIGHBOURS = 4
#: ... provided the cloud's median point has at least this many (else it is too sparse
#: against the voxel to tell strays from surface: nothing is removed)
DENSE_MEDIAN = 8
#: outlier removal runs when a sample finds at least this fraction of stray points in either
#: cloud (5 % uniform outliers give about 4.5 %; the bunny scans about 0.1 %)
MIN_STRAY_FRACTION = 0.02


def dense_mask(points: torch.Tensor, v: float, index: Any = None) -> torch.Tensor:
    """Tell the points of ``points (N, 3)`` that lie in the dense part of the cloud at scale v.

    A point is kept when at least :data:`SPARSE_NEIGHBOURS` other points lie within ``v``
    of it. Outliers scattered through the bounding box have none at the voxel scale
    (measured on the hard-pair benchmark at 20 % outliers: 90 % of them have at most 3,
    while 99 % of surface points have at least 7), while a sampled surface, or a lidar ring
    whose spacing is well under the voxel, has many. When the median point has fewer than
    :data:`DENSE_MEDIAN` (an input already about as sparse as the voxel grid), the rule
    cannot tell the two apart and every point is kept. Returns an ``(N,)`` bool tensor.
    """
    from pointalign.search import build_index

    if points.shape[0] <= SPARSE_NEIGHBOURS + 1:
        return torch.ones(points.shape[0], dtype=torch.bool, device=points.device)
    idx = build_index(points) if index is None else index
    count = neighbour_counts(idx, points, v, min(2 * DENSE_MEDIAN + 1, points.shape[0])) - 1
    if float(count.float().median()) < DENSE_MEDIAN:
        return torch.ones(points.shape[0], dtype=torch.bool, device=points.device)
    return count >= SPARSE_NEIGHBOURS


def stray_fraction(points: torch.Tensor, v: float, sample: int = 4096,
                   index: Any = None) -> float:
    """Estimate the fraction of stray points in ``points (N, 3)`` at scale ``v``.

    Stray: fewer than :data:`SPARSE_NEIGHBOURS` others within ``v`` (the points
    :func:`dense_mask` would drop), from an evenly strided sample of at most ``sample``
    queries: one small search instead of one per point. ``index``: an index over
    ``points`` to search (default: one built for the bound ``v``).
    """
    from pointalign.search import build_index

    n = points.shape[0]
    if n <= SPARSE_NEIGHBOURS + 1:
        return 0.0
    q = points[:: max(1, n // sample)]
    # a grid with cells of v: one sort to build, and a few thousand queries over 27 cells
    if index is None:
        index = build_index(points, max_distance=v)
    count = neighbour_counts(index, q, v, SPARSE_NEIGHBOURS + 1) - 1
    return float((count < SPARSE_NEIGHBOURS).float().mean())


def robust_voxel_size(points: Any, target_points: int = 5000, *,
                      iterations: int = 2) -> float:
    """Voxel edge at which ``points (N, 3)`` without its stray points keeps ``target_points``.

    :func:`auto_voxel_size` counts every occupied voxel, so stray points (outliers spread
    through the bounding box, one voxel each) inflate the edge: 20 % uniform outliers on a
    bunny scan take it from 2.6 to 5.1 mm, and then make up more than half of the voxels.
    Here the edge is recomputed on the points :func:`dense_mask` keeps at the current edge
    (``iterations`` times; a clean cloud keeps its :func:`auto_voxel_size` edge).
    """
    pts = _validate.as_points(points, "points")
    v = auto_voxel_size(pts, target_points)
    for _ in range(iterations):
        keep = dense_mask(pts, v)
        n = int(keep.sum())
        if n == pts.shape[0] or n < 3:
            break
        v = auto_voxel_size(pts[keep], target_points)
    return v


@_validate.out_of_memory_is_clear
def register(
    source: Any,
    target: Any,
    *,
    voxel_size: float | None = None,
    device: str | torch.device | None = None,
    method: str = "icp",
    target_points: int = 5000,
    hypotheses: int = 16384,
    icp_voxel_size: float | None = None,
    max_iterations: int = 30,
    seed: int = 0,
    remove_outliers: bool = True,
    robust: bool = True,
    **ransac_options: Any,
) -> RegistrationResult:
    """Register ``source`` onto ``target`` with no initial guess: FPFH + RANSAC, then ICP.

    Args:
        source: ``(N, 3)`` float array/tensor or PointCloud (metres).
        target: ``(M, 3)`` float array/tensor or PointCloud.
        voxel_size: downsampling edge v for the global stage (default: see
            :func:`auto_voxel_size`); normals use 2v, FPFH 5v, RANSAC 1.5v.
        device: compute device (default: the source's for tensors, else CUDA if present).
        method: ``"icp"`` (point-to-plane refinement) or ``"none"`` (global stage only).
        target_points: size the automatic voxel edge aims at.
        hypotheses: RANSAC hypotheses per batch.
        icp_voxel_size: downsample the clouds for ICP at this edge (default: full clouds).
        max_iterations: ICP iteration cap per stage.
        seed: RANSAC's seed (see :func:`~pointalign.registration.ransac.ransac`): an integer
            in [0, 2**64 - 1]; the same seed and inputs give identical results on one
            device (CPU, or a GPU), not across devices (their generators differ).
        remove_outliers: drop stray points before downsampling and choose the voxel edge
            without them (:func:`dense_mask`, :func:`robust_voxel_size`); False restores
            :func:`auto_voxel_size` on all points.
        robust: add the compatibility-graph hypotheses of
            :mod:`pointalign.registration.robust` to RANSAC's, refine the best
            ``REFINE_TOP`` by the coarse ICP stage and keep the one with the largest
            overlap; False refines RANSAC's best only.
        **ransac_options: passed to :func:`pointalign.registration.ransac.ransac`.

    Returns:
        :class:`RegistrationResult` of the last stage (ICP, or RANSAC with ``method="none"``)
        with ``timings`` per stage (``downsample``, ``normals``, ``fpfh``, ``ransac``,
        ``icp``, ``total``) and ``info`` holding ``voxel_size``, the downsampled sizes and
        the RANSAC result (``info["global"]``). If RANSAC finds no hypothesis, its failed
        result is returned (``converged=False``) without ICP. After ICP, ``converged``
        is the verdict: True only when the result looks trustworthy (enough overlap, a
        clear margin over the best different hypothesis, residuals concentrated near
        zero); ``info["verdict"]`` says why not, with ``info["overlap"]``,
        ``info["margin"]``, ``info["concentration"]``; ``info["icp_converged"]`` keeps
        the ICP's own stop test.

    """
    for name, flag in (("remove_outliers", remove_outliers), ("robust", robust)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name}: expected True or False, got {flag!r}")
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    seed = _validate.seed(seed)
    target_points = _validate.integer(target_points, "target_points", minimum=3)
    hypotheses = _validate.integer(hypotheses, "hypotheses", minimum=1)
    max_iterations = _validate.integer(max_iterations, "max_iterations", minimum=1)
    if voxel_size is not None:
        voxel_size = _validate.positive(voxel_size, "voxel_size")
    if icp_voxel_size is not None:
        icp_voxel_size = _validate.positive(icp_voxel_size, "icp_voxel_size")
    like = source.points if isinstance(source, PointCloud) else \
        source if isinstance(source, torch.Tensor) else None
    dev = _validate.as_device(device, like)
    src = _validate.as_points(source, "source", min_points=3, device=dev)
    tgt = _validate.as_points(target, "target", min_points=3, device=dev)
    _warn_register(src, tgt, dev, method, target_points, icp_voxel_size, max_iterations)
    # the local frame: both clouds shifted by the target's centroid in float64 before
    # anything becomes float32 (georeferenced coordinates keep their precision)
    frame, src_l, tgt_l = local_frame(src, tgt)
    # the arrays below are derived from validated ones: no NaN/Inf scans (host syncs) on them
    # on the CPU the stages are small PyTorch operations between numba kernels (which keep
    # their threads): PyTorch on one thread (see _threads.torch_single)
    single = _threads.torch_single() if dev.type == "cpu" else contextlib.nullcontext()
    with _validate.trusted(), _progress.task("register", delay=_progress.LIBRARY_DELAY), single:
        res = _register(src_l, tgt_l, dev, voxel_size, method, target_points, hypotheses,
                        icp_voxel_size, max_iterations, seed, remove_outliers,
                        robust, ransac_options)
    result = to_world(res, frame)
    _progress.log_timings("register", result.timings)
    if not result.converged:
        why = result.info.get("verdict") if method == "icp" else None
        _progress.warn(f"register: the result is doubtful ({why or result.stop_reason}); "
                       "result.converged is False, see result.info (verdict, overlap, margin, "
                       "concentration) before trusting the transformation",
                       _progress.DoubtfulResultWarning, stacklevel=3)
    return result


#: rough CPU cost of register() on 2 threads (measured on the bunny, a LiDAR and a KITTI
#: pair at default settings): seconds per 5,000 downsampled points (features, RANSAC,
#: hypotheses) and per raw point (voxel edge, downsampling, full-cloud ICP)
_CPU_SECONDS_PER_5000 = 5.0
_CPU_SECONDS_PER_POINT = 1e-5


def _warn_register(src: torch.Tensor, tgt: torch.Tensor, dev: torch.device, method: str,
                   target_points: int, icp_voxel_size: float | None,
                   max_iterations: int) -> None:
    """Warnings before the work: parameters ``method="none"`` ignores; a CPU call of minutes."""
    if method == "none":
        if icp_voxel_size is not None:
            _progress.warn_ignored("icp_voxel_size", 'register(method="none")',
                                   "no ICP stage", stacklevel=4)
        if max_iterations != 30:
            _progress.warn_ignored("max_iterations", 'register(method="none")',
                                   "no ICP stage", stacklevel=4)
    if dev.type == "cpu":
        n, m = src.shape[0], tgt.shape[0]
        est = (_CPU_SECONDS_PER_5000 * max(target_points, 1) / 5000
               + _CPU_SECONDS_PER_POINT * (n + m)) * 2 / max(torch.get_num_threads(), 1)
        _progress.warn_slow(f"register() on {n:,} + {m:,} points on the CPU", est,
                            "pass icp_voxel_size (ICP on downsampled clouds) or downsample "
                            "the clouds first (pointalign.voxel_downsample), or use a GPU",
                            stacklevel=4)


def local_frame(source: torch.Tensor, target: torch.Tensor
                ) -> tuple[_edge.Frame, torch.Tensor, torch.Tensor]:
    """Shift ``source (N, 3)`` and ``target (M, 3)`` by the target's centroid, in float64.

    Returns the :class:`~pointalign.registration._edge.Frame` and both clouds in it as
    float32. Float64 input far from the origin keeps its precision; float32 input is
    already rounded to its own resolution (about 6 cm at 10⁶ m), which no frame restores.
    """
    c = target.to(torch.float64).mean(0)
    src_l = (source.to(torch.float64) - c).to(torch.float32)
    tgt_l = (target.to(torch.float64) - c).to(torch.float32)
    return _edge.Frame(c.cpu().numpy()[None].astype(np.float64)), src_l, tgt_l


def to_world(result: RegistrationResult, frame: _edge.Frame) -> RegistrationResult:
    """Return ``result`` (solved in the local ``frame``) in the caller's coordinates.

    The transformation (and its tensor, and a nested ``info["global"]`` result) are
    composed back in float64: ``T_world = Tr(c) T_local Tr(−c)``.
    """
    T = frame.to_world(np.asarray(result.transformation, dtype=np.float64)[None])[0]
    tt = result.transformation_tensor
    info = dict(result.info)
    if isinstance(info.get("global"), RegistrationResult):
        info["global"] = to_world(info["global"], frame)
    return dataclasses.replace(
        result, transformation=T, info=info,
        transformation_tensor=None if tt is None else
        torch.from_numpy(T).to(device=tt.device, dtype=torch.float64))


def _register(src: torch.Tensor, tgt: torch.Tensor, dev: torch.device,
              voxel_size: float | None, method: str, target_points: int, hypotheses: int,
              icp_voxel_size: float | None, max_iterations: int, seed: int,
              remove_outliers: bool, robust: bool,
              ransac_options: dict[str, Any]) -> RegistrationResult:
    """:func:`register` on validated ``src, tgt (N, 3), (M, 3)`` float32 tensors on ``dev``."""
    from pointalign.search import build_index

    clock = _loop.Clock(dev)
    big = src if src.shape[0] >= tgt.shape[0] else tgt
    v = auto_voxel_size(big, target_points) if voxel_size is None \
        else _validate.positive(voxel_size, "voxel_size")
    # on the CPU (where an index's kind does not depend on the bound) the full target's
    # index serves the stray count below and the final ICP: one build instead of two
    t_full_idx = build_index(tgt) if (dev.type == "cpu" and method == "icp"
                                      and icp_voxel_size is None and remove_outliers) else None
    # stray points are looked for only where a sample shows some (a clean scan or a lidar
    # sweep pays nothing for the outlier stages)
    remove_outliers = remove_outliers and max(
        stray_fraction(src, v), stray_fraction(tgt, v, index=t_full_idx)) >= MIN_STRAY_FRACTION
    if remove_outliers and voxel_size is None:
        v = robust_voxel_size(big, target_points)
    clock.lap("voxel_size")

    from pointalign.features.normals import estimate_normals

    s_clean, t_clean = src, tgt
    if remove_outliers:
        s_keep, t_keep = dense_mask(src, v), dense_mask(tgt, v)
        if int(s_keep.sum()) >= 3 and int(t_keep.sum()) >= 3:
            s_clean, t_clean = src[s_keep], tgt[t_keep]
    s_down, t_down = voxel_downsample(s_clean, v), voxel_downsample(t_clean, v)
    if s_down.shape[0] < 3 or t_down.shape[0] < 3:
        raise ValueError(f"voxel_size: {v:g} leaves {s_down.shape[0]} source and "
                         f"{t_down.shape[0]} target points; at least 3 each are needed")
    clock.lap("downsample")
    s_idx, t_idx = build_index(s_down), build_index(t_down)
    clock.lap("index")
    # one search per cloud (5v, 100 nearest) serves FPFH and, cut to 2v / 30, the normals
    s_nb = neighbourhoods(s_down, 5 * v, min(100, s_down.shape[0]), s_idx)
    t_nb = neighbourhoods(t_down, 5 * v, min(100, t_down.shape[0]), t_idx)
    s_nrm = estimate_normals(s_down, neighbors=restrict(s_nb, 2 * v, 30),
                             orient="viewpoint", viewpoint=s_down.mean(0))
    t_nrm = estimate_normals(t_down, neighbors=restrict(t_nb, 2 * v, 30),
                             orient="viewpoint", viewpoint=t_down.mean(0))
    clock.lap("normals")
    s_f = fpfh(s_down, radius=5 * v, normals=s_nrm, neighbors=s_nb)
    t_f = fpfh(t_down, radius=5 * v, normals=t_nrm, neighbors=t_nb)
    clock.lap("fpfh")
    ransac_options.setdefault("max_correspondence_distance", 1.5 * v)
    # RANSAC's feature matches and the ranking's (k = 2 forward, 1 backward): one pass
    from pointalign.kernels.ransac import shared_feature_knn

    shared = shared_feature_knn(s_f, t_f, 2)
    with shared:
        glob = ransac(s_down, t_down, source_features=s_f, target_features=t_f,
                      hypotheses=hypotheses, target_index=t_idx, seed=seed, **ransac_options)
    clock.lap("ransac")
    info: dict[str, Any] = {"voxel_size": v, "source_down": int(s_down.shape[0]),
                            "target_down": int(t_down.shape[0]), "global": glob}
    if method == "none" or glob.stop_reason in ("no_hypothesis", "too_few_correspondences"):
        timings = clock.total()
        timings.update({f"ransac.{k}": x for k, x in glob.timings.items() if k != "total"})
        return RegistrationResult(
            transformation=glob.transformation, fitness=glob.fitness, rmse=glob.rmse,
            iterations=glob.iterations, converged=glob.converged,
            stop_reason=glob.stop_reason, timings=timings, info={**glob.info, **info},
            transformation_tensor=glob.transformation_tensor)

    from pointalign.registration.criteria import ConvergenceCriteria
    from pointalign.registration.icp import icp
    from pointalign.registration.ransac import _count
    from pointalign.registration.robust import compatibility_hypotheses, rank_correspondences

    # second proposer: length-consistent cliques of the most distinctive correspondences
    cands = glob.transformation_tensor[None]
    n_rank = 0
    if robust and t_f.shape[0] >= 2:
        with shared:
            corr = rank_correspondences(s_f, t_f, CORRESPONDENCES)
        n_rank = int(corr.shape[0])
        if n_rank >= 3:
            H, _ = compatibility_hypotheses(s_down[corr[:, 0]], t_down[corr[:, 1]], 1.5 * v)
            cands = torch.cat([cands, H])
    clock.lap("robust")
    # the best few proposals by inliers on the clouds, each refined by the coarse ICP stage
    criteria = ConvergenceCriteria(max_iterations=max_iterations, translation_tolerance=1e-3 * v,
                                   rotation_tolerance=math.radians(0.01))
    counts = _count(cands, s_down, t_idx, 1.5 * v)
    top = torch.argsort(counts, descending=True, stable=True)[:REFINE_TOP if robust else 1]
    # one batched ICP over the k hypotheses (the same source, the shared target and index)
    k = int(top.shape[0])
    loc = icp(s_down[None].expand(k, -1, -1), t_down, init=cands[top],
              max_correspondence_distance=1.5 * v, method="point_to_plane", criteria=criteria,
              index=t_idx, target_normals=t_nrm, device=dev)
    iters0 = int(np.max(loc.iterations))
    R = loc.transformation_tensor
    # robust score: source points with a target point within one voxel (a trimmed overlap)
    fit_v = _count(R, s_down, t_idx, v)
    order = torch.argsort(fit_v, descending=True, stable=True)
    R, fit_v = R[order], fit_v[order]
    clock.lap("hypotheses")

    s_full, t_full = src, tgt
    if icp_voxel_size is not None:
        vi = _validate.positive(icp_voxel_size, "icp_voxel_size")
        s_full, t_full = voxel_downsample(src, vi), voxel_downsample(tgt, vi)
    if t_full_idx is None or t_full is not tgt:
        t_full_idx = build_index(t_full)
    # normals within 2v as in step 2, from at most 16 neighbours: the full clouds are dense
    # (16 nearest points are well within 2v wherever the surface is sampled finer than the
    # voxel), and a k-NN list of 16 halves the search's work against 30 (KITTI: 5 vs 10 ms)
    # (searched a chunk at a time inside estimate_normals: the full (M, 16) neighbour table
    # of a 50M-point target alone held 26 GiB on the GPU)
    # (on the CPU the index keeps this self-query as the final ICP's shortcut lists,
    # ``CpuTree.set_candidates``)
    t_full_nrm = estimate_normals(t_full, k=min(16, t_full.shape[0]), radius=2 * v,
                                  index=t_full_idx, orient="viewpoint",
                                  viewpoint=t_full.mean(0))
    clock.lap("icp_prepare")
    local = icp(s_full, t_full, init=R[0], max_correspondence_distance=0.5 * v,
                method="point_to_plane", criteria=criteria, index=t_full_idx,
                target_normals=t_full_nrm, device=dev)
    T = local.transformation_tensor if local.transformation_tensor is not None else \
        torch.as_tensor(local.transformation, dtype=torch.float64, device=dev)
    clock.lap("icp")
    verdict = _verdict(T, R, fit_v, s_down, t_idx, v, local.converged,
                       float(local.info.get("stability", 1.0)))
    clock.lap("verdict")
    timings = clock.total()
    timings.update({f"ransac.{k}": x for k, x in glob.timings.items() if k != "total"})
    info.update(verdict)
    info["ranked_correspondences"] = n_rank
    info["hypotheses_refined"] = int(R.shape[0])
    return RegistrationResult(
        transformation=local.transformation, fitness=local.fitness, rmse=local.rmse,
        iterations=iters0 + int(local.iterations), converged=verdict["trusted"],
        stop_reason=local.stop_reason, history=local.history, timings=timings,
        info={**local.info, **info, "ransac_info": glob.info,
              "icp_converged": bool(local.converged)},
        transformation_tensor=T)


#: correspondences the compatibility graph is built on (the most distinctive first)
CORRESPONDENCES = 1000
#: global hypotheses refined by the coarse ICP stage
REFINE_TOP = 4
#: verdict thresholds, calibrated on benchmarks/bench_hard_pairs.py (see its docstring)
MIN_OVERLAP = 0.2
MAX_MARGIN = 0.95
MIN_CONCENTRATION = 0.45


def _counts_within(T: torch.Tensor, points: torch.Tensor, index: Any,
                   bounds: tuple[float, ...]) -> tuple[torch.Tensor, ...]:
    """Points of ``points (P, 3)`` moved by ``T (4, 4)`` with an indexed point within each bound.

    One search at the largest bound: a nearest point within a smaller bound is the nearest
    within the largest, so its squared distance (compared in the search's dtype, as the
    search compares it) tells every count. Equals ``_score(T[None], points, index, b)[0]``
    for each ``b``; returns one ``(1,)`` int64 count per bound.
    """
    from pointalign.kernels.ransac import transform_points

    q = transform_points(T[None], points).reshape(-1, 3)
    with _validate.trusted():
        res = index.nearest_within(q, max(bounds))
    d2 = torch.where(res.idx[:, 0] >= 0, res.dists[:, 0], math.inf)
    return tuple((d2 <= b * b).sum()[None] for b in bounds)


def _verdict(T: torch.Tensor, R: torch.Tensor, fit_v: torch.Tensor, s_down: torch.Tensor,
             t_idx: Any, v: float, icp_converged: bool,
             stability: float = 1.0) -> dict[str, Any]:
    """Whether the final ``T (4, 4)`` is trustworthy, and why not.

    * ``overlap``: fraction of the downsampled source within v of the target under T;
    * ``margin``: the best *different* refined hypothesis' overlap over the winner's (a
      hypothesis is different when it maps the source's centroid more than 3v away or
      turns more than 5 degrees away from T); near 1 = ambiguous;
    * ``concentration``: of the source points within 1.5v, the fraction within 0.5v (a
      right pose puts most matches near zero, a wrong one spreads them over the bound);
    * ``stability`` (of the final ICP, :func:`pointalign._math.stability`): at or below
      ``STABILITY_EPS`` the data do not determine the pose ("pose not determined").
    """
    from pointalign import _math, transforms

    c15, c05, cv = _counts_within(T, s_down, t_idx, (1.5 * v, 0.5 * v, v))
    ctr = s_down.mean(0).to(torch.float64)
    moved = R[:, :3, :3] @ ctr + R[:, :3, 3]
    here = T[:3, :3] @ ctr + T[:3, 3]
    dR = R[:, :3, :3].transpose(1, 2) @ T[:3, :3]
    ang = torch.rad2deg(transforms.rotation_angle(dR))
    other = ((moved - here).norm(dim=1) > 3 * v) | (ang > 5.0)
    n = s_down.shape[0]
    best = float(cv[0])
    second = float(fit_v[other].max()) if bool(other.any()) else 0.0
    overlap = best / n
    margin = second / max(best, 1.0)
    concentration = float(c05[0]) / max(float(c15[0]), 1.0)
    why = []
    if overlap < MIN_OVERLAP:
        why.append("small overlap")
    if margin > MAX_MARGIN:
        why.append("weak margin")
    if concentration < MIN_CONCENTRATION:
        why.append("residuals not concentrated")
    if not stability > _math.STABILITY_EPS:
        why.append("pose not determined")
    return {"overlap": overlap, "margin": margin, "concentration": concentration,
            "trusted": not why, "verdict": "trusted" if not why else ", ".join(why)}
