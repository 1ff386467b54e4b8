"""CPU nearest-neighbour kernels (backend ``"cpu"``): a k-d tree with tight boxes, in numba.

Why not SciPy's cKDTree alone: ICP's first iterations query points that lie centimetres off
a scanned surface (bun045 against bun000 from the identity). cKDTree prunes by the splitting
planes, whose cells reach far into the empty space around a surface, so such a query visits
hundreds of leaves (measured: 1.0-1.7 s for the 40k queries of that first iteration on the
2-core machine, 50 ms for the same number of on-surface queries). This tree stores the
**tight** bounding box of the points under every node and prunes by the distance to that
box, and each query may start from a candidate (``hint``, the last ICP correspondence), so
once ICP settles a query descends one path and scans one or two leaves.

Candidate lists (:meth:`CpuTree.set_candidates`, kept from a complete self-query such as the
target normals' k = 20): a hinted query within half the 9th-neighbour distance of its hint
is nearer to the hint than to any point outside the hint's 8 nearest, so those 8 decide it
without the tree (point-to-plane ICP on the bunny pair, once converged: ~90 % of the queries,
15 -> 4 ms per iteration on one thread). The self-query itself (:meth:`CpuTree.knn_self`)
runs in tree order, each point starting from its own leaf and walking up.

Keyed lists (float32 points, finite, fewer than 2**32): a kept neighbour is one uint64,
``bits(d²) << 32 | index``. Squared distances are >= +0, and the bits of a non-negative
float32 order as the float does, so the integer order of the keys is the contract's order
(distance, then index): the k-NN list is kept with one integer comparison per step, in a
small local buffer written to the output row once at the end. The plain lists
(``_scan_k``, one (distance, index) pair of comparisons per step) answer float64 points and
are the reference of the keyed ones (same answers bit for bit; tests compare them).
Box distances are computed without branches (:func:`_boxd2`).

Layout: a balanced implicit tree (node ``v`` has children ``2v+1`` and ``2v+2``) built by
median splits along the widest side of each node's box (quickselect), ``depth`` levels,
leaves of at most ``leaf_size`` points stored contiguously (``spts``, with ``perm`` the
original index of each stored point and ``inv`` its inverse), in one parallel region (the
top levels serially, then one subtree per work item).

A self-query starts each point's list from its own leaf by rank (:func:`_rank_keys`: the
leaf's keys counted against each other, no insertion shifts), then walks up as before:
-15 % CPU for k = 20 on the KITTI and bunny clouds, the same answers.

Contract (the answers of the brute-force :func:`pointalign.kernels.knn.knn_reference`):
squared distances are computed in the points' dtype as ``(q-p)_x² + (q-p)_y² + (q-p)_z²``;
results are ordered by (squared distance, original index); a point is within ``max_d2`` when
its squared distance is ``<= max_d2`` (``max_d2`` rounded to the points' dtype); missing
neighbours are ``inf`` / ``-1``. Pruning is exact: a box is skipped only when its
(rounded) distance is strictly larger than the current k-th distance, or equal to it while
every point under it has a larger original index than the k-th neighbour held (``nmin``,
the smallest original index under each node), and rounding is monotone, so no point that
could win (ties by index included) is skipped.

Ties and copies: real scans repeat points (a LiDAR driver writes each missing return as
the origin: 5,000 of the 70,000 points of the fast_gicp pair). Every copy is at the same
distance from a query, so pruning by distance alone visits all of them for every query
that reaches them (the fast_gicp pair's GICP: 79 against 21 ms per iteration on KITTI's
larger scans, 2 threads). With ``nmin`` a node of copies is skipped once the k-th
neighbour held has a smaller index, and equally near children are visited smaller
``nmin`` first, so the copies with the smallest indices are found first.
"""

from __future__ import annotations

import math

import numpy as np

from pointalign import _threads
from pointalign.kernels._numba import available, njit, prange

#: queries per parallel work item (one stack and one candidate list each)
QUERY_BLOCK = 256


@njit(cache=True, nogil=True)
def _select(perm, pts, lo, hi, kth, axis):
    """Reorder ``perm[lo:hi]`` so that ``perm[kth]`` has rank ``kth - lo`` by ``axis``."""
    while hi - lo > 1:
        mid = (lo + hi - 1) // 2
        # median of three as the pivot
        a, b, c = pts[perm[lo], axis], pts[perm[mid], axis], pts[perm[hi - 1], axis]
        if (a <= b <= c) or (c <= b <= a):
            pv = b
        elif (b <= a <= c) or (c <= a <= b):
            pv = a
        else:
            pv = c
        i, j = lo, hi - 1
        while i <= j:
            while pts[perm[i], axis] < pv:
                i += 1
            while pts[perm[j], axis] > pv:
                j -= 1
            if i <= j:
                t = perm[i]
                perm[i] = perm[j]
                perm[j] = t
                i += 1
                j -= 1
        if kth <= j:
            hi = j + 1
        elif kth >= i:
            lo = i
        else:
            return


@njit(cache=True, nogil=True)
def _box(pts, perm, lo, hi, bmin, bmax, v):
    for d in range(3):
        bmin[v, d] = pts[perm[lo], d]
        bmax[v, d] = pts[perm[lo], d]
    for i in range(lo + 1, hi):
        p = perm[i]
        for d in range(3):
            x = pts[p, d]
            if x < bmin[v, d]:
                bmin[v, d] = x
            if x > bmax[v, d]:
                bmax[v, d] = x


@njit(cache=True, inline="always")
def _split_node(pts, perm, lo, hi, bmin, bmax, v, split):
    """Node v's box; with ``split``, its median split along the box's widest side."""
    a, b = lo[v], hi[v]
    if b > a:
        _box(pts, perm, a, b, bmin, bmax, v)
    else:  # empty node (only when n < 2**depth): a box no query reaches
        for d in range(3):
            bmin[v, d] = np.inf
            bmax[v, d] = -np.inf
    if split:
        m = (a + b) // 2
        if b - a > 1:
            ax = 0
            w = bmax[v, 0] - bmin[v, 0]
            for d in range(1, 3):
                if bmax[v, d] - bmin[v, d] > w:
                    w = bmax[v, d] - bmin[v, d]
                    ax = d
            # int64, not the literal 0 typing may see first: one signature
            _select(perm, pts, a, b, m, np.int64(ax))
        lo[2 * v + 1], hi[2 * v + 1] = a, m
        lo[2 * v + 2], hi[2 * v + 2] = m, b


@njit(cache=True, parallel=True)
def _build(pts, depth, top):
    """Build the tree in one parallel region: levels ``< top`` serially, then the subtrees.

    Each node is split as it always was (the same boxes, medians and ``perm``: the tree
    does not depend on ``top`` or the threads); the ``2**top`` subtrees under level
    ``top`` are built level by level inside one ``prange`` item each, which also copies
    their points to ``spts``, fills ``inv`` (``inv[perm[s]] = s``) and ``nmin`` (the
    smallest original index under each node; ``2**62`` for an empty one) of its nodes;
    the levels above take the smaller of their children's. One parallel region instead of
    one per level: on a busy machine each region waits for its slowest thread.
    """
    n = pts.shape[0]
    nnodes = (1 << (depth + 1)) - 1
    perm = np.arange(n).astype(np.int64)
    lo = np.zeros(nnodes, np.int64)
    hi = np.zeros(nnodes, np.int64)
    bmin = np.empty((nnodes, 3), pts.dtype)
    bmax = np.empty((nnodes, 3), pts.dtype)
    spts = np.empty((n, 3), pts.dtype)
    inv = np.empty(n, np.int64)
    nmin = np.full(nnodes, np.int64(1) << 62, np.int64)
    hi[0] = n
    top = min(top, depth)
    for level in range(top):
        for v in range((1 << level) - 1, (1 << (level + 1)) - 1):
            _split_node(pts, perm, lo, hi, bmin, bmax, v, True)
    for t in prange(1 << top):
        for level in range(top, depth + 1):
            width = 1 << (level - top)
            first = (1 << level) - 1 + t * width
            for v in range(first, first + width):
                _split_node(pts, perm, lo, hi, bmin, bmax, v, level < depth)
        root = (1 << top) - 1 + t
        for i in range(lo[root], hi[root]):
            p = perm[i]
            inv[p] = i
            for d in range(3):
                spts[i, d] = pts[p, d]
        for level in range(depth, top - 1, -1):  # the subtree's nodes, leaves first
            width = 1 << (level - top)
            first = (1 << level) - 1 + t * width
            for v in range(first, first + width):
                if level == depth:
                    for i in range(lo[v], hi[v]):
                        nmin[v] = min(nmin[v], perm[i])
                else:
                    nmin[v] = min(nmin[2 * v + 1], nmin[2 * v + 2])
    for v in range((1 << top) - 2, -1, -1):
        nmin[v] = min(nmin[2 * v + 1], nmin[2 * v + 2])
    return perm, spts, lo, hi, bmin, bmax, inv, nmin


@njit(cache=True, inline="always")
def _boxd2(q0, q1, q2, bmin, bmax, v):
    """Squared distance from the query to node v's box, without branches.

    Per axis the gap is ``max(bmin - q, q - bmax, 0)`` (at most one of the two is
    positive), and the squares are added in axis order to a zero of the points' dtype: a
    zero gap adds +0, which changes no sum, so the value equals, bit for bit, the branchy
    form that adds only the positive gaps.
    """
    z = q0 - q0  # zero of the points' dtype
    g0 = max(bmin[v, 0] - q0, q0 - bmax[v, 0], z)
    g1 = max(bmin[v, 1] - q1, q1 - bmax[v, 1], z)
    g2 = max(bmin[v, 2] - q2, q2 - bmax[v, 2], z)
    return z + g0 * g0 + g1 * g1 + g2 * g2


@njit(cache=True, inline="always")
def _push_children(q0, q1, q2, bmin, bmax, nmin, v, bound, stack, sd, top):
    """Push node v's children whose boxes lie within ``bound`` (squared) of the query.

    The nearer child goes last, so it is visited first (of two equally near, the one with
    the smaller ``nmin``); ``sd`` keeps each entry's box distance. Returns the new stack top.
    """
    c1 = 2 * v + 1
    c2 = c1 + 1
    da = _boxd2(q0, q1, q2, bmin, bmax, c1)
    db = _boxd2(q0, q1, q2, bmin, bmax, c2)
    if da > db or (da == db and nmin[c1] > nmin[c2]):
        c1, c2 = c2, c1
        da, db = db, da
    if db <= bound:
        stack[top] = c2
        sd[top] = db
        top += 1
    if da <= bound:
        stack[top] = c1
        sd[top] = da
        top += 1
    return top


@njit(cache=True, inline="always")
def _nearest_one(q0, q1, q2, h, pts, perm, spts, lo, hi, bmin, bmax, nmin, first_leaf, max_d2,
                 cand, cand_r2, stack, sd):
    """Find the nearest point to ``q`` within ``max_d2``, from ``h`` (original index, -1).

    Returns ``(d2, original index)``, the index -1 when none is within the bound (see
    :func:`_nearest` for the candidate list and the tree walk). Inlined into its callers
    (:func:`_nearest`, GICP's fused CPU step), so each compiles as one loop.
    """
    best = max_d2
    bi = -1
    if h >= 0:
        e0, e1, e2 = q0 - pts[h, 0], q1 - pts[h, 1], q2 - pts[h, 2]
        dh = e0 * e0 + e1 * e1 + e2 * e2
        if h < cand.shape[0] and dh < cand_r2[h]:
            # every point off the list is farther than the hint: the list decides
            cb, ci = dh, h
            for s in range(cand.shape[1]):
                j = cand[h, s]
                e0, e1, e2 = q0 - spts[j, 0], q1 - spts[j, 1], q2 - spts[j, 2]
                dd = e0 * e0 + e1 * e1 + e2 * e2
                if dd < cb or (dd == cb and perm[j] < ci):
                    cb = dd
                    ci = perm[j]
            if cb <= max_d2:
                return cb, ci
            return max_d2, -1
        if dh <= best:
            best = dh
            bi = h
    top = 0
    d0 = _boxd2(q0, q1, q2, bmin, bmax, 0)
    if d0 <= best:
        stack[0] = 0
        sd[0] = d0
        top = 1
    while top > 0:
        top -= 1
        v = stack[top]
        if sd[top] > best or (sd[top] == best and bi >= 0 and nmin[v] > bi):
            continue
        if v >= first_leaf:
            for j in range(lo[v], hi[v]):
                e0, e1, e2 = q0 - spts[j, 0], q1 - spts[j, 1], q2 - spts[j, 2]
                dd = e0 * e0 + e1 * e1 + e2 * e2
                if dd < best or (dd == best and (bi < 0 or perm[j] < bi)):
                    best = dd
                    bi = perm[j]
            continue
        top = _push_children(q0, q1, q2, bmin, bmax, nmin, v, best, stack, sd, top)
    return best, bi


@njit(cache=True, parallel=True)
def _nearest(pts, perm, spts, lo, hi, bmin, bmax, nmin, depth, q, hint, max_d2, cand,
             cand_r2, out_d, out_i):
    """Search k = 1 with an optional candidate per query (``hint`` original index, -1).

    ``cand (M, K)`` / ``cand_r2 (M,)`` (``M = 0``: none, see :meth:`CpuTree.set_candidates`):
    a hinted query with squared distance to its hint below ``cand_r2[hint]`` takes the
    nearest of the hint's candidate list (stored positions) and skips the tree. A query
    without a hint takes the answer of the query before it in its block as one (queries
    in a spatial order, as ICP's, find their neighbour's answer near): the answer never
    depends on the hint, and blocks do not share them, so nor on the threads.
    """
    nq = q.shape[0]
    first_leaf = (1 << depth) - 1
    nblocks = (nq + QUERY_BLOCK - 1) // QUERY_BLOCK
    for blk in prange(nblocks):
        stack = np.empty(2 * depth + 4, np.int64)
        sd = np.empty(2 * depth + 4, pts.dtype)
        start = blk * QUERY_BLOCK
        for qi in range(start, min(nq, start + QUERY_BLOCK)):
            h = hint[qi]
            if h < 0 and qi > start:
                h = out_i[qi - 1]
            best, bi = _nearest_one(q[qi, 0], q[qi, 1], q[qi, 2], h, pts, perm, spts, lo, hi,
                                    bmin, bmax, nmin, first_leaf, max_d2, cand, cand_r2,
                                    stack, sd)
            out_i[qi] = bi
            out_d[qi] = best if bi >= 0 else np.inf


@njit(cache=True, inline="always")
def _scan_k(q0, q1, q2, perm, spts, a, b, k, bd, bx, cnt, bound):
    """Insert the stored points ``a:b`` into the ordered list ``bd, bx`` (k-NN, see _knn)."""
    for j in range(a, b):
        e0, e1, e2 = q0 - spts[j, 0], q1 - spts[j, 1], q2 - spts[j, 2]
        dd = e0 * e0 + e1 * e1 + e2 * e2
        if dd > bound:
            continue
        p = perm[j]
        if cnt == k and (dd > bd[k - 1] or (dd == bd[k - 1] and p > bx[k - 1])):
            continue
        # insertion into the ordered list (distance, index)
        s = cnt if cnt < k else k - 1
        while s > 0 and (bd[s - 1] > dd or (bd[s - 1] == dd and bx[s - 1] > p)):
            bd[s] = bd[s - 1]
            bx[s] = bx[s - 1]
            s -= 1
        bd[s] = dd
        bx[s] = p
        if cnt < k:
            cnt += 1
        if cnt == k:
            bound = bd[k - 1]
    return cnt, bound


@njit(cache=True, inline="always")
def _subtree_k(root, droot, q0, q1, q2, perm, spts, lo, hi, bmin, bmax, nmin, first_leaf,
               stack, sd, k, bd, bx, cnt, bound):
    """Nearest-first k-NN search of the subtree under ``root`` (box distance ``droot``)."""
    stack[0] = root
    sd[0] = droot
    top = 1
    while top > 0:
        top -= 1
        v = stack[top]
        # past the bound, or at it with every index under v after the full list's last
        if sd[top] > bound or (sd[top] == bound and cnt == k and nmin[v] > bx[k - 1]):
            continue
        if v >= first_leaf:
            cnt, bound = _scan_k(q0, q1, q2, perm, spts, lo[v], hi[v], k, bd, bx, cnt, bound)
            continue
        top = _push_children(q0, q1, q2, bmin, bmax, nmin, v, bound, stack, sd, top)
    return cnt, bound


@njit(cache=True, parallel=True)
def _knn(perm, spts, lo, hi, bmin, bmax, nmin, depth, q, k, max_d2, out_d, out_i):
    """Find the k nearest within ``max_d2`` (ordered by distance, then index)."""
    nq = q.shape[0]
    first_leaf = (1 << depth) - 1
    nblocks = (nq + QUERY_BLOCK - 1) // QUERY_BLOCK
    for blk in prange(nblocks):
        stack = np.empty(2 * depth + 4, np.int64)
        sd = np.empty(2 * depth + 4, spts.dtype)
        for qi in range(blk * QUERY_BLOCK, min(nq, (blk + 1) * QUERY_BLOCK)):
            q0, q1, q2 = q[qi, 0], q[qi, 1], q[qi, 2]
            bd = out_d[qi]
            bx = out_i[qi]
            for s in range(k):
                bd[s] = np.inf
                bx[s] = -1
            # bound: the k-th distance once k are held, else max_d2
            _subtree_k(0, _boxd2(q0, q1, q2, bmin, bmax, 0), q0, q1, q2, perm, spts, lo, hi,
                       bmin, bmax, nmin, first_leaf, stack, sd, k, bd, bx, 0, max_d2)


@njit(cache=True, parallel=True)
def _knn_self(perm, spts, lo, hi, bmin, bmax, nmin, depth, k, max_d2, out_d, out_i):
    """:func:`_knn` of every stored point (row ``perm[j]`` for ``spts[j]``), bottom-up.

    Queries go in tree order, each starting at its own leaf and walking up: the leaf, then
    for every node on the way to the root its sibling's subtree when that box is within the
    current bound (every point once, the nearest subtrees first; no descent from the root).
    """
    first_leaf = (1 << depth) - 1
    nleaves = 1 << depth
    for t in prange(nleaves):
        stack = np.empty(2 * depth + 4, np.int64)
        sd = np.empty(2 * depth + 4, spts.dtype)
        leaf = first_leaf + t
        for j0 in range(lo[leaf], hi[leaf]):
            q0, q1, q2 = spts[j0, 0], spts[j0, 1], spts[j0, 2]
            bd = out_d[perm[j0]]
            bx = out_i[perm[j0]]
            for s in range(k):
                bd[s] = np.inf
                bx[s] = -1
            cnt, bound = _scan_k(q0, q1, q2, perm, spts, lo[leaf], hi[leaf], k, bd, bx, 0,
                                 max_d2)
            v = leaf
            while v > 0:
                sib = v + 1 if v & 1 else v - 1
                ds = _boxd2(q0, q1, q2, bmin, bmax, sib)
                if ds < bound or (ds == bound and not (cnt == k and nmin[sib] > bx[k - 1])):
                    cnt, bound = _subtree_k(sib, ds, q0, q1, q2, perm, spts, lo, hi, bmin,
                                            bmax, nmin, first_leaf, stack, sd, k, bd, bx, cnt,
                                            bound)
                v = (v - 1) >> 1


_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


@njit(cache=True, inline="always")
def _scan_key(q0, q1, q2, perm, spts, a, b, k, kb, cnt, bound, f, u):
    """:func:`_scan_k` on keyed lists (float32 points; module docstring).

    ``kb (k,)`` uint64 keys in increasing order (``cnt`` held); ``f (2,)`` float32 with
    ``u`` its uint32 view: the bit casts. Returns ``(cnt, bound)`` as :func:`_scan_k`.
    """
    for j in range(a, b):
        e0, e1, e2 = q0 - spts[j, 0], q1 - spts[j, 1], q2 - spts[j, 2]
        dd = e0 * e0 + e1 * e1 + e2 * e2
        if dd > bound:
            continue
        f[0] = dd
        key = (np.uint64(u[0]) << _SHIFT) | np.uint64(perm[j])
        if cnt == k:
            if key > kb[k - 1]:
                continue
            s = k - 1
        else:
            s = cnt
            cnt += 1
        while s > 0 and kb[s - 1] > key:
            kb[s] = kb[s - 1]
            s -= 1
        kb[s] = key
        if cnt == k:
            u[1] = np.uint32(kb[k - 1] >> _SHIFT)
            bound = f[1]
    return cnt, bound


@njit(cache=True, inline="always")
def _subtree_key(root, droot, q0, q1, q2, perm, spts, lo, hi, bmin, bmax, nmin, first_leaf,
                 stack, sd, k, kb, cnt, bound, f, u):
    """:func:`_subtree_k` on keyed lists (the same visits)."""
    stack[0] = root
    sd[0] = droot
    top = 1
    while top > 0:
        top -= 1
        v = stack[top]
        if sd[top] > bound or (sd[top] == bound and cnt == k
                               and nmin[v] > np.int64(kb[k - 1] & _LOW32)):
            continue
        if v >= first_leaf:
            cnt, bound = _scan_key(q0, q1, q2, perm, spts, lo[v], hi[v], k, kb, cnt, bound,
                                   f, u)
            continue
        top = _push_children(q0, q1, q2, bmin, bmax, nmin, v, bound, stack, sd, top)
    return cnt, bound


@njit(cache=True, inline="always")
def _emit_keys(kb, cnt, k, out_d, out_i, row, f, u):
    """Write the keyed list ``kb[:cnt]`` to ``out_d[row], out_i[row]`` (``inf`` / -1 after)."""
    for s in range(cnt):
        u[0] = np.uint32(kb[s] >> _SHIFT)
        out_d[row, s] = f[0]
        out_i[row, s] = np.int64(kb[s] & _LOW32)
    for s in range(cnt, k):
        out_d[row, s] = np.inf
        out_i[row, s] = -1


_NOKEY = np.uint64(0xFFFFFFFFFFFFFFFF)


@njit(cache=True, inline="always")
def _rank_keys(q0, q1, q2, perm, spts, a, b, k, kb, lk, max_d2, f, u):
    """Start the keyed list ``kb`` from the stored points ``a:b`` at once, by rank.

    The keys of the points within ``max_d2`` go to ``lk`` (the others get the largest
    key); a key's rank is the number of keys below it (keys are distinct: the index is in
    them), and the ``k`` lowest go straight to their places. The list and the bound equal
    :func:`_scan_key`'s over the same points from an empty list (the ``k`` lowest keys, in
    order), without its insertion shifts and their mispredicted branches: one scan of the
    query's own leaf of the self-query, whose points all enter an empty list. Returns
    ``(cnt, bound)`` as :func:`_scan_key`.
    """
    m = b - a
    for j in range(a, b):
        e0, e1, e2 = q0 - spts[j, 0], q1 - spts[j, 1], q2 - spts[j, 2]
        dd = e0 * e0 + e1 * e1 + e2 * e2
        f[0] = dd
        key = (np.uint64(u[0]) << _SHIFT) | np.uint64(perm[j])
        lk[j - a] = key if dd <= max_d2 else _NOKEY
    cnt = 0
    for i in range(m):
        key = lk[i]
        if key == _NOKEY:
            continue
        cnt += 1
        r = 0
        for j in range(m):
            r += np.int64(lk[j] < key)
        if r < k:
            kb[r] = key
    bound = max_d2
    if cnt >= k:
        cnt = k
        u[1] = np.uint32(kb[k - 1] >> _SHIFT)
        bound = f[1]
    return cnt, bound


@njit(cache=True, inline="always")
def _self_key(j0, leaf, perm, spts, lo, hi, bmin, bmax, nmin, first_leaf, stack, sd, k, kb,
              lk, max_d2, f, u):
    """Put the k nearest of the tree's own point ``j0`` (held by ``leaf``) into the keys ``kb``.

    Its leaf first (:func:`_rank_keys`; ``lk`` holds at least the leaf's size), then, on the
    way up, each sibling subtree the current bound does not rule out (the self-query's
    order). Returns how many keys were kept. Inlined into its callers
    (:func:`_knn_self_keyed`, the fused GICP covariances), so both compile as one loop.
    """
    q0, q1, q2 = spts[j0, 0], spts[j0, 1], spts[j0, 2]
    cnt, bound = _rank_keys(q0, q1, q2, perm, spts, lo[leaf], hi[leaf], k, kb, lk, max_d2,
                            f, u)
    v = leaf
    while v > 0:
        sib = v + 1 if v & 1 else v - 1
        ds = _boxd2(q0, q1, q2, bmin, bmax, sib)
        if ds < bound or (ds == bound and not (cnt == k
                                               and nmin[sib] > np.int64(kb[k - 1] & _LOW32))):
            cnt, bound = _subtree_key(sib, ds, q0, q1, q2, perm, spts, lo, hi, bmin, bmax,
                                      nmin, first_leaf, stack, sd, k, kb, cnt, bound, f, u)
        v = (v - 1) >> 1
    return cnt


@njit(cache=True, parallel=True)
def _knn_keyed(perm, spts, lo, hi, bmin, bmax, nmin, depth, q, k, max_d2, out_d, out_i):
    """:func:`_knn` with keyed lists (float32, finite, < 2**32 points): the same answers."""
    nq = q.shape[0]
    first_leaf = (1 << depth) - 1
    nblocks = (nq + QUERY_BLOCK - 1) // QUERY_BLOCK
    for blk in prange(nblocks):
        stack = np.empty(2 * depth + 4, np.int64)
        sd = np.empty(2 * depth + 4, spts.dtype)
        kb = np.empty(k, np.uint64)
        f = np.empty(2, np.float32)
        u = f.view(np.uint32)
        for qi in range(blk * QUERY_BLOCK, min(nq, (blk + 1) * QUERY_BLOCK)):
            q0, q1, q2 = q[qi, 0], q[qi, 1], q[qi, 2]
            cnt, _ = _subtree_key(0, _boxd2(q0, q1, q2, bmin, bmax, 0), q0, q1, q2, perm,
                                  spts, lo, hi, bmin, bmax, nmin, first_leaf, stack, sd, k,
                                  kb, 0, max_d2, f, u)
            _emit_keys(kb, cnt, k, out_d, out_i, qi, f, u)


@njit(cache=True, parallel=True)
def _knn_self_keyed(perm, spts, lo, hi, bmin, bmax, nmin, depth, k, max_d2, out_d, out_i):
    """:func:`_knn_self` with keyed lists (float32, finite, < 2**32 points): same answers."""
    first_leaf = (1 << depth) - 1
    nleaves = 1 << depth
    for t in prange(nleaves):
        stack = np.empty(2 * depth + 4, np.int64)
        sd = np.empty(2 * depth + 4, spts.dtype)
        kb = np.empty(k, np.uint64)
        f = np.empty(2, np.float32)
        u = f.view(np.uint32)
        leaf = first_leaf + t
        lk = np.empty(hi[leaf] - lo[leaf], np.uint64)
        for j0 in range(lo[leaf], hi[leaf]):
            cnt = _self_key(j0, leaf, perm, spts, lo, hi, bmin, bmax, nmin, first_leaf, stack,
                            sd, k, kb, lk, max_d2, f, u)
            _emit_keys(kb, cnt, k, out_d, out_i, perm[j0], f, u)


def _top_levels(threads: int) -> int:
    """Levels :func:`_build` splits serially: ``2**top >= 2 * threads`` subtrees after them."""
    return 0 if threads <= 1 else (2 * threads - 1).bit_length()


#: use the keyed lists where they apply (tests set False to run the plain reference lists)
KEYED = True


@njit(cache=True, parallel=True)
def _candidate_lists(inv, d2, idx, k, cand, cand_r2):
    """:meth:`CpuTree.set_candidates`' lists (stored positions) and bounds, row by row.

    ``r2_h = 0.25 (1 − 1e-4) δ²`` in float64, rounded to the points' dtype and stepped
    down once where that rounding went up; 0 for a short row (no (k+1)-th entry), whose
    missing entries point at the row's own point (never read).
    """
    m = inv.shape[0]
    zero = cand_r2.dtype.type(0)
    for h in prange(m):
        if idx[h, k] < 0:
            cand_r2[h] = zero
        else:
            r2 = (0.25 * (1 - 1e-4)) * np.float64(d2[h, k])
            r2c = cand_r2.dtype.type(r2)
            if np.float64(r2c) > r2:
                r2c = np.nextafter(r2c, zero)
            cand_r2[h] = r2c
        own = inv[np.int64(h)]
        for s in range(k):
            j = idx[h, s]
            cand[h, s] = inv[j] if j >= 0 else own


class CpuTree:
    """The k-d tree over ``points (M, 3)`` (NumPy float32 or float64, C-contiguous).

    Args:
        points: ``(M, 3)`` float32/float64 array (kept by reference; not modified).
        leaf_size: target points per leaf (the depth is the smallest with leaves this small).

    """

    def __init__(self, points: np.ndarray, leaf_size: int = 16):
        if not available():
            raise RuntimeError("the CPU k-d tree needs numba (pip install numba)")
        pts = np.ascontiguousarray(points)
        if pts.ndim != 2 or pts.shape[1] != 3 or pts.dtype not in (np.float32, np.float64):
            raise ValueError(f"points: expected (M, 3) float32/float64, got {pts.shape} "
                             f"{pts.dtype}")
        if pts.shape[0] == 0:
            raise ValueError("points: the tree needs at least one point")
        if int(leaf_size) < 1:
            raise ValueError(f"leaf_size: must be >= 1, got {leaf_size}")
        m = pts.shape[0]
        self.depth = max(0, math.ceil(math.log2(max(1.0, m / int(leaf_size)))))
        self.points = pts
        (self.perm, self.spts, self.lo, self.hi, self.bmin, self.bmax, self.inv,
         self.nmin) = _build(pts, self.depth, _top_levels(_threads.numba_threads()))
        self._keyable = bool(pts.dtype == np.float32 and m < 2**32 and np.isfinite(pts).all())

    def set_candidates(self, d2: np.ndarray, idx: np.ndarray, k: int = 8,
                       bounded: bool = False) -> bool:
        """Keep each point's ``k`` nearest as a shortcut for hinted :meth:`nearest` calls.

        ``d2, idx``: a self-query table of these points, ``(M, K)`` with ``K > k`` columns
        (each row's K nearest points, ordered by squared distance: :meth:`knn` or
        :meth:`knn_self` of ``self.points`` itself; ``bounded``: within a distance bound,
        missing entries ``-1``, else complete). Row ``h`` keeps its first ``k`` entries,
        ``S_h``, and ``r2_h``: a quarter of the (k+1)-th squared distance ``δ²``, less a
        margin of 1e-4 relative for rounding. A query ``q`` hinted with ``h`` and
        ``|q − p_h|² < r2_h`` (``|q − p_h| < δ/2``) is nearer to ``p_h`` than to any point
        off ``S_h`` (those are ``>= δ`` from ``p_h``, so ``> δ/2`` from ``q``, with room for
        the rounding of both squared distances), so its nearest point (ties: smallest index)
        is the nearest of ``S_h``: the answer equals the full search. A row of a bounded
        table with fewer than k + 1 entries gets ``r2_h = 0`` (its hinted queries take the
        tree). Returns True when kept (False, nothing changed, when the table does not fit
        these points, or a complete one has missing entries).
        """
        m = self.points.shape[0]
        if (d2.shape != idx.shape or d2.ndim != 2 or d2.shape[0] != m
                or not 1 <= int(k) < d2.shape[1]):
            return False
        k = int(k)
        short = idx[:, k] < 0  # fewer than k + 1 points within the bound
        if short.any() and not bounded:
            return False
        pos_t = np.int32 if m < 2**31 else np.int64  # stored positions: 4 bytes each
        self._cand = np.empty((m, k), pos_t)
        self._cand_r2 = np.empty(m, self.points.dtype)
        _threads.numba_threads()
        _candidate_lists(self.inv, np.ascontiguousarray(d2), np.ascontiguousarray(idx), k,
                         self._cand, self._cand_r2)
        return True

    def candidates(self) -> tuple[np.ndarray, np.ndarray]:
        """Return the candidate lists ``(cand (M, K), cand_r2 (M,))``; ``M = 0``: none set."""
        c = getattr(self, "_cand", None)
        if c is None:
            return np.zeros((0, 1), np.int32), np.zeros(0, self.points.dtype)
        return c, self._cand_r2

    def bound(self, max_d2: float | None) -> np.floating:
        """Return the squared bound ``max_d2`` in the points' dtype (None: infinity)."""
        dt = self.points.dtype.type
        return dt(np.inf) if max_d2 is None else dt(max_d2)

    def nearest(self, query: np.ndarray, max_d2: float | None = None,
                hint: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Nearest point of each query within ``max_d2`` (squared): ``(d2 (N,), idx (N,))``.

        ``hint``: optional ``(N,)`` int64 candidate per query (original index, -1 = none);
        the answer does not depend on it, only the time.
        """
        _threads.numba_threads()
        q = np.ascontiguousarray(query, dtype=self.points.dtype)
        n = q.shape[0]
        if hint is None:
            hint = np.full(n, -1, np.int64)
        out_d = np.empty(n, self.points.dtype)
        out_i = np.empty(n, np.int64)
        _nearest(self.points, self.perm, self.spts, self.lo, self.hi, self.bmin, self.bmax,
                 self.nmin, self.depth, q, np.ascontiguousarray(hint, dtype=np.int64),
                 self.bound(max_d2), *self.candidates(), out_d, out_i)
        return out_d, out_i

    def knn(self, query: np.ndarray, k: int,
            max_d2: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``k`` nearest points within ``max_d2``: ``(d2 (N, k), idx (N, k))``."""
        _threads.numba_threads()
        q = np.ascontiguousarray(query, dtype=self.points.dtype)
        n = q.shape[0]
        out_d = np.empty((n, k), self.points.dtype)
        out_i = np.empty((n, k), np.int64)
        keyed = KEYED and getattr(self, "_keyable", False) and bool(np.isfinite(q).all())
        (_knn_keyed if keyed else _knn)(self.perm, self.spts, self.lo, self.hi, self.bmin,
                                        self.bmax, self.nmin, self.depth, q, int(k),
                                        self.bound(max_d2), out_d, out_i)
        return out_d, out_i

    def knn_self(self, k: int,
                 max_d2: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`knn` with the tree's own points as the queries (row i: ``points[i]``).

        The same answers, found bottom-up from each point's leaf in tree order.
        """
        _threads.numba_threads()
        n = self.points.shape[0]
        out_d = np.empty((n, k), self.points.dtype)
        out_i = np.empty((n, k), np.int64)
        kern = _knn_self_keyed if KEYED and getattr(self, "_keyable", False) else _knn_self
        kern(self.perm, self.spts, self.lo, self.hi, self.bmin, self.bmax, self.nmin,
             self.depth, int(k), self.bound(max_d2), out_d, out_i)
        return out_d, out_i
