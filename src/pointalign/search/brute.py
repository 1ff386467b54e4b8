"""Exact nearest-neighbour search by tiled brute force (every query against every point).

O(N M) work, no build cost, coalesced memory access: the fastest exact search on the GPU for
small targets, and the reference the other indexes are tested against. The "GPU naive"
search of the CUDA ICP project (Sharma, CIS 565 Project 4); tiles go through
:func:`pointalign.kernels.knn.knn_tiles` (fused Triton kernel on CUDA).
"""

from __future__ import annotations

from typing import Any

import torch

from pointalign.kernels import knn as _knn
from pointalign.kernels._backend import backend
from pointalign.search import _checks
from pointalign.search.base import KnnResult


class BruteForceIndex:
    """Brute-force :class:`~pointalign.search.base.Index` over ``points (M, 3)``.

    Args:
        points: ``(M, 3)`` array, tensor or PointCloud (kept on its device; float64 stays
            float64, other dtypes become float32). Not copied when already a float tensor.
        device: optional device to move the points to.

    ``knn`` with ``k > M`` raises ``ValueError``; ``radius`` pads with ``inf`` / ``-1``.

    """

    def __init__(self, points: Any, *, device: str | torch.device | None = None):
        self.points = _checks.index_points(points, device=device)
        self._points_t: torch.Tensor | None = None  # (3, M) copy for the Triton kernel

    def __repr__(self) -> str:
        return f"BruteForceIndex(M={self.points.shape[0]}, device={self.points.device})"

    def knn(self, query: Any, k: int) -> KnnResult:
        """The k nearest points of each query: ``dists (N, k)`` squared, ``idx (N, k)``."""
        k = _checks.check_k(k, self.points.shape[0])
        q = _checks.query_points(query, self.points)
        return KnnResult(*_knn.knn_tiles(q, self.points, k))

    def radius(self, query: Any, r: float, max_neighbors: int) -> KnnResult:
        """Up to ``max_neighbors`` nearest points within distance ``r``: ``(N, max_neighbors)``."""
        r = _checks.check_distance(r, "r")
        k = _checks.check_k(max_neighbors, self.points.shape[0], "max_neighbors",
                            allow_more=True)
        q = _checks.query_points(query, self.points)
        return KnnResult(*_knn.knn_tiles(q, self.points, k, r * r))

    def nearest_within(self, query: Any, max_distance: float) -> KnnResult:
        """Nearest point within ``max_distance``: ``(N, 1)``, ``-1`` / ``inf`` if none."""
        md = _checks.check_distance(max_distance, "max_distance")
        q = _checks.query_points(query, self.points)
        return KnnResult(*_knn.knn_tiles(q, self.points, 1, md * md))

    def nearest_within_unchecked(self, query: torch.Tensor, max_distance: float
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """ICP's fast path of :meth:`nearest_within`: ``(dists (N,), idx (N,))`` (-1 = none).

        No argument checks; on the Triton path the kernel reads a structure-of-arrays copy
        of the points kept from the first call. ``query`` must be a finite contiguous
        ``(N, 3)`` tensor of the points' dtype and device, ``max_distance > 0``.
        """
        md2 = float(max_distance) ** 2
        if query.shape[0] and backend(query) == "triton":
            from pointalign.kernels import _knn_triton

            if self._points_t is None:
                self._points_t = self.points.t().contiguous()
            d, i = _knn_triton.knn(query, self.points, 1, md2, points_t=self._points_t)
        else:
            d, i = _knn.knn_tiles(query, self.points, 1, md2)
        return d[:, 0], i[:, 0]
