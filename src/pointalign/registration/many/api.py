"""register_many(), the entry point: the options checked, the chunks run, the timings summed.

What runs per pair and what runs batched: :mod:`pointalign.registration.many`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from pointalign import _progress, _threads, _validate
from pointalign.registration.many.chunk import CHUNK_CPU, CHUNK_CUDA, run_chunk
from pointalign.registration.many.cluster import _run_distributed
from pointalign.registration.many.pairs import _specs
from pointalign.registration.many.table import ManyResult
from pointalign.registration.options import check


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
    (see :mod:`pointalign.registration.many` for what runs per pair and what runs
    batched); pairs with an ``init`` run the local stages only. The same pairs, options and
    ``chunk_size`` give the same table on one device and on a cluster of workers of that
    device kind (each chunk is registered the same way wherever it runs).

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
