"""Triton k-d tree searches by blocks of queries that walk the tree together.

A program's ``QB`` queries share one stack of node ids: one node at a time for all lanes,
its box and split read once (one address for the whole program, where the per-query kernel
of ``kdtree/triton.py`` keeps a stack per lane and reads a node per lane). A node is
visited when it may still hold a point nearer than the k-th of any lane; a visited leaf's
points are read one at a time, each compared with every lane's k best (the per-query
kernel's tile, queries last). At an inner node both children are stacked where some lane
needs them, the one most lanes lie in on top. Pruning is the per-query kernel's: a box
farther than a lane's k-th distance (or as far, once its k places are taken) is skipped for
that lane, a child beyond the split plane likewise. It pays where a block's queries are
near one another (their walks then nearly coincide):

* :func:`self_knn` (``_self_knn_kernel``): every tree point's k nearest, one program per
  leaf (a balanced tree's leaf ``j`` holds positions ``[floor(j M / 2^D), floor((j + 1) M /
  2^D))``: no look-up); the walk starts at the program's own leaf, with the sibling of every
  node on its path stacked beneath (deepest on top): no descent from the root. Contract:
  :func:`pointalign.kernels.kdtree.self_knn`.
* :func:`knn` (``_block_knn_kernel``): ``QB`` consecutive queries of a spatially coherent
  order from the root, with the per-query kernel's options (a bound, hints, original ids).
  Contract: :func:`pointalign.kernels.kdtree.knn`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pointalign.kernels.kdtree.triton import (
    BIG,
    BIG_HOST,
    INT32_TILE_MAX,
    QUERY_CHUNK,
    _replace_worst,
)

#: queries per program of the self-query: at most one leaf of a tree built with 16-point
#: leaves
QUERY_BLOCK = 16

#: consecutive queries per program of :func:`knn` (one warp; 16 measured slower on the
#: KITTI scan and the 1M-point pair, H200)
KNN_BLOCK = 32


@triton.jit
def _reach(gap2, worst, full):
    """Lanes a point or box ``gap2`` away may still enter (ties: only while not full)."""
    return tl.where(full, gap2 < worst, gap2 <= worst)


@triton.jit
def _box_need(lo_ptr, hi_ptr, node, qx, qy, qz, qmask, worst, full):
    """Return the lanes whose k best a point of ``node``'s box may still enter."""
    bx = tl.maximum(tl.maximum(tl.load(lo_ptr + node * 3 + 0) - qx,
                               qx - tl.load(hi_ptr + node * 3 + 0)), 0.0)
    by = tl.maximum(tl.maximum(tl.load(lo_ptr + node * 3 + 1) - qy,
                               qy - tl.load(hi_ptr + node * 3 + 1)), 0.0)
    bz = tl.maximum(tl.maximum(tl.load(lo_ptr + node * 3 + 2) - qz,
                               qz - tl.load(hi_ptr + node * 3 + 2)), 0.0)
    return qmask & _reach(bx * bx + by * by + bz * bz, worst, full)


@triton.jit
def _scan_leaf(pts_ptr, p, p_end, qx, qy, qz, need, best_d, best_i, worst, max_d2, cols,
               K: tl.constexpr, KP: tl.constexpr, QB: tl.constexpr, IDX: tl.constexpr):
    """Offer tree points ``p .. p_end - 1`` to the lanes in ``need``; the updated k best."""
    while p < p_end:
        dx = tl.load(pts_ptr + p * 3 + 0) - qx
        dy = tl.load(pts_ptr + p * 3 + 1) - qy
        dz = tl.load(pts_ptr + p * 3 + 2) - qz
        d = dx * dx + dy * dy + dz * dz
        take = need & _reach(d, worst, worst < max_d2)
        if tl.max(take.to(tl.int32), axis=0) > 0:  # skipped when no lane takes it
            best_d, best_i, worst = _replace_worst(
                best_d, best_i, worst, d, tl.zeros((QB,), tl.int64) + p, take, cols, KP, IDX)
        p += 1
    return best_d, best_i


@triton.jit
def _push_children(axis_ptr, split_ptr, stack, sp, node, qx, qy, qz, need, worst, full):
    """Stack the children of inner ``node`` that a lane in ``need`` may still need.

    Each lane needs the child on its side of the split, and the other one when the split
    plane is within its k-th distance; the child fewer lanes lie in is stacked first, so
    that the other is visited first. Returns the new stack size.
    """
    ax = tl.load(axis_ptr + node)
    qa = tl.where(ax == 0, qx, tl.where(ax == 1, qy, qz))
    sv = tl.load(split_ptr + node)
    right = qa >= sv
    gap = qa - sv
    beyond = _reach(gap * gap, worst, full)
    n_right = tl.sum((need & right).to(tl.int32), axis=0)
    n_left = tl.sum((need & ~right).to(tl.int32), axis=0)
    want_l = tl.max((need & (~right | beyond)).to(tl.int32), axis=0) > 0
    want_r = tl.max((need & (right | beyond)).to(tl.int32), axis=0) > 0
    l_first = n_left < n_right
    if tl.where(l_first, want_l, want_r):
        tl.store(stack + sp, tl.where(l_first, 2 * node + 1, 2 * node + 2))
        sp += 1
    if tl.where(l_first, want_r, want_l):
        tl.store(stack + sp, tl.where(l_first, 2 * node + 2, 2 * node + 1))
        sp += 1
    return sp


# one compilation for every size and depth (run-time values)
@triton.jit(do_not_specialize=("m_points", "depth", "leaf0", "row0", "stack"))
def _self_knn_kernel(pts_ptr, lo_ptr, hi_ptr, axis_ptr, split_ptr, stack_ptr, out_d_ptr,
                     out_i_ptr, m_points, depth, leaf0, row0, stack,
                     K: tl.constexpr, KP: tl.constexpr, QB: tl.constexpr, IDX: tl.constexpr):
    leaf = leaf0 + tl.program_id(0).to(tl.int64)
    first_leaf = (tl.full((), 1, tl.int64) << depth) - 1
    q_start = (leaf * m_points) >> depth
    q_end = ((leaf + 1) * m_points) >> depth
    offs = q_start + tl.program_id(1) * QB + tl.arange(0, QB)
    qmask = offs < q_end
    qx = tl.load(pts_ptr + offs * 3 + 0, mask=qmask, other=0.0)
    qy = tl.load(pts_ptr + offs * 3 + 1, mask=qmask, other=0.0)
    qz = tl.load(pts_ptr + offs * 3 + 2, mask=qmask, other=0.0)
    cols = tl.arange(0, KP)
    zero_tile = tl.zeros((KP, QB), dtype=qx.dtype)
    best_d = tl.where(cols[:, None] < K, zero_tile + BIG, zero_tile - BIG)
    best_i = tl.zeros((KP, QB), dtype=IDX) - 1
    sbase = (tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)) * stack
    # the path's siblings, the root's child first: the deepest one ends on top
    for level in range(1, depth + 1):
        on_path = leaf >> (depth - level)
        tl.store(stack_ptr + sbase + level - 1, (1 << level) - 1 + (on_path ^ 1))
    tl.store(stack_ptr + sbase + depth, first_leaf + leaf)
    tl.debug_barrier()
    sp = depth + 1
    while sp > 0:
        sp -= 1
        node = tl.load(stack_ptr + sbase + sp)
        worst = tl.max(best_d, axis=0)
        full = worst < BIG
        need = _box_need(lo_ptr, hi_ptr, node, qx, qy, qz, qmask, worst, full)
        if tl.max(need.to(tl.int32), axis=0) > 0:
            if node >= first_leaf:
                j = node - first_leaf
                best_d, best_i = _scan_leaf(pts_ptr, (j * m_points) >> depth,
                                            ((j + 1) * m_points) >> depth, qx, qy, qz, need,
                                            best_d, best_i, worst, BIG, cols, K, KP, QB, IDX)
            else:
                sp = _push_children(axis_ptr, split_ptr, stack_ptr + sbase, sp, node, qx, qy,
                                    qz, need, worst, full)
        tl.debug_barrier()  # the stack is shared: a push is read by every thread next
    omask = qmask[None, :] & (cols[:, None] < K)
    found = best_i >= 0
    optr = (offs - row0)[None, :] * K + cols[:, None]
    tl.store(out_d_ptr + optr, tl.where(found, best_d, float("inf")), mask=omask)
    tl.store(out_i_ptr + optr, best_i.to(tl.int64), mask=omask)


def self_knn(tree, k: int, leaves: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher for :func:`pointalign.kernels.kdtree.self_knn` (same contract)."""
    m, depth = tree.points.shape[0], tree.depth
    a, b = leaves
    row0, row1 = (a * m) >> depth, (b * m) >> depth
    dev = tree.points.device
    out_d = torch.empty((row1 - row0, k), dtype=tree.points.dtype, device=dev)
    out_i = torch.empty((row1 - row0, k), dtype=torch.int64, device=dev)
    if b <= a:
        return out_d, out_i
    parts = triton.cdiv(tree.max_leaf_size, QUERY_BLOCK)
    stack = 2 * depth + 4
    stacks = torch.empty((b - a) * parts * stack, dtype=torch.int64, device=dev)
    _self_knn_kernel[(b - a, parts)](
        tree.points, tree.lo, tree.hi, tree.split_axis, tree.split_value, stacks, out_d, out_i,
        m, depth, a, row0, stack,
        K=k, KP=max(2, triton.next_power_of_2(k)), QB=QUERY_BLOCK,
        IDX=tl.int32 if m <= INT32_TILE_MAX else tl.int64, num_warps=1,
    )
    return out_d, out_i


# one compilation for every size (run-time values), as the per-query kernel
@triton.jit(do_not_specialize=("n_query", "first_leaf", "stack"))
def _block_knn_kernel(q_ptr, pts_ptr, lo_ptr, hi_ptr, axis_ptr, split_ptr, start_ptr, end_ptr,
                      stack_ptr, hint_ptr, perm_ptr, inv_ptr, out_d_ptr, out_i_ptr, n_query,
                      first_leaf, max_d2, stack,
                      K: tl.constexpr, KP: tl.constexpr, HAS_HINT: tl.constexpr,
                      MAP: tl.constexpr, QB: tl.constexpr, IDX: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * QB + tl.arange(0, QB)
    qmask = offs < n_query
    qx = tl.load(q_ptr + offs * 3 + 0, mask=qmask, other=0.0)
    qy = tl.load(q_ptr + offs * 3 + 1, mask=qmask, other=0.0)
    qz = tl.load(q_ptr + offs * 3 + 2, mask=qmask, other=0.0)
    cols = tl.arange(0, KP)
    zero_tile = tl.zeros((KP, QB), dtype=qx.dtype)
    best_d = tl.where(cols[:, None] < K, zero_tile + max_d2, zero_tile - BIG)
    best_i = tl.zeros((KP, QB), dtype=IDX) - 1
    if HAS_HINT:  # K == 1: the hint, where within the maximum, is the first candidate
        h = tl.load(hint_ptr + offs, mask=qmask, other=-1)
        if MAP:  # original index -> tree position
            h = tl.where(h >= 0, tl.load(inv_ptr + h, mask=qmask & (h >= 0), other=-1), -1)
        hm = qmask & (h >= 0)
        hx = tl.load(pts_ptr + h * 3 + 0, mask=hm, other=0.0) - qx
        hy = tl.load(pts_ptr + h * 3 + 1, mask=hm, other=0.0) - qy
        hz = tl.load(pts_ptr + h * 3 + 2, mask=hm, other=0.0) - qz
        hd = hx * hx + hy * hy + hz * hz
        use = (hm & (hd <= max_d2))[None, :] & (cols[:, None] == 0)
        best_d = tl.where(use, hd[None, :], best_d)
        best_i = tl.where(use, h[None, :].to(IDX), best_i)
    sbase = pid * stack
    tl.store(stack_ptr + sbase, tl.zeros((), tl.int64))  # the root
    tl.debug_barrier()
    sp = tl.max(qmask.to(tl.int32), axis=0)
    while sp > 0:
        sp -= 1
        node = tl.load(stack_ptr + sbase + sp)
        worst = tl.max(best_d, axis=0)
        full = worst < max_d2
        need = _box_need(lo_ptr, hi_ptr, node, qx, qy, qz, qmask, worst, full)
        if tl.max(need.to(tl.int32), axis=0) > 0:
            if node >= first_leaf:
                best_d, best_i = _scan_leaf(pts_ptr, tl.load(start_ptr + node),
                                            tl.load(end_ptr + node), qx, qy, qz, need,
                                            best_d, best_i, worst, max_d2, cols, K, KP, QB, IDX)
            else:
                sp = _push_children(axis_ptr, split_ptr, stack_ptr + sbase, sp, node, qx, qy,
                                    qz, need, worst, full)
        tl.debug_barrier()  # the stack is shared: a push is read by every thread next
    omask = qmask[None, :] & (cols[:, None] < K)
    found = best_i >= 0
    best_d = tl.where(found, best_d, float("inf"))
    if MAP:  # tree position -> original index
        best_i = tl.where(found, tl.load(perm_ptr + best_i, mask=omask & found, other=-1), -1)
    optr = offs[None, :] * K + cols[:, None]
    tl.store(out_d_ptr + optr, best_d, mask=omask)
    tl.store(out_i_ptr + optr, best_i.to(tl.int64), mask=omask)


def knn(tree, query: torch.Tensor, k: int, *, max_dist2: float, hint: torch.Tensor | None,
        ids: tuple[torch.Tensor, torch.Tensor] | None, block: int = KNN_BLOCK
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact kNN of ``query (N, 3)`` by blocks of ``block`` consecutive queries.

    The per-query launcher's contract (:func:`pointalign.kernels.kdtree.triton.knn`) for an
    exact search, each row's k unordered (the caller sorts).
    """
    q = query.to(tree.points.dtype).contiguous()
    n = q.shape[0]
    dev = q.device
    out_d = torch.empty((n, k), dtype=q.dtype, device=dev)
    out_i = torch.empty((n, k), dtype=torch.int64, device=dev)
    if n == 0:
        return out_d, out_i
    chunk = min(n, QUERY_CHUNK)
    stack = tree.depth + 2
    stacks = torch.empty(triton.cdiv(chunk, block) * stack, dtype=torch.int64, device=dev)
    hint_c = None if hint is None else hint.contiguous()
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        _block_knn_kernel[(triton.cdiv(e - s, block),)](
            q[s:e], tree.points, tree.lo, tree.hi, tree.split_axis, tree.split_value,
            tree.start, tree.end, stacks, out_i[s:e] if hint_c is None else hint_c[s:e],
            tree.perm if ids is None else ids[0], tree.perm if ids is None else ids[1],
            out_d[s:e], out_i[s:e], e - s, tree.first_leaf, min(float(max_dist2), BIG_HOST),
            stack, K=k, KP=max(2, triton.next_power_of_2(k)), HAS_HINT=hint is not None,
            MAP=ids is not None, QB=block,
            IDX=tl.int32 if tree.points.shape[0] <= INT32_TILE_MAX else tl.int64,
            num_warps=max(1, block // 32),
        )
    return out_d, out_i
