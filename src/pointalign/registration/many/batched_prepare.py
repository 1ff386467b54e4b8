"""register_many's global stage, batched: the clouds of a group of pairs prepared at once.

The voxel edges and stray points of the group come from
:mod:`~pointalign.registration.voxel_rule` (register()'s rule, batched); :func:`scaled`:
every cloud divided by its v in one launch.

Then :func:`prepare_many` and :func:`describe_many`: every cloud downsampled by one sort
(:func:`~pointalign.features.downsample.voxel_downsample_many`: each cloud on its own
grid, as alone); one neighbour search for all of them (a
:class:`~pointalign.search.packed.PackedIndex`: each cloud in its own lattice cell, so
each answer is the cloud's own); the normals and FPFH of the concatenation with
neighbour indices into it (per-point kernels: each point's result depends on its own
row only, so it is the per-cloud result wherever the rows agree).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pointalign._ops import divide_like_scalar
from pointalign.features.downsample import voxel_downsample_many
from pointalign.features.fpfh import restrict
from pointalign.kernels import _loop, upload
from pointalign.kernels.features import pca_normals
from pointalign.kernels.features.fpfh import fpfh_combine, spfh
from pointalign.registration.many.batched import _packed, _pad
from pointalign.registration.pipeline import Scales
from pointalign.registration.prepare import FEATURE_NEIGHBOURS, NORMAL_NEIGHBOURS
from pointalign.search.base import KnnResult


def scaled(vs: Sequence[float], clouds: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``[c / v for c, v in zip(clouds, vs)]`` in three launches, bit for bit (one division)."""
    if not clouds:
        return []
    sizes = [int(c.shape[0]) for c in clouds]
    dev = clouds[0].device
    rows = torch.repeat_interleave(torch.arange(len(sizes), device=dev),
                                   upload(sizes, dtype=torch.int64, device=dev),
                                   output_size=sum(sizes))
    return list(torch.split(divide_like_scalar(torch.cat(list(clouds)), vs, rows), sizes))


def describe_many(downs: Sequence[torch.Tensor], scales: Scales
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Describe C downsampled clouds at once (normals, FPFH), as ``prepare_cloud`` does.

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
