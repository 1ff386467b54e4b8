"""PLY files through plyfile: vertex x y z, normals, colours, features, extras."""

from __future__ import annotations

import io as _io
import re
from pathlib import Path
from typing import Any

import numpy as np

from pointalign.cloud import PointCloud
from pointalign.io._common import (
    _arrays,
    _check_name,
    _color_scale,
    _Fields,
    _flat_extras,
    _FormatError,
    _native,
    _open,
    _to_uint8,
)

_PLY_NORMALS = (("nx", "ny", "nz"), ("normal_x", "normal_y", "normal_z"))
_PLY_COLORS = (("red", "green", "blue"), ("r", "g", "b"),
               ("diffuse_red", "diffuse_green", "diffuse_blue"))


def _ply_min_bytes(elt: Any, text: bool) -> int:
    """Fewest bytes ``elt`` can occupy (rejects headers that promise more than the file has)."""
    import plyfile

    if elt.count < 0:
        raise _FormatError(f"element {elt.name!r} has a negative count ({elt.count})")
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


def _read_ply_vertex(f: Any, path: Path) -> tuple[Any, dict[str, int]]:
    """Read the PLY elements up to and including ``vertex``, then stop.

    Returns the vertex records and the counts of the other elements (``{"face": 69451}``).

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
        return ply["vertex"].data.copy(), _others(ply.elements)
    ply = parse(f)
    names = [e.name for e in ply.elements]
    if "vertex" not in names:
        raise _FormatError(f"no 'vertex' element (elements: {names})")
    remaining = f.size - f.tell()
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
        # copy: detach from the memory map before the file closes
        return vertex.data.copy(), _others(ply.elements)
    finally:
        if ply.text:
            stream.detach()


def _others(elements: Any) -> dict[str, int]:
    """Count the elements other than ``vertex`` (faces, edges, range grids)."""
    return {e.name: int(e.count) for e in elements if e.name != "vertex"}


def _read_ply(path: Path) -> _Fields:
    with _open(path) as f:
        if f.read(4).rstrip(b"\r\n") != b"ply":
            raise _FormatError("not a PLY file (no 'ply' magic line at byte 0)")
        f.seek(0)
        data, others = _read_ply_vertex(f, path)
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
    return _Fields(pts, normals, colors, features, extras, f64, skipped=others)


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


