"""Compile what a device needs before the first real call: ``pointalign warmup``.

A fresh machine pays for compilation on its first calls: numba compiles the CPU kernels
(about a minute on 2 cores) and Triton the GPU kernels (about 20 s); both are cached on
disk afterwards, so this is paid once per machine. :func:`warmup` runs each public method
once on the bundled bunny pair, with a progress bar, so that the cost is paid at
installation (``make demo`` runs it) rather than inside a user's first registration.

numba compiles on one thread per process, so on a CPU whose cache is still empty the steps
are shared out over one worker process per core (each compiles the kernels of its steps and
writes them to the common disk cache; a kernel two steps share may be compiled twice, side
by side), and one of them first compiles register()'s RANSAC kernels (:data:`AHEAD`) so
that the worker running register() finds them cached. The gain is the second core's: on
the shared 2-core development machine (issue 23) a cold ``make demo`` took 47 s with the
machine nearly idle (load ~2-4), while under load ~6 the workers only share the busy cores
(137-141 s serial, 143-149 s in workers).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from pointalign import _progress, _validate, datasets

#: points of the subsampled pair for the annealing methods (their kernels do not change
#: with the size; the full scans would only spend time)
SOFT_POINTS = 1500


def _steps(device: torch.device) -> list[tuple[str, Callable[[], Any]]]:
    """(name, call) for every public method, on the bundled pair moved to ``device``."""
    import pointalign as pa

    pair = datasets.load_bunny_pair()
    src, tgt = pair.source.to(device), pair.target.to(device)
    init = pair.T_target_source
    small_s = datasets.random_subsample(pair.source, SOFT_POINTS, seed=0).to(device)
    small_t = datasets.random_subsample(pair.target, SOFT_POINTS, seed=1).to(device)
    return [
        ("register", lambda: pa.register(src, tgt, device=device)),
        ("icp (point-to-point)", lambda: pa.icp(src, tgt, init=init, device=device,
                                                max_correspondence_distance=0.005)),
        ("icp (point-to-plane)", lambda: pa.icp(src, tgt, init=init, device=device,
                                                max_correspondence_distance=0.005,
                                                method="point_to_plane")),
        ("gicp", lambda: pa.gicp(src, tgt, init=init, device=device,
                                 max_correspondence_distance=0.005)),
        ("emicp", lambda: pa.emicp(small_s, small_t, init=init, device=device)),
        ("softassign", lambda: pa.softassign(small_s, small_t, init=init, device=device)),
        ("surface_newton", lambda: pa.surface_newton(src, tgt, init=init, device=device)),
    ]


#: the parallel CPU warm-up's first job beside ``register``: the kernels of register()'s late
#: stages (RANSAC's feature matches, its compatibility graph, the scoring grid: ~15 s of
#: compiler CPU) compiled on small random inputs of the same types, so that they are in the
#: cache by the time the worker running register() reaches them
AHEAD = "register's RANSAC kernels (ahead)"


def _ransac_ahead() -> None:
    """Compile register()'s RANSAC kernels on random float32 inputs (their types there).

    The signatures were checked against a cold register()'s compile log
    (``benchmarks/bench_first_call.py --compile-table``): the same types, so the worker
    running register() loads these from the cache instead of compiling them again.
    """
    from pointalign.kernels import ransac

    g = torch.Generator().manual_seed(0)
    fs, ft = torch.rand(64, 33, generator=g), torch.rand(80, 33, generator=g)
    ransac.feature_matches(fs, ft, 2, backward=True)
    ps, pt = torch.rand(40, 3, generator=g), torch.rand(40, 3, generator=g)
    ransac.second_order_of_points(ps, pt, 0.01)
    from pointalign.search import build_index

    pts = torch.rand(500, 3, generator=g)
    T = torch.eye(4).repeat(8, 1, 1)
    T[:, :3, 3] = 0.01 * torch.rand(8, 3, generator=g)
    ransac.score_transforms(T, pts, build_index(pts), 0.05, with_matches=True)


def _run_step(name: str, device: str) -> float:
    """Worker process: run the step ``name`` of :func:`_steps` on ``device``; its seconds."""
    dev = torch.device(device)
    call = _ransac_ahead if name == AHEAD else dict(_steps(dev))[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = time.perf_counter()
        call()
    return time.perf_counter() - t


def default_workers(device: torch.device) -> int:
    """Return the processes a warm-up uses: one per core on a cold CPU cache, else 1.

    With kernels already cached a step takes a fraction of a second and a worker's start
    (importing torch) would cost more than it saves; Triton compiles in the one process.
    """
    from pointalign.kernels import _numba

    if device.type != "cpu" or not _numba.available() or _numba.cached_kernels() > 0:
        return 1
    return max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else (os.cpu_count() or 1), 4))


def _parallel(names: list[str], dev: torch.device, workers: int,
              bar: Any) -> dict[str, float]:
    """Run the named steps in ``workers`` spawned processes, longest (the first) first."""
    import concurrent.futures as cf
    import multiprocessing

    seconds: dict[str, float] = {}
    order = list(names)
    if dev.type == "cpu" and "register" in order:  # register()'s late kernels beside it
        order.insert(order.index("register") + 1, AHEAD)
    ctx = multiprocessing.get_context("spawn")  # no forked numba/torch thread pools
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        jobs = {pool.submit(_run_step, name, str(dev)): name for name in order}
        for job in cf.as_completed(jobs):
            seconds[jobs[job]] = job.result()
            if jobs[job] in names:
                bar.advance()
    return {name: seconds[name] for name in names}


def warmup(device: str | torch.device | None = None, *,
           quiet: bool | None = None, workers: int | None = None) -> dict[str, float]:
    """Run every public method once on ``device`` so that its kernels are compiled and cached.

    Args:
        device: "cpu", "cuda" or a torch.device (default: CUDA when present, else the CPU).
        quiet: True: no progress bar; None: a bar on a terminal only.
        workers: processes that run the steps side by side (default
            :func:`default_workers`: one per core, at most 4, where numba's cache is empty
            on the CPU, else 1: this process).

    Returns:
        Seconds spent per method, in the order of the steps (a second warm-up takes a
        fraction of the first: the kernels then come from the disk caches).

    """
    dev = _validate.resolve_device(device)
    if workers is None:
        workers = default_workers(dev)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    seconds: dict[str, float] = {}
    steps = _steps(dev)
    with warnings.catch_warnings(), \
            _progress.task(f"compiling for {dev.type}", total=len(steps), quiet=quiet) as bar:
        warnings.simplefilter("ignore")  # results on the bundled pair are not the point
        if workers > 1:
            return _parallel([name for name, _ in steps], dev, workers, bar)
        for name, call in steps:
            t = time.perf_counter()
            call()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            seconds[name] = time.perf_counter() - t
            bar.advance()
    return seconds
