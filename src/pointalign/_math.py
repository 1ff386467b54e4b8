"""The shared formulas of the library, written once: the float64 PyTorch specification.

Every function here is batched over leading dimensions, computes in float64 (except where
it says "in the input's dtype") and never synchronises with the host. The Triton twins of
these functions live in :mod:`pointalign.kernels._tl_math` (same names, scalar form); the
test ``tests/test_math.py`` compares the two element by element. ``docs/math-map.md`` maps
each formula to its users.

Conventions (those of :mod:`pointalign.transforms`): quaternions ``(w, x, y, z)``, twists
``(ω, v)``, column vectors ``y = R x + t``.

Contents:

* :func:`skew`, :func:`quat_to_rot`, :func:`rot_to_quat`, :func:`so3_exp`, :func:`so3_log`,
  :func:`rotation_angle`.
* Horn's closed form (Horn 1987; Tamaki et al. eqs. 15-20): :func:`horn_matrix` N(S),
  :func:`top_eigenvector4`, :func:`horn_pose` (weighted moments → R, t).
* The one degeneracy rule, :func:`spans_plane`, with :data:`DEGENERACY_EPS`; the one
  determinacy rule of a whole registration, :func:`stability` with :data:`STABILITY_EPS`.
* Small symmetric eigen-solvers: 2×2 and 3×3 in closed form (:func:`symmetric_eigh2`,
  :func:`eigvalsh3`, :func:`eigh3`, :func:`smallest_eigenvector3`), 4×4 and 6×6 by
  ``torch.linalg.eigh``; the 4×4 SPD Cholesky solve :func:`solve_spd4`.
* :func:`least_norm_solve` (the point-to-plane 6×6 solve, least-norm on a rank-deficient
  system) and :func:`robust_weight` (the M-estimator weights w(r)).
"""

from __future__ import annotations

import math

import torch

#: ε of the one degeneracy rule (:func:`spans_plane`) and of the rank rule of
#: :func:`least_norm_solve`: a direction whose eigenvalue is ≤ ε × the largest is empty
DEGENERACY_EPS = 1e-10

#: the robust kernels of :func:`robust_weight`, in the order of the Triton ``KIND`` code
ROBUST_KINDS = ("none", "huber", "tukey", "cauchy")

#: a cross-covariance S counts as 0 when max|S_ij| ≤ this × the size of the moments it is
#: the difference of (it is then rounding noise: one point, coincident points)
HORN_NOISE = 1e-10

#: εI added to the normalised S by the soft family and RANSAC (``tie=HORN_TIE``): a tied
#: top eigenvalue of N(S) (one or two points) then resolves towards R = I
HORN_TIE = 1e-9


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64)


# ---- rotations --------------------------------------------------------------------------

def skew(v: torch.Tensor) -> torch.Tensor:
    """Cross-product matrices ``[v]× (…, 3, 3)`` of ``v (…, 3)`` (in the input's dtype)."""
    z = torch.zeros_like(v[..., 0])
    x, y, w = v[..., 0], v[..., 1], v[..., 2]
    return torch.stack(
        [torch.stack([z, -w, y], -1), torch.stack([w, z, -x], -1), torch.stack([-y, x, z], -1)],
        -2,
    )


def quat_to_rot(q: torch.Tensor) -> torch.Tensor:
    """Rotation matrices ``(…, 3, 3)`` of quaternions ``q (…, 4)`` = (w, x, y, z), in q's dtype.

    q is normalised first (a zero q gives I; no check: this runs inside device loops); then
    ``R = [[1−2(y²+z²), 2(xy−zw), 2(xz+yw)], [2(xy+zw), 1−2(x²+z²), 2(yz−xw)],
    [2(xz−yw), 2(yz+xw), 1−2(x²+y²)]]``.
    """
    n = q.norm(dim=-1, keepdim=True)
    w, x, y, z = (q / n.clamp_min(1e-300)).unbind(-1)
    return torch.stack(
        [
            1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w),
            2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w),
            2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y),
        ],
        -1,
    ).reshape(*q.shape[:-1], 3, 3)


def rot_to_quat(R: torch.Tensor) -> torch.Tensor:
    """Return unit quaternions ``(…, 4)`` (w ≥ 0) of rotations ``R (…, 3, 3)``, in R's dtype.

    Shepperd's method: the largest of the four candidate denominators, so it is stable for
    every rotation, including 180°.
    """
    m = R
    tr = m[..., 0, 0] + m[..., 1, 1] + m[..., 2, 2]
    choice = torch.stack([tr, m[..., 0, 0], m[..., 1, 1], m[..., 2, 2]], -1).argmax(-1)
    s0 = (1 + tr).clamp_min(1e-30).sqrt() * 2
    s1 = (1 + m[..., 0, 0] - m[..., 1, 1] - m[..., 2, 2]).clamp_min(1e-30).sqrt() * 2
    s2 = (1 + m[..., 1, 1] - m[..., 0, 0] - m[..., 2, 2]).clamp_min(1e-30).sqrt() * 2
    s3 = (1 + m[..., 2, 2] - m[..., 0, 0] - m[..., 1, 1]).clamp_min(1e-30).sqrt() * 2
    qs = torch.stack([
        torch.stack([0.25 * s0, (m[..., 2, 1] - m[..., 1, 2]) / s0,
                     (m[..., 0, 2] - m[..., 2, 0]) / s0, (m[..., 1, 0] - m[..., 0, 1]) / s0], -1),
        torch.stack([(m[..., 2, 1] - m[..., 1, 2]) / s1, 0.25 * s1,
                     (m[..., 0, 1] + m[..., 1, 0]) / s1, (m[..., 0, 2] + m[..., 2, 0]) / s1], -1),
        torch.stack([(m[..., 0, 2] - m[..., 2, 0]) / s2, (m[..., 0, 1] + m[..., 1, 0]) / s2,
                     0.25 * s2, (m[..., 1, 2] + m[..., 2, 1]) / s2], -1),
        torch.stack([(m[..., 1, 0] - m[..., 0, 1]) / s3, (m[..., 0, 2] + m[..., 2, 0]) / s3,
                     (m[..., 1, 2] + m[..., 2, 1]) / s3, 0.25 * s3], -1),
    ], -2)
    q = qs.gather(-2, choice[..., None, None].expand(*choice.shape, 1, 4))[..., 0, :]
    q = q / q.norm(dim=-1, keepdim=True)
    return torch.where(q[..., :1] < 0, -q, q)


#: below this θ² the Rodrigues coefficients are their Taylor series (exact to rounding)
_SMALL_ANGLE2 = 1e-12


def so3_exp(omega: torch.Tensor) -> torch.Tensor:
    """Rodrigues: rotation vectors ``ω (…, 3)`` (radians) → ``R (…, 3, 3)``, in ω's dtype.

    ``R = I + a [ω]× + b [ω]×²`` with ``a = sin θ / θ``, ``b = (1 − cos θ) / θ²``
    (θ = |ω|), and ``a = 1 − θ²/6``, ``b = 1/2 − θ²/24`` for θ² < 1e-12 (accurate near 0).
    """
    theta2 = (omega * omega).sum(-1)[..., None, None]
    small = theta2 < _SMALL_ANGLE2
    safe = torch.where(small, torch.ones_like(theta2), theta2.sqrt())
    a = torch.where(small, 1 - theta2 / 6, torch.sin(safe) / safe)
    b = torch.where(small, 0.5 - theta2 / 24, (1 - torch.cos(safe)) / (safe * safe))
    K = skew(omega)
    eye = torch.eye(3, dtype=omega.dtype, device=omega.device)
    return eye + a * K + b * (K @ K)


def so3_log(R: torch.Tensor) -> torch.Tensor:
    """Rotation vectors ``(…, 3)`` (|ω| ≤ π) of ``R (…, 3, 3)``, in R's dtype.

    Computed through the quaternion (stable near 0 and near π).
    """
    q = rot_to_quat(R)
    w = q[..., 0].clamp(-1, 1)
    v = q[..., 1:]
    s = v.norm(dim=-1)
    angle = 2 * torch.atan2(s, w)
    scale = torch.where(s > 1e-12, angle / s.clamp_min(1e-30), 2 / w.clamp_min(1e-30))
    return v * scale[..., None]


def invert_rigid(T: torch.Tensor) -> torch.Tensor:
    """Inverse of rigid ``T (…, 4, 4)``: ``[Rᵀ, −Rᵀ t]`` (exact, no matrix inverse)."""
    Rt = T[..., :3, :3].transpose(-1, -2)
    out = torch.zeros_like(T)
    out[..., :3, :3] = Rt
    out[..., :3, 3] = -(Rt @ T[..., :3, 3:])[..., 0]
    out[..., 3, 3] = 1
    return out


# ---- Horn's closed form -----------------------------------------------------------------

def rotation_angle(R: torch.Tensor) -> torch.Tensor:
    """Angles ``(…)`` in radians of rotations ``R (…, 3, 3)``, in R's dtype.

    ``atan2(sin θ, cos θ)`` from R's antisymmetric part (``2 sin θ n``) and its trace
    (``1 + 2 cos θ``): accurate near 0 and near π, and a few elementwise operations where
    ``|so3_log(R)|`` takes the quaternion's dozens.
    """
    a = R[..., 2, 1] - R[..., 1, 2]
    b = R[..., 0, 2] - R[..., 2, 0]
    c = R[..., 1, 0] - R[..., 0, 1]
    s = 0.5 * torch.sqrt(a * a + b * b + c * c)
    return torch.atan2(s, 0.5 * (R[..., 0, 0] + R[..., 1, 1] + R[..., 2, 2] - 1))


def horn_matrix(S: torch.Tensor) -> torch.Tensor:
    """Horn's symmetric 4×4 matrix ``N(S) (…, 4, 4)`` of cross-covariances ``S (…, 3, 3)``.

    With S = Σ w (x − x̄)(y − ȳ)ᵀ, the unit quaternion of N's largest eigenvalue is the
    rotation maximising Σ w (y − ȳ)ᵀ R (x − x̄) (Horn 1987; Tamaki et al. eq. 15)::

        [[Sxx+Syy+Szz, Syz−Szy,      Szx−Sxz,      Sxy−Syx    ],
         [Syz−Szy,     Sxx−Syy−Szz,  Sxy+Syx,      Szx+Sxz    ],
         [Szx−Sxz,     Sxy+Syx,      −Sxx+Syy−Szz, Syz+Szy    ],
         [Sxy−Syx,     Szx+Sxz,      Syz+Szy,      −Sxx−Syy+Szz]]
    """
    sxx, sxy, sxz = S[..., 0, 0], S[..., 0, 1], S[..., 0, 2]
    syx, syy, syz = S[..., 1, 0], S[..., 1, 1], S[..., 1, 2]
    szx, szy, szz = S[..., 2, 0], S[..., 2, 1], S[..., 2, 2]
    return torch.stack([
        torch.stack([sxx + syy + szz, syz - szy, szx - sxz, sxy - syx], -1),
        torch.stack([syz - szy, sxx - syy - szz, sxy + syx, szx + sxz], -1),
        torch.stack([szx - sxz, sxy + syx, -sxx + syy - szz, syz + szy], -1),
        torch.stack([sxy - syx, szx + sxz, syz + szy, -sxx - syy + szz], -1),
    ], -2)


def top_eigenvector4(N: torch.Tensor) -> torch.Tensor:
    """Return the unit eigenvector ``(…, 4)`` of the largest eigenvalue of ``N (…, 4, 4)``.

    The spec uses ``torch.linalg.eigh``; the device solver (``_tl_math.top_eigenvector4``)
    is repeated squaring of the shifted matrix. They agree wherever the top eigenvalue is
    separated from the next by more than ~1e-10 of ‖N‖_F (sign: either; q and −q are the
    same rotation).
    """
    return torch.linalg.eigh(_f64(N))[1][..., :, -1]


def horn_pose(W: torch.Tensor, sum_x: torch.Tensor, sum_y: torch.Tensor,
              cross: torch.Tensor, *, tie: float = 0.0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted moments → pose ``argmin Σ w ||R x + t − y||²`` (Horn 1987).

    ``x̄ = Σwx / W``, ``ȳ = Σwy / W``, ``S = Σ w x yᵀ − W x̄ ȳᵀ``; S is scaled by its
    largest entry (scale-free) and set to 0 when it is only rounding noise of the moments
    (max|S| ≤ :data:`HORN_NOISE` × (Σ|cross| + W |x̄|₁ |ȳ|₁)); then ``tie``·I is added
    (0: unbiased; :data:`HORN_TIE`: ties resolve towards R = I), q is the top eigenvector
    of N(S) (an S of 0 gives q = (1, 0, 0, 0)), ``R = R(q)`` and ``t = ȳ − R x̄``.

    Args:
        W: ``(…)`` total weight Σw.
        sum_x: ``(…, 3)`` Σ w x.
        sum_y: ``(…, 3)`` Σ w y.
        cross: ``(…, 3, 3)`` Σ w x yᵀ.
        tie: the εI tie-breaker (a Python float).

    Returns:
        ``(R (…, 3, 3), t (…, 3), ok (…) bool)`` float64, ``ok = W > 0`` and R, t finite;
        where not ok, R = I and t = 0.

    """
    W, sum_x, sum_y, cross = _f64(W), _f64(sum_x), _f64(sum_y), _f64(cross)
    Wc = W.clamp_min(1e-300)[..., None]
    xm, ym = sum_x / Wc, sum_y / Wc
    S = cross - W[..., None, None] * (xm[..., :, None] * ym[..., None, :])
    smax = S.abs().amax((-1, -2), keepdim=True)
    mag = cross.abs().sum((-1, -2), keepdim=True) + (
        W.abs()[..., None, None] * xm.abs().sum(-1)[..., None, None]
        * ym.abs().sum(-1)[..., None, None])
    S = torch.where(smax > HORN_NOISE * mag, S / smax.clamp_min(1e-300), torch.zeros_like(S))
    if tie:
        S = S + tie * torch.eye(3, dtype=S.dtype, device=S.device)
    q = top_eigenvector4(horn_matrix(S))
    zero = (S == 0).all(-1).all(-1)
    e0 = torch.zeros_like(q)
    e0[..., 0] = 1
    q = torch.where(zero[..., None], e0, q)
    R = quat_to_rot(q)
    t = ym - (R @ xm[..., None])[..., 0]
    ok = (W > 0) & torch.isfinite(R).all(-1).all(-1) & torch.isfinite(t).all(-1)
    eye = torch.eye(3, dtype=R.dtype, device=R.device)
    R = torch.where(ok[..., None, None], torch.nan_to_num(R), eye)
    t = torch.where(ok[..., None], torch.nan_to_num(t), torch.zeros_like(t))
    return R, t, ok


# ---- the one degeneracy rule ------------------------------------------------------------

def spans_plane(cov: torch.Tensor, eps: float = DEGENERACY_EPS) -> torch.Tensor:
    """Whether 3×3 covariances ``(…, 3, 3)`` span (at least) a plane: ``(…)`` bool.

    **The degeneracy rule of the library.** With eigenvalues λ₁ ≤ λ₂ ≤ λ₃ the test is
    ``e₂ > ε ‖C‖_F²`` where ``e₂ = λ₁λ₂ + λ₁λ₃ + λ₂λ₃ = (tr(C)² − ‖C‖_F²) / 2`` and
    ``‖C‖_F² = Σ λᵢ²``: no eigen-solver needed. Where λ₁ ≤ λ₂ ≪ λ₃ (near the threshold)
    this is ``λ₂ > ε λ₃`` to first order in λ₂/λ₃ (the rule differs from the eigenvalue
    form only within a factor 2 of ε). A line or a single point fails it; an empty
    covariance (0) fails it.
    """
    c = _f64(cov)
    tr = torch.diagonal(c, dim1=-2, dim2=-1).sum(-1)
    fro2 = (c * c).sum((-2, -1))
    return 0.5 * (tr * tr - fro2) > eps * fro2


# ---- the one determinacy rule of a registration ----------------------------------------

#: a pose is determined when :func:`stability` exceeds this. Measured on the CPU (the final
#: correspondences of ICP started at the ground truth, PCA normals from 20 neighbours):
#: real scans 0.06-0.21 (Stanford bunny 0.09-0.12, KITTI 0.18-0.19, the fast_gicp lidar
#: pair 0.06-0.14, 3DMatch 0.21, UWA 0.12-0.15); undetermined problems ≤ 2.2e-3 (a sphere
#: turned 20°, with and without 1 % noise: 0.8-2.2e-3; a cylinder turned about its axis
#: 2.5e-4; a plane moved in-plane, fewer than 6 points: 0)
STABILITY_EPS = 1e-2


def stability(H: torch.Tensor, extent: torch.Tensor) -> torch.Tensor:
    """Geometric stability of a registration: ``(…)`` float64 in [0, 1].

    ``H (…, 6, 6)``: the point-to-plane information matrix ``Σ w J Jᵀ`` of the final
    correspondences, ``J = [x̃ × n, n]`` (twist (ω, v) about a centre near the data);
    ``extent (…)``: the cloud's RMS radius about that centre (metres). With the rotational
    rows and columns divided by the extent (radians → metres at the cloud's size, Gelfand
    et al., "Geometrically stable sampling for the ICP algorithm", 3DIM 2003), the result
    is ``λ_min / λ_max``: 0 when some motion slides the source along the target without
    changing any residual (a plane moved in-plane, a sphere turned about its centre, a
    cylinder about its axis, collinear or coincident points, fewer than 6
    correspondences), so no objective can tell the true pose from its neighbours. A
    non-finite or empty H gives 0.
    """
    A = _f64(H)
    L = _f64(extent).clamp_min(1e-300)
    d = torch.ones(*A.shape[:-1], dtype=A.dtype, device=A.device)
    d[..., :3] = 1.0 / L[..., None]
    A = d[..., :, None] * A * d[..., None, :]
    ok = torch.isfinite(A).all(-1).all(-1)
    ev = torch.linalg.eigvalsh(torch.where(ok[..., None, None], A, torch.zeros_like(A)))
    top = ev[..., -1]
    r = ev[..., 0].clamp_min(0) / top.clamp_min(1e-300)
    return torch.where(ok & (top > 0), r, torch.zeros_like(r))


# ---- small symmetric eigen-solvers ------------------------------------------------------

def eigvalsh3(A: torch.Tensor) -> torch.Tensor:
    """Eigenvalues ``(…, 3)`` ascending of symmetric ``A (…, 3, 3)``, closed form (Smith 1961).

    With q = tr(A)/3, p = sqrt(tr((A − qI)²)/6), B = (A − qI)/p and φ = acos(det(B)/2)/3,
    the eigenvalues are q + 2p cos(φ + 2πk/3). In A's dtype.
    """
    a00, a11, a22 = A[..., 0, 0], A[..., 1, 1], A[..., 2, 2]
    a01, a02, a12 = A[..., 0, 1], A[..., 0, 2], A[..., 1, 2]
    q = (a00 + a11 + a22) / 3
    b00, b11, b22 = a00 - q, a11 - q, a22 - q
    p2 = b00 * b00 + b11 * b11 + b22 * b22 + 2 * (a01 * a01 + a02 * a02 + a12 * a12)
    p = (p2 / 6).sqrt()
    ps = torch.where(p > 0, p, torch.ones_like(p))
    c00, c11, c22 = b00 / ps, b11 / ps, b22 / ps
    c01, c02, c12 = a01 / ps, a02 / ps, a12 / ps
    det = (c00 * (c11 * c22 - c12 * c12) - c01 * (c01 * c22 - c12 * c02)
           + c02 * (c01 * c12 - c11 * c02))
    phi = torch.acos((det / 2).clamp(-1, 1)) / 3
    l_max = q + 2 * p * torch.cos(phi)
    l_min = q + 2 * p * torch.cos(phi + 2 * math.pi / 3)
    l_mid = 3 * q - l_max - l_min
    return torch.stack([l_min, l_mid, l_max], -1)


def _cross(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.linalg.cross(a, b, dim=-1)


def _null_vector(A: torch.Tensor, lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return a unit vector spanning the null space of ``A − λI``, and its squared raw norm.

    The vector is the largest cross product of two rows; its squared norm is small when λ is
    not a simple eigenvalue.
    """
    eye = torch.eye(3, dtype=A.dtype, device=A.device)
    Mm = A - lam[..., None, None] * eye
    r0, r1, r2 = Mm[..., 0, :], Mm[..., 1, :], Mm[..., 2, :]
    cands = torch.stack([_cross(r0, r1), _cross(r0, r2), _cross(r1, r2)], -2)
    n2 = (cands * cands).sum(-1)
    best = n2.argmax(-1)
    v = torch.gather(cands, -2, best[..., None, None].expand(*best.shape, 1, 3))[..., 0, :]
    nb = torch.gather(n2, -1, best[..., None])[..., 0]
    return v / nb.clamp_min(1e-300).sqrt()[..., None], nb


def _any_orthogonal(u: torch.Tensor) -> torch.Tensor:
    """Return a unit vector orthogonal to unit ``u (…, 3)``."""
    ax = torch.zeros_like(u)
    k = u.abs().argmin(-1)
    ax.scatter_(-1, k[..., None], 1.0)
    v = _cross(u, ax)
    return v / v.norm(dim=-1, keepdim=True).clamp_min(1e-300)


def _scaled(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``A (…, 3, 3)`` in float64 over its largest entry, and that scale ``(…,)``."""
    A64 = _f64(A)
    s = A64.abs().amax((-1, -2))
    s = torch.where(s > 0, s, torch.ones_like(s))
    return A64 / s[..., None, None], s


def smallest_eigenvector3(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the unit eigenvector of the smallest eigenvalue of ``A (…, 3, 3)``, closed form.

    Computed in float64. The matrix is first scaled by its largest entry. When the smallest
    eigenvalue is (nearly) repeated the eigenvector is not unique: the result is then a unit
    vector orthogonal to the eigenvector of the largest eigenvalue (any vector when all three
    coincide). Returns ``(vectors (…, 3), eigenvalues (…, 3) ascending)`` in A's dtype.
    """
    dt = A.dtype
    An, s = _scaled(A)
    lam = eigvalsh3(An)
    v, nv = _null_vector(An, lam[..., 0])
    gap = (lam[..., 1] - lam[..., 0])
    spread = (lam[..., 2] - lam[..., 0])
    # the largest cross product has norm ~ gap * spread for a simple eigenvalue
    simple = nv > (1e-8 * spread.clamp_min(1e-300)) ** 2
    simple &= gap > 1e-9 * spread.clamp_min(1e-300)
    u, nu = _null_vector(An, lam[..., 2])
    alt = _any_orthogonal(u)
    alt = torch.where((nu > 0)[..., None] & (spread > 0)[..., None], alt,
                      torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64, device=A.device))
    v = torch.where(simple[..., None], v, alt)
    return v.to(dt), (lam * s[..., None]).to(dt)


def eigh3(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All eigenpairs of symmetric ``A (…, 3, 3)`` in closed form (no LAPACK/cuSOLVER call).

    **The 3×3 eigen-solver of the library.** Eigenvalues by :func:`eigvalsh3`; the smallest
    eigenvector by :func:`smallest_eigenvector3`, the largest as the null vector of
    ``A − λ_max I`` made orthogonal to it (any orthogonal unit vector when ``λ_max`` is
    repeated), the middle one as their cross product. O(1) memory per matrix, in float64.

    Returns:
        ``(eigenvalues (…, 3) ascending, eigenvectors (…, 3, 3))`` in A's dtype; column
        ``j`` is the eigenvector of eigenvalue ``j``; the columns form a rotation (det +1).

    """
    dt = A.dtype
    An, s = _scaled(A)
    lam = eigvalsh3(An)
    v0, _ = smallest_eigenvector3(An)
    v2, n2 = _null_vector(An, lam[..., 2])
    spread = (lam[..., 2] - lam[..., 0]).clamp_min(1e-300)
    v2 = v2 - (v2 * v0).sum(-1, keepdim=True) * v0
    nrm = v2.norm(dim=-1, keepdim=True)
    simple = (n2 > (1e-8 * spread) ** 2) & (lam[..., 2] - lam[..., 1] > 1e-9 * spread)
    simple &= nrm[..., 0] > 0.5
    v2 = torch.where(simple[..., None], v2 / nrm.clamp_min(1e-300), _any_orthogonal(v0))
    v1 = _cross(v2, v0)
    V = torch.stack([v0, v1, v2], -1)
    return (lam * s[..., None]).to(dt), V.to(dt)


def symmetric_eigh2(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenpairs of the symmetric 2×2 ``[[a, b], [b, c]]`` (``a, b, c (…,)``) in closed form.

    ``λ = m ∓ r`` with ``m = (a + c)/2``, ``r = hypot((a − c)/2, b)``; the eigenvector of the
    larger is ``(cos θ, sin θ)``, ``θ = ½ atan2(2b, a − c)``, the smaller's ``(−sin θ, cos θ)``.
    No LAPACK/cuSOLVER call, O(1) memory per matrix, in the inputs' dtype.

    Returns:
        ``(eigenvalues (…, 2) ascending, eigenvectors (…, 2, 2))``; column ``j`` is the
        eigenvector of eigenvalue ``j``.

    """
    m = 0.5 * (a + c)
    r = torch.hypot(0.5 * (a - c), b)
    th = 0.5 * torch.atan2(2 * b, a - c)
    co, si = torch.cos(th), torch.sin(th)
    vecs = torch.stack([torch.stack([-si, co], -1), torch.stack([co, si], -1)], -1)
    return torch.stack([m - r, m + r], -1), vecs


def solve_spd4(M: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Solve ``M x = r`` for symmetric positive definite ``M (K, 4, 4)``, ``r (K, 4)``.

    Cholesky ``M = L Lᵀ`` unrolled over ``(K,)`` columns, then the two triangular solves (no
    batched LAPACK/cuSOLVER call, O(K) memory); in the inputs' dtype. Rows whose pivot is
    not positive give NaN. Returns ``x (K, 4)``.
    """
    n = 4
    L: dict[tuple[int, int], torch.Tensor] = {}
    for j in range(n):
        d = M[:, j, j] - sum((L[j, k] * L[j, k] for k in range(j)), torch.zeros_like(M[:, 0, 0]))
        ljj = torch.where(d > 0, d, torch.full_like(d, float("nan"))).sqrt()
        L[j, j] = ljj
        for i in range(j + 1, n):
            v = M[:, i, j] - sum((L[i, k] * L[j, k] for k in range(j)), torch.zeros_like(ljj))
            L[i, j] = v / ljj
    y: list[torch.Tensor] = []
    for i in range(n):
        y.append((r[:, i] - sum((L[i, k] * y[k] for k in range(i)), torch.zeros_like(r[:, 0])))
                 / L[i, i])
    x: dict[int, torch.Tensor] = {}
    for i in reversed(range(n)):
        x[i] = (y[i] - sum((L[k, i] * x[k] for k in range(i + 1, n)), torch.zeros_like(y[i])))\
            / L[i, i]
    return torch.stack([x[i] for i in range(n)], -1)


def eigh6(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenpairs of symmetric ``A (…, 6, 6)`` in float64.

    Returns ``(ascending eigenvalues (…, 6), vectors (…, 6, 6))`` (``torch.linalg.eigh``;
    the device solver is cyclic Jacobi, ``_tl_math.eigh6``).
    """
    return torch.linalg.eigh(_f64(A))


# ---- the point-to-plane solve -----------------------------------------------------------

def block_scales6(A: torch.Tensor) -> torch.Tensor:
    """``(…, 6)`` scales equalising the rotation and translation blocks of ``A (…, 6, 6)``.

    ``1/√(tr A_ωω / 3)`` for the three rotations and ``1/√(tr A_tt / 3)`` for the three
    translations (1 for an empty block). Whole blocks, not single entries: one noisy,
    nearly empty direction (an in-plane translation) stays nearly empty.
    """
    tr_r = (A[..., 0, 0] + A[..., 1, 1] + A[..., 2, 2]) / 3
    tr_t = (A[..., 3, 3] + A[..., 4, 4] + A[..., 5, 5]) / 3
    s_r = torch.where(tr_r > 0, 1.0 / tr_r.clamp_min(1e-300).sqrt(), torch.ones_like(tr_r))
    s_t = torch.where(tr_t > 0, 1.0 / tr_t.clamp_min(1e-300).sqrt(), torch.ones_like(tr_t))
    return torch.stack([s_r, s_r, s_r, s_t, s_t, s_t], -1)


def least_norm_solve(A: torch.Tensor, b: torch.Tensor, eps: float = DEGENERACY_EPS
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Least-norm solution of ``A x = b`` for symmetric PSD ``A (…, n, n)``, ``b (…, n)``.

    ``x = V diag(1/λ_k if λ_k > ε λ_max else 0) Vᵀ b`` (eigen pseudo-inverse): on a
    rank-deficient system (e.g. one plane leaves the in-plane translation free) the step on
    the determined directions, 0 along the others. A 6×6 system is the point-to-plane
    ``(ω, t)`` layout: it is first equalised by :func:`block_scales6` (``D A D y = D b``,
    ``x = D y``), so that the rule compares rotations and translations in the same units
    whatever the cloud's size (a 15 µm object's rotations would otherwise fall under ε).

    Returns:
        ``(x (…, n), full (…) bool, usable (…) bool)`` float64: ``full`` when no direction
        was dropped, ``usable`` when x is finite and some direction was kept (else x = 0).
        ``full`` implies ``usable``.

    """
    A, b = _f64(A), _f64(b)
    d = torch.ones_like(b)
    if A.shape[-1] == 6:
        d = block_scales6(A)
        A = d[..., :, None] * A * d[..., None, :]
        b = d * b
    ev, V = eigh6(A) if A.shape[-1] == 6 else torch.linalg.eigh(A)
    keep = ev > eps * ev[..., -1:].clamp_min(1e-300)
    inv = torch.where(keep, 1.0 / ev.clamp_min(1e-300), torch.zeros_like(ev))
    x = d * (V @ (inv[..., None] * (V.transpose(-1, -2) @ b[..., None])))[..., 0]
    usable = torch.isfinite(x).all(-1) & keep.any(-1)
    x = torch.where(usable[..., None], x, torch.zeros_like(x))
    return x, keep.all(-1) & usable, usable


# ---- robust weights ---------------------------------------------------------------------

def robust_weight(r: torch.Tensor, kind: str, k: float) -> torch.Tensor:
    """M-estimator weights ``w(r)`` (same shape and dtype as r) with scale ``k > 0``.

    ``"none"``: 1; ``"huber"``: min(1, k/|r|); ``"tukey"``: (1 − (r/k)²)² for |r| < k
    else 0; ``"cauchy"``: 1 / (1 + (r/k)²). Non-negative, 1 at r = 0.
    """
    a = r.abs()
    if kind == "none":
        return torch.ones_like(a)
    if kind == "huber":
        return torch.where(a <= k, torch.ones_like(a), k / a.clamp_min(1e-30))
    if kind == "tukey":
        return torch.where(a < k, (1 - (a / k) ** 2) ** 2, torch.zeros_like(a))
    if kind == "cauchy":
        return 1.0 / (1.0 + (a / k) ** 2)
    raise ValueError(f"kind: expected one of {ROBUST_KINDS}, got {kind!r}")
