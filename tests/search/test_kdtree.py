"""KDTreeIndex: structure invariants, exact/approximate queries vs a SciPy oracle, payloads."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pointalign.datasets import random_subsample
from pointalign.search.base import Index
from pointalign.search.kdtree import KDTreeIndex
from tests._oracles import assert_knn_matches, knn_oracle

SIZES = [(1, 1), (1, 4), (2, 3), (3, 2), (7, 13), (31, 17), (97, 211), (1009, 89)]


def _cloud(n: int, g: torch.Generator, dtype=torch.float32, scale: float = 1.0):
    return (torch.rand(n, 3, generator=g, dtype=torch.float64) * scale).to(dtype)


def _check_structure(t: KDTreeIndex, pts: torch.Tensor) -> None:
    m = pts.shape[0]
    assert 2**t.depth <= m
    assert torch.equal(torch.sort(t.perm).values, torch.arange(m, device=t.device))
    assert torch.equal(t.tree_points, pts[t.perm])
    r = t.node_ranges
    assert r.shape == (t.n_nodes, 2)
    assert (r[:, 1] > r[:, 0]).all(), "no node may be empty"
    inner = torch.arange(2**t.depth - 1, device=t.device)
    # children split the parent's range exactly
    assert torch.equal(r[2 * inner + 1, 0], r[inner, 0])
    assert torch.equal(r[2 * inner + 1, 1], r[2 * inner + 2, 0])
    assert torch.equal(r[2 * inner + 2, 1], r[inner, 1])
    sizes = t.node_sizes()[2**t.depth - 1:]
    assert int(sizes.max()) - int(sizes.min()) <= 1, "balanced leaves"
    tp = t.tree_points.double().numpy()
    lo, hi = t.node_lo.double().numpy(), t.node_hi.double().numpy()
    rr = r.numpy()
    for level in range(t.depth + 1):
        ids = np.arange(2**level - 1, 2 ** (level + 1) - 1)
        starts = rr[ids, 0]
        assert np.array_equal(np.minimum.reduceat(tp, starts, axis=0), lo[ids])
        assert np.array_equal(np.maximum.reduceat(tp, starts, axis=0), hi[ids])
    inner = inner.numpy()
    ax = t.split_axis.numpy()
    sv = t.split_value.double().numpy()
    assert (ax[2**t.depth - 1:] == -1).all()
    if inner.size:
        left, right = 2 * inner + 1, 2 * inner + 2
        assert (hi[left, ax[inner]] <= sv[inner]).all()
        assert (sv[inner] <= lo[right, ax[inner]]).all()
        # the split axis is the axis of largest extent of the node's points
        ext = hi[inner] - lo[inner]
        assert np.allclose(ext[np.arange(inner.size), ax[inner]], ext.max(1))


@pytest.mark.parametrize("m", [1, 2, 3, 5, 16, 17, 97, 256, 1009])
@pytest.mark.parametrize("leaf_size", [1, 2, 7])
def test_structure(m, leaf_size, rng):
    pts = _cloud(m, rng)
    t = KDTreeIndex(pts, leaf_size=leaf_size)
    _check_structure(t, pts)
    # leaves hold at most leaf_size points unless the depth is capped by 2^D <= M
    assert t.leaf_size <= leaf_size or t.depth == int(math.log2(m))


@pytest.mark.parametrize("m", [2, 13, 500])
def test_host_and_device_builds_agree(m, rng):
    pts = _cloud(m, rng)
    a = KDTreeIndex(pts, leaf_size=3, build="device")
    b = KDTreeIndex(pts, leaf_size=3, build="host")
    _check_structure(b, pts)
    assert torch.equal(a.perm, b.perm)
    assert torch.equal(a.split_axis, b.split_axis)
    assert torch.allclose(a.split_value, b.split_value)


def test_depth_argument_and_clamp(rng):
    pts = _cloud(100, rng)
    assert KDTreeIndex(pts, depth=3).depth == 3
    assert KDTreeIndex(pts, depth=30).depth == 6  # 2^6 <= 100 < 2^7
    assert KDTreeIndex(pts, depth=0).n_nodes == 1
    assert KDTreeIndex(pts[:1], depth=5).depth == 0


def test_is_an_index(rng):
    assert isinstance(KDTreeIndex(_cloud(10, rng)), Index)


@pytest.mark.parametrize("m,n", SIZES)
@pytest.mark.parametrize("k", [1, 4])
def test_knn_matches_oracle(m, n, k, rng):
    pts, q = _cloud(m, rng), _cloud(n, rng, scale=1.3) - 0.15
    t = KDTreeIndex(pts, leaf_size=4)
    if k > m:
        with pytest.raises(ValueError, match="k"):
            t.knn(q, k)
        return
    assert_knn_matches(t.knn(q, k), q, pts, k)


@pytest.mark.parametrize("leaf_size", [1, 8, 64])
def test_knn_float64_and_leaf_sizes(leaf_size, rng):
    pts, q = _cloud(523, rng, torch.float64), _cloud(101, rng, torch.float64)
    res = KDTreeIndex(pts, leaf_size=leaf_size).knn(q, 9)
    assert res.dists.dtype == torch.float64
    assert_knn_matches(res, q, pts, 9, rtol=1e-12, atol=1e-12)


def test_duplicates_and_ties(rng):
    # a coarse grid: many identical points and many equidistant neighbours
    base = torch.randint(0, 4, (400, 3), generator=rng).float()
    pts = torch.cat([base, base[:150]], 0)
    q = torch.randint(0, 4, (60, 3), generator=rng).float() + 0.5
    t = KDTreeIndex(pts, leaf_size=5)
    _check_structure(t, pts)
    for k in (1, 6, 17):
        assert_knn_matches(t.knn(q, k), q, pts, k)
    # all points equal: every split is a tie
    same = torch.ones(37, 3)
    t = KDTreeIndex(same, leaf_size=2)
    _check_structure(t, same)
    d, i = t.knn(torch.zeros(3, 3), 5)
    assert torch.allclose(d, torch.full((3, 5), 3.0))
    assert all(len(set(row.tolist())) == 5 for row in i)


def test_bunny_scans(bunny_pair, seed):
    tgt = random_subsample(bunny_pair.target, 6000, seed)
    src = random_subsample(bunny_pair.source, 700, seed + 1)
    t = KDTreeIndex(tgt, leaf_size=16)
    assert_knn_matches(t.knn(src, 5), src, tgt, 5)
    assert_knn_matches(t.nearest_within(src, 0.002), src, tgt, 1, max_distance=0.002)
    assert_knn_matches(t.radius(src, 0.004, 12), src, tgt, 12, max_distance=0.004)


@pytest.mark.parametrize("r", [0.05, 0.2, 3.0])
@pytest.mark.parametrize("max_neighbors", [1, 7, 400])
def test_radius_matches_oracle(r, max_neighbors, rng):
    pts, q = _cloud(301, rng), _cloud(47, rng, scale=1.4) - 0.2
    res = KDTreeIndex(pts, leaf_size=6).radius(q, r, max_neighbors)
    assert_knn_matches(res, q, pts, max_neighbors, max_distance=r)


def test_no_neighbour_within_distance(rng):
    pts = _cloud(50, rng) + 10.0
    q = _cloud(8, rng)
    t = KDTreeIndex(pts, leaf_size=4)
    d, i = t.nearest_within(q, 1.0)
    assert d.shape == (8, 1) and torch.isinf(d).all() and (i == -1).all()
    d, i = t.radius(q, 1.0, 3)
    assert torch.isinf(d).all() and (i == -1).all()
    # k > points is padded for radius queries
    d, i = t.radius(q, 100.0, 60)
    assert (i[:, 50:] == -1).all() and (i[:, :50] >= 0).all()


def test_empty_query(rng):
    t = KDTreeIndex(_cloud(20, rng))
    d, i = t.knn(torch.empty(0, 3), 3)
    assert d.shape == (0, 3) and i.shape == (0, 3)
    assert t.descend(torch.empty(0, 3)).shape == (0,)


def test_approximate_searches_only_the_leaf(rng):
    pts, q = _cloud(800, rng), _cloud(120, rng)
    t = KDTreeIndex(pts, leaf_size=10)
    k = 3
    d, i = t.knn(q, k, approximate=True)
    exact = t.knn(q, k)
    leaf = t.descend(q)
    r = t.node_ranges[leaf]
    for row in range(q.shape[0]):
        members = t.perm[int(r[row, 0]):int(r[row, 1])]
        od, oi = knn_oracle(q[row:row + 1], pts[members], k)
        got = d[row].double().numpy()
        assert np.allclose(np.where(np.isinf(od[0]), -1, od[0]),
                           np.where(np.isinf(got), -1, got), atol=1e-6)
        valid = i[row] >= 0
        assert set(i[row][valid].tolist()) <= set(members.tolist())
    # never better than exact, and often exact for points near the data
    fin = torch.isfinite(d[:, 0])
    assert (d[fin, 0] >= exact.dists[fin, 0] - 1e-7).all()
    assert (d[:, 0] == exact.dists[:, 0]).float().mean() > 0.5


def test_descend_levels_are_consistent(rng):
    pts, q = _cloud(1000, rng), _cloud(200, rng)
    t = KDTreeIndex(pts, leaf_size=4)
    leaf = t.descend(q)
    assert ((leaf >= 2**t.depth - 1) & (leaf < t.n_nodes)).all()
    assert torch.equal(t.node_level(leaf), torch.full_like(leaf, t.depth))
    for level in range(t.depth + 1):
        node = t.descend(q, level)
        assert torch.equal(t.node_level(node), torch.full_like(node, level))
        # the ancestor of the leaf at this level
        anc = leaf.clone()
        for _ in range(t.depth - level):
            anc = (anc - 1) // 2
        assert torch.equal(node, anc)
    # tree points (distinct coordinates) descend to the leaf that owns them
    own = t.descend(pts)
    r = t.node_ranges[own]
    pos = torch.argsort(t.perm)
    assert ((pos >= r[:, 0]) & (pos < r[:, 1])).all()


def test_payloads_and_node_sums(rng):
    pts = _cloud(157, rng, torch.float64)
    t = KDTreeIndex(pts, leaf_size=5)
    sums = t.node_sums(pts)
    for i in (0, 1, 2, t.n_nodes - 1, t.n_nodes // 2):
        s, e = (int(v) for v in t.node_ranges[i])
        assert torch.allclose(sums[i], pts[t.perm[s:e]].sum(0))
    mean = sums / t.node_sizes()[:, None]
    t.attach("mean", mean)
    assert t.has_payload("mean")
    q = _cloud(33, rng, torch.float64)
    nodes = t.descend(q, 2)
    assert torch.equal(t.payload("mean", nodes), mean[nodes])
    assert t.payload("mean").shape == (t.n_nodes, 3)
    with pytest.raises(KeyError, match="nothing"):
        t.payload("nothing", nodes)
    with pytest.raises(ValueError, match="per_node"):
        t.attach("bad", torch.zeros(t.n_nodes + 1, 3))
    with pytest.raises(TypeError, match="per_node"):
        t.attach("bad", np.zeros((t.n_nodes, 3)))
    with pytest.raises(ValueError, match="values"):
        t.node_sums(pts[:-1])


def test_inputs_not_modified(rng):
    pts, q = _cloud(64, rng), _cloud(9, rng)
    p0, q0 = pts.clone(), q.clone()
    t = KDTreeIndex(pts, leaf_size=3)
    t.knn(q, 2)
    t.radius(q, 0.3, 4)
    assert torch.equal(pts, p0) and torch.equal(q, q0)


def test_numpy_input(rng):
    pts = _cloud(40, rng).numpy()
    t = KDTreeIndex(pts)
    assert_knn_matches(t.knn(pts[:5], 2), pts[:5], pts, 2)


def test_bad_inputs(rng):
    pts = _cloud(10, rng)
    with pytest.raises(ValueError, match="points"):
        KDTreeIndex(torch.zeros(5, 2))
    with pytest.raises(ValueError, match="points"):
        KDTreeIndex(torch.zeros(0, 3))
    with pytest.raises(ValueError, match="points"):
        KDTreeIndex(torch.tensor([[0.0, math.nan, 0.0]]))
    with pytest.raises(ValueError, match="leaf_size"):
        KDTreeIndex(pts, leaf_size=0)
    with pytest.raises(ValueError, match="depth"):
        KDTreeIndex(pts, depth=-1)
    with pytest.raises(ValueError, match="build"):
        KDTreeIndex(pts, build="gpu")
    t = KDTreeIndex(pts)
    with pytest.raises(ValueError, match="query"):
        t.knn(torch.zeros(3, 4), 1)
    with pytest.raises(ValueError, match="k"):
        t.knn(pts, 0)
    with pytest.raises(ValueError, match="k"):
        t.knn(pts, 11)
    with pytest.raises(ValueError, match="r"):
        t.radius(pts, -1.0, 3)
    with pytest.raises(ValueError, match="max_neighbors"):
        t.radius(pts, 1.0, 0)
    with pytest.raises(ValueError, match="max_distance"):
        t.nearest_within(pts, math.nan)
    with pytest.raises(ValueError, match="depth"):
        t.descend(pts, t.depth + 1)


@pytest.mark.parametrize("approximate", [False, True])
def test_device_matches_cpu_and_oracle(approximate, rng, device):
    m, n = (20011, 3001) if device == "cuda" else (4011, 601)
    pts, q = _cloud(m, rng), _cloud(n, rng, scale=1.2) - 0.1
    tc = KDTreeIndex(pts.to(device), leaf_size=16)
    t = KDTreeIndex(pts, leaf_size=16)
    assert torch.equal(tc.perm.cpu(), t.perm)
    rc = tc.knn(q.to(device), 8, approximate=approximate)
    r = t.knn(q, 8, approximate=approximate)
    assert torch.equal(torch.isinf(rc.dists.cpu()), torch.isinf(r.dists))
    fin = torch.isfinite(r.dists)
    assert torch.allclose(rc.dists.cpu()[fin], r.dists[fin], atol=1e-6)
    if not approximate:
        assert_knn_matches(rc, q, pts, 8)
        assert_knn_matches(tc.nearest_within(q.to(device), 0.01), q, pts, 1, max_distance=0.01)
        assert_knn_matches(tc.radius(q.to(device), 0.03, 32), q, pts, 32, max_distance=0.03)
