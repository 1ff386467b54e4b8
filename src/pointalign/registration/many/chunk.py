"""One chunk of register_many's pairs (:func:`run_chunk`): read, global stage, local stages.

What a Dask task runs (:mod:`.cluster`) and what register_many runs chunk by chunk on one
device; the chunk sizes, and the one-thread rule for small pairs on the CPU.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import torch

from pointalign import _threads, _validate
from pointalign.kernels import _loop
from pointalign.registration import _edge
from pointalign.registration.many import batched as _batched
from pointalign.registration.many.global_stage import _global_stage, _global_stage_batched
from pointalign.registration.many.local_stages import _local_stages
from pointalign.registration.many.pairs import PairSpec, PathLike
from pointalign.registration.many.table import _empty_row
from pointalign.registration.many.work import _fail, _Work
from pointalign.registration.options import Options as _Options

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


def _read(x: Any) -> Any:
    if isinstance(x, PathLike):
        from pointalign import io

        return io.read(x)
    return x


def run_chunk(part: Sequence[tuple[int, PairSpec]], opts: _Options, device: torch.device,
              on_error: str = "raise") -> list[dict[str, Any]]:
    """Register one chunk of ``(index, PairSpec)`` on ``device``; one row dict per pair.

    What a Dask task runs, and what :func:`register_many` runs chunk by chunk on one device.
    """
    single = _threads.torch_single() if device.type == "cpu" else contextlib.nullcontext()
    works = [_Work(i, spec, _empty_row(i, spec.name)) for i, spec in part]
    clock = _loop.Clock(device)
    with single:
        pairs = _read_chunk(works, device, on_error)
        fresh = [w for w in works if id(w) in pairs and w.spec.init is None]
        batched = fresh if _batched.applies(opts, device, len(fresh)) else []
        chosen = {id(w) for w in batched}
        for w in works:
            if id(w) not in pairs or id(w) in chosen:
                continue
            t = time.perf_counter()
            try:
                pair = pairs[id(w)]
                size = max(pair.source.shape[0], pair.target.shape[0])
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


def _read_chunk(works: list[_Work], device: torch.device, on_error: str
                ) -> dict[int, _edge.LocalPair]:
    """Read every pair's clouds, then check and prepare them all at once (by ``id(work)``).

    Each file is read here (``read.io``, per pair); the clouds of the whole chunk are
    checked and moved to their local frames by one :func:`~pointalign.registration._edge.
    prepare_pairs` (``read.prepare``: its time shared by the pairs it prepared), with the
    errors, numbers and order of failures of ``prepare_pair`` called pair by pair.
    """
    read: list[tuple[_Work, Any, Any, float]] = []
    errors: dict[int, Exception] = {}
    for w in works:
        t = time.perf_counter()
        try:
            s_in, t_in = _read(w.spec.source), _read(w.spec.target)
            read.append((w, s_in, t_in, time.perf_counter() - t))
        except (ValueError, TypeError, OSError) as exc:
            errors[id(w)] = exc
    t = time.perf_counter()
    got = _edge.prepare_pairs([r[1] for r in read], [r[2] for r in read],
                              [r[0].spec.init for r in read], device=device, min_points=3)
    # one copy to the device, one NaN/Inf test and one transfer back for the whole chunk
    share = (time.perf_counter() - t) / max(len(read), 1)
    pairs: dict[int, _edge.LocalPair] = {}
    for (w, _, _, io), r in zip(read, got, strict=True):
        if isinstance(r, Exception):
            errors[id(w)] = r
            continue
        pairs[id(w)] = r
        w.row["read_s"] = io + share
        w.row["read_stages"] = {"io": io, "prepare": share}
    for w in works:  # the failures in the pairs' order (on_error="raise": the first one)
        if id(w) in errors:
            _fail(w, errors[id(w)], on_error)
    return pairs


def _serial(device: torch.device, points: int) -> contextlib.AbstractContextManager[None]:
    """One CPU thread for a pair (or group) of at most :data:`SERIAL_POINTS` points."""
    if device.type == "cpu" and points <= SERIAL_POINTS:
        return _threads.threads(1)
    return contextlib.nullcontext()
