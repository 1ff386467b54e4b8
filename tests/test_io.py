"""pointalign.io: round trips of every format, real files, bad files, atomic writes, fuzzing."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import plyfile
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from pypcd4 import PointCloud as PcdCloud
from pypcd4.pypcd4 import Encoding

from pointalign import PointCloud
from pointalign import io as pio
from pointalign._progress import FileContentWarning

try:
    import laspy

    HAS_LAS = True
    HAS_LAZ = bool(laspy.LazBackend.detect_available())
except ImportError:  # pragma: no cover
    HAS_LAS = HAS_LAZ = False

COLOR_TOL = 0.5 / 255 + 1e-6  # colours are stored as 8-bit integers


def make_cloud(seed: int, n: int = 57, dtype=torch.float64, *, normals=True, colors=True,
               features=False, extras=False, scale=10.0) -> PointCloud:
    g = np.random.default_rng(seed)
    pts = g.normal(size=(n, 3)) * scale + g.normal(size=3) * 100
    nrm = g.normal(size=(n, 3))
    nrm /= np.linalg.norm(nrm, axis=1, keepdims=True)
    col = g.uniform(size=(n, 3))
    ext = {}
    if extras:
        ext = {"intensity": g.uniform(size=n).astype(np.float32),
               "label": g.integers(-5, 1000, size=n).astype(np.int32)}
    return PointCloud(
        torch.from_numpy(pts).to(dtype),
        torch.from_numpy(nrm).to(dtype) if normals else None,
        torch.from_numpy(col).to(dtype) if colors else None,
        torch.from_numpy(g.normal(size=(n, 5))).to(dtype) if features else None,
        ext,
    )


def assert_close(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float = 0.0) -> None:
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    err = (a64 - b64).abs() - rtol * b64.abs()
    assert float(err.max()) <= atol, f"max error {float((a64 - b64).abs().max())} > {atol}"


def no_temp_files(d: Path) -> bool:
    return not [p for p in d.iterdir() if p.name.endswith(".tmp")]


# ----------------------------------------------------------------------------------------
# round trips: (suffix, binary, holds normals, holds colours, coordinate tolerance)
# ----------------------------------------------------------------------------------------

ROUND_TRIPS = [
    (".ply", True, True, True, 0.0),
    (".ply", False, True, True, 0.0),  # plyfile writes %.18g: exact
    (".pcd", True, True, True, 0.0),
    (".pcd", False, True, True, 1e-9),  # pypcd4 writes %.10f
    (".xyz", True, True, True, 0.0),  # %.9g / %.17g: exact
    (".txt", True, True, True, 0.0),
    (".csv", True, True, True, 0.0),
    (".pts", True, False, True, 0.0),
    (".xyzn", True, True, False, 0.0),
    (".xyzrgb", True, False, True, 0.0),
    (".npy", True, False, False, 0.0),
    (".npz", True, True, True, 0.0),
]


@pytest.mark.parametrize("suffix,binary,has_n,has_c,tol", ROUND_TRIPS,
                         ids=[f"{r[0]}-{'bin' if r[1] else 'ascii'}" for r in ROUND_TRIPS])
def test_round_trip(tmp_path, seed, dtype, suffix, binary, has_n, has_c, tol):
    check_round_trip(tmp_path, seed, 37 + seed, dtype, suffix, binary, has_n, has_c, tol)


@pytest.mark.parametrize("suffix,binary,has_n,has_c,tol", ROUND_TRIPS,
                         ids=[f"{r[0]}-{'bin' if r[1] else 'ascii'}" for r in ROUND_TRIPS])
def test_round_trip_single_point(tmp_path, suffix, binary, has_n, has_c, tol):
    check_round_trip(tmp_path, 11, 1, torch.float32, suffix, binary, has_n, has_c, tol)


def check_round_trip(tmp_path, seed, n, dtype, suffix, binary, has_n, has_c, tol):
    cloud = make_cloud(seed, n=n, dtype=dtype, normals=has_n, colors=has_c)
    before = {k: v.copy() for k, v in cloud.numpy().items()}
    path = tmp_path / f"c{suffix}"
    pio.write(path, cloud, binary=binary)
    for k, v in cloud.numpy().items():  # the input is never modified
        np.testing.assert_array_equal(v, before[k])
    back = pio.read(path, dtype=dtype)
    assert back.dtype == dtype and len(back) == len(cloud)
    # relative part covers float32 -> decimal text -> float32 (exact) and float64 via %.10f
    assert_close(back.points, cloud.points, tol, rtol=0.0)
    if has_n:
        assert_close(back.normals, cloud.normals, tol + 1e-12)
    else:
        assert back.normals is None
    if has_c:
        exact = suffix == ".npz" or suffix == ".xyzrgb"
        assert_close(back.colors, cloud.colors, 1e-12 if exact else COLOR_TOL)
    else:
        assert back.colors is None
    assert no_temp_files(tmp_path)


@pytest.mark.parametrize("suffix,binary", [(".ply", True), (".ply", False), (".pcd", True),
                                           (".npz", True), (".npy", True), (".xyz", True)])
def test_default_dtype_keeps_file_precision(tmp_path, suffix, binary):
    for dt in (torch.float32, torch.float64):
        cloud = make_cloud(3, dtype=dt, normals=False, colors=False)
        pio.write(tmp_path / f"a{suffix}", cloud, binary=binary)
        back = pio.read(tmp_path / f"a{suffix}")
        want = torch.float64 if suffix == ".xyz" else dt  # decimal text reads as float64
        assert back.dtype == want
        assert_close(back.points.to(dt), cloud.points, 0.0)  # 9 digits: exact in float32


@pytest.mark.parametrize("suffix,binary", [(".ply", True), (".ply", False), (".pcd", True),
                                           (".pcd", False), (".npz", True)])
def test_round_trip_features_and_extras(tmp_path, seed, suffix, binary):
    cloud = make_cloud(seed, dtype=torch.float32, features=True, extras=True)
    pio.write(tmp_path / f"f{suffix}", cloud, binary=binary)
    back = pio.read(tmp_path / f"f{suffix}")
    assert_close(back.features, cloud.features, 1e-6 if binary else 1e-9)
    assert set(back.extras) == {"intensity", "label"}
    assert_close(back.extras["intensity"], cloud.extras["intensity"], 1e-9)
    assert torch.equal(back.extras["label"].to(torch.int64),
                       cloud.extras["label"].to(torch.int64))


@pytest.mark.skipif(not HAS_LAS, reason="laspy not installed")
def test_round_trip_las(tmp_path, seed, dtype):
    cloud = make_cloud(seed, dtype=dtype, extras=True).replace(
        extras={"intensity": torch.arange(57, dtype=torch.int32) * 100})
    pio.write(tmp_path / "c.las", cloud)
    back = pio.read(tmp_path / "c.las")
    assert back.dtype == torch.float64  # scaled integers + offset need float64
    extent = float((cloud.points.max(0).values - cloud.points.min(0).values).max())
    assert_close(back.points, cloud.points, 5e-9 * extent + 1e-12)  # half the LAS scale
    assert_close(back.normals, cloud.normals, 1e-7 if dtype == torch.float32 else 1e-15)
    assert_close(back.colors, cloud.colors, 0.5 / 65535 + 1e-7)  # 16 bit + float32
    assert torch.equal(back.extras["intensity"].to(torch.int64),
                       cloud.extras["intensity"].to(torch.int64))
    assert set(back.extras) == {"intensity"}  # all-zero standard dimensions are not carried


@pytest.mark.skipif(not HAS_LAS, reason="laspy not installed")
def test_las_refuses_lossy_standard_dimension(tmp_path):
    cloud = make_cloud(0, normals=False, colors=False).replace(
        extras={"intensity": torch.linspace(0, 1, 57)})  # floats: LAS intensity is uint16
    with pytest.raises(ValueError, match="intensity"):
        pio.write(tmp_path / "c.las", cloud)
    assert not (tmp_path / "c.las").exists() and no_temp_files(tmp_path)


@pytest.mark.skipif(not HAS_LAS, reason="laspy not installed")
def test_laz(tmp_path):
    cloud = make_cloud(0, normals=False, colors=False)
    if not HAS_LAZ:
        with pytest.raises(ImportError, match="LAZ"):
            pio.write(tmp_path / "c.laz", cloud)
        assert not (tmp_path / "c.laz").exists() and no_temp_files(tmp_path)
        (tmp_path / "d.laz").write_bytes(b"LASF" + bytes(400))
        with pytest.raises(ImportError, match="pip install"):
            pio.read(tmp_path / "d.laz")
        return
    pio.write(tmp_path / "c.laz", cloud)  # pragma: no cover - needs lazrs/laszip
    assert_close(pio.read(tmp_path / "c.laz").points, cloud.points, 1e-6)


def test_ply_big_endian_elements_before_and_after_vertex_and_extra_properties(tmp_path, seed):
    g = np.random.default_rng(seed)
    n = 23
    v = np.empty(n, dtype=[("x", ">f4"), ("y", ">f4"), ("z", ">f4"), ("nx", ">f4"),
                           ("ny", ">f4"), ("nz", ">f4"), ("red", "u1"), ("green", "u1"),
                           ("blue", "u1"), ("confidence", ">f4"), ("flags", ">u2")])
    for c in ("x", "y", "z", "nx", "ny", "nz", "confidence"):
        v[c] = g.normal(size=n)
    for c in ("red", "green", "blue"):
        v[c] = g.integers(0, 256, size=n)
    v["flags"] = g.integers(0, 65536, size=n)
    cam = np.array([(1.0, 2.0)], dtype=[("view_px", "f4"), ("view_py", "f4")])
    grid = np.empty(40, dtype=[("vertex_indices", "O")])
    grid["vertex_indices"] = [np.arange(g.integers(0, 3), dtype="i4") for _ in range(40)]
    for text, order in ((False, ">"), (False, "<"), (True, "=")):
        path = tmp_path / f"s{text}{order}.ply"
        plyfile.PlyData([plyfile.PlyElement.describe(cam, "camera"),
                         plyfile.PlyElement.describe(v, "vertex"),
                         plyfile.PlyElement.describe(grid, "range_grid")],
                        text=text, byte_order=order).write(str(path))
        c = pio.read(path)
        assert c.dtype == torch.float32 and len(c) == n
        np.testing.assert_array_equal(c.points.numpy(), np.stack([v["x"], v["y"], v["z"]], 1))
        np.testing.assert_array_equal(c.normals.numpy(),
                                      np.stack([v["nx"], v["ny"], v["nz"]], 1))
        rgb = np.stack([v["red"], v["green"], v["blue"]], 1) / 255.0
        np.testing.assert_allclose(c.colors.numpy(), rgb, atol=1e-7)
        assert set(c.extras) == {"confidence", "flags"}
        np.testing.assert_array_equal(c.extras["flags"].numpy(), v["flags"])
        np.testing.assert_array_equal(c.extras["confidence"].numpy(), v["confidence"])


def test_ply_without_plyfile_private_helpers(tmp_path, monkeypatch):
    """The public PlyData.read fallback gives the same cloud as the vertex-only fast path."""
    cloud = make_cloud(0, dtype=torch.float32, extras=True)
    pio.write(tmp_path / "a.ply", cloud)
    fast = pio.read(tmp_path / "a.ply")
    monkeypatch.setattr(pio.ply, "_PLY_VERTEX_ONLY", False)
    slow = pio.read(tmp_path / "a.ply")
    for name in ("points", "normals", "colors"):
        assert torch.equal(getattr(fast, name), getattr(slow, name))
    assert torch.equal(fast.extras["label"], slow.extras["label"])


def test_pcd_compressed_and_packed_float_rgb(tmp_path, seed):
    g = np.random.default_rng(seed)
    n = 31
    xyz = g.normal(size=(n, 3)).astype(np.float32)
    rgb8 = g.integers(0, 256, size=(n, 3))
    packed = PcdCloud.encode_rgb(rgb8)  # PCL convention: 0x00RRGGBB as float32 bits
    inten = g.uniform(size=n).astype(np.float32)
    pc = PcdCloud.from_points([xyz[:, 0], xyz[:, 1], xyz[:, 2], packed, inten],
                              ("x", "y", "z", "rgb", "intensity"),
                              (np.float32, np.float32, np.float32, np.float32, np.float32))
    for enc in (Encoding.BINARY_COMPRESSED, Encoding.BINARY):
        path = tmp_path / f"{enc.value}.pcd"
        pc.save(path, encoding=enc)
        c = pio.read(path)
        np.testing.assert_array_equal(c.points.numpy(), xyz)
        np.testing.assert_allclose(c.colors.numpy(), rgb8 / 255.0, atol=1e-7)
        np.testing.assert_array_equal(c.extras["intensity"].numpy(), inten)


def test_pcd_single_column_fields_and_separate_rgb(tmp_path, seed):
    g = np.random.default_rng(seed)
    cloud = make_cloud(seed, normals=False, colors=False).replace(
        features=torch.from_numpy(g.normal(size=(57, 1))),
        extras={"ring": torch.from_numpy(g.integers(0, 64, size=(57, 1)).astype(np.int16))})
    for binary in (True, False):
        pio.write(tmp_path / "one.pcd", cloud, binary=binary)
        back = pio.read(tmp_path / "one.pcd")
        assert_close(back.features, cloud.features, 1e-9)
        assert torch.equal(back.extras["ring"].reshape(-1), cloud.extras["ring"].reshape(-1))
    xyz = g.normal(size=(9, 3)).astype(np.float32)
    rgb = g.integers(0, 256, size=(9, 3)).astype(np.uint8)
    PcdCloud.from_points([*xyz.T, *rgb.T], tuple("xyzrgb"), (np.float32,) * 3 + (np.uint8,) * 3
                         ).save(tmp_path / "sep.pcd")
    back = pio.read(tmp_path / "sep.pcd")
    np.testing.assert_allclose(back.colors.numpy(), rgb / 255.0, atol=1e-7)
    assert not back.extras


def test_non_finite_points_are_dropped(tmp_path):
    (tmp_path / "a.xyz").write_text("1 2 3\nnan nan nan\n4 5 6\n")
    with pytest.warns(FileContentWarning, match=r"a\.xyz: dropped 1 of 3 points .*NaN"):
        c = pio.read(tmp_path / "a.xyz")
    np.testing.assert_array_equal(c.points.numpy(), [[1, 2, 3], [4, 5, 6]])
    (tmp_path / "b.xyz").write_text("nan 0 0\ninf 1 1\n")
    with pytest.raises(ValueError, match="b.xyz.*finite"):
        pio.read(tmp_path / "b.xyz")


# ----------------------------------------------------------------------------------------
# the column rule for text and .npy
# ----------------------------------------------------------------------------------------

def test_text_column_rule(tmp_path):
    g = np.random.default_rng(5)
    xyz = g.normal(size=(6, 3))
    nrm = g.normal(size=(6, 3))
    nrm /= np.linalg.norm(nrm, axis=1, keepdims=True)
    rgb = g.integers(0, 256, size=(6, 3))

    def put(name: str, table: np.ndarray, head: str = "", sep: str = " ") -> PointCloud:
        np.savetxt(tmp_path / name, table, fmt="%.17g", delimiter=sep, header=head,
                   comments="")
        return pio.read(tmp_path / name)

    c = put("n.xyz", np.hstack([xyz, nrm]))
    assert c.colors is None and np.allclose(c.normals.numpy(), nrm)
    c = put("c.txt", np.hstack([xyz, rgb]), sep=",")
    assert c.normals is None and np.allclose(c.colors.numpy(), rgb / 255)
    c = put("f.csv", np.hstack([xyz, rgb / 255 * 0.9]), head="x,y,z,r,g,b", sep=",")
    assert c.normals is None and np.allclose(c.colors.numpy(), rgb / 255 * 0.9)
    c = put("e.xyz", np.hstack([xyz, xyz * 7]))
    assert c.normals is None and c.colors is None
    assert np.allclose(c.extras["columns"].numpy(), xyz * 7)
    c = put("nc.xyz", np.hstack([xyz, nrm, rgb]))
    assert np.allclose(c.normals.numpy(), nrm) and np.allclose(c.colors.numpy(), rgb / 255)
    c = put("nine.xyz", np.hstack([xyz, xyz, rgb]))  # columns 4-6 are not normals
    assert c.normals is None and c.colors is None and c.extras["columns"].shape == (6, 6)
    c = put("i.pts", np.hstack([xyz, xyz[:, :1], rgb]), head="6")
    assert np.allclose(c.extras["intensity"].numpy(), xyz[:, 0])
    assert np.allclose(c.colors.numpy(), rgb / 255)
    c = put("four.xyz", np.hstack([xyz, xyz[:, :1]]), head="# comment line")
    assert c.extras["columns"].shape == (6, 1)
    np.save(tmp_path / "n.npy", np.hstack([xyz, nrm]))
    assert np.allclose(pio.read(tmp_path / "n.npy").normals.numpy(), nrm)


@pytest.mark.parametrize("text,where", [
    ("1 2 3\n4 x 6\n", "line 2"),
    ("1 2 3\n4 5\n", "line 2"),
    ("5\n1 2 3\n4 5 6\n", "count line says 5 points but 2"),
    ("1 2\n3 4\n", "line 1"),
    ("# only a comment\n\n", "0 points"),
])
def test_text_errors_name_file_and_line(tmp_path, text, where):
    path = tmp_path / "bad.pts"
    path.write_text(text)
    with pytest.raises(ValueError) as exc:
        pio.read(path)
    assert "bad.pts" in str(exc.value) and where in str(exc.value)


# ----------------------------------------------------------------------------------------
# real files from the shared data
# ----------------------------------------------------------------------------------------

def _pcd_oracle(path: Path) -> np.ndarray:
    """Independent parse of a binary PCD with only F4 fields."""
    raw = path.read_bytes()
    head, _, body = raw.partition(b"DATA binary\n")
    fields = [ln.split()[1:] for ln in head.decode().splitlines() if ln.startswith("FIELDS")][0]
    n = int([ln.split()[1] for ln in head.decode().splitlines() if ln.startswith("POINTS")][0])
    return np.frombuffer(body[: n * 4 * len(fields)], "<f4").reshape(n, len(fields))


def test_real_bunny_ply(shared_data):
    path = shared_data / "stanford_bunny" / "data" / "bun000.ply"
    if not path.is_file():
        pytest.skip("bun000.ply absent")
    c = pio.read(path)
    assert len(c) == 40256 and c.dtype == torch.float32 and not c.extras
    lines = path.read_text().splitlines()
    start = lines.index("end_header") + 1
    oracle = np.loadtxt(lines[start: start + 40256], dtype=np.float32)
    np.testing.assert_array_equal(c.points.numpy(), oracle)


def test_real_pcd_with_normals_and_rgb(shared_data):
    path = shared_data / "open3d_demo" / "feature" / "cloud_bin_0.pcd"
    if not path.is_file():
        pytest.skip("cloud_bin_0.pcd absent")
    c = pio.read(path)
    assert len(c) == 3903 and c.normals is not None and c.colors is not None
    oracle = _pcd_oracle(path)
    np.testing.assert_array_equal(c.points.numpy(), oracle[:, :3])
    np.testing.assert_array_equal(c.normals.numpy(), oracle[:, 3:6])
    packed = oracle[:, 6].copy().view(np.uint32)
    np.testing.assert_allclose(c.colors[:, 0].numpy() * 255, (packed >> 16) & 255, atol=1e-4)
    assert np.allclose(np.linalg.norm(c.normals.numpy(), axis=1), 1, atol=1e-3)


def test_real_lidar_pcd_and_kitti_bin(shared_data):
    path = shared_data / "lidar" / "fast_gicp_pair" / "251370668.pcd"
    if path.is_file():
        c = pio.read(path)
        assert len(c) == 69088 and set(c.extras) == {"intensity"}
        np.testing.assert_array_equal(c.points.numpy(), _pcd_oracle(path)[:, :3])
    kitti = shared_data / "lidar" / "kitti_00" / "000000_xyz.bin"
    if kitti.is_file():
        k = pio.read_bin(kitti, columns=3)
        assert len(k) == 124668
        with pytest.warns(FileContentWarning, match="read as 3 float32 columns"):
            assert len(pio.read(kitti)) == 124668  # its size also divides by 16
        np.testing.assert_allclose(k.points[0].numpy(), [52.898, 0.023, 1.998], atol=1e-3)
        with pytest.raises(ValueError, match="000000_xyz.bin.*multiple of 20"):
            pio.read_bin(kitti, columns=5)


def test_read_bin_columns(tmp_path):
    a = np.arange(40, dtype="<f4").reshape(10, 4)
    a.tofile(tmp_path / "s.bin")
    c = pio.read_bin(tmp_path / "s.bin", columns=4)
    np.testing.assert_array_equal(c.points.numpy(), a[:, :3])
    np.testing.assert_array_equal(c.extras["intensity"].numpy(), a[:, 3])
    with pytest.raises(ValueError, match="columns"):
        pio.read_bin(tmp_path / "s.bin", columns=2)
    # pa.read() reads .bin by the same rules (160 bytes: only 4 columns fit), silently
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same = pio.read(tmp_path / "s.bin")
    np.testing.assert_array_equal(same.points.numpy(), a[:, :3])
    # .bin is read, not written
    with pytest.raises(ValueError, match=r"unknown file suffix '\.bin'.*read, not written"):
        pio.write(tmp_path / "w.bin", c)


def _ring_scan(n_rings=16, per_ring=240, seed=0):
    """An ordered LiDAR-like sweep: rings of points around a sensor, x y z (metres)."""
    g = np.random.default_rng(seed)
    az = np.tile(np.linspace(-np.pi, np.pi, per_ring, endpoint=False), n_rings)
    elev = np.repeat(np.radians(np.linspace(-15, 5, n_rings)), per_ring)
    r = 10 + 30 * g.random(az.size)
    return np.stack([r * np.cos(elev) * np.cos(az), r * np.cos(elev) * np.sin(az),
                     r * np.sin(elev)], 1).astype("<f4")


@pytest.mark.parametrize("shuffle", [False, True])
def test_bin_layout_is_inferred_not_guessed(tmp_path, shuffle):
    """An x y z scan whose size divides by 16 is read as x y z, and the assumption said."""
    xyz = _ring_scan()  # 3840 points: 46080 bytes, a multiple of 16 and of 12
    if shuffle:  # an unordered cloud: only the 4th column's sign tells
        xyz = xyz[np.random.default_rng(1).permutation(len(xyz))]
    xyz.tofile(tmp_path / "xyz.bin")
    for read in (pio.read_bin, pio.read):
        with pytest.warns(FileContentWarning, match=r"xyz\.bin: read as 3 float32 columns"):
            c = read(tmp_path / "xyz.bin")
        np.testing.assert_array_equal(c.points.numpy(), xyz)
        assert not c.extras
    # asked for 4 columns: read as asked, with a warning naming the better reading
    with pytest.warns(FileContentWarning, match=r"as asked.*garbage.*columns=3"):
        four = pio.read_bin(tmp_path / "xyz.bin", columns=4)
    assert len(four) == len(xyz) * 3 // 4
    # KITTI's layout (reflectance in [0, 1]) is read without a word
    xyzi = np.concatenate([xyz, np.random.default_rng(2).random((len(xyz), 1))], 1)
    xyzi.astype("<f4").tofile(tmp_path / "xyzi.bin")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        k = pio.read(tmp_path / "xyzi.bin")
        assert pio.read_bin(tmp_path / "xyzi.bin", columns=4).extras.keys() == {"intensity"}
    np.testing.assert_array_equal(k.points.numpy(), xyz)
    np.testing.assert_allclose(k.extras["intensity"].numpy(), xyzi[:, 3], rtol=1e-7)
    with pytest.raises(ValueError, match=r"odd\.bin.*not a multiple of 16.*or 12"):
        (tmp_path / "odd.bin").write_bytes(bytes(20))
        pio.read(tmp_path / "odd.bin")


def test_mesh_ply_says_it_read_the_vertices(tmp_path):
    v = np.array([(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1)],
                 dtype=[("x", "f4"), ("y", "f4"), ("z", "f4")])
    f = np.array([([0, 1, 2],), ([0, 1, 3],), ([0, 2, 3],)], dtype=[("vertex_indices", "O")])
    plyfile.PlyData([plyfile.PlyElement.describe(v, "vertex"),
                     plyfile.PlyElement.describe(f, "face")]).write(str(tmp_path / "m.ply"))
    with pytest.warns(FileContentWarning, match=r"m\.ply: read the 4 vertices as points; "
                      r"its 3 faces are not used"):
        c = pio.read(tmp_path / "m.ply")
    assert len(c) == 4
    with warnings.catch_warnings():  # a plain point-cloud PLY: nothing to say
        warnings.simplefilter("error")
        pio.write(tmp_path / "p.ply", c)
        pio.read(tmp_path / "p.ply")


# ----------------------------------------------------------------------------------------
# bad files
# ----------------------------------------------------------------------------------------

READABLE = [s for s in pio.FORMATS if s != ".laz" or HAS_LAZ]
BINARY_SAMPLES = [(".ply", True), (".pcd", True), (".npy", True), (".npz", True)] + (
    [(".las", True)] if HAS_LAS else [])


def test_missing_and_unknown(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.ply"):
        pio.read(tmp_path / "nope.ply")
    with pytest.raises(ValueError, match=r"\.obj.*\.ply.*\.pcd"):
        pio.read(tmp_path / "x.obj")
    with pytest.raises(ValueError, match="unknown file suffix"):
        pio.write(tmp_path / "x.obj", make_cloud(0))
    with pytest.raises(TypeError, match="cloud"):
        pio.write(tmp_path / "x.ply", "not a cloud")
    with pytest.raises(ValueError, match=r"cloud: expected shape \(N, 3\)"):
        pio.write(tmp_path / "x.ply", np.zeros((3, 2)))
    pio.write(tmp_path / "bare.ply", np.zeros((3, 3)))  # a bare array is a cloud of points
    assert len(pio.read(tmp_path / "bare.ply")) == 3
    with pytest.raises(ValueError, match="no_dir.*does not exist"):
        pio.write(tmp_path / "no_dir" / "x.ply", make_cloud(0))
    (tmp_path / "j.ply").write_bytes(b"\x00junk" * 10)
    with pytest.raises(ValueError, match="j.ply.*not a PLY file"):
        pio.read(tmp_path / "j.ply")
    with pytest.raises(ValueError, match="dtype"):
        pio.read(tmp_path / "x.ply", dtype=torch.int32)


@pytest.mark.parametrize("suffix", READABLE)
def test_empty_file(tmp_path, suffix):
    path = tmp_path / f"empty{suffix}"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=f"empty{suffix}.*empty"):
        pio.read(path)


@pytest.mark.parametrize("suffix", READABLE)
def test_random_bytes(tmp_path, suffix, seed):
    path = tmp_path / f"junk{suffix}"
    path.write_bytes(np.random.default_rng(seed).bytes(2000))
    with pytest.raises(ValueError, match=f"junk{suffix}"):
        pio.read(path)


@pytest.mark.parametrize("suffix,binary", BINARY_SAMPLES + [(".ply", False), (".pcd", False)])
def test_truncated(tmp_path, suffix, binary):
    path = tmp_path / f"cut{suffix}"
    pio.write(path, make_cloud(1, n=200, normals=suffix != ".npy", colors=suffix != ".npy"),
              binary=binary)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match=f"cut{suffix}") as exc:
        pio.read(path)
    if binary and suffix in (".ply", ".pcd", ".las"):  # the size check names the byte counts
        assert "truncated" in str(exc.value)


def test_truncated_compressed_pcd(tmp_path):
    xyz = np.random.default_rng(0).normal(size=(300, 3)).astype(np.float32)
    PcdCloud.from_xyz_points(xyz).save(tmp_path / "z.pcd", Encoding.BINARY_COMPRESSED)
    raw = (tmp_path / "z.pcd").read_bytes()
    (tmp_path / "z.pcd").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match="z.pcd.*truncated"):
        pio.read(tmp_path / "z.pcd")


def test_ply_truncated_message_names_row(tmp_path):
    path = tmp_path / "t.ply"
    pio.write(path, make_cloud(0, n=100), binary=False)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) * 3 // 4])
    with pytest.raises(ValueError, match=r"t\.ply.*row \d+"):
        pio.read(path)


def test_zero_points(tmp_path):
    v = np.empty(0, dtype=[("x", "f4"), ("y", "f4"), ("z", "f4")])
    plyfile.PlyData([plyfile.PlyElement.describe(v, "vertex")]).write(str(tmp_path / "z.ply"))
    np.save(tmp_path / "z.npy", np.zeros((0, 3)))
    PcdCloud.from_xyz_points(np.zeros((0, 3), np.float32)).save(tmp_path / "z.pcd")
    for name in ("z.ply", "z.npy", "z.pcd"):
        with pytest.raises(ValueError, match=f"{name}.*0 points"):
            pio.read(tmp_path / name)


# ----------------------------------------------------------------------------------------
# writing: atomic replacement, refusal to lose fields
# ----------------------------------------------------------------------------------------

def test_failed_write_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "keep.ply"
    old = make_cloud(0)
    pio.write(path, old)
    old_bytes = path.read_bytes()

    def broken(f, cloud, binary):
        f.write(b"ply\nformat binary_little_endian 1.0\n" + b"\0" * 100)
        raise OSError("No space left on device (simulated)")

    monkeypatch.setitem(pio.FORMATS, ".ply", pio.Format("PLY", pio.FORMATS[".ply"].reader,
                                                        broken))
    with pytest.raises(OSError, match="simulated"):
        pio.write(path, make_cloud(1))
    assert path.read_bytes() == old_bytes and no_temp_files(tmp_path)
    monkeypatch.undo()
    assert_close(pio.read(path).points, old.points, 0.0)


@pytest.mark.parametrize("suffix,field", [(".npy", "normals"), (".xyz", "extras"),
                                          (".pts", "normals"), (".xyz", "features")])
def test_write_refuses_to_drop_fields(tmp_path, suffix, field):
    path = tmp_path / f"old{suffix}"
    path.write_bytes(b"previous contents")
    cloud = make_cloud(0, normals=True, colors=False, features=field == "features",
                       extras=field == "extras")
    with pytest.raises(ValueError, match=field):
        pio.write(path, cloud)
    assert path.read_bytes() == b"previous contents" and no_temp_files(tmp_path)


def test_write_does_not_modify_input_with_extras(tmp_path):
    cloud = make_cloud(2, dtype=torch.float32, features=True, extras=True)
    snap = {k: v.copy() for k, v in cloud.numpy().items()}
    for suffix in (".ply", ".pcd", ".npz"):
        pio.write(tmp_path / f"w{suffix}", cloud, binary=False)
    for k, v in cloud.numpy().items():
        np.testing.assert_array_equal(v, snap[k])


def test_write_permissions_follow_umask(tmp_path):
    pio.write(tmp_path / "p.ply", make_cloud(0))
    mode = os.stat(tmp_path / "p.ply").st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask


# ----------------------------------------------------------------------------------------
# fuzzing the parsers (bounded, fast)
# ----------------------------------------------------------------------------------------

# POINTALIGN_FUZZ_EXAMPLES=2000 for a longer local run (derandomized: same cases in CI)
FUZZ = settings(max_examples=int(os.environ.get("POINTALIGN_FUZZ_EXAMPLES", "25")),
                deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def _read_or_value_error(path: Path) -> None:
    try:
        c = pio.read(path)
    except ValueError as exc:
        assert path.name in str(exc)
    else:
        assert isinstance(c, PointCloud) and len(c) > 0
        assert bool(torch.isfinite(c.points).all())


@FUZZ
@given(data=st.binary(min_size=1, max_size=300),
       suffix=st.sampled_from(READABLE))
def test_fuzz_random_bytes(tmp_path, data, suffix):
    path = tmp_path / f"fz{suffix}"
    path.write_bytes(data)
    _read_or_value_error(path)


_SAMPLES: dict[str, bytes] = {}


def _sample(tmp_path: Path, suffix: str, binary: bool) -> bytes:
    key = f"{suffix}{binary}"
    if key not in _SAMPLES:
        p = tmp_path / f"sample{suffix}"
        pio.write(p, make_cloud(4, n=6, dtype=torch.float32, extras=suffix != ".xyz"),
                  binary=binary)
        _SAMPLES[key] = p.read_bytes()
    return _SAMPLES[key]


@FUZZ
@given(which=st.sampled_from([(".ply", True), (".ply", False), (".pcd", True),
                              (".pcd", False), (".npz", True), (".xyz", True)]),
       cut=st.floats(0.0, 1.0), flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)),
                                             max_size=4))
def test_fuzz_mutated_valid_files(tmp_path, which, cut, flips):
    raw = bytearray(_sample(tmp_path, *which))
    for pos, val in flips:
        raw[min(int(pos * len(raw)), len(raw) - 1)] = val
    raw = raw[: max(1, int(cut * len(raw))) if cut < 1 else len(raw)]
    path = tmp_path / f"mut{which[0]}"
    path.write_bytes(bytes(raw))
    _read_or_value_error(path)


@FUZZ
@given(pts=hnp.arrays(np.float64, st.tuples(st.integers(1, 20), st.just(3)),
                      elements=st.floats(-1e12, 1e12, allow_nan=False)),
       suffix=st.sampled_from([".xyz", ".csv", ".pts", ".ply", ".pcd"]))
def test_fuzz_text_and_ascii_round_trip(tmp_path, pts, suffix):
    path = tmp_path / f"rt{suffix}"
    pio.write(path, PointCloud(pts), binary=False)
    back = pio.read(path, dtype=torch.float64)
    tol = 1e-9 if suffix == ".pcd" else 0.0  # pypcd4's %.10f
    np.testing.assert_allclose(back.points.numpy(), pts, rtol=1e-15 if tol else 0, atol=tol)


# ----------------------------------------------------------------------------------------
# writing through symbolic links, keeping the replaced file's mode
# ----------------------------------------------------------------------------------------

def test_write_through_symlink_keeps_the_link(tmp_path):
    real_dir = tmp_path / "data"
    real_dir.mkdir()
    target = real_dir / "scan.ply"
    pio.write(target, make_cloud(0))
    link = tmp_path / "latest.ply"
    link.symlink_to(target)
    new = make_cloud(1)
    pio.write(link, new)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert_close(pio.read(target).points, new.points, 0.0)
    assert no_temp_files(tmp_path) and no_temp_files(real_dir)
    # a relative link, a chain of links, and a dangling link (creates the target)
    (tmp_path / "rel.ply").symlink_to(Path("data") / "scan.ply")
    (tmp_path / "chain.ply").symlink_to(tmp_path / "rel.ply")
    pio.write(tmp_path / "chain.ply", make_cloud(2))
    assert (tmp_path / "chain.ply").is_symlink() and (tmp_path / "rel.ply").is_symlink()
    assert_close(pio.read(target).points, make_cloud(2).points, 0.0)
    (tmp_path / "dangling.ply").symlink_to(real_dir / "new.ply")
    pio.write(tmp_path / "dangling.ply", make_cloud(3))
    assert (tmp_path / "dangling.ply").is_symlink() and (real_dir / "new.ply").is_file()


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o444, 0o755])
def test_write_keeps_the_replaced_files_mode(tmp_path, mode):
    path = tmp_path / "m.pcd"
    pio.write(path, make_cloud(0))
    os.chmod(path, mode)
    pio.write(path, make_cloud(1))
    assert os.stat(path).st_mode & 0o7777 == mode
    assert_close(pio.read(path).points, make_cloud(1).points, 0.0)
    link = tmp_path / "l.pcd"  # through a link: the target's mode, the link untouched
    link.symlink_to(path)
    pio.write(link, make_cloud(2))
    assert os.stat(path).st_mode & 0o7777 == mode and link.is_symlink()


def test_failed_write_through_symlink_keeps_target(tmp_path):
    target = tmp_path / "t.npy"
    pio.write(target, make_cloud(0, normals=False, colors=False))
    old = target.read_bytes()
    (tmp_path / "l.npy").symlink_to(target)
    with pytest.raises(ValueError, match="normals"):
        pio.write(tmp_path / "l.npy", make_cloud(1))
    assert target.read_bytes() == old and (tmp_path / "l.npy").is_symlink()
    assert no_temp_files(tmp_path)
