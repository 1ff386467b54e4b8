"""Closed-form rigid transform estimators (batched; solved in float64).

Every estimator returns an :class:`Estimate`: ``transformation (…, 4, 4)`` float64
``T_target_source`` (``y ≈ R x + t``) and ``valid (…)`` bool. A problem is *degenerate*
when the data does not determine the motion: zero total weight, or source or target points
(weighted, centred) spanning less than a plane's worth of directions (all on a line, or a
single point). With ``strict=True`` (the default for direct calls) a degenerate problem
raises ``ValueError``; with ``strict=False`` (what iterative algorithms use) its entry is
the identity and ``valid`` is False. No estimator ever returns NaN or a reflection.

Batching: points ``(…, N, 3)`` with optional ``weights (…, N)``; padded batches are handled
by giving padding rows weight 0.

References: B. K. P. Horn, "Closed-form solution of absolute orientation using unit
quaternions", JOSA A 1987; S. Umeyama, PAMI 1991; Tamaki et al., "Softassign and EM-ICP
on GPU", eqs. 18-20 and 26 (the soft form); Y. Chen and G. Medioni 1992 (point-to-plane).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pointalign import _math, _validate, transforms

#: relative eigenvalue below which a covariance direction counts as empty (degenerate);
#: the one ε of :func:`pointalign._math.spans_plane`
DEGENERACY_EPS = _math.DEGENERACY_EPS


class Estimate(NamedTuple):
    """Estimated transform(s) and whether each problem was well posed."""

    transformation: torch.Tensor
    valid: torch.Tensor


class Moments(NamedTuple):
    """Weighted first and second moments of a set of (soft) correspondences.

    For weights m_ij between source x_i and target y_j (hard correspondences are the
    diagonal case): ``total = Σ m_ij``, ``sum_source = Σ_ij m_ij x_i``,
    ``sum_target = Σ_ij m_ij y_j``, ``cross = Σ_ij m_ij x_i y_jᵀ`` (3×3), all float64 with
    leading batch dims. ``source_cov`` / ``target_cov`` are the centred weighted
    covariances used only for the degeneracy test.
    """

    total: torch.Tensor
    sum_source: torch.Tensor
    sum_target: torch.Tensor
    cross: torch.Tensor
    source_cov: torch.Tensor
    target_cov: torch.Tensor


def _weighted_moments(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None) -> Moments:
    x = x.to(torch.float64)
    y = y.to(torch.float64)
    w = torch.ones(x.shape[:-1], dtype=torch.float64, device=x.device) if w is None \
        else w.to(device=x.device, dtype=torch.float64)
    W = w.sum(-1)
    denom = W.clamp_min(1e-300)[..., None]
    xm = (w[..., None] * x).sum(-2) / denom
    ym = (w[..., None] * y).sum(-2) / denom
    xc, yc = x - xm[..., None, :], y - ym[..., None, :]
    wx = w[..., None] * xc
    # the cross moment is assembled around the centroids for accuracy, then shifted back
    cross_c = wx.transpose(-1, -2) @ yc
    cross = cross_c + W[..., None, None] * (xm[..., :, None] * ym[..., None, :])
    return Moments(W, xm * W[..., None], ym * W[..., None], cross,
                   wx.transpose(-1, -2) @ xc, (w[..., None] * yc).transpose(-1, -2) @ yc)


def _spans_plane(cov: torch.Tensor) -> torch.Tensor:
    """Apply the degeneracy rule :func:`pointalign._math.spans_plane` (``(…, 3, 3)`` → ``(…)``).

    ``e₂ > ε ‖C‖_F²`` with ``e₂ = (tr² − ‖C‖_F²) / 2``, ≈ λ₂ > ε λ₃; it differs from
    :func:`_spans_plane_reference` (``λ₂ > ε λ₃`` by ``eigvalsh``) only within a factor 2
    of the threshold.
    """
    return _math.spans_plane(cov, DEGENERACY_EPS)


def _spans_plane_reference(cov: torch.Tensor) -> torch.Tensor:
    """Test ``λ₂ > ε λ₃`` with ``torch.linalg.eigvalsh`` (reference for :func:`_spans_plane`)."""
    ev = torch.linalg.eigvalsh(cov.to(torch.float64))  # ascending
    return ev[..., 1] > DEGENERACY_EPS * ev[..., 2].clamp_min(1e-300)


def _finish(T: torch.Tensor, valid: torch.Tensor, strict: bool, what: str) -> Estimate:
    eye = torch.eye(4, dtype=T.dtype, device=T.device).expand_as(T)
    T = torch.where(valid[..., None, None], T, eye)
    if strict and not bool(valid.all()):
        bad = (~valid).nonzero().flatten().tolist() if valid.dim() else []
        where = f" (batch entries {bad})" if bad else ""
        raise ValueError(
            f"{what}: degenerate input{where}: needs total weight > 0 and at least 3 "
            "non-collinear points in source and target"
        )
    return Estimate(T, valid)


def horn_matrix(S: torch.Tensor) -> torch.Tensor:
    """Horn's symmetric 4×4 matrix N(S) of cross-covariances ``S (…, 3, 3)``: ``(…, 4, 4)``.

    See :func:`pointalign._math.horn_matrix`.
    """
    return _math.horn_matrix(S)


def horn_matrix_reference(S: torch.Tensor) -> torch.Tensor:
    """N(S) as ``vec(S) @ HORN_BASIS`` (N is linear in S): a second form, for tests."""
    flat = S.reshape(*S.shape[:-2], 9)
    return (flat @ _constant(HORN_BASIS, flat)).reshape(*S.shape[:-2], 4, 4)


#: (9, 16): N(S) = vec(S) @ basis (row k: N of the k-th unit matrix)
HORN_BASIS = _math.horn_matrix(torch.eye(9, dtype=torch.float64).reshape(9, 3, 3)
                               ).reshape(9, 16)


def _rotation_basis() -> torch.Tensor:
    """(16, 9): R(q) = vec(q qᵀ) @ basis / |q|² (the quadratic form of a unit quaternion)."""
    K = torch.zeros(4, 4, 3, 3, dtype=torch.float64)
    # (i, j, row, col, coefficient) of q_i q_j in R[row, col]; q = (w, x, y, z) = 0..3
    for i, j, r, c, k in (
        (0, 0, 0, 0, 1), (1, 1, 0, 0, 1), (2, 2, 0, 0, -1), (3, 3, 0, 0, -1),
        (0, 0, 1, 1, 1), (1, 1, 1, 1, -1), (2, 2, 1, 1, 1), (3, 3, 1, 1, -1),
        (0, 0, 2, 2, 1), (1, 1, 2, 2, -1), (2, 2, 2, 2, -1), (3, 3, 2, 2, 1),
        (1, 2, 0, 1, 2), (0, 3, 0, 1, -2), (1, 3, 0, 2, 2), (0, 2, 0, 2, 2),
        (1, 2, 1, 0, 2), (0, 3, 1, 0, 2), (2, 3, 1, 2, 2), (0, 1, 1, 2, -2),
        (1, 3, 2, 0, 2), (0, 2, 2, 0, -2), (2, 3, 2, 1, 2), (0, 1, 2, 1, 2),
    ):
        K[i, j, r, c] = k
    return K.reshape(16, 9)


_ROTATION_BASIS = _rotation_basis()
_constants: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def _constant(c: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Return module constant ``c`` on ``like``'s device and dtype (copied once, cached)."""
    key = (id(c), like.device, like.dtype)
    out = _constants.get(key)
    if out is None:
        out = _constants[key] = c.to(device=like.device, dtype=like.dtype)
    return out


def quaternion_rotation(q: torch.Tensor) -> torch.Tensor:
    """Rotation matrices ``(…, 3, 3)`` of quaternions ``q (…, 4)`` = (w, x, y, z) ≠ 0.

    See :func:`pointalign._math.quat_to_rot`.
    """
    return _math.quat_to_rot(q)


def quaternion_rotation_reference(q: torch.Tensor) -> torch.Tensor:
    """``R = Σ_ij q_i q_j K_ij / |q|²`` (the quadratic form with a constant basis), for tests."""
    outer = (q[..., :, None] * q[..., None, :]).reshape(*q.shape[:-1], 16)
    R = outer @ _constant(_ROTATION_BASIS, outer)
    return (R / (q * q).sum(-1, keepdim=True)).reshape(*q.shape[:-1], 3, 3)


def horn_from_moments(m: Moments, *, strict: bool = True) -> Estimate:
    """Horn's quaternion method from weighted moments (the core all Horn variants share).

    :func:`pointalign._math.horn_pose`: with centroids x̄ = Σx/W, ȳ = Σy/W and
    S = cross − W x̄ ȳᵀ, the rotation is the unit quaternion of the largest eigenvalue of
    Horn's symmetric 4×4 matrix N(S); then t = ȳ − R x̄. Valid when W > 0 and both
    covariances pass the degeneracy rule :func:`pointalign._math.spans_plane`. Never
    synchronises with the host when ``strict=False``.
    """
    R, t, ok = _math.horn_pose(m.total, m.sum_source, m.sum_target, m.cross)
    valid = ok & _spans_plane(m.source_cov) & _spans_plane(m.target_cov)
    return _finish(transforms.make(R, t), valid, strict, "horn")


def horn(
    source: torch.Tensor,
    target: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    strict: bool = True,
) -> Estimate:
    """Least-squares rigid motion ``argmin Σ w_i ||R x_i + t − y_i||²`` by Horn's method.

    Args:
        source: ``(…, N, 3)`` float tensor, x_i.
        target: ``(…, N, 3)`` float tensor, y_i (corresponding row by row).
        weights: optional ``(…, N)`` non-negative weights (0 drops a row).
        strict: raise ``ValueError`` on a degenerate problem (False: report it as not
            valid instead; see the module docstring).

    """
    source, target, weights = _check_pairs(source, target, weights)
    return horn_from_moments(_weighted_moments(source, target, weights), strict=strict)


def horn_soft(
    source: torch.Tensor,
    target: torch.Tensor,
    row_sums: torch.Tensor,
    col_sums: torch.Tensor,
    cross: torch.Tensor,
    *,
    source_center: torch.Tensor | None = None,
    target_center: torch.Tensor | None = None,
    strict: bool = True,
) -> Estimate:
    """Horn's method for an N×M soft weight matrix M given only through its reductions.

    Tamaki et al. (eqs. 18-20, 26): with r_i = Σ_j m_ij, c_j = Σ_i m_ij,
    W = Σ r_i, x̄ = Σ r_i x_i / W, ȳ = Σ c_j y_j / W and
    S = Σ_ij m_ij (x_i − x̄)(y_j − ȳ)ᵀ = cross − W x̄ ȳᵀ, the rotation is Horn's. The matrix
    M is never needed.

    Args:
        source: ``(…, N, 3)`` source points x_i.
        target: ``(…, M, 3)`` target points y_j.
        row_sums: ``(…, N)`` r_i.
        col_sums: ``(…, M)`` c_j.
        cross: ``(…, 3, 3)`` ``Σ_ij m_ij (x_i − a)(y_j − b)ᵀ`` where a = ``source_center``
            and b = ``target_center`` (default 0): kernels centre coordinates on a rough
            centroid before accumulating in float32, to avoid cancellation.
        source_center: ``(…, 3)`` the shift a used in ``cross``.
        target_center: ``(…, 3)`` the shift b used in ``cross``.
        strict: raise ``ValueError`` on a degenerate problem (False: report it as not
            valid instead; see the module docstring).

    """
    x = source.to(torch.float64)
    y = target.to(torch.float64)
    r = row_sums.to(torch.float64)
    c = col_sums.to(torch.float64)
    a = torch.zeros_like(x[..., 0, :]) if source_center is None else source_center.double()
    b = torch.zeros_like(y[..., 0, :]) if target_center is None else target_center.double()
    W = r.sum(-1)
    sx = (r[..., None] * x).sum(-2)
    sy = (c[..., None] * y).sum(-2)
    # shift the cross moment back to the origin: Σ m (x-a)(y-b)ᵀ + a Σy ᵀ + Σx bᵀ − W a bᵀ
    S0 = cross.to(torch.float64) + a[..., :, None] * sy[..., None, :] \
        + sx[..., :, None] * b[..., None, :] \
        - W[..., None, None] * (a[..., :, None] * b[..., None, :])
    xm = sx / W.clamp_min(1e-300)[..., None]
    ym = sy / W.clamp_min(1e-300)[..., None]
    xc, yc = x - xm[..., None, :], y - ym[..., None, :]
    cov_x = (r[..., None] * xc).transpose(-1, -2) @ xc
    cov_y = (c[..., None] * yc).transpose(-1, -2) @ yc
    return horn_from_moments(Moments(W, sx, sy, S0, cov_x, cov_y), strict=strict)


def umeyama(
    source: torch.Tensor,
    target: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    with_scale: bool = False,
    strict: bool = True,
) -> Estimate:
    """Rigid (or similarity) motion by SVD of the weighted cross-covariance (Umeyama).

    ``R = U diag(1, 1, det(U Vᵀ)) Vᵀ`` from ``S_yx = U Σ Vᵀ`` (never a reflection).
    With ``with_scale`` the 3×3 block is ``s R`` (s > 0); the result is then not rigid.

    Args: as :func:`horn`.
    """
    source, target, weights = _check_pairs(source, target, weights)
    m = _weighted_moments(source, target, weights)
    W = m.total
    denom = W.clamp_min(1e-300)[..., None]
    xm, ym = m.sum_source / denom, m.sum_target / denom
    S = m.cross - W[..., None, None] * (xm[..., :, None] * ym[..., None, :])
    U, sig, Vh = torch.linalg.svd(S.transpose(-1, -2))  # S_yx = Σ w (y-ȳ)(x-x̄)ᵀ
    d = torch.sign(torch.linalg.det(U @ Vh))
    d = torch.where(d == 0, torch.ones_like(d), d)
    D = torch.diag_embed(torch.stack([torch.ones_like(d), torch.ones_like(d), d], -1))
    R = U @ D @ Vh
    if with_scale:
        var_x = torch.diagonal(m.source_cov, dim1=-2, dim2=-1).sum(-1)
        s = (sig * torch.diagonal(D, dim1=-2, dim2=-1)).sum(-1) / var_x.clamp_min(1e-300)
        R = R * s[..., None, None]
    t = ym - (R @ xm[..., None])[..., 0]
    valid = (W > 0) & _spans_plane(m.source_cov) & _spans_plane(m.target_cov)
    return _finish(transforms.make(torch.nan_to_num(R), torch.nan_to_num(t)), valid, strict,
                   "umeyama")


def point_to_plane_system(
    source: torch.Tensor,
    target: torch.Tensor,
    target_normals: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Build the normal equations of linearised point-to-plane ICP.

    Residual r_i = n_iᵀ (x_i − y_i), Jacobian J_i = [(x_i × n_i)ᵀ, n_iᵀ] w.r.t. the twist
    ξ = (ω, v) of a small motion ``x ↦ (I + [ω]×) x + v``.

    Returns:
        ``(JᵀWJ (…, 6, 6), JᵀWr (…, 6), Σ w r² (…))`` in float64.

    """
    x = source.to(torch.float64)
    y = target.to(torch.float64)
    n = target_normals.to(torch.float64)
    w = torch.ones(x.shape[:-1], dtype=torch.float64, device=x.device) if weights is None \
        else weights.to(device=x.device, dtype=torch.float64)
    J = torch.cat([torch.linalg.cross(x, n, dim=-1), n], -1)
    r = (n * (x - y)).sum(-1)
    wJ = w[..., None] * J
    return wJ.transpose(-1, -2) @ J, (wJ * r[..., None]).sum(-2), (w * r * r).sum(-1)


def solve_point_to_plane(
    JtJ: torch.Tensor, Jtr: torch.Tensor, *, strict: bool = True
) -> Estimate:
    """Solve ``JᵀJ ξ = −Jᵀr`` (float64) and turn the twist into a rigid transform.

    The rotation is ``exp([ω]×)`` (exactly orthonormal). A system whose 6×6 matrix is
    rank-deficient (e.g. a single plane leaves the in-plane translation free) is solved in
    the least-norm sense on its well-determined directions and reported as not valid (with
    ``strict=False`` that least-norm step is returned, not the identity; only an empty or
    non-finite system gives the identity).

    Args:
        JtJ: ``(…, 6, 6)``, e.g. from :func:`point_to_plane_system` or the fused
            reduction of ``kernels.normal_eq``.
        Jtr: ``(…, 6)``, from the same source as ``JtJ``.
        strict: raise ``ValueError`` on a rank-deficient system (False: return the
            least-norm step, reported as not valid).

    """
    xi, valid, _ = _math.least_norm_solve(JtJ, -Jtr.to(torch.float64), DEGENERACY_EPS)
    T = transforms.make(_math.so3_exp(xi[..., :3]), xi[..., 3:])
    if strict and not bool(valid.all()):
        raise ValueError(
            "point_to_plane: degenerate input: the correspondences leave some motion "
            "undetermined (e.g. all normals parallel); use strict=False for the least-norm step"
        )
    # rank-deficient systems keep their least-norm step: it is still the best update
    return Estimate(T, valid)


def point_to_plane(
    source: torch.Tensor,
    target: torch.Tensor,
    target_normals: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    strict: bool = True,
) -> Estimate:
    """One Gauss-Newton step of point-to-plane alignment.

    Minimises ``Σ w (nᵀ(R x + t − y))²`` linearised at the identity, solved as a 6×6 system
    in float64.

    Args:
        source: ``(…, N, 3)`` source points.
        target: ``(…, N, 3)`` target points (corresponding row by row).
        target_normals: ``(…, N, 3)`` unit normals at the targets.
        weights: optional ``(…, N)`` non-negative weights.
        strict: raise ``ValueError`` on a degenerate system (False: return the least-norm
            step, reported as not valid; see :func:`solve_point_to_plane`).

    """
    source, target, weights = _check_pairs(source, target, weights)
    target_normals = _validate._to_tensor("target_normals", target_normals)
    if target_normals.shape != target.shape:
        raise ValueError(
            f"target_normals: expected shape {tuple(target.shape)}, "
            f"got {tuple(target_normals.shape)}"
        )
    JtJ, Jtr, _ = point_to_plane_system(source, target, target_normals, weights)
    return solve_point_to_plane(JtJ, Jtr, strict=strict)


def _check_pairs(source, target, weights):
    """Coerce to tensors and check shapes, devices, finiteness; returns the tensors."""
    source = _validate._float("source", _validate._to_tensor("source", source), None)
    target = _validate._float("target", _validate._to_tensor("target", target), None)
    if weights is not None:
        weights = _validate._float("weights", _validate._to_tensor("weights", weights), None)
    if source.shape[-1:] != (3,) or source.dim() < 2:
        raise ValueError(f"source: expected shape (..., N, 3), got {tuple(source.shape)}")
    if target.shape != source.shape:
        raise ValueError(
            f"target: expected the source's shape {tuple(source.shape)} (row-wise "
            f"correspondences), got {tuple(target.shape)}"
        )
    if source.device != target.device:
        raise ValueError(f"source on {source.device} but target on {target.device}")
    if weights is not None:
        if weights.shape != source.shape[:-1]:
            raise ValueError(
                f"weights: expected shape {tuple(source.shape[:-1])}, got {tuple(weights.shape)}"
            )
        if bool((weights < 0).any()) or not bool(torch.isfinite(weights).all()):
            raise ValueError("weights: must be finite and non-negative")
    _validate._check_finite("source", source)
    _validate._check_finite("target", target)
    return source, target, weights
