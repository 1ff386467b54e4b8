"""k-d tree kernel family: build, descent and kNN traversal, with their PyTorch references.

The tree is a complete binary tree of ``depth`` D split levels stored in level order (a heap):
node ``i`` has children ``2i+1`` and ``2i+2``, level ``l`` holds nodes ``2^l - 1 .. 2^(l+1) - 2``
and the ``2^D`` leaves are nodes ``2^D - 1 ..``. The ``M`` points are permuted (``perm``) so that
node ``j`` of level ``l`` (0-based within the level) owns the contiguous range

    ``[floor(j M / 2^l), floor((j + 1) M / 2^l))``

of the permuted points: a balanced median split, each node's points ordered along its parent's
split axis by (coordinate, original index). ``2^D <= M`` keeps every node non-empty. Each
internal node splits along the axis of largest extent of its points; ``split_value`` is halfway
between the left child's largest and the right child's smallest coordinate on that axis, and a
query goes right when ``q[axis] >= split_value``. Every node stores the bounding box of its
points, which prunes the exact search (so exactness never depends on the split value).

Entry points (dispatched through :func:`pointalign.kernels._backend.backend`; the layout
helpers and the references :func:`descend_reference` and :func:`knn_reference` live in
``kdtree/reference.py`` and are re-exported here):

* :func:`build` — the tree arrays from ``points (M, 3)``; ``where="device"`` (torch sorts per
  level, vectorised over the level's nodes, on the points' device) or ``"host"`` (NumPy).
* :func:`descend` — approximate lookup: the node at level ``depth`` whose cell holds each query
  (no backtracking), as in Zabatani & Bronstein (2012), Sec. 4.2.
* :func:`knn` — exact k nearest neighbours (backtracking with a depth-bounded per-query stack in
  the Triton kernel; a level-synchronous frontier in the reference), or approximate (search only
  the query's leaf), optionally bounded by a maximum squared distance.
* :func:`self_knn` — every tree point's k nearest (the covariances' and normals' self-query):
  in Triton one program per leaf walks the tree once for all of that leaf's points
  (``kdtree/triton_block.py``: the 125k-point KITTI scan's k = 20 0.57 -> 0.44 ms, 1M points
  6.9 -> 4.5 ms against per-query walks, H200); elsewhere :func:`knn` of the tree's points.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import numpy as np
import torch

from pointalign.kernels import _loop
from pointalign.kernels._backend import backend, upload
from pointalign.kernels.kdtree.reference import (
    TreeArrays,
    descend_reference,
    knn_reference,
    level_bounds,
    node_ranges,
)
from pointalign.kernels.kdtree.reference import depth_for as depth_for

# the Triton kernel keeps the k best per query in registers; above this k the reference runs
TRITON_MAX_K = 64
# from this many queries on, the Triton path visits queries grouped by their leaf (one
# descent + argsort), so that the lanes of a warp walk the same nodes: less divergence, and
# coalesced, cached node and point reads; results are scattered back to the caller's order
REORDER_MIN_QUERIES = 8192


# ----------------------------------------------------------------------------- build


#: per (depth, device): :func:`build_layout`'s entries as ``(j, level, offset)`` rows
_LAYOUT_TEMPLATES: dict[tuple[int, str], torch.Tensor] = {}


def _layout_template(depth: int, device: torch.device | str) -> torch.Tensor:
    """Return ``(3, E)`` int64 rows on ``device``: each layout entry is ``((j m) >> level) + off``.

    The entries of :func:`build_layout` in its order (every level's bounds, the split
    positions either side of each children's boundary, the node ranges), which depend on
    the depth alone; made once per depth and device (depths run to ~25).
    """
    key = (depth, str(device))
    if key not in _LAYOUT_TEMPLATES:
        rows: list[tuple[np.ndarray, int, int]] = []
        rows += [(np.arange(2**level + 1), level, 0) for level in range(depth + 1)]
        for level in range(1, depth + 1):  # the last position left and the first right
            odd = np.arange(1, 2**level, 2)
            rows += [(odd, level, -1), (odd, level, 0)]
        for level in range(depth + 1):  # [start, end) of each node
            j = np.arange(2**level)
            rows.append((np.stack([j, j + 1], 1).reshape(-1), level, 0))
        t = np.concatenate([np.stack([j, np.full_like(j, lv), np.full_like(j, off)])
                            for j, lv, off in rows], 1)
        _LAYOUT_TEMPLATES[key] = upload(t, dtype=torch.int64, device=device)
    return _LAYOUT_TEMPLATES[key]


def build_layout(m: int, depth: int, device: torch.device | str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Make the arrays of a device build that depend on ``m`` and ``depth`` only.

    Returns ``(flat, ranges)``: every level's node bounds and the positions either side of
    each split, concatenated (int64), and :func:`node_ranges` ``(n_nodes, 2)``, on
    ``device``: three element-wise launches over a template kept per depth
    (:func:`_layout_template`), no copy from the host after the first call at a depth.
    :func:`build` makes them when not given; a caller that captures a build in a CUDA
    graph makes them before (the template's first copy is not captured). The same values
    as :func:`level_bounds`, :func:`node_ranges`.
    """
    t = _layout_template(depth, device)
    both = ((t[0] * m) >> t[1]) + t[2]
    n_flat = t.shape[1] - 2 * (2 ** (depth + 1) - 1)
    return both[:n_flat], both[n_flat:].view(-1, 2)


def build(points: torch.Tensor, depth: int, where: str = "device", *,
          layout: tuple[torch.Tensor, torch.Tensor] | None = None,
          graph: bool = True) -> TreeArrays:
    """Build the tree over ``points (M, 3)`` with ``depth`` split levels (``2^depth <= M``).

    ``where="device"``: torch ops on the points' device (per level: node bounding boxes by a
    padded gather and row reduction, axis of largest extent, one sort by node, coordinate and
    original index; see :func:`_node_order`).
    ``where="host"``: the same algorithm in NumPy (``lexsort``), copied back. Both give the same
    tree (points of equal coordinate ordered by their original index).
    ``where="auto"``: ``"device"`` for points on a GPU, ``"host"`` for points in host memory
    (NumPy's lexsort beat torch's scatter-reduce and two sorts per level by about 2x on the
    CPU; see ``benchmarks/bench_kdtree.py``).
    ``layout``: :func:`build_layout` of ``(M, depth)`` on the points' device, when the caller
    has it (a device build then copies nothing from the host; a host build ignores it).
    ``graph``: a Triton build of up to :data:`BUILD_GRAPH_MAX` points replays a CUDA graph
    per size from the size's second build on; False inside another device program (it is
    captured into that program's graph).
    """
    m = points.shape[0]
    if depth < 0 or 2**depth > m:
        raise ValueError(f"depth: must satisfy 0 <= depth and 2**depth <= {m}, got {depth}")
    if where == "auto":
        where = "host" if points.device.type == "cpu" else "device"
    if where == "device":
        if layout is None:
            layout = build_layout(m, depth, points.device)
        ranges = layout[1]
        # float32 on a Triton backend: three sorts, then five launches a level (each
        # node's box and split read off the sorted lists, the sides, a running count, the
        # partition) in place of a sort a level, then one launch for every level whose
        # nodes fit a program
        if points.dtype == torch.float32 and backend(points) in ("triton", "interpret"):
            program = _BuildProgram(depth)
            inputs = {"points": points, "flat": layout[0]}
            if graph and m <= BUILD_GRAPH_MAX:  # a CUDA graph per size on Triton
                _, out = _loop.run_program(program, inputs, host_outputs=False,
                                           eager_first=True)
            else:
                out = program(inputs, None)
            perm, pts, lo, hi, split_axis, split_value = (out[n] for n in program.outputs)
            return TreeArrays(pts, perm, lo, hi, split_axis, split_value,
                              ranges[:, 0].contiguous(), ranges[:, 1].contiguous(), depth)
        perm, axes, splits, pts = _build_torch(points, depth, *_split_layout(layout[0], depth))
    elif where == "host":
        perm_np, axes_np, splits_np = _build_numpy(points.detach().cpu().double().numpy(), depth)
        perm = torch.from_numpy(perm_np).to(points.device)
        axes = torch.from_numpy(axes_np).to(points.device)
        splits = torch.from_numpy(splits_np).to(device=points.device, dtype=points.dtype)
        pts = points[perm]
        ranges = node_ranges(m, depth, points.device)
    else:
        raise ValueError(f"where: must be 'device', 'host' or 'auto', got {where!r}")
    pts = pts.contiguous()
    lo, hi = _node_boxes(pts, depth)
    n_int = 2**depth - 1
    n_nodes = 2 ** (depth + 1) - 1
    split_axis = torch.full((n_nodes,), -1, dtype=torch.int32, device=points.device)
    split_value = torch.zeros(n_nodes, dtype=points.dtype, device=points.device)
    split_axis[:n_int] = axes.to(torch.int32)
    split_value[:n_int] = splits.to(points.dtype)
    return TreeArrays(pts, perm, lo, hi, split_axis, split_value,
                      ranges[:, 0].contiguous(), ranges[:, 1].contiguous(), depth)


def _segment_boxes(pts: torch.Tensor, level: int, b: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounding boxes ``lo, hi (2^level, 3)`` of the level's node ranges of ``pts (M, 3)``.

    ``b``: the level's ``level_bounds`` on the points' device, when the caller has them.

    Every range is non-empty and at most ``ceil(M / 2^level)`` long, so the ranges are read
    as rows of one padded gather (short rows repeat their last point, which leaves min and
    max unchanged) and reduced along the rows: no atomics, unlike a scatter-reduce, whose
    few segments near the root serialise on a GPU.
    """
    m = pts.shape[0]
    b = level_bounds(m, level, pts.device) if b is None else b
    width = -(-m // 2**level)
    pos = torch.minimum(b[:-1, None] + torch.arange(width, device=pts.device),
                        b[1:, None] - 1)
    return torch.aminmax(pts[pos], dim=1)


def _node_boxes(pts: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounding boxes of all nodes: leaves from their points, parents from their children."""
    lo, hi = _segment_boxes(pts, depth)
    los, his = [lo], [hi]
    for _ in range(depth):
        lo = torch.minimum(lo[0::2], lo[1::2])
        hi = torch.maximum(hi[0::2], hi[1::2])
        los.append(lo)
        his.append(hi)
    return torch.cat(los[::-1], 0).contiguous(), torch.cat(his[::-1], 0).contiguous()


def _node_order(seg: torch.Tensor, key: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Permutation sorting positions by node ``seg (M,)``, then ``key (M,)``, then ``ids``.

    ``ids (M,)``: distinct integers (the points' original indices), which order the points
    of equal key. float32 keys: one stable sort of ``seg · 2³² + u(key)`` over the
    positions taken in id order, with ``u`` the order-preserving map of the float's bits
    to [0, 2³²) (negative floats reversed below the positive ones; -0.0 folded onto +0.0
    first, as a float comparison treats them). Wider keys: two more stable sorts (by key,
    then by node).
    """
    o = torch.argsort(ids)
    if key.dtype == torch.float32:
        b = (key[o] + 0.0).view(torch.int32).to(torch.int64)
        u = torch.where(b < 0, -1 - b, b + (1 << 31))
        return o[torch.sort((seg[o] << 32) | u, stable=True).indices]
    o = o[torch.sort(key[o], stable=True).indices]
    return o[torch.sort(seg[o], stable=True).indices]


#: device builds of up to this many points run as a fixed program
#: (:func:`pointalign.kernels._loop.run_program`): on Triton a CUDA graph per size, captured
#: at a size's second build and replayed after (a 40k-point build is ~6 levels of four kinds
#: of launch, ~2.5 ms of host, H200); above, launches are a small part of the build
BUILD_GRAPH_MAX = 1 << 18


@dataclasses.dataclass(frozen=True)
class _BuildProgram:
    """The Triton build as a fixed device program (:func:`build`'s, one graph per size).

    Inputs ``points (M, 3)`` float32 and :func:`build_layout`'s ``flat``; outputs the tree
    arrays named in :attr:`outputs`.
    """

    depth: int
    outputs: ClassVar[tuple[str, ...]] = ("perm", "points", "lo", "hi", "split_axis",
                                          "split_value")

    def __call__(self, inputs: dict[str, torch.Tensor], checkpoint: object
                 ) -> dict[str, torch.Tensor]:
        from pointalign.kernels.kdtree import triton as _kdtree_triton

        bounds, _ = _split_layout(inputs["flat"], self.depth)
        arrays = _kdtree_triton.build(inputs["points"], self.depth, bounds)
        return dict(zip(self.outputs, arrays, strict=True))


def _split_layout(flat: torch.Tensor, depth: int
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Cut :func:`build_layout`'s ``flat`` into views: each level's bounds, split positions.

    Returns ``(bounds, mids)``: levels 0..depth's node bounds, and each split level's
    ``(2, 2^level)`` positions either side of the children's boundary.
    """
    sizes = [2**level + 1 for level in range(depth + 1)] + [2**level for level in
                                                           range(1, depth + 1)]
    parts = list(torch.split(flat, sizes))
    return parts[:depth + 1], [x.view(2, -1) for x in parts[depth + 1:]]


def _build_torch(points: torch.Tensor, depth: int, bounds_d: list[torch.Tensor],
                 mids_d: list[torch.Tensor]):
    """Device build in torch operations; returns ``(perm, axes, splits, points[perm])``.

    ``bounds_d``, ``mids_d``: :func:`_split_layout` of :func:`build_layout`'s ``flat``.
    """
    m, dev = points.shape[0], points.device
    pos = torch.arange(m, device=dev)
    perm = pos
    pts = points.contiguous()
    axes, splits = [], []
    for level in range(depth):
        b = bounds_d[level]
        seg = torch.bucketize(pos, b[1:], right=True)  # node j of p: b[j] <= p < b[j+1]
        lo, hi = _segment_boxes(pts, level, b)
        axis = (hi - lo).argmax(1)
        key = pts.gather(1, axis[seg][:, None]).squeeze(1)
        order = _node_order(seg, key, perm)
        perm = perm[order]
        pts = pts[order]
        # the split: midway between the two points either side of the children's boundary
        splits.append(key[order[mids_d[level]]].mean(0))
        axes.append(axis)
    if depth == 0:
        return perm, torch.zeros(0, dtype=torch.int64, device=dev), points.new_zeros(0), pts
    return perm, torch.cat(axes), torch.cat(splits), pts


def _build_numpy(points: np.ndarray, depth: int):
    m = points.shape[0]
    perm = np.arange(m)
    pts = points
    axes, splits = [], []
    for level in range(depth):
        b = (np.arange(2**level + 1, dtype=np.int64) * m) >> level
        starts = b[:-1]
        lo = np.minimum.reduceat(pts, starts, axis=0)
        hi = np.maximum.reduceat(pts, starts, axis=0)
        axis = np.argmax(hi - lo, axis=1)
        seg = np.repeat(np.arange(2**level), np.diff(b))
        key = pts[np.arange(m), axis[seg]]
        by_id = np.empty_like(perm)  # the positions in original-index order (ties by it)
        by_id[perm] = np.arange(m)
        order = by_id[np.lexsort((key[by_id], seg[by_id]))]  # lexsort is stable
        perm, pts, key = perm[order], pts[order], key[order]
        mid = ((np.arange(2 ** (level + 1) + 1, dtype=np.int64) * m) >> (level + 1))[1:-1:2]
        splits.append(0.5 * (key[mid - 1] + key[mid]))
        axes.append(axis)
    if depth == 0:
        return perm, np.zeros(0, dtype=np.int64), np.zeros(0)
    return perm, np.concatenate(axes), np.concatenate(splits)


def descend(tree: TreeArrays, query: torch.Tensor,
            depth: int | torch.Tensor | None = None) -> torch.Tensor:
    """Node id (level order) at level ``depth`` whose cell holds each ``query (N, 3)``: ``(N,)``.

    Follows the split planes from the root without backtracking (``q[axis] >= split`` goes
    right); ``depth`` defaults to the leaves and is clamped to ``[0, tree.depth]``. One
    Triton launch for a float32 tree (a level's few element-wise launches each in
    :func:`descend_reference`, the PyTorch reference); the same node ids: comparisons only.

    ``depth`` may be a 0-d or ``(1,)`` integer tensor on the query's device: the descent
    goes to the leaves and each leaf's ancestor at that level is taken on the device
    (``(leaf + 1) >> (D − depth)) − 1``, the node the descent passes at that level), so
    that no host read of the level is needed (one CUDA graph serves every level).
    """
    if isinstance(depth, torch.Tensor):
        if depth.numel() != 1 or depth.dtype.is_floating_point or depth.dtype == torch.bool:
            raise ValueError(f"depth: expected one integer (a 0-d or (1,) integer tensor), "
                             f"got a {depth.dtype} tensor of shape {tuple(depth.shape)}")
        leaf = descend(tree, query)
        up = (tree.depth - depth.reshape(()).clamp(0, tree.depth)).to(torch.int64)
        return ((leaf + 1) >> up) - 1
    d = tree.depth if depth is None else max(0, min(int(depth), tree.depth))
    if backend(query) in ("triton", "interpret") and tree.points.dtype == torch.float32:
        from pointalign.kernels.kdtree import triton as _kdtree_triton

        return _kdtree_triton.descend(tree, query, d)
    return descend_reference(tree, query, d)


# ----------------------------------------------------------------------------- kNN


def knn(tree: TreeArrays, query: torch.Tensor, k: int, *, max_dist2: float = math.inf,
        approximate: bool = False, hint: torch.Tensor | None = None,
        reorder: bool = True, ids: tuple[torch.Tensor, torch.Tensor] | None = None,
        sort: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Find the k nearest tree points of each ``query (N, 3)`` within ``d^2 <= max_dist2``.

    Returns ``dists (N, k)`` squared distances ascending (``inf`` where none) and
    ``idx (N, k)`` int64 positions in **tree order** (``-1`` where none); map through
    ``tree.perm`` for original indices. ``approximate=True`` searches only the query's leaf.

    ``hint``: optional ``(N,)`` int64 tree positions (``-1``: none), ``k == 1`` only: a
    candidate per query (ICP passes the previous correspondence). The Triton kernel starts
    from its distance, which prunes most of the tree when the hint is near the answer; the
    answer does not change, up to ties (the reference ignores the hint). Ties: any of the
    equally near points (the Triton kernel skips what can only tie once k are held).
    ``reorder=False`` skips the grouping of large query sets by leaf (for callers whose
    queries are already in a spatially coherent order). ``ids = (tree.perm, its inverse
    (M,) int64)``: ``hint`` and the returned indices are original indices instead of tree
    positions (mapped inside the Triton kernel).
    ``sort=False``: the k found of each query in no particular order (for callers that
    only reduce over them, e.g. covariances; saves a segmented sort of the whole table).
    """
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    if hint is not None and (k != 1 or approximate or hint.shape != query.shape[:1]):
        raise ValueError(f"hint: expected ({query.shape[0]},) tree positions for an exact "
                         f"k = 1 search, got shape {tuple(hint.shape)} with k = {k}")
    be = backend(query)
    if be in ("triton", "interpret") and k <= TRITON_MAX_K:
        from pointalign.kernels.kdtree import triton as _kdtree_triton

        if reorder and be == "triton" and query.shape[0] >= REORDER_MIN_QUERIES:
            order = torch.argsort(descend(tree, query))
            d, i = _kdtree_triton.knn(tree, query[order], k, max_dist2=max_dist2,
                                      approximate=approximate,
                                      hint=None if hint is None else hint[order], ids=ids,
                                      sort=sort)
            out_d, out_i = torch.empty_like(d), torch.empty_like(i)
            out_d[order] = d
            out_i[order] = i
            return out_d, out_i
        return _kdtree_triton.knn(tree, query, k, max_dist2=max_dist2, approximate=approximate,
                                  hint=hint, ids=ids, sort=sort)
    d, i = knn_reference(tree, query, k, max_dist2=max_dist2, approximate=approximate)
    if ids is not None:
        i = torch.where(i >= 0, ids[0][i.clamp_min(0)], i)
    return d, i


def self_knn(tree: TreeArrays, k: int, leaves: tuple[int, int] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tree point's k nearest tree points (itself included), asked in tree order.

    Args:
        tree: the tree (its points are the queries).
        k: neighbours per point, ``1 <= k <= M``.
        leaves: ``(a, b)``: only the points of leaves ``a .. b - 1`` (left to right), the
            rows ``[floor(a M / 2^D), floor(b M / 2^D))`` in tree order; default all.

    Returns:
        ``dists (R, k)`` squared distances and ``idx (R, k)`` int64 tree positions, row r
        for tree point ``floor(a M / 2^D) + r``, each row's k in no particular order (ties:
        any of the equally near points). :func:`knn` of those points with ``reorder=False,
        sort=False`` answers the same; the Triton path walks the tree once per leaf for
        all of its points (``kdtree/triton_block.py``).

    """
    m, n_leaves = tree.points.shape[0], 2**tree.depth
    a, b = (0, n_leaves) if leaves is None else (int(leaves[0]), int(leaves[1]))
    if not 0 <= a <= b <= n_leaves:
        raise ValueError(f"leaves: expected 0 <= a <= b <= {n_leaves}, got ({a}, {b})")
    if not 1 <= k <= m:
        raise ValueError(f"k: expected 1 <= k <= {m}, got {k}")
    be = backend(tree.points)
    if be in ("triton", "interpret") and k <= TRITON_MAX_K:
        from pointalign.kernels.kdtree import triton_block as _self_triton

        return _self_triton.self_knn(tree, int(k), (a, b))
    rows = tree.points[(a * m) >> tree.depth: (b * m) >> tree.depth]
    return knn(tree, rows, int(k), reorder=False, sort=False)

