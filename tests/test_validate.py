import numpy as np
import pytest
import torch

from pointalign import PointCloud, _validate


def test_accepts_numpy_tensor_pointcloud_and_does_not_copy_unnecessarily():
    a = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
    t = _validate.as_points(a)
    assert t.dtype == torch.float32 and t.shape == (5, 3)
    x = torch.randn(5, 3, dtype=torch.float64)
    assert _validate.as_points(x) is x
    assert _validate.as_points(PointCloud(x)).shape == (5, 3)
    assert _validate.as_points(np.arange(15).reshape(5, 3)).dtype == torch.float32


@pytest.mark.parametrize("bad,exc,match", [
    (np.zeros((0, 3)), ValueError, "empty"),
    (np.zeros((5, 2)), ValueError, r"shape \(N, 3\)"),
    (np.zeros(3), ValueError, r"shape \(N, 3\)"),
    (np.array([[0, 0, np.nan]]), ValueError, "NaN or Inf"),
    (np.array([[0, 0, np.inf]]), ValueError, "NaN or Inf"),
    (np.array([["a", "b", "c"]]), TypeError, "numeric"),
    (torch.zeros(4, 3, dtype=torch.bool), TypeError, "floating"),
    ("points.ply", TypeError, "expected a NumPy array"),
    (None, TypeError, "expected a NumPy array"),
])
def test_rejects_bad_points_naming_the_argument(bad, exc, match):
    with pytest.raises(exc, match=match) as info:
        _validate.as_points(bad, "source")
    assert "source" in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_finite_check_counts_bad_rows_and_accepts_a_sum_that_overflows(dtype):
    """The check sums first: finite values whose sum overflows are accepted (the
    element-wise test decides), and a NaN or Inf is found wherever it sits."""
    big = torch.full((1000, 3), torch.finfo(dtype).max / 2, dtype=dtype)
    assert not torch.isfinite(big.sum())
    assert _validate.as_points(big) is big
    for value in (float("nan"), float("inf"), -float("inf")):
        for pts in (torch.zeros(50, 3, dtype=dtype), big.clone()):
            pts[[3, 40], 1] = value
            with pytest.raises(ValueError, match="2 rows contain NaN or Inf"):
                _validate.as_points(pts, "source")
    mixed = torch.zeros(4, 3, dtype=dtype)
    mixed[0, 0], mixed[1, 0] = float("inf"), -float("inf")  # the sum is NaN
    with pytest.raises(ValueError, match="2 rows"):
        _validate.as_points(mixed)


def test_min_points():
    with pytest.raises(ValueError, match="at least 3 points, got 2"):
        _validate.as_points(np.zeros((2, 3)), "target", min_points=3)


def test_batch_forms():
    pts, lens, batched = _validate.as_batch(torch.randn(7, 3))
    assert pts.shape == (1, 7, 3) and lens.tolist() == [7] and not batched
    pts, lens, batched = _validate.as_batch([torch.randn(3, 3), np.zeros((5, 3))])
    assert pts.shape == (2, 5, 3) and lens.tolist() == [3, 5] and batched
    pts, lens, _ = _validate.as_batch(torch.randn(2, 4, 3), lengths=[4, 2])
    assert lens.tolist() == [4, 2]
    with pytest.raises(ValueError, match="exceeds"):
        _validate.as_batch(torch.randn(2, 4, 3), lengths=[5, 2])
    with pytest.raises(ValueError, match="2 entries"):
        _validate.as_batch(torch.randn(2, 4, 3), lengths=[4])
    with pytest.raises(TypeError, match="integers"):
        _validate.as_batch(torch.randn(2, 4, 3), lengths=[4.0, 2.0])


def test_transform_checks():
    assert torch.equal(_validate.as_transform(None), torch.eye(4, dtype=torch.float64))
    assert _validate.as_transform(np.eye(4), batch=3).shape == (3, 4, 4)
    bad = np.eye(4)
    bad[0, 0] = -1  # reflection
    with pytest.raises(ValueError, match="init: not a rigid transform"):
        _validate.as_transform(bad)
    with pytest.raises(ValueError, match=r"init: expected a \(4, 4\)"):
        _validate.as_transform(np.eye(3))
    scaled = np.eye(4) * 2
    scaled[3, 3] = 1
    with pytest.raises(ValueError, match="rigid"):
        _validate.as_transform(scaled, "init")


def test_same_device_and_scalars():
    a = torch.zeros(3)
    assert _validate.same_device(source=a, target=a) == torch.device("cpu")
    with pytest.raises(ValueError, match="sigma: must be finite and > 0"):
        _validate.positive(0.0, "sigma")
    with pytest.raises(ValueError, match="factor"):
        _validate.in_range(1.0, "factor", 0, 1)
    with pytest.raises(TypeError, match="beta0"):
        _validate.positive("x", "beta0")
    with pytest.raises(ValueError, match="device"):
        _validate.as_device("nonsense-device")


def test_resolve_device_is_the_one_rule():
    """Explicit, else the inputs' common device, else the default; a mismatch names both."""
    from pointalign.registration import _edge

    assert _edge.resolve_device is _validate.resolve_device
    cpu, a = torch.device("cpu"), torch.zeros(4, 3)
    meta = torch.zeros(4, 3, device="meta")
    assert _validate.resolve_device(None, source=np.zeros((4, 3)), target=a) == cpu
    assert _validate.resolve_device(None, points=np.zeros((4, 3))) == _validate.default_device()
    assert _validate.resolve_device("cpu", source=a, target=None) == cpu
    assert _validate.resolve_device(None, cloud=PointCloud(a)) == cpu
    with pytest.raises(ValueError, match="different devices: source on cpu, target on meta"):
        _validate.resolve_device(None, source=a, target=meta)
    with pytest.raises(ValueError, match="different devices: source on cpu, target on meta"):
        _validate.resolve_device("cpu", source=PointCloud(a), target=meta)  # even if given
    with pytest.raises(ValueError, match=r"clouds\[0\] on cpu, clouds\[1\] on meta"):
        _validate.resolve_device(None, clouds=[a, meta])
    with pytest.raises(ValueError, match="device"):
        _validate.resolve_device("nonsense-device", source=a)


def test_public_functions_name_inputs_on_different_devices():
    """Every public function resolves its device by the one rule (no hand-picked input)."""
    import types

    import pointalign as pa
    from pointalign.features.outliers import radius_outlier_mask, statistical_outlier_mask
    from pointalign.registration.ransac import feature_correspondences

    pts = torch.rand(50, 3, generator=torch.Generator().manual_seed(0))
    meta = torch.empty(50, 3, device="meta")
    f, f_meta = torch.rand(50, 8), torch.empty(50, 8, device="meta")
    elsewhere = types.SimpleNamespace(points=meta)
    calls = {
        "register": (lambda: pa.register(pts, meta), "source on cpu, target on meta"),
        "ransac": (lambda: pa.ransac(pts, pts, source_features=f, target_features=f_meta,
                                     max_correspondence_distance=0.1),
                   "source_features on cpu, target_features on meta"),
        "feature_correspondences": (lambda: feature_correspondences(f_meta, f),
                                    "source_features on meta, target_features on cpu"),
        "fpfh": (lambda: pa.fpfh(pts, radius=0.2, normals=meta),
                 "cloud_or_points on cpu, normals on meta"),
        "radius_outlier_mask": (lambda: radius_outlier_mask(pts, 0.1, index=elsewhere),
                                "points on cpu, index on meta"),
        "statistical_outlier_mask": (lambda: statistical_outlier_mask(pts, index=elsewhere),
                                     "points on cpu, index on meta"),
    }
    for call, both in calls.values():
        with pytest.raises(ValueError, match=f"^inputs are on different devices: .*{both}"):
            call()


@pytest.mark.gpu
def test_mismatched_devices_rejected():
    with pytest.raises(ValueError, match="different devices"):
        _validate.same_device(source=torch.zeros(3), target=torch.zeros(3, device="cuda"))


@pytest.mark.parametrize("algorithm", ["icp", "emicp", "register", "surface_newton"])
def test_tensors_that_require_grad_are_accepted_and_left_alone(algorithm):
    import pointalign as pa

    pair = pa.datasets.load_bunny_pair()
    s = pa.datasets.random_subsample(pair.source, 600, 0).requires_grad_(True)
    t = pa.datasets.random_subsample(pair.target, 600, 1).requires_grad_(True)
    kw = {"max_correspondence_distance": 0.05} if algorithm == "icp" else {}
    res = getattr(pa, algorithm)(s, t, device="cpu", **kw)
    assert res.transformation.shape == (4, 4)
    assert s.requires_grad and s.grad is None and t.grad is None
