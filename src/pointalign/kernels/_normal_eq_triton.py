"""Triton kernel for :mod:`pointalign.kernels.normal_eq` (private; see its contract).

One program reduces ``BLOCK`` source rows of one batch entry: it gathers the
corresponding target point (and normal), forms the robust weight and the 30 per-row terms,
sums them in float32 registers and writes one partial row. A second tiny reduction sums the
``(B, P, 30)`` partials in float64 on the device (deterministic; no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pointalign.kernels.normal_eq import KERNELS, WIDTH

BLOCK = 256


@triton.jit
def _weight(r, scale, KIND: tl.constexpr):
    a = tl.abs(r)
    if KIND == 0:
        w = tl.full(a.shape, 1.0, tl.float32)
    elif KIND == 1:
        w = tl.where(a <= scale, 1.0, scale / tl.maximum(a, 1e-30))
    elif KIND == 2:
        u = a / scale
        w = tl.where(a < scale, (1.0 - u * u) * (1.0 - u * u), 0.0)
    else:
        u = a / scale
        w = 1.0 / (1.0 + u * u)
    return w


@triton.jit
def _normal_eq_kernel(x_ptr, y_ptr, n_ptr, idx_ptr, len_ptr, c_ptr, out_ptr,
                      N, M, P, scale,
                      PLANE: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    L = tl.load(len_ptr + b)
    inb = offs < L
    j = tl.load(idx_ptr + b * N + offs, mask=inb, other=-1)
    valid = inb & (j >= 0)
    j = tl.where(valid, j, 0)
    c0 = tl.load(c_ptr + b * 3 + 0).to(tl.float32)
    c1 = tl.load(c_ptr + b * 3 + 1).to(tl.float32)
    c2 = tl.load(c_ptr + b * 3 + 2).to(tl.float32)
    xb = x_ptr + b * N * 3 + offs * 3
    yb = y_ptr + b * M * 3 + j * 3
    x0 = tl.where(valid, tl.load(xb + 0, mask=valid, other=0.0).to(tl.float32) - c0, 0.0)
    x1 = tl.where(valid, tl.load(xb + 1, mask=valid, other=0.0).to(tl.float32) - c1, 0.0)
    x2 = tl.where(valid, tl.load(xb + 2, mask=valid, other=0.0).to(tl.float32) - c2, 0.0)
    y0 = tl.where(valid, tl.load(yb + 0, mask=valid, other=0.0).to(tl.float32) - c0, 0.0)
    y1 = tl.where(valid, tl.load(yb + 1, mask=valid, other=0.0).to(tl.float32) - c1, 0.0)
    y2 = tl.where(valid, tl.load(yb + 2, mask=valid, other=0.0).to(tl.float32) - c2, 0.0)
    d0 = x0 - y0
    d1 = x1 - y1
    d2 = x2 - y2
    dd = d0 * d0 + d1 * d1 + d2 * d2
    vf = tl.where(valid, 1.0, 0.0)
    o = out_ptr + (b * P + pid) * 30
    if PLANE:
        nb = n_ptr + b * M * 3 + j * 3
        n0 = tl.load(nb + 0, mask=valid, other=0.0).to(tl.float32)
        n1 = tl.load(nb + 1, mask=valid, other=0.0).to(tl.float32)
        n2 = tl.load(nb + 2, mask=valid, other=0.0).to(tl.float32)
        r = n0 * d0 + n1 * d1 + n2 * d2
        w = _weight(r, scale, KIND) * vf
        # J = [x̃ × n, n]
        j0 = x1 * n2 - x2 * n1
        j1 = x2 * n0 - x0 * n2
        j2 = x0 * n1 - x1 * n0
        w0 = w * j0
        w1 = w * j1
        w2 = w * j2
        w3 = w * n0
        w4 = w * n1
        w5 = w * n2
        tl.store(o + 0, tl.sum(w0 * j0, 0))
        tl.store(o + 1, tl.sum(w0 * j1, 0))
        tl.store(o + 2, tl.sum(w0 * j2, 0))
        tl.store(o + 3, tl.sum(w0 * n0, 0))
        tl.store(o + 4, tl.sum(w0 * n1, 0))
        tl.store(o + 5, tl.sum(w0 * n2, 0))
        tl.store(o + 6, tl.sum(w1 * j1, 0))
        tl.store(o + 7, tl.sum(w1 * j2, 0))
        tl.store(o + 8, tl.sum(w1 * n0, 0))
        tl.store(o + 9, tl.sum(w1 * n1, 0))
        tl.store(o + 10, tl.sum(w1 * n2, 0))
        tl.store(o + 11, tl.sum(w2 * j2, 0))
        tl.store(o + 12, tl.sum(w2 * n0, 0))
        tl.store(o + 13, tl.sum(w2 * n1, 0))
        tl.store(o + 14, tl.sum(w2 * n2, 0))
        tl.store(o + 15, tl.sum(w3 * n0, 0))
        tl.store(o + 16, tl.sum(w3 * n1, 0))
        tl.store(o + 17, tl.sum(w3 * n2, 0))
        tl.store(o + 18, tl.sum(w4 * n1, 0))
        tl.store(o + 19, tl.sum(w4 * n2, 0))
        tl.store(o + 20, tl.sum(w5 * n2, 0))
        tl.store(o + 21, tl.sum(w0 * r, 0))
        tl.store(o + 22, tl.sum(w1 * r, 0))
        tl.store(o + 23, tl.sum(w2 * r, 0))
        tl.store(o + 24, tl.sum(w3 * r, 0))
        tl.store(o + 25, tl.sum(w4 * r, 0))
        tl.store(o + 26, tl.sum(w5 * r, 0))
        tl.store(o + 27, tl.sum(w * r * r, 0))
    else:
        w = _weight(tl.sqrt(dd), scale, KIND) * vf
        wx0 = w * x0
        wx1 = w * x1
        wx2 = w * x2
        wy0 = w * y0
        wy1 = w * y1
        wy2 = w * y2
        tl.store(o + 0, tl.sum(w, 0))
        tl.store(o + 1, tl.sum(wx0, 0))
        tl.store(o + 2, tl.sum(wx1, 0))
        tl.store(o + 3, tl.sum(wx2, 0))
        tl.store(o + 4, tl.sum(wy0, 0))
        tl.store(o + 5, tl.sum(wy1, 0))
        tl.store(o + 6, tl.sum(wy2, 0))
        tl.store(o + 7, tl.sum(wx0 * y0, 0))
        tl.store(o + 8, tl.sum(wx0 * y1, 0))
        tl.store(o + 9, tl.sum(wx0 * y2, 0))
        tl.store(o + 10, tl.sum(wx1 * y0, 0))
        tl.store(o + 11, tl.sum(wx1 * y1, 0))
        tl.store(o + 12, tl.sum(wx1 * y2, 0))
        tl.store(o + 13, tl.sum(wx2 * y0, 0))
        tl.store(o + 14, tl.sum(wx2 * y1, 0))
        tl.store(o + 15, tl.sum(wx2 * y2, 0))
        tl.store(o + 16, tl.sum(wx0 * x0, 0))
        tl.store(o + 17, tl.sum(wx0 * x1, 0))
        tl.store(o + 18, tl.sum(wx0 * x2, 0))
        tl.store(o + 19, tl.sum(wx1 * x1, 0))
        tl.store(o + 20, tl.sum(wx1 * x2, 0))
        tl.store(o + 21, tl.sum(wx2 * x2, 0))
        tl.store(o + 22, tl.sum(wy0 * y0, 0))
        tl.store(o + 23, tl.sum(wy0 * y1, 0))
        tl.store(o + 24, tl.sum(wy0 * y2, 0))
        tl.store(o + 25, tl.sum(wy1 * y1, 0))
        tl.store(o + 26, tl.sum(wy1 * y2, 0))
        tl.store(o + 27, tl.sum(wy2 * y2, 0))
    tl.store(o + 28, tl.sum(vf, 0))
    tl.store(o + 29, tl.sum(dd * vf, 0))


def normal_equations_triton(source: torch.Tensor, target: torch.Tensor, idx: torch.Tensor,
                            target_normals: torch.Tensor | None, lengths: torch.Tensor,
                            center: torch.Tensor, kernel: str, scale: float) -> torch.Tensor:
    """Launcher: contiguous inputs, grid (ceil(N / BLOCK), B), float64 sum of the partials."""
    B, N = source.shape[:2]
    M = target.shape[1]
    x = source.contiguous()
    y = target.contiguous()
    n = target_normals.contiguous() if target_normals is not None else y
    ix = idx.contiguous()
    ln = lengths.to(torch.int64).contiguous()
    c = center.to(torch.float32).contiguous()
    P = max(1, triton.cdiv(N, BLOCK))
    partial = torch.empty(B, P, WIDTH, dtype=torch.float32, device=source.device)
    _normal_eq_kernel[(P, B)](
        x, y, n, ix, ln, c, partial, N, M, P, float(scale),
        PLANE=target_normals is not None, KIND=KERNELS.index(kernel), BLOCK=BLOCK,
        num_warps=4)
    return partial.sum(1, dtype=torch.float64)
