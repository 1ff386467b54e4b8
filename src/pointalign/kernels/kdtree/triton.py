"""Triton k-d tree kernels: the device build, and exact and approximate kNN traversal.

The build (:func:`build`) sorts the points once along each axis, then splits those sorted
lists stably, level by level (five launches a level, no sort), until the nodes hold at most
:data:`SUBTREE_BLOCK` points; one launch finishes every level below, a program per node
with its points in registers (:func:`_subtree_kernel`).

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


@triton.jit
def _queries_and_tile(q_ptr, offs, qmask, max_d2, K: tl.constexpr, KP: tl.constexpr,
                      BLOCK: tl.constexpr, IDX: tl.constexpr):
    """Load the queries at ``offs``; an empty ``(KP, BLOCK)`` tile of k best (``max_d2``, -1).

    The padding columns past K hold -BIG, so that they are never the worst.
    """
    qx = tl.load(q_ptr + offs * 3 + 0, mask=qmask, other=0.0)
    qy = tl.load(q_ptr + offs * 3 + 1, mask=qmask, other=0.0)
    qz = tl.load(q_ptr + offs * 3 + 2, mask=qmask, other=0.0)
    cols = tl.arange(0, KP)
    zero_tile = tl.zeros((KP, BLOCK), dtype=qx.dtype)
    best_d = tl.where(cols[:, None] < K, zero_tile + max_d2, zero_tile - BIG)
    best_i = tl.zeros((KP, BLOCK), dtype=IDX) - 1
    return qx, qy, qz, cols, best_d, best_i


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
    qx, qy, qz, cols, best_d, best_i = _queries_and_tile(q_ptr, offs, qmask, max_d2, K, KP,
                                                         BLOCK, IDX)
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


@triton.jit
def _ordered(c):
    """int32 ordered as the float32 ``c`` are (-0.0 as +0.0): the bits, negatives reversed."""
    b = tl.where(c == 0.0, 0.0, c).to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit(do_not_specialize=("m_points",))
def _axis_keys_kernel(pts_ptr, key_ptr, m_points, BLOCK: tl.constexpr, PACKED: tl.constexpr):
    """Write row ``c`` of ``key (3, M)`` int32: every point's coordinate ``c``, ordered.

    ``PACKED``: int64 keys ``c · 2³² + u`` instead (``u`` the ordered bits as unsigned), so
    that one sort orders the three rows at once.
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < m_points
    for c in tl.static_range(3):
        v = tl.load(pts_ptr + offs * 3 + c, mask=m, other=0.0)
        k = _ordered(v)
        if PACKED:
            k = (k.to(tl.int64) + 2147483648) | (c << 32)
        tl.store(key_ptr + c * m_points + offs, k, mask=m)


@triton.jit
def _list_end(pts_ptr, list_ptr, pos, c, m_points, mask):
    """Coordinate ``c`` of the point at position ``pos`` of list ``c`` (-0.0 as +0.0)."""
    i = tl.load(list_ptr + c * m_points + pos, mask=mask, other=0)
    v = tl.load(pts_ptr + i * 3 + c, mask=mask, other=0.0)
    return tl.where(v == 0.0, 0.0, v)


@triton.jit
def _store_box(lo_ptr, hi_ptr, node, lx, ly, lz, hx, hy, hz, mask):
    """Store node boxes: ``lo[node] = (lx, ly, lz)``, ``hi[node] = (hx, hy, hz)``."""
    tl.store(lo_ptr + node * 3 + 0, lx, mask=mask)
    tl.store(lo_ptr + node * 3 + 1, ly, mask=mask)
    tl.store(lo_ptr + node * 3 + 2, lz, mask=mask)
    tl.store(hi_ptr + node * 3 + 0, hx, mask=mask)
    tl.store(hi_ptr + node * 3 + 1, hy, mask=mask)
    tl.store(hi_ptr + node * 3 + 2, hz, mask=mask)


@triton.jit
def _longest_axis(ex, ey, ez):
    """Return the axis of the largest extent, the first on ties (as ``argmax``)."""
    return tl.where((ex >= ey) & (ex >= ez), 0, tl.where(ey >= ez, 1, 2))


@triton.jit(do_not_specialize=("m_points", "level"))
def _top_nodes_kernel(pts_ptr, list_ptr, lo_ptr, hi_ptr, axis_ptr, split_ptr, m_points, level,
                      SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """Box (and, ``SPLIT``, split axis and value) of every node of a level, from the lists.

    Node ``j`` of the level owns positions ``[b0, b1)`` of each list ``c < 3``, sorted there
    by coordinate ``c``: its box is the coordinates at ``b0`` and ``b1 - 1``. The axis is
    the box's longest (first on ties, as ``argmax``) and the split is halfway between the
    coordinates either side of the children's boundary ``mid`` in that axis's list.
    """
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    nm = j < (1 << level)
    node = (1 << level) - 1 + j
    b0 = (j * m_points) >> level
    b1 = ((j + 1) * m_points) >> level
    lx = _list_end(pts_ptr, list_ptr, b0, 0, m_points, nm)
    ly = _list_end(pts_ptr, list_ptr, b0, 1, m_points, nm)
    lz = _list_end(pts_ptr, list_ptr, b0, 2, m_points, nm)
    hx = _list_end(pts_ptr, list_ptr, b1 - 1, 0, m_points, nm)
    hy = _list_end(pts_ptr, list_ptr, b1 - 1, 1, m_points, nm)
    hz = _list_end(pts_ptr, list_ptr, b1 - 1, 2, m_points, nm)
    _store_box(lo_ptr, hi_ptr, node, lx, ly, lz, hx, hy, hz, nm)
    if SPLIT:
        ax = _longest_axis(hx - lx, hy - ly, hz - lz).to(tl.int64)
        mid = ((2 * j + 1) * m_points) >> (level + 1)
        below = _list_end(pts_ptr, list_ptr, mid - 1, ax, m_points, nm)
        above = _list_end(pts_ptr, list_ptr, mid, ax, m_points, nm)
        tl.store(axis_ptr + node, ax.to(tl.int32), mask=nm)
        tl.store(split_ptr + node, (below + above) * 0.5, mask=nm)


@triton.jit(do_not_specialize=("m_points", "level"))
def _top_side_kernel(list_ptr, axis_ptr, side_ptr, m_points, level, BLOCK: tl.constexpr):
    """Mark every point's side of its node's split: ``side[id] = 1`` left, 0 right.

    Position ``p`` of node ``j``'s split-axis list goes left when ``p < mid``: the node's
    first ``mid - b0`` points by (coordinate, id).
    """
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = p < m_points
    seg = (((p + 1) << level) - 1) // m_points
    mid = ((2 * seg + 1) * m_points) >> (level + 1)
    ax = tl.load(axis_ptr + (1 << level) - 1 + seg, mask=m, other=0).to(tl.int64)
    i = tl.load(list_ptr + ax * m_points + p, mask=m, other=0)
    tl.store(side_ptr + i, (p < mid).to(tl.int32), mask=m)


@triton.jit(do_not_specialize=("n_total",))
def _top_flags_kernel(list_ptr, side_ptr, flag_ptr, n_total, BLOCK: tl.constexpr):
    """``flag[q] = side[list[q]]`` over the four lists, end to end."""
    q = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = q < n_total
    i = tl.load(list_ptr + q, mask=m, other=0)
    tl.store(flag_ptr + q, tl.load(side_ptr + i, mask=m, other=0), mask=m)


@triton.jit(do_not_specialize=("m_points", "level", "n_total"))
def _top_partition_kernel(list_ptr, flag_ptr, csum_ptr, out_ptr, m_points, level, n_total,
                          BLOCK: tl.constexpr):
    """Split every node of every list stably: its left points first, then its right.

    ``csum``: the inclusive running count of ``flag`` over the four lists end to end; the
    left points before position ``p`` of node ``[b0, ...)`` are ``csum[p] - flag[p]`` less
    the count before ``b0``. A left point goes to ``b0 +`` that count, a right one to
    ``mid +`` the right points before it, so each list stays sorted within every child.
    """
    q = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = q < n_total
    row = q // m_points
    p = q - row * m_points
    seg = (((p + 1) << level) - 1) // m_points
    b0 = (seg * m_points) >> level
    mid = ((2 * seg + 1) * m_points) >> (level + 1)
    f = tl.load(flag_ptr + q, mask=m, other=0)
    start = row * m_points + b0
    base = tl.load(csum_ptr + start, mask=m, other=0) - tl.load(flag_ptr + start, mask=m,
                                                                 other=0)
    left_before = (tl.load(csum_ptr + q, mask=m, other=0) - f - base).to(tl.int64)
    new = tl.where(f != 0, b0 + left_before, mid + (p - b0 - left_before))
    tl.store(out_ptr + row * m_points + new, tl.load(list_ptr + q, mask=m, other=0), mask=m)


@triton.jit(do_not_specialize=("m_points", "level"))
def _top_gather_kernel(points_ptr, list_ptr, axis_ptr, perm_ptr, pts_ptr, m_points, level,
                       BY_PARENT: tl.constexpr, BLOCK: tl.constexpr):
    """Lay the points out in tree order at ``level``: ``perm``, ``points[perm]``.

    Within each node the order of the id list (the subtree kernel's start), or
    ``BY_PARENT`` (leaves) the parent's split-axis list: by (that coordinate, id), as the
    level sort of the reference leaves them.
    """
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = p < m_points
    if BY_PARENT:
        seg = (((p + 1) << level) - 1) // m_points
        parent = ((1 << level) - 2 + seg) >> 1
        row = tl.load(axis_ptr + parent, mask=m, other=0).to(tl.int64)
    else:
        row = tl.zeros_like(p) + 3
    i = tl.load(list_ptr + row * m_points + p, mask=m, other=0)
    tl.store(perm_ptr + p, i, mask=m)
    for c in tl.static_range(3):
        tl.store(pts_ptr + p * 3 + c, tl.load(points_ptr + i * 3 + c, mask=m, other=0.0),
                 mask=m)


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
    _store_box(lo_ptr, hi_ptr, node, lx, ly, lz, hx, hy, hz, last)
    if SPLIT:  # (padding lanes: no extent, so no overflow)
        ax = _longest_axis(tl.where(valid, hx, 0.0) - tl.where(valid, lx, 0.0),
                           tl.where(valid, hy, 0.0) - tl.where(valid, ly, 0.0),
                           tl.where(valid, hz, 0.0) - tl.where(valid, lz, 0.0))
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

    The node's points (at most ``BLOCK``, ``pts[b[j]:b[j + 1]]`` and their ``perm``, given
    in the order of their ids) stay in registers with their rank by id within the node;
    per level: the boxes and axes of its nodes (one segmented scan), then one sort of the
    keys ``(node, u(coordinate), rank, position)`` (the level loop's sort by node,
    coordinate and id), the points and ids permuted in place through memory, and the
    splits; at ``depth`` the leaves' boxes. ``scratch`` holds ``4 · BLOCK`` int64 per
    program (the sort's keys, then the scan's six float32 rows:
    :data:`SCRATCH_PER_POINT`). The same arithmetic, order and rounding as the level loop,
    in one launch for the levels whose nodes fit a program. A key holds ``3 · LOG_BLOCK +
    32`` bits (a node's descendants at a level number at most its points): ``BLOCK <=
    2^10``.
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
    rank = li  # by id within the node: the points come in id order
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
        key = ((((seg - seg0) << 32) | u) << (2 * LOG_BLOCK)) | (rank << LOG_BLOCK) | li
        key = _bitonic_sort(tl.where(valid, key, 0x7FFFFFFFFFFFFFFF - li), li, key_ptr,
                            LOG_BLOCK)
        src = start + (key & (BLOCK - 1))
        rank = (key >> LOG_BLOCK) & (BLOCK - 1)
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


#: the largest node the subtree kernel finishes in one program (points held in registers),
#: and the most its sort keys allow (:func:`_subtree_kernel`). With the top levels split
#: from the sorted lists, smaller programs won (session 21, H200, GPU time of one build at
#: 40k / 125k / 1M points: 1024 0.51 / 0.59 / 3.42 ms, 512 0.38 / 0.51 / 2.65, 256 0.36 /
#: 0.48 / 2.45; 512 with the packed presort 0.33 / 0.46 / 2.77; 1024 had led while every
#: level above it was a sort)
SUBTREE_BLOCK = 512
MAX_SUBTREE_BLOCK = 1024

#: int64 words of scratch per point a subtree program uses: its sort keys (one) and its
#: scan's six float32 rows (three); ``_subtree_kernel`` strides its programs by this
SCRATCH_PER_POINT = 4


def subtree_level(m: int, block: int) -> int:
    """Return the first level whose nodes all hold at most ``block`` of ``m`` points."""
    level = 0
    while -(-m // (1 << level)) > block:
        level += 1
    return level


#: the lists a build partitions level by level: the point ids sorted by x, by y, by z, and
#: in id order
N_LISTS = 4


#: up to this many points the three presorts are one sort of packed 64-bit keys, above it
#: three sorts of 32-bit keys (H200, GPU time of one build, subtree programs of 512: 40k
#: 0.38 -> 0.33 ms, 125k 0.51 -> 0.46 ms packed; 1M 2.65 -> 2.77 ms)
PRESORT_PACKED_MAX = 1 << 19


def _presorted(points: torch.Tensor, block: int) -> torch.Tensor:
    """Return ``(4, M)`` int64: the ids sorted by x, y and z (ties by id), and ``arange(M)``."""
    m, dev = points.shape[0], points.device
    lists = torch.empty(N_LISTS, m, dtype=torch.int64, device=dev)
    grid = (triton.cdiv(m, block),)
    if m <= PRESORT_PACKED_MAX:
        keys = torch.empty(3, m, dtype=torch.int64, device=dev)
        _axis_keys_kernel[grid](points, keys, m, BLOCK=block, PACKED=True, num_warps=4)
        order = torch.sort(keys.view(-1), stable=True).indices.view(3, m)
        torch.sub(order, torch.arange(0, 3 * m, m, device=dev)[:, None], out=lists[:3])
    else:
        keys = torch.empty(3, m, dtype=torch.int32, device=dev)
        _axis_keys_kernel[grid](points, keys, m, BLOCK=block, PACKED=False, num_warps=4)
        values = torch.empty(m, dtype=torch.int32, device=dev)
        for c in range(3):
            torch.sort(keys[c], stable=True, out=(values, lists[c]))
    torch.arange(m, out=lists[3])
    return lists


def build(points: torch.Tensor, depth: int, bounds: list[torch.Tensor],
          subtree_block: int | None = None) -> tuple[torch.Tensor, ...]:
    """Build the tree over float32 ``points (M, 3)``: five launches a level, then one.

    ``bounds``: each level's node bounds (``level_bounds``, levels 0..depth) on the points'
    device. The ids are sorted once along each axis (three sorts of 32-bit keys, ties by
    id) and kept, with the ids in their own order, as four lists that each hold every
    node's points contiguously. A level then needs no sort: each node's box is read at its
    ends of the three sorted lists, its split axis and value at its children's boundary in
    that axis's list (:func:`_top_nodes_kernel`); every point learns its side
    (:func:`_top_side_kernel`), and every list is split stably, node by node, by one
    running count (:func:`_top_flags_kernel`, ``torch.cumsum``,
    :func:`_top_partition_kernel`). (Session 21: this replaced a stable sort of 64-bit keys
    a level, eight radix passes of ~9 µs each at 125k points on an H200.) From the first
    level whose nodes hold at most ``subtree_block`` points (default
    :data:`SUBTREE_BLOCK`, a power of two up to :data:`MAX_SUBTREE_BLOCK`; 0: none), one
    launch of :func:`_subtree_kernel` finishes every level below and the leaves' boxes;
    else the leaves' boxes from the lists. The same tree as the level loop of
    ``kdtree.build``: every node's points ordered by (coordinate, id), the same splits'
    rounding, the boxes as the min/max of each node's points.

    Returns ``(perm (M,) int64, points[perm] (M, 3), lo, hi (n_nodes, 3), split_axis
    (n_nodes,) int32 (-1 at the leaves), split_value (n_nodes,))``.
    """
    m, dev = points.shape[0], points.device
    points = points.contiguous()
    n_nodes = 2 ** (depth + 1) - 1
    block = 1024 if points.is_cuda else 64
    lo = torch.empty(n_nodes, 3, dtype=points.dtype, device=dev)
    hi = torch.empty_like(lo)
    axis = torch.full((n_nodes,), -1, dtype=torch.int32, device=dev)
    split = torch.zeros(n_nodes, dtype=points.dtype, device=dev)
    sub = SUBTREE_BLOCK if subtree_block is None else int(subtree_block)
    if sub < 0 or sub & (sub - 1) or sub > MAX_SUBTREE_BLOCK:
        raise ValueError(f"subtree_block: expected 0 or a power of two up to "
                         f"{MAX_SUBTREE_BLOCK}, got {sub}")
    # the first level the subtree kernel finishes; depth + 1: none (or no such kernel)
    level0 = min(subtree_level(m, sub), depth + 1) if sub else depth + 1
    if 0 < level0 == depth:  # nothing left to split: the leaves' boxes from the lists
        level0 = depth + 1
    if level0 == 0:  # one program: the points in id order; it permutes them in place
        perm, pts = torch.arange(m, device=dev), points.clone()
    else:
        top = min(level0, depth)  # the levels split here
        lists = _presorted(points, block)
        spare = torch.empty_like(lists)
        side = torch.empty(m, dtype=torch.int32, device=dev)
        flags = torch.empty(N_LISTS * m, dtype=torch.int32, device=dev)
        grid, grid_all = triton.cdiv(m, block), triton.cdiv(N_LISTS * m, block)
        for level in range(top):
            _top_nodes_kernel[(triton.cdiv(2**level, block),)](
                points, lists, lo, hi, axis, split, m, level, SPLIT=True, BLOCK=block,
                num_warps=4)
            _top_side_kernel[(grid,)](lists, axis, side, m, level, BLOCK=block, num_warps=4)
            _top_flags_kernel[(grid_all,)](lists, side, flags, N_LISTS * m, BLOCK=block,
                                           num_warps=4)
            csum = torch.cumsum(flags, 0, dtype=torch.int32)
            _top_partition_kernel[(grid_all,)](lists, flags, csum, spare, m, level,
                                               N_LISTS * m, BLOCK=block, num_warps=4)
            lists, spare = spare, lists
        leaves = level0 > depth  # no subtree kernel: the leaves' boxes from the lists
        if leaves:
            _top_nodes_kernel[(triton.cdiv(2**depth, block),)](
                points, lists, lo, hi, axis, split, m, depth, SPLIT=False, BLOCK=block,
                num_warps=4)
        perm = torch.empty(m, dtype=torch.int64, device=dev)
        pts = torch.empty_like(points)
        _top_gather_kernel[(grid,)](points, lists, axis, perm, pts, m, top,
                                    BY_PARENT=leaves and top > 0, BLOCK=block, num_warps=4)
    if level0 <= depth:
        scratch = torch.empty(2**level0 * SCRATCH_PER_POINT * sub, dtype=torch.int64,
                              device=dev)
        _subtree_kernel[(2**level0,)](pts, perm, bounds[level0], lo, hi, axis, split, scratch,
                                      m, level0, depth, BLOCK=sub,
                                      LOG_BLOCK=sub.bit_length() - 1,
                                      num_warps=8 if points.is_cuda else 1)
    return perm, pts, lo, hi, axis, split
