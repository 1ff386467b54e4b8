"""Triton kernel of the ransac family's point move: ``R_s p + t_s`` without a GEMM.

``transform_points_reference`` moves points by ``baddbmm``, a GEMM whose inner dimension is
3: cuBLAS tiles it as a matrix product and reads and writes far more than the points
(an H200: ~60 us for 1M points, ~44 us for KITTI's 125k, where moving them is 24 MB and
3 MB of memory traffic). Here one program moves ``BLOCK`` points by one transform, read
from device memory (no host synchronisation, one compilation for every size), each
coordinate ``((r0 x + r1 y) + r2 z) + t`` as a chain of float32 FMAs: a few ulps from the
GEMM's own rounding at most (tested against the float64 move).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=("n_points", "n_blocks", "p_stride"))
def _move_kernel(T_ptr, p_ptr, out_ptr, n_points, n_blocks, p_stride, BLOCK: tl.constexpr):
    """Move block ``pid % n_blocks`` of ``BLOCK`` points by transform ``pid // n_blocks``.

    ``T (S, 4, 4)`` float32; the points of problem s start at ``s · p_stride`` (0: every
    transform moves the same points); ``out (S, P, 3)``. One grid axis, so that neither
    S nor P meets a grid's second-axis limit.
    """
    pid = tl.program_id(0).to(tl.int64)
    s = pid // n_blocks
    offs = (pid - s * n_blocks) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_points
    src = p_ptr + s * p_stride + offs * 3
    x = tl.load(src + 0, mask=m, other=0.0)
    y = tl.load(src + 1, mask=m, other=0.0)
    z = tl.load(src + 2, mask=m, other=0.0)
    dst = out_ptr + (s * n_points + offs) * 3
    for r in tl.static_range(3):
        row = T_ptr + s * 16 + 4 * r
        v = tl.load(row + 0) * x + tl.load(row + 1) * y
        v = v + tl.load(row + 2) * z
        tl.store(dst + r, v + tl.load(row + 3), mask=m)


def transform_points(T: torch.Tensor, points: torch.Tensor, block: int = 512) -> torch.Tensor:
    """``(S, P, 3)`` float32: ``T (S, 4, 4)`` moving float32 ``points (P, 3)`` or ``(S, P, 3)``.

    The contract of :func:`pointalign.kernels.ransac.transform_points` for float32 points.
    """
    S = T.shape[0]
    if T.dim() != 3 or T.shape[1:] != (4, 4) or points.shape[-1] != 3 \
            or points.dim() not in (2, 3) or (points.dim() == 3 and points.shape[0] != S):
        raise ValueError(f"transform_points: expected T (S, 4, 4) and points (P, 3) or "
                         f"(S, P, 3), got {tuple(T.shape)} and {tuple(points.shape)}")
    # one copy of points every transform reads through a stride-0 batch (an expanded view)
    pts = (points[0] if points.dim() == 3 and points.stride(0) == 0 else points).contiguous()
    P = pts.shape[-2]
    out = torch.empty((S, P, 3), dtype=torch.float32, device=pts.device)
    if S == 0 or P == 0:
        return out
    Tf = T.to(device=pts.device, dtype=torch.float32).contiguous()
    n_blocks = triton.cdiv(P, block)
    _move_kernel[(S * n_blocks,)](Tf, pts, out, P, n_blocks, 0 if pts.dim() == 2 else P * 3,
                                  BLOCK=block, num_warps=4)
    return out
