"""kernels._horn_cpu (numba weighted Horn) vs the PyTorch reference ``horn.horn_reference``.

Fresh random batches (three seeds): weights with zeros, padding rows, B = 1 and large B,
one and two points, coplanar and collinear points, 180° turns, huge translations, zero and
non-finite total weight, expanded (stride-0) and mixed-dtype inputs. Poses must agree to
1e-9 where the top eigenvalue of Horn's N(S) is separated from the next (gap > 1e-3 of its
largest |eigenvalue|), and everywhere the kernel's pose must fit the points as well as the
reference's (the weighted cost, up to rounding); ``valid`` must be equal everywhere.
"""

from __future__ import annotations

import math

import pytest
import torch

from pointalign import _math
from pointalign.kernels import _backend, horn

pytestmark = pytest.mark.skipif(not _backend.cpu_available(), reason="numba not installed")


def _cpu():
    from pointalign.kernels.horn import cpu as _horn_cpu

    return _horn_cpu


def _rotations(B, g, dtype=torch.float64):
    q = torch.randn(B, 4, generator=g, dtype=torch.float64)
    return _math.quat_to_rot(q).to(dtype)


def _problem(B, N, g, dtype=torch.float32, noise=1e-3, scale=1.0, shift=1.0):
    x = torch.randn(B, N, 3, generator=g, dtype=torch.float64) * scale
    R = _rotations(B, g)
    t = torch.randn(B, 1, 3, generator=g, dtype=torch.float64) * shift
    m = x @ R.transpose(1, 2) + t + noise * torch.randn(B, N, 3, generator=g,
                                                        dtype=torch.float64)
    w = torch.rand(B, N, generator=g, dtype=torch.float64)
    if N > 3:
        w[torch.rand(B, N, generator=g) < 0.2] = 0  # zero weights
    return x.to(dtype), m.to(dtype), w.to(dtype)


def _gap(source, targets, weights):
    """Relative gap of the two largest eigenvalues of the reference's N(S) (with the tie)."""
    W, sx, sm, cross = horn.horn_moments(source, targets, weights)
    Wc = W.clamp_min(1e-300)[:, None]
    S = cross - W[:, None, None] * ((sx / Wc)[:, :, None] * (sm / Wc)[:, None, :])
    S = S / S.abs().amax((1, 2), keepdim=True).clamp_min(1e-300)
    S = torch.where(torch.isfinite(S), S, torch.zeros_like(S))
    ev = torch.linalg.eigvalsh(_math.horn_matrix(S + _math.HORN_TIE * torch.eye(3,
                                                                                 dtype=S.dtype)))
    return (ev[:, 3] - ev[:, 2]) / ev.abs().amax(1).clamp_min(1e-300)


def _cost(T, source, targets, weights):
    x, m, w = source.double(), targets.double(), weights.double()
    r = x @ T[:, :3, :3].transpose(1, 2) + T[:, None, :3, 3] - m
    return (w * (r * r).sum(-1)).sum(-1)


def _check(source, targets, weights, *, tol=1e-9, healthy=1e-3):
    before = [a.clone() for a in (source, targets, weights)]
    T, valid = _cpu().horn(source, targets, weights)
    Tr, vr = horn.horn_reference(source, targets, weights)
    for a, b in zip(before, (source, targets, weights), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # inputs unchanged
    assert T.dtype == torch.float64 and T.shape == Tr.shape
    assert valid.dtype == torch.bool
    assert torch.equal(valid, vr)
    assert torch.isfinite(T).all()
    assert torch.equal(T[:, 3], Tr[:, 3])
    eye = torch.eye(4, dtype=torch.float64)
    assert torch.equal(T[~valid], eye.expand(int((~valid).sum()), 4, 4))
    R = T[:, :3, :3]
    assert torch.allclose(R @ R.transpose(1, 2), torch.eye(3, dtype=torch.float64).expand_as(R),
                          atol=1e-12)
    assert (torch.det(R) > 0).all()
    # every pose fits as well as the reference's (ties: any of the optimal poses)
    c, cr = _cost(T, source, targets, weights), _cost(Tr, source, targets, weights)
    scale = (weights.double() * (targets.double() ** 2).sum(-1)).sum(-1) + 1
    fit = (c <= cr + 1e-9 * scale)[valid]
    assert fit.all(), (c - cr)[valid].max()
    # where the top eigenvalue is separated the pose is the reference's to ~rounding
    ok = valid & (_gap(source, targets, weights) > healthy)
    size = 1 + Tr[:, :3, 3].abs().amax(1)
    err = (T - Tr).abs().amax((1, 2)) / size
    assert (err[ok] <= tol).all(), err[ok].max()
    return T, valid, ok


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,N", [(1, 3), (1, 40), (2000, 3), (65, 30)])
def test_random_batches_match_reference(B, N, dtype, rng):
    x, m, w = _problem(B, N, rng, dtype)
    _, valid, ok = _check(x, m, w)
    assert ok.float().mean() > 0.5  # the test compares most entries to 1e-9


def test_padding_rows_and_zero_total_weight(rng):
    x, m, w = _problem(50, 20, rng, torch.float32)
    x[:, 15:] = 1e6 * torch.randn(50, 5, 3, generator=rng)  # padding: far away, weight 0
    m[:, 15:] = -3e5
    w[:, 15:] = 0
    w[:5] = 0  # zero total weight
    w[5, 0] = float("nan")  # non-finite weight: identity, not valid
    T, valid, _ = _check(x, m, w)
    assert not valid[:6].any()
    # the padding does not count: same pose as without the padded rows
    Tc, _ = _cpu().horn(x[6:, :15], m[6:, :15], w[6:, :15])
    assert torch.allclose(T[6:], Tc, atol=1e-12)


def test_one_point_and_two_points(rng):
    for n in (1, 2):
        x, m, w = _problem(200, n, rng, torch.float64, noise=0.0)
        w = w + 0.5  # no zero weights
        T, valid, _ = _check(x, m, w, tol=1e-6)
        assert valid.all()
        # the tie resolves towards R = I: one point gives the pure translation
        if n == 1:
            assert torch.allclose(T[:, :3, :3], torch.eye(3, dtype=torch.float64).expand(200, 3, 3),
                                  atol=1e-12)
            assert torch.allclose(T[:, :3, 3], (m - x)[:, 0], atol=1e-12)
        # both points are matched exactly
        r = x @ T[:, :3, :3].transpose(1, 2) + T[:, None, :3, 3] - m
        pair = ((x[:, :1] - x[:, -1:]).norm(dim=-1) - (m[:, :1] - m[:, -1:]).norm(dim=-1)).abs()
        assert (r.norm(dim=-1).amax(1)[pair[:, 0] < 1e-12] < 1e-7).all()


@pytest.mark.parametrize("shape", ["coplanar", "collinear", "coincident"])
def test_degenerate_configurations(shape, rng):
    B, N = 300, 12
    x, m, w = _problem(B, N, rng, torch.float64)
    if shape == "coplanar":
        x[..., 2] = 0
    elif shape == "collinear":
        x = torch.randn(B, N, 1, generator=rng, dtype=torch.float64) * torch.randn(
            B, 1, 3, generator=rng, dtype=torch.float64)
    else:
        x = x[:, :1].expand(B, N, 3).clone()
    R = _rotations(B, rng)
    m = x @ R.transpose(1, 2) + torch.randn(B, 1, 3, generator=rng, dtype=torch.float64)
    _, valid, ok = _check(x, m, w, tol=1e-6)
    if shape == "coplanar":  # a plane determines the rotation
        assert ok.float().mean() > 0.9


def test_half_turns_and_huge_translations(rng):
    B, N = 120, 25
    x = torch.randn(B, N, 3, generator=rng, dtype=torch.float64)
    axes = torch.randn(B, 3, generator=rng, dtype=torch.float64)
    axes[:3] = torch.eye(3, dtype=torch.float64)  # half turns about the coordinate axes
    q = torch.cat([torch.zeros(B, 1, dtype=torch.float64), axes], 1)  # w = 0: 180°
    R = _math.quat_to_rot(q)
    t = torch.randn(B, 1, 3, generator=rng, dtype=torch.float64) * 1e6
    m = x @ R.transpose(1, 2) + t
    w = torch.rand(B, N, generator=rng, dtype=torch.float64)
    T, valid, ok = _check(x, m, w, tol=1e-9)
    assert valid.all() and ok.all()
    assert torch.allclose(T[:, :3, :3], R, atol=1e-8)
    # float32 points far from the origin
    _check((x + 1e4).float(), (m * 1e-2).float(), w.float())


def test_expanded_and_mixed_dtype_inputs(rng):
    C, B = 200, 16
    src = torch.randn(C, 3, generator=rng)
    R = _rotations(1, rng, torch.float32)[0]
    tgt = src @ R.T + 0.5 + 0.01 * torch.randn(C, 3, generator=rng)
    w = (torch.rand(B, C, generator=rng) < 0.5).to(torch.float32)
    xs, ms = src.expand(B, -1, -1), tgt.expand(B, -1, -1)
    assert xs.stride(0) == 0
    T, _, _ = _check(xs, ms, w)
    T2, _, _ = _check(xs, ms.double(), w)  # mixed dtypes: all read in float64
    assert torch.allclose(T, T2, atol=1e-6)
    # strided (non-contiguous) views
    big = torch.randn(B, 2 * C, 4, generator=rng)
    _check(big[:, ::2, :3], big[:, 1::2, 1:], w.t().contiguous().t())


def test_empty_shapes():
    for B, N in ((0, 5), (3, 0)):
        x = torch.zeros(B, N, 3)
        T, valid = _cpu().horn(x, x, torch.zeros(B, N))
        assert T.shape == (B, 4, 4) and valid.shape == (B,) and not valid.any()
        assert torch.equal(T, torch.eye(4, dtype=torch.float64).expand(B, 4, 4))


def test_horn_from_sums_matches_reference(rng):
    x, m, w = _problem(60, 9, rng, torch.float64)
    w[:4] = 0
    W, sx, sm, cross = horn.horn_moments(x, m, w)
    lead = (5, 12)
    args = (W.reshape(lead), sx.reshape(*lead, 3), sm.reshape(*lead, 3),
            cross.reshape(*lead, 3, 3))
    T, valid = _cpu().horn_from_sums(*args)
    Tr, vr = horn.horn_from_sums_reference(*args)
    assert T.shape == (*lead, 4, 4) and torch.equal(valid, vr)
    assert torch.allclose(T, Tr, atol=1e-10, rtol=0)
    # same moments, same result as the points kernel
    Tp, _ = _cpu().horn(x, m, w)
    assert torch.allclose(T.reshape(60, 4, 4), Tp, atol=1e-12, rtol=0)


def test_dispatch(monkeypatch, rng):
    x, m, w = _problem(7, 5, rng)
    mod = _cpu()
    calls = []
    real = mod.horn
    monkeypatch.setattr(mod, "horn", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("POINTALIGN_BACKEND", "cpu")
    T, _ = horn.weighted_horn(x, m, w)
    assert calls == [1]
    assert torch.allclose(T, horn.horn_reference(x, m, w)[0], atol=1e-9)
    # autograd or other dtypes: the reference
    xg = x.double().requires_grad_()
    horn.weighted_horn(xg, m, w)
    horn.weighted_horn(x.half(), m, w)
    assert calls == [1]
    monkeypatch.setenv("POINTALIGN_BACKEND", "torch")
    horn.weighted_horn(x, m, w)
    assert calls == [1]


def test_jacobi_top_eigenvector_matches_eigh(rng):
    """The solver alone on random symmetric 4×4 (the eigenvalue order, signs, scales)."""
    import numpy as np

    mod = _cpu()
    A0 = torch.randn(300, 4, 4, generator=rng, dtype=torch.float64)
    A0 = (A0 + A0.transpose(1, 2)) * 10.0 ** torch.randint(-5, 6, (300, 1, 1), generator=rng)
    ev, V = torch.linalg.eigh(A0)
    A, Vs, q = np.empty((4, 4)), np.empty((4, 4)), np.empty(4)
    for i in range(300):
        A[:] = A0[i].numpy()
        mod.top_eigenvector4(A, Vs, q)
        gap = (ev[i, 3] - ev[i, 2]) / ev[i].abs().max()
        v = V[i, :, 3].numpy()
        if gap > 1e-3:
            assert math.isclose(abs(float(q @ v)), 1.0, abs_tol=1e-13)
