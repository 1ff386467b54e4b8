"""The spec of the kdtree family: the tree's layout, descent and the reference kNN.

The layout (a level-order complete binary tree over permuted points, one contiguous range
per node; see :mod:`pointalign.kernels.kdtree`) is :class:`TreeArrays`; :func:`knn_reference`
is the plain PyTorch statement of :func:`pointalign.kernels.kdtree.knn`. The Triton kernels
(``kdtree/triton.py``) never import their dispatcher.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class TreeArrays(NamedTuple):
    """Flat arrays of a level-order k-d tree (see the module docstring).

    Attributes:
        points: ``(M, 3)`` float tensor, the points in tree order (``original[perm]``).
        perm: ``(M,)`` int64, tree position -> original index.
        lo, hi: ``(n_nodes, 3)`` float, bounding box of each node's points.
        split_axis: ``(n_nodes,)`` int32, 0/1/2 for internal nodes, -1 for leaves.
        split_value: ``(n_nodes,)`` float, the split coordinate (0 for leaves).
        start, end: ``(n_nodes,)`` int64, the node's range ``[start, end)`` in tree order.
        depth: number of split levels D (leaves are at level D).

    """

    points: torch.Tensor
    perm: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    split_axis: torch.Tensor
    split_value: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    depth: int

    @property
    def n_nodes(self) -> int:
        """``2^(D+1) - 1``."""
        return 2 ** (self.depth + 1) - 1

    @property
    def first_leaf(self) -> int:
        """Id of the leftmost leaf, ``2^D - 1``."""
        return 2**self.depth - 1

    @property
    def max_leaf_size(self) -> int:
        """Most points in one leaf, ``ceil(M / 2^D)``."""
        m = self.points.shape[0]
        return -(-m // 2**self.depth)


def depth_for(m: int, leaf_size: int) -> int:
    """Split levels D so that leaves hold at most ``leaf_size`` of ``m`` points (``2^D <= m``)."""
    if m <= leaf_size:
        return 0
    d = math.ceil(math.log2(m / leaf_size))
    while -(-m // 2**d) > leaf_size:  # guard against float rounding in log2
        d += 1
    return min(d, int(math.floor(math.log2(m))))


def level_bounds(m: int, level: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``(2^level + 1,)`` int64 boundaries of the level's node ranges: ``floor(j m / 2^level)``."""
    j = torch.arange(2**level + 1, dtype=torch.int64, device=device)
    return (j * m) >> level


def node_ranges(m: int, depth: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``(n_nodes, 2)`` int64 ``[start, end)`` of every node, in level order."""
    parts = []
    for level in range(depth + 1):
        b = level_bounds(m, level)
        parts.append(torch.stack([b[:-1], b[1:]], 1))
    return torch.cat(parts, 0).to(device)  # made on the host: one copy, not ~5 launches a level


# ----------------------------------------------------------------------------- descent


def descend_reference(tree: TreeArrays, query: torch.Tensor, depth: int | None = None
                      ) -> torch.Tensor:
    """Descend a level at a time: the reference of :func:`pointalign.kernels.kdtree.descend`.

    Node id (level order) at level ``depth`` whose cell holds each ``query (N, 3)``, ``(N,)``.
    Follows the split planes from the root without backtracking (``q[axis] >= split`` goes
    right). ``depth`` defaults to the leaves; it is clamped to ``[0, tree.depth]``.
    """
    d = tree.depth if depth is None else max(0, min(int(depth), tree.depth))
    node = torch.zeros(query.shape[0], dtype=torch.int64, device=query.device)
    q = query.to(tree.points.dtype)
    for _ in range(d):
        ax = tree.split_axis[node].long()
        right = q.gather(1, ax[:, None]).squeeze(1) >= tree.split_value[node]
        node = 2 * node + 1 + right.long()
    return node


def _box_dist2(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    d = torch.maximum(torch.maximum(lo - q, q - hi), torch.zeros((), dtype=q.dtype,
                                                                  device=q.device))
    return (d * d).sum(-1)


def _scan_nodes(tree: TreeArrays, q: torch.Tensor, qi: torch.Tensor, nodes: torch.Tensor,
                width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Squared distances from ``q[qi]`` to the points of ``nodes``: ``(P, width)``, inf padded."""
    pos = tree.start[nodes][:, None] + torch.arange(width, device=q.device)
    valid = pos < tree.end[nodes][:, None]
    pos = torch.where(valid, pos, torch.zeros_like(pos))
    diff = tree.points[pos] - q[qi][:, None, :]
    d2 = (diff * diff).sum(-1)
    d2 = torch.where(valid, d2, torch.full_like(d2, math.inf))
    return d2, pos, valid


def knn_reference(tree: TreeArrays, query: torch.Tensor, k: int, *,
                  max_dist2: float = math.inf, approximate: bool = False,
                  chunk: int = 1 << 16) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`knn` (same contract), vectorised over queries.

    Exact mode: an upper bound per query from the smallest node around it that holds at least
    k points, then a level-synchronous frontier of (query, node) pairs whose bounding boxes are
    within the bound, then the candidates' distances ranked per query. Exact, by construction.
    """
    n = query.shape[0]
    q_all = query.to(tree.points.dtype)
    out_d = torch.full((n, k), math.inf, dtype=q_all.dtype, device=q_all.device)
    out_i = torch.full((n, k), -1, dtype=torch.int64, device=q_all.device)
    m = tree.points.shape[0]
    for c0 in range(0, n, chunk):
        q = q_all[c0:c0 + chunk]
        nq = q.shape[0]
        ar = torch.arange(nq, device=q.device)
        bound = torch.full((nq,), float(max_dist2), dtype=q.dtype, device=q.device)
        if approximate:
            qi, nodes = ar, descend_reference(tree, q)
        else:
            # bound from the deepest level whose nodes all hold >= k points
            lk = -1
            for level in range(tree.depth, -1, -1):
                if (m >> level) >= k:
                    lk = level
                    break
            if lk >= 0:
                node = descend_reference(tree, q, lk)
                d2, _, _ = _scan_nodes(tree, q, ar, node, -(-m // 2**lk))
                kth = torch.topk(d2, k, dim=1, largest=False).values[:, -1]
                bound = torch.minimum(bound, kth)
            qi = ar
            nodes = torch.zeros(nq, dtype=torch.int64, device=q.device)
            for level in range(tree.depth + 1):
                keep = _box_dist2(q[qi], tree.lo[nodes], tree.hi[nodes]) <= bound[qi]
                qi, nodes = qi[keep], nodes[keep]
                if level < tree.depth:
                    qi = qi.repeat_interleave(2)
                    nodes = torch.stack([2 * nodes + 1, 2 * nodes + 2], 1).reshape(-1)
        d2, pos, valid = _scan_nodes(tree, q, qi, nodes, tree.max_leaf_size)
        qi = qi[:, None].expand_as(d2)
        sel = valid & (d2 <= bound[qi])
        d2, pos, qi = d2[sel], pos[sel], qi[sel]
        o = torch.sort(d2, stable=True).indices
        o = o[torch.sort(qi[o], stable=True).indices]
        d2, pos, qi = d2[o], pos[o], qi[o]
        counts = torch.bincount(qi, minlength=nq)
        first = torch.cumsum(counts, 0) - counts
        rank = torch.arange(qi.shape[0], device=q.device) - first[qi]
        take = rank < k
        out_d[c0 + qi[take], rank[take]] = d2[take]
        out_i[c0 + qi[take], rank[take]] = pos[take]
    return out_d, out_i
