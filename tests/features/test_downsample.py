import math

import numpy as np
import pytest
import torch

from pointalign import PointCloud, datasets
from pointalign.features.downsample import count_voxels, voxel_downsample, voxel_keys


def _oracle(points: np.ndarray, v: float) -> dict[tuple, np.ndarray]:
    """Centroid per voxel in float64 NumPy, keyed by integer cell."""
    cells = np.floor((points - points.min(0)) / v).astype(np.int64)
    groups: dict[tuple, list] = {}
    for c, p in zip(map(tuple, cells), points, strict=False):
        groups.setdefault(c, []).append(p)
    return {c: np.mean(ps, 0) for c, ps in groups.items()}


@pytest.mark.parametrize("n", [1, 2, 7, 1001])
def test_centroids_match_numpy_oracle(seed, n):
    rng = np.random.default_rng(seed)
    pts = rng.uniform(-1, 3, size=(n, 3))
    v = 0.37
    out = voxel_downsample(torch.from_numpy(pts), v)
    ref = _oracle(pts, v)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
    assert out.shape == (len(ref), 3)
    got = sorted(map(tuple, out.numpy().round(9)))
    want = sorted(map(tuple, np.array(list(ref.values())).round(9)))
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-9)
    assert count_voxels(torch.from_numpy(pts), v) == len(ref)


def test_float32_bunny_every_point_within_its_voxel():
    pts = datasets.load_bunny("bun000")
    v = 0.004
    out = voxel_downsample(pts, v)
    assert out.dtype == torch.float32
    ref = _oracle(pts.double().numpy(), v)
    assert out.shape[0] == len(ref)
    got = np.sort(out.double().numpy(), axis=0)
    want = np.sort(np.array(list(ref.values())), axis=0)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_one_big_voxel_gives_the_mean(seed):
    g = torch.Generator().manual_seed(seed)
    pts = torch.randn(57, 3, generator=g, dtype=torch.float64)
    out = voxel_downsample(pts, 100.0)
    torch.testing.assert_close(out, pts.mean(0, keepdim=True))


def test_pointcloud_carries_normals_and_colours(seed):
    g = torch.Generator().manual_seed(seed)
    pts = torch.rand(300, 3, generator=g, dtype=torch.float64)
    nrm = torch.randn(300, 3, generator=g, dtype=torch.float64)
    nrm = nrm / nrm.norm(dim=1, keepdim=True)
    col = torch.rand(300, 3, generator=g, dtype=torch.float64)
    cloud = PointCloud(pts, normals=nrm, colors=col)
    out = voxel_downsample(cloud, 0.25)
    assert isinstance(out, PointCloud)
    assert out.normals is not None and out.colors is not None
    torch.testing.assert_close(out.normals.norm(dim=1), torch.ones(len(out), dtype=torch.float64))
    # colours: the mean colour of the points of each voxel; check one voxel against a mask
    cells = torch.floor((pts - pts.min(0).values) / 0.25).long()
    c0 = torch.floor((out.points[0] - pts.min(0).values) / 0.25).long()
    members = (cells == c0).all(1)
    torch.testing.assert_close(out.colors[0], col[members].mean(0))
    mean_n = nrm[members].sum(0)
    torch.testing.assert_close(out.normals[0], mean_n / mean_n.norm())


def test_deterministic_and_input_untouched(seed):
    g = torch.Generator().manual_seed(seed)
    pts = torch.rand(5000, 3, generator=g)
    before = pts.clone()
    a, b = voxel_downsample(pts, 0.05), voxel_downsample(pts, 0.05)
    assert torch.equal(a, b)
    assert torch.equal(pts, before)


def test_numpy_input_returns_numpy():
    """Outputs follow the input's kind (issue 26): NumPy in, NumPy out; tensors stay tensors."""
    out = voxel_downsample(np.zeros((4, 3)), 1.0)
    assert isinstance(out, np.ndarray) and out.shape == (1, 3)
    out = voxel_downsample(torch.zeros(4, 3), 1.0)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 3)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_bad_voxel_size(bad):
    with pytest.raises(ValueError, match="voxel_size"):
        voxel_downsample(torch.rand(10, 3), bad)


def test_bad_points():
    with pytest.raises(ValueError, match="cloud"):
        voxel_downsample(torch.rand(10, 2), 0.1)
    with pytest.raises(ValueError, match="cloud"):
        voxel_downsample(torch.empty(0, 3), 0.1)
    with pytest.raises(ValueError, match="voxel_size"):
        voxel_downsample(torch.tensor([[0.0, 0, 0], [1e6, 0, 0]]), 1e-3)


def test_device_matches_cpu(seed, device):
    g = torch.Generator().manual_seed(seed)
    pts = torch.rand(20000, 3, generator=g)
    a = voxel_downsample(pts, 0.03)
    b = voxel_downsample(pts.to(device), 0.03)
    assert b.device.type == device
    torch.testing.assert_close(b.cpu(), a, atol=1e-6, rtol=0)


def test_sort_based_grouping_equals_unique(seed):
    # the single stable sort groups exactly as torch.unique + a stable argsort of the
    # inverse (the former implementation): same voxels, same order, same centroids
    g = torch.Generator().manual_seed(seed)
    pts = torch.rand(5000, 3, generator=g, dtype=torch.float64) * torch.tensor([1.0, 0.5, 0.01])
    v = 0.02
    keys, _ = voxel_keys(pts, v)
    _, inverse, counts = torch.unique(keys, sorted=True, return_inverse=True, return_counts=True)
    order = torch.argsort(inverse, stable=True)
    seg = inverse[order]
    ref = torch.zeros(counts.numel(), 3, dtype=torch.float64).index_add_(0, seg, pts[order])
    ref /= counts[:, None].to(torch.float64)
    out = voxel_downsample(pts, v)
    assert count_voxels(pts, v) == counts.numel() == out.shape[0]
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_chunked_float64_work_equals_one_pass(seed, chunk, monkeypatch):
    """Keys and segment sums taken a chunk at a time (large clouds) equal the one-pass ones,
    including voxels that straddle a chunk boundary or are longer than a chunk."""
    from pointalign.features import downsample as ds

    g = torch.Generator().manual_seed(seed)
    # clustered points: some voxels hold hundreds of points (longer than a small chunk)
    pts = torch.cat([torch.rand(500, 3, generator=g),
                     0.5 + 0.01 * torch.rand(300, 3, generator=g)])
    cloud = PointCloud(pts, normals=torch.nn.functional.normalize(
        torch.randn(800, 3, generator=g), dim=1), colors=torch.rand(800, 3, generator=g))
    one = ds.voxel_downsample(cloud, 0.1)
    keys_one, _ = ds.voxel_keys(pts, 0.1)
    monkeypatch.setattr(ds, "_CHUNK", chunk)
    many = ds.voxel_downsample(cloud, 0.1)
    keys_many, _ = ds.voxel_keys(pts, 0.1)
    assert torch.equal(keys_one, keys_many)
    torch.testing.assert_close(many.points, one.points, rtol=0, atol=1e-6)
    torch.testing.assert_close(many.normals, one.normals, rtol=0, atol=1e-6)
    torch.testing.assert_close(many.colors, one.colors, rtol=0, atol=1e-6)


@pytest.mark.parametrize("repeat", [1, 3])
def test_many_clouds_at_once_equal_each_alone(repeat):
    """voxel_downsample_many: each cloud on its own grid, its voxels in its own order; the
    same float32 centroids (the shared float64 cumulative sum could move one by an ulp of
    float64 only, far below float32's: equal here). Four clouds (corners reduced cloud by
    cloud) and twelve (corners by one scatter); the same with the caller's group."""
    from pointalign.features.downsample import group_clouds, voxel_downsample_many

    g = torch.Generator().manual_seed(repeat)
    clouds = [torch.rand(n, 3, generator=g) * s + o for n, s, o in
              ((500, 10.0, 0.0), (3, 2.0, -7.5), (900, 30.0, 100.0), (1, 1.0, 0.3))
              for _ in range(repeat)]
    got = voxel_downsample_many(clouds, 1.0)
    assert len(got) == len(clouds)
    for c, d in zip(clouds, got, strict=True):
        assert torch.equal(d, voxel_downsample(c, 1.0))
    grouped = voxel_downsample_many(clouds, 1.0, group_clouds(clouds))  # a caller's group
    assert all(torch.equal(a, b) for a, b in zip(grouped, got, strict=True))


def _many_clouds(device: str) -> list[torch.Tensor]:
    """Bunny-size clouds of different sizes and scales, a tiny one and a coincident one."""
    bunny = datasets.load_bunny("bun000")
    g = torch.Generator().manual_seed(3)
    clouds = [datasets.random_subsample(bunny, n, seed=n) * s + o for n, s, o in
              ((2000, 1.0, 0.0), (1500, 10.0, 5.0), (3000, 0.01, -1.0), (800, 250.0, 0.0))]
    clouds += [torch.rand(40, 3, generator=g), torch.zeros(7, 3), torch.rand(2, 3, generator=g),
               bunny]
    return [c.to(device) for c in clouds]


@pytest.mark.parametrize("k", [1, 2, 8, 9])
def test_group_corners_are_each_clouds_bounds(device, k):
    """group_clouds: every cloud's corners as bounds() finds them alone, whether reduced
    cloud by cloud (a few clouds) or by one scatter (many)."""
    from pointalign.features.downsample import bounds, group_clouds

    clouds = (_many_clouds(device) * 2)[:k]
    group = group_clouds(clouds)
    for c, lo, hi in zip(clouds, group.lo_h, group.hi_h, strict=True):
        _, want_lo, want_hi = bounds(c)
        assert lo == want_lo and hi == want_hi
    assert group.lo.tolist() == group.lo_h and group.sizes == [c.shape[0] for c in clouds]


@pytest.mark.parametrize("first_rounds", [4, 1])
def test_auto_voxel_size_many_equals_each_alone(device, first_rounds, monkeypatch):
    """auto_voxel_size_many: every cloud's edge bit for bit (the same cells, counts and host
    arithmetic); NaN where auto_voxel_size raises (all points coincide); ``clouds`` sizes
    some of the group's clouds, in its order, with the same edges. With the host looking
    after one round (``FIRST_ROUNDS`` 1), the search goes on from the device's state."""
    from pointalign.features import downsample
    from pointalign.features.downsample import (
        auto_voxel_size,
        auto_voxel_size_many,
        group_clouds,
    )

    monkeypatch.setattr(downsample, "FIRST_ROUNDS", first_rounds)

    clouds = _many_clouds(device)
    group = group_clouds(clouds)
    for target in (5000, 300):
        got = auto_voxel_size_many(group, target)
        for c, v in zip(clouds, got, strict=True):
            if bool((c == c[0]).all()):
                assert math.isnan(v)
                with pytest.raises(ValueError, match="coincide"):
                    auto_voxel_size(c, target)
            else:
                assert v == auto_voxel_size(c, target)
        some = list(range(len(clouds)))[::-2]  # some clouds, in another order
        assert [math.isnan(v) or v for v in auto_voxel_size_many(group, target, clouds=some)] \
            == [math.isnan(got[i]) or got[i] for i in some]


def test_divide_like_scalar_rounds_as_a_scalar_division(device):
    """_ops.divide_like_scalar gives ``x / v`` of each row's Python float v, bit for bit."""
    from pointalign._ops import divide_like_scalar

    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.float64):
        x = (torch.randn(3000, 3, generator=g, dtype=torch.float64) * 10).to(dt).to(device)
        vs = [0.0031, 1 / 3, 7.7e-5, 123.456, 0.1]
        rows = torch.arange(3000, device=device) % len(vs)
        got = divide_like_scalar(x, vs, rows)
        for i, v in enumerate(vs):
            assert torch.equal(got[i::len(vs)], x[i::len(vs)] / v)


def test_packed_grids_count_cells_as_the_host_and_flag_an_overflow(device):
    """packed_grids: cells per axis as Python computes them (a true division and floor, or
    the float floor division ``//``), offsets in turn; overflow flagged per axis, in all,
    and for a non-finite edge, with no host read."""
    from pointalign.features.downsample import packed_grids

    g = torch.Generator().manual_seed(4)
    ext = (torch.rand(5, 3, generator=g, dtype=torch.float64) * 10).to(device)
    edges = (torch.rand(5, generator=g, dtype=torch.float64) * 0.5 + 0.01).to(device)
    for spare in (-1, 0, 1):
        dims, base, overflow = packed_grids(ext, edges, spare)
        want = [[(int(e // v) + 1 if spare < 0 else math.floor(e / v) + 1 + spare)
                 for e in row] for row, v in zip(ext.tolist(), edges.tolist(), strict=True)]
        assert dims.tolist() == want and not bool(overflow)
        cells = [a * b * c for a, b, c in want]
        assert base.tolist() == [sum(cells[:i]) for i in range(5)]
    ten = torch.full_like(ext, 10.0)
    # 10**8 cells an axis; 9.1·10**5 an axis (below 2**21), 7.5·10**17 in each of 5 clouds;
    # NaN; and just fitting (6.7·10**5 an axis, 1.5·10**18 in all)
    for e, over in ((1e-7, True), (1.1e-5, True), (math.nan, True), (1.5e-5, False)):
        assert bool(packed_grids(ten, torch.full_like(edges, e), 1)[2]) == over


def test_auto_voxel_size_many_after_an_overflow_sizes_each_cloud_alone(device, monkeypatch):
    """Where the program reports its packed cells overflowed (forced here), every cloud is
    sized alone: the same edges, NaN where the points coincide."""
    import dataclasses

    from pointalign.features import downsample

    @dataclasses.dataclass(frozen=True)
    class Overflowing(downsample._EdgeSearch):
        def __call__(self, inputs, checkpoint):
            out = super().__call__(inputs, checkpoint)
            return {**out, "overflow": torch.ones_like(out["overflow"])}

    clouds = _many_clouds(device)
    group = downsample.group_clouds(clouds)
    want = downsample.auto_voxel_size_many(group, 300)
    monkeypatch.setattr(downsample, "_EdgeSearch", Overflowing)
    got = downsample.auto_voxel_size_many(group, 300)
    assert [math.isnan(v) or v for v in got] == [math.isnan(v) or v for v in want]
