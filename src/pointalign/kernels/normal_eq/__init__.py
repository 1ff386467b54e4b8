"""Fused ICP reduction over correspondences: the sums a rigid update needs, in one pass.

Contract (shared by the PyTorch reference :func:`normal_equations_reference` in
``normal_eq/reference.py``, the Triton kernel in ``normal_eq/triton.py`` and the numba loop
in ``normal_eq/cpu.py``):

* ``source (B, N, 3)``: float tensor, source points **already moved** by the current
  estimate (x_i). Rows ``i >= lengths[b]`` are padding and ignored.
* ``target (B, M, 3)``: float tensor, target points y_j.
* ``idx (B, N)`` int64: correspondence of each source row, ``-1`` for none (ignored).
* ``target_normals (B, M, 3)`` or None: unit normals n_j (point-to-plane when given).
* ``lengths (B,)`` int64: valid source rows per batch entry.
* ``center (B, 3)``: coordinates are shifted by c before accumulating (x̃ = x − c,
  ỹ = y − c) so that float32 block sums do not cancel far from the origin.
* ``kernel`` ("none", "huber", "tukey", "cauchy") and ``scale`` k: robust weight w(r) of
  :class:`~pointalign.registration.criteria.RobustKernel` applied to the residual r:
  ``r = ||x − y||`` (point-to-point) or ``r = nᵀ(x − y)`` (point-to-plane).

Output: ``(B, 30)`` float64 on the input's device, one row per batch entry:

* point-to-point (``target_normals is None``): ``[0]`` W = Σ w, ``[1:4]`` Σ w x̃,
  ``[4:7]`` Σ w ỹ, ``[7:16]`` Σ w x̃ ỹᵀ (3×3 row-major), ``[16:22]`` Σ w x̃ x̃ᵀ and
  ``[22:28]`` Σ w ỹ ỹᵀ (upper triangles 00, 01, 02, 11, 12, 22): the moments of Horn's
  method (:func:`pointalign.estimate.horn_from_moments`).
* point-to-plane: ``[0:21]`` upper triangle (row-major, i <= j) of JᵀWJ, ``[21:27]`` JᵀWr,
  ``[27]`` Σ w r², with J_i = [(x̃_i × n_i)ᵀ, n_iᵀ] (twist (ω, v) about c), the 6×6
  linearised normal equations of Chen & Medioni (1992).
* both: ``[28]`` number of valid correspondences, ``[29]`` Σ ||x − y||² over them
  (unweighted; for fitness and inlier RMSE).

The Triton kernel accumulates blocks in float32 and sums the block partials in float64 on
the device; the reference computes in float64 throughout.
"""

from __future__ import annotations

import numpy as np
import torch

from pointalign.kernels import _np_math
from pointalign.kernels._backend import backend
from pointalign.kernels.normal_eq.reference import (
    _SYM3_NP,
    _SYM6_NP,
    KERNELS,
    WIDTH,
    normal_equations_reference,
    solve_update_reference,
)
from pointalign.kernels.normal_eq.reference import FLAG_USABLE as FLAG_USABLE
from pointalign.kernels.normal_eq.reference import FLAG_VALID as FLAG_VALID
from pointalign.kernels.normal_eq.reference import TRIU3 as TRIU3
from pointalign.kernels.normal_eq.reference import TRIU6 as TRIU6
from pointalign.kernels.normal_eq.reference import robust_weights as robust_weights
from pointalign.kernels.normal_eq.reference import unpack_hessian as unpack_hessian
from pointalign.kernels.normal_eq.reference import unpack_sym3 as unpack_sym3


def _check(source, target, idx, target_normals, lengths, center, kernel, scale):
    if source.dim() != 3 or source.shape[-1] != 3:
        raise ValueError(f"source: expected shape (B, N, 3), got {tuple(source.shape)}")
    B, N = source.shape[:2]
    if target.dim() != 3 or target.shape[0] != B or target.shape[-1] != 3:
        raise ValueError(f"target: expected shape ({B}, M, 3), got {tuple(target.shape)}")
    if idx.shape != (B, N) or idx.dtype != torch.int64:
        raise ValueError(f"idx: expected ({B}, {N}) int64, got {tuple(idx.shape)} {idx.dtype}")
    if target_normals is not None and target_normals.shape != target.shape:
        raise ValueError(f"target_normals: expected shape {tuple(target.shape)}, got "
                         f"{tuple(target_normals.shape)}")
    if lengths.shape != (B,):
        raise ValueError(f"lengths: expected shape ({B},), got {tuple(lengths.shape)}")
    if center.shape != (B, 3):
        raise ValueError(f"center: expected shape ({B}, 3), got {tuple(center.shape)}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    if not scale > 0:
        raise ValueError(f"scale: must be > 0, got {scale}")
    devs = {t.device for t in (source, target, idx, lengths, center)
            if t is not None}
    if target_normals is not None:
        devs.add(target_normals.device)
    if len(devs) != 1:
        raise ValueError(f"normal_equations: inputs on different devices {sorted(map(str, devs))}")


def normal_equations(
    source: torch.Tensor,
    target: torch.Tensor,
    idx: torch.Tensor,
    *,
    target_normals: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    center: torch.Tensor | None = None,
    kernel: str = "none",
    scale: float = 1.0,
) -> torch.Tensor:
    """Compute the ICP sums of one iteration, fused into one pass (see the module docstring).

    Args:
        source: ``(B, N, 3)`` float tensor, moved source points x_i.
        target: ``(B, M, 3)`` float tensor, y_j.
        idx: ``(B, N)`` int64 correspondences (-1 = none).
        target_normals: ``(B, M, 3)`` unit normals (point-to-plane) or None (point-to-point).
        lengths: ``(B,)`` int64 valid source rows (default N).
        center: ``(B, 3)`` centring point c (default 0).
        kernel: robust kernel name ("none", "huber", "tukey", "cauchy").
        scale: the robust kernel's scale k (metres), > 0.

    Returns:
        ``(B, 30)`` float64 sums on the input's device.

    """
    B, N = source.shape[:2]
    if lengths is None:
        lengths = torch.full((B,), N, dtype=torch.int64, device=source.device)
    if center is None:
        center = torch.zeros(B, 3, dtype=source.dtype, device=source.device)
    _check(source, target, idx, target_normals, lengths, center, kernel, float(scale))
    be = backend(source)
    if be == "cpu":
        from pointalign.kernels.normal_eq import cpu as _normal_eq_cpu

        return _normal_eq_cpu.normal_equations_cpu(source, target, idx, target_normals,
                                                    lengths, center, kernel, float(scale))
    if be == "torch":
        return normal_equations_reference(source, target, idx, target_normals=target_normals,
                                          lengths=lengths, center=center, kernel=kernel,
                                          scale=scale)
    from pointalign.kernels.normal_eq import triton as _normal_eq_triton

    return _normal_eq_triton.normal_equations_triton(
        source, target, idx, target_normals, lengths, center, kernel, float(scale))


def _host_update(R: np.ndarray, t: np.ndarray, c: np.ndarray, transform: torch.Tensor,
                 valid: np.ndarray, usable: np.ndarray):
    """``(D, T_new = D T, flags)`` of an update ``(R, t)`` solved about the centre ``c``.

    The host solves' un-centring, ``D = [R, t + c − R c]`` (:func:`solve_update_reference`'s).
    """
    D = np.tile(np.eye(4), (R.shape[0], 1, 1))
    D[:, :3, :3] = R
    D[:, :3, 3] = t + c - (R @ c[:, :, None])[:, :, 0]
    Tn = D @ transform.detach().to(torch.float64).numpy()
    flags = np.stack([valid, usable], -1).astype(np.int32)
    return torch.from_numpy(D), torch.from_numpy(Tn), torch.from_numpy(flags)


def solve_update_plane_host(sums: torch.Tensor, center: torch.Tensor, transform: torch.Tensor,
                            *, eps: float = 1e-10):
    """:func:`solve_update_reference` for point-to-plane sums, in float64 NumPy on the host.

    The same steps (:func:`pointalign._math.block_scales6`, the eigen pseudo-inverse of
    :func:`pointalign._math.least_norm_solve`, so3_exp (:mod:`.._np_math`), the
    un-centring) on a handful of 6×6 systems, where PyTorch's per-operation overhead
    (~25 operations, ~1 ms a step on the CPU) outweighs the arithmetic; equal to the
    reference up to the eigen-solver's rounding. ``sums (B, 30)``, ``center (B, 3)``,
    ``transform (B, 4, 4)`` on the CPU; returns ``(D, T_new, flags)`` like the reference.
    """
    s = sums.detach().to(torch.float64).numpy()
    c = center.detach().to(torch.float64).numpy()
    B = s.shape[0]
    A = s[:, _SYM6_NP].reshape(B, 6, 6)
    b = -s[:, 21:27]
    tr_r = (A[:, 0, 0] + A[:, 1, 1] + A[:, 2, 2]) / 3
    tr_t = (A[:, 3, 3] + A[:, 4, 4] + A[:, 5, 5]) / 3
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s_r = np.where(tr_r > 0, 1.0 / np.sqrt(np.maximum(tr_r, 1e-300)), 1.0)
        s_t = np.where(tr_t > 0, 1.0 / np.sqrt(np.maximum(tr_t, 1e-300)), 1.0)
        d = np.stack([s_r, s_r, s_r, s_t, s_t, s_t], -1)
        A = d[:, :, None] * A * d[:, None, :]
        b = d * b
        finite = np.isfinite(A).all((1, 2))
        ev = np.full((B, 6), np.nan)
        V = np.zeros((B, 6, 6))
        if finite.any():
            ev[finite], V[finite] = np.linalg.eigh(A[finite])
        keep = ev > eps * np.maximum(ev[:, -1:], 1e-300)
        inv = np.where(keep, 1.0 / np.maximum(ev, 1e-300), 0.0)
        x = d * (V @ (inv[:, :, None] * (V.transpose(0, 2, 1) @ b[:, :, None])))[:, :, 0]
        usable = np.isfinite(x).all(-1) & keep.any(-1)
        x = np.where(usable[:, None], x, 0.0)
        valid = keep.all(-1) & usable
        R = _np_math.so3_exp(x[:, :3])
    return _host_update(R, x[:, 3:], c, transform, valid, usable)


def solve_update_point_host(sums: torch.Tensor, center: torch.Tensor, transform: torch.Tensor,
                            *, eps: float = 1e-10):
    """:func:`solve_update_reference` for point-to-point sums on the CPU backend.

    Horn's pose by the numba twin of :func:`pointalign._math.horn_pose` (``kernels/horn``'s
    :func:`~pointalign.kernels.horn.cpu.horn_from_sums` with no tie-breaker, as ICP's
    spec), the degeneracy rule (``_np_math.spans_plane``) and the un-centring in NumPy:
    ~0.05 ms a step where the spec's ~40 PyTorch operations take ~0.6 ms. Equal to the
    reference up to the 4×4 eigen-solver's rounding. Arguments and result as
    :func:`solve_update_plane_host`.
    """
    from pointalign.kernels.horn import cpu as _horn_cpu

    s = sums.detach().to(torch.float64)
    B = s.shape[0]
    T_h, ok = _horn_cpu.horn_from_sums(s[:, 0], s[:, 1:4], s[:, 4:7],
                                       s[:, 7:16].reshape(B, 3, 3), tie=0.0)
    sn, c = s.numpy(), center.detach().to(torch.float64).numpy()
    W = np.maximum(sn[:, 0], 1e-300)[:, None, None]
    sx, sy = sn[:, 1:4], sn[:, 4:7]
    cov_x = sn[:, 16:22][:, _SYM3_NP].reshape(B, 3, 3) - sx[:, :, None] * sx[:, None, :] / W
    cov_y = sn[:, 22:28][:, _SYM3_NP].reshape(B, 3, 3) - sy[:, :, None] * sy[:, None, :] / W
    valid = ok.numpy() & _np_math.spans_plane(cov_x, eps) & _np_math.spans_plane(cov_y, eps)
    Th = T_h.numpy()
    R = np.where(valid[:, None, None], Th[:, :3, :3], np.eye(3))
    t = np.where(valid[:, None], Th[:, :3, 3], 0.0)
    return _host_update(R, t, c, transform, valid, valid)


def icp_update(
    source: torch.Tensor,
    target: torch.Tensor,
    idx: torch.Tensor,
    *,
    transform: torch.Tensor,
    plane: bool,
    target_normals: torch.Tensor | None = None,
    lengths: torch.Tensor,
    center: torch.Tensor,
    kernel: str = "none",
    scale: float = 1.0,
    eps: float = 1e-10,
    out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """One ICP step after the search: the sums, the update and the new estimate, on device.

    :func:`normal_equations` followed by :func:`solve_update_reference`'s contract, with no
    host round trip on the Triton path (a torch reduction sums the block partials in float64
    and one kernel solves with the ``_tl_math`` helpers; ``_normal_eq_triton``). ``source``
    is the moved source x = T s, ``transform`` the T that moved it (float64 ``(B, 4, 4)``).

    Returns (written into ``out`` when given, which must not alias ``transform``):
    ``sums (B, 30)`` float64, ``D (B, 4, 4)`` float64, ``T_new (B, 4, 4)`` float64,
    ``T_new`` as float32 ``(B, 4, 4)``, ``flags (B, 2)`` int32 (valid, usable).
    """
    B = source.shape[0]
    dev = source.device
    if out is None:
        out = (torch.empty(B, WIDTH, dtype=torch.float64, device=dev),
               torch.empty(B, 4, 4, dtype=torch.float64, device=dev),
               torch.empty(B, 4, 4, dtype=torch.float64, device=dev),
               torch.empty(B, 4, 4, dtype=torch.float32, device=dev),
               torch.empty(B, 2, dtype=torch.int32, device=dev))
    normals = target_normals if plane else None
    be = backend(source)
    if be in ("torch", "cpu"):
        if be == "cpu":
            from pointalign.kernels.normal_eq import cpu as _normal_eq_cpu

            s = _normal_eq_cpu.normal_equations_cpu(source, target, idx, normals, lengths,
                                                    center, kernel, float(scale))
        else:
            s = normal_equations_reference(source, target, idx, target_normals=normals,
                                           lengths=lengths, center=center, kernel=kernel,
                                           scale=scale)
        if be == "cpu":  # host solves: ~25-40 small PyTorch ops cost ~0.6-1 ms a step
            host = solve_update_plane_host if plane else solve_update_point_host
            D, Tn, fl = host(s, center, transform, eps=eps)
        else:
            D, Tn, fl = solve_update_reference(s, center, transform, plane=plane, eps=eps)
        for o, v in zip(out, (s, D, Tn, Tn, fl), strict=False):
            o.copy_(v)
        return out
    from pointalign.kernels.normal_eq import triton as _normal_eq_triton

    return _normal_eq_triton.icp_update_triton(
        source.contiguous(), target.contiguous(), idx.contiguous(),
        None if normals is None else normals.contiguous(), lengths.to(torch.int64),
        center.to(torch.float32).contiguous(), kernel, float(scale),
        transform.to(torch.float64).contiguous(), eps, out)
