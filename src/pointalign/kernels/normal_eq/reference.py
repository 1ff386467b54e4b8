"""The spec of the normal_eq family: the layout of the ICP sums and the float64 references.

:func:`normal_equations_reference` is the plain PyTorch (float64) statement of
:func:`pointalign.kernels.normal_eq.normal_equations` (the contract: shapes, the ``(B, 30)``
layout ``WIDTH``, the robust ``KERNELS``, the upper-triangle orders ``TRIU6``/``TRIU3``),
:func:`solve_update_reference` that of the device solve. The backends (``normal_eq/triton.py``,
``normal_eq/cpu.py``) import this module, never their dispatcher.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pointalign import _math

#: number of sums per batch entry
WIDTH = 30
KERNELS = _math.ROBUST_KINDS

#: upper-triangle (i <= j) index pairs of a 6×6 and of a 3×3 matrix, row-major
TRIU6 = [(i, j) for i in range(6) for j in range(i, 6)]
TRIU3 = [(i, j) for i in range(3) for j in range(i, 3)]


def _sym_gather(triu: list[tuple[int, int]], n: int) -> list[int]:
    """For each entry (a, b) of an n×n symmetric matrix (row-major), its position in triu."""
    pos = {ab: q for q, ab in enumerate(triu)}
    return [pos[(min(a, b), max(a, b))] for a in range(n) for b in range(n)]


_SYM6, _SYM3 = _sym_gather(TRIU6, 6), _sym_gather(TRIU3, 3)
_SYM6_NP = np.asarray(_SYM6)
_SYM3_NP = np.asarray(_SYM3)


def robust_weights(r: torch.Tensor, kernel: str, scale: float) -> torch.Tensor:
    """M-estimator weights w(r) of residuals ``r (…)``: :func:`pointalign._math.robust_weight`."""
    return _math.robust_weight(r, kernel, scale)


def normal_equations_reference(
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
    """Plain PyTorch (float64) version of :func:`normal_equations`; the spec and CPU path."""
    B, N = source.shape[:2]
    dev = source.device
    if lengths is None:
        lengths = torch.full((B,), N, dtype=torch.int64, device=dev)
    if center is None:
        center = torch.zeros(B, 3, dtype=torch.float64, device=dev)
    c = center.to(torch.float64)[:, None, :]
    rows = torch.arange(N, device=dev)[None, :]
    valid = (rows < lengths[:, None]) & (idx >= 0)
    j = torch.where(valid, idx, torch.zeros_like(idx))
    x = source.to(torch.float64) - c
    y = torch.gather(target, 1, j[..., None].expand(B, N, 3)).to(torch.float64) - c
    vf = valid.to(torch.float64)
    d = x - y
    d2 = (d * d).sum(-1)
    out = torch.zeros(B, WIDTH, dtype=torch.float64, device=dev)
    if target_normals is None:
        r = d2.sqrt()
        w = robust_weights(r, kernel, float(scale)) * vf
        wx, wy = w[..., None] * x, w[..., None] * y
        out[:, 0] = w.sum(1)
        out[:, 1:4] = wx.sum(1)
        out[:, 4:7] = wy.sum(1)
        out[:, 7:16] = (wx.transpose(1, 2) @ y).reshape(B, 9)
        xx = wx.transpose(1, 2) @ x
        yy = wy.transpose(1, 2) @ y
        out[:, 16:22] = torch.stack([xx[:, a, b] for a, b in TRIU3], 1)
        out[:, 22:28] = torch.stack([yy[:, a, b] for a, b in TRIU3], 1)
    else:
        n = torch.gather(target_normals, 1, j[..., None].expand(B, N, 3)).to(torch.float64)
        r = (n * d).sum(-1)
        w = robust_weights(r, kernel, float(scale)) * vf
        J = torch.cat([torch.linalg.cross(x, n, dim=-1), n], -1)
        wJ = w[..., None] * J
        H = wJ.transpose(1, 2) @ J
        out[:, 0:21] = torch.stack([H[:, a, b] for a, b in TRIU6], 1)
        out[:, 21:27] = (wJ * r[..., None]).sum(1)
        out[:, 27] = (w * r * r).sum(1)
    out[:, 28] = vf.sum(1)
    out[:, 29] = (d2 * vf).sum(1)
    return out


def unpack_hessian(sums: Any) -> tuple[Any, Any]:
    """Point-to-plane sums ``(B, 30)`` → ``(JᵀWJ (B, 6, 6), JᵀWr (B, 6))`` (symmetric).

    A tensor gives tensors, a NumPy array arrays (host work on a few problems).
    """
    return sums[:, _SYM6].reshape(-1, 6, 6), sums[:, 21:27]


def unpack_sym3(v: Any) -> Any:
    """Upper-triangle sums ``(B, 6)`` (00, 01, 02, 11, 12, 22) → symmetric ``(B, 3, 3)``.

    A tensor gives a tensor, a NumPy array an array.
    """
    return v[:, _SYM3].reshape(-1, 3, 3)


# ---- the rigid update from the sums (the device-side solve of ICP) ------------------------

#: ``flags[:, 0]``: the system was well posed (``valid``); ``flags[:, 1]``: the update is
#: usable (point-to-plane: a least-norm step on the determined directions exists).
FLAG_VALID, FLAG_USABLE = 0, 1


def solve_update_reference(sums: torch.Tensor, center: torch.Tensor, transform: torch.Tensor,
                           *, plane: bool, eps: float = 1e-10):
    """Compute the ICP update from the sums, float64 PyTorch (the spec of the device solve).

    Point-to-point: :func:`pointalign._math.horn_pose` (no tie-breaker), valid when W > 0
    and both weighted covariances pass :func:`pointalign._math.spans_plane` (the one
    degeneracy rule, ≈ middle eigenvalue > eps × largest). Point-to-plane: ξ = (ω, v) =
    −A⁺ g by :func:`pointalign._math.least_norm_solve` (eigenvalues ≤ eps × largest
    dropped; valid when none is dropped), R = :func:`pointalign._math.so3_exp` (ω). The
    update was solved about the centre c and is un-centred: ``D = [R, t + c − R c]``.

    Args:
        sums: ``(B, 30)`` float64 from :func:`normal_equations`.
        center: ``(B, 3)`` the centre used by the reduction.
        transform: ``(B, 4, 4)`` float64 current estimate T.
        plane: point-to-plane (True) or point-to-point (False) sums.
        eps: the relative eigenvalue threshold of the degeneracy rules above.

    Returns:
        ``(D (B, 4, 4), T_new = D T (B, 4, 4), flags (B, 2) int32)`` float64 on sums' device.

    """
    s = sums.to(torch.float64)
    B = s.shape[0]
    c = center.to(torch.float64)
    if plane:
        A = unpack_hessian(s)[0]
        xi, valid, usable = _math.least_norm_solve(A, -s[:, 21:27], eps)
        R, t = _math.so3_exp(xi[:, :3]), xi[:, 3:]
    else:
        W = s[:, 0]
        Wd = W.clamp_min(1e-300)[:, None, None]
        sx, sy = s[:, 1:4], s[:, 4:7]
        R, t, ok = _math.horn_pose(W, sx, sy, s[:, 7:16].reshape(B, 3, 3))
        cov_x = unpack_sym3(s[:, 16:22]) - sx[:, :, None] * sx[:, None, :] / Wd
        cov_y = unpack_sym3(s[:, 22:28]) - sy[:, :, None] * sy[:, None, :] / Wd
        valid = ok & _math.spans_plane(cov_x, eps) & _math.spans_plane(cov_y, eps)
        R = torch.where(valid[:, None, None], R, torch.eye(3, dtype=R.dtype, device=R.device))
        t = torch.where(valid[:, None], t, torch.zeros_like(t))
        usable = valid
    D = torch.eye(4, dtype=torch.float64, device=s.device).repeat(B, 1, 1)
    D[:, :3, :3] = R
    D[:, :3, 3] = t + c - (R @ c[:, :, None])[:, :, 0]
    flags = torch.stack([valid, usable], -1).to(torch.int32)
    return D, D @ transform.to(torch.float64), flags
