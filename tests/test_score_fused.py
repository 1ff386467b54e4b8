"""The fused CPU transform-and-score kernel against the reference path (kernels.ransac).

``score_transforms`` runs ``_score_cpu._score`` when the "cpu" index has a scoring grid;
``score_transforms_reference`` moves the points with ``transform_points_reference``
(``baddbmm``) and asks the index's ``nearest_within``. Counts and matches must be
identical, the float64 sums equal up to summation order (and exactly the documented
blocked order).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pointalign.kernels import _backend
from pointalign.kernels import ransac as K
from pointalign.kernels.ransac import score_cpu as _score_cpu
from pointalign.search.ckdtree import CKDTreeIndex

pytestmark = pytest.mark.skipif(not _backend.cpu_available(), reason="numba missing")


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
    return c, sq


@pytest.mark.parametrize("s,p", [(1, 700), (300, 33), (9, 600)])
def test_fused_equals_reference_random(s, p, monkeypatch):
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


def test_fused_equals_reference_on_the_bunny(monkeypatch):
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


def test_no_hits_and_points_outside_the_grid(monkeypatch):
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


def test_moves_points_as_transform_points_does():
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


def test_sums_in_the_documented_order_and_thread_count_free():
    """Per transform: blocks of SCORE_BLOCK points summed in point order, then the blocks."""
    import pointalign as pa

    g = torch.Generator().manual_seed(5)
    tgt = torch.rand(120, 3, generator=g)
    src = torch.rand(3 * _score_cpu.SCORE_BLOCK + 17, 3, generator=g)
    T = _motions(5, g, 0.02)
    index = CKDTreeIndex(tgt)
    c, sq, m = K.score_transforms(T, src, index, 0.08, True)
    # the kernel's own squared distances of the matches (the index's, per point)
    q = K.transform_points_reference(T, src).reshape(-1, 3)
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


def test_routes_and_bad_input():
    g = torch.Generator().manual_seed(2)
    tgt = torch.rand(500, 3, generator=g)
    src = torch.rand(20, 3, generator=g)
    index = CKDTreeIndex(tgt)
    T = _motions(3, g)
    # few queries per target point: no grid, the reference path (the tree) answers
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


def test_grid_lists_sorted_by_centre_distance_then_index():
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
def test_transform_points_cpu_equals_reference(dtype):
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
