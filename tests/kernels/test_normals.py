"""kernels.features.pca_normals (PCA normals of neighbourhoods) against the reference
``pca_normals_reference`` (``kernels/features/reference.py``), by backend.

The reference computes the covariance in the points' dtype and the closed-form smallest
eigenvector in float64; the numba and Triton kernels compute both in float64 in one pass,
so normals agree to about the float32 input's rounding over the eigen-gap: 2e-3 (float32)
or 1e-8 (float64) for at least 99 % of the rows; the rest are neighbourhoods with a repeated
smallest eigenvalue, where any unit vector orthogonal to the largest's axis is a normal.
(The chain radius search → normals → FPFH on real scans: ``test_fpfh.py``; the closed-form
solver itself: ``tests/features/test_normals.py`` and ``tests/test_math.py``.)
"""

from __future__ import annotations

import pytest
import torch

from pointalign.kernels import features
from pointalign.kernels.features import cpu as _features_cpu
from pointalign.kernels.features.reference import neighbour_covariances
from pointalign.kernels.knn import knn_reference
from tests._backends import backends

#: the numba kernel's own cases: the "cpu" backend only (skipped without numba)
cpu_only = backends("cpu")


def _case(seed: int, dtype: torch.dtype, scan: torch.Tensor):
    """A bunny subsample with random points, a flat patch, a collapsed neighbourhood and
    holes in the k = 12 neighbour table (one row without any neighbour); a viewpoint."""
    g = torch.Generator().manual_seed(seed)
    pts = torch.cat([scan[::10].to(dtype), torch.randn(300, 3, generator=g, dtype=dtype)])
    pts[-50:, 2] = 0  # a flat patch: a simple smallest eigenvalue, normal +-z
    pts[-60:-50] = pts[-60]  # a collapsed neighbourhood: repeated eigenvalues
    idx = knn_reference(pts, pts, 12)[1]
    idx[::7, -3:] = -1
    idx[5] = -1  # no neighbour at all
    return pts, idx, torch.tensor([0.3, -1.0, 2.0], dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pca_normals_match_reference(backend, seed, dtype, bunny_scans):
    """The dispatcher on every backend (with and without a viewpoint, with centres)."""
    pts, idx, vp = _case(seed, dtype, bunny_scans[1])
    dev = backend.device
    for view in (None, vp):
        ref = features.pca_normals_reference(pts, idx, view)
        got = features.pca_normals(pts.to(dev), idx.to(dev),
                                   None if view is None else view.to(dev))
        assert got.device.type == dev and got.dtype == dtype
        got = got.cpu()
        torch.testing.assert_close(got.norm(dim=1), torch.ones(len(pts), dtype=dtype))
        close = (got - ref).norm(dim=1) <= (2e-3 if dtype == torch.float32 else 1e-8)
        assert close.float().mean() >= 0.99, close.float().mean()
    # rows of other points (centres): the flip faces the viewpoint from each centre
    sub = idx[::3]
    ref = features.pca_normals_reference(pts, sub, vp, pts[::3])
    got = features.pca_normals(pts.to(dev), sub.to(dev), vp.to(dev), centers=pts[::3].to(dev))
    close = (got.cpu() - ref).norm(dim=1) <= (2e-3 if dtype == torch.float32 else 1e-8)
    assert close.float().mean() >= 0.99, close.float().mean()


def test_reference_is_the_covariance_spec(rng):
    """pca_normals_reference: the smallest eigenvector of neighbour_covariances, flipped."""
    pts = torch.randn(200, 3, generator=rng, dtype=torch.float64)
    idx = knn_reference(pts, pts, 8)[1]
    cov = neighbour_covariances(pts, idx)
    n = features.pca_normals_reference(pts, idx)
    # C n = λ_min n, unit length, λ_min the smallest eigenvalue
    lam = torch.linalg.eigvalsh(cov)[:, 0]
    torch.testing.assert_close((cov @ n[:, :, None])[:, :, 0], lam[:, None] * n,
                               atol=1e-12, rtol=0)
    vp = torch.tensor([0.0, 0.0, 5.0], dtype=torch.float64)
    assert ((features.pca_normals_reference(pts, idx, vp) * (vp - pts)).sum(-1) >= 0).all()


def test_pca_normals_bad_shapes(backend):
    pts = torch.zeros(5, 3, device=backend.device)
    with pytest.raises(ValueError, match="pca_normals"):
        features.pca_normals(pts, torch.zeros(4, 2, dtype=torch.int64, device=backend.device),
                             centers=pts)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pca_normals_cpu_equals_reference(backend, seed, dtype, bunny_scans):
    pts, idx, vp = _case(seed, dtype, bunny_scans[1])
    for view in (None, vp):
        ref = features.pca_normals_reference(pts, idx, view)
        got = _features_cpu.pca_normals_cpu(pts, idx, view, pts)
        torch.testing.assert_close(got.norm(dim=1), torch.ones(len(pts), dtype=dtype))
        close = (got - ref).norm(dim=1) <= (2e-3 if dtype == torch.float32 else 1e-8)
        # a repeated smallest eigenvalue: any unit vector orthogonal to the largest's axis
        assert close.float().mean() >= 0.99, close.float().mean()
        assert torch.equal(features.pca_normals(pts, idx, view), got)


def _copies_case(dtype: torch.dtype):
    """60 random points, one with three copies and a pair of two; a row without neighbours."""
    pts = torch.rand(60, 3, generator=torch.Generator().manual_seed(3), dtype=dtype)
    pts[[10, 11, 12]] = pts[3].clone()
    pts[21] = pts[20].clone()
    idx = knn_reference(pts, pts, 4)[1]
    idx[40] = -1
    return pts, idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_copy_rows_finds_exact_copies(backend, dtype):
    """copy_rows: exactly the rows with a copy (their two nearest are at their coordinates),
    the reference's answer; fewer than two columns is a ValueError."""
    pts, idx = (t.to(backend.device) for t in _copies_case(dtype))
    got = features.copy_rows(pts, idx, pts)
    assert got.dtype == torch.bool
    assert torch.nonzero(got).flatten().tolist() == [3, 10, 11, 12, 20, 21]
    assert torch.equal(got, features.copy_rows_reference(pts, idx, pts))
    assert not features.copy_rows(pts[:30], idx[:30, :2].clamp_max(29), pts[:30] + 1).any()
    with pytest.raises(ValueError, match="copy_rows"):
        features.copy_rows(pts, idx[:, :1], pts)
    with pytest.raises(ValueError, match="copy_rows"):
        features.copy_rows(pts, idx, pts[:-1])
    with pytest.raises(ValueError, match="one device"):
        features.copy_rows(pts, idx.to("meta"), pts)
