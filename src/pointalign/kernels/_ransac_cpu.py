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
from pointalign.kernels._knn_cpu import njit, prange

#: queries per parallel work item (they share each reference tile while it is in cache)
QUERY_BLOCK = 8
#: reference rows per tile (D × TILE floats: 33 KB for FPFH in float32)
TILE = 256
#: largest k this kernel serves (its sorted list is scanned linearly); larger k: reference
MAX_K = 16


@njit(cache=True, inline="always")
def _tile_distances(q, rt, a, nq, t0, t1, acc):
    """``acc[s, j] = ‖q[a + s] − rt[:, t0 + j]‖²`` for the ``nq`` queries and the tile."""
    w = t1 - t0
    for s in range(nq):
        for j in range(w):
            acc[s, j] = 0
    for d in range(q.shape[1]):
        row = rt[d, t0:t1]
        for s in range(nq):
            qd = q[a + s, d]
            for j in range(w):
                x = qd - row[j]
                acc[s, j] += x * x


@njit(cache=True, inline="always")
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
        for t0 in range(0, m, TILE):
            t1 = min(m, t0 + TILE)
            w = t1 - t0
            _tile_distances(q, rt, a, nq, t0, t1, acc)
            for s in range(nq):
                worst = bd[s, k - 1]
                for j in range(w):
                    dd = acc[s, j]
                    if dd < worst:
                        worst = _insert(bd, bi, s, k, dd, t0 + j)
        for s in range(nq):
            for c in range(k):
                out_d[a + s, c] = bd[s, c]
                out_i[a + s, c] = bi[s, c]


@njit(cache=True, parallel=True)
def _feature_knn_both(q, rt, k, nchunks, out_d, out_i, back_d, back_i):
    """:func:`_feature_knn` plus every reference row's nearest query, from the same tiles.

    Query blocks are split into ``nchunks`` contiguous runs, one parallel item each; a run
    keeps its own best query per reference row (strictly smaller distances replace, and
    queries come in increasing order, so ties keep the smaller index); the runs are merged
    in order with the same rule. The answer is that of a separate call with the roles
    swapped: ``(r_d − q_d)²`` equals ``(q_d − r_d)²`` and the sum runs over d in the same order.
    """
    n = q.shape[0]
    m = rt.shape[1]
    nblocks = (n + QUERY_BLOCK - 1) // QUERY_BLOCK
    per = (nblocks + nchunks - 1) // nchunks
    cd = np.full((nchunks, m), np.inf, q.dtype)
    ci = np.full((nchunks, m), -1, np.int64)
    for c in prange(nchunks):
        acc = np.empty((QUERY_BLOCK, TILE), q.dtype)
        bd = np.empty((QUERY_BLOCK, k), q.dtype)
        bi = np.empty((QUERY_BLOCK, k), np.int64)
        for blk in range(c * per, min(nblocks, (c + 1) * per)):
            a = blk * QUERY_BLOCK
            b = min(n, a + QUERY_BLOCK)
            nq = b - a
            bd[:] = np.inf
            bi[:] = -1
            for t0 in range(0, m, TILE):
                t1 = min(m, t0 + TILE)
                w = t1 - t0
                _tile_distances(q, rt, a, nq, t0, t1, acc)
                for s in range(nq):
                    worst = bd[s, k - 1]
                    for j in range(w):
                        dd = acc[s, j]
                        if dd < cd[c, t0 + j]:
                            cd[c, t0 + j] = dd
                            ci[c, t0 + j] = a + s
                        if dd < worst:
                            worst = _insert(bd, bi, s, k, dd, t0 + j)
            for s in range(nq):
                for c2 in range(k):
                    out_d[a + s, c2] = bd[s, c2]
                    out_i[a + s, c2] = bi[s, c2]
    for j in range(m):
        back_d[j] = cd[0, j]
        back_i[j] = ci[0, j]
        for c in range(1, nchunks):
            if cd[c, j] < back_d[j]:
                back_d[j] = cd[c, j]
                back_i[j] = ci[c, j]


# --- the same answers through BLAS: approximate distances by GEMM, exact re-check -------------
#
# ``‖q‖² + ‖r‖² − 2 q·r`` (one GEMM per block of queries, through torch's BLAS) differs from
# the exact sum of the tiles above, ``Σ_d (q_d − r_d)²`` in the features' dtype, by at most
# ``δ = (4 D + 32) u (‖q‖ + ‖r‖)²`` (u: the unit roundoff; the standard bound of a dot
# product in any summation order is ``D u Σ|q_d r_d| ≤ D u ‖q‖ ‖r‖`` (+ O(u²)), the norms
# and the exact sum likewise, and a few roundings of values below ``(‖q‖ + ‖r‖)²``; the
# factor is about twice their sum). So a row's k-th smallest approximate value a_k bounds
# its exact k-th smallest by ``a_k + δ``, and every reference row whose exact distance is
# within that (ties included) has an approximate value ``<= a_k + 2δ``: those few
# candidates get the exact sum (the tiles' arithmetic: the same bits) and the tiles'
# insertion rule, so the answer, tie order included, is theirs. The backward nearest keeps
# a running approximate minimum per reference row and re-checks every query within 2δ of
# it (an exact minimum at query i has an approximate value ``<= min + 2δ`` when i comes).
# Used only where the bound holds: finite features, no overflow, and float32 matrix
# products at full precision (``torch.get_float32_matmul_precision() == "highest"``).

#: queries per GEMM block (the block's distances, 32 × M floats, stay in L2)
GEMM_BLOCK = 32


@njit(cache=True, inline="always")
def _exact(q, r, i, j, zero):
    """``Σ_d (q[i, d] − r[j, d])²`` summed in order of d in the features' dtype."""
    acc = zero
    for d in range(q.shape[1]):
        x = q[i, d] - r[j, d]
        acc += x * x
    return acc


@njit(cache=True, parallel=True)
def _gemm_scan(E, a, qn2, q, r, k, delta, bdelta, zero, amin, out_d, out_i, back_d, back_i,
               bcand, nchunks, backward):
    """Answer rows ``a + s`` and update the backward answers from the block ``E (B, M)``.

    ``E[s, j] = ‖r_j‖² − 2 q_{a+s}·r_j`` (approximate); ``delta (N,)``, ``bdelta (M,)``: the
    error bounds of the rows and of the reference rows; ``amin (M,)``: the running
    approximate minimum of ``‖q‖² + E`` over the queries so far; ``bcand (B, M)`` int32
    scratch. Three phases: the running minima take in the block; one pass per row collects
    the forward candidates (within 2δ of the running k-th approximate value) and the
    backward ones (within 2δ of the minimum), re-checks the forward ones exactly; the
    backward candidates are re-checked in query order (ties keep the first query).
    """
    nb, m = E.shape
    if backward:
        per = (m + nchunks - 1) // nchunks
        for c in prange(nchunks):
            j0 = c * per
            j1 = min(m, j0 + per)
            for s in range(nb):
                qs = qn2[a + s]
                for j in range(j0, j1):
                    v = E[s, j] + qs
                    if v < amin[j]:
                        amin[j] = v
    # the thresholds in the block's dtype (their rounding is far inside the slack of δ)
    bthr = np.empty(m, E.dtype)
    for j in range(m):
        bthr[j] = amin[j] + bdelta[j] + bdelta[j]
    nbc = np.zeros(nb, np.int64)
    for s in prange(nb):
        i = a + s
        qs = qn2[i]
        two_d = delta[i] + delta[i]
        ap = np.full(k, np.inf, E.dtype)
        cand = np.empty(m, np.int64)
        nc = 0
        nb_s = 0
        thr = ap[k - 1]
        for j in range(m):
            e = E[s, j]
            if e <= thr:
                cand[nc] = j
                nc += 1
                if e < ap[k - 1]:
                    p = k - 1
                    while p > 0 and ap[p - 1] > e:
                        ap[p] = ap[p - 1]
                        p -= 1
                    ap[p] = e
                    thr = ap[k - 1] + two_d
            if backward and e + qs <= bthr[j]:
                bcand[s, nb_s] = j
                nb_s += 1
        nbc[s] = nb_s
        bd = np.full((1, k), np.inf, q.dtype)
        bi = np.full((1, k), -1, np.int64)
        kth = bd[0, k - 1]
        for t in range(nc):
            j = cand[t]
            if E[s, j] <= thr:
                dd = _exact(q, r, i, j, zero)
                if dd < kth:
                    kth = _insert(bd, bi, 0, k, dd, j)
        for c in range(k):
            out_d[i, c] = bd[0, c]
            out_i[i, c] = bi[0, c]
    if backward:
        for s in range(nb):
            for t in range(nbc[s]):
                j = bcand[s, t]
                dd = _exact(q, r, a + s, j, zero)
                if dd < back_d[j]:  # queries come in increasing order: ties keep the first
                    back_d[j] = dd
                    back_i[j] = a + s


def _gemm_applies(q: torch.Tensor, r: torch.Tensor) -> bool:
    """Tell whether the GEMM path's error bound holds for ``q (N, D)``, ``r (M, D)``."""
    if q.dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return False
    if not (bool(torch.isfinite(q).all()) and bool(torch.isfinite(r).all())):
        return False
    big = float(q.abs().max()) + float(r.abs().max()) if q.numel() and r.numel() else 0.0
    # (‖q‖ + ‖r‖)² <= D (max|q| + max|r|)² must stay far below the dtype's largest value
    return q.shape[1] * big * big < torch.finfo(q.dtype).max * 1e-3


def _feature_knn_gemm(query: torch.Tensor, ref: torch.Tensor, k: int, backward: bool
                      ) -> tuple[torch.Tensor, ...]:
    """Return the forward ``(N, k)`` answers and, with ``backward``, the ``(M, 1)`` ones."""
    threads = _threads.numba_threads()
    qt = query.detach().contiguous()
    rt_ = ref.detach().to(query.dtype).contiguous()
    q, r = qt.numpy(), rt_.numpy()
    n, m, dim = q.shape[0], r.shape[0], q.shape[1]
    dt = q.dtype
    u = float(np.finfo(dt).eps) / 2
    coef = (4 * dim + 32) * u
    tiny = 64.0 * dim * float(np.finfo(dt).tiny)  # subnormal products: absolute errors
    qn = np.sqrt((q.astype(np.float64) ** 2).sum(1)) * (1 + 1e-6)
    rn = np.sqrt((r.astype(np.float64) ** 2).sum(1)) * (1 + 1e-6)
    qmax = float(qn.max()) if n else 0.0
    rmax = float(rn.max()) if m else 0.0
    delta = (coef * (qn + rmax) ** 2 + tiny).astype(dt)
    rn2 = torch.from_numpy((r.astype(np.float64) ** 2).sum(1).astype(dt))
    qn2 = (q.astype(np.float64) ** 2).sum(1).astype(dt)
    out_d = np.empty((n, k), dt)
    out_i = np.empty((n, k), np.int64)
    back_d = np.full(m, np.inf, dt)
    back_i = np.full(m, -1, np.int64)
    amin = np.full(m, np.inf, dt)
    bdelta = (coef * (qmax + rn) ** 2 + tiny).astype(dt)
    zero = dt.type(0)
    rT = rt_.T
    buf = torch.empty(min(GEMM_BLOCK, max(n, 1)), m, dtype=query.dtype)
    bcand = np.empty((buf.shape[0], m), np.int32)
    nchunks = max(1, min(m, 4 * threads))
    for a in range(0, n, GEMM_BLOCK):
        b = min(n, a + GEMM_BLOCK)
        E = buf[: b - a]
        torch.addmm(rn2, qt[a:b], rT, beta=1, alpha=-2, out=E)
        En = E.numpy()
        _gemm_scan(En, a, qn2, q, r, int(k), delta, bdelta, zero, amin, out_d, out_i, back_d,
                   back_i, bcand, nchunks, backward)
    outs = (torch.from_numpy(out_d), torch.from_numpy(out_i))
    if backward:
        outs += (torch.from_numpy(back_d[:, None].copy()),
                 torch.from_numpy(back_i[:, None].copy()))
    return outs


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
    for i in prange(c):
        for j in range(c):
            if A[i, j] != 0:
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
