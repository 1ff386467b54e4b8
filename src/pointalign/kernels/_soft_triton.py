"""Triton kernels of ``kernels/soft.py``: fused distance → exp → row reductions, and Horn.

Row kernel: program (i-block, split, batch) keeps BLOCK_N query rows, moves them by the
pose (float32 or float64, read from device memory: no host sync, no recompilation per
iteration), and streams its share of the points (coordinate-contiguous, see :func:`soa`)
in tiles of BLOCK_M points × BLOCK_N rows. Rows lie along the tile's fast axis, so each
thread owns whole rows and every reduction over points stays in-thread (no shuffles, no
barriers). Per tile: squared distance from coordinate differences, base-2 logit
``z = −s·log2(e)·d + g·log2(e)``, the exact running row maximum m, and ``exp2(z − m)``
summed into Σe, Σe² and Σe·p after rescaling the sums by ``exp2(m_old − m)`` (one exp2 per
row per tile): e ≤ 1, nothing overflows, and no row underflows to 0/0. Only the last
tile of a chunk is masked.
With SPLIT > 1 the points are divided among SPLIT programs per row block (flash-decoding)
so that small clouds still fill the GPU; their partial (max, sums) are merged by a second
tiny kernel, which applies the same epilogue. Accumulation in float32; no N×M storage.

Epilogues (constexpr MODE): 0 raw (lse, lse2, mean), 1 EM-ICP (λ_i, x'_i),
2 Sinkhorn (``offset − logaddexp(lse, log_slack)``).

Horn kernel: one program per batch entry reduces the weighted moments in float64, builds
Horn's 4×4 matrix (10 scalars per thread: no shuffles) and finds its top eigenvector by 40
squarings of the shifted, positive semi-definite matrix, normalised every 4th (no eigh, no
host sync), then writes the pose. A cross-
covariance that is only rounding noise of the moments it is computed from (one point,
coincident points) counts as 0, and a tiny εI breaks ties towards R = I (as the reference).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_MODES = {"raw": 0, "emicp": 1, "sinkhorn": 2}
#: (BLOCK_N, BLOCK_M, num_warps) of the row kernel on the GPU
TILE = (256, 16, 4)  # (rows, points, warps): fastest of 6 on an H100 at 40k and 200k


@triton.jit
def _logaddexp(a, b):
    mx = tl.maximum(a, b)
    mn = tl.minimum(a, b)
    safe = tl.where(mx == float("-inf"), 0.0, mx)
    return tl.where(mx == float("-inf"), mx, safe + tl.log(1.0 + tl.exp(mn - safe)))


@triton.jit
def _epilogue(m2, l1, l2, ux, uy, uz, rows, rmask, b, N, extra, offset,
              out0_ptr, out1_ptr, mean_ptr, qx, qy, qz, mom_ptr, part, n_parts,
              MODE: tl.constexpr, SQUARES: tl.constexpr, MOMENTS: tl.constexpr):
    neg_inf = float("-inf")
    lse = (m2 + tl.log2(l1)) * 0.6931471805599453
    pos = l1 > 0
    inv = 1.0 / tl.where(pos, l1, 1.0)
    mx = tl.where(pos & rmask, ux * inv, 0.0)
    my = tl.where(pos & rmask, uy * inv, 0.0)
    mz = tl.where(pos & rmask, uz * inv, 0.0)
    base = b * N + rows
    nmask = rows < N
    if MODE == 0:
        tl.store(out0_ptr + base, tl.where(rmask, lse, neg_inf), mask=nmask)
        if SQUARES:
            lse2 = (2.0 * m2 + tl.log2(l2)) * 0.6931471805599453
            tl.store(out1_ptr + base, tl.where(rmask, lse2, neg_inf), mask=nmask)
    elif MODE == 1:
        lse2 = (2.0 * m2 + tl.log2(l2)) * 0.6931471805599453
        log_c = _logaddexp(lse2, extra + tl.zeros_like(lse2))
        log_c = tl.where(log_c == neg_inf, 0.0, log_c)
        w = tl.where(rmask & (lse != neg_inf), tl.exp(lse - 0.5 * log_c), 0.0)
        tl.store(out0_ptr + base, w, mask=nmask)
        if MOMENTS:
            _horn_moments(w, qx, qy, qz, mx, my, mz, mom_ptr + (b * n_parts + part) * 16)
    else:
        out = offset - _logaddexp(lse, extra + tl.zeros_like(lse))
        tl.store(out0_ptr + base, tl.where(rmask, out, neg_inf), mask=nmask)
    if MODE != 2:
        tl.store(mean_ptr + base * 3 + 0, mx, mask=nmask)
        tl.store(mean_ptr + base * 3 + 1, my, mask=nmask)
        tl.store(mean_ptr + base * 3 + 2, mz, mask=nmask)


@triton.jit
def _exp2(x, FTZ: tl.constexpr):
    """``exp2(x)``, with ``FTZ`` as one ``ex2.approx.ftz.f32`` (no denormal fix-up).

    Results below 2**-126 of the row maximum become 0, which the sums cannot see anyway.
    """
    if FTZ:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def _tload(ptr, k):
    return tl.load(ptr + k).to(tl.float32)


@triton.jit
def _horn_moments(w, x0, x1, x2, m0, m1, m2, out_ptr):
    """Store the 16 float64 Horn moments of these rows (Σw, Σw x, Σw m, Σw x mᵀ)."""
    f64 = tl.float64
    w = w.to(f64)
    wx0 = w * x0.to(f64)
    wx1 = w * x1.to(f64)
    wx2 = w * x2.to(f64)
    m0 = m0.to(f64)
    m1 = m1.to(f64)
    m2 = m2.to(f64)
    tl.store(out_ptr + 0, tl.sum(w, 0))
    tl.store(out_ptr + 1, tl.sum(wx0, 0))
    tl.store(out_ptr + 2, tl.sum(wx1, 0))
    tl.store(out_ptr + 3, tl.sum(wx2, 0))
    tl.store(out_ptr + 4, tl.sum(w * m0, 0))
    tl.store(out_ptr + 5, tl.sum(w * m1, 0))
    tl.store(out_ptr + 6, tl.sum(w * m2, 0))
    tl.store(out_ptr + 7, tl.sum(wx0 * m0, 0))
    tl.store(out_ptr + 8, tl.sum(wx0 * m1, 0))
    tl.store(out_ptr + 9, tl.sum(wx0 * m2, 0))
    tl.store(out_ptr + 10, tl.sum(wx1 * m0, 0))
    tl.store(out_ptr + 11, tl.sum(wx1 * m1, 0))
    tl.store(out_ptr + 12, tl.sum(wx1 * m2, 0))
    tl.store(out_ptr + 13, tl.sum(wx2 * m0, 0))
    tl.store(out_ptr + 14, tl.sum(wx2 * m1, 0))
    tl.store(out_ptr + 15, tl.sum(wx2 * m2, 0))


@triton.jit
def _row_tile(m2, l1, l2, ux, uy, uz, px, py, pz, s2, p_base, g_base, cols, hi, spc,
              HAS_G: tl.constexpr, SQUARES: tl.constexpr, MASKED: tl.constexpr,
              FTZ: tl.constexpr):
    """One tile: BLOCK_M points (axis 0) × BLOCK_N query rows (axis 1) of the online
    log-sum-exp. Returns the row state (m2, l1, l2, ux, uy, uz), each (BLOCK_N,).

    Rows lie along the fast axis, so a thread owns whole rows and every reduction over the
    points is in-thread (no shuffles, no barriers). The row shift m2 (log2 units) is the
    exact running maximum; the sums are rescaled by exp2(m2_old − m2_new) per tile (one
    exp2 per row per tile, 1 when the maximum did not move). Only the last tile of a
    chunk is ``MASKED``.
    """
    if MASKED:
        cmask = cols < hi
        yx = tl.load(p_base + cols, mask=cmask, other=0.0).to(tl.float32)
        yy = tl.load(p_base + spc + cols, mask=cmask, other=0.0).to(tl.float32)
        yz = tl.load(p_base + 2 * spc + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        yx = tl.load(p_base + cols).to(tl.float32)
        yy = tl.load(p_base + spc + cols).to(tl.float32)
        yz = tl.load(p_base + 2 * spc + cols).to(tl.float32)
    dx = yx[:, None] - px[None, :]
    dy = yy[:, None] - py[None, :]
    dz = yz[:, None] - pz[None, :]
    d = dx * dx + dy * dy + dz * dz
    if HAS_G:
        if MASKED:
            g = tl.load(g_base + cols, mask=cmask, other=float("-inf"))
        else:
            g = tl.load(g_base + cols)
        z = (g.to(tl.float32) * 1.4426950408889634)[:, None] - s2 * d
        m_new = tl.maximum(m2, tl.max(z, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        e = _exp2(z - m_safe[None, :], FTZ)
    else:
        # z = −s2·d: the row maximum is −s2 · min d, and exp2(z − m) is one FMA + exp2
        if MASKED:
            d = tl.where(cmask[:, None], d, float("inf"))
        m_new = tl.maximum(m2, -s2 * tl.min(d, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        e = _exp2(d * (-s2) - m_safe[None, :], FTZ)
    alpha = tl.exp2(m2 - m_safe)
    l1 = l1 * alpha + tl.sum(e, 0)
    if SQUARES:
        l2 = l2 * (alpha * alpha) + tl.sum(e * e, 0)
    ux = ux * alpha + tl.sum(e * yx[:, None], 0)
    uy = uy * alpha + tl.sum(e * yy[:, None], 0)
    uz = uz * alpha + tl.sum(e * yz[:, None], 0)
    return m_new, l1, l2, ux, uy, uz


@triton.jit
def _rows_body(
    q_ptr, p_ptr, T_ptr, s_ptr, g_ptr, ql_ptr, pl_ptr, extra_ptr, offset_ptr,
    out0_ptr, out1_ptr, mean_ptr, part_ptr, mom_ptr,
    N, M, CHUNK,
    sqb, sqn, sqc, spb, spc, sgb,
    HAS_G: tl.constexpr, SQUARES: tl.constexpr, MODE: tl.constexpr, SPLIT: tl.constexpr,
    MOMENTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    FTZ: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    sp = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    qlen = tl.load(ql_ptr + b)
    plen = tl.load(pl_ptr + b)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < qlen
    qb = q_ptr + b * sqb + rows * sqn
    qx = tl.load(qb, mask=rmask, other=0.0).to(tl.float32)
    qy = tl.load(qb + sqc, mask=rmask, other=0.0).to(tl.float32)
    qz = tl.load(qb + 2 * sqc, mask=rmask, other=0.0).to(tl.float32)
    Tb = T_ptr + b * 16
    px = _tload(Tb, 0) * qx + _tload(Tb, 1) * qy + _tload(Tb, 2) * qz + _tload(Tb, 3)
    py = _tload(Tb, 4) * qx + _tload(Tb, 5) * qy + _tload(Tb, 6) * qz + _tload(Tb, 7)
    pz = _tload(Tb, 8) * qx + _tload(Tb, 9) * qy + _tload(Tb, 10) * qz + _tload(Tb, 11)
    s2 = tl.load(s_ptr + b) * 1.4426950408889634
    m2 = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    l1 = tl.zeros((BLOCK_N,), tl.float32)
    l2 = tl.zeros((BLOCK_N,), tl.float32)
    ux = tl.zeros((BLOCK_N,), tl.float32)
    uy = tl.zeros((BLOCK_N,), tl.float32)
    uz = tl.zeros((BLOCK_N,), tl.float32)
    p_base = p_ptr + b * spb
    g_base = g_ptr + b * sgb
    # this program's points [lo, hi): full tiles unmasked, then at most one masked tile
    lo = sp * CHUNK
    hi = tl.minimum(lo + CHUNK, plen)
    n_full = tl.maximum(hi - lo, 0) // BLOCK_M
    for t in range(0, n_full):
        cols = lo + t * BLOCK_M + tl.arange(0, BLOCK_M)
        m2, l1, l2, ux, uy, uz = _row_tile(m2, l1, l2, ux, uy, uz, px, py, pz, s2, p_base,
                                           g_base, cols, hi, spc,
                                           HAS_G, SQUARES, False, FTZ)
    if lo + n_full * BLOCK_M < hi:
        cols = lo + n_full * BLOCK_M + tl.arange(0, BLOCK_M)
        m2, l1, l2, ux, uy, uz = _row_tile(m2, l1, l2, ux, uy, uz, px, py, pz, s2, p_base,
                                           g_base, cols, hi, spc,
                                           HAS_G, SQUARES, True, FTZ)
    if SPLIT == 1:
        extra = tl.load(extra_ptr + b)
        offset = tl.load(offset_ptr + b)
        _epilogue(m2, l1, l2, ux, uy, uz, rows, rmask, b, N, extra, offset,
                  out0_ptr, out1_ptr, mean_ptr, qx, qy, qz, mom_ptr, pid_n,
                  tl.num_programs(0), MODE, SQUARES, MOMENTS)
    else:
        # partials laid out (B, SPLIT, 6, N)
        pb = part_ptr + ((b * SPLIT + sp) * 6) * N + rows
        tl.store(pb, m2, mask=rmask)
        tl.store(pb + N, l1, mask=rmask)
        tl.store(pb + 2 * N, l2, mask=rmask)
        tl.store(pb + 3 * N, ux, mask=rmask)
        tl.store(pb + 4 * N, uy, mask=rmask)
        tl.store(pb + 5 * N, uz, mask=rmask)


# Two thin kernels around one body: the loop bound CHUNK is a runtime argument on the GPU
# (one compilation for every size) and a compile-time constant under the interpreter, whose
# scalar arguments are 1-element arrays that recent NumPy refuses to use as ``range`` bounds.
@triton.jit
def _rows_kernel(
    q_ptr, p_ptr, T_ptr, s_ptr, g_ptr, ql_ptr, pl_ptr, extra_ptr, offset_ptr,
    out0_ptr, out1_ptr, mean_ptr, part_ptr, mom_ptr, N, M, CHUNK,
    sqb, sqn, sqc, spb, spc, sgb,
    HAS_G: tl.constexpr, SQUARES: tl.constexpr, MODE: tl.constexpr, SPLIT: tl.constexpr,
    MOMENTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    FTZ: tl.constexpr = False,
):
    _rows_body(q_ptr, p_ptr, T_ptr, s_ptr, g_ptr, ql_ptr, pl_ptr, extra_ptr, offset_ptr,
               out0_ptr, out1_ptr, mean_ptr, part_ptr, mom_ptr, N, M, CHUNK,
               sqb, sqn, sqc, spb, spc, sgb,
               HAS_G, SQUARES, MODE, SPLIT, MOMENTS, BLOCK_N, BLOCK_M, FTZ)


@triton.jit
def _rows_kernel_const(
    q_ptr, p_ptr, T_ptr, s_ptr, g_ptr, ql_ptr, pl_ptr, extra_ptr, offset_ptr,
    out0_ptr, out1_ptr, mean_ptr, part_ptr, mom_ptr, N, M, CHUNK: tl.constexpr,
    sqb, sqn, sqc, spb, spc, sgb,
    HAS_G: tl.constexpr, SQUARES: tl.constexpr, MODE: tl.constexpr, SPLIT: tl.constexpr,
    MOMENTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    FTZ: tl.constexpr = False,
):
    _rows_body(q_ptr, p_ptr, T_ptr, s_ptr, g_ptr, ql_ptr, pl_ptr, extra_ptr, offset_ptr,
               out0_ptr, out1_ptr, mean_ptr, part_ptr, mom_ptr, N, M, CHUNK,
               sqb, sqn, sqc, spb, spc, sgb,
               HAS_G, SQUARES, MODE, SPLIT, MOMENTS, BLOCK_N, BLOCK_M, FTZ)


@triton.jit
def _merge_kernel(
    part_ptr, q_ptr, ql_ptr, extra_ptr, offset_ptr, out0_ptr, out1_ptr, mean_ptr, mom_ptr, N,
    sqb, sqn, sqc,
    SQUARES: tl.constexpr, MODE: tl.constexpr, SPLIT: tl.constexpr, MOMENTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    qlen = tl.load(ql_ptr + b)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < qlen
    qx = rmask  # placeholders, unused unless MOMENTS
    qy = rmask
    qz = rmask
    if MOMENTS:
        qb = q_ptr + b * sqb + rows * sqn
        qx = tl.load(qb, mask=rmask, other=0.0)
        qy = tl.load(qb + sqc, mask=rmask, other=0.0)
        qz = tl.load(qb + 2 * sqc, mask=rmask, other=0.0)
    m2 = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    # unrolled (SPLIT is a constexpr): every partial's load is in flight at once
    for sp in tl.static_range(SPLIT):
        pm = tl.load(part_ptr + ((b * SPLIT + sp) * 6) * N + rows, mask=rmask,
                     other=float("-inf"))
        m2 = tl.maximum(m2, pm)
    m_safe = tl.where(m2 == float("-inf"), 0.0, m2)
    l1 = tl.zeros((BLOCK_N,), tl.float32)
    l2 = tl.zeros((BLOCK_N,), tl.float32)
    ux = tl.zeros((BLOCK_N,), tl.float32)
    uy = tl.zeros((BLOCK_N,), tl.float32)
    uz = tl.zeros((BLOCK_N,), tl.float32)
    for sp in tl.static_range(SPLIT):
        pb = part_ptr + ((b * SPLIT + sp) * 6) * N + rows
        a = tl.exp2(tl.load(pb, mask=rmask, other=float("-inf")) - m_safe)
        l1 += a * tl.load(pb + N, mask=rmask, other=0.0)
        if SQUARES:
            l2 += a * a * tl.load(pb + 2 * N, mask=rmask, other=0.0)
        ux += a * tl.load(pb + 3 * N, mask=rmask, other=0.0)
        uy += a * tl.load(pb + 4 * N, mask=rmask, other=0.0)
        uz += a * tl.load(pb + 5 * N, mask=rmask, other=0.0)
    extra = tl.load(extra_ptr + b)
    offset = tl.load(offset_ptr + b)
    _epilogue(m2, l1, l2, ux, uy, uz, rows, rmask, b, N, extra, offset,
              out0_ptr, out1_ptr, mean_ptr, qx, qy, qz, mom_ptr, pid_n, tl.num_programs(0),
              MODE, SQUARES, MOMENTS)


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def soa(points: torch.Tensor) -> torch.Tensor:
    """``points (B, M, 3)`` as the row kernel reads them: float32, coordinates contiguous.

    Returns a ``(B, M, 3)`` view of a ``(B, 3, M')`` buffer (M' = M rounded up to 16, so
    every coordinate row is 64-byte aligned): the kernel's loads of a tile are then unit-
    stride with constant offsets. Returned unchanged when ``points`` already is such a view
    (callers that reuse a cloud across passes convert it once).
    """
    B, M, _ = points.shape
    if (points.dtype == torch.float32 and points.stride(1) == 1 and points.stride(2) % 16 == 0
            and (B == 1 or points.stride(0) % 16 == 0) and points.data_ptr() % 64 == 0):
        return points
    buf = torch.empty((B, 3, -(-max(M, 1) // 16) * 16), dtype=torch.float32,
                      device=points.device)
    buf[:, :, :M].copy_(points.transpose(1, 2))
    return buf[:, :, :M].transpose(1, 2)


def rows(query, points, transform, scale, query_lengths, point_lengths, point_log_weights,
         extra, *, mode: str, squares: bool = False, offset=None, split: int | None = None,
         moments: bool = False):
    """Launch the row kernel (see module docstring); returns ``(out0, out1, mean)``.

    ``out0`` is lse (raw), λ (emicp) or the Sinkhorn log scaling; ``out1`` is lse2 (raw
    with ``squares``) or None; ``mean`` is None in Sinkhorn mode. With ``moments`` (EM-ICP
    mode) ``out1`` is instead the ``(B, n_parts, 16)`` float64 Horn moments of row blocks
    (Σλ, Σλ x, Σλ x', Σλ x x'ᵀ, x the untransformed query), for :func:`horn_from_parts`.
    """
    B, N, M = query.shape[0], query.shape[1], points.shape[1]
    dev = query.device
    interp = dev.type != "cuda"
    f32 = torch.float32
    # float32 or float64 pose: the kernel converts (no cast launch per iteration)
    T = transform.to(device=dev).contiguous()
    s = scale.to(device=dev, dtype=f32).contiguous()
    # unused scalars point at ``s`` (the kernel loads but ignores them): no extra launches
    ex = s if extra is None else extra.to(device=dev, dtype=f32).contiguous()
    off = s if offset is None else offset.to(device=dev, dtype=f32).contiguous()
    ql = query_lengths.to(device=dev, dtype=torch.int64).contiguous()
    pl = point_lengths.to(device=dev, dtype=torch.int64).contiguous()
    MODE = _MODES[mode]
    SQ = bool(squares) or MODE == 1
    out_dtype = query.dtype
    out0 = torch.empty((B, N), dtype=f32, device=dev)
    out1 = torch.empty((B, N), dtype=f32, device=dev) if (MODE == 0 and SQ) else out0
    mean = torch.empty((B, N, 3), dtype=f32, device=dev) if MODE != 2 else out0
    points = soa(points)
    g = s if point_log_weights is None else point_log_weights.to(f32).contiguous()
    if interp:
        BLOCK_N, BLOCK_M, warps = 16, 16, 4
    else:
        BLOCK_N, BLOCK_M, warps = TILE
        tile = os.environ.get("POINTALIGN_SOFT_TILE")  # "BLOCK_N,BLOCK_M,num_warps" (tuning)
        if tile:
            BLOCK_N, BLOCK_M, warps = (int(v) for v in tile.split(","))
    # ex2.approx.ftz in the pair loop (inline PTX: CUDA only); POINTALIGN_SOFT_FTZ=0 turns
    # it off (tl.exp2)
    ftz = (not interp) and os.environ.get("POINTALIGN_SOFT_FTZ", "1") != "0"
    nblk = triton.cdiv(N, BLOCK_N)
    mtiles = triton.cdiv(M, BLOCK_M)
    if split is None:
        if interp:
            split = 1
        else:
            want = 4 * _sm_count(dev.index or 0)
            split = max(1, min(mtiles // 4, -(-want // (nblk * B)), 64))
    split = max(1, min(int(split), mtiles))
    chunk = triton.cdiv(mtiles, split) * BLOCK_M
    part = torch.empty((B, split, 6, N), dtype=f32, device=dev) if split > 1 else out0
    kern = _rows_kernel_const if interp else _rows_kernel
    MOM = bool(moments) and MODE == 1
    n_parts = nblk if split == 1 else triton.cdiv(N, 128)
    mom = torch.empty((B, n_parts, 16), dtype=torch.float64, device=dev) if MOM else out0
    kern[(nblk, split, B)](
        query, points, T, s, g, ql, pl, ex, off, out0, out1, mean, part, mom,
        N, M, chunk,
        query.stride(0), query.stride(1), query.stride(2),
        points.stride(0), points.stride(2),
        g.stride(0) if point_log_weights is not None else 0,
        HAS_G=point_log_weights is not None, SQUARES=SQ, MODE=MODE, SPLIT=split,
        MOMENTS=MOM, BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M, FTZ=ftz, num_warps=warps,
    )
    if split > 1:
        _merge_kernel[(triton.cdiv(N, 128), B)](
            part, query, ql, ex, off, out0, out1, mean, mom, N,
            query.stride(0), query.stride(1), query.stride(2),
            SQUARES=SQ, MODE=MODE, SPLIT=split, MOMENTS=MOM, BLOCK_N=128, num_warps=4,
        )
    conv = (lambda t: t.to(out_dtype)) if out_dtype != f32 else (lambda t: t)
    return (conv(out0), mom if MOM else (conv(out1) if (MODE == 0 and SQ) else None),
            conv(mean) if MODE != 2 else None)


# --------------------------------------------------------------------------------------
# Horn: weighted moments + 4x4 top eigenvector, one program per batch entry
# --------------------------------------------------------------------------------------


@triton.jit
def _sel(v, idx, k):
    return tl.sum(tl.where(idx == k, v, 0.0), 0)


@triton.jit
def _horn_body(x_ptr, m_ptr, w_ptr, T_ptr, valid_ptr, N,
                 sxb, sxn, sxc, smb, smn, smc, swb, swn,
                 SQUARINGS: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    f64 = tl.float64
    aW = tl.zeros((BLOCK,), f64)
    ax0 = tl.zeros((BLOCK,), f64)
    ax1 = tl.zeros((BLOCK,), f64)
    ax2 = tl.zeros((BLOCK,), f64)
    am0 = tl.zeros((BLOCK,), f64)
    am1 = tl.zeros((BLOCK,), f64)
    am2 = tl.zeros((BLOCK,), f64)
    c00 = tl.zeros((BLOCK,), f64)
    c01 = tl.zeros((BLOCK,), f64)
    c02 = tl.zeros((BLOCK,), f64)
    c10 = tl.zeros((BLOCK,), f64)
    c11 = tl.zeros((BLOCK,), f64)
    c12 = tl.zeros((BLOCK,), f64)
    c20 = tl.zeros((BLOCK,), f64)
    c21 = tl.zeros((BLOCK,), f64)
    c22 = tl.zeros((BLOCK,), f64)
    for start in range(0, N, BLOCK):
        r = start + tl.arange(0, BLOCK)
        msk = r < N
        r64 = r.to(tl.int64)
        w = tl.load(w_ptr + b * swb + r64 * swn, mask=msk, other=0.0).to(f64)
        xb = x_ptr + b * sxb + r64 * sxn
        mb = m_ptr + b * smb + r64 * smn
        x0 = tl.load(xb, mask=msk, other=0.0).to(f64)
        x1 = tl.load(xb + sxc, mask=msk, other=0.0).to(f64)
        x2 = tl.load(xb + 2 * sxc, mask=msk, other=0.0).to(f64)
        m0 = tl.load(mb, mask=msk, other=0.0).to(f64)
        m1 = tl.load(mb + smc, mask=msk, other=0.0).to(f64)
        m2 = tl.load(mb + 2 * smc, mask=msk, other=0.0).to(f64)
        wx0 = w * x0
        wx1 = w * x1
        wx2 = w * x2
        aW += w
        ax0 += wx0
        ax1 += wx1
        ax2 += wx2
        am0 += w * m0
        am1 += w * m1
        am2 += w * m2
        c00 += wx0 * m0
        c01 += wx0 * m1
        c02 += wx0 * m2
        c10 += wx1 * m0
        c11 += wx1 * m1
        c12 += wx1 * m2
        c20 += wx2 * m0
        c21 += wx2 * m1
        c22 += wx2 * m2
    _horn_solve(tl.sum(aW, 0), tl.sum(ax0, 0), tl.sum(ax1, 0), tl.sum(ax2, 0),
                tl.sum(am0, 0), tl.sum(am1, 0), tl.sum(am2, 0),
                tl.sum(c00, 0), tl.sum(c01, 0), tl.sum(c02, 0), tl.sum(c10, 0),
                tl.sum(c11, 0), tl.sum(c12, 0), tl.sum(c20, 0), tl.sum(c21, 0),
                tl.sum(c22, 0), b, T_ptr, valid_ptr, T_ptr, T_ptr, SQUARINGS, False)


@triton.jit
def _horn_solve(W, sx0, sx1, sx2, sm0, sm1, sm2, c00s, c01s, c02s, c10s, c11s, c12s,
                c20s, c21s, c22s, b, T_ptr, valid_ptr, Told_ptr, frozen_ptr,
                SQUARINGS: tl.constexpr, KEEP: tl.constexpr):
    """Pose of batch entry ``b`` from its float64 moments Σw, Σw x, Σw m, Σw x mᵀ.

    Writes ``T (4, 4)`` and ``valid`` (W > 0). With ``KEEP``, an entry that is invalid or
    ``frozen`` gets ``Told`` instead of the identity / the new pose.
    """
    Wc = tl.maximum(W, 1e-300)
    xm0 = sx0 / Wc
    xm1 = sx1 / Wc
    xm2 = sx2 / Wc
    mm0 = sm0 / Wc
    mm1 = sm1 / Wc
    mm2 = sm2 / Wc
    sxx = c00s - W * xm0 * mm0
    sxy = c01s - W * xm0 * mm1
    sxz = c02s - W * xm0 * mm2
    syx = c10s - W * xm1 * mm0
    syy = c11s - W * xm1 * mm1
    syz = c12s - W * xm1 * mm2
    szx = c20s - W * xm2 * mm0
    szy = c21s - W * xm2 * mm1
    szz = c22s - W * xm2 * mm2
    # S is a difference of two moments: when it is rounding noise of them (a single point,
    # coincident points) it carries no rotation; treat it as 0 (→ R = I, as the reference)
    mag = tl.abs(c00s) + tl.abs(c01s) + tl.abs(c02s) + tl.abs(c10s) + tl.abs(c11s) \
        + tl.abs(c12s) + tl.abs(c20s) + tl.abs(c21s) + tl.abs(c22s) \
        + tl.abs(W) * (tl.abs(xm0) + tl.abs(xm1) + tl.abs(xm2)) \
        * (tl.abs(mm0) + tl.abs(mm1) + tl.abs(mm2))
    smax = tl.maximum(tl.maximum(tl.maximum(tl.abs(sxx), tl.abs(sxy)),
                                 tl.maximum(tl.abs(sxz), tl.abs(syx))),
                      tl.maximum(tl.maximum(tl.abs(syy), tl.abs(syz)),
                                 tl.maximum(tl.maximum(tl.abs(szx), tl.abs(szy)),
                                            tl.abs(szz))))
    inv = tl.where(smax > 1e-10 * mag, 1.0 / tl.maximum(smax, 1e-300), 0.0)
    # normalised S plus a tiny εI (ties broken towards R = I, as horn_from_sums)
    sxx = sxx * inv + 1e-9
    sxy = sxy * inv
    sxz = sxz * inv
    syx = syx * inv
    syy = syy * inv + 1e-9
    syz = syz * inv
    szx = szx * inv
    szy = szy * inv
    szz = szz * inv + 1e-9
    # Horn's symmetric 4×4 matrix N(S) as 10 scalars (every thread holds them: squarings
    # are ~40 float64 FMAs each, in registers, with no shuffles or layout conversions)
    a00 = sxx + syy + szz
    a01 = syz - szy
    a02 = szx - sxz
    a03 = sxy - syx
    a11 = sxx - syy - szz
    a12 = sxy + syx
    a13 = szx + sxz
    a22 = syy - sxx - szz
    a23 = syz + szy
    a33 = szz - sxx - syy
    # shift to positive semi-definite: eigenvalues of N lie in [-||N||_F, ||N||_F]
    fro = tl.sqrt(a00 * a00 + a11 * a11 + a22 * a22 + a33 * a33
                  + 2.0 * (a01 * a01 + a02 * a02 + a03 * a03 + a12 * a12 + a13 * a13
                           + a23 * a23))
    ifro = 1.0 / tl.maximum(fro, 1e-300)
    a00 = a00 * ifro + 1.0
    a01 = a01 * ifro
    a02 = a02 * ifro
    a03 = a03 * ifro
    a11 = a11 * ifro + 1.0
    a12 = a12 * ifro
    a13 = a13 * ifro
    a22 = a22 * ifro + 1.0
    a23 = a23 * ifro
    a33 = a33 * ifro + 1.0
    # 40 squarings, normalised every 4th (entries grow at most 4**16 in between: far
    # inside float64's range; only the scaling, not the direction, changes)
    for _ in range(SQUARINGS // 4):
        for _k in tl.static_range(4):
            b00 = a00 * a00 + a01 * a01 + a02 * a02 + a03 * a03
            b01 = a00 * a01 + a01 * a11 + a02 * a12 + a03 * a13
            b02 = a00 * a02 + a01 * a12 + a02 * a22 + a03 * a23
            b03 = a00 * a03 + a01 * a13 + a02 * a23 + a03 * a33
            b11 = a01 * a01 + a11 * a11 + a12 * a12 + a13 * a13
            b12 = a01 * a02 + a11 * a12 + a12 * a22 + a13 * a23
            b13 = a01 * a03 + a11 * a13 + a12 * a23 + a13 * a33
            b22 = a02 * a02 + a12 * a12 + a22 * a22 + a23 * a23
            b23 = a02 * a03 + a12 * a13 + a22 * a23 + a23 * a33
            b33 = a03 * a03 + a13 * a13 + a23 * a23 + a33 * a33
            a00 = b00
            a01 = b01
            a02 = b02
            a03 = b03
            a11 = b11
            a12 = b12
            a13 = b13
            a22 = b22
            a23 = b23
            a33 = b33
        big = tl.maximum(tl.maximum(tl.maximum(a00, a11), tl.maximum(a22, a33)),
                         tl.maximum(tl.maximum(tl.maximum(tl.abs(a01), tl.abs(a02)),
                                               tl.maximum(tl.abs(a03), tl.abs(a12))),
                                    tl.maximum(tl.abs(a13), tl.abs(a23))))
        ib = 1.0 / tl.maximum(big, 1e-300)
        a00 = a00 * ib
        a01 = a01 * ib
        a02 = a02 * ib
        a03 = a03 * ib
        a11 = a11 * ib
        a12 = a12 * ib
        a13 = a13 * ib
        a22 = a22 * ib
        a23 = a23 * ib
        a33 = a33 * ib
    # the column of the largest diagonal entry (the first on ties, as argmax)
    qw = a00
    qx = a01
    qy = a02
    qz = a03
    best = a00
    pick = a11 > best
    qw = tl.where(pick, a01, qw)
    qx = tl.where(pick, a11, qx)
    qy = tl.where(pick, a12, qy)
    qz = tl.where(pick, a13, qz)
    best = tl.where(pick, a11, best)
    pick = a22 > best
    qw = tl.where(pick, a02, qw)
    qx = tl.where(pick, a12, qx)
    qy = tl.where(pick, a22, qy)
    qz = tl.where(pick, a23, qz)
    best = tl.where(pick, a22, best)
    pick = a33 > best
    qw = tl.where(pick, a03, qw)
    qx = tl.where(pick, a13, qx)
    qy = tl.where(pick, a23, qy)
    qz = tl.where(pick, a33, qz)
    qn = 1.0 / tl.maximum(tl.sqrt(qw * qw + qx * qx + qy * qy + qz * qz), 1e-300)
    qw = qw * qn
    qx = qx * qn
    qy = qy * qn
    qz = qz * qn
    r00 = 1 - 2 * (qy * qy + qz * qz)
    r01 = 2 * (qx * qy - qz * qw)
    r02 = 2 * (qx * qz + qy * qw)
    r10 = 2 * (qx * qy + qz * qw)
    r11 = 1 - 2 * (qx * qx + qz * qz)
    r12 = 2 * (qy * qz - qx * qw)
    r20 = 2 * (qx * qz - qy * qw)
    r21 = 2 * (qy * qz + qx * qw)
    r22 = 1 - 2 * (qx * qx + qy * qy)
    t0 = mm0 - (r00 * xm0 + r01 * xm1 + r02 * xm2)
    t1 = mm1 - (r10 * xm0 + r11 * xm1 + r12 * xm2)
    t2 = mm2 - (r20 * xm0 + r21 * xm1 + r22 * xm2)
    ok = W > 0
    k16 = tl.arange(0, 16)
    T = tl.where(k16 == 0, r00, 0.0) + tl.where(k16 == 1, r01, 0.0) \
        + tl.where(k16 == 2, r02, 0.0) + tl.where(k16 == 3, t0, 0.0) \
        + tl.where(k16 == 4, r10, 0.0) + tl.where(k16 == 5, r11, 0.0) \
        + tl.where(k16 == 6, r12, 0.0) + tl.where(k16 == 7, t1, 0.0) \
        + tl.where(k16 == 8, r20, 0.0) + tl.where(k16 == 9, r21, 0.0) \
        + tl.where(k16 == 10, r22, 0.0) + tl.where(k16 == 11, t2, 0.0) \
        + tl.where(k16 == 15, 1.0, 0.0)
    if KEEP:
        new_pose = ok & (tl.load(frozen_ptr + b) == 0)
        T = tl.where(new_pose, T, tl.load(Told_ptr + b * 16 + k16))
    else:
        T = tl.where(ok, T, tl.where(k16 % 5 == 0, 1.0, 0.0))
    tl.store(T_ptr + b * 16 + k16, T)
    tl.store(valid_ptr + b, ok.to(tl.int8))


@triton.jit
def _horn_parts_kernel(mom_ptr, n_parts, T_ptr, valid_ptr, Told_ptr, frozen_ptr,
                       SQUARINGS: tl.constexpr, BLOCK: tl.constexpr):
    """Horn from per-block moments ``(B, n_parts, 16)`` (float64) written by the row
    kernels' EM-ICP epilogue; frozen or invalid entries keep ``Told``."""
    b = tl.program_id(0).to(tl.int64)
    k16 = tl.arange(0, 16)
    acc = tl.zeros((BLOCK, 16), tl.float64)
    for start in range(0, n_parts, BLOCK):
        r = start + tl.arange(0, BLOCK)
        acc += tl.load(mom_ptr + (b * n_parts + r[:, None]) * 16 + k16[None, :],
                       mask=(r < n_parts)[:, None], other=0.0)
    m = tl.sum(acc, 0)
    _horn_solve(_sel(m, k16, 0), _sel(m, k16, 1), _sel(m, k16, 2), _sel(m, k16, 3),
                _sel(m, k16, 4), _sel(m, k16, 5), _sel(m, k16, 6), _sel(m, k16, 7),
                _sel(m, k16, 8), _sel(m, k16, 9), _sel(m, k16, 10), _sel(m, k16, 11),
                _sel(m, k16, 12), _sel(m, k16, 13), _sel(m, k16, 14), _sel(m, k16, 15),
                b, T_ptr, valid_ptr, Told_ptr, frozen_ptr, SQUARINGS, True)


@triton.jit
def _horn_kernel(x_ptr, m_ptr, w_ptr, T_ptr, valid_ptr, N,
                 sxb, sxn, sxc, smb, smn, smc, swb, swn,
                 SQUARINGS: tl.constexpr, BLOCK: tl.constexpr):
    _horn_body(x_ptr, m_ptr, w_ptr, T_ptr, valid_ptr, N, sxb, sxn, sxc, smb, smn, smc,
               swb, swn, SQUARINGS, BLOCK)


@triton.jit
def _horn_kernel_const(x_ptr, m_ptr, w_ptr, T_ptr, valid_ptr, N: tl.constexpr,
                       sxb, sxn, sxc, smb, smn, smc, swb, swn,
                       SQUARINGS: tl.constexpr, BLOCK: tl.constexpr):
    _horn_body(x_ptr, m_ptr, w_ptr, T_ptr, valid_ptr, N, sxb, sxn, sxc, smb, smn, smc,
               swb, swn, SQUARINGS, BLOCK)


def horn_from_parts(moments, T_old, frozen):
    """Horn pose from ``moments (B, n_parts, 16)`` of :func:`rows` (``moments=True``).

    Returns ``(T (B, 4, 4) float64, valid (B,) bool)``; entries with zero weight or
    ``frozen (B,) bool`` get ``T_old (B, 4, 4) float64``.
    """
    B, n_parts = moments.shape[0], moments.shape[1]
    dev = moments.device
    T = torch.empty((B, 4, 4), dtype=torch.float64, device=dev)
    valid = torch.empty((B,), dtype=torch.int8, device=dev)
    # bool ↔ uint8 views (same bytes, 0/1): no cast launches per iteration
    frozen_u8 = frozen.to(torch.bool).contiguous().view(torch.uint8)
    _horn_parts_kernel[(B,)](moments, n_parts, T, valid, T_old.contiguous(), frozen_u8,
                             SQUARINGS=40, BLOCK=32, num_warps=1)
    return T, valid.view(torch.bool)


def horn(source, targets, weights):
    """Weighted Horn per batch entry (see ``kernels.soft.weighted_horn``)."""
    B, N = source.shape[0], source.shape[1]
    dev = source.device
    T = torch.empty((B, 4, 4), dtype=torch.float64, device=dev)
    valid = torch.empty((B,), dtype=torch.int8, device=dev)
    BLOCK = 64 if dev.type != "cuda" else 256
    kern = _horn_kernel_const if dev.type != "cuda" else _horn_kernel
    kern[(B,)](
        source, targets, weights, T, valid, N,
        source.stride(0), source.stride(1), source.stride(2),
        targets.stride(0), targets.stride(1), targets.stride(2),
        weights.stride(0), weights.stride(1),
        SQUARINGS=40, BLOCK=BLOCK, num_warps=4,
    )
    return T, valid.bool()
