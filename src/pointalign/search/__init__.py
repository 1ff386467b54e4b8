"""Nearest-neighbour search: indexes behind one protocol, and :func:`build_index`.

Every index implements :class:`~pointalign.search.base.Index` (``knn``, ``radius``,
``nearest_within``) and returns :class:`~pointalign.search.base.KnnResult` with squared
distances and ``-1`` for "no neighbour".
"""

from __future__ import annotations

from typing import Any

import torch

from pointalign import _validate
from pointalign.search import _checks
from pointalign.search.base import Index, KnnResult
from pointalign.search.brute import BruteForceIndex

#: On CUDA, "auto" picks brute force up to this many target points (no build cost, and the
#: fused kernel beats tree traversal there); tuned from benchmarks/bench_knn.py.
AUTO_BRUTE_MAX_POINTS = 20_000

#: "auto" uses the grid only when the cloud spans at least this many cells along its longest
#: axis: with fewer, the 27 cells around a query hold a large share of the cloud and the
#: fused brute force / k-d tree do less work (a guess to tune from benchmarks/bench_knn.py).
AUTO_GRID_MIN_CELLS = 8

METHODS = ("auto", "brute", "grid", "kdtree", "ckdtree")


def __getattr__(name: str) -> Any:
    # lazy: the grid pulls in its kernels, cKDTree pulls in SciPy
    if name == "VoxelGridIndex":
        from pointalign.search.grid import VoxelGridIndex

        return VoxelGridIndex
    if name == "CKDTreeIndex":
        from pointalign.search.ckdtree import CKDTreeIndex

        return CKDTreeIndex
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _kdtree_class():
    try:
        from pointalign.search.kdtree import KDTreeIndex
    except ImportError as exc:
        raise ValueError(
            "method: 'kdtree' is not available (pointalign.search.kdtree could not be "
            f"imported: {exc}); use method='brute', 'grid' or 'ckdtree'") from exc
    return KDTreeIndex


@_validate.out_of_memory_is_clear
def build_index(points: Any, method: str = "auto", *, cell_size: float | None = None,
                max_distance: float | None = None, device: str | torch.device | None = None,
                **kw: Any) -> Index:
    """Build a nearest-neighbour index over ``points (M, 3)`` to query many times.

    Methods:
    * ``"brute"``: :class:`~pointalign.search.brute.BruteForceIndex`, tiled exact brute force
      (fused Triton kernel on CUDA); O(N M) per query batch, no build.
    * ``"grid"``: :class:`~pointalign.search.grid.VoxelGridIndex` with ``cell_size`` (default:
      ``max_distance``, else chosen from the point density); fastest for ICP with a maximum
      correspondence distance (``nearest_within``), exact for every query.
    * ``"kdtree"``: :class:`pointalign.search.kdtree.KDTreeIndex` (flat k-d tree on device).
    * ``"ckdtree"``: :class:`~pointalign.search.ckdtree.CKDTreeIndex`, SciPy's cKDTree on the
      host with all cores; results come back on the points' device.
    * ``"auto"``: points on the CPU -> ``"ckdtree"``; on a GPU -> ``"grid"`` when
      ``cell_size`` or ``max_distance`` is given and the cloud spans at least
      ``AUTO_GRID_MIN_CELLS`` such cells, else ``"brute"`` when ``M <= AUTO_BRUTE_MAX_POINTS``,
      else ``"kdtree"`` when it imports, else ``"grid"`` (automatic cell).

    Args:
        points: ``(M, 3)`` array, tensor or PointCloud; non-empty and finite.
        method: one of ``"auto"``, ``"brute"``, ``"grid"``, ``"kdtree"``, ``"ckdtree"``.
        cell_size: grid cell edge (same units as the points), > 0.
        max_distance: the largest query distance expected (used by ``"auto"``/``"grid"``).
        device: move the points to this device first (default: keep theirs).
        **kw: passed to the index class.

    Returns:
        An object implementing :class:`~pointalign.search.base.Index`. Queries must be on
        the index's device; ``knn`` with ``k`` larger than M raises ``ValueError``.

    """
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if cell_size is not None:
        cell_size = _checks.check_distance(cell_size, "cell_size")
    if max_distance is not None:
        max_distance = _checks.check_distance(max_distance, "max_distance")
    pts = _checks.index_points(points, device=device)
    if method == "auto":
        cs = cell_size if cell_size is not None else max_distance
        on_cpu = pts.device.type == "cpu"
        span = float((pts.amax(0) - pts.amin(0)).max()) if cs is not None and not on_cpu else 0.0
        if on_cpu:
            method = "ckdtree"
        elif cs is not None and span >= AUTO_GRID_MIN_CELLS * cs:
            method = "grid"
        elif pts.shape[0] <= AUTO_BRUTE_MAX_POINTS:
            method = "brute"
        else:
            try:
                _kdtree_class()
                method = "kdtree"
            except ValueError:
                method, cell_size, max_distance = "grid", None, None
    if method == "brute":
        return BruteForceIndex(pts, **kw)
    if method == "ckdtree":
        from pointalign.search.ckdtree import CKDTreeIndex

        return CKDTreeIndex(pts, **kw)
    if method == "grid":
        from pointalign.search.grid import VoxelGridIndex

        return VoxelGridIndex(pts, cell_size if cell_size is not None else max_distance, **kw)
    return _kdtree_class()(pts, **kw)


__all__ = ["AUTO_BRUTE_MAX_POINTS", "AUTO_GRID_MIN_CELLS", "METHODS", "BruteForceIndex",
           "CKDTreeIndex", "Index", "KnnResult", "VoxelGridIndex", "build_index"]
