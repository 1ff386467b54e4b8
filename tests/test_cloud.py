import numpy as np
import pytest
import torch

from pointalign import PointCloud
from pointalign import transforms as T


def test_construct_coerces_to_one_device_and_dtype():
    c = PointCloud(np.zeros((4, 3), np.float64), normals=np.ones((4, 3), np.float32),
                   colors=torch.rand(4, 3, dtype=torch.float64))
    assert c.dtype == torch.float64 and c.normals.dtype == torch.float64
    assert len(c) == 4 and "normals" in repr(c)


@pytest.mark.parametrize("kw,match", [
    (dict(normals=np.zeros((3, 3))), r"normals: expected shape \(4, 3\)"),
    (dict(colors=np.zeros((4, 4))), "colors"),
    (dict(features=np.zeros((3, 33))), "features"),
    (dict(normals=np.full((4, 3), np.nan)), "normals"),
])
def test_rejects_mismatched_attributes(kw, match):
    with pytest.raises(ValueError, match=match):
        PointCloud(np.zeros((4, 3)), **kw)


def test_transform_moves_points_and_rotates_normals_without_touching_input():
    pts = torch.randn(10, 3)
    nrm = torch.nn.functional.normalize(torch.randn(10, 3), dim=-1)
    c = PointCloud(pts, normals=nrm)
    before = pts.clone()
    M = T.se3_exp(torch.tensor([0.3, 0.1, -0.2, 1.0, 2.0, 3.0], dtype=torch.float64))
    moved = c.transform(M)
    assert torch.equal(c.points, before)
    assert torch.allclose(moved.points, T.apply(M, pts), atol=1e-6)
    assert torch.allclose(moved.normals.norm(dim=-1), torch.ones(10), atol=1e-6)
    assert torch.allclose(moved.normals, nrm @ M[:3, :3].float().T, atol=1e-6)


def test_select_and_numpy():
    c = PointCloud(torch.arange(12.0).reshape(4, 3), colors=torch.rand(4, 3))
    s = c.select(torch.tensor([True, False, True, False]))
    assert len(s) == 2 and s.colors.shape == (2, 3)
    d = s.numpy()
    assert set(d) == {"points", "colors"}


def test_is_immutable():
    c = PointCloud(torch.zeros(2, 3))
    with pytest.raises(AttributeError):
        c.points = torch.ones(2, 3)
