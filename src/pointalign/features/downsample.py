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

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from pointalign import _threads, _validate
from pointalign._ops import divides_by_scalar, exclusive_cumsum_rows, scalar_divisors
from pointalign.cloud import PointCloud
from pointalign.kernels import _loop, upload
from pointalign.kernels.grid import cell_keys, count_cells

#: largest number of voxels along one axis (the three keys are packed in one int64)
_MAX_CELLS_PER_AXIS = 1 << 20
#: the automatic edge's rounds at most (:func:`auto_voxel_size`)
EDGE_ROUNDS = 6


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


def auto_voxel_size(points: Any, target_points: int = 5000, *,
                    iterations: int = EDGE_ROUNDS) -> float:
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


def packed_grids(ext: torch.Tensor, edges: torch.Tensor, spare: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each cloud's grid and key offset, and whether they overflow one packed key.

    ``ext (C, 3)`` float64: each cloud's corners' difference; ``edges (C,)`` float64 cell
    edges. Cells per axis ``floor(ext / edge) + 1 + spare`` (a true division, as
    :func:`voxel_keys`; ``spare = -1``: ``ext // edge + 1``, Python's float floor division,
    as the stray grids count them). Returns ``dims (C, 3)`` and ``base (C,)`` int64 and a
    0-dim bool, True where some axis needs 2**21 cells or more or the grids 2**61 cells in
    all (judged in float64 before anything is packed): then the keys are meaningless and
    the caller answers one cloud at a time. No host read.
    """
    if spare < 0:
        q = torch.div(ext, edges[:, None], rounding_mode="floor") + 1
    else:
        q = torch.floor(ext / edges[:, None]) + 1 + spare
    overflow = (q >= 2.0**21).any() | (q.prod(1).sum() >= 2.0**61) | ~torch.isfinite(q).all()
    dims = torch.where(overflow, 1.0, q).to(torch.int64)
    cells = dims.prod(1)
    return dims, torch.cumsum(cells, 0) - cells, overflow


def edge_search_inputs(group: CloudGroup, target_points: int = 5000,
                       clouds: Sequence[int] | None = None,
                       edges: Sequence[float] | None = None) -> dict[str, torch.Tensor]:
    """:func:`edge_search`'s start for every cloud of ``group``: host arithmetic, one upload.

    The same start as :func:`auto_voxel_size` per cloud (the diagonal, the wanted count, the
    first edge); ``clouds``: the indices of the clouds to size (default: all; the others keep
    their first edge). ``edges``: every cloud's edge given instead (nothing sized). Returns
    ``ext (C, 3)`` (the corners' difference), ``diag``, ``want`` ``(C,)`` float64 and the
    search's first state (:data:`EDGE_STATE`: ``v``, ``best_v``, ``best_err`` ``(C,)``
    float64, ``active (C,)`` and ``overflow`` (0-dim) bool) on the group's device.
    """
    target_points = int(target_points)
    if target_points < 3:
        raise ValueError(f"target_points: expected an integer >= 3, got {target_points}")
    c = len(group.sizes)
    sized = set(range(c) if clouds is None else clouds) if edges is None else set()
    ext = [h - o for lo, hi in zip(group.lo_h, group.hi_h, strict=True)
           for o, h in zip(lo, hi, strict=True)]
    diag = [math.dist(lo, hi) for lo, hi in zip(group.lo_h, group.hi_h, strict=True)]
    want = [max(3, min(target_points, n // 2)) for n in group.sizes]
    if edges is None:
        v = [d / math.sqrt(w) if d > 0 else 1.0 for d, w in zip(diag, want, strict=True)]
    else:
        v = [float(e) for e in edges]
    active = [float(i in sized and diag[i] > 0) for i in range(c)]
    flat = upload(ext + diag + want + v + active + [math.inf] * c, dtype=torch.float64,
                  device=group.points.device)
    return {"ext": flat[:3 * c].view(c, 3), "diag": flat[3 * c:4 * c],
            "want": flat[4 * c:5 * c], "v": flat[5 * c:6 * c],
            "active": flat[6 * c:7 * c] > 0.5, "best_v": flat[5 * c:6 * c],
            "best_err": flat[7 * c:],
            "overflow": torch.zeros((), dtype=torch.bool, device=group.points.device)}


#: the edge search's state from round to round (:func:`edge_search`)
EDGE_STATE = ("v", "best_v", "best_err", "active", "overflow")
#: rounds of the edge search run before the host looks (:func:`searched`): the rule settles
#: within two to four on the usual scans (the bunny pairs two, a KITTI pair four)
FIRST_ROUNDS = 4


def edge_search(arrays: Mapping[str, torch.Tensor], rounds: int
                ) -> dict[str, torch.Tensor]:
    """Run ``rounds`` of :func:`auto_voxel_size`'s search for every cloud, on the device.

    ``arrays``: the group's ``points``, ``owner`` and ``lo`` (:class:`CloudGroup`),
    :func:`edge_search_inputs`' tensors and the search's state (:data:`EDGE_STATE`: the
    first one, or a previous call's), by name. Each round counts every cloud's voxels at
    its edge (:func:`~pointalign.kernels.grid.count_cells`: each cloud on its own grid, its
    cells computed as :func:`voxel_keys` computes them, float64 ``floor((p - lo) / v)``
    with the division as PyTorch rounds a division by a Python float:
    :func:`pointalign._ops.scalar_divisors`) and moves the clouds still searching by the
    rule's float64 arithmetic (true divisions, square roots and products: the host's bits;
    the log error decides the same comparisons). Every round runs (a cloud that has
    stopped is counted along, unchanged), with no host read. Returns the new state and
    ``edges (C,)`` float64: each cloud's best edge so far, NaN where its points all
    coincide (``auto_voxel_size`` raises there). ``overflow``: some round's grids
    overflowed the packed key (:func:`packed_grids`; only for a group of many clouds at
    edges near ``diag · 1e-6``), the edges are then meaningless.
    """
    points, owner, lo = arrays["points"], arrays["owner"], arrays["lo"]
    ext, diag, want = arrays["ext"], arrays["diag"], arrays["want"]
    v, active, overflow = arrays["v"], arrays["active"], arrays["overflow"]
    best_v, best_err = arrays["best_v"], arrays["best_err"]
    divide = divides_by_scalar(torch.float64, points.device)
    finest = diag * 1e-6
    for _ in range(rounds):
        dims, base, over = packed_grids(ext, v, 1)  # one spare cell an axis: no collision
        counts = count_cells(points, owner, lo, v if divide else 1.0 / v, dims, base,
                             divide=divide)
        ratio = counts.to(torch.float64) / want
        err = ratio.log().abs()
        better = active & (err < best_err)
        best_v, best_err = torch.where(better, v, best_v), torch.where(better, err, best_err)
        active = active & (err >= 0.1)
        v = torch.where(active, torch.maximum(v * ratio.sqrt(), finest), v)
        overflow = overflow | over
    return {"v": v, "best_v": best_v, "best_err": best_err, "active": active,
            "overflow": overflow, "edges": torch.where(diag > 0, best_v, math.nan)}


def searched(program: Callable[[int], Any], inputs: dict[str, torch.Tensor],
             iterations: int) -> dict[str, np.ndarray]:
    """Run an edge-search program (:func:`edge_search` inside), the host looking rarely.

    ``program(rounds)``: the fixed device program of ``rounds`` rounds, whose outputs hold
    the state (:data:`EDGE_STATE`); ``inputs``: its inputs, the first state among them.
    :data:`FIRST_ROUNDS` rounds, one read, and the remaining rounds of ``iterations`` only
    where a cloud still searches (and no grid overflowed): the same rounds as the host's
    loop. Each run through :func:`~pointalign.kernels._loop.run_program` (on a GPU a CUDA
    graph per size from a size's second call). Returns the last run's host outputs.
    """
    done, rounds = 0, min(FIRST_ROUNDS, iterations)
    while True:
        host, out = _loop.run_program(program(rounds), inputs, eager_first=True)
        done += rounds
        if host["overflow"] or done >= iterations or not host["active"].any():
            return host
        inputs = {**inputs, **{k: out[k] for k in EDGE_STATE}}
        rounds = iterations - done


@dataclasses.dataclass(frozen=True)
class _EdgeSearch:
    """:func:`edge_search` as a fixed device program (:func:`auto_voxel_size_many`)."""

    rounds: int

    def __call__(self, inputs: dict[str, torch.Tensor], checkpoint: object
                 ) -> dict[str, torch.Tensor]:
        return edge_search(inputs, self.rounds)


def auto_voxel_size_many(group: CloudGroup, target_points: int = 5000, *,
                         iterations: int = EDGE_ROUNDS, clouds: Sequence[int] | None = None
                         ) -> list[float]:
    """:func:`auto_voxel_size` of every cloud of ``group``: the same edges, bit for bit.

    The same rule and arithmetic per cloud, every round of every cloud on the device
    (:func:`edge_search`, run by :func:`searched`: one read after :data:`FIRST_ROUNDS`
    rounds, a second where a cloud still searches); one cloud at a time where the packed
    cells overflowed.
    A cloud whose points all coincide gets NaN (:func:`auto_voxel_size` raises there).
    ``clouds``: the indices of the clouds to size, in the order of the returned edges
    (default: all); the others are counted along but not sized (a group made once for
    other uses as well).
    """
    sized = list(range(len(group.sizes))) if clouds is None else list(clouds)
    start = edge_search_inputs(group, target_points, sized)
    host = searched(_EdgeSearch, {"points": group.points, "owner": group.owner,
                                  "lo": group.lo, **start}, int(iterations))
    if host["overflow"]:  # the packed key overflowed: one cloud at a time
        return [_edge_alone(group.cloud(i), target_points, iterations) for i in sized]
    return [float(host["edges"][i]) for i in sized]


def _edge_alone(points: torch.Tensor, target_points: int, iterations: int) -> float:
    """Return :func:`auto_voxel_size`, NaN where the points all coincide."""
    try:
        return auto_voxel_size(points, target_points, iterations=iterations)
    except ValueError:
        return math.nan
