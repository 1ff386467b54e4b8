"""Fuzzed files for every reader: a valid cloud or a ValueError naming the file, fast.

The cases come from ``benchmarks/fuzz_io.py`` (the 10,000-case campaign recorded in
RELIABILITY.md); here a fixed, seeded slice of them runs in CI, plus hand-made files whose
headers claim huge counts and sizes, each checked for time and traced memory.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import struct
import time
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from pointalign import PointCloud
from pointalign import io as pio

_spec = importlib.util.spec_from_file_location(
    "fuzz_io", Path(__file__).resolve().parents[1] / "benchmarks" / "fuzz_io.py")
fuzz_io = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz_io)

CASES = int(os.environ.get("POINTALIGN_FUZZ_CASES", "24"))  # per format
READ_LIMIT_S = 10.0  # per read; reads take milliseconds, the margin is for loaded CI machines
FORMATS = [f for f in fuzz_io.FORMATS if fuzz_io.available(f)]


class _Slow(Exception):
    pass


def _timed(fn, limit: float = READ_LIMIT_S):
    """Run ``fn`` and fail if it takes longer than ``limit`` s (interrupts Python loops)."""
    def stop(signum, frame):
        raise _Slow(f"still running after {limit} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, limit)
    t0 = time.perf_counter()
    try:
        return fn(), time.perf_counter() - t0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    cache: dict[str, list[bytes]] = {}

    def get(fmt: str) -> list[bytes]:
        if fmt not in cache:
            cache[fmt] = fuzz_io.make_samples(fmt, tmp_path_factory.mktemp(fmt))
        return cache[fmt]

    return get


@pytest.mark.parametrize("fmt", FORMATS)
def test_samples_are_valid(tmp_path, samples, fmt):
    """The seeds of the mutations read back as clouds (else the fuzzing tests nothing)."""
    for i, data in enumerate(samples(fmt)):
        path = tmp_path / f"s{i}{fuzz_io.FORMATS[fmt]}"
        path.write_bytes(data)
        assert fuzz_io.classify(fmt, path)[0] == "ok"


@pytest.mark.parametrize("fmt", FORMATS)
def test_fuzzed_files(tmp_path, samples, fmt):
    path = tmp_path / f"case{fuzz_io.FORMATS[fmt]}"
    seen = set()
    for case in range(CASES):
        data, mutation = fuzz_io.make_case(fmt, samples(fmt), 0, case)
        res, dt = _timed(lambda data=data: fuzz_io.run_one(fmt, path, data, trace=False))
        assert not res["outcome"].startswith("bug"), (case, mutation, res)
        assert dt < READ_LIMIT_S
        seen.add(res["outcome"])
    assert "ValueError" in seen  # the mutations do break files


def test_classify_flags_bugs(tmp_path, monkeypatch):
    """The oracle itself: a raw exception, an unnamed ValueError or a hidden MemoryError."""
    path = tmp_path / "x.ply"
    pio.write(path, np.zeros((3, 3)))
    assert fuzz_io.classify("ply-binary", path)[0] == "ok"

    def boom(exc):
        def reader(p):
            raise exc
        return reader

    for exc, want in ((KeyError("k"), "bug:KeyError"), (ValueError("no name"), "bug:unnamed")):
        monkeypatch.setattr(fuzz_io, "read_file", lambda fmt, p, exc=exc: boom(exc)(p))
        assert fuzz_io.classify("ply-binary", path)[0] == want
    try:
        raise MemoryError
    except MemoryError as inner:
        wrapped = ValueError(f"{path.name}: wrapped")
        wrapped.__cause__ = inner
    monkeypatch.setattr(fuzz_io, "read_file", lambda fmt, p: boom(wrapped)(p))
    assert fuzz_io.classify("ply-binary", path)[0] == "bug:MemoryError"


# ----------------------------------------------------------------------------------------
# huge header claims: fail fast, allocate nothing near the claim
# ----------------------------------------------------------------------------------------

def _claims_fail_fast(path: Path, match: str) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=match) as exc:
            _timed(lambda: pio.read(path), 5.0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert path.name in str(exc.value)
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB traced for a {path.stat().st_size} B file"


def _cloud(n: int = 20) -> PointCloud:
    g = np.random.default_rng(0)
    return PointCloud(torch.from_numpy(g.normal(size=(n, 3))),
                      colors=torch.from_numpy(g.uniform(size=(n, 3))))


@pytest.mark.skipif(not fuzz_io.available("las"), reason="laspy not installed")
def test_las_claiming_2_32_vlrs_fails_fast(tmp_path):
    """Issue 16: a 16 kB LAS claiming 4,294,967,295 VLRs hung (>60 s, >1 GB)."""
    path = tmp_path / "vlrs.las"
    pio.write(path, _cloud())
    raw = bytearray(path.read_bytes())
    struct.pack_into("<I", raw, 100, 2**32 - 1)
    path.write_bytes(bytes(raw) + bytes(16000))
    _claims_fail_fast(path, "4294967295 VLRs")


@pytest.mark.skipif(not fuzz_io.available("las"), reason="laspy not installed")
@pytest.mark.parametrize("offset,fmt,value,match", [
    (107, "<I", 2**32 - 1, "truncated"),  # legacy point count
    (96, "<I", 2**32 - 1, "offset to point data"),
    (105, "<H", 3, "record length"),
    (94, "<H", 60000, "header size"),
    (24, "<B", 9, "version"),
])
def test_las_header_claims(tmp_path, offset, fmt, value, match):
    path = tmp_path / "claim.las"
    pio.write(path, _cloud())
    raw = bytearray(path.read_bytes())
    struct.pack_into(fmt, raw, offset, value)
    path.write_bytes(bytes(raw))
    _claims_fail_fast(path, match)


@pytest.mark.skipif(not fuzz_io.available("laz"), reason="no LAZ backend")
def test_laz_chunk_count_claim(tmp_path):
    """lazrs reserves the chunk table up front and aborts the process if that fails."""
    path = tmp_path / "chunks.laz"
    pio.write(path, _cloud())
    raw = bytearray(path.read_bytes())
    start = struct.unpack_from("<I", raw, 96)[0]
    table = struct.unpack_from("<q", raw, start)[0]
    struct.pack_into("<I", raw, table + 4, 2**31)
    path.write_bytes(bytes(raw))
    _claims_fail_fast(path, "chunk table")


def test_ply_huge_counts(tmp_path):
    path = tmp_path / "big.ply"
    pio.write(path, _cloud())
    raw = path.read_bytes().replace(b"element vertex 20", b"element vertex 4294967295")
    path.write_bytes(raw)
    _claims_fail_fast(path, "truncated")
    lists = (b"ply\nformat binary_little_endian 1.0\nelement face 1\n"
             b"property list uint int vertex_indices\nelement vertex 1\nproperty float x\n"
             b"property float y\nproperty float z\nend_header\n"
             + struct.pack("<I", 2**32 - 1) + bytes(40))
    path.write_bytes(lists)  # a list claiming 2**32 - 1 entries: no 16 GB read buffer
    _claims_fail_fast(path, "big.ply")


@pytest.mark.parametrize("binary", [True, False])
def test_pcd_huge_counts(tmp_path, binary):
    path = tmp_path / "big.pcd"
    pio.write(path, _cloud(), binary=binary)
    raw = path.read_bytes()
    for old, new in ((b"POINTS 20", b"POINTS 4294967295"), (b"COUNT 1 1 1", b"COUNT 1 1 999999999"),
                     (b"WIDTH 20", b"WIDTH -5")):
        path.write_bytes(raw.replace(old, new))
        _claims_fail_fast(path, "big.pcd")


def test_npy_mutated_headers(tmp_path):
    """Issue 16: mutated .npy headers raised TokenError from inside np.load."""
    path = tmp_path / "m.npy"
    np.save(path, np.zeros((50, 3)))
    raw = path.read_bytes()
    for old, new in ((b"(50, 3)", b"(99999999999999, 3)"), (b"'shape'", b"'shape\""),
                     (b"(50, 3)", b"(50, 3 "), (b"<f8", b"|O8"), (b"False", b"Fals("),
                     (b"{", b"(" * 60), (b"(50, 3)", b"(5 0, 3)")):
        path.write_bytes(raw.replace(old, new, 1))
        _claims_fail_fast(path, "m.npy")
    path.write_bytes(raw[:8] + b"\xff\xff" + raw[10:])  # header length beyond the file
    _claims_fail_fast(path, "truncated")
    path.write_bytes(raw[:6] + b"\x09\x00" + raw[8:])  # unknown version
    _claims_fail_fast(path, "version")


def test_npz_corrupt_members(tmp_path):
    """Issue 16: zlib.error and OSError without the file name from inside np.load."""
    path = tmp_path / "z.npz"
    np.savez_compressed(path, points=np.random.default_rng(0).normal(size=(200, 3)))
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("points.npy")
    data_at = info.header_offset + 30 + len(info.filename) + len(info.extra)
    bad = bytearray(raw)
    bad[data_at + 5:data_at + 25] = b"\xff" * 20  # corrupt deflate stream
    path.write_bytes(bytes(bad))
    _claims_fail_fast(path, "points.npy")
    path.write_bytes(raw[: len(raw) - 30])  # truncated central directory
    _claims_fail_fast(path, "z.npz")
    path.write_bytes(raw[: len(raw) // 2])
    _claims_fail_fast(path, "z.npz")
    # a member claiming 4 GB uncompressed from a few hundred bytes (zip bomb size field)
    cd = raw.rfind(b"PK\x01\x02")
    bomb = bytearray(raw)
    struct.pack_into("<I", bomb, cd + 24, 2**32 - 2)
    path.write_bytes(bytes(bomb))
    _claims_fail_fast(path, "claims")


def test_npy_fortran_and_big_endian_read_correctly(tmp_path):
    a = np.random.default_rng(1).normal(size=(7, 3))
    np.save(tmp_path / "f.npy", np.asfortranarray(a))
    np.save(tmp_path / "b.npy", a.astype(">f4"))
    np.testing.assert_array_equal(pio.read(tmp_path / "f.npy").points.numpy(), a)
    np.testing.assert_array_equal(pio.read(tmp_path / "b.npy").points.numpy(),
                                  a.astype(np.float32))
    np.savez(tmp_path / "s.npz", points=a, normals=a / np.linalg.norm(a, axis=1)[:, None])
    back = pio.read(tmp_path / "s.npz")  # stored (not deflated) members
    np.testing.assert_array_equal(back.points.numpy(), a)


def test_kitti_bin_fuzz_sizes(tmp_path):
    path = tmp_path / "k.bin"
    a = np.random.default_rng(2).normal(size=(10, 4)).astype("<f4")
    for cut in (1, 15, 17, 159):
        path.write_bytes(a.tobytes()[:cut])
        with pytest.raises(ValueError, match="k.bin.*multiple of 16"):
            pio.read_bin(path, columns=4)
    nan = a.copy()
    nan[:, :3] = np.nan
    path.write_bytes(nan.tobytes())
    with pytest.raises(ValueError, match="k.bin.*finite"):
        pio.read_bin(path, columns=4)


@pytest.mark.skipif(not fuzz_io.available("laz"), reason="no LAZ backend")
def test_laz_layer_sizes_and_chunk_size_claims(tmp_path):
    """Corrupt sizes that made lazrs hang, reserve 4 GB per layer or abort the process."""
    import laspy

    las = laspy.LasData(laspy.LasHeader(point_format=6, version="1.4"))
    las.x, las.y, las.z = np.random.default_rng(0).normal(size=(3, 12)) * 100
    path = tmp_path / "layers.laz"
    las.write(str(path), do_compress=True)
    assert len(pio.read(path)) == 12
    raw = path.read_bytes()
    offset = struct.unpack_from("<I", raw, 96)[0]
    bad = bytearray(raw)
    struct.pack_into("<I", bad, offset + 8 + 30 + 4, 2**32 - 1)  # first layer's byte count
    path.write_bytes(bytes(bad))
    _claims_fail_fast(path, "layers .* claim")
    # the laszip VLR's chunk size (first VLR after the 375-byte 1.4 header)
    bad = bytearray(raw)
    struct.pack_into("<I", bad, 375 + 54 + 12, 956351312)
    path.write_bytes(bytes(bad))
    _claims_fail_fast(path, "chunk size")
    bad = bytearray(raw)  # the point item's type 10 (point14) made 11 (rgb14): lazrs hung
    struct.pack_into("<H", bad, 375 + 54 + 34, 11)
    path.write_bytes(bytes(bad))
    _claims_fail_fast(path, "item of type 11")
