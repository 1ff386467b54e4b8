"""Quick look: the library's main operations at CPU-friendly sizes, in one process (< 1 min).

What ``pointalign bench --quick`` runs by default: a user's first look at the speed on their
own machine, not a record (nothing is written to ``benchmarks/results`` unless
``POINTALIGN_BENCH_RESULTS`` says where). One row per operation, each timed after one
warm-up call, the median of up to 3 calls within a per-row budget (``timeit`` of
common.py; a row whose first call is slow is timed once):

* ``k-NN k=1`` / ``k-NN k=8``: ``build_index`` + ``knn`` on N = 50,000 uniform points in the
  unit cube, N queries (a copy jittered by 1e-3); peer SciPy's ``cKDTree`` (build + query,
  all cores); check: largest distance difference from SciPy's.
* ``voxel + normals + FPFH``: bun000 (bundled, 40,256 points) downsampled at 3 mm, normals
  within 6 mm, FPFH within 15 mm; peer Open3D (if installed), same steps and radii.
* ``ICP point-to-plane``: bun045 -> bun000 from the ground truth moved by 3 deg / 5 mm, max
  distance 1 cm, until convergence (Open3D's relative-change rule); peer Open3D's
  ``registration_icp`` (if installed) with the same criteria, its target normals (30
  nearest) timed with it; check: iterations and rotation error (deg).
* ``register()``: bun045 -> bun000 from the identity (about 34 deg), default settings, one
  call (no warm-up: the longest row, about a third of the run on a 2-core CPU); check:
  rotation error (deg) against bun.conf.

``POINTALIGN_BENCH_SCALE`` (default 1) multiplies the point counts and
``POINTALIGN_BENCH_STEPS`` picks rows (``knn,features,icp,register``; the test suite runs
``knn`` at 0.01); ``POINTALIGN_OPEN3D=0`` leaves the Open3D columns out. ``--quick`` is
accepted and changes nothing (the sizes are already small).

    python benchmarks/bench_quick.py --device cpu
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Recorder, parse_args, progress, timeit  # noqa: E402

import pointalign as pa  # noqa: E402
from pointalign import datasets, metrics, transforms  # noqa: E402

#: seconds of timed calls per row (after the warm-up); a call slower than this runs once
ROW_BUDGET_S = 2.0


def _time(fn, device, warmup: bool = True) -> dict[str, float]:
    if not warmup:  # one call, first-call costs included (the row says so)
        return timeit(fn, warmup=0, repeat=1, device=device)
    t0 = time.perf_counter()
    fn()  # warm-up (first-call costs: imports, JIT, caches)
    first = time.perf_counter() - t0
    repeat = 1 if first > ROW_BUDGET_S / 3 else 3
    return timeit(fn, warmup=0, repeat=repeat, device=device)


def _row(rec: Recorder, operation: str, size: str, ours: dict[str, float],
         peer: str = "", peer_s: float | None = None, check: str = "") -> None:
    ms = 1e3 * ours["median_s"]
    rec.add(operation=operation, size=size, pointalign_ms=round(ms, 2),
            peer=peer, peer_ms=None if peer_s is None else round(1e3 * peer_s, 2),
            ratio=None if peer_s is None else round(ms / (1e3 * peer_s), 2), check=check)


def _open3d():
    if os.environ.get("POINTALIGN_OPEN3D", "1") == "0":
        return None
    try:
        import open3d as o3d
    except Exception:  # not installed, or a broken install
        return None
    return o3d


def knn_rows(rec: Recorder, dev: str, n: int) -> None:
    from scipy.spatial import cKDTree

    g = torch.Generator().manual_seed(0)
    pts = torch.rand(n, 3, generator=g).to(dev)
    q = (pts + 1e-3 * torch.randn(n, 3, generator=g).to(dev)).contiguous()
    pn, qn = pts.cpu().numpy(), q.cpu().numpy()
    for k in (1, 8):
        def ours(k=k):
            return pa.build_index(pts).knn(q, k)

        tm = _time(ours, dev)
        d_ours = ours().dists.reshape(n, k).sqrt().cpu().numpy().astype(np.float64)
        peer = _time(lambda k=k: cKDTree(pn).query(qn, k=k, workers=-1), "cpu")
        d_ref = cKDTree(pn).query(qn, k=k, workers=-1)[0].reshape(n, k)
        err = float(np.abs(d_ours - d_ref).max())
        _row(rec, f"k-NN k={k}, build + query", f"{n:,}", tm, "scipy cKDTree",
             peer["median_s"], f"max diff {err:.0e}")


def feature_rows(rec: Recorder, dev: str, pts: torch.Tensor, o3d) -> None:
    v = 0.003
    pts = pts.to(dev)

    def ours():
        down = pa.voxel_downsample(pts, v)
        nrm = pa.estimate_normals(down, radius=2 * v, k=30)
        return pa.fpfh(down, radius=5 * v, normals=nrm)

    tm = _time(ours, dev)
    peer_s, note = None, ""
    if o3d is not None:
        cloud = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(pts.cpu().double().numpy()))

        def theirs():
            d = cloud.voxel_down_sample(v)
            d.estimate_normals(o3d.geometry.KDTreeSearchParamHybrid(radius=2 * v, max_nn=30))
            return o3d.pipelines.registration.compute_fpfh_feature(
                d, o3d.geometry.KDTreeSearchParamHybrid(radius=5 * v, max_nn=100))

        peer_s = _time(theirs, "cpu")["median_s"]
        note = f"{ours().shape[0]:,} vs {theirs().data.shape[1]:,} points"
    _row(rec, "voxel + normals + FPFH", f"{pts.shape[0]:,}", tm,
         "open3d" if o3d is not None else "", peer_s, note)


def icp_rows(rec: Recorder, dev: str, pair, o3d) -> None:
    T_true = torch.as_tensor(pair.T_target_source)
    turn = transforms.axis_angle_to_matrix(torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64),
                                           float(np.radians(3.0)))
    nudge = transforms.make(turn, torch.tensor([0.005, 0.0, 0.0], dtype=torch.float64))
    init = (nudge @ T_true).numpy()
    src, tgt = pair.source.to(dev), pair.target.to(dev)
    res = {}

    def ours():
        res["r"] = pa.icp(src, tgt, init=init, max_correspondence_distance=0.01,
                          method="point_to_plane",
                          criteria=pa.ConvergenceCriteria(max_iterations=50))
        return res["r"]

    tm = _time(ours, dev)
    rot, _ = metrics.relative_error(res["r"].transformation, T_true.numpy())
    peer_s, note = None, f"{int(res['r'].iterations)} it., {rot:.3f} deg"
    if o3d is not None:
        reg = o3d.pipelines.registration
        s = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(pair.source.double().numpy()))
        t = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(pair.target.double().numpy()))

        def theirs():
            t.estimate_normals(o3d.geometry.KDTreeSearchParamKNN(30))
            return reg.registration_icp(s, t, 0.01, init,
                                        reg.TransformationEstimationPointToPlane(),
                                        reg.ICPConvergenceCriteria(1e-6, 1e-6, 50))

        peer_s = _time(theirs, "cpu")["median_s"]
        rot_o, _ = metrics.relative_error(np.asarray(theirs().transformation), T_true.numpy())
        note += f" (open3d {rot_o:.3f})"
    _row(rec, "ICP point-to-plane + normals", f"{pair.source.shape[0]:,}", tm,
         "open3d" if o3d is not None else "", peer_s, note)


def register_row(rec: Recorder, dev: str, pair) -> None:
    src, tgt = pair.source.to(dev), pair.target.to(dev)
    res = {}

    def ours():
        res["r"] = pa.register(src, tgt, device=dev)

    tm = _time(ours, dev, warmup=False)  # the longest row: one call
    rot, _ = metrics.relative_error(res["r"].transformation, pair.T_target_source.numpy())
    verdict = "trusted" if res["r"].converged else "not trusted"
    _row(rec, "register() from identity, 1 call", f"{pair.source.shape[0]:,}", tm,
         check=f"{rot:.3f} deg, {verdict}")


def _subsample(points: torch.Tensor, scale: float) -> torch.Tensor:
    n = max(200, int(points.shape[0] * scale))
    return points if n >= points.shape[0] else datasets.random_subsample(points, n)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0]).parse_args()
    dev = args.device
    scale = float(os.environ.get("POINTALIGN_BENCH_SCALE", "1"))
    if not (0 < scale <= 1):
        raise SystemExit(f"POINTALIGN_BENCH_SCALE: expected a number in (0, 1], got {scale}")
    rec = Recorder("quick", dev, title="Quick look (pointalign bench --quick)",
                   notes=__doc__.split("\n\n")[1],
                   columns=["operation", "size", "pointalign_ms", "peer", "peer_ms", "ratio",
                            "check"])
    o3d = _open3d() if torch.device(dev).type == "cpu" else None
    pair = datasets.load_bunny_pair()
    if scale < 1:
        pair = dataclasses.replace(pair, source=_subsample(pair.source, scale),
                                   target=_subsample(pair.target, scale))
    every = {"knn": lambda: knn_rows(rec, dev, max(500, int(50_000 * scale))),
             "features": lambda: feature_rows(rec, dev, pair.target, o3d),
             "icp": lambda: icp_rows(rec, dev, pair, o3d),
             "register": lambda: register_row(rec, dev, pair)}
    names = [s for s in os.environ.get("POINTALIGN_BENCH_STEPS", "").split(",") if s]
    unknown = sorted(set(names) - set(every))
    if unknown:
        raise SystemExit(f"POINTALIGN_BENCH_STEPS: unknown {unknown}; known: {list(every)}")
    steps = [every[s] for s in names or every]
    for i, step in enumerate(progress(steps, "quick benchmark")):
        n, c0, t0 = len(rec.rows), time.process_time(), time.perf_counter()
        step()
        # the noise of a shared machine, with every row: CPU seconds of the whole step
        # (warm-up included), its wall seconds and the 1-minute load average
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        print(f"# step {i + 1}/{len(steps)}: rows {n}-{len(rec.rows) - 1}: wall {wall:.1f} s, "
              f"cpu {cpu:.1f} s, load {os.getloadavg()[0]:.1f}", flush=True)
    if os.environ.get("POINTALIGN_BENCH_RESULTS"):
        rec.save()


if __name__ == "__main__":
    main()
