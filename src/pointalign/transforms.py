"""Rigid transforms: the one convention of the library, and the operations on it.

Convention
----------
* Column vectors: ``x_target = R @ x_source + t``.
* A transform is a ``(4, 4)`` matrix ``T = [[R, t], [0, 0, 0, 1]]``, or ``(B, 4, 4)`` for a
  batch; ``T_target_source`` maps source points into the target frame (the Open3D and
  small_gicp meaning of a registration result). Variables are named by the frames they
  connect: ``T_tgt_src``, ``T_src_tgt = invert(T_tgt_src)``.
* Quaternions are ``(w, x, y, z)`` (scalar first), Hamilton product, unit norm; ``q`` and
  ``-q`` are the same rotation.
* Twists ``xi = (omega, v)``: rotation vector first (radians), then translation; the
  exponential of ``[omega]_x`` / ``v`` gives ``T``.
* Points are row-stacked ``(N, 3)`` (or ``(B, N, 3)``) tensors, so ``apply`` computes
  ``points @ R.T + t``.

Every function is batched over leading dimensions and works on any device and dtype.
"""

from __future__ import annotations

import math

import torch

from pointalign import _math


def make(rotation: torch.Tensor, translation: torch.Tensor) -> torch.Tensor:
    """Build ``(…, 4, 4)`` from rotation ``(…, 3, 3)`` and translation ``(…, 3)``."""
    rotation = torch.as_tensor(rotation)
    translation = torch.as_tensor(translation, dtype=rotation.dtype, device=rotation.device)
    batch = torch.broadcast_shapes(rotation.shape[:-2], translation.shape[:-1])
    T = torch.zeros(*batch, 4, 4, dtype=rotation.dtype, device=rotation.device)
    T[..., :3, :3] = rotation
    T[..., :3, 3] = translation
    T[..., 3, 3] = 1
    return T


def compose(*Ts: torch.Tensor) -> torch.Tensor:
    """Matrix product ``Ts[0] @ Ts[1] @ …`` (apply the last one first)."""
    out = Ts[0]
    for T in Ts[1:]:
        out = out @ T
    return out


def invert(T: torch.Tensor) -> torch.Tensor:
    """Inverse of rigid ``(…, 4, 4)`` transforms, ``[R^T, -R^T t]`` (exact, no matrix inverse)."""
    R = T[..., :3, :3]
    t = T[..., :3, 3:]
    Rt = R.transpose(-1, -2)
    return make(Rt, -(Rt @ t)[..., 0])


def apply(T: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """Transform points: ``points (…, N, 3)`` by ``T (…, 4, 4)`` → ``(…, N, 3)``.

    Computed in ``T``'s precision and returned in ``points``' dtype.
    """
    R = T[..., :3, :3]
    t = T[..., None, :3, 3]
    return (points.to(T.dtype) @ R.transpose(-1, -2) + t).to(points.dtype)


def skew(v: torch.Tensor) -> torch.Tensor:
    """Cross-product matrices ``[v]_x`` of shape ``(…, 3, 3)`` for ``v (…, 3)``."""
    return _math.skew(v)


def quaternion_to_matrix(q: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """Rotation matrices ``(…, 3, 3)`` from quaternions ``(…, 4)`` = (w, x, y, z).

    The quaternion is normalised first (:func:`pointalign._math.quat_to_rot`); a zero
    quaternion raises ``ValueError``. With ``check=False`` (inside device loops: no host
    sync) that test is skipped and a zero quaternion gives the identity.
    """
    if check and bool((q.norm(dim=-1) == 0).any()):
        raise ValueError("q: zero quaternion has no rotation")
    return _math.quat_to_rot(q)


def matrix_to_quaternion(R: torch.Tensor) -> torch.Tensor:
    """Convert rotation matrices ``(…, 3, 3)`` to unit quaternions ``(…, 4)`` (w >= 0).

    Uses the largest of the four candidate denominators (Shepperd's method), so it is
    stable for every rotation, including 180°.
    """
    return _math.rot_to_quat(R)


def random_rotation(
    n: int | None = None,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Rotations drawn uniformly from SO(3) (normalised Gaussian quaternions).

    Returns ``(3, 3)`` when ``n`` is None, else ``(n, 3, 3)``.
    """
    shape = (1 if n is None else n, 4)
    q = torch.randn(shape, generator=generator, dtype=torch.float64)
    R = quaternion_to_matrix(q).to(dtype=dtype, device=device)
    return R[0] if n is None else R


def axis_angle_to_matrix(axis: torch.Tensor, angle: torch.Tensor | float) -> torch.Tensor:
    """Rotation about ``axis (…, 3)`` (any length > 0) by ``angle`` radians → ``(…, 3, 3)``."""
    axis = torch.as_tensor(axis, dtype=torch.float64)
    a = axis / axis.norm(dim=-1, keepdim=True)
    return so3_exp(a * torch.as_tensor(angle, dtype=a.dtype)[..., None])


def so3_exp(omega: torch.Tensor) -> torch.Tensor:
    """Rodrigues: rotation vectors ``(…, 3)`` (radians) → ``(…, 3, 3)``; exact near 0.

    See :func:`pointalign._math.so3_exp`.
    """
    return _math.so3_exp(omega)


def so3_log(R: torch.Tensor) -> torch.Tensor:
    """Rotation vectors ``(…, 3)`` from rotation matrices ``(…, 3, 3)``; |result| ≤ π.

    Goes through the quaternion, which is stable near 0 and near π
    (:func:`pointalign._math.so3_log`).
    """
    return _math.so3_log(R)


def _V(omega: torch.Tensor) -> torch.Tensor:
    theta2 = (omega * omega).sum(-1)[..., None, None]
    theta = theta2.sqrt()
    K = skew(omega)
    small = theta2 < 1e-10
    safe = torch.where(small, torch.ones_like(theta), theta)
    b = torch.where(small, 0.5 - theta2 / 24, (1 - torch.cos(safe)) / (safe * safe))
    c = torch.where(small, 1.0 / 6 - theta2 / 120, (safe - torch.sin(safe)) / (safe ** 3))
    eye = torch.eye(3, dtype=omega.dtype, device=omega.device)
    return eye + b * K + c * (K @ K)


def se3_exp(xi: torch.Tensor) -> torch.Tensor:
    """Twists ``(…, 6)`` = (omega, v) → transforms ``(…, 4, 4)``."""
    omega, v = xi[..., :3], xi[..., 3:]
    R = so3_exp(omega)
    t = (_V(omega) @ v[..., None])[..., 0]
    return make(R, t)


def se3_log(T: torch.Tensor) -> torch.Tensor:
    """Map transforms ``(…, 4, 4)`` to twists ``(…, 6)`` = (omega, v); inverts :func:`se3_exp`."""
    omega = so3_log(T[..., :3, :3])
    t = T[..., :3, 3]
    v = torch.linalg.solve(_V(omega), t[..., None])[..., 0]
    return torch.cat([omega, v], -1)


def rotation_angle(R: torch.Tensor) -> torch.Tensor:
    """Angle in radians of rotations ``(…, 3, 3)``, robust near 0 and π."""
    return so3_log(R).norm(dim=-1)


def random_transform(
    rotation_deg: float,
    translation: float,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Return a random ``(4, 4)`` transform of exact rotation angle and translation length.

    It rotates by exactly ``rotation_deg`` about a random axis and translates by exactly
    ``translation`` along a random direction.
    """
    axis = torch.randn(3, generator=generator, dtype=torch.float64)
    direction = torch.randn(3, generator=generator, dtype=torch.float64)
    R = axis_angle_to_matrix(axis, math.radians(rotation_deg))
    t = direction / direction.norm() * translation
    return make(R, t).to(dtype)
