"""A/B timing of two checkouts on the rows a refactor must not slow down (issue #12).

Each row is one public call on fixed inputs, timed by the contract of ``common.timeit``
(median of 7 after 2 warm-ups, CUDA events on a GPU), plus the cold first call of the
process (``first_ms``: compilation, allocator, graph capture included). The script times
whatever ``pointalign`` is importable, so the same file runs against the old and the new
code in one device session::

    PYTHONPATH=.base/src python benchmarks/bench_ab.py --label before --out $OUT/before.json
    PYTHONPATH=src       python benchmarks/bench_ab.py --label after  --out $OUT/after.json
    python benchmarks/bench_ab.py --compare $OUT/before*.json $OUT/after*.json

``--compare`` pools the runs of each label (median of the per-run medians) and writes
``results/refactor_ab-<device>.json`` with after/before ratios for ``render.py``.

Rows (inputs as in the benchmark named in brackets):

* register bunny ~5k / KITTI [bench_ransac pipeline]: ``register(seed=0)`` from the identity;
  the "(tranche-1 stages)" rows switch off the stages issue #13 added (outlier removal, the
  compatibility-graph proposer, several refined hypotheses), a like-for-like comparison;
* ICP bunny 40k, Open3D's rule; ICP 1M point-to-point, small_gicp's rule [bench_icp];
* EM-ICP 5k and 40k, Softassign 5k [bench_soft];
* Newton plane 1M with a prebuilt tree [bench_surface]; exact 1-NN kNN 1M uniform [bench_knn].
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_icp import upsample as _upsample  # noqa: E402
from bench_soft import subsample_pair  # noqa: E402
from common import RESULTS, metadata, sync, timeit  # noqa: E402

import pointalign as pa  # noqa: E402
from pointalign import datasets, transforms  # noqa: E402
from pointalign.features.downsample import (
    auto_voxel_size,  # noqa: E402
    voxel_downsample,  # noqa: E402
)
from pointalign.registration.criteria import ConvergenceCriteria  # noqa: E402
from pointalign.registration.pipeline import register  # noqa: E402


def rows(dev: torch.device):
    """(name, call) for every row; inputs are built (and moved to dev) once."""
    pair = datasets.load_bunny_pair()
    data = datasets.shared_data_dir()
    v5k = auto_voxel_size(pair.target, 5000)
    s5, t5 = voxel_downsample(pair.source, v5k).to(dev), voxel_downsample(pair.target, v5k).to(dev)
    yield "register bunny ~5k", lambda: register(s5, t5, seed=0)
    import inspect

    if "robust" in inspect.signature(register).parameters:  # the tranche-1 front end alone
        yield "register bunny ~5k (tranche-1 stages)", lambda: register(
            s5, t5, seed=0, robust=False, remove_outliers=False)
    else:
        yield "register bunny ~5k (tranche-1 stages)", lambda: register(s5, t5, seed=0)
    kdir = None if data is None else data / "lidar" / "kitti_00"
    if kdir is not None and (kdir / "000000_xyz.bin").is_file():
        def kb(i):
            return torch.from_numpy(np.fromfile(kdir / f"00000{i}_xyz.bin", dtype=np.float32)
                                    .reshape(-1, 3).copy()).to(dev)
        ks, kt = kb(1), kb(0)
        yield "register KITTI", lambda: register(ks, kt, seed=0)
        if "robust" in inspect.signature(register).parameters:
            yield "register KITTI (tranche-1 stages)", lambda: register(
                ks, kt, seed=0, robust=False, remove_outliers=False)
        else:
            yield "register KITTI (tranche-1 stages)", lambda: register(ks, kt, seed=0)
    s, t = pair.source.to(dev), pair.target.to(dev)
    rel = ConvergenceCriteria(max_iterations=100)
    yield "ICP bunny 40k (Open3D's rule)", lambda: pa.icp(
        s, t, max_correspondence_distance=0.05, criteria=rel, device=dev)
    big = datasets.make_pair(_upsample(pair.target, 1_000_000, 5e-4, 1_000_000), 10.0, 0.02,
                             noise=5e-4, seed=0)
    bs, bt = big.source.to(dev), big.target.to(dev)
    upd = ConvergenceCriteria(max_iterations=100, relative_fitness=0, relative_rmse=0,
                              translation_tolerance=1e-3, rotation_tolerance=float(np.radians(0.1)))
    yield "ICP 1M point-to-point (small_gicp's rule)", lambda: pa.icp(
        bs, bt, max_correspondence_distance=0.05, criteria=upd, device=dev)
    for n in (5000, 40000):
        x, y = (c.to(dev) for c in subsample_pair(n)[:2])
        yield f"EM-ICP {n // 1000}k", lambda x=x, y=y: pa.emicp(x, y, device=dev)
    x, y = (c.to(dev) for c in subsample_pair(5000)[:2])
    yield "Softassign 5k", lambda: pa.softassign(x, y, device=dev)
    base = datasets.load_bunny("bun000")
    tgt = _upsample(base, 1_000_000, 3e-4, 0)
    g = torch.Generator().manual_seed(0)
    T = transforms.random_transform(10.0, 0.01, generator=g)
    src = transforms.apply(transforms.invert(T).float(), _upsample(base, 1_000_000, 3e-4, 1))
    from pointalign.registration.surface import surface_newton
    from pointalign.search.kdtree import KDTreeIndex
    src_d, tree = src.to(dev), KDTreeIndex(tgt.to(dev), leaf_size=8)
    surface_newton(src_d, index=tree, approximant="plane")  # builds the approximants once
    yield "Newton plane 1M (tree prebuilt)", lambda: surface_newton(src_d, index=tree,
                                                                     approximant="plane")
    g = torch.Generator().manual_seed(0)
    p = torch.rand(1_000_000, 3, generator=g).to(dev)
    q = torch.rand(1_000_000, 3, generator=g).to(dev)
    ix = pa.build_index(p, "grid" if dev.type == "cuda" else "ckdtree")
    yield "kNN 1M uniform, k=1 (grid query)", lambda: ix.knn(q, 1)


def run(args) -> None:
    dev = torch.device(args.device)
    if args.without_check:  # the refactor's own cost: the final pose's measured stability off
        from pointalign.registration import _edge

        if hasattr(_edge, "measured_stability"):
            _edge.measured_stability = lambda pair, T, **kw: np.ones(len(T))
    out = {"label": args.label, "meta": metadata(dev), "rows": {}}
    for name, fn in rows(dev):
        if args.only and not any(o.lower() in name.lower() for o in args.only):
            continue
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        first = time.perf_counter() - t0
        tm = timeit(fn, warmup=1, repeat=args.repeat, device=dev)
        out["rows"][name] = {"median_ms": 1e3 * tm["median_s"], "iqr_ms": 1e3 * tm["iqr_s"],
                             "first_ms": 1e3 * first}
        print(f"{args.label:>7} {name:<44} {1e3 * tm['median_s']:9.2f} ms "
              f"(iqr {1e3 * tm['iqr_s']:.2f}, first {1e3 * first:.0f})", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


def compare(paths: list[str], topic: str = "refactor_ab", base: str = ".base = 356792a",
            title: str = "", notes: str = "") -> None:
    runs = [r for r in (json.loads(Path(p).read_text()) for p in paths) if "rows" in r]
    colds = [json.loads(Path(p).read_text()) for p in paths]
    colds = [c for c in colds if "cold" in c]
    plain = [r for r in runs if r["label"] != "after-without-check"]
    without = [r for r in runs if r["label"] == "after-without-check"]
    runs = plain
    labels = sorted({r["label"] for r in runs})
    assert labels == ["after", "before"], labels
    by = {lab: [r for r in runs if r["label"] == lab] for lab in labels}
    names = [n for n in by["before"][0]["rows"] if all(n in r["rows"] for r in runs)]
    table = []
    for n in names:
        b = statistics.median(r["rows"][n]["median_ms"] for r in by["before"])
        a = statistics.median(r["rows"][n]["median_ms"] for r in by["after"])
        fb = statistics.median(r["rows"][n]["first_ms"] for r in by["before"])
        fa = statistics.median(r["rows"][n]["first_ms"] for r in by["after"])
        table.append({"row": n, "before_ms": round(b, 3), "after_ms": round(a, 3),
                      "ratio": round(a / b, 3), "first_before_ms": round(fb, 1),
                      "first_after_ms": round(fa, 1),
                      "runs": [len(by["before"]), len(by["after"])]})
        if without and n in without[0]["rows"]:
            w = statistics.median(r["rows"][n]["median_ms"] for r in without)
            table[-1]["after_without_check_ms"] = round(w, 3)
            table[-1]["ratio_without_check"] = round(w / b, 3)
        print(f"{n:<44} {b:9.2f} -> {a:9.2f} ms  x{a / b:.3f}")
    cold_rows = {}
    for c in colds:
        for n, r in c["cold"].items():
            cold_rows.setdefault(n, {})[c["label"]] = round(r["first_ms"], 1)
    meta = dict(by["after"][0]["meta"])
    meta["command"] = f"benchmarks/bench_ab.py (before: {base}; after: this commit)"
    dev = "cuda" if "cuda" in str(meta.get("device", "")).lower() or "NVIDIA" in str(meta) \
        else "cpu"
    dest = RESULTS / f"{topic}-{dev}.json"
    dest.write_text(json.dumps({"meta": meta, "topic": topic,
                                "title": title or f"Before and after ({base})",
                                "notes": notes, "rows": table,
                                "cold": [{"row": n, **v} for n, v in cold_rows.items()]},
                               indent=1))
    print("wrote", dest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--label", default="after")
    ap.add_argument("--out", default="ab.json")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--compare", nargs="*")
    ap.add_argument("--without-check", action="store_true",
                    help="switch off the final pose's measured stability (issue 26's check of "
                         "EM-ICP, Softassign and the surface methods): the refactor's own cost")
    ap.add_argument("--topic", default="refactor_ab", help="--compare writes results/TOPIC-*.json")
    ap.add_argument("--title", default="", help="--compare: the section's title")
    ap.add_argument("--notes", default="", help="--compare: the section's notes")
    ap.add_argument("--base", default=".base = 356792a", help="--compare: what 'before' was")
    ap.add_argument("--cold", action="store_true",
                    help="each --only row in a fresh process with an empty Triton cache: "
                         "first_ms is what a user meets on a new machine")
    args = ap.parse_args()
    if args.compare:
        compare(args.compare, args.topic, args.base, args.title, args.notes)
    elif args.cold:
        cold(args)
    else:
        run(args)


def cold(args) -> None:
    """Time each row's first call in a new process with an empty Triton kernel cache."""
    import subprocess
    import tempfile

    out = {"label": args.label, "cold": {}}
    for row in args.only or []:
        with tempfile.TemporaryDirectory() as cache, tempfile.NamedTemporaryFile() as f:
            env = dict(os.environ, TRITON_CACHE_DIR=cache)
            t0 = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--device", args.device, "--label",
                            args.label, "--only", row, "--repeat", "1", "--out", f.name],
                           env=env, check=True, stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            rows = json.loads(Path(f.name).read_text())["rows"]
        for name, r in rows.items():
            out["cold"][name] = {"first_ms": r["first_ms"], "process_s": wall}
            print(f"{args.label:>7} cold {name:<40} first call {r['first_ms']:9.0f} ms "
                  f"(process {wall:.1f} s)", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
