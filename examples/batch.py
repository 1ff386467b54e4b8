"""Register a batch of pairs in one call: padded ``(B, N, 3)`` clouds plus lengths.

Shows: lists of clouds of different sizes are padded by pointalign; one ``pa.icp`` call
returns a batched result (``(B, 4, 4)`` transformations, ``(B,)`` fitness/rmse) that can be
indexed per pair, and each pair's error.

    python examples/batch.py --device cpu
"""

from __future__ import annotations

import argparse

import torch

import pointalign as pa


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--pairs", type=int, default=4)
    args = p.parse_args()

    bunny = pa.datasets.load_bunny("bun000")
    pairs = [pa.datasets.make_pair(pa.datasets.random_subsample(bunny, 1000 + 200 * b, seed=b),
                                   rotation_deg=3.0 + b, translation=0.003, seed=b)
             for b in range(args.pairs)]
    sources = [q.source for q in pairs]   # different sizes: padded inside
    targets = [q.target for q in pairs]
    result = pa.icp(sources, targets, max_correspondence_distance=0.01, device=args.device)
    print(f"batched result: {len(result)} pairs, transformations {result.transformation.shape}")
    for b, q in enumerate(pairs):
        r = result[b]
        rot, trans = pa.metrics.relative_error(r.transformation, q.T_target_source)
        print(f"pair {b}: {len(q.source)} points, {r.iterations} iterations, "
              f"error {rot:.3f} deg / {trans * 1e3:.3f} mm, converged={r.converged}")


if __name__ == "__main__":
    main()
