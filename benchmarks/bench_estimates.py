"""Estimates of long work against the time it took: the ratio estimate / actual per call.

Every CPU call that can run longer than 5 s announces an estimate before it starts
(``pointalign._progress.announce``); issue 26 asks that it hold within 2×. Rows, on the
"cpu" backend, each call timed end to end (wall) after one untimed warm-up call of its
method (numba compilation), ``--repeat`` times (median; a row stops repeating once its calls
took ``ROW_BUDGET_S``):

* ``softassign``: bun045 → bun000 subsampled to n × n points (a fixed random subset; the
  whole pair, 40,097 → 40,256, as ``pointalign demo --method softassign`` runs it),
  default schedule and form (``approximation="auto"``: "cells" then per point). Estimate:
  ``soft.estimate_seconds`` / ``_threads.host_share()``, what the call announces.
* ``emicp``: the same pair at n points, default schedule. Estimate as Softassign's.
* ``icp_point_to_plane``, ``icp_point_to_point``: the bunny pair repeated to n points (each
  copy with 0.3 mm Gaussian noise, as ``registration.checks``' constants were measured),
  3 cm, from a 2° / 5 mm perturbation of the truth, default criteria. Estimate:
  ``checks.estimate_icp_seconds`` at the typical iterations (what ``icp`` announces) and at
  the iterations the call ran (``model_at_iterations_s``: the per-iteration model alone).
* ``register``: the repeated pair at n points from the truth's inverse (a global problem).
  Estimate: ``checks.estimate_register_seconds`` (what ``register`` announces).

Each call's estimate divides the model by the machine's free share measured just before it
(from the 1-minute load), as its announcement does; ``ratio`` is the median over the calls
of estimate / wall time (``ratio_all``: each call's); ``share`` and ``estimate_s`` are the
medians of the row's calls. The machine is shared: the load moves during a call,
so the ratios scatter; compare them with the 2× bound, not with each other.

    python benchmarks/bench_estimates.py            # the sizes below, 3 repeats
    python benchmarks/bench_estimates.py --quick    # small sizes, 1 repeat (smoke run)
    python benchmarks/bench_estimates.py --only softassign
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import pointalign as pa  # noqa: E402
from pointalign import _threads, datasets  # noqa: E402
from pointalign.registration import checks, soft  # noqa: E402

#: a size above the bunny scans': the whole pair
WHOLE = 10 ** 6
SIZES = {"softassign": (2000, 5000, 10000, WHOLE), "emicp": (10000, WHOLE),
         "icp_point_to_plane": (1_000_000, 2_000_000),
         "icp_point_to_point": (1_000_000, 2_000_000), "register": (1_000_000, 3_000_000)}
QUICK = {"softassign": (2000,), "emicp": (10000,), "icp_point_to_plane": (200_000,),
         "icp_point_to_point": (200_000,), "register": (200_000,)}


def _subsample(points: np.ndarray, n: int, seed: int) -> np.ndarray:
    if n >= points.shape[0]:
        return points
    rng = np.random.default_rng(seed)
    return points[rng.choice(points.shape[0], min(n, points.shape[0]), replace=False)]


def _repeated(points: np.ndarray, n: int, seed: int) -> np.ndarray:
    """``points`` repeated to n rows, each copy with 0.3 mm Gaussian noise."""
    rng = np.random.default_rng(seed)
    reps = -(-n // points.shape[0])
    out = np.concatenate([points + rng.normal(0, 3e-4, points.shape) for _ in range(reps)])
    return out[:n].astype(np.float32)


#: a row stops repeating once its calls have taken this long (seconds): the long rows run
#: once or twice on a loaded machine, the short ones ``--repeat`` times
ROW_BUDGET_S = 150.0


def _time(call: Callable[[], Any], repeat: int
          ) -> tuple[list[float], list[float], list[float], Any]:
    """Walls, CPU times and shares (measured before each call, as its announcement is)."""
    walls: list[float] = []
    cpus: list[float] = []
    shares: list[float] = []
    result = None
    while len(walls) < repeat and (not walls or sum(walls) < ROW_BUDGET_S):
        shares.append(_threads.host_share())
        t0, c0 = time.perf_counter(), time.process_time()
        result = call()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return walls, cpus, shares, result


def _row(rec: common.Recorder, method: str, n: int, m: int, model: float | None,
         call: Callable[[], Any], repeat: int, **extra: Any) -> None:
    load = os.getloadavg()[0]
    walls, cpus, shares, result = _time(call, repeat)
    wall = statistics.median(walls)
    # each call's estimate is the model over the share measured just before it
    ratios = [] if model is None else [model / sh / w for sh, w in zip(shares, walls,
                                                                        strict=True)]
    share = statistics.median(shares)
    its = getattr(result, "iterations", None)
    rec.add(method=method, n=n, m=m, threads=_threads.get_num_threads(),
            load=round(load, 2), load_after=round(os.getloadavg()[0], 2),
            share=round(share, 3), model_s=None if model is None else round(model, 3),
            estimate_s=None if model is None else round(model / share, 3),
            wall_s=round(wall, 3), repeats=len(walls),
            wall_all_s=[round(w, 3) for w in walls],
            ratio_all=[round(r, 3) for r in ratios], cpu_s=round(statistics.median(cpus), 3),
            ratio=round(statistics.median(ratios), 3) if ratios else None,
            iterations=None if its is None else int(np.max(its)), **extra)


def soft_rows(rec: common.Recorder, sizes: dict, repeat: int) -> None:
    pair = datasets.load_bunny_pair()
    S, T = np.asarray(pair.source), np.asarray(pair.target)
    for method in ("softassign", "emicp"):
        fn = getattr(pa, method)
        if method in sizes:
            fn(_subsample(S, 500, 0), _subsample(T, 500, 1), device="cpu")  # compile
        for n in sizes.get(method, ()):
            s, t = _subsample(S, n, 0), _subsample(T, n, 1)
            model = soft.estimate_seconds(method, s, t)["seconds"]
            _row(rec, method, s.shape[0], t.shape[0], model,
                 lambda fn=fn, s=s, t=t: fn(s, t, device="cpu"), repeat)


def icp_rows(rec: common.Recorder, sizes: dict, repeat: int) -> None:
    pair = datasets.load_bunny_pair()
    S, T = np.asarray(pair.source), np.asarray(pair.target)
    T_true = np.asarray(pair.T_target_source, dtype=np.float64)
    init = datasets.perturbed_pose(T_true, 2.0, 0.005, center=T, seed=0)
    threads = _threads.host_threads("cpu")
    for method in ("point_to_plane", "point_to_point"):
        name = f"icp_{method}"
        if name not in sizes:
            continue
        pa.icp(S, T, init=init, max_correspondence_distance=0.03, method=method,
               device="cpu")  # compile
        for n in sizes[name]:
            s, t = _repeated(S, n, 0), _repeated(T, n, 1)
            typical = checks.ICP_TYPICAL_ITERATIONS[method]
            model = checks.estimate_icp_seconds(n, n, plane=method == "point_to_plane",
                                                iterations=typical, threads=threads,
                                                share=1.0)
            before = len(rec.rows)
            _row(rec, name, n, n, model,
                 lambda s=s, t=t, method=method: pa.icp(
                     s, t, init=init, max_correspondence_distance=0.03, method=method,
                     device="cpu"), repeat)
            row = rec.rows[before]
            at = checks.estimate_icp_seconds(n, n, plane=method == "point_to_plane",
                                             iterations=row["iterations"], threads=threads,
                                             share=row["share"])
            row["model_at_iterations_s"] = round(at, 3)
            row["ratio_at_iterations"] = round(at / row["wall_s"], 3)


def register_rows(rec: common.Recorder, sizes: dict, repeat: int) -> None:
    if "register" not in sizes:
        return
    pair = datasets.load_bunny_pair()
    S, T = np.asarray(pair.source), np.asarray(pair.target)
    threads = _threads.host_threads("cpu")
    pa.register(S, T, device="cpu")  # compile
    for n in sizes["register"]:
        s, t = _repeated(S, n, 0), _repeated(T, n, 1)
        # a global problem: the source moved away from its pose in the target's frame
        Ti = np.linalg.inv(np.asarray(pair.T_target_source, dtype=np.float64))
        s = (s @ Ti[:3, :3].T + Ti[:3, 3]).astype(np.float32)
        model = checks.estimate_register_seconds(n, n, target_points=5000, threads=threads,
                                                 share=1.0)
        _row(rec, "register", n, n, model,
             lambda s=s, t=t: pa.register(s, t, device="cpu"), repeat)


def main() -> None:
    p = common.parse_args(__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--only", default="", help="comma-separated methods (rows' 'method')")
    p.add_argument("--max-points", type=int, default=0,
                   help="skip sizes above this (0: none)")
    p.add_argument("--merge", action="store_true",
                   help="keep the saved rows of the (method, n) pairs not run now")
    args = p.parse_args()
    if torch.device(args.device).type != "cpu":  # the estimates are of CPU work (a GPU: None)
        print(f"bench_estimates: the estimates are of CPU work; nothing to do on {args.device}")
        return
    sizes = dict(QUICK if args.quick else SIZES)
    if args.only:
        keep = set(args.only.split(","))
        sizes = {k: v for k, v in sizes.items() if k in keep or k.split("_")[0] in keep}
    if args.max_points:
        sizes = {k: tuple(n for n in v if n <= args.max_points) for k, v in sizes.items()}
    warnings.simplefilter("ignore")  # the announcements' warnings: the rows say it all
    torch.manual_seed(0)
    rec = common.Recorder(
        "estimates", "cpu", title="Estimates of long work: estimate / actual (CPU)",
        notes="Each row: the estimate a call announces (its cost model over the machine's "
              "free share) against the median wall time of the call on the 'cpu' backend. "
              "Taken on a shared 2-core machine whose load moved during the calls (load, "
              "load_after): the ratios scatter with it. The bound asked: 0.5 <= ratio <= 2.",
        columns=["method", "n", "m", "threads", "load", "load_after", "share", "model_s",
                 "estimate_s", "wall_s", "ratio", "cpu_s", "iterations"])
    soft_rows(rec, sizes, 1 if args.quick else args.repeat)
    icp_rows(rec, sizes, 1 if args.quick else args.repeat)
    register_rows(rec, sizes, 1 if args.quick else args.repeat)
    saved = common.RESULTS / "estimates-cpu.json"
    if args.merge and saved.is_file():
        done = {(r["method"], r["n"]) for r in rec.rows}
        old = [r for r in json.loads(saved.read_text())["rows"]
               if (r["method"], r["n"]) not in done]
        order = list(SIZES)
        rec.rows = sorted(old + rec.rows, key=lambda r: (order.index(r["method"]), r["n"]))
    rec.save()


if __name__ == "__main__":
    main()
