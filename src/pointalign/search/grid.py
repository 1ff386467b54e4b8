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

import functools
import math
from typing import Any

import torch

from pointalign import _validate
from pointalign.kernels import grid as _grid
from pointalign.kernels import knn as _knn
from pointalign.kernels import upload
from pointalign.search import _checks
from pointalign.search.base import KnnResult


def auto_cell_size(points: torch.Tensor, per_cell: float = 4.0) -> float:
    """Choose a cell edge giving about ``per_cell`` points per occupied cell.

    Starts from the bounding box volume per point (``(V / M)^(1/3) * per_cell^(1/3)``), then
    corrects once by the measured occupancy assuming the points lie on surfaces
    (occupancy grows with the square of the edge), as range scans do.
    """
    m = points.shape[0]
    if not per_cell > 0 or (m / (per_cell * 1e-6)) ** (1 / 3) >= 1 << 20:
        raise ValueError(f"per_cell: expected a positive number, not far below 1, got {per_cell}")
    lo32, hi32 = torch.aminmax(points, dim=0)
    lo = lo32.to(torch.float64)               # float32 extrema widen to float64 exactly
    ext = (hi32.to(torch.float64) - lo).clamp(min=0)
    span = ext.max()
    # the first guess and the occupancy it gives, on the device: one transfer for the three
    c = (torch.maximum(ext, span * 1e-3).prod() / m) ** (1 / 3) * per_cell ** (1 / 3)
    # every cell coordinate is below (m / (per_cell · 1e-6))^(1/3) (c^3 >= span^3 · 1e-6 ·
    # per_cell / m, checked above): cells packed 2**21 to an axis are one-to-one
    packed = upload([1 << 21] * 3 + [0], dtype=torch.int64, device=points.device)
    occupied = _grid.count_cells(points, None, lo[None], torch.where(span > 0, c, 1.0)[None],
                                 packed[None, :3], packed[3:], divide=True)[0]
    span_h, c_h, occupied_h = torch.stack([span, c, occupied.to(torch.float64)]).tolist()
    if span_h == 0 or m == 1:
        return 1.0 if span_h == 0 else span_h
    occ = m / occupied_h
    if occ > 2 * per_cell:
        c_h *= math.sqrt(per_cell / occ)
    return c_h


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

    ``knn`` with ``k > M`` raises ``ValueError``; ``radius`` pads with ``inf`` / ``-1``;
    ``nearest_within`` ignores ``hint``.

    """

    uses_hint = False

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
        self.cell_size = self.grid.radius
        # max_cells grew the cells (grid_build grows them by at least 1 + 1e-6): a finer
        # grid over this box would be grown as much
        self._capped = self.cell_size > float(cell_size) * (1 + 1e-6)
        self._grids: dict[float, _grid.GridData] = {}
        self._fine_cell: float | None = None

    @functools.cached_property
    def _occupancy(self) -> float:
        """Points per occupied cell (the k-NN search's first cell size; one synchronisation)."""
        occupied = int((self.grid.cell_start[1:] > self.grid.cell_start[:-1]).sum())
        return self.points.shape[0] / max(1, occupied)

    @functools.cached_property
    def scan(self) -> float:
        """The mean, over the points, of the points in their cell (Σ n_c² / M).

        What a query scans per cell when queries are distributed like the points: the mean
        occupancy on evenly sampled surfaces, far more on LiDAR scans, whose cells near the
        sensor hold hundreds of points (:mod:`pointalign.search.policy`). Measured on first
        use (one synchronisation).
        """
        n = (self.grid.cell_start[1:] - self.grid.cell_start[:-1]).to(torch.float64)
        return float(n.square().sum()) / self.points.shape[0]

    def __repr__(self) -> str:
        return (f"VoxelGridIndex(M={self.points.shape[0]}, cell_size={self.cell_size:.4g}, "
                f"dims={self.grid.dims}, device={self.points.device})")

    def _grid_for(self, cell: float) -> _grid.GridData:
        """Get a grid with cells of at least ``cell`` (built on first use; up to 8 kept)."""
        if cell == self.cell_size:
            return self.grid
        if cell not in self._grids:
            if len(self._grids) >= 8:
                self._grids.pop(next(iter(self._grids)))
            self._grids[cell] = _grid.grid_build(self.points, cell, max_cells=self._max_cells)
        return self._grids[cell]

    def _bounded_grid(self, bound: float) -> _grid.GridData:
        """Pick the grid that answers a search bounded by ``bound`` exactly in one pass.

        A bound larger than the cell size: a grid with cells of the bound. A bound of at most
        half the cell size: a finer grid (cells halved, not below the density-based size, so
        a shrinking ICP schedule builds at most a few grids), when its certified radius still
        covers the bound. Otherwise the grid itself, and always where ``max_cells`` grew this
        grid's cells (a grid over a wide, sparse box such as a
        :class:`~pointalign.search.packed.PackedIndex`'s lattice): a finer one over the same
        box would be grown back to about the same cells, so neither the density-based size
        (a pass and a sort over all points) nor that grid is made.
        """
        if bound > self.cell_size:
            return self._grid_for(bound)
        if bound <= self.cell_size / 2 and not self._capped:
            if self._fine_cell is None:
                self._fine_cell = auto_cell_size(self.points)
            j = int(math.floor(math.log2(self.cell_size / max(bound, self._fine_cell))))
            if j >= 1:
                g = self._grid_for(self.cell_size / 2**j)
                if g.radius >= bound:
                    return g
        return self.grid

    def _search(self, q: torch.Tensor, k: int, bound: float | None) -> KnnResult:
        if bound is not None:
            return KnnResult(*_grid.grid_query(self._bounded_grid(bound), q, k, bound * bound))
        # k nearest: start with cells expected to hold about 1.5 k points within one edge
        # (occupied cells as surface patches: about 3 x occupancy points per edge radius)
        f = max(1.0, math.sqrt(k / (2.0 * self._occupancy)))
        g = self._grid_for(self.cell_size * f)
        radius = g.radius
        d, i = _grid.grid_query(g, q, k, None)
        # certified where the k-th found neighbour is within the certified radius; the
        # others go to grids with cells twice as large, then to brute force
        rows = (~(d[:, k - 1] <= radius**2)).nonzero().squeeze(1)
        while rows.numel():
            g = self._grid_for(radius * self.LEVEL_FACTOR)
            radius = g.radius
            if max(g.dims) <= 2:
                bd, bi = _knn.knn_tiles(q[rows], self.points, k, None)
                d, i = d.index_copy(0, rows, bd), i.index_copy(0, rows, bi)
                break
            bd, bi = _grid.grid_query(g, q[rows], k, None)
            d, i = d.index_copy(0, rows, bd), i.index_copy(0, rows, bi)
            rows = rows[~(bd[:, k - 1] <= radius**2)]
        return KnnResult(d, i)

    def knn(self, query: Any, k: int) -> KnnResult:
        """Find the k nearest points of each query: ``dists (N, k)`` squared, ``idx (N, k)``."""
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

    def nearest_within(self, query: Any, max_distance: float, *,
                       hint: torch.Tensor | None = None) -> KnnResult:
        """Nearest point with ``||q - p|| <= max_distance``: ``(N, 1)``, ``-1`` / ``inf`` if none.

        One pass over the 27 cells of the grid that covers the bound (the fast path for ICP
        when ``max_distance <= cell_size``). Inside :func:`~pointalign._validate.trusted`: no
        argument checks and, on the GPU, one kernel launch over the queries in the given
        order (no sort by cell, no synchronisation once the grid for this bound exists; pass
        the queries in a spatially coherent order). ``hint`` is ignored.
        """
        md = _checks.check_distance(max_distance, "max_distance")
        q = _checks.query_points(query, self.points)
        _checks.check_hint(hint, q.shape[0], self.points, values=False)
        return KnnResult(*_grid.grid_query(self._bounded_grid(md), q, 1, md * md,
                                           sort_queries=not _validate.is_trusted()))
