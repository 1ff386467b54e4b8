"""Outlier removal: radius (isolated points) and statistical (far from their neighbours).

* :func:`radius_outlier_mask`: a point is kept when at least ``min_neighbors`` other points
  lie within ``radius`` of it (PCL's ``RadiusOutlierRemoval``, Open3D's
  ``remove_radius_outlier``). At a voxel-downsampled cloud's own scale (radius 1.5 voxels)
  every point of a sampled surface has several neighbours, while a stray point in empty
  space has none: this is the rule :func:`pointalign.register` applies by default.
* :func:`statistical_outlier_mask`: the mean distance of each point to its ``neighbors``
  nearest points is compared with the cloud's mean and standard deviation of that
  quantity; points beyond ``mean + std_ratio · std`` are dropped (Rusu et al. 2008; PCL's
  ``StatisticalOutlierRemoval``, Open3D's ``remove_statistical_outlier``).

Both take their neighbours from a :class:`~pointalign.search.base.Index` (built on the
points' device when none is given), so they run on the GPU through the same code as on the
CPU. They return a boolean mask; ``points[mask]`` is the cleaned cloud.

:func:`pointalign.register`'s stray points, at the scale of its voxel edge v:
:func:`stray_fraction` (a sample tells whether there are any), :func:`dense_mask` (which
points to keep) and :func:`robust_voxel_size` (the automatic edge chosen without them).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pointalign import _threads, _validate
from pointalign._ops import run_totals
from pointalign.features.downsample import (
    CloudGroup,
    auto_voxel_size,
    auto_voxel_size_many,
    group_clouds,
    packed_grids,
)
from pointalign.kernels import upload
from pointalign.kernels.grid import cell_keys, count_within
from pointalign.kernels.grid.reference import CELL_MARGIN


def _index(points: torch.Tensor, index: Any) -> Any:
    if index is not None:
        return index
    from pointalign.search import build_index

    return build_index(points)


def neighbour_counts(index: Any, queries: torch.Tensor, radius: float, cap: int
                     ) -> torch.Tensor:
    """Count the indexed points within ``radius`` of each query, up to ``cap``: ``(Q,)`` int.

    ``queries (Q, 3)`` on the index's device; a query that is itself an indexed point counts
    itself (subtract 1 for "other points"). One ``radius`` search with ``cap`` columns.
    """
    return (index.radius(queries, radius, cap).idx >= 0).sum(1)


@_threads.per_call
@_validate.out_of_memory_is_clear
def radius_outlier_mask(points: Any, radius: float, min_neighbors: int = 2, *,
                        index: Any = None, device: str | torch.device | None = None
                        ) -> Any:
    """Tell which points have at least ``min_neighbors`` other points within ``radius``.

    Open3D's ``remove_radius_outlier(nb_points, radius)`` as a mask: ``cloud[mask]`` or
    ``cloud.select(mask)`` keeps the points it keeps (``nb_points`` counts the point
    itself: ``min_neighbors = nb_points - 1``).

    Args:
        points: ``(N, 3)`` float tensor / array, PointCloud or Open3D cloud.
        radius: search radius (> 0), same units as the points.
        min_neighbors: other points needed within ``radius`` (>= 1).
        index: optional prebuilt :class:`~pointalign.search.base.Index` over ``points``.
        device: compute device (default: the device of the points and the index, which
            must be one).
        num_threads: CPU threads for this call (:func:`pointalign.threads`).

    Returns:
        ``(N,)`` bool mask, True = keep, in the input's kind
        (:func:`pointalign._validate.kind`): NumPy for NumPy input or an Open3D cloud, a
        tensor on the device for a tensor or a PointCloud.

    """
    dev = _validate.resolve_device(device, points=points, index=index)
    pts = _validate.as_points(points, "points", device=dev)
    r = _validate.positive(radius, "radius")
    min_neighbors = _validate.integer(min_neighbors, "min_neighbors", minimum=1)
    k = min(min_neighbors + 1, pts.shape[0])  # the point itself is its own first neighbour
    keep = neighbour_counts(_index(pts, index), pts, r, k) >= min_neighbors + 1
    return _validate.as_kind(keep, _validate.kind(points))


@_threads.per_call
@_validate.out_of_memory_is_clear
def statistical_outlier_mask(points: Any, neighbors: int = 16, std_ratio: float = 2.0, *,
                             index: Any = None, device: str | torch.device | None = None
                             ) -> Any:
    """Tell which points lie no farther than usual from their ``neighbors`` nearest points.

    ``m_i`` = mean distance of point i to its ``neighbors`` nearest other points; a point is
    kept when ``m_i <= mean(m) + std_ratio · std(m)``.

    Open3D's ``remove_statistical_outlier(nb_neighbors, std_ratio)`` as a mask.

    Args:
        points: ``(N, 3)`` float tensor / array, PointCloud or Open3D cloud, N >= 2.
        neighbors: k (>= 1).
        std_ratio: threshold in standard deviations (> 0).
        index: optional prebuilt :class:`~pointalign.search.base.Index` over ``points``.
        device: compute device (default: the device of the points and the index, which
            must be one).
        num_threads: CPU threads for this call (:func:`pointalign.threads`).

    Returns:
        ``(N,)`` bool mask, True = keep, in the input's kind (as
        :func:`radius_outlier_mask`).

    """
    dev = _validate.resolve_device(device, points=points, index=index)
    pts = _validate.as_points(points, "points", min_points=2, device=dev)
    neighbors = _validate.integer(neighbors, "neighbors", minimum=1)
    ratio = _validate.positive(std_ratio, "std_ratio")
    k = min(neighbors + 1, pts.shape[0])
    nb = _index(pts, index).knn(pts, k)
    d = nb.dists[:, 1:].clamp_min(0).sqrt().to(torch.float64)  # column 0: the point itself
    m = d.mean(1)
    keep = m <= m.mean() + ratio * m.std(unbiased=False)
    return _validate.as_kind(keep, _validate.kind(points))


#: raw neighbours within one voxel edge: a point with fewer is a stray point ...
SPARSE_NEIGHBOURS = 4
#: ... provided the cloud's median point has at least this many (else it is too sparse
#: against the voxel to tell strays from surface: nothing is removed)
DENSE_MEDIAN = 8
#: outlier removal runs when a sample finds at least this fraction of stray points in either
#: cloud (5 % uniform outliers give about 4.5 %; the bunny scans about 0.1 %)
MIN_STRAY_FRACTION = 0.02


def dense_mask(points: torch.Tensor, v: float, index: Any = None) -> torch.Tensor:
    """Tell the points of ``points (N, 3)`` that lie in the dense part of the cloud at scale v.

    A point is kept when at least :data:`SPARSE_NEIGHBOURS` other points lie within ``v``
    of it. Outliers scattered through the bounding box have none at the voxel scale
    (measured on the hard-pair benchmark at 20 % outliers: 90 % of them have at most 3,
    while 99 % of surface points have at least 7), while a sampled surface, or a lidar ring
    whose spacing is well under the voxel, has many. When the median point has fewer than
    :data:`DENSE_MEDIAN` (an input already about as sparse as the voxel grid), the rule
    cannot tell the two apart and every point is kept. Returns an ``(N,)`` bool tensor.
    """
    if points.shape[0] <= SPARSE_NEIGHBOURS + 1:
        return torch.ones(points.shape[0], dtype=torch.bool, device=points.device)
    idx = _index(points, index)
    count = neighbour_counts(idx, points, v, min(2 * DENSE_MEDIAN + 1, points.shape[0])) - 1
    if float(count.float().median()) < DENSE_MEDIAN:
        return torch.ones(points.shape[0], dtype=torch.bool, device=points.device)
    return count >= SPARSE_NEIGHBOURS


def stray_fraction(points: torch.Tensor, v: float, sample: int = 4096,
                   index: Any = None) -> float:
    """Estimate the fraction of stray points in ``points (N, 3)`` at scale ``v``.

    Stray: fewer than :data:`SPARSE_NEIGHBOURS` others within ``v`` (the points
    :func:`dense_mask` would drop), from an evenly strided sample of at most ``sample``
    queries: one small search instead of one per point. ``index``: an index over
    ``points`` to search (default: one built for the bound ``v``).
    """
    n = points.shape[0]
    if n <= SPARSE_NEIGHBOURS + 1:
        return 0.0
    q = points[:: max(1, n // sample)]
    # a grid with cells of v: one sort to build, and a few thousand queries over 27 cells
    if index is None:
        from pointalign.search import build_index

        index = build_index(points, max_distance=v)
    count = neighbour_counts(index, q, v, SPARSE_NEIGHBOURS + 1) - 1
    return float((count < SPARSE_NEIGHBOURS).float().mean())


def robust_voxel_size(points: Any, target_points: int = 5000, *,
                      iterations: int = 2) -> float:
    """Voxel edge at which ``points (N, 3)`` without its stray points keeps ``target_points``.

    :func:`auto_voxel_size` counts every occupied voxel, so stray points (outliers spread
    through the bounding box, one voxel each) inflate the edge: 20 % uniform outliers on a
    bunny scan take it from 2.6 to 5.1 mm, and then make up more than half of the voxels.
    Here the edge is recomputed on the points :func:`dense_mask` keeps at the current edge
    (``iterations`` times; a clean cloud keeps its :func:`auto_voxel_size` edge).
    """
    pts = _validate.as_points(points, "points")
    v = auto_voxel_size(pts, target_points)
    for _ in range(iterations):
        keep = dense_mask(pts, v)
        n = int(keep.sum())
        if n == pts.shape[0] or n < 3:
            break
        v = auto_voxel_size(pts[keep], target_points)
    return v


def _mean_as_torch(count: int, n: int, device: torch.device) -> float:
    """``float(x.float().mean())`` of an ``(n,)`` 0/1 vector holding ``count`` ones.

    The sum is exact; the mean is rounded as PyTorch rounds it on the device: on the CPU
    ``sum / n`` in float32 (``mean_out``: ``sum_out(...).div_(n)``), on CUDA ``sum · (1/n)``
    with ``1/n`` a float32 factor (``mean_kernel_impl``'s ``MeanOps``). Host arithmetic.
    """
    s, m = np.float32(count), np.float32(n)
    return float(s * (np.float32(1.0) / m) if device.type == "cuda" else s / m)


def _arrays(group: CloudGroup, edges: Sequence[float]
            ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Upload ``group``'s tensors for :func:`_within_many` and its ``(C,)`` float64 edges."""
    c = len(group.sizes)
    flat = upload([h - o for lo, hi in zip(group.lo_h, group.hi_h, strict=True)
                   for o, h in zip(lo, hi, strict=True)] + [float(v) for v in edges],
                  dtype=torch.float64, device=group.points.device)
    return ({"points": group.points, "owner": group.owner, "lo": group.lo,
             "ext": flat[:3 * c].view(c, 3)}, flat[3 * c:])


def _within_many(arrays: Mapping[str, torch.Tensor], voxel_sizes: torch.Tensor,
                 q_rows: torch.Tensor, q_owner: torch.Tensor, cap: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Count the points within ``voxel_sizes[c]`` of each query row (the query included).

    ``arrays``: the group's ``points (P, 3)``, ``owner (P,)``, ``lo (C, 3)`` and ``ext
    (C, 3)`` (its corners' difference, float64) (:func:`_arrays`); ``voxel_sizes (C,)``
    float64 on the device.
    ``q_rows (Q,)``: rows of the points asked about; ``q_owner (Q,)``: their clouds. Each
    cloud is cut into its own cells of edge ``v (1 + CELL_MARGIN)`` (anchored at its own
    corner; the cells per axis ``(h - o) // edge + 1``, Python's float floor division),
    one sort orders every point by ``(cloud, cell)``, and
    :func:`~pointalign.kernels.grid.count_within` compares each query with the points of its
    cloud's 27 cells around it: ``dx² + dy² + dz² <= v²`` in the points' dtype on the
    cloud's own coordinates (the search contract of every index).
    Returns ``(Q,)`` int64 counts, exact below ``cap`` and ``cap`` elsewhere (a lidar
    scan's cells near the sensor hold hundreds of points: a query there stops comparing at
    ``cap``), and a 0-dim bool: the grids overflowed the packed key
    (:func:`~pointalign.features.downsample.packed_grids`), the counts are meaningless. No
    host synchronisation on a GPU.
    """
    points = arrays["points"]
    edges = voxel_sizes * (1 + CELL_MARGIN)
    dims, base, overflow = packed_grids(arrays["ext"], edges, -1)
    keys, cell = cell_keys(points, arrays["owner"], arrays["lo"], edges, dims, base,
                           divide=True)
    sorted_keys, order = torch.sort(keys)
    r2 = (voxel_sizes * voxel_sizes).to(points.dtype)                          # rounded to dt
    return count_within(sorted_keys, points[order], points[q_rows], cell[q_rows], q_owner,
                        dims, base, r2, cap), overflow


def stray_sample(group: CloudGroup, sample: int = 4096
                 ) -> tuple[dict[str, torch.Tensor], list[int]]:
    """:func:`stray_fraction`'s strided sample of every cloud of ``group``, in one upload.

    Rows 0, s, 2s, ... of each cloud with s = max(1, n // sample). Returns ``q_rows (Q,)``
    (rows of ``group.points``), ``q_owner (Q,)`` and ``cuts (C + 1,)`` (each cloud's
    queries in turn) int64 on the device, and each cloud's query count (host ints).
    """
    stride = [max(1, n // sample) for n in group.sizes]
    m = [-(-n // s) for n, s in zip(group.sizes, stride, strict=True)]
    first = list(itertools.accumulate(group.sizes, initial=0))[:-1]
    rows = np.concatenate([np.arange(f, f + n, s, dtype=np.int64)
                           for f, n, s in zip(first, group.sizes, stride, strict=True)])
    owner = np.repeat(np.arange(len(m), dtype=np.int64), m)
    cuts = np.asarray(list(itertools.accumulate(m, initial=0)), dtype=np.int64)
    flat = upload(np.concatenate([rows, owner, cuts]), dtype=torch.int64,
                  device=group.points.device)
    q = rows.shape[0]
    return {"q_rows": flat[:q], "q_owner": flat[q:2 * q], "cuts": flat[2 * q:]}, m


def stray_counts(arrays: Mapping[str, torch.Tensor], voxel_sizes: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each cloud's stray queries at its edge: ``(C,)`` int64 on the device, no host read.

    ``arrays``: :func:`_within_many`'s and :func:`stray_sample`'s tensors; a query is a
    stray with fewer than :data:`SPARSE_NEIGHBOURS` others within ``voxel_sizes[c]`` (each
    query stops counting there: not a stray). With :func:`_within_many`'s overflow flag.
    """
    within, overflow = _within_many(arrays, voxel_sizes, arrays["q_rows"], arrays["q_owner"],
                                    cap=SPARSE_NEIGHBOURS + 1)
    # fewer than SPARSE_NEIGHBOURS others (the count includes the query itself)
    return run_totals(within < SPARSE_NEIGHBOURS + 1, arrays["cuts"]), overflow


def stray_fractions_of(sizes: Sequence[int], strays: Sequence[int], queries: Sequence[int],
                       device: torch.device) -> list[float]:
    """Return the fractions :func:`stray_fraction` reports, from each cloud's stray count.

    ``sizes``: the clouds' sizes; ``strays``, ``queries``: :func:`stray_counts` and
    :func:`stray_sample`'s counts. Rounded as ``stray_fraction``'s mean
    (:func:`_mean_as_torch`).
    """
    return [0.0 if n <= SPARSE_NEIGHBOURS + 1 else _mean_as_torch(s, k, device)
            for n, s, k in zip(sizes, strays, queries, strict=True)]


def stray_fractions_many(group: CloudGroup, voxel_sizes: Sequence[float],
                         sample: int = 4096) -> list[float]:
    """:func:`stray_fraction` of every cloud of ``group``, cloud c at ``voxel_sizes[c]``.

    The same strided sample per cloud (:func:`stray_sample`) and the same test (fewer than
    :data:`SPARSE_NEIGHBOURS` others within v, squared distances ``dx² + dy² + dz²``
    computed in the points' dtype on each cloud's own coordinates and compared with ``v²``
    rounded to that dtype: the search contract of every index), answered for all clouds at
    once by :func:`stray_counts`. The counts are the per-cloud index's (on the CPU
    backends, which compute that expression as written, bit for bit; the Triton kernels may
    contract it into fused multiply-adds, which can move a squared distance lying within
    ~2 float32 ulps of v² across it); the fraction is rounded as ``stray_fraction``'s mean
    (:func:`stray_fractions_of`). One host synchronisation on a GPU (the stray counts), for
    the whole group; one cloud at a time where the packed key would overflow.
    """
    tensors, edges = _arrays(group, voxel_sizes)
    q, m = stray_sample(group, sample)
    strays, overflow = stray_counts({**tensors, **q}, edges)
    *strays_h, over = torch.cat([strays, overflow[None].to(torch.int64)]).tolist()
    if over:  # the packed key overflowed: one cloud at a time
        return [stray_fraction(group.cloud(i), v, sample) for i, v in enumerate(voxel_sizes)]
    return stray_fractions_of(group.sizes, strays_h, m, group.points.device)


def dense_masks_many(group: CloudGroup, voxel_sizes: Sequence[float]
                     ) -> tuple[torch.Tensor, list[int]]:
    """:func:`dense_mask` of every cloud of ``group``, cloud c at ``voxel_sizes[c]``.

    Every point's neighbours within v counted by :func:`_within_many` (the counts of
    :func:`stray_fractions_many`: the per-cloud index's on the CPU backends, bit for bit),
    capped as ``dense_mask``'s search caps them (``min(2·DENSE_MEDIAN + 1, n)``), each
    cloud's lower median taken by one sort of ``(cloud, count)`` (``Tensor.median``'s), and
    the same rule. Returns the masks of all clouds concatenated ``(P,)`` bool (the rows of
    ``group.points``) and each cloud's kept count (host ints): one host synchronisation for
    the whole group on a GPU (the kept counts), one or two more with the PyTorch reference.
    """
    c = len(group.sizes)
    dev, i64 = group.points.device, torch.int64
    owner = group.owner
    within, overflow = _within_many(*_arrays(group, voxel_sizes),
                                    torch.arange(owner.shape[0], device=dev), owner,
                                    cap=2 * DENSE_MEDIAN + 1)
    sizes = upload(group.sizes, dtype=i64, device=dev)
    cap = sizes.clamp_max(2 * DENSE_MEDIAN + 1)
    count = torch.minimum(within, cap[owner]) - 1                           # 0 ... 16
    span = 2 * DENSE_MEDIAN + 2
    ranked = torch.sort(owner * span + count).values
    first = torch.cumsum(sizes, 0) - sizes
    median = ranked[first + (sizes - 1) // 2] - torch.arange(c, device=dev) * span
    every = (median < DENSE_MEDIAN) | (sizes <= SPARSE_NEIGHBOURS + 1)
    keep = (count >= SPARSE_NEIGHBOURS) | every[owner]
    cuts = upload(list(itertools.accumulate(group.sizes, initial=0)), dtype=i64, device=dev)
    *kept, over = torch.cat([run_totals(keep, cuts), overflow[None].to(i64)]).tolist()
    if over:  # the packed key overflowed: one cloud at a time
        masks = [dense_mask(group.cloud(i), v) for i, v in enumerate(voxel_sizes)]
        return torch.cat(masks), [int(m.sum()) for m in masks]
    return keep, kept


def robust_voxel_sizes_many(clouds: Sequence[torch.Tensor], target_points: int = 5000, *,
                            start: Sequence[float] | None = None,
                            iterations: int = 2) -> list[float]:
    """:func:`robust_voxel_size` of every cloud of ``clouds``: the same edges, bit for bit.

    The same rounds: each round masks every cloud still searching by one
    :func:`dense_masks_many` and recomputes the edges of those that lost points (at least
    3 kept) by one :func:`~pointalign.features.downsample.auto_voxel_size_many` (the same
    edges as ``auto_voxel_size``). ``start``: each cloud's ``auto_voxel_size`` if known
    (else computed here). A cloud whose points (or kept points) all coincide gets NaN
    (``auto_voxel_size`` raises there). A few host synchronisations per round for the
    whole list, none per cloud.
    """
    if not clouds:
        return []
    v = list(start) if start is not None else auto_voxel_size_many(
        group_clouds(clouds), target_points)
    active = [i for i in range(len(clouds)) if math.isfinite(v[i])]
    for _ in range(iterations):
        if not active:
            break
        group = group_clouds([clouds[i] for i in active])
        keep, kept = dense_masks_many(group, [v[i] for i in active])
        moved = [j for j, i in enumerate(active) if 3 <= kept[j] != clouds[i].shape[0]]
        if not moved:
            break
        dense = torch.split(group.points[keep], kept)
        new = auto_voxel_size_many(group_clouds([dense[j] for j in moved]), target_points)
        for j, nv in zip(moved, new, strict=True):
            v[active[j]] = nv
        active = [active[j] for j in moved if math.isfinite(v[active[j]])]
    return v
