"""Anderson acceleration of ICP (issue 23): iterations, time and accuracy, plain vs accelerated.

The problems of ``bench_icp.py``'s convergence table: bun045 -> bun000 from the identity
(about 34 deg), and bun000 upsampled to 100k / 1M points moved by 10 deg / 2 cm with 0.5 mm
noise. Point-to-point and point-to-plane, max correspondence distance 5 cm, Open3D's rule
(relative fitness and RMSE 1e-6) with a cap of 100 iterations; each row plain
(``acceleration=False``) and accelerated (``acceleration=True``) side by side. A second
table runs GICP the same way (``gicp(acceleration=)``) on ``bench_gicp.py``'s KITTI pair
(0.25 m voxels and full resolution), its first bunny pair and, on a GPU, its 1M pair.

    python benchmarks/bench_anderson.py                  # CUDA when present: bunny, 100k, 1M
    python benchmarks/bench_anderson.py --device cpu --quick
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_gicp  # noqa: E402
from bench_icp import MAX_DIST, problems  # noqa: E402
from common import Recorder, parse_args, timeit  # noqa: E402

from pointalign import metrics  # noqa: E402
from pointalign.registration.criteria import ConvergenceCriteria  # noqa: E402
from pointalign.registration.gicp import gicp  # noqa: E402
from pointalign.registration.icp import icp  # noqa: E402


def plain_and_accelerated(run, truth, dev: torch.device, quick: bool, **row) -> dict:
    """Time ``run(acceleration)`` plain and accelerated; the row with both sides' columns.

    ``row`` names the problem; its ``n`` (points) decides the repeats.
    """
    big = row["n"] > 200_000
    for label, acc in (("plain", False), ("aa", True)):
        res = run(acc)
        tm = timeit(lambda acc=acc: run(acc), warmup=1,
                    repeat=3 if (quick or big or dev.type == "cpu") else 7, device=dev)
        rot, trans = metrics.relative_error(res.transformation, truth)
        row.update({f"{label}_iterations": res.iterations,
                    f"{label}_stop": res.stop_reason,
                    f"{label}_ms": round(1e3 * tm["median_s"], 2),
                    f"{label}_rot_deg": round(float(rot), 4),
                    f"{label}_trans_mm": round(1e3 * float(trans), 3)})
    row["speedup"] = round(row["plain_ms"] / row["aa_ms"], 2)
    print(row, flush=True)
    return row


def main() -> None:
    args = parse_args(__doc__.splitlines()[0]).parse_args()
    dev = torch.device(args.device)
    rec = Recorder("anderson", dev, title="ICP with Anderson acceleration (issue 23)")
    crit = ConvergenceCriteria(max_iterations=100)
    sizes = ((100_000, "100k"), (1_000_000, "1M")) if dev.type == "cuda" else ((100_000, "100k"),)
    for name, p in problems(args.quick, sizes):
        s, t = p.source.to(dev), p.target.to(dev)
        for method in ("point_to_point", "point_to_plane"):
            def run(acc, method=method, s=s, t=t):
                return icp(s, t, max_correspondence_distance=MAX_DIST, method=method,
                           criteria=crit, device=dev, acceleration=acc)

            rec.add("anderson", **plain_and_accelerated(
                run, p.T_target_source, dev, args.quick, problem=name, n=int(s.shape[0]),
                method=method))
    gicp_rows(rec, dev, crit, args.quick)
    print("wrote", rec.save())


def gicp_rows(rec: Recorder, dev: torch.device, crit: ConvergenceCriteria, quick: bool) -> None:
    """The ``gicp`` table: plain against accelerated GICP on bench_gicp's cases."""
    wanted = ("kitti 00 1->0 (0.25 m)", "kitti 00 1->0 (full)", "bunny 1M 10deg")
    first = True
    for case in bench_gicp.cases(quick, dev.type == "cuda"):
        if not (case.name in wanted or (first and case.name.startswith("bunny"))):
            continue
        first = first and not case.name.startswith("bunny")
        s, t = case.source.to(dev), case.target.to(dev)

        def run(acc, s=s, t=t, case=case):
            return gicp(s, t, init=case.init, max_correspondence_distance=case.dist,
                        k=bench_gicp.K, criteria=crit, device=dev, acceleration=acc)

        rec.add("gicp", **plain_and_accelerated(run, case.truth, dev, quick, problem=case.name,
                                                n=int(s.shape[0]), method="gicp"))


if __name__ == "__main__":
    main()
