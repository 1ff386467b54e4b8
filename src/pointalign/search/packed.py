"""One index over the targets of many problems: each problem moved to its own lattice cell.

A batch of B registration problems with B different targets (``register_many``, batched
``icp``) would otherwise build B indexes and send B small queries per iteration (1,000
bunny-size pairs on an H200: 1.4 s of builds, 50 ms of tiny kernels per iteration). Here
problem b's points are shifted by ``shift[b]`` into cell b of a cubic lattice whose
spacing ``L = 3 D + 4 d`` (D: the largest bounding-box edge of any problem, d: the largest
query distance) keeps every problem farther from the others than from itself, and one
index is built over the union; a query row of problem b is shifted the same way, and an
answer in another problem is dropped (``-1``). That makes every answer the one problem b's
own index gives:

* ``nearest_within(q, r)`` with ``r <= d``: a query with an own point within r lies within
  r of b's box, and every other problem's point at least ``L - D - r > r`` from it;
* ``knn(q, k)`` for queries inside b's box (the target's own points, as the normals and
  the stability sample ask): the own points lie within ``√3 D`` of the query, the others
  at least ``L - D > √3 D`` away; with fewer than k own points the missing columns are
  ``-1``, as for a small target.

Queries arrive as ``(B·n, 3)`` in problem order (n rows per problem; what a
``(B, n, 3)`` tensor reshapes to), or in any order with ``problem=`` naming each row's
problem (``register_many``'s batched RANSAC: a different number of motions per problem),
and indices come back local to each problem's ``(M_b, 3)`` points. Distances are
measured on the shifted coordinates: a lattice of
extent E rounds them to float32's ulp at E (0.5 µm at 6 m, a thousand bunny pairs), so a
near-tie may be broken the other way than by the problem's own index.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pointalign.search import _checks
from pointalign.search.base import Index, KnnResult


class PackedIndex:
    """:class:`~pointalign.search.base.Index` over ``points (B, M, 3)`` with ``lengths (B,)``.

    Args:
        points: ``(B, M, 3)`` float tensor, problem b's first ``lengths[b]`` rows valid
            (finite; the rest is padding and never returned).
        lengths: ``(B,)`` int array of valid rows, each >= 1.
        max_distance: the largest ``nearest_within`` bound the index will be asked (None:
            ``knn`` only).
        build: makes the inner index over the packed ``(Σ M_b, 3)`` points (the search
            policy's choice).

    ``points`` is the packed table (shifted coordinates); ``problems`` is B. Queries must
    have a multiple of B rows; ``hint`` is ignored.

    """

    uses_hint = False

    def __init__(self, points: torch.Tensor, lengths: Any, *, max_distance: float | None,
                 build: Callable[[torch.Tensor], Index]):
        B, M = int(points.shape[0]), int(points.shape[1])
        dev = points.device
        n = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if n.shape[0] != B or (n < 1).any() or (n > M).any():
            raise ValueError(f"lengths: expected {B} values in [1, {M}], got {n.tolist()}")
        counts = torch.from_numpy(n).to(dev)
        valid = torch.arange(M, device=dev)[None, :] < counts[:, None]           # (B, M)
        lo = torch.where(valid[..., None], points, math.inf).amin(1)             # (B, 3)
        hi = torch.where(valid[..., None], points, -math.inf).amax(1)
        span = float((hi - lo).amax())  # one synchronisation, at build time
        d = 0.0 if max_distance is None else float(max_distance)
        spacing = 3.0 * span + 4.0 * d + max(span, d, 1.0) * 1e-3
        side = max(1, math.ceil(round(B ** (1.0 / 3.0), 9)))
        b = torch.arange(B, device=dev)
        cell = torch.stack([b % side, (b // side) % side, b // (side * side)], -1)
        self.shift = cell.to(points.dtype) * spacing - lo                        # (B, 3)
        self.problems = B
        self.problem_of = b[:, None].expand(B, M)[valid]                         # (P,)
        self.local_row = torch.arange(M, device=dev)[None, :].expand(B, M)[valid]
        self.points = (points + self.shift[:, None]).reshape(-1, 3)[valid.reshape(-1)]
        self.inner = build(self.points.contiguous())

    def __repr__(self) -> str:
        return f"PackedIndex(problems={self.problems}, points={self.points.shape[0]}, " \
               f"inner={type(self.inner).__name__})"

    def _shifted(self, query: Any, problem: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Shift ``query (Q, 3)`` into the lattice; also return each row's problem ``(Q,)``.

        ``problem``: ``(Q,)`` int64, each row's problem; None: ``Q = B·n`` in problem order.
        """
        q = _checks.query_points(query, self.points)
        if problem is not None:
            if problem.shape != (q.shape[0],):
                raise ValueError(f"problem: expected ({q.shape[0]},) problem indices, got "
                                 f"{tuple(problem.shape)}")
            return q + self.shift[problem], problem
        B = self.problems
        if q.shape[0] % B:
            raise ValueError(f"query: expected a multiple of {B} rows (n per problem, in "
                             f"problem order), got {q.shape[0]}")
        n = q.shape[0] // B
        prob = torch.arange(B, device=q.device)[:, None].expand(B, n).reshape(-1)
        return (q.view(B, n, 3) + self.shift[:, None]).reshape(-1, 3), prob

    def _own(self, r: KnnResult, prob: torch.Tensor) -> KnnResult:
        """Keep the answers in each query's own problem, as local rows; others become -1."""
        j = r.idx.clamp_min(0)
        own = (r.idx >= 0) & (self.problem_of[j] == prob[:, None])
        return KnnResult(torch.where(own, r.dists, math.inf),
                         torch.where(own, self.local_row[j], -1))

    def knn(self, query: Any, k: int, *, problem: torch.Tensor | None = None) -> KnnResult:
        """Find the k nearest own points of each query row: ``(B·n, k)``, local indices."""
        q, prob = self._shifted(query, problem)
        return self._own(self.inner.knn(q, k), prob)

    def radius(self, query: Any, r: float, max_neighbors: int, *,
               problem: torch.Tensor | None = None) -> KnnResult:
        """Find up to ``max_neighbors`` own points within ``r`` (``r`` at most ``max_distance``)."""
        q, prob = self._shifted(query, problem)
        return self._own(self.inner.radius(q, r, max_neighbors), prob)

    def nearest_within(self, query: Any, max_distance: float, *,
                       hint: torch.Tensor | None = None,
                       problem: torch.Tensor | None = None) -> KnnResult:
        """Find the nearest own point within ``max_distance`` (<= the build's): ``(B·n, 1)``."""
        q, prob = self._shifted(query, problem)
        return self._own(self.inner.nearest_within(q, max_distance), prob)
