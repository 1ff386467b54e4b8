"""Fast Point Feature Histograms (FPFH), 33 bins per point.

R. B. Rusu, N. Blodow, M. Beetz, "Fast Point Feature Histograms (FPFH) for 3D
Registration", ICRA 2009. For every point p and each neighbour p_k within ``radius``, the
Darboux frame (u = n_p, v = u × (p_k − p)/‖·‖, w = u × v) gives three angles
α = atan2(w·n_k, u·n_k), φ = v·n_k, θ = u·(p_k − p)/‖p_k − p‖ (with Open3D's rule for which
point of the pair is the source). Binning each into 11 bins gives the Simplified PFH;
``FPFH(p) = SPFH(p) + (1/k) Σ_k SPFH(p_k) / ω_k``. Conventions follow Open3D
(``compute_fpfh_feature``): ω_k is the *squared* distance, the neighbourhood is the hybrid
search (at most ``max_neighbors`` nearest points within ``radius``, the point itself
included), and the neighbour part is scaled to sum to 100 per histogram before SPFH(p) is
added. Finally each of the three 11-bin histograms is scaled to sum to 100 (Open3D's values
sum to 200 per histogram, i.e. ours are Open3D's halved; feature-space nearest neighbours
are unchanged by that uniform scale).

The neighbour table comes from :func:`neighbourhoods` (the self-query of :meth:`Index.radius`;
squared distances, ``-1`` = none);
the histograms from :mod:`pointalign.kernels.features.fpfh`. One code path on CPU and GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from pointalign import _threads, _validate
from pointalign.kernels.features import fpfh as _kernels
from pointalign.search.base import KnnResult

#: feature dimension
FPFH_DIM = 33


def neighbourhoods(points: torch.Tensor, radius: float, max_neighbors: int,
                   index: Any) -> KnnResult:
    """Up to ``max_neighbors`` nearest points within ``radius`` of every one of ``points``.

    The self-query ``index.radius(points, radius, max_neighbors)``: ``(N, K)`` squared
    distances ascending and indices (``-1`` = none). Pass the index's own points tensor
    (``index.points``, or the tensor it was built from without a copy): it is not checked
    again, and the brute-force index answers that self-query with the fused radius search,
    which has no cap on K (FPFH's 100 neighbours).

    Args:
        points: ``(N, 3)`` float tensor, the points ``index`` was built over.
        radius: search radius (> 0).
        max_neighbors: K (>= 1).
        index: an :class:`~pointalign.search.base.Index` over ``points``.

    """
    return index.radius(points, radius, max_neighbors)


def restrict(neighbors: KnnResult, radius: float, max_neighbors: int) -> torch.Tensor:
    """Cut neighbourhoods to ``radius`` and at most ``max_neighbors`` each: ``(N, k)``.

    ``neighbors`` must be sorted by distance (as :func:`neighbourhoods` returns them) and
    come from a radius at least ``radius`` and a cap at least ``max_neighbors``; then the
    result equals a search with ``(radius, max_neighbors)`` (up to ties at the cut), so one
    search serves both normals (2v, 30) and FPFH (5v, 100). Returns int64 indices, ``-1`` =
    none.
    """
    k = min(max_neighbors, neighbors.idx.shape[1])
    d, i = neighbors.dists[:, :k], neighbors.idx[:, :k]
    return torch.where(d <= radius * radius, i, torch.full_like(i, -1))


@_threads.per_call
@_validate.out_of_memory_is_clear
def fpfh(
    cloud_or_points: Any,
    *,
    radius: float,
    max_neighbors: int = 100,
    normals: Any = None,
    index: Any = None,
    neighbors: KnnResult | None = None,
    device: str | torch.device | None = None,
) -> Any:
    """33-bin FPFH descriptors of every point (Rusu et al. 2009, Open3D's conventions).

    Args:
        cloud_or_points: ``(N, 3)`` float tensor / NumPy array, a :class:`PointCloud` or an
            Open3D point cloud (a cloud's normals are used when ``normals`` is None).
        radius: neighbourhood radius (same units as the points); Open3D's tutorial uses
            5 × the voxel size of the downsampled cloud.
        max_neighbors: at most this many nearest points within ``radius`` (the point
            itself included), as Open3D's ``KDTreeSearchParamHybrid(radius, max_nn)``.
        normals: ``(N, 3)`` unit normals; when neither this nor the cloud has normals they
            are estimated with :func:`pointalign.features.normals.estimate_normals`
            (radius ``radius / 2.5``, i.e. 2 × voxel when radius = 5 × voxel), oriented
            towards the cloud's centroid.
        index: optional prebuilt :class:`~pointalign.search.base.Index` over these very
            points (reused, e.g. from normal estimation); default builds one.
        neighbors: the precomputed neighbourhoods ``(dists_sq (N, K), idx (N, K))`` of
            :func:`neighbourhoods` for this radius and cap (replaces the search).
        device: compute device (default: the inputs' device, which must be one: the
            points', the normals' and the index's).

        num_threads: CPU threads for this call (:func:`pointalign.threads`).

    Returns:
        ``(N, 33)`` float [α bins | φ bins | θ bins], each 11-bin histogram summing to 100
        (zeros for a point with no neighbour in ``radius``), in the input's kind
        (:func:`pointalign._validate.kind`): NumPy for a NumPy array or an Open3D cloud, a
        tensor on ``device`` for a tensor or a PointCloud.

    """
    dev = _validate.resolve_device(device, cloud_or_points=cloud_or_points, normals=normals,
                                   index=index)
    points = _validate.as_points(cloud_or_points, "cloud_or_points", device=dev)
    if points.dtype != torch.float32 and points.dtype != torch.float64:
        points = points.float()
    radius = _validate.positive(radius, "radius")
    max_neighbors = _validate.integer(max_neighbors, "max_neighbors", minimum=2)
    like = _validate.kind(cloud_or_points)
    if normals is None:
        normals = _validate.cloud_normals(cloud_or_points)
    if index is None and neighbors is None:
        from pointalign.search import build_index

        index = build_index(points)
    if neighbors is None:
        nbr = neighbourhoods(points, radius, min(max_neighbors, points.shape[0]), index)
    elif not isinstance(neighbors, KnnResult):
        raise ValueError(f"neighbors: expected a KnnResult (dists, idx), got "
                         f"{type(neighbors).__name__}")
    else:
        from pointalign.features.normals import check_neighbour_table

        check_neighbour_table(neighbors.idx, points.shape[0], points.device, "neighbors.idx")
        nbr = neighbors
    if normals is None:
        from pointalign.features.normals import estimate_normals

        # facing the cloud's centroid: a sign convention that moves with the cloud, so the
        # descriptors are invariant to a rigid motion of it; neighbourhoods within
        # radius / 2.5 (30 at most), cut from the FPFH ones when those hold 30
        table = restrict(nbr, radius / 2.5, 30) if nbr.idx.shape[1] >= 30 else None
        normals = estimate_normals(points, radius=radius / 2.5, max_neighbors=30, index=index,
                                   neighbors=table, orient="viewpoint",
                                   viewpoint=points.mean(0))
    normals = _validate.as_vectors(normals, "normals", points.shape[0], device=points.device,
                                   dtype=points.dtype)
    hist = _kernels.spfh(points, normals, nbr.idx)
    return _validate.as_kind(_kernels.fpfh_combine(hist, nbr.idx, nbr.dists), like)
