"""Before any work: the units check, and estimates of long work announced before it starts.

* :func:`check_units`: the two clouds' scales, and every length a caller gave, compared
  before any work (a 20× mismatch warns, naming the likely unit mix-up; 1000× fails).
* :func:`estimate_icp_seconds`, :func:`estimate_register_seconds`, :func:`announce_icp`:
  the cost models of the long calls, measured on the 2-core development machine, scaled by
  the machine's free share (:func:`pointalign._threads.host_share`).
* :func:`inner`: a composite call (``register``) checks and announces once; the
  registrations it runs on clouds it derived say nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from pointalign import _progress, _threads
from pointalign.registration._edge import Pair, prepare_pair

#: scales (the two clouds' extents, a length given against them) that differ by more than
#: this factor warn (:class:`~pointalign._progress.UnitsWarning`) ...
UNITS_WARN = 20.0
#: ... and by more than this one, no registration can work: ValueError
UNITS_FAIL = 1000.0

#: the unit mix-ups a ratio of scales points to, nearest first (within a factor of 1.6)
_UNIT_RATIOS = ((1000.0, "millimetres", "metres"), (100.0, "centimetres", "metres"),
                (10.0, "millimetres", "centimetres"), (25.4, "millimetres", "inches"),
                (39.37, "inches", "metres"), (304.8, "millimetres", "feet"),
                (1e6, "micrometres", "metres"))


def spacing(extent: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Typical point spacing of ``count`` points on a surface of RMS radius ``extent``: ``(B,)``.

    ``extent · sqrt(4π / count)``: a sphere of that radius sampled evenly. A cloud that
    fills a volume is sparser than this, a line denser; both scans and objects are surfaces.
    """
    return np.asarray(extent, np.float64) * np.sqrt(4 * np.pi / np.maximum(count, 1))


def _unit_guess(ratio: float, big: str, small: str) -> str:
    """``"; source in millimetres and target in metres?"`` for a ratio near 1000, else ``""``."""
    best = min(_UNIT_RATIOS, key=lambda u: abs(np.log(ratio / u[0])))
    if abs(np.log(ratio / best[0])) > np.log(1.6):
        return ""
    return f"; {big} in {best[1]} and {small} in {best[2]}?"


#: set inside :func:`inner`: a composite call (``register``, ``register_many``) checked the
#: units and announced its own estimate; the registrations it runs inside say nothing
_INNER: contextvars.ContextVar[bool] = contextvars.ContextVar("pointalign_inner",
                                                              default=False)


@contextlib.contextmanager
def inner() -> Iterator[None]:
    """Within this block :func:`check_units` and :func:`announce_icp` do nothing.

    For composite calls that run registrations on clouds they derived (``register``: the
    downsampled clouds, the coarse and final ICP): the composite checks the units and
    announces its estimate once, on the clouds the user gave.
    """
    token = _INNER.set(True)
    try:
        yield
    finally:
        _INNER.reset(token)


def prepared_pair(source: Any, target: Any, init: Any, dev: torch.device, source_lengths: Any,
                  target_lengths: Any, *, min_points: int = 1, local: bool = True,
                  **lengths: float | Sequence[float] | None
                  ) -> tuple[Pair, Callable[[], None] | None]:
    """Prepare a pair (``_edge.prepare_pair``) for a method whose first work is on the device.

    On CUDA the pair's host part (centroids, extents: one transfer) is left in flight: the
    device starts on the method's first work (an index, normals, covariances, its first
    steps or its whole program) before the host reads it. Returns the pair and
    :func:`check_units` (with ``lengths``) still to run then, or None: elsewhere the check
    has run here, before any work. ``local``: as ``prepare_pair``'s.
    """
    defer = dev.type == "cuda"
    pair = prepare_pair(source, target, init=init, device=dev, source_lengths=source_lengths,
                        target_lengths=target_lengths, min_points=min_points, local=local,
                        defer=defer)

    def units() -> None:
        check_units(pair.resolve(), **lengths)

    if defer:
        return pair, units
    units()
    return pair, None


def check_units(pair: Pair, **lengths: float | Sequence[float] | None) -> None:
    """Compare the clouds' scales, and each given length with them, before any work.

    Every registration entry point calls this right after :func:`prepare_pair` (``register``
    too, on its own pair; on CUDA ``icp`` and ``gicp`` once their first device work is
    enqueued, which a raise here discards), with the lengths it was given
    (``max_correspondence_distance=``, ``voxel_size=``, one length or a sequence of them;
    None: not given). It reads the
    extents :func:`prepare_pair` measured (``pair.source_extent``, ``pair.extent``: RMS
    radii) and the counts, so it costs a few host operations on B numbers.

    * The two clouds' extents differ by more than :data:`UNITS_WARN` (20×):
      :class:`~pointalign._progress.UnitsWarning` naming both and the likely mix-up
      (a ratio near 1000: millimetres against metres).
    * A length above 20× the larger extent, or below 1/20 of the typical point spacing
      (:func:`spacing`: from the extent and the count): UnitsWarning naming the length,
      the scale and the ratio. Beyond :data:`UNITS_FAIL` (1000×) on either side no
      registration can work (a bound 1000× the clouds bounds nothing, and one 1000× below
      the spacing leaves no point a partner): ``ValueError`` naming the argument.

    A cloud of no extent (one point repeated) is left to the degeneracy rules.

    Raises:
        ValueError: a length more than 1000× off the clouds' scale.

    """
    if pair.extent is None or pair.source_extent is None or _INNER.get():
        return

    ext_t, ext_s = np.asarray(pair.extent), np.asarray(pair.source_extent)
    h = np.minimum(spacing(ext_t, pair.target_counts), spacing(ext_s, pair.source_counts))
    where = (lambda b: f" (problem {b})") if pair.size > 1 else (lambda b: "")
    both = (ext_t > 0) & (ext_s > 0)
    ratio = np.where(both, np.maximum(ext_s, ext_t) / np.where(both, np.minimum(ext_s, ext_t),
                                                               1.0), 1.0)
    b = int(np.argmax(ratio))
    if both.any() and ratio[b] > UNITS_WARN:
        big, small = ("source", "target") if ext_s[b] > ext_t[b] else ("target", "source")
        _progress.warn(f"source and target differ in size by {ratio[b]:.0f}×{where(b)}: "
                       f"source extent (RMS radius) {ext_s[b]:.4g}, target extent "
                       f"{ext_t[b]:.4g}{_unit_guess(float(ratio[b]), big, small) or '.'} Both "
                       "must be in the same units (metres by convention)",
                       _progress.UnitsWarning, stacklevel=None)
    big = np.maximum(ext_t, ext_s)
    ok = (big > 0) & (h > 0)
    for name, value in ((n, float(v)) for n, vs in lengths.items()
                        for v in (vs if isinstance(vs, (tuple, list)) else (vs,))
                        if v is not None):
        with np.errstate(divide="ignore", invalid="ignore"):
            over = np.where(ok, value / np.where(ok, big, 1.0), 0.0)
            under = np.where(ok, h / value, 0.0)
        if (over > UNITS_WARN).any():
            b = int(np.argmax(over))
            msg = (f"{name}: {value:.4g} is {over[b]:.0f}× the clouds' extent (RMS radius "
                   f"{big[b]:.4g}){where(b)}")
            guess = "; is it in millimetres, the clouds in metres?" if over[b] >= 100 else "."
            if over[b] > UNITS_FAIL:
                raise ValueError(f"{msg}: no registration can work at that scale{guess} "
                                 f"Give it in the clouds' units (from about their point "
                                 f"spacing, ~{h[b]:.3g}, to a tenth of their extent)")
            _progress.warn(f"{msg}: it bounds nothing{guess}", _progress.UnitsWarning,
                           stacklevel=None)
        elif (under > UNITS_WARN).any():
            b = int(np.argmax(under))
            msg = (f"{name}: {value:.4g} is {under[b]:.0f}× below the clouds' typical point "
                   f"spacing (~{h[b]:.3g}, from their extent {big[b]:.4g} and point "
                   f"counts){where(b)}")
            guess = "; is it in metres, the clouds in millimetres?" if under[b] >= 100 else "."
            if under[b] > UNITS_FAIL:
                raise ValueError(f"{msg}: no point can find a partner that close{guess} "
                                 "Give it in the clouds' units")
            _progress.warn(f"{msg}: few points will find a partner{guess}",
                           _progress.UnitsWarning, stacklevel=None)


#: CPU seconds per point at 2 threads, measured on the shared 2-core machine (load 0.8-5,
#: bunny scans repeated with 0.3 mm noise, 2e5-3e6 points; the spread is the load's): the
#: correspondence index per target point, the target normals (k = 20) per target point,
#: and one ICP iteration per source point (search, fused sums, solve; both methods alike)
ICP_INDEX_S = 1e-7
ICP_NORMALS_S = 2.5e-6
ICP_ITERATION_S = 2.8e-7

#: the iterations an ICP call is estimated at (its cap when lower): point-to-plane
#: converges in 10-30 iterations on scans (11 on a 1M-point bunny from 3°, 30-49 on noisy
#: repeated copies); point-to-point, Anderson-accelerated by default, in 16-24 (bunny
#: pairs, 100k and 1M copies; plain, it creeps through 40-100)
ICP_TYPICAL_ITERATIONS = {"point_to_plane": 20, "point_to_point": 25}

#: register() on the CPU at 2 threads: seconds per 5,000 points of the downsampled clouds
#: (features, RANSAC, hypotheses: ~1 s on the bunny at its default size) and per raw point
#: (voxel edge, outlier test, downsampling); the final ICP on the full clouds is counted as
#: :func:`estimate_icp_seconds` counts an ICP call (index, target normals, iterations). The
#: final ICP starts near the answer, but its iterations depend on the data: 1-3 on a clean
#: 1M-point bunny, 19-26 on bunny copies with 0.3 mm noise (1M, 3M points), where a model
#: that counted it per raw point (2e-6 s, all stages) predicted 0.45-0.6 of the wall time
#: (``benchmarks/bench_estimates.py``); counted at :data:`ICP_TYPICAL_ITERATIONS`, the
#: same runs are predicted within 20 % and the clean 5M-point pair of issue 26 (26.5 s)
#: at 1.7×
REGISTER_PER_5000_S = 1.0
REGISTER_PER_POINT_S = 3e-7


def estimate_icp_seconds(n: int, m: int, *, plane: bool, iterations: int,
                         threads: int | None, normals: bool = True,
                         share: float | None = None) -> float | None:
    """Predict the seconds :func:`~pointalign.icp` takes on the CPU for ``iterations``.

    ``(ICP_INDEX_S · m + ICP_NORMALS_S · m [plane, normals estimated] + iterations ·
    ICP_ITERATION_S · n) · 2 / threads / share``: the constants were measured at 2
    threads, the kernels scale about linearly with threads, and a busy machine gives this
    process only ``share`` of its cores (:func:`pointalign._threads.host_share`).
    :func:`announce_icp` passes the typical count (:data:`ICP_TYPICAL_ITERATIONS`, or the
    cap when lower).

    Args:
        n: source points (all problems of a batch).
        m: target points (each distinct target once).
        plane: point-to-plane (target normals estimated unless ``normals`` is False).
        iterations: the iterations to count.
        threads: the host's threads (:func:`pointalign._threads.host_threads`); None: the
            work runs on a GPU, no CPU estimate (returns None).
        normals: whether point-to-plane estimates the target normals (False: given).
        share: the share of the cores this process gets (None: measured now).

    """
    if threads is None:
        return None
    work = ICP_INDEX_S * m + iterations * ICP_ITERATION_S * n
    if plane and normals:
        work += ICP_NORMALS_S * m
    return work * 2.0 / max(threads, 1) / _share(share)


def _share(share: float | None) -> float:

    return _threads.host_share() if share is None else max(float(share), 1e-3)


def estimate_register_seconds(n: int, m: int, *, target_points: int,
                              threads: int | None, share: float | None = None,
                              iterations: int | None = None, refine: bool = True
                              ) -> float | None:
    """Predict the seconds :func:`~pointalign.register` takes on the CPU (None on a GPU).

    ``(REGISTER_PER_5000_S · target_points / 5000 + REGISTER_PER_POINT_S · (n + m)) · 2 /
    threads / share`` for ``n`` + ``m`` raw points (as :func:`estimate_icp_seconds`), plus
    the final point-to-plane ICP on the full clouds (``refine``) as
    :func:`estimate_icp_seconds` counts it at ``iterations`` (default: the typical count,
    :data:`ICP_TYPICAL_ITERATIONS`); the pipeline's ``_warn_register`` announces it with
    :func:`pointalign._progress.announce`.
    """
    if threads is None:
        return None
    sh = _share(share)
    own = (REGISTER_PER_5000_S * max(target_points, 1) / 5000
           + REGISTER_PER_POINT_S * (n + m)) * 2.0 / max(threads, 1) / sh
    if not refine:
        return own
    its = ICP_TYPICAL_ITERATIONS["point_to_plane"] if iterations is None else iterations
    final = estimate_icp_seconds(n, m, plane=True, iterations=its, threads=threads, share=sh)
    return own + (final or 0.0)


#: GICP on the CPU at 2 threads, from ``benchmarks/results/gicp-cpu.json`` (KITTI pair,
#: 25k + 25k points after 0.25 m voxels: covariances 108-140 ms, 5-9 iterations 22-99 ms):
#: seconds per point for its k = 20 covariances (each cloud), per source point per iteration
GICP_COVARIANCE_S = 2.8e-6
GICP_ITERATION_S = 1.2e-6
#: iterations a GICP/VGICP call typically takes to its stopping rule (the same runs: 4-9)
GICP_TYPICAL_ITERATIONS = 10


def estimate_gicp_seconds(n: int, m: int, *, iterations: int, threads: int | None,
                          covariances: int | None = None,
                          share: float | None = None) -> float | None:
    """Predict the seconds :func:`~pointalign.gicp` / :func:`~pointalign.vgicp` take on the CPU.

    ``(GICP_COVARIANCE_S · c + iterations · GICP_ITERATION_S · n) · 2 / threads / share``
    with ``c`` the points whose covariances are estimated (default ``n + m``), as
    :func:`estimate_icp_seconds` scales its constants. None where the work runs on a GPU.
    """
    if threads is None:
        return None
    c = n + m if covariances is None else covariances
    work = GICP_COVARIANCE_S * c + iterations * GICP_ITERATION_S * n
    return work * 2.0 / max(threads, 1) / _share(share)


def announce_gicp(pair: Pair, method: str, cap: int, covariances: int) -> None:
    """Announce a GICP/VGICP call estimated above 5 s on the CPU (:func:`estimate_gicp_seconds`).

    ``covariances``: how many points get their covariances estimated in this call (given
    ones cost nothing).
    """
    if _INNER.get():
        return
    threads = _threads.host_threads(pair.device)
    n = int(pair.source_counts.sum())
    m = int(pair.target_counts[0] if pair.shared_target else pair.target_counts.sum())
    est = estimate_gicp_seconds(n, m, iterations=min(cap, GICP_TYPICAL_ITERATIONS),
                                threads=threads, covariances=covariances)
    _progress.announce(f"{method} on {n:,} + {m:,} points on the CPU ({threads} threads, at "
                       f"most {cap} iterations)", est,
                       "downsample the clouds first (pointalign.voxel_downsample) or use a "
                       "GPU")


#: the distance-map methods (surface_newton, approximate_icp) on the CPU at 2 threads, per
#: point of source + target, tree and approximants included: 1.7e-6 s on the LiDAR pair
#: (70k + 69k points, 0.23-0.24 s) and 1.9e-6 s on the bunny pair (40k + 40k, 0.15 s)
#: (``benchmarks/results/tranche3_cpu_ab-cpu.json``)
SURFACE_PER_POINT_S = 1.8e-6


def estimate_surface_seconds(n: int, m: int, *, threads: int | None,
                             share: float | None = None) -> float | None:
    """Predict the seconds a distance-map method takes on the CPU: ``(n + m)`` points.

    ``SURFACE_PER_POINT_S · (n + m) · 2 / threads / share``; None where it runs on a GPU.
    """
    if threads is None:
        return None
    return SURFACE_PER_POINT_S * (n + m) * 2.0 / max(threads, 1) / _share(share)


def announce_surface(pair: Pair, method: str) -> None:
    """Announce a distance-map call estimated above 5 s on the CPU."""
    if _INNER.get():
        return
    threads = _threads.host_threads(pair.device)
    n, m = int(pair.source_counts.sum()), int(pair.target_counts.sum())
    _progress.announce(f"{method} on {n:,} + {m:,} points on the CPU ({threads} threads)",
                       estimate_surface_seconds(n, m, threads=threads),
                       "downsample the clouds first (pointalign.voxel_downsample) or use a "
                       "GPU")


def announce_icp(pair: Pair, method: str, cap: int, normals: bool) -> None:
    """Announce an ICP call estimated above 5 s on the CPU (:func:`estimate_icp_seconds`).

    Counted at :data:`ICP_TYPICAL_ITERATIONS` of ``method`` (``cap`` when lower); the
    counted bar (``track(..., total=cap)``) then shows the iterations as they run.
    """
    if _INNER.get():
        return
    threads = _threads.host_threads(pair.device)
    n = int(pair.source_counts.sum())
    m = int(pair.target_counts[0] if pair.shared_target else pair.target_counts.sum())
    est = estimate_icp_seconds(n, m, plane=method == "point_to_plane",
                               iterations=min(cap, ICP_TYPICAL_ITERATIONS.get(method, cap)),
                               threads=threads, normals=normals)
    _progress.announce(f"ICP ({method}) on {n:,} + {m:,} points on the CPU ({threads} "
                       f"threads, at most {cap} iterations)", est,
                       "downsample the clouds first (pointalign.voxel_downsample) or use a "
                       "GPU")
