"""Voxel-grid nearest-neighbour search: fixed-radius and hybrid queries, always exact.

Points are sorted by cell (:func:`pointalign.kernels.grid.grid_build`); a query scans the 27
cells around it (:func:`pointalign.kernels.grid.grid_query`). Any point within one cell
edge ``c`` of a query lies in those cells, so:

* ``nearest_within(query, max_distance)`` and ``radius(query, r, ...)`` with the distance
  ``<= c`` are answered by the grid alone: the natural index for ICP with a maximum
  correspondence distance (build with ``cell_size = max_correspondence_distance``);
* a bound ``> c`` is answered in one pass by a second grid with cells of that bound (built
  on first use, up to 4 kept);
* ``knn`` is exact for every query whose k-th neighbour found in the
  27 cells is within ``c``; the other queries (far from the cloud, sparse regions) are
  searched again in coarser grids (cells 4, 16, ... times larger, built on first use and
  kept), each exact for the queries whose k-th neighbour is within its cell edge, and once
  a grid has at most 2 cells per axis, by brute force
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
    keys = ((p - p.amin(0)) / c).floor().to(torch.int64)
    occupied = torch.unique(keys, dim=0).shape[0]
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
    LEVEL_FACTOR = 4

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
        self._levels = {0: self.grid}
        self._bound_grids: dict[float, _grid.GridData] = {}

    def __repr__(self) -> str:
        return (f"VoxelGridIndex(M={self.points.shape[0]}, cell_size={self.cell_size:.4g}, "
                f"dims={self.grid.dims}, device={self.points.device})")

    def _level(self, level: int) -> tuple[_grid.GridData, float]:
        """Grid ``level`` (cells ``LEVEL_FACTOR**level`` times larger; built once, cached)
        and its certified radius."""
        if level not in self._levels:
            self._levels[level] = _grid.grid_build(
                self.points, self.cell_size * self.LEVEL_FACTOR**level,
                max_cells=self._max_cells)
        g = self._levels[level]
        return g, g.cell / (1 + _grid._CELL_MARGIN)

    def _search(self, q: torch.Tensor, k: int, bound: float | None) -> KnnResult:
        b2 = None if bound is None else bound * bound
        if bound is not None and bound > self.cell_size:
            # a grid with cells of the bound answers every query in one pass; kept for reuse
            if bound not in self._bound_grids:
                if len(self._bound_grids) >= 4:
                    self._bound_grids.pop(next(iter(self._bound_grids)))
                self._bound_grids[bound] = _grid.grid_build(self.points, bound,
                                                            max_cells=self._max_cells)
            return KnnResult(*_grid.grid_query(self._bound_grids[bound], q, k, b2))
        d, i = _grid.grid_query(self.grid, q, k, b2)
        if bound is not None:
            return KnnResult(d, i)
        # certified where the k-th found neighbour is within the cell edge; the others go
        # to ever coarser grids, and past the last useful one to brute force
        rows = (~(d[:, k - 1] <= self.cell_size**2)).nonzero().squeeze(1)
        level = 1
        while rows.numel():
            g, radius = self._level(level)
            if max(g.dims) <= 2:
                bd, bi = _knn.knn_tiles(q[rows], self.points, k, b2)
                d, i = d.index_copy(0, rows, bd), i.index_copy(0, rows, bi)
                break
            bd, bi = _grid.grid_query(g, q[rows], k, b2)
            d, i = d.index_copy(0, rows, bd), i.index_copy(0, rows, bi)
            rows = rows[~(bd[:, k - 1] <= radius**2)]
            level += 1
        return KnnResult(d, i)

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
