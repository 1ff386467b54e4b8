"""Anderson acceleration (registration/anderson.py, kernels/anderson/): the combination, the
safeguard, ICP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch

import pointalign as pa
from pointalign import datasets, metrics, transforms
from pointalign.kernels.anderson import anderson_point, from_vector, to_vector
from pointalign.registration import anderson
from pointalign.registration.criteria import ConvergenceCriteria


def test_vector_round_trip(rng):
    B = 5
    T = torch.eye(4, dtype=torch.float64).repeat(B, 1, 1)
    T[:, :3, :3] = transforms.random_rotation(B, generator=rng)
    T[:, :3, 3] = torch.randn(B, 3, generator=rng, dtype=torch.float64)
    origin = T.flip(0).clone()
    scale = torch.rand(B, generator=rng, dtype=torch.float64) + 0.5
    pivot = torch.randn(B, 3, generator=rng, dtype=torch.float64)
    x = to_vector(T, origin, scale, pivot)
    back = from_vector(x, origin, scale, pivot)
    torch.testing.assert_close(back, T, rtol=0, atol=1e-12)
    # at the origin the vector is zero
    torch.testing.assert_close(to_vector(origin, origin, scale, pivot),
                               torch.zeros(B, 6, dtype=torch.float64), rtol=0, atol=1e-12)
    # the same move seen in a frame shifted by o, with the pivot shifted too: the same vector
    o = torch.randn(B, 3, generator=rng, dtype=torch.float64)
    S = torch.eye(4, dtype=torch.float64).repeat(B, 1, 1)
    S[:, :3, 3] = o
    Si = torch.linalg.inv(S)
    torch.testing.assert_close(to_vector(S @ T @ Si, S @ origin @ Si, scale, pivot + o), x,
                               rtol=0, atol=1e-12)


def test_anderson_solves_a_linear_fixed_point(rng):
    """For an affine map G(x) = A x + b in 6 dimensions, Anderson with 6 differences is
    GMRES in disguise: its 7th point is the fixed point in exact arithmetic. The normal
    equations square the differences' condition number, so a few more points are taken."""
    B, n = 3, 6
    Q = torch.linalg.qr(torch.randn(B, n, n, generator=rng, dtype=torch.float64))[0]
    A = Q @ torch.diag_embed(torch.rand(B, n, generator=rng, dtype=torch.float64) * 0.9) \
        @ Q.transpose(1, 2)
    b = torch.randn(B, n, generator=rng, dtype=torch.float64)
    fixed = torch.linalg.solve(torch.eye(n, dtype=torch.float64) - A, b)

    def G(x):
        return (A @ x[..., None])[..., 0] + b

    m = n
    xs = torch.zeros(B, m + 1, n, dtype=torch.float64)
    gs = torch.zeros(B, m + 1, n, dtype=torch.float64)
    x = torch.zeros(B, n, dtype=torch.float64)
    plain = x.clone()
    for k in range(2 * (m + 1)):
        xs = torch.cat([xs[:, 1:], x[:, None]], 1)
        gs = torch.cat([gs[:, 1:], G(x)[:, None]], 1)
        count = torch.full((B,), min(k + 1, m + 1), dtype=torch.int64)
        x = anderson_point(xs, gs, count)
        plain = G(plain)
    torch.testing.assert_close(x, fixed, rtol=0, atol=1e-9)
    assert (plain - fixed).norm() > 1e4 * (x - fixed).norm()  # plain iteration is far behind


def test_one_filled_slot_is_the_plain_image(rng):
    xs = torch.randn(2, 4, 6, generator=rng, dtype=torch.float64)
    gs = torch.randn(2, 4, 6, generator=rng, dtype=torch.float64)
    out = anderson_point(xs, gs, torch.ones(2, dtype=torch.int64))
    assert torch.equal(out, gs[:, -1])


@dataclass(frozen=True)
class _Halfway:
    """A fake ICP step on translations: G moves half way to ``goal``; its 'energy' is
    the squared distance to the goal plus ``inputs['bump']``, so that a test can make an
    accelerated point look worse."""

    graph_safe: ClassVar[bool] = True

    def __call__(self, inputs, state):
        T = state["T"]
        goal = inputs["goal"]
        T_new = T.clone()
        T_new[:, :3, 3] = T[:, :3, 3] + 0.5 * (goal - T[:, :3, 3])
        d2 = ((T[:, :3, 3] - goal) ** 2).sum(-1) + inputs["bump"]
        sums = torch.zeros(T.shape[0], 30, dtype=torch.float64)
        sums[:, 28], sums[:, 29] = 1.0, d2
        D = T_new @ torch.linalg.inv(T)
        flags = torch.ones(T.shape[0], 2)
        return {"T": T_new, "Tf": T_new.float()}, {"sums": sums, "update": D, "T": T_new,
                                                    "flags": flags}


def test_safeguard_rejects_a_worse_accelerated_point():
    step = anderson.AndersonStep(_Halfway(), tau2=1e9, history=2)
    T0 = torch.eye(4, dtype=torch.float64)[None]
    inputs = {"goal": torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64),
              "bump": torch.tensor([0.0], dtype=torch.float64)}
    inputs, state = step.prepare(inputs, {"T": T0, "Tf": T0.float()},
                                 torch.tensor([1]), torch.tensor([1.0]), torch.zeros(1, 3))
    state, rec = step(inputs, state)                  # plain: half way
    assert rec["accepted"].all() and not state["accelerated"].any()
    state, rec = step(inputs, state)                  # two points: an accelerated jump
    assert rec["accepted"].all() and state["accelerated"].all()
    # the map is linear: the accelerated point is the goal (up to the ridge term, 1e-10)
    torch.testing.assert_close(state["T"][0, :3, 3], inputs["goal"][0], rtol=0, atol=1e-9)
    fallback = state["fallback"].clone()
    inputs["bump"] = torch.tensor([1e6], dtype=torch.float64)  # make it look worse
    state, rec = step(inputs, state)
    assert not rec["accepted"].any()                  # rejected ...
    assert torch.equal(state["T"], fallback)          # ... back to the plain image
    assert not state["accelerated"].any() and int(state["count"][0]) == 0


def _small_pair(n=3000):
    pair = datasets.load_bunny_pair()
    return (datasets.random_subsample(pair.source, n, seed=0),
            datasets.random_subsample(pair.target, n, seed=1), pair.T_target_source)


@pytest.mark.parametrize("method", ["point_to_point", "point_to_plane"])
def test_icp_acceleration_converges_in_fewer_iterations(method):
    """Accelerated against plain ICP (the default accelerates point-to-point only)."""
    src, tgt, T_true = _small_pair()
    crit = ConvergenceCriteria(max_iterations=100)
    plain = pa.icp(src, tgt, max_correspondence_distance=0.02, method=method, criteria=crit,
                   device="cpu", acceleration=False)
    fast = pa.icp(src, tgt, max_correspondence_distance=0.02, method=method, criteria=crit,
                  device="cpu", acceleration=True)
    assert fast.converged
    # point-to-plane already converges fast (Gauss-Newton): acceleration may cost a step
    assert fast.iterations <= plain.iterations + (2 if method == "point_to_plane" else 0)
    e_plain = metrics.relative_error(plain.transformation, np.asarray(T_true))
    e_fast = metrics.relative_error(fast.transformation, np.asarray(T_true))
    # the same basin: the accelerated answer is as good as the plain one (0.05°, 0.1 mm)
    assert float(e_fast[0]) <= float(e_plain[0]) + 0.05
    assert float(e_fast[1]) <= float(e_plain[1]) + 1e-4
    assert fast.rmse <= plain.rmse * 1.01
    if method == "point_to_point":  # the slow case: a long flat valley
        assert fast.iterations < 0.75 * plain.iterations


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["point_to_point", "point_to_plane"])
def test_fused_update_runs_as_the_reference_in_icp(method, monkeypatch):
    """On a GPU the update is one Triton kernel: the accelerated ICP of the bunny pair from
    the identity takes the same steps as with the spec's tensor operations in its place."""
    from pointalign.kernels import _loop
    from pointalign.kernels.anderson.reference import anderson_update_reference

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pair = datasets.load_bunny_pair()
    s, t = pair.source.cuda(), pair.target.cuda()
    kw = dict(max_correspondence_distance=0.05, method=method, acceleration=True,
              criteria=ConvergenceCriteria(max_iterations=100))
    fused = pa.icp(s, t, **kw)
    monkeypatch.setattr(anderson, "anderson_update", anderson_update_reference)
    _loop.clear_caches()  # not the kept graph of the fused step
    spec = pa.icp(s, t, **kw)
    _loop.clear_caches()
    assert fused.iterations == spec.iterations and fused.stop_reason == spec.stop_reason
    np.testing.assert_allclose(fused.transformation, spec.transformation, atol=1e-9)
    plain = pa.icp(s, t, **dict(kw, acceleration=False))
    assert fused.converged
    if method == "point_to_point":  # the slow case: a long flat valley
        assert fused.iterations < 0.5 * plain.iterations
    else:  # Gauss-Newton converges fast already: acceleration may cost a step
        assert fused.iterations <= plain.iterations + 2


def test_default_accelerates_point_to_point_only():
    src, tgt, _ = _small_pair(1500)
    kw = dict(max_correspondence_distance=0.02, device="cpu",
              criteria=ConvergenceCriteria(max_iterations=60))
    for method, on in (("point_to_point", True), ("point_to_plane", False)):
        default = pa.icp(src, tgt, method=method, **kw)
        chosen = pa.icp(src, tgt, method=method, acceleration=on, **kw)
        # the same path twice (a threaded numba reduction may group sums otherwise: to 1e-12)
        assert default.iterations == chosen.iterations
        np.testing.assert_allclose(default.transformation, chosen.transformation, rtol=0,
                                   atol=1e-12)
    assert pa.icp(src, tgt, acceleration=False, **kw).iterations \
        > pa.icp(src, tgt, **kw).iterations
