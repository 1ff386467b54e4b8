"""Read and write point clouds: one suffix -> reader/writer table, atomic writes.

:func:`read` and :func:`write` dispatch on the file suffix (case-insensitive) through
``FORMATS``; :func:`read_bin` reads raw float32 ``.bin`` scans (KITTI Velodyne style),
whose column count cannot be told from the file.

Formats (suffix: what is read and written; library):

* ``.ply``: vertex ``x y z``, ``nx ny nz``, ``red green blue``, ``feature_<j>``, other
  scalar vertex properties as ``extras``; ascii and binary little/big endian; elements other
  than ``vertex`` (faces, the Stanford scans' ``range_grid``) are skipped; plyfile.
* ``.pcd``: ``x y z``, ``normal_x normal_y normal_z``, ``rgb``/``rgba`` (packed in F 4 or
  U 4) or ``r g b``, ``fpfh``/``feature`` (COUNT D) as features, other fields as ``extras``;
  ascii, binary and binary_compressed; pypcd4.
* ``.xyz .txt .csv .pts``: text columns, see the column rule below.
* ``.xyzn`` / ``.xyzrgb``: text with 6 columns, xyz + normals / xyz + rgb in [0, 1]
  (Open3D's conventions).
* ``.npy``: one ``(N, 3)`` array (``(N, C)`` follows the column rule).
* ``.npz``: arrays ``points`` (required), ``normals``, ``colors``, ``features`` and
  ``extra.<name>``.
* ``.las`` / ``.laz``: scaled X Y Z, 16-bit ``red green blue``, normals and other extras as
  extra-bytes dimensions; laspy (optional extra, ``pip install 'pointalign[las]'``), and a
  LAZ backend for ``.laz``. Standard LAS dimensions that are zero for every point are not
  carried into ``extras``.

Extras of shape ``(N, K)`` are written to PLY and LAS as K columns ``name_0 .. name_{K-1}``
(and read back as K separate extras); PCD and NPZ keep them whole.

**Column rule** for text files and ``.npy`` (documented once, used by both). Numbers are
separated by whitespace and/or commas; blank lines and lines starting with ``#`` or ``//``
are ignored; a first line holding a single integer is a point count (``.pts``) and must
match the number of rows; a first line with no number at all (``x y z``) is a header and is
skipped. Then, by the number of columns C:

* C = 3: ``x y z``.
* C = 6: ``x y z`` followed by three columns that are read as **colours** when they are
  all integers in 0..255 with at least one above 1 (scaled by 1/255), else as **normals**
  when every row has unit length (within 1e-3), else as colours when they all lie in
  [0, 1], else they are kept as ``extras["columns"]``.
* C = 9: ``x y z nx ny nz r g b`` when columns 4-6 have unit length and columns 7-9 are
  colours (in [0, 1], or integers in 0..255 when any exceeds 1); else as "any other C".
* ``.pts`` follows Open3D: C = 4 is ``x y z intensity``, C = 7 is ``x y z intensity r g b``
  (0..255), C = 6 is ``x y z r g b`` (0..255).
* Any other C: ``x y z`` then the rest as ``extras["columns"]`` (``(N, C - 3)``).

Text writers emit ``x y z [nx ny nz] [r g b]`` with colours as integers 0..255 and
coordinates with enough digits to round-trip exactly (9 for float32, 17 for float64).
The rule has one blind spot: a colour-only text file whose colours are all 0 or 1 on the
0..255 scale reads as normals or [0, 1] colours; use ``.xyzrgb``, ``.ply`` or ``.pcd`` for
such clouds.

**Common rules.** ``read(..., dtype=None)`` keeps the file's precision: float64 when the
file stores float64 coordinates or decimal text (and for LAS, whose scaled integers need
it), float32 otherwise; pass ``dtype`` to force one. Points whose coordinates are not
finite (organised scans mark missing returns with NaN) are dropped with their attributes.
Integer colours are scaled to [0, 1] by the type's maximum (255 for uint8). Every reading
error is a ``ValueError`` naming the file (and the row, line or byte offset where it is
known); a missing file is a ``FileNotFoundError``. A file with 0 points is an error.

Writers never lose data silently: a field the format cannot store (normals in ``.npy``,
extras in text files, ...) raises ``ValueError`` before anything is written. Colours are
stored as 8-bit integers in PLY, PCD and text (16-bit in LAS), so they come back rounded to
1/255. Every write goes to a temporary file in the target's directory, which then replaces
the target with ``os.replace``; a failure part-way leaves any existing file untouched.
"""

from __future__ import annotations

import io as _io
import os
import re
import secrets
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pointalign import _validate
from pointalign.cloud import PointCloud

__all__ = ["FORMATS", "Format", "read", "read_bin", "write"]

PathLike = str | os.PathLike


class _FormatError(ValueError):
    """A file's contents are not what its format requires (message without the path)."""


# --------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------

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
    return PointCloud(cast(pts, "coordinates"), cast(f.normals, "normals"),
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


# --------------------------------------------------------------------------------------
# PLY (plyfile)
# --------------------------------------------------------------------------------------

_PLY_NORMALS = (("nx", "ny", "nz"), ("normal_x", "normal_y", "normal_z"))
_PLY_COLORS = (("red", "green", "blue"), ("r", "g", "b"),
               ("diffuse_red", "diffuse_green", "diffuse_blue"))


def _ply_min_bytes(elt: Any, text: bool) -> int:
    """Fewest bytes ``elt`` can occupy (rejects headers that promise more than the file has)."""
    import plyfile

    if text:
        return elt.count * 2 * max(len(elt.properties), 1) - 1 if elt.count else 0
    per_row = 0
    for p in elt.properties:
        if isinstance(p, plyfile.PlyListProperty):
            per_row += np.dtype(p.list_dtype()[0]).itemsize
        else:
            per_row += np.dtype(p.dtype()).itemsize
    return elt.count * per_row


# read only up to the vertex element through plyfile's per-element reader (False: the
# public PlyData.read of the whole file, as used if plyfile ever renames those helpers)
_PLY_VERTEX_ONLY = True


def _read_ply_vertex(f: Any, path: Path) -> Any:
    """Read the PLY elements up to and including ``vertex``, then stop.

    Later elements (faces, the Stanford scans' 204,800-entry ``range_grid``) are never
    parsed, which makes reading bun000.ply about 20x faster.

    Uses plyfile's header parser and per-element reader (``_parse_header``/``_read``);
    falls back to the public ``PlyData.read`` of the whole file if those ever disappear.
    """
    import plyfile

    parse = getattr(plyfile.PlyData, "_parse_header", None)
    if not _PLY_VERTEX_ONLY or parse is None or not hasattr(plyfile.PlyElement, "_read"):
        ply = plyfile.PlyData.read(f)
        if "vertex" not in ply:
            raise _FormatError(f"no 'vertex' element (elements: {[e.name for e in ply]})")
        return ply["vertex"].data.copy()
    ply = parse(f)
    names = [e.name for e in ply.elements]
    if "vertex" not in names:
        raise _FormatError(f"no 'vertex' element (elements: {names})")
    remaining = os.fstat(f.fileno()).st_size - f.tell()
    upto = ply.elements[: names.index("vertex") + 1]
    need = sum(_ply_min_bytes(e, ply.text) for e in upto)
    if need > remaining:
        raise _FormatError(
            f"truncated: the header promises at least {need} bytes of data after byte "
            f"{f.tell()}, the file has {remaining}"
        )
    stream = _io.TextIOWrapper(f, "ascii") if ply.text else f
    try:
        for elt in upto:
            elt._read(stream, ply.text, ply.byte_order, "c", {})
        vertex = upto[-1]
        return vertex.data.copy()  # detach from the memory map before the file closes
    finally:
        if ply.text:
            stream.detach()


def _read_ply(path: Path) -> _Fields:
    with open(path, "rb") as f:
        if f.read(4).rstrip(b"\r\n") != b"ply":
            raise _FormatError("not a PLY file (no 'ply' magic line at byte 0)")
        f.seek(0)
        data = _read_ply_vertex(f, path)
    names = list(data.dtype.names or ())
    if not {"x", "y", "z"} <= set(names):
        raise _FormatError(f"vertex element has no x, y, z properties (has {names})")
    used = {"x", "y", "z"}
    pts = np.stack([data[c] for c in ("x", "y", "z")], axis=1)
    f64 = any(data[c].dtype.itemsize > 4 for c in ("x", "y", "z"))
    normals = colors = features = None
    for trio in _PLY_NORMALS:
        if set(trio) <= set(names):
            normals = np.stack([data[c] for c in trio], axis=1).astype(np.float64)
            used |= set(trio)
            break
    for trio in _PLY_COLORS:
        if set(trio) <= set(names):
            colors = _color_scale(np.stack([_native(data[c]) for c in trio], axis=1))
            used |= set(trio)
            break
    feat = sorted((int(m.group(1)), n) for n in names
                  if (m := re.fullmatch(r"feature_(\d+)", n)))
    if feat:
        features = np.stack([data[n] for _, n in feat], axis=1).astype(np.float64)
        used |= {n for _, n in feat}
    extras = {n: data[n] for n in names
              if n not in used and data[n].dtype != object and data[n].ndim == 1}
    return _Fields(pts, normals, colors, features, extras, f64)


_PLY_TYPES = {np.dtype(t): t for t in
              ("i1", "u1", "i2", "u2", "i4", "u4", "f4", "f8")}


def _ply_col(name: str, v: np.ndarray) -> np.ndarray:
    if v.dtype == np.bool_:
        v = v.astype(np.uint8)
    if v.dtype in (np.int64, np.uint64):
        if v.size and (v.min() < np.iinfo(np.int32).min or v.max() > np.iinfo(np.int32).max):
            raise ValueError(f"extras[{name!r}]: 64-bit integers beyond int32 cannot be "
                             "stored in PLY")
        v = v.astype(np.int32)
    if v.dtype == np.float16:
        v = v.astype(np.float32)
    if np.dtype(v.dtype.newbyteorder("=")) not in _PLY_TYPES:
        raise ValueError(f"extras[{name!r}]: dtype {v.dtype} cannot be stored in PLY")
    return v


def _write_ply(f: Any, cloud: PointCloud, binary: bool) -> None:
    import plyfile

    a = _arrays(cloud)
    ft = "<f8" if a["points"].dtype == np.float64 else "<f4"
    cols: list[tuple[str, np.ndarray, str]] = [
        (c, a["points"][:, i], ft) for i, c in enumerate("xyz")]
    if a["normals"] is not None:
        cols += [(c, a["normals"][:, i], ft) for i, c in enumerate(("nx", "ny", "nz"))]
    if a["colors"] is not None:
        rgb = _to_uint8(a["colors"])
        cols += [(c, rgb[:, i], "u1") for i, c in enumerate(("red", "green", "blue"))]
    if a["features"] is not None:
        cols += [(f"feature_{j}", a["features"][:, j], ft)
                 for j in range(a["features"].shape[1])]
    taken = {c for c, _, _ in cols}
    for k, v in _flat_extras(a["extras"]):
        _check_name(k, "PLY", taken)
        v = _ply_col(k, v)
        cols.append((k, v, v.dtype.newbyteorder("<").str))
    rec = np.empty(len(cloud), dtype=[(c, t) for c, _, t in cols])
    for c, v, _ in cols:
        rec[c] = v
    el = plyfile.PlyElement.describe(rec, "vertex")
    plyfile.PlyData([el], text=not binary, byte_order="<",
                    comments=["written by pointalign"]).write(f)


# --------------------------------------------------------------------------------------
# PCD (pypcd4)
# --------------------------------------------------------------------------------------

_PCD_NORMALS = ("normal_x", "normal_y", "normal_z")


def _pcd_check_size(f: Any) -> None:
    """Reject headers that promise more data than the file holds (before any allocation)."""
    from pypcd4.pypcd4 import MetaData

    lines: list[str] = []
    offset = 0
    for bline in f:
        try:
            line = bline.decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            raise _FormatError(f"header line at byte offset {offset} is not text (byte "
                               f"{offset + exc.start})") from None
        offset += len(bline)
        if line.startswith("#") or not line:
            continue
        lines.append(line)
        if line.startswith("DATA") or len(lines) >= 10:
            break
    if not lines or not lines[0].upper().startswith(("VERSION", "FIELDS")):
        raise _FormatError("not a PCD file (no VERSION/FIELDS header line)")
    meta = MetaData.parse_header(lines)
    if len(meta.fields) != len(meta.size) or len(meta.fields) != len(meta.type) \
            or len(meta.fields) != len(meta.count):
        raise _FormatError("FIELDS, SIZE, TYPE and COUNT have different lengths")
    item = meta.build_dtype().itemsize
    start = f.tell()
    remaining = os.fstat(f.fileno()).st_size - start
    need = meta.points * item
    if meta.data.value == "binary" and need > remaining:
        raise _FormatError(f"truncated: {meta.points} points need {need} bytes after byte "
                           f"{start}, the file has {remaining}")
    if meta.data.value.startswith("binary") and meta.data.value != "binary":
        head = f.read(8)
        if len(head) < 8:
            raise _FormatError(f"truncated at byte {start}: no compressed-size header")
        comp, raw = struct.unpack("<II", head)
        if comp > remaining - 8:
            raise _FormatError(f"truncated: {comp} compressed bytes announced at byte {start},"
                               f" {remaining - 8} present")
        if raw != need or raw > 256 * comp + 64:
            raise _FormatError(f"inconsistent compressed block at byte {start}: {raw} bytes "
                               f"announced, {meta.points} points x {item} bytes expected")
    if meta.data.value == "ascii" and meta.points > remaining:
        raise _FormatError(f"truncated: {meta.points} points announced, {remaining} bytes "
                           "of text present")
    f.seek(0)


def _read_pcd(path: Path) -> _Fields:
    from pypcd4 import PointCloud as PcdCloud

    with open(path, "rb") as f:
        _pcd_check_size(f)
        pc = PcdCloud.from_fileobj(f)
    # pypcd4's ascii path (np.loadtxt) returns a 0-d record for a 1-point file
    meta, data = pc.metadata, np.atleast_1d(pc.pc_data)
    if len(data) != meta.points:
        raise _FormatError(f"truncated: header says {meta.points} points, {len(data)} read")
    names = list(meta.fields)
    if not {"x", "y", "z"} <= set(names):
        raise _FormatError(f"no x, y, z fields (fields: {names})")

    def col(name: str, count: int) -> np.ndarray:
        if count == 1:
            return data[name]
        return np.stack([data[f"{name}__{i:04d}"] for i in range(count)], axis=1)

    cnt = dict(zip(names, meta.count, strict=True))
    pts = np.stack([col(c, 1) for c in "xyz"], axis=1)
    f64 = any(data[c].dtype.itemsize > 4 for c in "xyz")
    used = {"x", "y", "z"}
    normals = colors = features = None
    if set(_PCD_NORMALS) <= set(names):
        normals = np.stack([col(c, 1) for c in _PCD_NORMALS], axis=1)
        used |= set(_PCD_NORMALS)
    extras: dict[str, np.ndarray] = {}
    for key in ("rgb", "rgba"):
        if key in names and cnt[key] == 1 and data[key].dtype.itemsize == 4:
            packed = np.ascontiguousarray(data[key]).view(np.uint32)
            rgb = np.stack([(packed >> s) & 255 for s in (16, 8, 0)], axis=1)
            colors = rgb.astype(np.float64) / 255.0
            if key == "rgba":
                extras["alpha"] = ((packed >> 24) & 255).astype(np.uint8)
            used.add(key)
            break
    if colors is None and {"r", "g", "b"} <= set(names) \
            and all(cnt[c] == 1 for c in "rgb"):
        colors = _color_scale(np.stack([data[c] for c in "rgb"], axis=1))
        used |= {"r", "g", "b"}
    for key in ("fpfh", "feature"):
        if key in names:
            features = col(key, cnt[key]).reshape(len(data), -1).astype(np.float64)
            used.add(key)
            break
    for n in names:
        if n not in used and not n.startswith("#$%&~~"):  # pypcd4's name for "_" padding
            extras[n] = col(n, cnt[n])
    return _Fields(pts, normals, colors, features, extras, f64)


def _write_pcd(f: Any, cloud: PointCloud, binary: bool) -> None:
    from pypcd4 import PointCloud as PcdCloud
    from pypcd4.pypcd4 import NUMPY_TYPE_TO_PCD_TYPE, Encoding, MetaData

    a = _arrays(cloud)
    fields: list[tuple[str, np.ndarray]] = [(c, a["points"][:, i]) for i, c in enumerate("xyz")]
    if a["normals"] is not None:
        fields += [(c, a["normals"][:, i]) for i, c in enumerate(_PCD_NORMALS)]
    if a["colors"] is not None:
        rgb = _to_uint8(a["colors"]).astype(np.uint32)
        # packed 0x00RRGGBB stored as U 4 (exact in ascii; PCL and Open3D read it)
        fields.append(("rgb", (rgb[:, 0] << 16) | (rgb[:, 1] << 8) | rgb[:, 2]))
    if a["features"] is not None:
        fields.append(("feature", a["features"]))
    taken = {c for c, _ in fields}
    for k, v in a["extras"].items():
        _check_name(k, "PCD", taken)
        v = v.reshape(v.shape[0], -1) if v.ndim > 2 else v
        if v.dtype == np.bool_:
            v = v.astype(np.uint8)
        if np.dtype(v.dtype) not in NUMPY_TYPE_TO_PCD_TYPE:
            raise ValueError(f"extras[{k!r}]: dtype {v.dtype} cannot be stored in PCD")
        fields.append((k, v))
    names, sizes, types, counts = [], [], [], []
    for n, v in fields:
        t, s = NUMPY_TYPE_TO_PCD_TYPE[np.dtype(v.dtype)]
        names.append(n)
        types.append(t)
        sizes.append(s)
        counts.append(1 if v.ndim == 1 else v.shape[1])
    n_pts = len(cloud)
    meta = MetaData(fields=tuple(names), size=tuple(sizes), type=tuple(types),
                    count=tuple(counts), points=n_pts, width=n_pts, height=1)
    rec = np.empty(n_pts, dtype=meta.build_dtype())
    for n, v in fields:
        if v.ndim == 1 or v.shape[1] == 1:
            rec[n] = v.reshape(-1)
        else:
            for i in range(v.shape[1]):
                rec[f"{n}__{i:04d}"] = v[:, i]
    enc = Encoding.BINARY if binary else Encoding.ASCII
    PcdCloud(meta, rec).save(f, encoding=enc)


# --------------------------------------------------------------------------------------
# text: .xyz .txt .csv .pts .xyzn .xyzrgb
# --------------------------------------------------------------------------------------

def _is_number(tok: str) -> bool:
    try:
        float(tok)
    except ValueError:
        return False
    return True


def _parse_text(path: Path) -> tuple[np.ndarray, list[int]]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _FormatError(f"not a text file (byte offset {exc.start} is not UTF-8)") from None
    rows: list[list[str]] = []
    lines: list[int] = []
    for i, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or s.startswith(("#", "//")):
            continue
        rows.append(s.replace(",", " ").replace(";", " ").split())
        lines.append(i)
    if rows and not any(_is_number(t) for t in rows[0]):
        rows, lines = rows[1:], lines[1:]  # a header line such as "x y z"
    count = None
    if rows and len(rows[0]) == 1 and (len(rows) == 1 or len(rows[1]) != 1):
        try:
            count = int(rows[0][0])
        except ValueError:
            raise _FormatError(f"line {lines[0]}: expected a point count, got {rows[0][0]!r}"
                               ) from None
        rows, lines = rows[1:], lines[1:]
    if not rows:
        raise _FormatError("the file contains no points (0 points)")
    if count is not None and count != len(rows):
        raise _FormatError(f"line {lines[0] - 1 if lines else 1}: the count line says "
                           f"{count} points but {len(rows)} rows follow (truncated?)")
    ncol = len(rows[0])
    if ncol < 3:
        raise _FormatError(f"line {lines[0]}: expected at least 3 columns (x y z), got {ncol}")
    for r, ln in zip(rows, lines, strict=True):
        if len(r) != ncol:
            raise _FormatError(f"line {ln}: expected {ncol} columns like the first row, "
                               f"got {len(r)}")
    try:
        table = np.array(rows, dtype=np.float64)
    except ValueError:
        for r, ln in zip(rows, lines, strict=True):
            for tok in r:
                if not _is_number(tok):
                    raise _FormatError(f"line {ln}: {tok[:40]!r} is not a number") from None
        raise
    return table, lines


def _unit_rows(v: np.ndarray) -> bool:
    return bool(np.all(np.abs(np.linalg.norm(v, axis=1) - 1.0) < 1e-3))


def _as_colors(v: np.ndarray) -> np.ndarray | None:
    """Colours in [0, 1] from [0, 1] floats or 0..255 integers, else None."""
    if v.min() >= 0 and v.max() <= 1:
        return v
    if v.min() >= 0 and v.max() <= 255 and np.all(v == np.rint(v)):
        return v / 255.0
    return None


def _columns(table: np.ndarray, kind: str = "auto") -> _Fields:
    """Interpret an ``(N, C)`` table by the column rule in the module docstring."""
    n, c = table.shape
    pts = table[:, :3]
    if kind == "xyzn" or kind == "xyzrgb":
        if c != 6:
            raise _FormatError(f".{kind} needs 6 columns, found {c}")
        return (_Fields(pts, normals=table[:, 3:]) if kind == "xyzn"
                else _Fields(pts, colors=table[:, 3:]))
    if kind == "pts" and c in (4, 7):
        extras = {"intensity": table[:, 3].copy()}
        return _Fields(pts, colors=table[:, 4:7] / 255.0 if c == 7 else None, extras=extras)
    if kind == "pts" and c == 6:
        return _Fields(pts, colors=table[:, 3:6] / 255.0)
    if c == 3:
        return _Fields(pts)
    if c in (6, 9):
        last = table[:, 6:9] if c == 9 else table[:, 3:6]
        is_int = bool(np.all(last == np.rint(last)))
        if c == 9:
            cols = _as_colors(last)
            if _unit_rows(table[:, 3:6]) and cols is not None:
                return _Fields(pts, normals=table[:, 3:6], colors=cols)
            return _Fields(pts, extras={"columns": table[:, 3:].copy()})
        if is_int and last.min() >= 0 and last.max() <= 255 and last.max() > 1:
            return _Fields(pts, colors=last / 255.0)
        if _unit_rows(last):
            return _Fields(pts, normals=last)
        if last.min() >= 0 and last.max() <= 1:
            return _Fields(pts, colors=last)
    return _Fields(pts, extras={"columns": table[:, 3:].copy()})


def _text_reader(kind: str) -> Callable[[Path], _Fields]:
    def reader(path: Path) -> _Fields:
        table, _ = _parse_text(path)
        out = _columns(table, kind)
        out.float64 = True
        return out

    return reader


def _text_writer(kind: str) -> Callable[[Any, PointCloud, bool], None]:
    def writer(f: Any, cloud: PointCloud, binary: bool) -> None:
        a = _arrays(cloud)
        _refuse(f".{kind}", cloud, normals=kind not in ("pts", "xyzrgb"),
                colors=kind != "xyzn", features=False, extras=False)
        if kind == "xyzn" and a["normals"] is None:
            raise ValueError(".xyzn needs normals; the cloud has none")
        if kind == "xyzrgb" and a["colors"] is None:
            raise ValueError(".xyzrgb needs colors; the cloud has none")
        digits = "%.17g" if a["points"].dtype == np.float64 else "%.9g"
        blocks, fmts = [a["points"]], [digits] * 3
        if a["normals"] is not None:
            blocks.append(a["normals"])
            fmts += [digits] * 3
        if a["colors"] is not None:
            if kind == "xyzrgb":
                blocks.append(a["colors"])
                fmts += [digits] * 3
            else:
                blocks.append(_to_uint8(a["colors"]))
                fmts += ["%d"] * 3
        table = np.concatenate([b.astype(np.float64) for b in blocks], axis=1)
        sep = "," if kind == "csv" else " "
        header = f"{len(cloud)}\n" if kind == "pts" else ""
        buf = _io.StringIO()
        np.savetxt(buf, table, fmt=fmts, delimiter=sep)
        f.write((header + buf.getvalue()).encode("ascii"))

    return writer


# --------------------------------------------------------------------------------------
# NumPy: .npy .npz
# --------------------------------------------------------------------------------------

def _read_npy(path: Path) -> _Fields:
    with open(path, "rb") as f:
        if f.read(6) != b"\x93NUMPY":
            raise _FormatError("not a .npy file (no \\x93NUMPY magic at byte 0)")
        f.seek(0)
        arr = np.load(f, allow_pickle=False)
    if arr.ndim != 2 or arr.shape[1] < 3:
        raise _FormatError(f"expected an (N, 3) array, found shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.number):
        raise _FormatError(f"expected a numeric array, found dtype {arr.dtype}")
    if arr.shape[1] == 3:
        return _Fields(arr, float64=arr.dtype == np.float64)
    out = _columns(arr.astype(np.float64))
    out.float64 = arr.dtype == np.float64
    return out


def _write_npy(f: Any, cloud: PointCloud, binary: bool) -> None:
    _refuse(".npy", cloud, normals=False, colors=False, features=False, extras=False)
    np.save(f, _arrays(cloud)["points"], allow_pickle=False)


def _read_npz(path: Path) -> _Fields:
    with open(path, "rb") as f:
        if f.read(4) not in (b"PK\x03\x04", b"PK\x05\x06"):
            raise _FormatError("not a .npz file (no zip signature at byte 0)")
    with np.load(path, allow_pickle=False) as z:
        keys = list(z.files)
        if "points" not in keys:
            raise _FormatError(f"no 'points' array (keys: {keys})")
        d = {k: z[k] for k in keys}
    pts = d["points"]
    if pts.ndim != 2 or pts.shape[1] != 3:
        raise _FormatError(f"'points' must have shape (N, 3), found {pts.shape}")
    n = pts.shape[0]
    extras = {k[len("extra."):]: v for k, v in d.items()
              if k.startswith("extra.") and v.ndim >= 1 and v.shape[0] == n}
    return _Fields(pts, d.get("normals"), d.get("colors"), d.get("features"), extras,
                   pts.dtype == np.float64)


def _write_npz(f: Any, cloud: PointCloud, binary: bool) -> None:
    a = _arrays(cloud)
    out = {k: a[k] for k in ("points", "normals", "colors", "features") if a[k] is not None}
    out.update({f"extra.{k}": v for k, v in a["extras"].items()})
    np.savez_compressed(f, **out)


# --------------------------------------------------------------------------------------
# LAS / LAZ (laspy, optional)
# --------------------------------------------------------------------------------------

_LAS_HINT = "pip install 'pointalign[las]'"
_LAZ_HINT = "pip install 'laspy[lazrs]' (or laszip)"


def _laspy(laz: bool) -> Any:
    try:
        import laspy
    except ImportError as exc:
        raise ImportError(f"reading/writing LAS files needs laspy: {_LAS_HINT}") from exc
    if laz and not laspy.LazBackend.detect_available():
        raise ImportError(f"LAZ (compressed LAS) needs a LAZ backend for laspy: {_LAZ_HINT}")
    return laspy


_LAS_SKIP = {"X", "Y", "Z", "red", "green", "blue"}


def _read_las(path: Path) -> _Fields:
    laspy = _laspy(path.suffix.lower() == ".laz")
    with open(path, "rb") as f:
        if f.read(4) != b"LASF":
            raise _FormatError("not a LAS file (no LASF signature at byte 0)")
    if path.suffix.lower() == ".las":
        with laspy.open(path) as reader:
            h = reader.header
            need = h.offset_to_point_data + h.point_count * h.point_format.size
        size = path.stat().st_size
        if need > size:
            raise _FormatError(f"truncated: {h.point_count} points need {need} bytes, the "
                               f"file has {size}")
    las = laspy.read(path)
    pts = np.stack([np.asarray(las.x), np.asarray(las.y), np.asarray(las.z)], axis=1)
    dims = list(las.point_format.dimension_names)
    std = set(las.point_format.standard_dimension_names)
    colors = normals = None
    if {"red", "green", "blue"} <= set(dims):
        colors = np.stack([np.asarray(las[c]) for c in ("red", "green", "blue")],
                          axis=1).astype(np.float64) / 65535.0
    if {"normal_x", "normal_y", "normal_z"} <= set(dims):
        normals = np.stack([np.asarray(las[c]) for c in _PCD_NORMALS], axis=1)
    extras = {}
    for d in dims:
        if d in _LAS_SKIP or d in _PCD_NORMALS:
            continue
        v = np.asarray(las[d])
        if v.dtype.kind not in "iufb" or v.ndim < 1:
            continue
        if d in std and not np.any(v):
            continue  # a standard dimension the writer left at 0: nothing to carry
        extras[d] = v
    return _Fields(pts, normals, colors, None, extras, True)


def _write_las(f: Any, cloud: PointCloud, binary: bool, laz: bool = False) -> None:
    laspy = _laspy(laz)
    _refuse(".laz" if laz else ".las", cloud, normals=True, colors=True, features=False,
            extras=True)
    a = _arrays(cloud)
    pts = a["points"].astype(np.float64)
    lo, hi = pts.min(axis=0), pts.max(axis=0)
    extent = float(max(np.max(hi - lo), 1e-30))
    # int32 storage: (x - offset) / scale must stay well below 2**31
    scale = 10.0 ** np.ceil(np.log10(extent / 1e9))
    header = laspy.LasHeader(point_format=2 if a["colors"] is not None else 0, version="1.2")
    header.offsets = lo
    header.scales = np.array([scale] * 3)
    ft = np.float64 if a["points"].dtype == np.float64 else np.float32
    std = set(header.point_format.dimension_names)
    extra_cols = [(c, a["normals"][:, i]) for i, c in enumerate(_PCD_NORMALS)] \
        if a["normals"] is not None else []
    taken = set(std) | set(_PCD_NORMALS)
    for k, v in _flat_extras(a["extras"]):
        if k in std and k not in _LAS_SKIP:
            continue  # a standard dimension (intensity, classification, ...): set below
        _check_name(k, "LAS", taken)
        extra_cols.append((k, v.astype(np.uint8) if v.dtype == np.bool_ else v))
    if extra_cols:
        header.add_extra_dims([laspy.ExtraBytesParams(name=k, type=(ft if k in _PCD_NORMALS
                                                                    else v.dtype))
                               for k, v in extra_cols])
    las = laspy.LasData(header)
    las.x, las.y, las.z = pts[:, 0], pts[:, 1], pts[:, 2]
    if a["colors"] is not None:
        c16 = np.rint(np.clip(a["colors"], 0, 1) * 65535).astype(np.uint16)
        las.red, las.green, las.blue = c16[:, 0], c16[:, 1], c16[:, 2]
    for k, v in _flat_extras(a["extras"]):
        if k in std and k not in _LAS_SKIP:
            want = np.asarray(las[k]).dtype
            if not np.array_equal(v.astype(want).astype(np.float64), v.astype(np.float64)):
                raise ValueError(
                    f"extras[{k!r}] does not fit LAS's {want} {k!r} dimension exactly "
                    f"(values {v.min()}..{v.max()}); rename or rescale it"
                )
            las[k] = v
    for k, v in extra_cols:
        las[k] = v
    las.write(f, do_compress=laz)


# --------------------------------------------------------------------------------------
# the table and the public functions
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Format:
    """One row of the suffix table: a reader and a writer for a file format."""

    name: str
    reader: Callable[[Path], _Fields]
    writer: Callable[[Any, PointCloud, bool], None]


FORMATS: dict[str, Format] = {
    ".ply": Format("PLY", _read_ply, _write_ply),
    ".pcd": Format("PCD", _read_pcd, _write_pcd),
    ".xyz": Format("XYZ text", _text_reader("auto"), _text_writer("xyz")),
    ".txt": Format("XYZ text", _text_reader("auto"), _text_writer("txt")),
    ".csv": Format("CSV text", _text_reader("auto"), _text_writer("csv")),
    ".pts": Format("PTS text", _text_reader("pts"), _text_writer("pts")),
    ".xyzn": Format("XYZN text", _text_reader("xyzn"), _text_writer("xyzn")),
    ".xyzrgb": Format("XYZRGB text", _text_reader("xyzrgb"), _text_writer("xyzrgb")),
    ".npy": Format("NumPy .npy", _read_npy, _write_npy),
    ".npz": Format("NumPy .npz", _read_npz, _write_npz),
    ".las": Format("LAS", _read_las, _write_las),
    ".laz": Format("LAZ", _read_las,
                   lambda f, c, b: _write_las(f, c, b, laz=True)),
}
"""Suffix (lower case, with the dot) -> :class:`Format`.

A reader takes the path and returns the module's private ``_Fields`` record; a writer takes
an open binary file (the temporary file), the cloud and ``binary``. Tests swap rows to
inject failures.
"""

# what a parser may raise on a bad file; converted to ValueError naming the file
_PARSE_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, KeyError, IndexError, TypeError, struct.error, EOFError, RuntimeError,
    OverflowError, MemoryError, zipfile.BadZipFile, AssertionError,
)


def _parse_errors() -> tuple[type[BaseException], ...]:
    extra: list[type[BaseException]] = []
    try:
        import plyfile

        extra.append(plyfile.PlyParseError)
    except ImportError:  # pragma: no cover
        pass
    try:
        import laspy

        extra.append(laspy.LaspyException)
    except ImportError:  # pragma: no cover
        pass
    return _PARSE_ERRORS + tuple(extra)


def _format_for(path: Path) -> Format:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        hint = (" (for raw float32 .bin scans use pointalign.io.read_bin(path, columns=...))"
                if path.suffix.lower() == ".bin" else "")
        raise ValueError(f"{path}: unknown file suffix {path.suffix!r}; supported: "
                         f"{', '.join(FORMATS)}{hint}")
    return fmt


def _dtype_arg(dtype: Any) -> torch.dtype | None:
    if dtype is None:
        return None
    if dtype in (torch.float32, np.float32, "float32"):
        return torch.float32
    if dtype in (torch.float64, np.float64, "float64"):
        return torch.float64
    raise ValueError(f"dtype: expected None, torch.float32 or torch.float64, got {dtype!r}")


def _check_file(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory, not a point-cloud file")
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: the file is empty (0 bytes)")


def read(path: PathLike, *, dtype: torch.dtype | None = None) -> PointCloud:
    """Read a point cloud; the format is chosen by the file suffix (see ``FORMATS``).

    Args:
        path: file to read (``.ply .pcd .xyz .txt .csv .pts .xyzn .xyzrgb .npy .npz .las
            .laz``; case-insensitive).
        dtype: float dtype of the result; default keeps the file's precision (float64 for
            double-precision, text and LAS files, float32 otherwise).

    Returns:
        A :class:`PointCloud` on the CPU: ``points (N, 3)``, and ``normals (N, 3)``,
        ``colors (N, 3)`` in [0, 1], ``features (N, D)`` and ``extras`` where the file has
        them. Points with non-finite coordinates are dropped.

    Raises:
        FileNotFoundError: no such file.
        ValueError: unknown suffix (the message lists the supported ones), or a corrupt,
            truncated or empty file, or 0 points; the message names the file and, where
            the parser tells it, the row, line or byte offset.
        ImportError: ``.las``/``.laz`` without laspy or a LAZ backend (with install hint).
    """
    p = Path(os.fspath(path))
    fmt = _format_for(p)
    dt = _dtype_arg(dtype)
    _check_file(p)
    try:
        fields = fmt.reader(p)
        return _build(fields, dt)
    except ImportError:
        raise
    except _parse_errors() as exc:
        detail = str(exc) if isinstance(exc, _FormatError) else f"{type(exc).__name__}: {exc}"
        raise ValueError(f"cannot read {p} as {fmt.name}: {detail}") from exc


def read_bin(path: PathLike, *, columns: int, dtype: torch.dtype | None = None) -> PointCloud:
    """Read a raw little-endian float32 ``.bin`` scan (KITTI Velodyne style).

    The file is ``N x columns`` float32 values, row after row, with no header, so
    ``columns`` must be given: KITTI's own scans are ``x y z reflectance`` (4; the 4th
    column becomes ``extras["intensity"]``), some re-exports keep only ``x y z`` (3).
    Columns beyond 4 go to ``extras["columns"]``. A file size that is not a multiple of
    ``4 * columns`` bytes is rejected, but a wrong ``columns`` whose row size happens to
    divide the file size cannot be detected.

    Args:
        path: the ``.bin`` file.
        columns: float32 values per point, at least 3.
        dtype: float dtype of the result (default float32).
    """
    if not isinstance(columns, (int, np.integer)) or isinstance(columns, bool) or columns < 3:
        raise ValueError(f"columns: expected an integer >= 3, got {columns!r}")
    p = Path(os.fspath(path))
    dt = _dtype_arg(dtype)
    _check_file(p)
    size = p.stat().st_size
    row = 4 * int(columns)
    if size % row:
        raise ValueError(f"cannot read {p} as raw float32: its {size} bytes are not a "
                         f"multiple of {row} ({columns} float32 columns); truncated, or "
                         "wrong `columns`?")
    table = np.fromfile(p, dtype="<f4").reshape(-1, int(columns))
    extras = {}
    if columns >= 4:
        extras["intensity"] = table[:, 3].copy()
    if columns > 4:
        extras["columns"] = table[:, 4:].copy()
    try:
        return _build(_Fields(table[:, :3], extras=extras), dt)
    except _FormatError as exc:
        raise ValueError(f"cannot read {p} as raw float32: {exc}") from exc


def write(path: PathLike, cloud: PointCloud, *, binary: bool = True) -> None:
    """Write a point cloud; the format is chosen by the file suffix (see ``FORMATS``).

    The file is written to a temporary file in the same directory and moved into place with
    ``os.replace``, so an error part-way (full disk, a field the format cannot hold, ...)
    never destroys an existing file. ``cloud`` is not modified.

    Args:
        path: destination; its suffix picks the format.
        cloud: the :class:`PointCloud` to write, or an ``(N, 3)`` array/tensor of points
            (any device; copied to the CPU).
        binary: binary encoding for PLY (little endian) and PCD; ``False`` writes ASCII.
            Ignored by formats with a single encoding (text, NumPy, LAS).

    Raises:
        ValueError: unknown suffix, or a field the format cannot store (nothing is
            written then).
        TypeError: ``cloud`` is neither a PointCloud nor an ``(N, 3)`` array.
        ImportError: ``.las``/``.laz`` without laspy or a LAZ backend.
    """
    if not isinstance(cloud, PointCloud):
        # a bare (N, 3) array or tensor is a cloud of points only
        cloud = PointCloud(_validate.as_points(cloud, "cloud"))
    p = Path(os.fspath(path))
    fmt = _format_for(p)
    if p.is_dir():
        raise IsADirectoryError(f"{p}: is a directory")
    if not p.parent.is_dir():
        raise FileNotFoundError(f"{p}: the directory {p.parent} does not exist")
    tmp = p.with_name(f".{p.name}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "xb") as f:  # created with the usual umask-based permissions
            fmt.writer(f, cloud, bool(binary))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
