"""The "cpu" backend's distance-map kernels (numba) against the PyTorch references.

Tolerances: the Newton terms equal the float64 reference to 1e-9 of their scale where the
moved points are the same (float64 points, or T = I: only the order of float64 additions
differs); float32 points moved by T to 1e-5 (the reference's float32 matrix product may round
q one ulp away from the kernel's, relative 6e-8, which shows in the quadratic terms; a point
would change cell only if it lay on a split plane). Node frames:
means and radii to 1e-9 relatively; the frame's axes (as projectors ``e eᵀ``, signs are a
convention) to 1e-6 where the eigenvalues are separated: the reference takes differences of
prefix sums, the kernel centred sums, so they differ by the reference's rounding (which
decides the axes of cells whose points coincide; those are left out).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pointalign import datasets, transforms
from pointalign.kernels import _backend
from pointalign.kernels import surface as ks
from pointalign.registration import surface as rs
from pointalign.search.kdtree import KDTreeIndex

_knn_cpu = pytest.importorskip("pointalign.kernels.knn.cpu")
if not _backend.cpu_available():
    pytest.skip("numba is not installed", allow_module_level=True)
from pointalign.kernels.surface import cpu as _surface_cpu  # noqa: E402


def _surface(g: torch.Generator, n: int) -> torch.Tensor:
    """A wavy sheet with a flat part, exact duplicates and a few far points, float32."""
    uv = torch.rand(n, 2, generator=g) * 2 - 1
    z = 0.2 * torch.sin(3 * uv[:, 0]) * torch.cos(2 * uv[:, 1])
    p = torch.cat([uv, z[:, None]], 1)
    p[: n // 8, 2] = 0.0                      # a flat part
    p[n // 2: n // 2 + n // 20] = p[: n // 20]  # duplicates
    p[-3:] *= 4.0
    return p


def _motion(g: torch.Generator, angle: float, shift: float) -> torch.Tensor:
    axis = torch.randn(3, generator=g, dtype=torch.float64)
    T = torch.eye(4, dtype=torch.float64)
    T[:3, :3] = transforms.so3_exp(angle * axis / axis.norm())
    T[:3, 3] = shift * torch.randn(3, generator=g, dtype=torch.float64)
    return T


def _close_terms(got: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-9) -> None:
    scale = float(ref[:27].abs().max()) + 1e-300
    assert torch.allclose(got[:27], ref[:27], rtol=rtol, atol=rtol * scale)
    assert math.isclose(float(got[27]), float(ref[27]), rel_tol=rtol, abs_tol=1e-12)
    assert float(got[28]) == float(ref[28])


@pytest.mark.parametrize("n", [1, 7, 1000])
def test_newton_terms_equal_reference(seed, n):
    g = torch.Generator().manual_seed(seed)
    tgt = _surface(g, 1500)
    tree = KDTreeIndex(tgt, leaf_size=4)
    co = rs.approximant_coefficients(tree, "plane")
    src = _surface(g, n) + 0.01 * torch.randn(n, 3, generator=g)
    T = _motion(g, 0.05, 0.02)
    center = torch.randn(3, generator=g, dtype=torch.float64) * 0.1
    w = torch.rand(n, generator=g)
    w[::3] = 0.0
    eye = torch.eye(4, dtype=torch.float64)
    for dtype, pose, rtol in ((torch.float32, eye, 1e-9), (torch.float32, T, 1e-5),
                              (torch.float64, T, 1e-9)):
        # float32 points moved by T: the reference's float32 matrix product and the
        # kernel's float64 one rounded to float32 may differ by an ulp of q (relative
        # 6e-8), which shows in the terms at ~1e-6; with T = I both move nothing
        x = src.to(dtype)
        cases = [(depth, math.inf, None, False) for depth in (0, 3)] + [
            (tree.depth, tau2, weights, obj) for tau2 in (math.inf, 1e-3)
            for weights in (None, w) for obj in (False, True)]
        for depth, tau2, weights, obj in cases:
            kw = {"weights": weights, "tau2": tau2, "objective_only": obj}
            ref = ks.newton_terms_reference(x, pose, center, tree.arrays, co, depth, **kw)
            got = _surface_cpu.newton_terms_cpu(x, pose, center, tree.arrays, co, depth, **kw)
            _close_terms(got, ref, rtol)


def test_newton_terms_dispatch_and_threads(monkeypatch):
    g = torch.Generator().manual_seed(5)
    tgt = _surface(g, 3000)
    tree = KDTreeIndex(tgt, leaf_size=8)
    co = rs.approximant_coefficients(tree, "plane")
    src = tgt[::2] + 0.005
    T = _motion(g, 0.02, 0.01)
    c = torch.zeros(3, dtype=torch.float64)
    monkeypatch.setenv("POINTALIGN_BACKEND", "cpu")
    got = ks.newton_terms(src, T, c, tree.arrays, co, tree.depth)
    _close_terms(got, ks.newton_terms_reference(src, T, c, tree.arrays, co, tree.depth), 1e-5)
    # the block split does not depend on the thread count: the same bits with 1 or 2
    monkeypatch.setattr(_surface_cpu, "PARALLEL_MIN_POINTS", 0)
    import pointalign as pa
    from pointalign import _threads

    before = _threads._n  # None: the default (environment / all cores)
    try:
        pa.set_num_threads(1)
        one = _surface_cpu.newton_terms_cpu(src, T, c, tree.arrays, co, tree.depth)
        pa.set_num_threads(2)
        two = _surface_cpu.newton_terms_cpu(src, T, c, tree.arrays, co, tree.depth)
    finally:
        pa.set_num_threads(before)
    assert torch.equal(one, two)
    assert torch.equal(one, got)
    # empty input: the reference's zeros
    e = ks.newton_terms(src[:0], T, c, tree.arrays, co, tree.depth)
    assert torch.equal(e, torch.zeros(ks.N_TERMS, dtype=torch.float64))


def _projectors(frame: torch.Tensor) -> torch.Tensor:
    return frame.transpose(1, 2)[:, :, :, None] * frame.transpose(1, 2)[:, :, None, :]


@pytest.mark.parametrize("cloud", ["random", "surface", "bunny"])
def test_node_frames_equal_reference(seed, cloud, monkeypatch):
    g = torch.Generator().manual_seed(seed)
    if cloud == "random":
        pts = torch.randn(700, 3, generator=g) * torch.tensor([3.0, 1.0, 0.3]) + 50.0
    elif cloud == "surface":
        pts = _surface(g, 900)
    else:
        pts = datasets.random_subsample(datasets.load_bunny("bun000"), 1500, seed)
    tree = KDTreeIndex(pts, leaf_size=3)  # nodes of < 5 points take their parent's frame
    monkeypatch.setenv("POINTALIGN_BACKEND", "torch")
    m0, f0, r0 = rs.node_frames(tree)
    monkeypatch.setenv("POINTALIGN_BACKEND", "cpu")
    m1, f1, r1 = rs.node_frames(tree)
    assert m1.dtype == f1.dtype == r1.dtype == torch.float64
    assert m1.shape == m0.shape and f1.shape == f0.shape and r1.shape == r0.shape
    span = float(pts.double().abs().max())
    assert torch.allclose(m1, m0, rtol=0, atol=1e-12 * span)
    # the reference's radius of a cell of coincident points is its rounding noise
    assert torch.allclose(r1, r0, rtol=1e-9, atol=1e-6 * float(r0[0]))
    # frames where the node's (or, for small nodes, the frame donor's) spectrum is separated
    mom = ks.node_moments(tree.arrays)
    assert mom is not None
    ev = torch.linalg.eigvalsh(mom[1])
    sep = torch.minimum(ev[:, 1] - ev[:, 0], ev[:, 2] - ev[:, 1]) > 1e-4 * ev[:, 2]
    sizes = tree.node_sizes()
    donor = torch.arange(tree.n_nodes)
    for _ in range(tree.depth):
        donor = torch.where(sizes[donor] < 5, (donor - 1) // 2, donor)
    ok = sep[donor]
    assert ok.float().mean() > 0.5
    assert torch.allclose(_projectors(f1)[ok], _projectors(f0)[ok], atol=1e-6)
    # every frame is orthonormal, with the reference's handedness ((e1, e2, n) reverses
    # eigh3's ascending rotation)
    eye = torch.eye(3, dtype=torch.float64)
    assert torch.allclose(f1.transpose(1, 2) @ f1, eye.expand_as(f1), atol=1e-9)
    assert torch.allclose(torch.linalg.det(f1), torch.linalg.det(f0), atol=1e-9)
    # the same numbers as the library's closed-form eigen-solve on the kernel's covariances
    _, V = rs.symmetric_eigh3(mom[1])
    big = sizes >= 5
    assert torch.allclose(f1[big][:, :, 2], V[big][:, :, 0], atol=1e-9)
    assert torch.allclose(f1[big][:, :, 0], V[big][:, :, 2], atol=1e-9)


def test_quadric_sums_equal_reference(monkeypatch):
    """The second-order approximant's quadric fits: curvatures from the kernel's sums."""
    pts = datasets.random_subsample(datasets.load_bunny("bun000"), 2000, 4)
    tree = KDTreeIndex(pts, leaf_size=8)
    monkeypatch.setenv("POINTALIGN_BACKEND", "torch")
    mean, frame, _ = rs.node_frames(tree)
    assert ks.quadric_sums(tree.arrays, mean, frame) is None
    k0, d0 = rs._curvatures(tree, mean, frame)
    monkeypatch.setenv("POINTALIGN_BACKEND", "cpu")
    k1, d1 = rs._curvatures(tree, mean, frame)
    scale = float(k0.abs().max())
    assert scale > 0
    assert torch.allclose(k1, k0, rtol=1e-6, atol=1e-9 * scale)
    # principal directions where the curvatures differ (a direction is a projector)
    sep = (k0[:, 1] - k0[:, 0]).abs() > 1e-3 * scale
    P0 = d0[:, :, :, None].transpose(1, 2) * d0[:, :, None, :].transpose(1, 2)
    P1 = d1[:, :, :, None].transpose(1, 2) * d1[:, :, None, :].transpose(1, 2)
    assert sep.float().mean() > 0.5
    assert torch.allclose(P1[sep], P0[sep], atol=1e-6)


def test_node_frames_degenerate_cells():
    # coincident points: the covariance is exactly 0 and the frame follows eigh3's rule
    # (a unit normal, a rotation); a line: the normal is perpendicular to it
    pts = torch.zeros(64, 3)
    pts[32:, 0] = torch.linspace(0, 1, 32)
    tree = KDTreeIndex(pts, leaf_size=8)
    m, f, r = _surface_cpu.node_frames_cpu(tree.arrays, 5)
    assert torch.isfinite(f).all() and torch.isfinite(r).all()
    eye = torch.eye(3, dtype=torch.float64)
    assert torch.allclose(f.transpose(1, 2) @ f, eye.expand_as(f), atol=1e-12)
    zero = r == 0
    assert zero.any()
    line = (tree.node_sizes() >= 5) & (r > 0)
    assert line.any()
    assert torch.allclose(f[line][:, 0, 2], torch.zeros(int(line.sum()), dtype=torch.float64),
                          atol=1e-12)


@pytest.mark.parametrize("kind", ["plane", "point", "second_order"])
def test_surface_newton_cpu_equals_torch(kind, monkeypatch):
    """On a real subsample (bun045 -> bun000, from 3° / 3 mm off the truth), both backends."""
    src = datasets.random_subsample(datasets.load_bunny("bun045"), 1000, 0)
    tgt = datasets.random_subsample(datasets.load_bunny("bun000"), 1500, 1)
    truth = datasets.bunny_relative_pose("bun045", "bun000")
    g = torch.Generator().manual_seed(3)
    init = _motion(g, math.radians(3), 0.003 / math.sqrt(3)) @ truth
    out = {}
    for be in ("torch", "cpu"):
        monkeypatch.setenv("POINTALIGN_BACKEND", be)
        out[be] = rs.surface_newton(src, tgt, approximant=kind, init=init, device="cpu")
    a, b = out["torch"], out["cpu"]
    Ta, Tb = np.asarray(a.transformation), np.asarray(b.transformation)
    dR = Ta[:3, :3].T @ Tb[:3, :3]
    angle = math.acos(min(1.0, max(-1.0, (np.trace(dR) - 1) / 2)))
    assert angle < 2e-5
    assert np.abs(Ta[:3, 3] - Tb[:3, 3]).max() < 2e-6  # metres; the bunny is ~0.15 m
    assert abs(float(a.rmse) - float(b.rmse)) <= 1e-4 * float(a.rmse)
    assert abs(int(a.iterations) - int(b.iterations)) <= 2


def _close_sums(got: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    scale = float(ref[:28].abs().max()) + 1e-300
    assert got.shape == (30,) and got.dtype == torch.float64
    assert torch.allclose(got[:28], ref[:28], rtol=rtol, atol=rtol * scale)
    assert float(got[28]) == float(ref[28])
    assert math.isclose(float(got[29]), float(ref[29]), rel_tol=rtol, abs_tol=1e-12)


@pytest.mark.parametrize("cloud", ["surface", "bunny"])
def test_cell_mean_sums_equal_reference(cloud):
    """approximate_icp's fused step: the same pairs and sums as the torch reference."""
    seed = 11
    g = torch.Generator().manual_seed(seed)
    if cloud == "surface":
        tgt = _surface(g, 1500)
        src = _surface(g, 900) + 0.01 * torch.randn(900, 3, generator=g)
    else:
        tgt = datasets.random_subsample(datasets.load_bunny("bun000"), 1500, seed)
        src = datasets.random_subsample(datasets.load_bunny("bun045"), 1000, seed)
    tree = KDTreeIndex(tgt, leaf_size=4)
    means = (tree.node_sums(tree.points) / tree.node_sizes()[:, None]).float()
    T = _motion(g, 0.05, 0.02)
    eye = torch.eye(4, dtype=torch.float64)
    center = means[0]
    d2 = float(((src.double() - src.double().mean(0)) ** 2).sum(-1).mean())
    for dtype, pose, rtol in ((torch.float32, eye, 1e-9), (torch.float32, T, 1e-5),
                              (torch.float64, T, 1e-9)):
        x = src.to(dtype)
        for depth in (3, tree.depth):
            for tau2, c in ((math.inf, None), (0.05 * d2, center)):
                ref = ks.cell_mean_sums_reference(x, pose, tree.arrays, means, depth,
                                                  tau2=tau2, center=c)
                got = _surface_cpu.cell_mean_sums_cpu(x, pose, tree.arrays, means, depth,
                                                      tau2=tau2, center=c)
                _close_sums(got, ref, rtol)
                if math.isfinite(tau2) and depth == tree.depth:
                    assert 0 < float(ref[28]) < x.shape[0]  # the truncation was exercised


def test_approximate_icp_cpu_equals_torch(monkeypatch):
    """Both backends, end to end, on a real subsample (bun045 -> bun000, 3° / 3 mm off)."""
    src = datasets.random_subsample(datasets.load_bunny("bun045"), 1000, 0)
    tgt = datasets.random_subsample(datasets.load_bunny("bun000"), 1500, 1)
    truth = datasets.bunny_relative_pose("bun045", "bun000")
    g = torch.Generator().manual_seed(3)
    init = _motion(g, math.radians(3), 0.003 / math.sqrt(3)) @ truth
    out = {}
    for be in ("torch", "cpu"):
        monkeypatch.setenv("POINTALIGN_BACKEND", be)
        out[be] = rs.approximate_icp(src, tgt, init=init, device="cpu",
                                     max_correspondence_distance=0.01)
    a, b = out["torch"], out["cpu"]
    Ta, Tb = np.asarray(a.transformation), np.asarray(b.transformation)
    dR = Ta[:3, :3].T @ Tb[:3, :3]
    assert math.acos(min(1.0, max(-1.0, (np.trace(dR) - 1) / 2))) < 2e-5
    assert np.abs(Ta[:3, 3] - Tb[:3, 3]).max() < 2e-6
    assert int(a.iterations) == int(b.iterations)
    assert a.stop_reason == b.stop_reason and a.info["stalled"] == b.info["stalled"]
    assert abs(float(a.rmse) - float(b.rmse)) <= 1e-5 * float(a.rmse)
