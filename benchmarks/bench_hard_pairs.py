"""Hard pairs (issue 13): partial overlap, large turns, noise and outliers; ours vs Open3D.

Pairs come from :func:`pointalign.datasets.make_hard_pair`: each scan is cut along a random
direction into a source and a target sharing 30/40/50/70 % of their points; the source is
turned 30/90/150/180 degrees about a random axis through its centroid and moved 5 mm·s
(``s`` below); each side gets 0.5 mm·s Gaussian noise and 5 % or 20 % of its points
replaced by uniform outliers in its bounding box. Millimetre quantities are for the bunny
(bun000, bounding-box diagonal 0.2474 m); every other scan uses them times
``s = its diagonal / 0.2474 m`` (the UWA parasaurolophus, in mm: s = 1471, noise 0.74 mm).
Success: rotation error < 1 degree and translation error < 2 mm·s, the translation error
measured at the source's centroid (``|T_est c − T_true c|``, so it does not depend on where
the scan's origin lies). Seeds are fixed: pair k of the grid uses seed k.

Methods on the SAME pairs:

* ``ours``: :func:`pointalign.register` with default arguments on ``--device``;
* ``o3d_ransac``: Open3D's global-registration tutorial (voxel 2.5 mm·s; normals 2v/30,
  FPFH 5v/100, mutual-filtered RANSAC with edge 0.9 and distance 1.5v checkers,
  100,000 iterations, confidence 0.999), then point-to-plane ICP at 0.4v on the full
  clouds (normals 2v/30): CPU, when ``import open3d`` works;
* ``o3d_fgr``: the same features, Fast Global Registration (0.5v), the same ICP.

Tables: ``cells`` (overlap × outliers × angle: successes and median time per method),
``by_overlap_outliers`` (the issue's targets), ``totals``, and ``verdict`` (how
``result.converged`` separates our successes from our failures: false accepts = failures
with converged True, false rejects = successes with converged False).

    python benchmarks/bench_hard_pairs.py --device cuda --only ours   # GPU machine
    python benchmarks/bench_hard_pairs.py --device cpu                # ours + Open3D, CPU
    python benchmarks/bench_hard_pairs.py --device cpu --quick        # smoke run
    python benchmarks/bench_hard_pairs.py --cases 0-7,40              # a subset of the grid

Data: ``stanford_bunny/data/bun000.ply`` and ``uwa_mian/parasaurolophus_low_normals2.ply``
under the shared data folder (``$POINTALIGN_DATA``; the GPU machine reads ``.data``).

DIAGNOSIS (why every 20 %-outlier pair failed at commit 356792a) is recorded in
``DIAGNOSIS`` below and rendered with the results.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

# idle OpenMP threads sleep (what importing pointalign before PyTorch sets; see _threads)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Recorder, parse_args, sync  # noqa: E402

from pointalign import datasets, io, metrics, transforms  # noqa: E402
from pointalign.registration.pipeline import register  # noqa: E402

SCANS = {"bunny": "stanford_bunny/data/bun000.ply",
         "uwa": "uwa_mian/parasaurolophus_low_normals2.ply"}
OVERLAPS = (0.3, 0.4, 0.5, 0.7)
OUTLIERS = (0.05, 0.2)
ANGLES = (30.0, 90.0, 150.0, 180.0)
ROT_TOL_DEG = 1.0
TRANS_TOL = 0.002  # metres on the bunny, times s elsewhere

DIAGNOSIS = (
    "Diagnosis of the 20%-outlier failures (measured at 356792a on pair 14: bunny, 40% "
    "overlap, 150 deg; /tmp scripts, CPU). (1) Voxel size: auto_voxel_size counts every "
    "occupied voxel, and uniform outliers take one voxel each: v grew from 2.6 to 4.6-5.1 mm. "
    "(2) Downsampling then AMPLIFIES the outliers: surface points merge into few voxels, "
    "outliers do not, so 55-57% of the downsampled points were outliers (20% of the raw "
    "ones). (3) Scoring: with the target's outliers filling the box at the scale of the "
    "1.5v bound, a wrong pose scored a higher inlier ratio (0.88) than the true one (~0.47). "
    "(4) Correspondences: only 2.7% of feature matches were right under the ground truth "
    "(mutual 4%). Fix: dense_mask drops raw points with fewer than 4 neighbours within v "
    "(90% of outliers have <= 3, 99% of surface points >= 7) and robust_voxel_size "
    "recomputes v without them: downsampled outliers 57% -> 0%, v 4.6 -> 2.1 mm, right "
    "matches 2.7% -> 8% (11% among the 1,000 mutual/ratio-ranked ones). Voxel-level "
    "isolation at 1.5v alone removed only 22-48% of the outliers (they are dense at that "
    "scale). RANSAC at w ~ 0.1 still missed some pairs; compatibility-graph hypotheses "
    "(registration/robust.py) recovered 6 of 8 hard pairs tried on their own. Verdict: on "
    "the first CPU pairs, right results had residual concentration >= 0.60 and wrong ones "
    "<= 0.39; the margin alone did not separate them (0.88-0.91 both ways) and is kept at "
    "0.95 for truly ambiguous cases only.")


def grid(scans: list[str]) -> list[dict]:
    """Every case of the benchmark, in a fixed order (case k uses seed k)."""
    cases = []
    for scan in scans:
        for ov in OVERLAPS:
            for out in OUTLIERS:
                for ang in ANGLES:
                    cases.append(dict(k=len(cases), scan=scan, overlap=ov, outliers=out,
                                      angle=ang))
    return cases


def parse_cases(spec: str | None, n: int) -> list[int]:
    if not spec:
        return list(range(n))
    out: list[int] = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    bad = [k for k in out if not 0 <= k < n]
    if bad:
        raise SystemExit(f"--cases: {bad} outside 0..{n - 1}")
    return out


def load_scans(data: Path, names: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for name in names:
        path = data / SCANS[name]
        if path.is_file():
            out[name] = io.read(path).points.to(torch.float32)
        else:
            print(f"missing {path}: scan {name!r} skipped")
    return out


def make(case: dict, scans: dict[str, torch.Tensor]) -> tuple[datasets.Pair, float]:
    """The case's pair and its length scale s."""
    pts = scans[case["scan"]]
    scale = float((pts.max(0).values - pts.min(0).values).double().norm()) \
        / datasets.HARD_PAIR_REFERENCE_DIAGONAL
    pair = datasets.make_hard_pair(pts, case["overlap"], case["angle"], case["outliers"],
                                   seed=case["k"], scale=scale)
    return pair, scale


def errors(T_est, pair: datasets.Pair) -> tuple[float, float]:
    """Rotation error (degrees) and the error of the source centroid's image."""
    T_est = torch.as_tensor(np.asarray(T_est), dtype=torch.float64)
    rot, _ = metrics.relative_error(T_est, pair.T_target_source)
    c = pair.source.double().mean(0, keepdim=True)
    d = transforms.apply(T_est, c) - transforms.apply(pair.T_target_source, c)
    return float(rot), float(d.norm())


def run_ours(pair: datasets.Pair, dev: str, kw: dict) -> dict:
    s, t = pair.source.to(dev), pair.target.to(dev)
    sync()
    t0 = time.perf_counter()
    r = register(s, t, **kw)
    sync()
    wall = time.perf_counter() - t0
    return dict(T=r.transformation, s=wall, converged=bool(r.converged),
                verdict=r.info.get("verdict", ""), voxel=r.info.get("voxel_size"),
                **{k: round(float(r.info[k]), 4) for k in ("overlap", "margin", "concentration")
                   if k in r.info})


def _o3d_prep(o3d, p: torch.Tensor, v: float):
    reg = o3d.pipelines.registration
    pc = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(p.double().numpy()))
    d = pc.voxel_down_sample(v)
    d.estimate_normals(o3d.geometry.KDTreeSearchParamHybrid(radius=2 * v, max_nn=30))
    f = reg.compute_fpfh_feature(d, o3d.geometry.KDTreeSearchParamHybrid(radius=5 * v,
                                                                         max_nn=100))
    pc.estimate_normals(o3d.geometry.KDTreeSearchParamHybrid(radius=2 * v, max_nn=30))
    return pc, d, f


def run_open3d(o3d, pair: datasets.Pair, scale: float, seed: int) -> dict[str, dict]:
    reg = o3d.pipelines.registration
    v = 0.0025 * scale
    o3d.utility.random.seed(seed)
    out = {}
    t0 = time.perf_counter()
    s_full, sd, sf = _o3d_prep(o3d, pair.source, v)
    t_full, td, tf = _o3d_prep(o3d, pair.target, v)
    prep = time.perf_counter() - t0

    def icp(T0):
        return reg.registration_icp(s_full, t_full, 0.4 * v, T0,
                                    reg.TransformationEstimationPointToPlane()).transformation

    t0 = time.perf_counter()
    g = reg.registration_ransac_based_on_feature_matching(
        sd, td, sf, tf, True, 1.5 * v, reg.TransformationEstimationPointToPoint(False), 3,
        [reg.CorrespondenceCheckerBasedOnEdgeLength(0.9),
         reg.CorrespondenceCheckerBasedOnDistance(1.5 * v)],
        reg.RANSACConvergenceCriteria(100000, 0.999))
    T = icp(g.transformation)
    out["o3d_ransac"] = dict(T=np.asarray(T), s=prep + time.perf_counter() - t0)
    t0 = time.perf_counter()
    g = reg.registration_fgr_based_on_feature_matching(
        sd, td, sf, tf, reg.FastGlobalRegistrationOption(maximum_correspondence_distance=0.5 * v))
    T = icp(g.transformation)
    out["o3d_fgr"] = dict(T=np.asarray(T), s=prep + time.perf_counter() - t0)
    return out


def _ok(rot: float, trans: float, scale: float) -> bool:
    return rot < ROT_TOL_DEG and trans < TRANS_TOL * scale


def main() -> None:
    p = parse_args(__doc__.splitlines()[0])
    p.add_argument("--cases", default=None, help="indices of the grid, e.g. 0-7,40")
    p.add_argument("--scans", default=",".join(SCANS), help="comma-separated: bunny,uwa")
    p.add_argument("--only", choices=("ours", "open3d"), default=None)
    args = p.parse_args()
    dev = args.device
    data = datasets.shared_data_dir()
    if data is None:
        raise SystemExit("shared data folder not found (set POINTALIGN_DATA)")
    names = [s for s in args.scans.split(",") if s]
    scans = load_scans(data, names)
    cases = [c for c in grid(names) if c["scan"] in scans]
    if args.quick and not args.cases:
        # one pair per (overlap, outliers) cell of the first scan, angles rotating
        cases = [c for c in cases if c["scan"] == names[0]
                 and c["angle"] == ANGLES[(OVERLAPS.index(c["overlap"]) * 2
                                           + OUTLIERS.index(c["outliers"])) % len(ANGLES)]]
    else:
        chosen = set(parse_cases(args.cases, len(grid(names))))
        cases = [c for c in cases if c["k"] in chosen]
    o3d = None
    if args.only != "ours":
        try:
            import open3d as o3d  # noqa: F811
        except Exception as exc:  # optional peer
            print(f"open3d not importable ({type(exc).__name__}): peer columns left out")
    methods = ([] if args.only == "open3d" else ["ours"]) + \
        (["o3d_ransac", "o3d_fgr"] if o3d is not None else [])
    if not methods:
        raise SystemExit("nothing to run")
    # warm-up: kernels compile and caches fill on the first call
    if "ours" in methods:
        run_ours(make(cases[0], scans)[0], dev, {})
    rows = []
    for case in cases:
        pair, scale = make(case, scans)
        res = {}
        if "ours" in methods:
            res["ours"] = run_ours(pair, dev, {})
        if o3d is not None:
            res.update(run_open3d(o3d, pair, scale, case["k"]))
        row = dict(case)
        row["load"] = round(os.getloadavg()[0], 2)
        for m, r in res.items():
            rot, trans = errors(r["T"], pair)
            row[m] = dict(ok=_ok(rot, trans, scale), rot=round(rot, 3),
                          trans_rel=round(trans / (TRANS_TOL * scale), 3),
                          ms=round(1e3 * r["s"], 1),
                          **{k: r[k] for k in ("converged", "verdict", "voxel", "overlap", "margin",
                                               "concentration") if k in r})
        print(row, flush=True)
        rows.append(row)
    rec = Recorder("hard_pairs", dev if "ours" in methods else "cpu",
                   title="Hard pairs: partial overlap, outliers, large turns (issue 13)",
                   notes=NOTES + "\n\n" + DIAGNOSIS)
    for r in rows:
        flat = {k: r[k] for k in ("k", "scan", "overlap", "outliers", "angle", "load")}
        for m in methods:
            for k, x in r[m].items():
                flat[f"{m}.{k}"] = x
        rec.add("pairs", **flat)
    summarise(rec, rows, methods)
    rec.save()


def _cell(rows: list[dict], methods: list[str], **key) -> dict:
    sel = [r for r in rows if all(r[k] == x for k, x in key.items())]
    out = dict(key, pairs=len(sel))
    for m in methods:
        out[f"{m} ok"] = sum(r[m]["ok"] for r in sel)
        out[f"{m} ms"] = statistics.median(r[m]["ms"] for r in sel) if sel else float("nan")
    return out


def summarise(rec: Recorder, rows: list[dict], methods: list[str]) -> None:
    for ov in OVERLAPS:
        for out in OUTLIERS:
            for ang in ANGLES:
                c = _cell(rows, methods, overlap=ov, outliers=out, angle=ang)
                if c["pairs"]:
                    rec.add("cells", **c)
    for ov in OVERLAPS:
        for out in OUTLIERS:
            c = _cell(rows, methods, overlap=ov, outliers=out)
            if c["pairs"]:
                rec.add("by_overlap_outliers", **c)
    for out in OUTLIERS:
        c = _cell(rows, methods, outliers=out)
        if c["pairs"]:
            rec.add("totals", **c)
    rec.add("totals", **_cell(rows, methods))
    if "ours" in methods:
        ok = [r for r in rows if r["ours"]["ok"]]
        bad = [r for r in rows if not r["ours"]["ok"]]
        fa = sum(r["ours"]["converged"] for r in bad)
        fr = sum(not r["ours"]["converged"] for r in ok)
        rec.add("verdict", successes=len(ok), failures=len(bad),
                failures_flagged=f"{len(bad) - fa}/{len(bad)}",
                false_accept_rate=round(fa / len(bad), 3) if bad else 0.0,
                successes_rejected=f"{fr}/{len(ok)}",
                false_reject_rate=round(fr / len(ok), 3) if ok else 0.0,
                reasons_on_failures=", ".join(sorted({r["ours"]["verdict"] for r in bad}))
                or "-")


NOTES = ("Pairs from datasets.make_hard_pair (see the benchmark's docstring); success = "
         "rotation error < 1 deg and centroid error < 2 mm·s. `ours` ran on the device named "
         "above with default register() arguments; Open3D columns (tutorial RANSAC + ICP, "
         "FGR + ICP, voxel 2.5 mm·s) on the CPU of the same run. `ms`: median wall time per "
         "pair of the cell; `load`: 1-minute load average when the pair finished.")


if __name__ == "__main__":
    main()
