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

Inputs: torch tensors, or anything :mod:`pointalign._validate` turns into one (NumPy arrays,
lists); results are tensors. Integer inputs are promoted to float32; ``bool`` and complex
dtypes, wrong trailing shapes, batch shapes that do not broadcast and tensors on different
devices raise a ``ValueError``/``TypeError`` naming the argument. Values are not scanned for
NaN (that would synchronise the device in the loops that call these functions).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from pointalign import _math, _validate

_TAILS = {(3,): "(…, 3)", (4,): "(…, 4)", (6,): "(…, 6)", (3, 3): "(…, 3, 3)",
          (4, 4): "(…, 4, 4)"}


def _arg(x: Any, name: str, tail: tuple[int, ...], *, float_dtype: torch.dtype | None = None
         ) -> torch.Tensor:
    """``x`` as a real floating tensor whose trailing dimensions are ``tail``."""
    t = x if isinstance(x, torch.Tensor) else _validate._to_tensor(name, x)
    if t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name}: expected a real floating-point array, got dtype {t.dtype}")
    if not t.dtype.is_floating_point or t.dtype in (torch.float16, torch.bfloat16):
        t = t.to(float_dtype or torch.float32)
    if t.dim() < len(tail) or tuple(t.shape[t.dim() - len(tail):]) != tail:
        raise ValueError(f"{name}: expected shape {_TAILS[tail]}, got {tuple(t.shape)}")
    return t


def _same_device(**tensors: torch.Tensor) -> None:
    devs = {n: t.device for n, t in tensors.items()}
    if len(set(devs.values())) > 1:
        desc = ", ".join(f"{n} on {d}" for n, d in devs.items())
        raise ValueError(f"{next(iter(devs))}: the arguments are on different devices ({desc})")


def _batch(what: str, *shapes: torch.Size) -> tuple[int, ...]:
    """Broadcast batch shapes (NumPy rules), or a ValueError naming ``what``."""
    nd = max(len(s) for s in shapes)
    out = []
    for dims in zip(*((1,) * (nd - len(s)) + tuple(s) for s in shapes), strict=True):
        sizes = {d for d in dims if d != 1}
        if len(sizes) > 1:
            raise ValueError(f"{what}: batch shapes {', '.join(str(tuple(s)) for s in shapes)} "
                             "do not broadcast")
        out.append(sizes.pop() if sizes else min(dims))
    return tuple(out)


def make(rotation: torch.Tensor, translation: torch.Tensor) -> torch.Tensor:
    """Build ``(…, 4, 4)`` from rotation ``(…, 3, 3)`` and translation ``(…, 3)``."""
    rotation = _arg(rotation, "rotation", (3, 3))
    translation = _arg(translation, "translation", (3,))
    _same_device(rotation=rotation, translation=translation)
    translation = translation.to(rotation.dtype)
    batch = _batch("translation", rotation.shape[:-2], translation.shape[:-1])
    T = torch.zeros(*batch, 4, 4, dtype=rotation.dtype, device=rotation.device)
    T[..., :3, :3] = rotation
    T[..., :3, 3] = translation
    T[..., 3, 3] = 1
    return T


def compose(*Ts: torch.Tensor) -> torch.Tensor:
    """Matrix product ``Ts[0] @ Ts[1] @ …`` (apply the last one first).

    Args:
        *Ts: one or more ``(…, 4, 4)`` transforms on one device (batch shapes broadcast;
            mixed float dtypes are promoted).

    Returns:
        ``(…, 4, 4)`` tensor.

    """
    if not Ts:
        raise TypeError("Ts: compose() needs at least one (…, 4, 4) transform")
    mats = [_arg(T, f"Ts[{i}]", (4, 4)) for i, T in enumerate(Ts)]
    _same_device(**{f"Ts[{i}]": T for i, T in enumerate(mats)})
    _batch("Ts", *(T.shape[:-2] for T in mats))
    out = mats[0]
    for T in mats[1:]:
        dt = torch.promote_types(out.dtype, T.dtype)
        out = out.to(dt) @ T.to(dt)
    return out


def invert(T: torch.Tensor) -> torch.Tensor:
    """Inverse of rigid ``(…, 4, 4)`` transforms, ``[R^T, -R^T t]`` (exact, no matrix inverse)."""
    return _math.invert_rigid(_arg(T, "T", (4, 4)))


def apply(T: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """Transform points: ``points (…, N, 3)`` by ``T (…, 4, 4)`` → ``(…, N, 3)``.

    Computed in ``T``'s precision and returned in ``points``' dtype (integer points: float32).
    ``T``'s batch dimensions must broadcast against ``points``' (``(4, 4)`` with
    ``(B, N, 3)``, ``(B, 4, 4)`` with ``(B, N, 3)`` or with ``(N, 3)``).
    """
    T = _arg(T, "T", (4, 4))
    points = _arg(points, "points", (3,))
    if points.dim() < 2:
        raise ValueError(f"points: expected shape (…, N, 3), got {tuple(points.shape)}")
    _same_device(T=T, points=points)
    _batch("points", T.shape[:-2], points.shape[:-2])
    R = T[..., :3, :3]
    t = T[..., None, :3, 3]
    return (points.to(T.dtype) @ R.transpose(-1, -2) + t).to(points.dtype)


def skew(v: torch.Tensor) -> torch.Tensor:
    """Cross-product matrices ``[v]_x`` of shape ``(…, 3, 3)`` for ``v (…, 3)``."""
    return _math.skew(_arg(v, "v", (3,)))


def quaternion_to_matrix(q: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """Rotation matrices ``(…, 3, 3)`` from quaternions ``(…, 4)`` = (w, x, y, z).

    The quaternion is normalised first (:func:`pointalign._math.quat_to_rot`); a zero
    quaternion raises ``ValueError``. With ``check=False`` (inside device loops: no host
    sync) that test is skipped and a zero quaternion gives the identity.
    """
    q = _arg(q, "q", (4,))
    if check and bool((q.norm(dim=-1) == 0).any()):
        raise ValueError("q: zero quaternion has no rotation")
    return _math.quat_to_rot(q)


def matrix_to_quaternion(R: torch.Tensor) -> torch.Tensor:
    """Convert rotation matrices ``(…, 3, 3)`` to unit quaternions ``(…, 4)`` (w >= 0).

    Uses the largest of the four candidate denominators (Shepperd's method), so it is
    stable for every rotation, including 180°.
    """
    return _math.rot_to_quat(_arg(R, "R", (3, 3)))


def random_rotation(
    n: int | None = None,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Rotations drawn uniformly from SO(3) (normalised Gaussian quaternions).

    Returns ``(3, 3)`` when ``n`` is None, else ``(n, 3, 3)`` (``n >= 0``; NumPy integers
    accepted). ``dtype`` is a floating dtype; the draw is made on the host with
    ``generator`` (a CPU ``torch.Generator``), so a seed gives the same rotations on every
    device.
    """
    if n is not None:
        n = _validate.integer(n, "n", minimum=0)
    _generator(generator)
    _float_dtype(dtype)
    dev = _validate.as_device(device)
    shape = (1 if n is None else n, 4)
    q = torch.randn(shape, generator=generator, dtype=torch.float64)
    R = quaternion_to_matrix(q).to(dtype=dtype, device=dev)
    return R[0] if n is None else R


def _generator(generator: Any) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got "
                        f"{type(generator).__name__}")
    if generator is not None and generator.device.type != "cpu":
        raise ValueError(f"generator: expected a CPU torch.Generator, got one on "
                         f"{generator.device}")


def _float_dtype(dtype: Any) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a torch floating dtype (torch.float32, "
                        f"torch.float64), got {dtype!r}")


def axis_angle_to_matrix(axis: torch.Tensor, angle: torch.Tensor | float) -> torch.Tensor:
    """Rotation about ``axis (…, 3)`` (any length > 0) by ``angle`` radians → ``(…, 3, 3)``.

    Computed and returned in float64 on the axis' device. ``angle`` is a number or a tensor
    broadcasting against the axis' batch shape. A zero-length axis raises ``ValueError``
    (it defines no rotation); NaN/Inf in the axis or the angle too.
    """
    axis = _arg(axis, "axis", (3,)).to(torch.float64)
    if isinstance(angle, (torch.Tensor, np.ndarray, list, tuple)):
        ang = _validate._to_tensor("angle", angle)
        if ang.is_complex() or ang.dtype == torch.bool:
            raise TypeError(f"angle: expected real numbers, got dtype {ang.dtype}")
        ang = ang.to(torch.float64)
        _same_device(axis=axis, angle=ang)
    else:
        ang = torch.tensor(_validate._number(angle, "angle"), dtype=torch.float64,
                           device=axis.device)
    _batch("angle", axis.shape[:-1], ang.shape)
    norm = axis.norm(dim=-1, keepdim=True)
    if not bool(torch.isfinite(norm).all()) or bool((norm == 0).any()):
        raise ValueError("axis: must be non-zero and finite (a zero axis defines no rotation)")
    if not bool(torch.isfinite(ang).all()):
        raise ValueError("angle: contains NaN or Inf")
    return so3_exp(axis / norm * ang[..., None])


def so3_exp(omega: torch.Tensor) -> torch.Tensor:
    """Rodrigues: rotation vectors ``(…, 3)`` (radians) → ``(…, 3, 3)``; exact near 0.

    See :func:`pointalign._math.so3_exp`.
    """
    return _math.so3_exp(_arg(omega, "omega", (3,)))


def so3_log(R: torch.Tensor) -> torch.Tensor:
    """Rotation vectors ``(…, 3)`` from rotation matrices ``(…, 3, 3)``; |result| ≤ π.

    Goes through the quaternion, which is stable near 0 and near π
    (:func:`pointalign._math.so3_log`).
    """
    return _math.so3_log(_arg(R, "R", (3, 3)))


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
    xi = _arg(xi, "xi", (6,))
    omega, v = xi[..., :3], xi[..., 3:]
    R = so3_exp(omega)
    t = (_V(omega) @ v[..., None])[..., 0]
    return make(R, t)


def se3_log(T: torch.Tensor) -> torch.Tensor:
    """Map transforms ``(…, 4, 4)`` to twists ``(…, 6)`` = (omega, v); inverts :func:`se3_exp`."""
    T = _arg(T, "T", (4, 4))
    omega = so3_log(T[..., :3, :3])
    t = T[..., :3, 3]
    v = torch.linalg.solve(_V(omega), t[..., None])[..., 0]
    return torch.cat([omega, v], -1)


def rotation_angle(R: torch.Tensor) -> torch.Tensor:
    """Angle in radians of rotations ``(…, 3, 3)``, robust near 0 and π.

    (:func:`pointalign._math.rotation_angle`: ``atan2(sin θ, cos θ)`` from R's
    antisymmetric part and trace.)
    """
    return _math.rotation_angle(_arg(R, "R", (3, 3)))


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

    Args:
        rotation_deg: rotation angle in degrees (finite).
        translation: translation length (finite, >= 0).
        generator: CPU ``torch.Generator`` (None: the global one).
        dtype: floating dtype of the result.

    """
    rotation_deg = _validate._number(rotation_deg, "rotation_deg")
    if not math.isfinite(rotation_deg):
        raise ValueError(f"rotation_deg: must be finite, got {rotation_deg}")
    translation = _validate.positive(translation, "translation", allow_zero=True)
    _generator(generator)
    _float_dtype(dtype)
    axis = torch.randn(3, generator=generator, dtype=torch.float64)
    direction = torch.randn(3, generator=generator, dtype=torch.float64)
    R = axis_angle_to_matrix(axis, math.radians(rotation_deg))
    t = direction / direction.norm() * translation
    return make(R, t).to(dtype)
