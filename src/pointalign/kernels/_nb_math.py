"""The shared formulas as numba helpers: the CPU twins of :mod:`pointalign._math`.

Same names and meanings as the float64 PyTorch spec (and as the Triton helpers of
:mod:`pointalign.kernels._tl_math`); ``tests/kernels/test_nb_math.py`` compares each helper
with its spec element by element, and ``docs/math-map.md`` maps each formula to its users in
the three languages. Every ``kernels/<family>/cpu.py`` takes these formulas from here.

Helpers work on float64 scalars and return tuples (a small matrix is its upper triangle or
its row-major entries, as in ``_tl_math``); the scalar ones are compiled into their callers
(``inline="always"``: no call in the hot loops). Only the 4×4 Jacobi solver and Horn's pose
use small scratch arrays, passed in by the caller (one set per thread, no allocation per
call). numba compiles without fastmath, so no FMA contraction changes the rounding: each
helper does the IEEE operations of the spec in the order written here.

Contents:

* :func:`robust_weight` (the M-estimator weights, kind codes of :data:`ROBUST_CODE`).
* :func:`quat_to_rot`, :func:`horn_matrix`, :func:`top_eigenvector4` (cyclic Jacobi),
  :func:`horn_pose` (moments → pose, with :data:`HORN_NOISE` and ``tie``).
* Horn's weighted moments, one pair at a time: :func:`add_horn_moments` (W, Σwx, Σwy,
  Σ w x yᵀ) and :func:`add_horn` (those plus the upper triangles of Σ w x xᵀ, Σ w y yᵀ).
* The degeneracy rule :func:`spans_plane` (with :data:`DEGENERACY_EPS`).
* The closed-form 3×3 symmetric eigen-solver: :func:`eigvalsh3`, :func:`null_vector3`,
  :func:`any_orthogonal3`, :func:`scaled3`, :func:`smallest_eigenvector3`, :func:`eigh3`.

Not here: rotation angles, so(3) exp/log and the 6×6 least-norm solve (no numba kernel
computes them; the CPU runs the spec or NumPy for those).

numba's on-disk cache of a kernel does not notice a change of a helper it compiled in from
this module: after editing this file, delete the ``__pycache__/*.nbi``/``*.nbc`` files of
the ``kernels`` folders (or set ``NUMBA_CACHE_DIR`` to a fresh folder).
"""

from __future__ import annotations

import math

import numpy as np

from pointalign import _math
from pointalign.kernels._numba import njit

#: kind → code of :func:`robust_weight` (the order of ``_math.ROBUST_KINDS``, as the Triton
#: ``KIND``)
ROBUST_CODE = {kind: code for code, kind in enumerate(_math.ROBUST_KINDS)}
#: the spec's constants (compiled in as numba globals)
HORN_NOISE = _math.HORN_NOISE
HORN_TIE = _math.HORN_TIE
DEGENERACY_EPS = _math.DEGENERACY_EPS
#: Jacobi sweeps at most in :func:`top_eigenvector4` (a 4×4 converges quadratically: 3-5
#: reach rounding)
MAX_SWEEPS = 30


# ---- robust weights ---------------------------------------------------------------------

@njit(cache=True, nogil=True, inline="always")
def robust_weight(r, kind, scale):
    """``_math.robust_weight`` of one residual ``r``; kind 0 none, 1 huber, 2 tukey, 3 cauchy.

    ``scale > 0``; the operations of the spec: Huber ``k / max(|r|, 1e-30)``, Tukey
    ``(1 − (|r|/k)²)²`` for ``|r| < k``, Cauchy ``1 / (1 + (|r|/k)²)``.
    """
    a = abs(r)
    if kind == 0:
        return 1.0
    if kind == 1:
        return 1.0 if a <= scale else scale / max(a, 1e-30)
    if kind == 2:
        if a < scale:
            u = 1.0 - (a / scale) ** 2
            return u * u
        return 0.0
    return 1.0 / (1.0 + (a / scale) ** 2)


# ---- rotations --------------------------------------------------------------------------

@njit(cache=True, nogil=True, inline="always")
def quat_to_rot(qw, qx, qy, qz):
    """``_math.quat_to_rot``: (w, x, y, z), normalised first → R as a 9-tuple (row-major).

    The normalisation multiplies by ``1 / max(|q|, 1e-300)`` (as ``_tl_math``; the spec
    divides by the norm: the two differ by rounding).
    """
    inv = 1.0 / max(math.sqrt(qw * qw + qx * qx + qy * qy + qz * qz), 1e-300)
    w = qw * inv
    x = qx * inv
    y = qy * inv
    z = qz * inv
    return (1.0 - 2.0 * (y * y + z * z), 2.0 * (x * y - z * w), 2.0 * (x * z + y * w),
            2.0 * (x * y + z * w), 1.0 - 2.0 * (x * x + z * z), 2.0 * (y * z - x * w),
            2.0 * (x * z - y * w), 2.0 * (y * z + x * w), 1.0 - 2.0 * (x * x + y * y))


# ---- Horn's closed form -----------------------------------------------------------------

@njit(cache=True, nogil=True, inline="always")
def horn_matrix(S):
    """``_math.horn_matrix``: S (9 entries, row-major 3×3) → N(S) as its upper triangle.

    The 10-tuple (n00, n01, n02, n03, n11, n12, n13, n22, n23, n33), as ``_tl_math``. Nine
    entries are the spec's sums in the spec's order (``−Sxx + Syy − Szz`` as
    ``Syy − Sxx − Szz``: the same bits); n33 is ``(Szz − Sxx) − Syy`` where the spec has
    ``(−Sxx − Syy) + Szz`` (the order the CPU Horn kernel always had: within two roundings).
    """
    return (S[0] + S[4] + S[8], S[5] - S[7], S[6] - S[2], S[1] - S[3],
            S[0] - S[4] - S[8], S[1] + S[3], S[6] + S[2],
            S[4] - S[0] - S[8], S[5] + S[7],
            S[8] - S[0] - S[4])


@njit(cache=True, nogil=True)
def top_eigenvector4(A, V, q):
    """``_math.top_eigenvector4`` by cyclic Jacobi: write the unit top eigenvector into ``q (4,)``.

    ``A (4, 4)`` symmetric is overwritten (it ends diagonal); ``V (4, 4)`` is scratch (the
    accumulated rotations). Sweeps until the off-diagonal part is below 1e-18 of ‖A‖_F (at
    most :data:`MAX_SWEEPS`), rotations as ``_tl_math._jacobi_coefficients`` (Golub & Van
    Loan, Alg. 8.4.2): exact to float64 rounding wherever the top eigenvalue is separated
    from the next, as the spec's ``eigh``. On a tie of the top diagonal entries the first
    is taken. Sign: either (q and −q are the same rotation). The stop test squares the
    entries: for ‖A‖ within ~1e±150 (:func:`horn_pose` passes ‖N‖ ≈ 1).
    """
    for i in range(4):
        for j in range(4):
            V[i, j] = 1.0 if i == j else 0.0
    for _ in range(MAX_SWEEPS):
        off = 0.0
        fro = 0.0
        for i in range(4):
            fro += A[i, i] * A[i, i]
            for j in range(i + 1, 4):
                off += A[i, j] * A[i, j]
        if not off > 1e-36 * (fro + 2.0 * off):  # ‖offdiag‖ ≤ 1e-18 ‖A‖_F; stops on NaN too
            break
        for p in range(3):
            for r in range(p + 1, 4):
                apq = A[p, r]
                if abs(apq) <= 1e-19 * math.sqrt(fro):  # negligible for the stop test (or 0)
                    continue
                th = (A[r, r] - A[p, p]) / (2.0 * apq)
                t = (1.0 if th >= 0 else -1.0) / (abs(th) + math.sqrt(th * th + 1.0))
                c = 1.0 / math.sqrt(t * t + 1.0)
                s = t * c
                A[p, p] -= t * apq
                A[r, r] += t * apq
                A[p, r] = 0.0
                A[r, p] = 0.0
                for k in range(4):
                    if k != p and k != r:
                        akp = A[k, p]
                        akr = A[k, r]
                        A[k, p] = c * akp - s * akr
                        A[p, k] = A[k, p]
                        A[k, r] = s * akp + c * akr
                        A[r, k] = A[k, r]
                for k in range(4):
                    vkp = V[k, p]
                    vkr = V[k, r]
                    V[k, p] = c * vkp - s * vkr
                    V[k, r] = s * vkp + c * vkr
    top = 0
    for i in range(1, 4):
        if A[i, i] > A[top, top]:
            top = i
    n2 = 0.0
    for k in range(4):
        n2 += V[k, top] * V[k, top]
    inv = 1.0 / math.sqrt(max(n2, 1e-300))
    for k in range(4):
        q[k] = V[k, top] * inv


@njit(cache=True, nogil=True)
def horn_pose(mom, tie, S, A, V, q, T):
    """``_math.horn_pose``: float64 moments → pose ``T (4, 4)``; return ``ok``.

    ``mom (16,)``: W, Σwx (3), Σwy (3), Σ w x yᵀ (9, row-major). S = cross − W x̄ ȳᵀ is
    divided by its largest |entry| when that exceeds HORN_NOISE × (Σ|cross| + W |x̄|₁ |ȳ|₁),
    else set to 0; then ``tie``·I; q = the top eigenvector of N(S), (1, 0, 0, 0) when S = 0;
    R = R(q), t = ȳ − R x̄. Where not ok (W ≤ 0, or R, t not finite) T = I.
    ``S (9,)``, ``A, V (4, 4)``, ``q (4,)`` are scratch.

    Order of operations: S's entries as the spec's (``c − W (x̄_i ȳ_j)``); the noise
    magnitude adds the nine |cross| after ``W |x̄|₁ |ȳ|₁`` (as ``_tl_math``); S is divided
    by ``smax`` (the spec; ``_tl_math`` multiplies by its reciprocal).
    """
    W = mom[0]
    Wc = max(W, 1e-300)
    xm0 = mom[1] / Wc
    xm1 = mom[2] / Wc
    xm2 = mom[3] / Wc
    ym0 = mom[4] / Wc
    ym1 = mom[5] / Wc
    ym2 = mom[6] / Wc
    xm = (xm0, xm1, xm2)
    ym = (ym0, ym1, ym2)
    smax = 0.0
    mag = abs(W) * (abs(xm0) + abs(xm1) + abs(xm2)) * (abs(ym0) + abs(ym1) + abs(ym2))
    for i in range(3):
        for j in range(3):
            c = mom[7 + 3 * i + j]
            s = c - W * (xm[i] * ym[j])
            S[3 * i + j] = s
            mag += abs(c)
            a = abs(s)
            if a > smax or a != a:  # NaN propagates, as amax
                smax = a
    keep = smax > HORN_NOISE * mag
    zero = True
    for k in range(9):
        s = S[k] / max(smax, 1e-300) if keep else 0.0
        if k % 4 == 0:
            s += tie
        S[k] = s
        if s != 0.0:
            zero = False
    if zero:
        q[0] = 1.0
        q[1] = 0.0
        q[2] = 0.0
        q[3] = 0.0
    else:
        n = horn_matrix(S)
        A[0, 0], A[0, 1], A[0, 2], A[0, 3] = n[0], n[1], n[2], n[3]
        A[1, 1], A[1, 2], A[1, 3] = n[4], n[5], n[6]
        A[2, 2], A[2, 3] = n[7], n[8]
        A[3, 3] = n[9]
        for i in range(4):
            for j in range(i):
                A[i, j] = A[j, i]
        top_eigenvector4(A, V, q)
    R = quat_to_rot(q[0], q[1], q[2], q[3])
    t0 = ym0 - (R[0] * xm0 + R[1] * xm1 + R[2] * xm2)
    t1 = ym1 - (R[3] * xm0 + R[4] * xm1 + R[5] * xm2)
    t2 = ym2 - (R[6] * xm0 + R[7] * xm1 + R[8] * xm2)
    ok = W > 0 and np.isfinite(t0) and np.isfinite(t1) and np.isfinite(t2)
    for k in range(9):
        ok = ok and np.isfinite(R[k])
    for i in range(3):
        for j in range(3):
            T[i, j] = R[3 * i + j] if ok else (1.0 if i == j else 0.0)
    T[0, 3] = t0 if ok else 0.0
    T[1, 3] = t1 if ok else 0.0
    T[2, 3] = t2 if ok else 0.0
    T[3, 0] = 0.0
    T[3, 1] = 0.0
    T[3, 2] = 0.0
    T[3, 3] = 1.0
    return ok


# ---- Horn's weighted moments ------------------------------------------------------------

@njit(cache=True, nogil=True, inline="always")
def add_horn_moments(acc, w, x0, x1, x2, y0, y1, y2):
    """Add one weighted pair (x, y) to Horn's moments ``acc[0:16]`` (float64).

    The layout of :func:`horn_pose`'s ``mom``: W, Σwx, Σwy, Σ w x yᵀ (row-major), each term
    formed as ``w·x``, ``w·y``, ``(w·x_i)·y_j`` (the moments of
    ``kernels.horn.horn_moments``). ``w = 1.0`` adds the unweighted pair exactly.
    """
    acc[0] += w
    wx0, wx1, wx2 = w * x0, w * x1, w * x2
    acc[1] += wx0
    acc[2] += wx1
    acc[3] += wx2
    acc[4] += w * y0
    acc[5] += w * y1
    acc[6] += w * y2
    acc[7] += wx0 * y0
    acc[8] += wx0 * y1
    acc[9] += wx0 * y2
    acc[10] += wx1 * y0
    acc[11] += wx1 * y1
    acc[12] += wx1 * y2
    acc[13] += wx2 * y0
    acc[14] += wx2 * y1
    acc[15] += wx2 * y2


@njit(cache=True, nogil=True, inline="always")
def add_horn(acc, w, x0, x1, x2, y0, y1, y2):
    """Add one weighted pair (x, y) to Horn's sums ``acc[0:28]`` (float64).

    The layout of :mod:`pointalign.kernels.normal_eq`: :func:`add_horn_moments`' 16, then
    the upper triangles of Σ w x xᵀ and Σ w y yᵀ (terms ``(w·x_i)·x_j``, ``(w·y_i)·y_j``).
    """
    add_horn_moments(acc, w, x0, x1, x2, y0, y1, y2)
    wx0, wx1, wx2 = w * x0, w * x1, w * x2
    wy0, wy1, wy2 = w * y0, w * y1, w * y2
    acc[16] += wx0 * x0
    acc[17] += wx0 * x1
    acc[18] += wx0 * x2
    acc[19] += wx1 * x1
    acc[20] += wx1 * x2
    acc[21] += wx2 * x2
    acc[22] += wy0 * y0
    acc[23] += wy0 * y1
    acc[24] += wy0 * y2
    acc[25] += wy1 * y1
    acc[26] += wy1 * y2
    acc[27] += wy2 * y2


# ---- the one degeneracy rule ------------------------------------------------------------

@njit(cache=True, nogil=True, inline="always")
def spans_plane(c00, c01, c02, c11, c12, c22, eps):
    """``_math.spans_plane``: ``(tr² − ‖C‖_F²) / 2 > ε ‖C‖_F²`` for a symmetric 3×3 C.

    C given by its upper triangle (≈ λ₂ > ε λ₃; no eigen-solve). ``‖C‖_F²`` is summed as
    ``_tl_math`` does (diagonal, then twice the off-diagonal); the spec sums the nine
    squares, so the two can differ only within rounding of the threshold.
    """
    tr = c00 + c11 + c22
    fro2 = c00 * c00 + c11 * c11 + c22 * c22 + 2.0 * (c01 * c01 + c02 * c02 + c12 * c12)
    return 0.5 * (tr * tr - fro2) > eps * fro2


# ---- the closed-form 3×3 symmetric eigen-solver -----------------------------------------

@njit(cache=True, nogil=True, inline="always")
def eigvalsh3(a00, a01, a02, a11, a12, a22):
    """``_math.eigvalsh3``: ascending eigenvalues ``(l_min, l_mid, l_max)`` of a symmetric 3×3.

    Smith's closed form in the spec's order of operations (A given by its upper triangle):
    q = tr/3, p = sqrt(tr((A − qI)²)/6), det of (A − qI)/p, φ = acos(det/2)/3.
    """
    q = (a00 + a11 + a22) / 3
    b00, b11, b22 = a00 - q, a11 - q, a22 - q
    p2 = b00 * b00 + b11 * b11 + b22 * b22 + 2 * (a01 * a01 + a02 * a02 + a12 * a12)
    p = math.sqrt(p2 / 6)
    ps = p if p > 0 else 1.0
    c00, c11, c22 = b00 / ps, b11 / ps, b22 / ps
    c01, c02, c12 = a01 / ps, a02 / ps, a12 / ps
    det = (c00 * (c11 * c22 - c12 * c12) - c01 * (c01 * c22 - c12 * c02)
           + c02 * (c01 * c12 - c11 * c02))
    phi = math.acos(min(max(det / 2, -1.0), 1.0)) / 3
    l_max = q + 2 * p * math.cos(phi)
    l_min = q + 2 * p * math.cos(phi + 2 * math.pi / 3)
    l_mid = 3 * q - l_max - l_min
    return l_min, l_mid, l_max


@njit(cache=True, nogil=True, inline="always")
def null_vector3(a00, a01, a02, a11, a12, a22, lam):
    """``_math._null_vector``: ``(x, y, z, n2)``, the unit null vector of ``A − λI``.

    The largest (the first on ties) of the cross products r0 × r1, r0 × r2, r1 × r2 of the
    rows of A − λI, divided by ``sqrt(max(n2, 1e-300))``; ``n2`` is its squared raw norm
    (small when λ is not a simple eigenvalue).
    """
    r00, r01, r02 = a00 - lam, a01, a02
    r10, r11, r12 = a01, a11 - lam, a12
    r20, r21, r22 = a02, a12, a22 - lam
    x0 = r01 * r12 - r02 * r11
    y0 = r02 * r10 - r00 * r12
    z0 = r00 * r11 - r01 * r10
    x1 = r01 * r22 - r02 * r21
    y1 = r02 * r20 - r00 * r22
    z1 = r00 * r21 - r01 * r20
    x2 = r11 * r22 - r12 * r21
    y2 = r12 * r20 - r10 * r22
    z2 = r10 * r21 - r11 * r20
    n0 = x0 * x0 + y0 * y0 + z0 * z0
    n1 = x1 * x1 + y1 * y1 + z1 * z1
    n2 = x2 * x2 + y2 * y2 + z2 * z2
    if n0 >= n1 and n0 >= n2:
        x, y, z, nb = x0, y0, z0, n0
    elif n1 >= n2:
        x, y, z, nb = x1, y1, z1, n1
    else:
        x, y, z, nb = x2, y2, z2, n2
    s = math.sqrt(max(nb, 1e-300))
    return x / s, y / s, z / s, nb


@njit(cache=True, nogil=True, inline="always")
def any_orthogonal3(u0, u1, u2):
    """``_math._any_orthogonal``: a unit vector orthogonal to the unit vector u.

    ``u × e_k`` with k the axis of u's smallest |entry| (the first on ties), written as the
    spec's cross product with the one-hot e_k, divided by ``max(|u × e_k|, 1e-300)``.
    """
    a0, a1, a2 = abs(u0), abs(u1), abs(u2)
    k = 0
    if a1 < a0:
        k = 1
    if a2 < (a0 if k == 0 else a1):
        k = 2
    e0 = 1.0 if k == 0 else 0.0
    e1 = 1.0 if k == 1 else 0.0
    e2 = 1.0 if k == 2 else 0.0
    x = u1 * e2 - u2 * e1
    y = u2 * e0 - u0 * e2
    z = u0 * e1 - u1 * e0
    s = max(math.sqrt(x * x + y * y + z * z), 1e-300)
    return x / s, y / s, z / s


@njit(cache=True, nogil=True, inline="always")
def scaled3(a00, a01, a02, a11, a12, a22):
    """``_math._scaled``: the upper triangle divided by its largest |entry| s, then s.

    Returns the 7-tuple ``(a00/s, a01/s, a02/s, a11/s, a12/s, a22/s, s)``; s = 1 when every
    entry is 0 (or NaN).
    """
    s = max(abs(a00), abs(a01), abs(a02), abs(a11), abs(a12), abs(a22))
    if not s > 0:
        s = 1.0
    return a00 / s, a01 / s, a02 / s, a11 / s, a12 / s, a22 / s, s


@njit(cache=True, nogil=True, inline="always")
def _smallest_of_scaled(a00, a01, a02, a11, a12, a22, l0, l1, l2):
    """Return the smallest eigenvector of a scaled A with eigenvalues l0 ≤ l1 ≤ l2.

    The spec's rule: the null vector of A − l0·I where l0 is simple (its cross product not
    negligible: n2 > (1e-8 spread)², and gap > 1e-9 spread); else a unit vector orthogonal
    to the null vector of A − l2·I, or (0, 0, 1) when that is empty or A = qI.
    """
    v0, v1, v2, nv = null_vector3(a00, a01, a02, a11, a12, a22, l0)
    gap = l1 - l0
    spread = l2 - l0
    simple = nv > (1e-8 * max(spread, 1e-300)) ** 2 and gap > 1e-9 * max(spread, 1e-300)
    if not simple:
        u0, u1, u2, nu = null_vector3(a00, a01, a02, a11, a12, a22, l2)
        if nu > 0 and spread > 0:
            v0, v1, v2 = any_orthogonal3(u0, u1, u2)
        else:
            v0, v1, v2 = 0.0, 0.0, 1.0
    return v0, v1, v2


@njit(cache=True, nogil=True)  # not inline="always": numba's parfor analysis rejects it
def smallest_eigenvector3(a00, a01, a02, a11, a12, a22):
    """``_math.smallest_eigenvector3`` in float64: ``((v0, v1, v2), (l0, l1, l2))``.

    The unit eigenvector of the smallest eigenvalue of the symmetric A (its upper
    triangle), computed on A scaled by its largest entry (:func:`scaled3`); when the
    smallest eigenvalue is (nearly) repeated, a unit vector orthogonal to the largest one's
    eigenvector. The eigenvalues are ascending, scaled back (``λ·s``).
    """
    b00, b01, b02, b11, b12, b22, s = scaled3(a00, a01, a02, a11, a12, a22)
    l0, l1, l2 = eigvalsh3(b00, b01, b02, b11, b12, b22)
    v = _smallest_of_scaled(b00, b01, b02, b11, b12, b22, l0, l1, l2)
    return v, (l0 * s, l1 * s, l2 * s)


@njit(cache=True, nogil=True)
def eigh3(a00, a01, a02, a11, a12, a22):
    """``_math.eigh3``: ``((l0, l1, l2), v0, v1, v2)`` of the symmetric A (its upper triangle).

    Eigenvalues ascending (scaled back), ``v_k`` the unit eigenvector (3-tuple) of ``l_k``;
    ``[v0 v1 v2]`` is a rotation. On A scaled by its largest entry: v0 by
    :func:`smallest_eigenvector3`'s rule, v2 the null vector of A − l2·I made orthogonal to
    v0 (any unit vector orthogonal to v0 where l2 is not simple or that leaves less than
    half of it), v1 = v2 × v0. The eigenvalues are computed once (the spec computes them
    twice, on the already scaled A: the same numbers).
    """
    b00, b01, b02, b11, b12, b22, s = scaled3(a00, a01, a02, a11, a12, a22)
    l0, l1, l2 = eigvalsh3(b00, b01, b02, b11, b12, b22)
    p0, p1, p2 = _smallest_of_scaled(b00, b01, b02, b11, b12, b22, l0, l1, l2)
    u0, u1, u2, n2 = null_vector3(b00, b01, b02, b11, b12, b22, l2)
    spread = max(l2 - l0, 1e-300)
    dot = u0 * p0 + u1 * p1 + u2 * p2
    u0 -= dot * p0
    u1 -= dot * p1
    u2 -= dot * p2
    nrm = math.sqrt(u0 * u0 + u1 * u1 + u2 * u2)
    if n2 > (1e-8 * spread) ** 2 and l2 - l1 > 1e-9 * spread and nrm > 0.5:
        d = max(nrm, 1e-300)
        u0, u1, u2 = u0 / d, u1 / d, u2 / d
    else:
        u0, u1, u2 = any_orthogonal3(p0, p1, p2)
    m0 = u1 * p2 - u2 * p1
    m1 = u2 * p0 - u0 * p2
    m2 = u0 * p1 - u1 * p0
    return (l0 * s, l1 * s, l2 * s), (p0, p1, p2), (m0, m1, m2), (u0, u1, u2)
