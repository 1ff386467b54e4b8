"""Index policy: the one place that chooses how a cloud is searched.

Five decisions, each a function here:

* :func:`choose_index` — which index to build over a cloud (``build_index(method="auto")``
  and ICP's default index);
* :func:`choose_batch_index` — one index over many problems' different targets (a
  :class:`~pointalign.search.packed.PackedIndex`) or one per problem;
* :func:`probe_index` — which index answers a few thousand queries once (a final pose's
  stability sample);
* :func:`correspondence_index` — what ICP queries for its nearest-within correspondences:
  the index itself, or the index behind fine voxel-grid "tiers" (:class:`TieredIndex`);
* :func:`query_order` — the order in which ICP sends its queries.

What depends on the device (where SciPy's tree runs, whether the fused Triton kernels run)
comes from the kernel layer, :func:`pointalign.kernels.search_plan`; nothing here
looks at devices or backends. The thresholds, all in this module:

=========================  =====  ==========================================================
knob                       value  rule (and where it was measured)
=========================  =====  ==========================================================
``GRID_MAX_RATIO``         8      with a distance d and device kernels: a voxel grid with
                                  cells of d when d <= 8 automatic cells (about 4 points per
                                  occupied cell, :func:`~pointalign.search.grid.auto_cell_size`);
                                  a larger bound makes every query scan thousands of points,
                                  where the k-d tree's cost does not grow with the bound
                                  (ICP on the bunny pair, H100, ``benchmarks/bench_icp.py``)
(k-NN shared)                     where the caller also needs every point's k nearest (GICP's
                                  covariances, point-to-plane ICP's estimated normals): no
                                  grid (a k-d tree serves both, a grid cannot); the rule
                                  below as if no distance were given. An earlier rule kept
                                  a grid whose cells held at most 64 points as the points see
                                  them (Σ n_c² / M, :attr:`~pointalign.search.grid.
                                  VoxelGridIndex.scan`: 12 on KITTI at 0.25 m, 206 at full
                                  resolution), built first to measure it; the tree's k-NN
                                  has since run 2-3x faster, and the grid lost where it had
                                  won. H200, warm medians interleaved in one process,
                                  grid-first against this rule: GICP on KITTI at 0.25 m
                                  7.89 -> 6.92 ms, 0.1 m 10.08 -> 9.69, full resolution (a
                                  grid built and dropped) 12.16 -> 10.67; point-to-plane
                                  ICP with estimated normals 11.99 -> 10.13, 16.31 -> 13.01
                                  and 13.71 -> 12.52 ms; the fast_gicp pair at 0.1 m (16k
                                  points: brute force now) GICP 7.98 -> 6.51 ms.
                                  Without k-NN to share, the ratio rule alone: the tree's
                                  build costs 3-5 ms more than the grid's (launch-bound),
                                  repaid only over many iterations (point-to-point on the
                                  bunny at 1.5 cm, 45 iterations: 45-47 against 22-30 ms),
                                  not over a few (register() on KITTI read 70.6-71.0
                                  against 74.0-77.0 ms with this rule for every caller)
``AUTO_BRUTE_MAX_POINTS``  20000  otherwise, on a device: brute force up to this many target
                                  points (no build, and the fused kernel beats a traversal
                                  there; ``benchmarks/bench_knn.py``), else the k-d tree
``TIER_BASE``, ``TIERS``   2, 2   tier j has cells of ``TIER_BASE * 4**j`` automatic cells, at
                                  most ``TIERS`` tiers, all at most half the distance; only
                                  with the fused kernels, and not in front of brute force
                                  (its cost does not drop for queries already answered), of
                                  an index that reads hints (the last correspondences prune
                                  its search better), or of a grid with cells <=
                                  ``GRID_MAX_RATIO`` automatic cells (one pass is cheaper).
                                  H100, bunny 40k: grid 1 cm 0.60 -> 0.84 ms per iteration
                                  with tiers (so none there); k-d tree 5 cm 2.9 -> 2.2
                                  without hints (the hinted tree does better still)
``PROBE_BRUTE_MAX_PAIRS``  2^28   :func:`probe_index` (a few thousand queries, once) searches
                                  by brute force while queries x points stay below this
                                  (2,048 queries: targets up to 131k points); above, the
                                  k-d tree (H200: its build over 40k points 10 ms)
``SPATIAL_ORDER_MIN``      8192   :func:`query_order` sorts queries along a Morton curve
                                  from this many on; below, the search is too small for the
                                  order to matter and the ~40 launches of the sort would not
                                  pay
=========================  =====  ==========================================================

Points in host memory always get SciPy's cKDTree (all cores).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from pointalign import kernels
from pointalign.kernels import grid as _grid
from pointalign.search import _checks
from pointalign.search.base import Index, KnnResult
from pointalign.search.brute import BruteForceIndex

GRID_MAX_RATIO = 8.0
AUTO_BRUTE_MAX_POINTS = 20_000
TIER_BASE = 2.0
TIERS = 2
SPATIAL_ORDER_MIN = 8192
PROBE_BRUTE_MAX_PAIRS = 1 << 28

#: a query answered by a tier is moved this far away for the next stages, which every index
#: rejects at once (shapes stay static: no compaction, no synchronisation)
_FAR = 1e30


def search_plan(points: torch.Tensor) -> kernels.SearchPlan:
    """Ask the kernel layer for its :class:`~pointalign.kernels.SearchPlan` for the points."""
    return kernels.search_plan(points)


def one_index_serves_every_bound(points: torch.Tensor) -> bool:
    """Tell whether :func:`choose_index` picks one index for ``points (M, 3)`` at any bound.

    True where the kernel layer's plan is the host tree (points in host memory: SciPy's
    cKDTree, for every bound): there an index built once without a bound serves searches
    at several bounds as well as one built per bound (``register`` builds the full target's
    once for its stray-point count and its final ICP). On a device a small bound may choose
    a voxel grid with cells of that bound, so each bound gets its own index.
    """
    return search_plan(points).host_tree


# ------------------------------------------------------------------------- choose_index


def index_method(plan: kernels.SearchPlan, m: int, distance: float | None = None,
                 auto_cell: float | None = None) -> str:
    """Name the index :func:`choose_index` builds, a pure function of what it measured.

    Args:
        plan: the kernel layer's plan for the points' device.
        m: number of target points M.
        distance: the largest query distance expected (ICP's maximum correspondence
            distance), or None.
        auto_cell: :func:`~pointalign.search.grid.auto_cell_size` of the points (needed only
            when ``distance`` is given and ``plan.host_tree`` is False).

    Returns:
        ``"ckdtree"``, ``"grid"``, ``"brute"`` or ``"kdtree"`` (see the module table).

    """
    if plan.host_tree:
        return "ckdtree"
    if distance is not None and auto_cell is not None and distance <= GRID_MAX_RATIO * auto_cell:
        return "grid"
    if m <= AUTO_BRUTE_MAX_POINTS:
        return "brute"
    return "kdtree"


def choose_index(points: Any, *, max_distance: float | None = None, knn: bool = False
                 ) -> Index:
    """Build the index that serves ``points (M, 3)`` best on their device.

    The rule (thresholds in the module table): points in host memory -> SciPy's cKDTree;
    on a device, with ``max_distance`` at most ``GRID_MAX_RATIO`` automatic grid cells -> a
    voxel grid with cells of ``max_distance`` (not with ``knn``: a k-d tree serves both
    searches); else brute force up to ``AUTO_BRUTE_MAX_POINTS`` points; else the k-d tree
    (a grid with automatic cells, or with cells of ``max_distance``, when the k-d tree
    module does not import).

    Args:
        points: ``(M, 3)`` array, tensor or PointCloud; non-empty and finite.
        max_distance: the largest query distance expected (> 0), e.g. ICP's maximum
            correspondence distance; None when unknown.
        knn: the caller will also ask every point's k nearest neighbours over this index
            (GICP's covariances, ICP's normals), which a k-d tree answers and a grid does not.

    Returns:
        An :class:`~pointalign.search.base.Index` over the points, on their device.

    """
    pts = _checks.index_points(points)
    if max_distance is not None:
        max_distance = _checks.check_distance(max_distance, "max_distance")
    return _choose(pts, max_distance, knn=knn)


def _choose(pts: torch.Tensor, distance: float | None, *, knn: bool = False,
            **kw: Any) -> Index:
    """:func:`choose_index` on checked points; ``distance`` is also the grid's cell size."""
    plan = search_plan(pts)
    auto = None
    if distance is not None and not plan.host_tree and not knn:
        from pointalign.search.grid import auto_cell_size

        auto = auto_cell_size(pts)
    index = _build(index_method(plan, pts.shape[0], distance, auto), pts, distance, **kw)
    if auto is not None:  # correspondence_index reads it again (a sort, three syncs)
        try:
            _tier_cache.setdefault(index, _Tiers(pts, auto))
        except TypeError:  # an index that cannot be weakly referenced
            pass
    return index


def _build(method: str, pts: torch.Tensor, distance: float | None, **kw: Any) -> Index:
    """Build the index :func:`index_method` named over checked points."""
    if method == "ckdtree":
        from pointalign.search.ckdtree import CKDTreeIndex

        return CKDTreeIndex(pts, **kw)
    if method == "brute":
        return BruteForceIndex(pts, **kw)
    if method == "kdtree":
        try:
            from pointalign.search.kdtree import KDTreeIndex
        except ImportError:  # no k-d tree module: a grid (cells of the distance, or automatic)
            pass
        else:
            return KDTreeIndex(pts, **kw)
    from pointalign.search.grid import VoxelGridIndex

    return VoxelGridIndex(pts, distance, **kw)


def choose_batch_index(points: torch.Tensor, lengths: Any, *,
                       max_distance: float | None = None) -> Index | None:
    """One index over B problems' different targets ``points (B, M, 3)``, or None.

    On a device: a :class:`~pointalign.search.packed.PackedIndex` (the problems side by side
    in a lattice, one build and one query per iteration for the whole batch, where B
    indexes cost B builds and B small launches per iteration: 1,000 bunny-size ICP pairs on
    an H200 spent 1.4 s building and ~50 ms per iteration querying); its inner index is the
    one :func:`choose_index` picks for that many points, judging the cell size on the first
    problem (the lattice's empty space would inflate an automatic cell). In host memory
    (SciPy's tree per problem is cheap there) and for one problem: None, build per problem.

    Args:
        points: ``(B, M, 3)`` checked float tensor, problem b's first ``lengths[b]`` rows.
        lengths: ``(B,)`` int array, each >= 1.
        max_distance: the largest ``nearest_within`` bound to be asked, or None.

    """
    plan = search_plan(points)
    if plan.host_tree or points.shape[0] < 2:
        return None
    from pointalign.search.packed import PackedIndex

    n0 = int(lengths[0])
    auto = None
    if max_distance is not None:
        from pointalign.search.grid import auto_cell_size

        auto = auto_cell_size(points[0, :n0])
    total = int(sum(int(n) for n in lengths))
    method = index_method(plan, total, max_distance, auto)
    return PackedIndex(points, lengths, max_distance=max_distance,
                       build=lambda p: _build(method, p, max_distance))


def probe_index(points: torch.Tensor, queries: int, *, index: Index | None = None) -> Index:
    """Return the index for ``queries`` (a few thousand) queries over checked ``points (M, 3)``.

    A final pose's stability sample (:func:`pointalign.registration._edge.measured_stability`)
    asks ~2,000 nearest neighbours and ~2,000 k-NN once, so no build should cost more than
    those queries. In host memory: SciPy's cKDTree (a build of ms; a method's own tree there
    is a PyTorch traversal, 0.5 s for the sample on a 70k-point LiDAR target). On a device:
    the method's own ``index`` when it holds one over these points, else brute force up to
    ``PROBE_BRUTE_MAX_PAIRS`` query-point pairs (no build: a voxel grid's build and its
    cell-size measurement cost 7 ms of launches and synchronisations on an H200 at 5k points,
    a k-d tree's 10 ms at 40k, where 2,048 brute-force queries take well under 1 ms), else
    the k-d tree.
    """
    plan = search_plan(points)
    if plan.host_tree:
        from pointalign.search.ckdtree import CKDTreeIndex

        return index if isinstance(index, CKDTreeIndex) else CKDTreeIndex(points)
    if index is not None:
        return index
    if points.shape[0] * queries <= PROBE_BRUTE_MAX_PAIRS:
        return BruteForceIndex(points)
    return _choose(points, None)


# ------------------------------------------------------------------ correspondence_index


def tier_cells(max_distance: float, auto_cell: float) -> list[float]:
    """List the tiers' cell sizes for a bound (pure): ``TIER_BASE * 4**j * auto_cell``.

    At most ``TIERS`` of them, ascending, each at most half of ``max_distance``.
    """
    out = []
    for j in range(TIERS):
        cell = TIER_BASE * 4**j * auto_cell
        if cell > max_distance / 2:
            break
        out.append(cell)
    return out


def wants_tiers(plan: kernels.SearchPlan, index: Index, auto_cell: float) -> bool:
    """Tell whether fine grid tiers in front of ``index`` pay (see the module table)."""
    from pointalign.search.grid import VoxelGridIndex

    if not plan.fused or index.uses_hint or isinstance(index, BruteForceIndex):
        return False
    return not (isinstance(index, VoxelGridIndex)
                and index.cell_size <= GRID_MAX_RATIO * auto_cell)


class _Tiers:
    """What the tiers of one index keep: its automatic cell and the tier grids built so far."""

    def __init__(self, points: torch.Tensor, auto_cell: float | None = None):
        from pointalign.search.grid import auto_cell_size

        self.auto_cell = auto_cell_size(points) if auto_cell is None else auto_cell
        self.grids: dict[float, Any] = {}


#: per index, weakly (dropped with the index; the grids hold the points, not the index):
#: built once and reused, so that the :class:`TieredIndex` of every call over one index
#: reads the same tensors and compares equal (a CUDA graph captured on one is replayed for
#: the later ones)
_tier_cache: weakref.WeakKeyDictionary[Any, _Tiers] = weakref.WeakKeyDictionary()


def correspondence_index(index: Index, max_distance: float) -> Index:
    """Return what ICP should query for nearest-within-``max_distance`` correspondences.

    ``index`` itself, or a :class:`TieredIndex` that first asks fine voxel grids ("tiers",
    built over the same points once per index and cached) and sends only the queries they
    cannot answer on to ``index`` (see the module table for when tiers pay). Either way,
    ``nearest_within(query, max_distance, hint=...)`` gives the same answer as
    ``index.nearest_within``; inside :func:`~pointalign._validate.trusted` it does not
    synchronise (capture safe, static shapes).

    Args:
        index: an :class:`~pointalign.search.base.Index` over the target.
        max_distance: the bound the correspondences will be searched with (> 0).

    Returns:
        An :class:`~pointalign.search.base.Index` over ``index.points``.

    """
    md = _checks.check_distance(max_distance, "max_distance")
    pts = index.points
    plan = search_plan(pts)
    if not plan.fused or index.uses_hint or isinstance(index, BruteForceIndex):
        return index  # decided before measuring the automatic cell
    try:
        cache = _tier_cache.get(index)
        if cache is None:
            cache = _tier_cache[index] = _Tiers(pts)
    except TypeError:  # an index that cannot be weakly referenced: no cache, no tiers
        return index
    if not wants_tiers(plan, index, cache.auto_cell):
        return index
    cells = tier_cells(md, cache.auto_cell)
    if not cells:
        return index
    from pointalign.search.grid import VoxelGridIndex

    for c in cells:
        if c not in cache.grids:
            cache.grids[c] = VoxelGridIndex(pts, c)
    return TieredIndex(index, tuple(cache.grids[c] for c in cells))


@dataclasses.dataclass(frozen=True)
class TieredIndex:
    """An index behind fine voxel grids for ``nearest_within`` (ICP's correspondences).

    A query whose nearest point in tier ``j`` (a :class:`~pointalign.search.grid.VoxelGridIndex`
    over the same points, finest first) lies within that grid's cell is answered there,
    exactly: every closer point is in its 27 cells. The others go on to the next tier and
    finally to ``index``; queries already answered are sent on as a far-away point, which
    every index rejects at once, so shapes stay static (no compaction, no synchronisation).
    Tiers with cells larger than the requested bound are skipped, so the answer equals
    ``index.nearest_within`` for every bound. ``knn`` and ``radius`` go to ``index``.

    A frozen dataclass: two wrappers of the same index and tier grids are equal and hash
    alike (an executor's graph signature names them by their fields), and the wrapper keeps
    no state of its own.

    Attributes:
        index: the index behind the tiers.
        tiers: grid indexes over ``index.points``, ascending cell size.

    """

    index: Any
    tiers: tuple[Any, ...]

    @property
    def points(self) -> torch.Tensor:
        """The ``(M, 3)`` points of ``index``."""
        return self.index.points

    @property
    def uses_hint(self) -> bool:
        """Whether ``index`` reads hints (passed on to it)."""
        return bool(self.index.uses_hint)

    def __repr__(self) -> str:
        cells = ", ".join(f"{t.cell_size:.4g}" for t in self.tiers)
        return f"TieredIndex({self.index!r}, tiers=[{cells}])"

    def knn(self, query: Any, k: int) -> KnnResult:
        """``index.knn``."""
        return self.index.knn(query, k)

    def radius(self, query: Any, r: float, max_neighbors: int) -> KnnResult:
        """``index.radius``."""
        return self.index.radius(query, r, max_neighbors)

    def nearest_within(self, query: Any, max_distance: float, *,
                       hint: torch.Tensor | None = None) -> KnnResult:
        """Nearest point within ``max_distance``: ``(N, 1)``; the tiers first, then the index.

        Answers of the stages are disjoint (``-1`` / ``inf`` where a stage has none), so they
        merge by an element-wise maximum of the indices and minimum of the distances.
        """
        md = _checks.check_distance(max_distance, "max_distance")
        q = _checks.query_points(query, self.points)
        found: KnnResult | None = None
        for g in self.tiers:
            if g.cell_size > md:
                break
            r = g.nearest_within(q, g.cell_size)
            found = r if found is None else _merge(found, r)
            q = torch.where(r.idx >= 0, _FAR, q)
        last = self.index.nearest_within(q, md, hint=hint)
        return last if found is None else _merge(found, last)


def _merge(a: KnnResult, b: KnnResult) -> KnnResult:
    """Merge two disjoint ``(N, 1)`` answers (each ``inf`` / ``-1`` where the other has one)."""
    return KnnResult(torch.minimum(a.dists, b.dists), torch.maximum(a.idx, b.idx))


# --------------------------------------------------------------------------- query_order


def query_order(points: torch.Tensor) -> torch.Tensor | None:
    """Return the order to send ``points (N, 3)`` as queries in, or None to keep theirs.

    From ``SPATIAL_ORDER_MIN`` points on: the permutation ``(N,)`` int64 along a Morton
    (Z-order) curve (:func:`pointalign.kernels.grid.morton_order`; one sort), so that
    neighbouring lanes of the search kernels visit the same cells or tree nodes; callers
    permute their queries once (``x[order]``) and use it for every query of that set (the
    trusted ``nearest_within`` paths do not re-sort). Below that: None.
    """
    if points.shape[0] < SPATIAL_ORDER_MIN:
        return None
    return _grid.morton_order(points)


__all__ = ["AUTO_BRUTE_MAX_POINTS", "GRID_MAX_RATIO", "SPATIAL_ORDER_MIN", "TIERS",
           "TIER_BASE", "TieredIndex", "choose_index", "correspondence_index", "index_method",
           "one_index_serves_every_bound", "query_order", "search_plan", "tier_cells",
           "wants_tiers"]
