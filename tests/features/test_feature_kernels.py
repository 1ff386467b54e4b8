"""Fused feature kernels (radius table, PCA normals, SPFH, FPFH combine) vs their references.

The Triton kernels run here through Triton's interpreter on CPU tensors (small clouds, in a
child process: see ``tests._interpreted``) and on CUDA when present.
"""

from __future__ import annotations

import pytest
import torch

from pointalign import datasets
from pointalign.features.downsample import voxel_downsample
from pointalign.features.fpfh import fpfh, neighbourhoods, restrict
from pointalign.features.normals import estimate_normals
from pointalign.kernels import features as KF
from pointalign.kernels import knn as KNN
from pointalign.kernels.features import fpfh as KP
from pointalign.search import build_index
from tests._interpreted import interpreted_fixture

V = 0.012


def _cloud(dtype: torch.dtype) -> torch.Tensor:
    return voxel_downsample(datasets.load_bunny("bun000").to(dtype), V)


def _all_paths(pts: torch.Tensor) -> dict:
    """Every kernel entry point on ``pts`` (whatever backend is active)."""
    d, i = KF.radius_neighbours(pts, 5 * V, 100)
    table = restrict(neighbourhoods(pts, 5 * V, 100, build_index(pts, "brute")), 2 * V, 30)
    vp = pts.mean(0)
    nrm = KF.pca_normals(pts, table, vp)
    none = KF.pca_normals(pts, torch.full((pts.shape[0], 4), -1, device=pts.device), None)
    h = KP.spfh(pts, nrm, i)
    return {"d": d, "i": i, "table": table, "nrm": nrm, "none": none, "spfh": h,
            "fpfh": KP.fpfh_combine(h, i, d)}


def _check_against_reference(got: dict, pts: torch.Tensor) -> None:
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
    torch.testing.assert_close(got["spfh"], ref_h, atol=1e-3, rtol=1e-4)
    ref_f = KP.fpfh_combine_reference(ref_h, got["i"], got["d"])
    torch.testing.assert_close(got["fpfh"], ref_f, atol=1e-3, rtol=1e-4)


def run_interpreted_features(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): the kernels on small float32/64 clouds."""
    from pointalign.kernels import _backend

    assert _backend.backend(torch.empty(0)) == "interpret"
    torch.save({str(dt): _all_paths(_cloud(dt)) for dt in (torch.float32, torch.float64)},
               out_path)


interpreted = interpreted_fixture("tests.features.test_feature_kernels", "run_interpreted_features")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_triton_interpreter_matches_reference(interpreted, dtype):
    _check_against_reference(interpreted[str(dtype)], _cloud(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_cuda_kernels_match_reference(dtype):
    pts = _cloud(dtype)
    got = {k: x.cpu() for k, x in _all_paths(pts.cuda()).items()}
    _check_against_reference(got, pts)


def test_radius_neighbours_reference_path_is_knn_tiles(seed, monkeypatch):
    # the reference (CPU kernels: test_cpu_kernels)
    monkeypatch.setenv("POINTALIGN_BACKEND", "torch")
    pts = torch.rand(300, 3, generator=torch.Generator().manual_seed(seed))
    d, i = KF.radius_neighbours(pts, 0.2, 40)
    rd, ri = KNN.knn_tiles(pts, pts, 40, 0.04)
    assert torch.equal(d, rd) and torch.equal(i, ri)


def test_shared_neighbourhoods_give_the_separate_results():
    pts = _cloud(torch.float64)
    idx = build_index(pts)
    nb = neighbourhoods(pts, 5 * V, 100, idx)
    sep = idx.radius(pts, 2 * V, 30)
    shared = restrict(nb, 2 * V, 30)
    assert torch.equal(shared, sep.idx)
    a = estimate_normals(pts, neighbors=shared, orient="viewpoint", viewpoint=pts.mean(0))
    b = estimate_normals(pts, radius=2 * V, max_neighbors=30, index=idx, orient="viewpoint",
                         viewpoint=pts.mean(0))
    torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    torch.testing.assert_close(fpfh(pts, radius=5 * V, normals=a, neighbors=nb),
                               fpfh(pts, radius=5 * V, normals=b, index=idx), atol=1e-9, rtol=0)


def test_bad_neighbors():
    pts = _cloud(torch.float32)
    with pytest.raises(ValueError, match="neighbors"):
        estimate_normals(pts, neighbors=torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="neighbors"):
        fpfh(pts, radius=0.05, neighbors=(torch.zeros(3, 4), torch.zeros(3, 4)))


def test_neighbour_tables_out_of_range_or_wrong_dtype():
    """A bad table is a clear ValueError, never an IndexError from inside the kernels."""
    from pointalign.search.base import KnnResult

    pts = _cloud(torch.float32)
    n = pts.shape[0]
    for bad, match in ((torch.full((n, 4), n, dtype=torch.int64), "in \\[0"),
                       (torch.full((n, 4), -2, dtype=torch.int64), "in \\[0"),
                       (torch.zeros(n, 4), "int64")):
        with pytest.raises(ValueError, match=match):
            estimate_normals(pts, neighbors=bad)
    with pytest.raises(ValueError, match="neighbors.idx"):
        fpfh(pts, radius=0.05,
             neighbors=KnnResult(torch.zeros(n, 4), torch.full((n, 4), n, dtype=torch.int64)))
