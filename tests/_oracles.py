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


# ---- the ICP solve: NumPy host oracle (independent of pointalign._math) ------------------

_TRIU3 = [(i, j) for i in range(3) for j in range(i, 3)]
_TRIU6 = [(i, j) for i in range(6) for j in range(i, 6)]
#: ε of the degeneracy and rank rules (``pointalign._math.DEGENERACY_EPS``)
ORACLE_EPS = 1e-10


def _sym_np(v: np.ndarray, pairs, n: int) -> np.ndarray:
    M = np.zeros((v.shape[0], n, n))
    for q, (a, b) in enumerate(pairs):
        M[:, a, b] = v[:, q]
        M[:, b, a] = v[:, q]
    return M


def horn_matrix_np(S: np.ndarray) -> np.ndarray:
    """Horn's N(S) ``(B, 4, 4)`` from ``S (B, 3, 3)``, entry by entry (Horn 1987)."""
    (xx, xy, xz), (yx, yy, yz), (zx, zy, zz) = S[:, 0].T, S[:, 1].T, S[:, 2].T
    return np.stack([
        np.stack([xx + yy + zz, yz - zy, zx - xz, xy - yx], -1),
        np.stack([yz - zy, xx - yy - zz, xy + yx, zx + xz], -1),
        np.stack([zx - xz, xy + yx, yy - xx - zz, yz + zy], -1),
        np.stack([xy - yx, zx + xz, yz + zy, zz - xx - yy], -1)], -2)


def quat_to_rot_np(q: np.ndarray) -> np.ndarray:
    """Rotation matrices ``(B, 3, 3)`` of quaternions ``(B, 4)`` = (w, x, y, z)."""
    q = q / np.maximum(np.linalg.norm(q, axis=-1, keepdims=True), 1e-300)
    w, x, y, z = q.T
    return np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w),
                     2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w),
                     2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
                    -1).reshape(-1, 3, 3)


def rodrigues_np(w: np.ndarray) -> np.ndarray:
    """so(3) exponential of ``w (B, 3)`` (Taylor coefficients near 0)."""
    th2 = (w * w).sum(-1)[:, None, None]
    K = np.zeros((w.shape[0], 3, 3))
    K[:, 0, 1], K[:, 0, 2], K[:, 1, 2] = -w[:, 2], w[:, 1], -w[:, 0]
    K[:, 1, 0], K[:, 2, 0], K[:, 2, 1] = w[:, 2], -w[:, 1], w[:, 0]
    small = th2 < 1e-12
    safe = np.where(small, 1.0, np.sqrt(th2))
    a = np.where(small, 1 - th2 / 6, np.sin(safe) / safe)
    b = np.where(small, 0.5 - th2 / 24, (1 - np.cos(safe)) / (safe * safe))
    return np.eye(3) + a * K + b * (K @ K)


def spans_plane_np(cov: np.ndarray) -> np.ndarray:
    """Middle eigenvalue > ε × largest (``np.linalg.eigvalsh``): ``(B,)`` bool."""
    ev = np.linalg.eigvalsh(cov)
    return ev[:, 1] > ORACLE_EPS * np.maximum(ev[:, 2], 1e-300)


def icp_solve_np(sums: np.ndarray, plane: bool, c: np.ndarray):
    """NumPy oracle of the ICP update from the ``(B, 30)`` sums of ``kernels.normal_eq``.

    Point-to-point: Horn (top eigenvector of N(S) by ``np.linalg.eigh``), valid when W > 0
    and both centred covariances span a plane (eigenvalue form). Point-to-plane: eigen
    pseudo-inverse of the 6×6 equalised by block (least-norm step when rank-deficient),
    Rodrigues. Un-centred about c. Returns ``(D (B, 4, 4), valid (B,), usable (B,))``.
    """
    B = sums.shape[0]
    if plane:
        A = _sym_np(sums[:, :21], _TRIU6, 6)
        # rotations and translations equalised by their blocks' mean diagonals
        tr = np.stack([np.trace(A[:, :3, :3], axis1=1, axis2=2),
                       np.trace(A[:, 3:, 3:], axis1=1, axis2=2)], 1) / 3
        d = np.repeat(np.where(tr > 0, 1 / np.sqrt(np.maximum(tr, 1e-300)), 1.0), 3, axis=1)
        ev, V = np.linalg.eigh(d[:, :, None] * A * d[:, None, :])
        keep = ev > ORACLE_EPS * np.maximum(ev[:, -1:], 1e-300)
        inv = np.where(keep, 1.0 / np.maximum(ev, 1e-300), 0.0)
        g = -(d * sums[:, 21:27])[:, :, None]
        xi = d * (V @ (inv[:, :, None] * (V.transpose(0, 2, 1) @ g)))[:, :, 0]
        usable = np.isfinite(xi).all(-1) & keep.any(-1)
        xi = np.where(usable[:, None], xi, 0.0)
        valid = keep.all(-1) & usable
        R, t = rodrigues_np(xi[:, :3]), xi[:, 3:]
    else:
        W = sums[:, 0]
        sx, sy = sums[:, 1:4], sums[:, 4:7]
        Wd = np.maximum(W, 1e-300)[:, None]
        xm, ym = sx / Wd, sy / Wd
        S = sums[:, 7:16].reshape(B, 3, 3) - W[:, None, None] * (xm[:, :, None] * ym[:, None, :])
        cov_x = _sym_np(sums[:, 16:22], _TRIU3, 3) - sx[:, :, None] * sx[:, None, :] / Wd[..., None]
        cov_y = _sym_np(sums[:, 22:28], _TRIU3, 3) - sy[:, :, None] * sy[:, None, :] / Wd[..., None]
        R = quat_to_rot_np(np.linalg.eigh(horn_matrix_np(S))[1][:, :, -1])
        t = ym - (R @ xm[:, :, None])[:, :, 0]
        valid = (W > 0) & spans_plane_np(cov_x) & spans_plane_np(cov_y)
        valid &= np.isfinite(R).all((-1, -2)) & np.isfinite(t).all(-1)
        R = np.where(valid[:, None, None], np.nan_to_num(R), np.eye(3))
        t = np.where(valid[:, None], np.nan_to_num(t), 0.0)
        usable = valid
    D = np.tile(np.eye(4), (B, 1, 1))
    D[:, :3, :3] = R
    D[:, :3, 3] = t + c - (R @ c[:, :, None])[:, :, 0]
    return D, valid, usable


def bumpy_sheet(seed: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A bumpy sheet ``(n, 3)`` with its unit normals (duplicates and a flat part)."""
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g, dtype=torch.float64)
    z = 0.1 * torch.sin(6 * xy[:, 0]) * torch.cos(4 * xy[:, 1])
    z[: n // 8] = 0.0  # flat: parallel normals, the tie rule of the pair features
    p = torch.cat([xy, z[:, None]], 1)
    dz = torch.stack([-0.6 * torch.cos(6 * xy[:, 0]) * torch.cos(4 * xy[:, 1]),
                      0.4 * torch.sin(6 * xy[:, 0]) * torch.sin(4 * xy[:, 1])], 1)
    dz[: n // 8] = 0.0
    nrm = torch.cat([-dz, torch.ones(n, 1, dtype=torch.float64)], 1)
    nrm = nrm / nrm.norm(dim=1, keepdim=True)
    p[n - n // 10:] = p[: n // 10]  # exact duplicates: zero-distance pairs
    nrm[n - n // 10:] = nrm[: n // 10]
    return p.to(dtype), nrm.to(dtype)


def self_table(p: torch.Tensor, r: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every point's k nearest points within r (the PyTorch reference): ``dists, idx (n, k)``."""
    from pointalign.kernels.knn import knn_reference

    return knn_reference(p, p, k, r * r)
