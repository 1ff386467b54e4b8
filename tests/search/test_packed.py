"""search/packed.py: one index over many problems answers as each problem's own index.

Checked on the CPU with brute force inside (the packing is plain PyTorch) against one
brute-force index per problem: the same neighbours, except where a near-tie within the
rounding of the lattice shift (float32 at the lattice's extent) falls the other way, and
distances within that rounding; the device rule of
``choose_batch_index`` runs here with a device plan substituted, and ICP on a batch of
different targets through it equals ICP problem by problem.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pointalign import datasets
from pointalign.kernels import SearchPlan
from pointalign.registration.criteria import ConvergenceCriteria
from pointalign.registration.icp import icp
from pointalign.search import BruteForceIndex, policy
from pointalign.search.packed import PackedIndex

DEVICE = SearchPlan(host_tree=False, fused=True)


def _batch(g, sizes=(300, 120, 7, 250, 64)):
    """Problems of different sizes and places (one of them far off and 100x larger)."""
    M = max(sizes)
    pts = torch.full((len(sizes), M, 3), 1e3)  # padding far away: never returned
    for b, m in enumerate(sizes):
        scale = 100.0 if b == 3 else 1.0
        pts[b, :m] = torch.rand(m, 3, generator=g) * scale + 5.0 * b
    return pts, np.array(sizes)


def _bound(pix, r):
    """Squared distances of length <= r, each coordinate shifted and rounded once (float32
    at the lattice's extent E: |error| <= u = eps·E per coordinate of the difference):
    |Δ(d²)| <= 2·√3·u·r + 3u², doubled for the query's own rounding."""
    u = float(torch.finfo(torch.float32).eps) * float(pix.points.abs().max())
    return 2 * (2 * 3**0.5 * u * r + 3 * u * u)


def _same_or_tied(got, ref, query, points, tol):
    """Equal indices, or (where the lattice's rounding broke a near-tie the other way) indices
    whose true float64 squared distances from the query differ by at most ``tol``."""
    if torch.equal(got, ref):
        return True
    q, p = query.double(), points.double()

    def true_d(idx):
        d = ((q[:, None, :] - p[idx.clamp_min(0)]) ** 2).sum(-1)
        return torch.where(idx >= 0, d, torch.full_like(d, float("inf")))

    dg, dr = true_d(got), true_d(ref)
    both = torch.isfinite(dg) & torch.isfinite(dr)
    return bool(((got == ref) | (both & ((dg - dr).abs() <= tol))).all())


def test_nearest_within_and_knn_equal_each_problems_own_index(rng):
    pts, n = _batch(rng)
    B = len(n)
    pix = PackedIndex(pts, n, max_distance=0.3, build=BruteForceIndex)
    S = 40
    q = pts[:, :S] + 0.2 * (torch.rand(B, S, 3, generator=rng) - 0.5)   # near and off
    q[2] = pts[2, 0] + 50.0  # a problem whose queries have nothing within the bound
    near = pix.nearest_within(q.reshape(-1, 3), 0.3)
    # the knn rows are own target points (the normals' and the stability sample's queries)
    y = torch.stack([pts[b, torch.arange(S) % int(n[b])] for b in range(B)])
    knn = pix.knn(y.reshape(-1, 3), 9)
    for b in range(B):
        own = BruteForceIndex(pts[b, : n[b]])
        ref = own.nearest_within(q[b], 0.3)
        got = slice(b * S, (b + 1) * S)
        tol = _bound(pix, 0.3)
        assert _same_or_tied(near.idx[got], ref.idx, q[b], pts[b], tol)
        fin = torch.isfinite(ref.dists) & torch.isfinite(near.dists[got])
        # found by one and not the other only at the bound itself (a rounding apart)
        edge = torch.isfinite(ref.dists) ^ torch.isfinite(near.dists[got])
        assert bool((ref.dists[edge].clamp(max=1.0) >= 0.09 - tol).all())
        diff = (near.dists[got][fin] - ref.dists[fin]).abs()
        if diff.numel():
            assert float(diff.max()) <= tol
        k = min(9, int(n[b]))
        ref = own.knn(y[b], k)
        r_k = float(ref.dists[torch.isfinite(ref.dists)].max().sqrt())
        assert _same_or_tied(knn.idx[got, :k], ref.idx, y[b], pts[b], _bound(pix, r_k))
        assert bool((knn.idx[got, k:] == -1).all()) and bool(torch.isinf(knn.dists[got, k:]).all())
    assert bool((near.idx[2 * S:3 * S] == -1).all())


def test_radius_keeps_own_points_only(rng):
    pts, n = _batch(rng)
    pix = PackedIndex(pts, n, max_distance=0.5, build=BruteForceIndex)
    q = pts[:, :10].reshape(-1, 3)
    got = pix.radius(q, 0.5, 30)
    for b in range(len(n)):
        ref = BruteForceIndex(pts[b, : n[b]]).radius(pts[b, :10], 0.5, 30)
        assert _same_or_tied(got.idx[b * 10:(b + 1) * 10], ref.idx, pts[b, :10], pts[b],
                             _bound(pix, 0.5))


def test_bad_queries_and_lengths(rng):
    pts, n = _batch(rng)
    pix = PackedIndex(pts, n, max_distance=0.3, build=BruteForceIndex)
    with pytest.raises(ValueError, match="multiple of 5"):
        pix.nearest_within(torch.zeros(7, 3), 0.1)
    with pytest.raises(ValueError, match="lengths"):
        PackedIndex(pts, n[:-1], max_distance=0.3, build=BruteForceIndex)
    with pytest.raises(ValueError, match="lengths"):
        PackedIndex(pts, np.r_[n[:-1], 0], max_distance=0.3, build=BruteForceIndex)


def test_choose_batch_index_rule(rng, monkeypatch):
    pts, n = _batch(rng)
    assert policy.choose_batch_index(pts, n, max_distance=0.1) is None  # host: per problem
    monkeypatch.setattr(policy, "search_plan", lambda points: DEVICE)
    assert policy.choose_batch_index(pts[:1], n[:1], max_distance=0.1) is None  # one problem
    pix = policy.choose_batch_index(pts, n, max_distance=0.1)
    assert isinstance(pix, PackedIndex) and pix.points.shape == (int(n.sum()), 3)


def test_batched_icp_through_one_packed_index_equals_one_by_one(monkeypatch):
    """Different targets, the device rule: one PackedIndex serves the batch; each pose and
    iteration count equals ICP on that problem alone."""
    monkeypatch.setattr(policy, "search_plan", lambda points: DEVICE)
    bunny = datasets.load_bunny("bun000")
    pairs = [datasets.make_pair(datasets.random_subsample(bunny, m, seed=s), 8.0, 0.005,
                                noise=3e-4, seed=s) for s, m in enumerate((600, 450, 520))]
    N = max(p.source.shape[0] for p in pairs)
    M = max(p.target.shape[0] for p in pairs)
    src, tgt = torch.zeros(3, N, 3), torch.zeros(3, M, 3)
    for b, p in enumerate(pairs):
        src[b, : p.source.shape[0]], tgt[b, : p.target.shape[0]] = p.source, p.target
    sl = torch.tensor([p.source.shape[0] for p in pairs])
    tl = torch.tensor([p.target.shape[0] for p in pairs])
    crit = ConvergenceCriteria(max_iterations=20)
    res = icp(src, tgt, source_lengths=sl, target_lengths=tl, max_correspondence_distance=0.02,
              criteria=crit, device="cpu")
    assert res.info["index"] == "PackedIndex"
    for b, p in enumerate(pairs):
        one = icp(p.source, p.target, max_correspondence_distance=0.02, criteria=crit,
                  device="cpu")
        np.testing.assert_allclose(res.transformation[b], one.transformation, atol=1e-5)
        assert res.iterations[b] == one.iterations


def test_rows_naming_their_problem_answer_as_problem_order():
    """``problem=`` (any order, any count per problem) gives what the problem-order query
    gives for the same rows."""
    g = torch.Generator().manual_seed(3)
    pts, sizes = _batch(g)
    idx = PackedIndex(pts, sizes, max_distance=0.3, build=BruteForceIndex)
    B = pts.shape[0]
    q = torch.rand(B, 20, 3, generator=g) + 5.0 * torch.arange(B)[:, None, None]
    ordered = idx.nearest_within(q.reshape(-1, 3), 0.3)
    prob = torch.arange(B)[:, None].expand(B, 20).reshape(-1)
    perm = torch.randperm(B * 20, generator=g)
    named = idx.nearest_within(q.reshape(-1, 3)[perm], 0.3, problem=prob[perm])
    assert torch.equal(named.idx, ordered.idx[perm])
    assert torch.equal(named.dists, ordered.dists[perm])
    knn = idx.knn(q.reshape(-1, 3)[perm], 4, problem=prob[perm])
    assert torch.equal(knn.idx, idx.knn(q.reshape(-1, 3), 4).idx[perm])
    with pytest.raises(ValueError, match="problem"):
        idx.nearest_within(q.reshape(-1, 3), 0.3, problem=prob[:5])
