"""The surface kernel family (``kernels/surface``): each entry point against its reference.

Every dispatcher test takes the ``backend`` fixture (torch, cpu, triton [gpu]): the tensors
live on ``backend.device`` and the dispatcher's answer is compared with the PyTorch
reference (:mod:`pointalign.kernels.surface.reference`) on the same inputs. The Triton
kernels also run on the CPU through the interpreter (a child process, tests/_interpreted.py).

Tolerances, by what each backend computes:

* "torch": the dispatcher runs the reference itself, on the same inputs in the same order:
  equal bits.
* "cpu" (numba): the Newton terms equal the float64 reference to 1e-9 of their scale where
  the moved points are the same (float64 points, or T = I: only the order of float64
  additions differs); float32 points moved by T to 1e-5 (the reference's float32 matrix
  product may round q one ulp away from the kernel's, relative 6e-8, which shows in the
  quadratic terms; a point would change cell only if it lay on a split plane). Node frames:
  means and radii to 1e-9 relatively; the frame's axes (as projectors ``e eᵀ``, signs are a
  convention) to 1e-6 where the eigenvalues are separated: the reference takes differences
  of prefix sums, the kernel centred sums, so they differ by the reference's rounding
  (which decides the axes of cells whose points coincide; those are left out).
* "triton": one float32 lane per point and float32 block sums (added in float64): the
  terms to 1e-4 of their scale (as the interpreter's), Horn's sums to 1e-4 of each
  column's scale with exact counts, the device's Horn solve to 1e-7 of LAPACK's on the
  same sums (the bounds of ``tests/kernels/test_normal_eq.py``). The node statistics and
  the cell-mean sums have no Triton kernel: the reference runs on the device, equal to
  itself up to the order of CUDA's float64 sums (1e-12). The end-to-end runs are held to
  the references on "torch" and "cpu" only (``_CREEPING``).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from pointalign import _math, datasets, transforms
from pointalign.kernels import normal_eq
from pointalign.kernels import surface as ks
from pointalign.registration import surface as rs
from pointalign.registration.surface.approximants import _curvatures, _fit_curvatures
from pointalign.search.kdtree import KDTreeIndex
from tests._interpreted import interpreted_fixture


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


def _close_terms(got: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    got, ref = got.cpu(), ref.cpu()
    scale = float(ref[:27].abs().max()) + 1e-300
    assert torch.allclose(got[:27], ref[:27], rtol=rtol, atol=rtol * scale)
    assert math.isclose(float(got[27]), float(ref[27]), rel_tol=rtol, abs_tol=1e-12)
    assert float(got[28]) == float(ref[28])


def _terms_as_promised(backend, got: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    """The dispatcher's terms against the reference's, to what ``backend`` promises."""
    assert got.shape == (ks.N_TERMS,) and got.dtype == torch.float64
    assert got.device.type == ref.device.type
    if backend.name == "torch":
        assert torch.equal(got, ref)
    elif backend.name == "cpu":
        _close_terms(got, ref, rtol)
    else:
        scale = float(ref.abs().max())
        assert torch.allclose(got.cpu(), ref.cpu(), rtol=1e-4, atol=1e-5 * scale)


# ---- the fused Newton terms ------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 7, 1000])
def test_newton_terms_equal_reference(seed, n, backend):
    g = torch.Generator().manual_seed(seed)
    dev = backend.device
    tgt = _surface(g, 1500)
    tree = KDTreeIndex(tgt.to(dev), leaf_size=4)
    co = rs.approximant_coefficients(tree, "plane")
    src = _surface(g, n) + 0.01 * torch.randn(n, 3, generator=g)
    T = _motion(g, 0.05, 0.02)
    center = torch.randn(3, generator=g, dtype=torch.float64) * 0.1
    w = torch.rand(n, generator=g)
    w[::3] = 0.0
    w = w.to(dev)
    eye = torch.eye(4, dtype=torch.float64)
    for dtype, pose, rtol in ((torch.float32, eye, 1e-9), (torch.float32, T, 1e-5),
                              (torch.float64, T, 1e-9)):
        # float32 points moved by T: the reference's float32 matrix product and the
        # kernel's float64 one rounded to float32 may differ by an ulp of q (relative
        # 6e-8), which shows in the terms at ~1e-6; with T = I both move nothing
        x = src.to(device=dev, dtype=dtype)
        cases = [(depth, math.inf, None, False) for depth in (0, 3)] + [
            (tree.depth, tau2, weights, obj) for tau2 in (math.inf, 1e-3)
            for weights in (None, w) for obj in (False, True)]
        for depth, tau2, weights, obj in cases:
            kw = {"weights": weights, "tau2": tau2, "objective_only": obj}
            ref = ks.newton_terms_reference(x, pose, center, tree.arrays, co, depth, **kw)
            got = ks.newton_terms(x, pose, center, tree.arrays, co, depth, **kw)
            _terms_as_promised(backend, got, ref, rtol)


def test_newton_terms_of_no_points_are_zero(backend):
    g = torch.Generator().manual_seed(5)
    tree = KDTreeIndex(_surface(g, 300).to(backend.device), leaf_size=8)
    co = rs.approximant_coefficients(tree, "plane")
    T = _motion(g, 0.02, 0.01)
    c = torch.zeros(3, dtype=torch.float64)
    e = ks.newton_terms(tree.points[:0], T, c, tree.arrays, co, tree.depth)
    assert torch.equal(e.cpu(), torch.zeros(ks.N_TERMS, dtype=torch.float64))


def test_newton_terms_cpu_threads(backend, monkeypatch):
    """The numba kernel's block split does not depend on the thread count."""
    if backend.name != "cpu":
        pytest.skip("a property of the numba kernel")
    from pointalign.kernels.surface import cpu as _surface_cpu

    g = torch.Generator().manual_seed(5)
    tgt = _surface(g, 3000)
    tree = KDTreeIndex(tgt, leaf_size=8)
    co = rs.approximant_coefficients(tree, "plane")
    src = tgt[::2] + 0.005
    T = _motion(g, 0.02, 0.01)
    c = torch.zeros(3, dtype=torch.float64)
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
    assert torch.equal(one, got)  # the dispatcher ran this kernel


def _terms_problem(g):
    tgt = datasets.random_subsample(datasets.load_bunny("bun000"), 900, int(g.initial_seed()))
    src = datasets.random_subsample(datasets.load_bunny("bun045"), 211, 7)
    tree = KDTreeIndex(tgt, leaf_size=4)
    T = transforms.random_transform(4.0, 0.01, generator=g)
    center = torch.tensor([0.01, 0.1, -0.02], dtype=torch.float64)
    return src, tree, T, center


@pytest.mark.parametrize("kind", ["point", "plane", "second_order"])
def test_newton_terms_match_float64_model(kind, rng):
    src, tree, T, o = _terms_problem(rng)
    co = rs.approximant_coefficients(tree, kind)
    depth = tree.depth - 1
    w = torch.rand(src.shape[0], generator=rng)
    F, g, h, n_in = ks.unpack(ks.newton_terms_reference(src, T, o, tree.arrays, co, depth,
                                                        weights=w))
    # independent NumPy float64: with the cells fixed, d̂² is quadratic in q and q(ξ) is
    # linear in ξ, so the model ξᵀFξ − 2gᵀξ + h is exact for q(ξ) = q + ω×(q−o) + τ
    Tf = T.float()
    q32 = src @ Tf[:3, :3].T + Tf[:3, 3]
    node = tree.descend(q32, depth)
    c = co[node].double().numpy()
    A = np.stack([c[:, [0, 1, 2]], c[:, [1, 3, 4]], c[:, [2, 4, 5]]], 1)
    q = q32.double().numpy()
    wn = w.double().numpy()
    assert n_in == src.shape[0]
    for _ in range(4):
        xi = np.random.default_rng(0).normal(size=6) * 1e-2
        qx = q + np.cross(xi[:3], q - o.numpy()) + xi[3:]
        d2 = np.einsum("ni,nij,nj->n", qx, A, qx) - 2 * (c[:, 6:9] * qx).sum(1) + c[:, 9]
        exact = float((wn * d2).sum())
        model = float(xi @ F.numpy() @ xi - 2 * g.numpy() @ xi + h)
        assert math.isclose(model, exact, rel_tol=1e-5, abs_tol=1e-12)


def test_newton_terms_truncation_and_objective_only(rng, backend):
    src, tree, T, o = _terms_problem(rng)
    # everything on the backend's device (the approximants go through its kernels)
    dtree = KDTreeIndex(tree.points.to(backend.device), leaf_size=4)
    dco = rs.approximant_coefficients(dtree, "plane")
    dsrc = src.to(backend.device)
    full = ks.newton_terms_reference(dsrc, T, o, dtree.arrays, dco, 5).cpu()
    tr = ks.newton_terms_reference(dsrc, T, o, dtree.arrays, dco, 5, tau2=1e-6).cpu()
    ob = ks.newton_terms_reference(dsrc, T, o, dtree.arrays, dco, 5, tau2=1e-6,
                                   objective_only=True).cpu()
    assert float(tr[28]) < float(full[28])
    assert float(tr[27]) <= float(full[27])
    assert torch.equal(ob[27:], tr[27:]) and (ob[:27] == 0).all()
    # the dispatcher against the reference on the same tree
    ref = full
    got = ks.newton_terms(dsrc, T, o, dtree.arrays, dco, 5).cpu()
    if backend.name == "triton":
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))
    else:
        assert torch.allclose(got, ref)


def run_interpreted_surface(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): the Triton Newton terms and cell-mean step."""
    from pointalign.kernels import _backend
    from pointalign.kernels.surface import triton as kt

    assert _backend.backend(torch.empty(0)) == "interpret"
    out: dict = {}
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        src, tree, T, o = _terms_problem(g)
        w = torch.rand(src.shape[0], generator=g)
        for kind in ("plane", "second_order"):
            co = rs.approximant_coefficients(tree, kind)
            for tau2 in (math.inf, 1e-5):
                for obj in (False, True):
                    out[(seed, kind, tau2, obj)] = kt.newton_terms(
                        src, T, o, tree.arrays, co, tree.depth, weights=w, tau2=tau2,
                        objective_only=obj)
    args, kw = _step_case(0, 300)
    out["step"] = ks.cell_mean_step(*args, **kw)  # the dispatcher's Triton branch
    torch.save(out, out_path)


interpreted = interpreted_fixture("tests.kernels.test_surface", "run_interpreted_surface")


@pytest.mark.parametrize("kind", ["plane", "second_order"])
def test_triton_interpreter_matches_reference(kind, interpreted):
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        src, tree, T, o = _terms_problem(g)
        w = torch.rand(src.shape[0], generator=g)
        co = rs.approximant_coefficients(tree, kind)
        for tau2 in (math.inf, 1e-5):
            for obj in (False, True):
                ref = ks.newton_terms_reference(src, T, o, tree.arrays, co, tree.depth,
                                                weights=w, tau2=tau2, objective_only=obj)
                got = interpreted[(seed, kind, tau2, obj)]
                scale = ref.abs().max()
                assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5 * float(scale))


# ---- node statistics: frames, moments, radii, quadric sums -------------------------------

def _prefix_bound(pts: torch.Tensor) -> float:
    """Rounding bound of a second moment from float64 prefix sums over ``pts (M, 3)``.

    A node's Σ p pᵀ is the difference of two prefix sums of up to M terms of size span²,
    each rounded to ~M ulps: 8 M ε span² covers both, with the division by the count and
    the subtraction of mean meanᵀ (each a few ulps of span²).
    """
    span = float(pts.double().abs().max())
    return 8 * pts.shape[0] * 2.0**-52 * span**2


def _projectors(frame: torch.Tensor) -> torch.Tensor:
    return frame.transpose(1, 2)[:, :, :, None] * frame.transpose(1, 2)[:, :, None, :]


@pytest.mark.parametrize("cloud", ["random", "surface", "bunny"])
def test_node_frames_equal_reference(seed, cloud, backend):
    g = torch.Generator().manual_seed(seed)
    if cloud == "random":
        pts = torch.randn(700, 3, generator=g) * torch.tensor([3.0, 1.0, 0.3]) + 50.0
    elif cloud == "surface":
        pts = _surface(g, 900)
    else:
        pts = datasets.random_subsample(datasets.load_bunny("bun000"), 1500, seed)
    tree = KDTreeIndex(pts.to(backend.device), leaf_size=3)  # nodes of < 5 points: parent's
    m0, f0, r0 = ks.node_frames_reference(tree.arrays, 5)
    m1, f1, r1 = ks.node_frames(tree.arrays, 5)
    assert torch.equal(m1.cpu(), rs.node_frames(tree)[0].cpu())  # the algorithm's entry
    m0, f0, r0, m1, f1, r1 = (t.cpu() for t in (m0, f0, r0, m1, f1, r1))
    assert m1.dtype == f1.dtype == r1.dtype == torch.float64
    assert m1.shape == m0.shape and f1.shape == f0.shape and r1.shape == r0.shape
    span = float(pts.double().abs().max())
    assert torch.allclose(m1, m0, rtol=0, atol=1e-12 * span)
    # the reference's radius of a cell of coincident points is its rounding noise
    assert torch.allclose(r1, r0, rtol=1e-9, atol=1e-6 * float(r0[0]))
    # frames where the node's (or, for small nodes, the frame donor's) spectrum is separated
    mom = ks.node_moments(tree.arrays)
    mom_ref = ks.node_moments_reference(tree.arrays)
    assert torch.allclose(mom[0].cpu(), m0, rtol=0, atol=1e-12 * span)
    cov = mom[1].cpu()
    # the reference's prefix sums of p pᵀ over M points round to ~M ulps of span²
    assert torch.allclose(cov, mom_ref[1].cpu(), rtol=0, atol=_prefix_bound(pts))
    ev = torch.linalg.eigvalsh(cov)
    sep = torch.minimum(ev[:, 1] - ev[:, 0], ev[:, 2] - ev[:, 1]) > 1e-4 * ev[:, 2]
    sizes = tree.node_sizes().cpu()
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
    # the same numbers as the library's closed-form eigen-solve on the backend's covariances
    _, V = _math.eigh3(cov)
    big = sizes >= 5
    assert torch.allclose(f1[big][:, :, 2], V[big][:, :, 0], atol=1e-9)
    assert torch.allclose(f1[big][:, :, 0], V[big][:, :, 2], atol=1e-9)


def test_node_radii_equal_reference(seed, backend):
    """The level schedule's cell radii: the RMS distance of each node's points to their mean."""
    pts = datasets.random_subsample(datasets.load_bunny("bun000"), 1500, seed)
    tree = KDTreeIndex(pts.to(backend.device), leaf_size=3)
    got = ks.node_radii(tree.arrays).cpu()
    ref = ks.node_radii_reference(tree.arrays).cpu()
    assert got.shape == (tree.n_nodes,) and got.dtype == torch.float64
    # prefix sums (reference) against centred sums (numba): the reference's Σ|p|²/n −
    # |mean|² carries the prefix sums' rounding (~M ulps of span²)
    assert torch.allclose(got ** 2, ref ** 2, rtol=1e-9, atol=_prefix_bound(pts))
    # the trace of the covariance: the radius of node_frames (Σ of the eigenvalues, each
    # clamped at 0). Smith's closed form keeps the sum (its middle eigenvalue is the trace
    # less the others) but, at a repeated eigenvalue (a leaf of collinear or coincident
    # points: the scan's repeated coordinates), finds the pair to ~sqrt(ε) of the spread
    # only, so a tiny negative one clamped adds up to ~sqrt(ε) of the node's radius²
    _, _, r = ks.node_frames_reference(tree.arrays, 5)
    assert torch.allclose(ref ** 2, r.cpu() ** 2, rtol=4 * 2.0**-26, atol=_prefix_bound(pts))


def test_quadric_sums_equal_reference(backend):
    """The second-order approximant's quadric fits: curvatures from the backend's sums."""
    pts = datasets.random_subsample(datasets.load_bunny("bun000"), 2000, 4)
    tree = KDTreeIndex(pts.to(backend.device), leaf_size=8)
    mean, frame, _ = ks.node_frames_reference(tree.arrays, 5)
    ne0, rhs0 = ks.quadric_sums_reference(tree.arrays, mean, frame)
    ne1, rhs1 = ks.quadric_sums(tree.arrays, mean, frame)  # every backend answers
    assert ne1.shape == (tree.n_nodes, 4, 4) and rhs1.shape == (tree.n_nodes, 4)
    assert ne1.dtype == rhs1.dtype == torch.float64
    if backend.name == "torch":
        assert torch.equal(ne1, ne0) and torch.equal(rhs1, rhs0)  # the reference itself
    elif backend.name == "triton":  # the reference again: CUDA's index_add_ may reorder
        assert torch.allclose(ne1, ne0, rtol=1e-12, atol=1e-12 * float(ne0.abs().max()))
        assert torch.allclose(rhs1, rhs0, rtol=1e-12, atol=1e-12 * float(rhs0.abs().max()))
    k0, d0 = (t.cpu() for t in _fit_curvatures(ne0, rhs0, tree.node_sizes(), frame))
    k1, d1 = (t.cpu() for t in _curvatures(tree, mean, frame))
    scale = float(k0.abs().max())
    assert scale > 0
    assert torch.allclose(k1, k0, rtol=1e-6, atol=1e-9 * scale)
    # principal directions where the curvatures differ (a direction is a projector)
    sep = (k0[:, 1] - k0[:, 0]).abs() > 1e-3 * scale
    P0 = d0[:, :, :, None].transpose(1, 2) * d0[:, :, None, :].transpose(1, 2)
    P1 = d1[:, :, :, None].transpose(1, 2) * d1[:, :, None, :].transpose(1, 2)
    assert sep.float().mean() > 0.5
    assert torch.allclose(P1[sep], P0[sep], atol=1e-6)


def test_node_frames_degenerate_cells(backend):
    # coincident points: the covariance is exactly 0 and the frame follows eigh3's rule
    # (a unit normal, a rotation); a line: the normal is perpendicular to it
    pts = torch.zeros(64, 3)
    pts[32:, 0] = torch.linspace(0, 1, 32)
    tree = KDTreeIndex(pts.to(backend.device), leaf_size=8)
    m, f, r = (t.cpu() for t in ks.node_frames(tree.arrays, 5))
    assert torch.isfinite(f).all() and torch.isfinite(r).all()
    eye = torch.eye(3, dtype=torch.float64)
    assert torch.allclose(f.transpose(1, 2) @ f, eye.expand_as(f), atol=1e-12)
    zero = r == 0
    assert zero.any()
    line = (tree.node_sizes().cpu() >= 5) & (r > 0)
    assert line.any()
    assert torch.allclose(f[line][:, 0, 2], torch.zeros(int(line.sum()), dtype=torch.float64),
                          atol=1e-12)


# ---- cell means: approximate ICP's step ---------------------------------------------------

def _close_sums(got: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    got, ref = got.cpu(), ref.cpu()
    scale = float(ref[:28].abs().max()) + 1e-300
    assert got.shape == (30,) and got.dtype == torch.float64
    assert torch.allclose(got[:28], ref[:28], rtol=rtol, atol=rtol * scale)
    assert float(got[28]) == float(ref[28])
    assert math.isclose(float(got[29]), float(ref[29]), rel_tol=rtol, abs_tol=1e-12)


@pytest.mark.parametrize("cloud", ["surface", "bunny"])
def test_cell_mean_sums_equal_reference(cloud, backend):
    """approximate_icp's fused sums: the same pairs and sums as the torch reference."""
    seed = 11
    g = torch.Generator().manual_seed(seed)
    if cloud == "surface":
        tgt = _surface(g, 1500)
        src = _surface(g, 900) + 0.01 * torch.randn(900, 3, generator=g)
    else:
        tgt = datasets.random_subsample(datasets.load_bunny("bun000"), 1500, seed)
        src = datasets.random_subsample(datasets.load_bunny("bun045"), 1000, seed)
    dev = backend.device
    tree = KDTreeIndex(tgt.to(dev), leaf_size=4)
    means = (tree.node_sums(tree.points) / tree.node_sizes()[:, None]).float()
    T = _motion(g, 0.05, 0.02)
    eye = torch.eye(4, dtype=torch.float64)
    center = means[0]
    d2 = float(((src.double() - src.double().mean(0)) ** 2).sum(-1).mean())
    for dtype, pose, rtol in ((torch.float32, eye, 1e-9), (torch.float32, T, 1e-5),
                              (torch.float64, T, 1e-9)):
        x = src.to(device=dev, dtype=dtype)
        for depth in (3, tree.depth):
            for tau2, c in ((math.inf, None), (0.05 * d2, center)):
                ref = ks.cell_mean_sums_reference(x, pose, tree.arrays, means, depth,
                                                  tau2=tau2, center=c)
                got = ks.cell_mean_sums(x, pose, tree.arrays, means, depth, tau2=tau2,
                                        center=c)
                if backend.name == "cpu":
                    _close_sums(got, ref, rtol)
                elif backend.name == "torch":
                    assert torch.equal(got, ref)
                else:  # no Triton kernel: the reference again (cuBLAS may reorder its sums)
                    _close_sums(got, ref, 1e-12)
                if math.isfinite(tau2) and depth == tree.depth:
                    assert 0 < float(ref[28]) < x.shape[0]  # the truncation was exercised


def _step_case(seed: int, n: int, device: str = "cpu"):
    """Arguments of one ``cell_mean_step`` on the bunny (1200-point target, n-point source)."""
    g = torch.Generator().manual_seed(seed)
    tgt = datasets.random_subsample(datasets.load_bunny("bun000"), 1200, seed)
    src = datasets.random_subsample(datasets.load_bunny("bun045"), n, seed + 1)
    tree = KDTreeIndex(tgt.to(device), leaf_size=8)
    means = (tree.node_sums(tree.points) / tree.node_sizes()[:, None]).float()
    T = (_motion(g, 0.05, 0.01) @ datasets.bunny_relative_pose("bun045", "bun000"))[None]
    T = T.to(device)
    args = (src.to(device)[None], means[None], T, T.float(), tree.arrays, tree.depth - 1)
    kw = {"tau2": 1e-4, "lengths": torch.tensor([n], device=device),
          "center": means[:1].contiguous(), "eps": 1e-10}
    return args, kw


def _step_as_promised(got, ref, args, kw, triton: bool) -> None:
    """A cell-mean step's outputs against the reference's (tolerances: module docstring)."""
    sums, D, Tn, Tf, flags = (t.cpu() for t in got)
    rsums, _, _, _, rflags = (t.cpu() for t in ref)
    assert sums.shape == (1, 30) and D.shape == Tn.shape == Tf.shape == (1, 4, 4)
    assert sums.dtype == D.dtype == Tn.dtype == torch.float64 and Tf.dtype == torch.float32
    assert flags.dtype == torch.int32 and torch.equal(flags, rflags)
    assert flags[0, 0] == 1  # a well-posed step
    assert float(sums[0, 28]) == float(rsums[0, 28])  # the same pairs
    assert 0 < float(rsums[0, 28]) < args[0].shape[1]  # the truncation was exercised
    # the solve of the backend's own sums
    Dr, Tr, flr = normal_eq.solve_update_reference(sums, kw["center"].cpu(), args[2].cpu(),
                                                   plane=False, eps=kw["eps"])
    assert torch.equal(flags, flr)
    if triton:
        scale = rsums.abs().amax(0, keepdim=True) + 1e-12
        assert torch.allclose(sums / scale, rsums / scale, rtol=0, atol=1e-4)
        torch.testing.assert_close(D, Dr, atol=1e-7, rtol=0)
        torch.testing.assert_close(Tn, Tr, atol=1e-7, rtol=0)
        torch.testing.assert_close(Tf, Tr.float(), atol=1e-6, rtol=1e-6)
    else:
        _close_sums(sums[0], rsums[0], 1e-5)  # float32 points moved by T (see the sums)
        assert torch.equal(D, Dr) and torch.equal(Tn, Tr) and torch.equal(Tf, Tr.float())


def test_cell_mean_step_equals_reference(seed, backend):
    """approximate_icp's whole step (partners, sums, Horn's solve): one kernel entry point."""
    args, kw = _step_case(seed, 800, backend.device)
    got = ks.cell_mean_step(*args, **kw)
    ref = ks.cell_mean_step_reference(*args, **kw)
    assert all(t.device.type == args[0].device.type for t in got)
    if backend.name == "torch":
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    _step_as_promised(got, ref, args, kw, triton=backend.name == "triton")


def test_triton_cell_mean_step_interpreted_matches_reference(interpreted):
    args, kw = _step_case(0, 300)
    ref = ks.cell_mean_step_reference(*args, **kw)
    _step_as_promised(interpreted["step"], ref, args, kw, triton=True)


# ---- end to end: each backend against the references ----------------------------------------

def _bunny_case():
    """bun045 -> bun000 subsamples, from 3° / 3 mm off the truth."""
    src = datasets.random_subsample(datasets.load_bunny("bun045"), 1000, 0)
    tgt = datasets.random_subsample(datasets.load_bunny("bun000"), 1500, 1)
    truth = datasets.bunny_relative_pose("bun045", "bun000")
    g = torch.Generator().manual_seed(3)
    init = _motion(g, math.radians(3), 0.003 / math.sqrt(3)) @ truth
    return src, tgt, init


def _newton(kind: str, device: str):
    src, tgt, init = _bunny_case()
    return rs.surface_newton(src, tgt, approximant=kind, init=init, device=device)


def _aicp(kind: str, device: str):
    src, tgt, init = _bunny_case()
    return rs.approximate_icp(src, tgt, init=init, device=device,
                              max_correspondence_distance=0.01)


_METHODS = {"newton": _newton, "aicp": _aicp}


@functools.cache
def _on_torch_backend(method: str, kind: str):
    """The "torch" backend's result of one case (the references), computed once a session."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POINTALIGN_BACKEND", "torch")
        return _METHODS[method](kind, "cpu")


#: why the end-to-end cases are not held to the references on "triton": on this partial
#: overlap (no truncation) the iterations creep (Newton plane's last steps 0.08°, point's
#: 0.9°; the cell-mean steps 0.7°), so float32 device sums that move one stop decision move
#: the pose by a step; the CUDA run is bounded against the CPU one on a pair both converge
#: on, in tests/registration/test_surface.py::test_cuda_matches_cpu
_CREEPING = "float32 device sums move a creeping iteration's stop (test_cuda_matches_cpu)"


def _angle(Ta: np.ndarray, Tb: np.ndarray) -> float:
    dR = Ta[:3, :3].T @ Tb[:3, :3]
    return math.acos(min(1.0, max(-1.0, (np.trace(dR) - 1) / 2)))


@pytest.mark.parametrize("kind", ["plane", "point", "second_order"])
def test_surface_newton_backend_equals_torch(kind, backend):
    """On a real subsample (bun045 -> bun000, from 3° / 3 mm off the truth), every backend."""
    if backend.name == "triton":
        pytest.skip(_CREEPING)
    a = _on_torch_backend("newton", kind)
    b = a if backend.name == "torch" else _newton(kind, backend.device)
    Ta, Tb = np.asarray(a.transformation), np.asarray(b.transformation)
    assert _angle(Ta, Tb) < 2e-5
    assert np.abs(Ta[:3, 3] - Tb[:3, 3]).max() < 2e-6  # metres; the bunny is ~0.15 m
    assert abs(float(a.rmse) - float(b.rmse)) <= 1e-4 * float(a.rmse)
    assert abs(int(a.iterations) - int(b.iterations)) <= 2


def test_approximate_icp_backend_equals_torch(backend):
    """Every backend, end to end, on a real subsample (bun045 -> bun000, 3° / 3 mm off)."""
    if backend.name == "triton":
        pytest.skip(_CREEPING)
    a = _on_torch_backend("aicp", "")
    b = a if backend.name == "torch" else _aicp("", backend.device)
    Ta, Tb = np.asarray(a.transformation), np.asarray(b.transformation)
    assert _angle(Ta, Tb) < 2e-5
    assert np.abs(Ta[:3, 3] - Tb[:3, 3]).max() < 2e-6
    assert int(a.iterations) == int(b.iterations)
    assert a.stop_reason == b.stop_reason and a.info["stalled"] == b.info["stalled"]
    assert abs(float(a.rmse) - float(b.rmse)) <= 1e-5 * float(a.rmse)
