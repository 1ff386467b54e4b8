"""Voxel-grid downsampling: one point per occupied voxel, the centroid of its points.

The space is cut into cubes of edge ``voxel_size`` anchored at the cloud's minimum corner;
each occupied cube ``k = floor((p - p_min) / voxel_size)`` yields the mean of its points
(and the mean of their normals, renormalised, and of their colours). This is PCL's
``VoxelGrid`` and Open3D's ``voxel_down_sample``, as used before FPFH + RANSAC in the
parallel RANSAC paper (5 mm leaf) and Open3D's global-registration tutorial.

Implementation: integer voxel keys, one stable sort of the points by key (the occupied cells
are the runs of equal keys), and segment sums taken as differences of a float64 cumulative
sum. No atomics, so the result is bit-identical from run to run on a device (RANSAC's
determinism for a fixed seed depends on it). Same code on CPU and GPU; two host
synchronisations per call (the grid's extent and the number of voxels).

:func:`auto_voxel_size` chooses the edge that keeps about a given number of points
(:func:`pointalign.register`'s default).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from pointalign import _threads, _validate
from pointalign._ops import exclusive_cumsum_rows, scalar_divisors
from pointalign.cloud import PointCloud
from pointalign.kernels import upload
from pointalign.kernels.grid import cell_keys, count_cells

#: largest number of voxels along one axis (the three keys are packed in one int64)
_MAX_CELLS_PER_AXIS = 1 << 20


def bounds(points: torch.Tensor) -> tuple[torch.Tensor, list[float], list[float]]:
    """``(points (N, 3), min corner, max corner)``; one host synchronisation.

    The corners are exact (a float32 extremum converts to float64 without rounding); the
    points are returned as given: :func:`voxel_keys` widens them to float64 a chunk at a time.
    """
    lo, hi = torch.stack([points.min(0).values, points.max(0).values]).to(torch.float64).tolist()
    return points, lo, hi


#: rows per chunk of the float64 work in :func:`voxel_keys` and :func:`_segment_mean`
#: (bounds its temporaries to ~100 MB whatever the cloud's size)
_CHUNK = 1 << 22


def voxel_keys(points: torch.Tensor, voxel_size: float,
               extent: tuple[torch.Tensor, list[float], list[float]] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed int64 voxel key of every point and the grid origin.

    Args:
        points: ``(N, 3)`` float tensor.
        voxel_size: cube edge, same units as the points (> 0).
        extent: ``bounds(points)`` when the caller has it (saves its synchronisation).

    Returns:
        ``(keys (N,) int64, origin (3,) float64)``; points in one voxel share a key.

    Raises:
        ValueError: the grid would need more than 2**20 voxels along an axis.

    """
    p, lo, hi = bounds(points) if extent is None else extent
    origin = upload(lo, dtype=torch.float64, device=p.device)
    # floor is monotone, so the largest cell index is that of the largest coordinate (the
    # host's division may round differently from the device's only at a cell boundary)
    dims = [math.floor((h - o) / voxel_size) + 1 for o, h in zip(lo, hi, strict=True)]
    if max(dims) > _MAX_CELLS_PER_AXIS:
        raise ValueError(
            f"voxel_size: {voxel_size} is too small for this cloud's extent "
            f"({dims} voxels per axis, at most {_MAX_CELLS_PER_AXIS})"
        )
    keys = torch.empty(p.shape[0], dtype=torch.int64, device=p.device)
    for s in range(0, p.shape[0], _CHUNK):
        cell = torch.floor((p[s:s + _CHUNK].to(torch.float64) - origin) / voxel_size)
        cell = cell.to(torch.int64)
        keys[s:s + _CHUNK] = ((cell[:, 0] * _MAX_CELLS_PER_AXIS + cell[:, 1])
                              * _MAX_CELLS_PER_AXIS + cell[:, 2])
    return keys, origin


def count_voxels(points: torch.Tensor, voxel_size: float,
                 extent: tuple[torch.Tensor, list[float], list[float]] | None = None) -> int:
    """Count the voxels of edge ``voxel_size`` occupied by ``points (N, 3)``.

    ``extent``: ``bounds(points)`` when the caller counts at several sizes.
    """
    keys, _ = voxel_keys(points, voxel_size, extent)
    sorted_keys = torch.sort(keys).values
    return int((sorted_keys[1:] != sorted_keys[:-1]).sum()) + 1


def _segment_mean(values: torch.Tensor, order: torch.Tensor, seg: torch.Tensor,
                  ends: torch.Tensor, counts: torch.Tensor,
                  shift: torch.Tensor) -> torch.Tensor:
    """Mean of ``values (N, C)`` over consecutive segments of ``values[order]`` (float64 sums).

    ``seg (N,)``: segment of each sorted row (non-decreasing); ``ends, counts (V,)``: end
    (exclusive) and length of each segment. ``shift (V, C)`` is subtracted per segment
    before summing (keeps the float64 cumulative sum small, so differences of it stay exact
    to ~1e-12 of a voxel). The rows are taken in runs of whole segments of about
    :data:`_CHUNK` rows (one host synchronisation for the cuts when there are several).
    """
    n, nseg = order.shape[0], counts.shape[0]
    starts = ends - counts
    if n <= _CHUNK:
        cuts = [(0, nseg, 0, n)]
    else:
        # segment index at each chunk boundary (a segment longer than a chunk stays whole)
        rows = torch.arange(_CHUNK, n, _CHUNK, device=order.device)
        segs = torch.unique(torch.cat([seg.new_zeros(1), seg[rows], seg.new_full((1,), nseg)]))
        at = torch.cat([starts, starts.new_full((1,), n)])[segs]
        segs_h, at_h = segs.tolist(), at.tolist()
        cuts = [(a, b, r0, r1) for a, b, r0, r1 in
                zip(segs_h[:-1], segs_h[1:], at_h[:-1], at_h[1:], strict=True)]
    out = torch.empty(nseg, values.shape[1], dtype=torch.float64, device=values.device)
    for a, b, r0, r1 in cuts:
        rel = values[order[r0:r1]].to(torch.float64) - shift[seg[r0:r1]]
        cs = exclusive_cumsum_rows(rel)
        sums = cs[ends[a:b] - r0] - cs[starts[a:b] - r0]
        out[a:b] = shift[a:b] + sums / counts[a:b, None].to(torch.float64)
    return out


@_threads.per_call
@_validate.out_of_memory_is_clear
def voxel_downsample(cloud: Any, voxel_size: float) -> Any:
    """Replace the points of every occupied voxel by their centroid.

    ``q_v = (1/|V|) Σ_{p ∈ V} p`` for every voxel V of edge ``voxel_size``; normals are
    averaged and renormalised (a voxel whose normals cancel keeps its first normal), colours
    averaged (Open3D's ``voxel_down_sample``). Other attributes (features, covariances,
    extras) are dropped: recompute them for the new points.

    Args:
        cloud: ``(N, 3)`` float tensor / NumPy array, a :class:`PointCloud`, or an Open3D
            point cloud (legacy or tensor API; its normals and colours are averaged too).
        voxel_size: cube edge (> 0), same units as the points (metres by convention).

    Returns:
        The input's kind (:func:`pointalign._validate.kind`): an ``(V, 3)`` NumPy array for
        NumPy input, an ``(V, 3)`` tensor on the input's device for a tensor, a
        :class:`PointCloud` for a PointCloud, an Open3D cloud of the same API for an Open3D
        cloud; in the input's float dtype. Voxels come in increasing key order (x-major),
        so the output is deterministic.
        ``num_threads``: CPU threads for this call (:func:`pointalign.threads`).

    """
    like = _validate.kind(cloud)
    if like in ("open3d", "open3d_tensor"):
        cloud = PointCloud.from_open3d(cloud)
    is_cloud = isinstance(cloud, PointCloud)
    points = _validate.as_points(cloud, "cloud")
    voxel_size = _validate.positive(voxel_size, "voxel_size")
    keys, _ = voxel_keys(points, voxel_size)
    # one stable sort: voxels in increasing key order, points in index order within each
    sorted_keys, order = torch.sort(keys, stable=True)
    new = torch.ones_like(sorted_keys, dtype=torch.bool)
    new[1:] = sorted_keys[1:] != sorted_keys[:-1]
    starts = new.nonzero().squeeze(1)  # the one host synchronisation: V
    ends = torch.cat([starts[1:], starts.new_full((1,), keys.numel())])
    counts = ends - starts
    seg = torch.cumsum(new, 0) - 1
    first = order[starts]  # one member of each voxel (the lowest index)
    shift = points[first].to(torch.float64)
    centers = _segment_mean(points, order, seg, ends, counts, shift).to(points.dtype)
    if not is_cloud:
        return _validate.as_kind(centers, like)
    normals = colors = None
    if cloud.normals is not None:
        first_n = cloud.normals[first].to(torch.float64)
        mean_n = _segment_mean(cloud.normals, order, seg, ends, counts,
                               torch.zeros_like(first_n))
        norm = mean_n.norm(dim=1, keepdim=True)
        ok = norm > 1e-12
        normals = torch.where(ok, mean_n / norm.clamp_min(1e-300), first_n)
        normals = normals.to(points.dtype)
    if cloud.colors is not None:
        colors = _segment_mean(cloud.colors, order, seg, ends, counts,
                               torch.zeros(counts.numel(), 3, dtype=torch.float64,
                                           device=points.device)).to(points.dtype)
    return _validate.cloud_as_kind(PointCloud(centers, normals=normals, colors=colors), like)


def auto_voxel_size(points: Any, target_points: int = 5000, *, iterations: int = 6) -> float:
    """Voxel edge at which ``points (N, 3)`` keeps about ``target_points`` voxels.

    Starts from ``diag / sqrt(target_points)`` (diag: the bounding-box diagonal) and
    corrects ``v ← v · sqrt(count / target_points)`` (surfaces: count ∝ v⁻²) a few times;
    returns the first edge whose count is within 10 % or the best seen. A cloud with fewer
    than ``2 · target_points`` points is reduced to about half its size instead.

    :func:`pointalign.register`'s default edge, with ``target_points`` = 5,000: the size the
    parallel RANSAC paper works at (5 mm voxels on ~10⁵-point object scans); it gives
    ~3.5 mm on the Stanford bunny, ~5 cm on 3DMatch fragments and ~1 m on a KITTI scan, the
    sizes those datasets are usually registered at.
    """
    pts = _validate.as_points(points, "points")
    target_points = int(target_points)
    if target_points < 3:
        raise ValueError(f"target_points: expected an integer >= 3, got {target_points}")
    extent = bounds(pts)  # one synchronisation for the loop
    diag = math.dist(extent[1], extent[2])
    if diag == 0.0:
        raise ValueError("points: all points coincide; cannot choose a voxel size")
    # a cloud not much larger than the target is still halved: every voxel must keep a
    # few neighbours within the 2v normal radius
    want = max(3, min(target_points, pts.shape[0] // 2))
    v = diag / math.sqrt(want)
    best_v, best_err = v, math.inf
    for _ in range(iterations):
        c = count_voxels(pts, v, extent)
        err = abs(math.log(c / want))
        if err < best_err:
            best_v, best_err = v, err
        if err < 0.1:
            break
        v *= math.sqrt(c / want)
        v = max(v, diag * 1e-6)
    return best_v


def voxel_downsample_many(clouds: list[torch.Tensor], voxel_size: float,
                          group: CloudGroup | None = None) -> list[torch.Tensor]:
    """:func:`voxel_downsample` of many checked clouds at once: one sort for all of them.

    Each cloud keeps its own grid (anchored at its own minimum corner) and its voxels come
    in its own key order: the packed key is ``(cloud, cell)`` with the cell packed as
    :func:`voxel_keys` packs it (the same x-major order), so cloud c's voxels and points
    are grouped as alone. The cells and their centroids are computed with the same
    operations; only the float64 cumulative sum of :func:`_segment_mean` runs over all the
    clouds, which may change a centroid by an ulp of float64 (below float32's, so in
    practice the same float32 points; the tests allow 1e-6 voxel). Two host
    synchronisations for the whole list (the corners, the voxels per cloud).

    Args:
        clouds: C ``(N_c, 3)`` float tensors (finite, N_c >= 1) on one device, one dtype.
        voxel_size: cube edge (> 0).
        group: ``group_clouds(clouds)`` when the caller has it (saves its synchronisation).

    Returns:
        C ``(V_c, 3)`` tensors, each what ``voxel_downsample(clouds[c], voxel_size)`` gives.

    """
    c = len(clouds)
    points, owner, sizes, origin, lo_h, hi_h = group_clouds(clouds) if group is None else group
    dims = [math.floor((h - o) / voxel_size) + 1
            for lo_c, hi_c in zip(lo_h, hi_h, strict=True)
            for o, h in zip(lo_c, hi_c, strict=True)]
    if max(dims) > _MAX_CELLS_PER_AXIS:
        raise ValueError(f"voxel_size: {voxel_size} is too small for a cloud's extent "
                         f"({max(dims)} voxels along an axis, at most {_MAX_CELLS_PER_AXIS})")
    side = max(dims) + 1  # one spare cell per axis: no key can collide
    if c * side ** 3 >= 1 << 62:  # the packed key would overflow: one cloud at a time
        return [voxel_downsample(x, voxel_size) for x in clouds]
    flat = upload([side] * (3 * c) + [i * side ** 3 for i in range(c)], dtype=torch.int64,
                  device=points.device)
    scale, divide = scalar_divisors([voxel_size] * c, torch.float64, points.device)
    keys = cell_keys(points, owner, origin, scale, flat[:3 * c].view(c, 3), flat[3 * c:],
                     divide=divide)[0]
    sorted_keys, order = torch.sort(keys, stable=True)
    new = torch.ones_like(sorted_keys, dtype=torch.bool)
    new[1:] = sorted_keys[1:] != sorted_keys[:-1]
    seg = torch.cumsum(new, 0) - 1
    # cloud c's points are the sorted rows [Σ_{<c} N, Σ_{<=c} N) (its index leads the key):
    # the voxels before its end, read once for every cloud
    last = upload(np.cumsum(sizes) - 1, dtype=torch.int64, device=points.device)
    upto = np.asarray((seg[last] + 1).tolist())             # the one read of the voxels
    per = np.diff(np.concatenate([[0], upto])).tolist()
    # each voxel's first sorted row (the rows where ``new`` holds), without a second read
    pos = torch.arange(keys.numel(), device=points.device)
    starts = pos.new_full((int(upto[-1]),), keys.numel()).scatter_reduce_(0, seg, pos, "amin")
    ends = torch.cat([starts[1:], starts.new_full((1,), keys.numel())])
    counts = ends - starts
    first = order[starts]
    centers = _segment_mean(points, order, seg, ends, counts,
                            points[first].to(torch.float64)).to(points.dtype)
    return list(torch.split(centers, per))


class CloudGroup(NamedTuple):
    """C checked clouds side by side, for the ``*_many`` functions (:func:`group_clouds`).

    Attributes:
        points: ``(P, 3)`` the clouds concatenated (one dtype, one device).
        owner: ``(P,)`` int64, each row's cloud.
        sizes: the C clouds' sizes (host ints).
        lo: ``(C, 3)`` float64 minimum corners on the device.
        lo_h, hi_h: the C minimum and maximum corners on the host (float64, exact).

    """

    points: torch.Tensor
    owner: torch.Tensor
    sizes: list[int]
    lo: torch.Tensor
    lo_h: list[list[float]]
    hi_h: list[list[float]]

    def cloud(self, c: int) -> torch.Tensor:
        """Cloud c's rows (a view)."""
        s = sum(self.sizes[:c])
        return self.points[s:s + self.sizes[c]]


#: up to this many clouds, :func:`group_clouds` reduces each cloud's corners on its own
_SLICED_CORNERS = 8


def group_clouds(clouds: Sequence[torch.Tensor]) -> CloudGroup:
    """Concatenate C checked clouds and find their corners: one host synchronisation.

    The corners are exact (a float32 extremum widens to float64 without rounding), so every
    cloud's corners are those :func:`bounds` gives for it alone.
    """
    dev, dtype = clouds[0].device, clouds[0].dtype
    sizes = [int(x.shape[0]) for x in clouds]
    points = torch.cat(list(clouds))
    owner = torch.repeat_interleave(torch.arange(len(sizes), device=dev),
                                    upload(sizes, dtype=torch.int64, device=dev),
                                    output_size=points.shape[0])
    c = len(sizes)
    if c <= _SLICED_CORNERS and min(sizes) > 0:
        # a few clouds: each one's own reduction (a scatter's atomics on a few rows
        # serialise: 2.6 ms for the two KITTI scans on an H200, against ~0.05 ms)
        ext = [torch.aminmax(x, dim=0) for x in clouds]
        lo = torch.stack([e.min for e in ext])
        hi = torch.stack([e.max for e in ext])
    else:
        idx3 = owner[:, None].expand(-1, 3)
        lo = torch.full((c, 3), math.inf, dtype=dtype, device=dev).scatter_reduce(
            0, idx3, points, "amin")
        hi = torch.full((c, 3), -math.inf, dtype=dtype, device=dev).scatter_reduce(
            0, idx3, points, "amax")
    corners = torch.stack([lo, hi]).to(torch.float64)
    lo_h, hi_h = corners.tolist()
    return CloudGroup(points, owner, sizes, corners[0], lo_h, hi_h)


def count_voxels_many(group: CloudGroup, voxel_sizes: Sequence[float]) -> list[int]:
    """:func:`count_voxels` of every cloud of ``group``, cloud c at ``voxel_sizes[c]``.

    Each cloud on its own grid (anchored at its own minimum corner), its cells computed
    with the operations :func:`voxel_keys` uses (float64 ``floor((p - lo) / v)``, the
    division as PyTorch rounds a division by a Python float on the device:
    :func:`pointalign._ops.scalar_divisors`), so the same cells and the same counts; the
    key ``(cloud, cell)`` is packed over each cloud's own extent and all clouds are counted
    at once (:func:`~pointalign.kernels.grid.count_cells`: on a GPU one hash-table launch).
    One host synchronisation (the counts).

    Raises:
        ValueError: a grid would need more than 2**20 voxels along an axis (as
            :func:`voxel_keys`).

    """
    c = len(group.sizes)
    dims = []
    for lo_c, hi_c, v in zip(group.lo_h, group.hi_h, voxel_sizes, strict=True):
        d = [math.floor((h - o) / v) + 1 for o, h in zip(lo_c, hi_c, strict=True)]
        if max(d) > _MAX_CELLS_PER_AXIS:
            raise ValueError(f"voxel_size: {v} is too small for this cloud's extent "
                             f"({d} voxels per axis, at most {_MAX_CELLS_PER_AXIS})")
        dims.append([x + 1 for x in d])  # one spare cell per axis: no key can collide
    cells = [a * b * e for a, b, e in dims]
    if sum(cells) >= 1 << 62:  # the packed key would overflow: one cloud at a time
        return [count_voxels(group.cloud(i), v) for i, v in enumerate(voxel_sizes)]
    dev = group.points.device
    flat = upload([x for d in dims for x in d]
                  + list(itertools.accumulate(cells, initial=0))[:-1], dtype=torch.int64,
                  device=dev)
    scale, divide = scalar_divisors(voxel_sizes, torch.float64, dev)
    return count_cells(group.points, group.owner, group.lo, scale, flat[:3 * c].view(c, 3),
                       flat[3 * c:], divide=divide).tolist()


def auto_voxel_size_many(group: CloudGroup, target_points: int = 5000, *,
                         iterations: int = 6, clouds: Sequence[int] | None = None
                         ) -> list[float]:
    """:func:`auto_voxel_size` of every cloud of ``group``: the same edges, bit for bit.

    The same rule and host arithmetic per cloud; each round counts the voxels of every
    cloud still searching by one :func:`count_voxels_many` (one host synchronisation per
    round, at most ``iterations``, instead of one per cloud and round). A cloud whose points
    all coincide gets NaN (:func:`auto_voxel_size` raises there). ``clouds``: the indices
    of the clouds to size, in the order of the returned edges (default: all); the others
    are counted along but not sized (a group made once for other uses as well).
    """
    target_points = int(target_points)
    if target_points < 3:
        raise ValueError(f"target_points: expected an integer >= 3, got {target_points}")
    c = len(group.sizes)
    sized = list(range(c)) if clouds is None else list(clouds)
    diag = [math.dist(lo, hi) for lo, hi in zip(group.lo_h, group.hi_h, strict=True)]
    want = [max(3, min(target_points, n // 2)) for n in group.sizes]
    v = [d / math.sqrt(w) if d > 0 else 1.0 for d, w in zip(diag, want, strict=True)]
    best_v, best_err = list(v), [math.inf] * c
    active = [False] * c
    for i in sized:
        active[i] = diag[i] > 0
    for _ in range(iterations):
        if not any(active):
            break
        counts = count_voxels_many(group, v)
        for i in range(c):
            if not active[i]:
                continue
            err = abs(math.log(counts[i] / want[i]))
            if err < best_err[i]:
                best_v[i], best_err[i] = v[i], err
            if err < 0.1:
                active[i] = False
                continue
            v[i] *= math.sqrt(counts[i] / want[i])
            v[i] = max(v[i], diag[i] * 1e-6)
    return [best_v[i] if diag[i] > 0 else math.nan for i in sized]
