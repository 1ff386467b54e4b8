"""Where a call's GPU memory peak goes: replay a ``torch.cuda.memory`` trace, group by line.

For ``icp`` and ``register`` on two synthetic surfaces of N points (``bench_memory``'s),
the blocks alive at the peak of one warm call, summed by the first three pointalign frames
that allocated them::

    python benchmarks/trace_memory.py 1e7
"""

from __future__ import annotations

import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_memory import pose, surface  # noqa: E402

import pointalign as pa  # noqa: E402


def peak_blocks(fn) -> tuple[int, collections.Counter]:
    """Peak bytes of one ``fn()`` above its start, and the live bytes at it by call site."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    fn()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, tuple[int, list]] = {}
    total = best = 0
    at: dict[int, tuple[int, list]] = {}
    for ev in snap["device_traces"][0]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", []))
            total += ev["size"]
            if total > best:
                best, at = total, dict(live)
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    sites: collections.Counter = collections.Counter()
    for size, frames in at.values():
        ours = [f for f in frames if "pointalign" in f["filename"]]
        key = " <- ".join(f'{f["filename"].split("/")[-1]}:{f["line"]}' for f in ours[:3])
        sites[key or "?"] += size
    return best, sites


def main() -> None:
    n = int(float(sys.argv[1])) if len(sys.argv) > 1 else 10_000_000
    T = pose("cuda")
    src = surface(n, 1, "cuda")
    tgt = pa.transforms.apply(T, surface(n, 2, "cuda").double()).float()
    nrm = pa.estimate_normals(tgt, k=16, device="cuda")
    calls = {
        "icp": lambda: pa.icp(src, tgt, init=T, target_normals=nrm, method="point_to_plane",
                              max_correspondence_distance=0.5, device="cuda"),
        "register": lambda: pa.register(src, tgt, device="cuda"),
    }
    for name, fn in calls.items():
        fn()  # warm: compiled kernels, cached graphs
        best, sites = peak_blocks(fn)
        print(f"== {name} n={n}: peak {best / 2**30:.2f} GiB above the start ({best / n:.0f} B/pt)")
        for key, size in sites.most_common(14):
            print(f"  {size / 2**30:7.3f} GiB {size / n:6.0f} B/pt  {key}")


if __name__ == "__main__":
    main()
