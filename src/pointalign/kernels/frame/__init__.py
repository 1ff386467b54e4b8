"""The local frame of a registration problem: centroids, radii and the shifted clouds.

Contract (the PyTorch spec is :func:`.reference.local_frame_reference`; the Triton kernels
are in ``triton.py``; :func:`pointalign.kernels.backend` picks, CPU tensors take the spec):

``local_frame(source (B, N, 3), source_lengths (B,), source_counts, target (Bt, M, 3),
target_lengths (Bt,), target_counts, local=True) -> (source_local, target_local, host)``:

* each cloud's centroid ``c`` (the mean of its first ``lengths`` rows) and RMS radius (the
  root of the mean squared distance from ``c``) in float64, from float32 or float64 points;
  ``Bt`` is ``B``, or 1 for a target shared by every source;
* ``source_local (B, N, 3)`` and ``target_local (Bt, M, 3)`` float32: every row (padding
  too) minus its problem's target centroid in float64, then rounded once (``local=False``:
  no shift, only the rounding);
* ``host (B, 8)`` float64 on the device, one row per problem: the shift (3), the target's
  radius, the target's centroid in the shifted frame (3; zero when ``local``) and the
  source's radius: what :func:`pointalign.registration._pair.prepare_pair` reads in one
  transfer. A NaN/Inf row makes its cloud's numbers non-finite.

``source_counts`` / ``target_counts`` are the lengths on the host (NumPy int64). The spec
takes ``torch.mean``; the Triton kernels sum each block of rows relative to the cloud's
first row in float64 (``Σ (x − x₀)``, ``Σ (x − x₀)²``) and add the blocks in a fixed
order, in two launches: centroids and radii agree with the spec to float64 rounding
(differently grouped sums), the float32 clouds to one float32 rounding where a centroid's
last bit differs.
"""

from __future__ import annotations

import numpy as np
import torch

from pointalign.kernels._backend import backend
from pointalign.kernels.frame.reference import local_frame_reference

__all__ = ["local_frame"]


def local_frame(source: torch.Tensor, source_lengths: torch.Tensor, source_counts: np.ndarray,
                target: torch.Tensor, target_lengths: torch.Tensor, target_counts: np.ndarray,
                *, local: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shift a batch of problems to their targets' centroids (entry point; module contract).

    Args:
        source: ``(B, N, 3)`` float tensor, padded.
        source_lengths: ``(B,)`` int64 valid rows of each source, on its device.
        source_counts: ``(B,)`` the same on the host (NumPy).
        target: ``(Bt, M, 3)`` float tensor (``Bt`` is B or 1).
        target_lengths: ``(Bt,)`` int64 valid rows of each target, on its device.
        target_counts: ``(Bt,)`` the same on the host.
        local: shift by the target's centroid (False: keep the coordinates).

    Returns:
        ``(source_local (B, N, 3) float32, target_local (Bt, M, 3) float32, host (B, 8)
        float64)`` on the inputs' device.

    """
    B, Bt = source.shape[0], target.shape[0]
    if source.dim() != 3 or target.dim() != 3 or source.shape[-1] != 3 \
            or target.shape[-1] != 3 or Bt not in (1, B) \
            or source_lengths.shape != (B,) or target_lengths.shape != (Bt,):
        raise ValueError(f"local_frame: expected source (B, N, 3), target (B or 1, M, 3) and "
                         f"their lengths, got {tuple(source.shape)}, {tuple(target.shape)}, "
                         f"{tuple(source_lengths.shape)}, {tuple(target_lengths.shape)}")
    devs = {t.device for t in (source, source_lengths, target, target_lengths)}
    if len(devs) != 1:
        raise ValueError(f"local_frame: inputs on different devices {sorted(map(str, devs))}")
    if backend(source) in ("triton", "interpret"):
        from pointalign.kernels.frame import triton as _triton

        return _triton.local_frame(source, source_lengths, target, target_lengths, local)
    return local_frame_reference(source, source_lengths, np.asarray(source_counts), target,
                                 target_lengths, np.asarray(target_counts), local)
