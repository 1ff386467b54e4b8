"""Register two LiDAR scans stored as KITTI-style ``.bin`` files (float32 rows).

Shows: ``pa.read_bin`` (x y z [reflectance] rows), voxel downsampling, the global pipeline
``pa.register`` on outdoor data (metres), and the error against a known motion. With
``--kitti DIR`` it reads ``000000_xyz.bin`` / ``000001_xyz.bin`` and the derived ground
truth ``gt_T_velo0_from_velo1.txt`` (KITTI is CC BY-NC-SA: not shipped with pointalign);
without it, a small synthetic street scene (ground, two walls, poles) is scanned from two
poses and written as ``.bin`` files first, so the example runs anywhere in seconds.

    python examples/lidar_pair.py --device cpu
    python examples/lidar_pair.py --kitti ../shared/data/lidar/kitti_00 --device cuda
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import numpy as np
import torch

import pointalign as pa


def street(n: int, rng: np.random.Generator) -> np.ndarray:
    """Points on a ground plane, two building fronts and a row of poles (metres)."""
    k = n // 4
    ground = np.c_[rng.uniform(-30, 30, k), rng.uniform(-8, 8, k), rng.normal(0, 0.02, k)]
    wall1 = np.c_[rng.uniform(-30, 30, k), np.full(k, 8.0) + rng.normal(0, 0.02, k),
                  rng.uniform(0, 6, k)]
    wall2 = np.c_[np.full(k // 2, 30.0) + rng.normal(0, 0.02, k // 2),
                  rng.uniform(-8, 8, k // 2), rng.uniform(0, 6, k // 2)]
    m = n - 3 * k - k // 2
    pole = rng.integers(0, 6, m)
    ang = rng.uniform(0, 2 * math.pi, m)
    poles = np.c_[-25 + 10 * pole + 0.15 * np.cos(ang), -6 + 0.15 * np.sin(ang),
                  rng.uniform(0, 4, m)]
    return np.concatenate([ground, wall1, wall2, poles])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kitti", type=Path, default=None, help="folder with KITTI 00 frames")
    p.add_argument("--voxel", type=float, default=1.0, help="voxel edge in metres")
    args = p.parse_args()

    if args.kitti is not None:
        f0, f1 = args.kitti / "000000_xyz.bin", args.kitti / "000001_xyz.bin"
        target, source = pa.read_bin(f0, columns=3), pa.read_bin(f1, columns=3)
        T_true = np.loadtxt(args.kitti / "gt_T_velo0_from_velo1.txt")
    else:
        rng = np.random.default_rng(0)
        scene = street(6000, rng)
        T_true = np.eye(4)
        c, s = math.cos(math.radians(3)), math.sin(math.radians(3))
        T_true[:2, :2] = [[c, -s], [s, c]]
        T_true[:3, 3] = [0.9, 0.05, 0.02]  # about 1 m forward, as between two frames
        # the second scan sees the scene from the moved sensor: p1 = inv(T) p0
        inv = np.linalg.inv(T_true)
        moved = scene @ inv[:3, :3].T + inv[:3, 3] + rng.normal(0, 0.01, scene.shape)
        out = Path(tempfile.mkdtemp(prefix="pointalign-lidar-"))
        f0, f1 = out / "000000.bin", out / "000001.bin"
        refl = rng.uniform(0, 1, (len(scene), 1))
        np.c_[scene, refl].astype("<f4").tofile(f0)   # KITTI layout: x y z reflectance
        np.c_[moved, refl].astype("<f4").tofile(f1)
        target, source = pa.read_bin(f0, columns=4), pa.read_bin(f1, columns=4)
    print(f"{f1.name}: {len(source)} points -> {f0.name}: {len(target)} points")

    src = pa.voxel_downsample(source.points, args.voxel / 4)
    tgt = pa.voxel_downsample(target.points, args.voxel / 4)
    result = pa.register(src, tgt, voxel_size=args.voxel, device=args.device)
    rot, trans = pa.metrics.relative_error(result.transformation, T_true)
    print(result.summary())
    print(f"error against the known motion: {rot:.3f} deg, {trans:.3f} m "
          f"(voxel {result.info['voxel_size']:.2f} m)")


if __name__ == "__main__":
    main()
