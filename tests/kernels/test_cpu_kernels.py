"""The "cpu" backend's kernels (numba) against the PyTorch references.

Tolerances: neighbour indices equal the brute-force reference's except between points whose
squared distances differ by at most a few ulps (the reference's ``addcmul`` may fuse
multiply-adds, the tree does not); distances to within that rounding. The ICP sums equal the
float64 reference to rtol 1e-10 (only the order of float64 additions differs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pointalign as pa
from pointalign.kernels import _backend
from pointalign.kernels import normal_eq as ne
from pointalign.kernels.knn import knn_reference

_knn_cpu = pytest.importorskip("pointalign.kernels.knn.cpu")
if not _knn_cpu.available():
    pytest.skip("numba is not installed", allow_module_level=True)
from pointalign.kernels.normal_eq import cpu as _normal_eq_cpu  # noqa: E402

ULP = {np.float32: 4e-7, np.float64: 1e-15}


def _cloud(seed, n, dtype, dup=True):
    g = np.random.default_rng(seed)
    p = g.normal(size=(n, 3)).astype(dtype)
    if dup:  # exact duplicates and a flat sheet: ties by distance
        p[n // 2: n // 2 + n // 10] = p[: n // 10]
        p[: n // 5, 2] = 0
    return p


def _same_neighbours(q, p, i_ref, i_got, d_ref, d_got, dtype):
    """Indices equal, or both at the same distance up to rounding."""
    assert i_ref.shape == i_got.shape
    miss_ref, miss_got = i_ref < 0, i_got < 0
    fin = np.isfinite(d_ref) & np.isfinite(d_got)
    tol = 8 * ULP[dtype] * np.maximum(d_ref, 1e-30) + 1e-30
    # a point missing from one side only must sit at the bound (rounding)
    assert np.all(np.abs(d_ref[fin] - d_got[fin]) <= tol[fin])
    diff = (i_ref != i_got) & ~miss_ref & ~miss_got
    if diff.any():
        rows = np.nonzero(diff)[0] if diff.ndim == 1 else np.nonzero(diff)[0]
        for r in np.unique(rows)[:50]:
            a = i_ref[r] if i_ref.ndim == 1 else i_ref[r][i_ref[r] != i_got[r]]
            b = i_got[r] if i_got.ndim == 1 else i_got[r][i_ref[r] != i_got[r]]
            qa = np.asarray(q[r], np.float64)
            da = ((p[np.atleast_1d(a)].astype(np.float64) - qa) ** 2).sum(-1)
            db = ((p[np.atleast_1d(b)].astype(np.float64) - qa) ** 2).sum(-1)
            assert np.allclose(da, db, rtol=16 * ULP[dtype], atol=1e-30)
    assert (miss_ref != miss_got).sum() <= max(1, miss_ref.size // 1000)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 5, 9, 700])
def test_nearest_equals_brute(seed, dtype, n):
    p = _cloud(seed, n, dtype, dup=n > 10)
    q = _cloud(seed + 100, 333, dtype, dup=False)
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
def test_knn_equals_brute(seed, dtype, k):
    p = _cloud(seed, 900, dtype)
    q = np.concatenate([p[:200], _cloud(seed + 1, 100, dtype, dup=False)])
    tree = _knn_cpu.CpuTree(p)
    for md in (None, 0.3):
        rd, ri = knn_reference(torch.from_numpy(q), torch.from_numpy(p), k,
                               None if md is None else md * md)
        d, i = tree.knn(q, k, None if md is None else md * md)
        _same_neighbours(q, p, ri.numpy(), i, rd.numpy(), d, dtype)
        assert np.all((d[:, 1:] >= d[:, :-1]) | ~np.isfinite(d[:, 1:]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("leaf_size", [1, 32])
def test_knn_self_equals_knn(seed, dtype, leaf_size):
    p = _cloud(seed, 400, dtype)  # duplicates and a flat sheet: ties by index
    tree = _knn_cpu.CpuTree(p, leaf_size=leaf_size)
    for k, md in ((1, None), (20, None), (20, 0.15), (400, None)):
        d, i = tree.knn_self(k, md)
        d0, i0 = tree.knn(p, k, md)
        assert np.array_equal(i, i0) and np.array_equal(d, d0)
    rd, ri = knn_reference(torch.from_numpy(p), torch.from_numpy(p), 20)
    d, i = tree.knn_self(20)
    _same_neighbours(p, p, ri.numpy(), i, rd.numpy(), d, dtype)


@pytest.mark.parametrize("leaf_size", [1, 5, 32])
def test_keyed_lists_equal_plain(monkeypatch, seed, leaf_size):
    """float32: the keyed k-NN lists give the plain lists' answers bit for bit."""
    p = _cloud(seed, 500, np.float32)  # duplicates and a flat sheet: ties by index
    q = np.concatenate([p[::3], _cloud(seed + 1, 120, np.float32, dup=False)])
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


def test_keyed_lists_not_for_float64_or_non_finite():
    assert not _knn_cpu.CpuTree(np.zeros((3, 3), np.float64))._keyable
    p = np.zeros((3, 3), np.float32)
    p[1, 2] = np.inf
    assert not _knn_cpu.CpuTree(p)._keyable


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


def test_flat_box_distance_equals_branchy(seed):
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
def test_nearest_with_candidates_equals_tree(seed, dtype):
    p = _cloud(seed, 1500, dtype)  # duplicates and a flat sheet
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
    c, r2 = fast._candidates()
    e = q.astype(np.float64) - p[hints[0]]
    assert ((e * e).sum(1) < r2[hints[0]]).mean() > 0.3


def test_nearest_with_candidates_bunny(bunny_pair_or_skip):
    s, t = bunny_pair_or_skip
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
def test_nearest_unhinted_queries_equal_one_at_a_time(seed, dtype):
    """An unhinted query starts from the previous query's answer: the answers do not change."""
    p = _cloud(seed, 1200, dtype)
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


def test_set_candidates_rejects_tables_that_do_not_fit():
    p = _cloud(0, 50, np.float32, dup=False)
    tree = _knn_cpu.CpuTree(p)
    d, i = tree.knn(p, 6)
    assert not tree.set_candidates(d[:10], i[:10], 4)  # other rows
    assert not tree.set_candidates(d, i, 6)  # no (k+1)-th column
    i2 = i.copy()
    i2[3, 4] = -1  # a missing (k+1)-th neighbour in a table said to be complete
    assert not tree.set_candidates(d, i2, 4)
    assert tree._candidates()[0].shape[0] == 0
    assert tree.set_candidates(d, i, 4) and tree._candidates()[0].shape == (50, 4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nearest_with_bounded_candidates_equals_tree(seed, dtype):
    """A radius-bounded self-query serves as the shortcut; its short rows take the tree."""
    p = _cloud(seed, 1500, dtype)
    plain = _knn_cpu.CpuTree(p, leaf_size=8)
    fast = _knn_cpu.CpuTree(p, leaf_size=8)
    radius = 0.25
    d, i = fast.knn_self(12, radius * radius)
    short = i[:, 8] < 0
    assert short.any() and not short.all()  # both kinds of rows occur
    assert not fast.set_candidates(d, i, 8)  # not said to be bounded: refused
    assert fast.set_candidates(d, i, 8, bounded=True)
    c, r2 = fast._candidates()
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


def test_ckdtree_index_keeps_the_self_query():
    p = torch.from_numpy(_cloud(3, 500, np.float32, dup=False))
    ix = pa.CKDTreeIndex(p)
    ix.knn(p[:100], 12)  # not the points themselves: nothing kept
    ix.knn(p.clone(), 5)  # too few neighbours for the candidate lists
    tree = ix._cpu_tree()
    assert tree._candidates()[0].shape[0] == 0
    got = ix.knn(p.clone(), 12)  # the self-query (bottom-up) answers as the plain search
    assert tree._candidates()[0].shape == (500, 8)
    d, i = tree.knn(p.numpy(), 12)
    assert np.array_equal(got.idx.numpy(), i) and np.array_equal(got.dists.numpy(), d)


def test_icp_point_to_plane_candidates_change_nothing(monkeypatch, bunny_pair_or_skip):
    from pointalign.search import ckdtree

    s, t = (c[::4].contiguous() for c in bunny_pair_or_skip)
    crit = pa.ConvergenceCriteria(max_iterations=12, relative_fitness=0, relative_rmse=0,
                                  translation_tolerance=0, rotation_tolerance=0)
    out = []
    for cand in (ckdtree.CANDIDATES, 10**9):  # the lists kept, then never kept
        monkeypatch.setattr(ckdtree, "CANDIDATES", cand)
        out.append(pa.icp(s, t, max_correspondence_distance=0.05, method="point_to_plane",
                          criteria=crit, device="cpu"))
    assert np.array_equal(np.asarray(out[0].transformation), np.asarray(out[1].transformation))
    assert out[0].fitness == out[1].fitness and out[0].rmse == out[1].rmse


def test_tree_bad_input():
    with pytest.raises(ValueError, match="points"):
        _knn_cpu.CpuTree(np.zeros((0, 3), np.float32))
    with pytest.raises(ValueError, match="points"):
        _knn_cpu.CpuTree(np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match="leaf_size"):
        _knn_cpu.CpuTree(np.zeros((4, 3), np.float32), leaf_size=0)


def test_ckdtree_index_cpu_equals_torch_backend(monkeypatch, seed):
    p = torch.from_numpy(_cloud(seed, 2000, np.float32))
    q = torch.from_numpy(_cloud(seed + 7, 500, np.float32, dup=False))
    ix = pa.CKDTreeIndex(p)
    assert _backend.backend(p) == "cpu"
    fast = [ix.knn(q, 7), ix.radius(q, 0.2, 9), ix.nearest_within(q, 0.3)]
    hinted = ix.nearest_within(q, 0.3, hint=torch.full((500,), 3, dtype=torch.int64))
    d_u, i_u = hinted.dists[:, 0], hinted.idx[:, 0]
    monkeypatch.setenv("POINTALIGN_BACKEND", "torch")
    assert _backend.backend(p) == "torch"
    ref = [ix.knn(q, 7), ix.radius(q, 0.2, 9), ix.nearest_within(q, 0.3)]
    for a, b in zip(fast, ref, strict=True):
        _same_neighbours(q.numpy(), p.numpy(), b.idx.numpy(), a.idx.numpy(), b.dists.numpy(),
                         a.dists.numpy(), np.float32)
    assert torch.equal(i_u, fast[2].idx[:, 0]) and torch.equal(d_u, fast[2].dists[:, 0])


def test_bunny_nearest_equals_brute(bunny_pair_or_skip):
    s, t = bunny_pair_or_skip
    q = s[::8].numpy()
    tree = _knn_cpu.CpuTree(t.numpy())
    rd, ri = knn_reference(torch.from_numpy(q), t, 1, 0.05 ** 2)
    d, i = tree.nearest(q, 0.05 ** 2)
    _same_neighbours(q, t.numpy(), ri[:, 0].numpy(), i, rd[:, 0].numpy(), d, np.float32)


@pytest.fixture
def bunny_pair_or_skip():
    try:
        return pa.datasets.load_bunny("bun045"), pa.datasets.load_bunny("bun000")
    except Exception as e:  # pragma: no cover - package data missing
        pytest.skip(f"bunny not available: {e}")


def _sums_case(seed, dtype, B=3, N=1000, M=600, offset=5.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, N, 3, generator=g) + offset).to(dtype)
    y = (torch.randn(B, M, 3, generator=g) + offset).to(dtype)
    n = torch.nn.functional.normalize(torch.randn(B, M, 3, generator=g), dim=-1).to(dtype)
    idx = torch.randint(-1, M, (B, N), generator=g)
    lengths = torch.tensor([N, N // 3, 0])
    center = torch.full((B, 3), offset, dtype=dtype) + 0.1
    return x, y, n, idx, lengths, center


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("plane", [False, True])
@pytest.mark.parametrize("kernel", ne.KERNELS)
def test_normal_equations_cpu_equals_reference(seed, dtype, plane, kernel):
    x, y, n, idx, lengths, center = _sums_case(seed, dtype)
    args = (x, y, idx)
    kw = dict(target_normals=n if plane else None, lengths=lengths, center=center,
              kernel=kernel, scale=0.8)
    ref = ne.normal_equations_reference(*args, **kw)
    got = _normal_eq_cpu.normal_equations_cpu(x, y, idx, n if plane else None, lengths, center,
                                              kernel, 0.8)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-9)
    assert torch.equal(ne.normal_equations(*args, **kw), got)  # the dispatcher's choice
    assert torch.all(got[2] == 0)  # lengths 0: nothing


def test_normal_equations_cpu_thread_invariant(seed):
    x, y, n, idx, lengths, center = _sums_case(seed, torch.float32, N=20000)
    try:
        pa.set_num_threads(1)
        a = _normal_eq_cpu.normal_equations_cpu(x, y, idx, n, lengths, center, "huber", 0.5)
        pa.set_num_threads(2)
        b = _normal_eq_cpu.normal_equations_cpu(x, y, idx, n, lengths, center, "huber", 0.5)
    finally:
        pa.set_num_threads(None)
    assert torch.equal(a, b)


def test_icp_cpu_backend_equals_torch_backend(monkeypatch, bunny_pair_or_skip):
    s, t = bunny_pair_or_skip
    s, t = s[::6].contiguous(), t[::6].contiguous()
    crit = pa.ConvergenceCriteria(max_iterations=15, relative_fitness=0, relative_rmse=0,
                                  translation_tolerance=0, rotation_tolerance=0)
    out = {}
    for be in ("cpu", "torch"):
        monkeypatch.setenv("POINTALIGN_BACKEND", be)
        for m in ("point_to_point", "point_to_plane"):
            out[be, m] = pa.icp(s, t, max_correspondence_distance=0.05, method=m,
                                criteria=crit, device="cpu")
    for m in ("point_to_point", "point_to_plane"):
        a, b = out["cpu", m], out["torch", m]
        # float64 sums in another order, float32 normals (point-to-plane) and distance ties
        # of the search: after 15 iterations the estimates differ by ~1e-5 (measured 1.2e-5)
        tol = 1e-4
        torch.testing.assert_close(torch.as_tensor(a.transformation),
                                   torch.as_tensor(b.transformation), rtol=0, atol=tol)
        assert abs(a.fitness - b.fitness) <= 1e-3


def test_threads_api(monkeypatch):
    try:
        pa.set_num_threads(1)
        assert pa.get_num_threads() == 1 and torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="n"):
            pa.set_num_threads(0)
        with pytest.raises(TypeError, match="n"):
            pa.set_num_threads(1.5)
        pa.set_num_threads(None)
        monkeypatch.setenv("POINTALIGN_NUM_THREADS", "1")
        assert pa.get_num_threads() == 1
        monkeypatch.setenv("POINTALIGN_NUM_THREADS", "zero")
        with pytest.raises(ValueError, match="POINTALIGN_NUM_THREADS"):
            pa.get_num_threads()
    finally:
        monkeypatch.delenv("POINTALIGN_NUM_THREADS", raising=False)
        pa.set_num_threads(None)


# the soft methods' CPU passes: tests/kernels/test_soft_cpu.py


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pca_normals_cpu_equals_reference(seed, dtype, bunny_pair_or_skip):
    from pointalign.kernels import features
    from pointalign.kernels.features import cpu as _features_cpu

    g = torch.Generator().manual_seed(seed)
    pts = torch.cat([bunny_pair_or_skip[1][::10].to(dtype),
                     torch.randn(300, 3, generator=g, dtype=dtype)])
    pts[-50:, 2] = 0  # a flat patch: a simple smallest eigenvalue, normal +-z
    pts[-60:-50] = pts[-60]  # a collapsed neighbourhood: repeated eigenvalues
    idx = torch.from_numpy(_knn_cpu.CpuTree(pts.numpy()).knn(pts.numpy(), 12)[1])
    idx[::7, -3:] = -1
    idx[5] = -1  # no neighbour at all
    vp = torch.tensor([0.3, -1.0, 2.0], dtype=dtype)
    for view in (None, vp):
        ref = features.pca_normals_reference(pts, idx, view)
        got = _features_cpu.pca_normals_cpu(pts, idx, view, pts)
        torch.testing.assert_close(got.norm(dim=1), torch.ones(len(pts), dtype=dtype))
        close = (got - ref).norm(dim=1) <= (2e-3 if dtype == torch.float32 else 1e-8)
        # a repeated smallest eigenvalue: any unit vector orthogonal to the largest's axis
        assert close.float().mean() >= 0.99, close.float().mean()
        assert torch.equal(features.pca_normals(pts, idx, view), got)


def test_radius_neighbours_cpu_equals_reference(monkeypatch, seed):
    from pointalign.kernels import features

    pts = torch.from_numpy(_cloud(seed, 1500, np.float32))
    got = features.radius_neighbours(pts, 0.4, 10)
    monkeypatch.setenv("POINTALIGN_BACKEND", "torch")
    ref = features.radius_neighbours(pts, 0.4, 10)
    _same_neighbours(pts.numpy(), pts.numpy(), ref[1].numpy(), got[1].numpy(),
                     ref[0].numpy(), got[0].numpy(), np.float32)
