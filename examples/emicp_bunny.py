"""EM-ICP and Softassign on the Stanford bunny: align bun045 to bun000 from the identity.

Shows: ``pointalign.registration.soft.emicp`` (multi-scale EM-ICP, the seed code's schedule
scaled from the data) and ``softassign`` on random subsamples of two real range scans with
partial overlap, started from the identity (true motion 34.3°, 53 mm), where plain ICP
needs a good initial guess; then the errors against the ground truth (bun.conf). The soft
correspondence matrix is never stored: memory grows as N + M.

    python examples/emicp_bunny.py --device cpu --points 300
    python examples/emicp_bunny.py --device cuda --points 20000
"""

from __future__ import annotations

import argparse

import torch

from pointalign import datasets, metrics
from pointalign.registration.soft import emicp, softassign


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--points", type=int, default=None,
                   help="points per scan (default: 5000 on CUDA, 200 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    n = args.points or (5000 if args.device.startswith("cuda") else 200)

    pair = datasets.load_bunny_pair()
    src = datasets.random_subsample(pair.source, n, seed=args.seed)
    tgt = datasets.random_subsample(pair.target, n, seed=args.seed + 1)
    rot0, trans0 = metrics.relative_error(torch.eye(4, dtype=torch.float64),
                                          pair.T_target_source)
    print(f"{pair.name}: {n} + {n} points, device {args.device}")
    print(f"identity start: rotation error {rot0:.2f} deg, translation error "
          f"{trans0 * 1e3:.1f} mm")
    runs = [("EM-ICP", lambda: emicp(src, tgt, device=args.device))]
    if n <= 2000 or args.device.startswith("cuda"):
        # the short schedule keeps the CPU run to seconds; on CUDA use the seed's
        kw = {} if args.device.startswith("cuda") else dict(
            temperatures=20, beta_factor=1.45, iterations_per_temperature=3,
            sinkhorn_iterations=2)
        runs.append(("Softassign", lambda: softassign(src, tgt, device=args.device, **kw)))
    for name, fn in runs:
        res = fn()
        rot, trans = metrics.relative_error(res.transformation, pair.T_target_source)
        print(f"{name:10s}: rotation error {rot:.2f} deg, translation error "
              f"{trans * 1e3:.2f} mm; {res.summary()}")


if __name__ == "__main__":
    main()
