"""PCD files through pypcd4: ascii, binary and binary_compressed."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

from pointalign.cloud import PointCloud
from pointalign.io._common import (
    _arrays,
    _check_name,
    _color_scale,
    _Fields,
    _FormatError,
    _open,
    _to_uint8,
)

_PCD_NORMALS = ("normal_x", "normal_y", "normal_z")


def _pcd_check_size(f: Any) -> None:
    """Reject headers that promise more data than the file holds (before any allocation)."""
    from pypcd4.pypcd4 import PCD_TYPE_TO_NUMPY_TYPE, MetaData

    lines: list[str] = []
    offset = 0
    for bline in f:
        try:
            line = bline.decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            raise _FormatError(f"the header line at byte {offset} is not text (byte "
                               f"{offset + exc.start})") from None
        offset += len(bline)
        if line.startswith("#") or not line:
            continue
        if not lines and not line.upper().startswith(("VERSION", "FIELDS")):
            break
        lines.append(line)
        if line.startswith("DATA") or len(lines) >= 10:
            break
    if not lines:
        raise _FormatError("not a PCD file (no VERSION/FIELDS header line)")
    meta = MetaData.parse_header(lines)
    nf = len(meta.fields)
    if nf != len(meta.size) or nf != len(meta.type) or nf != len(meta.count):
        raise _FormatError("FIELDS, SIZE, TYPE and COUNT have different lengths")
    for name, t, s, c in zip(meta.fields, meta.type, meta.size, meta.count, strict=True):
        if (t, s) not in PCD_TYPE_TO_NUMPY_TYPE:
            raise _FormatError(f"field {name!r}: unsupported TYPE {t} with SIZE {s}")
        if c < 1:
            raise _FormatError(f"field {name!r}: COUNT {c} is not positive")
    if meta.points < 0 or meta.width < 0 or meta.height < 0:
        raise _FormatError(f"negative size in the header (WIDTH {meta.width}, HEIGHT "
                           f"{meta.height}, POINTS {meta.points})")
    if meta.points == 0:
        raise _FormatError("the file contains no points (0 points)")
    start = f.tell()
    remaining = f.size - start
    values = sum(meta.count)  # numbers per point
    item = sum(s * c for s, c in zip(meta.size, meta.count, strict=True))
    need = meta.points * item
    encoding = str(meta.data.value)
    if encoding == "ascii":
        need_text = meta.points * 2 * values - 1  # one digit and one separator per number
        if need_text > remaining:
            raise _FormatError(f"truncated: {meta.points} points of {values} numbers need at "
                               f"least {need_text} bytes of text after byte {start}, the file "
                               f"has {remaining}")
        f.seek(0)
        return
    if encoding == "binary":
        if need > remaining:
            raise _FormatError(f"truncated: {meta.points} points need {need} bytes after byte "
                               f"{start}, the file has {remaining}")
        f.seek(0)
        return
    if encoding != "binary_compressed":
        raise _FormatError(f"unknown DATA encoding {encoding!r}")
    head = f.read(8)
    if len(head) < 8:
        raise _FormatError(f"truncated at byte {start}: no compressed-size header")
    comp, raw = struct.unpack("<II", head)
    if comp > remaining - 8:
        raise _FormatError(f"truncated: {comp} compressed bytes announced at byte {start}, "
                           f"{remaining - 8} present")
    # LZF expands at most ~100x; the raw block is exactly the points' records
    if raw != need or raw > 256 * comp + 64:
        raise _FormatError(f"inconsistent compressed block at byte {start}: {raw} bytes "
                           f"announced, {meta.points} points x {item} bytes expected")
    f.seek(0)


def _read_pcd(path: Path) -> _Fields:
    from pypcd4 import PointCloud as PcdCloud

    with _open(path) as f:
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
    names: list[str] = []
    sizes: list[int] = []
    types: list[Any] = []
    counts: list[int] = []
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


