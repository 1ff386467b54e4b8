"""Triton kernels of ``kernels/horn.py`` (private; see its contract).

One program per batch entry reduces the weighted moments in float64 (or sums the per-block
moments written by the EM-ICP row kernels) and solves with ``_tl_math.horn_pose``: Horn's
4×4 matrix as 10 scalars per thread (no shuffles), its top eigenvector by 40 squarings of
the shifted, positive semi-definite matrix (no eigh, no host sync), then the pose. A
cross-covariance that is only rounding noise of the moments (one point, coincident points)
counts as 0, and the εI tie-breaker ``_math.HORN_TIE`` resolves ties towards R = I (as the
reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pointalign import _math
from pointalign.kernels import _tl_math as tm

#: the εI tie-breaker of the family (``_math.HORN_TIE``)
_TIE = tl.constexpr(_math.HORN_TIE)
#: problems of at most this many points run one warp each (a 256-wide block of four warps
#: would idle on them)
SMALL_N = 32


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

    Uses ``_tl_math.horn_pose`` with the tie-breaker ``_math.HORN_TIE``.

    Writes ``T (4, 4)`` and ``valid``. With ``KEEP``, an entry that is invalid or
    ``frozen`` gets ``Told`` instead of the identity / the new pose.
    """
    R, t, ok = tm.horn_pose(W, (sx0, sx1, sx2), (sm0, sm1, sm2),
                            (c00s, c01s, c02s, c10s, c11s, c12s, c20s, c21s, c22s),
                            _TIE, SQUARINGS)
    k16 = tl.arange(0, 16)
    T = tl.where(k16 == 0, R[0], 0.0) + tl.where(k16 == 1, R[1], 0.0) \
        + tl.where(k16 == 2, R[2], 0.0) + tl.where(k16 == 3, t[0], 0.0) \
        + tl.where(k16 == 4, R[3], 0.0) + tl.where(k16 == 5, R[4], 0.0) \
        + tl.where(k16 == 6, R[5], 0.0) + tl.where(k16 == 7, t[1], 0.0) \
        + tl.where(k16 == 8, R[6], 0.0) + tl.where(k16 == 9, R[7], 0.0) \
        + tl.where(k16 == 10, R[8], 0.0) + tl.where(k16 == 11, t[2], 0.0) \
        + tl.where(k16 == 15, 1.0, 0.0)
    if KEEP:
        new_pose = ok & (tl.load(frozen_ptr + b) == 0)
        T = tl.where(new_pose, T, tl.load(Told_ptr + b * 16 + k16))
    tl.store(T_ptr + b * 16 + k16, T)
    tl.store(valid_ptr + b, ok.to(tl.int8))


@triton.jit(do_not_specialize=("n_parts",))  # follows N: no compilation per size
def _horn_parts_kernel(mom_ptr, n_parts, T_ptr, valid_ptr, Told_ptr, frozen_ptr,
                       SQUARINGS: tl.constexpr, BLOCK: tl.constexpr):
    """Horn from per-block moments ``(B, n_parts, 16)`` (float64).

    The moments are written by the row kernels' EM-ICP epilogue; frozen or invalid entries
    keep ``Told``.
    """
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


# sizes and outer strides not specialised (divisible by 16 or not): one compilation serves
# every hypothesis batch (four were compiled in a first register(), about 1 s each)
@triton.jit(do_not_specialize=("N", "sxb", "sxn", "smb", "smn", "swb"))
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
    """Weighted Horn per batch entry (see :func:`pointalign.kernels.horn.weighted_horn`)."""
    B, N = source.shape[0], source.shape[1]
    dev = source.device
    T = torch.empty((B, 4, 4), dtype=torch.float64, device=dev)
    valid = torch.empty((B,), dtype=torch.int8, device=dev)
    if dev.type != "cuda":
        kern, BLOCK, warps = _horn_kernel_const, 64, 4
    elif N <= SMALL_N:  # RANSAC's triangles: one warp a problem (2,000 of 3 points on an
        kern, BLOCK, warps = _horn_kernel, SMALL_N, 1  # H200: 63 -> 17 us)
    else:
        kern, BLOCK, warps = _horn_kernel, 256, 4
    kern[(B,)](
        source, targets, weights, T, valid, N,
        source.stride(0), source.stride(1), source.stride(2),
        targets.stride(0), targets.stride(1), targets.stride(2),
        weights.stride(0), weights.stride(1),
        SQUARINGS=40, BLOCK=BLOCK, num_warps=warps,
    )
    return T, valid.bool()
