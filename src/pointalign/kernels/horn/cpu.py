"""CPU (numba) kernels of ``kernels/horn.py`` (private; backend ``"cpu"``; see its contract).

The numba twin of ``_tl_math.horn_pose`` (and so of the spec :func:`pointalign._math.horn_pose`
with ``tie=HORN_TIE``): one parallel loop over the batch reduces each entry's weighted
moments W = Σw, Σw x, Σw m, Σw x mᵀ in float64 (points and weights read in their dtype and
widened, in row order), then solves Horn per entry with the scalar helpers below, each the
twin of the ``_math`` function of the same name: :func:`horn_matrix` N(S),
:func:`top_eigenvector4`, :func:`quat_to_rot`, :func:`horn_pose`. Nothing is written per
point: the reference's float64 copies of the inputs (the whole expanded cloud, for the
callers that pass ``src.expand(B, -1, -1)``) and its batched ``torch.linalg.eigh`` (one
LAPACK call per 4×4 matrix) are gone.

The top eigenvector is found by cyclic Jacobi on the symmetric 4×4 (sweeps until the
off-diagonal part is below 1e-18 of the matrix's norm, at most :data:`MAX_SWEEPS`): exact to
float64 rounding wherever the top eigenvalue is separated from the next, as ``eigh`` is; the
device solver (40 squarings) is the one that stops at ~1e-11. Differences to the reference
come from the order of the float64 moment sums and from the solver's rounding: poses agree
to ~1e-12 where the top eigenvalue of N(S) is separated by a healthy fraction of its norm
(measured: ≤ 4e-13 on 20,000 random triangles with gap > 1e-3), and to ~rounding / gap
where it is nearly tied. Two points leave a tie that only the εI tie-breaker splits, by
≤ ~1e-9 of ‖N‖ and by far less where the tied rotations differ little in angle: there the
two paths may return different poses of the same cost (measured up to 9e-5 apart on noisy
random pairs; ``tests/test_horn_cpu.py`` checks the cost), as ``eigh`` itself would under
a reordering of its input.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch

from pointalign import _math, _threads
from pointalign.kernels._numba import njit, prange

#: the cross-covariance noise gate and the εI tie-breaker of the family (the spec's constants)
_NOISE = _math.HORN_NOISE
_TIE = _math.HORN_TIE
#: Jacobi sweeps at most (a 4×4 converges quadratically: 3-5 reach rounding)
MAX_SWEEPS = 30
#: batch entries per parallel work item (they share one set of scratch arrays)
CHUNK = 64

@njit(cache=True, inline="always")
def horn_matrix(S, N):
    """``_math.horn_matrix``: write N(S) ``(4, 4)`` for S ``(9,)`` (row-major 3×3)."""
    N[0, 0] = S[0] + S[4] + S[8]
    N[0, 1] = S[5] - S[7]
    N[0, 2] = S[6] - S[2]
    N[0, 3] = S[1] - S[3]
    N[1, 1] = S[0] - S[4] - S[8]
    N[1, 2] = S[1] + S[3]
    N[1, 3] = S[6] + S[2]
    N[2, 2] = S[4] - S[0] - S[8]
    N[2, 3] = S[5] + S[7]
    N[3, 3] = S[8] - S[0] - S[4]
    for i in range(4):
        for j in range(i):
            N[i, j] = N[j, i]


@njit(cache=True)
def top_eigenvector4(A, V, q):
    """``_math.top_eigenvector4`` by cyclic Jacobi: write the unit top eigenvector into ``q (4,)``.

    ``A (4, 4)`` symmetric is overwritten (it ends diagonal); ``V (4, 4)`` is scratch (the
    accumulated rotations). Rotations as ``_tl_math._jacobi_coefficients`` (Golub & Van
    Loan, Alg. 8.4.2). On a tie of the top diagonal entries the first is taken.
    """
    for i in range(4):
        for j in range(4):
            V[i, j] = 1.0 if i == j else 0.0
    for _ in range(MAX_SWEEPS):
        off = 0.0
        fro = 0.0
        for i in range(4):
            fro += A[i, i] * A[i, i]
            for j in range(i + 1, 4):
                off += A[i, j] * A[i, j]
        if not off > 1e-36 * (fro + 2.0 * off):  # ‖offdiag‖ ≤ 1e-18 ‖A‖_F; stops on NaN too
            break
        for p in range(3):
            for r in range(p + 1, 4):
                apq = A[p, r]
                if abs(apq) <= 1e-19 * math.sqrt(fro):  # negligible for the stop test (or 0)
                    continue
                th = (A[r, r] - A[p, p]) / (2.0 * apq)
                t = (1.0 if th >= 0 else -1.0) / (abs(th) + math.sqrt(th * th + 1.0))
                c = 1.0 / math.sqrt(t * t + 1.0)
                s = t * c
                A[p, p] -= t * apq
                A[r, r] += t * apq
                A[p, r] = 0.0
                A[r, p] = 0.0
                for k in range(4):
                    if k != p and k != r:
                        akp = A[k, p]
                        akr = A[k, r]
                        A[k, p] = c * akp - s * akr
                        A[p, k] = A[k, p]
                        A[k, r] = s * akp + c * akr
                        A[r, k] = A[k, r]
                for k in range(4):
                    vkp = V[k, p]
                    vkr = V[k, r]
                    V[k, p] = c * vkp - s * vkr
                    V[k, r] = s * vkp + c * vkr
    top = 0
    for i in range(1, 4):
        if A[i, i] > A[top, top]:
            top = i
    n2 = 0.0
    for k in range(4):
        n2 += V[k, top] * V[k, top]
    inv = 1.0 / math.sqrt(max(n2, 1e-300))
    for k in range(4):
        q[k] = V[k, top] * inv


@njit(cache=True, inline="always")
def quat_to_rot(q, T):
    """``_math.quat_to_rot``: q = (w, x, y, z), normalised first → R into ``T[:3, :3]``."""
    inv = 1.0 / max(math.sqrt(q[0] * q[0] + q[1] * q[1] + q[2] * q[2] + q[3] * q[3]), 1e-300)
    w = q[0] * inv
    x = q[1] * inv
    y = q[2] * inv
    z = q[3] * inv
    T[0, 0] = 1.0 - 2.0 * (y * y + z * z)
    T[0, 1] = 2.0 * (x * y - z * w)
    T[0, 2] = 2.0 * (x * z + y * w)
    T[1, 0] = 2.0 * (x * y + z * w)
    T[1, 1] = 1.0 - 2.0 * (x * x + z * z)
    T[1, 2] = 2.0 * (y * z - x * w)
    T[2, 0] = 2.0 * (x * z - y * w)
    T[2, 1] = 2.0 * (y * z + x * w)
    T[2, 2] = 1.0 - 2.0 * (x * x + y * y)


@njit(cache=True)
def horn_pose(mom, tie, S, A, V, q, T):
    """``_math.horn_pose``: float64 moments → pose ``T (4, 4)``; return ``ok``.

    ``mom (16,)``: W, Σwx (3), Σwy (3), Σ w x yᵀ (9, row-major). S = cross − W x̄ ȳᵀ is
    divided by its largest |entry| when that exceeds HORN_NOISE × (Σ|cross| + W |x̄|₁ |ȳ|₁),
    else set to 0; then ``tie``·I; q = the top eigenvector of N(S), (1, 0, 0, 0) when S = 0;
    R = R(q), t = ȳ − R x̄. Where not ok (W ≤ 0, or R, t not finite) T = I.
    ``S (9,)``, ``A, V (4, 4)``, ``q (4,)`` are scratch.
    """
    W = mom[0]
    Wc = max(W, 1e-300)
    xm0 = mom[1] / Wc
    xm1 = mom[2] / Wc
    xm2 = mom[3] / Wc
    ym0 = mom[4] / Wc
    ym1 = mom[5] / Wc
    ym2 = mom[6] / Wc
    xm = (xm0, xm1, xm2)
    ym = (ym0, ym1, ym2)
    smax = 0.0
    mag = abs(W) * (abs(xm0) + abs(xm1) + abs(xm2)) * (abs(ym0) + abs(ym1) + abs(ym2))
    for i in range(3):
        for j in range(3):
            c = mom[7 + 3 * i + j]
            s = c - W * (xm[i] * ym[j])
            S[3 * i + j] = s
            mag += abs(c)
            a = abs(s)
            if a > smax or a != a:  # NaN propagates, as amax
                smax = a
    keep = smax > _NOISE * mag
    zero = True
    for k in range(9):
        s = S[k] / max(smax, 1e-300) if keep else 0.0
        if k % 4 == 0:
            s += tie
        S[k] = s
        if s != 0.0:
            zero = False
    if zero:
        q[0] = 1.0
        q[1] = 0.0
        q[2] = 0.0
        q[3] = 0.0
    else:
        horn_matrix(S, A)
        top_eigenvector4(A, V, q)
    quat_to_rot(q, T)
    t0 = ym0 - (T[0, 0] * xm0 + T[0, 1] * xm1 + T[0, 2] * xm2)
    t1 = ym1 - (T[1, 0] * xm0 + T[1, 1] * xm1 + T[1, 2] * xm2)
    t2 = ym2 - (T[2, 0] * xm0 + T[2, 1] * xm1 + T[2, 2] * xm2)
    ok = W > 0 and np.isfinite(t0) and np.isfinite(t1) and np.isfinite(t2)
    for i in range(3):
        for j in range(3):
            ok = ok and np.isfinite(T[i, j])
    for i in range(3):
        for j in range(3):
            if not ok:
                T[i, j] = 1.0 if i == j else 0.0
    T[0, 3] = t0 if ok else 0.0
    T[1, 3] = t1 if ok else 0.0
    T[2, 3] = t2 if ok else 0.0
    T[3, 0] = 0.0
    T[3, 1] = 0.0
    T[3, 2] = 0.0
    T[3, 3] = 1.0
    return ok


def _horn_points(x, m, w, tie, chunk, T, valid):
    """Moments and pose of every entry of ``x, m (B, N, 3)``, ``w (B, N)`` (any strides).

    Compiled by :func:`_points_kernel`, once per input dtype.
    """
    B = x.shape[0]
    n = x.shape[1]
    for c in prange((B + chunk - 1) // chunk):
        mom = np.empty(16)
        S = np.empty(9)
        A = np.empty((4, 4))
        V = np.empty((4, 4))
        q = np.empty(4)
        for b in range(c * chunk, min(B, (c + 1) * chunk)):
            for k in range(16):
                mom[k] = 0.0
            for i in range(n):
                wi = np.float64(w[b, i])
                x0 = np.float64(x[b, i, 0])
                x1 = np.float64(x[b, i, 1])
                x2 = np.float64(x[b, i, 2])
                m0 = np.float64(m[b, i, 0])
                m1 = np.float64(m[b, i, 1])
                m2 = np.float64(m[b, i, 2])
                wx0 = wi * x0
                wx1 = wi * x1
                wx2 = wi * x2
                mom[0] += wi
                mom[1] += wx0
                mom[2] += wx1
                mom[3] += wx2
                mom[4] += wi * m0
                mom[5] += wi * m1
                mom[6] += wi * m2
                mom[7] += wx0 * m0
                mom[8] += wx0 * m1
                mom[9] += wx0 * m2
                mom[10] += wx1 * m0
                mom[11] += wx1 * m1
                mom[12] += wx1 * m2
                mom[13] += wx2 * m0
                mom[14] += wx2 * m1
                mom[15] += wx2 * m2
            valid[b] = horn_pose(mom, tie, S, A, V, q, T[b])


@functools.cache
def _points_kernel(dtype: torch.dtype) -> Any:
    """:func:`_horn_points` compiled for float32 or float64 inputs of any strides.

    One signature per dtype ('A' layout: contiguous, strided and expanded inputs share it),
    compiled (or loaded from numba's cache) on the first call with that dtype only.
    """
    from numba import types as nt

    f = nt.float32 if dtype == torch.float32 else nt.float64
    sig = (nt.Array(f, 3, "A"), nt.Array(f, 3, "A"), nt.Array(f, 2, "A"), nt.float64, nt.int64,
           nt.Array(nt.float64, 3, "C"), nt.Array(nt.bool_, 1, "C"))
    return njit([sig], cache=True, parallel=True)(_horn_points)


@njit(cache=True, parallel=True)
def _horn_sums(mom_all, tie, chunk, T, valid):
    """Pose of every row of ``mom_all (B, 16)`` float64 (the layout of :func:`horn_pose`)."""
    B = mom_all.shape[0]
    for c in prange((B + chunk - 1) // chunk):
        S = np.empty(9)
        A = np.empty((4, 4))
        V = np.empty((4, 4))
        q = np.empty(4)
        for b in range(c * chunk, min(B, (c + 1) * chunk)):
            valid[b] = horn_pose(mom_all[b], tie, S, A, V, q, T[b])


_FLOATS = (torch.float32, torch.float64)


def accepts(source: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> bool:
    """Tell whether :func:`horn` serves these arguments (else the caller uses the reference).

    It does for CPU tensors without autograd, ``source, targets (B, N, 3)`` and
    ``weights (B, N)`` of the same B and N, float32 or float64 (any strides).
    """
    ts = (source, targets, weights)
    return (all(t.device.type == "cpu" and t.dtype in _FLOATS and not t.requires_grad
                for t in ts)
            and source.dim() == 3 and source.shape[2] == 3 and targets.shape == source.shape
            and weights.shape == source.shape[:2])


def _chunk(B: int, threads: int) -> int:
    """Entries per work item: CHUNK, or fewer so that every thread gets ~4 items."""
    return max(1, min(CHUNK, -(-B // (4 * threads))))


def horn(source: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted Horn per batch entry (see :func:`pointalign.kernels.horn.weighted_horn`).

    Args:
        source: ``(B, N, 3)`` float32/float64 CPU tensor (any strides, e.g. expanded).
        targets: ``(B, N, 3)`` same kinds.
        weights: ``(B, N)`` same kinds.

    Returns:
        ``(T (B, 4, 4) float64, valid (B,) bool)``.

    """
    ts = [source.detach(), targets.detach(), weights.detach()]
    if len({t.dtype for t in ts}) > 1:  # mixed: all in float64 (exact, as the reference)
        ts = [t.to(torch.float64) for t in ts]
    kernel = _points_kernel(ts[0].dtype)
    threads = _threads.numba_threads()
    B = source.shape[0]
    T = np.empty((B, 4, 4), np.float64)
    valid = np.empty(B, np.bool_)
    kernel(*(t.numpy() for t in ts), _TIE, _chunk(B, threads), T, valid)
    return torch.from_numpy(T), torch.from_numpy(valid)


def horn_from_sums(W: torch.Tensor, sx: torch.Tensor, sm: torch.Tensor, cross: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pose from moments (see :func:`pointalign.kernels.horn.horn_from_sums`).

    Args:
        W: ``(…)`` Σw (CPU tensor).
        sx: ``(…, 3)`` Σw x.
        sm: ``(…, 3)`` Σw m.
        cross: ``(…, 3, 3)`` Σw x mᵀ.

    Returns:
        ``(T (…, 4, 4) float64, valid (…) bool)``.

    """
    lead = W.shape
    f64 = torch.float64
    mom = torch.cat([W.detach().reshape(-1, 1).to(f64), sx.detach().reshape(-1, 3).to(f64),
                     sm.detach().reshape(-1, 3).to(f64), cross.detach().reshape(-1, 9).to(f64)],
                    1)
    threads = _threads.numba_threads()
    B = mom.shape[0]
    T = np.empty((B, 4, 4), np.float64)
    valid = np.empty(B, np.bool_)
    kernel: Any = _horn_sums
    kernel(mom.numpy(), _TIE, _chunk(B, threads), T, valid)
    return torch.from_numpy(T).reshape(*lead, 4, 4), torch.from_numpy(valid).reshape(lead)
