"""The surface family's PyTorch specification and the constants every backend shares.

Each function here is the reference of the entry point of the same name (without
``_reference``) in :mod:`pointalign.kernels.surface`, with the same arguments and result:
the ``"torch"`` backend runs it, and the tests compare the numba and Triton kernels with it.
:mod:`.triton` and :mod:`.cpu` import their constants from here, never from the dispatcher.

* :func:`newton_terms_reference`: the fused Newton terms (layout :data:`N_TERMS`,
  :data:`TRIU`; :func:`unpack`), and the approximant helpers :func:`sym3`, :func:`evaluate`.
* :func:`node_frames_reference`, :func:`node_moments_reference`,
  :func:`node_radii_reference`: per-node mean, covariance, PCA frame and RMS radius, from
  float64 prefix sums over the tree-ordered points (:func:`node_sums`).
* :func:`quadric_sums_reference`: the normal equations of the per-node quadric fits of the
  second-order approximant.
* :func:`cell_partners`, :func:`cell_mean_sums_reference`,
  :func:`cell_mean_step_reference`: the approximate-ICP step (cell means as partners,
  Horn's sums and solve).

Tree arguments are the flat arrays :class:`pointalign.kernels.kdtree.TreeArrays`; node ``v``
of level ``l`` (``2^l − 1 <= v < 2^(l+1) − 1``) owns the tree-ordered points
``[start_v, end_v)``.
"""

from __future__ import annotations

import math

import torch

from pointalign import _math
from pointalign._ops import exclusive_cumsum_rows
from pointalign.kernels import kdtree as _kd
from pointalign.kernels import normal_eq

#: length of the Newton terms vector: F (21, upper triangle row-major), g (6), objective, inliers
N_TERMS = 29
#: index pairs (i, j), i <= j, of the 21 stored entries of the symmetric 6×6 F
TRIU = [(i, j) for i in range(6) for j in range(i, 6)]


def unpack(terms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """``(F (6, 6), g (6,), objective, inliers)`` from a ``(29,)`` float64 vector."""
    F = terms.new_zeros(6, 6)
    for k, (i, j) in enumerate(TRIU):
        F[i, j] = F[j, i] = terms[k]
    return F, terms[21:27].clone(), float(terms[27]), float(terms[28])


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


# ----------------------------------------------------------------------------- Newton terms


def newton_terms_reference(points: torch.Tensor, T: torch.Tensor, center: torch.Tensor,
                           tree: _kd.TreeArrays, coeffs: torch.Tensor, depth: int, *,
                           weights: torch.Tensor | None = None, tau2: float = math.inf,
                           objective_only: bool = False) -> torch.Tensor:
    """PyTorch reference of :func:`~pointalign.kernels.surface.newton_terms` (same contract).

    ``q = points @ R^T + t`` in the points' dtype, the descent to ``depth``, then every term
    in float64 per point and one weighted sum: returns the ``(29,)`` float64 terms.
    """
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


# ----------------------------------------------------------------------------- node statistics


def node_sizes(tree: _kd.TreeArrays) -> torch.Tensor:
    """``(n_nodes,)`` int64 number of points of every node."""
    return tree.end - tree.start


def node_sums(tree: _kd.TreeArrays, values: torch.Tensor) -> torch.Tensor:
    """Per-node sums ``(n_nodes, …)`` float64 of per-point ``values (M, …)`` in tree order.

    Differences of float64 prefix sums (the sums of
    :meth:`pointalign.search.kdtree.KDTreeIndex.node_sums`, whose values come in the
    caller's point order).
    """
    csum = exclusive_cumsum_rows(values.to(torch.float64))
    return csum[tree.end] - csum[tree.start]


def node_moments_reference(tree: _kd.TreeArrays) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``(K, 3)`` and covariance ``(K, 3, 3)`` float64 of every node's points.

    ``cov = Σ ppᵀ / n − mean meanᵀ`` from prefix sums of the raw coordinates and their
    products, symmetrised.
    """
    pts = tree.points.double()
    size = node_sizes(tree).double()
    mean = node_sums(tree, pts) / size[:, None]
    second = node_sums(tree, (pts[:, :, None] * pts[:, None, :]).reshape(-1, 9)).reshape(-1, 3, 3)
    cov = second / size[:, None, None] - mean[:, :, None] * mean[:, None, :]
    return mean, 0.5 * (cov + cov.transpose(1, 2))


def node_radii_reference(tree: _kd.TreeArrays) -> torch.Tensor:
    """RMS distance ``(K,)`` float64 of every node's points to their mean.

    ``sqrt(max(Σ|p|² / n − |mean|², 0))`` from prefix sums (the trace of the covariance).
    """
    pts = tree.points.double()
    size = node_sizes(tree).double().clamp_min(1)
    mean = node_sums(tree, pts) / size[:, None]
    sq = node_sums(tree, (pts * pts).sum(-1)) / size
    return (sq - (mean * mean).sum(-1)).clamp_min(0).sqrt()


def node_frames_reference(tree: _kd.TreeArrays, min_frame_points: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean ``(K, 3)``, PCA frame ``(K, 3, 3)`` and RMS radius ``(K,)`` of every node, float64.

    ``frame[:, :, 0..2]`` are the eigenvectors of the node's covariance
    (:func:`node_moments_reference`) ordered ``(e1, e2, n)``: largest, middle, smallest
    eigenvalue (the normal), by the closed-form :func:`pointalign._math.eigh3`; the radius
    is ``sqrt(Σ max(λ, 0))``. Nodes of fewer than ``min_frame_points`` points take their
    parent's frame (level by level, so a chain of small nodes inherits from the first large
    ancestor).
    """
    mean, cov = node_moments_reference(tree)
    evals, evecs = _math.eigh3(cov)  # ascending
    frame = torch.stack([evecs[:, :, 2], evecs[:, :, 1], evecs[:, :, 0]], -1)
    radius = evals.clamp_min(0).sum(-1).sqrt()
    small = node_sizes(tree) < min_frame_points
    if bool(small.any()):
        for level in range(1, tree.depth + 1):
            ids = torch.arange(2**level - 1, 2 ** (level + 1) - 1, device=small.device)
            sel = ids[small[ids]]
            frame[sel] = frame[(sel - 1) // 2]
    return mean, frame, radius


def quadric_sums_reference(tree: _kd.TreeArrays, mean: torch.Tensor, frame: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the normal equations ``(K, 4, 4)`` and right sides ``(K, 4)`` of quadric fits.

    Each node's points in its frame, ``(u, v, w) = (p − mean_v) · frame_v`` (``mean (K, 3)``,
    ``frame (K, 3, 3)`` float64 as :func:`node_frames_reference` returns them), give
    ``φ = (u², uv, v², 1)``; the sums are ``Σ φφᵀ`` and ``Σ φ w`` in float64, level by level.
    """
    K = tree.n_nodes
    dev = tree.points.device
    ne = torch.zeros(K, 4, 4, dtype=torch.float64, device=dev)
    rhs = torch.zeros(K, 4, dtype=torch.float64, device=dev)
    tp = tree.points.double()
    m = tp.shape[0]
    for level in range(tree.depth + 1):
        b = _kd.level_bounds(m, level, dev)
        seg = torch.repeat_interleave(torch.arange(2**level, device=dev), b[1:] - b[:-1],
                                      output_size=m) + (2**level - 1)
        local = ((tp - mean[seg]).unsqueeze(1) @ frame[seg]).squeeze(1)  # (m, 3): u, v, w
        u, v, w = local[:, 0], local[:, 1], local[:, 2]
        phi = torch.stack([u * u, u * v, v * v, torch.ones_like(u)], -1)
        ne.index_add_(0, seg, phi[:, :, None] * phi[:, None, :])
        rhs.index_add_(0, seg, phi * w[:, None])
    return ne, rhs


# ----------------------------------------------------------------------------- cell means


def cell_partners(points: torch.Tensor, T: torch.Tensor, tree: _kd.TreeArrays,
                  means: torch.Tensor, depth: int | torch.Tensor, tau2: float = math.inf
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Move ``points (N, 3)`` by ``T (4, 4)`` and pair each with its cell's mean.

    ``q = points @ R^T + t`` in the points' dtype (one ``baddbmm``, T rounded to that
    dtype), the node of level ``depth`` whose cell holds ``q`` (no backtracking), and -1
    where ``||q − means[node]||² > tau2``. Returns ``(q (N, 3), node (N,) int64)``.
    """
    Tp = T.to(device=points.device, dtype=points.dtype)
    q = torch.baddbmm(Tp[None, None, :3, 3], points[None], Tp[None, :3, :3].transpose(1, 2))[0]
    node = _kd.descend(tree, q, depth)
    if math.isfinite(tau2):
        d2 = ((q - means[node]) ** 2).sum(-1)
        node = torch.where(d2 <= tau2, node, torch.full_like(node, -1))
    return q, node


def cell_mean_sums_reference(points: torch.Tensor, T: torch.Tensor, tree: _kd.TreeArrays,
                             means: torch.Tensor, depth: int, *, tau2: float = math.inf,
                             center: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference of :func:`~pointalign.kernels.surface.cell_mean_sums` (same contract).

    The moves in the points' dtype, the truncation test in float64, then
    :func:`pointalign.kernels.normal_eq.normal_equations_reference` (point-to-point, unit
    weights) on the pairs: the ``(30,)`` float64 sums.
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


def cell_mean_step_reference(source: torch.Tensor, means: torch.Tensor, T: torch.Tensor,
                             Tf: torch.Tensor, tree: _kd.TreeArrays,
                             depth: int | torch.Tensor, *,
                             tau2: float, lengths: torch.Tensor, center: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, ...]:
    """PyTorch reference of :func:`~pointalign.kernels.surface.cell_mean_step`.

    :func:`cell_partners` at ``Tf``, then Horn's sums
    (:func:`pointalign.kernels.normal_eq.normal_equations_reference`) and the float64 solve
    (:func:`pointalign.kernels.normal_eq.solve_update_reference`); returns ``(sums (1, 30),
    D (1, 4, 4), T_new (1, 4, 4) float64, T_new float32, flags (1, 2) int32)``.
    """
    x, node = cell_partners(source[0], Tf[0], tree, means[0], depth, tau2)
    sums = normal_eq.normal_equations_reference(x[None], means, node[None], lengths=lengths,
                                                center=center)
    D, T_new, flags = normal_eq.solve_update_reference(sums, center, T, plane=False, eps=eps)
    return sums, D, T_new, T_new.float(), flags
