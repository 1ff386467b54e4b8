"""Independent float64 oracles shared by the tests (SciPy, NumPy); never our own code."""

from __future__ import annotations

import numpy as np
import torch
from scipy.spatial import cKDTree


def _np64(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def knn_oracle(query, points, k: int, max_distance: float | None = None):
    """k nearest neighbours by SciPy cKDTree in float64.

    Returns ``(dists_sq (N, k) float64 with inf for none, idx (N, k) int64 with -1 for none)``;
    ``max_distance`` (not squared) keeps neighbours with distance <= max_distance.
    """
    q, p = _np64(query), _np64(points)
    n, m = q.shape[0], p.shape[0]
    kk = min(k, m)
    d = np.full((n, k), np.inf)
    idx = np.full((n, k), -1, dtype=np.int64)
    if n == 0:
        return d, idx
    bound = np.inf if max_distance is None else max_distance * (1 + 1e-12)
    dd, ii = cKDTree(p).query(q, k=kk, distance_upper_bound=bound)
    dd, ii = np.asarray(dd).reshape(n, kk), np.asarray(ii).reshape(n, kk)
    ok = ii < m
    d[:, :kk] = np.where(ok, dd**2, np.inf)
    idx[:, :kk] = np.where(ok, ii, -1)
    return d, idx


def assert_knn_matches(result, query, points, k: int, max_distance: float | None = None,
                       *, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Check a kNN result against :func:`knn_oracle` without relying on index order.

    * shapes ``(N, k)``, int64 indices, -1 exactly where the distance is inf;
    * every returned index is distinct per row and its true float64 squared distance equals
      the returned one (within tolerance);
    * the returned distances equal the oracle's k smallest (so ties/duplicates may pick any
      of the equally near points);
    * "no neighbour" agrees with the oracle except for points within tolerance of the bound.
    """
    dists, idx = result
    q, p = _np64(query), _np64(points)
    n = q.shape[0]
    assert tuple(dists.shape) == (n, k), dists.shape
    assert tuple(idx.shape) == (n, k), idx.shape
    assert idx.dtype == torch.int64
    d = dists.detach().cpu().to(torch.float64).numpy()
    i = idx.detach().cpu().numpy()
    missing = i < 0
    assert np.array_equal(missing, np.isinf(d)), "idx == -1 must coincide with inf distances"
    assert (i < p.shape[0]).all()
    assert np.all(np.diff(np.where(np.isinf(d), np.finfo(np.float64).max, d), axis=1) >= 0), \
        "distances must ascend"
    for row in range(n):
        got = i[row][i[row] >= 0]
        assert len(set(got.tolist())) == len(got), f"row {row}: repeated indices {got}"
    safe = np.where(missing, 0, i)
    true = ((q[:, None, :] - p[safe]) ** 2).sum(-1)
    tol = atol + rtol * np.abs(true)
    assert np.all(np.abs(np.where(missing, 0, true - d)) <= tol), "distance does not match idx"
    od, _ = knn_oracle(q, p, k, max_distance)
    both = np.isfinite(od) & np.isfinite(d)
    diff = np.where(both, od, 0) - np.where(both, d, 0)
    assert np.all(np.abs(diff) <= atol + rtol * np.abs(np.where(both, od, 0))), \
        "distances differ from the oracle's"
    disagree = np.isfinite(od) != np.isfinite(d)
    if disagree.any():
        assert max_distance is not None, "found/missing neighbours differ from the oracle"
        # only points on the boundary (within rounding) may be counted differently
        edge = np.where(np.isfinite(od), od, np.where(np.isfinite(d), d, 0))
        assert np.all(np.abs(edge[disagree] - max_distance**2) <= atol + rtol * max_distance**2)


def run_interpreted(module: str, function: str, out_path, monkeypatch) -> dict:
    """Run ``module.function(out_path)`` in a fresh Python with ``TRITON_INTERPRET=1``.

    Triton decides at import time whether its standard library is interpreted, so a process
    that already imported Triton for compiled kernels cannot interpret kernels; the Triton
    kernels' CPU tests therefore run in a child process and return tensors through
    ``torch.save``. Returns the saved dict.
    """
    import os
    import subprocess
    import sys

    pytest = __import__("pytest")
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("POINTALIGN_BACKEND", raising=False)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = f"import {module} as m; m.{function}({str(out_path)!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, env=dict(os.environ), timeout=600)
    assert proc.returncode == 0, f"interpreted run failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return torch.load(out_path)


def assert_same_or_tied(d, i, ref_d, ref_i, *, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    """Two kNN results agree: same inf pattern, close distances, and equal indices except at
    near-ties (fast paths may round a distance one ulp differently and swap two neighbours).

    A differing index at slot c is accepted when another reference slot of that row has the
    same distance within rounding, or when c is the last slot (its tied partner may lie just
    outside the k kept).
    """
    assert torch.equal(torch.isinf(d), torch.isinf(ref_d))
    fin = torch.isfinite(ref_d)
    assert torch.allclose(d[fin], ref_d[fin], atol=atol, rtol=rtol)
    k = d.shape[1]
    for r, c in (i != ref_i).nonzero().tolist():
        tol = atol + rtol * abs(float(d[r, c]))
        ties = int(((ref_d[r] - d[r, c]).abs() <= tol).sum())
        assert ties >= 2 or c == k - 1, \
            f"row {r}, slot {c}: index {int(i[r, c])} vs {int(ref_i[r, c])} without a tie"
