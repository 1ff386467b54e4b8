"""BruteForceIndex vs the SciPy cKDTree oracle: random, odd sizes, duplicates, bunny, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pointalign import _validate
from pointalign.search import BruteForceIndex
from pointalign.search.base import Index, KnnResult
from tests._oracles import assert_knn_matches


def _cloud(n, g, dtype=torch.float32):
    return torch.rand(n, 3, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("n,m", [(1, 1), (2, 3), (3, 2), (13, 101), (257, 31)])
def test_knn_matches_oracle(n, m, rng, device, dtype):
    q, p = _cloud(n, rng, dtype).to(device), _cloud(m, rng, dtype).to(device)
    ix = BruteForceIndex(p)
    assert isinstance(ix, Index)
    for k in sorted({1, min(m, 4), m}):
        res = ix.knn(q, k)
        assert isinstance(res, KnnResult) and res.dists.device == q.device
        assert res.dists.dtype == dtype
        assert_knn_matches(res, q, p, k)


def test_radius_and_nearest_within(rng, device):
    q, p = _cloud(71, rng).to(device), _cloud(293, rng).to(device)
    ix = BruteForceIndex(p)
    assert_knn_matches(ix.radius(q, 0.12, 9), q, p, 9, max_distance=0.12)
    assert_knn_matches(ix.radius(q, 0.2, 400), q, p, 400, max_distance=0.2)  # > M: padding
    assert_knn_matches(ix.nearest_within(q, 0.03), q, p, 1, max_distance=0.03)
    for _ in range(2):  # the trusted path, twice (both calls read the kept layout)
        with _validate.trusted():
            res = ix.nearest_within(q, 0.03)
        assert_knn_matches(res, q, p, 1, max_distance=0.03)


def test_duplicates_compare_distances(rng):
    p = _cloud(40, rng).repeat(3, 1)  # every point three times
    q = torch.cat([_cloud(20, rng), p[:5]])
    res = BruteForceIndex(p).knn(q, 6)
    assert_knn_matches(res, q, p, 6)
    assert torch.all(res.dists[-5:, :3] == 0)


def test_no_neighbour(rng):
    p = _cloud(10, rng)
    q = _cloud(4, rng) + 5.0
    res = BruteForceIndex(p).nearest_within(q, 0.5)
    assert (res.idx == -1).all() and torch.isinf(res.dists).all()


def test_bunny(bunny_pair):
    q, p = bunny_pair.source[::41], bunny_pair.target[::2]
    ix = BruteForceIndex(p)
    assert_knn_matches(ix.nearest_within(q, 0.005), q, p, 1, max_distance=0.005)
    assert_knn_matches(ix.knn(q[::3], 3), q[::3], p, 3)


def test_numpy_input_and_no_mutation(rng):
    p = _cloud(30, rng)
    p0 = p.clone()
    ix = BruteForceIndex(p.numpy())
    res = ix.knn(p.numpy()[:5], 1)
    assert res.idx[:, 0].tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(p, p0)
    assert ix.knn(torch.empty(0, 3), 2).idx.shape == (0, 2)


def test_bad_input(rng):
    p = _cloud(5, rng)
    with pytest.raises(ValueError, match="points"):
        BruteForceIndex(torch.empty(0, 3))
    with pytest.raises(ValueError, match="points"):
        BruteForceIndex(torch.tensor([[0.0, float("nan"), 0]]))
    with pytest.raises(ValueError, match="points"):
        BruteForceIndex(np.zeros((4, 2)))
    ix = BruteForceIndex(p)
    with pytest.raises(ValueError, match="k"):
        ix.knn(p, 6)  # more neighbours than points: a clear error
    with pytest.raises(ValueError, match="k"):
        ix.knn(p, 0)
    with pytest.raises(TypeError, match="k"):
        ix.knn(p, 1.5)
    with pytest.raises(ValueError, match="query"):
        ix.knn(p[:, :2], 1)
    with pytest.raises(ValueError, match="query"):
        ix.knn(torch.tensor([[float("inf"), 0, 0]]), 1)
    with pytest.raises(ValueError, match="max_distance"):
        ix.nearest_within(p, 0.0)
    with pytest.raises(ValueError, match="max_distance"):
        ix.nearest_within(p, -1.0)
    with pytest.raises(ValueError, match="r"):
        ix.radius(p, float("nan"), 3)
    with pytest.raises(ValueError, match="max_neighbors"):
        ix.radius(p, 0.1, 0)


def test_query_on_other_device(rng, device):
    ix = BruteForceIndex(_cloud(5, rng).to(device))
    with pytest.raises(ValueError, match="query"):
        ix.knn(_cloud(3, rng).to("cpu" if device == "cuda" else "meta"), 1)


def test_large_vs_oracle(rng, device):
    n, m = (20_000, 50_000) if device == "cuda" else (2_000, 5_000)
    q, p = _cloud(n, rng).to(device), _cloud(m, rng).to(device)
    ix = BruteForceIndex(p)
    sel = torch.arange(0, n, 13, device=device)
    res = ix.knn(q, 16)
    assert_knn_matches((res.dists[sel], res.idx[sel]), q[sel], p, 16)
    res = ix.nearest_within(q, 0.01)
    assert_knn_matches((res.dists[sel], res.idx[sel]), q[sel], p, 1, max_distance=0.01)

