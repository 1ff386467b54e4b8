"""build_index: method selection, the cKDTree backend, validation."""

from __future__ import annotations

import pytest
import torch

from pointalign.search import BruteForceIndex, build_index
from pointalign.search.base import Index
from tests._backends import backends
from tests._oracles import assert_knn_matches


def _cloud(n, g):
    return torch.rand(n, 3, generator=g, dtype=torch.float64).float()


@pytest.mark.parametrize("method", ["brute", "ckdtree", "grid", "auto"])
def test_methods_agree_with_oracle(method, rng):
    q, p = _cloud(61, rng), _cloud(409, rng)
    ix = build_index(p, method, cell_size=0.1) if method == "grid" else build_index(p, method)
    assert isinstance(ix, Index)
    assert_knn_matches(ix.knn(q, 5), q, p, 5)
    assert_knn_matches(ix.radius(q, 0.09, 7), q, p, 7, max_distance=0.09)
    assert_knn_matches(ix.nearest_within(q, 0.05), q, p, 1, max_distance=0.05)


def test_auto_rule_cpu(rng):
    p = _cloud(50, rng)
    assert type(build_index(p)).__name__ == "CKDTreeIndex"
    assert isinstance(build_index(p, "brute"), BruteForceIndex)
    assert type(build_index(p, "grid", max_distance=0.2)).__name__ == "VoxelGridIndex"


def test_ckdtree_odd_sizes_duplicates_bunny(rng, bunny_pair):
    for n, m in [(1, 1), (3, 2), (17, 5)]:
        q, p = _cloud(n, rng), _cloud(m, rng)
        assert_knn_matches(build_index(p, "ckdtree").knn(q, m), q, p, m)
        assert_knn_matches(build_index(p, "ckdtree").radius(q, 0.5, m + 3), q, p, m + 3,
                           max_distance=0.5)
    p = _cloud(20, rng).repeat(2, 1)
    assert_knn_matches(build_index(p, "ckdtree").knn(p[:7], 4), p[:7], p, 4)
    q, p = bunny_pair.source[::5], bunny_pair.target
    assert_knn_matches(build_index(p, "ckdtree").nearest_within(q, 0.004), q, p, 1,
                       max_distance=0.004)


def test_ckdtree_float64(rng):
    q, p = _cloud(30, rng).double(), _cloud(70, rng).double()
    res = build_index(p, "ckdtree").knn(q, 3)
    assert res.dists.dtype == torch.float64
    assert_knn_matches(res, q, p, 3, rtol=1e-12, atol=1e-14)


def test_kdtree_method_is_clear_when_missing(rng):
    p = _cloud(10, rng)
    try:
        import pointalign.search.kdtree  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="kdtree"):
            build_index(p, "kdtree")
    else:
        assert isinstance(build_index(p, "kdtree"), Index)


def test_bad_input(rng):
    p = _cloud(10, rng)
    with pytest.raises(ValueError, match="method"):
        build_index(p, "octree")
    with pytest.raises(ValueError, match="points"):
        build_index(torch.empty(0, 3))
    with pytest.raises(ValueError, match="points"):
        build_index(torch.full((3, 3), float("nan")))
    with pytest.raises(ValueError, match="points"):
        build_index(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="cell_size"):
        build_index(p, "grid", cell_size=0)
    with pytest.raises(ValueError, match="max_distance"):
        build_index(p, max_distance=-1.0)
    for method in ("brute", "ckdtree", "grid"):
        ix = build_index(p, method, cell_size=0.2)
        with pytest.raises(ValueError, match="k"):
            ix.knn(p, 11)
        with pytest.raises(ValueError, match="max_distance"):
            ix.nearest_within(p, 0)


@pytest.mark.parametrize("method", ["auto", "brute", "grid", "ckdtree"])
def test_methods_on_device(method, rng, device):
    n, m = (3001, 30011) if device == "cuda" else (601, 6011)
    q, p = _cloud(n, rng).to(device), _cloud(m, rng).to(device)
    ix = build_index(p, method, max_distance=0.05) if method == "grid" else build_index(p, method)
    assert ix.points.device.type == device
    res = ix.nearest_within(q, 0.05)
    assert res.idx.device.type == device
    assert_knn_matches(res, q, p, 1, max_distance=0.05)
    assert_knn_matches(ix.knn(q[:500], 8), q[:500], p, 8)
    with pytest.raises(ValueError, match="query"):  # a query on another device
        ix.knn(q.to("cpu" if device == "cuda" else "meta"), 1)


@backends("triton")
def test_auto_rule_on_cuda(backend, rng):
    small, big = _cloud(5000, rng).cuda(), _cloud(50_000, rng).cuda()
    assert type(build_index(small, max_distance=0.05)).__name__ == "VoxelGridIndex"
    # a "maximum distance" as large as the cloud: the grid would scan everything
    assert isinstance(build_index(small, max_distance=10.0), BruteForceIndex)
    assert isinstance(build_index(small), BruteForceIndex)
    assert type(build_index(big)).__name__ in ("KDTreeIndex", "VoxelGridIndex")
