"""kernels.kdtree: build, descent, the kNN reference and the Triton traversal kernel.

The Triton kernel runs here through Triton's interpreter on CPU tensors (tiny sizes); the
dispatcher runs on every backend (the "triton" one on a CUDA device, ``-m gpu``, compiled)
and is compared with the reference. Search answers are compared as sets of equal distances
(``assert_knn_matches``); builds exactly (the same sorts), split values to rounding.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pointalign.kernels import _loop
from pointalign.kernels import kdtree as K
from tests._backends import backends
from tests._interpreted import interpreted_fixture
from tests._oracles import assert_knn_matches

triton = pytest.importorskip("triton")


def _cloud(n, g, dtype=torch.float32, scale=1.0):
    return (torch.rand(n, 3, generator=g, dtype=torch.float64) * scale).to(dtype)


def _orig(tree, res):
    d, pos = res
    return d, torch.where(pos >= 0, tree.perm[pos.clamp_min(0)], pos)


def test_depth_for():
    assert K.depth_for(1, 16) == 0
    assert K.depth_for(16, 16) == 0
    assert K.depth_for(17, 16) == 1
    assert K.depth_for(1000, 1) == 9
    for m in (5, 33, 1000, 4097):
        for ls in (1, 3, 8):
            d = K.depth_for(m, ls)
            assert 2**d <= m
            assert -(-m // 2**d) <= ls or 2 ** (d + 1) > m


def test_node_ranges_partition():
    for m, depth in [(1, 0), (5, 2), (97, 5), (1024, 10)]:
        r = K.node_ranges(m, depth)
        for level in range(depth + 1):
            rows = r[2**level - 1:2 ** (level + 1) - 1]
            assert rows[0, 0] == 0 and rows[-1, 1] == m
            assert torch.equal(rows[1:, 0], rows[:-1, 1])


@pytest.mark.parametrize("m", [1, 7, 1000, 1023])
def test_segment_boxes_match_each_range(m, rng):
    """The padded-gather boxes equal each node range's own min and max, on every level."""
    pts = torch.randn(m, 3, generator=rng)
    for level in range(int(math.log2(m)) + 1):
        lo, hi = K._segment_boxes(pts, level)
        b = K.level_bounds(m, level)
        for j in range(2**level):
            seg = pts[b[j]:b[j + 1]]
            assert torch.equal(lo[j], seg.amin(0)) and torch.equal(hi[j], seg.amax(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_node_order_sorts_by_node_then_key_then_id(dtype, rng):
    """One packed sort (float32) or stable sorts: by node, then key, ties in id order."""
    m = 500
    key = torch.randn(m, generator=rng).to(dtype)
    key[::7] = 0.0
    key[::11] = -0.0
    key[::13] = key[0]
    seg = torch.randint(0, 9, (m,), generator=rng)
    ids = torch.randperm(m, generator=rng)
    got = K._node_order(seg, key, ids)
    want = sorted(range(m), key=lambda i: (int(seg[i]), float(key[i]), int(ids[i])))
    assert got.tolist() == want


def test_build_auto_is_the_host_build_on_the_cpu(rng):
    pts = torch.rand(500, 3, generator=rng)
    a, b = K.build(pts, 5, "auto"), K.build(pts, 5, "host")
    for name in ("points", "perm", "lo", "hi", "split_axis", "split_value", "start", "end"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("m,depth", [(1, 0), (1000, 6)])
def test_build_with_a_layout_made_before(m, depth, rng):
    """A device build given build_layout's arrays equals one that makes them itself."""
    pts = _cloud(m, rng)
    a = K.build(pts, depth, "device")
    b = K.build(pts, depth, "device", layout=K.build_layout(m, depth, pts.device))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


@pytest.mark.parametrize("m,depth", [(1, 0), (5, 2), (777, 6), (100003, 12)])
def test_build_layout_is_level_bounds_and_node_ranges(m, depth):
    """build_layout's host-made arrays: every level's bounds, the split positions either
    side of each children's boundary, and node_ranges."""
    flat, ranges = K.build_layout(m, depth, "cpu")
    bounds = [K.level_bounds(m, level) for level in range(depth + 1)]
    mids = [torch.stack([b[1:-1:2] - 1, b[1:-1:2]]).reshape(-1) for b in bounds[1:]]
    assert torch.equal(flat, torch.cat(bounds + mids))
    assert torch.equal(ranges, K.node_ranges(m, depth))


def test_build_rejects_bad_depth():
    with pytest.raises(ValueError, match="depth"):
        K.build(torch.zeros(4, 3), 3)
    with pytest.raises(ValueError, match="where"):
        K.build(torch.zeros(4, 3), 1, "gpu")
    from pointalign.kernels.kdtree import triton as KT

    bounds, _ = K._split_layout(K.build_layout(40, 2, "cpu")[0], 2)
    for bad in (48, 2048):
        with pytest.raises(ValueError, match="power of two"):
            KT.build(torch.rand(40, 3), 2, bounds, subtree_block=bad)


# ---- the Triton kernel through the interpreter (in a child process, see _oracles) ----------

# (M, N, k, depth): tiny, because the interpreter runs each Triton op in NumPy
INTERP_CASES = [(1, 3, 1, 0), (2, 5, 3, 1), (3, 4, 2, 1), (37, 11, 5, 3), (97, 13, 4, 4)]
INTERP_MAXD = [0.0, 0.3]
INTERP_SEEDS = 2
# (M, depth) built by the subtree kernel with nodes of up to 64 points: from level 3 (500
# points), the whole tree (50), and none (a leaf of 250 points: depth 1 < level 3)
SUBTREE_CASES = [(500, 6), (50, 4), (500, 1)]


def _interp_inputs(case, seed, dtype=torch.float32):
    m, n, k, depth = case
    g = torch.Generator().manual_seed(1000 * seed + m)
    return _cloud(m, g, dtype), _cloud(n, g, dtype, scale=1.2) - 0.1


def run_interpreted_kdtree(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): every Triton case, results saved by key."""
    from pointalign.kernels import _backend
    from pointalign.kernels.kdtree import triton as KT
    from pointalign.kernels.kdtree import triton_block as KS

    assert _backend.backend(torch.empty(0)) == "interpret"
    out = {}
    for seed in range(INTERP_SEEDS):
        for case in INTERP_CASES:
            pts, q = _interp_inputs(case, seed)
            tree = K.build(pts, case[3])
            for approx in (False, True):
                out[("knn", case, seed, approx)] = KT.knn(tree, q, case[2], approximate=approx)
        pts, q = _interp_inputs((60, 9, 6, 3), seed)
        tree = K.build(pts, 3)
        for md in INTERP_MAXD:
            out[("maxd", md, seed)] = KT.knn(tree, q, 6, max_dist2=md**2)
        out[("unsorted", seed)] = (KT.knn(tree, q, 6), KT.knn(tree, q, 6, sort=False))
        bt = K.build(_build_cloud(seed), 5)  # ties: queries exactly on split values
        out[("descend", seed)] = [KT.descend(bt, _descend_queries(bt, q), d) for d in (0, 2, 5)]
        KT.INT32_TILE_MAX, tile_max = 0, KT.INT32_TILE_MAX  # int64 positions in the tile
        try:
            out[("int64 tile", seed)] = (KT.knn(tree, q, 6),
                                         KT.knn(tree, q, 1, hint=_hints(tree, q, seed)))
        finally:
            KT.INT32_TILE_MAX = tile_max
        for md in (math.inf, 0.3):
            out[("hint", md, seed)] = KT.knn(tree, q, 1, max_dist2=md**2,
                                             hint=_hints(tree, q, seed))
        # hints and answers as original indices, mapped inside the kernel
        h = _hints(tree, q, seed)
        out[("ids", seed)] = KT.knn(tree, q, 1, hint=torch.where(h >= 0, tree.perm[h], h),
                                    ids=(tree.perm, torch.argsort(tree.perm)))
        # launched over chunks of 4 queries (large query sets): hints and k > 1 included
        pts, q = _interp_inputs((60, 9, 6, 3), seed)
        tree = K.build(pts, 3)
        KT.QUERY_CHUNK, chunk = 4, KT.QUERY_CHUNK
        try:
            out[("chunked", seed)] = (KT.knn(tree, q, 6), KT.knn(tree, q, 1,
                                                                 hint=_hints(tree, q, seed)))
        finally:
            KT.QUERY_CHUNK = chunk
        pts, q = _copies_inputs(seed)  # copies of one point: ties the search may skip
        tree = K.build(pts, 3)
        out[("copies", seed)] = (KT.knn(tree, q, 6), KT.knn(tree, q, 6, max_dist2=0.05**2),
                                 KT.knn(tree, q, 1, hint=_hints(tree, q, seed)))
        out[("self copies", seed)] = KS.self_knn(tree, 6, (0, 8))
        pts, _ = _interp_inputs((60, 9, 6, 3), seed)  # every point's k nearest, by leaf
        tree = K.build(pts, 3)
        out[("self", seed)] = (KS.self_knn(tree, 6, (0, 8)), KS.self_knn(tree, 6, (2, 5)),
                               KS.self_knn(tree, 1, (0, 8)))
        tree = K.build(_cloud(70, torch.Generator().manual_seed(300 + seed)), 1)
        out[("self parts", seed)] = KS.self_knn(tree, 4, (1, 2))  # 35-point leaves
        tree = K.build(_build_cloud(seed), 6)  # the fused Triton levels
        out[("build", seed)] = (tree.perm, tree.split_axis, tree.split_value, tree.lo, tree.hi)
        # the subtree kernel with nodes of up to 64 points (512 by default): from level 3
        # (8 programs), the whole tree in one program, and not at all
        KT.SUBTREE_BLOCK, block = 64, KT.SUBTREE_BLOCK
        try:
            for m, depth in SUBTREE_CASES:
                tree = K.build(_build_cloud(seed)[:m], depth)
                out[("subtree", m, depth, seed)] = (tree.perm, tree.split_axis, tree.split_value,
                                             tree.lo, tree.hi, tree.points)
        finally:
            KT.SUBTREE_BLOCK = block
        pts, q = _interp_inputs((30, 7, 3, 2), seed, torch.float64)
        tree = K.build(pts, 2)
        out[("f64", seed)] = KT.knn(tree, q, 3)
        out[("empty", seed)] = KT.knn(tree, torch.empty(0, 3, dtype=torch.float64), 2)
        # the public dispatch takes the Triton path under the interpret backend
        calls = []
        orig = KT.knn

        def spy(*a, _calls=calls, _orig=orig, **kw):
            _calls.append(1)
            return _orig(*a, **kw)

        KT.knn = spy
        try:
            out[("dispatch", seed)] = (K.knn(tree, q, 2), len(calls))
        finally:
            KT.knn = orig
    torch.save(out, out_path)


def _hints(tree, q, seed):
    """Tree positions ``(N,)``: a mix of none (-1), random points and the true nearest."""
    g = torch.Generator().manual_seed(seed + 7)
    n, m = q.shape[0], tree.points.shape[0]
    h = torch.randint(0, m, (n,), generator=g)
    exact = K.knn_reference(tree, q, 1)[1][:, 0]
    kind = torch.arange(n) % 3
    return torch.where(kind == 0, torch.full_like(h, -1), torch.where(kind == 1, h, exact))


def _copies_inputs(seed):
    """80 points, 40 of them copies of the origin and 10 of another point (a scan's missing
    returns); queries on the copies, near them and elsewhere."""
    g = torch.Generator().manual_seed(200 + seed)
    pts = _cloud(80, g)
    pts[::2] = 0.0
    pts[1:40:4] = pts[1]
    q = torch.cat([pts[:4], torch.full((2, 3), 0.01), _cloud(4, g)])
    return pts, q


def _build_cloud(seed):
    """500 points with repeated coordinates and signed zeros (ties in the build's sorts)."""
    pts = _cloud(500, torch.Generator().manual_seed(100 + seed))
    pts[::9, 1] = 0.0
    pts[::13, 1] = -0.0
    pts[::7, 0] = pts[0, 0]
    return pts


interpreted = interpreted_fixture("tests.kernels.test_kdtree", "run_interpreted_kdtree")


@pytest.mark.parametrize("case", INTERP_CASES)
@pytest.mark.parametrize("approximate", [False, True])
def test_triton_interpreter_matches_reference(case, approximate, interpreted, seed):
    if seed >= INTERP_SEEDS:
        pytest.skip("the interpreted run covers the first INTERP_SEEDS seeds")
    pts, q = _interp_inputs(case, seed)
    tree = K.build(pts, case[3])
    k = case[2]
    ref = K.knn_reference(tree, q, k, approximate=approximate)
    got = interpreted[("knn", case, seed, approximate)]
    assert torch.equal(torch.isinf(got[0]), torch.isinf(ref[0]))
    fin = torch.isfinite(ref[0])
    assert torch.allclose(got[0][fin], ref[0][fin], atol=1e-6)
    assert torch.equal(got[1] < 0, ref[1] < 0)
    if not approximate:
        assert_knn_matches(_orig(tree, got), q, pts, k)


@pytest.mark.parametrize("max_d", INTERP_MAXD)
def test_triton_interpreter_max_distance(max_d, interpreted, seed):
    if seed >= INTERP_SEEDS:
        pytest.skip("the interpreted run covers the first INTERP_SEEDS seeds")
    pts, q = _interp_inputs((60, 9, 6, 3), seed)
    tree = K.build(pts, 3)
    got = interpreted[("maxd", max_d, seed)]
    if max_d == 0.0:
        assert torch.isinf(got[0]).all() and (got[1] == -1).all()
    else:
        assert_knn_matches(_orig(tree, got), q, pts, 6, max_distance=max_d)


@pytest.mark.parametrize("max_d", [math.inf, 0.3])
def test_triton_interpreter_hint_keeps_the_answer(max_d, interpreted, seed):
    """A hint (none, a random point, the answer) changes the work, never the result."""
    if seed >= INTERP_SEEDS:
        pytest.skip("the interpreted run covers the first INTERP_SEEDS seeds")
    pts, q = _interp_inputs((60, 9, 6, 3), seed)
    tree = K.build(pts, 3)
    got = interpreted[("hint", max_d, seed)]
    assert_knn_matches(_orig(tree, got), q, pts, 1,
                       **({} if math.isinf(max_d) else {"max_distance": max_d}))


def test_triton_interpreter_copies(interpreted, seed):
    """Copies tie exactly: once k places are taken, the search skips what can only tie, and
    the neighbours found are still the k nearest (some copies or others, equally near)."""
    if seed >= INTERP_SEEDS:
        pytest.skip("the interpreted run covers the first INTERP_SEEDS seeds")
    pts, q = _copies_inputs(seed)
    tree = K.build(pts, 3)
    every, bounded, hinted = interpreted[("copies", seed)]
    assert_knn_matches(_orig(tree, every), q, pts, 6)
    assert_knn_matches(_orig(tree, bounded), q, pts, 6, max_distance=0.05)
    assert_knn_matches(_orig(tree, hinted), q, pts, 1)


def _same_rows_any_order(sorted_res, unsorted_res):
    """The unsorted answer holds each row's neighbours of the sorted one, in any order."""
    (d, i), (du, iu) = sorted_res, unsorted_res
    assert torch.equal(torch.sort(du, 1).values, d)
    assert torch.equal(torch.sort(iu, 1).values, torch.sort(i, 1).values)


def test_triton_interpreter_unsorted_rows(interpreted, seed):
    if seed >= INTERP_SEEDS:
        pytest.skip("the interpreted run covers the first INTERP_SEEDS seeds")
    _same_rows_any_order(*interpreted[("unsorted", seed)])


@backends("triton")
def test_unsorted_rows_hold_the_sorted_answer(backend, rng):
    """``sort=False`` (the covariances' self-query) returns the same rows, unordered."""
    pts = _cloud(30011, rng).to(backend.device)
    tree = K.build(pts, K.depth_for(pts.shape[0], 16))
    for k in (8, 20):
        _same_rows_any_order(K.knn(tree, tree.points, k, reorder=False),
                             K.knn(tree, tree.points, k, reorder=False, sort=False))


def test_triton_interpreter_original_ids(interpreted, seed):
    if seed >= INTERP_SEEDS:
        pytest.skip("the interpreted run covers the first INTERP_SEEDS seeds")
    pts, q = _interp_inputs((60, 9, 6, 3), seed)
    assert_knn_matches(interpreted[("ids", seed)], q, pts, 1)


@pytest.mark.parametrize("run", ["chunked", "int64 tile"])
def test_triton_interpreter_chunked_launches_and_int64_tile(run, interpreted, seed):
    """k = 6 and hinted k = 1 searches, launched over chunks of 4 queries, or with int64
    positions in the tile (trees too large for int32 ones): the same answers."""
    if seed >= INTERP_SEEDS:
        pytest.skip("the interpreted run covers the first INTERP_SEEDS seeds")
    pts, q = _interp_inputs((60, 9, 6, 3), seed)
    tree = K.build(pts, 3)
    many, hinted = interpreted[(run, seed)]
    assert_knn_matches(_orig(tree, many), q, pts, 6)
    assert_knn_matches(_orig(tree, hinted), q, pts, 1)


def _self_rows(tree, res, leaves):
    """A self-query's rows sorted by distance, with original indices; the rows' points."""
    m, depth = tree.points.shape[0], tree.depth
    rows = tree.points[(leaves[0] * m) >> depth: (leaves[1] * m) >> depth]
    return _orig(tree, _sorted(res)), rows


@pytest.mark.parametrize("run", ["self", "self copies", "self parts"])
def test_triton_interpreter_self_knn(run, interpreted, seed):
    """Every tree point's k nearest, one program a leaf (kdtree/triton_block.py): the k
    nearest of each row of the leaves asked, itself included, with copies of one point and
    leaves of more points than a program's lanes."""
    if seed >= INTERP_SEEDS:
        pytest.skip("the interpreted run covers the first INTERP_SEEDS seeds")
    if run == "self":
        pts, _ = _interp_inputs((60, 9, 6, 3), seed)
        tree = K.build(pts, 3)
        every, some, nearest = interpreted[(run, seed)]
        for res, leaves, k in ((every, (0, 8), 6), (some, (2, 5), 6), (nearest, (0, 8), 1)):
            assert_knn_matches(*_self_rows(tree, res, leaves), pts, k)
        assert torch.equal(nearest[1][:, 0], torch.arange(60))  # each point itself
    elif run == "self copies":
        pts, _ = _copies_inputs(seed)
        tree = K.build(pts, 3)
        assert_knn_matches(*_self_rows(tree, interpreted[(run, seed)], (0, 8)), pts, 6)
    else:
        pts = _cloud(70, torch.Generator().manual_seed(300 + seed))
        tree = K.build(pts, 1)
        assert_knn_matches(*_self_rows(tree, interpreted[(run, seed)], (1, 2)), pts, 4)


def _sorted(res):
    """Each row's neighbours by ascending distance."""
    d, i = res
    d, order = torch.sort(d, 1)
    return d, i.gather(1, order)


@pytest.mark.parametrize("k", [1, 8, 20])
def test_self_knn_matches_knn(backend, k, rng):
    """``self_knn`` answers as ``knn`` of the tree's points, over every leaf and over a range
    of them: the same distances (the same expression in both kernels; to a float32 rounding,
    should a compiler contract it into multiply-adds differently)."""
    m = _sizes(backend, (30011, 0), (3001, 0))[0]
    pts = _cloud(m, rng).to(backend.device)
    tree = K.build(pts, K.depth_for(m, 16))
    n_leaves = 2**tree.depth
    for leaves in ((0, n_leaves), (3, n_leaves // 2 + 1)):
        got = K.self_knn(tree, k, leaves)
        r0, r1 = (leaves[0] * m) >> tree.depth, (leaves[1] * m) >> tree.depth
        want = K.knn(tree, tree.points[r0:r1], k, reorder=False)
        assert got[0].device.type == backend.device
        torch.testing.assert_close(torch.sort(got[0], 1).values, want[0], rtol=5e-7, atol=0)
        (d, i), rows = _self_rows(tree, got, leaves)
        assert_knn_matches((d.cpu(), i.cpu()), rows.cpu(), pts.cpu(), k)


def test_self_knn_checks_its_arguments(rng):
    tree = K.build(_cloud(100, rng), 3)
    for leaves in ((-1, 2), (3, 2), (0, 9)):
        with pytest.raises(ValueError, match="leaves"):
            K.self_knn(tree, 4, leaves)
    for k in (0, 101):
        with pytest.raises(ValueError, match="k:"):
            K.self_knn(tree, k)


def test_reference_original_ids(rng):
    pts, q = _cloud(300, rng), _cloud(40, rng)
    tree = K.build(pts, 4)
    got = K.knn(tree, q, 1, ids=(tree.perm, torch.argsort(tree.perm)))
    assert_knn_matches(got, q, pts, 1)


def test_hint_is_checked(rng):
    tree = K.build(_cloud(40, rng), 2)
    q = _cloud(5, rng)
    for bad, k in ((torch.zeros(4, dtype=torch.int64), 1), (torch.zeros(5, dtype=torch.int64), 2)):
        with pytest.raises(ValueError, match="hint"):
            K.knn(tree, q, k, hint=bad)


def test_triton_interpreter_float64_empty_and_dispatch(interpreted, seed):
    if seed >= INTERP_SEEDS:
        pytest.skip("the interpreted run covers the first INTERP_SEEDS seeds")
    pts, q = _interp_inputs((30, 7, 3, 2), seed, torch.float64)
    tree = K.build(pts, 2)
    got = interpreted[("f64", seed)]
    assert got[0].dtype == torch.float64
    assert_knn_matches(_orig(tree, got), q, pts, 3, rtol=1e-12, atol=1e-12)
    d, i = interpreted[("empty", seed)]
    assert d.shape == (0, 2) and i.shape == (0, 2)
    res, n_calls = interpreted[("dispatch", seed)]
    assert n_calls == 1, "the interpret backend must run the Triton kernel"
    assert_knn_matches(_orig(tree, res), q, pts, 2)


@backends("torch")
def test_torch_backend_skips_triton(backend, rng, monkeypatch):
    pts, q = _cloud(40, rng), _cloud(6, rng)
    tree = K.build(pts, 2)
    import sys

    mod = sys.modules.get("pointalign.kernels.kdtree.triton")
    if mod is not None:
        monkeypatch.setattr(mod, "knn", lambda *a, **kw: pytest.fail("Triton path taken"))
    assert_knn_matches(_orig(tree, K.knn(tree, q, 2)), q, pts, 2)


def test_reference_chunks_and_k_beyond_points(rng):
    pts, q = _cloud(90, rng), _cloud(70, rng)
    tree = K.build(pts, 3)
    a = K.knn_reference(tree, q, 5, chunk=7)
    b = K.knn_reference(tree, q, 5)
    assert torch.equal(a[0], b[0])
    d, pos = K.knn_reference(tree, q, 100)
    assert (pos[:, 90:] == -1).all() and torch.isinf(d[:, 90:]).all()
    assert_knn_matches(_orig(tree, (d, pos)), q, pts, 100)
    with pytest.raises(ValueError, match="k"):
        K.knn(tree, q, 0)


def _descend_queries(tree, q):
    """The tree's own points (duplicates sit on split values) and ``q``, in float64."""
    return torch.cat([tree.points, q]).double()


def test_triton_interpreter_descend_matches_reference(interpreted, seed):
    if seed >= INTERP_SEEDS:
        pytest.skip("the interpreted run covers the first INTERP_SEEDS seeds")
    tree = K.build(_build_cloud(seed), 5)
    q = _descend_queries(tree, _interp_inputs((60, 9, 6, 3), seed)[1])
    on_split = (tree.points[:, None, :] == tree.split_value[None, :, None]).any()
    assert on_split  # the ties the kernel must send right, as the reference does
    for d, got in zip((0, 2, 5), interpreted[("descend", seed)], strict=True):
        assert torch.equal(got, K.descend_reference(tree, q, d))


@backends("triton")
def test_descend_kernel_matches_reference(backend, rng):
    pts = _cloud(50021, rng).to(backend.device)
    tree = K.build(pts, K.depth_for(pts.shape[0], 16))
    q = torch.cat([tree.points, (_cloud(4099, rng, scale=1.3) - 0.15).to(backend.device)])
    for d in (None, 3, 0):
        assert torch.equal(K.descend(tree, q, d), K.descend_reference(tree, q, d))
        depth = torch.tensor([tree.depth if d is None else d], device=backend.device)
        assert torch.equal(K.descend(tree, q, depth), K.descend_reference(tree, q, d))
    assert K.descend(tree, q[:0]).shape == (0,)


def test_descend_reaches_cell(rng):
    pts, q = _cloud(300, rng), _cloud(50, rng)
    tree = K.build(pts, 5)
    leaf = K.descend(tree, q)
    # walk down by hand in NumPy
    ax, sv = tree.split_axis.numpy(), tree.split_value.numpy()
    for row in range(q.shape[0]):
        node = 0
        for _ in range(tree.depth):
            node = 2 * node + (2 if q[row, ax[node]].item() >= sv[node] else 1)
        assert node == int(leaf[row])
    assert torch.equal(K.descend(tree, q, 0), torch.zeros(50, dtype=torch.int64))
    assert torch.equal(K.descend(tree, q, 99), leaf)
    # a level given as a tensor (no host read): each leaf's ancestor at that level
    for d in (0, 2, 5, 99):
        assert torch.equal(K.descend(tree, q, torch.tensor([d])), K.descend(tree, q, d))
        assert torch.equal(K.descend(tree, q, torch.tensor(d)), K.descend(tree, q, d))
    for bad in (torch.tensor([2.0]), torch.tensor([1, 2]), torch.tensor(True)):
        with pytest.raises(ValueError, match="depth"):
            K.descend(tree, q, bad)


@pytest.mark.parametrize("m,depth", SUBTREE_CASES)
def test_triton_interpreter_subtree_kernel_matches_host(m, depth, interpreted, seed):
    """The subtree kernel (every level below the first whose nodes fit a program, in one
    launch) builds the tree the NumPy build makes: the same sorts, boxes and axes."""
    if seed >= INTERP_SEEDS:
        pytest.skip("the interpreted run covers the first INTERP_SEEDS seeds")
    ref = K.build(_build_cloud(seed)[:m], depth, "host")
    perm, axis, split, lo, hi, pts = interpreted[("subtree", m, depth, seed)]
    assert torch.equal(perm, ref.perm) and torch.equal(axis, ref.split_axis)
    assert torch.equal(lo, ref.lo) and torch.equal(hi, ref.hi)
    assert torch.equal(pts, ref.points)
    assert np.allclose(split.numpy(), ref.split_value.numpy())


def test_triton_interpreter_build_matches_host(interpreted, seed):
    """The fused per-level kernels build the tree the NumPy build makes."""
    if seed >= INTERP_SEEDS:
        pytest.skip("the interpreted run covers the first INTERP_SEEDS seeds")
    perm, axis, split, lo, hi = interpreted[("build", seed)]
    ref = K.build(_build_cloud(seed), 6, "host")
    assert torch.equal(perm, ref.perm) and torch.equal(axis, ref.split_axis)
    assert torch.equal(lo, ref.lo) and torch.equal(hi, ref.hi)
    assert np.allclose(split.numpy(), ref.split_value.numpy())


@pytest.mark.parametrize("m,depth,dtype", [(777, 6, torch.float32), (1000, 9, torch.float32),
                                           (5, 2, torch.float32), (300, 5, torch.float64)])
def test_host_build_matches_device(m, depth, dtype, rng):
    pts = _cloud(m, rng).to(dtype)
    a, b = K.build(pts, depth, "device"), K.build(pts, depth, "host")
    assert torch.equal(a.perm, b.perm)
    assert torch.equal(a.lo, b.lo) and torch.equal(a.hi, b.hi)
    assert np.allclose(a.split_value.numpy(), b.split_value.numpy())


# ---- the dispatcher on every backend (compiled Triton on CUDA) -----------------------------

def _sizes(backend, gpu: tuple[int, int], cpu: tuple[int, int]) -> tuple[int, int]:
    return gpu if backend.device == "cuda" else cpu


@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("k", [1, 8, 33])
def test_knn_matches_reference(backend, approximate, k, rng):
    m, n = _sizes(backend, (50021, 4099), (5021, 409))
    pts = _cloud(m, rng).to(backend.device)
    q = (_cloud(n, rng, scale=1.3) - 0.15).to(backend.device)
    tree = K.build(pts, K.depth_for(pts.shape[0], 16))
    got = K.knn(tree, q, k, approximate=approximate)
    ref = K.knn_reference(tree, q, k, approximate=approximate)
    assert got[0].device.type == backend.device
    assert torch.equal(torch.isinf(got[0]), torch.isinf(ref[0]))
    fin = torch.isfinite(ref[0])
    assert torch.allclose(got[0][fin], ref[0][fin], atol=1e-6)
    if not approximate:
        assert_knn_matches(_orig(tree, got), q.cpu(), pts.cpu(), k)
        got = K.knn(tree, q, k, max_dist2=0.02**2)
        assert_knn_matches(_orig(tree, got), q.cpu(), pts.cpu(), k, max_distance=0.02)


@pytest.mark.parametrize("max_d", [math.inf, 0.02])
def test_hint_keeps_the_answer(backend, max_d, rng):
    m, n = _sizes(backend, (50021, 4099), (5021, 409))
    pts = _cloud(m, rng).to(backend.device)
    q = (_cloud(n, rng, scale=1.3) - 0.15).to(backend.device)
    tree = K.build(pts, K.depth_for(pts.shape[0], 16))
    host = K.TreeArrays(*[x.cpu() if isinstance(x, torch.Tensor) else x for x in tree])
    hint = _hints(host, q.cpu(), 0).to(backend.device)
    got = K.knn(tree, q, 1, max_dist2=max_d**2, hint=hint)
    assert_knn_matches(_orig(tree, got), q.cpu(), pts.cpu(), 1,
                       **({} if math.isinf(max_d) else {"max_distance": max_d}))


@pytest.mark.parametrize("size", ["large", "large, ties everywhere", "one program",
                                  "leaves above a program", "leaves at a program's size"])
def test_device_build_matches_host(backend, size, rng):
    """The build on the points' device (on Triton: the top levels split from the sorted
    lists, then the subtree kernel below 512-point nodes: from level 8, for the whole
    tree, not at all, or not where its nodes are the leaves) equals the host's, ties
    ordered by the points' original index."""
    cases = {"large": ((100003, 12), (10007, 9)), "one program": ((500, 6), (500, 6)),
             "leaves above a program": ((5000, 2), (500, 1)),
             "leaves at a program's size": ((5000, 4), (5000, 4))}
    m, depth = cases[size.split(",")[0]][0 if backend.device == "cuda" else 1]
    pts = _cloud(m, rng)
    pts[::9, 1] = 0.0  # ties
    pts[::7, 0] = pts[0, 0]
    if "ties everywhere" in size:  # every coordinate on a grid of 1/16
        pts = (pts * 16).round() / 16
    a = K.build(pts.to(backend.device), depth, "device")
    b = K.build(pts, depth, "host")
    assert torch.equal(a.perm.cpu(), b.perm)
    assert torch.equal(a.lo.cpu(), b.lo) and torch.equal(a.hi.cpu(), b.hi)
    assert torch.equal(a.split_axis.cpu(), b.split_axis)
    assert math.isclose(float((a.split_value.cpu() - b.split_value).abs().max()), 0.0,
                        abs_tol=1e-7)


@backends("triton")
def test_device_build_replayed_from_a_graph_matches_host(backend, rng, monkeypatch):
    """From a size's second build on, the Triton build replays a CUDA graph over copies of
    the points: every build of new points of that size is the host's, the caller's points
    are not written, and a replay does not overwrite the trees made before it."""
    monkeypatch.setattr(_loop, "USE_GRAPHS", True)
    _loop.clear_caches()
    m, depth = 30011, 11
    clouds, trees = [], []
    for _ in range(4):
        pts = _cloud(m, rng)
        pts[::9, 1] = 0.0  # ties
        dev = pts.to(backend.device)
        trees.append(K.build(dev, depth, "device"))
        assert torch.equal(dev.cpu(), pts)
        clouds.append(pts)
    assert any(isinstance(e.payload, tuple) for e in _loop._programs.entries.values())
    for pts, a in zip(clouds, trees, strict=True):
        b = K.build(pts, depth, "host")
        assert torch.equal(a.perm.cpu(), b.perm) and torch.equal(a.points.cpu(), b.points)
        assert torch.equal(a.lo.cpu(), b.lo) and torch.equal(a.hi.cpu(), b.hi)
        assert torch.equal(a.split_axis.cpu(), b.split_axis)
        assert float((a.split_value.cpu() - b.split_value).abs().max()) <= 1e-7


@pytest.mark.parametrize("approximate", [False, True])
def test_dispatch_with_query_reordering(backend, approximate, rng):
    """Large query sets visit the queries grouped by leaf on Triton: same answers."""
    n, m = _sizes(backend, (K.REORDER_MIN_QUERIES * 3 + 7, 30011), (2003, 3001))
    pts, q = _cloud(m, rng).to(backend.device), (_cloud(n, rng, scale=1.2) - 0.1).to(
        backend.device)
    tree = K.build(pts, K.depth_for(pts.shape[0], 16))
    got = K.knn(tree, q, 4, approximate=approximate)
    ref = K.knn_reference(tree, q, 4, approximate=approximate)
    assert torch.equal(torch.isinf(got[0]), torch.isinf(ref[0]))
    fin = torch.isfinite(ref[0])
    assert torch.allclose(got[0][fin], ref[0][fin], atol=1e-6)
