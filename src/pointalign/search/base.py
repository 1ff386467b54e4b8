"""The Index protocol every nearest-neighbour backend implements.

An index is built once from ``points (M, 3)`` (the target) and queried many times, across
ICP iterations and calls. All queries take ``query (N, 3)`` on the index's device and
return a :class:`KnnResult`:

* ``dists (N, k)`` float: **squared** Euclidean distances, ascending along the last axis;
  ``inf`` where there is no neighbour.
* ``idx (N, k)`` int64: indices into the index's points; ``-1`` where there is no neighbour
  (fewer than k points in range, or none within ``max_distance``).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import torch


class KnnResult(NamedTuple):
    """Neighbours of each query point: squared distances and indices (-1 = none)."""

    dists: torch.Tensor
    idx: torch.Tensor


@runtime_checkable
class Index(Protocol):
    """A spatial index over ``points (M, 3)``; see the module docstring for the contract."""

    points: torch.Tensor

    def knn(self, query: torch.Tensor, k: int) -> KnnResult:
        """The k nearest points of each query: ``dists, idx`` of shape ``(N, k)``."""
        ...

    def radius(self, query: torch.Tensor, r: float, max_neighbors: int) -> KnnResult:
        """Up to ``max_neighbors`` nearest points within distance ``r`` (not squared) of each
        query: ``(N, max_neighbors)``, padded with ``inf`` / ``-1``.
        """
        ...

    def nearest_within(self, query: torch.Tensor, max_distance: float) -> KnnResult:
        """The nearest point within ``max_distance`` (not squared): ``(N, 1)``; -1 if none."""
        ...
