"""Inputs and comparisons shared by the kernel family tests.

``same_neighbours`` is the comparison of two nearest-neighbour answers that may differ only
by rounding: indices equal the reference's except between points whose squared distances
differ by at most a few ulps (a brute force whose ``addcmul`` may fuse multiply-adds against
a tree that does not), distances equal to within that rounding.
"""

from __future__ import annotations

import numpy as np

#: unit roundoff-sized steps per dtype (a little above eps / 2)
ULP = {np.float32: 4e-7, np.float64: 1e-15}


def np_cloud(seed: int, n: int, dtype, dup: bool = True) -> np.ndarray:
    """``(n, 3)`` normal points; with ``dup``: exact duplicates and a flat sheet (ties)."""
    g = np.random.default_rng(seed)
    p = g.normal(size=(n, 3)).astype(dtype)
    if dup:  # exact duplicates and a flat sheet: ties by distance
        p[n // 2: n // 2 + n // 10] = p[: n // 10]
        p[: n // 5, 2] = 0
    return p


def same_neighbours(q, p, i_ref, i_got, d_ref, d_got, dtype) -> None:
    """Indices equal, or both at the same distance up to rounding (see the module doc)."""
    assert i_ref.shape == i_got.shape
    miss_ref, miss_got = i_ref < 0, i_got < 0
    fin = np.isfinite(d_ref) & np.isfinite(d_got)
    tol = 8 * ULP[dtype] * np.maximum(d_ref, 1e-30) + 1e-30
    # a point missing from one side only must sit at the bound (rounding)
    assert np.all(np.abs(d_ref[fin] - d_got[fin]) <= tol[fin])
    diff = (i_ref != i_got) & ~miss_ref & ~miss_got
    if diff.any():
        rows = np.nonzero(diff)[0]
        for r in np.unique(rows)[:50]:
            a = i_ref[r] if i_ref.ndim == 1 else i_ref[r][i_ref[r] != i_got[r]]
            b = i_got[r] if i_got.ndim == 1 else i_got[r][i_ref[r] != i_got[r]]
            qa = np.asarray(q[r], np.float64)
            da = ((p[np.atleast_1d(a)].astype(np.float64) - qa) ** 2).sum(-1)
            db = ((p[np.atleast_1d(b)].astype(np.float64) - qa) ** 2).sum(-1)
            assert np.allclose(da, db, rtol=16 * ULP[dtype], atol=1e-30)
    assert (miss_ref != miss_got).sum() <= max(1, miss_ref.size // 1000)
