import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pointalign import estimate, metrics
from pointalign import transforms as T


def numpy_umeyama(x, y, w):
    """Independent float64 oracle: weighted Kabsch via NumPy SVD."""
    w = w / w.sum()
    xm, ym = w @ x, w @ y
    S = ((y - ym) * w[:, None]).T @ (x - xm)
    U, _, Vt = np.linalg.svd(S)
    D = np.diag([1, 1, np.sign(np.linalg.det(U @ Vt))])
    R = U @ D @ Vt
    return R, ym - R @ xm


def _problem(seed, n=40, noise=0.01, batch=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, n, 3, generator=g, dtype=torch.float64)
    Tt = T.make(T.random_rotation(None if not batch else batch[0], generator=g),
                torch.randn(*batch, 3, generator=g, dtype=torch.float64))
    y = T.apply(Tt, x) + noise * torch.randn(*batch, n, 3, generator=g, dtype=torch.float64)
    w = torch.rand(*batch, n, generator=g, dtype=torch.float64) + 0.1
    return x, y, w, Tt


@pytest.mark.parametrize("n", [3, 4, 17, 200])
def test_horn_and_umeyama_match_numpy_oracle(seed, n):
    x, y, w, _ = _problem(seed, n)
    R_o, t_o = numpy_umeyama(x.numpy(), y.numpy(), w.numpy())
    for fn in (estimate.horn, estimate.umeyama):
        est = fn(x, y, w)
        assert bool(est.valid)
        np.testing.assert_allclose(est.transformation[:3, :3].numpy(), R_o, atol=1e-9)
        np.testing.assert_allclose(est.transformation[:3, 3].numpy(), t_o, atol=1e-9)


def test_exact_recovery_without_noise(seed):
    x, y, _, Tt = _problem(seed, 25, noise=0.0)
    est = estimate.horn(x, y)
    assert torch.allclose(est.transformation, Tt, atol=1e-10)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(3, 30))
def test_rotation_is_always_proper(seed, n):
    # arbitrary (even unrelated) point sets: never a reflection
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    y = torch.randn(n, 3, generator=g, dtype=torch.float64)
    for fn in (estimate.horn, estimate.umeyama):
        R = fn(x, y, strict=False).transformation[:3, :3]
        assert abs(float(torch.linalg.det(R)) - 1) < 1e-9
        assert torch.allclose(R.T @ R, torch.eye(3, dtype=R.dtype), atol=1e-9)


def test_reflected_target_gives_rotation_not_reflection():
    x = torch.randn(50, 3, dtype=torch.float64)
    y = x * torch.tensor([-1.0, 1.0, 1.0], dtype=torch.float64)
    for fn in (estimate.horn, estimate.umeyama):
        assert float(torch.linalg.det(fn(x, y).transformation[:3, :3])) > 0.999


def test_uniform_weights_equal_plain(seed):
    x, y, _, _ = _problem(seed)
    plain = estimate.horn(x, y).transformation
    scaled = estimate.horn(x, y, torch.full((40,), 3.7, dtype=torch.float64)).transformation
    assert torch.allclose(scaled, plain, atol=1e-12)


def test_soft_form_reduces_to_plain_and_to_dense(seed):
    x, y, w, _ = _problem(seed, 30)
    # identity correspondence matrix: the soft form equals the plain one
    M = torch.eye(30, dtype=torch.float64)
    soft = estimate.horn_soft(x, y, M.sum(1), M.sum(0), x.T @ M @ y)
    assert torch.allclose(soft.transformation, estimate.horn(x, y).transformation, atol=1e-10)
    # a dense random soft matrix: compare with an explicit weighted Horn over all pairs
    g = torch.Generator().manual_seed(seed + 100)
    Md = torch.rand(30, 30, generator=g, dtype=torch.float64)
    a = torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64)
    b = torch.tensor([5.0, 0.0, -2.0], dtype=torch.float64)
    soft = estimate.horn_soft(x, y, Md.sum(1), Md.sum(0), (x - a).T @ Md @ (y - b),
                              source_center=a, target_center=b)
    xx = x[:, None, :].expand(30, 30, 3).reshape(-1, 3)
    yy = y[None, :, :].expand(30, 30, 3).reshape(-1, 3)
    dense = estimate.horn(xx, yy, Md.reshape(-1))
    assert torch.allclose(soft.transformation, dense.transformation, atol=1e-10)


def test_batched_equals_separate(seed):
    x, y, w, Tt = _problem(seed, 20, batch=(5,))
    est = estimate.horn(x, y, w)
    assert est.transformation.shape == (5, 4, 4) and est.valid.all()
    for b in range(5):
        single = estimate.horn(x[b], y[b], w[b]).transformation
        assert torch.allclose(est.transformation[b], single, atol=1e-12)


def test_padding_by_zero_weight():
    x, y, w, _ = _problem(0, 20)
    xp = torch.cat([x, torch.full((5, 3), 1e3, dtype=x.dtype)])
    yp = torch.cat([y, torch.zeros(5, 3, dtype=x.dtype)])
    wp = torch.cat([w, torch.zeros(5, dtype=w.dtype)])
    assert torch.allclose(estimate.horn(xp, yp, wp).transformation,
                          estimate.horn(x, y, w).transformation, atol=1e-9)


@pytest.mark.parametrize("fn", [estimate.horn, estimate.umeyama])
def test_degenerate_inputs_are_reported(fn):
    line = torch.linspace(0, 1, 10, dtype=torch.float64)[:, None] * torch.tensor([[1.0, 2, 3]])
    line = line.to(torch.float64)
    with pytest.raises(ValueError, match="degenerate"):
        fn(line, line + 1)
    est = fn(line, line + 1, strict=False)
    assert not bool(est.valid)
    assert torch.equal(est.transformation, torch.eye(4, dtype=torch.float64))
    x = torch.randn(10, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="degenerate"):
        fn(x, x, torch.zeros(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="degenerate"):
        fn(x[:2], x[:2])
    # batch: one bad entry does not spoil the others
    xb = torch.stack([x, line])
    est = fn(xb, xb + 0.5, strict=False)
    assert est.valid.tolist() == [True, False]
    assert torch.isfinite(est.transformation).all()


def test_point_to_plane_converges_to_truth(seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(200, 3, generator=g, dtype=torch.float64)
    n = torch.nn.functional.normalize(torch.randn(200, 3, generator=g, dtype=torch.float64), dim=-1)
    truth = T.se3_exp(0.05 * torch.randn(6, generator=g, dtype=torch.float64))
    x = T.apply(T.invert(truth), y)
    est = torch.eye(4, dtype=torch.float64)
    for _ in range(6):
        est = estimate.point_to_plane(T.apply(est, x), y, n).transformation @ est
    assert torch.allclose(est, truth, atol=1e-10)


def test_point_to_plane_system_matches_finite_differences():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 30, 3, generator=g, dtype=torch.float64)
    n = torch.nn.functional.normalize(torch.randn(30, 3, generator=g, dtype=torch.float64), dim=-1)
    JtJ, Jtr, cost = estimate.point_to_plane_system(x, y, n)

    def f(xi):
        xm = x @ (torch.eye(3, dtype=xi.dtype) + T.skew(xi[:3])).T + xi[3:]
        return ((n * (xm - y)).sum(-1) ** 2).sum()

    xi0 = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    grad = torch.autograd.grad(f(xi0), xi0)[0]
    assert torch.allclose(grad, 2 * Jtr, atol=1e-10)
    assert torch.allclose(cost, f(torch.zeros(6, dtype=torch.float64)))
    assert torch.allclose(torch.autograd.functional.hessian(f, torch.zeros(6, dtype=torch.float64)),
                          2 * JtJ, atol=1e-10)


def test_planar_point_to_plane_is_flagged_not_nan():
    y = torch.randn(100, 3, dtype=torch.float64)
    y[:, 2] = 0
    n = torch.tensor([[0, 0, 1.0]], dtype=torch.float64).expand(100, 3)
    est = estimate.point_to_plane(y + torch.tensor([0, 0, 0.1], dtype=torch.float64), y, n,
                                  strict=False)
    assert not bool(est.valid)
    assert torch.isfinite(est.transformation).all()
    assert torch.allclose(est.transformation[2, 3], torch.tensor(-0.1, dtype=torch.float64))


@pytest.mark.parametrize("bad,match", [
    (dict(target=torch.zeros(5, 3)), "target"),
    (dict(weights=-torch.ones(4)), "weights"),
    (dict(weights=torch.ones(3)), "weights"),
    (dict(source=torch.zeros(4, 2)), "source"),
    (dict(source=torch.full((4, 3), float("nan"))), "source"),
])
def test_bad_input_named(bad, match):
    args = dict(source=torch.randn(4, 3), target=torch.randn(4, 3), weights=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        estimate.horn(args["source"], args["target"], args["weights"])


def test_numpy_inputs_accepted():
    x = np.random.default_rng(0).normal(size=(10, 3))
    est = estimate.horn(x, x + 1)
    np.testing.assert_allclose(est.transformation[:3, 3].numpy(), [1, 1, 1], atol=1e-12)


@pytest.mark.gpu
def test_estimators_on_cuda():
    x, y, w, Tt = _problem(0, 50, noise=0.0, batch=(3,))
    est = estimate.horn(x.float().cuda(), y.float().cuda(), w.float().cuda())
    assert est.transformation.is_cuda and est.valid.all()
    assert metrics.rotation_error(est.transformation, Tt).max() < 1e-3
    est = estimate.umeyama(x.cuda(), y.cuda())
    assert torch.allclose(est.transformation.cpu(), Tt, atol=1e-9)



def test_horn_matrix_and_rotation_bases_match_formulas(seed):
    g = torch.Generator().manual_seed(seed)
    S = torch.randn(50, 3, 3, generator=g, dtype=torch.float64)
    torch.testing.assert_close(estimate.horn_matrix(S), estimate.horn_matrix_reference(S),
                               atol=1e-15, rtol=0)
    q = torch.randn(50, 4, generator=g, dtype=torch.float64)
    q[0, 0] = 0.0  # a half turn
    torch.testing.assert_close(estimate.quaternion_rotation_reference(q),
                               T.quaternion_to_matrix(q), atol=1e-14, rtol=0)
    torch.testing.assert_close(estimate.quaternion_rotation_reference(3.0 * q[1]),
                               T.quaternion_to_matrix(q[1]), atol=1e-14, rtol=0)

@pytest.mark.parametrize("axis", [(1.0, 0, 0), (0, 1.0, 0), (0, 0, 1.0), (1.0, -2, 0.5)])
def test_horn_half_turn(seed, axis):
    # a 180-degree rotation: quaternion w = 0, the case where some closed forms break
    a = torch.tensor(axis, dtype=torch.float64)
    q = torch.cat([torch.zeros(1, dtype=torch.float64), a / a.norm()])
    Tt = T.make(T.quaternion_to_matrix(q), torch.tensor([0.1, -2.0, 0.3], dtype=torch.float64))
    for n in (3, 20):
        x = _problem(seed, n)[0]
        y = T.apply(Tt, x)
        est = estimate.horn(x, y)
        assert torch.allclose(est.transformation, Tt, atol=1e-10)
        R_o, t_o = numpy_umeyama(x.numpy(), y.numpy(), np.ones(n))
        np.testing.assert_allclose(est.transformation[:3, :3].numpy(), R_o, atol=1e-10)


def test_spans_plane_matches_eigvalsh_reference(seed):
    g = torch.Generator().manual_seed(seed)
    pts = torch.randn(300, 12, 3, generator=g, dtype=torch.float64)
    # squash a third of the sets towards a line, a third towards a plane, by factors that
    # stay away from the threshold (1e-10 on variances: 1e-5 on spreads) by 100x both ways
    f = torch.tensor([1e-8, 1e-3, 1.0], dtype=torch.float64).repeat(100)[:, None]
    pts[:, :, 1] *= torch.where(torch.arange(300)[:, None] % 3 == 0, f, 1.0)
    pts[:, :, 2] *= f
    R = T.random_rotation(300, generator=g)
    pts = pts @ R.mT
    m = estimate._weighted_moments(pts, pts, None)
    fast, ref = estimate._spans_plane(m.source_cov), estimate._spans_plane_reference(m.source_cov)
    assert torch.equal(fast, ref)
    assert 0 < int(fast.sum()) < 300


def test_spans_plane_degenerate_sets():
    line = torch.linspace(-1, 1, 7)[:, None] * torch.tensor([[1.0, 2, 3]]) + 5.0  # float32
    point = torch.full((4, 3), 2.5)
    tri = torch.tensor([[0.0, 0, 0], [1, 0, 0], [0, 1e-3, 0]])
    for pts, spans in ((line, False), (point, False), (tri, True), (line[:2], False)):
        cov = estimate._weighted_moments(pts, pts, None).source_cov
        assert bool(estimate._spans_plane(cov)) == spans
        assert bool(estimate._spans_plane_reference(cov)) == spans
    assert not bool(estimate._spans_plane(torch.zeros(3, 3, dtype=torch.float64)))



@pytest.mark.gpu
def test_closed_forms_on_cuda_match_cpu(seed):
    x, y, w, _ = _problem(seed, 30, noise=0.05, batch=(4096,))
    m = estimate._weighted_moments(x, y, w)
    S = m.cross.cuda()
    torch.testing.assert_close(estimate.horn_matrix(S).cpu(),
                               estimate.horn_matrix_reference(m.cross), atol=1e-12, rtol=0)
    q = torch.randn(4096, 4, dtype=torch.float64)
    torch.testing.assert_close(estimate.quaternion_rotation_reference(q.cuda()).cpu(),
                               T.quaternion_to_matrix(q), atol=1e-14, rtol=0)
    covs = torch.cat([m.source_cov, torch.zeros(1, 3, 3, dtype=torch.float64)])
    assert torch.equal(estimate._spans_plane(covs.cuda()).cpu(),
                       estimate._spans_plane_reference(covs))
