"""Outlier removal: radius (isolated points) and statistical (far from their neighbours).

* :func:`radius_outlier_mask`: a point is kept when at least ``min_neighbors`` other points
  lie within ``radius`` of it (PCL's ``RadiusOutlierRemoval``, Open3D's
  ``remove_radius_outlier``). At a voxel-downsampled cloud's own scale (radius 1.5 voxels)
  every point of a sampled surface has several neighbours, while a stray point in empty
  space has none: this is the rule :func:`pointalign.register` applies by default.
* :func:`statistical_outlier_mask`: the mean distance of each point to its ``neighbors``
  nearest points is compared with the cloud's mean and standard deviation of that
  quantity; points beyond ``mean + std_ratio · std`` are dropped (Rusu et al. 2008; PCL's
  ``StatisticalOutlierRemoval``, Open3D's ``remove_statistical_outlier``).

Both take their neighbours from a :class:`~pointalign.search.base.Index` (built on the
points' device when none is given), so they run on the GPU through the same code as on the
CPU. They return a boolean mask; ``points[mask]`` is the cleaned cloud.
"""

from __future__ import annotations

from typing import Any

import torch

from pointalign import _validate


def _index(points: torch.Tensor, index: Any) -> Any:
    if index is not None:
        return index
    from pointalign.search import build_index

    return build_index(points)


def neighbour_counts(index: Any, queries: torch.Tensor, radius: float, cap: int
                     ) -> torch.Tensor:
    """Count the indexed points within ``radius`` of each query, up to ``cap``: ``(Q,)`` int.

    ``queries (Q, 3)`` on the index's device; a query that is itself an indexed point counts
    itself (subtract 1 for "other points"). One ``radius`` search with ``cap`` columns.
    """
    return (index.radius(queries, radius, cap).idx >= 0).sum(1)


@_validate.out_of_memory_is_clear
def radius_outlier_mask(points: Any, radius: float, min_neighbors: int = 2, *,
                        index: Any = None, device: str | torch.device | None = None
                        ) -> torch.Tensor:
    """Tell which points have at least ``min_neighbors`` other points within ``radius``.

    Args:
        points: ``(N, 3)`` float tensor / array.
        radius: search radius (> 0), same units as the points.
        min_neighbors: other points needed within ``radius`` (>= 1).
        index: optional prebuilt :class:`~pointalign.search.base.Index` over ``points``.
        device: compute device (default: the points').

    Returns:
        ``(N,)`` bool tensor on the device, True = keep.

    """
    dev = _validate.as_device(device, points if isinstance(points, torch.Tensor) else None)
    pts = _validate.as_points(points, "points", device=dev)
    r = _validate.positive(radius, "radius")
    min_neighbors = _validate.integer(min_neighbors, "min_neighbors", minimum=1)
    k = min(min_neighbors + 1, pts.shape[0])  # the point itself is its own first neighbour
    return neighbour_counts(_index(pts, index), pts, r, k) >= min_neighbors + 1


@_validate.out_of_memory_is_clear
def statistical_outlier_mask(points: Any, neighbors: int = 16, std_ratio: float = 2.0, *,
                             index: Any = None, device: str | torch.device | None = None
                             ) -> torch.Tensor:
    """Tell which points lie no farther than usual from their ``neighbors`` nearest points.

    ``m_i`` = mean distance of point i to its ``neighbors`` nearest other points; a point is
    kept when ``m_i <= mean(m) + std_ratio · std(m)``.

    Args:
        points: ``(N, 3)`` float tensor / array, N >= 2.
        neighbors: k (>= 1).
        std_ratio: threshold in standard deviations (> 0).
        index: optional prebuilt :class:`~pointalign.search.base.Index` over ``points``.
        device: compute device (default: the points').

    Returns:
        ``(N,)`` bool tensor on the device, True = keep.

    """
    dev = _validate.as_device(device, points if isinstance(points, torch.Tensor) else None)
    pts = _validate.as_points(points, "points", min_points=2, device=dev)
    neighbors = _validate.integer(neighbors, "neighbors", minimum=1)
    ratio = _validate.positive(std_ratio, "std_ratio")
    k = min(neighbors + 1, pts.shape[0])
    nb = _index(pts, index).knn(pts, k)
    d = nb.dists[:, 1:].clamp_min(0).sqrt().to(torch.float64)  # column 0: the point itself
    m = d.mean(1)
    return m <= m.mean() + ratio * m.std(unbiased=False)
