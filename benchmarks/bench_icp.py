"""ICP: time per iteration by search backend, and ICP to convergence vs small_gicp.

Table ``per_iteration`` (the CUDA ICP project's comparison, Sharma, CIS 565 Project 4: CPU
6.5-9 s, GPU brute force 80-100 ms, GPU k-d tree 150-315 ms per iteration on a Quadro
P1000): bun045 -> bun000 (40,097 -> 40,256 points) from the identity, point-to-point, a
fixed 30 iterations (tolerances 0), max correspondence distance 5 cm (about the
unbounded nearest neighbour of the CUDA ICP project) and 1 cm. Rows: our CPU ICP on
SciPy cKDTree (all cores), and on the GPU every ``build_index`` method that exists (brute,
kdtree, grid); missing methods are listed as skipped. The index is built once (its build
time is its own column) and reused by every timed call. CPU peers (if importable), same
points, distances and 30 fixed iterations: Open3D ``registration_icp`` point-to-point (its
KDTreeFlann is built inside every call: timed on its own as build_ms and subtracted) and
small_gicp ``align`` (``ICP``, all cores, k-d tree prebuilt, convergence epsilons 0).

Table ``convergence``: point-to-point and point-to-plane ICP until convergence, at most 100
iterations, under two stopping rules: Open3D's (relative fitness 1e-6, relative RMSE 1e-6) and
small_gicp's (an update smaller than 1 mm and 0.1 deg, its ``TerminationCriteria`` defaults),
on

* ``bunny``: bun045 -> bun000 from the identity (about 34 deg; ground truth from bun.conf);
* ``100k`` / ``1M``: bun000 upsampled to n points (drawn with replacement plus Gaussian
  jitter of 0.5 mm per coordinate) as the target, the source a copy moved by a known
  10 deg / 2 cm motion with 0.5 mm noise (``datasets.make_pair``, seed 0).

Max correspondence distance 5 cm for every row. Our time includes the index build and, for
point-to-plane, target normals (k = 20); small_gicp (if importable) runs ``align`` on the
same points with all cores (``downsampling_resolution`` 1e-5 m, i.e. effectively no
downsampling) and includes its own preprocessing (k-d tree, normals). Open3D (if importable,
CPU only: it is too large to carry to the GPU machine) runs
``open3d.pipelines.registration.registration_icp`` with ``ICPConvergenceCriteria``
(relative fitness 1e-6, relative RMSE 1e-6, 100 iterations: the same rules as ours),
point-to-point and point-to-plane (target normals from ``estimate_normals`` with
``KDTreeSearchParamHybrid(radius=1 cm, max_nn=20)``, timed as open3d_normals_ms and included
in open3d_ms); its iteration count is read from its debug log. Errors: rotation (deg) and
translation (mm) vs the ground truth. On the CPU the 1M problem is left out (``--cpu-1m``
adds it): each peer takes minutes there on 2 cores.

    python benchmarks/bench_icp.py --device cuda          # full sizes (bunny, 100k, 1M)
    python benchmarks/bench_icp.py --device cpu --quick   # smoke run, < 1 minute
    python benchmarks/bench_icp.py --device cpu           # CPU sizes (bunny, 100k), with Open3D
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Recorder, parse_args, small_gicp_steps, sync, timeit  # noqa: E402

from pointalign import datasets, metrics  # noqa: E402
from pointalign.registration.criteria import ConvergenceCriteria  # noqa: E402
from pointalign.registration.icp import icp  # noqa: E402
from pointalign.search import build_index  # noqa: E402

MAX_DIST = 0.05
JITTER = 5e-4

NOTES = (
    "per_iteration: bun045 -> bun000 from the identity, point-to-point, 30 fixed iterations, "
    "max distance 5 cm and 1 cm, plain (acceleration=False: the cost of one iteration); "
    "ms_per_iter = (whole call - nothing else) / evaluations, index "
    "prebuilt (build_ms separate). convergence: to convergence (rel. fitness/RMSE 1e-6, "
    "<= 100 iterations; and small_gicp's rule: update < 1 mm and 0.1 deg), max distance 5 cm, "
    "icp()'s defaults (point-to-point Anderson-accelerated since session 10); "
    "100k/1M = bun000 upsampled with 0.5 mm jitter, "
    "source moved by 10 deg / 2 cm + 0.5 mm noise. Our total includes index build and "
    "target normals (k=20, point-to-plane); small_gicp.align (all cores) includes its "
    "preprocessing. The loop stays on the device (search, fused reduction, float64 Jacobi solve "
    "of the 4x4/6x6 in a Triton kernel); the host checks convergence after chunks of 1, 2, 4, "
    "8 steps (one transfer per chunk; steps past the stop are discarded). Targets (H100): "
    "<= 0.15 ms/iteration on the bunny pair, <= 3 ms/iteration at 1M, whole ICP at 1M >= 100x "
    "faster than small_gicp."
)


def upsample(points: torch.Tensor, n: int, jitter: float, seed: int = 0) -> torch.Tensor:
    """``n`` points drawn with replacement from ``points (M, 3)`` plus Gaussian jitter."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, points.shape[0], (n,), generator=g)
    return points[idx] + jitter * torch.randn(n, 3, generator=g, dtype=points.dtype)


def _small_gicp():
    try:
        import small_gicp
    except Exception:
        return None
    return small_gicp


def run_small_gicp(sg, source: np.ndarray, target: np.ndarray, kind: str):
    """small_gicp.align on raw points (keyword names differ across versions)."""
    threads = os.cpu_count() or 1
    base = dict(init_T_target_source=np.eye(4), registration_type=kind,
                downsampling_resolution=1e-5, num_threads=threads)
    attempts = [dict(max_correspondence_distance=MAX_DIST, max_iterations=100),
                dict(max_correspondence_distance=MAX_DIST),
                dict(max_corresponding_distance=MAX_DIST)]
    for extra in attempts:
        try:
            t0 = time.perf_counter()
            res = sg.align(target, source, **base, **extra)
            return res, time.perf_counter() - t0
        except TypeError:
            continue
    raise RuntimeError("small_gicp.align: no known keyword set accepted")


def _open3d():
    try:
        import open3d
    except Exception:
        return None
    return open3d


def _o3d_cloud(o3d, points) -> object:
    return o3d.geometry.PointCloud(o3d.utility.Vector3dVector(np.asarray(points, np.float64)))


def open3d_icp(o3d, source, target, *, max_dist: float, kind: str, iterations: int,
               rel: float, count: bool = False):
    """One Open3D ``registration_icp`` call -> (result, seconds, iterations or None).

    ``count``: run at debug verbosity with stdout redirected to a file and count the
    "ICP Iteration #" lines (legacy results carry no iteration count); not for timing.
    """
    reg = o3d.pipelines.registration
    est = (reg.TransformationEstimationPointToPoint() if kind == "point_to_point"
           else reg.TransformationEstimationPointToPlane())
    crit = reg.ICPConvergenceCriteria(relative_fitness=rel, relative_rmse=rel,
                                      max_iteration=iterations)
    if not count:
        t0 = time.perf_counter()
        res = reg.registration_icp(source, target, max_dist, np.eye(4), est, crit)
        return res, time.perf_counter() - t0, None
    sys.stdout.flush()
    with tempfile.TemporaryFile() as f:
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        o3d.utility.set_verbosity_level(o3d.utility.VerbosityLevel.Debug)
        try:
            t0 = time.perf_counter()
            res = reg.registration_icp(source, target, max_dist, np.eye(4), est, crit)
            el = time.perf_counter() - t0
        finally:
            o3d.utility.set_verbosity_level(o3d.utility.VerbosityLevel.Warning)
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        n = len(re.findall(rb"ICP Iteration #", f.read()))
    return res, el, n


def per_iteration_peers(rec: Recorder, src: torch.Tensor, tgt: torch.Tensor, truth,
                        iters: int, md: float) -> None:
    """Open3D and small_gicp point-to-point for ``iters`` fixed iterations (CPU)."""
    o3d, sg = _open3d(), _small_gicp()
    base = dict(device="cpu", max_dist_m=md, n_source=src.shape[0], n_target=tgt.shape[0])
    s_np, t_np = src.double().numpy(), tgt.double().numpy()
    if o3d is not None:
        s, t = _o3d_cloud(o3d, s_np), _o3d_cloud(o3d, t_np)
        b = timeit(lambda: o3d.geometry.KDTreeFlann(t), warmup=1, repeat=5)["median_s"]
        res, _, n = open3d_icp(o3d, s, t, max_dist=md, kind="point_to_point",
                               iterations=iters, rel=0.0, count=True)
        tm = timeit(lambda: open3d_icp(o3d, s, t, max_dist=md, kind="point_to_point",
                                       iterations=iters, rel=0.0), warmup=1, repeat=3)
        rot, trans = metrics.relative_error(np.asarray(res.transformation), truth)
        rec.add("per_iteration", search="open3d KDTreeFlann", **base, iterations=n,
                ms_per_iter=1e3 * (tm["median_s"] - b) / n, iqr_ms=1e3 * tm["iqr_s"] / n,
                build_ms=1e3 * b, fitness=res.fitness, rot_err_deg=rot,
                trans_err_mm=1e3 * trans, peer=f"open3d {o3d.__version__} registration_icp")
    else:
        rec.add("per_iteration", search="open3d", **base, skipped="not importable")
    if sg is not None:
        threads = os.cpu_count() or 1
        s, t = sg.PointCloud(s_np), sg.PointCloud(t_np)
        b = timeit(lambda: sg.KdTree(t, num_threads=threads), warmup=1, repeat=5)["median_s"]
        tree = sg.KdTree(t, num_threads=threads)

        def call():
            return sg.align(t, s, tree, init_T_target_source=np.eye(4), registration_type="ICP",
                            max_correspondence_distance=md, num_threads=threads,
                            max_iterations=iters, rotation_epsilon=0.0,
                            translation_epsilon=0.0)

        res = call()
        n = max(1, int(res.iterations))
        tm = timeit(call, warmup=1, repeat=3)
        rot, trans = metrics.relative_error(np.asarray(res.T_target_source), truth)
        rec.add("per_iteration", search="small_gicp KdTree", **base, iterations=n,
                ms_per_iter=1e3 * tm["median_s"] / n, iqr_ms=1e3 * tm["iqr_s"] / n,
                build_ms=1e3 * b, rot_err_deg=rot, trans_err_mm=1e3 * trans,
                peer=f"small_gicp align ICP, {threads} threads")
    else:
        rec.add("per_iteration", search="small_gicp", **base, skipped="not importable")


def per_iteration(rec: Recorder, dev: torch.device, quick: bool) -> None:
    pair = datasets.load_bunny_pair()
    src, tgt = pair.source, pair.target
    if quick:
        src = datasets.random_subsample(src, 4000, 0)
        tgt = datasets.random_subsample(tgt, 4000, 1)
    iters = 10 if quick else 30
    crit = ConvergenceCriteria(max_iterations=iters, relative_fitness=0, relative_rmse=0,
                               translation_tolerance=0, rotation_tolerance=0)
    rows = [("cpu", "ckdtree")]
    if dev.type == "cuda":
        rows += [("cuda", m) for m in ("brute", "kdtree", "grid")]
    dists = (MAX_DIST,) if quick else (MAX_DIST, 0.01)
    for (d, m), md in [(r, md) for md in dists for r in rows]:
        s, t = src.to(d), tgt.to(d)
        try:
            t0 = time.perf_counter()
            ix = build_index(t, m, max_distance=md)
            sync()
            build = time.perf_counter() - t0
        except (ValueError, ImportError) as exc:
            rec.add("per_iteration", device=d, search=m, max_dist_m=md,
                    skipped=f"{type(exc).__name__}: {exc}")
            continue

        def call(s=s, t=t, ix=ix, d=d, md=md):  # plain: the cost of one iteration
            return icp(s, t, max_correspondence_distance=md, criteria=crit, index=ix,
                       device=d, acceleration=False)

        res = call()
        n_eval = len(res.history)
        tm = timeit(call, warmup=1, repeat=3 if (quick or d == "cpu") else 10, device=d)
        rot, trans = metrics.relative_error(res.transformation, pair.T_target_source)
        rec.add("per_iteration", device=d, search=m, max_dist_m=md, n_source=s.shape[0],
                n_target=t.shape[0], iterations=res.iterations,
                ms_per_iter=1e3 * tm["median_s"] / n_eval, iqr_ms=1e3 * tm["iqr_s"] / n_eval,
                build_ms=1e3 * build, launch_ms=1e3 * res.timings["launch"] / n_eval,
                sync_ms=1e3 * res.timings["sync"] / n_eval,
                device_steps=res.info.get("device_steps"),
                fitness=res.fitness, rot_err_deg=rot, trans_err_mm=1e3 * trans)
        if d == "cpu":  # the CPU peers beside our CPU row
            per_iteration_peers(rec, src, tgt, pair.T_target_source, iters, md)


def problems(quick: bool, sizes=((100_000, "100k"), (1_000_000, "1M"))):
    pair = datasets.load_bunny_pair()
    if quick:
        cloud = datasets.random_subsample(pair.target, 5000, 0)
        yield "bunny5k-synthetic", datasets.make_pair(cloud, 10.0, 0.02, noise=JITTER, seed=0)
        return
    yield "bunny", pair
    for n, name in sizes:
        cloud = upsample(pair.target, n, JITTER, seed=n)
        yield name, datasets.make_pair(cloud, 10.0, 0.02, noise=JITTER, seed=0)


def open3d_convergence(o3d, p, kind: str, repeat: int) -> dict:
    """Open3D registration_icp to convergence on pair ``p`` (CPU): the open3d_* fields."""
    s = _o3d_cloud(o3d, p.source.double().numpy())
    t = _o3d_cloud(o3d, p.target.double().numpy())
    normals_s = 0.0
    if kind == "point_to_plane":
        def normals():
            t.estimate_normals(o3d.geometry.KDTreeSearchParamHybrid(radius=0.01, max_nn=20))

        normals_s = timeit(normals, warmup=1, repeat=repeat)["median_s"]
    res, _, n = open3d_icp(o3d, s, t, max_dist=MAX_DIST, kind=kind, iterations=100, rel=1e-6,
                           count=True)
    tm = timeit(lambda: open3d_icp(o3d, s, t, max_dist=MAX_DIST, kind=kind, iterations=100,
                                   rel=1e-6), warmup=1, repeat=repeat)
    rot, trans = metrics.relative_error(np.asarray(res.transformation), p.T_target_source)
    return dict(open3d_ms=1e3 * (tm["median_s"] + normals_s), open3d_icp_ms=1e3 * tm["median_s"],
                open3d_normals_ms=1e3 * normals_s, open3d_iterations=n,
                open3d_ms_per_iter=1e3 * tm["median_s"] / max(n, 1),
                open3d_rot_err_deg=rot, open3d_trans_err_mm=1e3 * trans,
                open3d_fitness=res.fitness)


#: the two stopping rules of the convergence table: Open3D's (relative change of fitness and
#: RMSE) and small_gicp's (an update below 1 mm and 0.1 deg: its TerminationCriteria defaults)
CRITERIA = (
    ("relative 1e-6", ConvergenceCriteria(max_iterations=100)),
    ("update < 1 mm, 0.1 deg", ConvergenceCriteria(
        max_iterations=100, relative_fitness=0, relative_rmse=0,
        translation_tolerance=1e-3, rotation_tolerance=float(np.radians(0.1)))),
)


def small_gicp_fields(sg, p, sg_kind: str, big: bool) -> dict:
    """small_gicp.align on pair ``p`` (all cores): the small_gicp_* fields of a row."""
    src_np = p.source.double().numpy()
    tgt_np = p.target.double().numpy()
    try:
        times = []
        for _ in range(1 if big else 3):
            sres, el = run_small_gicp(sg, src_np, tgt_np, sg_kind)
            times.append(el)
        srot, strans = metrics.relative_error(np.asarray(sres.T_target_source),
                                              p.T_target_source)
        med = float(np.median(times))
        return dict(small_gicp_ms=1e3 * med, small_gicp_iterations=small_gicp_steps(sres),
                    small_gicp_ms_per_iter=1e3 * med / small_gicp_steps(sres),
                    small_gicp_rot_err_deg=srot, small_gicp_trans_err_mm=1e3 * strans)
    except Exception as exc:  # record, never hide
        return dict(small_gicp_error=f"{type(exc).__name__}: {exc}")


def convergence(rec: Recorder, dev: torch.device, quick: bool, cpu_1m: bool = False) -> None:
    sg = _small_gicp()
    if sg is None:
        rec.add("convergence", peer="small_gicp", skipped="not importable")
    o3d = _open3d()
    sizes = ((100_000, "100k"), (1_000_000, "1M"))
    if dev.type == "cpu" and not cpu_1m:
        sizes = sizes[:1]
    for name, p in problems(quick, sizes):
        s, t = p.source.to(dev), p.target.to(dev)
        for method, sg_kind in (("point_to_point", "ICP"), ("point_to_plane", "PLANE_ICP")):
            peer = None
            for crit_name, crit in CRITERIA:
                def call(s=s, t=t, method=method, crit=crit):
                    return icp(s, t, max_correspondence_distance=MAX_DIST, method=method,
                               criteria=crit, device=dev)

                t0 = time.perf_counter()
                res = call()
                first = time.perf_counter() - t0
                # on the CPU a call over 5 s is timed once more (the first was the warm-up)
                big = s.shape[0] > 200_000 or (dev.type == "cpu" and first > 5)
                tm = timeit(call, warmup=0 if big else 1,
                            repeat=1 if (big and dev.type == "cpu") else
                            3 if (quick or big or dev.type == "cpu") else 7, device=dev)
                rot, trans = metrics.relative_error(res.transformation, p.T_target_source)
                n_eval = len(res.history)
                row = dict(problem=name, n_source=s.shape[0], n_target=t.shape[0],
                           method=method, criteria=crit_name, device=dev.type,
                           index=res.info["index"], iterations=res.iterations,
                           stop=res.stop_reason, total_ms=1e3 * tm["median_s"],
                           ms_per_iter=1e3 * res.timings["iterate"] / n_eval,
                           device_steps=res.info.get("device_steps"),
                           index_ms=1e3 * res.timings["index"],
                           normals_ms=1e3 * res.timings.get("normals", 0.0),
                           rot_err_deg=rot, trans_err_mm=1e3 * trans, fitness=res.fitness)
                if sg is not None:
                    if peer is None:  # one small_gicp run per problem, beside both rules
                        peer = small_gicp_fields(sg, p, sg_kind, s.shape[0] > 200_000)
                    row.update(peer)
                    if "small_gicp_ms" in peer:
                        row["speedup"] = peer["small_gicp_ms"] / (1e3 * tm["median_s"])
                if o3d is not None and dev.type == "cpu" and crit_name == CRITERIA[0][0]:
                    try:
                        o = open3d_convergence(o3d, p, method, 1 if (big or quick) else 3)
                        row.update(**o,
                                   speedup_vs_open3d=o["open3d_ms"] / (1e3 * tm["median_s"]))
                    except Exception as exc:  # record, never hide
                        row.update(open3d_error=f"{type(exc).__name__}: {exc}")
                rec.add("convergence", **row)


def main() -> None:
    ap = parse_args(__doc__.splitlines()[0])
    ap.add_argument("--cpu-1m", action="store_true", help="on the CPU, run the 1M problem too")
    args = ap.parse_args()
    dev = torch.device(args.device)
    rec = Recorder("icp", dev, title="ICP: per-iteration time by search backend, and to "
                   "convergence vs small_gicp", notes=NOTES)
    if dev.type == "cpu":
        rec.title += " and Open3D"
        rec.notes += (f" CPU run ({os.cpu_count()} cores, torch {torch.get_num_threads()} "
                      "threads): ours on SciPy cKDTree (build_index 'auto' on the CPU); peers "
                      "Open3D registration_icp and small_gicp (all cores), same inputs, "
                      "distances and iteration caps; 1M left out on the CPU.")
    load0 = os.getloadavg()[0]
    per_iteration(rec, dev, args.quick)
    convergence(rec, dev, args.quick, args.cpu_1m)
    if dev.type == "cpu":
        rec.notes += (f" Load average (1 min) {load0:.1f} at the start, {os.getloadavg()[0]:.1f} "
                      f"at the end, on {os.cpu_count()} cores (other processes shared the "
                      "machine).")
    if not args.quick:
        rec.save()
    else:
        print("quick run: results not saved")


if __name__ == "__main__":
    main()
