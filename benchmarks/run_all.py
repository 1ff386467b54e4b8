"""Run every ``benchmarks/bench_*.py`` for one device, then ``benchmarks/render.py``.

On the CPU each benchmark runs with ``--quick`` (a smoke run) unless ``--full`` is given;
on CUDA at full size. A failing benchmark is reported and the others still run.

    python benchmarks/run_all.py                     # current device (cuda if available)
    python benchmarks/run_all.py --device cpu --full
    python benchmarks/run_all.py --only knn icp
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--full", action="store_true", help="full sizes on the CPU too")
    ap.add_argument("--only", nargs="*", default=None, help="topics, e.g. knn icp")
    args = ap.parse_args()
    quick = args.device.startswith("cpu") and not args.full
    failed = []
    for script in sorted(HERE.glob("bench_*.py")):
        topic = script.stem.removeprefix("bench_")
        if args.only and topic not in args.only:
            continue
        cmd = [sys.executable, str(script), "--device", args.device] + (["--quick"] * quick)
        print("===", " ".join(cmd[1:]), flush=True)
        if subprocess.run(cmd).returncode != 0:
            failed.append(topic)
    subprocess.run([sys.executable, str(HERE / "render.py")], check=True)
    if failed:
        print("failed:", " ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
