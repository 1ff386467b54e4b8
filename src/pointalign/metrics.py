"""Accuracy measures of a registration against the ground truth, and on the data.

Transforms are ``T_target_source`` (``(4, 4)`` or ``(B, 4, 4)``; NumPy or tensors).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from pointalign import _validate, transforms


def _T(x: Any, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor) and x.dim() == 3:
        return _validate.as_transform(x, name, batch=x.shape[0], device=x.device)
    if isinstance(x, np.ndarray) and x.ndim == 3:
        return _validate.as_transform(x, name, batch=x.shape[0])
    return _validate.as_transform(x, name)


def _out(t: torch.Tensor) -> Any:
    return float(t) if t.dim() == 0 else t.cpu().numpy()


def relative_error(estimate: Any, truth: Any) -> tuple[Any, Any]:
    """Rotation error (degrees) and translation error (same units as t) of an estimate.

    The error transform is ``E = inv(T_true) @ T_est``; the rotation error is the angle of
    E's rotation and the translation error ``||t_est − t_true||``.
    """
    Te, Tt = _T(estimate, "estimate"), _T(truth, "truth").to(torch.float64)
    Tt = Tt.to(Te.device)
    E = transforms.invert(Tt) @ Te
    rot = torch.rad2deg(transforms.rotation_angle(E[..., :3, :3]))
    trans = (Te[..., :3, 3] - Tt[..., :3, 3]).norm(dim=-1)
    return _out(rot), _out(trans)


def rotation_error(estimate: Any, truth: Any) -> Any:
    """Angle in degrees of ``R_trueᵀ R_est`` (float, or ``(B,)`` array for batches)."""
    return relative_error(estimate, truth)[0]


def translation_error(estimate: Any, truth: Any) -> Any:
    """``||t_est − t_true||`` in the units of the data."""
    return relative_error(estimate, truth)[1]


def zabatani_error(estimate: Any, truth: Any) -> Any:
    """Zabatani and Bronstein's error ε = ||R⁻¹R* − I||_F + ||Rt − t*||.

    Here (R, t) is the estimate and (R*, t*) the truth, read as in the paper: ``Rt`` is the
    estimate's translation ``t`` (the paper's rigid motion is ``x ↦ Rx + t``). The Frobenius
    term of a rotation by θ equals ``2√2 |sin(θ/2)|``.
    """
    Te, Tt = _T(estimate, "estimate"), _T(truth, "truth").to(torch.float64)
    Tt = Tt.to(Te.device)
    R, R_true = Te[..., :3, :3], Tt[..., :3, :3]
    eye = torch.eye(3, dtype=R.dtype, device=R.device)
    rot = torch.linalg.matrix_norm(R.transpose(-1, -2) @ R_true - eye)
    trans = (Te[..., :3, 3] - Tt[..., :3, 3]).norm(dim=-1)
    return _out(rot + trans)


def correspondence_stats(
    source: Any, target: Any, transformation: Any, max_correspondence_distance: float
) -> tuple[float, float]:
    """Fitness and inlier RMSE of a transform, Open3D's meaning, using a SciPy cKDTree.

    fitness = (source points whose nearest target point after transforming lies within
    ``max_correspondence_distance``) / (source points); rmse = RMS of those distances
    (``inf`` when there is none). Runs on the CPU in float64.
    """
    from scipy.spatial import cKDTree

    src = _validate.as_points(source, "source", device="cpu", dtype=torch.float64)
    tgt = _validate.as_points(target, "target", device="cpu", dtype=torch.float64)
    T = _validate.as_transform(transformation, "transformation", device="cpu")
    d = _validate.positive(max_correspondence_distance, "max_correspondence_distance")
    moved = transforms.apply(T, src).numpy()
    dist, _ = cKDTree(tgt.numpy()).query(moved, k=1, distance_upper_bound=d, workers=-1)
    inl = np.isfinite(dist)
    fit = float(inl.mean())
    rmse = float(np.sqrt(np.mean(dist[inl] ** 2))) if inl.any() else math.inf
    return fit, rmse


def fitness(source: Any, target: Any, transformation: Any,
            max_correspondence_distance: float) -> float:
    """Fraction of source points with a target point within the distance after moving."""
    return correspondence_stats(source, target, transformation, max_correspondence_distance)[0]


def inlier_rmse(source: Any, target: Any, transformation: Any,
                max_correspondence_distance: float) -> float:
    """RMS distance over the inlier correspondences (see :func:`correspondence_stats`)."""
    return correspondence_stats(source, target, transformation, max_correspondence_distance)[1]


def registration_recall(rotation_errors: Any, translation_errors: Any, *,
                        max_rotation_deg: float = 15.0, max_translation: float = 0.3) -> float:
    """Fraction of pairs with rotation error < ``max_rotation_deg`` and translation error <
    ``max_translation`` (defaults: the 3DMatch success test, 15° and 30 cm).
    """
    r = np.asarray(rotation_errors, dtype=float)
    t = np.asarray(translation_errors, dtype=float)
    if r.shape != t.shape or r.size == 0:
        raise ValueError("rotation_errors and translation_errors: need equal, non-zero lengths")
    return float(np.mean((r < max_rotation_deg) & (t < max_translation)))
