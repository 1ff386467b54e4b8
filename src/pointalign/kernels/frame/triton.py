"""Triton kernels of the local frame: block moments, then the shift that reads them.

Two launches for a whole batch (the spec's ~20 PyTorch operations, each a launch):

* ``_moments_kernel``: program ``(j, r)`` sums rows ``j·BLOCK ..`` of cloud r (sources
  ``0 .. B-1``, then targets) relative to the cloud's first row, in float64:
  ``Σ (x − x₀)`` and ``Σ (x − x₀)²`` per axis, six numbers per block.
* ``_shift_kernel``: program ``(j, r)`` adds up the blocks of its problem's target in a fixed
  order (every program the same sums, so the same centroid bits), shifts its block of rows
  and rounds them to float32; the first block of each source also writes the problem's
  host row. Variance about the centroid: ``Σ (x − x₀)² / n − (Σ (x − x₀) / n)²`` with
  ``x₀`` a row of the cloud (no cancellation beyond the cloud's own extent).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton import knobs

_CACHE: dict[bool, dict[str, Any]] = {}

#: rows per program of both kernels (1M-point clouds: 245 blocks a cloud)
BLOCK = 4096

#: blocks added per step when a program sums a cloud's blocks
PARTS = 256


def _moments_kernel(src_ptr, tgt_ptr, slen_ptr, tlen_ptr, part_ptr, N, M, B,
                    BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    if r < B:
        base = src_ptr + r * N * 3
        n = tl.load(slen_ptr + r)
    else:
        base = tgt_ptr + (r - B) * M * 3
        n = tl.load(tlen_ptr + r - B)
    rows = j * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    ok = rows < n
    o = part_ptr + (r * tl.num_programs(0) + j) * 6
    for a in tl.static_range(3):
        x0 = tl.load(base + a).to(tl.float64)
        d = tl.where(ok, tl.load(base + rows * 3 + a, mask=ok, other=0.0).to(tl.float64) - x0,
                     0.0)
        tl.store(o + a, tl.sum(d, 0))
        tl.store(o + 3 + a, tl.sum(d * d, 0))


@triton.jit
def _block_sum(p, nblk, PARTS: tl.constexpr):
    """Return the sum of ``p[6 i]`` for i < nblk, in a fixed order."""
    acc = tl.zeros((PARTS,), dtype=tl.float64)
    for s in range(0, nblk, PARTS):
        i = s + tl.arange(0, PARTS)
        acc += tl.load(p + i * 6, mask=i < nblk, other=0.0)
    return tl.sum(acc, 0)


@triton.jit
def _centre(base, part, n, nblk, a, PARTS: tl.constexpr):
    """Return the float64 mean of axis ``a`` of a cloud (its first row ``base``, blocks)."""
    return tl.load(base + a).to(tl.float64) + _block_sum(part + a, nblk, PARTS) / n


@triton.jit
def _radius(part, n, nblk, PARTS: tl.constexpr):
    """Return the RMS distance of a cloud's rows from their mean (its blocks' moments)."""
    v = 0.0
    for a in tl.static_range(3):
        m = _block_sum(part + a, nblk, PARTS) / n
        v += _block_sum(part + 3 + a, nblk, PARTS) / n - m * m
    return tl.sqrt(tl.where(v < 0.0, 0.0, v))  # (tl.maximum would drop a NaN)


@triton.jit
def _shift_axis(base, out, rows, ok, a, s):
    """``out[rows, a] = float32(base[rows, a] − s)``, the difference in float64."""
    x = tl.load(base + rows * 3 + a, mask=ok, other=0.0).to(tl.float64)
    tl.store(out + rows * 3 + a, (x - s).to(tl.float32), mask=ok)


def _shift_kernel(src_ptr, tgt_ptr, slen_ptr, tlen_ptr, part_ptr, osrc_ptr, otgt_ptr,
                  host_ptr, N, M, B, tstep, nblk, LOCAL: tl.constexpr, BLOCK: tl.constexpr,
                  PARTS: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    if r < B:  # a source: its problem's target is r (or 0 when shared)
        f = r * tstep
        base = src_ptr + r * N * 3
        out = osrc_ptr + r * N * 3
        rows_n = N
    else:
        f = r - B
        base = tgt_ptr + f * M * 3
        out = otgt_ptr + f * M * 3
        rows_n = M
    tbase = tgt_ptr + f * M * 3
    tpart = part_ptr + (B + f) * nblk * 6
    nt = tl.load(tlen_ptr + f).to(tl.float64)
    cx = _centre(tbase, tpart, nt, nblk, 0, PARTS)
    cy = _centre(tbase, tpart, nt, nblk, 1, PARTS)
    cz = _centre(tbase, tpart, nt, nblk, 2, PARTS)
    if LOCAL:
        sx, sy, sz = cx, cy, cz
    else:
        sx, sy, sz = 0.0, 0.0, 0.0
    rows = j * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    ok = rows < rows_n
    _shift_axis(base, out, rows, ok, 0, sx)
    _shift_axis(base, out, rows, ok, 1, sy)
    _shift_axis(base, out, rows, ok, 2, sz)
    if (j == 0) & (r < B):
        ns = tl.load(slen_ptr + r).to(tl.float64)
        h = host_ptr + r * 8
        tl.store(h + 0, sx)
        tl.store(h + 1, sy)
        tl.store(h + 2, sz)
        tl.store(h + 3, _radius(tpart, nt, nblk, PARTS))
        tl.store(h + 4, cx - sx)
        tl.store(h + 5, cy - sy)
        tl.store(h + 6, cz - sz)
        tl.store(h + 7, _radius(part_ptr + r * nblk * 6, ns, nblk, PARTS))


def _kernels() -> dict[str, Any]:
    interp = bool(knobs.runtime.interpret)
    if interp not in _CACHE:
        # sizes not specialised (divisible by 16 or not): one compilation for every size
        sizes = ("N", "M", "B")
        _CACHE[interp] = {
            "moments": triton.jit(_moments_kernel, do_not_specialize=sizes),
            "shift": triton.jit(_shift_kernel, do_not_specialize=sizes + ("tstep", "nblk"))}
    return _CACHE[interp]


def local_frame(source: torch.Tensor, source_lengths: torch.Tensor, target: torch.Tensor,
                target_lengths: torch.Tensor, local: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the two kernels (contract of :func:`pointalign.kernels.frame.local_frame`)."""
    B, N = source.shape[:2]
    Bt, M = target.shape[:2]
    dev = source.device
    if source.dtype != target.dtype or source.dtype not in (torch.float32, torch.float64):
        source, target = source.to(torch.float64), target.to(torch.float64)
    src, tgt = source.contiguous(), target.contiguous()
    slen, tlen = source_lengths.contiguous(), target_lengths.contiguous()
    nblk = -(-max(N, M) // BLOCK)
    part = torch.empty((B + Bt, nblk, 6), dtype=torch.float64, device=dev)
    k = _kernels()
    k["moments"][(nblk, B + Bt)](src, tgt, slen, tlen, part, N, M, B, BLOCK=BLOCK,
                                 num_warps=8)
    out_s = torch.empty((B, N, 3), dtype=torch.float32, device=dev)
    out_t = torch.empty((Bt, M, 3), dtype=torch.float32, device=dev)
    host = torch.empty((B, 8), dtype=torch.float64, device=dev)
    k["shift"][(nblk, B + Bt)](src, tgt, slen, tlen, part, out_s, out_t, host, N, M, B,
                               1 if Bt == B else 0, nblk, LOCAL=bool(local), BLOCK=BLOCK,
                               PARTS=PARTS, num_warps=8)
    return out_s, out_t, host
