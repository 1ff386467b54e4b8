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


def _pair(estimate: Any, truth: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Both transforms as float64-compatible tensors on one device, batches checked."""
    Te, Tt = _T(estimate, "estimate"), _T(truth, "truth").to(torch.float64)
    Tt = Tt.to(Te.device)
    if Te.dim() == 3 and Tt.dim() == 3 and Te.shape[0] != Tt.shape[0]:
        raise ValueError(f"estimate, truth: batches of {Te.shape[0]} and {Tt.shape[0]} "
                         "transforms; give batches of one size, or one (4, 4) truth for all")
    return Te, Tt


def relative_error(estimate: Any, truth: Any) -> tuple[Any, Any]:
    """Rotation error (degrees) and translation error (same units as t) of an estimate.

    The error transform is ``E = inv(T_true) @ T_est``; the rotation error is the angle of
    E's rotation and the translation error ``||t_est − t_true||``.

    Args:
        estimate: ``(4, 4)`` or ``(B, 4, 4)`` ``T_target_source`` (NumPy or tensor).
        truth: ``(4, 4)`` or ``(B, 4, 4)`` with the same B (a ``(4, 4)`` truth serves a
            whole batch).

    Returns:
        ``(rotation_deg, translation)``: floats, or ``(B,)`` NumPy arrays for batches.

    Raises:
        ValueError: not rigid ``(…, 4, 4)`` transforms, or batches of different sizes.

    """
    Te, Tt = _pair(estimate, truth)
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
    Te, Tt = _pair(estimate, truth)
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

    @property
    def rmse(self) -> float:
        """The inlier RMSE under the name :class:`~pointalign.RegistrationResult` uses."""
        return self.inlier_rmse


def _is_number(x: Any) -> bool:
    if isinstance(x, (bool, np.bool_)):
        return False
    if isinstance(x, (int, float, np.integer, np.floating)):
        return True
    return isinstance(x, (np.ndarray, torch.Tensor)) and x.ndim == 0


def evaluate_registration(
    source: Any, target: Any, max_correspondence_distance: Any,
    transformation: Any = None,
) -> RegistrationEvaluation:
    """Fitness, inlier RMSE and correspondence set of a transformation (Open3D's meaning).

    Each source point ``T x_s`` is paired with its nearest target point; pairs closer than
    ``max_correspondence_distance`` are inliers. ``fitness = inliers / N`` and
    ``inlier_rmse = sqrt(mean(d²))`` over the inliers. This is the one meaning of
    ``RegistrationResult.fitness``/``rmse`` (see its docstring for the distance each method
    uses). Runs on the CPU in float64 with a SciPy cKDTree, whatever the inputs' device.

    The arguments come in Open3D's order, ``(source, target, max_correspondence_distance,
    transformation)``, with the identity as the default transformation. The earlier order
    ``(source, target, transformation, max_correspondence_distance)`` is still accepted: a
    number and a ``(4, 4)`` matrix cannot be mistaken for each other. Keywords work either
    way.

    Args:
        source: ``(N, 3)`` cloud (array, tensor, PointCloud, Open3D cloud, DLPack object).
        target: ``(M, 3)`` cloud.
        max_correspondence_distance: inlier distance (> 0), in the units of the data.
        transformation: ``(4, 4)`` rigid ``T_target_source``; None: the identity.

    Returns:
        :class:`RegistrationEvaluation` (``inlier_rmse``, also readable as ``rmse``).

    Raises:
        ValueError / TypeError: bad shapes, NaN/Inf, a non-rigid transform or a distance
            that is not a positive number; the message names the argument.

    """
    from scipy.spatial import cKDTree

    if not _is_number(max_correspondence_distance) and _is_number(transformation):
        # the earlier positional order: (source, target, transformation, distance)
        max_correspondence_distance, transformation = transformation, max_correspondence_distance
    if transformation is None:
        transformation = np.eye(4)
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
    ev = evaluate_registration(source, target, max_correspondence_distance, transformation)
    return ev.fitness, ev.inlier_rmse


def fitness(source: Any, target: Any, transformation: Any,
            max_correspondence_distance: float) -> float:
    """Fraction of source points with a target point within the distance after moving."""
    return correspondence_stats(source, target, transformation, max_correspondence_distance)[0]


def inlier_rmse(source: Any, target: Any, transformation: Any,
                max_correspondence_distance: float) -> float:
    """RMS distance over the inlier correspondences (see :func:`correspondence_stats`)."""
    return correspondence_stats(source, target, transformation, max_correspondence_distance)[1]


def _errors(x: Any, name: str) -> np.ndarray:
    """Per-pair errors as a 1-D float64 array; clear errors for strings, scalars, shapes."""
    if isinstance(x, (str, bytes)):
        raise TypeError(f"{name}: expected a sequence of numbers (one error per pair), got "
                        f"{type(x).__name__} {x!r}")
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    try:
        a = np.asarray(x)
    except (ValueError, TypeError) as exc:
        raise TypeError(f"{name}: expected a sequence of numbers, got {type(x).__name__} "
                        f"({exc})") from None
    if a.dtype == object or not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
        raise TypeError(f"{name}: expected numbers (one error per pair), got values of type "
                        f"{a.dtype}")
    if np.issubdtype(a.dtype, np.complexfloating) or a.dtype == np.bool_:
        raise TypeError(f"{name}: expected real numbers, got dtype {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence with one error per pair, got shape "
                         f"{a.shape}" + ("; wrap a single pair's error in a list" if a.ndim == 0
                                         else ""))
    return a.astype(np.float64)


def registration_recall(rotation_errors: Any, translation_errors: Any, *,
                        max_rotation_deg: float = 15.0, max_translation: float = 0.3) -> float:
    """Fraction of pairs that succeed: rotation and translation errors below the limits.

    Success means rotation error < ``max_rotation_deg`` and translation error <
    ``max_translation`` (defaults: the 3DMatch success test, 15° and 30 cm). A NaN error
    (a failed pair) counts as a failure.

    Args:
        rotation_errors: ``(P,)`` rotation errors in degrees (list, array or tensor).
        translation_errors: ``(P,)`` translation errors, in the units of ``max_translation``.
        max_rotation_deg: rotation limit in degrees (> 0).
        max_translation: translation limit (> 0).

    Raises:
        TypeError: errors that are not numbers (strings, objects).
        ValueError: not 1-D, lengths that differ or are zero, or limits that are not > 0.

    """
    _validate.positive(max_rotation_deg, "max_rotation_deg")
    _validate.positive(max_translation, "max_translation")
    r = _errors(rotation_errors, "rotation_errors")
    t = _errors(translation_errors, "translation_errors")
    if r.shape != t.shape or r.size == 0:
        raise ValueError("rotation_errors and translation_errors: need equal, non-zero lengths "
                         f"(got {r.size} and {t.size})")
    return float(np.mean((r < max_rotation_deg) & (t < max_translation)))
