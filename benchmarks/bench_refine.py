"""register()'s refinement: point-to-plane ICP vs generalized ICP after the global stage (issue 24).

The issue's rule: make GICP ``register()``'s default refinement if it is more accurate than
point-to-plane after the global stage on the bunny pairs and the hard pairs. Both runs of a
pair get the same inputs and the same seed, so the global stage (FPFH + RANSAC + the coarse
ICP) is the same and only the final refinement differs (``register(refine=...)``, every
other argument at its default).

Pairs:

* ``scan``: the Stanford bunny scan pairs of ``bench_gicp`` (bun045->bun000,
  bun315->bun000, bun090->bun045, bun270->bun315, top2->bun000) in both directions, raw
  scans (~30-40k points each), ground truth from ``bun.conf``; no initial guess.
* ``hard``: ``bench_hard_pairs``'s grid (:func:`pointalign.datasets.make_hard_pair`:
  30-70 % overlap, 5 % / 20 % outliers, 30-180 degree turns; case k uses seed k) on every
  scan found (the bunny; the UWA parasaurolophus where the data folder has it).
  ``--hard-cases`` picks a subset (e.g. ``0-31``), ``--quick`` one pair per cell.

Success (both kinds): rotation error < 1 degree and translation error < 2 mm·s measured at
the source's centroid (``bench_hard_pairs``'s rule; s = the scan's diagonal / the bunny's).
Per refinement and kind: successes, ``converged`` (the verdict's trust), rotation and
translation errors (median, p90; over all pairs and over the pairs both refinements got
right), wall time of ``register`` (median) and of its final stage (``timings["icp"]``).

    python benchmarks/bench_refine.py --device cpu            # all pairs (CPU: ~10 min)
    python benchmarks/bench_refine.py --device cpu --quick    # smoke run
"""

from __future__ import annotations  # noqa: I001 (pointalign before PyTorch, below)

import os
import statistics
import sys
import time

# pointalign before PyTorch: it sets OMP_WAIT_POLICY=PASSIVE only while the OpenMP runtime
# is not loaded yet (pointalign._threads; see bench_gicp for what spinning costs here)
import pointalign
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_hard_pairs import _ok, errors, grid, load_scans, make, parse_cases  # noqa: E402
from common import Recorder, parse_args, sync  # noqa: E402

from pointalign import datasets, io  # noqa: E402
from pointalign.registration.pipeline import register  # noqa: E402

REFINES = ("point_to_plane", "gicp")
SCAN_PAIRS = (("bun045", "bun000"), ("bun315", "bun000"), ("bun090", "bun045"),
              ("bun270", "bun315"), ("top2", "bun000"))
NOTES = (
    "register() with every argument at its default but refine; the same seed and inputs, "
    "so the global stage is shared and only the final refinement differs. scan: Stanford "
    "bunny scan pairs both ways (raw, ground truth bun.conf); hard: bench_hard_pairs' grid "
    "(make_hard_pair, case k seed k). ok: rotation < 1 deg and centroid error < 2 mm·s. "
    "Errors in degrees and millimetres·s; 'both ok': over the pairs both refinements got "
    "right. ms: wall time of register(); icp_ms: its final stage. CPU times on a shared "
    "2-core machine (load in each row).")


def scan_pairs(data) -> list[tuple[str, datasets.Pair, float]]:
    """The bunny scan pairs both ways: ``(name, pair, scale 1)``."""
    bdir = None if data is None else data / "stanford_bunny" / "data"
    out = []
    if bdir is None or not bdir.is_dir():
        names = [("bun045", "bun000")]
        load = datasets.load_bunny
    else:
        names = list(SCAN_PAIRS)

        def load(n):
            return io.read(bdir / f"{n}.ply").points.to(torch.float32)
    for s, t in names:
        for a, b in ((s, t), (t, s)):
            pair = datasets.Pair(load(a), load(b), datasets.bunny_relative_pose(a, b))
            out.append((f"{a}->{b}", pair, 1.0))
    return out


def hard_pairs(data, spec: str | None, quick: bool) -> list[tuple[str, datasets.Pair, float]]:
    """``bench_hard_pairs``'s grid on the scans found: ``(name, pair, scale)``."""
    if data is None:
        return []
    from bench_hard_pairs import ANGLES, OUTLIERS, OVERLAPS, SCANS

    names = list(SCANS)
    scans = load_scans(data, names)
    cases = [c for c in grid(names) if c["scan"] in scans]
    if spec:
        chosen = set(parse_cases(spec, len(grid(names))))
        cases = [c for c in cases if c["k"] in chosen]
    elif quick:
        cases = [c for c in cases if c["angle"] == ANGLES[(OVERLAPS.index(c["overlap"]) * 2
                                                          + OUTLIERS.index(c["outliers"]))
                                                         % len(ANGLES)]]
    out = []
    for c in cases:
        pair, scale = make(c, scans)
        out.append((f"{c['scan']} k={c['k']} ov={c['overlap']} out={c['outliers']} "
                    f"{c['angle']:.0f}deg", pair, scale))
    return out


def run(pair: datasets.Pair, dev: str, refine: str) -> dict:
    s, t = pair.source.to(dev), pair.target.to(dev)
    sync()
    t0 = time.perf_counter()
    r = register(s, t, refine=refine)
    sync()
    return dict(T=r.transformation, s=time.perf_counter() - t0,
                icp_s=float(r.timings.get("icp", float("nan"))),
                converged=bool(r.converged), stop=str(r.stop_reason))


def _q(xs: list[float], q: float) -> float:
    return float(np.quantile(np.asarray(xs), q)) if xs else float("nan")


def summary(rows: list[dict], kind: str) -> list[dict]:
    sel = [r for r in rows if kind == "all" or r["kind"] == kind]
    both = [r for r in sel if all(r[f"{m}.ok"] for m in REFINES)]
    out = []
    for m in REFINES:
        rot = [r[f"{m}.rot_deg"] for r in sel]
        tr = [r[f"{m}.trans_mm_s"] for r in sel]
        out.append(dict(
            kind=kind, refine=m, pairs=len(sel), ok=sum(r[f"{m}.ok"] for r in sel),
            converged=sum(r[f"{m}.converged"] for r in sel),
            trusted_wrong=sum(r[f"{m}.converged"] and not r[f"{m}.ok"] for r in sel),
            rot_med=_q(rot, 0.5), rot_p90=_q(rot, 0.9), trans_med=_q(tr, 0.5),
            trans_p90=_q(tr, 0.9), both_ok=len(both),
            both_rot_med=_q([r[f"{m}.rot_deg"] for r in both], 0.5),
            both_rot_p90=_q([r[f"{m}.rot_deg"] for r in both], 0.9),
            both_trans_med=_q([r[f"{m}.trans_mm_s"] for r in both], 0.5),
            both_trans_p90=_q([r[f"{m}.trans_mm_s"] for r in both], 0.9),
            more_accurate=sum(r[f"{m}.rot_deg"] < r[f"{o}.rot_deg"]
                              for r in both for o in REFINES if o != m),
            ms_med=statistics.median(r[f"{m}.ms"] for r in sel) if sel else float("nan"),
            icp_ms_med=statistics.median(r[f"{m}.icp_ms"] for r in sel) if sel
            else float("nan")))
    return out


def main() -> None:
    p = parse_args(__doc__.splitlines()[0])
    p.add_argument("--hard-cases", default=None, help="hard-pair grid indices, e.g. 0-31")
    p.add_argument("--no-scans", action="store_true", help="leave out the scan pairs")
    p.add_argument("--no-hard", action="store_true", help="leave out the hard pairs")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    a = p.parse_args()
    dev = a.device
    if a.threads:
        pointalign.set_num_threads(a.threads)
    data = datasets.shared_data_dir()
    pairs = [] if a.no_scans else [("scan", *x) for x in scan_pairs(data)]
    if a.quick:
        pairs = pairs[:2]
    if not a.no_hard:
        pairs += [("hard", *x) for x in hard_pairs(data, a.hard_cases, a.quick)]
    if not pairs:
        raise SystemExit("no pairs (set POINTALIGN_DATA)")
    for m in REFINES:  # warm-up: kernels compile and caches fill on the first call
        run(pairs[0][2], dev, m)
    rec = Recorder("refine", dev, title="register(): point-to-plane vs GICP refinement",
                   notes=NOTES, columns=None)
    rows = []
    for kind, name, pair, scale in pairs:
        row: dict = dict(kind=kind, pair=name)
        for m in REFINES:
            r = run(pair, dev, m)
            rot, trans = errors(r["T"], pair)
            row |= {f"{m}.ok": _ok(rot, trans, scale), f"{m}.rot_deg": round(rot, 4),
                    f"{m}.trans_mm_s": round(1e3 * trans / scale, 4),
                    f"{m}.converged": r["converged"], f"{m}.stop": r["stop"],
                    f"{m}.ms": round(1e3 * r["s"], 1), f"{m}.icp_ms": round(1e3 * r["icp_s"], 1)}
        row["load"] = round(os.getloadavg()[0], 2)
        rec.add("pairs", **row)
        rows.append(row)
    for kind in ("scan", "hard", "all"):
        if any(kind in ("all", r["kind"]) for r in rows):
            for s in summary(rows, kind):
                rec.add("summary", **s)
    rec.save()


if __name__ == "__main__":
    main()
