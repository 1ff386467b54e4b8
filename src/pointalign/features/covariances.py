"""Per-point covariances for generalized ICP, plane-regularised.

Each point's covariance is estimated from its k nearest neighbours (the point included) and
regularised to a plane: with ``C = V diag(λ₁, λ₂, λ₃) Vᵀ`` (λ₁ ≤ λ₂ ≤ λ₃) the eigenvalues
are replaced by ``(ε, 1, 1)``, so ``C = I − (1 − ε) n nᵀ`` with n the smallest eigenvector
(the PCA normal): "this point lies on a surface with normal n" (Segal, Haehnel & Thrun,
"Generalized-ICP", RSS 2009; the regularisation of Open3D's and small_gicp's GICP, ε =
1e-3). A neighbourhood of fewer than 3 points, or one that does not span a plane (one point
repeated, collinear points: :func:`pointalign._math.spans_plane`), gets the fallback
covariance ``I`` (isotropic); never NaN.

The covariance, the degeneracy test, the eigen-solve and the regularisation run in one pass
over the neighbour table (:func:`pointalign.kernels.gicp.covariances`), which may be the
table the normals use (``neighbors=``).
"""

from __future__ import annotations

from typing import Any

import torch

from pointalign import _threads, _validate
from pointalign.features.normals import check_neighbour_table
from pointalign.kernels import gicp as _kernels

#: neighbourhoods per chunk (bounds the neighbour table to about chunk × k indices)
_CHUNK = 1 << 18

#: the default neighbourhood size (small_gicp's and Open3D's GICP examples use 20)
DEFAULT_K = 20



@_threads.per_call
@_validate.out_of_memory_is_clear
def estimate_covariances(
    points: Any,
    k: int = DEFAULT_K,
    *,
    eps: float = _kernels.PLANE_EPS,
    index: Any = None,
    neighbors: torch.Tensor | None = None,
    device: str | torch.device | None = None,
) -> Any:
    """Estimate plane-regularised covariances ``I − (1 − ε) n nᵀ`` from k nearest neighbours.

    Args:
        points: ``(N, 3)`` array, tensor or PointCloud (metres), with ``N >= k``.
        k: neighbours per point, the point included (>= 3).
        eps: the regularisation ε in (0, 1]: eigenvalues ``(ε, 1, 1)`` (default 1e-3).
        index: an :class:`~pointalign.search.base.Index` built over these points (reused: a
            :class:`~pointalign.search.kdtree.KDTreeIndex`'s tree is self-queried in its own
            order, :func:`pointalign.kernels.gicp.knn_covariances`; default: the kernel
            layer's own search, numba's fused search and reduction on the CPU and on a GPU
            a k-d tree build, self-query and reduction replayed as one CUDA graph per size
            class (up to 2^19 points), else ``build_index(points)``; the same neighbours
            either way, up to ties).
        neighbors: a precomputed ``(N, K)`` int64 neighbour table (``-1`` = none), e.g. the
            one the normals were estimated from; replaces the search (``k`` and ``index``
            are then not used).
        device: compute device (default: the points' device for tensors, else cuda when
            available).

        num_threads: CPU threads for this call (:func:`pointalign.threads`).

    Returns:
        ``(N, 3, 3)`` symmetric positive definite covariances in the points' dtype (the
        fallback I where a neighbourhood is too small or degenerate, see the module
        docstring), in the input's kind (:func:`pointalign._validate.kind`): NumPy for a
        NumPy array or an Open3D cloud, a tensor on ``device`` for a tensor or a
        PointCloud (keep them with the cloud: ``cloud.replace(covariances=C)``, which
        :func:`~pointalign.gicp` then reuses).

    Raises:
        ValueError: fewer than k points, k < 3, ε outside (0, 1], NaN/Inf points, an index
            or neighbour table that does not match the points.

    """
    like = _validate.kind(points)
    if isinstance(points, torch.Tensor) and device is None:
        dev = points.device
    else:
        dev = _validate.as_device(device)
    pts = _validate.as_points(points, "points", device=dev)
    n = pts.shape[0]
    eps = _validate.in_range(eps, "eps", 0.0, 1.0, high_closed=True)
    if neighbors is not None:
        check_neighbour_table(neighbors, n, dev)
        return _validate.as_kind(_kernels.covariances(pts, neighbors, eps), like)
    k = _validate.integer(k, "k", minimum=3)
    if n < k:
        raise ValueError(f"points: {n} points, fewer than k = {k} neighbours per covariance; "
                         "pass a smaller k")
    if index is None:
        fused = _kernels.knn_covariances(pts, k, eps)  # numba: search and reduction fused
        if fused is not None:
            return _validate.as_kind(fused, like)
        from pointalign.search import build_index

        index = build_index(pts)  # brute force for small clouds, else a k-d tree
    elif index.points.shape[0] != n or index.points.device != dev:
        raise ValueError(f"index: built over {index.points.shape[0]} points on "
                         f"{index.points.device}, but points has {n} on {dev}")
    tree = getattr(index, "arrays", None)
    if tree is not None:  # a k-d tree: asked in its own order
        asked = _kernels.knn_covariances(pts, k, eps, tree=tree)
        if asked is not None:
            return _validate.as_kind(asked, like)
    out = torch.empty(n, 3, 3, dtype=pts.dtype, device=dev)
    for s in range(0, n, _CHUNK):
        q = pts[s:s + _CHUNK]
        with _validate.trusted():
            nb = index.knn(q, k).idx
        out[s:s + _CHUNK] = _kernels.covariances(pts, nb, eps)
    return _validate.as_kind(out, like)
