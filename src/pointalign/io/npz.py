"""NumPy files: .npy (one array) and .npz (named arrays), parsed without pickle.

The ``.npy`` header is parsed here (not by ``np.load``, whose ``ast.literal_eval`` raises
``TokenError``/``SyntaxError`` on mutated headers and which allocates whatever shape the
header claims): only the three keys NumPy writes (``descr``, ``fortran_order``, ``shape``),
only plain numeric/bool dtypes, and the bytes the shape needs are checked against the bytes
present before anything is allocated. ``.npz`` members are read through :mod:`zipfile` with
each member's claimed size checked against its compressed size first; zip and zlib errors
become ``ValueError`` naming the member.
"""

from __future__ import annotations

import re
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from pointalign.cloud import PointCloud
from pointalign.io._common import _arrays, _Fields, _FormatError, _open, _refuse
from pointalign.io.text import _columns

_MAGIC = b"\x93NUMPY"
_MAX_HEADER = 65536  # NumPy itself refuses headers above 10,000 bytes by default
# plain little/big-endian numbers only (no objects, strings, structured or long double)
_DESCR = re.compile(r"[<>|=]?(?:f[248]|[iu][1248]|b1)")
_ITEM = re.compile(
    r"""\s*(?P<q>['"])(?P<key>\w+)(?P=q)\s*:\s*"""
    r"""(?P<val>'[^'"]*'|"[^'"]*"|True|False|\([\d\s,]*\))\s*(?:,|(?=\}))"""
)
# deflate cannot expand more than ~1032:1; a larger claim is a corrupt size field
_MAX_RATIO = 1100


def _npy_header(head: bytes) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """Parse the start of a ``.npy`` stream: (dtype, shape, fortran order, data offset)."""
    if head[:6] != _MAGIC:
        raise _FormatError("not a .npy array (no \\x93NUMPY magic at byte 0)")
    if len(head) < 10:
        raise _FormatError(f"truncated: the .npy preamble needs 10 bytes, found {len(head)}")
    major = head[6]
    if major == 1:
        (hlen,), start = struct.unpack_from("<H", head, 8), 10
    elif major in (2, 3):
        if len(head) < 12:
            raise _FormatError("truncated: the .npy preamble needs 12 bytes")
        (hlen,), start = struct.unpack_from("<I", head, 8), 12
    else:
        raise _FormatError(f"unsupported .npy format version {major}.{head[7]} (byte 6)")
    if hlen > _MAX_HEADER:
        raise _FormatError(f"the .npy header claims {hlen} bytes (byte 8), more than "
                           f"{_MAX_HEADER}: corrupt")
    if start + hlen > len(head):
        raise _FormatError(f"truncated: the .npy header needs {hlen} bytes after byte "
                           f"{start}, found {len(head) - start}")
    try:
        text = head[start:start + hlen].decode("utf-8" if major == 3 else "latin1")
    except UnicodeDecodeError as exc:
        raise _FormatError(f"the .npy header is not text (byte {start + exc.start})") from None
    s = text.strip()
    items: dict[str, str] = {}
    pos = 1
    if s.startswith("{"):
        while (m := _ITEM.match(s, pos)) is not None:
            if m["key"] in items:
                break
            items[m["key"]] = m["val"]
            pos = m.end()
    if not s.startswith("{") or s[pos:].strip() != "}" \
            or set(items) != {"descr", "fortran_order", "shape"}:
        raise _FormatError(f"cannot parse the .npy header at byte {start}: {text[:80]!r}")
    descr = items["descr"][1:-1]
    if not _DESCR.fullmatch(descr):
        raise _FormatError(f"unsupported .npy dtype {descr!r} (plain numbers only; no "
                           "objects, strings or records)")
    dims = [t.strip() for t in items["shape"][1:-1].split(",")]
    if dims and not dims[-1]:
        dims.pop()  # "(5,)" and "(5, 3,)"
    if not all(d.isdigit() and len(d) <= 18 for d in dims):
        raise _FormatError(f"cannot parse the .npy shape {items['shape']!r} (byte {start})")
    shape = tuple(int(d) for d in dims)
    return np.dtype(descr), shape, items["fortran_order"] == "True", start + hlen


def _npy_need(dtype: np.dtype, shape: tuple[int, ...], present: int, at: int) -> int:
    """Elements of the array; raises unless its bytes are exactly the ``present`` ones."""
    count = 1
    for d in shape:
        count *= d
    need = count * dtype.itemsize
    if need > present:
        raise _FormatError(f"truncated: shape {shape} of {dtype} needs {need} bytes after "
                           f"byte {at}, found {present}")
    if need < present:
        raise _FormatError(f"{present - need} bytes after the data of shape {shape} of "
                           f"{dtype} (byte {at + need}): corrupt header?")
    return count


def _shaped(flat: np.ndarray, shape: tuple[int, ...], fortran: bool) -> np.ndarray:
    if fortran:
        return np.ascontiguousarray(flat.reshape(shape[::-1]).transpose())
    return flat.reshape(shape)


def _npy_from_bytes(buf: bytes) -> np.ndarray:
    """Return the array held in the complete bytes of a ``.npy`` file (a copy)."""
    dtype, shape, fortran, at = _npy_header(buf[: 12 + _MAX_HEADER])
    count = _npy_need(dtype, shape, len(buf) - at, at)
    flat = np.frombuffer(buf, dtype=dtype, count=count, offset=at).copy()
    return _shaped(flat, shape, fortran)


def _load_npy(path: Path) -> np.ndarray:
    with _open(path) as f:
        head = f.read(12 + _MAX_HEADER)
        dtype, shape, fortran, at = _npy_header(head)
        count = _npy_need(dtype, shape, f.size - at, at)
        f.seek(at)
        flat = np.fromfile(f, dtype=dtype, count=count)
    if flat.size != count:  # the file shrank while being read
        raise _FormatError(f"truncated: {flat.size} of {count} values read")
    return _shaped(flat, shape, fortran)


def _read_npy(path: Path) -> _Fields:
    arr = _load_npy(path)
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


# what zipfile/zlib raise on a corrupt archive (after the file itself was opened)
_ZIP_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, OSError, NotImplementedError,
               RuntimeError, struct.error, ValueError, KeyError, IndexError, OverflowError)


def _member(z: zipfile.ZipFile, info: zipfile.ZipInfo, archive_size: int) -> np.ndarray:
    """One ``.npy`` member, its size fields checked before it is decompressed."""
    name = info.filename
    if info.flag_bits & 0x1:
        raise _FormatError(f"member {name!r} is encrypted")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise _FormatError(f"member {name!r}: unsupported compression method "
                           f"{info.compress_type} (NumPy writes stored or deflated)")
    if info.compress_size > archive_size:
        raise _FormatError(f"member {name!r} claims {info.compress_size} compressed bytes, "
                           f"the file has {archive_size}")
    limit = info.compress_size if info.compress_type == zipfile.ZIP_STORED \
        else _MAX_RATIO * info.compress_size + 1024
    if info.file_size > limit:
        raise _FormatError(f"member {name!r} claims {info.file_size} bytes from "
                           f"{info.compress_size} compressed: corrupt size field")
    try:
        with z.open(info) as m:
            buf = m.read()
    except _ZIP_ERRORS as exc:
        kind = "zlib error" if isinstance(exc, zlib.error) else type(exc).__name__
        raise _FormatError(f"member {name!r}: {kind}: {exc}") from None
    try:
        return _npy_from_bytes(buf)
    except _FormatError as exc:
        raise _FormatError(f"member {name!r}: {exc}") from None


_WANTED = ("points", "normals", "colors", "features")


def _read_npz(path: Path) -> _Fields:
    with _open(path) as f:
        if f.read(4) not in (b"PK\x03\x04", b"PK\x05\x06"):
            raise _FormatError("not a .npz file (no zip signature at byte 0)")
        f.seek(0)
        try:
            z = zipfile.ZipFile(f)
        except _ZIP_ERRORS as exc:
            raise _FormatError(f"not a readable zip archive: {type(exc).__name__}: {exc}"
                               ) from None
        with z:
            members = {i.filename[:-4]: i for i in z.infolist()
                       if i.filename.endswith(".npy")}
            if "points" not in members:
                raise _FormatError(f"no 'points' array (keys: {sorted(members)[:20]})")
            d = {k: _member(z, i, f.size) for k, i in members.items()
                 if k in _WANTED or k.startswith("extra.")}
    pts = d["points"]
    if pts.ndim != 2 or pts.shape[1] != 3:
        raise _FormatError(f"'points' must have shape (N, 3), found {pts.shape}")
    if not np.issubdtype(pts.dtype, np.number):
        raise _FormatError(f"'points' must be numeric, found dtype {pts.dtype}")
    n = pts.shape[0]
    for k in _WANTED[1:]:
        if k in d and (d[k].ndim != 2 or d[k].shape[0] != n):
            raise _FormatError(f"{k!r} must have shape ({n}, C), found {d[k].shape}")
    extras = {k[len("extra."):]: v for k, v in d.items()
              if k.startswith("extra.") and v.ndim >= 1 and v.shape[0] == n}
    return _Fields(pts, d.get("normals"), d.get("colors"), d.get("features"), extras,
                   pts.dtype == np.float64)


def _write_npz(f: Any, cloud: PointCloud, binary: bool) -> None:
    a = _arrays(cloud)
    out = {k: a[k] for k in ("points", "normals", "colors", "features") if a[k] is not None}
    out.update({f"extra.{k}": v for k, v in a["extras"].items()})
    np.savez_compressed(f, **out)
