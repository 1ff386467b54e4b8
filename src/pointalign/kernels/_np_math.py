"""Formulas of :mod:`pointalign._math` in float64 NumPy, for a few poses at a time.

Also the registrations' host-side 6×6 work on their final sums (:func:`shift_information`,
:func:`stability`).

The CPU backend's host-side steps (a handful of 6×6 solves or pose updates a step) would
spend ~5-10 µs of PyTorch overhead per operation on arrays of a few entries; NumPy's is
~1 µs. Same formulas and branches as the spec; ``tests/test_math.py`` compares them.
"""

from __future__ import annotations

import numpy as np

from pointalign import _math


def so3_exp(w: np.ndarray) -> np.ndarray:
    """``_math.so3_exp``: rotation vectors ``(B, 3)`` → ``R (B, 3, 3)`` (Rodrigues)."""
    theta2 = (w * w).sum(-1)[:, None, None]
    small = theta2 < _math._SMALL_ANGLE2
    safe = np.where(small, 1.0, np.sqrt(theta2))
    a = np.where(small, 1 - theta2 / 6, np.sin(safe) / safe)
    b = np.where(small, 0.5 - theta2 / 24, (1 - np.cos(safe)) / (safe * safe))
    K = np.zeros((w.shape[0], 3, 3))
    K[:, 0, 1], K[:, 0, 2], K[:, 1, 2] = -w[:, 2], w[:, 1], -w[:, 0]
    K[:, 1, 0], K[:, 2, 0], K[:, 2, 1] = w[:, 2], -w[:, 1], w[:, 0]
    return np.eye(3) + a * K + b * (K @ K)


def rot_to_quat(R: np.ndarray) -> np.ndarray:
    """``_math.rot_to_quat`` (Shepperd): ``R (B, 3, 3)`` → unit ``(w, x, y, z) (B, 4)``, w ≥ 0."""
    m = R
    d0, d1, d2 = m[:, 0, 0], m[:, 1, 1], m[:, 2, 2]
    tr = d0 + d1 + d2
    cand = np.empty((R.shape[0], 4))  # tr, r00, r11, r22: the largest picks the formula
    cand[:, 0], cand[:, 1], cand[:, 2], cand[:, 3] = tr, d0, d1, d2
    choice = cand.argmax(-1)
    rad = np.empty_like(cand)  # 1 + tr, 1 + r00 − r11 − r22, …
    rad[:, 0], rad[:, 1] = 1 + tr, 1 + d0 - d1 - d2
    rad[:, 2], rad[:, 3] = 1 + d1 - d0 - d2, 1 + d2 - d0 - d1
    rows = np.arange(R.shape[0])
    si = 2 * np.sqrt(np.maximum(rad[rows, choice], 1e-30))
    d21, d02, d10 = m[:, 2, 1] - m[:, 1, 2], m[:, 0, 2] - m[:, 2, 0], m[:, 1, 0] - m[:, 0, 1]
    s01, s02, s12 = m[:, 0, 1] + m[:, 1, 0], m[:, 0, 2] + m[:, 2, 0], m[:, 1, 2] + m[:, 2, 1]
    num = np.zeros((R.shape[0], 4, 4))  # row i: candidate i's (w, x, y, z) times s_i
    num[:, 0, 1], num[:, 0, 2], num[:, 0, 3] = d21, d02, d10
    num[:, 1, 0], num[:, 1, 2], num[:, 1, 3] = d21, s01, s02
    num[:, 2, 0], num[:, 2, 1], num[:, 2, 3] = d02, s01, s12
    num[:, 3, 0], num[:, 3, 1], num[:, 3, 2] = d10, s02, s12
    q = num[rows, choice] / si[:, None]
    q[rows, choice] = 0.25 * si  # the candidate's own component
    q = q / np.linalg.norm(q, axis=-1, keepdims=True)
    return np.where(q[:, :1] < 0, -q, q)


def so3_log(R: np.ndarray) -> np.ndarray:
    """``_math.so3_log``: ``R (B, 3, 3)`` → rotation vectors ``(B, 3)``, |ω| ≤ π."""
    q = rot_to_quat(R)
    w = np.clip(q[:, 0], -1, 1)
    v = q[:, 1:]
    s = np.linalg.norm(v, axis=-1)
    angle = 2 * np.arctan2(s, w)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(s > 1e-12, angle / np.maximum(s, 1e-30), 2 / np.maximum(w, 1e-30))
    return v * scale[:, None]


def spans_plane(cov: np.ndarray, eps: float = _math.DEGENERACY_EPS) -> np.ndarray:
    """``_math.spans_plane``, the degeneracy rule: ``(tr² − ‖C‖_F²) / 2 > ε ‖C‖_F²``."""
    tr = np.trace(cov, axis1=-2, axis2=-1)
    fro2 = (cov * cov).sum((-2, -1))
    return 0.5 * (tr * tr - fro2) > eps * fro2


def rotation_angle(R: np.ndarray) -> np.ndarray:
    """``_math.rotation_angle``: angles in radians of ``R (..., 3, 3)``.

    ``atan2(sin θ, cos θ)`` from R's antisymmetric part and trace: accurate near 0 and
    near π, and a tenth of the cost of :func:`so3_log` (the stopping rules call it per
    step).
    """
    a, b, c = R[..., 2, 1] - R[..., 1, 2], R[..., 0, 2] - R[..., 2, 0], R[..., 1, 0] - R[..., 0, 1]
    s = 0.5 * np.sqrt(a * a + b * b + c * c)
    return np.arctan2(s, 0.5 * (R[..., 0, 0] + R[..., 1, 1] + R[..., 2, 2] - 1))


def stability(H: np.ndarray, extent: np.ndarray) -> np.ndarray:
    """``_math.stability``: ``λ_min / λ_max`` of ``H (…, 6, 6)``, rotations over ``extent (…)``.

    0 for a non-finite or empty H. Registrations read it once per call, on the host.
    """
    A = np.asarray(H, dtype=np.float64)
    L = np.maximum(np.asarray(extent, dtype=np.float64), 1e-300)
    d = np.ones(A.shape[:-1])
    d[..., :3] = 1.0 / L[..., None]
    A = d[..., :, None] * A * d[..., None, :]
    ok = np.asarray(np.isfinite(A).all((-2, -1)))
    ev = np.linalg.eigvalsh(np.where(ok[..., None, None], A, 0.0))
    top = ev[..., -1]
    r = np.maximum(ev[..., 0], 0.0) / np.maximum(top, 1e-300)
    return np.where(ok & (top > 0), r, 0.0)


def skew(v: np.ndarray) -> np.ndarray:
    """``_math.skew``: cross-product matrices ``[v]× (…, 3, 3)`` of ``v (…, 3)``."""
    K = np.zeros(v.shape + (3,))
    K[..., 0, 1], K[..., 0, 2], K[..., 1, 2] = -v[..., 2], v[..., 1], -v[..., 0]
    K[..., 1, 0], K[..., 2, 0], K[..., 2, 1] = v[..., 2], -v[..., 1], v[..., 0]
    return K


def shift_information(H: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Move a twist (ω, v) information ``H (B, 6, 6)`` about a point p to one about ``p − c``.

    ``Aᵀ H A`` with ``A = [[I, 0], [[c]×ᵀ, I]]``: the rows ``J_p = [(x − p) × n, n]``
    become ``J_p A = [(x − p + c) × n, n]``. ``c (B, 3)``; float64.
    """
    A = np.tile(np.eye(6), (H.shape[0], 1, 1))
    A[:, 3:, :3] = skew(np.asarray(c, dtype=np.float64)).transpose(0, 2, 1)
    return A.transpose(0, 2, 1) @ H @ A
