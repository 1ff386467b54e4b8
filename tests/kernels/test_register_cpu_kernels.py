"""register()'s CPU kernels (numba) against their PyTorch references.

* ``_fpfh_cpu``: SPFH equals the reference exactly in float64; in float32 an angle within an
  ulp of a bin edge may fall in the neighbouring bin (libm's ``atan2`` against PyTorch's),
  so at most a few rows differ, each by one pair moved to an adjacent bin. The combine sums
  in another order: equal to 1e-4 relative.
* ``_ransac_cpu``: distances equal the float64 truth to float32 rounding (the reference's
  ``cdist`` has the larger error); a neighbour may differ from the reference's only between
  rows within ``cdist``'s rounding of each other.
* ``_score_cpu``: the per-bound grid returns exactly the k-d tree's answers (and through it
  the brute force's), at every bound, with exact hits, points at the bound and far queries.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pointalign.kernels import ransac as KR
from pointalign.kernels.features import fpfh as KP
from pointalign.kernels.knn import knn_reference

_knn_cpu = pytest.importorskip("pointalign.kernels.knn.cpu")
if not _knn_cpu.available():
    pytest.skip("numba is not installed", allow_module_level=True)
from pointalign.kernels.features import fpfh_cpu as _fpfh_cpu  # noqa: E402
from pointalign.kernels.ransac import cpu as _ransac_cpu  # noqa: E402
from pointalign.kernels.ransac import score_cpu as _score_cpu  # noqa: E402


def _surface(seed: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A bumpy sheet ``(n, 3)`` with its unit normals (duplicates and a flat part)."""
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g, dtype=torch.float64)
    z = 0.1 * torch.sin(6 * xy[:, 0]) * torch.cos(4 * xy[:, 1])
    z[: n // 8] = 0.0  # flat: parallel normals, the tie rule of the pair features
    p = torch.cat([xy, z[:, None]], 1)
    dz = torch.stack([-0.6 * torch.cos(6 * xy[:, 0]) * torch.cos(4 * xy[:, 1]),
                      0.4 * torch.sin(6 * xy[:, 0]) * torch.sin(4 * xy[:, 1])], 1)
    dz[: n // 8] = 0.0
    nrm = torch.cat([-dz, torch.ones(n, 1, dtype=torch.float64)], 1)
    nrm = nrm / nrm.norm(dim=1, keepdim=True)
    p[n - n // 10:] = p[: n // 10]  # exact duplicates: zero-distance pairs
    nrm[n - n // 10:] = nrm[: n // 10]
    return p.to(dtype), nrm.to(dtype)


def _table(p: torch.Tensor, r: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    d, i = knn_reference(p, p, k, r * r)
    return d, i


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_spfh_and_combine_equal_reference(dtype):
    p, n = _surface(3, 900, dtype)
    d, i = _table(p, 0.08, 40)
    i[::7, 5] = -1  # holes in the table
    h = _fpfh_cpu.spfh_cpu(p, n, i)
    ref = KP.spfh_reference(p, n, i)
    assert h.dtype == dtype and h.shape == (900, 33)
    rows = (h - ref).abs().amax(1) > 1e-3
    if dtype == torch.float64:
        torch.testing.assert_close(h, ref, atol=1e-9, rtol=1e-12)
    else:  # a bin-edge flip moves one pair: two bins change by 100 / #neighbours
        assert int(rows.sum()) <= 3
        torch.testing.assert_close(h[~rows], ref[~rows], atol=1e-4, rtol=1e-5)
    f = _fpfh_cpu.fpfh_combine_cpu(ref, i, d)
    torch.testing.assert_close(f, KP.fpfh_combine_reference(ref, i, d), atol=1e-3, rtol=1e-4)
    # a point without neighbours: zeros, as the reference
    lone = torch.full_like(i[:2], -1)
    assert torch.equal(_fpfh_cpu.spfh_cpu(p[:2], n[:2], lone), torch.zeros(2, 33, dtype=dtype))


def test_atan2_polynomial_error_bound():
    """The polynomial arctangent stays within 2e-6 rad: 40x inside ALPHA_MARGIN's budget."""
    ang = np.linspace(-math.pi, math.pi, 20001)
    for r in (1e-3, 1.0, 1e3):
        y, x = r * np.sin(ang), r * np.cos(ang)
        got = np.array([_fpfh_cpu._atan2_approx(a, b) for a, b in zip(y[::7], x[::7], strict=True)])
        assert np.abs(got - np.arctan2(y[::7], x[::7])).max() < 2e-6
    # the bound in bins, against the margin (the exact path's own error is < 1e-5 bin)
    assert 2e-6 * _fpfh_cpu.BINS / (2 * math.pi) < _fpfh_cpu.ALPHA_MARGIN / 50


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_alpha_bin_equals_atan2_bin(dtype, seed):
    """Fast α bins equal atan2's everywhere, next to the bin edges and at ±0 / ±π too."""
    g = np.random.default_rng(seed)
    edges = -math.pi + 2 * math.pi * np.arange(12) / 11
    ang = np.concatenate([g.uniform(-math.pi, math.pi, 3000),
                          (edges[:, None] + np.array([-1e-6, -1e-7, 0, 1e-7, 1e-6])).ravel()])
    r = g.uniform(1e-3, 10, ang.size)
    y, x = (r * np.sin(ang)).astype(dtype), (r * np.cos(ang)).astype(dtype)
    # rows nudged by single ulps around the edges; zeros of both signs; a NaN
    y = np.concatenate([y, np.nextafter(y[-60:], dtype(np.inf)), [0.0, -0.0, 0.0, -0.0, 1.0],
                        [np.nan, 0.0]]).astype(dtype)
    x = np.concatenate([x, x[-60:], [-1.0, -1.0, 0.0, -0.0, 0.0], [1.0, np.inf]]).astype(dtype)
    lo, span, nb = dtype(-math.pi), dtype(2 * math.pi), dtype(_fpfh_cpu.BINS)
    fast = [_fpfh_cpu._alpha_bin(a, b, lo, span, nb, False) for a, b in zip(y, x, strict=True)]
    exact = [_fpfh_cpu._alpha_bin(a, b, lo, span, nb, True) for a, b in zip(y, x, strict=True)]
    assert fast == exact
    assert exact[:3000] == [_fpfh_cpu._bin(dtype(math.atan2(a, b)), lo, span, nb)
                            for a, b in zip(y[:3000], x[:3000], strict=True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_spfh_fast_alpha_equals_exact_atan2(dtype):
    """The SPFH kernel's α shortcut changes no bin: equal to the all-atan2 run bit for bit."""
    p, n = _surface(5, 1500, dtype)
    d, i = _table(p, 0.1, 60)
    i[::5, 3] = -1
    pn, nn, inn = p.numpy(), n.numpy(), i.numpy()
    tol = pn.dtype.type(16 * np.finfo(pn.dtype).eps)
    fast, exact = (np.empty((1500, 33), pn.dtype) for _ in range(2))
    _fpfh_cpu._spfh(pn, nn, inn, tol, fast, False)
    _fpfh_cpu._spfh(pn, nn, inn, tol, exact, True)
    assert np.array_equal(fast, exact)
    assert np.array_equal(_fpfh_cpu.spfh_cpu(p, n, i).numpy(), exact)


def test_fpfh_entry_points_use_cpu_kernels_on_a_real_scan(monkeypatch):
    from pointalign import datasets
    from pointalign.features.downsample import voxel_downsample
    from pointalign.features.fpfh import neighbourhoods, restrict
    from pointalign.features.normals import estimate_normals
    from pointalign.kernels import _backend
    from pointalign.search import build_index

    monkeypatch.delenv("POINTALIGN_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _backend.backend(torch.empty(0)) == "cpu"
    v = 0.008
    pts = voxel_downsample(datasets.load_bunny("bun000"), v)  # ~1,000 points
    nb = neighbourhoods(pts, 5 * v, 100, build_index(pts))
    nrm = estimate_normals(pts, neighbors=restrict(nb, 2 * v, 30), orient="viewpoint",
                           viewpoint=pts.mean(0))
    h = KP.spfh(pts, nrm, nb.idx)
    ref = KP.spfh_reference(pts, nrm, nb.idx)
    assert int(((h - ref).abs().amax(1) > 1e-3).sum()) <= 2
    f = KP.fpfh_combine(ref, nb.idx, nb.dists)
    torch.testing.assert_close(f, KP.fpfh_combine_reference(ref, nb.idx, nb.dists),
                               atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_feature_knn_equals_reference(dtype, k):
    g = torch.Generator().manual_seed(k)
    q = (torch.rand(301, 33, generator=g, dtype=torch.float64) * 30).to(dtype)
    r = (torch.rand(517, 33, generator=g, dtype=torch.float64) * 30).to(dtype)
    r[100:110] = r[:10]  # duplicate rows: ties to the smaller index
    q[:20] = r[200:220]  # exact hits
    d, i = _ransac_cpu.feature_knn_cpu(q, r, k)
    rd, ri = KR.feature_knn_reference(q, r, k)
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
    from pointalign.kernels import _backend

    _, i2 = KR.feature_knn(q, r, k)
    assert torch.equal(i2, i if _backend.backend(q) == "cpu" else ri)


def test_feature_knn_duplicates_break_ties_by_index():
    r = torch.zeros(6, 4)
    r[3] = 1.0
    d, i = _ransac_cpu.feature_knn_cpu(torch.zeros(2, 4), r, 3)
    assert torch.equal(i, torch.tensor([[0, 1, 2], [0, 1, 2]]))
    assert torch.equal(d, torch.zeros(2, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("n", [1, 9, 203])
def test_feature_knn_both_equals_two_calls(dtype, n):
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
def test_feature_knn_bit_equal_to_plain_sum(dtype, dim, grid):
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


def test_shared_feature_knn_serves_matching_calls(monkeypatch):
    from pointalign.kernels import _backend

    g = torch.Generator().manual_seed(3)
    a, b = torch.rand(40, 8, generator=g), torch.rand(30, 8, generator=g)
    want = [KR.feature_knn(a, b, 1), KR.feature_knn(a, b, 2), KR.feature_knn(b, a, 1)]
    calls = []
    real = _ransac_cpu.feature_knn_both_cpu
    monkeypatch.setattr(_ransac_cpu, "feature_knn_both_cpu",
                        lambda *x: calls.append(1) or real(*x))
    shared = KR.shared_feature_knn(a, b, 2)
    with shared:
        got = [KR.feature_knn(a, b, 1), KR.feature_knn(a, b, 2)]
    with shared:
        got.append(KR.feature_knn(b, a, 1))
        other = KR.feature_knn(a.clone(), b, 1)  # another tensor: searched on its own
    for (d, i), (wd, wi) in zip(got, want, strict=True):
        assert torch.equal(d, wd) and torch.equal(i, wi)
    assert torch.equal(other[1], want[0][1])
    assert len(calls) == (1 if _backend.backend(a) == "cpu" else 0)
    a.copy_(torch.rand(40, 8, generator=g))  # modified in place: no stale answers
    with shared:
        d, i = KR.feature_knn(a, b, 1)
    truth = ((a[:, None].double() - b[None].double()) ** 2).sum(-1)
    assert torch.equal(i[:, 0], truth.argmin(1))
    assert len(calls) <= 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bound_grid_equals_tree_and_brute(dtype):
    g = np.random.default_rng(7)
    p, _ = _surface(5, 2000, torch.float64)
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


def test_scoring_tree_routes_many_queries_to_the_grid():
    p, _ = _surface(2, 500, torch.float32)
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


def test_bound_grid_declines_a_huge_extent():
    pts = np.array([[0, 0, 0], [1e6, 1e6, 1e6]], np.float64)
    assert _score_cpu.BoundGrid.build(pts, 1e-6) is None
    t = _score_cpu.ScoringTree(pts)
    d, i = t.nearest(np.zeros((20, 3)), 1e-6)
    assert (i == 0).all() and not math.isnan(float(d[0]))


def test_numba_pool_start_keeps_torch_threads():
    """numba's OpenMP pool start used to reset PyTorch's thread count (fresh process)."""
    import subprocess
    import sys

    code = ("import numpy as np, torch, pointalign as pa\n"
            "from pointalign.kernels.knn.cpu import CpuTree\n"
            "torch.set_num_threads(2); pa.set_num_threads(1)\n"
            "CpuTree(np.random.rand(100, 3)).nearest(np.zeros((4, 3)))\n"
            "print(torch.get_num_threads())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "1"


def test_bound_grid_equals_tree_on_a_real_scan():
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
    q = KR.transform_points(T, src).reshape(-1, 3).numpy()
    tree = _knn_cpu.CpuTree(pts)
    for r in (0.5 * v, v, 1.5 * v):
        md = np.float32(r * r)
        grid = _score_cpu.BoundGrid.build(pts, md)
        assert grid is not None
        d, i = grid.nearest(q)
        td, ti = tree.nearest(q, md)
        assert np.array_equal(i, ti) and np.array_equal(d, td)
        assert (i >= 0).mean() > 0.05  # the aligned hypothesis hits: the early stop acts


def _compat(src: torch.Tensor, tgt: torch.Tensor, tau: float) -> torch.Tensor:
    A = ((torch.cdist(src, src) - torch.cdist(tgt, tgt)).abs() < tau).to(torch.float32)
    return A.fill_diagonal_(0)


@pytest.mark.parametrize("c", [3, 64, 130, 700])
def test_second_order_equals_reference(c):
    from pointalign.registration.robust import second_order_reference

    g = torch.Generator().manual_seed(c)
    src = torch.rand(c, 3, generator=g)
    tgt = src.clone()
    tgt[c // 3:] = torch.rand(c - c // 3, 3, generator=g)  # two thirds wrong matches
    A = _compat(src, tgt, 0.05)
    S = _ransac_cpu.second_order_cpu(A)
    assert torch.equal(S, second_order_reference(A))
    assert bool((S > 0).any()) or c == 3


def test_second_order_on_real_correspondences(monkeypatch):
    """Two bunny scans paired by index: the entry point takes the kernel, equal to the reference."""
    from pointalign import datasets
    from pointalign.registration import robust

    p = datasets.load_bunny("bun000")[::40][:1000]
    q = datasets.load_bunny("bun045")[::40][:1000]
    A = _compat(q, p, 0.004)
    calls = []
    real = _ransac_cpu.second_order_cpu
    monkeypatch.setattr(_ransac_cpu, "second_order_cpu", lambda a: calls.append(1) or real(a))
    monkeypatch.setattr("pointalign.kernels._backend.backend", lambda x=None: "cpu")
    S = robust.second_order(A)
    assert calls and torch.equal(S, robust.second_order_reference(A))


@pytest.mark.parametrize("c", [3, 65, 700])
def test_second_order_of_points_equals_reference(c, monkeypatch):
    """The fused kernel (lengths and A pair by pair, never stored) equals the reference.

    Bit for bit, with tau at a value some |ds − dt| takes exactly (the strict comparison
    decides those pairs) and at one that rounds to float32 (the comparison is PyTorch's).
    """
    from pointalign.registration import robust

    g = torch.Generator().manual_seed(c)
    src = torch.rand(c, 3, generator=g) * 0.1
    tgt = src + torch.randn(c, 3, generator=g) * 0.004  # noisy correspondences
    tgt[: c // 3] = torch.rand(c // 3, 3, generator=g) * 0.1  # and wrong ones
    ds, dt = robust.pair_lengths(src), robust.pair_lengths(tgt)
    # the lengths themselves: sqrt((dx² + dy²) + dz²) rounded step by step (NumPy float32)
    d = src.numpy()[:, None] - src.numpy()[None]
    assert np.array_equal(ds.numpy(), np.sqrt((d[..., 0] ** 2 + d[..., 1] ** 2) + d[..., 2] ** 2))
    gap = (ds - dt).abs()
    tie = float(gap[0, 1]) if c > 3 else 0.7
    for tau in (tie, 0.7 * float(gap.mean()) + 1e-9):
        A = ((ds - dt).abs() < tau).to(torch.float32).fill_diagonal_(0)
        want = robust.second_order_reference(A)
        assert 0 < int(A.sum()) < c * (c - 1) or c == 3
        assert torch.equal(_ransac_cpu.second_order_points_cpu(src, tgt, tau), want)
    calls = []
    real = _ransac_cpu.second_order_points_cpu
    monkeypatch.setattr(_ransac_cpu, "second_order_points_cpu",
                        lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr("pointalign.kernels._backend.backend", lambda x=None: "cpu")
    assert torch.equal(robust.second_order_of_points(src, tgt, tau), want) and calls
    monkeypatch.setattr("pointalign.kernels._backend.backend", lambda x=None: "torch")
    assert torch.equal(robust.second_order_of_points(src, tgt, tau), want) and len(calls) == 1
