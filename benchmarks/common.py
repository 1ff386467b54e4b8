"""The timing contract every benchmark follows.

* ``timeit(fn)``: ``warmup`` untimed calls, then ``repeat`` timed calls, each bracketed by
  CUDA events on a CUDA device (or ``time.perf_counter`` plus synchronisation elsewhere);
  reports the median and the inter-quartile range in seconds.
* ``Recorder``: collects rows (dicts) and writes ``benchmarks/results/<topic>-<device>.json``
  with metadata (date, commit, device name, versions, command line).
* ``benchmarks/render.py`` turns every results file into BENCHMARKS.md.
* ``progress(items, description)``: a bar on standard error (terminal only) for a driver's
  outer loop; the rows stay one JSON object per line on standard output.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# POINTALIGN_BENCH_RESULTS redirects the JSON (``pointalign bench`` uses it so that a quick
# run on a user's machine does not overwrite the recorded results)
RESULTS = Path(os.environ.get("POINTALIGN_BENCH_RESULTS")
               or Path(__file__).resolve().parent / "results")


def sync(device: str | torch.device | None = None) -> None:
    """Wait for queued GPU work (no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def small_gicp_steps(result: Any) -> int:
    """Linearisations small_gicp's ``align`` made: one more than ``result.iterations``.

    small_gicp's optimisers set ``RegistrationResult.iterations`` to the last loop index,
    counted from 0 (``result.iterations = i`` in ``registration/optimizer.hpp``), so a
    run that stops after its fifth step reports 4. Ours count the steps taken.
    """
    return int(result.iterations) + 1


def timeit(fn: Callable[[], Any], *, warmup: int = 2, repeat: int = 7,
           device: str | torch.device | None = None) -> dict[str, float]:
    """Median and IQR of ``fn()``'s wall time in seconds, after warm-up."""
    dev = torch.device(device) if device is not None else None
    use_events = dev is not None and dev.type == "cuda"
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeat):
        if use_events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median_s": statistics.median(times), "iqr_s": q[2] - q[0], "repeat": repeat}


def device_name(device: str | torch.device) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def metadata(device: str | torch.device) -> dict[str, Any]:
    # the GPU machine gets a copy of the tree without .git: the caller passes the commit
    commit = os.environ.get("POINTALIGN_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip()
        except OSError:
            commit = ""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("numpy", "scipy", "triton", "pykdtree", "small_gicp", "open3d"):
        try:
            m = __import__(mod)
            versions[mod] = getattr(m, "__version__", None) or _dist_version(mod)
        except Exception:
            pass
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "device": device_name(device),
        "device_type": torch.device(device).type,
        "versions": versions,
        "command": " ".join(["python"] + sys.argv),
        "host": host_info(),
    }


def _dist_version(module: str) -> str:
    """Installed distribution version for modules without ``__version__`` (pykdtree,
    small_gicp), or "?"."""
    from importlib import metadata as md

    for name in (module, module.replace("_", "-")):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return "?"


def host_info() -> dict[str, Any]:
    """CPU model, cores and torch threads of the machine running the benchmark."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu_model": model, "cpu_cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}


class Recorder:
    """Collect result rows for one topic and write them as JSON.

    ``title`` and ``notes`` are rendered above the table in BENCHMARKS.md; ``columns`` fixes
    the column order (default: keys of the first row).
    """

    def __init__(self, topic: str, device: str | torch.device, *, title: str = "",
                 notes: str = "", columns: list[str] | None = None):
        self.topic, self.device = topic, torch.device(device)
        self.title, self.notes, self.columns = title or topic, notes, columns
        self.rows: list[dict[str, Any]] = []
        self.tables: dict[str, list[dict[str, Any]]] = {}

    def add(self, table: str | None = None, **row: Any) -> None:
        """Add one row (printed as it comes) to the default or a named table."""
        (self.rows if table is None else self.tables.setdefault(table, [])).append(row)
        print(json.dumps(row, default=str), flush=True)

    def save(self) -> Path:
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / f"{self.topic}-{self.device.type}.json"
        doc = {"topic": self.topic, "title": self.title, "notes": self.notes,
               "columns": self.columns, "meta": metadata(self.device), "rows": self.rows,
               "tables": self.tables}
        path.write_text(json.dumps(doc, indent=1, default=str))
        print(f"wrote {path}")
        return path


def progress(items, description: str):
    """Iterate ``items`` with a progress bar on standard error when it is a terminal.

    The rows stay one JSON object per line on standard output (``pointalign bench`` reads
    them from there and draws its own bar per suite); the bar never mixes into them.
    """
    from pointalign import _progress

    return _progress.track(items, description)


def parse_args(description: str):
    """Common flags: --device, --quick (small sizes, for CPU smoke runs)."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    return p
