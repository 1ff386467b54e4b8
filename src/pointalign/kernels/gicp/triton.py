"""Triton kernels of the GICP family (private; contracts in :mod:`pointalign.kernels.gicp`).

* ``_covariance_kernel``: one lane per point walks its neighbour row twice (mean, then
  covariance, float64), applies the degeneracy rule (``_tl_math.spans_plane``), finds the
  smallest eigenvector in closed form (the steps of the normals kernel in
  ``kernels/features/triton.py``: Smith's eigenvalues by Newton on the characteristic
  cubic, the null vector of ``A − λI``, the orthogonal fallback) and writes
  ``I − (1 − ε) n nᵀ`` (or the fallback I).
* ``_sums_kernel``: one program reduces ``BLOCK`` source rows of one batch entry: it turns
  each row's covariance by R once, then for each of the S partner slots gathers the target
  point and covariance, inverts the combined covariance by its adjugate, forms the robust
  weight and the 28 terms of the pair, accumulates in float32 registers and writes one
  ``(30,)`` partial row; the partials are added in float64 by one torch reduction
  (deterministic; no atomics). Offsets are int64; every load is masked.
* The 6×6 solve is ``normal_eq``'s device solve (``_solve_kernel``, point-to-plane mode):
  the GICP sums share its layout.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pointalign import _math
from pointalign.kernels import _tl_math as tm
from pointalign.kernels.features.triton import _cross, _null_vector, neighbour_scatter
from pointalign.kernels.gicp.reference import KERNELS, MIN_NEIGHBOURS, ROBUST_SCALE2, WIDTH
from pointalign.kernels.normal_eq.triton import _SQUARINGS, _SWEEPS6, _solve_kernel

BLOCK = 128
COV_BLOCK = 128
#: Newton steps of the extreme eigenvalues (as the normals kernel)
NEWTON_STEPS = 64


@triton.jit
def _smallest_eigenvector3(a00, a01, a02, a11, a12, a22, NEWTON_STEPS: tl.constexpr):
    """``_math.smallest_eigenvector3`` of one symmetric 3×3 per lane (float64 blocks)."""
    s = tl.maximum(tl.maximum(tl.maximum(tl.abs(a00), tl.abs(a01)),
                              tl.maximum(tl.abs(a02), tl.abs(a11))),
                   tl.maximum(tl.abs(a12), tl.abs(a22)))
    s = tl.where(s > 0, s, 1.0)
    a00 = a00 / s
    a01 = a01 / s
    a02 = a02 / s
    a11 = a11 / s
    a12 = a12 / s
    a22 = a22 / s
    q = (a00 + a11 + a22) / 3
    b00 = a00 - q
    b11 = a11 - q
    b22 = a22 - q
    p2 = b00 * b00 + b11 * b11 + b22 * b22 + 2 * (a01 * a01 + a02 * a02 + a12 * a12)
    p = tl.sqrt(p2 / 6)
    ps = tl.where(p > 0, p, 1.0)
    c00 = b00 / ps
    c11 = b11 / ps
    c22 = b22 / ps
    c01 = a01 / ps
    c02 = a02 / ps
    c12 = a12 / ps
    det = (c00 * (c11 * c22 - c12 * c12) - c01 * (c01 * c22 - c12 * c02)
           + c02 * (c01 * c12 - c11 * c02))
    # the roots 2cos(φ + 2πk/3) of x³ − 3x − det: Newton from ±2 reaches the extreme ones
    cdet = tl.minimum(tl.maximum(det, -2.0), 2.0)
    x_lo = q * 0 - 2.0
    x_hi = q * 0 + 2.0
    for _ in range(NEWTON_STEPS):
        d_lo = tl.maximum(3 * x_lo * x_lo - 3, 1e-300)
        d_hi = tl.maximum(3 * x_hi * x_hi - 3, 1e-300)
        x_lo = tl.minimum(x_lo - (x_lo * x_lo * x_lo - 3 * x_lo - cdet) / d_lo, -1.0)
        x_hi = tl.maximum(x_hi - (x_hi * x_hi * x_hi - 3 * x_hi - cdet) / d_hi, 1.0)
    l_min = q + p * x_lo
    l_max = q + p * x_hi
    l_mid = 3 * q - l_max - l_min
    vx, vy, vz, nv = _null_vector(a00, a01, a02, a11, a12, a22, l_min)
    spread = tl.maximum(l_max - l_min, 1e-300)
    simple = (nv > (1e-8 * spread) * (1e-8 * spread)) & (l_mid - l_min > 1e-9 * spread)
    ux, uy, uz, nu = _null_vector(a00, a01, a02, a11, a12, a22, l_max)
    ax = tl.abs(ux)
    ay = tl.abs(uy)
    az = tl.abs(uz)
    kx = (ax <= ay) & (ax <= az)
    ky = (~kx) & (ay <= az)
    kz = (~kx) & (~ky)
    ox, oy, oz = _cross(ux, uy, uz, kx.to(tl.float64), ky.to(tl.float64), kz.to(tl.float64))
    on = 1.0 / tl.sqrt(tl.maximum(ox * ox + oy * oy + oz * oz, 1e-300))
    has_u = (nu > 0) & (l_max - l_min > 0)
    ox = tl.where(has_u, ox * on, 0.0)
    oy = tl.where(has_u, oy * on, 0.0)
    oz = tl.where(has_u, oz * on, 1.0)
    return tl.where(simple, vx, ox), tl.where(simple, vy, oy), tl.where(simple, vz, oz)


@triton.jit
def _covariance_kernel(pts_ptr, idx_ptr, prm_ptr, out_ptr, N, K,
                       MIN_COUNT: tl.constexpr, BLOCK_N: tl.constexpr,
                       NEWTON_STEPS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    rmask = rows < N
    # ε and the degeneracy ε in float64 from memory (float arguments would be float32)
    eps = tl.load(prm_ptr + 0)
    degeneracy = tl.load(prm_ptr + 1)
    cnt, mx, my, mz, a00, a01, a02, a11, a12, a22 = neighbour_scatter(
        pts_ptr, idx_ptr, rows, rmask, K, pid, BLOCK_N)
    cn = tl.maximum(cnt, 1.0)
    a00 = a00 / cn
    a01 = a01 / cn
    a02 = a02 / cn
    a11 = a11 / cn
    a12 = a12 / cn
    a22 = a22 / cn
    ok = (cnt >= MIN_COUNT) & tm.spans_plane(a00, a01, a02, a11, a12, a22, degeneracy)
    nx, ny, nz = _smallest_eigenvector3(a00, a01, a02, a11, a12, a22, NEWTON_STEPS)
    f = tl.where(ok, 1.0 - eps, 0.0)
    ty = out_ptr.dtype.element_ty
    o = out_ptr + rows * 9
    xx = 1.0 - f * (nx * nx)
    yy = 1.0 - f * (ny * ny)
    zz = 1.0 - f * (nz * nz)
    xy = -(f * (nx * ny))
    xz = -(f * (nx * nz))
    yz = -(f * (ny * nz))
    tl.store(o + 0, xx.to(ty), mask=rmask)
    tl.store(o + 1, xy.to(ty), mask=rmask)
    tl.store(o + 2, xz.to(ty), mask=rmask)
    tl.store(o + 3, xy.to(ty), mask=rmask)
    tl.store(o + 4, yy.to(ty), mask=rmask)
    tl.store(o + 5, yz.to(ty), mask=rmask)
    tl.store(o + 6, xz.to(ty), mask=rmask)
    tl.store(o + 7, yz.to(ty), mask=rmask)
    tl.store(o + 8, zz.to(ty), mask=rmask)


@functools.lru_cache(maxsize=16)
def _covariance_params(eps: float, device: torch.device) -> torch.Tensor:
    """Return ``(ε, DEGENERACY_EPS)`` as float64 on ``device``, made once per device.

    A launch inside a CUDA graph capture may not copy from host memory.
    """
    return torch.tensor([eps, _math.DEGENERACY_EPS], dtype=torch.float64).to(device)


def covariances(points: torch.Tensor, nbr_idx: torch.Tensor, eps: float) -> torch.Tensor:
    """Launcher of ``_covariance_kernel``: ``(Q, 3, 3)`` in the points' dtype."""
    q, k = nbr_idx.shape
    out = torch.empty(q, 3, 3, dtype=points.dtype, device=points.device)
    if q:
        prm = _covariance_params(float(eps), points.device)
        _covariance_kernel[(triton.cdiv(q, COV_BLOCK),)](
            points.contiguous(), nbr_idx.contiguous(), prm, out, q, k,
            MIN_COUNT=MIN_NEIGHBOURS, BLOCK_N=COV_BLOCK,
            NEWTON_STEPS=NEWTON_STEPS, num_warps=4)
    return out


@triton.jit
def _pair_terms(w, x0, x1, x2, m00, m01, m02, m11, m12, m22, u0, u1, u2, e):
    """Return the 28 weighted terms of one pair (``cpu.add_pair``: the same formulas)."""
    p00 = -x2 * m01 + x1 * m02
    p01 = -x2 * m11 + x1 * m12
    p02 = -x2 * m12 + x1 * m22
    p10 = x2 * m00 - x0 * m02
    p11 = x2 * m01 - x0 * m12
    p12 = x2 * m02 - x0 * m22
    p20 = -x1 * m00 + x0 * m01
    p21 = -x1 * m01 + x0 * m11
    p22 = -x1 * m02 + x0 * m12
    return (w * (x1 * p02 - x2 * p01), w * (x1 * p12 - x2 * p11), w * (x1 * p22 - x2 * p21),
            w * p00, w * p01, w * p02,
            w * (x2 * p10 - x0 * p12), w * (x2 * p20 - x0 * p22),
            w * p10, w * p11, w * p12,
            w * (x0 * p21 - x1 * p20),
            w * p20, w * p21, w * p22,
            w * m00, w * m01, w * m02, w * m11, w * m12, w * m22,
            w * (x1 * u2 - x2 * u1), w * (x2 * u0 - x0 * u2), w * (x0 * u1 - x1 * u0),
            w * u0, w * u1, w * u2, w * e)


@triton.jit
def _sums_kernel(x_ptr, sc_ptr, y_ptr, tc_ptr, idx_ptr, rot_ptr, len_ptr, c_ptr, out_ptr,
                 N, M, P, scale, rscale2,
                 S: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    L = tl.load(len_ptr + b)
    inb = offs < L
    c0 = tl.load(c_ptr + b * 3 + 0).to(tl.float32)
    c1 = tl.load(c_ptr + b * 3 + 1).to(tl.float32)
    c2 = tl.load(c_ptr + b * 3 + 2).to(tl.float32)
    xb = x_ptr + b * N * 3 + offs * 3
    x0 = tl.load(xb + 0, mask=inb, other=0.0).to(tl.float32) - c0
    x1 = tl.load(xb + 1, mask=inb, other=0.0).to(tl.float32) - c1
    x2 = tl.load(xb + 2, mask=inb, other=0.0).to(tl.float32) - c2
    # the source covariance turned by R: S = R Cs Rᵀ (upper triangle), once per row
    R = [tl.load(rot_ptr + b * 9 + k).to(tl.float32) for k in (0, 1, 2, 3, 4, 5, 6, 7, 8)]
    sb = sc_ptr + b * N * 9 + offs * 9
    a00 = tl.load(sb + 0, mask=inb, other=1.0).to(tl.float32)
    a01 = tl.load(sb + 1, mask=inb, other=0.0).to(tl.float32)
    a02 = tl.load(sb + 2, mask=inb, other=0.0).to(tl.float32)
    a11 = tl.load(sb + 4, mask=inb, other=1.0).to(tl.float32)
    a12 = tl.load(sb + 5, mask=inb, other=0.0).to(tl.float32)
    a22 = tl.load(sb + 8, mask=inb, other=1.0).to(tl.float32)
    q00 = a00 * R[0] + a01 * R[1] + a02 * R[2]
    q01 = a00 * R[3] + a01 * R[4] + a02 * R[5]
    q02 = a00 * R[6] + a01 * R[7] + a02 * R[8]
    q10 = a01 * R[0] + a11 * R[1] + a12 * R[2]
    q11 = a01 * R[3] + a11 * R[4] + a12 * R[5]
    q12 = a01 * R[6] + a11 * R[7] + a12 * R[8]
    q20 = a02 * R[0] + a12 * R[1] + a22 * R[2]
    q21 = a02 * R[3] + a12 * R[4] + a22 * R[5]
    q22 = a02 * R[6] + a12 * R[7] + a22 * R[8]
    s00 = R[0] * q00 + R[1] * q10 + R[2] * q20
    s01 = R[0] * q01 + R[1] * q11 + R[2] * q21
    s02 = R[0] * q02 + R[1] * q12 + R[2] * q22
    s11 = R[3] * q01 + R[4] * q11 + R[5] * q21
    s12 = R[3] * q02 + R[4] * q12 + R[5] * q22
    s22 = R[6] * q02 + R[7] * q12 + R[8] * q22
    zero = x0 * 0.0
    acc = [zero for _ in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19,
                          20, 21, 22, 23, 24, 25, 26, 27)]
    n_ok = zero
    d2sum = zero
    for s in range(S):
        j = tl.load(idx_ptr + (b * N + offs) * S + s, mask=inb, other=-1)
        ok = inb & (j >= 0)
        jj = tl.where(ok, j, 0)
        yb = y_ptr + b * M * 3 + jj * 3
        r0 = x0 - (tl.load(yb + 0, mask=ok, other=0.0).to(tl.float32) - c0)
        r1 = x1 - (tl.load(yb + 1, mask=ok, other=0.0).to(tl.float32) - c1)
        r2 = x2 - (tl.load(yb + 2, mask=ok, other=0.0).to(tl.float32) - c2)
        tb = tc_ptr + b * M * 9 + jj * 9
        e00 = tl.load(tb + 0, mask=ok, other=1.0).to(tl.float32) + s00
        e01 = tl.load(tb + 1, mask=ok, other=0.0).to(tl.float32) + s01
        e02 = tl.load(tb + 2, mask=ok, other=0.0).to(tl.float32) + s02
        e11 = tl.load(tb + 4, mask=ok, other=1.0).to(tl.float32) + s11
        e12 = tl.load(tb + 5, mask=ok, other=0.0).to(tl.float32) + s12
        e22 = tl.load(tb + 8, mask=ok, other=1.0).to(tl.float32) + s22
        # M = adj(C) / det(C) (reference.sym3_inverse)
        b00 = e11 * e22 - e12 * e12
        b01 = e02 * e12 - e01 * e22
        b02 = e01 * e12 - e02 * e11
        b11 = e00 * e22 - e02 * e02
        b12 = e01 * e02 - e00 * e12
        b22 = e00 * e11 - e01 * e01
        det = e00 * b00 + e01 * b01 + e02 * b02
        ok = ok & (det > 0)
        inv = 1.0 / tl.where(ok, det, 1.0)
        m00 = b00 * inv
        m01 = b01 * inv
        m02 = b02 * inv
        m11 = b11 * inv
        m12 = b12 * inv
        m22 = b22 * inv
        u0 = m00 * r0 + m01 * r1 + m02 * r2
        u1 = m01 * r0 + m11 * r1 + m12 * r2
        u2 = m02 * r0 + m12 * r1 + m22 * r2
        e = tl.maximum(r0 * u0 + r1 * u1 + r2 * u2, 0.0)
        okf = tl.where(ok, 1.0, 0.0)
        w = tm.robust_weight(tl.sqrt(rscale2 * e), scale, KIND) * okf
        t = _pair_terms(w, x0, x1, x2, m00, m01, m02, m11, m12, m22, u0, u1, u2, e)
        acc = [acc[q] + t[q] for q in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                       16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27)]
        n_ok += okf
        d2sum += okf * (r0 * r0 + r1 * r1 + r2 * r2)
    o = out_ptr + (b * P + pid) * 30
    for q in tl.static_range(28):
        tl.store(o + q, tl.sum(acc[q], 0))
    tl.store(o + 28, tl.sum(tl.where(n_ok > 0, 1.0, 0.0), 0))
    tl.store(o + 29, tl.sum(d2sum / tl.maximum(n_ok, 1.0), 0))


def partials(source, source_cov, target, target_cov, idx, rotation, lengths, center, kernel,
             scale) -> torch.Tensor:
    """Return the ``(B, P, 30)`` float32 block partials of :func:`gicp_sums`."""
    B, N = source.shape[:2]
    M = target.shape[1]
    S = idx.shape[2]
    P = max(1, triton.cdiv(N, BLOCK))
    out = torch.empty(B, P, WIDTH, dtype=torch.float32, device=source.device)
    _sums_kernel[(P, B)](
        source.contiguous(), source_cov.contiguous(), target.contiguous(),
        target_cov.contiguous(), idx.contiguous(), rotation.to(torch.float32).contiguous(),
        lengths.to(torch.int64).contiguous(), center.to(torch.float32).contiguous(), out,
        N, M, P, float(scale), float(ROBUST_SCALE2), S=S, KIND=KERNELS.index(kernel),
        BLOCK=BLOCK, num_warps=4)
    return out


def gicp_sums(source, source_cov, target, target_cov, idx, rotation, lengths, center, kernel,
              scale) -> torch.Tensor:
    """``(B, 30)`` float64: the float32 block partials summed in float64 on the device."""
    return partials(source, source_cov, target, target_cov, idx, rotation, lengths, center,
                    kernel, scale).sum(1, dtype=torch.float64)


def gicp_update(source, source_cov, target, target_cov, idx, rotation, lengths, center,
                kernel, scale, transform, eps):
    """Reduce and solve on the device: ``(sums, D, T_new, T_new_f32, flags)``.

    Three launches (partials, their float64 sum, ``normal_eq``'s point-to-plane solve), no
    synchronisation. ``transform (B, 4, 4)`` float64 contiguous.
    """
    part = partials(source, source_cov, target, target_cov, idx, rotation, lengths, center,
                    kernel, scale)
    B, dev = part.shape[0], part.device
    sums = part.sum(1, dtype=torch.float64)
    D = torch.empty(B, 4, 4, dtype=torch.float64, device=dev)
    Tn = torch.empty(B, 4, 4, dtype=torch.float64, device=dev)
    Tf = torch.empty(B, 4, 4, dtype=torch.float32, device=dev)
    flags = torch.empty(B, 2, dtype=torch.int32, device=dev)
    _solve_kernel[(B,)](sums, center.to(torch.float32).contiguous(), transform, D, Tn, Tf,
                        flags, float(eps), PLANE=True, SWEEPS=_SWEEPS6, SQUARINGS=_SQUARINGS,
                        num_warps=1)
    return sums, D, Tn, Tf, flags
