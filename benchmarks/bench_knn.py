"""Exact nearest-neighbour search: 1-NN and k=16 for each pointalign index vs peers.

Workloads (N queries against M = N points, float32):

* ``uniform``: both uniform in the unit cube (independent draws);
* ``bunny``: target bun000 upsampled with 0.3 mm jitter to M points; queries bun045 moved
  into the target frame by the ground truth and upsampled the same way (ICP-like, partial
  overlap: about a third of the queries have no target surface near them).

Methods: ``brute`` (fused Triton kernel), ``grid`` (VoxelGridIndex, automatic cell),
``grid_within`` (``nearest_within(cell)`` with the cell = 1.5 x the mean NN spacing, the
ICP correspondence query), ``kdtree`` (KDTreeIndex, when present), ``ckdtree``; peers SciPy
cKDTree (workers=-1), pykdtree (if importable) and a plain PyTorch brute force
(``torch.cdist`` + ``topk`` in chunks). Build and query are timed separately (an index is
built once and queried every ICP iteration). ``max_err`` is the largest squared-distance
error against cKDTree on a 2,000-query sample.

    python benchmarks/bench_knn.py --device cuda          # 1e4, 1e5, 1e6
    python benchmarks/bench_knn.py --device cpu --quick   # smoke run, < 1 minute
"""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Recorder, parse_args, sync, timeit  # noqa: E402

from pointalign import datasets, transforms  # noqa: E402
from pointalign.search import build_index  # noqa: E402

NOTES = (
    "Exact kNN, N queries against M = N points, float32; build and query timed separately "
    "(median of 7 after 2 warm-ups, fewer for calls over 0.5 s). Expected on an H100: the "
    "fused brute force is compute-bound at about 9 operations per pair (~0.3 s for 1M x 1M, "
    "so it only wins below ~50k points); the voxel grid does ~30-100 candidates per query "
    "and should reach the 10 ms target for exact 1-NN at 1M x 1M on uniform data (grid "
    "build ~1-2 ms: one sort). The bunny workload is harder for the grid: queries off the "
    "target surface fall through to coarser grids (built on first use, so not in build_ms; "
    "likewise the k=16 grid, whose cells are scaled for 16 neighbours). Rows marked skipped "
    "were estimated too slow to run (O(N M) peers at 1M). max_err: squared distance vs "
    "cKDTree on a sample (inf = a missing neighbour)."
)


def upsample(points: torch.Tensor, n: int, jitter: float, seed: int) -> torch.Tensor:
    """``n`` points drawn with replacement from ``points (M, 3)`` plus Gaussian jitter."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, points.shape[0], (n,), generator=g)
    return points[idx] + jitter * torch.randn(n, 3, generator=g, dtype=points.dtype)


def problem(name: str, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(points (n, 3), queries (n, 3)) float32 on the CPU."""
    if name == "uniform":
        g = torch.Generator().manual_seed(seed)
        return torch.rand(n, 3, generator=g), torch.rand(n, 3, generator=g)
    pair = datasets.load_bunny_pair()
    src = transforms.apply(pair.T_target_source.to(pair.source.dtype), pair.source)
    return upsample(pair.target, n, 3e-4, seed), upsample(src, n, 3e-4, seed + 1)


def torch_brute(points: torch.Tensor, query: torch.Tensor, k: int, chunk_pairs: int = 1 << 26):
    """Plain PyTorch peer: torch.cdist + topk over query chunks."""
    bn = max(1, chunk_pairs // points.shape[0])
    ds, ids = [], []
    for s in range(0, query.shape[0], bn):
        d = torch.cdist(query[s:s + bn], points)
        v, i = torch.topk(d, k, dim=1, largest=False)
        ds.append(v.square())
        ids.append(i)
    return torch.cat(ds), torch.cat(ids)


def _timed(fn, device, budget_s: float = 0.5, quick: bool = False):
    """timeit with fewer repeats for slow calls (one probe call first)."""
    if quick:
        return timeit(fn, warmup=1, repeat=3, device=device)
    t0 = time.perf_counter()
    fn()
    sync()
    probe = time.perf_counter() - t0
    if probe > budget_s:
        return timeit(fn, warmup=0, repeat=3 if probe < 5 else 1, device=device)
    return timeit(fn, warmup=2, repeat=7, device=device)


def _err(d, sample, ref_d) -> float:
    d = d[sample].detach().cpu().double().numpy()
    both = np.isfinite(ref_d) & np.isfinite(d)
    if not np.array_equal(np.isfinite(ref_d), np.isfinite(d)):
        return float("inf")
    return float(np.abs(np.where(both, d - ref_d, 0)).max()) if both.any() else 0.0


def bench_case(rec, c, k: int) -> None:
    """All methods for one (dataset, size, k); ``c`` holds the shared inputs."""
    args, dev, nb, ds, n = c.args, c.dev, c.nb, c.ds, c.n
    p, q, p_cpu, q_cpu, tree, sample, ref, within = (
        c.p, c.q, c.p_cpu, c.q_cpu, c.tree, c.sample, c.ref, c.within)
    has_kdtree, cKDTree, PyKDTree = c.has_kdtree, c.cKDTree, c.PyKDTree

    def row(method, build_s, q_stats, d=None, note=""):
        err = _err(d, sample, ref[k]) if d is not None else None
        ms = (lambda s: None if s is None else round(s * 1e3, 3))  # noqa: E731
        rec.add(dataset=ds, n=n, m=n, k=k, method=method, build_ms=ms(build_s),
                query_ms=ms(q_stats and q_stats["median_s"]),
                query_iqr_ms=ms(q_stats and q_stats["iqr_s"]),
                total_ms=ms(q_stats and (build_s or 0) + q_stats["median_s"]),
                max_err=err, note=note)

    methods = ["grid", "brute", "ckdtree"] + (["kdtree"] if has_kdtree else [])
    for method in methods:
        if method == "brute" and n * n > (1e12 if dev.type == "cuda" else 1e8):
            row(method, None, None, note="skipped: O(N M)")
            continue
        if method == "ckdtree" and dev.type == "cuda":
            continue  # the same tree as the SciPy peer below, plus copies
        try:
            b = timeit(lambda m=method: build_index(p, m), warmup=nb - 1,
                       repeat=nb, device=dev)["median_s"]
            ix = build_index(p, method)
            st = _timed(lambda ix=ix: ix.knn(q, k), dev, quick=args.quick)
            row(method, b, st, ix.knn(q, k).dists)
            if method == "grid" and k == 1:
                gx = build_index(p, "grid", cell_size=within)
                b2 = timeit(lambda: build_index(p, "grid", cell_size=within),
                            warmup=nb - 1, repeat=nb, device=dev)["median_s"]
                st = _timed(lambda gx=gx: gx.nearest_within(q, within), dev,
                            quick=args.quick)
                row("grid_within", b2, st,
                    note=f"nearest_within({within:.3g}), cell {within:.3g}")
        except Exception as exc:  # report, keep going
            row(method, None, None, note=f"failed: {type(exc).__name__}: {exc}")
    # peers
    pn, qn = p_cpu.numpy(), q_cpu.numpy()
    b = timeit(lambda: cKDTree(pn), warmup=nb - 1, repeat=nb)["median_s"]
    st = _timed(lambda: tree.query(qn, k=k, workers=-1), "cpu", quick=args.quick)
    row("scipy_ckdtree", b, st, note="host, workers=-1")
    if PyKDTree is not None:
        b = timeit(lambda: PyKDTree(pn), warmup=nb - 1, repeat=nb)["median_s"]
        pk = PyKDTree(pn)
        st = _timed(lambda: pk.query(qn, k=k), "cpu", quick=args.quick)
        row("pykdtree", b, st, note="host")
    if n * n <= (1e11 if dev.type == "cuda" else 1e8):
        st = _timed(lambda: torch_brute(p, q, k), dev, quick=args.quick)
        row("torch_cdist_topk", 0.0, st, torch_brute(p, q, k)[0])
    else:
        row("torch_cdist_topk", None, None, note="skipped: O(N M)")


def main() -> None:
    ap = parse_args(__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=None)
    ap.add_argument("--datasets", nargs="*", default=["uniform", "bunny"])
    args = ap.parse_args()
    dev = torch.device(args.device)
    nb = 1 if args.quick else 3  # timed builds
    sizes = args.sizes or ([1_000, 3_000] if args.quick else [10_000, 100_000, 1_000_000])
    rec = Recorder("knn", dev, title="Exact nearest-neighbour search (1-NN, k=16)",
                   notes=NOTES, columns=["dataset", "n", "m", "k", "method", "build_ms",
                                         "query_ms", "query_iqr_ms", "total_ms", "max_err",
                                         "note"])
    try:
        from scipy.spatial import cKDTree
    except ImportError:  # pragma: no cover
        cKDTree = None
    try:
        from pykdtree.kdtree import KDTree as PyKDTree
    except ImportError:
        PyKDTree = None
    try:
        import pointalign.search.kdtree  # noqa: F401
        has_kdtree = True
    except ImportError:
        has_kdtree = False

    for ds in args.datasets:
        for n in sizes:
            p_cpu, q_cpu = problem(ds, n)
            p, q = p_cpu.to(dev), q_cpu.to(dev)
            sample = torch.arange(0, n, max(1, n // 2000))
            tree = cKDTree(p_cpu.double().numpy())
            ref = {k: tree.query(q_cpu[sample].double().numpy(), k=k, workers=-1)[0]
                   for k in (1, 16)}
            ref = {k: (np.asarray(v).reshape(len(sample), k)) ** 2 for k, v in ref.items()}
            spacing = float(np.sqrt(np.median(
                tree.query(p_cpu[sample].double().numpy(), k=2, workers=-1)[0][:, 1] ** 2)))
            within = 1.5 * spacing
            c = SimpleNamespace(args=args, dev=dev, nb=nb, ds=ds, n=n, p=p, q=q, p_cpu=p_cpu,
                                q_cpu=q_cpu, tree=tree, sample=sample, ref=ref, within=within,
                                has_kdtree=has_kdtree, cKDTree=cKDTree, PyKDTree=PyKDTree)
            for k in (1, 16):
                bench_case(rec, c, k)
    rec.save()


if __name__ == "__main__":
    main()
