"""Triton kernel of the ransac family's point move: ``R_s p + t_s`` without a GEMM.

``transform_points_reference`` moves points by ``baddbmm``, a GEMM whose inner dimension is
3: cuBLAS tiles it as a matrix product and reads and writes far more than the points
(an H200: ~60 us for 1M points, ~44 us for KITTI's 125k, where moving them is 24 MB and
3 MB of memory traffic). Here one program moves ``BLOCK`` points by one transform, read
from device memory (no host synchronisation, one compilation for every size), each
coordinate ``((r0 x + r1 y) + r2 z) + t`` as a chain of float32 FMAs: a few ulps from the
GEMM's own rounding at most (tested against the float64 move).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pointalign.kernels.knn.triton import empty_best, take_tile
from pointalign.kernels.ransac.reference import MAX_TRITON_FEATURE_K


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
    for r in tl.static_range(3):
        row = T_ptr + s * 16 + 4 * r
        v = tl.load(row + 0) * x + tl.load(row + 1) * y
        v = v + tl.load(row + 2) * z
        tl.store(dst + r, v + tl.load(row + 3), mask=m)


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


# ---- feature kNN -------------------------------------------------------------------------

#: feature kNN tiles: query rows per program and reference rows per step (BQ × BR distances
#: held in registers); every program walks all reference rows of its problem
_FEATURE_BQ, _FEATURE_BR = 32, 64


@triton.jit(do_not_specialize=("n_blocks", "n_rows", "n_cols", "dim", "k", "q_stride",
                               "r_stride", "o_stride"),
            do_not_specialize_on_alignment=("q_ptr",))
def _feature_knn_kernel(q_ptr, rt_ptr, n_ptr, m_ptr, out_d_ptr, out_i_ptr, n_blocks, n_rows,
                        n_cols, dim, k, q_stride, r_stride, o_stride, COUNTS: tl.constexpr,
                        KP: tl.constexpr, BQ: tl.constexpr, BR: tl.constexpr):
    """The ``k`` nearest reference rows of ``BQ`` query rows of problem ``pid // n_blocks``.

    ``q (B, n_rows, dim)`` row-major (problem b at ``b · q_stride``), the reference
    transposed ``rt (B, dim, n_cols)`` (at ``b · r_stride``: each dimension's row is
    contiguous, so a tile's loads coalesce). Problem b's valid rows are its first ``n[b]``
    queries and ``m[b]`` references (``COUNTS``; else all). Distances ``Σ_d (q_d − r_d)²``
    in order of d; the k best per row by (distance, index) through the knn family's
    running list (:func:`~pointalign.kernels.knn.triton.take_tile`), then written in that
    order to ``out (B, n_rows, k)``; padding rows get ``(inf, -1)``.
    """
    pid = tl.program_id(0).to(tl.int64)
    b = pid // n_blocks
    rows = (pid - b * n_blocks) * BQ + tl.arange(0, BQ).to(tl.int64)
    if COUNTS:
        nq = tl.load(n_ptr + b)
        nr = tl.load(m_ptr + b)
    else:
        nq = n_rows + b * 0
        nr = n_cols + b * 0
    rmask = rows < nq
    inf = float("inf")
    zero_q = tl.zeros((BQ,), dtype=tl.float32)
    best_d, best_i = empty_best(tl.zeros((BQ, KP), dtype=tl.float32),
                                tl.zeros((BQ, KP), dtype=tl.int64), k)
    q_row = q_ptr + b * q_stride + rows * dim
    r_base = rt_ptr + b * r_stride
    lanes = tl.arange(0, BR).to(tl.int64)
    # int64 scalars; while loops (the interpreter cannot index range() by a tensor)
    start = b * 0
    while start < nr:
        cols = start + lanes
        cmask = cols < nr
        acc = tl.zeros((BQ, BR), dtype=tl.float32)
        d = b * 0
        while d < dim:
            qd = tl.load(q_row + d, mask=rmask, other=0.0)
            rd = tl.load(r_base + d * n_cols + cols, mask=cmask, other=0.0)
            x = qd[:, None] - rd[None, :]
            acc += x * x
            d += 1
        acc = tl.where(cmask[None, :], acc, inf)
        best_d, best_i = take_tile(acc, start, best_d, best_i, rmask)
        start += BR
    # the k best in order of (distance, index); slots past k (-inf) are not written
    slots = tl.arange(0, KP).to(tl.int64)
    best_d = tl.where(slots[None, :] < k, best_d, inf)
    out = b * o_stride + rows * k
    omask = rows < n_rows
    big = 9223372036854775807
    r = b * 0
    while r < k:
        md = tl.min(best_d, axis=1)
        mi = tl.min(tl.where(best_d == md[:, None], best_i, big), axis=1)
        tl.store(out_d_ptr + out + r, tl.where(rmask, md, zero_q + inf), mask=omask)
        tl.store(out_i_ptr + out + r, tl.where(rmask, mi, -1), mask=omask)
        best_d = tl.where(best_i == mi[:, None], inf, best_d)
        r += 1


def feature_knn(query: torch.Tensor, ref: torch.Tensor, k: int,
                n: torch.Tensor | None = None, m: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The k nearest rows of ``ref`` per row of ``query``, float32, one launch.

    ``query (N, D)`` and ``ref (M, D)`` (the contract of
    :func:`pointalign.kernels.ransac.feature_knn`), or ``query (B, N, D)``, ``ref (B, M, D)``
    with the valid counts ``n, m (B,)`` int64 on the device (that of
    :func:`~pointalign.kernels.ransac.feature_matches_many`: padding rows ``(inf, -1)``).
    ``1 <= k <= MAX_TRITON_FEATURE_K`` and ``k <= M`` (``k <= m[b]``). Returns
    ``(dists_sq, idx)`` of shape ``(N, k)`` or ``(B, N, k)``, idx int64, ascending by (distance, index).
    Squared distances are float32 sums of ``(q_d − r_d)²`` in order of d; the compiler may
    fuse each product with its sum (one rounding fewer than the "cpu" kernel's).
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
    q = q.contiguous()
    rt = r.transpose(1, 2).contiguous()  # (B, D, M)
    out_d = torch.empty((B, N, k), dtype=torch.float32, device=q.device)
    out_i = torch.empty((B, N, k), dtype=torch.int64, device=q.device)
    if N and B:
        n_blocks = triton.cdiv(N, _FEATURE_BQ)
        counts = n is not None
        _feature_knn_kernel[(B * n_blocks,)](
            q, rt, n if counts else q, m if counts else q, out_d, out_i, n_blocks, N, M, D,
            k, N * D, D * M, N * k, COUNTS=counts, KP=2 if k <= 2 else MAX_TRITON_FEATURE_K,
            BQ=_FEATURE_BQ, BR=_FEATURE_BR, num_warps=4)
    return (out_d, out_i) if batched else (out_d[0], out_i[0])
