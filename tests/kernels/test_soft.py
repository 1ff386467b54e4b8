"""kernels.soft: fused soft-correspondence reductions vs dense float64 references, per backend.

The dense reference below builds the full N×M matrix in float64 (tiny N only), exactly as
Tamaki et al.'s GPU code does (including the explicit outlier row and column for Sinkhorn);
the kernels never build it. Compared: row sums, column sums, weighted coordinate sums, the
cross-covariance, EM-ICP's λ and x', and the Horn pose; on random data (odd sizes, N ≠ M,
ragged batches) and on the bunny; for every backend of the ``backend`` fixture (the PyTorch
reference, numba, Triton on CUDA [gpu]) and the Triton kernels through the interpreter in a
child process.

The CPU's forms (``kernels.soft.cpu``): exact, equal to the reference up to the order of
float64 sums; EM-ICP's "cells", every row sum within the bounds the module states (Jensen /
Hoeffding per kept cell, ``e^(−s(R − h)²)`` per dropped point); Softassign's "truncated",
every Sinkhorn output within its relative bound; Softassign's "cells" and its fused update
(equal to its passes one by one within a bound derived from the rounding between passes);
the plan's modes, record and estimates.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pointalign import datasets, transforms
from pointalign.kernels import horn, soft
from pointalign.kernels._numba import available
from pointalign.kernels.knn.cpu import CpuTree
from pointalign.kernels.soft import reference
from tests._interpreted import interpreted_fixture

needs_numba = pytest.mark.skipif(not available(), reason="numba is not installed")

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
    """The kernels' version: returns row sums, column sums, Σ_ij m_ij x_i y_jᵀ, Σ m y.

    ``x``, ``y`` on the backend's device; the results on the host.
    """
    B, dev = 1, x.device
    xb, yb, Tb = x[None], y[None], T[None].to(x.dtype).to(dev)
    Ti = transforms.invert(T.double())[None].to(x.dtype).to(dev)
    bt = torch.tensor([beta], dtype=x.dtype, device=dev)
    ba = torch.tensor([beta * alpha], dtype=x.dtype, device=dev)
    lw = torch.tensor([math.log(w)], dtype=x.dtype, device=dev)
    g_col = ba[:, None].expand(B, y.shape[0]).contiguous()
    for _ in range(rounds):
        g_row = soft.sinkhorn_scaling(xb, yb, Tb, bt, g_col, lw, ba)
        g_col = soft.sinkhorn_scaling(yb, xb, Ti, bt, g_row, lw, ba)
    r = soft.soft_rows(xb, yb, Tb, bt, point_log_weights=g_col)
    rows = torch.exp(r.lse + g_row - ba[:, None])[0].cpu()
    c = soft.soft_rows(yb, xb, Ti, bt, point_log_weights=g_row)
    cols = torch.exp(c.lse + g_col - ba[:, None])[0].cpu()
    cross = (rows[:, None] * x.cpu()).T @ r.mean[0].cpu()
    return rows, cols, cross, (rows[:, None] * r.mean[0].cpu()).sum(0)


def _cloud(n, g, dtype=torch.float64, scale=1.0):
    return (torch.rand(n, 3, generator=g, dtype=torch.float64) * scale).to(dtype)


def _pose(g, deg=20.0, trans=0.1):
    return transforms.random_transform(deg, trans, generator=g)


def _tol(backend, f64=None):
    """Tolerances of a backend's answer to a float64 reference of a small, well-scaled case.

    Triton sums in float32 (exp2 with flushed denormals): a few float32 ulps of logits of
    at most ~20 here, ~1e-5, with a margin; numba sums in float64 and the reference
    computes in the input's dtype: float64 tolerances (``f64``, default assert_close's).
    """
    if backend.name == "triton":
        return dict(atol=1e-4, rtol=1e-4)
    return {} if f64 is None else f64


def _on(backend, *ts):
    return tuple(t.to(backend.device) for t in ts)


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


# ------------------------------------------------------------------------------------------
# every backend vs the dense and chunked references
# ------------------------------------------------------------------------------------------


def test_rows_float32_matches_dense(backend, rng):
    q, p, T = _cloud(300, rng), _cloud(257, rng), _pose(rng)
    s = torch.tensor([50.0])
    qd, pd, Td, sd = _on(backend, q[None].float(), p[None].float(), T[None].float(), s)
    r = soft.soft_rows(qd, pd, Td, sd, squares=True)
    lse, lse2, mean = dense_rows(q, p, T, 50.0)
    torch.testing.assert_close(r.lse[0].cpu().double(), lse, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(r.mean[0].cpu().double(), mean, atol=1e-5, rtol=1e-5)


def test_ragged_batch_ignores_padding(backend, rng):
    qs = [_cloud(n, rng) for n in (5, 11, 2)]
    ps = [_cloud(m, rng) for m in (9, 3, 13)]
    Q = torch.full((3, 11, 3), 1e3, dtype=torch.float64)  # padding far away: must not count
    P = torch.full((3, 13, 3), -1e3, dtype=torch.float64)
    for i, (q, p) in enumerate(zip(qs, ps, strict=True)):
        Q[i, : len(q)], P[i, : len(p)] = q, p
    T = torch.stack([_pose(rng) for _ in range(3)])
    s = torch.tensor([1.0, 5.0, 0.5], dtype=torch.float64)
    ql, pl = torch.tensor([5, 11, 2]), torch.tensor([9, 3, 13])
    r = soft.soft_rows(*_on(backend, Q, P, T, s), query_lengths=ql.to(backend.device),
                       point_lengths=pl.to(backend.device), squares=True)
    lse_all, mean_all = r.lse.cpu(), r.mean.cpu()
    for i, (q, p) in enumerate(zip(qs, ps, strict=True)):
        lse, _, mean = dense_rows(q, p, T[i], float(s[i]))
        torch.testing.assert_close(lse_all[i, : len(q)], lse, **_tol(backend))
        torch.testing.assert_close(mean_all[i, : len(q)], mean, **_tol(backend))
        assert torch.isinf(lse_all[i, len(q):]).all()
        assert (mean_all[i, len(q):] == 0).all()


def test_emicp_rows_match_dense_row_col_sums_and_cross(backend, rng):
    x, y, T = _cloud(80, rng, scale=0.2), _cloud(67, rng, scale=0.2), _pose(rng, 10, 0.02)
    sigma2, log_out = 0.004, -0.01 / 0.004
    lam, xp = soft.emicp_rows(*_on(backend, x[None], y[None], T[None],
                                   torch.tensor([sigma2]).double(),
                                   torch.tensor([log_out]).double()))
    lam, xp = lam.cpu(), xp.cpu()
    Ms, lam_d, xp_d = dense_emicp(x, y, T, sigma2, log_out)
    tol = _tol(backend)
    torch.testing.assert_close(lam[0], lam_d, **tol)
    torch.testing.assert_close(xp[0], xp_d, **tol)
    # the soft Horn moments (Tamaki eqs. 18-20, 26) from the rows alone
    W, sx, sm, cross = horn.horn_moments(x[None], xp, lam)
    torch.testing.assert_close(W[0], Ms.sum(), **tol)
    torch.testing.assert_close(sx[0], (Ms.sum(1)[:, None] * x).sum(0), **tol)
    torch.testing.assert_close(sm[0], (Ms.sum(0)[:, None] * y).sum(0), **tol)  # column sums
    torch.testing.assert_close(cross[0], x.T @ Ms @ y, **tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_sinkhorn_scalings_match_dense_matrix(backend, dtype, rng):
    x, y, T = _cloud(45, rng, scale=0.2), _cloud(38, rng, scale=0.2), _pose(rng, 10, 0.02)
    beta, alpha, w, rounds = 60.0, 0.002, 0.3, 3
    Md = dense_sinkhorn(x, y, T, beta, alpha, w, rounds)
    rows, cols, cross, sy = kernel_sinkhorn(*_on(backend, x.to(dtype), y.to(dtype)), T, beta,
                                            alpha, w, rounds)
    tol = dict(atol=1e-10, rtol=1e-9) if dtype == torch.float64 and backend.name != "triton" \
        else dict(atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(rows.double(), Md.sum(1), **tol)
    torch.testing.assert_close(cols.double(), Md.sum(0), **tol)
    torch.testing.assert_close(cross.double(), x.T @ Md @ y, **tol)
    torch.testing.assert_close(sy.double(), (Md.sum(0)[:, None] * y).sum(0), **tol)


def test_bunny_rows_match_dense(backend, bunny_pair):
    x = datasets.random_subsample(bunny_pair.source, 400, 1)
    y = datasets.random_subsample(bunny_pair.target, 350, 2)
    T = torch.as_tensor(bunny_pair.T_target_source)
    lam, xp = soft.emicp_rows(*_on(backend, x[None], y[None], T[None].float(),
                                   torch.tensor([1e-4]), torch.tensor([-100.0])))
    _, lam_d, xp_d = dense_emicp(x, y, T, 1e-4, -100.0)
    torch.testing.assert_close(lam[0].cpu().double(), lam_d, atol=1e-5, rtol=1e-4)
    ok = lam_d > 1e-3
    torch.testing.assert_close(xp[0].cpu().double()[ok], xp_d[ok], atol=1e-6, rtol=1e-5)


def test_underflow_gives_no_nan(backend, rng):
    """Scales where every exp(z) underflows in float32 (and float64): finite, sane results."""
    x, y = _cloud(50, rng), _cloud(40, rng) + 5.0  # far apart: d² ≈ 75
    T = torch.eye(4, dtype=torch.float64)
    xd, yd, Td = _on(backend, x[None].float(), y[None].float(), T[None].float())
    for s in (1e3, 1e8):
        r = soft.soft_rows(xd, yd, Td, torch.tensor([s], device=backend.device), squares=True)
        assert torch.isfinite(r.mean).all()
        if backend.name == "triton" and s == 1e8:
            # float32 cannot resolve z − max(z) at s·d² ≈ 1e10 (half an ulp is hundreds in
            # log2 units): such a row reports no mass (lse −inf, mean 0), never NaN or +inf
            for lse in (r.lse, r.lse2):
                assert not torch.isnan(lse).any() and (lse < math.inf).all()
        else:
            assert torch.isfinite(r.lse).all() and torch.isfinite(r.lse2).all()
        # the soft correspondence tends to the nearest point as s grows
        if s == 1e8 and backend.name != "triton":
            d = torch.cdist(x.double(), y.double())
            torch.testing.assert_close(r.mean[0].cpu().double(), y.double()[d.argmin(1)],
                                       atol=1e-4, rtol=0)
        lam, xp = soft.emicp_rows(xd, yd, Td, *_on(backend, torch.tensor([1.0 / s]),
                                                   torch.tensor([-s * 0.01])))
        assert torch.isfinite(lam).all() and torch.isfinite(xp).all()
        assert (lam >= 0).all() and float(lam.max()) < 1e-6  # all points are outliers
        g = torch.zeros(1, 40, device=backend.device)
        out = soft.sinkhorn_scaling(xd, yd, Td, *_on(backend, torch.tensor([s]), g,
                                                     torch.tensor([0.0]), torch.tensor([0.0])))
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("n,m", [(1, 1), (37, 1000), (5003, 4099), (20000, 300)])
def test_rows_and_step_match_reference(backend, n, m, rng):
    """Every size class against the float64 reference (float32 inputs), the fused EM-ICP step
    on a ragged batch, and Horn on the backend."""
    q, p = _cloud(n, rng, torch.float32, 0.2), _cloud(m, rng, torch.float32, 0.2)
    T = _pose(rng, 10, 0.02)[None].float()
    gw = torch.randn(1, m, generator=rng)
    for s in (10.0, 1e5):
        st = torch.tensor([s])
        ref = soft.soft_rows_reference(q[None].double(), p[None].double(), T.double(),
                                       st.double(), point_log_weights=gw.double(), squares=True)
        got = soft.soft_rows(*_on(backend, q[None], p[None], T, st),
                             point_log_weights=gw.to(backend.device), squares=True)
        torch.testing.assert_close(got.lse.cpu().double(), ref.lse, atol=1e-3, rtol=1e-5)
        torch.testing.assert_close(got.lse2.cpu().double(), ref.lse2, atol=1e-3, rtol=1e-5)
        torch.testing.assert_close(got.mean.cpu().double(), ref.mean, atol=1e-5, rtol=1e-4)
    if n > 1:  # the fused EM-ICP step (moments in the row kernels) on a ragged batch
        Q = torch.stack([q, q.flip(0)])
        P = torch.stack([p, p])
        ql, pl = torch.tensor([n, n // 2]), torch.tensor([m, max(1, m // 3)])
        T2 = torch.cat([T, T])
        Q2, P2, Td, s2, lo, frozen, kw = _step_case(*_on(backend, Q, P, T2, ql, pl))
        got = soft.emicp_step(Q2, P2, Td, *_on(backend, s2, lo, frozen), **kw)
        _check_step(got, Q, P, T2, ql, pl)
    w = torch.rand(1, n, generator=rng)
    Tg, vg = horn.weighted_horn(*_on(backend, q[None], q[None] + 0.1, w))
    Tr, vr = horn.horn_reference(q[None], q[None] + 0.1, w)
    torch.testing.assert_close(Tg.cpu(), Tr, atol=1e-5, rtol=0)


@pytest.mark.gpu
def test_merge_groups_and_one_compilation_for_every_split(rng):
    """Splits within, at and across the merge kernel's groups against the float64 reference;
    a later split reuses the row and merge kernels already compiled (the split is a run-time
    value: a constant one compiled a merge kernel of seconds per cloud size)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from pointalign.kernels.soft import triton as _soft_triton

    dev = torch.device("cuda")
    # points far apart in scale: later partials raise the running maximum of earlier ones
    q, p = _cloud(300, rng, torch.float32, 0.2), _cloud(2000, rng, torch.float32, 0.2)
    p[1500:] *= 0.01
    T = _pose(rng, 10, 0.02)[None].float()
    s = torch.tensor([1e4])
    ref = soft.soft_rows_reference(q[None].double(), p[None].double(), T.double(), s.double(),
                                   squares=True)
    one = torch.ones(1, dtype=torch.int64)
    args = (q[None].to(dev), p[None].to(dev), T.to(dev), s, one * 300, one * 2000, None, None)
    from pointalign.kernels import _precompile

    def check(split):
        lse, lse2, mean = _soft_triton.rows(*args, mode="raw", squares=True, split=split)
        torch.testing.assert_close(lse.cpu().double(), ref.lse, atol=1e-3, rtol=1e-5)
        torch.testing.assert_close(lse2.cpu().double(), ref.lse2, atol=1e-3, rtol=1e-5)
        torch.testing.assert_close(mean.cpu().double(), ref.mean, atol=1e-5, rtol=1e-4)

    check(2)
    with _precompile.record() as compiled:
        for split in (31, 32, 33, 64, 100):
            check(split)
    assert compiled == []


def _update_case(g, dtype, batch):
    """Softassign update arguments: clouds, poses and β of a short hot schedule."""
    x = torch.stack([_sheet(g, 700), _sheet(g, 700)]).to(dtype)[:batch]
    y = torch.stack([_sheet(g, 600), _sheet(g, 600)]).to(dtype)[:batch]
    xl, yl = torch.tensor([700, 650])[:batch], torch.tensor([600, 520])[:batch]
    beta = torch.tensor([2.0, 3.0], dtype=torch.float32)[:batch]
    ba = torch.tensor([0.02, 0.03], dtype=torch.float32)[:batch]
    log_w = torch.zeros(batch, dtype=torch.float32)
    return x, y, xl, yl, beta, ba, log_w


def test_softassign_update_is_its_passes(backend):
    """The update entry point against its reference, the passes one by one in float64."""
    g = torch.Generator().manual_seed(37)
    x, y, xl, yl, beta, ba, log_w = _update_case(g, torch.float32, 2)
    T = torch.stack([_rot(0.1), torch.linalg.inv(_rot(0.2, (0.05, 0.0, 0.01)))])
    lse, mean = soft.softassign_update(*_on(backend, x, y, T, beta, ba, log_w),
                                       source_lengths=xl.to(backend.device),
                                       target_lengths=yl.to(backend.device), rounds=3)
    r_lse, r_mean = reference.softassign_passes(
        reference.Passes(), x.double(), y.double(), T, beta.double(), ba.double(),
        log_w.double(), xl, yl, 3)
    assert lse.dtype == torch.float32 and lse.shape == (2, 600) and mean.shape == (2, 600, 3)
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(r_lse))
    fin = torch.isfinite(r_lse)
    # float32 inputs: the reference in float32 and numba (rounding to float32 after each
    # float64 pass) within a few float32 ulps of |lse| ≲ 10 per pass; Triton likewise
    torch.testing.assert_close(lse.cpu().double()[fin], r_lse[fin], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(mean.cpu().double(), r_mean, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="rounds"):
        soft.softassign_update(*_on(backend, x, y, T, beta, ba, log_w), rounds=0)


def test_softassign_step_is_update_weights_and_horn(backend):
    """The fused iteration against its parts in float64: the update's last pass, the
    weights sigmoid(lse − log slack) and weighted Horn of (x', y, w); a frozen entry keeps
    its pose. Triton's last pass writes the weights and Horn's moments itself."""
    g = torch.Generator().manual_seed(43)
    x, y, xl, yl, beta, ba, log_w = _update_case(g, torch.float32, 2)
    T = torch.stack([_rot(0.1), torch.linalg.inv(_rot(0.2, (0.05, 0.0, 0.01)))])
    frozen = torch.tensor([False, True])
    got_T, valid, w = soft.softassign_step(
        *_on(backend, x, y, T, beta, ba, log_w, frozen),
        source_lengths=xl.to(backend.device), target_lengths=yl.to(backend.device),
        rounds=2)
    lse, mean = reference.softassign_passes(
        reference.Passes(), x.double(), y.double(), T, beta.double(), ba.double(),
        log_w.double(), xl, yl, 2)
    r_w = reference.softassign_weights(lse, log_w.double())
    r_T, r_valid = horn.horn_reference(mean, y.double(), r_w)
    assert w.shape == (2, 600) and (w.cpu()[1, 520:] == 0).all()
    torch.testing.assert_close(w.cpu().double(), r_w, atol=1e-5, rtol=1e-5)
    assert valid.cpu().tolist() == r_valid.tolist() == [True, True]
    torch.testing.assert_close(got_T[0].cpu(), r_T[0], atol=1e-5, rtol=0)
    assert torch.equal(got_T[1].cpu(), T[1])  # frozen: its pose kept
    with pytest.raises(ValueError, match="rounds"):
        soft.softassign_step(*_on(backend, x, y, T, beta, ba, log_w, frozen), rounds=0)
    with pytest.raises(ValueError, match="frozen"):
        soft.softassign_step(*_on(backend, x, y, T, beta, ba, log_w, frozen[:1]), rounds=1)
    with pytest.raises(ValueError, match="log_slack"):
        soft.softassign_step(*_on(backend, x, y, T, beta, ba, log_w[:, None], frozen),
                             rounds=1)
    with pytest.raises(ValueError, match="offset"):
        soft.softassign_update(*_on(backend, x, y, T, beta, ba[:1], log_w), rounds=1)


def test_passes_move_by_their_inverse_form_as_by_the_inverse_matrix(backend):
    """A backend's ``Passes.inverse(T)`` (Triton: T marked, inverted in the row kernel as
    Rᵀ (q − t)) moves the queries as the matrix T⁻¹ does: the same rows to float32 rounding
    (the matrix's −Rᵀt rounds once to float32, the kernel's q − t once per point)."""
    g = torch.Generator().manual_seed(41)
    x, y, xl, yl, beta, ba, log_w = _update_case(g, torch.float32, 2)
    x, y, xl, yl, beta, ba, log_w = _on(backend, x, y, xl, yl, beta, ba, log_w)
    T = torch.stack([_rot(0.3, (0.2, -0.1, 0.05)), _rot(-0.2, (0.0, 0.3, 0.1))])
    T = T.to(backend.device)
    passes = soft._exact(y, x.shape[1])
    g_row = torch.randn(x.shape[:2], generator=g).to(backend.device)
    got = [passes.soft_rows(y, x, pose, beta, yl, xl, point_log_weights=g_row)
           for pose in (passes.inverse(T), T.inverse())]
    torch.testing.assert_close(got[0].lse, got[1].lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0].mean, got[1].mean, rtol=1e-5, atol=1e-5)
    got = [passes.sinkhorn_scaling(y, x, pose, beta, g_row, log_w, ba, yl, xl)
           for pose in (passes.inverse(T), T.inverse())]
    torch.testing.assert_close(got[0], got[1], rtol=1e-5, atol=1e-5)


def test_nearest_d2_within_its_contract(backend, rng):
    """Exact on the CPU (k-d tree), within the soft minimum's bound elsewhere; padding inf."""
    q, p = _cloud(300, rng, scale=0.5), _cloud(250, rng, scale=0.5)
    Q = torch.zeros(2, 300, 3)
    Q[0], Q[1, :200] = q.float(), q[:200].float()
    P = torch.stack([p, p]).float()
    T = torch.stack([_pose(rng, 10, 0.02), torch.eye(4, dtype=torch.float64)])
    max_d2 = torch.tensor([0.01, 0.004], dtype=torch.float64)
    ql, pl = torch.tensor([300, 200]), torch.tensor([250, 120])
    d2 = soft.nearest_d2(*_on(backend, Q, P, T, max_d2), query_lengths=ql.to(backend.device),
                         point_lengths=pl.to(backend.device)).cpu()
    assert d2.dtype == torch.float64 and d2.shape == (2, 300)
    for b in range(2):
        qt = Q[b, :ql[b]].double() @ T[b, :3, :3].T + T[b, :3, 3]
        true = torch.cdist(qt, P[b, :pl[b]].double()).square().amin(1)
        near = true <= max_d2[b]
        if backend.name == "cpu":
            torch.testing.assert_close(d2[b, :ql[b]][near], true[near], atol=1e-12, rtol=0)
            assert torch.isinf(d2[b, :ql[b]][~near]).all()
        else:  # the soft minimum: below by at most log(M) max_d2 / FITNESS_SCALE, float32
            slack = math.log(int(pl[b])) * float(max_d2[b]) / soft.FITNESS_SCALE
            got = d2[b, :ql[b]][near]
            assert bool((got <= true[near] + 1e-6).all() and (got >= true[near] - slack - 1e-6)
                        .all())
            assert bool((d2[b, :ql[b]][~near] > max_d2[b] - slack - 1e-6).all())
    if backend.name == "cpu":
        assert torch.isinf(d2[1, 200:]).all()


def test_prepare_names_bad_arguments_and_reports_its_form(backend):
    x = torch.rand(1, 50, 3, device=backend.device)
    n = torch.tensor([50], device=backend.device)
    with pytest.raises(ValueError, match="approximation"):
        soft.prepare("emicp", x, x, n, n, iterations=3, approximation="fast")
    with pytest.raises(ValueError, match="method"):
        soft.prepare("icp", x, x, n, n, iterations=3)
    asked = []
    p = soft.prepare("emicp", x, x, n, n, iterations=3, approximation="approximate",
                     schedule=lambda: asked.append(1) or {"sigmas": [0.5, 0.4, 0.3]})
    if backend.name == "cpu":  # the numba passes plan ahead: they read the schedule once
        assert asked == [1] and p.form == "cells" and p.estimate_s > 0 and p.host
        assert p.info()["mode"] == "cells"
    else:  # exact; no plan, no schedule read, no estimate
        assert asked == [] and p.form == "exact" and p.estimate_s is None
        assert p.info() == {"mode": "exact", "device": str(x.device)}
        assert p.host == (backend.device == "cpu")


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
    with pytest.raises(ValueError, match="max_d2"):
        soft.nearest_d2(q, q, torch.eye(4)[None], torch.ones(2))


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


# ------------------------------------------------------------------------------------------
# Triton kernels through the interpreter (child process)
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
    """emicp_step vs the reference E-step + horn_reference in float64 (host tensors)."""
    Tg, vg, lam = got
    Q, P, T, ql, pl = (t.cpu() for t in (Q, P, T, ql, pl))
    rl, rx = reference.Passes().emicp_rows(Q.double(), P.double(), T.double(),
                                           torch.tensor([50.0, 5e5]).double(),
                                           torch.tensor([-1.0, -1e4]).double(), ql, pl)
    Tr, vr = horn.horn_reference(Q.double(), rx, rl)
    # float32 logits of up to ~50 at s = 5e5: λ agrees to a few 1e-4 relative
    _masked_close(lam.cpu(), rl, ql, 1e-6, 5e-4)
    assert vg.cpu().tolist() == vr.tolist()
    torch.testing.assert_close(Tg[0].cpu(), Tr[0], atol=1e-5, rtol=0)
    assert torch.equal(Tg[1].cpu(), T[1].double())  # frozen: pose kept


#: (scale, split) of the culled passes: from every tile kept to most skipped
CULL_CASES = [(1.0, 1), (300.0, 1), (300.0, 3), (2e4, 2)]


def _cull_case():
    """A sheet of 400 points in scan order, in Morton order, and 300 noisy rows of it."""
    g = torch.Generator().manual_seed(11)
    u, v = torch.rand(400, generator=g), torch.rand(400, generator=g)
    P = torch.stack([u, v, 0.1 * torch.sin(6 * u)], 1)
    from pointalign.kernels.grid import morton_order

    P = P[morton_order(P)]
    Q = P[:300] + 0.01 * torch.randn(300, 3, generator=g, dtype=torch.float64)
    return Q[None].float(), P[None].float(), _pose(g, 2, 0.01)[None].float()


def _cull_cases(soft_triton) -> dict:
    """EM-ICP rows culled, not culled, and with every tile but the seed skipped."""
    import os

    Q, P, T = _cull_case()
    n = torch.tensor([300]), torch.tensor([400])
    out = {}
    soft_triton.CULL_MIN_POINTS = 0  # these 400 points are culled too
    for scale, split in CULL_CASES:
        args = (Q, P, T, torch.tensor([scale]), *n, None, torch.tensor([-3.0]))
        for cull in ("0", "1"):
            os.environ["POINTALIGN_SOFT_CULL"] = cull
            out[(scale, split, cull)] = soft_triton.rows(*args, mode="emicp", squares=True,
                                                         split=split)
        bits, soft_triton.CULL_BITS = soft_triton.CULL_BITS, -1e30
        out[(scale, split, "all")] = soft_triton.rows(*args, mode="emicp", squares=True,
                                                      split=split)
        soft_triton.CULL_BITS = bits
    os.environ.pop("POINTALIGN_SOFT_CULL")
    return out


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
        passes = _soft_triton.TritonPasses("cpu")  # the column passes' pose: T inverted
        out[("sink_inv", seed)] = passes.sinkhorn_scaling(
            Q, P, passes.inverse(T), s, gw, torch.tensor([0.0, -2.0]),
            torch.tensor([0.5, 1.0]), ql, pl)
        for split in (1, 3):  # Softassign's last column pass: weights and Horn's moments
            out[("column", seed, split)] = _soft_triton.rows(
                Q, P, T, s, ql, pl, gw, torch.tensor([0.0, -2.0]), mode="column",
                moments=True, invert=True, split=split)
        w = torch.rand(2, 37, generator=torch.Generator().manual_seed(seed))
        out[("horn", seed)] = horn.weighted_horn(Q, P[:, :37], w)
        *args, kw = _step_case(Q, P, T, ql, pl)
        out[("step", seed)] = soft.emicp_step(*args, **kw)
    out["cull"] = _cull_cases(_soft_triton)
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
    rl, rx = reference.Passes().emicp_rows(Q.double(), P.double(), T.double(),
                                           0.5 / torch.tensor([0.01, 1e-6]).double(),
                                           torch.tensor([-1.0, -1e4]).double(), ql, pl)
    _masked_close(lam, rl, ql, 1e-6, 1e-4)
    assert (lam[1, 20:] == 0).all()
    sk = interpreted[("sink", seed)]
    rs = reference.Passes().sinkhorn_scaling(Q.double(), P.double(), T.double(), s.double(),
                                             gw.double(), torch.tensor([0.0, -2.0]).double(),
                                             torch.tensor([0.5, 1.0]).double(), ql, pl)
    _masked_close(sk, rs, ql, 1e-4, 2e-6)
    rs = reference.Passes().sinkhorn_scaling(Q.double(), P.double(),
                                             torch.linalg.inv(T.double()), s.double(),
                                             gw.double(), torch.tensor([0.0, -2.0]).double(),
                                             torch.tensor([0.5, 1.0]).double(), ql, pl)
    _masked_close(interpreted[("sink_inv", seed)], rs, ql, 1e-4, 2e-6)
    r = soft.soft_rows_reference(Q.double(), P.double(), torch.linalg.inv(T.double()),
                                 s.double(), query_lengths=ql, point_lengths=pl,
                                 point_log_weights=gw.double())
    rw = reference.softassign_weights(r.lse, torch.tensor([0.0, -2.0]).double())
    for split in (1, 3):
        w, mom, mean = interpreted[("column", seed, split)]
        _masked_close(w, rw, ql, 1e-6, 1e-4)
        assert (w[1, 20:] == 0).all()
        _masked_close(mean, r.mean, ql, 1e-5, 1e-5)
        # the moments of (x' -> q, w) summed over the row blocks: Σw, Σw x', Σw q, Σw x' qᵀ
        rows = [torch.cat([rw[b, :n, None] * t for t in (torch.ones_like(Q[b, :n, :1]),
                                                           r.mean[b, :n], Q[b, :n].double())]
                          + [(rw[b, :n, None, None] * r.mean[b, :n, :, None]
                              * Q[b, :n, None, :].double()).reshape(n, 9)], 1).sum(0)
                for b, n in enumerate(ql.tolist())]
        torch.testing.assert_close(mom.sum(1), torch.stack(rows), atol=1e-5, rtol=1e-5)
    w = torch.rand(2, 37, generator=torch.Generator().manual_seed(seed))
    Th, valid = interpreted[("horn", seed)]
    Tr, vr = horn.horn_reference(Q, P[:, :37], w)
    assert torch.equal(valid, vr)
    torch.testing.assert_close(Th, Tr, atol=1e-5, rtol=0)
    _check_step(interpreted[("step", seed)], Q, P, T, ql, pl)


def test_triton_interpreted_culled_tiles_change_nothing(interpreted):
    """A pass without column offsets leaves out tiles whose every pair weighs under
    2^−(CULL_BITS + log2 M + 1) of the row's largest: λ and x' equal the pass that keeps
    every tile to float32 rounding, and the float64 reference. Leaving out every whole tile
    changes them: the lists are what the row kernel sums."""
    Q, P, T = _cull_case()
    n = torch.tensor([300]), torch.tensor([400])
    for scale, split in CULL_CASES:
        kept, culled, all_ = (interpreted["cull"][(scale, split, c)] for c in ("0", "1", "all"))
        rl, rx = reference.Passes().emicp_rows(Q.double(), P.double(), T.double(),
                                               torch.tensor([scale]).double(),
                                               torch.tensor([-3.0]).double(), *n)
        torch.testing.assert_close(culled[0], kept[0], atol=0, rtol=1e-6)
        torch.testing.assert_close(culled[2], kept[2], atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(culled[0].double(), rl, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(culled[2].double(), rx, atol=1e-5, rtol=1e-4)
        if scale > 1:
            assert not torch.allclose(all_[0], kept[0], rtol=1e-3)


def test_warmup_compiles_the_culled_passes():
    """The GPU warm-up's second EM-ICP call is large enough to be culled, so the Triton
    manifest records the cull kernel and the listed row kernel: no compile at a first
    large EM-ICP."""
    pytest.importorskip("triton")
    from pointalign import _warmup
    from pointalign.kernels.soft import triton as _soft_triton

    assert _warmup.SOFT_POINTS < _soft_triton.CULL_MIN_POINTS <= _warmup.SOFT_CULLED_POINTS


@pytest.mark.gpu
def test_culled_tiles_change_nothing_on_cuda():
    """On CUDA (256-row blocks, the splits the sizes choose), EM-ICP rows of the bunny
    culled and not culled agree to float32 summation order, from a σ that leaves out
    nothing to one that leaves out most tiles; so do the fused steps' poses."""
    import os

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    y = soft.centre(datasets.load_bunny("bun000").float()[None].to(dev),
                    torch.tensor([40256], device=dev))
    x = soft.centre(datasets.load_bunny("bun045").float()[None].to(dev),
                    torch.tensor([40097], device=dev), layout=False)
    T = torch.eye(4, dtype=torch.float64, device=dev)[None]
    for sigma in (0.05, 0.01, 0.002):
        s = torch.tensor([0.5 / sigma**2], device=dev)
        lo = torch.tensor([-(0.1 / sigma) ** 2], device=dev)
        got = {}
        for cull in ("0", "1"):
            os.environ["POINTALIGN_SOFT_CULL"] = cull
            try:
                got[cull] = (soft.emicp_rows(x.points, y.points, T, None, lo, scale=s,
                                             source_lengths=x.lengths, target_lengths=y.lengths),
                             soft.emicp_step(x.points, y.points, T, s, lo,
                                             torch.tensor([False], device=dev),
                                             source_lengths=x.lengths, target_lengths=y.lengths))
            finally:
                os.environ.pop("POINTALIGN_SOFT_CULL")
        (lam0, xp0), (T0, _, _) = got["0"]
        (lam1, xp1), (T1, _, _) = got["1"]
        # the culled pass also splits the points among 27 programs a block instead of 4:
        # its float32 sums run in another order (differences of ~1e-5 relative seen)
        torch.testing.assert_close(lam1, lam0, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(xp1, xp0, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(T1, T0, atol=1e-6, rtol=0)


def test_emicp_step_matches_reference(backend, seed):
    Q, P, T, ql, pl, _ = _interp_case(seed)
    Q2, P2, T2, s, lo, frozen, kw = _step_case(*_on(backend, Q, P, T, ql, pl))
    _check_step(soft.emicp_step(Q2, P2, T2, *_on(backend, s, lo, frozen), **kw), Q, P, T, ql,
                pl)


def test_triton_interpreted_sinkhorn_matches_dense_matrix(interpreted):
    g = torch.Generator().manual_seed(5)
    x, y = _cloud(40, g), _cloud(45, g)
    Md = dense_sinkhorn(x, y, _pose(g, 10, 0.02), 60.0, 0.01, 0.3, 2)
    rows, cols, cross, _ = interpreted["sinkhorn_dense"]
    torch.testing.assert_close(rows.double(), Md.sum(1), atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(cols.double(), Md.sum(0), atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(cross.double(), x.T @ Md @ y, atol=2e-5, rtol=2e-4)


# ------------------------------------------------------------------------------------------
# the CPU's forms (numba): exact, cells, truncated; the plan; the fused Softassign update
# ------------------------------------------------------------------------------------------


def _sheet(g, n, flat=0.05):
    """A noisy sheet-like cloud (n, 3) float64: surfaces are what the soft methods see."""
    return torch.randn(n, 3, generator=g, dtype=torch.float64) * torch.tensor([1.0, 1.0, flat],
                                                                                dtype=torch.float64)


def _rot(rz=0.1, t=(0.05, -0.02, 0.01)):
    T = torch.eye(4, dtype=torch.float64)
    c, s = math.cos(rz), math.sin(rz)
    T[:2, :2] = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    T[:3, 3] = torch.tensor(t, dtype=torch.float64)
    return T


def _passes(n, m, **kw):
    """CPU passes in the form a plan chooses (``cpu_plan.plan``'s arguments)."""
    from pointalign.kernels.soft import cpu, cpu_plan

    return cpu.CpuPasses(plan=cpu_plan.plan(n, m, 1, **kw))


@needs_numba
@pytest.mark.parametrize("scale,weights", [(2.0, False), (50.0, True), (1e6, True)])
def test_exact_rows_equal_reference(backend, scale, weights):
    """The exact pass (numba: both kernels, linear weights and running maximum) = reference.

    Float64 sums on both sides (the reference in the input's float64): equal up to their
    order. (Triton sums in float32: ``test_rows_and_step_match_reference``.)
    """
    if backend.name == "triton":
        pytest.skip("float32 sums: test_rows_and_step_match_reference")
    g = torch.Generator().manual_seed(3)
    q, p = _sheet(g, 301), _sheet(g, 257)
    lw = torch.randn(1, 257, generator=g, dtype=torch.float64) * 3 if weights else None
    sc = torch.tensor([scale], dtype=torch.float64)
    T = _rot()[None]
    ref = soft.soft_rows_reference(q[None], p[None], T, sc, point_log_weights=lw, squares=True)
    got = soft.soft_rows(q[None], p[None], T, sc, point_log_weights=lw, squares=True)
    if backend.name == "cpu":  # the numba form is the one a plan chooses as "exact"
        other = _passes(301, 257, approximation="exact").soft_rows(
            q[None], p[None], T, sc, point_log_weights=lw, squares=True)
        assert all(torch.equal(a, b) for a, b in zip(got, other, strict=True))
    lse, lse2, mean = got
    fin = torch.isfinite(ref.lse)
    assert torch.equal(fin, torch.isfinite(lse))
    assert torch.allclose(lse[fin], ref.lse[fin], rtol=0, atol=1e-9)
    assert ref.lse2 is not None and lse2 is not None
    assert torch.allclose(lse2[fin], ref.lse2[fin], rtol=0, atol=1e-9)
    assert torch.allclose(mean, ref.mean, rtol=0, atol=1e-9)


@needs_numba
@pytest.mark.parametrize("sigma", [0.6, 0.2, 0.05])
def test_cells_row_sums_within_stated_bounds(sigma):
    """At source-cell centroids, the cells' row sums bracket the exact all-pairs sums."""
    from pointalign.kernels.soft import cpu, cpu_plan, cpu_rows

    g = torch.Generator().manual_seed(5)
    t = _sheet(g, 3000)
    q = _sheet(g, 400) + 0.05
    k, c = cpu.TRUNCATE_K, cpu.CELL_RATIO
    _, a = cpu_plan.cell_side(sigma, c)
    assert c * sigma / math.sqrt(2) < a <= c * sigma
    cen, n, _ = cpu_plan._merge(t.numpy(), a)
    if sigma > 0.5:
        assert cen.shape[0] < t.shape[0] / 2  # cells do merge here
    tree = CpuTree(cen, leaf_size=8)
    for mult in (1.0, 2.0):  # lse (scale s) and lse2 (scale 2s) of the same pass
        s = 0.5 / sigma ** 2
        R, h = k * sigma, math.sqrt(3) / 2 * a
        lse, lse2, _ = cpu_rows._run_rows(q.numpy(), np.log(n), tree, s, R * R, True)
        approx = torch.from_numpy(lse if mult == 1 else lse2)
        sm = mult * s
        ref = soft.soft_rows_reference(q[None], t[None], torch.eye(4, dtype=torch.float64)[None],
                                       torch.tensor([sm], dtype=torch.float64)).lse[0]
        hi = ref + sm * h * h                                      # Jensen, every kept cell
        rng = 4 * sm * R * h + sm * h * h                           # Hoeffding at d <= R
        dropped = t.shape[0] * math.exp(-sm * (R - h) ** 2)
        lo = torch.log((ref.exp() - dropped).clamp_min(0)) - rng * rng / 8  # -inf: vacuous
        assert torch.all(approx <= hi + 1e-9), (approx - hi).max()
        assert torch.all(approx >= lo - 1e-9), (lo - approx).max()


@needs_numba
def test_cells_emicp_step_close_to_exact():
    """One EM-ICP step in cells form lands near the exact step (a bounded perturbation)."""
    g = torch.Generator().manual_seed(7)
    y = _sheet(g, 2000).float()[None]
    x = (_sheet(g, 1500).float() @ _rot()[:3, :3].T.float())[None]
    L = torch.tensor([1500]), torch.tensor([2000])
    T0 = torch.eye(4, dtype=torch.float64)[None]
    fr = torch.zeros(1, dtype=torch.bool)
    for sigma in (0.5, 0.1):
        sc = torch.tensor([0.5 / sigma ** 2])
        lo = torch.tensor([-4.0 / sigma ** 2])
        cells = _passes(1500, 2000, approximation="approximate")
        assert cells.form == "cells"
        Ta, _, lam_a = cells.emicp_step(x, y, T0, sc, lo, fr, *L)
        Te, _, lam_e = reference.Passes().emicp_step(x, y, T0, sc, lo, fr, *L)
        R = Ta[0, :3, :3] @ Te[0, :3, :3].T
        ang = math.degrees(math.acos(max(-1.0, min(1.0, (float(R.trace()) - 1) / 2))))
        assert ang < 0.5 and float((Ta[0, :3, 3] - Te[0, :3, 3]).norm()) < 0.02 * sigma
        assert float((lam_a - lam_e).abs().sum() / lam_e.sum()) < 0.1
        # the exact numba form is the reference up to float rounding
        Tx, _, _ = _passes(1500, 2000, approximation="exact").emicp_step(x, y, T0, sc, lo, fr,
                                                                         *L)
        assert torch.allclose(Tx, Te, atol=1e-5)


@needs_numba
def test_truncated_sinkhorn_within_its_bound():
    """Softassign's truncation: each half-step's output within the stated relative bound."""
    from pointalign.kernels.soft import cpu

    g = torch.Generator().manual_seed(11)
    x, y = _sheet(g, 500)[None], _sheet(g, 450)[None]
    T = _rot()[None]
    Ti = torch.linalg.inv(T)
    ref_p = reference.Passes()
    for beta, alpha in ((1.0, 0.01), (30.0, 0.01), (2000.0, 0.001)):
        b = torch.tensor([beta], dtype=torch.float64)
        ba = torch.tensor([beta * alpha], dtype=torch.float64)
        lw = torch.zeros(1, dtype=torch.float64)
        trunc = _passes(500, 450, approximation="approximate", method="softassign")
        assert trunc.form == "truncated"
        g_col = ba[:, None].expand(1, 450)
        for _ in range(2):
            ref = ref_p.sinkhorn_scaling(x, y, T, b, g_col, lw, ba)
            got = trunc.sinkhorn_scaling(x, y, T, b, g_col, lw, ba)
            # out = βα − log(w + Σ): a relative error ≤ tol of the normaliser
            assert torch.all(got >= ref - 1e-9)
            assert torch.all(got - ref <= -math.log1p(-cpu.SOFTASSIGN_TOLERANCE) + 1e-9)
            g_row = ref
            g_col = ref_p.sinkhorn_scaling(y, x, Ti, b, g_row, lw, ba)
        r_ref = ref_p.soft_rows(y, x, Ti, b, point_log_weights=g_row)
        r_got = trunc.soft_rows(y, x, Ti, b, point_log_weights=g_row, offset=ba)
        fin = torch.isfinite(r_got.lse)
        assert torch.all(r_got.lse[fin] <= r_ref.lse[fin] + 1e-9)


@needs_numba
def test_plan_modes_info_and_estimates():
    from pointalign.kernels.soft import cpu, cpu_plan

    assert cpu_plan.plan(100, 100, 10).mode == "exact"
    p = cpu_plan.plan(40000, 40000, 66)
    assert p.mode == "cells" and p.exact_estimate_s > cpu.AUTO_BUDGET_S
    info = p.info()
    assert info["mode"] == "cells" and info["k"] == cpu.TRUNCATE_K
    assert info["dropped_term_bound"] < 5e-3 and 0.9 < info["kept_cell_ratio_at_1_sigma"][0] < 1
    assert cpu_plan.plan(40000, 40000, 66, approximation="exact").mode == "exact"
    sa = cpu_plan.plan(2000, 2000, 3000, method="softassign")
    assert sa.mode == "truncated"
    assert 2000 * math.exp(-sa.k ** 2 / 2) <= cpu.SOFTASSIGN_TOLERANCE * 1.0001
    with pytest.raises(ValueError, match="approximation"):
        cpu_plan.plan(1, 1, 1, approximation="fast")
    with pytest.raises(ValueError, match="method"):
        cpu_plan.plan(1, 1, 1, method="icp")
    # with the clouds, the cells' estimate counts cells: far below the exact one at 40k
    g = torch.Generator().manual_seed(1)
    pts = _sheet(g, 40000).numpy() * 0.05
    sig = [0.05 * 0.9 ** (k / 2) for k in range(66)]
    est = cpu_plan.plan(40000, 40000, 66, source=pts, target=pts, sigmas=sig)
    assert 0 < est.estimate_s < est.exact_estimate_s / 5


def _softassign_passes(x, y, betas, alpha):
    return _passes(x.shape[0], y.shape[0], approximation="approximate", method="softassign",
                   source=x.numpy(), target=y.numpy(), betas=betas, alpha=alpha,
                   passes_per_beta=1)


@needs_numba
def test_softassign_cells_pass_within_block_bounds():
    """Hot β: each source cell's term against the target cells brackets its block's exact
    sums (``block_factor``: Jensen above, Hoeffding at the largest kept distance below)."""
    from pointalign.kernels.soft import cpu_cells, cpu_plan

    g = torch.Generator().manual_seed(13)
    y = _sheet(g, 1500)
    x = _sheet(g, 1200) + 0.03
    beta, alpha = 1.0, 0.01
    plan = _softassign_passes(x, y, [beta], alpha).plan
    assert plan.mode == "cells" and plan.phases[0]["form"] == "cells"
    c = plan.cell_ratio
    sigma = math.sqrt(0.5 / beta)
    _, a = cpu_plan.cell_side(sigma, c)
    cx, nx, inv = cpu_plan._merge(x.numpy(), a)
    assert inv is not None and cx.shape[0] < 900  # the cells merge here
    lw = torch.randn(1500, generator=g, dtype=torch.float64) * 0.5  # column scalings
    T = torch.eye(4, dtype=torch.float64)
    r2 = (plan.k ** 2 / 2 + beta * alpha) / beta
    lse, _ = cpu_cells.softassign_cells(x, y, T, beta, lw, r2, plan)
    ref = soft.soft_rows_reference(x[None], y[None], T[None],
                                   torch.tensor([beta], dtype=torch.float64),
                                   point_log_weights=lw[None]).lse[0].numpy()
    # per source cell: n_I e^(lse_I) against Σ_(i∈I) e^(ref_i) (each point takes its cell's)
    block = np.bincount(inv, weights=np.exp(ref), minlength=cx.shape[0])
    approx = nx * np.exp(lse[np.unique(inv, return_index=True)[1]])
    R = math.sqrt(r2) + 2 * math.sqrt(3) * a
    lo, hi = cpu_plan.block_factor(R / sigma, a / sigma)
    dropped = nx * 1500 * math.exp(lw.max().item()) * math.exp(-beta * r2)
    assert np.all(approx <= hi * block * (1 + 1e-12))
    assert np.all(approx >= lo * (block - dropped) * (1 - 1e-12))
    # what it gives in practice: every cell's block within a few per cent
    assert np.abs(np.log(approx / block)).max() < 0.05


@needs_numba
def test_softassign_cells_equal_truncated_once_cells_hold_one_point():
    """Cold β: one point per cell on both sides: the pass is the per-point truncated one."""
    g = torch.Generator().manual_seed(17)
    y, x = _sheet(g, 400)[None], _sheet(g, 300)[None]
    beta, alpha = torch.tensor([1e6], dtype=torch.float64), 1e-4
    cells = _softassign_passes(x[0], y[0], [1e6], alpha)
    assert [p["form"] for p in cells.plan.phases] == ["per_point"]
    trunc = _passes(300, 400, approximation="approximate", method="softassign")
    assert trunc.form == "truncated"
    T, lw = _rot()[None], torch.randn(1, 400, generator=g, dtype=torch.float64)
    ba = beta * alpha
    a = cells.soft_rows(x, y, T, beta, point_log_weights=lw, offset=ba)
    b = trunc.soft_rows(x, y, T, beta, point_log_weights=lw, offset=ba)
    assert torch.equal(a.lse, b.lse) and torch.equal(a.mean, b.mean)
    assert cells.info()["passes"] == {"per_point": 1}


@needs_numba
def test_softassign_cells_plan_phases_and_estimate():
    """The plan's phases go from cells to per point as β grows; its estimate follows."""
    from pointalign.kernels.soft import cpu, cpu_plan

    g = torch.Generator().manual_seed(19)
    x, y = _sheet(g, 2000) * 0.05, _sheet(g, 2000) * 0.05
    betas = [1 / 0.05 ** 2 * 1.12 ** k for k in range(100)]  # hot to one point per cell
    plan = cpu_plan.plan(2000, 2000, 3000, approximation="approximate", method="softassign",
                         source=x.numpy(), target=y.numpy(), betas=betas, alpha=2.5e-5,
                         passes_per_beta=30)
    forms = [p["form"] for p in plan.phases]
    assert forms[0] == "cells" and forms[-1] == "per_point" and forms.count("per_point") == 1
    assert plan.phases[0]["temperatures"][0] == 0 and plan.phases[-1]["temperatures"][1] == 99
    assert plan.phases[0]["cells"][0] < 1500
    assert 0 < plan.estimate_s < plan.exact_estimate_s / 3
    info = plan.info()
    assert info["mode"] == "cells" and info["cell_ratio"] == cpu.SOFT_CELL_RATIO
    lo, hi = info["cell_block_ratio_at_1_sigma"]
    assert (lo, hi) == cpu_plan.block_factor(1.0, cpu.SOFT_CELL_RATIO)
    assert 0 < lo < 1 < hi < 1.5
    # the block bound is second order in a/σ: halving the cells shrinks its log 4x at d -> 0
    assert math.log(cpu_plan.block_factor(0.0, 0.2)[1]) == pytest.approx(
        math.log(cpu_plan.block_factor(0.0, 0.4)[1]) / 4)


@needs_numba
def test_softassign_cells_kernel_matrix_equals_tree_pass(monkeypatch):
    """One update's cached kernel matrix (row pass, then the column pass through its
    transpose) gives the tree passes' sums; a new pose rebuilds it. (Weights that vary
    within a cell take the tree pass: ``test_softassign_cells_pass_within_block_bounds``.)"""
    from pointalign.kernels.soft import cpu_cells

    g = torch.Generator().manual_seed(29)
    x, y = _sheet(g, 900)[None], _sheet(g, 800)[None]
    beta, ba = torch.tensor([2.0], dtype=torch.float64), torch.tensor([0.02], dtype=torch.float64)
    cells = _softassign_passes(x[0], y[0], [2.0], 0.01)
    lw = ba[:, None].expand(1, 800)  # the first row pass's column weights: one per cell

    def passes(p, T):
        Ti = torch.linalg.inv(T)
        g_row = p.sinkhorn_scaling(x, y, T, beta, lw, torch.zeros(1, dtype=torch.float64), ba)
        return g_row, p.soft_rows(y, x, Ti, beta, point_log_weights=g_row, offset=ba)

    for T in (_rot()[None], _rot(0.3, (0.1, 0.0, 0.0))[None]):
        g_row, cols = passes(cells, T)
        slot = cells.plan.cache.items["kernel"]  # built by the row pass, used by the column
        assert slot["s"] == 2.0 and slot["q"][1] == x.data_ptr()
        monkeypatch.setattr(cpu_cells, "KERNEL_CACHE_PAIRS", -1)  # the tree passes
        tree = _softassign_passes(x[0], y[0], [2.0], 0.01)
        g_ref, ref = passes(tree, T)
        monkeypatch.undo()
        assert "kernel" not in tree.plan.cache.items
        assert torch.allclose(g_row, g_ref, rtol=0, atol=1e-10)
        assert torch.allclose(cols.lse, ref.lse, rtol=0, atol=1e-10)
        assert torch.allclose(cols.mean, ref.mean, rtol=0, atol=1e-10)


def _order_bound(ref_lse, offset, pts, rounds, dtype):
    """Largest ``(|Δlse|, |Δmean|)`` between two runs of the same update's passes whose sums
    agree but whose PyTorch normalisations between the passes may round differently.

    The fused update and the passes one by one compute every pass's sums in float64, in
    one order, and round them to ``dtype``; between the passes each normalises with the same
    PyTorch ops (``logaddexp``, ``exp``) on tensors laid out alike, which ATen runs through
    its run-time-dispatched vector kernels (AVX-512, AVX2 or scalar, tails and grouping by
    vector width): each output may differ by a few ulps (8 counted, of the largest log
    weight ``|offset| + max|lse|``). A pass's lse, and the normalisation, are 1-Lipschitz in
    the log weights (max norm), so after the ``2·rounds`` passes the difference is at most
    ``2·rounds`` such steps; the mean's weights then move by a factor within ``e^(±2δ)``:
    ``|Δmean| ≤ (e^(2δ) − 1)·(diameter of the points) + 4 ulps`` of its rounding.
    """
    eps = torch.finfo(dtype).eps
    scale = float(offset.abs().max()) + float(ref_lse[torch.isfinite(ref_lse)].abs().max())
    d_lse = 2 * rounds * 8 * eps * max(1.0, scale)
    p = pts.double()
    diam = float((p.reshape(-1, 3).amax(0) - p.reshape(-1, 3).amin(0)).norm())
    return d_lse, math.expm1(2 * d_lse) * diam + 4 * eps * float(p.abs().max())


@needs_numba
@pytest.mark.parametrize("dtype,batch", [(torch.float32, 1), (torch.float64, 1),
                                         (torch.float64, 2)])
def test_softassign_update_equals_its_passes(dtype, batch):
    """The fused update (kernel matrix from candidate pairs, all passes in one call) gives the
    passes run one by one (``sinkhorn_scaling`` x 2·rounds − 1, ``soft_rows``) in float32 and
    float64: the same sums in the same order, so equal up to the rounding of the PyTorch ops
    between the passes (:func:`_order_bound`; AVX-512 and AVX2 round them differently), with
    the same pass counts: a pose close to the last (candidates reused), one far (candidates
    rebuilt), and None once no cell merges. A batch of two (padding in the second): within
    1e-12, as the per-pass path keeps one problem's matrix at a time (its column passes then
    walk a tree: the same sums in another order)."""
    from pointalign.kernels.soft import cpu_cells

    g = torch.Generator().manual_seed(31)
    x, y, xl, yl, beta, ba, log_w = _update_case(g, dtype, batch)
    cells = _softassign_passes(x[0].double(), y[0].double(), [2.0], 0.01)
    plan = cells.plan

    def passes(T, rounds):
        return reference.softassign_passes(cells, x, y, T, beta, ba, log_w, xl, yl, rounds)

    poses = [_rot(), _rot(0.1001, (0.0501, -0.02, 0.01)), _rot(0.5, (0.4, 0.2, 0.0))]
    builds = []
    for T1, rounds in zip(poses, (3, 3, 1), strict=True):
        T = torch.stack([T1, torch.linalg.inv(T1)])[:batch]
        before = plan.cache.passes.get("cells", 0)
        got = cpu_cells.softassign_update(x, y, T, beta, ba, log_w, xl, yl, rounds, plan)
        assert got is not None
        assert plan.cache.passes["cells"] == before + 2 * rounds * batch
        builds.append(id(plan.cache.items[("cand", 0)]["idx"]))
        lse, mean = passes(T, rounds)
        assert got[0].dtype == dtype
        assert torch.equal(torch.isinf(got[0]), torch.isinf(lse))
        fin = torch.isfinite(lse)
        if batch == 1:
            d_lse, d_mean = _order_bound(lse, ba, torch.cat([x[0], y[0]]), rounds, dtype)
            torch.testing.assert_close(got[0][fin], lse[fin], rtol=0, atol=d_lse)
            torch.testing.assert_close(got[1], mean, rtol=0, atol=d_mean)
        else:
            assert torch.isinf(lse[1, 520:]).all() and torch.isfinite(lse[1, :520]).all()
            assert torch.allclose(got[0][fin], lse[fin], rtol=0, atol=1e-12)
            assert torch.allclose(got[1], mean, rtol=0, atol=1e-12)
    assert builds[0] == builds[1] != builds[2]  # reused for the small move only
    cold = torch.tensor([1e7, 1e7], dtype=torch.float32)[:batch]  # cells below the spacing
    T = torch.stack([poses[0], poses[0]])[:batch]
    assert cpu_cells.softassign_update(x, y, T, cold, ba, log_w, xl, yl, 2, plan) is None
    # the passes object falls back to the passes one by one there, counting them per point
    lse, _ = cells.softassign_update(x, y, T, cold, ba, log_w, xl, yl, 2)
    assert lse.shape == (batch, 600) and plan.cache.passes["per_point"] == 4 * batch


def test_softassign_estimate_counts_the_pairs_of_the_aligned_pose():
    """The late temperatures run near the aligned pose: a pair that starts crossed (a sheet
    against itself turned 90° about an in-plane axis: at the start only a line of it meets
    the other) is estimated as the same pair aligned, not as the few pairs of its start."""
    from pointalign.kernels.soft import cpu_plan

    g = torch.Generator().manual_seed(23)
    x = (_sheet(g, 2000) * 0.05).numpy()
    turned = x[:, [0, 2, 1]] * np.array([1.0, -1.0, 1.0])  # 90° about the x axis
    betas = [1 / 0.05 ** 2 * 1.12 ** k for k in range(100)]

    def estimate(y):
        return cpu_plan.plan(2000, 2000, 3000, approximation="approximate",
                             method="softassign", source=x, target=y, betas=betas,
                             alpha=2.5e-5, passes_per_beta=30).estimate_s

    aligned, crossed = estimate(x), estimate(turned)
    assert crossed == pytest.approx(aligned, rel=0.05)
