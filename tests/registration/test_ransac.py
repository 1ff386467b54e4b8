import math

import numpy as np
import pytest
import torch

from pointalign import datasets, transforms
from pointalign.features.downsample import voxel_downsample
from pointalign.features.fpfh import fpfh
from pointalign.registration.ransac import feature_correspondences, ransac, required_hypotheses

V = 0.005


@pytest.fixture(scope="module")
def bunny_features():
    """bun045 -> bun000 downsampled at 5 mm (~1.3k points each) with FPFH at 5 voxels."""
    pair = datasets.load_bunny_pair()
    s, t = voxel_downsample(pair.source, V), voxel_downsample(pair.target, V)
    return (s, t, fpfh(s, radius=5 * V), fpfh(t, radius=5 * V),
            torch.as_tensor(pair.T_target_source))


def _random_pose(seed):
    g = torch.Generator().manual_seed(seed)
    R = transforms.random_rotation(generator=g, dtype=torch.float64).reshape(3, 3)
    return transforms.make(R, 0.3 * torch.randn(3, generator=g, dtype=torch.float64))


def _point_error(T_est, T_true, pts):
    """Rotation error (degrees) and RMS displacement of the points between two transforms."""
    T_est = torch.as_tensor(T_est, dtype=torch.float64)
    E = transforms.invert(T_true) @ T_est
    rot = math.degrees(float(transforms.rotation_angle(E[:3, :3])))
    p = pts.double()
    disp = (transforms.apply(T_est, p) - transforms.apply(T_true, p)).norm(dim=1)
    return rot, float(disp.square().mean().sqrt())


def test_recovers_random_pose_on_bunny(bunny_features, seed):
    s, t, fs, ft, T_ts = bunny_features
    P = _random_pose(seed)  # any rotation; features are invariant, so fs stays valid
    s2 = transforms.apply(P, s.double()).float()
    T_true = T_ts @ transforms.invert(P)
    r = ransac(s2, t, source_features=fs, target_features=ft,
               max_correspondence_distance=1.5 * V, hypotheses=4096, seed=seed)
    assert r.converged and r.stop_reason in ("confidence", "max_hypotheses")
    rot, disp = _point_error(r.transformation, T_true, s2)
    # a coarse global pose (ICP refines it): Open3D's RANSAC is 4.5 deg off on this pair
    assert rot < 10.0 and disp < 0.01
    assert r.fitness > 0.8 and r.rmse < 1.5 * V
    info = r.info
    assert info["hypotheses"] == r.iterations >= 4096
    assert info["hypotheses"] >= info["after_triangle"] >= info["after_estimation"] \
        >= info["after_tdd"] >= info["validated"] >= 1
    assert info["after_triangle"] < info["hypotheses"]
    assert {"correspondences", "sample", "hypotheses", "total"} <= set(r.timings)


def test_swapping_source_and_target_gives_the_inverse(bunny_features):
    s, t, fs, ft, T_ts = bunny_features
    r = ransac(t, s, source_features=ft, target_features=fs,
               max_correspondence_distance=1.5 * V, hypotheses=4096, seed=1)
    rot, disp = _point_error(r.transformation, transforms.invert(T_ts), t)
    assert rot < 10.0 and disp < 0.01


def test_same_seed_same_result(bunny_features):
    s, t, fs, ft, _ = bunny_features
    kw = dict(source_features=fs, target_features=ft, max_correspondence_distance=1.5 * V,
              hypotheses=2048, seed=7)
    a, b = ransac(s, t, **kw), ransac(s, t, **kw)
    assert np.array_equal(a.transformation, b.transformation)
    assert a.info == b.info and a.fitness == b.fitness


def test_a_batch_of_every_hypothesis_masked_equals_the_compacted_one(bunny_features,
                                                                      monkeypatch):
    """A device keeps every hypothesis's row and masks the failures (no compaction, no host
    read); in host memory the survivors alone. Forced to keep every row here, the batch
    program gives the compacted run's pose, counts and pool, batch after batch."""
    from pointalign.kernels import ransac as _k

    s, t, fs, ft, _ = bunny_features
    kw = dict(source_features=fs, target_features=ft, max_correspondence_distance=1.5 * V,
              hypotheses=64, max_hypotheses=512, confidence=1 - 1e-12, seed=3)
    compacted = ransac(s, t, **kw)
    rows = _k.triangle_motions

    def every_row(*args, compact=None):
        est = rows(*args, compact=False)
        assert est.T.shape[0] == args[2].shape[0]  # (H, 4, 4): nothing dropped
        return est

    monkeypatch.setattr(_k, "triangle_motions", every_row)
    masked = ransac(s, t, **kw)
    assert compacted.info["batches"] > 1  # the pool carried from batch to batch
    assert np.array_equal(masked.transformation, compacted.transformation)
    assert masked.info == compacted.info and masked.fitness == compacted.fitness


def test_inputs_untouched_and_numpy_accepted(bunny_features):
    s, t, fs, ft, T_ts = bunny_features
    s0, fs0 = s.clone(), fs.clone()
    r = ransac(s.numpy(), t.numpy(), source_features=fs.numpy(), target_features=ft.numpy(),
               max_correspondence_distance=1.5 * V, hypotheses=2048, seed=0)
    assert torch.equal(s, s0) and torch.equal(fs, fs0)
    assert r.transformation.shape == (4, 4) and r.transformation.dtype == np.float64


def test_threshold_not_reached_says_so(bunny_features):
    s, t, fs, ft, _ = bunny_features
    r = ransac(s, t, source_features=fs, target_features=ft, max_correspondence_distance=1e-4,
               hypotheses=1024, max_hypotheses=1024, inlier_ratio_threshold=0.9,
               local_refinement=False)
    assert not r.converged
    assert r.stop_reason in ("below_threshold", "no_hypothesis")


def test_no_hypothesis_surviving_is_a_failed_result(bunny_features):
    s, t, fs, ft, _ = bunny_features
    r = ransac(s, t, source_features=fs, target_features=ft, max_correspondence_distance=0.01,
               hypotheses=512, max_hypotheses=512, triangle_similarity=1e-12)
    assert not r.converged and r.stop_reason == "no_hypothesis"
    assert np.array_equal(r.transformation, np.eye(4)) and r.fitness == 0.0
    assert r.info["after_triangle"] == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_too_few_correspondences_is_a_failed_result(device):
    """The count comes back with the first batch (it stays on the device until then): the
    failed result counts no hypothesis and no batch, and says how many correspondences."""
    g = torch.Generator().manual_seed(0)
    pts = torch.rand(5, 3, generator=g).to(device)
    # every source feature is nearest to target 0, whose nearest source is 0: one mutual pair
    fs = torch.zeros(5, 4, device=device)
    ft = torch.cat([torch.zeros(1, 4), torch.full((4, 4), 10.0)]).to(device)
    r = ransac(pts, pts, source_features=fs, target_features=ft, max_correspondence_distance=0.1,
               mutual=True)
    assert not r.converged and r.stop_reason == "too_few_correspondences"
    assert r.info["correspondences"] == 1
    assert r.info["hypotheses"] == 0 and r.info["batches"] == 0
    assert np.array_equal(r.transformation, np.eye(4)) and r.fitness == 0.0


@pytest.mark.gpu
def test_nan_input_raises_on_cuda(bunny_features):
    """On a GPU the pair's host part is read once the first batch is enqueued: a NaN point
    still raises the ValueError naming the cloud, and the caller's clouds are untouched."""
    s, t, fs, ft, _ = bunny_features
    src = s.cuda().clone()
    src[7, 1] = math.nan
    kept = src.clone()
    with pytest.raises(ValueError, match="source"):
        ransac(src, t.cuda(), source_features=fs.cuda(), target_features=ft.cuda(),
               max_correspondence_distance=1.5 * V)
    assert torch.equal(src.isnan(), kept.isnan())
    assert torch.equal(torch.nan_to_num(src), torch.nan_to_num(kept))


@pytest.mark.parametrize("kw, err, match", [
    (dict(source=torch.rand(2, 3)), ValueError, "source"),
    (dict(target=torch.rand(2, 3)), ValueError, "target"),
    (dict(source_features=torch.rand(9, 33)), ValueError, "source_features"),
    (dict(target_features=torch.rand(10, 5)), ValueError, "target_features"),
    (dict(source_features=None), ValueError, "source_features"),
    (dict(max_correspondence_distance=0.0), ValueError, "max_correspondence_distance"),
    (dict(triangle_similarity=1.5), ValueError, "triangle_similarity"),
    (dict(hypotheses=0), ValueError, "hypotheses"),
    (dict(confidence=1.0), ValueError, "confidence"),
    (dict(source_features=torch.full((10, 33), math.nan)), ValueError, "source_features"),
    (dict(source_features="x"), TypeError, "source_features"),
    # one device rule: inputs on different devices are named together
    (dict(target=torch.rand(10, 3, device="meta")), ValueError,
     "different devices: source on cpu, target on meta"),
    (dict(target_features=torch.rand(10, 33, device="meta")), ValueError,
     "different devices: .*target_features on meta"),
    (dict(matches="x"), TypeError, "matches"),
])
def test_bad_input(kw, err, match):
    base = dict(source=torch.rand(10, 3), target=torch.rand(10, 3),
                source_features=torch.rand(10, 33), target_features=torch.rand(10, 33),
                max_correspondence_distance=0.1)
    base.update(kw)
    src, tgt = base.pop("source"), base.pop("target")
    with pytest.raises(err, match=match):
        ransac(src, tgt, **base)


def test_feature_correspondences_against_numpy(seed):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(57, 6)), rng.normal(size=(41, 6))
    d = np.linalg.norm(a[:, None] - b[None], axis=-1)
    nn = d.argmin(1)
    c = feature_correspondences(a, b).numpy()
    np.testing.assert_array_equal(c, np.stack([np.arange(57), nn], 1))
    back = d.argmin(0)
    mutual = feature_correspondences(a, b, mutual=True).numpy()
    want = [(i, nn[i]) for i in range(57) if back[nn[i]] == i]
    np.testing.assert_array_equal(mutual, np.array(want).reshape(-1, 2))
    srt = np.sort(d, 1)
    ratio = feature_correspondences(a, b, ratio=0.8).numpy()
    keep = srt[:, 0] < 0.8 * srt[:, 1]
    np.testing.assert_array_equal(ratio[:, 0], np.arange(57)[keep])
    with pytest.raises(ValueError, match="target_features"):
        feature_correspondences(a, b[:, :5])


def test_matches_given_equal_matches_searched(bunny_features):
    """ransac(matches=...) reads the matches a caller found once (as register does)."""
    from pointalign.kernels.ransac import feature_matches

    s, t, fs, ft, _ = bunny_features
    m = feature_matches(fs, ft, 2)
    for kw in ({}, {"mutual": True}, {"ratio_test": 0.9}):
        base = dict(source_features=fs, target_features=ft, max_correspondence_distance=1.5 * V,
                    hypotheses=1024, max_hypotheses=1024, seed=3, **kw)
        a, b = ransac(s, t, **base), ransac(s, t, matches=m, **base)
        assert np.array_equal(a.transformation, b.transformation)
        assert a.info == b.info and a.fitness == b.fitness and a.stop_reason == b.stop_reason
        assert torch.equal(b.transformation_tensor, torch.from_numpy(b.transformation))
    # forward only: enough unless mutual pairs are asked for (then searched backward here)
    one = feature_matches(fs, ft, 1, backward=False)
    kw = dict(source_features=fs, target_features=ft, max_correspondence_distance=1.5 * V,
              hypotheses=1024, max_hypotheses=1024, seed=3, mutual=True)
    assert np.array_equal(ransac(s, t, matches=one, **kw).transformation,
                          ransac(s, t, **kw).transformation)
    with pytest.raises(ValueError, match="matches"):
        ransac(s, t, matches=feature_matches(fs[:10], ft, 2), **kw)


def test_feature_correspondences_on_different_devices_are_named():
    a = torch.rand(5, 4)
    with pytest.raises(ValueError, match="source_features on cpu, target_features on meta"):
        feature_correspondences(a, torch.rand(5, 4, device="meta"))


def test_required_hypotheses():
    assert required_hypotheses(0.0, 0.99) == math.inf
    assert required_hypotheses(1.0, 0.99) == 1.0
    n = required_hypotheses(0.1, 0.999)
    assert n == pytest.approx(math.log(0.001) / math.log(1 - 1e-3))
    assert 1 - (1 - 0.1 ** 3) ** math.ceil(n) >= 0.999


@pytest.mark.slow
def test_recovers_random_pose_on_3dmatch_demo(shared_data):
    d = shared_data / "3dmatch" / "3dsmoothnet_demo_pair"
    if not (d / "cloud_bin_0.ply").is_file():
        pytest.skip("3DMatch demo pair not present")
    from plyfile import PlyData

    def load(name):
        v = PlyData.read(str(d / name))["vertex"]
        return torch.from_numpy(np.stack([v["x"], v["y"], v["z"]], 1).astype(np.float32))

    T_ref = torch.from_numpy(np.loadtxt(d / "reference_T_bin0_from_bin1_ESTIMATED.txt"))
    v = 0.05
    s = voxel_downsample(load("cloud_bin_1.ply"), v)
    t = voxel_downsample(load("cloud_bin_0.ply"), v)
    fs, ft = fpfh(s, radius=5 * v), fpfh(t, radius=5 * v)
    P = _random_pose(3)
    s2 = transforms.apply(P, s.double()).float()
    r = ransac(s2, t, source_features=fs, target_features=ft, max_correspondence_distance=1.5 * v,
               seed=0)
    T_true = T_ref @ transforms.invert(P)
    rot, _ = _point_error(r.transformation, T_true, s2)
    E = transforms.invert(T_true) @ torch.as_tensor(r.transformation)
    assert rot < 5.0 and float(E[:3, 3].norm()) < 0.10 + 0.1 * math.radians(rot) * 3


@pytest.mark.gpu
def test_cuda_recovers_pose_and_is_deterministic(bunny_features, seed, monkeypatch):
    """Repeated runs agree exactly: the Lo-RANSAC rounds eager (the first run), captured
    and replayed as a CUDA graph (the later ones), and with graphs switched off."""
    from pointalign.kernels import _loop

    s, t, fs, ft, T_ts = bunny_features
    P = _random_pose(seed)
    s2 = transforms.apply(P, s.double()).float().cuda()
    T_true = T_ts @ transforms.invert(P)
    kw = dict(source_features=fs.cuda(), target_features=ft.cuda(),
              max_correspondence_distance=1.5 * V, seed=seed)
    a = ransac(s2, t.cuda(), **kw)
    runs = [ransac(s2, t.cuda(), **kw) for _ in range(2)]
    monkeypatch.setattr(_loop, "USE_GRAPHS", False)
    runs.append(ransac(s2, t.cuda(), **kw))
    assert a.transformation_tensor.is_cuda
    for b in runs:
        assert np.array_equal(a.transformation, b.transformation) and a.info == b.info
    rot, disp = _point_error(a.transformation, T_true, s2.cpu())
    assert rot < 10.0 and disp < 0.01


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_triangle_motions_match_horn(device, rng):
    """The hypotheses' motions agree with estimate.horn, degenerate triangles included."""
    from pointalign import estimate
    from pointalign.kernels import ransac as _k

    h = 64
    src = torch.randn(h, 3, 3, generator=rng)
    P = _random_pose(int(torch.randint(0, 1000, (1,), generator=rng)))
    tgt = transforms.apply(P, src.double()).float() + 1e-4 * torch.randn(h, 3, 3, generator=rng)
    src[:8, 2] = src[:8, 0] + 0.5 * (src[:8, 1] - src[:8, 0])  # collinear source triangles
    tgt[8:16, 1] = tgt[8:16, 0]  # coincident target vertices
    triples = torch.arange(3 * h).view(h, 3)
    want = estimate.horn(src.double(), tgt.double(), strict=False)
    # the triangle test (any length ratio: similarity 1) drops the coincident vertices only
    kept = list(range(8)) + list(range(16, h))
    for compact in (True, False):
        T, valid, rows, passed = _k.triangle_motions(
            src.reshape(-1, 3).to(device), tgt.reshape(-1, 3).to(device), triples.to(device),
            1.0, estimate.DEGENERACY_EPS, compact=compact)
        assert int(passed) == len(kept)
        assert rows.tolist() == (kept if compact else list(range(h)))
        T, valid = T.cpu(), valid.cpu()
        if not compact:  # every row kept: the dropped ones not valid, the identity
            eye = torch.eye(4, dtype=T.dtype).expand(8, 4, 4)
            assert not valid[8:16].any() and torch.equal(T[8:16], eye)
            T, valid = T[kept], valid[kept]
        assert torch.equal(valid, want.valid[kept])
        assert not valid[:8].any() and valid[-(h - 16):].all()
        torch.testing.assert_close(T, want.transformation[kept], atol=1e-6, rtol=0)


def _lo_ransac_reference(T, c, sq, src, tgt, index, d, rounds):
    """Lo-RANSAC as a plain host loop over the filled rows alone: stop after a round that
    improves none; the best by the ranking key."""
    from pointalign.kernels.horn import weighted_horn
    from pointalign.registration.ransac_programs import key, score

    k = key(c, sq, d)
    idx = score(T, src, index, d, with_matches=True)[2]
    for _ in range(rounds):
        T2, valid = weighted_horn(src.expand(T.shape[0], -1, -1), tgt[idx.clamp_min(0)],
                                  (idx >= 0).to(src.dtype))
        c2, sq2, idx2 = score(T2, src, index, d, with_matches=True)
        k2 = key(c2, sq2, d)
        better = valid & (k2 > k)
        if not bool(better.any()):
            break
        T = torch.where(better[:, None, None], T2, T)
        c, sq = torch.where(better, c2, c), torch.where(better, sq2, sq)
        k = torch.where(better, k2, k)
        idx = torch.where(better[:, None], idx2, idx)
    b = int(torch.sort(k, descending=True, stable=True).indices[0])
    return T[b], int(c[b]), float(sq[b])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("rounds", [1, 2, 5])
def test_lo_ransac_on_the_executor_equals_the_host_loop(bunny_features, device, rounds):
    """ransac()'s Lo-RANSAC (its rounds on the executor: chunks of two rounds, replayed from
    a CUDA graph on a GPU, stopped by the host after a round that improves nothing) ranks
    the same best motion as a plain host loop, bit for bit, in a first call and in later
    ones."""
    from pointalign.kernels import _loop
    from pointalign.registration.ransac_programs import key, refine, score
    from pointalign.search import build_index

    _loop.clear_caches()
    s, t, _, _, T_true = bunny_features
    src, tgt = s.to(device), t.to(device)
    index = build_index(tgt)
    d = 1.5 * V
    g = torch.Generator().manual_seed(3)
    T = torch.stack([T_true] * 3).clone()  # three motions near the truth, best first
    T[:, :3, 3] += 0.004 * torch.randn(3, 3, generator=g, dtype=torch.float64)
    T = T.to(device)
    c, sq, _ = score(T, src, index, d)
    order = torch.sort(c, descending=True, stable=True).indices
    T, c, sq = T[order], c[order], sq[order]
    want_T, want_c, want_sq = _lo_ransac_reference(T, c, sq, src, tgt, index, d, rounds)
    for _ in range(3):  # a first call, then kept graphs
        rT, rc, rsq = refine(T, c, sq, src, tgt, index, d, rounds)
        b = int(torch.sort(key(rc, rsq, d), descending=True, stable=True).indices[0])
        assert torch.equal(rT[b], want_T) and int(rc[b]) == want_c and float(rsq[b]) == want_sq
    # here the rounds move the best motion from the second on (the test is not of a
    # refinement that does nothing)
    assert torch.equal(want_T, T[0]) == (rounds < 2)
