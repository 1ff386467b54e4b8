"""Triton kernels of the knn family: fused brute-force kNN and the radius table.

They serve :func:`~pointalign.kernels.knn.knn_tiles` and
:func:`~pointalign.kernels.knn.radius_neighbours`.

Each program owns ``BLOCK_N`` queries and streams the points in tiles of ``BLOCK_M``:
distances are computed from coordinate differences in the input dtype (fp32 for float32)
and reduced on the fly, so no distance ever reaches global memory.

* ``k == 1``: a per-lane running minimum ``(BLOCK_N, BLOCK_M)`` updated element-wise (no
  reduction inside the loop), reduced once at the end to (min, smallest index).
* ``1 < k <= 32``: a running top-k per query in registers. A tile is touched only if one of
  its distances beats a row's current k-th best; then its minimum is repeatedly extracted
  and swapped for the worst kept entry while that helps (for random data only the first few
  tiles do real work). Points are scanned in index order and comparisons are strict, so
  among equal distances the smallest indices are kept. Rows are sorted afterwards.
* ``_radius_table_kernel``: brute-force fixed-radius search of every point against all
  points (tiles of ``BLOCK_M``), writing the points within the radius of each row in index
  order into a ``(N, C)`` table (exclusive prefix sums inside a tile give the slots);
  ``count`` tells how many there were (more than C: the caller retries wider).

Kernels are decorated on first use, separately for compiled and interpreted runs
(``TRITON_INTERPRET=1`` is read when ``triton.jit`` runs), so tests can switch modes.
Points are passed as a ``(3, M)`` structure of arrays for coalesced loads; offsets are
int64.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl
from triton import knobs

from pointalign.kernels.knn.reference import MAX_TRITON_K, _sort_rows

_CACHE: dict[bool, dict[str, Any]] = {}


@triton.jit
def nn1_scan(qx, qy, qz, p_ptr, M, stride, max_d2, HAS_MAX: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Find the nearest of ``M`` SoA points ``p (3, stride)`` to each query: ``(d², index)``.

    A per-lane running minimum ``(BLOCK_N, BLOCK_M)`` updated element-wise, reduced once at
    the end to (min, smallest index); ``-1`` where no point lies within ``max_d2``
    (``HAS_MAX``) or none exists. Shared by the 1-NN kernel and the stability probe.
    """
    inf = float("inf")
    zero2 = tl.full((BLOCK_N, BLOCK_M), 0, dtype=qx.dtype)
    best_d = zero2 + inf
    best_i = tl.full((BLOCK_N, BLOCK_M), -1, dtype=tl.int32)  # M < 2**31 (launcher checks)
    lanes = tl.arange(0, BLOCK_M).to(tl.int64)
    # int64 scalar; a while loop (the interpreter cannot index range() by M)
    start = tl.program_id(0).to(tl.int64) * 0
    while start < M:
        cols = start + lanes
        cmask = cols < M
        px = tl.load(p_ptr + cols, mask=cmask, other=inf)
        py = tl.load(p_ptr + stride + cols, mask=cmask, other=inf)
        pz = tl.load(p_ptr + 2 * stride + cols, mask=cmask, other=inf)
        dx = qx[:, None] - px[None, :]
        dy = qy[:, None] - py[None, :]
        dz = qz[:, None] - pz[None, :]
        d = dx * dx + dy * dy + dz * dz
        if HAS_MAX:
            d = tl.where(d <= max_d2, d, inf)
        better = d < best_d
        best_d = tl.where(better, d, best_d)
        best_i = tl.where(better, cols.to(tl.int32)[None, :], best_i)
        start += BLOCK_M
    m = tl.min(best_d, axis=1)
    big = 2147483647
    cand = tl.where((best_d == m[:, None]) & (best_i >= 0), best_i, big)
    mi = tl.min(cand, axis=1)
    return m, tl.where(mi == big, -1, mi).to(tl.int64)


def _nn1_kernel(q_ptr, p_ptr, out_d_ptr, out_i_ptr, N, M, max_d2,
                HAS_MAX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    rmask = rows < N
    qx = tl.load(q_ptr + rows * 3 + 0, mask=rmask, other=0.0)
    qy = tl.load(q_ptr + rows * 3 + 1, mask=rmask, other=0.0)
    qz = tl.load(q_ptr + rows * 3 + 2, mask=rmask, other=0.0)
    m, mi = nn1_scan(qx, qy, qz, p_ptr, M, M, max_d2, HAS_MAX, BLOCK_N, BLOCK_M)
    tl.store(out_d_ptr + rows, m, mask=rmask)
    tl.store(out_i_ptr + rows, mi, mask=rmask)


@triton.jit
def topk_scan(qx, qy, qz, rmask, p_ptr, M, stride, max_d2, HAS_MAX: tl.constexpr,
              K: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Find the ``K`` nearest of ``M`` SoA points ``p (3, stride)`` to each query: ``(d², i)``.

    Each ``(BLOCK_N, KP)``, unsorted; slots past ``K`` hold ``-inf``, empty slots ``inf``
    and ``-1``. A tile is touched only if one of its distances beats a row's current k-th
    best; then its minimum is repeatedly extracted and swapped for the worst kept entry
    while that helps. Points are scanned in index order and comparisons are strict, so
    among equal distances the smallest indices are kept. Shared by the top-k kernel and the
    stability probe.
    """
    inf = float("inf")
    slots = tl.arange(0, KP).to(tl.int64)
    zk = tl.full((BLOCK_N, KP), 0, dtype=qx.dtype)
    zk_i = tl.full((BLOCK_N, KP), 0, dtype=tl.int64)
    # real slots start empty (inf) with distinct negative ids; padding slots hold -inf and
    # are never the worst, so never replaced
    best_d = tl.where(slots[None, :] < K, zk + inf, zk - inf)
    best_i = zk_i - 1 - slots[None, :]
    lanes = tl.arange(0, BLOCK_M).to(tl.int64)
    big = 9223372036854775807
    # int64 scalar; a while loop (the interpreter cannot index range() by M)
    start = tl.program_id(0).to(tl.int64) * 0
    while start < M:
        cols = start + lanes
        cmask = cols < M
        px = tl.load(p_ptr + cols, mask=cmask, other=inf)
        py = tl.load(p_ptr + stride + cols, mask=cmask, other=inf)
        pz = tl.load(p_ptr + 2 * stride + cols, mask=cmask, other=inf)
        dx = qx[:, None] - px[None, :]
        dy = qy[:, None] - py[None, :]
        dz = qz[:, None] - pz[None, :]
        d = dx * dx + dy * dy + dz * dz
        if HAS_MAX:
            d = tl.where(d <= max_d2, d, inf)
        worst = tl.max(best_d, axis=1)
        tmin = tl.min(d, axis=1)
        todo = (tmin < worst) & rmask
        while tl.max(todo.to(tl.int32), axis=0) > 0:
            m, j = tl.min(d, axis=1, return_indices=True, return_indices_tie_break_left=True)
            ins = (m < worst) & rmask
            # the worst kept entry by (distance, index): unique thanks to distinct ids
            wi = tl.max(tl.where(best_d == worst[:, None], best_i, -big), axis=1)
            slot = (best_d == worst[:, None]) & (best_i == wi[:, None]) & ins[:, None]
            best_d = tl.where(slot, m[:, None] + zk, best_d)
            best_i = tl.where(slot, (start + j.to(tl.int64))[:, None] + zk_i, best_i)
            d = tl.where(lanes[None, :] == j.to(tl.int64)[:, None], inf, d)
            worst = tl.max(best_d, axis=1)
            todo = (tl.min(d, axis=1) < worst) & rmask
        start += BLOCK_M
    return best_d, tl.where(best_d == inf, -1, best_i)


def _topk_kernel(q_ptr, p_ptr, out_d_ptr, out_i_ptr, N, M, max_d2,
                 HAS_MAX: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    rmask = rows < N
    qx = tl.load(q_ptr + rows * 3 + 0, mask=rmask, other=0.0)
    qy = tl.load(q_ptr + rows * 3 + 1, mask=rmask, other=0.0)
    qz = tl.load(q_ptr + rows * 3 + 2, mask=rmask, other=0.0)
    best_d, best_i = topk_scan(qx, qy, qz, rmask, p_ptr, M, M, max_d2, HAS_MAX, K, KP,
                               BLOCK_N, BLOCK_M)
    slots = tl.arange(0, KP).to(tl.int64)
    out = rows[:, None] * K + slots[None, :]
    omask = rmask[:, None] & (slots[None, :] < K)
    tl.store(out_d_ptr + out, best_d, mask=omask)
    tl.store(out_i_ptr + out, best_i, mask=omask)


def _radius_table_kernel(q_ptr, p_ptr, out_d_ptr, out_i_ptr, count_ptr, N, M, S, r2, C,
                         BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    # rows [0, S) search points [0, S), rows [S, N) points [S, M): two clouds at once (a
    # single cloud: S = N = M); a program whose rows straddle S scans both ranges
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    rmask = rows < N
    qx = tl.load(q_ptr + rows * 3 + 0, mask=rmask, other=0.0)
    qy = tl.load(q_ptr + rows * 3 + 1, mask=rmask, other=0.0)
    qz = tl.load(q_ptr + rows * 3 + 2, mask=rmask, other=0.0)
    first = rows < S
    lo = tl.where(first, 0, S)
    hi = tl.where(first, S, M)
    inf = float("inf")
    lanes = tl.arange(0, BLOCK_M).to(tl.int64)
    base = tl.zeros((BLOCK_N,), dtype=tl.int64)
    # int64 scalars; a while loop (the interpreter cannot index range() by M)
    start = tl.min(tl.where(rmask, lo, M), 0)
    end = tl.max(tl.where(rmask, hi, 0), 0)
    while start < end:
        cols = start + lanes
        cmask = cols < M
        px = tl.load(p_ptr + cols, mask=cmask, other=inf)
        py = tl.load(p_ptr + M + cols, mask=cmask, other=inf)
        pz = tl.load(p_ptr + 2 * M + cols, mask=cmask, other=inf)
        dx = qx[:, None] - px[None, :]
        dy = qy[:, None] - py[None, :]
        dz = qz[:, None] - pz[None, :]
        d = dx * dx + dy * dy + dz * dz
        own = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
        hit = (d <= r2) & cmask[None, :] & rmask[:, None] & own
        h = hit.to(tl.int64)
        slot = base[:, None] + tl.cumsum(h, axis=1) - h
        wmask = hit & (slot < C)
        off = rows[:, None] * C + slot
        tl.store(out_d_ptr + off, d, mask=wmask)
        tl.store(out_i_ptr + off, cols[None, :] + slot * 0, mask=wmask)
        base += tl.sum(h, axis=1)
        start += BLOCK_M
    tl.store(count_ptr + rows, base, mask=rmask)


def _kernels() -> dict[str, Any]:
    interp = bool(knobs.runtime.interpret)
    if interp not in _CACHE:
        # sizes are not specialised (divisible by 16 or not): one compilation for every size
        sizes = ("N", "M")
        _CACHE[interp] = {"nn1": triton.jit(_nn1_kernel, do_not_specialize=sizes),
                          "topk": triton.jit(_topk_kernel, do_not_specialize=sizes),
                          "radius": triton.jit(_radius_table_kernel,
                                               do_not_specialize=sizes + ("S", "C"))}
    return _CACHE[interp]


def knn(query: torch.Tensor, points: torch.Tensor, k: int,
        max_distance_sq: float | None = None, *, block_n: int | None = None,
        block_m: int | None = None, points_t: torch.Tensor | None = None
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the fused kNN kernel; same contract as :func:`pointalign.kernels.knn.knn_tiles`.

    ``query (N, 3)``, ``points (M, 3)`` (one float dtype, one device; CPU tensors only under
    ``TRITON_INTERPRET=1``), ``1 <= k <= 32``. Returns ``(dists_sq (N, k), idx (N, k))``.
    ``points_t``: ``points.t().contiguous()`` when the caller keeps it (the kernel reads the
    points as a structure of arrays; otherwise this call makes that copy).
    """
    if not 1 <= k <= MAX_TRITON_K:
        raise ValueError(f"k: the Triton kernel handles 1..{MAX_TRITON_K}, got {k}")
    ks = _kernels()
    if points.shape[0] >= 2**31 - 1:
        raise ValueError(f"points: at most 2**31 - 2 points, got {points.shape[0]}")
    n, m = query.shape[0], points.shape[0]
    q = query.contiguous()
    p = points.t().contiguous() if points_t is None else points_t  # (3, M) SoA
    has_max = max_distance_sq is not None
    md2 = 0.0 if max_distance_sq is None else float(max_distance_sq)
    kk = min(k, m)
    out_d = torch.empty((n, kk), dtype=q.dtype, device=q.device)
    out_i = torch.empty((n, kk), dtype=torch.int64, device=q.device)
    if kk == 1:
        # wide query blocks amortise point loads; narrow ones keep all SMs busy for small N
        bn = block_n or (64 if n >= 1 << 16 else 32 if n >= 1 << 12 else 16)
        bm = block_m or 64
        grid = (triton_cdiv(n, bn),)
        ks["nn1"][grid](q, p, out_d, out_i, n, m, md2, HAS_MAX=has_max,
                        BLOCK_N=bn, BLOCK_M=bm, num_warps=4)
    else:
        kp = 1 << (kk - 1).bit_length()
        bn, bm = block_n or 16, block_m or 64
        grid = (triton_cdiv(n, bn),)
        ks["topk"][grid](q, p, out_d, out_i, n, m, md2, HAS_MAX=has_max, K=kk, KP=kp,
                         BLOCK_N=bn, BLOCK_M=bm, num_warps=4)
        out_d, out_i = _sort_rows(out_d, out_i)
    if kk < k:
        out_d = torch.cat([out_d, out_d.new_full((n, k - kk), math.inf)], 1)
        out_i = torch.cat([out_i, out_i.new_full((n, k - kk), -1)], 1)
    return out_d, out_i


def triton_cdiv(a: int, b: int) -> int:
    """Ceiling division (kept here so no triton.cdiv at launch)."""
    return max(1, -(-a // b))


def radius_table(points: torch.Tensor, r2: float, capacity: int,
                 block_n: int = 16, block_m: int = 128, split: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Points within ``sqrt(r2)`` of every point, in index order.

    ``points (N, 3)`` → ``(dists_sq (N, C), idx (N, C) int64, count (N,) int64)`` with
    ``C = capacity``; slots past a row's count hold ``inf`` / ``-1``; a row with
    ``count > C`` kept its first C points (by index). ``split``: ``points`` is two clouds,
    rows ``[0, split)`` and ``[split, N)``, each row searching its own cloud's points only
    (indices into ``points``): every row as the cloud alone would give it, shifted.
    """
    n = points.shape[0]
    s = n if split is None else int(split)
    q = points.contiguous()
    if q.data_ptr() % 16:  # a group's later cloud: aligned, as alone (one compilation)
        q = q.clone()
    p = points.t().contiguous()
    out_d = torch.full((n, capacity), math.inf, dtype=q.dtype, device=q.device)
    out_i = torch.full((n, capacity), -1, dtype=torch.int64, device=q.device)
    count = torch.empty(n, dtype=torch.int64, device=q.device)
    _kernels()["radius"][(triton_cdiv(n, block_n),)](q, p, out_d, out_i, count, n, n, s,
                                                      float(r2), capacity, BLOCK_N=block_n,
                                                      BLOCK_M=block_m, num_warps=4)
    return out_d, out_i, count
