"""register_many's host work for a chunk (issue 25): ``_edge.prepare_pairs`` and
``_validate.as_points_many`` against ``prepare_pair`` / ``as_points`` pair by pair, the
list form of ``as_batch``, the batched path's padding, and a packed grid whose cells
``max_cells`` grew (no density pass, the same answers).

Exact on the CPU: the same float32 local clouds and float64 centroids bit for bit (each target's
centroid is the same float64 mean, the shift one element-wise pass), the same errors
with the same messages in the same order of checks, inputs untouched.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pointalign import _validate
from pointalign.cloud import PointCloud
from pointalign.registration import _edge
from pointalign.registration.many import register_many

DEV = torch.device("cpu")
TURN = np.array([[0, -1, 0, 1.5], [1, 0, 0, 2.0], [0, 0, 1, 3.0], [0, 0, 0, 1.0]])


def _one(s, t, init):
    try:
        p = _edge.prepare_pair(s, t, init=init, device=DEV, min_points=3)
    except (ValueError, TypeError) as exc:
        return exc
    if p.batched:
        return ValueError(_edge.ONE_CLOUD_EACH)
    return _edge.LocalPair(p.source[0], p.target[0], p.frame.center[0], p.init[0])


def _inputs():
    rng = np.random.default_rng(0)
    S, T, inits = [], [], []
    for k in range(40):
        n, m = (int(x) for x in rng.integers(3, 3000, 2))
        off = rng.normal(size=3) * 10.0 ** int(rng.integers(0, 7))  # up to UTM-like offsets
        s, t = rng.normal(size=(n, 3)) + off, rng.normal(size=(m, 3)) * 0.3 + off
        S.append([s, s.astype(np.float32), (s * 100).astype(np.int64),
                  torch.from_numpy(s), PointCloud(torch.from_numpy(s.astype(np.float32)))][k % 5])
        T.append(t if k % 3 else torch.from_numpy(t.astype(np.float32)))
        inits.append(TURN if k % 4 == 0 else None)
    S[5] = S[5].copy()
    S[5][3, 1] = np.nan                                   # source not finite
    T[7] = T[7].copy()
    T[7][[1, 4], 0] = np.inf                              # target not finite
    S[9] = rng.normal(size=(50, 3))
    S[9][0, 0] = np.nan
    T[9] = np.zeros((4, 2))                               # both bad: the source's is first
    S[10] = np.zeros((2, 3))                              # too few points
    T[11] = np.zeros((0, 3))                              # empty
    S[13] = rng.normal(size=(2, 10, 3))                   # a batch
    T[14] = [rng.normal(size=(10, 3)), rng.normal(size=(9, 3))]
    S[15] = "cloud.ply"                                   # not an array
    inits[17] = np.eye(4) * 2                             # not rigid
    S[18] = np.zeros((10, 3), dtype=bool)
    S[19] = [[0.0, 1, 2], [1, 2, 3], [4, 5, 6.5]]          # nested lists
    T[21] = np.zeros((10, 3))
    T[21][2, 2] = np.nan
    S[21] = np.zeros((1, 3))                              # shape first, then the target's NaN
    return S, T, inits


def test_prepare_pairs_as_prepare_pair_one_by_one():
    S, T, inits = _inputs()
    before = [np.array(x, copy=True) if isinstance(x, np.ndarray) else x for x in S + T]
    got = _edge.prepare_pairs(S, T, inits, device=DEV, min_points=3)
    errors = 0
    for k, (s, t, init) in enumerate(zip(S, T, inits, strict=True)):
        want = _one(s, t, init)
        if isinstance(want, Exception):
            errors += 1
            assert type(got[k]) is type(want) and str(got[k]) == str(want), k
            continue
        assert isinstance(got[k], _edge.LocalPair), k
        assert got[k].source.dtype == torch.float32 and got[k].source.is_contiguous()
        assert torch.equal(got[k].source, want.source), k
        assert torch.equal(got[k].target, want.target), k
        assert np.array_equal(got[k].center, want.center), k
        assert np.array_equal(got[k].init, want.init), k
    assert errors == 11
    for a, b in zip(before, S + T, strict=True):  # inputs never modified
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b)


def test_as_points_many_as_as_points():
    xs = [np.ones((4, 3)), np.full((5, 3), np.nan), np.zeros((4, 2)),
          np.arange(9).reshape(3, 3), np.ones((2, 3)), np.ones((3, 3), dtype=np.float32)]
    names = [f"c[{i}]" for i in range(len(xs))]
    many = _validate.as_points_many(xs, names, min_points=3, cat_dtype=torch.float64)
    assert many.shaped == [True, True, False, True, False, True]
    assert many.points.shape == (4 + 5 + 3 + 3, 3)
    for x, name, got in zip(xs, names, many.clouds, strict=True):
        try:
            want = _validate.as_points(x, name, min_points=3)
        except (ValueError, TypeError) as exc:
            assert type(got) is type(exc) and str(got) == str(exc)
            continue
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float64
        assert torch.equal(got, want.to(torch.float64))
    with _validate.trusted():  # no NaN/Inf scan, as as_points there
        assert isinstance(_validate.as_points_many(xs, names).clouds[1], torch.Tensor)


def test_bad_pairs_keep_their_rows_and_order():
    rng = np.random.default_rng(1)
    good = rng.normal(size=(300, 3))
    nan = good.copy()
    nan[7] = np.nan
    pairs = [(good, nan), (np.zeros((4, 2)), good), (nan, good)]
    with pytest.raises(ValueError, match=r"pairs\[0\] \(0\): target: 1 rows contain NaN"):
        register_many(pairs, device="cpu")
    res = register_many(pairs, device="cpu", on_error="record")
    assert [r["error"] for r in res.rows] == [
        "ValueError: target: 1 rows contain NaN or Inf values",
        "ValueError: source: expected shape (N, 3), got (4, 2)",
        "ValueError: source: 1 rows contain NaN or Inf values"]
    assert all(r["verdict"] == "error" and np.isnan(r["transformation"]).all()
               for r in res.rows)


def _batch_or_error(xs, **kw):
    try:
        return _validate.as_batch(xs, "clouds", **kw)
    except (ValueError, TypeError) as exc:
        return exc


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float64])
def test_as_batch_of_a_list_on_a_device_as_cloud_by_cloud(dtype):
    """A list with ``device=`` (checked at once) as without (cloud by cloud): same batch."""
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(5, 3)) * 1e3 + 0.1, rng.normal(size=(8, 3)).astype(np.float32)
    ints = rng.integers(-(2**40), 2**40, size=(4, 3))
    nan = a.copy()
    nan[1, 2] = np.nan
    cases = [[a, b], [b, a], [b, a, b], [a, ints, b], [torch.from_numpy(a), b],
             [a, nan], [nan, np.zeros((2, 3))], [a, np.zeros((4, 2)), nan],
             [a, np.zeros((0, 3))], [a, np.zeros((3, 3), dtype=bool)]]
    for xs in cases:
        want = _batch_or_error(xs, dtype=dtype, min_points=3)
        got = _batch_or_error(xs, dtype=dtype, min_points=3, device="cpu")
        if isinstance(want, Exception):
            assert type(got) is type(want) and str(got) == str(want)
            continue
        assert got[0].dtype == want[0].dtype and torch.equal(got[0], want[0])
        assert torch.equal(got[1], want[1]) and got[2] is want[2] is True


def test_pad_as_pad_sequence():
    from pointalign.registration.many.batched import _pad

    for shapes in ([(5, 3), (0, 3), (7, 3)], [(4, 16), (1, 16)], [(6, 3)]):
        clouds = [torch.randn(*s, dtype=torch.float64) for s in shapes]
        out, n = _pad(clouds)
        assert torch.equal(out, torch.nn.utils.rnn.pad_sequence(clouds, batch_first=True))
        assert n.tolist() == [s[0] for s in shapes] and n.dtype == torch.int64


def test_packed_grid_grown_by_max_cells_skips_the_fine_grid(monkeypatch):
    """A grid whose cells ``max_cells`` grew: no density pass (a finer grid over the same
    box would grow back), and the answers of the grid that measures it anyway."""
    from pointalign.search import grid as grid_mod
    from pointalign.search.grid import VoxelGridIndex
    from pointalign.search.packed import PackedIndex

    g = torch.Generator().manual_seed(0)
    pts = torch.rand(64, 200, 3, generator=g) * 20.0
    q = pts.reshape(-1, 3) + torch.randn(64 * 200, 3, generator=g) * 0.5
    lens = [200] * 64

    def build(p):
        return VoxelGridIndex(p, 1.0, max_cells=1 << 16)

    idx = PackedIndex(pts, lens, max_distance=1.0, build=build)
    assert idx.inner._capped and idx.inner.cell_size > 2.0
    calls = []
    monkeypatch.setattr(grid_mod, "auto_cell_size",
                        lambda p, *a: calls.append(1) or 1.0)
    got = idx.nearest_within(q, 1.0)
    assert not calls
    old = PackedIndex(pts, lens, max_distance=1.0, build=build)
    old.inner._capped = False  # the rule before: the density pass, maybe a finer grid
    want = old.nearest_within(q, 1.0)
    assert calls
    assert torch.equal(got.idx, want.idx) and torch.equal(got.dists, want.dists)
    assert not VoxelGridIndex(pts[0], 1.0)._capped
