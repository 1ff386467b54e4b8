"""Distance-map Newton terms: one fused pass over the query points, with its PyTorch reference.

For every query point ``q`` (source point moved by the current ``R, t``: ``q = R x + t``) the
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
"""

from __future__ import annotations

import math

import torch

from pointalign.kernels import kdtree as _kd
from pointalign.kernels import normal_eq
from pointalign.kernels._backend import backend

N_TERMS = 29
#: index pairs (i, j), i <= j, of the 21 stored entries of the symmetric 6×6 F
TRIU = [(i, j) for i in range(6) for j in range(i, 6)]


def unpack(terms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """``(F (6, 6), g (6,), objective, inliers)`` from a ``(29,)`` float64 vector."""
    F = terms.new_zeros(6, 6)
    for k, (i, j) in enumerate(TRIU):
        F[i, j] = F[j, i] = terms[k]
    return F, terms[21:27].clone(), float(terms[27]), float(terms[28])


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
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Mean, PCA frame and RMS radius of every node from the backend's kernel, or None.

    The contract of :func:`pointalign.registration.surface.node_frames` (its PyTorch code is
    the reference, and runs where this returns None: every backend but ``"cpu"``).
    """
    if backend(tree.points) == "cpu":
        from pointalign.kernels.surface import cpu as _surface_cpu

        return _surface_cpu.node_frames_cpu(tree, min_frame_points)
    return None


def node_moments(tree: _kd.TreeArrays) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Mean ``(K, 3)`` and covariance ``(K, 3, 3)`` float64 of every node, or None.

    From the backend's kernel (``"cpu"`` only); None elsewhere, where the caller sums with
    :meth:`pointalign.search.kdtree.KDTreeIndex.node_sums` (the reference).
    """
    if backend(tree.points) == "cpu":
        from pointalign.kernels.surface import cpu as _surface_cpu

        return _surface_cpu.node_moments_cpu(tree)
    return None


def quadric_sums(tree: _kd.TreeArrays, mean: torch.Tensor, frame: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Return the quadric fits' sums ``(K, 4, 4)``, ``(K, 4)`` from the backend's kernel, or None.

    None on every backend but ``"cpu"``, where the caller's reference runs (the per-level
    sums in ``pointalign.registration.surface._curvatures``).
    """
    if backend(tree.points) == "cpu":
        from pointalign.kernels.surface import cpu as _surface_cpu

        return _surface_cpu.quadric_sums_cpu(tree, mean, frame)
    return None


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
    :func:`cell_mean_sums_reference`.
    """
    if backend(points) == "cpu" and points.shape[0] > 0:
        from pointalign.kernels.surface import cpu as _surface_cpu

        return _surface_cpu.cell_mean_sums_cpu(points, T, tree, means, depth, tau2=tau2,
                                               center=center)
    return cell_mean_sums_reference(points, T, tree, means, depth, tau2=tau2, center=center)


def cell_mean_sums_reference(points: torch.Tensor, T: torch.Tensor, tree: _kd.TreeArrays,
                             means: torch.Tensor, depth: int, *, tau2: float = math.inf,
                             center: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference of :func:`cell_mean_sums` (same arguments and result).

    The moves and the float64 reduction of
    :class:`pointalign.registration.surface.CellMeanStep` on the "torch" backend.
    """
    Tp = T.to(device=points.device, dtype=points.dtype)
    q = points @ Tp[:3, :3].T + Tp[:3, 3]
    node = _kd.descend(tree, q, depth)
    y = means.to(q.dtype)
    if math.isfinite(tau2):
        d2 = ((q.double() - y[node].double()) ** 2).sum(-1)
        node = torch.where(d2 <= tau2, node, torch.full_like(node, -1))
    c = torch.zeros(3, dtype=q.dtype, device=q.device) if center is None else \
        center.to(device=q.device, dtype=q.dtype).reshape(3)
    n = torch.tensor([q.shape[0]], dtype=torch.int64, device=q.device)
    return normal_eq.normal_equations_reference(q[None], y[None], node[None], lengths=n,
                                                center=c[None])[0]


def sym3(co: torch.Tensor) -> torch.Tensor:
    """``(…, 3, 3)`` symmetric A from the first six coefficients ``(…, ≥6)``."""
    a00, a01, a02, a11, a12, a22 = co[..., 0], co[..., 1], co[..., 2], co[..., 3], co[..., 4], \
        co[..., 5]
    return torch.stack([torch.stack([a00, a01, a02], -1), torch.stack([a01, a11, a12], -1),
                        torch.stack([a02, a12, a22], -1)], -2)


def evaluate(q: torch.Tensor, co: torch.Tensor) -> torch.Tensor:
    """``d̂²(q) = qᵀAq − 2bᵀq + c`` for ``q (N, 3)`` and per-point coefficients ``co (N, 10)``."""
    A = sym3(co)
    Aq = (A @ q.unsqueeze(-1)).squeeze(-1)
    return (q * Aq).sum(-1) - 2 * (co[:, 6:9] * q).sum(-1) + co[:, 9]


def newton_terms_reference(points: torch.Tensor, T: torch.Tensor, center: torch.Tensor,
                           tree: _kd.TreeArrays, coeffs: torch.Tensor, depth: int, *,
                           weights: torch.Tensor | None = None, tau2: float = math.inf,
                           objective_only: bool = False) -> torch.Tensor:
    """PyTorch reference of :func:`newton_terms` (float64 per-point terms, same contract)."""
    Tp = T.to(device=points.device, dtype=points.dtype)
    q = points @ Tp[:3, :3].T + Tp[:3, 3]
    node = _kd.descend(tree, q, depth)
    co = coeffs[node].double()
    q = q.double()
    A = sym3(co)
    Aq = (A @ q.unsqueeze(-1)).squeeze(-1)
    h = (q * Aq).sum(-1) - 2 * (co[:, 6:9] * q).sum(-1) + co[:, 9]
    h = h.clamp_min(0)
    del A
    wt = torch.ones_like(h) if weights is None else weights.double()
    inl = h <= tau2
    w = torch.where(inl, wt, torch.zeros_like(wt))
    out = torch.zeros(N_TERMS, dtype=torch.float64, device=points.device)
    out[27] = (wt * torch.clamp(h, max=tau2)).sum()
    out[28] = (w > 0).sum()
    if objective_only:
        return out
    px, py, pz = (q - center.double().to(q.device)).unbind(-1)
    a00, a01, a02, a11, a12, a22 = co[:, :6].unbind(-1)
    gx, gy, gz = (Aq - co[:, 6:9]).unbind(-1)
    # u_i = A m_i with m_i = e_i × p, the rotation columns of Q = [−[p]ₓ | I]
    u0 = torch.stack([a02 * py - a01 * pz, a12 * py - a11 * pz, a22 * py - a12 * pz], -1)
    u1 = torch.stack([a00 * pz - a02 * px, a01 * pz - a12 * px, a02 * pz - a22 * px], -1)
    u2 = torch.stack([a01 * px - a00 * py, a11 * px - a01 * py, a12 * px - a02 * py], -1)
    zero = torch.zeros_like(px)
    m = [torch.stack([zero, -pz, py], -1), torch.stack([pz, zero, -px], -1),
         torch.stack([-py, px, zero], -1)]
    u = [u0, u1, u2]
    A = sym3(co)
    cols = []
    for i, j in TRIU:
        if j < 3:
            cols.append((m[i] * u[j]).sum(-1))
        elif i < 3:
            cols.append(u[i][:, j - 3])
        else:
            cols.append(A[:, i - 3, j - 3])
    g = [-(py * gz - pz * gy), -(pz * gx - px * gz), -(px * gy - py * gx), -gx, -gy, -gz]
    out[:27] = w @ torch.stack(cols + g, -1)
    return out


def _skew(v: torch.Tensor) -> torch.Tensor:
    z = torch.zeros_like(v[..., 0])
    return torch.stack([torch.stack([z, -v[..., 2], v[..., 1]], -1),
                        torch.stack([v[..., 2], z, -v[..., 0]], -1),
                        torch.stack([-v[..., 1], v[..., 0], z], -1)], -2)
