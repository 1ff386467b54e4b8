"""Build the target's search index once and reuse it across many ICP calls.

Shows: ``pa.build_index`` over a fixed target (a map), then ICP of several source scans
against it with ``index=``, so the build cost is paid once; the timings per call.

    python examples/index_reuse.py --device cpu
"""

from __future__ import annotations

import argparse
import time

import torch

import pointalign as pa


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--scans", type=int, default=3)
    args = p.parse_args()

    target = pa.datasets.random_subsample(pa.datasets.load_bunny("bun000"), 5000, seed=0)
    target = target.to(args.device)
    t0 = time.perf_counter()
    index = pa.build_index(target, device=args.device)
    print(f"index {type(index).__name__} over {len(target)} points built in "
          f"{(time.perf_counter() - t0) * 1e3:.1f} ms")
    for k in range(args.scans):
        pair = pa.datasets.make_pair(target.cpu(), rotation_deg=4.0, translation=0.004,
                                     overlap=0.9, seed=10 + k)
        t0 = time.perf_counter()
        res = pa.icp(pair.source.to(args.device), target, index=index,
                     max_correspondence_distance=0.01, device=args.device)
        rot, trans = pa.metrics.relative_error(res.transformation, pair.T_target_source)
        print(f"scan {k}: {(time.perf_counter() - t0) * 1e3:.1f} ms with the shared index, "
              f"error {rot:.3f} deg / {trans * 1e3:.3f} mm")


if __name__ == "__main__":
    main()
