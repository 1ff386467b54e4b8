"""Global registration from an arbitrary pose: FPFH + parallel RANSAC, then ICP.

Shows: ``pa.register`` needs no initial guess; its stages (downsample, normals, FPFH,
RANSAC, ICP) and their timings; the RANSAC-only result (``refine="none"``) next to the
refined one; the error against the ground truth.

    python examples/global_registration.py --device cpu
"""

from __future__ import annotations

import argparse

import torch

import pointalign as pa


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--points", type=int, default=4000, help="points per cloud")
    args = p.parse_args()

    bunny = pa.datasets.load_bunny("bun000")
    bunny = pa.datasets.random_subsample(bunny, args.points, seed=0)
    pair = pa.datasets.make_pair(bunny, rotation_deg=120.0, translation=0.05,
                                 noise=0.0002, overlap=0.8, seed=3)
    print(f"{len(pair.source)} -> {len(pair.target)} points, true motion 120 deg / 5 cm")
    for refine in ("none", "point_to_plane"):
        res = pa.register(pair.source, pair.target, refine=refine, device=args.device)
        rot, trans = pa.metrics.relative_error(res.transformation, pair.T_target_source)
        stages = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in res.timings.items()
                           if "." not in k)
        label = "RANSAC only " if refine == "none" else "RANSAC + ICP"
        print(f"{label}: error {rot:.3f} deg, {trans * 1e3:.2f} mm; fitness "
              f"{float(res.fitness):.3f}; {stages}")


if __name__ == "__main__":
    main()
