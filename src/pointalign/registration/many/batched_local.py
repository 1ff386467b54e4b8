"""register_many's local stages, batched: the per-pair work of a whole group at once.

For the local stages on a GPU (:func:`.batched.batched_local`): :func:`refine_many`
(the coarse stage's counts and rankings), :func:`final_clouds_many` (the final ICP's
clouds and target normals, through :func:`normals_many`), :func:`verdicts_many` (the
verdict's numbers): each a few launches for the whole group, within the packed search's
rounding of the per-pair counts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pointalign.kernels import _loop, upload
from pointalign.kernels import ransac as _kr
from pointalign.kernels.features import copy_rows, pca_normals
from pointalign.registration._edge import StopReason
from pointalign.registration.criteria import ConvergenceCriteria
from pointalign.registration.icp import icp
from pointalign.registration.many.batched import _packed, _pad, _score, index_of, indexes_of
from pointalign.registration.many.batched_prepare import _facing, scaled
from pointalign.registration.pipeline import (
    FULL_NORMAL_NEIGHBOURS,
    REFINE_TOP,
    FinalClouds,
    Scales,
    _batch,
)
from pointalign.registration.prepare import Prepared


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
    """``pipeline._final_clouds(src / v, tgt / v, scales, None, refine)`` of B pairs.

    The full clouds of every pair divided by its v in one launch
    (:func:`.batched_prepare.scaled`: the same division, bit for bit); each target's index
    as per pair (:func:`.batched.indexes_of`: brute force on a GPU, no build); the targets'
    normals (``refine="point_to_plane"``) of all pairs by :func:`normals_many`.
    ``scales.normal_radius``: the radius of every pair (one number of voxels).
    """
    both = scaled([v for v in vs for _ in (0, 1)], [x for p in zip(sources, targets,
                                                                    strict=True) for x in p])
    srcs, tgts = both[0::2], both[1::2]
    normals: list[torch.Tensor | None] = [None] * len(tgts)
    if refine != "gicp":
        normals = list(normals_many(tgts, scales.normal_radius, FULL_NORMAL_NEIGHBOURS))
    return [FinalClouds(s, t, i, nt)
            for s, t, i, nt in zip(srcs, tgts, indexes_of(tgts), normals, strict=True)]


def normals_many(clouds: Sequence[torch.Tensor], radius: float, k: int) -> list[torch.Tensor]:
    """Estimate the normals of C clouds at once, as ``estimate_normals`` does per cloud.

    Per cloud c: ``estimate_normals(c, k=min(k, n), radius=radius, orient="viewpoint",
    viewpoint=c.mean(0))``.
    One radius search for all clouds (a :class:`~pointalign.search.packed.PackedIndex`:
    each cloud's own points; at most ``min(k, n_c)`` of them, nearest first), the PCA
    normal kernel once over the concatenation, each normal facing its cloud's centroid
    (:func:`.batched_prepare._facing`). The packed search measures distances on shifted
    coordinates: a neighbour within the lattice's float32 rounding of the radius, or a
    near-tie for the k-th place, may differ from the cloud's own search (that row's normal
    then moves slightly); a normal lying almost across the direction to the centroid may
    face the other way (the centroid summed differently). A cloud holding duplicated points (the
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
    if gidx.shape[1] >= 2:  # estimate_normals' check for copies, every cloud, one transfer
        same = copy_rows(points, gidx, points)
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
