"""The shared formulas as ``@triton.jit`` helpers: the device twins of :mod:`pointalign._math`.

Same names and meanings as the float64 PyTorch spec; ``tests/test_math.py`` compares each
helper with its spec element by element (Triton interpreter on CPU, compiled on CUDA).

Triton has no small local arrays, so a small matrix is a tuple of scalars (row-major,
``A[i * n + j]``): tuples are unrolled at compile time into straight-line scalar code, one
register per entry, with no shuffles or layout conversions. Loops over matrix entries use
``tl.static_range`` or tuple comprehensions over literal index tuples (both unrolled). The
6×6 eigen-solver is the exception: its 15 rotations per sweep, unrolled, made a kernel
that took 6 s to compile, so it holds the matrix in an (8, 8) block and loops over the
rotations at run time (:func:`jacobi6`).
Scalars are float64 when the caller passes float64 (the solves); :func:`robust_weight`
works on float32 blocks.

Solvers (one per size, as in the spec):

* 4×4 (Horn's N, only the top eigenvector is needed): repeated squaring of the shifted,
  positive semi-definite matrix (:func:`top_eigenvector4`).
* 6×6 (point-to-plane normal equations): cyclic Jacobi (:func:`eigh6`), then the
  least-norm solve (:func:`least_norm_solve6`).
* 3×3: none on the device; the degeneracy rule (:func:`spans_plane`) needs no eigenvalues.
"""

from __future__ import annotations

import triton
import triton.language as tl

# ---- robust weights ---------------------------------------------------------------------


@triton.jit
def robust_weight(r, scale, KIND: tl.constexpr):
    """``_math.robust_weight``: KIND 0 none, 1 huber, 2 tukey, 3 cauchy (``ROBUST_KINDS``)."""
    a = tl.abs(r)
    if KIND == 0:
        w = tl.full(a.shape, 1.0, a.dtype)
    elif KIND == 1:
        w = tl.where(a <= scale, 1.0, scale / tl.maximum(a, 1e-30))
    elif KIND == 2:
        u = a / scale
        w = tl.where(a < scale, (1.0 - u * u) * (1.0 - u * u), 0.0)
    else:
        u = a / scale
        w = 1.0 / (1.0 + u * u)
    return w


# ---- rotations --------------------------------------------------------------------------


@triton.jit
def quat_to_rot(qw, qx, qy, qz):
    """``_math.quat_to_rot``: (w, x, y, z), normalised first → R as a 9-tuple (row-major)."""
    inv = 1.0 / tl.maximum(tl.sqrt(qw * qw + qx * qx + qy * qy + qz * qz), 1e-300)
    w = qw * inv
    x = qx * inv
    y = qy * inv
    z = qz * inv
    return (1.0 - 2.0 * (y * y + z * z), 2.0 * (x * y - z * w), 2.0 * (x * z + y * w),
            2.0 * (x * y + z * w), 1.0 - 2.0 * (x * x + z * z), 2.0 * (y * z - x * w),
            2.0 * (x * z - y * w), 2.0 * (y * z + x * w), 1.0 - 2.0 * (x * x + y * y))


@triton.jit
def so3_exp(w0, w1, w2):
    """``_math.so3_exp`` (Rodrigues, Taylor coefficients for θ² < 1e-12) → R as a 9-tuple.

    ``R = I + a [ω]× + b [ω]×²`` with ``[ω]×² = ω ωᵀ − θ² I``.
    """
    th2 = w0 * w0 + w1 * w1 + w2 * w2
    small = th2 < 1e-12
    safe = tl.where(small, 1.0, tl.sqrt(th2))
    a = tl.where(small, 1.0 - th2 / 6.0, tl.sin(safe) / safe)
    b = tl.where(small, 0.5 - th2 / 24.0, (1.0 - tl.cos(safe)) / (safe * safe))
    d = 1.0 - b * th2
    return (b * w0 * w0 + d, b * w0 * w1 - a * w2, b * w0 * w2 + a * w1,
            b * w1 * w0 + a * w2, b * w1 * w1 + d, b * w1 * w2 - a * w0,
            b * w2 * w0 - a * w1, b * w2 * w1 + a * w0, b * w2 * w2 + d)


@triton.jit
def rot_to_quat(R):
    """``_math.rot_to_quat`` (Shepperd): R a 9-tuple (row-major) → unit (w, x, y, z), w ≥ 0.

    The candidate of the largest of ``(tr, r00, r11, r22)`` (the first on ties, as
    ``argmax``), normalised.
    """
    tr = R[0] + R[4] + R[8]
    s0 = tl.sqrt(tl.maximum(1.0 + tr, 1e-30)) * 2.0
    s1 = tl.sqrt(tl.maximum(1.0 + R[0] - R[4] - R[8], 1e-30)) * 2.0
    s2 = tl.sqrt(tl.maximum(1.0 + R[4] - R[0] - R[8], 1e-30)) * 2.0
    s3 = tl.sqrt(tl.maximum(1.0 + R[8] - R[0] - R[4], 1e-30)) * 2.0
    p0 = (tr >= R[0]) & (tr >= R[4]) & (tr >= R[8])
    p1 = ~p0 & (R[0] >= R[4]) & (R[0] >= R[8])
    p2 = ~p0 & ~p1 & (R[4] >= R[8])
    w = tl.where(p0, 0.25 * s0, tl.where(p1, (R[7] - R[5]) / s1,
                 tl.where(p2, (R[2] - R[6]) / s2, (R[3] - R[1]) / s3)))
    x = tl.where(p0, (R[7] - R[5]) / s0, tl.where(p1, 0.25 * s1,
                 tl.where(p2, (R[1] + R[3]) / s2, (R[2] + R[6]) / s3)))
    y = tl.where(p0, (R[2] - R[6]) / s0, tl.where(p1, (R[1] + R[3]) / s1,
                 tl.where(p2, 0.25 * s2, (R[5] + R[7]) / s3)))
    z = tl.where(p0, (R[3] - R[1]) / s0, tl.where(p1, (R[2] + R[6]) / s1,
                 tl.where(p2, (R[5] + R[7]) / s2, 0.25 * s3)))
    n = tl.sqrt(w * w + x * x + y * y + z * z)
    sign = tl.where(w < 0, -1.0, 1.0) / n
    return w * sign, x * sign, y * sign, z * sign


@triton.jit
def _half_angle(s, w):
    """``atan2(s, w)`` for ``s, w ≥ 0`` with ``s² + w² = 1`` (Triton has no arctangent).

    Five halvings on the unit circle (``cos(φ/2) = √((1 + cos φ)/2)``,
    ``sin(φ/2) = sin φ / (2 cos(φ/2))``) bring φ ≤ π/2 under π/64, where the arctangent's
    series to ``z¹¹`` is exact to rounding (the next term is below 1e-17 relative). Square
    roots and divisions only: a trigonometric Newton iteration made this kernel family
    compile for seconds, and keeps small angles' relative accuracy as well.
    """
    for _ in tl.static_range(5):
        half = tl.sqrt(0.5 * (1.0 + w))
        s = s / (2.0 * half)
        w = half
    z = s / w
    z2 = z * z
    series = 1.0 - z2 * (1.0 / 3.0 - z2 * (1.0 / 5.0 - z2 * (1.0 / 7.0 - z2 * (
        1.0 / 9.0 - z2 / 11.0))))
    return 32.0 * z * series


@triton.jit
def so3_log(R):
    """``_math.so3_log``: R a 9-tuple (row-major) → its rotation vector (|ω| ≤ π), a 3-tuple.

    Through the quaternion (stable near 0 and near π): ``ω = v · 2 atan2(|v|, w) / |v|``,
    and ``2 v / w`` for ``|v| ≤ 1e-12``.
    """
    qw, qx, qy, qz = rot_to_quat(R)
    w = tl.minimum(tl.maximum(qw, -1.0), 1.0)
    s = tl.sqrt(qx * qx + qy * qy + qz * qz)
    angle = 2.0 * _half_angle(s, w)
    k = tl.where(s > 1e-12, angle / tl.maximum(s, 1e-30), 2.0 / tl.maximum(w, 1e-30))
    return qx * k, qy * k, qz * k


# ---- Horn's closed form -----------------------------------------------------------------


@triton.jit
def horn_matrix(S):
    """``_math.horn_matrix``: S a 9-tuple (row-major) → N(S) as its upper triangle.

    The upper triangle is the 10-tuple (n00, n01, n02, n03, n11, n12, n13, n22, n23, n33).
    """
    return (S[0] + S[4] + S[8], S[5] - S[7], S[6] - S[2], S[1] - S[3],
            S[0] - S[4] - S[8], S[1] + S[3], S[6] + S[2],
            S[4] - S[0] - S[8], S[5] + S[7],
            S[8] - S[0] - S[4])


@triton.jit
def _square4(a):
    """Return the upper triangle of A² for a symmetric 4×4 A given by its upper triangle."""
    a00, a01, a02, a03, a11, a12, a13, a22, a23, a33 = a
    return (a00 * a00 + a01 * a01 + a02 * a02 + a03 * a03,
            a00 * a01 + a01 * a11 + a02 * a12 + a03 * a13,
            a00 * a02 + a01 * a12 + a02 * a22 + a03 * a23,
            a00 * a03 + a01 * a13 + a02 * a23 + a03 * a33,
            a01 * a01 + a11 * a11 + a12 * a12 + a13 * a13,
            a01 * a02 + a11 * a12 + a12 * a22 + a13 * a23,
            a01 * a03 + a11 * a13 + a12 * a23 + a13 * a33,
            a02 * a02 + a12 * a12 + a22 * a22 + a23 * a23,
            a02 * a03 + a12 * a13 + a22 * a23 + a23 * a33,
            a03 * a03 + a13 * a13 + a23 * a23 + a33 * a33)


@triton.jit
def top_eigenvector4(n, SQUARINGS: tl.constexpr):
    """``_math.top_eigenvector4``: unit eigenvector (4-tuple) of the largest eigenvalue.

    The symmetric 4×4 is given by its upper triangle ``n`` (10-tuple).

    N's eigenvalues lie in [−‖N‖_F, ‖N‖_F], so A = N/‖N‖_F + I is positive semi-definite
    with the same eigenvectors; ``SQUARINGS`` squarings of A (normalised every 4th: entries
    grow at most 4¹⁶ in between) make it proportional to the projector onto the top
    eigenvector, whose column of largest diagonal (the first on ties) is returned,
    normalised. Converges when the top two eigenvalues of N differ by more than
    ~2^-SQUARINGS ‖N‖_F (40 squarings: ~1e-11). N = 0 gives (1, 0, 0, 0).
    """
    n00, n01, n02, n03, n11, n12, n13, n22, n23, n33 = n
    fro = tl.sqrt(n00 * n00 + n11 * n11 + n22 * n22 + n33 * n33
                  + 2.0 * (n01 * n01 + n02 * n02 + n03 * n03 + n12 * n12 + n13 * n13
                           + n23 * n23))
    f = 1.0 / tl.maximum(fro, 1e-300)
    a = (n00 * f + 1.0, n01 * f, n02 * f, n03 * f, n11 * f + 1.0, n12 * f, n13 * f,
         n22 * f + 1.0, n23 * f, n33 * f + 1.0)
    for _ in range(SQUARINGS // 4):
        for _k in tl.static_range(4):
            a = _square4(a)
        a00, a01, a02, a03, a11, a12, a13, a22, a23, a33 = a
        big = tl.maximum(tl.maximum(tl.maximum(a00, a11), tl.maximum(a22, a33)),
                         tl.maximum(tl.maximum(tl.maximum(tl.abs(a01), tl.abs(a02)),
                                               tl.maximum(tl.abs(a03), tl.abs(a12))),
                                    tl.maximum(tl.abs(a13), tl.abs(a23))))
        ib = 1.0 / tl.maximum(big, 1e-300)
        a = (a00 * ib, a01 * ib, a02 * ib, a03 * ib, a11 * ib, a12 * ib, a13 * ib,
             a22 * ib, a23 * ib, a33 * ib)
    a00, a01, a02, a03, a11, a12, a13, a22, a23, a33 = a
    qw = a00
    qx = a01
    qy = a02
    qz = a03
    best = a00
    pick = a11 > best
    qw = tl.where(pick, a01, qw)
    qx = tl.where(pick, a11, qx)
    qy = tl.where(pick, a12, qy)
    qz = tl.where(pick, a13, qz)
    best = tl.where(pick, a11, best)
    pick = a22 > best
    qw = tl.where(pick, a02, qw)
    qx = tl.where(pick, a12, qx)
    qy = tl.where(pick, a22, qy)
    qz = tl.where(pick, a23, qz)
    best = tl.where(pick, a22, best)
    pick = a33 > best
    qw = tl.where(pick, a03, qw)
    qx = tl.where(pick, a13, qx)
    qy = tl.where(pick, a23, qy)
    qz = tl.where(pick, a33, qz)
    inv = 1.0 / tl.maximum(tl.sqrt(qw * qw + qx * qx + qy * qy + qz * qz), 1e-300)
    return qw * inv, qx * inv, qy * inv, qz * inv


@triton.jit
def horn_pose(W, sx, sy, cross, TIE: tl.constexpr, SQUARINGS: tl.constexpr):
    """``_math.horn_pose``: float64 moments → ``(R 9-tuple, t 3-tuple, ok)``.

    ``W`` = Σw, ``sx`` = Σwx and ``sy`` = Σwy (3-tuples), ``cross`` = Σ w x yᵀ (9-tuple,
    row-major). S = cross − W x̄ ȳᵀ is scaled by its largest entry, set to 0 when it is
    rounding noise of the moments, plus ``TIE``·I; q = top eigenvector of N(S); where not
    ok (W ≤ 0 or a non-finite result) R = I, t = 0.
    """
    Wc = tl.maximum(W, 1e-300)
    xm0 = sx[0] / Wc
    xm1 = sx[1] / Wc
    xm2 = sx[2] / Wc
    ym0 = sy[0] / Wc
    ym1 = sy[1] / Wc
    ym2 = sy[2] / Wc
    S = (cross[0] - W * xm0 * ym0, cross[1] - W * xm0 * ym1, cross[2] - W * xm0 * ym2,
         cross[3] - W * xm1 * ym0, cross[4] - W * xm1 * ym1, cross[5] - W * xm1 * ym2,
         cross[6] - W * xm2 * ym0, cross[7] - W * xm2 * ym1, cross[8] - W * xm2 * ym2)
    mag = tl.abs(W) * (tl.abs(xm0) + tl.abs(xm1) + tl.abs(xm2)) \
        * (tl.abs(ym0) + tl.abs(ym1) + tl.abs(ym2))
    smax = tl.abs(S[0])
    for k in tl.static_range(9):
        mag += tl.abs(cross[k])
        smax = tl.maximum(smax, tl.abs(S[k]))
    inv = tl.where(smax > 1e-10 * mag, 1.0 / tl.maximum(smax, 1e-300), 0.0)
    S = (S[0] * inv + TIE, S[1] * inv, S[2] * inv,
         S[3] * inv, S[4] * inv + TIE, S[5] * inv,
         S[6] * inv, S[7] * inv, S[8] * inv + TIE)
    qw, qx, qy, qz = top_eigenvector4(horn_matrix(S), SQUARINGS)
    R = quat_to_rot(qw, qx, qy, qz)
    t0 = ym0 - (R[0] * xm0 + R[1] * xm1 + R[2] * xm2)
    t1 = ym1 - (R[3] * xm0 + R[4] * xm1 + R[5] * xm2)
    t2 = ym2 - (R[6] * xm0 + R[7] * xm1 + R[8] * xm2)
    ok = (W > 0) & _finite(t0) & _finite(t1) & _finite(t2)
    for k in tl.static_range(9):
        ok = ok & _finite(R[k])
    R, t = mask_pose(ok, R, (t0, t1, t2))
    return R, t, ok


@triton.jit
def _finite(x):
    return (x == x) & (tl.abs(x) < float("inf"))


@triton.jit
def mask_pose(ok, R, t):
    """``(R, t)`` where ``ok``, else ``(I, 0)`` (R a 9-tuple, t a 3-tuple)."""
    return ((tl.where(ok, R[0], 1.0), tl.where(ok, R[1], 0.0), tl.where(ok, R[2], 0.0),
             tl.where(ok, R[3], 0.0), tl.where(ok, R[4], 1.0), tl.where(ok, R[5], 0.0),
             tl.where(ok, R[6], 0.0), tl.where(ok, R[7], 0.0), tl.where(ok, R[8], 1.0)),
            (tl.where(ok, t[0], 0.0), tl.where(ok, t[1], 0.0), tl.where(ok, t[2], 0.0)))


# ---- the one degeneracy rule ------------------------------------------------------------


@triton.jit
def spans_plane(c00, c01, c02, c11, c12, c22, eps):
    """``_math.spans_plane``: ``(tr² − ‖C‖_F²) / 2 > ε ‖C‖_F²`` for a symmetric 3×3 C.

    C is given by its upper triangle (≈ λ₂ > ε λ₃; no eigen-solve).
    """
    tr = c00 + c11 + c22
    fro2 = c00 * c00 + c11 * c11 + c22 * c22 + 2.0 * (c01 * c01 + c02 * c02 + c12 * c12)
    return 0.5 * (tr * tr - fro2) > eps * fro2


# ---- the 6×6 eigen-solver and the least-norm solve --------------------------------------


@triton.jit
def _jacobi_coefficients(app, aqq, apq):
    """Return the rotation (c, s) zeroing a_pq and t = s / c (Golub & Van Loan, Alg. 8.4.2)."""
    nz = tl.abs(apq) > 1e-300
    th = (aqq - app) / tl.where(nz, 2.0 * apq, 1.0)
    t = tl.where(th >= 0, 1.0, -1.0) / (tl.abs(th) + tl.sqrt(th * th + 1.0))
    t = tl.where(nz, t, 0.0)
    c = 1.0 / tl.sqrt(t * t + 1.0)
    return c, t * c, t


@triton.jit
def _pick(v, idx, k):
    """``v[k]`` of a small block vector (``idx`` its ``tl.arange``; exact: one term)."""
    return tl.sum(tl.where(idx == k, v, 0.0), axis=0)


@triton.jit
def _block6(A):
    """Return the 36-tuple ``A`` (row-major 6×6) as an (8, 8) float64 block, zero-padded."""
    r = tl.arange(0, 8)[:, None]
    c = tl.arange(0, 8)[None, :]
    M = tl.zeros((8, 8), dtype=tl.float64)
    for k in tl.static_range(36):
        M = tl.where((r == k // 6) & (c == k % 6), A[k], M)
    return M


@triton.jit
def _off_diagonal(M, r, c):
    """Return whether ``M``'s off-diagonal part is above 1e-15 of its diagonal (Frobenius)."""
    sq = M * M
    off = tl.sum(tl.sum(tl.where(r != c, sq, 0.0), axis=1), axis=0)
    return off > 1e-30 * tl.sum(tl.sum(tl.where(r == c, sq, 0.0), axis=1), axis=0)


@triton.jit
def jacobi6(M, SWEEPS: tl.constexpr):
    """Cyclic Jacobi on a symmetric 6×6 held in an (8, 8) float64 block (zero-padded).

    Returns ``(ev (8,), V (8, 8))``: ``ev[k]`` the eigenvalues (unordered; the two pads 0),
    ``V[:, k]`` their eigenvectors. Each rotation (p, q) zeroes ``a_pq`` by Golub & Van
    Loan's Alg. 8.4.2: rows and columns p, q become ``c a_p − s a_q`` and ``s a_p + c a_q``,
    the pivots ``a_pp − t a_pq`` and ``a_qq + t a_pq`` (an ``a_pq`` under 1e-15 of its
    pivots is left). The rotation index runs in a loop, not unrolled: the kernel stays
    small and compiles in a fraction of a second (unrolled, the 6×6 solve took 6 s). Sweeps
    stop at ``SWEEPS`` or once the off-diagonal part is under 1e-15 of the diagonal
    (convergence is quadratic: usually 4-6 sweeps).
    """
    i = tl.arange(0, 8)
    r = i[:, None]
    c = i[None, :]
    V = tl.where(r == c, 1.0, 0.0).to(tl.float64)
    sweep = tl.zeros((), dtype=tl.int32)
    while (sweep < SWEEPS) & _off_diagonal(M, r, c):
        for p in range(5):
            for q in range(p + 1, 6):
                col_p = tl.sum(tl.where(c == p, M, 0.0), axis=1)  # column p, by row
                col_q = tl.sum(tl.where(c == q, M, 0.0), axis=1)
                app = _pick(col_p, i, p)
                aqq = _pick(col_q, i, q)
                apq = _pick(col_p, i, q)
                # an a_pq under 1e-15 of its pivots is at their round-off: skip the rotation
                # (the classical threshold test; the last sweeps are mostly skips)
                if tl.abs(apq) > 1e-15 * tl.sqrt(tl.abs(app) * tl.abs(aqq)):
                    cs, sn, t = _jacobi_coefficients(app, aqq, apq)
                    new_p = cs * col_p - sn * col_q
                    new_q = sn * col_p + cs * col_q
                    new_p = tl.where(i == p, app - t * apq, tl.where(i == q, 0.0, new_p))
                    new_q = tl.where(i == q, aqq + t * apq, tl.where(i == p, 0.0, new_q))
                    # the same vectors along the other axis (M is kept exactly symmetric)
                    row_p = tl.sum(tl.where(r == c, new_p[:, None], 0.0), axis=0)
                    row_q = tl.sum(tl.where(r == c, new_q[:, None], 0.0), axis=0)
                    M = tl.where(c == p, new_p[:, None], tl.where(c == q, new_q[:, None], M))
                    M = tl.where(r == p, row_p[None, :], tl.where(r == q, row_q[None, :], M))
                    v_p = tl.sum(tl.where(c == p, V, 0.0), axis=1)
                    v_q = tl.sum(tl.where(c == q, V, 0.0), axis=1)
                    V = tl.where(c == p, (cs * v_p - sn * v_q)[:, None],
                                 tl.where(c == q, (sn * v_p + cs * v_q)[:, None], V))
        sweep += 1
    ev = tl.sum(tl.where(r == c, M, 0.0), axis=1)
    return ev, V


@triton.jit
def eigh6(A, SWEEPS: tl.constexpr):
    """Eigen-decomposition of a symmetric 6×6 ``A`` (36-tuple, row-major) by cyclic Jacobi.

    Returns ``(ev, V)``: ``ev`` the eigenvalues (6-tuple, unordered), ``V`` (36-tuple,
    row-major) the eigenvectors in its columns (:func:`jacobi6`). The spec is
    ``_math.eigh6`` (``torch.linalg.eigh``).
    """
    ev, V = jacobi6(_block6(A), SWEEPS)
    i = tl.arange(0, 8)
    r = i[:, None]
    c = i[None, :]
    vals = [_pick(ev, i, k) for k in (0, 1, 2, 3, 4, 5)]
    vecs = [tl.sum(tl.sum(tl.where((r == k // 6) & (c == k % 6), V, 0.0), axis=1), axis=0)
            for k in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19,
                      20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35)]
    return vals, vecs


@triton.jit
def _cholesky_solve6(M, bv, eps):
    """Solve ``M y = bv`` by Cholesky where that is the least-norm solution; ``(y, ok)``.

    ``M`` the equalised system as an (8, 8) float64 block (zero-padded), ``bv`` (8,). ok
    when ``M = L Lᵀ`` exists and ``2 ε tr(M) tr(M⁻¹) < 1``, with ``tr(M⁻¹) = ‖L⁻¹‖²_F``:
    then ``λ_min ≥ 1 / tr(M⁻¹) > ε tr(M) ≥ ε λ_max``, every eigenvalue passes the
    least-norm rule and its solution is ``M⁻¹ bv = L⁻ᵀ L⁻¹ bv`` (this one, up to rounding).
    """
    i = tl.arange(0, 8)
    r = i[:, None]
    c = i[None, :]
    tr = tl.sum(tl.sum(tl.where(r == c, M, 0.0), axis=1), axis=0)
    ok = tr == tr
    Lt = tl.zeros((8, 8), dtype=tl.float64)  # Lᵀ: row j holds column j of L
    for j in range(6):  # right-looking: take column j, remove its outer product
        col = tl.sum(tl.where(c == j, M, 0.0), axis=1)
        d = _pick(col, i, j)
        ok = ok & (d > 1e-30)  # M is equalised (its blocks' traces 3): smaller fails anyway
        lj = tl.where(i >= j, col / tl.sqrt(tl.where(d > 1e-30, d, 1.0)), 0.0)
        Lt = tl.where(r == j, lj[None, :], Lt)
        M = M - lj[:, None] * lj[None, :]
    W = tl.zeros((8, 8), dtype=tl.float64)  # L⁻¹ by forward substitution, row by row
    for j in range(6):
        row = tl.sum(tl.where(c == j, Lt, 0.0), axis=1)  # row j of L, by column k
        acc = tl.sum(tl.where(r < j, row[:, None] * W, 0.0), axis=0)
        w = (tl.where(i == j, 1.0, 0.0) - acc) / tl.where(ok, _pick(row, i, j), 1.0)
        W = tl.where(r == j, w[None, :], W)
    tr_inv = tl.sum(tl.sum(W * W, axis=1), axis=0)
    ok = ok & (2.0 * eps * tr * tr_inv < 1.0)
    z = tl.sum(W * bv[None, :], axis=1)  # L⁻¹ bv
    return tl.sum(W * z[:, None], axis=0), ok  # L⁻ᵀ z


@triton.jit
def least_norm_solve6(A, b, eps, SWEEPS: tl.constexpr):
    """``_math.least_norm_solve`` for n = 6: ``A`` 36-tuple (symmetric PSD), ``b`` 6-tuple.

    ``x = V diag(1/λ_k if λ_k > ε λ_max else 0) Vᵀ b``; returns ``(x 6-tuple, full,
    usable)`` with x = 0 where not usable (as the spec). A system whose Cholesky bound shows
    every eigenvalue kept (:func:`_cholesky_solve6`: a Gauss-Newton system that determines
    the pose) is solved by Cholesky, in a few microseconds; the others by cyclic Jacobi
    (:func:`jacobi6`: ~50 µs of one program's dependent steps, H200).
    """
    # the block equalisation of ``_math.block_scales6``: D A D y = D b, x = D y
    tr_r = (A[0] + A[7] + A[14]) / 3.0
    tr_t = (A[21] + A[28] + A[35]) / 3.0
    s_r = tl.where(tr_r > 0, 1.0 / tl.sqrt(tl.maximum(tr_r, 1e-300)), 1.0)
    s_t = tl.where(tr_t > 0, 1.0 / tl.sqrt(tl.maximum(tr_t, 1e-300)), 1.0)
    i = tl.arange(0, 8)
    d = tl.where(i < 3, s_r, tl.where(i < 6, s_t, 0.0))
    M = _block6(A) * d[:, None] * d[None, :]
    bv = tl.zeros((8,), dtype=tl.float64)
    for k in tl.static_range(6):
        bv = tl.where(i == k, b[k], bv)
    y_fast, fast = _cholesky_solve6(M, d * bv, eps)
    x_fast = d * y_fast
    fast = fast & (tl.sum(tl.where((i < 6) & ~((x_fast == x_fast)
                                               & (tl.abs(x_fast) < float("inf"))), 1, 0),
                          axis=0) == 0)
    xv, full, usable = x_fast, fast, fast
    if not fast:  # the eigen pseudo-inverse
        ev, V = jacobi6(M, SWEEPS)
        live = i < 6
        thr = eps * tl.maximum(tl.max(tl.where(live, ev, float("-inf")), axis=0), 1e-300)
        keep = live & (ev > thr)
        full = tl.sum(tl.where(live & ~keep, 1, 0), axis=0) == 0
        some = tl.sum(tl.where(keep, 1, 0), axis=0) > 0
        proj = tl.sum(V * (d * bv)[:, None], axis=0)  # Vᵀ (D b), by eigenvector
        y = tl.where(keep, proj / tl.maximum(ev, 1e-300), 0.0)
        xv = d * tl.sum(V * y[None, :], axis=1)
        usable = some & (tl.sum(tl.where(live & ~((xv == xv) & (tl.abs(xv) < float("inf"))),
                                         1, 0), axis=0) == 0)
        xv = tl.where(usable, xv, 0.0)
        full = full & usable
    x = [_pick(xv, i, k) for k in (0, 1, 2, 3, 4, 5)]
    return x, full, usable
