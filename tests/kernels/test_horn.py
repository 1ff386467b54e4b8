"""kernels.horn: every backend's weighted Horn against the PyTorch reference
``horn.horn_reference``; the "cpu" backend's numba kernel (``horn/cpu.py``) on every hard case;
the Triton kernel through the interpreter.

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
from pointalign.kernels import _backend, _nb_math, horn
from tests._backends import backends
from tests._interpreted import interpreted_fixture

#: the numba kernel's own cases: the "cpu" backend only (skipped without numba)
cpu_only = backends("cpu")


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


def _check(source, targets, weights, *, tol=1e-9, healthy=1e-3, result=None):
    """Check a pose batch (``result``, default the numba kernel's) against the reference."""
    before = [a.clone() for a in (source, targets, weights)]
    T, valid = _cpu().horn(source, targets, weights) if result is None else result
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
@cpu_only
def test_random_batches_match_reference(backend, B, N, dtype, rng):
    x, m, w = _problem(B, N, rng, dtype)
    _, valid, ok = _check(x, m, w)
    assert ok.float().mean() > 0.5  # the test compares most entries to 1e-9


@cpu_only
def test_padding_rows_and_zero_total_weight(backend, rng):
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


@cpu_only
def test_one_point_and_two_points(backend, rng):
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
@cpu_only
def test_degenerate_configurations(backend, shape, rng):
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


@cpu_only
def test_half_turns_and_huge_translations(backend, rng):
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


@cpu_only
def test_expanded_and_mixed_dtype_inputs(backend, rng):
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


@cpu_only
def test_empty_shapes(backend):
    for B, N in ((0, 5), (3, 0)):
        x = torch.zeros(B, N, 3)
        T, valid = _cpu().horn(x, x, torch.zeros(B, N))
        assert T.shape == (B, 4, 4) and valid.shape == (B,) and not valid.any()
        assert torch.equal(T, torch.eye(4, dtype=torch.float64).expand(B, 4, 4))


@cpu_only
def test_horn_from_sums_matches_reference(backend, rng):
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


@backends("torch", "cpu")
def test_dispatch(backend, monkeypatch, rng):
    """The numba kernel runs on the "cpu" backend (not for autograd or other dtypes), never
    on "torch"."""
    x, m, w = _problem(7, 5, rng)
    mod = _cpu()
    calls = []
    real = mod.horn
    monkeypatch.setattr(mod, "horn", lambda *a: calls.append(1) or real(*a))
    T, _ = horn.weighted_horn(x, m, w)
    on_cpu = [1] if backend.name == "cpu" else []
    assert calls == on_cpu
    assert torch.allclose(T, horn.horn_reference(x, m, w)[0], atol=1e-9)
    # autograd or other dtypes: the reference
    xg = x.double().requires_grad_()
    horn.weighted_horn(xg, m, w)
    horn.weighted_horn(x.half(), m, w)
    assert calls == on_cpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,N", [(1, 3), (65, 30), (2000, 3)])
def test_weighted_horn_matches_reference(backend, B, N, dtype, rng):
    """The dispatcher on every backend against the reference (fresh random batches).

    Poses within 1e-9 of the reference where the top eigenvalue of N(S) is separated (the
    moments are float64 on every backend; the numba kernel's cyclic Jacobi and the Triton
    kernel's 40 squarings of the shifted matrix both converge to rounding there), ``valid``
    equal, every pose at least as good a fit as the reference's.
    """
    x, m, w = _problem(B, N, rng, dtype)
    dev = backend.device
    T, valid = horn.weighted_horn(x.to(dev), m.to(dev), w.to(dev))
    assert T.device.type == valid.device.type == dev
    _, _, ok = _check(x, m, w, result=(T.cpu(), valid.cpu()))
    assert ok.float().mean() > 0.5


# ---- the Triton kernel through the interpreter (child process) -----------------------------

#: (B, N, dtype, seed) of the interpreted runs: tiny, the interpreter is slow
INTERP = [(7, 5, torch.float32, 0), (20, 30, torch.float64, 1), (3, 1, torch.float64, 2)]


def run_interpreted_horn(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): the Triton Horn kernel through the dispatcher."""
    assert _backend.backend(torch.empty(0)) == "interpret"
    out = {}
    for B, N, dt, seed in INTERP:
        x, m, w = _problem(B, N, torch.Generator().manual_seed(seed), dt)
        if N == 1:
            w = w + 0.5
        w[0] = 0  # zero total weight: identity, not valid
        out[(B, N, seed)] = horn.weighted_horn(x, m, w)
    torch.save(out, out_path)


interpreted = interpreted_fixture("tests.kernels.test_horn", "run_interpreted_horn")


@pytest.mark.parametrize("case", INTERP, ids=[f"{c[0]}x{c[1]}" for c in INTERP])
def test_triton_interpreted_matches_reference(interpreted, case):
    B, N, dt, seed = case
    x, m, w = _problem(B, N, torch.Generator().manual_seed(seed), dt)
    if N == 1:
        w = w + 0.5
    w[0] = 0
    T, valid = interpreted[(B, N, seed)]
    _check(x, m, w, result=(T, valid), tol=1e-9 if N > 1 else 1e-6)
    assert not bool(valid[0])


@cpu_only
def test_jacobi_top_eigenvector_matches_eigh(backend, rng):
    """The solver alone on random symmetric 4×4 (the eigenvalue order, signs, scales)."""
    import numpy as np

    _cpu()  # skips without numba
    A0 = torch.randn(300, 4, 4, generator=rng, dtype=torch.float64)
    A0 = (A0 + A0.transpose(1, 2)) * 10.0 ** torch.randint(-5, 6, (300, 1, 1), generator=rng)
    ev, V = torch.linalg.eigh(A0)
    A, Vs, q = np.empty((4, 4)), np.empty((4, 4)), np.empty(4)
    for i in range(300):
        A[:] = A0[i].numpy()
        _nb_math.top_eigenvector4(A, Vs, q)
        gap = (ev[i, 3] - ev[i, 2]) / ev[i].abs().max()
        v = V[i, :, 3].numpy()
        if gap > 1e-3:
            assert math.isclose(abs(float(q @ v)), 1.0, abs_tol=1e-13)
