"""surface_newton / approximate_icp: approximants, Armijo, levels, recovery.

The surface kernels (Newton terms, node statistics, the cell-mean step) are tested in
tests/kernels/test_surface.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pointalign import datasets, metrics, transforms
from pointalign.features.normals import symmetric_eigh3
from pointalign.kernels import surface as ks
from pointalign.registration.criteria import ConvergenceCriteria
from pointalign.registration.surface import (
    APPROXIMANTS,
    LevelSchedule,
    NewtonStep,
    approximant_coefficients,
    approximate_icp,
    approximate_sq_distance,
    default_criteria,
    node_frames,
    surface_newton,
)
from pointalign.search.kdtree import KDTreeIndex

CRIT = ConvergenceCriteria(max_iterations=80, relative_rmse=1e-5, rotation_tolerance=1e-5,
                           translation_tolerance=1e-6)


def _sphere(n, g, radius=1.0):
    v = torch.randn(n, 3, generator=g, dtype=torch.float64)
    return radius * v / v.norm(dim=1, keepdim=True)


# ---- closed-form eigen-solves (no cuSOLVER) ---------------------------------------------

def _random_spectra(g, n):
    """Random symmetric 3×3 in float64: generic, two or three equal eigenvalues, singular."""
    Q, _ = torch.linalg.qr(torch.randn(n, 3, 3, generator=g, dtype=torch.float64))
    lam = torch.randn(n, 3, generator=g, dtype=torch.float64)
    k = n // 5
    lam[k:2 * k, 1] = lam[k:2 * k, 0]            # smallest repeated
    lam[2 * k:3 * k, 2] = lam[2 * k:3 * k, 1]    # largest repeated
    lam[3 * k:4 * k] = lam[3 * k:4 * k, :1]      # all equal
    lam[4 * k:, 0] = 0                           # singular (a flat cell)
    return Q @ torch.diag_embed(lam) @ Q.transpose(1, 2)


def test_symmetric_eigh3_matches_torch_eigh(rng):
    A = _random_spectra(rng, 2000)
    lam, V = symmetric_eigh3(A)
    ref, Vr = torch.linalg.eigh(A)
    scale = A.abs().amax((-1, -2))[:, None]
    # Smith's trigonometric formula loses about half the digits at repeated eigenvalues
    assert ((lam - ref).abs() / scale).max() < 1e-7
    assert ((A @ V - V * lam[:, None, :]).abs().amax((-1, -2)) / scale[:, 0]).max() < 1e-7
    eye = torch.eye(3, dtype=torch.float64)
    assert (V.transpose(1, 2) @ V - eye).abs().max() < 1e-12
    assert torch.allclose(torch.linalg.det(V), torch.ones(2000, dtype=torch.float64))
    # where all three eigenvalues are distinct the eigenvectors match eigh's up to sign
    gap = (ref[:, 1:] - ref[:, :-1]).amin(-1) / scale[:, 0]
    d = gap > 1e-3
    dots = (V[d] * Vr[d]).sum(1).abs()
    assert d.sum() > 300 and torch.allclose(dots, torch.ones_like(dots), atol=1e-9)


def test_node_frames_match_eigh(rng):
    pts = datasets.random_subsample(datasets.load_bunny("bun000"), 5000, int(rng.initial_seed()))
    tree = KDTreeIndex(pts, leaf_size=8)
    mean, frame, radius = node_frames(tree)
    big = tree.node_sizes() >= 5
    p = tree.points.double()
    for node in torch.nonzero(big).flatten()[::97].tolist():
        s, e = int(tree.arrays.start[node]), int(tree.arrays.end[node])
        x = p[tree.perm[s:e]]
        ev, vec = torch.linalg.eigh(torch.cov(x.T, correction=0))
        assert abs(float((frame[node, :, 2] @ vec[:, 0]).abs()) - 1) < 1e-6  # normal
        assert math.isclose(float(radius[node]), float(ev.clamp_min(0).sum().sqrt()),
                            rel_tol=1e-6)


# ---- approximants ----------------------------------------------------------------------

def test_approximants_near_a_sphere(rng):
    # true squared distance to the unit sphere at points up to 0.01 off the surface
    pts = _sphere(20000, rng).float()
    tree = KDTreeIndex(pts, leaf_size=16)
    dirs = _sphere(500, rng)
    delta = 0.01 * (2 * torch.rand(500, 1, generator=rng, dtype=torch.float64) - 1)
    q = (dirs * (1 + delta)).float()
    true = delta[:, 0] ** 2
    err = {k: float((approximate_sq_distance(tree, q, k, depth=tree.depth - 1) - true)
                    .abs().median()) for k in APPROXIMANTS}
    # cells of ~32 points span about 0.06: the point approximant sees the tangential offset
    assert 1e-4 < err["point"] < 0.06**2
    # the plane is within the sagitta of a cell (~5e-4) times delta of the truth
    assert err["plane"] < 2e-5
    # the per-cell Pottmann-Hofer form adds a small tangential term (λ ≈ δ0 κ / 2)
    assert err["second_order"] < 1e-4 and err["second_order"] < err["point"] / 10


def test_second_order_curvature_weights_on_sphere(rng):
    # on a unit sphere both curvatures are 1: tangential weights small but positive
    pts = _sphere(20000, rng).float()
    tree = KDTreeIndex(pts, leaf_size=16)
    co = approximant_coefficients(tree, "second_order").double()
    A = ks.sym3(co)
    ev = torch.linalg.eigvalsh(A[2**(tree.depth - 1) - 1:2**tree.depth - 1])
    assert torch.allclose(ev[:, 2], torch.ones_like(ev[:, 2]), atol=1e-4)  # the normal
    assert (ev[:, :2] > 0).all() and (ev[:, :2] < 0.2).all()


def test_custom_approximant_callable(rng):
    pts = _sphere(3000, rng).float()
    tree = KDTreeIndex(pts, leaf_size=8)

    def plane(s, n, frame):
        A = n[:, :, None] * n[:, None, :]
        b = (A @ s.unsqueeze(-1)).squeeze(-1)
        return A, b, (s * b).sum(-1)

    a = approximant_coefficients(tree, plane)
    b = approximant_coefficients(tree, "plane")
    assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError, match="approximant"):
        approximant_coefficients(tree, lambda s, n, f: (n, n, n))
    with pytest.raises(ValueError, match="approximant"):
        approximant_coefficients(tree, "quadric")


# ---- Newton / Armijo / recovery -------------------------------------------------------------

def _pair(deg, seed, n=1200, noise=2e-4):
    cloud = datasets.random_subsample(datasets.load_bunny("bun000"), n, seed)
    return datasets.make_pair(cloud, deg, 0.01, noise=noise, seed=seed)


@pytest.mark.parametrize("kind", ["point", "plane"])
def test_armijo_never_increases_exact_objective(kind, seed):
    p = _pair(15.0, seed)
    tree = KDTreeIndex(p.target, leaf_size=8)
    r = surface_newton(p.source, index=tree, approximant=kind, tree_depth=tree.depth - 3,
                       criteria=ConvergenceCriteria(max_iterations=15))
    obj = [h["objective"] for h in r.history]
    assert len(obj) >= 2
    # exact objective recomputed at the returned pose equals the last history entry
    co = approximant_coefficients(tree, kind)
    T = torch.as_tensor(r.transformation)
    q = p.source @ T.float()[:3, :3].T + T.float()[:3, 3]
    d2 = ks.evaluate(q.double(), co[tree.descend(q, tree.depth - 3)].double()).clamp_min(0)
    assert math.isclose(float(d2.sum()), obj[-1], rel_tol=1e-4)
    assert all(b <= a * (1 + 1e-9) for a, b in zip(obj, obj[1:], strict=False))
    # the point approximant may stretch an accepted full step (2ξ, 4ξ, …; surface_newton)
    top = NewtonStep.MAX_STRETCH if kind == "point" else 1.0
    assert all(0 < h["step"] <= top for h in r.history)


@pytest.mark.parametrize("deg", [5.0, 15.0, 30.0])
@pytest.mark.parametrize("kind", ["plane", "second_order"])
def test_newton_recovers_motion(deg, kind, seed):
    p = _pair(deg, seed)
    r = surface_newton(p.source, p.target, approximant=kind, criteria=CRIT)
    assert r.converged
    tol = 0.3 if kind == "plane" else 1.5  # degrees; second order: per-cell λ (docstring)
    assert metrics.rotation_error(r.transformation, p.T_target_source) < tol
    assert metrics.translation_error(r.transformation, p.T_target_source) < tol * 2e-3
    assert r.transformation.shape == (4, 4) and r.transformation.dtype == np.float64
    assert r.info["F"].shape == (6, 6)


def test_newton_plane_converges_in_few_steps(seed):
    # issue 5 / paper Table 1: Newton point-to-plane converges in ~5 steps; the default stop
    # rule (float32-aware) must fire, not the iteration cap
    p = _pair(5.0, seed, n=3000)
    r = surface_newton(p.source, p.target, approximant="plane")
    assert r.converged and r.stop_reason != "max_iterations"
    assert r.iterations <= 10
    assert metrics.rotation_error(r.transformation, p.T_target_source) < 0.2
    assert metrics.translation_error(r.transformation, p.T_target_source) < 4e-4
    assert default_criteria(p.source).max_iterations == 50


@pytest.mark.parametrize("deg", [5.0, pytest.param(15.0, marks=pytest.mark.slow),
                                 pytest.param(30.0, marks=pytest.mark.slow)])
def test_point_newton_and_approximate_icp_recover_motion(deg, seed):
    # cell means are a coarse stand-in for the surface: these converge near, not onto, the
    # truth (bias of the cell means); both start on cells sized against the target (no 15°
    # stall)
    p = _pair(deg, seed, n=6000)
    tree = KDTreeIndex(p.target, leaf_size=8)
    # (Newton point at 30° stopped ~10° off on seed 0 before the start cells were sized
    # against the target and its full steps stretched)
    runs = [approximate_icp(p.source, index=tree),
            surface_newton(p.source, index=tree, approximant="point")]
    for r in runs:
        assert r.converged
        assert metrics.rotation_error(r.transformation, p.T_target_source) < 1.5
        assert metrics.translation_error(r.transformation, p.T_target_source) < 3e-3


def _upsampled_problem(n):
    """benchmarks/bench_surface.py's problem(n): bun000 drawn with replacement to n points
    plus 0.3 mm jitter (target); a second draw moved by a 10°/10 mm motion (source)."""
    base = datasets.load_bunny("bun000")

    def draw(seed):
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, base.shape[0], (n,), generator=g)
        return base[idx] + 3e-4 * torch.randn(n, 3, generator=g, dtype=base.dtype)

    T = transforms.random_transform(10.0, 0.01, generator=torch.Generator().manual_seed(0))
    return transforms.apply(transforms.invert(T).float(), draw(1)), draw(0), T


def test_cell_mean_start_level_is_a_length_not_a_point_count():
    # the first cells are ~20 mm on the bunny whatever its size (issue 5: starting 7 levels
    # above the finest put them at 2.7-3.8 mm on 150k-1M points, under a ~15 mm motion)
    starts = []
    for n in (20_000, 200_000):
        src, tgt, _ = _upsampled_problem(n)
        r = approximate_icp(src[:2000], index=KDTreeIndex(tgt, leaf_size=8),
                            criteria=ConvergenceCriteria(max_iterations=1))
        starts.append(r.history[0]["level"])
    assert starts == [3, 3]


@pytest.mark.parametrize("method", ["aicp", pytest.param("point", marks=pytest.mark.slow)])
def test_cell_mean_methods_converge_on_large_upsampled_bunny(method):
    # regression (issue 5): at 2e5 points (tree depth 15) approximate ICP stopped after 11
    # steps 10.1° / 12 mm off (3e5 and 1e6 on the H100: 50 steps, ~9° off, both methods);
    # fixed seed: the measured failing configuration
    src, tgt, T = _upsampled_problem(200_000)
    tree = KDTreeIndex(tgt, leaf_size=8)
    if method == "aicp":
        r = approximate_icp(src, index=tree)
    else:
        r = surface_newton(src, index=tree, approximant="point")
    assert r.converged and r.stop_reason != "max_iterations"
    assert metrics.rotation_error(r.transformation, T) < 0.5
    assert metrics.translation_error(r.transformation, T) < 1e-3


def _load_3dmatch(shared_data, name):
    d = shared_data / "3dmatch" / "3dsmoothnet_demo_pair" / name
    if not d.is_file():
        pytest.skip("3DMatch demo pair not present")
    from plyfile import PlyData

    from pointalign.features.downsample import voxel_downsample

    v = PlyData.read(str(d))["vertex"]
    pts = torch.from_numpy(np.stack([v["x"], v["y"], v["z"]], 1).astype(np.float32))
    return voxel_downsample(pts, 0.03)


@pytest.mark.slow  # 20-60 s per case on 2 CPU cores
@pytest.mark.parametrize("deg", [5.0, 15.0, 30.0])
def test_recovers_motion_on_3dmatch_demo(deg, seed, shared_data):
    # a 3DMatch indoor scan (metres, ~3 m across), voxel 3 cm, known motion + 5 mm noise;
    # cell-mean methods (point, approximate ICP) carry the cells' bias: ~1.2-2.3° at 5 cm
    cloud = _load_3dmatch(shared_data, f"cloud_bin_{seed % 2}.ply")
    p = datasets.make_pair(cloud, deg, 0.1, noise=0.005, seed=seed)
    tree = KDTreeIndex(p.target, leaf_size=8)
    tol = {"plane": 0.3, "second_order": 0.5, "point": 1.5, "aicp": 1.5}
    for kind in tol:
        r = approximate_icp(p.source, index=tree) if kind == "aicp" else \
            surface_newton(p.source, index=tree, approximant=kind)
        assert metrics.rotation_error(r.transformation, p.T_target_source) < tol[kind], kind
        assert metrics.translation_error(r.transformation, p.T_target_source) < \
            tol[kind] * 0.03, kind


def test_index_reuse_and_init(seed):
    p = _pair(10.0, seed)
    tree = KDTreeIndex(p.target, leaf_size=8)
    a = surface_newton(p.source, index=tree, criteria=CRIT)
    assert tree.has_payload("surface:plane")
    b = surface_newton(p.source, p.target, criteria=CRIT)
    # the same tree, solved in two frames (the caller's; the target's centroid): their
    # float32 roundings differ by ~1e-5 of the objective from the first step, and each run
    # stops by the relative-change rule; seed 2 lands 0.0045 deg and 4 um apart
    assert metrics.rotation_error(a.transformation, b.transformation) < 0.02
    assert metrics.translation_error(a.transformation, b.transformation) < 2e-5
    # starting at the truth (finest level only) stays there
    c = surface_newton(p.source, index=tree, init=p.T_target_source, criteria=CRIT,
                       tree_depth=a.info["tree_depth"])
    assert metrics.rotation_error(c.transformation, p.T_target_source) < 0.1
    # the inverse problem gives the inverse transform (the noisy cloud is now the template)
    d = surface_newton(p.target, p.source, criteria=CRIT)
    inv = transforms.invert(p.T_target_source)
    assert metrics.rotation_error(d.transformation, inv) < 0.5


def test_truncation_with_partial_overlap(seed):
    cloud = datasets.random_subsample(datasets.load_bunny("bun000"), 3000, seed)
    p = datasets.make_pair(cloud, 8.0, 0.005, noise=2e-4, overlap=0.7, outlier_fraction=0.05,
                           seed=seed)
    r = surface_newton(p.source, p.target, max_correspondence_distance=0.01, criteria=CRIT)
    assert metrics.rotation_error(r.transformation, p.T_target_source) < 0.5
    assert 0.5 < r.fitness <= 1.0


# ---- the shared edge: precision far from the origin, honest convergence ------------------

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("method", ["newton", "aicp"])
def test_georeferenced_offsets_keep_precision(method, device):
    # issue 16: at +1e6 m surface_newton returned a pose 6.6 km off. The problem is solved
    # in a frame centred on the target in float64: the shifted run moves the source as the
    # unshifted one does, to 1e-6 of the cloud's extent
    cloud = datasets.random_subsample(datasets.load_bunny("bun000"), 500, 1)
    p = datasets.make_pair(cloud, 10.0, 0.01, noise=2e-4, seed=1)
    src, tgt = p.source.double(), p.target.double()
    run = (lambda s, t: surface_newton(s, t, device=device)) if method == "newton" else \
        (lambda s, t: approximate_icp(s, t, device=device))
    base = run(src, tgt)
    assert base.converged
    moved = transforms.apply(torch.as_tensor(base.transformation), src)
    extent = float((src - src.mean(0)).norm(dim=1).max())
    for off in (1e3, 1e4, 1e5, 1e6):
        o = torch.tensor([off, -0.7 * off, 0.3 * off], dtype=torch.float64)
        r = run(src + o, tgt + o)
        assert r.converged and r.iterations == base.iterations, off
        got = transforms.apply(torch.as_tensor(r.transformation), src + o) - o
        assert float((got - moved).norm(dim=1).max()) < 1e-6 * extent, off


def _tilted_plane(n, g):
    uv = torch.rand(n, 2, generator=g, dtype=torch.float64) - 0.5
    Q, _ = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
    return (uv @ Q[:, :2].T).float(), Q


@pytest.mark.parametrize("kind", ["plane", "second_order"])
def test_plane_moved_in_plane_is_degenerate(kind, rng):
    # a rotation about the normal and a slide along the plane leave the distance to the plane
    # unchanged: the Newton system cannot determine them, so the result must not say
    # converged (it did, issue 16); the motion across the plane is still solved
    tgt, Q = _tilted_plane(600, rng)
    n = Q[:, 2]
    T = transforms.make(transforms.so3_exp(0.1 * n), 0.02 * Q[:, 0] + 0.01 * n)
    src = transforms.apply(transforms.invert(T), tgt.double()).float()
    r = surface_newton(src, tgt, approximant=kind, device="cpu")
    assert not r.converged and r.stop_reason == "degenerate"
    assert r.info["rank_deficient"]
    across = (transforms.apply(torch.as_tensor(r.transformation), src.double()) @ n).abs()
    assert float(across.max()) < 1e-5


@pytest.mark.parametrize("kind", ["plane", "point", "aicp"])
def test_collinear_and_identical_points_are_degenerate(kind, rng):
    line = (torch.linspace(-1, 1, 400, dtype=torch.float64)[:, None]
            * torch.tensor([[0.3, -0.5, 0.8]], dtype=torch.float64)).float()
    T = transforms.random_transform(5.0, 0.01, generator=rng)
    src = transforms.apply(transforms.invert(T), line.double()).float()
    same = torch.full((60, 3), 0.25)
    for s, t in ((src, line), (same, same)):
        r = approximate_icp(s, t, device="cpu") if kind == "aicp" else \
            surface_newton(s, t, approximant=kind, device="cpu")
        assert not r.converged and r.stop_reason == "degenerate", (kind, r.stop_reason)


def test_cell_mean_rules_say_when_no_decrease_is_a_stall():
    # approximate ICP ends on "no_decrease" when a step raised the RMS distance to the cell
    # means; info["stalled"] says whether the steps kept before it were still changing that
    # distance by >= LevelSchedule.LEVEL_RELATIVE_CHANGE (KITTI: 0.3 % a step, 0.95 m off)
    from types import SimpleNamespace

    from pointalign.registration.surface.cell_icp import _CellMeanRules

    prob = SimpleNamespace(source=torch.zeros(100, 3), cov=0.01 * np.eye(3),
                           centroid=np.zeros(3))
    crit = ConvergenceCriteria(max_iterations=50, relative_rmse=1e-12, rotation_tolerance=0.0,
                               translation_tolerance=0.0)

    def record(rmse):
        s = np.zeros((1, 30))
        s[0, 28], s[0, 29] = 100, 100 * rmse**2
        D = np.eye(4)
        D[0, 3] = 1e-3
        return {"sums": s, "flags": np.array([[1, 1]]), "update": D[None], "T": D[None]}

    for drop, stalled in ((1e-2, True), (1e-4, False)):
        rules = _CellMeanRules(crit, LevelSchedule([5], [1.0], 8.0), prob, np.eye(4))
        ends = [rules(record(r)) for r in (1.0, 1.0 - drop, 1.5)]
        assert ends == [False, False, True]
        assert rules.reason == "no_decrease" and rules.stalled is stalled
        assert rules.it == 2 and len(rules.history) == 1  # the raising step was taken back
        assert math.isclose(rules.last_rel, drop)


def test_level_schedule_rules():
    sch = LevelSchedule(levels=[3, 4, 5, 6], radii=[8.0, 4.0, 2.0, 1.0], margin=2.0)
    assert (sch.level, sch.finest) == (3, False)
    # a large motion still expected keeps the level (cells must be >= 2 × the motion)
    assert not sch.after_step(disp=3.0, rel_change=0.5) and sch.level == 3
    # a slow rate (ρ = 0.9) stretches the expected motion to 9 × the step: no move
    assert not sch.after_step(disp=2.7, rel_change=0.5) and sch.level == 3
    # a fast-shrinking motion goes straight to the deepest level whose cells are big enough
    assert sch.after_step(disp=0.6, rel_change=0.5) and sch.level == 5
    assert math.isnan(sch.prev_disp)
    # a stalled objective goes one level deeper even when the motion is not small
    assert sch.after_step(disp=5.0, rel_change=1e-4) and sch.level == 6 and sch.finest
    sch.descend()
    assert sch.level == 6  # never past the finest
    # the cell-mean schedule starts on cells sized against the target (a length)
    src, tgt, _ = _upsampled_problem(20_000)
    tree = KDTreeIndex(tgt, leaf_size=8)
    a = LevelSchedule.for_tree(tree, None, cell_means=True)
    b = LevelSchedule.for_tree(tree, None, cell_means=False)
    assert a.levels[-1] == b.levels[-1] and a.levels[0] <= b.levels[0]
    assert a.margin > b.margin
    assert LevelSchedule.for_tree(tree, 5, cell_means=False).levels == [5]


def test_steps_run_on_the_executor(seed):
    # both methods are a step + rules on kernels._loop; a step's signature (the CUDA-graph
    # key) must be computable from its fields: the tree by identity, numbers by value
    from pointalign.kernels import _loop
    from pointalign.registration.surface import CellMeanStep

    p = _pair(10.0, seed, n=400)
    tree = KDTreeIndex(p.target, leaf_size=8)
    key, objects = _loop.signature(CellMeanStep(tree, math.inf), {"x": p.source})
    assert objects == [tree] and key[0][1][1:] == (math.inf,)

    assert not NewtonStep.graph_safe  # the line search reads each trial's objective
    r = surface_newton(p.source, index=tree, criteria=CRIT)
    a = approximate_icp(p.source, index=tree)
    assert r.info["device_steps"] == r.iterations  # no step computed past a stop (eager)
    assert a.info["device_steps"] >= a.iterations and a.info["cuda_graph"] == "off"


def test_bad_inputs(rng):
    p = _pair(5.0, 0, n=300)
    with pytest.raises(ValueError, match="source"):
        surface_newton(torch.zeros(5, 2), p.target)
    with pytest.raises(ValueError, match="target"):
        surface_newton(p.source)
    with pytest.raises(TypeError, match="index"):
        surface_newton(p.source, index=object())
    with pytest.raises(ValueError, match="approximant"):
        surface_newton(p.source, p.target, approximant="cubic")
    with pytest.raises(ValueError, match="tree_depth"):
        surface_newton(p.source, p.target, tree_depth=-1)
    with pytest.raises(ValueError, match="armijo"):
        surface_newton(p.source, p.target, armijo=(1.5, 0.1))
    with pytest.raises(ValueError, match="max_correspondence_distance"):
        approximate_icp(p.source, p.target, max_correspondence_distance=-1.0)
    with pytest.raises(ValueError, match="init"):
        approximate_icp(p.source, p.target, init=torch.eye(3))
    src0 = p.source.clone()
    surface_newton(p.source, p.target, criteria=ConvergenceCriteria(max_iterations=2))
    assert torch.equal(src0, p.source)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["point", "plane", "second_order"])
def test_cuda_matches_cpu(kind, seed):
    p = _pair(15.0, seed, n=20000)
    rc = surface_newton(p.source, p.target, approximant=kind, device="cuda", criteria=CRIT)
    r = surface_newton(p.source, p.target, approximant=kind, device="cpu", criteria=CRIT)
    # the point approximant (cell means) stops anywhere in a ~0.1-0.4° basin around the truth:
    # a 1e-7 m perturbation of the source moved its CPU result by up to 0.063° (seed 2;
    # 0.021° before its steps were stretched), so float32 device differences may too
    tol = 0.2 if kind == "point" else 0.05
    assert metrics.rotation_error(rc.transformation, r.transformation) < tol
    tree = KDTreeIndex(p.target.cuda(), leaf_size=8)
    co = approximant_coefficients(tree, kind)
    from pointalign.kernels.surface import triton as _surface_triton

    T = torch.as_tensor(p.T_target_source)
    o = torch.zeros(3, dtype=torch.float64)
    src = p.source.cuda()
    for depth in (3, tree.depth):
        got = _surface_triton.newton_terms(src, T, o, tree.arrays, co, depth)
        ref = ks.newton_terms_reference(src, T, o, tree.arrays, co, depth)
        assert torch.allclose(got, ref, rtol=1e-3, atol=1e-5 * float(ref.abs().max()))
    ra = approximate_icp(p.source, p.target, device="cuda", criteria=CRIT)
    assert metrics.rotation_error(ra.transformation, p.T_target_source) < 1.5


@pytest.mark.gpu
def test_approximate_icp_one_graph_for_every_level(seed, monkeypatch):
    """The level is an input of the step: from the third call on every level replays the
    kept graph (a graph per level evicted one another from the executor's LRU every call),
    with the poses, stops and iterations of the eager run."""
    from pointalign.kernels import _loop

    p = _pair(15.0, seed, n=20000)
    s, t = p.source.cuda(), p.target.cuda()
    _loop.clear_caches()
    runs = [approximate_icp(s, t, criteria=CRIT) for _ in range(3)]
    assert runs[-1].info["cuda_graph"] == "reused", runs[-1].info["cuda_graph"]
    assert runs[-1].info["tree_depth"] > LevelSchedule.for_tree(
        KDTreeIndex(t, leaf_size=8), None, cell_means=True).levels[0]  # several levels ran
    monkeypatch.setattr(_loop, "USE_GRAPHS", False)
    eager = approximate_icp(s, t, criteria=CRIT)
    for r in runs:
        assert r.iterations == eager.iterations and r.stop_reason == eager.stop_reason
        np.testing.assert_allclose(r.transformation, eager.transformation, atol=1e-6)
    _loop.clear_caches()
