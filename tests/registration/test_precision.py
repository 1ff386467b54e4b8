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
    ot = torch.from_numpy(o)
    x = (s + ot).numpy()
    moved = lambda T: x @ T[:3, :3].T + T[:3, 3]  # noqa: E731
    extent = float(np.ptp(s.numpy(), axis=0).max())
    kw = dict(max_correspondence_distance=0.02, method=method, criteria=CRIT, device="cpu")
    ref = icp(s, t, acceleration=False, **kw)
    far = icp(s + ot, t + ot, acceleration=False, **kw)
    assert far.iterations == ref.iterations and far.converged == ref.converged
    back = _shift(ref.transformation, o)
    # the two poses move every (shifted) source point to the same place, to 1e-6 of the
    # cloud's extent (the rotation alone differs by ~1e-9 rad: float32 rounding)
    assert np.abs(moved(far.transformation) - moved(back)).max() <= 1e-6 * extent
    assert abs(far.rmse - ref.rmse) <= 1e-6 * ref.rmse
    if method == "point_to_point":
        # accelerated (the default): the extrapolation and the safeguard's energy test
        # amplify that rounding (at 10⁶ m one step more, measured 1.4e-5 of the extent),
        # within what the relative-change rule (1e-6) resolves
        ref = icp(s, t, **kw)
        far = icp(s + ot, t + ot, **kw)
        assert ref.converged and far.converged and abs(far.iterations - ref.iterations) <= 2
        back = _shift(ref.transformation, o)
        assert np.abs(moved(far.transformation) - moved(back)).max() <= 1e-4 * extent
        assert abs(far.rmse - ref.rmse) <= 1e-4 * ref.rmse


@pytest.mark.parametrize(("offset", "coarse"), [(1e3, False), (1e5, True)])
def test_float32_far_from_origin_is_not_converged(small_pair, offset, coarse):
    """Float32 coordinates at 10⁵ m are rounded to ~8 mm (5 % of the bunny): a settled
    iteration there says ``coarse_input``, not converged; at 10³ m (0.1 mm) it converges."""
    s, t = small_pair
    ot = torch.tensor([offset, -0.5 * offset, 0.25 * offset], dtype=torch.float64)
    far = icp((s + ot).float(), (t + ot).float(), max_correspondence_distance=0.02,
              criteria=CRIT, device="cpu")
    assert far.converged is not coarse
    if coarse:
        assert far.stop_reason == "coarse_input" and "input_resolution" in far.info


# ---- register() on the edge: the whole pipeline far from the origin --------------------

REGISTER_KW = dict(target_points=300, hypotheses=1024, max_iterations=15)
_REFS: dict = {}


@pytest.fixture(scope="module")
def register_pair():
    p = datasets.make_pair(datasets.random_subsample(datasets.load_bunny("bun000"), 700, 0),
                           30.0, 0.02, noise=3e-4, seed=1)
    return p.source.double(), p.target.double()


def _register_far(pair, offset, device):
    from pointalign import register

    s, t = pair
    if device not in _REFS:  # the unshifted run, once per device
        _REFS[device] = register(s, t, device=device, **REGISTER_KW)
    ref = _REFS[device]
    o = np.array([offset, -0.5 * offset, 0.25 * offset])
    ot = torch.from_numpy(o)
    far = register(s + ot, t + ot, device=device, **REGISTER_KW)
    assert far.converged == ref.converged and ref.converged
    back = _shift(ref.transformation, o)
    x = (s + ot).numpy()
    moved = lambda T: x @ T[:3, :3].T + T[:3, 3]  # noqa: E731
    extent = float(np.ptp(s.numpy(), axis=0).max())
    assert np.abs(moved(far.transformation) - moved(back)).max() <= 1e-6 * extent
    # the nested global result is in the caller's coordinates too
    g_back = _shift(ref.info["global"].transformation, o)
    assert np.abs(moved(far.info["global"].transformation) - moved(g_back)).max() \
        <= 1e-6 * extent


@pytest.mark.parametrize("offset", OFFSETS)
def test_register_far_from_origin_equals_unshifted(register_pair, offset):
    _register_far(register_pair, offset, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("offset", OFFSETS)
def test_register_far_from_origin_equals_unshifted_cuda(register_pair, offset):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _register_far(register_pair, offset, "cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_ransac_far_from_origin_is_in_callers_coordinates(device):
    """ransac() alone (features from the unshifted clouds) at 10⁶ m: the same motion."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pointalign import fpfh, ransac
    from pointalign.features.normals import estimate_normals

    pts = datasets.random_subsample(datasets.load_bunny("bun000"), 800, 0).double()
    p = datasets.make_pair(pts, 30.0, 0.01, seed=2)
    s, t = p.source.double(), p.target.double()
    feats = [fpfh(c.float(), radius=0.025, normals=estimate_normals(c.float(), k=15))
             for c in (s, t)]
    kw = dict(source_features=feats[0], target_features=feats[1], device=device,
              max_correspondence_distance=0.006, hypotheses=2048, seed=3)
    ref = ransac(s, t, **kw)
    o = np.array([1e6, -5e5, 2.5e5])
    far = ransac(s + torch.from_numpy(o), t + torch.from_numpy(o), **kw)
    assert far.fitness == pytest.approx(ref.fitness, abs=0.02)
    x = s.numpy() + o
    moved = lambda T: x @ T[:3, :3].T + T[:3, 3]  # noqa: E731
    err = np.abs(moved(far.transformation) - moved(_shift(ref.transformation, o))).max()
    assert err <= 1e-3 * float(np.ptp(s.numpy(), axis=0).max())
