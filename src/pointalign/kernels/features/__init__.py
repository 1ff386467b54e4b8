"""Feature kernels: capped fixed-radius neighbour tables and fused PCA normals.

Contracts (the PyTorch references here are the CPU path and the spec):

* ``radius_neighbours(points (N, 3), radius, k) -> (dists_sq (N, k), idx (N, k) int64)``:
  the self-query of :meth:`~pointalign.search.base.Index.radius` by brute force: for every
  point, up to ``k`` nearest points (itself included) within ``radius``, ascending by
  (distance, index), padded with ``inf`` / ``-1``. Reference:
  :func:`pointalign.kernels.knn.knn_tiles`. The Triton path (any ``k``, where the Triton kNN
  kernel stops at 32) collects every point within the radius into a table in index order
  (one kernel, one host check of the largest count), then a stable sort by distance keeps
  the ``k`` nearest, smallest indices first among equal distances.
* ``pca_normals(points (N, 3), nbr_idx (N, K) int64, viewpoint (3,) | None) -> (N, 3)``:
  unit normal of each neighbourhood (``-1`` = no neighbour) as the smallest eigenvector of
  its covariance (Hoppe et al. 1992), flipped to face ``viewpoint`` when given
  (``nᵀ(v − p) >= 0``). Reference: :func:`pca_normals_reference` (covariance in the
  points' dtype, closed-form eigenvector in float64); the Triton kernel does covariance and
  eigen-solve in float64 in one pass per point.
"""

from __future__ import annotations

import math

import torch

from pointalign.kernels._backend import backend

#: largest neighbour table (rows × slots) the Triton radius search allocates; beyond it the
#: tiled kNN path is used
_MAX_TABLE_ENTRIES = 1 << 26


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def radius_neighbours(points: torch.Tensor, radius: float,
                      k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``k`` nearest points within ``radius`` of every point (entry point).

    Args:
        points: ``(N, 3)`` float tensor (queries and data: a self-query).
        radius: search radius (> 0, not squared).
        k: neighbours kept per point (>= 1).

    Returns:
        ``(dists_sq (N, k), idx (N, k) int64)``, see the module contract.

    """
    if points.dim() != 2 or points.shape[1] != 3:
        raise ValueError(f"radius_neighbours: points must be (N, 3), got {tuple(points.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"radius_neighbours: k must be an integer >= 1, got {k!r}")
    r2 = float(radius) ** 2
    n = points.shape[0]
    be = backend(points)
    cap = max(_pow2(k), 64)
    if be in ("triton", "interpret") and n and n * cap <= _MAX_TABLE_ENTRIES:
        from pointalign.kernels.features import triton as _features_triton

        d, i, count = _features_triton.radius_table(points, r2, cap)
        widest = int(count.max())  # the one host check
        if widest > cap:
            cap = _pow2(widest)
            if n * cap <= _MAX_TABLE_ENTRIES:
                d, i, _ = _features_triton.radius_table(points, r2, cap)
        if widest <= cap and n * cap <= _MAX_TABLE_ENTRIES:
            d, order = torch.sort(d, dim=1, stable=True)  # index order breaks ties
            i = i.gather(1, order)
            if k <= cap:
                return d[:, :k].contiguous(), i[:, :k].contiguous()
            return (torch.cat([d, d.new_full((n, k - cap), math.inf)], 1),
                    torch.cat([i, i.new_full((n, k - cap), -1)], 1))
    if be == "cpu" and n:
        from pointalign.kernels.knn.cpu import CpuTree

        dn, inn = CpuTree(points.detach().contiguous().numpy()).knn(
            points.detach().contiguous().numpy(), min(k, n), r2)
        d, i = torch.from_numpy(dn), torch.from_numpy(inn)
        if k > n:
            d = torch.cat([d, d.new_full((n, k - n), math.inf)], 1)
            i = torch.cat([i, i.new_full((n, k - n), -1)], 1)
        return d, i
    from pointalign.kernels.knn import knn_tiles

    return knn_tiles(points, points, k, r2)


def pca_normals_reference(points: torch.Tensor, nbr_idx: torch.Tensor,
                          viewpoint: torch.Tensor | None = None,
                          centers: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference of :func:`pca_normals` (the formulas of ``features.normals``)."""
    from pointalign.features.normals import _neighbour_covariances, smallest_eigenvector

    out, _ = smallest_eigenvector(_neighbour_covariances(points, nbr_idx))
    if viewpoint is not None:
        c = points if centers is None else centers
        flip = ((viewpoint - c) * out).sum(-1) < 0
        out = torch.where(flip[:, None], -out, out)
    return out


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
