"""Surface normals by PCA of each point's neighbourhood, with a closed-form 3×3 eigen-solve.

For the neighbours q_1..q_k of p (k nearest, or within a radius, or both), the normal is
the eigenvector of the smallest eigenvalue of the covariance
``C = 1/k Σ (q_i − q̄)(q_i − q̄)ᵀ`` (Hoppe et al., "Surface reconstruction from unorganized
points", SIGGRAPH 1992). The symmetric 3×3 eigenproblem is solved in closed form and
batched (:func:`smallest_eigenvector`): eigenvalues by the trigonometric formula for the
roots of the characteristic cubic (O. K. Smith, "Eigenvalues of a symmetric 3×3 matrix",
CACM 1961), the eigenvector as the largest cross product of two rows of ``C − λ I``.
"""

from __future__ import annotations

from typing import Any

import torch

from pointalign import _math, _threads, _validate
from pointalign.kernels import features as _kernels

# the PCA normals' spec (covariance, smallest eigenvector) is the kernel family's reference;
# its covariance stays importable under the old name
from pointalign.kernels.features.reference import (
    neighbour_covariances as _neighbour_covariances,  # noqa: F401
)

#: neighbourhoods per chunk (bounds memory to about chunk × max_neighbors × 3 floats)
_CHUNK = 1 << 18

ORIENTS = ("viewpoint", "majority", None)


# the closed-form 3×3 eigen-solver is the library's one 3×3 solver, in ``pointalign._math``
symmetric_eigenvalues = _math.eigvalsh3
smallest_eigenvector = _math.smallest_eigenvector3
symmetric_eigh3 = _math.eigh3


def check_neighbour_table(idx: Any, n: int, device: torch.device,
                          name: str = "neighbors") -> None:
    """Raise ValueError unless ``idx`` is a valid ``(n, K)`` neighbour table.

    Valid: int64, on ``device``, holding point indices in ``[0, n)`` or ``-1`` (none); the
    range scan (a host synchronisation) is skipped under ``_validate.trusted()``.
    """
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] != n \
            or idx.dtype != torch.int64 or idx.device != device:
        got = (f"{tuple(idx.shape)} {idx.dtype} on {idx.device}"
               if isinstance(idx, torch.Tensor) else type(idx).__name__)
        raise ValueError(f"{name}: expected an ({n}, K) int64 tensor on {device}, got {got}")
    if idx.numel() and not _validate.is_trusted() \
            and not bool(((idx >= -1) & (idx < n)).all()):
        raise ValueError(f"{name}: indices must be in [0, {n}) or -1 (no neighbour)")


@_threads.per_call
@_validate.out_of_memory_is_clear
def estimate_normals(
    points: Any,
    *,
    k: int | None = None,
    radius: float | None = None,
    max_neighbors: int = 30,
    viewpoint: Any = None,
    orient: str | None = "viewpoint",
    index: Any = None,
    neighbors: torch.Tensor | None = None,
    device: str | torch.device | None = None,
) -> Any:
    """Estimate unit normals of a point cloud by PCA of each neighbourhood (Hoppe et al. 1992).

    Neighbourhoods: ``k`` nearest points (``k`` given, no ``radius``); up to
    ``max_neighbors`` nearest within ``radius`` (``radius`` given); both given: up to ``k``
    nearest within ``radius`` (Open3D's hybrid search); neither: ``max_neighbors`` nearest.
    Each neighbourhood includes the point itself. A point with fewer than 3 neighbours has
    an arbitrary unit normal.

    Repeated points count once: where the search finds exact copies (a cloud with every
    point repeated 8 times has 16 nearest that are copies of 2 points, a line, whose normal
    is arbitrary), the neighbourhoods are searched again among the distinct points (the
    same ``k``, ``radius``, ``max_neighbors``; each copy gets its point's normal), so that
    a repeated cloud has the normals of the cloud. Found by comparing each point with its
    two nearest (no extra search where there are no copies). A ``neighbors`` table is used
    as given.

    Orientation (the PCA sign is arbitrary): ``"viewpoint"`` flips each normal to face
    ``viewpoint`` (default the origin, where a scanner sits): ``nᵀ(v − p) >= 0``;
    ``"majority"`` flips every normal to agree with the dominant normal direction (principal
    axis of Σ n nᵀ, signed so that its largest component is positive), for mostly flat
    scenes; ``None`` leaves the signs as computed.

    Args:
        points: ``(N, 3)`` float array/tensor, a PointCloud or an Open3D point cloud.
        k: neighbours per point (>= 3), or None.
        radius: neighbourhood radius (> 0, same units as the points), or None.
        max_neighbors: cap on the radius search (and the default k).
        viewpoint: ``(3,)`` point the normals face with ``orient="viewpoint"``.
        orient: ``"viewpoint"``, ``"majority"`` or None.
        index: an :class:`~pointalign.search.base.Index` built over these points (reused;
            default: ``build_index(points)``).
        neighbors: a precomputed ``(N, K)`` int64 neighbour table (``-1`` = none; e.g. from
            :func:`pointalign.features.fpfh.neighbourhoods`, shared with FPFH); replaces the
            search, so ``k``, ``radius`` and ``index`` are not used.
        device: compute device (default: the points' device for tensors, else cuda when
            available).

    Returns:
        ``(N, 3)`` unit normals in the points' dtype, in the input's kind
        (:func:`pointalign._validate.kind`, as :func:`~pointalign.fpfh`): a NumPy array for
        a NumPy array or an Open3D cloud, a tensor on ``device`` for a tensor or a
        :class:`PointCloud`. ``num_threads``: CPU threads for this call
        (:func:`pointalign.threads`).

    """
    like = _validate.kind(points)
    if isinstance(points, torch.Tensor) and device is None:
        dev = points.device
    else:
        dev = _validate.as_device(device)
    pts = _validate.as_points(points, "points", device=dev)
    n = pts.shape[0]
    _validate.choice(orient, "orient", ORIENTS)
    if k is not None:
        k = _validate.integer(k, "k", minimum=3)
    if radius is not None:
        radius = _validate.positive(radius, "radius")
    max_neighbors = _validate.integer(max_neighbors, "max_neighbors", minimum=3)
    vp = None
    if orient == "viewpoint":
        vp = torch.zeros(3, dtype=pts.dtype, device=dev) if viewpoint is None else \
            _validate._float("viewpoint", _validate._to_tensor("viewpoint", viewpoint),
                             pts.dtype).to(dev).reshape(-1)
        if vp.shape != (3,):
            raise ValueError(f"viewpoint: expected shape (3,), got {tuple(vp.shape)}")
        _validate._check_finite("viewpoint", vp)
    centre_vp = vp if orient == "viewpoint" else None
    if neighbors is not None:
        check_neighbour_table(neighbors, n, dev)
        out = _kernels.pca_normals(pts, neighbors, centre_vp)
    else:
        if index is None:
            from pointalign.search import build_index

            index = build_index(pts)
        elif index.points.shape[0] != n or index.points.device != dev:
            raise ValueError(f"index: built over {index.points.shape[0]} points on "
                             f"{index.points.device}, but points has {n} on {dev}")
        out = torch.empty_like(pts)
        copies = False
        for s in range(0, n, _CHUNK):
            q = pts[s:s + _CHUNK]
            if radius is not None:
                cap = min(k if k is not None else max_neighbors, n)
                res = index.radius(q, radius, cap)
            else:
                res = index.knn(q, min(k if k is not None else max_neighbors, n))
            out[s:s + _CHUNK] = _kernels.pca_normals(pts, res.idx, centre_vp, centers=q)
            copies = copies or (res.idx.shape[1] >= 2
                                 and bool(_kernels.copy_rows(pts, res.idx, q).any()))
        if copies:  # search again among the distinct points; each copy takes its point's
            distinct, inverse = torch.unique(pts, dim=0, return_inverse=True)
            if distinct.shape[0] < n:
                out = estimate_normals(distinct, k=None if k is None else min(
                    k, max(3, distinct.shape[0])), radius=radius, max_neighbors=max_neighbors,
                    viewpoint=vp, orient="viewpoint" if orient == "viewpoint" else None,
                    device=dev)[inverse]
    if orient == "majority":
        S = out.to(torch.float64).transpose(0, 1) @ out.to(torch.float64)
        _, V = torch.linalg.eigh(S)
        d = V[:, -1]
        d = d * torch.sign(d[d.abs().argmax()])
        flip = (out.to(torch.float64) @ d) < 0
        out = torch.where(flip[:, None], -out, out)
    return _validate.as_kind(out, like)
