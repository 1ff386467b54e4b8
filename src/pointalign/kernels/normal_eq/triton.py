"""Triton kernel for :mod:`pointalign.kernels.normal_eq` (private; see its contract).

One program reduces ``BLOCK`` source rows of one batch entry: it gathers the
corresponding target point (and normal), forms the robust weight and the 30 per-row terms,
sums them in float32 registers and writes one partial row. A second tiny reduction sums the
``(B, P, 30)`` partials in float64 on the device (deterministic; no atomics).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from pointalign.kernels import _tl_math as tm
from pointalign.kernels.normal_eq.reference import KERNELS, WIDTH

BLOCK = 256


@triton.jit
def _normal_eq_body(x_ptr, y_ptr, n_ptr, idx_ptr, len_ptr, c_ptr, out_ptr, N, M, P, scale,
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
        w = tm.robust_weight(r, scale, KIND) * vf
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
        w = tm.robust_weight(tl.sqrt(dd), scale, KIND) * vf
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


@triton.jit  # one problem: its sizes rounded to 16 (see _launch), one compiled variant
def _normal_eq_kernel(x_ptr, y_ptr, n_ptr, idx_ptr, len_ptr, c_ptr, out_ptr, N, M, P, scale,
                      PLANE: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr):
    _normal_eq_body(x_ptr, y_ptr, n_ptr, idx_ptr, len_ptr, c_ptr, out_ptr, N, M, P, scale,
                    PLANE, KIND, BLOCK)


# a batch: its sizes are the problems' strides and are not specialised (divisible by 16 or
# not), so that a batch of any sizes runs one compiled variant (each new size class compiled
# one, ~1 s, inside a user's call)
@triton.jit(do_not_specialize=("N", "M", "P"))
def _normal_eq_batch_kernel(x_ptr, y_ptr, n_ptr, idx_ptr, len_ptr, c_ptr, out_ptr, N, M, P,
                            scale, PLANE: tl.constexpr, KIND: tl.constexpr,
                            BLOCK: tl.constexpr):
    _normal_eq_body(x_ptr, y_ptr, n_ptr, idx_ptr, len_ptr, c_ptr, out_ptr, N, M, P, scale,
                    PLANE, KIND, BLOCK)


def _launch(B: int, P: int, *args: Any, **meta: Any) -> None:
    """Launch the partials kernel on grid (P, B): ``args`` end with N, M, P and the scale.

    N, M and P only scale the problem index b. For one problem (b = 0, the strides never
    read) they are rounded up to 16 and stay specialised (the divisible variant, one for
    every size); a batch takes the kernel that does not specialise them.
    """
    *head, N, M, P_, scale = args
    if B > 1:
        _normal_eq_batch_kernel[(P, B)](*head, N, M, P_, scale, **meta)
    else:
        N, M, P_ = (-(-s // 16) * 16 for s in (N, M, P_))
        _normal_eq_kernel[(P, B)](*head, N, M, P_, scale, **meta)


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
    _launch(B, P, x, y, n, ix, ln, c, partial, N, M, P, float(scale),
            PLANE=target_normals is not None, KIND=KERNELS.index(kernel), BLOCK=BLOCK,
            num_warps=4)
    return partial.sum(1, dtype=torch.float64)


# ---- the solve: partial sums -> update, on the device (no host round trip) ----------------
#
# The (P, 30) float32 block partials are summed in float64 (one torch reduction), then one
# program per batch entry solves in float64 with the scalar helpers of ``_tl_math`` (the
# twins of ``pointalign._math``): Horn's pose from the moments plus the degeneracy rule
# (point-to-point) or the least-norm 6×6 solve by cyclic Jacobi and Rodrigues
# (point-to-plane). The spec is ``normal_eq.solve_update_reference``.

#: Jacobi sweeps of the 6×6 solve (quadratic convergence: 8 reach float64 round-off)
_SWEEPS6 = 8
#: squarings of Horn's 4×4 (top eigenvector; converges for gaps above ~1e-11 ‖N‖)
_SQUARINGS = 40


@triton.jit
def _solve_kernel(sums_ptr, c_ptr, tin_ptr, d_ptr, tn_ptr, tf_ptr, flag_ptr, eps,
                  PLANE: tl.constexpr, SWEEPS: tl.constexpr = 8,
                  SQUARINGS: tl.constexpr = 40):
    b = tl.program_id(0).to(tl.int64)
    s = [tl.load(sums_ptr + b * 30 + k)
         for k in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                   21, 22, 23, 24, 25, 26, 27, 28, 29)]
    c0 = tl.load(c_ptr + b * 3 + 0).to(tl.float64)
    c1 = tl.load(c_ptr + b * 3 + 1).to(tl.float64)
    c2 = tl.load(c_ptr + b * 3 + 2).to(tl.float64)
    if PLANE:
        # the symmetric 6×6 from its upper triangle (row-major TRIU6 positions)
        A = [s[m] for m in (0, 1, 2, 3, 4, 5, 1, 6, 7, 8, 9, 10, 2, 7, 11, 12, 13, 14,
                            3, 8, 12, 15, 16, 17, 4, 9, 13, 16, 18, 19,
                            5, 10, 14, 17, 19, 20)]
        g = [-s[21 + k] for k in (0, 1, 2, 3, 4, 5)]
        xi, valid, usable = tm.least_norm_solve6(A, g, eps, SWEEPS)
        R = tm.so3_exp(xi[0], xi[1], xi[2])
        t = (xi[3], xi[4], xi[5])
    else:
        W = s[0]
        R, t, ok = tm.horn_pose(W, (s[1], s[2], s[3]), (s[4], s[5], s[6]),
                                (s[7], s[8], s[9], s[10], s[11], s[12], s[13], s[14], s[15]),
                                0.0, SQUARINGS)
        # the centred covariances Σ w x̃ x̃ᵀ − Σwx̃ Σwx̃ᵀ / W (upper triangles)
        Wd = tl.maximum(W, 1e-300)
        valid = ok & tm.spans_plane(s[16] - s[1] * s[1] / Wd, s[17] - s[1] * s[2] / Wd,
                                    s[18] - s[1] * s[3] / Wd, s[19] - s[2] * s[2] / Wd,
                                    s[20] - s[2] * s[3] / Wd, s[21] - s[3] * s[3] / Wd, eps)
        valid = valid & tm.spans_plane(s[22] - s[4] * s[4] / Wd, s[23] - s[4] * s[5] / Wd,
                                       s[24] - s[4] * s[6] / Wd, s[25] - s[5] * s[5] / Wd,
                                       s[26] - s[5] * s[6] / Wd, s[27] - s[6] * s[6] / Wd, eps)
        R, t = tm.mask_pose(valid, R, t)
        usable = valid
    # un-centre (x ↦ R (x − c) + t + c), compose with T, store
    D = (R[0], R[1], R[2], t[0] + c0 - (R[0] * c0 + R[1] * c1 + R[2] * c2),
         R[3], R[4], R[5], t[1] + c1 - (R[3] * c0 + R[4] * c1 + R[5] * c2),
         R[6], R[7], R[8], t[2] + c2 - (R[6] * c0 + R[7] * c1 + R[8] * c2))
    for i in tl.static_range(4):
        for j in tl.static_range(4):
            Tij = tl.load(tin_ptr + b * 16 + 12 + j)
            if i < 3:
                Tij = D[4 * i] * tl.load(tin_ptr + b * 16 + j) \
                    + D[4 * i + 1] * tl.load(tin_ptr + b * 16 + 4 + j) \
                    + D[4 * i + 2] * tl.load(tin_ptr + b * 16 + 8 + j) \
                    + D[4 * i + 3] * Tij
                tl.store(d_ptr + b * 16 + 4 * i + j, D[4 * i + j])
            else:
                if j == 3:
                    tl.store(d_ptr + b * 16 + 4 * i + j, c0 * 0.0 + 1.0)
                else:
                    tl.store(d_ptr + b * 16 + 4 * i + j, c0 * 0.0)
            tl.store(tn_ptr + b * 16 + 4 * i + j, Tij)
            tl.store(tf_ptr + b * 16 + 4 * i + j, Tij.to(tl.float32))
    tl.store(flag_ptr + b * 2 + 0, valid.to(tl.int32))
    tl.store(flag_ptr + b * 2 + 1, usable.to(tl.int32))


def partials_triton(source, target, idx, target_normals, lengths, center, kernel, scale):
    """Return the ``(B, P, 30)`` float32 block partials of :func:`normal_equations_triton`."""
    B, N = source.shape[:2]
    M = target.shape[1]
    n = target_normals if target_normals is not None else target
    P = max(1, triton.cdiv(N, BLOCK))
    partial = torch.empty(B, P, WIDTH, dtype=torch.float32, device=source.device)
    _launch(B, P, source, target, n, idx, lengths, center, partial, N, M, P, float(scale),
            PLANE=target_normals is not None, KIND=KERNELS.index(kernel), BLOCK=BLOCK,
            num_warps=4)
    return partial


def icp_update_triton(source, target, idx, target_normals, lengths, center, kernel, scale,
                      transform, eps, out):
    """Reduce and solve on the device: writes ``out = (sums, D, T_new, T_new_f32, flags)``.

    Inputs must be contiguous, ``lengths`` int64, ``center`` float32, ``transform (B, 4, 4)``
    float64 (not aliased with ``out``). Three launches, no synchronisation.
    """
    partial = partials_triton(source, target, idx, target_normals, lengths, center, kernel,
                              scale)
    B = partial.shape[0]
    sums, D, Tn, Tf, flags = out
    torch.sum(partial, 1, dtype=torch.float64, out=sums)
    _solve_kernel[(B,)](sums, center, transform, D, Tn, Tf, flags, float(eps),
                        PLANE=target_normals is not None, SWEEPS=_SWEEPS6,
                        SQUARINGS=_SQUARINGS, num_warps=1)
    return out
