"""kernels.knn: the chunked PyTorch reference and the fused Triton kernel vs a SciPy oracle."""

from __future__ import annotations

import math

import pytest
import torch

from pointalign.kernels import knn as knn_mod
from tests._interpreted import interpreted_fixture
from tests._oracles import assert_knn_matches, assert_same_or_tied

SIZES = [(1, 1), (1, 2), (2, 3), (3, 1), (7, 13), (31, 17), (97, 211), (257, 64)]


def _cloud(n: int, g: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    return torch.rand(n, 3, generator=g, dtype=torch.float64).to(dtype)


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


def test_points_layout_and_radius_tiles(rng, dtype):
    q, p = _cloud(41, rng, dtype), _cloud(157, rng, dtype)
    layout = knn_mod.points_layout(p)
    assert layout is None  # the PyTorch path reads the points as they are
    d, i = knn_mod.knn_tiles(q, p, 3, 0.2**2, points_t=layout)
    assert_knn_matches((d, i), q, p, 3, max_distance=0.2)
    # radius_tiles: knn_tiles with the squared radius; the self-query through the feature
    # kernels' radius search (same contract)
    rd, ri = knn_mod.radius_tiles(q, p, 0.2, 3)
    assert torch.equal(rd, d) and torch.equal(ri, i)
    sd, si = knn_mod.radius_tiles(p, p, 0.15, 40)
    assert_knn_matches((sd, si), p, p, 40, max_distance=0.15)
    assert (si[:, 0] == torch.arange(157)).all()  # itself first, at distance 0


def test_no_neighbour_and_padding(rng):
    p = _cloud(5, rng) + 10.0
    q = _cloud(4, rng)
    d, i = knn_mod.knn_tiles(q, p, 7, 1.0)
    assert torch.isinf(d).all() and (i == -1).all()
    d, i = knn_mod.knn_tiles(q, p, 7)
    assert (i[:, 5:] == -1).all() and torch.isinf(d[:, 5:]).all()
    assert (i[:, :5] >= 0).all()


def test_empty_query(rng):
    d, i = knn_mod.knn_tiles(torch.empty(0, 3), _cloud(4, rng), 2)
    assert d.shape == (0, 2) and i.shape == (0, 2)


def test_bad_input(rng):
    q, p = _cloud(4, rng), _cloud(5, rng)
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


def test_bunny_reference(bunny_pair):
    q = bunny_pair.source[::61]
    p = bunny_pair.target[::3]
    res = knn_mod.knn_reference(q, p, 8)
    assert_knn_matches(res, q, p, 8)


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


# --- CUDA: the compiled kernel vs the reference at larger sizes ------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 2, 8, 16, 32])
@pytest.mark.parametrize("max_distance", [None, 0.05])
def test_triton_cuda_matches_reference(k, max_distance, rng):
    q = _cloud(5003, rng).cuda()
    p = _cloud(20011, rng).cuda()
    md2 = None if max_distance is None else max_distance**2
    d, i = knn_mod.knn_tiles(q, p, k, md2)
    assert d.is_cuda and i.is_cuda
    rd, ri = knn_mod.knn_reference(q, p, k, md2)
    assert_same_or_tied(d, i, rd, ri)
    sel = torch.arange(0, 5003, 7, device="cuda")
    assert_knn_matches((d[sel], i[sel]), q[sel], p, k, max_distance)


@pytest.mark.gpu
def test_triton_cuda_float64_and_bunny(bunny_pair):
    q, p = bunny_pair.source.cuda(), bunny_pair.target.cuda()
    res = knn_mod.knn_tiles(q, p, 4)
    assert_knn_matches(res, q, p, 4)
    res = knn_mod.knn_tiles(q.double(), p.double(), 1, 0.002**2)
    assert_knn_matches(res, q, p, 1, max_distance=0.002)


def test_k_above_32_uses_reference(monkeypatch, rng):
    q, p = _cloud(9, rng), _cloud(50, rng)
    res = knn_mod.knn_tiles(q, p, 33)
    assert_knn_matches(res, q, p, 33)
    assert math.isinf(float(knn_mod.knn_tiles(q, p, 60)[0][0, -1]))
