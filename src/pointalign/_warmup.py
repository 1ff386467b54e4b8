"""Compile what a device needs before the first real call: ``pointalign warmup``.

A fresh machine pays for compilation on its first calls: numba compiles the CPU kernels
and Triton the GPU kernels; both are cached on disk afterwards, so this is paid once per
machine. :func:`warmup` runs public methods once on the bundled bunny pair,
with a progress bar, so that the cost is paid at installation (``make demo`` runs it)
rather than inside a user's first call. By default it warms what the demo and a first
``register()`` need (:data:`DEMO_STEPS`); ``every_method=True`` (``pointalign warmup
--all``) every public method. A method not warmed compiles on its first use, announced with
its estimate and a bar (:func:`pointalign.kernels._numba.first_use`).

numba compiles on one thread per process, so on a CPU where the steps' kernels are not
cached yet the kernels themselves are shared out over one worker process per core: the
compile manifest (:data:`pointalign.kernels._numba.MANIFEST`) lists, per step, every kernel
with its argument types and its measured compile seconds; the pending ones go to the pool
longest first (each worker takes the next kernel when it is free: a longest-processing-
time schedule), each compiled once and written to the common disk cache. The steps then
run in this process and load them (anything the manifest missed compiles there). On a GPU
the Triton manifest does the same for the steps' Triton kernels, in forked processes
(:mod:`pointalign.kernels._precompile`).
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
#: on a GPU EM-ICP also runs once at this size, whose passes leave out far tiles (at least
#: ``kernels.soft.triton.CULL_MIN_POINTS``): that form's kernels are compiled too
SOFT_CULLED_POINTS = 20000

#: points of the k-d tree the GPU's icp step also builds: the kernels of large builds (a
#: cold icp() on a 1M-point pair compiled one, its presort's unpacked keys, in session 27)
LARGE_TREE_POINTS = 1 << 20

#: the steps a plain ``pointalign warmup`` runs: what ``pointalign demo`` (register()) and
#: a first register() need; ``--all`` runs every step of :func:`_steps`
DEMO_STEPS = ("register",)

#: seconds of pending compile work below which a second process would not pay for itself
#: (a worker's start imports torch: ~1.5 s)
PARALLEL_MIN_S = 8.0


def _steps(device: torch.device) -> list[tuple[str, Callable[[], Any]]]:
    """(name, call) for every public method, on the bundled pair moved to ``device``."""
    import pointalign as pa

    pair = datasets.load_bunny_pair()
    src, tgt = pair.source.to(device), pair.target.to(device)
    init = pair.T_target_source
    small_s = datasets.random_subsample(pair.source, SOFT_POINTS, seed=0).to(device)
    small_t = datasets.random_subsample(pair.target, SOFT_POINTS, seed=1).to(device)
    mid_s = datasets.random_subsample(pair.source, SOFT_CULLED_POINTS, seed=0).to(device)
    mid_t = datasets.random_subsample(pair.target, SOFT_CULLED_POINTS, seed=1).to(device)

    def emicp() -> Any:
        out = pa.emicp(small_s, small_t, init=init, device=device)
        if device.type == "cuda":
            pa.emicp(mid_s, mid_t, init=init, device=device)
        return out

    def icp() -> Any:
        if device.type == "cuda":  # a 1M-point k-d tree: large builds presort otherwise
            g = torch.Generator(device=device).manual_seed(0)
            pa.search.build_index(torch.rand(LARGE_TREE_POINTS, 3, generator=g,
                                             device=device), method="kdtree")
        return pa.icp(src, tgt, init=init, device=device, max_correspondence_distance=0.005)

    return [
        ("register", lambda: pa.register(src, tgt, device=device)),
        ("icp (point-to-point)", icp),
        ("icp (point-to-plane)", lambda: pa.icp(src, tgt, init=init, device=device,
                                                max_correspondence_distance=0.005,
                                                method="point_to_plane")),
        ("gicp", lambda: pa.gicp(src, tgt, init=init, device=device,
                                 max_correspondence_distance=0.005)),
        ("vgicp", lambda: pa.vgicp(src, tgt, init=init, device=device, voxel_size=0.005)),
        ("emicp", emicp),
        ("softassign", lambda: pa.softassign(small_s, small_t, init=init, device=device)),
        ("surface_newton", lambda: pa.surface_newton(src, tgt, init=init, device=device)),
    ]


def _compile(kernel: str, args: str) -> float:
    """Worker process: compile (or load) ``kernel`` for ``args``; its seconds."""
    from pointalign.kernels import _numba

    t = time.perf_counter()
    d, sig = _numba.dispatcher(kernel), _numba.signature(args)
    if d is not None and sig is not None:
        d.compile(sig)
    return time.perf_counter() - t


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else (os.cpu_count() or 1)


def default_workers(device: torch.device, steps: tuple[str, ...] = DEMO_STEPS) -> int:
    """Return the processes a warm-up uses: one per core (at most 4), or 1.

    One per core on the CPU where the ``steps``' pending kernels take over
    :data:`PARALLEL_MIN_S` to compile, else 1. With the kernels already cached a step
    takes a fraction of a second and a worker's start (importing torch) would cost more
    than it saves; Triton compiles in the one process.
    """
    from pointalign.kernels import _numba

    if device.type != "cpu" or not _numba.available():
        return 1
    if sum(s for _, _, s in _numba.pending(steps)) < PARALLEL_MIN_S:
        return 1
    return max(1, min(_cores(), 4))


def _parallel(todo: list[tuple[str, str, float]], workers: int, bar: Any) -> float:
    """Compile the kernels ``todo`` in ``workers`` spawned processes, longest first."""
    import concurrent.futures as cf
    import multiprocessing

    t = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")  # no forked numba/torch thread pools
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        jobs = [pool.submit(_compile, kernel, args) for kernel, args, _ in todo]
        for job in cf.as_completed(jobs):
            job.result()
            bar.advance()
    return time.perf_counter() - t


def warmup(device: str | torch.device | None = None, *, quiet: bool | None = None,
           workers: int | None = None, every_method: bool = False) -> dict[str, float]:
    """Run public methods once on ``device`` so that their kernels are compiled and cached.

    Args:
        device: "cpu", "cuda" or a torch.device (default: CUDA when present, else the CPU).
        quiet: True: no progress bar; None: a bar on a terminal only.
        workers: processes that compile the CPU kernels side by side (default
            :func:`default_workers`: one per core, at most 4, where numba's cache lacks
            several seconds of them, else 1: this process).
        every_method: False: what the demo and a first ``register()`` need
            (:data:`DEMO_STEPS`); True: every public method (the others otherwise compile
            on their first use, announced).

    Returns:
        Seconds per step, in the order of the steps, after a first entry for the parallel
        compile where there is one (a second warm-up takes a fraction of the first: the
        kernels then come from the disk caches).

    """
    dev = _validate.resolve_device(device)
    steps = [(n, c) for n, c in _steps(dev) if every_method or n in DEMO_STEPS]
    names = tuple(n for n, _ in steps)
    if workers is None:
        workers = default_workers(dev, names)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    from pointalign.kernels import _numba, _precompile

    todo = _numba.pending(names) if workers > 1 and dev.type == "cpu" else []
    seconds: dict[str, float] = {}
    silent, _numba._silent = _numba._silent, True  # the bar below says it
    try:
        with warnings.catch_warnings(), \
                _progress.task(f"compiling for {dev.type}", total=len(todo) + len(steps),
                               quiet=quiet) as bar:
            warnings.simplefilter("ignore")  # results on the bundled pair are not the point
            if todo:
                seconds[f"{len(todo)} kernels in {workers} processes"] = \
                    _parallel(todo, workers, bar)
            ahead = _precompile.ensure(names, dev)  # GPU: every step's kernels at once
            if ahead is not None:
                seconds["Triton kernels: prebuilt or compiled in parallel"] = ahead
            missed = _numba.compiles()
            for name, call in steps:
                t = time.perf_counter()
                call()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                seconds[name] = time.perf_counter() - t
                bar.advance()
            missed = _numba.compiles() - missed
    finally:
        _numba._silent = silent
    if todo and missed:  # compiled here, serially: the manifest lacks them
        _progress.logger.info(
            "warm-up: %d kernels were not in the compile manifest and compiled serially "
            "(benchmarks/bench_first_call_cpu.py --compile-table --manifest writes it anew)",
            missed)
    return seconds
