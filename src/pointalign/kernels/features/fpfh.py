"""FPFH kernels: pair features → SPFH histograms, and the weighted neighbour sum.

Contract (the PyTorch reference here is the CPU path and the spec):

* ``spfh(points (N, 3), normals (N, 3), nbr_idx (N, K) int64) -> (N, 33)``: for each point
  p and each neighbour q (``nbr_idx[i, k] >= 0`` and ``!= i``), the Darboux-frame angles
  (α, φ, θ) of the pair (Rusu et al., ICRA 2009, eqs. 1-2, with Open3D's choice of source
  point and sign) are binned into 11 bins each; each 11-bin histogram sums to 100 (a point
  without neighbours gets zeros).
* ``fpfh_combine(spfh (N, 33), nbr_idx (N, K), nbr_dist_sq (N, K)) -> (N, 33)``:
  ``FPFH(p) = SPFH(p) + Σ_k SPFH(p_k) / ω_k`` with ω_k = ||p − p_k||² (Open3D's weight; the
  neighbour part is scaled so each of its 11-bin histograms sums to 100), then each 11-bin
  histogram rescaled to sum to 100. Neighbours at distance 0 (the point itself, duplicates)
  are skipped.

Both are deterministic (integer bin counts; fixed-order reductions), which RANSAC's
reproducibility needs. On CUDA each is one Triton kernel (``_features_triton``: one lane per
point walks its neighbour row, histogram in registers); on the "cpu" backend a numba loop
per point (``_fpfh_cpu``); the PyTorch references below are the spec. The work is tiny (a
gather and a few dozen flops per pair); what the kernels remove is the dozens of small
PyTorch launches and the chunk loop, which cost milliseconds at a few thousand points.

Pair features, as in Open3D ``ComputePairFeatures`` (p1, n1, p2, n2): d = p2 − p1;
the point whose normal makes the smaller angle with the line is the source (swap and negate
d otherwise; a tie within 16 ulps is never swapped, so rounding cannot flip it);
u = n_s, v = (d × u)/|d × u|, w = u × v;
α = atan2(w·n_t, u·n_t), φ = v·n_t, θ = ±(n·d)/|d|. Bins: α over [−π, π], φ and θ over [−1, 1].
"""

from __future__ import annotations

import math

import torch

from pointalign.kernels._backend import backend

#: bins per angle
BINS = 11
#: neighbour pairs processed per chunk (memory ~ 40 floats per pair)
_CHUNK_PAIRS = 1 << 21


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


def spfh(points: torch.Tensor, normals: torch.Tensor, nbr_idx: torch.Tensor) -> torch.Tensor:
    """Entry point: SPFH histograms ``(N, 33)``; see the module docstring for the contract.

    Args:
        points: ``(N, 3)`` float tensor.
        normals: ``(N, 3)`` unit normals.
        nbr_idx: ``(N, K)`` int64 neighbour indices into points, ``-1`` for none.

    """
    _check(points, normals, nbr_idx)
    if backend(points) in ("triton", "interpret") and nbr_idx.shape[1] > 0:
        from pointalign.kernels.features import triton as _features_triton

        return _features_triton.spfh(points, normals.to(points.dtype), nbr_idx.to(torch.int64))
    if backend(points) == "cpu" and points.dtype in (torch.float32, torch.float64):
        from pointalign.kernels.features import fpfh_cpu as _fpfh_cpu

        return _fpfh_cpu.spfh_cpu(points, normals, nbr_idx)
    return spfh_reference(points, normals, nbr_idx)


def fpfh_combine(spfh_hist: torch.Tensor, nbr_idx: torch.Tensor,
                 nbr_dist_sq: torch.Tensor) -> torch.Tensor:
    """Entry point: FPFH ``(N, 33)`` from SPFH ``(N, 33)`` and the neighbour table.

    Args:
        spfh_hist: ``(N, 33)`` from :func:`spfh`.
        nbr_idx: ``(N, K)`` int64 neighbour indices (``-1`` for none).
        nbr_dist_sq: ``(N, K)`` squared distances (``inf`` for none).

    """
    if nbr_idx.shape != nbr_dist_sq.shape or spfh_hist.shape != (nbr_idx.shape[0], 3 * BINS):
        raise ValueError(
            f"fpfh_combine: shapes spfh {tuple(spfh_hist.shape)}, idx {tuple(nbr_idx.shape)}, "
            f"dists {tuple(nbr_dist_sq.shape)} do not fit (N, 33), (N, K), (N, K)")
    if backend(spfh_hist) in ("triton", "interpret") and nbr_idx.shape[1] > 0:
        from pointalign.kernels.features import triton as _features_triton

        return _features_triton.fpfh_combine(spfh_hist, nbr_idx.to(torch.int64),
                                             nbr_dist_sq.to(spfh_hist.dtype))
    if backend(spfh_hist) == "cpu" and spfh_hist.dtype in (torch.float32, torch.float64):
        from pointalign.kernels.features import fpfh_cpu as _fpfh_cpu

        return _fpfh_cpu.fpfh_combine_cpu(spfh_hist, nbr_idx, nbr_dist_sq)
    return fpfh_combine_reference(spfh_hist, nbr_idx, nbr_dist_sq)


def _check(points: torch.Tensor, normals: torch.Tensor, nbr_idx: torch.Tensor) -> None:
    if points.dim() != 2 or points.shape[1] != 3 or normals.shape != points.shape:
        raise ValueError(f"spfh: points and normals must be (N, 3), got "
                         f"{tuple(points.shape)} and {tuple(normals.shape)}")
    if nbr_idx.dim() != 2 or nbr_idx.shape[0] != points.shape[0]:
        raise ValueError(f"spfh: nbr_idx must be (N, K), got {tuple(nbr_idx.shape)}")
    if points.device != normals.device or points.device != nbr_idx.device:
        raise ValueError("spfh: points, normals and nbr_idx on different devices")
