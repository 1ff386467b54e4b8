"""GICP and VGICP: recovery of 30° with noise, outliers and a crop on the bunny on every
backend, batched == one by one, given == estimated covariances, the information matrix vs an
oracle, stop reasons, bad input, the Triton kernels (interpreted) and CUDA.

Tolerances (rotation error = angle of inv(T_true) T_est, translation = ||t_est − t_true||):
the bunny (~0.15 m across) subsampled to 1,500 points, noise σ = 0.5 mm, 5 % outliers, 85 %
overlap, 30° and 20 mm: < 0.5° and < 1.5 mm (measured: GICP 0.1-0.25°, VGICP 0.15-0.35°,
both < 0.6 mm).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from scipy.spatial import cKDTree

from pointalign import datasets, metrics
from pointalign.cloud import PointCloud
from pointalign.features.covariances import estimate_covariances
from pointalign.kernels.gicp import reference as ref
from pointalign.registration.criteria import ConvergenceCriteria, RobustKernel
from pointalign.registration.gicp import gicp, vgicp
from pointalign.registration.icp import icp
from pointalign.search import build_index
from tests._interpreted import interpreted_fixture
from tests.registration._deferred import assert_scans_raise

METHODS = ["gicp", "vgicp"]
#: VGICP from 30°: a coarse level (4 cm voxels, 7 cells) widens the basin, 1 cm sets the
#: accuracy (one 1 cm level alone recovers up to ~20° here)
VOXELS = (0.04, 0.01)


@pytest.fixture(scope="module")
def bunny():
    return datasets.random_subsample(datasets.load_bunny("bun000"), 1500, seed=7)


def _run(method, source, target, *, distance=0.05, voxels=VOXELS, neighborhood=7, **kw):
    """``gicp`` (with ``distance``) or ``vgicp`` (with ``voxels`` and ``neighborhood``)."""
    if method == "gicp":
        return gicp(source, target, max_correspondence_distance=distance, **kw)
    return vgicp(source, target, voxel_size=voxels, neighborhood=neighborhood, **kw)


@pytest.mark.parametrize("method", METHODS)
def test_recovers_30deg_noise_outliers_crop(backend, bunny, seed, method):
    p = datasets.make_pair(bunny, 30.0, 0.02, noise=5e-4, outlier_fraction=0.05,
                           overlap=0.85, seed=seed)
    dev = backend.device
    res = _run(method, p.source.to(dev), p.target.to(dev), device=dev)
    rot, trans = metrics.relative_error(res.transformation, p.T_target_source)
    assert rot < 0.5 and trans < 1.5e-3, (rot, trans, res.summary())
    assert res.converged and res.stop_reason in ("relative_change", "small_update")
    assert 0.8 < res.fitness <= 1.0 and res.rmse < 1e-2  # (outliers within 5 cm count)
    assert res.info["H"].shape == (6, 6) and res.info["method"] == method
    assert res.info["stability"] > 0.01
    assert res.history[0]["iteration"] == 0
    assert {"covariances", "iterate", "total"} <= set(res.timings)


def _ragged(bunny, seed):
    return [datasets.make_pair(datasets.random_subsample(bunny, m, seed=s), 10.0, 0.01,
                               noise=5e-4, overlap=ov, seed=seed * 10 + s)
            for s, (m, ov) in enumerate([(700, 1.0), (601, 0.8), (503, 0.9)])]


# ---- the LiDAR pairs (../shared/data/lidar), full resolution, from the identity ------


def _lidar(shared_data, name):
    """``(source, target, reference T_target_source)`` of a LiDAR pair, or skip."""
    from pointalign import io

    d = shared_data / "lidar" / name
    if name == "kitti_00":
        if not (d / "000000_xyz.bin").is_file():
            pytest.skip("the KITTI pair is not in the shared data")

        def scan(i):
            return torch.from_numpy(np.fromfile(d / f"00000{i}_xyz.bin", dtype=np.float32)
                                    .reshape(-1, 3).copy())

        return scan(1), scan(0), np.loadtxt(d / "gt_T_velo0_from_velo1.txt")
    if not (d / "251370668.pcd").is_file():
        pytest.skip("the fast_gicp pair is not in the shared data")
    return (io.read(d / "251371071.pcd").points.float(),
            io.read(d / "251370668.pcd").points.float(), np.loadtxt(d / "relative.txt"))


def _inliers(T, source, target, within=0.2):
    """Open3D's fitness and inlier RMSE of ``T @ source`` against ``target`` at ``within``
    metres (SciPy's k-d tree, float64)."""
    moved = source.double().numpy() @ T[:3, :3].T + T[:3, 3]
    d, _ = cKDTree(target.double().numpy()).query(moved, 1, distance_upper_bound=within)
    ok = np.isfinite(d)
    return float(ok.mean()), float(np.sqrt((d[ok] ** 2).mean()))


@pytest.mark.parametrize("method", METHODS)
def test_fast_gicp_pair_within_2cm_and_a_quarter_degree(shared_data, method):
    """The issue's bar for the LiDAR pairs, on the one whose reference holds to millimetres
    (~120k points a scan, 1 m; BENCHMARKS: GICP 0.04° / 5 mm, VGICP 0.15° / 6 mm)."""
    source, target, truth = _lidar(shared_data, "fast_gicp_pair")
    res = (gicp(source, target, max_correspondence_distance=1.0, device="cpu")
           if method == "gicp" else vgicp(source, target, voxel_size=1.0, device="cpu"))
    rot, tr = metrics.relative_error(res.transformation, truth)
    assert res.converged and rot < 0.25 and tr < 0.02, (rot, tr)


def test_kitti_pair_fits_the_scans_better_than_its_reference(shared_data):
    """The KITTI pair's reference (odometry poses 0 and 1 with the velodyne calibration)
    lands 18-19 cm from every GICP's, small_gicp's and Open3D's included (BENCHMARKS), so
    the 2 cm bar cannot be read there; the scans side with GICP: under its transform more
    source points have a target point within 20 cm, and nearer (measured: fitness 0.894
    against 0.865, inlier RMSE 75 against 93 mm; the identity: 0.689). A median
    point-to-plane distance does not decide it: motion along the road and the walls hardly
    changes it (the identity scores lowest)."""
    source, target, truth = _lidar(shared_data, "kitti_00")
    res = gicp(source, target, max_correspondence_distance=1.0, device="cpu")
    fit, rmse = _inliers(np.asarray(res.transformation), source, target)
    ref_fit, ref_rmse = _inliers(truth, source, target)
    assert res.converged and fit > ref_fit + 0.01 and rmse < 0.9 * ref_rmse, \
        (fit, rmse, ref_fit, ref_rmse)


@pytest.mark.parametrize("method", METHODS)
def test_batched_equals_separate(bunny, seed, method):
    pairs = _ragged(bunny, seed)
    B = len(pairs)
    N = max(p.source.shape[0] for p in pairs)
    M = max(p.target.shape[0] for p in pairs)
    src, tgt = torch.full((B, N, 3), 7.0), torch.full((B, M, 3), -7.0)
    for b, p in enumerate(pairs):
        src[b, : p.source.shape[0]] = p.source
        tgt[b, : p.target.shape[0]] = p.target
    sl = torch.tensor([p.source.shape[0] for p in pairs])
    tl = torch.tensor([p.target.shape[0] for p in pairs])
    crit = ConvergenceCriteria(max_iterations=25)
    kw = {"voxels": 0.015, "neighborhood": 1} if method == "vgicp" else {"distance": 0.02}
    res = _run(method, src, tgt, source_lengths=sl, target_lengths=tl, criteria=crit,
               device="cpu", **kw)
    assert res.batched and res.transformation.shape == (B, 4, 4)
    for b, p in enumerate(pairs):
        one = _run(method, p.source, p.target, criteria=crit, device="cpu", **kw)
        # the same kernels on the same rows; only the float64 block sums are split by the
        # padded size (relative ~1e-13), far below the tolerances
        np.testing.assert_allclose(res.transformation[b], one.transformation, atol=1e-6)
        assert res.iterations[b] == one.iterations
        assert res.stop_reason[b] == one.stop_reason
        assert abs(res.fitness[b] - one.fitness) < 1e-9
        np.testing.assert_allclose(res[b].info["H"], one.info["H"], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("method", METHODS)
def test_shared_target(bunny, method):
    pairs = [datasets.make_pair(bunny, 8.0, 0.01, noise=5e-4, seed=s) for s in range(2)]
    res = _run(method, torch.stack([p.source for p in pairs]), bunny, device="cpu")
    for b, p in enumerate(pairs):
        rot, trans = metrics.relative_error(res.transformation[b], p.T_target_source)
        assert rot < 0.5 and trans < 1.5e-3


def test_given_covariances_and_pointcloud_equal_estimated(bunny):
    p = datasets.make_pair(bunny, 10.0, 0.01, noise=5e-4, seed=1)
    est = gicp(p.source, p.target, max_correspondence_distance=0.03, device="cpu")
    cs, ct = estimate_covariances(p.source, k=20), estimate_covariances(p.target, k=20)
    given = gicp(p.source, p.target, max_correspondence_distance=0.03, device="cpu",
                 source_covariances=cs, target_covariances=ct)
    # (estimated here from the float32 points of the centred frame: ~1e-7 apart)
    np.testing.assert_allclose(given.transformation, est.transformation, atol=1e-6)
    clouds = gicp(PointCloud(p.source, covariances=cs), PointCloud(p.target, covariances=ct),
                  max_correspondence_distance=0.03, device="cpu")
    np.testing.assert_array_equal(clouds.transformation, given.transformation)
    # NumPy float64 in, a caller's index, k: the same problem
    ix = build_index(p.target.double())
    other = gicp(p.source.double().numpy(), p.target.double().numpy(), index=ix,
                 max_correspondence_distance=0.03, device="cpu", k=15)
    rot, trans = metrics.relative_error(other.transformation, p.T_target_source)
    assert rot < 0.5 and trans < 1.5e-3 and other.info["index"] == type(ix).__name__


@pytest.mark.parametrize("method", ["gicp", "icp point_to_plane"])
def test_callers_index_far_from_the_origin(bunny, device, method):
    """A caller's index holds the target as given, 36 m from the origin here: it is searched
    from the centred frame (search/shifted.py), so the result is the centred one's, and
    converges (solved in the caller's coordinates, the float32 sums lost the rotational
    information: 4.5 m off after one step, stability 0; summed about the centroid, the
    updates never settled below float32's spacing there: the iteration cap)."""
    p = datasets.make_pair(bunny, 10.0, 0.01, noise=5e-4, seed=3)
    off = torch.tensor([30.0, -20.0, 5.0])
    s, t = (p.source + off).to(device), (p.target + off).to(device)
    if method == "gicp":
        run = functools.partial(gicp, s, t, max_correspondence_distance=0.03, device=device)
    else:
        run = functools.partial(icp, s, t, max_correspondence_distance=0.03, device=device,
                                method="point_to_plane")
    ix = build_index(t)
    centred, given = run(), run(index=ix)
    c = np.append(t.double().mean(0).cpu().numpy(), 1.0)
    rot, _ = metrics.relative_error(given.transformation, centred.transformation)
    moved = (given.transformation @ c - centred.transformation @ c)[:3]
    assert rot < 1e-2 and np.linalg.norm(moved) < 1e-4, (rot, moved)
    assert given.converged and centred.converged, (given.stop_reason, centred.stop_reason)
    assert 1 < given.iterations < 30 and given.info["index"] == type(ix).__name__
    np.testing.assert_allclose(given.info["stability"], centred.info["stability"], rtol=2e-2)
    np.testing.assert_allclose(given.info["H"], centred.info["H"], rtol=0, atol=1e-3 * np.abs(
        centred.info["H"]).max())


def test_information_matrix_matches_oracle(bunny):
    p = datasets.make_pair(bunny, 10.0, 0.01, noise=5e-4, seed=2)
    md = 0.02
    res = gicp(p.source, p.target, max_correspondence_distance=md, device="cpu")
    T = res.transformation
    src, tgt = p.source.double().numpy(), p.target.double().numpy()
    cs = estimate_covariances(p.source.double(), k=20).numpy()
    ct = estimate_covariances(p.target.double(), k=20).numpy()
    x = src @ T[:3, :3].T + T[:3, 3]
    d, j = cKDTree(tgt).query(x, distance_upper_bound=md)
    H = np.zeros((6, 6))
    R = T[:3, :3]
    for i in np.nonzero(np.isfinite(d))[0]:
        M = np.linalg.inv(ct[j[i]] + R @ cs[i] @ R.T)
        xi = x[i]
        J = np.hstack([-np.array([[0, -xi[2], xi[1]], [xi[2], 0, -xi[0]],
                                  [-xi[1], xi[0], 0]]), np.eye(3)])
        H += J.T @ M @ J
    # float32 coordinates and covariances in the kernels: relative ~1e-5 of the entries
    np.testing.assert_allclose(res.info["H"], H, rtol=1e-4, atol=1e-4 * np.abs(H).max())
    assert np.isfinite(res.rmse) and abs(res.fitness - np.isfinite(d).mean()) < 1e-2


@pytest.mark.parametrize("method", METHODS)
def test_robust_kernel_with_many_outliers(bunny, method):
    p = datasets.make_pair(bunny, 10.0, 0.01, noise=5e-4, outlier_fraction=0.3, seed=4)
    res = _run(method, p.source, p.target, device="cpu",
               robust_kernel=RobustKernel("tukey", 0.005))
    rot, trans = metrics.relative_error(res.transformation, p.T_target_source)
    assert rot < 0.5 and trans < 1.5e-3


def test_no_correspondences_and_plane(rng):
    far = torch.rand(200, 3, generator=rng) + 10.0
    near = torch.rand(200, 3, generator=rng)
    for method in METHODS:
        res = _run(method, far, near, device="cpu", voxels=0.1, neighborhood=1)
        assert res.stop_reason == "no_correspondences" and not res.converged
        np.testing.assert_array_equal(res.transformation, np.eye(4))
    # a plane registered to a shifted copy: the in-plane slide is not determined
    xy = torch.rand(400, 2, generator=rng, dtype=torch.float64)
    plane = torch.cat([xy, torch.zeros(400, 1, dtype=torch.float64)], 1)
    res = gicp(plane + torch.tensor([0.01, 0.02, 0.003], dtype=torch.float64), plane,
               max_correspondence_distance=0.1, device="cpu")
    assert res.stop_reason == "ambiguous" and not res.converged
    assert res.info["stability"] < 0.01
    assert abs(res.transformation[2, 3] + 0.003) < 1e-6  # the normal direction is found


@pytest.mark.gpu
def test_nan_input_raises_on_cuda(bunny):
    """On CUDA the pair's host part is read after the covariances and the index are
    enqueued: a NaN or Inf point still raises the scans' error, and the inputs stay."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run with -m gpu on the device)")
    p = datasets.make_pair(bunny, 5.0, 0.0, seed=0)
    s, t = p.source.cuda(), p.target.cuda()
    assert_scans_raise(lambda a, b: gicp(a, b, max_correspondence_distance=0.05), s, t)
    res = gicp(s, t, max_correspondence_distance=0.05)  # and the next call is sound
    assert res.converged


def test_bad_input(bunny):
    p = datasets.make_pair(bunny, 5.0, 0.0, seed=0)
    s, t = p.source, p.target
    for method in METHODS:
        with pytest.raises(ValueError, match="empty"):
            _run(method, torch.zeros(0, 3), t, device="cpu")
        nan = s.clone()
        nan[3, 0] = float("nan")
        with pytest.raises(ValueError, match="NaN"):
            _run(method, nan, t, device="cpu")
        with pytest.raises(ValueError, match="fewer than k"):
            _run(method, s[:10], t, device="cpu")
        with pytest.raises(ValueError, match="fewer than k"):
            _run(method, s, t[:15], device="cpu")
        with pytest.raises(ValueError, match="k"):
            _run(method, s, t, device="cpu", k=2)
        with pytest.raises(ValueError, match="source_covariances"):
            _run(method, s, t, device="cpu", source_covariances=torch.eye(3).repeat(5, 1, 1))
        bad = torch.eye(3).repeat(t.shape[0], 1, 1)
        bad[0, 0, 0] = float("inf")
        with pytest.raises(ValueError, match="target_covariances"):
            _run(method, s, t, device="cpu", target_covariances=bad)
        with pytest.raises(ValueError, match="devices|meta"):
            _run(method, s, t, source_covariances=torch.eye(3, device="meta")
                 .repeat(s.shape[0], 1, 1))
        with pytest.raises(TypeError, match="robust_kernel"):
            _run(method, s, t, device="cpu", robust_kernel=3.0)  # ("huber": accepted)
        with pytest.raises(TypeError, match="criteria"):
            _run(method, s, t, device="cpu", criteria={"max_iterations": 3})
    with pytest.raises(ValueError, match="max_correspondence_distance"):
        gicp(s, t, max_correspondence_distance=0.0, device="cpu")
    with pytest.raises(TypeError, match="acceleration"):
        gicp(s, t, max_correspondence_distance=0.01, device="cpu", acceleration=None)
    with pytest.raises(ValueError, match="voxel_size"):
        vgicp(s, t, voxel_size=-1.0, device="cpu")
    with pytest.raises(ValueError, match="voxel_size"):
        vgicp(s, t, voxel_size=[], device="cpu")
    with pytest.raises(ValueError, match="neighborhood"):
        vgicp(s, t, voxel_size=0.01, neighborhood=8, device="cpu")


# ---- Triton through the interpreter (child process, tiny sizes) --------------------------

#: two iterations: the interpreted 6×6 Jacobi solve (normal_eq's, tested there) costs ~1 s
SHORT = ConvergenceCriteria(max_iterations=2)


def _interp_pair():
    cloud = datasets.random_subsample(datasets.load_bunny("bun000"), 250, seed=0)
    return datasets.make_pair(cloud, 8.0, 0.01, noise=5e-4, seed=0)


def run_interpreted_gicp(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): tiny GICP and VGICP with the Triton kernels."""
    from pointalign.kernels import _backend

    assert _backend.backend(torch.empty(0)) == "interpret"
    p = _interp_pair()
    out = {}
    for method in METHODS:
        r = _run(method, p.source, p.target, device="cpu", criteria=SHORT, voxels=0.02)
        out[method] = (torch.from_numpy(r.transformation), r.iterations, r.fitness)
    torch.save(out, out_path)


interpreted = interpreted_fixture("tests.registration.test_gicp", "run_interpreted_gicp")


@pytest.mark.parametrize("method", METHODS)
def test_interpreted_triton_matches_torch(interpreted, method, monkeypatch):
    monkeypatch.setenv("POINTALIGN_BACKEND", "torch")
    p = _interp_pair()
    want = _run(method, p.source, p.target, device="cpu", criteria=SHORT, voxels=0.02)
    T, iters, fit = interpreted[method]
    # float32 block sums (Triton) against float64 (reference): the poses agree to ~1e-6
    rot, trans = metrics.relative_error(T, want.transformation)
    assert rot < 1e-3 and trans < 1e-5, (rot, trans)
    assert iters == want.iterations and abs(fit - want.fitness) < 1e-2


# ---- CUDA ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
def test_cuda_matches_cpu_full_bunny(seed, method):
    full = datasets.load_bunny("bun000")
    p = datasets.make_pair(full, 30.0, 0.02, noise=5e-4, outlier_fraction=0.05, overlap=0.85,
                           seed=seed)
    gpu = _run(method, p.source.cuda(), p.target.cuda())
    cpu = _run(method, p.source, p.target, device="cpu")
    for r in (gpu, cpu):
        rot, trans = metrics.relative_error(r.transformation, p.T_target_source)
        assert rot < 0.5 and trans < 1.5e-3, (rot, trans, r.summary())
    rot, trans = metrics.relative_error(gpu.transformation, cpu.transformation)
    assert rot < 0.02 and trans < 5e-5
    assert gpu.transformation_tensor.is_cuda


@pytest.mark.gpu
def test_cuda_batched_and_mismatched_devices(bunny):
    pairs = _ragged(bunny, 0)
    src = [p.source.cuda() for p in pairs]
    tgt = [p.target.cuda() for p in pairs]
    res = gicp(src, tgt, max_correspondence_distance=0.02)
    for b, p in enumerate(pairs):
        rot, trans = metrics.relative_error(res.transformation[b], p.T_target_source)
        assert rot < 0.5 and trans < 1.5e-3
    with pytest.raises(ValueError, match="devices"):
        gicp(pairs[0].source.cuda(), pairs[0].target, max_correspondence_distance=0.02)
    with pytest.raises(ValueError, match="devices"):
        vgicp(pairs[0].source.cuda(), pairs[0].target.cuda(), voxel_size=0.01,
              target_covariances=estimate_covariances(pairs[0].target))


@pytest.mark.gpu
def test_cuda_covariances_beside_the_index_give_the_same_bits(bunny, monkeypatch):
    """GICP's source covariances run on a second stream beside the target's index and
    covariances (kernels._loop.Beside): the same kernels on the same inputs as inline, and
    deterministic ones (no atomics): the same bits."""
    from pointalign.kernels import _loop

    p = datasets.make_pair(bunny, 20.0, 0.02, noise=5e-4, seed=3)
    src, tgt = p.source.cuda(), p.target.cuda()
    runs = {}
    for concurrent in (True, False, True):
        monkeypatch.setattr(_loop, "CONCURRENT", concurrent)
        runs.setdefault(concurrent, []).append(_run("gicp", src, tgt))
    for r in runs[True][1:] + runs[False]:
        assert r.iterations == runs[True][0].iterations
        np.testing.assert_array_equal(r.transformation, runs[True][0].transformation)
        assert r.timings["covariances"] > 0


def test_reference_constants_are_the_documented_ones():
    assert ref.PLANE_EPS == 1e-3 and ref.ROBUST_SCALE2 == 2e-3 and ref.NEIGHBORHOODS == (1, 7,
                                                                                         27)


def test_gicp_asks_for_an_index_its_covariances_can_share(bunny, monkeypatch):
    """The target's k-NN (its covariances) may search the correspondence index: GICP says so
    to the index policy unless the target's covariances are given or kept with it."""
    from pointalign.search import policy

    asked = []
    choose = policy.choose_index

    def spy(*args, **kwargs):
        asked.append(kwargs.get("knn"))
        return choose(*args, **kwargs)

    monkeypatch.setattr(policy, "choose_index", spy)
    src, tgt = bunny, datasets.random_subsample(datasets.load_bunny("bun045"), 1500, seed=8)
    gicp(src, tgt, max_correspondence_distance=0.05)
    cov = estimate_covariances(tgt, 20)
    gicp(src, tgt, max_correspondence_distance=0.05, target_covariances=cov)
    gicp(src, PointCloud(tgt, covariances=cov), max_correspondence_distance=0.05)
    gicp(src, PointCloud(tgt), max_correspondence_distance=0.05)
    assert asked == [True, False, False, True]


def test_cpu_fused_step_equals_the_separate_passes(bunny, monkeypatch):
    """gicp() on the CPU with its one-pass step gives the result of move, search and sums
    run separately: the same bits, iterations and stop."""
    from pointalign.registration import gicp as gicp_module

    pair = datasets.make_pair(bunny, 12.0, 0.01, noise=5e-4, overlap=0.9, seed=3)
    calls = []
    real = gicp_module._kg.gicp_step_cpu
    monkeypatch.setattr(gicp_module._kg, "gicp_step_cpu",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    fused = gicp(pair.source, pair.target, max_correspondence_distance=0.02, device="cpu")
    assert len(calls) >= fused.iterations  # every iteration (and any launched ahead)
    monkeypatch.setattr(gicp_module.GicpStep, "_host_tree", lambda self: None)
    separate = gicp(pair.source, pair.target, max_correspondence_distance=0.02, device="cpu")
    assert np.array_equal(fused.transformation, separate.transformation)
    assert fused.iterations == separate.iterations and fused.stop_reason == separate.stop_reason
    assert np.array_equal(fused.info["H"], separate.info["H"])
