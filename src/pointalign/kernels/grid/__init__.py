"""Voxel grid over points sorted by cell: build, and search of the 27 cells around a query.

Build (:func:`grid_build`): cells of edge ``c`` tile the points' bounding box, starting at its
minimum corner ``o``; point ``p`` lies in cell ``floor((p - o) / c)`` (computed in float64),
whose linear key is ``(i * ny + j) * nz + l``. Points are sorted by key (stable) and a dense
table ``cell_start (nx * ny * nz + 1,)`` gives each cell's range in the sorted order. The
three cells ``l - 1 .. l + 1`` of one ``(i, j)`` column are adjacent in key order, so the 27
neighbouring cells of a query are 9 contiguous ranges.

Query (:func:`grid_query`): the k nearest among the points of those 27 cells. Every point
within distance ``c`` of the query lies in them, so a result whose k-th distance is at most
``c`` (or a search bounded by ``max_distance_sq <= c^2``) is exact; callers
(:class:`pointalign.search.grid.VoxelGridIndex`) handle the rest. Ties: smallest original
index first. The uniform grid for ICP correspondences follows Greenspan & Yurick,
"Approximate k-d tree search for efficient ICP" (3DIM 2003) and the GPU voxel hash of
small_gicp / Open3D; here the "hash" is a dense table over the bounding box.
"""

from __future__ import annotations

import math

import torch

from pointalign.kernels._backend import backend, upload
from pointalign.kernels.grid.reference import CELL_MARGIN as _CELL_MARGIN
from pointalign.kernels.grid.reference import GridData as GridData
from pointalign.kernels.grid.reference import cell_keys_reference as cell_keys_reference
from pointalign.kernels.grid.reference import count_cells_reference as count_cells_reference
from pointalign.kernels.grid.reference import count_within_reference as count_within_reference
from pointalign.kernels.grid.reference import grid_query_reference as grid_query_reference
from pointalign.kernels.grid.reference import morton_codes_reference as morton_codes_reference
from pointalign.kernels.grid.reference import query_keys as query_keys

#: Cells in the dense table are capped; a box that needs more gets larger cells.
DEFAULT_MAX_CELLS = 1 << 24

#: points per chunk of the float64 cell computation of a build (bounds its temporaries)
_BUILD_CHUNK = 1 << 22


def grid_build(points: torch.Tensor, cell_size: float, *,
               max_cells: int = DEFAULT_MAX_CELLS) -> GridData:
    """Sort ``points (M, 3)`` into a dense grid of cells of edge >= ``cell_size``.

    The cell is ``cell_size * (1 + 1e-5)``, grown further (by whole factors of the needed
    ratio) when the bounding box would need more than ``max_cells`` cells.
    """
    if points.dim() != 2 or points.shape[1] != 3 or points.shape[0] == 0:
        raise ValueError(f"points: expected shape (M, 3) with M >= 1, got {tuple(points.shape)}")
    if points.shape[0] >= 2**31 - 1:
        raise ValueError(f"points: at most 2**31 - 2 points, got {points.shape[0]}")
    if not cell_size > 0 or not math.isfinite(cell_size):
        raise ValueError(f"cell_size: must be finite and > 0, got {cell_size}")
    # float32 extrema widen to float64 exactly; the points are widened a chunk at a time
    lo = points.amin(0).to(torch.float64)
    ext = (points.amax(0).to(torch.float64) - lo).tolist()
    cell = float(cell_size) * (1 + _CELL_MARGIN)
    dims = [int(e // cell) + 1 for e in ext]
    total = dims[0] * dims[1] * dims[2]
    if total > max_cells:
        cell *= (total / max_cells) ** (1 / 3) * (1 + 1e-6)
        dims = [int(e // cell) + 1 for e in ext]
        while dims[0] * dims[1] * dims[2] > max_cells:
            cell *= 1.01
            dims = [int(e // cell) + 1 for e in ext]
    nx, ny, nz = dims
    m = points.shape[0]
    keys = torch.empty(m, dtype=torch.int32 if nx * ny * nz < 2**31 else torch.int64,
                       device=points.device)
    for s in range(0, m, _BUILD_CHUNK):
        ijk = ((points[s:s + _BUILD_CHUNK].to(torch.float64) - lo) / cell).floor()
        ijk = ijk.to(torch.int64)
        for a in range(3):
            ijk[:, a].clamp_(0, dims[a] - 1)
        keys[s:s + _BUILD_CHUNK] = (ijk[:, 0] * ny + ijk[:, 1]) * nz + ijk[:, 2]
    order = torch.argsort(keys, stable=True)
    counts = torch.bincount(keys, minlength=nx * ny * nz)
    cell_start = torch.zeros(nx * ny * nz + 1, dtype=torch.int64, device=points.device)
    torch.cumsum(counts, 0, out=cell_start[1:])
    params = torch.cat([lo, upload([1.0 / cell], dtype=torch.float64, device=lo.device)])
    return GridData(params, cell, (nx, ny, nz), cell_start.to(torch.int32),
                    points.t().index_select(1, order), order.to(torch.int32),
                    upload(dims, dtype=torch.int64, device=points.device))


def grid_query(g: GridData, query: torch.Tensor, k: int,
               max_distance_sq: float | None = None, *,
               sort_queries: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """K nearest points of each query among the 27 cells around it.

    Args:
        g: a grid from :func:`grid_build`.
        query: ``(N, 3)`` float tensor, dtype and device of the grid's points.
        k: neighbours per query (>= 1).
        max_distance_sq: optional inclusive bound on squared distances.
        sort_queries: the Triton path visits the queries grouped by cell (one sort, results
            scattered back). ``False`` takes them in the given order: one kernel launch and
            nothing else for ``k == 1`` (no synchronisation, capture safe); for callers whose
            queries are already in a spatially coherent order (:func:`morton_order`).

    Returns:
        ``(dists_sq (N, k), idx (N, k) int64)`` ascending, ``inf`` / ``-1`` where fewer than
        k points are in range; ``idx`` indexes the original points. Exact when the k-th
        distance is at most ``g.cell`` (see the module docstring).

    Dispatch: Triton on CUDA (and under ``TRITON_INTERPRET=1``) for ``k <= 32``, else the
    chunked PyTorch reference :func:`grid_query_reference`.

    """
    if query.dim() != 2 or query.shape[1] != 3:
        raise ValueError(f"query: expected shape (N, 3), got {tuple(query.shape)}")
    if query.dtype != g.sorted_points.dtype or query.device != g.sorted_points.device:
        raise ValueError("query: must have the grid's dtype and device")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k: expected an integer >= 1, got {k!r}")
    n = query.shape[0]
    if n == 0:
        return (torch.full((0, k), math.inf, dtype=query.dtype, device=query.device),
                torch.full((0, k), -1, dtype=torch.int64, device=query.device))
    be = backend(query)
    if be in ("triton", "interpret") and k <= 32:
        from pointalign.kernels.grid import triton as _grid_triton

        return _grid_triton.grid_query(g, query, k, max_distance_sq, sort_queries=sort_queries)
    return grid_query_reference(g, query, k, max_distance_sq)


def count_within(sorted_keys: torch.Tensor, sorted_points: torch.Tensor, query: torch.Tensor,
                 query_cell: torch.Tensor, query_cloud: torch.Tensor, dims: torch.Tensor,
                 base: torch.Tensor, r2: torch.Tensor, cap: int) -> torch.Tensor:
    """Count the points within ``sqrt(r2)`` of each query among its 27 cells, up to ``cap``.

    Several clouds share one packed grid: cloud c has ``dims[c] = (nx, ny, nz)`` cells of its
    own, keyed ``base[c] + (i · ny + j) · nz + l``, and the keys of different clouds do not
    overlap. A query of cloud c in cell ``(i, j, l)`` is compared with every point whose key
    is one of its 27 neighbours' (cells off the grid hold nothing); a point counts when
    ``dx² + dy² + dz² <= r2[c]``, computed in the points' dtype (the search contract: the
    Triton kernel may fuse the multiply-adds, so a distance within ~2 ulps of the bound may
    count differently there). With cells of edge at least ``sqrt(r2[c])``, that is every
    point of the cloud within the radius.

    Args:
        sorted_keys: ``(P,)`` int64 every point's key, ascending.
        sorted_points: ``(P, 3)`` float points in that order.
        query: ``(Q, 3)`` float queries (the points' dtype and device).
        query_cell: ``(Q, 3)`` int64 each query's cell ``(i, j, l)`` in its cloud's grid.
        query_cloud: ``(Q,)`` int64 each query's cloud.
        dims: ``(C, 3)`` int64 cells per axis of each cloud.
        base: ``(C,)`` int64 each cloud's first key.
        r2: ``(C,)`` squared radius of each cloud, in the points' dtype.
        cap: counts stop at this (>= 1): a query in a crowded cell compares with no more
            candidates than it needs.

    Returns:
        ``(Q,)`` int64 ``min(count, cap)``. On Triton one launch and no host
        synchronisation (each lane stops at ``cap``); elsewhere
        :func:`count_within_reference` (one or two synchronisations).

    """
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"cap: expected an integer >= 1, got {cap!r}")
    if sorted_points.dim() != 2 or sorted_points.shape[1] != 3 \
            or sorted_keys.shape != sorted_points.shape[:1]:
        raise ValueError(f"sorted_keys, sorted_points: expected shapes (P,) and (P, 3), got "
                         f"{tuple(sorted_keys.shape)} and {tuple(sorted_points.shape)}")
    if query.dim() != 2 or query.shape[1] != 3 or query.dtype != sorted_points.dtype:
        raise ValueError(f"query: expected shape (Q, 3) with the points' dtype "
                         f"{sorted_points.dtype}, got {tuple(query.shape)} {query.dtype}")
    arrays = (sorted_keys, sorted_points, query, query_cell, query_cloud, dims, base, r2)
    if len({t.device for t in arrays}) > 1:
        raise ValueError("count_within: every tensor must be on one device, got "
                         f"{sorted({str(t.device) for t in arrays})}")
    if backend(query) in ("triton", "interpret"):
        from pointalign.kernels.grid import triton as _grid_triton

        return _grid_triton.count_within(
            sorted_keys.contiguous(), sorted_points.contiguous(), query.contiguous(),
            query_cell.contiguous(), query_cloud.contiguous(), dims.contiguous(),
            base.contiguous(), r2.contiguous(), cap)
    return count_within_reference(sorted_keys, sorted_points, query, query_cell, query_cloud,
                                  dims, base, r2, cap)


_Cells = tuple[torch.Tensor, "torch.Tensor | None", torch.Tensor, torch.Tensor, torch.Tensor,
               torch.Tensor]


def _cell_arguments(points: torch.Tensor, owner: torch.Tensor | None, lo: torch.Tensor,
                    scale: torch.Tensor, dims: torch.Tensor, base: torch.Tensor) -> _Cells:
    """Check :func:`cell_keys`' arguments; return them contiguous, the floats in float64."""
    if points.dim() != 2 or points.shape[1] != 3:
        raise ValueError(f"points: expected shape (P, 3), got {tuple(points.shape)}")
    c = base.shape[0]
    if lo.shape != (c, 3) or scale.shape != (c,) or dims.shape != (c, 3) \
            or (owner is not None and owner.shape != points.shape[:1]):
        raise ValueError(f"cells: expected owner (P,), lo (C, 3), scale (C,), dims (C, 3) "
                         f"and base (C,), got {None if owner is None else tuple(owner.shape)}, "
                         f"{tuple(lo.shape)}, {tuple(scale.shape)}, {tuple(dims.shape)}, "
                         f"{tuple(base.shape)}")
    arrays = [t for t in (points, owner, lo, scale, dims, base) if t is not None]
    if len({t.device for t in arrays}) > 1:
        raise ValueError("cells: every tensor must be on one device, got "
                         f"{sorted({str(t.device) for t in arrays})}")
    return (points.contiguous(), None if owner is None else owner.contiguous(),
            lo.to(torch.float64).contiguous(), scale.to(torch.float64).contiguous(),
            dims.contiguous(), base.contiguous())


def cell_keys(points: torch.Tensor, owner: torch.Tensor | None, lo: torch.Tensor,
              scale: torch.Tensor, dims: torch.Tensor, base: torch.Tensor, *,
              divide: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every point's cell in its own cloud's grid, and its packed ``(cloud, cell)`` key.

    Point i of cloud ``c = owner[i]`` (0 when ``owner`` is None) lies in the cell
    ``(x, y, z) = floor((p_i − lo[c]) / scale[c])`` (``divide``, correctly rounded) or
    ``floor((p_i − lo[c]) · scale[c])``, computed in float64 and clamped to
    ``[0, dims[c] − 1]``; its key is ``base[c] + (x · ny + y) · nz + z``. With each cloud's
    keys ``[base[c], base[c] + nx · ny · nz)`` apart from the others' (and below 2**62) a
    key names one cell of one cloud.

    Args:
        points: ``(P, 3)`` float tensor.
        owner: ``(P,)`` int64 each point's cloud, or None (one cloud).
        lo: ``(C, 3)`` float64 each cloud's corner.
        scale: ``(C,)`` float64 each cloud's cell edge (``divide``) or its reciprocal.
        dims: ``(C, 3)`` int64 each cloud's cells per axis ``(nx, ny, nz)``.
        base: ``(C,)`` int64 each cloud's first key.
        divide: divide by ``scale`` rather than multiply.

    Returns:
        ``(keys (P,), cells (P, 3))`` int64. On Triton one launch, no host synchronisation;
        elsewhere :func:`cell_keys_reference`.

    """
    args = _cell_arguments(points, owner, lo, scale, dims, base)
    if backend(points) in ("triton", "interpret"):
        from pointalign.kernels.grid import triton as _grid_triton

        return _grid_triton.cell_keys(*args, divide)
    return cell_keys_reference(*args, divide)


def count_cells(points: torch.Tensor, owner: torch.Tensor | None, lo: torch.Tensor,
                scale: torch.Tensor, dims: torch.Tensor, base: torch.Tensor, *,
                divide: bool) -> torch.Tensor:
    """Count every cloud's occupied cells: the distinct keys of :func:`cell_keys` per cloud.

    The same arguments as :func:`cell_keys`. Distinct keys are counted exactly on every
    backend. Returns ``(C,)`` int64 counts on the points' device: on Triton one hash-table
    insertion launch (and its fill), no host synchronisation; elsewhere
    :func:`count_cells_reference` (one sort).
    """
    args = _cell_arguments(points, owner, lo, scale, dims, base)
    if backend(points) in ("triton", "interpret") and base.shape[0]:
        from pointalign.kernels.grid import triton as _grid_triton

        return _grid_triton.count_cells(*args, divide)
    return count_cells_reference(*args, divide)


def morton_order(points: torch.Tensor) -> torch.Tensor:
    """Permutation ``(N,)`` int64 sorting ``points (N, 3)`` along a Morton (Z-order) curve.

    10 bits per axis over the bounding box (:func:`.reference.morton_codes_reference`), one
    sort; on the device no synchronisation. Queries taken in this order are spatially
    coherent: neighbouring lanes of the search kernels visit the same cells or tree nodes.
    On the "cpu" backend the codes come from one numba pass (the same codes) and a stable
    NumPy sort (~20 PyTorch operations cost ~3 ms of a 25k-point GICP call there); on
    CUDA float32 points from one Triton launch (the same codes; ~35 launches before).
    """
    if backend(points) == "cpu" and points.dtype in (torch.float32, torch.float64):
        from pointalign.kernels.grid import cpu as _grid_cpu

        return _grid_cpu.morton_order_cpu(points)
    if backend(points) == "triton" and points.dtype == torch.float32 and points.shape[0]:
        from pointalign.kernels.grid import triton as _grid_triton

        return torch.argsort(_grid_triton.morton_codes(points))
    return torch.argsort(morton_codes_reference(points))


def morton_order_rows(points: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Permutations ``(B, N)`` int64 sorting each batch entry's valid rows by Morton code.

    ``points (B, N, 3)`` float tensor whose entry ``b`` holds ``lengths[b]`` valid rows
    first; each permutation keeps the padding rows last (so ``lengths`` still applies after
    a gather). The codes are taken over the batch's common bounding box (padding rows
    included): the order is spatially coherent within each entry. No host reads (safe in a
    CUDA graph); on CUDA one Triton launch for the codes.
    """
    B, N = points.shape[:2]
    flat = points.reshape(B * N, 3)
    if backend(points) == "triton" and N:
        from pointalign.kernels.grid import triton as _grid_triton

        codes = _grid_triton.morton_codes(flat.to(torch.float32))
    else:
        codes = morton_codes_reference(flat) if N else flat.new_zeros(0, dtype=torch.int32)
    pad = torch.arange(N, device=points.device)[None, :] >= lengths.to(points.device)[:, None]
    codes = codes.view(B, N).masked_fill(pad, torch.iinfo(codes.dtype).max)
    return torch.argsort(codes, dim=1, stable=True)
