"""Text files: .xyz .txt .csv .pts .xyzn .xyzrgb, read by the column rule."""

from __future__ import annotations

import io as _io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pointalign.cloud import PointCloud
from pointalign.io._common import _arrays, _Fields, _FormatError, _open, _refuse, _to_uint8


def _is_number(tok: str) -> bool:
    try:
        float(tok)
    except ValueError:
        return False
    return True


def _parse_text(path: Path) -> tuple[np.ndarray, list[int]]:
    with _open(path) as f:
        raw = f.read()
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


