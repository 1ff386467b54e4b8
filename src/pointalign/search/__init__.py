"""Nearest-neighbour search: indexes behind one protocol, and :func:`build_index`.

Every index implements :class:`~pointalign.search.base.Index` (``knn``, ``radius``,
``nearest_within`` with an optional hint, ``uses_hint``, ``points``) and returns
:class:`~pointalign.search.base.KnnResult` with squared distances and ``-1`` for "no
neighbour". Which index serves a cloud is decided in one place,
:mod:`pointalign.search.policy`; the indexes call only the kernel layer's entry points.
"""

from __future__ import annotations

from typing import Any

import torch

from pointalign import _validate
from pointalign.search import _checks
from pointalign.search import policy as _policy
from pointalign.search.base import Index, KnnResult
from pointalign.search.brute import BruteForceIndex
from pointalign.search.policy import AUTO_BRUTE_MAX_POINTS, choose_index

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
    * ``"auto"``: :func:`pointalign.search.policy.choose_index` with ``max_distance`` (or
      ``cell_size``, which then also sets the grid's cells): SciPy's cKDTree for points in
      host memory; on a GPU a voxel grid when that distance is at most ``GRID_MAX_RATIO``
      (8) automatic cells, else brute force up to ``AUTO_BRUTE_MAX_POINTS`` points, else
      the k-d tree.

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
        return _policy._choose(pts, cell_size if cell_size is not None else max_distance, **kw)
    if method == "brute":
        return BruteForceIndex(pts, **kw)
    if method == "ckdtree":
        from pointalign.search.ckdtree import CKDTreeIndex

        return CKDTreeIndex(pts, **kw)
    if method == "grid":
        from pointalign.search.grid import VoxelGridIndex

        return VoxelGridIndex(pts, cell_size if cell_size is not None else max_distance, **kw)
    return _kdtree_class()(pts, **kw)


__all__ = ["AUTO_BRUTE_MAX_POINTS", "METHODS", "BruteForceIndex", "CKDTreeIndex", "Index",
           "KnnResult", "VoxelGridIndex", "build_index", "choose_index"]
