"""Triton kernel of the stability probe: search, PCA normal and information in one pass.

One program owns ``BLOCK_N`` sampled rows of one problem: it moves them by the pose, finds
each one's nearest target point (the knn family's 1-NN scan), that point's ``k`` nearest
(its top-k scan), writes those indices to a scratch table and reads them back for the
scatter matrix (the features family's two-pass ``neighbour_scatter``), applies the
degeneracy rule and the closed-form smallest eigenvector, and stores its rows' float64
sums of ``J Jᵀ`` (21), counted and flat samples. One more launch adds the programs' rows.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton import knobs

from pointalign import _math
from pointalign.kernels import _tl_math as tm
from pointalign.kernels.features.triton import _cross, neighbour_scatter, smallest_eigenvector
from pointalign.kernels.knn.triton import nn1_scan, topk_scan

_CACHE: dict[bool, dict[str, Any]] = {}


def _probe_kernel(src_ptr, rows_ptr, valid_ptr, T_ptr, soa_ptr, aos_ptr, tlen_ptr, c_ptr,
                  d2_ptr, nb_ptr, out_ptr, N, S, M, tstep, eps,
                  K: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_M: tl.constexpr, NEWTON_STEPS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    r = pid * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    rmask = r < S
    ok = (tl.load(valid_ptr + b * S + r, mask=rmask, other=0) != 0) & rmask
    srow = tl.load(rows_ptr + b * S + r, mask=ok, other=0)
    sx = tl.load(src_ptr + (b * N + srow) * 3 + 0, mask=ok, other=0.0)
    sy = tl.load(src_ptr + (b * N + srow) * 3 + 1, mask=ok, other=0.0)
    sz = tl.load(src_ptr + (b * N + srow) * 3 + 2, mask=ok, other=0.0)
    Tb = T_ptr + b * 16
    x = tl.load(Tb + 0) * sx + tl.load(Tb + 1) * sy + tl.load(Tb + 2) * sz + tl.load(Tb + 3)
    y = tl.load(Tb + 4) * sx + tl.load(Tb + 5) * sy + tl.load(Tb + 6) * sz + tl.load(Tb + 7)
    z = tl.load(Tb + 8) * sx + tl.load(Tb + 9) * sy + tl.load(Tb + 10) * sz + tl.load(Tb + 11)
    tb = b * tstep  # the problem's target (0 for a shared one)
    m = tl.load(tlen_ptr + tb)
    soa = soa_ptr + tb * 3 * M
    max_d2 = tl.load(d2_ptr)  # on the device: a bound a device program computed
    _, j = nn1_scan(x, y, z, soa, m, M, max_d2, True, BLOCK_N, BLOCK_M)
    ok = ok & (j >= 0)
    jj = tb * M + tl.where(ok, j, 0)  # a row of the (Bt·M, 3) table
    yx = tl.load(aos_ptr + jj * 3 + 0, mask=ok, other=0.0)
    yy = tl.load(aos_ptr + jj * 3 + 1, mask=ok, other=0.0)
    yz = tl.load(aos_ptr + jj * 3 + 2, mask=ok, other=0.0)
    _, nbi = topk_scan(yx, yy, yz, ok, soa, m, M, 0.0, False, K, KP, BLOCK_N, BLOCK_M)
    slots = tl.arange(0, KP).to(tl.int64)
    grow = b * S + r  # this problem's rows of the scratch table (B·S, K)
    keep = ok[:, None] & (slots[None, :] < K)
    tl.store(nb_ptr + grow[:, None] * K + slots[None, :],
             tl.where(keep & (nbi >= 0), nbi + tb * M, -1),
             mask=rmask[:, None] & (slots[None, :] < K))
    tl.debug_barrier()  # the table is read back by other lanes of this program
    cnt, mx, my, mz, a00, a01, a02, a11, a12, a22 = neighbour_scatter(
        aos_ptr, nb_ptr, grow, rmask, K, pid, BLOCK_N)
    spans = tm.spans_plane(a00, a01, a02, a11, a12, a22, eps)
    nx, ny, nz = smallest_eigenvector(a00, a01, a02, a11, a12, a22, NEWTON_STEPS)
    _store_information(out_ptr + (b * tl.num_programs(0) + pid) * 23, ok, spans, yx, yy, yz,
                       nx, ny, nz, c_ptr + b * 3)


def _given_kernel(table_ptr, j_ptr, nb_ptr, c_ptr, out_ptr, S, eps,
                  K: tl.constexpr, BLOCK_N: tl.constexpr, NEWTON_STEPS: tl.constexpr):
    """Measure the probe's information with its searches given: ``table`` rows per sample.

    Program ``(pid, b)``: samples ``pid·BLOCK_N ..`` of problem b; ``j (B, S)`` each
    sample's nearest row (-1: none), ``nb (B, S, K)`` that row's K nearest rows (-1).
    """
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    r = pid * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    rmask = r < S
    grow = b * S + r
    j = tl.load(j_ptr + grow, mask=rmask, other=-1)
    ok = rmask & (j >= 0)
    jj = tl.where(ok, j, 0)
    yx = tl.load(table_ptr + jj * 3 + 0, mask=ok, other=0.0)
    yy = tl.load(table_ptr + jj * 3 + 1, mask=ok, other=0.0)
    yz = tl.load(table_ptr + jj * 3 + 2, mask=ok, other=0.0)
    cnt, mx, my, mz, a00, a01, a02, a11, a12, a22 = neighbour_scatter(
        table_ptr, nb_ptr, grow, ok, K, pid, BLOCK_N)
    spans = tm.spans_plane(a00, a01, a02, a11, a12, a22, eps)
    nx, ny, nz = smallest_eigenvector(a00, a01, a02, a11, a12, a22, NEWTON_STEPS)
    # rounded as the normals kernel stores them (features.pca_normals): the search path's
    # normals, bit for bit
    nx = nx.to(tl.float32).to(tl.float64)
    ny = ny.to(tl.float32).to(tl.float64)
    nz = nz.to(tl.float32).to(tl.float64)
    _store_information(out_ptr + (b * tl.num_programs(0) + pid) * 23, ok, spans, yx, yy, yz,
                       nx, ny, nz, c_ptr + b * 3)


@triton.jit
def _store_information(o, ok, spans, yx, yy, yz, nx, ny, nz, c_ptr):
    """Store a block's 23 sums at ``o``: ``Σ J Jᵀ`` (upper triangle), counted, flat."""
    w = (ok & spans).to(tl.float64)
    px = yx.to(tl.float64) - tl.load(c_ptr + 0)
    py = yy.to(tl.float64) - tl.load(c_ptr + 1)
    pz = yz.to(tl.float64) - tl.load(c_ptr + 2)
    ax, ay, az = _cross(px, py, pz, nx, ny, nz)
    # J = w [a, n]: the upper triangle of Σ J Jᵀ, row-major (normal_eq.TRIU6)
    tl.store(o + 0, tl.sum(w * ax * ax, 0))
    tl.store(o + 1, tl.sum(w * ax * ay, 0))
    tl.store(o + 2, tl.sum(w * ax * az, 0))
    tl.store(o + 3, tl.sum(w * ax * nx, 0))
    tl.store(o + 4, tl.sum(w * ax * ny, 0))
    tl.store(o + 5, tl.sum(w * ax * nz, 0))
    tl.store(o + 6, tl.sum(w * ay * ay, 0))
    tl.store(o + 7, tl.sum(w * ay * az, 0))
    tl.store(o + 8, tl.sum(w * ay * nx, 0))
    tl.store(o + 9, tl.sum(w * ay * ny, 0))
    tl.store(o + 10, tl.sum(w * ay * nz, 0))
    tl.store(o + 11, tl.sum(w * az * az, 0))
    tl.store(o + 12, tl.sum(w * az * nx, 0))
    tl.store(o + 13, tl.sum(w * az * ny, 0))
    tl.store(o + 14, tl.sum(w * az * nz, 0))
    tl.store(o + 15, tl.sum(w * nx * nx, 0))
    tl.store(o + 16, tl.sum(w * nx * ny, 0))
    tl.store(o + 17, tl.sum(w * nx * nz, 0))
    tl.store(o + 18, tl.sum(w * ny * ny, 0))
    tl.store(o + 19, tl.sum(w * ny * nz, 0))
    tl.store(o + 20, tl.sum(w * nz * nz, 0))
    tl.store(o + 21, tl.sum(w, 0))
    tl.store(o + 22, tl.sum((ok & ~spans).to(tl.float64), 0))


def _kernels() -> dict[str, Any]:
    interp = bool(knobs.runtime.interpret)
    if interp not in _CACHE:
        # sizes are not specialised (divisible by 16 or not): one compilation for every size
        _CACHE[interp] = {"probe": triton.jit(_probe_kernel, do_not_specialize=("N", "S", "M")),
                          "given": triton.jit(_given_kernel, do_not_specialize=("S",))}
    return _CACHE[interp]


def probe_information(source: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor,
                      transform: torch.Tensor, target: torch.Tensor,
                      target_counts: torch.Tensor, center: torch.Tensor,
                      max_distance_sq: float | torch.Tensor, k: int, block_n: int = 2,
                      block_m: int = 128, num_warps: int = 2) -> torch.Tensor:
    """Launch the probe (contract of :func:`pointalign.kernels.stability.probe_information`).

    Tiles of 2 rows × 128 points with 2 warps: the fastest of twelve shapes on an H200 for
    2,048 samples (5k points: 246 us against 364 for the 8 × 128, 4 warps used before;
    40k: 662 against 1,025 us; session 27), since 2,048 rows make few programs and each
    needs many loads in flight. In a warm point-to-point ICP on the 40k bunny pair it took
    7.7 ms of GPU time (session 13, H200), against ~2 ms of host for a k-d tree's
    searches, so tree indexes keep their searches. No host reads or transfers: it may run
    inside a captured device program (the bound then a device tensor).
    """
    B, S = rows.shape
    N, M = source.shape[1], target.shape[1]
    dev = source.device
    f32 = torch.float32
    src = source.to(f32).contiguous()
    tgt = target.to(f32).contiguous()
    soa = tgt.transpose(1, 2).contiguous()  # (Bt, 3, M): the scans' coalesced loads
    d2 = (max_distance_sq.to(device=dev, dtype=f32).reshape(1)
          if isinstance(max_distance_sq, torch.Tensor)
          else torch.full((1,), float(max_distance_sq), dtype=f32, device=dev))
    nprog = max(1, -(-S // block_n))
    part = torch.empty((B, nprog, 23), dtype=torch.float64, device=dev)
    nb = torch.empty((B * S, k), dtype=torch.int64, device=dev)
    _kernels()["probe"][(nprog, B)](
        src, rows.contiguous(), valid.contiguous(), transform.to(f32).contiguous(), soa, tgt,
        target_counts.to(device=dev, dtype=torch.int64).contiguous(),
        center.to(device=dev, dtype=torch.float64).contiguous(), d2, nb, part,
        N, S, M, 1 if target.shape[0] == B and B > 1 else 0,
        float(_math.DEGENERACY_EPS), K=k, KP=1 << max(0, k - 1).bit_length(),
        BLOCK_N=block_n, BLOCK_M=block_m, NEWTON_STEPS=64, num_warps=num_warps)
    return part.sum(1)


def neighbourhood_information(table: torch.Tensor, nearest: torch.Tensor,
                              neighbours: torch.Tensor, center: torch.Tensor,
                              block_n: int = 32, num_warps: int = 1) -> torch.Tensor:
    """Launch the measurement with given searches.

    The contract of :func:`pointalign.kernels.stability.neighbourhood_information`.
    """
    B, S, k = neighbours.shape
    part = torch.empty((B, max(1, -(-S // block_n)), 23), dtype=torch.float64,
                       device=table.device)
    _kernels()["given"][(part.shape[1], B)](
        table.to(torch.float32).contiguous(), nearest.contiguous(), neighbours.contiguous(),
        center.to(device=table.device, dtype=torch.float64).contiguous(), part, S,
        float(_math.DEGENERACY_EPS), K=k, BLOCK_N=block_n, NEWTON_STEPS=64,
        num_warps=num_warps)
    return part.sum(1)
