"""Small frozen configuration objects shared by every registration algorithm."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pointalign import _math, _validate

#: the default translation tolerance, as a fraction of the cloud's extent (the RMS distance
#: of the target's points from their centroid): 1e-6 ≈ 8 float32 roundings of a coordinate
#: in the local frame, and 6e-8 m on the Stanford bunny (whose RMS radius is ~6 cm)
RELATIVE_TRANSLATION = 1e-6

#: the extent a :class:`PerExtent` tolerance reads as when nothing knows the cloud (a plain
#: ``float()``): a 10 cm object, so the default reads as the old absolute 1e-7 m
REFERENCE_EXTENT = 0.1


class PerExtent(float):
    """A translation tolerance given relative to the cloud: ``fraction × extent`` metres.

    ``extent``: the RMS distance of the target's points from their centroid (see
    :meth:`ConvergenceCriteria.translation_for`). As a plain float it reads as the
    tolerance of a :data:`REFERENCE_EXTENT` object, ``fraction × 0.1`` metres.
    """

    fraction: float

    def __new__(cls, fraction: float) -> PerExtent:
        """Make the tolerance ``fraction × extent``."""
        self = super().__new__(cls, float(fraction) * REFERENCE_EXTENT)
        self.fraction = float(fraction)
        return self

    def __repr__(self) -> str:
        return f"PerExtent({self.fraction!r})"

    def __reduce__(self) -> tuple:
        return (PerExtent, (self.fraction,))


@dataclass(frozen=True)
class ConvergenceCriteria:
    """When an iterative algorithm stops.

    Which algorithm reads which field (a field an algorithm does not read has no effect
    on it):

    ======================  ========================  ======================  ===============
    field                   icp                       emicp, softassign       surface_newton,
                                                                              approximate_icp
    ======================  ========================  ======================  ===============
    max_iterations          iteration cap             cap on the schedule     iteration cap
                                                      (criteria=None: none)
    relative_fitness        with relative_rmse        default of              —
                                                      relative_weights
    relative_rmse           with relative_fitness     —                       RMS change
    translation_tolerance   update                    update (at checks)      update
    rotation_tolerance      update                    update (at checks)      update
    relative_weights        —                         weight change, with     —
                                                      both tolerances
    ======================  ========================  ======================  ===============

    Attributes:
        max_iterations: hard cap on iterations (>= 1).
        relative_fitness: stop when ``|fitness_k - fitness_{k-1}| < relative_fitness``
            (Open3D's meaning).
        relative_rmse: stop when ``|rmse_k - rmse_{k-1}| / rmse_{k-1} < relative_rmse``.
        translation_tolerance: stop when the last update moved by less than this (metres)
            and ``rotation_tolerance`` holds too. Default: :data:`RELATIVE_TRANSLATION`
            (1e-6) of the target's extent (its RMS distance from its centroid), so the rule
            means the same for a 15 µm object and a 15 m one; a number is used in metres as
            given (``PerExtent(f)`` asks for another fraction).
        rotation_tolerance: radians; see ``translation_tolerance``.
        relative_weights: the annealing methods' settling test: the relative L1 change of
            the soft weights between checks, ``Σ|w_k − w_{k−1}| / Σ w_k``. None (default)
            takes the value of ``relative_fitness``, which EM-ICP and Softassign read with
            this meaning before this field existed (so ``relative_fitness=0.2`` passed to
            them still takes effect).

    """

    max_iterations: int = 50
    relative_fitness: float = 1e-6
    relative_rmse: float = 1e-6
    translation_tolerance: float = PerExtent(RELATIVE_TRANSLATION)
    rotation_tolerance: float = 1e-7
    relative_weights: float | None = None

    def __post_init__(self) -> None:
        # checked and stored as plain int / float (NumPy scalars accepted)
        object.__setattr__(self, "max_iterations",
                           _validate.integer(self.max_iterations, "max_iterations", minimum=1))
        for name in ("relative_fitness", "relative_rmse", "translation_tolerance",
                     "rotation_tolerance"):
            value = _validate.positive(getattr(self, name), name, allow_zero=True)
            if not isinstance(getattr(self, name), PerExtent):  # a PerExtent stays one
                object.__setattr__(self, name, value)
        if self.relative_weights is not None:
            object.__setattr__(self, "relative_weights", _validate.positive(
                self.relative_weights, "relative_weights", allow_zero=True))

    def translation_for(self, extent: np.ndarray | float) -> np.ndarray:
        """Return the translation tolerance in metres for clouds of ``extent`` (``(B,)``).

        ``extent``: the RMS distance of the target's points from their centroid (metres). A
        :class:`PerExtent` tolerance (the default) is its fraction of it; a plain number is
        returned as given.
        """
        e = np.asarray(extent, dtype=np.float64)
        tol = self.translation_tolerance
        if isinstance(tol, PerExtent):
            return tol.fraction * e
        return np.full_like(e, float(tol))

    @property
    def weight_change(self) -> float:
        """The relative weight change the annealing methods stop below (see the table)."""
        return self.relative_fitness if self.relative_weights is None else \
            self.relative_weights


@dataclass(frozen=True)
class RobustKernel:
    """M-estimator weight ``w(r)`` for residual r, with scale ``k`` (metres).

    ``kind``: ``"none"`` (w = 1), ``"huber"`` (w = min(1, k/|r|)), ``"tukey"``
    (w = (1 - (r/k)^2)^2 for |r| < k else 0), ``"cauchy"`` (w = 1 / (1 + (r/k)^2)).
    """

    kind: str = "none"
    k: float = 1.0

    def __post_init__(self) -> None:
        _validate.choice(self.kind, "robust_kernel.kind", tuple(_math.ROBUST_KINDS))
        object.__setattr__(self, "k", _validate.positive(self.k, "robust_kernel.k"))

    def weights(self, residual: torch.Tensor) -> torch.Tensor:
        """Weights for residuals ``(…)`` (same shape); non-negative, 1 at r = 0.

        Uses :func:`pointalign._math.robust_weight`, the formula the ICP kernels use.
        """
        return _math.robust_weight(residual, self.kind, self.k)


def as_criteria(criteria: Any, max_iterations: Any = None, *,
                default: ConvergenceCriteria | None = None) -> ConvergenceCriteria:
    """Return the criteria of a call that takes ``criteria=`` and ``max_iterations=``.

    ``max_iterations=n`` is Open3D's and small_gicp's habit and a shortcut for
    ``criteria=ConvergenceCriteria(max_iterations=n)`` (the other fields: ``default``'s, or
    the defaults); giving both is an error (the cap would be ambiguous).

    Args:
        criteria: a :class:`ConvergenceCriteria` or None.
        max_iterations: an integer >= 1 or None.
        default: the criteria the method uses when neither is given (None: the defaults).

    Raises:
        TypeError: ``criteria`` is not a ConvergenceCriteria, or both were given.

    """
    if max_iterations is not None:
        n = _validate.integer(max_iterations, "max_iterations", minimum=1)
        if criteria is not None:
            raise TypeError("max_iterations: pass either max_iterations= or criteria="
                            "ConvergenceCriteria(max_iterations=...), not both")
        return dataclasses.replace(default if default is not None else ConvergenceCriteria(),
                                   max_iterations=n)
    if criteria is None:
        return default if default is not None else ConvergenceCriteria()
    return _validate.instance(criteria, ConvergenceCriteria, "criteria")


def as_robust_kernel(value: Any) -> RobustKernel:
    """Return a :class:`RobustKernel` from any of the forms ``robust_kernel=`` accepts.

    ``None`` (no kernel), a RobustKernel, a kind (``"huber"``: the same as
    ``RobustKernel("huber")``, scale k = 1 in the points' units, Open3D's default too) or a
    pair ``("huber", k)`` (k in the points' units: about the noise level). Anything else is
    a TypeError naming ``robust_kernel``; an unknown kind or a bad scale a ValueError.
    """
    if value is None:
        return RobustKernel()
    if isinstance(value, RobustKernel):
        return value
    if isinstance(value, str):
        return RobustKernel(value)
    if isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], str):
        return RobustKernel(value[0], value[1])
    kinds = ", ".join(map(repr, _math.ROBUST_KINDS))
    raise TypeError(f"robust_kernel: expected a RobustKernel, a kind ({kinds}) or a pair "
                    f"(kind, k), got {type(value).__name__} {value!r}")
