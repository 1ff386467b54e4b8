"""Open3D (legacy and tensor API), open3d.core.Tensor and DLPack objects wherever points go."""

import numpy as np
import pytest
import torch

import pointalign as pa
from pointalign import _validate, datasets


class DLPackOnly:
    """Stands for CuPy/JAX arrays: exposes nothing but the DLPack protocol."""

    def __init__(self, t):
        self._t = t

    def __dlpack__(self, **kwargs):
        return self._t.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


def test_dlpack_object_is_zero_copy_and_validated():
    t = torch.randn(20, 3)
    got = _validate.as_points(DLPackOnly(t), "source")
    assert got.data_ptr() == t.data_ptr() and torch.equal(got, t)
    with pytest.raises(ValueError, match="source: expected shape"):
        _validate.as_points(DLPackOnly(torch.randn(5, 2)), "source")
    bad = torch.randn(5, 3)
    bad[1, 1] = float("nan")
    with pytest.raises(ValueError, match="source: 1 rows contain NaN"):
        _validate.as_points(DLPackOnly(bad), "source")


def test_unknown_object_message_names_argument_and_type():
    with pytest.raises(TypeError, match=r"target: expected .*DLPack.*got builtins\.object"):
        _validate.as_points(object(), "target")


def test_pointcloud_duck_typed_without_circular_import():
    cloud = pa.PointCloud(torch.randn(10, 3))
    assert _validate.as_points(cloud, "source") is cloud.points
    import sys
    src = open(sys.modules["pointalign._validate"].__file__).read()
    assert "pointalign.cloud" not in src.split('"""', 2)[2]  # no import of cloud.py


def test_icp_takes_dlpack_inputs():
    pair = datasets.load_bunny_pair()
    src = datasets.random_subsample(pair.source, 400, seed=0)
    T0 = pair.T_target_source.numpy()
    a = pa.icp(src, pair.target, init=T0, max_correspondence_distance=0.005, device="cpu")
    b = pa.icp(DLPackOnly(src), DLPackOnly(pair.target), init=T0,
               max_correspondence_distance=0.005, device="cpu")
    np.testing.assert_allclose(a.transformation, b.transformation, atol=1e-9)


try:
    import open3d as o3d
except ImportError:  # optional extra: the Open3D tests skip, the DLPack ones still run
    o3d = None
needs_o3d = pytest.mark.skipif(o3d is None, reason="needs open3d (pip install open3d)")


def _o3d_legacy(pts, normals=None):
    pcd = o3d.geometry.PointCloud()
    pcd.points = o3d.utility.Vector3dVector(pts)
    if normals is not None:
        pcd.normals = o3d.utility.Vector3dVector(normals)
    return pcd


@needs_o3d
def test_open3d_legacy_cloud_accepted_zero_copy():
    pts = np.random.default_rng(0).normal(size=(30, 3))
    pcd = _o3d_legacy(pts)
    got = _validate.as_points(pcd, "source")
    assert got.dtype == torch.float64
    np.testing.assert_array_equal(got.numpy(), pts)
    assert got.data_ptr() == np.asarray(pcd.points).__array_interface__["data"][0]


@needs_o3d
def test_open3d_tensor_cloud_and_tensor_accepted_zero_copy():
    pts = np.random.default_rng(1).normal(size=(30, 3)).astype(np.float32)
    ot = o3d.core.Tensor(pts)
    got = _validate.as_points(ot, "source")
    np.testing.assert_array_equal(got.numpy(), pts)
    got[0, 0] = 42.0  # shared memory: the write shows in the Open3D tensor
    assert ot[0, 0].item() == 42.0
    tpcd = o3d.t.geometry.PointCloud(ot)
    got2 = _validate.as_points(tpcd, "target")
    assert got2.dtype == torch.float32 and got2.data_ptr() == got.data_ptr()
    with pytest.raises(ValueError, match="target"):
        _validate.as_points(o3d.core.Tensor(pts[:, :2].copy()), "target")


@needs_o3d
def test_register_functions_accept_open3d_clouds():
    pair = datasets.load_bunny_pair()
    src = datasets.random_subsample(pair.source, 400, seed=0)
    T0 = pair.T_target_source.numpy()
    ref = pa.icp(src, pair.target, init=T0, max_correspondence_distance=0.005, device="cpu")
    legacy = pa.icp(_o3d_legacy(src.double().numpy()), _o3d_legacy(pair.target.double().numpy()),
                    init=T0, max_correspondence_distance=0.005, device="cpu")
    tens = pa.icp(o3d.t.geometry.PointCloud(o3d.core.Tensor(src.numpy())),
                  o3d.t.geometry.PointCloud(o3d.core.Tensor(pair.target.numpy())),
                  init=T0, max_correspondence_distance=0.005, device="cpu")
    np.testing.assert_allclose(tens.transformation, ref.transformation, atol=1e-9)
    np.testing.assert_allclose(legacy.transformation, ref.transformation, atol=1e-5)
    ev = pa.evaluate_registration(_o3d_legacy(src.double().numpy()),
                                  o3d.t.geometry.PointCloud(o3d.core.Tensor(pair.target.numpy())),
                                  ref.transformation, 0.005)
    assert ev.fitness == pytest.approx(ref.fitness, abs=0.01)


@needs_o3d
def test_pointcloud_open3d_round_trips():
    rng = np.random.default_rng(2)
    pts = rng.normal(size=(25, 3)).astype(np.float32)
    nrm = rng.normal(size=(25, 3)).astype(np.float32)
    nrm /= np.linalg.norm(nrm, axis=1, keepdims=True)
    col = rng.uniform(size=(25, 3)).astype(np.float32)
    cloud = pa.PointCloud(pts, nrm, col, extras={"intensity": torch.arange(25.0)})
    legacy = cloud.to_open3d()
    assert isinstance(legacy, o3d.geometry.PointCloud) and legacy.has_normals()
    back = pa.PointCloud.from_open3d(legacy)
    np.testing.assert_allclose(back.points.numpy(), pts, atol=1e-7)
    np.testing.assert_allclose(back.colors.numpy(), col, atol=1e-7)
    tcloud = cloud.to_open3d(tensor=True)
    assert isinstance(tcloud, o3d.t.geometry.PointCloud)
    assert set(tcloud.point) >= {"positions", "normals", "colors", "intensity"}
    back2 = pa.PointCloud.from_open3d(tcloud)
    assert back2.dtype == torch.float32
    np.testing.assert_array_equal(back2.points.numpy(), pts)
    np.testing.assert_array_equal(back2.normals.numpy(), nrm)
    np.testing.assert_array_equal(back2.extras["intensity"].numpy(), np.arange(25.0))
    with pytest.raises(TypeError, match="pcd"):
        pa.PointCloud.from_open3d(np.zeros((3, 3)))
    # the source cloud is untouched by the conversions
    np.testing.assert_array_equal(cloud.points.numpy(), pts)


@pytest.mark.gpu
def test_dlpack_cuda_zero_copy_on_device():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    t = torch.randn(100, 3, device="cuda")
    got = _validate.as_points(DLPackOnly(t), "source")
    assert got.is_cuda and got.data_ptr() == t.data_ptr()
    cloud = pa.PointCloud(t)
    if o3d is None:
        return
    tp = cloud.to_open3d(tensor=True)  # CUDA Open3D: stays on the GPU; else a CPU copy
    back = pa.PointCloud.from_open3d(tp)
    assert torch.equal(back.points.cpu(), t.cpu())
