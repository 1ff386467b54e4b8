"""Triton kernels of the feature family (:mod:`pointalign.kernels.features`, ``.fpfh``).

Every reduction runs in a fixed order (deterministic results, no atomics); except for the
combine step, one program owns ``BLOCK_N`` points (one lane each) and walks their neighbour
table column by column:

* ``_pca_normals_kernel``: covariance of each neighbourhood (two passes, float64), its
  smallest eigenvector in closed form, optionally flipped towards a viewpoint; the same
  formulas and degenerate-case rules as :func:`pointalign._math.smallest_eigenvector3`.
* ``_spfh_kernel``: Darboux-frame pair features of every (point, neighbour) pair binned into
  a ``(BLOCK_N, 64)`` register histogram (33 bins used); formulas of
  :func:`pointalign.kernels.features.reference.pair_features`.
* ``_copies_kernel``: whether a row's two nearest neighbours are copies of its point.
* ``_fpfh_combine_kernel``: ``SPFH(p) + Σ SPFH(p_k) / ω_k`` with the 11-bin group
  normalisations of :func:`pointalign.kernels.features.reference.fpfh_combine_reference`;
  one program per point (its neighbour row in slices, a fixed-order tree sum).

Kernels are decorated on first use, separately for compiled and interpreted runs (as in
``_knn_triton``). Offsets are int64.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl
from triton import knobs

_CACHE: dict[bool, dict[str, Any]] = {}

#: histogram lanes per row (33 bins, padded to a power of two)
_HIST_LANES = 64


@triton.jit
def _cross(ax, ay, az, bx, by, bz):
    return ay * bz - az * by, az * bx - ax * bz, ax * by - ay * bx


@triton.jit
def _null_vector(a00, a01, a02, a11, a12, a22, lam):
    """Return the unit largest cross product of two rows of ``A − λI`` and its squared norm."""
    r00 = a00 - lam
    r11 = a11 - lam
    r22 = a22 - lam
    c0x, c0y, c0z = _cross(r00, a01, a02, a01, r11, a12)
    c1x, c1y, c1z = _cross(r00, a01, a02, a02, a12, r22)
    c2x, c2y, c2z = _cross(a01, r11, a12, a02, a12, r22)
    n0 = c0x * c0x + c0y * c0y + c0z * c0z
    n1 = c1x * c1x + c1y * c1y + c1z * c1z
    n2 = c2x * c2x + c2y * c2y + c2z * c2z
    pick1 = n1 > n0
    vx = tl.where(pick1, c1x, c0x)
    vy = tl.where(pick1, c1y, c0y)
    vz = tl.where(pick1, c1z, c0z)
    nb = tl.where(pick1, n1, n0)
    pick2 = n2 > nb
    vx = tl.where(pick2, c2x, vx)
    vy = tl.where(pick2, c2y, vy)
    vz = tl.where(pick2, c2z, vz)
    nb = tl.where(pick2, n2, nb)
    inv = 1.0 / tl.sqrt(tl.maximum(nb, 1e-300))
    return vx * inv, vy * inv, vz * inv, nb


@triton.jit
def neighbour_scatter(pts_ptr, idx_ptr, rows, rmask, K, pid, BLOCK_N: tl.constexpr):
    """Count, mean and scatter matrix of each row's neighbours, float64, in two passes.

    ``idx (N, K)`` int64 rows of neighbour indices (-1: none) into ``pts (M, 3)``; returns
    ``(cnt, mx, my, mz, a00, a01, a02, a11, a12, a22)``, each ``(BLOCK_N,)``: the scatter
    ``Σ (p − m)(p − m)ᵀ`` about the mean (the covariance times cnt). The spec:
    :func:`pointalign.kernels.features.reference.neighbour_covariances`. Shared by the
    normals and GICP's covariances.
    """
    zero = tl.zeros((BLOCK_N,), dtype=tl.float64)
    cnt = zero
    sx = zero
    sy = zero
    sz = zero
    c = pid * 0  # a loop counter of the program id's type
    while c < K:
        j = tl.load(idx_ptr + rows * K + c, mask=rmask, other=-1)
        ok = j >= 0
        jj = tl.where(ok, j, 0)
        w = ok.to(tl.float64)
        cnt += w
        sx += w * tl.load(pts_ptr + jj * 3 + 0, mask=ok, other=0.0).to(tl.float64)
        sy += w * tl.load(pts_ptr + jj * 3 + 1, mask=ok, other=0.0).to(tl.float64)
        sz += w * tl.load(pts_ptr + jj * 3 + 2, mask=ok, other=0.0).to(tl.float64)
        c += 1
    cn = tl.maximum(cnt, 1.0)
    mx = sx / cn
    my = sy / cn
    mz = sz / cn
    a00 = zero
    a01 = zero
    a02 = zero
    a11 = zero
    a12 = zero
    a22 = zero
    c = pid * 0  # a loop counter of the program id's type
    while c < K:
        j = tl.load(idx_ptr + rows * K + c, mask=rmask, other=-1)
        ok = j >= 0
        jj = tl.where(ok, j, 0)
        w = ok.to(tl.float64)
        dx = w * (tl.load(pts_ptr + jj * 3 + 0, mask=ok, other=0.0).to(tl.float64) - mx)
        dy = w * (tl.load(pts_ptr + jj * 3 + 1, mask=ok, other=0.0).to(tl.float64) - my)
        dz = w * (tl.load(pts_ptr + jj * 3 + 2, mask=ok, other=0.0).to(tl.float64) - mz)
        a00 += dx * dx
        a01 += dx * dy
        a02 += dx * dz
        a11 += dy * dy
        a12 += dy * dz
        a22 += dz * dz
        c += 1
    return cnt, mx, my, mz, a00, a01, a02, a11, a12, a22


@triton.jit
def smallest_eigenvector(a00, a01, a02, a11, a12, a22, NEWTON_STEPS: tl.constexpr):
    """Return the unit eigenvector of the smallest eigenvalue of symmetric 3×3 matrices.

    The six entries are ``(BLOCK_N,)`` float64 (any positive scale: a scatter matrix or a
    covariance); the formulas and degenerate-case rules of
    :func:`pointalign._math.smallest_eigenvector3`. Shared by the normals kernel and the
    stability probe.
    """
    zero = a00 * 0
    # scale by the largest entry (the covariance's 1/k cancels here)
    s = tl.maximum(tl.maximum(tl.maximum(tl.abs(a00), tl.abs(a01)),
                              tl.maximum(tl.abs(a02), tl.abs(a11))),
                   tl.maximum(tl.abs(a12), tl.abs(a22)))
    s = tl.where(s > 0, s, 1.0)
    a00 /= s
    a01 /= s
    a02 /= s
    a11 /= s
    a12 /= s
    a22 /= s
    # eigenvalues: Smith 1961
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
    # B's eigenvalues are the roots 2cos(φ + 2πk/3) of x³ − 3x − det(B) (cos 3φ = det/2):
    # Newton from ±2 converges monotonically to the extreme roots (no acos needed)
    cdet = tl.minimum(tl.maximum(det, -2.0), 2.0)
    x_lo = zero - 2.0
    x_hi = zero + 2.0
    it = 0
    while it < NEWTON_STEPS:
        d_lo = tl.maximum(3 * x_lo * x_lo - 3, 1e-300)
        d_hi = tl.maximum(3 * x_hi * x_hi - 3, 1e-300)
        x_lo = tl.minimum(x_lo - (x_lo * x_lo * x_lo - 3 * x_lo - cdet) / d_lo, -1.0)
        x_hi = tl.maximum(x_hi - (x_hi * x_hi * x_hi - 3 * x_hi - cdet) / d_hi, 1.0)
        it += 1
    l_min = q + p * x_lo
    l_max = q + p * x_hi
    l_mid = 3 * q - l_max - l_min
    vx, vy, vz, nv = _null_vector(a00, a01, a02, a11, a12, a22, l_min)
    spread = tl.maximum(l_max - l_min, 1e-300)
    simple = (nv > (1e-8 * spread) * (1e-8 * spread)) & (l_mid - l_min > 1e-9 * spread)
    ux, uy, uz, nu = _null_vector(a00, a01, a02, a11, a12, a22, l_max)
    # any unit vector orthogonal to u: u × e_k, k = the first smallest |u| component
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
    nx = tl.where(simple, vx, ox)
    ny = tl.where(simple, vy, oy)
    nz = tl.where(simple, vz, oz)
    return nx, ny, nz


def _pca_normals_kernel(pts_ptr, idx_ptr, ctr_ptr, vp_ptr, out_ptr, N, K,
                        HAS_VP: tl.constexpr, BLOCK_N: tl.constexpr,
                        NEWTON_STEPS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    rmask = rows < N
    cnt, mx, my, mz, a00, a01, a02, a11, a12, a22 = neighbour_scatter(
        pts_ptr, idx_ptr, rows, rmask, K, pid, BLOCK_N)
    nx, ny, nz = smallest_eigenvector(a00, a01, a02, a11, a12, a22, NEWTON_STEPS)
    if HAS_VP:
        px = tl.load(ctr_ptr + rows * 3 + 0, mask=rmask, other=0.0).to(tl.float64)
        py = tl.load(ctr_ptr + rows * 3 + 1, mask=rmask, other=0.0).to(tl.float64)
        pz = tl.load(ctr_ptr + rows * 3 + 2, mask=rmask, other=0.0).to(tl.float64)
        vpx = tl.load(vp_ptr + 0).to(tl.float64)
        vpy = tl.load(vp_ptr + 1).to(tl.float64)
        vpz = tl.load(vp_ptr + 2).to(tl.float64)
        flip = (vpx - px) * nx + (vpy - py) * ny + (vpz - pz) * nz < 0
        nx = tl.where(flip, -nx, nx)
        ny = tl.where(flip, -ny, ny)
        nz = tl.where(flip, -nz, nz)
    ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + rows * 3 + 0, nx.to(ty), mask=rmask)
    tl.store(out_ptr + rows * 3 + 1, ny.to(ty), mask=rmask)
    tl.store(out_ptr + rows * 3 + 2, nz.to(ty), mask=rmask)


@triton.jit
def _bin(x, lo, hi):
    b = tl.floor(11 * (x - lo) / (hi - lo)).to(tl.int32)
    return tl.minimum(tl.maximum(b, 0), 10)


@triton.jit
def _count_at_least(x, edges_ptr, E: tl.constexpr):
    """Count the E ascending ``edges`` that ``x`` reaches: its bin index."""
    b = tl.zeros(x.shape, dtype=tl.int32)
    for e in tl.static_range(E):
        b += (x >= tl.load(edges_ptr + e)).to(tl.int32)
    return b


def _spfh_kernel(pts_ptr, nrm_ptr, idx_ptr, edges_ptr, out_ptr, N, K, TOL,
                 BLOCK_N: tl.constexpr, LANES: tl.constexpr, ALPHA_EDGES: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    rmask = rows < N
    ty = pts_ptr.dtype.element_ty
    p1x = tl.load(pts_ptr + rows * 3 + 0, mask=rmask, other=0.0)
    p1y = tl.load(pts_ptr + rows * 3 + 1, mask=rmask, other=0.0)
    p1z = tl.load(pts_ptr + rows * 3 + 2, mask=rmask, other=0.0)
    n1x = tl.load(nrm_ptr + rows * 3 + 0, mask=rmask, other=0.0)
    n1y = tl.load(nrm_ptr + rows * 3 + 1, mask=rmask, other=0.0)
    n1z = tl.load(nrm_ptr + rows * 3 + 2, mask=rmask, other=0.0)
    lanes = tl.arange(0, LANES)
    hist = tl.zeros((BLOCK_N, LANES), dtype=tl.int32)
    n_use = tl.zeros((BLOCK_N,), dtype=tl.int32)
    c = pid * 0
    while c < K:
        j = tl.load(idx_ptr + rows * K + c, mask=rmask, other=-1)
        use = (j >= 0) & (j != rows)
        jj = tl.where(use, j, 0)
        dx = tl.load(pts_ptr + jj * 3 + 0, mask=rmask, other=0.0) - p1x
        dy = tl.load(pts_ptr + jj * 3 + 1, mask=rmask, other=0.0) - p1y
        dz = tl.load(pts_ptr + jj * 3 + 2, mask=rmask, other=0.0) - p1z
        n2x = tl.load(nrm_ptr + jj * 3 + 0, mask=rmask, other=0.0)
        n2y = tl.load(nrm_ptr + jj * 3 + 1, mask=rmask, other=0.0)
        n2z = tl.load(nrm_ptr + jj * 3 + 2, mask=rmask, other=0.0)
        dist = tl.sqrt(dx * dx + dy * dy + dz * dz)
        safe = tl.maximum(dist, 1e-30)
        a1 = (n1x * dx + n1y * dy + n1z * dz) / safe
        a2 = (n2x * dx + n2y * dy + n2z * dz) / safe
        swap = tl.abs(a1) < tl.abs(a2) - TOL
        ux = tl.where(swap, n2x, n1x)
        uy = tl.where(swap, n2y, n1y)
        uz = tl.where(swap, n2z, n1z)
        tx = tl.where(swap, n1x, n2x)
        tyy = tl.where(swap, n1y, n2y)
        tz = tl.where(swap, n1z, n2z)
        dx = tl.where(swap, -dx, dx)
        dy = tl.where(swap, -dy, dy)
        dz = tl.where(swap, -dz, dz)
        theta = tl.where(swap, -a2, a1)
        vx, vy, vz = _cross(dx, dy, dz, ux, uy, uz)
        vn = tl.sqrt(vx * vx + vy * vy + vz * vz)
        valid = (dist > 0) & (vn > 0)
        inv = tl.maximum(vn, 1e-30)
        vx = vx / inv
        vy = vy / inv
        vz = vz / inv
        wx, wy, wz = _cross(ux, uy, uz, vx, vy, vz)
        phi = vx * tx + vy * tyy + vz * tz
        # α = atan2(y, x) is binned through a pseudo-angle, monotone in α on (−π, π]
        ya = wx * tx + wy * tyy + wz * tz
        xa = ux * tx + uy * tyy + uz * tz
        ps = 1 - xa / tl.maximum(tl.abs(xa) + tl.abs(ya), 1e-30)
        ps = tl.where(ya < 0, -ps, ps)
        ba = _count_at_least(ps, edges_ptr, ALPHA_EDGES)
        ba = tl.where(valid, ba, 5)  # α = 0
        phi = tl.where(valid, phi, 0.0)
        theta = tl.where(valid, theta, 0.0)
        bp = 11 + _bin(phi, -1.0, 1.0)
        bt = 22 + _bin(theta, -1.0, 1.0)
        hit = ((lanes[None, :] == ba[:, None]) | (lanes[None, :] == bp[:, None])
               | (lanes[None, :] == bt[:, None])) & use[:, None]
        hist += hit.to(tl.int32)
        n_use += use.to(tl.int32)
        c += 1
    nf = n_use.to(ty)
    scale = tl.where(n_use > 0, 100.0 / tl.maximum(nf, 1.0), 0.0).to(ty)
    out = hist.to(ty) * scale[:, None]
    omask = rmask[:, None] & (lanes[None, :] < 33)
    tl.store(out_ptr + rows[:, None] * 33 + lanes[None, :], out, mask=omask)


@triton.jit
def _normalise_groups(h, lanes):
    """Scale each 11-lane group of ``h (LANES,)`` (lanes 0-32) to sum to 100."""
    g0 = lanes < 11
    g1 = (lanes >= 11) & (lanes < 22)
    s0 = tl.sum(tl.where(g0, h, 0.0), axis=0)
    s1 = tl.sum(tl.where(g1, h, 0.0), axis=0)
    s2 = tl.sum(tl.where(lanes >= 22, h, 0.0), axis=0)
    s = tl.where(g0, s0, tl.where(g1, s1, s2))
    return tl.where(s > 0, h * (100.0 / tl.maximum(s, 1e-30)), 0.0)


def _fpfh_combine_kernel(spfh_ptr, idx_ptr, d2_ptr, out_ptr, K,
                         BLOCK_K: tl.constexpr, LANES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ty = spfh_ptr.dtype.element_ty
    lanes = tl.arange(0, LANES)
    lmask = lanes < 33
    slots = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros((LANES,), dtype=ty)
    c = row * 0
    while c < K:
        cols = c + slots
        cmask = cols < K
        j = tl.load(idx_ptr + row * K + cols, mask=cmask, other=-1)
        d2 = tl.load(d2_ptr + row * K + cols, mask=cmask, other=0.0).to(ty)
        use = (j >= 0) & (d2 > 0) & (d2 < float("inf"))
        w = tl.where(use, 1.0 / tl.maximum(d2, 1e-30), 0.0)
        jj = tl.where(use, j, 0)
        h = tl.load(spfh_ptr + jj[:, None] * 33 + lanes[None, :],
                    mask=use[:, None] & lmask[None, :], other=0.0)
        acc += tl.sum(w[:, None] * h, axis=0)
        c += BLOCK_K
    own = tl.load(spfh_ptr + row * 33 + lanes, mask=lmask, other=0.0)
    out = _normalise_groups(own + _normalise_groups(acc, lanes), lanes)
    tl.store(out_ptr + row * 33 + lanes, out.to(ty), mask=lmask)


def _pseudo_angle(a: float) -> float:
    """``sign(sin a) · (1 − cos a / (|cos a| + |sin a|))``: monotone in a on (−π, π]."""
    x, y = math.cos(a), math.sin(a)
    p = 1 - x / (abs(x) + abs(y))
    return -p if y < 0 else p


_EDGES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _alpha_edges(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Return the 10 inner α bin edges −π + 2πk/11 as pseudo-angles ``(10,)`` (cached)."""
    key = (dtype, device)
    if key not in _EDGES:
        _EDGES[key] = torch.tensor([_pseudo_angle(-math.pi + 2 * math.pi * k / 11)
                                    for k in range(1, 11)], dtype=dtype, device=device)
    return _EDGES[key]


def _kernels() -> dict[str, Any]:
    interp = bool(knobs.runtime.interpret)
    if interp not in _CACHE:
        # sizes are not specialised (divisible by 16 or not): one compilation for every size
        _CACHE[interp] = {name: triton.jit(f, do_not_specialize=sizes) for name, f, sizes in (
            ("normals", _pca_normals_kernel, ("N", "K")),
            ("spfh", _spfh_kernel, ("N", "K")), ("combine", _fpfh_combine_kernel, ("K",)),
            ("copies", _copies_kernel, ("Q", "K")))}
    return _CACHE[interp]


def _copies_kernel(p_ptr, idx_ptr, c_ptr, out_ptr, Q, K, BLOCK: tl.constexpr):
    """Flag the rows ``[pid·BLOCK, (pid + 1)·BLOCK)`` that have copies.

    A row has copies where its two nearest are other points at its coordinates
    (:func:`~pointalign.kernels.features.reference.copy_rows_reference`).
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    rm = rows < Q
    a = tl.load(idx_ptr + rows * K, mask=rm, other=-1)
    b = tl.load(idx_ptr + rows * K + 1, mask=rm, other=-1)
    same = rm & (a >= 0) & (b >= 0) & (a != b)
    for d in tl.static_range(3):
        c = tl.load(c_ptr + rows * 3 + d, mask=rm, other=0.0)
        same = same & (tl.load(p_ptr + a * 3 + d, mask=same, other=0.0) == c) \
            & (tl.load(p_ptr + b * 3 + d, mask=same, other=0.0) == c)
    tl.store(out_ptr + rows, same.to(tl.int8), mask=rm)


def copy_rows(points: torch.Tensor, nbr_idx: torch.Tensor, centers: torch.Tensor,
              block: int = 256) -> torch.Tensor:
    """Launch :func:`_copies_kernel`: ``(Q,)`` bool (no synchronisation)."""
    q, k = nbr_idx.shape
    out = torch.empty(q, dtype=torch.int8, device=points.device)
    _kernels()["copies"][_grid(q, block)](points, nbr_idx, centers, out, q, k, BLOCK=block,
                                          num_warps=4)
    return out.view(torch.bool)


def _grid(n: int, block: int) -> tuple[int]:
    return (max(1, -(-n // block)),)


def pca_normals(points: torch.Tensor, nbr_idx: torch.Tensor, centers: torch.Tensor,
                viewpoint: torch.Tensor | None, block_n: int = 128) -> torch.Tensor:
    """Fused covariance + smallest eigenvector (+ viewpoint flip): ``(Q, 3)``.

    ``points (N, 3)`` indexed by ``nbr_idx (Q, K)``; ``centers (Q, 3)`` the rows' points.
    """
    q, k = nbr_idx.shape
    ctr = centers.contiguous()
    out = torch.empty_like(ctr)
    vp = viewpoint.contiguous() if viewpoint is not None else ctr
    _kernels()["normals"][_grid(q, block_n)](points.contiguous(), nbr_idx.contiguous(), ctr,
                                              vp, out, q, k, HAS_VP=viewpoint is not None,
                                              BLOCK_N=block_n, NEWTON_STEPS=64, num_warps=4)
    return out


def spfh(points: torch.Tensor, normals: torch.Tensor, nbr_idx: torch.Tensor,
         block_n: int = 32) -> torch.Tensor:
    """SPFH histograms ``(N, 33)`` (contract of :func:`pointalign.kernels.features.fpfh.spfh`)."""
    n, k = nbr_idx.shape
    out = torch.empty(n, 33, dtype=points.dtype, device=points.device)
    tol = 16 * torch.finfo(points.dtype).eps
    edges = _alpha_edges(points.dtype, points.device)
    _kernels()["spfh"][_grid(n, block_n)](points.contiguous(), normals.contiguous(),
                                           nbr_idx.contiguous(), edges, out, n, k, tol,
                                           BLOCK_N=block_n, LANES=_HIST_LANES,
                                           ALPHA_EDGES=edges.numel(), num_warps=4)
    return out


def fpfh_combine(spfh_hist: torch.Tensor, nbr_idx: torch.Tensor,
                 nbr_dist_sq: torch.Tensor) -> torch.Tensor:
    """FPFH ``(N, 33)`` (contract of :func:`pointalign.kernels.features.fpfh.fpfh_combine`).

    One program per point; its neighbour row is read in slices of ``BLOCK_K``.
    """
    n, k = nbr_idx.shape
    out = torch.empty_like(spfh_hist)
    bk = min(128, max(16, 1 << max(0, k - 1).bit_length()))
    _kernels()["combine"][(max(n, 1),)](spfh_hist.contiguous(), nbr_idx.contiguous(),
                                         nbr_dist_sq.contiguous(), out, k, BLOCK_K=bk,
                                         LANES=_HIST_LANES, num_warps=4)
    return out
