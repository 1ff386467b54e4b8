"""The stability probe: point-to-plane information of a final pose's sampled correspondences.

Contract (the PyTorch spec is :func:`.reference.probe_information_reference`; the Triton
kernel in ``triton.py`` fuses it into one pass; :func:`pointalign.kernels.backend` picks;
:func:`neighbourhood_information` is its second half, for searches an index made):

``probe_information(source, rows, valid, transform, target, target_counts, center,
max_distance_sq, k) -> (B, 23) float64`` on the inputs' device, by brute force:

* ``source (B, N, 3)``: float32, the problems' source points; ``rows (B, S)`` int64 the
  sampled rows, ``valid (B, S)`` bool (False: padding); ``transform (B, 4, 4)`` float32,
  each problem's final pose (x = R s + t).
* ``target (Bt, M, 3)`` float32 with ``target_counts (Bt,)`` int64 valid rows; ``Bt`` is
  ``B``, or 1 for a target shared by every problem.
* each moved sample x finds its nearest target point y within ``max_distance_sq`` (a
  float, or a one-element device tensor, read on the device; none within: not counted),
  y's ``k`` nearest target points (itself included; ties by index, ``-1`` missing) give a
  scatter matrix, the library's degeneracy rule
  (:func:`pointalign._math.spans_plane`) says whether it spans a plane, and if it does its
  smallest eigenvector n (:func:`pointalign._math.smallest_eigenvector3`'s rules) adds
  ``J Jᵀ`` with ``J = [(y − c) × n, n]``, ``c = center[b]`` (float64).

Output row b: ``[0:21]`` the upper triangle of ``Σ J Jᵀ`` in
:data:`pointalign.kernels.normal_eq.TRIU6` order (float64 sums), ``[21]`` the samples
counted, ``[22]`` the samples whose neighbourhood spans no plane (not counted: the
caller looks again with more neighbours, see
:func:`pointalign.registration.stability.point_information`). The Triton kernel sums each
block of rows in float64 and the blocks in float64 (one sum launch); the reference
computes in float64 from the same float32 points.
"""

from __future__ import annotations

import torch

from pointalign.kernels._backend import backend
from pointalign.kernels.normal_eq.reference import _SYM6
from pointalign.kernels.stability.reference import probe_information_reference

#: the output's width: 21 upper-triangle sums, the counted and the flat samples
WIDTH = 23


def probe_runs_on_device(points: torch.Tensor, k: int) -> bool:
    """Whether :func:`probe_information` over ``points``' device is device work alone.

    True where it is one Triton launch and a sum, with no host reads or transfers, so a
    captured device program may run it (:mod:`pointalign.registration.soft_programs`); the
    reference reads the counts on the host.
    """
    return backend(points) == "triton" and 1 <= k <= 32


def probe_information(source: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor,
                      transform: torch.Tensor, target: torch.Tensor,
                      target_counts: torch.Tensor, center: torch.Tensor,
                      max_distance_sq: float | torch.Tensor, k: int) -> torch.Tensor:
    """Sum each problem's sampled point-to-plane information (entry point; module contract).

    Returns ``(B, 23)`` float64 on the inputs' device.
    """
    B, S = rows.shape
    if source.dim() != 3 or target.dim() != 3 or target.shape[0] not in (1, B) \
            or valid.shape != (B, S) or transform.shape != (B, 4, 4) or center.shape != (B, 3):
        raise ValueError(f"probe_information: expected source (B, N, 3), rows/valid (B, S), "
                         f"transform (B, 4, 4), target (B or 1, M, 3), center (B, 3); got "
                         f"{tuple(source.shape)}, {tuple(rows.shape)}, {tuple(valid.shape)}, "
                         f"{tuple(transform.shape)}, {tuple(target.shape)}, "
                         f"{tuple(center.shape)}")
    if backend(source) in ("triton", "interpret") and 1 <= k <= 32:
        from pointalign.kernels.stability import triton as _triton

        return _triton.probe_information(source, rows, valid, transform, target,
                                         target_counts, center, max_distance_sq, k)
    return probe_information_reference(source, rows, valid, transform, target, target_counts,
                                       center, max_distance_sq, k)


def neighbourhood_fused(table: torch.Tensor) -> bool:
    """Whether :func:`neighbourhood_information` measures over ``table`` (else None)."""
    return backend(table) in ("triton", "interpret") and table.dtype == torch.float32


def neighbourhood_information(table: torch.Tensor, nearest: torch.Tensor,
                              neighbours: torch.Tensor, center: torch.Tensor
                              ) -> torch.Tensor | None:
    """Measure the probe's information where a search index found the neighbours.

    Args:
        table: ``(R, 3)`` float32 rows (one target, or B targets packed).
        nearest: ``(B, S)`` int64, each sample's nearest row of ``table`` (-1: none, not
            counted).
        neighbours: ``(B, S, k)`` int64, that row's k nearest rows (-1: none).
        center: ``(B, 3)`` float64, each problem's ``c``.

    Returns:
        ``(B, 23)`` float64 as :func:`probe_information`: ``Σ J Jᵀ`` of the matched
        samples whose neighbourhood spans a plane, their count, and the count of matched
        samples whose neighbourhood does not. One Triton launch (and one sum) on the
        Triton backends, the normals rounded to float32 as ``features.pca_normals`` stores
        them; None elsewhere (the caller's batched operations; the spec is
        :func:`.reference.neighbourhood_information_reference`).

    """
    B, S = nearest.shape
    if neighbours.dim() != 3 or neighbours.shape[:2] != (B, S) or table.dim() != 2 \
            or table.shape[1] != 3 or center.shape != (B, 3):
        raise ValueError(f"neighbourhood_information: expected table (R, 3), nearest (B, S), "
                         f"neighbours (B, S, k), center (B, 3); got {tuple(table.shape)}, "
                         f"{tuple(nearest.shape)}, {tuple(neighbours.shape)}, "
                         f"{tuple(center.shape)}")
    if neighbourhood_fused(table):
        from pointalign.kernels.stability import triton as _triton

        return _triton.neighbourhood_information(table, nearest, neighbours, center)
    return None


def information_matrix(sums: torch.Tensor) -> torch.Tensor:
    """Return the symmetric ``(B, 6, 6)`` ``Σ J Jᵀ`` of :func:`probe_information`'s rows."""
    return sums[:, _SYM6].reshape(-1, 6, 6)
