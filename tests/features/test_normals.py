"""Normals: the closed-form 3×3 eigen-solver vs torch.linalg.eigh, PCA normals vs analytic
surfaces (sphere, plane), orientation, search modes, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pointalign.cloud import PointCloud
from pointalign.features.normals import (
    estimate_normals,
    smallest_eigenvector,
    symmetric_eigenvalues,
)
from pointalign.search import build_index


def _random_sym(g, n, dtype=torch.float64):
    Q, _ = torch.linalg.qr(torch.randn(n, 3, 3, generator=g, dtype=torch.float64))
    lam = torch.rand(n, 3, generator=g, dtype=torch.float64) * 10 - 2
    lam = lam.sort(-1).values
    lam[:, 1] = lam[:, 0] + 0.01 + lam[:, 1].abs()  # keep the smallest one simple
    return (Q @ torch.diag_embed(lam) @ Q.transpose(1, 2)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_eigen_matches_eigh(rng, dtype):
    A = _random_sym(rng, 2000, dtype)
    A = A * torch.logspace(-6, 6, 2000, dtype=torch.float64).to(dtype)[:, None, None]
    v, lam = smallest_eigenvector(A)
    ev, V = torch.linalg.eigh(A.double())
    scale = ev.abs().amax(-1, keepdim=True)
    tol = 1e-9 if dtype == torch.float64 else 1e-5
    assert torch.allclose(lam.double() / scale, ev / scale, atol=tol * 10)
    assert torch.allclose(v.double().norm(dim=-1), torch.ones(2000, dtype=torch.float64),
                          atol=tol)
    dots = (v.double() * V[:, :, 0]).sum(-1).abs()
    # float32 matrices carry relative errors of 1e-7 in A, so the vector is good to
    # about that over the relative eigen-gap
    assert (dots > 1 - (1e-12 if dtype == torch.float64 else 1e-4)).all()


def test_eigenvalues_closed_form_known():
    A = torch.tensor([[2.0, 1, 0], [1, 2, 0], [0, 0, 5]], dtype=torch.float64)
    assert torch.allclose(symmetric_eigenvalues(A), torch.tensor([1.0, 3, 5],
                                                                 dtype=torch.float64))


def test_eigen_degenerate_cases():
    A = torch.stack([
        torch.diag(torch.tensor([1.0, 1.0, 0.0])),     # plane: normal is ±z
        torch.diag(torch.tensor([4.0, 0.0, 0.0])),     # line: any vector ⟂ x
        torch.zeros(3, 3),                              # single point: any unit vector
        torch.eye(3) * 2,                               # isotropic: any unit vector
        torch.diag(torch.tensor([1.0, 1.0, 1.0 - 1e-12])),
    ]).double()
    v, _ = smallest_eigenvector(A)
    assert torch.isfinite(v).all()
    assert torch.allclose(v.norm(dim=-1), torch.ones(5, dtype=torch.float64))
    assert abs(abs(v[0, 2].item()) - 1) < 1e-12
    assert abs(v[1, 0].item()) < 1e-12


def _sphere(n, g, radius=1.0, center=(0.0, 0.0, 0.0)):
    d = torch.nn.functional.normalize(torch.randn(n, 3, generator=g, dtype=torch.float64), dim=-1)
    return (torch.tensor(center, dtype=torch.float64) + radius * d).float(), d.float()


def test_sphere_normals_towards_viewpoint(rng):
    pts, d = _sphere(3000, rng)
    n = estimate_normals(pts, k=12, device="cpu")
    assert n.shape == (3000, 3) and n.dtype == torch.float32
    assert torch.allclose(n.norm(dim=-1), torch.ones(3000), atol=1e-5)
    # the origin (default viewpoint) is inside: normals point inwards
    dots = (n * d).sum(-1)
    assert (dots < -0.98).all(), dots.max()
    n_out = estimate_normals(pts, k=12, viewpoint=[0.0, 0.0, 100.0], device="cpu")
    top = d[:, 2] > 0.2
    assert ((n_out * d).sum(-1)[top] > 0.98).all()


def test_plane_normals_majority_and_viewpoint(rng):
    g = rng
    xy = torch.rand(2000, 2, generator=g) * 2 - 1
    z = 0.5 + 1e-4 * torch.randn(2000, generator=g)
    pts = torch.cat([xy, z[:, None]], 1)
    n_vp = estimate_normals(pts, k=16, device="cpu")
    assert (n_vp[:, 2] < -0.99).all()   # facing the origin below the plane
    n_maj = estimate_normals(pts, k=16, orient="majority", device="cpu")
    assert (n_maj[:, 2] > 0.99).all()   # dominant direction, largest component positive
    n_raw = estimate_normals(pts, k=16, orient=None, device="cpu")
    assert (n_raw[:, 2].abs() > 0.99).all()


def test_radius_and_hybrid_search(rng):
    pts, d = _sphere(4000, rng, radius=2.0, center=(5.0, -3.0, 1.0))
    c = torch.tensor([5.0, -3.0, 1.0])
    for kw in ({"radius": 0.3}, {"radius": 0.3, "k": 10}):
        n = estimate_normals(pts, viewpoint=c, device="cpu", **kw)
        assert ((n * d).sum(-1) < -0.97).all(), kw


def test_index_reuse_and_pointcloud_input(rng):
    pts, _ = _sphere(500, rng)
    ix = build_index(pts, "brute")
    a = estimate_normals(PointCloud(pts), k=8, index=ix, device="cpu")
    b = estimate_normals(pts.numpy(), k=8, device="cpu")
    assert isinstance(a, torch.Tensor) and isinstance(b, np.ndarray)  # the input's kind
    assert torch.allclose(a, torch.from_numpy(b), atol=1e-5)


def test_tiny_clouds():
    pts = torch.tensor([[0.0, 0, 1], [1.0, 0, 1], [0, 1.0, 1]])
    n = estimate_normals(pts, k=3, device="cpu")
    assert torch.allclose(n, torch.tensor([[0.0, 0, -1]]).expand(3, 3), atol=1e-6)
    one = estimate_normals(torch.tensor([[1.0, 2.0, 3.0]]), device="cpu")
    assert torch.isfinite(one).all() and math.isclose(one.norm().item(), 1.0, rel_tol=1e-6)


def test_bad_input():
    pts = torch.rand(50, 3)
    with pytest.raises(ValueError, match="k"):
        estimate_normals(pts, k=2)
    with pytest.raises(ValueError, match="radius"):
        estimate_normals(pts, radius=0.0)
    with pytest.raises(ValueError, match="orient"):
        estimate_normals(pts, orient="outward")
    with pytest.raises(ValueError, match="viewpoint"):
        estimate_normals(pts, viewpoint=[1.0, 2.0])
    with pytest.raises(ValueError, match="points"):
        estimate_normals(torch.zeros(0, 3))
    bad = pts.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="points"):
        estimate_normals(bad)
    with pytest.raises(ValueError, match="index"):
        estimate_normals(pts, index=build_index(pts[:10], "brute"))


def test_device_matches_cpu(rng, device):
    pts, d = _sphere(20_000 if device == "cuda" else 4_000, rng)
    n_dev = estimate_normals(pts.to(device), k=12)
    assert n_dev.device.type == device
    n_cpu = estimate_normals(pts, k=12, device="cpu")
    assert ((n_dev.cpu() * n_cpu).sum(-1) > 0.999).all()


@pytest.mark.parametrize("kw", [{"k": 10}, {"k": 16}, {"k": 20}, {},
                                {"radius": 0.5, "max_neighbors": 12}])
def test_repeated_points_have_the_normals_of_the_cloud(rng, kw):
    """Every point repeated 8 times: its 16 nearest are copies of 2 points (a line, no
    normal); the copies count once, so each copy gets the distinct cloud's normal."""
    pts, _ = _sphere(400, rng)
    c = pts.mean(0)
    want = estimate_normals(pts, viewpoint=c, device="cpu", **kw)
    got = estimate_normals(pts.repeat_interleave(8, 0), viewpoint=c, device="cpu", **kw)
    assert torch.isfinite(got).all()
    # the same neighbourhoods summed in another order (float32): the same normal to ~1e-6
    cos = (got.double() * want.repeat_interleave(8, 0).double()).sum(-1)
    assert (cos > 1 - 1e-5).all(), float(cos.min())
    # a few copies among distinct points: those rows too, the others as before
    some = torch.cat([pts, pts[:7]])
    mixed = estimate_normals(some, viewpoint=c, device="cpu", **kw)
    assert ((mixed[:400].double() * want.double()).sum(-1) > 1 - 1e-5).all()
    assert ((mixed[400:].double() * want[:7].double()).sum(-1) > 1 - 1e-5).all()


def test_a_cloud_of_copies_of_one_point_is_finite():
    one = torch.tensor([[1.0, 2.0, 3.0]]).expand(50, 3)
    n = estimate_normals(one, k=10, device="cpu")
    assert torch.isfinite(n).all()
    assert torch.allclose(n.norm(dim=-1), torch.ones(50), atol=1e-6)
