"""The spec of the knn family: the contract, its constants and the plain PyTorch reference.

Contract of :func:`pointalign.kernels.knn.knn_tiles` (shared by :func:`knn_reference` here,
the Triton kernel in ``knn/triton.py`` and the "cpu" backend's tree in ``knn/cpu.py``):

* ``query (N, 3)`` and ``points (M, 3)``: float tensors of one dtype on one device.
* ``d_ij = ||q_i - p_j||^2`` computed from coordinate differences (no ``|q|^2 + |p|^2 - 2 q.p``
  expansion, which loses precision far from the origin).
* Returns ``dists_sq (N, k)`` in the input dtype, ascending along the last axis, and
  ``idx (N, k)`` int64 indices into ``points``. Slots without a neighbour (``k > M``, or no
  point with ``d_ij <= max_distance_sq``) hold ``inf`` / ``-1``; they are always at the end.
* Ties (equal distances): for ``k == 1`` both paths return the smallest index. For ``k > 1``
  the Triton kernel keeps the smallest indices; the reference returns each row sorted by
  ``(distance, index)`` but may keep a larger index at the k-th boundary. Compare distances,
  not indices, when points repeat.

The backends import this module, never their dispatcher (``knn/__init__.py``).
"""

from __future__ import annotations

import math

import torch

#: Largest k the Triton kernel keeps in registers; larger k runs the reference.
MAX_TRITON_K = 32

#: Pairs per tile of the reference (memory is about 3 x this many elements).
TILE_PAIRS = 1 << 22


def check(query: torch.Tensor, points: torch.Tensor, k: int,
          max_distance_sq: float | None) -> None:
    """Raise TypeError/ValueError naming the argument unless the inputs fit the contract."""
    if not isinstance(query, torch.Tensor) or not isinstance(points, torch.Tensor):
        raise TypeError("query, points: expected torch tensors")
    if query.dim() != 2 or query.shape[1] != 3:
        raise ValueError(f"query: expected shape (N, 3), got {tuple(query.shape)}")
    if points.dim() != 2 or points.shape[1] != 3:
        raise ValueError(f"points: expected shape (M, 3), got {tuple(points.shape)}")
    if not query.is_floating_point() or query.dtype != points.dtype:
        raise TypeError(
            f"query, points: expected one floating dtype, got {query.dtype} and {points.dtype}")
    if query.device != points.device:
        raise ValueError(
            f"query, points: on different devices ({query.device} and {points.device})")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k: expected an integer >= 1, got {k!r}")
    if max_distance_sq is not None and not (float(max_distance_sq) > 0):
        raise ValueError(f"max_distance_sq: must be > 0, got {max_distance_sq}")


def _sort_rows(d: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row of ``d, i (N, k)`` by (distance, index) with ``-1`` indices (missing) last."""
    key_i = torch.where(i < 0, torch.iinfo(torch.int64).max, i)
    o = torch.argsort(key_i, dim=1, stable=True)
    d, i = d.gather(1, o), i.gather(1, o)
    o = torch.argsort(d, dim=1, stable=True)
    return d.gather(1, o), i.gather(1, o)


def _tile_topk(d: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the ``k`` smallest of each row of ``d (n, m)`` by (value, column), and their columns.

    ``torch.topk`` alone may keep any of the columns that tie at the k-th value. One more
    value tells the rows where such ties reach past the k places (a tile of repeated
    points: every copy is equally near); there only, the places go to the smallest columns.
    """
    kk = min(k + 1, d.shape[1])
    td, ti = torch.topk(d, kk, dim=1, largest=False, sorted=True)
    if kk == k:  # every column kept
        return td, ti
    cross = (td[:, k] == td[:, k - 1]) & torch.isfinite(td[:, k - 1])
    td, ti = td[:, :k], ti[:, :k]
    if not bool(cross.any()):
        return td, ti
    rows = cross.nonzero().squeeze(1)
    sub, kth = d[rows], td[rows, k - 1:k]
    below = sub < kth
    tie = sub == kth
    take = below | (tie & (tie.cumsum(1) <= k - below.sum(1, keepdim=True)))
    col = torch.arange(d.shape[1], device=d.device).expand_as(sub)
    sel = torch.topk(torch.where(take, col, d.shape[1]), k, dim=1, largest=False,
                     sorted=True).indices
    td, ti = td.clone(), ti.clone()
    td[rows], ti[rows] = sub.gather(1, sel), sel
    return td, ti


def _sq_dists(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``(n, m)`` squared distances, coordinate by coordinate (two temporaries of the tile)."""
    d = (q[:, 0:1] - p[:, 0]).square_()
    t = torch.empty_like(d)
    for c in (1, 2):
        torch.sub(q[:, c:c + 1], p[:, c], out=t)
        d.addcmul_(t, t)
    return d


def knn_reference(query: torch.Tensor, points: torch.Tensor, k: int,
                  max_distance_sq: float | None = None, *,
                  tile_pairs: int = TILE_PAIRS) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch reference of :func:`knn_tiles` (the CPU path and the spec).

    Tiles queries and points so at most ``tile_pairs`` distances exist at once; keeps a
    running top-k per query row, merged tile by tile with ``torch.topk`` (``torch.min`` for
    ``k == 1``, which keeps the first index on ties). Same arguments and results as
    :func:`knn_tiles`.
    """
    check(query, points, k, max_distance_sq)
    n, m = query.shape[0], points.shape[0]
    dev, dt = query.device, query.dtype
    out_d = torch.full((n, k), math.inf, dtype=dt, device=dev)
    out_i = torch.full((n, k), -1, dtype=torch.int64, device=dev)
    if n == 0 or m == 0:
        return out_d, out_i
    kk = min(k, m)
    bm = max(1, min(m, tile_pairs))
    bn = max(1, min(n, tile_pairs // bm))
    for qs in range(0, n, bn):
        q = query[qs:qs + bn]
        best_d = torch.full((q.shape[0], kk), math.inf, dtype=dt, device=dev)
        best_i = torch.full((q.shape[0], kk), -1, dtype=torch.int64, device=dev)
        for ps in range(0, m, bm):
            p = points[ps:ps + bm]
            d = _sq_dists(q, p)  # (bn, bm)
            if max_distance_sq is not None:
                d = torch.where(d <= max_distance_sq, d, torch.full_like(d, math.inf))
            if kk == 1:
                md, mi = d.min(dim=1, keepdim=True)
                better = md < best_d
                best_d = torch.where(better, md, best_d)
                best_i = torch.where(better, mi + ps, best_i)
                continue
            td, ti = _tile_topk(d, min(kk, d.shape[1]))
            cd = torch.cat([best_d, td], dim=1)
            ci = torch.cat([best_i, ti + ps], dim=1)
            cd, ci = _sort_rows(cd, ci)  # earlier (smaller-index) candidates win equal distances
            best_d, best_i = cd[:, :kk], ci[:, :kk]
        best_i = torch.where(torch.isinf(best_d), torch.full_like(best_i, -1), best_i)
        out_d[qs:qs + bn, :kk] = best_d
        out_i[qs:qs + bn, :kk] = best_i
    return out_d, out_i
