"""Rigid registration by quadratic distance-map approximants stored in a k-d tree.

Zabatani & Bronstein, "Parallelized algorithms for rigid surface alignment on GPU" (2012),
following Mitra, Gelfand, Pottmann & Guibas, "Registration of point cloud data from a
geometric optimization perspective" (SGP 2004). Every node of the target's k-d tree (all
levels) stores a quadratic approximant of the squared distance to the target surface,

    ``d̂²(q) = qᵀAq − 2bᵀq + c``   (A symmetric positive semi-definite),

built from the node's points: its mean ``s*`` (the representative point), and the PCA frame
``(e1, e2, n)`` of their covariance (``n``: the smallest-variance direction). Kinds:

* ``"point"`` (far field, eq. 4): ``||q − s*||²``, ``A = I``.
* ``"plane"`` (near field, eq. 5): ``⟨n, q − s*⟩²``, ``A = nnᵀ``.
* ``"second_order"`` (Pottmann & Hofer, eq. 7): ``A = nnᵀ + λ1 d1d1ᵀ + λ2 d2d2ᵀ`` with principal
  directions ``d_i`` and curvatures ``κ_i`` from a **local quadric fit**
  ``w ≈ αu² + βuv + γv² + ζ`` of the node's points in its PCA frame (curvatures: eigenvalues
  of the Hessian ``[[2α, β], [β, 2γ]]``). The non-negative weights ``max(δ/(δ − ρ_i), 0)``
  depend on the query's signed distance ``δ``, which a per-cell constant cannot know; we
  store their average over both sides of the surface at ``|δ| = δ0``, the node's RMS radius
  (the typical distance of the queries that land in the cell), capped at 1:
  ``λ = min(1, ½ s/(1+s) + ½ max(s/(s−1), 0))`` with ``s = δ0 |κ|``. Small for flat cells
  (plane-like), 1 far beyond the curvature radius (point-like).
* a callable ``f(s_star (K, 3), normal (K, 3), frame (K, 3, 3)) -> (A (K, 3, 3), b (K, 3),
  c (K,))`` (float64; ``frame[:, :, j]`` = e1, e2, n as columns) for any other approximant.

``surface_newton`` minimises ``Σ_q d̂²(R q + t)`` by damped Newton steps (Algorithm 2,
:class:`NewtonStep`): the motion is linearised (small rotation), the 6×6 system ``F ξ = g``
is reduced in one fused pass (:func:`pointalign.kernels.surface.newton_terms`) and solved
in float64 (:func:`newton_direction`), and the step length is chosen by the Armijo rule
(Algorithm 1) on the **exact** objective (the approximants looked up at the moved points).
``approximate_icp`` is the paper's approximate GPU ICP (:class:`CellMeanStep`): the
correspondence of a source point is the mean of the tree cell it falls in (no
backtracking), and the update is Horn's closed form.

Both are a step and host rules on the one executor (:mod:`pointalign.kernels._loop`), go
coarse to fine through the tree's levels by one :class:`LevelSchedule` (not in the paper:
a lookup without backtracking needs cells larger than the motion), and share the edge of
every algorithm (:mod:`pointalign.registration._edge`: device, local float64 frame, stop
reasons, result).
"""

from pointalign.registration.surface.approximants import (
    APPROXIMANTS,
    Approximant,
    approximant_coefficients,
    approximate_sq_distance,
    node_frames,
)
from pointalign.registration.surface.cell_icp import CellMeanStep, approximate_icp
from pointalign.registration.surface.levels import LevelSchedule
from pointalign.registration.surface.newton import NewtonStep, newton_direction, surface_newton
from pointalign.registration.surface.problem import default_criteria

__all__ = [
    "APPROXIMANTS",
    "Approximant",
    "CellMeanStep",
    "LevelSchedule",
    "NewtonStep",
    "approximant_coefficients",
    "approximate_icp",
    "approximate_sq_distance",
    "default_criteria",
    "newton_direction",
    "node_frames",
    "surface_newton",
]
