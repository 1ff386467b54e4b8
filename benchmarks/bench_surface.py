"""Distance-map registration (Zabatani & Bronstein 2012): Fig. 4/5, Tables 1/2, tree build.

Inputs: the bun000 scan upsampled with jitter to N points is the template (target); a second
jittered upsampling moved by a known 10° / 10 mm motion is the query (source). Per size:

* ``build``: k-d tree build, and the per-node approximants (plane, point);
* ``iteration`` (Fig. 4): one fused Newton-terms pass (descent + approximant + reduction),
  and one approximate-ICP correspondence + Horn step;
* ``converge`` (Fig. 5, Table 1, Table 2): time to convergence with the tree reused
  (``index=``) and including its build, iterations, rotation/translation error and the
  paper's ε (``metrics.zabatani_error``) for approximate ICP, Newton point, plane, second
  order, and exact ICP (``pointalign.registration.icp``, when present) as the baseline.

    python benchmarks/bench_surface.py --device cuda          # 1e5, 3e5, 1e6
    python benchmarks/bench_surface.py --device cpu --quick   # smoke run
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_kdtree import upsample  # noqa: E402
from common import Recorder, parse_args, sync, timeit  # noqa: E402

from pointalign import datasets, metrics, transforms  # noqa: E402
from pointalign.kernels import surface as ks  # noqa: E402
from pointalign.registration.criteria import ConvergenceCriteria  # noqa: E402
from pointalign.registration.surface import (  # noqa: E402
    approximant_coefficients,
    approximate_icp,
    surface_newton,
)
from pointalign.search.kdtree import KDTreeIndex  # noqa: E402

CRIT = ConvergenceCriteria(max_iterations=100, relative_rmse=1e-6, rotation_tolerance=1e-6,
                           translation_tolerance=1e-7)


def problem(n: int, seed: int = 0):
    """(source (n, 3), target (n, 3), T_target_source (4, 4) float64), CPU float32."""
    base = datasets.load_bunny("bun000")
    tgt = upsample(base, n, 3e-4, seed)
    g = torch.Generator().manual_seed(seed)
    T = transforms.random_transform(10.0, 0.01, generator=g)
    src = transforms.apply(transforms.invert(T).float(), upsample(base, n, 3e-4, seed + 1))
    return src, tgt, T


def run_size(rec: Recorder, n: int, dev: torch.device, rep: int, warm: int,
             crit: ConvergenceCriteria) -> None:
    """All rows for one size N."""
    src, tgt, T_true = problem(n)
    src_d, tgt_d = src.to(dev), tgt.to(dev)
    # tree build and approximants
    t = timeit(lambda: KDTreeIndex(tgt_d, leaf_size=8), repeat=rep, warmup=warm, device=dev)
    build_ms = t["median_s"] * 1e3
    rec.add(table="build", algorithm="k-d tree build", N=n, ms=build_ms)
    for kind in ("plane", "point", "second_order"):
        def approx(kind=kind):
            tr = KDTreeIndex(tgt_d, leaf_size=8)
            approximant_coefficients(tr, kind)
        t = timeit(approx, repeat=rep, warmup=warm, device=dev)
        rec.add(table="build", algorithm=f"tree + {kind} approximants", N=n,
                ms=t["median_s"] * 1e3)
    tree = KDTreeIndex(tgt_d, leaf_size=8)
    co = approximant_coefficients(tree, "plane")
    approximant_coefficients(tree, "point")
    approximant_coefficients(tree, "second_order")
    o = torch.zeros(3, dtype=torch.float64)
    t = timeit(lambda: ks.newton_terms(src_d, T_true, o, tree.arrays, co, tree.depth),
               repeat=rep, warmup=warm, device=dev)
    rec.add(table="iteration (Fig. 4)", algorithm="Newton terms pass", N=n,
            ms=t["median_s"] * 1e3)
    one = ConvergenceCriteria(max_iterations=1)
    t = timeit(lambda: approximate_icp(src_d, index=tree, criteria=one,
                                       tree_depth=tree.depth), repeat=rep, warmup=warm, device=dev)
    rec.add(table="iteration (Fig. 4)", algorithm="approximate ICP iteration", N=n,
            ms=t["median_s"] * 1e3)
    runs = [
        ("approximate ICP", lambda idx: approximate_icp(src_d, index=idx, criteria=crit)),
        ("Newton point", lambda idx: surface_newton(src_d, index=idx, approximant="point",
                                                    criteria=crit)),
        ("Newton plane", lambda idx: surface_newton(src_d, index=idx, approximant="plane",
                                                    criteria=crit)),
        ("Newton second order", lambda idx: surface_newton(
            src_d, index=idx, approximant="second_order", criteria=crit)),
        # one fixed level (no coarse-to-fine schedule): the paper's setting
        ("Newton plane, fixed depth", lambda idx: surface_newton(
            src_d, index=idx, approximant="plane", criteria=crit,
            tree_depth=idx.depth - 1)),
    ]
    try:
        from pointalign.registration.icp import icp

        runs.append(("ICP (exact, point-to-point)", lambda idx: icp(
            src_d, tgt_d, max_correspondence_distance=0.02, criteria=crit, device=dev)))
    except ImportError:
        pass
    for name, fn in runs:
        res = fn(tree)
        t = timeit(lambda fn=fn: fn(tree), warmup=warm, repeat=rep, device=dev)

        def with_build(fn=fn, name=name):
            tr = KDTreeIndex(tgt_d, leaf_size=8)
            return fn(tr)

        tb = timeit(with_build, warmup=warm, repeat=rep, device=dev)
        sync()
        rec.add(table="converge (Fig. 5, Tables 1-2)", algorithm=name, N=n,
                ms=t["median_s"] * 1e3, ms_incl_build=tb["median_s"] * 1e3,
                iterations=int(res.iterations),
                rot_err_deg=metrics.rotation_error(res.transformation, T_true),
                trans_err_mm=metrics.translation_error(res.transformation, T_true) * 1e3,
                eps=metrics.zabatani_error(res.transformation, T_true))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0]).parse_args()
    dev = torch.device(args.device)
    sizes = [1_500] if args.quick else [100_000, 300_000, 1_000_000]
    rep = 1 if args.quick else 5
    warm = 0 if args.quick else 1
    crit = ConvergenceCriteria(max_iterations=15) if args.quick else CRIT
    rec = Recorder("surface", dev, title="Distance-map registration (Zabatani & Bronstein)",
                   notes="bunny upsampled to N points (template and query), 10°/10 mm motion; "
                         "ms = median wall time; 'incl. build' adds the k-d tree build and "
                         "approximants; errors vs ground truth (ε = paper eq. 21).",
                   columns=["table", "algorithm", "N", "ms", "ms_incl_build", "iterations",
                            "rot_err_deg", "trans_err_mm", "eps"])
    for n in sizes:
        run_size(rec, n, dev, rep, warm, crit)
    rec.save()


if __name__ == "__main__":
    main()
