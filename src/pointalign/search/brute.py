"""Exact nearest-neighbour search by tiled brute force (every query against every point).

O(N M) work, no build cost, coalesced memory access: the fastest exact search on the GPU for
small targets, and the reference the other indexes are tested against. The "GPU naive"
search of the CUDA ICP project (Sharma, CIS 565 Project 4); tiles go through
:func:`pointalign.kernels.knn.knn_tiles` (fused Triton kernel on CUDA), self-queries of
``radius`` through :func:`pointalign.kernels.knn.radius_tiles`.
"""

from __future__ import annotations

from typing import Any

import torch

from pointalign.kernels import knn as _knn
from pointalign.search import _checks
from pointalign.search.base import KnnResult


class BruteForceIndex:
    """Brute-force :class:`~pointalign.search.base.Index` over ``points (M, 3)``.

    Args:
        points: ``(M, 3)`` array, tensor or PointCloud (kept on its device; float64 stays
            float64, other dtypes become float32). Not copied when already a float tensor.
        device: optional device to move the points to.

    ``knn`` with ``k > M`` raises ``ValueError``; ``radius`` pads with ``inf`` / ``-1``. The
    layout the fused kernel reads (:func:`pointalign.kernels.knn.points_layout`) is made once,
    at the first query, so that no query copies the points (and an index only held, such
    as a stability probe's that a fused kernel serves, costs nothing). ``nearest_within``
    ignores ``hint``.

    """

    uses_hint = False

    def __init__(self, points: Any, *, device: str | torch.device | None = None):
        self.points = _checks.index_points(points, device=device)
        self._made: tuple[torch.Tensor | None] | None = None

    @property
    def _layout(self) -> torch.Tensor | None:
        if self._made is None:
            self._made = (_knn.points_layout(self.points),)
        return self._made[0]

    def __repr__(self) -> str:
        return f"BruteForceIndex(M={self.points.shape[0]}, device={self.points.device})"

    # ------------------------------------------------------------------ CUDA graphs
    def graph_arrays(self) -> tuple[tuple, dict[str, torch.Tensor]]:
        """Return ``(key, arrays)``: the tensors a captured search reads, and their layout.

        ``arrays``: ``points (M, 3)`` and, where the fused kernel reads one, its ``layout``
        ``(3, M)`` (made here if no query has made it yet); ``key``: every array's name,
        shape, dtype and device. Two indexes with one key are interchangeable in a captured
        CUDA graph once the one's arrays are copied into the other's: the executor
        (:mod:`pointalign.kernels._loop`) keeps an ICP step's graph across calls that each
        build a new index, as ``register()``'s coarse stage does.
        """
        arrays = {"points": self.points}
        if self._layout is not None:
            arrays["layout"] = self._layout
        return ("BruteForceIndex", _checks.array_layout(arrays)), arrays

    def with_arrays(self, arrays: dict[str, torch.Tensor]) -> BruteForceIndex:
        """Return a copy of this index that reads ``arrays`` (laid out as :meth:`graph_arrays`).

        Raises:
            ValueError: ``arrays`` with other names, shapes, dtypes or devices.

        """
        _checks.check_arrays(arrays, self.graph_arrays()[1])
        new = object.__new__(BruteForceIndex)
        new.points, new._made = arrays["points"], (arrays.get("layout"),)
        return new

    def scoring_layout(self) -> torch.Tensor | None:
        """Return the ``(3, M)`` points the fused RANSAC scoring reads, or None.

        :func:`pointalign.kernels.ransac.score_transforms` scores motions against this index
        by brute force in one Triton launch where the kernel layer lays the points out for
        its Triton kernels (on CUDA), instead of moving the points and asking
        :meth:`nearest_within`.
        """
        return self._layout

    def knn(self, query: Any, k: int) -> KnnResult:
        """Find the k nearest points of each query: ``dists (N, k)`` squared, ``idx (N, k)``."""
        k = _checks.check_k(k, self.points.shape[0])
        q = _checks.query_points(query, self.points)
        return KnnResult(*_knn.knn_tiles(q, self.points, k, points_t=self._layout))

    def radius(self, query: Any, r: float, max_neighbors: int) -> KnnResult:
        """Up to ``max_neighbors`` nearest points within distance ``r``: ``(N, max_neighbors)``.

        The self-query (``query`` is :attr:`points`) has no cap on ``max_neighbors`` in its
        fused path (FPFH's 100 neighbours).
        """
        r = _checks.check_distance(r, "r")
        k = _checks.check_k(max_neighbors, self.points.shape[0], "max_neighbors",
                            allow_more=True)
        q = _checks.query_points(query, self.points)
        return KnnResult(*_knn.radius_tiles(q, self.points, r, k, points_t=self._layout))

    def nearest_within(self, query: Any, max_distance: float, *,
                       hint: torch.Tensor | None = None) -> KnnResult:
        """Nearest point within ``max_distance``: ``(N, 1)``, ``-1`` / ``inf`` if none.

        Inside :func:`~pointalign._validate.trusted`: no argument checks, one kernel launch
        on the GPU (no synchronisation). ``hint`` is ignored.
        """
        md = _checks.check_distance(max_distance, "max_distance")
        q = _checks.query_points(query, self.points)
        _checks.check_hint(hint, q.shape[0], self.points, values=False)
        return KnnResult(*_knn.knn_tiles(q, self.points, 1, md * md, points_t=self._layout))
