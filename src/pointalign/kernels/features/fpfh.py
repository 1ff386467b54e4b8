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
reproducibility needs. On CUDA each is one Triton kernel (``features/triton.py``: one lane
per point walks its neighbour row, histogram in registers); on the "cpu" backend a numba
loop per point (``features/fpfh_cpu.py``); the PyTorch references in
``features/reference.py`` (re-exported here) are the spec. The work is tiny (a
gather and a few dozen flops per pair); what the kernels remove is the dozens of small
PyTorch launches and the chunk loop, which cost milliseconds at a few thousand points.

Pair features, as in Open3D ``ComputePairFeatures`` (p1, n1, p2, n2): d = p2 − p1;
the point whose normal makes the smaller angle with the line is the source (swap and negate
d otherwise; a tie within 16 ulps is never swapped, so rounding cannot flip it);
u = n_s, v = (d × u)/|d × u|, w = u × v;
α = atan2(w·n_t, u·n_t), φ = v·n_t, θ = ±(n·d)/|d|. Bins: α over [−π, π], φ and θ over [−1, 1].
"""

from __future__ import annotations

import torch

from pointalign.kernels._backend import backend
from pointalign.kernels.features.reference import (
    BINS,
    fpfh_combine_reference,
    spfh_reference,
)
from pointalign.kernels.features.reference import pair_features as pair_features


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
