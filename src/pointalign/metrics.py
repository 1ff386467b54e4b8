"""Accuracy measures of a registration against the ground truth, and on the data.

Transforms are ``T_target_source`` (``(4, 4)`` or ``(B, 4, 4)``; NumPy or tensors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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


@dataclass(frozen=True)
class RegistrationEvaluation:
    """What :func:`evaluate_registration` measures (Open3D's ``evaluate_registration``).

    Attributes:
        fitness: inlier correspondences / source points, in [0, 1].
        inlier_rmse: RMS distance over the inlier correspondences (``inf`` when none).
        correspondence_set: ``(K, 2)`` int64 NumPy array of ``(source index, target index)``
            pairs whose distance after moving the source is within the maximum distance.
        transformation: the ``(4, 4)`` float64 transformation that was evaluated.

    """

    fitness: float
    inlier_rmse: float
    correspondence_set: np.ndarray
    transformation: np.ndarray


def evaluate_registration(
    source: Any, target: Any, transformation: Any, max_correspondence_distance: float
) -> RegistrationEvaluation:
    """Fitness, inlier RMSE and correspondence set of a transformation (Open3D's meaning).

    Each source point ``T x_s`` is paired with its nearest target point; pairs closer than
    ``max_correspondence_distance`` are inliers. ``fitness = inliers / N`` and
    ``inlier_rmse = sqrt(mean(d²))`` over the inliers. This is the one meaning of
    ``RegistrationResult.fitness``/``rmse`` (see its docstring for the distance each method
    uses). Runs on the CPU in float64 with a SciPy cKDTree, whatever the inputs' device.

    Args:
        source: ``(N, 3)`` cloud (array, tensor, PointCloud, Open3D cloud, DLPack object).
        target: ``(M, 3)`` cloud.
        transformation: ``(4, 4)`` rigid ``T_target_source``.
        max_correspondence_distance: inlier distance (> 0), in the units of the data.

    Returns:
        :class:`RegistrationEvaluation`.

    Raises:
        ValueError / TypeError: bad shapes, NaN/Inf, a non-rigid transform or a distance
            that is not a positive number; the message names the argument.

    """
    from scipy.spatial import cKDTree

    src = _validate.as_points(source, "source", device="cpu", dtype=torch.float64)
    tgt = _validate.as_points(target, "target", device="cpu", dtype=torch.float64)
    T = _validate.as_transform(transformation, "transformation", device="cpu")
    d = _validate.positive(max_correspondence_distance, "max_correspondence_distance")
    moved = transforms.apply(T, src).numpy()
    dist, idx = cKDTree(tgt.numpy()).query(moved, k=1, distance_upper_bound=d, workers=-1)
    inl = np.isfinite(dist) & (dist <= d)
    fit = float(inl.mean())
    rmse = float(np.sqrt(np.mean(dist[inl] ** 2))) if inl.any() else math.inf
    pairs = np.stack([np.nonzero(inl)[0], idx[inl]], axis=1).astype(np.int64)
    return RegistrationEvaluation(fit, rmse, pairs, T.numpy().copy())


def correspondence_stats(
    source: Any, target: Any, transformation: Any, max_correspondence_distance: float
) -> tuple[float, float]:
    """Fitness and inlier RMSE of a transform (see :func:`evaluate_registration`)."""
    ev = evaluate_registration(source, target, transformation, max_correspondence_distance)
    return ev.fitness, ev.inlier_rmse


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
    """Fraction of pairs that succeed: rotation and translation errors below the limits.

    Success means rotation error < ``max_rotation_deg`` and translation error <
    ``max_translation`` (defaults: the 3DMatch success test, 15° and 30 cm).
    """
    _validate.positive(max_rotation_deg, "max_rotation_deg")
    _validate.positive(max_translation, "max_translation")
    r = np.asarray(rotation_errors, dtype=float)
    t = np.asarray(translation_errors, dtype=float)
    if r.shape != t.shape or r.size == 0:
        raise ValueError("rotation_errors and translation_errors: need equal, non-zero lengths")
    return float(np.mean((r < max_rotation_deg) & (t < max_translation)))
