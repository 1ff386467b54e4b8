"""Exact brute-force k-nearest-neighbour search over tiles: ``knn_tiles`` and its reference.

Contract (shared by the PyTorch reference below and the Triton kernel in ``_knn_triton.py``):

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

The N x M distance matrix is never materialised beyond one tile. The brute force is the
"GPU naive" search of the CUDA ICP project (Sharma, CIS 565 Project 4), fused with a running
top-k as in PyTorch3D's ``knn_points``.
"""

from __future__ import annotations

import math

import torch

from pointalign.kernels._backend import backend

#: Largest k the Triton kernel keeps in registers; larger k runs the reference.
MAX_TRITON_K = 32

#: leaf size of the "cpu" backend's host tree (:func:`host_tree`): leaves of 16-32 points.
#: ICP on the bunny pair (40k, 1 thread, hinted nearest-within over 31 iterations):
#: 16 -> 32 (depth 12 -> 11) 5-10 % less search time for point-to-point and point-to-plane
#: and for the normals' k = 20 self-query; 64 is slower again (``benchmarks/bench_cpu.py``)
HOST_LEAF_SIZE = 32

#: Pairs per tile of the reference (memory is about 3 x this many elements).
_TILE_PAIRS = 1 << 22
#: the smallest tile the out-of-memory fallback of :func:`knn_tiles` tries
_MIN_TILE_PAIRS = 1 << 16


def _check(query: torch.Tensor, points: torch.Tensor, k: int,
           max_distance_sq: float | None) -> None:
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


def uses_host_tree(points: torch.Tensor) -> bool:
    """Tell whether searches over host ``points`` run on the "cpu" backend's k-d tree."""
    return backend(points) == "cpu"


def host_tree(points: torch.Tensor) -> object:
    """Return the "cpu" backend's k-d tree over host ``points (M, 3)``.

    The tree (``_knn_cpu.CpuTree``) has tight node boxes, hinted nearest-within and kNN;
    unhinted bounded nearest-within calls with many queries per point (RANSAC scoring) go
    through a per-bound cell grid (``_score_cpu.ScoringTree``; same answers).
    """
    from pointalign.kernels.ransac.score_cpu import ScoringTree

    return ScoringTree(points.detach().cpu().numpy(), leaf_size=HOST_LEAF_SIZE)


def points_layout(points: torch.Tensor) -> torch.Tensor | None:
    """Make the copy of ``points (M, 3)`` the fused kernel reads, for callers that keep it.

    ``(3, M)`` contiguous (structure of arrays) where the Triton path runs, else ``None``;
    pass it to :func:`knn_tiles` / :func:`radius_tiles` as ``points_t`` so that a query makes
    no copy of the points (one launch fewer per call).
    """
    if backend(points) in ("triton", "interpret"):
        return points.t().contiguous()
    return None


def knn_tiles(query: torch.Tensor, points: torch.Tensor, k: int,
              max_distance_sq: float | None = None, *,
              points_t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact k nearest ``points`` of every ``query`` row by tiled brute force.

    ``dists_sq[i, r]`` is the r-th smallest ``||query_i - points_j||^2`` over ``j`` (limited to
    values ``<= max_distance_sq`` when given) and ``idx[i, r] = j``.

    Args:
        query: ``(N, 3)`` float tensor.
        points: ``(M, 3)`` float tensor, same dtype and device as ``query``.
        k: neighbours per query, >= 1 (``k > M`` pads with ``inf`` / ``-1``).
        max_distance_sq: optional bound on the **squared** distance (inclusive).
        points_t: :func:`points_layout` of ``points`` when the caller keeps it (read by the
            Triton path; ignored by the reference).

    Returns:
        ``(dists_sq (N, k), idx (N, k) int64)``; see the module docstring for ties/padding.

    Only metadata is checked (no synchronisation): with ``k == 1`` on the Triton path a call
    is two allocations and one launch, safe inside CUDA-graph capture.

    Dispatch: Triton on CUDA (and under ``TRITON_INTERPRET=1``) for ``k <= 32``; the chunked
    PyTorch reference :func:`knn_reference` otherwise (also for ``k > 32`` on CUDA), whose
    tiles shrink fourfold on each out-of-memory error.

    """
    _check(query, points, k, max_distance_sq)
    n, m = query.shape[0], points.shape[0]
    if n == 0 or m == 0:
        return (torch.full((n, k), math.inf, dtype=query.dtype, device=query.device),
                torch.full((n, k), -1, dtype=torch.int64, device=query.device))
    be = backend(query)
    if be in ("triton", "interpret") and k <= MAX_TRITON_K:
        from pointalign.kernels.knn import triton as _knn_triton

        return _knn_triton.knn(query, points, k, max_distance_sq, points_t=points_t)
    # out of device memory: retry with tiles a quarter the size, down to 2^16 pairs
    tile = _TILE_PAIRS
    while True:
        try:
            return knn_reference(query, points, k, max_distance_sq, tile_pairs=tile)
        except torch.OutOfMemoryError:
            if tile <= _MIN_TILE_PAIRS:
                raise
            tile //= 4
            if query.is_cuda:
                torch.cuda.empty_cache()


def radius_tiles(query: torch.Tensor, points: torch.Tensor, radius: float, k: int, *,
                 points_t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``k`` nearest ``points`` within ``radius`` (not squared) of every ``query`` row.

    :func:`knn_tiles` with ``max_distance_sq = radius**2``, same results and padding. The
    self-query (``query`` is ``points``: the same memory, shape and strides; FPFH asks it)
    goes to :func:`pointalign.kernels.features.radius_neighbours`, whose Triton path has no
    cap on ``k`` (FPFH keeps 100 neighbours; :func:`knn_tiles` fuses only ``k <= 32``).
    """
    if query is points or (
            query.data_ptr() == points.data_ptr() and query.shape == points.shape
            and query.stride() == points.stride() and query.dtype == points.dtype
            and query.device == points.device):
        from pointalign.kernels.features import radius_neighbours

        return radius_neighbours(points, radius, k)
    return knn_tiles(query, points, k, float(radius) ** 2, points_t=points_t)


def _sort_rows(d: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row by (distance, index) with ``-1`` indices (missing) last."""
    key_i = torch.where(i < 0, torch.iinfo(torch.int64).max, i)
    o = torch.argsort(key_i, dim=1, stable=True)
    d, i = d.gather(1, o), i.gather(1, o)
    o = torch.argsort(d, dim=1, stable=True)
    return d.gather(1, o), i.gather(1, o)


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
                  tile_pairs: int = _TILE_PAIRS) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch reference of :func:`knn_tiles` (the CPU path and the spec).

    Tiles queries and points so at most ``tile_pairs`` distances exist at once; keeps a
    running top-k per query row, merged tile by tile with ``torch.topk`` (``torch.min`` for
    ``k == 1``, which keeps the first index on ties). Same arguments and results as
    :func:`knn_tiles`.
    """
    _check(query, points, k, max_distance_sq)
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
            kt = min(kk, d.shape[1])
            td, ti = torch.topk(d, kt, dim=1, largest=False, sorted=True)
            cd = torch.cat([best_d, td], dim=1)
            ci = torch.cat([best_i, ti + ps], dim=1)
            cd, ci = _sort_rows(cd, ci)  # earlier (smaller-index) candidates win equal distances
            best_d, best_i = cd[:, :kk], ci[:, :kk]
        best_i = torch.where(torch.isinf(best_d), torch.full_like(best_i, -1), best_i)
        out_d[qs:qs + bn, :kk] = best_d
        out_i[qs:qs + bn, :kk] = best_i
    return out_d, out_i
