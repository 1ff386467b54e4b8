"""EM-ICP and Softassign: dense float64 reference runs, recovery, batches, bad input, forms.

The dense references rebuild the full N×M matrix (N ≤ 500) in float64 each iteration and
solve Horn by an independent NumPy SVD; the library's fused O(N + M) path must give the
same pose after a fixed number of iterations, on every backend (the ``backend`` fixture).

The CPU's approximated forms (``approximation="approximate"``) must land near the exact form
on a bunny subsample; ``info["approximation"]`` says which ran; parameters out of range raise
a ValueError naming them; a run that matched nothing is not "converged"; clouds far from the
origin (float64) give the unshifted run's pose.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
import pytest
import torch

from pointalign import _math, _progress, datasets, metrics, transforms
from pointalign.kernels._numba import available
from pointalign.registration import soft
from pointalign.registration.criteria import ConvergenceCriteria
from pointalign.registration.soft import CHECK_EVERY, emicp, softassign
from tests._interpreted import interpreted_fixture
from tests.kernels.test_soft import dense_emicp, dense_sinkhorn
from tests.registration._deferred import assert_scans_raise

needs_numba = pytest.mark.skipif(not available(), reason="numba is not installed")


def svd_horn(x, m, w):
    """Weighted least-squares rigid motion x → m by NumPy SVD (float64 oracle)."""
    X, Y, W = (t.detach().double().numpy() for t in (x, m, w))
    xm, ym = (W[:, None] * X).sum(0) / W.sum(), (W[:, None] * Y).sum(0) / W.sum()
    H = ((X - xm) * W[:, None]).T @ (Y - ym)
    U, _, Vt = np.linalg.svd(H)
    d = np.sign(np.linalg.det(Vt.T @ U.T))
    R = Vt.T @ np.diag([1, 1, d]) @ U.T
    T = np.eye(4)
    T[:3, :3], T[:3, 3] = R, ym - R @ xm
    return torch.from_numpy(T)


def dense_emicp_run(x, y, sigma, factor, d0, iters):
    T = torch.eye(4, dtype=torch.float64)
    for k in range(iters):
        s2 = sigma**2 * factor**k
        _, lam, xp = dense_emicp(x, y, T, s2, -(d0**2) / s2)
        T = svd_horn(x, xp, lam)
    return T


def dense_softassign_run(x, y, beta0, beta_factor, temps, per_t, alpha, w, rounds):
    T = torch.eye(4, dtype=torch.float64)
    for j in range(temps):
        beta = beta0 * beta_factor**j
        for _ in range(per_t):
            M = dense_sinkhorn(x, y, T, beta, alpha, w, rounds)
            rows = M.sum(1)
            T = svd_horn(x, (M @ y.double()) / rows[:, None], rows)
    return T


def _bunny_small(n_src=200, n_tgt=180, seed=0):
    p = datasets.load_bunny_pair()
    return (datasets.random_subsample(p.source, n_src, seed),
            datasets.random_subsample(p.target, n_tgt, seed + 1), p.T_target_source)


EM_ARGS = dict(sigma=0.08, factor=0.8, outlier_distance=0.05)
SA_ARGS = dict(beta0=150.0, beta_factor=1.5, temperatures=2, iterations_per_temperature=2,
               alpha=0.002, outlier_weight=0.5, sinkhorn_iterations=2)


def _check_pose(T, Td, rot_deg, trans):
    r, t = metrics.relative_error(np.asarray(T), Td.numpy())
    assert r < rot_deg and t < trans, (r, t)


def _sizes(backend, cpu, gpu):
    """The clouds' sizes on this backend's device: the GPU takes the larger case."""
    return gpu if backend.device == "cuda" else cpu


def test_emicp_matches_dense_reference_after_fixed_iterations(backend):
    x, y, _ = _bunny_small(*_sizes(backend, (200, 180), (500, 480)))
    res = emicp(x.to(backend.device), y.to(backend.device),
                criteria=ConvergenceCriteria(max_iterations=6), device=backend.device, **EM_ARGS)
    Td = dense_emicp_run(x, y, 0.08, 0.8, 0.05, 6)
    assert res.iterations == 6 and res.stop_reason == "max_iterations" and not res.converged
    _check_pose(res.transformation, Td, 1e-3, 1e-5)


def test_softassign_matches_dense_reference_after_fixed_iterations(backend):
    x, y, _ = _bunny_small(*_sizes(backend, (150, 140), (500, 480)))
    res = softassign(x.to(backend.device), y.to(backend.device), device=backend.device,
                     **SA_ARGS)
    Td = dense_softassign_run(x, y, 150.0, 1.5, 2, 2, 0.002, 0.5, 2)
    assert res.iterations == 4 and res.stop_reason == "schedule"
    _check_pose(res.transformation, Td, 1e-3, 1e-5)


def test_emicp_bunny_pair_from_identity(backend):
    """bun045 → bun000 (34.3°, 53 mm) from the identity with the seed's schedule."""
    x, y, T_true = _bunny_small(300, 300)
    res = emicp(x.to(backend.device), y.to(backend.device), device=backend.device)
    assert res.stop_reason == "schedule" and res.converged and res.iterations == 66
    r, t = metrics.relative_error(res.transformation, T_true.numpy())
    assert r < 8.0 and t < 0.01, (r, t)  # 300 points ≈ 1 cm apart; from 34.3° / 53 mm
    assert 0 < res.fitness <= 1 and res.rmse < 0.01
    x, y, _ = _bunny_small(500, 480)
    full = emicp(x.to(backend.device), y.to(backend.device), device=backend.device)
    r, t = metrics.relative_error(full.transformation, T_true.numpy())
    assert r < 6.0 and t < 0.008, (r, t)


@pytest.mark.gpu
def test_gpu_pose_matches_cpu():
    """The same run on the GPU (Triton, float32 sums) and the CPU (numba or the reference)."""
    x, y, _ = _bunny_small(500, 480)
    crit = ConvergenceCriteria(max_iterations=6)
    g = emicp(x.cuda(), y.cuda(), criteria=crit, **EM_ARGS)
    c = emicp(x, y, criteria=crit, device="cpu", **EM_ARGS)
    _check_pose(g.transformation, torch.from_numpy(c.transformation), 1e-3, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("algo", [emicp, softassign])
def test_new_sizes_compile_nothing_after_the_first(algo):
    """Clouds of new sizes (counts divisible by 16 or not, odd and even) run the kernels the
    first size compiled: no Triton compile after the first call."""
    triton = pytest.importorskip("triton")
    compiled: list[str] = []

    def hook(*args, **kwargs):
        compiled.append(getattr(kwargs.get("fn"), "name", "?"))

    old = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        for i, (n, m) in enumerate([(1000, 1200), (1008, 1216), (1013, 1211), (1024, 999)]):
            x, y, _ = _bunny_small(n, m)
            algo(x.cuda(), y.cuda(), max_iterations=2)
            if i == 0:
                compiled.clear()
    finally:
        triton.knobs.runtime.jit_post_compile_hook = old
    assert compiled == []


def _outlier_pair(n, seed, device):
    cloud = datasets.random_subsample(datasets.load_bunny("bun000"), n, seed)
    pr = datasets.make_pair(cloud, rotation_deg=60.0, translation=0.03, noise=0.001,
                            outlier_fraction=0.1, seed=seed)
    return pr.source.to(device), pr.target.to(device), pr.T_target_source


def test_emicp_recovers_known_transform_with_noise_and_outliers(backend, seed):
    x, y, T = _outlier_pair(150, seed, backend.device)
    res = emicp(x, y, device=backend.device)
    r, t = metrics.relative_error(res.transformation, T.numpy())
    assert r < 4.0 and t < 0.006, (r, t)
    # swapping source and target gives (about) the inverse
    inv = emicp(y, x, device=backend.device)
    r2, t2 = metrics.relative_error(inv.transformation, transforms.invert(T).numpy())
    assert r2 < 5.0 and t2 < 0.01, (r2, t2)


def test_softassign_recovers_known_transform_with_noise_and_outliers(backend, seed):
    x, y, T = _outlier_pair(150, seed, backend.device)
    res = softassign(x, y, device=backend.device, temperatures=20, beta_factor=1.45,
                     iterations_per_temperature=3, sinkhorn_iterations=2)
    r, t = metrics.relative_error(res.transformation, T.numpy())
    assert r < 3.0 and t < 0.005, (r, t)


@pytest.mark.gpu
def test_default_schedules_recover_60_degrees_at_2000_points(seed):
    """The seed's full schedules (66 EM-ICP steps, 500 Softassign updates) on 2000 points."""
    x, y, T = _outlier_pair(2000, seed, "cuda")
    for res in (emicp(x, y), softassign(x, y)):
        r, t = metrics.relative_error(res.transformation, T.numpy())
        assert r < 3.0 and t < 0.005, (res.info["algorithm"], r, t)


def test_init_is_used(seed):
    cloud = datasets.random_subsample(datasets.load_bunny("bun000"), 150, seed)
    pr = datasets.make_pair(cloud, rotation_deg=120.0, translation=0.05, seed=seed)
    args = dict(sigma=0.02, sigma_min=0.01, device="cpu",
                criteria=ConvergenceCriteria(max_iterations=1))
    res = emicp(pr.source, pr.target, init=pr.T_target_source, **args)
    r, t = metrics.relative_error(res.transformation, pr.T_target_source.numpy())
    assert r < 1.0 and t < 0.002, (r, t)
    r0, _ = metrics.relative_error(emicp(pr.source, pr.target, **args).transformation,
                                   pr.T_target_source.numpy())
    assert r0 > 20.0  # one iteration from the identity cannot bridge 120°: init mattered


def test_batched_emicp_matches_single_runs(seed):
    g = torch.Generator().manual_seed(seed)
    bun = datasets.load_bunny("bun000")
    pairs = [datasets.make_pair(datasets.random_subsample(bun, n, seed + i), 25.0, 0.02,
                                seed=seed + i) for i, n in enumerate((120, 90, 150))]
    del g
    B, N, M = 3, 150, 150
    S = torch.zeros(B, N, 3)
    Tg = torch.zeros(B, M, 3)
    for i, p in enumerate(pairs):
        S[i, : len(p.source)] = p.source
        Tg[i, : len(p.target)] = p.target
    sl = torch.tensor([len(p.source) for p in pairs])
    tl = torch.tensor([len(p.target) for p in pairs])
    args = dict(sigma=0.1, sigma_min=0.01, factor=0.7, device="cpu")
    res = emicp(S, Tg, source_lengths=sl, target_lengths=tl, **args)
    assert res.batched and res.transformation.shape == (3, 4, 4)
    for i, p in enumerate(pairs):
        one = emicp(p.source, p.target, **args)
        np.testing.assert_allclose(res.transformation[i], one.transformation, atol=1e-5)
        assert res[i].iterations == one.iterations
        assert res[i].stop_reason == one.stop_reason


@pytest.mark.parametrize("algo", [emicp, softassign])
def test_collinear_input_is_reported_degenerate_in_a_batch(rng, algo):
    # the rotation about the line is undetermined: that pair keeps its init, the other runs
    x, y, _ = _bunny_small(120, 120)
    line = torch.zeros(120, 3)
    line[:, 0] = torch.rand(120, generator=rng)
    init = torch.eye(4, dtype=torch.float64).repeat(2, 1, 1)
    init[1, :3, 3] = torch.tensor([0.01, 0.0, 0.0], dtype=torch.float64)
    kw = dict(criteria=ConvergenceCriteria(max_iterations=5), device="cpu", init=init)
    res = algo(torch.stack([x, line]), torch.stack([y, line + 0.001]), **kw)
    assert list(res.stop_reason) == ["max_iterations", "degenerate"]
    assert not res.converged[1] and res.iterations[1] == 0
    np.testing.assert_array_equal(res.transformation[1], init[1].numpy())
    single = algo(line, line + 0.001, **dict(kw, init=init[1]))
    assert single.stop_reason == "degenerate" and not single.converged


def test_early_stop_when_pose_and_weights_settle():
    x, y, _ = _bunny_small(200, 200)
    crit = ConvergenceCriteria(max_iterations=500, translation_tolerance=1e-3,
                               rotation_tolerance=1e-2, relative_fitness=0.2)
    res = emicp(x, y, sigma=0.02, sigma_min=0.019, factor=0.9999, criteria=crit, device="cpu")
    assert res.stop_reason == "pose_and_weights" and res.converged
    assert res.iterations % CHECK_EVERY == 0 and res.iterations < res.info["scheduled_iterations"]
    assert res.history and "weight_change" in res.history[-1]


@pytest.mark.gpu
def test_nan_input_raises_on_cuda():
    """On CUDA the pair's host part is read while the program runs: a NaN or Inf point still
    raises the scans' error (EM-ICP, Softassign, and the estimate, which runs no program),
    and the inputs stay as given."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run with -m gpu on the device)")
    p = datasets.make_pair(datasets.random_subsample(datasets.load_bunny("bun000"), 800,
                                                     seed=1), 5.0, 0.0, seed=0)
    s, t = p.source.cuda(), p.target.cuda()
    assert_scans_raise(lambda a, b: emicp(a, b), s, t)
    assert_scans_raise(lambda a, b: softassign(a, b, temperatures=3), s, t)
    assert_scans_raise(lambda a, b: soft.estimate_seconds("emicp", a, b), s, t)


def test_tiny_sigma_no_nan():
    """σ so small that every exp underflows in float32: finite, sensible pose, no NaN."""
    x, y, _ = _bunny_small(100, 100)
    res = emicp(x, y, sigma=1e-6, sigma_min=1e-7, device="cpu")
    assert np.isfinite(res.transformation).all()
    res = softassign(x, y, beta0=1e14, temperatures=2, iterations_per_temperature=1,
                     device="cpu")
    assert np.isfinite(res.transformation).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(sigma=0.0), "sigma"),
    (dict(sigma=-1.0), "sigma"),
    (dict(sigma_min=0.0), "sigma_min"),
    (dict(sigma=0.01, sigma_min=0.02), "sigma_min"),
    (dict(factor=1.0), "factor"),
    (dict(factor=1.5), "factor"),
    (dict(factor=0.0), "factor"),
    (dict(outlier_distance=-0.1), "outlier_distance"),
    (dict(sigma=float("nan")), "sigma"),
])
def test_emicp_bad_parameters(kwargs, match):
    x = torch.rand(10, 3)
    with pytest.raises(ValueError, match=match):
        emicp(x, x, device="cpu", **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(beta0=0.0), "beta0"),
    (dict(beta0=-3.0), "beta0"),
    (dict(beta_factor=1.0), "beta_factor"),
    (dict(beta_factor=0.5), "beta_factor"),
    (dict(alpha=0.0), "alpha"),
    (dict(outlier_weight=0.0), "outlier_weight"),
    (dict(temperatures=0), "temperatures"),
    (dict(sinkhorn_iterations=0), "sinkhorn_iterations"),
    (dict(iterations_per_temperature=0), "iterations_per_temperature"),
])
def test_softassign_bad_parameters(kwargs, match):
    x = torch.rand(10, 3)
    with pytest.raises(ValueError, match=match):
        softassign(x, x, device="cpu", **kwargs)


def test_bad_inputs_name_the_argument():
    x = torch.rand(10, 3)
    with pytest.raises(ValueError, match="source"):
        emicp(torch.rand(10, 2), x, device="cpu")
    with pytest.raises(ValueError, match="target"):
        softassign(x, torch.full((10, 3), float("nan")), device="cpu")
    with pytest.raises(ValueError, match="init"):
        emicp(x, x, init=torch.zeros(4, 4), device="cpu")
    with pytest.raises(ValueError, match="source, target"):
        emicp(torch.rand(2, 10, 3), x, device="cpu")
    with pytest.raises(TypeError, match="criteria"):
        emicp(x, x, criteria=5, device="cpu")


def test_inputs_not_modified():
    x, y, _ = _bunny_small(100, 100)
    x0, y0 = x.clone(), y.clone()
    emicp(x, y, sigma=0.05, sigma_min=0.02, device="cpu")
    softassign(x.numpy(), y.numpy(), temperatures=1, iterations_per_temperature=1,
               device="cpu")
    assert torch.equal(x, x0) and torch.equal(y, y0)


# ------------------------------------------------------------------------------------------
# Triton path: interpreter (child process); GPU-only sizes
# ------------------------------------------------------------------------------------------


def run_interpreted_cases(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): both algorithms with the Triton kernels."""
    from pointalign.kernels import _backend

    assert _backend.backend(torch.empty(0)) == "interpret"
    x, y, _ = _bunny_small(40, 35)
    out = {
        "emicp": torch.from_numpy(emicp(x, y, criteria=ConvergenceCriteria(max_iterations=3),
                                        device="cpu", **EM_ARGS).transformation),
        "soft": torch.from_numpy(softassign(x, y, device="cpu", **SA_ARGS).transformation),
    }
    torch.save(out, out_path)


interpreted = interpreted_fixture("tests.registration.test_soft", "run_interpreted_cases")


def test_triton_interpreted_matches_dense(interpreted):
    x, y, _ = _bunny_small(40, 35)
    _check_pose(interpreted["emicp"], dense_emicp_run(x, y, 0.08, 0.8, 0.05, 3), 1e-3, 1e-5)
    _check_pose(interpreted["soft"],
                dense_softassign_run(x, y, 150.0, 1.5, 2, 2, 0.002, 0.5, 2), 1e-3, 1e-5)


@pytest.mark.gpu
def test_200k_points_linear_memory():
    """200k points a side: peak memory stays O(N + M) (an N×M float32 matrix is 160 GB)."""
    bun = datasets.load_bunny("bun000").cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 200_000
    idx = torch.randint(0, bun.shape[0], (n,), device="cuda", generator=g)
    y = bun[idx] + 1e-3 * torch.randn(n, 3, device="cuda", generator=g)
    x = y[torch.randperm(n, device="cuda", generator=g)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    res = emicp(x, y, criteria=ConvergenceCriteria(max_iterations=2))
    sres = softassign(x, y, criteria=ConvergenceCriteria(max_iterations=1), temperatures=1,
                      iterations_per_temperature=1, sinkhorn_iterations=1)
    peak = torch.cuda.max_memory_allocated() - base
    assert np.isfinite(res.transformation).all() and np.isfinite(sres.transformation).all()
    assert peak < 256 * 2**20, f"peak {peak / 2**20:.1f} MiB"  # ≈ 100 floats per point
    assert peak < n * n * 4 / 1000


# ------------------------------------------------------------------------------------------
# the program on the executor: signature and criteria
# ------------------------------------------------------------------------------------------


def _captured_program(monkeypatch, algo, *args, **kwargs):
    """Run ``algo`` and return the (program, inputs) it handed to the executor."""
    from pointalign.kernels import _loop
    from pointalign.registration import soft

    seen, run = [], _loop.run_program

    def spy(program, inputs, **kw):
        seen.append((program, inputs))
        return run(program, inputs, **kw)

    monkeypatch.setattr(soft._loop, "run_program", spy)
    algo(*args, **kwargs)
    monkeypatch.undo()
    # the run's passes and progress bar are per call (a CUDA graph keys the GPU's passes by
    # value; the CPU's own their trees and run eagerly)
    prog, inputs = seen[-1]
    return dataclasses.replace(prog, passes=None, progress=None), inputs


@pytest.mark.parametrize("algo,change", [(emicp, dict(factor=0.7)),
                                         (emicp, dict(criteria=ConvergenceCriteria(
                                             max_iterations=1, rotation_tolerance=1e-3))),
                                         (softassign, dict(beta_factor=1.6)),
                                         (softassign, dict(outlier_weight=0.25))])
def test_program_signature_changes_with_every_constant(monkeypatch, algo, change):
    """A cached graph is keyed by the program's fields: a changed constant must change it."""
    from pointalign.kernels import _loop

    x, y, _ = _bunny_small(30, 30)
    base = EM_ARGS if algo is emicp else SA_ARGS
    kw = dict(base, device="cpu", criteria=ConvergenceCriteria(max_iterations=1))
    p1, in1 = _captured_program(monkeypatch, algo, x, y, **kw)
    p1b, in1b = _captured_program(monkeypatch, algo, x, y, **kw)
    p2, in2 = _captured_program(monkeypatch, algo, x, y, **dict(kw, **change))
    key = _loop.signature(p1, in1)[0]
    assert key == _loop.signature(p1b, in1b)[0]
    assert key != _loop.signature(p2, in2)[0]
    # a per-problem value the caller gives is an input, not a constant: the graph is reused
    name = "sigma" if algo is emicp else "beta0"
    p3, in3 = _captured_program(monkeypatch, algo, x, y, **dict(kw, **{name: 0.9 * base[name]}))
    assert _loop.signature(p3, in3)[0] == key and not torch.equal(in3[name], in1[name])
    # every field of the program is part of the key
    for f in dataclasses.fields(p1):
        v = getattr(p1, f.name)
        other = (v + 1 if isinstance(v, int) else 0.5 * v + 0.125) if v is not None else 1.0
        assert _loop.signature(dataclasses.replace(p1, **{f.name: other}), in1)[0] != key, f.name


def test_relative_weights_is_the_weight_rule():
    """``relative_weights`` decides the weight test; ``relative_fitness`` only stands in for
    it when it is None (the meaning EM-ICP gave relative_fitness before)."""
    x, y, _ = _bunny_small(200, 200)
    crit = ConvergenceCriteria(max_iterations=48, translation_tolerance=1e-3,
                               rotation_tolerance=1e-2, relative_weights=0.2)
    args = dict(sigma=0.02, sigma_min=0.019, factor=0.9999, device="cpu")
    assert emicp(x, y, criteria=crit, **args).stop_reason == "pose_and_weights"
    strict = ConvergenceCriteria(max_iterations=48, translation_tolerance=1e-3,
                                 rotation_tolerance=1e-2, relative_fitness=0.2,
                                 relative_weights=0.0)
    res = emicp(x, y, criteria=strict, **args)
    assert res.stop_reason == "max_iterations" and res.iterations == 48
    with pytest.raises(ValueError, match="relative_weights"):
        ConvergenceCriteria(relative_weights=-1.0)


# ------------------------------------------------------------------------------------------
# the CPU's forms of the passes: the record, the estimate, the approximations' poses
# ------------------------------------------------------------------------------------------

EM_SHORT = dict(sigma=0.03, sigma_min=0.004, factor=0.8)          # 18 iterations
SA_SHORT = dict(temperatures=12, beta_factor=1.4, iterations_per_temperature=2,
                sinkhorn_iterations=2)
#: a short Softassign schedule that starts hot (β₀ = 1/ρ², cells of ~4 points) and ends cold
#: (β = 1/ρ² · 2.2^9 ≈ 1200/ρ²: one point per cell), as the default schedule does
SA_HOT_COLD = dict(temperatures=10, beta_factor=2.2, iterations_per_temperature=3,
                   sinkhorn_iterations=2)


def _bunny(n_src, n_tgt, seed=0):
    p = datasets.load_bunny_pair()
    return (datasets.random_subsample(p.source, n_src, seed).double(),
            datasets.random_subsample(p.target, n_tgt, seed + 1).double(), p.T_target_source)


def _translation(v) -> torch.Tensor:
    T = torch.eye(4, dtype=torch.float64)
    T[:3, 3] = torch.as_tensor(v, dtype=torch.float64)
    return T


def _pose_gap(Ta, Tb):
    r, t = metrics.relative_error(np.asarray(Ta), np.asarray(Tb))
    return r, t


@needs_numba
def test_emicp_approximate_lands_near_exact():
    """Cells + truncation on 1200 x 1200 bunny points: within 0.5° / 1 mm of the exact form
    (both from the identity; the pose is ~34° away), and as near the truth (+0.5°)."""
    x, y, Td = _bunny(1200, 1200)
    ex = emicp(x, y, device="cpu", approximation="exact", **EM_SHORT)
    ap = emicp(x, y, device="cpu", approximation="approximate", **EM_SHORT)
    assert ex.info["approximation"]["mode"] == "exact"
    assert ap.info["approximation"]["mode"] == "cells"
    assert ap.info["approximation"]["k"] == 4.0 and "cell_rule" in ap.info["approximation"]
    r, t = _pose_gap(ap.transformation, ex.transformation)
    assert r < 0.5 and t < 1e-3, (r, t)
    r_ap, _ = _pose_gap(ap.transformation, Td.numpy())
    r_ex, _ = _pose_gap(ex.transformation, Td.numpy())
    assert r_ap < r_ex + 0.5, (r_ap, r_ex)


@needs_numba
def test_softassign_approximate_lands_near_exact():
    """Cells while they merge points, then per point: within 0.05° / 0.05 mm of the exact
    form on 400 x 400 bunny points (from the identity; the pose is ~34° away), and the record
    says which form ran in which phase."""
    x, y, Td = _bunny(400, 400)
    ex = softassign(x, y, device="cpu", approximation="exact", **SA_HOT_COLD)
    ap = softassign(x, y, device="cpu", approximation="approximate", **SA_HOT_COLD)
    assert ex.info["approximation"]["mode"] == "exact"
    info = ap.info["approximation"]
    assert info["mode"] == "cells" and info["normaliser_relative_bound"] <= 1e-4
    forms = [p["form"] for p in info["phases"]]
    assert forms[0] == "cells" and forms[-1] == "per_point", info["phases"]
    assert info["passes"]["cells"] > 0 and info["passes"]["per_point"] > 0
    assert sum(info["passes"].values()) == ap.iterations * 2 * 2
    r, t = _pose_gap(ap.transformation, ex.transformation)
    assert r < 0.05 and t < 5e-5, (r, t)
    r_ex, _ = _pose_gap(ex.transformation, Td.numpy())
    assert r_ex < 3.0, r_ex  # the exact run itself registers the pair


@needs_numba
def test_auto_form_estimate_and_slow_warning(monkeypatch):
    x, y, _ = _bunny(200, 200)
    res = emicp(x, y, device="cpu", **EM_SHORT)
    assert res.info["approximation"]["mode"] == "exact"  # small: the exact form is seconds
    est = soft.estimate_seconds("emicp", x, y, device="cpu", **EM_SHORT)
    assert est["approximation"]["mode"] == "exact" and 0 < est["seconds"] < 3
    est = soft.estimate_seconds("softassign", x, y, device="cpu", approximation="approximate")
    assert est["approximation"]["mode"] == "cells" and est["seconds"] > 0
    with pytest.raises(ValueError, match="algorithm"):
        soft.estimate_seconds("icp", x, y)
    with pytest.raises(TypeError, match="sigmaa"):
        soft.estimate_seconds("emicp", x, y, sigmaa=0.1)
    with pytest.raises(ValueError, match="approximation"):
        emicp(x, y, device="cpu", approximation="fast")
    monkeypatch.setattr(soft, "SLOW_S", -1.0)
    with pytest.warns(_progress.SlowOperationWarning, match="estimated"):
        emicp(x, y, device="cpu", criteria=soft.ConvergenceCriteria(max_iterations=1))


@pytest.mark.parametrize("algo,kwargs,match", [
    (emicp, dict(sigma=1e-30), "sigma"),
    (emicp, dict(sigma=1e30), "sigma"),
    (emicp, dict(sigma_min=1e-30), "sigma_min"),
    (emicp, dict(sigma=1e30, sigma_min=1e29), "sigma"),
    (emicp, dict(sigma=1e-29, sigma_min=1e-30), "sigma"),
    (softassign, dict(beta0=1e-30), "beta0"),
    (softassign, dict(beta0=1e30), "beta0"),
    (softassign, dict(alpha=1e30), "alpha"),
    (softassign, dict(beta_factor=float("inf")), "beta_factor"),
])
def test_extreme_parameters_name_the_argument(algo, kwargs, match):
    x, y, _ = _bunny(50, 50)
    with pytest.raises(ValueError, match=match):
        algo(x, y, device="cpu", **kwargs)


@pytest.mark.parametrize("algo,kwargs", [(emicp, EM_SHORT), (softassign, SA_SHORT)])
def test_nothing_matched_is_not_converged(algo, kwargs):
    """The source placed 100 m away: no pair within reach, the pose stays: not converged."""
    x, y, _ = _bunny(100, 100)
    init = _translation([100.0, 0.0, 0.0])
    res = algo(x, y, init=init, device="cpu", **kwargs)
    assert not res.converged and res.stop_reason == "no_correspondences"
    assert res.fitness == 0


@pytest.mark.parametrize("algo,kwargs,offset",
                         [(emicp, EM_SHORT, o) for o in (1e3, 1e4, 1e5, 1e6)]
                         + [(softassign, SA_SHORT, o) for o in (1e3, 1e6)])
def test_far_from_origin_matches_unshifted(algo, kwargs, offset):
    """Float64 clouds shifted by 1e3..1e6 m: the pose of the unshifted run, moved along."""
    x, y, _ = _bunny(150, 150)
    o = torch.tensor([offset, -0.7 * offset, 0.3 * offset], dtype=torch.float64)
    base = algo(x, y, device="cpu", **kwargs)
    far = algo(x + o, y + o, device="cpu", **kwargs)
    # the same motion of the points where they are (the pose about the origin, 1e6 m away,
    # carries its rotation's last bits times the offset)
    xs = (x + o).numpy()
    moved_far = xs @ np.asarray(far.transformation)[:3, :3].T + \
        np.asarray(far.transformation)[:3, 3]
    moved_base = x.numpy() @ np.asarray(base.transformation)[:3, :3].T + \
        np.asarray(base.transformation)[:3, 3] + o.numpy()
    extent = float(np.ptp(x.numpy(), axis=0).max())
    gap = np.abs(moved_far - moved_base).max()
    assert gap < 1e-6 * extent, gap
    assert np.abs(np.asarray(far.transformation)[:3, :3]
                  - np.asarray(base.transformation)[:3, :3]).max() < 1e-6
    assert far.converged == base.converged and far.iterations == base.iterations


@pytest.mark.parametrize("algo,kwargs", [(emicp, EM_SHORT), (softassign, SA_SHORT)])
def test_progress_advances_once_per_iteration(monkeypatch, algo, kwargs):
    """A run whose passes are on the host opens one progress task over the schedule and
    advances it per iteration."""
    seen = []

    class Bar:
        n = 0

        def advance(self, n=1):
            self.n += n

    @contextlib.contextmanager
    def task(description, total=None, *, quiet=None):
        bar = Bar()
        seen.append((description, total, bar))
        yield bar

    monkeypatch.setattr(soft._progress, "task", task)
    x, y, _ = _bunny(100, 100)
    res = algo(x, y, device="cpu", **kwargs)
    (desc, total, bar), = seen
    assert total == res.info["scheduled_iterations"] and bar.n == res.iterations


@needs_numba
def test_softassign_approximate_on_random_data_lands_near_exact():
    """A random anisotropic Gaussian cloud (250 points, 23° about z, 1 cm noise): the cells
    form gives the exact form's pose within 0.05° / 0.05 mm, and the truth within 0.5°."""
    g = torch.Generator().manual_seed(23)
    y = torch.randn(250, 3, generator=g, dtype=torch.float64) * \
        torch.tensor([1.0, 0.6, 0.3], dtype=torch.float64)
    c, s = math.cos(0.4), math.sin(0.4)
    T = torch.eye(4, dtype=torch.float64)
    T[:3, :3] = torch.tensor([[c, -s, 0], [s, c, 0], [0, 0, 1.0]], dtype=torch.float64)
    T[:3, 3] = torch.tensor([0.1, -0.05, 0.02], dtype=torch.float64)
    x = (y - T[:3, 3]) @ T[:3, :3] + 0.01 * torch.randn(250, 3, generator=g,
                                                         dtype=torch.float64)
    ex = softassign(x, y, device="cpu", approximation="exact", **SA_HOT_COLD)
    ap = softassign(x, y, device="cpu", approximation="approximate", **SA_HOT_COLD)
    assert ap.info["approximation"]["passes"].get("cells", 0) > 0
    r, t = _pose_gap(ap.transformation, ex.transformation)
    assert r < 0.05 and t < 5e-5, (r, t)
    r, _ = _pose_gap(ap.transformation, T.numpy())
    assert r < 0.5, r


@needs_numba
def test_softassign_fused_updates_equal_the_passes(monkeypatch):
    """The "cells" updates fused into one call per update (``cpu_cells.softassign_update``)
    give the pose of the passes run one by one (float32 bunny subsample, hot to cold), and
    the record counts the same passes.

    The same sums in the same order, in float32 points: what may differ is the rounding of
    the PyTorch normalisations between the passes (ATen's vector kernels, AVX-512 or AVX2,
    tests/kernels/test_soft.py::_order_bound), a few float32 ulps of the soft
    correspondences per update; Horn's closed form carries them to the pose without gain
    near the solution, so the poses may differ by a few float32 ulps per update: of the
    rotation's entries, and of the extent for the translation.
    """
    from pointalign.kernels.soft import cpu_cells

    x, y, _ = _bunny(300, 300)
    x, y = x.float(), y.float()
    fused = softassign(x, y, device="cpu", approximation="approximate", **SA_HOT_COLD)
    calls = []

    def per_pass(*args, **kw):
        calls.append(1)
        return None
    monkeypatch.setattr(cpu_cells, "softassign_update", per_pass)
    ref = softassign(x, y, device="cpu", approximation="approximate", **SA_HOT_COLD)
    assert len(calls) == ref.iterations
    assert ref.info["approximation"]["passes"]["cells"] > 0
    assert fused.info["approximation"]["passes"] == ref.info["approximation"]["passes"]
    ulps = 8 * ref.iterations * float(torch.finfo(torch.float32).eps)
    extent = float((y.amax(0) - y.amin(0)).norm())
    Tf, Tr = torch.from_numpy(fused.transformation), torch.from_numpy(ref.transformation)
    torch.testing.assert_close(Tf[:3, :3], Tr[:3, :3], rtol=0, atol=ulps)
    torch.testing.assert_close(Tf[:3, 3], Tr[:3, 3], rtol=0, atol=ulps * extent)


def _sphere_pair(n: int, repeat: int = 1):
    """A unit sphere (``n`` points, each repeated ``repeat`` times) and itself turned 20°."""
    u = torch.randn(n, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    s = (u / u.norm(dim=1, keepdim=True)).repeat_interleave(repeat, 0)
    R = transforms.axis_angle_to_matrix(torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64),
                                        math.radians(20.0))
    return s, s @ R.T


def _padded_batch():
    """Two bunny problems of other sizes, padded: ``(x (2, 400, 3), y (2, 380, 3), lengths)``."""
    (x0, y0), (x1, y1) = _bunny(400, 380)[:2], _bunny(300, 350, seed=2)[:2]
    x = torch.zeros(2, 400, 3, dtype=x0.dtype)
    y = torch.zeros(2, 380, 3, dtype=y0.dtype)
    x[0], x[1, :300], y[0], y[1, :350] = x0, x1, y0, y1
    return x, y, dict(source_lengths=[400, 300], target_lengths=[380, 350])


@pytest.mark.parametrize("algo,kwargs", [(emicp, EM_SHORT), (softassign, SA_SHORT)])
@pytest.mark.parametrize("case", ["bunny", "batch", "sphere", "repeated sphere"])
def test_stability_measured_in_the_program_equals_the_one_after_it(monkeypatch, backend,
                                                                   algo, kwargs, case):
    """The final poses' stability measured by the program's last step (where the probe is
    device work: Triton on a GPU; elsewhere the probe's reference stands in) equals the
    measurement after the run, for one problem and a padded batch of two, and so does the
    verdict (a sphere turned: undetermined); a sample whose neighbourhood spans no plane
    (every point repeated 8 times) is measured again after the run, with more
    neighbours."""
    from pointalign.registration import stability as rstab

    lengths: dict = {}
    if case == "batch":
        x, y, lengths = _padded_batch()
    else:
        x, y = _bunny(400, 380)[:2] if case == "bunny" else _sphere_pair(300) \
            if case == "sphere" else _sphere_pair(60, 8)
    x, y = x.to(backend.device), y.to(backend.device)
    kw = dict(kwargs, device=backend.device, **lengths)
    if algo is emicp and "sphere" in case:
        kw.update(sigma=0.6, sigma_min=0.05)  # lengths for a unit sphere
    after = []
    measured, device_probe = rstab._edge.measured_stability, rstab.device_probe

    def spy(*a, **k):
        after.append(1)
        return measured(*a, **k)

    monkeypatch.setattr(soft._edge, "measured_stability", spy)
    monkeypatch.setattr(soft._stability, "device_probe", lambda pair: None)
    want = algo(x, y, **kw)
    assert len(after) == 1
    after.clear()

    def in_program(pair):
        k = int(min(rstab.STABILITY_K, int(pair.target_counts.max())))
        return (k, *rstab.stability_sample(pair.source_counts, pair.device))

    monkeypatch.setattr(soft._stability, "device_probe",
                        in_program if backend.device == "cpu" else device_probe)
    got = algo(x, y, **kw)
    assert len(after) == (1 if case == "repeated sphere" else 0)
    assert np.array_equal(got.stop_reason, want.stop_reason)
    np.testing.assert_allclose(got.info["stability"], want.info["stability"], rtol=1e-5,
                               atol=1e-9)
    np.testing.assert_allclose(got.transformation, want.transformation, rtol=0, atol=1e-12)
    if case == "sphere":  # the data do not determine the turn ("stalled" where it slides)
        assert not got.converged and got.info["stability"] <= _math.STABILITY_EPS
    if case in ("bunny", "batch"):
        assert (np.asarray(got.info["stability"]) > 5 * _math.STABILITY_EPS).all()
