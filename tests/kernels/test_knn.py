"""kernels.knn: knn_tiles, radius_tiles and the radius self-query on every backend, the
reference alone against a SciPy oracle, the Triton kernels through the interpreter, and the
"cpu" backend's k-d tree (``knn/cpu.py``) against the brute-force reference.

Exactness: search answers are integers and compared exactly where both sides compute the
same squared distances in the same order (the tree against itself with other hints, leaf
sizes, candidate lists or thread counts); the tree against the brute force (whose
``addcmul`` may fuse multiply-adds) through ``same_neighbours``: equal indices except
between points within a few ulps of each other.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import pointalign as pa
from pointalign.kernels import _backend
from pointalign.kernels import knn as knn_mod
from pointalign.kernels.knn import cpu as _knn_cpu
from pointalign.kernels.knn import knn_reference
from tests._backends import backends
from tests._interpreted import interpreted_fixture
from tests._oracles import assert_knn_matches, assert_same_or_tied
from tests.kernels._cases import np_cloud as _cloud_np
from tests.kernels._cases import same_neighbours as _same_neighbours

SIZES = [(1, 1), (1, 2), (2, 3), (3, 1), (7, 13), (31, 17), (97, 211), (257, 64)]

#: the "cpu" backend's own machinery (the numba tree): one backend
cpu_only = backends("cpu")


def _cloud(n: int, g: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    return torch.rand(n, 3, generator=g, dtype=torch.float64).to(dtype)


# ---- the reference (the spec) against the SciPy oracle -----------------------------------

@pytest.mark.parametrize("n,m", SIZES)
@pytest.mark.parametrize("k", [1, 4, 16])
def test_reference_matches_oracle(n, m, k, rng):
    q, p = _cloud(n, rng), _cloud(m, rng)
    res = knn_mod.knn_reference(q, p, k)
    assert_knn_matches(res, q, p, k)
    assert res[0].dtype == torch.float32


@pytest.mark.parametrize("k", [1, 3, 40])
def test_reference_small_tiles_and_max_distance(k, rng, dtype):
    q, p = _cloud(53, rng, dtype), _cloud(301, rng, dtype)
    # tiny tiles force many merges across query and point tiles
    res = knn_mod.knn_reference(q, p, k, 0.2**2, tile_pairs=37)
    assert_knn_matches(res, q, p, k, max_distance=0.2)
    assert res[0].dtype == dtype


def test_reference_tie_break_smallest_index():
    p = torch.tensor([[1.0, 0, 0], [0, 1, 0], [-1, 0, 0], [1.0, 0, 0]])
    q = torch.zeros(2, 3)
    d, i = knn_mod.knn_reference(q, p, 1, tile_pairs=2)
    assert i.tolist() == [[0], [0]]
    d, i = knn_mod.knn_reference(q, p, 4)
    assert torch.allclose(d, torch.ones(2, 4))
    assert sorted(i[0].tolist()) == [0, 1, 2, 3]


def test_reference_keeps_the_smallest_indices_among_copies():
    """500 copies of one point among 20,000: where the copies tie at the k-th place, the
    places go to the smallest indices (``torch.topk`` alone kept others on rows 357, 1356
    and 1869 of this cloud). Exact where the arithmetic is: copies are at bit-equal
    distances, so a row holding c of them holds the c smallest; the rest agrees with the
    oracle up to rounding (the reference may contract multiply-adds)."""
    g = np.random.default_rng(0)
    p = g.normal(size=(20000, 3)).astype(np.float32)
    p[g.choice(20000, 3000, replace=False)] = 0.0
    p[g.choice(20000, 500, replace=False)] = p[5]
    q = p[[357, 1356, 1869, 0, 1, 2, 3, 4, 5, 6]]
    want_d, want_i = _lexsorted_knn(q, p, 20)
    d, i = knn_mod.knn_reference(torch.from_numpy(q), torch.from_numpy(p), 20)
    d, i = d.numpy(), i.numpy()
    _same_neighbours(q, p, want_i, i, want_d, d, np.float32)
    for point in (p[5], np.zeros(3, np.float32)):
        copies = np.nonzero((p == point).all(1))[0]
        for row in i:
            held = np.sort(row[np.isin(row, copies)])
            assert np.array_equal(held, copies[:held.size])


def test_bunny_reference(bunny_pair):
    q = bunny_pair.source[::61]
    p = bunny_pair.target[::3]
    res = knn_mod.knn_reference(q, p, 8)
    assert_knn_matches(res, q, p, 8)


# ---- the dispatcher on every backend --------------------------------------------------------

def test_points_layout_and_radius_tiles(backend, rng, dtype):
    q, p = (_cloud(41, rng, dtype).to(backend.device),
            _cloud(157, rng, dtype).to(backend.device))
    layout = knn_mod.points_layout(p)
    if backend.name == "triton":  # the (3, M) copy the fused kernel reads
        assert layout is not None and layout.shape == (3, 157)
    else:
        assert layout is None  # the PyTorch path reads the points as they are
    d, i = knn_mod.knn_tiles(q, p, 3, 0.2**2, points_t=layout)
    assert_knn_matches((d, i), q, p, 3, max_distance=0.2)
    # radius_tiles: knn_tiles with the squared radius; the self-query through the radius
    # search of the same family (same contract)
    rd, ri = knn_mod.radius_tiles(q, p, 0.2, 3)
    assert torch.equal(rd, d) and torch.equal(ri, i)
    sd, si = knn_mod.radius_tiles(p, p, 0.15, 40)
    assert_knn_matches((sd, si), p, p, 40, max_distance=0.15)
    assert (si[:, 0].cpu() == torch.arange(157)).all()  # itself first, at distance 0


def test_no_neighbour_and_padding(backend, rng):
    p = (_cloud(5, rng) + 10.0).to(backend.device)
    q = _cloud(4, rng).to(backend.device)
    d, i = knn_mod.knn_tiles(q, p, 7, 1.0)
    assert torch.isinf(d).all() and (i == -1).all()
    d, i = knn_mod.knn_tiles(q, p, 7)
    assert (i[:, 5:] == -1).all() and torch.isinf(d[:, 5:]).all()
    assert (i[:, :5] >= 0).all()


def test_empty_query(backend, rng):
    d, i = knn_mod.knn_tiles(torch.empty(0, 3, device=backend.device),
                             _cloud(4, rng).to(backend.device), 2)
    assert d.shape == (0, 2) and i.shape == (0, 2)


def test_bad_input(backend, rng):
    q, p = _cloud(4, rng).to(backend.device), _cloud(5, rng).to(backend.device)
    with pytest.raises(ValueError, match="query"):
        knn_mod.knn_tiles(q[:, :2], p, 1)
    with pytest.raises(ValueError, match="points"):
        knn_mod.knn_tiles(q, p.reshape(-1), 1)
    with pytest.raises(TypeError, match="dtype"):
        knn_mod.knn_tiles(q, p.double(), 1)
    with pytest.raises(ValueError, match="k"):
        knn_mod.knn_tiles(q, p, 0)
    with pytest.raises(ValueError, match="max_distance_sq"):
        knn_mod.knn_tiles(q, p, 1, 0.0)


def test_k_above_32_uses_reference(backend, rng):
    q, p = _cloud(9, rng).to(backend.device), _cloud(50, rng).to(backend.device)
    res = knn_mod.knn_tiles(q, p, 33)
    assert_knn_matches(res, q, p, 33)
    assert math.isinf(float(knn_mod.knn_tiles(q, p, 60)[0][0, -1]))


@pytest.mark.parametrize("k", [1, 2, 8, 16, 32])
@pytest.mark.parametrize("max_distance", [None, 0.05])
def test_knn_tiles_matches_reference(backend, k, max_distance, rng):
    """The dispatcher (the fused kernel on Triton) against the reference and the oracle."""
    n, m = (5003, 20011) if backend.device == "cuda" else (503, 2011)
    q = _cloud(n, rng).to(backend.device)
    p = _cloud(m, rng).to(backend.device)
    md2 = None if max_distance is None else max_distance**2
    d, i = knn_mod.knn_tiles(q, p, k, md2)
    assert d.device.type == i.device.type == backend.device
    rd, ri = knn_mod.knn_reference(q, p, k, md2)
    assert_same_or_tied(d, i, rd, ri)
    sel = torch.arange(0, n, 7, device=backend.device)
    assert_knn_matches((d[sel], i[sel]), q[sel], p, k, max_distance)


def test_knn_tiles_float64_and_bunny(backend, bunny_pair):
    step = 1 if backend.device == "cuda" else 23  # the brute force on the CPU: a subsample
    q = bunny_pair.source[::step].to(backend.device)
    p = bunny_pair.target[::max(1, step // 4)].to(backend.device)
    res = knn_mod.knn_tiles(q, p, 4)
    assert_knn_matches(res, q, p, 4)
    res = knn_mod.knn_tiles(q.double(), p.double(), 1, 0.002**2)
    assert_knn_matches(res, q, p, 1, max_distance=0.002)


# ---- the radius self-query (radius_neighbours) ---------------------------------------------

def test_radius_neighbours_matches_reference(backend, seed):
    """Every backend's radius self-query against the brute force (ties: any equal point)."""
    pts = torch.from_numpy(_cloud_np(seed, 1500, np.float32))
    got = knn_mod.radius_neighbours(pts.to(backend.device), 0.4, 10)
    ref = knn_reference(pts, pts, 10, 0.4**2)
    _same_neighbours(pts.numpy(), pts.numpy(), ref[1].numpy(), got[1].cpu().numpy(),
                     ref[0].numpy(), got[0].cpu().numpy(), np.float32)


@backends("torch")
def test_radius_neighbours_reference_path_is_knn_tiles(backend, seed):
    pts = torch.rand(300, 3, generator=torch.Generator().manual_seed(seed))
    d, i = knn_mod.radius_neighbours(pts, 0.2, 40)
    rd, ri = knn_mod.knn_tiles(pts, pts, 40, 0.04)
    assert torch.equal(d, rd) and torch.equal(i, ri)


@pytest.mark.parametrize("sizes", [(1500, 1300), (37, 900), (5, 3)])
def test_radius_pair_is_each_cloud_alone(backend, seed, sizes):
    """Two clouds at once (Triton: one table, rows straddling the split at 37): every row is
    the cloud's own radius_neighbours row, bit for bit, its indices shifted; a dense clump
    (160 points within the radius of each other) widens the table past its first 128."""
    a = torch.from_numpy(_cloud_np(seed, sizes[0], np.float32))
    b = torch.from_numpy(_cloud_np(seed + 7, sizes[1], np.float32))
    if sizes[1] >= 160:  # overlapping clouds: the search must not cross from one to the other
        b[:160] = a[0] + 0.001 * torch.arange(160, dtype=torch.float32)[:, None]
    a, b = a.to(backend.device), b.to(backend.device)
    both = torch.cat([a, b])
    for r, k in ((0.4, 100), (0.1, 10)):
        d, i = knn_mod.radius_pair(both, a.shape[0], r, k)
        (da, ia), (db, ib) = knn_mod.radius_neighbours(a, r, k), knn_mod.radius_neighbours(b, r, k)
        assert torch.equal(d, torch.cat([da, db]))
        assert torch.equal(i, torch.cat([ia, torch.where(ib >= 0, ib + a.shape[0], ib)]))
    with pytest.raises(ValueError, match="points must be"):
        knn_mod.radius_pair(both[:, :2], a.shape[0], 0.1, 3)
    for split in (0, both.shape[0], 2.0):
        with pytest.raises(ValueError, match="split"):
            knn_mod.radius_pair(both, split, 0.1, 3)


def _widest_within(c: torch.Tensor, r: float) -> int:
    """The largest count of ``c``'s points within ``r`` of one of them (float64)."""
    c = c.double()
    return int((((c[:, None] - c[None]) ** 2).sum(-1) <= r * r).sum(1).max())


@pytest.mark.parametrize("sizes", [(1500, 1300), (37, 900)])
def test_radius_pair_at_width_says_whether_its_table_held(backend, seed, sizes):
    """A table of a given width, no host read: where each cloud's widest neighbourhood fits,
    radius_pair's rows bit for bit; ``widest`` is each cloud's largest count within the
    radius (past the width the caller searches again). Where the backend has no table (not
    Triton): radius_pair's rows and 0."""
    a = torch.from_numpy(_cloud_np(seed, sizes[0], np.float32))
    b = torch.from_numpy(_cloud_np(seed + 7, sizes[1], np.float32))
    b[:160] = b[0] + 0.001 * torch.arange(160, dtype=torch.float32)[:, None]
    a, b = a.to(backend.device), b.to(backend.device)
    both = torch.cat([a, b])
    n1 = a.shape[0]
    fits = []
    for r, k, width in ((0.4, 100, 1024), (0.4, 100, 128), (0.1, 10, 256), (0.1, 10, 16)):
        d, i, widest = knn_mod.radius_pair_at_width(both, n1, r, k, width)
        assert widest.shape == (2,) and widest.device == both.device
        if backend.name == "triton":  # the kernel's count, up to rounding at the radius
            for c, w in zip((a, b), widest.tolist(), strict=True):
                assert _widest_within(c, r * (1 - 1e-5)) <= w <= _widest_within(c, r * (1 + 1e-5))
        else:
            assert widest.tolist() == [0, 0]
        fits.append(max(widest.tolist()) <= width)
        if fits[-1]:
            rd, ri = knn_mod.radius_pair(both, n1, r, k)
            assert torch.equal(d, rd) and torch.equal(i, ri)
    # Triton: the wide tables held and the narrow ones overflowed (160-190 points within 0.4
    # of the densest, ~115 within 0.1 in the clump); elsewhere there is no table to overflow
    assert fits == ([True, False, True, False] if backend.name == "triton" else [True] * 4)
    with pytest.raises(ValueError, match="width"):
        knn_mod.radius_pair_at_width(both, n1, 0.1, 10, 8)
    with pytest.raises(ValueError, match="split"):
        knn_mod.radius_pair_at_width(both, 0, 0.1, 10, 16)


def test_radius_neighbours_bad_input(backend):
    with pytest.raises(ValueError, match="points"):
        knn_mod.radius_neighbours(torch.zeros(4, 2, device=backend.device), 0.1, 3)
    with pytest.raises(ValueError, match="k"):
        knn_mod.radius_neighbours(torch.zeros(4, 3, device=backend.device), 0.1, 0)


# --- Triton kernel through the interpreter (CPU, tiny sizes, in a child process) -----------

# (name, n, m, k, max_distance, dtype, block_m)
INTERP_CASES = [
    ("1x1", 1, 1, 1, None, torch.float32, None),
    ("3x2k3", 3, 2, 3, None, torch.float32, None),
    ("37x101k1", 37, 101, 1, None, torch.float32, None),
    ("21x61k8", 21, 61, 8, None, torch.float32, None),
    ("19x5k3", 19, 5, 3, None, torch.float32, None),
    ("29x83k1max", 29, 83, 1, 0.15, torch.float32, None),
    ("29x83k5max", 29, 83, 5, 0.15, torch.float32, None),
    ("13x40k5f64", 13, 40, 5, 0.3, torch.float64, 16),
    ("6x3k5", 6, 3, 5, None, torch.float32, None),
    ("17x30k1f64", 17, 30, 1, None, torch.float64, 8),
]


def _interp_inputs(case, seed):
    name, n, m, k, md, dt, bm = case
    g = torch.Generator().manual_seed(1000 * seed + sum(map(ord, name)))
    return _cloud(n, g, dt), _cloud(m, g, dt)


def _interp_ties():
    base = torch.tensor([[0.0, 0, 0], [1.0, 0, 0], [0, 2.0, 0]])
    return torch.tensor([[0.1, 0, 0], [0.9, 0, 0]]), base.repeat(4, 1)  # p[j] = base[j % 3]


def run_interpreted_cases(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): run the kernel on every case, save results."""
    from pointalign.kernels import _backend
    from pointalign.kernels.knn import triton as _knn_triton

    assert _backend.backend(torch.empty(0)) == "interpret"
    out = {}
    for seed in range(3):
        for case in INTERP_CASES:
            name, n, m, k, md, dt, bm = case
            q, p = _interp_inputs(case, seed)
            md2 = None if md is None else md * md
            out[(name, seed)] = _knn_triton.knn(q, p, k, md2, block_m=bm)
        q, p = _interp_inputs(INTERP_CASES[5], seed)
        out[("dispatch", seed)] = knn_mod.knn_tiles(q, p, 5, 0.15**2)  # via the backend
        layout = knn_mod.points_layout(p)  # (3, M): the kept copy the kernel reads
        assert layout is not None and layout.shape == (3, p.shape[0])
        out[("layout", seed)] = knn_mod.knn_tiles(q, p, 1, 0.15**2, points_t=layout)
        p = _interp_inputs(INTERP_CASES[3], seed)[1]
        out[("radius", seed)] = knn_mod.radius_neighbours(p, 0.3, 40)  # the radius table
        a = _interp_inputs(INTERP_CASES[3], seed + 10)[1][:37]  # rows straddle the split
        out[("pair", seed)] = knn_mod.radius_pair(torch.cat([a, p]), 37, 0.3, 40), \
            knn_mod.radius_neighbours(a, 0.3, 40)
        out[("pair_width", seed)] = knn_mod.radius_pair_at_width(torch.cat([a, p]), 37, 0.3,
                                                                 40, 64)
    q, p = _interp_ties()
    out["ties1"] = _knn_triton.knn(q, p, 1, block_m=4)
    out["ties3"] = _knn_triton.knn(q, p, 3, block_m=4)
    torch.save(out, out_path)


interpreted = interpreted_fixture("tests.kernels.test_knn", "run_interpreted_cases")


@pytest.mark.parametrize("case", INTERP_CASES, ids=[c[0] for c in INTERP_CASES])
def test_triton_interpreted_matches_reference(case, seed, interpreted):
    name, n, m, k, md, dt, bm = case
    q, p = _interp_inputs(case, seed)
    d, i = interpreted[(name, seed)]
    assert d.dtype == dt and i.dtype == torch.int64
    md2 = None if md is None else md * md
    rd, ri = knn_mod.knn_reference(q, p, k, md2)
    assert_same_or_tied(d, i, rd, ri)
    assert_knn_matches((d, i), q, p, k, max_distance=md)


def test_triton_interpreted_dispatch(seed, interpreted):
    q, p = _interp_inputs(INTERP_CASES[5], seed)
    assert_knn_matches(interpreted[("dispatch", seed)], q, p, 5, max_distance=0.15)
    assert_knn_matches(interpreted[("layout", seed)], q, p, 1, max_distance=0.15)


def test_triton_interpreted_ties_keep_smallest_index(interpreted):
    # four copies of each of three points: the kept neighbours are the lowest indices
    assert interpreted["ties1"][1][:, 0].tolist() == [0, 1]
    assert interpreted["ties3"][1].tolist() == [[0, 3, 6], [1, 4, 7]]


def test_triton_interpreted_radius_neighbours(seed, interpreted):
    """The radius table (any k: 40 > 32) through the dispatcher, against the oracle."""
    p = _interp_inputs(INTERP_CASES[3], seed)[1]
    d, i = interpreted[("radius", seed)]
    assert_knn_matches((d, i), p, p, 40, max_distance=0.3)
    assert (i[:, 0] == torch.arange(p.shape[0])).all()  # itself first, at distance 0


def test_triton_interpreted_radius_pair(seed, interpreted):
    """The table's two-cloud form: each row as its cloud alone (the rows of ``p`` above)."""
    (d, i), (da, ia) = interpreted[("pair", seed)]
    db, ib = interpreted[("radius", seed)]
    assert torch.equal(d, torch.cat([da, db]))
    assert torch.equal(i, torch.cat([ia, torch.where(ib >= 0, ib + ia.shape[0], ib)]))


def test_triton_interpreted_radius_pair_at_width(seed, interpreted):
    """The fixed-width form: each cloud's widest count, and where it fits, radius_pair's rows."""
    (d, i), _ = interpreted[("pair", seed)]
    dw, iw, widest = interpreted[("pair_width", seed)]
    a = _interp_inputs(INTERP_CASES[3], seed + 10)[1][:37]
    p = _interp_inputs(INTERP_CASES[3], seed)[1]
    for c, w in zip((a, p), widest.tolist(), strict=True):  # up to rounding at the radius
        assert _widest_within(c, 0.3 * (1 - 1e-5)) <= w <= _widest_within(c, 0.3 * (1 + 1e-5))
    if max(widest.tolist()) <= 64:
        assert torch.equal(dw, d) and torch.equal(iw, i)


# ---- the "cpu" backend's k-d tree (knn/cpu.py) -------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 5, 9, 700])
@cpu_only
def test_nearest_equals_brute(backend, seed, dtype, n):
    p = _cloud_np(seed, n, dtype, dup=n > 10)
    q = _cloud_np(seed + 100, 333, dtype, dup=False)
    q[:20] = p[np.arange(20) % n]  # exact hits
    tree = _knn_cpu.CpuTree(p, leaf_size=4)
    for md in (None, 0.7):
        rd, ri = knn_reference(torch.from_numpy(q), torch.from_numpy(p), 1,
                               None if md is None else md * md)
        d, i = tree.nearest(q, None if md is None else md * md)
        _same_neighbours(q, p, ri[:, 0].numpy(), i, rd[:, 0].numpy(), d, dtype)
        # any hint (right, wrong, out of range of the bound, none) gives the same answer
        g = np.random.default_rng(seed)
        for hint in (i, g.integers(-1, n, size=q.shape[0])):
            d2, i2 = tree.nearest(q, None if md is None else md * md, hint)
            assert np.array_equal(i2, i) and np.array_equal(d2, d)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k", [1, 4, 20])
@cpu_only
def test_knn_equals_brute(backend, seed, dtype, k):
    p = _cloud_np(seed, 900, dtype)
    q = np.concatenate([p[:200], _cloud_np(seed + 1, 100, dtype, dup=False)])
    tree = _knn_cpu.CpuTree(p)
    for md in (None, 0.3):
        rd, ri = knn_reference(torch.from_numpy(q), torch.from_numpy(p), k,
                               None if md is None else md * md)
        d, i = tree.knn(q, k, None if md is None else md * md)
        _same_neighbours(q, p, ri.numpy(), i, rd.numpy(), d, dtype)
        assert np.all((d[:, 1:] >= d[:, :-1]) | ~np.isfinite(d[:, 1:]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("leaf_size", [1, 32])
@cpu_only
def test_knn_self_equals_knn(backend, seed, dtype, leaf_size):
    p = _cloud_np(seed, 400, dtype)  # duplicates and a flat sheet: ties by index
    tree = _knn_cpu.CpuTree(p, leaf_size=leaf_size)
    for k, md in ((1, None), (20, None), (20, 0.15), (400, None)):
        d, i = tree.knn_self(k, md)
        d0, i0 = tree.knn(p, k, md)
        assert np.array_equal(i, i0) and np.array_equal(d, d0)
    rd, ri = knn_reference(torch.from_numpy(p), torch.from_numpy(p), 20)
    d, i = tree.knn_self(20)
    _same_neighbours(p, p, ri.numpy(), i, rd.numpy(), d, dtype)


def _lexsorted_knn(q: np.ndarray, p: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Brute-force oracle of the contract: squared distances in the points' dtype, summed in
    axis order, ordered by (distance, index)."""
    e = q[:, None, :] - p[None, :, :]
    d = (e[..., 0] * e[..., 0] + e[..., 1] * e[..., 1]) + e[..., 2] * e[..., 2]
    cols = np.broadcast_to(np.arange(p.shape[0]), d.shape)
    order = np.lexsort((cols, d), axis=1)[:, :k]
    return np.take_along_axis(d, order, 1), order


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@cpu_only
def test_copies_keep_their_smallest_indices(backend, monkeypatch, seed, dtype):
    """Hundreds of copies of one point (a scan's missing returns, written as the origin):
    every copy is equally near, and the copies with the smallest indices win, in the tree
    (its pruning by the smallest index under a node) and in the reference alike. Exact
    where the arithmetic is: the rows whose k nearest are all copies of the query (distance
    0 in any rounding); elsewhere the same neighbours up to rounding (implementations may
    contract multiply-adds)."""
    g = np.random.default_rng(seed)
    p = g.normal(size=(2000, 3)).astype(dtype)
    p[g.choice(2000, 500, replace=False)] = 0
    p[g.choice(2000, 80, replace=False)] = p[7]
    q = np.concatenate([p[:250], (g.normal(size=(150, 3)) * 0.01).astype(dtype)])
    tree = _knn_cpu.CpuTree(p, leaf_size=8)

    def agree(qq, i, d, want_i, want_d):
        _same_neighbours(qq, p, want_i, i, want_d, d, dtype)
        on_copies = want_d.reshape(len(qq), -1)[:, -1] == 0
        assert on_copies.sum() > 0
        assert np.array_equal(i[on_copies], want_i[on_copies])

    for k in (1, 20):
        want_d, want_i = _lexsorted_knn(q, p, k)
        self_d, self_i = _lexsorted_knn(p, p, k)
        rd, ri = knn_reference(torch.from_numpy(q), torch.from_numpy(p), k, tile_pairs=4096)
        agree(q, ri.numpy(), rd.numpy(), want_i, want_d)
        for keyed in (True, False):
            monkeypatch.setattr(_knn_cpu, "KEYED", keyed)
            d, i = tree.knn(q, k)
            agree(q, i, d, want_i, want_d)
            d, i = tree.knn_self(k)
            agree(p, i, d, self_i, self_d)
        d, i = tree.nearest(q)
        agree(q, i, d, want_i[:, 0], want_d[:, 0])
    nmin = tree.nmin  # the smallest original index under every node
    for v in range(len(nmin)):
        a, b = tree.lo[v], tree.hi[v]
        assert nmin[v] == (tree.perm[a:b].min() if b > a else 1 << 62)


@pytest.mark.parametrize("leaf_size", [1, 5, 32])
@cpu_only
def test_keyed_lists_equal_plain(backend, monkeypatch, seed, leaf_size):
    """float32: the keyed k-NN lists give the plain lists' answers bit for bit."""
    p = _cloud_np(seed, 500, np.float32)  # duplicates and a flat sheet: ties by index
    q = np.concatenate([p[::3], _cloud_np(seed + 1, 120, np.float32, dup=False)])
    q[-1, 0] = np.nan  # a non-finite query: that call takes the plain lists
    tree = _knn_cpu.CpuTree(p, leaf_size=leaf_size)
    assert tree._keyable
    cases = ((1, None), (7, None), (16, 0.2), (100, 0.5), (500, None))
    got = [(tree.knn_self(k, md), tree.knn(q, k, md), tree.knn(q[:-1], k, md))
           for k, md in cases]
    monkeypatch.setattr(_knn_cpu, "KEYED", False)
    for (k, md), g in zip(cases, got, strict=True):
        want = (tree.knn_self(k, md), tree.knn(q, k, md), tree.knn(q[:-1], k, md))
        for (d, i), (d0, i0) in zip(g, want, strict=True):
            assert np.array_equal(i, i0) and np.array_equal(d, d0, equal_nan=True)


@cpu_only
def test_keyed_lists_not_for_float64_or_non_finite(backend):
    assert not _knn_cpu.CpuTree(np.zeros((3, 3), np.float64))._keyable
    p = np.zeros((3, 3), np.float32)
    p[1, 2] = np.inf
    assert not _knn_cpu.CpuTree(p)._keyable



@pytest.mark.parametrize("n", [1, 37, 900])
@cpu_only
def test_tree_build_does_not_depend_on_its_serial_levels(backend, seed, n):
    """_build's serial top levels (set by the threads) change no node; inv inverts perm."""
    p = _cloud_np(seed, n, np.float32)
    depth = max(0, math.ceil(math.log2(max(1.0, n / 4))))
    want = _knn_cpu._build(p, depth, 0)
    for top in (1, 2, 3, depth + 2):
        got = _knn_cpu._build(p, depth, top)
        for a, b in zip(got, want, strict=True):
            assert np.array_equal(a, b)
    perm, spts, inv = want[0], want[1], want[6]
    assert np.array_equal(inv[perm], np.arange(n)) and np.array_equal(spts, p[perm])
    assert [_knn_cpu._top_levels(t) for t in (1, 2, 3, 4, 16)] == [0, 2, 3, 3, 5]

def _branchy_boxd2(q0, q1, q2, bmin, bmax, v):
    """The box distance adding only the positive gaps (the form _boxd2 must equal)."""
    d = q0 - q0
    for a, q in enumerate((q0, q1, q2)):
        g = bmin[v, a] - q
        if g > 0:
            d += g * g
        elif q - bmax[v, a] > 0:
            d += (q - bmax[v, a]) * (q - bmax[v, a])
    return d


@cpu_only
def test_flat_box_distance_equals_branchy(backend, seed):
    """_boxd2 (no branches) equals the branchy form bit for bit (inside, outside, on a
    face, degenerate and empty boxes), compiled and as Python."""
    g = np.random.default_rng(seed)
    for dt in (np.float32, np.float64):
        lo = g.normal(size=(300, 3)).astype(dt)
        hi = (lo + np.abs(g.normal(size=(300, 3)))).astype(dt)
        hi[:20] = lo[:20]  # degenerate boxes
        lo[-5:], hi[-5:] = np.inf, -np.inf  # empty nodes
        q = g.normal(scale=2, size=(300, 3)).astype(dt)
        q[20:40] = lo[20:40]  # on a corner
        for v in range(300):
            want = _branchy_boxd2(q[v, 0], q[v, 1], q[v, 2], lo, hi, v)
            a = _knn_cpu._boxd2.py_func(q[v, 0], q[v, 1], q[v, 2], lo, hi, v)
            b = _knn_cpu._boxd2(q[v, 0], q[v, 1], q[v, 2], lo, hi, v)
            assert a == want and type(a) is type(want) and b == want


def _candidates_case(p, seed, dtype, scale):
    """Queries near ``p`` (jittered points, some far ones) and hints of every kind."""
    g = np.random.default_rng(seed)
    n = p.shape[0]
    src = g.integers(0, n, size=1500)
    q = (p[src] + g.normal(scale=scale, size=(1500, 3))).astype(dtype)
    q[:100] = p[src[:100]]  # exact hits (duplicates: ties by index)
    q[-50:] += 10 * scale  # beyond the bound
    hints = (src, g.integers(-1, n, size=1500), np.full(1500, -1))
    return q, hints


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@cpu_only
def test_nearest_with_candidates_equals_tree(backend, seed, dtype):
    p = _cloud_np(seed, 1500, dtype)  # duplicates and a flat sheet
    p[-100:] = p[-1]  # a point repeated more often than the candidate lists are long
    plain = _knn_cpu.CpuTree(p, leaf_size=8)
    fast = _knn_cpu.CpuTree(p, leaf_size=8)
    assert fast.set_candidates(*fast.knn(p, 12), k=8)
    q, hints = _candidates_case(p, seed, dtype, 0.01)
    for md in (None, 0.02):
        b = None if md is None else md * md
        rd, ri = knn_reference(torch.from_numpy(q), torch.from_numpy(p), 1, b)
        for h in hints:
            d0, i0 = plain.nearest(q, b, h)
            d1, i1 = fast.nearest(q, b, h)
            assert np.array_equal(i0, i1) and np.array_equal(d0, d1)
            _same_neighbours(q, p, ri[:, 0].numpy(), i1, rd[:, 0].numpy(), d1, dtype)
    # the shortcut is taken (the test is not vacuous): most jittered queries qualify
    c, r2 = fast.candidates()
    e = q.astype(np.float64) - p[hints[0]]
    assert ((e * e).sum(1) < r2[hints[0]]).mean() > 0.3


@cpu_only
def test_nearest_with_candidates_bunny(backend, bunny_scans):
    s, t = bunny_scans
    t = t[::4].contiguous().numpy()
    plain, fast = _knn_cpu.CpuTree(t), _knn_cpu.CpuTree(t)
    assert fast.set_candidates(*fast.knn(t, 20))
    q = s[::4].contiguous().numpy()
    d, i = plain.nearest(q, 0.05 ** 2)
    for _ in range(2):  # the answers as hints, twice (ICP converged), then a shifted cloud
        d1, i1 = fast.nearest(q, 0.05 ** 2, i)
        assert np.array_equal(i1, i) and np.array_equal(d1, d)
    q2 = q + np.float32(0.002)
    d2, i2 = plain.nearest(q2, 0.05 ** 2)
    d3, i3 = fast.nearest(q2, 0.05 ** 2, i)
    assert np.array_equal(i2, i3) and np.array_equal(d2, d3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@cpu_only
def test_nearest_unhinted_queries_equal_one_at_a_time(backend, seed, dtype):
    """An unhinted query starts from the previous query's answer: the answers do not change."""
    p = _cloud_np(seed, 1200, dtype)
    tree = _knn_cpu.CpuTree(p, leaf_size=8)
    assert tree.set_candidates(*tree.knn(p, 12), k=8)  # the shortcut may fire too
    q, _ = _candidates_case(p, seed, dtype, 0.01)
    q = q[np.argsort(q[:, 0], kind="stable")]  # a spatial order: neighbours come in turn
    hint = np.full(q.shape[0], -1)
    hint[::7] = 0  # some hinted queries in between
    for md in (None, 0.02):
        b = None if md is None else md * md
        d, i = tree.nearest(q, b, hint)
        one = [tree.nearest(q[j:j + 1], b, hint[j:j + 1]) for j in range(0, q.shape[0], 5)]
        assert np.array_equal(i[::5], np.concatenate([o[1] for o in one]))
        assert np.array_equal(d[::5], np.concatenate([o[0] for o in one]))


@cpu_only
def test_set_candidates_rejects_tables_that_do_not_fit(backend):
    p = _cloud_np(0, 50, np.float32, dup=False)
    tree = _knn_cpu.CpuTree(p)
    d, i = tree.knn(p, 6)
    assert not tree.set_candidates(d[:10], i[:10], 4)  # other rows
    assert not tree.set_candidates(d, i, 6)  # no (k+1)-th column
    i2 = i.copy()
    i2[3, 4] = -1  # a missing (k+1)-th neighbour in a table said to be complete
    assert not tree.set_candidates(d, i2, 4)
    assert tree.candidates()[0].shape[0] == 0
    assert tree.set_candidates(d, i, 4) and tree.candidates()[0].shape == (50, 4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@cpu_only
def test_nearest_with_bounded_candidates_equals_tree(backend, seed, dtype):
    """A radius-bounded self-query serves as the shortcut; its short rows take the tree."""
    p = _cloud_np(seed, 1500, dtype)
    plain = _knn_cpu.CpuTree(p, leaf_size=8)
    fast = _knn_cpu.CpuTree(p, leaf_size=8)
    radius = 0.25
    d, i = fast.knn_self(12, radius * radius)
    short = i[:, 8] < 0
    assert short.any() and not short.all()  # both kinds of rows occur
    assert not fast.set_candidates(d, i, 8)  # not said to be bounded: refused
    assert fast.set_candidates(d, i, 8, bounded=True)
    c, r2 = fast.candidates()
    assert (r2[short] == 0).all() and (r2[~short] > 0).all()
    q, hints = _candidates_case(p, seed, dtype, 0.01)
    for md in (None, 0.02):
        b = None if md is None else md * md
        for h in hints:
            d0, i0 = plain.nearest(q, b, h)
            d1, i1 = fast.nearest(q, b, h)
            assert np.array_equal(i0, i1) and np.array_equal(d0, d1)
    e = q.astype(np.float64) - p[hints[0]]
    assert ((e * e).sum(1) < r2[hints[0]]).mean() > 0.1  # the shortcut is taken


@cpu_only
def test_ckdtree_index_keeps_the_self_query(backend):
    p = torch.from_numpy(_cloud_np(3, 500, np.float32, dup=False))
    ix = pa.CKDTreeIndex(p)
    ix.knn(p[:100], 12)  # not the points themselves: nothing kept
    ix.knn(p.clone(), 5)  # too few neighbours for the candidate lists
    tree = ix._cpu_tree()
    assert tree.candidates()[0].shape[0] == 0
    got = ix.knn(p.clone(), 12)  # the self-query (bottom-up) answers as the plain search
    assert tree.candidates()[0].shape == (500, 8)
    d, i = tree.knn(p.numpy(), 12)
    assert np.array_equal(got.idx.numpy(), i) and np.array_equal(got.dists.numpy(), d)


@cpu_only
def test_icp_point_to_plane_candidates_change_nothing(backend, monkeypatch, bunny_scans):
    from pointalign.search import ckdtree

    s, t = (c[::4].contiguous() for c in bunny_scans)
    crit = pa.ConvergenceCriteria(max_iterations=12, relative_fitness=0, relative_rmse=0,
                                  translation_tolerance=0, rotation_tolerance=0)
    out = []
    for cand in (ckdtree.CANDIDATES, 10**9):  # the lists kept, then never kept
        monkeypatch.setattr(ckdtree, "CANDIDATES", cand)
        out.append(pa.icp(s, t, max_correspondence_distance=0.05, method="point_to_plane",
                          criteria=crit, device="cpu"))
    assert np.array_equal(np.asarray(out[0].transformation), np.asarray(out[1].transformation))
    assert out[0].fitness == out[1].fitness and out[0].rmse == out[1].rmse


@cpu_only
def test_tree_bad_input(backend):
    with pytest.raises(ValueError, match="points"):
        _knn_cpu.CpuTree(np.zeros((0, 3), np.float32))
    with pytest.raises(ValueError, match="points"):
        _knn_cpu.CpuTree(np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match="leaf_size"):
        _knn_cpu.CpuTree(np.zeros((4, 3), np.float32), leaf_size=0)


@backends("torch", "cpu")
def test_ckdtree_index_matches_reference(backend, seed):
    """CKDTreeIndex answers as the brute force on the "cpu" backend (the numba tree, which
    reads hints) and on "torch" (SciPy's tree, which ignores them)."""
    p = torch.from_numpy(_cloud_np(seed, 2000, np.float32))
    q = torch.from_numpy(_cloud_np(seed + 7, 500, np.float32, dup=False))
    ix = pa.CKDTreeIndex(p)
    assert _backend.backend(p) == backend.name
    got = [ix.knn(q, 7), ix.radius(q, 0.2, 9), ix.nearest_within(q, 0.3)]
    hinted = ix.nearest_within(q, 0.3, hint=torch.full((500,), 3, dtype=torch.int64))
    d_u, i_u = hinted.dists[:, 0], hinted.idx[:, 0]
    ref = [knn_reference(q, p, 7), knn_reference(q, p, 9, 0.2**2),
           knn_reference(q, p, 1, 0.3**2)]
    for a, (rd, ri) in zip(got, ref, strict=True):
        _same_neighbours(q.numpy(), p.numpy(), ri.numpy(), a.idx.numpy(), rd.numpy(),
                         a.dists.numpy(), np.float32)
    assert torch.equal(i_u, got[2].idx[:, 0]) and torch.equal(d_u, got[2].dists[:, 0])


@cpu_only
def test_bunny_nearest_equals_brute(backend, bunny_scans):
    s, t = bunny_scans
    q = s[::8].numpy()
    tree = _knn_cpu.CpuTree(t.numpy())
    rd, ri = knn_reference(torch.from_numpy(q), t, 1, 0.05 ** 2)
    d, i = tree.nearest(q, 0.05 ** 2)
    _same_neighbours(q, t.numpy(), ri[:, 0].numpy(), i, rd[:, 0].numpy(), d, np.float32)
