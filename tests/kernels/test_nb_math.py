"""Every ``kernels._nb_math`` helper against its ``pointalign._math`` spec, element by element.

One tiny numba kernel per helper loops over a batch of cases. Inputs are fresh random
(three seeds) plus edge cases: repeated eigenvalues, zero, rank-1 and rank-2 matrices,
huge and tiny scales, a zero cross-covariance, zero total weight, each robust kind at
r = 0, at the scale and beyond.

Exactness asserted (the rule of DESIGN.md): equal bits only where both sides do the same
IEEE operations in the same order (Horn's N(S) but its n33, one pair's moments, the
robust weights' exact values, the eigen-solver on a one-eigenvalue matrix); elsewhere a
bound derived from the arithmetic, in units of ``EPS`` (float64 machine epsilon): the
spec's ``torch.linalg.eigh`` and vector norms, PyTorch's vector ``sqrt``/``acos``/``cos``
against libm's (on AVX-512 PyTorch's float64 ``sqrt`` is not always correctly rounded),
``scalar / tensor`` as a reciprocal times the scalar, cross products that a compiler may
fuse into FMAs, other summation orders. Smith's closed form amplifies those roundings near
a double root (its eigenvalues are only ~√EPS accurate there): :func:`_smith_bound`.
"""

from __future__ import annotations

import math

import pytest
import torch

from pointalign import _math
from pointalign.kernels import _backend

if not _backend.cpu_available():
    pytest.skip("numba is not installed", allow_module_level=True)

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

from pointalign.kernels import _nb_math as nm  # noqa: E402

EPS = torch.finfo(torch.float64).eps
F64 = torch.float64


# ---- the kernels: one helper each, over a batch -----------------------------------------

@njit(cache=True)
def _k_robust(r, kind, scale, out):
    for i in range(r.shape[0]):
        out[i] = nm.robust_weight(r[i], kind, scale)


@njit(cache=True)
def _k_quat(q, out):
    for b in range(q.shape[0]):
        R = nm.quat_to_rot(q[b, 0], q[b, 1], q[b, 2], q[b, 3])
        for k in range(9):
            out[b, k] = R[k]


@njit(cache=True)
def _k_horn_matrix(S, out):
    for b in range(S.shape[0]):
        n = nm.horn_matrix(S[b])
        for k in range(10):
            out[b, k] = n[k]


@njit(cache=True)
def _k_top4(N, out):
    A = np.empty((4, 4))
    V = np.empty((4, 4))
    q = np.empty(4)
    for b in range(N.shape[0]):
        A[:, :] = N[b]
        nm.top_eigenvector4(A, V, q)
        out[b, :] = q


@njit(cache=True)
def _k_horn_pose(mom, tie, T, ok):
    S = np.empty(9)
    A = np.empty((4, 4))
    V = np.empty((4, 4))
    q = np.empty(4)
    for b in range(mom.shape[0]):
        ok[b] = nm.horn_pose(mom[b], tie, S, A, V, q, T[b])


@njit(cache=True)
def _k_moments(w, x, y, out16, out28):
    out16[:] = 0.0
    out28[:] = 0.0
    for i in range(w.shape[0]):
        nm.add_horn_moments(out16, w[i], x[i, 0], x[i, 1], x[i, 2], y[i, 0], y[i, 1], y[i, 2])
        nm.add_horn(out28, w[i], x[i, 0], x[i, 1], x[i, 2], y[i, 0], y[i, 1], y[i, 2])


@njit(cache=True)
def _k_spans(C, eps, out):
    for b in range(C.shape[0]):
        out[b] = nm.spans_plane(C[b, 0, 0], C[b, 0, 1], C[b, 0, 2], C[b, 1, 1], C[b, 1, 2],
                                C[b, 2, 2], eps)


@njit(cache=True)
def _k_eig(A, lam, vals, null, orth, small, small_ev, ev, V):
    """Every 3×3 helper on ``A (B, 3, 3)``; ``lam (B,)`` for the null vector."""
    for b in range(A.shape[0]):
        a00, a01, a02 = A[b, 0, 0], A[b, 0, 1], A[b, 0, 2]
        a11, a12, a22 = A[b, 1, 1], A[b, 1, 2], A[b, 2, 2]
        vals[b, 0], vals[b, 1], vals[b, 2] = nm.eigvalsh3(a00, a01, a02, a11, a12, a22)
        x, y, z, n2 = nm.null_vector3(a00, a01, a02, a11, a12, a22, lam[b])
        null[b, 0], null[b, 1], null[b, 2], null[b, 3] = x, y, z, n2
        orth[b, 0], orth[b, 1], orth[b, 2] = nm.any_orthogonal3(x, y, z)
        v, lv = nm.smallest_eigenvector3(a00, a01, a02, a11, a12, a22)
        for k in range(3):
            small[b, k] = v[k]
            small_ev[b, k] = lv[k]
        lv, v0, v1, v2 = nm.eigh3(a00, a01, a02, a11, a12, a22)
        for k in range(3):
            ev[b, k] = lv[k]
            V[b, k, 0] = v0[k]
            V[b, k, 1] = v1[k]
            V[b, k, 2] = v2[k]


# ---- inputs ------------------------------------------------------------------------------

def _unit(g, n=3):
    return torch.nn.functional.normalize(torch.randn(n, generator=g, dtype=F64), dim=0)


def _symmetric(g):
    """(B, 3, 3) symmetric matrices: 40 random, then edge cases; and the edge cases' rows.

    Rows 40-41 have one eigenvalue (p = 0: both sides take the same branch, exactly);
    42-44 are diagonal with a repeated eigenvalue (every null vector is an axis, ±);
    45-46 have rank 1 (a double eigenvalue 0 that Smith's formula resolves to ~√EPS only);
    47-49 rank 2, rotated, and a close pair; ``d`` is the rank-1 direction.
    """
    P = torch.randn(40, 3, 3, generator=g, dtype=F64)
    A = P @ P.transpose(1, 2)
    A[20:30] = (P + P.transpose(1, 2))[20:30]     # indefinite
    d, e = _unit(g), _unit(g)
    e = torch.nn.functional.normalize(e - (e @ d) * d, dim=0)
    Q = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=F64))[0]
    edge = [
        torch.zeros(3, 3, dtype=F64),                       # zero
        2.5 * torch.eye(3, dtype=F64),                      # all three equal
        torch.diag(torch.tensor([1.0, 1.0, 2.0], dtype=F64)),  # smallest repeated
        torch.diag(torch.tensor([3.0, 1.0, 1.0], dtype=F64)),  # smallest repeated, unsorted
        torch.diag(torch.tensor([1.0, 2.0, 2.0], dtype=F64)),  # largest repeated
        torch.outer(d, d) * 4.0,                            # rank 1 (a line)
        -torch.outer(d, d),                                 # rank 1, negative
        torch.outer(d, d) + 1e-3 * torch.outer(e, e),       # rank 2 (a thin plane)
        Q @ torch.diag(torch.tensor([0.0, 1.0, 3.0], dtype=F64)) @ Q.T,  # rank 2, rotated
        Q @ torch.diag(torch.tensor([1.0, 1.0 + 1e-6, 5.0], dtype=F64)) @ Q.T,  # close pair
    ]
    A = torch.cat([A, torch.stack(edge)])
    return 0.5 * (A + A.transpose(1, 2)), d


def _moments(g):
    """(B, 16): Σw, Σwx, Σwy, Σwxyᵀ of weighted problems; the number of points per row."""
    rows, sizes = [], []
    for b in range(24):
        n = [1, 2, 3, 50][b % 4]
        x = torch.randn(n, 3, generator=g, dtype=F64) * 10 ** (b % 3 - 1) + 5 * (b % 3)
        R = _math.quat_to_rot(torch.randn(4, generator=g, dtype=F64))
        if b == 3:
            R = torch.diag(torch.tensor([-1.0, -1.0, 1.0], dtype=F64))  # 180°
        y = x @ R.T + torch.randn(3, generator=g, dtype=F64)
        y = y + 0.01 * torch.randn(n, 3, generator=g, dtype=F64)
        w = torch.rand(n, generator=g, dtype=F64) + 0.1
        if b == 7:
            w = torch.zeros(n, dtype=F64)  # zero total weight
        rows.append(torch.cat([w.sum()[None], (w[:, None] * x).sum(0), (w[:, None] * y).sum(0),
                               ((w[:, None] * x).T @ y).reshape(9)]))
        sizes.append(n)
    return torch.stack(rows), torch.tensor(sizes)


def _np(t):
    return t.contiguous().numpy()


def _same_up_to_sign(a, b):
    """``a`` flipped to ``b``'s sign, row by row ((…, n) vectors)."""
    s = torch.where((a * b).sum(-1, keepdim=True) < 0, -1.0, 1.0)
    return s * a


# ---- robust weights ---------------------------------------------------------------------

def test_robust_weight(seed):
    g = torch.Generator().manual_seed(seed)
    k = 0.7 + float(torch.rand(1, generator=g))
    special = torch.tensor([0.0, -0.0, k, -k, math.nextafter(k, 0), math.nextafter(k, 9),
                            1e-300, 1e300, 3 * k, math.inf], dtype=F64)
    r = torch.cat([special, 4 * k * torch.randn(200, generator=g, dtype=F64)])
    for code, kind in enumerate(_math.ROBUST_KINDS):
        assert nm.ROBUST_CODE[kind] == code
        got = np.empty(r.shape[0])
        _k_robust(_np(r), code, k, got)
        got = torch.from_numpy(got)
        ref = _math.robust_weight(r, kind, k)
        # w ∈ [0, 1] with bounded derivatives in the relative rounding of a/k: each side
        # rounds a few times (the spec's k/a is a reciprocal times k)
        torch.testing.assert_close(got, ref, rtol=4 * EPS, atol=8 * EPS)
        # exact values: 1 at r = 0 and for "none"; Huber 1 within k; Tukey 0 from k on;
        # Cauchy 1/2 at ±k
        assert (got[:2] == 1.0).all()
        if kind == "none":
            assert (got == 1.0).all()
        if kind == "huber":
            assert (got[r.abs() <= k] == 1.0).all() and (got[r.abs() > k] < 1.0).all()
        if kind == "tukey":
            assert (got[r.abs() >= k] == 0.0).all() and (got[r.abs() < k] > 0.0).all()
        if kind == "cauchy":
            assert (got[2:4] == 0.5).all() and got[9] == 0.0


# ---- rotations and Horn's closed form ---------------------------------------------------

def test_quat_to_rot(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(60, 4, generator=g, dtype=F64)
    q[0] = torch.tensor([1.0, 0, 0, 0])          # zero rotation
    q[1] = torch.tensor([0.0, 1, 0, 0])          # 180° about x
    q[2] = torch.tensor([0.0, 0.6, 0, 0.8])      # 180° about an oblique axis
    q[3] = torch.tensor([-1e-3, 2.0, -1, 0.5])   # near 180°, w < 0, not unit
    q[4] = 1e150 * q[5]                          # huge
    q[6] = 1e-150 * q[7]                         # tiny
    got = np.empty((60, 9))
    _k_quat(_np(q), got)
    # entries ≤ 1, quadratic in q/|q| (each component within ~3 EPS relative): ≤ ~30 EPS
    torch.testing.assert_close(torch.from_numpy(got), _math.quat_to_rot(q).reshape(-1, 9),
                               atol=64 * EPS, rtol=0)
    assert got[0].tolist() == [1.0, 0, 0, 0, 1.0, 0, 0, 0, 1.0]


def test_horn_matrix(seed):
    g = torch.Generator().manual_seed(seed)
    S = torch.randn(50, 3, 3, generator=g, dtype=F64) * 10.0 ** torch.randint(
        -5, 6, (50, 1, 1), generator=g)
    got = np.empty((50, 10))
    _k_horn_matrix(_np(S.reshape(-1, 9)), got)
    got = torch.from_numpy(got)
    N = _math.horn_matrix(S)
    triu = N[:, [0, 0, 0, 0, 1, 1, 1, 2, 2, 3], [0, 1, 2, 3, 1, 2, 3, 2, 3, 3]]
    # the same sums in the same order, but n33 (another grouping: two roundings apart)
    assert torch.equal(got[:, :9], triu[:, :9])
    diag = S.diagonal(dim1=1, dim2=2).abs().sum(-1)
    assert ((got[:, 9] - triu[:, 9]).abs() <= 2 * EPS * diag).all()


def test_top_eigenvector4(seed):
    g = torch.Generator().manual_seed(seed)
    S = torch.randn(60, 3, 3, generator=g, dtype=F64)
    N = _math.horn_matrix(S)
    N[0] = torch.diag(torch.tensor([3.0, -1, -1, -1], dtype=F64))
    N[1] = 0.0
    N[2] = torch.diag(torch.tensor([-1.0, 2, 0.5, 2 - 1e-3], dtype=F64))
    N[3] *= 1e-100  # (the stop test squares entries: ‖N‖ within ~1e±150; Horn's is ~1)
    N[4] *= 1e100
    got = np.empty((60, 4))
    _k_top4(_np(N), got)
    got = torch.from_numpy(got)
    assert torch.equal(got[0], torch.tensor([1.0, 0, 0, 0], dtype=F64))
    assert torch.equal(got[1], torch.tensor([1.0, 0, 0, 0], dtype=F64))  # N = 0
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(60, dtype=F64), atol=4 * EPS,
                               rtol=0)
    ev, V = torch.linalg.eigh(N)
    ref = V[..., -1]
    # both exact to rounding: the vectors differ by ≲ c EPS ‖N‖ / gap (Davis-Kahan)
    gap = (ev[:, 3] - ev[:, 2]) / ev.abs().amax(-1).clamp_min(1e-300)
    bound = 64 * EPS / gap.clamp_min(1e-300)
    err = (_same_up_to_sign(got, ref) - ref).abs().amax(-1)
    assert (err[2:] <= bound[2:]).all(), (err / bound).max()


@pytest.mark.parametrize("tie", [0.0, _math.HORN_TIE])
def test_horn_pose(seed, tie):
    g = torch.Generator().manual_seed(seed)
    m, sizes = _moments(g)
    B = m.shape[0]
    T = np.empty((B, 4, 4))
    ok = np.empty(B, np.bool_)
    _k_horn_pose(_np(m), tie, T, ok)
    T, ok = torch.from_numpy(T), torch.from_numpy(ok)
    R, t, ok_ref = _math.horn_pose(m[:, 0], m[:, 1:4], m[:, 4:7], m[:, 7:].reshape(-1, 3, 3),
                                   tie=tie)
    assert torch.equal(ok, ok_ref)
    assert not ok[7] and ok.sum() == B - 1
    eye = torch.eye(4, dtype=F64)
    assert torch.equal(T[7], eye)                           # zero weight: I
    assert torch.equal(T[:, 3], eye[3].expand(B, 4))
    one = (sizes == 1) & ok
    assert torch.equal(T[one][:, :3, :3], torch.eye(3, dtype=F64).expand(int(one.sum()), 3, 3))
    # where the rotation is determined (3 or more points, the top eigenvalue of N(S)
    # separated), both are exact to rounding: R within ~c EPS / gap, t = ȳ − R x̄
    W = m[:, 0].clamp_min(1e-300)
    S = m[:, 7:].reshape(-1, 3, 3) - m[:, 0, None, None] * (
        (m[:, 1:4] / W[:, None])[:, :, None] * (m[:, 4:7] / W[:, None])[:, None, :])
    S = S / S.abs().amax((1, 2), keepdim=True).clamp_min(1e-300) + tie * torch.eye(3)
    ev = torch.linalg.eigvalsh(_math.horn_matrix(S))
    gap = (ev[:, 3] - ev[:, 2]) / ev.abs().amax(-1)
    det = (sizes >= 3) & ok & (gap > 1e-4)
    assert det.sum() >= B // 3
    torch.testing.assert_close(T[det][:, :3, :3], R[det], atol=1e-10, rtol=0)
    scale = (m[det, 1:7].abs() / m[det, :1]).amax(-1, keepdim=True)
    assert ((T[det][:, :3, 3] - t[det]).abs() <= 1e-10 * (1 + scale)).all()


# ---- Horn's moments ---------------------------------------------------------------------

def test_horn_moments(seed):
    g = torch.Generator().manual_seed(seed)
    n = 1000
    w = torch.rand(n, generator=g, dtype=F64)
    w[::10] = 0.0
    x = torch.randn(n, 3, generator=g, dtype=F64) * 3 + 1
    y = torch.randn(n, 3, generator=g, dtype=F64) - 2

    def run(w, x, y):
        o16, o28 = np.empty(16), np.empty(28)
        _k_moments(_np(w), _np(x), _np(y), o16, o28)
        return torch.from_numpy(o16), torch.from_numpy(o28)

    def terms(w, x, y):
        """(n, 28) the terms of every pair, formed as the helpers form them."""
        wx, wy = w[:, None] * x, w[:, None] * y
        iu = torch.triu_indices(3, 3)
        xx = (wx[:, :, None] * x[:, None, :])[:, iu[0], iu[1]]
        yy = (wy[:, :, None] * y[:, None, :])[:, iu[0], iu[1]]
        xy = (wx[:, :, None] * y[:, None, :]).reshape(-1, 9)
        return torch.cat([w[:, None], wx, wy, xy, xx, yy], 1)

    # one pair: the same products in the same order, bit for bit
    o16, o28 = run(w[:1], x[:1], y[:1])
    assert torch.equal(o28, terms(w[:1], x[:1], y[:1])[0])
    assert torch.equal(o16, o28[:16])
    # many pairs: row-order sums against torch's; |Δ| ≤ (n − 1) EPS Σ|terms| (recursive sum)
    o16, o28 = run(w, x, y)
    tt = terms(w, x, y)
    assert torch.equal(o16, o28[:16])
    assert ((o28 - tt.sum(0)).abs() <= (n - 1) * EPS * tt.abs().sum(0)).all()


# ---- degeneracy -------------------------------------------------------------------------

def test_spans_plane(seed):
    g = torch.Generator().manual_seed(seed)
    P = torch.randn(30, 3, 3, generator=g, dtype=F64)
    C = P @ P.transpose(1, 2)
    d, e = _unit(g), _unit(g)
    e = torch.nn.functional.normalize(e - (e @ d) * d, dim=0)
    C[0] = 0.0                                              # empty
    C[1] = torch.outer(d, d) * 4.0                          # a line
    C[2] = torch.outer(d, d) + 1e-3 * torch.outer(e, e)     # a thin plane
    C[3] = torch.outer(d, d) + 1e-14 * torch.eye(3, dtype=F64)  # line + rounding
    C[4] = C[2] * 1e-150                                    # tiny plane
    C[5] = C[1] * 1e150                                     # huge line
    got = np.empty(30, np.bool_)
    _k_spans(_np(C), nm.DEGENERACY_EPS, got)
    ref = _math.spans_plane(C)
    # ‖C‖² in another order: equal wherever e₂ is not within rounding of ε‖C‖² (all here)
    assert torch.equal(torch.from_numpy(got), ref)
    assert not ref[0] and not ref[1] and ref[2] and not ref[3] and ref[4] and not ref[5]
    assert ref[6:].all()


# ---- the closed-form 3×3 eigen-solver ---------------------------------------------------

def _eig_all(A, lam):
    B = A.shape[0]
    outs = [np.empty((B, 3)), np.empty((B, 4)), np.empty((B, 3)), np.empty((B, 3)),
            np.empty((B, 3)), np.empty((B, 3)), np.empty((B, 3, 3))]
    _k_eig(_np(A), _np(lam), *outs)
    return [torch.from_numpy(o) for o in outs]


def _smith_bound(A):
    """Per row: a bound on |Δλ| (A's units) between two evaluations of Smith's closed form
    that do the same operations up to a few roundings each (PyTorch's vector ``sqrt``,
    ``acos``, ``cos`` against libm's: on AVX-512 PyTorch's float64 ``sqrt`` is not always
    correctly rounded).

    q and p agree to a few ulps, so x = det(B)/2 (B = (A − qI)/p) to DX = 8 EPS T, T the
    sum of |products| in det(B); with λ = q + 2p cos(φ + 2πk/3), φ = acos(x)/3:
    |Δλ| ≤ 16 EPS (|q| + 2p) + (2p/3) Δacos, Δacos ≤ min(DX / √(1 − x²), √(2 DX)): acos is
    Lipschitz inside (−1, 1) and Hölder-½ at ±1, so near a double root the closed form
    itself is only ~√EPS accurate.
    """
    a00, a11, a22 = A[:, 0, 0], A[:, 1, 1], A[:, 2, 2]
    a01, a02, a12 = A[:, 0, 1], A[:, 0, 2], A[:, 1, 2]
    q = (a00 + a11 + a22) / 3
    p = ((((a00 - q) ** 2 + (a11 - q) ** 2 + (a22 - q) ** 2)
          + 2 * (a01 ** 2 + a02 ** 2 + a12 ** 2)) / 6).sqrt()
    ps = torch.where(p > 0, p, torch.ones_like(p))
    c00, c11, c22 = (a00 - q) / ps, (a11 - q) / ps, (a22 - q) / ps
    c01, c02, c12 = a01 / ps, a02 / ps, a12 / ps
    det = (c00 * (c11 * c22 - c12 * c12) - c01 * (c01 * c22 - c12 * c02)
           + c02 * (c01 * c12 - c11 * c02))
    T = (c00.abs() * ((c11 * c22).abs() + c12 * c12) + c01.abs() * ((c01 * c22).abs()
         + (c12 * c02).abs()) + c02.abs() * ((c01 * c12).abs() + (c11 * c02).abs()))
    dx = 8 * EPS * T + EPS
    x = (det / 2).clamp(-1, 1)
    dacos = torch.minimum(dx / (1 - x * x).clamp_min(1e-300).sqrt(), (2 * dx).sqrt())
    return 16 * EPS * (q.abs() + 2 * p) + 2 * p / 3 * dacos


@pytest.mark.parametrize("scale", [1.0, 1e-100, 1e100, 1e-300, 1e300])
def test_eigen3(seed, scale):
    g = torch.Generator().manual_seed(seed)
    A, d = _symmetric(g)
    A = A * scale
    B = A.shape[0]
    lam = torch.randn(B, generator=g, dtype=F64) * scale
    vals, null, orth, small, small_ev, ev, V = _eig_all(A, lam)
    An, s = _math._scaled(A)
    lb = _smith_bound(An)  # the scaled solvers' |Δλ|, in units of max|A|

    # eigenvalues: eigvalsh3 unscaled (only where its squares stay normal numbers), the
    # scaled solvers on A / max|A| then times it
    if 1e-100 <= scale <= 1e100:
        assert ((vals - _math.eigvalsh3(A)).abs() <= _smith_bound(A)[:, None]).all()
    ref_small, ref_ev = _math.smallest_eigenvector3(A)
    assert ((small_ev - ref_ev).abs() <= (lb * s)[:, None]).all()
    assert torch.equal(small_ev, ev)

    # null_vector3 at a random λ (three non-parallel cross products): each component a
    # difference of two products (PyTorch's compiled cross product may fuse it into an
    # FMA), |Δc| ≤ 2 EPS M with M the largest |a₁b₂| + |a₂b₁|; norms in another order
    if scale == 1.0:
        v_ref, n_ref = _math._null_vector(A, lam)
        Mm = A - lam[:, None, None] * torch.eye(3, dtype=F64)
        M = torch.zeros(B, dtype=F64)
        for i, j in ((0, 1), (0, 2), (1, 2)):
            a, b = Mm[:, i, :], Mm[:, j, :]
            for u, v in ((1, 2), (2, 0), (0, 1)):
                M = torch.maximum(M, (a[:, u] * b[:, v]).abs() + (a[:, v] * b[:, u]).abs())
        root = n_ref.sqrt()
        assert ((null[:, :3] - v_ref).abs().amax(-1) <= 8 * EPS * M / root).all()
        assert ((null[:, 3] - n_ref).abs() <= 16 * EPS * M * root).all()
        # any_orthogonal3: the same cross product with e_k (exact); the norm in another way
        torch.testing.assert_close(orth, _math._any_orthogonal(null[:, :3]), atol=4 * EPS,
                                   rtol=0)
        assert ((orth * null[:, :3]).sum(-1).abs() <= 4 * EPS).all()

    # smallest eigenvector: where λ₀ is simple, the same vector up to sign, within
    # (c EPS + 4 |Δλ|) / (λ₁ − λ₀) (a null vector of A − λI moves by ~Δλ / gap)
    lam_n = _math.eigvalsh3(An)
    spread = (lam_n[:, 2] - lam_n[:, 0]).clamp_min(1e-300)
    gap0 = (lam_n[:, 1] - lam_n[:, 0]).clamp_min(1e-300)
    gap2 = (lam_n[:, 2] - lam_n[:, 1]).clamp_min(1e-300)
    simple0 = gap0 > 1e-6 * spread
    simple2 = gap2 > 1e-6 * spread
    bound0 = (64 * EPS + 4 * lb) / gap0
    err = (_same_up_to_sign(small, ref_small) - ref_small).abs().amax(-1)
    assert (err[simple0] <= bound0[simple0]).all()
    torch.testing.assert_close(small.norm(dim=-1), torch.ones(B, dtype=F64), atol=4 * EPS,
                               rtol=0)
    # repeated eigenvalues: one eigenvalue (p = 0) gives (0, 0, 1) on both sides; a diagonal
    # matrix gives an axis (the sign follows λ's rounding); a double 0 of rank 1 a vector
    # orthogonal to the line, to within |λ₀| / λ₂ (≤ the eigenvalue bound)
    z = torch.tensor([0.0, 0.0, 1.0], dtype=F64)
    assert torch.equal(small[40], z) and torch.equal(ref_small[40], z)
    assert torch.equal(small[41], z) and torch.equal(ref_small[41], z)
    torch.testing.assert_close(small[42:45].abs(), ref_small[42:45].abs(), atol=4 * EPS, rtol=0)
    assert ((small[42:45].abs() == 1.0).sum(-1) == 1).all()
    assert (small[45] @ d).abs() <= 4 * lb[45] / lam_n[45, 2] + 64 * EPS

    # eigh3: a rotation whose columns are eigenvectors (residual ≤ ~|Δλ|: near a double
    # root Smith's eigenvalues, so the residual, are only ~√EPS accurate); its extreme
    # columns the spec's up to sign where their eigenvalue is simple (the largest one is
    # orthogonalised to the smallest one: that one's error adds); the same one-eigenvalue
    # and axis answers as the spec
    ref_vals, ref_V = _math.eigh3(A)
    eye = torch.eye(3, dtype=F64).expand(B, 3, 3)
    torch.testing.assert_close(V.transpose(1, 2) @ V, eye, atol=16 * EPS, rtol=0)
    assert (torch.linalg.det(V) > 0).all()
    res = (An @ V - V * (ev / s[:, None])[:, None, :]).abs().amax((1, 2))
    assert (res <= 4 * lb + 64 * EPS).all()
    bound2 = 2 * (64 * EPS + 4 * lb) / gap2 + torch.where(simple0, bound0, 0.0)
    for j, ok, bj in ((0, simple0, bound0), (2, simple2, bound2)):
        col, rcol = V[:, :, j], ref_V[:, :, j]
        err = (_same_up_to_sign(col, rcol) - rcol).abs().amax(-1)
        assert (err[ok] <= bj[ok]).all()
    assert torch.equal(V[40:42], ref_V[40:42])
    torch.testing.assert_close(V[42:45].abs(), ref_V[42:45].abs(), atol=4 * EPS, rtol=0)
    assert simple2[45] and simple0[46]  # the rank-1 lines: ±d, checked above
