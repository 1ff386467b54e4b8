"""VoxelGridIndex and kernels.grid vs the SciPy cKDTree oracle; Triton grid kernel checks."""

from __future__ import annotations

import pytest
import torch

from pointalign.kernels import grid as grid_mod
from pointalign.search.base import Index
from pointalign.search.grid import VoxelGridIndex, auto_cell_size
from tests._interpreted import interpreted_fixture
from tests._oracles import assert_knn_matches, assert_same_or_tied


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


def test_reference_budget_chunks(rng):
    q, p = _cloud(77, rng), _cloud(500, rng)
    g = grid_mod.grid_build(p, 0.2)
    a = grid_mod.grid_query_reference(g, q, 3)
    b = grid_mod.grid_query_reference(g, q, 3, budget=50)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


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


# --- Triton grid kernel through the interpreter (child process, tiny sizes) ------------------

# (name, n, m, cell, k, max_distance, dtype)
INTERP_CASES = [
    ("m1", 5, 1, 0.1, 1, None, torch.float32),
    ("k1", 16, 150, 0.15, 1, None, torch.float32),
    ("k1max", 16, 150, 0.15, 1, 0.1, torch.float32),
    ("k4", 12, 150, 0.2, 4, None, torch.float32),
    ("k4max_f64", 12, 100, 0.2, 4, 0.15, torch.float64),
]


def _interp_inputs(case, seed):
    name, n, m, cell, k, md, dt = case
    g = torch.Generator().manual_seed(1000 * seed + sum(map(ord, name)))
    return _cloud(n, g, dt) * 1.4 - 0.2, _cloud(m, g, dt)


def run_interpreted_cases(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): grid kernel and index on every case."""
    from pointalign.kernels import _backend

    assert _backend.backend(torch.empty(0)) == "interpret"
    from pointalign.kernels.grid import triton as _grid_triton

    out = {}
    for seed in range(3):
        for case in INTERP_CASES:
            name, n, m, cell, k, md, dt = case
            q, p = _interp_inputs(case, seed)
            g = grid_mod.grid_build(p, cell)
            md2 = None if md is None else md * md
            out[(name, seed)] = _grid_triton.grid_query(g, q, k, md2)
        q, p = _interp_inputs(INTERP_CASES[3], seed)
        out[("index", seed)] = tuple(VoxelGridIndex(p, 0.3).knn(q[:6], 3))
    dup = torch.tensor([[0.0, 0, 0], [0.5, 0, 0]]).repeat(3, 1)  # p[j] = dup[j % 2]
    g = grid_mod.grid_build(dup, 0.6)
    out["ties"] = _grid_triton.grid_query(g, torch.tensor([[0.1, 0, 0], [0.45, 0, 0]]), 2)
    # k = 1 with duplicates spread over more than one unrolled step of a lane
    many = torch.tensor([[0.0, 0, 0], [0.5, 0, 0]]).repeat(11, 1)
    out["ties1"] = _grid_triton.grid_query(grid_mod.grid_build(many, 0.6),
                                           torch.tensor([[0.1, 0, 0], [0.45, 0, 0]]), 1)
    torch.save(out, out_path)


interpreted = interpreted_fixture("tests.search.test_grid", "run_interpreted_cases")


@pytest.mark.parametrize("case", INTERP_CASES, ids=[c[0] for c in INTERP_CASES])
def test_triton_interpreted_matches_reference(case, seed, interpreted):
    name, n, m, cell, k, md, dt = case
    q, p = _interp_inputs(case, seed)
    d, i = interpreted[(name, seed)]
    assert d.dtype == dt and i.dtype == torch.int64
    g = grid_mod.grid_build(p, cell)
    md2 = None if md is None else md * md
    rd, ri = grid_mod.grid_query_reference(g, q, k, md2)
    assert_same_or_tied(d, i, rd, ri)  # both keep the smallest index on exact ties
    if md is not None and md <= cell:
        assert_knn_matches((d, i), q, p, k, max_distance=md)


def test_triton_interpreted_index(seed, interpreted):
    q, p = _interp_inputs(INTERP_CASES[3], seed)
    assert_knn_matches(interpreted[("index", seed)], q[:6], p, 3)


def test_triton_interpreted_ties(interpreted):
    d, i = interpreted["ties"]
    assert i.tolist() == [[0, 2], [1, 3]]
    d, i = interpreted["ties1"]
    assert i.tolist() == [[0], [1]]


# --- CUDA: compiled kernel vs reference -----------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 4, 16])
@pytest.mark.parametrize("max_distance", [None, 0.02])
def test_triton_cuda_matches_reference(k, max_distance, rng):
    p = _cloud(100_003, rng).cuda()
    q = (_cloud(20_011, rng) * 1.2 - 0.1).cuda()
    g = grid_mod.grid_build(p, 0.03)
    md2 = None if max_distance is None else max_distance**2
    d, i = grid_mod.grid_query(g, q, k, md2)
    rd, ri = grid_mod.grid_query_reference(g, q, k, md2)
    assert_same_or_tied(d, i, rd, ri)
    ix = VoxelGridIndex(p, 0.03)
    sel = torch.arange(0, q.shape[0], 11, device="cuda")
    res = ix.knn(q, k) if max_distance is None else ix.radius(q, max_distance, k)
    assert_knn_matches((res.dists[sel], res.idx[sel]), q[sel], p, k, max_distance)


@pytest.mark.gpu
def test_cuda_bunny_nearest_within(bunny_pair):
    p, q = bunny_pair.target.cuda(), bunny_pair.source.cuda()
    ix = VoxelGridIndex(p, 0.005)
    res = ix.nearest_within(q, 0.005)
    assert res.idx.is_cuda
    assert_knn_matches(res, q, p, 1, max_distance=0.005)
    assert_knn_matches(ix.knn(q, 8), q, p, 8)


def test_build_in_chunks_equals_one_pass(rng, monkeypatch):
    """The float64 cell computation taken a chunk at a time (large clouds) changes nothing."""
    p = torch.rand(500, 3, generator=rng) * torch.tensor([3.0, 1.0, 0.2])
    one = grid_mod.grid_build(p, 0.15)
    monkeypatch.setattr(grid_mod, "_BUILD_CHUNK", 7)
    many = grid_mod.grid_build(p, 0.15)
    for a, b in zip(one, many, strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        else:
            assert a == b
