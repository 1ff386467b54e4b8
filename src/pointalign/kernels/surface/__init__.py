"""The surface family: distance-map Newton terms, per-node statistics, the cell-mean step.

The Newton terms (:func:`newton_terms`) are one fused pass over the query points. For every
query point ``q`` (source point moved by the current ``R, t``: ``q = R x + t``) the
pass finds the k-d tree node of level ``depth`` whose cell holds ``q`` (descent, no
backtracking), fetches that node's quadratic approximant of the squared distance to the
target, ``d̂²(q) = qᵀAq − 2bᵀq + c`` (``A`` symmetric 3×3), and accumulates the terms of its
linearisation in the motion ``ξ = (ω, τ)`` about the centre ``o``:

    ``q(ξ) ≈ q + ω × (q − o) + τ = q + Q ξ``,  ``Q = [−[q − o]ₓ | I]``  (3×6)
    ``d̂²(q(ξ)) ≈ ξᵀ F ξ − 2 gᵀ ξ + h``,  ``F = QᵀAQ``,  ``g = Qᵀ(b − Aq)``,  ``h = d̂²(q)``

(Zabatani & Bronstein 2012, eqs. 11-17; Mitra et al. 2004). Each term is weighted by
``w = weight · [h <= tau2]`` (a truncated quadratic: terms beyond ``tau2`` contribute the
constant ``tau2`` to the objective and nothing to ``F, g``).

Output of :func:`newton_terms`: a ``(29,)`` float64 vector ``[F (21, upper triangle
row-major), g (6), objective Σ weight·min(h, tau2), inliers Σ w > 0]``.

Coefficient table layout, ``coeffs (n_nodes, 10)``: ``a00 a01 a02 a11 a12 a22 b0 b1 b2 c``.

Every entry point answers on every backend: the numba kernels of :mod:`.cpu` on ``"cpu"``,
the Triton kernel of :mod:`.triton` for :func:`newton_terms` on ``"triton"``/``"interpret"``,
and the PyTorch references of :mod:`.reference` (the spec, with the shared constants)
elsewhere. The other entry points:

* :func:`node_frames`, :func:`node_moments`, :func:`node_radii`: per-node mean, PCA frame,
  covariance and RMS radius of the tree's points (the approximants' inputs);
  :func:`quadric_sums`: the normal equations of the second-order approximant's quadric fits.
* :func:`cell_mean_sums` and :func:`cell_mean_step`: one approximate-ICP step, the tree
  cell's mean as each point's partner, Horn's sums and (the step) the float64 solve.
"""

from __future__ import annotations

import math

import torch

from pointalign.kernels import kdtree as _kd
from pointalign.kernels import normal_eq
from pointalign.kernels._backend import backend
from pointalign.kernels.surface.reference import (
    N_TERMS,
    TRIU,
    cell_mean_step_reference,
    cell_mean_sums_reference,
    cell_partners,
    evaluate,
    newton_terms_reference,
    node_frames_reference,
    node_moments_reference,
    node_radii_reference,
    quadric_sums_reference,
    sym3,
    unpack,
)

__all__ = [
    "N_TERMS", "TRIU", "cell_mean_step", "cell_mean_step_reference",
    "cell_mean_sums", "cell_mean_sums_reference", "evaluate", "newton_terms",
    "newton_terms_reference", "node_frames", "node_frames_reference", "node_moments",
    "node_moments_reference", "node_radii", "node_radii_reference", "quadric_sums",
    "quadric_sums_reference", "sym3", "unpack",
]


def newton_terms(points: torch.Tensor, T: torch.Tensor, center: torch.Tensor,
                 tree: _kd.TreeArrays, coeffs: torch.Tensor, depth: int, *,
                 weights: torch.Tensor | None = None, tau2: float = math.inf,
                 objective_only: bool = False) -> torch.Tensor:
    """Fused reduction of the Newton terms (module docstring) over ``points (N, 3)``.

    Args:
        points: ``(N, 3)`` float source points (source frame).
        T: ``(4, 4)`` current ``T_target_source`` (any float dtype; applied in ``points``'
            dtype).
        center: ``(3,)`` rotation centre ``o`` (target frame).
        tree: the target's k-d tree arrays.
        coeffs: ``(n_nodes, 10)`` per-node approximants (layout in the module docstring).
        depth: level of the nodes whose approximants are used (0..tree.depth).
        weights: optional ``(N,)`` non-negative per-point weights (default 1).
        tau2: squared truncation distance (``inf``: none).
        objective_only: compute only the objective and the inlier count (``F, g`` are 0).

    Returns:
        ``(29,)`` float64 tensor on the points' device.

    """
    be = backend(points)
    if be in ("triton", "interpret"):
        from pointalign.kernels.surface import triton as _surface_triton

        return _surface_triton.newton_terms(points, T, center, tree, coeffs, depth,
                                            weights=weights, tau2=tau2,
                                            objective_only=objective_only)
    if be == "cpu" and points.shape[0] > 0:
        from pointalign.kernels.surface import cpu as _surface_cpu

        return _surface_cpu.newton_terms_cpu(points, T, center, tree, coeffs, depth,
                                             weights=weights, tau2=tau2,
                                             objective_only=objective_only)
    return newton_terms_reference(points, T, center, tree, coeffs, depth, weights=weights,
                                  tau2=tau2, objective_only=objective_only)


def node_frames(tree: _kd.TreeArrays, min_frame_points: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean ``(K, 3)``, PCA frame ``(K, 3, 3)`` and RMS radius ``(K,)`` float64 of every node.

    ``frame[:, :, 0..2]`` = ``(e1, e2, n)``, the eigenvectors of the node's covariance by
    decreasing eigenvalue (``n``: the normal); ``radius = sqrt(Σ max(λ, 0))``. Nodes of fewer
    than ``min_frame_points`` points take their parent's frame. The ``"cpu"`` backend's
    numba kernel (centred two-pass sums per node); elsewhere
    :func:`~.reference.node_frames_reference` (prefix sums; the two agree to the rounding of
    those).
    """
    if backend(tree.points) == "cpu":
        from pointalign.kernels.surface import cpu as _surface_cpu

        return _surface_cpu.node_frames_cpu(tree, min_frame_points)
    return node_frames_reference(tree, min_frame_points)


def node_moments(tree: _kd.TreeArrays) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``(K, 3)`` and covariance ``(K, 3, 3)`` float64 of every node's points.

    The ``"cpu"`` backend's numba kernel; elsewhere :func:`~.reference.node_moments_reference`.
    """
    if backend(tree.points) == "cpu":
        from pointalign.kernels.surface import cpu as _surface_cpu

        return _surface_cpu.node_moments_cpu(tree)
    return node_moments_reference(tree)


def node_radii(tree: _kd.TreeArrays) -> torch.Tensor:
    """RMS distance ``(K,)`` float64 of every node's points to their mean.

    On ``"cpu"``: the square root of the trace of :func:`node_moments`'s covariance (numba,
    centred sums); elsewhere :func:`~.reference.node_radii_reference` (prefix sums).
    """
    if backend(tree.points) == "cpu":
        from pointalign.kernels.surface import cpu as _surface_cpu

        cov = _surface_cpu.node_moments_cpu(tree)[1]
        return cov.diagonal(dim1=1, dim2=2).sum(-1).clamp_min(0).sqrt()
    return node_radii_reference(tree)


def quadric_sums(tree: _kd.TreeArrays, mean: torch.Tensor, frame: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the normal equations ``(K, 4, 4)`` and right sides ``(K, 4)`` of quadric fits.

    The least-squares fit ``w ≈ αu² + βuv + γv² + ζ`` of each node's points in its frame
    (``mean (K, 3)``, ``frame (K, 3, 3)`` float64 from :func:`node_frames`): ``Σ φφᵀ`` and
    ``Σ φ w`` with ``φ = (u², uv, v², 1)``, float64. The ``"cpu"`` backend's numba kernel;
    elsewhere :func:`~.reference.quadric_sums_reference`.
    """
    if backend(tree.points) == "cpu":
        from pointalign.kernels.surface import cpu as _surface_cpu

        return _surface_cpu.quadric_sums_cpu(tree, mean, frame)
    return quadric_sums_reference(tree, mean, frame)


def cell_mean_sums(points: torch.Tensor, T: torch.Tensor, tree: _kd.TreeArrays,
                   means: torch.Tensor, depth: int, *, tau2: float = math.inf,
                   center: torch.Tensor | None = None) -> torch.Tensor:
    """Horn's sums of one approximate-ICP step (cell means as partners), fused in one pass.

    Each point of ``points (N, 3)`` is moved by ``T (4, 4)`` (applied in the points' dtype),
    descended to the level-``depth`` node whose cell holds it (no backtracking) and paired
    with that node's mean ``means (n_nodes, 3)``; pairs with ``||q − mean||² > tau2`` are
    dropped. Returns the ``(30,)`` float64 point-to-point sums of
    :func:`pointalign.kernels.normal_eq.normal_equations` (unit weights, coordinates centred
    on ``center (3,)``, default 0): ``[0]`` count, ``[1:4]`` Σ x̃, ``[4:7]`` Σ ỹ, ``[7:16]``
    Σ x̃ỹᵀ, ``[16:22]``/``[22:28]`` the upper triangles of Σ x̃x̃ᵀ and Σ ỹỹᵀ, ``[28]`` count,
    ``[29]`` Σ ||q − mean||². The ``"cpu"`` backend's numba kernel; every other backend runs
    :func:`~.reference.cell_mean_sums_reference`.
    """
    if backend(points) == "cpu" and points.shape[0] > 0:
        from pointalign.kernels.surface import cpu as _surface_cpu

        return _surface_cpu.cell_mean_sums_cpu(points, T, tree, means, depth, tau2=tau2,
                                               center=center)
    return cell_mean_sums_reference(points, T, tree, means, depth, tau2=tau2, center=center)


def cell_mean_step(source: torch.Tensor, means: torch.Tensor, T: torch.Tensor,
                   Tf: torch.Tensor, tree: _kd.TreeArrays, depth: int | torch.Tensor, *,
                   tau2: float, lengths: torch.Tensor, center: torch.Tensor, eps: float
                   ) -> tuple[torch.Tensor, ...]:
    """One approximate-ICP step: cell means as partners, Horn's sums and the float64 solve.

    Move ``source (1, N, 3)`` float by ``Tf (1, 4, 4)`` (``T`` in the source's dtype), pair
    each point with the mean ``means (1, K, 3)`` of the level-``depth`` cell it falls in
    (dropped beyond ``tau2``; ``depth`` an int or a ``(1,)`` integer tensor on the source's
    device, see :func:`pointalign.kernels.kdtree.descend`), reduce the point-to-point sums
    (centred on ``center (1, 3)``; ``lengths (1,)`` = N) and solve Horn's closed form about
    the centre (:func:`pointalign.kernels.normal_eq.solve_update_reference`'s contract,
    degeneracy threshold ``eps``), composed with ``T (1, 4, 4)`` float64.

    The ``"cpu"`` backend fuses move, descent, pairing and sums in one numba pass
    (:func:`cell_mean_sums`); ``"triton"`` moves and descends with PyTorch and reduces and
    solves on the device (:func:`pointalign.kernels.normal_eq.icp_update`; no host round
    trip, CUDA-graph safe); ``"torch"`` runs :func:`~.reference.cell_mean_step_reference`.

    Returns:
        ``(sums (1, 30) float64, D (1, 4, 4) float64, T_new = D T (1, 4, 4) float64, T_new
        as float32, flags (1, 2) int32 (valid, usable))``, on the source's device.

    """
    be = backend(source)
    if be == "cpu" and source.shape[1] > 0:
        from pointalign.kernels.surface import cpu as _surface_cpu

        sums = _surface_cpu.cell_mean_sums_cpu(source[0], Tf[0], tree, means[0], int(depth),
                                               tau2=tau2, center=center[0])[None]
        D, T_new, flags = normal_eq.solve_update_reference(sums, center, T, plane=False,
                                                           eps=eps)
        return sums, D, T_new, T_new.float(), flags
    if be in ("triton", "interpret"):
        x, node = cell_partners(source[0], Tf[0], tree, means[0], depth, tau2)
        return normal_eq.icp_update(x[None], means, node[None], transform=T, plane=False,
                                    lengths=lengths, center=center, eps=eps)
    return cell_mean_step_reference(source, means, T, Tf, tree, depth, tau2=tau2,
                                    lengths=lengths, center=center, eps=eps)
