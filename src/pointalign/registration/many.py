"""register_many(): many pairs at once, batched on one device or in chunks on a Dask cluster.

On one device the pairs run chunk by chunk (``chunk_size`` pairs), and inside a chunk
through the stages of :func:`~pointalign.registration.pipeline.register` (the same
functions, so the same options and the same rules):

1. **read** each cloud (paths are read here, on the worker that runs the chunk);
2. **global stage**: on a GPU, batched for the chunk's pairs without an ``init``
   (:mod:`~pointalign.registration.many_global`: the voxel edges v and stray decisions
   of all pairs by a few host synchronisations, one downsampling sort, one packed
   neighbour search, the normal and FPFH kernels once, RANSAC's rounds and the
   compatibility-graph proposals for all pairs at once; the rule is
   :func:`~pointalign.registration.many_global.applies`), else per pair
   (``pipeline._prepare_pair``: v and stray points, downsampling, normals, FPFH;
   ``pipeline._global``: parallel RANSAC and the graph's proposals); a pair given an
   ``init`` is only downsampled and indexed;
3. **coarse ICP, batched**: ``pipeline._refine_hypotheses`` of every pair's best
   hypotheses in one point-to-plane :func:`~pointalign.registration.icp.icp` call (on a
   GPU the candidates' inlier counts, the overlap counts and the rankings of all pairs at
   once: :func:`~pointalign.registration.many_global.refine_many`);
4. **final stage, batched**: ``pipeline._final_icp`` (point-to-plane ICP or GICP, as
   ``refine`` says), pairs grouped by size and padded; on a GPU the full clouds scaled and
   the targets' normals found for all pairs at once
   (:func:`~pointalign.registration.many_global.final_clouds_many`), else per pair
   (``pipeline._final_clouds``);
5. **verdict, batched**: :func:`~pointalign.registration.verdict.verdicts` (on a GPU
   :func:`~pointalign.registration.many_global.verdicts_many`: the counts of all pairs by
   one search), one transfer for the group.

``timings`` splits the stages: ``read.io`` / ``read.prepare`` (host clock only),
``global.<part>`` (the batched global stage), ``local.<part>`` (``rows``, ``coarse_rank`` /
``coarse_icp`` / ``coarse_overlap`` on a GPU or ``coarse`` per pair, ``final_clouds``,
``final_prepare``, ``final_icp``, ``verdict``): seconds summed over pairs, the device
synchronised once at each part's end (once per group, not per pair).

A pair's voxel edge v differs from pair to pair, and one ICP call takes one bound: each pair
is registered in its own frame, centred on its target's centroid (in float64) and **scaled
by 1/v** (``Scales(1, …)``), so that every bound is the same number of voxels for the whole
batch (pairs whose overridden bounds differ in voxels go in different batches). Poses come
back in the caller's coordinates: ``T = S(c, v) T_scaled S(c, v)⁻¹``.

With ``client=`` (a ``distributed.Client``) each chunk is one Dask task; clouds given as
paths are read on the worker. Dask reruns the tasks of a worker that dies (up to its
``distributed.scheduler.allowed-failures``) and ``retries=`` reruns a task that raised;
results are gathered by pair index, each pair exactly once.

On the CPU a pair of at most :data:`SERIAL_POINTS` points runs on one thread: the pairs,
not the kernels, are the parallel work. To use several cores, pass the client of a local
cluster with one single-threaded worker process per core
(``distributed.LocalCluster(n_workers=cores, threads_per_worker=1)``).
"""

from __future__ import annotations

import contextlib
import csv
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from pointalign import _progress, _threads, _validate
from pointalign.kernels import _loop
from pointalign.registration import _edge
from pointalign.registration import many_global as _mg
from pointalign.registration.options import Options as _Options
from pointalign.registration.options import check
from pointalign.registration.pipeline import (
    Prepared,
    Scales,
    _final_clouds,
    _final_icp,
    _global,
    _prepare_pair,
    _refine_hypotheses,
    icp_criteria,
)
from pointalign.registration.ransac import count_inliers
from pointalign.registration.result import RegistrationResult
from pointalign.registration.verdict import verdicts

PathLike = (str, os.PathLike)

#: pairs per chunk by default: a Dask task costs 0.2-1 ms of scheduler time, and one
#: batched ICP launch per stage serves the whole chunk (a GPU takes many; a CPU worker
#: gains nothing from more than a few)
CHUNK_CUDA = 256
CHUNK_CPU = 8

#: on the CPU, a pair whose clouds have at most this many points runs its stages on one
#: thread (the pairs of a run parallelise across Dask workers instead): a parallel region
#: over a few thousand points costs more in wake-ups and barriers than it saves, and on a
#: loaded machine each barrier waits for a descheduled thread. Measured on the shared
#: 2-core machine (load 11-13): 16 pairs of 2,000 points 60.4-60.7 s with 2 threads against
#: 8.8-10.1 s with one; a k-d tree build of 500 points 130 ms against 1 ms
SERIAL_POINTS = 20_000

#: the columns of :meth:`ManyResult.to_rows` (``T00`` … ``T33``: the transformation, row-major)
COLUMNS = ("index", "name", *(f"T{r}{c}" for r in range(4) for c in range(4)), "fitness",
           "rmse", "verdict", "trusted", "converged", "stop_reason", "iterations",
           "voxel_size", "overlap", "margin", "concentration", "stability", "error",
           "read_s", "global_s", "local_s", "total_s")


@dataclass(frozen=True)
class PairSpec:
    """One registration problem of :func:`register_many`.

    Attributes:
        source: ``(N, 3)`` cloud (array, tensor or PointCloud) or a file path.
        target: ``(M, 3)`` cloud or a file path.
        name: a label for the table (default: the index, or ``source->target`` of paths).
        init: ``(4, 4)`` initial ``T_target_source``; given, the global stage is skipped.

    """

    source: Any
    target: Any
    name: str = ""
    init: np.ndarray | None = None


@dataclass(frozen=True)
class ManyResult:
    """The table of :func:`register_many`: one row per pair, in the order given.

    Attributes:
        rows: one dict per pair with the keys of :data:`COLUMNS` except the sixteen
            ``Tij`` (a row holds ``transformation``: ``(4, 4)`` float64 NumPy, mapping the
            source into the target frame) plus ``info``: ``H``, the final ICP's 6×6
            information matrix (twist about ``H_center``, the target's centroid, metres),
            ``correspondences``, ``icp_converged``, ``icp_stop_reason`` and
            ``coarse_iterations``. ``stop_reason`` and ``iterations`` mean what they mean
            in :func:`~pointalign.registration.pipeline.register`'s result: the verdict's
            reason, the final stage's iterations.
        timings: seconds for the whole call (``total``) and summed per stage.

    """

    rows: list[dict[str, Any]]
    timings: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Return row i (a dict)."""
        return self.rows[i]

    @property
    def transformations(self) -> np.ndarray:
        """``(K, 4, 4)`` float64: every pair's ``T_target_source``."""
        return np.stack([r["transformation"] for r in self.rows]) if self.rows \
            else np.zeros((0, 4, 4))

    def to_rows(self) -> list[dict[str, Any]]:
        """Flat rows (the keys of :data:`COLUMNS`; plain Python numbers and strings)."""
        out = []
        for r in self.rows:
            flat = {k: r.get(k) for k in COLUMNS if not (k.startswith("T") and len(k) == 3)}
            T = np.asarray(r["transformation"], dtype=np.float64).reshape(16)
            flat.update({f"T{i // 4}{i % 4}": float(T[i]) for i in range(16)})
            out.append({k: _plain(flat[k]) for k in COLUMNS})
        return out

    def to_csv(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_rows` as CSV (a header of :data:`COLUMNS`); returns the path."""
        p = Path(path)
        with p.open("w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(COLUMNS))
            w.writeheader()
            w.writerows(self.to_rows())
        return p

    def to_pandas(self) -> Any:
        """:meth:`to_rows` as a ``pandas.DataFrame`` (needs pandas)."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("to_pandas needs pandas: pip install pandas") from None
        return pd.DataFrame(self.to_rows(), columns=list(COLUMNS))

    def to_parquet(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_rows` as Parquet (needs pyarrow); returns the path."""
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("to_parquet needs pyarrow: pip install pyarrow") from None
        rows = self.to_rows()
        table = pa.table({k: [r[k] for r in rows] for k in COLUMNS})
        pq.write_table(table, str(path))
        return Path(path)


def _plain(v: Any) -> Any:
    if isinstance(v, (np.bool_,)):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    return v


# ---------------------------------------------------------------------------- the pairs

def _specs(pairs: Iterable[Any]) -> list[PairSpec]:
    """Normalise ``pairs`` to :class:`PairSpec` (names default to paths or the index)."""
    if isinstance(pairs, (str, os.PathLike)) or not isinstance(pairs, Iterable):
        raise TypeError("pairs: expected a sequence of (source, target) pairs, PairSpec or "
                        f"dicts, got {type(pairs).__name__}")
    out = []
    for i, p in enumerate(pairs):
        if isinstance(p, PairSpec):
            spec = p
        elif isinstance(p, dict):
            if "source" not in p or "target" not in p:
                raise ValueError(f"pairs[{i}]: a dict needs 'source' and 'target'")
            spec = PairSpec(p["source"], p["target"], str(p.get("name") or ""), p.get("init"))
        elif hasattr(p, "source") and hasattr(p, "target"):  # e.g. datasets.Pair
            spec = PairSpec(p.source, p.target, str(getattr(p, "name", "") or ""))
        elif isinstance(p, (tuple, list)) and len(p) in (2, 3):
            spec = PairSpec(p[0], p[1], "", p[2] if len(p) == 3 else None)
        else:
            raise TypeError(f"pairs[{i}]: expected (source, target), (source, target, init), "
                            f"a dict or a PairSpec, got {type(p).__name__}")
        init = None if spec.init is None else _validate.as_transform(
            spec.init, f"pairs[{i}].init", device="cpu", dtype=torch.float64).numpy()
        name = spec.name or (f"{Path(spec.source).name}->{Path(spec.target).name}"
                             if isinstance(spec.source, PathLike)
                             and isinstance(spec.target, PathLike) else str(i))
        out.append(PairSpec(spec.source, spec.target, name, init))
    return out


# ---------------------------------------------------------------------------- entry point

@_threads.per_call
@_validate.out_of_memory_is_clear
def register_many(
    pairs: Iterable[Any],
    *,
    device: str | torch.device | None = None,
    client: Any = None,
    chunk_size: int | None = None,
    retries: int = 2,
    on_error: str = "raise",
    progress: bool | None = None,
    **register_options: Any,
) -> ManyResult:
    """Register many pairs, batched on one device or as chunks of pairs on a Dask cluster.

    Every pair goes through :func:`~pointalign.registration.pipeline.register`'s stages
    (see the module docstring for what runs per pair and what runs batched); pairs with an
    ``init`` run the local stages only. The same pairs, options and ``chunk_size`` give the
    same table on one device and on a cluster of workers of that device kind (each chunk
    is registered the same way wherever it runs).

    Args:
        pairs: a sequence of ``(source, target)`` or ``(source, target, init)`` tuples,
            dicts with those keys (and ``name``), :class:`PairSpec` or
            :class:`pointalign.datasets.Pair`; a cloud is an ``(N, 3)`` array/tensor, a
            PointCloud or a file path (read by :func:`pointalign.io.read` where the chunk
            runs). ``init``: ``(4, 4)`` initial ``T_target_source``.
        device: compute device (default: CUDA when present, else the CPU; on a cluster,
            each worker's own default).
        client: a ``distributed.Client``: run each chunk as one task on its workers.
        chunk_size: pairs per chunk (default: :data:`CHUNK_CUDA` on a GPU,
            :data:`CHUNK_CPU` on a CPU; on a cluster, by its workers' devices).
        retries: on a cluster, how often a chunk that raised is run again.
        on_error: ``"raise"`` (default) or ``"record"``: a pair whose input is bad
            (ValueError/TypeError, an unreadable file) gets a row with ``error`` set and
            a NaN transformation instead of stopping the run.
        progress: show a progress bar (None: when the terminal is interactive).
        **register_options: :func:`~pointalign.registration.pipeline.register`'s options,
            checked as it checks them (``voxel_size``, ``refine``, ``target_points``,
            ``hypotheses``, ``icp_voxel_size``, ``max_iterations``, ``seed``,
            ``remove_outliers``, ``robust``, ``max_correspondence_distance``,
            ``icp_max_correspondence_distance`` and RANSAC's); ``voxel_size`` and the
            distances in the clouds' units (metres).

    Returns:
        :class:`ManyResult`: one row per pair in the order given (``to_rows``, ``to_csv``,
        ``to_parquet``, ``to_pandas``).

    """
    t0 = time.perf_counter()
    specs = _specs(pairs)
    opts = check("register_many", register_options)
    if on_error not in ("raise", "record"):
        raise ValueError(f"on_error: expected 'raise' or 'record', got {on_error!r}")
    retries = _validate.integer(retries, "retries", minimum=0)
    if chunk_size is not None:
        chunk_size = _validate.integer(chunk_size, "chunk_size", minimum=1)
    quiet = None if progress is None else not progress
    if client is not None:
        if device is not None:
            raise ValueError("device: with client=, each worker uses its own device "
                             "(CUDA when present); leave device unset")
        rows = _run_distributed(specs, opts, on_error, client, chunk_size, retries,
                                quiet)
    else:
        dev = _validate.as_device(device)
        size = chunk_size or (CHUNK_CUDA if dev.type == "cuda" else CHUNK_CPU)
        rows = []
        items = list(enumerate(specs))
        with _progress.task("register_many", len(specs), quiet=quiet,
                            delay=_progress.LIBRARY_DELAY) as bar:
            for lo in range(0, len(items), size):
                part = items[lo:lo + size]
                rows += run_chunk(part, opts, dev, on_error)
                bar.advance(len(part))
    timings = {"total": time.perf_counter() - t0}
    for k in ("read_s", "global_s", "local_s"):
        timings[k.removesuffix("_s")] = float(sum(r[k] for r in rows))
    for r in rows:  # each stage's split (read, the batched global stage, local), summed
        for stage in ("read", "global", "local"):
            for k, v in r.get(f"{stage}_stages", {}).items():
                timings[f"{stage}.{k}"] = timings.get(f"{stage}.{k}", 0.0) + v
    return ManyResult(rows, timings)


# ---------------------------------------------------------------------------- Dask

def _worker_kind() -> str:
    """Return the device kind a worker registers on by default ("cuda" or "cpu")."""
    return _validate.default_device().type


def _task(part: list[tuple[int, PairSpec]], opts: _Options,
          on_error: str) -> list[dict[str, Any]]:
    """One Dask task: a chunk of pairs on the worker's default device."""
    return run_chunk(part, opts, _validate.default_device(), on_error)


def _run_distributed(specs: list[PairSpec], opts: _Options, on_error: str, client: Any,
                     chunk_size: int | None, retries: int,
                     quiet: bool | None) -> list[dict[str, Any]]:
    """Submit chunks to ``client``, gather the rows as they finish; each pair exactly once."""
    try:
        from distributed import as_completed
    except ImportError:
        raise ImportError("client=: register_many on a cluster needs Dask's distributed: "
                          "pip install 'pointalign[dist]'") from None
    if chunk_size is None:
        kinds = set(client.run(_worker_kind).values())
        chunk_size = CHUNK_CUDA if kinds == {"cuda"} else CHUNK_CPU
    items = list(enumerate(specs))
    parts = [items[lo:lo + chunk_size] for lo in range(0, len(items), chunk_size)]
    # pure=False: a rerun computes again rather than reusing a key's earlier result
    futures = [client.submit(_task, part, opts, on_error, retries=retries, pure=False,
                             key=f"register_many-{lo}-{os.getpid()}-{time.monotonic_ns()}")
               for lo, part in zip(range(0, len(items), chunk_size), parts, strict=True)]
    got: dict[int, dict[str, Any]] = {}
    with _progress.task("register_many", len(specs), quiet=quiet,
                        delay=_progress.LIBRARY_DELAY) as bar:
        for fut in as_completed(futures):
            rows = fut.result()
            new = [r for r in rows if r["index"] not in got]
            got.update({r["index"]: r for r in new})
            bar.advance(len(new))
            fut.release()
    missing = sorted(set(range(len(specs))) - set(got))
    if missing:
        raise RuntimeError(f"register_many: no result for pairs {missing[:10]} (a bug: every "
                           "chunk finished)")
    return [got[i] for i in range(len(specs))]


# ---------------------------------------------------------------------------- one chunk

class _Ready(NamedTuple):
    """A pair after the global stage: its local clouds and their prepared, scaled copies."""

    src: torch.Tensor           # (N, 3) float32 local (the target's centroid at 0), metres
    tgt: torch.Tensor           # (M, 3)
    center: np.ndarray          # (3,) float64 the target's centroid (caller's frame)
    v: float                    # the voxel edge (metres); from here on lengths are in v
    scales: Scales              # Scales(1, …): the lengths in voxels
    source: Prepared            # downsampled, indexed (and described) in the scaled frame
    target: Prepared


@dataclass
class _Work:
    """A pair in flight: what the stages found so far."""

    index: int
    spec: PairSpec
    row: dict[str, Any]
    ready: _Ready | None = None
    glob: RegistrationResult | None = None   # RANSAC's result (scaled frame)
    cands: torch.Tensor | None = None        # (H, 4, 4) float64 global candidates
    refined: torch.Tensor | None = None      # (k, 4, 4) refined hypotheses, best first
    fit_v: torch.Tensor | None = None        # (k,) their overlap counts
    coarse_iterations: int = 0

    @property
    def r(self) -> _Ready:
        """The pair after the global stage."""
        assert self.ready is not None
        return self.ready

    @property
    def hypotheses(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``refined (k, 4, 4)`` and ``fit_v (k,)``, once known."""
        assert self.refined is not None and self.fit_v is not None
        return self.refined, self.fit_v


def _read(x: Any) -> Any:
    if isinstance(x, PathLike):
        from pointalign import io

        return io.read(x)
    return x


def _unscaled(T: np.ndarray, v: float, center: np.ndarray) -> np.ndarray:
    """Scaled local ``T (4, 4)`` → the caller's coordinates, in float64."""
    out = np.array(T, dtype=np.float64)
    out[:3, 3] *= v
    out[:3, 3] += center - out[:3, :3] @ center
    return out


def run_chunk(part: Sequence[tuple[int, PairSpec]], opts: _Options, device: torch.device,
              on_error: str = "raise") -> list[dict[str, Any]]:
    """Register one chunk of ``(index, PairSpec)`` on ``device``; one row dict per pair.

    What a Dask task runs, and what :func:`register_many` runs chunk by chunk on one device.
    """
    single = _threads.torch_single() if device.type == "cpu" else contextlib.nullcontext()
    works = [_Work(i, spec, _empty_row(i, spec.name)) for i, spec in part]
    clock = _loop.Clock(device)
    with single:
        pairs: dict[int, _edge.Pair] = {}
        for w in works:
            t = time.perf_counter()
            try:
                s_in, t_in = _read(w.spec.source), _read(w.spec.target)
                t_io = time.perf_counter()
                pair = _edge.prepare_pair(s_in, t_in, init=w.spec.init, device=device,
                                          min_points=3)
                if pair.batched:
                    raise ValueError("source, target: expected one (N, 3) cloud each, got a "
                                     "batch")
                w.row["read_s"] = time.perf_counter() - t
                # no synchronisation: the prepare part is the host's (its copies may run on)
                w.row["read_stages"] = {"io": t_io - t, "prepare": w.row["read_s"] - t_io + t}
                pairs[id(w)] = pair
            except (ValueError, TypeError, OSError) as exc:
                _fail(w, exc, on_error)
        fresh = [w for w in works if id(w) in pairs and w.spec.init is None]
        batched = fresh if _mg.applies(opts, device, len(fresh)) else []
        for w in works:
            if id(w) not in pairs or w in batched:
                continue
            t = time.perf_counter()
            try:
                pair = pairs[id(w)]
                size = max(pair.source.shape[1], pair.target.shape[1])
                with _validate.trusted(), _serial(device, size):
                    _global_stage(w, pair, opts, clock)
                w.row["global_s"] = time.perf_counter() - t
            except (ValueError, TypeError, OSError) as exc:
                _fail(w, exc, on_error)
        if batched:
            t = time.perf_counter()
            with _validate.trusted():
                stages = _global_stage_batched(batched, pairs, opts, device, on_error)
            share = (time.perf_counter() - t) / len(batched)
            for w in batched:
                w.row["global_s"] = share
                w.row["global_stages"] = {k: v / len(batched) for k, v in stages.items()}
        live = [w for w in works if not w.row["error"]]
        t = time.perf_counter()
        size = max((max(w.r.src.shape[0], w.r.tgt.shape[0]) for w in live if w.ready),
                   default=0)
        with _validate.trusted(), _serial(device, size):
            parts = _local_stages(live, opts, device)
        share = (time.perf_counter() - t) / max(len(live), 1)
    for w in works:
        if not w.row["error"]:
            w.row["local_s"] = share
            w.row["local_stages"] = {k: v / len(live) for k, v in parts.items()}
        w.row["total_s"] = w.row["read_s"] + w.row["global_s"] + w.row["local_s"]
    return [w.row for w in works]


def _serial(device: torch.device, points: int) -> contextlib.AbstractContextManager[None]:
    """One CPU thread for a pair (or group) of at most :data:`SERIAL_POINTS` points."""
    if device.type == "cpu" and points <= SERIAL_POINTS:
        return _threads.threads(1)
    return contextlib.nullcontext()


def _empty_row(i: int, name: str) -> dict[str, Any]:
    return {"index": i, "name": name, "transformation": np.full((4, 4), np.nan),
            "fitness": 0.0, "rmse": math.inf, "verdict": "", "trusted": False,
            "converged": False, "stop_reason": "", "iterations": 0, "voxel_size": math.nan,
            "overlap": math.nan, "margin": math.nan, "concentration": math.nan,
            "stability": math.nan, "error": "", "read_s": 0.0, "global_s": 0.0,
            "local_s": 0.0, "total_s": 0.0, "info": {}}


def _fail(w: _Work, exc: Exception, on_error: str) -> None:
    if on_error == "raise":
        raise type(exc)(f"pairs[{w.index}] ({w.spec.name}): {exc}") from exc
    w.row.update(error=f"{type(exc).__name__}: {exc}", verdict="error")


# ---------------------------------------------------------------------------- stages

def _global_stage(w: _Work, pair: _edge.Pair, opts: _Options, clock: _loop.Clock) -> None:
    """Per pair, in its frame scaled by 1/v: both clouds prepared, the global candidates.

    ``pair``: the checked clouds in their local frame (register()'s float64 shift). A pair
    given an ``init`` needs no features: its clouds are downsampled and indexed (for the
    verdict) and the init is its one hypothesis.
    """
    src, tgt = pair.source[0], pair.target[0]
    start = w.spec.init is not None
    v, scales, source, target = _prepare_pair(src, tgt, opts, None, clock, in_voxels=True,
                                              describe=not start)
    w.ready = _Ready(src, tgt, pair.frame.center[0], v, scales, source, target)
    w.row["voxel_size"] = v
    if not start:
        w.glob, w.cands, _ = _global(source, target, scales, opts, clock)
    elif opts.refine != "none":
        T0 = torch.from_numpy(pair.init[0]).to(src.device)
        T0[:3, 3] /= v
        w.refined = T0[None]
        w.fit_v = count_inliers(w.refined, source.down, target.index, scales.overlap)


def _global_stage_batched(works: list[_Work], pairs: dict[int, _edge.Pair], opts: _Options,
                          device: torch.device, on_error: str) -> dict[str, float]:
    """Run the global stage of ``works`` (no init) at once (:mod:`.many_global`).

    v and the stray decisions of all pairs at once (:func:`.many_global.voxel_sizes`: the
    per-pair rule's results), the strays dropped per pair that shows some, the clouds
    scaled by 1/v in one launch; then every cloud downsampled by one sort, described by one
    search and one launch per kernel, and RANSAC with the graph's proposals for each group
    of pairs sharing a bound.
    Fills each pair's ``ready``, ``glob`` and ``cands`` as :func:`_global_stage` does.
    Returns the seconds per stage for the whole group.
    """
    clock = _loop.Clock(device)
    mcd, fine = opts.max_correspondence_distance, opts.icp_max_correspondence_distance
    todo: list[_Work] = []
    clouds: list[torch.Tensor] = []
    meta: dict[int, tuple[torch.Tensor, torch.Tensor, np.ndarray, float, Scales]] = {}
    local = [(pairs[id(w)].source[0], pairs[id(w)].target[0]) for w in works]
    dirty: list[int] = []  # the pairs showing strays: their dense points, all at once below
    for w, (src, tgt), rule in zip(works, local, _mg.voxel_sizes(local, opts), strict=True):
        try:
            if isinstance(rule, Exception):
                raise rule
            v, strays = rule
            scales = Scales(1.0, None if mcd is None else mcd / v,
                            None if fine is None else fine / v)
            meta[id(w)] = (src, tgt, pairs[id(w)].frame.center[0], v, scales)
            if strays:
                dirty.append(len(todo))
            todo.append(w)
            clouds += [src, tgt]
        except (ValueError, TypeError) as exc:
            _fail(w, exc, on_error)
    clock.lap("voxel_size")
    dense = _mg.without_strays_many([(clouds[2 * i], clouds[2 * i + 1]) for i in dirty],
                                    [meta[id(todo[i])][3] for i in dirty])
    for i, (s_c, t_c) in zip(dirty, dense, strict=True):
        clouds[2 * i], clouds[2 * i + 1] = s_c, t_c
    clock.lap("strays")
    clouds = _mg.scaled([meta[id(w)][3] for w in todo for _ in (0, 1)], clouds)
    clock.lap("scale")
    if not todo:
        return clock.total()
    unit = meta[id(todo[0])][4]
    downs, sizes = _mg.prepare_many(clouds, unit, clock)
    kept, kept_downs = [], []
    for i, w in enumerate(todo):
        small = [(name, sizes[2 * i + j]) for j, name in enumerate(("source", "target"))
                 if sizes[2 * i + j] < 3]
        if small:
            name, got = small[0]
            _fail(w, ValueError(f"voxel_size: {meta[id(w)][3]:g} leaves {got} {name} "
                                "point(s); at least 3 are needed (a smaller voxel_size)"),
                  on_error)
            continue
        kept.append(w)
        kept_downs += [downs[2 * i], downs[2 * i + 1]]
    if not kept:
        return clock.total()
    normals, features = _mg.describe_many(kept_downs, unit)
    clock.lap("describe")
    for i, w in enumerate(kept):
        src, tgt, center, v, scales = meta[id(w)]
        prep = [Prepared(kept_downs[2 * i + j], _mg.index_of(kept_downs[2 * i + j]),
                         normals[2 * i + j], features[2 * i + j]) for j in (0, 1)]
        w.ready = _Ready(src, tgt, center, v, scales, prep[0], prep[1])
        w.row["voxel_size"] = v
    clock.lap("index")
    for scales, group in _by_scales(kept).items():
        found = _mg.global_many([w.r.source.down for w in group],
                                [w.r.target.down for w in group],
                                [w.r.source.features for w in group],
                                [w.r.target.features for w in group], scales, opts, clock)
        for w, pg in zip(group, found, strict=True):
            w.glob, w.cands = pg.glob, pg.candidates
    return clock.total()


def _global_row(w: _Work) -> None:
    """Fill the row of a pair whose last stage is the global one (refine "none", no hypothesis)."""
    if w.glob is None:  # an init and refine="none": nothing to do
        w.row.update(transformation=np.asarray(w.spec.init, dtype=np.float64),
                     verdict="not refined (refine='none')")
        return
    g, r = w.glob, w.r
    w.row.update(transformation=_unscaled(np.asarray(g.transformation), r.v, r.center),
                 fitness=float(g.fitness), rmse=float(g.rmse) * r.v,
                 converged=bool(g.converged), trusted=bool(g.converged),
                 verdict="global only" if g.converged else str(g.stop_reason).replace("_", " "),
                 stop_reason=str(g.stop_reason), iterations=int(g.iterations))


#: the local stages' clock names as register_many's timings name them (``local.<name>``)
_LOCAL_NAMES = {"hypotheses": "coarse", "icp_prepare": "final_prepare", "icp": "final_icp"}


def _local_stages(works: list[_Work], opts: _Options, device: torch.device
                  ) -> dict[str, float]:
    """Coarse ICP of every pair's hypotheses, final stage and verdicts, batched per group.

    On a GPU (:func:`.many_global.batched_local`) the coarse stage's counts and sorts
    (:func:`.many_global.refine_many`) and the final clouds (:func:`.many_global.
    final_clouds_many`) run for a whole group at once; else per pair, as ``register``.
    Returns the seconds per part (one clock: a synchronisation at each part's end):
    ``rows`` (results wrapped), ``coarse_*`` (``coarse`` on the per-pair path),
    ``final_clouds``, ``final_prepare``, ``final_icp``, ``verdict``.
    """
    clock = _loop.Clock(device)
    batched = _mg.batched_local(device)
    for w in works:
        if w.refined is None and w.cands is None:  # refine="none", or RANSAC found nothing
            _global_row(w)
    clock.lap("rows")
    coarse = [(w, w.cands) for w in works if w.cands is not None]
    for scales, group in _by_scales([w for w, _ in coarse]).items():
        cands = dict((id(w), c) for w, c in coarse)
        refine = _mg.refine_many if batched and len(group) > 1 else _refine_hypotheses
        got = refine([(cands[id(w)], w.r.source, w.r.target) for w in group],
                     scales, icp_criteria(scales, opts.max_iterations), opts.robust, clock)
        for w, (R, fit_v, its) in zip(group, got, strict=True):
            w.refined, w.fit_v, w.coarse_iterations = R, fit_v, its
    final = [w for w in works if w.refined is not None]
    ivs = opts.icp_voxel_size
    clouds: dict[int, Any] = {}
    if batched and ivs is None and len(final) > 1:
        for same in _by_normal_radius(final).values():
            got_c = _mg.final_clouds_many([w.r.src for w in same], [w.r.tgt for w in same],
                                          [w.r.v for w in same], same[0].r.scales,
                                          opts.refine)
            clouds.update((id(w), c) for w, c in zip(same, got_c, strict=True))
    else:
        clouds = {id(w): _final_clouds(w.r.src / w.r.v, w.r.tgt / w.r.v, w.r.scales,
                                       None if ivs is None else ivs / w.r.v, None,
                                       opts.refine)
                  for w in final}
    clock.lap("final_clouds")
    for scales, same in _by_scales(final).items():
        # pairs of similar sizes share a padded batch (padding costs work per iteration)
        for group in _size_groups(sorted(same, key=lambda w: clouds[id(w)].source.shape[0]),
                                  lambda w: clouds[id(w)].source.shape[0]):
            hyp = [w.hypotheses for w in group]
            res = _final_icp([clouds[id(w)] for w in group], torch.stack([R[0] for R, _ in hyp]),
                             scales, icp_criteria(scales, opts.max_iterations), opts.refine,
                             clock, own_index=not batched)
            assert res.transformation_tensor is not None
            stab = np.asarray(res.info["stability"], dtype=np.float64).reshape(-1)
            judged = (_mg.verdicts_many if batched else verdicts)(
                res.transformation_tensor, stab, [R for R, _ in hyp], [f for _, f in hyp],
                [w.r.source for w in group], [w.r.target for w in group], scales)
            clock.lap("verdict")
            for j, (w, (ver, reason)) in enumerate(zip(group, judged, strict=True)):
                _final_row(w, res, j, ver, str(reason), clouds[id(w)].source.shape[0],
                           float(stab[j]))
            clock.lap("rows")
    out = clock.total()
    out.pop("total")
    return {_LOCAL_NAMES.get(k, k): v for k, v in out.items()}


def _by_normal_radius(works: list[_Work]) -> dict[float, list[_Work]]:
    """Group pairs by their normal radius in voxels (one radius per batched search)."""
    groups: dict[float, list[_Work]] = {}
    for w in works:
        groups.setdefault(w.r.scales.normal_radius, []).append(w)
    return groups


def _final_row(w: _Work, res: RegistrationResult, j: int, ver: dict[str, Any], reason: str,
               n_source: int, stability: float) -> None:
    """Fill the row of pair ``j`` of the final stage's batched result ``res``."""
    r = w.r
    w.row.update(transformation=_unscaled(res.transformation[j], r.v, r.center),
                 fitness=float(res.fitness[j]), rmse=float(res.rmse[j]) * r.v,
                 verdict=ver["verdict"], trusted=ver["trusted"], converged=ver["trusted"],
                 stop_reason=reason, iterations=int(res.iterations[j]),
                 overlap=ver["overlap"], margin=ver["margin"],
                 concentration=ver["concentration"], stability=stability,
                 info={"H": _information_world(res.info["H"][j], r.v),
                       "H_center": r.center.copy(),
                       "icp_converged": bool(res.converged[j]),
                       "icp_stop_reason": str(res.stop_reason[j]),
                       "coarse_iterations": w.coarse_iterations,
                       "correspondences": int(round(float(res.fitness[j]) * n_source))})


def _by_scales(works: list[_Work]) -> dict[Scales, list[_Work]]:
    """Group pairs by their lengths in voxels (one bound per batched call), in order."""
    groups: dict[Scales, list[_Work]] = {}
    for w in works:
        groups.setdefault(w.r.scales, []).append(w)
    return groups


def _information_world(H: np.ndarray, v: float) -> np.ndarray:
    """Convert the final ICP's ``H`` (twist about the scaled local origin) to metres.

    The scaled frame's twist (ω, v/s) against residuals in voxels: ``H_m = D H D / s²``
    with ``D = diag(1, 1, 1, 1/s, 1/s, 1/s)`` (s = v); about the target's centroid
    (``info["H_center"]``), the twist about the world origin follows by the adjoint.
    """
    d = np.array([1.0, 1.0, 1.0, 1.0 / v, 1.0 / v, 1.0 / v])
    return (d[:, None] * np.asarray(H, dtype=np.float64) * d[None]) * v * v


def _size_groups(order: list[_Work], size: Any, ratio: float = 1.5) -> list[list[_Work]]:
    """Split ``order`` (ascending ``size(w)``) where the largest would pass ``ratio`` × smallest."""
    groups: list[list[_Work]] = []
    for w in order:
        if groups and size(w) <= ratio * size(groups[-1][0]):
            groups[-1].append(w)
        else:
            groups.append([w])
    return groups
