"""Triton self-query of a k-d tree: every tree point's k nearest, one program per leaf.

The queries are the tree's own points, so the ``QB`` queries of a program are the points of
one leaf (a balanced tree's leaf ``j`` holds positions ``[floor(j M / 2^D), floor((j + 1) M
/ 2^D))``: no look-up). They walk the tree together: one stack of node ids per program, one
node at a time for all lanes, its box and split read once (one address for the whole
program, where per-query traversal keeps a stack per lane and reads a node per lane). A
node is visited when it may still hold a point nearer than the k-th of any lane; a visited
leaf's points are read one at a time, each compared with every lane's k best (the tile of
:func:`pointalign.kernels.kdtree.triton._knn_kernel`, queries last). The walk starts at the
program's own leaf, with the sibling of every node on its path stacked beneath (deepest on
top): no descent from the root. At an inner node both children are stacked where some lane
needs them, the one most lanes lie in on top. Pruning is the per-query kernel's: a box
farther than a lane's k-th distance (or as far, once its k places are taken) is skipped for
that lane, a child beyond the split plane likewise. Contract:
:func:`pointalign.kernels.kdtree.self_knn`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pointalign.kernels.kdtree.triton import BIG, INT32_TILE_MAX, _replace_worst

#: queries per program: at most one leaf of a tree built with 16-point leaves
QUERY_BLOCK = 16


@triton.jit
def _reach(gap2, worst, full):
    """Lanes a point or box ``gap2`` away may still enter (ties: only while not full)."""
    return tl.where(full, gap2 < worst, gap2 <= worst)


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
    sp = depth + 1
    while sp > 0:
        sp -= 1
        node = tl.load(stack_ptr + sbase + sp)
        bx = tl.maximum(tl.maximum(tl.load(lo_ptr + node * 3 + 0) - qx,
                                   qx - tl.load(hi_ptr + node * 3 + 0)), 0.0)
        by = tl.maximum(tl.maximum(tl.load(lo_ptr + node * 3 + 1) - qy,
                                   qy - tl.load(hi_ptr + node * 3 + 1)), 0.0)
        bz = tl.maximum(tl.maximum(tl.load(lo_ptr + node * 3 + 2) - qz,
                                   qz - tl.load(hi_ptr + node * 3 + 2)), 0.0)
        worst = tl.max(best_d, axis=0)
        full = worst < BIG
        need = qmask & _reach(bx * bx + by * by + bz * bz, worst, full)
        if tl.max(need.to(tl.int32), axis=0) > 0:
            if node >= first_leaf:
                j = node - first_leaf
                p = (j * m_points) >> depth
                p_end = ((j + 1) * m_points) >> depth
                while p < p_end:
                    dx = tl.load(pts_ptr + p * 3 + 0) - qx
                    dy = tl.load(pts_ptr + p * 3 + 1) - qy
                    dz = tl.load(pts_ptr + p * 3 + 2) - qz
                    d = dx * dx + dy * dy + dz * dz
                    take = need & _reach(d, worst, worst < BIG)
                    if tl.max(take.to(tl.int32), axis=0) > 0:
                        best_d, best_i, worst = _replace_worst(
                            best_d, best_i, worst, d, tl.zeros((QB,), tl.int64) + p, take,
                            cols, KP, IDX)
                    p += 1
            else:
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
                # the child with fewer lanes in it first, so that the other pops first
                l_first = n_left < n_right
                first = tl.where(l_first, 2 * node + 1, 2 * node + 2)
                second = tl.where(l_first, 2 * node + 2, 2 * node + 1)
                want_first = tl.where(l_first, want_l, want_r)
                want_second = tl.where(l_first, want_r, want_l)
                if want_first:
                    tl.store(stack_ptr + sbase + sp, first)
                    sp += 1
                if want_second:
                    tl.store(stack_ptr + sbase + sp, second)
                    sp += 1
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
