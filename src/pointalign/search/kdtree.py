"""A flat, level-order k-d tree: built on the device, exact and approximate queries, payloads.

The tree (layout in :mod:`pointalign.kernels.kdtree`) is a complete binary tree stored as a heap
(node ``i`` has children ``2i+1``, ``2i+2``) over the target points permuted so that every node
owns a contiguous range ``[start, end)`` of ``points[perm]``; balanced median splits on the axis
of largest extent; a bounding box per node. Following Zabatani & Bronstein, "Parallelized
algorithms for rigid surface alignment on GPU" (2012), Sec. 4.2, every node at every level can
carry a payload (e.g. the coefficients of a quadratic distance approximant), fetched after an
approximate descent to a chosen level without backtracking::

    tree = KDTreeIndex(target, leaf_size=16)
    tree.attach("mean", tree.node_sums(tree.points) / tree.node_sizes()[:, None])
    nodes = tree.descend(query, depth=10)      # (N,) node ids at level 10
    means = tree.payload("mean", nodes)        # (N, 3)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pointalign import _validate
from pointalign._ops import exclusive_cumsum_rows
from pointalign.kernels import kdtree as _k
from pointalign.search import _checks
from pointalign.search.base import KnnResult


class KDTreeIndex:
    """k-d tree over ``points (M, 3)``; implements :class:`pointalign.search.base.Index`.

    Args:
        points: ``(M, 3)`` float array/tensor/PointCloud, the target (kept in its dtype,
            float32 recommended on the GPU).
        leaf_size: most points per leaf (>= 1); sets the depth when ``depth`` is None.
        depth: number of split levels D (leaves at level D, ``2^D`` leaves); clamped to
            ``2^D <= M`` so that no node is empty. Overrides ``leaf_size``.
        build: ``"device"`` (torch sorts on the points' device), ``"host"`` (NumPy, then copied)
            or ``"auto"``: the kernel layer's choice for the points' device (see
            :func:`pointalign.kernels.kdtree.build`).
        device: where the tree lives (default: the points' device).

    Attributes:
        points: ``(M, 3)`` the points in the caller's order (on ``device``).
        perm: ``(M,)`` int64, tree order -> original index; ``points[perm]`` is tree order.
        tree_points: ``(M, 3)`` the points in tree order.
        depth: D; ``n_nodes = 2^(D+1) - 1``; level ``l`` holds nodes ``2^l - 1 .. 2^(l+1) - 2``.
        node_ranges: ``(n_nodes, 2)`` int64 ``[start, end)`` of every node in tree order.
        node_lo, node_hi: ``(n_nodes, 3)`` bounding boxes.
        split_axis, split_value: ``(n_nodes,)`` split of internal nodes (axis -1 at leaves).

    """

    #: :meth:`nearest_within` reads its ``hint`` (ICP passes its last correspondences)
    uses_hint = True

    def __init__(self, points: Any, *, leaf_size: int = 16, depth: int | None = None,
                 build: str = "auto", device: str | torch.device | None = None):
        pts = _checks.index_points(points)
        dev = _validate.as_device(device, like=pts)
        pts = pts.to(dev)
        if int(leaf_size) < 1:
            raise ValueError(f"leaf_size: must be >= 1, got {leaf_size}")
        if build not in ("auto", "device", "host"):
            raise ValueError(f"build: must be 'auto', 'device' or 'host', got {build!r}")
        m = pts.shape[0]
        if depth is None:
            d = _k.depth_for(m, int(leaf_size))
        else:
            if int(depth) < 0:
                raise ValueError(f"depth: must be >= 0, got {depth}")
            d = min(int(depth), int(math.floor(math.log2(m))))
        self._tree = _k.build(pts, d, build)
        self.points = pts
        self.leaf_size = self._tree.max_leaf_size
        self._payloads: dict[str, torch.Tensor] = {}
        # original index -> tree position: the kernel maps hints in and answers out with it
        perm = self._tree.perm
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.shape[0], device=perm.device)
        self._ids = (perm, inv)

    # ------------------------------------------------------------------ structure
    @property
    def arrays(self) -> _k.TreeArrays:
        """The flat tree arrays handed to :mod:`pointalign.kernels.kdtree`."""
        return self._tree

    @property
    def device(self) -> torch.device:
        """Device of the points and the tree."""
        return self.points.device

    @property
    def depth(self) -> int:
        """Number of split levels D (leaves at level D)."""
        return self._tree.depth

    @property
    def n_nodes(self) -> int:
        """``2^(D+1) - 1`` nodes, all levels."""
        return self._tree.n_nodes

    @property
    def perm(self) -> torch.Tensor:
        """``(M,)`` int64: tree order -> original point index."""
        return self._tree.perm

    @property
    def tree_points(self) -> torch.Tensor:
        """``(M, 3)`` the points in tree order (``points[perm]``)."""
        return self._tree.points

    @property
    def node_ranges(self) -> torch.Tensor:
        """``(n_nodes, 2)`` int64 ``[start, end)`` of every node in tree order."""
        return torch.stack([self._tree.start, self._tree.end], 1)

    @property
    def node_lo(self) -> torch.Tensor:
        """``(n_nodes, 3)`` lower corners of the nodes' bounding boxes."""
        return self._tree.lo

    @property
    def node_hi(self) -> torch.Tensor:
        """``(n_nodes, 3)`` upper corners of the nodes' bounding boxes."""
        return self._tree.hi

    @property
    def split_axis(self) -> torch.Tensor:
        """``(n_nodes,)`` int32 split axis (-1 at leaves)."""
        return self._tree.split_axis

    @property
    def split_value(self) -> torch.Tensor:
        """``(n_nodes,)`` split coordinate (0 at leaves)."""
        return self._tree.split_value

    def level_nodes(self, level: int) -> torch.Tensor:
        """``(2^level,)`` int64 ids of the nodes of one level, left to right."""
        if not 0 <= level <= self.depth:
            raise ValueError(f"level: must be in [0, {self.depth}], got {level}")
        return torch.arange(2**level - 1, 2 ** (level + 1) - 1, device=self.device)

    def node_level(self, node_ids: torch.Tensor) -> torch.Tensor:
        """Level of each node id: ``floor(log2(id + 1))``."""
        ids = node_ids.long() + 1
        lvl = torch.zeros_like(ids)
        for level in range(1, self.depth + 1):
            lvl += (ids >= 2**level).long()
        return lvl

    def node_sizes(self) -> torch.Tensor:
        """``(n_nodes,)`` int64 number of points of every node."""
        return self._tree.end - self._tree.start

    def node_sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per-node sums of per-point ``values (M, ...)`` given in the caller's point order.

        ``out[i] = sum(values[perm[start_i:end_i]])``, via float64 prefix sums over tree order;
        returns ``(n_nodes, ...)`` float64. Build payloads from it (means, covariances, ...).
        """
        if values.shape[0] != self.points.shape[0]:
            raise ValueError(f"values: expected {self.points.shape[0]} rows, "
                             f"got {values.shape[0]}")
        v = values.to(self.device, torch.float64)[self.perm]
        csum = exclusive_cumsum_rows(v)
        return csum[self._tree.end] - csum[self._tree.start]

    # ------------------------------------------------------------------ payloads
    def attach(self, name: str, per_node: torch.Tensor) -> None:
        """Store ``per_node (n_nodes, ...)`` data under ``name`` (moved to the tree's device).

        Row ``i`` belongs to node ``i`` (level order, all levels); fetch with :meth:`payload`.
        """
        if not isinstance(per_node, torch.Tensor):
            raise TypeError(f"per_node: expected a tensor, got {type(per_node).__name__}")
        if per_node.dim() < 1 or per_node.shape[0] != self.n_nodes:
            raise ValueError(f"per_node: expected shape ({self.n_nodes}, ...), "
                             f"got {tuple(per_node.shape)}")
        self._payloads[str(name)] = per_node.to(self.device)

    def payload(self, name: str, node_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Return the data attached as ``name`` for ``node_ids (N,)`` (all nodes when None)."""
        if name not in self._payloads:
            raise KeyError(f"name: no payload {name!r}; attached: {sorted(self._payloads)}")
        data = self._payloads[name]
        return data if node_ids is None else data[node_ids.to(self.device).long()]

    def has_payload(self, name: str) -> bool:
        """Whether a payload ``name`` is attached."""
        return name in self._payloads

    # ------------------------------------------------------------------ CUDA graphs
    def graph_arrays(self) -> tuple[tuple, dict[str, torch.Tensor]]:
        """Return ``(key, arrays)``: the tensors a captured search reads, and their layout.

        ``arrays``: ``points (M, 3)``, the tree's ``tree_points (M, 3)``, ``perm (M,)``,
        ``lo``, ``hi (n_nodes, 3)``, ``split_axis``, ``split_value``, ``start``, ``end
        (n_nodes,)``, ``inverse (M,)`` (original index -> tree position) and each attached
        payload (``payload.<name>``); ``key``: the depth, leaf size and every array's name,
        shape, dtype and device. Two indexes with one key are interchangeable in a captured
        CUDA graph once the one's arrays are copied into the other's
        (:mod:`pointalign.kernels._loop` keeps an ICP step's graph across calls that way:
        every call builds a new index).
        """
        t = self._tree
        arrays = {"points": self.points, "tree_points": t.points, "perm": t.perm, "lo": t.lo,
                  "hi": t.hi, "split_axis": t.split_axis, "split_value": t.split_value,
                  "start": t.start, "end": t.end, "inverse": self._ids[1],
                  **{"payload." + k: v for k, v in self._payloads.items()}}
        return ("KDTreeIndex", t.depth, self.leaf_size, _checks.array_layout(arrays)), arrays

    def with_arrays(self, arrays: dict[str, torch.Tensor]) -> KDTreeIndex:
        """Return a copy of this index that reads ``arrays`` (laid out as :meth:`graph_arrays`).

        Raises:
            ValueError: ``arrays`` with other names, shapes, dtypes or devices.

        """
        _checks.check_arrays(arrays, self.graph_arrays()[1])
        new = object.__new__(KDTreeIndex)
        t = self._tree
        new._tree = _k.TreeArrays(arrays["tree_points"], arrays["perm"], arrays["lo"],
                                  arrays["hi"], arrays["split_axis"], arrays["split_value"],
                                  arrays["start"], arrays["end"], t.depth)
        new.points, new.leaf_size = arrays["points"], self.leaf_size
        new._payloads = {k[len("payload."):]: v for k, v in arrays.items()
                         if k.startswith("payload.")}
        new._ids = (arrays["perm"], arrays["inverse"])
        return new

    # ------------------------------------------------------------------ queries
    def _query(self, query: Any) -> torch.Tensor:
        return _checks.query_points(query, self.points)

    def descend(self, query: Any, depth: int | None = None) -> torch.Tensor:
        """Node ids ``(N,)`` int64 at level ``depth`` (default: leaves) of each ``query (N, 3)``.

        The paper's lookup: follow the split planes from the root, no backtracking; the cell
        of the returned node holds the query (the tree's cells partition space).
        """
        if depth is not None and not 0 <= int(depth) <= self.depth:
            raise ValueError(f"depth: must be in [0, {self.depth}], got {depth}")
        return _k.descend(self._tree, self._query(query), depth)

    def _result(self, d2: torch.Tensor, pos: torch.Tensor) -> KnnResult:
        idx = torch.where(pos >= 0, self.perm[pos.clamp_min(0)], pos)
        return KnnResult(d2, idx)

    def knn(self, query: Any, k: int, *, approximate: bool = False) -> KnnResult:
        """Find the k nearest points of each ``query (N, 3)``: ``dists, idx (N, k)``.

        Exact unless ``approximate=True`` (only the query's leaf is searched: fast, and exact
        whenever the nearest points share the query's leaf; ``idx = -1``, ``dists = inf`` where
        the leaf holds fewer than k points). ``k`` larger than M is a ``ValueError``, as for
        every index.
        """
        k = _checks.check_k(k, self.points.shape[0])
        d2, pos = _k.knn(self._tree, self._query(query), k, approximate=approximate)
        return self._result(d2, pos)

    def radius(self, query: Any, r: float, max_neighbors: int) -> KnnResult:
        """Up to ``max_neighbors`` nearest points within distance ``r`` of each query."""
        r = _checks.check_distance(r, "r")
        k = _checks.check_k(max_neighbors, self.points.shape[0], "max_neighbors",
                            allow_more=True)
        d2, pos = _k.knn(self._tree, self._query(query), k, max_dist2=float(r) ** 2)
        return self._result(d2, pos)

    def nearest_within(self, query: Any, max_distance: float, *,
                       hint: torch.Tensor | None = None) -> KnnResult:
        """Find the nearest point within ``max_distance`` of each query: ``(N, 1)``, -1 if none.

        ``hint``: optional ``(N,)`` int64 original indices (-1: none), a candidate per query
        such as the previous ICP iteration's correspondence: the search starts from its
        distance (see :func:`pointalign.kernels.kdtree.knn`), same answer, much less of the
        tree visited when the hint is close. With a hint the queries are searched in the
        given order (pass them in a spatially coherent order, as ICP does); without one, a
        large query set is first grouped by leaf (scattered queries such as RANSAC's).
        Inside :func:`~pointalign._validate.trusted`: no check of the query's values or of
        the hint's entries, and no host synchronisation.
        """
        md = _checks.check_distance(max_distance, "max_distance")
        q = self._query(query)
        hint = _checks.check_hint(hint, q.shape[0], self.points, values=True)
        d2, idx = _k.knn(self._tree, q, 1, max_dist2=md * md, hint=hint,
                         reorder=hint is None, ids=self._ids)
        return KnnResult(d2, idx)

    def __repr__(self) -> str:
        return (f"KDTreeIndex(M={self.points.shape[0]}, depth={self.depth}, "
                f"leaf_size<={self.leaf_size}, device={self.device})")
