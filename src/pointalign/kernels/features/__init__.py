"""Feature kernels: fused PCA normals here, FPFH in :mod:`pointalign.kernels.features.fpfh`.

Contract (the PyTorch reference in ``features/reference.py`` is the spec; the radius
self-query that feeds both is a search: :func:`pointalign.kernels.knn.radius_neighbours`):

* ``pca_normals(points (N, 3), nbr_idx (N, K) int64, viewpoint (3,) | None) -> (N, 3)``:
  unit normal of each neighbourhood (``-1`` = no neighbour) as the smallest eigenvector of
  its covariance (Hoppe et al. 1992), flipped to face ``viewpoint`` when given
  (``nᵀ(v − p) >= 0``). Reference: :func:`pca_normals_reference` (re-exported here;
  covariance in the points' dtype, closed-form eigenvector in float64); the Triton kernel
  does covariance and eigen-solve in float64 in one pass per point; the "cpu" backend a
  numba loop per point (``features/cpu.py``).
* ``copy_rows(points, nbr_idx (Q, K), centers (Q, 3)) -> (Q,) bool``: whether a row's two
  nearest are two other points at its very coordinates (exact copies). Reference:
  :func:`copy_rows_reference`; on Triton one launch.
"""

from __future__ import annotations

import torch

from pointalign.kernels._backend import backend
from pointalign.kernels.features.reference import copy_rows_reference, pca_normals_reference


def pca_normals(points: torch.Tensor, nbr_idx: torch.Tensor,
                viewpoint: torch.Tensor | None = None,
                centers: torch.Tensor | None = None) -> torch.Tensor:
    """Compute unit PCA normals of neighbourhoods (entry point; see the module contract).

    Args:
        points: ``(N, 3)`` float tensor; ``nbr_idx`` indexes it.
        nbr_idx: ``(Q, K)`` int64 neighbour indices (``-1`` = none), one row per normal.
        viewpoint: optional ``(3,)`` point the normals are flipped to face.
        centers: ``(Q, 3)`` points the rows belong to (for the flip); default ``points``
            (then Q = N).

    Returns:
        ``(Q, 3)`` unit normals in the points' dtype.

    """
    c = points if centers is None else centers
    if points.dim() != 2 or points.shape[1] != 3 or nbr_idx.dim() != 2 \
            or c.shape != (nbr_idx.shape[0], 3):
        raise ValueError(f"pca_normals: expected points (N, 3), nbr_idx (Q, K) and centers "
                         f"(Q, 3), got {tuple(points.shape)}, {tuple(nbr_idx.shape)} and "
                         f"{tuple(c.shape)}")
    if backend(points) == "cpu":
        from pointalign.kernels.features import cpu as _features_cpu

        return _features_cpu.pca_normals_cpu(points, nbr_idx, viewpoint, c)
    if backend(points) in ("triton", "interpret"):
        from pointalign.kernels.features import triton as _features_triton

        vp = None if viewpoint is None else viewpoint.to(points.dtype)
        return _features_triton.pca_normals(points, nbr_idx.to(torch.int64),
                                            c.to(points.dtype), vp)
    return pca_normals_reference(points, nbr_idx, viewpoint, centers)


def copy_rows(points: torch.Tensor, nbr_idx: torch.Tensor, centers: torch.Tensor
              ) -> torch.Tensor:
    """Which rows of ``centers (Q, 3)`` have an exact copy among ``points (N, 3)``: ``(Q,)`` bool.

    From their search result ``nbr_idx (Q, K)`` int64 (nearest first, the point itself
    among them, ``-1`` = none; K >= 2): a duplicated point has two neighbours at distance
    0, the first two of its row, whose coordinates then equal its own exactly (compared,
    not the distances: no rounding). No host synchronisation; on Triton one launch.
    """
    if points.dim() != 2 or points.shape[1] != 3 or nbr_idx.dim() != 2 \
            or nbr_idx.shape[1] < 2 or centers.shape != (nbr_idx.shape[0], 3):
        raise ValueError(f"copy_rows: expected points (N, 3), nbr_idx (Q, K >= 2) and centers "
                         f"(Q, 3), got {tuple(points.shape)}, {tuple(nbr_idx.shape)} and "
                         f"{tuple(centers.shape)}")
    if len({points.device, nbr_idx.device, centers.device}) > 1:
        raise ValueError(f"copy_rows: points, nbr_idx and centers must be on one device, got "
                         f"{points.device}, {nbr_idx.device} and {centers.device}")
    if backend(points) in ("triton", "interpret") and nbr_idx.shape[0]:
        from pointalign.kernels.features import triton as _features_triton

        return _features_triton.copy_rows(points.contiguous(),
                                          nbr_idx.to(torch.int64).contiguous(),
                                          centers.to(points.dtype).contiguous())
    return copy_rows_reference(points, nbr_idx, centers)
