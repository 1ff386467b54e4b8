"""The rotation formulas of :mod:`pointalign._math` in float64 NumPy, for a few poses at a time.

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
    tr = m[:, 0, 0] + m[:, 1, 1] + m[:, 2, 2]
    choice = np.stack([tr, m[:, 0, 0], m[:, 1, 1], m[:, 2, 2]], -1).argmax(-1)
    s = 2 * np.sqrt(np.maximum(np.stack([1 + tr, 1 + m[:, 0, 0] - m[:, 1, 1] - m[:, 2, 2],
                                         1 + m[:, 1, 1] - m[:, 0, 0] - m[:, 2, 2],
                                         1 + m[:, 2, 2] - m[:, 0, 0] - m[:, 1, 1]], -1),
                               1e-30))
    d21, d02, d10 = m[:, 2, 1] - m[:, 1, 2], m[:, 0, 2] - m[:, 2, 0], m[:, 1, 0] - m[:, 0, 1]
    s01, s02, s12 = m[:, 0, 1] + m[:, 1, 0], m[:, 0, 2] + m[:, 2, 0], m[:, 1, 2] + m[:, 2, 1]
    rows = np.arange(R.shape[0])
    si = s[rows, choice]
    num = np.stack([np.stack([0.25 * s[:, 0] * s[:, 0], d21, d02, d10], -1),
                    np.stack([d21, 0.25 * s[:, 1] * s[:, 1], s01, s02], -1),
                    np.stack([d02, s01, 0.25 * s[:, 2] * s[:, 2], s12], -1),
                    np.stack([d10, s02, s12, 0.25 * s[:, 3] * s[:, 3]], -1)], 1)
    q = num[rows, choice] / si[:, None]
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


def rotation_angle(R: np.ndarray) -> np.ndarray:
    """``transforms.rotation_angle``: angles in radians of ``R (..., 3, 3)``.

    ``atan2(sin θ, cos θ)`` from R's antisymmetric part and trace: accurate near 0 and
    near π, and a tenth of the cost of :func:`so3_log` (the stopping rules call it per
    step).
    """
    s = 0.5 * np.linalg.norm(np.stack([R[..., 2, 1] - R[..., 1, 2], R[..., 0, 2] - R[..., 2, 0],
                                       R[..., 1, 0] - R[..., 0, 1]], -1), axis=-1)
    return np.arctan2(s, 0.5 * (np.trace(R, axis1=-2, axis2=-1) - 1))
