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
near one another (their walks then nearly coincide).

The self-query (:func:`self_knn`, ``_self_knn_kernel``): every tree point's k nearest,
one program per leaf (a balanced tree's leaf ``j`` holds positions ``[floor(j M / 2^D),
floor((j + 1) M / 2^D))``: no look-up); the walk starts at the program's own leaf, with the
sibling of every node on its path stacked beneath (deepest on top): no descent from the
root. Contract: :func:`pointalign.kernels.kdtree.self_knn`.

Tried and not kept (session 23): the same walk for any 32 consecutive queries of a
coherent order, for exact 1-NN. Alone it measured x0.41-0.96 against the per-query kernel
(H200: 1M points, the bunny, a KITTI scan, hints at the answers); inside ICP, whose hints
are the last step's partners, it cost the 40k bunny's icp() 4.24 -> 5.43 ms of GPU time
and saved icp() on 1M points only 36.0 -> 35.2 ms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pointalign.kernels.kdtree.triton import (
    BIG,
    INT32_TILE_MAX,
    _queries_and_tile,
    _replace_worst,
)

#: queries per program: at most one leaf of a tree built with 16-point leaves
QUERY_BLOCK = 16


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
    qx, qy, qz, cols, best_d, best_i = _queries_and_tile(pts_ptr, offs, qmask, BIG, K, KP, QB,
                                                         IDX)
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

