"""Precision far from the origin: each method on the bunny pair shifted by 10³-10⁶ m.

3,000 points of ``bun000`` (ICP and EM-ICP: 8° / 1 cm apart; ``register``: 30° / 2 cm; 0.3 mm
noise), shifted by ``(o, −o/2, o/4)``, against the unshifted run shifted back. ``rot``: the
angle of ``R_far R_refᵀ`` (rad); ``pts_over_extent``: the largest difference between the
two poses' images of the shifted source points over the extent (0.15 m); ``converged``:
the far run's verdict. Float64 input, then the same coordinates rounded to float32.

    python benchmarks/bench_precision.py --device cuda
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Recorder, parse_args  # noqa: E402

from pointalign import datasets, emicp, icp, register  # noqa: E402
from pointalign.registration.criteria import ConvergenceCriteria  # noqa: E402

OFFSETS = (1e3, 1e4, 1e5, 5e5, 1e6)


def _shift(T: np.ndarray, o: np.ndarray) -> np.ndarray:
    S, Si = np.eye(4), np.eye(4)
    S[:3, 3], Si[:3, 3] = o, -o
    return S @ T @ Si


def errors(far, ref, s: torch.Tensor, o: np.ndarray) -> tuple[float, float]:
    """(rotation difference in rad, largest point difference over the extent)."""
    B = _shift(ref.transformation, o)
    dR = far.transformation[:3, :3] @ B[:3, :3].T
    ang = float(np.arccos(np.clip((np.trace(dR) - 1) / 2, -1, 1)))
    x = s.numpy() + o
    ext = float(np.ptp(s.numpy(), axis=0).max())

    def moved(T):
        return x @ T[:3, :3].T + T[:3, 3]

    return ang, float(np.abs(moved(far.transformation) - moved(B)).max() / ext)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0]).parse_args()
    dev = args.device
    rec = Recorder("precision", dev, title="Precision far from the origin",
                   notes=__doc__.split("\n\n")[1].replace("\n", " "))
    b = datasets.random_subsample(datasets.load_bunny("bun000"), 3000, 0)
    near = datasets.make_pair(b, 8.0, 0.01, noise=3e-4, seed=1)
    wide = datasets.make_pair(b, 30.0, 0.02, noise=3e-4, seed=1)
    crit = ConvergenceCriteria(max_iterations=30)
    runs = {
        "icp point_to_point": (near, lambda s, t: icp(
            s, t, max_correspondence_distance=0.02, criteria=crit, device=dev)),
        "icp point_to_plane": (near, lambda s, t: icp(
            s, t, max_correspondence_distance=0.02, method="point_to_plane", criteria=crit,
            device=dev)),
        "emicp": (near, lambda s, t: emicp(s[::3], t[::3], device=dev)),
        "register": (wide, lambda s, t: register(s, t, device=dev)),
    }
    for name, (pair, f) in runs.items():
        s, t = pair.source.double(), pair.target.double()
        ref = f(s, t)
        for off in OFFSETS:
            o = np.array([off, -0.5 * off, 0.25 * off])
            ot = torch.from_numpy(o)
            row = {"method": name, "offset_m": off}
            for dt, tag in ((torch.float64, "f64"), (torch.float32, "f32")):
                far = f((s + ot).to(dt), (t + ot).to(dt))
                rot, pts = errors(far, ref, s, o)
                row.update({f"{tag}_rot": rot, f"{tag}_pts_over_extent": pts,
                            f"{tag}_converged": bool(far.converged)})
            rec.add(**row)
    rec.save()


if __name__ == "__main__":
    main()
