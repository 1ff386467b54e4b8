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

import math
from typing import Any

import torch

from pointalign import _validate
from pointalign.kernels import features as _kernels

#: neighbourhoods per chunk (bounds memory to about chunk × max_neighbors × 3 floats)
_CHUNK = 1 << 18

ORIENTS = ("viewpoint", "majority", None)


def _cross(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.linalg.cross(a, b, dim=-1)


def symmetric_eigenvalues(A: torch.Tensor) -> torch.Tensor:
    """Eigenvalues ``(…, 3)`` ascending of symmetric ``A (…, 3, 3)``, closed form (Smith 1961).

    With q = tr(A)/3, p = sqrt(tr((A − qI)²)/6), B = (A − qI)/p and φ = acos(det(B)/2)/3,
    the eigenvalues are q + 2p cos(φ + 2πk/3).
    """
    a00, a11, a22 = A[..., 0, 0], A[..., 1, 1], A[..., 2, 2]
    a01, a02, a12 = A[..., 0, 1], A[..., 0, 2], A[..., 1, 2]
    q = (a00 + a11 + a22) / 3
    b00, b11, b22 = a00 - q, a11 - q, a22 - q
    p2 = b00 * b00 + b11 * b11 + b22 * b22 + 2 * (a01 * a01 + a02 * a02 + a12 * a12)
    p = (p2 / 6).sqrt()
    ps = torch.where(p > 0, p, torch.ones_like(p))
    c00, c11, c22 = b00 / ps, b11 / ps, b22 / ps
    c01, c02, c12 = a01 / ps, a02 / ps, a12 / ps
    det = (c00 * (c11 * c22 - c12 * c12) - c01 * (c01 * c22 - c12 * c02)
           + c02 * (c01 * c12 - c11 * c02))
    phi = torch.acos((det / 2).clamp(-1, 1)) / 3
    l_max = q + 2 * p * torch.cos(phi)
    l_min = q + 2 * p * torch.cos(phi + 2 * math.pi / 3)
    l_mid = 3 * q - l_max - l_min
    return torch.stack([l_min, l_mid, l_max], -1)


def _null_vector(A: torch.Tensor, lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit vector spanning the null space of ``A − λI``, and its squared raw norm.

    The vector is the largest cross product of two rows; its squared norm is small when λ is
    not a simple eigenvalue.
    """
    eye = torch.eye(3, dtype=A.dtype, device=A.device)
    Mm = A - lam[..., None, None] * eye
    r0, r1, r2 = Mm[..., 0, :], Mm[..., 1, :], Mm[..., 2, :]
    cands = torch.stack([_cross(r0, r1), _cross(r0, r2), _cross(r1, r2)], -2)
    n2 = (cands * cands).sum(-1)
    best = n2.argmax(-1)
    v = torch.gather(cands, -2, best[..., None, None].expand(*best.shape, 1, 3))[..., 0, :]
    nb = torch.gather(n2, -1, best[..., None])[..., 0]
    return v / nb.clamp_min(1e-300).sqrt()[..., None], nb


def _any_orthogonal(u: torch.Tensor) -> torch.Tensor:
    """A unit vector orthogonal to unit ``u (…, 3)``."""
    ax = torch.zeros_like(u)
    k = u.abs().argmin(-1)
    ax.scatter_(-1, k[..., None], 1.0)
    v = _cross(u, ax)
    return v / v.norm(dim=-1, keepdim=True).clamp_min(1e-300)


def smallest_eigenvector(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit eigenvector of the smallest eigenvalue of symmetric ``A (…, 3, 3)``, closed form.

    Computed in float64. The matrix is first scaled by its largest entry. When the smallest
    eigenvalue is (nearly) repeated the eigenvector is not unique: the result is then a unit
    vector orthogonal to the eigenvector of the largest eigenvalue (any vector when all three
    coincide). Returns ``(vectors (…, 3), eigenvalues (…, 3) ascending)`` in A's dtype.
    """
    dt = A.dtype
    A64 = A.to(torch.float64)
    s = A64.abs().amax((-1, -2))
    s = torch.where(s > 0, s, torch.ones_like(s))
    An = A64 / s[..., None, None]
    lam = symmetric_eigenvalues(An)
    v, nv = _null_vector(An, lam[..., 0])
    gap = (lam[..., 1] - lam[..., 0])
    spread = (lam[..., 2] - lam[..., 0])
    # the largest cross product has norm ~ gap * spread for a simple eigenvalue
    simple = nv > (1e-8 * spread.clamp_min(1e-300)) ** 2
    simple &= gap > 1e-9 * spread.clamp_min(1e-300)
    u, nu = _null_vector(An, lam[..., 2])
    alt = _any_orthogonal(u)
    alt = torch.where((nu > 0)[..., None] & (spread > 0)[..., None], alt,
                      torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64, device=A.device))
    v = torch.where(simple[..., None], v, alt)
    return v.to(dt), (lam * s[..., None]).to(dt)


def symmetric_eigh3(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All eigenpairs of symmetric ``A (…, 3, 3)`` in closed form (no LAPACK/cuSOLVER call).

    Eigenvalues by :func:`symmetric_eigenvalues`; the smallest eigenvector by
    :func:`smallest_eigenvector`, the largest as the null vector of ``A − λ_max I`` made
    orthogonal to it (any orthogonal unit vector when ``λ_max`` is repeated), the middle one
    as their cross product. O(1) memory per matrix, computed in float64.

    Returns:
        ``(eigenvalues (…, 3) ascending, eigenvectors (…, 3, 3))`` in A's dtype; column
        ``j`` is the eigenvector of eigenvalue ``j``; the columns form a rotation (det +1).

    """
    dt = A.dtype
    A64 = A.to(torch.float64)
    s = A64.abs().amax((-1, -2))
    s = torch.where(s > 0, s, torch.ones_like(s))
    An = A64 / s[..., None, None]
    lam = symmetric_eigenvalues(An)
    v0, _ = smallest_eigenvector(An)
    v2, n2 = _null_vector(An, lam[..., 2])
    spread = (lam[..., 2] - lam[..., 0]).clamp_min(1e-300)
    v2 = v2 - (v2 * v0).sum(-1, keepdim=True) * v0
    nrm = v2.norm(dim=-1, keepdim=True)
    simple = (n2 > (1e-8 * spread) ** 2) & (lam[..., 2] - lam[..., 1] > 1e-9 * spread)
    simple &= nrm[..., 0] > 0.5
    v2 = torch.where(simple[..., None], v2 / nrm.clamp_min(1e-300), _any_orthogonal(v0))
    v1 = _cross(v2, v0)
    V = torch.stack([v0, v1, v2], -1)
    return (lam * s[..., None]).to(dt), V.to(dt)


def _neighbour_covariances(pts: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Covariance ``(n, 3, 3)`` of each row's neighbours ``idx (n, k)`` (-1 = none)."""
    valid = idx >= 0
    nb = pts[idx.clamp_min(0)]  # (n, k, 3)
    w = valid.to(pts.dtype)[..., None]
    cnt = w.sum(1).clamp_min(1)
    mean = (nb * w).sum(1) / cnt
    d = (nb - mean[:, None, :]) * w
    return d.transpose(1, 2) @ d / cnt[..., None]


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
) -> torch.Tensor:
    """Unit normals of a point cloud by PCA of each neighbourhood (Hoppe et al. 1992).

    Neighbourhoods: ``k`` nearest points (``k`` given, no ``radius``); up to
    ``max_neighbors`` nearest within ``radius`` (``radius`` given); both given: up to ``k``
    nearest within ``radius`` (Open3D's hybrid search); neither: ``max_neighbors`` nearest.
    Each neighbourhood includes the point itself. A point with fewer than 3 neighbours has
    an arbitrary unit normal.

    Orientation (the PCA sign is arbitrary): ``"viewpoint"`` flips each normal to face
    ``viewpoint`` (default the origin, where a scanner sits): ``nᵀ(v − p) >= 0``;
    ``"majority"`` flips every normal to agree with the dominant normal direction (principal
    axis of Σ n nᵀ, signed so that its largest component is positive), for mostly flat
    scenes; ``None`` leaves the signs as computed.

    Args:
        points: ``(N, 3)`` array, tensor or PointCloud.
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
        ``(N, 3)`` float tensor of unit normals on ``device``, in the points' dtype.

    """
    if isinstance(points, torch.Tensor) and device is None:
        dev = points.device
    else:
        dev = _validate.as_device(device)
    pts = _validate.as_points(points, "points", device=dev)
    n = pts.shape[0]
    if orient not in ORIENTS:
        raise ValueError(f"orient: expected one of {ORIENTS}, got {orient!r}")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 3:
            raise ValueError(f"k: expected an integer >= 3, got {k!r}")
    if radius is not None:
        radius = _validate.positive(radius, "radius")
    if isinstance(max_neighbors, bool) or not isinstance(max_neighbors, int) or max_neighbors < 3:
        raise ValueError(f"max_neighbors: expected an integer >= 3, got {max_neighbors!r}")
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
        for s in range(0, n, _CHUNK):
            q = pts[s:s + _CHUNK]
            if radius is not None:
                cap = min(k if k is not None else max_neighbors, n)
                res = index.radius(q, radius, cap)
            else:
                res = index.knn(q, min(k if k is not None else max_neighbors, n))
            out[s:s + _CHUNK] = _kernels.pca_normals(pts, res.idx, centre_vp, centers=q)
    if orient == "majority":
        S = out.to(torch.float64).transpose(0, 1) @ out.to(torch.float64)
        _, V = torch.linalg.eigh(S)
        d = V[:, -1]
        d = d * torch.sign(d[d.abs().argmax()])
        flip = (out.to(torch.float64) @ d) < 0
        out = torch.where(flip[:, None], -out, out)
    return out
