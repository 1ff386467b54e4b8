"""Triton kernel for :func:`pointalign.kernels.surface.newton_terms` (same contract).

One point per lane, ``BLOCK`` points per program: transform the source point, descend the
k-d tree to level ``depth`` (the split planes only, no backtracking), load the node's 10
approximant coefficients, form the 21 + 6 + 2 terms, reduce them over the block in fp32 and
write one row of partial sums per program; the rows are summed in float64 afterwards
(deterministic, no atomics).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pointalign.kernels.surface.reference import N_TERMS

BIG = 3.0e38


@triton.jit
def _terms_kernel(x_ptr, w_ptr, axis_ptr, split_ptr, co_ptr, part_ptr, n,
                  r00, r01, r02, r10, r11, r12, r20, r21, r22, t0, t1, t2, o0, o1, o2,
                  tau2, DEPTH: tl.constexpr,
                  HAS_W: tl.constexpr, OBJ_ONLY: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x0 = tl.load(x_ptr + offs * 3 + 0, mask=m, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + offs * 3 + 1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs * 3 + 2, mask=m, other=0.0).to(tl.float32)
    qx = r00 * x0 + r01 * x1 + r02 * x2 + t0
    qy = r10 * x0 + r11 * x1 + r12 * x2 + t1
    qz = r20 * x0 + r21 * x1 + r22 * x2 + t2
    node = tl.zeros((BLOCK,), dtype=tl.int64)
    for _ in range(DEPTH):
        ax = tl.load(axis_ptr + node, mask=m, other=0)
        sv = tl.load(split_ptr + node, mask=m, other=0.0).to(tl.float32)
        qa = tl.where(ax == 0, qx, tl.where(ax == 1, qy, qz))
        node = 2 * node + 1 + (qa >= sv).to(tl.int64)
    cb = co_ptr + node * 10
    a00 = tl.load(cb + 0, mask=m, other=0.0)
    a01 = tl.load(cb + 1, mask=m, other=0.0)
    a02 = tl.load(cb + 2, mask=m, other=0.0)
    a11 = tl.load(cb + 3, mask=m, other=0.0)
    a12 = tl.load(cb + 4, mask=m, other=0.0)
    a22 = tl.load(cb + 5, mask=m, other=0.0)
    b0 = tl.load(cb + 6, mask=m, other=0.0)
    b1 = tl.load(cb + 7, mask=m, other=0.0)
    b2 = tl.load(cb + 8, mask=m, other=0.0)
    c = tl.load(cb + 9, mask=m, other=0.0)
    # A q - b (half the gradient of d^2), and h = q.(Aq) - 2 b.q + c
    ax_ = a00 * qx + a01 * qy + a02 * qz
    ay_ = a01 * qx + a11 * qy + a12 * qz
    az_ = a02 * qx + a12 * qy + a22 * qz
    h = qx * ax_ + qy * ay_ + qz * az_ - 2.0 * (b0 * qx + b1 * qy + b2 * qz) + c
    h = tl.maximum(h, 0.0)
    if HAS_W:
        wt = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    else:
        wt = m.to(tl.float32)
    wt = tl.where(m, wt, 0.0)
    inl = h <= tau2
    w = tl.where(inl, wt, 0.0)
    base = part_ptr + pid * 29
    tl.store(base + 27, tl.sum(wt * tl.minimum(h, tau2), axis=0))
    tl.store(base + 28, tl.sum((w > 0).to(tl.float32), axis=0))
    if not OBJ_ONLY:
        gx = ax_ - b0
        gy = ay_ - b1
        gz = az_ - b2
        px = qx - o0
        py = qy - o1
        pz = qz - o2
        # u_i = A m_i with m_0 = e1 x p, m_1 = e2 x p, m_2 = e3 x p
        u0x = a02 * py - a01 * pz
        u0y = a12 * py - a11 * pz
        u0z = a22 * py - a12 * pz
        u1x = a00 * pz - a02 * px
        u1y = a01 * pz - a12 * px
        u1z = a02 * pz - a22 * px
        u2x = a01 * px - a00 * py
        u2y = a11 * px - a01 * py
        u2z = a12 * px - a02 * py
        # F_rr[i][j] = m_i . u_j
        tl.store(base + 0, tl.sum(w * (py * u0z - pz * u0y), axis=0))
        tl.store(base + 1, tl.sum(w * (py * u1z - pz * u1y), axis=0))
        tl.store(base + 2, tl.sum(w * (py * u2z - pz * u2y), axis=0))
        tl.store(base + 3, tl.sum(w * u0x, axis=0))
        tl.store(base + 4, tl.sum(w * u0y, axis=0))
        tl.store(base + 5, tl.sum(w * u0z, axis=0))
        tl.store(base + 6, tl.sum(w * (pz * u1x - px * u1z), axis=0))
        tl.store(base + 7, tl.sum(w * (pz * u2x - px * u2z), axis=0))
        tl.store(base + 8, tl.sum(w * u1x, axis=0))
        tl.store(base + 9, tl.sum(w * u1y, axis=0))
        tl.store(base + 10, tl.sum(w * u1z, axis=0))
        tl.store(base + 11, tl.sum(w * (px * u2y - py * u2x), axis=0))
        tl.store(base + 12, tl.sum(w * u2x, axis=0))
        tl.store(base + 13, tl.sum(w * u2y, axis=0))
        tl.store(base + 14, tl.sum(w * u2z, axis=0))
        tl.store(base + 15, tl.sum(w * a00, axis=0))
        tl.store(base + 16, tl.sum(w * a01, axis=0))
        tl.store(base + 17, tl.sum(w * a02, axis=0))
        tl.store(base + 18, tl.sum(w * a11, axis=0))
        tl.store(base + 19, tl.sum(w * a12, axis=0))
        tl.store(base + 20, tl.sum(w * a22, axis=0))
        # g = -(p x a, a)
        tl.store(base + 21, tl.sum(w * (pz * gy - py * gz), axis=0))
        tl.store(base + 22, tl.sum(w * (px * gz - pz * gx), axis=0))
        tl.store(base + 23, tl.sum(w * (py * gx - px * gy), axis=0))
        tl.store(base + 24, tl.sum(-w * gx, axis=0))
        tl.store(base + 25, tl.sum(-w * gy, axis=0))
        tl.store(base + 26, tl.sum(-w * gz, axis=0))


def newton_terms(points, T, center, tree, coeffs, depth, *, weights=None, tau2=math.inf,
                 objective_only=False, block: int | None = None) -> torch.Tensor:
    """Launcher; see :func:`pointalign.kernels.surface.newton_terms`."""
    x = points.contiguous()
    n = x.shape[0]
    dev = x.device
    if block is None:
        block = 1024 if x.is_cuda else 64
    nprog = max(1, triton.cdiv(n, block))
    part = torch.zeros((nprog, N_TERMS), dtype=torch.float32, device=dev)
    if n == 0:
        return part.sum(0).double()
    Th = T.detach().double().cpu().tolist()
    o = center.detach().double().cpu().tolist()
    co = coeffs.to(torch.float32).contiguous()
    w = weights.contiguous() if weights is not None else x
    d = max(0, min(int(depth), tree.depth))
    _terms_kernel[(nprog,)](
        x, w, tree.split_axis, tree.split_value, co, part, n,
        Th[0][0], Th[0][1], Th[0][2], Th[1][0], Th[1][1], Th[1][2], Th[2][0], Th[2][1],
        Th[2][2], Th[0][3], Th[1][3], Th[2][3], o[0], o[1], o[2],
        min(float(tau2), BIG), DEPTH=d,
        HAS_W=weights is not None, OBJ_ONLY=bool(objective_only), BLOCK=block,
        num_warps=8 if block >= 1024 else 4,
    )
    return part.double().sum(0)
