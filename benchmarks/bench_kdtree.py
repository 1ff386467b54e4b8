"""k-d tree: build time (device vs host) and query time (exact / approximate) vs peers.

Target: the bun000 scan upsampled with jitter to M points; queries: bun045 moved into the
target frame by the ground truth, upsampled to N = M (a registration-like workload).
Peers (same inputs, when installed): SciPy cKDTree (all cores), pykdtree.

    python benchmarks/bench_kdtree.py --device cuda          # 1e4, 1e5, 1e6
    python benchmarks/bench_kdtree.py --device cpu --quick   # smoke run, < 1 minute
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Recorder, parse_args, timeit  # noqa: E402

from pointalign import datasets, transforms  # noqa: E402
from pointalign.features.covariances import estimate_covariances  # noqa: E402
from pointalign.kernels import kdtree as K  # noqa: E402
from pointalign.search.kdtree import KDTreeIndex  # noqa: E402


def upsample(points: torch.Tensor, n: int, jitter: float, seed: int) -> torch.Tensor:
    """``n`` points drawn (with replacement) from ``points (M, 3)`` plus Gaussian jitter."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, points.shape[0], (n,), generator=g)
    return points[idx] + jitter * torch.randn(n, 3, generator=g, dtype=points.dtype)


def bunny_problem(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(target (n, 3), queries (n, 3)) from the bundled bunny scans, float32 CPU."""
    pair = datasets.load_bunny_pair()
    src = transforms.apply(torch.as_tensor(pair.T_target_source).float(), pair.source)
    return upsample(pair.target, n, 3e-4, seed), upsample(src, n, 3e-4, seed + 1)


def bench_size(rec: Recorder, m: int, dev: torch.device, rep: int, warm: int) -> None:
    """All rows for one size M."""
    tgt, qry = bunny_problem(m)
    tgt_d, qry_d = tgt.to(dev), qry.to(dev)
    depth = K.depth_for(m, 16)

    def row(op, impl, k, t, per_query=True):
        rec.add(op=op, impl=impl, M=m, k=k, ms=t["median_s"] * 1e3, iqr_ms=t["iqr_s"] * 1e3,
                per_query_ns=t["median_s"] * 1e9 / m if per_query else "")

    for where in ("device", "host"):
        t = timeit(lambda w=where: K.build(tgt_d, depth, w), repeat=rep, warmup=warm,
                   device=dev)
        row("build", f"pointalign {where}", "", t, per_query=False)
    tree = KDTreeIndex(tgt_d, leaf_size=16)
    for name, fn, k in [
        ("exact", lambda: tree.knn(qry_d, 1), 1),
        ("exact", lambda: tree.knn(qry_d, 8), 8),
        ("approximate", lambda: tree.knn(qry_d, 1, approximate=True), 1),
        ("nearest_within 1mm", lambda: tree.nearest_within(qry_d, 1e-3), 1),
        ("descend", lambda: tree.descend(qry_d), ""),
    ]:
        row(name, "pointalign", k, timeit(fn, repeat=rep, warmup=warm, device=dev))
    # the covariances' workload: every target point's 20 nearest, asked in tree order
    arr = tree.arrays
    row("self-query k=20 in tree order", "pointalign", 20,
        timeit(lambda: K.knn(arr, arr.points, 20, reorder=False), repeat=rep, warmup=warm,
               device=dev))
    row("self_knn k=20 (a leaf's points walk together)", "pointalign", 20,
        timeit(lambda: K.self_knn(arr, 20), repeat=rep, warmup=warm, device=dev))
    row("covariances k=20 (build + self-query + reduction)", "pointalign", 20,
        timeit(lambda: estimate_covariances(tgt_d, 20), repeat=rep, warmup=warm, device=dev))
    tn, qn = tgt.numpy(), qry.numpy()
    try:  # peers on the host, same inputs
        from scipy.spatial import cKDTree

        row("build", "scipy cKDTree", "",
            timeit(lambda: cKDTree(tn, leafsize=16), repeat=rep, warmup=warm), False)
        ck = cKDTree(tn, leafsize=16)
        for k in (1, 8):
            row("exact", "scipy cKDTree", k,
                timeit(lambda k=k: ck.query(qn, k, workers=-1), repeat=rep, warmup=warm))
    except ImportError:
        pass
    try:
        from pykdtree.kdtree import KDTree

        row("build", "pykdtree", "",
            timeit(lambda: KDTree(tn, leafsize=16), repeat=rep, warmup=warm), False)
        pk = KDTree(tn, leafsize=16)
        for k in (1, 8):
            row("exact", "pykdtree", k,
                timeit(lambda k=k: pk.query(qn, k=k), repeat=rep, warmup=warm))
    except ImportError:
        pass


def main() -> None:
    args = parse_args(__doc__.splitlines()[0]).parse_args()
    dev = torch.device(args.device)
    sizes = [2_000, 5_000] if args.quick else [10_000, 25_000, 100_000, 1_000_000]
    rep = 3 if args.quick else 7
    warm = 1 if args.quick else 2
    rec = Recorder("kdtree", dev, title="k-d tree: build and query",
                   notes="M target points = N queries (bunny, upsampled); k-d tree leaf size "
                         "16; times in ms (median of repeats); peers on the host.",
                   columns=["op", "impl", "M", "k", "ms", "iqr_ms", "per_query_ns"])
    for m in sizes:
        bench_size(rec, m, dev, rep, warm)
    rec.save()


if __name__ == "__main__":
    main()
