"""Voxel-grid nearest-neighbour search: fixed-radius and hybrid queries, always exact.

Points are sorted by cell (:func:`pointalign.kernels.grid.grid_build`); a query scans the 27
cells around it (:func:`pointalign.kernels.grid.grid_query`). Any point within one cell
edge ``c`` of a query lies in those cells, so:

* ``nearest_within(query, max_distance)`` and ``radius(query, r, ...)`` with the distance
  ``<= c`` are answered by the grid alone (by a grid with cells ``c / 2^j`` when the
  distance is at most half of ``c`` and the point density allows): the natural index for
  ICP with a maximum correspondence distance (build with ``cell_size =`` that distance);
* a bound ``> c`` is answered in one pass by a second grid with cells of that bound (built
  on first use; up to 8 extra grids are kept);
* ``knn`` first searches a grid whose cells are expected to hold about 1.5 k points within
  one edge (``c`` itself for small k); a query is exact when its k-th neighbour found is
  within that grid's edge. The other queries (far from the cloud, sparse regions) are
  searched again in grids with cells 2, 4, ... times larger (built on first use, a few
  kept), and once a grid has at most 2 cells per axis, by brute force
  (:func:`pointalign.kernels.knn.knn_tiles`). Results are always exact; queries far from
  every point cost more.

Greenspan & Yurick, "Approximate k-d tree search for efficient ICP" (3DIM 2003) discuss
grids for ICP correspondences; small_gicp and Open3D use GPU voxel hashes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pointalign.kernels import grid as _grid
from pointalign.kernels import knn as _knn
from pointalign.search import _checks
from pointalign.search.base import KnnResult


def auto_cell_size(points: torch.Tensor, per_cell: float = 4.0) -> float:
    """A cell edge giving about ``per_cell`` points per occupied cell.

    Starts from the bounding box volume per point (``(V / M)^(1/3) * per_cell^(1/3)``), then
    corrects once by the measured occupancy assuming the points lie on surfaces
    (occupancy grows with the square of the edge), as range scans do.
    """
    p = points.to(torch.float64)
    m = p.shape[0]
    ext = (p.amax(0) - p.amin(0)).clamp(min=0)
    span = float(ext.max())
    if span == 0 or m == 1:
        return 1.0 if span == 0 else span
    ext = ext.clamp(min=span * 1e-3)
    c = float((ext.prod() / m) ** (1 / 3)) * per_cell ** (1 / 3)
    ijk = ((p - p.amin(0)) / c).floor().to(torch.int64)
    dims = ijk.amax(0) + 1
    keys = (ijk[:, 0] * dims[1] + ijk[:, 1]) * dims[2] + ijk[:, 2]
    occupied = int(torch.unique(keys).numel())
    occ = m / max(1, occupied)
    if occ > 2 * per_cell:
        c *= math.sqrt(per_cell / occ)
    return c


class VoxelGridIndex:
    """Voxel-grid :class:`~pointalign.search.base.Index` over ``points (M, 3)``.

    Args:
        points: ``(M, 3)`` array, tensor or PointCloud.
        cell_size: cell edge, same units as the points (> 0). ``None``: chosen by
            :func:`auto_cell_size` (about 4 points per occupied cell). For ICP pass the
            maximum correspondence distance.
        device: optional device for the points.
        max_cells: cap on the dense cell table; a larger bounding box gets larger cells.

    Attributes:
        points: the ``(M, 3)`` points (not copied).
        cell_size: the certified radius: every point this close to a query is in its 27
            cells (the requested size, or larger when ``max_cells`` forced it).

    ``knn`` with ``k > M`` raises ``ValueError``; ``radius`` pads with ``inf`` / ``-1``.

    """

    #: Each fallback level's cells are this many times larger than the previous level's.
    LEVEL_FACTOR = 2

    def __init__(self, points: Any, cell_size: float | None = None, *,
                 device: str | torch.device | None = None,
                 max_cells: int = _grid.DEFAULT_MAX_CELLS):
        self.points = _checks.index_points(points, device=device)
        if cell_size is None:
            cell_size = auto_cell_size(self.points)
        else:
            cell_size = _checks.check_distance(cell_size, "cell_size")
        self._max_cells = max_cells
        self.grid = _grid.grid_build(self.points, cell_size, max_cells=max_cells)
        self.cell_size = self.grid.cell / (1 + _grid._CELL_MARGIN)
        self._grids: dict[float, _grid.GridData] = {}
        self._fine_cell: float | None = None
        occupied = int((self.grid.cell_start[1:] > self.grid.cell_start[:-1]).sum())
        self._occupancy = self.points.shape[0] / max(1, occupied)

    def __repr__(self) -> str:
        return (f"VoxelGridIndex(M={self.points.shape[0]}, cell_size={self.cell_size:.4g}, "
                f"dims={self.grid.dims}, device={self.points.device})")

    def _grid_for(self, cell: float) -> tuple[_grid.GridData, float]:
        """Get a grid with cells of at least ``cell`` and its certified radius (cached)."""
        if cell == self.cell_size:
            return self.grid, self.cell_size
        if cell not in self._grids:
            if len(self._grids) >= 8:
                self._grids.pop(next(iter(self._grids)))
            self._grids[cell] = _grid.grid_build(self.points, cell, max_cells=self._max_cells)
        g = self._grids[cell]
        return g, g.cell / (1 + _grid._CELL_MARGIN)

    def _search(self, q: torch.Tensor, k: int, bound: float | None) -> KnnResult:
        b2 = None if bound is None else bound * bound
        if bound is not None and bound > self.cell_size:
            # a grid with cells of the bound answers every query in one pass
            return KnnResult(*_grid.grid_query(self._grid_for(bound)[0], q, k, b2))
        if bound is not None:
            # much smaller bounds scan a finer grid (cells halved, not below the density-based
            # size, so a shrinking ICP schedule builds at most a few grids)
            g = self.grid
            if bound <= self.cell_size / 2:
                if self._fine_cell is None:
                    self._fine_cell = auto_cell_size(self.points)
                j = int(math.floor(math.log2(self.cell_size / max(bound, self._fine_cell))))
                if j >= 1:
                    g, radius = self._grid_for(self.cell_size / 2**j)
                    g = g if radius >= bound else self.grid
            return KnnResult(*_grid.grid_query(g, q, k, b2))
        # k nearest: start with cells expected to hold about 1.5 k points within one edge
        # (occupied cells as surface patches: about 3 x occupancy points per edge radius)
        f = max(1.0, math.sqrt(k / (2.0 * self._occupancy)))
        g, radius = self._grid_for(self.cell_size * f)
        d, i = _grid.grid_query(g, q, k, None)
        # certified where the k-th found neighbour is within the certified radius; the
        # others go to grids with cells twice as large, then to brute force
        rows = (~(d[:, k - 1] <= radius**2)).nonzero().squeeze(1)
        while rows.numel():
            g, radius = self._grid_for(radius * self.LEVEL_FACTOR)
            if max(g.dims) <= 2:
                bd, bi = _knn.knn_tiles(q[rows], self.points, k, None)
                d, i = d.index_copy(0, rows, bd), i.index_copy(0, rows, bi)
                break
            bd, bi = _grid.grid_query(g, q[rows], k, None)
            d, i = d.index_copy(0, rows, bd), i.index_copy(0, rows, bi)
            rows = rows[~(bd[:, k - 1] <= radius**2)]
        return KnnResult(d, i)

    def nearest_within_unchecked(self, query: torch.Tensor, max_distance: float
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """ICP's fast path of :meth:`nearest_within`: ``(dists (N,), idx (N,))`` (-1 = none).

        No argument checks and no host synchronisation (the grid's ``dims`` are cached on the
        device; the queries are not re-sorted, so pass them in a spatially coherent order for
        speed). ``query`` must be a finite contiguous ``(N, 3)`` tensor of the points' dtype
        and device and ``max_distance > 0``. Falls back to :meth:`nearest_within` off the
        Triton path.
        """
        from pointalign.kernels._backend import backend

        md = float(max_distance)
        n = query.shape[0]
        if n == 0 or backend(query) in ("torch", "cpu"):
            r = self.nearest_within(query, md)
            return r.dists[:, 0], r.idx[:, 0]
        if md > self.cell_size:
            g = self._grid_for(md)[0]
        else:
            g = self.grid
            if md <= self.cell_size / 2:
                if self._fine_cell is None:
                    self._fine_cell = auto_cell_size(self.points)
                j = int(math.floor(math.log2(self.cell_size / max(md, self._fine_cell))))
                if j >= 1:
                    g2, radius = self._grid_for(self.cell_size / 2**j)
                    g = g2 if radius >= md else self.grid
        cache = self.__dict__.setdefault("_dims_dev", {})
        dims = cache.get(g.cell)
        if dims is None:
            dims = cache[g.cell] = torch.tensor(g.dims, dtype=torch.int64, device=query.device)
        from pointalign.kernels import _grid_triton

        out_d = torch.empty((n, 1), dtype=query.dtype, device=query.device)
        out_i = torch.empty((n, 1), dtype=torch.int64, device=query.device)
        _grid_triton._kernel()[(-(-n // 128),)](
            query, g.params, dims, g.cell_start, g.sorted_points, g.sorted_idx, out_d, out_i,
            n, g.sorted_points.shape[1], md * md, HAS_MAX=True, K=1, KP=1, BLOCK=128,
            U=_grid_triton.NN_UNROLL, num_warps=4)
        return out_d[:, 0], out_i[:, 0]

    def knn(self, query: Any, k: int) -> KnnResult:
        """The k nearest points of each query: ``dists (N, k)`` squared, ``idx (N, k)``."""
        k = _checks.check_k(k, self.points.shape[0])
        q = _checks.query_points(query, self.points)
        return self._search(q, k, None)

    def radius(self, query: Any, r: float, max_neighbors: int) -> KnnResult:
        """Up to ``max_neighbors`` nearest points with ``||q - p|| <= r``: ``(N, max_neighbors)``.

        Grid only when ``r <= cell_size``; otherwise rows not certified fall back to brute force.
        """
        r = _checks.check_distance(r, "r")
        k = _checks.check_k(max_neighbors, self.points.shape[0], "max_neighbors",
                            allow_more=True)
        q = _checks.query_points(query, self.points)
        return self._search(q, k, r)

    def nearest_within(self, query: Any, max_distance: float) -> KnnResult:
        """Nearest point with ``||q - p|| <= max_distance``: ``(N, 1)``, ``-1`` / ``inf`` if none.

        One pass over the 27 cells when ``max_distance <= cell_size`` (the fast path for ICP).
        """
        md = _checks.check_distance(max_distance, "max_distance")
        q = _checks.query_points(query, self.points)
        return self._search(q, 1, md)
