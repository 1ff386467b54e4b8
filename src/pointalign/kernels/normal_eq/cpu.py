"""CPU (numba) kernel of the fused ICP reduction: the contract of :mod:`.normal_eq`.

One pass over the rows, no ``(B, N, ·)`` intermediates: each of ``BLOCKS`` fixed row blocks
per batch entry accumulates the 30 sums in float64 registers from the float32/float64 inputs
(promoted to float64 per row, as the reference does), and the block partials are added in
block order. The block split does not depend on the thread count, so the result is the same
bit for bit with any ``set_num_threads``; it differs from the reference
(:func:`~pointalign.kernels.normal_eq.normal_equations_reference`, which sums whole columns)
only by the order of the float64 additions (relative ~1e-13 on 40k rows). The per-row
formulas are the numba twins in :mod:`pointalign.kernels._nb_math`: ``robust_weight`` and
Horn's sums ``add_horn``. The parallel loop's body is a function of its own
(:func:`_block`): numba's parallel passes then see a one-line loop (compiling: 3.2 → 2.4 s
of CPU; the same speed and bits).
"""

from __future__ import annotations

import numpy as np
import torch

from pointalign import _threads
from pointalign.kernels._nb_math import ROBUST_CODE, add_horn, robust_weight
from pointalign.kernels._numba import njit, prange

#: row blocks per batch entry (fixed: the summation order does not depend on threads)
BLOCKS = 64


@njit(cache=True)
def _block(src, tgt, idx, nrm, plane, b, start, stop, center, kind, scale, acc):
    """Add rows ``start:stop`` of batch entry b into ``acc (30,)`` (one parallel item)."""
    c0 = np.float64(center[b, 0])
    c1 = np.float64(center[b, 1])
    c2 = np.float64(center[b, 2])
    for i in range(start, stop):
        j = idx[b, i]
        if j < 0:
            continue
        x0 = np.float64(src[b, i, 0]) - c0
        x1 = np.float64(src[b, i, 1]) - c1
        x2 = np.float64(src[b, i, 2]) - c2
        y0 = np.float64(tgt[b, j, 0]) - c0
        y1 = np.float64(tgt[b, j, 1]) - c1
        y2 = np.float64(tgt[b, j, 2]) - c2
        d0, d1, d2 = x0 - y0, x1 - y1, x2 - y2
        dd = d0 * d0 + d1 * d1 + d2 * d2
        acc[28] += 1.0
        acc[29] += dd
        if not plane:
            add_horn(acc, robust_weight(np.sqrt(dd), kind, scale), x0, x1, x2, y0, y1, y2)
        else:
            n0 = np.float64(nrm[b, j, 0])
            n1 = np.float64(nrm[b, j, 1])
            n2 = np.float64(nrm[b, j, 2])
            r = n0 * d0 + n1 * d1 + n2 * d2
            w = robust_weight(r, kind, scale)
            # J = [x × n, n]
            J0 = x1 * n2 - x2 * n1
            J1 = x2 * n0 - x0 * n2
            J2 = x0 * n1 - x1 * n0
            J = (J0, J1, J2, n0, n1, n2)
            q = 0
            for a in range(6):
                wa = w * J[a]
                for c in range(a, 6):
                    acc[q] += wa * J[c]
                    q += 1
                acc[21 + a] += wa * r
            acc[27] += w * r * r


@njit(cache=True, parallel=True)
def _sums(src, tgt, idx, nrm, plane, lengths, center, kind, scale):
    B, N = idx.shape
    part = np.zeros((B, BLOCKS, 30), np.float64)
    step = (N + BLOCKS - 1) // BLOCKS
    for job in prange(B * BLOCKS):
        b = job // BLOCKS
        blk = job % BLOCKS
        _block(src, tgt, idx, nrm, plane, b, blk * step, min(lengths[b], (blk + 1) * step),
               center, kind, scale, part[b, blk])
    out = np.zeros((B, 30), np.float64)
    for b in range(B):
        for blk in range(BLOCKS):
            for q in range(30):
                out[b, q] += part[b, blk, q]
    return out


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def normal_equations_cpu(source, target, idx, target_normals, lengths, center, kernel,
                         scale) -> torch.Tensor:
    """Return the ``(B, 30)`` float64 sums (arguments as in :func:`.normal_eq.normal_equations`)."""
    _threads.numba_threads()
    plane = target_normals is not None
    src = _np(source)
    tgt = _np(target)
    nrm = _np(target_normals) if plane else np.zeros((1, 1, 3), src.dtype)
    if plane and nrm.dtype != src.dtype:
        nrm = nrm.astype(src.dtype)
    if tgt.dtype != src.dtype:
        tgt = tgt.astype(src.dtype)
    out = _sums(src, tgt, _np(idx.to(torch.int64)), nrm, plane,
                _np(lengths.to(torch.int64)), _np(center.to(torch.float64)),
                ROBUST_CODE[kernel], float(scale))
    return torch.from_numpy(out)
