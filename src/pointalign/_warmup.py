"""Compile what a device needs before the first real call: ``pointalign warmup``.

A fresh machine pays for compilation on its first calls: numba compiles the CPU kernels
(about a minute on 2 cores) and Triton the GPU kernels (about 20 s); both are cached on
disk afterwards, so this is paid once per machine. :func:`warmup` runs each public method
once on the bundled bunny pair, with a progress bar, so that the cost is paid at
installation (``make demo`` runs it) rather than inside a user's first registration.
"""

from __future__ import annotations

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


def warmup(device: str | torch.device | None = None, *,
           quiet: bool | None = None) -> dict[str, float]:
    """Run every public method once on ``device`` so that its kernels are compiled and cached.

    Args:
        device: "cpu", "cuda" or a torch.device (default: CUDA when present, else the CPU).
        quiet: True: no progress bar; None: a bar on a terminal only.

    Returns:
        Seconds spent per method, in the order run (a second warm-up takes a fraction of
        the first: the kernels then come from the disk caches).

    """
    dev = _validate.resolve_device(device)
    seconds: dict[str, float] = {}
    steps = _steps(dev)
    with warnings.catch_warnings(), \
            _progress.task(f"compiling for {dev.type}", total=len(steps), quiet=quiet) as bar:
        warnings.simplefilter("ignore")  # results on the bundled pair are not the point
        for name, call in steps:
            t = time.perf_counter()
            call()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            seconds[name] = time.perf_counter() - t
            bar.advance()
    return seconds
