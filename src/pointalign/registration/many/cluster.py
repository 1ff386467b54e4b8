"""register_many on a Dask cluster: one task per chunk, the rows gathered by pair index."""

from __future__ import annotations

import os
import time
from typing import Any

from pointalign import _progress, _validate
from pointalign.registration.many.chunk import CHUNK_CPU, CHUNK_CUDA, run_chunk
from pointalign.registration.many.pairs import PairSpec
from pointalign.registration.options import Options as _Options


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
