"""Coerce and check inputs once, at the edge of the public API.

Every public function passes its array arguments through :func:`as_points`,
:func:`as_batch`, :func:`as_transform` or :func:`as_vectors`. They accept NumPy arrays,
PyTorch tensors, :class:`~pointalign.cloud.PointCloud`, Open3D point clouds (legacy and
tensor API), ``open3d.core.Tensor`` and any ``__dlpack__`` object, and return tensors; every
error is a ``ValueError`` or ``TypeError`` whose message names the argument, what was
expected and what was given. Inputs are never modified: a tensor that already has the
wanted device and dtype is returned as is (callers must not write into it).

The NaN/Inf scan costs a device synchronisation per array on a GPU. Composite operations
(``register``, the ICP and RANSAC loops) check their own inputs, then run the public
functions they call on arrays derived from them inside :func:`trusted`, which skips that
scan (shapes, dtypes and devices are still checked).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from pointalign.kernels import upload

FLOAT_DTYPES = (torch.float32, torch.float64)


def default_device() -> torch.device:
    """``cuda`` when a CUDA device is present, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def as_device(device: str | torch.device | None, like: torch.Tensor | None = None) -> torch.device:
    """Check an explicit ``device=`` value (else ``like``'s device, else the default).

    The parsing and checks of a device name; a public function resolves its compute device
    with :func:`resolve_device` (the one rule: every input's device is looked at).
    """
    if device is None:
        return like.device if like is not None else default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: cannot interpret {device!r} as a torch device") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {device!r} is not supported; pointalign runs on 'cpu' and "
                         "'cuda' devices")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but no CUDA device is available; "
                         "pass device='cpu'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device: {device!r} requested but only {torch.cuda.device_count()} "
                         "CUDA device(s) exist")
    if dev.type == "cuda" and dev.index is None:
        # "cuda" means the current device; name it, so that it compares equal to the
        # devices of the tensors made on it ("cuda" != "cuda:0" for torch.device)
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_device(device: Any, **inputs: Any) -> torch.device:
    """Resolve ``device=``: explicit value, else the inputs' common device, else default.

    Every public function resolves its compute device here (re-exported as
    :func:`pointalign.registration._edge.resolve_device`).

    Args:
        device: the caller's ``device=`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a
            ``torch.device``) or None.
        **inputs: the call's array arguments by name: arrays, tensors, PointClouds (or lists
            of them). Those that live on a device (tensors, clouds of tensors) must agree.

    Returns:
        ``device`` (checked by :func:`as_device`) when given; else the device of the inputs
        that have one; else :func:`default_device`.

    Raises:
        ValueError: inputs on different devices (the message names each with its device),
            or a bad ``device``.

    """
    devs: dict[str, torch.device] = {}

    def note(name: str, x: Any) -> None:
        pts = x if isinstance(x, torch.Tensor) else getattr(x, "points", None)
        if isinstance(pts, torch.Tensor):
            devs[name] = pts.device

    for name, x in inputs.items():
        if isinstance(x, (list, tuple)):
            for i, c in enumerate(x):
                note(f"{name}[{i}]", c)
        else:
            note(name, x)
    if len(set(devs.values())) > 1:
        desc = ", ".join(f"{k} on {v}" for k, v in devs.items())
        raise ValueError(f"inputs are on different devices: {desc}; move them to one device "
                         "(or pass NumPy arrays and device=)")
    if device is not None:
        return as_device(device)
    if devs:
        return next(iter(devs.values()))
    return default_device()


def _is_open3d(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "open3d"


def _from_open3d(name: str, x: Any) -> torch.Tensor | None:
    """Points of an Open3D object without importing Open3D (duck-typed by module name).

    Legacy ``open3d.geometry.PointCloud``: a zero-copy view of its float64 points.
    ``open3d.t.geometry.PointCloud``: its ``positions`` tensor through DLPack (zero-copy, same
    device). ``open3d.core.Tensor``: through DLPack. Other Open3D objects: None.
    """
    if hasattr(x, "point") and hasattr(x, "to_legacy"):  # tensor PointCloud
        try:
            pos = x.point["positions"]
        except (KeyError, RuntimeError) as exc:
            raise ValueError(f"{name}: the Open3D tensor PointCloud has no positions") from exc
        return _from_dlpack(name, pos)
    if hasattr(x, "points") and hasattr(x, "has_normals"):  # legacy PointCloud
        return torch.from_numpy(np.asarray(x.points))
    if hasattr(x, "__dlpack__") or hasattr(x, "to_dlpack"):
        return _from_dlpack(name, x)
    return None


def _from_dlpack(name: str, x: Any) -> torch.Tensor:
    try:
        if hasattr(x, "__dlpack__"):
            return torch.from_dlpack(x)
        from torch.utils import dlpack

        return dlpack.from_dlpack(x.to_dlpack())
    except (RuntimeError, TypeError, BufferError, ValueError) as exc:
        raise TypeError(f"{name}: cannot read {type(x).__name__} through DLPack ({exc})") from None


def _to_tensor(name: str, x: Any) -> torch.Tensor:
    """Return the tensor behind any accepted array-like, zero-copy where possible.

    Accepted: tensors (as is), NumPy arrays (shared memory), pointalign ``PointCloud`` and
    anything else whose ``.points`` is a tensor, Open3D legacy and tensor point clouds,
    ``open3d.core.Tensor``, any object with ``__dlpack__`` (CuPy, JAX, …: zero-copy on its
    own device through ``torch.from_dlpack``), and lists/tuples of numbers.
    """
    if isinstance(x, torch.Tensor):
        if x.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name}: a tensor on {x.device}; pointalign runs on 'cpu' and "
                             "'cuda' devices")
        # registration is not differentiable: a view without the autograd graph
        return x.detach() if x.requires_grad else x
    if isinstance(x, np.ndarray):
        if x.dtype == object or not (
            np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)
        ):
            raise TypeError(f"{name}: expected a numeric array, got dtype {x.dtype}")
        # (ascontiguousarray turns a 0-d array into shape (1,): keep the shape)
        return torch.from_numpy(np.ascontiguousarray(x).reshape(x.shape))
    pts = getattr(x, "points", None)
    if isinstance(pts, torch.Tensor):  # PointCloud (duck-typed: no import of cloud.py)
        return pts.detach() if pts.requires_grad else pts
    if _is_open3d(x):
        t = _from_open3d(name, x)
        if t is not None:
            return t
    elif hasattr(x, "__dlpack__"):
        return _from_dlpack(name, x)
    if isinstance(x, (list, tuple)):
        try:
            arr = np.asarray(x, dtype=np.float64)
        except (ValueError, TypeError) as exc:
            raise TypeError(
                f"{name}: cannot convert {type(x).__name__} to a numeric array") from exc
        return torch.from_numpy(arr)
    raise TypeError(
        f"{name}: expected a NumPy array, torch tensor, PointCloud, Open3D point cloud or "
        f"DLPack array, got {type(x).__module__}.{type(x).__name__}"
    )


#: the kinds of input :func:`kind` tells apart (the rule for outputs: :func:`as_kind`)
KINDS = ("numpy", "torch", "pointcloud", "open3d", "open3d_tensor")


def kind(x: Any) -> str:
    """Tell what kind of array-like ``x`` is, for an output that follows its input's kind.

    The rule for array outputs, in one place (:func:`as_kind` applies it):

    * ``"numpy"``: a NumPy array (or a list of numbers) -> NumPy out;
    * ``"torch"``: a tensor, or any other ``__dlpack__`` array -> a tensor on its device;
    * ``"pointcloud"``: a ``PointCloud`` -> a cloud where the output
      is a cloud (voxel_downsample, preprocess), else a tensor: per-point arrays (normals,
      features, covariances, masks) on the cloud's device, the storage a PointCloud holds;
    * ``"open3d"``: a legacy ``open3d.geometry.PointCloud`` -> a legacy cloud where the
      output is a cloud, else NumPy (what Open3D's users read with ``np.asarray``);
    * ``"open3d_tensor"``: an ``open3d.t.geometry.PointCloud`` -> a tensor-API cloud where the
      output is a cloud, else NumPy.
    """
    if isinstance(x, torch.Tensor):
        return "torch"
    if isinstance(x, np.ndarray) or isinstance(x, (list, tuple)):
        return "numpy"
    if _is_open3d(x):
        if hasattr(x, "point") and hasattr(x, "to_legacy"):
            return "open3d_tensor"
        if hasattr(x, "points") and hasattr(x, "has_normals"):
            return "open3d"
        return "torch"  # open3d.core.Tensor: read through DLPack
    if isinstance(getattr(x, "points", None), torch.Tensor):
        return "pointcloud"
    return "torch"


def as_kind(t: torch.Tensor, like: str) -> Any:
    """Return the per-point array ``t`` as the kind :func:`kind` named for the input.

    ``"numpy"``, ``"open3d"`` and ``"open3d_tensor"``: a NumPy array (on the host);
    ``"torch"`` and ``"pointcloud"``: ``t`` itself.
    """
    if like in ("numpy", "open3d", "open3d_tensor"):
        return t.detach().cpu().numpy()
    return t


def cloud_as_kind(cloud: Any, like: str) -> Any:
    """Return a PointCloud output as the kind of the input it came from (see :func:`kind`).

    ``"pointcloud"``: the PointCloud; ``"open3d"`` / ``"open3d_tensor"``: an Open3D cloud of
    that API with the points, normals and colours (and, for the tensor API, the extras);
    ``"numpy"``: the points as an ``(N, 3)`` NumPy array; ``"torch"``: the points tensor.
    """
    if like == "pointcloud":
        return cloud
    if like == "open3d":
        return cloud.to_open3d()
    if like == "open3d_tensor":
        return cloud.to_open3d(tensor=True)
    return as_kind(cloud.points, like)


def cloud_normals(cloud: Any) -> Any:
    """Return the normals a cloud carries, or None: ``(N, 3)`` in the cloud's own kind.

    A ``PointCloud``'s ``normals``; a legacy Open3D cloud's
    ``normals`` when ``has_normals()`` (its ``Vector3dVector`` read as a NumPy array: empty
    when it has none); a tensor-API Open3D cloud's ``point["normals"]``. Anything else
    (arrays, tensors, lists of clouds): None.
    """
    if _is_open3d(cloud):
        if hasattr(cloud, "point") and hasattr(cloud, "to_legacy"):  # tensor API
            return cloud.point["normals"] if "normals" in set(cloud.point) else None
        if hasattr(cloud, "has_normals") and hasattr(cloud, "normals"):  # legacy
            return np.asarray(cloud.normals) if cloud.has_normals() else None
        return None
    if isinstance(getattr(cloud, "points", None), torch.Tensor):  # PointCloud (duck-typed)
        return getattr(cloud, "normals", None)
    return None


def _float(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name}: expected a real floating-point array, got dtype {t.dtype}")
    if dtype is not None:
        return t.to(dtype)
    if t.dtype not in FLOAT_DTYPES:
        # integers and half precision are promoted; float64 stays float64
        return t.to(torch.float32)
    return t


#: set inside :func:`trusted`
_TRUSTED = contextvars.ContextVar("pointalign_trusted", default=False)


@contextlib.contextmanager
def trusted():
    """Within this block, arrays are finite by construction: the NaN/Inf scans are skipped.

    For internal callers only, on arrays they derived from validated inputs (downsampled
    points, normals, neighbour tables, points moved by finite transforms).
    """
    token = _TRUSTED.set(True)
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def is_trusted() -> bool:
    """Tell whether the caller runs inside :func:`trusted`."""
    return _TRUSTED.get()


def _check_finite(name: str, t: torch.Tensor) -> None:
    if _TRUSTED.get() or not t.numel():
        return
    # one reduction: a NaN or an infinity makes the sum non-finite; a non-finite sum of
    # finite values (an overflow) is told apart by the element-wise test (on 2 CPU threads
    # 7 us against 86 us at 25k points, 75 us against 3.5 ms at 1M)
    if math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all()):
        return
    bad = int((~torch.isfinite(t)).any(dim=-1).sum()) if t.dim() > 1 else -1
    raise _not_finite(name, bad)


def _not_finite(name: str, bad: int) -> ValueError:
    """Make the error of :func:`_check_finite`: ``bad`` rows hold NaN/Inf (-1: 1-D)."""
    what = f"{bad} rows contain" if bad >= 0 else "contains"
    return ValueError(f"{name}: {what} NaN or Inf values")


def as_points(
    x: Any,
    name: str = "points",
    *,
    min_points: int = 1,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Turn one cloud into a ``(N, 3)`` float tensor.

    Args:
        x: ``(N, 3)`` NumPy array, tensor or PointCloud.
        name: argument name used in error messages.
        min_points: fewest points the calling operation needs.
        device: move to this device (default: keep).
        dtype: cast to this dtype (default: keep float32/float64, promote others to float32).

    Raises:
        TypeError: not an array, or a non-numeric dtype.
        ValueError: wrong shape, too few points, NaN/Inf.

    """
    t = _points_shape(x, name, min_points, dtype)
    if device is not None:
        t = t.to(as_device(device))
    _check_finite(name, t)
    return t


def _points_shape(x: Any, name: str, min_points: int, dtype: torch.dtype | None
                  ) -> torch.Tensor:
    """:func:`as_points`' checks before the device and the NaN/Inf scan (same errors)."""
    t = _to_tensor(name, x)
    if t.dim() != 2 or t.shape[-1] != 3:
        raise ValueError(f"{name}: expected shape (N, 3), got {tuple(t.shape)}")
    if t.shape[0] == 0:
        raise ValueError(f"{name}: the cloud is empty (0 points)")
    if t.shape[0] < min_points:
        raise ValueError(
            f"{name}: this operation needs at least {min_points} points, got {t.shape[0]}"
        )
    return _float(name, t, dtype)


class ManyPoints(NamedTuple):
    """What :func:`as_points_many` returns (see there)."""

    points: torch.Tensor
    clouds: list[torch.Tensor | ValueError | TypeError]
    shaped: list[bool]
    dtypes: list[torch.dtype | None]


def as_points_many(
    xs: Sequence[Any],
    names: Sequence[str],
    *,
    min_points: int = 1,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    cat_dtype: torch.dtype | None = None,
) -> ManyPoints:
    """:func:`as_points` of many clouds at once: one copy to the device, one NaN/Inf scan.

    Each ``xs[i]`` is checked as ``as_points(xs[i], names[i], min_points=min_points,
    dtype=dtype)`` checks it, and gets the same error where that raises (the shape, dtype
    and size checks first, then NaN/Inf, skipped inside :func:`trusted`); the clouds that
    pass are concatenated in ``cat_dtype`` (default: the promotion of their dtypes, which
    holds each exactly), moved to ``device`` in one copy and scanned for NaN/Inf in one pass
    (a row count per cloud only where something is not finite). The inputs are not
    modified.

    Args:
        xs: the clouds (arrays, tensors, PointClouds, …: what :func:`as_points` takes).
        names: each cloud's argument name, for its error.
        min_points: fewest points a cloud may have.
        device: the device of the result (default: the first valid cloud's; clouds
            elsewhere are copied there).
        dtype: as :func:`as_points` (None: float32/float64 kept, others promoted to
            float32).
        cat_dtype: the concatenation's dtype.

    Returns:
        :class:`ManyPoints`: ``points (R, 3)``, the rows of the clouds that passed the shape
        checks concatenated in order on the device; ``clouds``: per cloud its ``(n_i, 3)``
        view of ``points`` or the exception :func:`as_points` would have raised for it;
        ``shaped``: per cloud whether it passed the shape, dtype and size checks (its rows
        are in ``points``; an error of such a cloud is the NaN/Inf one); ``dtypes``: the
        dtype :func:`as_points` returns for each such cloud (None for the others).

    """
    if len(xs) != len(names):
        raise ValueError(f"names: expected {len(xs)} names (one per cloud), got {len(names)}")
    results: list[torch.Tensor | ValueError | TypeError] = []
    parts: list[torch.Tensor] = []
    for x, name in zip(xs, names, strict=True):
        try:
            t = _points_shape(x, name, min_points, dtype)
        except (ValueError, TypeError) as exc:
            results.append(exc)
            continue
        results.append(t)
        parts.append(t)
    shaped = [not isinstance(r, Exception) for r in results]
    dtypes = [r.dtype if isinstance(r, torch.Tensor) else None for r in results]
    dev = as_device(device) if device is not None else (
        parts[0].device if parts else torch.device("cpu"))
    if cat_dtype is None:
        cat_dtype = functools.reduce(torch.promote_types, {t.dtype for t in parts},
                                     torch.float32)
    if not parts:
        return ManyPoints(torch.zeros(0, 3, dtype=cat_dtype, device=dev), results, shaped,
                          dtypes)
    homes = {t.device for t in parts}
    rows = sum(int(t.shape[0]) for t in parts)
    if len(homes) == 1:  # one concatenation where they live, then one copy
        cat = torch.empty((rows, 3), dtype=cat_dtype, device=parts[0].device)
        torch.cat(parts, out=cat)
        cat = cat.to(dev)
    else:
        cat = torch.cat([t.to(dev, cat_dtype) for t in parts])
    sizes = [int(t.shape[0]) for t in parts]
    views = list(torch.split(cat, sizes))
    bad: list[int] | None = None
    if not _TRUSTED.get() and cat.numel():
        ok = torch.isfinite(cat).all(1)
        if not bool(ok.all()):
            own = torch.repeat_interleave(torch.arange(len(sizes), device=dev),
                                          torch.tensor(sizes, device=dev),
                                          output_size=len(ok))
            bad = torch.zeros(len(sizes), dtype=torch.int64, device=dev).index_add_(
                0, own, (~ok).to(torch.int64)).tolist()
    j = 0
    for i, r in enumerate(results):
        if isinstance(r, Exception):
            continue
        results[i] = views[j] if bad is None or not bad[j] else _not_finite(names[i], bad[j])
        j += 1
    return ManyPoints(cat, results, shaped, dtypes)


def as_batch(
    x: Any,
    name: str = "points",
    *,
    lengths: Any = None,
    min_points: int = 1,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Turn one cloud ``(N, 3)`` or a padded batch ``(B, N, 3)`` into ``(B, N, 3)`` + lengths.

    Args:
        x: ``(N, 3)`` or ``(B, N, 3)`` array/tensor, a PointCloud, or a list of ``(N_b, 3)``
            clouds (padded with zeros here).
        name: argument name used in error messages.
        min_points: fewest points per cloud the calling operation needs.
        device: move to this device (default: keep).
        dtype: cast to this dtype (default: as :func:`as_points`).
        lengths: ``(B,)`` integer count of valid points per batch entry; default all N.
            Padding rows (index >= length) may hold anything finite.

    Returns:
        ``(points (B, N, 3), lengths (B,) int64, batched)`` where ``batched`` says whether
        the input had a batch dimension (so results can be returned in the same form).

    """
    if isinstance(x, (list, tuple)) and x and not isinstance(x[0], (int, float)):
        if not all(hasattr(c, "shape") or hasattr(c, "points") or hasattr(c, "point")
                   or hasattr(c, "__dlpack__") for c in x):
            x = _to_tensor(name, x)
        elif device is not None:  # every cloud to one device: checked all at once
            return _as_batch_list(x, name, min_points, device, dtype)
        else:
            clouds = [as_points(c, f"{name}[{i}]", min_points=min_points, device=device,
                                dtype=dtype) for i, c in enumerate(x)]
            dev = clouds[0].device
            if any(c.device != dev for c in clouds):
                raise ValueError(f"{name}: clouds are on different devices")
            dt = torch.promote_types(clouds[0].dtype, clouds[-1].dtype)
            n_max = max(c.shape[0] for c in clouds)
            out = torch.zeros(len(clouds), n_max, 3, dtype=dt, device=dev)
            for i, c in enumerate(clouds):
                out[i, : c.shape[0]] = c
            lens = upload([c.shape[0] for c in clouds], dtype=torch.int64, device=dev)
            return out, lens, True
    t = _to_tensor(name, x)
    if t.dim() == 2:
        p = as_points(t, name, min_points=min_points, device=device, dtype=dtype)
        lens = torch.full((1,), p.shape[0], dtype=torch.int64, device=p.device)
        if lengths is not None:
            raise ValueError(f"{name}: lengths given but {name} has no batch dimension")
        return p.unsqueeze(0), lens, False
    if t.dim() != 3 or t.shape[-1] != 3:
        raise ValueError(f"{name}: expected shape (N, 3) or (B, N, 3), got {tuple(t.shape)}")
    if t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{name}: the batch is empty, shape {tuple(t.shape)}")
    t = _float(name, t, dtype)
    if device is not None:
        t = t.to(as_device(device))
    _check_finite(name, t)
    if lengths is None:  # every entry full: checked on the host, no wait for the device
        lens = torch.full((t.shape[0],), t.shape[1], dtype=torch.int64, device=t.device)
        short = t.shape[1] < min_points
    else:
        lens = torch.as_tensor(lengths) if isinstance(lengths, (list, tuple)) \
            else _to_tensor(f"{name} lengths", lengths)
        if lens.dtype.is_floating_point or lens.dtype == torch.bool:
            raise TypeError(f"{name} lengths: expected integers, got {lens.dtype}")
        lens = lens.to(device=t.device, dtype=torch.int64).reshape(-1)
        if lens.shape[0] != t.shape[0]:
            raise ValueError(
                f"{name} lengths: expected {t.shape[0]} entries (one per batch item), "
                f"got {lens.shape[0]}"
            )
        if bool((lens > t.shape[1]).any()):
            raise ValueError(f"{name} lengths: a length exceeds the padded size {t.shape[1]}")
        short = bool((lens < min_points).any())
    if short:
        raise ValueError(
            f"{name}: this operation needs at least {min_points} points per cloud, "
            f"got lengths {lens.tolist()}"
        )
    return t, lens, True


def _as_batch_list(x: Sequence[Any], name: str, min_points: int,
                   device: str | torch.device, dtype: torch.dtype | None
                   ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """:func:`as_batch` of a list of clouds moved to ``device``: the same result and errors.

    What the cloud-by-cloud branch gives (each cloud :func:`as_points`'d, the first error in
    the clouds' order raised, the batch in the promotion of the first and the last cloud's
    dtypes, zero-padded), by :func:`as_points_many` (one copy, one NaN/Inf scan) and one
    scatter into the padded batch.
    """
    many = as_points_many(x, [f"{name}[{i}]" for i in range(len(x))],
                          min_points=min_points, device=device, dtype=dtype)
    for r in many.clouds:
        if not isinstance(r, torch.Tensor):
            raise r
    first, last = many.dtypes[0], many.dtypes[-1]
    assert first is not None and last is not None
    sizes = [int(c.shape[0]) for c in many.clouds]  # type: ignore[union-attr]
    dev, total, n_max = many.points.device, sum(sizes), max(sizes)
    lens = upload(sizes, dtype=torch.int64, device=dev)
    owner = torch.repeat_interleave(torch.arange(len(sizes), device=dev), lens,
                                    output_size=total)
    col = torch.arange(total, device=dev) - (torch.cumsum(lens, 0) - lens)[owner]
    out = torch.zeros(len(sizes), n_max, 3, dtype=torch.promote_types(first, last),
                      device=dev)
    out.view(-1, 3).index_copy_(0, owner * n_max + col, many.points.to(out.dtype))
    return out, lens, True


def as_vectors(
    x: Any, name: str, n: int, *, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Per-point vectors (normals, …) of shape ``(n, 3)`` matching a cloud of n points."""
    t = _to_tensor(name, x)
    if t.shape != (n, 3):
        raise ValueError(f"{name}: expected shape ({n}, 3), got {tuple(t.shape)}")
    t = _float(name, t, dtype).to(device)
    _check_finite(name, t)
    return t


def as_transform(
    x: Any,
    name: str = "init",
    *,
    batch: int | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Turn a rigid transform into a ``(4, 4)`` (or ``(B, 4, 4)`` when ``batch``) tensor.

    ``None`` means the identity. A ``(4, 4)`` input with ``batch=B`` is broadcast to B.
    The rotation block must be orthonormal with determinant +1 (tolerance 1e-4) and the
    last row must be ``[0, 0, 0, 1]``.
    """
    dev = as_device(device) if device is not None else None
    if x is None:
        eye = torch.eye(4, dtype=dtype, device=dev)
        return eye if batch is None else eye.expand(batch, 4, 4).clone()
    t = _to_tensor(name, x)
    if t.shape[-2:] != (4, 4) or t.dim() not in (2, 3):
        raise ValueError(f"{name}: expected a (4, 4) or (B, 4, 4) transform, got {tuple(t.shape)}")
    t = _float(name, t, dtype)
    if dev is not None:
        t = t.to(dev)
    _check_finite(name, t)
    if batch is not None:
        if t.dim() == 2:
            t = t.expand(batch, 4, 4).clone()
        elif t.shape[0] != batch:
            raise ValueError(f"{name}: expected {batch} transforms, got {t.shape[0]}")
    elif t.dim() == 3:
        raise ValueError(f"{name}: expected a single (4, 4) transform, got {tuple(t.shape)}")
    # checked on the host in NumPy: one transfer, and a few 4×4s are far cheaper there
    h = t.detach().to("cpu", torch.float64).numpy()
    r = h[..., :3, :3]
    orth = np.abs(np.swapaxes(r, -1, -2) @ r - np.eye(3)).max()
    last = np.abs(h[..., 3, :] - np.array([0.0, 0.0, 0.0, 1.0])).max()
    if orth > 1e-4 or bool((np.linalg.det(r) < 0).any()) or last > 1e-9:
        raise ValueError(
            f"{name}: not a rigid transform (rotation block must be orthonormal with det +1 "
            f"and the last row [0, 0, 0, 1]); orthogonality error {float(orth):.2e}"
        )
    return t


def same_device(**tensors: torch.Tensor) -> torch.device:
    """Check that all named tensors live on one device and return it."""
    devs = {name: t.device for name, t in tensors.items() if t is not None}
    uniq = set(devs.values())
    if len(uniq) > 1:
        desc = ", ".join(f"{k} on {v}" for k, v in devs.items())
        raise ValueError(f"inputs are on different devices: {desc}; move them to one device")
    return uniq.pop()


def _number(value: Any, name: str) -> float:
    """Return a real scalar (Python/NumPy number, 0-d real array) as a float; else TypeError."""
    if isinstance(value, (bool, np.bool_)) or isinstance(value, (str, bytes, complex)) or \
            isinstance(value, np.complexfloating):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__} {value!r}")
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim != 0 or value.dtype in (torch.bool, np.bool_) or \
                (isinstance(value, torch.Tensor) and value.is_complex()) or \
                (isinstance(value, np.ndarray) and not np.issubdtype(value.dtype, np.number)) \
                or (isinstance(value, np.ndarray) and np.iscomplexobj(value)):
            raise TypeError(f"{name}: expected a real number, got a {type(value).__name__} of "
                            f"shape {tuple(value.shape)} and dtype {value.dtype}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}") from None


def integer(value: Any, name: str, *, minimum: int | None = None,
            maximum: int | None = None) -> int:
    """Check an integer argument and return it as a Python ``int``.

    Accepted: ``int`` and NumPy integers (``np.int64(10)``) and 0-d integer tensors; refused
    with a ``TypeError``: ``bool``, floats (``10.0``, NaN), strings, None. Out of
    ``[minimum, maximum]``: ``ValueError`` stating the range.
    """
    ok = not isinstance(value, (bool, np.bool_)) and (
        isinstance(value, (int, np.integer))
        or (isinstance(value, torch.Tensor) and value.ndim == 0
            and not value.dtype.is_floating_point and not value.is_complex()
            and value.dtype != torch.bool))
    if not ok:
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
    v = int(value)
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        lo = "" if minimum is None else f">= {minimum}"
        hi = "" if maximum is None else f"<= {maximum}"
        raise ValueError(f"{name}: must be an integer {' and '.join(x for x in (lo, hi) if x)}"
                         f", got {v}")
    return v


def positive(value: Any, name: str, *, allow_zero: bool = False) -> float:
    """Check a real scalar is finite and > 0 (or >= 0); NumPy scalars are accepted."""
    v = _number(value, name)
    if not np.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}: must be finite and {bound}, got {value}")
    return v


def in_range(value: Any, name: str, lo: float, hi: float, *, low_closed: bool = False,
             high_closed: bool = False) -> float:
    """Check ``lo < value < hi`` (ends included where ``low_closed`` / ``high_closed``).

    The message states the interval, e.g. ``armijo beta: must lie in (0, 1), got 1.5``.
    """
    v = _number(value, name)
    above = v >= lo if low_closed else v > lo
    below = v <= hi if high_closed else v < hi
    if not (np.isfinite(v) and above and below):
        span = f"{'[' if low_closed else '('}{lo:g}, {hi:g}{']' if high_closed else ')'}"
        raise ValueError(f"{name}: must lie in {span}, got {value}")
    return v


def probability(value: Any, name: str, *, zero: bool = False, one: bool = False) -> float:
    """Check a probability / fraction in ``(0, 1)``; ``zero`` / ``one`` include the ends."""
    return in_range(value, name, 0.0, 1.0, low_closed=zero, high_closed=one)


def choice(value: Any, name: str, options: tuple[Any, ...]) -> Any:
    """Check ``value`` is one of ``options`` (ValueError listing them otherwise)."""
    try:
        ok = any(value == o and type(value) is type(o) for o in options) or \
            (isinstance(value, str) and value in options)
    except Exception:  # an array compared to a string, …
        ok = False
    if not ok:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, options))}, "
                         f"got {value!r}")
    return value


def flag(value: Any, name: str, *, none: bool = False) -> bool | None:
    """Check a switch: True or False (NumPy booleans accepted), or None where ``none``."""
    if value is None and none:
        return None
    if not isinstance(value, (bool, np.bool_)):
        allowed = "True, False or None" if none else "True or False"
        raise TypeError(f"{name}: expected {allowed}, got {value!r}")
    return bool(value)


#: seeds go to ``torch.Generator.manual_seed``, which takes 64-bit values
SEED_MAX = 2**64 - 1


def seed(value: Any, name: str = "seed") -> int:
    """Check a random seed: an integer (NumPy integers accepted) in ``[0, 2**64 - 1]``."""
    return integer(value, name, minimum=0, maximum=SEED_MAX)


def normals_for(x: Any, name: str, points: torch.Tensor) -> torch.Tensor:
    """Per-point unit normals ``(N, 3)`` for ``points (N, 3)``: same length, finite.

    Returned on the points' device in their dtype. Wrong length, NaN/Inf, a non-numeric
    dtype: ``ValueError``/``TypeError`` naming ``name``.
    """
    return as_vectors(x, name, int(points.shape[0]), device=points.device, dtype=points.dtype)


def instance(value: Any, cls: type, name: str) -> Any:
    """``value`` if it is a ``cls``, ``cls()`` (the defaults) if None, else a TypeError."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise TypeError(f"{name}: expected a {cls.__name__}, got {type(value).__name__}")
    return value


def out_of_memory_is_clear(fn):
    """Decorate a public entry point: GPU out-of-memory becomes a clear ``MemoryError``.

    The search kernels already fall back to smaller tiles on their own; what still runs out
    of memory (a problem too large for the device as a whole) raises ``MemoryError`` naming
    the function and the way out, instead of a raw CUDA error from deep inside. The kept CUDA
    graphs (their memory pools) and the cached blocks are released first; the inputs are
    untouched (they are never written to).
    """
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except torch.OutOfMemoryError as exc:
            from pointalign.kernels import _loop

            _loop.clear_caches()  # the kept CUDA graphs hold their memory pools
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"
            raise MemoryError(
                f"{fn.__name__}: the device ran out of memory ({first[:200]}). Downsample the "
                "clouds (pointalign.features.downsample.voxel_downsample), split a batch into "
                "smaller ones, or pass device='cpu'") from exc

    return wrapper
