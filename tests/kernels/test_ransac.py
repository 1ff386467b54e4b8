"""kernels.ransac: RANSAC's kernels against their references, by backend.

* Scoring (``score_transforms``): on the "cpu" backend the fused transform-and-score kernel
  (``score_cpu._score``) runs when the index has a scoring grid;
  ``score_transforms_reference`` moves the points with ``transform_points_reference``
  (``baddbmm``) and asks the index's ``nearest_within``. Counts and matches must be
  identical, the float64 sums equal up to summation order (and exactly the documented
  blocked order). Where the kernel's documented rounding of the moved points
  (``((p₀r₀ + p₁r₁) + p₂r₂) + t``, no fused multiply-add) differs from this CPU's
  ``baddbmm`` (an AVX-512 or FMA build may round otherwise), the reference is given the
  documented rounding, and a comparison with ``baddbmm`` itself is made only where this
  CPU rounds so.
* Feature kNN (``cpu.feature_knn_cpu``): distances equal the float64 truth to float32
  rounding (the reference's ``cdist`` has the larger error); a neighbour may differ from
  the reference's only between rows within ``cdist``'s rounding of each other; against the
  module contract written plainly (``Σ_d (q_d − r_d)²`` in order of d, NumPy, no FMA) bit
  for bit.
* The scoring grid (``score_cpu.BoundGrid``) returns exactly the k-d tree's answers (and
  through it the brute force's), at every bound, with exact hits, points at the bound and
  far queries.
* Second-order compatibility: integer counts, equal bit for bit; pair lengths rounded step
  by step, equal to NumPy's in that order.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pointalign.kernels import _backend
from pointalign.kernels import ransac as K
from pointalign.kernels.knn import cpu as _knn_cpu
from pointalign.kernels.knn import knn_reference
from pointalign.kernels.ransac import cpu as _ransac_cpu
from pointalign.kernels.ransac import score_cpu as _score_cpu
from pointalign.search.ckdtree import CKDTreeIndex
from tests._backends import backends
from tests._interpreted import interpreted_fixture
from tests._oracles import bumpy_sheet

try:  # the ransac family's home for them (the pipeline branch moves them there)
    from pointalign.kernels.ransac import (
        pair_lengths,
        second_order,
        second_order_of_points,
        second_order_reference,
    )
except ImportError:  # before that move: the algorithm layer
    from pointalign.registration.robust import (  # type: ignore[no-redef]
        pair_lengths,
        second_order,
        second_order_of_points,
        second_order_reference,
    )

#: the numba kernels' own cases: the "cpu" backend only (skipped without numba)
cpu_only = backends("cpu")


# ---- scoring: the fused transform-and-score kernel (score_cpu.py) ------------------------

def _motions(s: int, g: torch.Generator, shift: float = 0.1) -> torch.Tensor:
    """``s`` random rigid motions ``(s, 4, 4)`` float64 (rotations from QR, random shifts)."""
    q, r = torch.linalg.qr(torch.randn(s, 3, 3, dtype=torch.float64, generator=g))
    q = q * torch.sign(torch.diagonal(r, dim1=1, dim2=2))[:, None, :]
    q[torch.linalg.det(q) < 0, :, 0] *= -1
    T = torch.eye(4, dtype=torch.float64).repeat(s, 1, 1)
    T[:, :3, :3] = q
    T[:, :3, 3] = (torch.rand(s, 3, dtype=torch.float64, generator=g) - 0.5) * 2 * shift
    return T


def _sequential(T: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``((p₀r₀ + p₁r₁) + p₂r₂) + t`` elementwise in the points' dtype: ``(S, P, 3)``."""
    Tp = T.to(p.dtype)
    R, t = Tp[:, None, :3, :3], Tp[:, None, :3, 3]
    x, y, z = p[None, :, 0, None], p[None, :, 1, None], p[None, :, 2, None]
    return ((x * R[..., 0] + y * R[..., 1]) + z * R[..., 2]) + t


def _reference(T, p, index, r, with_matches, monkeypatch):
    """The reference path; where this CPU's ``baddbmm`` rounds otherwise (e.g. with FMA),
    with the moved points of the rounding the kernel documents (``_sequential``)."""
    if not torch.equal(K.transform_points_reference(T, p), _sequential(T, p)):
        monkeypatch.setattr(K, "transform_points_reference", _sequential)
    out = K.score_transforms_reference(T, p, index, r, with_matches)
    monkeypatch.undo()
    return out


def _check(T, p, index, r, monkeypatch, min_hits=1):
    """Fused == reference (counts, matches exactly; sums to order) with and without matches."""
    assert K._scoring_grid(T, p, index, r) is not None  # the fused kernel answers
    for wm in (False, True):
        c, sq, m = K.score_transforms(T, p, index, r, wm)
        rc, rsq, rm = _reference(T, p, index, r, wm, monkeypatch)
        assert c.dtype == torch.int64 and sq.dtype == torch.float64
        assert torch.equal(c, rc)
        assert torch.allclose(sq, rsq, rtol=1e-12, atol=0)
        if wm:
            assert m is not None and m.shape == (T.shape[0], p.shape[0])
            assert m.dtype == torch.int64 and torch.equal(m, rm)
        else:
            assert m is None
        assert int(c.sum()) >= min_hits
    # counts only: each point's search stops at its first target point within the bound
    only, none_sq, none_m = K.score_transforms(T, p, index, r, with_sums=False)
    assert torch.equal(only, c) and none_sq is None and none_m is None
    _check_masked(T, p, index, r)
    return c, sq


def _check_masked(T, p, index, r):
    """Scoring with ``valid`` equals scoring every motion, on the valid rows; 0 / -1 else."""
    valid = torch.arange(T.shape[0], device=T.device) % 3 != 1
    for wm in (False, True):
        full = K.score_transforms(T, p, index, r, wm)
        _equal_where_valid(K.score_transforms(T, p, index, r, wm, valid=valid), full, valid)


def _equal_where_valid(part, full, valid):
    """Equal bits: each motion's sums run over its own blocks of points in a fixed order,
    whatever the other motions (the fused kernels' contract), on any CPU."""
    (c, sq, m), (fc, fsq, fm) = part, full
    assert torch.equal(c, torch.where(valid, fc, 0)) and torch.equal(sq, torch.where(valid, fsq, 0))
    assert (m is None) == (fm is None)
    assert m is None or torch.equal(m, torch.where(valid[:, None], fm, -1))


@pytest.mark.parametrize("s,p", [(1, 700), (300, 33), (9, 600)])
@cpu_only
def test_fused_equals_reference_random(backend, s, p, monkeypatch):
    dtype = torch.float32  # (float64 works the same way; its numba compile costs CI ~25 s)
    g = torch.Generator().manual_seed(s * 1000 + p)
    tgt = torch.rand(150, 3, generator=g, dtype=dtype) * 0.5
    src = torch.rand(p, 3, generator=g, dtype=dtype) * 0.5
    T = _motions(s, g)
    T[0] = torch.eye(4, dtype=torch.float64)  # some hits for sure
    index = CKDTreeIndex(tgt)
    src0 = src.clone()
    _check(T, src, index, 0.04, monkeypatch)
    assert torch.equal(src, src0)  # inputs not modified


@cpu_only
def test_fused_equals_reference_on_the_bunny(backend, monkeypatch):
    """Scoring as register() does it: a real scan pair, the true pose and 64 others."""
    from pointalign import datasets
    from pointalign.features.downsample import voxel_downsample

    v = 0.006
    tgt = voxel_downsample(datasets.load_bunny("bun000"), v)
    src = voxel_downsample(datasets.load_bunny("bun045"), v)
    g = torch.Generator().manual_seed(7)
    T0 = torch.as_tensor(datasets.bunny_relative_pose("bun045", "bun000"), dtype=torch.float64)
    T = _motions(65, g, shift=0.01)
    T[:, :3, :3] = T0[:3, :3] @ torch.linalg.matrix_exp(  # small turns about the truth
        torch.linalg.cross(torch.eye(3, dtype=torch.float64)[None].expand(65, 3, 3),
                           torch.randn(65, 1, 3, dtype=torch.float64, generator=g) * 0.05,
                           dim=-1))
    T[:, :3, 3] += T0[:3, 3]
    T[0] = T0
    index = CKDTreeIndex(tgt)
    for r in (0.5 * v, 1.5 * v):
        c, _ = _check(T, src, index, r, monkeypatch)
        assert int(c[0]) > 0.3 * src.shape[0]  # the true pose: most points hit
    # RANSAC's T(d,d) shape: 32 points, many motions
    sub = src[torch.randperm(src.shape[0], generator=g)[:32]]
    _check(torch.cat([T, _motions(400, g, 0.05)]), sub, index, 1.5 * v, monkeypatch)


@cpu_only
def test_no_hits_and_points_outside_the_grid(backend, monkeypatch):
    g = torch.Generator().manual_seed(3)
    tgt = torch.rand(100, 3, generator=g)
    src = torch.cat([torch.rand(50, 3, generator=g),
                     torch.tensor([[1e6, -1e6, 3.0], [-50.0, 0.5, 0.5], [0.5, 0.5, 1e30]])])
    T = _motions(40, g)
    T[1, :3, 3] = torch.tensor([100.0, 0.0, 0.0], dtype=torch.float64)  # all far away
    index = CKDTreeIndex(tgt)
    _check(T, src, index, 0.05, monkeypatch)
    c, sq, m = K.score_transforms(T, src, index, 0.05, True)
    assert int(c[1]) == 0 and float(sq[1]) == 0.0 and bool((m[1] == -1).all())
    assert bool((m[:, -3:] == -1).all())  # outside the grid under every motion


@cpu_only
def test_moves_points_as_transform_points_does(backend):
    """Targets placed exactly where ``transform_points`` moves the source: distance 0.

    A kernel that rounded the motion otherwise (another order, a fused multiply-add) would
    miss the exact zeros.
    """
    g = torch.Generator().manual_seed(11)
    src = torch.rand(400, 3, generator=g) * 0.3
    T = _motions(8, g)
    moved = K.transform_points_reference(T[:1], src)[0]
    if not torch.equal(moved, _sequential(T[:1], src)[0]):
        pytest.skip("this CPU's baddbmm rounds otherwise (the kernel's order: _sequential)")
    index = CKDTreeIndex(moved)
    c, sq, m = K.score_transforms(T, src, index, 0.01, True)
    assert K._scoring_grid(T, src, index, 0.01) is not None
    assert int(c[0]) == 400 and float(sq[0]) == 0.0
    assert torch.equal(m[0], torch.arange(400))


@cpu_only
def test_sums_in_the_documented_order_and_thread_count_free(backend):
    """Per transform: blocks of SCORE_BLOCK points summed in point order, then the blocks."""
    import pointalign as pa

    g = torch.Generator().manual_seed(5)
    tgt = torch.rand(120, 3, generator=g)
    src = torch.rand(3 * _score_cpu.SCORE_BLOCK + 17, 3, generator=g)
    T = _motions(5, g, 0.02)
    index = CKDTreeIndex(tgt)
    c, sq, m = K.score_transforms(T, src, index, 0.08, True)
    # the kernel's own squared distances of the matches (the index's, per point), at the
    # points moved with the kernel's documented rounding (baddbmm may round otherwise on
    # this CPU: then these sums would not be the kernel's)
    q = _sequential(T, src).reshape(-1, 3)
    d2 = index.nearest_within(q, 0.08).dists[:, 0].view(5, -1).to(torch.float64).numpy()
    for s in range(5):
        total = 0.0
        for a in range(0, src.shape[0], _score_cpu.SCORE_BLOCK):
            part = 0.0
            for i in range(a, min(src.shape[0], a + _score_cpu.SCORE_BLOCK)):
                if m[s, i] >= 0:
                    part += float(d2[s, i])
            total += part
        assert float(sq[s]) == total
    try:
        pa.set_num_threads(1)
        one = K.score_transforms(T, src, index, 0.08, False)
        pa.set_num_threads(2)
        two = K.score_transforms(T, src, index, 0.08, False)
    finally:
        pa.set_num_threads(None)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    assert torch.equal(one[1], sq)


@backends("torch", "cpu")
def test_routes_and_bad_input(backend):
    g = torch.Generator().manual_seed(2)
    tgt = torch.rand(500, 3, generator=g)
    src = torch.rand(20, 3, generator=g)
    index = CKDTreeIndex(tgt)
    T = _motions(3, g)
    # few queries per target point (or the torch backend): no grid, the reference path
    assert K._scoring_grid(T, src, index, 0.05) is None
    got = K.score_transforms(T, src, index, 0.05, True)
    want = K.score_transforms_reference(T, src, index, 0.05, True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    c, sq, m = K.score_transforms(T, src, index, 0.05, with_sums=False)
    assert torch.equal(c, want[0]) and sq is None and m is None
    # another index kind: the reference path
    from pointalign.search.brute import BruteForceIndex

    assert K._scoring_grid(T, src, BruteForceIndex(tgt), 0.05) is None
    # no motions
    c, sq, m = K.score_transforms(T[:0], src, index, 0.05, True)
    assert c.shape == (0,) and sq.shape == (0,) and m.shape == (0, 20)
    with pytest.raises(ValueError, match="T"):
        K.score_transforms(T[:, :3], src, index, 0.05)
    with pytest.raises(ValueError, match="points"):
        K.score_transforms(T, src[:, :2], index, 0.05)
    with pytest.raises(ValueError, match="max_distance"):
        K.score_transforms(T.repeat(200, 1, 1), src, index, -1.0)


@cpu_only
def test_grid_lists_sorted_by_centre_distance_then_index(backend):
    """Build: each cell's list in (distance from the centre, index) order, with coordinates.

    Duplicated points (equal keys) and a dense cluster (lists longer than the insertion
    sort's limit) take both sort branches.
    """
    import math

    g = torch.Generator().manual_seed(9)
    base = torch.rand(300, 3, generator=g).numpy()
    pts = np.concatenate([base, base[:40], 0.5 + 1e-4 * torch.rand(200, 3, generator=g).numpy()])
    pts = np.ascontiguousarray(pts, np.float32)
    grid = _score_cpu.BoundGrid.build(pts, 0.1 ** 2)
    assert grid is not None
    assert np.array_equal(grid.cpts, pts[grid.items])
    lens = np.diff(grid.start)
    assert lens.max() > _score_cpu._INSERTION_MAX and (lens >= 3).sum() > 100
    d1, d2 = grid.dims[1], grid.dims[2]
    for cell in np.flatnonzero(lens):
        a, b = grid.start[cell], grid.start[cell + 1]
        x, y, z = cell // (d1 * d2), (cell // d2) % d1, cell % d2
        centre = grid.origin + (np.array([x, y, z]) + 0.5) * grid.c
        p = pts[grid.items[a:b]].astype(np.float64) - centre
        key = np.array([math.sqrt(u * u + v * v + w * w) for u, v, w in p])
        assert np.array_equal(grid.dc[a:b], key)
        want = np.lexsort((grid.items[a:b], key))  # by key, then index
        assert np.array_equal(want, np.arange(b - a))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@cpu_only
def test_transform_points_cpu_equals_reference(backend, dtype):
    """The numba move equals ``baddbmm`` (shared and per-transform points, S = 1 and more)."""
    g = torch.Generator().manual_seed(3)
    T = _motions(6, g)
    for pts in (torch.rand(700, 3, generator=g, dtype=dtype) * 40 - 20,
                torch.rand(6, 300, 3, generator=g, dtype=dtype)):
        for S in (1, 6):
            p = pts if pts.dim() == 2 else pts[:S]
            got = K.transform_points(T[:S], p)
            ref = K.transform_points_reference(T[:S], p)
            assert got.shape == ref.shape == (S, p.shape[-2], 3) and got.dtype == dtype
            seq = _sequential(T[:S], p) if p.dim() == 2 else torch.stack(
                [_sequential(T[s:s + 1], p[s])[0] for s in range(S)])
            assert torch.equal(got, seq)  # the documented rounding, always
            if torch.equal(ref, seq):  # and baddbmm's, where this CPU rounds so
                assert torch.equal(got, ref)
            assert torch.allclose(got, ref, rtol=1e-6 if dtype == torch.float32 else 1e-14,
                                  atol=1e-5 if dtype == torch.float32 else 1e-12)


def _move_cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(T, points)`` float32: shared points (S = 1, 5; a ragged last block) and per-problem
    points, coordinates to ±20 and shifts to ±2."""
    g = torch.Generator().manual_seed(11)
    T = _motions(5, g, shift=2.0).float()
    shared = torch.rand(1500, 3, generator=g) * 40 - 20
    own = torch.rand(5, 700, 3, generator=g) * 40 - 20
    return [(T[:1], shared), (T, shared), (T, own), (T[:0], shared),
            (T, shared[None].expand(5, -1, -1))]  # an expanded view: read once


def _check_move(got: torch.Tensor, T: torch.Tensor, p: torch.Tensor) -> None:
    """``got`` within 4 float32 ulps of the float64 move's largest term, per point."""
    Td, pd = T.double(), p.double()
    want = K.transform_points_reference(Td, pd)
    pts = pd if pd.dim() == 3 else pd.expand(T.shape[0], -1, -1)
    terms = (pts.abs() @ Td[:, :3, :3].abs().transpose(1, 2)) + Td[:, None, :3, 3].abs()
    assert got.shape == want.shape and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= 4 * 2.0**-23 * terms).all()


def run_interpreted_move(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): the Triton move of every case."""
    from pointalign.kernels.ransac import triton as _ransac_triton

    torch.save([_ransac_triton.transform_points(T, p) for T, p in _move_cases()], out_path)


interpreted_move = interpreted_fixture("tests.kernels.test_ransac", "run_interpreted_move",
                                       "interpreted_move")


def test_triton_move_interpreted(interpreted_move):
    """The Triton move (``ransac/triton.py``) to float32 FMA rounding of the exact move."""
    for got, (T, p) in zip(interpreted_move, _move_cases(), strict=True):
        _check_move(got, T, p)


@pytest.mark.parametrize("T_shape,p_shape", [((2, 3, 4), (5, 3)), ((2, 4, 4), (5, 2)),
                                             ((2, 4, 4), (3, 5, 3)), ((4, 4), (5, 3))])
def test_triton_move_rejects_bad_shapes(T_shape, p_shape):
    """Shapes off the contract are a ValueError before any launch (no garbage read)."""
    pytest.importorskip("triton")
    from pointalign.kernels.ransac import triton as _ransac_triton

    with pytest.raises(ValueError, match="transform_points"):
        _ransac_triton.transform_points(torch.zeros(T_shape), torch.zeros(p_shape))


@pytest.mark.gpu
def test_transform_points_on_cuda():
    """``transform_points`` of float32 CUDA points takes the Triton move: FMA rounding."""
    for T, p in _move_cases():
        got = K.transform_points(T.cuda(), p.cuda())
        assert got.is_cuda
        _check_move(got.cpu(), T, p)
        if T.shape[0]:  # float64 points keep the reference
            d = K.transform_points(T.double().cuda(), p.double().cuda())
            assert torch.equal(d, K.transform_points_reference(T.double().cuda(),
                                                               p.double().cuda()))


# ---- triangle hypotheses (the Triton tests in ransac/triton.py) ----------------------------

def _triangle_cases() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """``(cs, ct, triples, similarity)``: 60 correspondences of a known motion with noise, 400
    random triples (repeated rows: coincident vertices), collinear source rows, one wildly
    wrong correspondence, and similarity 0.2 and 1 (the test off)."""
    g = torch.Generator().manual_seed(3)
    cs = torch.rand(60, 3, generator=g) * 2 - 1
    R = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))[0]
    R = R * torch.sign(torch.linalg.det(R))
    ct = (cs.double() @ R.T + 0.3).float() + 1e-3 * torch.randn(60, 3, generator=g)
    cs[50:55] = cs[40] + torch.linspace(0.1, 0.5, 5)[:, None] * (cs[41] - cs[40])  # a line
    ct[59] = 5.0  # a wrong match
    triples = torch.randint(0, 60, (400, 3), generator=g)
    triples[:20] = torch.tensor([40, 41, 50])  # a collinear source triangle
    triples[20:30, 1] = triples[20:30, 0]  # a repeated correspondence
    return [(cs, ct, triples, 0.2), (cs, ct, triples, 1.0)]


def _check_triangles(got, cs, ct, triples, sim) -> None:
    """Hypotheses ``(T, valid, keep)`` of every row (the dropped ones invalid) against the
    reference composition: the same tests up to a triangle on a bound, the same motions to
    float64 rounding."""
    from pointalign.kernels.horn.reference import horn_reference
    from pointalign.kernels.ransac.reference import triangle_has_area

    T, valid, keep = got
    H = triples.shape[0]
    assert T.shape == (H, 4, 4) and T.dtype == torch.float64 and valid.shape == keep.shape == (H,)
    src, tgt = cs[triples], ct[triples]
    want_keep = K.triangle_similar(src, tgt, sim)
    ls = (src - src.roll(1, dims=-2)).norm(dim=-1)
    lt = (tgt - tgt.roll(1, dims=-2)).norm(dim=-1)
    edge = ((torch.minimum(ls, lt) - (1 - sim) * torch.maximum(ls, lt)).abs()
            <= 1e-5 * torch.maximum(ls, lt)).any(1)
    assert torch.equal(keep | edge, want_keep | edge)
    Tr, ok = horn_reference(src.double(), tgt.double(), torch.ones(H, 3, dtype=torch.float64))
    want = keep & ok & triangle_has_area(src, 1e-12) & triangle_has_area(tgt, 1e-12)
    assert torch.equal(valid, want)
    assert not bool(valid[:30].any())  # collinear, or a repeated correspondence: no area
    torch.testing.assert_close(T[valid], Tr[valid], atol=1e-9, rtol=0)
    assert torch.equal(T[~valid], torch.eye(4, dtype=torch.float64).expand(int((~valid).sum()),
                                                                           4, 4))


def _check_tests(got, cs, ct, triples, sim) -> None:
    """The Triton tests ``(keep, area) (H,)`` against the reference's, every hypothesis:
    equal up to a triangle with an edge pair on the ratio's bound."""
    from pointalign.kernels.ransac.reference import triangle_has_area

    keep, area = got
    src, tgt = cs[triples], ct[triples]
    ls = (src - src.roll(1, dims=-2)).norm(dim=-1)
    lt = (tgt - tgt.roll(1, dims=-2)).norm(dim=-1)
    edge = ((torch.minimum(ls, lt) - (1 - sim) * torch.maximum(ls, lt)).abs()
            <= 1e-5 * torch.maximum(ls, lt)).any(1)
    assert keep.dtype == area.dtype == torch.bool and keep.shape == (triples.shape[0],)
    assert torch.equal(keep | edge, K.triangle_similar(src, tgt, sim) | edge)
    assert torch.equal(area, triangle_has_area(src, 1e-12) & triangle_has_area(tgt, 1e-12))
    assert not bool(area[:30].any())  # collinear, or a repeated correspondence: no area


def run_interpreted_triangles(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): the Triton tests of every case."""
    from pointalign.kernels.ransac import triton as _ransac_triton

    torch.save([_ransac_triton.triangle_tests(cs, ct, tri, sim, 1e-12)
                for cs, ct, tri, sim in _triangle_cases()], out_path)


interpreted_triangles = interpreted_fixture("tests.kernels.test_ransac",
                                            "run_interpreted_triangles",
                                            "interpreted_triangles")


def test_triton_triangle_tests_interpreted(interpreted_triangles):
    for got, case in zip(interpreted_triangles, _triangle_cases(), strict=True):
        _check_tests(got, *case)


@backends("torch", "cpu", "triton")
def test_triangle_motions_entry_point(backend):
    """Every backend: the hypotheses that pass the triangle test, in order, with their rows,
    equal to the reference's motions."""
    for cs, ct, triples, sim in _triangle_cases():
        dev = backend.device
        got = K.triangle_motions(cs.to(dev), ct.to(dev), triples.to(dev), sim, 1e-12)
        keep = K.triangle_similar(cs[triples], ct[triples], sim)
        rows = got.rows.cpu()
        assert torch.equal(rows, keep.nonzero().squeeze(1))
        full_T = torch.eye(4, dtype=torch.float64).repeat(triples.shape[0], 1, 1)
        full_valid = torch.zeros(triples.shape[0], dtype=torch.bool)
        full_T[rows], full_valid[rows] = got.T.cpu(), got.valid.cpu()
        _check_triangles((full_T, full_valid, keep), cs, ct, triples, sim)


# ---- feature kNN on Triton (ransac/triton.py) ---------------------------------------------

def _feature_cases() -> list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None,
                                   torch.Tensor | None, int | None]]:
    """``(query, ref, k, n, m, split)`` float32: FPFH-like rows with duplicates and exact hits
    (more than one tile of each), small-integer rows (exact sums, many ties), k = 1 and 2,
    one reference share or several (shares past the reference's end included), a single
    reference tile, fewer reference than query rows, and a batch of three problems with
    padding (n, m: counts)."""
    g = torch.Generator().manual_seed(5)
    q = torch.rand(70, 33, generator=g) * 30
    r = torch.rand(300, 33, generator=g) * 30
    r[280:290] = r[:10]  # duplicate rows: ties to the smaller index
    q[:5] = r[100:105]  # exact hits
    q[60:65] = q[:5]  # duplicate queries: backward ties to the smaller query row
    qi = torch.randint(0, 3, (45, 7), generator=g).float()
    ri = torch.randint(0, 3, (130, 7), generator=g).float()
    qb = torch.rand(3, 40, 33, generator=g)
    rb = torch.rand(3, 90, 33, generator=g)
    n, m = torch.tensor([40, 7, 1]), torch.tensor([90, 20, 65])
    return [(q, r, 2, None, None, None), (q, r, 2, None, None, 1), (q, r, 1, None, None, 3),
            (r, q, 1, None, None, None), (q, r, 2, None, None, 2),
            (qi, ri, 2, None, None, None), (qi, ri, 1, None, None, 8), (ri, qi, 2, None, None, 3),
            (q[:9], r[:3], 2, None, None, None), (qb, rb, 2, n, m, None),
            (rb, qb, 1, m, n, 2)]


def _check_feature_knn(d: torch.Tensor, i: torch.Tensor, q: torch.Tensor, r: torch.Tensor,
                       k: int) -> None:
    """One problem's ``(d, i) (N, k)``: the k nearest by (distance, index), ascending.

    Distances are the float64 truth of the returned rows to float32 rounding (a sum of 33
    positive terms: 1e-5 relative); where the truth is exact in float32 (small integers)
    the answer is the plain stable order bit for bit; elsewhere the rows may differ only
    between near-equidistant rows.
    """
    truth = ((q[:, None].double() - r[None].double()) ** 2).sum(-1)
    order = torch.from_numpy(np.argsort(truth.numpy(), axis=1, kind="stable")[:, :k])
    assert d.shape == i.shape == (q.shape[0], k) and i.dtype == torch.int64
    assert d.dtype == torch.float32
    torch.testing.assert_close(d.double(), truth.gather(1, i), rtol=1e-5, atol=1e-6)
    if bool((q == q.round()).all() and (r == r.round()).all()):
        assert torch.equal(i, order) and torch.equal(d.double(), truth.gather(1, order))
    else:
        near = (truth.gather(1, i) - truth.gather(1, order)).abs() <= 1e-5 * truth.amax()
        assert bool(((i == order) | near).all())
    assert bool((d[:, 1:] >= d[:, :-1]).all())


def _check_feature_case(got, q, r, k, n, m, split=None) -> None:
    """Forward ``(d, i)`` and (when given) backward ``(bd, bi)`` of one case."""
    back = len(got) == 4
    if n is None:
        _check_feature_knn(got[0], got[1], q, r, k)
        if back:
            _check_feature_knn(got[2], got[3], r, q, 1)
        return
    for b in range(q.shape[0]):
        nb, mb = int(n[b]), int(m[b])
        _check_feature_knn(got[0][b, :nb], got[1][b, :nb], q[b, :nb], r[b, :mb], k)
        assert bool((got[1][b, nb:] == -1).all()) and bool(torch.isinf(got[0][b, nb:]).all())
        if back:
            _check_feature_knn(got[2][b, :mb], got[3][b, :mb], r[b, :mb], q[b, :nb], 1)
            assert bool((got[3][b, mb:] == -1).all())


def run_interpreted_features(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): the Triton feature kNN of every case, both
    ways, and forward only (the same forward answers)."""
    from pointalign.kernels.ransac import triton as _ransac_triton

    torch.save([(_ransac_triton.feature_knn(q, r, k, n, m, backward=True, split=sp),
                 _ransac_triton.feature_knn(q, r, k, n, m, split=sp))
                for q, r, k, n, m, sp in _feature_cases()], out_path)


interpreted_features = interpreted_fixture("tests.kernels.test_ransac",
                                           "run_interpreted_features", "interpreted_features")


def test_triton_feature_knn_interpreted(interpreted_features):
    for (both, forward), case in zip(interpreted_features, _feature_cases(), strict=True):
        _check_feature_case(both, *case)
        assert all(torch.equal(a, b) for a, b in zip(both[:2], forward, strict=True))


@pytest.mark.parametrize("args", [
    (torch.zeros(4, 33, dtype=torch.float64), torch.zeros(5, 33, dtype=torch.float64), 1),
    (torch.zeros(4, 33), torch.zeros(5, 32), 1),
    (torch.zeros(4, 33), torch.zeros(5, 33), 0),
    (torch.zeros(4, 33), torch.zeros(1, 33), 2),
    (torch.zeros(4, 33), torch.zeros(40, 33), 3),
    (torch.zeros(2, 4, 33), torch.zeros(2, 5, 33), 1),  # a batch without its counts
], ids=["float64", "dims", "k0", "k_over_M", "k_over_2", "no_counts"])
def test_triton_feature_knn_rejects_bad_input(args):
    """Off-contract input is a ValueError before any launch (no garbage read)."""
    pytest.importorskip("triton")
    from pointalign.kernels.ransac import triton as _ransac_triton

    with pytest.raises(ValueError, match="feature_knn"):
        _ransac_triton.feature_knn(*args)


@pytest.mark.gpu
def test_feature_knn_on_cuda():
    """On CUDA, float32 features take the Triton kernel: every case, through the entry
    points (``feature_knn``, ``feature_matches``, ``feature_matches_many``)."""
    from pointalign.kernels.ransac import triton as _ransac_triton

    for q, r, k, n, m, split in _feature_cases():
        qc, rc = q.cuda(), r.cuda()
        if n is None:
            got = K.feature_knn(qc, rc, k)
            assert all(torch.equal(a, b) for a, b in
                       zip(got, _ransac_triton.feature_knn(qc, rc, k), strict=True))
            _check_feature_case(tuple(x.cpu() for x in got), q, r, k, n, m)
            both = K.feature_matches(qc, rc, k, backward=True)
        else:
            both = K.feature_matches_many(qc, rc, n.cuda(), m.cuda(), k, backward=True)
        assert both.back_idx is not None and both.back_dists is not None
        _check_feature_case(tuple(x.cpu() for x in both), q, r, k, n, m)
        one = _ransac_triton.feature_knn(qc, rc, k, None if n is None else n.cuda(),
                                         None if m is None else m.cuda(), backward=True,
                                         split=split)
        _check_feature_case(tuple(x.cpu() for x in one), q, r, k, n, m)
    # float64 features keep the reference
    q, r = _feature_cases()[0][:2]
    d, i = K.feature_knn(q.double().cuda(), r.double().cuda(), 2)
    assert d.dtype == torch.float64
    _check_feature_knn(d.float().cpu(), i.cpu(), q, r, 2)


# ---- feature kNN (ransac/cpu.py) and the scoring grid (score_cpu.BoundGrid) ------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("k", [1, 2, 5])
@backends("torch", "cpu")
def test_feature_knn_equals_reference(backend, dtype, k):
    g = torch.Generator().manual_seed(k)
    q = (torch.rand(301, 33, generator=g, dtype=torch.float64) * 30).to(dtype)
    r = (torch.rand(517, 33, generator=g, dtype=torch.float64) * 30).to(dtype)
    r[100:110] = r[:10]  # duplicate rows: ties to the smaller index
    q[:20] = r[200:220]  # exact hits
    d, i = _ransac_cpu.feature_knn_cpu(q, r, k)
    rd, ri = K.feature_knn_reference(q, r, k)
    assert d.dtype == dtype and i.shape == (301, k)
    truth = ((q[:, None].double() - r[None].double()) ** 2).sum(-1)  # (301, 517)
    # distances: the true squared distances of the returned rows, to float32 rounding
    got = truth.gather(1, i)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(d.double(), got, rtol=tol, atol=tol)
    # the returned rows are the k nearest (up to rounding) and ascending
    kth = truth.sort(1).values[:, k - 1]
    assert bool((got[:, -1] <= kth * (1 + 2 * tol) + tol).all())
    assert bool((d[:, 1:] >= d[:, :-1]).all()) if k > 1 else True
    assert torch.equal(i[:20, 0], torch.arange(200, 220))
    # where the reference's neighbours are clearly separated, the same indices
    gap = (truth.gather(1, ri) - truth.gather(1, i)).abs().amax(1)
    sep = gap > 1e-3 * truth.amax()
    assert not bool(((ri != i).any(1) & sep).any())
    # entry point: the cpu kernel on the "cpu" backend, else the reference
    _, i2 = K.feature_knn(q, r, k)
    assert torch.equal(i2, i if _backend.backend(q) == "cpu" else ri)


@cpu_only
def test_feature_knn_duplicates_break_ties_by_index(backend):
    r = torch.zeros(6, 4)
    r[3] = 1.0
    d, i = _ransac_cpu.feature_knn_cpu(torch.zeros(2, 4), r, 3)
    assert torch.equal(i, torch.tensor([[0, 1, 2], [0, 1, 2]]))
    assert torch.equal(d, torch.zeros(2, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("n", [1, 9, 203])
@cpu_only
def test_feature_knn_both_equals_two_calls(backend, dtype, n):
    """One pass (forward k + backward 1) equals the two separate kernel calls exactly."""
    g = torch.Generator().manual_seed(n)
    q = (torch.rand(n, 33, generator=g, dtype=torch.float64) * 30).to(dtype)
    r = (torch.rand(157, 33, generator=g, dtype=torch.float64) * 30).to(dtype)
    if n > 20:
        q[10:20] = q[:10]  # duplicate queries: the backward ties go to the smaller index
        r[50:60] = q[:10]  # exact hits both ways
    d, i, bd, bi = _ransac_cpu.feature_knn_both_cpu(q, r, 2)
    d1, i1 = _ransac_cpu.feature_knn_cpu(q, r, 2)
    bd1, bi1 = _ransac_cpu.feature_knn_cpu(r, q, 1)
    assert torch.equal(d, d1) and torch.equal(i, i1)
    assert torch.equal(bd, bd1) and torch.equal(bi, bi1)
    if n > 20:
        assert torch.equal(bi[50:60, 0], torch.arange(10))


def _feature_knn_plain(q: torch.Tensor, r: torch.Tensor, k: int):
    """The module contract written plainly: ``Σ_d (q_d − r_d)²`` in the dtype, in order of d.

    NumPy rounds every subtraction, product and sum on its own (no FMA); a stable sort gives
    ties to the smaller index, ``argmin`` the first minimum. Returns forward ``(d, i)`` of
    shape ``(N, k)`` and backward ``(d, i)`` of shape ``(M, 1)``.
    """
    qn, rn = q.numpy(), r.numpy()
    acc = np.zeros((qn.shape[0], rn.shape[0]), qn.dtype)
    for d in range(qn.shape[1]):
        x = qn[:, None, d] - rn[None, :, d]
        acc += x * x
    i = np.argsort(acc, axis=1, kind="stable")[:, :k]
    bi = np.argmin(acc, axis=0)[:, None]
    return (torch.from_numpy(np.take_along_axis(acc, i, 1)), torch.from_numpy(i),
            torch.from_numpy(np.take_along_axis(acc, bi.T, 0).T), torch.from_numpy(bi))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("dim", [3, 4, 7, 8, 33])
@pytest.mark.parametrize("grid", [False, True], ids=["float", "grid"])
@cpu_only
def test_feature_knn_bit_equal_to_plain_sum(backend, dtype, dim, grid):
    """Both kernels equal the plain in-order sum bit for bit, ties included.

    ``dim`` covers fewer dimensions than one register group, whole groups and remainders;
    ``grid`` features (small integers) make many equal distances; 45 queries are not a
    multiple of the query block and 300 reference rows are more than one tile.
    """
    g = torch.Generator().manual_seed(dim)
    if grid:
        q = torch.randint(0, 3, (45, dim), generator=g).to(dtype)
        r = torch.randint(0, 3, (300, dim), generator=g).to(dtype)
    else:
        q = (torch.randn(45, dim, generator=g, dtype=torch.float64) * 7).to(dtype)
        r = (torch.randn(300, dim, generator=g, dtype=torch.float64) * 7).to(dtype)
        r[270:280] = r[5:15]
        q[:5] = r[260:265]
    d0, i0, bd0, bi0 = _feature_knn_plain(q, r, 3)
    d, i = _ransac_cpu.feature_knn_cpu(q, r, 3)
    assert torch.equal(i, i0) and torch.equal(d, d0)
    d, i, bd, bi = _ransac_cpu.feature_knn_both_cpu(q, r, 3)
    assert torch.equal(i, i0) and torch.equal(d, d0)
    assert torch.equal(bi, bi0) and torch.equal(bd, bd0)
    bd, bi = _ransac_cpu.feature_knn_cpu(r, q, 1)
    assert torch.equal(bi, bi0) and torch.equal(bd, bd0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@cpu_only
def test_bound_grid_equals_tree_and_brute(backend, dtype):
    g = np.random.default_rng(7)
    p, _ = bumpy_sheet(5, 2000, torch.float64)
    pts = (p.numpy() * 3 + 100.0).astype(dtype)  # far from the origin: rounding matters
    q = np.concatenate([pts + g.normal(scale=s, size=pts.shape) for s in (0.0, 0.01, 0.05, 1)])
    q = q.astype(dtype)
    tree = _knn_cpu.CpuTree(pts)
    for r in (0.02, 0.05, 0.3):
        md = dtype(r * r)
        grid = _score_cpu.BoundGrid.build(pts, md)
        assert grid is not None
        d, i = grid.nearest(q)
        td, ti = tree.nearest(q, md)
        assert np.array_equal(i, ti) and np.array_equal(d, td)
        # points exactly at the bound: rounding decides, identically on both paths
        edge = pts[:50] + np.array([r, 0, 0], dtype)
        assert np.array_equal(grid.nearest(edge)[1], tree.nearest(edge, md)[1])
    bd, bi = knn_reference(torch.from_numpy(q[:500]), torch.from_numpy(pts), 1, 0.03 ** 2)
    d, i = _score_cpu.BoundGrid.build(pts, dtype(0.03 ** 2)).nearest(q[:500])
    assert np.array_equal(i, bi[:, 0].numpy())


@cpu_only
def test_scoring_tree_routes_many_queries_to_the_grid(backend):
    p, _ = bumpy_sheet(2, 500, torch.float32)
    pts = p.numpy()
    t = _score_cpu.ScoringTree(pts)
    q = np.repeat(pts, 5, 0) + np.float32(0.01)
    base = _knn_cpu.CpuTree(pts)
    d, i = t.nearest(q, 0.05 ** 2)
    assert len(t._grids) == 1  # built for this bound and kept
    bd, bi = base.nearest(q, 0.05 ** 2)
    assert np.array_equal(i, bi) and np.array_equal(d, bd)
    t.nearest(q[:10], 0.05 ** 2, hint=np.zeros(10, np.int64))  # hinted: the tree
    t.nearest(q[:10], 0.02 ** 2)  # few queries, new bound: the tree, no grid built
    assert len(t._grids) == 1


@cpu_only
def test_bound_grid_declines_a_huge_extent(backend):
    pts = np.array([[0, 0, 0], [1e6, 1e6, 1e6]], np.float64)
    assert _score_cpu.BoundGrid.build(pts, 1e-6) is None
    t = _score_cpu.ScoringTree(pts)
    d, i = t.nearest(np.zeros((20, 3)), 1e-6)
    assert (i == 0).all() and not math.isnan(float(d[0]))


@cpu_only
def test_bound_grid_equals_tree_on_a_real_scan(backend):
    """Scoring queries as register() makes them: the bunny moved by near and far motions."""
    from pointalign import datasets
    from pointalign.features.downsample import voxel_downsample

    v = 0.006
    pts = voxel_downsample(datasets.load_bunny("bun000"), v).numpy()  # ~1,000 points
    src = voxel_downsample(datasets.load_bunny("bun045"), v)
    g = torch.Generator().manual_seed(4)
    ang = torch.rand(8, generator=g, dtype=torch.float64) * 0.6 - 0.3  # turns about z
    T = torch.eye(4, dtype=torch.float64).repeat(8, 1, 1)
    T[:, 0, 0], T[:, 0, 1] = torch.cos(ang), -torch.sin(ang)
    T[:, 1, 0], T[:, 1, 1] = torch.sin(ang), torch.cos(ang)
    T[:, :3, 3] = torch.rand(8, 3, generator=g, dtype=torch.float64) * 0.02 - 0.01
    T[0] = torch.as_tensor(datasets.bunny_relative_pose("bun045", "bun000"))
    q = K.transform_points(T, src).reshape(-1, 3).numpy()
    tree = _knn_cpu.CpuTree(pts)
    for r in (0.5 * v, v, 1.5 * v):
        md = np.float32(r * r)
        grid = _score_cpu.BoundGrid.build(pts, md)
        assert grid is not None
        d, i = grid.nearest(q)
        td, ti = tree.nearest(q, md)
        assert np.array_equal(i, ti) and np.array_equal(d, td)
        assert (i >= 0).mean() > 0.05  # the aligned hypothesis hits: the early stop acts


# ---- second-order compatibility and pair lengths ------------------------------------------

def _compat(src: torch.Tensor, tgt: torch.Tensor, tau: float) -> torch.Tensor:
    A = ((torch.cdist(src, src) - torch.cdist(tgt, tgt)).abs() < tau).to(torch.float32)
    return A.fill_diagonal_(0)


@cpu_only
@pytest.mark.parametrize("c", [3, 64, 130, 700])
def test_second_order_equals_reference(backend, c):
    g = torch.Generator().manual_seed(c)
    src = torch.rand(c, 3, generator=g)
    tgt = src.clone()
    tgt[c // 3:] = torch.rand(c - c // 3, 3, generator=g)  # two thirds wrong matches
    A = _compat(src, tgt, 0.05)
    S = _ransac_cpu.second_order_cpu(A)
    assert torch.equal(S, second_order_reference(A))
    assert bool((S > 0).any()) or c == 3


def test_second_order_on_real_correspondences(backend, monkeypatch):
    """Two bunny scans paired by index: the entry point takes the kernel on the "cpu"
    backend (only there), equal to the reference bit for bit (integer counts)."""
    from pointalign import datasets

    p = datasets.load_bunny("bun000")[::40][:1000]
    q = datasets.load_bunny("bun045")[::40][:1000]
    A = _compat(q, p, 0.004)
    calls = []
    real = _ransac_cpu.second_order_cpu
    monkeypatch.setattr(_ransac_cpu, "second_order_cpu", lambda a: calls.append(1) or real(a))
    S = second_order(A.to(backend.device))
    assert bool(calls) == (backend.name == "cpu")
    assert torch.equal(S.cpu(), second_order_reference(A))


@pytest.mark.parametrize("c", [3, 65, 700])
def test_second_order_of_points_equals_reference(backend, c, monkeypatch):
    """The fused kernel (lengths and A pair by pair, never stored) equals the reference.

    Bit for bit, with tau at a value some |ds − dt| takes exactly (the strict comparison
    decides those pairs) and at one that rounds to float32 (the comparison is PyTorch's).
    The entry point on every backend: the kernel on "cpu" (only there), else the lengths
    (elementwise PyTorch operations, one rounding each, the root in float64: the same
    values on every device) and the integer counts of the reference.
    """
    g = torch.Generator().manual_seed(c)
    src = torch.rand(c, 3, generator=g) * 0.1
    tgt = src + torch.randn(c, 3, generator=g) * 0.004  # noisy correspondences
    tgt[: c // 3] = torch.rand(c // 3, 3, generator=g) * 0.1  # and wrong ones
    ds, dt = pair_lengths(src), pair_lengths(tgt)
    # the lengths themselves: sqrt((dx² + dy²) + dz²) rounded step by step (NumPy float32)
    d = src.numpy()[:, None] - src.numpy()[None]
    assert np.array_equal(ds.numpy(), np.sqrt((d[..., 0] ** 2 + d[..., 1] ** 2) + d[..., 2] ** 2))
    gap = (ds - dt).abs()
    tie = float(gap[0, 1]) if c > 3 else 0.7
    for tau in (tie, 0.7 * float(gap.mean()) + 1e-9):
        A = ((ds - dt).abs() < tau).to(torch.float32).fill_diagonal_(0)
        want = second_order_reference(A)
        assert 0 < int(A.sum()) < c * (c - 1) or c == 3
        if _backend.cpu_available():  # the numba kernel itself (any backend setting)
            assert torch.equal(_ransac_cpu.second_order_points_cpu(src, tgt, tau), want)
    calls = []
    real = _ransac_cpu.second_order_points_cpu
    monkeypatch.setattr(_ransac_cpu, "second_order_points_cpu",
                        lambda *a: calls.append(1) or real(*a))
    dev = backend.device
    got = second_order_of_points(src.to(dev), tgt.to(dev), tau)
    assert torch.equal(got.cpu(), want) and len(calls) == int(backend.name == "cpu")


def _ranking_cases() -> list[K.FeatureMatches]:
    """Feature matches of random FPFH-like rows (some mutual, some not), with duplicated
    target rows (distance ties, ratio 1) and exact hits (ratio 0, a zero second distance)."""
    g = torch.Generator().manual_seed(11)
    out = []
    for n, m in ((300, 280), (5, 2), (700, 900)):
        s, t = torch.rand(n, 33, generator=g), torch.rand(m, 33, generator=g)
        t[1::7] = t[0::7][: t[1::7].shape[0]]      # pairs of equal target rows
        s[:min(3, m)] = t[:3]                      # exact hits
        out.append(K.FeatureMatches(*K.feature_knn_reference(s, t, 2),
                                    *K.feature_knn_reference(t, s, 1)))
    return out


@backends("torch", "cpu", "triton")
def test_ranking_keys_equal_the_reference(backend):
    """ranking_keys: the reference's keys bit for bit on every backend (the same operations,
    correctly rounded); mutual rows below 2, the others at or above."""
    for mt in _ranking_cases():
        dev = backend.device
        got = K.ranking_keys(K.FeatureMatches(*(x.to(dev) for x in mt)))
        want = K.ranking_keys_reference(mt.dists, mt.idx, mt.back_idx)
        assert got.dtype == torch.float64 and torch.equal(got.cpu(), want)
        mutual = mt.back_idx[mt.idx[:, 0], 0] == torch.arange(mt.idx.shape[0])
        assert bool((want[mutual] <= 1).all()) and bool((want[~mutual] >= 2).all())
    with pytest.raises(ValueError, match="k >= 2"):
        K.ranking_keys(K.FeatureMatches(mt.dists[:, :1], mt.idx[:, :1], mt.back_dists,
                                        mt.back_idx))


def run_interpreted_ranking(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): the Triton ranking keys of every case."""
    from pointalign.kernels.ransac import triton as _ransac_triton

    torch.save([_ransac_triton.ranking_keys(mt.dists, mt.idx, mt.back_idx)
                for mt in _ranking_cases()], out_path)


interpreted_ranking = interpreted_fixture("tests.kernels.test_ransac", "run_interpreted_ranking",
                                          "interpreted_ranking")


def test_triton_ranking_keys_interpreted(interpreted_ranking):
    for got, mt in zip(interpreted_ranking, _ranking_cases(), strict=True):
        assert torch.equal(got, K.ranking_keys_reference(mt.dists, mt.idx, mt.back_idx))


# ---- scoring on CUDA: the Triton kernel against a brute-force index (ransac/triton.py) ----

def _triton_scoring_cases() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """(motions, source, target, bound): one motion and many points, many motions and few
    points (RANSAC's T(d,d)), a tight bound; the identity first (hits for sure)."""
    g = torch.Generator().manual_seed(21)
    tgt = torch.rand(300, 3, generator=g) * 0.5
    out = []
    for s, p, r in ((1, 700, 0.04), (300, 33, 0.04), (9, 100, 0.01)):
        T = _motions(s, g)
        T[0] = torch.eye(4, dtype=torch.float64)
        out.append((T, torch.rand(p, 3, generator=g) * 0.5, tgt, r))
    return out


def _scoring_of_triton_moves(T, src, index, r, with_matches, move=K.transform_points):
    """The reference with the points moved as the Triton kernel moves them: ``move`` is
    transform_points' dispatcher on CUDA (its Triton kernel), ``_sequential`` for the
    interpreter (the kernel's order without fused multiply-adds; a CPU's ``baddbmm`` may
    round otherwise, with AVX-512 or FMA)."""
    import pointalign.kernels.ransac.reference as ref

    saved, ref.transform_points_reference = ref.transform_points_reference, move
    try:
        return K.score_transforms_reference(T, src, index, r, with_matches)
    finally:
        ref.transform_points_reference = saved


def _check_scoring(got, want):
    """The interpreter (no fused multiply-adds): the reference's counts and matches, the
    sums up to their order."""
    (c, sq, m), (rc, rsq, rm) = got, want
    assert c.dtype == torch.int64 and sq.dtype == torch.float64 and torch.equal(c, rc)
    assert torch.allclose(sq, rsq, rtol=1e-12, atol=0)
    assert (m is None) == (rm is None) and (m is None or torch.equal(m, rm))


@backends("triton")
def test_triton_scoring_equals_the_reference_of_its_moves(backend):
    """On CUDA a brute-force index is scored by one Triton launch. Its moved coordinates,
    kept in registers, may round a few float32 ulps from transform_points' stored ones (the
    compiler contracts multiply-adds its own way), so a squared distance moves by at most
    ~6·r·4 ulps of the coordinates: the counts and matches are the reference's (for the
    points moved by transform_points) except for points that close to the bound or to a
    tie, and each sum is the reference's to that tolerance per inlier."""
    from pointalign.search.brute import BruteForceIndex

    for T, src, tgt, r in _triton_scoring_cases():
        T, src, index = T.cuda(), src.cuda(), BruteForceIndex(tgt.cuda())
        assert K._scoring_layout(T, src, index) is not None
        moved = K.transform_points(T, src).reshape(-1, 3)
        tol = 6 * r * 4 * torch.finfo(torch.float32).eps * float(moved.abs().max().clamp_min(1))
        d, _ = index.knn(moved, 2)
        unsure = (((d[:, 0] - r * r).abs() <= tol) | (d[:, 1] - d[:, 0] <= tol)).view(
            T.shape[0], -1)
        for wm in (False, True):
            c, sq, m = K.score_transforms(T, src, index, r, wm)
            rc, rsq, rm = _scoring_of_triton_moves(T, src, index, r, wm)
            assert c.dtype == torch.int64 and sq.dtype == torch.float64
            assert bool(((c - rc).abs() <= unsure.sum(1)).all())
            assert bool(((sq - rsq).abs() <= (c + rc) * tol + 1e-12 * rsq).all())
            if wm:
                assert torch.equal(m[~unsure], rm[~unsure])
            plain = K.score_transforms_reference(T, src, index, r, wm)  # baddbmm's moves
            assert int((c - plain[0]).abs().sum()) <= 2
        only, none_sq, none_m = K.score_transforms(T, src, index, r, with_sums=False)
        assert none_sq is None and none_m is None and torch.equal(only, c)
        _check_masked(T, src, index, r)  # the kernel skips the masked motions' scans


def run_interpreted_scoring(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): the Triton scoring and its reference."""
    from pointalign.kernels.ransac import triton as _ransac_triton
    from pointalign.search.brute import BruteForceIndex

    out = []
    for T, src, tgt, r in _triton_scoring_cases():
        index = BruteForceIndex(tgt)
        soa = index.scoring_layout()
        valid = torch.arange(T.shape[0]) % 3 != 1
        out.append(([(_ransac_triton.score_transforms(T, src, soa, r, wm),
                      _scoring_of_triton_moves(T, src, index, r, wm, _sequential))
                     for wm in (False, True)],
                    (_ransac_triton.score_transforms(T, src, soa, r, True, valid),
                     _ransac_triton.score_transforms(T, src, soa, r, True), valid)))
    torch.save(out, out_path)


interpreted_scoring = interpreted_fixture("tests.kernels.test_ransac", "run_interpreted_scoring",
                                          "interpreted_scoring")


def test_triton_scoring_interpreted(interpreted_scoring):
    for case, (part, full, valid) in interpreted_scoring:
        for got, want in case:
            _check_scoring(got, want)
        assert int(case[0][0][0].sum()) >= 1
        _equal_where_valid(part, full, valid)  # the masked motions' scans skipped


def test_a_malformed_valid_mask_is_refused():
    from pointalign.search.ckdtree import CKDTreeIndex

    g = torch.Generator().manual_seed(0)
    T, p = _motions(4, g), torch.rand(20, 3, generator=g)
    index = CKDTreeIndex(torch.rand(30, 3, generator=g))
    for bad in (torch.ones(3, dtype=torch.bool), torch.ones(4, dtype=torch.int64)):
        with pytest.raises(ValueError, match="valid: expected"):
            K.score_transforms(T, p, index, 0.1, valid=bad)
