"""kernels.grid: the voxel grid's build and 27-cell query on every backend against the
reference ``grid_query_reference`` and the SciPy oracle; the Triton kernel through the
interpreter; the capped counts within a radius (``count_within``) of several clouds sharing
one packed grid against a brute-force count; the occupied cells of several clouds
(``count_cells``) against each cloud's distinct cells. (The index over it, VoxelGridIndex:
``tests/search/test_grid.py``.)

Search answers: equal indices except at exact ties of distance (``assert_same_or_tied``:
both keep the smallest index on exact ties; distances to float32 rounding); builds equal.
"""

from __future__ import annotations

import pytest
import torch

from pointalign.kernels import grid as grid_mod
from pointalign.kernels.grid import reference as grid_ref
from pointalign.search.grid import VoxelGridIndex
from tests._interpreted import interpreted_fixture
from tests._oracles import assert_knn_matches, assert_same_or_tied


def _cloud(n, g, dtype=torch.float32):
    return torch.rand(n, 3, generator=g, dtype=torch.float64).to(dtype)


def test_reference_budget_chunks(rng):
    q, p = _cloud(77, rng), _cloud(500, rng)
    g = grid_mod.grid_build(p, 0.2)
    a = grid_mod.grid_query_reference(g, q, 3)
    b = grid_mod.grid_query_reference(g, q, 3, budget=50)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


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


@pytest.mark.parametrize("k", [1, 4, 16])
@pytest.mark.parametrize("max_distance", [None, 0.02])
def test_grid_query_matches_reference(backend, k, max_distance, rng):
    """The dispatcher (the Triton kernel on CUDA) against the reference and the oracle."""
    m, n = (100_003, 20_011) if backend.device == "cuda" else (20_003, 2_011)
    p = _cloud(m, rng).to(backend.device)
    q = (_cloud(n, rng) * 1.2 - 0.1).to(backend.device)
    g = grid_mod.grid_build(p, 0.03)
    md2 = None if max_distance is None else max_distance**2
    d, i = grid_mod.grid_query(g, q, k, md2)
    assert d.device.type == backend.device
    rd, ri = grid_mod.grid_query_reference(g, q, k, md2)
    assert_same_or_tied(d, i, rd, ri)
    ix = VoxelGridIndex(p, 0.03)
    sel = torch.arange(0, q.shape[0], 11, device=backend.device)
    res = ix.knn(q, k) if max_distance is None else ix.radius(q, max_distance, k)
    assert_knn_matches((res.dists[sel], res.idx[sel]), q[sel], p, k, max_distance)


def test_grid_query_bad_input(backend, rng):
    g = grid_mod.grid_build(_cloud(50, rng).to(backend.device), 0.1)
    q = _cloud(4, rng).to(backend.device)
    with pytest.raises(ValueError, match="query"):
        grid_mod.grid_query(g, q[:, :2], 1)
    with pytest.raises(ValueError, match="query"):
        grid_mod.grid_query(g, q.double(), 1)
    with pytest.raises(ValueError, match="k"):
        grid_mod.grid_query(g, q, 0)
    with pytest.raises(ValueError, match="cell_size"):
        grid_mod.grid_build(q, 0.0)


# --- count_within: capped counts within a radius, several clouds on one packed grid ------


def _packed(clouds: list[torch.Tensor], radii: list[float]):
    """count_within's arguments for every point of ``clouds`` as a query: each cloud on its
    own grid of cells of edge ``r (1 + 1e-5)`` from its own corner, keys packed cloud after
    cloud. Returns ``(args without cap, points, owner)``."""
    dev = clouds[0].device
    dims, keys, cells, base = [], [], [], 0
    bases = []
    for c, r in zip(clouds, radii, strict=True):
        lo = c.to(torch.float64).amin(0)
        cell = ((c.to(torch.float64) - lo) / (r * (1 + 1e-5))).floor().to(torch.int64)
        d = cell.amax(0) + 1
        keys.append(base + (cell[:, 0] * d[1] + cell[:, 1]) * d[2] + cell[:, 2])
        cells.append(cell)
        dims.append(d)
        bases.append(base)
        base += int(d.prod())
    pts = torch.cat(clouds)
    owner = torch.cat([torch.full((c.shape[0],), i, device=dev) for i, c in enumerate(clouds)])
    sk, order = torch.sort(torch.cat(keys))
    r2 = torch.tensor([r * r for r in radii], dtype=pts.dtype, device=dev)
    args = (sk, pts[order], pts, torch.cat(cells), owner, torch.stack(dims),
            torch.tensor(bases, device=dev), r2)
    return args, pts, owner


def _brute_counts(pts: torch.Tensor, owner: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
    """Points of the query's own cloud within the bound, the contract's arithmetic."""
    e = pts[:, None, :] - pts[None, :, :]
    d2 = e[..., 0] * e[..., 0] + e[..., 1] * e[..., 1] + e[..., 2] * e[..., 2]
    same = owner[:, None] == owner[None, :]
    return (same & (d2 <= r2[owner][:, None])).sum(1)


def _count_clouds(g: torch.Generator, n: int = 1500
                  ) -> tuple[list[torch.Tensor], list[float]]:
    """A crowded cloud (hundreds per cell at n = 1500), a sparse one far away, a tiny one."""
    dense = torch.rand(n, 3, generator=g) * 0.05
    sparse = torch.rand(n // 5, 3, generator=g) * 4.0 + 1.0
    return [torch.cat([dense, sparse]), sparse * 0.5 - 7.0, torch.rand(4, 3, generator=g)], \
        [0.02, 0.3, 0.5]


@pytest.mark.parametrize("cap", [1, 5, 17, 10_000])
def test_count_within_matches_brute_force(backend, cap, rng, monkeypatch):
    """Capped counts equal a brute-force count over each cloud (27 cells of edge >= r hold
    every point within r), in one pass and in several (a small candidate budget)."""
    clouds, radii = _count_clouds(rng)
    args, pts, owner = _packed([c.to(backend.device) for c in clouds], radii)
    full = _brute_counts(pts, owner, args[-1])
    assert int(full.max()) > 17 and int(full.min()) == 1       # crowded cells and lone points
    want = full.clamp_max(cap)
    for budget in (None, 2000):
        if budget is not None:
            monkeypatch.setattr(grid_ref, "COUNT_BUDGET", budget)
        got = grid_mod.count_within(*args, cap)
        assert got.dtype == torch.int64
        assert torch.equal(got.cpu(), want.cpu())


def test_count_within_bad_input():
    args, _, _ = _packed([torch.rand(10, 3)], [0.3])
    for cap in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="cap"):
            grid_mod.count_within(*args, cap)
    with pytest.raises(ValueError, match="sorted_keys"):
        grid_mod.count_within(args[0][:-1], *args[1:], 3)
    with pytest.raises(ValueError, match="query"):
        grid_mod.count_within(*args[:2], args[2].double(), *args[3:], 3)
    with pytest.raises(ValueError, match="one device"):
        grid_mod.count_within(*args[:-1], args[-1].to("meta"), 3)


def _cell_clouds(g: torch.Generator, n: int = 2000):
    """count_cells' arguments for four clouds (quantised points, many to a cell; a sparse
    cloud far away; one point; one point repeated) at edges v, and each cloud's points."""
    clouds = [(torch.rand(n, 3, generator=g) * 2).round(decimals=2),
              torch.rand(n // 4, 3, generator=g) * 50 + 1e3, torch.rand(1, 3, generator=g),
              torch.full((7, 3), -2.5)]
    v = torch.tensor([0.1, 3.7, 0.5, 0.01], dtype=torch.float64)
    lo = torch.stack([c.amin(0) for c in clouds]).double()
    hi = torch.stack([c.amax(0) for c in clouds]).double()
    dims3 = (torch.floor((hi - lo) / v[:, None]) + 2).long()
    base = torch.cat([torch.zeros(1, dtype=torch.long), dims3.prod(1).cumsum(0)[:-1]])
    owner = torch.repeat_interleave(torch.arange(4), torch.tensor([c.shape[0] for c in clouds]))
    return (torch.cat(clouds), owner, lo, v, dims3, base), clouds


def _distinct_cells(clouds, lo, scale, divide):
    """The oracle: each cloud's distinct cell triples (no packing, no hashing)."""
    out = []
    for c, o, s in zip(clouds, lo, scale, strict=True):
        rel = c.double() - o
        out.append(torch.unique(torch.floor(rel / s if divide else rel * s), dim=0).shape[0])
    return out


def test_count_cells_counts_distinct_cells(backend, rng):
    """Each cloud's occupied cells, dividing by the edge or multiplying by its reciprocal;
    one cloud without ``owner``; the keys and cells (cell_keys) the reference's, exactly
    (the same float64 operations); the inputs untouched."""
    args, clouds = _cell_clouds(rng)
    pts, owner, lo, v, dims, base = (t.to(backend.device) for t in args)
    before = pts.clone()
    for divide, scale in ((True, v), (False, 1.0 / v)):
        want = _distinct_cells(clouds, lo.cpu(), scale.cpu(), divide)
        assert 1 < want[0] < clouds[0].shape[0] and want[1] > 1 and want[2:] == [1, 1]
        got = grid_mod.count_cells(pts, owner, lo, scale, dims, base, divide=divide)
        assert got.dtype == torch.int64 and got.tolist() == want
        keys, cells = grid_mod.cell_keys(pts, owner, lo, scale, dims, base, divide=divide)
        rk, rc = grid_ref.cell_keys_reference(pts, owner, lo, scale, dims, base, divide)
        assert torch.equal(keys, rk) and torch.equal(cells, rc)
        assert [int(torch.unique(keys[owner == i]).numel()) for i in range(4)] == want
        one = grid_mod.count_cells(pts[owner == 0], None, lo[:1], scale[:1], dims[:1],
                                   base[:1], divide=divide)
        assert one.tolist() == want[:1]
    assert torch.equal(pts, before)
    empty = grid_mod.count_cells(pts[:0], owner[:0], lo, v, dims, base, divide=True)
    assert empty.tolist() == [0, 0, 0, 0]


def test_count_cells_bad_input():
    (pts, owner, lo, v, dims, base), _ = _cell_clouds(torch.Generator().manual_seed(0), 50)
    with pytest.raises(ValueError, match="points"):
        grid_mod.count_cells(pts[:, :2], owner, lo, v, dims, base, divide=True)
    with pytest.raises(ValueError, match="expected owner"):
        grid_mod.count_cells(pts, owner[1:], lo, v, dims, base, divide=True)
    with pytest.raises(ValueError, match="expected owner"):
        grid_mod.count_cells(pts, owner, lo, v[1:], dims, base, divide=True)
    with pytest.raises(ValueError, match="one device"):
        grid_mod.count_cells(pts, owner, lo, v, dims, base.to("meta"), divide=True)
    for bad in ((pts[:, :2], owner, lo, v, dims, base), (pts, owner, lo, v, dims[:, :2], base),
                (pts, owner.to("meta"), lo, v, dims, base)):  # cell_keys: the same checks
        with pytest.raises(ValueError, match="points|expected owner|one device"):
            grid_mod.cell_keys(*bad, divide=True)


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
    out["morton"] = [_grid_triton.morton_codes(c) for c in _morton_clouds()]
    for seed in range(2):  # small clouds: the interpreter is slow
        args, _, _ = _packed(*_count_clouds(torch.Generator().manual_seed(seed), 150))
        out[("count", seed)] = [grid_mod.count_within(*args, cap) for cap in (5, 10_000)]
        args, _ = _cell_clouds(torch.Generator().manual_seed(seed), 300)
        out[("cells", seed)] = [(_grid_triton.count_cells(*args[:3], s, *args[4:], d),
                                 _grid_triton.cell_keys(*args[:3], s, *args[4:], d))
                                for s, d in ((args[3], True), (1.0 / args[3], False))]
    torch.save(out, out_path)


interpreted = interpreted_fixture("tests.kernels.test_grid", "run_interpreted_cases")


def _morton_clouds() -> list[torch.Tensor]:
    """float32 clouds for the Morton codes: random, a scan far from the origin, many ties."""
    from pointalign import datasets

    g = torch.Generator().manual_seed(7)
    return [torch.rand(5000, 3, generator=g) * 37.0 - 3.0,
            datasets.load_bunny("bun000") + 1e3,
            torch.rand(300, 3, generator=g).round(decimals=1), torch.zeros(1, 3)]


def test_triton_morton_codes_interpreted(interpreted):
    """The Triton Morton codes (``grid/triton.py``) are the reference's, bit for bit."""
    for got, p in zip(interpreted["morton"], _morton_clouds(), strict=True):
        assert torch.equal(got, grid_ref.morton_codes_reference(p))


@pytest.mark.gpu
def test_morton_order_on_cuda_sorts_the_reference_codes():
    """On CUDA, ``morton_order`` sorts the Triton codes: the reference's, bit for bit."""
    for p in (c.cuda() for c in _morton_clouds()):
        codes = grid_ref.morton_codes_reference(p)
        from pointalign.kernels.grid import triton as _grid_triton

        assert torch.equal(_grid_triton.morton_codes(p), codes)
        assert torch.equal(codes[grid_mod.morton_order(p)], codes.sort().values)


def test_morton_order_rows_keeps_padding_last(backend, rng):
    """Each entry's valid rows sorted by code (over the batch's box), padding rows after
    them in their order; one entry without padding: :func:`morton_order`'s order."""
    p = torch.rand(3, 50, 3, generator=rng, dtype=torch.float64).to(backend.device)
    lengths = torch.tensor([50, 17, 0], device=backend.device)
    perm = grid_mod.morton_order_rows(p, lengths).cpu()
    codes = grid_ref.morton_codes_reference(p.reshape(-1, 3).cpu()).view(3, 50)
    for b, n in enumerate(lengths.tolist()):
        assert sorted(perm[b, :n].tolist()) == list(range(n))
        assert (codes[b, perm[b, :n]].diff() >= 0).all()
        assert perm[b, n:].tolist() == list(range(n, 50))
    one = p[:1].float()
    assert torch.equal(grid_mod.morton_order_rows(one, lengths[:1]).cpu()[0],
                       grid_mod.morton_order(one[0]).cpu())


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


@pytest.mark.parametrize("seed", [0, 1])
def test_triton_count_within_interpreted(seed, interpreted):
    """The Triton counts (``grid/triton.py``) are the reference's, exactly."""
    args, _, _ = _packed(*_count_clouds(torch.Generator().manual_seed(seed), 150))
    assert int(grid_ref.count_within_reference(*args, 10_000).max()) > 5   # some capped
    for got, cap in zip(interpreted[("count", seed)], (5, 10_000), strict=True):
        assert torch.equal(got, grid_ref.count_within_reference(*args, cap))


@pytest.mark.parametrize("seed", [0, 1])
def test_triton_count_cells_interpreted(seed, interpreted):
    """The Triton hash-table counts and the keys (``grid/triton.py``) are the reference's."""
    (pts, owner, lo, v, dims, base), _ = _cell_clouds(torch.Generator().manual_seed(seed), 300)
    for (got, keys), (s, d) in zip(interpreted[("cells", seed)], ((v, True), (1.0 / v, False)),
                                   strict=True):
        assert torch.equal(got, grid_ref.count_cells_reference(pts, owner, lo, s, dims, base, d))
        rk, rc = grid_ref.cell_keys_reference(pts, owner, lo, s, dims, base, d)
        assert torch.equal(keys[0], rk) and torch.equal(keys[1], rc)
