"""multiway: the edge information's meaning, the robust pose graph (both solvers) on
synthetic graphs with false edges, candidate edges, merge, bad input, and the ten
Stanford bunny scans against bun.conf (each scan within 1° and 3 mm).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pointalign import datasets, io, metrics, transforms
from pointalign.registration import multiway as mw
from pointalign.registration.multiway import candidate_edges, merge, multiway

BUNNY = ["bun000", "bun045", "bun090", "bun180", "bun270", "bun315", "chin", "ear_back",
         "top2", "top3"]


def _rt(deg, dist, seed):
    return transforms.random_transform(deg, dist, generator=torch.Generator().manual_seed(seed)
                                       ).numpy()


def test_edge_information_is_mean_squared_displacement(seed):
    """eᵀ Ω e = mean (n·Δy)² / v² to first order, for the measured Z moved by Exp(e)."""
    rng = np.random.default_rng(seed)
    n_pts, v = 400, 0.004
    y = rng.normal(size=(n_pts, 3)) * 0.05 + np.array([0.3, -0.2, 0.1])   # target frame i
    nrm = rng.normal(size=(n_pts, 3))
    nrm /= np.linalg.norm(nrm, axis=1, keepdims=True)
    c = y.mean(0)
    J = np.concatenate([np.cross(y - c, nrm), nrm], 1)
    H = J.T @ J                                          # ICP's H about the centroid
    Z = _rt(30.0, 0.1, seed)                             # T_i_j
    omega = mw.edge_information(H, c, Z, n_pts, v)
    x = (np.linalg.inv(Z) @ np.c_[y, np.ones(n_pts)].T).T[:, :3]   # the source points
    for k in range(3):
        e = rng.normal(size=6) * np.array([1e-4] * 3 + [1e-6] * 3)
        moved = (Z @ mw._exp(e) @ np.c_[x, np.ones(n_pts)].T).T[:, :3]
        disp = ((moved - y) * nrm).sum(1)
        ms = float((disp ** 2).mean()) / v**2
        assert e @ omega @ e == pytest.approx(ms, rel=1e-3), k


def _graph(seed, outliers):
    n = 8
    X = np.stack([np.eye(4)] + [_rt(25.0 * k, 0.05, seed * 100 + k) for k in range(1, n)])
    ij = np.array([(i, j) for i in range(n) for j in range(i + 1, n) if j - i <= 3])
    Z = np.stack([np.linalg.inv(X[i]) @ X[j] @ _rt(0.1, 2e-4, seed * 100 + 50 + e)
                  for e, (i, j) in enumerate(ij)])
    for e in outliers:
        Z[e] = Z[e] @ _rt(30.0 + 20 * e, 0.04, seed + e)
    # a voxel of 4 mm; information of ~1 correspondence per 0.1 m lever: ω ~ 10 m, v ~ 1/v
    L = np.stack([np.linalg.cholesky(np.diag([25.0] * 3 + [1 / 0.004**2] * 3))] * len(ij))
    X0 = X @ np.stack([np.eye(4)] + [_rt(2.0, 0.003, seed * 100 + 80 + k)
                                     for k in range(1, n)])
    return mw._Graph(n, ij, Z, L), X, X0


@pytest.mark.parametrize("solver", ["scipy", "gtsam"])
def test_gnc_prunes_false_edges(seed, solver):
    if solver == "gtsam":
        pytest.importorskip("gtsam")
    outliers = [2, 9]
    g, X, X0 = _graph(seed, outliers)
    solve = mw._gnc_gtsam if solver == "gtsam" else mw._gnc_scipy
    Xs, w = solve(g, X0, mw.MAX_DISPLACEMENT ** 2)
    assert sorted(np.nonzero(w < 0.5)[0].tolist()) == outliers
    # the inliers' noise is 0.1°, 0.2 mm per edge, and a pose is at most 7 edges from scan
    # 0: within 0.7°, and 0.7° over a lever of 0.35 m (7 × 5 cm) plus 7 × 0.2 mm: 6 mm
    for k in range(g.n):
        rot, trans = metrics.relative_error(Xs[k], X[k])
        assert rot < 0.7 and trans < 6e-3, (k, rot, trans)
    np.testing.assert_array_equal(Xs[0], np.eye(4))


def test_solvers_agree(seed):
    pytest.importorskip("gtsam")
    g, X, X0 = _graph(seed, [4])
    Xa, wa = mw._gnc_scipy(g, X0, 1.0)
    Xb, wb = mw._gnc_gtsam(g, X0, 1.0)
    np.testing.assert_array_equal(wa > 0.5, wb > 0.5)
    for k in range(g.n):
        rot, trans = metrics.relative_error(Xa[k], Xb[k])
        assert rot < 0.01 and trans < 2e-5


def test_candidate_edges():
    clouds = [datasets.random_subsample(datasets.load_bunny("bun000"), 200, seed=k)
              for k in range(6)]
    assert len(candidate_edges(clouds, "all", 1, 0)) == 15
    ring = candidate_edges(clouds, "neighbours", 1, 0)
    assert ring == [(0, 1), (0, 5), (1, 2), (2, 3), (3, 4), (4, 5)]
    more = candidate_edges(clouds, "neighbours", 2, 3)
    assert set(ring) < set(more) and len(more) == 9 + 1 + 3  # 2 ahead, (0, 5), 3 closures
    assert candidate_edges(clouds, [(3, 1), (1, 3), (0, 2)], 1, 0) == [(0, 2), (1, 3)]
    with pytest.raises(ValueError, match="edges"):
        candidate_edges(clouds, "ring", 1, 0)
    with pytest.raises(ValueError, match="edges"):
        candidate_edges(clouds, [(0, 6)], 1, 0)
    with pytest.raises(ValueError, match="edges"):
        candidate_edges(clouds, [(2, 2)], 1, 0)


def test_merge():
    a = datasets.random_subsample(datasets.load_bunny("bun000"), 300, seed=1)
    b = datasets.random_subsample(datasets.load_bunny("bun000"), 200, seed=2)
    T = _rt(20.0, 0.05, 3)
    moved = transforms.apply(torch.from_numpy(np.linalg.inv(T)), b.double()).float()
    out = merge([a, moved], np.stack([np.eye(4), T]))
    assert out.points.shape == (500, 3)
    torch.testing.assert_close(out.points[300:], b, atol=1e-6, rtol=0)
    assert merge([a, moved], np.stack([np.eye(4), T]), voxel_size=0.01).points.shape[0] < 500
    with pytest.raises(ValueError, match="poses"):
        merge([a, b], np.eye(4)[None])


def test_bad_input():
    a = datasets.random_subsample(datasets.load_bunny("bun000"), 100, seed=1)
    with pytest.raises(ValueError, match="scans"):
        multiway([a])
    with pytest.raises(ValueError, match="scans"):
        multiway("scans.ply")
    with pytest.raises(ValueError, match="solver"):
        multiway([a, a], solver="ceres")
    with pytest.raises(ValueError, match="max_displacement"):
        multiway([a, a], max_displacement=0)
    with pytest.raises(ValueError, match="refine"):
        multiway([a, a], refine=-1)
    with pytest.raises(ValueError, match="scans\\[1\\]"):
        multiway([a, a[:2]])


@pytest.mark.slow
def test_bunny_ten_scans_within_1deg_3mm(shared_data):
    """All ten scans (4,000 points each, a random sample) against bun.conf.

    The frames agree (scan 0 is bun000, bun.conf's identity), so each scan's pose is
    compared with bun.conf directly: the angle of inv(T_true) T_est and its translation.
    """
    d = shared_data / "stanford_bunny" / "data"
    truth = datasets.read_bun_conf((d / "bun.conf").read_text())
    scans = [datasets.random_subsample(io.read(d / f"{k}.ply").points.float(), 4000, seed=0)
             for k in BUNNY]
    res = multiway(scans, device="cpu", target_points=1500, hypotheses=2048)
    assert res.poses.shape == (10, 4, 4) and len(res.edges) == 45
    P0 = truth["bun000.ply"].numpy()
    for k, name in enumerate(BUNNY):
        rot, trans = metrics.relative_error(res.poses[k], np.linalg.inv(P0)
                                            @ truth[name + ".ply"].numpy())
        assert rot < 1.0 and trans < 3e-3, (name, rot, trans)
    kept = [e for e in res.edges if e["kept"]]
    assert len(kept) >= 9 and all(e["residual"] <= mw.MAX_DISPLACEMENT for e in kept)
    merged = res.merge(scans, voxel_size=0.002)
    assert 0 < merged.points.shape[0] < 40000
