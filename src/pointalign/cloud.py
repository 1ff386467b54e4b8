"""PointCloud: points plus optional per-point attributes, on one device with one dtype."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from pointalign import _validate


@dataclass(frozen=True)
class PointCloud:
    """A point cloud: ``points (N, 3)`` and optional per-point attributes.

    Attributes:
        points: ``(N, 3)`` float tensor, metres by convention.
        normals: optional ``(N, 3)`` float tensor of unit normals (same dtype/device).
        colors: optional ``(N, 3)`` float tensor of RGB in [0, 1].
        features: optional ``(N, D)`` float tensor (e.g. 33-bin FPFH).
        extras: optional dict name -> ``(N,)`` or ``(N, K)`` tensor of other per-point
            fields read from a file (intensity, confidence, …); carried, not interpreted.
        covariances: optional ``(N, 3, 3)`` float tensor of per-point covariances (e.g.
            the plane-regularised ones of
            :func:`pointalign.features.covariances.estimate_covariances`), kept with the
            cloud so that :func:`~pointalign.registration.gicp.gicp` reuses them across
            calls; rotated with the points by :meth:`transform`.

    Construct with NumPy arrays or tensors; everything is coerced to one device and one
    float dtype (that of ``points``) and validated. The object is immutable; use
    :meth:`replace`, :meth:`to` or :meth:`transform` to get modified copies.

    """

    points: torch.Tensor
    normals: torch.Tensor | None = None
    colors: torch.Tensor | None = None
    features: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    covariances: torch.Tensor | None = None

    def __post_init__(self) -> None:
        pts = _validate.as_points(self.points, "points")
        object.__setattr__(self, "points", pts)
        n, dev, dt = pts.shape[0], pts.device, pts.dtype
        for name in ("normals", "colors"):
            val = getattr(self, name)
            if val is not None:
                object.__setattr__(
                    self, name, _validate.as_vectors(val, name, n, device=dev, dtype=dt)
                )
        if self.features is not None:
            f = _validate._to_tensor("features", self.features)
            if f.dim() != 2 or f.shape[0] != n:
                raise ValueError(f"features: expected shape ({n}, D), got {tuple(f.shape)}")
            f = _validate._float("features", f, dt).to(dev)
            _validate._check_finite("features", f)
            object.__setattr__(self, "features", f)
        if self.extras is None:
            object.__setattr__(self, "extras", {})
        if not isinstance(self.extras, Mapping):
            raise TypeError(f"extras: expected a dict of name -> ({n},) or ({n}, K) array, "
                            f"got {type(self.extras).__name__}")
        extras = {}
        for k, v in dict(self.extras).items():
            if not isinstance(k, str):
                raise TypeError(f"extras: keys must be field names (str), got {k!r}")
            t = _validate._to_tensor(f"extras[{k!r}]", v)
            if t.dim() == 0 or t.shape[0] != n:
                raise ValueError(f"extras[{k!r}]: expected ({n},) or ({n}, K) values, one "
                                 f"row per point, got shape {tuple(t.shape)}")
            extras[k] = t.to(dev)
        object.__setattr__(self, "extras", extras)
        if self.covariances is not None:
            c = _validate._to_tensor("covariances", self.covariances)
            if tuple(c.shape) != (n, 3, 3):
                raise ValueError(f"covariances: expected shape ({n}, 3, 3), got "
                                 f"{tuple(c.shape)}")
            c = _validate._float("covariances", c, dt).to(dev)
            _validate._check_finite("covariances", c.reshape(n, 9))
            object.__setattr__(self, "covariances", c)

    def __len__(self) -> int:
        return int(self.points.shape[0])

    def __repr__(self) -> str:
        attrs = [a for a in ("normals", "colors", "features", "covariances")
                 if getattr(self, a) is not None]
        attrs += list(self.extras)
        return (
            f"PointCloud({len(self)} points, {self.dtype}, {self.device}"
            + (f", with {', '.join(attrs)}" if attrs else "")
            + ")"
        )

    @property
    def device(self) -> torch.device:
        """The device all tensors live on."""
        return self.points.device

    @property
    def dtype(self) -> torch.dtype:
        """The float dtype of points, normals and colours."""
        return self.points.dtype

    def replace(self, **changes: Any) -> PointCloud:
        """Copy with some fields replaced (validated again)."""
        return replace(self, **changes)

    def to(self, device: str | torch.device | None = None,
           dtype: torch.dtype | None = None) -> PointCloud:
        """Copy on another device and/or with another float dtype.

        Args:
            device: target device (``"cpu"``, ``"cuda"``, ``"cuda:1"``; None: keep).
            dtype: ``torch.float32`` or ``torch.float64`` (None: keep); other dtypes raise
                ``TypeError`` (a point cloud holds real coordinates).

        """
        if dtype is not None and dtype not in _validate.FLOAT_DTYPES:
            raise TypeError(f"dtype: expected torch.float32 or torch.float64, got {dtype!r}")
        if device is not None:
            device = _validate.as_device(device)

        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=dtype)

        return PointCloud(
            self.points.to(device=device, dtype=dtype), mv(self.normals), mv(self.colors),
            mv(self.features),
            {k: v.to(device) for k, v in self.extras.items()},
            covariances=mv(self.covariances),
        )

    def select(self, index: torch.Tensor | np.ndarray) -> PointCloud:
        """Subset of points (and their attributes) by integer index or boolean mask.

        Args:
            index: ``(K,)`` integer indices in ``[-N, N)`` or an ``(N,)`` boolean mask (NumPy
                array, tensor or list); the result must keep at least one point.

        """
        idx = index if isinstance(index, torch.Tensor) else torch.as_tensor(np.asarray(index))
        n = len(self)
        if idx.dim() != 1:
            raise ValueError(f"index: expected a 1-D index or mask, got shape {tuple(idx.shape)}")
        if idx.dtype == torch.bool:
            if idx.shape[0] != n:
                raise ValueError(f"index: a boolean mask needs {n} entries, got {idx.shape[0]}")
        elif idx.dtype.is_floating_point or idx.is_complex():
            raise TypeError(f"index: expected integers or booleans, got dtype {idx.dtype}")
        elif idx.numel() and not bool(((idx >= -n) & (idx < n)).all()):
            raise ValueError(f"index: entries must lie in [-{n}, {n})")
        idx = idx.to(self.device)

        def sel(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[idx]

        return PointCloud(
            self.points[idx], sel(self.normals), sel(self.colors), sel(self.features),
            {k: v[idx] for k, v in self.extras.items()}, covariances=sel(self.covariances),
        )

    def transform(self, transformation: Any) -> PointCloud:
        """Apply a rigid ``(4, 4)`` transform to points, normals (R n) and covariances (R C Rᵀ)."""
        from pointalign import transforms

        T = _validate.as_transform(transformation, "transformation", device=self.device)
        pts = transforms.apply(T, self.points)
        nrm = cov = None
        R = T[:3, :3]
        if self.normals is not None:
            nrm = (self.normals.to(T.dtype) @ R.T).to(self.dtype)
        if self.covariances is not None:
            cov = (R @ self.covariances.to(T.dtype) @ R.T).to(self.dtype)
        return self.replace(points=pts, normals=nrm, covariances=cov)

    def numpy(self) -> dict[str, np.ndarray]:
        """Return every present field as a host NumPy array, in a dict keyed by field name.

        A dict, not a cloud: ``{"points": (N, 3), "normals": (N, 3), "colors": (N, 3),
        "features": (N, D), "covariances": (N, 3, 3), <extra name>: (N,) or (N, K)}`` (only
        the fields present), the form ``np.savez(path, **cloud.numpy())``, pandas and the
        file writers take. A PointCloud is one torch-backed type on one device; a second,
        NumPy-backed cloud type would double every operation for no gain. For one field
        use ``cloud.points.cpu().numpy()``; to go back, ``PointCloud(**fields)`` with the
        extras under ``extras=``.
        """
        out = {"points": self.points.detach().cpu().numpy()}
        for name in ("normals", "colors", "features", "covariances"):
            v = getattr(self, name)
            if v is not None:
                out[name] = v.detach().cpu().numpy()
        for k, v in self.extras.items():
            out[k] = v.detach().cpu().numpy()
        return out

    @classmethod
    def from_open3d(cls, pcd: Any) -> PointCloud:
        """Build from an Open3D point cloud, legacy or tensor API.

        Args:
            pcd: ``open3d.geometry.PointCloud`` (float64 points, normals, colours and
                covariances are copied) or ``open3d.t.geometry.PointCloud``
                (``positions``, ``normals``, ``colors`` and every other per-point
                attribute, the latter into
                :attr:`extras`; read through DLPack, so zero-copy on the cloud's device where
                PyTorch supports it).

        Raises:
            TypeError: ``pcd`` is not an Open3D point cloud.

        """
        mod = type(pcd).__module__.split(".")[0]
        if mod != "open3d":
            raise TypeError(f"pcd: expected an Open3D PointCloud, got {type(pcd).__name__}")
        if hasattr(pcd, "point") and hasattr(pcd, "to_legacy"):
            attrs = {k: _validate._from_dlpack(f"pcd.point[{k!r}]", pcd.point[k])
                     for k in pcd.point}
            if "positions" not in attrs:
                raise ValueError("pcd: the Open3D tensor PointCloud has no positions")
            pts = attrs.pop("positions")
            nrm, col = attrs.pop("normals", None), attrs.pop("colors", None)
            extras = {k: (v[:, 0] if v.dim() == 2 and v.shape[1] == 1 else v)
                      for k, v in attrs.items()}
            return cls(pts, nrm, col, extras=extras)
        if not (hasattr(pcd, "points") and hasattr(pcd, "has_normals")):
            raise TypeError(f"pcd: expected an Open3D PointCloud, got {type(pcd).__name__}")
        def arr(v: Any) -> torch.Tensor:
            return torch.from_numpy(np.array(v))

        has_cov = getattr(pcd, "has_covariances", None)
        cov = arr(pcd.covariances) if has_cov is not None and has_cov() else None
        return cls(arr(pcd.points), arr(pcd.normals) if pcd.has_normals() else None,
                   arr(pcd.colors) if pcd.has_colors() else None, covariances=cov)

    def to_open3d(self, tensor: bool = False) -> Any:
        """Convert to an Open3D point cloud (needs the ``open3d`` extra).

        Args:
            tensor: False: ``open3d.geometry.PointCloud`` (legacy API, float64 copies of
                points, normals, colours and covariances). True:
                ``open3d.t.geometry.PointCloud`` with ``positions``, ``normals``, ``colors``
                and the :attr:`extras` as attributes,
                in this cloud's dtype; handed over through DLPack (shared memory on the CPU;
                a CUDA cloud stays on the GPU when Open3D was built with CUDA, otherwise it
                is copied to the CPU).

        Returns:
            The Open3D point cloud. ``features`` are not carried (Open3D keeps them apart).

        """
        try:
            import open3d as o3d
        except ImportError as exc:  # pragma: no cover - optional
            raise ImportError(
                "to_open3d needs Open3D: pip install 'pointalign[open3d]'"
            ) from exc
        if tensor:
            on_cuda = self.device.type == "cuda" and o3d.core.cuda.is_available()

            def o3t(t: torch.Tensor) -> Any:
                t = t.detach()
                if not on_cuda:
                    t = t.cpu()
                return o3d.core.Tensor.from_dlpack(t.contiguous())

            pcd = o3d.t.geometry.PointCloud(o3t(self.points))
            if self.normals is not None:
                pcd.point["normals"] = o3t(self.normals)
            if self.colors is not None:
                pcd.point["colors"] = o3t(self.colors)
            for k, v in self.extras.items():
                pcd.point[k] = o3t(v[:, None] if v.dim() == 1 else v)
            return pcd
        legacy: Any = o3d.geometry.PointCloud()
        pcd = legacy
        arrs = self.numpy()
        pcd.points = o3d.utility.Vector3dVector(arrs["points"].astype(np.float64))
        if "normals" in arrs:
            pcd.normals = o3d.utility.Vector3dVector(arrs["normals"].astype(np.float64))
        if "colors" in arrs:
            pcd.colors = o3d.utility.Vector3dVector(arrs["colors"].astype(np.float64))
        if "covariances" in arrs:
            pcd.covariances = o3d.utility.Matrix3dVector(arrs["covariances"].astype(np.float64))
        return pcd
