"""The plain PyTorch spec of the GICP family, and the constants every backend shares.

Generalized ICP (Segal, Haehnel & Thrun, "Generalized-ICP", RSS 2009) models each point as
a Gaussian: its covariance, estimated from its neighbourhood and **plane-regularised**
(the eigenvalues replaced by ``(ε, 1, 1)``, as Segal et al., Open3D and small_gicp do), says
"this point lies on a plane with normal n". With n the neighbourhood's smallest eigenvector
that covariance is ``C = V diag(ε, 1, 1) Vᵀ = I − (1 − ε) n nᵀ``.

* :func:`covariances_reference`: ``C`` of each neighbourhood (the fallback rule below).
* :func:`gicp_sums_reference`: the Gauss-Newton normal equations of the plane-to-plane
  (Mahalanobis) cost ``Σ w rᵀ M r``, ``r = x − y``, ``M = (Cᵗ + R Cˢ Rᵀ)⁻¹`` in the
  30-wide layout of :mod:`pointalign.kernels.normal_eq` (so its 6×6 solve is reused).
* :func:`voxelize_reference`, :func:`voxel_lookup_reference`: the Gaussian voxel map of
  voxelized GICP (Koide et al., "Voxelized GICP for fast and accurate 3D point cloud
  registration", ICRA 2021) and its look-up: no nearest-neighbour search per iteration.

Everything here computes in float64 and is the CPU path of the ``torch`` backend; the
numba (``cpu.py``) and Triton (``triton.py``) kernels follow the same formulas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from pointalign import _math

#: ε of the plane regularisation: eigenvalues (ε, 1, 1) (Segal et al., small_gicp, Open3D)
PLANE_EPS = 1e-3
#: fewest neighbours (the point included) whose covariance can span a plane; fewer, or a
#: neighbourhood that does not span a plane (:func:`pointalign._math.spans_plane`: one
#: point repeated, collinear points), gets the **fallback covariance I** (isotropic: the
#: point-to-point metric for that point, as small_gicp does for too small neighbourhoods)
MIN_NEIGHBOURS = 3
#: sums per batch entry (the layout of ``normal_eq``: 21 + 6 + 1 + 2)
WIDTH = 30
#: the robust kernels (``_math.ROBUST_KINDS``, in the order of the kernels' KIND code)
KERNELS = _math.ROBUST_KINDS
#: the robust weight reads ``ρ = sqrt(ROBUST_SCALE2 · rᵀ M r)``: with plane-regularised
#: covariances, a point h off a plane shared by source and target has ``rᵀ M r ≈ h² / 2ε``,
#: so ρ ≈ h, the point-to-plane residual (the robust kernel's ``k`` stays in metres)
ROBUST_SCALE2 = 2 * PLANE_EPS

#: the voxels a source point is matched against (:func:`voxel_lookup_reference`)
NEIGHBORHOODS = (1, 7, 27)
#: bits per axis of a voxel key, and the offset that makes cell coordinates non-negative:
#: cells in ``[-2**20, 2**20 - 2]`` along each axis (voxels around the local origin, the
#: target's centroid) have a key
KEY_BITS = 21
KEY_OFFSET = 1 << (KEY_BITS - 1)
#: key of no voxel (padding of a batch's key rows; sorts last)
KEY_PAD = torch.iinfo(torch.int64).max


def _offsets() -> list[tuple[int, int, int]]:
    """List the 27 cell offsets: the cell itself, its 6 face neighbours, then the other 20."""
    rest = [(i, j, k) for i in (-1, 0, 1) for j in (-1, 0, 1) for k in (-1, 0, 1)]
    first = [(0, 0, 0), (-1, 0, 0), (1, 0, 0), (0, -1, 0), (0, 1, 0), (0, 0, -1), (0, 0, 1)]
    return first + [o for o in rest if o not in first]


#: ``OFFSETS[:n]`` are the cells of neighbourhood n (1, 7 or 27)
OFFSETS = _offsets()


# ---- covariances ------------------------------------------------------------------------

def neighbourhood_moments(points: torch.Tensor, nbr_idx: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Covariance ``(Q, 3, 3)`` float64 and count ``(Q,)`` of each row's neighbours.

    ``points (N, 3)``, ``nbr_idx (Q, K)`` int64 (``-1`` = none). Two passes in float64:
    the mean, then ``1/n Σ (q − q̄)(q − q̄)ᵀ``. An empty row has covariance 0.
    """
    valid = nbr_idx >= 0
    nb = points[nbr_idx.clamp_min(0)].to(torch.float64)          # (Q, K, 3)
    w = valid.to(torch.float64)[..., None]
    cnt = w.sum(1)[:, 0]
    mean = (nb * w).sum(1) / cnt.clamp_min(1)[:, None]
    d = (nb - mean[:, None, :]) * w
    return d.transpose(1, 2) @ d / cnt.clamp_min(1)[:, None, None], cnt


def plane_covariance(cov: torch.Tensor, ok: torch.Tensor, eps: float = PLANE_EPS
                     ) -> torch.Tensor:
    """``I − (1 − ε) n nᵀ`` (n: smallest eigenvector of ``cov (…, 3, 3)``) where ``ok``, else I.

    The plane-regularised covariance ``V diag(ε, 1, 1) Vᵀ``, float64 ``(…, 3, 3)``; rows
    that are not ``ok`` get the fallback I. ``ok`` is further restricted to covariances
    that span a plane (:func:`pointalign._math.spans_plane`).
    """
    c = cov.to(torch.float64)
    ok = ok & _math.spans_plane(c)
    n, _ = _math.smallest_eigenvector3(c)
    eye = torch.eye(3, dtype=torch.float64, device=c.device)
    C = eye - (1 - eps) * (n[..., :, None] * n[..., None, :])  # (symmetric bit for bit)
    return torch.where(ok[..., None, None], C, eye.expand_as(C))


def covariances_reference(points: torch.Tensor, nbr_idx: torch.Tensor,
                          eps: float = PLANE_EPS) -> torch.Tensor:
    """Plane-regularised covariance of each neighbourhood (the spec of ``gicp.covariances``).

    ``points (N, 3)``, ``nbr_idx (Q, K)`` int64 (``-1`` = none) → ``(Q, 3, 3)`` in the
    points' dtype: :func:`plane_covariance` of :func:`neighbourhood_moments`, the fallback
    I for fewer than :data:`MIN_NEIGHBOURS` neighbours or a neighbourhood that does not
    span a plane.
    """
    cov, cnt = neighbourhood_moments(points, nbr_idx)
    return plane_covariance(cov, cnt >= MIN_NEIGHBOURS, eps).to(points.dtype)


# ---- the Mahalanobis normal equations ---------------------------------------------------

def sym3_inverse(C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse ``(…, 3, 3)`` and determinant ``(…)`` of symmetric ``C`` by its adjugate.

    ``adj(C) / det(C)`` from the upper triangle (the formula the kernels use, in their
    order: cofactors first, ``det = c00 a00 + c01 a01 + c02 a02``). Meaningful where
    ``det > 0`` (a positive definite C).
    """
    c00, c01, c02 = C[..., 0, 0], C[..., 0, 1], C[..., 0, 2]
    c11, c12, c22 = C[..., 1, 1], C[..., 1, 2], C[..., 2, 2]
    a00 = c11 * c22 - c12 * c12
    a01 = c02 * c12 - c01 * c22
    a02 = c01 * c12 - c02 * c11
    a11 = c00 * c22 - c02 * c02
    a12 = c01 * c02 - c00 * c12
    a22 = c00 * c11 - c01 * c01
    det = c00 * a00 + c01 * a01 + c02 * a02
    adj = torch.stack([torch.stack([a00, a01, a02], -1), torch.stack([a01, a11, a12], -1),
                       torch.stack([a02, a12, a22], -1)], -2)
    safe = torch.where(det > 0, det, torch.ones_like(det))
    return adj / safe[..., None, None], det


def gicp_sums_reference(
    source: torch.Tensor,
    source_cov: torch.Tensor,
    target: torch.Tensor,
    target_cov: torch.Tensor,
    idx: torch.Tensor,
    rotation: torch.Tensor,
    *,
    lengths: torch.Tensor,
    center: torch.Tensor,
    kernel: str = "none",
    scale: float = 1.0,
) -> torch.Tensor:
    """Compute the GICP normal equations of one iteration in float64 (``gicp_sums``'s spec).

    For every valid pair (row i < lengths[b], slot s, j = idx[b, i, s] >= 0):
    ``r = x − y`` (x̃ = x − c, ỹ = y − c), ``C = Cᵗ_j + R Cˢ_i Rᵀ``, ``M = C⁻¹``
    (:func:`sym3_inverse`; a pair with ``det C <= 0`` is skipped), the Mahalanobis error
    ``e = rᵀ M r``, the robust weight ``w = w(sqrt(ROBUST_SCALE2 · e))`` and the Jacobian of
    ``r`` under ``x ↦ exp(ξ) x`` about c, ``J = [−[x̃]×, I]`` (twist ξ = (ω, v)):

    * ``[0:21]`` upper triangle (row-major) of ``Σ w Jᵀ M J``, ``[21:27]`` ``Σ w Jᵀ M r``,
      ``[27]`` ``Σ w e`` (the point-to-plane layout of ``normal_eq``: the same solve);
    * ``[28]`` source rows with at least one valid pair, ``[29]`` the sum over those rows
      of the mean ``||x − y||²`` of their pairs (for fitness and RMSE).

    Args:
        source: ``(B, N, 3)`` moved source points x (rows ``>= lengths[b]`` ignored).
        source_cov: ``(B, N, 3, 3)`` source covariances Cˢ in the source's own frame.
        target: ``(B, M, 3)`` target points (or voxel means) y.
        target_cov: ``(B, M, 3, 3)`` their covariances Cᵗ.
        idx: ``(B, N, S)`` int64 partners of each source row (``-1``: none).
        rotation: ``(B, 3, 3)`` the rotation R of the estimate that moved the source.
        lengths: ``(B,)`` int64 valid source rows.
        center: ``(B, 3)`` centre c of the linearisation.
        kernel: robust kernel name.
        scale: its k (metres, see :data:`ROBUST_SCALE2`).

    Returns:
        ``(B, 30)`` float64 on the input's device.

    """
    f64 = torch.float64
    B, N = source.shape[:2]
    S = idx.shape[2]
    dev = source.device
    c = center.to(f64)
    x = source.to(f64) - c[:, None, :]                                     # (B, N, 3)
    R = rotation.to(f64)
    Cs = R[:, None] @ source_cov.to(f64) @ R[:, None].transpose(-1, -2)    # (B, N, 3, 3)
    rows = torch.arange(N, device=dev)[None, :, None]
    valid = (rows < lengths[:, None, None]) & (idx >= 0)                   # (B, N, S)
    j = torch.where(valid, idx, torch.zeros_like(idx)).reshape(B, N * S)
    y = torch.gather(target, 1, j[..., None].expand(B, N * S, 3)).to(f64).reshape(B, N, S, 3)
    y = y - c[:, None, None, :]
    Ct = torch.gather(target_cov.reshape(B, -1, 9), 1, j[..., None].expand(B, N * S, 9))
    C = Ct.to(f64).reshape(B, N, S, 3, 3) + Cs[:, :, None]
    Minv, det = sym3_inverse(C)
    ok = valid & (det > 0)
    okf = ok.to(f64)
    r = x[:, :, None, :] - y                                                # (B, N, S, 3)
    u = (Minv @ r[..., None])[..., 0]
    e = (r * u).sum(-1).clamp_min(0)
    w = _math.robust_weight((ROBUST_SCALE2 * e).sqrt(), kernel, float(scale)) * okf
    xs = x[:, :, None, :].expand(B, N, S, 3)
    J = torch.cat([-_math.skew(xs), torch.eye(3, dtype=f64, device=dev).expand(B, N, S, 3, 3)],
                  -1)                                                       # (B, N, S, 3, 6)
    wJt = w[..., None, None] * J.transpose(-1, -2)
    H = (wJt @ Minv @ J).sum((1, 2))                                       # (B, 6, 6)
    g = (wJt @ u[..., None])[..., 0].sum((1, 2))
    out = torch.zeros(B, WIDTH, dtype=f64, device=dev)
    out[:, 0:21] = torch.stack([H[:, a, b] for a in range(6) for b in range(a, 6)], 1)
    out[:, 21:27] = g
    out[:, 27] = (w * e).sum((1, 2))
    n_ok = okf.sum(-1)                                                      # (B, N)
    d2 = ((r * r).sum(-1) * okf).sum(-1) / n_ok.clamp_min(1)
    out[:, 28] = (n_ok > 0).to(f64).sum(1)
    out[:, 29] = d2.sum(1)
    return out


# ---- the Gaussian voxel map -------------------------------------------------------------

class VoxelMap(NamedTuple):
    """Target points and covariances aggregated per voxel, for B targets (padded).

    Attributes:
        keys: ``(B, V)`` int64, each target's occupied voxel keys ascending (a voxel with
            integer cell ``(i, j, k) = floor(p / voxel_size)`` has key
            ``((i + O) << 2·KEY_BITS) | ((j + O) << KEY_BITS) | (k + O)``, ``O =
            KEY_OFFSET``), padded with :data:`KEY_PAD`.
        means: ``(B, V, 3)`` mean of each voxel's points (points' dtype; padding 0).
        covariances: ``(B, V, 3, 3)`` mean of their covariances (padding I).
        counts: ``(B, V)`` int64 points per voxel (padding 0).
        voxel_size: the voxel edge (metres); cells are ``floor(p · inv_size)`` with
            ``inv_size = 1 / voxel_size`` in float64 on every backend.

    """

    keys: torch.Tensor
    means: torch.Tensor
    covariances: torch.Tensor
    counts: torch.Tensor
    voxel_size: float

    @property
    def inv_size(self) -> float:
        """``1 / voxel_size`` (float64), the factor every backend's cell computation uses."""
        return 1.0 / self.voxel_size


def cells_of(points: torch.Tensor, inv_size: float) -> torch.Tensor:
    """Integer cells ``floor(p · inv_size)`` ``(…, 3)`` int64, computed in float64."""
    return torch.floor(points.to(torch.float64) * inv_size).to(torch.int64)


def keys_of(cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``(…)`` int64 of integer ``cells (…, 3)``, and whether each cell has one."""
    c = cells + KEY_OFFSET
    top = (1 << KEY_BITS) - 2  # (the all-ones key is KEY_PAD)
    ok = ((c >= 0) & (c <= top)).all(-1)
    c = c.clamp(0, top)
    return (c[..., 0] << (2 * KEY_BITS)) | (c[..., 1] << KEY_BITS) | c[..., 2], ok


def voxelize_reference(points: torch.Tensor, lengths: torch.Tensor, covariances: torch.Tensor,
                       voxel_size: float, counts: list[int] | None = None) -> VoxelMap:
    """Aggregate ``points (B, M, 3)`` (rows ``< lengths[b]``) and ``covariances (B, M, 3, 3)``.

    Each occupied voxel gets the mean of its points (accumulated in float64) and the mean
    of their covariances: the voxel's Gaussian (Koide et al. 2021; as small_gicp and
    fast_gicp, the mean of plane-regularised covariances, each eigenvalue ≥ ε). ``counts``:
    the lengths on the host, when the caller knows them (saves a transfer).
    Raises ValueError when a point lies more than ``2**20`` voxels from the origin.
    """
    B = points.shape[0]
    dt = points.dtype
    inv = 1.0 / float(voxel_size)
    lens = lengths.tolist() if counts is None else [int(c) for c in counts]
    per = []
    for b in range(B):
        p = points[b, :lens[b]]
        key, ok = keys_of(cells_of(p, inv))
        if not bool(ok.all()):
            raise too_small(voxel_size)
        uk, inverse = torch.unique(key, sorted=True, return_inverse=True)
        n = torch.bincount(inverse, minlength=uk.shape[0])
        s = torch.zeros(uk.shape[0], 3, dtype=torch.float64, device=points.device)
        s.index_add_(0, inverse, p.to(torch.float64))
        cs = torch.zeros(uk.shape[0], 9, dtype=torch.float64, device=points.device)
        cs.index_add_(0, inverse, covariances[b, :lens[b]].reshape(-1, 9).to(torch.float64))
        nf = n.to(torch.float64)[:, None]
        per.append((uk, (s / nf).to(dt), (cs / nf).to(dt).reshape(-1, 3, 3), n))
    return padded_map(per, float(voxel_size), points.device, dt)


def too_small(voxel_size: float) -> ValueError:
    """Return the error of a voxel size too small for the cloud's extent (every backend's)."""
    return ValueError(f"voxel_size: {voxel_size} is too small for the target's extent (a "
                      f"point lies more than 2**20 voxels from its centroid)")


def padded_map(per: Sequence[tuple[torch.Tensor, ...]], voxel_size: float, device: torch.device,
               dtype: torch.dtype) -> VoxelMap:
    """Pad B problems' voxels into one :class:`VoxelMap` (V: the largest count, at least 1).

    ``per[b] = (keys (V_b,), means (V_b, 3), covariances (V_b, 3, 3), counts (V_b,))``.
    """
    B = len(per)
    V = max(1, max(u[0].shape[0] for u in per))
    keys = torch.full((B, V), KEY_PAD, dtype=torch.int64, device=device)
    means = torch.zeros(B, V, 3, dtype=dtype, device=device)
    covs = torch.eye(3, dtype=dtype, device=device).repeat(B, V, 1, 1)
    cnt = torch.zeros(B, V, dtype=torch.int64, device=device)
    for b, (uk, mu, cv, n) in enumerate(per):
        v = uk.shape[0]
        keys[b, :v], means[b, :v], covs[b, :v], cnt[b, :v] = uk, mu, cv, n
    return VoxelMap(keys, means, covs, cnt, voxel_size)


_OFFSETS_ON: dict[tuple[str, int], torch.Tensor] = {}


def _offsets_on(device: torch.device, n: int) -> torch.Tensor:
    """``OFFSETS[:n]`` as an ``(n, 3)`` int64 tensor on ``device``, made once per device.

    (Kept: a host-to-device copy may not run inside a CUDA-graph capture, and the
    executor's first, eager step makes it before any capture.)
    """
    key = (str(device), n)
    if key not in _OFFSETS_ON:
        _OFFSETS_ON[key] = torch.tensor(OFFSETS[:n], dtype=torch.int64, device=device)
    return _OFFSETS_ON[key]


def voxel_lookup_reference(points: torch.Tensor, vmap: VoxelMap, neighborhood: int
                           ) -> torch.Tensor:
    """Find the nearest voxel around each of ``points (B, N, 3)``: ``(B, N)`` int64 (-1: none).

    Among the occupied voxels at cells ``floor(p / voxel_size) + OFFSETS[s]``,
    ``s < neighborhood``, the one whose mean is nearest to p (small_gicp's voxel search;
    ties: the first in ``OFFSETS`` order), as its index into ``vmap.keys[b]``. Squared
    distances in float64 as ``(dx² + dy²) + dz²`` of float64 differences, so every
    backend gives exactly these integers.
    """
    B, N = points.shape[:2]
    f64 = torch.float64
    off = _offsets_on(points.device, neighborhood)
    cells = cells_of(points, vmap.inv_size)[:, :, None, :] + off            # (B, N, S, 3)
    key, ok = keys_of(cells)
    flat = key.reshape(B, -1).contiguous()
    pos = torch.searchsorted(vmap.keys, flat).clamp_max(vmap.keys.shape[1] - 1)
    hit = (torch.gather(vmap.keys, 1, pos) == flat) & ok.reshape(B, -1)
    mu = torch.gather(vmap.means, 1, pos[..., None].expand(B, pos.shape[1], 3))
    d = points.to(f64)[:, :, None, :] - mu.to(f64).reshape(B, N, neighborhood, 3)
    d2 = (d[..., 0] * d[..., 0] + d[..., 1] * d[..., 1]) + d[..., 2] * d[..., 2]
    d2 = torch.where(hit.reshape(B, N, neighborhood), d2, torch.full_like(d2, torch.inf))
    best = d2.argmin(-1, keepdim=True)  # the first of equal minima
    found = torch.gather(d2, -1, best)[..., 0] < torch.inf
    v = torch.gather(pos.reshape(B, N, neighborhood), -1, best)[..., 0]
    return torch.where(found, v, torch.full_like(v, -1))
