"""kernels.stability.probe_information (the final pose's sampled point-to-plane information)
against its reference ``probe_information_reference`` (``kernels/stability/reference.py``),
by backend, and the fused path of ``registration.stability.point_information`` against its
index-based path.

The Triton kernel moves the sample with float32 FMAs where the reference multiplies a
float32 matrix, and sums float64 products of float32 inputs per block of rows: the searches
agree except on near-ties, the sums to ~1e-6 of their largest entry (the normals' float32
rounding over the eigen-gap, as in ``test_normals.py``), the counts exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pointalign.kernels import _backend, stability
from pointalign.kernels.knn.reference import knn_reference
from pointalign.kernels.stability.reference import (
    neighbourhood_information_reference,
    probe_information_reference,
)
from tests._interpreted import interpreted_fixture


def _case(seed: int, shared: bool = False):
    """Two problems over bumpy sheets (one ragged, one with a cluster of repeated points),
    a sample with padding, small poses, a bound that leaves some samples unmatched."""
    g = torch.Generator().manual_seed(seed)
    B, N, M, S = 2, 400, 300, 64
    src = torch.rand(B, N, 3, generator=g)
    src[..., 2] = 0.1 * torch.sin(6 * src[..., 0]) * torch.cos(5 * src[..., 1])
    tgt = torch.rand(B, M, 3, generator=g)
    tgt[..., 2] = 0.1 * torch.sin(6 * tgt[..., 0]) * torch.cos(5 * tgt[..., 1])
    tgt[0, 200:240] = tgt[0, 200]  # repeated points: neighbourhoods without a plane,
    src[0, :80] = tgt[0, 200]  # which a fifth of the first problem's sample finds
    counts = torch.tensor([M, M - 37])
    rows = torch.randint(N, (B, S), generator=g)
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[1, -9:] = False
    T = torch.eye(4).repeat(B, 1, 1)
    T[:, :3, 3] = 0.02 * torch.randn(B, 3, generator=g)
    c = torch.rand(B, 3, generator=g, dtype=torch.float64)
    if shared:
        tgt, counts = tgt[:1], counts[:1]
    return src, rows, valid, T, tgt, counts, c


CASES = [(0, False, 0.04), (1, True, 1e6), (2, False, 1e6)]


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape == (want.shape[0], stability.WIDTH)
    assert torch.equal(got[:, 21:], want[:, 21:])  # the counted and the flat samples
    torch.testing.assert_close(got[:, :21], want[:, :21], rtol=0,
                               atol=1e-6 * float(want[:, :21].abs().max()))


@pytest.mark.parametrize("seed,shared,bound", CASES)
def test_probe_matches_reference(backend, seed, shared, bound):
    args = [a.to(backend.device) for a in _case(seed, shared)]
    got = stability.probe_information(*args, bound * bound, 16).cpu()
    want = probe_information_reference(*_case(seed, shared), bound * bound, 16)
    _check(got, want)
    assert (want[:, 21] > 0).all() and want[0, 22] > 0  # counted and flat samples both occur


def test_reference_is_the_information_of_its_samples():
    """The reference against a direct float64 sum over the samples it counted (not itself):
    a problem whose every neighbourhood is the plane z = 0 has n = ±e_z."""
    g = torch.Generator().manual_seed(5)
    tgt = torch.rand(1, 500, 3, generator=g)
    tgt[..., 2] = 0
    src = tgt.clone()
    rows = torch.arange(500)[None]
    c = torch.zeros(1, 3, dtype=torch.float64)
    out = probe_information_reference(src, rows, torch.ones(1, 500, dtype=torch.bool),
                                      torch.eye(4)[None], tgt, torch.tensor([500]), c, 1.0, 8)
    y = tgt[0].double()
    n = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64).expand(500, 3)
    J = torch.cat([torch.linalg.cross(y, n), n], 1)
    torch.testing.assert_close(stability.information_matrix(out)[0], J.T @ J, rtol=1e-12,
                               atol=1e-9)
    assert out[0, 21] == 500 and out[0, 22] == 0


def _given_case(seed: int, shared: bool, bound: float):
    """``_case``'s problems with their searches made (brute force), as packed table rows:
    ``(table (R, 3), nearest (B, S), neighbours (B, S, 16), center (B, 3))``."""
    src, rows, valid, T, tgt, counts, c = _case(seed, shared)
    B, S = rows.shape
    M = tgt.shape[1]
    nearest = torch.full((B, S), -1, dtype=torch.int64)
    nb = torch.full((B, S, 16), -1, dtype=torch.int64)
    for b in range(B):
        tb = 0 if shared else b
        y_all = tgt[tb, : int(counts[tb])]
        x = src[b, rows[b]] @ T[b, :3, :3].T + T[b, :3, 3]
        j = knn_reference(x, y_all, 1, bound * bound)[1][:, 0]
        j = torch.where(valid[b], j, -1)
        nearest[b] = torch.where(j >= 0, j + tb * M, -1)
        r = knn_reference(y_all[j.clamp_min(0)], y_all, 16)[1]
        nb[b] = torch.where(r >= 0, r + tb * M, -1)
    return tgt.reshape(-1, 3), nearest, nb, c


def run_interpreted_stability(out_path: str) -> None:
    """Child-process body (TRITON_INTERPRET=1): the Triton probe through the dispatcher."""
    assert _backend.backend(torch.empty(0)) == "interpret"
    out = {case: stability.probe_information(*_case(case[0], case[1]), case[2] * case[2], 16)
           for case in CASES}
    out.update({("given", *case): stability.neighbourhood_information(*_given_case(*case))
                for case in CASES})
    torch.save(out, out_path)


interpreted = interpreted_fixture("tests.kernels.test_stability", "run_interpreted_stability")


@pytest.mark.parametrize("case", CASES, ids=[str(c[0]) for c in CASES])
def test_triton_interpreted_matches_reference(interpreted, case):
    seed, shared, bound = case
    _check(interpreted[case], probe_information_reference(*_case(seed, shared),
                                                           bound * bound, 16))


@pytest.mark.parametrize("case", CASES, ids=[str(c[0]) for c in CASES])
def test_given_searches_interpreted_match_reference(interpreted, case):
    """``neighbourhood_information`` (the searches given) equals its reference, and the
    probe's sums where the probe made the same searches."""
    got = interpreted[("given", *case)]
    want = neighbourhood_information_reference(*_given_case(*case))
    _check(got, want)
    _check(got, probe_information_reference(*_case(case[0], case[1]), case[2] * case[2], 16))
    assert (want[:, 21] > 0).all() and want[0, 22] > 0


@pytest.mark.parametrize("seed,shared,bound", CASES)
def test_given_searches_by_backend(backend, seed, shared, bound):
    """A Triton backend measures given searches in one kernel; the others return None."""
    args = [a.to(backend.device) for a in _given_case(seed, shared, bound)]
    got = stability.neighbourhood_information(*args)
    if backend.device == "cpu":
        assert got is None
        return
    _check(got.cpu(), neighbourhood_information_reference(*_given_case(seed, shared, bound)))


@pytest.mark.parametrize("bad", ["table", "nearest", "neighbours", "center"])
def test_given_searches_reject_bad_shapes(bad):
    """Shapes off the contract are a ValueError naming the function, on every backend."""
    args = dict(zip(("table", "nearest", "neighbours", "center"), _given_case(0, False, 0.04),
                    strict=True))
    args[bad] = args[bad][:, :5] if bad in ("nearest", "neighbours") else args[bad][..., :2]
    with pytest.raises(ValueError, match="neighbourhood_information"):
        stability.neighbourhood_information(**args)


def test_fused_point_information_equals_the_index_path(backend, bunny_scans):
    """registration.stability.point_information: brute-force indexes take the fused probe, any
    other index the search-by-search path; on a real scan pair both give one matrix."""
    from pointalign.registration import _edge
    from pointalign.registration import stability as measured
    from pointalign.search.brute import BruteForceIndex
    from pointalign.search.kdtree import KDTreeIndex

    src, tgt = (s[::8].to(backend.device) for s in bunny_scans)
    pair = _edge.prepare_pair(src, tgt, init=None, device=torch.device(backend.device))
    T = np.eye(4)[None]
    target = pair.target[0, : int(pair.target_counts[0])]
    fused = measured.point_information(pair, (BruteForceIndex(target),), T, 0.01)
    other = measured.point_information(pair, (KDTreeIndex(target),), T, 0.01)
    torch.testing.assert_close(fused, other, rtol=0, atol=1e-5 * float(other.abs().max()))
