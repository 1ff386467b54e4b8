"""The spec of the feature family: PCA normals and FPFH, plain PyTorch, with their constants.

The backends (``features/triton.py``, ``features/cpu.py``, ``features/fpfh_cpu.py``) and
the algorithm layer (:mod:`pointalign.features.normals`) import this module, never the
dispatchers (``features/__init__.py``, ``features/fpfh.py``), whose docstrings state the
contracts.

* :func:`neighbour_covariances`, :func:`pca_normals_reference`: the covariance
  ``C = 1/k Σ (q_i − q̄)(q_i − q̄)ᵀ`` of each neighbourhood (in the points' dtype) and its
  smallest eigenvector by the closed-form 3×3 solver
  :func:`pointalign._math.smallest_eigenvector3` (float64 inside), flipped towards a
  viewpoint (Hoppe et al. 1992).
* :func:`pair_features`, :func:`spfh_reference`, :func:`fpfh_combine_reference`, ``BINS``:
  FPFH (Rusu et al., ICRA 2009), see :mod:`pointalign.kernels.features.fpfh`.
"""

from __future__ import annotations

import math

import torch

from pointalign import _math


def neighbour_covariances(pts: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Covariance ``(n, 3, 3)`` of each row's neighbours ``idx (n, k)`` (-1 = none).

    ``pts``: ``(N, 3)`` float tensor indexed by ``idx``; computed in its dtype.
    """
    valid = idx >= 0
    nb = pts[idx.clamp_min(0)]  # (n, k, 3)
    w = valid.to(pts.dtype)[..., None]
    cnt = w.sum(1).clamp_min(1)
    mean = (nb * w).sum(1) / cnt
    d = (nb - mean[:, None, :]) * w
    return d.transpose(1, 2) @ d / cnt[..., None]


def pca_normals_reference(points: torch.Tensor, nbr_idx: torch.Tensor,
                          viewpoint: torch.Tensor | None = None,
                          centers: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference of :func:`pointalign.kernels.features.pca_normals`.

    Args:
        points: ``(N, 3)`` float tensor; ``nbr_idx`` indexes it.
        nbr_idx: ``(Q, K)`` int64 neighbour indices (``-1`` = none), one row per normal.
        viewpoint: optional ``(3,)`` point the normals are flipped to face
            (``nᵀ(v − c) >= 0``).
        centers: ``(Q, 3)`` points the rows belong to (for the flip); default ``points``.

    Returns:
        ``(Q, 3)`` unit normals in the points' dtype.

    """
    out, _ = _math.smallest_eigenvector3(neighbour_covariances(points, nbr_idx))
    if viewpoint is not None:
        c = points if centers is None else centers
        flip = ((viewpoint - c) * out).sum(-1) < 0
        out = torch.where(flip[:, None], -out, out)
    return out


# ---- FPFH --------------------------------------------------------------------------------

#: bins per angle
BINS = 11
#: neighbour pairs processed per chunk (memory ~ 40 floats per pair)
_CHUNK_PAIRS = 1 << 21


def copy_rows_reference(points: torch.Tensor, nbr_idx: torch.Tensor,
                        centers: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch statement of :func:`pointalign.kernels.features.copy_rows`: ``(Q,)`` bool."""
    a, b = nbr_idx[:, 0], nbr_idx[:, 1]
    return (b >= 0) & (a >= 0) & (a != b) \
        & (points[a.clamp_min(0)] == centers).all(-1) & (points[b.clamp_min(0)] == centers).all(-1)


def pair_features(p1: torch.Tensor, n1: torch.Tensor, p2: torch.Tensor,
                  n2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                             torch.Tensor]:
    """Darboux-frame features of point pairs ``(…, 3)`` → ``(alpha, phi, theta, valid)``.

    ``valid`` is False where the pair is degenerate (coincident points, or the line along
    the source normal); those pairs get the features (0, 0, 0), as in Open3D.
    """
    d = p2 - p1
    dist = d.norm(dim=-1)
    safe = dist.clamp_min(1e-30)
    a1 = (n1 * d).sum(-1) / safe
    a2 = (n2 * d).sum(-1) / safe
    # acos is decreasing: acos(|a1|) > acos(|a2|)  <=>  |a1| < |a2|. Ties are common (two
    # points with the same neighbourhood get the same normal) and a tie decided by rounding
    # flips θ's sign, which spreads to every neighbour's FPFH; so within a few ulps of a tie
    # the pair is never swapped, whatever the device's rounding.
    tol = 16 * torch.finfo(d.dtype).eps
    swap = a1.abs() < a2.abs() - tol
    sw = swap[..., None]
    u = torch.where(sw, n2, n1)
    nt = torch.where(sw, n1, n2)
    d = torch.where(sw, -d, d)
    theta = torch.where(swap, -a2, a1)
    v = torch.linalg.cross(d, u, dim=-1)
    vn = v.norm(dim=-1)
    valid = (dist > 0) & (vn > 0)
    v = v / vn.clamp_min(1e-30)[..., None]
    w = torch.linalg.cross(u, v, dim=-1)
    phi = (v * nt).sum(-1)
    alpha = torch.atan2((w * nt).sum(-1), (u * nt).sum(-1))
    zero = torch.zeros_like(alpha)
    return (torch.where(valid, alpha, zero), torch.where(valid, phi, zero),
            torch.where(valid, theta, zero), valid)


def _bin(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    b = torch.floor(BINS * (x - lo) / (hi - lo)).to(torch.int64)
    return b.clamp(0, BINS - 1)


def _rows_per_chunk(k: int) -> int:
    return max(1, _CHUNK_PAIRS // max(k, 1))


def spfh_reference(points: torch.Tensor, normals: torch.Tensor,
                   nbr_idx: torch.Tensor) -> torch.Tensor:
    """Simplified Point Feature Histograms ``(N, 33)`` (PyTorch reference; see module doc)."""
    n, k = nbr_idx.shape
    counts = torch.zeros(n * 3 * BINS, dtype=points.dtype, device=points.device)
    n_nbrs = torch.zeros(n, dtype=points.dtype, device=points.device)
    step = _rows_per_chunk(k)
    for s in range(0, n, step):
        e = min(n, s + step)
        idx = nbr_idx[s:e]
        rows = torch.arange(s, e, device=points.device)
        use = (idx >= 0) & (idx != rows[:, None])
        j = idx.clamp_min(0)
        p1 = points[s:e, None, :].expand(-1, k, -1)
        n1 = normals[s:e, None, :].expand(-1, k, -1)
        alpha, phi, theta, _ = pair_features(p1, n1, points[j], normals[j])
        bins = torch.stack([_bin(alpha, -math.pi, math.pi), BINS + _bin(phi, -1.0, 1.0),
                            2 * BINS + _bin(theta, -1.0, 1.0)], -1)  # (C, K, 3)
        flat = (rows[:, None, None] * (3 * BINS) + bins)[use]
        # integer counts: exact in float32 whatever the order of the atomic adds
        counts.index_add_(0, flat.reshape(-1), torch.ones(flat.numel(), dtype=counts.dtype,
                                                          device=points.device))
        n_nbrs[s:e] = use.sum(1).to(n_nbrs.dtype)
    hist = counts.view(n, 3 * BINS)
    scale = torch.where(n_nbrs > 0, 100.0 / n_nbrs.clamp_min(1), torch.zeros_like(n_nbrs))
    return (hist * scale[:, None]).to(points.dtype)


def _normalise_groups(h: torch.Tensor) -> torch.Tensor:
    """Scale each 11-bin group of ``h (N, 33)`` to sum to 100 (zero groups stay zero)."""
    g = h.view(h.shape[0], 3, BINS)
    s = g.sum(-1, keepdim=True)
    g = torch.where(s > 0, g * (100.0 / s.clamp_min(1e-30)), torch.zeros_like(g))
    return g.reshape(h.shape[0], 3 * BINS)


def fpfh_combine_reference(spfh: torch.Tensor, nbr_idx: torch.Tensor,
                           nbr_dist_sq: torch.Tensor) -> torch.Tensor:
    """FPFH ``(N, 33)`` from SPFH and the neighbour table (PyTorch reference)."""
    n, k = nbr_idx.shape
    out = torch.empty_like(spfh)
    step = _rows_per_chunk(k * 3)
    for s in range(0, n, step):
        e = min(n, s + step)
        idx = nbr_idx[s:e]
        d2 = nbr_dist_sq[s:e].to(spfh.dtype)
        use = (idx >= 0) & (d2 > 0) & torch.isfinite(d2)
        w = torch.where(use, 1.0 / d2.clamp_min(1e-30), torch.zeros_like(d2))
        nb = (w[..., None] * spfh[idx.clamp_min(0)]).sum(1)  # (C, 33), fixed-order sum
        out[s:e] = _normalise_groups(spfh[s:e] + _normalise_groups(nb))
    return out
