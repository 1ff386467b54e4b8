"""register_many(): many pairs at once, batched on one device or in chunks on a Dask cluster.

On one device the pairs run chunk by chunk (``chunk_size`` pairs), and inside a chunk:

1. **read** each cloud (paths are read here, on the worker that runs the chunk);
2. **global stage, per pair** (no batched kernel exists for it yet): the steps of
   :func:`~pointalign.registration.pipeline.register` in the target's local frame,
   voxel edge v, stray-point removal, downsampling, normals, FPFH, parallel RANSAC, the
   compatibility-graph hypotheses and the ``REFINE_TOP`` best by inlier count;
   a pair given with an ``init`` skips this stage;
3. **coarse ICP, batched**: every pair's best hypotheses in one point-to-plane
   :func:`~pointalign.registration.icp.icp` call on the downsampled clouds (bound 1.5v);
4. **final ICP, batched**: one point-to-plane ICP call for the whole chunk on the full
   clouds (or their ``icp_voxel_size`` copies; bound 0.5v), pairs grouped by size and padded;
5. **verdict, batched** (:func:`verdicts`): overlap, margin, concentration and stability of
   every pair from one search per target and one transfer.

A pair's voxel edge v differs from pair to pair, and one ICP call takes one bound: each pair
is registered in its own frame, centred on its target's centroid (in float64) and **scaled
by 1/v**, so that every bound is the same number of voxels (1.5, 0.5) for the whole batch.
Poses come back in the caller's coordinates: ``T = S(c, v) T_scaled S(c, v)⁻¹``.

With ``client=`` (a ``distributed.Client``) each chunk is one Dask task; clouds given as
paths are read on the worker. Dask reruns the tasks of a worker that dies (up to its
``distributed.scheduler.allowed-failures``) and ``retries=`` reruns a task that raised;
results are gathered by pair index, each pair exactly once.
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
from typing import Any

import numpy as np
import torch

from pointalign import _progress, _threads, _validate

PathLike = (str, os.PathLike)

#: pairs per chunk by default: a Dask task costs 0.2-1 ms of scheduler time, and one
#: batched ICP launch per stage serves the whole chunk (a GPU takes many; a CPU worker
#: gains nothing from more than a few)
CHUNK_CUDA = 256
CHUNK_CPU = 8

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
            source into the target frame) plus ``info`` (``H``, the final ICP's 6×6
            information matrix about the target origin, and ``correspondences``).
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


# ---------------------------------------------------------------------------- the options

@dataclass(frozen=True)
class _Options:
    """:func:`register`'s options, checked once (the same meaning and defaults)."""

    voxel_size: float | None = None
    method: str = "icp"
    target_points: int = 5000
    hypotheses: int = 16384
    icp_voxel_size: float | None = None
    max_iterations: int = 30
    seed: int = 0
    remove_outliers: bool = True
    robust: bool = True
    on_error: str = "raise"
    ransac: dict[str, Any] = field(default_factory=dict)


def _options(opts: dict[str, Any], on_error: str) -> _Options:
    from pointalign.registration.pipeline import METHODS

    known = {f for f in _Options.__dataclass_fields__ if f not in ("ransac", "on_error")}
    base = {k: opts.pop(k) for k in list(opts) if k in known}
    o = _Options(**base, on_error=on_error, ransac=dict(opts))
    for name in ("remove_outliers", "robust"):
        if not isinstance(getattr(o, name), (bool, np.bool_)):
            raise TypeError(f"{name}: expected True or False, got {getattr(o, name)!r}")
    if o.method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {o.method!r}")
    if on_error not in ("raise", "record"):
        raise ValueError(f"on_error: expected 'raise' or 'record', got {on_error!r}")
    _validate.seed(o.seed)
    _validate.integer(o.target_points, "target_points", minimum=3)
    _validate.integer(o.hypotheses, "hypotheses", minimum=1)
    _validate.integer(o.max_iterations, "max_iterations", minimum=1)
    for name in ("voxel_size", "icp_voxel_size"):
        if getattr(o, name) is not None:
            _validate.positive(getattr(o, name), name)
    return o


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
        **register_options: :func:`~pointalign.registration.pipeline.register`'s options
            (``voxel_size``, ``method``, ``target_points``, ``hypotheses``,
            ``icp_voxel_size``, ``max_iterations``, ``seed``, ``remove_outliers``,
            ``robust`` and RANSAC's).

    Returns:
        :class:`ManyResult`: one row per pair in the order given (``to_rows``, ``to_csv``,
        ``to_parquet``, ``to_pandas``).

    """
    t0 = time.perf_counter()
    specs = _specs(pairs)
    opts = _options(dict(register_options), on_error)
    retries = _validate.integer(retries, "retries", minimum=0)
    if chunk_size is not None:
        chunk_size = _validate.integer(chunk_size, "chunk_size", minimum=1)
    quiet = None if progress is None else not progress
    if client is not None:
        if device is not None:
            raise ValueError("device: with client=, each worker uses its own device "
                             "(CUDA when present); leave device unset")
        rows = _run_distributed(specs, opts, client, chunk_size, retries, quiet)
    else:
        dev = _validate.as_device(device)
        size = chunk_size or (CHUNK_CUDA if dev.type == "cuda" else CHUNK_CPU)
        rows = []
        items = list(enumerate(specs))
        with _progress.task("register_many", len(specs), quiet=quiet,
                            delay=_progress.LIBRARY_DELAY) as bar:
            for lo in range(0, len(items), size):
                part = items[lo:lo + size]
                rows += run_chunk(part, opts, dev)
                bar.advance(len(part))
    timings = {"total": time.perf_counter() - t0}
    for k in ("read_s", "global_s", "local_s"):
        timings[k.removesuffix("_s")] = float(sum(r[k] for r in rows))
    return ManyResult(rows, timings)


# ---------------------------------------------------------------------------- Dask

def _worker_kind() -> str:
    """Return the device kind a worker registers on by default ("cuda" or "cpu")."""
    return _validate.default_device().type


def _task(part: list[tuple[int, PairSpec]], opts: _Options) -> list[dict[str, Any]]:
    """One Dask task: a chunk of pairs on the worker's default device."""
    return run_chunk(part, opts, _validate.default_device())


def _run_distributed(specs: list[PairSpec], opts: _Options, client: Any,
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
    futures = [client.submit(_task, part, opts, retries=retries, pure=False,
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

@dataclass
class _Work:
    """A pair in flight: its clouds in the scaled local frame and what the stages found."""

    index: int
    spec: PairSpec
    row: dict[str, Any]
    src: torch.Tensor | None = None          # (N, 3) float32 local, unscaled
    tgt: torch.Tensor | None = None
    center: np.ndarray | None = None         # (3,) float64 target centroid (world)
    v: float = 1.0
    s_down: torch.Tensor | None = None       # scaled by 1/v from here on
    t_down: torch.Tensor | None = None
    t_nrm: torch.Tensor | None = None
    t_index: Any = None
    cands: torch.Tensor | None = None        # (k, 4, 4) float64 scaled local hypotheses
    refined: torch.Tensor | None = None      # (k, 4, 4) after the coarse ICP, best first
    fit_v: torch.Tensor | None = None        # (k,) inlier counts within 1 (voxel)
    init: torch.Tensor | None = None         # (4, 4) scaled local start of the final ICP
    glob: Any = None                         # the RANSAC result (method "none")
    iterations: int = 0


def _read(x: Any) -> Any:
    if isinstance(x, PathLike):
        from pointalign import io

        return io.read(x)
    return x


def _scaled(T: torch.Tensor, v: float) -> torch.Tensor:
    """``(…, 4, 4)`` local transforms → the frame scaled by 1/v (translation / v)."""
    out = T.clone()
    out[..., :3, 3] /= v
    return out


def _unscaled(T: np.ndarray, v: float, center: np.ndarray) -> np.ndarray:
    """Scaled local ``T (4, 4)`` → the caller's coordinates, in float64."""
    out = np.array(T, dtype=np.float64)
    out[:3, 3] *= v
    out[:3, 3] += center - out[:3, :3] @ center
    return out


def run_chunk(part: Sequence[tuple[int, PairSpec]], opts: _Options,
              device: torch.device) -> list[dict[str, Any]]:
    """Register one chunk of ``(index, PairSpec)`` on ``device``; one row dict per pair.

    What a Dask task runs, and what :func:`register_many` runs chunk by chunk on one device.
    """
    from pointalign.registration.pipeline import local_frame

    single = _threads.torch_single() if device.type == "cpu" else contextlib.nullcontext()
    works = [_Work(i, spec, _empty_row(i, spec.name)) for i, spec in part]
    with single:
        for w in works:
            t = time.perf_counter()
            try:
                src = _validate.as_points(_read(w.spec.source), "source", min_points=3,
                                          device=device)
                tgt = _validate.as_points(_read(w.spec.target), "target", min_points=3,
                                          device=device)
                frame, w.src, w.tgt = local_frame(src, tgt)
                w.center = frame.center[0]
                w.row["read_s"] = time.perf_counter() - t
                t = time.perf_counter()
                with _validate.trusted():
                    _global_stage(w, opts)
                w.row["global_s"] = time.perf_counter() - t
            except (ValueError, TypeError, OSError) as exc:
                _fail(w, exc, opts)
        live = [w for w in works if not w.row["error"]]
        t = time.perf_counter()
        with _validate.trusted():
            if opts.method == "icp":
                _local_stages(live, opts, device)
            else:
                for w in live:
                    _global_row(w)
        share = (time.perf_counter() - t) / max(len(live), 1)
    for w in works:
        if not w.row["error"]:
            w.row["local_s"] = share
        w.row["total_s"] = w.row["read_s"] + w.row["global_s"] + w.row["local_s"]
    return [w.row for w in works]


def _empty_row(i: int, name: str) -> dict[str, Any]:
    return {"index": i, "name": name, "transformation": np.full((4, 4), np.nan),
            "fitness": 0.0, "rmse": math.inf, "verdict": "", "trusted": False,
            "converged": False, "stop_reason": "", "iterations": 0, "voxel_size": math.nan,
            "overlap": math.nan, "margin": math.nan, "concentration": math.nan,
            "stability": math.nan, "error": "", "read_s": 0.0, "global_s": 0.0,
            "local_s": 0.0, "total_s": 0.0, "info": {}}


def _fail(w: _Work, exc: Exception, opts: _Options) -> None:
    if opts.on_error == "raise":
        raise type(exc)(f"pairs[{w.index}] ({w.spec.name}): {exc}") from exc
    w.row.update(error=f"{type(exc).__name__}: {exc}", verdict="error")


# ---------------------------------------------------------------------------- stages

def _voxel(w: _Work, opts: _Options) -> tuple[float, bool]:
    """Return the voxel edge and whether stray points are removed (register()'s rule)."""
    from pointalign.registration.pipeline import (
        MIN_STRAY_FRACTION,
        auto_voxel_size,
        robust_voxel_size,
        stray_fraction,
    )

    assert w.src is not None and w.tgt is not None
    big = w.src if w.src.shape[0] >= w.tgt.shape[0] else w.tgt
    v = auto_voxel_size(big, opts.target_points) if opts.voxel_size is None \
        else float(opts.voxel_size)
    strays = opts.remove_outliers and max(stray_fraction(w.src, v), stray_fraction(w.tgt, v)) \
        >= MIN_STRAY_FRACTION
    if strays and opts.voxel_size is None:
        v = robust_voxel_size(big, opts.target_points)
    return v, strays


def _global_stage(w: _Work, opts: _Options) -> None:
    """Per pair: downsampled clouds and, without an init, the best global hypotheses.

    register()'s steps 1-4 and its compatibility-graph proposals, then the
    ``REFINE_TOP`` best hypotheses by inlier count (refined later, batched).
    """
    from pointalign.features.downsample import voxel_downsample
    from pointalign.features.fpfh import fpfh, neighbourhoods, restrict
    from pointalign.features.normals import estimate_normals
    from pointalign.kernels.ransac import shared_feature_knn
    from pointalign.registration.pipeline import CORRESPONDENCES, REFINE_TOP, dense_mask
    from pointalign.registration.ransac import _count, ransac
    from pointalign.registration.robust import compatibility_hypotheses, rank_correspondences
    from pointalign.search import build_index

    assert w.src is not None and w.tgt is not None and w.center is not None
    v, strays = _voxel(w, opts)
    w.v = v
    w.row["voxel_size"] = v
    s_clean, t_clean = w.src, w.tgt
    if strays:
        s_keep, t_keep = dense_mask(w.src, v), dense_mask(w.tgt, v)
        if int(s_keep.sum()) >= 3 and int(t_keep.sum()) >= 3:
            s_clean, t_clean = w.src[s_keep], w.tgt[t_keep]
    s_down, t_down = voxel_downsample(s_clean, v), voxel_downsample(t_clean, v)
    if s_down.shape[0] < 3 or t_down.shape[0] < 3:
        raise ValueError(f"voxel_size: {v:g} leaves {s_down.shape[0]} source and "
                         f"{t_down.shape[0]} target points; at least 3 each are needed")
    # from here on in voxels: every bound is the same for every pair of a batch
    w.s_down, w.t_down = s_down / v, t_down / v
    w.t_index = build_index(w.t_down)
    if w.spec.init is not None:
        T0 = torch.from_numpy(w.spec.init).to(device=w.src.device)
        shift = torch.eye(4, dtype=torch.float64, device=w.src.device)
        shift[:3, 3] = torch.from_numpy(w.center).to(w.src.device)
        w.init = _scaled(torch.linalg.inv(shift) @ T0 @ shift, v)
        w.refined = w.init[None]
        w.fit_v = _count(w.refined, w.s_down, w.t_index, 1.0)
        return
    s_idx = build_index(w.s_down)
    s_nb = neighbourhoods(w.s_down, 5.0, min(100, w.s_down.shape[0]), s_idx)
    t_nb = neighbourhoods(w.t_down, 5.0, min(100, w.t_down.shape[0]), w.t_index)
    s_nrm = estimate_normals(w.s_down, neighbors=restrict(s_nb, 2.0, 30), orient="viewpoint",
                             viewpoint=w.s_down.mean(0))
    w.t_nrm = estimate_normals(w.t_down, neighbors=restrict(t_nb, 2.0, 30),
                               orient="viewpoint", viewpoint=w.t_down.mean(0))
    s_f = fpfh(w.s_down, radius=5.0, normals=s_nrm, neighbors=s_nb)
    t_f = fpfh(w.t_down, radius=5.0, normals=w.t_nrm, neighbors=t_nb)
    ransac_options = dict(opts.ransac)
    ransac_options.setdefault("max_correspondence_distance", 1.5)
    shared = shared_feature_knn(s_f, t_f, 2)
    with shared:
        glob = ransac(w.s_down, w.t_down, source_features=s_f, target_features=t_f,
                      hypotheses=opts.hypotheses, target_index=w.t_index, seed=opts.seed,
                      **ransac_options)
    w.glob = glob
    if opts.method == "none" or glob.stop_reason in ("no_hypothesis",
                                                      "too_few_correspondences"):
        return
    cands = glob.transformation_tensor[None]
    if opts.robust and t_f.shape[0] >= 2:
        with shared:
            corr = rank_correspondences(s_f, t_f, CORRESPONDENCES)
        if corr.shape[0] >= 3:
            H, _ = compatibility_hypotheses(w.s_down[corr[:, 0]], w.t_down[corr[:, 1]], 1.5)
            cands = torch.cat([cands, H])
    counts = _count(cands, w.s_down, w.t_index, 1.5)
    top = torch.argsort(counts, descending=True, stable=True)[:REFINE_TOP if opts.robust else 1]
    w.cands = cands[top]


def _global_row(w: _Work) -> None:
    """Fill the row of a pair whose last stage is the global one (method "none", none found)."""
    g = w.glob
    assert w.center is not None
    T = _unscaled(np.asarray(g.transformation), w.v, w.center)
    w.row.update(transformation=T, fitness=float(g.fitness), rmse=float(g.rmse) * w.v,
                 converged=bool(g.converged), trusted=bool(g.converged),
                 verdict="global only" if g.converged else str(g.stop_reason),
                 stop_reason=str(g.stop_reason), iterations=int(g.iterations))


def _pad(clouds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(c.shape[0] for c in clouds)
    out = clouds[0].new_zeros(len(clouds), n, 3)
    for b, c in enumerate(clouds):
        out[b, : c.shape[0]] = c
    return out, torch.tensor([c.shape[0] for c in clouds], device=clouds[0].device)


def _local_stages(works: list[_Work], opts: _Options, device: torch.device) -> None:
    """Coarse ICP of every pair's hypotheses, final ICP and verdicts, each one batched call."""
    from pointalign.features.downsample import voxel_downsample
    from pointalign.features.normals import estimate_normals
    from pointalign.registration.criteria import ConvergenceCriteria
    from pointalign.registration.icp import icp
    from pointalign.registration.ransac import _count
    from pointalign.search import build_index

    criteria = ConvergenceCriteria(max_iterations=opts.max_iterations,
                                   translation_tolerance=1e-3,
                                   rotation_tolerance=math.radians(0.01))
    done = [w for w in works if w.glob is not None and w.cands is None]
    for w in done:   # RANSAC found nothing: its failed result is the row
        _global_row(w)
    coarse = [w for w in works if w.cands is not None]
    if coarse:
        owner = [w for w in coarse for _ in range(w.cands.shape[0])]  # type: ignore[union-attr]
        src, sl = _pad([w.s_down for w in owner])  # type: ignore[misc]
        tgt, tl = _pad([w.t_down for w in owner])  # type: ignore[misc]
        nrm, _ = _pad([w.t_nrm for w in owner])  # type: ignore[misc]
        init = torch.cat([w.cands for w in coarse])  # type: ignore[misc]
        loc = icp(src, tgt, source_lengths=sl, target_lengths=tl, init=init,
                  max_correspondence_distance=1.5, method="point_to_plane", criteria=criteria,
                  index=[w.t_index for w in owner], target_normals=nrm, device=device)
        R = loc.transformation_tensor
        it = np.asarray(loc.iterations)
        lo = 0
        for w in coarse:
            k = w.cands.shape[0]  # type: ignore[union-attr]
            Rw = R[lo:lo + k]
            assert w.s_down is not None
            fit = _count(Rw, w.s_down, w.t_index, 1.0)
            rank = torch.argsort(fit, descending=True, stable=True)
            w.refined, w.fit_v = Rw[rank], fit[rank]
            w.init, w.iterations = w.refined[0], int(it[lo:lo + k].max())
            lo += k
    final = [w for w in works if w.init is not None]
    if not final:
        return
    fulls_s, fulls_t, idxs, nrms = [], [], [], []
    for w in final:
        assert w.src is not None and w.tgt is not None
        s, t = w.src, w.tgt
        if opts.icp_voxel_size is not None:
            s = voxel_downsample(s, opts.icp_voxel_size)
            t = voxel_downsample(t, opts.icp_voxel_size)
        s, t = s / w.v, t / w.v
        ix = build_index(t)
        nrms.append(estimate_normals(t, k=min(16, t.shape[0]), radius=2.0, index=ix,
                                     orient="viewpoint", viewpoint=t.mean(0)))
        fulls_s.append(s)
        fulls_t.append(t)
        idxs.append(ix)
    # pairs of similar sizes share a padded batch (padding costs work per iteration)
    order = sorted(range(len(final)), key=lambda b: fulls_s[b].shape[0])
    for group in _size_groups(order, [fulls_s[b].shape[0] for b in range(len(final))]):
        ws = [final[b] for b in group]
        src, sl = _pad([fulls_s[b] for b in group])
        tgt, tl = _pad([fulls_t[b] for b in group])
        nrm, _ = _pad([nrms[b] for b in group])
        init = torch.stack([w.init for w in ws])  # type: ignore[misc]
        res = icp(src, tgt, source_lengths=sl, target_lengths=tl, init=init,
                  max_correspondence_distance=0.5, method="point_to_plane", criteria=criteria,
                  index=[idxs[b] for b in group], target_normals=nrm, device=device)
        ver = verdicts(res.transformation_tensor, [w.refined for w in ws],  # type: ignore[misc]
                       [w.fit_v for w in ws], [w.s_down for w in ws],  # type: ignore[misc]
                       [w.t_index for w in ws], 1.0, np.asarray(res.info["stability"]))
        for j, (b, w) in enumerate(zip(group, ws, strict=True)):
            assert w.center is not None
            T = _unscaled(res.transformation[j], w.v, w.center)
            H = _information_world(res.info["H"][j], w.v)
            w.row.update(transformation=T, fitness=float(res.fitness[j]),
                         rmse=float(res.rmse[j]) * w.v, verdict=ver[j]["verdict"],
                         trusted=ver[j]["trusted"], converged=ver[j]["trusted"],
                         stop_reason=str(res.stop_reason[j]),
                         iterations=w.iterations + int(res.iterations[j]),
                         overlap=ver[j]["overlap"], margin=ver[j]["margin"],
                         concentration=ver[j]["concentration"],
                         stability=float(res.info["stability"][j]),
                         info={"H": H, "H_center": w.center.copy(),
                               "icp_converged": bool(res.converged[j]),
                               "correspondences": int(round(float(res.fitness[j])
                                                            * fulls_s[b].shape[0]))})


def _information_world(H: np.ndarray, v: float) -> np.ndarray:
    """Convert the final ICP's ``H`` (twist about the scaled local origin) to metres.

    The scaled frame's twist (ω, v/s) against residuals in voxels: ``H_m = D H D / s²``
    with ``D = diag(1, 1, 1, 1/s, 1/s, 1/s)`` (s = v); about the target's centroid
    (``info["H_center"]``), the twist about the world origin follows by the adjoint.
    """
    d = np.array([1.0, 1.0, 1.0, 1.0 / v, 1.0 / v, 1.0 / v])
    return (d[:, None] * np.asarray(H, dtype=np.float64) * d[None]) * v * v


def _size_groups(order: list[int], sizes: list[int], ratio: float = 1.5) -> list[list[int]]:
    """Split ``order`` (ascending sizes) where the largest would exceed ``ratio`` × smallest."""
    groups: list[list[int]] = []
    for b in order:
        if groups and sizes[b] <= ratio * sizes[groups[-1][0]]:
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups


def verdicts(T: torch.Tensor, refined: list[torch.Tensor], fit_v: list[torch.Tensor],
             s_down: list[torch.Tensor], t_index: list[Any], v: float,
             stability: np.ndarray) -> list[dict[str, Any]]:
    """:func:`pipeline._verdict` of B pairs at once.

    Args:
        T: ``(B, 4, 4)`` float64 final transforms (on the points' device).
        refined: B ``(k_b, 4, 4)`` refined hypotheses, best first.
        fit_v: B ``(k_b,)`` inlier counts of those within v.
        s_down: B ``(P_b, 3)`` downsampled sources.
        t_index: B indexes over the downsampled targets.
        v: the voxel edge (the same for all, in their frames).
        stability: ``(B,)`` stability of each final ICP.

    Returns:
        B dicts with ``overlap``, ``margin``, ``concentration``, ``trusted``, ``verdict``:
        the values of ``_verdict`` (the same searches; one transfer for the batch).

    """
    from pointalign import _math, transforms
    from pointalign.kernels.ransac import transform_points
    from pointalign.registration.pipeline import MAX_MARGIN, MIN_CONCENTRATION, MIN_OVERLAP

    B = T.shape[0]
    dev = T.device
    pts, lengths = _pad(s_down)
    moved = transform_points(T, pts)  # (B, P, 3)
    valid = torch.arange(pts.shape[1], device=dev)[None] < lengths[:, None]
    d2 = torch.full(pts.shape[:2], math.inf, dtype=pts.dtype, device=dev)
    for b in range(B):
        n = int(s_down[b].shape[0])
        res = t_index[b].nearest_within(moved[b, :n], 1.5 * v)
        d2[b, :n] = torch.where(res.idx[:, 0] >= 0, res.dists[:, 0], math.inf)
    d2 = torch.where(valid, d2, math.inf)
    counts = torch.stack([(d2 <= b * b).sum(1) for b in (1.5 * v, 0.5 * v, v)], 1)
    # margins: the best different hypothesis (3v away at the centroid, or 5 degrees)
    k = max(r.shape[0] for r in refined)
    R = torch.eye(4, dtype=torch.float64, device=dev).repeat(B, k, 1, 1)
    F = torch.full((B, k), -1.0, dtype=torch.float64, device=dev)
    for b in range(B):
        R[b, : refined[b].shape[0]] = refined[b]
        F[b, : fit_v[b].shape[0]] = fit_v[b].to(torch.float64)
    ctr = torch.stack([s.mean(0) for s in s_down]).to(torch.float64)        # (B, 3)
    moved_c = (R[..., :3, :3] @ ctr[:, None, :, None])[..., 0] + R[..., :3, 3]
    here = (T[:, :3, :3] @ ctr[..., None])[..., 0] + T[:, :3, 3]
    dR = R[..., :3, :3].transpose(-1, -2) @ T[:, None, :3, :3]
    ang = torch.rad2deg(transforms.rotation_angle(dR))
    other = (((moved_c - here[:, None]).norm(dim=-1) > 3 * v) | (ang > 5.0)) & (F >= 0)
    second = torch.where(other, F, torch.zeros_like(F)).amax(1)
    host = torch.cat([counts.to(torch.float64), second[:, None]], 1).cpu().numpy()
    out = []
    for b in range(B):
        c15, c05, cv, sec = host[b]
        n = s_down[b].shape[0]
        overlap, margin = cv / n, sec / max(cv, 1.0)
        concentration = c05 / max(c15, 1.0)
        why = []
        if overlap < MIN_OVERLAP:
            why.append("small overlap")
        if margin > MAX_MARGIN:
            why.append("weak margin")
        if concentration < MIN_CONCENTRATION:
            why.append("residuals not concentrated")
        if not stability[b] > _math.STABILITY_EPS:
            why.append("pose not determined")
        out.append({"overlap": float(overlap), "margin": float(margin),
                    "concentration": float(concentration), "trusted": not why,
                    "verdict": "trusted" if not why else ", ".join(why)})
    return out
