"""Parallel RANSAC on feature correspondences: all hypotheses at once, on the device.

Follows L. Marchel (Heuros), "Parallel RANSAC for point cloud registration" (Foundations of
Computing and Decision Sciences, 2017): feature-space nearest neighbours computed once for
every source point; N hypotheses of three correspondences drawn at once; the triangle
(polygon) similarity test of Bolles & Fischler rejects most of them before any estimation;
stream compaction (boolean mask → ``nonzero``); closed-form estimation (Horn) of the
survivors in one batch; the T(d,d) pre-test of Matas & Chum on a random subset of d source
points; full inlier scoring of the few that remain; the best by inlier ratio. Beyond the
paper: a local optimisation of the best few on their inliers (Lo-RANSAC, Chum, Matas &
Kittler 2003) and an adaptive number of hypothesis batches from the observed
correspondence inlier ratio w and a confidence p: ``N = log(1 − p) / log(1 − w³)``.

Inliers: a source point x is an inlier of T when the target has a point within
``max_correspondence_distance`` of ``T x`` (Open3D's ``fitness``); the paper's "inlier
ratio" is this fraction. Random numbers come from a ``torch.Generator`` on the compute
device seeded by ``seed``, and every reduction is order-fixed, so a seed gives the same
result on a given device.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from pointalign import _progress, _threads, _validate
from pointalign.cloud import PointCloud
from pointalign.kernels import _loop
from pointalign.kernels import ransac as _k
from pointalign.kernels.ransac import FeatureMatches
from pointalign.registration import _edge, checks
from pointalign.registration._edge import StopReason
from pointalign.registration.ransac_programs import (  # noqa: F401 (the counts: README names)
    Batch,
    count_inliers,
    count_inliers_within,
    explained,
    key,
    refine,
)
from pointalign.registration.result import RegistrationResult
from pointalign.search import build_index


def _features(x: Any, name: str, cloud: Any, n: int, device: torch.device) -> torch.Tensor:
    if x is None and isinstance(cloud, PointCloud):
        x = cloud.features
    if x is None:
        raise ValueError(f"{name}: required (an (N, D) array, e.g. from pointalign.fpfh)")
    t = _validate._float(name, _validate._to_tensor(name, x), torch.float32).to(device)
    if t.dim() != 2 or t.shape[0] != n or t.shape[1] < 1:
        raise ValueError(f"{name}: expected shape ({n}, D) (one row per point), "
                         f"got {tuple(t.shape)}")
    _validate._check_finite(name, t)
    return t


def feature_correspondences(
    source_features: Any,
    target_features: Any,
    *,
    mutual: bool = False,
    ratio: float | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """Nearest neighbour in feature space of every source point: ``(C, 2)`` int64 pairs.

    Row c is ``(i, j)``: target point j has the feature closest to source point i's.
    With ``mutual`` only pairs where i is also j's nearest source feature are kept; with
    ``ratio`` (Lowe's test) only pairs with ``d1 < ratio · d2`` (Euclidean feature
    distances to the first and second nearest target features).

    Args:
        source_features: ``(N, D)`` float array/tensor.
        target_features: ``(M, D)`` float array/tensor.
        mutual: keep only mutual nearest neighbours.
        ratio: optional Lowe ratio in (0, 1].
        device: compute device (default: the features' device, which must be one).

    Returns:
        ``(C, 2)`` int64 tensor on the device, rows in increasing source index.

    """
    dev = _validate.resolve_device(device, source_features=source_features,
                                   target_features=target_features)
    sf = _validate._to_tensor("source_features", source_features)
    tf_ = _validate._to_tensor("target_features", target_features)
    sf = _features(sf, "source_features", None, sf.shape[0] if sf.dim() == 2 else -1, dev)
    tf = _features(tf_, "target_features", None, tf_.shape[0] if tf_.dim() == 2 else -1, dev)
    if sf.shape[1] != tf.shape[1]:
        raise ValueError(f"target_features: dimension {tf.shape[1]} differs from "
                         f"source_features' {sf.shape[1]}")
    corr, count = _correspond(sf, tf, mutual, ratio)
    return corr[:int(count)]  # (one host read)


def _correspond(sf: torch.Tensor, tf: torch.Tensor, mutual: bool, ratio: float | None,
                matches: FeatureMatches | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Feature correspondences of ``sf (N, D)`` and ``tf (M, D)``, with no host read.

    From ``matches`` where they hold what is needed (k forward, the backward ones for
    ``mutual``), else searched. Returns ``(N, 2)`` int64 rows ``(source row, target row)``,
    the C correspondences first in increasing source row (the rows after them are other
    source rows: not correspondences), and C as a 0-dim int64 tensor.
    """
    k = 2 if ratio is not None and tf.shape[0] >= 2 else 1
    if matches is not None and matches.k >= k:
        d, j = matches.forward(k)
    else:
        d, j = _k.feature_knn(sf, tf, k)
    i = torch.arange(sf.shape[0], device=sf.device)
    keep = torch.ones_like(i, dtype=torch.bool)
    if ratio is not None and k == 2:
        keep &= d[:, 0].sqrt() < float(ratio) * d[:, 1].sqrt()
    if mutual:
        back = matches.back_idx if matches is not None else None
        if back is None:
            _, back = _k.feature_knn(tf, sf, 1)
        keep &= back[j[:, 0], 0] == i
    first = torch.sort((~keep).to(torch.int8), stable=True).indices  # kept rows first
    return torch.stack([i, j[:, 0]], 1)[first], keep.sum()


def required_hypotheses(inlier_ratio: float, confidence: float, sample_size: int = 3) -> float:
    """Hypotheses needed to draw one all-inlier sample with probability ``confidence``.

    ``log(1 − p) / log(1 − w^s)`` (``inf`` when w = 0, 1 when w = 1).
    """
    ws = float(inlier_ratio) ** sample_size
    if ws <= 0:
        return math.inf
    if ws >= 1:
        return 1.0
    return math.log(1.0 - confidence) / math.log1p(-ws)


@_threads.per_call
@_validate.out_of_memory_is_clear
def ransac(
    source: Any,
    target: Any,
    *,
    source_features: Any = None,
    target_features: Any = None,
    max_correspondence_distance: float,
    hypotheses: int = 16384,
    triangle_similarity: float = 0.2,
    tdd_points: int = 32,
    inlier_ratio_threshold: float | None = None,
    mutual: bool = False,
    ratio_test: float | None = None,
    confidence: float = 0.999,
    max_hypotheses: int | None = None,
    max_validations: int = 32,
    local_refinement: bool = True,
    refine_top: int = 4,
    refine_iterations: int = 5,
    target_index: Any = None,
    seed: int = 0,
    device: str | torch.device | None = None,
    matches: FeatureMatches | None = None,
) -> RegistrationResult:
    """Global registration by parallel RANSAC over feature correspondences.

    Per batch of ``hypotheses`` samples: draw three correspondences each; keep those whose
    source and target triangles have every edge-length ratio ≥ ``1 − triangle_similarity``;
    estimate their motions by Horn's method in one batch; keep those whose inlier count on
    a shared random subset of ``tdd_points`` source points is at least half the batch's best
    (T(d,d)); score the best ``max_validations`` of them on all source points. Batches
    continue until ``log(1 − confidence) / log(1 − w³)`` hypotheses were drawn (w: the
    fraction of correspondences the best motion so far explains), ``max_hypotheses`` is
    reached, or the inlier ratio reaches ``inlier_ratio_threshold``. Then the best
    ``refine_top`` motions are re-estimated on their inliers (Lo-RANSAC).

    Args:
        source: ``(N, 3)`` float array/tensor or PointCloud (the model); metres.
        target: ``(M, 3)`` float array/tensor or PointCloud (the scene).
        source_features: ``(N, D)`` descriptors (e.g. :func:`pointalign.fpfh`); default the
            PointCloud's ``features``.
        target_features: ``(M, D)`` descriptors of the target, same D.
        max_correspondence_distance: inlier bound (metres); the paper and Open3D's tutorial
            use 1.5 × the voxel size.
        hypotheses: samples drawn per batch (the paper's 16 × 1024).
        triangle_similarity: allowed relative edge-length difference (0.2: 20 %).
        tdd_points: d of the T(d,d) pre-test.
        inlier_ratio_threshold: stop early once the inlier ratio reaches it; the result is
            ``converged=False`` (stop_reason ``"below_threshold"``) if it is never reached.
        mutual: use only mutual nearest neighbours in feature space.
        ratio_test: optional Lowe ratio for the feature matches.
        confidence: p of the adaptive hypothesis count.
        max_hypotheses: cap on hypotheses over all batches (default 4 × ``hypotheses``).
        max_validations: hypotheses per batch scored on the whole source after T(d,d).
        local_refinement: run the Lo-RANSAC step.
        refine_top: how many of the best motions the Lo-RANSAC step refines.
        refine_iterations: rounds of re-estimation per refined motion.
        target_index: optional prebuilt :class:`~pointalign.search.base.Index` over target
            (its points are checked against target: a ValueError when they differ). Without
            one, the problem is solved in a frame centred on the target's centroid (shifted
            in float64 before anything becomes float32), so coordinates far from the origin
            keep their precision; with one, the caller's coordinates are kept.
        seed: seeds the ``torch.Generator`` on the compute device (an integer in
            [0, 2**64 - 1]; NumPy integers accepted). Every random draw (samples, the
            T(d,d) subset) comes from it and every reduction has a fixed order, so the same
            seed and inputs give identical results on one device: on the CPU, and on a GPU
            (repeated runs with one seed were identical in the project's checks, issue 16).
            The CPU and CUDA generators produce different streams, so one seed draws
            different (equally valid) hypotheses on the CPU and on a GPU, and different
            seeds give slightly different results.
        device: compute device (default: the inputs' device, which must be one; see
            :func:`pointalign.registration._edge.resolve_device`).
        matches: the feature matches of ``source_features`` against ``target_features``
            when the caller has them already
            (:func:`pointalign.kernels.ransac.feature_matches`: ``(N, k)`` forward, and the
            ``(M, 1)`` backward ones for ``mutual``), e.g. shared with
            :func:`pointalign.registration.robust.rank_correspondences` as
            :func:`pointalign.register` does; default: searched here. Only their shapes are
            checked: they must be the matches of these very features.
        num_threads: CPU threads for this call (:func:`pointalign.threads`).

    Returns:
        :class:`RegistrationResult`: ``transformation`` T_target_source, ``fitness`` (inlier
        ratio), ``rmse`` (inlier RMSE), ``iterations`` (hypotheses drawn), ``info`` with
        counts per stage (``hypotheses``, ``after_triangle``, ``after_estimation``,
        ``after_tdd``, ``validated``, ``correspondences``, ``correspondence_inlier_ratio``,
        ``required_hypotheses``, ``batches``) and ``timings`` per stage. When no hypothesis
        survives, ``converged`` is False, ``stop_reason`` ``"no_hypothesis"`` and the
        transformation is the identity.

    Raises:
        ValueError / TypeError: bad clouds (fewer than 3 points), features of the wrong
            shape, bad parameters.

    """
    dev = _validate.resolve_device(device, source=source, target=target,
                                   source_features=source_features,
                                   target_features=target_features,
                                   matches=getattr(matches, "idx", None))
    dist = _validate.positive(max_correspondence_distance, "max_correspondence_distance")
    # the local frame (shift by the target's centroid in float64, then float32), unless the
    # caller's index was built in the caller's coordinates; on a GPU the pair's host part
    # (and the units check) is read once the first batch is enqueued
    pair, units = checks.prepared_pair(source, target, None, dev, None, None, min_points=3,
                                       local=target_index is None,
                                       max_correspondence_distance=dist)
    if pair.batched:
        raise ValueError(f"source, target: expected one (N, 3) cloud each, got a batch of "
                         f"{pair.size}; call ransac once per pair")
    src, tgt = pair.source[0], pair.target[0]
    if target_index is not None:
        _check_index(target_index, tgt)
    sf = _features(source_features, "source_features", source, src.shape[0], dev)
    tf = _features(target_features, "target_features", target, tgt.shape[0], dev)
    if sf.shape[1] != tf.shape[1]:
        raise ValueError(f"target_features: dimension {tf.shape[1]} differs from "
                         f"source_features' {sf.shape[1]}")
    sim = _validate.in_range(triangle_similarity, "triangle_similarity", 0.0, 1.0)
    conf = _validate.in_range(confidence, "confidence", 0.0, 1.0)
    hypotheses, tdd_points, max_validations, refine_top = (
        _validate.integer(v, name, minimum=1) for name, v in (
            ("hypotheses", hypotheses), ("tdd_points", tdd_points),
            ("max_validations", max_validations), ("refine_top", refine_top)))
    refine_iterations = _validate.integer(refine_iterations, "refine_iterations", minimum=0)
    seed = _validate.seed(seed)
    for name, flag in (("mutual", mutual), ("local_refinement", local_refinement)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name}: expected True or False, got {flag!r}")
    max_h = 4 * hypotheses if max_hypotheses is None else \
        _validate.integer(max_hypotheses, "max_hypotheses", minimum=1)
    if max_h < hypotheses:
        raise ValueError(f"max_hypotheses: must be >= hypotheses ({hypotheses}), got {max_h}")
    if inlier_ratio_threshold is not None:
        inlier_ratio_threshold = _validate.in_range(inlier_ratio_threshold,
                                                    "inlier_ratio_threshold", 0.0, 1.0 + 1e-9)
    if ratio_test is not None:
        ratio_test = _validate.in_range(ratio_test, "ratio_test", 0.0, 1.0 + 1e-9)
    if not local_refinement and (refine_top, refine_iterations) != (4, 5):
        _progress.warn_ignored("refine_top/refine_iterations", "ransac", "local_refinement "
                               "is False", stacklevel=3)

    if matches is not None:
        if not isinstance(matches, FeatureMatches):
            raise TypeError(f"matches: expected a FeatureMatches "
                            f"(pointalign.kernels.ransac.feature_matches), got "
                            f"{type(matches).__name__}")
        matches.check(sf.shape[0], tf.shape[0])

    clock = _loop.Clock(dev)
    if target_index is None:
        target_index = build_index(tgt)
    clock.lap("index")
    # the correspondences' count stays on the device: the first batch brings it back
    corr, n_corr_t = _correspond(sf, tf, mutual, ratio_test, matches)
    clock.lap("correspondences")

    info: dict[str, Any] = {"hypotheses": 0, "after_triangle": 0, "after_estimation": 0,
                            "after_tdd": 0, "validated": 0, "correspondences": 0,
                            "correspondence_inlier_ratio": 0.0,
                            "required_hypotheses": math.inf, "batches": 0}
    g = torch.Generator(device=dev)
    g.manual_seed(int(seed))
    d = min(tdd_points, src.shape[0])
    subset = src[torch.randperm(src.shape[0], generator=g, device=dev)[:d]]
    cs, ct = src[corr[:, 0]], tgt[corr[:, 1]]
    last_row = (n_corr_t - 1).clamp_min(0)

    # the best motions so far, padded to a fixed size by rows that count -1 (ranked last)
    keep = max(refine_top, 1)
    pool = {"T": torch.eye(4, dtype=torch.float64, device=dev).repeat(keep, 1, 1),
            "counts": torch.full((keep,), -1, dtype=torch.int64, device=dev),
            "sq": torch.zeros(keep, dtype=torch.float64, device=dev)}
    batch = Batch(target_index, sim, dist, max_validations)
    n_pool = 0
    stop = StopReason.MAX_HYPOTHESES
    # a progress bar on a terminal once the batches run over a second (nothing otherwise)
    for h in _progress.batches(max_h, hypotheses, "RANSAC hypotheses"):
        # three rows each, uniform over the correspondences
        triples = (torch.rand(h, 3, generator=g, device=dev) * n_corr_t).long().minimum(last_row)
        clock.lap("sample")
        # one fixed program a batch (a CUDA graph on a GPU), one transfer of its counts
        host, out = _loop.run_program(batch, {"cs": cs, "ct": ct, "triples": triples,
                                              "subset": subset, "source": src,
                                              "n_corr": n_corr_t, **pool},
                                      eager_first=True, meanwhile=units)
        units = None  # (checked, with the first batch in flight)
        (n_triangle, n_valid, n_passed, n_validated, n_pool, best_count,
         n_explained, n_corr) = (int(v) for v in host["tally"])
        if n_corr < 3:  # (the batch drew from nothing: it is not counted)
            info["correspondences"] = n_corr
            return _failed(pair, info, clock, StopReason.TOO_FEW_CORRESPONDENCES)
        info["correspondences"] = n_corr
        info["hypotheses"] += h
        info["batches"] += 1
        pool = {k: out[k] for k in pool}
        for k, v in (("after_triangle", n_triangle), ("after_estimation", n_valid),
                     ("after_tdd", n_passed), ("validated", n_validated)):
            info[k] += v
        clock.lap("hypotheses")
        if n_pool == 0:
            continue
        fit = best_count / src.shape[0]
        if inlier_ratio_threshold is not None and fit >= inlier_ratio_threshold:
            stop = StopReason.INLIER_RATIO
            break
        w = n_explained / n_corr
        info["correspondence_inlier_ratio"] = w
        info["required_hypotheses"] = required_hypotheses(w, conf)
        if info["hypotheses"] >= info["required_hypotheses"]:
            stop = StopReason.CONFIDENCE
            break
    if n_pool == 0:
        return _failed(pair, info, clock, StopReason.NO_HYPOTHESIS)
    pool_T, pool_c, pool_sq = (pool[k][:n_pool] for k in ("T", "counts", "sq"))

    before = pool_c[0]
    if local_refinement and refine_iterations > 0:
        pool_T, pool_c, pool_sq = refine(pool_T, pool_c, pool_sq, src, tgt, target_index,
                                         dist, refine_iterations)
        best = torch.sort(key(pool_c, pool_sq, dist), descending=True, stable=True).indices
        pool_T, pool_c, pool_sq = pool_T[best], pool_c[best], pool_sq[best]
    n_expl = explained(pool_T[0], cs, ct, n_corr_t, dist)
    last = torch.cat([torch.stack([pool_c[0].double(), pool_sq[0], before.double(),
                                   n_expl.double()]),
                      pool_T[0].detach().to(torch.float64).reshape(16)]).cpu().numpy()
    count_f, sq_best, before_f, n_explained = last[:4].tolist()  # (one transfer)
    count, n_before = int(count_f), int(before_f)
    if local_refinement and refine_iterations > 0:
        info["refined_inliers_gain"] = count - n_before
        clock.lap("refine")
    timings = clock.total()
    _progress.log_timings("ransac", timings)
    fitness = count / src.shape[0]
    rmse = math.sqrt(sq_best / count) if count else math.inf
    info["correspondence_inlier_ratio"] = n_explained / n_corr
    converged = inlier_ratio_threshold is None or fitness >= inlier_ratio_threshold
    if not converged:
        stop = StopReason.BELOW_THRESHOLD
    return _edge.build_result(
        pair, last[4:].reshape(1, 4, 4), fitness=np.array([fitness]), rmse=np.array([rmse]),
        iterations=np.array([info["hypotheses"]]), reasons=[stop], history=[],
        timings=timings, info=info, converged=np.array([converged]))


#: target rows compared with a caller's index (evenly spaced; one transfer)
_INDEX_CHECK_ROWS = 64


def _check_index(index: Any, target: torch.Tensor) -> None:
    """Raise a ValueError unless ``index`` was built over ``target (M, 3)``.

    Compares the point count, the device and, unless the index holds ``target`` itself,
    up to :data:`_INDEX_CHECK_ROWS` evenly spaced rows (float32 rounding allowed): an index
    over another cloud would score every hypothesis against the wrong points.
    """
    p = getattr(index, "points", None)
    if not isinstance(p, torch.Tensor) or not hasattr(index, "nearest_within"):
        raise TypeError("target_index: expected an Index over the target "
                        f"(pointalign.search.build_index), got {type(index).__name__}")
    if tuple(p.shape) != tuple(target.shape) or p.device != target.device:
        raise ValueError(f"target_index: built over {tuple(p.shape)} points on {p.device}, "
                         f"but target has {tuple(target.shape)} on {target.device}")
    if p is target or p.data_ptr() == target.data_ptr() or _validate.is_trusted():
        return  # (an internal caller built the index over this cloud: no transfer to ask)
    rows = torch.linspace(0, p.shape[0] - 1, min(_INDEX_CHECK_ROWS, p.shape[0]),
                          device=p.device).long()
    a, b = p[rows].to(torch.float64), target[rows].to(torch.float64)
    tol = 1e-6 * (1.0 + b.abs().max())
    if not bool(((a - b).abs().max() <= tol).item()):
        raise ValueError("target_index: built over a different cloud than target (its "
                         "points differ); build it with pointalign.search.build_index(target)")


def _failed(pair: _edge.Pair, info: dict[str, Any], clock: _loop.Clock,
            reason: StopReason) -> RegistrationResult:
    """Build the result of a RANSAC that found nothing: the identity, ``converged=False``."""
    return _edge.build_result(
        pair, np.eye(4)[None], fitness=np.array([0.0]), rmse=np.array([math.inf]),
        iterations=np.array([info["hypotheses"]]), reasons=[reason], history=[],
        timings=clock.total(), info=info, converged=np.array([False]))
