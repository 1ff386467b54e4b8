"""CPU (numba): nearest point within a fixed bound for many unhinted queries (RANSAC scoring).

RANSAC and register() score hypotheses by moving the source by each one and asking, for
every moved point, for the nearest target point within a fixed bound r: hundreds of
thousands of queries against a few thousand target points, most of them (wrong hypotheses)
far from the target surface. The k-d tree (``_knn_cpu``) must descend to prove that a point
has no neighbour; here a grid of cells of edge ``c`` (r by default) over the target's
bounding box grown by r keeps, per cell, the list of target points within ``r`` (plus a
rounding margin) of the cell's box, in increasing index. A query reads its one cell: an
empty cell (a point off the surface) answers at once, a full one holds a few candidates.

Contract: that of :meth:`pointalign.kernels.knn.cpu.CpuTree.nearest` without a hint: the
nearest point with squared distance ``<= max_d2`` (computed in the points' dtype as
``(q-p)_x² + (q-p)_y² + (q-p)_z²``; ties to the smaller index), else ``inf`` / ``-1``. It is
exact: a point whose rounded squared distance passes the bound lies within ``r + pad`` of
the query, and every cell lists all points within ``r + pad`` of its box, where ``pad``
covers the rounding of the distances and of the query's cell index.

:meth:`BoundGrid.score` (kernel :func:`_score`, behind
:func:`pointalign.kernels.ransac.score_transforms`) moves the source by every hypothesis
and queries the grid in one parallel pass over (hypothesis, block of points): no moved
points in memory, per-hypothesis inlier counts and float64 sums of squared distances
summed in a fixed order, the matches only when asked, and (counts only) a search that
stops at the first point within the bound.
"""

from __future__ import annotations

import math

import numpy as np

from pointalign import _threads
from pointalign.kernels._numba import njit, prange
from pointalign.kernels.knn.cpu import CpuTree

#: cell edge as a fraction of the bound (measured on the bunny at 1.5v: 1.0 builds in 2 ms
#: and answers 135k queries in 5 ms, 0.5 in 8 ms and 7 ms; the tree 33 ms)
CELL_FRACTION = 1.0
#: most cells a grid may have (memory: 4 bytes each for the offsets)
MAX_CELLS = 1 << 22
#: use a grid when a call has at least this many queries per target point (build ~ M·64)
MIN_QUERIES_PER_POINT = 4
#: points per work item of the fused transform-and-score kernel (:func:`_score`)
SCORE_BLOCK = 256


@njit(cache=True)
def _cells_in_reach(pts, origin, c, dims, reach2, pos, items, fill):
    """Visit, for every point, the cells whose box lies within ``sqrt(reach2)`` of it.

    Two passes build the CSR candidate lists: ``fill=False`` counts entries per cell into
    ``pos[cell + 1]``; ``fill=True`` writes each point into ``items`` at ``pos[cell]`` (the
    cells' starts), so indices increase within each cell.
    """
    reach = math.sqrt(reach2)
    for i in range(pts.shape[0]):
        p0, p1, p2 = np.float64(pts[i, 0]), np.float64(pts[i, 1]), np.float64(pts[i, 2])
        a0 = max(0, int(math.floor((p0 - reach - origin[0]) / c)))
        a1 = max(0, int(math.floor((p1 - reach - origin[1]) / c)))
        a2 = max(0, int(math.floor((p2 - reach - origin[2]) / c)))
        b0 = min(dims[0] - 1, int(math.floor((p0 + reach - origin[0]) / c)))
        b1 = min(dims[1] - 1, int(math.floor((p1 + reach - origin[1]) / c)))
        b2 = min(dims[2] - 1, int(math.floor((p2 + reach - origin[2]) / c)))
        for x in range(a0, b0 + 1):
            lo = origin[0] + x * c
            g0 = max(lo - p0, p0 - (lo + c), 0.0)
            for y in range(a1, b1 + 1):
                lo1 = origin[1] + y * c
                g1 = max(lo1 - p1, p1 - (lo1 + c), 0.0)
                for z in range(a2, b2 + 1):
                    lo2 = origin[2] + z * c
                    g2 = max(lo2 - p2, p2 - (lo2 + c), 0.0)
                    if g0 * g0 + g1 * g1 + g2 * g2 <= reach2:
                        cell = (x * dims[1] + y) * dims[2] + z
                        if fill:
                            items[pos[cell]] = i
                            pos[cell] += 1
                        else:
                            pos[cell + 1] += 1


#: cell lists up to this long are sorted by insertion (longer ones: a stable argsort)
_INSERTION_MAX = 64


@njit(cache=True, parallel=True)
def _order_cells(pts, origin, c, dims, start, items, dc, cpts):
    """Sort every cell's list by distance from the cell's centre (float64), ties by index.

    ``dc[e]`` receives the distance of entry e's point from its cell's centre and
    ``cpts[e]`` its coordinates. Both sorts are stable (lists start in increasing index):
    short lists by insertion in place, long ones by a merge sort.
    """
    ncell = start.shape[0] - 1
    for cell in prange(ncell):
        a, b = start[cell], start[cell + 1]
        if b - a == 0:
            continue
        z = cell % dims[2]
        y = (cell // dims[2]) % dims[1]
        x = cell // (dims[2] * dims[1])
        c0 = origin[0] + (x + 0.5) * c
        c1 = origin[1] + (y + 0.5) * c
        c2 = origin[2] + (z + 0.5) * c
        if b - a <= _INSERTION_MAX:
            for e in range(a, b):
                i = items[e]
                d0 = np.float64(pts[i, 0]) - c0
                d1 = np.float64(pts[i, 1]) - c1
                d2 = np.float64(pts[i, 2]) - c2
                k = math.sqrt(d0 * d0 + d1 * d1 + d2 * d2)
                j = e
                while j > a and dc[j - 1] > k:  # strictly: equal keys keep their order
                    dc[j] = dc[j - 1]
                    items[j] = items[j - 1]
                    j -= 1
                dc[j] = k
                items[j] = i
        else:
            key = np.empty(b - a, np.float64)
            for e in range(a, b):
                i = items[e]
                d0 = np.float64(pts[i, 0]) - c0
                d1 = np.float64(pts[i, 1]) - c1
                d2 = np.float64(pts[i, 2]) - c2
                key[e - a] = math.sqrt(d0 * d0 + d1 * d1 + d2 * d2)
            order = np.argsort(key, kind="mergesort")  # stable: equal keys keep index order
            seg = items[a:b].copy()
            for e in range(b - a):
                items[a + e] = seg[order[e]]
                dc[a + e] = key[order[e]]
        for e in range(a, b):
            i = items[e]
            cpts[e, 0] = pts[i, 0]
            cpts[e, 1] = pts[i, 1]
            cpts[e, 2] = pts[i, 2]


@njit(cache=True, nogil=True, inline="always")
def _cell_of(origin, c, dims, q0, q1, q2):
    """Return the grid cell of one query and its distance from the cell's centre: ``(cell, h)``.

    ``(-1, 0.0)`` for a query outside the grid (or not finite).
    """
    x = math.floor((np.float64(q0) - origin[0]) / c)
    y = math.floor((np.float64(q1) - origin[1]) / c)
    z = math.floor((np.float64(q2) - origin[2]) / c)
    if 0 <= x < dims[0] and 0 <= y < dims[1] and 0 <= z < dims[2]:
        h0 = np.float64(q0) - (origin[0] + (x + 0.5) * c)
        h1 = np.float64(q1) - (origin[1] + (y + 0.5) * c)
        h2 = np.float64(q2) - (origin[2] + (z + 0.5) * c)
        return ((int(x) * dims[1] + int(y)) * dims[2] + int(z),
                math.sqrt(h0 * h0 + h1 * h1 + h2 * h2))
    return -1, 0.0


@njit(cache=True, nogil=True, inline="always")  # a call per query costs ~2x
def _nearest_one(cpts, dc, origin, c, dims, start, items, q0, q1, q2, max_d2, reach, pad):
    """Nearest candidate within the bound of one query: ``(d2, index)`` or ``(inf, -1)``.

    Each cell's list is read in order of distance from its centre. A candidate at ``dc``
    from the centre is at least ``dc − h`` from a query at ``h`` from it; the scan stops
    once that exceeds the best distance found (the bound's ``reach`` before any) plus
    ``pad``: every later candidate's rounded squared distance is then larger than the
    best's (see the module doc for ``pad``). Ties: the smaller index. A query outside the
    grid (or not finite) has no candidate.
    """
    best = q0 - q0 + np.inf
    bi = -1
    cell, h = _cell_of(origin, c, dims, q0, q1, q2)
    if cell >= 0:
        lim = reach + h
        for e in range(start[cell], start[cell + 1]):
            if dc[e] > lim:
                break
            d0 = q0 - cpts[e, 0]
            d1 = q1 - cpts[e, 1]
            d2 = q2 - cpts[e, 2]
            d = d0 * d0 + d1 * d1 + d2 * d2
            if d <= max_d2 and (d < best or (d == best and items[e] < bi)):
                best = d
                bi = items[e]
                lim = math.sqrt(np.float64(best)) + pad + h
    return best, bi


@njit(cache=True, nogil=True, inline="always")
def _any_within(cpts, dc, origin, c, dims, start, items, q0, q1, q2, max_d2, reach, pad):
    """Tell whether one query has a candidate within the bound (no nearest needed).

    The scan of :func:`_nearest_one` up to its first hit: True exactly when that finds one.
    """
    cell, h = _cell_of(origin, c, dims, q0, q1, q2)
    if cell >= 0:
        lim = reach + h
        for e in range(start[cell], start[cell + 1]):
            if dc[e] > lim:
                break
            d0 = q0 - cpts[e, 0]
            d1 = q1 - cpts[e, 1]
            d2 = q2 - cpts[e, 2]
            if d0 * d0 + d1 * d1 + d2 * d2 <= max_d2:
                return True
    return False


@njit(cache=True, parallel=True)
def _query(cpts, dc, origin, c, dims, start, items, q, max_d2, reach, pad, out_d, out_i):
    """Nearest within the bound of every query ``q (N, 3)`` (:func:`_nearest_one`)."""
    n = q.shape[0]
    nblocks = (n + 255) // 256
    for blk in prange(nblocks):
        for t in range(blk * 256, min(n, blk * 256 + 256)):
            d, i = _nearest_one(cpts, dc, origin, c, dims, start, items, q[t, 0], q[t, 1],
                                q[t, 2], max_d2, reach, pad)
            out_d[t] = d
            out_i[t] = i


@njit(cache=True, nogil=True, inline="always")
def _moved(R, tr, s, p0, p1, p2):
    """Point ``(p0, p1, p2)`` moved by ``(R[s], tr[s])``.

    Coordinate j is ``((p₀R[j,0] + p₁R[j,1]) + p₂R[j,2]) + t[j]``, each product and sum
    rounded in the points' dtype (no fused multiply-add): what PyTorch's ``baddbmm`` of
    :func:`pointalign.kernels.ransac.transform_points_reference` computes on the CPU.
    """
    return (((p0 * R[s, 0, 0] + p1 * R[s, 0, 1]) + p2 * R[s, 0, 2]) + tr[s, 0],
            ((p0 * R[s, 1, 0] + p1 * R[s, 1, 1]) + p2 * R[s, 1, 2]) + tr[s, 1],
            ((p0 * R[s, 2, 0] + p1 * R[s, 2, 1]) + p2 * R[s, 2, 2]) + tr[s, 2])


@njit(cache=True, parallel=True)
def _move(R, tr, pts, block, out):
    """``out[s, i]`` = point i of ``pts[s]`` (or of ``pts[0]`` when shared) moved by s."""
    S, P = out.shape[0], out.shape[1]
    nb = (P + block - 1) // block
    shared = pts.shape[0] == 1
    for w in prange(S * nb):
        s = w // nb
        b = w - s * nb
        src = pts[0] if shared else pts[s]
        for i in range(b * block, min(P, b * block + block)):
            out[s, i, 0], out[s, i, 1], out[s, i, 2] = _moved(R, tr, s, src[i, 0], src[i, 1],
                                                              src[i, 2])


def move_points(R: np.ndarray, tr: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Move ``points (1 or S, P, 3)`` by ``R (S, 3, 3)``, ``tr (S, 3)`` (its dtype): ``(S, P, 3)``.

    The numba twin of :func:`pointalign.kernels.ransac.transform_points_reference`
    (:func:`_moved`'s rounding), in parallel over blocks of points.
    """
    _threads.numba_threads()
    out = np.empty((R.shape[0], points.shape[1], 3), points.dtype)
    _move(R, tr, points, SCORE_BLOCK, out)
    return out


@njit(cache=True, parallel=True)
def _score(cpts, dc, origin, c, dims, start, items, R, tr, pts, max_d2, reach, pad, block,
           with_sums, with_matches, counts, sums, matches):
    """Move ``pts (P, 3)`` by every ``(R[s], tr[s])`` and score against the grid.

    Work items ``(s, b)`` (transform s, points ``[b·block, (b+1)·block)``) run in
    parallel, each point moved as :func:`_moved` moves it. Per item: inliers and the
    float64 sum of their squared distances, over the block's points in order; then per
    transform, the items' partial results in block
    order (a fixed order: the same result for any thread count). ``matches[s, i]``
    receives the match of point i (−1: none) when ``with_matches``. With neither sums nor
    matches asked, a point's scan stops at its first candidate within the bound
    (:func:`_any_within`; the same counts).
    """
    S, P = R.shape[0], pts.shape[0]
    nb = (P + block - 1) // block
    pc = np.zeros((S, nb), np.int64)
    ps = np.zeros((S, nb), np.float64)
    for w in prange(S * nb):
        s = w // nb
        b = w - s * nb
        cnt = 0
        acc = 0.0
        for i in range(b * block, min(P, b * block + block)):
            q0, q1, q2 = _moved(R, tr, s, pts[i, 0], pts[i, 1], pts[i, 2])
            if with_sums or with_matches:
                d, j = _nearest_one(cpts, dc, origin, c, dims, start, items, q0, q1, q2,
                                    max_d2, reach, pad)
                if j >= 0:
                    cnt += 1
                    acc += np.float64(d)
                if with_matches:
                    matches[s, i] = j
            elif _any_within(cpts, dc, origin, c, dims, start, items, q0, q1, q2, max_d2,
                             reach, pad):
                cnt += 1
        pc[s, b] = cnt
        ps[s, b] = acc
    for s in prange(S):
        cnt = 0
        acc = 0.0
        for b in range(nb):
            cnt += pc[s, b]
            acc += ps[s, b]
        counts[s] = cnt
        sums[s] = acc


class BoundGrid:
    """Per-cell candidate lists over ``points (M, 3)`` for the bound ``max_d2`` (squared).

    ``None`` from :meth:`build` when the grid would exceed :data:`MAX_CELLS` even at cells
    as large as the bound (a tiny bound over a huge extent): the tree serves those.
    """

    def __init__(self, points: np.ndarray, max_d2: float, origin: np.ndarray, c: float,
                 dims: np.ndarray, start: np.ndarray, items: np.ndarray, dc: np.ndarray,
                 reach: float, pad: float, cpts: np.ndarray):
        self.points, self.max_d2 = points, max_d2
        self.origin, self.c, self.dims, self.start, self.items = origin, c, dims, start, items
        self.dc, self.reach, self.pad = dc, reach, pad
        self.cpts = cpts  # candidates' coordinates, in list order (points[items])

    @staticmethod
    def build(points: np.ndarray, max_d2: float) -> BoundGrid | None:
        """Grid over ``points (M, 3)`` (float32/float64, C-contiguous) for ``max_d2``."""
        p64 = points.astype(np.float64)
        lo, hi = p64.min(0), p64.max(0)
        r = math.sqrt(float(max_d2))
        if not (r > 0 and math.isfinite(r)):
            return None
        # rounding of the dtype's squared distances and of the cell index (see module doc)
        scale = float(np.abs(np.concatenate([lo, hi])).max()) + r
        pad = 1e-5 * r + 16 * float(np.finfo(points.dtype).eps) * scale
        reach = r + pad
        c = CELL_FRACTION * r
        while True:
            dims = np.floor((hi - lo + 2 * reach) / c).astype(np.int64) + 1
            if float(np.prod(dims.astype(np.float64))) <= MAX_CELLS:
                break
            if c >= r:
                return None
            c = min(r, 2 * c)
        origin = lo - reach
        counts = np.zeros(int(np.prod(dims)) + 1, np.int64)
        _cells_in_reach(points, origin, c, dims, reach * reach, counts,
                        np.empty(0, np.int32), False)
        start = np.cumsum(counts)
        if start[-1] >= 2 ** 31:
            return None
        items = np.empty(start[-1], np.int32)
        _cells_in_reach(points, origin, c, dims, reach * reach, start[:-1].copy(), items,
                        True)
        _threads.numba_threads()
        dc = np.empty(items.shape[0], np.float64)
        cpts = np.empty((items.shape[0], 3), points.dtype)
        _order_cells(points, origin, c, dims, start, items, dc, cpts)
        return BoundGrid(points, max_d2, origin, c, dims, start, items, dc, reach, pad, cpts)

    def nearest(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Nearest point within the bound of each ``query (N, 3)``: ``(d2 (N,), idx (N,))``."""
        _threads.numba_threads()
        q = np.ascontiguousarray(query, dtype=self.points.dtype)
        out_d = np.empty(q.shape[0], self.points.dtype)
        out_i = np.empty(q.shape[0], np.int64)
        if q.shape[0]:
            _query(self.cpts, self.dc, self.origin, self.c, self.dims, self.start, self.items,
                   q, self.points.dtype.type(self.max_d2), self.reach, self.pad, out_d, out_i)
        return out_d, out_i

    def score(self, R: np.ndarray, t: np.ndarray, points: np.ndarray, with_matches: bool,
              with_sums: bool = True) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Inliers of ``points (P, 3)`` moved by ``R (S, 3, 3)``, ``t (S, 3)`` (see :func:`_score`).

        All three in the grid's dtype, C-contiguous. Returns ``counts (S,) int64``,
        ``sums (S,) float64`` (squared distances of the inliers; None without
        ``with_sums``) and, with ``with_matches``, ``matches (S, P) int64`` (−1: none within
        the bound), else None.
        """
        _threads.numba_threads()
        s, p = R.shape[0], points.shape[0]
        counts = np.zeros(s, np.int64)
        sums = np.zeros(s, np.float64)
        matches = np.empty((s, p) if with_matches else (0, 0), np.int64)
        if s and p:
            _score(self.cpts, self.dc, self.origin, self.c, self.dims, self.start, self.items,
                   R, t, points, self.points.dtype.type(self.max_d2), self.reach, self.pad,
                   SCORE_BLOCK, with_sums, with_matches, counts, sums, matches)
        return counts, sums if with_sums else None, matches if with_matches else None


class ScoringTree(CpuTree):
    """The k-d tree, with a :class:`BoundGrid` for many unhinted bounded queries.

    :class:`~pointalign.kernels.knn.cpu.CpuTree` whose unhinted bounded ``nearest`` calls
    with many queries go through a :class:`BoundGrid` (built once per bound, kept). The
    answers are the tree's (same contract); only the time differs.
    """

    def __init__(self, points: np.ndarray, leaf_size: int = 16):
        super().__init__(points, leaf_size)
        self._grids: dict[float, BoundGrid | None] = {}

    def grid(self, max_d2: float, queries: int) -> BoundGrid | None:
        """Return the grid that answers ``queries`` unhinted queries within ``max_d2``, or None.

        The grid of that bound (in the points' dtype) once built; built when a call has at
        least :data:`MIN_QUERIES_PER_POINT` queries per point. None: the tree answers.
        """
        key = float(self.bound(max_d2))
        grid = self._grids.get(key, False)
        if grid is False and queries >= MIN_QUERIES_PER_POINT * self.points.shape[0]:
            grid = self._grids[key] = BoundGrid.build(self.points, key)
        return grid if isinstance(grid, BoundGrid) else None

    def nearest(self, query: np.ndarray, max_d2: float | None = None,
                hint: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """As :meth:`CpuTree.nearest`; see the class docstring for the route taken."""
        if hint is None and max_d2 is not None:
            grid = self.grid(max_d2, query.shape[0])
            if grid is not None:
                return grid.nearest(query)
        return super().nearest(query, max_d2, hint)
