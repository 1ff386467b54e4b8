"""register_many's global stage for a whole group of pairs at once (issue 25, part 2).

The per-pair global stage (``pipeline._prepare_pair`` then ``pipeline._global``) is
launch-bound on a GPU: about 1,700 small launches and 100 host synchronisations per
bunny-size pair. Here every stage runs once for the whole group, in the frame
``register_many`` already uses (each pair scaled by 1/v, so every radius is the same
number of voxels for all pairs):

1. :func:`describe_many`: every cloud downsampled by one sort
   (:func:`~pointalign.features.downsample.voxel_downsample_many`: each cloud on its own
   grid, as alone); one neighbour search for all of them (a
   :class:`~pointalign.search.packed.PackedIndex`: each cloud in its own lattice cell, so
   each answer is the cloud's own); the normals and FPFH of the concatenation with
   neighbour indices into it (per-point kernels: each point's result depends on its own
   row only, so it is the per-cloud result wherever the rows agree);
2. :func:`global_many`: features padded to ``(B, n, 33)``, matched by one batched brute
   force (:func:`pointalign.kernels.ransac.feature_matches_many`); RANSAC's rounds for
   every pair at once (the samples of all pairs in one tensor; the T(d,d) test and the
   scores by one packed index over the targets, each query row naming its pair; the
   per-pair selections as padded ``(B, ·)`` sorts); the compatibility-graph proposals of
   :mod:`~pointalign.registration.robust` batched over pairs.

Before them, :func:`voxel_sizes`: the voxel edge v and the stray decision of every pair
(``pipeline._voxel_size``'s rule and results, bit for bit on the CPU backends) with one
voxel count per round of the edge rule, one stray search for the whole group and, for the
pairs that show strays, ``robust_voxel_size`` of all of them at once
(:func:`~pointalign.features.outliers.robust_voxel_sizes_many`); :func:`without_strays_many`:
their dense points (``pipeline._without_strays``: the same masks); :func:`scaled`: every
cloud divided by its v in one launch.

For register_many's local stages on a GPU (:func:`batched_local`): :func:`refine_many`
(the coarse stage's counts and rankings), :func:`final_clouds_many` (the final ICP's
clouds and target normals), :func:`verdicts_many` (the verdict's numbers): each a few
launches for the whole group, within the packed search's rounding of the per-pair counts.

What stays per pair: each cloud's index for the local stages (brute force on a GPU: no
build); a target holding duplicated points (its normals); the per-pair Python loops that
wrap the results (views and one ``cat`` per pair). The random
draws differ from the per-pair path's (one generator for the group), so the hypotheses
differ; the results are equivalent, not identical (tests: the same verdicts).

Which path runs (:func:`applies`): the batched one on a GPU, for groups of at least
:data:`MIN_PAIRS` pairs without an ``init``, whose RANSAC options are among
:data:`BATCHED_RANSAC_OPTIONS`; otherwise the per-pair one. :data:`BATCHED` forces it either
way (None: that rule).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from pointalign._ops import divide_like_scalar
from pointalign.features.downsample import (
    auto_voxel_size_many,
    group_clouds,
    voxel_downsample_many,
)
from pointalign.features.fpfh import restrict
from pointalign.features.outliers import (
    MIN_STRAY_FRACTION,
    dense_masks_many,
    robust_voxel_sizes_many,
    stray_fractions_many,
)
from pointalign.kernels import _loop, upload
from pointalign.kernels import ransac as _kr
from pointalign.kernels.features import pca_normals
from pointalign.kernels.features.fpfh import fpfh_combine, spfh
from pointalign.kernels.horn import weighted_horn
from pointalign.kernels.soft import weighted_horn as soft_weighted_horn
from pointalign.registration._edge import MIN_FITNESS, StopReason
from pointalign.registration.criteria import ConvergenceCriteria
from pointalign.registration.icp import icp
from pointalign.registration.options import Options as _Options
from pointalign.registration.pipeline import (
    CORRESPONDENCES,
    FEATURE_NEIGHBOURS,
    FULL_NORMAL_NEIGHBOURS,
    NORMAL_NEIGHBOURS,
    REFINE_TOP,
    FinalClouds,
    Prepared,
    Scales,
    _batch,
)
from pointalign.registration.ransac import _key, _triangle_motions, required_hypotheses
from pointalign.registration.result import RegistrationResult
from pointalign.search import build_index, policy
from pointalign.search.base import KnnResult
from pointalign.search.packed import PackedIndex

#: None: the batched stage on a GPU, per pair on the CPU; True/False: always/never
BATCHED: bool | None = None
#: a smaller group runs per pair (nothing to batch)
MIN_PAIRS = 2
#: RANSAC options the batched stage implements (``inlier_ratio_threshold``: per pair)
BATCHED_RANSAC_OPTIONS = frozenset({
    "mutual", "ratio_test", "triangle_similarity", "tdd_points", "confidence",
    "max_hypotheses", "max_validations", "local_refinement", "refine_top",
    "refine_iterations"})
#: pairs per chunk of the compatibility graphs (each ``(C, C)`` float32, C <= 1,000)
GRAPH_PAIRS = 32
#: seeds and consensus size of :func:`pointalign.registration.robust.compatibility_hypotheses`
_SEEDS, _K, _ROUNDS = 64, 32, 2


def applies(opts: _Options, device: torch.device, pairs: int) -> bool:
    """Tell whether ``pairs`` pairs (no ``init``) of one chunk take the batched stage."""
    if pairs < MIN_PAIRS or not set(opts.ransac_options) <= BATCHED_RANSAC_OPTIONS:
        return False
    return device.type == "cuda" if BATCHED is None else BATCHED


def _pad(clouds: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(C, max n, D)`` zero-padded and the lengths ``(C,)`` int64 on the device."""
    dev = clouds[0].device
    out = torch.nn.utils.rnn.pad_sequence(list(clouds), batch_first=True)
    return out, torch.tensor([c.shape[0] for c in clouds], dtype=torch.int64, device=dev)


def _packed(points: torch.Tensor, lengths: list[int], distance: float) -> PackedIndex:
    """One packed index over ``points (C, M, 3)`` (the search policy's, on the CPU too)."""
    idx = policy.choose_batch_index(points, lengths, max_distance=distance)
    if isinstance(idx, PackedIndex):
        return idx
    return PackedIndex(points, lengths, max_distance=distance,
                       build=lambda p: policy.choose_index(p, max_distance=distance))


#: ``auto_voxel_size``'s error, for a pair whose larger cloud's points all coincide
_COINCIDE = "points: all points coincide; cannot choose a voxel size"


def voxel_sizes(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], opts: _Options
                ) -> list[tuple[float, bool] | ValueError]:
    """``pipeline._voxel_size`` of every pair ``(source, target)`` at once: v, strays.

    The same rule: v from the larger cloud (:func:`~pointalign.features.downsample.
    auto_voxel_size_many`: the same edges, bit for bit, one host synchronisation per round
    of the rule's loop for the whole group), the stray fractions of both clouds at v
    (:func:`~pointalign.features.outliers.stray_fractions_many`: the same samples and
    test, two or three synchronisations for the group), and where pairs show strays and
    v is automatic, ``robust_voxel_size`` of those pairs' larger clouds at once
    (:func:`~pointalign.features.outliers.robust_voxel_sizes_many`: the same edges, a few
    synchronisations per round for the group). A pair whose larger cloud's points all
    coincide gets the ValueError
    ``auto_voxel_size`` raises.
    """
    if not pairs:
        return []
    bigs = [s if s.shape[0] >= t.shape[0] else t for s, t in pairs]
    if opts.voxel_size is None:
        vs = auto_voxel_size_many(group_clouds(bigs), opts.target_points)
    else:
        vs = [float(opts.voxel_size)] * len(pairs)
    ok = [math.isfinite(v) for v in vs]
    strays = [False] * len(pairs)
    if opts.remove_outliers:
        fr = stray_fractions_many(group_clouds([x for p in pairs for x in p]),
                                  [v if good else 1.0 for v, good in zip(vs, ok, strict=True)
                                   for _ in (0, 1)])
        strays = [max(fr[2 * i], fr[2 * i + 1]) >= MIN_STRAY_FRACTION for i in range(len(pairs))]
    if opts.voxel_size is None:  # v without the strays, for every pair that shows some
        redo = [i for i in range(len(pairs)) if ok[i] and strays[i]]
        for i, rv in zip(redo, robust_voxel_sizes_many(
                [bigs[i] for i in redo], opts.target_points, start=[vs[i] for i in redo]),
                         strict=True):
            vs[i], ok[i] = rv, math.isfinite(rv)
    return [(v, st) if good else ValueError(_COINCIDE)
            for v, good, st in zip(vs, ok, strays, strict=True)]


def without_strays_many(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
                        vs: Sequence[float]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``pipeline._without_strays`` of every pair ``(source, target)`` at its ``vs[i]``.

    Every cloud's :func:`~pointalign.features.outliers.dense_mask` by one
    :func:`~pointalign.features.outliers.dense_masks_many` (the same masks), the kept points
    of all clouds by one selection; a pair where either cloud keeps fewer than 3 points
    stays as given (as per pair). A few host synchronisations for the whole group.
    """
    if not pairs:
        return []
    group = group_clouds([x for p in pairs for x in p])
    keep, kept = dense_masks_many(group, [v for v in vs for _ in (0, 1)])
    dense = torch.split(group.points[keep], kept)
    return [(dense[2 * i], dense[2 * i + 1]) if min(kept[2 * i], kept[2 * i + 1]) >= 3
            else p for i, p in enumerate(pairs)]


def scaled(vs: Sequence[float], clouds: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``[c / v for c, v in zip(clouds, vs)]`` in three launches, bit for bit (one division)."""
    if not clouds:
        return []
    sizes = [int(c.shape[0]) for c in clouds]
    dev = clouds[0].device
    rows = torch.repeat_interleave(torch.arange(len(sizes), device=dev),
                                   torch.tensor(sizes).to(dev), output_size=sum(sizes))
    return list(torch.split(divide_like_scalar(torch.cat(list(clouds)), vs, rows), sizes))


def describe_many(downs: Sequence[torch.Tensor], scales: Scales
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Describe C downsampled clouds at once (normals, FPFH), as ``_prepare_cloud`` does.

    Args:
        downs: C ``(n_c, 3)`` float32 clouds (n_c >= 3) on one device.
        scales: the lengths (``feature_radius``, ``normal_radius``).

    Returns:
        ``(normals, features)``: C ``(n_c, 3)`` unit normals (facing each cloud's centroid)
        and C ``(n_c, 33)`` FPFH.

    """
    sizes = [int(d.shape[0]) for d in downs]
    pad, n = _pad(downs)
    c, m = pad.shape[0], pad.shape[1]
    dev = pad.device
    r = scales.feature_radius
    index = _packed(pad, sizes, r)
    nb = index.radius(pad.reshape(-1, 3), r, min(FEATURE_NEIGHBOURS, m))
    valid = (torch.arange(m, device=dev)[None] < n[:, None]).reshape(-1)       # (C·m,)
    offset = torch.cumsum(n, 0) - n                                             # (C,)
    owner = torch.arange(c, device=dev)[:, None].expand(c, m).reshape(-1)
    gidx = torch.where(nb.idx >= 0, nb.idx + offset[owner][:, None], -1)[valid]
    dists = nb.dists[valid]
    points = torch.cat(list(downs))
    who = owner[valid]
    table = restrict(KnnResult(dists, gidx), scales.normal_radius, NORMAL_NEIGHBOURS)
    normals = _facing(pca_normals(points, table, None), points, pad, n, who)
    features = fpfh_combine(spfh(points, normals, gidx), gidx, dists)
    return list(torch.split(normals, sizes)), list(torch.split(features, sizes))


def _facing(normals: torch.Tensor, points: torch.Tensor, pad: torch.Tensor, n: torch.Tensor,
            who: torch.Tensor) -> torch.Tensor:
    """Flip ``normals`` to face their cloud's centroid: ``nᵀ(c − p) >= 0``.

    ``pad (C, m, 3)`` the clouds zero-padded, ``n (C,)`` their sizes, ``who`` each row's
    cloud; the dot product summed as the normal kernels sum it.
    """
    vp = pad.sum(1) / n[:, None].to(pad.dtype)
    a = vp[who] - points
    f = (a[:, 0] * normals[:, 0] + a[:, 1] * normals[:, 1]) + a[:, 2] * normals[:, 2]
    return torch.where((f < 0)[:, None], -normals, normals)


def prepare_many(clouds: Sequence[torch.Tensor], scales: Scales, clock: _loop.Clock
                 ) -> tuple[list[torch.Tensor], list[int]]:
    """Downsample C clouds at ``scales.voxel`` (one sort): the clouds and their sizes."""
    downs = voxel_downsample_many(list(clouds), scales.voxel)
    clock.lap("downsample")
    return downs, [int(d.shape[0]) for d in downs]


class PairGlobal(NamedTuple):
    """One pair's global result: RANSAC's, and the candidates (None: nothing to refine)."""

    glob: RegistrationResult
    candidates: torch.Tensor | None


def _score(T: torch.Tensor, prob: torch.Tensor, src: torch.Tensor, n_src: torch.Tensor,
           index: PackedIndex, dist: float, with_matches: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Score motions ``T (S, 4, 4)`` of pairs ``prob (S,)`` on their padded sources.

    ``src (B, N, 3)`` with ``n_src (B,)`` valid rows. Returns counts ``(S,)`` int64, the
    float64 sums of the inliers' squared distances ``(S,)`` and (``with_matches``) each
    row's target match ``(S, N)`` (-1: none, or a padding row).
    """
    s, n = T.shape[0], src.shape[1]
    if s == 0:
        z = torch.zeros(0, dtype=torch.int64, device=src.device)
        return z, z.to(torch.float64), z.new_zeros(0, n) if with_matches else None
    moved = _kr.transform_points(T, src[prob])                                 # (S, N, 3)
    rows = prob[:, None].expand(s, n).reshape(-1)
    res = index.nearest_within(moved.reshape(-1, 3), dist, problem=rows)
    ok = (res.idx[:, 0] >= 0).view(s, n) & (torch.arange(n, device=src.device)[None]
                                            < n_src[prob][:, None])
    d2 = torch.where(ok, res.dists[:, 0].view(s, n).to(torch.float64), 0.0)
    match = torch.where(ok, res.idx[:, 0].view(s, n), -1) if with_matches else None
    return ok.sum(1), d2.sum(1), match


def global_many(sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                source_features: Sequence[torch.Tensor],
                target_features: Sequence[torch.Tensor], scales: Scales, opts: _Options,
                clock: _loop.Clock) -> list[PairGlobal]:
    """RANSAC and (``robust``) the graph's proposals of B pairs, batched.

    Args:
        sources: B ``(n_b, 3)`` float32 downsampled source clouds.
        targets: B ``(m_b, 3)`` float32 downsampled target clouds.
        source_features: their ``(n_b, 33)`` FPFH.
        target_features: ``(m_b, 33)``.
        scales: the lengths (``correspondence``: RANSAC's bound), one for the group.
        opts: the checked options (RANSAC's among :data:`BATCHED_RANSAC_OPTIONS`).
        clock: the stage clock.

    Returns:
        B :class:`PairGlobal`: what ``pipeline._global`` returns per pair (RANSAC's result
        in the scaled frame, the candidates ``(H, 4, 4)`` float64, RANSAC's first).

    """
    ro = dict(opts.ransac_options)
    mutual, ratio = bool(ro.get("mutual", False)), ro.get("ratio_test")
    sim = float(ro.get("triangle_similarity", 0.2))
    tdd, conf = int(ro.get("tdd_points", 32)), float(ro.get("confidence", 0.999))
    h = int(opts.hypotheses)
    max_h = int(ro.get("max_hypotheses") or 4 * h)
    max_val, top = int(ro.get("max_validations", 32)), int(ro.get("refine_top", 4))
    iters = int(ro.get("refine_iterations", 5)) if ro.get("local_refinement", True) else 0
    dist = scales.correspondence
    B = len(sources)
    S, n_src = _pad(sources)
    Tg, n_tgt = _pad(targets)
    SF, _ = _pad(source_features)
    TF, _ = _pad(target_features)
    dev, N = S.device, S.shape[1]
    ns, nt = [int(x.shape[0]) for x in sources], [int(x.shape[0]) for x in targets]
    index = _packed(Tg, nt, dist)
    clock.lap("ransac_index")
    use_ratio = opts.robust or ratio is not None
    k = 2 if use_ratio and min(nt) >= 2 else 1
    fm = _kr.feature_matches_many(SF, TF, n_src, n_tgt, k, backward=opts.robust or mutual)
    cols = torch.arange(N, device=dev)
    real = cols[None] < n_src[:, None]                                           # (B, N)
    keep = real.clone()
    if ratio is not None and k == 2:
        keep &= fm.dists[..., 0].sqrt() < float(ratio) * fm.dists[..., 1].sqrt()
    if mutual:
        assert fm.back_idx is not None
        back = torch.gather(fm.back_idx[..., 0], 1, fm.idx[..., 0].clamp_min(0))
        keep &= back == cols[None]
    # each pair's correspondences first, in increasing source row (as ``_correspond``)
    corr_i = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices     # (B, N)
    corr_j = torch.gather(fm.idx[..., 0].clamp_min(0), 1, corr_i)
    n_corr_t = keep.sum(1)
    bi = torch.arange(B, device=dev)[:, None]
    cs, ct = S[bi, corr_i], Tg[bi, corr_j]                                       # (B, N, 3)
    clock.lap("correspondences")
    g = torch.Generator(device=dev)
    g.manual_seed(int(opts.seed))
    d_max = min(tdd, N)
    perm = torch.where(real, torch.rand(B, N, generator=g, device=dev), 2.0).argsort(1)
    subset = S[bi, perm[:, :d_max]]                                              # (B, d, 3)
    n_sub = n_src.clamp_max(d_max)
    eye = torch.eye(4, dtype=torch.float64, device=dev)
    pool_T = eye.expand(B, top, 4, 4).clone()
    pool_c = torch.zeros(B, top, dtype=torch.int64, device=dev)
    pool_sq = torch.zeros(B, top, dtype=torch.float64, device=dev)
    pool_key = torch.full((B, top), -math.inf, dtype=torch.float64, device=dev)
    n_corr = n_corr_t.tolist()
    active = [c >= 3 for c in n_corr]
    drawn = [0] * B
    stop = [StopReason.MAX_HYPOTHESES if a else StopReason.TOO_FEW_CORRESPONDENCES
            for a in active]
    done = 0
    while done < max_h and any(active):
        hh = min(h, max_h - done)
        done += hh
        act = torch.tensor([b for b in range(B) if active[b]], device=dev)
        na = int(act.shape[0])
        for b in range(B):
            drawn[b] += hh if active[b] else 0
        r = torch.rand(na, hh, 3, generator=g, device=dev)
        triples = (r * n_corr_t[act][:, None, None]).long().minimum(
            n_corr_t[act][:, None, None] - 1)
        ab = act[:, None, None]
        tri_s, tri_t = cs[ab, triples].reshape(-1, 3, 3), ct[ab, triples].reshape(-1, 3, 3)
        surv = _kr.triangle_similar(tri_s, tri_t, sim).nonzero().squeeze(1)
        clock.lap("triangle")
        if surv.numel():
            prob = act[surv // hh]
            est = _triangle_motions(tri_s[surv], tri_t[surv])
            c_sub, _, _ = _score(est.transformation, prob, subset, n_sub, index, dist)
            c_sub = torch.where(est.valid, c_sub, -1)
            best = torch.full((B,), -1, dtype=torch.int64, device=dev).scatter_reduce(
                0, prob, c_sub, "amax")
            passed = (c_sub >= 1) & (2 * c_sub >= best[prob])
            # per pair: passed first by T(d,d) count (hypothesis order on ties)
            o1 = torch.sort(torch.where(passed, c_sub, -1), descending=True,
                            stable=True).indices
            o2 = torch.sort(prob[o1], stable=True).indices
            order = o1[o2]
            counts = torch.bincount(prob, minlength=B)
            first = torch.cumsum(counts, 0) - counts
            rank = torch.arange(order.shape[0], device=dev) - first[prob[order]]
            take = passed[order] & (rank < max_val)
            sel, slot = order[take], rank[take]
            clock.lap("tdd")
            T = est.transformation[sel]
            P = prob[sel]
            c, sq, _ = _score(T, P, S, n_src, index, dist)
            new_T = eye.expand(B, max_val, 4, 4).clone()
            new_c = torch.zeros(B, max_val, dtype=torch.int64, device=dev)
            new_sq = torch.zeros(B, max_val, dtype=torch.float64, device=dev)
            new_key = torch.full((B, max_val), -math.inf, dtype=torch.float64, device=dev)
            new_T[P, slot], new_c[P, slot], new_sq[P, slot] = T, c, sq
            new_key[P, slot] = _key(c, sq, dist)
            allk = torch.cat([pool_key, new_key], 1)
            o = torch.sort(allk, dim=1, descending=True, stable=True).indices[:, :top]
            pool_T = torch.gather(torch.cat([pool_T, new_T], 1), 1,
                                  o[..., None, None].expand(-1, -1, 4, 4))
            pool_c = torch.gather(torch.cat([pool_c, new_c], 1), 1, o)
            pool_sq = torch.gather(torch.cat([pool_sq, new_sq], 1), 1, o)
            pool_key = torch.gather(allk, 1, o)
            clock.lap("score")
        explained = _explained(pool_T[:, 0], cs, ct, n_corr_t, dist)
        has, n_expl = torch.stack([torch.isfinite(pool_key[:, 0]).long(), explained]).tolist()
        for b in range(B):
            if active[b] and has[b]:
                if drawn[b] >= required_hypotheses(n_expl[b] / n_corr[b], conf):
                    active[b], stop[b] = False, StopReason.CONFIDENCE
        clock.lap("score")
    found = torch.isfinite(pool_key[:, 0])
    if iters > 0:
        pool_T, pool_c, pool_sq, pool_key = _refine(pool_T, pool_c, pool_sq, pool_key, S,
                                                    Tg, n_src, index, dist, iters)
        clock.lap("refine")
    explained = _explained(pool_T[:, 0], cs, ct, n_corr_t, dist)
    found_h, cnt_h, sq_h, expl_h = (x.tolist() for x in (found, pool_c[:, 0], pool_sq[:, 0],
                                                         explained))
    T_best = pool_T[:, 0]
    T_host = T_best.cpu().numpy()
    globs = []
    for b in range(B):
        if not found_h[b]:
            reason = stop[b] if stop[b] == StopReason.TOO_FEW_CORRESPONDENCES \
                else StopReason.NO_HYPOTHESIS
            globs.append(_result(np.eye(4), 0.0, math.inf, drawn[b], reason, n_corr[b], 0.0,
                                 eye))
            continue
        fit = cnt_h[b] / ns[b]
        rmse = math.sqrt(sq_h[b] / cnt_h[b]) if cnt_h[b] else math.inf
        globs.append(_result(T_host[b], fit, rmse, drawn[b], stop[b], n_corr[b],
                             expl_h[b] / n_corr[b], T_best[b]))
    clock.lap("ransac")
    if opts.refine == "none":
        return [PairGlobal(gl, None) for gl in globs]
    props = _proposals(S, Tg, n_src, fm, dist) if opts.robust else [None] * B
    clock.lap("robust")
    out = []
    for b in range(B):
        if not found_h[b]:
            out.append(PairGlobal(globs[b], None))
            continue
        tt = globs[b].transformation_tensor
        assert tt is not None
        H = props[b]
        out.append(PairGlobal(globs[b], tt[None] if H is None else torch.cat([tt[None], H])))
    return out


def _result(T: np.ndarray, fitness: float, rmse: float, drawn: int, reason: StopReason,
            n_corr: int, w: float, T_dev: torch.Tensor) -> RegistrationResult:
    """One pair's RANSAC result (the rules of ``_edge.build_result`` that apply here)."""
    conv = bool(reason.converged) and fitness >= MIN_FITNESS
    if bool(reason.converged) and not conv:
        reason = StopReason.LOW_FITNESS
    return RegistrationResult(
        transformation=np.asarray(T, dtype=np.float64), fitness=fitness, rmse=rmse,
        iterations=drawn, converged=conv, stop_reason=str(reason),
        info={"correspondences": n_corr, "correspondence_inlier_ratio": w, "hypotheses": drawn},
        transformation_tensor=T_dev.to(torch.float64))


def _explained(T: torch.Tensor, cs: torch.Tensor, ct: torch.Tensor, n_corr: torch.Tensor,
               dist: float) -> torch.Tensor:
    """Per pair, the correspondences ``cs → ct (B, N, 3)`` that ``T (B, 4, 4)`` maps within."""
    res = (_kr.transform_points(T, cs) - ct).norm(dim=2)
    ok = (res <= dist) & (torch.arange(cs.shape[1], device=cs.device)[None] < n_corr[:, None])
    return ok.sum(1)


def _refine(T: torch.Tensor, c: torch.Tensor, sq: torch.Tensor, key: torch.Tensor,
            S: torch.Tensor, Tg: torch.Tensor, n_src: torch.Tensor, index: PackedIndex,
            dist: float, iterations: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lo-RANSAC of every pair's pool ``T (B, R, 4, 4)`` (``ransac._refine``, batched).

    Empty slots (key -inf) are never updated; returns the pools sorted by key, best first.
    """
    B, R = key.shape
    prob = torch.arange(B, device=S.device)[:, None].expand(B, R).reshape(-1)
    Tf, cf, sqf, kf = T.reshape(-1, 4, 4), c.reshape(-1), sq.reshape(-1), key.reshape(-1)
    real = torch.isfinite(kf)
    _, _, idx = _score(Tf, prob, S, n_src, index, dist, with_matches=True)
    assert idx is not None
    src_b = S[prob]
    for _ in range(iterations):
        tgt = Tg[prob[:, None], idx.clamp_min(0)]
        T_new, valid = weighted_horn(src_b, tgt, (idx >= 0).to(S.dtype))
        c_new, sq_new, idx_new = _score(T_new, prob, S, n_src, index, dist, with_matches=True)
        assert idx_new is not None
        k_new = _key(c_new, sq_new, dist)
        better = real & valid & (k_new > kf)
        if not bool(better.any()):
            break
        Tf = torch.where(better[:, None, None], T_new, Tf)
        cf, sqf = torch.where(better, c_new, cf), torch.where(better, sq_new, sqf)
        kf = torch.where(better, k_new, kf)
        idx = torch.where(better[:, None], idx_new, idx)
    key = kf.view(B, R)
    o = torch.sort(key, dim=1, descending=True, stable=True).indices
    return (torch.gather(Tf.view(B, R, 4, 4), 1, o[..., None, None].expand(-1, -1, 4, 4)),
            torch.gather(cf.view(B, R), 1, o), torch.gather(sqf.view(B, R), 1, o),
            torch.gather(key, 1, o))


def _proposals(S: torch.Tensor, Tg: torch.Tensor, n_src: torch.Tensor,
               fm: _kr.FeatureMatches, tau: float) -> list[torch.Tensor | None]:
    """Propose the compatibility graph's hypotheses of every pair (``robust``, batched).

    ``rank_correspondences`` (mutual matches first, then by Lowe's ratio; at most
    :data:`~pointalign.registration.pipeline.CORRESPONDENCES`) and
    ``compatibility_hypotheses`` of each pair, in chunks of :data:`GRAPH_PAIRS` pairs.
    Returns per pair ``(H, 4, 4)`` float64, most supported first, or None (fewer than 3
    correspondences).
    """
    B, N = S.shape[0], S.shape[1]
    dev = S.device
    cols = torch.arange(N, device=dev)
    d, j = fm.dists, fm.idx
    assert fm.back_idx is not None and d.shape[2] >= 2
    back = torch.gather(fm.back_idx[..., 0], 1, j[..., 0].clamp_min(0))
    mutual = back == cols[None]
    ratio = (d[..., 0].clamp_min(0).sqrt() / d[..., 1].clamp_min(1e-30).sqrt()).clamp(0, 1)
    key = ratio.to(torch.float64) + (~mutual).to(torch.float64) * 2.0
    key = torch.where(cols[None] < n_src[:, None], key, math.inf)
    C = min(CORRESPONDENCES, N)
    ci = torch.argsort(key, dim=1, stable=True)[:, :C]                          # (B, C)
    cj = torch.gather(j[..., 0].clamp_min(0), 1, ci)
    bi = torch.arange(B, device=dev)[:, None]
    src, tgt = S[bi, ci], Tg[bi, cj]
    cnt = n_src.clamp_max(C)
    cnt_h = cnt.tolist()
    out: list[torch.Tensor | None] = [None] * B
    for lo in range(0, B, GRAPH_PAIRS):
        hi = min(B, lo + GRAPH_PAIRS)
        for b, T in zip(range(lo, hi), _graph_hypotheses(src[lo:hi], tgt[lo:hi],
                                                         cnt[lo:hi], cnt_h[lo:hi], tau),
                        strict=True):
            out[b] = T
    return out


def _graph_hypotheses(src: torch.Tensor, tgt: torch.Tensor, cnt: torch.Tensor,
                      cnt_h: list[int], tau: float) -> list[torch.Tensor | None]:
    """``robust.compatibility_hypotheses`` of G pairs ``src, tgt (G, C, 3)``, ``cnt`` rows."""
    G, C = src.shape[0], src.shape[1]
    dev = src.device
    Sm = _kr.second_order_of_points_many(src, tgt, cnt, tau)                  # (G, C, C)
    ns = min(_SEEDS, C)
    valid = torch.arange(C, device=dev)[None] < cnt[:, None]                    # (G, C)
    # padding rows last: a pair's first min(ns, cnt) seeds are its own
    seed = torch.topk(torch.where(valid, Sm.sum(2), -1.0), ns, dim=1).indices   # (G, ns)
    gi = torch.arange(G, device=dev)[:, None]
    rows = Sm[gi, seed]                                                          # (G, ns, C)
    mx = rows.amax(dim=(1, 2))
    rows[gi, torch.arange(ns, device=dev)[None], seed] = (mx + 1)[:, None]
    kk = min(_K, C)
    member_s, member = torch.topk(rows, kk, dim=2)
    w = (member_s > 0).to(torch.float32).reshape(G * ns, kk)
    gs = gi[..., None]
    T, _ = soft_weighted_horn(src[gs, member].reshape(G * ns, kk, 3),
                              tgt[gs, member].reshape(G * ns, kk, 3), w)
    vrow = valid[:, None].expand(G, ns, C).reshape(G * ns, C)
    s_all = src[:, None].expand(G, ns, C, 3).reshape(G * ns, C, 3)
    t_all = tgt[:, None].expand(G, ns, C, 3).reshape(G * ns, C, 3)
    for _ in range(_ROUNDS):
        res = (_kr.transform_points(T, s_all) - t_all).norm(dim=2)
        inl = ((res < tau) & vrow).to(torch.float32)
        T_new, ok = soft_weighted_horn(s_all, t_all, inl)
        ok &= inl.sum(1) >= 3
        T = torch.where(ok[:, None, None], T_new, T)
    support = (((_kr.transform_points(T, s_all) - t_all).norm(dim=2) < tau) & vrow).sum(1)
    seed_ok = torch.arange(ns, device=dev)[None] < cnt[:, None].clamp_max(ns)  # (G, ns)
    support = torch.where(seed_ok.reshape(-1), support, -1).view(G, ns)
    order = torch.argsort(support, dim=1, descending=True, stable=True)
    T = torch.gather(T.view(G, ns, 4, 4), 1, order[..., None, None].expand(-1, -1, 4, 4))
    return [T[g, :min(ns, cnt_h[g])] if cnt_h[g] >= 3 else None for g in range(G)]


def index_of(down: torch.Tensor) -> Any:
    """Return the index over ``down (n, 3)`` the local stages read (as ``_prepare_cloud``)."""
    return build_index(down)


# ---------------------------------------------------------------------------- local stages

def batched_local(device: torch.device) -> bool:
    """Tell whether register_many's local stages batch their per-pair work here.

    The rule of :func:`applies` without its group conditions: on a GPU (launch-bound per
    pair), :data:`BATCHED` forcing it either way.
    """
    return device.type == "cuda" if BATCHED is None else BATCHED


def refine_many(problems: Sequence[tuple[torch.Tensor, Prepared, Prepared]], scales: Scales,
                criteria: ConvergenceCriteria, robust: bool, clock: _loop.Clock
                ) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """``pipeline._refine_hypotheses`` of B pairs with the per-pair work batched.

    The same stage: each pair's best :data:`~pointalign.registration.pipeline.REFINE_TOP`
    (``robust``; else 1) candidates by inliers within ``Scales.correspondence`` (a stable
    descending sort: ties keep the candidates' order), all refined by one point-to-plane
    ICP call (the same call), ranked by their overlap counts within ``Scales.overlap``.
    Both counts for all pairs' motions at once through one packed index over the targets
    (:class:`~pointalign.search.packed.PackedIndex`; per pair: two ``count_inliers`` and an
    argsort each); the per-pair sorts as one padded ``(B, ·)`` sort; the ICP call builds its
    own packed index over the batch (one search per iteration, not one per hypothesis,
    which searching each pair's own index cost: 2.4 s of 5.9 s for 1,000 pairs on an
    H200). The packed search
    measures distances on shifted coordinates, so a point whose distance lies within the
    lattice's float32 rounding (~1e-4 voxel) of a bound may count differently than with
    the pair's own index: the counts may differ by such points, and a ranking between
    hypotheses whose counts tie or differ by them may change. One host synchronisation
    besides the ICP's (the winners' iterations). Returns what ``_refine_hypotheses`` does.
    """
    B = len(problems)
    cands = [c for c, _, _ in problems]
    S, n_src = _pad([s.down for _, s, _ in problems])
    Tg, _ = _pad([t.down for _, _, t in problems])
    dev = S.device
    index = _packed(Tg, [int(t.down.shape[0]) for _, _, t in problems],
                    max(scales.correspondence, scales.overlap))
    H = [int(c.shape[0]) for c in cands]
    k = [min(REFINE_TOP if robust else 1, h) for h in H]
    T = torch.cat(cands)
    prob = torch.repeat_interleave(torch.arange(B, device=dev),
                                   upload(H, dtype=torch.int64, device=dev), output_size=sum(H))
    counts, _, _ = _score(T, prob, S, n_src, index, scales.correspondence)
    order, first = _ranked(counts, prob, H)
    owner = upload([b for b in range(B) for _ in range(k[b])], dtype=torch.int64, device=dev)
    slot = upload([j for b in range(B) for j in range(k[b])], dtype=torch.int64, device=dev)
    top = T[first[owner] + order[owner, slot]]
    clock.lap("coarse_rank")
    ob = [b for b in range(B) for _ in range(k[b])]
    normals = _batch([problems[b][2].normals for b in ob])
    loc = icp([problems[b][1].down for b in ob], [problems[b][2].down for b in ob], init=top,
              max_correspondence_distance=scales.correspondence, method="point_to_plane",
              criteria=criteria, target_normals=normals, device=dev)
    R_all = loc.transformation_tensor
    assert R_all is not None  # every RegistrationResult of icp() carries it
    its = np.asarray(loc.iterations).reshape(-1)
    clock.lap("coarse_icp")
    fit, _, _ = _score(R_all, owner, S, n_src, index, scales.overlap)
    order, first = _ranked(fit, owner, k)
    pick = first[owner] + order[owner, slot]
    R_sorted, fit_sorted = R_all[pick], fit[pick]
    best = pick[first].tolist()  # each pair's winner (its row of R_all)
    out = [(R, f, int(its[b])) for R, f, b in zip(torch.split(R_sorted, k),
                                                  torch.split(fit_sorted, k), best,
                                                  strict=True)]
    clock.lap("coarse_overlap")
    return out


def _ranked(values: torch.Tensor, prob: torch.Tensor, sizes: list[int]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each problem's rows of ``values (S,)``, descending, stably.

    ``prob``: each row's problem, ``sizes`` rows each, in order. Returns ``order (B, max
    size)`` (positions within the problem, padding last) and each problem's first row
    ``(B,)``.
    """
    dev = values.device
    B = len(sizes)
    first = upload(list(itertools.accumulate(sizes, initial=0))[:-1], dtype=torch.int64,
                   device=dev)
    col = torch.arange(values.shape[0], device=dev) - first[prob]
    pad = torch.full((B, max(sizes)), -1, dtype=values.dtype, device=dev)
    pad[prob, col] = values
    return torch.sort(pad, dim=1, descending=True, stable=True).indices, first


def final_clouds_many(sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                      vs: Sequence[float], scales: Scales, refine: str) -> list[FinalClouds]:
    """``pipeline._final_clouds(src / v, tgt / v, scales, None, None, refine)`` of B pairs.

    The full clouds of every pair divided by its v in one launch (:func:`scaled`: the same
    division, bit for bit); each target's index as per pair (:func:`index_of`: brute force
    on a GPU, no build); the targets' normals (``refine="point_to_plane"``) of all pairs by
    :func:`normals_many`. ``scales.normal_radius``: the radius of every pair (one number
    of voxels).
    """
    both = scaled([v for v in vs for _ in (0, 1)], [x for p in zip(sources, targets,
                                                                    strict=True) for x in p])
    srcs, tgts = both[0::2], both[1::2]
    normals: list[torch.Tensor | None] = [None] * len(tgts)
    if refine != "gicp":
        normals = list(normals_many(tgts, scales.normal_radius, FULL_NORMAL_NEIGHBOURS))
    return [FinalClouds(s, t, index_of(t), nt)
            for s, t, nt in zip(srcs, tgts, normals, strict=True)]


def normals_many(clouds: Sequence[torch.Tensor], radius: float, k: int) -> list[torch.Tensor]:
    """Estimate the normals of C clouds at once, as ``estimate_normals`` does per cloud.

    Per cloud c: ``estimate_normals(c, k=min(k, n), radius=radius, orient="viewpoint",
    viewpoint=c.mean(0))``.
    One radius search for all clouds (a :class:`~pointalign.search.packed.PackedIndex`:
    each cloud's own points; at most ``min(k, n_c)`` of them, nearest first), the PCA
    normal kernel once over the concatenation, each normal facing its cloud's centroid
    (:func:`_facing`). The packed search measures distances on shifted coordinates: a
    neighbour within the lattice's float32 rounding of the radius, or a near-tie for the
    k-th place, may differ from the cloud's own search (that row's normal then moves
    slightly); a normal lying almost across the direction to the centroid may face the
    other way (the centroid summed differently). A cloud holding duplicated points (the
    per-cloud path searches its distinct points again) is done alone. Two host
    synchronisations for the whole list.
    """
    from pointalign.features.normals import estimate_normals

    sizes = [int(c.shape[0]) for c in clouds]
    pad, n = _pad(clouds)
    c, m = pad.shape[0], pad.shape[1]
    dev = pad.device
    index = _packed(pad, sizes, radius)
    nb = index.radius(pad.reshape(-1, 3), radius, min(k, m))
    valid = (torch.arange(m, device=dev)[None] < n[:, None]).reshape(-1)
    offset = torch.cumsum(n, 0) - n
    owner = torch.arange(c, device=dev)[:, None].expand(c, m).reshape(-1)
    gidx = torch.where(nb.idx >= 0, nb.idx + offset[owner][:, None], -1)[valid]
    points = torch.cat(list(clouds))
    who = owner[valid]
    out = list(torch.split(_facing(pca_normals(points, gidx, None), points, pad, n, who),
                           sizes))
    if gidx.shape[1] >= 2:  # normals._has_duplicates of every cloud, one transfer
        a, b = gidx[:, 0], gidx[:, 1]
        same = (b >= 0) & (a >= 0) & (a != b) & (points[a.clamp_min(0)] == points).all(-1) \
            & (points[b.clamp_min(0)] == points).all(-1)
        dup = torch.zeros(c, dtype=torch.int64, device=dev).index_add_(
            0, who, same.to(torch.int64)).tolist()
        for i in (i for i in range(c) if dup[i]):
            out[i] = estimate_normals(clouds[i], k=min(k, sizes[i]), radius=radius,
                                      index=index_of(clouds[i]), orient="viewpoint",
                                      viewpoint=clouds[i].mean(0))
    return out


def verdicts_many(T: torch.Tensor, stability: Any, hypotheses: Sequence[torch.Tensor],
                  overlaps: Sequence[torch.Tensor], sources: Sequence[Prepared],
                  targets: Sequence[Prepared], scales: Scales
                  ) -> list[tuple[dict[str, Any], StopReason]]:
    """:func:`~pointalign.registration.verdict.verdicts` of B pairs, measured at once.

    The same numbers (``verdict._measure``'s) for all pairs by a few launches instead of
    about twenty per pair: the final poses' three counts by one search through a packed
    index over the targets (one nearest point within the largest bound, its squared
    distance compared with each bound as ``count_inliers_within`` compares it), the
    distinct hypotheses' test over the padded ``(B, k)`` hypotheses; then the same rules
    (``verdict.judged``). The packed search measures distances on shifted coordinates: a
    point within the lattice's float32 rounding (~1e-4 voxel) of a bound may count
    differently than with the pair's own index; the sources' centroids are summed in
    float64 (per pair: ``Tensor.mean`` in float32, then widened), which moves a
    hypothesis' distance from the result by ~1e-7 voxel against the 3-voxel ``distinct``
    bound. One transfer for the group.
    """
    from pointalign.registration.verdict import DISTINCT_ANGLE_DEG, judged

    B = T.shape[0]
    S, n_src = _pad([s.down for s in sources])
    Tg, _ = _pad([t.down for t in targets])
    dev, N = S.device, S.shape[1]
    bounds = (scales.correspondence, scales.fine, scales.overlap)
    index = _packed(Tg, [int(t.down.shape[0]) for t in targets], max(bounds))
    moved = _kr.transform_points(T, S)                                           # (B, N, 3)
    rows = torch.arange(B, device=dev)[:, None].expand(B, N).reshape(-1)
    res = index.nearest_within(moved.reshape(-1, 3), max(bounds), problem=rows)
    real = torch.arange(N, device=dev)[None] < n_src[:, None]
    d2 = torch.where((res.idx[:, 0] >= 0).view(B, N) & real, res.dists[:, 0].view(B, N),
                     math.inf)
    c_out, c_in, c_overlap = ((d2 <= b * b).sum(1) for b in bounds)
    k = [int(h.shape[0]) for h in hypotheses]
    R, _ = _pad([h.reshape(-1, 16) for h in hypotheses])
    fit, _ = _pad([f[:, None] for f in overlaps])
    fit = fit[..., 0]
    kk = torch.arange(R.shape[1], device=dev)[None] < upload(k, dtype=torch.int64,
                                                              device=dev)[:, None]
    R = torch.where(kk[..., None, None], R.view(B, -1, 4, 4),
                    torch.eye(4, dtype=R.dtype, device=dev))                       # (B, k, 4, 4)
    ctr = (S.to(torch.float64).sum(1) / n_src[:, None].to(torch.float64))        # (B, 3)
    moved_c = (R[..., :3, :3] @ ctr[:, None, :, None])[..., 0] + R[..., :3, 3]   # (B, k, 3)
    here = (T[:, :3, :3] @ ctr[..., None])[..., 0] + T[:, :3, 3]
    dR = R[..., :3, :3].transpose(-1, -2) @ T[:, None, :3, :3]
    ang = torch.rad2deg(_rotation_angle(dR))
    other = ((moved_c - here[:, None]).norm(dim=-1) > scales.distinct) \
        | (ang > DISTINCT_ANGLE_DEG)
    second = torch.where(other & kk, fit, torch.zeros_like(fit)).amax(1)
    host = torch.stack([c_overlap, second, c_out, c_in], 1).to(torch.float64).cpu().numpy()
    return judged(host, stability, sources)


def _rotation_angle(R: torch.Tensor) -> torch.Tensor:
    """``transforms.rotation_angle`` of ``R (..., 3, 3)`` (flattened for the call)."""
    from pointalign import transforms

    return transforms.rotation_angle(R.reshape(-1, 3, 3)).view(R.shape[:-2])
