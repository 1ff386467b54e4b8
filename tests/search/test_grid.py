"""VoxelGridIndex vs the SciPy cKDTree oracle (the grid kernels: tests/kernels/test_grid.py)."""

from __future__ import annotations

import pytest
import torch

from pointalign.search.base import Index
from pointalign.search.grid import VoxelGridIndex, auto_cell_size
from tests._oracles import assert_knn_matches


def _cloud(n, g, dtype=torch.float32):
    return torch.rand(n, 3, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("m", [1, 2, 3, 101, 997])
@pytest.mark.parametrize("cell", [None, 0.07, 0.3])
def test_knn_exact_any_cell(m, cell, rng):
    q = _cloud(53, rng) * 1.4 - 0.2  # some queries outside the box
    p = _cloud(m, rng)
    ix = VoxelGridIndex(p, cell)
    assert isinstance(ix, Index)
    for k in sorted({1, min(m, 5)}):
        assert_knn_matches(ix.knn(q, k), q, p, k)


@pytest.mark.parametrize("bound", [0.04, 0.1, 0.25])  # <, =, > the cell edge
def test_nearest_within_and_radius(bound, rng, dtype):
    q, p = _cloud(97, rng, dtype), _cloud(1009, rng, dtype)
    ix = VoxelGridIndex(p, 0.1)
    res = ix.nearest_within(q, bound)
    assert res.dists.dtype == dtype
    assert_knn_matches(res, q, p, 1, max_distance=bound)
    assert_knn_matches(ix.radius(q, bound, 6), q, p, 6, max_distance=bound)
    assert_knn_matches(ix.nearest_within(q, bound), q, p, 1, max_distance=bound)  # cached


def test_small_bound_uses_finer_grid(rng):
    q, p = _cloud(150, rng), _cloud(5000, rng)
    ix = VoxelGridIndex(p, 0.4)
    for bound in (0.03, 0.06, 0.15):
        assert_knn_matches(ix.nearest_within(q, bound), q, p, 1, max_distance=bound)
        assert_knn_matches(ix.radius(q, bound, 4), q, p, 4, max_distance=bound)
    assert any(g.cell < 0.4 for g in ix._grids.values())  # a finer grid served them


def test_duplicates_and_flat_cloud(rng):
    p = _cloud(50, rng).repeat(4, 1)
    ix = VoxelGridIndex(p, 0.1)
    res = ix.knn(p[:9], 4)
    assert_knn_matches(res, p[:9], p, 4)
    assert torch.all(res.dists == 0)
    flat = _cloud(300, rng)
    flat[:, 2] = 0.5  # a plane: zero extent along z
    ix = VoxelGridIndex(flat)
    q = _cloud(40, rng)
    assert_knn_matches(ix.knn(q, 3), q, flat, 3)
    assert_knn_matches(ix.nearest_within(q, 0.05), q, flat, 1, max_distance=0.05)


def test_far_queries_and_no_neighbour(rng):
    p = _cloud(200, rng)
    q = torch.cat([_cloud(5, rng) + 7.0, _cloud(5, rng) - 3.0, _cloud(5, rng)])
    ix = VoxelGridIndex(p, 0.05)
    assert_knn_matches(ix.knn(q, 3), q, p, 3)  # coarser levels, then brute force
    res = ix.nearest_within(q, 0.05)
    assert (res.idx[:10] == -1).all() and torch.isinf(res.dists[:10]).all()
    assert_knn_matches(res, q, p, 1, max_distance=0.05)


def test_max_cells_grows_cells(rng):
    p = _cloud(400, rng)
    p[0] = 100.0  # a far outlier stretches the box
    ix = VoxelGridIndex(p, 0.01, max_cells=4096)
    assert ix.cell_size > 0.01
    assert ix.grid.dims[0] * ix.grid.dims[1] * ix.grid.dims[2] <= 4096
    q = _cloud(30, rng)
    assert_knn_matches(ix.nearest_within(q, 0.01), q, p, 1, max_distance=0.01)
    assert_knn_matches(ix.knn(q, 2), q, p, 2)


def test_bunny(bunny_pair):
    p = bunny_pair.target
    q = bunny_pair.source[::37]
    ix = VoxelGridIndex(p, 0.004)
    assert_knn_matches(ix.nearest_within(q, 0.004), q, p, 1, max_distance=0.004)
    assert_knn_matches(ix.nearest_within(q, 0.002), q, p, 1, max_distance=0.002)
    c = auto_cell_size(p)
    assert 5e-4 < c < 1e-2  # bunny scans are about 0.15 m across, 40k points


def test_bad_input(rng):
    p = _cloud(20, rng)
    with pytest.raises(ValueError, match="cell_size"):
        VoxelGridIndex(p, 0.0)
    with pytest.raises(ValueError, match="cell_size"):
        VoxelGridIndex(p, float("inf"))
    with pytest.raises(ValueError, match="points"):
        VoxelGridIndex(torch.empty(0, 3), 0.1)
    with pytest.raises(ValueError, match="points"):
        VoxelGridIndex(torch.tensor([[0.0, float("nan"), 1.0]]), 0.1)
    ix = VoxelGridIndex(p, 0.1)
    with pytest.raises(ValueError, match="k"):
        ix.knn(p, 21)
    with pytest.raises(ValueError, match="max_distance"):
        ix.nearest_within(p, -0.1)
    with pytest.raises(ValueError, match="query"):
        ix.knn(p[:, :2], 1)
    with pytest.raises(ValueError, match="r"):
        ix.radius(p, 0, 2)


def test_bunny_nearest_within_on_device(bunny_pair, device):
    q = bunny_pair.source if device == "cuda" else bunny_pair.source[::7]
    p, q = bunny_pair.target.to(device), q.to(device)
    ix = VoxelGridIndex(p, 0.005)
    res = ix.nearest_within(q, 0.005)
    assert res.idx.device.type == device
    assert_knn_matches(res, q, p, 1, max_distance=0.005)
    assert_knn_matches(ix.knn(q, 8), q, p, 8)
