"""Helpers shared by the readers and writers: the fields record, conversion to a cloud."""

from __future__ import annotations

import io as _io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pointalign.cloud import PointCloud


class _FormatError(ValueError):
    """A file's contents are not what its format requires (message without the path)."""


class _ClampedReader(_io.BufferedReader):
    """A binary file whose ``read(n)`` never asks for more than the bytes left in the file.

    ``BufferedReader.read(n)`` allocates ``n`` bytes before reading, so a parser that trusts a
    size field of a corrupt file (a zip directory claiming 4 GB, a PLY list of 2**32
    entries) would allocate that much for a file of a few kB. Every reader opens its file
    through :func:`_open` so that no read is larger than the file.
    """

    def __init__(self, path: Path) -> None:
        super().__init__(_io.FileIO(path, "rb"))
        self.size = os.fstat(self.fileno()).st_size

    def read(self, n: int | None = -1) -> bytes:  # noqa: D102
        if n is not None and n > 0:
            n = min(n, max(self.size - self.tell(), 0))
            if n == 0:
                return b""
        return super().read(n)


def _open(path: Path) -> _ClampedReader:
    """Open ``path`` for reading (binary, reads clamped to the file size)."""
    return _ClampedReader(path)


# torch has no (full) unsigned 16/32/64-bit tensors: widen them to signed types
_WIDEN = {np.dtype(np.uint16): np.int32, np.dtype(np.uint32): np.int64,
          np.dtype(np.uint64): np.int64, np.dtype(np.float16): np.float32,
          np.dtype(np.bool_): np.uint8}


def _native(a: np.ndarray) -> np.ndarray:
    """Native byte order, a torch-supported dtype, contiguous (a copy, never a view)."""
    dt = a.dtype.newbyteorder("=") if a.dtype.byteorder not in ("=", "|") else a.dtype
    dt = np.dtype(_WIDEN.get(np.dtype(dt), dt))
    return np.array(a, dtype=dt, copy=True, order="C")


def _color_scale(c: np.ndarray) -> np.ndarray:
    """Colours to float64 in [0, 1]: integer types are divided by their maximum."""
    if np.issubdtype(c.dtype, np.integer):
        return c.astype(np.float64) / float(np.iinfo(c.dtype).max)
    return c.astype(np.float64)


def _to_uint8(colors: np.ndarray) -> np.ndarray:
    return np.rint(np.clip(colors, 0.0, 1.0) * 255.0).astype(np.uint8)


@dataclass
class _Fields:
    """What a reader found, as NumPy arrays (converted to a PointCloud in one place)."""

    points: np.ndarray
    normals: np.ndarray | None = None
    colors: np.ndarray | None = None
    features: np.ndarray | None = None
    extras: dict[str, np.ndarray] | None = None
    float64: bool = False  # the file stores float64 coordinates
    #: elements the reader did not turn into points, by name (a PLY's ``face`` count)
    skipped: dict[str, int] | None = None
    #: rows dropped by :func:`_build` because their coordinates are not finite
    dropped: int = 0


def _build(f: _Fields, dtype: torch.dtype | None) -> PointCloud:
    pts = np.asarray(f.points)
    if pts.ndim != 2 or pts.shape[1] != 3:
        raise _FormatError(f"expected (N, 3) coordinates, found shape {pts.shape}")
    if pts.shape[0] == 0:
        raise _FormatError("the file contains no points (0 points)")
    if not np.issubdtype(pts.dtype, np.number):
        raise _FormatError(f"coordinates have a non-numeric type {pts.dtype}")
    if dtype is None:
        dtype = torch.float64 if (f.float64 or pts.dtype == np.float64) else torch.float32
    np_dt = np.float64 if dtype == torch.float64 else np.float32
    keep = np.isfinite(pts.astype(np.float64)).all(axis=1)
    if not keep.any():
        raise _FormatError(f"none of the {pts.shape[0]} points has finite coordinates")
    sel = slice(None) if keep.all() else keep
    f.dropped = int(pts.shape[0] - np.count_nonzero(keep))

    def cast(a: np.ndarray | None, name: str) -> torch.Tensor | None:
        if a is None:
            return None
        a = np.asarray(a)
        if a.shape[0] != pts.shape[0]:
            raise _FormatError(f"{name} has {a.shape[0]} rows for {pts.shape[0]} points")
        a = a[sel].astype(np_dt)
        if not np.isfinite(a).all():
            raise _FormatError(f"{name} contain NaN or Inf values")
        return torch.from_numpy(np.ascontiguousarray(a))

    extras = {}
    for k, v in (f.extras or {}).items():
        v = np.asarray(v)
        if v.shape[0] != pts.shape[0]:
            raise _FormatError(f"field {k!r} has {v.shape[0]} rows for {pts.shape[0]} points")
        extras[k] = torch.from_numpy(_native(v[sel]))
    coords = cast(pts, "coordinates")
    assert coords is not None  # the coordinates were read above
    return PointCloud(coords, cast(f.normals, "normals"),
                      cast(f.colors, "colours"), cast(f.features, "features"), extras)


def _arrays(cloud: PointCloud) -> dict[str, Any]:
    """Return the cloud's fields as NumPy arrays (copies: writers may change them)."""
    out: dict[str, Any] = {"points": cloud.points.detach().cpu().numpy().copy()}
    for name in ("normals", "colors", "features"):
        v = getattr(cloud, name)
        out[name] = None if v is None else v.detach().cpu().numpy().copy()
    out["extras"] = {k: v.detach().cpu().numpy().copy() for k, v in cloud.extras.items()}
    return out


def _refuse(fmt: str, cloud: PointCloud, *, normals: bool, colors: bool, features: bool,
            extras: bool) -> None:
    """Raise before writing when the format cannot hold a field the cloud has."""
    lost = []
    if cloud.normals is not None and not normals:
        lost.append("normals")
    if cloud.colors is not None and not colors:
        lost.append("colors")
    if cloud.features is not None and not features:
        lost.append("features")
    if cloud.extras and not extras:
        lost.append("extras (" + ", ".join(cloud.extras) + ")")
    if lost:
        raise ValueError(
            f"{fmt} cannot store the cloud's {', '.join(lost)}; write .ply, .pcd or .npz, "
            "or drop them first with cloud.replace(normals=None, colors=None, "
            "features=None, extras={})"
        )


def _flat_extras(extras: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """Extras as 1-D columns: ``(N,)`` keeps its name, ``(N, K)`` becomes ``name_0..``."""
    cols = []
    for k, v in extras.items():
        if v.ndim == 1:
            cols.append((k, v))
        else:
            v2 = v.reshape(v.shape[0], -1)
            cols += [(f"{k}_{j}", v2[:, j]) for j in range(v2.shape[1])]
    return cols


def _check_name(name: str, fmt: str, taken: set[str]) -> None:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"extras name {name!r} cannot be written to {fmt} (use letters, "
                         "digits and _)")
    if name in taken:
        raise ValueError(f"extras name {name!r} clashes with a standard {fmt} field")
    taken.add(name)


