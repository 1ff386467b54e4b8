"""Distance-map registration (Zabatani & Bronstein 2012): Fig. 4, Fig. 5, Tables 1-2, tree build.

Inputs (stated as the issue asks): the bun000 scan upsampled to N points by drawing scan
points with replacement plus 0.3 mm Gaussian jitter is the template (target); a second,
independent upsampling moved by a known 10° / 10 mm motion is the query (source). Sizes
10⁵, 3·10⁵, 5·10⁵, 10⁶ on CUDA. Tables (``tables`` in the JSON):

* ``build``: k-d tree build (leaf 8) and tree + per-node approximants, against template size.
* ``iteration (Fig. 4)``: time of one iteration of each method (Newton: one fused terms pass
  plus the Armijo pass, i.e. two passes; approximate ICP: one cell-mean lookup + Horn;
  exact ICP: one step of ``pointalign.registration.icp``, from a 5-step run). CPU rows (our
  ICP on the CPU, small_gicp ICP on all cores) only at 10⁵ on the CUDA run: larger sizes cost
  more device-machine time than the run may take.
* ``converge (Fig. 5, Tables 1-2)``: time to convergence with the tree reused (``ms``),
  plus the tree + approximant build of the ``build`` table (``ms_incl_build``), iterations
  (Table 1), rotation/translation error and ε (paper eq. 21, ``metrics.zabatani_error``)
  against the ground truth and against exact GPU ICP's result (Table 2). Default
  (float32-aware) stop rules for the surface methods; ICP: relative change 1e-6, at most
  100 iterations.

    python benchmarks/bench_surface.py --device cuda          # 1e5, 3e5, 5e5, 1e6 (< 4 min)
    python benchmarks/bench_surface.py --device cpu --quick   # smoke run (< 1 min)
    python benchmarks/plot_surface.py                          # docs/img/surface_fig{4,5}.png
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_kdtree import upsample  # noqa: E402
from common import Recorder, parse_args, sync, timeit  # noqa: E402

from pointalign import datasets, metrics, transforms  # noqa: E402
from pointalign.registration.criteria import ConvergenceCriteria  # noqa: E402
from pointalign.registration.surface import (  # noqa: E402
    approximant_coefficients,
    approximate_icp,
    surface_newton,
)
from pointalign.search.kdtree import KDTreeIndex  # noqa: E402

ICP_CRIT = ConvergenceCriteria(max_iterations=100, relative_rmse=1e-6, relative_fitness=1e-6)
ICP_DIST = 0.02  # metres: the 10 mm motion moves bunny points by up to ~25 mm
CPU_MAX_N = 100_000


def problem(n: int, seed: int = 0):
    """(source (n, 3), target (n, 3), T_target_source (4, 4) float64), CPU float32."""
    base = datasets.load_bunny("bun000")
    tgt = upsample(base, n, 3e-4, seed)
    g = torch.Generator().manual_seed(seed)
    T = transforms.random_transform(10.0, 0.01, generator=g)
    src = transforms.apply(transforms.invert(T).float(), upsample(base, n, 3e-4, seed + 1))
    return src, tgt, T


def _icp():
    try:
        from pointalign.registration.icp import icp
    except ImportError:
        return None
    return icp


def _small_gicp():
    try:
        import small_gicp
    except Exception:
        return None
    return small_gicp


def run_size(rec: Recorder, n: int, dev: torch.device, rep: int, warm: int,
             with_cpu: bool) -> None:
    """All rows for one size N."""
    src, tgt, T_true = problem(n)
    src_d, tgt_d = src.to(dev), tgt.to(dev)
    # ---- tree build and approximants (vs template size)
    t = timeit(lambda: KDTreeIndex(tgt_d, leaf_size=8), repeat=rep, warmup=warm, device=dev)
    tree = KDTreeIndex(tgt_d, leaf_size=8)
    rec.add(table="build", algorithm="k-d tree build", N=n, depth=tree.depth,
            ms=t["median_s"] * 1e3, iqr_ms=t["iqr_s"] * 1e3)
    build_ms = {}
    for kind in ("plane", "point", "second_order"):
        def approx(kind=kind):
            approximant_coefficients(KDTreeIndex(tgt_d, leaf_size=8), kind)
        t = timeit(approx, repeat=rep, warmup=warm, device=dev)
        build_ms[kind] = t["median_s"] * 1e3
        rec.add(table="build", algorithm=f"tree + {kind} approximants", N=n, depth=tree.depth,
                ms=t["median_s"] * 1e3, iqr_ms=t["iqr_s"] * 1e3)
    build_ms["mean"] = build_ms["point"]  # cell means cost no more than the point approximant
    for kind in ("plane", "point", "second_order"):
        approximant_coefficients(tree, kind)
    icp = _icp()
    # ---- converge (Fig. 5, Tables 1-2)
    runs = [
        ("approximate ICP", "mean", lambda idx: approximate_icp(src_d, index=idx)),
        ("Newton point", "point",
         lambda idx: surface_newton(src_d, index=idx, approximant="point")),
        ("Newton plane", "plane",
         lambda idx: surface_newton(src_d, index=idx, approximant="plane")),
        ("Newton second order", "second_order",
         lambda idx: surface_newton(src_d, index=idx, approximant="second_order")),
    ]
    if icp is not None:  # builds its own search index inside every call
        runs.insert(0, ("GPU ICP (exact)" if dev.type == "cuda" else "ICP (exact)", None,
                        lambda idx: icp(src_d, tgt_d, max_correspondence_distance=ICP_DIST,
                                        criteria=ICP_CRIT, device=dev)))
    ref_T = None
    per_iter = {}
    for name, kind, fn in runs:
        res = fn(tree)
        t = timeit(lambda fn=fn: fn(tree), warmup=0, repeat=rep, device=dev)
        tb = {"median_s": t["median_s"] + (build_ms[kind] / 1e3 if kind else 0.0)}
        if ref_T is None and "exact" in name:
            ref_T = res.transformation
        it = max(int(res.iterations), 1)
        per_iter[name] = t["median_s"] * 1e3 / it
        rec.add(table="converge (Fig. 5, Tables 1-2)", algorithm=name, N=n,
                ms=t["median_s"] * 1e3, ms_incl_build=tb["median_s"] * 1e3,
                iterations=int(res.iterations), stop=res.stop_reason,
                rot_err_deg=metrics.rotation_error(res.transformation, T_true),
                trans_err_mm=metrics.translation_error(res.transformation, T_true) * 1e3,
                eps_vs_truth=metrics.zabatani_error(res.transformation, T_true),
                eps_vs_exact_icp=(metrics.zabatani_error(res.transformation, ref_T)
                                  if ref_T is not None else float("nan")))
    # ---- one iteration (Fig. 4)
    one = ConvergenceCriteria(max_iterations=1)
    iters = [("approximate ICP", lambda: approximate_icp(src_d, index=tree, criteria=one,
                                                         tree_depth=tree.depth - 3))]
    for kind, name in (("point", "Newton point"), ("plane", "Newton plane"),
                       ("second_order", "Newton second order")):
        iters.append((name, lambda kind=kind: surface_newton(
            src_d, index=tree, approximant=kind, criteria=one, tree_depth=tree.depth - 3)))
    for name, fn in iters:
        t = timeit(fn, warmup=warm, repeat=rep, device=dev)
        rec.add(table="iteration (Fig. 4)", algorithm=name, N=n, device=dev.type,
                ms=t["median_s"] * 1e3, ms_per_iter_in_convergence=per_iter.get(name))
    if icp is not None:
        five = ConvergenceCriteria(max_iterations=5, relative_rmse=0, relative_fitness=0,
                                   rotation_tolerance=0, translation_tolerance=0)
        t = timeit(lambda: icp(src_d, tgt_d, max_correspondence_distance=ICP_DIST,
                               criteria=five, device=dev), warmup=warm, repeat=rep, device=dev)
        name = "GPU ICP (exact)" if dev.type == "cuda" else "ICP (exact)"
        rec.add(table="iteration (Fig. 4)", algorithm=name, N=n, device=dev.type,
                ms=t["median_s"] * 1e3 / 5, ms_per_iter_in_convergence=per_iter.get(name))
    if not with_cpu:
        return
    # ---- CPU anchors (Fig. 4 speed-up): our ICP on the CPU, small_gicp on all cores
    if icp is not None:
        five = ConvergenceCriteria(max_iterations=5, relative_rmse=0, relative_fitness=0,
                                   rotation_tolerance=0, translation_tolerance=0)
        t0 = time.perf_counter()
        r = icp(src, tgt, max_correspondence_distance=ICP_DIST, criteria=five, device="cpu")
        el = time.perf_counter() - t0
        rec.add(table="iteration (Fig. 4)", algorithm="CPU ICP (ours)", N=n, device="cpu",
                ms=el * 1e3 / max(int(r.iterations), 1),
                threads=torch.get_num_threads())
    sg = _small_gicp()
    if sg is None:
        rec.add(table="iteration (Fig. 4)", algorithm="small_gicp ICP", N=n, device="cpu",
                skipped="small_gicp not importable")
        return
    s_np, t_np = src.double().numpy(), tgt.double().numpy()
    threads = os.cpu_count() or 1
    s_pc, t_pc = sg.PointCloud(s_np), sg.PointCloud(t_np)
    t0 = time.perf_counter()
    sg_tree = sg.KdTree(t_pc, num_threads=threads)
    el_tree = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = sg.align(t_pc, s_pc, sg_tree, init_T_target_source=np.eye(4),
                   registration_type="ICP", max_correspondence_distance=ICP_DIST,
                   num_threads=threads, max_iterations=100)
    el = time.perf_counter() - t0
    its = max(int(res.iterations), 1)
    rec.add(table="iteration (Fig. 4)", algorithm="small_gicp ICP", N=n, device="cpu",
            ms=1e3 * el / its, threads=threads,
            note="converged run / iterations, k-d tree prebuilt")
    el += el_tree
    T_sg = np.asarray(res.T_target_source)
    rec.add(table="converge (Fig. 5, Tables 1-2)", algorithm="small_gicp ICP (CPU)", N=n,
            ms=(el - el_tree) * 1e3, ms_incl_build=el * 1e3, iterations=its,
            stop="converged" if res.converged else "max_iterations",
            rot_err_deg=metrics.rotation_error(T_sg, T_true),
            trans_err_mm=metrics.translation_error(T_sg, T_true) * 1e3,
            eps_vs_truth=metrics.zabatani_error(T_sg, T_true),
            eps_vs_exact_icp=(metrics.zabatani_error(T_sg, ref_T) if ref_T is not None
                              else float("nan")))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0]).parse_args()
    dev = torch.device(args.device)
    sizes = [2_000] if args.quick else [100_000, 300_000, 500_000, 1_000_000]
    rep = 1 if args.quick else 3
    warm = 0 if args.quick else 1
    rec = Recorder("surface", dev, title="Distance-map registration (Zabatani & Bronstein)",
                   notes="bun000 upsampled to N points with 0.3 mm jitter (template and query "
                         "independently), 10°/10 mm motion; ms = median wall time (CUDA "
                         "events); 'incl. build' adds the measured tree + approximant build; "
                         "ε = paper eq. 21 against the truth and against exact ICP. CPU "
                         f"anchors (our ICP, small_gicp all cores) at N <= {CPU_MAX_N} only.",
                   columns=["algorithm", "N"])
    t0 = time.perf_counter()
    for n in sizes:
        run_size(rec, n, dev, rep, warm, with_cpu=n <= CPU_MAX_N)
        sync()
        print(f"# N={n} done at {time.perf_counter() - t0:.1f} s", flush=True)
    summarise(rec)
    rec.save()


def summarise(rec: Recorder) -> None:
    """Paper-style Tables 1 and 2: per method, averaged over the sizes run."""
    rows = rec.tables.get("converge (Fig. 5, Tables 1-2)", [])
    names = list(dict.fromkeys(r["algorithm"] for r in rows))
    for name in names:
        rs = [r for r in rows if r["algorithm"] == name]

        def mean(key, rs=rs):
            v = [float(r[key]) for r in rs if r.get(key) == r.get(key)]
            return sum(v) / len(v) if v else float("nan")

        rec.add(table="Tables 1-2 (mean over sizes)", algorithm=name,
                sizes=",".join(f"{r['N']:.0e}" for r in rs),
                iterations=mean("iterations"), eps_vs_truth=mean("eps_vs_truth"),
                eps_vs_exact_icp=mean("eps_vs_exact_icp"),
                converged_runs=f"{sum(r['stop'] != 'max_iterations' for r in rs)}/{len(rs)}")


if __name__ == "__main__":
    main()
