"""Bad input to the io API, one table: each row is a call and the error it must raise.

Every error names the argument or the file; a failed write leaves nothing behind.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from pointalign import PointCloud
from pointalign import io as pio

try:
    import laspy  # noqa: F401

    HAS_LAS = True
except ImportError:  # pragma: no cover
    HAS_LAS = False


def _cloud(normals: bool = False, extras: dict | None = None) -> PointCloud:
    g = np.random.default_rng(0)
    n = g.normal(size=(5, 3))
    return PointCloud(torch.from_numpy(g.normal(size=(5, 3))),
                      torch.from_numpy(n / np.linalg.norm(n, axis=1, keepdims=True))
                      if normals else None, extras=extras or {})


def _file(d: Path, name: str, data: bytes = b"") -> Path:
    p = d / name
    p.write_bytes(data)
    return p


def _valid_ply(d: Path, name: str = "ok.ply") -> Path:
    pio.write(d / name, _cloud())
    return d / name


def _fifo(d: Path) -> Path:
    p = d / "pipe.ply"
    os.mkfifo(p)
    return p


def _loop(d: Path) -> Path:
    (d / "a.ply").symlink_to(d / "b.ply")
    (d / "b.ply").symlink_to(d / "a.ply")
    return d / "a.ply"


def _to_devnull(d: Path) -> Path:
    (d / "null.ply").symlink_to("/dev/null")
    return d / "null.ply"


# (id, call taking the temporary folder, exception, regex the message must match)
READ_CASES = [
    ("missing file", lambda d: pio.read(d / "nope.ply"), FileNotFoundError, "nope.ply"),
    ("missing folder", lambda d: pio.read(d / "no" / "x.pcd"), FileNotFoundError, "x.pcd"),
    ("directory", lambda d: pio.read((d / "dir.ply").mkdir() or d / "dir.ply"),
     IsADirectoryError, "dir.ply.*directory"),
    ("fifo", lambda d: pio.read(_fifo(d)), ValueError, "pipe.ply.*not a regular file"),
    ("unknown suffix", lambda d: pio.read(_file(d, "x.obj", b"v 0 0 0")), ValueError,
     r"x\.obj.*unknown file suffix.*\.ply"),
    ("no suffix", lambda d: pio.read(_file(d, "cloud", b"1 2 3")), ValueError,
     "unknown file suffix ''"),
    (".bin of no row size", lambda d: pio.read(_file(d, "s.bin", bytes(50))), ValueError,
     r"s\.bin.*not a multiple of 16.*or 12.*read_bin"),
    ("path int", lambda d: pio.read(5), TypeError, "path: expected a str"),
    ("path None", lambda d: pio.read(None), TypeError, "path: expected a str"),
    ("path bytes", lambda d: pio.read(b"x.ply"), TypeError, "path: expected a str"),
    ("path empty", lambda d: pio.read(""), ValueError, "path: '' is not a valid"),
    ("path NUL", lambda d: pio.read("a\0.ply"), ValueError, "path: .* not a valid"),
    ("dtype int", lambda d: pio.read(_valid_ply(d), dtype=torch.int32), ValueError, "dtype"),
    ("dtype f16", lambda d: pio.read(_valid_ply(d), dtype="float16"), ValueError, "dtype"),
    ("ply content in .pcd", lambda d: pio.read(_file(d, "w.pcd", _valid_ply(d).read_bytes())),
     ValueError, "w.pcd.*not a PCD"),
    ("pcd content in .npy", lambda d: pio.read(_file(d, "w.npy", b"VERSION .7\nFIELDS x\n")),
     ValueError, r"w\.npy.*not a \.npy"),
    ("text in .npz", lambda d: pio.read(_file(d, "w.npz", b"1 2 3\n")), ValueError,
     r"w\.npz.*zip signature"),
    ("text in .las", lambda d: pio.read(_file(d, "w.las", b"1 2 3\n")), ValueError,
     r"w\.las.*LASF"),
    ("binary in .xyz", lambda d: pio.read(_file(d, "w.xyz", b"\xff\xfe\x00junk")), ValueError,
     r"w\.xyz.*not a text file.*byte offset 0"),
    ("two columns", lambda d: pio.read(_file(d, "w.csv", b"1,2\n3,4\n")), ValueError,
     r"w\.csv.*line 1.*3 columns"),
    ("ragged rows", lambda d: pio.read(_file(d, "w.txt", b"1 2 3\n4 5 6 7\n")), ValueError,
     r"w\.txt.*line 2"),
    ("npy 1-D", lambda d: (np.save(d / "v.npy", np.zeros(9)), pio.read(d / "v.npy")),
     ValueError, r"v\.npy.*\(N, 3\)"),
    ("npy strings", lambda d: (np.save(d / "s.npy", np.array([["a", "b", "c"]])),
                               pio.read(d / "s.npy")), ValueError, r"s\.npy.*dtype"),
    ("npy object", lambda d: (np.save(d / "o.npy", np.array([[1, None, 2]], dtype=object),
                                      allow_pickle=True), pio.read(d / "o.npy")),
     ValueError, r"o\.npy.*unsupported .npy dtype '\|O'"),
    ("npz no points", lambda d: (np.savez(d / "n.npz", xyz=np.zeros((3, 3))),
                                 pio.read(d / "n.npz")), ValueError, r"n\.npz.*'points'"),
    ("npz normals rows", lambda d: (np.savez(d / "r.npz", points=np.zeros((3, 3)),
                                             normals=np.zeros((2, 3))), pio.read(d / "r.npz")),
     ValueError, r"r\.npz.*normals"),
    ("all NaN", lambda d: pio.read(_file(d, "nan.xyz", b"nan 1 2\n1 inf 2\n")), ValueError,
     r"nan\.xyz.*finite"),
]

READ_BIN_CASES = [
    ("columns 2", lambda d: pio.read_bin(_file(d, "k.bin", bytes(48)), columns=2), ValueError,
     "columns"),
    ("columns str", lambda d: pio.read_bin(_file(d, "k.bin", bytes(48)), columns="4"),
     ValueError, "columns"),
    ("columns bool", lambda d: pio.read_bin(_file(d, "k.bin", bytes(48)), columns=True),
     ValueError, "columns"),
    ("columns float", lambda d: pio.read_bin(_file(d, "k.bin", bytes(48)), columns=4.0),
     ValueError, "columns"),
    ("size", lambda d: pio.read_bin(_file(d, "k.bin", bytes(50)), columns=4), ValueError,
     r"k\.bin.*multiple of 16"),
    ("missing", lambda d: pio.read_bin(d / "none.bin", columns=4), FileNotFoundError,
     "none.bin"),
    ("empty", lambda d: pio.read_bin(_file(d, "e.bin"), columns=3), ValueError,
     r"e\.bin.*empty"),
    ("path list", lambda d: pio.read_bin(["a.bin"], columns=3), TypeError, "path"),
]

WRITE_CASES = [
    ("unknown suffix", lambda d: pio.write(d / "x.obj", _cloud()), ValueError,
     r"x\.obj.*unknown file suffix"),
    ("no suffix", lambda d: pio.write(d / "x", _cloud()), ValueError, "unknown file suffix"),
    ("missing folder", lambda d: pio.write(d / "no" / "x.ply", _cloud()), ValueError,
     r"x\.ply.*folder .*no does not exist"),
    ("folder is a file", lambda d: pio.write(_file(d, "f.txt") / "x.ply", _cloud()),
     ValueError, "does not exist"),
    ("path is a directory", lambda d: pio.write((d / "x.ply").mkdir() or d / "x.ply",
                                                _cloud()), ValueError, r"x\.ply.*directory"),
    ("symlink loop", lambda d: pio.write(_loop(d), _cloud()), ValueError, "loop"),
    ("link to a device", lambda d: pio.write(_to_devnull(d), _cloud()), ValueError,
     "not a regular file"),
    ("path int", lambda d: pio.write(3, _cloud()), TypeError, "path"),
    ("cloud str", lambda d: pio.write(d / "x.ply", "points"), TypeError, "cloud"),
    ("cloud None", lambda d: pio.write(d / "x.ply", None), TypeError, "cloud"),
    ("cloud (3, 2)", lambda d: pio.write(d / "x.ply", np.zeros((3, 2))), ValueError,
     r"cloud: expected shape \(N, 3\)"),
    ("cloud (3, 3, 1)", lambda d: pio.write(d / "x.ply", np.zeros((3, 3, 1))), ValueError,
     "cloud"),
    ("cloud empty", lambda d: pio.write(d / "x.ply", np.zeros((0, 3))), ValueError,
     "cloud: .*empty"),
    ("cloud NaN", lambda d: pio.write(d / "x.ply", np.full((2, 3), np.nan)), ValueError,
     "cloud: .*NaN"),
    ("cloud complex", lambda d: pio.write(d / "x.ply", np.zeros((2, 3), complex)), TypeError,
     "cloud: .*complex"),
    ("cloud bool", lambda d: pio.write(d / "x.ply", np.zeros((2, 3), bool)), TypeError,
     "cloud: .*bool"),
    ("binary str", lambda d: pio.write(d / "x.ply", _cloud(), binary="yes"), TypeError,
     "binary"),
    ("binary None", lambda d: pio.write(d / "x.ply", _cloud(), binary=None), TypeError,
     "binary"),
    ("normals to .npy", lambda d: pio.write(d / "x.npy", _cloud(normals=True)), ValueError,
     r"\.npy cannot store the cloud's normals"),
    (".xyzn without normals", lambda d: pio.write(d / "x.xyzn", _cloud()), ValueError,
     "needs normals"),
    (".xyzrgb without colours", lambda d: pio.write(d / "x.xyzrgb", _cloud()), ValueError,
     "needs colors"),
    ("extras to text", lambda d: pio.write(d / "x.csv", _cloud(extras={
        "i": torch.zeros(5)})), ValueError, "extras"),
    ("bad extras name", lambda d: pio.write(d / "x.ply", _cloud(extras={
        "a b": torch.zeros(5)})), ValueError, "'a b'"),
    ("extras clash", lambda d: pio.write(d / "x.ply", _cloud(extras={
        "x": torch.zeros(5)})), ValueError, "clashes"),
    ("int64 beyond PLY", lambda d: pio.write(d / "x.ply", _cloud(extras={
        "big": torch.full((5,), 2**40)})), ValueError, "int32"),
]

CHECK_CASES = [
    ("unknown suffix", lambda d: pio.check_writable(d / "x.obj"), ValueError,
     "unknown file suffix"),
    ("missing folder", lambda d: pio.check_writable(d / "no" / "x.ply"), ValueError,
     "does not exist"),
    ("directory", lambda d: pio.check_writable((d / "x.pcd").mkdir() or d / "x.pcd"),
     ValueError, "directory"),
    ("path None", lambda d: pio.check_writable(None), TypeError, "path"),
]
if HAS_LAS:
    WRITE_CASES.append(("float extras to LAS intensity", lambda d: pio.write(
        d / "x.las", _cloud(extras={"intensity": torch.linspace(0, 1, 5)})), ValueError,
        "intensity"))


def _ids(rows):
    return [r[0] for r in rows]


@pytest.mark.parametrize("name,call,exc,match", READ_CASES + READ_BIN_CASES,
                         ids=_ids(READ_CASES + READ_BIN_CASES))
def test_read_bad_input(tmp_path, name, call, exc, match):
    with pytest.raises(exc, match=match):
        call(tmp_path)


@pytest.mark.parametrize("name,call,exc,match", WRITE_CASES + CHECK_CASES,
                         ids=_ids(WRITE_CASES) + [f"check {r[0]}" for r in CHECK_CASES])
def test_write_bad_input(tmp_path, name, call, exc, match):
    before = {p.name for p in tmp_path.rglob("*")}
    with pytest.raises(exc, match=match):
        call(tmp_path)
    made = {p.name for p in tmp_path.rglob("*")} - before
    # only what the call's setup made (folders, links, files); no output, no temp files
    assert not [m for m in made if m.endswith(".tmp")]
    assert "x.ply" not in made or (tmp_path / "x.ply").is_dir()


@pytest.mark.parametrize("suffix", sorted(pio.FORMATS))
def test_empty_file_every_suffix(tmp_path, suffix):
    with pytest.raises(ValueError, match=f"empty{suffix}.*empty"):
        pio.read(_file(tmp_path, f"empty{suffix}"))


def test_check_writable_accepts_and_creates_nothing(tmp_path):
    for name in ("a.ply", "b.PCD", "c.npz", "d.xyz"):
        assert pio.check_writable(tmp_path / name) is None
        assert pio.check_writable(str(tmp_path / name)) is None
    assert not list(tmp_path.iterdir())
    _valid_ply(tmp_path, "e.ply")
    pio.check_writable(tmp_path / "e.ply")  # an existing file may be replaced


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_folder(tmp_path):  # pragma: no cover - CI runs as a user
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(ValueError, match="no permission"):
            pio.check_writable(ro / "x.ply")
        with pytest.raises(ValueError, match="no permission"):
            pio.write(ro / "x.ply", _cloud())
    finally:
        ro.chmod(0o700)
