"""kernels.features.fpfh (SPFH, the FPFH combine) against the reference, by backend; the
"cpu" backend's numba kernels (``features/fpfh_cpu.py``); the feature chain (radius
self-query → PCA normals → SPFH → FPFH) on every backend and through the Triton interpreter.

Exactness: SPFH bins are integer counts; the numba kernel equals the reference exactly in
float64; in float32 an angle within an ulp of a bin edge may fall in the neighbouring bin
(libm's ``atan2`` against PyTorch's), so at most a few rows differ, each by one pair moved to
an adjacent bin. The combine sums in another order: equal to 1e-4 relative. The fast α bins
are proved against ``atan2``'s (a polynomial with a stated error bound and a margin), so the
two SPFH paths of the kernel are equal bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pointalign import datasets
from pointalign.features.downsample import voxel_downsample
from pointalign.features.fpfh import neighbourhoods, restrict
from pointalign.kernels import features as KF
from pointalign.kernels import knn as KNN
from pointalign.kernels.features import fpfh as KP
from pointalign.kernels.features import fpfh_cpu as _fpfh_cpu
from pointalign.search import build_index
from tests._backends import backends
from tests._interpreted import interpreted_fixture
from tests._oracles import bumpy_sheet, self_table

#: the numba kernels' own cases: the "cpu" backend only (skipped without numba)
cpu_only = backends("cpu")

V = 0.012


def _cloud(dtype: torch.dtype) -> torch.Tensor:
    return voxel_downsample(datasets.load_bunny("bun000").to(dtype), V)


def _all_paths(pts: torch.Tensor) -> dict:
    """Every kernel entry point on ``pts`` (whatever backend is active)."""
    d, i = KNN.radius_neighbours(pts, 5 * V, 100)
    table = restrict(neighbourhoods(pts, 5 * V, 100, build_index(pts, "brute")), 2 * V, 30)
    vp = pts.mean(0)
    nrm = KF.pca_normals(pts, table, vp)
    none = KF.pca_normals(pts, torch.full((pts.shape[0], 4), -1, device=pts.device), None)
    h = KP.spfh(pts, nrm, i)
    return {"d": d, "i": i, "table": table, "nrm": nrm, "none": none, "spfh": h,
            "fpfh": KP.fpfh_combine(h, i, d)}


def _check_against_reference(got: dict, pts: torch.Tensor, *, bin_flips: int = 0) -> None:
    """The chain's every stage against its reference; ``bin_flips``: SPFH rows allowed one
    pair in a neighbouring bin (a float32 angle within an ulp of a bin edge)."""
    rd, ri = KNN.knn_reference(pts, pts, 100, (5 * V) ** 2)
    assert torch.equal(torch.isinf(got["d"]), torch.isinf(rd))
    fin = torch.isfinite(rd)
    torch.testing.assert_close(got["d"][fin], rd[fin], atol=1e-6, rtol=1e-5)
    assert float((got["i"] != ri).float().mean()) < 1e-3  # ties only
    ref_n = KF.pca_normals_reference(pts, got["table"], pts.mean(0))
    assert float((got["nrm"] * ref_n).sum(-1).min()) > 1 - 1e-5
    torch.testing.assert_close(got["none"], torch.tensor([[0.0, 0, 1]], dtype=pts.dtype)
                               .expand_as(got["none"]))
    ref_h = KP.spfh_reference(pts, got["nrm"], got["i"])
    rows = ((got["spfh"] - ref_h).abs() > 1e-3 + 1e-4 * ref_h.abs()).any(1)
    assert int(rows.sum()) <= bin_flips
    torch.testing.assert_close(got["spfh"][~rows], ref_h[~rows], atol=1e-3, rtol=1e-4)
    ref_f = KP.fpfh_combine_reference(ref_h, got["i"], got["d"])
    torch.testing.assert_close(got["fpfh"], ref_f, atol=1e-3, rtol=1e-4)


def run_interpreted_features(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): the kernels on small float32/64 clouds."""
    from pointalign.kernels import _backend

    assert _backend.backend(torch.empty(0)) == "interpret"
    from tests.kernels.test_normals import _copies_case

    out = {str(dt): _all_paths(_cloud(dt)) for dt in (torch.float32, torch.float64)}
    pts, idx = _copies_case(torch.float32)
    out["copies"] = KF.copy_rows(pts, idx, pts)
    torch.save(out, out_path)


interpreted = interpreted_fixture("tests.kernels.test_fpfh", "run_interpreted_features")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_triton_interpreter_matches_reference(interpreted, dtype):
    _check_against_reference(interpreted[str(dtype)], _cloud(dtype))


def test_triton_interpreter_copy_rows(interpreted):
    """The Triton copies check (features/triton.py) through the interpreter."""
    from tests.kernels.test_normals import _copies_case

    pts, idx = _copies_case(torch.float32)
    assert torch.equal(interpreted["copies"], KF.copy_rows_reference(pts, idx, pts))
    assert int(interpreted["copies"].sum()) == 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_feature_chain_matches_reference(backend, dtype):
    """Every kernel of the chain on each backend. The numba SPFH in float32 may move a pair
    to the neighbouring bin (libm's atan2 against PyTorch's; see the module docstring)."""
    pts = _cloud(dtype)
    got = {k: x.cpu() for k, x in _all_paths(pts.to(backend.device)).items()}
    flips = 3 if backend.name == "cpu" and dtype == torch.float32 else 0
    _check_against_reference(got, pts, bin_flips=flips)


# ---- the "cpu" backend's numba FPFH (features/fpfh_cpu.py) --------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@cpu_only
def test_spfh_and_combine_equal_reference(backend, dtype):
    p, n = bumpy_sheet(3, 900, dtype)
    d, i = self_table(p, 0.08, 40)
    i[::7, 5] = -1  # holes in the table
    h = _fpfh_cpu.spfh_cpu(p, n, i)
    ref = KP.spfh_reference(p, n, i)
    assert h.dtype == dtype and h.shape == (900, 33)
    rows = (h - ref).abs().amax(1) > 1e-3
    if dtype == torch.float64:
        torch.testing.assert_close(h, ref, atol=1e-9, rtol=1e-12)
    else:  # a bin-edge flip moves one pair: two bins change by 100 / #neighbours
        assert int(rows.sum()) <= 3
        torch.testing.assert_close(h[~rows], ref[~rows], atol=1e-4, rtol=1e-5)
    f = _fpfh_cpu.fpfh_combine_cpu(ref, i, d)
    torch.testing.assert_close(f, KP.fpfh_combine_reference(ref, i, d), atol=1e-3, rtol=1e-4)
    # a point without neighbours: zeros, as the reference
    lone = torch.full_like(i[:2], -1)
    assert torch.equal(_fpfh_cpu.spfh_cpu(p[:2], n[:2], lone), torch.zeros(2, 33, dtype=dtype))


@cpu_only
def test_atan2_polynomial_error_bound(backend):
    """The polynomial arctangent stays within 2e-6 rad: 40x inside ALPHA_MARGIN's budget."""
    ang = np.linspace(-math.pi, math.pi, 20001)
    for r in (1e-3, 1.0, 1e3):
        y, x = r * np.sin(ang), r * np.cos(ang)
        got = np.array([_fpfh_cpu._atan2_approx(a, b) for a, b in zip(y[::7], x[::7], strict=True)])
        assert np.abs(got - np.arctan2(y[::7], x[::7])).max() < 2e-6
    # the bound in bins, against the margin (the exact path's own error is < 1e-5 bin)
    assert 2e-6 * _fpfh_cpu.BINS / (2 * math.pi) < _fpfh_cpu.ALPHA_MARGIN / 50


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@cpu_only
def test_alpha_bin_equals_atan2_bin(backend, dtype, seed):
    """Fast α bins equal atan2's everywhere, next to the bin edges and at ±0 / ±π too."""
    g = np.random.default_rng(seed)
    edges = -math.pi + 2 * math.pi * np.arange(12) / 11
    ang = np.concatenate([g.uniform(-math.pi, math.pi, 3000),
                          (edges[:, None] + np.array([-1e-6, -1e-7, 0, 1e-7, 1e-6])).ravel()])
    r = g.uniform(1e-3, 10, ang.size)
    y, x = (r * np.sin(ang)).astype(dtype), (r * np.cos(ang)).astype(dtype)
    # rows nudged by single ulps around the edges; zeros of both signs; a NaN
    y = np.concatenate([y, np.nextafter(y[-60:], dtype(np.inf)), [0.0, -0.0, 0.0, -0.0, 1.0],
                        [np.nan, 0.0]]).astype(dtype)
    x = np.concatenate([x, x[-60:], [-1.0, -1.0, 0.0, -0.0, 0.0], [1.0, np.inf]]).astype(dtype)
    lo, span, nb = dtype(-math.pi), dtype(2 * math.pi), dtype(_fpfh_cpu.BINS)
    fast = [_fpfh_cpu._alpha_bin(a, b, lo, span, nb, False) for a, b in zip(y, x, strict=True)]
    exact = [_fpfh_cpu._alpha_bin(a, b, lo, span, nb, True) for a, b in zip(y, x, strict=True)]
    assert fast == exact
    assert exact[:3000] == [_fpfh_cpu._bin(dtype(math.atan2(a, b)), lo, span, nb)
                            for a, b in zip(y[:3000], x[:3000], strict=True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@cpu_only
def test_spfh_fast_alpha_equals_exact_atan2(backend, dtype):
    """The SPFH kernel's α shortcut changes no bin: equal to the all-atan2 run bit for bit."""
    p, n = bumpy_sheet(5, 1500, dtype)
    d, i = self_table(p, 0.1, 60)
    i[::5, 3] = -1
    pn, nn, inn = p.numpy(), n.numpy(), i.numpy()
    tol = pn.dtype.type(16 * np.finfo(pn.dtype).eps)
    fast, exact = (np.empty((1500, 33), pn.dtype) for _ in range(2))
    _fpfh_cpu._spfh(pn, nn, inn, tol, fast, False)
    _fpfh_cpu._spfh(pn, nn, inn, tol, exact, True)
    assert np.array_equal(fast, exact)
    assert np.array_equal(_fpfh_cpu.spfh_cpu(p, n, i).numpy(), exact)


@cpu_only
def test_fpfh_entry_points_use_cpu_kernels_on_a_real_scan(backend, monkeypatch):
    from pointalign.features.normals import estimate_normals
    from pointalign.kernels import _backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _backend.backend(torch.empty(0)) == "cpu"
    v = 0.008
    pts = voxel_downsample(datasets.load_bunny("bun000"), v)  # ~1,000 points
    nb = neighbourhoods(pts, 5 * v, 100, build_index(pts))
    nrm = estimate_normals(pts, neighbors=restrict(nb, 2 * v, 30), orient="viewpoint",
                           viewpoint=pts.mean(0))
    h = KP.spfh(pts, nrm, nb.idx)
    ref = KP.spfh_reference(pts, nrm, nb.idx)
    assert int(((h - ref).abs().amax(1) > 1e-3).sum()) <= 2
    f = KP.fpfh_combine(ref, nb.idx, nb.dists)
    torch.testing.assert_close(f, KP.fpfh_combine_reference(ref, nb.idx, nb.dists),
                               atol=1e-3, rtol=1e-4)
