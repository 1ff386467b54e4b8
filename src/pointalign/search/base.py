"""The Index protocol every nearest-neighbour backend implements.

An index is built once from ``points (M, 3)`` (the target) and queried many times, across
ICP iterations and calls. All queries take ``query (N, 3)`` on the index's device and
return a :class:`KnnResult`:

* ``dists (N, k)`` float: **squared** Euclidean distances, ascending along the last axis;
  ``inf`` where there is no neighbour.
* ``idx (N, k)`` int64: indices into the index's points; ``-1`` where there is no neighbour
  (fewer than k points in range, or none within ``max_distance``).

The three queries are those ICP, RANSAC and FPFH use: ``knn`` (normals), ``radius`` (FPFH's
hybrid search, normals) and ``nearest_within`` (correspondences, hypothesis scores).

Checked and trusted calls. Outside :func:`pointalign._validate.trusted` every call checks
its arguments (shapes, dtypes, devices, values; NaN/Inf scans of the query, each a device
synchronisation on a GPU) and raises ``ValueError``/``TypeError`` naming the argument.
Inside ``trusted()`` the caller vouches that the query is a finite ``(N, 3)`` tensor of the
index's dtype and device (points moved by finite transforms), that ``max_distance > 0`` and
that a ``hint`` holds valid indices: data-dependent checks are skipped (cheap metadata checks
may stay) and ``nearest_within`` takes its fastest path, which on a GPU **never
synchronises with the host and allocates only tensors whose shapes follow from the query's
shape**, so that it may run inside CUDA-graph capture, every ICP iteration. On that path an
index may also take the queries in the given order instead of grouping them by cell or
leaf: pass them in a spatially coherent order for speed
(:func:`pointalign.search.policy.query_order`). The answer is the same on both paths.
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
    """A spatial index over ``points (M, 3)``; see the module docstring for the contract.

    Attributes:
        points: the ``(M, 3)`` float tensor the index was built over (its device and dtype
            are those of every query and result).
        uses_hint: whether :meth:`nearest_within` reads its ``hint`` (today only the k-d
            tree, whose search starts from the hint's distance). Callers keep a hint up to
            date only when this is True; other indexes ignore it.

    """

    @property
    def points(self) -> torch.Tensor:
        """The ``(M, 3)`` points (read-only for callers)."""
        ...

    @property
    def uses_hint(self) -> bool:
        """Whether :meth:`nearest_within` reads its ``hint``."""
        ...

    def knn(self, query: torch.Tensor, k: int) -> KnnResult:
        """Find the k nearest points of each ``query (N, 3)``: ``dists, idx (N, k)``.

        ``k`` must be an integer in ``[1, M]``.
        """
        ...

    def radius(self, query: torch.Tensor, r: float, max_neighbors: int) -> KnnResult:
        """Find up to ``max_neighbors`` nearest points within ``r`` of each ``query (N, 3)``.

        ``r`` is a distance (not squared). Returns ``(N, max_neighbors)``, padded with
        ``inf`` / ``-1``.
        """
        ...

    def nearest_within(self, query: torch.Tensor, max_distance: float, *,
                       hint: torch.Tensor | None = None) -> KnnResult:
        """Find the nearest point within ``max_distance`` (not squared) of each ``query (N, 3)``.

        Returns ``(N, 1)`` results, ``inf`` / ``-1`` where no point is that close.
        ``hint``: optional ``(N,)`` int64 indices into the points (``-1``: none), a
        candidate per query such as ICP's last correspondence; read only when
        :attr:`uses_hint` is True, and it never changes the answer, only the work.
        """
        ...
