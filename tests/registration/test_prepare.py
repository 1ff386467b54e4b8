"""registration/prepare.py: both clouds of a pair prepared as one group, as each alone.

On a device :func:`prepare_both` downsamples both clouds by one sort (the points as each
alone, to far below float32's resolution) and describes them by one radius table, one SPFH
and one FPFH launch: the normals and features must equal the cloud's own description bit
for bit (the same arithmetic per row). On the "torch" backend the
grouped description runs through the reference kernels; on the "cpu" backend the clouds
are searched by their own trees (each described alone).
"""

from __future__ import annotations

import pytest
import torch

from pointalign import datasets
from pointalign.kernels import _loop
from pointalign.registration import voxel_rule
from pointalign.registration.options import check
from pointalign.registration.pipeline import Scales
from pointalign.registration.prepare import (
    FEATURE_NEIGHBOURS,
    describe_both,
    describe_cloud,
    prepare_both,
    prepare_cloud,
)
from pointalign.search.brute import BruteForceIndex


def _pair(n: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    p = datasets.make_pair(datasets.random_subsample(datasets.load_bunny("bun000"), n,
                                                     seed=seed), 20.0, 0.02, noise=3e-4,
                           seed=seed)
    s = torch.as_tensor(p.source, dtype=torch.float32, device=device)
    t = torch.as_tensor(p.target, dtype=torch.float32, device=device)
    v, _ = voxel_rule.voxel_size_per_cloud(s, t, check("register", {}))
    return s, t, v


@pytest.mark.parametrize("n", [6000, 1500])
def test_both_as_each_alone(backend, seed, n):
    src, tgt, v = _pair(n, seed, backend.device)
    scales = Scales(v)
    clock = _loop.Clock(torch.device(backend.device))
    both = prepare_both(src, tgt, scales, clock, True, v)
    for got, cloud in zip(both, (src, tgt), strict=True):
        one = prepare_cloud(cloud, scales, clock, "cloud")
        assert got.down.shape[0] >= FEATURE_NEIGHBOURS or n < 2000
        # the group's float64 centroid sums run over both clouds: the points agree to far
        # below float32's resolution (voxel_downsample_many's statement), not by construction
        assert got.down.shape == one.down.shape
        torch.testing.assert_close(got.down, one.down, rtol=0, atol=1e-6 * v)
        assert type(got.index) is type(one.index)
        # on those points, the same arithmetic per row as the cloud described alone
        alone = describe_cloud(got.down, got.index, scales, clock)
        assert torch.equal(got.normals, alone.normals)
        assert torch.equal(got.features, alone.features)
    assert set(clock.timings) >= {"downsample", "index", "describe"}


def test_described_together_as_each_alone(backend, seed):
    """The grouped description itself on every backend (each cloud's own brute-force
    index, as a device's): the concatenation read through shifted indices."""
    src, tgt, v = _pair(3000, seed, backend.device)
    scales = Scales(v)
    clock = _loop.Clock(torch.device(backend.device))
    downs = [prepare_cloud(c, scales, clock, "cloud", describe=False).down for c in (src, tgt)]
    normals, features, again = describe_both(downs[0], downs[1], scales, clock)
    assert again() is None
    for d, n, f in zip(downs, normals, features, strict=True):
        one = describe_cloud(d, BruteForceIndex(d), scales, clock)
        assert torch.equal(n, one.normals) and torch.equal(f, one.features)


def test_described_by_the_program_every_call_and_after_an_overflow(backend, monkeypatch):
    """describe_both is one program, eager at a size's first call and a CUDA graph from the
    second (on a GPU): every call gives each cloud's own description, bit for bit. A
    neighbourhood wider than its table (reported here past DESCRIBE_WIDTH) searches again:
    the same description; deferred (describe_both's ``defer``, prepare_both's ``pending``),
    when the check is asked for, and only then."""
    from pointalign.registration import prepare

    src, tgt, v = _pair(3000, 1, backend.device)
    scales = Scales(v)
    clock = _loop.Clock(torch.device(backend.device))
    downs = [prepare_cloud(c, scales, clock, "cloud", describe=False).down for c in (src, tgt)]
    alone = [describe_cloud(d, BruteForceIndex(d), scales, clock) for d in downs]

    def check(overflow):
        normals, features, _ = describe_both(downs[0], downs[1], scales, clock)
        for one, n, f in zip(alone, normals, features, strict=True):
            assert torch.equal(n, one.normals) and torch.equal(f, one.features)
        # deferred: the table's description now, the check when asked (the search again
        # where it overflowed)
        *_, again = describe_both(downs[0], downs[1], scales, clock, defer=True)
        redo = again()
        assert (redo is not None) == overflow
        if redo is not None:
            for one, n, f in zip(alone, *redo, strict=True):
                assert torch.equal(n, one.normals) and torch.equal(f, one.features)
        pending = []
        both = prepare_both(src, tgt, scales, clock, True, v, pending=pending)
        assert len(pending) <= 1  # none where the clouds are described one by one
        redo = pending[0]() if pending else None
        assert (redo is not None) == (overflow and bool(pending))
        for got in redo or both:
            ref = describe_cloud(got.down, got.index, scales, clock)
            assert torch.equal(got.normals, ref.normals)
            assert torch.equal(got.features, ref.features)

    _loop.clear_caches()
    for _ in range(3):
        check(False)
    real = prepare.radius_pair_at_width
    monkeypatch.setattr(prepare, "radius_pair_at_width", lambda *a: (
        lambda d, i, w: (d, i, w + prepare.DESCRIBE_WIDTH + 1))(*real(*a)))
    _loop.clear_caches()
    for _ in range(3):
        check(True)


def test_both_without_features_and_too_coarse(backend):
    src, tgt, v = _pair(1500, 0, backend.device)
    clock = _loop.Clock(torch.device(backend.device))
    for p in prepare_both(src, tgt, Scales(v), clock, False, v):
        assert p.normals.shape == (0, 3) and p.features.shape == (0, 33)
    with pytest.raises(ValueError, match="leaves 1 source point"):
        prepare_both(src, tgt, Scales(1e3), clock, True, 1e3)
