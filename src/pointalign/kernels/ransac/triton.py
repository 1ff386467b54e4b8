"""Triton kernels of the ransac family: the point move, the feature kNN, the triangle tests.

**The point move** (``transform_points``). ``transform_points_reference`` moves points by
``baddbmm``, a GEMM whose inner dimension is 3: cuBLAS tiles it as a matrix product and
reads and writes far more than the points (an H200: ~60 us for 1M points, ~44 us for
KITTI's 125k, where moving them is 24 MB and 3 MB of memory traffic). Here one program
moves ``BLOCK`` points by one transform, read from device memory (no host synchronisation,
one compilation for every size), each coordinate ``((r0 x + r1 y) + r2 z) + t`` as a chain
of float32 FMAs: a few ulps from the GEMM's own rounding at most (tested against the float64
move).

**The feature kNN** (``feature_knn``: RANSAC's FPFH matches, both ways). The reference
(``cdist`` + ``topk``, twice) made ~130 launches for register()'s ~4.5k × 4.6k rows and
wrote the distance matrix twice. Here one pass computes each ``BQ × BR`` tile of distances
in registers (``Σ_d (q_d − r_d)²``, in order of d); every lane keeps the two nearest rows it
sees element-wise (no reduction inside the loop: k <= 2, what RANSAC's ratio test and the
backward matches ask), and each reference row's nearest query row is folded in by an
``atomic_min`` of a packed (distance, row) key. The reference rows are split into shares so
that a few thousand rows still fill the GPU, and a second kernel merges the shares'
candidates. Nothing is specialised on the sizes: one compilation serves every cloud and
batch.

**The triangle tests** (``triangle_tests``: RANSAC's hypotheses). One lane a hypothesis
gathers its three correspondences and tests the edge ratios (float32 lengths) and both
triangles' areas (float64), one launch where the PyTorch statement took ~30. Horn's motion
of the survivors stays the horn family's kernel: inlined here for every hypothesis it made
this kernel compile in ~3 s on the device (the first call waits for the slowest compile).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from pointalign.kernels.knn.triton import nn1_scan
from pointalign.kernels.ransac.reference import MAX_TRITON_FEATURE_K


@triton.jit
def _moved_axis(row_ptr, x, y, z):
    """One coordinate of ``R p + t``: ``((r₀x + r₁y) + r₂z) + t`` from a row of T."""
    v = tl.load(row_ptr + 0) * x + tl.load(row_ptr + 1) * y
    v = v + tl.load(row_ptr + 2) * z
    return v + tl.load(row_ptr + 3)


@triton.jit
def _moved(T_ptr, x, y, z):
    """Points ``(x, y, z)`` moved by the float32 transform at ``T_ptr`` (4 × 4, row-major)."""
    return (_moved_axis(T_ptr, x, y, z), _moved_axis(T_ptr + 4, x, y, z),
            _moved_axis(T_ptr + 8, x, y, z))


@triton.jit(do_not_specialize=("n_points", "n_blocks", "p_stride"))
def _move_kernel(T_ptr, p_ptr, out_ptr, n_points, n_blocks, p_stride, BLOCK: tl.constexpr):
    """Move block ``pid % n_blocks`` of ``BLOCK`` points by transform ``pid // n_blocks``.

    ``T (S, 4, 4)`` float32; the points of problem s start at ``s · p_stride`` (0: every
    transform moves the same points); ``out (S, P, 3)``. One grid axis, so that neither
    S nor P meets a grid's second-axis limit.
    """
    pid = tl.program_id(0).to(tl.int64)
    s = pid // n_blocks
    offs = (pid - s * n_blocks) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_points
    src = p_ptr + s * p_stride + offs * 3
    x = tl.load(src + 0, mask=m, other=0.0)
    y = tl.load(src + 1, mask=m, other=0.0)
    z = tl.load(src + 2, mask=m, other=0.0)
    dst = out_ptr + (s * n_points + offs) * 3
    mx, my, mz = _moved(T_ptr + s * 16, x, y, z)
    tl.store(dst + 0, mx, mask=m)
    tl.store(dst + 1, my, mask=m)
    tl.store(dst + 2, mz, mask=m)


def transform_points(T: torch.Tensor, points: torch.Tensor, block: int = 512) -> torch.Tensor:
    """``(S, P, 3)`` float32: ``T (S, 4, 4)`` moving float32 ``points (P, 3)`` or ``(S, P, 3)``.

    The contract of :func:`pointalign.kernels.ransac.transform_points` for float32 points.
    """
    S = T.shape[0]
    if T.dim() != 3 or T.shape[1:] != (4, 4) or points.shape[-1] != 3 \
            or points.dim() not in (2, 3) or (points.dim() == 3 and points.shape[0] != S):
        raise ValueError(f"transform_points: expected T (S, 4, 4) and points (P, 3) or "
                         f"(S, P, 3), got {tuple(T.shape)} and {tuple(points.shape)}")
    # one copy of points every transform reads through a stride-0 batch (an expanded view)
    pts = (points[0] if points.dim() == 3 and points.stride(0) == 0 else points).contiguous()
    P = pts.shape[-2]
    out = torch.empty((S, P, 3), dtype=torch.float32, device=pts.device)
    if S == 0 or P == 0:
        return out
    Tf = T.to(device=pts.device, dtype=torch.float32).contiguous()
    n_blocks = triton.cdiv(P, block)
    _move_kernel[(S * n_blocks,)](Tf, pts, out, P, n_blocks, 0 if pts.dim() == 2 else P * 3,
                                  BLOCK=block, num_warps=4)
    return out


@triton.jit(do_not_specialize=("n_points", "n_blocks", "m", "matches", "masked"),
            do_not_specialize_on_alignment=("valid_ptr",))
def _score_kernel(T_ptr, p_ptr, soa_ptr, valid_ptr, cnt_ptr, sq_ptr, match_ptr, n_points,
                  n_blocks, m, max_d2, matches, masked, BLOCK_N: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    """Score block ``pid % n_blocks`` of ``BLOCK_N`` points under transform ``pid // n_blocks``.

    Each point moves as :func:`_move_kernel` moves it, finds its nearest of the ``m``
    target points (``soa (3, m)``) within ``max_d2`` as the brute-force 1-NN kernel does
    (:func:`~pointalign.kernels.knn.triton.nn1_scan`), and the block's inlier count and
    float64 sum of squared distances go to its slot (summed per transform afterwards, in a
    fixed order); every point's match where ``matches`` (a run-time flag: one compilation).
    Where ``masked`` (a run-time flag), a transform whose byte of ``valid`` is 0 scans no
    target point: no inlier, no match (RANSAC's hypotheses that failed the triangle test).
    """
    pid = tl.program_id(0).to(tl.int64)
    s = pid // n_blocks
    keep = tl.load(valid_ptr + s, mask=masked != 0, other=1) != 0
    m_scan = tl.where(keep, m, 0)
    offs = (pid - s * n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    msk = offs < n_points
    x = tl.load(p_ptr + offs * 3 + 0, mask=msk, other=0.0)
    y = tl.load(p_ptr + offs * 3 + 1, mask=msk, other=0.0)
    z = tl.load(p_ptr + offs * 3 + 2, mask=msk, other=0.0)
    mx, my, mz = _moved(T_ptr + s * 16, x, y, z)
    d, j = nn1_scan(mx, my, mz, soa_ptr, m_scan, m, max_d2, True, BLOCK_N, BLOCK_M)
    hit = msk & (j >= 0)
    tl.store(cnt_ptr + pid, tl.sum(hit.to(tl.int64), axis=0))
    tl.store(sq_ptr + pid, tl.sum(tl.where(hit, d, 0.0).to(tl.float64), axis=0))
    tl.store(match_ptr + s * n_points + offs, tl.where(hit, j, -1).to(tl.int64),
             mask=offs < n_points * matches)


def score_transforms(T: torch.Tensor, points: torch.Tensor, soa: torch.Tensor,
                     max_distance: float, with_matches: bool,
                     valid: torch.Tensor | None = None, block_n: int = 32,
                     block_m: int = 64
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Score ``T (S, 4, 4)`` on float32 ``points (P, 3)`` against a brute-force target.

    ``soa (3, M)``: the target's points as the brute-force index lays them out; ``valid``:
    optional ``(S,)`` bool, the transforms to score (the others scan nothing: count 0, sum
    0, no match). Returns ``counts (S,) int64``, ``sums (S,) float64`` and
    (``with_matches``) ``matches (S, P)``: one launch and two fixed-order sums (the
    contract of :func:`pointalign.kernels.ransac.score_transforms`), no ``(S, P, 3)``
    tensor.
    """
    S, P = T.shape[0], points.shape[0]
    n_blocks = triton.cdiv(P, block_n)
    cnt = torch.empty(S * n_blocks, dtype=torch.int64, device=points.device)
    sq = torch.empty(S * n_blocks, dtype=torch.float64, device=points.device)
    match = torch.empty((S, P), dtype=torch.int64, device=points.device) if with_matches \
        else cnt
    mask = (torch.empty(1, dtype=torch.int8, device=points.device) if valid is None
            else valid.contiguous().view(torch.int8))  # (read only where given)
    _score_kernel[(S * n_blocks,)](
        T.to(device=points.device, dtype=torch.float32).contiguous(), points.contiguous(), soa,
        mask, cnt, sq, match, P, n_blocks, soa.shape[1],
        float(max_distance) * float(max_distance), int(with_matches), int(valid is not None),
        BLOCK_N=block_n, BLOCK_M=block_m, num_warps=4)
    return (cnt.view(S, n_blocks).sum(1), sq.view(S, n_blocks).sum(1),
            match if with_matches else None)


# ---- feature kNN -------------------------------------------------------------------------

#: feature kNN tiles: query rows per program and reference rows per step (BQ × BR distances
#: held in registers)
_FEATURE_BQ, _FEATURE_BR = 16, 64
#: programs per SM the reference is split for (a program walks its share of the reference
#: rows: RANSAC's ~4.5k × 4.6k FPFH rows are 140 query blocks, too few alone)
_FEATURE_PROGRAMS_PER_SM = 8
#: dimensions of the feature kernel's loop per pass (unrolled; the whole of FPFH's 33 ran
#: ~2x faster than one at a time but took ~2.5 s to compile, on the first call's path)
_FEATURE_UNROLL = 8
#: (distance bits << 32 | row) of "no row yet": larger than every real key
_NO_KEY = 0x7FFFFFFFFFFFFFFF


@triton.jit
def _valid_rows(n_ptr, m_ptr, b, n_rows, n_cols, COUNTS: tl.constexpr):
    """Problem ``b``'s valid query and reference rows: ``n[b], m[b]`` (``COUNTS``), else all."""
    if COUNTS:
        nq = tl.load(n_ptr + b)
        nr = tl.load(m_ptr + b)
    else:
        nq = n_rows + b * 0
        nr = n_cols + b * 0
    return nq, nr


@triton.jit(do_not_specialize=("n_blocks", "n_split", "chunk", "n_rows", "n_cols", "dim",
                               "k", "q_stride", "r_stride", "back"),
            do_not_specialize_on_alignment=("q_ptr",))
def _feature_part_kernel(q_ptr, rt_ptr, n_ptr, m_ptr, part_d_ptr, part_i_ptr, back_ptr,
                         n_blocks, n_split, chunk, n_rows, n_cols, dim, k, q_stride, r_stride,
                         back, COUNTS: tl.constexpr, UNROLL: tl.constexpr, BQ: tl.constexpr,
                         BR: tl.constexpr):
    """Find the 2 nearest of ``BQ`` query rows among a share of a problem's reference rows.

    Program ``pid`` = (problem b, query block, share s) with the share fastest: reference
    rows ``[s · chunk, (s + 1) · chunk)``. ``q (B, n_rows, dim)`` row-major (problem b at
    ``b · q_stride``), the reference transposed ``rt (B, dim, n_cols)`` (at ``b · r_stride``:
    a dimension's row is contiguous, so a tile's loads coalesce). Problem b's valid rows are
    its first ``n[b]`` queries and ``m[b]`` references (``COUNTS``; else all). Distances
    ``Σ_d (q_d − r_d)²`` in order of d. Each of the ``BQ × BR`` lanes keeps the two nearest
    of the reference rows it sees (element-wise, strict: of equal distances the earlier,
    smaller row); at the end the share's ``k`` (1 or 2) best per query row by (distance,
    index) go to ``part (B, n_rows, n_split, 2)`` (a second slot unused for k = 1 holds
    ``(inf, -1)``). With ``back``, each reference row's nearest query row of a tile is folded
    into ``back (B, n_cols)`` by ``atomic_min`` of ``(distance bits << 32) | query row``
    (the distances are >= +0, whose bits order as the values: the smallest distance, then
    the smallest row).
    """
    pid = tl.program_id(0).to(tl.int64)
    share = pid % n_split
    blk = pid // n_split
    b = blk // n_blocks
    first = (blk - b * n_blocks) * BQ
    rows = first + tl.arange(0, BQ).to(tl.int64)
    nq, nr = _valid_rows(n_ptr, m_ptr, b, n_rows, n_cols, COUNTS)
    rmask = rows < nq
    inf = float("inf")
    zero = tl.zeros((BQ, BR), dtype=tl.float32)
    zero_i = tl.zeros((BQ, BR), dtype=tl.int64)
    d1, i1 = zero + inf, zero_i - 1  # each lane's nearest and second nearest
    d2, i2 = zero + inf, zero_i - 1
    q_row = q_ptr + b * q_stride + rows * dim
    r_base = rt_ptr + b * r_stride
    lanes = tl.arange(0, BR).to(tl.int64)
    # int64 scalars; while loops (the interpreter cannot index range() by a tensor)
    start = share * chunk
    end = tl.minimum(start + chunk, nr)
    while start < end:
        cols = start + lanes
        cmask = cols < end
        acc = zero
        # in order of d: UNROLL dimensions a pass (their loads issued ahead of their use),
        # then the rest one at a time
        d = b * 0
        while d + UNROLL <= dim:
            for j in tl.static_range(UNROLL):
                qd = tl.load(q_row + d + j, mask=rmask, other=0.0)
                rd = tl.load(r_base + (d + j) * n_cols + cols, mask=cmask, other=0.0)
                x = qd[:, None] - rd[None, :]
                acc += x * x
            d += UNROLL
        while d < dim:
            qd = tl.load(q_row + d, mask=rmask, other=0.0)
            rd = tl.load(r_base + d * n_cols + cols, mask=cmask, other=0.0)
            x = qd[:, None] - rd[None, :]
            acc += x * x
            d += 1
        acc = tl.where(rmask[:, None] & cmask[None, :], acc, inf)
        if back:
            near, who = tl.min(acc, axis=0, return_indices=True,
                               return_indices_tie_break_left=True)
            key = (near.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (
                first + who.to(tl.int64))
            tl.atomic_min(back_ptr + b * n_cols + cols, key, mask=cmask & (near < inf),
                          sem="relaxed")
        c = cols[None, :] + zero_i
        lt1 = acc < d1
        lt2 = acc < d2
        d2 = tl.where(lt1, d1, tl.where(lt2, acc, d2))
        i2 = tl.where(lt1, i1, tl.where(lt2, c, i2))
        d1 = tl.where(lt1, acc, d1)
        i1 = tl.where(lt1, c, i1)
        start += BR
    # the share's best: the smallest (distance, index) of the lanes' nearest; then, with
    # that lane's second moved up, the next (within a lane the nearest orders first)
    big = 9223372036854775807
    m1 = tl.min(d1, axis=1)
    j1 = tl.min(tl.where(d1 == m1[:, None], i1, big), axis=1)
    taken = (d1 == m1[:, None]) & (i1 == j1[:, None])
    e1 = tl.where(taken, d2, d1)
    f1 = tl.where(taken, i2, i1)
    m2 = tl.min(e1, axis=1)
    j2 = tl.min(tl.where(e1 == m2[:, None], f1, big), axis=1)
    out = ((b * n_rows + rows) * n_split + share) * 2
    omask = rows < n_rows
    j1 = tl.where(m1 < inf, j1, -1)
    j2 = tl.where((m2 < inf) & (k > 1), j2, -1)
    tl.store(part_d_ptr + out, m1, mask=omask)
    tl.store(part_i_ptr + out, j1, mask=omask)
    tl.store(part_d_ptr + out + 1, tl.where(k > 1, m2, inf), mask=omask)
    tl.store(part_i_ptr + out + 1, j2, mask=omask)


@triton.jit(do_not_specialize=("n_blocks", "n_split", "n_rows", "n_cols", "k", "back"))
def _feature_merge_kernel(part_d_ptr, part_i_ptr, back_ptr, n_ptr, m_ptr, out_d_ptr,
                          out_i_ptr, back_d_ptr, back_i_ptr, n_blocks, n_split, n_rows, n_cols,
                          k, back, COUNTS: tl.constexpr, BQ: tl.constexpr):
    """Merge the shares' pairs of ``BQ`` rows into their k best, and decode ``back``.

    Program ``pid`` = (problem b, row block). Query rows: the shares' candidates of
    :func:`_feature_part_kernel` merged by (distance, index) into two slots (a candidate
    replaces the worse kept one when it orders before it), then written ascending to
    ``out (B, n_rows, k)``. Reference rows (``back``): the key's distance and query row to
    ``back_d, back_i (B, n_cols, 1)``. Padding rows get ``(inf, -1)``.
    """
    pid = tl.program_id(0).to(tl.int64)
    b = pid // n_blocks
    rows = (pid - b * n_blocks) * BQ + tl.arange(0, BQ).to(tl.int64)
    nq, nr = _valid_rows(n_ptr, m_ptr, b, n_rows, n_cols, COUNTS)
    inf = float("inf")
    big = 9223372036854775807
    zero_q = tl.zeros((BQ,), dtype=tl.float32)
    rmask = rows < nq
    # the kept pair, a <= b by (distance, index); "none yet" orders after every candidate
    ad, ai = zero_q + inf, rows * 0 + big
    bd, bi = zero_q + inf, rows * 0 + big
    src = (b * n_rows + rows) * n_split * 2
    j = b * 0
    while j < n_split * 2:
        cd = tl.load(part_d_ptr + src + j, mask=rmask, other=inf)
        ci = tl.load(part_i_ptr + src + j, mask=rmask, other=-1)
        ci = tl.where(ci < 0, big, ci)
        before_a = (cd < ad) | ((cd == ad) & (ci < ai))
        before_b = (cd < bd) | ((cd == bd) & (ci < bi))
        bd = tl.where(before_a, ad, tl.where(before_b, cd, bd))
        bi = tl.where(before_a, ai, tl.where(before_b, ci, bi))
        ad = tl.where(before_a, cd, ad)
        ai = tl.where(before_a, ci, ai)
        j += 1
    out = (b * n_rows + rows) * k
    omask = rows < n_rows
    tl.store(out_d_ptr + out, tl.where(rmask, ad, inf), mask=omask)
    tl.store(out_i_ptr + out, tl.where(rmask & (ai < big), ai, -1), mask=omask)
    if k > 1:
        tl.store(out_d_ptr + out + 1, tl.where(rmask, bd, inf), mask=omask)
        tl.store(out_i_ptr + out + 1, tl.where(rmask & (bi < big), bi, -1), mask=omask)
    if back:
        bmask = rows < n_cols
        key = tl.load(back_ptr + b * n_cols + rows, mask=bmask, other=0)
        found = (rows < nr) & (key != 0x7FFFFFFFFFFFFFFF)
        dist = (key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        tl.store(back_d_ptr + b * n_cols + rows, tl.where(found, dist, zero_q + inf),
                 mask=bmask)
        tl.store(back_i_ptr + b * n_cols + rows, tl.where(found, key & 0xFFFFFFFF, -1),
                 mask=bmask)


def feature_knn(query: torch.Tensor, ref: torch.Tensor, k: int,
                n: torch.Tensor | None = None, m: torch.Tensor | None = None, *,
                backward: bool = False, split: int | None = None
                ) -> tuple[torch.Tensor, ...]:
    """Find the k nearest rows of ``ref`` per row of ``query`` (and back), float32.

    ``query (N, D)`` and ``ref (M, D)`` (the contract of
    :func:`pointalign.kernels.ransac.feature_knn`), or ``query (B, N, D)``, ``ref (B, M, D)``
    with the valid counts ``n, m (B,)`` int64 on the device (that of
    :func:`~pointalign.kernels.ransac.feature_matches_many`: padding rows ``(inf, -1)``).
    ``1 <= k <= MAX_TRITON_FEATURE_K`` and ``k <= M`` (``k <= m[b]``). Returns
    ``(dists_sq, idx)`` of shape ``(N, k)`` or ``(B, N, k)``, idx int64, ascending by
    (distance, index), and with ``backward`` also each reference row's nearest query row,
    ``(M, 1)`` or ``(B, M, 1)`` (the same distances: one pass serves both). Squared
    distances are float32 sums of ``(q_d − r_d)²`` in order of d; the compiler may fuse each
    product with its sum (one rounding fewer than the "cpu" kernel's). ``split``: reference
    shares per query block (default: enough programs to fill the GPU).
    """
    batched = query.dim() == 3
    q = query if batched else query[None]
    r = ref if batched else ref[None]
    if (q.dim() != 3 or r.dim() != 3 or q.shape[0] != r.shape[0] or q.shape[2] != r.shape[2]
            or q.dtype != torch.float32 or r.dtype != torch.float32
            or (n is None) != (m is None) or batched != (n is not None)):
        raise ValueError(f"feature_knn: expected float32 (N, D) and (M, D), or (B, N, D) and "
                         f"(B, M, D) with counts, got {tuple(query.shape)} {query.dtype} and "
                         f"{tuple(ref.shape)} {ref.dtype}")
    B, N, D = q.shape
    M = r.shape[1]
    if not 1 <= k <= min(MAX_TRITON_FEATURE_K, M):
        raise ValueError(f"feature_knn: k must be in [1, {min(MAX_TRITON_FEATURE_K, M)}], "
                         f"got {k}")
    if max(N, M) >= 1 << 31:
        raise ValueError(f"feature_knn: at most 2**31 - 1 rows, got {N} and {M}")
    dev = q.device
    out = (torch.empty((B, N, k), dtype=torch.float32, device=dev),
           torch.empty((B, N, k), dtype=torch.int64, device=dev))
    back: tuple[torch.Tensor, ...] = (
        torch.empty((B, M, 1), dtype=torch.float32, device=dev),
        torch.empty((B, M, 1), dtype=torch.int64, device=dev)) if backward else ()
    if B and N:
        q = q.contiguous()
        rt = r.transpose(1, 2).contiguous()  # (B, D, M)
        n_blocks = triton.cdiv(N, _FEATURE_BQ)
        tiles = triton.cdiv(M, _FEATURE_BR)
        if split is None:
            want = _FEATURE_PROGRAMS_PER_SM * (
                1 if dev.type != "cuda" else _sm_count(dev.index or 0))
            split = -(-want // (B * n_blocks))
        split = max(1, min(int(split), tiles))
        chunk = triton.cdiv(tiles, split) * _FEATURE_BR
        split = triton.cdiv(M, chunk)
        part = (torch.empty((B, N, split, 2), dtype=torch.float32, device=dev),
                torch.empty((B, N, split, 2), dtype=torch.int64, device=dev))
        keys = torch.full((B, M), _NO_KEY, dtype=torch.int64, device=dev) if backward \
            else part[1]
        counts = n is not None
        nc = (n, m) if counts else (q, q)
        _feature_part_kernel[(B * n_blocks * split,)](
            q, rt, *nc, *part, keys, n_blocks, split, chunk, N, M, D, k, N * D, D * M,
            int(backward), COUNTS=counts, UNROLL=_FEATURE_UNROLL, BQ=_FEATURE_BQ,
            BR=_FEATURE_BR, num_warps=4)
        m_blocks = triton.cdiv(max(N, M if backward else 0), _FEATURE_BQ)
        _feature_merge_kernel[(B * m_blocks,)](
            *part, keys, *nc, *out, *(back or out), m_blocks, split, N, M, k, int(backward),
            COUNTS=counts, BQ=_FEATURE_BQ, num_warps=4)
    elif backward:
        back[0].fill_(math.inf)
        back[1].fill_(-1)
    res = out + back
    return res if batched else tuple(x[0] for x in res)


@triton.jit(do_not_specialize=("n", "k"))
def _ranking_kernel(d_ptr, j_ptr, back_ptr, key_ptr, n, k, BLOCK: tl.constexpr):
    """Write the ranking keys of source rows ``[pid·BLOCK, (pid + 1)·BLOCK)``.

    The reference's float32 steps (correctly rounded square roots and division), then
    float64.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    rm = rows < n
    d0 = tl.maximum(tl.load(d_ptr + rows * k, mask=rm, other=0.0), 0.0)
    d1 = tl.maximum(tl.load(d_ptr + rows * k + 1, mask=rm, other=1.0), 1e-30)
    ratio = tl.math.div_rn(tl.math.sqrt_rn(d0), tl.math.sqrt_rn(d1))
    ratio = tl.minimum(tl.maximum(ratio, 0.0), 1.0)
    j = tl.load(j_ptr + rows * k, mask=rm, other=0)
    mutual = tl.load(back_ptr + j, mask=rm, other=-1) == rows
    key = ratio.to(tl.float64) + tl.where(mutual, 0.0, 2.0).to(tl.float64)
    tl.store(key_ptr + rows, key, mask=rm)


def ranking_keys(dists: torch.Tensor, idx: torch.Tensor, back_idx: torch.Tensor,
                 block: int = 256) -> torch.Tensor:
    """Launch :func:`_ranking_kernel` (float32 distances): ``(N,)`` float64, one launch."""
    n, k = idx.shape
    key = torch.empty(n, dtype=torch.float64, device=dists.device)
    if n:
        _ranking_kernel[(triton.cdiv(n, block),)](dists.contiguous(), idx.contiguous(),
                                                  back_idx.contiguous(), key, n, k,
                                                  BLOCK=block, num_warps=4)
    return key


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# ---- triangle hypotheses -----------------------------------------------------------------

@triton.jit
def _row(p_ptr, i):
    """Rows ``i`` of a ``(C, 3)`` table: three vectors."""
    return tl.load(p_ptr + 3 * i), tl.load(p_ptr + 3 * i + 1), tl.load(p_ptr + 3 * i + 2)


@triton.jit
def _edge_ok(ax, ay, az, bx, by, bz, cx, cy, cz, dx, dy, dz, lo_ratio):
    """One edge pair of the triangle test: source edge ``a − b``, target edge ``c − d``."""
    ex = ax - bx
    ey = ay - by
    ez = az - bz
    fx = cx - dx
    fy = cy - dy
    fz = cz - dz
    ls = tl.sqrt(ex * ex + ey * ey + ez * ez)
    lt = tl.sqrt(fx * fx + fy * fy + fz * fz)
    lo = tl.minimum(ls, lt)
    return (lo >= lo_ratio * tl.maximum(ls, lt)) & (lo > 0)


@triton.jit
def _has_area(x0, y0, z0, x1, y1, z1, x2, y2, z2, eps):
    """``|e₁ × e₂|² > ε |e₁|² |e₂|²`` in float64 (e: the edges from the first vertex)."""
    ax = x1.to(tl.float64) - x0.to(tl.float64)
    ay = y1.to(tl.float64) - y0.to(tl.float64)
    az = z1.to(tl.float64) - z0.to(tl.float64)
    bx = x2.to(tl.float64) - x0.to(tl.float64)
    by = y2.to(tl.float64) - y0.to(tl.float64)
    bz = z2.to(tl.float64) - z0.to(tl.float64)
    cx = ay * bz - az * by
    cy = az * bx - ax * bz
    cz = ax * by - ay * bx
    return (cx * cx + cy * cy + cz * cz) > eps * (ax * ax + ay * ay + az * az) \
        * (bx * bx + by * by + bz * bz)


@triton.jit(do_not_specialize=("n_hyp", "lo_ratio", "eps"))
def _triangle_test_kernel(cs_ptr, ct_ptr, tri_ptr, keep_ptr, area_ptr, n_hyp, lo_ratio, eps,
                          BLOCK: tl.constexpr):
    """``BLOCK`` hypotheses, one a lane: the triangle test and both triangles' areas.

    Correspondences ``tri (H, 3)`` into ``cs, ct (C, 3)`` float32. Writes ``keep`` (the edge
    ratio test, float32 lengths) and ``area`` (both triangles span a plane, float64).
    """
    h = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    hm = h < n_hyp
    hc = tl.where(hm, h, 0)  # lanes past the end read hypothesis 0 and store nothing
    i0 = tl.load(tri_ptr + 3 * hc)
    i1 = tl.load(tri_ptr + 3 * hc + 1)
    i2 = tl.load(tri_ptr + 3 * hc + 2)
    x0, y0, z0 = _row(cs_ptr, i0)
    x1, y1, z1 = _row(cs_ptr, i1)
    x2, y2, z2 = _row(cs_ptr, i2)
    u0, v0, w0 = _row(ct_ptr, i0)
    u1, v1, w1 = _row(ct_ptr, i1)
    u2, v2, w2 = _row(ct_ptr, i2)
    # the edges p_j − p_{j−1} of both triangles (triangle_similar's roll by one)
    keep = _edge_ok(x0, y0, z0, x2, y2, z2, u0, v0, w0, u2, v2, w2, lo_ratio) \
        & _edge_ok(x1, y1, z1, x0, y0, z0, u1, v1, w1, u0, v0, w0, lo_ratio) \
        & _edge_ok(x2, y2, z2, x1, y1, z1, u2, v2, w2, u1, v1, w1, lo_ratio)
    area = _has_area(x0, y0, z0, x1, y1, z1, x2, y2, z2, eps) \
        & _has_area(u0, v0, w0, u1, v1, w1, u2, v2, w2, eps)
    tl.store(keep_ptr + h, keep.to(tl.int8), mask=hm)
    tl.store(area_ptr + h, area.to(tl.int8), mask=hm)


#: hypotheses per program of the triangle kernel (one a lane)
_TRIANGLE_BLOCK = 128


def triangle_tests(cs: torch.Tensor, ct: torch.Tensor, triples: torch.Tensor,
                   similarity: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the triangle test and the area tests of every hypothesis in one launch.

    ``cs, ct (C, 3)`` float32 on one CUDA device, ``triples (H, 3)`` int64. Returns
    ``(keep (H,) bool, area (H,) bool)``: what ``triangle_similar`` and
    ``triangle_has_area`` (of both triangles) say of each hypothesis, up to the rounding of
    a length on the test's bound.
    """
    H = triples.shape[0]
    keep = torch.empty((H,), dtype=torch.int8, device=cs.device)
    area = torch.empty((H,), dtype=torch.int8, device=cs.device)
    if H:
        _triangle_test_kernel[(triton.cdiv(H, _TRIANGLE_BLOCK),)](
            cs.contiguous(), ct.contiguous(), triples.contiguous(), keep, area, H,
            1.0 - float(similarity), float(eps), BLOCK=_TRIANGLE_BLOCK, num_warps=4)
    return keep.view(torch.bool), area.view(torch.bool)
