"""Triton kernels of the soft family: fused distance → exp → row reductions.

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
With a split > 1 the points are divided among that many programs per row block
(flash-decoding) so that small clouds still fill the GPU; their partial (max, sums) are
merged by a second tiny kernel, which applies the same epilogue. Accumulation in float32;
no N×M storage. The split depends on the sizes and the GPU, so it is a run-time value
(the grid's second axis): one compilation serves every size (a constant split cost a first
EM-ICP call 20-24 s of compiling on a fresh H200, 3.7 s for each new split's merge kernel).
The merge reads the partials ``MERGE_GROUP`` at a time as (group, rows) tiles: one memory
round trip per group.

Culling (passes without column offsets g: EM-ICP, the raw and fitness passes, from
:data:`CULL_MIN_POINTS` points on): at a small σ most pairs weigh nothing next to a row's
nearest points. A first kernel (:func:`_cull_kernel`, a program per block of rows) bounds
every tile's largest logit by the gap between its bounding box and the block's, bounds each
row's largest logit from below by one near tile, and lists the tiles that could give a row
at least ``2^−(CULL_BITS + log2 M + 1)`` of its largest term; the row kernel sums only
those, reading each listed tile's points one tile ahead. What is left out is below
``2^−CULL_BITS`` of every row sum, far under float32's rounding; the boxes are tight
because :func:`pointalign.kernels.soft.centre` puts such clouds in Morton order. Blocks keep
unequal shares, so a culled pass splits each block's list among more programs
(:data:`CULL_PROGRAMS` per SM). On the 40k bunny pair (H200) a pass at σ = 0.03 ρ keeps
27 % of the tiles and takes 0.32 ms instead of 1.05; EM-ICP's whole schedule, whose first
half runs at a σ that leaves nothing out, spends 49.4 ms in the row kernel instead of 70.5.

Epilogues (constexpr MODE): 0 raw (lse, lse2, mean), 1 EM-ICP (λ_i, x'_i),
2 Sinkhorn (``offset − logaddexp(lse, log_slack)``).

In EM-ICP mode the row kernels also write each row block's Horn moments
(:func:`_horn_moments`); the Horn solve itself is the ``kernels.horn`` family
(``horn/triton.py``). :class:`TritonPasses` runs a soft method's passes with them.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pointalign.kernels.soft.reference import (
    Passes,
    SoftRows,
    lengths_or_all,
    softassign_row_scalings,
)

LOG2E = 1.4426950408889634
#: partials the merge kernel loads at once (one memory round trip per group)
MERGE_GROUP = tl.constexpr(32)
LN2 = 0.6931471805599453
_MODES = {"raw": 0, "emicp": 1, "sinkhorn": 2, "column": 3}
#: a pass without column offsets leaves out a tile whose every pair weighs less than
#: 2^−(this + log2 M + 1) of its row's largest term: under 2^−CULL_BITS of each row's sum
#: (which holds at least ~0.84 of its largest term, see :func:`_row_tile`)
CULL_BITS = 32.0
#: the cull runs from this many points on (below, its two launches cost more than it saves)
CULL_MIN_POINTS = 16384
#: and while its lists (row blocks × tiles, int32) stay under this many entries
CULL_MAX_ENTRIES = 1 << 24
#: a culled pass's programs per SM (the split's target; an unculled pass's is 4)
CULL_PROGRAMS = 32
#: an unculled pass splits its points so that a program sums at most about this many tiles
#: (longer programs leave the GPU's slots idle from ~10k points on) ...
TILES_PER_PROGRAM = 20
#: ... while its partials (split × rows, 6 floats each: 24 MiB) stay under this many rows
PARTIAL_ROWS = 1 << 20
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
    elif MODE == 2:
        out = offset - _logaddexp(lse, extra + tl.zeros_like(lse))
        tl.store(out0_ptr + base, tl.where(rmask, out, neg_inf), mask=nmask)
    else:  # Softassign's last column pass: w = sigmoid(lse − log slack), Horn's moments
        w = tl.where(rmask & (lse != neg_inf), 1.0 / (1.0 + tl.exp(extra - lse)), 0.0)
        tl.store(out0_ptr + base, w, mask=nmask)
        if MOMENTS:  # the pose moves the soft correspondences x' onto the queries y
            _horn_moments(w, mx, my, mz, qx, qy, qz, mom_ptr + (b * n_parts + part) * 16)
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
def _accumulate(m2, m_new, m_safe, e, l1, l2, ux, uy, uz, yx, yy, yz, SQUARES: tl.constexpr,
                MODE: tl.constexpr):
    """Add a tile's weights ``e (BLOCK_M, BLOCK_N)`` to the row sums, rescaled to ``m_new``.

    The sums kept at the shift ``m2`` are multiplied by ``exp2(m2 − m_safe)`` (1 when the
    maximum did not move); returns the row state ``(m_new, l1, l2, ux, uy, uz)``. The
    weighted means are not summed in Sinkhorn mode (``MODE`` 2), whose epilogue has none.
    """
    alpha = tl.exp2(m2 - m_safe)
    l1 = l1 * alpha + tl.sum(e, 0)
    if SQUARES:
        l2 = l2 * (alpha * alpha) + tl.sum(e * e, 0)
    if MODE != 2:
        ux = ux * alpha + tl.sum(e * yx[:, None], 0)
        uy = uy * alpha + tl.sum(e * yy[:, None], 0)
        uz = uz * alpha + tl.sum(e * yz[:, None], 0)
    return m_new, l1, l2, ux, uy, uz


@triton.jit
def _row_tile(m2, l1, l2, ux, uy, uz, px, py, pz, s2, p_base, g_base, cols, hi, spc,
              HAS_G: tl.constexpr, SQUARES: tl.constexpr, MASKED: tl.constexpr,
              FTZ: tl.constexpr, MODE: tl.constexpr):
    """One tile of the online log-sum-exp.

    The tile is BLOCK_M points (axis 0) × BLOCK_N query rows (axis 1). Returns the row
    state (m2, l1, l2, ux, uy, uz), each (BLOCK_N,).

    Rows lie along the fast axis, so a thread owns whole rows and every reduction over the
    points is in-thread (no shuffles, no barriers). The row shift m2 (log2 units) is the
    exact running maximum; the sums are rescaled by exp2(m2_old − m2_new) per tile (one
    exp2 per row per tile, 1 when the maximum did not move). Only the last tile of a
    chunk is ``MASKED``.
    """
    cmask = cols < hi
    if MASKED:
        yx = tl.load(p_base + cols, mask=cmask, other=0.0).to(tl.float32)
        yy = tl.load(p_base + spc + cols, mask=cmask, other=0.0).to(tl.float32)
        yz = tl.load(p_base + 2 * spc + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        yx = tl.load(p_base + cols).to(tl.float32)
        yy = tl.load(p_base + spc + cols).to(tl.float32)
        yz = tl.load(p_base + 2 * spc + cols).to(tl.float32)
    if not HAS_G:
        return _tile_sums(m2, l1, l2, ux, uy, uz, px, py, pz, s2, yx, yy, yz, cmask,
                          SQUARES, MASKED, FTZ, MODE)
    dx = yx[:, None] - px[None, :]
    dy = yy[:, None] - py[None, :]
    dz = yz[:, None] - pz[None, :]
    d = dx * dx + dy * dy + dz * dz
    if MASKED:
        g = tl.load(g_base + cols, mask=cmask, other=float("-inf"))
    else:
        g = tl.load(g_base + cols)
    z = (g.to(tl.float32) * 1.4426950408889634)[:, None] - s2 * d
    m_new = tl.maximum(m2, tl.max(z, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    e = _exp2(z - m_safe[None, :], FTZ)
    return _accumulate(m2, m_new, m_safe, e, l1, l2, ux, uy, uz, yx, yy, yz, SQUARES, MODE)


@triton.jit
def _tile_sums(m2, l1, l2, ux, uy, uz, px, py, pz, s2, yx, yy, yz, cmask,
               SQUARES: tl.constexpr, MASKED: tl.constexpr, FTZ: tl.constexpr,
               MODE: tl.constexpr):
    """One tile of :func:`_row_tile` without column offsets, its points already loaded.

    ``yx, yy, yz``: the tile's ``(BLOCK_M,)`` coordinates; ``cmask``: the valid ones (read
    when ``MASKED``). Returns the row state as :func:`_row_tile`.
    """
    dx = yx[:, None] - px[None, :]
    dy = yy[:, None] - py[None, :]
    dz = yz[:, None] - pz[None, :]
    d = dx * dx + dy * dy + dz * dz
    # z = −s2·d: the row maximum is −s2 · min d, and exp2(z − m) is one FMA + exp2. The
    # FMA rounds once where m was rounded once more, so at the row's nearest point z − m
    # could be +½ ulp(m), hundreds when every point is far (s·d ≈ 1e10). The shift is
    # therefore raised by 2⁻²² |m| (≥ 2 ulp; z ≤ 0, so m ≤ 0 and the product moves it
    # towards 0) once per row and tile: every z − m ≤ 0 and e ≤ 1 without a clamp in
    # the pair loop (any shift gives the same log-sum-exp; this one only costs float32
    # ~5e-7 |m| of range, nothing where |m| is moderate)
    if MASKED:
        d = tl.where(cmask[:, None], d, float("inf"))
    m_new = tl.maximum(m2, (-s2 * tl.min(d, 0)) * 0.9999997615814209)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    e = _exp2(d * (-s2) - m_safe[None, :], FTZ)
    return _accumulate(m2, m_new, m_safe, e, l1, l2, ux, uy, uz, yx, yy, yz, SQUARES, MODE)


@triton.jit
def _moved_rows(q_ptr, T_ptr, b, rows, rmask, sqb, sqn, sqc, INVERT: tl.constexpr = False):
    """Load query rows ``q`` and move them by entry b's pose: ``(qx, qy, qz, px, py, pz)``.

    ``INVERT``: by the pose's inverse, ``Rᵀ (q − t)`` (Softassign's column passes: no
    inverse made per update).
    """
    qb = q_ptr + b * sqb + rows * sqn
    qx = tl.load(qb, mask=rmask, other=0.0).to(tl.float32)
    qy = tl.load(qb + sqc, mask=rmask, other=0.0).to(tl.float32)
    qz = tl.load(qb + 2 * sqc, mask=rmask, other=0.0).to(tl.float32)
    Tb = T_ptr + b * 16
    if INVERT:
        dx, dy, dz = qx - _tload(Tb, 3), qy - _tload(Tb, 7), qz - _tload(Tb, 11)
        px = _tload(Tb, 0) * dx + _tload(Tb, 4) * dy + _tload(Tb, 8) * dz
        py = _tload(Tb, 1) * dx + _tload(Tb, 5) * dy + _tload(Tb, 9) * dz
        pz = _tload(Tb, 2) * dx + _tload(Tb, 6) * dy + _tload(Tb, 10) * dz
    else:
        px = _tload(Tb, 0) * qx + _tload(Tb, 1) * qy + _tload(Tb, 2) * qz + _tload(Tb, 3)
        py = _tload(Tb, 4) * qx + _tload(Tb, 5) * qy + _tload(Tb, 6) * qz + _tload(Tb, 7)
        pz = _tload(Tb, 8) * qx + _tload(Tb, 9) * qy + _tload(Tb, 10) * qz + _tload(Tb, 11)
    return qx, qy, qz, px, py, pz


@triton.jit
def _tile_gaps(box_ptr, box_hi, box_axis, ts, tm, rx0, ry0, rz0, rx1, ry1, rz1):
    """Squared gaps between the rows' box and the boxes of tiles ``ts`` (inf off ``tm``)."""
    bb = box_ptr + ts
    gx = tl.maximum(tl.maximum(tl.load(bb, mask=tm, other=0.0) - rx1,
                               rx0 - tl.load(bb + box_hi, mask=tm, other=0.0)), 0.0)
    gy = tl.maximum(tl.maximum(tl.load(bb + box_axis, mask=tm, other=0.0) - ry1,
                               ry0 - tl.load(bb + box_hi + box_axis, mask=tm, other=0.0)), 0.0)
    gz = tl.maximum(tl.maximum(tl.load(bb + 2 * box_axis, mask=tm, other=0.0) - rz1,
                               rz0 - tl.load(bb + box_hi + 2 * box_axis, mask=tm, other=0.0)),
                    0.0)
    return tl.where(tm, gx * gx + gy * gy + gz * gz, float("inf"))


# the sizes and strides are not specialised (no compilation per size)
@triton.jit(do_not_specialize=("sqb", "sbb", "box_hi", "box_axis", "slb"))
def _cull_kernel(q_ptr, p_ptr, T_ptr, s_ptr, ql_ptr, pl_ptr, box_ptr, list_ptr, count_ptr,
                 sqb, sqn, sqc, spb, spc, sbb, box_hi, box_axis, slb, cull_bits,
                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SCAN: tl.constexpr):
    """List, for one block of rows (program (i-block, batch)), the tiles of points to sum.

    The block's box is taken over its valid moved rows. The whole tile whose box is nearest
    that box bounds each row's largest logit from below by its own largest,
    ``m = −s·log2(e)·min d``. A tile whose largest possible logit (from its box) is below
    ``min m − cull_bits`` gives every pair of the block less than ``2^−cull_bits`` of its
    row's largest term: it is left out. The kept whole tiles' indices are written in order
    (one compaction per ``SCAN`` tiles), then their count; the partial last tile is not
    listed (the row kernel always sums it).
    """
    pid_n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n_t = tl.load(pl_ptr + b) // BLOCK_M
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < tl.load(ql_ptr + b)
    _, _, _, px, py, pz = _moved_rows(q_ptr, T_ptr, b, rows, rmask, sqb, sqn, sqc)
    s2 = tl.load(s_ptr + b) * 1.4426950408889634
    big = 3.0e38
    rx0 = tl.min(tl.where(rmask, px, big), 0)
    ry0 = tl.min(tl.where(rmask, py, big), 0)
    rz0 = tl.min(tl.where(rmask, pz, big), 0)
    rx1 = tl.max(tl.where(rmask, px, -big), 0)
    ry1 = tl.max(tl.where(rmask, py, -big), 0)
    rz1 = tl.max(tl.where(rmask, pz, -big), 0)
    bb = box_ptr + b * sbb
    best = tl.full((SCAN,), float("inf"), tl.float32)
    best_t = tl.zeros((SCAN,), tl.int64)
    for c in range(0, n_t, SCAN):
        ts = c + tl.arange(0, SCAN)
        g = _tile_gaps(bb, box_hi, box_axis, ts, ts < n_t, rx0, ry0, rz0, rx1, ry1, rz1)
        best_t = tl.where(g < best, ts, best_t)
        best = tl.minimum(g, best)
    seed = tl.sum(tl.where(tl.arange(0, SCAN) == tl.argmin(best, 0), best_t, 0), 0)
    cols = seed * BLOCK_M + tl.arange(0, BLOCK_M)
    cmask = cols < n_t * BLOCK_M  # none without a whole tile
    p_base = p_ptr + b * spb
    yx = tl.load(p_base + cols, mask=cmask, other=0.0).to(tl.float32)
    yy = tl.load(p_base + spc + cols, mask=cmask, other=0.0).to(tl.float32)
    yz = tl.load(p_base + 2 * spc + cols, mask=cmask, other=0.0).to(tl.float32)
    dx = yx[:, None] - px[None, :]
    dy = yy[:, None] - py[None, :]
    dz = yz[:, None] - pz[None, :]
    d = tl.where(cmask[:, None], dx * dx + dy * dy + dz * dz, float("inf"))
    limit = tl.min(tl.where(rmask, -s2 * tl.min(d, 0), float("inf")), 0) - cull_bits
    lb = list_ptr + (b * tl.num_programs(0) + pid_n) * slb
    count = n_t * 0
    for c in range(0, n_t, SCAN):
        ts = c + tl.arange(0, SCAN)
        g = _tile_gaps(bb, box_hi, box_axis, ts, ts < n_t, rx0, ry0, rz0, rx1, ry1, rz1)
        # a pair's computed d is at least 0.999 of the boxes' gap (rounding); NaN keeps
        keep = (ts < n_t) & ((s2 * g * 0.999 > -limit) == 0)
        k = keep.to(tl.int32)
        tl.store(lb + count + tl.cumsum(k, 0) - 1, ts.to(tl.int32), mask=keep)
        count += tl.sum(k, 0)
    tl.store(count_ptr + b * tl.num_programs(0) + pid_n, count)


@triton.jit
def _rows_body(
    q_ptr, p_ptr, T_ptr, s_ptr, g_ptr, ql_ptr, pl_ptr, extra_ptr, offset_ptr,
    out0_ptr, out1_ptr, mean_ptr, part_ptr, mom_ptr, list_ptr, count_ptr,
    N, M, CHUNK,
    sqb, sqn, sqc, spb, spc, sgb, slb,
    HAS_G: tl.constexpr, SQUARES: tl.constexpr, MODE: tl.constexpr,
    PARTIAL: tl.constexpr, MOMENTS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, FTZ: tl.constexpr, LIST: tl.constexpr, INVERT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    sp = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    qlen = tl.load(ql_ptr + b)
    plen = tl.load(pl_ptr + b)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < qlen
    qx, qy, qz, px, py, pz = _moved_rows(q_ptr, T_ptr, b, rows, rmask, sqb, sqn, sqc,
                                         INVERT)
    s2 = tl.load(s_ptr + b) * 1.4426950408889634
    m2 = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    l1 = tl.zeros((BLOCK_N,), tl.float32)
    l2 = tl.zeros((BLOCK_N,), tl.float32)
    ux = tl.zeros((BLOCK_N,), tl.float32)
    uy = tl.zeros((BLOCK_N,), tl.float32)
    uz = tl.zeros((BLOCK_N,), tl.float32)
    p_base = p_ptr + b * spb
    g_base = g_ptr + b * sgb
    if LIST:  # the whole tiles _cull_kernel kept for this row block, shared by the split
        n_kept = tl.load(count_ptr + b * tl.num_programs(0) + pid_n)
        lb = list_ptr + (b * tl.num_programs(0) + pid_n) * slb
        k0 = sp * n_kept // tl.num_programs(1)
        k1 = (sp + 1) * n_kept // tl.num_programs(1)
        # prefetched by hand: the next tile's points and the index after it are loaded
        # before a tile's sums (an index read then its points, in the loop, ran ~20 % slower
        # per tile than the flat loop below)
        ar = tl.arange(0, BLOCK_M)
        cols = tl.load(lb + k0, mask=k0 < k1, other=0).to(tl.int64) * BLOCK_M + ar
        t_next = tl.load(lb + k0 + 1, mask=k0 + 1 < k1, other=0).to(tl.int64)
        yx = tl.load(p_base + cols).to(tl.float32)
        yy = tl.load(p_base + spc + cols).to(tl.float32)
        yz = tl.load(p_base + 2 * spc + cols).to(tl.float32)
        for k in range(k0, k1):
            cx, cy, cz = yx, yy, yz
            cols = t_next * BLOCK_M + ar
            yx = tl.load(p_base + cols).to(tl.float32)
            yy = tl.load(p_base + spc + cols).to(tl.float32)
            yz = tl.load(p_base + 2 * spc + cols).to(tl.float32)
            t_next = tl.load(lb + k + 2, mask=k + 2 < k1, other=0).to(tl.int64)
            m2, l1, l2, ux, uy, uz = _tile_sums(m2, l1, l2, ux, uy, uz, px, py, pz, s2,
                                                cx, cy, cz, cols, SQUARES, False, FTZ,
                                                MODE)
        lo = plen // BLOCK_M * BLOCK_M  # then the partial last tile, by the last program
        hi = tl.where(sp == tl.num_programs(1) - 1, plen, lo)
        n_full = 0
    else:
        # this program's points [lo, hi): full tiles unmasked, then at most one masked tile
        lo = sp * CHUNK
        hi = tl.minimum(lo + CHUNK, plen)
        n_full = tl.maximum(hi - lo, 0) // BLOCK_M
        for t in range(0, n_full):
            cols = lo + t * BLOCK_M + tl.arange(0, BLOCK_M)
            m2, l1, l2, ux, uy, uz = _row_tile(m2, l1, l2, ux, uy, uz, px, py, pz, s2,
                                               p_base, g_base, cols, hi, spc,
                                               HAS_G, SQUARES, False, FTZ, MODE)
    if lo + n_full * BLOCK_M < hi:
        cols = lo + n_full * BLOCK_M + tl.arange(0, BLOCK_M)
        m2, l1, l2, ux, uy, uz = _row_tile(m2, l1, l2, ux, uy, uz, px, py, pz, s2, p_base,
                                           g_base, cols, hi, spc,
                                           HAS_G, SQUARES, True, FTZ, MODE)
    if not PARTIAL:
        extra = tl.load(extra_ptr + b)
        offset = tl.load(offset_ptr + b)
        _epilogue(m2, l1, l2, ux, uy, uz, rows, rmask, b, N, extra, offset,
                  out0_ptr, out1_ptr, mean_ptr, qx, qy, qz, mom_ptr, pid_n,
                  tl.num_programs(0), MODE, SQUARES, MOMENTS)
    else:
        # partials laid out (B, split, 6, N), the split being the grid's second axis; only the
        # fields the merge reads are written (lse2 with squares, the means outside Sinkhorn)
        pb = part_ptr + ((b * tl.num_programs(1) + sp) * 6) * N + rows
        tl.store(pb, m2, mask=rmask)
        tl.store(pb + N, l1, mask=rmask)
        if SQUARES:
            tl.store(pb + 2 * N, l2, mask=rmask)
        if MODE != 2:
            tl.store(pb + 3 * N, ux, mask=rmask)
            tl.store(pb + 4 * N, uy, mask=rmask)
            tl.store(pb + 5 * N, uz, mask=rmask)


# Two thin kernels around one body: the loop bound CHUNK is a runtime argument on the GPU
# (one compilation for every size) and a compile-time constant under the interpreter, whose
# scalar arguments are 1-element arrays that recent NumPy refuses to use as ``range`` bounds.
# the sizes and the strides that follow them (the query's and the column offsets' batch
# strides, 3N and M) are not specialised (no compilation per size); CHUNK, a multiple of
# BLOCK_M, always specialises the same way (its divisibility keeps the point loads
# vectorised), as do the points' strides (soa pads them to multiples of 16)
@triton.jit(do_not_specialize=("N", "M", "sqb", "sgb", "slb"))
def _rows_kernel(
    q_ptr, p_ptr, T_ptr, s_ptr, g_ptr, ql_ptr, pl_ptr, extra_ptr, offset_ptr,
    out0_ptr, out1_ptr, mean_ptr, part_ptr, mom_ptr, list_ptr, count_ptr, N, M, CHUNK,
    sqb, sqn, sqc, spb, spc, sgb, slb,
    HAS_G: tl.constexpr, SQUARES: tl.constexpr, MODE: tl.constexpr,
    PARTIAL: tl.constexpr, MOMENTS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, FTZ: tl.constexpr = False, LIST: tl.constexpr = False,
    INVERT: tl.constexpr = False,
):
    _rows_body(q_ptr, p_ptr, T_ptr, s_ptr, g_ptr, ql_ptr, pl_ptr, extra_ptr, offset_ptr,
               out0_ptr, out1_ptr, mean_ptr, part_ptr, mom_ptr, list_ptr, count_ptr, N, M,
               CHUNK, sqb, sqn, sqc, spb, spc, sgb, slb,
               HAS_G, SQUARES, MODE, PARTIAL, MOMENTS, BLOCK_N, BLOCK_M, FTZ, LIST, INVERT)


@triton.jit
def _rows_kernel_const(
    q_ptr, p_ptr, T_ptr, s_ptr, g_ptr, ql_ptr, pl_ptr, extra_ptr, offset_ptr,
    out0_ptr, out1_ptr, mean_ptr, part_ptr, mom_ptr, list_ptr, count_ptr, N, M, CHUNK: tl.constexpr,
    sqb, sqn, sqc, spb, spc, sgb, slb,
    HAS_G: tl.constexpr, SQUARES: tl.constexpr, MODE: tl.constexpr,
    PARTIAL: tl.constexpr, MOMENTS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, FTZ: tl.constexpr = False, LIST: tl.constexpr = False,
    INVERT: tl.constexpr = False,
):
    _rows_body(q_ptr, p_ptr, T_ptr, s_ptr, g_ptr, ql_ptr, pl_ptr, extra_ptr, offset_ptr,
               out0_ptr, out1_ptr, mean_ptr, part_ptr, mom_ptr, list_ptr, count_ptr, N, M,
               CHUNK, sqb, sqn, sqc, spb, spc, sgb, slb,
               HAS_G, SQUARES, MODE, PARTIAL, MOMENTS, BLOCK_N, BLOCK_M, FTZ, LIST, INVERT)


@triton.jit
def _merge_body(
    part_ptr, q_ptr, ql_ptr, extra_ptr, offset_ptr, out0_ptr, out1_ptr, mean_ptr, mom_ptr, N,
    split, sqb, sqn, sqc,
    SQUARES: tl.constexpr, MODE: tl.constexpr, MOMENTS: tl.constexpr, BLOCK_N: tl.constexpr,
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
    # one pass over the partials, MERGE_GROUP at a time as a (MERGE_GROUP, BLOCK_N) tile per
    # field: a group's loads (up to six) are independent, so each group costs one memory round trip
    # (a split up to MERGE_GROUP: one, as the unrolled loads of a constant split did). The
    # running maximum m2 and the sums scaled to it are rescaled when a group raises it, as
    # the row kernel's tiles are; partials past the split are masked off
    m2 = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    l1 = tl.zeros((BLOCK_N,), tl.float32)
    l2 = tl.zeros((BLOCK_N,), tl.float32)
    ux = tl.zeros((BLOCK_N,), tl.float32)
    uy = tl.zeros((BLOCK_N,), tl.float32)
    uz = tl.zeros((BLOCK_N,), tl.float32)
    for base in range(0, split, MERGE_GROUP):
        j = base + tl.arange(0, MERGE_GROUP)
        pmask = (j < split)[:, None] & rmask[None, :]
        pb = part_ptr + ((b * split + j[:, None]) * 6) * N + rows[None, :]
        pm = tl.load(pb, mask=pmask, other=float("-inf"))
        p1 = tl.load(pb + N, mask=pmask, other=0.0)
        px = p1  # the means' partials (Sinkhorn mode has none)
        py = p1
        pz = p1
        if MODE != 2:
            px = tl.load(pb + 3 * N, mask=pmask, other=0.0)
            py = tl.load(pb + 4 * N, mask=pmask, other=0.0)
            pz = tl.load(pb + 5 * N, mask=pmask, other=0.0)
        m_new = tl.maximum(m2, tl.max(pm, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m2 - m_safe)
        a = tl.exp2(pm - m_safe[None, :])
        l1 = l1 * alpha + tl.sum(a * p1, 0)
        if SQUARES:
            p2 = tl.load(pb + 2 * N, mask=pmask, other=0.0)
            l2 = l2 * (alpha * alpha) + tl.sum(a * a * p2, 0)
        if MODE != 2:
            ux = ux * alpha + tl.sum(a * px, 0)
            uy = uy * alpha + tl.sum(a * py, 0)
            uz = uz * alpha + tl.sum(a * pz, 0)
        m2 = m_new
    extra = tl.load(extra_ptr + b)
    offset = tl.load(offset_ptr + b)
    _epilogue(m2, l1, l2, ux, uy, uz, rows, rmask, b, N, extra, offset,
              out0_ptr, out1_ptr, mean_ptr, qx, qy, qz, mom_ptr, pid_n, tl.num_programs(0),
              MODE, SQUARES, MOMENTS)


# the split is a run-time loop bound on the GPU (one compilation for every split) and a
# compile-time constant under the interpreter (see _rows_kernel_const)
@triton.jit(do_not_specialize=("N", "split", "sqb"))
def _merge_kernel(
    part_ptr, q_ptr, ql_ptr, extra_ptr, offset_ptr, out0_ptr, out1_ptr, mean_ptr, mom_ptr, N,
    split, sqb, sqn, sqc,
    SQUARES: tl.constexpr, MODE: tl.constexpr, MOMENTS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    _merge_body(part_ptr, q_ptr, ql_ptr, extra_ptr, offset_ptr, out0_ptr, out1_ptr, mean_ptr,
                mom_ptr, N, split, sqb, sqn, sqc, SQUARES, MODE, MOMENTS, BLOCK_N)


@triton.jit
def _merge_kernel_const(
    part_ptr, q_ptr, ql_ptr, extra_ptr, offset_ptr, out0_ptr, out1_ptr, mean_ptr, mom_ptr, N,
    SPLIT: tl.constexpr, sqb, sqn, sqc,
    SQUARES: tl.constexpr, MODE: tl.constexpr, MOMENTS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    _merge_body(part_ptr, q_ptr, ql_ptr, extra_ptr, offset_ptr, out0_ptr, out1_ptr, mean_ptr,
                mom_ptr, N, SPLIT, sqb, sqn, sqc, SQUARES, MODE, MOMENTS, BLOCK_N)


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


def tile_boxes(points: torch.Tensor, block: int) -> torch.Tensor:
    """Bounding boxes ``(2, B, 3, M // block)`` (lower, upper corners) of whole tiles.

    ``points``: ``(B, M, 3)`` in :func:`soa`'s layout; tile ``t`` holds points
    ``[t·block, (t + 1)·block)``; the partial last tile has none. One launch.
    """
    B, M = points.shape[:2]
    tiles = points.transpose(1, 2)[..., :M // block * block].unflatten(-1, (M // block, block))
    boxes = torch.empty((2, B, 3, M // block), dtype=torch.float32, device=points.device)
    torch.aminmax(tiles, dim=-1, out=(boxes[0], boxes[1]))
    return boxes


def rows(query, points, transform, scale, query_lengths, point_lengths, point_log_weights,
         extra, *, mode: str, squares: bool = False, offset=None, split: int | None = None,
         moments: bool = False, invert: bool = False):
    """Launch the row kernel (see module docstring); returns ``(out0, out1, mean)``.

    ``invert``: the queries move by ``transform``'s inverse (``Rᵀ (q − t)``, in the kernel).
    Mode "column" (Softassign's last column pass, ``extra`` the log slack): ``out0`` is the
    column weight ``sigmoid(lse − extra)``, and with ``moments`` ``out1`` holds the Horn
    moments of ``(mean → query, out0)``: the pose that moves the soft correspondences onto
    the queries.

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
    # without column offsets, the tiles too far to count are left out (_cull_kernel)
    cull = (point_log_weights is None and not invert and M >= CULL_MIN_POINTS
            and B * nblk * mtiles <= CULL_MAX_ENTRIES
            and os.environ.get("POINTALIGN_SOFT_CULL", "1") != "0")
    if split is None:
        if interp:
            split = 1
        else:
            # a culled pass's blocks keep unequal shares of the tiles: more, shorter programs
            # even out their ends (EM-ICP 40k at σ = 0.03 ρ: split 4 -> 27, 525 -> ~330 us)
            want = (CULL_PROGRAMS if cull else 4) * _sm_count(dev.index or 0)
            split = max(1, min(mtiles // 4, -(-want // (nblk * B)), 64))
            if not cull:  # and at most ~TILES_PER_PROGRAM tiles a program while the
                # partials stay small (H200, column offsets: 10k points x0.88, 20k x0.78,
                # 40k x0.81 a pass; 5k unchanged)
                split = max(split, min(mtiles // TILES_PER_PROGRAM, 64,
                                       PARTIAL_ROWS // max(B * N, 1)))
    split = max(1, min(int(split), mtiles))
    chunk = triton.cdiv(mtiles, split) * BLOCK_M
    part = torch.empty((B, split, 6, N), dtype=f32, device=dev) if split > 1 else out0
    kern = _rows_kernel_const if interp else _rows_kernel
    MOM = bool(moments) and MODE in (1, 3)
    n_parts = nblk if split == 1 else triton.cdiv(N, 128)
    mom = torch.empty((B, n_parts, 16), dtype=torch.float64, device=dev) if MOM else out0
    lst = count = s
    if cull:
        boxes = tile_boxes(points, BLOCK_M)
        lst = torch.empty((B, nblk, M // BLOCK_M), dtype=torch.int32, device=dev)
        count = torch.empty((B, nblk), dtype=torch.int64, device=dev)
        _cull_kernel[(nblk, B)](
            query, points, T, s, ql, pl, boxes, lst, count,
            query.stride(0), query.stride(1), query.stride(2), points.stride(0),
            points.stride(2), boxes.stride(1), boxes.stride(0), boxes.stride(2),
            lst.stride(1), CULL_BITS + math.log2(M) + 1,
            BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M, SCAN=256, num_warps=warps)
    kern[(nblk, split, B)](
        query, points, T, s, g, ql, pl, ex, off, out0, out1, mean, part, mom, lst, count,
        N, M, chunk,
        query.stride(0), query.stride(1), query.stride(2),
        points.stride(0), points.stride(2),
        g.stride(0) if point_log_weights is not None else 0, lst.stride(1) if cull else 0,
        HAS_G=point_log_weights is not None, SQUARES=SQ, MODE=MODE, PARTIAL=split > 1,
        MOMENTS=MOM, BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M, FTZ=ftz, LIST=cull, INVERT=invert,
        num_warps=warps,
    )
    if split > 1:
        (_merge_kernel_const if interp else _merge_kernel)[(triton.cdiv(N, 128), B)](
            part, query, ql, ex, off, out0, out1, mean, mom, N, split,
            query.stride(0), query.stride(1), query.stride(2),
            SQUARES=SQ, MODE=MODE, MOMENTS=MOM, BLOCK_N=128, num_warps=4,
        )
    conv = (lambda t: t.to(out_dtype)) if out_dtype != f32 else (lambda t: t)
    return (conv(out0), mom if MOM else (conv(out1) if (MODE == 0 and SQ) else None),
            conv(mean) if MODE != 2 else None)


class Inverted(NamedTuple):
    """A pose the row kernel applies inverted, ``Rᵀ (q − t)`` (:meth:`TritonPasses.inverse`)."""

    transform: torch.Tensor


def _pose(transform: torch.Tensor | Inverted) -> tuple[torch.Tensor, bool]:
    """``(T, invert)`` for the row kernel from a pose or an :class:`Inverted` one."""
    if isinstance(transform, Inverted):
        return transform.transform, True
    return transform, False


@dataclass(frozen=True)
class TritonPasses(Passes):
    """The exact passes as the row kernel above (:func:`rows`), one launch or two each.

    Arguments and results as :class:`~pointalign.kernels.soft.reference.Passes`; the
    Softassign update and the fitness pass are its loops over these passes.
    """

    def soft_rows(self, query, points, transform, scale, query_lengths=None,
                  point_lengths=None, *, point_log_weights=None, squares=False,
                  offset=None) -> SoftRows:
        """Row reductions, mode "raw" (``offset``: the exact form ignores it)."""
        ql, pl = lengths_or_all(query_lengths, query), lengths_or_all(point_lengths, points)
        T, invert = _pose(transform)
        lse, lse2, mean = rows(query, points, T, scale, ql, pl, point_log_weights, None,
                               mode="raw", squares=squares, invert=invert)
        return SoftRows(lse, lse2, mean)

    def emicp_rows(self, source, target, transform, scale, log_outlier, source_lengths=None,
                   target_lengths=None):
        """EM-ICP's ``(λ, x')``, mode "emicp"."""
        sl, tl = lengths_or_all(source_lengths, source), lengths_or_all(target_lengths, target)
        w, _, mean = rows(source, target, transform, scale, sl, tl, None, log_outlier,
                          mode="emicp", squares=True)
        return w, mean

    def emicp_step(self, source, target, transform, scale, log_outlier, frozen,
                   source_lengths=None, target_lengths=None):
        """Write each row block's Horn moments in the row kernels; solve Horn in one more."""
        from pointalign.kernels.horn import triton as _horn_triton

        sl, tl = lengths_or_all(source_lengths, source), lengths_or_all(target_lengths, target)
        lam, mom, _ = rows(source, target, transform, scale, sl, tl, None, log_outlier,
                           mode="emicp", squares=True, moments=True)
        T, valid = _horn_triton.horn_from_parts(mom, transform.to(torch.float64), frozen)
        return T, valid, lam

    def sinkhorn_scaling(self, query, points, transform, beta, point_log_weights, log_slack,
                         offset, query_lengths=None, point_lengths=None) -> torch.Tensor:
        """One Sinkhorn half-step, mode "sinkhorn" (the normalisation in the epilogue)."""
        ql, pl = lengths_or_all(query_lengths, query), lengths_or_all(point_lengths, points)
        T, invert = _pose(transform)
        return rows(query, points, T, beta.to(query.dtype), ql, pl, point_log_weights,
                    log_slack, mode="sinkhorn", offset=offset, invert=invert)[0]

    def softassign_step(self, source, target, transform, beta, offset, log_slack, frozen,
                        source_lengths, target_lengths, rounds: int):
        """Run the update's passes; the last column pass writes the weights and Horn's moments.

        One tiny kernel solves Horn from them (:func:`horn_from_parts`): no separate pass
        over the correspondences, no weight or masking launches per iteration.
        """
        from pointalign.kernels.horn import triton as _horn_triton

        sl = lengths_or_all(source_lengths, source)
        tl_ = lengths_or_all(target_lengths, target)
        g_row = softassign_row_scalings(self, source, target, transform, beta, offset,
                                        log_slack, sl, tl_, rounds)
        w, mom, _ = rows(target, source, transform, beta.to(target.dtype), tl_, sl, g_row,
                         log_slack, mode="column", offset=offset, moments=True, invert=True)
        T, valid = _horn_triton.horn_from_parts(mom, transform.to(torch.float64), frozen)
        return T, valid, w

    def inverse(self, transform: torch.Tensor) -> Inverted:
        """T⁻¹ as these passes take it: T marked :class:`Inverted`, inverted in the kernel."""
        return Inverted(transform)
