"""Multiway registration of the ten Stanford bunny scans: ours against Open3D's tutorial.

Table ``multiway`` (``benchmarks/results/multiway-<device>.json``), one row per method and
scan plus a row ``scan="all"`` per method (worst errors, merged-model spread, wall time):

* ``pointalign``: :func:`pointalign.multiway` on ``--device`` (every pair registered
  globally and locally through ``register_many``, robust pose graph, one joint refinement).
* ``open3d tutorial``: Open3D's multiway-registration tutorial pipeline as written, on the
  CPU: voxel downsampling, normals (hybrid search, radius 2v, 30 neighbours), every pair
  registered by point-to-plane ICP from the identity, coarse (15 v) then fine (1.5 v), the
  information matrix from the fine correspondences, odometry edges certain and the others
  uncertain, ``global_optimization`` with Levenberg-Marquardt (edge prune threshold 0.25,
  reference node 0). The tutorial's voxel (0.02 m on the 3 m living-room fragments) scaled
  by the ratio of bounding-box diagonals: v = 0.02 m x 0.25 / 3.0 ~ 1.6 mm.
* ``open3d tutorial + ransac``: the same, each pair's ICP started from Open3D's global
  registration tutorial (FPFH radius 5 v, RANSAC on feature matches, 1.5 v threshold,
  edge-length 0.9 and distance checkers, 100,000 iterations, confidence 0.999): the
  scans turn by up to 180 degrees, which ICP from the identity cannot recover.

``edges_right``: how many of the 45 pairwise measurements lie within 1 deg and 3 mm of
the truth (before the pose graph). Errors: each scan's pose against bun.conf (bun000 is
bun.conf's identity, so the frames agree): the angle of inv(T_true) T_est in degrees and
its translation in mm. Spread of the
merged model: each scan moved by its pose, the median distance of its points to the nearest
point of the other scans (SciPy cKDTree, pairs within 2 mm), the median over scans, in mm,
and ``within_2mm``: the share of points with a neighbour within 2 mm. The same measure
for every method, on the full scans; the truth poses give the floor.

    python benchmarks/bench_multiway.py --device cpu        # ours on the CPU, Open3D
    python benchmarks/bench_multiway.py --device cuda       # ours on the GPU, Open3D
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Recorder, parse_args  # noqa: E402

from pointalign import datasets, io, metrics  # noqa: E402

BUNNY = ["bun000", "bun045", "bun090", "bun180", "bun270", "bun315", "chin", "ear_back",
         "top2", "top3"]
#: Open3D's multiway tutorial: voxel 0.02 m on fragments whose bounding boxes have ~3.0 m
#: diagonals (cloud_bin_0/1: 3.08, 2.92 m); the bunny scans' diagonals are ~0.25 m
TUTORIAL_VOXEL = 0.02 * 0.25 / 3.0


def bunny_dir() -> Path | None:
    """The folder holding the ten scans and bun.conf, or None."""
    for root in (datasets.shared_data_dir(), Path("/work/main/.data"),
                 Path("/work/shared/data")):
        if root is not None and (Path(root) / "stanford_bunny" / "data" / "bun.conf").is_file():
            return Path(root) / "stanford_bunny" / "data"
    return None


def load(d: Path) -> tuple[list[np.ndarray], np.ndarray]:
    """The ten scans ``(N_k, 3)`` float64 and their true poses ``T_0_k (10, 4, 4)``."""
    truth = datasets.read_bun_conf((d / "bun.conf").read_text())
    P0 = np.linalg.inv(truth["bun000.ply"].numpy())
    scans = [io.read(d / f"{k}.ply").points.double().numpy() for k in BUNNY]
    return scans, np.stack([P0 @ truth[k + ".ply"].numpy() for k in BUNNY])


def spread(scans: list[np.ndarray], poses: np.ndarray, bound: float = 0.002
           ) -> tuple[float, float]:
    """Median over scans of the median distance (mm) to the other scans, share within bound."""
    from scipy.spatial import cKDTree

    moved = [s @ poses[k, :3, :3].T + poses[k, :3, 3] for k, s in enumerate(scans)]
    med, within = [], []
    for k in range(len(moved)):
        tree = cKDTree(np.concatenate([m for j, m in enumerate(moved) if j != k]))
        d, _ = tree.query(moved[k], distance_upper_bound=bound, workers=-1)
        ok = np.isfinite(d)
        med.append(float(np.median(d[ok])) * 1e3 if ok.any() else float("nan"))
        within.append(float(ok.mean()))
    return float(np.nanmedian(med)), float(np.mean(within))


def edges_right(edges: list[tuple[int, int, np.ndarray]], truth: np.ndarray) -> int:
    """How many pairwise measurements ``(i, j, T_i_j)`` lie within 1 deg and 3 mm of the truth."""
    good = 0
    for i, j, T in edges:
        rot, trans = metrics.relative_error(T, np.linalg.inv(truth[i]) @ truth[j])
        good += bool(rot < 1.0 and trans < 3e-3)
    return good


def record(rec: Recorder, method: str, poses: np.ndarray, truth: np.ndarray,
           scans: list[np.ndarray], wall: float, **extra) -> None:
    errs = []
    for k, name in enumerate(BUNNY):
        rot, trans = metrics.relative_error(poses[k], truth[k])
        errs.append((float(rot), float(trans) * 1e3))
        rec.add("multiway", method=method, scan=name, rotation_deg=errs[-1][0],
                translation_mm=errs[-1][1])
    sp, within = spread(scans, poses)
    rec.add("multiway", method=method, scan="all", rotation_deg=max(e[0] for e in errs),
            translation_mm=max(e[1] for e in errs),
            within_1deg_3mm=sum(e[0] < 1.0 and e[1] < 3.0 for e in errs), spread_mm=sp,
            within_2mm=within, wall_s=wall, **extra)


def run_ours(rec: Recorder, scans, truth, dev: str, points: int | None,
             threads: int | None) -> None:
    from pointalign import _threads
    from pointalign.registration.multiway import multiway

    x = [torch.from_numpy(s).float() for s in scans]
    kw: dict = {}
    if points:
        x = [datasets.random_subsample(s, points, seed=0) for s in x]
        kw = dict(target_points=1500, hypotheses=2048)
    multiway(x[:2], device=dev, **kw)  # warm-up: compiles (numba, Triton) once per machine
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    with _threads.threads(threads):
        res = multiway(x, device=dev, **kw)
    wall = time.perf_counter() - t
    record(rec, "pointalign" + (f" ({threads} thread{'s' * (threads > 1)})" if threads else ""),
           res.poses, truth, scans, wall, device=dev,
           cpu_threads=threads or _threads.get_num_threads(),
           voxel_mm=res.voxel_size * 1e3, solver=res.solver, edges=len(res.edges),
           kept=sum(e["kept"] for e in res.edges),
           edges_right=edges_right([(e["i"], e["j"], e["transformation"]) for e in res.edges],
                                   truth),
           points=int(sum(s.shape[0] for s in x)),
           timings={k: round(v, 3) for k, v in res.timings.items()})


def _o3d_cloud(points: np.ndarray, v: float):
    import open3d as o3d

    pcd = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(points))
    down = pcd.voxel_down_sample(v)
    down.estimate_normals(o3d.geometry.KDTreeSearchParamHybrid(radius=2 * v, max_nn=30))
    return down


def _o3d_ransac(src, tgt, v: float) -> np.ndarray:
    """Open3D's global registration tutorial: FPFH and RANSAC on feature matches."""
    import open3d as o3d

    reg = o3d.pipelines.registration
    param = o3d.geometry.KDTreeSearchParamHybrid(radius=5 * v, max_nn=100)
    fs, ft = reg.compute_fpfh_feature(src, param), reg.compute_fpfh_feature(tgt, param)
    d = 1.5 * v
    res = reg.registration_ransac_based_on_feature_matching(
        src, tgt, fs, ft, True, d, reg.TransformationEstimationPointToPoint(False), 3,
        [reg.CorrespondenceCheckerBasedOnEdgeLength(0.9),
         reg.CorrespondenceCheckerBasedOnDistance(d)],
        reg.RANSACConvergenceCriteria(100000, 0.999))
    return np.asarray(res.transformation)


def open3d_multiway(scans: list[np.ndarray], v: float, ransac: bool, seed: int = 0
                    ) -> tuple[np.ndarray, list[tuple[int, int, np.ndarray]]]:
    """Open3D's multiway tutorial pipeline.

    Returns the node poses ``T_0_k (S, 4, 4)`` and the pairwise measurements
    ``(i, j, T_i_j)`` (Open3D's edge s -> t maps scan s into scan t: ``T_t_s``).
    """
    import open3d as o3d

    reg = o3d.pipelines.registration
    o3d.utility.random.seed(seed)
    pcds = [_o3d_cloud(s, v) for s in scans]
    coarse, fine = 15 * v, 1.5 * v
    graph = reg.PoseGraph()
    odometry = np.eye(4)
    graph.nodes.append(reg.PoseGraphNode(odometry))
    measured = []
    for s in range(len(pcds)):
        for t in range(s + 1, len(pcds)):
            init = _o3d_ransac(pcds[s], pcds[t], v) if ransac else np.eye(4)
            c = reg.registration_icp(pcds[s], pcds[t], coarse, init,
                                     reg.TransformationEstimationPointToPlane())
            f = reg.registration_icp(pcds[s], pcds[t], fine, c.transformation,
                                     reg.TransformationEstimationPointToPlane())
            T = np.asarray(f.transformation)
            info = reg.get_information_matrix_from_point_clouds(pcds[s], pcds[t], fine, T)
            measured.append((t, s, T))
            if t == s + 1:  # odometry
                odometry = T @ odometry
                graph.nodes.append(reg.PoseGraphNode(np.linalg.inv(odometry)))
                graph.edges.append(reg.PoseGraphEdge(s, t, T, info, uncertain=False))
            else:           # loop closure
                graph.edges.append(reg.PoseGraphEdge(s, t, T, info, uncertain=True))
    option = reg.GlobalOptimizationOption(max_correspondence_distance=fine,
                                          edge_prune_threshold=0.25, reference_node=0)
    with o3d.utility.VerbosityContextManager(o3d.utility.VerbosityLevel.Error):
        reg.global_optimization(graph, reg.GlobalOptimizationLevenbergMarquardt(),
                                reg.GlobalOptimizationConvergenceCriteria(), option)
    return np.stack([np.asarray(n.pose) for n in graph.nodes]), measured


def run_open3d(rec: Recorder, scans, truth, ransac: bool, threads: int) -> None:
    try:
        import open3d as o3d
    except ImportError:
        print("# open3d is not installed; its rows skipped")
        return
    t = time.perf_counter()
    poses, measured = open3d_multiway(scans, TUTORIAL_VOXEL, ransac)
    wall = time.perf_counter() - t
    record(rec, "open3d tutorial" + (" + ransac" if ransac else ""), poses, truth, scans,
           wall, device="cpu", voxel_mm=TUTORIAL_VOXEL * 1e3, solver="open3d LM",
           edges=45, kept=None, edges_right=edges_right(measured, truth),
           points=int(sum(s.shape[0] for s in scans)),
           open3d=o3d.__version__, cpu_threads=threads)


def main() -> None:
    p = parse_args(__doc__.splitlines()[0])
    p.add_argument("--points", type=int, default=None,
                   help="random sample per scan for ours (default: every point; quick 4000)")
    p.add_argument("--threads", type=int, nargs="*", default=None,
                   help="CPU thread counts for ours, one run each (0: pointalign's setting, "
                        "all cores; default 0)")
    p.add_argument("--only", nargs="*", default=None,
                   help="ours open3d open3d_ransac (default: all)")
    args = p.parse_args()
    d = bunny_dir()
    if d is None:
        sys.exit("bench_multiway: the Stanford bunny scans (bun.conf) were not found")
    scans, truth = load(d)
    only = set(args.only or ["ours", "open3d", "open3d_ransac"])
    rec = Recorder("multiway", args.device, title="Multiway: ten bunny scans, ours against "
                   "Open3D's tutorial pipeline", notes=__doc__.split("\n\n")[1])
    threads = os.cpu_count() or 1
    sp, within = spread(scans, truth)
    rec.add("multiway", method="bun.conf (truth)", scan="all", rotation_deg=0.0,
            translation_mm=0.0, spread_mm=sp, within_2mm=within)
    if "ours" in only:
        for n in args.threads or [0]:
            run_ours(rec, scans, truth, args.device,
                     args.points or (4000 if args.quick else None), n or None)
    if "open3d" in only:
        run_open3d(rec, scans, truth, False, threads)
    if "open3d_ransac" in only:
        run_open3d(rec, scans, truth, True, threads)
    rec.save()


if __name__ == "__main__":
    main()
