"""register_many's global stage, batched: the clouds of a group of pairs prepared at once.

:func:`voxel_sizes`: the voxel edge v and the stray decision of every pair
(``pipeline._voxel_size``'s rule and results, bit for bit on the CPU backends) with one
voxel count per round of the edge rule, one stray search for the whole group and, for the
pairs that show strays, ``robust_voxel_size`` of all of them at once
(:func:`~pointalign.features.outliers.robust_voxel_sizes_many`); :func:`without_strays_many`:
their dense points (``pipeline._without_strays``: the same masks); :func:`scaled`: every
cloud divided by its v in one launch.

Then :func:`prepare_many` and :func:`describe_many`: every cloud downsampled by one sort
(:func:`~pointalign.features.downsample.voxel_downsample_many`: each cloud on its own
grid, as alone); one neighbour search for all of them (a
:class:`~pointalign.search.packed.PackedIndex`: each cloud in its own lattice cell, so
each answer is the cloud's own); the normals and FPFH of the concatenation with
neighbour indices into it (per-point kernels: each point's result depends on its own
row only, so it is the per-cloud result wherever the rows agree).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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
from pointalign.kernels import _loop
from pointalign.kernels.features import pca_normals
from pointalign.kernels.features.fpfh import fpfh_combine, spfh
from pointalign.registration.many.batched import _packed, _pad
from pointalign.registration.options import Options as _Options
from pointalign.registration.pipeline import FEATURE_NEIGHBOURS, NORMAL_NEIGHBOURS, Scales
from pointalign.search.base import KnnResult

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
