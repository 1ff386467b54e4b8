"""Triton k-d tree kernels: the device build, and exact and approximate kNN traversal.

The build (:func:`build`) runs four kinds of launch a level until the nodes hold at most
:data:`SUBTREE_BLOCK` points, then one launch finishes every level below, a program per
node with its points in registers (:func:`_subtree_kernel`).

The traversal:

One query per lane, ``BLOCK`` queries per program. Each lane walks the tree iteratively with
its own stack of node ids (depth-bounded: at most ``depth + 1`` entries) kept in a scratch
buffer in global memory (L1/L2 resident); its k best candidates live in registers as a
``(KP, BLOCK)`` tile, updated by replacing the current worst (``tl.where``, no sorting inside
the kernel). The tile is laid out queries-last so that Triton gives each thread one query's
whole column: the per-candidate maximum and arg-maximum over the k places are then a
thread's own arithmetic, where the ``(BLOCK, KP)`` tile spread a query's places over a
warp and paid warp shuffles for every candidate (H200, every point's 20 nearest in tree
order: 1M points 27.0 -> 10.5 ms, the 125k KITTI scan 2.24 -> 1.04 ms; 8 nearest 7.5 ->
3.2 ms; one nearest 0.52 -> 0.37 ms). Positions in the tile are int32 (``IDX``) below
2^31 points. Each lane's k-th distance is kept current through a leaf's points, and for
k > 1 a candidate that no lane of the program takes costs no update of the tile (every
point's 20 nearest of 1M points 10.8 -> 6.9 ms, of the KITTI scan 1.09 -> 0.86 ms).

A popped node is skipped when its bounding box is farther than the current k-th
distance, or as far once all k places are taken (its points could only tie, and ties may go
either way: a scan's thousands of copies of one point are then not all visited by every
query that reaches them); a leaf scans its points; an internal node pushes the far child,
then the near one (so the near one is visited first); the far child is pushed only when its
side of the split plane is within the current k-th distance (its points are at least that
far along the split axis). The approximate mode pushes only the near child. With a ``hint``
(k = 1: one candidate tree position per query, e.g. the previous ICP correspondence) the
search starts from that candidate's distance instead of the maximum, which prunes most of
the tree when the hint is close; the answer is the same, up to ties.
Contract: :func:`pointalign.kernels.kdtree.knn`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BIG_HOST = 3.0e38  # stands for +inf inside the kernel
BIG = tl.constexpr(BIG_HOST)


@triton.jit
def _replace_worst(best_d, best_i, worst, d, p, take, cols, KP: tl.constexpr,
                   IDX: tl.constexpr):
    """Put candidate ``(d, p)`` in place of each taking lane's worst; the new k-th distance."""
    pos = tl.min(tl.where(best_d == worst[None, :], cols[:, None], KP), axis=0)
    upd = take[None, :] & (cols[:, None] == pos[None, :])
    best_d = tl.where(upd, d[None, :], best_d)
    best_i = tl.where(upd, p[None, :].to(IDX), best_i)
    return best_d, best_i, tl.max(best_d, axis=0)


# one compilation for every size, tree depth and leaf size: the sizes, the first leaf and
# the stack's stride are run-time values, and the leaf loop runs as many steps as the
# block's largest leaf being visited holds (none when every lane is at an inner node).
# (Before, the loop's bound was the tree's largest leaf, a compile-time constant: one
# compilation per leaf size met, and rounded up to a power of two it cost ICP on the 40k
# bunny 8 -> 15 ms of k-d tree queries on an H200.)
@triton.jit(do_not_specialize=("n_query", "first_leaf", "stack"))
def _knn_kernel(q_ptr, pts_ptr, lo_ptr, hi_ptr, axis_ptr, split_ptr, start_ptr, end_ptr,
                stack_ptr, hint_ptr, perm_ptr, inv_ptr, out_d_ptr, out_i_ptr, n_query,
                first_leaf, max_d2, stack,
                K: tl.constexpr, KP: tl.constexpr,
                APPROX: tl.constexpr, HAS_HINT: tl.constexpr, MAP: tl.constexpr,
                BLOCK: tl.constexpr, IDX: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    qmask = offs < n_query
    qx = tl.load(q_ptr + offs * 3 + 0, mask=qmask, other=0.0)
    qy = tl.load(q_ptr + offs * 3 + 1, mask=qmask, other=0.0)
    qz = tl.load(q_ptr + offs * 3 + 2, mask=qmask, other=0.0)
    cols = tl.arange(0, KP)
    # the best K per lane; padding columns hold -BIG so they are never the worst
    zero_tile = tl.zeros((KP, BLOCK), dtype=qx.dtype)
    best_d = tl.where(cols[:, None] < K, zero_tile + max_d2, zero_tile - BIG)
    best_i = tl.zeros((KP, BLOCK), dtype=IDX) - 1
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
    sbase = offs * stack
    tl.store(stack_ptr + sbase, tl.zeros((BLOCK,), dtype=tl.int32), mask=qmask)
    sp = qmask.to(tl.int32)
    while tl.max(sp, axis=0) > 0:
        active = sp > 0
        sp = sp - active.to(tl.int32)
        node = tl.load(stack_ptr + sbase + sp, mask=active, other=0).to(tl.int64)
        lox = tl.load(lo_ptr + node * 3 + 0, mask=active, other=0.0)
        loy = tl.load(lo_ptr + node * 3 + 1, mask=active, other=0.0)
        loz = tl.load(lo_ptr + node * 3 + 2, mask=active, other=0.0)
        hix = tl.load(hi_ptr + node * 3 + 0, mask=active, other=0.0)
        hiy = tl.load(hi_ptr + node * 3 + 1, mask=active, other=0.0)
        hiz = tl.load(hi_ptr + node * 3 + 2, mask=active, other=0.0)
        bx = tl.maximum(tl.maximum(lox - qx, qx - hix), 0.0)
        by = tl.maximum(tl.maximum(loy - qy, qy - hiy), 0.0)
        bz = tl.maximum(tl.maximum(loz - qz, qz - hiz), 0.0)
        dbox = bx * bx + by * by + bz * bz
        worst = tl.max(best_d, axis=0)
        full = worst < max_d2  # all K places taken: an equally near point cannot enter
        visit = active & tl.where(full, dbox < worst, dbox <= worst)
        is_leaf = node >= first_leaf
        leaf = visit & is_leaf
        s = tl.load(start_ptr + node, mask=leaf, other=0)
        e = tl.load(end_ptr + node, mask=leaf, other=0)
        n_leaf = tl.max(e - s, axis=0)  # 0 where no lane visits a leaf
        j = n_leaf * 0
        while j < n_leaf:
            p = s + j
            pm = leaf & (p < e)
            px = tl.load(pts_ptr + p * 3 + 0, mask=pm, other=0.0)
            py = tl.load(pts_ptr + p * 3 + 1, mask=pm, other=0.0)
            pz = tl.load(pts_ptr + p * 3 + 2, mask=pm, other=0.0)
            dx = px - qx
            dy = py - qy
            dz = pz - qz
            d = dx * dx + dy * dy + dz * dz
            # worst: each lane's k-th distance, kept current (best_d changes only below)
            take = pm & tl.where(worst < max_d2, d < worst, d <= worst)
            if K == 1:
                best_d, best_i, worst = _replace_worst(best_d, best_i, worst, d, p, take,
                                                       cols, KP, IDX)
            elif tl.max(take.to(tl.int32), axis=0) > 0:  # skipped when no lane takes it
                best_d, best_i, worst = _replace_worst(best_d, best_i, worst, d, p, take,
                                                       cols, KP, IDX)
            j += 1
        inner = visit & (node < first_leaf)
        ax = tl.load(axis_ptr + node, mask=inner, other=0)
        sv = tl.load(split_ptr + node, mask=inner, other=0.0)
        qa = tl.where(ax == 0, qx, tl.where(ax == 1, qy, qz))
        right = (qa >= sv).to(tl.int64)
        near = 2 * node + 1 + right
        if not APPROX:
            far = 2 * node + 2 - right
            gap = qa - sv
            worst = tl.max(best_d, axis=0)
            push = inner & tl.where(worst < max_d2, gap * gap < worst, gap * gap <= worst)
            tl.store(stack_ptr + sbase + sp, far.to(tl.int32), mask=push)
            sp = sp + push.to(tl.int32)
        tl.store(stack_ptr + sbase + sp, near.to(tl.int32), mask=inner)
        sp = sp + inner.to(tl.int32)
    omask = qmask[None, :] & (cols[:, None] < K)
    found = best_i >= 0
    best_d = tl.where(found, best_d, float("inf"))
    if MAP:  # tree position -> original index
        best_i = tl.where(found, tl.load(perm_ptr + best_i, mask=omask & found, other=-1), -1)
    optr = offs[None, :] * K + cols[:, None]
    tl.store(out_d_ptr + optr, best_d, mask=omask)
    tl.store(out_i_ptr + optr, best_i, mask=omask)


#: trees of up to this many points keep int32 positions in the kNN kernel's tile (larger
#: ones int64: a position must fit)
INT32_TILE_MAX = 2**31 - 1

#: queries per launch of the k-nearest kernel (bounds its traversal stacks)
QUERY_CHUNK = 1 << 20


def knn(tree, query: torch.Tensor, k: int, *, max_dist2: float = math.inf,
        approximate: bool = False, hint: torch.Tensor | None = None,
        ids: tuple[torch.Tensor, torch.Tensor] | None = None,
        block: int | None = None, sort: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher for :func:`pointalign.kernels.kdtree.knn` (same contract).

    ``ids = (perm, inverse perm)``: ``hint`` and the returned indices are original indices,
    mapped inside the kernel (no extra launches).
    """
    q = query.to(tree.points.dtype).contiguous()
    n = q.shape[0]
    dev = q.device
    out_d = torch.empty((n, k), dtype=q.dtype, device=dev)
    out_i = torch.empty((n, k), dtype=torch.int64, device=dev)
    if n == 0:
        return out_d, out_i
    # one traversal stack per query: launched over chunks of queries, so that the stacks
    # stay ~100 MB whatever n is (a stack for each of 50M queries would hold 4 GiB)
    chunk = min(n, QUERY_CHUNK)
    stack = torch.empty(chunk * (tree.depth + 2), dtype=torch.int32, device=dev)
    kp = max(2, triton.next_power_of_2(k))
    md2 = min(float(max_dist2), BIG_HOST)
    if block is None:
        # on CUDA one warp a program, a query a thread (the k best in that thread's registers:
        # see _knn_kernel); 16 queries for k > 8, where 32 would hold twice the registers a
        # thread (H200, every point's 20 nearest in tree order: 1M 12.97 ms with 32 against
        # 10.52 with 16, k = 8: 3.21 against 3.55); small blocks keep the interpreter fast
        block = (16 if k > 8 else 32) if q.is_cuda else 16
    hint_c = None if hint is None else hint.contiguous()
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        _knn_kernel[(triton.cdiv(e - s, block),)](
            q[s:e], tree.points, tree.lo, tree.hi, tree.split_axis, tree.split_value,
            tree.start, tree.end, stack, out_i[s:e] if hint_c is None else hint_c[s:e],
            tree.perm if ids is None else ids[0], tree.perm if ids is None else ids[1],
            out_d[s:e], out_i[s:e], e - s, tree.first_leaf, md2, tree.depth + 2,
            K=k, KP=kp,
            APPROX=bool(approximate), HAS_HINT=hint is not None, MAP=ids is not None,
            BLOCK=block, IDX=tl.int32 if tree.points.shape[0] <= INT32_TILE_MAX else tl.int64,
            num_warps=max(1, block // 32),
        )
    if k == 1 or not sort:
        return out_d, out_i
    out_d, order = torch.sort(out_d, dim=1)
    return out_d, out_i.gather(1, order)


# ----------------------------------------------------------------------------- build


# the queries and the tree's arrays may be views at any offset (one compilation for all)
@triton.jit(do_not_specialize=("n_query", "depth"),
            do_not_specialize_on_alignment=("q_ptr", "axis_ptr", "split_ptr"))
def _descend_kernel(q_ptr, axis_ptr, split_ptr, out_ptr, n_query, depth, BLOCK: tl.constexpr):
    """Follow the split planes from the root ``depth`` levels down for every query row."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_query
    x = tl.load(q_ptr + offs * 3, mask=m, other=0.0)
    y = tl.load(q_ptr + offs * 3 + 1, mask=m, other=0.0)
    z = tl.load(q_ptr + offs * 3 + 2, mask=m, other=0.0)
    node = tl.zeros([BLOCK], dtype=tl.int64)
    for _ in range(depth):
        ax = tl.load(axis_ptr + node, mask=m, other=0)
        c = tl.where(ax == 0, x, tl.where(ax == 1, y, z))
        node = 2 * node + 1 + (c >= tl.load(split_ptr + node, mask=m, other=0.0)).to(tl.int64)
    tl.store(out_ptr + offs, node, mask=m)


def descend(tree, query: torch.Tensor, depth: int) -> torch.Tensor:
    """Launcher for :func:`pointalign.kernels.kdtree.descend` (one launch; float32 trees).

    ``query (N, 3)`` (cast to float32), ``depth`` already clamped to ``[0, tree.depth]``.
    """
    q = query.to(torch.float32).contiguous()
    out = torch.empty(q.shape[0], dtype=torch.int64, device=q.device)
    if q.shape[0]:
        block = 256
        _descend_kernel[(triton.cdiv(q.shape[0], block),)](
            q, tree.split_axis, tree.split_value, out, q.shape[0], depth, BLOCK=block,
            num_warps=4)
    return out


@triton.jit(do_not_specialize=("first",),
            do_not_specialize_on_alignment=("b_ptr",))  # a level's bounds: a view at any offset
def _split_axis_kernel(pts_ptr, b_ptr, axis_ptr, lo_ptr, hi_ptr, first, BLOCK: tl.constexpr,
                       SPLIT: tl.constexpr):
    """Bounding box of level node ``program_id`` (tree node ``first + program_id``), and axis.

    The node's points ``pts[b[j]:b[j + 1]]`` are read in blocks of ``BLOCK``; the box goes to
    row ``first + j`` of ``lo``, ``hi`` (n_nodes, 3) and, ``SPLIT``, the axis of largest
    extent (first on ties, as ``argmax``) to ``axis[first + j]`` (int32). Reordering a
    level only permutes the points inside each node, so the box is the final tree's.
    """
    j = tl.program_id(0).to(tl.int64)
    start = tl.load(b_ptr + j)
    end = tl.load(b_ptr + j + 1)
    lx = tl.full((BLOCK,), BIG, tl.float32)
    ly = tl.full((BLOCK,), BIG, tl.float32)
    lz = tl.full((BLOCK,), BIG, tl.float32)
    hx = tl.full((BLOCK,), -BIG, tl.float32)
    hy = tl.full((BLOCK,), -BIG, tl.float32)
    hz = tl.full((BLOCK,), -BIG, tl.float32)
    for s in range(start, end, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        m = offs < end
        x = tl.load(pts_ptr + offs * 3 + 0, mask=m, other=0.0)
        y = tl.load(pts_ptr + offs * 3 + 1, mask=m, other=0.0)
        z = tl.load(pts_ptr + offs * 3 + 2, mask=m, other=0.0)
        lx = tl.where(m, tl.minimum(lx, x), lx)
        ly = tl.where(m, tl.minimum(ly, y), ly)
        lz = tl.where(m, tl.minimum(lz, z), lz)
        hx = tl.where(m, tl.maximum(hx, x), hx)
        hy = tl.where(m, tl.maximum(hy, y), hy)
        hz = tl.where(m, tl.maximum(hz, z), hz)
    node = first + j
    mnx, mny, mnz = tl.min(lx, 0), tl.min(ly, 0), tl.min(lz, 0)
    mxx, mxy, mxz = tl.max(hx, 0), tl.max(hy, 0), tl.max(hz, 0)
    tl.store(lo_ptr + node * 3 + 0, mnx)
    tl.store(lo_ptr + node * 3 + 1, mny)
    tl.store(lo_ptr + node * 3 + 2, mnz)
    tl.store(hi_ptr + node * 3 + 0, mxx)
    tl.store(hi_ptr + node * 3 + 1, mxy)
    tl.store(hi_ptr + node * 3 + 2, mxz)
    if SPLIT:
        ex, ey, ez = mxx - mnx, mxy - mny, mxz - mnz
        ax = tl.where((ex >= ey) & (ex >= ez), 0, tl.where(ey >= ez, 1, 2))
        tl.store(axis_ptr + node, ax.to(tl.int32))


@triton.jit(do_not_specialize=("m_points", "level", "first"))
def _chunk_boxes_kernel(pts_ptr, lo_ptr, hi_ptr, m_points, level, first, BLOCK: tl.constexpr):
    """Fold ``BLOCK`` positions into the boxes of a level whose nodes hold >= ``BLOCK`` each.

    The positions of program ``i`` then meet at most two nodes (j and j + 1, as
    ``_level_keys_kernel`` assigns them); each node's part is reduced here and folded into
    rows ``first + j`` of ``lo``, ``hi`` (which start at +BIG, -BIG) by atomic min and max:
    exact in any order. A level near the root thus reads its points with every program
    of the device, where ``_split_axis_kernel``'s program per node read a million points
    alone (H200: 3.8 ms of a 10 ms build of 1M points).
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < m_points
    seg = (((offs + 1) << level) - 1) // m_points
    s0 = tl.min(tl.where(m, seg, m_points), 0)
    for part in tl.static_range(2):
        sel = m & (seg == s0 + part)
        row = (first + s0 + part) * 3
        has = tl.max(sel.to(tl.int32), 0) > 0
        for c in tl.static_range(3):
            v = tl.load(pts_ptr + offs * 3 + c, mask=m, other=0.0)
            tl.atomic_min(lo_ptr + row + c, tl.min(tl.where(sel, v, BIG), 0), mask=has,
                          sem="relaxed")
            tl.atomic_max(hi_ptr + row + c, tl.max(tl.where(sel, v, -BIG), 0), mask=has,
                          sem="relaxed")


@triton.jit(do_not_specialize=("m_points", "level", "first"))
def _level_keys_kernel(pts_ptr, axis_ptr, lo_ptr, hi_ptr, key_ptr, packed_ptr, m_points, level,
                       first, AXIS_FROM_BOX: tl.constexpr, BLOCK: tl.constexpr):
    """Compute the node, split coordinate and sort key of every position.

    For every position p: its node j (``floor(j M / 2^level) <= p``), its coordinate
    along j's split axis (``axis[first + j]``; -0.0 as +0.0), and the sort key
    ``j · 2³² + u(coordinate)`` with ``u`` the order-preserving map of the float's bits to
    [0, 2³²). ``AXIS_FROM_BOX``: the axis is the box's longest (``lo``, ``hi`` rows
    ``first + j``, first on ties as ``argmax``), stored by the node's first position.
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < m_points
    seg = (((offs + 1) << level) - 1) // m_points
    if AXIS_FROM_BOX:
        row = (first + seg) * 3
        ex = tl.load(hi_ptr + row, mask=m, other=0.0) - tl.load(lo_ptr + row, mask=m, other=0.0)
        ey = (tl.load(hi_ptr + row + 1, mask=m, other=0.0)
              - tl.load(lo_ptr + row + 1, mask=m, other=0.0))
        ez = (tl.load(hi_ptr + row + 2, mask=m, other=0.0)
              - tl.load(lo_ptr + row + 2, mask=m, other=0.0))
        ax = tl.where((ex >= ey) & (ex >= ez), 0, tl.where(ey >= ez, 1, 2))
        tl.store(axis_ptr + first + seg, ax.to(tl.int32),
                 mask=m & (((seg * m_points) >> level) == offs))
    else:
        ax = tl.load(axis_ptr + first + seg, mask=m, other=0)
    key = tl.load(pts_ptr + offs * 3 + ax, mask=m, other=0.0)
    key = tl.where(key == 0.0, 0.0, key)
    bits = key.to(tl.int32, bitcast=True).to(tl.int64)
    u = tl.where(bits < 0, -1 - bits, bits + 2147483648)
    tl.store(key_ptr + offs, key, mask=m)
    tl.store(packed_ptr + offs, (seg << 32) | u, mask=m)


@triton.jit(do_not_specialize=("m_points", "n_mid", "first"),
            do_not_specialize_on_alignment=("mid_ptr",))  # a level's split positions: a view
def _reorder_kernel(order_ptr, perm_ptr, pts_ptr, perm_out, pts_out, key_ptr, mid_ptr,
                    split_ptr, m_points, n_mid, first, BLOCK: tl.constexpr):
    """Apply a level's sort and place its splits, in one launch.

    Programs ``< cdiv(M, BLOCK)`` gather ``perm_out[p] = perm[order[p]]`` and the point
    ``pts_out[p] = pts[order[p]]``; the others compute split ``i`` of the level, halfway
    between the coordinates either side of the children's boundary,
    ``(key[order[mid[i]]] + key[order[mid[n_mid + i]]]) · 0.5``, into
    ``split[first + i]`` (the mean of the two, as ``Tensor.mean`` rounds it in float32).
    """
    pid = tl.program_id(0).to(tl.int64)
    n_gather = tl.cdiv(m_points, BLOCK)
    if pid < n_gather:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < m_points
        o = tl.load(order_ptr + offs, mask=m, other=0)
        tl.store(perm_out + offs, tl.load(perm_ptr + o, mask=m, other=0), mask=m)
        for c in tl.static_range(3):
            tl.store(pts_out + offs * 3 + c, tl.load(pts_ptr + o * 3 + c, mask=m, other=0.0),
                     mask=m)
    else:
        offs = (pid - n_gather) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n_mid
        a = tl.load(order_ptr + tl.load(mid_ptr + offs, mask=m, other=0), mask=m, other=0)
        b = tl.load(order_ptr + tl.load(mid_ptr + n_mid + offs, mask=m, other=0), mask=m,
                    other=0)
        ka = tl.load(key_ptr + a, mask=m, other=0.0)
        kb = tl.load(key_ptr + b, mask=m, other=0.0)
        tl.store(split_ptr + first + offs, (ka + kb) * 0.5, mask=m)


@triton.jit
def _node_boxes(x, y, z, g, li, valid, level, m_points, box_ptr, lo_ptr, hi_ptr, axis_ptr,
                BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    """Store the box (and, ``SPLIT``, the axis) of the level's nodes among positions ``g``.

    The positions are consecutive and sorted by node, so an inclusive segmented scan
    reduces every node's points (Hillis-Steele through the program's scratch ``box_ptr``:
    step k takes the partial ``2^k`` places back where it lies in the same node, as many
    steps as the level's largest node needs); the node's last position stores its box.
    Returns each position's node index within the level.
    """
    seg = (((g + 1) << level) - 1) // m_points
    lx, ly, lz = tl.where(valid, x, BIG), tl.where(valid, y, BIG), tl.where(valid, z, BIG)
    hx, hy, hz = tl.where(valid, x, -BIG), tl.where(valid, y, -BIG), tl.where(valid, z, -BIG)
    span = (m_points + (1 << level) - 1) >> level  # the level's largest node
    shift = 1
    while shift < span:
        tl.store(box_ptr + 0 * BLOCK + li, lx)
        tl.store(box_ptr + 1 * BLOCK + li, ly)
        tl.store(box_ptr + 2 * BLOCK + li, lz)
        tl.store(box_ptr + 3 * BLOCK + li, hx)
        tl.store(box_ptr + 4 * BLOCK + li, hy)
        tl.store(box_ptr + 5 * BLOCK + li, hz)
        tl.debug_barrier()
        take = (li >= shift) & ((((g - shift + 1) << level) - 1) // m_points == seg)
        back = tl.where(take, li - shift, li)
        lx = tl.minimum(lx, tl.load(box_ptr + 0 * BLOCK + back))
        ly = tl.minimum(ly, tl.load(box_ptr + 1 * BLOCK + back))
        lz = tl.minimum(lz, tl.load(box_ptr + 2 * BLOCK + back))
        hx = tl.maximum(hx, tl.load(box_ptr + 3 * BLOCK + back))
        hy = tl.maximum(hy, tl.load(box_ptr + 4 * BLOCK + back))
        hz = tl.maximum(hz, tl.load(box_ptr + 5 * BLOCK + back))
        tl.debug_barrier()  # every lane has read before the next step overwrites
        shift *= 2
    node = (1 << level) - 1 + seg
    last = valid & (g == (((seg + 1) * m_points) >> level) - 1)
    tl.store(lo_ptr + node * 3 + 0, lx, mask=last)
    tl.store(lo_ptr + node * 3 + 1, ly, mask=last)
    tl.store(lo_ptr + node * 3 + 2, lz, mask=last)
    tl.store(hi_ptr + node * 3 + 0, hx, mask=last)
    tl.store(hi_ptr + node * 3 + 1, hy, mask=last)
    tl.store(hi_ptr + node * 3 + 2, hz, mask=last)
    if SPLIT:  # (padding lanes: no extent, so no overflow)
        ex = tl.where(valid, hx, 0.0) - tl.where(valid, lx, 0.0)
        ey = tl.where(valid, hy, 0.0) - tl.where(valid, ly, 0.0)
        ez = tl.where(valid, hz, 0.0) - tl.where(valid, lz, 0.0)
        ax = tl.where((ex >= ey) & (ex >= ez), 0, tl.where(ey >= ez, 1, 2))
        tl.store(axis_ptr + node, ax.to(tl.int32), mask=last)
    return seg


@triton.jit
def _bitonic_sort(key, li, key_ptr, LOG_BLOCK: tl.constexpr):
    """Sort the program's int64 ``key`` ascending (Batcher's bitonic network).

    The stages exchange through the scratch ``key_ptr`` in run-time loops: a kernel that
    compiles in ~1 s, where ``tl.sort`` unrolls every stage (~5 s on an H200 host's CPU for
    1024 keys) and interprets element by element.
    """
    for kk in range(1, LOG_BLOCK + 1):
        for t in range(kk):
            j = 1 << (kk - 1 - t)
            tl.store(key_ptr + li, key)
            tl.debug_barrier()
            other = tl.load(key_ptr + (li ^ j))
            tl.debug_barrier()  # every lane has read before the next stage overwrites
            up = ((li >> kk) & 1) == 0  # this run of 2^kk ascends
            low = (li & j) == 0  # the lower lane of the pair
            key = tl.where(low == up, tl.minimum(key, other), tl.maximum(key, other))
    return key


@triton.jit(do_not_specialize=("m_points", "level0", "depth"),
            do_not_specialize_on_alignment=("b_ptr",))  # a level's bounds: a view
def _subtree_kernel(pts_ptr, perm_ptr, b_ptr, lo_ptr, hi_ptr, axis_ptr, split_ptr,
                    scratch_ptr, m_points, level0, depth, BLOCK: tl.constexpr,
                    LOG_BLOCK: tl.constexpr):
    """Finish the subtree of node ``program_id`` of level ``level0``: every level below it.

    The node's points (at most ``BLOCK``, ``pts[b[j]:b[j + 1]]`` and their ``perm``) stay in
    registers; per level: the boxes and axes of its nodes (one segmented scan), then one
    sort of the keys ``(node, u(coordinate), position)`` (the stable sort of the level
    loop), the points and ids permuted in place through memory, and the splits; at
    ``depth`` the leaves' boxes. ``scratch`` holds ``4 · BLOCK`` int64 per program (the
    sort's keys, then the scan's six float32 rows: :data:`SCRATCH_PER_POINT`). The same
    arithmetic, order and rounding as the level loop, in one launch for the levels whose
    nodes fit a program.
    """
    j = tl.program_id(0).to(tl.int64)
    start = tl.load(b_ptr + j)
    end = tl.load(b_ptr + j + 1)
    li = tl.arange(0, BLOCK).to(tl.int64)
    g = start + li
    valid = g < end
    key_ptr = scratch_ptr + j * (4 * BLOCK)
    box_ptr = (key_ptr + BLOCK).to(tl.pointer_type(tl.float32), bitcast=True)
    x = tl.load(pts_ptr + g * 3 + 0, mask=valid, other=0.0)
    y = tl.load(pts_ptr + g * 3 + 1, mask=valid, other=0.0)
    z = tl.load(pts_ptr + g * 3 + 2, mask=valid, other=0.0)
    p = tl.load(perm_ptr + g, mask=valid, other=0)
    for level in range(level0, depth):
        seg = _node_boxes(x, y, z, g, li, valid, level, m_points, box_ptr, lo_ptr, hi_ptr,
                          axis_ptr, BLOCK, True)
        tl.debug_barrier()  # the axes are read back by every position of their node
        node = (1 << level) - 1 + seg
        ax = tl.load(axis_ptr + node, mask=valid, other=0)
        c = tl.where(ax == 0, x, tl.where(ax == 1, y, z))
        c = tl.where(c == 0.0, 0.0, c)
        bits = c.to(tl.int32, bitcast=True).to(tl.int64)
        u = tl.where(bits < 0, -1 - bits, bits + 2147483648)
        seg0 = (((start + 1) << level) - 1) // m_points
        key = ((seg - seg0) << (32 + LOG_BLOCK)) | (u << LOG_BLOCK) | li
        key = _bitonic_sort(tl.where(valid, key, 0x7FFFFFFFFFFFFFFF - li), li, key_ptr,
                            LOG_BLOCK)
        src = start + (key & (BLOCK - 1))
        x = tl.load(pts_ptr + src * 3 + 0, mask=valid, other=0.0)
        y = tl.load(pts_ptr + src * 3 + 1, mask=valid, other=0.0)
        z = tl.load(pts_ptr + src * 3 + 2, mask=valid, other=0.0)
        p = tl.load(perm_ptr + src, mask=valid, other=0)
        tl.debug_barrier()  # every position has read its source before any is overwritten
        tl.store(pts_ptr + g * 3 + 0, x, mask=valid)
        tl.store(pts_ptr + g * 3 + 1, y, mask=valid)
        tl.store(pts_ptr + g * 3 + 2, z, mask=valid)
        tl.store(perm_ptr + g, p, mask=valid)
        tl.debug_barrier()  # the new order is read back across the split
        # the split: halfway between the coordinates either side of the children's boundary
        mid = valid & (g == (((2 * seg + 1) * m_points) >> (level + 1)))
        here = tl.where(ax == 0, x, tl.where(ax == 1, y, z))
        prev = tl.load(pts_ptr + (g - 1) * 3 + ax, mask=mid, other=0.0)
        here = tl.where(here == 0.0, 0.0, here)
        prev = tl.where(prev == 0.0, 0.0, prev)
        tl.store(split_ptr + node, (prev + here) * 0.5, mask=mid)
    _node_boxes(x, y, z, g, li, valid, depth, m_points, box_ptr, lo_ptr, hi_ptr, axis_ptr,
                BLOCK, False)


#: the largest node the subtree kernel finishes in one program (points held in registers;
#: 1024 and 2048 tie on a 40k-point build, 1024 is ahead at 1.5k and 1M points, H200)
SUBTREE_BLOCK = 1024

#: int64 words of scratch per point a subtree program uses: its sort keys (one) and its
#: scan's six float32 rows (three); ``_subtree_kernel`` strides its programs by this
SCRATCH_PER_POINT = 4


def subtree_level(m: int, block: int) -> int:
    """Return the first level whose nodes all hold at most ``block`` of ``m`` points."""
    level = 0
    while -(-m // (1 << level)) > block:
        level += 1
    return level


#: levels whose every node holds at least this many points find their boxes by blocks of
#: points (:func:`_chunk_boxes_kernel`), not a program per node: a program alone reading a
#: node this wide is what bounds the level. (Session 20, H200, kernel time of one build:
#: 125k points 1.134 -> 0.923 ms, 40k 0.798 -> 0.752 ms against 2^17; from 2^10 on the
#: same, 0.916 / 0.758 ms. The end-to-end calls moved within their noise, x0.97-x1.01.)
CHUNK_BOXES_MIN = 1 << 14


def build(points: torch.Tensor, depth: int, bounds: list[torch.Tensor],
          mids: list[torch.Tensor], subtree_block: int | None = None
          ) -> tuple[torch.Tensor, ...]:
    """Build the tree over float32 ``points (M, 3)``: four kinds of launch a level, then one.

    ``bounds``: each level's node bounds (``level_bounds``, levels 0..depth), ``mids``:
    each split level's ``(2, 2^level)`` positions either side of the children's boundary,
    on the points' device. Per level: the nodes' boxes (while every node holds at least
    :data:`CHUNK_BOXES_MIN` points, a program per block of points folding into the boxes
    by atomics, :func:`_chunk_boxes_kernel`; below, a program per node) and split axes,
    every position's node and key, one stable sort, the reorder and the level's splits;
    from the first level whose nodes hold at most ``subtree_block`` points (default
    :data:`SUBTREE_BLOCK`, a power of two; 0: none), one launch of :func:`_subtree_kernel`
    finishes every level below and the leaves' boxes (a 40k-point build: 12 levels -> 6
    and that launch, 3.2-4.6 -> 1.9-3.0 ms on H200s; 1M points 10.4 -> 7.2 ms with the
    boxes by blocks, the rest its top levels' sorts: BENCHMARKS.md, "k-d tree"); else the
    leaves' boxes. The same tree as
    the level loop of torch operations in ``kdtree.build`` (the same keys, stable order
    and rounding; the boxes as the min/max of each node's points).

    Returns ``(perm (M,) int64, points[perm] (M, 3), lo, hi (n_nodes, 3), split_axis
    (n_nodes,) int32 (-1 at the leaves), split_value (n_nodes,))``.
    """
    m, dev = points.shape[0], points.device
    n_nodes = 2 ** (depth + 1) - 1
    block = 1024 if points.is_cuda else 64
    lo = torch.empty(n_nodes, 3, dtype=points.dtype, device=dev)
    hi = torch.empty_like(lo)
    axis = torch.full((n_nodes,), -1, dtype=torch.int32, device=dev)
    split = torch.zeros(n_nodes, dtype=points.dtype, device=dev)
    perm = torch.arange(m, device=dev)
    pts = points.contiguous()
    key = torch.empty(m, dtype=points.dtype, device=dev)
    packed = torch.empty(m, dtype=torch.int64, device=dev)
    grid = triton.cdiv(m, block)
    sub = SUBTREE_BLOCK if subtree_block is None else int(subtree_block)
    if sub < 0 or sub & (sub - 1):
        raise ValueError(f"subtree_block: expected 0 or a power of two, got {sub}")
    # the first level the subtree kernel finishes; depth + 1: none (or no such kernel)
    level0 = min(subtree_level(m, sub), depth + 1) if sub else depth + 1
    wide = 0  # the levels whose nodes are wide enough: boxes by chunks
    while wide < min(level0, depth) and (m >> wide) >= max(block, CHUNK_BOXES_MIN):
        wide += 1
    if wide:
        lo[:2**wide - 1] = BIG_HOST  # one fill: the atomic folds' starting boxes
        hi[:2**wide - 1] = -BIG_HOST
    for level in range(min(level0, depth)):
        first = 2**level - 1
        if level < wide:
            _chunk_boxes_kernel[(grid,)](pts, lo, hi, m, level, first, BLOCK=block,
                                         num_warps=4)
        else:
            _split_axis_kernel[(2**level,)](pts, bounds[level], axis, lo, hi, first,
                                            BLOCK=block, SPLIT=True, num_warps=4)
        _level_keys_kernel[(grid,)](pts, axis, lo, hi, key, packed, m, level, first,
                                    AXIS_FROM_BOX=level < wide, BLOCK=block, num_warps=4)
        order = torch.sort(packed, stable=True).indices
        perm_n, pts_n = torch.empty_like(perm), torch.empty_like(pts)
        n_mid = 2**level
        _reorder_kernel[(grid + triton.cdiv(n_mid, block),)](
            order, perm, pts, perm_n, pts_n, key, mids[level], split, m, n_mid, first,
            BLOCK=block, num_warps=4)
        perm, pts = perm_n, pts_n
    if level0 <= depth:
        if level0 == 0:  # the kernel permutes in place: not the caller's points
            pts = pts.clone()
        scratch = torch.empty(2**level0 * SCRATCH_PER_POINT * sub, dtype=torch.int64,
                              device=dev)
        _subtree_kernel[(2**level0,)](pts, perm, bounds[level0], lo, hi, axis, split, scratch,
                                      m, level0, depth, BLOCK=sub,
                                      LOG_BLOCK=sub.bit_length() - 1,
                                      num_warps=8 if points.is_cuda else 1)
    else:
        _split_axis_kernel[(2**depth,)](pts, bounds[depth], axis, lo, hi, 2**depth - 1,
                                        BLOCK=block, SPLIT=False, num_warps=4)
    return perm, pts, lo, hi, axis, split
