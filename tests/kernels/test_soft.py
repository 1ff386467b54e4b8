"""kernels.soft: fused soft-correspondence reductions vs a dense float64 reference.

The dense reference below builds the full N×M matrix in float64 (tiny N only), exactly as
Tamaki et al.'s GPU code does (including the explicit outlier row and column for Sinkhorn);
the kernels never build it. Compared: row sums, column sums, weighted coordinate sums, the
cross-covariance, EM-ICP's λ and x', and the Horn pose; on random data (odd sizes, N ≠ M,
ragged batches) and on the bunny; for the chunked PyTorch path here, the Triton kernels
through the interpreter in a child process, and the compiled kernels on CUDA (gpu marker).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pointalign import datasets, transforms
from pointalign.kernels import horn, soft
from tests._interpreted import interpreted_fixture

# ------------------------------------------------------------------------------------------
# dense float64 references (full matrices)
# ------------------------------------------------------------------------------------------


def dense_logits(q, p, T, s, g=None):
    q, p, T = q.double(), p.double(), T.double()
    qt = q @ T[:3, :3].T + T[:3, 3]
    Z = -float(s) * ((qt[:, None, :] - p[None, :, :]) ** 2).sum(-1)
    if g is not None:
        Z = Z + g.double()[None, :]
    return Z


def dense_rows(q, p, T, s, g=None):
    Z = dense_logits(q, p, T, s, g)
    return torch.logsumexp(Z, 1), torch.logsumexp(2 * Z, 1), torch.softmax(Z, 1) @ p.double()


def dense_emicp(x, y, T, sigma2, log_out):
    """Granger & Pennec's weights with the full matrix: √α, its row/col sums, x'."""
    Z = dense_logits(x, y, T, 1.0 / sigma2)
    A = torch.exp(Z)
    C = math.exp(log_out) + A.sum(1)
    Ms = torch.sqrt(A / C[:, None])
    lam = Ms.sum(1)
    return Ms, lam, (Ms @ y.double()) / lam[:, None]


def dense_sinkhorn(x, y, T, beta, alpha, w, rounds):
    """Tamaki's Algorithm 2 lines 4-8 with an explicit (N+1)×(M+1) matrix."""
    N, M = x.shape[0], y.shape[0]
    D = -dense_logits(x, y, T, 1.0)
    Mx = torch.zeros(N + 1, M + 1, dtype=torch.float64)
    Mx[:N, :M] = torch.exp(-beta * (D - alpha))
    Mx[:N, M] = w
    Mx[N, :M] = w
    for _ in range(rounds):
        Mx[:N] = Mx[:N] / Mx[:N].sum(1, keepdim=True)
        Mx[:, :M] = Mx[:, :M] / Mx[:, :M].sum(0, keepdim=True)
    return Mx[:N, :M]


def kernel_sinkhorn(x, y, T, beta, alpha, w, rounds):
    """The kernels' version: returns row sums, column sums, Σ_ij m_ij x_i y_jᵀ, Σ m y."""
    B = 1
    xb, yb, Tb = x[None], y[None], T[None].to(x.dtype)
    Ti = transforms.invert(T.double())[None].to(x.dtype)
    bt = torch.tensor([beta], dtype=x.dtype)
    ba = torch.tensor([beta * alpha], dtype=x.dtype)
    lw = torch.tensor([math.log(w)], dtype=x.dtype)
    g_col = ba[:, None].expand(B, y.shape[0]).contiguous()
    for _ in range(rounds):
        g_row = soft.sinkhorn_scaling(xb, yb, Tb, bt, g_col, lw, ba)
        g_col = soft.sinkhorn_scaling(yb, xb, Ti, bt, g_row, lw, ba)
    r = soft.soft_rows(xb, yb, Tb, bt, point_log_weights=g_col)
    rows = torch.exp(r.lse + g_row - ba[:, None])[0]
    c = soft.soft_rows(yb, xb, Ti, bt, point_log_weights=g_row)
    cols = torch.exp(c.lse + g_col - ba[:, None])[0]
    cross = (rows[:, None] * x).T @ r.mean[0]
    return rows, cols, cross, (rows[:, None] * r.mean[0]).sum(0)


def _cloud(n, g, dtype=torch.float64, scale=1.0):
    return (torch.rand(n, 3, generator=g, dtype=torch.float64) * scale).to(dtype)


def _pose(g, deg=20.0, trans=0.1):
    return transforms.random_transform(deg, trans, generator=g)


# ------------------------------------------------------------------------------------------
# chunked PyTorch reference vs dense
# ------------------------------------------------------------------------------------------

SIZES = [(1, 1), (2, 3), (3, 2), (17, 31), (64, 7), (101, 97)]


@pytest.mark.parametrize("n,m", SIZES)
def test_rows_reference_matches_dense(n, m, rng):
    q, p, T = _cloud(n, rng), _cloud(m, rng), _pose(rng)
    g = torch.randn(m, generator=rng, dtype=torch.float64)
    s = torch.tensor([3.7], dtype=torch.float64)
    # tiny tiles so that the online log-sum-exp crosses many chunks
    r = soft.soft_rows_reference(q[None], p[None], T[None], s, point_log_weights=g[None],
                                 squares=True, tile_pairs=5)
    lse, lse2, mean = dense_rows(q, p, T, 3.7, g)
    torch.testing.assert_close(r.lse[0], lse, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(r.lse2[0], lse2, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(r.mean[0], mean, atol=1e-10, rtol=1e-10)


def test_rows_float32_matches_dense(rng):
    q, p, T = _cloud(300, rng), _cloud(257, rng), _pose(rng)
    s = torch.tensor([50.0])
    r = soft.soft_rows(q[None].float(), p[None].float(), T[None].float(), s, squares=True)
    lse, lse2, mean = dense_rows(q, p, T, 50.0)
    torch.testing.assert_close(r.lse[0].double(), lse, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(r.mean[0].double(), mean, atol=1e-5, rtol=1e-5)


def test_ragged_batch_ignores_padding(rng):
    qs = [_cloud(n, rng) for n in (5, 11, 2)]
    ps = [_cloud(m, rng) for m in (9, 3, 13)]
    Q = torch.full((3, 11, 3), 1e3, dtype=torch.float64)  # padding far away: must not count
    P = torch.full((3, 13, 3), -1e3, dtype=torch.float64)
    for i, (q, p) in enumerate(zip(qs, ps, strict=True)):
        Q[i, : len(q)], P[i, : len(p)] = q, p
    T = torch.stack([_pose(rng) for _ in range(3)])
    s = torch.tensor([1.0, 5.0, 0.5], dtype=torch.float64)
    ql, pl = torch.tensor([5, 11, 2]), torch.tensor([9, 3, 13])
    r = soft.soft_rows(Q, P, T, s, query_lengths=ql, point_lengths=pl, squares=True)
    for i, (q, p) in enumerate(zip(qs, ps, strict=True)):
        lse, _, mean = dense_rows(q, p, T[i], float(s[i]))
        torch.testing.assert_close(r.lse[i, : len(q)], lse)
        torch.testing.assert_close(r.mean[i, : len(q)], mean)
        assert torch.isinf(r.lse[i, len(q):]).all()
        assert (r.mean[i, len(q):] == 0).all()


def test_emicp_rows_match_dense_row_col_sums_and_cross(rng):
    x, y, T = _cloud(80, rng, scale=0.2), _cloud(67, rng, scale=0.2), _pose(rng, 10, 0.02)
    sigma2, log_out = 0.004, -0.01 / 0.004
    lam, xp = soft.emicp_rows(x[None], y[None], T[None], torch.tensor([sigma2]).double(),
                              torch.tensor([log_out]).double())
    Ms, lam_d, xp_d = dense_emicp(x, y, T, sigma2, log_out)
    torch.testing.assert_close(lam[0], lam_d)
    torch.testing.assert_close(xp[0], xp_d)
    # the soft Horn moments (Tamaki eqs. 18-20, 26) from the rows alone
    W, sx, sm, cross = horn.horn_moments(x[None], xp, lam)
    torch.testing.assert_close(W[0], Ms.sum())
    torch.testing.assert_close(sx[0], (Ms.sum(1)[:, None] * x).sum(0))
    torch.testing.assert_close(sm[0], (Ms.sum(0)[:, None] * y).sum(0))  # uses column sums
    torch.testing.assert_close(cross[0], x.T @ Ms @ y)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_sinkhorn_scalings_match_dense_matrix(dtype, rng):
    x, y, T = _cloud(45, rng, scale=0.2), _cloud(38, rng, scale=0.2), _pose(rng, 10, 0.02)
    beta, alpha, w, rounds = 60.0, 0.002, 0.3, 3
    Md = dense_sinkhorn(x, y, T, beta, alpha, w, rounds)
    rows, cols, cross, sy = kernel_sinkhorn(x.to(dtype), y.to(dtype), T, beta, alpha, w, rounds)
    tol = dict(atol=1e-10, rtol=1e-9) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(rows.double(), Md.sum(1), **tol)
    torch.testing.assert_close(cols.double(), Md.sum(0), **tol)
    torch.testing.assert_close(cross.double(), x.T @ Md @ y, **tol)
    torch.testing.assert_close(sy.double(), (Md.sum(0)[:, None] * y).sum(0), **tol)


def test_bunny_rows_match_dense(bunny_pair):
    x = datasets.random_subsample(bunny_pair.source, 400, 1)
    y = datasets.random_subsample(bunny_pair.target, 350, 2)
    T = torch.as_tensor(bunny_pair.T_target_source)
    lam, xp = soft.emicp_rows(x[None], y[None], T[None].float(), torch.tensor([1e-4]),
                              torch.tensor([-100.0]))
    _, lam_d, xp_d = dense_emicp(x, y, T, 1e-4, -100.0)
    torch.testing.assert_close(lam[0].double(), lam_d, atol=1e-5, rtol=1e-4)
    ok = lam_d > 1e-3
    torch.testing.assert_close(xp[0].double()[ok], xp_d[ok], atol=1e-6, rtol=1e-5)


def test_underflow_gives_no_nan(rng):
    """Scales where every exp(z) underflows in float32 (and float64): finite, sane results."""
    x, y = _cloud(50, rng), _cloud(40, rng) + 5.0  # far apart: d² ≈ 75
    T = torch.eye(4, dtype=torch.float64)
    for s in (1e3, 1e8):
        r = soft.soft_rows(x[None].float(), y[None].float(), T[None].float(),
                           torch.tensor([s]), squares=True)
        assert torch.isfinite(r.lse).all() and torch.isfinite(r.lse2).all()
        assert torch.isfinite(r.mean).all()
        # the soft correspondence tends to the nearest point as s grows
        if s == 1e8:
            d = torch.cdist(x.double(), y.double())
            torch.testing.assert_close(r.mean[0].double(), y.double()[d.argmin(1)], atol=1e-4,
                                       rtol=0)
        lam, xp = soft.emicp_rows(x[None].float(), y[None].float(), T[None].float(),
                                  torch.tensor([1.0 / s]), torch.tensor([-s * 0.01]))
        assert torch.isfinite(lam).all() and torch.isfinite(xp).all()
        assert (lam >= 0).all() and float(lam.max()) < 1e-6  # all points are outliers
        g = torch.zeros(1, 40)
        out = soft.sinkhorn_scaling(x[None].float(), y[None].float(), T[None].float(),
                                    torch.tensor([s]), g, torch.tensor([0.0]),
                                    torch.tensor([0.0]))
        assert torch.isfinite(out).all()


def test_weighted_horn_matches_svd_oracle(rng):
    x = _cloud(60, rng)
    Tt = _pose(rng, 70, 0.5)
    m = transforms.apply(Tt, x) + 0.01 * torch.randn(60, 3, generator=rng, dtype=torch.float64)
    w = torch.rand(60, generator=rng, dtype=torch.float64)
    T, valid = horn.weighted_horn(x[None], m[None], w[None])
    assert bool(valid[0])
    # independent oracle: NumPy weighted Umeyama (SVD)
    X, Y, W = x.numpy(), m.numpy(), w.numpy()
    xm, ym = (W[:, None] * X).sum(0) / W.sum(), (W[:, None] * Y).sum(0) / W.sum()
    H = ((X - xm) * W[:, None]).T @ (Y - ym)
    U, _, Vt = np.linalg.svd(H)
    d = np.sign(np.linalg.det(Vt.T @ U.T))
    R = Vt.T @ np.diag([1, 1, d]) @ U.T
    np.testing.assert_allclose(T[0, :3, :3].numpy(), R, atol=1e-9)
    np.testing.assert_allclose(T[0, :3, 3].numpy(), ym - R @ xm, atol=1e-9)


def test_weighted_horn_zero_weight_is_identity_not_nan(rng):
    x = _cloud(10, rng)
    T, valid = horn.weighted_horn(x[None], x[None], torch.zeros(1, 10, dtype=torch.float64))
    assert not bool(valid[0])
    assert torch.equal(T[0], torch.eye(4, dtype=torch.float64))


def test_shape_errors_name_the_argument():
    q = torch.zeros(1, 4, 3)
    with pytest.raises(ValueError, match="points"):
        soft.soft_rows(q, torch.zeros(2, 4, 3), torch.eye(4)[None], torch.ones(1))
    with pytest.raises(ValueError, match="transform"):
        soft.soft_rows(q, q, torch.eye(4), torch.ones(1))
    with pytest.raises(ValueError, match="point_log_weights"):
        soft.soft_rows(q, q, torch.eye(4)[None], torch.ones(1),
                       point_log_weights=torch.zeros(1, 5))


# ------------------------------------------------------------------------------------------
# Triton kernels through the interpreter (child process) and on CUDA
# ------------------------------------------------------------------------------------------


def _interp_case(seed):
    g = torch.Generator().manual_seed(77 + seed)
    Q = _cloud(37 * 2, g, torch.float32, 0.3).reshape(2, 37, 3)
    P = _cloud(53 * 2, g, torch.float32, 0.3).reshape(2, 53, 3)
    T = torch.stack([_pose(g, 15, 0.05), _pose(g, 40, 0.1)]).float()
    ql, pl = torch.tensor([37, 20]), torch.tensor([53, 31])
    gw = torch.randn(2, 53, generator=g)
    return Q, P, T, ql, pl, gw


def _step_case(Q, P, T, ql, pl):
    """emicp_step arguments: the second entry frozen (it must keep its pose)."""
    return (Q, soft.point_layout(P), T.double(), torch.tensor([50.0, 5e5]),
            torch.tensor([-1.0, -1e4]), torch.tensor([False, True]),
            dict(source_lengths=ql, target_lengths=pl))


def _check_step(got, Q, P, T, ql, pl):
    """emicp_step vs emicp_rows + horn_reference in float64."""
    Tg, vg, lam = got
    rl, rx = soft.emicp_rows(Q.double(), P.double(), T.double(), None,
                             torch.tensor([-1.0, -1e4]).double(), source_lengths=ql.cpu(),
                             target_lengths=pl.cpu(), scale=torch.tensor([50.0, 5e5]).double())
    Tr, vr = horn.horn_reference(Q.double(), rx, rl)
    # float32 logits of up to ~50 at s = 5e5: λ agrees to a few 1e-4 relative
    _masked_close(lam.cpu(), rl, ql.cpu(), 1e-6, 5e-4)
    assert vg.cpu().tolist() == vr.tolist()
    torch.testing.assert_close(Tg[0].cpu(), Tr[0], atol=1e-5, rtol=0)
    assert torch.equal(Tg[1].cpu(), T[1].double().cpu())  # frozen: pose kept


def run_interpreted_cases(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): every entry point through Triton."""
    from pointalign.kernels import _backend
    from pointalign.kernels.soft import triton as _soft_triton

    assert _backend.backend(torch.empty(0)) == "interpret"
    out = {}
    for seed in range(3):
        Q, P, T, ql, pl, gw = _interp_case(seed)
        s = torch.tensor([20.0, 3e4])
        for split in (1, 3):
            out[("raw", seed, split)] = _soft_triton.rows(
                Q, P, T, s, ql, pl, gw, None, mode="raw", squares=True, split=split)
        out[("emicp", seed)] = soft.emicp_rows(Q, P, T, torch.tensor([0.01, 1e-6]),
                                               torch.tensor([-1.0, -1e4]), source_lengths=ql,
                                               target_lengths=pl)
        out[("sink", seed)] = soft.sinkhorn_scaling(Q, P, T, s, gw, torch.tensor([0.0, -2.0]),
                                                    torch.tensor([0.5, 1.0]), query_lengths=ql,
                                                    point_lengths=pl)
        w = torch.rand(2, 37, generator=torch.Generator().manual_seed(seed))
        out[("horn", seed)] = horn.weighted_horn(Q, P[:, :37], w)
        *args, kw = _step_case(Q, P, T, ql, pl)
        out[("step", seed)] = soft.emicp_step(*args, **kw)
    g = torch.Generator().manual_seed(5)
    x, y = _cloud(40, g), _cloud(45, g)
    out["sinkhorn_dense"] = kernel_sinkhorn(x.float(), y.float(), _pose(g, 10, 0.02), 60.0,
                                            0.01, 0.3, 2)
    torch.save(out, out_path)


interpreted = interpreted_fixture("tests.kernels.test_soft", "run_interpreted_cases")


def _masked_close(a, b, ql, atol, rtol):
    for i, n in enumerate(ql.tolist()):
        torch.testing.assert_close(a[i, :n].double(), b[i, :n].double(), atol=atol, rtol=rtol)


def test_triton_interpreted_matches_reference(seed, interpreted):
    Q, P, T, ql, pl, gw = _interp_case(seed)
    s = torch.tensor([20.0, 3e4])
    ref = soft.soft_rows_reference(Q.double(), P.double(), T.double(), s.double(),
                                   query_lengths=ql, point_lengths=pl,
                                   point_log_weights=gw.double(), squares=True)
    for split in (1, 3):
        lse, lse2, mean = interpreted[("raw", seed, split)]
        _masked_close(lse, ref.lse, ql, 1e-4, 2e-6)  # |lse| up to ~1e3 at s = 3e4
        _masked_close(lse2, ref.lse2, ql, 1e-4, 2e-6)
        _masked_close(mean, ref.mean, ql, 1e-5, 1e-5)
        assert torch.isinf(lse[1, 20:]).all() and (mean[1, 20:] == 0).all()
    lam, xp = interpreted[("emicp", seed)]
    rl, rx = soft.emicp_rows(Q.double(), P.double(), T.double(),
                             torch.tensor([0.01, 1e-6]).double(),
                             torch.tensor([-1.0, -1e4]).double(), source_lengths=ql,
                             target_lengths=pl)
    _masked_close(lam, rl, ql, 1e-6, 1e-4)
    assert (lam[1, 20:] == 0).all()
    sk = interpreted[("sink", seed)]
    rs = soft.sinkhorn_scaling(Q.double(), P.double(), T.double(), s.double(), gw.double(),
                               torch.tensor([0.0, -2.0]).double(),
                               torch.tensor([0.5, 1.0]).double(), query_lengths=ql,
                               point_lengths=pl)
    _masked_close(sk, rs, ql, 1e-4, 2e-6)
    w = torch.rand(2, 37, generator=torch.Generator().manual_seed(seed))
    Th, valid = interpreted[("horn", seed)]
    Tr, vr = horn.horn_reference(Q, P[:, :37], w)
    assert torch.equal(valid, vr)
    torch.testing.assert_close(Th, Tr, atol=1e-5, rtol=0)
    _check_step(interpreted[("step", seed)], Q, P, T, ql, pl)


def test_emicp_step_reference(seed):
    Q, P, T, ql, pl, _ = _interp_case(seed)
    Q, P, T2, s, lo, frozen, kw = _step_case(Q, P, T, ql, pl)
    _check_step(soft.emicp_step(Q, P, T2, s, lo, frozen, **kw), Q, P, T, ql, pl)


def test_triton_interpreted_sinkhorn_matches_dense_matrix(interpreted):
    g = torch.Generator().manual_seed(5)
    x, y = _cloud(40, g), _cloud(45, g)
    Md = dense_sinkhorn(x, y, _pose(g, 10, 0.02), 60.0, 0.01, 0.3, 2)
    rows, cols, cross, _ = interpreted["sinkhorn_dense"]
    torch.testing.assert_close(rows.double(), Md.sum(1), atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(cols.double(), Md.sum(0), atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(cross.double(), x.T @ Md @ y, atol=2e-5, rtol=2e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("n,m", [(1, 1), (37, 1000), (5003, 4099), (20000, 300)])
def test_triton_cuda_matches_reference(n, m, rng):
    q, p = _cloud(n, rng, torch.float32, 0.2), _cloud(m, rng, torch.float32, 0.2)
    T = _pose(rng, 10, 0.02)[None].float()
    gw = torch.randn(1, m, generator=rng)
    for s in (10.0, 1e5):
        st = torch.tensor([s])
        ref = soft.soft_rows_reference(q[None].double(), p[None].double(), T.double(),
                                       st.double(), point_log_weights=gw.double(), squares=True)
        got = soft.soft_rows(q[None].cuda(), p[None].cuda(), T.cuda(), st.cuda(),
                             point_log_weights=gw.cuda(), squares=True)
        torch.testing.assert_close(got.lse.cpu().double(), ref.lse, atol=1e-3, rtol=1e-5)
        torch.testing.assert_close(got.lse2.cpu().double(), ref.lse2, atol=1e-3, rtol=1e-5)
        torch.testing.assert_close(got.mean.cpu().double(), ref.mean, atol=1e-5, rtol=1e-4)
    if n > 1:  # the fused EM-ICP step (moments in the row kernels) on a ragged batch
        Q = torch.stack([q, q.flip(0)]).cuda()
        P = torch.stack([p, p]).cuda()
        ql, pl = torch.tensor([n, n // 2]).cuda(), torch.tensor([m, max(1, m // 3)]).cuda()
        T2 = torch.cat([T, T]).cuda()
        Q2, P2, Td, s2, lo, frozen, kw = _step_case(Q, P, T2, ql, pl)
        got = soft.emicp_step(Q2, P2, Td, s2.cuda(), lo.cuda(), frozen.cuda(), **kw)
        _check_step(got, Q.cpu(), P.cpu(), T2.cpu(), ql.cpu(), pl.cpu())
    w = torch.rand(1, n, generator=rng)
    Tg, vg = horn.weighted_horn(q[None].cuda(), q[None].cuda() + 0.1, w.cuda())
    Tr, vr = horn.horn_reference(q[None], q[None] + 0.1, w)
    torch.testing.assert_close(Tg.cpu(), Tr, atol=1e-5, rtol=0)


@pytest.mark.parametrize("offset", [0.0, 0.3, 123.456])
def test_weighted_horn_single_point_is_identity_rotation(offset, rng):
    """One point (S is only rounding noise of its moments): R = I, t = m − x, no NaN."""
    x = torch.rand(1, 1, 3, generator=rng, dtype=torch.float64) + offset
    m = x + torch.tensor([0.01, -0.02, 0.03], dtype=torch.float64)
    w = torch.tensor([[0.37]], dtype=torch.float64)
    for xs, ms in ((x, m), (x.float(), m.float())):
        T, valid = horn.horn_reference(xs, ms, w.to(xs.dtype))
        assert bool(valid[0])
        torch.testing.assert_close(T[0, :3, :3], torch.eye(3, dtype=torch.float64))
        torch.testing.assert_close(T[0, :3, 3], (ms - xs)[0, 0].double(), atol=1e-5, rtol=0)
