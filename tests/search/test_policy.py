"""search/policy.py: the index, tier and query-order choices as functions that can fail.

The pure rules (``index_method``, ``tier_cells``, ``wants_tiers``) are checked against
their table; ``choose_index`` / ``correspondence_index`` on real clouds, on the CPU with the
kernel layer's plan as it is and with a device plan substituted (so the GPU rule runs here
too, on the PyTorch references); the GPU tests check the rule on the bunny on the device.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pointalign.kernels import SearchPlan
from pointalign.kernels import grid as grid_mod
from pointalign.search import BruteForceIndex, build_index, policy
from pointalign.search.base import Index
from pointalign.search.grid import VoxelGridIndex, auto_cell_size
from pointalign.search.policy import (
    AUTO_BRUTE_MAX_POINTS,
    GRID_MAX_RATIO,
    SPATIAL_ORDER_MIN,
    TieredIndex,
    choose_index,
    correspondence_index,
    index_method,
    query_order,
    tier_cells,
    wants_tiers,
)
from tests._backends import backends
from tests._oracles import assert_knn_matches

HOST = SearchPlan(host_tree=True, fused=False)
DEVICE = SearchPlan(host_tree=False, fused=True)
DEVICE_TORCH = SearchPlan(host_tree=False, fused=False)  # e.g. POINTALIGN_BACKEND=torch


def _cloud(n, g):
    return torch.rand(n, 3, generator=g, dtype=torch.float64).float()


def _plane(n, g):
    """Points on z = 0 in the unit square, as range scans are surfaces."""
    p = _cloud(n, g)
    p[:, 2] = 0
    return p


# --- pure rules ------------------------------------------------------------------------------

@pytest.mark.parametrize("plan, m, distance, auto, want", [
    (HOST, 10, None, None, "ckdtree"),
    (HOST, 10**7, 0.01, 1.0, "ckdtree"),          # host memory: always SciPy's tree
    (DEVICE, 10, None, None, "brute"),
    (DEVICE, AUTO_BRUTE_MAX_POINTS, None, None, "brute"),
    (DEVICE, AUTO_BRUTE_MAX_POINTS + 1, None, None, "kdtree"),
    (DEVICE, 10**6, 0.05, 0.01, "grid"),           # 5 automatic cells <= 8
    (DEVICE, 10**6, GRID_MAX_RATIO * 0.01, 0.01, "grid"),  # the boundary is a grid
    (DEVICE, 10**6, 0.0801, 0.01, "kdtree"),       # just above: the k-d tree
    (DEVICE, 5000, 10.0, 0.09, "brute"),           # a bound as large as the cloud, few points
    (DEVICE, 10**6, 0.05, None, "kdtree"),         # no automatic cell measured: no grid
    (DEVICE_TORCH, 10**6, 0.05, 0.01, "grid"),     # on a device without Triton: same rule
])
def test_index_method_table(plan, m, distance, auto, want):
    assert index_method(plan, m, distance, auto) == want


def test_grid_scan_counts_points_as_the_points_see_their_cells():
    """Σ n_c² / M of the cells of the grid: 3 points in one cell and 1 alone -> (9 + 1) / 4."""
    p = torch.tensor([[0.1, 0.1, 0.1], [0.2, 0.2, 0.2], [0.3, 0.1, 0.2], [5.5, 5.5, 5.5]])
    assert VoxelGridIndex(p, 1.0).scan == pytest.approx(10 / 4)


def test_knn_callers_get_the_tree_not_a_grid(rng, monkeypatch):
    """Device rule on the CPU: a caller that also needs k-NN gets the k-d tree (or brute
    force on a small cloud) at a distance where the ratio rule alone keeps a grid, and no
    grid is built to be dropped."""
    monkeypatch.setattr(policy, "search_plan", lambda points: DEVICE)
    monkeypatch.setattr(policy, "AUTO_BRUTE_MAX_POINTS", 500)
    even = _plane(3000, rng)
    d = 2 * auto_cell_size(even)
    assert isinstance(choose_index(even, max_distance=d), VoxelGridIndex)  # the ratio rule
    built = []
    real = VoxelGridIndex.__init__

    def counting(self, *args, **kwargs):
        built.append(args)
        real(self, *args, **kwargs)

    monkeypatch.setattr(VoxelGridIndex, "__init__", counting)
    assert type(choose_index(even, max_distance=d, knn=True)).__name__ == "KDTreeIndex"
    assert not built
    monkeypatch.setattr(policy, "AUTO_BRUTE_MAX_POINTS", 5000)
    assert isinstance(choose_index(even, max_distance=d, knn=True), BruteForceIndex)


def test_tier_cells_table():
    assert tier_cells(10.0, 1.0) == [2.0]           # 8 > 10 / 2
    assert tier_cells(16.0, 1.0) == [2.0, 8.0]      # both at most half the bound
    assert tier_cells(100.0, 1.0) == [2.0, 8.0]     # at most TIERS
    assert tier_cells(3.9, 1.0) == []               # the finest is above half the bound
    assert tier_cells(4.0, 1.0) == [2.0]
    assert tier_cells(1.0, 0.01) == [0.02, 0.08]


@backends("torch")  # SciPy's tree (the "cpu" one reads hints)
def test_wants_tiers_table(backend, rng):
    p = _plane(800, rng)
    auto = auto_cell_size(p)
    coarse = VoxelGridIndex(p, 3 * GRID_MAX_RATIO * auto)
    fine = VoxelGridIndex(p, GRID_MAX_RATIO * auto * 0.99)
    tree, brute, host = build_index(p, "kdtree"), BruteForceIndex(p), build_index(p, "ckdtree")
    assert wants_tiers(DEVICE, coarse, auto)
    assert wants_tiers(DEVICE, host, auto)          # a host tree over device points
    assert not wants_tiers(DEVICE, fine, auto)       # one pass is cheaper
    assert not wants_tiers(DEVICE, tree, auto)       # reads hints
    assert not wants_tiers(DEVICE, brute, auto)      # cost does not drop
    for ix in (coarse, host):
        assert not wants_tiers(DEVICE_TORCH, ix, auto)  # PyTorch references: never
        assert not wants_tiers(HOST, ix, auto)


# --- choose_index ----------------------------------------------------------------------------

def test_choose_index_on_the_cpu(rng):
    p = _cloud(300, rng)
    for md in (None, 0.01, 10.0):
        ix = choose_index(p, max_distance=md)
        assert type(ix).__name__ == "CKDTreeIndex" and isinstance(ix, Index)
        assert type(build_index(p, max_distance=md)) is type(ix)
    with pytest.raises(ValueError, match="max_distance"):
        choose_index(p, max_distance=0.0)
    with pytest.raises(ValueError, match="points"):
        choose_index(torch.zeros(0, 3))


def test_choose_index_with_a_device_plan(rng, monkeypatch):
    """The device rule, run here on the CPU: grid, brute force or k-d tree."""
    monkeypatch.setattr(policy, "search_plan", lambda points: DEVICE)
    monkeypatch.setattr(policy, "AUTO_BRUTE_MAX_POINTS", 500)
    small, big = _plane(400, rng), _plane(900, rng)
    auto = auto_cell_size(small)
    ix = choose_index(small, max_distance=2 * auto)
    assert isinstance(ix, VoxelGridIndex) and ix.cell_size == pytest.approx(2 * auto, rel=1e-4)
    assert isinstance(choose_index(small, max_distance=10.0), BruteForceIndex)
    assert isinstance(choose_index(small), BruteForceIndex)
    assert type(choose_index(big)).__name__ == "KDTreeIndex"
    assert type(choose_index(big, max_distance=10.0)).__name__ == "KDTreeIndex"
    # build_index("auto") is the same rule; cell_size stands in for max_distance
    assert isinstance(build_index(small, max_distance=2 * auto), VoxelGridIndex)
    assert isinstance(build_index(small, cell_size=2 * auto), VoxelGridIndex)
    assert isinstance(build_index(small, max_distance=10.0), BruteForceIndex)
    q = small[:50] + 0.001
    assert_knn_matches(choose_index(big).nearest_within(q, 0.05), q, big, 1, max_distance=0.05)


def test_probe_index_rule(rng, monkeypatch):
    """A few queries once: cKDTree on the host, else the method's own index, brute force while
    queries x points are few, the k-d tree above; every choice answers exactly."""
    small, big = _plane(400, rng), _plane(900, rng)
    host = policy.probe_index(small, 100)
    assert type(host).__name__ == "CKDTreeIndex"
    assert policy.probe_index(small, 100, index=host) is host
    own = BruteForceIndex(small)  # the host's tree is preferred to a method's own index
    assert type(policy.probe_index(small, 100, index=own)).__name__ == "CKDTreeIndex"
    monkeypatch.setattr(policy, "search_plan", lambda points: DEVICE)
    monkeypatch.setattr(policy, "PROBE_BRUTE_MAX_PAIRS", 100 * 500)
    monkeypatch.setattr(policy, "AUTO_BRUTE_MAX_POINTS", 500)  # above: choose_index's rule
    assert policy.probe_index(big, 100, index=own) is own
    assert isinstance(policy.probe_index(small, 100), BruteForceIndex)
    ix = policy.probe_index(big, 100)
    assert type(ix).__name__ == "KDTreeIndex"
    q = big[:50] + 0.001
    assert_knn_matches(ix.knn(q, 4), q, big, 4)


# --- correspondence_index --------------------------------------------------------------------

def test_correspondence_index_on_the_cpu_is_the_index(rng):
    p = _plane(500, rng)
    for method in ("brute", "grid", "kdtree", "ckdtree"):
        ix = build_index(p, method, max_distance=0.5)
        assert correspondence_index(ix, 0.5) is ix  # PyTorch references: no tiers
    with pytest.raises(ValueError, match="max_distance"):
        correspondence_index(ix, -1.0)


@backends("torch")  # SciPy's tree (the "cpu" one reads hints)
def test_correspondence_index_with_a_device_plan(backend, rng, monkeypatch):
    monkeypatch.setattr(policy, "search_plan", lambda points: DEVICE)
    p = _plane(600, rng)
    auto = auto_cell_size(p)
    md = 20 * auto  # above GRID_MAX_RATIO automatic cells
    coarse = VoxelGridIndex(p, md)
    tiered = correspondence_index(coarse, md)
    assert isinstance(tiered, TieredIndex) and tiered.index is coarse
    assert [t.cell_size for t in tiered.tiers] == pytest.approx(tier_cells(md, auto), rel=1e-4)
    assert len(tiered.tiers) == 2
    # built once per index: a second call reads the same grids, and the two wrappers are
    # equal, so an executor's graph signature (objects named by identity) is the same
    again = correspondence_index(coarse, md)
    assert all(a is b for a, b in zip(again.tiers, tiered.tiers, strict=True))
    assert again == tiered and hash(again) == hash(tiered)
    from pointalign.kernels._loop import signature

    key1, objs1 = signature(_Step((tiered,), md))
    key2, objs2 = signature(_Step((again,), md))
    assert key1 == key2 and all(a is b for a, b in zip(objs1, objs2, strict=True))
    assert coarse in objs1  # the index itself is named, so a graph dies with it
    # a bound whose half is below the finest tier: no tiers
    assert correspondence_index(coarse, 3 * auto) is coarse
    for ix in (VoxelGridIndex(p, 2 * auto), BruteForceIndex(p), build_index(p, "kdtree")):
        assert correspondence_index(ix, md) is ix
    host = build_index(p, "ckdtree")
    assert isinstance(correspondence_index(host, md), TieredIndex)
    g = torch.Generator().manual_seed(3)
    q = _cloud(200, g) * 1.2 - 0.1
    q[:, 2] *= 0.3
    assert_knn_matches(tiered.nearest_within(q, md), q, p, 1, max_distance=md)


@dataclasses.dataclass(frozen=True)
class _Step:
    """A step like ICP's: the correspondence indexes and the bound are its fields."""

    indexes: tuple
    max_distance: float


# --- query_order ----------------------------------------------------------------------------

def test_query_order(rng):
    assert query_order(_cloud(SPATIAL_ORDER_MIN - 1, rng)) is None
    p = _cloud(SPATIAL_ORDER_MIN, rng)
    o = query_order(p)
    assert o.dtype == torch.int64
    assert torch.equal(torch.sort(o).values, torch.arange(p.shape[0]))
    # coherent: consecutive queries are much closer than in the given (random) order
    step = (p[o][1:] - p[o][:-1]).norm(dim=1).mean()
    assert step < 0.25 * (p[1:] - p[:-1]).norm(dim=1).mean()


def test_morton_order_of_the_cube_corners(rng):
    from pointalign.kernels.grid import morton_order

    corners = torch.tensor([[x, y, z] for z in (0, 1) for y in (0, 1) for x in (0, 1)],
                           dtype=torch.float32)  # Z-order: x fastest, then y, then z
    shuffle = torch.randperm(8, generator=rng)
    o = morton_order(corners[shuffle])
    assert torch.equal(corners[shuffle][o], corners)


# --- GPU: the rule on the bunny, tiers exact ------------------------------------------------

@backends("triton")
def test_choose_index_rule_on_cuda(backend):
    """Replaces test_icp's test_cuda_default_index_rule (which accepted either index)."""
    from pointalign import datasets

    t = datasets.load_bunny("bun000").cuda()
    assert policy.search_plan(t) == DEVICE
    assert t.shape[0] > AUTO_BRUTE_MAX_POINTS
    assert 0.002 <= GRID_MAX_RATIO * auto_cell_size(t) < 0.05
    assert isinstance(choose_index(t, max_distance=0.002), VoxelGridIndex)
    assert type(choose_index(t, max_distance=0.05)).__name__ == "KDTreeIndex"
    assert type(choose_index(t)).__name__ == "KDTreeIndex"
    assert isinstance(choose_index(t[:5000]), BruteForceIndex)


@backends("triton")
@pytest.mark.parametrize("method", ["grid", "kdtree"])
def test_correspondence_index_on_cuda_is_exact(backend, seed, method):
    from pointalign import _validate, datasets

    t = datasets.load_bunny("bun000").cuda()
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = t[::2] + 0.004 * torch.randn(t[::2].shape, device="cuda", generator=g)
    q[:500] += 0.03
    md = 0.05
    ix = build_index(t, method, max_distance=md)
    cix = correspondence_index(ix, md)
    if method == "kdtree":  # reads hints instead: no tiers
        assert cix is ix
    else:
        assert isinstance(cix, TieredIndex) and len(cix.tiers) == 2
    hint = torch.randint(-1, t.shape[0], (q.shape[0],), device="cuda", generator=g)
    hint[::3] = ix.nearest_within(q, md).idx[::3, 0]
    with _validate.trusted():
        got = cix.nearest_within(q.contiguous(), md, hint=hint if cix.uses_hint else None)
    want = ix.nearest_within(q, md)
    assert torch.equal(got.idx >= 0, want.idx >= 0)
    torch.testing.assert_close(got.dists, want.dists)
    assert_knn_matches(got, q, t, 1, max_distance=md)


def test_morton_codes_in_chunks_equal_one_pass(rng, monkeypatch):
    from pointalign.kernels.grid import reference as grid_ref

    pts = torch.rand(1000, 3, generator=rng)
    one = grid_ref.morton_codes_reference(pts)
    monkeypatch.setattr(grid_ref, "_MORTON_CHUNK", 7)
    assert torch.equal(grid_ref.morton_codes_reference(pts), one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_morton_order_on_the_cpu_sorts_the_reference_codes(rng, dtype):
    """The numba pass computes the reference's codes bit for bit (the same rounded
    operations in the points' dtype); the order is their stable sort."""
    from pointalign import datasets
    from pointalign.kernels import _backend
    from pointalign.kernels.grid import cpu as grid_cpu
    from pointalign.kernels.grid import reference as grid_ref

    if not _backend.cpu_available():
        pytest.skip("numba is not installed")
    clouds = [torch.rand(5000, 3, generator=rng) * 37.0 - 3.0,
              datasets.load_bunny("bun000") + 1e3,               # far from the origin
              torch.rand(300, 3, generator=rng).round(decimals=1)]  # many equal codes
    for p in (c.to(dtype) for c in clouds):
        codes = grid_ref.morton_codes_reference(p)
        out = np.empty(p.shape[0], np.int32)
        grid_cpu._morton_codes(p.numpy(), out)
        assert torch.equal(torch.from_numpy(out), codes)
        order = grid_mod.morton_order(p)
        assert torch.equal(order, torch.from_numpy(np.argsort(codes.numpy(), kind="stable")))


def test_correspondence_index_reuses_the_automatic_cell_of_choose_index(rng, monkeypatch):
    """The automatic cell measured to choose an index (a sort and three synchronisations on a
    device) is kept with it: ICP's correspondence_index does not measure it again."""
    from pointalign.search import grid

    monkeypatch.setattr(policy, "search_plan", lambda points: DEVICE)
    calls = []
    measure = grid.auto_cell_size
    monkeypatch.setattr(grid, "auto_cell_size", lambda p, *a: calls.append(1) or measure(p, *a))
    p = _plane(2000, rng)
    d = 2 * measure(p)
    ix = choose_index(p, max_distance=d)
    assert isinstance(ix, VoxelGridIndex) and len(calls) == 1
    assert correspondence_index(ix, d) is ix  # a fine grid: no tiers
    assert len(calls) == 1
    other = VoxelGridIndex(p, d)  # built by hand: measured on first use, then kept
    correspondence_index(other, d)
    correspondence_index(other, d)
    assert len(calls) == 2
