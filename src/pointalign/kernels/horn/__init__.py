"""Weighted moments → rigid pose (Horn's closed form): one kernel family for every caller.

Used by ICP point-to-point (inside the fused ICP solve of ``kernels.normal_eq``, through the
same helper ``_tl_math.horn_pose``), EM-ICP and Softassign (``kernels.soft``) and RANSAC
(``registration.ransac``).

Contract: for sources x_i, targets m_i and weights w_i ≥ 0 of each batch entry, the pose
``argmin Σ w_i ||R x_i + t − m_i||²``: moments W = Σw, Σw x, Σw m, Σw x mᵀ in float64, then
:func:`pointalign._math.horn_pose` with the tie-breaker :data:`pointalign._math.HORN_TIE`
(a tied top eigenvalue, as for one or two points, resolves towards R = I). Never raises,
never returns NaN: an entry with zero total weight (or a non-finite result) gets the
identity and ``valid`` False. The soft form of Tamaki et al. (eqs. 18-20, 26) reduces to
this with w_i the row sums and m_i the soft correspondences.

The reference (:func:`horn_reference`, :func:`horn_from_sums_reference`, in
``horn/reference.py`` and re-exported here) is the spec; on Triton one program per batch
entry reduces the moments and solves (``horn/triton.py``); on the "cpu" backend one numba
loop over the batch does the same (``horn/cpu.py``, cyclic Jacobi for the top eigenvector,
exact to rounding like the reference's ``eigh``).
"""

from __future__ import annotations

import torch

from pointalign.kernels._backend import backend
from pointalign.kernels.horn.reference import horn_from_sums_reference, horn_reference
from pointalign.kernels.horn.reference import horn_moments as horn_moments


def weighted_horn(
    source: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted Horn ``argmin Σ w_i ||R x_i + t − m_i||²`` for every batch entry.

    Args:
        source: ``(B, N, 3)`` float tensor, x_i.
        targets: ``(B, N, 3)`` float tensor, m_i.
        weights: ``(B, N)`` w_i ≥ 0 (0 on padding rows).

    Returns:
        ``(T (B, 4, 4) float64, valid (B,) bool)``.

    """
    be = backend(source)
    if be in ("triton", "interpret"):
        from pointalign.kernels.horn import triton as _horn_triton

        return _horn_triton.horn(source, targets, weights)
    if be == "cpu":
        from pointalign.kernels.horn import cpu as _horn_cpu

        if _horn_cpu.accepts(source, targets, weights):
            return _horn_cpu.horn(source, targets, weights)
    return horn_reference(source, targets, weights)


def horn_from_sums(W: torch.Tensor, sx: torch.Tensor, sm: torch.Tensor, cross: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pose from the weighted moments of :func:`horn_moments` (float64).

    Computed by :func:`pointalign._math.horn_pose` with ``tie=HORN_TIE`` (the reference,
    :func:`horn_from_sums_reference`), or by its numba twin on the "cpu" backend.

    Args:
        W: ``(…)`` Σw.
        sx: ``(…, 3)`` Σw x.
        sm: ``(…, 3)`` Σw m.
        cross: ``(…, 3, 3)`` Σw x mᵀ.

    Returns:
        ``(T (…, 4, 4) float64, valid (…) bool)``; T = I where not valid.

    """
    if backend(W) == "cpu" and not any(a.requires_grad for a in (W, sx, sm, cross)):
        from pointalign.kernels.horn import cpu as _horn_cpu

        return _horn_cpu.horn_from_sums(W, sx, sm, cross)
    return horn_from_sums_reference(W, sx, sm, cross)
