"""Georeferenced coordinates keep their precision (issue #16, item 1).

The bunny pair shifted far from the origin (float64 input, as survey and LiDAR users have
it) must register exactly as the unshifted pair: the shift is undone in float64 at the edge.
"""

import numpy as np
import pytest
import torch

from pointalign import datasets, icp
from pointalign.registration.criteria import ConvergenceCriteria

OFFSETS = [1e3, 1e4, 1e5, 5e5, 1e6]
CRIT = ConvergenceCriteria(max_iterations=30)


def _shift(T: np.ndarray, o: np.ndarray) -> np.ndarray:
    """T between frames shifted by +o: Tr(o) T Tr(-o)."""
    S = np.eye(4)
    S[:3, 3] = o
    Si = np.eye(4)
    Si[:3, 3] = -o
    return S @ T @ Si


@pytest.fixture(scope="module")
def small_pair():
    p = datasets.make_pair(datasets.random_subsample(datasets.load_bunny("bun000"), 3000, 0),
                           8.0, 0.01, noise=3e-4, seed=1)
    return p.source.double(), p.target.double()


@pytest.mark.parametrize("method", ["point_to_point", "point_to_plane"])
@pytest.mark.parametrize("offset", OFFSETS)
def test_icp_far_from_origin_equals_unshifted(small_pair, method, offset):
    s, t = small_pair
    o = np.array([offset, -0.5 * offset, 0.25 * offset])
    ref = icp(s, t, max_correspondence_distance=0.02, method=method, criteria=CRIT,
              device="cpu")
    ot = torch.from_numpy(o)
    far = icp(s + ot, t + ot, max_correspondence_distance=0.02, method=method, criteria=CRIT,
              device="cpu")
    assert far.iterations == ref.iterations and far.converged == ref.converged
    back = _shift(ref.transformation, o)
    # the two poses move every (shifted) source point to the same place, to 1e-6 of the
    # cloud's extent (the rotation alone differs by ~1e-9 rad: float32 rounding)
    x = (s + ot).numpy()
    moved = lambda T: x @ T[:3, :3].T + T[:3, 3]  # noqa: E731
    extent = float(np.ptp(s.numpy(), axis=0).max())
    assert np.abs(moved(far.transformation) - moved(back)).max() <= 1e-6 * extent
    assert abs(far.rmse - ref.rmse) <= 1e-6 * ref.rmse
