"""Many pairs and many scans (issue 25): pairs/s batched, on Dask, and multiway on the bunny.

Tables (``benchmarks/results/many-<device>.json``):

* ``throughput``: N synthetic bunny-size pairs (bun000 subsampled to ``--points`` points per
  pair, each pair its own sample, a 10° turn and 1 cm shift, σ = 0.3 mm noise):
  - ``icp batched``: one point-to-point :func:`icp` call on the padded batch (distinct
    targets), from the identity; ``ok``: pairs within 0.5° of the truth;
  - ``register_many (per_pair|batched global)``: the whole pipeline on one device, its
    global stage per pair or batched (``--global-path``; ``many.batched``), coarse/final ICP
    and verdicts batched; ``ok``: within 0.5° and 2 mm; ``timings``: the stages' seconds
    (the batched global stage's split as ``global.<stage>``, the local stages' as
    ``local.<part>``, reading as ``read.io`` / ``read.prepare``);
  - ``register one by one``: :func:`register` per pair (a sample of the pairs), the
    baseline;
* ``dask``: the same pairs (on a GPU machine, for CPU workers, the first max(64, N/10))
  in chunks of ``--chunk`` pairs:
  - ``single process cpu|gpu``: batched ICP chunk by chunk, and ``register_many``, in
    this process (the baseline);
  - ``dask cpu xW``: a ``LocalCluster`` of W worker processes, one thread each (numba,
    PyTorch too); ``dask gpu xG`` (``--only dask_gpu``): one worker process per GPU, worker
    i started with ``CUDA_VISIBLE_DEVICES=i`` (``devices`` says what each worker saw);
  - per cluster: ``roundtrip_ms`` (one empty task submitted and awaited, median of 20),
    ``empty_task_ms`` (200 no-op tasks at once: wall / tasks, the scheduler's cost per
    task), ``ship_chunk_ms`` (a task that only receives one chunk of pairs: wall / tasks;
    ``chunk_mb`` its size), batched ICP (``icp batched``) and ``register_many`` on the
    cluster, ``per_task_ms``: (wall − the chunks' own compute / W) / tasks.
* ``multiway``: the ten Stanford bunny scans (shared data) through :func:`multiway`: each
  scan's pose error against bun.conf, the kept edges, the time per stage, and the merged
  model's spread: for each scan moved by its pose, the median distance of its points to
  the nearest point of the other scans (within 2 mm), the median over scans, in mm.

``--quick``: 12 pairs of 500 points, Dask with 1 and 2 workers, multiway on 3,000-point
samples of the scans (a CPU smoke run). The multiway comparison with Open3D is
``bench_multiway.py``.

    python benchmarks/bench_many.py --device cpu --quick
    python benchmarks/bench_many.py --device cuda --only register_many --pairs 1000
    python benchmarks/bench_many.py --device cpu --only dask --pairs 96 --out many_dask
    python benchmarks/bench_many.py --device cuda --only dask_gpu --pairs 1000 --gpus 1 2 \
        --out many_gpus                                    # a machine with two GPUs
"""

from __future__ import annotations

import logging
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Recorder, parse_args  # noqa: E402

from pointalign import datasets, metrics, transforms  # noqa: E402
from pointalign.registration.icp import icp  # noqa: E402
from pointalign.registration.many import register_many  # noqa: E402

BUNNY = ["bun000", "bun045", "bun090", "bun180", "bun270", "bun315", "chin", "ear_back",
         "top2", "top3"]


def make_pairs(n_pairs: int, points: int, seed: int = 0) -> list[datasets.Pair]:
    bunny = datasets.load_bunny("bun000")
    return [datasets.make_pair(datasets.random_subsample(bunny, points, seed=seed + k), 10.0,
                               0.01, noise=3e-4, seed=seed + k) for k in range(n_pairs)]


def _ok(T: np.ndarray, pairs: list[datasets.Pair], trans_tol: float = 2e-3) -> int:
    good = 0
    for k, p in enumerate(pairs):
        rot, trans = metrics.relative_error(T[k], p.T_target_source)
        good += bool(rot < 0.5 and trans < trans_tol)
    return good


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_icp(rec: Recorder, pairs, dev: str) -> None:
    src = torch.nn.utils.rnn.pad_sequence([p.source for p in pairs], batch_first=True)
    tgt = torch.nn.utils.rnn.pad_sequence([p.target for p in pairs], batch_first=True)
    sl = torch.tensor([p.source.shape[0] for p in pairs])
    tl = torch.tensor([p.target.shape[0] for p in pairs])
    src, tgt, sl, tl = (x.to(dev) for x in (src, tgt, sl, tl))

    def run():
        return icp(src, tgt, source_lengths=sl, target_lengths=tl,
                   max_correspondence_distance=0.02, device=dev)

    run()  # warm-up: compiles, caches
    _sync()
    t = time.perf_counter()
    res = run()
    _sync()
    wall = time.perf_counter() - t
    rec.add("throughput", stage="icp batched", workers=1, pairs=len(pairs), wall_s=wall,
            pairs_per_s=len(pairs) / wall, ok=_ok(res.transformation, pairs, 1.0),
            per_task_ms=None, note="point-to-point, distinct targets, from the identity")


def bench_register_many(rec: Recorder, pairs, dev: str, chunk: int,
                        paths: tuple[str, ...] = ("per_pair", "batched")) -> None:
    """register_many with each global-stage path (``many.batched.BATCHED``): pairs/s and the
    global stage's split (``timings``: seconds summed over pairs; ``global.<stage>`` of the
    batched path: voxel_size, strays, scale, downsample, describe, index, correspondences,
    triangle, tdd, score, refine, ransac, robust; ``local.<part>``: rows, coarse_rank,
    coarse_icp, coarse_overlap (per pair: coarse), final_clouds, final_prepare, final_icp,
    verdict; ``read.io``, ``read.prepare``)."""
    from pointalign.registration.many import batched

    old = batched.BATCHED
    try:
        for path in paths:
            batched.BATCHED = {"per_pair": False, "batched": True, "auto": None}[path]
            register_many(pairs[: min(4, len(pairs))], device=dev, chunk_size=chunk)  # warm
            _sync()
            t = time.perf_counter()
            res = register_many(pairs, device=dev, chunk_size=chunk)
            _sync()
            wall = time.perf_counter() - t
            split = {k: round(v, 3) for k, v in res.timings.items()}
            rec.add("throughput", stage=f"register_many ({path} global)", workers=1,
                    pairs=len(pairs), wall_s=wall, pairs_per_s=len(pairs) / wall,
                    ok=_ok(res.transformations, pairs), per_task_ms=None, timings=split,
                    trusted=int(sum(bool(r["trusted"]) for r in res.rows)),
                    note=f"chunks of {chunk}; global {res.timings['global']:.2f} s, batched "
                         f"local {res.timings['local']:.2f} s")
    finally:
        batched.BATCHED = old
    from pointalign.registration.pipeline import register

    sample = pairs[: min(len(pairs), 8)]
    t = time.perf_counter()
    Ts = np.stack([register(p.source, p.target, device=dev).transformation for p in sample])
    wall = time.perf_counter() - t
    rec.add("throughput", stage="register one by one", workers=1, pairs=len(sample),
            wall_s=wall, pairs_per_s=len(sample) / wall, ok=_ok(Ts, sample), per_task_ms=None,
            note="register() per pair (baseline)")


def _gpu_cluster(n: int):
    """One worker process per GPU: worker i sees only GPU i (``CUDA_VISIBLE_DEVICES=i``).

    ``LocalCluster`` gives every worker the same environment; a ``SpecCluster`` of nannies
    sets each worker's own before its process starts (before CUDA initialises).
    """
    from distributed import Nanny, Scheduler, SpecCluster

    env = {"OMP_NUM_THREADS": "1"}
    workers = {f"gpu{i}": {"cls": Nanny, "options": {
        "nthreads": 1, "env": dict(env, CUDA_VISIBLE_DEVICES=str(i)),
        "dashboard_address": None}} for i in range(n)}
    return SpecCluster(scheduler={"cls": Scheduler, "options": {"dashboard_address": None}},
                       workers=workers, silence_logs=logging.ERROR)


def _cpu_cluster(n: int):
    """``n`` CPU worker processes, one thread each (numba and PyTorch on one thread too)."""
    import distributed

    return distributed.LocalCluster(
        n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None,
        worker_dashboard_address=None,
        env={"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
             "POINTALIGN_NUM_THREADS": "1"})


def _noop(x):
    return x


def _touch(chunk):
    """A task that receives a chunk of pairs and does nothing with them (transfer cost)."""
    return len(chunk)


def _icp_chunk(chunk):
    """Batched point-to-point ICP of a chunk of pairs on the worker's default device."""
    from pointalign import _validate

    dev = _validate.default_device()
    src = torch.nn.utils.rnn.pad_sequence([torch.as_tensor(p.source) for p in chunk],
                                          batch_first=True).to(dev)
    tgt = torch.nn.utils.rnn.pad_sequence([torch.as_tensor(p.target) for p in chunk],
                                          batch_first=True).to(dev)
    sl = torch.tensor([p.source.shape[0] for p in chunk], device=dev)
    tl = torch.tensor([p.target.shape[0] for p in chunk], device=dev)
    res = icp(src, tgt, source_lengths=sl, target_lengths=tl,
              max_correspondence_distance=0.02, device=dev)
    return np.asarray(res.transformation).reshape(len(chunk), 4, 4)


def _warm(pairs):
    """Warm one worker (imports, numba cache or Triton compiles); say what device it has."""
    from pointalign import _validate

    register_many(pairs, chunk_size=len(pairs), progress=False)
    _icp_chunk(pairs)
    dev = _validate.default_device()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"pid": os.getpid(), "device": str(dev), "name": name,
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}


def _chunks(pairs, chunk: int):
    return [pairs[lo:lo + chunk] for lo in range(0, len(pairs), chunk)]


def _nbytes(chunk) -> int:
    return int(sum(p.source.numel() * p.source.element_size()
                   + p.target.numel() * p.target.element_size() for p in chunk))


def _median_runs(fn, repeat: int):
    """Run ``fn`` ``repeat`` times; return (median wall s, all walls, the last result)."""
    walls, out = [], None
    for _ in range(repeat):
        _sync()
        t = time.perf_counter()
        out = fn()
        _sync()
        walls.append(time.perf_counter() - t)
    return float(np.median(walls)), [round(w, 3) for w in walls], out


def bench_single(rec: Recorder, pairs, dev: str, chunk: int, label: str,
                 repeat: int) -> None:
    """The same pairs and chunks in this process (the Dask rows' baseline).

    Batched ICP twice on the CPU: with pointalign's thread setting (all cores, what a
    user's process gets) and on one thread (what each CPU worker runs).
    """
    from pointalign import _threads

    # warm-up on one whole chunk: compiles, caches, CUDA graphs of the chunk's shapes
    register_many(pairs[:chunk], device=dev, chunk_size=chunk, progress=False)
    _icp_chunk(pairs[:chunk])
    runs = [None] if label == "gpu" else [None, 1]
    for n in runs:
        def run(n=n):
            with _threads.threads(n):
                return np.concatenate([_icp_chunk(c) for c in _chunks(pairs, chunk)])

        wall, walls, Ts = _median_runs(run, repeat)
        rec.add("dask", stage="icp batched", run=f"single process {label}", workers=1,
                threads=n or _threads.get_num_threads(), pairs=len(pairs), chunk=chunk,
                wall_s=wall, walls=walls, pairs_per_s=len(pairs) / wall,
                ok=_ok(Ts, pairs, 1.0))
    wall, walls, res = _median_runs(
        lambda: register_many(pairs, device=dev, chunk_size=chunk, progress=False), repeat)
    rec.add("dask", stage="register_many", run=f"single process {label}", workers=1,
            pairs=len(pairs), chunk=chunk, wall_s=wall, walls=walls,
            pairs_per_s=len(pairs) / wall, ok=_ok(res.transformations, pairs),
            compute_s=float(sum(r["total_s"] for r in res.rows)),
            note="CPU: pairs of <= SERIAL_POINTS points on one thread" if label == "cpu"
            else "")


def bench_dask(rec: Recorder, pairs, workers: list[int], chunk: int, gpu: bool,
               empty_tasks: int = 200, repeat: int = 1) -> None:
    """register_many and batched ICP on a local cluster of W workers, W in ``workers``.

    Per cluster: the round trip of one empty task (median of 20), the scheduler's cost per
    task (``empty_tasks`` no-op tasks submitted at once: wall / tasks), the cost of
    shipping a chunk of pairs to a worker (a task that only receives one chunk: wall /
    tasks, median of ``repeat``), then batched ICP and register_many on the pairs in
    chunks of ``chunk`` (median of ``repeat`` runs).
    """
    import distributed

    kind = "gpu" if gpu else "cpu"
    for w in workers:
        cluster = _gpu_cluster(w) if gpu else _cpu_cluster(w)
        with cluster, distributed.Client(cluster) as client:
            client.wait_for_workers(w)
            addrs = sorted(client.scheduler_info()["workers"])
            # warm-up on every worker (each its own task, pinned to it)
            info = client.gather([client.submit(_warm, pairs[:chunk], workers=[a], pure=False,
                                                allow_other_workers=False) for a in addrs])
            rt = []
            for _ in range(20):
                t = time.perf_counter()
                client.submit(_noop, 0, pure=False).result()
                rt.append(time.perf_counter() - t)
            empty = []
            for _ in range(max(repeat, 3)):
                t = time.perf_counter()
                client.gather(client.map(_noop, range(empty_tasks), pure=False))
                empty.append((time.perf_counter() - t) / empty_tasks * 1e3)
            parts = _chunks(pairs, chunk)
            ship, _, _ = _median_runs(
                lambda parts=parts: client.gather([client.submit(_touch, c, pure=False)
                                                   for c in parts]),
                max(repeat, 3))
            common = dict(run=f"dask {kind} x{w}", workers=w, pairs=len(pairs), chunk=chunk,
                          tasks=len(parts), roundtrip_ms=float(np.median(rt)) * 1e3,
                          empty_task_ms=float(np.median(empty)),
                          ship_chunk_ms=ship / len(parts) * 1e3,
                          chunk_mb=_nbytes(parts[0]) / 1e6)
            wall, walls, Ts = _median_runs(lambda parts=parts: np.concatenate(client.gather(
                [client.submit(_icp_chunk, c, pure=False) for c in parts])), repeat)
            rec.add("dask", stage="icp batched", wall_s=wall, walls=walls,
                    pairs_per_s=len(pairs) / wall, ok=_ok(Ts, pairs, 1.0), **common)
            wall, walls, res = _median_runs(lambda: register_many(
                pairs, client=client, chunk_size=chunk, progress=False), repeat)
        compute = sum(r["total_s"] for r in res.rows)
        rec.add("dask", stage="register_many", wall_s=wall, walls=walls,
                pairs_per_s=len(pairs) / wall, ok=_ok(res.transformations, pairs),
                compute_s=compute,
                per_task_ms=max(0.0, wall - compute / w) / len(parts) * 1e3,
                devices=[f"{i['name']} (CUDA_VISIBLE_DEVICES={i['CUDA_VISIBLE_DEVICES']})"
                         for i in info], **common)


def bench_multiway(rec: Recorder, dev: str, points: int | None) -> None:
    from pointalign import io
    from pointalign.registration.multiway import multiway
    from pointalign.search import build_index

    root = datasets.shared_data_dir()
    if root is None or not (root / "stanford_bunny" / "data").is_dir():
        print("# multiway: shared bunny scans not found; skipped")
        return
    d = root / "stanford_bunny" / "data"
    truth = datasets.read_bun_conf((d / "bun.conf").read_text())
    scans = [io.read(d / f"{k}.ply").points.float() for k in BUNNY]
    if points:
        scans = [datasets.random_subsample(s, points, seed=0) for s in scans]
    kw = dict(target_points=1500, hypotheses=2048) if points else {}
    t = time.perf_counter()
    res = multiway(scans, device=dev, **kw)
    wall = time.perf_counter() - t
    P0 = truth["bun000.ply"].numpy()
    errs = []
    for k, name in enumerate(BUNNY):
        rot, trans = metrics.relative_error(res.poses[k],
                                            np.linalg.inv(P0) @ truth[name + ".ply"].numpy())
        errs.append((float(rot), float(trans)))
        rec.add("multiway", scan=name, points=int(scans[k].shape[0]), rotation_deg=float(rot),
                translation_mm=float(trans) * 1e3)
    # the merged model's spread: each scan's median distance to the other scans' points
    moved = [transforms.apply(torch.from_numpy(res.poses[k]), s.double()).float()
             for k, s in enumerate(scans)]
    spread = []
    for k in range(len(moved)):
        others = torch.cat([m for j, m in enumerate(moved) if j != k])
        r = build_index(others).nearest_within(moved[k], 0.002)
        d2 = r.dists[:, 0][r.idx[:, 0] >= 0]
        spread.append(float(d2.sqrt().median()) * 1e3 if d2.numel() else float("nan"))
    rec.add("multiway", scan="all", points=int(sum(s.shape[0] for s in scans)),
            rotation_deg=max(e[0] for e in errs), translation_mm=max(e[1] for e in errs) * 1e3,
            wall_s=wall, solver=res.solver, edges=len(res.edges),
            kept=sum(e["kept"] for e in res.edges), spread_mm=float(np.nanmedian(spread)),
            timings={k: round(v, 3) for k, v in res.timings.items()})


def main() -> None:
    p = parse_args(__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=None, help="pairs (default 1000, quick 12)")
    p.add_argument("--points", type=int, default=None, help="points per cloud (2000; 500)")
    p.add_argument("--chunk", type=int, default=None, help="pairs per chunk/task")
    p.add_argument("--workers", type=int, nargs="*", default=None,
                   help="Dask CPU worker counts (default 1 2 4; quick 1 2)")
    p.add_argument("--gpus", type=int, nargs="*", default=None,
                   help="Dask GPU worker counts, one worker per GPU (default 1 2)")
    p.add_argument("--only", nargs="*", default=None,
                   help="icp register_many dask dask_gpu multiway (default: icp "
                        "register_many dask multiway; dask_gpu only when asked)")
    p.add_argument("--repeat", type=int, default=3,
                   help="timed runs per Dask-table row, the median reported (default 3)")
    p.add_argument("--global-path", nargs="*", default=["per_pair", "batched"],
                   choices=["per_pair", "batched", "auto"],
                   help="register_many's global stage: per pair, batched (many.batched), or "
                        "the library's rule; each one measured (default: both)")
    p.add_argument("--out", default="many",
                   help="results topic: benchmarks/results/<out>-<device>.json")
    args = p.parse_args()
    dev = args.device
    quick = args.quick
    n = args.pairs or (12 if quick else 1000)
    pts = args.points or (500 if quick else 2000)
    cuda = torch.device(dev).type == "cuda"
    chunk = args.chunk or (256 if cuda else (2 if quick else 8))
    workers = args.workers if args.workers is not None else ([1, 2] if quick else [1, 2, 4])
    gpus = args.gpus if args.gpus is not None else [1, 2]
    only = set(args.only or ["icp", "register_many", "dask", "multiway"])
    rec = Recorder(args.out, dev, title="Many pairs and many scans (issue 25)",
                   notes=__doc__.split("\n\n")[1])
    pairs = make_pairs(n, pts)
    if "icp" in only:
        bench_icp(rec, pairs, dev)
    if "register_many" in only:
        bench_register_many(rec, pairs, dev, chunk, tuple(args.global_path))
    if only & {"dask", "dask_gpu"}:
        try:
            import distributed  # noqa: F401
        except ImportError:
            sys.exit("bench_many: --only dask needs distributed (pip install distributed)")
    if "dask" in only and workers:
        cpu_pairs = pairs if not cuda else pairs[: max(64, n // 10)]
        cpu_chunk = args.chunk or (2 if quick else 8)
        bench_single(rec, cpu_pairs, "cpu", cpu_chunk, "cpu", args.repeat)
        bench_dask(rec, cpu_pairs, workers, cpu_chunk, gpu=False, repeat=args.repeat)
    if "dask_gpu" in only:
        if not cuda or torch.cuda.device_count() < max(gpus):
            sys.exit(f"bench_many: dask_gpu needs {max(gpus)} GPUs, found "
                     f"{torch.cuda.device_count()}")
        bench_single(rec, pairs, dev, chunk, "gpu", args.repeat)
        bench_dask(rec, pairs, gpus, chunk, gpu=True, repeat=args.repeat)
    if "multiway" in only:
        bench_multiway(rec, dev, 3000 if quick else None)
    rec.save()


if __name__ == "__main__":
    main()
