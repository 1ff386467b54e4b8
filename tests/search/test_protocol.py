"""Every index against the cKDTree oracle for every protocol method: checked, trusted, hinted.

The Index protocol (``search/base.py``): ``knn``, ``radius``, ``nearest_within(..., hint=)``,
``uses_hint`` and ``points``; inside ``_validate.trusted()`` the same answers on the fast
path. The Triton paths run under the interpreter in a child process (small clouds) and on
the GPU (``-m gpu``), where the trusted path must not synchronise and must survive CUDA-graph
capture.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from pointalign import _validate
from pointalign.search import build_index
from pointalign.search.base import Index, KnnResult
from pointalign.search.policy import TieredIndex
from tests._backends import backends
from tests._interpreted import interpreted_fixture
from tests._oracles import assert_knn_matches

METHODS = ["brute", "grid", "kdtree", "ckdtree"]


def _cloud(n, g, dtype=torch.float32):
    return torch.rand(n, 3, generator=g, dtype=torch.float64).to(dtype)


def _build(method, p, md):
    return build_index(p, method, max_distance=md) if method == "grid" else build_index(p, method)


def _hints(ix, q, md, g):
    """Hints of every kind: none (-1), random points, and the answer itself."""
    n, m = q.shape[0], ix.points.shape[0]
    h = torch.randint(-1, m, (n,), generator=g, device=g.device).to(q.device)
    h[::3] = ix.nearest_within(q, md).idx[::3, 0]
    h[1::5] = -1
    return h


@pytest.mark.parametrize("method", METHODS)
def test_every_method_matches_oracle_checked_and_trusted(method, rng, device, dtype):
    p = _cloud(503, rng, dtype).to(device)
    q = (_cloud(211, rng, dtype) * 1.3 - 0.15).to(device)
    md = 0.08
    ix = _build(method, p, md)
    assert isinstance(ix, Index)
    from pointalign.kernels import knn as _knn

    reads_hint = method == "kdtree" or (method == "ckdtree" and _knn.uses_host_tree(p.cpu()))
    assert ix.uses_hint is reads_hint
    assert ix.points.shape == (503, 3)
    hint = _hints(ix, q, md, rng)
    q0, h0 = q.clone(), hint.clone()
    for trusted in (False, True):
        with _validate.trusted() if trusted else nullcontext():
            results = {
                "knn": (ix.knn(q, 6), 6, None),
                "radius": (ix.radius(q, 0.1, 9), 9, 0.1),
                "nearest": (ix.nearest_within(q, md), 1, md),
                "hinted": (ix.nearest_within(q, md, hint=hint), 1, md),
                "far bound": (ix.nearest_within(q, 0.4, hint=hint), 1, 0.4),
                "near bound": (ix.nearest_within(q, 0.02), 1, 0.02),
            }
        for name, (res, k, bound) in results.items():
            assert isinstance(res, KnnResult), name
            assert res.dists.dtype == dtype and res.idx.device == q.device, name
            tol = {} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-14}
            assert_knn_matches(res, q, p, k, max_distance=bound, **tol)
    assert torch.equal(q, q0) and torch.equal(hint, h0)  # inputs never modified


@pytest.mark.parametrize("method", METHODS)
def test_self_query_and_empty_query(method, rng, device):
    p = _cloud(300, rng).to(device)
    ix = _build(method, p, 0.1)
    assert_knn_matches(ix.radius(ix.points, 0.12, 40), p, p, 40, max_distance=0.12)
    assert_knn_matches(ix.knn(ix.points, 5), p, p, 5)
    empty = torch.empty(0, 3, device=device)
    for trusted in (False, True):
        with _validate.trusted() if trusted else nullcontext():
            res = ix.nearest_within(empty, 0.1, hint=torch.empty(0, dtype=torch.int64,
                                                                  device=device))
        assert res.idx.shape == (0, 1) and res.dists.shape == (0, 1)


@pytest.mark.parametrize("method", METHODS)
def test_bad_hint_is_a_clear_error(method, rng):
    p, q = _cloud(50, rng), _cloud(7, rng)
    ix = _build(method, p, 0.1)
    with pytest.raises(ValueError, match="hint"):
        ix.nearest_within(q, 0.1, hint=torch.zeros(6, dtype=torch.int64))
    with pytest.raises(TypeError, match="hint"):
        ix.nearest_within(q, 0.1, hint=torch.zeros(7, dtype=torch.int32))
    with pytest.raises(TypeError, match="hint"):
        ix.nearest_within(q, 0.1, hint=[0] * 7)
    bad = torch.full((7,), 50, dtype=torch.int64)  # one past the last point
    if ix.uses_hint:  # read: its entries are checked outside trusted()
        with pytest.raises(ValueError, match="hint"):
            ix.nearest_within(q, 0.1, hint=bad)
    else:  # ignored: the answer does not depend on it
        assert_knn_matches(ix.nearest_within(q, 0.1, hint=bad), q, p, 1, max_distance=0.1)
    with pytest.raises(ValueError, match="max_distance"):
        ix.nearest_within(q, 0.0)
    with pytest.raises(ValueError, match="query"):
        ix.nearest_within(torch.full((2, 3), float("nan")), 0.1)


def test_tiered_index_matches_oracle(rng, device):
    """The tiers wrapper on its own (any device): the answer of the index behind it."""
    from pointalign.search.grid import VoxelGridIndex

    p = _cloud(600, rng).to(device)
    q = (_cloud(150, rng) * 1.2 - 0.1).to(device)
    q[:20] += 0.3  # some far from every point
    for inner in (VoxelGridIndex(p, 0.3), build_index(p, "kdtree"), build_index(p, "ckdtree")):
        tiers = tuple(VoxelGridIndex(p, c) for c in (0.04, 0.1))
        ix = TieredIndex(inner, tiers)
        assert isinstance(ix, Index) and ix.uses_hint is inner.uses_hint
        hint = _hints(inner, q, 0.25, rng)
        for trusted in (False, True):
            with _validate.trusted() if trusted else nullcontext():
                for md in (0.25, 0.06, 0.03):  # the last is below every tier's cell
                    res = ix.nearest_within(q, md, hint=hint)
                    assert_knn_matches(res, q, p, 1, max_distance=md)
                    want = inner.nearest_within(q, md)
                    assert torch.equal(res.idx >= 0, want.idx >= 0)
    # knn and radius are the inner index's
    assert_knn_matches(ix.knn(q, 3), q, p, 3)
    assert_knn_matches(ix.radius(q, 0.1, 5), q, p, 5, max_distance=0.1)


# --- the Triton paths under the interpreter (child process) ---------------------------------

def run_interpreted_protocol(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): every index's paths on small clouds."""
    from pointalign.kernels import _backend
    from pointalign.search import policy
    from pointalign.search.grid import VoxelGridIndex

    assert _backend.backend(torch.empty(0)) == "interpret"
    assert policy.search_plan(torch.empty(0, 3)).fused
    out = {}
    g = torch.Generator().manual_seed(7)
    p = _cloud(300, g)
    q = _cloud(120, g) * 1.2 - 0.1
    hint = torch.randint(-1, 300, (120,), generator=g)
    for method in ("brute", "grid", "kdtree"):
        ix = _build(method, p, 0.1)
        out[(method, "checked")] = tuple(ix.nearest_within(q, 0.1))
        with _validate.trusted():
            out[(method, "trusted")] = tuple(ix.nearest_within(q, 0.1))
            out[(method, "hinted")] = tuple(ix.nearest_within(q, 0.1, hint=hint))
        out[(method, "radius")] = tuple(ix.radius(ix.points, 0.15, 40))  # self-query
    plane, qp = _plane(g)
    tiered = policy.correspondence_index(VoxelGridIndex(plane, 0.5), 0.5)
    out["tiers"] = len(tiered.tiers) if isinstance(tiered, TieredIndex) else 0
    with _validate.trusted():
        out["tiered"] = tuple(tiered.nearest_within(qp, 0.5))
    torch.save(out, out_path)


def _plane(g):
    """300 points on the plane z = 0 (automatic cell about 0.024) and queries near it."""
    plane = _cloud(300, g)
    plane[:, 2] = 0
    q = _cloud(120, g) * 1.2 - 0.1
    q[:, 2] *= 0.2
    return plane, q


interpreted = interpreted_fixture("tests.search.test_protocol", "run_interpreted_protocol")


@pytest.mark.parametrize("method", ["brute", "grid", "kdtree"])
def test_interpreted_paths_match_oracle(method, interpreted):
    g = torch.Generator().manual_seed(7)
    p = _cloud(300, g)
    q = _cloud(120, g) * 1.2 - 0.1
    for path in ("checked", "trusted", "hinted"):
        assert_knn_matches(interpreted[(method, path)], q, p, 1, max_distance=0.1)
    assert_knn_matches(interpreted[(method, "radius")], p, p, 40, max_distance=0.15)


def test_interpreted_tiers_match_oracle(interpreted):
    g = torch.Generator().manual_seed(7)
    _cloud(300, g), _cloud(120, g), torch.randint(-1, 300, (120,), generator=g)
    plane, q = _plane(g)
    assert interpreted["tiers"] == 2  # fused kernels (interpreted): two tiers in front
    assert_knn_matches(interpreted["tiered"], q, plane, 1, max_distance=0.5)


# --- GPU: no synchronisation, CUDA-graph capture -----------------------------------------------

def _gpu_cases(seed):
    from pointalign import datasets
    from pointalign.search import policy

    t = datasets.load_bunny("bun000").cuda()
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = t[::2] + 0.004 * torch.randn(t[::2].shape, device="cuda", generator=g)
    q[:500] += 0.03
    q = q[policy.query_order(q)].contiguous()
    grid = build_index(t, "grid", max_distance=0.05)
    cases = {"brute": build_index(t, "brute"), "grid": grid,
             "fine grid": build_index(t, "grid", max_distance=0.005),
             "kdtree": build_index(t, "kdtree"),
             "tiers": policy.correspondence_index(grid, 0.05)}
    return t, q, cases, g


@backends("triton")
def test_trusted_path_never_synchronises_on_cuda(backend, seed):
    t, q, cases, g = _gpu_cases(seed)
    assert isinstance(cases["tiers"], TieredIndex)
    for name, ix in cases.items():
        md = 0.005 if name == "fine grid" else 0.05
        hint = _hints(ix, q, md, g)
        with _validate.trusted():
            ix.nearest_within(q, md, hint=hint)  # first use: kernels compile, grids build
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                res = ix.nearest_within(q, md, hint=hint)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert_knn_matches(res, q, t, 1, max_distance=md)


@backends("triton")
def test_trusted_path_replays_from_a_graph_on_cuda(backend, seed):
    t, q, cases, g = _gpu_cases(seed)
    for name, ix in cases.items():
        md = 0.005 if name == "fine grid" else 0.05
        hint = _hints(ix, q, md, g)
        x = q.clone()
        with _validate.trusted():
            ix.nearest_within(x, md, hint=hint)  # warm up outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                res = ix.nearest_within(x, md, hint=hint)
        x.copy_(q + 0.001)  # new queries, same buffer
        graph.replay()
        torch.cuda.synchronize()
        assert_knn_matches(res, q + 0.001, t, 1, max_distance=md)


@pytest.mark.parametrize("method", ["brute", "kdtree"])
def test_graph_arrays_protocol(method, rng, device):
    """The executor's protocol (kernels._loop keys a captured graph by it): a copy over
    another index's arrays of the same layout answers for those arrays; another layout is
    refused; the index itself is unchanged."""
    a, b = (build_index(_cloud(300, rng).to(device), method) for _ in range(2))
    q = _cloud(40, rng).to(device)
    key_a, arrays_a = a.graph_arrays()
    key_b, arrays_b = b.graph_arrays()
    assert key_a == key_b and set(arrays_a) == set(arrays_b)
    copy = a.with_arrays({k: v.clone() for k, v in arrays_b.items()})
    for got, want in ((copy.knn(q, 3), b.knn(q, 3)),
                      (copy.nearest_within(q, 0.2), b.nearest_within(q, 0.2))):
        assert torch.equal(got.idx, want.idx) and torch.equal(got.dists, want.dists)
    assert a.graph_arrays()[1]["points"] is arrays_a["points"]  # a itself unchanged
    with pytest.raises(ValueError, match="layout"):
        a.with_arrays(build_index(_cloud(301, rng).to(device), method).graph_arrays()[1])
    with pytest.raises(ValueError, match="layout"):
        a.with_arrays({k: v for k, v in arrays_b.items() if k != "points"})
    with pytest.raises(ValueError, match="layout"):
        a.with_arrays({k: v.double() if k == "points" else v for k, v in arrays_b.items()})
