"""Generalized ICP and voxelized GICP, side by side with small_gicp and Open3D (issue 24).

Cases (every method gets the same points and the same initial estimate):

* ``bunny A->B ±10°``: Stanford scans (bun045->bun000, bun315->bun000, bun090->bun045,
  bun270->bun315, top2->bun000; ~30-40k points each, not downsampled; only the bundled
  bun045->bun000 without ``../shared/data``), started from the ground truth (bun.conf)
  turned by +10° and by -10° about a seeded random axis. GICP: max correspondence
  distance 5 cm; VGICP: 1 cm voxels.
* ``kitti 00 1->0`` and ``fast_gicp pair`` (``../shared/data/lidar``): both scans voxel
  downsampled to 0.25 m and to 0.1 m (ours, then given to every method) and at full
  resolution (KITTI: ~125k points a scan), started from the identity, errors against the
  reference transforms (KITTI: derived from the odometry poses; fast_gicp pair: fast_gicp's
  ``relative.txt``, and ``alt_*`` against small_gicp's reference, the two differ by
  0.23° / 19 mm). GICP: 1 m; VGICP: 1 m voxels. ``residual_mm``: how well a transform fits
  the scans themselves, independent of any reference: the median distance of the
  full-resolution source points, moved by it, to the plane of their 10 nearest
  full-resolution target points (pairs within 0.5 m); a ``reference`` row gives the
  reference transform's own residual.
* ``bunny 1M 10°``: bun000 upsampled to 1M points (drawn with replacement, 0.5 mm jitter;
  ``bench_icp.upsample``) as the target, the source a copy moved by 10° / 2 cm with 0.5 mm
  noise (``datasets.make_pair``, seed 0). GICP 5 cm, VGICP 1 cm. Left out on the CPU
  unless ``--cpu-1m`` (each peer takes minutes on 2 cores).

Methods: ours (``pointalign.gicp`` / ``vgicp``, k = 20 covariances, on ``--device``),
small_gicp (``align`` with ``GICP`` on its KdTree, and ``VGICP`` on a ``GaussianVoxelMap``;
k = 20 covariances; all cores of the host) and Open3D
(``registration_generalized_icp``, ε = 1e-3, k = 20 covariances; CPU). Each row: total
time of one registration from raw points (median of ``--repeat`` runs after a warm-up:
one call, two on a GPU, whose second captures the kept CUDA graphs),
of which ``cov_ms`` went to the covariances (ours: the ``covariances`` stage of the
result's timings; peers: their covariance estimation timed on its own), iterations,
rotation error (deg) and translation error (mm) against the reference. Stopping rules:
ours and Open3D: relative fitness and RMSE change 1e-6 (Open3D's rule, at most 50
iterations), and ours again with small_gicp's rule (an update below 0.1° and 1 mm, at most
50 iterations), small_gicp: its rule.

    python benchmarks/bench_gicp.py --device cuda          # the GPU run (peers on the host)
    python benchmarks/bench_gicp.py --device cpu --quick   # smoke run, about a minute
    python benchmarks/bench_gicp.py --device cpu           # CPU sizes, with the peers
    python benchmarks/bench_gicp.py --device cpu --threads 2 --repeat 5   # same threads

``--threads N`` runs every method with N threads: ours through ``pointalign.threads``,
small_gicp through its ``num_threads``, Open3D through ``OMP_NUM_THREADS`` (set before any
OpenMP runtime loads, so it also caps PyTorch's pool); without it, all cores. Each row
records the 1-minute load average when it was taken (``load``): on a shared machine other
processes' work shows there, and CPU times under a load above the core count are noisy.
``--label`` names the results file (``gicp_<label>-<device>.json``), e.g. a before/after.
"""

from __future__ import annotations

import math
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Any, NamedTuple


def _early_threads(argv: list[str]) -> None:
    """Set ``OMP_NUM_THREADS`` from ``--threads`` before PyTorch and Open3D load OpenMP."""
    for i, a in enumerate(argv):
        v = a.split("=", 1)[1] if a.startswith("--threads=") else \
            argv[i + 1] if a == "--threads" and i + 1 < len(argv) else None
        if v is not None and v.isdigit():
            os.environ["OMP_NUM_THREADS"] = v


if __name__ == "__main__":
    _early_threads(sys.argv)

# pointalign before PyTorch: its import sets OMP_WAIT_POLICY=PASSIVE for the OpenMP runtime
# (pointalign._threads) only when PyTorch has not loaded it yet. With PyTorch first, the
# runtime's spinning waits made every numba parallel region cost ~16 ms at load 10 on the
# shared 2-core machine (9 µs with PASSIVE): ours took 1.0 s on the KITTI pair, not 0.29 s.
# The peers run in this process under the same setting.
import pointalign  # noqa: E402, I001
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_icp import upsample  # noqa: E402
from common import Recorder, parse_args, small_gicp_steps, sync  # noqa: E402

from pointalign import datasets, io, metrics, transforms  # noqa: E402
from pointalign.features.downsample import voxel_downsample  # noqa: E402
from pointalign.registration.criteria import ConvergenceCriteria  # noqa: E402
from pointalign.registration.gicp import gicp, vgicp  # noqa: E402

K = 20
MAX_ITER = 50
BUNNY_PAIRS = (("bun045", "bun000"), ("bun315", "bun000"), ("bun090", "bun045"),
               ("bun270", "bun315"), ("top2", "bun000"))
OPEN3D_RULE = ConvergenceCriteria(max_iterations=MAX_ITER)
SMALL_GICP_RULE = ConvergenceCriteria(max_iterations=MAX_ITER, relative_fitness=0,
                                      relative_rmse=0, translation_tolerance=1e-3,
                                      rotation_tolerance=math.radians(0.1))
COLUMNS = ["case", "method", "impl", "rule", "n_source", "n_target", "total_ms", "iqr_ms",
           "cov_ms", "iter_ms", "iterations", "converged", "rot_err_deg", "trans_err_mm",
           "alt_rot_err_deg", "alt_trans_err_mm", "residual_mm", "fitness", "load", "note"]
#: threads of every method (None: all cores); set by ``--threads``
THREADS: int | None = None
NOTES = (
    "Time of one registration from raw points (median after a warm-up), covariances "
    "included (cov_ms: their share). Ours on the benchmark device; small_gicp (all cores) "
    "and Open3D on the host CPU. bunny: scan pairs from ground truth ±10°, no downsampling, "
    "GICP 5 cm, VGICP 1 cm voxels; lidar: 0.25 m and 0.1 m voxel-downsampled and full "
    "resolution, from identity, GICP 1 m, VGICP 1 m voxels; residual_mm: median "
    "point-to-plane distance of the full-resolution scans under the transform (a reference "
    "row: the reference transform's); 1M: bun000 upsampled, 10° / 2 cm. Rules: open3d = relative "
    "fitness/RMSE 1e-6; small_gicp = update < 0.1° and 1 mm; at most 50 iterations. "
    "Targets (issue 24, GPU): KITTI pair <= 5 ms, 1M pair <= 50 ms, accuracy >= small_gicp "
    "GICP on every pair; CPU: no slower than small_gicp with the same threads."
)


# ---- cases ------------------------------------------------------------------------------

def _turned(T: np.ndarray, degrees: float, seed: int) -> np.ndarray:
    """``T`` turned by ``degrees`` about a seeded random axis through the target's origin."""
    g = torch.Generator().manual_seed(seed)
    D = transforms.random_transform(abs(degrees), 0.0, generator=g).numpy()
    return (D if degrees > 0 else np.linalg.inv(D)) @ T


def _points(path) -> torch.Tensor:
    return io.read(path).points.to(torch.float32)


class Case(NamedTuple):
    """One registration problem; ``full``: the full-resolution ``(source, target)`` of a
    downsampled LiDAR pair (for ``residual_mm``)."""

    name: str
    source: torch.Tensor
    target: torch.Tensor
    init: np.ndarray
    truth: np.ndarray
    alt: np.ndarray | None
    dist: float
    voxel: float
    full: tuple[torch.Tensor, torch.Tensor] | None = None


def _lidar_cases(name: str, src: torch.Tensor, tgt: torch.Tensor, truth: np.ndarray,
                 alt: np.ndarray | None, quick: bool):
    """The pair downsampled to 0.25 m, 0.1 m and at full resolution, from the identity."""
    for v in ((0.25,) if quick else (0.25, 0.1, None)):
        label = "full" if v is None else f"{v:g} m"
        s, t = (src, tgt) if v is None else (voxel_downsample(src, v), voxel_downsample(tgt, v))
        yield Case(f"{name} ({label})", s, t, np.eye(4), truth, alt, 1.0, 1.0, (src, tgt))


def cases(quick: bool, big: bool):
    """Yield the :class:`Case` s: bunny pairs, LiDAR pairs, the 1M pair (``big``)."""
    data = datasets.shared_data_dir()
    bdir = None if data is None else data / "stanford_bunny" / "data"
    pairs = BUNNY_PAIRS[:1] if quick or bdir is None or not bdir.is_dir() else BUNNY_PAIRS
    for i, (s, t) in enumerate(pairs):
        if bdir is not None and bdir.is_dir():
            src, tgt = _points(bdir / f"{s}.ply"), _points(bdir / f"{t}.ply")
        else:
            src, tgt = datasets.load_bunny(s), datasets.load_bunny(t)
        if quick:
            src = datasets.random_subsample(src, 5000, 0)
            tgt = datasets.random_subsample(tgt, 5000, 1)
        T = datasets.bunny_relative_pose(s, t).numpy()
        for sign in ((1,) if quick else (1, -1)):
            yield Case(f"bunny {s}->{t} {'+' if sign > 0 else '-'}10deg", src, tgt,
                       _turned(T, 10.0 * sign, i), T, None, 0.05, 0.01)
    if data is not None:
        kdir = data / "lidar" / "kitti_00"
        if (kdir / "000000_xyz.bin").is_file():
            def kb(i):
                return torch.from_numpy(np.fromfile(kdir / f"00000{i}_xyz.bin",
                                                    dtype=np.float32).reshape(-1, 3).copy())

            yield from _lidar_cases("kitti 00 1->0", kb(1), kb(0),
                                    np.loadtxt(kdir / "gt_T_velo0_from_velo1.txt"), None,
                                    quick)
        fdir = data / "lidar" / "fast_gicp_pair"
        if not quick and (fdir / "251370668.pcd").is_file():
            yield from _lidar_cases("fast_gicp pair", _points(fdir / "251371071.pcd"),
                                    _points(fdir / "251370668.pcd"),
                                    np.loadtxt(fdir / "relative.txt"),
                                    np.loadtxt(fdir / "small_gicp_T_target_source.txt"), quick)
    if big:
        cloud = upsample(datasets.load_bunny("bun000"), 1_000_000, 5e-4, seed=1_000_000)
        p = datasets.make_pair(cloud, 10.0, 0.02, noise=5e-4, seed=0)
        yield Case("bunny 1M 10deg", p.source, p.target, np.eye(4), p.T_target_source.numpy(),
                   None, 0.05, 0.01)


# ---- timing -----------------------------------------------------------------------------

#: untimed calls before the timed ones on a GPU: the first runs eagerly (compiles, marks
#: its step programs seen), the second captures their kept CUDA graphs, later calls replay
GPU_WARMUP = 2


def _timed(fn, repeat: int, device: str = "cpu") -> tuple[Any, list[float]]:
    """Warm ``fn`` up (once; :data:`GPU_WARMUP` times on a GPU), then run it ``repeat``
    times; return the last output and the times."""
    for _ in range(GPU_WARMUP if device.startswith("cuda") else 1):
        out = fn()
    times = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return out, times


def _iqr(times: list[float]) -> float:
    if len(times) < 2:
        return 0.0
    q = statistics.quantiles(times, n=4)
    return q[2] - q[0]


def _errors(T: Any, case: Case) -> dict[str, Any]:
    T = np.asarray(T, dtype=np.float64)
    if not np.isfinite(T).all():
        return {"note": "returned a non-finite transform"}
    rot, tr = metrics.relative_error(T, case.truth)
    out = {"rot_err_deg": rot, "trans_err_mm": 1e3 * tr}
    if case.alt is not None:
        rot, tr = metrics.relative_error(T, case.alt)
        out |= {"alt_rot_err_deg": rot, "alt_trans_err_mm": 1e3 * tr}
    if case.full is not None:
        out["residual_mm"] = _plane_residual_mm(T, *case.full)
    return out


#: per target (by identity; the tensor is kept, so its id is not reused): its cKDTree and
#: the centroid and normal of each point's 10 nearest
_TARGET_PLANES: dict[int, tuple[torch.Tensor, Any, np.ndarray, np.ndarray]] = {}


def _plane_residual_mm(T: np.ndarray, src: torch.Tensor, tgt: torch.Tensor) -> float:
    """Median distance (mm) of ``T @ src`` to the planes of ``tgt`` (pairs within 0.5 m).

    Each target point's plane: centroid and smallest-eigenvalue direction of its 10 nearest
    target points (float64; SciPy). A data-only check of a transform: no reference needed.
    """
    from scipy.spatial import cKDTree

    key = id(tgt)
    if key not in _TARGET_PLANES:
        t = tgt.double().numpy()
        tree = cKDTree(t)
        _, nb = tree.query(t, 10)
        centred = t[nb] - t[nb].mean(1, keepdims=True)
        _, vecs = np.linalg.eigh(np.einsum("nki,nkj->nij", centred, centred))
        _TARGET_PLANES[key] = (tgt, tree, t[nb].mean(1), vecs[:, :, 0])
    _, tree, centroid, normal = _TARGET_PLANES[key]
    moved = src.double().numpy() @ T[:3, :3].T + T[:3, 3]
    d, j = tree.query(moved, 1, distance_upper_bound=0.5)
    ok = np.isfinite(d)
    dist = np.abs(np.einsum("ni,ni->n", moved[ok] - centroid[j[ok]], normal[j[ok]]))
    return 1e3 * float(np.median(dist))


def reference_row(rec: Recorder, case: Case) -> None:
    """The reference transform's own ``residual_mm`` (a LiDAR case at full resolution)."""
    if case.full is not None and case.name.endswith("(full)"):
        rec.add(case=case.name, method="-", impl="reference transform", rule="-",
                n_source=case.source.shape[0], n_target=case.target.shape[0],
                **_errors(case.truth, case))


# ---- ours -------------------------------------------------------------------------------

def ours(rec: Recorder, case: Case, dev: str, repeat: int) -> None:
    name, src, tgt, init, _, _, dist, voxel, _ = case
    s, t = src.to(dev), tgt.to(dev)
    for method in ("gicp", "vgicp"):
        for rule_name, rule in (("open3d", OPEN3D_RULE), ("small_gicp", SMALL_GICP_RULE)):
            stages: list[dict[str, float]] = []

            def call(method=method, rule=rule, stages=stages):
                if method == "gicp":
                    res = gicp(s, t, init=init, max_correspondence_distance=dist, k=K,
                               criteria=rule, device=dev, num_threads=THREADS)
                else:
                    res = vgicp(s, t, init=init, voxel_size=voxel, k=K, criteria=rule,
                                device=dev, num_threads=THREADS)
                stages.append(res.timings)
                return res

            res, times = _timed(call, repeat, dev)
            timed = stages[-len(times):]  # the warm-ups left out
            rec.add(case=name, method=method.upper(),
                    impl=f"pointalign ({dev}{'' if THREADS is None else f', {THREADS} threads'})",
                    rule=rule_name, n_source=src.shape[0], n_target=tgt.shape[0],
                    total_ms=1e3 * statistics.median(times), iqr_ms=1e3 * _iqr(times),
                    cov_ms=1e3 * statistics.median(x.get("covariances", math.nan)
                                                   for x in timed),
                    iter_ms=1e3 * statistics.median(x.get("iterate", math.nan) for x in timed),
                    iterations=int(res.iterations), converged=bool(res.converged),
                    fitness=float(res.fitness), load=os.getloadavg()[0],
                    **_errors(res.transformation, case))


# ---- small_gicp ---------------------------------------------------------------------------

def small_gicp_rows(rec: Recorder, case: Case, repeat: int) -> None:
    name, src, tgt, init, _, _, dist, voxel, _ = case
    base = dict(case=name, rule="small_gicp", n_source=src.shape[0], n_target=tgt.shape[0])
    try:
        import small_gicp as sg
    except Exception:
        rec.add(**base, method="GICP/VGICP", impl="small_gicp", skipped="not importable")
        return
    threads = THREADS or os.cpu_count() or 1
    s_np, t_np = src.double().numpy(), tgt.double().numpy()

    def covs():
        s, t = sg.PointCloud(s_np), sg.PointCloud(t_np)
        t_tree = sg.KdTree(t, num_threads=threads)
        sg.estimate_covariances(t, t_tree, num_neighbors=K, num_threads=threads)
        sg.estimate_covariances(s, num_neighbors=K, num_threads=threads)
        return s, t, t_tree

    def run_gicp():
        s, t, tree = covs()
        return sg.align(t, s, tree, init_T_target_source=init, registration_type="GICP",
                        max_correspondence_distance=dist, num_threads=threads,
                        max_iterations=MAX_ITER)

    def run_vgicp():
        s, t, _ = covs()
        vm = sg.GaussianVoxelMap(voxel)
        vm.insert(t)
        return sg.align(vm, s, init_T_target_source=init,
                        max_correspondence_distance=dist, num_threads=threads,
                        max_iterations=MAX_ITER)

    _, cov_times = _timed(covs, repeat)
    for method, fn in (("GICP", run_gicp), ("VGICP", run_vgicp)):
        res, times = _timed(fn, repeat)
        rec.add(**base, method=method, impl=f"small_gicp ({threads} threads)",
                total_ms=1e3 * statistics.median(times), iqr_ms=1e3 * _iqr(times),
                cov_ms=1e3 * statistics.median(cov_times),
                iter_ms=1e3 * (statistics.median(times) - statistics.median(cov_times)),
                iterations=small_gicp_steps(res), converged=bool(res.converged),
                load=os.getloadavg()[0],
                fitness=float(res.num_inliers) / max(1, src.shape[0]),
                **_errors(res.T_target_source, case))


# ---- Open3D -------------------------------------------------------------------------------

def open3d_rows(rec: Recorder, case: Case, repeat: int) -> None:
    name, src, tgt, init, _, _, dist, _, _ = case
    base = dict(case=name, method="GICP", rule="open3d", n_source=src.shape[0],
                n_target=tgt.shape[0])
    try:
        import open3d as o3d
    except Exception:
        rec.add(**base, impl="open3d", skipped="not importable")
        return
    reg = o3d.pipelines.registration
    knn = o3d.geometry.KDTreeSearchParamKNN(K)

    def clouds():
        s = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(src.double().numpy()))
        t = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(tgt.double().numpy()))
        s.estimate_covariances(knn)
        t.estimate_covariances(knn)
        return s, t

    crit = reg.ICPConvergenceCriteria(relative_fitness=1e-6, relative_rmse=1e-6,
                                      max_iteration=MAX_ITER)
    est = reg.TransformationEstimationForGeneralizedICP(1e-3)

    def run():
        s, t = clouds()
        return reg.registration_generalized_icp(s, t, dist, init, est, crit)

    _, cov_times = _timed(clouds, repeat)
    res, times = _timed(run, repeat)
    omp = os.environ.get("OMP_NUM_THREADS")
    rec.add(**base, impl=f"open3d {o3d.__version__}" + (f" ({omp} threads)" if omp else ""),
            total_ms=1e3 * statistics.median(times),
            iqr_ms=1e3 * _iqr(times), cov_ms=1e3 * statistics.median(cov_times),
            iter_ms=1e3 * (statistics.median(times) - statistics.median(cov_times)),
            load=os.getloadavg()[0],
            iterations=_open3d_iterations(o3d, run), fitness=float(res.fitness),
            **_errors(res.transformation, case))


def _open3d_iterations(o3d, run) -> int:
    """Iterations of one Open3D run, counted in its debug log (its result has no count)."""
    sys.stdout.flush()
    with tempfile.TemporaryFile() as f:
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        o3d.utility.set_verbosity_level(o3d.utility.VerbosityLevel.Debug)
        try:
            run()
        finally:
            o3d.utility.set_verbosity_level(o3d.utility.VerbosityLevel.Warning)
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        return len(re.findall(rb"ICP Iteration #", f.read()))


def main() -> None:
    global THREADS
    p = parse_args(__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=None, help="timed runs per row (default 5)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads of every method (default: all cores)")
    p.add_argument("--label", default="", help="results file gicp_<label>-<device>.json")
    p.add_argument("--cases", default="",
                   help="only the cases whose name holds one of these comma-separated texts")
    p.add_argument("--cpu-1m", action="store_true", help="the 1M pair on the CPU too")
    p.add_argument("--no-peers", action="store_true", help="ours only")
    a = p.parse_args()
    dev = torch.device(a.device).type
    repeat = a.repeat or (1 if a.quick else 5)
    THREADS = a.threads
    if THREADS is not None:
        pointalign.set_num_threads(THREADS)
    topic = "gicp" + (f"_{a.label}" if a.label else "")
    notes = NOTES + (f" Every method with {THREADS} threads." if THREADS else "") + (
        " iter_ms: ours the iterations' stage; peers: total less covariances.")
    rec = Recorder(topic, a.device, title="GICP and VGICP vs small_gicp and Open3D"
                   + (f" ({a.label})" if a.label else ""), notes=notes, columns=COLUMNS)
    big = not a.quick and (dev == "cuda" or a.cpu_1m)
    for case in cases(a.quick, big):
        if a.cases and not any(c in case[0] for c in a.cases.split(",")):
            continue
        reference_row(rec, case)
        ours(rec, case, a.device, repeat)
        if not a.no_peers:
            small_gicp_rows(rec, case, repeat)
            open3d_rows(rec, case, repeat)
    rec.save()


if __name__ == "__main__":
    main()
