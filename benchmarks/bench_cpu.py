"""CPU: pointalign's "cpu" backend against Open3D and small_gicp, in the same run.

Rows (bun045 -> bun000, 40,097 -> 40,256 points, from the identity, 5 cm):

* ``icp_p2p``: point-to-point ICP, 30 fixed iterations (tolerances 0), plain as the peers'
  (``acceleration=False``; accelerated, icp() converges in fewer: ``bench_anderson.py``).
  Ours: ``pa.icp`` (index built inside the call). Open3D: ``registration_icp`` (its
  KDTreeFlann built inside the call). small_gicp: ``align`` ``ICP`` with all cores, its k-d
  tree built inside.
* ``icp_p2pl``: point-to-plane, 30 fixed iterations, target normals included (ours: k = 20
  inside ``pa.icp``; Open3D: ``estimate_normals`` hybrid 1 cm / 20 then ``registration_icp``;
  small_gicp: ``PLANE_ICP`` with its own normals, k = 20 by default in its preprocessing).
* ``register``: global + local from the identity at voxel 2.54 mm: ``pa.register`` against
  Open3D's tutorial pipeline (voxel_down_sample, normals 2v/30, FPFH 5v/100, RANSAC
  mutual-free 1.5v with the edge-length/distance checkers, 100000 / 0.999, then
  point-to-plane ICP at 0.4v on the downsampled clouds) and small_gicp's GICP alone
  (``align`` GICP, downsampling 2.54 mm, which is a local method: it needs no features but
  converges from the identity only because this pair starts within its basin).
* ``emicp``: ``pa.emicp`` end to end on the 40k pair on the "cpu" backend, default
  schedule (σ₀ = 0.949ρ → 0.03ρ, 66 iterations, d₀ = 1.78ρ), the form chosen automatically
  (``approximation="auto"``: cells of 0.4σ and truncation at 4σ above a few seconds of exact
  work; ``info["approximation"]`` is recorded), after one warm-up run (numba compilation).
* ``softassign``: ``pa.softassign`` end to end on 2000 x 2000 random points of the pair,
  the seed's schedule (100 temperatures x 5 updates x 3 Sinkhorn rounds), the form chosen
  automatically ("cells": Sinkhorn on cells of 0.5σ, σ = 1/√(2β), while they merge points,
  truncated at the 1e-2 normaliser radius; then per point with the 1e-4 normaliser bound;
  ``info["approximation"]`` records the phases and the passes of each form); one run after
  the warm-up. Profile of the per-point "truncated" form it replaces (issue 14, 2-core
  machine at load 5-8, so the absolute wall times are inflated 10x; 50.5 s quiet): its
  radius k = 5.8 (1e-4 bound, +α) exceeds the bunny for the first ~30 temperatures (100 %
  of the pairs kept, 3.2e9 of the run's 4.4e9 pair terms), > 50 % up to temperature ~35,
  ~1-5 % over the last 40 (where the 3,000 passes' fixed costs dominate); PyTorch on 2
  threads paid an OpenMP fork/join per small op between the passes (weighted Horn on 2k
  points 13.5 ms of CPU against 1.4 ms on one thread under load), so the host ops of the
  CPU programs now run on one PyTorch thread. The "cells" form (2,790 cell passes, 210
  per-point passes) computes each update's ~1.9e5 cell-pair kernel values once (sparse) and
  runs its 6 Sinkhorn passes as products with them: 11.2 s of CPU on one thread (load 7;
  21.7 s when each pass recomputed its kernel values, 179 CPU-s for the truncated form on 2
  threads at load 5-8), and lands within 1e-5° / 1e-8 m of the truncated form's pose
  (0.647° / 0.59 mm from the ground truth for both). Each pose update of the cells phase
  now runs as one call (``kernels.soft.cpu_cells.softassign_update``: no per-pass keys, checks and
  conversions, ~2 ms each before; the kernel matrix filtered from candidate pairs reused
  across a cell level's updates instead of two tree walks per update; pose bit-identical):
  6.1-6.5 s of CPU on one thread at load 3.4-3.6 where the same script measured 8.0-9.1 s
  before (2k x 2k, seed schedule; numba kernels ~4.0 s of it: the exps of the matrices
  ~1.9 s, the passes ~1.1 s, the 210 per-point passes ~0.5 s).
* ``surface_newton`` on the fast_gicp LiDAR pair (69,792 -> 69,088 points, from the
  identity, plane approximant, default schedule) with Open3D point-to-plane ICP and
  small_gicp PLANE_ICP on the same clouds for context (:func:`surface_rows`); ``--slow``
  adds one run on the PyTorch reference backend and the cpu-vs-reference pose difference.
  A second ours row truncates at 1 m, as the peers do (docs/surface-methods.md: without a
  truncation the partial overlap and the ~5k invalid returns at (0, 0, 0) of each scan
  pull the pose 0.78° / 50 mm off relative.txt).
* ``approximate_icp`` (:func:`approximate_icp_rows`, run with ``--only surface`` or
  ``--only aicp``): the LiDAR pair (no truncation and 1 m, beside the surface rows' peers)
  and the bunny pair (bun045 -> bun000), from the identity, default schedule; ``--slow``
  adds one run each on the PyTorch reference backend (the "before": the torch move,
  descent and reduction of ``CellMeanStep``). The "cpu" backend runs one fused numba pass
  a step (``kernels/surface/cpu.py``, ``cell_mean_sums``).

Every row records wall time, this process's CPU time (all its threads, peers' OpenMP
threads included: a load-robust measure) and ``os.getloadavg()`` before the row: the
machine is shared, so compare rows of one run only.

Profile of the original CPU path (before this backend; cProfile, ICP p2p 30 iterations,
2-core machine under load 1.4, 303 ms per iteration): SciPy cKDTree queries 114 ms (its
far-from-surface queries visit hundreds of leaves; 1.0-1.7 s for the first iteration's
queries alone at the identity), the result post-processing in ``CKDTreeIndex._query``
(gathers, distance recomputation, ``where``) ~40 ms, the float64 reference reduction
``normal_equations_reference`` 104 ms (nine (B, N, ·) temporaries), the rest (baddbmm
moving the source, the 4×4 eigh solve, copies) ~15 ms. With the "cpu" backend (numba k-d
tree with tight boxes and the last correspondence as a bound; one fused reduction pass),
one thread, the same run: search 29 ms per iteration on average (67 ms at the identity,
~19 ms once converged), reduction 1.4 ms, moving the source ~7 ms (torch baddbmm in
``registration/icp.py``), solve ~4 ms.

Profile of ``register()`` on the CPU (issue 14; cProfile with ``time.process_time`` as its
clock, ``pa.set_num_threads(1)``, bun045 -> bun000 at v = 2.54 mm, 4,496 / 4,695 points
after downsampling; the shared 2-core machine at load 10-12, so absolute numbers are
inflated, proportions are not). Before the kernels below: 4.7 s of CPU per call
(``feature_knn_reference``: cdist + topk, 3 calls, ~1.2 s; ``spfh_reference`` +
``fpfh_combine_reference`` ~1.6 s with their (chunk, K, ·) temporaries; the rest mostly
PyTorch's OpenMP threads spinning: numba's pool start reset ``torch.set_num_threads(1)`` to
2, see ``_threads._launch_numba``). After (0.95-1.05 s of CPU per call; Open3D's tutorial
pipeline under ``OMP_NUM_THREADS=1`` in the same minutes 0.63-0.74 s, of which its FPFH
0.39-0.45 s and RANSAC 0.19-0.22 s):

* feature-space kNN (``kernels/ransac/cpu.py``, fused, no N×M matrix): 0.24 s for its 3
  calls (RANSAC's correspondences k = 1, and ``rank_correspondences``' k = 2 forward and
  k = 1 backward);
* inlier scoring (``kernels/ransac/score_cpu.py`` cell grid behind the host tree): 0.15 s
  for ~620k queries
  (RANSAC score 2 × 145k, refine 3 × 18k, the robust stage's 65 candidates × 4.5k = 292k;
  the k-d tree took 0.41 s for the same queries) + hinted ICP queries 0.09 s;
* radius kNN (5v / 100 per downsampled cloud, stray-point counts): 0.12 s;
* SPFH + combine (``kernels/features/fpfh_cpu.py``): 0.08 s (the references: ~1.6 s);
* compatibility hypotheses 0.08 s, tree builds 0.04 s (plus 0.03 s of SciPy cKDTrees that the
  "cpu" backend never queries: ``search/ckdtree.py`` builds one per index), downsample and
  normals ~0.03 s each, the final point-to-plane ICP on the full clouds ~0.15 s;
* later (regcpu3; 1 thread, CPU time, load 5-6, same minutes, ``POINTALIGN_NUM_THREADS=1
  OMP_NUM_THREADS=1 --only register``): main 0.77-0.83 s, this branch 0.71-0.72 s, Open3D
  0.61-0.67 s. The scoring grid reads each cell's candidates in order of distance from the
  cell's centre and stops once no later one can be nearer (0.22 -> 0.13 s of CPU at load
  9 for the same 668k queries, moving the points included; the 65 compatibility
  hypotheses are mostly right poses, whose queries scanned whole cells); the second-order
  compatibility ``A ⊙ (A A)`` by bit sets (25 -> 7 ms); the full target's index serves the
  stray count and the final ICP (one 40k build less). Left: feature kNN ~0.08 s (a variant
  sorted along the features' principal axis u, skipping tiles by ``|q·u − r·u|``, took
  0.055 s forward + 0.053 s backward: more than the fused two-way pass's 0.08 s; not
  kept), SPFH ~0.07 s, radius kNN 5v/100 ~0.05 s, the full target's k = 16 normals ~0.08 s and
  full-cloud ICP searches ~0.08 s (Open3D's pipeline runs ICP on the downsampled clouds).
  Under load with 2 threads, small PyTorch ops (sort, baddbmm, sums) cost 10-50x their
  1-thread CPU time (barrier waits when a thread is descheduled): 1.75 s of CPU at load 7.5.
* tranche 2, session 4 (quiet, 2 threads, bun045 -> bun000 at 2.54 mm; stage wall / CPU ms
  from ``result.timings`` and ``time.process_time``): before, 0.42-0.48 s wall / 0.63-0.70 s
  CPU (Open3D's pipeline 0.29-0.35 s / 0.55-0.67 s in the same minutes), of which wall
  feature kNN 58, the three self-queries 52, scoring 36 + ``baddbmm`` moves 32, SPFH 35,
  Horn's batched ``eigh`` + moments 24, the coarse batched ICP's unhinted-then-hinted searches
  (no shortcut lists on the downsampled target) ~30; about 0.21 s of the wall was serial
  (PyTorch on one thread). After: feature kNN four dimensions per pass over a tile with the
  row tests and backward minima vectorised (75 -> 46 ms of CPU, bit-equal); keyed
  (``bits(d²) << 32 | index``) k-NN lists and a polynomial arctangent for SPFH's alpha bin
  with the exact ``atan2`` near bin edges (-25 % and -20 %, bit-equal); moves and scoring in
  one numba pass (``_score``: ``_score`` CPU per call 105 -> 56 ms; counts-only scoring stops
  at the first point within the bound); Horn by cyclic Jacobi in numba (35-46 -> 9-10 ms);
  the FPFH 5v neighbourhoods kept as the downsampled target's shortcut lists (a bounded
  self-query's short rows take the tree: the coarse ICP stage 94 -> 69 ms of CPU); an
  unhinted nearest query starts from its predecessor's answer (ICP's first, Morton-ordered
  search 16.4 -> 11.7 ms); the compatibility graph's lengths computed pair by pair in its
  bit-set kernel (no ``cdist``: 23.9 -> 15.4 ms). register: 0.25-0.33 s wall / 0.39-0.51 s
  CPU against Open3D's 0.27-0.35 s / 0.51-0.67 s in the same runs (same poses as before,
  bit for bit on the bunny pair, up to 3e-15 where Horn's rounding changed).
* first call in a fresh process: numba compiles the register path's kernels once (~50 s of
  CPU at load 12 with an empty cache; ``cache=True`` stores them under ``__pycache__``), then
  loading the cache costs ~0.7 s of CPU on the first call of each later process.

Point-to-plane ICP (30 iterations, one thread, cProfile with ``time.process_time``, load
6-9): before, 0.91 s of CPU, of which the 31 hinted nearest-within searches 0.54 s (a
converged iteration 15 ms: 40k queries descending the tree although 99.99 % keep their
hint), the normals' k = 20 self-query 0.09 s, the reduction 0.05 s (the "second tree and
SciPy trees" of earlier profiles were gone: the normals reuse the correspondence index).
After (0.48 s): each target point's 8 nearest, kept from the normals' self-query, answer a
hinted query lying within half the 9th-neighbour distance of its hint without the tree
(exact; ~90 % of the converged queries: 15 -> 3-4 ms per iteration); the self-query runs
bottom-up from each point's leaf in tree order (0.09 -> 0.07 s); leaves of 16-32 points
instead of 8-16 (5-10 % off every search, point-to-point included). Searches 0.20-0.25 s,
of which the first five iterations (queries up to 5 cm off the surface, few hints right)
~0.16 s: the ball around a far query meets many leaves; a walk along the candidate lists
did not pay there.

Profile of ``surface_newton`` on the LiDAR pair (cProfile, the plane approximant, from the
identity: 10-11 Newton steps, 52-64 objective passes with the Armijo trials). Before the
"cpu" backend (PyTorch reference, 1 thread, load 1-7): 7.3 s of CPU (20 s wall under load;
140 s was measured earlier on 2 threads, where OpenMP's spinning under load multiplies every
small op), of which the Newton reduction ``newton_terms_reference`` ~95 % (per pass ~130 ms:
the descent ``kdtree.descend`` ~65-100 ms, 13 levels of gathers, the rest ~25 ``torch.stack``
and ``sum`` over (N, 3) float64 temporaries), the node frames (``node_frames``: prefix sums
and the closed-form ``eigh3`` on 32k nodes) ~0.3-0.9 s, the tree build ~0.25 s, the host
loop (``_move``, ``so3_exp``, the 6x6 eigh) ~0.05 s. With the "cpu" backend (numba,
``kernels/surface/cpu.py``; 1 thread, CPU time, load 6-10): 0.9 s a call: Newton passes
52 x 3.5 ms = 0.18 s (the descent of groups of 16 points at once overlaps their dependent
node reads: 9.8 -> 3.5 ms a pass), tree build (NumPy lexsort, ``kernels/kdtree.py``)
0.25 s, input validation and the local frame (``_edge.prepare_pair``) 0.12 s, node frames
and coefficients 0.06 s, level radii 0.035 s, default criteria 0.035 s, host loop 0.05 s.

Measured (``--only surface``, this 2-core machine shared and loaded, so CPU seconds are the
comparable figure; the lead's quiet run replaces these): load 12, 2 threads: cpu backend
8.4 s wall / 2.3 s CPU, torch reference 140 s / 46.7 s (pose difference 4e-7° / 4e-5 mm),
Open3D point-to-plane ICP 9.5 s / 3.4 s, small_gicp PLANE_ICP 2.3 s / 0.76 s; load 10,
``POINTALIGN_NUM_THREADS=1``: cpu backend 3.0 s / 1.27 s, Open3D 8.1 s / 3.8 s (all cores),
small_gicp 1.4 s / 0.67 s. Against relative.txt: ours 0.78° / 50 mm (the torch reference
gives the same pose), Open3D 0.04° / 16 mm, small_gicp 0.10° / 30 mm; truncated at 1 m
as the peers: 0.33° / 49 mm (0.12° / 14 mm with the invalid (0, 0, 0) returns dropped).
approximate_icp (``--only surface --slow --repeat 2``, load 8.6-9.5, 2 threads): bunny
cpu 7.2 s / 2.9 s CPU, torch reference 27.9 s / 12.3 s; LiDAR cpu 6.7 s / 2.6 s, reference
10.3 s / 5.8 s; with ``pa.set_num_threads(1)`` (load 7): bunny 0.78 s / 0.38 s, LiDAR
1.0 s / 0.51 s (the 2-thread rows measure the oversubscribed machine). Poses equal the
reference's; accuracy: bunny 4.2° / 3.8 mm, LiDAR 2.35° / 887 mm (``info["stalled"]``),
see docs/surface-methods.md.

    python benchmarks/bench_cpu.py            # all rows (surface_newton: cpu backend + peers)
    python benchmarks/bench_cpu.py --slow     # plus surface_newton on the torch reference
"""

from __future__ import annotations

import math
import os
import sys
import time

# OpenMP reads its wait policy when torch (or Open3D) loads it: set it first, as ``import
# pointalign`` does when it comes before torch (README), so that idle threads of either
# library sleep instead of spinning against the other's work (same setting for the peers)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Recorder, parse_args, small_gicp_steps  # noqa: E402

import pointalign as pa  # noqa: E402
from pointalign import datasets, metrics  # noqa: E402

MAX_DIST = 0.05
ITERS = 30
VOXEL = 0.00254

NOTES = (
    "bun045 -> bun000 (40k points each) from the identity; 2-core machine shared with other "
    "engineers: load1 is os.getloadavg()[0] before each row, cpu_s this process's CPU time "
    "(all threads; peers' OpenMP threads included). Compare rows of one run only. icp_*: 30 "
    "fixed iterations, 5 cm, index (and for point-to-plane the target normals, k = 20 / "
    "Open3D hybrid 1 cm, 20) built inside each call. register: voxel 2.54 mm, Open3D's "
    "tutorial pipeline (FPFH + RANSAC + point-to-plane ICP) and small_gicp GICP alone. "
    "emicp: pa.emicp end to end (40k, automatic form); softassign: pa.softassign 2k x 2k "
    "(automatic form), both after a warm-up. Targets: ICP p2p/p2pl "
    "and register() no slower than Open3D, EM-ICP 40k <= 10 s, surface_newton LiDAR <= 2 s. "
    f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} for both libraries."
)


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def on_reference_backend(fn):
    """Run ``fn()`` once on the PyTorch references: ``(result, wall s, CPU s, load)``."""
    old = os.environ.get("POINTALIGN_BACKEND")
    os.environ["POINTALIGN_BACKEND"] = "torch"
    try:
        load = _load()
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        return out, time.perf_counter() - w0, time.process_time() - c0, load
    finally:
        if old is None:
            os.environ.pop("POINTALIGN_BACKEND", None)
        else:
            os.environ["POINTALIGN_BACKEND"] = old


def timed(fn, repeat: int = 3):
    """Best-of-``repeat`` wall and CPU seconds of ``fn()`` after one warm-up call."""
    out = fn()
    best_w, best_c = math.inf, math.inf
    for _ in range(repeat):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        best_w = min(best_w, time.perf_counter() - w0)
        best_c = min(best_c, time.process_time() - c0)
    return out, best_w, best_c


def _peers():
    try:
        import open3d as o3d
    except Exception:
        o3d = None
    try:
        import small_gicp as sg
    except Exception:
        sg = None
    return o3d, sg


def _o3d_cloud(o3d, p):
    return o3d.geometry.PointCloud(o3d.utility.Vector3dVector(np.asarray(p, np.float64)))


def icp_rows(rec: Recorder, s: torch.Tensor, t: torch.Tensor, truth: np.ndarray,
             repeat: int) -> None:
    o3d, sg = _peers()
    threads = pa.get_num_threads()
    crit = pa.ConvergenceCriteria(max_iterations=ITERS, relative_fitness=0, relative_rmse=0,
                                  translation_tolerance=0, rotation_tolerance=0)
    s_np, t_np = s.double().numpy(), t.double().numpy()
    reg = None if o3d is None else o3d.pipelines.registration
    for method, table in (("point_to_point", "icp_p2p"), ("point_to_plane", "icp_p2pl")):
        load = _load()
        res, w, c = timed(lambda m=method: pa.icp(s, t, max_correspondence_distance=MAX_DIST,
                                                  method=m, criteria=crit, device="cpu",
                                                  acceleration=False),  # as the peers
                          repeat)
        rot, tr = metrics.relative_error(np.asarray(res.transformation), truth)
        rec.add(table, impl="pointalign (cpu backend)", wall_s=w, cpu_s=c, load1=load,
                threads=threads, fitness=res.fitness, rot_err_deg=rot, trans_err_mm=1e3 * tr)
        if o3d is not None:
            est = (reg.TransformationEstimationPointToPoint() if method == "point_to_point"
                   else reg.TransformationEstimationPointToPlane())
            cr = reg.ICPConvergenceCriteria(relative_fitness=0, relative_rmse=0,
                                            max_iteration=ITERS)

            def o3d_call(method=method, est=est, cr=cr):
                src, tgt = _o3d_cloud(o3d, s_np), _o3d_cloud(o3d, t_np)
                if method == "point_to_plane":
                    tgt.estimate_normals(o3d.geometry.KDTreeSearchParamHybrid(radius=0.01,
                                                                              max_nn=20))
                return reg.registration_icp(src, tgt, MAX_DIST, np.eye(4), est, cr)

            load = _load()
            r, w, c = timed(o3d_call, repeat)
            rot, tr = metrics.relative_error(np.asarray(r.transformation), truth)
            rec.add(table, impl=f"open3d {o3d.__version__}", wall_s=w, cpu_s=c, load1=load,
                    threads=os.cpu_count(), fitness=r.fitness, rot_err_deg=rot,
                    trans_err_mm=1e3 * tr)
        if sg is not None:
            kind = "ICP" if method == "point_to_point" else "PLANE_ICP"

            def sg_call(kind=kind):
                return sg.align(t_np, s_np, init_T_target_source=np.eye(4),
                                registration_type=kind, downsampling_resolution=1e-5,
                                max_correspondence_distance=MAX_DIST, num_threads=threads,
                                max_iterations=ITERS, rotation_epsilon=0.0,
                                translation_epsilon=0.0)

            load = _load()
            r, w, c = timed(sg_call, repeat)
            rot, tr = metrics.relative_error(np.asarray(r.T_target_source), truth)
            rec.add(table, impl="small_gicp 1.0 (" + kind + ")", wall_s=w, cpu_s=c, load1=load,
                    threads=threads, iterations=small_gicp_steps(r), rot_err_deg=rot,
                    trans_err_mm=1e3 * tr)


def register_rows(rec: Recorder, s: torch.Tensor, t: torch.Tensor, truth: np.ndarray,
                  repeat: int) -> None:
    o3d, sg = _peers()
    load = _load()
    res, w, c = timed(lambda: pa.register(s, t, voxel_size=VOXEL, device="cpu"), repeat)
    rot, tr = metrics.relative_error(np.asarray(res.transformation), truth)
    rec.add("register", impl="pointalign register (cpu backend)", wall_s=w, cpu_s=c,
            load1=load, rot_err_deg=rot, trans_err_mm=1e3 * tr)
    s_np, t_np = s.double().numpy(), t.double().numpy()
    if o3d is not None:
        reg = o3d.pipelines.registration
        v = VOXEL

        def prep(p):
            d = _o3d_cloud(o3d, p).voxel_down_sample(v)
            d.estimate_normals(o3d.geometry.KDTreeSearchParamHybrid(radius=2 * v, max_nn=30))
            f = reg.compute_fpfh_feature(d, o3d.geometry.KDTreeSearchParamHybrid(
                radius=5 * v, max_nn=100))
            return d, f

        def pipeline():
            o3d.utility.random.seed(0)
            sd, sf = prep(s_np)
            td, tf = prep(t_np)
            g = reg.registration_ransac_based_on_feature_matching(
                sd, td, sf, tf, False, 1.5 * v, reg.TransformationEstimationPointToPoint(False),
                3, [reg.CorrespondenceCheckerBasedOnEdgeLength(0.9),
                    reg.CorrespondenceCheckerBasedOnDistance(1.5 * v)],
                reg.RANSACConvergenceCriteria(100000, 0.999))
            return reg.registration_icp(sd, td, 0.4 * v, g.transformation,
                                        reg.TransformationEstimationPointToPlane())

        load = _load()
        r, w, c = timed(pipeline, repeat)
        rot, tr = metrics.relative_error(np.asarray(r.transformation), truth)
        rec.add("register", impl=f"open3d {o3d.__version__} FPFH+RANSAC+ICP", wall_s=w,
                cpu_s=c, load1=load, rot_err_deg=rot, trans_err_mm=1e3 * tr)
    if sg is not None:
        load = _load()
        r, w, c = timed(lambda: sg.align(t_np, s_np, init_T_target_source=np.eye(4),
                                         registration_type="GICP",
                                         downsampling_resolution=VOXEL,
                                         num_threads=pa.get_num_threads()), repeat)
        rot, tr = metrics.relative_error(np.asarray(r.T_target_source), truth)
        rec.add("register", impl="small_gicp 1.0 GICP alone (local)", wall_s=w, cpu_s=c,
                load1=load, rot_err_deg=rot, trans_err_mm=1e3 * tr)


def emicp_rows(rec: Recorder, s: torch.Tensor, t: torch.Tensor, truth: np.ndarray,
               repeat: int) -> None:
    """End-to-end ``pa.emicp`` on the 40k pair and ``pa.softassign`` on 2k x 2k (CPU)."""
    from pointalign.registration import soft

    est = soft.estimate_seconds("emicp", s, t, device="cpu")
    load = _load()
    res, w, c = timed(lambda: pa.emicp(s, t, device="cpu"), repeat)
    rot, tr = metrics.relative_error(np.asarray(res.transformation), truth)
    rec.add("emicp", impl="pointalign emicp 40k (cpu backend, " +
            res.info["approximation"]["mode"] + ")", points=s.shape[0], wall_s=w, cpu_s=c,
            load1=load, iterations=int(res.iterations), rot_err_deg=rot, trans_err_mm=1e3 * tr,
            estimate_s=est["seconds"], exact_estimate_s=est["exact_seconds"],
            approximation=str(res.info["approximation"]))
    s2, t2 = datasets.random_subsample(s, 2000, 0), datasets.random_subsample(t, 2000, 1)
    est = soft.estimate_seconds("softassign", s2, t2, device="cpu")
    load = _load()
    pa.softassign(s2, t2, device="cpu", temperatures=1, iterations_per_temperature=1)  # warm
    c0, w0 = time.process_time(), time.perf_counter()
    res = pa.softassign(s2, t2, device="cpu")
    w, c = time.perf_counter() - w0, time.process_time() - c0
    rot, tr = metrics.relative_error(np.asarray(res.transformation), truth)
    rec.add("softassign", impl="pointalign softassign 2k x 2k (cpu backend, " +
            res.info["approximation"]["mode"] + ")", points=2000, wall_s=w, cpu_s=c,
            load1=load, iterations=int(res.iterations), rot_err_deg=rot, trans_err_mm=1e3 * tr,
            estimate_s=est["seconds"], exact_estimate_s=est["exact_seconds"],
            approximation=str(res.info["approximation"]))


def surface_rows(rec: Recorder, repeat: int, reference: bool) -> None:
    """surface_newton on the fast_gicp LiDAR pair (source 251371071 -> target 251370668).

    Errors against fast_gicp's ``relative.txt`` (a reference solution, not survey truth;
    small_gicp's differs from it by 1.9 cm / 0.23°). Peers on the same raw clouds (the
    ~5k invalid returns at the sensor origin of each scan included, as for ours):
    Open3D point-to-plane ICP (normals hybrid 1 m / 20, 1 m, its default 30 iterations)
    and small_gicp's PLANE_ICP (its own normals, 1 m, no downsampling). ``reference``:
    also one run on the PyTorch reference backend (``POINTALIGN_BACKEND=torch``; ~20 s of
    CPU, the "before" row).
    """
    root = datasets.shared_data_dir()
    if root is None:
        rec.add("surface_newton", impl="pointalign", skipped="no shared data")
        return
    d = root / "lidar" / "fast_gicp_pair"
    src = pa.read(d / "251371071.pcd")
    tgt = pa.read(d / "251370668.pcd")
    truth = np.loadtxt(d / "relative.txt")
    o3d, sg = _peers()
    threads = pa.get_num_threads()

    def ours():
        return pa.surface_newton(src, tgt, device="cpu")

    def row(impl, res, w, c, load):
        rot, tr = metrics.relative_error(np.asarray(res.transformation), truth)
        tm = {k: round(v, 4) for k, v in res.timings.items()}
        rec.add("surface_newton", impl=impl, wall_s=w, cpu_s=c, load1=load, threads=threads,
                iterations=int(res.iterations), passes=int(res.info["passes"]),
                stages=str(tm), fitness=float(res.fitness), rot_err_deg=rot,
                trans_err_mm=1e3 * tr)
        return res

    load = _load()
    res, w, c = timed(ours, repeat)
    ours_T = np.asarray(row("pointalign surface_newton (cpu backend)", res, w, c,
                            load).transformation)
    if reference:
        ref, w, c, load = on_reference_backend(ours)
        row("pointalign surface_newton (torch reference backend, 1 run)", ref, w, c, load)
        rot, tr = metrics.relative_error(ours_T, np.asarray(ref.transformation))
        rec.add("surface_newton", impl="cpu backend vs torch reference", rot_err_deg=rot,
                trans_err_mm=1e3 * tr)
    load = _load()
    r, w, c = timed(lambda: pa.surface_newton(src, tgt, device="cpu",
                                              max_correspondence_distance=1.0), repeat)
    row("pointalign surface_newton (cpu backend, truncated at 1 m as the peers)", r, w, c,
        load)
    approximate_icp_rows(rec, src, tgt, truth, "lidar", repeat, reference)
    s_np = np.asarray(src.points, np.float64)
    t_np = np.asarray(tgt.points, np.float64)
    if o3d is not None:
        reg = o3d.pipelines.registration

        def o3d_call():
            sc, tc = _o3d_cloud(o3d, s_np), _o3d_cloud(o3d, t_np)
            tc.estimate_normals(o3d.geometry.KDTreeSearchParamHybrid(radius=1.0, max_nn=20))
            return reg.registration_icp(sc, tc, 1.0, np.eye(4),
                                        reg.TransformationEstimationPointToPlane())

        load = _load()
        r, w, c = timed(o3d_call, repeat)
        rot, tr = metrics.relative_error(np.asarray(r.transformation), truth)
        rec.add("surface_newton", impl=f"open3d {o3d.__version__} point-to-plane ICP",
                wall_s=w, cpu_s=c, load1=load, threads=os.cpu_count(), fitness=r.fitness,
                rot_err_deg=rot, trans_err_mm=1e3 * tr)
    if sg is not None:
        load = _load()
        r, w, c = timed(lambda: sg.align(t_np, s_np, init_T_target_source=np.eye(4),
                                         registration_type="PLANE_ICP",
                                         downsampling_resolution=1e-5,
                                         max_correspondence_distance=1.0,
                                         num_threads=threads), repeat)
        rot, tr = metrics.relative_error(np.asarray(r.T_target_source), truth)
        rec.add("surface_newton", impl="small_gicp 1.0 (PLANE_ICP)", wall_s=w, cpu_s=c,
                load1=load, threads=threads, iterations=small_gicp_steps(r), rot_err_deg=rot,
                trans_err_mm=1e3 * tr)


def approximate_icp_rows(rec: Recorder, src, tgt, truth: np.ndarray, pair: str, repeat: int,
                         reference: bool) -> None:
    """``approximate_icp`` (cell means as partners, default schedule, from the identity).

    The cpu backend (one fused numba pass a step: move, descend, pair, Horn's sums) and,
    with ``reference``, one run on the PyTorch reference backend (the "before"). No
    truncation (its default) and, on the LiDAR pair, 1 m as the peers of
    :func:`surface_rows`. Its accuracy is that of the cell means (docs: surface methods).
    """
    threads = pa.get_num_threads()

    def add(impl, res, w, c, load):
        rot, tr = metrics.relative_error(np.asarray(res.transformation), truth)
        rec.add("approximate_icp", impl=impl, pair=pair, wall_s=w, cpu_s=c, load1=load,
                threads=threads, iterations=int(res.iterations),
                stop_reason=str(res.stop_reason), stalled=bool(res.info["stalled"]),
                fitness=float(res.fitness), rot_err_deg=rot, trans_err_mm=1e3 * tr)

    taus = [None] + ([1.0] if pair == "lidar" else [])
    for tau in taus:
        def call(tau=tau):
            return pa.approximate_icp(src, tgt, device="cpu", max_correspondence_distance=tau)

        load = _load()
        res, w, c = timed(call, repeat)
        label = "" if tau is None else f", truncated at {tau:g} m"
        add(f"pointalign approximate_icp (cpu backend{label})", res, w, c, load)
    if reference:
        ref, w, c, load = on_reference_backend(
            lambda: pa.approximate_icp(src, tgt, device="cpu"))
        add("pointalign approximate_icp (torch reference backend, 1 run)", ref, w, c, load)


def main() -> None:
    p = parse_args(__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--slow", action="store_true",
                   help="also surface_newton on the PyTorch reference backend (~20 s)")
    p.add_argument("--emicp-repeat", type=int, default=1,
                   help="timed EM-ICP runs after the warm-up (softassign: one run)")
    p.add_argument("--only", default=None, help="comma-separated tables to run")
    args = p.parse_args()
    rec = Recorder("cpu", "cpu", title="CPU", notes=NOTES)
    s, t = datasets.load_bunny("bun045"), datasets.load_bunny("bun000")
    truth = datasets.bunny_relative_pose("bun045", "bun000").numpy()
    only = None if args.only is None else set(args.only.split(","))

    def want(name):
        return only is None or name in only

    if want("icp"):
        icp_rows(rec, s, t, truth, args.repeat)
    if want("register"):
        register_rows(rec, s, t, truth, args.repeat)
    if want("emicp"):
        emicp_rows(rec, s, t, truth, args.emicp_repeat)
    if want("surface"):
        surface_rows(rec, args.repeat, reference=args.slow)
    if want("surface") or want("aicp"):
        approximate_icp_rows(rec, s, t, truth, "bunny", args.repeat, args.slow)
    rec.save()


if __name__ == "__main__":
    main()
