"""Every ``kernels._tl_math`` helper against its ``pointalign._math`` spec, element by element.

One tiny ``@triton.jit`` kernel per helper (one program per case) runs through the Triton
interpreter in a child process (:mod:`tests._interpreted`) and, with the
``gpu`` marker, compiled on CUDA. Inputs are random plus edge cases: zero rotation, 180°,
tiny angles, rank-deficient and degenerate matrices, a zero cross-covariance.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pointalign import _math
from tests._interpreted import interpreted_fixture

try:
    import triton
    import triton.language as tl

    from pointalign.kernels import _tl_math as tm
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _k_robust(r_ptr, o_ptr, n, scale, KIND: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        r = tl.load(r_ptr + offs, mask=offs < n, other=0.0)
        tl.store(o_ptr + offs, tm.robust_weight(r, scale, KIND), mask=offs < n)

    @triton.jit
    def _k_quat(q_ptr, o_ptr):
        b = tl.program_id(0).to(tl.int64)
        R = tm.quat_to_rot(tl.load(q_ptr + 4 * b), tl.load(q_ptr + 4 * b + 1),
                           tl.load(q_ptr + 4 * b + 2), tl.load(q_ptr + 4 * b + 3))
        for k in tl.static_range(9):
            tl.store(o_ptr + 9 * b + k, R[k])

    @triton.jit
    def _k_exp(w_ptr, o_ptr):
        b = tl.program_id(0).to(tl.int64)
        R = tm.so3_exp(tl.load(w_ptr + 3 * b), tl.load(w_ptr + 3 * b + 1),
                       tl.load(w_ptr + 3 * b + 2))
        for k in tl.static_range(9):
            tl.store(o_ptr + 9 * b + k, R[k])

    @triton.jit
    def _k_log(r_ptr, o_ptr):
        b = tl.program_id(0).to(tl.int64)
        R = [tl.load(r_ptr + 9 * b + k) for k in (0, 1, 2, 3, 4, 5, 6, 7, 8)]
        q = tm.rot_to_quat(R)
        w = tm.so3_log(R)
        for k in tl.static_range(4):
            tl.store(o_ptr + 7 * b + k, q[k])
        for k in tl.static_range(3):
            tl.store(o_ptr + 7 * b + 4 + k, w[k])

    @triton.jit
    def _k_horn_matrix(s_ptr, o_ptr):
        b = tl.program_id(0).to(tl.int64)
        S = [tl.load(s_ptr + 9 * b + k) for k in (0, 1, 2, 3, 4, 5, 6, 7, 8)]
        n = tm.horn_matrix(S)
        for k in tl.static_range(10):
            tl.store(o_ptr + 10 * b + k, n[k])

    @triton.jit
    def _k_top4(n_ptr, o_ptr, SQUARINGS: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        n = [tl.load(n_ptr + 10 * b + k) for k in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)]
        q = tm.top_eigenvector4(n, SQUARINGS)
        for k in tl.static_range(4):
            tl.store(o_ptr + 4 * b + k, q[k])

    @triton.jit
    def _k_horn_pose(m_ptr, o_ptr, TIE: tl.constexpr, SQUARINGS: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        m = [tl.load(m_ptr + 16 * b + k)
             for k in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
        R, t, ok = tm.horn_pose(m[0], (m[1], m[2], m[3]), (m[4], m[5], m[6]),
                                (m[7], m[8], m[9], m[10], m[11], m[12], m[13], m[14], m[15]),
                                TIE, SQUARINGS)
        for k in tl.static_range(9):
            tl.store(o_ptr + 13 * b + k, R[k])
        for k in tl.static_range(3):
            tl.store(o_ptr + 13 * b + 9 + k, t[k])
        tl.store(o_ptr + 13 * b + 12, tl.where(ok, 1.0, 0.0))

    @triton.jit
    def _k_spans(c_ptr, o_ptr, eps):
        b = tl.program_id(0).to(tl.int64)
        c = c_ptr + 9 * b
        ok = tm.spans_plane(tl.load(c), tl.load(c + 1), tl.load(c + 2), tl.load(c + 4),
                            tl.load(c + 5), tl.load(c + 8), eps)
        tl.store(o_ptr + b, ok.to(tl.int32))

    @triton.jit
    def _k_solve6(a_ptr, b_ptr, o_ptr, eps, SWEEPS: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        A = [tl.load(a_ptr + 36 * pid + k)
             for k in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19,
                       20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35)]
        g = [tl.load(b_ptr + 6 * pid + k) for k in (0, 1, 2, 3, 4, 5)]
        x, full, usable = tm.least_norm_solve6(A, g, eps, SWEEPS)
        ev, V = tm.eigh6(A, SWEEPS)
        for k in tl.static_range(6):
            tl.store(o_ptr + 16 * pid + k, x[k])
            tl.store(o_ptr + 16 * pid + 6 + k, ev[k])
        tl.store(o_ptr + 16 * pid + 12, tl.where(full, 1.0, 0.0))
        tl.store(o_ptr + 16 * pid + 13, tl.where(usable, 1.0, 0.0))
        # ‖A V − V D‖ for the eigenpairs (row 0 of the residual, enough to pin V)
        res = A[0] * 0.0
        for j in tl.static_range(6):
            e = A[0] * V[j] + A[1] * V[6 + j] + A[2] * V[12 + j] + A[3] * V[18 + j] \
                + A[4] * V[24 + j] + A[5] * V[30 + j] - V[j] * ev[j]
            res = tl.maximum(res, tl.abs(e))
        tl.store(o_ptr + 16 * pid + 14, res)


# ---- inputs ------------------------------------------------------------------------------

def _quats(g):
    q = torch.randn(40, 4, generator=g, dtype=torch.float64)
    q[0] = torch.tensor([1.0, 0, 0, 0])         # zero rotation
    q[1] = torch.tensor([0.0, 1, 0, 0])         # 180° about x
    q[2] = torch.tensor([0.0, 0.6, 0, 0.8])     # 180° about an oblique axis
    q[3] = torch.tensor([-1e-3, 2.0, -1, 0.5])  # near 180°, w < 0, not unit
    q[4] = 7.0 * q[5]
    return q


def _omegas(g):
    w = torch.randn(40, 3, generator=g, dtype=torch.float64)
    w[0] = 0.0                                       # zero rotation
    w[1] = torch.tensor([math.pi, 0, 0])             # 180°
    w[2] = torch.tensor([1e-7, -2e-7, 3e-8])         # θ² < 1e-12: Taylor branch
    w[3] = torch.tensor([1e-6, 0, 0]) * (1 + 1e-9)   # just above the branch
    w[4] = 3.0 * torch.nn.functional.normalize(w[4], dim=0)
    return w


def _moments(g):
    """(B, 16): Σw, Σwx, Σwy, Σwxyᵀ of random weighted problems and edge cases."""
    from pointalign import transforms

    rows = []
    for b in range(12):
        n = [1, 2, 3, 50][b % 4]
        x = torch.randn(n, 3, generator=g, dtype=torch.float64) + 5 * (b % 3)
        R = transforms.random_rotation(generator=g)
        if b == 3:
            R = transforms.axis_angle_to_matrix(torch.tensor([0.0, 0, 1]), math.pi)  # 180°
        y = x @ R.T + torch.randn(3, generator=g, dtype=torch.float64)
        y = y + 0.01 * torch.randn(n, 3, generator=g, dtype=torch.float64)
        w = torch.rand(n, generator=g, dtype=torch.float64) + 0.1
        if b == 5:
            w = torch.zeros(n, dtype=torch.float64)  # zero total weight
        rows.append(torch.cat([w.sum()[None], (w[:, None] * x).sum(0), (w[:, None] * y).sum(0),
                               ((w[:, None] * x).T @ y).reshape(9)]))
    return torch.stack(rows)


def _covs(g):
    P = torch.randn(30, 3, 3, generator=g, dtype=torch.float64)
    C = P @ P.transpose(1, 2)
    d = torch.nn.functional.normalize(torch.randn(3, generator=g, dtype=torch.float64), dim=0)
    C[0] = 0.0                                   # empty
    C[1] = torch.outer(d, d) * 4.0               # a line
    e = torch.nn.functional.normalize(torch.randn(3, generator=g, dtype=torch.float64), dim=0)
    e = e - (e @ d) * d
    C[2] = torch.outer(d, d) + 1e-3 * torch.outer(e, e) / (e @ e)  # a thin plane
    C[3] = torch.outer(d, d) + 1e-14 * torch.eye(3, dtype=torch.float64)  # line + rounding
    return C


def _systems(g):
    J = torch.randn(8, 40, 6, generator=g, dtype=torch.float64)
    J[1, :, 3:] = 0.0                            # rotation only: translation undetermined
    J[2, :, :] = J[2, :1, :]                     # rank 1
    A = J.transpose(1, 2) @ J
    A[3] = 0.0                                   # empty system
    # conditioned either side of the Cholesky path's bound (2 ε tr tr⁻¹ < 1, ε = 1e-10) and
    # of the least-norm rule itself (λ > ε λ_max): Cholesky, Jacobi keeping every
    # direction, Jacobi dropping one
    V = torch.linalg.qr(torch.randn(5, 6, 6, generator=g, dtype=torch.float64))[0]
    lam = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 1e-4], [1.0, 2.0, 3.0, 4.0, 5.0, 1e-8],
                        [1.0, 1.0, 1.0, 1.0, 1.0, 3e-10], [1.0, 1.0, 1.0, 1.0, 1.0, 5e-11],
                        [1e3, 1.0, 1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    A = torch.cat([A, V @ torch.diag_embed(lam) @ V.transpose(1, 2)])
    b = torch.randn(A.shape[0], 6, generator=g, dtype=torch.float64)
    return A, b


def run_interpreted_math(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): every helper on the inputs above."""
    out = run_math_kernels("cpu")
    torch.save(out, out_path)


def run_math_kernels(device: str) -> dict:
    g = torch.Generator().manual_seed(0)
    out: dict = {}
    r = torch.linspace(-3, 3, 61, dtype=torch.float32)
    for code, kind in enumerate(_math.ROBUST_KINDS):
        o = torch.empty(61, dtype=torch.float32, device=device)
        _k_robust[(1,)](r.to(device), o, 61, 0.7, KIND=code, BLOCK=64)
        out[("robust", kind)] = o.cpu()
    q = _quats(g)
    o = torch.empty(40, 9, dtype=torch.float64, device=device)
    _k_quat[(40,)](q.to(device), o)
    out["quat"] = o.cpu()
    w = _omegas(g)
    o = torch.empty(40, 9, dtype=torch.float64, device=device)
    _k_exp[(40,)](w.to(device), o)
    out["exp"] = o.cpu()
    R = _math.so3_exp(w)
    o = torch.empty(40, 7, dtype=torch.float64, device=device)
    _k_log[(40,)](R.reshape(-1, 9).contiguous().to(device), o)
    out["log"] = o.cpu()
    S = torch.randn(20, 3, 3, generator=g, dtype=torch.float64)
    o = torch.empty(20, 10, dtype=torch.float64, device=device)
    _k_horn_matrix[(20,)](S.to(device), o)
    out["horn_matrix"] = o.cpu()
    N = _math.horn_matrix(S)
    N[0] = torch.diag(torch.tensor([3.0, -1, -1, -1], dtype=torch.float64))
    N[1] = 0.0
    triu = N[:, [0, 0, 0, 0, 1, 1, 1, 2, 2, 3], [0, 1, 2, 3, 1, 2, 3, 2, 3, 3]]
    o = torch.empty(20, 4, dtype=torch.float64, device=device)
    _k_top4[(20,)](triu.contiguous().to(device), o, SQUARINGS=40)
    out["top4"] = o.cpu()
    m = _moments(g)
    for tie in (0.0, _math.HORN_TIE):
        o = torch.empty(m.shape[0], 13, dtype=torch.float64, device=device)
        _k_horn_pose[(m.shape[0],)](m.to(device), o, TIE=tie, SQUARINGS=40)
        out[("horn_pose", tie)] = o.cpu()
    C = _covs(g)
    o = torch.empty(30, dtype=torch.int32, device=device)
    _k_spans[(30,)](C.to(device), o, _math.DEGENERACY_EPS)
    out["spans"] = o.cpu()
    A, b = _systems(g)
    o = torch.empty(A.shape[0], 16, dtype=torch.float64, device=device)
    _k_solve6[(A.shape[0],)](A.to(device), b.to(device), o, _math.DEGENERACY_EPS, SWEEPS=8)
    out["solve6"] = o.cpu()
    out["inputs"] = dict(r=r, q=q, w=w, S=S, N=N, m=m, C=C, A=A, b=b)
    return out


interpreted = interpreted_fixture("tests.test_math", "run_interpreted_math")


def _check_all(out: dict) -> None:
    inp = out["inputs"]
    for kind in _math.ROBUST_KINDS:
        torch.testing.assert_close(out[("robust", kind)],
                                   _math.robust_weight(inp["r"], kind, 0.7), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out["quat"], _math.quat_to_rot(inp["q"]).reshape(-1, 9),
                               atol=1e-14, rtol=0)
    torch.testing.assert_close(out["exp"], _math.so3_exp(inp["w"]).reshape(-1, 9),
                               atol=1e-14, rtol=0)
    R = _math.so3_exp(inp["w"])
    # 180° (row 1): ±ω are both its logarithm; compare the rotations there
    torch.testing.assert_close(out["log"][:, :4], _math.rot_to_quat(R), atol=1e-15, rtol=0)
    rest = [i for i in range(40) if i != 1]
    torch.testing.assert_close(out["log"][rest, 4:], _math.so3_log(R)[rest], atol=1e-14,
                               rtol=1e-14)
    torch.testing.assert_close(_math.so3_exp(out["log"][:, 4:]), R, atol=1e-14, rtol=0)
    torch.testing.assert_close(out["log"][2:4, 4:], inp["w"][2:4], atol=0, rtol=1e-12)
    N = _math.horn_matrix(inp["S"])
    triu = N[:, [0, 0, 0, 0, 1, 1, 1, 2, 2, 3], [0, 1, 2, 3, 1, 2, 3, 2, 3, 3]]
    torch.testing.assert_close(out["horn_matrix"], triu, atol=1e-14, rtol=0)
    # top eigenvector: equal up to sign to the spec's
    q_ref = _math.top_eigenvector4(inp["N"])
    q = out["top4"]
    sign = torch.sign((q * q_ref).sum(-1, keepdim=True))
    torch.testing.assert_close(q[2:], (sign * q_ref)[2:], atol=1e-9, rtol=0)
    assert torch.equal(q[0], torch.tensor([1.0, 0, 0, 0], dtype=torch.float64))
    assert torch.equal(q[1], torch.tensor([1.0, 0, 0, 0], dtype=torch.float64))  # N = 0
    m = inp["m"]
    for tie in (0.0, _math.HORN_TIE):
        R, t, ok = _math.horn_pose(m[:, 0], m[:, 1:4], m[:, 4:7], m[:, 7:].reshape(-1, 3, 3),
                                   tie=tie)
        got = out[("horn_pose", tie)]
        assert torch.equal(got[:, 12] > 0, ok)
        assert not ok[5] and ok[[0, 1, 2, 3, 4, 6]].all()
        # one point (rows 0, 4, 8) and two points (1, 5, 9) leave the rotation (partly)
        # free: compare where it is determined, or where the tie-breaker fixes it
        det = [0, 2, 3, 4, 6, 7, 8, 10, 11]
        torch.testing.assert_close(got[det, :9], R.reshape(-1, 9)[det], atol=1e-8, rtol=0)
        torch.testing.assert_close(got[det, 9:12], t[det], atol=1e-7, rtol=0)
        if tie:
            # two points: the εI tie-breaker leaves a gap of ~1e-9 ‖N‖ between the top two
            # eigenvalues; 40 squarings resolve it only to ~1e-4 (measured 4e-5)
            torch.testing.assert_close(got[[1, 9], :9], R.reshape(-1, 9)[[1, 9]], atol=1e-4,
                                       rtol=0)
    spans = _math.spans_plane(inp["C"])
    assert torch.equal(out["spans"] > 0, spans)
    assert not spans[0] and not spans[1] and spans[2] and not spans[3] and spans[4:].all()
    A, b = inp["A"], inp["b"]
    x, full, usable = _math.least_norm_solve(A, b)
    got = out["solve6"]
    torch.testing.assert_close(got[:8, :6], x[:8], atol=1e-8, rtol=1e-8)
    # conditioned systems: two backward-stable solvers agree to ~κ u (κ up to 3·10⁹ here)
    torch.testing.assert_close(got[8:, :6], x[8:], atol=0, rtol=1e-6)
    assert torch.equal(got[:, 12] > 0, full) and torch.equal(got[:, 13] > 0, usable)
    assert full[0] and not full[1] and not full[2] and usable[2] and not usable[3]
    assert full[8:11].all() and not full[11] and usable[11] and full[12]
    ev = torch.sort(got[:, 6:12], -1).values
    scale = A.abs().amax((-1, -2)).clamp_min(1e-300)[:, None]
    torch.testing.assert_close(ev / scale, _math.eigh6(A)[0] / scale, atol=1e-12, rtol=0)
    assert (got[:, 14] <= 1e-12 * scale[:, 0] + 1e-300).all()


def test_tl_math_interpreted_matches_spec(interpreted):
    _check_all(interpreted)


@pytest.mark.gpu
def test_tl_math_cuda_matches_spec():
    _check_all(run_math_kernels("cuda"))


# ---- the spec alone ----------------------------------------------------------------------

def test_spec_rotations_are_consistent():
    g = torch.Generator().manual_seed(1)
    q = _quats(g)
    R = _math.quat_to_rot(q)
    torch.testing.assert_close(R @ R.transpose(-1, -2), torch.eye(3, dtype=torch.float64)
                               .expand_as(R), atol=1e-13, rtol=0)
    torch.testing.assert_close(_math.quat_to_rot(_math.rot_to_quat(R)), R, atol=1e-13, rtol=0)
    w = _omegas(g)
    torch.testing.assert_close(_math.so3_exp(_math.so3_log(_math.so3_exp(w))),
                               _math.so3_exp(w), atol=1e-12, rtol=0)
    torch.testing.assert_close(_math.so3_exp(w), torch.linalg.matrix_exp(_math.skew(w)),
                               atol=1e-13, rtol=0)


def test_robust_weight_rejects_unknown_kind():
    with pytest.raises(ValueError, match="kind"):
        _math.robust_weight(torch.zeros(3), "welsch", 1.0)


# ---- the surface approximants' small solves (closed-form 2×2 eigen, 4×4 Cholesky) -------

def test_symmetric_eigh2_and_solve_spd4(rng):
    # entries ~N(0, 1): LAPACK's eigh and the closed form (hypot, atan2, cos, sin: each a
    # few ulps) agree to a few ulps of |λ| <= ~5, far inside 1e-13
    a, b, c = torch.randn(3, 1000, generator=rng, dtype=torch.float64)
    b[:100] = 0
    a[:50] = c[:50]  # repeated eigenvalue
    lam, V = _math.symmetric_eigh2(a, b, c)
    H = torch.stack([torch.stack([a, b], -1), torch.stack([b, c], -1)], -2)
    ref, _ = torch.linalg.eigh(H)
    assert torch.allclose(lam, ref, atol=1e-13)
    assert (H @ V - V * lam[:, None, :]).abs().max() < 1e-13
    assert (V.transpose(1, 2) @ V - torch.eye(2, dtype=torch.float64)).abs().max() < 1e-13
    # SPD systems with eigenvalues in [1e-3, ~50] (cond <= ~5e4): LU and Cholesky agree to
    # ~cond × ε relatively, far inside 1e-8
    M = torch.randn(500, 4, 4, generator=rng, dtype=torch.float64)
    M = M @ M.transpose(1, 2) + 1e-3 * torch.eye(4, dtype=torch.float64)
    r = torch.randn(500, 4, generator=rng, dtype=torch.float64)
    assert torch.allclose(_math.solve_spd4(M, r), torch.linalg.solve(M, r), rtol=1e-8, atol=1e-8)
    # a pivot that is not positive gives NaN in its row, the others are solved
    M[0] = -torch.eye(4, dtype=torch.float64)
    x = _math.solve_spd4(M, r)
    assert torch.isnan(x[0]).all() and torch.isfinite(x[1:]).all()


def test_numpy_twins_match_spec():
    """``kernels._np_math`` (the CPU backend's host steps) against the spec: the rotations of
    ``_omegas`` (0, 180°, the Taylor branch, just above it, random)."""
    from pointalign.kernels import _np_math

    w = _omegas(torch.Generator().manual_seed(0))
    R = _math.so3_exp(w)
    np.testing.assert_allclose(_np_math.so3_exp(w.numpy()), R.numpy(), atol=1e-15, rtol=0)
    np.testing.assert_allclose(_np_math.rot_to_quat(R.numpy()), _math.rot_to_quat(R).numpy(),
                               atol=1e-15, rtol=0)
    log = _np_math.so3_log(R.numpy())
    rest = [i for i in range(40) if i != 1]  # 180°: ±ω both; compare the rotations there
    np.testing.assert_allclose(log[rest], _math.so3_log(R).numpy()[rest], atol=1e-14,
                               rtol=1e-14)
    np.testing.assert_allclose(_np_math.so3_exp(log), R.numpy(), atol=1e-14, rtol=0)
    C = _covs(torch.Generator().manual_seed(0))
    np.testing.assert_array_equal(_np_math.spans_plane(C.numpy()), _math.spans_plane(C).numpy())
    np.testing.assert_allclose(_np_math.rotation_angle(R.numpy()),
                               _math.so3_log(R).norm(dim=-1).numpy(), atol=1e-14, rtol=1e-12)
    # the same formula in both, on the same float64 operations
    np.testing.assert_allclose(_np_math.rotation_angle(R.numpy()),
                               _math.rotation_angle(R).numpy(), atol=1e-15, rtol=1e-15)
    w64 = w.numpy()
    np.testing.assert_array_equal(_np_math.skew(w64), _math.skew(w).numpy())


def test_numpy_stability_and_shift(rng):
    """``_np_math.stability`` against the spec (random, rank-deficient, non-finite and zero
    informations); ``shift_information`` against Jacobians formed about the moved point."""
    from pointalign.kernels import _np_math

    x = torch.randn(4, 50, 3, generator=rng, dtype=torch.float64)
    n = torch.nn.functional.normalize(torch.randn(4, 50, 3, generator=rng,
                                                  dtype=torch.float64), dim=-1)
    n[1] = n[1, :1]  # one normal: translations along the plane are free
    J = torch.cat([torch.linalg.cross(x, n, dim=-1), n], -1)
    H = J.transpose(1, 2) @ J
    H[2, 0, 0] = float("nan")
    H[3] = 0.0
    ext = torch.rand(4, generator=rng, dtype=torch.float64) + 0.5
    got, want = _np_math.stability(H.numpy(), ext.numpy()), _math.stability(H, ext).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    assert got[0] > 0.01 and got[1] < 1e-12 and got[2] == 0.0 and got[3] == 0.0
    c = torch.randn(4, 3, generator=rng, dtype=torch.float64)
    Jc = torch.cat([torch.linalg.cross(x + c[:, None], n, dim=-1), n], -1)  # about −c
    scale = float((Jc.transpose(1, 2) @ Jc).abs().max())
    np.testing.assert_allclose(_np_math.shift_information(H[:2].numpy(), c[:2].numpy()),
                               (Jc.transpose(1, 2) @ Jc)[:2].numpy(), rtol=0,
                               atol=1e-12 * scale)
