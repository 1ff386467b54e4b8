"""LAS / LAZ files through laspy (optional dependency)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

from pointalign.cloud import PointCloud
from pointalign.io._common import (
    _arrays,
    _check_name,
    _Fields,
    _flat_extras,
    _FormatError,
    _open,
    _refuse,
)
from pointalign.io.pcd import _PCD_NORMALS

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


# bytes of a point record of each LAS point format (0..10), extra bytes not counted
_LAS_RECORD = (20, 28, 26, 34, 57, 63, 30, 36, 38, 59, 67)
_LAS_HEADER = {0: 227, 1: 227, 2: 227, 3: 235, 4: 375}  # minor version -> header bytes
# LAZ: bytes of uncompressed point records per compressed byte, at most. LASzip stores
# each chunk's first point raw and codes later points with adaptive arithmetic models;
# even constant points cost a fraction of a byte each, so 1000:1 is a generous bound.
_LAZ_MAX_RATIO = 1000


def _las_check_header(f: Any, laz: bool) -> None:
    """Check the LAS public header's counts and offsets against the file size.

    Done before laspy sees the file: a corrupt VLR count (up to 2**32 - 1) or point count
    would otherwise make it loop or allocate for as long as the header claims.
    """
    size = f.size
    head = f.read(375)
    if head[:4] != b"LASF":
        raise _FormatError("not a LAS file (no LASF signature at byte 0)")
    if len(head) < 227:
        raise _FormatError(f"truncated: the LAS header needs at least 227 bytes, the file "
                           f"has {size}")
    major, minor = head[24], head[25]
    if major != 1 or minor not in _LAS_HEADER:
        raise _FormatError(f"unsupported LAS version {major}.{minor} (byte 24)")
    header_size, offset, n_vlr, pf, rec_len, legacy = struct.unpack_from("<HIIBHI", head, 94)
    if header_size < _LAS_HEADER[minor] or header_size > size:
        raise _FormatError(f"header size {header_size} (byte 94) is too small for LAS "
                           f"{major}.{minor} or larger than the file ({size} bytes)")
    if not header_size <= offset <= size:
        raise _FormatError(f"offset to point data {offset} (byte 96) is outside "
                           f"{header_size}..{size}")
    fmt = pf & 0x3F
    if fmt >= len(_LAS_RECORD):
        raise _FormatError(f"unknown point format {fmt} (byte 104)")
    if rec_len < _LAS_RECORD[fmt]:
        raise _FormatError(f"point record length {rec_len} (byte 105) is shorter than the "
                           f"{_LAS_RECORD[fmt]} bytes of point format {fmt}")
    if n_vlr * 54 > offset - header_size:
        raise _FormatError(f"{n_vlr} VLRs (byte 100) cannot fit in the "
                           f"{offset - header_size} bytes before the point data")
    pos = header_size
    chunk_size, items = None, None
    for i in range(n_vlr):  # at most (offset - header_size) / 54 iterations
        f.seek(pos + 2)
        vlr = f.read(52)
        (length,) = struct.unpack_from("<H", vlr, 18)
        if laz and vlr[:14] == b"laszip encoded" and vlr[16:18] == b"\xbc\x56" \
                and length >= 34:  # record 22204: the LAZ parameters
            f.seek(pos + 54)
            laszip = f.read(length)
            chunk_size, n_items = struct.unpack_from("<I", laszip, 12)[0], \
                struct.unpack_from("<H", laszip, 32)[0]
            if length < 34 + 6 * n_items:
                raise _FormatError(f"the laszip VLR at byte {pos} lists {n_items} items in "
                                   f"{length} bytes")
            items = [struct.unpack_from("<HHH", laszip, 34 + 6 * k)[:2] for k in range(n_items)]
            for t, item_size in items:  # types 0 and 14: extra bytes of any size
                if t not in (0, 14) and _LAZ_ITEM_SIZE.get(t) != item_size:
                    raise _FormatError(f"the laszip VLR at byte {pos} has an item of type {t} "
                                       f"and size {item_size}")
            if sum(item_size for _, item_size in items) != rec_len:
                raise _FormatError(f"the laszip VLR's items (byte {pos}) do not add up to the "
                                   f"point record length {rec_len}")
        pos += 54 + length
        if pos > offset:
            raise _FormatError(f"VLR {i} at byte {pos - 54 - length} runs past the start of "
                               f"the point data (byte {offset})")
    count = legacy
    if minor >= 4:
        evlr_start, n_evlr, count64 = struct.unpack_from("<QIQ", head, 235)
        count = max(legacy, count64)
        if n_evlr:
            if not offset <= evlr_start <= size or n_evlr * 60 > size - evlr_start:
                raise _FormatError(f"{n_evlr} extended VLRs at byte {evlr_start} (byte 235) "
                                   f"do not fit in the file ({size} bytes)")
            pos = evlr_start
            for i in range(n_evlr):
                f.seek(pos + 20)
                (length,) = struct.unpack("<Q", f.read(8))
                pos += 60 + length
                if pos > size:
                    raise _FormatError(f"extended VLR {i} at byte {pos - 60 - length} runs "
                                       f"past the end of the file ({size} bytes)")
    need = count * rec_len
    have = size - offset
    if (need > have) if not laz else (need > _LAZ_MAX_RATIO * have + 65536):
        raise _FormatError(f"truncated: {count} points (byte {107 if count == legacy else 247}"
                           f") of {rec_len} bytes need {need} bytes after byte {offset}, the "
                           f"file has {have}")
    if laz and count:
        if chunk_size is None or items is None:
            raise _FormatError("no laszip VLR (user 'laszip encoded', record 22204)")
        # the decoder reserves a whole chunk of points (chunk_size, or all points when
        # chunks vary in size: 2**32 - 1) before it reads it
        if chunk_size == 0 or (chunk_size != 2**32 - 1
                               and chunk_size * rec_len > max(need, 2**26)):
            raise _FormatError(f"LAZ chunk size {chunk_size} is impossible for {count} points "
                               f"of {rec_len} bytes")
        table, _ = _laz_check_chunk_table(f, offset, count)
        _laz_check_first_chunk(f, offset, table, count, items)
    f.seek(0)


# bytes of each LAZ item type (6-9: LAS 1.0-1.3 point, GPS time, RGB, wave packet;
# 10-13: the LAS 1.4 ones, with RGB+NIR as 12)
_LAZ_ITEM_SIZE = {6: 20, 7: 8, 8: 6, 9: 29, 10: 30, 11: 6, 12: 8, 13: 29}
# layers of each LAZ 1.4 item type in a layered chunk (type 14: one layer per extra byte)
_LAZ_LAYERS = {10: 9, 11: 1, 12: 2, 13: 1}


def _laz_check_first_chunk(f: Any, offset: int, table: int, count: int,
                           items: list[tuple[int, int]]) -> None:
    """Check the first chunk's point count and layer sizes (point formats 6-10).

    A layered chunk holds the first point raw, the chunk's point count and the byte
    count of every layer; lazrs reserves each layer's bytes as read (a corrupt size
    reserves up to 4 GB per layer), so they are checked against the compressed bytes.
    Only the first chunk's header can be found without decoding the chunk table.
    """
    if not any(t >= 10 for t, _ in items):
        return  # LAZ 1.0-1.3 items: not layered
    raw = sum(size for _, size in items)
    layers = sum(_LAZ_LAYERS.get(t, size if t == 14 else 0) for t, size in items)
    pos = offset + 8 + raw
    if pos + 4 + 4 * layers > table:
        raise _FormatError(f"the first LAZ chunk at byte {offset + 8} is cut by the chunk "
                           f"table at byte {table}")
    f.seek(pos)
    head = f.read(4 + 4 * layers)
    in_chunk, *sizes = struct.unpack(f"<I{layers}I", head)
    if in_chunk > count:
        raise _FormatError(f"the first LAZ chunk (byte {pos}) claims {in_chunk} points of "
                           f"{count}")
    room = table - (pos + 4 + 4 * layers)
    if sum(sizes) > room:
        raise _FormatError(f"the first LAZ chunk's layers (byte {pos + 4}) claim "
                           f"{sum(sizes)} bytes, {room} are present")


def _laz_check_chunk_table(f: Any, offset: int, count: int) -> tuple[int, int]:
    """Check the LAZ chunk count before the decoder reserves memory for it.

    The point data starts with the (absolute) offset of the chunk table, or -1 when the
    offset was written in the file's last 8 bytes; the table starts with a version and the
    number of chunks. lazrs reserves that many entries up front and aborts the whole
    process when the allocation fails, so a corrupt count must not reach it.
    """
    size = f.size
    f.seek(offset)
    raw = f.read(8)
    if len(raw) < 8:
        raise _FormatError(f"truncated: no LAZ chunk-table offset at byte {offset}")
    (table,) = struct.unpack("<q", raw)
    where = offset
    if table == -1:
        f.seek(size - 8)
        (table,) = struct.unpack("<q", f.read(8))
        where = size - 8
    if not offset + 8 <= table <= size - 8:
        raise _FormatError(f"LAZ chunk table offset {table} (byte {where}) is outside "
                           f"{offset + 8}..{size - 8}")
    f.seek(table)
    _, chunks = struct.unpack("<II", f.read(8))
    if chunks > min(count, table - offset):  # a chunk holds >= 1 point and >= 1 byte
        raise _FormatError(f"the LAZ chunk table at byte {table} lists {chunks} chunks for "
                           f"{count} points in {table - offset} bytes")
    return table, chunks


def _read_las(path: Path) -> _Fields:
    laz = path.suffix.lower() == ".laz"
    with _open(path) as f:
        if f.read(4) != b"LASF":
            raise _FormatError("not a LAS file (no LASF signature at byte 0)")
        laspy = _laspy(laz)
        f.seek(0)
        _las_check_header(f, laz)
        try:
            las = laspy.read(f, closefd=False)
        except BaseException as exc:  # a Rust decoder's panic is a BaseException
            if type(exc).__name__ != "PanicException":
                raise
            raise _FormatError(f"the LAZ decoder failed (panic): {exc}") from None
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


