"""CPU (numba) kernels of ``kernels/horn.py`` (private; backend ``"cpu"``; see its contract).

The numba twin of ``_tl_math.horn_pose`` (and so of the spec :func:`pointalign._math.horn_pose`
with ``tie=HORN_TIE``): one parallel loop over the batch reduces each entry's weighted
moments W = Σw, Σw x, Σw m, Σw x mᵀ in float64 (points and weights read in their dtype and
widened, in row order, by :func:`~pointalign.kernels._nb_math.add_horn_moments`), then
solves Horn per entry with the numba twins of the ``_math`` functions of the same names in
:mod:`pointalign.kernels._nb_math`: ``horn_matrix`` N(S), ``top_eigenvector4``,
``quat_to_rot``, ``horn_pose``. Nothing is written per point: the reference's float64
copies of the inputs (the whole expanded cloud, for the callers that pass
``src.expand(B, -1, -1)``) and its batched ``torch.linalg.eigh`` (one LAPACK call per 4×4
matrix) are gone.

The top eigenvector is found by cyclic Jacobi on the symmetric 4×4 (sweeps until the
off-diagonal part is below 1e-18 of the matrix's norm, at most ``_nb_math.MAX_SWEEPS``):
exact to float64 rounding wherever the top eigenvalue is separated from the next, as
``eigh`` is; the device solver (40 squarings) is the one that stops at ~1e-11. Differences
to the reference come from the order of the float64 moment sums and from the solver's
rounding: poses agree to ~1e-12 where the top eigenvalue of N(S) is separated by a healthy
fraction of its norm (measured: ≤ 4e-13 on 20,000 random triangles with gap > 1e-3), and to
~rounding / gap where it is nearly tied. Two points leave a tie that only the εI tie-breaker
splits, by ≤ ~1e-9 of ‖N‖ and by far less where the tied rotations differ little in angle:
there the two paths may return different poses of the same cost (measured up to 9e-5 apart
on noisy random pairs; ``tests/kernels/test_horn.py`` checks the cost), as ``eigh`` itself would
under a reordering of its input.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from pointalign import _threads
from pointalign.kernels._nb_math import (
    HORN_TIE,
    add_horn_moments,
    horn_pose,
)
from pointalign.kernels._numba import njit, prange

#: batch entries per parallel work item (they share one set of scratch arrays)
CHUNK = 64


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
                add_horn_moments(mom, np.float64(w[b, i]), np.float64(x[b, i, 0]),
                                 np.float64(x[b, i, 1]), np.float64(x[b, i, 2]),
                                 np.float64(m[b, i, 0]), np.float64(m[b, i, 1]),
                                 np.float64(m[b, i, 2]))
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


#: kernels built with their signatures (above), as lazy dispatchers with the same options:
#: ``pointalign warmup`` compiles one for a signature of its manifest into the same numba
#: cache entries (:func:`pointalign.kernels._numba.dispatcher`), which the typed one loads
_TYPED = {"_horn_points": njit(cache=True, parallel=True)(_horn_points)}


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
    kernel(*(t.numpy() for t in ts), HORN_TIE, _chunk(B, threads), T, valid)
    return torch.from_numpy(T), torch.from_numpy(valid)


def horn_from_sums(W: torch.Tensor, sx: torch.Tensor, sm: torch.Tensor, cross: torch.Tensor,
                   tie: float = HORN_TIE) -> tuple[torch.Tensor, torch.Tensor]:
    """Pose from moments (see :func:`pointalign.kernels.horn.horn_from_sums`).

    Args:
        W: ``(…)`` Σw (CPU tensor).
        sx: ``(…, 3)`` Σw x.
        sm: ``(…, 3)`` Σw m.
        cross: ``(…, 3, 3)`` Σw x mᵀ.
        tie: the εI tie-breaker of :func:`pointalign._math.horn_pose` (ICP's update: 0).

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
    kernel(mom.numpy(), float(tie), _chunk(B, threads), T, valid)
    return torch.from_numpy(T).reshape(*lead, 4, 4), torch.from_numpy(valid).reshape(lead)
