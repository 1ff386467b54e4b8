"""ICP: recovery of known transforms on the bunny, inverse on swap, batched == separate,
the information matrix vs an oracle, robust kernels, no-correspondence / degenerate stops,
bad input, the Triton path (interpreted) and CUDA.

Tolerances (rotation error = angle of inv(T_true) T_est, translation = ||t_est − t_true||):
the bunny target is ~0.15 m across, subsampled to 1,500 points, noise σ = 0.5 mm.
* 10°, 20 mm, 5 % outliers, 85 % overlap: < 0.5° and < 2 mm (both methods);
* 30°, 20 mm, full overlap: < 0.5° and < 2 mm (both methods).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from scipy.spatial import cKDTree

import pointalign.registration.icp as icp_module
import pointalign.registration.stability as measured
from pointalign import _math, datasets, metrics, transforms
from pointalign.cloud import PointCloud
from pointalign.kernels import _np_math
from pointalign.registration.criteria import ConvergenceCriteria, RobustKernel
from pointalign.registration.icp import icp
from pointalign.search import build_index
from pointalign.search.packed import PackedIndex
from pointalign.search.policy import choose_index
from tests._backends import backends
from tests._interpreted import interpreted_fixture
from tests.registration._deferred import assert_scans_raise

METHODS = ["point_to_point", "point_to_plane"]
CRIT = ConvergenceCriteria(max_iterations=60)


@pytest.fixture(scope="module")
def bunny():
    return datasets.random_subsample(datasets.load_bunny("bun000"), 1500, seed=7)


def _err(res, T):
    rot, trans = metrics.relative_error(res.transformation, T)
    return rot, trans


@pytest.mark.parametrize("method", METHODS)
def test_recovers_10deg_outliers_partial_overlap(bunny, seed, method):
    p = datasets.make_pair(bunny, 10.0, 0.02, noise=5e-4, outlier_fraction=0.05,
                           overlap=0.85, seed=seed)
    res = icp(p.source, p.target, max_correspondence_distance=0.02, method=method,
              criteria=CRIT, device="cpu")
    rot, trans = _err(res, p.T_target_source)
    assert rot < 0.5 and trans < 2e-3, (rot, trans, res.summary())
    assert res.converged and res.stop_reason in ("relative_change", "small_update")
    assert 0.8 < res.fitness <= 1.0 and res.rmse < 3e-3
    assert res.info["H"].shape == (6, 6)
    assert res.history[0]["iteration"] == 0 and len(res.history) == res.iterations + 1
    assert {"index", "iterate", "total"} <= set(res.timings)


@pytest.mark.parametrize("method", METHODS)
def test_recovers_30deg_full_overlap(bunny, seed, method):
    p = datasets.make_pair(bunny, 30.0, 0.02, noise=5e-4, seed=seed)
    res = icp(p.source, p.target, max_correspondence_distance=0.05, method=method,
              criteria=CRIT, device="cpu")
    rot, trans = _err(res, p.T_target_source)
    assert rot < 0.5 and trans < 2e-3, (rot, trans, res.summary())


def test_swap_gives_inverse(bunny, seed):
    p = datasets.make_pair(bunny, 8.0, 0.01, noise=3e-4, seed=seed)
    crit = ConvergenceCriteria(max_iterations=60, relative_fitness=0, relative_rmse=1e-7)
    fwd = icp(p.source, p.target, max_correspondence_distance=0.03, criteria=crit,
              method="point_to_plane", device="cpu")
    bwd = icp(p.target, p.source, max_correspondence_distance=0.03, criteria=crit,
              method="point_to_plane", device="cpu")
    rot, trans = metrics.relative_error(bwd.transformation, np.linalg.inv(fwd.transformation))
    assert rot < 0.1 and trans < 5e-4, (rot, trans)


def test_perturbed_init_converges_back(bunny, seed):
    p = datasets.make_pair(bunny, 5.0, 0.0, noise=5e-4, seed=seed)
    g = torch.Generator().manual_seed(100 + seed)
    init = transforms.random_transform(3.0, 0.005, generator=g) @ p.T_target_source
    res = icp(p.source, p.target, init=init, max_correspondence_distance=0.02,
              method="point_to_plane", criteria=CRIT, device="cpu")
    rot, trans = _err(res, p.T_target_source)
    assert rot < 0.3 and trans < 1e-3


def _ragged_batch(bunny, seed):
    pairs = [datasets.make_pair(datasets.random_subsample(bunny, m, seed=s), 10.0, 0.01,
                                noise=5e-4, overlap=ov, seed=seed * 10 + s)
             for s, (m, ov) in enumerate([(900, 1.0), (701, 0.8), (503, 0.9)])]
    return pairs


@pytest.mark.parametrize("method", METHODS)
def test_batched_equals_separate(bunny, seed, method):
    pairs = _ragged_batch(bunny, seed)
    B = len(pairs)
    N = max(p.source.shape[0] for p in pairs)
    M = max(p.target.shape[0] for p in pairs)
    src = torch.full((B, N, 3), 7.0)
    tgt = torch.full((B, M, 3), -7.0)
    for b, p in enumerate(pairs):
        src[b, : p.source.shape[0]] = p.source
        tgt[b, : p.target.shape[0]] = p.target
    sl = torch.tensor([p.source.shape[0] for p in pairs])
    tl = torch.tensor([p.target.shape[0] for p in pairs])
    crit = ConvergenceCriteria(max_iterations=25)
    res = icp(src, tgt, source_lengths=sl, target_lengths=tl, max_correspondence_distance=0.02,
              method=method, criteria=crit, device="cpu")
    assert res.batched and res.transformation.shape == (B, 4, 4) and len(res) == B
    for b, p in enumerate(pairs):
        one = icp(p.source, p.target, max_correspondence_distance=0.02, method=method,
                  criteria=crit, device="cpu")
        np.testing.assert_allclose(res.transformation[b], one.transformation, atol=1e-6)
        assert res.iterations[b] == one.iterations
        assert res.stop_reason[b] == one.stop_reason
        assert abs(res.fitness[b] - one.fitness) < 1e-9
        assert abs(res.rmse[b] - one.rmse) < 1e-7
        item = res[b]
        assert item.transformation.shape == (4, 4)
        np.testing.assert_allclose(item.info["H"], one.info["H"], rtol=1e-5, atol=1e-9)


def test_batched_shared_target(bunny, seed):
    pairs = [datasets.make_pair(bunny, 8.0, 0.01, noise=5e-4, seed=seed * 10 + s)
             for s in range(2)]
    src = torch.stack([p.source for p in pairs])
    res = icp(src, bunny, max_correspondence_distance=0.02, criteria=CRIT, device="cpu")
    for b, p in enumerate(pairs):
        rot, trans = metrics.relative_error(res.transformation[b], p.T_target_source)
        assert rot < 0.5 and trans < 2e-3


def _corr(src, tgt, T, md):
    x = src.double().numpy() @ T[:3, :3].T + T[:3, 3]
    d, j = cKDTree(tgt.double().numpy()).query(x, distance_upper_bound=md)
    ok = np.isfinite(d)
    return x[ok], tgt.double().numpy()[j[ok]], d[ok]


@pytest.mark.parametrize("method", METHODS)
def test_information_matrix_and_stats_match_oracle(bunny, seed, method):
    p = datasets.make_pair(bunny, 5.0, 0.01, noise=5e-4, overlap=0.9, seed=seed)
    res = icp(p.source, p.target, max_correspondence_distance=0.01, method=method,
              criteria=ConvergenceCriteria(max_iterations=8), device="cpu")
    x, y, d = _corr(p.source, p.target, res.transformation, 0.01)
    assert abs(res.fitness - len(d) / p.source.shape[0]) < 2e-3
    assert abs(res.rmse - np.sqrt((d ** 2).mean())) < 1e-5
    if method == "point_to_plane":
        from pointalign.features.normals import estimate_normals

        nrm = estimate_normals(p.target, k=20, orient=None).double().numpy()
        j = cKDTree(p.target.double().numpy()).query(y)[1]
        n = nrm[j]
        J = np.concatenate([np.cross(y, n), n], 1)
    else:
        # Σ Gᵀ G with G = [−[y]×, I] (Open3D's point-to-point information matrix)
        J = None
        H = np.zeros((6, 6))
        for yi in y:
            G = np.concatenate([-np.array([[0, -yi[2], yi[1]], [yi[2], 0, -yi[0]],
                                           [-yi[1], yi[0], 0]]), np.eye(3)], 1)
            H += G.T @ G
    if J is not None:
        H = J.T @ J
    # the final correspondences differ from the oracle's only on points at the boundary
    np.testing.assert_allclose(res.info["H"], H, rtol=2e-2, atol=2e-2 * np.abs(H).max())


@pytest.mark.parametrize("kind,scale", [("huber", 0.002), ("tukey", 0.02), ("cauchy", 0.005)])
def test_robust_kernels_with_many_outliers(bunny, kind, scale):
    p = datasets.make_pair(bunny, 8.0, 0.01, noise=5e-4, outlier_fraction=0.3, seed=3)
    res = icp(p.source, p.target, max_correspondence_distance=0.03,
              robust_kernel=RobustKernel(kind, scale), criteria=CRIT, device="cpu")
    rot, trans = _err(res, p.T_target_source)
    assert rot < 0.5 and trans < 2e-3, (kind, rot, trans)


def test_no_correspondences_reported(bunny):
    far = bunny + torch.tensor([10.0, 0.0, 0.0])
    for method in METHODS:
        res = icp(far, bunny, max_correspondence_distance=0.01, method=method, device="cpu")
        assert not res.converged and res.stop_reason == "no_correspondences"
        assert res.iterations == 0 and res.fitness == 0.0
        np.testing.assert_array_equal(res.transformation, np.eye(4))


def test_plane_is_rank_deficient_for_point_to_plane(rng):
    xy = torch.rand(500, 2, generator=rng)
    plane = torch.cat([xy, torch.zeros(500, 1)], 1)
    res = icp(plane + torch.tensor([0.01, 0.0, 0.002]), plane,
              target_normals=torch.tensor([[0.0, 0, 1]]).expand(500, 3),
              max_correspondence_distance=0.05, method="point_to_plane", device="cpu")
    # the normal offset is removed by the least-norm step; in-plane motion is unobservable,
    # so the pose is not determined: not converged (issue #16 item 2)
    assert res.info["rank_deficient"] and not res.converged
    assert res.stop_reason == "ambiguous" and res.info["stability"] == 0.0
    assert np.isfinite(res.transformation).all()
    assert abs(res.transformation[2, 3] + 0.002) < 1e-6
    np.testing.assert_allclose(res.transformation[:3, :3], np.eye(3), atol=1e-6)


def test_collinear_is_degenerate_for_point_to_point(rng):
    line = torch.zeros(200, 3)
    line[:, 0] = torch.rand(200, generator=rng)
    res = icp(line + torch.tensor([0.0, 0.001, 0.0]), line, max_correspondence_distance=0.05,
              device="cpu")
    assert not res.converged and res.stop_reason == "degenerate" and res.iterations == 0
    np.testing.assert_array_equal(res.transformation, np.eye(4))


def test_inputs_numpy_pointcloud_float64_and_index(bunny):
    p = datasets.make_pair(bunny, 6.0, 0.01, noise=5e-4, seed=4)
    ref = icp(p.source, p.target, max_correspondence_distance=0.02, device="cpu",
              method="point_to_plane")
    from pointalign.features.normals import estimate_normals

    nrm = estimate_normals(p.target, k=20, orient=None)
    cloud = PointCloud(p.target, normals=nrm)
    a = icp(p.source.double().numpy(), cloud, max_correspondence_distance=0.02, device="cpu",
            method="point_to_plane", index=build_index(p.target, "brute"))
    np.testing.assert_allclose(a.transformation, ref.transformation, atol=1e-5)
    assert a.info["index"] == "BruteForceIndex"


def test_bad_input(bunny):
    with pytest.raises(ValueError, match="max_correspondence_distance"):
        icp(bunny, bunny, max_correspondence_distance=0.0)
    with pytest.raises(ValueError, match="max_correspondence_distance"):
        icp(bunny, bunny, max_correspondence_distance=-1.0)
    with pytest.raises(ValueError, match="target"):
        icp(bunny, torch.zeros(0, 3), max_correspondence_distance=0.1, device="cpu")
    bad = bunny.clone()
    bad[5, 0] = float("nan")
    with pytest.raises(ValueError, match="source"):
        icp(bad, bunny, max_correspondence_distance=0.1, device="cpu")
    with pytest.raises(ValueError, match="method"):
        icp(bunny, bunny, max_correspondence_distance=0.1, method="plane")
    with pytest.raises(ValueError, match="different devices"):
        icp(bunny, torch.empty(10, 3, device="meta"), max_correspondence_distance=0.1)
    with pytest.raises(ValueError, match="init"):
        icp(bunny, bunny, init=np.ones((4, 4)), max_correspondence_distance=0.1, device="cpu")
    with pytest.raises(ValueError, match="target_normals"):
        icp(bunny, bunny, target_normals=torch.zeros(3, 3), method="point_to_plane",
            max_correspondence_distance=0.1, device="cpu")
    with pytest.raises(ValueError, match="index"):
        icp(bunny, bunny, index=build_index(bunny[:10], "brute"),
            max_correspondence_distance=0.1, device="cpu")
    with pytest.raises(TypeError, match="robust_kernel"):  # ("huber" is accepted: issue 26)
        icp(bunny, bunny, robust_kernel=3.0, max_correspondence_distance=0.1, device="cpu")
    with pytest.raises(ValueError, match="target"):
        icp(bunny, torch.stack([bunny] * 3), max_correspondence_distance=0.1, device="cpu")


# ---- the Triton reduction (and brute-force kNN) through the interpreter -----------------

def _interp_pair(seed):
    cloud = datasets.random_subsample(datasets.load_bunny("bun000"), 300, seed=seed)
    return datasets.make_pair(cloud, 8.0, 0.01, noise=5e-4, seed=seed)


#: pairs the Triton-interpreter ICP runs cover (the GPU tests cover the compiled kernels
#: on many more)
INTERP_PAIRS = [0]
SHORT = ConvergenceCriteria(max_iterations=4, relative_fitness=0, relative_rmse=0,
                            translation_tolerance=0, rotation_tolerance=0)


def run_interpreted_icp(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): tiny ICPs with the Triton kernels."""
    from pointalign.kernels import _backend

    assert _backend.backend(torch.empty(0)) == "interpret"
    # the end-of-run stability sample's interpreted k-d tree search took ~35 s of the ~3 min
    # (the rule itself is tested in test_converged.py; the results compared here do not read it)
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(measured, "STABILITY_SAMPLE", 32)
    out = {}
    for seed in INTERP_PAIRS:  # one pair: the 6×6 Jacobi solve is slow when interpreted
        p = _interp_pair(seed)
        for m in METHODS:
            r = icp(p.source, p.target, max_correspondence_distance=0.03, method=m,
                    index=build_index(p.target, "ckdtree"), device="cpu",
                    criteria=ConvergenceCriteria(max_iterations=15))
            out[(seed, m)] = (torch.from_numpy(r.transformation), r.iterations, r.fitness)
    # the k-d tree's hinted search (the last correspondences) in the loop: slow when
    # interpreted, so one short run
    p = _interp_pair(0)
    r = icp(p.source, p.target, max_correspondence_distance=0.03,
            index=build_index(p.target, "kdtree"), device="cpu", criteria=SHORT)
    out["kdtree"] = (torch.from_numpy(r.transformation), r.iterations, r.fitness)
    torch.save(out, out_path)


interpreted = interpreted_fixture("tests.registration.test_icp", "run_interpreted_icp")


def test_interpreted_hinted_kdtree_icp_matches_torch(interpreted):
    p = _interp_pair(0)
    ref = icp(p.source, p.target, max_correspondence_distance=0.03, device="cpu",
              criteria=SHORT)
    T, iters, fit = interpreted["kdtree"]
    assert iters == ref.iterations == SHORT.max_iterations
    rot, trans = metrics.relative_error(T, ref.transformation)
    assert rot < 1e-3 and trans < 1e-5
    assert abs(fit - ref.fitness) < 1e-9


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("pseed", INTERP_PAIRS)
def test_interpreted_triton_icp_matches_torch(interpreted, pseed, method):
    p = _interp_pair(pseed)
    ref = icp(p.source, p.target, max_correspondence_distance=0.03, method=method,
              device="cpu", criteria=ConvergenceCriteria(max_iterations=15))
    T, iters, fit = interpreted[(pseed, method)]
    rot, trans = metrics.relative_error(T, ref.transformation)
    assert rot < 1e-3 and trans < 1e-5
    assert abs(fit - ref.fitness) < 1e-2


# ---- every device (CUDA: the Triton kernels) ----------------------------------------------

@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("index_method", ["auto", "brute", "grid", "kdtree"])
def test_recovers_on_device_and_matches_cpu(bunny, seed, method, index_method, device):
    # the whole scan on a GPU; the 1,500-point subsample on the CPU (same tolerances)
    cloud = datasets.load_bunny("bun000") if device == "cuda" else bunny
    p = datasets.make_pair(cloud, 10.0, 0.02, noise=5e-4, outlier_fraction=0.05, overlap=0.85,
                           seed=seed)
    try:
        ix = build_index(p.target.to(device), index_method, max_distance=0.02)
    except (ValueError, ImportError) as exc:
        pytest.skip(f"index {index_method} unavailable: {exc}")
    kw = dict(max_correspondence_distance=0.02, method=method, criteria=CRIT)
    res = icp(p.source.to(device), p.target.to(device), index=ix, init=np.eye(4),  # host init
              **kw)
    assert res.transformation_tensor.device.type == device
    rot, trans = _err(res, p.T_target_source)
    assert rot < 0.5 and trans < 2e-3, (rot, trans)
    # the same run on the CPU, plain: the devices' rounding differs, and acceleration's
    # extrapolation would carry that further along the flat valley before the relative rule
    # stops (measured 0.07° between an accelerated GPU and CPU run, 0.2° from the truth)
    plain = icp(p.source.to(device), p.target.to(device), index=ix, acceleration=False, **kw)
    cpu = icp(p.source, p.target, device="cpu", acceleration=False, **kw)
    rot, trans = metrics.relative_error(plain.transformation, cpu.transformation)
    assert rot < 0.05 and trans < 2e-4


def test_batched_equals_separate_on_device(seed, device):
    bunny = datasets.random_subsample(datasets.load_bunny("bun000"), 8000, seed=seed)
    pairs = _ragged_batch(bunny, seed)
    B = len(pairs)
    N = max(p.source.shape[0] for p in pairs)
    M = max(p.target.shape[0] for p in pairs)
    src, tgt = torch.zeros(B, N, 3), torch.zeros(B, M, 3)
    for b, p in enumerate(pairs):
        src[b, : p.source.shape[0]] = p.source
        tgt[b, : p.target.shape[0]] = p.target
    sl = torch.tensor([p.source.shape[0] for p in pairs])
    tl = torch.tensor([p.target.shape[0] for p in pairs])
    res = icp(src.to(device), tgt.to(device), source_lengths=sl, target_lengths=tl,
              max_correspondence_distance=0.02, method="point_to_plane", criteria=CRIT)
    for b, p in enumerate(pairs):
        one = icp(p.source.to(device), p.target.to(device), max_correspondence_distance=0.02,
                  method="point_to_plane", criteria=CRIT)
        np.testing.assert_allclose(res.transformation[b], one.transformation, atol=1e-5)
        assert res.iterations[b] == one.iterations


@pytest.mark.parametrize("plane", [False, True], ids=["p2p", "p2l"])
def test_host_solver_matches_estimate(bunny, seed, plane):
    """The NumPy oracle of the ICP solve (tests/_oracles.py) equals the estimate-module
    path (horn_from_moments / solve_point_to_plane on _math) and ICP's torch solve,
    including a degenerate entry."""
    from pointalign import estimate
    from pointalign.features.normals import estimate_normals
    from pointalign.kernels import normal_eq
    from tests._oracles import icp_solve_np

    g = torch.Generator().manual_seed(seed)
    T = transforms.random_transform(20.0, 0.02, generator=g).float()
    x = transforms.apply(T, bunny)[None].repeat(3, 1, 1)
    y = bunny[None].repeat(3, 1, 1)
    idx = torch.randint(-1, bunny.shape[0], (3, bunny.shape[0]), generator=g)
    idx[1] = torch.arange(bunny.shape[0])
    idx[2, 2:] = -1  # only two correspondences: degenerate
    n = estimate_normals(bunny, k=10)[None].repeat(3, 1, 1) if plane else None
    c = bunny.mean(0)[None].repeat(3, 1)
    s = normal_eq.normal_equations_reference(x, y, idx, target_normals=n, center=c)
    Dn, vn, un = icp_solve_np(s.numpy(), plane, c.double().numpy())
    if plane:
        A, g6 = normal_eq.unpack_hessian(s)
        est = estimate.solve_point_to_plane(A, g6, strict=False)
        R, t = est.transformation[:, :3, :3], est.transformation[:, :3, 3]
        valid = est.valid
    else:
        W = s[:, 0]
        Wd = W.clamp_min(1e-300)[:, None, None]
        sx, sy = s[:, 1:4], s[:, 4:7]
        m = estimate.Moments(
            W, sx, sy, s[:, 7:16].reshape(3, 3, 3),
            normal_eq.unpack_sym3(s[:, 16:22]) - sx[:, :, None] * sx[:, None, :] / Wd,
            normal_eq.unpack_sym3(s[:, 22:28]) - sy[:, :, None] * sy[:, None, :] / Wd)
        est = estimate.horn_from_moments(m, strict=False)
        R, t = est.transformation[:, :3, :3], est.transformation[:, :3, 3]
        valid = est.valid
    cd = c.double()
    D = transforms.make(R, t + cd - (R @ cd[:, :, None])[:, :, 0])
    assert un[:2].all() and un[2] == plane  # a rank-deficient 6x6 still gives a step
    np.testing.assert_array_equal(vn, valid.numpy())
    assert not vn[2] and vn[:2].all()
    np.testing.assert_allclose(Dn, D.numpy(), atol=1e-10)
    Dr, _, flags = normal_eq.solve_update_reference(s, c, torch.eye(4, dtype=torch.float64)
                                                    .expand(3, 4, 4), plane=plane)
    np.testing.assert_allclose(Dn, Dr.numpy(), atol=1e-10)
    np.testing.assert_array_equal(flags[:, 0].numpy() > 0, vn)
    if not plane:  # exact correspondences: the update undoes T
        np.testing.assert_allclose(Dn[1] @ T.double().numpy(), np.eye(4), atol=1e-5)


def test_chunked_loop_matches_max_iterations(bunny, seed):
    """The host replays the stop rules over device chunks: a fixed cap is hit exactly."""
    p = datasets.make_pair(bunny, 10.0, 0.02, noise=5e-4, seed=seed)
    crit = ConvergenceCriteria(max_iterations=13, relative_fitness=0, relative_rmse=0,
                               translation_tolerance=0, rotation_tolerance=0)
    res = icp(p.source, p.target, max_correspondence_distance=0.02, criteria=crit, device="cpu",
              acceleration=False)
    assert res.iterations == 13 and res.stop_reason == "max_iterations"
    assert len(res.history) == 14 and res.info["device_steps"] == 14
    # accelerated: the cap counts iterations, not the steps a rejected point costs
    fast = icp(p.source, p.target, max_correspondence_distance=0.02, criteria=crit,
               device="cpu")
    assert fast.iterations == 13 and fast.stop_reason == "max_iterations"
    assert len(fast.history) == 14 and fast.info["device_steps"] >= 14
    one = icp(p.source, p.target, max_correspondence_distance=0.02, device="cpu",
              criteria=ConvergenceCriteria(max_iterations=13, relative_fitness=0,
                                           relative_rmse=0, translation_tolerance=0,
                                           rotation_tolerance=0), init=np.eye(4),
              acceleration=False)
    np.testing.assert_allclose(res.transformation, one.transformation, atol=1e-12)


@backends("triton")
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("index_method", ["grid", "kdtree", "brute"])
def test_graph_matches_eager(backend, seed, method, index_method, monkeypatch):
    from pointalign.kernels import _loop

    pair = datasets.load_bunny_pair()
    s, t = pair.source.cuda(), pair.target.cuda()
    ix = build_index(t, index_method, max_distance=0.01)
    kw = dict(max_correspondence_distance=0.01, method=method, index=ix, criteria=CRIT)
    _loop.clear_caches()  # a k-d tree's graph is kept by its layout: no earlier test's
    # a short first call with an index runs eagerly, the next call captures
    monkeypatch.setattr(_loop, "EAGER_STEPS", 10**9)
    first = icp(s, t, **kw)
    assert first.info["cuda_graph"] == "first_use", first.info["cuda_graph"]
    res = icp(s, t, **kw)
    assert res.info["cuda_graph"] == "captured", res.info["cuda_graph"]
    np.testing.assert_allclose(res.transformation, first.transformation, atol=1e-6)
    monkeypatch.setattr(_loop, "USE_GRAPHS", False)
    eager = icp(s, t, **kw)
    assert eager.info["cuda_graph"] == "off"
    assert res.iterations == eager.iterations and res.stop_reason == eager.stop_reason
    np.testing.assert_allclose(res.transformation, eager.transformation, atol=1e-6)
    # a later call with the same index and sizes replays the kept graph on its own inputs
    g = torch.Generator().manual_seed(seed)
    s2 = s + 1e-3 * torch.randn(s.shape, generator=g).cuda()
    init = transforms.random_transform(3.0, 0.005, generator=g)
    eager2 = icp(s2, t, init=init, **kw)
    monkeypatch.setattr(_loop, "USE_GRAPHS", True)
    again = icp(s2, t, init=init, **kw)
    assert again.info["cuda_graph"] == "reused", again.info["cuda_graph"]
    assert again.iterations == eager2.iterations and again.stop_reason == eager2.stop_reason
    np.testing.assert_allclose(again.transformation, eager2.transformation, atol=1e-6)
    # another index over the same points: a k-d tree or brute force (its graph kept by its
    # arrays' layout) replays the kept graph with its arrays copied in; a grid captures its own
    other_ix = build_index(t, index_method, max_distance=0.01)
    other = [icp(s2, t, init=init, **dict(kw, index=other_ix)) for _ in range(2)]
    kept = index_method in ("kdtree", "brute")
    assert [o.info["cuda_graph"] for o in other] == (["reused"] * 2 if kept
                                                     else ["first_use", "captured"])
    for o in other:
        np.testing.assert_allclose(o.transformation, eager2.transformation, atol=1e-6)
    if kept:  # a tree over other points of the same count: the replay reads its arrays
        t3 = t + 2e-3 * torch.randn(t.shape, generator=g).cuda()
        ix_t3 = build_index(t3, index_method, max_distance=0.01)
        moved = icp(s2, t3, init=init, **dict(kw, index=ix_t3))
        assert moved.info["cuda_graph"] == "reused", moved.info["cuda_graph"]
        monkeypatch.setattr(_loop, "USE_GRAPHS", False)
        moved_eager = icp(s2, t3, init=init, **dict(kw, index=ix_t3))
        monkeypatch.setattr(_loop, "USE_GRAPHS", True)
        assert moved.iterations == moved_eager.iterations
        np.testing.assert_allclose(moved.transformation, moved_eager.transformation,
                                   atol=1e-6)
        assert not np.allclose(moved.transformation, eager2.transformation, atol=1e-6)
    # a long first call captures once past EAGER_STEPS steps: same result as eager
    _loop.clear_caches()
    monkeypatch.setattr(_loop, "EAGER_STEPS", 3)
    crit = ConvergenceCriteria(max_iterations=20, relative_fitness=0, relative_rmse=0,
                               translation_tolerance=0, rotation_tolerance=0)
    ix3 = build_index(t, index_method, max_distance=0.01)
    long = icp(s2, t, init=init, **dict(kw, index=ix3, criteria=crit))
    assert long.info["cuda_graph"] == "captured", long.info["cuda_graph"]
    monkeypatch.setattr(_loop, "USE_GRAPHS", False)
    long_eager = icp(s2, t, init=init, **dict(kw, index=ix3, criteria=crit))
    np.testing.assert_allclose(long.transformation, long_eager.transformation, atol=1e-6)


# ---- point-to-point's stability check, batched -------------------------------------------

def _point_information_per_problem(pair, b, index, T, max_distance):
    """The per-problem form the batched ``point_information`` replaced (the reference)."""
    from pointalign import _validate
    from pointalign.kernels import features

    n, m = int(pair.source_counts[b]), int(pair.target_counts[b])
    rows = torch.randint(n, (min(n, measured.STABILITY_SAMPLE),),
                         generator=torch.Generator().manual_seed(0))
    x = pair.source[b, rows.to(pair.source.device)]
    Tf = torch.from_numpy(T).to(device=x.device, dtype=torch.float32)
    with _validate.trusted():
        q = x @ Tf[:3, :3].T + Tf[:3, 3]
        j = index.nearest_within(q, max_distance).idx[:, 0]
        tgt = pair.target[b, :m]
        y = tgt[j.clamp_min(0)]
        nb = index.knn(y, min(measured.STABILITY_K, m)).idx
    normal = features.pca_normals(tgt, nb, centers=y).to(torch.float64)
    c = torch.from_numpy(pair.centroid[b]).to(x.device)
    J = torch.cat([torch.linalg.cross(y.to(torch.float64) - c, normal), normal], -1)
    J = J * (j >= 0)[:, None]
    return (J.T @ J).cpu(), q


def _stability_inputs(bunny, seed, shared, device):
    from pointalign.registration import _edge

    g = torch.Generator().manual_seed(seed)
    if shared:
        src = torch.stack([datasets.make_pair(bunny, 5.0, 0.003, noise=5e-4,
                                              seed=seed * 10 + s).source for s in range(3)])
        pair = _edge.prepare_pair(src.to(device), bunny.to(device), init=None,
                                  device=torch.device(device))
    else:
        pairs = _ragged_batch(bunny, seed)
        # sources of 3,000 points: a sample of STABILITY_SAMPLE rows with a smaller one beside it
        pairs[0] = datasets.make_pair(datasets.random_subsample(
            datasets.load_bunny("bun000"), 3000, seed=seed), 6.0, 0.004, noise=5e-4, seed=seed)
        srcs = [p.source.to(device) for p in pairs]
        tgts = [p.target.to(device) for p in pairs]
        pair = _edge.prepare_pair(srcs, tgts, init=None, device=torch.device(device))
    idxs = icp_module._indexes(pair, None, 0.02)
    T = np.stack([transforms.random_transform(2.0, 0.002, generator=g).numpy()
                  for _ in range(pair.size)])
    return pair, idxs, T


@pytest.mark.parametrize("shared", [False, True], ids=["own_targets", "shared_target"])
def test_batched_stability_matches_per_problem(bunny, seed, shared, backend):
    """The batched point-to-point stability equals the per-problem form it replaced.

    Same sample rows, same searches (integer answers) and, where this CPU moves the sample
    bit for bit alike in the batched and the per-problem product (checked first), the
    information matrices differ only by the float64 summation order of B·S products:
    |ΔH| <= S·eps64·Σ|J Jᵀ| (S = 2,048 terms), and the stability ratio λ_min/λ_max moves
    by at most 2·|ΔH|/λ_min relative; 1e-9 is loose for both. Elsewhere the moved points
    may round differently by one float32 ulp, which moves the float32 PCA normals by
    ~1e-6 relative: 1e-4.
    """
    pair, idxs, T = _stability_inputs(bunny, seed, shared, backend.device)
    H = measured.point_information(pair, idxs, T, 0.02)
    assert H.shape == (pair.size, 6, 6) and H.dtype == torch.float64
    stab = _math.stability(H, torch.from_numpy(pair.extent)).numpy()
    got = measured.stability(pair, idxs, T, np.zeros((pair.size, 30)), False, 0.02)
    # (the rule runs on the host in NumPy: the same formula, its own eigen-solver)
    np.testing.assert_array_equal(got, _np_math.stability(H.numpy(), pair.extent))
    np.testing.assert_allclose(got, stab, rtol=1e-12, atol=1e-15)
    for b in range(pair.size):
        own = idxs[b]
        if isinstance(own, PackedIndex):  # a device batch shares one index: build b's own
            own = choose_index(pair.target[b, : pair.target_counts[b]], max_distance=0.02)
        ref, q = _point_information_per_problem(pair, b, own, T[b], 0.02)
        Tf = torch.from_numpy(T).to(device=pair.source.device, dtype=torch.float32)
        rows = measured.stability_sample(pair.source_counts, pair.source.device)[0][b]
        rows = rows[: q.shape[0]]
        # the batched product of this problem's sample, as point_information forms it
        moved = (pair.source[None, b, rows] @ Tf[b:b + 1, :3, :3].transpose(1, 2)
                 + Tf[b:b + 1, None, :3, 3])[0]
        tol = 1e-9 if torch.equal(moved, q) else 1e-4
        scale = float(ref.abs().max())
        assert float((H[b] - ref).abs().max()) <= tol * scale
        ref_stab = float(_math.stability(ref[None],
                                                    torch.tensor(pair.extent[b:b + 1]))[0])
        assert abs(stab[b] - ref_stab) <= tol * max(ref_stab, 1e-3) + 1e-15
        assert ref_stab > 0.01  # a real surface: the comparison is not between zeros


@backends("triton")
@pytest.mark.parametrize("size", [1, 3], ids=["one_problem", "shared_target"])
def test_one_index_program_equals_the_search_by_search_path(bunny, backend, size):
    """One k-d tree over one target (one problem, or a shared target): point_information's
    searches run as one program, eager at a size's first call and a CUDA graph from the
    second. Its kernels are the search-by-search path's on the same arrays, so every call
    gives that path's matrix bit for bit (the path taken when the problems' indexes are
    distinct objects over the same target), and one problem's matrix is the per-problem
    form's (to the float32 rounding of the moved sample, as above)."""
    from pointalign.kernels import _loop

    pair, _, T = _stability_inputs(bunny, 0, True, backend.device)
    if size == 1:
        from pointalign.registration import _edge

        pair = _edge.prepare_pair(pair.source[:1], pair.target[0], init=None,
                                  device=pair.device)
        T = T[:1]
    index = build_index(pair.target[0, : int(pair.target_counts[0])], "kdtree")
    idxs = (index,) * pair.size
    _loop.clear_caches()
    calls = [measured.point_information(pair, idxs, T, 0.02) for _ in range(3)]
    for got in calls[1:]:
        torch.testing.assert_close(got, calls[0], rtol=0, atol=0)
    if size == 1:
        ref, _ = _point_information_per_problem(pair, 0, index, T[0], 0.02)
        assert float((calls[0][0] - ref).abs().max()) <= 1e-4 * float(ref.abs().max())
    else:
        apart = (index,) + tuple(copy.copy(index) for _ in range(pair.size - 1))
        torch.testing.assert_close(measured.point_information(pair, apart, T, 0.02),
                                   calls[0], rtol=0, atol=0)


def test_point_to_plane_shares_its_index_with_the_normals(monkeypatch):
    """Normals to estimate: ICP asks the policy for an index that serves k-NN too, and the
    normals search a tree index over the target (given or chosen) instead of building
    their own; given normals, or point-to-point: no such request."""
    from pointalign.features import normals as normals_module
    from pointalign.search import policy

    asked, searched = [], []
    choose, estimate = policy.choose_index, normals_module.estimate_normals

    def spy_choose(*args, **kwargs):
        asked.append(kwargs.get("knn"))
        return choose(*args, **kwargs)

    def spy_estimate(*args, **kwargs):
        searched.append(kwargs.get("index"))
        return estimate(*args, **kwargs)

    monkeypatch.setattr(policy, "choose_index", spy_choose)
    monkeypatch.setattr(normals_module, "estimate_normals", spy_estimate)
    src = datasets.random_subsample(datasets.load_bunny("bun045"), 1500, seed=3)
    tgt = datasets.random_subsample(datasets.load_bunny("bun000"), 1500, seed=4)
    icp(src, tgt, max_correspondence_distance=0.05, method="point_to_plane")
    icp(src, tgt, max_correspondence_distance=0.05, method="point_to_point")
    given = normals_module.estimate_normals(tgt, k=10)
    icp(src, tgt, max_correspondence_distance=0.05, method="point_to_plane",
        target_normals=given)
    assert asked == [True, False, False]
    tree = build_index(tgt, "kdtree")
    icp(src, tgt, max_correspondence_distance=0.05, method="point_to_plane", index=tree)
    assert searched[-1].index is tree  # the caller's tree, searched from the centred frame
    brute = build_index(tgt, "brute")
    icp(src, tgt, max_correspondence_distance=0.05, method="point_to_plane", index=brute)
    assert searched[-1] is None  # N x M: the normals build their own search


def test_rules_guess_whether_a_run_goes_on():
    """``_Rules.continues``: a chunk whose last update still moves and whose fitness or RMSE
    still changes goes on; a small update, no correspondences, a degenerate update or flat
    fitness and RMSE may stop; stopped problems do not count."""
    crit = ConvergenceCriteria()
    rules = icp_module._Rules(crit, np.array([100.0, 100.0]), np.tile(np.eye(4), (2, 1, 1)),
                              np.array([1e-4, 1e-4]))

    def rec(count, sq, angle, shift, usable=1):
        sums = np.zeros((2, 30))
        sums[:, 28], sums[:, 29] = count, sq
        D = np.tile(np.eye(4), (2, 1, 1))
        c, s_ = np.cos(angle), np.sin(angle)
        D[:, :2, :2] = [[c, -s_], [s_, c]]
        D[:, 0, 3] = shift
        return {"sums": sums, "update": D, "flags": np.array([[1, usable]] * 2)}

    moving = (rec(80, 8.0, 0.0, 0.0), rec(90, 7.0, 0.01, 1e-2))
    assert rules.continues(*moving)
    assert not rules.continues(moving[0], rec(90, 7.0, 0.0, 1e-6))       # small update
    assert not rules.continues(moving[0], rec(0, 0.0, 0.01, 1e-2))       # no partners
    assert not rules.continues(moving[0], rec(90, 7.0, 0.01, 1e-2, 0))   # degenerate
    assert not rules.continues(rec(90, 7.0, 0.0, 0.0), rec(90, 7.0, 0.01, 1e-2))  # flat
    rules.active[:] = [False, True]  # a stopped problem does not count
    assert rules.continues(moving[0], {**moving[1], "sums": np.where(
        np.arange(2)[:, None] == 0, 0.0, moving[1]["sums"])})
    rules.active[:] = False
    assert not rules.continues(*moving)  # nothing left to run


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["point_to_point", "point_to_plane"])
def test_deferred_host_part_on_cuda(bunny, method):
    """On CUDA the pair's host part is read once the index, the normals and the first steps
    are enqueued: a NaN or Inf point still raises the scans' error, a length 1000x off the
    clouds' scale the units error, the inputs stay, and the next call is sound."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run with -m gpu on the device)")
    p = datasets.make_pair(bunny, 5.0, 0.0, seed=0)
    s, t = p.source.cuda(), p.target.cuda()
    assert_scans_raise(lambda a, b: icp(a, b, max_correspondence_distance=0.05,
                                        method=method), s, t)
    with pytest.raises(ValueError, match="max_correspondence_distance"):
        icp(s, t, max_correspondence_distance=1e4, method=method)
    res = icp(s, t, max_correspondence_distance=0.05, method=method)
    assert res.converged
    rot, _ = metrics.relative_error(res.transformation, p.T_target_source)
    assert rot < 1.0
