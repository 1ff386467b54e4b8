import dataclasses
import math
import re

import numpy as np
import pytest
import torch

from pointalign import _progress, datasets, metrics, transforms
from pointalign.features.downsample import auto_voxel_size, count_voxels
from pointalign.registration.pipeline import Scales, register


@pytest.fixture(scope="module")
def bunny():
    return datasets.load_bunny_pair()


def test_demo_pair_from_identity(bunny):
    """bun045 -> bun000 from the identity: what `make demo` prints (< 1 deg, < 2 mm)."""
    r = register(bunny.source, bunny.target, hypotheses=2048, icp_voxel_size=0.0015, seed=0)
    rot, trans = metrics.relative_error(r.transformation, bunny.T_target_source)
    assert rot < 1.0 and trans < 0.002
    assert r.converged
    assert {"downsample", "describe", "ransac", "icp", "total"} <= set(r.timings)
    assert r.info["global"].converged
    assert 3000 < r.info["source_down"] < 7000
    # the verdict decides, and says so; the final ICP's own stop is kept beside it
    assert r.stop_reason == "trusted" and r.info["verdict"] == "trusted"
    assert r.info["icp_converged"] and r.info["icp_stop_reason"] in ("small_update",
                                                                    "relative_change")
    # iterations count one thing: the final ICP's, as its history records them
    assert r.iterations == r.history[-1]["iteration"] == len(r.history) - 1 <= 30
    assert 1 <= r.info["coarse_iterations"] <= 30


def test_random_pose_any_rotation(bunny, seed):
    g = torch.Generator().manual_seed(seed)
    P = transforms.make(transforms.random_rotation(generator=g, dtype=torch.float64).reshape(3, 3),
                        torch.randn(3, generator=g, dtype=torch.float64))
    src = transforms.apply(P, bunny.source.double()).float()
    T_true = torch.as_tensor(bunny.T_target_source) @ transforms.invert(P)
    r = register(src, bunny.target, voxel_size=0.006, hypotheses=2048, icp_voxel_size=0.003,
                 seed=seed)
    E = transforms.invert(T_true) @ torch.as_tensor(r.transformation)
    rot = math.degrees(float(transforms.rotation_angle(E[:3, :3])))
    disp = (transforms.apply(torch.as_tensor(r.transformation), src.double())
            - transforms.apply(T_true, src.double())).norm(dim=1).max()
    assert rot < 1.0 and float(disp) < 0.003


def test_global_only(bunny):
    r = register(bunny.source, bunny.target, voxel_size=0.006, refine="none", hypotheses=2048)
    assert r.stop_reason in ("confidence", "max_hypotheses")
    assert "icp" not in r.timings and "ransac.hypotheses" in r.timings
    rot, _ = metrics.relative_error(r.transformation, bunny.T_target_source)
    assert rot < 10.0


def test_auto_voxel_size_aims_at_target_points(bunny, seed):
    pts = datasets.random_subsample(bunny.target, 30000, seed=seed)
    v = auto_voxel_size(pts, 4000)
    assert 0.8 * 4000 < count_voxels(pts, v) < 1.25 * 4000
    # a cloud smaller than twice the target is halved (each voxel keeps neighbours)
    small = datasets.random_subsample(bunny.target, 3000, seed=seed)
    assert 0.8 * 1500 < count_voxels(small, auto_voxel_size(small, 5000)) < 1.25 * 1500


def test_bad_input(bunny):
    with pytest.raises(ValueError, match="refine"):
        register(bunny.source, bunny.target, refine="newtonish")
    with pytest.warns(DeprecationWarning, match="refine"), pytest.raises(ValueError,
                                                                        match="refine"):
        register(bunny.source, bunny.target, method="newtonish")  # the old name
    with pytest.raises(ValueError, match="source"):
        register(torch.rand(2, 3), bunny.target)
    with pytest.raises(ValueError, match="voxel_size"):
        register(bunny.source, bunny.target, voxel_size=-1.0)
    with pytest.raises(ValueError, match="voxel_size"):
        register(bunny.source, bunny.target, voxel_size=10.0)  # one voxel: 1 point left
    with pytest.raises(ValueError, match="points"):
        auto_voxel_size(np.zeros((10, 3)))


@pytest.mark.gpu
def test_demo_pair_cuda(bunny):
    r = register(bunny.source.cuda(), bunny.target.cuda(), seed=0)
    rot, trans = metrics.relative_error(r.transformation, bunny.T_target_source)
    assert rot < 1.0 and trans < 0.002
    assert r.transformation_tensor.is_cuda


@pytest.mark.gpu
def test_graphed_programs_give_the_eager_result(bunny, monkeypatch):
    """register()'s fixed programs and executor loops (the cliques, the Lo-RANSAC rounds,
    the verdict's counts) run eagerly at a signature's first call, are captured at the
    second and replayed after: every run equals the run without graphs (the same kernels
    on the same data), pose and verdict numbers alike."""
    from pointalign.kernels import _loop

    _loop.clear_caches()
    s, t = bunny.source.cuda(), bunny.target.cuda()
    runs = [register(s, t, seed=0) for _ in range(3)]
    monkeypatch.setattr(_loop, "USE_GRAPHS", False)
    runs.append(register(s, t, seed=0))
    keys = ("overlap", "margin", "concentration", "verdict")
    for r in runs[1:]:
        assert np.array_equal(r.transformation, runs[0].transformation)
        assert [r.info[k] for k in keys] == [runs[0].info[k] for k in keys]


@pytest.mark.gpu
def test_description_checked_after_the_global_stage(bunny, monkeypatch):
    """On a device register() reads the description's check once its global stage is
    launched; a neighbourhood reported wider than the table (forced here) describes again
    and runs the global stage again: the same result (the table held in truth), and the
    description searched twice."""
    from pointalign.kernels import _loop
    from pointalign.registration import prepare

    s, t = bunny.source.cuda(), bunny.target.cuda()
    want = register(s, t, seed=0)
    real, searched = prepare.radius_pair, []
    monkeypatch.setattr(prepare, "radius_pair", lambda *a: searched.append(1) or real(*a))
    wide = prepare.radius_pair_at_width
    monkeypatch.setattr(prepare, "radius_pair_at_width", lambda *a: (
        lambda d, i, w: (d, i, w + prepare.DESCRIBE_WIDTH + 1))(*wide(*a)))
    _loop.clear_caches()  # (a kept graph would replay the unpatched search)
    got = register(s, t, seed=0)
    assert searched == [1]
    assert np.array_equal(got.transformation, want.transformation)
    assert got.info["verdict"] == want.info["verdict"]


def test_verdict_counts_equal_separate_scores(bunny, seed):
    """The verdict's three counts from one search equal three bounded scores (score)."""
    from pointalign.features.downsample import voxel_downsample
    from pointalign.registration.ransac_programs import count_inliers, count_inliers_within, score
    from pointalign.search import build_index

    v = 0.004
    s_down, t_down = voxel_downsample(bunny.source, v), voxel_downsample(bunny.target, v)
    t_idx = build_index(t_down)
    g = torch.Generator().manual_seed(seed)
    for scale in (0.0, 0.5, 1.0, 3.0):  # the true pose, then farther from it
        T = torch.tensor(bunny.T_target_source, dtype=torch.float64)
        T[:3, 3] += scale * v * torch.randn(3, generator=g, dtype=torch.float64)
        bounds = (1.5 * v, 0.5 * v, v)
        got = count_inliers_within(T, s_down, t_idx, bounds)
        want = [score(T[None], s_down, t_idx, b)[0] for b in bounds]
        assert [int(x) for x in got] == [int(x) for x in want]
        assert [int(x) for x in got] == [int(count_inliers(T[None], s_down, t_idx, b)[0])
                                         for b in bounds]
    assert int(got[0]) > int(got[1])  # not all-or-nothing


def test_register_cpu_keeps_torch_threads(bunny):
    """register() runs PyTorch on one thread inside (CPU) and restores the caller's count."""
    from pointalign import _threads
    from pointalign.search import policy

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with _threads.torch_single():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        # what register() asks instead of naming a device type
        with _threads.host_stages(torch.device("cpu")):
            assert torch.get_num_threads() == 1
        with _threads.host_stages(torch.device("meta")):
            assert torch.get_num_threads() == 2
        assert _threads.host_threads("cpu") == 2 and _threads.host_threads("meta") is None
        assert policy.one_index_serves_every_bound(bunny.target)  # host memory: cKDTree
        with pytest.raises(RuntimeError, match="inside"), _threads.torch_single():
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
        register(bunny.source, bunny.target, voxel_size=0.008, refine="none", hypotheses=256)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_full_normals_equal_bounded_search_and_keep_candidates(bunny):
    """The final ICP's target normals (estimate_normals' bounded self-query, k = 16) equal
    those of the complete k-NN cut to the radius (bit for bit), and the index keeps the
    bounded self-query as its shortcut lists."""
    from pointalign.features.normals import estimate_normals
    from pointalign.search import build_index

    t = bunny.target[::3].contiguous()
    for r in (0.0005, 0.002, 0.006):  # few, some and 16 neighbours within the radius
        idx = build_index(t)
        got = estimate_normals(t, k=16, radius=r, index=idx, orient="viewpoint",
                               viewpoint=t.mean(0))
        nb = build_index(t).knn(t, 16)
        table = torch.where(nb.dists <= r * r, nb.idx, -1)
        want = estimate_normals(t, neighbors=table, orient="viewpoint", viewpoint=t.mean(0))
        assert torch.equal(got, want)
    tree = idx._cpu_tree()
    if tree is not None:  # the "cpu" backend: the bounded self-query was kept
        assert tree.candidates()[0].shape == (t.shape[0], 8)


def test_scales_hold_every_multiple_and_overrides_replace_them():
    v = 0.004
    s = Scales(v)
    assert (s.voxel, s.normal_radius, s.feature_radius, s.correspondence, s.overlap, s.fine,
            s.translation_tolerance, s.distinct) == (v, 2 * v, 5 * v, 1.5 * v, v, 0.5 * v,
                                                     1e-3 * v, 3 * v)
    for f in dataclasses.fields(Scales):  # the docstring lists every one
        assert f"``{f.name}``" in Scales.__doc__
    o = Scales(v, max_correspondence_distance=0.01, icp_max_correspondence_distance=0.001)
    assert (o.correspondence, o.fine) == (0.01, 0.001)
    assert o == Scales(v, 0.01, 0.001) and o != s
    assert (o.normal_radius, o.feature_radius, o.overlap) == (2 * v, 5 * v, v)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.voxel = 1.0
    with pytest.raises(ValueError, match="max_correspondence_distance"):
        Scales(v, max_correspondence_distance=-1.0)
    with pytest.raises(ValueError, match="voxel_size"):
        Scales(0.0)


def test_register_names_itself_for_an_unknown_keyword(bunny):
    with pytest.raises(TypeError, match=r"^register\(\) got an unexpected keyword "
                                        r"argument 'foo'.*triangle_similarity"):
        register(bunny.source, bunny.target, foo=1)


def test_overrides_reach_every_use_and_matches_are_found_once(bunny, monkeypatch):
    """max_correspondence_distance reaches its five uses, icp_max_correspondence_distance
    its two; the feature matches are searched once and handed to RANSAC and the ranking."""
    from pointalign.kernels import ransac as kr
    from pointalign.registration import pipeline
    from pointalign.registration import verdict as verdict_module

    seen: dict = {}

    def spy(owner, name, what):
        real = getattr(owner, name)

        def wrapped(*a, **k):
            out = real(*a, **k)
            seen.setdefault(name, []).append(what(a, k, out))
            return out
        monkeypatch.setattr(owner, name, wrapped)

    spy(kr, "feature_matches", lambda a, k, out: (a[2], k["backward"], out))
    spy(pipeline, "ransac", lambda a, k, out: (k["max_correspondence_distance"], k["matches"]))
    spy(pipeline, "rank_correspondences", lambda a, k, out: k["matches"])
    spy(pipeline, "compatibility_hypotheses", lambda a, k, out: a[2])
    spy(pipeline, "count_inliers", lambda a, k, out: a[3])
    spy(pipeline, "icp", lambda a, k, out: k["max_correspondence_distance"])
    spy(verdict_module, "count_inliers_within", lambda a, k, out: a[3])
    v, d, fine = 0.008, 0.011, 0.003
    r = register(bunny.source, bunny.target, voxel_size=v, hypotheses=256, icp_voxel_size=0.004,
                 max_correspondence_distance=d, icp_max_correspondence_distance=fine)
    assert r.info["voxel_size"] == v
    (k, backward, matches), = seen["feature_matches"]
    assert k == 2 and backward
    assert seen["ransac"] == [(d, matches)] and seen["rank_correspondences"] == [matches]
    assert seen["compatibility_hypotheses"] == [d]
    assert seen["count_inliers"] == [d, v]  # the proposals at d, the refined overlap at v
    assert seen["icp"] == [d, fine]  # the coarse stage, the final one
    assert seen["count_inliers_within"] == [(d, fine, v)]  # the verdict's bounds


def test_iterations_count_the_final_icp_as_its_history_records_them(bunny):
    r = register(bunny.source, bunny.target, voxel_size=0.008, hypotheses=256,
                 icp_voxel_size=0.004, max_iterations=20)
    assert r.iterations == r.history[-1]["iteration"] == len(r.history) - 1
    assert 1 <= r.iterations <= 20 and 1 <= r.info["coarse_iterations"] <= 20


def test_failed_global_stage_says_why_and_points_to_keys_that_exist(bunny):
    with pytest.warns(_progress.DoubtfulResultWarning) as rec:
        r = register(bunny.source, bunny.target, voxel_size=0.008, hypotheses=128,
                     max_hypotheses=128, triangle_similarity=1e-12)
    assert not r.converged and r.stop_reason == "no_hypothesis"
    assert r.info["verdict"] == "no hypothesis"
    msg = str(rec[0].message)
    assert "no hypothesis" in msg
    keys = re.findall(r"'(\w+)'", msg.partition("result.info")[2])
    assert keys and all(key in r.info for key in keys)
    assert np.array_equal(r.transformation, np.eye(4)) and r.history == []


def test_inputs_on_different_devices_are_named(bunny):
    with pytest.raises(ValueError, match="different devices: source on cpu, target on meta"):
        register(bunny.source, torch.empty(100, 3, device="meta"))


@pytest.mark.gpu
def test_inputs_on_cpu_and_cuda_are_named(bunny):
    with pytest.raises(ValueError, match="different devices: source on cpu, target on cuda"):
        register(bunny.source, bunny.target.cuda())


def test_gicp_refinement_lands_where_point_to_plane_does(bunny):
    """refine="gicp" swaps the final stage for generalized ICP; on the bunny pair both
    refinements land within 0.2° and 1 mm of the ground truth, and the verdict trusts both."""
    kw = dict(voxel_size=0.006, hypotheses=2048, icp_voxel_size=0.002, device="cpu")
    plane = register(bunny.source, bunny.target, **kw)
    g = register(bunny.source, bunny.target, refine="gicp", **kw)
    for r in (plane, g):
        rot, trans = metrics.relative_error(r.transformation, bunny.T_target_source)
        assert r.converged and rot < 0.2 and trans < 1e-3, (r.stop_reason, rot, trans)
