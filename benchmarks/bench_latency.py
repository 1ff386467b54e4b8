"""Warm GPU latency against issue 23's targets, with what bounds each call.

For every row: the warm median (CUDA events, after warm-up), then one call under the
PyTorch profiler, which counts

* ``kernels``: kernels the GPU ran (PyTorch's and Triton's; a CUDA graph replay counts the
  kernels inside it);
* ``launches``: host-side launch calls (``cudaLaunchKernel``, ``cuLaunchKernel``,
  ``cudaGraphLaunch``);
* ``syncs``: host waits (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
  ``cudaEventSynchronize``; a copy to the host waits through one of them);
* ``gpu_busy_ms``: the summed kernel time; ``wall_ms - gpu_busy_ms`` is what the GPU waited
  for the host (launch overhead, Python, host decisions behind a synchronisation).

A row whose ``gpu_busy_ms`` is far below its ``wall_ms`` is launch- and host-bound (more
kernel speed does not help; fewer launches and synchronisations do); one whose busy time is
near its wall time is bound by its kernels, listed in the ``profile`` table (the five
kernels with the most GPU time per row). For the register rows the ``stages`` table splits
the profiled call by register()'s named stages (:data:`STAGES`): each stage's wall, the
kernel time that ran inside it, its launches and synchronisations (under the profiler,
whose overhead inflates the walls). Rows (issue 23's targets):

* ``register bunny``: ``register()`` on the bundled bun045 -> bun000 pair (40k points);
* ``register KITTI``: the KITTI 00 pair of ``../shared/data/lidar`` (about 125k points);
* ``icp bunny``: point-to-point ``icp()`` from the identity, 5 cm, its default stopping rule;
* ``icp 1M``: point-to-point ``icp()`` on a 1M-point upsampled bunny pair at 10 degrees;
* ``EM-ICP 5k / 40k``, ``Softassign 5k``: the subsampled bunny pairs of bench_soft.

Run (before/after: the same file against an older tree on PYTHONPATH)::

    python benchmarks/bench_latency.py [--label after] [--out latency.json]
    python benchmarks/bench_latency.py --compare before.json after.json   # -> results/
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_icp import upsample as _upsample  # noqa: E402
from bench_soft import subsample_pair  # noqa: E402
from common import RESULTS, metadata, timeit  # noqa: E402

import pointalign as pa  # noqa: E402
from pointalign import datasets  # noqa: E402

#: issue 23's warm targets (ms)
TARGETS = {"register bunny": 15.0, "register KITTI": 20.0, "icp bunny": 10.0,
           "icp 1M": 33.0, "EM-ICP 5k": 3.0, "EM-ICP 40k": 60.0, "Softassign 5k": 45.0}

_LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cudaLaunchKernelExC",
           "cuLaunchKernelEx")
_SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def rows(dev: torch.device):
    """(name, call) per row; inputs are built and moved to ``dev`` once."""
    pair = datasets.load_bunny_pair()
    s, t = pair.source.to(dev), pair.target.to(dev)
    yield "register bunny", lambda: pa.register(s, t, seed=0)
    data = datasets.shared_data_dir()
    kdir = None if data is None else data / "lidar" / "kitti_00"
    if kdir is not None and (kdir / "000000_xyz.bin").is_file():
        def kb(i: int) -> torch.Tensor:
            a = np.fromfile(kdir / f"00000{i}_xyz.bin", dtype=np.float32).reshape(-1, 3)
            return torch.from_numpy(a.copy()).to(dev)
        ks, kt = kb(1), kb(0)
        yield "register KITTI", lambda: pa.register(ks, kt, seed=0)
    yield "icp bunny", lambda: pa.icp(s, t, max_correspondence_distance=0.05, device=dev)
    big = datasets.make_pair(_upsample(pair.target, 1_000_000, 5e-4, 1_000_000), 10.0, 0.02,
                             noise=5e-4, seed=0)
    bs, bt = big.source.to(dev), big.target.to(dev)
    yield "icp 1M", lambda: pa.icp(bs, bt, max_correspondence_distance=0.05, device=dev)
    for n in (5000, 40000):
        x, y = (c.to(dev) for c in subsample_pair(n)[:2])
        yield f"EM-ICP {n // 1000}k", lambda x=x, y=y: pa.emicp(x, y, device=dev)
    x, y = (c.to(dev) for c in subsample_pair(5000)[:2])
    yield "Softassign 5k", lambda: pa.softassign(x, y, device=dev)


#: register()'s stages, as (module, function) the pipeline calls through that module's
#: namespace: wrapped in profiler ranges for the profiled call of the register rows
STAGES = (("registration.voxel_rule", "voxel_size"), ("registration.pipeline", "prepare_both"),
          ("kernels.ransac", "feature_matches"), ("registration.pipeline", "ransac"),
          ("registration.pipeline", "rank_correspondences"),
          ("registration.pipeline", "compatibility_hypotheses"),
          ("registration.pipeline", "_refine_hypotheses"),
          ("registration.pipeline", "_final_clouds"), ("registration.pipeline", "_final_icp"),
          ("registration.pipeline", "verdict"), ("registration.pipeline", "decided_result"))


@contextlib.contextmanager
def _stage_ranges(stages):
    """Wrap each ``(module, function)`` of ``stages`` in a profiler range named after it."""
    import importlib

    from torch.profiler import record_function

    saved = []
    for mod_name, fn_name in stages:
        mod = importlib.import_module("pointalign." + mod_name)
        fn = getattr(mod, fn_name)

        def wrapped(*a, _fn=fn, _name=fn_name, **k):
            with record_function("stage " + _name):
                return _fn(*a, **k)

        saved.append((mod, fn_name, fn))
        setattr(mod, fn_name, wrapped)
    try:
        yield
    finally:
        for mod, fn_name, fn in saved:
            setattr(mod, fn_name, fn)


def _stage_table(prof) -> list[dict]:
    """Per profiler range ``stage …``: wall, kernel time inside it, launches, syncs."""
    ev = list(prof.events())
    ranges = [e for e in ev if e.name.startswith("stage ")
              and e.device_type == torch.autograd.DeviceType.CPU]
    kernels = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith("stage ")]  # (the ranges' own GPU-side spans)
    host = [e for e in ev if e.name in _LAUNCH or e.name in _SYNC]
    out = []
    for r in sorted(ranges, key=lambda e: e.time_range.start):
        a, b = r.time_range.start, r.time_range.end
        busy = sum(max(0.0, min(b, k.time_range.end) - max(a, k.time_range.start))
                   for k in kernels)
        inside = [h for h in host if a <= h.time_range.start <= b]
        out.append({"stage": r.name[6:], "start_ms": None, "wall_ms": round((b - a) / 1e3, 3),
                    "gpu_busy_ms": round(busy / 1e3, 3),
                    "launches": sum(h.name in _LAUNCH for h in inside),
                    "syncs": sum(h.name in _SYNC for h in inside), "_start": a})
    t0 = min((s["_start"] for s in out), default=0.0)
    for s in out:
        s["start_ms"] = round((s.pop("_start") - t0) / 1e3, 3)
    return out


def profile_call(fn, stages=()) -> dict:
    """Count kernels, launches and synchronisations of one call; its busiest kernels.

    ``stages``: ``(module, function)`` pairs to time inside the call (:data:`STAGES`):
    returned as ``stages``, one entry per call of each, in order.
    """
    from torch.profiler import ProfilerActivity, profile

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with _stage_ranges(stages), profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    kernels = launches = syncs = 0
    busy_us = 0.0
    per_kernel: dict[str, float] = {}
    for e in prof.events():
        if e.name.startswith("stage "):  # the stage ranges, and their GPU-side spans
            continue
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            us = e.time_range.elapsed_us()
            busy_us += us
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + us
        elif e.name in _LAUNCH:
            launches += 1
        elif e.name in _SYNC:
            syncs += 1
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:5]
    iters = getattr(result, "iterations", None)
    return {"kernels": kernels, "launches": launches, "syncs": max(syncs - 1, 0),  # -1: ours
            "gpu_busy_ms": round(busy_us / 1e3, 3), "iterations": iters,
            "top": [(name[:60], round(us / 1e3, 3)) for name, us in top],
            "stages": _stage_table(prof) if stages else []}


def run(args) -> None:
    dev = torch.device("cuda")
    out = {"label": args.label, "meta": metadata(dev), "rows": {}}
    for name, fn in rows(dev):
        tm = timeit(fn, warmup=2, repeat=args.repeat, device=dev)
        prof = profile_call(fn, STAGES if name.startswith("register") else ())
        out["rows"][name] = {"median_ms": 1e3 * tm["median_s"], "iqr_ms": 1e3 * tm["iqr_s"],
                             **prof}
        print(f"{args.label:>7} {name:<16} {1e3 * tm['median_s']:8.2f} ms  "
              f"kernels {prof['kernels']:5d} launches {prof['launches']:5d} "
              f"syncs {prof['syncs']:4d} busy {prof['gpu_busy_ms']:.2f} ms", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


def compare(paths: list[str], base: str) -> None:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    by = {lab: [r for r in runs if r["label"] == lab] for lab in ("before", "after")}
    table, profile, stages = [], [], []
    for name, target in TARGETS.items():
        if not all(name in r["rows"] for r in runs):
            continue
        a = by["after"][0]["rows"][name]
        med_a = statistics.median(r["rows"][name]["median_ms"] for r in by["after"])
        row = {"row": name, "target_ms": target}
        if by["before"]:
            b = by["before"][0]["rows"][name]
            med_b = statistics.median(r["rows"][name]["median_ms"] for r in by["before"])
            row.update(before_ms=round(med_b, 2), before_launches=b["launches"],
                       before_syncs=b["syncs"])
        row.update(after_ms=round(med_a, 2), kernels=a["kernels"], launches=a["launches"],
                   syncs=a["syncs"], gpu_busy_ms=a["gpu_busy_ms"],
                   host_bound_ms=round(med_a - a["gpu_busy_ms"], 2),
                   iterations=a["iterations"], vs_target=round(med_a / target, 2))
        table.append(row)
        profile += [{"row": name, "kernel": k, "gpu_ms": ms} for k, ms in a["top"]]
        before_stages = by["before"][0]["rows"][name].get("stages", []) if by["before"] else []
        for i, st in enumerate(a.get("stages", [])):
            old = before_stages[i] if i < len(before_stages) and \
                before_stages[i]["stage"] == st["stage"] else {}
            stages.append({"row": name, **st, "before_wall_ms": old.get("wall_ms"),
                           "before_launches": old.get("launches"),
                           "before_syncs": old.get("syncs")})
    meta = dict(by["after"][0]["meta"])
    meta["command"] = ("benchmarks/bench_latency.py (before: " + base + "; after: this commit), "
                       "then --compare")
    notes = ("Warm medians (CUDA events, 9 repeats after 2 warm-ups, median of the runs per "
             "label) and one profiled call per row (PyTorch profiler): kernels run, host launch "
             "calls, host synchronisations, summed kernel time (gpu_busy_ms). host_bound_ms = "
             "after_ms - gpu_busy_ms: the time the GPU waited for the host. vs_target = "
             "after_ms / target_ms (issue 23).")
    dest = RESULTS / "latency-cuda.json"
    dest.write_text(json.dumps({"meta": meta, "topic": "latency",
                                "title": "Warm latency against the targets, launches and "
                                         "synchronisations per call (issue 23)",
                                "notes": notes, "rows": table,
                                "tables": {"profile: the five busiest kernels per row": profile,
                                           "stages: register()'s stages in the profiled call "
                                           "(wall and GPU busy inside each, ms)": stages}},
                               indent=1))
    print("wrote", dest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="after")
    ap.add_argument("--out", default="latency.json")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--compare", nargs="*")
    ap.add_argument("--base", default="cd32442", help="--compare: what 'before' was")
    args = ap.parse_args()
    if args.compare:
        compare(args.compare, args.base)
    else:
        run(args)


if __name__ == "__main__":
    main()
