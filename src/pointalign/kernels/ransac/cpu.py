"""CPU (numba) kernel of ``feature_knn``: brute-force k nearest rows in feature space, fused.

The reference (:func:`pointalign.kernels.ransac.feature_knn_reference`) writes the whole
``N × M`` distance matrix (``torch.cdist``, row chunks) and then runs ``topk`` over it: at
RANSAC's ~5,000 × 5,000 FPFH rows that is 100 MB of float32 written and read again per call,
and the matrix product behind ``cdist`` has an inner dimension of only 33, so the call is
bound by memory, not by flops (measured 0.3 s of CPU per call on the 2-core machine under
load, ``torch.cdist`` alone 0.2 s). Here every query block walks the reference rows in tiles
that stay in cache, computes the squared distances of a tile with the reference transposed
(``(D, M)``: the inner loop runs along reference rows and vectorises), and keeps its k best
in a small sorted list: the matrix never exists.

Inner loops (bunny FPFH, 4.5k × 4.7k rows of 33 float32, one thread: 80 → 47 ms of CPU,
AVX2, the same answers bit for bit): four dimensions are added per pass over a tile row
with each entry in a register (a loop over d alone loads and stores the tile once per
dimension); the last four are fused with the tests of the finished row (is some entry below
the query's k-th best; the backward minimum per reference row as selects into a second
buffer, since an in-place conditional update compiles to slow masked stores); only rows with
a hit are scanned, in runs of 32 behind a vectorised test. Every loop is sub, mul, add in
order of d: numba compiles without fastmath, so no FMA contraction changes the rounding.

Compile time (issue 23: this kernel was the largest part of a fresh machine's first
``register()``): only the two vectorised loops (:func:`_partial_distances`,
:func:`_last_group`) are inlined at numba's level, where they must be to vectorise as
measured, each from one call site; the rest are ordinary calls that LLVM inlines as it
sees fit, and the parallel loop's body is a function of its own. 12.6 → 6.8 s of compiler
CPU (measured alone), the same speed (one thread, ~40 ms per bunny-sized call, on the
shared machine).

Contract (that of :func:`pointalign.kernels.ransac.feature_knn`, with its rounding stated):
squared distances ``Σ_d (q_d − r_d)²`` summed in the features' dtype in order of d (no
cancellation, unlike ``cdist``'s ``|q|² + |r|² − 2 q·r``); the k smallest per query,
ascending, ties to the smaller reference index. Differences to the reference come from the
rounding of ``cdist`` only: a neighbour differs only where two reference rows are within
that rounding of each other.
"""

from __future__ import annotations

import numpy as np
import torch

from pointalign import _threads
from pointalign.kernels._numba import njit, prange

#: queries per parallel work item (they share each reference tile while it is in cache)
QUERY_BLOCK = 8
#: reference rows per tile (D × TILE floats: 33 KB for FPFH in float32)
TILE = 256
#: largest k this kernel serves (its sorted list is scanned linearly); larger k: reference
MAX_K = 16
#: dimensions added per pass over a tile row (each entry stays in a register for them);
#: fixed: the loops of :func:`_partial_distances` and :func:`_last_group` are written for 4
DIM_GROUP = 4
#: entries per vectorised test when a row of a tile is scanned for its best k
SCAN_RUN = 32


@njit(cache=True, inline="always")
def _partial_distances(q, rt, a, nq, t0, t1, stop, acc):
    """``acc[s, j] = Σ_{d < stop} (q[a + s, d] − rt[d, t0 + j])²`` for the ``nq`` queries.

    The sum is ``((0 + x_0²) + x_1²) + …`` in order of d in the features' dtype, exactly as a
    loop over d adding into ``acc`` gives it: the first ``stop % DIM_GROUP`` dimensions one at
    a time, then ``DIM_GROUP`` at a time with the entry held in a register (one load and one
    store of ``acc`` per group instead of per dimension). Each inner loop runs along the
    tile's reference rows and vectorises (sub, mul, add: no FMA contraction, as numba
    compiles without fastmath).
    """
    w = t1 - t0
    rem = stop % DIM_GROUP
    if rem == 0:
        for s in range(nq):
            for j in range(w):
                acc[s, j] = 0
    for d in range(rem):
        row = rt[d, t0:t1]
        for s in range(nq):
            qd = q[a + s, d]
            if d == 0:  # 0 + x² is x² (x² >= +0): the first dimension stores without a load
                for j in range(w):
                    x = qd - row[j]
                    acc[s, j] = x * x
            else:
                for j in range(w):
                    x = qd - row[j]
                    acc[s, j] += x * x
    for d in range(rem, stop, DIM_GROUP):
        r0 = rt[d, t0:t1]
        r1 = rt[d + 1, t0:t1]
        r2 = rt[d + 2, t0:t1]
        r3 = rt[d + 3, t0:t1]
        for s in range(nq):
            q0 = q[a + s, d]
            q1 = q[a + s, d + 1]
            q2 = q[a + s, d + 2]
            q3 = q[a + s, d + 3]
            for j in range(w):
                x = q0 - r0[j]
                v = acc[s, j] + x * x
                x = q1 - r1[j]
                v = v + x * x
                x = q2 - r2[j]
                v = v + x * x
                x = q3 - r3[j]
                acc[s, j] = v + x * x


@njit(cache=True, inline="always")
def _last_group(q, rt, a, s, d, t0, t1, acc, worst, cin, iin, cout, iout, both):
    """Add dimensions ``d … d + 3`` (the last) into row s of ``acc`` and test the finished row.

    Returns whether some entry is ``< worst`` (the caller's k-th best). With ``both``, also
    the backward nearest query of each reference row: ``cout[j], iout[j]`` become
    ``acc[s, j], a + s`` where ``acc[s, j] < cin[j]``, else ``cin[j], iin[j]`` (queries come
    in increasing order, so ties keep the first). In and out are different buffers so that
    the stores are unconditional (selects; an in-place update compiles to masked stores).
    One vectorised loop: the finished distances are compared while in registers.
    """
    w = t1 - t0
    r0 = rt[d, t0:t1]
    r1 = rt[d + 1, t0:t1]
    r2 = rt[d + 2, t0:t1]
    r3 = rt[d + 3, t0:t1]
    q0 = q[a + s, d]
    q1 = q[a + s, d + 1]
    q2 = q[a + s, d + 2]
    q3 = q[a + s, d + 3]
    hit = False
    if both:
        who = np.int32(a + s)
        for j in range(w):
            x = q0 - r0[j]
            v = acc[s, j] + x * x
            x = q1 - r1[j]
            v = v + x * x
            x = q2 - r2[j]
            v = v + x * x
            x = q3 - r3[j]
            v = v + x * x
            acc[s, j] = v
            hit |= v < worst
            m = cin[j]
            i = iin[j]
            better = v < m
            cout[j] = v if better else m
            iout[j] = who if better else i
    else:
        for j in range(w):
            x = q0 - r0[j]
            v = acc[s, j] + x * x
            x = q1 - r1[j]
            v = v + x * x
            x = q2 - r2[j]
            v = v + x * x
            x = q3 - r3[j]
            v = v + x * x
            acc[s, j] = v
            hit |= v < worst
    return hit


@njit(cache=True)
def _row_test(acc, s, w, worst, cdt, cit, who, both):
    """:func:`_last_group`'s tests of a finished row (for fewer than DIM_GROUP dimensions)."""
    cnt = 0
    for j in range(w):
        v = acc[s, j]
        cnt += v < worst
        if both and v < cdt[j]:
            cdt[j] = v
            cit[j] = who
    return cnt


@njit(cache=True)
def _insert(bd, bi, s, k, dd, idx):
    """Insert ``(dd, idx)`` into row s of the sorted best-k lists; return the k-th distance.

    It goes after every kept entry <= dd (ties: the smaller index first).
    """
    p = k - 1
    while p > 0 and bd[s, p - 1] > dd:
        bd[s, p] = bd[s, p - 1]
        bi[s, p] = bi[s, p - 1]
        p -= 1
    bd[s, p] = dd
    bi[s, p] = idx
    return bd[s, k - 1]


@njit(cache=True)
def _scan_row(acc, s, w, t0, worst, bd, bi, k):
    """Insert row s's entries below the k-th best ``worst`` into its lists, in order of j.

    The row goes in runs of ``SCAN_RUN`` entries; a run is scanned entry by entry only when a
    vectorised count finds one of its entries below the current k-th best.
    """
    for j0 in range(0, w, SCAN_RUN):
        j1 = min(w, j0 + SCAN_RUN)
        hit = False
        for j in range(j0, j1):
            hit |= acc[s, j] < worst
        if hit:
            for j in range(j0, j1):
                dd = acc[s, j]
                if dd < worst:
                    worst = _insert(bd, bi, s, k, dd, t0 + j)


@njit(cache=True)
def _block_tile(q, rt, a, nq, t0, t1, k, acc, bd, bi, cdt, cit, pd, pi, both):
    """One query block against one reference tile: distances, best-k lists, column minima.

    A row's entries are inserted in order of j, and only rows with some entry below their
    k-th best are scanned, so the lists are those of inserting every entry in order. With
    ``both``, ``cdt, cit`` (the tile's slice of the backward minima) are updated through the
    scratch ``pd, pi`` (``(TILE,)``), rows alternating between them.
    """
    w = t1 - t0
    dim = q.shape[1]
    last = dim - DIM_GROUP if dim >= DIM_GROUP else dim  # dimensions summed before the tests
    _partial_distances(q, rt, a, nq, t0, t1, last, acc)
    if dim >= DIM_GROUP:
        for s in range(nq):
            worst = bd[s, k - 1]
            # rows alternate between the two column-minimum buffers (one call site: the
            # loop is compiled once)
            if s % 2 == 0:
                cin, iin, cout, iout = cdt, cit, pd, pi
            else:
                cin, iin, cout, iout = pd, pi, cdt, cit
            if _last_group(q, rt, a, s, last, t0, t1, acc, worst, cin, iin, cout, iout, both):
                _scan_row(acc, s, w, t0, worst, bd, bi, k)
        if both and nq % 2:
            for j in range(w):
                cdt[j] = pd[j]
                cit[j] = pi[j]
    else:
        for s in range(nq):
            worst = bd[s, k - 1]
            if _row_test(acc, s, w, worst, cdt, cit, np.int32(a + s), both):
                _scan_row(acc, s, w, t0, worst, bd, bi, k)


@njit(cache=True, parallel=True)
def _feature_knn(q, rt, k, out_d, out_i):
    n = q.shape[0]
    m = rt.shape[1]
    nblocks = (n + QUERY_BLOCK - 1) // QUERY_BLOCK
    for blk in prange(nblocks):
        a = blk * QUERY_BLOCK
        b = min(n, a + QUERY_BLOCK)
        nq = b - a
        acc = np.empty((QUERY_BLOCK, TILE), q.dtype)
        bd = np.full((QUERY_BLOCK, k), np.inf, q.dtype)
        bi = np.full((QUERY_BLOCK, k), -1, np.int64)
        cdt = np.empty(1, q.dtype)  # unused (no column minima)
        cit = np.empty(1, np.int32)
        for t0 in range(0, m, TILE):
            t1 = min(m, t0 + TILE)
            _block_tile(q, rt, a, nq, t0, t1, k, acc, bd, bi, cdt, cit, cdt, cit, False)
        for s in range(nq):
            for c in range(k):
                out_d[a + s, c] = bd[s, c]
                out_i[a + s, c] = bi[s, c]


@njit(cache=True)
def _both_run(q, rt, k, blk0, blk1, cdc, cic, out_d, out_i):
    """One parallel item of :func:`_feature_knn_both`: query blocks ``blk0 … blk1 - 1``.

    Writes their best-k rows into ``out_d, out_i`` and keeps the run's backward minima in
    ``cdc, cic`` (``(M,)``). A function of its own (not the body of the ``prange`` loop) so
    that numba's parallel passes see a one-line loop: compiling the kernel took twice as
    long with the body inline.
    """
    n = q.shape[0]
    m = rt.shape[1]
    acc = np.empty((QUERY_BLOCK, TILE), q.dtype)
    bd = np.empty((QUERY_BLOCK, k), q.dtype)
    bi = np.empty((QUERY_BLOCK, k), np.int64)
    pd = np.empty(TILE, q.dtype)
    pi = np.empty(TILE, np.int32)
    for blk in range(blk0, blk1):
        a = blk * QUERY_BLOCK
        b = min(n, a + QUERY_BLOCK)
        nq = b - a
        bd[:] = np.inf
        bi[:] = -1
        for t0 in range(0, m, TILE):
            t1 = min(m, t0 + TILE)
            _block_tile(q, rt, a, nq, t0, t1, k, acc, bd, bi, cdc[t0:t1], cic[t0:t1],
                        pd, pi, True)
        for s in range(nq):
            for c2 in range(k):
                out_d[a + s, c2] = bd[s, c2]
                out_i[a + s, c2] = bi[s, c2]


@njit(cache=True, parallel=True)
def _feature_knn_both(q, rt, k, nchunks, out_d, out_i, back_d, back_i):
    """:func:`_feature_knn` plus every reference row's nearest query, from the same tiles.

    Query blocks are split into ``nchunks`` contiguous runs, one parallel item each; a run
    keeps its own best query per reference row (strictly smaller distances replace, and
    queries come in increasing order, so ties keep the smaller index); the runs are merged
    in order with the same rule. The answer is that of a separate call with the roles
    swapped: ``(r_d − q_d)²`` equals ``(q_d − r_d)²`` and the sum runs over d in the same order.
    Query indices are kept as int32 per run (``N < 2³¹``, checked by the caller).
    """
    n = q.shape[0]
    m = rt.shape[1]
    nblocks = (n + QUERY_BLOCK - 1) // QUERY_BLOCK
    per = (nblocks + nchunks - 1) // nchunks
    cd = np.full((nchunks, m), np.inf, q.dtype)
    ci = np.full((nchunks, m), -1, np.int32)
    for c in prange(nchunks):
        _both_run(q, rt, k, c * per, min(nblocks, (c + 1) * per), cd[c], ci[c], out_d, out_i)
    for j in range(m):
        back_d[j] = cd[0, j]
        back_i[j] = ci[0, j]
        for c in range(1, nchunks):
            if cd[c, j] < back_d[j]:
                back_d[j] = cd[c, j]
                back_i[j] = ci[c, j]


def feature_knn_both_cpu(query: torch.Tensor, ref: torch.Tensor, k: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward k nearest and backward nearest in one pass over the ``N × M`` distances.

    Returns ``(dists_sq (N, k), idx (N, k) int64, back_dists_sq (M, 1), back_idx (M, 1)
    int64)``: the first two equal :func:`feature_knn_cpu` ``(query, ref, k)``, the last two
    :func:`feature_knn_cpu` ``(ref, query, 1)`` (``N >= 1``, ``k <= min(M, MAX_K)``).
    """
    threads = _threads.numba_threads()
    q = query.detach().contiguous().numpy()
    rt = np.ascontiguousarray(ref.detach().to(query.dtype).numpy().T)
    n, m = q.shape[0], rt.shape[1]
    if n >= 2**31:
        raise ValueError(f"feature_knn_both_cpu: query has {n} rows, at most 2**31 - 1 are served")
    out_d = np.empty((n, k), q.dtype)
    out_i = np.empty((n, k), np.int64)
    back_d = np.empty((m, 1), q.dtype)
    back_i = np.empty((m, 1), np.int64)
    nblocks = (n + QUERY_BLOCK - 1) // QUERY_BLOCK
    nchunks = max(1, min(nblocks, 4 * threads))
    _feature_knn_both(q, rt, int(k), nchunks, out_d, out_i, back_d[:, 0], back_i[:, 0])
    return (torch.from_numpy(out_d), torch.from_numpy(out_i), torch.from_numpy(back_d),
            torch.from_numpy(back_i))


def feature_knn_cpu(query: torch.Tensor, ref: torch.Tensor,
                    k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the k nearest rows of ``ref (M, D)`` for each row of ``query (N, D)`` (k <= M).

    Returns ``(dists_sq (N, k), idx (N, k) int64)`` (see the module contract); float32 or
    float64 features of one dtype, ``k <= MAX_K``.
    """
    _threads.numba_threads()
    q = query.detach().contiguous().numpy()
    rt = np.ascontiguousarray(ref.detach().to(query.dtype).numpy().T)
    n = q.shape[0]
    out_d = np.empty((n, k), q.dtype)
    out_i = np.empty((n, k), np.int64)
    if n:
        _feature_knn(q, rt, int(k), out_d, out_i)
    return torch.from_numpy(out_d), torch.from_numpy(out_i)


@njit(cache=True, inline="always")
def _popcount(x):
    """Set bits of a uint64 (the SWAR form; LLVM emits one popcnt for it)."""
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return (x * np.uint64(0x0101010101010101)) >> np.uint64(56)


@njit(cache=True, parallel=True)
def _second_order(A, S):
    c = A.shape[0]
    w = (c + 63) // 64
    bits = np.zeros((c, w), np.uint64)
    for i in prange(c):
        for j in range(c):
            if A[i, j] != 0:
                bits[i, j >> 6] |= np.uint64(1) << np.uint64(j & 63)
    _count_pairs(bits, S)


@njit(cache=True, inline="always")
def _length(p, i, j):
    """``|p_i − p_j|`` of float32 ``p``, as ``reference.pair_lengths`` computes it.

    ``(dx² + dy²) + dz²`` rounded step by step in float32, its square root taken in
    float64 and rounded to float32 (the correctly rounded root).
    """
    dx = p[i, 0] - p[j, 0]
    dy = p[i, 1] - p[j, 1]
    dz = p[i, 2] - p[j, 2]
    return np.float32(np.sqrt(np.float64((dx * dx + dy * dy) + dz * dz)))


@njit(cache=True, parallel=True)
def _second_order_points(src, tgt, tau, S):
    """:func:`_second_order` of ``A_ij = ||s_i − s_j| − |t_i − t_j|| < tau`` (i ≠ j).

    The lengths are computed as :func:`_length` computes them; neither they nor A are stored.
    """
    c = src.shape[0]
    w = (c + 63) // 64
    bits = np.zeros((c, w), np.uint64)
    for i in prange(c):
        for j in range(c):
            if j != i and abs(_length(src, i, j) - _length(tgt, i, j)) < tau:
                bits[i, j >> 6] |= np.uint64(1) << np.uint64(j & 63)
    _count_pairs(bits, S)


@njit(cache=True, parallel=True)
def _count_pairs(bits, S):
    """``S_ij`` = popcount(bits_i & bits_j) where bit j of row i is set, else 0."""
    c = S.shape[0]
    w = bits.shape[1]
    for i in prange(c):
        for j in range(c):
            if (bits[i, j >> 6] >> np.uint64(j & 63)) & np.uint64(1):
                n = np.uint64(0)
                for t in range(w):
                    n += _popcount(bits[i, t] & bits[j, t])
                S[i, j] = n
            else:
                S[i, j] = 0


def second_order_cpu(A: torch.Tensor) -> torch.Tensor:
    """Return ``A ⊙ (A A)`` of a 0/1 matrix ``A (C, C)`` float32 by bit sets: ``(C, C)``.

    Entry ``(i, j)`` with ``A_ij ≠ 0`` is the number of k with ``A_ik ≠ 0`` and ``A_jk ≠ 0``
    (the popcount of the two rows' bit sets), else 0: the product's exact value (a float32
    sum of at most C < 2²⁴ ones is exact), so it equals ``A * (A @ A)`` bit for bit, at
    ``C²`` word operations / 64 for the pairs of A instead of the ``C³`` product.
    """
    _threads.numba_threads()
    a = A.detach().contiguous().numpy()
    out = np.empty(a.shape, np.float32)
    _second_order(a, out)
    return torch.from_numpy(out)


def second_order_points_cpu(source: torch.Tensor, target: torch.Tensor,
                            tau: float) -> torch.Tensor:
    """Return ``A ⊙ (A A)`` for ``A_ij = ||s_i − s_j| − |t_i − t_j|| < tau``, i ≠ j: ``(C, C)``.

    ``source, target``: ``(C, 3)`` float32 correspondence ends. The lengths are those of
    :func:`pointalign.kernels.ransac.pair_lengths` (:func:`_length`); ``tau`` is
    rounded to float32 first, as PyTorch does when comparing a float32 tensor with a Python
    float: the answer equals
    :func:`second_order_cpu` of the reference's A bit for bit, with no ``C × C`` matrix
    but the answer.
    """
    _threads.numba_threads()
    s = source.detach().contiguous().numpy()
    t = target.detach().contiguous().numpy()
    out = np.empty((s.shape[0], s.shape[0]), np.float32)
    _second_order_points(s, t, np.float32(tau), out)
    return torch.from_numpy(out)
