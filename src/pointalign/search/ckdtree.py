"""SciPy ``cKDTree`` behind the :class:`~pointalign.search.base.Index` protocol (CPU search).

The tree is built on the host in float64 on first use (the "cpu" backend answers from the
kernel layer's host tree instead and never builds it) and queried with all cores (``workers=-1``);
squared distances are then recomputed from the coordinates in the points' dtype, so results
match :class:`~pointalign.search.brute.BruteForceIndex` exactly. Results come back on the
query's device (points on a GPU are copied to the host once, at build time).
Bentley, "Multidimensional binary search trees used for associative searching", CACM 1975.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from pointalign.search import _checks
from pointalign.search.base import KnnResult

#: nearest points kept per target point from a self-query (``_knn_cpu.CpuTree.set_candidates``)
CANDIDATES = 8


class CKDTreeIndex:
    """SciPy cKDTree index over ``points (M, 3)``; same contract as the other indexes.

    Args:
        points: ``(M, 3)`` array, tensor or PointCloud.
        device: optional device for ``points`` (queries must live there; search runs on CPU).
        leafsize: cKDTree leaf size.
        workers: threads for queries (-1: all cores).

    ``nearest_within`` starts from ``hint`` (the last correspondences) when the kernel
    layer's host tree answers it (the "cpu" backend); SciPy's tree ignores it. There, a
    ``knn`` or ``radius`` search of the index's own points (k > :data:`CANDIDATES`: the
    target normals of point-to-plane ICP, the neighbourhoods of FPFH) runs bottom-up and is
    kept as each point's candidate list, which answers most hinted queries near the surface
    without the tree (same results).

    """

    def __init__(self, points: Any, *, device: str | torch.device | None = None,
                 leafsize: int = 16, workers: int = -1):
        self.points = _checks.index_points(points, device=device)
        self._host = self.points.detach().cpu()
        self.leafsize = int(leafsize)
        self._scipy: Any = None
        self.workers = workers

    @property
    def _tree(self) -> Any:
        """SciPy's cKDTree, built on first use (the "cpu" backend's host tree never needs it)."""
        if self._scipy is None:
            from scipy.spatial import cKDTree

            self._scipy = cKDTree(self._host.to(torch.float64).numpy(), leafsize=self.leafsize)
        return self._scipy

    def _cpu_tree(self) -> Any:
        """Return the kernel layer's host tree (built on first use), or None off its backend."""
        from pointalign.kernels import knn

        if not knn.uses_host_tree(self._host):
            return None
        if getattr(self, "_cpu", None) is None:
            self._cpu = knn.host_tree(self._host)
        return self._cpu

    @property
    def host_tree(self) -> Any:
        """The kernel layer's host k-d tree where it answers searches ("cpu" backend), or None."""
        return self._cpu_tree()

    @property
    def uses_hint(self) -> bool:  # type: ignore[override]
        """True when the fast host tree answers ``nearest_within`` (it starts from hints)."""
        return self._cpu_tree() is not None

    def __repr__(self) -> str:
        return f"CKDTreeIndex(M={self.points.shape[0]}, device={self.points.device})"

    def _query(self, q: torch.Tensor, k: int, max_distance: float | None) -> KnnResult:
        """Search checked queries ``q (N, 3)`` (see :func:`_checks.query_points`)."""
        n, m = q.shape[0], self.points.shape[0]
        dev, dt = self.points.device, self.points.dtype
        if n == 0:
            return KnnResult(torch.full((0, k), math.inf, dtype=dt, device=dev),
                             torch.full((0, k), -1, dtype=torch.int64, device=dev))
        qh = q.detach().cpu()
        kk = min(k, m)
        tree = self._cpu_tree()
        if tree is not None:  # "cpu" backend: ordered by (distance, index) already
            md2 = None if max_distance is None else max_distance ** 2
            if self._is_self(qh):  # the self-query (normals): from each point's own leaf
                d, i = tree.knn_self(kk, md2)
                if kk > CANDIDATES:  # hinted searches reuse it (see set_candidates)
                    tree.set_candidates(d, i, CANDIDATES, bounded=md2 is not None)
            else:
                d, i = tree.knn(qh.numpy(), kk, md2)
            return self._pad(torch.from_numpy(d), torch.from_numpy(i), k, dt, dev)
        bound = math.inf if max_distance is None else max_distance * (1 + 1e-9) + 1e-300
        _, idx = self._tree.query(qh.to(torch.float64).numpy(), k=kk,
                                  distance_upper_bound=bound, workers=self.workers)
        idx = torch.from_numpy(np.asarray(idx, dtype=np.int64).reshape(n, kk))
        valid = idx < m
        safe = torch.where(valid, idx, torch.zeros_like(idx))
        d = (qh[:, None, :] - self._host[safe]).square().sum(-1)
        if max_distance is not None:
            valid &= d <= max_distance * max_distance
        d = torch.where(valid, d, torch.full_like(d, math.inf))
        idx = torch.where(valid, idx, torch.full_like(idx, -1))
        if kk == 1:  # one column: already in order
            return KnnResult(d.to(dev), idx.to(dev)) if k == 1 else self._pad(d, idx, k, dt, dev)
        # order by (squared distance, index), missing last
        key = torch.where(idx < 0, torch.iinfo(torch.int64).max, idx)
        o = torch.argsort(key, dim=1, stable=True)
        d, idx = d.gather(1, o), idx.gather(1, o)
        o = torch.argsort(d, dim=1, stable=True)
        d, idx = d.gather(1, o), idx.gather(1, o)
        return self._pad(d, idx, k, dt, dev)

    def _is_self(self, qh: torch.Tensor) -> bool:
        """Tell whether host queries ``qh (N, 3)`` are this index's points, in order."""
        p = self._host
        if qh.shape != p.shape or qh.dtype != p.dtype:
            return False
        return (qh.data_ptr() == p.data_ptr() and qh.stride() == p.stride()) \
            or torch.equal(qh, p)

    @staticmethod
    def _pad(d: torch.Tensor, idx: torch.Tensor, k: int, dt: torch.dtype,
             dev: torch.device) -> KnnResult:
        """Pad ``(n, kk)`` results to ``k`` columns (``inf`` / ``-1``) on ``dev``."""
        n, kk = idx.shape
        if kk < k:
            d = torch.cat([d, torch.full((n, k - kk), math.inf, dtype=dt)], 1)
            idx = torch.cat([idx, torch.full((n, k - kk), -1, dtype=torch.int64)], 1)
        return KnnResult(d.to(dev), idx.to(dev))

    def knn(self, query: Any, k: int) -> KnnResult:
        """Find the k nearest points of each query: ``dists (N, k)`` squared, ``idx (N, k)``."""
        k = _checks.check_k(k, self.points.shape[0])
        return self._query(_checks.query_points(query, self.points), k, None)

    def radius(self, query: Any, r: float, max_neighbors: int) -> KnnResult:
        """Up to ``max_neighbors`` nearest points within distance ``r``: ``(N, max_neighbors)``."""
        r = _checks.check_distance(r, "r")
        k = _checks.check_k(max_neighbors, self.points.shape[0], "max_neighbors",
                            allow_more=True)
        return self._query(_checks.query_points(query, self.points), k, r)

    def scoring_grid(self, max_distance: float, queries: int) -> Any:
        """Return the host tree's cell grid for ``queries`` queries within ``max_distance``.

        For the kernel layer's fused scoring (``kernels.ransac.score_transforms``): the
        ``_score_cpu.BoundGrid`` that :meth:`nearest_within` would answer such a call from
        (the same rule), or None (off the "cpu" backend, points not on the host, or the
        tree answers).
        """
        md = _checks.check_distance(max_distance, "max_distance")
        tree = self._cpu_tree()
        if tree is None or self.points.device.type != "cpu":
            return None
        return tree.grid(md * md, int(queries))

    def nearest_within(self, query: Any, max_distance: float, *,
                       hint: torch.Tensor | None = None) -> KnnResult:
        """Nearest point within ``max_distance``: ``(N, 1)``, ``-1`` / ``inf`` if none.

        The search runs on the host: a query on a GPU is copied there and back
        (synchronising), also inside :func:`~pointalign._validate.trusted`.
        """
        md = _checks.check_distance(max_distance, "max_distance")
        q = _checks.query_points(query, self.points)
        tree = self._cpu_tree()
        _checks.check_hint(hint, q.shape[0], self.points, values=tree is not None)
        if tree is None or q.shape[0] == 0:
            return self._query(q, 1, md)
        h = None if hint is None else hint.detach().cpu().numpy()
        d, i = tree.nearest(q.detach().cpu().numpy(), md * md, h)
        dev = self.points.device
        return KnnResult(torch.from_numpy(d)[:, None].to(dev), torch.from_numpy(i)[:, None].to(dev))
