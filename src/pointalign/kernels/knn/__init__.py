"""The knn family's dispatcher: exact brute-force kNN, radius queries, the radius self-query.

Entry points: :func:`knn_tiles`, :func:`radius_tiles`, :func:`radius_neighbours`,
:func:`radius_pair` (the self-query of two clouds at once) and :func:`radius_pair_at_width`
(the same from a table of a given width, without a host read).

The contract (shapes, padding, ties) and the PyTorch reference :func:`knn_reference` live in
``knn/reference.py``; the fused Triton kernels in ``knn/triton.py``; the "cpu" backend's k-d
tree in ``knn/cpu.py``.

* ``knn_tiles(query (N, 3), points (M, 3), k, max_distance_sq) -> (dists_sq (N, k),
  idx (N, k) int64)``: see :mod:`pointalign.kernels.knn.reference`.
* ``radius_neighbours(points (N, 3), radius, k) -> (dists_sq (N, k), idx (N, k) int64)``:
  the self-query of :meth:`~pointalign.search.base.Index.radius` by brute force: for every
  point, up to ``k`` nearest points (itself included) within ``radius``, ascending by
  (distance, index), padded with ``inf`` / ``-1``. Reference: :func:`knn_tiles` with the
  squared radius. The Triton path (any ``k``, where the Triton kNN kernel stops at 32)
  collects every point within the radius into a table in index order (one kernel, one host
  check of the largest count), then a stable sort by distance keeps the ``k`` nearest,
  smallest indices first among equal distances; the "cpu" backend asks its k-d tree.

The N x M distance matrix is never materialised beyond one tile. The brute force is the
"GPU naive" search of the CUDA ICP project (Sharma, CIS 565 Project 4), fused with a running
top-k as in PyTorch3D's ``knn_points``.
"""

from __future__ import annotations

import math

import torch

from pointalign.kernels._backend import backend
from pointalign.kernels.knn.reference import MAX_TRITON_K, knn_reference
from pointalign.kernels.knn.reference import TILE_PAIRS as _TILE_PAIRS
from pointalign.kernels.knn.reference import check as _check

#: leaf size of the "cpu" backend's host tree (:func:`host_tree`): leaves of 16-32 points.
#: ICP on the bunny pair (40k, 1 thread, hinted nearest-within over 31 iterations):
#: 16 -> 32 (depth 12 -> 11) 5-10 % less search time for point-to-point and point-to-plane
#: and for the normals' k = 20 self-query; 64 is slower again (``benchmarks/bench_cpu.py``)
HOST_LEAF_SIZE = 32

#: the smallest tile the out-of-memory fallback of :func:`knn_tiles` tries
_MIN_TILE_PAIRS = 1 << 16

#: largest neighbour table (rows × slots) the Triton radius search allocates; beyond it the
#: tiled kNN path is used
_MAX_TABLE_ENTRIES = 1 << 26


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
    goes to :func:`radius_neighbours`, whose Triton path has no cap on ``k`` (FPFH keeps 100
    neighbours; :func:`knn_tiles` fuses only ``k <= 32``).
    """
    if query is points or (
            query.data_ptr() == points.data_ptr() and query.shape == points.shape
            and query.stride() == points.stride() and query.dtype == points.dtype
            and query.device == points.device):
        return radius_neighbours(points, radius, k)
    return knn_tiles(query, points, k, float(radius) ** 2, points_t=points_t)


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _radius_table_sorted(points: torch.Tensor, r2: float, k: int, split: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Run the Triton path of :func:`radius_neighbours` (``split``: :func:`radius_pair`'s).

    One table kernel (its ``split`` form: two clouds at once), one host read of the widest
    row (of each cloud), a wider table where rows overflowed (for every cloud at once when
    they all need the same width, else for each such cloud alone, as it alone would have),
    then a stable sort by distance. None where a table would pass
    :data:`_MAX_TABLE_ENTRIES`.
    """
    from pointalign.kernels.knn import triton as _knn_triton

    n = points.shape[0]
    cap = max(_pow2(k), 64)
    if n * cap > _MAX_TABLE_ENTRIES:
        return None
    d, i, count = _knn_triton.radius_table(points, r2, cap, split=split)
    parts = [(0, n)] if split is None else [(0, split), (split, n)]
    widest = _widest(count, parts).tolist()  # the one host read
    if max(widest) <= cap:
        return _nearest(d, i, k)
    wider = {_pow2(w) for w in widest}
    if len(wider) == 1 and min(widest) > cap:  # every cloud needs the same wider table
        cap = wider.pop()
        if n * cap > _MAX_TABLE_ENTRIES:
            return None
        d, i, _ = _knn_triton.radius_table(points, r2, cap, split=split)
        return _nearest(d, i, k)
    out = []
    for (a, b), w in zip(parts, widest, strict=True):
        if w <= cap:
            out.append(_nearest(d[a:b], i[a:b], k))
            continue
        wide = _pow2(w)
        if (b - a) * wide > _MAX_TABLE_ENTRIES:
            return None
        dw, iw, _ = _knn_triton.radius_table(points[a:b], r2, wide)
        out.append(_nearest(dw, torch.where(iw >= 0, iw + a, iw), k))
    return torch.cat([x[0] for x in out]), torch.cat([x[1] for x in out])


def _widest(count: torch.Tensor, parts: list[tuple[int, int]]) -> torch.Tensor:
    """Each part's largest row count ``(len(parts),)``, on the device (no host read)."""
    return torch.stack([count[a:b].max() for a, b in parts])


def _nearest(d: torch.Tensor, i: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the ``k`` nearest of each row of a radius table ``(n, C)``.

    A stable sort by distance (index order breaks ties), padded with ``inf`` / ``-1`` past C.
    """
    d, order = torch.sort(d, dim=1, stable=True)
    i = i.gather(1, order)
    n, cap = d.shape
    if k <= cap:
        return d[:, :k].contiguous(), i[:, :k].contiguous()
    return (torch.cat([d, d.new_full((n, k - cap), math.inf)], 1),
            torch.cat([i, i.new_full((n, k - cap), -1)], 1))


def _check_pair(points: torch.Tensor, split: int, name: str) -> int:
    """Refuse a pair's points that are not ``(N, 3)`` or a split outside ``[1, N)``; N."""
    if not isinstance(points, torch.Tensor) or points.dim() != 2 or points.shape[1] != 3:
        shape = tuple(points.shape) if isinstance(points, torch.Tensor) else type(points)
        raise ValueError(f"{name}: points must be (N, 3), got {shape}")
    n = points.shape[0]
    if isinstance(split, bool) or not isinstance(split, int) or not 1 <= split < n:
        raise ValueError(f"{name}: split must be an integer in [1, {n - 1}] (both clouds "
                         f"non-empty), got {split!r}")
    return n


def radius_pair(points: torch.Tensor, split: int, radius: float,
                k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`radius_neighbours` of two clouds at once, each searched within itself.

    Args:
        points: ``(N1 + N2, 3)`` float tensor, the two clouds one after the other.
        split: N1, where the second cloud starts (``1 <= split < N1 + N2``).
        radius: search radius (> 0, not squared).
        k: neighbours kept per point (>= 1).

    Returns:
        ``(dists_sq (N1 + N2, k), idx (N1 + N2, k) int64)``: every row equal to its cloud's
        own :func:`radius_neighbours` row, with the indices shifted into ``points`` (``-1``
        stays). On Triton one table for both (one host check instead of two); elsewhere,
        or where the table would be too large, the two searches.

    """
    _check_pair(points, split, "radius_pair")
    if backend(points) in ("triton", "interpret"):
        table = _radius_table_sorted(points, float(radius) ** 2, k, split=split)
        if table is not None:
            return table
    (d1, i1), (d2, i2) = (radius_neighbours(points[:split], radius, k),
                          radius_neighbours(points[split:], radius, k))
    return torch.cat([d1, d2]), torch.cat([i1, torch.where(i2 >= 0, i2 + split, i2)])


def radius_pair_at_width(points: torch.Tensor, split: int, radius: float, k: int,
                         width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`radius_pair` from a table ``width`` columns wide, with no host read.

    For a caller that runs the search inside a fixed device program and checks the width
    afterwards. Arguments as :func:`radius_pair`; ``width``: the table's columns (>= k).

    Returns:
        ``(dists_sq (N1 + N2, k), idx (N1 + N2, k) int64, widest (2,) int64)``, all on the
        points' device: ``widest`` holds each cloud's largest count of points within the
        radius. Every row equals :func:`radius_pair`'s where ``widest <= width`` (else search
        again with :func:`radius_pair`, which widens its table itself). Where the backend
        has no table (not Triton) or it would be too large: :func:`radius_pair`'s rows and
        ``widest`` 0.

    """
    n = _check_pair(points, split, "radius_pair_at_width")
    if isinstance(width, bool) or not isinstance(width, int) or width < k:
        raise ValueError(f"radius_pair_at_width: width must be an integer >= k = {k}, "
                         f"got {width!r}")
    if backend(points) in ("triton", "interpret") and n * width <= _MAX_TABLE_ENTRIES:
        from pointalign.kernels.knn import triton as _knn_triton

        d, i, count = _knn_triton.radius_table(points, float(radius) ** 2, width, split=split)
        return (*_nearest(d, i, k), _widest(count, [(0, split), (split, n)]))
    return (*radius_pair(points, split, radius, k),
            torch.zeros(2, dtype=torch.int64, device=points.device))


def radius_neighbours(points: torch.Tensor, radius: float,
                      k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``k`` nearest points within ``radius`` of every point (the radius self-query).

    Args:
        points: ``(N, 3)`` float tensor (queries and data: a self-query).
        radius: search radius (> 0, not squared).
        k: neighbours kept per point (>= 1).

    Returns:
        ``(dists_sq (N, k), idx (N, k) int64)``, see the module docstring.

    """
    if not isinstance(points, torch.Tensor) or points.dim() != 2 or points.shape[1] != 3:
        shape = tuple(points.shape) if isinstance(points, torch.Tensor) else type(points)
        raise ValueError(f"radius_neighbours: points must be (N, 3), got {shape}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"radius_neighbours: k must be an integer >= 1, got {k!r}")
    r2 = float(radius) ** 2
    n = points.shape[0]
    be = backend(points)
    if be in ("triton", "interpret") and n:
        table = _radius_table_sorted(points, r2, k)
        if table is not None:
            return table
    if be == "cpu" and n:
        from pointalign.kernels.knn.cpu import CpuTree

        dn, inn = CpuTree(points.detach().contiguous().numpy()).knn(
            points.detach().contiguous().numpy(), min(k, n), r2)
        d, i = torch.from_numpy(dn), torch.from_numpy(inn)
        if k > n:
            d = torch.cat([d, d.new_full((n, k - n), math.inf)], 1)
            i = torch.cat([i, i.new_full((n, k - n), -1)], 1)
        return d, i
    return knn_tiles(points, points, k, r2)
