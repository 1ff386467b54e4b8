"""estimate_covariances: plane-regularised covariances vs a NumPy oracle (cKDTree k-NN and
eigh of each neighbourhood) on every backend, the neighbour table shared with the normals,
analytic surfaces, PointCloud.covariances, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.spatial import cKDTree

from pointalign import datasets, transforms
from pointalign.cloud import PointCloud
from pointalign.features.covariances import estimate_covariances
from pointalign.features.normals import estimate_normals
from pointalign.search import build_index

EPS = 1e-3
U64 = 2.0 ** -53
U32 = 2.0 ** -24


def _oracle(pts: np.ndarray, k: int, eps: float = EPS):
    """Covariances ``V diag(ε, 1, 1) Vᵀ`` of each k-NN neighbourhood, and relative gaps."""
    _, idx = cKDTree(pts).query(pts, k)
    out = np.empty((pts.shape[0], 3, 3))
    gaps = np.empty(pts.shape[0])
    for i, row in enumerate(idx):
        d = pts[row] - pts[row].mean(0)
        lam, V = np.linalg.eigh(d.T @ d / k)
        out[i] = V @ np.diag([eps, 1.0, 1.0]) @ V.T
        gaps[i] = (lam[1] - lam[0]) / lam[2]
    return out, gaps


@pytest.fixture(scope="module")
def bunny():
    return datasets.random_subsample(datasets.load_bunny("bun000"), 800, seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_matches_numpy_oracle(backend, bunny, dtype):
    pts = bunny.to(dtype)
    got = estimate_covariances(pts.to(backend.device), k=20).cpu()
    assert got.shape == (800, 3, 3) and got.dtype == dtype
    want, gaps = _oracle(pts.double().numpy(), 20)
    # the closed-form eigenvector: ~sqrt(u) over the relative gap (tests/kernels/test_gicp.py)
    tol = 8 * math.sqrt(U64) / gaps + (4 * U32 if dtype == torch.float32 else 0.0)
    err = np.abs(got.double().numpy() - want).max((1, 2))
    assert (err <= tol).all(), (err / tol).max()


def test_plane_and_sphere_are_their_normals(rng):
    """On a plane C = I − (1 − ε) zzᵀ; on a sphere the normal direction is the radius."""
    xy = torch.rand(500, 2, generator=rng, dtype=torch.float64)
    plane = torch.cat([xy, torch.zeros(500, 1, dtype=torch.float64)], 1)
    C = estimate_covariances(plane, k=10)
    z = torch.tensor([0.0, 0, 1], dtype=torch.float64)
    want = torch.eye(3, dtype=torch.float64) - (1 - EPS) * torch.outer(z, z)
    torch.testing.assert_close(C, want.expand_as(C), atol=1e-12, rtol=0)
    s = torch.nn.functional.normalize(torch.randn(3000, 3, generator=rng,
                                                  dtype=torch.float64), dim=-1)
    C = estimate_covariances(s, k=10)
    # Cs = s − (1 − ε) s (n·s) ≈ ε s when n ≈ ±s: the radius is the least-variance direction
    Cs = (C @ s[:, :, None])[..., 0]
    assert ((Cs * s).sum(-1) < 0.02).all()


def test_shared_neighbour_table_with_normals(bunny):
    """The table the normals were estimated from gives the same covariances (one search)."""
    ix = build_index(bunny)
    table = ix.knn(bunny, 20).idx
    a = estimate_covariances(bunny, neighbors=table)
    b = estimate_covariances(bunny, k=20, index=ix)
    assert torch.equal(a, b)
    n = estimate_normals(bunny, neighbors=table, orient=None)
    # the normal is the least-variance direction of the covariance: C n = ε n
    torch.testing.assert_close((a.double() @ n.double()[:, :, None])[..., 0],
                               EPS * n.double(), atol=2e-4, rtol=0)


@pytest.mark.parametrize("method", ["brute", "kdtree", "ckdtree", "grid"])
def test_every_index_gives_the_default_covariances(backend, bunny, method):
    """Any index (the default path: the fused search on the CPU, brute force or a tree on a
    device) finds the exact k-NN: the covariances agree up to the rounding of the float64
    sums taken in another order where ties in float32 distance order differently, carried
    through the eigenvector (~sqrt(u) over the gap, as the oracle test)."""
    if method == "ckdtree" and backend.name == "triton":
        pytest.skip("SciPy's tree answers on the host: not a Triton search (the fixture forces "
                    "POINTALIGN_BACKEND=triton)")
    pts = bunny.to(backend.device)
    default = estimate_covariances(pts, k=20).cpu()
    got = estimate_covariances(pts, k=20, index=build_index(pts, method)).cpu()
    _, gaps = _oracle(bunny.double().numpy(), 20)
    tol = 8 * math.sqrt(U64) / gaps + 4 * U32
    err = np.abs(got.double().numpy() - default.double().numpy()).max((1, 2))
    assert (err <= tol).all(), (err / tol).max()


def test_fallback_for_degenerate_neighbourhoods():
    line = torch.stack([torch.linspace(0, 1, 30, dtype=torch.float64)] * 3, 1)
    C = estimate_covariances(line, k=5)
    assert torch.equal(C, torch.eye(3, dtype=torch.float64).expand_as(C))
    same = torch.ones(10, 3)
    C = estimate_covariances(same, k=4)
    assert torch.equal(C, torch.eye(3).expand_as(C))


def test_pointcloud_keeps_covariances(bunny, rng):
    C = estimate_covariances(bunny, k=10)
    cloud = PointCloud(bunny, covariances=C)
    assert torch.equal(cloud.covariances, C) and "covariances" in repr(cloud)
    assert torch.equal(cloud.select(torch.arange(5)).covariances, C[:5])
    assert cloud.to(dtype=torch.float64).covariances.dtype == torch.float64
    assert cloud.numpy()["covariances"].shape == (800, 3, 3)
    T = transforms.random_transform(30.0, 0.1, generator=rng)
    moved = cloud.transform(T)
    R = T[:3, :3]
    torch.testing.assert_close(moved.covariances.double(), R @ C.double() @ R.T, atol=1e-6,
                               rtol=0)
    # the covariances of the moved points are the moved covariances
    again = estimate_covariances(moved.points, k=10)
    ok = (again - moved.covariances).abs().amax((1, 2)) < 1e-3
    assert ok.float().mean() > 0.95
    with pytest.raises(ValueError, match="covariances"):
        PointCloud(bunny, covariances=C[:10])
    bad = C.clone()
    bad[3, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="covariances"):
        PointCloud(bunny, covariances=bad)


def test_bad_input(bunny):
    with pytest.raises(ValueError, match="empty"):
        estimate_covariances(torch.zeros(0, 3))
    nan = bunny.clone()
    nan[5, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        estimate_covariances(nan)
    with pytest.raises(ValueError, match="fewer than k"):
        estimate_covariances(bunny[:10], k=20)
    with pytest.raises(ValueError, match="k"):
        estimate_covariances(bunny, k=2)
    with pytest.raises(ValueError, match="eps"):
        estimate_covariances(bunny, eps=0.0)
    with pytest.raises(ValueError, match="index"):
        estimate_covariances(bunny, index=build_index(bunny[:100]))
    with pytest.raises(ValueError, match="neighbors"):
        estimate_covariances(bunny, neighbors=torch.zeros(5, 3, dtype=torch.int64))
    with pytest.raises(TypeError):
        estimate_covariances("points")
