"""Voxel-grid downsampling: one point per occupied voxel, the centroid of its points.

The space is cut into cubes of edge ``voxel_size`` anchored at the cloud's minimum corner;
each occupied cube ``k = floor((p - p_min) / voxel_size)`` yields the mean of its points
(and the mean of their normals, renormalised, and of their colours). This is PCL's
``VoxelGrid`` and Open3D's ``voxel_down_sample``, as used before FPFH + RANSAC in the
parallel RANSAC paper (5 mm leaf) and Open3D's global-registration tutorial.

Implementation: integer voxel keys, ``torch.unique`` (sort-based) for the occupied cells, a
stable sort of the points by cell, and segment sums taken as differences of a float64
cumulative sum. No atomics, so the result is bit-identical from run to run on a device
(RANSAC's determinism for a fixed seed depends on it). Same code on CPU and GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from pointalign import _validate
from pointalign._ops import exclusive_cumsum_rows
from pointalign.cloud import PointCloud

#: largest number of voxels along one axis (the three keys are packed in one int64)
_MAX_CELLS_PER_AXIS = 1 << 20


def voxel_keys(points: torch.Tensor, voxel_size: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed int64 voxel key of every point and the grid origin.

    Args:
        points: ``(N, 3)`` float tensor.
        voxel_size: cube edge, same units as the points (> 0).

    Returns:
        ``(keys (N,) int64, origin (3,) float64)``; points in one voxel share a key.

    Raises:
        ValueError: the grid would need more than 2**20 voxels along an axis.

    """
    p = points.to(torch.float64)
    origin = p.min(0).values
    cell = torch.floor((p - origin) / voxel_size).to(torch.int64)
    dims = cell.max(0).values + 1
    if bool((dims > _MAX_CELLS_PER_AXIS).any()):
        raise ValueError(
            f"voxel_size: {voxel_size} is too small for this cloud's extent "
            f"({dims.tolist()} voxels per axis, at most {_MAX_CELLS_PER_AXIS})"
        )
    keys = (cell[:, 0] * _MAX_CELLS_PER_AXIS + cell[:, 1]) * _MAX_CELLS_PER_AXIS + cell[:, 2]
    return keys, origin


def count_voxels(points: torch.Tensor, voxel_size: float) -> int:
    """Count the voxels of edge ``voxel_size`` occupied by ``points (N, 3)``."""
    keys, _ = voxel_keys(points, voxel_size)
    return int(torch.unique(keys).numel())


def _segment_mean(values: torch.Tensor, order: torch.Tensor, ends: torch.Tensor,
                  counts: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over consecutive segments of ``values[order]`` (float64 sums).

    ``shift (V, C)`` is subtracted per segment before summing (keeps the float64 cumulative
    sum small, so differences of it stay exact to ~1e-12 of a voxel).
    """
    sorted_vals = values[order].to(torch.float64)
    seg = torch.repeat_interleave(torch.arange(counts.numel(), device=values.device), counts)
    rel = sorted_vals - shift[seg]
    cs = exclusive_cumsum_rows(rel)
    starts = ends - counts
    sums = cs[ends] - cs[starts]
    return shift + sums / counts[:, None].to(torch.float64)


@_validate.out_of_memory_is_clear
def voxel_downsample(cloud: Any, voxel_size: float) -> Any:
    """Replace the points of every occupied voxel by their centroid.

    ``q_v = (1/|V|) Σ_{p ∈ V} p`` for every voxel V of edge ``voxel_size``; normals are
    averaged and renormalised (a voxel whose normals cancel keeps its first normal), colours
    averaged. Other attributes (features, extras) are dropped: recompute them.

    Args:
        cloud: ``(N, 3)`` float tensor / NumPy array, or a :class:`PointCloud`.
        voxel_size: cube edge (> 0), same units as the points (metres by convention).

    Returns:
        A :class:`PointCloud` for a PointCloud input, else an ``(V, 3)`` tensor on the
        input's device with the input's float dtype. Voxels come in increasing key order
        (x-major), so the output is deterministic.

    """
    is_cloud = isinstance(cloud, PointCloud)
    points = _validate.as_points(cloud, "cloud")
    voxel_size = _validate.positive(voxel_size, "voxel_size")
    keys, origin = voxel_keys(points, voxel_size)
    _, inverse, counts = torch.unique(keys, sorted=True, return_inverse=True,
                                      return_counts=True)
    order = torch.argsort(inverse, stable=True)
    ends = torch.cumsum(counts, 0)
    first = order[ends - counts]  # one member of each voxel (the lowest index)
    shift = points[first].to(torch.float64)
    centers = _segment_mean(points, order, ends, counts, shift).to(points.dtype)
    if not is_cloud:
        return centers
    normals = colors = None
    if cloud.normals is not None:
        first_n = cloud.normals[first].to(torch.float64)
        mean_n = _segment_mean(cloud.normals, order, ends, counts,
                               torch.zeros_like(first_n))
        norm = mean_n.norm(dim=1, keepdim=True)
        ok = norm > 1e-12
        normals = torch.where(ok, mean_n / norm.clamp_min(1e-300), first_n)
        normals = normals.to(points.dtype)
    if cloud.colors is not None:
        colors = _segment_mean(cloud.colors, order, ends, counts,
                               torch.zeros(counts.numel(), 3, dtype=torch.float64,
                                           device=points.device)).to(points.dtype)
    return PointCloud(centers, normals=normals, colors=colors)
