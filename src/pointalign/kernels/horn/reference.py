"""The spec of the horn family: weighted moments and Horn's closed form, plain PyTorch.

:func:`horn_reference` states :func:`pointalign.kernels.horn.weighted_horn` (its contract
is in the dispatcher's docstring): the moments of :func:`horn_moments` in float64, then
:func:`pointalign._math.horn_pose` with the tie-breaker :data:`pointalign._math.HORN_TIE`
(:func:`horn_from_sums_reference`). The backends (``horn/triton.py``, ``horn/cpu.py``) import
this module or ``_math``/``_tl_math``, never their dispatcher.
"""

from __future__ import annotations

import torch

from pointalign import _math


def horn_moments(source: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted moments ``(W (B,), sx (B, 3), sm (B, 3), cross (B, 3, 3))`` in float64.

    They are Σw, Σw x, Σw m, Σw x mᵀ of ``source (B, N, 3)``, ``targets (B, N, 3)``,
    ``weights (B, N)``.
    """
    x = source.to(torch.float64)
    m = targets.to(torch.float64)
    w = weights.to(torch.float64)
    W = w.sum(-1)
    sx = (w[..., None] * x).sum(-2)
    sm = (w[..., None] * m).sum(-2)
    cross = (w[..., None] * x).transpose(-1, -2) @ m
    return W, sx, sm, cross


def horn_from_sums_reference(W: torch.Tensor, sx: torch.Tensor, sm: torch.Tensor,
                             cross: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`horn_from_sums` (same arguments and result)."""
    R, t, ok = _math.horn_pose(W, sx, sm, cross, tie=_math.HORN_TIE)
    T = torch.zeros(ok.shape + (4, 4), dtype=torch.float64, device=ok.device)
    T[..., :3, :3] = R
    T[..., :3, 3] = t
    T[..., 3, 3] = 1
    return T, ok


def horn_reference(source: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`weighted_horn` (same arguments and result)."""
    return horn_from_sums_reference(*horn_moments(source, targets, weights))
