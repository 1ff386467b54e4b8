"""Read and write point clouds: one suffix -> reader/writer table, atomic writes.

:func:`read` and :func:`write` dispatch on the file suffix (case-insensitive) through
``FORMATS``; :func:`read_bin` reads raw float32 ``.bin`` scans (KITTI Velodyne style),
whose column count it infers from the data (x y z or x y z intensity) and announces, and
:func:`read` hands ``.bin`` files to it.

Formats (suffix: what is read and written; library):

* ``.ply``: vertex ``x y z``, ``nx ny nz``, ``red green blue``, ``feature_<j>``, other
  scalar vertex properties as ``extras``; ascii and binary little/big endian; elements other
  than ``vertex`` (faces, the Stanford scans' ``range_grid``) are skipped, a mesh's face
  count named in a warning; plyfile.
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
finite (organised scans mark missing returns with NaN) are dropped with their attributes,
and a :class:`~pointalign._progress.FileContentWarning` says how many.
Integer colours are scaled to [0, 1] by the type's maximum (255 for uint8). Every reading
error is a ``ValueError`` naming the file (and the row, line or byte offset where it is
known); a missing file is a ``FileNotFoundError``. A file with 0 points is an error.

**Corrupt files.** Every reader checks what a header claims (vertex and point counts, field
counts, ``.npy`` shapes, zip member sizes, LAS VLR/point counts and offsets, the LAZ chunk
count) against the file size before it allocates or loops, and every read of the file is
clamped to the bytes left in it, so a corrupt or hostile file fails fast with memory bounded
by a small multiple of the file size. ``.npy``/``.npz`` are parsed without pickle and
without ``np.load``. ``benchmarks/fuzz_io.py`` fuzzes every reader (results in
RELIABILITY.md). One limit is outside this package: lazrs (the LAZ decoder) reserves the
byte counts of a chunk's layers (point formats 6-10) as read from the file; with Linux's
default overcommit such a reservation is virtual and the read fails with a ValueError, but
under a hard address-space limit (``ulimit -v``) the decoder aborts the process.

The readers live in ``pointalign.io.{ply,pcd,text,npz,las}``, the shared record and the
conversion to a cloud in ``pointalign.io._common``.

Writers never lose data silently: a field the format cannot store (normals in ``.npy``,
extras in text files, ...) raises ``ValueError`` before anything is written. Colours are
stored as 8-bit integers in PLY, PCD and text (16-bit in LAS), so they come back rounded to
1/255. Every write goes to a temporary file in the target's directory, which then replaces
the target with ``os.replace``; a failure part-way leaves any existing file untouched.
Writing through a symbolic link replaces the file it points to (the link stays), and a
replaced file keeps its permission bits. :func:`check_writable` checks a destination
before any work is done.
"""

from __future__ import annotations

import math
import os
import secrets
import stat
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
from pointalign.io import las, npz, pcd, ply, text
from pointalign.io._common import _build, _Fields, _FormatError

__all__ = ["FORMATS", "Format", "check_writable", "read", "read_bin", "write"]

PathLike = str | os.PathLike


@dataclass(frozen=True)
class Format:
    """One row of the suffix table: a reader and a writer for a file format."""

    name: str
    reader: Callable[[Path], _Fields]
    writer: Callable[[Any, PointCloud, bool], None]


FORMATS: dict[str, Format] = {
    ".ply": Format("PLY", ply._read_ply, ply._write_ply),
    ".pcd": Format("PCD", pcd._read_pcd, pcd._write_pcd),
    ".xyz": Format("XYZ text", text._text_reader("auto"), text._text_writer("xyz")),
    ".txt": Format("XYZ text", text._text_reader("auto"), text._text_writer("txt")),
    ".csv": Format("CSV text", text._text_reader("auto"), text._text_writer("csv")),
    ".pts": Format("PTS text", text._text_reader("pts"), text._text_writer("pts")),
    ".xyzn": Format("XYZN text", text._text_reader("xyzn"), text._text_writer("xyzn")),
    ".xyzrgb": Format("XYZRGB text", text._text_reader("xyzrgb"),
                      text._text_writer("xyzrgb")),
    ".npy": Format("NumPy .npy", npz._read_npy, npz._write_npy),
    ".npz": Format("NumPy .npz", npz._read_npz, npz._write_npz),
    ".las": Format("LAS", las._read_las, las._write_las),
    ".laz": Format("LAZ", las._read_las,
                   lambda f, c, b: las._write_las(f, c, b, laz=True)),
}
"""Suffix (lower case, with the dot) -> :class:`Format`.

A reader takes the path and returns the module's private ``_Fields`` record; a writer takes
an open binary file (the temporary file), the cloud and ``binary``. Tests swap rows to
inject failures.
"""

# what a parser may raise on a bad file; converted to ValueError naming the file
_PARSE_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, KeyError, IndexError, TypeError, struct.error, EOFError, RuntimeError,
    ArithmeticError, zipfile.BadZipFile, AssertionError,
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
        hint = (" (raw float32 .bin scans are read, not written: write .ply, .pcd or .npy)"
                if path.suffix.lower() == ".bin" else "")
        raise ValueError(f"{path}: unknown file suffix {path.suffix!r}; supported: "
                         f"{', '.join(FORMATS)}{' and .bin (reading)' if not hint else ''}"
                         f"{hint}")
    return fmt


def _dtype_arg(dtype: Any) -> torch.dtype | None:
    if dtype is None:
        return None
    if dtype in (torch.float32, np.float32, "float32"):
        return torch.float32
    if dtype in (torch.float64, np.float64, "float64"):
        return torch.float64
    raise ValueError(f"dtype: expected None, torch.float32 or torch.float64, got {dtype!r}")


def _path_arg(path: Any, name: str = "path") -> Path:
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name}: expected a str or os.PathLike file name, got "
                        f"{type(path).__name__}")
    p = os.fspath(path)
    if not isinstance(p, str):
        raise TypeError(f"{name}: expected a str or os.PathLike file name, got a path of "
                        f"{type(p).__name__}")
    if not p or "\0" in p:
        raise ValueError(f"{name}: {p!r} is not a valid file name")
    return Path(p)


def _check_file(path: Path) -> None:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(f"{path}: is a directory, not a point-cloud file")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: not a regular file (a device, pipe or socket)")
    if st.st_size == 0:
        raise ValueError(f"{path}: the file is empty (0 bytes)")


def read(path: PathLike, *, dtype: torch.dtype | None = None) -> PointCloud:
    """Read a point cloud; the format is chosen by the file suffix (see ``FORMATS``).

    Args:
        path: file to read (``.ply .pcd .xyz .txt .csv .pts .xyzn .xyzrgb .npy .npz .las
            .laz``, and raw float32 ``.bin`` scans by :func:`read_bin`'s rules;
            case-insensitive).
        dtype: float dtype of the result; default keeps the file's precision (float64 for
            double-precision, text and LAS files, float32 otherwise).

    Returns:
        A :class:`PointCloud` on the CPU: ``points (N, 3)``, and ``normals (N, 3)``,
        ``colors (N, 3)`` in [0, 1], ``features (N, D)`` and ``extras`` where the file has
        them. Points with non-finite coordinates are dropped, and a
        :class:`~pointalign._progress.FileContentWarning` gives their count; a mesh PLY is
        read as its vertices, with a warning naming its face count.

    Raises:
        FileNotFoundError: no such file.
        IsADirectoryError: ``path`` is a directory.
        TypeError: ``path`` is not a str or path object.
        ValueError: unknown suffix (the message lists the supported ones), not a regular
            file, or a corrupt, truncated or empty file, or 0 points; the message names
            the file and, where the parser tells it, the row, line or byte offset. Header
            claims (counts, sizes, offsets) are checked against the file size before
            anything is allocated, so a corrupt file fails fast with bounded memory.
        ImportError: ``.las``/``.laz`` without laspy or a LAZ backend (with install hint).

    """
    p = _path_arg(path)
    if p.suffix.lower() == ".bin":
        _dtype_arg(dtype)
        return read_bin(p, dtype=dtype)
    fmt = _format_for(p)
    dt = _dtype_arg(dtype)
    _check_file(p)
    try:
        fields = fmt.reader(p)
        cloud = _build(fields, dt)
    except ImportError:
        raise
    except _parse_errors() as exc:
        detail = str(exc) if isinstance(exc, _FormatError) else f"{type(exc).__name__}: {exc}"
        raise ValueError(f"cannot read {p} as {fmt.name}: {detail}") from exc
    _announce(p, fields)
    return cloud


#: the column counts :func:`read_bin` considers when none is given: KITTI's
#: ``x y z reflectance`` first, then ``x y z``
BIN_COLUMNS = (4, 3)

#: rows sampled to test a raw float32 file's layout
_BIN_SAMPLE = 200_000


def _lag_spread(flat: np.ndarray, lag: int) -> float:
    """Median of ``|f[i + lag] − f[i]|`` over a fixed sample of the float stream ``flat``.

    At the true row length this pairs one coordinate of a point with the same coordinate of
    the next (close on an ordered scan, of one distribution on any cloud); at a wrong one it
    pairs x with y or a coordinate with an intensity, which differ more.
    """
    m = flat.size - lag
    if m <= 0:
        return math.inf
    idx = np.arange(m) if m <= _BIN_SAMPLE else \
        np.random.default_rng(0).choice(m, _BIN_SAMPLE, replace=False)
    d = np.abs(flat[idx + lag].astype(np.float64) - flat[idx].astype(np.float64))
    d = d[np.isfinite(d)]
    return float(np.median(d)) if d.size else math.inf


def _intensity_doubt(flat: np.ndarray, columns: int) -> str | None:
    """Why the 4th of ``columns`` values per row is not a plausible intensity (None: it is)."""
    if columns < 4:
        return None
    col = flat.reshape(-1, columns)[:, 3]
    finite = np.isfinite(col)
    negative = float(np.count_nonzero(finite & (col < 0))) / col.size
    if negative > 0.01:
        return f"{100 * negative:.0f}% of the 4th column (the intensity) is negative"
    if not finite.all():
        return f"{np.count_nonzero(~finite)} values of the 4th column are NaN or Inf"
    return None


def _bin_columns(p: Path, flat: np.ndarray, size: int, columns: int | None) -> int:
    """Choose (``columns=None``) or check the row length of a raw float32 file.

    Candidates are :data:`BIN_COLUMNS` whose row size divides the file. With two, the one
    whose stream repeats with its period (:func:`_lag_spread` at least 2x smaller) wins;
    when neither stands out, 4 unless its 4th column is not a plausible intensity. An
    inferred layout other than KITTI's 4 columns, or an unclear choice, is announced with
    a :class:`~pointalign._progress.FileContentWarning`; a given ``columns`` that the data
    contradicts gets one too (the file is still read as asked).
    """
    from pointalign import _progress

    fits = [c for c in BIN_COLUMNS if size % (4 * c) == 0]
    spread = {c: _lag_spread(flat, c) for c in fits}

    def clearly(c: int) -> bool:
        return all(spread[c] * 2 < spread[o] for o in fits if o != c)

    names = {3: "x y z", 4: "x y z intensity"}
    if columns is not None:
        others = [c for c in fits if c != columns and spread[c] * 2 < _lag_spread(flat, columns)]
        why = [w for w in (_intensity_doubt(flat, columns),) if w]
        if others:
            why.append(f"the values repeat every {others[0]} floats, not every {columns}")
        if why:
            better = others or [c for c in fits if c != columns and not _intensity_doubt(flat, c)]
            alt = f"; columns={better[0]} ({names[better[0]]}) fits the data" if better else ""
            _progress.warn(f"{p}: read as {columns} float32 columns as asked, but "
                           f"{' and '.join(why)}: the points may be garbage{alt}",
                           _progress.FileContentWarning, stacklevel=3)
        return columns
    if not fits:
        raise ValueError(f"cannot read {p} as raw float32: its {size} bytes are not a multiple "
                         "of 16 (x y z intensity) or 12 (x y z); truncated, or another "
                         "layout: pass columns= to read_bin")
    clear = next((c for c in fits if clearly(c)), None)
    if len(fits) == 1:  # 12N bytes with N % 4 != 0 cannot hold 4 columns, and vice versa
        chosen, how = fits[0], f"its size is a multiple of {4 * fits[0]} bytes only"
    elif clear is not None:
        chosen, how = clear, f"its values repeat every {clear} floats"
    else:
        doubt = _intensity_doubt(flat, 4)
        chosen = 3 if doubt else 4
        how = "the layout is not clear from the data" + (f" ({doubt} when read as 4 "
                                                         "columns)" if doubt else "")
    if chosen != BIN_COLUMNS[0] or how.startswith("the layout"):
        _progress.warn(f"{p}: read as {chosen} float32 columns ({names[chosen]}): {how}; "
                       "pass columns= (CLI: --bin-columns) if that is wrong",
                       _progress.FileContentWarning, stacklevel=3)
    _progress.get_logger("io").info("%s: read as %d float32 columns (%s)", p, chosen,
                                    names[chosen])
    return chosen


def read_bin(path: PathLike, *, columns: int | None = None,
             dtype: torch.dtype | None = None) -> PointCloud:
    """Read a raw little-endian float32 ``.bin`` scan (KITTI Velodyne style).

    The file is ``N x columns`` float32 values, row after row, with no header. KITTI's own
    scans are ``x y z reflectance`` (4; the 4th column becomes ``extras["intensity"]``),
    some re-exports keep only ``x y z`` (3). Columns beyond 4 go to ``extras["columns"]``.

    With ``columns=None`` (the default) the layout is read from the data: of 4 and 3 the
    row length whose size divides the file's and at which the float stream repeats
    (the same coordinate of consecutive points: a 3-column scan read as 4 columns would
    mix x, y and z in every column); when neither stands out, 4 unless the 4th column is
    not a plausible intensity (negative values). A layout other than 4 columns, or an
    unclear choice, is announced with a :class:`~pointalign._progress.FileContentWarning`
    naming the assumption. A given ``columns`` is used as asked; it is warned about when
    the data contradicts it. A file size that is not a multiple of the row size is
    rejected.

    Args:
        path: the ``.bin`` file.
        columns: float32 values per point, at least 3; None: inferred (4 or 3).
        dtype: float dtype of the result (default float32).

    Raises:
        ValueError: a bad ``columns``, a size no row length divides, or (``columns=None``)
            values that are no plausible x y z [intensity] layout; the message names the
            file.

    """
    if columns is not None and (not isinstance(columns, (int, np.integer))
                                or isinstance(columns, bool) or columns < 3):
        raise ValueError(f"columns: expected None or an integer >= 3, got {columns!r}")
    p = _path_arg(path)
    dt = _dtype_arg(dtype)
    _check_file(p)
    size = p.stat().st_size
    if columns is not None and size % (4 * int(columns)):
        row = 4 * int(columns)
        raise ValueError(f"cannot read {p} as raw float32: its {size} bytes are not a "
                         f"multiple of {row} ({columns} float32 columns); truncated, or "
                         "wrong `columns`?")
    flat = np.fromfile(p, dtype="<f4")
    ncol = _bin_columns(p, flat, size, None if columns is None else int(columns))
    table = flat.reshape(-1, ncol)
    extras = {}
    if ncol >= 4:
        extras["intensity"] = table[:, 3].copy()
    if ncol > 4:
        extras["columns"] = table[:, 4:].copy()
    fields = _Fields(table[:, :3], extras=extras)
    try:
        cloud = _build(fields, dt)
    except _FormatError as exc:
        raise ValueError(f"cannot read {p} as raw float32: {exc}") from exc
    _announce(p, fields)
    return cloud


def _announce(p: Path, fields: _Fields) -> None:
    """Warn about what reading ``p`` left out: a mesh's faces, rows with NaN coordinates."""
    from pointalign import _progress

    faces = (fields.skipped or {}).get("face", 0)
    if faces:
        _progress.warn(f"{p}: read the {len(fields.points) - fields.dropped:,} vertices as "
                       f"points; its {faces:,} faces are not used (a mesh: its vertices "
                       "may be unevenly spread over the surface)",
                       _progress.FileContentWarning, stacklevel=3)
    if fields.dropped:
        n = len(fields.points)
        _progress.warn(f"{p}: dropped {fields.dropped:,} of {n:,} points whose coordinates "
                       "are NaN or Inf (missing returns of an organised scan, or damage)",
                       _progress.FileContentWarning, stacklevel=3)


def _write_target(path: Any) -> tuple[Path, Path, Format]:
    """(path as given, file that will be replaced, format); ValueError if not writable."""
    p = _path_arg(path)
    fmt = _format_for(p)
    target = p
    if p.is_symlink():
        target = Path(os.path.realpath(p))
        if target.is_symlink():  # realpath stops inside a loop of links
            raise ValueError(f"{p}: cannot write through a loop of symbolic links")
    if target.is_dir():
        raise ValueError(f"{p}: is a directory")
    if target.exists() and not target.is_file():
        raise ValueError(f"{p}: exists and is not a regular file (a device, pipe or socket)")
    parent = target.parent
    if not parent.is_dir():
        raise ValueError(f"{p}: cannot write, the folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{p}: cannot write, no permission to create files in {parent}")
    return p, target, fmt


def check_writable(path: PathLike) -> None:
    """Check that :func:`write` can write ``path``, before any work is done.

    Checks the suffix (a known format), that the folder exists and accepts new files,
    that ``path`` (or the file a symbolic link points to) is not a directory or a special
    file, and that the format's optional dependency (laspy, a LAZ backend) is installed.
    Nothing is created.

    Args:
        path: the destination, as it would be passed to :func:`write`.

    Raises:
        ValueError: the message names ``path`` and the reason.
        TypeError: ``path`` is not a str or path object.

    """
    p, _, _ = _write_target(path)
    if p.suffix.lower() in (".las", ".laz"):
        try:
            las._laspy(p.suffix.lower() == ".laz")
        except ImportError as exc:
            raise ValueError(f"{p}: cannot write: {exc}") from None


def _keep_owner_and_mode(fd: int, old: os.stat_result) -> None:
    """Give the new file the replaced file's group/owner (where allowed) and mode."""
    if (old.st_uid, old.st_gid) != (os.getuid(), os.getgid()):
        try:
            os.fchown(fd, old.st_uid, old.st_gid)
        except OSError:
            pass  # only root may give files away; the mode is kept all the same
    os.fchmod(fd, stat.S_IMODE(old.st_mode))


def write(path: PathLike, cloud: PointCloud, *, binary: bool = True) -> None:
    """Write a point cloud; the format is chosen by the file suffix (see ``FORMATS``).

    The file is written to a temporary file in the same directory and moved into place with
    ``os.replace``, so an error part-way (full disk, a field the format cannot hold, ...)
    never destroys an existing file. ``cloud`` is not modified.

    If ``path`` is a symbolic link, the file it points to is replaced (atomically, in that
    file's folder) and the link stays. Replacing an existing file keeps its permission bits
    (a 0600 file stays 0600) and, where the user may, its owner and group; a new file gets
    the usual umask-based mode. (A hard link to the old file keeps the old contents.)

    Args:
        path: destination; its suffix picks the format.
        cloud: the :class:`PointCloud` to write, or an ``(N, 3)`` array/tensor of points
            (any device; copied to the CPU).
        binary: binary encoding for PLY (little endian) and PCD; ``False`` writes ASCII.
            Ignored by formats with a single encoding (text, NumPy, LAS).

    Raises:
        ValueError: unknown suffix, a folder that does not exist or is not writable, a
            directory or special file at ``path`` (see :func:`check_writable`), or a field
            the format cannot store (nothing is written then).
        TypeError: ``cloud`` is neither a PointCloud nor an ``(N, 3)`` array; ``binary``
            is not a bool; ``path`` is not a str or path object.
        ImportError: ``.las``/``.laz`` without laspy or a LAZ backend.

    """
    if not isinstance(binary, (bool, np.bool_)):
        raise TypeError(f"binary: expected True or False, got {binary!r}")
    if not isinstance(cloud, PointCloud):
        # a bare (N, 3) array or tensor is a cloud of points only
        cloud = PointCloud(_validate.as_points(cloud, "cloud"))
    _, target, fmt = _write_target(path)
    try:
        old: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        old = None
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "xb") as f:  # created with the usual umask-based permissions
            if old is not None:
                _keep_owner_and_mode(f.fileno(), old)
            fmt.writer(f, cloud, bool(binary))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
