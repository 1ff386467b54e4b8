"""Fuzz campaign for the file readers of ``pointalign.io``.

Every case is a valid sample file of one format, mutated by a seeded generator (byte flips,
bit flips, truncation, header numbers replaced by extreme values, binary header fields
overwritten with extreme integers, spliced/duplicated/deleted chunks, combinations). Each
read must return a valid cloud (finite points, N > 0) or raise ``ValueError``/``TypeError``
naming the file, within a time bound and with bounded memory. Anything else is a bug:
another exception type, an error message without the file name, a ``ValueError`` caused
by ``MemoryError``/``RecursionError``, or a read still running after ``--hang-s``.

    nice -n 10 python benchmarks/fuzz_io.py --cases 10000 --format ply-binary

writes ``benchmarks/results/fuzz_io/<format>.json`` (outcomes, per-mutation counts, max and
p99 time per read, max traced peak memory per read, bugs with their mutation) and, with
``--save-bugs DIR``, the inputs that failed. Reads run in a child process: a read that hangs
is killed after ``--hang-s`` seconds and recorded. ``tests/test_io_fuzz.py`` runs a few
hundred of the same cases in CI (without the child process and memory tracing).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from pointalign import PointCloud  # noqa: E402
from pointalign import io as pio  # noqa: E402

# format name -> suffix, writer binary flag (None: samples made by hand)
FORMATS: dict[str, str] = {
    "ply-ascii": ".ply", "ply-binary": ".ply", "pcd-ascii": ".pcd", "pcd-binary": ".pcd",
    "pcd-compressed": ".pcd", "xyz": ".xyz", "txt": ".txt", "csv": ".csv", "pts": ".pts",
    "npy": ".npy", "npz": ".npz", "las": ".las", "laz": ".laz", "bin": ".bin",
}
EXTREMES = (0, 1, 2, 3, 7, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
            2**53, 2**63 - 1, 2**64 - 1)
TEXT_EXTREMES = ("0", "-1", "1", "2147483647", "2147483648", "4294967295", "4294967296",
                 "9223372036854775807", "18446744073709551616", "1e30", "99999999999999999999",
                 "nan", "-2147483648", "3.5", "")
BUG_EXCEPTIONS = (MemoryError, RecursionError)


def available(fmt: str) -> bool:
    """Whether the format's optional dependency is installed."""
    if fmt not in ("las", "laz"):
        return True
    try:
        import laspy
    except ImportError:
        return False
    return fmt == "las" or bool(laspy.LazBackend.detect_available())


# --------------------------------------------------------------------------------------
# sample files (valid, small: a few dozen points)
# --------------------------------------------------------------------------------------

def _cloud(seed: int, n: int, *, normals: bool, colors: bool, extras: bool,
           dtype: torch.dtype = torch.float32) -> PointCloud:
    g = np.random.default_rng(seed)
    pts = g.normal(size=(n, 3)) * 5 + 100
    nrm = g.normal(size=(n, 3))
    nrm /= np.linalg.norm(nrm, axis=1, keepdims=True)
    ext = {}
    if extras:
        ext = {"intensity": torch.from_numpy(g.integers(0, 4000, n).astype(np.int32)),
               "confidence": torch.from_numpy(g.uniform(size=n).astype(np.float32))}
    return PointCloud(torch.from_numpy(pts).to(dtype),
                      torch.from_numpy(nrm).to(dtype) if normals else None,
                      torch.from_numpy(g.uniform(size=(n, 3))).to(dtype) if colors else None,
                      None, ext)


def make_samples(fmt: str, folder: Path) -> list[bytes]:
    """Valid files of ``fmt`` (bytes), the seeds of the mutations."""
    suffix = FORMATS[fmt]
    out: list[bytes] = []

    def put(cloud: PointCloud, binary: bool = True) -> None:
        p = folder / f"sample{suffix}"
        pio.write(p, cloud, binary=binary)
        out.append(p.read_bytes())

    if fmt.startswith("ply"):
        import plyfile

        binary = fmt == "ply-binary"
        put(_cloud(1, 24, normals=True, colors=True, extras=True), binary)
        put(_cloud(2, 9, normals=False, colors=False, extras=False, dtype=torch.float64),
            binary)
        v = np.zeros(12, dtype=[("x", "f4"), ("y", "f4"), ("z", "f4")])
        v["x"] = np.arange(12)
        faces = np.empty(3, dtype=[("vertex_indices", "O")])
        faces["vertex_indices"] = [np.array([0, 1, 2], "i4")] * 3
        cam = np.array([(1.0, 2.0)], dtype=[("px", "f4"), ("py", "f4")])
        p = folder / "mesh.ply"
        plyfile.PlyData([plyfile.PlyElement.describe(faces, "face"),
                         plyfile.PlyElement.describe(cam, "camera"),
                         plyfile.PlyElement.describe(v, "vertex")],
                        text=not binary, byte_order=">").write(str(p))
        out.append(p.read_bytes())
    elif fmt.startswith("pcd"):
        from pypcd4 import PointCloud as PcdCloud
        from pypcd4.pypcd4 import Encoding

        if fmt == "pcd-compressed":
            g = np.random.default_rng(3)
            xyz = g.normal(size=(30, 3)).astype(np.float32)
            rgb = PcdCloud.encode_rgb(g.integers(0, 256, size=(30, 3)))
            pc = PcdCloud.from_points([*xyz.T, rgb, xyz[:, 0] * 2],
                                      ("x", "y", "z", "rgb", "intensity"), (np.float32,) * 5)
            for n in (30, 1):
                p = folder / "c.pcd"
                (pc if n == 30 else PcdCloud.from_xyz_points(xyz[:1])).save(
                    p, encoding=Encoding.BINARY_COMPRESSED)
                out.append(p.read_bytes())
        else:
            binary = fmt == "pcd-binary"
            put(_cloud(4, 20, normals=True, colors=True, extras=True), binary)
            put(_cloud(5, 7, normals=False, colors=False, extras=False,
                       dtype=torch.float64), binary)
    elif fmt in ("xyz", "txt", "csv"):
        put(_cloud(6, 20, normals=True, colors=False, extras=False))
        put(_cloud(7, 15, normals=False, colors=True, extras=False, dtype=torch.float64))
        head = "x,y,z\n" if fmt == "csv" else "# x y z\n"
        sep = "," if fmt == "csv" else " "
        rows = "\n".join(sep.join(f"{v:.6g}" for v in r)
                         for r in np.random.default_rng(8).normal(size=(10, 3)))
        out.append((head + rows + "\n").encode())
    elif fmt == "pts":
        put(_cloud(9, 18, normals=False, colors=True, extras=False))
        put(_cloud(10, 6, normals=False, colors=False, extras=False))
    elif fmt == "npy":
        put(_cloud(11, 30, normals=False, colors=False, extras=False))
        put(_cloud(12, 5, normals=False, colors=False, extras=False, dtype=torch.float64))
        p = folder / "fortran.npy"
        np.save(p, np.asfortranarray(np.random.default_rng(13).normal(size=(8, 6))))
        out.append(p.read_bytes())
    elif fmt == "npz":
        put(_cloud(14, 20, normals=True, colors=True, extras=True))
        p = folder / "plain.npz"
        np.savez(p, points=np.random.default_rng(15).normal(size=(6, 3)))  # stored, not deflated
        out.append(p.read_bytes())
    elif fmt in ("las", "laz"):
        put(_cloud(16, 25, normals=True, colors=True, extras=True, dtype=torch.float64))
        put(_cloud(17, 8, normals=False, colors=False, extras=False, dtype=torch.float64))
        import laspy

        h = laspy.LasHeader(point_format=6, version="1.4")  # 1.4 header, 64-bit counts
        las = laspy.LasData(h)
        g = np.random.default_rng(18)
        las.x, las.y, las.z = (g.normal(size=(3, 12)) * 100 + 1000)
        las.intensity = g.integers(0, 60000, 12)
        p = folder / f"v14{suffix}"
        las.write(str(p), do_compress=fmt == "laz")
        out.append(p.read_bytes())
    elif fmt == "bin":
        g = np.random.default_rng(19)
        out.append(g.normal(size=(40, 4)).astype("<f4").tobytes())
        out.append(g.normal(size=(3, 4)).astype("<f4").tobytes())
    return out


# --------------------------------------------------------------------------------------
# mutations
# --------------------------------------------------------------------------------------

def _header_end(raw: bytes, fmt: str) -> int:
    """Bytes at the start that hold the header (where counts and sizes live)."""
    for marker in (b"end_header\n", b"end_header\r\n"):
        i = raw.find(marker)
        if i >= 0:
            return i + len(marker)
    if fmt.startswith("pcd"):
        i = raw.find(b"DATA")
        return raw.find(b"\n", i) + 1 if i >= 0 else min(len(raw), 300)
    if fmt == "npy":
        return min(len(raw), 128)
    if fmt in ("las", "laz"):
        return min(len(raw), 375 + 54 + 192 * 4)  # header, first VLR, extra-bytes records
    return min(len(raw), 200)


def _flip(g: np.random.Generator, b: bytearray, fmt: str) -> str:
    k = int(g.integers(1, 9))
    for _ in range(k):
        b[int(g.integers(len(b)))] = int(g.integers(256))
    return f"flip{k}"


def _bitflip(g: np.random.Generator, b: bytearray, fmt: str) -> str:
    k = int(g.integers(1, 5))
    for _ in range(k):
        i = int(g.integers(len(b)))
        b[i] ^= 1 << int(g.integers(8))
    return f"bitflip{k}"


def _truncate(g: np.random.Generator, b: bytearray, fmt: str) -> str:
    n = int(g.integers(0, len(b)))
    del b[n:]
    return "truncate"


def _text_number(g: np.random.Generator, b: bytearray, fmt: str) -> str:
    """Replace a number in the header (or the first lines of a text file) by an extreme."""
    import re

    end = _header_end(bytes(b), fmt)
    nums = [m for m in re.finditer(rb"-?\d+(?:\.\d+)?", bytes(b[:end]))]
    if not nums:
        return _binary_field(g, b, fmt)
    m = nums[int(g.integers(len(nums)))]
    new = TEXT_EXTREMES[int(g.integers(len(TEXT_EXTREMES)))].encode()
    b[m.start():m.end()] = new
    return "header-number"


def _binary_field(g: np.random.Generator, b: bytearray, fmt: str) -> str:
    """Overwrite an aligned 1/2/4/8-byte field in the header with an extreme integer."""
    width = int(g.choice([1, 2, 4, 8]))
    if fmt == "npz" and g.random() < 0.6:  # zip: local header at 0 or the central directory
        lo = max(0, len(b) - 120) if g.random() < 0.6 else 0
        hi = len(b) if lo else min(len(b), 40)
    else:
        lo, hi = 0, _header_end(bytes(b), fmt)
    if hi - lo <= width:
        return _flip(g, b, fmt)
    pos = int(g.integers(lo, hi - width))
    val = EXTREMES[int(g.integers(len(EXTREMES)))] % (1 << (8 * width))
    b[pos:pos + width] = val.to_bytes(width, "little")
    return f"header-u{8 * width}"


def _splice(g: np.random.Generator, b: bytearray, fmt: str) -> str:
    i = int(g.integers(len(b)))
    n = int(g.integers(1, max(2, len(b) // 4)))
    kind = int(g.integers(3))
    if kind == 0:
        del b[i:i + n]
        return "delete"
    if kind == 1:
        b[i:i] = b[i:i + n]
        return "duplicate"
    b[i:i] = g.bytes(n)
    return "insert"


MUTATORS: tuple[Callable[[np.random.Generator, bytearray, str], str], ...] = (
    _flip, _bitflip, _truncate, _text_number, _binary_field, _splice)


def make_case(fmt: str, samples: list[bytes], seed: int, case: int) -> tuple[bytes, str]:
    """The mutated bytes of case ``case`` and a name of what was done (deterministic)."""
    g = np.random.default_rng([seed, list(FORMATS).index(fmt), case])
    b = bytearray(samples[int(g.integers(len(samples)))])
    steps = 1 if g.random() < 0.7 else int(g.integers(2, 4))
    names = []
    for _ in range(steps):
        if not b:
            break
        names.append(MUTATORS[int(g.integers(len(MUTATORS)))](g, b, fmt))
    return bytes(b), "+".join(names) or "none"


# --------------------------------------------------------------------------------------
# one read, classified
# --------------------------------------------------------------------------------------

def read_file(fmt: str, path: Path) -> PointCloud:
    """Read ``path`` the way a user would for this format."""
    if fmt == "bin":
        return pio.read_bin(path, columns=4)
    return pio.read(path)


def classify(fmt: str, path: Path) -> tuple[str, str]:
    """Read and return (outcome, detail); outcome is "ok", "ValueError" or "bug:..."."""
    try:
        c = read_file(fmt, path)
    except (ValueError, TypeError) as exc:
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, BUG_EXCEPTIONS):
                return f"bug:{type(cause).__name__}", str(exc)[:300]
            cause = cause.__cause__ or cause.__context__
        if path.name not in str(exc):
            return "bug:unnamed", f"{type(exc).__name__}: {str(exc)[:300]}"
        return type(exc).__name__, str(exc)[:300]
    except BaseException as exc:  # noqa: BLE001 - every other exception is a finding
        if isinstance(exc, KeyboardInterrupt):
            raise
        return f"bug:{type(exc).__name__}", str(exc)[:300]
    if not isinstance(c, PointCloud) or len(c) == 0 or not bool(torch.isfinite(c.points).all()):
        return "bug:invalid-cloud", repr(c)[:300]
    return "ok", f"{len(c)} points"


def run_one(fmt: str, path: Path, data: bytes, *, trace: bool) -> dict[str, Any]:
    path.write_bytes(data)
    if trace:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    outcome, detail = classify(fmt, path)
    dt = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] - base if trace else 0
    return {"outcome": outcome, "detail": detail, "time_s": dt, "peak_bytes": peak,
            "size": len(data)}


# --------------------------------------------------------------------------------------
# the campaign: a child process reads, the parent watches for hangs
# --------------------------------------------------------------------------------------

def _worker(conn: Any, fmt: str, seed: int, folder: str, mem_limit: int) -> None:
    if mem_limit:
        resource.setrlimit(resource.RLIMIT_AS, (mem_limit, mem_limit))
    samples = make_samples(fmt, Path(folder))
    path = Path(folder) / f"case{FORMATS[fmt]}"
    # warm up (valid files and other mutations): imports and first-call costs on the
    # reading and the error paths are not part of a read's time and memory
    for s in samples:
        run_one(fmt, path, s, trace=False)
    for case in range(30):
        run_one(fmt, path, make_case(fmt, samples, seed + 10**6, case)[0], trace=False)
    tracemalloc.start()
    while True:
        case = conn.recv()
        if case is None:
            break
        data, mutation = make_case(fmt, samples, seed, case)
        res = run_one(fmt, path, data, trace=True)
        res.update(case=case, mutation=mutation)
        conn.send(res)


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def _reader_versions() -> dict[str, str]:
    from importlib import metadata as md

    out = {}
    for dist in ("plyfile", "pypcd4", "python-lzf", "laspy", "lazrs", "numpy"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "absent"
    return out


def campaign(fmt: str, cases: int, seed: int, hang_s: float, save_bugs: Path | None,
             mem_limit_gb: float) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    folder = tempfile.mkdtemp(prefix=f"fuzz_{fmt}_")
    mem_limit = int(_vm_size() + mem_limit_gb * 2**30) if mem_limit_gb > 0 else 0
    results: list[dict[str, Any]] = []
    proc = conn = None

    def start() -> None:
        nonlocal proc, conn
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, fmt, seed, folder, mem_limit),
                           daemon=True)
        proc.start()

    os.environ["RUST_BACKTRACE"] = "0"  # a decoder that aborts: one line, not 60
    start()
    t_start = time.perf_counter()
    for case in range(cases):
        conn.send(case)
        t_case = time.perf_counter()
        if conn.poll(hang_s + (60 if case == 0 else 0)):  # first case: sample making
            try:
                results.append(conn.recv())
                continue
            except EOFError:
                outcome = "bug:crash"
        else:
            outcome = "bug:hang"
        proc.kill()
        proc.join()
        samples = make_samples(fmt, Path(tempfile.mkdtemp(prefix="fuzz_s_")))
        data, mutation = make_case(fmt, samples, seed, case)
        results.append({"outcome": outcome, "detail": f"exit {proc.exitcode}",
                        "time_s": time.perf_counter() - t_case, "peak_bytes": 0,
                        "size": len(data), "case": case, "mutation": mutation})
        start()
    conn.send(None)
    proc.join(10)
    wall = time.perf_counter() - t_start
    maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024

    outcomes = Counter(r["outcome"] for r in results)
    by_mut: dict[str, Counter] = {}
    for r in results:
        key = r["mutation"].split("+")[0] if "+" not in r["mutation"] else "combined"
        by_mut.setdefault(key, Counter())[r["outcome"]] += 1
    times = np.array([r["time_s"] for r in results])
    peaks = np.array([r["peak_bytes"] for r in results])
    sizes = np.array([r["size"] for r in results])
    bugs = [r for r in results if r["outcome"].startswith("bug")]
    if save_bugs is not None and bugs:
        save_bugs.mkdir(parents=True, exist_ok=True)
        samples = make_samples(fmt, Path(tempfile.mkdtemp(prefix="fuzz_s_")))
        for r in bugs[:200]:
            data, _ = make_case(fmt, samples, seed, r["case"])
            (save_bugs / f"{fmt}-case{r['case']}{FORMATS[fmt]}").write_bytes(data)
    slowest = max(results, key=lambda r: r["time_s"])
    hungriest = max(results, key=lambda r: r["peak_bytes"])
    try:
        from common import metadata

        meta = metadata("cpu")
    except Exception:  # noqa: BLE001 - metadata is optional
        meta = {}
    meta["readers"] = _reader_versions()
    return {
        "topic": "fuzz_io", "format": fmt, "suffix": FORMATS[fmt], "cases": len(results),
        "seed": seed, "hang_limit_s": hang_s, "wall_s": wall,
        "outcomes": dict(outcomes),
        "bugs": len(bugs),
        "by_mutation": {k: dict(v) for k, v in sorted(by_mut.items())},
        "time_per_read_s": {"max": float(times.max()), "p99": float(np.quantile(times, 0.99)),
                            "median": float(np.median(times))},
        "slowest": {k: slowest[k] for k in ("case", "mutation", "outcome", "size", "time_s")},
        "peak_traced_bytes_per_read": {"max": int(peaks.max()),
                                       "median": int(np.median(peaks))},
        "hungriest": {k: hungriest[k] for k in ("case", "mutation", "outcome", "size",
                                                "peak_bytes")},
        "file_bytes": {"min": int(sizes.min()), "max": int(sizes.max())},
        "child_max_rss_bytes": int(maxrss),
        "bug_examples": [{k: r[k] for k in ("case", "mutation", "outcome", "detail")}
                         for r in bugs[:50]],
        "value_error_examples": sorted({r["detail"][:120] for r in results
                                        if r["outcome"] == "ValueError"})[:25],
        "meta": meta,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "load_avg_at_end": os.getloadavg(),
    }


def table(folder: Path) -> str:
    """Markdown table of the campaign results in ``folder`` (one JSON per format)."""
    rows = ["| format | cases | ok | ValueError | other (bugs) | max time / read | p99 time | "
            "max traced memory / read | largest file | child max RSS |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for fmt in FORMATS:
        p = folder / f"{fmt}.json"
        if not p.is_file():
            continue
        d = json.loads(p.read_text())
        o = d["outcomes"]
        rows.append(
            f"| {fmt} (`{d['suffix']}`) | {d['cases']} | {o.get('ok', 0)} | "
            f"{o.get('ValueError', 0) + o.get('TypeError', 0)} | {d['bugs']} | "
            f"{d['time_per_read_s']['max'] * 1e3:.0f} ms | "
            f"{d['time_per_read_s']['p99'] * 1e3:.1f} ms | "
            f"{d['peak_traced_bytes_per_read']['max'] / 1024:.0f} KiB | "
            f"{d['file_bytes']['max'] / 1024:.1f} kB | "
            f"{d['child_max_rss_bytes'] / 2**20:.0f} MiB |")
    fam: dict[str, Counter] = {}
    for p in sorted(folder.glob("*.json")):
        for k, v in json.loads(p.read_text())["by_mutation"].items():
            k = k.rstrip("0123456789")
            fam.setdefault("header-int" if k == "header-u" else k, Counter()).update(v)
    rows += ["", "| mutation (all formats) | cases | ok | ValueError | bugs |",
             "|---|---:|---:|---:|---:|"]
    for k, c in sorted(fam.items()):
        bugs = sum(v for o, v in c.items() if o.startswith("bug"))
        rows.append(f"| {k} | {sum(c.values())} | {c.get('ok', 0)} | "
                    f"{c.get('ValueError', 0) + c.get('TypeError', 0)} | {bugs} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", choices=[*FORMATS, "all"])
    ap.add_argument("--table", action="store_true", help="print the Markdown table of the "
                    "results in --out and exit")
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hang-s", type=float, default=20.0, help="a read longer than this is "
                    "killed and recorded as a hang")
    ap.add_argument("--mem-limit-gb", type=float, default=4.0, help="address space the child "
                    "may add (0: unlimited); an allocation beyond it is a MemoryError bug")
    ap.add_argument("--save-bugs", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "fuzz_io")
    args = ap.parse_args()
    if args.table:
        print(table(args.out))
        return
    if args.format is None:
        ap.error("--format is required")
    fmts = list(FORMATS) if args.format == "all" else [args.format]
    args.out.mkdir(parents=True, exist_ok=True)
    for fmt in fmts:
        if not available(fmt):
            print(f"{fmt}: skipped (optional dependency missing)")
            continue
        res = campaign(fmt, args.cases, args.seed, args.hang_s, args.save_bugs,
                       args.mem_limit_gb)
        (args.out / f"{fmt}.json").write_text(json.dumps(res, indent=1) + "\n")
        print(f"{fmt}: {res['cases']} cases {res['outcomes']} max "
              f"{res['time_per_read_s']['max']:.3f} s, peak "
              f"{res['peak_traced_bytes_per_read']['max'] / 2**20:.1f} MiB, "
              f"wall {res['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
